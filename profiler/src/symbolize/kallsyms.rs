//! Kernel symbols from `/proc/kallsyms`, parsed into a sorted table. Parsed ourselves rather
//! than through blazesym's kernel source so module symbols keep their module and nothing
//! goes looking for a vmlinux image.
//!
//! The kernel formats the whole file on each read (some 45 ms of its CPU for 120,000 lines),
//! the largest single cost of a one-second `record`. The core kernel's and the modules' symbols
//! do not change until a module comes or goes, so a root run keeps them in a file per boot
//! ([`cache`]) and reads that instead; an address outside the core text and the modules listed
//! then (a BPF program, a trampoline, a module loaded since) has the file read after all.

mod cache;

use std::cell::OnceCell;
use std::path::{Path, PathBuf};

pub(crate) use cache::{CacheSpec, default_dir};

/// Where a symbolizer keeps the kernel's symbols between runs.
#[derive(Debug)]
pub(crate) enum KeptFile {
    /// Decided at the first kernel frame: the default file for a root run on the host's
    /// kallsyms, none otherwise.
    Default,
    /// No such file: kallsyms is read whole (tests, a long-lived agent, not root).
    None,
    At(CacheSpec),
}

/// Kallsyms gives no sizes: a symbol ends where the next begins. Past the last symbol of a
/// region (the end of core text before module space) that rule would name arbitrarily far
/// addresses, so stop at a distance no real kernel function reaches.
const MAX_SYMBOL_SPAN: u64 = 1 << 20;

/// Symbols sorted by address, their names in one string (a `String` each took twice the
/// memory and most of the parse).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Table {
    addrs: Vec<u64>,
    /// Where each name ends in `names` (it starts where the previous one ends).
    ends: Vec<u32>,
    /// Names, `name [module]` for module symbols.
    names: String,
}

impl Table {
    fn name(&self, i: usize) -> &str {
        let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
        &self.names[start..self.ends[i] as usize]
    }

    fn lookup(&self, addr: u64) -> Option<(u64, &str)> {
        let i = self.addrs.partition_point(|&a| a <= addr).checked_sub(1)?;
        let start = self.addrs[i];
        (addr - start < MAX_SYMBOL_SPAN).then(|| (start, self.name(i)))
    }

    fn len(&self) -> usize {
        self.addrs.len()
    }
}

/// Code symbols of the text as (address, name, module), sorted by address, aliases in the
/// order listed; whether it had any line at all, and the core text's bounds (`_stext`,
/// `_etext`) when listed.
struct Parsed<'a> {
    syms: Vec<(u64, &'a str, Option<&'a str>)>,
    any: bool,
    core: Option<(u64, u64)>,
}

/// Symbols of pseudo-modules the kernel makes and drops as it runs (BPF programs, ftrace and
/// kprobe trampolines): never kept in the cache file.
fn dynamic_module(module: &str) -> bool {
    module == "[bpf]" || module.starts_with("[__builtin")
}

fn parse_text(text: &str) -> Parsed<'_> {
    let (mut any, mut stext, mut etext) = (false, None, None);
    let mut syms: Vec<(u64, &str, Option<&str>)> = Vec::with_capacity(text.len() / 40);
    for line in text.lines() {
        let mut parts = line.split_whitespace();
        let (Some(addr), Some(ty), Some(name)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        let Ok(addr) = u64::from_str_radix(addr, 16) else {
            continue;
        };
        any = true;
        match name {
            "_stext" => stext = Some(addr),
            "_etext" => etext = Some(addr),
            _ => {}
        }
        // Only code: data symbols would split functions' ranges.
        if !matches!(ty, "t" | "T" | "w" | "W") || addr == 0 {
            continue;
        }
        syms.push((addr, name, parts.next()));
    }
    // Stable: aliases share an address, and the first listed is the one the kernel prints.
    syms.sort_by_key(|s| s.0);
    Parsed {
        syms,
        any,
        core: stext.zip(etext).filter(|(s, e)| s < e),
    }
}

impl Table {
    /// The table of `syms` (sorted by address), the first of each address's aliases.
    fn build<'a>(syms: impl Iterator<Item = &'a (u64, &'a str, Option<&'a str>)>) -> Table {
        let mut table = Table::default();
        for &(addr, name, module) in syms {
            if table.addrs.last() == Some(&addr) {
                continue;
            }
            table.addrs.push(addr);
            table.names.push_str(name);
            if let Some(m) = module {
                table.names.push(' ');
                table.names.push_str(m);
            }
            table
                .ends
                .push(u32::try_from(table.names.len()).unwrap_or(u32::MAX));
        }
        table
    }
}

