//! The run state machine end to end: each hole the explicit state machine closed, made to
//! happen every time with named failure points (`SUBAGENTS_FAILPOINTS`) and, where a hole used
//! to be papered over by the reaper, with the reaper turned off (`reap_ms`), so only the
//! designed path can finish the run.

use std::time::{Duration, Instant};

use serde_json::json;
use subagents::app::StartRun;
use subagents::model::mock::Script;
use subagents::store::{CancelOutcome, Claim, IfBusy, RunStatus};

use crate::delegation::{call, calls, parent_job, say, start_parent, tool_results};
use crate::support::*;

/// No reaper: a run that is not woken by the designed path stays stuck.
const NO_REAPER_MS: u64 = 3_600_000;

async fn scripted(
    agents: Vec<(&str, Vec<subagents::model::mock::Turn>)>,
    tweak: impl FnOnce(&mut subagents::config::Settings) + 'static,
) -> TestApp {
    let jobs = agents.iter().map(|(name, _)| parent_job(name)).collect();
    let t = spawn_app_with(Options {
        jobs,
        tweak: Box::new(tweak),
        ..Default::default()
    })
    .await;
    t.mock.state.set_script(Script::from_iter(
        agents.into_iter().map(|(n, turns)| (n.to_owned(), turns)),
    ));
    t
}

async fn wait_for(
    t: &TestApp,
    run: subagents::ids::RunId,
    within: Duration,
) -> subagents::store::RunRecord {
    let r = t.app.wait(run, within).await.unwrap().unwrap();
    assert!(
        r.status.is_terminal(),
        "run {run} is stuck in {:?} after {within:?}: {r:?}",
        r.status
    );
    r
}

/// An app whose runs only worker processes execute, with `agent`'s scripted turns.
async fn without_workers(agent: &str, turns: Vec<subagents::model::mock::Turn>) -> TestApp {
    let t = spawn_app_with(Options {
        workers: false,
        jobs: vec![parent_job(agent)],
        ..Default::default()
    })
    .await;
    t.mock
        .state
        .set_script(Script::from([(agent.to_owned(), turns)]));
    t
}

/// A worker process with the failure points `points`, run until it has crashed at one.
async fn crash_a_worker(t: &TestApp, points: &str) {
    let mut doomed = spawn_worker(
        t.dir.path(),
        &t.mock,
        &[("SUBAGENTS_FAILPOINTS", points.to_owned())],
    );
    let status = tokio::task::spawn_blocking(move || doomed.wait().unwrap())
        .await
        .unwrap();
    assert!(!status.success(), "the worker crashed at the failure point");
}

/// `run` finished by a healthy worker process (its reaper finds what a crashed one left).
async fn finish_on_a_healthy_worker(
    t: &TestApp,
    run: subagents::ids::RunId,
    within: Duration,
) -> subagents::store::RunRecord {
    let mut healthy = spawn_worker(t.dir.path(), &t.mock, &[]);
    let done = t.app.wait(run, within).await.unwrap().unwrap();
    healthy.kill().unwrap();
    healthy.wait().unwrap();
    done
}

