//! `subagents bench`: a load benchmark of the whole path (queue → engine → model over HTTP →
//! checkpoints) that prints one JSON line. Figures go in the README; nothing here asserts a
//! speed.

pub mod deltas;
pub mod fork;
pub mod latency;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::app::{App, StartRun};
use crate::config::Settings;
use crate::ids::OwnerId;
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
    /// The mock's latency per call (sent in each run's scenario, so a mock in another process
    /// applies it too).
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
    /// Also measure the database's own ceiling: durable single-row INSERT commits per second at
    /// the same concurrency (what pgbench reports for a one-insert script), reported as
    /// `commits_per_s` and `commit_ratio` (= steps_per_s / commits_per_s).
    #[arg(long)]
    pub calibrate: bool,
    /// How long `--calibrate` commits rows, in seconds.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=600))]
    pub calibrate_secs: u64,
    /// Spread the runs over this many owners (`o0`, `o1`, …) and report each one's queue wait
    /// (created → started) percentiles.
    #[arg(long, default_value_t = 1)]
    pub owners: usize,
    /// Share of the runs that belong to the first owner (0 = spread evenly); its runs are
    /// enqueued first, as a burst, the others' after: what fair sharing is for.
    #[arg(long, default_value_t = 0.0)]
    pub skew: f64,
    /// Most runs of one owner running at once (`SUBAGENTS_OWNER_CONCURRENCY`; 0 = no limit).
    #[arg(long, default_value_t = 0)]
    pub owner_concurrency: u32,
    /// Enqueue every run before the workers start, so up to `--concurrency` of them run at
    /// once from the first moment (enqueueing is otherwise the limit for large counts); reports
    /// the most runs in flight at once and the memory it took (`peak_in_flight`,
    /// `rss_mb_at_peak`, `kb_per_run_in_flight`), and how fast runs were enqueued behind the
    /// growing backlog (`preload_runs_per_s`).
    #[arg(long)]
    pub preload: bool,
    /// Give the model a limit of this many requests per minute (per `SUBAGENTS_RATE_WINDOW_MS`
    /// when set): the in-process mock answers
    /// 429 above it (with `--base-url`, start `mock-llm --rpm N` yourself) and the workers get
    /// `SUBAGENTS_MODEL_LIMITS=mock-model:rpm=N`, so they should wait for budget instead of
    /// provoking refusals; reports the model calls per window reached and the 429s seen
    /// (`model_calls_per_window`, `refused_429`).
    #[arg(long)]
    pub rate_limit: Option<u32>,
}

