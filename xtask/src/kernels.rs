//! `cargo xtask kernels [NAME...]`: the kernel matrix by hand. The runner lives in the e2e
//! crate (tests/src/kernels), next to the fixtures its payload profiles and the readers its
//! checks use; the test command runs the same code as tests/tests/kernels.rs.

use anyhow::Result;

use crate::{apt, build_dir, cargo, deps, run};

/// Builds what the payload runs, unpacks qemu (apt.rs), then runs the matrix (every kernel, or
/// those named: see `KERNELS` in tests/src/kernels/mod.rs, plus `host`) and prints its summary
/// table.
pub fn kernels(names: &[String]) -> Result<()> {
    deps()?;
    apt::matrix_tools(&build_dir())?;
    run(cargo().args(["build", "-p", "pyrometer", "--bin", "pyrometer"]))?;
    matrix(names)
}

/// The e2e crate's `kernel-matrix` runner with `args` (kernel names, or `--fetch`).
pub fn matrix(args: &[String]) -> Result<()> {
    run(cargo()
        .args([
            "run",
            "-q",
            "-p",
            "pyrometer-e2e",
            "--bin",
            "kernel-matrix",
            "--",
        ])
        .args(args))
}
