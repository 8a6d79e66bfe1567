//! `pyrometer agent`: the always-on node daemon (the library's `agent`), its settings from
//! flags and the config file.

use std::sync::Arc;

use anyhow::Context;

mod config;

pub use config::AgentArgs;

pub fn run(args: AgentArgs) -> anyhow::Result<u8> {
    let cfg = config::resolve(&args)?;
    // Opened now: the agent gives up uid 0 once attached, and the file's directory may be
    // root's.
    let stats = args
        .stats
        .as_ref()
        .map(|path| {
            std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))
        })
        .transpose()?;
    let log: pyrometer::agent::Log = Arc::new(|line| eprintln!("pyrometer agent: {line}"));
    let summary = pyrometer::agent::run(cfg, log).map_err(crate::command_error)?;
    eprintln!(
        "pyrometer agent: {} samples, {} pushed, {} dropped, {} left in the spool",
        summary.samples, summary.samples_pushed, summary.samples_dropped, summary.spool_samples
    );
    if let (Some(mut file), Some(path)) = (stats, &args.stats) {
        use std::io::Write;
        file.write_all(serde_json::to_string_pretty(&summary)?.as_bytes())
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(0)
}
