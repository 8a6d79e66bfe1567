//! Booting a prepared kernel under `qemu-system-x86_64 -accel tcg,thread=single` (this
//! machine's /dev/kvm is a nested paravirtual one that cannot boot stock kernels; one emulator
//! thread for both vCPUs, because with one each a vCPU once ran a half-patched jump label of
//! the booting kernel and it died in `int3`): 2 vCPUs, 512 MiB, the
//! machine's root shared read-only over 9p (virtfs) and the results directory shared writable.
//! A busybox initramfs loads the 9p modules, mounts what the payload needs, chroots into the
//! shared root, runs the payload and powers off. The serial console goes to
//! `target/kernels/NAME/serial.log`; a boot that outlives its limit is killed and reported
//! with the log's tail.
//!
//! The guest mounts tmpfs over /tmp and /run, which would hide a checkout living there: the
//! checkout (and a target directory outside it) are shared on their own and mounted at their
//! own paths below those tmpfs, so the payload's paths are the same inside and out wherever
//! the checkout lies. qemu and busybox are the copies `cargo xtask test` unpacks under
//! `target/qemu` when there, else the machine's (see `tools`).

use std::fs;
use std::path::{Component, Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use super::checks::{self, Check, Status};
use super::cpio::Archive;
use super::fetch::Prepared;
use super::payload::{self, Setup};
use super::tools;

/// Where the guest mounts the results share, inside the chroot.
const GUEST_RESULTS: &str = "/tmp/results";
/// Seconds allowed for booting and mounting around the payload's own limits.
const BOOT_MARGIN_S: u32 = 120;

/// `s` single-quoted for sh.
fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The init lines mounting `shares[i]` (tag `share{i}`) read-only at its own path inside the
/// chroot, after the tmpfs over /tmp and /run.
fn share_mounts(shares: &[PathBuf]) -> String {
    let mut out = String::new();
    for (i, path) in shares.iter().enumerate() {
        let at = sh_quote(&path.display().to_string());
        out.push_str(&format!(
            "mkdir -p $R{at} && mount -t 9p -o {SHARE_OPTIONS} share{i} $R{at} \\\n    \
             || fail \"cannot mount share{i} at \"{at}\n"
        ));
    }
    out
}

/// Mount options of the read-only shares: page-cached, as the root is.
const SHARE_OPTIONS: &str = "trans=virtio,version=9p2000.L,ro,cache=loose,msize=262144";

/// The directories the payload's programs live in that the guest must see at their own
/// paths: the checkout, and the target directory and the binary's directory where they lie
/// outside it. Absolute and lexically normal, not canonical: the payload names them so.
pub fn shares(setup: &Setup) -> Vec<PathBuf> {
    let workspace = normal(Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/..")));
    let target = normal(&super::cache_root().join(".."));
    let bin_dir = setup.pyrometer.parent().map(normal);
    let mut dirs = vec![workspace];
    for d in std::iter::once(target).chain(bin_dir) {
        if !dirs.iter().any(|s| d.starts_with(s)) {
            dirs.push(d);
        }
    }
    dirs
}

/// `p` made absolute, with `.` and `..` resolved lexically.
fn normal(p: &Path) -> PathBuf {
    let p = std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            c => out.push(c),
        }
    }
    out
}

/// `path` as a qemu option value, in which a comma is written twice.
fn option_path(path: &Path) -> String {
    path.display().to_string().replace(',', ",,")
}

/// The initramfs's /init: busybox sh. Output lines start with `pyrometer-init:`.
fn init_script(shares: &[PathBuf]) -> String {
    format!(
        r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
say() {{ echo "pyrometer-init: $*"; }}
fail() {{ say "$*"; poweroff -f; }}
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
while read -r m; do
    insmod "/modules/$m" || fail "insmod $m failed"
done < /modules.load
# Page-cache the read-only root: the payload reads binaries and libraries many times.
mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=262144 hostroot /newroot \
    || fail "cannot mount the machine's root over 9p"
R=/newroot
mount -t proc proc $R/proc
mount -t sysfs sys $R/sys
mount -t devtmpfs dev $R/dev
mkdir -p $R/dev/shm $R/dev/pts
mount -t tmpfs shm $R/dev/shm
mount -t bpf bpf $R/sys/fs/bpf || say "no bpffs"
mount -t tracefs tracefs $R/sys/kernel/tracing || say "no tracefs"
mount -t debugfs debugfs $R/sys/kernel/debug || say "no debugfs"
mount -t tmpfs tmp $R/tmp
mount -t tmpfs run $R/run
{shares}mkdir -p $R{results}
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 results $R{results} \
    || fail "cannot mount the results share"
say "running the payload on $(uname -r)"
chroot $R /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    /bin/sh {results}/payload.sh
say "payload exited $?"
sync
umount $R{results}
poweroff -f
"#,
        results = GUEST_RESULTS,
        shares = share_mounts(shares),
    )
}

/// The initramfs: busybox, the modules in load order and /init.
fn initramfs(kernel: &Prepared, init: &str) -> std::io::Result<Vec<u8>> {
    let mut a = Archive::default();
    for d in ["bin", "dev", "proc", "sys", "newroot", "modules"] {
        a.dir(d);
    }
    a.char_device("dev/console", 5, 1);
    a.file("bin/busybox", 0o755, &fs::read(tools::busybox())?);
    let mut order = Vec::new();
    for m in &kernel.modules {
        let name = m.file_name().unwrap().to_string_lossy().into_owned();
        a.file(&format!("modules/{name}"), 0o644, &fs::read(m)?);
        order.push(name);
    }
    order.push(String::new());
    a.file("modules.load", 0o644, order.join("\n").as_bytes());
    a.file("init", 0o755, init.as_bytes());
    Ok(a.finish())
}

