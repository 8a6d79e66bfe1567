//! A process's container id, from its cgroup paths: Docker, containerd, CRI-O and Kubernetes
//! name a container's cgroup after its 64-hex-digit id (`.../docker-<id>.scope`,
//! `/kubepods/.../<id>`, `.../cri-containerd-<id>.scope`).

use std::path::Path;

/// The container id of `pid`, or None when it runs in none (or is gone).
pub fn container_id(proc_root: &Path, pid: u32) -> Option<String> {
    let text = crate::os::proctext::read(
        &proc_root.join(pid.to_string()).join("cgroup"),
        crate::os::proctext::TEXT_CAP,
    )
    .ok()?;
    from_cgroup(&text)
}

fn from_cgroup(text: &str) -> Option<String> {
    text.lines().find_map(|line| {
        let path = line.splitn(3, ':').nth(2)?;
        path.rsplit('/').find_map(|part| {
            let part = part.strip_suffix(".scope").unwrap_or(part);
            let id = part.rsplit(['-', ':']).next()?;
            (id.len() == 64 && id.bytes().all(|b| b.is_ascii_hexdigit())).then(|| id.to_string())
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn container_ids_come_from_the_cgroup_path() {
        let id = "3f2a".repeat(16);
        for text in [
            format!("0::/system.slice/docker-{id}.scope\n"),
            format!("12:pids:/kubepods/burstable/pod1234/{id}\n"),
            format!("0::/kubepods.slice/cri-containerd-{id}.scope\n"),
        ] {
            assert_eq!(from_cgroup(&text), Some(id.clone()), "{text}");
        }
        assert_eq!(
            from_cgroup("0::/user.slice/user-0.slice/session-3.scope\n"),
            None
        );
    }
}
