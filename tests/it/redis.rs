//! Events to Redis Streams: relayed in order, idempotently, surviving a Redis outage, and read
//! back with the outbox as the fallback. Each test runs its own redis-server on a free port.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use redis::AsyncCommands;
use subagents::app::StartRun;
use subagents::relay::{global_stream, run_stream};
use subagents::store::RunStatus;

use crate::support::*;

async fn with_redis(redis: &RedisServer, latency_ms: u64) -> TestApp {
    let url = redis.url();
    spawn_app_with(Options {
        latency: Duration::from_millis(latency_ms),
        tweak: Box::new(move |s| s.redis_url = Some(url)),
        ..Default::default()
    })
    .await
}

/// Waits until the relay has moved every outbox row.
async fn drained(t: &TestApp) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !t.app.store.unrelayed(1).await.unwrap().is_empty() {
        assert!(Instant::now() < deadline, "relay did not catch up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Asserts every run's stream holds exactly its outbox, in order, and the global stream holds
/// each event exactly once.
async fn assert_streams_match_outbox(
    t: &TestApp,
    redis: &RedisServer,
    runs: &[subagents::store::RunRecord],
) {
    let mut c = redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let global: redis::streams::StreamRangeReply = c.xrange_all(global_stream()).await.unwrap();
    let mut seen: HashMap<(String, u64), usize> = HashMap::new();
    for e in &global.ids {
        let v: serde_json::Value =
            serde_json::from_str(&e.get::<String>("event").unwrap()).unwrap();
        *seen
            .entry((
                v["run_id"].as_str().unwrap().to_owned(),
                v["seq"].as_u64().unwrap(),
            ))
            .or_default() += 1;
    }
    for r in runs {
        let outbox = t.app.store.events_after(r.id, 0, 10_000).await.unwrap();
        let stream: redis::streams::StreamRangeReply =
            c.xrange_all(run_stream(r.id)).await.unwrap();
        let ids: Vec<String> = stream
            .ids
            .iter()
            .map(|e| e.id.clone())
            .filter(|id| id.ends_with("-0"))
            .collect();
        let want: Vec<String> = outbox.iter().map(|e| format!("{}-0", e.seq)).collect();
        assert_eq!(ids, want, "run {} stream differs from its outbox", r.id);
        for e in &outbox {
            assert_eq!(
                seen.get(&(r.id.to_string(), e.seq)),
                Some(&1),
                "global stream: run {} seq {}",
                r.id,
                e.seq
            );
        }
    }
}

/// Runs `n` 4-step runs (two tool calls a step) to success, waits for the relay to catch up, and
/// checks Redis against the outbox.
async fn relayed_runs(
    t: &TestApp,
    redis: &RedisServer,
    n: usize,
    tag: &str,
) -> Vec<subagents::store::RunRecord> {
    let mut runs = vec![];
    for i in 0..n {
        runs.push(
            t.start(&format!("SCENARIO steps=4 parallel=2 run={tag}{i}"))
                .await,
        );
    }
    for r in &runs {
        assert_eq!(t.wait(r.id).await.status, RunStatus::Succeeded);
    }
    drained(t).await;
    assert_streams_match_outbox(t, redis, &runs).await;
    runs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_events_reach_redis_in_order_exactly_once() {
    let redis = RedisServer::start();
    let t = with_redis(&redis, 0).await;
    let runs = relayed_runs(&t, &redis, 20, "r").await;
    // Republishing is idempotent: mark every outbox row unrelayed and relay it all again.
    let db = sqlx::SqlitePool::connect(&t.app.settings.database_url)
        .await
        .unwrap();
    let n = sqlx::query("UPDATE sa_events SET relayed = 0")
        .execute(&db)
        .await
        .unwrap()
        .rows_affected();
    assert!(n > 100);
    drained(&t).await;
    assert_streams_match_outbox(&t, &redis, &runs).await;
    // A finished run's stream expires after the retention period.
    let mut c = redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let ttl: i64 = c.ttl(run_stream(runs[0].id)).await.unwrap();
    assert!(ttl > 0, "finished runs' streams carry a TTL");
}

/// A step's commit hands its events to the relay, which publishes them from memory instead of
/// reading them back: what Redis then holds is the outbox's rows to the byte (seq, type, commit
/// time, data), on both backends, and each exactly once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_published_from_memory_are_the_outbox_rows_to_the_byte() {
    let redis = RedisServer::start();
    for postgres in [false, true] {
        let url = redis.url();
        let db = match postgres {
            true => Some(fresh_postgres_database().await),
            false => None,
        };
        let t = spawn_app_with(Options {
            tweak: Box::new(move |s| {
                s.redis_url = Some(url);
                if let Some(db) = db {
                    s.database_url = db;
                }
            }),
            ..Default::default()
        })
        .await;
        let runs = relayed_runs(&t, &redis, 4, "m").await;
        let mut c = redis::Client::open(redis.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        for r in &runs {
            let outbox = t.app.store.events_after(r.id, 0, 1000).await.unwrap();
            let stream: redis::streams::StreamRangeReply =
                c.xrange_all(run_stream(r.id)).await.unwrap();
            let payloads: Vec<String> = stream
                .ids
                .iter()
                .filter(|e| e.id.ends_with("-0"))
                .map(|e| e.get::<String>("event").unwrap())
                .collect();
            let want: Vec<String> = outbox
                .iter()
                .map(|e| serde_json::to_string(e).unwrap())
                .collect();
            assert_eq!(payloads, want, "postgres: {postgres}");
        }
        let (memory, outbox) = t.app.redis.as_ref().unwrap().published();
        // Starts', claims' and steps' events go from memory; the outbox is read at the sweeps
        // (which may find events a commit handed over but the relay has not published yet).
        assert!(
            memory > outbox,
            "postgres: {postgres}: {memory} events from memory, {outbox} from the outbox"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_fall_back_to_the_outbox_for_ranges_redis_lacks() {
    let redis = RedisServer::start();
    let t = with_redis(&redis, 0).await;
    let r = t.run("SCENARIO steps=3").await;
    drained(&t).await;
    let outbox = t.app.store.events_after(r.id, 0, 1000).await.unwrap();
    assert_eq!(
        t.app.events_after(r.id, 0, 1000).await.unwrap(),
        outbox,
        "served from Redis"
    );
    let mut c = redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    // Trim the first three entries: the reader notices the gap and reads the outbox.
    let _: i64 = redis::cmd("XTRIM")
        .arg(run_stream(r.id))
        .arg("MINID")
        .arg("4-0")
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(t.app.events_after(r.id, 0, 1000).await.unwrap(), outbox);
    assert_eq!(
        t.app.events_after(r.id, 3, 1000).await.unwrap(),
        outbox[3..].to_vec(),
        "an intact range still comes from Redis"
    );
    let _: i64 = c.del(run_stream(r.id)).await.unwrap();
    assert_eq!(
        t.app.events_after(r.id, 2, 1000).await.unwrap(),
        outbox[2..].to_vec()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_outage_delays_events_but_loses_none() {
    let mut redis = RedisServer::start();
    let t = with_redis(&redis, 100).await;
    let mut runs = vec![];
    for i in 0..8 {
        runs.push(
            t.app
                .start_run(StartRun {
                    input: format!("SCENARIO steps=6 run=o{i}"),
                    ..Default::default()
                })
                .await
                .unwrap(),
        );
    }
    tokio::time::sleep(Duration::from_millis(250)).await;
    redis.kill();
    assert!(!t.app.redis.as_ref().unwrap().ping().await, "Redis is down");
    // Runs keep going without Redis.
    for r in &runs {
        assert_eq!(t.wait(r.id).await.status, RunStatus::Succeeded);
    }
    assert!(
        !t.app.store.unrelayed(1).await.unwrap().is_empty(),
        "events wait in the outbox"
    );
    // Readers are served from the outbox meanwhile.
    let outbox = t.app.store.events_after(runs[0].id, 0, 1000).await.unwrap();
    assert_eq!(
        t.app.events_after(runs[0].id, 0, 1000).await.unwrap(),
        outbox
    );
    redis.restart();
    drained(&t).await;
    assert_streams_match_outbox(&t, &redis, &runs).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_deltas_follow_their_durable_event_in_the_run_stream() {
    let redis = RedisServer::start();
    let t = with_redis(&redis, 300).await;
    let r = t.run("SCENARIO steps=2").await;
    assert_eq!(r.status, RunStatus::Succeeded);
    drained(&t).await;
    let mut c = redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let stream: redis::streams::StreamRangeReply = c.xrange_all(run_stream(r.id)).await.unwrap();
    let deltas: Vec<(String, serde_json::Value)> = stream
        .ids
        .iter()
        .filter(|e| !e.id.ends_with("-0"))
        .map(|e| {
            let d = e.get::<String>("delta").unwrap();
            (e.id.clone(), serde_json::from_str(&d).unwrap())
        })
        .collect();
    let text: String = deltas
        .iter()
        .filter(|(_, d)| d["step"] == 2)
        .filter_map(|(_, d)| d["text"].as_str())
        .collect();
    assert_eq!(
        text, "DONE after 2 steps",
        "the final answer streamed as deltas: {deltas:?}"
    );
    let args: String = deltas
        .iter()
        .filter(|(_, d)| d["step"] == 1)
        .filter_map(|(_, d)| d["tool_call"]["arguments"].as_str())
        .collect();
    assert_eq!(args, r#"{"text":"step 1 call 1"}"#, "{deltas:?}");
    // Each step's sit right after its durable events, numbered N-1, N-2, …
    for step in [1, 2] {
        let of: Vec<&String> = deltas
            .iter()
            .filter(|(_, d)| d["step"] == step)
            .map(|(id, _)| id)
            .collect();
        let n = of[0].split('-').next().unwrap().to_owned();
        for (k, id) in of.iter().enumerate() {
            assert_eq!(*id, &format!("{n}-{}", k + 1));
        }
    }
    // Durable readers never see them, and the outbox knows nothing of them.
    let outbox = t.app.store.events_after(r.id, 0, 1000).await.unwrap();
    assert!(outbox.iter().all(|e| e.kind != "model.delta"));
    assert_eq!(t.app.events_after(r.id, 0, 1000).await.unwrap(), outbox);
    assert_streams_match_outbox(&t, &redis, std::slice::from_ref(&r)).await;
}

/// Budgets live in Redis while it is up; during an outage the database counts them and runs
/// go on (nothing fails for want of Redis).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_outage_moves_the_budgets_to_the_database() {
    let mut redis = RedisServer::start();
    let t = with_redis(&redis, 0).await;
    let owner = subagents::app::LOCAL_OWNER;
    t.app
        .store
        .set_owner_budgets(&[(
            owner.into(),
            subagents::store::OwnerBudget {
                rpm: Some(1000),
                tpm: None,
            },
        )])
        .await
        .unwrap();
    let db = sqlx::SqlitePool::connect(&t.app.settings.database_url)
        .await
        .unwrap();
    let counted = |db: sqlx::SqlitePool| async move {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM sa_rate_log WHERE key = 'owner:' || $1")
            .bind(owner)
            .fetch_one(&db)
            .await
            .unwrap()
    };
    let first = t.start("SCENARIO steps=2 run=before").await;
    assert_eq!(t.wait(first.id).await.status, RunStatus::Succeeded);
    let mut c = redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let in_redis: i64 = redis::cmd("ZCARD")
        .arg(format!("subagents:budget:owner:{owner}"))
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(in_redis, 2, "both calls counted in Redis");
    assert_eq!(counted(db.clone()).await, 0, "none in the database");
    let budgets = &t.app.engine.budgets;
    assert_eq!(budgets.redis_failures(), 0);
    redis.kill();
    let t0 = Instant::now();
    let second = t.start("SCENARIO steps=2 run=during").await;
    assert_eq!(t.wait(second.id).await.status, RunStatus::Succeeded);
    assert_eq!(
        counted(db.clone()).await,
        2,
        "the database counted the calls made during the outage"
    );
    // One failed attempt per back-off period, not one per call (a loaded machine may take
    // longer than one period for the run).
    let periods =
        1 + (t0.elapsed().as_secs_f64() / subagents::budget::REDIS_BACKOFF.as_secs_f64()) as u64;
    let failed = budgets.redis_failures();
    assert!(
        (1..=periods).contains(&failed),
        "{failed} failed attempts in {:?}",
        t0.elapsed()
    );
}

/// The relay keeps its PostgreSQL connection between passes; a server restart cuts it. After
/// the restart the relay goes on, on a new connection: every event of runs that lived through
/// the outage reaches Redis, in order, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_goes_on_after_a_postgresql_restart() {
    let redis = RedisServer::start();
    let pg = PrivatePostgres::start();
    let (url, redis_url) = (pg.url(), redis.url());
    let t = spawn_app_with(Options {
        latency: Duration::from_millis(100),
        tweak: Box::new(move |s| {
            s.database_url = url;
            s.redis_url = Some(redis_url);
            // Longer than the outage: renewals retry through it instead of giving the lease up.
            s.lease_ttl_secs = 10.0;
        }),
        ..Default::default()
    })
    .await;
    let mut runs = vec![];
    for i in 0..3 {
        runs.push(
            t.start(&format!("SCENARIO steps=8 tool=echo run=rr{i}"))
                .await,
        );
    }
    // The relay has used (and kept) its connection before the restart.
    let deadline = Instant::now() + Duration::from_secs(60);
    while t
        .app
        .store
        .events_after(runs[0].id, 0, 100)
        .await
        .unwrap()
        .len()
        < 4
    {
        assert!(Instant::now() < deadline, "the runs did not get going");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drained(&t).await;
    pg.down();
    tokio::time::sleep(Duration::from_secs(1)).await;
    pg.up();
    for r in &runs {
        assert_eq!(t.wait(r.id).await.status, RunStatus::Succeeded);
    }
    drained(&t).await;
    assert_streams_match_outbox(&t, &redis, &runs).await;
}
