//! Logging and traces. Logs: `tracing` to stderr, filtered by `RUST_LOG` (default per
//! command), as text or, with `SUBAGENTS_LOG_FORMAT=json`, as JSON lines for log shippers.
//! Traces: with `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) set,
//! the run, step, model-call and tool-call spans go to that OTLP/HTTP endpoint
//! (`OTEL_EXPORTER_OTLP_PROTOCOL` = `http/protobuf`, the default, or `http/json`), named and
//! attributed per the OpenTelemetry GenAI conventions. Off when unset: no exporter, no cost.

use std::collections::HashMap;
use std::sync::OnceLock;

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, Registry};

static TRACES: OnceLock<SdkTracerProvider> = OnceLock::new();

type BoxedLayer = Box<dyn Layer<Registry> + Send + Sync>;

/// A per-layer filter that is asked about every event, never cached as always-on.
///
/// tracing-subscriber passes a per-layer filter's verdict from `enabled` to `on_event` through
/// a thread-local; a callsite cached as always-on skips `enabled` and reads whatever the last
/// check on the thread left there. sqlx checks `log::log_enabled!` after every query, which
/// the log bridge turns into such a check (disabled, for `sqlx::query` below our level): the
/// next always-on event on that thread was silently dropped (seen: a worker's debug line right
/// after its statement never printed; tokio-rs/tracing#2519). Answering "sometimes" where the
/// filter would say "always" makes every event ask, which keeps the verdict fresh; a callsite
/// the filter rejects outright is still never asked.
struct Fresh<F>(F);

impl<S, F: tracing_subscriber::layer::Filter<S>> tracing_subscriber::layer::Filter<S> for Fresh<F> {
    fn enabled(
        &self,
        meta: &tracing::Metadata<'_>,
        cx: &tracing_subscriber::layer::Context<'_, S>,
    ) -> bool {
        self.0.enabled(meta, cx)
    }

    fn callsite_enabled(
        &self,
        meta: &'static tracing::Metadata<'static>,
    ) -> tracing::subscriber::Interest {
        match self.0.callsite_enabled(meta) {
            i if i.is_never() => i,
            _ => tracing::subscriber::Interest::sometimes(),
        }
    }

    fn event_enabled(
        &self,
        event: &tracing::Event<'_>,
        cx: &tracing_subscriber::layer::Context<'_, S>,
    ) -> bool {
        self.0.event_enabled(event, cx)
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        self.0.max_level_hint()
    }

    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        id: &tracing::span::Id,
        cx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        self.0.on_new_span(attrs, id, cx)
    }

    fn on_record(
        &self,
        id: &tracing::span::Id,
        values: &tracing::span::Record<'_>,
        cx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        self.0.on_record(id, values, cx)
    }

    fn on_enter(&self, id: &tracing::span::Id, cx: tracing_subscriber::layer::Context<'_, S>) {
        self.0.on_enter(id, cx)
    }

    fn on_exit(&self, id: &tracing::span::Id, cx: tracing_subscriber::layer::Context<'_, S>) {
        self.0.on_exit(id, cx)
    }

    fn on_close(&self, id: tracing::span::Id, cx: tracing_subscriber::layer::Context<'_, S>) {
        self.0.on_close(id, cx)
    }
}

/// Installs the global subscriber. `default` applies when `RUST_LOG` is unset.
pub fn init(default: &str) {
    let filter =
        Fresh(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default)));
    let json = std::env::var("SUBAGENTS_LOG_FORMAT").is_ok_and(|v| v == "json");
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_target(false);
    let logs: BoxedLayer = if json {
        fmt.json().with_filter(filter).boxed()
    } else {
        fmt.with_filter(filter).boxed()
    };
    let mut layers = vec![logs];
    match otlp_layer() {
        Ok(Some(l)) => layers.push(l),
        Ok(None) => {}
        Err(e) => eprintln!("OTLP traces are off: {e}"),
    }
    let _ = tracing_subscriber::registry().with(layers).try_init();
}

