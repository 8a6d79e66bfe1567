//! `pyrometer-collector`: the server node agents push to. See the README for deployment.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use pyrometer_collector::api::{self, AppState};
use pyrometer_collector::auth::Auth;
use pyrometer_collector::captures::Captures;
use pyrometer_collector::clickhouse::{ClickHouseStore, Location, read_credentials};
use pyrometer_collector::config::Config;
use pyrometer_collector::limits::LimitFlags;
use pyrometer_collector::serve;
use pyrometer_collector::sqlite::SqliteStore;
use pyrometer_collector::store::Store;

// The README's and the book's examples are parsed with `Args` (see the test below).
#[cfg(test)]
#[path = "../../profiler/src/bin/pyrometer/doc_examples.rs"]
mod doc_examples;

#[derive(Parser)]
#[command(
    name = "pyrometer-collector",
    version,
    about = "Stores profiles pushed by pyrometer agents and serves flame graphs, pprof and a web UI"
)]
struct Args {
    /// Address for both gRPC ingest and HTTP (API, web UI, /metrics). Anything but loopback
    /// needs --token-file or --client-ca, or --insecure.
    #[arg(long, default_value = "127.0.0.1:4040")]
    listen: SocketAddr,
    /// Listen beyond loopback without credentials: anyone who reaches the port may push and
    /// read (for a trusted network, or behind a proxy that authenticates).
    #[arg(long)]
    insecure: bool,
    /// Directory of the SQLite store (the same as --store sqlite:DIR).
    #[arg(long, default_value = "/var/lib/pyrometer-collector")]
    data_dir: PathBuf,
    /// Where profiles are kept: sqlite:DIR (embedded, the default, in --data-dir) or
    /// clickhouse://HOST:PORT/DATABASE (shared by any number of collectors), or
    /// clickhouses://HOST:PORT/DATABASE over HTTPS.
    #[arg(long, value_name = "URL")]
    store: Option<String>,
    /// PEM file of the CA that signed a clickhouses:// store's certificate (default: the
    /// system's roots).
    #[arg(long, value_name = "FILE")]
    store_ca: Option<PathBuf>,
    /// File holding USER:PASSWORD for the ClickHouse store (never on the command line).
    #[arg(long, value_name = "FILE")]
    store_credentials: Option<PathBuf>,
    /// How long a request to ClickHouse may take before it counts as unavailable.
    #[arg(long, default_value = "4s", value_parser = parse_age)]
    store_timeout: Duration,
    /// Token file: `TOKEN TENANT ROLES` lines (roles push, read, admin), or one token (the
    /// default tenant's push and read). Pushes and reads then need a token or a certificate
    /// it lists. Read again on SIGHUP.
    #[arg(long, value_name = "FILE")]
    token_file: Option<PathBuf>,
    /// PEM file of the CA whose client certificates authenticate agents (needs --tls-cert);
    /// a certificate is named in the token file as `cn:COMMON_NAME`, or without a token file
    /// is the default tenant's push and read.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    client_ca: Option<PathBuf>,
    /// Take the tenant of requests without credentials from the X-Scope-OrgID header, for a
    /// proxy in front that authenticates (a token's tenant always wins).
    #[arg(long)]
    trust_tenant_header: bool,
    /// Serve /metrics without credentials.
    #[arg(long)]
    public_metrics: bool,
    /// Connections open at once; more are closed as they arrive (default: the file limit
    /// less 256).
    #[arg(long, value_name = "N")]
    max_connections: Option<usize>,
    /// Seconds a TLS handshake or an HTTP request head may take.
    #[arg(long, default_value_t = 10, value_name = "SECONDS")]
    header_timeout: u64,
    /// Seconds a connection may stay idle between requests.
    #[arg(long, default_value_t = 120, value_name = "SECONDS")]
    idle_timeout: u64,
    /// PEM certificate chain to serve TLS with (gRPC and HTTP both); needs --tls-key.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// How long samples are kept (e.g. 7d, 12h).
    #[arg(long, default_value = "7d", value_parser = parse_age)]
    retention: Duration,
    /// Buckets older than this are merged into 5-minute buckets.
    #[arg(long, default_value = "1d", value_parser = parse_age)]
    compact_after: Duration,
    /// TOML file of limits, for every tenant and per tenant (see the book's security page);
    /// the limit flags below win over its `[limits]`.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Largest push accepted, in MiB (the same as --max-push-bytes).
    #[arg(long, hide = true)]
    max_batch_mb: Option<usize>,
    #[command(flatten)]
    limits: LimitFlags,
    /// How often retention and compaction run.
    #[arg(long, default_value = "10m", value_parser = parse_age, hide = true)]
    maintenance_interval: Duration,
    /// Write the man page (pyrometer-collector.1) into this directory and exit (run by
    /// `cargo xtask test`).
    #[arg(long, value_name = "DIR", hide = true)]
    man_dir: Option<PathBuf>,
}

