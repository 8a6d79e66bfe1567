//! Compiles the kernel-side programs in `src/bpf/*.bpf.c` with clang (`-target bpf`) into
//! objects that `src/lib.rs` embeds, checks that every header compiles on its own, and
//! generates the Rust side of the kernel ABI from `src/bpf/shared.h` with bindgen. Debian's
//! clang, libclang-dev and libbpf-dev (for `bpf_helpers.h`) are installed by
//! `cargo xtask deps`; without them the build stops with a message saying so.

use std::path::{Path, PathBuf};
use std::{env, process::Command};

use bindgen::callbacks::{EnumVariantValue, IntKind, ItemInfo, ItemKind, ParseCallbacks};

/// Each `src/bpf/NAME.bpf.c` becomes `$OUT_DIR/NAME.bpf.o`.
const PROGRAMS: &[&str] = &["sampler"];

fn main() {
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR is set by cargo"));
    let src = PathBuf::from("src/bpf");
    println!("cargo:rerun-if-changed=src/bpf");
    let clang = env::var("CLANG").unwrap_or_else(|_| "clang".to_string());
    let multiarch = format!("/usr/include/{}-linux-gnu", env::consts::ARCH);
    let target_arch = match env::consts::ARCH {
        "x86_64" => "x86",
        "aarch64" => "arm64",
        other => other,
    };
    write_exp_table(&out);
    let flags = [
        "-target".to_string(),
        "bpf".into(),
        "-O2".into(),
        "-Wall".into(),
        "-Werror".into(),
        format!("-D__TARGET_ARCH_{target_arch}"),
        format!("-I{multiarch}"),
        "-Isrc/bpf".into(),
        format!("-I{}", out.display()),
    ];
    check_headers(&clang, &flags, &src);
    generate_abi(&multiarch, &out);
    for name in PROGRAMS {
        let input = src.join(format!("{name}.bpf.c"));
        let output = out.join(format!("{name}.bpf.o"));
        let status = Command::new(&clang)
            .args(["-target", "bpf", "-O2", "-g", "-Wall", "-Werror"])
            .arg(format!("-D__TARGET_ARCH_{target_arch}"))
            .arg(format!("-I{multiarch}"))
            .arg("-Isrc/bpf")
            .arg(format!("-I{}", out.display()))
            .arg("-c")
            .arg(&input)
            .arg("-o")
            .arg(&output)
            .status();
        match status {
            Ok(s) if s.success() => {}
            Ok(s) => panic!("clang failed ({s}) compiling {}", input.display()),
            Err(e) => panic!(
                "cannot run {clang} ({e}): install Debian's clang and libbpf-dev (`cargo xtask deps` does)"
            ),
        }
    }
}

/// Each header compiles on its own: it includes what it uses, so it can be read, changed and
/// formatted alone. They are still compiled into one object (`sampler.bpf.c` includes them
/// all), so no program gains a global function and the verifier sees what it always saw.
fn check_headers(clang: &str, flags: &[String], src: &Path) {
    let mut headers: Vec<PathBuf> = std::fs::read_dir(src)
        .expect("src/bpf is readable")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "h"))
        .collect();
    headers.sort();
    for header in headers {
        let output = Command::new(clang)
            .args(flags)
            // A header's static helpers are for its includers; `#pragma once` is for them too.
            .args([
                "-Wno-unused-function",
                "-Wno-pragma-once-outside-header",
                "-fsyntax-only",
                "-x",
                "c",
            ])
            .arg(&header)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {clang}: {e}"));
        if !output.status.success() {
            panic!(
                "{} does not compile on its own (include what it uses):\n{}",
                header.display(),
                String::from_utf8_lossy(&output.stderr)
            );
        }
    }
}

/// The Rust names of the ABI's C names: structs and enums in CamelCase, enum variants without
/// their enum's prefix, integer constants typed for their use (sizes `usize`, the Python frame
/// slot masks `u64`, everything else `u32`).
#[derive(Debug)]
struct AbiNames;

/// Constants that size arrays and slices.
const USIZE_CONSTANTS: &[&str] = &[
    "MAX_USER_FRAMES",
    "MAX_KERNEL_FRAMES",
    "FP_MAX_FRAMES",
    "MAX_PY_FRAMES",
    "MAX_SLOTS",
    "COMM_LEN",
    "MAX_MAPPINGS",
    "SPAN_NAME_LEN",
    "GPU_CHUNK_MAX",
];

