//! The ClickHouse schema, versioned: `schema_version` holds one row per applied version, and
//! a collector applies the versions it knows that are missing (every statement is idempotent,
//! so collectors starting together cannot break each other), and refuses a store whose
//! version is newer than its own.
//!
//! One schema for Debian's 18.16 and current releases, so it avoids what 18.16 lacks or
//! treats differently: no `Map` (labels are a JSON string in an interned table), no column
//! codecs and no `TTL` (retention drops whole day partitions instead), no projections (the
//! sort key serves the queries), no `DateTime64` (buckets are Int64 seconds, no time zone),
//! no `LowCardinality` (needs an experimental setting on 18.16; interning by id does the
//! same job), and no server-side query parameters (queries carry only integers the
//! collector formats itself). Queries use at most one JOIN (18.16's limit); in fact none.
//!
//! Exactly-once without transactions: a batch's sample rows and its marker row (type 0,
//! carrying the agent and sequence) are one INSERT into one partition, which ClickHouse
//! writes as one part, all or nothing. Each insert attempt has its own random `batch` id;
//! readers count only rows of the smallest `batch` id of each (agent, sequence) marker.
//! A replay after a lost acknowledgement, the same batch through two collectors at once, or
//! an insert cut short by a crash therefore never counts twice or half.

use super::http::{Client, HttpError};

/// The version this collector writes and reads.
pub const VERSION: u32 = 3;

/// The table sample rows are written to.
pub const SAMPLES: &str = "samples_v2";
/// The table sample rows are read from: every version's sample table at once.
pub const ALL_SAMPLES: &str = "all_samples";
/// Sample tables of every version (retention drops their partitions).
pub const SAMPLE_TABLES: &[&str] = &["samples", SAMPLES];

/// One schema change; each is idempotent, so collectors starting together cannot break
/// each other.
enum Step {
    Sql(&'static str),
    /// `ALTER TABLE {db}.table ADD COLUMN column definition` unless the column exists (18.16
    /// has no `ADD COLUMN IF NOT EXISTS`).
    AddColumn {
        table: &'static str,
        column: &'static str,
        definition: &'static str,
    },
}

/// `(version, steps)`, in order; `{db}` is the database.
const MIGRATIONS: &[(u32, &[Step])] = &[
    (
        1,
        &[
            // One row per (bucket, type, label set, stack) of one insert attempt; markers
            // have type 0. Sorted so a query reads one type's contiguous time range; a
            // partition a day, so retention is DROP PARTITION. Written by version 1 only.
            Step::Sql(
                "CREATE TABLE IF NOT EXISTS {db}.samples (
                bucket Int64, type UInt64, labelset UInt64, stack UInt64, value Int64,
                batch UInt64, agent UInt64, sequence UInt64
            ) ENGINE = MergeTree() PARTITION BY intDiv(bucket, 86400)
              ORDER BY (type, bucket, labelset, stack)",
            ),
            // Interned by a hash of their content, so collectors agree on ids without
            // talking; a row inserted twice collapses in a merge, and readers take any one.
            Step::Sql(
                "CREATE TABLE IF NOT EXISTS {db}.labelsets (id UInt64, labels String)
              ENGINE = ReplacingMergeTree() ORDER BY id",
            ),
            Step::Sql(
                "CREATE TABLE IF NOT EXISTS {db}.stacks (id UInt64, frames Array(String))
              ENGINE = ReplacingMergeTree() ORDER BY id",
            ),
            Step::Sql(
                "CREATE TABLE IF NOT EXISTS {db}.types (id UInt64, name String, unit String)
              ENGINE = ReplacingMergeTree() ORDER BY id",
            ),
        ],
    ),
    (
        2,
        &[
            // The same rows sorted by hour, then label set, then time: a query for some
            // label sets (one node, one process name) reads only their ranges of each hour
            // instead of every row of the time range, and a query of an hour still reads
            // that hour's (at most two hours') rows only, however many days are stored
            // (label set first would read a whole day of each label set). A sort key cannot change in place, and copying
            // the old rows over is not idempotent (collectors starting together would copy
            // twice), so new rows go to a new table and version 1's `samples` stays
            // readable, through `all_samples`, until retention has dropped its days.
            Step::Sql(
                "CREATE TABLE IF NOT EXISTS {db}.samples_v2 (
                bucket Int64, type UInt64, labelset UInt64, stack UInt64, value Int64,
                batch UInt64, agent UInt64, sequence UInt64
            ) ENGINE = MergeTree() PARTITION BY intDiv(bucket, 86400)
              ORDER BY (type, intDiv(bucket, 3600), labelset, bucket, stack)",
            ),
            // Reads both, each through its own sort key; version 1 collectors still running
            // during an upgrade keep writing to `samples` and are read too.
            Step::Sql(
                "CREATE TABLE IF NOT EXISTS {db}.all_samples AS {db}.samples_v2
              ENGINE = Merge({db}, '^samples(_v2)?$')",
            ),
            // When a label set was written, so retention removes only label sets that no
            // sample row uses and no collector has written lately (see `expire`). Rows
            // written before this column existed read as written now: never removed early.
            Step::AddColumn {
                table: "labelsets",
                column: "at",
                definition: "DateTime DEFAULT now()",
            },
        ],
    ),
    (
        3,
        &[
            // When a stack was written, so retention removes stacks no sample row uses, as it
            // does label sets (see `expire`).
            Step::AddColumn {
                table: "stacks",
                column: "at",
                definition: "DateTime DEFAULT now()",
            },
        ],
    ),
];

