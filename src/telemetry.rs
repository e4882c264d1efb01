//! Logging: `tracing` to stderr, filtered by `RUST_LOG` (default per command), as text or, with
//! `SUBAGENTS_LOG_FORMAT=json`, as JSON lines for log shippers.

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber. `default` applies when `RUST_LOG` is unset.
pub fn init(default: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let json = std::env::var("SUBAGENTS_LOG_FORMAT").is_ok_and(|v| v == "json");
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_target(false);
    let _ = if json { builder.json().try_init() } else { builder.try_init() };
}
