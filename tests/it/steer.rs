//! Steering: messages sent to a run while it is queued, running or parked on children reach
//! its next model call exactly once, across a worker killed on either side of the delivery.

use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde_json::json;
use subagents::ids::RunId;
use subagents::model::mock::{LogEntry, Script};
use subagents::store::{EventRecord, RunRecord, RunStatus, Sent};
use tokio_util::sync::CancellationToken;

use crate::api::{KEYS, code, setup};
use crate::delegation::{call, calls, parent_job, say, start_parent};
use crate::support::*;

/// Polls `what` until it holds (at most 30 s: the margin of a loaded 2-core machine).
async fn until<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let t0 = Instant::now();
    while !check().await {
        assert!(t0.elapsed() < Duration::from_secs(30), "{what} within 30 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until the run's first step has started (its model call is in flight).
async fn first_step_started(t: &TestApp, run: &RunRecord) {
    until("the first step starts", || async {
        t.events(run.id)
            .await
            .iter()
            .any(|e| e.kind == "step.started")
    })
    .await;
}

async fn send(t: &TestApp, run: &RunRecord, text: &str) {
    let (_, sent) = t.app.send_message(run.id, &run.owner, text).await.unwrap();
    assert!(matches!(sent, Sent::Accepted { .. }), "{sent:?}");
}

/// The answered requests whose user messages include `marker`'s message.
fn carrying<'a>(log: &'a [LogEntry], marker: &str) -> Vec<&'a LogEntry> {
    log.iter()
        .filter(|e| e.status == 200 && e.user_texts.iter().any(|u| u.contains(marker)))
        .collect()
}

/// Every request that carries the message carries it once, and at least one does.
fn delivered_once_per_request(t: &TestApp, marker: &str) -> usize {
    let log = t.mock.state.log();
    let with = carrying(&log, marker);
    assert!(!with.is_empty(), "a model request carried the message");
    for e in &with {
        let n = e.user_texts.iter().filter(|u| u.contains(marker)).count();
        assert_eq!(n, 1, "the message once per request: {:?}", e.user_texts);
    }
    with.len()
}

fn position(events: &[EventRecord], kind: &str) -> usize {
    events
        .iter()
        .position(|e| e.kind == kind)
        .unwrap_or_else(|| panic!("no {kind} in {:?}", kinds(events)))
}

async fn in_thread(t: &TestApp, run: &RunRecord, marker: &str) -> usize {
    t.app
        .store
        .thread_messages(&run.thread_id, 10_000)
        .await
        .unwrap()
        .iter()
        .filter(|m| {
            matches!(&m.message, subagents::model::Message::User { content } if content.contains(marker))
        })
        .count()
}

#[tokio::test]
async fn a_message_sent_while_running_reaches_the_next_model_call_once() {
    let t = spawn_app().await;
    let run = t
        .start("SCENARIO steps=3 latency_ms=600 run=steer-running")
        .await;
    first_step_started(&t, &run).await;
    send(&t, &run, "STEER-RUNNING also count the files").await;
    let done = t.wait(run.id).await;
    assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
    let events = t.events(run.id).await;
    assert_gap_free(&events, RunStatus::Succeeded);
    assert!(position(&events, "message.received") < position(&events, "message.delivered"));
    let delivered: Vec<&EventRecord> = events
        .iter()
        .filter(|e| e.kind == "message.delivered")
        .collect();
    assert_eq!(delivered.len(), 1, "{:?}", kinds(&events));
    assert_eq!(in_thread(&t, &run, "STEER-RUNNING").await, 1);
    delivered_once_per_request(&t, "STEER-RUNNING");
    // The step it was delivered in is the first whose request carried it.
    let step = delivered[0].data["step"].as_u64().unwrap();
    let started = events
        .iter()
        .position(|e| e.kind == "step.started" && e.data["step"] == json!(step))
        .unwrap();
    let first_call_after = events[started..]
        .iter()
        .position(|e| e.kind == "model.completed")
        .unwrap();
    assert!(position(&events, "message.delivered") < started + first_call_after);
}

