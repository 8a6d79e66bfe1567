//! Retention on ClickHouse: whole day partitions are dropped once every bucket in them is
//! older than the retention, then the label sets and stacks no sample row uses any more are
//! removed (see [`super::intern`] for why a collector never loses one it is about to use).

use super::intern::GRACE_S;
use super::rowbinary::Reader;
use super::{ClickHouseStore, IN_CHUNK, list, schema};
use crate::store::StoreError;

impl ClickHouseStore {
    /// Drops the partitions older than `before_s`; the rows removed.
    pub(super) fn drop_partitions(&self, before_s: i64) -> Result<u64, StoreError> {
        let tables = schema::SAMPLE_TABLES
            .iter()
            .map(|t| format!("'{t}'"))
            .collect::<Vec<_>>()
            .join(", ");
        let raw = self.select_raw(&format!(
            "SELECT table, partition, toUInt64(sum(rows)) FROM system.parts
             WHERE database = '{}' AND table IN ({tables}) AND active
             GROUP BY table, partition",
            self.db
        ))?;
        let mut r = Reader::new(&raw);
        let mut removed = 0;
        while !r.is_empty() {
            let table = r.str()?;
            let partition = r.str()?;
            let rows = r.u64()?;
            let day: i64 = partition
                .trim_matches('\'')
                .parse()
                .map_err(|_| StoreError::Corrupt(format!("partition '{partition}'")))?;
            if (day + 1) * 86_400 <= before_s {
                let sql = format!("ALTER TABLE {}.{table} DROP PARTITION {day}", self.db);
                self.client.post(&[], sql.as_bytes())?;
                removed += rows;
            }
        }
        Ok(removed)
    }

    /// Removes label sets and stacks that no sample row uses and that were written at least
    /// [`GRACE_S`] ago; returns how many of each. Skipped while version 1 collectors (which
    /// never write a cached entry again) may still be ingesting.
    pub(super) fn prune(&self) -> Result<(u64, u64), StoreError> {
        let raw = self.select_raw(&format!(
            "SELECT toUInt64(now()) - {GRACE_S},
                    (SELECT count() FROM {db}.samples WHERE bucket >= toInt64(now()) - {GRACE_S})",
            db = self.db
        ))?;
        let mut r = Reader::new(&raw);
        let (cutoff, recent_v1) = (r.u64()?, r.u64()?);
        if recent_v1 > 0 {
            return Ok((0, 0));
        }
        let labelsets = self.prune_table("labelsets", "labelset", cutoff)?;
        let stacks = self.prune_table("stacks", "stack", cutoff)?;
        let mut caches = self.caches();
        for id in &labelsets {
            caches.labelsets.remove(id);
        }
        for id in &stacks {
            caches.stacks.remove(id);
        }
        Ok((labelsets.len() as u64, stacks.len() as u64))
    }

    /// Deletes the rows of `table` written before `cutoff` whose id no sample row names in
    /// `column`; the ids.
    fn prune_table(&self, table: &str, column: &str, cutoff: u64) -> Result<Vec<u64>, StoreError> {
        let unused = self.select_ids(&format!(
            "SELECT DISTINCT id FROM {db}.{table}
             WHERE at < toDateTime({cutoff})
               AND id NOT IN (SELECT DISTINCT {column} FROM {db}.all_samples WHERE type != 0)",
            db = self.db
        ))?;
        for chunk in unused.chunks(IN_CHUNK) {
            // Only the old rows: a collector may have written the entry again since.
            let sql = format!(
                "ALTER TABLE {}.{table} DELETE WHERE id IN ({}) AND at < toDateTime({cutoff})",
                self.db,
                list(chunk)
            );
            self.client.post(
                &[("max_query_size", &(sql.len() + 1024).to_string())],
                sql.as_bytes(),
            )?;
        }
        Ok(unused)
    }
}
