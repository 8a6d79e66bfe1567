//! Checks, before anything is loaded, that the process holds the capabilities the sampler
//! needs, so a missing one is named instead of surfacing as an EPERM from deep inside a load.

/// A Linux capability by number (include/uapi/linux/capability.h).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capability {
    pub name: &'static str,
    pub bit: u32,
}

pub const CAP_DAC_READ_SEARCH: Capability = Capability {
    name: "CAP_DAC_READ_SEARCH",
    bit: 2,
};
pub const CAP_SYS_PTRACE: Capability = Capability {
    name: "CAP_SYS_PTRACE",
    bit: 19,
};
pub const CAP_SYS_ADMIN: Capability = Capability {
    name: "CAP_SYS_ADMIN",
    bit: 21,
};
pub const CAP_PERFMON: Capability = Capability {
    name: "CAP_PERFMON",
    bit: 38,
};
pub const CAP_BPF: Capability = Capability {
    name: "CAP_BPF",
    bit: 39,
};

/// What sampling needs: loading BPF, opening system-wide perf events, reading other
/// processes' memory maps and binaries.
pub const SAMPLING: &[Capability] = &[CAP_BPF, CAP_PERFMON, CAP_SYS_PTRACE];

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "missing privileges: {} (run as root, or grant them: setcap cap_bpf,cap_perfmon,cap_sys_ptrace+ep $(which pyrometer))",
    missing.join(", ")
)]
pub struct MissingPrivileges {
    pub missing: Vec<&'static str>,
}

/// The effective capability set of this process, from `/proc/self/status`.
pub fn effective() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| parse_cap_eff(&s))
        .unwrap_or(0)
}

fn parse_cap_eff(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("CapEff:"))?;
    u64::from_str_radix(line["CapEff:".len()..].trim(), 16).ok()
}

/// For tests that load the sampler: whether this process may ([`SAMPLING`]); when not, the
/// skip is recorded in the ledger with the reason.
#[cfg(test)]
pub(crate) fn may_sample() -> bool {
    let ok = check(SAMPLING, effective()).is_ok();
    if !ok {
        skip_ledger::skip(
            "root",
            "needs CAP_BPF, CAP_PERFMON and CAP_SYS_PTRACE (run as root)",
        );
    }
    ok
}

/// Fails naming every capability in `needed` that `effective` lacks. Kernels before 5.8 had
/// no CAP_BPF/CAP_PERFMON; there CAP_SYS_ADMIN grants both, so it is accepted for them.
pub fn check(needed: &[Capability], effective: u64) -> Result<(), MissingPrivileges> {
    let has = |c: Capability| effective & (1u64 << c.bit) != 0;
    let missing: Vec<&'static str> = needed
        .iter()
        .filter(|&&c| {
            let via_admin = (c == CAP_BPF || c == CAP_PERFMON) && has(CAP_SYS_ADMIN);
            !has(c) && !via_admin
        })
        .map(|c| c.name)
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(MissingPrivileges { missing })
    }
}

/// What the agent keeps once its programs are attached: BPF map updates for new targets and
/// unwind tables (CAP_BPF), perf events (CAP_PERFMON), and reading new processes' maps,
/// binaries and `/proc/PID/root` (CAP_SYS_PTRACE, CAP_DAC_READ_SEARCH).
pub const AGENT_KEEPS: &[Capability] = &[CAP_BPF, CAP_PERFMON, CAP_SYS_PTRACE, CAP_DAC_READ_SEARCH];

/// The names of the capabilities in a set, lowest bit first (unnamed ones as `cap_N`).
pub fn names(set: u64) -> Vec<String> {
    const KNOWN: &[Capability] = &[
        CAP_DAC_READ_SEARCH,
        CAP_SYS_PTRACE,
        CAP_SYS_ADMIN,
        CAP_PERFMON,
        CAP_BPF,
    ];
    (0..64)
        .filter(|b| set & (1u64 << b) != 0)
        .map(|b| {
            KNOWN
                .iter()
                .find(|c| c.bit == b)
                .map_or_else(|| format!("cap_{b}"), |c| c.name.to_string())
        })
        .collect()
}

#[derive(Debug, thiserror::Error)]
pub enum DropError {
    #[error(
        "capabilities are per thread and {0} threads are running; drop them before starting any"
    )]
    Threads(usize),
    #[error("{call}: {source}")]
    Os {
        call: &'static str,
        source: std::io::Error,
    },
}

/// The user the agent becomes once attached when not told otherwise: `nobody`.
pub const UNPRIVILEGED: (u32, u32) = (65534, 65534);

/// Becomes `uid`/`gid` (real, effective and saved; no supplementary groups) keeping every
/// capability, so that what the agent does afterwards is done as that user with only the
/// capabilities [`drop_all_but`] then leaves: files it creates are that user's, and nothing
/// root owns and the capabilities do not cover (writing root's files, signalling root's
/// processes) is open to it. Like the drop, it must run while the process has one thread.
pub fn become_user(uid: u32, gid: u32) -> Result<(), DropError> {
    let threads = std::fs::read_dir("/proc/self/task").map_or(1, |d| d.count());
    if threads > 1 {
        return Err(DropError::Threads(threads));
    }
    let os = |call: &'static str| DropError::Os {
        call,
        source: std::io::Error::last_os_error(),
    };
    // SAFETY: prctl, setgroups, setresgid and setresuid with integer arguments (and a null
    // list of groups, of length 0).
    unsafe {
        if libc::prctl(libc::PR_SET_KEEPCAPS, 1, 0, 0, 0) != 0 {
            return Err(os("prctl(PR_SET_KEEPCAPS)"));
        }
        if libc::setgroups(0, std::ptr::null()) != 0 {
            return Err(os("setgroups"));
        }
        if libc::setresgid(gid, gid, gid) != 0 {
            return Err(os("setresgid"));
        }
        if libc::setresuid(uid, uid, uid) != 0 {
            return Err(os("setresuid"));
        }
        if libc::prctl(libc::PR_SET_KEEPCAPS, 0, 0, 0, 0) != 0 {
            return Err(os("prctl(PR_SET_KEEPCAPS)"));
        }
    }
    // Leaving uid 0 cleared the effective set; the permitted one was kept.
    let (permitted, _) = capget().map_err(|_| os("capget"))?;
    capset(permitted).map_err(|_| os("capset"))
}

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const CAP_VERSION_3: u32 = 0x2008_0522;