#[derive(Debug, thiserror::Error)]
pub enum SchemaError {
    #[error(transparent)]
    Http(#[from] HttpError),
    #[error(
        "the store's schema is version {found}, newer than this collector's {VERSION}: \
         upgrade pyrometer-collector"
    )]
    Newer { found: u32 },
    #[error("unreadable schema version '{0}'")]
    Version(String),
}

fn sql(client: &Client, text: &str) -> Result<String, HttpError> {
    let answer = client.post(&[], text.as_bytes())?;
    Ok(String::from_utf8_lossy(&answer).trim().to_string())
}

/// Creates the database and brings its schema to [`VERSION`]; returns the version found.
pub fn migrate(client: &Client, db: &str) -> Result<u32, SchemaError> {
    sql(client, &format!("CREATE DATABASE IF NOT EXISTS {db}"))?;
    sql(
        client,
        &format!(
            "CREATE TABLE IF NOT EXISTS {db}.schema_version
             (version UInt32, applied_at DateTime DEFAULT now())
             ENGINE = ReplacingMergeTree() ORDER BY version"
        ),
    )?;
    let text = sql(
        client,
        &format!("SELECT max(version) FROM {db}.schema_version"),
    )?;
    let found: u32 = text.parse().map_err(|_| SchemaError::Version(text))?;
    if found > VERSION {
        return Err(SchemaError::Newer { found });
    }
    for &(version, steps) in MIGRATIONS {
        if version <= found {
            continue;
        }
        for step in steps {
            match step {
                Step::Sql(s) => {
                    sql(client, &s.replace("{db}", db))?;
                }
                Step::AddColumn {
                    table,
                    column,
                    definition,
                } => {
                    let exists = sql(
                        client,
                        &format!(
                            "SELECT count() FROM system.columns
                             WHERE database = '{db}' AND table = '{table}' AND name = '{column}'"
                        ),
                    )?;
                    if exists == "0" {
                        let added = sql(
                            client,
                            &format!("ALTER TABLE {db}.{table} ADD COLUMN {column} {definition}"),
                        );
                        // Another collector may have added it since the check.
                        match added {
                            Err(HttpError::Server { ref message, .. })
                                if message.contains("Code: 44,") => {}
                            other => {
                                other?;
                            }
                        }
                    }
                }
            }
        }
        sql(
            client,
            &format!("INSERT INTO {db}.schema_version (version) VALUES ({version})"),
        )?;
    }
    Ok(found)
}
