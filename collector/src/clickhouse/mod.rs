//! The shared store: ClickHouse over its HTTP interface, for any number of stateless
//! collectors. Label sets, stacks and sample types are interned by a hash of their content
//! (see [`ids`]), so collectors agree on ids without coordination and cache them only to
//! save round trips. Schema, versioning and the exactly-once rule: [`schema`].

mod http;
mod ids;
mod intern;
mod merged;
mod retention;
mod rowbinary;
pub mod schema;

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use http::{Client, HttpError};
use rowbinary::{Reader, Writer};

use crate::store::{
    BUCKET_SECONDS, Batch, Ingested, LabelSet, Point, Selection, Stack, Stacked, Store, StoreError,
};

/// Where the store is: `clickhouse://HOST[:PORT]/DATABASE` (HTTP interface, port 8123 by
/// default), or `clickhouses://` over HTTPS (port 8443 by default). Credentials never appear
/// in it; they come from a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    pub host: String,
    pub port: u16,
    pub database: String,
    /// HTTPS, checked against `ca` (a PEM file) or else the system's roots.
    pub tls: bool,
    pub ca: Option<std::path::PathBuf>,
}

impl Location {
    pub fn parse(url: &str) -> Result<Self, String> {
        let (rest, tls) = match url.strip_prefix("clickhouses://") {
            Some(rest) => (rest, true),
            None => (
                url.strip_prefix("clickhouse://").ok_or_else(|| {
                    format!("'{url}' is not clickhouse://HOST:PORT/DATABASE (or clickhouses://)")
                })?,
                false,
            ),
        };
        let (authority, database) = rest.split_once('/').ok_or_else(|| {
            format!("'{url}' names no database: use clickhouse://HOST:PORT/DATABASE")
        })?;
        if authority.contains('@') {
            return Err(format!(
                "'{url}' carries credentials: put USER:PASSWORD in a file and pass \
                 --store-credentials FILE instead"
            ));
        }
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) => (
                h,
                p.parse::<u16>()
                    .map_err(|_| format!("bad port '{p}' in '{url}'"))?,
            ),
            None => (authority, if tls { 8443 } else { 8123 }),
        };
        if host.is_empty() {
            return Err(format!("'{url}' names no host"));
        }
        let valid = database
            .chars()
            .enumerate()
            .all(|(i, c)| c == '_' || c.is_ascii_alphabetic() || (i > 0 && c.is_ascii_digit()));
        if database.is_empty() || !valid {
            return Err(format!(
                "bad database name '{database}' in '{url}': use letters, digits and _"
            ));
        }
        Ok(Self {
            host: host.to_string(),
            port,
            database: database.to_string(),
            tls,
            ca: None,
        })
    }

    /// The TLS configuration of an HTTPS location.
    fn tls_config(&self) -> Result<Option<Arc<tokio_rustls::rustls::ClientConfig>>, StoreError> {
        use tokio_rustls::rustls::pki_types::CertificateDer;
        use tokio_rustls::rustls::pki_types::pem::PemObject;
        if !self.tls {
            return Ok(None);
        }
        let mut roots = tokio_rustls::rustls::RootCertStore::empty();
        match &self.ca {
            Some(path) => {
                let bad =
                    |e: String| StoreError::Schema(format!("the store CA {}: {e}", path.display()));
                for c in CertificateDer::pem_file_iter(path).map_err(|e| bad(e.to_string()))? {
                    roots
                        .add(c.map_err(|e| bad(e.to_string()))?)
                        .map_err(|e| bad(e.to_string()))?;
                }
            }
            None => {
                for c in rustls_native_certs::load_native_certs().certs {
                    let _ = roots.add(c);
                }
            }
        }
        if roots.is_empty() {
            return Err(StoreError::Schema(
                "no CA to check the ClickHouse server with: give --store-ca FILE".into(),
            ));
        }
        let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
        let config = tokio_rustls::rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| StoreError::Schema(e.to_string()))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Some(Arc::new(config)))
    }
}

/// Reads `USER:PASSWORD` (one line) from a credentials file.
pub fn read_credentials(path: &Path) -> Result<(String, String), String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the credentials file {}: {e}", path.display()))?;
    let line = text.lines().next().unwrap_or("").trim();
    match line.split_once(':') {
        Some((user, password)) if !user.is_empty() => Ok((user.to_string(), password.to_string())),
        _ => Err(format!(
            "the credentials file {} must hold USER:PASSWORD on its first line",
            path.display()
        )),
    }
}