/// Boots `kernel` with the payload; the checks of its results, or a failed `boot` check.
pub fn boot(kernel: &Prepared, setup: &Setup, dir: &Path) -> Vec<Check> {
    let limit = Duration::from_secs(payload::limit_s(BOOT_MARGIN_S).into());
    let shares = shares(setup);
    boot_with(
        kernel,
        Some(setup),
        &init_script(&shares),
        &shares,
        dir,
        limit,
    )
}

/// Boots `kernel` with `init` as the initramfs's /init and the payload of `setup` (if any) in
/// the results share, `shares` shared read-only as `share0`, `share1`, …, killing qemu after
/// `limit`.
pub fn boot_with(
    kernel: &Prepared,
    setup: Option<&Setup>,
    init: &str,
    shares: &[PathBuf],
    dir: &Path,
    limit: Duration,
) -> Vec<Check> {
    let started = Instant::now();
    let fail = |detail: String| vec![Check::fail("boot", started.elapsed().as_secs_f64(), detail)];
    let results = dir.join("results");
    let fresh = match setup {
        Some(setup) => {
            payload::fresh_results(setup, &results, Path::new(GUEST_RESULTS), payload::GUEST)
                .map(|_| ())
        }
        None => fs::remove_dir_all(&results)
            .or(Ok(()))
            .and_then(|()| fs::create_dir_all(&results)),
    };
    if let Err(e) = fresh {
        return fail(format!("{}: {e}", results.display()));
    }
    let initrd = dir.join("initramfs.cpio");
    match initramfs(kernel, init) {
        Ok(bytes) => {
            if let Err(e) = fs::write(&initrd, bytes) {
                return fail(format!("{}: {e}", initrd.display()));
            }
        }
        Err(e) => {
            return fail(format!(
                "cannot build the initramfs ({}: {e}; `cargo xtask test` unpacks busybox-static into target/qemu)",
                tools::busybox().display()
            ));
        }
    }
    let log = dir.join("serial.log");
    let _ = fs::remove_file(&log);
    let qemu = tools::qemu();
    let mut cmd = Command::new(&qemu);
    cmd.args(["-accel", "tcg,thread=single", "-smp", "2", "-m", "512M"])
        .args(["-nodefaults", "-no-reboot", "-display", "none"])
        .arg("-kernel")
        .arg(&kernel.vmlinuz)
        .arg("-initrd")
        .arg(&initrd)
        .args(["-append", "console=ttyS0 panic=-1 quiet loglevel=4"])
        .arg("-serial")
        .arg(format!("file:{}", log.display()))
        .arg("-virtfs")
        .arg("local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap")
        .arg("-virtfs")
        .arg(format!(
            "local,path={},mount_tag=results,security_model=none,multidevs=remap",
            option_path(&results)
        ));
    for (i, share) in shares.iter().enumerate() {
        cmd.arg("-virtfs").arg(format!(
            "local,path={},mount_tag=share{i},security_model=none,readonly=on,multidevs=remap",
            option_path(share)
        ));
    }
    cmd.stdin(Stdio::null()).stdout(Stdio::null());
    let qemu_log = dir.join("qemu.log");
    match fs::File::create(&qemu_log) {
        Ok(f) => cmd.stderr(f),
        Err(e) => return fail(format!("{}: {e}", qemu_log.display())),
    };
    let spawned = SystemTime::now();
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            return fail(format!(
                "cannot run {}: {e} (`cargo xtask test` unpacks qemu into target/qemu)",
                qemu.display()
            ));
        }
    };
    let exited = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) if started.elapsed() > limit => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(250)),
            Err(e) => return fail(format!("waiting for qemu: {e}")),
        }
    };
    let seconds = started.elapsed().as_secs_f64();
    let tail = tail(&log, 30);
    let Some(status) = exited else {
        let mut checks = vec![Check::fail(
            "boot",
            seconds,
            format!(
                "no power-off after {} s: killed; serial log {}:\n{tail}",
                limit.as_secs(),
                log.display()
            ),
        )];
        // What the payload finished before the limit still tells which step hung.
        if setup.is_some() {
            checks.extend(checks::all(&results));
        }
        return checks;
    };
    if !results.join("done").exists() {
        let qemu_err = fs::read_to_string(&qemu_log).unwrap_or_default();
        return fail(format!(
            "the payload did not finish (qemu {status}{}); serial log {}:\n{tail}",
            if qemu_err.trim().is_empty() {
                String::new()
            } else {
                format!(": {}", qemu_err.trim())
            },
            log.display()
        ));
    }
    // Booting is the time to the payload's first line (the guest's clock comes from the
    // machine's at boot).
    let boot_s = fs::read_to_string(results.join("started"))
        .ok()
        .and_then(|s| s.trim().parse::<f64>().ok())
        .zip(spawned.duration_since(SystemTime::UNIX_EPOCH).ok())
        .map(|(started, spawned)| started - spawned.as_secs_f64())
        .unwrap_or(seconds);
    let mut checks = vec![Check {
        name: "boot",
        status: Status::Ok,
        seconds: boot_s,
        detail: format!("{} under qemu (tcg), to the payload", kernel.release),
    }];
    checks.extend(checks::all(&results));
    checks
}

/// The last `n` lines of the serial log (without the firmware's escape sequences).
fn tail(log: &Path, n: usize) -> String {
    let text = String::from_utf8_lossy(&fs::read(log).unwrap_or_default()).into_owned();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..]
        .iter()
        .map(|l| l.replace('\x1b', ""))
        .collect::<Vec<_>>()
        .join("\n")
}
