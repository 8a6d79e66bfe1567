//! `cargo xtask forky-root`: a Debian forky (testing) root under `target/forky/root` holding
//! CPython 3.14 and 3.15 with their `-dbg` packages, for the tests that run workloads in it with
//! `chroot` (a process whose debug files live in its own root, as in a container). Made once
//! (~1–2 min: debootstrap ~50 s, the packages ~20 s) and kept; `target/forky/made` records the
//! package list it was made with.
//!
//! Facts about the archive as met here: bookworm's debootstrap has no forky script, so the
//! `sid` script is passed with the forky suite; the machine's clock is past the archive's
//! Release expiry, so apt inside needs `Acquire::Check-Valid-Until "false"`. A failure is
//! written to `target/forky/failed` (the tests give it as their skip's reason) and returned:
//! under CI it fails the test command, elsewhere the forky tests skip.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// Debian packages installed in the root.
pub const PACKAGES: &[&str] = &[
    "python3.14",
    "python3.14-dbg",
    "python3.15",
    "python3.15-dbg",
];

const MIRROR: &str = "http://deb.debian.org/debian";

/// `target/forky`.
pub fn dir(root: &Path) -> PathBuf {
    root.join("target/forky")
}

/// Makes the root unless it is already there; a failure is also recorded for the tests.
pub fn ensure(root: &Path) -> Result<PathBuf> {
    let dir = dir(root);
    let made = dir.join("made");
    let want = PACKAGES.join(" ");
    let chroot = dir.join("root");
    if std::fs::read_to_string(&made).is_ok_and(|m| m == want) {
        return Ok(chroot);
    }
    let _ = std::fs::remove_file(dir.join("failed"));
    match make(&dir) {
        Ok(()) => {
            std::fs::write(&made, &want)?;
            Ok(chroot)
        }
        Err(e) => {
            let reason = format!("{e:#}");
            let _ = std::fs::create_dir_all(&dir);
            let _ = std::fs::write(dir.join("failed"), &reason);
            bail!(
                "cannot make the Debian forky root {}: {reason}",
                chroot.display()
            )
        }
    }
}

fn make(dir: &Path) -> Result<()> {
    if !Path::new("/usr/share/debootstrap/scripts/sid").exists() {
        bail!("debootstrap is not installed");
    }
    let building = dir.join("root.new");
    if building.exists() {
        std::fs::remove_dir_all(&building)
            .with_context(|| format!("cannot remove {}", building.display()))?;
    }
    std::fs::create_dir_all(dir)?;
    let started = std::time::Instant::now();
    crate::run(
        Command::new("debootstrap")
            .args(["--variant=minbase", "forky"])
            .arg(&building)
            .args([MIRROR, "/usr/share/debootstrap/scripts/sid"]),
    )?;
    std::fs::write(
        building.join("etc/apt/apt.conf.d/99pyrometer"),
        "Acquire::Check-Valid-Until \"false\";\n",
    )?;
    std::fs::copy("/etc/resolv.conf", building.join("etc/resolv.conf"))
        .context("cannot copy /etc/resolv.conf into the root")?;
    let in_root = |args: &[&str]| {
        let mut cmd = Command::new("chroot");
        cmd.arg(&building)
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive");
        cmd
    };
    crate::run(&mut in_root(&["apt-get", "update", "-qq"]))?;
    let mut install = in_root(&["apt-get", "install", "-y", "-qq", "--no-install-recommends"]);
    crate::run(install.args(PACKAGES))?;
    // The downloaded packages are not needed again.
    crate::run(&mut in_root(&["apt-get", "clean"]))?;
    let root = dir.join("root");
    if root.exists() {
        std::fs::remove_dir_all(&root)
            .with_context(|| format!("cannot remove {}", root.display()))?;
    }
    std::fs::rename(&building, &root)?;
    eprintln!(
        "made the Debian forky root {} in {:.0} s",
        root.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