/// This thread's permitted and effective sets.
fn capget() -> std::io::Result<(u64, u64)> {
    let mut header = CapHeader {
        version: CAP_VERSION_3,
        pid: 0,
    };
    let mut now = [CapData::default(); 2];
    // SAFETY: header and a two-element data array, as _LINUX_CAPABILITY_VERSION_3 wants.
    if unsafe { libc::syscall(libc::SYS_capget, &mut header, now.as_mut_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let join = |lo: u32, hi: u32| lo as u64 | (hi as u64) << 32;
    Ok((
        join(now[0].permitted, now[1].permitted),
        join(now[0].effective, now[1].effective),
    ))
}

/// Sets this thread's permitted and effective sets to `set`, its inheritable set empty.
fn capset(set: u64) -> std::io::Result<()> {
    let mut header = CapHeader {
        version: CAP_VERSION_3,
        pid: 0,
    };
    let (low, high) = (set as u32, (set >> 32) as u32);
    let new = [
        CapData {
            effective: low,
            permitted: low,
            inheritable: 0,
        },
        CapData {
            effective: high,
            permitted: high,
            inheritable: 0,
        },
    ];
    // SAFETY: as in capget; a set never grows past the permitted one (the kernel refuses).
    if unsafe { libc::syscall(libc::SYS_capset, &mut header, new.as_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Drops every capability but `keep` from the effective, permitted, inheritable, ambient and
/// bounding sets, so a compromised agent (it parses other processes' binaries) holds only
/// what sampling needs. Capabilities belong to a thread, and threads inherit them, so this
/// must run while the process has one thread; the ones started later inherit the reduced
/// sets. On kernels before 5.8 (no CAP_BPF) CAP_SYS_ADMIN stands in for CAP_BPF and
/// CAP_PERFMON and is kept.
pub fn drop_all_but(keep: &[Capability]) -> Result<u64, DropError> {
    let threads = std::fs::read_dir("/proc/self/task").map_or(1, |d| d.count());
    if threads > 1 {
        return Err(DropError::Threads(threads));
    }
    let last_cap: u32 = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(40);
    let mut mask: u64 = keep.iter().map(|c| 1u64 << c.bit).sum();
    if last_cap < CAP_BPF.bit {
        mask |= 1u64 << CAP_SYS_ADMIN.bit;
    }
    let os = |call: &'static str| DropError::Os {
        call,
        source: std::io::Error::last_os_error(),
    };
    // The bounding set first: dropping from it needs CAP_SETPCAP, which capset removes.
    for bit in 0..=last_cap.min(63) {
        // SAFETY: prctl with integer arguments only.
        let bounded = unsafe { libc::prctl(libc::PR_CAPBSET_READ, bit as libc::c_ulong, 0, 0, 0) };
        // Already out of the bounding set (a container's, a unit's): nothing to drop, and no
        // CAP_SETPCAP needed for it.
        if bounded == 0 {
            continue;
        }
        if mask & (1u64 << bit) == 0 {
            // SAFETY: prctl with integer arguments only.
            let r = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, bit as libc::c_ulong, 0, 0, 0) };
            if r != 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINVAL) {
                return Err(os("prctl(PR_CAPBSET_DROP)"));
            }
        }
    }
    // SAFETY: prctl with integer arguments only.
    let r = unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
            0,
            0,
            0,
        )
    };
    if r != 0 {
        return Err(os("prctl(PR_CAP_AMBIENT_CLEAR_ALL)"));
    }
    let (now, _) = capget().map_err(|_| os("capget"))?;
    let permitted = now & mask;
    capset(permitted).map_err(|_| os("capset"))?;
    Ok(permitted)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_status() {
        let s = "Name:\tx\nCapInh:\t0000000000000000\nCapEff:\t000001ffffffffff\n";
        assert_eq!(parse_cap_eff(s), Some(0x1ff_ffff_ffff));
    }

    #[test]
    fn names_each_missing_capability() {
        let only_ptrace = 1u64 << CAP_SYS_PTRACE.bit;
        let err = check(SAMPLING, only_ptrace).unwrap_err();
        assert_eq!(err.missing, vec!["CAP_BPF", "CAP_PERFMON"]);
        assert!(
            err.to_string()
                .starts_with("missing privileges: CAP_BPF, CAP_PERFMON")
        );
        assert!(check(SAMPLING, u64::MAX).is_ok());
        let admin_ptrace = only_ptrace | (1u64 << CAP_SYS_ADMIN.bit);
        assert!(check(SAMPLING, admin_ptrace).is_ok());
    }

    #[test]
    fn dropping_with_threads_running_is_refused() {
        // The test harness runs tests on their own threads, so this process has several.
        let err = drop_all_but(AGENT_KEEPS).unwrap_err();
        assert!(matches!(err, DropError::Threads(n) if n > 1), "{err}");
        assert!(err.to_string().contains("per thread"), "{err}");
    }
}
