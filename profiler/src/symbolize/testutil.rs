//! Test helpers: temporary directories and C/C++ fixtures compiled at test time.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

/// A directory removed when dropped.
pub(crate) struct TempDir(PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        static N: AtomicU32 = AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let p =
            std::env::temp_dir().join(format!("pyrometer-test-{}-{n}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub(crate) fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn compile(
    compiler: &str,
    ext: &str,
    tmp: &TempDir,
    name: &str,
    src: &str,
    args: &[&str],
) -> PathBuf {
    let src_path = tmp.path().join(format!("{name}.{ext}"));
    std::fs::write(&src_path, src).unwrap();
    let out = tmp.path().join(name);
    run(Command::new(compiler)
        .args(args)
        .arg("-o")
        .arg(&out)
        .arg(&src_path));
    out
}

/// Compiles `src` with gcc into `tmp/name` (source at `tmp/name.c`).
pub(crate) fn compile_c(tmp: &TempDir, name: &str, src: &str, args: &[&str]) -> PathBuf {
    compile("gcc", "c", tmp, name, src, args)
}

pub(crate) fn compile_cxx(tmp: &TempDir, name: &str, src: &str, args: &[&str]) -> PathBuf {
    compile("g++", "cpp", tmp, name, src, args)
}
