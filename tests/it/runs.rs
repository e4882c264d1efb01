//! Runs end to end through the queue, the engine and the mock model over HTTP.

use std::sync::Arc;
use std::time::{Duration, Instant};

use subagents::app::StartRun;
use subagents::engine::LOOP_MESSAGE;
use subagents::model::Message;
use subagents::store::{CancelOutcome, ErrorKind, RunStatus};

use crate::support::*;

#[tokio::test]
async fn five_step_run_checkpoints_every_step() {
    let t = spawn_app().await;
    let r = t.run("Do the task.\nSCENARIO steps=5 tool=echo").await;
    assert_eq!(r.status, RunStatus::Succeeded, "{r:?}");
    assert_eq!(r.result.as_deref(), Some("DONE after 5 steps"));
    assert_eq!(r.step, 5);
    assert!(!r.forced);
    assert!(r.usage.total() > 0, "usage recorded");
    let msgs = t
        .app
        .store
        .thread_messages(&r.thread_id, 100_000)
        .await
        .unwrap();
    let roles: Vec<&str> = msgs.iter().map(|m| m.message.role()).collect();
    assert_eq!(
        roles,
        [
            "user",
            "assistant",
            "tool",
            "assistant",
            "tool",
            "assistant",
            "tool",
            "assistant",
            "tool",
            "assistant"
        ]
    );
    for (i, m) in msgs
        .iter()
        .filter(|m| m.message.role() == "tool")
        .enumerate()
    {
        assert_eq!(
            m.message,
            Message::Tool {
                tool_call_id: format!("call_{}_1", i + 1),
                content: format!("step {} call 1", i + 1)
            }
        );
    }
    // Each step's response was requested exactly once.
    let served = t.served();
    for step in 1..=5 {
        assert_eq!(
            served.get(&format!("{}:{step}", r.id)),
            Some(&1),
            "step {step}: {served:?}"
        );
    }
    let events = t.events(r.id).await;
    assert_gap_free(&events, RunStatus::Succeeded);
    let k = kinds(&events);
    assert_eq!(k.iter().filter(|k| **k == "step.completed").count(), 5);
    assert_eq!(k.iter().filter(|k| **k == "tool.started").count(), 4);
    assert_eq!(k.iter().filter(|k| **k == "tool.completed").count(), 4);
    assert_eq!(&k[..3], ["run.queued", "run.started", "step.started"]);
}

#[tokio::test]
async fn parallel_tool_calls_each_commit() {
    let t = spawn_app().await;
    let r = t.run("SCENARIO steps=3 parallel=3").await;
    assert_eq!(r.result.as_deref(), Some("DONE after 3 steps"));
    let msgs = t
        .app
        .store
        .thread_messages(&r.thread_id, 100_000)
        .await
        .unwrap();
    assert_eq!(
        msgs.iter().filter(|m| m.message.role() == "tool").count(),
        6
    );
    let events = t.events(r.id).await;
    assert_gap_free(&events, RunStatus::Succeeded);
    // step.completed comes once per step, after that step's last tool result.
    assert_eq!(
        kinds(&events)
            .iter()
            .filter(|k| **k == "step.completed")
            .count(),
        3
    );
}

#[tokio::test]
async fn max_steps_forces_a_final_answer_without_tools() {
    let t = spawn_app().await;
    let r = t
        .app
        .start_run(StartRun {
            input: "SCENARIO steps=10".into(),
            max_steps: Some(3),
            ..Default::default()
        })
        .await
        .unwrap();
    let r = t.wait(r.id).await;
    assert_eq!(r.status, RunStatus::Succeeded);
    assert!(r.forced, "{r:?}");
    assert_eq!(r.result.as_deref(), Some("FORCED after 3 tool results"));
    assert_eq!(r.step, 4, "3 tool steps + 1 forced answer");
    let log = t.mock.state.log();
    let last = log
        .iter()
        .rfind(|e| e.step_key.starts_with(&r.id.to_string()))
        .unwrap();
    assert!(!last.offered_tools, "the forced call offers no tools");
    assert!(
        log.iter()
            .filter(|e| e.step_key.starts_with(&r.id.to_string()))
            .take(3)
            .all(|e| e.offered_tools)
    );
}

