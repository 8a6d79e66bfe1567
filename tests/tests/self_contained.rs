//! `pyrometer` needs no file beside it: it carries the allocation sampler library
//! (`libpyrometer_alloc.so`) and writes it to a cache directory when `record --alloc` needs
//! it. A copy of the binary alone, and one made by `cargo install`, sample a command's
//! allocations in process (through the library, no allocator uprobes), and `install-preload`
//! writes the library out for set-ups that preload it themselves. Needs root (BPF).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use pyrometer_e2e::alloc::{by_function, fixture_totals, read_stats};
use pyrometer_e2e::*;

/// Runs `BIN record --alloc -- allocs totals 0.3` with the cache in `cache`: the output, its
/// stats and the profile's path.
fn record_with(bin: &Path, dir: &Path, cache: &Path) -> (std::process::Output, serde_json::Value) {
    let (out, stats) = (dir.join("alloc.pb.gz"), dir.join("stats.json"));
    let result = Command::new(bin)
        .args(["record", "--alloc", "-o", out.to_str().unwrap(), "--stats"])
        .arg(&stats)
        .arg("--")
        .arg(fixture("allocs"))
        .args(["totals", "0.3"])
        .env("PYROMETER_CACHE_DIR", cache)
        .env_remove("PYROMETER_ALLOC_LIB")
        .output()
        .expect("run pyrometer");
    assert_ok(&result);
    // Through the library: its probes, none on the allocator, the frees of sampled blocks
    // reported by it, and the estimates right.
    let stats = read_stats(&stats);
    let err = stderr(&result);
    assert_eq!(stats["alloc_preload_libraries"], 1, "{stats}\n{err}");
    assert_eq!(stats["alloc_uprobes"], 0, "{stats}\n{err}");
    assert!(
        stats["alloc_preload_frees"].as_u64().unwrap() > 0,
        "{stats}\n{err}"
    );
    let truth = fixture_totals(&result.stdout);
    let p = read_pprof(&out);
    let space = pprof_type(&p, "alloc_space");
    let got = by_function(&pprof_samples(&p), space, "make_600");
    let want = truth["make_600"].1;
    assert!(
        (got - want).abs() <= 0.2 * want,
        "make_600: estimated {got:.0} bytes, allocated {want:.0}\n{err}"
    );
    (result, stats)
}

/// The one library file in the cache directory `cache` (`HASH/libpyrometer_alloc.so`); beside
/// it only `kallsyms` (the kernel's symbols a root run keeps).
fn cached_library(cache: &Path) -> PathBuf {
    let (dirs, others): (Vec<PathBuf>, Vec<PathBuf>) = std::fs::read_dir(cache)
        .unwrap_or_else(|e| panic!("{}: {e}", cache.display()))
        .map(|e| e.unwrap().path())
        .partition(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.len() == 16 && n.bytes().all(|b| b.is_ascii_hexdigit()))
        });
    assert_eq!(dirs.len(), 1, "one directory per library: {dirs:?}");
    assert!(
        others.iter().all(|p| p.ends_with("kallsyms")),
        "nothing else in the cache: {others:?}"
    );
    dirs[0].join("libpyrometer_alloc.so")
}

/// A copy of the binary alone in a directory samples in process: the library goes into the
/// cache (a directory named by its hash, 0755, the file 0644), is reused while it is intact
/// and written again when it is not.
#[test]
fn a_copied_binary_samples_allocations_in_process() {
    if !privileged() {
        return;
    }
    let dir = scratch("self-contained-copy");
    let bin = dir.join("bin/pyrometer");
    std::fs::create_dir_all(bin.parent().unwrap()).unwrap();
    copy_executable(&pyrometer_bin(), &bin);
    let cache = dir.join("cache");
    record_with(&bin, &dir, &cache);
    let lib = cached_library(&cache);
    let meta = std::fs::metadata(&lib).unwrap();
    assert_eq!(meta.mode() & 0o7777, 0o644, "{}", lib.display());
    let parent = std::fs::metadata(lib.parent().unwrap()).unwrap();
    assert_eq!(parent.mode() & 0o7777, 0o755);
    // Reused as it is.
    record_with(&bin, &dir, &cache);
    assert_eq!(std::fs::metadata(&lib).unwrap().ino(), meta.ino());
    // A damaged copy is replaced, not used.
    let mut bytes = std::fs::read(&lib).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xff;
    std::fs::write(&lib, &bytes).unwrap();
    record_with(&bin, &dir, &cache);
    assert_ne!(
        std::fs::read(&lib).unwrap(),
        bytes,
        "the damaged copy was used"
    );

    // install-preload writes the same library where a set-up wants it.
    let installed = pyrometer_e2e::alloc::install_preload(&dir.join("lib/pyrometer"));
    assert_eq!(
        std::fs::read(&installed).unwrap(),
        std::fs::read(&lib).unwrap()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `cargo install --path profiler` builds a binary that carries the library (a nested build
/// in profiler/build.rs): installed alone under a fresh root, it samples in process. The
/// install's final artifacts go to a target directory of its own, so it never replaces the
/// binaries the other tests run; its intermediate ones share the workspace's build
/// directory, where cargo reuses what the workspace's build made (seconds, where a whole
/// debug build took four minutes on the 2-core runner).
#[test]
fn cargo_install_samples_allocations_in_process() {
    if !privileged() {
        return;
    }
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let target = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cargo-install-target");
    let build_dir = std::env::var_os("CARGO_BUILD_BUILD_DIR")
        .or_else(|| std::env::var_os("CARGO_TARGET_DIR"))
        .map_or_else(|| workspace.join("target"), PathBuf::from);
    let dir = scratch("self-contained-install");
    let root = dir.join("root");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let install = Command::new(&cargo)
        .args(["install", "--debug", "--locked", "--offline", "--path"])
        .arg(workspace.join("profiler"))
        .arg("--root")
        .arg(&root)
        .env("CARGO_TARGET_DIR", &target)
        .env("CARGO_BUILD_BUILD_DIR", &build_dir)
        .output()
        .expect("run cargo install");
    assert!(
        install.status.success(),
        "cargo install failed:\n{}",
        String::from_utf8_lossy(&install.stderr)
    );
    let bin = root.join("bin/pyrometer");
    let installed: Vec<_> = std::fs::read_dir(root.join("bin"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(installed, ["pyrometer"], "nothing installed beside it");
    record_with(&bin, &dir, &dir.join("cache"));
    let _ = std::fs::remove_dir_all(&dir);
}