/// Requests to ClickHouse that take longer fail as unavailable: under the agents' 5 s push
/// timeout, so an agent hears "retry" rather than nothing.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(4);
/// Largest answer read from ClickHouse (memory stays bounded whatever a query selects).
const MAX_ANSWER: usize = 1 << 30;
/// Ids per `IN (...)` list sent in one query.
const IN_CHUNK: usize = 20_000;

/// The largest value one sample row holds (saturated when written). ClickHouse sums `Int64`
/// columns in `Int64` and wraps; summing wider (Decimal128, or two halves) cost 45 to 60 % more
/// per grouped query on 18.16. With rows bounded here, a sum wraps only when one group of one
/// tenant's query holds 65,536 rows at the bound: a day of a core's CPU time in nanoseconds
/// is 2^46.
const MAX_ROW_VALUE: i64 = 1 << 47;

pub struct ClickHouseStore {
    client: Client,
    db: String,
    caches: Mutex<intern::Caches>,
}

impl From<HttpError> for StoreError {
    fn from(e: HttpError) -> Self {
        if e.is_unavailable() {
            StoreError::Unavailable(e.to_string())
        } else {
            StoreError::ClickHouse(e.to_string())
        }
    }
}

impl From<rowbinary::Malformed> for StoreError {
    fn from(e: rowbinary::Malformed) -> Self {
        StoreError::Corrupt(e.to_string())
    }
}

impl From<schema::SchemaError> for StoreError {
    fn from(e: schema::SchemaError) -> Self {
        match e {
            schema::SchemaError::Http(e) => e.into(),
            other => StoreError::Schema(other.to_string()),
        }
    }
}

fn bucket_of(time_s: i64) -> i64 {
    time_s - time_s.rem_euclid(BUCKET_SECONDS)
}

/// `a, b, c` of integers, for `IN (...)`.
fn list(ids: &[u64]) -> String {
    let mut s = String::with_capacity(ids.len() * 21);
    for (i, id) in ids.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        let _ = write!(s, "{id}");
    }
    s
}

impl ClickHouseStore {
    /// Connects, creates or upgrades the schema, and fails with the reason when ClickHouse
    /// cannot be reached or its schema is newer than this collector's.
    pub fn open(
        location: &Location,
        credentials: Option<(String, String)>,
        timeout: Duration,
    ) -> Result<Self, StoreError> {
        let client = Client::new(
            &location.host,
            location.port,
            credentials,
            timeout,
            MAX_ANSWER,
            location.tls_config()?,
        )?;
        schema::migrate(&client, &location.database)?;
        Ok(Self {
            client,
            db: location.database.clone(),
            caches: Mutex::default(),
        })
    }

