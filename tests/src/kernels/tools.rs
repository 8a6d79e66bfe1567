//! The programs the matrix boots kernels with: qemu-system-x86_64 and a static busybox for the
//! initramfs. `cargo xtask test` unpacks Debian's packages of both under `target/qemu` (never
//! installing them: qemu-system-x86 from the archive can remove a newer qemu-utils a machine
//! has) and writes a launcher there that points qemu at its unpacked libraries, modules and
//! firmware; the matrix uses those when present, else the machine's.

use std::path::PathBuf;

/// `target/qemu`.
fn dir() -> PathBuf {
    super::cache_root().with_file_name("qemu")
}

/// The qemu to run: `PYROMETER_QEMU`, else the unpacked one's launcher, else the machine's.
pub fn qemu() -> PathBuf {
    if let Some(q) = std::env::var_os("PYROMETER_QEMU") {
        return PathBuf::from(q);
    }
    let unpacked = dir().join("bin/qemu-system-x86_64");
    if unpacked.exists() {
        unpacked
    } else {
        PathBuf::from("qemu-system-x86_64")
    }
}

/// busybox-static's binary (Debian's busybox package is dynamically linked): the unpacked one,
/// else the machine's.
pub fn busybox() -> PathBuf {
    let unpacked = dir().join("root/bin/busybox");
    if unpacked.exists() {
        unpacked
    } else {
        PathBuf::from("/bin/busybox")
    }
}