/// The message arrives while the model writes what would be its final answer: the answer
/// becomes an ordinary turn and the model is asked again, with the message.
#[tokio::test]
async fn a_message_that_meets_the_final_answer_is_answered_before_the_run_ends() {
    let t = spawn_app().await;
    let run = t
        .start("SCENARIO steps=1 latency_ms=1500 run=steer-final")
        .await;
    first_step_started(&t, &run).await;
    send(&t, &run, "STEER-FINAL and say it in French").await;
    let done = t.wait(run.id).await;
    assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
    assert_eq!(
        done.step, 2,
        "the answer that met the message was not the last"
    );
    let events = t.events(run.id).await;
    assert_gap_free(&events, RunStatus::Succeeded);
    let models = events
        .iter()
        .filter(|e| e.kind == "model.completed")
        .count();
    assert_eq!(models, 2, "{:?}", kinds(&events));
    assert_eq!(
        events
            .iter()
            .find(|e| e.kind == "message.delivered")
            .unwrap()
            .data["step"],
        json!(2)
    );
    assert_eq!(delivered_once_per_request(&t, "STEER-FINAL"), 1);
}

/// A parent parked on its child wakes for the message: its wait is answered with where the
/// child stands, the model hears the message long before the child ends, and the child is
/// neither started again nor stopped.
#[tokio::test]
async fn a_parent_parked_on_a_child_hears_a_message_without_waiting_for_it() {
    let t = spawn_app_with(Options {
        jobs: vec![parent_job("p-steer")],
        ..Default::default()
    })
    .await;
    t.mock.state.set_script(Script::from([(
        "p-steer".to_owned(),
        vec![
            calls(vec![call(
                "task",
                json!({"description": "Slow child.\nSCENARIO steps=2 latency_ms=2500 run=steer-kid", "subagent": "general-purpose"}),
            )]),
            say("parent done"),
        ],
    )]));
    let parent = start_parent(&t, "p-steer").await;
    until("the parent parks on its child", || async {
        t.app
            .store
            .get_run(parent.id)
            .await
            .unwrap()
            .unwrap()
            .status
            == RunStatus::Waiting
    })
    .await;
    send(&t, &parent, "STEER-PARKED the deadline moved").await;
    let done = t.wait(parent.id).await;
    assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
    assert_eq!(done.result.as_deref(), Some("parent done"));
    let events = t.events(parent.id).await;
    assert_gap_free(&events, RunStatus::Succeeded);
    assert!(
        position(&events, "message.delivered") < position(&events, "child.finished"),
        "the message reached the model before the child ended: {:?}",
        kinds(&events)
    );
    let texts = tool_texts(&t, &done).await;
    assert!(
        texts.iter().any(|x| x.contains("still_running")),
        "the wait was answered with where the child stands: {texts:?}"
    );
    let children = t.app.store.children(parent.id).await.unwrap();
    assert_eq!(children.len(), 1, "the child was not started twice");
    assert_eq!(children[0].status, RunStatus::Succeeded);
    assert_eq!(in_thread(&t, &done, "STEER-PARKED").await, 1);
    delivered_once_per_request(&t, "STEER-PARKED");
}

/// A message for a queued run follows its input in the first request.
#[tokio::test]
async fn a_message_for_a_queued_run_follows_its_input() {
    let t = spawn_app_with(Options {
        workers: false,
        ..Default::default()
    })
    .await;
    let run = t.start("SCENARIO steps=2 run=steer-queued").await;
    send(&t, &run, "STEER-QUEUED keep it short").await;
    let stop = CancellationToken::new();
    let workers = t.app.spawn_workers(stop.clone());
    let done = t.wait(run.id).await;
    stop.cancel();
    workers.await.unwrap();
    assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
    let log = t.mock.state.log();
    let first = log
        .iter()
        .find(|e| e.scenario.contains("run=steer-queued"))
        .unwrap();
    assert_eq!(first.user_texts.len(), 2, "{:?}", first.user_texts);
    assert!(first.user_texts[0].contains("SCENARIO"));
    assert!(first.user_texts[1].contains("STEER-QUEUED"));
    let events = t.events(run.id).await;
    assert!(position(&events, "message.received") < position(&events, "run.started"));
    assert_eq!(
        events
            .iter()
            .find(|e| e.kind == "message.delivered")
            .unwrap()
            .data["step"],
        json!(1)
    );
    delivered_once_per_request(&t, "STEER-QUEUED");
}