    fn caches(&self) -> MutexGuard<'_, intern::Caches> {
        // The caches hold only what ClickHouse holds too: a poisoned one is still right.
        self.caches.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A SELECT whose answer is RowBinary. Long `IN` lists go in the body, so the query
    /// size limit is raised to fit. Within a query's deadline (see
    /// [`crate::store::with_deadline`]), ClickHouse is told to stop there and the answer is
    /// waited for until then.
    fn select_raw(&self, query: &str) -> Result<Vec<u8>, StoreError> {
        let text = format!("{query} FORMAT RowBinary");
        let size = (text.len() + 1024).max(262_144).to_string();
        // wait_end_of_query: an exception after the first rows still arrives as an error
        // status, not as a 200 with a message glued to the rows.
        let mut params = vec![
            ("database", self.db.as_str()),
            ("max_query_size", &size),
            ("wait_end_of_query", "1"),
        ];
        let Some(deadline) = crate::store::deadline() else {
            return Ok(self.client.post(&params, text.as_bytes())?);
        };
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(StoreError::Timeout);
        }
        let seconds = left.as_secs().max(1).to_string();
        params.push(("max_execution_time", &seconds));
        params.push(("timeout_overflow_mode", "throw"));
        match self
            .client
            .post_within(&params, text.as_bytes(), left + Duration::from_secs(1))
        {
            Ok(answer) => Ok(answer),
            Err(_) if Instant::now() >= deadline => Err(StoreError::Timeout),
            Err(e) => Err(e.into()),
        }
    }

    fn select_ids(&self, query: &str) -> Result<Vec<u64>, StoreError> {
        let raw = self.select_raw(query)?;
        let mut r = Reader::new(&raw);
        let mut out = Vec::with_capacity(raw.len() / 8);
        while !r.is_empty() {
            out.push(r.u64()?);
        }
        Ok(out)
    }

    fn insert(&self, table_and_columns: &str, rows: &[u8], count: usize) -> Result<(), StoreError> {
        let query = format!(
            "INSERT INTO {}.{table_and_columns} FORMAT RowBinary",
            self.db
        );
        // One block, so one part: an insert is then all or nothing.
        let block = (count + 1).max(1_048_576).to_string();
        self.client.post(
            &[("query", &query), ("max_insert_block_size", &block)],
            rows,
        )?;
        Ok(())
    }

    /// The condition that keeps the rows of each batch's first stored attempt in
    /// `[from_s, to_s)` (see [`schema`]).
    fn winners(&self, from_s: i64, to_s: i64) -> String {
        format!(
            "batch IN (SELECT min(batch) FROM {db}.all_samples
                       WHERE type = 0 AND bucket >= {from_s} AND bucket < {to_s}
                       GROUP BY agent, sequence)",
            db = self.db
        )
    }

    fn has_marker(&self, bucket: i64, agent: u64, sequence: u64) -> Result<bool, StoreError> {
        let raw = self.select_raw(&format!(
            "SELECT count() FROM {}.all_samples
             WHERE type = 0 AND bucket = {bucket} AND agent = {agent} AND sequence = {sequence}",
            self.db
        ))?;
        Ok(Reader::new(&raw).u64()? > 0)
    }

    /// Label sets of `ids`, from the cache or ClickHouse.
    fn labelsets(&self, ids: &[u64]) -> Result<HashMap<u64, Arc<LabelSet>>, StoreError> {
        self.fetch_by_id(
            ids,
            "labelsets",
            "labels",
            |c, id| c.labelsets.get(&id).cloned(),
            |c, id, v| {
                c.labelsets.insert(id, v);
            },
            |id, r| {
                let json = r.str()?;
                serde_json::from_str(&json)
                    .map(Arc::new)
                    .map_err(|e| StoreError::Corrupt(format!("label set {id}: {e}")))
            },
        )
    }

    /// Stacks of `ids`, from the cache or ClickHouse.
    fn stacks(&self, ids: &[u64]) -> Result<HashMap<u64, Stack>, StoreError> {
        self.fetch_by_id(
            ids,
            "stacks",
            "frames",
            |c, id| c.stacks.get(&id).cloned(),
            intern::Caches::add_stack,
            |_, r| {
                Ok(Arc::new(
                    r.strs()?.iter().map(|f| crate::frames::name(f).0).collect(),
                ))
            },
        )
    }

    /// Entries of an interned table by id: those the cache lacks are read, [`IN_CHUNK`] ids a
    /// query, with `read` decoding the `column`, and remembered.
    #[allow(clippy::too_many_arguments)]
    fn fetch_by_id<T: Clone>(
        &self,
        ids: &[u64],
        table: &str,
        column: &str,
        cached: impl Fn(&intern::Caches, u64) -> Option<T>,
        remember: impl Fn(&mut intern::Caches, u64, T),
        read: impl Fn(u64, &mut Reader<'_>) -> Result<T, StoreError>,
    ) -> Result<HashMap<u64, T>, StoreError> {
        let mut out = HashMap::with_capacity(ids.len());
        let mut missing = Vec::new();
        {
            let caches = self.caches();
            for &id in ids {
                match cached(&caches, id) {
                    Some(v) => {
                        out.insert(id, v);
                    }
                    None => missing.push(id),
                }
            }
        }
        for chunk in missing.chunks(IN_CHUNK) {
            let raw = self.select_raw(&format!(
                "SELECT id, any({column}) FROM {}.{table} WHERE id IN ({}) GROUP BY id",
                self.db,
                list(chunk)
            ))?;
            let mut r = Reader::new(&raw);
            let mut fetched = Vec::new();
            while !r.is_empty() {
                let id = r.u64()?;
                fetched.push((id, read(id, &mut r)?));
            }
            let mut caches = self.caches();
            caches.bound();
            for (id, v) in fetched {
                remember(&mut caches, id, v.clone());
                out.insert(id, v);
            }
        }
        Ok(out)
    }

    /// Label sets used by sample rows of the range.
    fn labelsets_in(
        &self,
        from_s: i64,
        to_s: i64,
    ) -> Result<HashMap<u64, Arc<LabelSet>>, StoreError> {
        let ids = self.select_ids(&format!(
            "SELECT DISTINCT labelset FROM {}.all_samples
             WHERE type != 0 AND bucket >= {from_s} AND bucket < {to_s}",
            self.db
        ))?;
        self.labelsets(&ids)
    }

    fn types(&self) -> Result<Vec<(u64, String, String)>, StoreError> {
        let raw = self.select_raw(&format!(
            "SELECT id, any(name), any(unit) FROM {}.types GROUP BY id",
            self.db
        ))?;
        let mut r = Reader::new(&raw);
        let mut out = Vec::new();
        while !r.is_empty() {
            out.push((r.u64()?, r.str()?, r.str()?));
        }
        out.sort_by(|a, b| (&a.1, &a.2).cmp(&(&b.1, &b.2)));
        Ok(out)
    }
}

