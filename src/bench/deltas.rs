//! `subagents bench-deltas`: how late a client watching `GET /v1/runs/{id}/events?include=deltas`
//! sees the model's first token, with many streams open at once.
//!
//! The mock stamps the first chunk of each answer with the wall-clock microsecond it sends it
//! (`stamp=1`); each client notes when the `model.delta` carrying that chunk arrives. Both sides
//! run on this machine, so their clocks agree. Setups as a deployment runs them: SQLite with one
//! `serve` process and its embedded workers (deltas go through the process's in-memory hub), and
//! PostgreSQL with Redis, `serve --workers 0` and one `worker` (deltas go through Redis
//! Streams). Prints one JSON line per setup.

use std::time::Duration;

use futures::StreamExt;
use serde_json::{Value, json};

use super::latency::{Deployments, Proc, Setups, fresh_database, summary};

/// `subagents bench-deltas` parameters.
#[derive(clap::Args, Clone, Debug)]
pub struct DeltaBenchArgs {
    /// Streams open at once (one run each, all streaming together).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..=2000))]
    pub streams: u64,
    /// Milliseconds between the mock's chunks (an answer written over a second or so).
    #[arg(long, default_value_t = 20)]
    pub chunk_ms: u64,
    /// Which deployments, on which services.
    #[command(flatten)]
    pub deploy: Deployments,
}

/// Runs the benchmark; returns whether every stream saw its first token.
pub async fn run(args: DeltaBenchArgs) -> anyhow::Result<bool> {
    let (mock, dir) = super::mock_and_dir("deltas").await?;
    let workers = args.streams.to_string();
    let mut ok = true;
    if args.deploy.setup != Setups::Postgres {
        let env = vec![
            (
                "DATABASE_URL".to_owned(),
                format!("sqlite://{}", dir.join("deltas.db").display()),
            ),
            ("SUBAGENTS_CONCURRENCY".to_owned(), workers.clone()),
        ];
        let serve = Proc::serve(&dir, &mock, &env, args.streams as usize).await?;
        let (figures, fine) = measure(&args, &serve.base, "sqlite").await?;
        ok &= fine;
        println!("{figures}");
    }
    if args.deploy.setup != Setups::Sqlite {
        let dsn = fresh_database(&args.deploy.postgres).await?;
        let env = vec![
            ("DATABASE_URL".to_owned(), dsn),
            ("REDIS_URL".to_owned(), args.deploy.redis.clone()),
            ("SUBAGENTS_CONCURRENCY".to_owned(), workers),
        ];
        let serve = Proc::serve(&dir, &mock, &env, 0).await?;
        let _worker = Proc::worker(&dir, &mock, &env).await?;
        let (figures, fine) = measure(&args, &serve.base, "postgres+redis").await?;
        ok &= fine;
        println!("{figures}");
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(ok)
}

/// Starts `streams` runs whose model waits a second (so every client is listening) and then
/// writes its answer in chunks; returns the first-token delays of the clients.
async fn measure(args: &DeltaBenchArgs, base: &str, setup: &str) -> anyhow::Result<(Value, bool)> {
    let http = reqwest::Client::new();
    // The process is up and its workers take runs.
    let warm: Value = http
        .post(format!("{base}/v1/runs/wait"))
        .json(&json!({"input": "warm up", "timeout_s": 60}))
        .send()
        .await?
        .json()
        .await?;
    anyhow::ensure!(warm["status"] == "succeeded", "warm-up run: {warm}");
    let words = "the answer is written one word at a time ".repeat(3);
    let mut clients = vec![];
    for i in 0..args.streams {
        let input = format!(
            "{words}\nSCENARIO stamp=1 latency_ms=1500 chunk_ms={} run=d{i}",
            args.chunk_ms
        );
        let started: Value = http
            .post(format!("{base}/v1/runs"))
            .json(&json!({"input": input}))
            .send()
            .await?
            .json()
            .await?;
        let id = started["id"]
            .as_str()
            .ok_or_else(|| anyhow::anyhow!("no run id in {started}"))?
            .to_owned();
        let url = format!("{base}/v1/runs/{id}/events?include=deltas");
        let http = http.clone();
        clients.push(tokio::spawn(async move { first_token(&http, &url).await }));
    }
    let mut ms = vec![];
    let mut missed = 0;
    for c in clients {
        match c.await? {
            Some(d) => ms.push(d),
            None => missed += 1,
        }
    }
    let figures = json!({
        "bench": "deltas",
        "setup": setup,
        "streams": args.streams,
        "chunk_ms": args.chunk_ms,
        "missed": missed,
        "first_delta_ms": summary(ms),
    });
    Ok((figures, missed == 0))
}

/// Reads the run's event stream until it ends; the delay between the mock sending the stamped
/// first chunk and this client receiving it, in milliseconds.
async fn first_token(http: &reqwest::Client, url: &str) -> Option<f64> {
    use eventsource_stream::Eventsource;
    let resp = http
        .get(url)
        .header("accept", "text/event-stream")
        .send()
        .await
        .ok()?;
    let mut events = resp.bytes_stream().eventsource();
    let mut seen = None;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while let Ok(Some(Ok(ev))) = tokio::time::timeout_at(deadline, events.next()).await {
        if ev.event == "model.delta" && seen.is_none() {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .ok()?
                .as_micros() as f64;
            let v: Value = serde_json::from_str(&ev.data).ok()?;
            let stamp = v["text"]
                .as_str()
                .and_then(|t| t.split_whitespace().next())
                .and_then(|w| w.parse::<f64>().ok());
            if let Some(s) = stamp {
                seen = Some((now - s) / 1000.0);
            }
        }
        if matches!(
            ev.event.as_str(),
            "run.succeeded" | "run.failed" | "run.cancelled"
        ) {
            break;
        }
    }
    seen
}
