//! Builds the C workloads the end-to-end tests profile, with known behaviour by construction.
//! Each is built with frame pointers (`NAME`), and some also without (`NAME-nofp`), and a
//! stripped copy of cpu631 gets its debug info moved into a build-id directory, and stripped73's
//! into a folder a debuginfod server serves. The NVML test
//! double (a shared library) stands in for the NVIDIA driver in the GPU tests.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

fn run(cmd: &mut Command) {
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e} (is gcc/binutils installed?)"));
    assert!(status.success(), "{cmd:?} failed with {status}");
}

fn gcc(src: &Path, out: &Path, flags: &[&str]) {
    run(Command::new("gcc")
        .args(flags)
        .args(["-g", "-Wl,--build-id"])
        .arg(src)
        .arg("-o")
        .arg(out));
}

fn main() {
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let fixtures = Path::new("fixtures");
    println!("cargo:rerun-if-changed=fixtures");
    let fp = [
        "-O1",
        "-fno-omit-frame-pointer",
        "-mno-omit-leaf-frame-pointer",
        "-fno-optimize-sibling-calls",
        "-fno-inline",
    ];
    for name in [
        "cpu631", "syscalls", "fail", "regress", "raytitle", "allocs",
    ] {
        gcc(&fixtures.join(format!("{name}.c")), &out.join(name), &fp);
    }
    // The candidate build of a CI gate: crunch() made 2x slower by a define.
    let slow = [&fp[..], &["-DCRUNCH_FACTOR=2"]].concat();
    gcc(
        &fixtures.join("regress.c"),
        &out.join("regress-slow"),
        &slow,
    );
    let threaded = [&fp[..], &["-pthread"]].concat();
    gcc(&fixtures.join("gap.c"), &out.join("gap"), &threaded);
    // A native thread that calls into Python late (loaded by fixtures/late_thread.py).
    gcc(
        &fixtures.join("latethread.c"),
        &out.join("liblatethread.so"),
        &[&threaded[..], &["-shared", "-fPIC"]].concat(),
    );
    gcc(&fixtures.join("offcpu.c"), &out.join("offcpu"), &threaded);

    // Without frame pointers, for the DWARF unwinder: -O2 as distributions build.
    let nofp = ["-O2", "-fomit-frame-pointer"];
    gcc(&fixtures.join("cpu631.c"), &out.join("cpu631-nofp"), &nofp);
    for name in ["recurse", "sorter", "sighandler", "bigframes"] {
        gcc(&fixtures.join(format!("{name}.c")), &out.join(name), &nofp);
    }
    gcc(&fixtures.join("dlopener.c"), &out.join("dlopener"), &nofp);
    // Allocations without frame pointers: samples in an allocator probe's step must unwind.
    gcc(
        &fixtures.join("allocs.c"),
        &out.join("allocs-nofp"),
        &[&nofp[..], &["-pthread"]].concat(),
    );
    // A dlopen'd library that allocates (the preloaded sampler sees its calls too).
    gcc(
        &fixtures.join("dlalloc.c"),
        &out.join("libdlalloc.so"),
        &[&fp[..], &["-shared", "-fPIC"]].concat(),
    );
    gcc(
        &fixtures.join("dlwork.c"),
        &out.join("libdlwork.so"),
        &[&nofp[..], &["-shared", "-fPIC"]].concat(),
    );

    // The NVML test double the GPU tests load in place of libnvidia-ml.so.1.
    run(Command::new("gcc")
        .args(["-O1", "-g", "-Wall", "-Werror", "-shared", "-fPIC"])
        .arg(fixtures.join("nvml_testdouble.c"))
        .arg("-o")
        .arg(out.join("libnvml-testdouble.so")));

    // Stripped cpu631 whose symbols live only in DEBUG_DIR/.build-id/xx/rest.debug.
    let stripped = out.join("cpu631-stripped");
    let debug_dir = out.join("debug");
    let tmp_debug = out.join("cpu631.debug");
    run(Command::new("objcopy")
        .arg("--only-keep-debug")
        .arg(out.join("cpu631"))
        .arg(&tmp_debug));
    run(Command::new("objcopy")
        .args(["--strip-all"])
        .arg(out.join("cpu631"))
        .arg(&stripped));
    let build_id = read_build_id(&out.join("cpu631"));
    let dir = debug_dir.join(".build-id").join(&build_id[..2]);
    std::fs::create_dir_all(&dir).expect("create build-id dir");
    std::fs::rename(&tmp_debug, dir.join(format!("{}.debug", &build_id[2..])))
        .expect("place debug file");

    // A stripped binary whose static functions are named only by its debug file, which the
    // debuginfod tests serve from DEBUGINFOD_DIR (not a directory the profiler searches).
    let full = out.join("stripped73-full");
    gcc(&fixtures.join("stripped73.c"), &full, &fp);
    let served = out.join("debuginfod");
    std::fs::create_dir_all(&served).expect("create the debuginfod folder");
    run(Command::new("objcopy")
        .arg("--only-keep-debug")
        .arg(&full)
        .arg(served.join("stripped73.debug")));
    run(Command::new("strip")
        .arg("--strip-all")
        .arg(&full)
        .arg("-o")
        .arg(out.join("stripped73")));

    // A static executable with its symbols stripped: no allocator to find for --alloc.
    let static_alloc = out.join("allocs-static");
    gcc(
        &fixtures.join("allocs.c"),
        &static_alloc,
        &["-O1", "-static"],
    );
    run(Command::new("strip").arg(&static_alloc));

    cupti_standin(fixtures, &out);
    // The hostile-container tests' process (static, to run alone in a chroot), and the library
    // it maps and the one it is replaced by.
    gcc(
        &fixtures.join("hostile.c"),
        &out.join("hostile"),
        &["-O1", "-static", "-pthread"],
    );
    for (lib, name) in [
        ("libvictim.so", "victim_spin"),
        ("libreplaced.so", "replaced_canary_symbol"),
    ] {
        gcc(
            &fixtures.join("spinlib.c"),
            &out.join(lib),
            &[
                "-O1",
                "-shared",
                "-fPIC",
                "-nostdlib",
                &format!("-DNAME={name}"),
            ],
        );
    }

    busynode(fixtures, &out);

    println!("cargo:rustc-env=FIXTURE_DIR={}", out.display());
    println!("cargo:rustc-env=FIXTURE_DEBUG_DIR={}", debug_dir.display());
}

