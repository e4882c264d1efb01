//! `subagents bench-latency`: what a caller of `POST /v1/runs/wait` waits for a short run, next
//! to the floor the machine sets for the same work.
//!
//! Two setups, each in processes of their own as a deployment runs them: SQLite with one `serve`
//! process and its embedded workers; PostgreSQL with Redis, `serve --workers 0` and one `worker`.
//! For runs of 1 and 3 steps (the model answers at once: a loopback mock with no latency) it
//! times the round trip one caller at a time and with `--callers` at once. The floor is the work
//! such a run cannot avoid, timed alone on the same machine and database: the run's own model
//! calls (its requests, captured from one run and sent again to the mock, streamed and read to
//! the end: the mock's share of a step depends on what it is sent, a prompt with tool schemas
//! to count, not on who sends it), and `2 × steps + 2` single-row durable commits on a kept
//! connection (the run's start, its claim, one per model answer, one per tool batch, and the
//! queue's ack). It prints one JSON line: p50/p90/p99 of every figure (the floor's model calls
//! and commits also apart, `floor_model_ms` and `floor_commits_ms`), and the ratio of each
//! round trip to its floor.
//!
//! The floor includes the mock's own work for those requests, so the ratios move with the
//! mock's efficiency: when the mock stopped tokenizing every message of every request again,
//! SQLite's 3-step floor fell from about 2.6 to 1.4 ms and the ratio rose from 2.9× to 4.5–5×,
//! with the round trip itself 0.8 ms faster (docs/benchmarks.md). Compare builds on one mock.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::{percentile, round};
use crate::model::mock::MockServer;

/// Which deployments `bench-latency` measures.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Setups {
    /// SQLite, one `serve` process with embedded workers.
    Sqlite,
    /// PostgreSQL and Redis, `serve --workers 0` and one `worker` process.
    Postgres,
    /// Both, one after the other.
    Both,
}

/// `subagents bench-latency` parameters.
#[derive(clap::Args, Clone, Debug)]
pub struct LatencyBenchArgs {
    /// Timed runs per figure, after the warm-up.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub runs: u64,
    /// Untimed runs first (connections, caches, the tokenizer).
    #[arg(long, default_value_t = 5)]
    pub warmup: u64,
    /// Callers at once in the concurrent round (each waits for its run, then starts the next);
    /// 0 skips it.
    #[arg(long, default_value_t = 8)]
    pub callers: u64,
    /// Which deployments, on which services.
    #[command(flatten)]
    pub deploy: Deployments,
}

/// Which deployments a benchmark measures, and the services of the fleet one.
#[derive(clap::Args, Clone, Debug)]
pub struct Deployments {
    /// Which deployments to measure.
    #[arg(long, value_enum, default_value = "both")]
    pub setup: Setups,
    /// A PostgreSQL server: the database `sa_latency` on it is dropped and created for the run.
    #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432/postgres")]
    pub postgres: String,
    /// Redis for the PostgreSQL setup.
    #[arg(long, default_value = "redis://127.0.0.1:6379/13")]
    pub redis: String,
}

/// Runs the benchmark; returns whether every run succeeded.
pub async fn run(args: LatencyBenchArgs) -> anyhow::Result<bool> {
    let (mock, dir) = super::mock_and_dir("latency").await?;
    let mut out = serde_json::Map::new();
    let mut ok = true;
    if args.deploy.setup != Setups::Postgres {
        let dsn = format!("sqlite://{}", dir.join("latency.db").display());
        let env = vec![("DATABASE_URL".to_owned(), dsn.clone())];
        let serve = Proc::serve(&dir, &mock, &env, 8).await?;
        let (figures, fine) = measure(&args, &serve.base, &mock, &dsn).await?;
        ok &= fine;
        out.insert("sqlite".into(), figures);
        drop(serve);
    }
    if args.deploy.setup != Setups::Sqlite {
        let dsn = fresh_database(&args.deploy.postgres).await?;
        let env = vec![
            ("DATABASE_URL".to_owned(), dsn.clone()),
            ("REDIS_URL".to_owned(), args.deploy.redis.clone()),
        ];
        let serve = Proc::serve(&dir, &mock, &env, 0).await?;
        let worker = Proc::worker(&dir, &mock, &env).await?;
        let (figures, fine) = measure(&args, &serve.base, &mock, &dsn).await?;
        ok &= fine;
        out.insert("postgres".into(), figures);
        drop((serve, worker));
    }
    out.insert("ok".into(), json!(ok));
    out.insert("runs".into(), json!(args.runs));
    out.insert("callers".into(), json!(args.callers));
    println!("{}", Value::Object(out));
    let _ = std::fs::remove_dir_all(&dir);
    Ok(ok)
}

