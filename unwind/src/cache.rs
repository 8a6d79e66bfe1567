//! Per-node cache of built tables, so that one libc is compiled once however many processes
//! map it.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use crate::{UnwindError, UnwindTable, build_table};

/// The default budget: as many rows as the BPF row array holds by default (1 Mi rows of
/// 12 bytes), since a table that does not fit there is of no use here either.
pub const DEFAULT_BUDGET_BYTES: usize = (1 << 20) * crate::ROW_BYTES;

/// What identifies an executable's contents across processes and mount namespaces.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum CacheKey {
    /// The GNU build-id as lowercase hex (see [`crate::build_id`]): the same library in two
    /// containers shares one table.
    BuildId(String),
    /// For objects without a build-id. The path is part of the key so that an inode number
    /// reused after the file was replaced, on a filesystem without stable inodes, is less
    /// likely to alias.
    File { dev: u64, inode: u64, path: PathBuf },
}

impl CacheKey {
    /// The build-id key when `elf` has a build-id, the file key otherwise.
    pub fn for_object(elf: &[u8], dev: u64, inode: u64, path: impl Into<PathBuf>) -> CacheKey {
        match crate::build_id(elf) {
            Some(id) => CacheKey::BuildId(id),
            None => CacheKey::File {
                dev,
                inode,
                path: path.into(),
            },
        }
    }
}

/// Counters of a [`TableCache`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Lookups answered from the cache.
    pub hits: u64,
    /// Lookups that built a table (successfully or not).
    pub misses: u64,
    /// Builds that failed (unreadable or unparsable object); failures are not cached.
    pub failures: u64,
    /// Tables dropped to stay within the budget, least recently used first.
    pub evictions: u64,
    /// Tables dropped by [`TableCache::evict`].
    pub removals: u64,
    /// Tables held now.
    pub tables: usize,
    /// Row bytes of the tables held now ([`UnwindTable::bytes`]).
    pub bytes: usize,
}

struct Entry {
    table: Arc<UnwindTable>,
    last_used: u64,
}

/// Built tables by [`CacheKey`], within a byte budget.
///
/// Single-threaded by design (the agent owns it from one thread), but `Send`.
/// The budget counts row bytes of the tables the cache holds; an evicted table stays alive
/// while a caller still holds its `Arc`. A table bigger than the whole budget is kept (alone)
/// rather than rebuilt at every lookup.
pub struct TableCache {
    entries: HashMap<CacheKey, Entry>,
    budget: usize,
    clock: u64,
    stats: CacheStats,
    evicted: Vec<CacheKey>,
}

impl Default for TableCache {
    fn default() -> Self {
        Self::new()
    }
}

impl TableCache {
    /// A cache with [`DEFAULT_BUDGET_BYTES`].
    pub fn new() -> Self {
        Self::with_budget(DEFAULT_BUDGET_BYTES)
    }

    pub fn with_budget(bytes: usize) -> Self {
        TableCache {
            entries: HashMap::new(),
            budget: bytes,
            clock: 0,
            stats: CacheStats::default(),
            evicted: Vec::new(),
        }
    }

    /// The table for `key`, built from the bytes `read` returns when it is not cached.
    /// `read` is only called on a miss, so opening the file can be left to it.
    pub fn get_or_build<F, B>(
        &mut self,
        key: &CacheKey,
        read: F,
    ) -> Result<Arc<UnwindTable>, UnwindError>
    where
        F: FnOnce() -> std::io::Result<B>,
        B: AsRef<[u8]>,
    {
        if let Some(table) = self.get(key) {
            return Ok(table);
        }
        self.stats.misses += 1;
        let built = read()
            .map_err(UnwindError::from)
            .and_then(|bytes| build_table(bytes.as_ref()));
        let table = match built {
            Ok(table) => Arc::new(table),
            Err(e) => {
                self.stats.failures += 1;
                return Err(e);
            }
        };
        self.clock += 1;
        self.stats.bytes += table.bytes();
        self.stats.tables += 1;
        self.entries.insert(
            key.clone(),
            Entry {
                table: Arc::clone(&table),
                last_used: self.clock,
            },
        );
        self.shrink_to_budget(key);
        Ok(table)
    }