/// Which owner run `i` of `n` belongs to, for `--owners`/`--skew`; runs come out grouped by
/// owner, the heavy first owner's first.
fn owner_of(i: usize, n: usize, owners: usize, skew: f64) -> usize {
    if owners <= 1 {
        return 0;
    }
    let heavy = if skew > 0.0 {
        ((n as f64) * skew.clamp(0.0, 1.0)).round() as usize
    } else {
        n / owners
    };
    if i < heavy {
        return 0;
    }
    let rest = (n - heavy).max(1);
    1 + ((i - heavy) * (owners - 1)) / rest
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
    let rate_window_ms = settings.rate_window_ms.max(100);
    let mock = match &args.base_url {
        Some(_) => None,
        None => Some(
            MockServer::start(
                SocketAddr::from(([127, 0, 0, 1], 0)),
                MockOptions {
                    latency: Duration::from_millis(args.latency_ms),
                    // Over the workers' window (a minute unless SUBAGENTS_RATE_WINDOW_MS says).
                    rate_limit: args
                        .rate_limit
                        .map(|n| (n as usize, Duration::from_millis(rate_window_ms))),
                    ..Default::default()
                },
            )
            .await?,
        ),
    };
    let base_url = args
        .base_url
        .clone()
        .unwrap_or_else(|| mock.as_ref().unwrap().base_url());
    settings.database_url = args.dsn.clone();
    settings.openai_base_url = base_url.clone();
    settings.openai_api_key = Some("x".into());
    settings.default_model = "mock-model".into();
    settings.concurrency = args.concurrency;
    settings.owner_concurrency = args.owner_concurrency;
    if let Some(n) = args.rate_limit {
        settings.model_limits = format!("mock-model:rpm={n}");
    }
    let app = App::open(settings).await?;
    app.store.wipe().await?;
    let stats_url = format!(
        "{}/_mock/stats",
        base_url.trim_end_matches('/').trim_end_matches("/v1")
    );
    let http = reqwest::Client::new();
    let requests_before = mock_requests(&http, &stats_url).await;
    let refused_before = mock_stat(&http, &stats_url, "refused_429").await;

    let shutdown = CancellationToken::new();
    let tag = uuid::Uuid::now_v7().simple().to_string();
    let mut failures = 0usize;
    let start = |i: usize| {
        // The latency rides in the scenario, so a mock in another process applies it too.
        let latency = if args.latency_ms > 0 {
            format!(" latency_ms={}", args.latency_ms)
        } else {
            String::new()
        };
        let input = format!(
            "Subagent task {i}.\nSCENARIO steps={} tool=echo run={tag}-{i}{latency}",
            args.steps
        );
        let owner = (args.owners > 1)
            .then(|| format!("o{}", owner_of(i, args.runs, args.owners, args.skew)));
        app.start_run(StartRun {
            agent: Some("echo".into()),
            input,
            max_steps: Some(args.steps + 1),
            owner: owner.map(OwnerId::from),
            ..Default::default()
        })
    };
    let mut ids = Vec::with_capacity(args.runs);
    let mut preload_s = 0.0;
    if args.preload {
        use futures::StreamExt;
        let t = std::time::Instant::now();
        let started: Vec<_> = futures::stream::iter(0..args.runs)
            .map(start)
            .buffered(64)
            .collect()
            .await;
        for r in started {
            ids.push(r?.id);
        }
        preload_s = t.elapsed().as_secs_f64();
    }
    let rss_before = rss_kb(std::process::id(), "VmRSS:");
    let workers = app.spawn_workers(shutdown.clone());
    if !args.preload {
        tokio::time::sleep(Duration::from_millis(300)).await; // workers registered and idle
    }
    let cpu0 = cpu_seconds();
    let t0 = chrono::Utc::now();
    if args.preload {
    } else if args.sequential {
        for i in 0..args.runs {
            let run = start(i).await?;
            ids.push(run.id);
            app.wait(run.id, Duration::from_secs(600)).await?;
        }
    } else {
        // Enqueue as a busy caller would: many starts in flight at once.
        use futures::StreamExt;
        let started: Vec<_> = futures::stream::iter(0..args.runs)
            .map(start)
            .buffered(args.concurrency.clamp(1, 64))
            .collect()
            .await;
        for r in started {
            ids.push(r?.id);
        }
    }
    let mut durations = vec![];
    let mut pickups = vec![];
    let mut waits_by_owner: std::collections::BTreeMap<String, Vec<f64>> = Default::default();
    let mut last_end = t0;
    // Until every run has ended, then the CPU; only then each run is read back and checked.
    // The bench's own reads stay out of the measured window: a count by status every 100 ms
    // (one indexed scan) costs less than waiting on each run, whose every commit would wake a
    // read of it.
    // The same count gives the runs in flight (claimed and not ended): their peak and the
    // memory at it (reported with --preload, where every run is enqueued before this loop).
    let deadline = std::time::Instant::now() + Duration::from_secs(3600);
    let (mut peak_in_flight, mut rss_at_peak) = (0i64, 0u64);
    loop {
        let counts = app.store.status_counts().await?;
        let running: i64 = counts
            .iter()
            .filter(|(s, _)| *s == RunStatus::Running)
            .map(|(_, n)| n)
            .sum();
        if running > peak_in_flight {
            (peak_in_flight, rss_at_peak) = (running, rss_kb(std::process::id(), "VmRSS:"));
        }
        let live: i64 = counts
            .iter()
            .filter(|(s, _)| !s.is_terminal())
            .map(|(_, n)| n)
            .sum();
        if live == 0 {
            break;
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "{live} runs still going after an hour"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let cpu = cpu_seconds() - cpu0;
    let expected = format!("DONE after {} steps", args.steps);
    let mut to_check = Vec::with_capacity(ids.len());
    for id in &ids {
        let r = app
            .store
            .get_run(*id)
            .await?
            .ok_or_else(|| anyhow::anyhow!("run {id} vanished"))?;
        if r.status == RunStatus::Succeeded && r.result.as_deref() == Some(expected.as_str()) {
            to_check.push((r.id, r.thread_id.clone()));
        } else {
            failures += 1;
            eprintln!("run {id}: {:?} {:?} {:?}", r.status, r.result, r.error);
        }
        if let Some(f) = r.finished_at {
            last_end = last_end.max(f);
            durations.push((f - r.created_at).as_seconds_f64());
        }
        if let Some(s) = r.started_at {
            let wait = (s - r.created_at).as_seconds_f64() * 1000.0;
            pickups.push(wait);
            waits_by_owner
                .entry(r.owner.to_string())
                .or_default()
                .push(wait);
        }
    }
    let wall = (last_end - t0).as_seconds_f64().max(1e-9);
    for (id, thread) in &to_check {
        let msgs = app.store.thread_messages(thread, 100_000).await?;
        let tools = msgs
            .iter()
            .filter(|m| matches!(m.message, Message::Tool { .. }))
            .count();
        if tools != args.steps as usize - 1 {
            failures += 1;
            eprintln!(
                "run {id}: {tools} tool results, expected {}",
                args.steps - 1
            );
        }
    }
    shutdown.cancel();
    let _ = workers.await;
    durations.sort_by(f64::total_cmp);
    pickups.sort_by(f64::total_cmp);
    let steps = args.runs as u64 * args.steps as u64;
    let mock_requests = match (mock_requests(&http, &stats_url).await, requests_before) {
        (Some(a), Some(b)) => json!(a - b),
        _ => json!(null),
    };
    let refused_429 = match (
        mock_stat(&http, &stats_url, "refused_429").await,
        refused_before,
    ) {
        (Some(a), Some(b)) => Some(a - b),
        _ => None,
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
    if args.owners > 1 {
        let mut per = serde_json::Map::new();
        for (owner, mut w) in waits_by_owner {
            w.sort_by(f64::total_cmp);
            per.insert(
                owner,
                json!({"runs": w.len(), "queue_wait_p50_ms": round(percentile(&w, 0.5)), "queue_wait_p99_ms": round(percentile(&w, 0.99)), "queue_wait_max_ms": round(percentile(&w, 1.0))}),
            );
        }
        out["owners"] = serde_json::Value::Object(per);
        out["skew"] = json!(args.skew);
        out["owner_concurrency"] = json!(args.owner_concurrency);
    }
    if let Some(n) = args.rate_limit {
        out["rate_limit_rpm"] = json!(n);
        out["refused_429"] = json!(refused_429);
        // Requests the model answered, per window of the limit, over the whole run.
        let answered = out["mock_requests"]
            .as_i64()
            .map(|r| r - refused_429.unwrap_or(0) as i64);
        let window_s = rate_window_ms as f64 / 1000.0;
        out["rate_window_ms"] = json!(rate_window_ms);
        out["model_calls_per_window"] = json!(answered.map(|a| round(a as f64 * window_s / wall)));
    }
    if args.preload {
        // Every run enqueued behind all the earlier ones: what a deep backlog costs an enqueue.
        out["preload_runs_per_s"] = json!(round(args.runs as f64 / preload_s.max(1e-9)));
        out["peak_in_flight"] = json!(peak_in_flight);
        out["rss_mb_before_workers"] = json!(round(rss_before as f64 / 1024.0));
        out["rss_mb_at_peak"] = json!(round(rss_at_peak as f64 / 1024.0));
        out["rss_mb_max"] = json!(round(rss_kb(std::process::id(), "VmHWM:") as f64 / 1024.0));
        out["kb_per_run_in_flight"] = json!(round(
            rss_at_peak.saturating_sub(rss_before) as f64 / peak_in_flight.max(1) as f64
        ));
    }
    if args.sequential {
        out["pickup_p50_ms"] = json!(round(percentile(&pickups, 0.5)));
        out["pickup_p99_ms"] = json!(round(percentile(&pickups, 0.99)));
    }
    if args.calibrate {
        let commits = commit_ceiling(
            &args.dsn,
            args.concurrency,
            Duration::from_secs(args.calibrate_secs),
        )
        .await?;
        out["commits_per_s"] = json!(round(commits));
        out["commit_ratio"] = json!(round(steps as f64 / wall / commits.max(1e-9)));
    }
    println!("{out}");
    Ok(ok)
}

/// Durable single-row INSERT commits per second on `dsn` with `concurrency` connections, each
/// committing one row at a time for `during` (a table of its own, dropped afterwards).
async fn commit_ceiling(dsn: &str, concurrency: usize, during: Duration) -> anyhow::Result<f64> {
    let n = concurrency.clamp(1, 256);
    let deadline = tokio::time::Instant::now() + during;
    let count = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let t0 = std::time::Instant::now();
    // The same loop on either backend's pool: `n` connections, one row per commit.
    macro_rules! hammer {
        ($pool:expr, $create:expr) => {{
            let pool = $pool;
            sqlx::query($create).execute(&pool).await?;
            let tasks: Vec<_> = (0..n)
                .map(|_| {
                    let (pool, count) = (pool.clone(), count.clone());
                    tokio::spawn(async move {
                        // Each client keeps its connection, as pgbench's do: going through the
                        // pool per insert would add sqlx's two connection tests to every commit.
                        let Ok(mut conn) = pool.acquire().await else {
                            return;
                        };
                        while tokio::time::Instant::now() < deadline {
                            if sqlx::query("INSERT INTO sa_bench_commits (v) VALUES ('x')")
                                .execute(&mut *conn)
                                .await
                                .is_ok()
                            {
                                count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            }
                        }
                    })
                })
                .collect();
            futures::future::join_all(tasks).await;
            sqlx::query("DROP TABLE sa_bench_commits")
                .execute(&pool)
                .await?;
        }};
    }
    if dsn.starts_with("postgres") {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(n as u32)
            .connect_with(crate::store::postgres::connect_options(dsn)?)
            .await?;
        hammer!(
            pool,
            "CREATE TABLE IF NOT EXISTS sa_bench_commits (id BIGSERIAL PRIMARY KEY, v TEXT NOT NULL)"
        );
    } else {
        // The same settings as the store: WAL with synchronous=NORMAL.
        let opts: sqlx::sqlite::SqliteConnectOptions = dsn.parse()?;
        let opts = opts
            .create_if_missing(true)
            .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
            .synchronous(sqlx::sqlite::SqliteSynchronous::Normal)
            .busy_timeout(Duration::from_secs(30));
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(n as u32)
            .connect_with(opts)
            .await?;
        hammer!(
            pool,
            "CREATE TABLE IF NOT EXISTS sa_bench_commits (id INTEGER PRIMARY KEY AUTOINCREMENT, v TEXT NOT NULL)"
        );
    }
    Ok(count.load(std::sync::atomic::Ordering::Relaxed) as f64 / t0.elapsed().as_secs_f64())
}

/// A default mock model on a free loopback port, and a fresh directory for a benchmark's files.
async fn mock_and_dir(bench: &str) -> anyhow::Result<(MockServer, std::path::PathBuf)> {
    let mock = MockServer::start(
        SocketAddr::from(([127, 0, 0, 1], 0)),
        MockOptions::default(),
    )
    .await?;
    let dir = std::env::temp_dir().join(format!(
        "subagents-bench-{bench}-{}",
        uuid::Uuid::now_v7().simple()
    ));
    std::fs::create_dir_all(&dir)?;
    Ok((mock, dir))
}

fn round(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

async fn mock_requests(http: &reqwest::Client, url: &str) -> Option<u64> {
    mock_stat(http, url, "requests").await
}

/// One counter of the mock's `/_mock/stats`.
async fn mock_stat(http: &reqwest::Client, url: &str, name: &str) -> Option<u64> {
    let v: serde_json::Value = http.get(url).send().await.ok()?.json().await.ok()?;
    v[name].as_u64()
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
    let (mock, dir) = mock_and_dir("api").await?;
    let mut child = tokio::process::Command::new(std::env::current_exe()?)
        .args([
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--workers",
            "2",
        ])
        .current_dir(&dir)
        .env(
            "DATABASE_URL",
            format!("sqlite://{}", dir.join("bench.db").display()),
        )
        .env("OPENAI_BASE_URL", mock.base_url())
        .env("OPENAI_API_KEY", "x")
        .env("SUBAGENTS_MODEL", "mock-model")
        .env("RUST_LOG", "warn")
        .env_remove("SUBAGENTS_API_KEYS")
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let pid = child
        .id()
        .ok_or_else(|| anyhow::anyhow!("server exited at once"))?;
    let mut lines = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let base = loop {
        let line = lines
            .next_line()
            .await?
            .ok_or_else(|| anyhow::anyhow!("server exited before listening"))?;
        if let Some(rest) = line.split("listening on ").nth(1) {
            break rest.split_whitespace().next().unwrap_or("").to_owned();
        }
    };
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()?;
    let rss_idle = rss_kb(pid, "VmRSS:");
    let input = format!(
        "API bench.\nSCENARIO steps=2 latency_ms={}",
        args.latency_ms
    );
    let run: serde_json::Value = http
        .post(format!("{base}/v1/runs"))
        .json(&json!({"input": input}))
        .send()
        .await?
        .json()
        .await?;
    let id = run["id"]
        .as_str()
        .ok_or_else(|| anyhow::anyhow!("start failed: {run}"))?
        .to_owned();

    let mut tasks = tokio::task::JoinSet::new();
    // Waits and streams connect in turn, as clients of both kinds would arrive.
    for i in 0..args.waiters.max(args.streams) {
        if i < args.waiters {
            let (http, url) = (
                http.clone(),
                format!("{base}/v1/runs/{id}/wait?timeout_s=600"),
            );
            tasks.spawn(async move {
                let r = http.get(url).send().await.ok()?;
                let body = r.bytes().await.ok()?;
                let at = chrono::Utc::now();
                // Only the status: the client's own parsing is not the server's latency.
                #[derive(serde::Deserialize)]
                struct Status {
                    status: String,
                }
                let v: Status = serde_json::from_slice(&body).ok()?;
                (v.status == "succeeded").then_some(("wait", at))
            });
        }
        if i < args.streams {
            let (http, url) = (http.clone(), format!("{base}/v1/runs/{id}/events"));
            tasks.spawn(async move {
                let r = http
                    .get(url)
                    .header("accept", "text/event-stream")
                    .send()
                    .await
                    .ok()?;
                let mut s = eventsource_stream::Eventsource::eventsource(r.bytes_stream());
                while let Some(Ok(ev)) = s.next().await {
                    if ev.event == "run.succeeded" {
                        return Some(("sse", chrono::Utc::now()));
                    }
                }
                None
            });
        }
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
    let done: serde_json::Value = http
        .get(format!("{base}/v1/runs/{id}"))
        .send()
        .await?
        .json()
        .await?;
    let finished: chrono::DateTime<chrono::Utc> =
        serde_json::from_value(done["finished_at"].clone())?;
    let lat = |v: &[chrono::DateTime<chrono::Utc>]| {
        let mut ms: Vec<f64> = v
            .iter()
            .map(|t| (*t - finished).as_seconds_f64() * 1000.0)
            .collect();
        ms.sort_by(f64::total_cmp);
        json!({"min_ms": round(ms.first().copied().unwrap_or(0.0)), "p10_ms": round(percentile(&ms, 0.1)), "p50_ms": round(percentile(&ms, 0.5)), "p90_ms": round(percentile(&ms, 0.9)), "p99_ms": round(percentile(&ms, 0.99)), "max_ms": round(ms.last().copied().unwrap_or(0.0))})
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

/// `subagents bench-context` parameters.
#[derive(clap::Args, Clone, Debug)]
pub struct ContextBenchArgs {
    /// Tool steps of the delegated work (then its answer).
    #[arg(long, default_value_t = 10)]
    pub steps: u32,
    /// Smallest tool output, in bytes.
    #[arg(long, default_value_t = 1024)]
    pub min_output: usize,
    /// Largest tool output, in bytes.
    #[arg(long, default_value_t = 4096)]
    pub max_output: usize,
}

/// The context economy of delegation: the same work run inline and delegated with `task`,
/// counted with the model's tokenizer. Prints one JSON line; true when the parent gained at
/// most the child's final text plus 60 tokens (beyond the task statement it wrote).
pub async fn run_context(mut settings: Settings, args: ContextBenchArgs) -> anyhow::Result<bool> {
    use crate::model::tokens::Counter;
    let dir = std::env::temp_dir().join(format!(
        "subagents-bench-context-{}",
        uuid::Uuid::now_v7().simple()
    ));
    std::fs::create_dir_all(dir.join("jobs"))?;
    std::fs::write(
        dir.join("jobs/delegator.md"),
        "---\ndescription: Delegates the work to a subagent and reports its answer.\ntools: [Task]\n---\nMOCK:delegator You delegate work with the task tool.",
    )?;
    let work = format!(
        "Collect the figures.\nSCENARIO steps={} pad={} pad_max={} run=economy",
        args.steps + 1,
        args.min_output,
        args.max_output.max(args.min_output)
    );
    let script = crate::model::mock::Script::from([(
        "delegator".to_owned(),
        vec![
            crate::model::mock::Turn {
                content: None,
                tool_calls: vec![crate::model::mock::ScriptCall {
                    name: "task".into(),
                    arguments: json!({"description": work, "subagent": "general-purpose"}),
                }],
            },
            crate::model::mock::Turn {
                content: Some("Reported.".into()),
                tool_calls: vec![],
            },
        ],
    )]);
    let mock = MockServer::start(
        SocketAddr::from(([127, 0, 0, 1], 0)),
        MockOptions {
            script: Some(std::sync::Arc::new(script)),
            ..Default::default()
        },
    )
    .await?;
    settings.database_url = format!("sqlite://{}", dir.join("bench.db").display());
    settings.jobs_dir = dir.join("jobs");
    settings.workspace = dir.join("workspace");
    settings.openai_base_url = mock.base_url();
    settings.openai_api_key = Some("x".into());
    settings.default_model = "gpt-4o".into();
    let app = App::open(settings).await?;
    let shutdown = CancellationToken::new();
    let workers = app.spawn_workers(shutdown.clone());
    let counter = Counter::for_model("gpt-4o");

    let inline = app
        .start_run(StartRun {
            input: work.clone(),
            ..Default::default()
        })
        .await?;
    let parent = app
        .start_run(StartRun {
            agent: Some("delegator".into()),
            input: "Get the figures.".into(),
            ..Default::default()
        })
        .await?;
    let inline = app
        .wait(inline.id, Duration::from_secs(300))
        .await?
        .ok_or_else(|| anyhow::anyhow!("inline run vanished"))?;
    let parent = app
        .wait(parent.id, Duration::from_secs(300))
        .await?
        .ok_or_else(|| anyhow::anyhow!("parent run vanished"))?;
    shutdown.cancel();
    let _ = workers.await;
    if inline.status != RunStatus::Succeeded || parent.status != RunStatus::Succeeded {
        anyhow::bail!(
            "the benchmark's runs did not succeed: inline {:?} {:?}, delegated {:?} {:?}",
            inline.status,
            inline.error,
            parent.status,
            parent.error
        );
    }
    // What the work added to the context that ran it: everything after its input.
    let inline_msgs = app
        .store
        .thread_messages(&inline.thread_id, 100_000)
        .await?;
    let inline_added: usize = inline_msgs
        .iter()
        .skip(1)
        .map(|m| counter.message(&m.message))
        .sum();
    let parent_msgs = app
        .store
        .thread_messages(&parent.thread_id, 100_000)
        .await?;
    let call = parent_msgs.iter().find(
        |m| matches!(&m.message, Message::Assistant { tool_calls, .. } if !tool_calls.is_empty()),
    );
    let result = parent_msgs
        .iter()
        .find(|m| matches!(m.message, Message::Tool { .. }));
    let (Some(call), Some(result)) = (call, result) else {
        anyhow::bail!("the parent did not delegate")
    };
    let child = app
        .store
        .children(parent.id)
        .await?
        .into_iter()
        .next()
        .ok_or_else(|| anyhow::anyhow!("no child run"))?;
    let final_text = counter.text(child.result.as_deref().unwrap_or(""));
    let (call_tokens, result_tokens) = (
        counter.message(&call.message),
        counter.message(&result.message),
    );
    let added = call_tokens + result_tokens;
    let tool_outputs: Vec<usize> = inline_msgs
        .iter()
        .filter_map(|m| match &m.message {
            Message::Tool { content, .. } => Some(content.len()),
            _ => None,
        })
        .collect();
    // The task statement is the parent's own words (inline work has one too): what delegation
    // adds beyond it and the child's answer is the framing of the call and of its result.
    let statement = counter.text(&work);
    let overhead = added as i64 - final_text as i64 - statement as i64;
    let ok = overhead <= 60;
    println!(
        "{}",
        json!({
            "bench": "context",
            "child_tool_steps": args.steps,
            "tool_output_bytes": {"min": tool_outputs.iter().min(), "max": tool_outputs.iter().max()},
            "inline_added_tokens": inline_added,
            "delegated_added_tokens": added,
            "delegated_call_tokens": call_tokens,
            "delegated_result_tokens": result_tokens,
            "child_final_text_tokens": final_text,
            "task_statement_tokens": statement,
            "overhead_tokens": overhead,
            "inline_over_delegated": (inline_added as f64 / added.max(1) as f64 * 10.0).round() / 10.0,
            "target_overhead_le_60": ok,
            "delegated_result": match &result.message { Message::Tool { content, .. } => content.clone(), _ => String::new() },
        })
    );
    drop(app);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(ok)
}

/// A fresh directory for a bench that serves no runs (no workers): its jobs, its workspace, and
/// its SQLite file unless `dsn` names a database. The caller removes it.
pub(crate) fn scratch(
    settings: &mut Settings,
    name: &str,
    dsn: &str,
) -> anyhow::Result<std::path::PathBuf> {
    let dir = std::env::temp_dir().join(format!(
        "subagents-bench-{name}-{}",
        uuid::Uuid::now_v7().simple()
    ));
    std::fs::create_dir_all(&dir)?;
    settings.database_url = if dsn.is_empty() {
        format!("sqlite://{}", dir.join("bench.db").display())
    } else {
        dsn.to_owned()
    };
    settings.jobs_dir = dir.join("jobs");
    settings.workspace = dir.join("workspace");
    settings.concurrency = 0;
    Ok(dir)
}

/// Arguments of `subagents bench-dashboard`.
#[derive(clap::Args, Debug, Clone)]
pub struct DashboardBenchArgs {
    /// Runs in the database (one owner; 1 in 100 within the last hour, with events).
    #[arg(long, default_value_t = 100_000)]
    pub runs: u32,
    /// Times each request is repeated (the figures are medians and maxima).
    #[arg(long, default_value_t = 20)]
    pub repeat: usize,
    /// Database to seed; its runs are WIPED first. Default: a fresh SQLite file in a temporary
    /// directory.
    #[arg(long, default_value = "")]
    pub dsn: String,
}

/// The dashboard's first render with a big history: seeds `runs` runs (into `--dsn`, wiped
/// first; a fresh SQLite file by default), serves the API in-process,
/// and times what the overview page asks the server for (the page, its two assets, and
/// `/v1/overview`), then the runs table's first page, a text search and a filtered page.
/// Prints one JSON line; true when the overview's first render took under 500 ms of server
/// time (median).
pub async fn run_dashboard(
    mut settings: Settings,
    args: DashboardBenchArgs,
) -> anyhow::Result<bool> {
    let dir = scratch(&mut settings, "dashboard", &args.dsn)?;
    let app = std::sync::Arc::new(crate::app::App::open(settings).await?);
    app.store.wipe().await?;
    let owner = crate::app::LOCAL_OWNER;
    let t0 = Instant::now();
    app.store
        .seed_history(&owner.into(), args.runs, chrono::Utc::now())
        .await?;
    let seed_s = t0.elapsed().as_secs_f64();
    eprintln!("seeded {} runs in {seed_s:.1}s", args.runs);
    let shutdown = tokio_util::sync::CancellationToken::new();
    let server = crate::api::Server::start(
        app.clone(),
        crate::api::auth::Keys::default(),
        SocketAddr::from(([127, 0, 0, 1], 0)),
        shutdown.clone(),
    )
    .await?;
    let base = format!("http://{}", server.addr);
    let http = reqwest::Client::new();
    let mut figures = serde_json::Map::new();
    let mut time = async |name: &str, paths: &[&str]| -> anyhow::Result<f64> {
        let mut samples = vec![];
        for _ in 0..args.repeat.max(1) {
            let t = Instant::now();
            for p in paths {
                let r = http.get(format!("{base}{p}")).send().await?;
                anyhow::ensure!(r.status().is_success(), "{p}: HTTP {}", r.status());
                r.bytes().await?;
            }
            samples.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        samples.sort_by(f64::total_cmp);
        let p50 = samples[samples.len() / 2];
        figures.insert(format!("{name}_ms_p50"), json!((p50 * 10.0).round() / 10.0));
        figures.insert(
            format!("{name}_ms_max"),
            json!((samples[samples.len() - 1] * 10.0).round() / 10.0),
        );
        Ok(p50)
    };
    let first_render = time(
        "overview_first_render",
        &[
            "/ui/",
            "/ui/assets/app.js",
            "/ui/assets/app.css",
            "/v1/overview",
        ],
    )
    .await?;
    time("overview_api", &["/v1/overview"]).await?;
    time("runs_page", &["/v1/runs?limit=50"]).await?;
    time("runs_failed_page", &["/v1/runs?limit=50&status=failed"]).await?;
    time("runs_text_search", &["/v1/runs?limit=50&q=no-such-text"]).await?;
    shutdown.cancel();
    let _ = server.join().await;
    let ok = first_render < 500.0;
    let mut line = json!({"bench": "dashboard", "database": crate::app::redact(&app.settings.database_url), "runs": args.runs, "seed_s": (seed_s * 10.0).round() / 10.0, "repeat": args.repeat, "ok": ok});
    line.as_object_mut().expect("object").extend(figures);
    println!("{line}");
    let _ = std::fs::remove_dir_all(&dir);
    Ok(ok)
}

#[cfg(test)]
mod tests {
    use super::owner_of;

    #[test]
    fn a_skewed_split_puts_the_burst_first() {
        let owners: Vec<usize> = (0..10).map(|i| owner_of(i, 10, 3, 0.8)).collect();
        assert_eq!(owners, [0, 0, 0, 0, 0, 0, 0, 0, 1, 2]);
        let even: Vec<usize> = (0..9).map(|i| owner_of(i, 9, 3, 0.0)).collect();
        assert_eq!(even, [0, 0, 0, 1, 1, 1, 2, 2, 2]);
        assert!((0..5).all(|i| owner_of(i, 5, 1, 0.5) == 0));
    }
}
