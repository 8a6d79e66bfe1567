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
}