fn parse_age(s: &str) -> Result<Duration, String> {
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(split);
    let n: u64 = n
        .parse()
        .map_err(|_| format!("invalid duration '{s}': use e.g. 7d, 12h, 30m, 90s"))?;
    let mult = match unit {
        "s" | "" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86400,
        _ => return Err(format!("invalid duration unit in '{s}': use s, m, h or d")),
    };
    if n == 0 {
        return Err("duration must be positive".into());
    }
    Ok(Duration::from_secs(n * mult))
}

fn main() -> std::process::ExitCode {
    pyrometer_collector::memory::limit_arenas();
    let args = Args::parse();
    match run(args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pyrometer-collector: {e:#}");
            std::process::ExitCode::from(2)
        }
    }
}

fn run(args: Args) -> anyhow::Result<()> {
    if let Some(dir) = &args.man_dir {
        use clap::CommandFactory;
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        return clap_mangen::generate_to(Args::command(), dir)
            .with_context(|| format!("writing the man page into {}", dir.display()));
    }
    check_listen(&args)?;
    // Everything the collector writes (the store, its journal) is readable by it alone.
    // SAFETY: umask only changes this process's file creation mask.
    unsafe { libc::umask(0o077) };
    serve::raise_file_limit();
    let mut auth = Auth::open()
        .with_client_certificates(args.client_ca.is_some())
        .trusting_tenant_header(args.trust_tenant_header);
    auth.public_metrics = args.public_metrics;
    if let Some(path) = &args.token_file {
        auth = auth.with_token_file(path).map_err(anyhow::Error::msg)?;
    }
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(pyrometer_collector::tls::server_config(
            cert,
            key,
            args.client_ca.as_deref(),
        )?),
        _ => None,
    };
    let mut flags = args.limits.clone();
    if let Some(mb) = args.max_batch_mb {
        flags.max_push_bytes.get_or_insert(mb << 20);
    }
    let clickhouse = args
        .store
        .as_deref()
        .is_some_and(|s| s.starts_with("clickhouse"));
    if clickhouse {
        // ClickHouse runs a query on every core it has: one at a time per tenant keeps it
        // answering pushes (see the book's security page for the measurement).
        flags.max_concurrent_queries.get_or_insert(1);
    }
    let config = Config::load(args.config.as_deref(), &flags)?;
    let (store, store_name, captures_dir) = open_store(&args)?;
    // Finished captures are kept beside the embedded store; collectors sharing ClickHouse
    // share no disk, so theirs stay in memory.
    let captures = match captures_dir {
        Some(dir) => Captures::persistent(dir, args.retention, &mut |w| {
            eprintln!("pyrometer-collector: {w}")
        }),
        None => Captures::default(),
    };
    let state = Arc::new(
        AppState::new(store.clone())
            .with_auth(auth)
            .with_config(config)
            .with_retention(args.retention)
            .with_captures(captures),
    );
    let options = serve::Options {
        max_connections: args
            .max_connections
            .unwrap_or_else(serve::default_max_connections),
        header_timeout: Duration::from_secs(args.header_timeout.max(1)),
        idle_timeout: Duration::from_secs(args.idle_timeout.max(1)),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("cannot listen on {}", args.listen))?;
        eprintln!(
            "pyrometer-collector: listening on {} with {}{} (store {store_name})",
            listener.local_addr()?,
            if tls.is_some() { "TLS" } else { "plain text" },
            if state.auth.required() {
                ", credentials required"
            } else {
                ", no credentials required"
            },
        );
        tokio::spawn(maintenance(
            store,
            args.retention,
            args.compact_after,
            args.maintenance_interval,
        ));
        tokio::spawn(reload_on_sighup(state.clone()));
        let app = api::router(state.clone());
        serve::serve(
            listener,
            app,
            tls,
            options,
            state.metrics.clone(),
            shutdown(),
        )
        .await;
        Ok(())
    })
}