/// What a selection reads: the label sets stored, and the `FROM ... WHERE ...` of the sample
/// rows it sums (its type and time range, the matching label sets unless all match, and
/// only each batch's first stored attempt).
struct Selected {
    present: HashMap<u64, Arc<LabelSet>>,
    rows: String,
    /// Only the matching label sets' rows are read (an `IN` list): none stored since
    /// `present` was read can be among them.
    filtered: bool,
}

impl ClickHouseStore {
    /// `None` when nothing can match: the type is unknown or no label set stored matches.
    fn selected(&self, selection: &Selection<'_>) -> Result<Option<Selected>, StoreError> {
        let types = self.types()?;
        let Some(&(ty, _, _)) = types.iter().find(|t| t.1 == selection.sample_type) else {
            return Ok(None);
        };
        // Every label set stored, not only those of the range: the `labelsets` table has one
        // row per label set, where finding the range's would scan a column of every sample
        // row in it (as long again as the query itself). Label sets without rows in the
        // range only lengthen the `IN` list.
        let ids = self.select_ids(&format!("SELECT DISTINCT id FROM {}.labelsets", self.db))?;
        let present = self.labelsets(&ids)?;
        let mut wanted: Vec<u64> = present
            .iter()
            .filter(|(_, l)| (selection.labels)(l))
            .map(|(&id, _)| id)
            .collect();
        if wanted.is_empty() {
            return Ok(None);
        }
        wanted.sort_unstable();
        let filtered = wanted.len() != present.len();
        let filter = if filtered {
            format!("AND labelset IN ({})", list(&wanted))
        } else {
            String::new()
        };
        let (from_s, to_s) = (selection.from_s, selection.to_s);
        let rows = format!(
            "FROM {db}.all_samples
             WHERE type = {ty} AND bucket >= {from_s} AND bucket < {to_s} {filter}
               AND {winners}",
            db = self.db,
            winners = self.winners(from_s, to_s)
        );
        Ok(Some(Selected {
            present,
            rows,
            filtered,
        }))
    }

    /// `present` plus the label sets among `answered` that it lacks and the selection matches:
    /// a batch stored between a query's two statements can bring label sets the first did
    /// not see (only when no label filter was sent). Rows of label sets missing from the
    /// answer are to be dropped (they are new ones the selection does not match).
    fn with_late(
        &self,
        selection: &Selection<'_>,
        mut present: HashMap<u64, Arc<LabelSet>>,
        answered: impl Iterator<Item = u64>,
    ) -> Result<HashMap<u64, Arc<LabelSet>>, StoreError> {
        let mut late: Vec<u64> = answered.filter(|l| !present.contains_key(l)).collect();
        late.sort_unstable();
        late.dedup();
        for (id, labels) in self.labelsets(&late)? {
            if (selection.labels)(&labels) {
                present.insert(id, labels);
            }
        }
        Ok(present)
    }
}

