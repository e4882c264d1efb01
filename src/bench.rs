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
            MockServer::start(SocketAddr::from(([127, 0, 0, 1], 0)), MockOptions { latency: Duration::from_millis(args.latency_ms), ..Default::default() })
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
    let mut failures = 0usize;
    let start = |i: usize| {
        let input = format!("Subagent task {i}.\nSCENARIO steps={} tool=echo run={tag}-{i}", args.steps);
        app.start_run(StartRun { agent: Some("echo".into()), input, max_steps: Some(args.steps + 1), ..Default::default() })
    };
    let mut ids = Vec::with_capacity(args.runs);
    if args.sequential {
        for i in 0..args.runs {
            let run = start(i).await?;
            ids.push(run.id);
            app.wait(run.id, Duration::from_secs(600)).await?;
        }
    } else {
        // Enqueue as a busy caller would: many starts in flight at once.
        use futures::StreamExt;
        let started: Vec<_> = futures::stream::iter(0..args.runs).map(start).buffered(args.concurrency.clamp(1, 64)).collect().await;
        for r in started {
            ids.push(r?.id);
        }
    }
    let mut durations = vec![];
    let mut pickups = vec![];
    let mut last_end = t0;
    for id in &ids {
        let r = app.wait(*id, Duration::from_secs(3600)).await?.ok_or_else(|| anyhow::anyhow!("run {id} vanished"))?;
        let msgs = app.store.thread_messages(&r.thread_id, 100_000).await?;
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

/// Parameters of the API benchmark.
#[derive(clap::Args, Clone, Debug)]
pub struct ApiBenchArgs {
    /// Concurrent `GET /v1/runs/{id}/wait` requests held open.
    #[arg(long, default_value_t = 1000)]
    pub waiters: usize,
    /// Concurrent SSE streams held open.
    #[arg(long, default_value_t = 1000)]
    pub streams: usize,
    /// The mock model's latency per call: the run takes two calls, and every client connects
    /// during the first.
    #[arg(long, default_value_t = 3000)]
    pub latency_ms: u64,
}

fn rss_kb(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Starts `subagents serve` as a child process, holds `waiters` waits and `streams` SSE streams
/// open on one run, and reports the server's memory and how long after the run's end each
/// client heard of it.
pub async fn run_api(args: ApiBenchArgs) -> anyhow::Result<bool> {
    use futures::StreamExt;
    use tokio::io::AsyncBufReadExt;
    let mock = MockServer::start(SocketAddr::from(([127, 0, 0, 1], 0)), MockOptions::default()).await?;
    let dir = std::env::temp_dir().join(format!("subagents-bench-api-{}", uuid::Uuid::now_v7().simple()));
    std::fs::create_dir_all(&dir)?;
    let mut child = tokio::process::Command::new(std::env::current_exe()?)
        .args(["serve", "--host", "127.0.0.1", "--port", "0", "--workers", "2"])
        .current_dir(&dir)
        .env("DATABASE_URL", format!("sqlite://{}", dir.join("bench.db").display()))
        .env("OPENAI_BASE_URL", mock.base_url())
        .env("OPENAI_API_KEY", "x")
        .env("SUBAGENTS_MODEL", "mock-model")
        .env("RUST_LOG", "warn")
        .env_remove("SUBAGENTS_API_KEYS")
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let pid = child.id().ok_or_else(|| anyhow::anyhow!("server exited at once"))?;
    let mut lines = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let base = loop {
        let line = lines.next_line().await?.ok_or_else(|| anyhow::anyhow!("server exited before listening"))?;
        if let Some(rest) = line.split("listening on ").nth(1) {
            break rest.split_whitespace().next().unwrap_or("").to_owned();
        }
    };
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    let http = reqwest::Client::builder().pool_max_idle_per_host(0).build()?;
    let rss_idle = rss_kb(pid, "VmRSS:");
    let input = format!("API bench.\nSCENARIO steps=2 latency_ms={}", args.latency_ms);
    let run: serde_json::Value = http.post(format!("{base}/v1/runs")).json(&json!({"input": input})).send().await?.json().await?;
    let id = run["id"].as_str().ok_or_else(|| anyhow::anyhow!("start failed: {run}"))?.to_owned();

    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..args.waiters {
        let (http, url) = (http.clone(), format!("{base}/v1/runs/{id}/wait?timeout_s=600"));
        tasks.spawn(async move {
            let r = http.get(url).send().await.ok()?;
            let body = r.bytes().await.ok()?;
            let at = chrono::Utc::now();
            let v: serde_json::Value = serde_json::from_slice(&body).ok()?;
            (v["status"] == "succeeded").then_some(("wait", at))
        });
    }
    for _ in 0..args.streams {
        let (http, url) = (http.clone(), format!("{base}/v1/runs/{id}/events"));
        tasks.spawn(async move {
            let r = http.get(url).header("accept", "text/event-stream").send().await.ok()?;
            let mut s = eventsource_stream::Eventsource::eventsource(r.bytes_stream());
            while let Some(Ok(ev)) = s.next().await {
                if ev.event == "run.succeeded" {
                    return Some(("sse", chrono::Utc::now()));
                }
            }
            None
        });
    }
    // Every client is connected well before the run ends: sample the server while they wait.
    tokio::time::sleep(Duration::from_millis(args.latency_ms / 2 + 500)).await;
    let rss_loaded = rss_kb(pid, "VmRSS:");
    let mut waits = vec![];
    let mut sses = vec![];
    let mut failures = 0;
    while let Some(r) = tasks.join_next().await {
        match r {
            Ok(Some(("wait", at))) => waits.push(at),
            Ok(Some((_, at))) => sses.push(at),
            _ => failures += 1,
        }
    }
    let hwm = rss_kb(pid, "VmHWM:");
    let done: serde_json::Value = http.get(format!("{base}/v1/runs/{id}")).send().await?.json().await?;
    let finished: chrono::DateTime<chrono::Utc> = serde_json::from_value(done["finished_at"].clone())?;
    let lat = |v: &[chrono::DateTime<chrono::Utc>]| {
        let mut ms: Vec<f64> = v.iter().map(|t| (*t - finished).as_seconds_f64() * 1000.0).collect();
        ms.sort_by(f64::total_cmp);
        json!({"p50_ms": round(percentile(&ms, 0.5)), "p99_ms": round(percentile(&ms, 0.99)), "max_ms": round(ms.last().copied().unwrap_or(0.0))})
    };
    let ok = failures == 0 && waits.len() == args.waiters && sses.len() == args.streams;
    println!(
        "{}",
        json!({
            "ok": ok, "waiters": args.waiters, "streams": args.streams, "failures": failures,
            "server_rss_idle_mb": round(rss_idle as f64 / 1024.0),
            "server_rss_loaded_mb": round(rss_loaded as f64 / 1024.0),
            "server_rss_peak_mb": round(hwm as f64 / 1024.0),
            "kb_per_connection": round((rss_loaded.saturating_sub(rss_idle)) as f64 / (args.waiters + args.streams).max(1) as f64),
            "wait_end_to_response": lat(&waits),
            "sse_end_to_event": lat(&sses),
        })
    );
    let _ = child.kill().await;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(ok)
}
