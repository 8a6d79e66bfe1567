//! `verifier`: every kernel program loaded in every configuration on this kernel, and what
//! the verifier spent on each, against the budget (a tenth of its limit).

use std::path::Path;

use crate::command::CommandError;

pub use crate::bpf::load::VERIFIER_BUDGET;
pub use crate::bpf::verifier::Row;

/// The verifier table of the running kernel (or of the kernel whose BTF is `btf_path`).
pub struct Table {
    /// One row per program and configuration.
    pub rows: Vec<Row>,
    /// The kernel's release.
    pub kernel: String,
}

impl Table {
    /// Loads every program in every configuration; needs the sampling privileges.
    pub fn measure(btf_path: Option<&Path>) -> Result<Table, CommandError> {
        crate::command::check_sampling_privileges()?;
        let btf = crate::bpf::btf_path_or_default(btf_path);
        let rows = crate::bpf::verifier::verify_all(&btf)
            .map_err(|e| CommandError::Kernel(e.to_string()))?;
        Ok(Table {
            rows,
            kernel: crate::bpf::load::kernel_release(),
        })
    }

    /// The table as text.
    pub fn render(&self) -> String {
        crate::bpf::verifier::render(&self.rows, &self.kernel)
    }

    /// The table as JSON.
    pub fn to_json(&self) -> serde_json::Value {
        crate::bpf::verifier::to_json(&self.rows, &self.kernel)
    }

    /// Programs refused or over the budget.
    pub fn failed(&self) -> usize {
        self.rows.iter().filter(|r| r.failed()).count()
    }
}