/// A worker killed after the message committed and before its delivery, then another killed
/// right after the delivery: it is delivered once, and every request carries it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_around_the_delivery_delivers_the_message_once() {
    let t = spawn_app_with(Options {
        workers: false,
        ..Default::default()
    })
    .await;
    let run = t.start("SCENARIO steps=2 run=steer-kill").await;
    send(&t, &run, "STEER-KILL check twice").await;
    for point in ["before_message_delivery", "after_message_delivery"] {
        let mut doomed = spawn_worker(
            t.dir.path(),
            &t.mock,
            &[("SUBAGENTS_FAILPOINTS", format!("{point}=crash"))],
        );
        let status = tokio::task::spawn_blocking(move || doomed.wait().unwrap())
            .await
            .unwrap();
        assert!(!status.success(), "the worker died at {point}");
    }
    let delivered = |events: &[EventRecord]| {
        events
            .iter()
            .filter(|e| e.kind == "message.delivered")
            .count()
    };
    assert_eq!(delivered(&t.events(run.id).await), 1);
    let stop = CancellationToken::new();
    let workers = t.app.spawn_workers(stop.clone());
    let done = t.wait(run.id).await;
    stop.cancel();
    workers.await.unwrap();
    assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
    assert_eq!(done.crashes, 2, "{done:?}");
    let events = t.events(run.id).await;
    assert_gap_free(&events, RunStatus::Succeeded);
    assert_eq!(delivered(&events), 1, "{:?}", kinds(&events));
    assert_eq!(in_thread(&t, &done, "STEER-KILL").await, 1);
    delivered_once_per_request(&t, "STEER-KILL");
}