/// Refuses to listen beyond loopback without credentials unless told `--insecure`.
fn check_listen(args: &Args) -> anyhow::Result<()> {
    let loopback = args.listen.ip().is_loopback();
    let credentials = args.token_file.is_some() || args.client_ca.is_some();
    if !loopback && !credentials && !args.insecure {
        anyhow::bail!(
            "--listen {} accepts connections from other hosts, but no credentials are set: \
             give --token-file FILE (and --tls-cert/--tls-key so tokens travel encrypted) or \
             --client-ca FILE, or --insecure to let anyone who reaches the port push and read \
             (and, with --trust-tenant-header, claim any tenant)",
            args.listen
        );
    }
    if !loopback && args.token_file.is_some() && args.tls_cert.is_none() {
        eprintln!(
            "pyrometer-collector: warning: tokens on {} travel in plain text; give \
             --tls-cert and --tls-key (agents refuse to send a token over http:// unless \
             --insecure)",
            args.listen
        );
    }
    Ok(())
}

/// Reads the token file again on each SIGHUP; a file that does not parse leaves the old one.
async fn reload_on_sighup(state: Arc<AppState>) {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut hup) = signal(SignalKind::hangup()) else {
        return;
    };
    while hup.recv().await.is_some() {
        match state.auth.reload() {
            Ok(()) => {
                state.metrics.token_reloads.add("ok");
                eprintln!("pyrometer-collector: token file read again");
            }
            Err(e) => {
                state.metrics.token_reloads.add("error");
                eprintln!("pyrometer-collector: {e}; keeping the tokens read before");
            }
        }
    }
}

/// The store `--store` (or `--data-dir`) names, how to name it in messages, and where
/// finished captures are kept (beside an embedded store).
fn open_store(args: &Args) -> anyhow::Result<(Arc<dyn Store>, String, Option<PathBuf>)> {
    let spec = args.store.clone().unwrap_or_default();
    if spec.starts_with("clickhouse://") || spec.starts_with("clickhouses://") {
        let mut location = Location::parse(&spec).map_err(anyhow::Error::msg)?;
        anyhow::ensure!(
            args.store_ca.is_none() || location.tls,
            "--store-ca is for a clickhouses:// (HTTPS) store"
        );
        location.ca = args.store_ca.clone();
        let credentials = match &args.store_credentials {
            Some(path) => Some(read_credentials(path).map_err(anyhow::Error::msg)?),
            None => None,
        };
        let store = ClickHouseStore::open(&location, credentials, args.store_timeout)
            .with_context(|| format!("opening the store {spec}"))?;
        return Ok((Arc::new(store), spec, None));
    }
    anyhow::ensure!(
        args.store_credentials.is_none(),
        "--store-credentials is for a clickhouse:// store"
    );
    let dir = match spec.strip_prefix("sqlite:") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        Some(_) => {
            anyhow::bail!("--store sqlite: needs a directory, e.g. sqlite:/var/lib/pyrometer")
        }
        None if spec.is_empty() => args.data_dir.clone(),
        None => anyhow::bail!(
            "unknown store '{spec}': use sqlite:DIR or clickhouse://HOST:PORT/DATABASE"
        ),
    };
    let store = SqliteStore::open(&dir)
        .with_context(|| format!("opening the store in {}", dir.display()))?;
    Ok((
        Arc::new(store),
        dir.display().to_string(),
        Some(dir.join("captures")),
    ))
}

async fn shutdown() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

async fn maintenance(
    store: Arc<dyn Store>,
    retention: Duration,
    compact_after: Duration,
    every: Duration,
) {
    let mut tick = tokio::time::interval(every);
    loop {
        tick.tick().await;
        let store = store.clone();
        let now = api::now_s();
        let result = tokio::task::spawn_blocking(move || {
            store.expire(now - retention.as_secs() as i64)?;
            store.compact(now - compact_after.as_secs() as i64, 300)
        })
        .await;
        if let Ok(Err(e)) = result {
            eprintln!("pyrometer-collector: maintenance failed: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `pyrometer-collector ...` example in the README and the book parses with `Args`.
    #[test]
    fn documented_examples_parse() {
        let root = doc_examples::workspace_root();
        let examples = doc_examples::examples(&root, "pyrometer-collector");
        // The quick start and the deployment page have some; none means the extraction broke.
        assert!(
            examples.len() >= 2,
            "only {} examples found",
            examples.len()
        );
        let failures: Vec<String> = examples
            .iter()
            .filter_map(|e| {
                let err = Args::try_parse_from(&e.args).err()?;
                let first = err
                    .to_string()
                    .lines()
                    .next()
                    .unwrap_or_default()
                    .to_string();
                Some(format!("{}: `{}`: {first}", e.location, e.args.join(" ")))
            })
            .collect();
        assert!(
            failures.is_empty(),
            "examples that do not parse (write them with concrete values):\n{}",
            failures.join("\n")
        );
    }
}