/// Hole 2: a child that ends while its parent is committing its park (when nobody can wake
/// the parent yet) is seen by the park itself; the heartbeat cannot abort anything after it.
#[tokio::test]
async fn a_child_ending_while_its_parent_parks_still_wakes_it() {
    // The parent is held just before its park commit until the test has seen the child end.
    let gate = tempfile::tempdir().unwrap();
    let go = gate.path().join("go");
    let points = format!(
        "before_park_commit=wait({}),after_park_commit=sleep(1200)",
        go.display()
    );
    let t = scripted(
        vec![("p-race", vec![calls(vec![call("task", json!({"description": "Quick.\nSCENARIO steps=1 run=race", "subagent": "general-purpose"}))]), say("parent done")])],
        move |s| {
            s.reap_ms = NO_REAPER_MS;
            s.failpoints = points;
        },
    )
    .await;
    let parent = start_parent(&t, "p-race").await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let child = loop {
        if let Some(c) = t
            .app
            .store
            .children(parent.id)
            .await
            .unwrap()
            .into_iter()
            .find(|c| c.status.is_terminal())
        {
            break c;
        }
        assert!(Instant::now() < deadline, "the child never ended");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(child.status, RunStatus::Succeeded);
    assert_eq!(
        t.app
            .store
            .get_run(parent.id)
            .await
            .unwrap()
            .unwrap()
            .status,
        RunStatus::Running,
        "the parent has not parked yet"
    );
    std::fs::write(&go, "").unwrap();
    let done = wait_for(&t, parent.id, Duration::from_secs(20)).await;
    assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
    assert_eq!(done.result.as_deref(), Some("parent done"));
    let events = t.events(parent.id).await;
    assert_gap_free(&events, RunStatus::Succeeded);
    let waiting = events.iter().find(|e| e.kind == "run.waiting").unwrap();
    let finished = events.iter().find(|e| e.kind == "child.finished").unwrap();
    assert!(
        finished.seq < waiting.seq,
        "the child ended before the park committed"
    );
}

/// Hole 3: a run may await a child started by an earlier run of its thread; the child's end
/// wakes the run that waits on it (not the finished run that started it), once.
///
/// The earlier run's worker is held after its terminal commit until the later run is queued
/// (its job pending, both slots busy): the earlier run's end then finds the later run queued
/// and must not give it a second job, whose claim would find it parked and replay it for
/// nothing (seen under load as a third attempt; the store suite pins the pending case). Under
/// load the run's job may instead sit fetched in a worker's buffer (`Queued`) at that end,
/// fetched in one batch with the child's: apalis's `Queued` may also be a handler that already
/// let go, so that case gets a second job, and its claim one harmless replay.
#[tokio::test]
async fn awaiting_a_child_of_an_earlier_run_of_the_thread() {
    let gate = tempfile::tempdir().unwrap();
    let go = gate.path().join("go");
    let points = format!("after_terminal_commit=wait({})", go.display());
    let t = scripted(
        vec![
            (
                "p-first",
                vec![
                    calls(vec![call(
                        "subagent_start",
                        json!({"description": "Slow.\nSCENARIO steps=2 latency_ms=3000 run=earlier", "subagent": "general-purpose", "detached": true}),
                    )]),
                    say("started it"),
                ],
            ),
            ("p-second", vec![]),
        ],
        move |s| {
            s.reap_ms = NO_REAPER_MS;
            s.concurrency = 2;
            s.failpoints = points;
        },
    )
    .await;
    let first = start_parent(&t, "p-first").await;
    assert_eq!(
        wait_for(&t, first.id, Duration::from_secs(20)).await.status,
        RunStatus::Succeeded
    );
    let child = t.app.store.children(first.id).await.unwrap().remove(0);
    assert!(
        !child.status.is_terminal(),
        "the detached child outlives the run that started it"
    );
    t.mock.state.set_script(Script::from([(
        "p-second".to_owned(),
        vec![
            calls(vec![call("subagent_await", json!({"run_ids": [child.id]}))]),
            say("awaited it"),
        ],
    )]));
    let second = t
        .app
        .start_run(StartRun {
            agent: Some("p-second".into()),
            input: "Collect it.".into(),
            thread_id: Some(first.thread_id.clone()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(
        t.app
            .store
            .get_run(second.id)
            .await
            .unwrap()
            .unwrap()
            .status,
        RunStatus::Queued,
        "no slot free for it yet"
    );
    std::fs::write(&go, "").unwrap();
    let done = wait_for(&t, second.id, Duration::from_secs(20)).await;
    assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
    let results = tool_results(&t, &second).await;
    let awaited = results.last().unwrap();
    assert_eq!(awaited["runs"][0]["status"], "succeeded", "{awaited}");
    assert!(
        kinds(&t.events(second.id).await).contains(&"run.waiting"),
        "it parked on the child"
    );
    let claims: Vec<_> = t
        .events(second.id)
        .await
        .into_iter()
        .map(|e| (e.kind, e.data))
        .collect();
    assert!(
        (2..=3).contains(&done.attempts),
        "claimed to start and once more when the child ended (at most one replay more, above), never in a loop: {claims:?}"
    );
}

/// Hole 4: the child's end and its parent's `child.finished` (and wake-up) commit together, so
/// a worker that dies right after the child's terminal commit loses neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_a_childs_end_loses_neither_the_event_nor_the_wake() {
    let t = without_workers(
        "p-crash",
        vec![calls(vec![call("task", json!({"description": "Child.\nSCENARIO steps=2 latency_ms=100 run=crash", "subagent": "general-purpose"}))]), say("parent done")],
    )
    .await;
    let parent = start_parent(&t, "p-crash").await;
    // This worker dies right after the first terminal commit it makes: the child's.
    crash_a_worker(&t, "after_terminal_commit=crash").await;
    let child = t.app.store.children(parent.id).await.unwrap().remove(0);
    assert_eq!(child.status, RunStatus::Succeeded);
    let events = t.events(parent.id).await;
    assert!(
        events
            .iter()
            .any(|e| e.kind == "child.finished" && e.data["child_run_id"] == json!(child.id)),
        "child.finished committed with the child's end: {:?}",
        kinds(&events)
    );
    // The parent is due; a healthy worker's reaper finds it.
    let done = finish_on_a_healthy_worker(&t, parent.id, Duration::from_secs(30)).await;
    assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
    assert_gap_free(&t.events(parent.id).await, RunStatus::Succeeded);
}

/// Hole 5, first edge: a cancel that arrives while a child run is parking finishes it as
/// cancelled, cancels its own child, and wakes its parent.
#[tokio::test]
async fn a_cancel_during_a_park_ends_the_run_and_wakes_its_parent() {
    // Every park is held until the test has made its cancel.
    let gate = tempfile::tempdir().unwrap();
    let go = gate.path().join("go");
    let points = format!("before_park_commit=wait({})", go.display());
    let t = scripted(
        vec![
            ("p-root", vec![calls(vec![call("task", json!({"description": "Middle.", "subagent": "p-mid"}))]), say("root done")]),
            (
                "p-mid",
                vec![calls(vec![call("task", json!({"description": "Leaf.\nSCENARIO steps=5 latency_ms=500 run=leaf", "subagent": "general-purpose"}))]), say("mid done")],
            ),
        ],
        move |s| {
            s.reap_ms = NO_REAPER_MS;
            s.max_depth = 2;
            s.failpoints = points;
        },
    )
    .await;
    let root = start_parent(&t, "p-root").await;
    // Wait until the middle run has started its leaf: it is then held before its park.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mid = loop {
        let kids = t.app.store.children(root.id).await.unwrap();
        if let Some(m) = kids.first()
            && !t.app.store.children(m.id).await.unwrap().is_empty()
        {
            break m.clone();
        }
        assert!(
            Instant::now() < deadline,
            "the middle run never started its leaf"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(
        t.app.cancel(mid.id).await.unwrap(),
        CancelOutcome::Requested
    );
    std::fs::write(&go, "").unwrap();
    let mid_done = wait_for(&t, mid.id, Duration::from_secs(10)).await;
    assert_eq!(mid_done.status, RunStatus::Cancelled);
    let mid_events = t.events(mid.id).await;
    assert_gap_free(&mid_events, RunStatus::Cancelled);
    assert!(
        !kinds(&mid_events).contains(&"run.waiting"),
        "the park was refused: {:?}",
        kinds(&mid_events)
    );
    let leaf = t.app.store.children(mid.id).await.unwrap().remove(0);
    assert_eq!(
        wait_for(&t, leaf.id, Duration::from_secs(10)).await.status,
        RunStatus::Cancelled
    );
    let root_done = wait_for(&t, root.id, Duration::from_secs(20)).await;
    assert_eq!(
        root_done.status,
        RunStatus::Succeeded,
        "the parent was woken: {root_done:?}"
    );
    assert_eq!(tool_results(&t, &root).await[0]["status"], "cancelled");
}

/// Hole 5, second edge: a cancel requested while the run's worker was gone is honoured at the
/// next claim, before any model call.
#[tokio::test]
async fn a_cancel_pending_at_claim_makes_no_model_call() {
    let t = spawn_app_with(Options {
        workers: false,
        ..Default::default()
    })
    .await;
    let run = t.start("SCENARIO steps=3 run=pending-cancel").await;
    // A worker takes it and dies at once (its lease simply runs out).
    let Claim::Acquired(..) = t
        .app
        .store
        .claim_run(run.id, "dead-worker", Duration::from_millis(20))
        .await
        .unwrap()
    else {
        panic!()
    };
    assert_eq!(
        t.app.cancel(run.id).await.unwrap(),
        CancelOutcome::Requested
    );
    let stop = tokio_util::sync::CancellationToken::new();
    let w = t.app.spawn_workers(stop.clone());
    let done = wait_for(&t, run.id, Duration::from_secs(20)).await;
    stop.cancel();
    w.await.unwrap();
    assert_eq!(done.status, RunStatus::Cancelled);
    assert!(
        t.mock
            .state
            .log()
            .iter()
            .all(|l| !l.step_key.starts_with(&run.id.to_string())),
        "no model call after the cancel"
    );
    assert_gap_free(&t.events(run.id).await, RunStatus::Cancelled);
}

/// Hole 5, third edge: cancelling a parked run frees its thread: the run enqueued behind it
/// starts.
#[tokio::test]
async fn cancelling_a_parked_run_starts_the_next_run_of_its_thread() {
    let t = scripted(
        vec![(
            "p-park",
            vec![calls(vec![call("task", json!({"description": "Slow.\nSCENARIO steps=4 latency_ms=1000 run=slow", "subagent": "general-purpose"}))]), say("never")],
        )],
        |s| s.reap_ms = NO_REAPER_MS,
    )
    .await;
    let parent = start_parent(&t, "p-park").await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while t
        .app
        .store
        .get_run(parent.id)
        .await
        .unwrap()
        .unwrap()
        .status
        != RunStatus::Waiting
    {
        assert!(Instant::now() < deadline, "the parent never parked");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let behind = t
        .app
        .start_run(StartRun {
            input: "SCENARIO steps=1 run=behind".into(),
            thread_id: Some(parent.thread_id.clone()),
            if_busy: IfBusy::Enqueue,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(behind.status, RunStatus::Queued);
    assert_eq!(
        t.app.cancel(parent.id).await.unwrap(),
        CancelOutcome::Cancelled
    );
    let done = wait_for(&t, behind.id, Duration::from_secs(10)).await;
    assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
    assert_gap_free(&t.events(parent.id).await, RunStatus::Cancelled);
}

/// Hole 6: a parked run is woken only by what it waits on — not by a child it merely started
/// (whose call was answered before the park), nor by a re-run of an answered call.
#[tokio::test]
async fn a_parked_run_is_woken_only_by_what_it_waits_on() {
    let t = scripted(
        vec![(
            "p-spurious",
            vec![
                calls(vec![
                    call("subagent_start", json!({"description": "Quick.\nSCENARIO steps=1 run=quick", "subagent": "general-purpose"})),
                    call("task", json!({"description": "Slow.\nSCENARIO steps=3 latency_ms=400 run=slow6", "subagent": "general-purpose"})),
                ]),
                say("both done"),
            ],
        )],
        |s| s.reap_ms = NO_REAPER_MS,
    )
    .await;
    let parent = start_parent(&t, "p-spurious").await;
    let done = wait_for(&t, parent.id, Duration::from_secs(20)).await;
    assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
    let events = t.events(parent.id).await;
    let resumed = events.iter().filter(|e| e.kind == "run.resumed").count();
    assert_eq!(
        resumed,
        1,
        "woken once, when the awaited child ended: {:?}",
        kinds(&events)
    );
    assert_eq!(
        t.app.store.children(parent.id).await.unwrap().len(),
        2,
        "each child started once"
    );
}

/// Hole 7: a claim reads a long thread back in a bounded window (the newest messages), not
/// whole; the run's own task is always in its context.
#[tokio::test]
async fn a_long_thread_is_read_back_in_a_bounded_window() {
    let t = spawn_app_with(Options {
        tweak: Box::new(|s| s.context_messages = 6),
        ..Default::default()
    })
    .await;
    let first = t.run("SCENARIO steps=8 run=long").await;
    assert_eq!(first.status, RunStatus::Succeeded, "{first:?}");
    assert_eq!(
        t.app
            .store
            .thread_messages(&first.thread_id, 100_000)
            .await
            .unwrap()
            .len(),
        16
    );
    let second = t
        .app
        .start_run(StartRun {
            input: "SCENARIO steps=1 run=window".into(),
            thread_id: Some(first.thread_id.clone()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(t.wait(second.id).await.status, RunStatus::Succeeded);
    let log = t.mock.state.log();
    let req = log
        .iter()
        .find(|l| l.step_key.starts_with(&second.id.to_string()))
        .unwrap();
    // The system prompt and the 6 newest messages (its own task among them), not all 17.
    assert_eq!(req.messages, 7, "{req:?}");
    assert!(req.scenario.contains("window"));
}

/// Hole 8: owners have their own workspaces, and no path leaves them.
#[tokio::test]
async fn owners_cannot_read_each_others_files() {
    let t = scripted(
        vec![
            (
                "p-write",
                vec![
                    calls(vec![call(
                        "write_file",
                        json!({"path": "secret.txt", "content": "alice's"}),
                    )]),
                    say("written"),
                ],
            ),
            (
                "p-read",
                vec![
                    calls(vec![call("read_file", json!({"path": "secret.txt"}))]),
                    say("read"),
                ],
            ),
        ],
        |_| {},
    )
    .await;
    let start = |agent: &str, owner: &str| StartRun {
        agent: Some(agent.into()),
        input: "Go.".into(),
        owner: Some(owner.into()),
        ..Default::default()
    };
    let w = t.app.start_run(start("p-write", "alice")).await.unwrap();
    assert_eq!(t.wait(w.id).await.status, RunStatus::Succeeded);
    assert_eq!(
        std::fs::read_to_string(t.dir.path().join("workspace/alice/secret.txt")).unwrap(),
        "alice's"
    );
    let bob = t.app.start_run(start("p-read", "bob")).await.unwrap();
    assert_eq!(t.wait(bob.id).await.status, RunStatus::Succeeded);
    let seen = tool_results(&t, &bob).await;
    assert!(
        seen[0].as_str().unwrap().starts_with("error[not_found]"),
        "bob saw: {seen:?}"
    );
    let alice = t.app.start_run(start("p-read", "alice")).await.unwrap();
    assert_eq!(t.wait(alice.id).await.status, RunStatus::Succeeded);
    assert_eq!(
        tool_results(&t, &alice).await[0],
        json!("     1\talice's\n")
    );
}

/// Bounded while parked: a run's wall-time limit ends it even while it waits on a child that
/// takes longer, and its attached child is cancelled with it.
#[tokio::test]
async fn the_wall_time_limit_ends_a_parked_run() {
    let t = scripted(
        vec![("p-slow", vec![calls(vec![call("task", json!({"description": "Slow.\nSCENARIO steps=10 latency_ms=1000 run=slowest", "subagent": "general-purpose"}))]), say("never")])],
        |_| {},
    )
    .await;
    let parent = t
        .app
        .start_run(StartRun {
            agent: Some("p-slow".into()),
            input: "Go.".into(),
            timeout_secs: Some(2),
            ..Default::default()
        })
        .await
        .unwrap();
    let done = wait_for(&t, parent.id, Duration::from_secs(30)).await;
    assert_eq!(done.status, RunStatus::Failed, "{done:?}");
    assert_eq!(
        done.error.as_ref().unwrap().kind,
        subagents::store::ErrorKind::Timeout
    );
    // It ended before its 10 s child did: the child was cancelled with it, not finished.
    let child = t.app.store.children(parent.id).await.unwrap().remove(0);
    assert_eq!(
        wait_for(&t, child.id, Duration::from_secs(10)).await.status,
        RunStatus::Cancelled
    );
}

/// Until the mock has answered `n` requests (the model calls under way beside a held commit).
async fn until_answered(t: &TestApp, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while t.mock.state.log().len() < n {
        assert!(
            Instant::now() < deadline,
            "the mock answered {} of {n} requests",
            t.mock.state.log().len()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Lets the held commit go (the file `go`); the run then succeeds with `result`. Its events,
/// checked gap-free.
async fn let_go_and_succeed(
    t: &TestApp,
    run: subagents::ids::RunId,
    go: &std::path::Path,
    result: &str,
) -> Vec<subagents::domain::event::EventRecord> {
    std::fs::write(go, "").unwrap();
    let done = wait_for(t, run, Duration::from_secs(20)).await;
    assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
    assert_eq!(done.result.as_deref(), Some(result));
    let events = t.events(run).await;
    assert_gap_free(&events, RunStatus::Succeeded);
    events
}

async fn thread_of(
    t: &TestApp,
    run: &subagents::store::RunRecord,
) -> Vec<subagents::domain::StoredMessage> {
    t.app
        .store
        .thread_messages(&run.thread_id, 100)
        .await
        .unwrap()
}

fn seq_of(events: &[subagents::domain::event::EventRecord], kind: &str, step: u64) -> u64 {
    events
        .iter()
        .find(|e| e.kind == kind && e.data["step"] == step)
        .unwrap_or_else(|| panic!("no {kind} of step {step}"))
        .seq
}

/// The run's input is committed beside its first model call, not before it: with that commit
/// held, the model has answered while the run has not even its `step.started`; once the
/// commit lands the answer commits after it.
#[tokio::test]
async fn the_input_commits_beside_the_first_model_call() {
    let gate = tempfile::tempdir().unwrap();
    let go = gate.path().join("go");
    let points = format!("before_commit_beside_call=wait({})", go.display());
    let t = scripted(vec![("beside", vec![say("answered")])], move |s| {
        s.failpoints = points;
    })
    .await;
    let run = start_parent(&t, "beside").await;
    until_answered(&t, 1).await;
    let held = t.app.store.get_run(run.id).await.unwrap().unwrap();
    assert_eq!(held.status, RunStatus::Running);
    assert_eq!(held.step, 0, "the answer must not commit before the input");
    let events = t.events(run.id).await;
    assert!(
        !events.iter().any(|e| e.kind == "step.started"),
        "the input's commit is held, so is step 1's step.started: {events:?}"
    );
    let events = let_go_and_succeed(&t, run.id, &go, "answered").await;
    assert!(seq_of(&events, "step.started", 1) < seq_of(&events, "model.completed", 1));
    let history = thread_of(&t, &run).await;
    assert_eq!(history.len(), 2, "the input, then the answer: {history:?}");
}

/// A step's last tool result commits beside the next step's model call; a `RunStart` hook
/// keeps the input's commit before the call (the hook runs on a committed input), so only the
/// tool result's commit meets the held failure point.
#[tokio::test]
async fn a_tool_result_commits_beside_the_next_model_call_and_a_start_hook_keeps_the_input_first() {
    let gate = tempfile::tempdir().unwrap();
    let go = gate.path().join("go");
    let hook = gate.path().join("start.sh");
    std::fs::write(&hook, "#!/usr/bin/env bash\ncat > /dev/null\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&hook, std::fs::Permissions::from_mode(0o755)).unwrap();
    let settings = gate.path().join("subagents.json");
    let hooks = json!({"hooks": {"RunStart": [{"hooks": [{"type": "command", "command": hook}]}]}});
    std::fs::write(&settings, hooks.to_string()).unwrap();
    let points = format!("before_commit_beside_call=wait({})", go.display());
    let t = scripted(
        vec![(
            "beside-tool",
            vec![
                calls(vec![call("echo", json!({"text": "hello"}))]),
                say("after the tool"),
            ],
        )],
        move |s| {
            s.failpoints = points;
            s.settings_file = settings;
        },
    )
    .await;
    let run = start_parent(&t, "beside-tool").await;
    // Step 2's call was answered while step 1's tool result is still held.
    until_answered(&t, 2).await;
    let held = t.app.store.get_run(run.id).await.unwrap().unwrap();
    assert_eq!(
        held.step, 1,
        "step 2's answer must wait for step 1's result"
    );
    let events = t.events(run.id).await;
    assert!(events.iter().any(|e| e.kind == "model.completed"));
    assert!(
        !events.iter().any(|e| e.kind == "tool.completed"),
        "the result's commit is held: {events:?}"
    );
    let events = let_go_and_succeed(&t, run.id, &go, "after the tool").await;
    assert!(seq_of(&events, "tool.completed", 1) < seq_of(&events, "step.started", 2));
    assert!(seq_of(&events, "step.started", 2) < seq_of(&events, "model.completed", 2));
}

/// A run cancelled while the commit beside its model call is held: the cancel cuts the loop
/// (the answer is dropped), the held commit still lands before the end, as it would have
/// before the call: the thread keeps the run's input, and nothing of the call is committed.
#[tokio::test]
async fn a_cancel_beside_a_held_commit_keeps_the_commit_and_drops_the_answer() {
    let gate = tempfile::tempdir().unwrap();
    let go = gate.path().join("go");
    let cut = gate.path().join("cut");
    let points = format!(
        "before_commit_beside_call=wait({}),after_attempt_cut=touch({})",
        go.display(),
        cut.display()
    );
    let t = scripted(vec![("beside-cut", vec![say("never kept")])], move |s| {
        s.failpoints = points;
    })
    .await;
    let run = start_parent(&t, "beside-cut").await;
    until_answered(&t, 1).await;
    assert_eq!(
        t.app.cancel(run.id).await.unwrap(),
        CancelOutcome::Requested
    );
    // The cancel cut the loop while the input's commit was still held; only then is it let go.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cut.exists() {
        assert!(Instant::now() < deadline, "the cancel never cut the loop");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    std::fs::write(&go, "").unwrap();
    let done = wait_for(&t, run.id, Duration::from_secs(20)).await;
    assert_eq!(done.status, RunStatus::Cancelled, "{done:?}");
    assert_eq!(done.step, 0);
    let events = t.events(run.id).await;
    assert_gap_free(&events, RunStatus::Cancelled);
    assert!(
        !events.iter().any(|e| e.kind == "model.completed"),
        "{events:?}"
    );
    let started = seq_of(&events, "step.started", 1);
    let cancelled = events.iter().find(|e| e.kind == "run.cancelled").unwrap();
    assert!(
        started < cancelled.seq,
        "the held commit landed before the end"
    );
    let history = thread_of(&t, &run).await;
    assert_eq!(history.len(), 1, "the input only: {history:?}");
    assert!(
        matches!(&history[0].message, subagents::model::Message::User { content } if content == "Coordinate the work."),
        "{history:?}"
    );
}

/// A worker process that dies while the commit beside its model call is under way (the run's
/// input, here: the first such commit) leaves nothing of that attempt but its claim; the run
/// resumes on another worker from what was committed, and its thread holds each message once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_beside_a_commit_leaves_a_run_that_resumes_whole() {
    let t = without_workers(
        "p-beside-kill",
        vec![
            calls(vec![call("echo", json!({"text": "hello"}))]),
            say("resumed"),
        ],
    )
    .await;
    let run = start_parent(&t, "p-beside-kill").await;
    crash_a_worker(&t, "before_commit_beside_call=crash").await;
    let held = t.app.store.get_run(run.id).await.unwrap().unwrap();
    assert_eq!(
        (held.status, held.step),
        (RunStatus::Running, 0),
        "{held:?}"
    );
    assert!(
        thread_of(&t, &run).await.is_empty(),
        "the input never landed"
    );
    let done = finish_on_a_healthy_worker(&t, run.id, Duration::from_secs(60)).await;
    assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
    assert_eq!(done.result.as_deref(), Some("resumed"));
    assert_gap_free(&t.events(run.id).await, RunStatus::Succeeded);
    let thread = thread_of(&t, &run).await;
    let roles: Vec<&str> = thread
        .iter()
        .map(|m| match &m.message {
            subagents::model::Message::User { .. } => "user",
            subagents::model::Message::Assistant { .. } => "assistant",
            subagents::model::Message::Tool { .. } => "tool",
            _ => "other",
        })
        .collect();
    assert_eq!(
        roles,
        ["user", "assistant", "tool", "assistant"],
        "{thread:?}"
    );
}
