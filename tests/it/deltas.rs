//! The answer as it is written: `GET /v1/runs/{id}/events?include=deltas` gives the step in
//! flight's text and tool-argument fragments between the durable events, unnumbered, on one
//! SQLite process and through Redis; a client that reconnects with `Last-Event-ID` misses no
//! durable event.

use futures::StreamExt;
use serde_json::{Value, json};
use subagents::app::StartRun;
use subagents::store::RunRecord;

use crate::support::*;

/// One SSE block as sent: its `id:` (if any), `event:` and `data:` lines.
#[derive(Debug)]
struct Block {
    id: Option<u64>,
    event: String,
    data: Value,
}

fn parse_blocks(raw: &str) -> (Vec<Block>, String) {
    let mut out = vec![];
    let mut rest = raw;
    while let Some(end) = rest.find("\n\n") {
        let block = &rest[..end];
        rest = &rest[end + 2..];
        let (mut id, mut event, mut data) = (None, String::new(), String::new());
        for line in block.lines() {
            if let Some(v) = line.strip_prefix("id:") {
                id = v.trim().parse().ok();
            } else if let Some(v) = line.strip_prefix("event:") {
                event = v.trim().to_owned();
            } else if let Some(v) = line.strip_prefix("data:") {
                data.push_str(v.trim_start());
            }
        }
        if !data.is_empty() {
            out.push(Block {
                id,
                event,
                data: serde_json::from_str(&data).unwrap(),
            });
        }
    }
    (out, rest.to_owned())
}

/// Reads the stream until `stop` says so or it ends; returns the blocks read.
async fn read_until(resp: reqwest::Response, stop: impl Fn(&[Block]) -> bool) -> Vec<Block> {
    let mut body = resp.bytes_stream();
    let (mut blocks, mut pending) = (vec![], String::new());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while let Ok(Some(chunk)) = tokio::time::timeout_at(deadline.into(), body.next()).await {
        pending.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
        let (more, rest) = parse_blocks(&pending);
        pending = rest;
        blocks.extend(more);
        if stop(&blocks) {
            break;
        }
    }
    blocks
}

async fn open(base: &str, run: &RunRecord, last: Option<u64>) -> reqwest::Response {
    let mut req = reqwest::Client::new()
        .get(format!("{base}/v1/runs/{}/events?include=deltas", run.id))
        .header("accept", "text/event-stream");
    if let Some(l) = last {
        req = req.header("last-event-id", l.to_string());
    }
    let resp = req.send().await.unwrap();
    assert_eq!(resp.status(), 200);
    resp
}

async fn start(t: &TestApp, input: &str) -> RunRecord {
    t.app
        .start_run(StartRun {
            input: input.into(),
            ..Default::default()
        })
        .await
        .unwrap()
}

/// The whole answer and tool arguments come through as deltas, unnumbered, between gap-free
/// durable events.
async fn deltas_tell_the_answer(t: &TestApp) {
    let base = t.serve("").await;
    let run = start(t, "SCENARIO steps=2 latency_ms=700 run=live").await;
    let blocks = read_until(open(&base, &run, None).await, |_| false).await;
    let durable: Vec<u64> = blocks.iter().filter_map(|b| b.id).collect();
    let n = t.events(run.id).await.len() as u64;
    assert_eq!(durable, (1..=n).collect::<Vec<_>>(), "{blocks:?}");
    assert_eq!(blocks.last().unwrap().event, "run.succeeded");
    let deltas: Vec<&Block> = blocks.iter().filter(|b| b.event == "model.delta").collect();
    assert!(
        deltas.iter().all(|b| b.id.is_none()),
        "deltas are never numbered"
    );
    assert!(
        deltas
            .iter()
            .all(|b| b.data["type"] == "model.delta" && b.data["run_id"] == json!(run.id))
    );
    let text: String = deltas
        .iter()
        .filter(|b| b.data["step"] == 2)
        .filter_map(|b| b.data["text"].as_str())
        .collect();
    assert_eq!(text, "DONE after 2 steps", "{deltas:?}");
    let args: String = deltas
        .iter()
        .filter(|b| b.data["step"] == 1)
        .filter_map(|b| b.data["tool_call"]["arguments"].as_str())
        .collect();
    assert_eq!(args, json!({"text": "step 1 call 1"}).to_string());
    assert!(deltas.iter().any(|b| b.data["tool_call"]["name"] == "echo"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_sqlite_process_streams_the_answer_as_it_is_written() {
    let t = spawn_app().await;
    deltas_tell_the_answer(&t).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deltas_come_through_redis_streams() {
    let redis = RedisServer::start();
    let url = redis.url();
    let t = spawn_app_with(Options {
        tweak: Box::new(move |s| s.redis_url = Some(url)),
        ..Default::default()
    })
    .await;
    deltas_tell_the_answer(&t).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_reconnects_with_last_event_id_misses_no_durable_event() {
    let t = spawn_app().await;
    let base = t.serve("").await;
    let run = start(&t, "SCENARIO steps=3 latency_ms=300 chunk_ms=80 run=again").await;
    // Drop the connection at the first delta.
    let first = read_until(open(&base, &run, None).await, |b| {
        b.iter().any(|b| b.event == "model.delta")
    })
    .await;
    let seen: Vec<u64> = first.iter().filter_map(|b| b.id).collect();
    let last = *seen.last().expect("a durable event before the first delta");
    let rest = read_until(open(&base, &run, Some(last)).await, |_| false).await;
    let after: Vec<u64> = rest.iter().filter_map(|b| b.id).collect();
    let n = t.events(run.id).await.len() as u64;
    let all: Vec<u64> = seen.iter().chain(after.iter()).copied().collect();
    assert_eq!(all, (1..=n).collect::<Vec<_>>(), "{first:?}\n{rest:?}");
    assert_eq!(rest.last().unwrap().event, "run.succeeded");
    assert!(rest.iter().any(|b| b.event == "model.delta"), "{rest:?}");
    // Bad asks are refused.
    let r = reqwest::Client::new()
        .get(format!("{base}/v1/runs/{}/events?include=tokens", run.id))
        .header("accept", "text/event-stream")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let r = reqwest::get(format!("{base}/v1/runs/{}/events?include=deltas", run.id))
        .await
        .unwrap();
    assert_eq!(r.status(), 400, "deltas need SSE");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subagents_run_on_a_terminal_prints_the_answer_as_it_streams_and_once() {
    let t = spawn_app_with(Options {
        workers: false,
        ..Default::default()
    })
    .await;
    // `script` gives the command a terminal for stdout.
    let cmd = format!(
        "{} run --quiet 'Go.\nSCENARIO steps=2 latency_ms=200 run=tty'",
        env!("CARGO_BIN_EXE_subagents")
    );
    let out = cli_command(&t, "script")
        .args(["-qec", &cmd, "/dev/null"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        text.matches("DONE after 2 steps").count(),
        1,
        "the streamed answer is not printed again: {text:?}"
    );
}
