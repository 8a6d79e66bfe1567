//! The debuginfod flags `record` and the agent share, and what they resolve to.

use std::path::PathBuf;

use clap::Args;
use pyrometer::command::debuginfod::{DebuginfodConfig, parse_urls};

use crate::{EXIT_INPUT, exit_error};

#[derive(Args, Debug, Clone, Default)]
pub struct DebuginfodArgs {
    /// debuginfod server to fetch missing debug files from, by build id (repeatable, or
    /// several separated by spaces as in DEBUGINFOD_URLS), e.g.
    /// https://debuginfod.debian.net. Stripped binaries without a debug file on the machine
    /// get their functions named from the file fetched; downloads never delay sampling.
    #[arg(long = "debuginfod", value_name = "URL")]
    pub urls: Vec<String>,
    /// Where fetched debug files are kept, shared by record and the agent (default
    /// /var/cache/pyrometer/debuginfod as root, else ~/.cache/pyrometer/debuginfod).
    #[arg(long, value_name = "DIR")]
    pub debuginfod_cache: Option<PathBuf>,
    /// The cache's size limit in MiB; the least recently used files go first (default 1024).
    #[arg(long, value_name = "MIB", value_parser = clap::value_parser!(u64).range(1..))]
    pub debuginfod_cache_mb: Option<u64>,
}

impl DebuginfodArgs {
    /// The client's settings for `urls` (flags, or the config file's or the environment's
    /// list); None without a server.
    pub fn resolve(
        &self,
        from: &str,
        urls: &[String],
        cache: Option<PathBuf>,
        cache_mb: Option<u64>,
    ) -> anyhow::Result<Option<DebuginfodConfig>> {
        let urls = parse_urls(urls.iter().map(String::as_str))
            .map_err(|e| exit_error(EXIT_INPUT, format!("{from}: {e}")))?;
        if urls.is_empty() {
            return Ok(None);
        }
        let mut cfg = DebuginfodConfig::new(urls);
        if let Some(dir) = self.debuginfod_cache.clone().or(cache) {
            cfg.cache_dir = dir;
        }
        if let Some(mb) = self.debuginfod_cache_mb.or(cache_mb) {
            cfg.cache_max_bytes = mb.saturating_mul(1 << 20);
        }
        Ok(Some(cfg))
    }
}
