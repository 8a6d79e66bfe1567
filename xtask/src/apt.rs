//! Debian packages for the demo and the tests, installed so that the machine keeps what it
//! had: apt's plan is read first (`apt-get -s install`) and a plan that removes or downgrades
//! an installed package is refused, naming it. What only the kernel matrix needs and could
//! conflict with the machine's packages (qemu-system-x86 from the archive removes a newer
//! qemu-utils from backports; busybox-static conflicts with busybox) is never installed:
//! `apt-get download` and `dpkg-deb -x` unpack it under `target/qemu`, as the guest kernels
//! are unpacked under `target/kernels`.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::run;

/// One line of apt's plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Planned {
    /// `Inst PKG (VERSION …)`: not installed now.
    Install { package: String, version: String },
    /// `Inst PKG [OLD] (NEW …)`: replaces the installed OLD.
    Replace {
        package: String,
        old: String,
        new: String,
    },
    /// `Remv PKG [VERSION]`.
    Remove { package: String, version: String },
}

/// The `Inst` and `Remv` lines of `apt-get -s install`'s output.
pub fn parse_plan(text: &str) -> Vec<Planned> {
    let mut plan = Vec::new();
    for line in text.lines() {
        let (kind, rest) = match line.split_once(' ') {
            Some((k @ ("Inst" | "Remv"), rest)) => (k, rest),
            _ => continue,
        };
        let mut words = rest.splitn(2, ' ');
        let package = words.next().unwrap_or_default().to_string();
        let rest = words.next().unwrap_or_default();
        let bracketed = rest
            .strip_prefix('[')
            .and_then(|r| r.split_once(']'))
            .map(|(v, _)| v.to_string());
        let parenthesized = rest
            .find('(')
            .and_then(|at| rest[at + 1..].split_whitespace().next())
            .map(str::to_string);
        plan.push(match (kind, bracketed, parenthesized) {
            ("Remv", old, _) => Planned::Remove {
                package,
                version: old.unwrap_or_default(),
            },
            (_, Some(old), Some(new)) => Planned::Replace { package, old, new },
            (_, None, new) => Planned::Install {
                package,
                version: new.unwrap_or_default(),
            },
            (_, Some(old), None) => Planned::Replace {
                package,
                new: old.clone(),
                old,
            },
        });
    }
    plan
}

/// What of `plan` takes something from the machine: removals, and replacements by an older
/// version (`older(new, old)` says whether `new` sorts before `old`).
pub fn harmful(plan: &[Planned], older: impl Fn(&str, &str) -> bool) -> Vec<String> {
    plan.iter()
        .filter_map(|p| match p {
            Planned::Remove { package, version } => Some(format!("remove {package} {version}")),
            Planned::Replace { package, old, new } if older(new, old) => {
                Some(format!("downgrade {package} from {old} to {new}"))
            }
            _ => None,
        })
        .collect()
}

/// dpkg's order of versions: whether `a` is older than `b`.
fn dpkg_older(a: &str, b: &str) -> bool {
    Command::new("dpkg")
        .args(["--compare-versions", a, "lt", b])
        .status()
        .is_ok_and(|s| s.success())
}

