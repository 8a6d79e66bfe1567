//! Deployment files: the Kubernetes manifests must be well-formed objects that give the agent
//! what it needs (host PID namespace, capabilities, mounts that exist, options the binaries
//! accept), and, where a Docker daemon can run, an agent image built from a base made here
//! (no registry is reachable) must record a workload from inside its container.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use pyrometer_e2e::*;
use serde_json::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The YAML documents of a manifest, parsed by PyYAML (Debian's python3-yaml) into JSON.
fn load_yaml(path: &Path) -> Vec<Value> {
    let out = Command::new("python3")
        .args([
            "-c",
            "import json, sys, yaml; json.dump(list(yaml.safe_load_all(open(sys.argv[1]))), sys.stdout)",
        ])
        .arg(path)
        .output()
        .expect("run python3 (cargo xtask deps installs python3-yaml)");
    assert!(
        out.status.success(),
        "{} is not valid YAML: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("json from python")
}

fn str_list(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

/// The `--long` options a command's `--help` lists.
fn help_options(bin: &Path, args: &[&str]) -> BTreeSet<String> {
    let out = Command::new(bin)
        .args(args)
        .arg("--help")
        .output()
        .expect("run --help");
    String::from_utf8_lossy(&out.stdout)
        .split(|c: char| c.is_whitespace() || c == ',')
        .filter(|w| w.starts_with("--"))
        .map(|w| w.split(['=', '<']).next().unwrap_or(w).to_string())
        .collect()
}

/// Every `--flag` of `args` must be an option `--help` lists.
fn assert_known_flags(args: &[String], known: &BTreeSet<String>, what: &str) {
    for arg in args.iter().filter(|a| a.starts_with("--")) {
        let flag = arg.split('=').next().unwrap_or(arg);
        assert!(
            known.contains(flag),
            "{what}: {flag} is not an option ({known:?})"
        );
    }
}

/// Checks a pod template: mounts name declared volumes, the selector matches the labels.
fn check_pod(object: &Value, kind: &str) -> Value {
    let spec = &object["spec"];
    let labels = &spec["template"]["metadata"]["labels"];
    for (k, v) in spec["selector"]["matchLabels"]
        .as_object()
        .expect("a selector")
    {
        assert_eq!(
            &labels[k], v,
            "{kind}: selector {k} does not match the pod's labels"
        );
    }
    let pod = spec["template"]["spec"].clone();
    let mut volumes: BTreeSet<String> = pod["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v["name"].as_str().map(String::from))
        .collect();
    for claim in spec["volumeClaimTemplates"]
        .as_array()
        .into_iter()
        .flatten()
    {
        volumes.insert(
            claim["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .into(),
        );
    }
    for c in pod["containers"].as_array().expect("containers") {
        for m in c["volumeMounts"].as_array().into_iter().flatten() {
            let name = m["name"].as_str().unwrap_or_default();
            assert!(volumes.contains(name), "{kind}: mount {name} has no volume");
            assert!(m["mountPath"].as_str().is_some_and(|p| p.starts_with('/')));
        }
    }
    pod
}

#[test]
fn kubernetes_manifests_give_the_agent_what_it_needs() {
    let dir = root().join("deploy/kubernetes");
    let mut objects = Vec::new();
    for name in ["namespace.yaml", "collector.yaml", "agent-daemonset.yaml"] {
        objects.extend(load_yaml(&dir.join(name)));
    }
    for o in &objects {
        assert!(o["apiVersion"].is_string() && o["kind"].is_string(), "{o}");
        assert!(o["metadata"]["name"].is_string(), "{o}");
        if o["kind"] != "Namespace" {
            assert_eq!(o["metadata"]["namespace"], "pyrometer", "{}", o["kind"]);
        }
    }
    let find = |kind: &str| {
        objects
            .iter()
            .find(|o| o["kind"] == kind)
            .unwrap_or_else(|| panic!("no {kind}"))
            .clone()
    };
    let pyrometer = pyrometer_bin();
    let collector_bin = pyrometer.with_file_name("pyrometer-collector");

    let ds = find("DaemonSet");
    let pod = check_pod(&ds, "DaemonSet");
    assert_eq!(
        pod["hostPID"], true,
        "the agent must see the host's processes"
    );
    let agent = &pod["containers"][0];
    let sc = &agent["securityContext"];
    assert_eq!(sc["privileged"], false);
    let added: BTreeSet<String> = str_list(&sc["capabilities"]["add"]).into_iter().collect();
    for cap in ["BPF", "PERFMON", "SYS_PTRACE", "DAC_READ_SEARCH"] {
        assert!(added.contains(cap), "the agent needs CAP_{cap}: {added:?}");
    }
    assert_eq!(str_list(&sc["capabilities"]["drop"]), ["ALL"]);
    let args = str_list(&agent["args"]);
    assert_eq!(args[0], "agent");
    assert_known_flags(
        &args[1..],
        &help_options(&pyrometer, &["agent"]),
        "agent args",
    );
    // The config file's keys are the agent's options without the dashes.
    let config = find("ConfigMap");
    let toml = config["data"]["agent.toml"].as_str().expect("agent.toml");
    let keys: Vec<String> = toml
        .lines()
        .filter_map(|l| l.split_once('=').map(|(k, _)| format!("--{}", k.trim())))
        .collect();
    assert!(keys.contains(&"--collector".to_string()), "{toml}");
    assert_known_flags(&keys, &help_options(&pyrometer, &["agent"]), "agent.toml");
    assert!(
        toml.contains("pyrometer-collector.pyrometer.svc:4040"),
        "the agents push to the collector's Service"
    );
    assert!(
        toml.contains("collector = \"https://") && toml.contains("ca = "),
        "the agents push over TLS, checking the collector with the CA: {toml}"
    );

    let sts = find("StatefulSet");
    let pod = check_pod(&sts, "StatefulSet");
    let collector = &pod["containers"][0];
    let collector_args = str_list(&collector["args"]);
    assert_known_flags(
        &collector_args,
        &help_options(&collector_bin, &[]),
        "collector args",
    );
    for needed in ["--tls-cert", "--tls-key", "--token-file"] {
        assert!(
            collector_args.iter().any(|a| a.starts_with(needed)),
            "the collector serves its Service with {needed}: {collector_args:?}"
        );
    }
    let svc = find("Service");
    assert_eq!(
        svc["spec"]["selector"],
        sts["spec"]["template"]["metadata"]["labels"]
    );
    let target = svc["spec"]["ports"][0]["targetPort"].clone();
    assert!(
        collector["ports"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|p| p["name"] == target),
        "the Service's targetPort {target} names a container port"
    );
}

/// The example systemd units start the binaries with options they have, and the collector's
/// serves beyond loopback only with TLS and tokens, with room for every agent's connection.
#[test]
fn systemd_units_use_real_options_and_tls() {
    let pyrometer = pyrometer_bin();
    let collector_bin = pyrometer.with_file_name("pyrometer-collector");
    let unit = |name: &str| std::fs::read_to_string(root().join("deploy").join(name)).unwrap();
    let exec = |text: &str| -> Vec<String> {
        let line = text
            .lines()
            .find_map(|l| l.strip_prefix("ExecStart="))
            .expect("an ExecStart line");
        line.split_whitespace().skip(1).map(String::from).collect()
    };
    let collector = unit("pyrometer-collector.service");
    let args = exec(&collector);
    assert_known_flags(&args, &help_options(&collector_bin, &[]), "collector unit");
    for needed in ["--tls-cert", "--tls-key", "--token-file"] {
        assert!(args.iter().any(|a| a == needed), "{needed}: {args:?}");
    }
    assert!(collector.contains("LimitNOFILE="), "{collector}");
    let agent = unit("pyrometer-agent.service");
    let args = exec(&agent);
    assert_eq!(args[0], "agent");
    assert_known_flags(
        &args[1..],
        &help_options(&pyrometer, &["agent"]),
        "agent unit",
    );
    assert!(agent.contains("collector = \"https://"), "{agent}");
}

/// A dockerd of this test's own (socket, state and data under its scratch directory, no
/// bridge or iptables changes), stopped on drop.
struct Dockerd {
    pid: u32,
    socket: String,
}

impl Dockerd {
    fn start(dir: &Path) -> Result<Dockerd, String> {
        if Command::new("dockerd").arg("--version").output().is_err() {
            return Err("dockerd is not installed (cargo xtask deps installs docker.io)".into());
        }
        // exec-root holds unix sockets: keep its path short.
        let exec_root = format!("/tmp/pyro-dk-{}", std::process::id());
        let socket = format!("unix://{}/docker.sock", dir.display());
        let log = std::fs::File::create(dir.join("dockerd.log")).map_err(|e| e.to_string())?;
        let child = Command::new("dockerd")
            .arg("--data-root")
            .arg(dir.join("data"))
            .args(["--exec-root", &exec_root, "--pidfile"])
            .arg(dir.join("dockerd.pid"))
            .args([
                "-H",
                &socket,
                "--bridge=none",
                "--iptables=false",
                "--ip-masq=false",
            ])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("cannot start dockerd: {e}"))?;
        let d = Dockerd {
            pid: child.id(),
            socket,
        };
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(60) {
            if d.docker(&["info"]).status.success() {
                return Ok(d);
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        let log = std::fs::read_to_string(dir.join("dockerd.log")).unwrap_or_default();
        Err(format!(
            "dockerd did not come up: {}",
            log.lines().last().unwrap_or("no log")
        ))
    }

    fn docker(&self, args: &[&str]) -> std::process::Output {
        Command::new("docker")
            .args(args)
            .env("DOCKER_HOST", &self.socket)
            .env("DOCKER_BUILDKIT", "0")
            .output()
            .expect("run docker")
    }
}

impl Drop for Dockerd {
    fn drop(&mut self) {
        // SAFETY: plain kill(2) of the dockerd this test started.
        unsafe { libc::kill(self.pid as i32, libc::SIGTERM) };
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(20)
            && Path::new(&format!("/proc/{}", self.pid)).exists()
        {
            // Reap it if it is our zombie; ignore otherwise.
            // SAFETY: waitpid on our own child's pid.
            unsafe { libc::waitpid(self.pid as i32, std::ptr::null_mut(), libc::WNOHANG) };
            std::thread::sleep(Duration::from_millis(200));
        }
        let _ = std::fs::remove_dir_all(format!("/tmp/pyro-dk-{}", std::process::id()));
    }
}

/// The shared libraries a binary loads, from ldd: (path as the loader asks for it, real file).
fn libraries(bin: &Path) -> Vec<(PathBuf, PathBuf)> {
    let out = Command::new("ldd").arg(bin).output().expect("run ldd");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            let path = match l.split_once("=>") {
                Some((_, rest)) => rest.split_whitespace().next()?,
                None => l.split_whitespace().next()?,
            };
            path.starts_with('/').then(|| {
                let p = PathBuf::from(path);
                let real = std::fs::canonicalize(&p).unwrap_or_else(|_| p.clone());
                (p, real)
            })
        })
        .collect()
}

fn copy_into(context: &Path, inside: &Path, from: &Path) {
    let dest = context.join(inside.strip_prefix("/").unwrap_or(inside));
    std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
    std::fs::copy(from, &dest).unwrap_or_else(|e| panic!("copy {}: {e}", from.display()));
}

/// A shipped Dockerfile's instructions, continuation lines joined, comments left out.
fn instructions(dockerfile: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(dockerfile).unwrap();
    let mut out = Vec::new();
    let mut line = String::new();
    for l in text.lines().filter(|l| !l.trim_start().starts_with('#')) {
        match l.strip_suffix('\\') {
            Some(head) => line.push_str(head),
            None => {
                line.push_str(l);
                if !line.trim().is_empty() {
                    out.push(line.trim().to_string());
                }
                line.clear();
            }
        }
    }
    out
}

/// The files a runtime stage takes from the build stage:
/// `COPY --from=build /src/target/release/NAME DEST` as (NAME, DEST).
fn build_outputs(stage: &[String]) -> Vec<(String, String)> {
    stage
        .iter()
        .filter_map(|i| {
            let rest = i.strip_prefix("COPY --from=build ")?;
            let (from, dest) = rest.split_once(' ')?;
            let name = from.strip_prefix("/src/target/release/")?;
            Some((name.to_string(), dest.trim().to_string()))
        })
        .collect()
}

/// The stage after a Dockerfile's last `FROM`.
fn last_stage(dockerfile: &Path) -> Vec<String> {
    let all = instructions(dockerfile);
    let from = all
        .iter()
        .rposition(|i| i.starts_with("FROM "))
        .expect("a FROM");
    all[from + 1..].to_vec()
}

/// A shipped Dockerfile's runtime stage on the local image `base`: its build-stage copies
/// from the build context instead (by file name), its `RUN`s left out (they install packages
/// from Debian's mirrors, which a base made here has no apt for). Returns the Dockerfile and
/// the files it copies, as (NAME, DEST).
fn runtime_stage(dockerfile: &Path, base: &str) -> (String, Vec<(String, String)>) {
    let stage = last_stage(dockerfile);
    let files = build_outputs(&stage);
    assert!(
        !files.is_empty(),
        "{} copies nothing built",
        dockerfile.display()
    );
    let mut text = format!("FROM {base}\n");
    for i in &stage {
        if i.starts_with("RUN ") {
            continue;
        }
        match i.strip_prefix("COPY --from=build /src/target/release/") {
            Some(rest) => text.push_str(&format!("COPY {rest}\n")),
            None => text.push_str(&format!("{i}\n")),
        }
    }
    (text, files)
}

/// The JSON array of an `ENTRYPOINT [...]` or `CMD [...]` instruction.
fn exec_form(stage: &[String], what: &str) -> Vec<String> {
    stage
        .iter()
        .find_map(|i| i.strip_prefix(&format!("{what} ")))
        .map(|json| serde_json::from_str(json).expect("exec form"))
        .unwrap_or_default()
}

/// The shipped Dockerfiles (what users build, from a public base) copy files the workspace
/// builds, start a binary they copied, and pass it only options it has.
#[test]
fn shipped_dockerfiles_copy_built_files_and_pass_known_options() {
    let built_dir = pyrometer_bin().parent().unwrap().to_path_buf();
    for (file, subcommand) in [("Dockerfile.agent", true), ("Dockerfile.collector", false)] {
        let path = root().join("deploy").join(file);
        let stage = last_stage(&path);
        let files = build_outputs(&stage);
        assert!(
            !files.is_empty(),
            "{file} copies nothing from its build stage"
        );
        for (name, _) in &files {
            assert!(
                built_dir.join(name).exists(),
                "{file} copies {name}, which the workspace does not build"
            );
        }
        let mut command = exec_form(&stage, "ENTRYPOINT");
        command.extend(exec_form(&stage, "CMD"));
        let program = command.first().expect("an ENTRYPOINT");
        let (name, _) = files
            .iter()
            .find(|(_, dest)| dest == program)
            .unwrap_or_else(|| panic!("{file}: {program} is not one of its copies"));
        let bin = built_dir.join(name);
        let args: Vec<String> = command[1..].to_vec();
        let sub: Vec<&str> = if subcommand {
            vec![args[0].as_str()]
        } else {
            vec![]
        };
        assert_known_flags(&args, &help_options(&bin, &sub), file);
    }
}

#[test]
fn agent_image_records_a_workload_in_its_container() {
    if !privileged() {
        return;
    }
    let dir = scratch("docker");
    let dockerd = match Dockerd::start(&dir) {
        Ok(d) => d,
        Err(why) => {
            skip("docker", why);
            return;
        }
    };
    // The base: the C library, the loader, libgcc_s and a shell (`record -- CMD` holds the
    // command in `sh` until the kernel filter knows it), FROM scratch.
    let base = dir.join("base");
    let pyrometer = pyrometer_bin();
    let workload = fixture("cpu631");
    let allocs = fixture("allocs");
    for bin in [
        pyrometer.as_path(),
        workload.as_path(),
        allocs.as_path(),
        Path::new("/bin/sh"),
    ] {
        for (path, real) in libraries(bin) {
            copy_into(&base, &path, &real);
        }
    }
    copy_into(
        &base,
        Path::new("/bin/sh"),
        &std::fs::canonicalize("/bin/sh").unwrap(),
    );
    std::fs::write(base.join("Dockerfile"), "FROM scratch\nCOPY . /\n").unwrap();
    let tag = format!("pyrometer-e2e-base:{}", std::process::id());
    let built = dockerd.docker(&["build", "-q", "-t", &tag, base.to_str().unwrap()]);
    assert!(built.status.success(), "base image: {}", stderr(&built));
    // The agent image: deploy/Dockerfile.agent's runtime stage on that base, with this
    // build's binaries where it copies the build stage's, and the workload beside them.
    let ctx = dir.join("agent");
    let (stage, files) = runtime_stage(&root().join("deploy/Dockerfile.agent"), &tag);
    let built_dir = pyrometer.parent().unwrap();
    std::fs::create_dir_all(&ctx).unwrap();
    for (name, _) in &files {
        let from = built_dir.join(name);
        assert!(from.exists(), "{} is not built", from.display());
        std::fs::copy(&from, ctx.join(name)).unwrap();
    }
    copy_into(&ctx, Path::new("/usr/local/bin/cpu631"), &workload);
    copy_into(&ctx, Path::new("/usr/local/bin/allocs"), &allocs);
    std::fs::write(ctx.join("Dockerfile"), format!("{stage}COPY usr /usr\n")).unwrap();
    let image = format!("pyrometer-e2e-agent:{}", std::process::id());
    let built = dockerd.docker(&["build", "-q", "-t", &image, ctx.to_str().unwrap()]);
    assert!(built.status.success(), "agent image: {}", stderr(&built));

    // Debian's Docker (20.10) does not know CAP_BPF and CAP_PERFMON by name: CAP_SYS_ADMIN
    // grants both. The host PID namespace makes the pids pyrometer sees the kernel's.
    let out = dir.join("out");
    std::fs::create_dir_all(&out).unwrap();
    let volume = format!("{}:/out", out.display());
    let record = |args: &[&str]| {
        let mut all = vec![
            "run",
            "--rm",
            "--pid=host",
            "--network",
            "none",
            "--cap-drop",
            "ALL",
            "--cap-add",
            "SYS_ADMIN",
            "--cap-add",
            "SYS_PTRACE",
            "--cap-add",
            "DAC_READ_SEARCH",
            "--security-opt",
            "seccomp=unconfined",
            "-v",
            &volume,
            &image,
            "record",
        ];
        all.extend_from_slice(args);
        dockerd.docker(&all)
    };
    let run = record(&[
        "-F",
        "499",
        "-o",
        "/out/cpu631.folded",
        "--",
        "/usr/local/bin/cpu631",
        "2",
    ]);
    assert!(
        run.status.success(),
        "record in the container: {}",
        stderr(&run)
    );
    let stacks = read_folded(&out.join("cpu631.folded"));
    let shares = relative_shares(&stacks, &["leaf_a", "leaf_b", "leaf_c"]);
    for (leaf, want) in [("leaf_a", 0.6), ("leaf_b", 0.3), ("leaf_c", 0.1)] {
        let got = shares[leaf];
        assert!(
            (got - want).abs() <= 0.10,
            "{leaf}: {:.1} % in the container's recording, expected {:.0} % ± 10 pp ({shares:?})",
            got * 100.0,
            want * 100.0
        );
    }
    // Allocations in process: the image has the binary alone, which writes the library it
    // carries into the container's /var/cache/pyrometer.
    let run = record(&[
        "--alloc",
        "--stats",
        "/out/alloc.json",
        "-o",
        "/out/alloc.pb.gz",
        "--",
        "/usr/local/bin/allocs",
        "totals",
        "0.3",
    ]);
    assert!(
        run.status.success(),
        "record --alloc in the container: {}",
        stderr(&run)
    );
    let stats = pyrometer_e2e::alloc::read_stats(&out.join("alloc.json"));
    assert_eq!(stats["alloc_preload_libraries"], 1, "{stats}");
    assert_eq!(stats["alloc_uprobes"], 0, "{stats}");
    drop(dockerd);
    let _ = std::fs::remove_dir_all(&dir);
}