/// The busy-node test's large program (`fixtures/busynode.cpp`): C++ at -O2 without frame
/// pointers, stripped, its symbols in `busynode.debug` beside it (found by `.gnu_debuglink`, as
/// a distribution's debug package is).
fn busynode(fixtures: &Path, out: &Path) {
    let full = out.join("busynode-full");
    run(Command::new("g++")
        .args([
            "-O2",
            "-fomit-frame-pointer",
            "-std=c++17",
            "-g",
            "-Wl,--build-id",
        ])
        .arg(fixtures.join("busynode.cpp"))
        .arg("-o")
        .arg(&full));
    run(Command::new("objcopy")
        .arg("--only-keep-debug")
        .arg(&full)
        .arg(out.join("busynode.debug")));
    run(Command::new("strip")
        .arg("--strip-all")
        .arg(&full)
        .arg("-o")
        .arg(out.join("busynode")));
    run(Command::new("objcopy")
        .arg("--add-gnu-debuglink=busynode.debug")
        .arg("busynode")
        .current_dir(out));
}

/// The CUPTI stand-in (`fixtures/cupti_standin.c`) as CUPTI 13.5 and as CUPTI 13.0, each as
/// `libcupti.so.13` in a directory of its own, and the GPU workload's library linked to it; built
/// against the CUDA headers (found as profiler/build.rs finds them), skipped with a warning without them.
/// `CUPTI_STANDIN` is empty then, and the tests that need it say why they skip.
fn cupti_standin(fixtures: &Path, out: &Path) {
    println!("cargo:rerun-if-env-changed=PYROMETER_CUDA_INCLUDE");
    let include = match env::var_os("PYROMETER_CUDA_INCLUDE") {
        Some(dir) => PathBuf::from(dir),
        None => {
            let headers = Path::new("../target/cuda-headers");
            // Watched as a directory that exists (a missing watched path reruns this script,
            // and rebuilds every test, at every build).
            let _ = std::fs::create_dir_all(headers);
            println!("cargo:rerun-if-changed={}", headers.display());
            headers.join("include")
        }
    };
    if !include.join("cupti.h").is_file() {
        println!(
            "cargo:warning=CUDA headers not found in {}: the CUPTI stand-in is not built and the \
             GPU-kernel tests skip; run `cargo xtask cuda-headers`",
            include.display()
        );
        println!("cargo:rustc-env=CUPTI_STANDIN=");
        println!("cargo:rustc-env=CUDA_HEADERS=");
        return;
    }
    let include = std::fs::canonicalize(&include).expect("canonical include dir");
    let flags = [
        "-O1", "-g", "-Wall", "-Werror", "-shared", "-fPIC", "-pthread",
    ];
    for (dir, defines) in [
        ("cupti-standin", &[][..]),
        ("cupti-standin-old", &["-DSTANDIN_OLD"][..]),
    ] {
        let dir = out.join(dir);
        std::fs::create_dir_all(&dir).expect("stand-in dir");
        run(Command::new("gcc")
            .args(flags)
            .args(defines)
            .args(["-fvisibility=hidden", "-Wl,-soname,libcupti.so.13"])
            .arg("-isystem")
            .arg(&include)
            .arg(fixtures.join("cupti_standin.c"))
            .arg("-o")
            .arg(dir.join("libcupti.so.13"))
            .arg("-ldl"));
    }
    run(Command::new("gcc")
        .args(flags)
        .args(["-fno-omit-frame-pointer", "-fno-optimize-sibling-calls"])
        .arg("-isystem")
        .arg(&include)
        .arg(fixtures.join("gpuwork.c"))
        .arg("-o")
        .arg(out.join("libgpuwork.so"))
        .arg(out.join("cupti-standin/libcupti.so.13"))
        .arg("-ldl"));
    println!(
        "cargo:rustc-env=CUPTI_STANDIN={}",
        out.join("cupti-standin").display()
    );
    println!("cargo:rustc-env=CUDA_HEADERS={}", include.display());
}

/// The GNU build-id as hex, read with `readelf -n` (binutils, already needed for objcopy).
fn read_build_id(bin: &Path) -> String {
    let out = Command::new("readelf")
        .arg("-n")
        .arg(bin)
        .output()
        .expect("run readelf");
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.trim().strip_prefix("Build ID: "))
        .map(|s| s.trim().to_string())
        .expect("fixture has a build-id")
}