/// apt's plan for installing `packages` (nothing is changed).
fn plan(packages: &[&str]) -> Result<Vec<Planned>> {
    let out = Command::new("apt-get")
        .args(["-s", "install", "--no-install-recommends"])
        .args(packages)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .output()
        .context("cannot run apt-get (pyrometer's set-up needs Debian's apt)")?;
    if !out.status.success() {
        bail!(
            "apt-get -s install {} failed: {}",
            packages.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(parse_plan(&String::from_utf8_lossy(&out.stdout)))
}

fn update() -> Result<()> {
    run(Command::new("apt-get").args(["update", "-qq"]))
}

/// Installs those of `packages` (each with a file that shows it is installed) that are
/// missing, after checking apt's plan removes and downgrades nothing.
pub fn install(packages: &[(&str, &str)]) -> Result<()> {
    let missing: Vec<&str> = packages
        .iter()
        .filter(|(_, probe)| !Path::new(probe).exists())
        .map(|(pkg, _)| *pkg)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!("installing Debian packages: {}", missing.join(" "));
    update()?;
    let plan = plan(&missing)?;
    let harm = harmful(&plan, dpkg_older);
    if !harm.is_empty() {
        bail!(
            "refusing to install {}: apt would {} (nothing was changed; run apt-get yourself \
             if that is what you want, or resolve the conflict, then run again)",
            missing.join(" "),
            harm.join(", ")
        );
    }
    run(Command::new("apt-get")
        .args(["install", "-y", "-qq", "--no-install-recommends"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive"))
}

/// Packages unpacked for the kernel matrix, beside what apt's plan says qemu needs that the
/// machine lacks (its libraries).
const MATRIX_TOOLS: &[&str] = &[
    "qemu-system-x86",
    "qemu-system-common",
    "qemu-system-data",
    "seabios",
    "busybox-static",
];

/// `target/qemu`: qemu-system-x86 with its firmware and the libraries the machine lacks, and
/// busybox-static, unpacked (made once; `made` lists what was unpacked). Writes the launcher
/// `bin/qemu-system-x86_64` the kernel matrix runs (tests/src/kernels/tools.rs).
pub fn matrix_tools(target: &Path) -> Result<PathBuf> {
    let dir = target.join("qemu");
    let made = dir.join("made");
    let launcher = dir.join("bin/qemu-system-x86_64");
    if made.exists() && launcher.exists() {
        return Ok(dir);
    }
    update()?;
    // What qemu needs that is not installed, at the versions apt would install; libraries the
    // machine has, at whatever version, are used from the machine.
    let mut wanted: Vec<String> = MATRIX_TOOLS.iter().map(|p| p.to_string()).collect();
    for p in plan(MATRIX_TOOLS)? {
        if let Planned::Install { package, version } = p
            && !MATRIX_TOOLS.contains(&package.as_str())
        {
            wanted.push(format!("{package}={version}"));
        }
    }
    let building = dir.with_extension("new");
    let _ = std::fs::remove_dir_all(&building);
    let debs = building.join("debs");
    std::fs::create_dir_all(&debs)?;
    // As root into a directory apt's own user cannot write: no sandbox user, no warning.
    run(Command::new("apt-get")
        .args(["-q", "-o", "APT::Sandbox::User=root", "download"])
        .args(&wanted)
        .current_dir(&debs))?;
    let root = building.join("root");
    std::fs::create_dir_all(&root)?;
    for entry in std::fs::read_dir(&debs)? {
        run(Command::new("dpkg-deb")
            .arg("-x")
            .arg(entry?.path())
            .arg(&root))?;
    }
    std::fs::remove_dir_all(&debs)?;
    std::fs::create_dir_all(building.join("bin"))?;
    let final_root = dir.join("root");
    write_launcher(&building.join("bin/qemu-system-x86_64"), &final_root)?;
    std::fs::write(building.join("made"), wanted.join("\n") + "\n")?;
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::rename(&building, &dir)
        .with_context(|| format!("cannot move {} to {}", building.display(), dir.display()))?;
    check_launcher(&launcher)?;
    Ok(dir)
}

/// The launcher: qemu with its unpacked libraries, modules and firmware.
fn write_launcher(path: &Path, root: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let r = root.display().to_string().replace('\'', r"'\''");
    let text = format!(
        "#!/bin/sh\n\
         # Written by `cargo xtask test` (xtask/src/apt.rs): Debian's qemu unpacked under\n\
         # target/qemu/root, never installed, with the libraries the machine lacks beside it.\n\
         R='{r}'\n\
         export LD_LIBRARY_PATH=\"$R/usr/lib/x86_64-linux-gnu:$R/lib/x86_64-linux-gnu${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}\"\n\
         export QEMU_MODULE_DIR=\"$R/usr/lib/x86_64-linux-gnu/qemu\"\n\
         exec \"$R/usr/bin/qemu-system-x86_64\" -L \"$R/usr/share/qemu\" -L \"$R/usr/share/seabios\" \"$@\"\n"
    );
    std::fs::write(path, text)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))?;
    Ok(())
}

/// Runs the unpacked qemu once (`-version`), so a missing library shows here, not in a test.
fn check_launcher(launcher: &Path) -> Result<()> {
    let out = Command::new(launcher)
        .arg("-version")
        .output()
        .with_context(|| format!("cannot run {}", launcher.display()))?;
    if !out.status.success() {
        bail!(
            "the unpacked qemu does not start ({}): {}",
            launcher.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    eprintln!(
        "kernel matrix qemu: {} ({})",
        launcher.display(),
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .next()
            .unwrap_or("")
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// apt-get -s install qemu-system-x86 on a machine with qemu-utils from backports, as met:
    /// qemu-system-common's Breaks removes the newer qemu-utils.
    const PLAN: &str = "\
NOTE: This is only a simulation!
Reading package lists...
The following packages will be REMOVED:
  qemu-utils
Remv qemu-utils [1:10.0.2+ds-2+deb13u1~bpo12+1]
Inst libslirp0 (4.7.0-1 Debian:12.11/stable [amd64])
Inst qemu-block-extra [1:10.0.2+ds-2+deb13u1~bpo12+1] (1:7.2+dfsg-7+deb12u18+b3 Debian:12.11/stable [amd64])
Inst libzstd1 [1.5.4+dfsg2-5] (1.5.5+dfsg2-1 Debian:12.11/stable [amd64])
Inst qemu-system-x86 (1:7.2+dfsg-7+deb12u18+b3 Debian:12.11/stable [amd64])
Conf libslirp0 (4.7.0-1 Debian:12.11/stable [amd64])
";

    #[test]
    fn the_plan_is_read_line_by_line() {
        let plan = parse_plan(PLAN);
        assert_eq!(
            plan[0],
            Planned::Remove {
                package: "qemu-utils".into(),
                version: "1:10.0.2+ds-2+deb13u1~bpo12+1".into()
            }
        );
        assert_eq!(
            plan[1],
            Planned::Install {
                package: "libslirp0".into(),
                version: "4.7.0-1".into()
            }
        );
        assert_eq!(
            plan[2],
            Planned::Replace {
                package: "qemu-block-extra".into(),
                old: "1:10.0.2+ds-2+deb13u1~bpo12+1".into(),
                new: "1:7.2+dfsg-7+deb12u18+b3".into()
            }
        );
        assert_eq!(
            plan.len(),
            5,
            "Conf and other lines are not changes: {plan:?}"
        );
    }

    /// A removal and a downgrade are named; an upgrade and a new package are not.
    #[test]
    fn removals_and_downgrades_are_refused_by_name() {
        let harm = harmful(&parse_plan(PLAN), dpkg_older);
        assert_eq!(
            harm,
            [
                "remove qemu-utils 1:10.0.2+ds-2+deb13u1~bpo12+1",
                "downgrade qemu-block-extra from 1:10.0.2+ds-2+deb13u1~bpo12+1 to 1:7.2+dfsg-7+deb12u18+b3"
            ]
        );
    }

    /// The real apt on this machine: a plan that downgrades an installed package is seen and
    /// refused by name. Asked of the first essential package the archive also has in an older
    /// version (point releases and the security pocket keep some).
    #[test]
    fn a_downgrade_in_apt_s_own_plan_is_refused() {
        let field = |args: &[&str]| {
            Command::new(args[0])
                .args(&args[1..])
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default()
        };
        let found = ["tzdata", "libc6", "libssl3", "apt", "dpkg", "bash"]
            .iter()
            .find_map(|pkg| {
                let installed = field(&["dpkg-query", "-W", "-f", "${Version}", pkg]);
                let older = field(&["apt-cache", "madison", pkg])
                    .lines()
                    .filter_map(|l| l.split('|').nth(1).map(|v| v.trim().to_string()))
                    .find(|v| !installed.is_empty() && dpkg_older(v, &installed))?;
                Some((*pkg, installed, older))
            });
        let Some((pkg, installed, older)) = found else {
            skip_ledger::skip(
                "apt:older-version",
                "the archive has no older version of any package asked for",
            );
            return;
        };
        let plan = plan(&[&format!("{pkg}={older}")]).unwrap();
        let harm = harmful(&plan, dpkg_older);
        assert!(
            harm.contains(&format!("downgrade {pkg} from {installed} to {older}")),
            "{harm:?}"
        );
    }
}
