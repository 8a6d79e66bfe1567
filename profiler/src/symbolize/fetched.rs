//! The symbolizer's side of debuginfod: which binaries ask for a debug file, and what it
//! forgets when one arrives so that the binary's frames are named again from it.

use std::time::Duration;

use super::debuginfod::{Debuginfod, DebuginfodConfig};
use super::elf::ElfInfo;
use super::{ModKey, Symbolizer};

impl Symbolizer {
    /// Fetches the debug files of binaries stripped of their symbols, and without a debug
    /// file on the machine, from debuginfod servers, into the on-disk cache.
    pub fn with_debuginfod(mut self, cfg: DebuginfodConfig) -> Self {
        self.debuginfod = Some(Debuginfod::new(cfg));
        self
    }

    /// The debuginfod client, when there is one (to make its cache directory).
    pub fn debuginfod(&self) -> Option<&Debuginfod> {
        self.debuginfod.as_ref()
    }

    /// Runs `f` (a pass over the stacks that only finds which debug files to fetch) without
    /// counting its lookups in [`Symbolizer::stats`].
    pub fn uncounted<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        let stats = self.stats;
        let r = f(self);
        self.stats = stats;
        r
    }

    /// Waits up to `wait` for the debug files on their way, then forgets what was read
    /// without them. Returns the downloads still under way.
    pub fn wait_for_debug_files(&mut self, wait: Duration) -> usize {
        let Some(d) = self.debuginfod.as_mut() else {
            return 0;
        };
        let arrived = d.wait(wait);
        let pending = d.pending();
        self.forget_build_ids(&arrived);
        pending
    }

    /// Forgets what was read of the binaries whose debug file has arrived since the last
    /// call. Called between profiles, never within one: a file taken in the middle would name
    /// the stacks symbolized after it and leave those before it unnamed, skewing the named
    /// part of that profile toward the stacks symbolized last.
    pub(crate) fn take_debug_files(&mut self) {
        if let Some(d) = self.debuginfod.as_mut() {
            let arrived = d.poll();
            self.forget_build_ids(&arrived);
        }
    }

    fn forget_build_ids(&mut self, ids: &[String]) {
        if ids.is_empty() {
            return;
        }
        self.elves.retain(|_, info| {
            info.as_ref()
                .and_then(|i| i.build_id.as_ref())
                .is_none_or(|id| !ids.contains(id))
        });
        self.results.retain(|(m, _), _| match m {
            ModKey::BuildId(id) => !ids.contains(id),
            ModKey::File(_) => true,
        });
    }

    /// Asks again for the debug files of the binaries still held without one: a binary
    /// whose every address is already named from its symbol table is not read again, so a
    /// download that failed (retried once its failure expires) or found no free worker would
    /// otherwise never be asked for again. Ids on their way, arrived or recently found absent
    /// are skipped by the client.
    pub(super) fn ask_again_for_debug_files(&mut self) {
        let names_only = self.dwarf_budget == Some(0);
        let Some(d) = self.debuginfod.as_mut() else {
            return;
        };
        for info in self.elves.values().flatten() {
            if let Some(id) = wanted(info, names_only) {
                d.request(id);
            }
        }
    }

    /// Asks for the debug file of a binary read without one.
    pub(super) fn want_debug_file(&mut self, info: Option<&ElfInfo>) {
        let names_only = self.dwarf_budget == Some(0);
        let (Some(d), Some(info)) = (self.debuginfod.as_mut(), info) else {
            return;
        };
        if let Some(id) = wanted(info, names_only) {
            d.request(id);
        }
    }
}

/// The build id to fetch a debug file for, if one would name more of the binary: none is on
/// the machine, and it has no symbol table of its own or its DWARF is read (lines, inlined
/// functions). A symbolizer that reads no DWARF (the agent's default) gains nothing from the
/// debug file of a binary that kept its symbol table.
fn wanted(info: &ElfInfo, names_only: bool) -> Option<&str> {
    let named_enough = info.debug_syms || (names_only && info.symtab);
    let useful = !named_enough;
    info.build_id.as_deref().filter(|_| useful)
}