impl Store for ClickHouseStore {
    fn ingest(&self, batch: &Batch) -> Result<Ingested, StoreError> {
        let bucket = bucket_of(batch.time_s);
        let agent = ids::agent(&batch.agent_id);
        if self.has_marker(bucket, agent, batch.sequence)? {
            return Ok(Ingested {
                duplicate: true,
                ..Ingested::default()
            });
        }
        let types: Vec<u64> = batch
            .sample_types
            .iter()
            .map(|(n, u)| ids::sample_type(n, u))
            .collect();
        // Rows of one (type, label set, stack) summed here: fewer rows to store and read.
        let mut labelset_ids: HashMap<*const LabelSet, u64> = HashMap::new();
        let mut merged: HashMap<(u64, u64, u64), i64> = HashMap::new();
        let mut labelsets = HashMap::new();
        let mut stacks = HashMap::new();
        let mut caches = self.caches();
        caches.bound();
        for row in &batch.rows {
            let ty = *types
                .get(row.sample_type)
                .ok_or_else(|| StoreError::Corrupt("row names a missing sample type".into()))?;
            let sid = caches.stack_id(&row.stack);
            let lid = *labelset_ids
                .entry(Arc::as_ptr(&row.labels))
                .or_insert_with(|| ids::labelset(&row.labels));
            labelsets.insert(lid, &row.labels);
            stacks.insert(sid, &row.stack);
            crate::store::add(merged.entry((ty, lid, sid)).or_default(), row.value);
        }
        drop(caches);
        let refused = self.refused_labelsets(&labelsets, batch.max_label_sets)?;
        let mut rows_refused = 0;
        if !refused.is_empty() {
            labelsets.retain(|id, _| !refused.contains(id));
            let before = merged.len();
            merged.retain(|&(_, lid, _), _| !refused.contains(&lid));
            let kept_stacks: HashSet<u64> = merged.keys().map(|&(_, _, sid)| sid).collect();
            stacks.retain(|id, _| kept_stacks.contains(id));
            rows_refused = batch
                .rows
                .iter()
                .filter(|r| refused.contains(&labelset_ids[&Arc::as_ptr(&r.labels)]))
                .count() as u64;
            debug_assert!(merged.len() <= before);
        }
        self.intern(batch, &types, &labelsets, &stacks)?;
        let attempt = ids::attempt(&batch.agent_id, batch.sequence);
        let mut w = Writer::default();
        for (&(ty, lid, sid), &value) in &merged {
            w.i64(bucket);
            w.u64(ty);
            w.u64(lid);
            w.u64(sid);
            w.i64(value.clamp(-MAX_ROW_VALUE, MAX_ROW_VALUE));
            w.u64(attempt);
            w.u64(0);
            w.u64(0);
        }
        // The marker last: should a block ever be split, rows without their marker are
        // not counted.
        w.i64(bucket);
        w.u64(0);
        w.u64(0);
        w.u64(0);
        w.i64((batch.rows.len() as u64 - rows_refused) as i64);
        w.u64(attempt);
        w.u64(agent);
        w.u64(batch.sequence);
        self.insert(
            "samples_v2 (bucket, type, labelset, stack, value, batch, agent, sequence)",
            &w.0,
            merged.len() + 1,
        )?;
        Ok(Ingested {
            duplicate: false,
            rows: batch.rows.len() as u64 - rows_refused,
            rows_refused,
        })
    }

    fn select(&self, selection: &Selection<'_>) -> Result<Vec<Stacked>, StoreError> {
        let Some(Selected { present, rows, .. }) = self.selected(selection)? else {
            return Ok(Vec::new());
        };
        let raw = self.select_raw(&format!(
            "SELECT labelset, stack, sum(value) {rows} GROUP BY labelset, stack"
        ))?;
        let mut r = Reader::new(&raw);
        let mut sums = Vec::with_capacity(raw.len() / 24);
        while !r.is_empty() {
            sums.push((r.u64()?, r.u64()?, r.i64()?));
        }
        let labelsets = self.with_late(selection, present, sums.iter().map(|s| s.0))?;
        sums.retain(|s| labelsets.contains_key(&s.0));
        // Deterministic answers, whatever order ClickHouse's threads produced.
        sums.sort_unstable();
        let mut stack_ids: Vec<u64> = sums.iter().map(|s| s.1).collect();
        stack_ids.sort_unstable();
        stack_ids.dedup();
        let stacks = self.stacks(&stack_ids)?;
        sums.into_iter()
            .map(
                |(lid, sid, value)| match (labelsets.get(&lid), stacks.get(&sid)) {
                    (Some(labels), Some(stack)) => Ok(Stacked {
                        labels: labels.clone(),
                        stack: stack.clone(),
                        value,
                    }),
                    _ => Err(StoreError::Corrupt(format!(
                        "sample row of label set {lid} and stack {sid} without them"
                    ))),
                },
            )
            .collect()
    }

