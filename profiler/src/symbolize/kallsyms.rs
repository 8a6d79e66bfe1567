//! Kernel symbols from `/proc/kallsyms`, parsed into a sorted table. Parsed ourselves rather
//! than through blazesym's kernel source so module symbols keep their module and nothing
//! goes looking for a vmlinux image.

use std::path::Path;

/// Kallsyms gives no sizes: a symbol ends where the next begins. Past the last symbol of a
/// region (the end of core text before module space) that rule would name arbitrarily far
/// addresses, so stop at a distance no real kernel function reaches.
const MAX_SYMBOL_SPAN: u64 = 1 << 20;

#[derive(Debug, Default)]
pub(crate) struct Kallsyms {
    /// (address, name with ` [module]` suffix for module symbols), sorted by address.
    syms: Vec<(u64, String)>,
    /// Every address read as 0: kptr_restrict hides them from us.
    pub restricted: bool,
}

impl Kallsyms {
    pub fn load(path: &Path) -> Kallsyms {
        std::fs::read_to_string(path)
            .map(|t| Self::parse(&t))
            .unwrap_or_default()
    }

    pub fn parse(text: &str) -> Kallsyms {
        let mut any = false;
        let mut syms: Vec<(u64, String)> = text
            .lines()
            .filter_map(|line| {
                let mut parts = line.split_whitespace();
                let addr = u64::from_str_radix(parts.next()?, 16).ok()?;
                let ty = parts.next()?;
                let name = parts.next()?;
                any = true;
                // Only code: data symbols would split functions' ranges.
                if !matches!(ty, "t" | "T" | "w" | "W") || addr == 0 {
                    return None;
                }
                Some(match parts.next() {
                    Some(module) => (addr, format!("{name} {module}")),
                    None => (addr, name.to_string()),
                })
            })
            .collect();
        syms.sort_by_key(|s| s.0);
        // Aliases share an address; the first listed is the one the kernel itself prints.
        syms.dedup_by_key(|s| s.0);
        Kallsyms {
            restricted: any && syms.is_empty(),
            syms,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.syms.is_empty()
    }

    pub fn lookup(&self, addr: u64) -> Option<&str> {
        let i = self.syms.partition_point(|s| s.0 <= addr).checked_sub(1)?;
        let (start, name) = &self.syms[i];
        (addr - start < MAX_SYMBOL_SPAN).then_some(name.as_str())
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
