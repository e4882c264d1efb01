//! Durability by killing: a worker process is SIGKILLed mid-run and a new process finishes the
//! run. The mock's request log and the tool journal prove nothing committed was redone.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use subagents::app::{App, StartRun};
use subagents::model::Message;
use subagents::model::mock::{MockOptions, MockServer};
use subagents::store::RunStatus;

use crate::support::*;

fn worker(dir: &std::path::Path, mock: &MockServer, journal: &std::path::Path) -> Worker {
    spawn_worker(
        dir,
        mock,
        &[("SUBAGENTS_TOOL_JOURNAL", journal.display().to_string())],
    )
}

/// A test directory with a tool journal, a mock answering in 250 ms (time to kill mid-run),
/// and an app on the directory's SQLite file that starts runs and reads them (no workers).
async fn killable() -> (tempfile::TempDir, std::path::PathBuf, MockServer, App) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("jobs")).unwrap();
    let journal = dir.path().join("journal.tsv");
    let mock = MockServer::start(
        ([127, 0, 0, 1], 0).into(),
        MockOptions {
            latency: Duration::from_millis(250),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let settings = test_settings(dir.path(), &mock);
    let app = App::open(settings).await.unwrap();
    (dir, journal, mock, app)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_loses_nothing_and_redoes_nothing() {
    let (dir, journal, mock, app) = killable().await;
    let run = app
        .start_run(StartRun {
            input: "Long task.\nSCENARIO steps=10 tool=echo".into(),
            ..Default::default()
        })
        .await
        .unwrap();

    let mut first = worker(dir.path(), &mock, &journal);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = app.store.get_run(run.id).await.unwrap().unwrap();
        if r.step >= 3 {
            break;
        }
        assert!(Instant::now() < deadline, "worker made no progress: {r:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    first.kill().unwrap(); // SIGKILL
    first.wait().unwrap();
    let at_kill = app.store.get_run(run.id).await.unwrap().unwrap();
    assert_eq!(
        at_kill.status,
        RunStatus::Running,
        "the dead worker's run is still running (lease pending expiry)"
    );
    let committed_steps = at_kill.step;
    let committed_msgs = app
        .store
        .thread_messages(&run.thread_id, 100_000)
        .await
        .unwrap();

    let mut second = worker(dir.path(), &mock, &journal);
    finished_once(
        &app,
        &mock,
        &journal,
        &run,
        committed_steps,
        &committed_msgs,
    )
    .await;
    second.kill().unwrap();
    second.wait().unwrap();
}

/// The run the killed process was running finishes in the new one: every message committed
/// before the kill kept, and nothing committed (a model response, a tool call with its result)
/// done again; only the step in flight at the kill may run twice.
async fn finished_once(
    app: &App,
    mock: &MockServer,
    journal: &std::path::Path,
    run: &subagents::store::RunRecord,
    committed_steps: u32,
    committed_msgs: &[subagents::store::StoredMessage],
) {
    let done = app
        .wait(run.id, Duration::from_secs(60))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
    assert_eq!(done.result.as_deref(), Some("DONE after 10 steps"));
    assert_eq!(done.step, 10);
    assert_eq!(
        done.attempts, 2,
        "claimed by the killed worker, then by the new one"
    );

    // Every message committed before the kill is still there, unchanged, in the same place.
    let msgs = app
        .store
        .thread_messages(&run.thread_id, 100_000)
        .await
        .unwrap();
    assert_eq!(&msgs[..committed_msgs.len()], committed_msgs);
    assert_eq!(
        msgs.iter()
            .filter(|m| matches!(m.message, Message::Assistant { .. }))
            .count(),
        10
    );
    assert_eq!(
        msgs.iter()
            .filter(|m| matches!(m.message, Message::Tool { .. }))
            .count(),
        9
    );

    // No committed model response was requested again: only the step in flight at the kill
    // (committed_steps + 1) may have been answered twice.
    let served = count_served(&mock.state.log());
    for step in 1..=10u32 {
        let n = served
            .get(&format!("{}:{step}", run.id))
            .copied()
            .unwrap_or(0);
        if step == committed_steps + 1 {
            assert!(
                (1..=2).contains(&n),
                "in-flight step {step} served {n} times"
            );
        } else {
            assert_eq!(
                n, 1,
                "step {step} served {n} times (committed before the kill: {committed_steps})"
            );
        }
    }

    // No tool call with a committed result ran again: a key may repeat only if its result was
    // not committed at the kill.
    let committed_keys: Vec<String> = committed_msgs
        .iter()
        .filter_map(|m| match &m.message {
            Message::Tool { tool_call_id, .. } => {
                Some(format!("{}:{}:{}", run.id, m.step, tool_call_id))
            }
            _ => None,
        })
        .collect();
    let mut runs: HashMap<String, usize> = HashMap::new();
    for line in std::fs::read_to_string(journal).unwrap().lines() {
        *runs
            .entry(line.split('\t').next().unwrap().to_owned())
            .or_default() += 1;
    }
    assert_eq!(runs.len(), 9, "every call executed: {runs:?}");
    for (key, n) in &runs {
        if committed_keys.contains(key) {
            assert_eq!(*n, 1, "{key} had a committed result yet ran {n} times");
        } else {
            assert!(*n <= 2, "{key} ran {n} times");
        }
    }
    assert_gap_free(
        &app.store.events_after(run.id, 0, 10_000).await.unwrap(),
        RunStatus::Succeeded,
    );
}

/// A run that `serve` handed to its own embedded worker as it started it (no fetch: the job
/// written locked to that worker) survives the process's SIGKILL like any other: its job is
/// locked to a worker whose heartbeat stopped, and a new process finishes the run with nothing
/// committed done again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_serve_loses_nothing_of_a_run_it_handed_its_own_worker() {
    let (dir, journal, mock, app) = killable().await;
    let serve = Logged::spawn(
        process(
            dir.path(),
            &mock,
            &["serve", "--host", "127.0.0.1", "--port", "0"],
        )
        .current_dir(dir.path())
        .env("SUBAGENTS_TOOL_JOURNAL", journal.display().to_string())
        .env_remove("REDIS_URL")
        .env_remove("SUBAGENTS_API_KEYS")
        .env_remove("SUBAGENTS_KEYS_FILE"),
        "serve",
    );
    let base = serve.listening_on();
    // Its worker registered (apalis does it as the worker starts): starts are handed to it.
    let db = sqlx::SqlitePool::connect(&app.settings.database_url)
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM Workers")
        .fetch_one(&db)
        .await
        .unwrap()
        == 0
    {
        assert!(Instant::now() < deadline, "serve's worker never registered");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let started: serde_json::Value = reqwest::Client::new()
        .post(format!("{base}/v1/runs"))
        .json(&serde_json::json!({"input": "Long task.\nSCENARIO steps=10 tool=echo"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id: subagents::ids::RunId = serde_json::from_value(started["id"].clone()).unwrap();
    let run = app.store.get_run(id).await.unwrap().unwrap();
    let metrics = reqwest::get(format!("{base}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("subagents_jobs_direct_total{via=\"start\"} 1"),
        "serve handed the run to its own worker, not through a fetch: {metrics}"
    );
    loop {
        let r = app.store.get_run(run.id).await.unwrap().unwrap();
        if r.step >= 3 {
            break;
        }
        assert!(Instant::now() < deadline, "serve made no progress: {r:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut serve = serve.child;
    serve.kill().unwrap(); // SIGKILL
    serve.wait().unwrap();
    let at_kill = app.store.get_run(run.id).await.unwrap().unwrap();
    assert_eq!(at_kill.status, RunStatus::Running, "lease pending expiry");
    let committed_msgs = app
        .store
        .thread_messages(&run.thread_id, 100_000)
        .await
        .unwrap();
    let mut second = worker(dir.path(), &mock, &journal);
    finished_once(&app, &mock, &journal, &run, at_kill.step, &committed_msgs).await;
    second.kill().unwrap();
    second.wait().unwrap();
}

/// A real PostgreSQL restart, not terminated backends: the server stops (new connections are
/// refused, `/readyz` answers 503), the runs in flight lose nothing and count no crash (an
/// outage is not the run's fault), and once it is back every run finishes with each of its
/// steps committed once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgresql_restart_loses_nothing_and_counts_no_crash() {
    let pg = PrivatePostgres::start();
    let url = pg.url();
    let t = spawn_app_with(Options {
        latency: Duration::from_millis(200),
        tweak: Box::new(move |s| {
            s.database_url = url;
            // Longer than the outage: renewals retry through it instead of giving the lease up.
            s.lease_ttl_secs = 10.0;
        }),
        ..Default::default()
    })
    .await;
    let base = t.serve("").await;
    let mut runs = vec![];
    for i in 0..3 {
        runs.push(
            t.start(&format!("SCENARIO steps=6 tool=echo run=pg{i}"))
                .await,
        );
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut least = u32::MAX;
        for r in &runs {
            least = least.min(t.app.store.get_run(r.id).await.unwrap().unwrap().step);
        }
        if least >= 2 {
            break;
        }
        assert!(Instant::now() < deadline, "the runs did not get going");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    pg.down();
    let refused = <sqlx::PgConnection as sqlx::Connection>::connect(&pg.url()).await;
    assert!(refused.is_err(), "the server refuses connections");
    let asked = Instant::now();
    let ready = reqwest::get(format!("{base}/readyz")).await.unwrap();
    assert_eq!(ready.status(), 503, "/readyz says the database is down");
    // It answers within its own 2 s bound, not after the pool's 30 s acquire timeout (10 s is
    // a margin a loaded machine keeps).
    assert!(
        asked.elapsed() < Duration::from_secs(10),
        "{:?}",
        asked.elapsed()
    );
    // Long enough for every worker to meet the outage mid-step.
    tokio::time::sleep(Duration::from_secs(2)).await;
    pg.up();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let ready = reqwest::get(format!("{base}/readyz")).await.unwrap();
        if ready.status() == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "/readyz never came back");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for r in &runs {
        let done = t.wait(r.id).await;
        assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
        assert_eq!(done.result.as_deref(), Some("DONE after 6 steps"));
        assert_eq!(done.crashes, 0, "an outage counts no crash: {done:?}");
        // Gap-free events, each step started and completed once.
        assert_gap_free(&t.events(r.id).await, RunStatus::Succeeded);
    }
}