/// Every figure of one setup: for 1 and 3 steps, the round trips and their floor.
async fn measure(
    args: &LatencyBenchArgs,
    base: &str,
    mock: &MockServer,
    dsn: &str,
) -> anyhow::Result<(Value, bool)> {
    let http = reqwest::Client::new();
    let mut ok = true;
    let mut figures = serde_json::Map::new();
    for steps in [1u32, 3] {
        for _ in 0..args.warmup {
            ok &= round_trip(&http, base, steps).await.is_some();
        }
        let mut seq = vec![];
        for _ in 0..args.runs {
            match round_trip(&http, base, steps).await {
                Some(ms) => seq.push(ms),
                None => ok = false,
            }
        }
        let mut concurrent = vec![];
        if args.callers > 0 {
            let per_caller = args.runs.div_ceil(args.callers);
            let tasks: Vec<_> = (0..args.callers)
                .map(|_| {
                    let (http, base) = (http.clone(), base.to_owned());
                    tokio::spawn(async move {
                        let mut v = vec![];
                        for _ in 0..per_caller {
                            v.push(round_trip(&http, &base, steps).await);
                        }
                        v
                    })
                })
                .collect();
            for t in futures::future::join_all(tasks).await {
                for r in t? {
                    match r {
                        Some(ms) => concurrent.push(ms),
                        None => ok = false,
                    }
                }
            }
        }
        // The run's own requests, for the floor.
        mock.state.capture();
        ok &= round_trip(&http, base, steps).await.is_some();
        let requests = mock.state.take_captured();
        anyhow::ensure!(
            requests.len() == steps as usize,
            "a {steps}-step run sent {} model requests",
            requests.len()
        );
        let floor = floor(&http, mock, dsn, &requests, args.warmup, args.runs).await?;
        let seq = summary(seq);
        let floor_model = summary(floor.iter().map(|f| f.model).collect());
        let floor_commits = summary(floor.iter().map(|f| f.commits).collect());
        let floor = summary(floor.iter().map(|f| f.model + f.commits).collect());
        let ratio = |a: &Value, ka: &str, b: &Value, kb: &str| {
            round(a[ka].as_f64().unwrap_or(0.0) / b[kb].as_f64().unwrap_or(1.0).max(1e-9))
        };
        figures.insert(
            format!("steps_{steps}"),
            json!({
                "sequential_ms": seq,
                "concurrent_ms": summary(concurrent),
                "floor_ms": floor,
                "floor_model_ms": floor_model,
                "floor_commits_ms": floor_commits,
                "p50_over_floor_p50": ratio(&seq, "p50", &floor, "p50"),
                "p99_over_p50": ratio(&seq, "p99", &seq, "p50"),
            }),
        );
    }
    Ok((Value::Object(figures), ok))
}

/// One `POST /v1/runs/wait` of a run of `steps` steps, in ms; `None` unless it succeeded.
async fn round_trip(http: &reqwest::Client, base: &str, steps: u32) -> Option<f64> {
    let input = if steps > 1 {
        format!("Latency.\nSCENARIO steps={steps} tool=echo")
    } else {
        "Latency.".to_owned()
    };
    let t0 = Instant::now();
    let r = http
        .post(format!("{base}/v1/runs/wait"))
        .json(&json!({"input": input, "timeout_s": 60}))
        .send()
        .await
        .ok()?;
    let v: Value = r.json().await.ok()?;
    let ms = t0.elapsed().as_secs_f64() * 1000.0;
    if v["status"] != "succeeded" {
        tracing::warn!(run = %v, "a benchmark run did not succeed");
        return None;
    }
    Some(ms)
}

/// One timing of the floor, in ms: its model calls and its commits.
struct Floor {
    model: f64,
    commits: f64,
}

/// The floor of a run whose model requests were `requests`, `runs` times (after `warmup`
/// untimed): each request sent to the mock over loopback (streamed and read to the end, as the
/// engine does), then `2 × steps + 2` single-row commits on a kept connection to the same
/// database.
async fn floor(
    http: &reqwest::Client,
    mock: &MockServer,
    dsn: &str,
    requests: &[axum::body::Bytes],
    warmup: u64,
    runs: u64,
) -> anyhow::Result<Vec<Floor>> {
    let url = format!("{}/chat/completions", mock.base_url());
    let commits = 2 * requests.len() + 2;
    let mut db = Committer::open(dsn).await?;
    let mut out = vec![];
    for i in 0..warmup + runs {
        let t0 = Instant::now();
        for body in requests {
            let r = http
                .post(&url)
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(body.clone())
                .send()
                .await?;
            anyhow::ensure!(
                r.status().is_success(),
                "the mock refused a replayed request"
            );
            r.bytes().await?;
        }
        let t1 = Instant::now();
        for _ in 0..commits {
            db.commit().await?;
        }
        if i >= warmup {
            out.push(Floor {
                model: (t1 - t0).as_secs_f64() * 1000.0,
                commits: t1.elapsed().as_secs_f64() * 1000.0,
            });
        }
    }
    db.close().await?;
    Ok(out)
}

/// One kept connection committing one row at a time, with the store's durability settings.
enum Committer {
    Sqlite(sqlx::SqliteConnection),
    Postgres(sqlx::PgConnection),
}

