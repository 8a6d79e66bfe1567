//! Kernel frames: named from kallsyms, read once per symbolizer (or from the symbols a
//! root run kept, see `kallsyms`).

use std::path::Path;

use super::kallsyms::{self, Kallsyms};
use super::{Frame, FrameKind, KERNEL_MODULE, Symbolizer, UNKNOWN};

impl Symbolizer {
    /// Reads `/proc/kallsyms` whole rather than the symbols kept from an earlier run (see
    /// `kallsyms`): for a long-lived process that cannot read it later.
    pub fn without_kallsyms_cache(mut self) -> Self {
        self.kallsyms_cache = kallsyms::KeptFile::None;
        self
    }

    /// Whether kernel symbols are readable (kallsyms present and not hidden by kptr_restrict).
    pub fn kernel_available(&mut self) -> bool {
        !self.kallsyms().is_empty()
    }

    /// Kallsyms listed symbols but every address read as 0 (kptr_restrict, or no
    /// CAP_SYSLOG): say so rather than leaving kernel frames silently unnamed.
    pub fn kernel_restricted(&mut self) -> bool {
        self.kallsyms().restricted
    }

    fn kallsyms(&mut self) -> &Kallsyms {
        if self.kallsyms.is_none() {
            if matches!(self.kallsyms_cache, kallsyms::KeptFile::Default) {
                let host = self.kallsyms_path == Path::new("/proc/kallsyms");
                self.kallsyms_cache = kallsyms::default_dir()
                    .filter(|_| host)
                    .and_then(kallsyms::CacheSpec::of_host)
                    .map_or(kallsyms::KeptFile::None, kallsyms::KeptFile::At);
            }
            let spec = match &self.kallsyms_cache {
                kallsyms::KeptFile::At(spec) => Some(spec),
                _ => None,
            };
            self.kallsyms = Some(Kallsyms::load(&self.kallsyms_path, spec));
        }
        self.kallsyms.get_or_insert_default()
    }

    /// Symbolizes a kernel stack (leaf first, the first the sampled IP, the rest return
    /// addresses). Frame addresses are the absolute addresses given.
    pub fn kernel(&mut self, addrs: &[u64]) -> Vec<Frame> {
        let k = self.kallsyms();
        let frames: Vec<Frame> = addrs
            .iter()
            .enumerate()
            .map(|(i, &addr)| {
                let lookup = if i == 0 { addr } else { addr.saturating_sub(1) };
                let name = k.lookup(lookup);
                Frame {
                    function: name.unwrap_or(UNKNOWN).to_string(),
                    file: None,
                    line: None,
                    module: Some(KERNEL_MODULE.to_string()),
                    build_id: None,
                    address: addr,
                    kind: if name.is_some() {
                        FrameKind::Kernel
                    } else {
                        FrameKind::Unknown
                    },
                    inlined: false,
                }
            })
            .collect();
        for f in &frames {
            self.count(f.kind != FrameKind::Unknown);
        }
        frames
    }
}