    fn select_merged(
        &self,
        selection: &Selection<'_>,
        keep: &[&str],
    ) -> Result<Vec<Stacked>, StoreError> {
        self.merged(selection, keep)
    }

    fn series(&self, selection: &Selection<'_>, step_s: i64) -> Result<Vec<Point>, StoreError> {
        // The API validates steps; a non-positive one here is read as the finest.
        let step_s = step_s.max(1);
        let Some(Selected { present, rows, .. }) = self.selected(selection)? else {
            return Ok(Vec::new());
        };
        // The step's start as `bucket - bucket.rem_euclid(step)`, written with `%` twice since
        // ClickHouse's `%` (and `intDiv`) truncate toward zero; no `toStartOfInterval`, whose
        // arbitrary-seconds form 18.16 lacks and which works on DateTime, not Int64 buckets.
        let raw = self.select_raw(&format!(
            "SELECT labelset,
                    toInt64(bucket - ((bucket % {step_s}) + {step_s}) % {step_s}) AS step_start,
                    sum(value)
             {rows}
             GROUP BY labelset, step_start"
        ))?;
        let mut r = Reader::new(&raw);
        let mut sums = Vec::with_capacity(raw.len() / 24);
        while !r.is_empty() {
            sums.push((r.u64()?, r.i64()?, r.i64()?));
        }
        let labelsets = self.with_late(selection, present, sums.iter().map(|s| s.0))?;
        Ok(sums
            .into_iter()
            .filter_map(|(lid, time_s, value)| {
                let labels = labelsets.get(&lid)?.clone();
                Some(Point {
                    labels,
                    time_s,
                    value,
                })
            })
            .collect())
    }

    fn label_names(
        &self,
        from_s: i64,
        to_s: i64,
        labels: &(dyn Fn(&LabelSet) -> bool + Sync),
    ) -> Result<Vec<String>, StoreError> {
        let sets = self.labelsets_in(from_s, to_s)?;
        Ok(crate::store::names_of(sets.values().map(|s| &**s), labels))
    }

    fn label_values(
        &self,
        name: &str,
        from_s: i64,
        to_s: i64,
        labels: &(dyn Fn(&LabelSet) -> bool + Sync),
    ) -> Result<Vec<String>, StoreError> {
        let sets = self.labelsets_in(from_s, to_s)?;
        Ok(crate::store::values_of(
            sets.values().map(|s| &**s),
            name,
            labels,
        ))
    }

    fn sample_types(&self) -> Result<Vec<(String, String)>, StoreError> {
        let mut types: Vec<(String, String)> =
            self.types()?.into_iter().map(|(_, n, u)| (n, u)).collect();
        types.dedup();
        Ok(types)
    }

    fn size_bytes(&self) -> Result<u64, StoreError> {
        let raw = self.select_raw(&format!(
            "SELECT toUInt64(sum(bytes_on_disk)) FROM system.parts
             WHERE database = '{}' AND active",
            self.db
        ))?;
        Ok(Reader::new(&raw).u64()?)
    }

    /// Drops whole days: a partition goes once every bucket in it is older than `before_s`
    /// (so up to a day more than the retention is kept). Then removes the label sets and
    /// stacks no sample row uses any more (see [`retention`]).
    fn expire(&self, before_s: i64) -> Result<u64, StoreError> {
        let removed = self.drop_partitions(before_s)?;
        self.prune()?;
        Ok(removed)
    }

    /// Nothing to do: ClickHouse compresses columns and merges parts itself, so the table
    /// keeps full 10 s resolution until retention drops the day. (Rewriting buckets would
    /// need an atomic swap of partitions that collectors ingesting at the same time could
    /// race with.)
    fn compact(&self, _before_s: i64, _coarse_s: i64) -> Result<u64, StoreError> {
        Ok(0)
    }
}