#[derive(Debug, Default)]
pub(crate) struct Kallsyms {
    table: Table,
    /// Every address read as 0: kptr_restrict hides them from us.
    pub restricted: bool,
    /// When `table` came from the cache file: the ranges it answers for (the core text, the
    /// modules of its boot), the file to read for any other address, and that read.
    cached: Option<Cached>,
}

#[derive(Debug)]
struct Cached {
    covered: Vec<(u64, u64)>,
    path: PathBuf,
    full: OnceCell<Table>,
}

impl Kallsyms {
    /// The symbols of `path`; with `cache`, from its file when one is there for this boot and
    /// module set, else read from `path` and written to it for the next run.
    pub fn load(path: &Path, cache: Option<&CacheSpec>) -> Kallsyms {
        if let Some(spec) = cache
            && let Some((table, covered)) = spec.read()
        {
            return Kallsyms {
                table,
                restricted: false,
                cached: Some(Cached {
                    covered,
                    path: path.to_path_buf(),
                    full: OnceCell::new(),
                }),
            };
        }
        let Ok(text) = std::fs::read_to_string(path) else {
            return Kallsyms::default();
        };
        let parsed = parse_text(&text);
        let k = Self::from_parsed(&parsed);
        if let Some(spec) = cache
            && !k.restricted
            && let Some(core) = parsed.core
        {
            let kept = parsed
                .syms
                .iter()
                .filter(|s| !s.2.is_some_and(dynamic_module));
            // Best effort: a read-only cache directory leaves every run reading the file.
            let _ = spec.write(&Table::build(kept), core);
        }
        k
    }

    #[cfg(test)]
    pub fn parse(text: &str) -> Kallsyms {
        Self::from_parsed(&parse_text(text))
    }

    fn from_parsed(parsed: &Parsed<'_>) -> Kallsyms {
        let table = Table::build(parsed.syms.iter());
        Kallsyms {
            restricted: parsed.any && table.len() == 0,
            table,
            cached: None,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.table.len() == 0
    }

    pub fn lookup(&self, addr: u64) -> Option<&str> {
        let Some(c) = &self.cached else {
            return self.table.lookup(addr).map(|(_, name)| name);
        };
        if c.covered.iter().any(|&(s, e)| (s..e).contains(&addr)) {
            return self.table.lookup(addr).map(|(_, name)| name);
        }
        let full = c.full.get_or_init(|| {
            std::fs::read_to_string(&c.path)
                .map(|t| Table::build(parse_text(&t).syms.iter()))
                .unwrap_or_default()
        });
        full.lookup(addr).map(|(_, name)| name)
    }

    /// Whether the symbols came from the cache file (for tests).
    #[cfg(test)]
    pub fn came_from_cache(&self) -> bool {
        self.cached.is_some()
    }

    /// Whether an address made it read the kallsyms file after all (for tests).
    #[cfg(test)]
    pub fn read_in_full(&self) -> bool {
        self.cached.as_ref().is_some_and(|c| c.full.get().is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sorts_and_bounds() {
        let k = Kallsyms::parse(
            "\
ffffffff81000000 T _stext
ffffffff81000000 T _text
ffffffff81001000 t helper
ffffffff82000000 D some_data
ffffffffc0001000 t mod_fn\t[nf_tables]
ffffffff81000800 T second
",
        );
        assert!(!k.restricted);
        assert_eq!(k.lookup(0xffffffff81000000), Some("_stext"));
        assert_eq!(k.lookup(0xffffffff81000900), Some("second"));
        assert_eq!(k.lookup(0xffffffff81001004), Some("helper"));
        assert_eq!(k.lookup(0xffffffffc0001010), Some("mod_fn [nf_tables]"));
        assert_eq!(k.lookup(0xffffffff80000000), None);
        assert_eq!(k.lookup(0xffffffff81001000 + MAX_SYMBOL_SPAN), None);

        let hidden = Kallsyms::parse("0000000000000000 T _stext\n0000000000000000 t x\n");
        assert!(hidden.restricted && hidden.is_empty());
    }
}
