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

use std::sync::OnceLock;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

static METRICS: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Installs the process-wide metrics recorder (once); the engine records model latency, step
/// duration, tokens and finished runs into it.
pub fn init_metrics() {
    METRICS.get_or_init(|| {
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(
                Matcher::Suffix("_seconds".into()),
                &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0],
            )
            .ok()?
            .build_recorder();
        let handle = recorder.handle();
        metrics::set_global_recorder(recorder).ok()?;
        Some(handle)
    });
}

/// The recorder's metrics in Prometheus text format (empty before [`init_metrics`]).
pub fn render_metrics() -> String {
    METRICS.get().and_then(|h| h.as_ref()).map(|h| h.render()).unwrap_or_default()
}