/// The endpoint's answers: 202 with the message id, and each refusal with its code.
#[tokio::test]
async fn the_messages_endpoint_refuses_what_it_cannot_deliver() {
    let (t, alice) = setup(KEYS, 0).await;
    let path = |id: RunId| format!("/v1/runs/{id}/messages");
    let (s, v) = alice
        .call(
            Method::POST,
            "/v1/runs",
            Some(json!({"input": "SCENARIO steps=3 latency_ms=1500 run=steer-api"})),
        )
        .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    let id: RunId = v["id"].as_str().unwrap().parse().unwrap();
    let (s, v) = alice
        .call(
            Method::POST,
            &path(id),
            Some(json!({"content": "STEER-API go on"})),
        )
        .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    assert_eq!(v["status"], "pending");
    assert_eq!(v["run_id"], json!(id));
    let message_id = v["message_id"].as_str().unwrap().to_owned();
    assert!(message_id.starts_with("msg_"), "{message_id}");
    // `subagents say` is the same call from the command line.
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_subagents"))
        .args(["say", &id.to_string(), "STEER-CLI", "from", "the", "shell"])
        .env("SUBAGENTS_URL", &alice.base)
        .env("SUBAGENTS_KEY", "alice-secret-key")
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let cli_message = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    assert!(cli_message.starts_with("msg_"), "{cli_message}");
    let bob = alice.as_(Some("bob-secret-key"));
    let (s, v) = bob
        .call(Method::POST, &path(id), Some(json!({"content": "psst"})))
        .await;
    assert_eq!((s, code(&v)), (StatusCode::NOT_FOUND, "not_found"), "{v}");
    for (body, status, want) in [
        (
            json!({"content": "  "}),
            StatusCode::BAD_REQUEST,
            "empty_input",
        ),
        (
            json!({"content": "a\u{0}b"}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "nul_character",
        ),
        (
            json!({"text": "x"}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        ),
        (
            json!({"content": "x".repeat(t.app.settings.max_input_bytes + 1)}),
            StatusCode::PAYLOAD_TOO_LARGE,
            "input_too_large",
        ),
    ] {
        let (s, v) = alice.call(Method::POST, &path(id), Some(body)).await;
        assert_eq!((s, code(&v)), (status, want), "{v}");
    }
    let (s, v) = alice
        .call(
            Method::POST,
            &path(RunId::new()),
            Some(json!({"content": "x"})),
        )
        .await;
    assert_eq!((s, code(&v)), (StatusCode::NOT_FOUND, "not_found"), "{v}");
    let done = t.wait(id).await;
    assert_eq!(done.status, RunStatus::Succeeded);
    let events = t.events(id).await;
    assert_eq!(
        events
            .iter()
            .find(|e| e.kind == "message.delivered")
            .unwrap()
            .data["message_id"],
        json!(message_id)
    );
    let (s, v) = alice
        .call(
            Method::POST,
            &path(id),
            Some(json!({"content": "too late"})),
        )
        .await;
    assert_eq!(
        (s, code(&v)),
        (StatusCode::CONFLICT, "already_finished"),
        "{v}"
    );
    assert_eq!(v["error"]["status"], "succeeded");
    assert!(v["error"]["thread_id"].is_string(), "{v}");
}

/// `if_busy: steer` sends the input into the thread's active run; `interrupt` cancels that run
/// at its next step boundary (the model call in flight is answered and committed, its work
/// stays on the thread) and starts the new one when it has ended.
#[tokio::test]
async fn a_start_on_a_busy_thread_steers_or_interrupts_its_active_run() {
    let (t, alice) = setup(KEYS, 0).await;
    let start = |input: &str, if_busy: &str| json!({"input": input, "thread_id": "busy-thread", "if_busy": if_busy});
    let (s, v) = alice
        .call(
            Method::POST,
            "/v1/runs",
            Some(start(
                "SCENARIO steps=3 latency_ms=1500 run=busy-a",
                "reject",
            )),
        )
        .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    let a: RunId = v["id"].as_str().unwrap().parse().unwrap();
    let (s, v) = alice
        .call(
            Method::POST,
            "/v1/runs",
            Some(start("STEER-BUSY look here too", "steer")),
        )
        .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    assert_eq!(v["id"], json!(a), "steer answers with the active run: {v}");
    let message_id = v["steered"]["message_id"].clone();
    assert!(message_id.as_str().unwrap().starts_with("msg_"), "{v}");
    until("the message reaches the active run's model", || async {
        t.events(a)
            .await
            .iter()
            .any(|e| e.kind == "message.delivered" && e.data["message_id"] == message_id)
    })
    .await;
    // Interrupt while a model call is in flight: it is answered and committed first.
    until("a model call of the active run is in flight", || async {
        t.events(a)
            .await
            .last()
            .is_some_and(|e| e.kind == "step.started")
    })
    .await;
    let before = t.events(a).await.last().unwrap().seq;
    let (s, v) = alice
        .call(
            Method::POST,
            "/v1/runs",
            Some(start("SCENARIO steps=1 run=busy-b", "interrupt")),
        )
        .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    let b: RunId = v["id"].as_str().unwrap().parse().unwrap();
    assert_ne!(a, b);
    let a_done = t.wait(a).await;
    assert_eq!(a_done.status, RunStatus::Cancelled, "{a_done:?}");
    let b_done = t.wait(b).await;
    assert_eq!(b_done.status, RunStatus::Succeeded, "{b_done:?}");
    assert_eq!(b_done.thread_id, a_done.thread_id);
    let a_events = t.events(a).await;
    assert_gap_free(&a_events, RunStatus::Cancelled);
    assert!(
        a_events
            .iter()
            .any(|e| e.kind == "model.completed" && e.seq > before),
        "the step in flight finished before the interrupt took effect: {:?}",
        kinds(&a_events)
    );
    let b_events = t.events(b).await;
    assert!(
        a_events.last().unwrap().created_at
            <= b_events[position(&b_events, "run.started")].created_at,
        "the new run started after the interrupted one ended"
    );
    // The interrupted run's committed work is on the thread the new run sees.
    let log = t.mock.state.log();
    let first_b = log
        .iter()
        .find(|e| e.scenario.contains("run=busy-b"))
        .unwrap();
    assert!(
        first_b.user_texts.iter().any(|u| u.contains("run=busy-a")),
        "{:?}",
        first_b.user_texts
    );
    assert!(
        first_b.user_texts.iter().any(|u| u.contains("STEER-BUSY")),
        "{:?}",
        first_b.user_texts
    );
}