#[tokio::test]
async fn token_budget_forces_a_final_answer() {
    let t = spawn_app().await;
    let r = t
        .app
        .start_run(StartRun {
            input: "SCENARIO steps=50".into(),
            max_total_tokens: Some(300),
            ..Default::default()
        })
        .await
        .unwrap();
    let r = t.wait(r.id).await;
    assert_eq!(r.status, RunStatus::Succeeded);
    assert!(r.forced);
    assert!(r.result.as_deref().unwrap().starts_with("FORCED"), "{r:?}");
    assert!(r.step < 50);
}

#[tokio::test]
async fn identical_calls_are_cut_at_the_third() {
    let dir = tempfile::tempdir().unwrap();
    let journal = dir.path().join("journal.tsv");
    let j = journal.clone();
    let t = spawn_app_with(Options {
        tweak: Box::new(move |s| s.tool_journal = Some(j)),
        ..Default::default()
    })
    .await;
    let r = t.run("SCENARIO loop=1").await;
    assert_eq!(r.status, RunStatus::Succeeded);
    assert_eq!(
        r.result.as_deref(),
        Some("stopped repeating after 3 tool results")
    );
    let msgs = t
        .app
        .store
        .thread_messages(&r.thread_id, 100_000)
        .await
        .unwrap();
    let tool_results: Vec<String> = msgs
        .iter()
        .filter_map(|m| match &m.message {
            Message::Tool { content, .. } => Some(content.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(tool_results, ["loop", "loop", LOOP_MESSAGE]);
    // Only two executions happened: the third call was refused, not run.
    let executed = std::fs::read_to_string(&journal).unwrap();
    assert_eq!(executed.lines().count(), 2, "{executed}");
}

#[tokio::test]
async fn transient_500s_are_retried_to_success() {
    let t = spawn_app().await;
    let r = t.run("SCENARIO steps=4 fail_every=2").await;
    assert_eq!(r.status, RunStatus::Succeeded, "{r:?}");
    assert_eq!(r.result.as_deref(), Some("DONE after 4 steps"));
    let log = t.mock.state.log();
    assert!(
        log.iter().any(|e| e.status == 500),
        "failures were injected"
    );
    // Retries repeat failed requests only: each step got exactly one successful answer.
    for (_, n) in t.served() {
        assert_eq!(n, 1);
    }
}

#[tokio::test]
async fn rate_limits_honour_retry_after() {
    let t = spawn_app().await;
    let started = Instant::now();
    let r = t
        .run("SCENARIO steps=2 fail_every=2 fail_status=429 retry_after=1")
        .await;
    assert_eq!(r.status, RunStatus::Succeeded, "{r:?}");
    // The second request got 429 with Retry-After: 1, so at least one second passed.
    assert!(started.elapsed() >= Duration::from_secs(1));
}

#[tokio::test]
async fn a_4xx_fails_the_run_with_kind_model() {
    let t = spawn_app().await;
    let r = t.run("SCENARIO steps=3 fail_every=1 fail_status=400").await;
    assert_eq!(r.status, RunStatus::Failed);
    let e = r.error.unwrap();
    assert_eq!(e.kind, ErrorKind::Model);
    assert!(e.message.contains("HTTP 400"), "{}", e.message);
    let log = t.mock.state.log();
    assert_eq!(log.len(), 1, "a permanent error is not retried: {log:?}");
    assert_gap_free(&t.events(r.id).await, RunStatus::Failed);
}

#[tokio::test]
async fn persistent_5xx_fails_after_retries() {
    let t = spawn_app_with(Options {
        tweak: Box::new(|s| s.model_retries = 2),
        ..Default::default()
    })
    .await;
    let r = t.run("SCENARIO steps=3 fail_every=1 fail_status=503").await;
    assert_eq!(r.status, RunStatus::Failed);
    let e = r.error.unwrap();
    assert_eq!(e.kind, ErrorKind::Model);
    assert!(e.message.contains("after 3 attempts"), "{}", e.message);
}

#[tokio::test]
async fn unreachable_model_fails_with_kind_model() {
    let t = spawn_app_with(Options {
        tweak: Box::new(|s| {
            s.openai_base_url = "http://127.0.0.1:9/v1".into();
            s.model_retries = 1;
        }),
        ..Default::default()
    })
    .await;
    // Rebuilt App uses the settings' client, which points at a closed port.
    let r = t.run("hello").await;
    assert_eq!(r.status, RunStatus::Failed);
    assert_eq!(r.error.unwrap().kind, ErrorKind::Model);
}

#[tokio::test]
async fn a_continued_thread_sees_the_first_runs_messages() {
    let t = spawn_app().await;
    let first = t.run("First task.\nSCENARIO steps=3").await;
    assert_eq!(first.status, RunStatus::Succeeded);
    let second = t
        .app
        .start_run(StartRun {
            input: "Second task.\nSCENARIO steps=2 run=b".into(),
            thread_id: Some(first.thread_id.clone()),
            ..Default::default()
        })
        .await
        .unwrap();
    let second = t.wait(second.id).await;
    assert_eq!(second.status, RunStatus::Succeeded);
    assert_eq!(second.thread_id, first.thread_id);
    assert_eq!(second.result.as_deref(), Some("DONE after 2 steps"));
    // The second run's first request carried system + the first run's 6 messages + its input.
    let log = t.mock.state.log();
    let req = log
        .iter()
        .find(|e| e.step_key == format!("{}:1", second.id))
        .unwrap();
    assert_eq!(req.messages, 1 + 6 + 1, "{req:?}");
    let msgs = t
        .app
        .store
        .thread_messages(&first.thread_id, 100_000)
        .await
        .unwrap();
    assert_eq!(msgs.len(), 6 + 4);
}

#[tokio::test]
async fn one_active_run_per_thread() {
    let t = spawn_app_with(Options {
        workers: false,
        ..Default::default()
    })
    .await;
    let first = t.start("SCENARIO steps=2").await;
    let err = t
        .app
        .start_run(StartRun {
            input: "again".into(),
            thread_id: Some(first.thread_id.clone()),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), "thread_busy");
    assert!(
        err.to_string().contains(&first.id.to_string()),
        "names the active run: {err}"
    );
}

#[tokio::test]
async fn bad_inputs_are_refused_with_stable_codes() {
    let t = spawn_app_with(Options {
        workers: false,
        tweak: Box::new(|s| s.max_input_bytes = 100),
        ..Default::default()
    })
    .await;
    let cases = [
        (
            StartRun {
                input: "   ".into(),
                ..Default::default()
            },
            "empty_input",
        ),
        (
            StartRun {
                input: "x".repeat(101),
                ..Default::default()
            },
            "input_too_large",
        ),
        (
            StartRun {
                input: "x".into(),
                agent: Some("nope".into()),
                ..Default::default()
            },
            "unknown_agent",
        ),
        (
            StartRun {
                input: "x".into(),
                max_steps: Some(0),
                ..Default::default()
            },
            "bad_limit",
        ),
    ];
    for (req, code) in cases {
        let e = t.app.start_run(req).await.unwrap_err();
        assert_eq!(e.code(), code, "{e}");
    }
    let e = t
        .app
        .start_run(StartRun {
            input: "x".into(),
            agent: Some("nope".into()),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(
        e.to_string().contains("general-purpose"),
        "lists known agents: {e}"
    );
}

#[tokio::test]
async fn a_long_tool_result_is_offloaded_to_the_workspace_not_cut() {
    let t = spawn_app_with(Options {
        tools: Some(tools_with(vec![Arc::new(Big(50_000))])),
        tweak: Box::new(|s| s.tool_result_tokens = 1000),
        ..Default::default()
    })
    .await;
    let r = t.run("SCENARIO steps=2 tool=big").await;
    assert_eq!(r.status, RunStatus::Succeeded);
    let msgs = t
        .app
        .store
        .thread_messages(&r.thread_id, 100_000)
        .await
        .unwrap();
    let Message::Tool {
        content,
        tool_call_id,
    } = &msgs[2].message
    else {
        panic!("{msgs:?}")
    };
    let path = format!(".results/{}/{}.txt", r.id, tool_call_id);
    assert!(content.starts_with("xxxx"), "{content}");
    assert!(
        content.contains(&"[result offloaded: it is 50000 bytes".to_string()),
        "{content}"
    );
    assert!(
        content.contains(&format!("read_file with path=`{path}` offset=")),
        "{content}"
    );
    assert!(
        content.len() < 8_000,
        "the model sees a head, not the result: {} bytes",
        content.len()
    );
    let saved = std::fs::read_to_string(
        subagents::tools::owner_workspace(&t.app.settings.workspace, &r.owner).join(&path),
    )
    .unwrap();
    assert_eq!(saved, "x".repeat(50_000), "the whole result is kept");
    let events = t.app.store.events_after(r.id, 0, 1000).await.unwrap();
    let done = events.iter().find(|e| e.kind == "tool.completed").unwrap();
    assert_eq!(done.data["offloaded"], true);
}

#[tokio::test]
async fn a_slow_tool_times_out_and_the_model_is_told() {
    let t = spawn_app_with(Options {
        tools: Some(tools_with(vec![Arc::new(Sleep(Duration::from_secs(30)))])),
        tweak: Box::new(|s| s.tool_timeout_secs = 0.3),
        ..Default::default()
    })
    .await;
    let r = t.run("SCENARIO steps=2 tool=sleep").await;
    assert_eq!(r.status, RunStatus::Succeeded);
    let msgs = t
        .app
        .store
        .thread_messages(&r.thread_id, 100_000)
        .await
        .unwrap();
    let Message::Tool { content, .. } = &msgs[2].message else {
        panic!()
    };
    assert!(content.starts_with("error[tool_timeout]"), "{content}");
}

#[tokio::test]
async fn the_wall_time_limit_fails_the_run_with_kind_timeout() {
    let t = spawn_app().await;
    let r = t
        .app
        .start_run(StartRun {
            input: "SCENARIO steps=5 latency_ms=800".into(),
            timeout_secs: Some(1),
            ..Default::default()
        })
        .await
        .unwrap();
    let r = t.wait(r.id).await;
    assert_eq!(r.status, RunStatus::Failed);
    assert_eq!(r.error.unwrap().kind, ErrorKind::Timeout);
    assert_gap_free(&t.events(r.id).await, RunStatus::Failed);
}

#[tokio::test]
async fn cancel_a_queued_run_at_once() {
    let t = spawn_app_with(Options {
        workers: false,
        ..Default::default()
    })
    .await;
    let r = t.start("SCENARIO steps=3").await;
    assert_eq!(
        t.app.store.request_cancel(r.id).await.unwrap(),
        CancelOutcome::Cancelled
    );
    let r2 = t.app.store.get_run(r.id).await.unwrap().unwrap();
    assert_eq!(r2.status, RunStatus::Cancelled);
    assert_eq!(
        t.app.store.request_cancel(r.id).await.unwrap(),
        CancelOutcome::AlreadyFinished(RunStatus::Cancelled)
    );
    assert_gap_free(&t.events(r.id).await, RunStatus::Cancelled);
}

#[tokio::test]
async fn cancel_a_running_run_mid_tool() {
    let t = spawn_app_with(Options {
        tools: Some(tools_with(vec![Arc::new(Sleep(Duration::from_secs(30)))])),
        ..Default::default()
    })
    .await;
    let r = t.start("SCENARIO steps=3 tool=sleep").await;
    // Wait until the tool is running.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !kinds(&t.events(r.id).await).contains(&"tool.started") {
        assert!(Instant::now() < deadline, "tool never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let asked = Instant::now();
    assert_eq!(
        t.app.store.request_cancel(r.id).await.unwrap(),
        CancelOutcome::Requested
    );
    let done = t.wait(r.id).await;
    assert_eq!(done.status, RunStatus::Cancelled);
    // The tool sleeps 30 s: a run that ended well before that had its tool cut short, not
    // waited for (15 s is a margin a loaded machine keeps).
    let took = asked.elapsed();
    assert!(
        took < Duration::from_secs(15),
        "the cancel waited for the tool ({took:?})"
    );
    let events = t.events(r.id).await;
    assert!(
        !kinds(&events).contains(&"tool.completed"),
        "the cut tool has no result: {:?}",
        kinds(&events)
    );
    assert_gap_free(&events, RunStatus::Cancelled);
    assert_eq!(
        t.app.store.request_cancel(r.id).await.unwrap(),
        CancelOutcome::AlreadyFinished(RunStatus::Cancelled)
    );
}

/// A run held by a worker in another process is cancelled through the database: that worker
/// sees the request at its next lease renewal (no Redis here), drops the model call it is in,
/// and stays up to run the next run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_run_held_by_another_worker_process() {
    let t = spawn_app_with(Options {
        workers: false,
        ..Default::default()
    })
    .await;
    let mut worker = spawn_worker(t.dir.path(), &t.mock, &[]);
    let r = t.start("SCENARIO steps=3 latency_ms=30000 run=held").await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let run = t.app.store.get_run(r.id).await.unwrap().unwrap();
        if run.status == RunStatus::Running {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the worker never claimed the run"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let asked = Instant::now();
    assert_eq!(
        t.app.store.request_cancel(r.id).await.unwrap(),
        CancelOutcome::Requested
    );
    let done = t.wait(r.id).await;
    assert_eq!(done.status, RunStatus::Cancelled, "{done:?}");
    // The model call takes 30 s: ending well before that means the other process cut it.
    let took = asked.elapsed();
    assert!(
        took < Duration::from_secs(15),
        "the other process finished the call first ({took:?})"
    );
    assert_gap_free(&t.events(r.id).await, RunStatus::Cancelled);
    assert!(
        worker.try_wait().unwrap().is_none(),
        "the worker process is still up"
    );
    let next = t.start("SCENARIO steps=2 run=after-cancel").await;
    assert_eq!(t.wait(next.id).await.status, RunStatus::Succeeded);
    worker.kill().unwrap();
    worker.wait().unwrap();
}

/// A run parked on a model's rate limit holds no worker, so a cancel ends it at once, before
/// the limit frees up and without a model call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_parked_on_a_rate_limit_is_cancelled_at_once() {
    let t = spawn_app_with(Options {
        tweak: Box::new(|s| {
            s.model_limits = "mock-model:rpm=1".into();
            s.rate_window_ms = 600_000;
        }),
        ..Default::default()
    })
    .await;
    // The first run takes the window's one call.
    let first = t.start("SCENARIO steps=1 run=first").await;
    assert_eq!(t.wait(first.id).await.status, RunStatus::Succeeded);
    let r = t.start("SCENARIO steps=2 run=limited").await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let waiting = t
            .events(r.id)
            .await
            .iter()
            .any(|e| e.kind == "run.waiting" && e.data["waiting_on"] == "rate_limit");
        if waiting {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the run never parked on the limit"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        t.app.store.get_run(r.id).await.unwrap().unwrap().status,
        RunStatus::Waiting
    );
    let calls = t.mock.state.log().len();
    assert_eq!(
        t.app.store.request_cancel(r.id).await.unwrap(),
        CancelOutcome::Cancelled,
        "a parked run ends at once"
    );
    let done = t.wait(r.id).await;
    assert_eq!(done.status, RunStatus::Cancelled);
    assert_eq!(t.mock.state.log().len(), calls, "no model call for it");
    assert_gap_free(&t.events(r.id).await, RunStatus::Cancelled);
}

#[tokio::test]
async fn a_run_enqueued_without_workers_runs_when_a_worker_starts() {
    let t = spawn_app_with(Options {
        workers: false,
        ..Default::default()
    })
    .await;
    let r = t.start("SCENARIO steps=2").await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        t.app.store.get_run(r.id).await.unwrap().unwrap().status,
        RunStatus::Queued
    );
    let stop = tokio_util::sync::CancellationToken::new();
    let w = t.app.spawn_workers(stop.clone());
    let done = t.wait(r.id).await;
    assert_eq!(done.status, RunStatus::Succeeded);
    stop.cancel();
    w.await.unwrap();
}

#[tokio::test]
async fn graceful_shutdown_releases_the_run_and_another_worker_resumes_it() {
    // A long lease: on a loaded machine a 1.5 s lease can expire mid-step, and this test is about
    // the drain, not about expiry (tested elsewhere).
    let mut t = spawn_app_with(Options {
        latency: Duration::from_millis(150),
        tweak: Box::new(|s| s.lease_ttl_secs = 10.0),
        ..Default::default()
    })
    .await;
    let r = t.start("SCENARIO steps=8").await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while t.app.store.get_run(r.id).await.unwrap().unwrap().step < 2 {
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    t.stop_workers().await;
    let mid = t.app.store.get_run(r.id).await.unwrap().unwrap();
    assert_eq!(
        mid.status,
        RunStatus::Queued,
        "released to the queue, not finished"
    );
    assert_eq!(mid.crashes, 0, "a release is not a crash");
    let stop = tokio_util::sync::CancellationToken::new();
    let w = t.app.spawn_workers(stop.clone());
    let done = t.wait(r.id).await;
    assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
    assert_eq!(done.result.as_deref(), Some("DONE after 8 steps"));
    assert_eq!(done.attempts, 2);
    // The drain let the step in flight finish: no step was asked for twice.
    for (k, n) in t.served() {
        assert_eq!(n, 1, "step {k} served {n} times");
    }
    stop.cancel();
    w.await.unwrap();
}

/// Priorities order an owner's queued runs: a priority-5 run enqueued behind five of priority
/// 3 is next (its queue position says so) and is claimed first; out-of-range priorities are
/// refused.
#[tokio::test]
async fn a_higher_priority_run_goes_first_within_its_owner() {
    let t = spawn_app_with(Options {
        workers: false,
        tweak: Box::new(|s| s.concurrency = 1),
        ..Default::default()
    })
    .await;
    let start = |input: String, priority: Option<u8>| subagents::app::StartRun {
        input,
        priority,
        ..Default::default()
    };
    let mut normal = vec![];
    for i in 0..5 {
        normal.push(
            t.app
                .start_run(start(format!("SCENARIO steps=1 run=n{i}"), None))
                .await
                .unwrap(),
        );
    }
    let urgent = t
        .app
        .start_run(start("SCENARIO steps=1 run=urgent".into(), Some(5)))
        .await
        .unwrap();
    assert_eq!(urgent.priority, 5);
    assert_eq!(
        t.app.store.queue_position(urgent.id).await.unwrap(),
        0,
        "the urgent run is next"
    );
    assert_eq!(t.app.store.queue_position(normal[0].id).await.unwrap(), 1);
    assert_eq!(t.app.store.queue_position(normal[4].id).await.unwrap(), 5);
    for bad in [0u8, 6] {
        let e = t
            .app
            .start_run(start("x".into(), Some(bad)))
            .await
            .unwrap_err();
        assert_eq!(e.code(), "bad_limit", "{e}");
    }
    let stop = tokio_util::sync::CancellationToken::new();
    let w = t.app.spawn_workers(stop.clone());
    let urgent = t.wait(urgent.id).await;
    let first = t.wait(normal[0].id).await;
    assert!(
        urgent.started_at.unwrap() <= first.started_at.unwrap(),
        "urgent {:?} vs first normal {:?}",
        urgent.started_at,
        first.started_at
    );
    for r in &normal {
        assert_eq!(t.wait(r.id).await.status, RunStatus::Succeeded);
    }
    stop.cancel();
    w.await.unwrap();
}

/// A wait for a run's end reads the run when something may have ended it, not at every step:
/// a short run commits a few checkpoints per step, and each used to have every waiter read the
/// run again (on SQLite, a third of a short run's statements).
#[tokio::test]
async fn a_wait_reads_the_run_at_its_end_not_at_each_step() {
    let t = spawn_app().await;
    let run = t.start("SCENARIO steps=20 tool=echo").await;
    let reads = subagents::notify::SharedReads::default();
    let count = std::sync::atomic::AtomicUsize::new(0);
    let t0 = std::time::Instant::now();
    let (r, _) = t
        .app
        .wait_with(
            run.id,
            Duration::from_secs(60),
            &reads,
            || async {
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                t.app.store.get_run(run.id).await
            },
            None,
            |r| r.as_ref().is_none_or(|r| r.status.is_terminal()),
        )
        .await
        .unwrap();
    let elapsed = t0.elapsed();
    let r = r.unwrap();
    assert_eq!(r.status, RunStatus::Succeeded);
    assert_eq!(r.step, 20);
    // The first read, the claim, the end, and the timed re-checks for other processes' writers
    // (every 250 ms: as many as the run took). Forty progress commits would be forty reads.
    let rechecks = (elapsed.as_millis() / 250) as usize + 1;
    let n = count.load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        n <= 3 + rechecks,
        "{n} reads for a 20-step run that took {elapsed:?}"
    );
}

/// A wait told the run was just created skips the read that would find it queued, but not one
/// that something decisive has happened since: a run that ended before its waiter began is
/// answered at once, not at the timeout.
#[tokio::test]
async fn a_wait_for_a_run_just_created_still_sees_an_end_that_came_first() {
    let t = spawn_app().await;
    let id = subagents::ids::RunId::default();
    let signal = t.app.store.subscribe(id);
    let before = signal.decisive();
    t.app
        .start_run(StartRun {
            input: "Quick.".into(),
            run_id: Some(id),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(t.wait(id).await.status, RunStatus::Succeeded);
    let reads = subagents::notify::SharedReads::default();
    let t0 = Instant::now();
    let (r, _) = t
        .app
        .wait_with(
            id,
            Duration::from_secs(30),
            &reads,
            || t.app.store.get_run(id),
            Some(before),
            |r| r.as_ref().is_none_or(|r| r.status.is_terminal()),
        )
        .await
        .unwrap();
    assert_eq!(r.unwrap().status, RunStatus::Succeeded);
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    drop(signal);
}

/// A run started in a process whose worker has a free slot is handed to that worker as it is
/// written ([`subagents::worker::Local`]): its job is locked to the worker and acked by it, as
/// apalis's fetch and ack would. The runs handed over this way and the runs the worker fetches
/// share the process's concurrency: never more run at once than configured.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_started_beside_a_free_worker_is_handed_to_it_within_the_concurrency() {
    let t = spawn_app_with(Options {
        latency: Duration::from_millis(60),
        tweak: Box::new(|s| s.concurrency = 1),
        ..Default::default()
    })
    .await;
    let start = |steps: u32| StartRun {
        input: format!("SCENARIO steps={steps}"),
        ..Default::default()
    };
    // Once the worker is registered and its slot is free, a start is handed to it. (Until
    // then, starts go through the queue as ever.)
    let deadline = Instant::now() + Duration::from_secs(30);
    let held = loop {
        let c = t.app.start(start(6)).await.unwrap();
        if c.held {
            break c;
        }
        t.wait(c.run.id).await;
        assert!(
            Instant::now() < deadline,
            "no start was handed to the idle worker"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // Two more while it runs: the slot is taken, so they wait on the queue for it.
    let queued = [
        t.app.start(start(2)).await.unwrap(),
        t.app.start(start(2)).await.unwrap(),
    ];
    assert!(
        queued.iter().all(|c| !c.held),
        "no slot free: not handed over"
    );
    let all = [held.run.id, queued[0].run.id, queued[1].run.id];
    let running = subagents::store::RunFilter {
        status: vec![RunStatus::Running],
        ..Default::default()
    };
    let mut most = 0;
    loop {
        // One read: the runs running at one instant.
        let now = t
            .app
            .store
            .list_runs(&subagents::ids::OwnerId::local(), &running, 100)
            .await
            .unwrap();
        most = most.max(now.len());
        let mut done = 0;
        for id in all {
            if t.app
                .store
                .get_run(id)
                .await
                .unwrap()
                .unwrap()
                .status
                .is_terminal()
            {
                done += 1;
            }
        }
        if done == all.len() {
            break;
        }
        assert!(
            Instant::now() < deadline + Duration::from_secs(30),
            "runs did not finish"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(
        most, 1,
        "concurrency 1: one run at a time, however it reached the worker"
    );
    for id in all {
        assert_eq!(t.wait(id).await.status, RunStatus::Succeeded);
    }
    // The handed-over job is acked by the worker it was locked to, as apalis acks a job.
    let db = sqlx::SqlitePool::connect(&t.app.settings.database_url)
        .await
        .unwrap();
    let worker_prefix = format!("subagents-{}-", std::process::id());
    loop {
        let (status, attempts, lock_by): (String, i64, Option<String>) =
            sqlx::query_as("SELECT status, attempts, lock_by FROM Jobs WHERE id = ?")
                .bind(&held.run.job_id)
                .fetch_one(&db)
                .await
                .unwrap();
        assert!(
            lock_by
                .as_deref()
                .is_some_and(|w| w.starts_with(&worker_prefix)),
            "locked to this process's worker: {lock_by:?}"
        );
        if status == "Done" {
            assert_eq!(attempts, 1);
            break;
        }
        assert_eq!(status, "Queued", "held, never Pending for another worker");
        assert!(
            Instant::now() < deadline + Duration::from_secs(40),
            "the held job was never acked"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