/// Constants masked against (or packed into) the 64-bit Python frame slots.
const U64_CONSTANTS: &[&str] = &[
    "PY_ADDR_MASK",
    "PY_FIRSTLINE_MASK",
    "PY_ENTRY_BIT",
    "PY_SHIM_MARK",
    "PY_TASK_MARK",
    "PY_TASK_MARK_MASK",
];

fn camel(snake: &str) -> String {
    snake
        .split('_')
        .map(|w| {
            // `offcpu_record` reads as `OffCpuRecord`, as the Rust side always spelled it.
            let w = if w.eq_ignore_ascii_case("offcpu") {
                "off_cpu"
            } else {
                w
            };
            w.split('_')
                .map(|p| {
                    let mut c = p.chars();
                    c.next().map_or_else(String::new, |f| {
                        f.to_ascii_uppercase().to_string() + &c.as_str().to_ascii_lowercase()
                    })
                })
                .collect::<String>()
        })
        .collect()
}

impl ParseCallbacks for AbiNames {
    fn item_name(&self, item: ItemInfo) -> Option<String> {
        match item.kind {
            ItemKind::Type if !item.name.starts_with("__") => Some(camel(item.name)),
            _ => None,
        }
    }

    fn enum_variant_name(
        &self,
        enum_name: Option<&str>,
        variant: &str,
        _value: EnumVariantValue,
    ) -> Option<String> {
        let name = enum_name?.trim_start_matches("enum ");
        let prefix = format!("{}_", name.to_ascii_uppercase());
        Some(camel(variant.strip_prefix(&prefix).unwrap_or(variant)))
    }

    fn int_macro(&self, name: &str, _value: i64) -> Option<IntKind> {
        Some(if USIZE_CONSTANTS.contains(&name) {
            IntKind::Custom {
                name: "usize",
                is_signed: false,
            }
        } else if U64_CONSTANTS.contains(&name) {
            IntKind::U64
        } else {
            IntKind::U32
        })
    }
}

/// `$OUT_DIR/abi.rs`: the structs and constants of `src/bpf/shared.h`, with bindgen's layout
/// checks (each struct's size, alignment and field offsets as clang laid them out).
fn generate_abi(multiarch: &str, out: &Path) {
    let bindings = bindgen::Builder::default()
        .header("src/bpf/shared.h")
        .clang_arg(format!("-I{multiarch}"))
        .allowlist_file(".*/shared\\.h")
        .rustified_enum("py_.*_kind")
        .prepend_enum_name(false)
        .derive_default(true)
        .derive_eq(true)
        .derive_partialeq(true)
        .layout_tests(true)
        .parse_callbacks(Box::new(AbiNames))
        .generate()
        .unwrap_or_else(|e| {
            panic!(
                "bindgen cannot read src/bpf/shared.h ({e}): install Debian's libclang-dev (`cargo xtask deps` does)"
            )
        });
    bindings
        .write_to_file(out.join("abi.rs"))
        .expect("write abi.rs");
}

/// Entries of the allocation sampler's exponential table (a power of two).
const EXP_TABLE_SIZE: usize = 1024;
/// Fixed-point shift of its entries.
const EXP_TABLE_SHIFT: u32 = 16;

/// Writes `exp_table.h`: entry k is E[-ln U | U in [k/N, (k+1)/N)] (U uniform) in 16.16
/// fixed point, so a random entry times the mean is an exponential gap with exactly that mean
/// (the entries average to 1), without floating point in the kernel.
fn write_exp_table(out: &std::path::Path) {
    let n = EXP_TABLE_SIZE as f64;
    // The integral of -ln u is u - u ln u (0 at 0).
    let f = |u: f64| if u <= 0.0 { 0.0 } else { u - u * u.ln() };
    let mut text = format!(
        "// Generated by build.rs: conditional means of -ln(U) over {EXP_TABLE_SIZE} slices.\n\
         #pragma once\n#define EXP_TABLE_SIZE {EXP_TABLE_SIZE}\n#define EXP_TABLE_SHIFT {EXP_TABLE_SHIFT}\n\
         static const __u32 exp_table[EXP_TABLE_SIZE] = {{\n"
    );
    for k in 0..EXP_TABLE_SIZE {
        let (a, b) = (k as f64 / n, (k + 1) as f64 / n);
        let mean = n * (f(b) - f(a));
        let v = (mean * f64::from(1u32 << EXP_TABLE_SHIFT)).round() as u64;
        text.push_str(&format!("{v},"));
        if k % 8 == 7 {
            text.push('\n');
        }
    }
    text.push_str("};\n");
    std::fs::write(out.join("exp_table.h"), text).expect("write exp_table.h");
}
