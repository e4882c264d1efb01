//! Schedules: every tick fires exactly once across worker processes SIGKILLed as it goes;
//! `overlap` and `catch_up` do what they say; the API refuses what cannot fire and shows what
//! will. (Daylight saving: the unit tests of `domain::schedule`.)

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use subagents::store::{CatchUp, Overlap, RunStatus, Schedule};

use crate::support::*;

fn schedule(id: &str, cron: &str, input: &str, next_fire_at: i64) -> Schedule {
    Schedule {
        id: id.into(),
        owner: subagents::ids::OwnerId::local(),
        cron: cron.into(),
        timezone: "UTC".into(),
        agent: "general-purpose".into(),
        input: input.into(),
        thread_id: None,
        overlap: Overlap::Enqueue,
        catch_up: CatchUp::None,
        paused: false,
        metadata: json!({}),
        priority: 3,
        next_fire_at,
        created_at: chrono::Utc::now(),
        updated_at: chrono::Utc::now(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_tick_fires_once_across_three_workers_killed_every_few_seconds() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("jobs")).unwrap();
    let mock =
        subagents::model::mock::MockServer::start(([127, 0, 0, 1], 0).into(), Default::default())
            .await
            .unwrap();
    let app = subagents::app::App::open(test_settings(dir.path(), &mock))
        .await
        .unwrap();
    let mut workers: Vec<Worker> = (0..3)
        .map(|_| spawn_worker(dir.path(), &mock, &[]))
        .collect();
    // Every second, for a minute, from two seconds from now (the workers are starting).
    let first = (subagents::store::now_ms() / 1000 + 2) * 1000;
    let s = schedule("sch_fleet", "* * * * * *", "Tick.\nSCENARIO steps=1", first);
    app.store.create_schedule(&s).await.unwrap();
    let end = first + 60_000;
    let mut kills = 0;
    let mut next_kill = Instant::now() + Duration::from_secs(3);
    while subagents::store::now_ms() < end {
        if Instant::now() >= next_kill {
            let victim = kills % workers.len();
            workers[victim].kill().unwrap(); // SIGKILL
            workers[victim].wait().unwrap();
            workers[victim] = spawn_worker(dir.path(), &mock, &[]);
            kills += 1;
            next_kill = Instant::now() + Duration::from_millis(2_500 + (kills as u64 % 3) * 500);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut stopped = s.clone();
    stopped.paused = true;
    // The ticks up to `end` have fired once the schedule's next tick is past it.
    let t0 = Instant::now();
    loop {
        let now = app
            .store
            .get_schedule(&s.owner, &s.id)
            .await
            .unwrap()
            .unwrap();
        if now.next_fire_at > end {
            stopped.next_fire_at = now.next_fire_at;
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the schedule keeps firing"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    app.store.update_schedule(&stopped).await.unwrap();
    assert!(
        kills >= 15,
        "a worker was killed every few seconds: {kills}"
    );

    let fired = app.store.schedule_runs(&s.id, 10_000).await.unwrap();
    let ticks: BTreeSet<i64> = fired.iter().map(|(t, _, _)| *t).collect();
    let runs: BTreeSet<_> = fired.iter().map(|(_, r, _)| *r).collect();
    let expected: BTreeSet<i64> = (0..)
        .map(|i| first + i * 1000)
        .take_while(|t| *t <= *ticks.last().unwrap())
        .collect();
    assert!(ticks.len() >= 60, "a minute of ticks: {}", ticks.len());
    assert_eq!(ticks, expected, "no tick missed");
    assert_eq!(runs.len(), ticks.len(), "one run per tick");
    // Nothing else started a run: every run of the owner is one of the ticks'.
    let all = app
        .store
        .list_runs(&s.owner, &Default::default(), 10_000)
        .await
        .unwrap();
    assert_eq!(all.len(), runs.len(), "no tick started two runs");
    for r in &all {
        let (sched, tick) = app.store.run_schedule(r.id).await.unwrap().unwrap();
        assert_eq!(sched, s.id);
        assert_eq!(
            app.store
                .run_by_key(&s.owner, &format!("schedule:{}:{tick}", s.id))
                .await
                .unwrap(),
            Some(r.id),
            "a tick's run holds its key"
        );
    }
    drop(workers);
}

/// The API at `base`, keyless.
async fn call(
    base: &str,
    method: reqwest::Method,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let mut req = reqwest::Client::new().request(method, format!("{base}{path}"));
    if let Some(b) = body {
        req = req.json(&b);
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlap_skip_enqueue_and_cancel_previous_and_the_api() {
    let t = spawn_app().await;
    let base = t.serve("").await;
    use reqwest::Method;
    // What cannot fire is refused, with why.
    for (body, code) in [
        (json!({"cron": "* * *", "input": "x"}), "invalid_schedule"),
        (
            json!({"cron": "* * * * *", "timezone": "Mars/Base", "input": "x"}),
            "invalid_schedule",
        ),
        (
            json!({"cron": "* * * * *", "input": "  "}),
            "invalid_schedule",
        ),
        (
            json!({"cron": "* * * * *", "input": "x", "agent": "nobody"}),
            "unknown_agent",
        ),
        (
            json!({"cron": "* * * * *", "input": "x", "thread_id": "t", "new_thread_each_time": true}),
            "invalid_schedule",
        ),
        (
            json!({"cron": "* * * * *", "input": "x", "overlap": "sometimes"}),
            "invalid_request",
        ),
    ] {
        let (status, v) = call(&base, Method::POST, "/v1/schedules", Some(body.clone())).await;
        assert_eq!(status, 422, "{body}: {v}");
        assert_eq!(v["error"]["code"], code, "{body}: {v}");
    }
    // A slow run per trigger (the clock itself is far away: once a year).
    let mk = async |overlap: &str, thread: Option<&str>| {
        let (status, v) = call(
            &base,
            Method::POST,
            "/v1/schedules",
            Some(json!({"cron": "0 0 1 1 *", "timezone": "Europe/Paris", "input": "Slow.\nSCENARIO steps=1 latency_ms=4000",
                "overlap": overlap, "thread_id": thread})),
        )
        .await;
        assert_eq!(status, 201, "{v}");
        let times = v["next_fire_times"].as_array().unwrap();
        assert_eq!(times.len(), 5, "{v}");
        assert!(
            times[0].as_str().unwrap().contains("-12-31T23:00:00"),
            "midnight in Paris: {v}"
        );
        v["id"].as_str().unwrap().to_owned()
    };
    let trigger = async |id: &str| {
        call(
            &base,
            Method::POST,
            &format!("/v1/schedules/{id}/trigger"),
            None,
        )
        .await
    };
    let status_of = async |run: &Value| {
        let id: subagents::ids::RunId = run.as_str().unwrap().parse().unwrap();
        t.app.store.get_run(id).await.unwrap().unwrap().status
    };

    // skip: a tick while the previous run goes on starts nothing.
    let skip = mk("skip", None).await;
    let (s1, first) = trigger(&skip).await;
    assert_eq!(s1, 201, "{first}");
    let (s2, second) = trigger(&skip).await;
    assert_eq!(s2, 200, "{second}");
    assert_eq!(second["skipped_for"], first["run_id"]);

    // cancel_previous: the previous run is cancelled, the new one goes.
    let cancel = mk("cancel_previous", Some("sched-thread-c")).await;
    let (_, a) = trigger(&cancel).await;
    let (_, b) = trigger(&cancel).await;
    assert_ne!(a["run_id"], b["run_id"]);
    let done = t.wait(b["run_id"].as_str().unwrap().parse().unwrap()).await;
    assert_eq!(done.status, RunStatus::Succeeded);
    assert_eq!(status_of(&a["run_id"]).await, RunStatus::Cancelled);

    // enqueue on one thread: the second waits for the first, then runs.
    let enqueue = mk("enqueue", Some("sched-thread-e")).await;
    let (_, a) = trigger(&enqueue).await;
    let (_, b) = trigger(&enqueue).await;
    assert_eq!(
        status_of(&b["run_id"]).await,
        RunStatus::Queued,
        "queued behind the first"
    );
    let done = t.wait(b["run_id"].as_str().unwrap().parse().unwrap()).await;
    assert_eq!(done.status, RunStatus::Succeeded);
    let first = t.wait(a["run_id"].as_str().unwrap().parse().unwrap()).await;
    assert!(first.finished_at <= done.started_at, "one after the other");

    // The runs carry the schedule; the list filters on it; the view shows the recent runs.
    let (_, run) = call(
        &base,
        Method::GET,
        &format!("/v1/runs/{}", b["run_id"].as_str().unwrap()),
        None,
    )
    .await;
    assert_eq!(run["schedule_id"], enqueue.as_str(), "{run}");
    assert!(run["scheduled_for"].is_string(), "{run}");
    let (_, listed) = call(
        &base,
        Method::GET,
        &format!("/v1/runs?schedule_id={enqueue}"),
        None,
    )
    .await;
    assert_eq!(listed["runs"].as_array().unwrap().len(), 2, "{listed}");
    let (_, view) = call(
        &base,
        Method::GET,
        &format!("/v1/schedules/{enqueue}"),
        None,
    )
    .await;
    assert_eq!(view["recent_runs"].as_array().unwrap().len(), 2, "{view}");
    assert_eq!(view["recent_runs"][0]["status"], "succeeded", "{view}");

    // The dashboard's schedules page shows them and pauses one.
    let b = crate::browser::Browser::start(1280, 900).await;
    b.goto(&format!("{base}/ui/schedules")).await;
    b.wait_for(&format!("[data-schedule='{skip}']"), 30).await;
    let row = b.text(&format!("[data-schedule='{enqueue}']")).await;
    assert!(
        row.contains("enqueue") && row.contains("succeeded"),
        "{row}"
    );
    b.click(&format!("[data-schedule='{skip}'] button")).await;
    b.wait_for(&format!("[data-schedule='{skip}'] [data-paused]"), 30)
        .await;
    let (_, v) = call(&base, Method::GET, &format!("/v1/schedules/{skip}"), None).await;
    assert_eq!(v["paused"], true, "{v}");
    drop(b);

    // Pause, resume, delete.
    let (_, paused) = call(
        &base,
        Method::POST,
        &format!("/v1/schedules/{enqueue}/pause"),
        None,
    )
    .await;
    assert_eq!(
        (
            paused["paused"].clone(),
            paused["next_fire_times"].as_array().unwrap().len()
        ),
        (json!(true), 0)
    );
    let (_, resumed) = call(
        &base,
        Method::POST,
        &format!("/v1/schedules/{enqueue}/resume"),
        None,
    )
    .await;
    assert_eq!(resumed["paused"], false);
    let (status, _) = call(
        &base,
        Method::DELETE,
        &format!("/v1/schedules/{enqueue}"),
        None,
    )
    .await;
    assert_eq!(status, 204);
    let (status, _) = call(
        &base,
        Method::GET,
        &format!("/v1/schedules/{enqueue}"),
        None,
    )
    .await;
    assert_eq!(status, 404);
    let done = t.wait(first_run(&skip, &t).await).await;
    assert_eq!(done.status, RunStatus::Succeeded);
}

async fn first_run(schedule: &str, t: &TestApp) -> subagents::ids::RunId {
    t.app.store.schedule_runs(schedule, 10).await.unwrap()[0].1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_downtime_catch_up_fires_none_the_last_or_all_missed_ticks() {
    let t = spawn_app().await;
    // Ten minutes of missed minute ticks (the scheduler "was down").
    let now = subagents::store::now_ms();
    let missed_from = (now / 60_000 - 10) * 60_000;
    for (id, catch_up) in [
        ("sch_none", CatchUp::None),
        ("sch_last", CatchUp::Last),
        ("sch_all", CatchUp::All),
    ] {
        let mut s = schedule(id, "* * * * *", "Caught up.\nSCENARIO steps=1", missed_from);
        s.catch_up = catch_up;
        t.app.store.create_schedule(&s).await.unwrap();
    }
    subagents::schedules::spawn(t.app.clone(), t.shutdown.clone());
    let t0 = Instant::now();
    let mut fired: BTreeMap<&str, usize> = BTreeMap::new();
    loop {
        let mut all_moved = true;
        for id in ["sch_none", "sch_last", "sch_all"] {
            let s = t
                .app
                .store
                .get_schedule(&subagents::ids::OwnerId::local(), id)
                .await
                .unwrap()
                .unwrap();
            all_moved &= s.next_fire_at > now;
            fired.insert(id, t.app.store.schedule_runs(id, 100).await.unwrap().len());
        }
        if all_moved {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the scheduler catches up: {fired:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // `none` fires only a tick within the minute of grace (the current one, when it is).
    assert!(fired["sch_none"] <= 1, "{fired:?}");
    assert_eq!(fired["sch_last"], 1, "{fired:?}");
    assert!(fired["sch_all"] >= 10, "every missed tick: {fired:?}");
    let last = t.app.store.schedule_runs("sch_last", 10).await.unwrap();
    let all = t.app.store.schedule_runs("sch_all", 100).await.unwrap();
    assert_eq!(last[0].0, all[0].0, "`last` fired the latest missed tick");
}
