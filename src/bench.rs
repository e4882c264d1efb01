//! `subagents bench`: a load benchmark of the whole path (queue → engine → model over HTTP →
//! checkpoints) that prints one JSON line. Figures go in the README; nothing here asserts a
//! speed.

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::app::{App, StartRun};
use crate::config::Settings;
use crate::model::Message;
use crate::model::mock::{MockOptions, MockServer};
use crate::store::RunStatus;

/// Benchmark parameters.
#[derive(clap::Args, Clone, Debug)]
pub struct BenchArgs {
    /// Runs to execute.
    #[arg(long, default_value_t = 200)]
    pub runs: usize,
    /// Steps per run (K-1 tool steps, then the answer).
    #[arg(long, default_value_t = 5)]
    pub steps: u32,
    /// Runs in flight at once (worker concurrency).
    #[arg(long, default_value_t = 32)]
    pub concurrency: usize,
    /// The mock's latency; recorded in the output, and applied when the mock is in-process.
    #[arg(long, default_value_t = 0)]
    pub latency_ms: u64,
    /// An already running OpenAI-compatible server (e.g. `subagents mock-llm`); without it an
    /// in-process mock is started (its CPU then counts in `cpu_s`).
    #[arg(long)]
    pub base_url: Option<String>,
    /// The store to use; its subagents tables are emptied first.
    #[arg(long, default_value = "sqlite://bench.db")]
    pub dsn: String,
    /// Enqueue each run only after the previous one ended, to measure how fast an idle worker
    /// picks a job up (reported as `pickup_p50_ms`/`pickup_p99_ms`).
    #[arg(long)]
    pub sequential: bool,
}

fn cpu_seconds() -> f64 {
    // utime + stime of this process, in clock ticks (100 per second on Linux).
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Runs the benchmark; returns whether every run ended as expected.
pub async fn run(mut settings: Settings, args: BenchArgs) -> anyhow::Result<bool> {
    let mock = match &args.base_url {
        Some(_) => None,
        None => Some(
            MockServer::start(SocketAddr::from(([127, 0, 0, 1], 0)), MockOptions { latency: Duration::from_millis(args.latency_ms), log_file: None })
                .await?,
        ),
    };
    let base_url = args.base_url.clone().unwrap_or_else(|| mock.as_ref().unwrap().base_url());
    settings.database_url = args.dsn.clone();
    settings.openai_base_url = base_url.clone();
    settings.openai_api_key = Some("x".into());
    settings.default_model = "mock-model".into();
    settings.concurrency = args.concurrency;
    let app = App::open(settings).await?;
    app.store.wipe().await?;
    let stats_url = format!("{}/_mock/stats", base_url.trim_end_matches('/').trim_end_matches("/v1"));
    let http = reqwest::Client::new();
    let requests_before = mock_requests(&http, &stats_url).await;

    let shutdown = CancellationToken::new();
    let workers = app.spawn_workers(shutdown.clone());
    tokio::time::sleep(Duration::from_millis(300)).await; // workers registered and idle
    let tag = uuid::Uuid::now_v7().simple().to_string();
    let cpu0 = cpu_seconds();
    let t0 = chrono::Utc::now();
    let mut ids = Vec::with_capacity(args.runs);
    let mut failures = 0usize;
    for i in 0..args.runs {
        let input = format!("Subagent task {i}.\nSCENARIO steps={} tool=echo run={tag}-{i}", args.steps);
        let run = app.start_run(StartRun { agent: Some("echo".into()), input, max_steps: Some(args.steps + 1), ..Default::default() }).await?;
        ids.push(run.id);
        if args.sequential {
            app.wait(run.id, Duration::from_secs(600)).await?;
        }
    }
    let mut durations = vec![];
    let mut pickups = vec![];
    let mut last_end = t0;
    for id in &ids {
        let r = app.wait(*id, Duration::from_secs(3600)).await?.ok_or_else(|| anyhow::anyhow!("run {id} vanished"))?;
        let msgs = app.store.thread_messages(&r.thread_id).await?;
        let tools = msgs.iter().filter(|m| matches!(m.message, Message::Tool { .. })).count();
        let expected = format!("DONE after {} steps", args.steps);
        if r.status != RunStatus::Succeeded || r.result.as_deref() != Some(expected.as_str()) || tools != args.steps as usize - 1 {
            failures += 1;
            eprintln!("run {id}: {:?} {:?} {:?} ({tools} tool results)", r.status, r.result, r.error);
        }
        if let Some(f) = r.finished_at {
            last_end = last_end.max(f);
            durations.push((f - r.created_at).as_seconds_f64());
        }
        if let Some(s) = r.started_at {
            pickups.push((s - r.created_at).as_seconds_f64() * 1000.0);
        }
    }
    let cpu = cpu_seconds() - cpu0;
    let wall = (last_end - t0).as_seconds_f64().max(1e-9);
    shutdown.cancel();
    let _ = workers.await;
    durations.sort_by(f64::total_cmp);
    pickups.sort_by(f64::total_cmp);
    let steps = args.runs as u64 * args.steps as u64;
    let mock_requests = match (mock_requests(&http, &stats_url).await, requests_before) {
        (Some(a), Some(b)) => json!(a - b),
        _ => json!(null),
    };
    let ok = failures == 0;
    let mut out = json!({
        "system": if args.dsn.starts_with("postgres") { "postgres" } else { "sqlite" },
        "ok": ok,
        "runs": args.runs,
        "steps_per_run": args.steps,
        "steps": steps,
        "concurrency": args.concurrency,
        "latency_ms": args.latency_ms,
        "wall_s": round(wall),
        "runs_per_s": round(args.runs as f64 / wall),
        "steps_per_s": round(steps as f64 / wall),
        "p50_run_s": round(percentile(&durations, 0.5)),
        "p99_run_s": round(percentile(&durations, 0.99)),
        "checkpoint_rows": app.store.checkpoint_rows().await?,
        "mock_requests": mock_requests,
        "failures": failures,
        "cpu_s": round(cpu),
        "cpu_ms_per_step": round(cpu * 1000.0 / steps.max(1) as f64),
    });
    if args.sequential {
        out["pickup_p50_ms"] = json!(round(percentile(&pickups, 0.5)));
        out["pickup_p99_ms"] = json!(round(percentile(&pickups, 0.99)));
    }
    println!("{out}");
    Ok(ok)
}

fn round(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

async fn mock_requests(http: &reqwest::Client, url: &str) -> Option<u64> {
    let v: serde_json::Value = http.get(url).send().await.ok()?.json().await.ok()?;
    v["requests"].as_u64()
}