impl Committer {
    async fn open(dsn: &str) -> anyhow::Result<Self> {
        use sqlx::{ConnectOptions, Executor};
        let create = "CREATE TABLE IF NOT EXISTS sa_latency_floor (v TEXT NOT NULL)";
        Ok(if dsn.starts_with("postgres") {
            let mut c = crate::store::postgres::connect_options(dsn)?
                .connect()
                .await?;
            c.execute(create).await?;
            Committer::Postgres(c)
        } else {
            let opts: sqlx::sqlite::SqliteConnectOptions = dsn.parse()?;
            let mut c = opts
                .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
                .synchronous(sqlx::sqlite::SqliteSynchronous::Normal)
                .busy_timeout(Duration::from_secs(30))
                .connect()
                .await?;
            c.execute(create).await?;
            Committer::Sqlite(c)
        })
    }

    async fn commit(&mut self) -> anyhow::Result<()> {
        let q = "INSERT INTO sa_latency_floor (v) VALUES ('x')";
        match self {
            Committer::Sqlite(c) => sqlx::query(q).execute(c).await.map(drop)?,
            Committer::Postgres(c) => sqlx::query(q).execute(c).await.map(drop)?,
        }
        Ok(())
    }

    async fn close(self) -> anyhow::Result<()> {
        let q = "DROP TABLE sa_latency_floor";
        match self {
            Committer::Sqlite(mut c) => sqlx::query(q).execute(&mut c).await.map(drop)?,
            Committer::Postgres(mut c) => sqlx::query(q).execute(&mut c).await.map(drop)?,
        }
        Ok(())
    }
}

/// p50/p90/p99 (and the count) of a list of milliseconds.
pub(super) fn summary(mut ms: Vec<f64>) -> Value {
    ms.sort_by(f64::total_cmp);
    json!({
        "n": ms.len(),
        "p50": round(percentile(&ms, 0.5)),
        "p90": round(percentile(&ms, 0.9)),
        "p99": round(percentile(&ms, 0.99)),
    })
}

/// Drops and creates the database `sa_latency` on the server `admin` points at; returns its URL.
pub(super) async fn fresh_database(admin: &str) -> anyhow::Result<String> {
    use sqlx::{ConnectOptions, Executor};
    let name = "sa_latency";
    let mut c = crate::store::postgres::connect_options(admin)?
        .connect()
        .await?;
    c.execute("DROP DATABASE IF EXISTS sa_latency WITH (FORCE)")
        .await?;
    c.execute("CREATE DATABASE sa_latency").await?;
    // postgres://USER@HOST:PORT/DB?PARAMS with DB replaced.
    let (head, params) = admin.split_once('?').unwrap_or((admin, ""));
    let server = match head.find("://").map(|i| i + 3) {
        Some(i) => head[..i].to_owned() + head[i..].split('/').next().unwrap_or(""),
        None => anyhow::bail!("not a postgres:// URL: {admin}"),
    };
    let sep = if params.is_empty() { "" } else { "?" };
    Ok(format!("{server}/{name}{sep}{params}"))
}

/// A `subagents` child process, killed when dropped.
pub(super) struct Proc {
    child: tokio::process::Child,
    /// `serve`'s base URL (empty for a worker).
    pub(super) base: String,
}

impl Proc {
    fn command(
        dir: &std::path::Path,
        mock: &MockServer,
        env: &[(String, String)],
    ) -> anyhow::Result<tokio::process::Command> {
        let mut cmd = tokio::process::Command::new(std::env::current_exe()?);
        cmd.current_dir(dir)
            .env("OPENAI_BASE_URL", mock.base_url())
            .env("OPENAI_API_KEY", "x")
            .env("SUBAGENTS_MODEL", "mock-model")
            .env("SUBAGENTS_ECHO_TOOL", "1")
            .env("SUBAGENTS_CONCURRENCY", "8")
            .env("RUST_LOG", "warn")
            .env_remove("SUBAGENTS_API_KEYS")
            .envs(env.iter().map(|(k, v)| (k, v)))
            .kill_on_drop(true);
        Ok(cmd)
    }

    /// `serve` on a free loopback port, with `workers` embedded workers; returns once it listens.
    pub(super) async fn serve(
        dir: &std::path::Path,
        mock: &MockServer,
        env: &[(String, String)],
        workers: usize,
    ) -> anyhow::Result<Proc> {
        use tokio::io::AsyncBufReadExt;
        let mut child = Self::command(dir, mock, env)?
            .args(["serve", "--host", "127.0.0.1", "--port", "0"])
            .args(["--workers", &workers.to_string()])
            .stderr(std::process::Stdio::piped())
            .spawn()?;
        let mut lines = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
        let base = loop {
            let line = lines
                .next_line()
                .await?
                .ok_or_else(|| anyhow::anyhow!("serve exited before listening"))?;
            if let Some(rest) = line.split("listening on ").nth(1) {
                break rest.split_whitespace().next().unwrap_or("").to_owned();
            }
        };
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(Proc { child, base })
    }

    /// One `worker` process (the warm-up runs wait for it to be ready).
    pub(super) async fn worker(
        dir: &std::path::Path,
        mock: &MockServer,
        env: &[(String, String)],
    ) -> anyhow::Result<Proc> {
        let child = Self::command(dir, mock, env)?.arg("worker").spawn()?;
        Ok(Proc {
            child,
            base: String::new(),
        })
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}