    /// The cached table for `key`, counting a hit and marking it recently used.
    pub fn get(&mut self, key: &CacheKey) -> Option<Arc<UnwindTable>> {
        let entry = self.entries.get_mut(key)?;
        self.clock += 1;
        entry.last_used = self.clock;
        self.stats.hits += 1;
        Some(Arc::clone(&entry.table))
    }

    pub fn contains(&self, key: &CacheKey) -> bool {
        self.entries.contains_key(key)
    }

    /// Drops the table of an executable no longer mapped by any process. Returns whether
    /// there was one.
    pub fn evict(&mut self, key: &CacheKey) -> bool {
        match self.entries.remove(key) {
            Some(entry) => {
                self.forget(&entry);
                self.stats.removals += 1;
                true
            }
            None => false,
        }
    }

    /// The keys dropped for the budget since the last call, oldest first, so that the caller
    /// can free their rows in the BPF array too.
    pub fn take_evicted(&mut self) -> Vec<CacheKey> {
        std::mem::take(&mut self.evicted)
    }

    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    pub fn budget(&self) -> usize {
        self.budget
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn forget(&mut self, entry: &Entry) {
        self.stats.bytes -= entry.table.bytes();
        self.stats.tables -= 1;
    }

    fn shrink_to_budget(&mut self, keep: &CacheKey) {
        while self.stats.bytes > self.budget {
            // A linear scan: a node maps hundreds of executables, not millions.
            let victim = self
                .entries
                .iter()
                .filter(|(k, _)| *k != keep)
                .min_by_key(|(_, e)| e.last_used)
                .map(|(k, _)| k.clone());
            let Some(victim) = victim else { break };
            if let Some(entry) = self.entries.remove(&victim) {
                self.forget(&entry);
                self.stats.evictions += 1;
                self.evicted.push(victim);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CFA_RSP, UnwindRow};

    fn assert_send<T: Send>() {}

    #[test]
    fn cache_is_send() {
        assert_send::<TableCache>();
    }

    fn key(name: &str) -> CacheKey {
        CacheKey::BuildId(name.to_string())
    }

    /// Tables built from bytes are tested with real objects in tests/; here the accounting.
    fn fake(cache: &mut TableCache, name: &str, rows: usize) {
        let table = UnwindTable {
            rows: (0..rows as u32)
                .map(|pc| UnwindRow::bare(pc, CFA_RSP))
                .collect(),
            ..UnwindTable::default()
        };
        cache.clock += 1;
        cache.stats.bytes += table.bytes();
        cache.stats.tables += 1;
        cache.entries.insert(
            key(name),
            Entry {
                table: Arc::new(table),
                last_used: cache.clock,
            },
        );
        cache.shrink_to_budget(&key(name));
    }

    #[test]
    fn least_recently_used_goes_first() {
        let mut cache = TableCache::with_budget(30 * 12);
        fake(&mut cache, "a", 10);
        fake(&mut cache, "b", 10);
        fake(&mut cache, "c", 10);
        assert!(cache.get(&key("a")).is_some());
        fake(&mut cache, "d", 10);
        assert!(!cache.contains(&key("b")));
        assert!(cache.contains(&key("a")) && cache.contains(&key("c")));
        assert_eq!(cache.take_evicted(), vec![key("b")]);
        assert!(cache.take_evicted().is_empty());
        assert_eq!(cache.stats().bytes, 30 * 12);
        // Bigger than the budget: everything else goes, the newcomer stays.
        fake(&mut cache, "huge", 100);
        assert_eq!(cache.len(), 1);
        assert!(cache.contains(&key("huge")));
        assert_eq!(cache.stats().evictions, 4);
    }
}