/// The OTLP layer, when an endpoint is configured: only this program's spans (not the HTTP
/// client's or the database driver's), batched and sent by the SDK's own thread.
fn otlp_layer() -> Result<Option<BoxedLayer>, String> {
    let set = |k: &str| std::env::var(k).is_ok_and(|v| !v.trim().is_empty());
    if !set("OTEL_EXPORTER_OTLP_ENDPOINT") && !set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") {
        return Ok(None);
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .build()
        .map_err(|e| e.to_string())?;
    let mut resource = opentelemetry_sdk::Resource::builder();
    if !set("OTEL_SERVICE_NAME") {
        resource = resource.with_service_name("subagents");
    }
    let provider = SdkTracerProvider::builder()
        .with_resource(resource.build())
        .with_batch_exporter(exporter)
        .build();
    let tracer = provider.tracer("subagents");
    let _ = TRACES.set(provider);
    let only_ours = Targets::new().with_target("subagents", LevelFilter::INFO);
    let layer = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_tracked_inactivity(false)
        .with_location(false)
        .with_threads(false);
    Ok(Some(layer.with_filter(Fresh(only_ours)).boxed()))
}

/// Sends the spans still buffered (call before the process exits).
pub fn shutdown() {
    if let Some(p) = TRACES.get() {
        let _ = p.force_flush();
        let _ = p.shutdown();
    }
}

/// The W3C `traceparent` of `span`, when traces are on: what a child run carries so its spans
/// join its parent's trace, even in another process and hours later.
pub fn traceparent(span: &tracing::Span) -> Option<String> {
    TRACES.get()?;
    let cx = span.context();
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&cx, &mut carrier);
    carrier.remove("traceparent")
}

/// The `traceparent` every attempt of a run continues when neither its caller nor a parent run
/// gave it one, so a run that parks and is claimed again is one trace, not one per claim: the
/// trace id is the tree's root run id, and the parent span id is taken from the run's own id
/// (no span of that id is sent: backends show the attempts as siblings under it).
pub fn run_traceparent(root: uuid::Uuid, run: uuid::Uuid) -> String {
    let mut tail = [0u8; 8];
    tail.copy_from_slice(&run.as_bytes()[8..]);
    // A span id of zero is invalid.
    let span = u64::from_be_bytes(tail) | 1;
    format!("00-{}-{span:016x}-01", root.simple())
}

/// Makes `span` a child of the span `traceparent` names (a parent run's tool call, or a
/// caller's own trace passed in a run's metadata). A malformed value is ignored.
pub fn adopt(span: &tracing::Span, traceparent: &str) {
    if TRACES.get().is_none() {
        return;
    }
    let carrier = HashMap::from([("traceparent".to_owned(), traceparent.to_owned())]);
    let cx = TraceContextPropagator::new().extract(&carrier);
    if cx.span().span_context().is_valid() {
        let _ = span.set_parent(cx);
    }
}

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

static METRICS: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Installs the process-wide metrics recorder (once); the engine records model latency, step
/// duration, tokens and finished runs into it.
pub fn init_metrics() {
    METRICS.get_or_init(|| {
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(
                Matcher::Suffix("_seconds".into()),
                &[
                    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0,
                ],
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
    METRICS
        .get()
        .and_then(|h| h.as_ref())
        .map(|h| h.render())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_runs_own_traceparent_is_valid_and_the_same_at_every_claim() {
        let root = uuid::Uuid::now_v7();
        let run = uuid::Uuid::now_v7();
        let tp = run_traceparent(root, run);
        assert_eq!(tp, run_traceparent(root, run));
        let carrier = HashMap::from([("traceparent".to_owned(), tp)]);
        let cx = TraceContextPropagator::new().extract(&carrier);
        let sc = cx.span().span_context().clone();
        assert!(sc.is_valid());
        assert_eq!(sc.trace_id().to_string(), root.simple().to_string());
    }
}
