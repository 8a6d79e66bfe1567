//! Opting out: a process in a cgroup matching the agent's `--exclude-cgroup` is not profiled
//! (its samples are dropped before anything of it is read, and counted on /metrics), while a
//! process of the same name outside that cgroup is.

use std::process::{Command, Stdio};

use pyrometer_e2e::cluster::{Agent, Collector, free_port, samples_of, workload_of};
use pyrometer_e2e::wait::wait_for;
use pyrometer_e2e::{copy_executable, fixture, privileged, scratch};
use std::time::Duration;

/// A cgroup (v2) made for the test, removed when dropped.
struct Cgroup(std::path::PathBuf);

impl Drop for Cgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// A mounted cgroup hierarchy to make a cgroup in: the unified one (cgroup v2), else the
/// `pids` controller's (a machine with v1 hierarchies).
fn cgroup_root() -> std::path::PathBuf {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let mounts: Vec<(String, String)> = info
        .lines()
        .filter_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let point = left.split_whitespace().nth(4)?.to_string();
            let mut r = right.split_whitespace();
            let fstype = r.next()?.to_string();
            let options = r.nth(1).unwrap_or_default().to_string();
            Some((point, format!("{fstype} {options}")))
        })
        .collect();
    let find = |want: &dyn Fn(&str) -> bool| {
        mounts
            .iter()
            .find(|(_, t)| want(t))
            .map(|(p, _)| std::path::PathBuf::from(p))
    };
    find(&|t| t.starts_with("cgroup2 "))
        .or_else(|| find(&|t| t.starts_with("cgroup ") && t.split(',').any(|o| o == "pids")))
        .expect("a cgroup hierarchy is mounted")
}

#[test]
fn a_process_in_an_excluded_cgroup_is_not_profiled() {
    if !privileged() {
        return;
    }
    let dir = scratch("optout");
    let name = format!("pyrometer-optout-{}", std::process::id());
    let cgroup = Cgroup(cgroup_root().join(&name));
    std::fs::create_dir(&cgroup.0).expect("make a cgroup");
    let collector = Collector::start(&dir.join("store"), free_port(), None);
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let mut agent = Agent::start(
        &dir,
        "optout",
        &collector.url(),
        &[
            "--comm",
            "optout-wl",
            "--exclude-cgroup",
            &name,
            "--metrics-listen",
            &listen,
            "--no-gpu",
        ],
    );
    let addr = listen.parse().unwrap();
    agent.wait_for_metrics(addr);
    // Two processes of the same name: one moves itself into the cgroup before it execs.
    let exe = dir.join("optout-wl");
    copy_executable(&fixture("cpu631"), &exe);
    let mut kept = workload_of("cpu631", &dir, "optout-wl", 60);
    let mut excluded = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "echo $$ > {}/cgroup.procs && exec {} 60",
            cgroup.0.display(),
            exe.display()
        ))
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    agent.wait_for_metric(addr, "pyrometer_agent_opted_out_samples_total", 20.0);
    wait_for(
        Duration::from_secs(60),
        "the process outside the cgroup to be profiled",
        || match samples_of(&collector, "optout", kept.id()) {
            n if n >= 50 => Ok(n),
            n => Err(n),
        },
    );
    assert_eq!(
        samples_of(&collector, "optout", excluded.id()),
        0,
        "the opted-out process was profiled"
    );
    let _ = excluded.kill();
    let _ = excluded.wait();
    let _ = kept.kill();
    let _ = kept.wait();
    agent.stop();
}
