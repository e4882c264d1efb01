//! The store's contract — fencing, idempotent appends, gap-free sequences, one active run per
//! thread, the lease lifecycle, enqueue order, idempotency keys, orphans — as one conformance
//! suite run against both backends: a real SQLite file and a fresh PostgreSQL database.

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use subagents::ids::{OwnerId, RunId, ThreadId};
use subagents::model::Message;
use subagents::queue::new_job_id;
use subagents::store::*;

/// A backend under test; keeps its temp dir alive.
pub struct Backend {
    pub store: Arc<dyn Store>,
    /// The same database, to put apalis's jobs in the states its workers would.
    jobs: Jobs,
    /// Where the database is, to open a second store on it.
    url: String,
    _dir: Option<tempfile::TempDir>,
}

/// apalis's job table on either backend.
enum Jobs {
    Sqlite(sqlx::SqlitePool),
    Postgres(sqlx::PgPool),
}

impl Backend {
    /// A second store on the same database, of a process without a relay to Redis.
    async fn without_relay(&self) -> Arc<dyn Store> {
        match &self.jobs {
            Jobs::Sqlite(_) => Arc::new(
                SqliteStore::connect(&self.url)
                    .await
                    .unwrap()
                    .relaying(false),
            ),
            Jobs::Postgres(_) => {
                Arc::new(PgStore::connect(&self.url).await.unwrap().relaying(false))
            }
        }
    }

    /// A second store on the same database, as another process would open it.
    async fn another(&self) -> Arc<dyn Store> {
        match &self.jobs {
            Jobs::Sqlite(_) => Arc::new(SqliteStore::connect(&self.url).await.unwrap()),
            Jobs::Postgres(_) => Arc::new(PgStore::connect(&self.url).await.unwrap()),
        }
    }

    /// Runs one statement on the database directly, as an operator's hand (or another build)
    /// might.
    async fn execute(&self, sql: &str) {
        match &self.jobs {
            Jobs::Sqlite(p) => drop(
                sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
                    .execute(p)
                    .await
                    .unwrap(),
            ),
            Jobs::Postgres(p) => drop(
                sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
                    .execute(p)
                    .await
                    .unwrap(),
            ),
        }
    }

    /// The single number `sql` answers.
    async fn count(&self, sql: &str) -> i64 {
        match &self.jobs {
            Jobs::Sqlite(p) => sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
                .fetch_one(p)
                .await
                .unwrap(),
            Jobs::Postgres(p) => sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
                .fetch_one(p)
                .await
                .unwrap(),
        }
    }

    /// Puts every event back in the outbox, as if no relay had taken any.
    async fn unmark_all_events(&self) {
        match &self.jobs {
            Jobs::Sqlite(p) => drop(
                sqlx::query("UPDATE sa_events SET relayed = 0")
                    .execute(p)
                    .await
                    .unwrap(),
            ),
            Jobs::Postgres(p) => drop(
                sqlx::query("UPDATE sa_events SET relayed = 0")
                    .execute(p)
                    .await
                    .unwrap(),
            ),
        }
    }

    /// apalis's job and worker tables.
    fn apalis_tables(&self) -> (&'static str, &'static str) {
        match self.jobs {
            Jobs::Sqlite(_) => ("Jobs", "Workers"),
            Jobs::Postgres(_) => ("apalis.jobs", "apalis.workers"),
        }
    }

    /// What a run's end answers of its thread's next run when that is `next`: SQLite reads it
    /// in the end's commit, PostgreSQL after it.
    fn next_named(&self, next: Option<RunId>) -> NextQueued {
        match self.jobs {
            Jobs::Sqlite(_) => NextQueued::Known(next),
            Jobs::Postgres(_) => NextQueued::Unknown,
        }
    }

    /// Ends the leased run (cancelled): what its end answered.
    async fn end_cancelled(&self, lease: &Lease) -> Ending {
        self.checkpoint(
            lease,
            Checkpoint {
                finish: Some(Finish::Cancelled),
                ..Default::default()
            },
        )
        .await
        .unwrap()
        .expect("a terminal checkpoint answers what its end saw")
    }

    /// Sets a job's apalis status, as a worker fetching (`Queued`) or starting (`Running`) it does.
    async fn set_job_status(&self, job_id: &str, status: &str) {
        let n = match &self.jobs {
            Jobs::Sqlite(p) => sqlx::query("UPDATE Jobs SET status = ? WHERE id = ?")
                .bind(status)
                .bind(job_id)
                .execute(p)
                .await
                .unwrap()
                .rows_affected(),
            Jobs::Postgres(p) => sqlx::query("UPDATE apalis.jobs SET status = $1 WHERE id = $2")
                .bind(status)
                .bind(job_id)
                .execute(p)
                .await
                .unwrap()
                .rows_affected(),
        };
        assert_eq!(n, 1, "job {job_id} exists");
    }

    /// A job's status, priority and body, as apalis would fetch them.
    async fn job(&self, job_id: &str) -> Option<(String, i64, Vec<u8>, String)> {
        match &self.jobs {
            Jobs::Sqlite(p) => {
                sqlx::query_as("SELECT status, priority, job, job_type FROM Jobs WHERE id = ?")
                    .bind(job_id)
                    .fetch_optional(p)
                    .await
                    .unwrap()
            }
            Jobs::Postgres(p) => sqlx::query_as::<_, (String, i32, Vec<u8>, String)>(
                "SELECT status, priority, job, job_type FROM apalis.jobs WHERE id = $1",
            )
            .bind(job_id)
            .fetch_optional(p)
            .await
            .unwrap()
            .map(|(s, p, j, t)| (s, i64::from(p), j, t)),
        }
    }
}

impl std::ops::Deref for Backend {
    type Target = dyn Store;
    fn deref(&self) -> &(dyn Store + 'static) {
        self.store.as_ref()
    }
}

pub async fn sqlite() -> Backend {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("s.db").display());
    let s = SqliteStore::connect(&url).await.unwrap();
    let jobs = Jobs::Sqlite(s.pool().clone());
    Backend {
        store: Arc::new(s),
        jobs,
        url,
        _dir: Some(dir),
    }
}

pub async fn postgres() -> Backend {
    let url = crate::support::fresh_postgres_database().await;
    let s = PgStore::connect(&url).await.unwrap();
    let jobs = Jobs::Postgres(s.pool().clone());
    Backend {
        store: Arc::new(s),
        jobs,
        url,
        _dir: None,
    }
}

/// Generates one test per backend from one async fn taking the backend.
macro_rules! conformance {
    ($($name:ident),* $(,)?) => {
        mod sqlite_backend {
            $(#[tokio::test] async fn $name() { super::$name(super::sqlite().await).await })*
        }
        mod postgres_backend {
            $(#[tokio::test] async fn $name() { super::$name(super::postgres().await).await })*
        }
    };
}

conformance!(
    a_runs_view_extras_come_in_one_read,
    approvals_park_wake_and_answer_once,
    compactions_are_fenced_idempotent_and_where_contexts_start,
    a_claim_brings_the_context_its_run_rebuilds_from,
    a_stale_epoch_cannot_write,
    checkpoints_committed_together_are_each_fenced_by_their_own_lease,
    a_progress_commit_that_fails_midway_leaves_nothing_behind,
    a_start_past_its_owners_cap_of_queued_runs_is_refused,
    leases_renewed_together_are_each_fenced_by_their_own_epoch,
    renewals_beside_checkpoints_never_deadlock,
    appends_are_idempotent_and_sequences_gap_free,
    terminal_states_never_change,
    a_stored_name_the_code_does_not_know_is_a_corrupt_row,
    a_message_is_delivered_once_and_holds_back_the_final_answer,
    a_fork_shares_its_history_up_to_its_point_without_copying_it,
    an_agent_version_is_pinned_with_the_run_and_kept_once,
    a_run_pins_each_value_once_and_the_first_pin_holds,
    webhook_events_are_queued_with_their_commit_and_delivered_once_each,
    an_interrupt_waits_for_the_boundary_and_a_cancel_does_not,
    the_database_enforces_one_active_run_per_thread,
    a_notified_worker_takes_a_job_and_claims_its_run_in_one_go,
    enqueued_runs_wait_for_the_thread_and_go_in_order,
    a_start_writes_the_runs_job_with_its_place_in_the_queue,
    a_start_hands_its_job_to_a_local_worker_only_when_it_is_next_in_line,
    idempotency_keys_return_the_first_run,
    runs_whose_workers_keep_dying_fail_as_lost,
    parking_and_releases_do_not_spend_the_crash_budget,
    orphans_are_found_after_the_grace_period,
    parked_runs_are_claimed_again_and_cancelled_at_once,
    a_pending_cancel_refuses_the_park,
    a_childs_end_reports_and_wakes_in_the_same_commit,
    a_live_parent_hears_of_every_childs_end,
    a_park_on_ended_runs_is_due_at_once,
    the_transition_table_is_enforced,
    a_runs_end_ends_its_attached_children_in_the_same_commit,
    listing_and_tree_queries,
    a_runs_rank_counts_the_queued_runs_ahead_of_it_in_its_owners_queue,
    the_outbox_marks_what_the_relay_reports_and_nothing_else,
    relays_marking_the_same_events_at_once_both_succeed,
    a_store_without_a_relay_writes_its_events_as_relayed,
    the_apis_reads_never_wait_for_an_open_write,
);

/// Under a steady stream of commits SQLite's write-ahead log still starts again from its
/// beginning (its header's checkpoint sequence moves) once it passed the checkpointer's
/// threshold (16,384 pages): a passive checkpoint on a reading connection never found all of
/// the log copied while commits kept coming, so the log grew by every commit (363 MB after
/// 800 short runs in `serve`); the checkpointer now also folds it on the writing connection,
/// where no commit lands during it, and the next commit restarts the log.
#[tokio::test]
async fn sqlite_starts_its_write_ahead_log_again_under_a_steady_stream_of_commits() {
    use std::io::Read;
    let s = sqlite().await;
    let wal = format!("{}-wal", s.url.trim_start_matches("sqlite://"));
    // The log file's length and its header's checkpoint sequence (bytes 12..16).
    let header = move || -> Option<(u64, u32)> {
        let mut f = std::fs::File::open(&wal).ok()?;
        let len = f.metadata().ok()?.len();
        let mut b = [0u8; 16];
        f.read_exact(&mut b).ok()?;
        Some((len, u32::from_be_bytes([b[12], b[13], b[14], b[15]])))
    };
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (store, stop) = (s.store.clone(), stop.clone());
        tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let mut run = new_run(&ThreadId::generate());
                run.input = "x".repeat(64 * 1024);
                store.create_run(run).await.unwrap();
                n += 1;
            }
            n
        })
    };
    // Near the threshold (64 MB of 4 KB pages), then a new sequence: the first log past it.
    // Without the fold on the writer the log grew past 12 GB in the 90 s this once waited: it
    // gives up at 1 GB or a minute.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let mut past: Option<u32> = None;
    let restarted = loop {
        if std::time::Instant::now() > deadline {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        let Some((len, seq)) = header() else { continue };
        if len > 1 << 30 {
            break false;
        }
        match past {
            None if len > 60 << 20 => past = Some(seq),
            Some(at) if seq != at => break true,
            _ => {}
        }
    };
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let commits = writer.await.unwrap();
    assert!(
        restarted,
        "the log never started again after it passed 60 MB ({commits} commits, {:?})",
        header()
    );
}

/// A run's end committed by one process wakes the waiters of another at once on PostgreSQL
/// (LISTEN/NOTIFY), with no Redis: without it they hear of it only at their re-check timer. The
/// other store's notifier is fired by nothing else here, so the wait cannot pass any other way.
#[tokio::test]
async fn postgres_announces_a_runs_end_to_the_other_processes() {
    let s = postgres().await;
    let other = s.another().await;
    let ends = [
        Finish::Succeeded {
            result: "r".into(),
            forced: false,
        },
        Finish::Cancelled,
    ];
    for finish in ends {
        let (_, lease) = claimed_run(&s, Duration::from_secs(10)).await;
        let run = lease.run_id;
        let signal = other.subscribe(run);
        let heard = signal.notified();
        tokio::pin!(heard);
        heard.as_mut().enable();
        s.checkpoint(
            &lease,
            Checkpoint {
                finish: Some(finish),
                ..Default::default()
            },
        )
        .await
        .unwrap();
        tokio::time::timeout(Duration::from_secs(20), heard)
            .await
            .unwrap_or_else(|_| panic!("the other process never heard run {run} end"));
    }
}

/// A `BEGIN` whose caller is dropped before the server answers (apalis's fetch when a worker
/// stops, a future a `select!` gives up) leaves no transaction behind on the pooled connection:
/// the next write through the pool commits and is seen elsewhere. sqlx-postgres 0.9.0 left the
/// server inside a transaction it neither counted nor rolled back, and the pool tested every
/// connection for one; 0.9.1 rolls it back (transact-rs/sqlx#4394), which lets the pool skip
/// that test (`store::postgres::pool_options`). This pins the fix we rely on.
#[tokio::test]
async fn a_cancelled_begin_leaves_no_transaction_on_its_pooled_connection() {
    use subagents::store::postgres::{Liveness, pool_options};
    let url = crate::support::fresh_postgres_database().await;
    let options = subagents::store::postgres::connect_options(&url).unwrap();
    let mut outside: sqlx::PgConnection = sqlx::ConnectOptions::connect(&options).await.unwrap();
    sqlx::raw_sql("CREATE TABLE left_open (x INT)")
        .execute(&mut outside)
        .await
        .unwrap();
    let pool = pool_options(std::sync::Arc::new(Liveness::default()))
        .max_connections(1)
        .connect_with(options)
        .await
        .unwrap();
    {
        let mut conn = pool.acquire().await.unwrap();
        // The server answers this BEGIN a second late (the sleep rides in the same
        // simple query); its caller gives up long before.
        let begin = sqlx::Connection::begin_with(&mut *conn, "BEGIN; SELECT pg_sleep(1)");
        assert!(
            tokio::time::timeout(Duration::from_millis(50), begin)
                .await
                .is_err(),
            "the BEGIN was answered before its caller gave up"
        );
    }
    sqlx::query("INSERT INTO left_open VALUES (1)")
        .execute(&pool)
        .await
        .unwrap();
    let seen: i64 = sqlx::query_scalar("SELECT count(*) FROM left_open")
        .fetch_one(&mut outside)
        .await
        .unwrap();
    assert_eq!(seen, 1, "the write through the pool committed");
}

/// A PostgreSQL connection the server dropped while it idled in the pool (a restart, an
/// administrator's `pg_terminate_backend`) is replaced before a statement meets it: no caller
/// sees the dead connection. A connection idle for a second or more is always tested, whether or
/// not the store heard the cut.
#[tokio::test]
async fn postgres_connections_dropped_while_idle_are_replaced_before_use() {
    use sqlx::Connection;
    let s = postgres().await;
    let Jobs::Postgres(pool) = &s.jobs else {
        unreachable!()
    };
    let t = ThreadId::generate();
    let run = s.create_run(new_run(&t)).await.unwrap().run;
    // A few connections in use at once, then all idle in the pool.
    let held: Vec<_> = futures::future::join_all((0..3).map(|_| pool.acquire()))
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    drop(held);
    tokio::time::sleep(Duration::from_millis(300)).await; // their release pings are done
    let idle = pool.num_idle();
    assert!(idle >= 3, "{idle} idle connections");
    tokio::time::sleep(Duration::from_millis(1200)).await;
    // Another session ends every backend of this database but its own, as a restart would.
    let mut admin = sqlx::PgConnection::connect(&s.url).await.unwrap();
    let ended = end_every_backend(&mut admin).await;
    assert!(
        ended >= idle as i64,
        "ended {ended} of {idle} idle connections"
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Every idle connection is dead; each use meets one of them first, and still answers.
    for i in 0..idle + 1 {
        let seen = s
            .get_run(run.id)
            .await
            .unwrap_or_else(|e| panic!("read {i} met a dead connection: {e}"));
        assert_eq!(seen.map(|r| r.id), Some(run.id));
        let held: Vec<_> = futures::future::join_all((0..3).map(|_| pool.acquire()))
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
        drop(held);
    }
    s.create_run(new_run(&ThreadId::generate()))
        .await
        .expect("a start after the connections were dropped");
}

/// A connection used a moment ago is taken from the pool untested (its release ping just
/// passed), so a cut must reach the pool another way: the store's listening connection hears
/// it and the pool tests every connection idle since. Here every backend is ended a moment
/// after the connections went back; once the store has heard the cut, no use meets a dead one,
/// whether it idled in the pool or was kept aside between a run's statements (`store::kept`).
#[tokio::test]
async fn postgres_connections_cut_a_moment_after_use_are_replaced_once_the_cut_is_heard() {
    use sqlx::Connection;
    let url = crate::support::fresh_postgres_database().await;
    let store = PgStore::connect(&url).await.unwrap();
    let run = store
        .create_run(new_run(&ThreadId::generate()))
        .await
        .unwrap()
        .run;
    // Starts at once: each keeps its connection aside for the next short statement
    // (`store::kept`), out of the pool and past its release ping.
    for r in
        futures::future::join_all((0..4).map(|_| store.create_run(new_run(&ThreadId::generate()))))
            .await
    {
        r.unwrap();
    }
    let held: Vec<_> = futures::future::join_all((0..3).map(|_| store.pool().acquire()))
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    drop(held);
    tokio::time::sleep(Duration::from_millis(100)).await; // their release pings are done
    let idle = store.pool().num_idle();
    assert!(idle >= 3, "{idle} idle connections");
    let heard = store.liveness().cuts_heard();
    let mut admin = sqlx::PgConnection::connect(&url).await.unwrap();
    let ended = end_every_backend(&mut admin).await;
    assert!(
        ended > idle as i64,
        "ended {ended}: the idle ones and the listener"
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while store.liveness().cuts_heard() == heard {
        assert!(
            std::time::Instant::now() < deadline,
            "the cut was never heard"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for i in 0..idle + 1 {
        let seen = store
            .get_run(run.id)
            .await
            .unwrap_or_else(|e| panic!("read {i} met a dead connection: {e}"));
        assert_eq!(seen.map(|r| r.id), Some(run.id));
    }
    // The kept connections were cut too: each start and claim still answers.
    for i in 0..6 {
        let started = store
            .create_run(new_run(&ThreadId::generate()))
            .await
            .unwrap_or_else(|e| panic!("start {i} after the cut: {e}"));
        let claimed = store
            .claim_run(started.run.id, "w1", Duration::from_secs(60))
            .await
            .unwrap_or_else(|e| panic!("claim {i} after the cut: {e}"));
        assert!(matches!(claimed, Claim::Acquired(..)), "claim {i}");
    }
}

/// Ends every backend of this database but `admin`'s own, as a restart would; how many.
async fn end_every_backend(admin: &mut sqlx::PgConnection) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid()) AS k",
    )
    .fetch_one(admin)
    .await
    .unwrap()
}

/// Checkpoints commit through committers that keep a connection between batches instead of
/// taking a tested one from the pool each time. A restart (here every backend ended with
/// `pg_terminate_backend`) leaves each committer holding a dead connection: the next checkpoint
/// of every run, alone or in a group, within the second a kept connection is trusted untested
/// and after it, must still commit exactly once, with no error reaching the run.
#[tokio::test]
async fn postgres_committers_survive_their_kept_connections_being_cut() {
    use sqlx::Connection;
    let s = postgres().await;
    let mut leases = vec![];
    for _ in 0..12 {
        leases.push(claimed_run(&s, Duration::from_secs(60)).await);
    }
    let mut admin = sqlx::PgConnection::connect(&s.url).await.unwrap();
    let cp = |round: u32, lease: &Lease| Checkpoint {
        messages: vec![msg(lease.run_id, &format!("m{round}"))],
        events: vec![step_started(round), step_completed(round)],
        step: Some(round + 1),
        ..Default::default()
    };
    let mut round = 0;
    // Alone (one run at a time: each goes to a committer as a batch of one), then all at once
    // (groups), then alone after the kept connections sat idle past the untested second.
    for (together, idle) in [(false, 0), (true, 0), (false, 1300), (true, 1300)] {
        // Every committer busy at once, so each takes (and keeps) a connection.
        for r in
            futures::future::join_all(leases.iter().map(|(_, l)| s.checkpoint(l, cp(round, l))))
                .await
        {
            r.unwrap_or_else(|e| panic!("round {round}, before the cut: {e}"));
        }
        round += 1;
        let ended = end_every_backend(&mut admin).await;
        assert!(
            ended > 0,
            "round {round}: the committers' connections were cut"
        );
        tokio::time::sleep(Duration::from_millis(100 + idle)).await;
        if together {
            for r in
                futures::future::join_all(leases.iter().map(|(_, l)| s.checkpoint(l, cp(round, l))))
                    .await
            {
                r.unwrap_or_else(|e| panic!("round {round}, together after the cut: {e}"));
            }
        } else {
            for (_, l) in &leases {
                s.checkpoint(l, cp(round, l))
                    .await
                    .unwrap_or_else(|e| panic!("round {round}, alone after the cut: {e}"));
            }
        }
        round += 1;
    }
    for (t, lease) in &leases {
        let keys: Vec<String> = s
            .thread_messages(t, 100)
            .await
            .unwrap()
            .iter()
            .map(|m| m.key.rsplit(':').next().unwrap().to_owned())
            .collect();
        assert_eq!(
            keys,
            (0..round).map(|r| format!("m{r}")).collect::<Vec<_>>(),
            "each step's message once, in order"
        );
        let seqs: Vec<u64> = s
            .events_after(lease.run_id, 0, 1000)
            .await
            .unwrap()
            .iter()
            .map(|e| e.seq)
            .collect();
        assert_eq!(
            seqs,
            (1..=2 + 2 * u64::from(round)).collect::<Vec<u64>>(),
            "gap-free, and no step's events twice"
        );
        assert_eq!(s.get_run(lease.run_id).await.unwrap().unwrap().step, round);
    }
}

fn new_run(thread: &ThreadId) -> NewRun {
    NewRun {
        id: RunId::new(),
        thread_id: thread.clone(),
        owner: "o".into(),
        agent: "general-purpose".into(),
        input: "hi".into(),
        metadata: json!({}),
        limits: RunLimits {
            max_steps: 5,
            timeout_secs: 60,
            max_total_tokens: None,
            max_total_steps: None,
            compact_at: None,
            output: None,
        },
        parent_run_id: None,
        tree: TreePosition::default(),
        job_id: new_job_id(),
        if_busy: IfBusy::Reject,
        idempotency_key: None,
        retry_of: None,
        priority: 3,
        place: QueuePlace::Back,
        agent_version: Some("0123456789ab".into()),
        held_by: None,
        max_queued: 0,
    }
}

/// A new run on a new thread, claimed by `w1` for `ttl`.
async fn claimed_run(s: &Backend, ttl: Duration) -> (ThreadId, Lease) {
    let t = ThreadId::generate();
    let run = s.create_run(new_run(&t)).await.unwrap().run;
    let Claim::Acquired(lease, _) = s.claim_run(run.id, "w1", ttl).await.unwrap() else {
        panic!("a new run is claimable")
    };
    (t, lease)
}

fn msg(run: RunId, key: &str) -> NewMessage {
    NewMessage {
        step: 1,
        key: format!("{run}:{key}"),
        message: Message::User {
            content: key.into(),
        },
    }
}

async fn a_stale_epoch_cannot_write(s: Backend) {
    let t = ThreadId::generate();
    let run = s.create_run(new_run(&t)).await.unwrap().run;
    let Claim::Acquired(old, _) = s
        .claim_run(run.id, "w1", Duration::from_millis(100))
        .await
        .unwrap()
    else {
        panic!()
    };
    // Not claimable while the lease is valid.
    assert!(matches!(
        s.claim_run(run.id, "w2", Duration::from_secs(10))
            .await
            .unwrap(),
        Claim::NotClaimable(Some(RunStatus::Running))
    ));
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(
        s.expire_leases(5).await.unwrap(),
        [Expired {
            run_id: run.id,
            gave_up: false
        }]
    );
    let Claim::Acquired(new, rec) = s
        .claim_run(run.id, "w2", Duration::from_secs(10))
        .await
        .unwrap()
    else {
        panic!()
    };
    assert_eq!(new.epoch, old.epoch + 1);
    assert_eq!(rec.attempts, 2);
    let err = s
        .checkpoint(
            &old,
            Checkpoint {
                messages: vec![msg(run.id, "a")],
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::LeaseLost(_)), "{err}");
    assert!(matches!(
        s.renew_lease(&old).await.unwrap_err(),
        StoreError::LeaseLost(_)
    ));
    // Nor can it end the run (an end that tells nobody, which SQLite tries in one command
    // before the long way): no row, no event, no status.
    let seq = s.get_run(run.id).await.unwrap().unwrap().event_seq;
    let err = s
        .checkpoint(
            &old,
            Checkpoint {
                messages: vec![msg(run.id, "z")],
                ..succeeded(vec![step_started(1)])
            },
        )
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::LeaseLost(_)), "{err}");
    let after = s.get_run(run.id).await.unwrap().unwrap();
    assert_eq!(
        (after.status, after.event_seq, after.lease_epoch),
        (RunStatus::Running, seq, new.epoch)
    );
    assert!(
        s.events_after(run.id, seq, 100).await.unwrap().is_empty(),
        "a zombie's end wrote events"
    );
    // The zombie's writes left nothing behind.
    assert!(s.thread_messages(&t, 100_000).await.unwrap().is_empty());
    s.checkpoint(
        &new,
        Checkpoint {
            messages: vec![msg(run.id, "a")],
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(s.thread_messages(&t, 100_000).await.unwrap().len(), 1);
    // Nor can a lease on a run that does not exist write anything (PostgreSQL's history
    // tables have no foreign keys: the fence alone keeps them whole).
    let ghost = Lease {
        run_id: RunId::new(),
        epoch: 1,
        owner: "w3".into(),
        ttl: Duration::from_secs(10),
        child: false,
    };
    let event = step_started(1);
    let err = s
        .checkpoint(
            &ghost,
            Checkpoint {
                messages: vec![msg(ghost.run_id, "g")],
                events: vec![event],
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::LeaseLost(_)), "{err}");
    assert!(
        s.events_after(ghost.run_id, 0, 100)
            .await
            .unwrap()
            .is_empty(),
        "no event of a run that does not exist"
    );
    assert_eq!(
        s.thread_messages(&t, 100_000).await.unwrap().len(),
        1,
        "no message either"
    );
}

/// Many runs' lease renewals at once (PostgreSQL renews them in one statement per group):
/// each is fenced by its own epoch (a stale one renews nothing and says so), each hears of a
/// cancel requested on its own run only, and a renewed lease really moved.
async fn leases_renewed_together_are_each_fenced_by_their_own_epoch(s: Backend) {
    let mut leases = vec![];
    for i in 0..40 {
        let (_, mut lease) = claimed_run(&s, Duration::from_secs(2)).await;
        let run = s.get_run(lease.run_id).await.unwrap().unwrap();
        let stale = i % 5 == 0;
        if i % 7 == 3 && !stale {
            assert_eq!(
                s.request_cancel(run.id).await.unwrap(),
                CancelOutcome::Requested
            );
        }
        if stale {
            lease.epoch -= 1;
        }
        leases.push((i, stale, lease));
    }
    for round in 0..3 {
        if round > 0 {
            tokio::time::sleep(Duration::from_millis(1200)).await;
        }
        let before = chrono::Utc::now() - chrono::Duration::milliseconds(5);
        let answers =
            futures::future::join_all(leases.iter().map(|(_, _, l)| s.renew_lease(l))).await;
        for ((i, stale, lease), answer) in leases.iter().zip(answers) {
            match answer {
                Err(StoreError::LeaseLost(id)) => {
                    assert!(*stale, "run {i}: a current lease was refused");
                    assert_eq!(id, lease.run_id);
                }
                Ok(st) => {
                    assert!(!stale, "run {i}: a stale lease was renewed");
                    assert_eq!(
                        st.cancel_requested,
                        i % 7 == 3,
                        "run {i}: another run's cancel, or its own missed"
                    );
                    let r = s.get_run(lease.run_id).await.unwrap().unwrap();
                    assert!(
                        r.heartbeat_at.is_some_and(|h| h >= before),
                        "run {i}: no heartbeat recorded: {:?}",
                        r.heartbeat_at
                    );
                }
                Err(e) => panic!("run {i}: {e}"),
            }
        }
    }
    // 2.4 s after the claims, with a 2 s lease: only the leases never renewed have expired.
    let mut expired: Vec<RunId> = s
        .expire_leases(5)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.run_id)
        .collect();
    let mut want: Vec<RunId> = leases
        .iter()
        .filter(|(_, stale, _)| *stale)
        .map(|(_, _, l)| l.run_id)
        .collect();
    expired.sort();
    want.sort();
    assert_eq!(
        expired, want,
        "renewed leases moved, the stale ones did not"
    );
}

/// A busy worker: every run's heartbeat renews beside its steps' checkpoints, both in groups
/// and in opposite orders. Neither waits on the other into a deadlock (a renewal group that
/// waited for a row while holding others did, at 10,000 runs in flight): every renewal is
/// answered and every checkpoint commits.
async fn renewals_beside_checkpoints_never_deadlock(s: Backend) {
    let mut leases = vec![];
    for _ in 0..64 {
        leases.push(claimed_run(&s, Duration::from_secs(30)).await.1);
    }
    for round in 0..12u32 {
        let checkpoints = futures::future::join_all(leases.iter().map(|lease| {
            let cp = Checkpoint {
                messages: vec![msg(lease.run_id, &format!("m{round}"))],
                events: vec![step_started(round)],
                step: Some(round + 1),
                ..Default::default()
            };
            s.checkpoint(lease, cp)
        }));
        let renewals =
            futures::future::join_all(leases.iter().rev().map(|lease| s.renew_lease(lease)));
        let (checkpoints, renewals) = tokio::join!(checkpoints, renewals);
        for r in checkpoints {
            r.unwrap_or_else(|e| panic!("round {round}: a checkpoint failed: {e}"));
        }
        for r in renewals {
            let st = r.unwrap_or_else(|e| panic!("round {round}: a renewal failed: {e}"));
            assert!(!st.cancel_requested);
        }
    }
    for lease in &leases {
        assert_eq!(s.get_run(lease.run_id).await.unwrap().unwrap().step, 12);
    }
}

/// Many runs' checkpoints at once go to the database in groups: each item is still fenced by
/// its own lease (a lost one writes nothing and says so, the others commit), seqs stay gap-free
/// and every caller hears back only once its item is durable.
async fn checkpoints_committed_together_are_each_fenced_by_their_own_lease(s: Backend) {
    let mut leases = vec![];
    for _ in 0..40 {
        leases.push(claimed_run(&s, Duration::from_secs(30)).await);
    }
    // Every fifth lease is stale: an epoch older than the run's.
    let stale: Vec<bool> = (0..leases.len()).map(|i| i % 5 == 0).collect();
    let mut used = vec![];
    for ((t, lease), stale) in leases.iter().zip(&stale) {
        if *stale {
            let mut old = lease.clone();
            old.epoch -= 1;
            used.push((t.clone(), old));
        } else {
            used.push((t.clone(), lease.clone()));
        }
    }
    for round in 0..3 {
        let writes = used.iter().map(|(_, lease)| {
            let cp = Checkpoint {
                messages: vec![msg(lease.run_id, &format!("m{round}"))],
                events: vec![step_started(round), step_completed(round)],
                step: Some(round + 1),
                ..Default::default()
            };
            s.checkpoint(lease, cp)
        });
        let results = futures::future::join_all(writes).await;
        for (r, stale) in results.iter().zip(&stale) {
            match (r, stale) {
                (Ok(None), false) => {}
                (Err(StoreError::LeaseLost(_)), true) => {}
                other => panic!("round {round}: {other:?}"),
            }
        }
    }
    for ((t, lease), stale) in used.iter().zip(&stale) {
        let msgs = s.thread_messages(t, 100).await.unwrap();
        let events = s.events_after(lease.run_id, 0, 100).await.unwrap();
        let run = s.get_run(lease.run_id).await.unwrap().unwrap();
        if *stale {
            assert!(msgs.is_empty(), "a stale lease wrote messages");
            assert_eq!(
                events.len(),
                2,
                "only run.queued and run.started: {events:?}"
            );
            assert_eq!(run.step, 0);
        } else {
            assert_eq!(
                msgs.iter()
                    .map(|m| m.key.rsplit(':').next().unwrap().to_owned())
                    .collect::<Vec<_>>(),
                ["m0", "m1", "m2"]
            );
            let seqs: Vec<u64> = events.iter().map(|e| e.seq).collect();
            assert_eq!(seqs, (1..=8).collect::<Vec<u64>>(), "gap-free seqs");
            assert_eq!(run.step, 3);
        }
    }
}

/// A progress checkpoint whose events collide with a row already there (planted here, as
/// corruption or a bug would) fails after its fence and its messages went in: none of it
/// lands, and the connection it failed on is left in no transaction. SQLite sends a progress
/// commit's statements, `BEGIN` to `COMMIT`, as one command, so the failure stops that command
/// midway; the checkpoint after it commits, and another process sees it.
async fn a_progress_commit_that_fails_midway_leaves_nothing_behind(s: Backend) {
    let (t, lease) = claimed_run(&s, Duration::from_secs(30)).await;
    let before = s.get_run(lease.run_id).await.unwrap().unwrap();
    let planted = before.event_seq + 2;
    s.execute(&format!(
        "INSERT INTO sa_events (run_id, seq, type, data, created_at, relayed) \
         VALUES ('{}', {planted}, 'planted', '{{}}', CURRENT_TIMESTAMP, 1)",
        lease.run_id
    ))
    .await;
    let cp = || Checkpoint {
        messages: vec![msg(lease.run_id, "m")],
        events: vec![step_started(0), step_completed(0)],
        step: Some(1),
        ..Default::default()
    };
    let err = s.checkpoint(&lease, cp()).await.unwrap_err();
    assert!(!matches!(err, StoreError::LeaseLost(_)), "{err}");
    s.execute(&format!(
        "DELETE FROM sa_events WHERE run_id = '{}' AND seq = {planted}",
        lease.run_id
    ))
    .await;
    let after = s.get_run(lease.run_id).await.unwrap().unwrap();
    assert_eq!(
        (after.event_seq, after.step),
        (before.event_seq, before.step),
        "the failed commit moved the run"
    );
    assert!(
        s.thread_messages(&t, 100).await.unwrap().is_empty(),
        "the failed commit left its message"
    );
    // The writer is clean: the same checkpoint commits, and is seen from another store.
    s.checkpoint(&lease, cp()).await.unwrap();
    let other = s.another().await;
    let run = other.get_run(lease.run_id).await.unwrap().unwrap();
    assert_eq!(run.event_seq, before.event_seq + 2);
    assert_eq!(run.step, 1);
    let seqs: Vec<u64> = other
        .events_after(lease.run_id, 0, 100)
        .await
        .unwrap()
        .iter()
        .map(|e| e.seq)
        .collect();
    assert_eq!(seqs, (1..=before.event_seq + 2).collect::<Vec<u64>>());
    assert_eq!(other.thread_messages(&t, 100).await.unwrap().len(), 1);
}

/// A start that names a cap of queued runs (the API's `SUBAGENTS_MAX_QUEUED_PER_KEY`) is
/// refused once its owner has that many queued, and writes nothing: no run, no thread. Other
/// owners, and the owner again once a run left the queue, start as before; 0 is no cap. The
/// start's other answers come first, in the same order on both backends.
async fn a_start_past_its_owners_cap_of_queued_runs_is_refused(s: Backend) {
    for _ in 0..2 {
        s.create_run(new_run(&ThreadId::generate())).await.unwrap();
    }
    let capped = |cap: u64| NewRun {
        max_queued: cap,
        ..new_run(&ThreadId::generate())
    };
    let keyed = NewRun {
        idempotency_key: Some("k3".into()),
        ..capped(3)
    };
    let third = s.create_run(keyed).await.unwrap().run;
    let refused = capped(3);
    let (id, thread) = (refused.id, refused.thread_id.clone());
    let err = s.create_run(refused).await.unwrap_err();
    assert!(matches!(err, StoreError::QueueFull { cap: 3 }), "{err}");
    assert!(
        s.get_run(id).await.unwrap().is_none(),
        "a refused start wrote its run"
    );
    assert!(
        s.get_thread(&thread).await.unwrap().is_none(),
        "a refused start wrote its thread"
    );
    assert_eq!(s.queued_count(&"o".into()).await.unwrap(), 3);
    // Another owner has its own count; no cap is no cap.
    let other = NewRun {
        owner: "p".into(),
        ..capped(3)
    };
    let theirs = s.create_run(other).await.unwrap().run;
    // At a full queue a start is answered as at any other, in the same order on both
    // backends: another owner's thread is not found, a replay of a keyed start gets its run.
    let err = s
        .create_run(NewRun {
            thread_id: theirs.thread_id.clone(),
            ..capped(3)
        })
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::ThreadOwnedElsewhere(_)), "{err}");
    let replay = s
        .create_run(NewRun {
            idempotency_key: Some("k3".into()),
            ..capped(3)
        })
        .await
        .unwrap();
    assert!(replay.existing, "a replay at a full queue");
    assert_eq!(replay.run.id, third.id);
    s.create_run(capped(0)).await.unwrap();
    let err = s.create_run(capped(4)).await.unwrap_err();
    assert!(matches!(err, StoreError::QueueFull { cap: 4 }), "{err}");
    // A run that leaves the queue makes room.
    let Claim::Acquired(..) = s
        .claim_run(third.id, "w1", Duration::from_secs(30))
        .await
        .unwrap()
    else {
        panic!("the third run is claimable")
    };
    s.create_run(capped(4)).await.unwrap();
    assert_eq!(s.queued_count(&"o".into()).await.unwrap(), 4);
}

async fn approvals_park_wake_and_answer_once(s: Backend) {
    let t = ThreadId::generate();
    let run = s.create_run(new_run(&t)).await.unwrap().run;
    let Claim::Acquired(lease, _) = s
        .claim_run(run.id, "w", Duration::from_secs(10))
        .await
        .unwrap()
    else {
        panic!()
    };
    let future = chrono::Utc::now().timestamp_millis() + 60_000;
    let approval = |id: &str, expires_at| NewApproval {
        id: id.into(),
        tool: "bash".into(),
        input: json!({"command": "ls"}),
        reason: "the rule `Bash` asks".into(),
        expires_at,
        grant_scope: "rule:Bash".into(),
    };
    let decision = json!({"verdict": "ask", "approval_id": "apr_1"});
    s.commit_decision(
        &lease,
        "k1",
        decision.clone(),
        Some(approval("apr_1", future)),
        vec![sample("approval.requested")],
    )
    .await
    .unwrap();
    // Idempotent by key: the same call decided again adds nothing.
    s.commit_decision(
        &lease,
        "k1",
        json!({"verdict": "allow"}),
        Some(approval("apr_other", future)),
        vec![],
    )
    .await
    .unwrap();
    assert_eq!(s.tool_decision("k1").await.unwrap(), Some(decision));
    assert!(s.approval(&"apr_other".into()).await.unwrap().is_none());
    let a = s.approval(&"apr_1".into()).await.unwrap().unwrap();
    assert_eq!(
        (a.status, a.root_run_id, a.input["command"].as_str()),
        (ApprovalStatus::Pending, run.id, Some("ls"))
    );
    let listed = s
        .list_approvals(
            &"o".into(),
            Some(ApprovalStatus::Pending),
            Some(run.id),
            None,
            10,
        )
        .await
        .unwrap();
    assert_eq!(listed.len(), 1);
    assert!(
        s.list_approvals(&"someone-else".into(), None, None, None, 10)
            .await
            .unwrap()
            .is_empty()
    );
    // Parked on it: not due while pending.
    let park = Park {
        events: vec![],
        wake_at: Some(future),
        waits_on: vec![],
        approvals: vec!["apr_1".into()],
    };
    assert_eq!(
        s.park(&lease, park).await.unwrap(),
        Parked::Parked { due: false }
    );
    let answer = |allow, run_tree| ApprovalAnswer {
        allow,
        reason: Some("ok".into()),
        updated_input: None,
        run_tree,
        by: "o".into(),
    };
    assert_eq!(
        s.answer_approval(&"apr_1".into(), &"someone-else".into(), answer(true, true))
            .await
            .unwrap(),
        Answered::NotFound
    );
    assert_eq!(
        s.answer_approval(&"apr_1".into(), &"o".into(), answer(true, true))
            .await
            .unwrap(),
        Answered::Done { run_id: run.id }
    );
    assert_eq!(
        s.answer_approval(&"apr_1".into(), &"o".into(), answer(false, false))
            .await
            .unwrap(),
        Answered::Closed(ApprovalStatus::Allowed)
    );
    let woken = s.get_run(run.id).await.unwrap().unwrap();
    assert!(
        woken.wake_at.unwrap() <= chrono::Utc::now().timestamp_millis(),
        "answering wakes the parked run"
    );
    assert!(
        s.has_grant(run.id, "rule:Bash").await.unwrap()
            && !s.has_grant(run.id, "bash").await.unwrap()
    );
    let kinds: Vec<String> = s
        .events_after(run.id, 0, 100)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.kind)
        .collect();
    assert!(kinds.contains(&"approval.resolved".to_owned()), "{kinds:?}");
    // An answer that raced the park: the park finds it answered and is due at once.
    let Claim::Acquired(lease, _) = s
        .claim_run(run.id, "w", Duration::from_secs(10))
        .await
        .unwrap()
    else {
        panic!()
    };
    s.commit_decision(
        &lease,
        "k2",
        json!({"verdict": "ask"}),
        Some(approval("apr_2", future)),
        vec![],
    )
    .await
    .unwrap();
    assert!(matches!(
        s.answer_approval(&"apr_2".into(), &"o".into(), answer(false, false))
            .await
            .unwrap(),
        Answered::Done { .. }
    ));
    let park = Park {
        events: vec![],
        wake_at: Some(future),
        waits_on: vec![],
        approvals: vec!["apr_2".into()],
    };
    assert_eq!(
        s.park(&lease, park).await.unwrap(),
        Parked::Parked { due: true }
    );
    // Past its time it cannot be answered, and expires.
    let Claim::Acquired(lease, _) = s
        .claim_run(run.id, "w", Duration::from_secs(10))
        .await
        .unwrap()
    else {
        panic!()
    };
    s.commit_decision(
        &lease,
        "k3",
        json!({"verdict": "ask"}),
        Some(approval("apr_3", 1)),
        vec![],
    )
    .await
    .unwrap();
    assert_eq!(
        s.answer_approval(&"apr_3".into(), &"o".into(), answer(true, false))
            .await
            .unwrap(),
        Answered::Closed(ApprovalStatus::Expired)
    );
    assert!(s.expire_approval(&"apr_3".into()).await.unwrap());
    assert!(!s.expire_approval(&"apr_3".into()).await.unwrap());
    assert_eq!(
        s.approval(&"apr_3".into()).await.unwrap().unwrap().status,
        ApprovalStatus::Expired
    );
}

async fn compactions_are_fenced_idempotent_and_where_contexts_start(s: Backend) {
    let t = ThreadId::generate();
    let run = s.create_run(new_run(&t)).await.unwrap().run;
    let Claim::Acquired(lease, _) = s
        .claim_run(run.id, "w", Duration::from_secs(10))
        .await
        .unwrap()
    else {
        panic!()
    };
    let keys = ["a", "b", "c", "d"];
    s.checkpoint(
        &lease,
        Checkpoint {
            messages: keys.iter().map(|k| msg(run.id, k)).collect(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let all = s.thread_messages(&t, 100).await.unwrap();
    assert_eq!(s.latest_compaction(&t).await.unwrap(), None);
    // A claimed run's one read: no compaction yet, so the newest messages of the whole thread.
    let keys_of = |m: &[StoredMessage]| m.iter().map(|m| m.key.clone()).collect::<Vec<_>>();
    let (none, msgs) = s.context(&t, 3).await.unwrap();
    assert_eq!((none, keys_of(&msgs)), (None, keys_of(&all[1..])));
    assert_eq!(
        s.context(&ThreadId::generate(), 10).await.unwrap(),
        (None, vec![]),
        "a thread with nothing"
    );
    let c = two_compacted(&all);
    let event = || vec![sample("context.compacted")];
    s.commit_compaction(&lease, c.clone(), Default::default(), event())
        .await
        .unwrap();
    // A replay of the same compaction adds no second row (its event is a new one).
    s.commit_compaction(&lease, c.clone(), Default::default(), event())
        .await
        .unwrap();
    let list = s.compactions(&t).await.unwrap();
    assert_eq!(list.len(), 1);
    let latest = s.latest_compaction(&t).await.unwrap().unwrap();
    assert_eq!(
        (
            latest.run_id,
            latest.last_message_id,
            latest.summary.as_str(),
            latest.tokens_after
        ),
        (run.id, all[1].id, "a and b", 300)
    );
    // A context rebuilt from it reads only what came after it; the thread keeps everything.
    let after: Vec<String> = s
        .messages_after(&t, latest.last_message_id, 100)
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.key)
        .collect();
    assert_eq!(after, [format!("{}:c", run.id), format!("{}:d", run.id)]);
    assert_eq!(
        s.messages_after(&t, latest.last_message_id, 1)
            .await
            .unwrap()[0]
            .key,
        format!("{}:d", run.id),
        "the newest, when bounded"
    );
    assert_eq!(s.thread_messages(&t, 100).await.unwrap().len(), 4);
    // The one read answers as the two do.
    let (compaction, msgs) = s.context(&t, 100).await.unwrap();
    assert_eq!(compaction.as_ref(), Some(&latest));
    assert_eq!(keys_of(&msgs), after);
    assert_eq!(
        msgs,
        s.messages_after(&t, latest.last_message_id, 100)
            .await
            .unwrap()
    );
    assert_eq!(
        keys_of(&s.context(&t, 1).await.unwrap().1),
        [format!("{}:d", run.id)],
        "the newest, when bounded"
    );
    // A stale lease cannot compact.
    let stale = Lease {
        epoch: lease.epoch - 1,
        ..lease.clone()
    };
    let other = CompactionBody {
        first_message_id: all[2].id,
        last_message_id: all[2].id,
        ..c
    };
    assert!(matches!(
        s.commit_compaction(&stale, other, Default::default(), event())
            .await
            .unwrap_err(),
        StoreError::LeaseLost(_)
    ));
    assert_eq!(s.compactions(&t).await.unwrap().len(), 1);
    let kinds: Vec<String> = s
        .events_after(run.id, 0, 100)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.kind)
        .collect();
    assert_eq!(
        kinds.iter().filter(|k| *k == "context.compacted").count(),
        2
    );
}

/// A claim that reads its run's context reads what `context` would (the compaction and the
/// newest messages after it, bounded); on SQLite in the claim's own transaction, so a claimer
/// there never needs a read of its own, except on a forked thread.
async fn a_claim_brings_the_context_its_run_rebuilds_from(s: Backend) {
    let folds = s.url.starts_with("sqlite");
    let ttl = Duration::from_secs(30);
    let (t, lease) = claimed_run(&s, ttl).await;
    s.checkpoint(
        &lease,
        Checkpoint {
            messages: ["a", "b", "c", "d"].map(|k| msg(lease.run_id, k)).to_vec(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let all = s.thread_messages(&t, 100).await.unwrap();
    let summary = two_compacted(&all);
    s.commit_compaction(&lease, summary, Default::default(), vec![])
        .await
        .unwrap();
    // The run goes back on the queue and is claimed again, its context read with the claim.
    assert!(s.release_lease(&lease, &new_job_id(), false).await.unwrap());
    let (claim, context) = s
        .claim_with_context(lease.run_id, "w2", ttl, 1)
        .await
        .unwrap();
    let Claim::Acquired(again, run) = claim else {
        panic!("the released run is claimable")
    };
    assert_eq!(
        (again.epoch, run.thread_id.clone()),
        (lease.epoch + 1, t.clone())
    );
    let read = s.context(&t, 1).await.unwrap();
    assert_eq!(read.1.len(), 1, "bounded to the newest");
    assert_eq!(read.0.as_ref().map(|c| c.summary.as_str()), Some("a and b"));
    match folds {
        true => assert_eq!(context, Some(read), "SQLite reads it with the claim"),
        false => assert_eq!(
            context, None,
            "PostgreSQL's claimer reads a compacted thread's itself"
        ),
    }
    // Nothing to claim: no context either.
    let (claim, context) = s
        .claim_with_context(lease.run_id, "w3", ttl, 10)
        .await
        .unwrap();
    assert!(matches!(
        claim,
        Claim::NotClaimable(Some(RunStatus::Running))
    ));
    assert_eq!(context, None);
    // A fork's history goes on in the thread it shares: its claimer reads that itself.
    let fork = ThreadId::generate();
    s.fork_thread(&"o".into(), &t, ForkAt::End, &fork)
        .await
        .unwrap();
    let mut on_fork = new_run(&fork);
    on_fork.input = "forked".into();
    let forked = s.create_run(on_fork).await.unwrap().run;
    let (claim, context) = s
        .claim_with_context(forked.id, "w4", ttl, 10)
        .await
        .unwrap();
    assert!(matches!(claim, Claim::Acquired(..)));
    assert_eq!(context, None);
    assert_eq!(
        s.context(&fork, 10).await.unwrap().1.len(),
        2,
        "c and d, shared"
    );
    // A thread of messages alone: both backends read its context with the claim, bounded to
    // the newest, oldest first.
    let (t2, lease2) = claimed_run(&s, ttl).await;
    s.checkpoint(
        &lease2,
        Checkpoint {
            messages: ["x", "y", "z"].map(|k| msg(lease2.run_id, k)).to_vec(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert!(
        s.release_lease(&lease2, &new_job_id(), false)
            .await
            .unwrap()
    );
    let (claim, context) = s
        .claim_with_context(lease2.run_id, "w5", ttl, 2)
        .await
        .unwrap();
    assert!(matches!(claim, Claim::Acquired(..)));
    let read = s.context(&t2, 2).await.unwrap();
    assert_eq!(read.1.len(), 2, "bounded to the newest");
    assert!(read.1[0].id < read.1[1].id, "oldest first");
    assert_eq!(context, Some(read), "read with the claim");
}

async fn appends_are_idempotent_and_sequences_gap_free(s: Backend) {
    let t = ThreadId::generate();
    let run = s.create_run(new_run(&t)).await.unwrap().run;
    let Claim::Acquired(lease, _) = s
        .claim_run(run.id, "w", Duration::from_secs(10))
        .await
        .unwrap()
    else {
        panic!()
    };
    for _ in 0..2 {
        s.checkpoint(
            &lease,
            Checkpoint {
                messages: vec![msg(run.id, "a"), msg(run.id, "b")],
                events: vec![step_started(0), step_completed(0)],
                ..Default::default()
            },
        )
        .await
        .unwrap();
    }
    assert_eq!(
        s.thread_messages(&t, 100_000).await.unwrap().len(),
        2,
        "same keys appended once"
    );
    let ev = s.events_after(run.id, 0, 100).await.unwrap();
    assert_eq!(
        ev.iter().map(|e| e.seq).collect::<Vec<_>>(),
        [1, 2, 3, 4, 5, 6]
    );
    assert_eq!(
        s.events_after(run.id, 4, 1).await.unwrap()[0].seq,
        5,
        "cursor and limit"
    );
}

/// The relay reports what went through as one range per run; exactly those events leave the
/// outbox, and a range covering events already relayed is harmless.
async fn the_outbox_marks_what_the_relay_reports_and_nothing_else(s: Backend) {
    let mut runs = vec![];
    for _ in 0..2 {
        let t = ThreadId::generate();
        let run = s.create_run(new_run(&t)).await.unwrap().run;
        let Claim::Acquired(lease, _) = s
            .claim_run(run.id, "w", Duration::from_secs(10))
            .await
            .unwrap()
        else {
            panic!()
        };
        let events = vec![step_started(0), step_completed(0)];
        s.checkpoint(
            &lease,
            Checkpoint {
                events,
                ..Default::default()
            },
        )
        .await
        .unwrap();
        runs.push(run.id);
    }
    let pending = |v: Vec<EventRecord>| v.iter().map(|e| (e.run_id, e.seq)).collect::<Vec<_>>();
    let all = pending(s.unrelayed(100).await.unwrap());
    assert_eq!(
        all.len(),
        8,
        "queued, started and two step events per run: {all:?}"
    );
    s.mark_relayed(&[(runs[0], 2, 3), (runs[1], 1, 4)])
        .await
        .unwrap();
    let left = pending(s.unrelayed(100).await.unwrap());
    assert_eq!(left, [(runs[0], 1), (runs[0], 4)]);
    s.mark_relayed(&[(runs[0], 1, 4)]).await.unwrap();
    assert!(s.unrelayed(100).await.unwrap().is_empty());
    s.mark_relayed(&[]).await.unwrap();
}

/// Every process with Redis runs a relay, and two relays can mark the same events at once
/// (both read the outbox before either marked it). Neither may fail: on PostgreSQL two plain
/// `UPDATE … FROM unnest(…)` statements locking the same rows in opposite orders deadlock, and
/// one of them is cancelled ("deadlock detected"). Here two stores mark the same ranges over
/// and over, one in the outbox's order and one in reverse, at the same moment.
async fn relays_marking_the_same_events_at_once_both_succeed(s: Backend) {
    let other = s.another().await;
    let mut runs = vec![];
    for _ in 0..30 {
        let (_, lease) = claimed_run(&s, Duration::from_secs(60)).await;
        let events = (0..62).map(step_started).collect();
        s.checkpoint(
            &lease,
            Checkpoint {
                events,
                ..Default::default()
            },
        )
        .await
        .unwrap();
        runs.push(lease.run_id);
    }
    // Events 1..=64 of each run: queued, started and 62 steps. Each round puts all of them
    // back in the outbox and both relays mark all of them.
    let forward: Vec<_> = runs.iter().map(|r| (*r, 1, 64)).collect();
    let backward: Vec<_> = forward.iter().rev().copied().collect();
    for round in 0..12 {
        s.unmark_all_events().await;
        assert_eq!(s.unrelayed(10_000).await.unwrap().len(), 30 * 64);
        let (a, b) = tokio::join!(s.mark_relayed(&forward), other.mark_relayed(&backward));
        a.unwrap_or_else(|e| panic!("round {round}, the first relay: {e}"));
        b.unwrap_or_else(|e| panic!("round {round}, the second relay: {e}"));
        let left = s.unrelayed(10_000).await.unwrap();
        assert!(
            left.is_empty(),
            "round {round}: {} events left in the outbox",
            left.len()
        );
    }
}

/// A process without Redis has no relay: whatever writes its events (a start, a claim, a group
/// or a single checkpoint, a terminal commit with its parent's `child.finished`, a cancel, an
/// appended event), they are written as relayed and never wait in the outbox. A store with a
/// relay on the same database still leaves its own there.
async fn a_store_without_a_relay_writes_its_events_as_relayed(s: Backend) {
    let quiet = s.without_relay().await;
    let parent = quiet
        .create_run(new_run(&ThreadId::generate()))
        .await
        .unwrap()
        .run;
    let Claim::Acquired(lp, _) = quiet
        .claim_run(parent.id, "w", Duration::from_secs(10))
        .await
        .unwrap()
    else {
        panic!()
    };
    let child = quiet.create_run(child_of(&parent)).await.unwrap().run;
    let Claim::Acquired(lc, _) = quiet
        .claim_run(child.id, "w", Duration::from_secs(10))
        .await
        .unwrap()
    else {
        panic!()
    };
    let step = || vec![step_started(0), step_completed(0)];
    let usage = subagents::model::Usage {
        prompt_tokens: 100,
        completion_tokens: 1,
        cache_read_tokens: 70,
        cache_write_tokens: 20,
    };
    // Two progress checkpoints at once go through a group commit; then the child ends alone.
    let (a, b) = tokio::join!(
        quiet.checkpoint(
            &lp,
            Checkpoint {
                events: step(),
                usage,
                ..Default::default()
            }
        ),
        quiet.checkpoint(
            &lc,
            Checkpoint {
                events: step(),
                usage,
                ..Default::default()
            }
        )
    );
    a.unwrap();
    b.unwrap();
    for id in [parent.id, child.id] {
        let row = quiet.get_run(id).await.unwrap().unwrap();
        assert_eq!(
            row.usage, usage,
            "a group commit sums the cache figures too"
        );
    }
    let end = vec![sample("run.succeeded")];
    quiet.checkpoint(&lc, succeeded(end)).await.unwrap();
    assert!(
        quiet
            .append_events(parent.id, vec![sample("child.started")])
            .await
            .unwrap()
    );
    let queued = quiet
        .create_run(new_run(&ThreadId::generate()))
        .await
        .unwrap()
        .run;
    assert_eq!(
        quiet.request_cancel(queued.id).await.unwrap(),
        CancelOutcome::Cancelled
    );
    let parent_events = quiet.events_after(parent.id, 0, 100).await.unwrap();
    assert!(
        parent_events.iter().any(|e| e.kind == "child.finished"),
        "{parent_events:?}"
    );
    assert_eq!(
        quiet.events_after(child.id, 0, 100).await.unwrap().len(),
        5,
        "queued, started, two step events, succeeded"
    );
    assert!(
        quiet.unrelayed(1000).await.unwrap().is_empty(),
        "nothing waits for a relay that does not exist"
    );
    let relayed = s
        .create_run(new_run(&ThreadId::generate()))
        .await
        .unwrap()
        .run;
    let waiting: Vec<_> = s
        .unrelayed(1000)
        .await
        .unwrap()
        .iter()
        .map(|e| (e.run_id, e.seq))
        .collect();
    assert_eq!(
        waiting,
        [(relayed.id, 1)],
        "a store with a relay leaves its events for it"
    );
}

async fn terminal_states_never_change(s: Backend) {
    let t = ThreadId::generate();
    let run = s.create_run(new_run(&t)).await.unwrap().run;
    let Claim::Acquired(lease, _) = s
        .claim_run(run.id, "w", Duration::from_secs(10))
        .await
        .unwrap()
    else {
        panic!()
    };
    s.checkpoint(
        &lease,
        Checkpoint {
            finish: Some(Finish::Succeeded {
                result: "r".into(),
                forced: false,
            }),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let again = s
        .checkpoint(
            &lease,
            Checkpoint {
                finish: Some(Finish::Cancelled),
                ..Default::default()
            },
        )
        .await;
    assert!(matches!(again, Err(StoreError::LeaseLost(_))));
    assert!(matches!(
        s.claim_run(run.id, "w2", Duration::from_secs(1))
            .await
            .unwrap(),
        Claim::NotClaimable(Some(RunStatus::Succeeded))
    ));
    assert_eq!(
        s.request_cancel(run.id).await.unwrap(),
        CancelOutcome::AlreadyFinished(RunStatus::Succeeded)
    );
    let r = s.get_run(run.id).await.unwrap().unwrap();
    assert_eq!(
        (r.status, r.result.as_deref()),
        (RunStatus::Succeeded, Some("r"))
    );
    // The thread is free again.
    s.create_run(new_run(&t)).await.unwrap();
}

/// Stored names decode through their enums: a name this build does not know (written by hand,
/// or by a newer build) is a corrupt row with the name in its message, never a panic and never
/// read as some other value.
async fn a_stored_name_the_code_does_not_know_is_a_corrupt_row(s: Backend) {
    let run = s
        .create_run(new_run(&ThreadId::generate()))
        .await
        .unwrap()
        .run;
    s.execute(&format!(
        "UPDATE sa_runs SET error_kind = 'melted' WHERE id = '{}'",
        run.id
    ))
    .await;
    match s.get_run(run.id).await {
        Err(StoreError::Corrupt(m)) => assert!(m.contains("melted"), "{m}"),
        other => panic!("expected a corrupt row, got {other:?}"),
    }
    assert!(s.get_run(RunId::new()).await.unwrap().is_none());
}

/// A message for a run commits with its event, is reported by the lease renewal, refuses the
/// final answer's commit (not a forced one) until it is delivered, and is delivered once: a
/// second delivery finds nothing. Another owner's run is not found; an ended run refuses.
async fn a_message_is_delivered_once_and_holds_back_the_final_answer(s: Backend) {
    let (thread, lease) = claimed_run(&s, Duration::from_secs(30)).await;
    let run = lease.run_id;
    let id = subagents::ids::MessageId::generate();
    let owner: subagents::ids::OwnerId = "o".into();
    assert_eq!(
        s.send_message(run, &"intruder".into(), &id, "psst")
            .await
            .unwrap(),
        Sent::NotFound,
        "another owner's run is not found"
    );
    assert_eq!(
        s.send_message(run, &owner, &id, "also look at B")
            .await
            .unwrap(),
        Sent::Accepted {
            status: RunStatus::Running,
            woken: false
        }
    );
    assert_eq!(s.get_run(run).await.unwrap().unwrap().inbox, 1);
    assert!(s.renew_lease(&lease).await.unwrap().messages_waiting);
    let answer = |forced| Checkpoint {
        finish: Some(Finish::Succeeded {
            result: "done".into(),
            forced,
        }),
        ..Default::default()
    };
    // Refused whole, with its rows: the fence holds the current epoch, so only the waiting
    // message refuses it (SQLite tries it as a lone end in one command first).
    let seq = s.get_run(run).await.unwrap().unwrap().event_seq;
    assert!(
        matches!(
            s.checkpoint(
                &lease,
                Checkpoint {
                    messages: vec![msg(run, "refused answer")],
                    events: vec![step_started(2)],
                    pins: vec![("refused".into(), "yes".into())],
                    ..answer(false)
                }
            )
            .await,
            Err(StoreError::LeaseLost(_))
        ),
        "a final answer does not commit over a waiting message"
    );
    let after = s.get_run(run).await.unwrap().unwrap();
    assert_eq!((after.status, after.event_seq), (RunStatus::Running, seq));
    assert!(s.events_after(run, seq, 100).await.unwrap().is_empty());
    assert!(
        s.thread_messages(&thread, 100).await.unwrap().is_empty(),
        "a refused answer wrote its message"
    );
    assert!(s.run_pins(run).await.unwrap().is_empty());
    let delivered = s.deliver_messages(&lease, 2).await.unwrap();
    assert_eq!(delivered.len(), 1);
    assert_eq!(
        delivered[0].message,
        Message::User {
            content: "also look at B".into()
        }
    );
    assert!(s.deliver_messages(&lease, 3).await.unwrap().is_empty());
    let history = s.thread_messages(&thread, 100).await.unwrap();
    assert_eq!(
        history
            .iter()
            .filter(|m| m.message
                == Message::User {
                    content: "also look at B".into()
                })
            .count(),
        1
    );
    assert!(!s.renew_lease(&lease).await.unwrap().messages_waiting);
    let kinds: Vec<String> = s
        .events_after(run, 0, 100)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.kind)
        .collect();
    let received = kinds.iter().position(|k| k == "message.received");
    let delivered = kinds.iter().position(|k| k == "message.delivered");
    assert!(received.is_some() && received < delivered, "{kinds:?}");
    // A forced answer is not held back (the limit wins); this one is not forced and now commits.
    let id2 = subagents::ids::MessageId::generate();
    s.send_message(run, &owner, &id2, "late").await.unwrap();
    s.checkpoint(&lease, answer(true)).await.unwrap();
    assert_eq!(
        s.send_message(run, &owner, &subagents::ids::MessageId::generate(), "after")
            .await
            .unwrap(),
        Sent::Finished(RunStatus::Succeeded)
    );
    // The fence of an unforced answer holds once nothing waits.
    let (_, lease) = claimed_run(&s, Duration::from_secs(30)).await;
    s.checkpoint(&lease, answer(false)).await.unwrap();
    // A run's inbox is bounded: the next message is refused until the run takes them.
    let (_, lease) = claimed_run(&s, Duration::from_secs(30)).await;
    for i in 0..MAX_WAITING_MESSAGES {
        let id = subagents::ids::MessageId::generate();
        let sent = s
            .send_message(lease.run_id, &owner, &id, &format!("m{i}"))
            .await;
        assert!(matches!(sent, Ok(Sent::Accepted { .. })), "{i}: {sent:?}");
    }
    let id = subagents::ids::MessageId::generate();
    assert_eq!(
        s.send_message(lease.run_id, &owner, &id, "one too many")
            .await
            .unwrap(),
        Sent::Full
    );
    assert_eq!(
        s.deliver_messages(&lease, 1).await.unwrap().len() as i64,
        MAX_WAITING_MESSAGES
    );
    assert!(matches!(
        s.send_message(lease.run_id, &owner, &id, "room again")
            .await
            .unwrap(),
        Sent::Accepted { .. }
    ));
}

/// A fork's history is the source's up to its point, read through the lineage (no message is
/// copied); each thread then goes on apart, a fork of a fork shares both, and a fork point
/// outside the history, another owner's thread or an empty one is refused.
async fn a_fork_shares_its_history_up_to_its_point_without_copying_it(s: Backend) {
    let (thread, lease) = claimed_run(&s, Duration::from_secs(30)).await;
    let owner: subagents::ids::OwnerId = "o".into();
    let said = |key: &str| {
        let mut m = msg(lease.run_id, key);
        m.step = 1;
        m
    };
    for key in ["one", "two", "three"] {
        s.checkpoint(
            &lease,
            Checkpoint {
                messages: vec![said(key)],
                ..Default::default()
            },
        )
        .await
        .unwrap();
    }
    let history = s.thread_messages(&thread, 100).await.unwrap();
    assert_eq!(history.len(), 3);
    let rows_before = s
        .count("SELECT CAST(COUNT(*) AS BIGINT) FROM sa_messages")
        .await;
    let fork = ThreadId::generate();
    let at = history[1].id;
    assert_eq!(
        s.fork_thread(&owner, &thread, ForkAt::Message(at), &fork)
            .await
            .unwrap(),
        Forked::Done { at_message: at }
    );
    assert_eq!(
        s.count("SELECT CAST(COUNT(*) AS BIGINT) FROM sa_messages")
            .await,
        rows_before,
        "a fork copies no message"
    );
    let keys = |m: &[StoredMessage]| m.iter().map(|m| m.key.clone()).collect::<Vec<_>>();
    let shared = s.thread_messages(&fork, 100).await.unwrap();
    assert_eq!(keys(&shared), keys(&history[..2]));
    let (_, context) = s.context(&fork, 100).await.unwrap();
    assert_eq!(keys(&context), keys(&history[..2]));
    assert_eq!(
        keys(&s.messages_page(&fork, 0, 100).await.unwrap()),
        keys(&history[..2])
    );
    let t = s.get_thread(&fork).await.unwrap().unwrap();
    assert_eq!(t.forked_from, Some((thread.clone(), at)));
    assert_eq!(s.forks_of(&thread).await.unwrap(), vec![(fork.clone(), at)]);
    // Both go on: the original's new message is not the fork's, and the other way round.
    s.checkpoint(
        &lease,
        Checkpoint {
            messages: vec![said("four")],
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let mut on_fork = new_run(&fork);
    on_fork.input = "forked".into();
    let run = s.create_run(on_fork).await.unwrap().run;
    let Claim::Acquired(fl, _) = s
        .claim_run(run.id, "w1", Duration::from_secs(30))
        .await
        .unwrap()
    else {
        panic!("the fork's run is claimable")
    };
    let mut own = msg(fl.run_id, "fork-own");
    own.step = 1;
    s.checkpoint(
        &fl,
        Checkpoint {
            messages: vec![own.clone()],
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let (_, fork_context) = s.context(&fork, 100).await.unwrap();
    let mut want = keys(&history[..2]);
    want.push(own.key.clone());
    assert_eq!(keys(&fork_context), want);
    let (_, original) = s.context(&thread, 100).await.unwrap();
    assert_eq!(original.len(), 4);
    assert!(!keys(&original).contains(&own.key));
    // The newest `limit` of a fork come from both threads, in order.
    let (_, newest) = s.context(&fork, 2).await.unwrap();
    assert_eq!(keys(&newest), want[1..].to_vec());
    // A fork of the fork shares both, up to its own point.
    let grandchild = ThreadId::generate();
    assert_eq!(
        s.fork_thread(&owner, &fork, ForkAt::End, &grandchild)
            .await
            .unwrap(),
        Forked::Done {
            at_message: fork_context.last().unwrap().id
        }
    );
    assert_eq!(
        keys(&s.thread_messages(&grandchild, 100).await.unwrap()),
        want
    );
    let at_run = ThreadId::generate();
    assert_eq!(
        s.fork_thread(&owner, &thread, ForkAt::Run(lease.run_id), &at_run)
            .await
            .unwrap(),
        Forked::Done {
            at_message: original.last().unwrap().id
        }
    );
    // Refusals.
    let nowhere = ThreadId::generate();
    assert_eq!(
        s.fork_thread(&"intruder".into(), &thread, ForkAt::End, &nowhere)
            .await
            .unwrap(),
        Forked::NoThread
    );
    assert_eq!(
        s.fork_thread(&owner, &fork, ForkAt::Message(history[2].id), &nowhere)
            .await
            .unwrap(),
        Forked::NoMessage,
        "a message of the source after the fork point is not in the fork's history"
    );
    assert_eq!(
        s.fork_thread(&owner, &thread, ForkAt::Run(run.id), &nowhere)
            .await
            .unwrap(),
        Forked::NoRun,
        "a run of another thread"
    );
    let (empty, _) = claimed_run(&s, Duration::from_secs(30)).await;
    assert_eq!(
        s.fork_thread(&owner, &empty, ForkAt::End, &nowhere)
            .await
            .unwrap(),
        Forked::Empty
    );
    assert!(s.get_thread(&nowhere).await.unwrap().is_none());
}

/// A run records the agent version it starts with; a version's text is kept once (the first
/// text stays) and read back by its version.
async fn an_agent_version_is_pinned_with_the_run_and_kept_once(s: Backend) {
    let run = s
        .create_run(new_run(&ThreadId::generate()))
        .await
        .unwrap()
        .run;
    assert_eq!(run.agent_version.as_deref(), Some("0123456789ab"));
    assert_eq!(
        s.get_run(run.id).await.unwrap().unwrap().agent_version,
        run.agent_version
    );
    assert_eq!(s.agent_version("0123456789ab").await.unwrap(), None);
    s.record_agent_version("0123456789ab", "a", "first")
        .await
        .unwrap();
    s.record_agent_version("0123456789ab", "a", "second")
        .await
        .unwrap();
    assert_eq!(
        s.agent_version("0123456789ab").await.unwrap(),
        Some(("a".to_owned(), "first".to_owned()))
    );
}

/// What a run's view shows beside the run (pins, plan, children, schedule) comes in one read,
/// the same as the reads it replaced; and with the run and its latest events, in the read that
/// answers a wait.
async fn a_runs_view_extras_come_in_one_read(s: Backend) {
    let (_, lease) = claimed_run(&s, Duration::from_secs(10)).await;
    let run = lease.run_id;
    assert_eq!(
        s.view_extras(run, "todo_write").await.unwrap(),
        ViewExtras::default()
    );
    let plan = r#"{"todos":[{"content":"x","status":"pending"}]}"#;
    let call = |name: &str, arguments: &str| subagents::model::ToolCall {
        id: format!("c-{name}"),
        kind: "function".into(),
        function: subagents::model::FunctionCall {
            name: name.into(),
            arguments: arguments.into(),
        },
    };
    s.checkpoint(
        &lease,
        Checkpoint {
            pins: vec![("model".into(), "m1".into())],
            messages: vec![NewMessage {
                step: 1,
                key: format!("{run}:a1"),
                message: Message::Assistant {
                    content: None,
                    tool_calls: vec![call("todo_write", plan), call("echo", "{}")],
                    thinking: vec![],
                },
            }],
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let mut children = vec![];
    for _ in 0..2 {
        let mut child = new_run(&ThreadId::generate());
        child.parent_run_id = Some(run);
        children.push(s.create_run(child).await.unwrap().run.id);
    }
    let x = s.view_extras(run, "todo_write").await.unwrap();
    assert_eq!(x.pins, s.run_pins(run).await.unwrap());
    assert_eq!(x.pins["model"], "m1");
    assert_eq!(x.last_call.as_deref(), Some(plan));
    assert_eq!(
        x.last_call,
        s.last_call_arguments(run, "todo_write").await.unwrap()
    );
    let mut want = children.clone();
    want.sort_by_key(|id| id.to_string());
    assert_eq!(x.children, want);
    assert_eq!(x.schedule, None);
    assert_eq!(
        s.view_extras(run, "web_search").await.unwrap().last_call,
        None
    );
    // What answers a wait after a commit: the run, its latest events, and once it has ended
    // the same extras, together.
    let latest = |r: subagents::store::RunRead| {
        (
            r.run.event_seq,
            r.events_after,
            r.events.iter().map(|e| e.seq).collect::<Vec<_>>(),
            r.extras,
        )
    };
    let read = s.run_with_latest(run, 2, "todo_write").await.unwrap();
    let seq = s.get_run(run).await.unwrap().unwrap().event_seq;
    assert!(seq >= 2, "a claimed run has its events");
    assert_eq!(
        latest(read.unwrap()),
        (seq, seq - 2, vec![seq - 1, seq], None),
        "no extras while it runs"
    );
    // The run and its extras alone (what a wait beside a relay reads): none while it runs.
    let (r, extras) = s.run_and_extras(run, "todo_write").await.unwrap().unwrap();
    assert_eq!(
        (r.id, r.status, r.event_seq),
        (run, RunStatus::Running, seq)
    );
    assert_eq!(extras, None, "no extras while it runs");
    s.checkpoint(&lease, succeeded(vec![sample("run.succeeded")]))
        .await
        .unwrap();
    let (r, extras) = s.run_and_extras(run, "todo_write").await.unwrap().unwrap();
    assert_eq!(r.status, RunStatus::Succeeded);
    let x = s.view_extras(run, "todo_write").await.unwrap();
    assert_eq!(extras.as_ref(), Some(&x));
    assert_eq!((x.children.len(), x.pins.len()), (2, 1));
    assert_eq!(x.last_call.as_deref(), Some(plan));
    assert!(
        s.run_and_extras(RunId::new(), "todo_write")
            .await
            .unwrap()
            .is_none()
    );
    let read = s.run_with_latest(run, 100, "todo_write").await.unwrap();
    let ended = s.get_run(run).await.unwrap().unwrap();
    assert_eq!(ended.status, RunStatus::Succeeded);
    let read = read.unwrap();
    assert_eq!(read.run.status, RunStatus::Succeeded);
    assert_eq!(read.events, s.events_after(run, 0, 100).await.unwrap());
    assert_eq!(
        latest(read),
        (
            ended.event_seq,
            0,
            (1..=ended.event_seq).collect(),
            Some(s.view_extras(run, "todo_write").await.unwrap())
        )
    );
    assert!(
        s.run_with_latest(RunId::new(), 5, "todo_write")
            .await
            .unwrap()
            .is_none()
    );
}

/// A run's pins: each name takes its first value for good (a second pin of it, as from a claim
/// racing the first, gets the first value back); names pinned later join them; a pinned
/// text is kept once.
async fn a_run_pins_each_value_once_and_the_first_pin_holds(s: Backend) {
    let run = s
        .create_run(new_run(&ThreadId::generate()))
        .await
        .unwrap()
        .run;
    let pin = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect()
    };
    assert!(s.run_pins(run.id).await.unwrap().is_empty());
    let first = s
        .pin_run(run.id, pin(&[("model", "m1"), ("settings", "v1")]))
        .await
        .unwrap();
    assert_eq!(first["model"], "m1");
    let again = s
        .pin_run(run.id, pin(&[("model", "m2"), ("mcp:files", "[]")]))
        .await
        .unwrap();
    assert_eq!(again.len(), 2);
    assert_eq!(again["model"], "m1", "the first pin holds");
    assert_eq!(again["mcp:files"], "[]");
    let all = s.run_pins(run.id).await.unwrap();
    assert_eq!(
        all.into_iter().collect::<Vec<_>>(),
        pin(&[("mcp:files", "[]"), ("model", "m1"), ("settings", "v1")])
    );
    let other = s
        .create_run(new_run(&ThreadId::generate()))
        .await
        .unwrap()
        .run;
    assert!(
        s.run_pins(other.id).await.unwrap().is_empty(),
        "pins are per run"
    );
    // A first claim's pins commit with its input checkpoint (fenced like it), once.
    let (_, lease) = claimed_run(&s, Duration::from_secs(10)).await;
    for model in ["first", "second"] {
        s.checkpoint(
            &lease,
            Checkpoint {
                pins: pin(&[("model", model), ("settings", "none")]),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    }
    assert_eq!(
        s.run_pins(lease.run_id)
            .await
            .unwrap()
            .into_iter()
            .collect::<Vec<_>>(),
        pin(&[("model", "first"), ("settings", "none")])
    );
    assert_eq!(s.pinned_text("abcdefabcdef").await.unwrap(), None);
    s.record_pinned_text("abcdefabcdef", "{}").await.unwrap();
    s.record_pinned_text("abcdefabcdef", "{\"x\":1}")
        .await
        .unwrap();
    assert_eq!(
        s.pinned_text("abcdefabcdef").await.unwrap().as_deref(),
        Some("{}")
    );
}

/// Webhooks in the store: a run's end is queued by the trigger in its own commit (only once a
/// subscription exists, and only the types one can name); deliveries made of it are created
/// once however often; a due delivery is claimed by one claimer; attempts move it to failed,
/// dead (pausing the subscription) or delivered; a redelivery makes it due again.
async fn webhook_events_are_queued_with_their_commit_and_delivered_once_each(s: Backend) {
    use subagents::store::{Attempted, DeliveryStatus, NewDelivery, Webhook, WebhookPatch};
    let finish = async |s: &Backend| {
        let (_, lease) = claimed_run(s, Duration::from_secs(10)).await;
        s.checkpoint(
            &lease,
            succeeded(vec![
                step_started(1),
                step_completed(1),
                sample("run.succeeded"),
            ]),
        )
        .await
        .unwrap();
        lease.run_id
    };
    finish(&s).await;
    assert!(
        s.queued_webhook_events(100).await.unwrap().is_empty(),
        "nothing is queued while nobody subscribes"
    );
    let now = chrono::Utc::now();
    let hook = Webhook {
        id: "wh_1".into(),
        owner: OwnerId::local(),
        url: "https://example.com/h".into(),
        events: vec!["run.succeeded".into()],
        agents: None,
        description: String::new(),
        secret: "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".into(),
        old_secret: None,
        paused_reason: None,
        run_id: None,
        created_at: now,
        updated_at: now,
    };
    s.create_webhook(&hook).await.unwrap();
    let read = s
        .get_webhook(&OwnerId::local(), "wh_1")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (&read.url, &read.events, &read.secret, &read.agents),
        (&hook.url, &hook.events, &hook.secret, &hook.agents)
    );
    assert_eq!(
        s.get_webhook(&OwnerId::from("other"), "wh_1")
            .await
            .unwrap(),
        None
    );
    let run = finish(&s).await;
    let queued = s.queued_webhook_events(100).await.unwrap();
    let kinds: Vec<&str> = queued.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(
        kinds,
        ["run.started", "run.succeeded"],
        "the types a subscription can name, not every event"
    );
    assert!(queued.iter().all(|e| e.run_id == run));
    let delivery = |id: &str| NewDelivery {
        id: id.into(),
        webhook_id: "wh_1".into(),
        event_type: "run.succeeded".into(),
        run_id: run,
        body: "{}".into(),
    };
    let done: Vec<_> = queued.iter().map(|e| (run, e.seq)).collect();
    s.create_deliveries(vec![delivery("msg_a")], done.clone())
        .await
        .unwrap();
    // Made again (a crash before the queue row went): nothing new.
    s.create_deliveries(vec![delivery("msg_a")], done)
        .await
        .unwrap();
    assert!(s.queued_webhook_events(100).await.unwrap().is_empty());
    assert_eq!(s.list_deliveries("wh_1", None, 10).await.unwrap().len(), 1);

    let t = subagents::store::now_ms();
    assert_eq!(
        s.due_webhooks(t).await.unwrap(),
        vec![("wh_1".to_owned(), 1)]
    );
    let claimed = s.claim_deliveries("wh_1", t, t + 60_000, 5).await.unwrap();
    assert_eq!(claimed.len(), 1);
    assert_eq!(claimed[0].attempts, 1);
    assert!(
        s.claim_deliveries("wh_1", t, t + 60_000, 5)
            .await
            .unwrap()
            .is_empty(),
        "a locked delivery is nobody else's"
    );
    let failed = Attempted {
        delivered: false,
        status: Some(500),
        error: Some("HTTP 500".into()),
        body: Some("no".into()),
        retry_at: Some(t + 1_000),
    };
    s.record_attempt(&claimed[0], &failed, 1).await.unwrap();
    let d = &s.list_deliveries("wh_1", None, 10).await.unwrap()[0];
    assert_eq!(
        (d.status, d.last_status),
        (DeliveryStatus::Failed, Some(500))
    );
    assert!(
        s.due_webhooks(t).await.unwrap().is_empty(),
        "not due before its retry"
    );
    let again = s
        .claim_deliveries("wh_1", t + 1_000, t + 60_000, 5)
        .await
        .unwrap();
    assert_eq!(again[0].attempts, 2);
    let dead = Attempted {
        retry_at: None,
        ..failed
    };
    s.record_attempt(&again[0], &dead, 1).await.unwrap();
    let d = &s.list_deliveries("wh_1", None, 10).await.unwrap()[0];
    assert_eq!(d.status, DeliveryStatus::Dead);
    let paused = s
        .get_webhook(&OwnerId::local(), "wh_1")
        .await
        .unwrap()
        .unwrap();
    assert!(
        paused
            .paused_reason
            .as_deref()
            .is_some_and(|r| r.contains("HTTP 500")),
        "{paused:?}"
    );
    assert!(s.redeliver("wh_1", "msg_a").await.unwrap());
    assert!(!s.redeliver("wh_1", "msg_nope").await.unwrap());
    assert!(
        s.due_webhooks(subagents::store::now_ms())
            .await
            .unwrap()
            .is_empty(),
        "a paused subscription's deliveries wait"
    );
    s.update_webhook(
        &OwnerId::local(),
        "wh_1",
        WebhookPatch {
            paused: Some(false),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let t = subagents::store::now_ms();
    let third = s.claim_deliveries("wh_1", t, t + 60_000, 5).await.unwrap();
    assert_eq!(third.len(), 1, "resumed, the redelivery is due");
    let ok = Attempted {
        delivered: true,
        status: Some(204),
        error: None,
        body: None,
        retry_at: None,
    };
    s.record_attempt(&third[0], &ok, 1).await.unwrap();
    assert_eq!(
        s.list_deliveries("wh_1", None, 10).await.unwrap()[0].status,
        DeliveryStatus::Delivered
    );
    let rotated = s
        .rotate_webhook_secret(&OwnerId::local(), "wh_1", "whsec_bmV3", t + 1_000)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        rotated.signing_secrets(t),
        ["whsec_bmV3", hook.secret.as_str()]
    );
    assert_eq!(rotated.signing_secrets(t + 2_000), ["whsec_bmV3"]);
    assert!(s.delete_webhook(&OwnerId::local(), "wh_1").await.unwrap());
    assert!(
        s.list_deliveries("wh_1", None, 10)
            .await
            .unwrap()
            .is_empty()
    );
}

/// A running run's interrupt is heard by its lease renewal as an interrupt (the holder ends it
/// at its next step boundary), not as a cancel now; a cancel asked later wins; a queued run is
/// at a boundary, so its interrupt cancels it at once.
async fn an_interrupt_waits_for_the_boundary_and_a_cancel_does_not(s: Backend) {
    let (_, lease) = claimed_run(&s, Duration::from_secs(30)).await;
    assert_eq!(
        s.request_interrupt(lease.run_id).await.unwrap(),
        CancelOutcome::Requested
    );
    let st = s.renew_lease(&lease).await.unwrap();
    assert!(st.interrupt_requested && !st.cancel_requested, "{st:?}");
    assert!(
        s.get_run(lease.run_id)
            .await
            .unwrap()
            .unwrap()
            .cancel_requested,
        "a claim or a park (boundaries) sees it as a cancel"
    );
    s.request_cancel(lease.run_id).await.unwrap();
    let st = s.renew_lease(&lease).await.unwrap();
    assert!(st.cancel_requested && !st.interrupt_requested, "{st:?}");
    s.request_interrupt(lease.run_id).await.unwrap();
    assert!(
        s.renew_lease(&lease).await.unwrap().cancel_requested,
        "an interrupt does not soften a cancel already asked"
    );
    let queued = s
        .create_run(new_run(&ThreadId::generate()))
        .await
        .unwrap()
        .run;
    assert_eq!(
        s.request_interrupt(queued.id).await.unwrap(),
        CancelOutcome::Cancelled
    );
    assert_eq!(
        s.get_run(queued.id).await.unwrap().unwrap().status,
        RunStatus::Cancelled
    );
}

/// A refused start writes nothing: no run, no thread, not the thread's last start, and not
/// another owner's thread that it named.
async fn the_database_enforces_one_active_run_per_thread(s: Backend) {
    let t = ThreadId::generate();
    let key = format!("once-{t}");
    let mut keyed = new_run(&t);
    keyed.idempotency_key = Some(key.clone());
    let first = s.create_run(keyed).await.unwrap().run;
    let thread = s.get_thread(&t).await.unwrap().unwrap();
    let refused = new_run(&t);
    let refused_id = refused.id;
    match s.create_run(refused).await.unwrap_err() {
        StoreError::Busy { active_run, .. } => assert_eq!(active_run, first.id),
        e => panic!("{e}"),
    }
    let mut other = new_run(&t);
    other.owner = "someone-else".into();
    let other_id = other.id;
    assert!(matches!(
        s.create_run(other).await.unwrap_err(),
        StoreError::ThreadOwnedElsewhere(_)
    ));
    // A replay of the keyed start, naming a thread that does not exist yet: the first run,
    // and no thread for it.
    let fresh = ThreadId::generate();
    let mut replay = new_run(&fresh);
    replay.idempotency_key = Some(key);
    let replayed = s.create_run(replay).await.unwrap();
    assert!(
        replayed.existing && replayed.run.id == first.id,
        "{replayed:?}"
    );
    assert!(
        s.get_thread(&fresh).await.unwrap().is_none(),
        "a replay created its thread"
    );
    assert!(s.get_run(refused_id).await.unwrap().is_none());
    assert!(s.get_run(other_id).await.unwrap().is_none());
    assert_eq!(
        s.get_thread(&t).await.unwrap().unwrap().updated_at,
        thread.updated_at,
        "a refused start moved the thread's last start"
    );
}

async fn enqueued_runs_wait_for_the_thread_and_go_in_order(s: Backend) {
    let t = ThreadId::generate();
    let first = s.create_run(new_run(&t)).await.unwrap().run;
    let mut n = new_run(&t);
    n.if_busy = IfBusy::Enqueue;
    let second = s.create_run(n).await.unwrap().run;
    let mut n = new_run(&t);
    n.if_busy = IfBusy::Enqueue;
    let third = s.create_run(n).await.unwrap().run;
    // Only the oldest queued run of the thread is claimable.
    assert!(matches!(
        s.claim_run(third.id, "w", Duration::from_secs(10))
            .await
            .unwrap(),
        Claim::NotClaimable(Some(RunStatus::Queued))
    ));
    let Claim::Acquired(l1, _) = s
        .claim_run(first.id, "w", Duration::from_secs(10))
        .await
        .unwrap()
    else {
        panic!()
    };
    // While the first runs, the second waits.
    assert!(matches!(
        s.claim_run(second.id, "w", Duration::from_secs(10))
            .await
            .unwrap(),
        Claim::NotClaimable(Some(RunStatus::Queued))
    ));
    assert!(
        s.orphans(Duration::ZERO)
            .await
            .unwrap()
            .iter()
            .all(|o| o.run_id != second.id),
        "a blocked run is not an orphan"
    );
    // The end answers the thread's next run where it can read it under its own write lock
    // (SQLite), and whether a child was still going: so its worker need not read them after.
    // The second's job ended (its handler found the thread busy), so the second needs one.
    s.set_job_status(&second.job_id, "Done").await;
    assert_eq!(
        s.end_cancelled(&l1).await,
        Ending {
            children_going: false,
            next: s.next_named(Some(second.id)),
            job_done: None,
        }
    );
    s.set_job_status(&second.job_id, "Pending").await;
    // A queued run whose own job still waits to be fetched needs no second one: that job's
    // claim starts it, the thread being free.
    assert_eq!(
        s.next_queued(&t).await.unwrap(),
        None,
        "its own job (written with its start) is pending"
    );
    s.set_job_status(&second.job_id, "Done").await;
    assert_eq!(
        s.next_queued(&t).await.unwrap(),
        Some(second.id),
        "its job ended (its handler found the thread busy): it needs one"
    );
    s.set_job_status(&second.job_id, "Pending").await;
    assert_eq!(
        s.next_queued(&t).await.unwrap(),
        None,
        "its own job is pending"
    );
    // apalis marks a job `Running` and `Done` after its handler started: `Queued` may already
    // be a handler that found the thread busy and let go. A second job is the safe answer.
    s.set_job_status(&second.job_id, "Queued").await;
    assert_eq!(
        s.next_queued(&t).await.unwrap(),
        Some(second.id),
        "its own job may have let go already"
    );
    s.set_job_status(&second.job_id, "Running").await;
    assert_eq!(
        s.next_queued(&t).await.unwrap(),
        Some(second.id),
        "its own job started: it may have found the thread busy and let go"
    );
    let Claim::Acquired(l2, _) = s
        .claim_run(second.id, "w", Duration::from_secs(10))
        .await
        .unwrap()
    else {
        panic!("the second is next")
    };
    // The second ends while the third's own job is still pending (that job will start it), and
    // while the second's job is held by another worker than the one ending it: the end names no
    // next run and leaves that job alone.
    let (jobs, workers) = s.apalis_tables();
    s.execute(&format!(
        "INSERT INTO {workers} (id, worker_type, storage_name) VALUES ('another-worker', '{}', 'test')",
        subagents::queue::QUEUE_NAME
    ))
    .await;
    s.execute(&format!(
        "UPDATE {jobs} SET lock_by = 'another-worker' WHERE id = '{}'",
        second.job_id
    ))
    .await;
    assert_eq!(
        s.end_cancelled(&l2).await,
        Ending {
            children_going: false,
            next: s.next_named(None),
            job_done: None,
        }
    );
    assert_eq!(s.job(&second.job_id).await.unwrap().0, "Running");
    assert_eq!(s.next_queued(&t).await.unwrap(), None, "the read agrees");
    assert_eq!(s.job(&third.job_id).await.unwrap().0, "Pending");
}

/// A start writes the run's first job in its own transaction, as apalis's push would: pending,
/// in the runs' queue, the run id in apalis's JSON codec, and fetched by the run's rank in its
/// owner's queue (`job_priority`, which PostgreSQL's start computes in SQL). A start that
/// creates nothing (an idempotent repeat, a busy thread) writes no job.
async fn a_start_writes_the_runs_job_with_its_place_in_the_queue(s: Backend) {
    let mut urgent = new_run(&ThreadId::generate());
    urgent.priority = 5;
    let mut runs = vec![];
    for n in [
        new_run(&ThreadId::generate()),
        new_run(&ThreadId::generate()),
        urgent,
    ] {
        let (job, priority) = (n.job_id.clone(), n.priority);
        let created = s.create_run(n).await.unwrap();
        runs.push((created.run.id, job, created.ahead, priority));
    }
    assert_eq!(
        runs.iter().map(|r| r.2).collect::<Vec<_>>(),
        [0, 1, 0],
        "the urgent run goes ahead of both"
    );
    for (run, job, ahead, priority) in &runs {
        let (status, job_priority, body, queue) =
            s.job(job).await.expect("the start wrote the job");
        assert_eq!(
            (status.as_str(), queue.as_str()),
            ("Pending", subagents::queue::QUEUE_NAME)
        );
        assert_eq!(
            job_priority,
            subagents::queue::job_priority(*ahead, *priority) as i64,
            "run {run}"
        );
        let decoded: subagents::queue::RunJob = serde_json::from_slice(&body).unwrap();
        assert_eq!(decoded.run_id, *run, "apalis's codec reads the run back");
    }
    // Nothing created, no job.
    let t = ThreadId::generate();
    s.create_run(new_run(&t)).await.unwrap();
    let busy = new_run(&t);
    let busy_job = busy.job_id.clone();
    assert!(matches!(
        s.create_run(busy).await.unwrap_err(),
        StoreError::Busy { .. }
    ));
    assert!(
        s.job(&busy_job).await.is_none(),
        "a refused start writes no job"
    );
    let mut first = new_run(&ThreadId::generate());
    first.idempotency_key = Some("k".into());
    let mut again = new_run(&ThreadId::generate());
    again.idempotency_key = Some("k".into());
    let again_job = again.job_id.clone();
    s.create_run(first).await.unwrap();
    assert!(s.create_run(again).await.unwrap().existing);
    assert!(
        s.job(&again_job).await.is_none(),
        "a repeated start writes no second job"
    );
}

/// The in-process hand-off ([`NewRun::held_by`]): a start locks its job to a worker of its
/// process, as apalis's fetch would, only when that worker is registered and the run is next
/// in line (no other job waiting to be fetched, none of its owner's runs ahead); the worker
/// settles it as apalis's ack would, and only while the job is still locked to it.
async fn a_start_hands_its_job_to_a_local_worker_only_when_it_is_next_in_line(s: Backend) {
    let (jobs, workers) = s.apalis_tables();
    let held_start = |owner: &str| {
        let mut n = new_run(&ThreadId::generate());
        n.owner = owner.into();
        n.held_by = Some("w-local".into());
        n
    };
    let locked = |job: &str| {
        format!("SELECT COUNT(*) FROM {jobs} WHERE id = '{job}' AND lock_by = 'w-local'")
    };
    // A worker that is not registered (stopped, or not started yet) is handed nothing.
    let first = s.create_run(held_start("a")).await.unwrap();
    assert!(!first.held);
    assert_eq!(s.job(&first.run.job_id).await.unwrap().0, "Pending");
    s.execute(&format!(
        "INSERT INTO {workers} (id, worker_type, storage_name) VALUES ('w-local', '{}', 'test')",
        subagents::queue::QUEUE_NAME
    ))
    .await;
    // Another job waits to be fetched: it goes first, so the new run's job waits too.
    let second = s.create_run(held_start("b")).await.unwrap();
    assert!(!second.held, "the first run's job waits to be fetched");
    assert_eq!(s.job(&second.run.job_id).await.unwrap().0, "Pending");
    assert_eq!(s.count(&locked(&second.run.job_id)).await, 0);
    // Both fetched by workers elsewhere: the next run is next in line, and handed over.
    s.set_job_status(&first.run.job_id, "Queued").await;
    s.set_job_status(&second.run.job_id, "Queued").await;
    let third = s.create_run(held_start("c")).await.unwrap();
    assert!(third.held, "next in line with a registered worker");
    assert_eq!(s.job(&third.run.job_id).await.unwrap().0, "Queued");
    assert_eq!(s.count(&locked(&third.run.job_id)).await, 1);
    // A run of an owner whose earlier run is still queued keeps the owner's order.
    let behind = s.create_run(held_start("a")).await.unwrap();
    assert_eq!(behind.ahead, 1);
    assert!(!behind.held, "its owner's first run goes first");
    assert_eq!(s.job(&behind.run.job_id).await.unwrap().0, "Pending");
    s.set_job_status(&behind.run.job_id, "Queued").await;
    // A repeated start (same idempotency key) hands nothing over again.
    let mut keyed = held_start("d");
    keyed.idempotency_key = Some("once".into());
    let keyed = s.create_run(keyed).await.unwrap();
    assert!(keyed.held);
    let mut again = held_start("d");
    again.idempotency_key = Some("once".into());
    let again = s.create_run(again).await.unwrap();
    assert!(again.existing && !again.held);

    // Settled only by the worker it is locked to.
    s.settle_held_job(&third.run.job_id, "someone-else", JobEnd::Done)
        .await
        .unwrap();
    assert_eq!(s.job(&third.run.job_id).await.unwrap().0, "Queued");
    s.settle_held_job(&third.run.job_id, "w-local", JobEnd::Done)
        .await
        .unwrap();
    assert_eq!(s.job(&third.run.job_id).await.unwrap().0, "Done");
    assert_eq!(
        s.count(&format!(
            "SELECT COUNT(*) FROM {jobs} WHERE id = '{}' AND attempts = 1 AND done_at IS NOT NULL",
            third.run.job_id
        ))
        .await,
        1,
        "acked as apalis acks"
    );
    // A failed handling puts the job back for any worker.
    s.settle_held_job(&keyed.run.job_id, "w-local", JobEnd::Retry)
        .await
        .unwrap();
    assert_eq!(s.job(&keyed.run.job_id).await.unwrap().0, "Pending");
    assert_eq!(
        s.count(&format!(
            "SELECT COUNT(*) FROM {jobs} WHERE id = '{}' AND lock_by IS NULL AND attempts = 1",
            keyed.run.job_id
        ))
        .await,
        1
    );

    // A job a notification named is taken by a worker only when apalis's fetch would have
    // taken it: here the job put back above waits first.
    let mut queued = new_run(&ThreadId::generate());
    queued.owner = "e".into();
    let queued = s.create_run(queued).await.unwrap();
    assert!(!queued.held);
    assert_eq!(
        s.take_job(&queued.run.job_id, "w-local").await.unwrap(),
        None,
        "an older job waits to be fetched"
    );
    s.set_job_status(&keyed.run.job_id, "Done").await;
    assert_eq!(
        s.take_job(&queued.run.job_id, "unregistered")
            .await
            .unwrap(),
        None,
        "only a registered worker takes a job"
    );
    assert_eq!(
        s.take_job(&queued.run.job_id, "w-local").await.unwrap(),
        Some(queued.run.id),
        "next in line: taken, and its run named"
    );
    assert_eq!(s.job(&queued.run.job_id).await.unwrap().0, "Queued");
    assert_eq!(s.count(&locked(&queued.run.job_id)).await, 1);
    assert_eq!(
        s.take_job(&queued.run.job_id, "w-local").await.unwrap(),
        None,
        "taken once"
    );

    // The run's end marks its held job done in the same commit, as the settle would: its
    // worker then writes nothing more for it.
    let Claim::Acquired(lease, _) = s
        .claim_run(queued.run.id, "w-local", Duration::from_secs(10))
        .await
        .unwrap()
    else {
        panic!("the taken job's run is claimable")
    };
    let ending = s.end_cancelled(&lease).await;
    assert_eq!(ending.job_done.as_deref(), Some(queued.run.job_id.as_str()));
    assert_eq!(
        s.count(&format!(
            "SELECT COUNT(*) FROM {jobs} WHERE id = '{}' AND status = 'Done' AND attempts = 1 \
             AND done_at IS NOT NULL AND lock_by = 'w-local'",
            queued.run.job_id
        ))
        .await,
        1,
        "acked as apalis acks"
    );
}

/// A notified worker's take of a job and the claim of its run ([`Claims::take_and_claim`],
/// one statement on PostgreSQL): taken only when apalis's fetch would have taken it, once, by a
/// registered worker; the run claimed by that worker with its context; a run that is not
/// claimable leaves its job taken and the run queued, and an untaken job claims nothing.
async fn a_notified_worker_takes_a_job_and_claims_its_run_in_one_go(s: Backend) {
    let (jobs, workers) = s.apalis_tables();
    s.execute(&format!(
        "INSERT INTO {workers} (id, worker_type, storage_name) VALUES ('w-n', '{}', 'test')",
        subagents::queue::QUEUE_NAME
    ))
    .await;
    let ttl = Duration::from_secs(30);
    let first = s
        .create_run(new_run(&ThreadId::generate()))
        .await
        .unwrap()
        .run;
    let second = s
        .create_run(new_run(&ThreadId::generate()))
        .await
        .unwrap()
        .run;
    // Its notification is nothing new to the process that started it (PostgreSQL's listener
    // passes it over), once.
    let postgres = matches!(s.jobs, Jobs::Postgres(_));
    assert_eq!(s.started_here(&first.job_id), postgres);
    assert!(!s.started_here(&first.job_id), "forgotten once seen");
    assert!(!s.started_here(&new_job_id()), "a job written elsewhere");
    let mut refused = new_run(&first.thread_id);
    refused.owner = "someone-else".into();
    let refused_job = refused.job_id.clone();
    s.create_run(refused).await.unwrap_err();
    assert!(
        !s.started_here(&refused_job),
        "a refused start wrote no job"
    );
    let mut capped = new_run(&ThreadId::generate());
    capped.max_queued = 1;
    let capped_job = capped.job_id.clone();
    assert!(matches!(
        s.create_run(capped).await.unwrap_err(),
        StoreError::QueueFull { .. }
    ));
    assert!(!s.started_here(&capped_job), "nor one past its owner's cap");
    assert!(
        s.take_and_claim(&first.job_id, "w-n", ttl, 10)
            .await
            .unwrap()
            .is_none(),
        "another job waits to be fetched"
    );
    assert_eq!(
        s.get_run(first.id).await.unwrap().unwrap().status,
        RunStatus::Queued,
        "a job not taken claims nothing"
    );
    // Fetched by a worker elsewhere: the first one's job is next in line.
    s.set_job_status(&second.job_id, "Done").await;
    assert!(
        s.take_and_claim(&first.job_id, "unregistered", ttl, 10)
            .await
            .unwrap()
            .is_none(),
        "only a registered worker takes a job"
    );
    let taken = s
        .take_and_claim(&first.job_id, "w-n", ttl, 10)
        .await
        .unwrap()
        .expect("next in line: taken");
    assert_eq!(taken.run_id, first.id);
    let Claim::Acquired(lease, run) = taken.claim else {
        panic!("its run is claimable: {:?}", taken.claim)
    };
    assert_eq!((lease.run_id, lease.owner.as_str()), (first.id, "w-n"));
    assert_eq!((run.status, run.event_seq), (RunStatus::Running, 2));
    let (compaction, messages) = taken.context.expect("the claim's context");
    assert!(compaction.is_none() && messages.is_empty());
    let events = s.events_after(first.id, 0, 10).await.unwrap();
    assert_eq!(
        events.iter().map(|e| e.kind.as_str()).collect::<Vec<_>>(),
        ["run.queued", "run.started"]
    );
    assert_eq!(s.job(&first.job_id).await.unwrap().0, "Queued");
    assert_eq!(
        s.count(&format!(
            "SELECT COUNT(*) FROM {jobs} WHERE id = '{}' AND lock_by = 'w-n'",
            first.job_id
        ))
        .await,
        1
    );
    assert!(
        s.take_and_claim(&first.job_id, "w-n", ttl, 10)
            .await
            .unwrap()
            .is_none(),
        "taken once"
    );
    // A run queued behind the first on its thread: its job is taken, but its run waits for
    // the thread.
    let mut behind = new_run(&first.thread_id);
    behind.if_busy = IfBusy::Enqueue;
    let behind = s.create_run(behind).await.unwrap().run;
    let taken = s
        .take_and_claim(&behind.job_id, "w-n", ttl, 10)
        .await
        .unwrap()
        .expect("its job is next in line");
    assert_eq!(taken.run_id, behind.id);
    assert!(
        matches!(taken.claim, Claim::NotClaimable(Some(RunStatus::Queued)))
            && taken.context.is_none(),
        "{taken:?}"
    );
    assert_eq!(s.job(&behind.job_id).await.unwrap().0, "Queued");
    assert_eq!(
        s.get_run(behind.id).await.unwrap().unwrap().status,
        RunStatus::Queued
    );
}

async fn idempotency_keys_return_the_first_run(s: Backend) {
    let mut a = new_run(&ThreadId::generate());
    a.idempotency_key = Some("k1".into());
    let first = s.create_run(a.clone()).await.unwrap();
    assert!(!first.existing);
    a.id = RunId::new();
    let again = s.create_run(a).await.unwrap();
    assert!(again.existing);
    assert_eq!(again.run.id, first.run.id);
    // Keys are per owner.
    let mut b = new_run(&ThreadId::generate());
    b.idempotency_key = Some("k1".into());
    b.owner = "other".into();
    assert!(!s.create_run(b).await.unwrap().existing);
}

async fn runs_whose_workers_keep_dying_fail_as_lost(s: Backend) {
    let run = s
        .create_run(new_run(&ThreadId::generate()))
        .await
        .unwrap()
        .run;
    for crash in 1..=2u32 {
        assert!(matches!(
            s.claim_run(run.id, "w", Duration::from_millis(10))
                .await
                .unwrap(),
            Claim::Acquired(..)
        ));
        tokio::time::sleep(Duration::from_millis(20)).await;
        let expired = s.expire_leases(3).await.unwrap();
        assert_eq!(
            expired,
            [Expired {
                run_id: run.id,
                gave_up: false
            }],
            "crash {crash} puts it back on the queue"
        );
        let r = s.get_run(run.id).await.unwrap().unwrap();
        assert_eq!((r.status, r.crashes), (RunStatus::Queued, crash));
    }
    assert!(matches!(
        s.claim_run(run.id, "w", Duration::from_millis(10))
            .await
            .unwrap(),
        Claim::Acquired(..)
    ));
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(
        s.expire_leases(3).await.unwrap(),
        [Expired {
            run_id: run.id,
            gave_up: true
        }]
    );
    let r = s.get_run(run.id).await.unwrap().unwrap();
    assert_eq!(r.status, RunStatus::Failed);
    assert_eq!(r.error.unwrap().kind, ErrorKind::Lost);
    let ev = s.events_after(run.id, 0, 100).await.unwrap();
    assert_eq!(ev.last().unwrap().kind, "run.failed");
    assert_eq!(
        ev.iter().map(|e| e.seq).collect::<Vec<_>>(),
        (1..=ev.len() as u64).collect::<Vec<_>>()
    );
}

/// Hole 1: parking, waking and graceful releases are not crashes. A run that parked five times
/// and was released once still survives a crash with a crash budget of 2.
async fn parking_and_releases_do_not_spend_the_crash_budget(s: Backend) {
    let run = s
        .create_run(new_run(&ThreadId::generate()))
        .await
        .unwrap()
        .run;
    for _ in 0..5 {
        let Claim::Acquired(lease, _) = s
            .claim_run(run.id, "w", Duration::from_secs(10))
            .await
            .unwrap()
        else {
            panic!()
        };
        let park = Park {
            wake_at: Some(now_ms() + 60_000),
            ..Default::default()
        };
        assert_eq!(
            s.park(&lease, park).await.unwrap(),
            Parked::Parked { due: false }
        );
    }
    let Claim::Acquired(lease, _) = s
        .claim_run(run.id, "w", Duration::from_secs(10))
        .await
        .unwrap()
    else {
        panic!()
    };
    assert!(s.release_lease(&lease, &new_job_id(), false).await.unwrap());
    assert_eq!(
        s.get_run(run.id).await.unwrap().unwrap().status,
        RunStatus::Queued,
        "a release queues it again at once"
    );
    let Claim::Acquired(..) = s
        .claim_run(run.id, "w", Duration::from_millis(10))
        .await
        .unwrap()
    else {
        panic!()
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(
        s.expire_leases(2).await.unwrap(),
        [Expired {
            run_id: run.id,
            gave_up: false
        }]
    );
    let r = s.get_run(run.id).await.unwrap().unwrap();
    assert_eq!((r.status, r.attempts, r.crashes), (RunStatus::Queued, 7, 1));
    let Claim::Acquired(..) = s
        .claim_run(run.id, "w", Duration::from_secs(10))
        .await
        .unwrap()
    else {
        panic!("one crash must not lose it")
    };
}

async fn orphans_are_found_after_the_grace_period(s: Backend) {
    let queued = s
        .create_run(new_run(&ThreadId::generate()))
        .await
        .unwrap()
        .run;
    let parked = s
        .create_run(new_run(&ThreadId::generate()))
        .await
        .unwrap()
        .run;
    let Claim::Acquired(lease, _) = s
        .claim_run(parked.id, "w", Duration::from_secs(10))
        .await
        .unwrap()
    else {
        panic!()
    };
    s.park(
        &lease,
        Park {
            wake_at: Some(now_ms() + 20),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert!(
        s.orphans(Duration::from_secs(60)).await.unwrap().is_empty(),
        "fresh enqueues are left alone"
    );
    tokio::time::sleep(Duration::from_millis(50)).await;
    // The queued run's job ended without starting it (here: marked so); the parked one's
    // deadline passed.
    s.set_job_status(&queued.job_id, "Done").await;
    let found = s.orphans(Duration::from_millis(1)).await.unwrap();
    assert!(
        found
            .iter()
            .any(|o| o.run_id == queued.id && o.status == RunStatus::Queued),
        "{found:?}"
    );
    assert!(
        found
            .iter()
            .any(|o| o.run_id == parked.id && o.status == RunStatus::Waiting),
        "{found:?}"
    );
    s.set_job(queued.id, &new_job_id()).await.unwrap();
    s.set_job(parked.id, &new_job_id()).await.unwrap();
    let found = s.orphans(Duration::from_secs(1)).await.unwrap();
    assert!(
        found.is_empty(),
        "re-enqueued runs are not orphans within the grace: {found:?}"
    );
}

async fn parked_runs_are_claimed_again_and_cancelled_at_once(s: Backend) {
    let run = s
        .create_run(new_run(&ThreadId::generate()))
        .await
        .unwrap()
        .run;
    let Claim::Acquired(lease, _) = s
        .claim_run(run.id, "w", Duration::from_secs(10))
        .await
        .unwrap()
    else {
        panic!()
    };
    s.park(
        &lease,
        Park {
            wake_at: Some(12345),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let parked = s.get_run(run.id).await.unwrap().unwrap();
    assert_eq!(
        (parked.status, parked.wake_at),
        (RunStatus::Waiting, Some(12345))
    );
    // A parked run holds no lease: the old epoch cannot write.
    assert!(matches!(
        s.checkpoint(&lease, Checkpoint::default()).await,
        Err(StoreError::LeaseLost(_))
    ));
    let Claim::Acquired(again, rec) = s
        .claim_run(run.id, "w2", Duration::from_secs(10))
        .await
        .unwrap()
    else {
        panic!()
    };
    assert_eq!(
        (rec.claimed_from, rec.wake_at),
        (Some(RunStatus::Waiting), None)
    );
    let ev = s.events_after(run.id, 0, 100).await.unwrap();
    assert_eq!(ev.last().unwrap().kind, "run.resumed");
    s.park(
        &again,
        Park {
            wake_at: Some(now_ms() + 60_000),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(
        s.request_cancel(run.id).await.unwrap(),
        CancelOutcome::Cancelled,
        "parked runs are cancelled at once"
    );
    assert_eq!(
        s.get_run(run.id).await.unwrap().unwrap().status,
        RunStatus::Cancelled
    );
    let d1 = s.wait_deadline("k", 100).await.unwrap();
    let d2 = s.wait_deadline("k", 999).await.unwrap();
    assert_eq!(
        (d1, d2),
        (100, 100),
        "a deadline is fixed at the first attempt"
    );
}

/// Hole 5: a cancel requested while the run was deciding to park refuses the park; the holder
/// then finishes it as cancelled.
async fn a_pending_cancel_refuses_the_park(s: Backend) {
    let run = s
        .create_run(new_run(&ThreadId::generate()))
        .await
        .unwrap()
        .run;
    let Claim::Acquired(lease, _) = s
        .claim_run(run.id, "w", Duration::from_secs(10))
        .await
        .unwrap()
    else {
        panic!()
    };
    assert_eq!(
        s.request_cancel(run.id).await.unwrap(),
        CancelOutcome::Requested
    );
    let park = Park {
        wake_at: Some(now_ms() + 60_000),
        ..Default::default()
    };
    assert_eq!(s.park(&lease, park).await.unwrap(), Parked::CancelPending);
    assert_eq!(
        s.get_run(run.id).await.unwrap().unwrap().status,
        RunStatus::Running
    );
    s.checkpoint(
        &lease,
        Checkpoint {
            finish: Some(Finish::Cancelled),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(
        s.get_run(run.id).await.unwrap().unwrap().status,
        RunStatus::Cancelled
    );
}

fn child_of(parent: &RunRecord) -> NewRun {
    let mut c = new_run(&ThreadId::generate());
    c.parent_run_id = Some(parent.id);
    c.tree = TreePosition {
        root_run_id: Some(parent.id),
        depth: 1,
        detached: false,
    };
    c.place = QueuePlace::Front;
    c
}

/// Holes 3 and 4: a child's end commits its parent's `child.finished` and wakes whoever is
/// parked on it — also a later run of the parent's thread — for every way a child ends.
async fn a_childs_end_reports_and_wakes_in_the_same_commit(s: Backend) {
    let t = ThreadId::generate();
    let first = s.create_run(new_run(&t)).await.unwrap().run;
    let Claim::Acquired(l1, _) = s
        .claim_run(first.id, "w", Duration::from_secs(10))
        .await
        .unwrap()
    else {
        panic!()
    };
    let detached = || {
        let mut c = child_of(&first);
        c.tree.detached = true;
        c
    };
    let finished = s.create_run(detached()).await.unwrap().run;
    let cancelled_queued = s.create_run(detached()).await.unwrap().run;
    let lost = s.create_run(detached()).await.unwrap().run;
    // The first run ends (its detached children live on); a second run of the same thread
    // awaits them.
    let end = vec![sample("run.succeeded")];
    s.checkpoint(
        &l1,
        Checkpoint {
            events: end,
            finish: Some(Finish::Succeeded {
                result: "x".into(),
                forced: false,
            }),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let mut second = new_run(&t);
    second.if_busy = IfBusy::Enqueue;
    let second = s.create_run(second).await.unwrap().run;
    let Claim::Acquired(l2, _) = s
        .claim_run(second.id, "w", Duration::from_secs(10))
        .await
        .unwrap()
    else {
        panic!()
    };
    let park = Park {
        waits_on: vec![finished.id, cancelled_queued.id, lost.id],
        ..Default::default()
    };
    assert_eq!(
        s.park(&l2, park).await.unwrap(),
        Parked::Parked { due: false }
    );
    assert!(s.due_waiters(finished.id).await.unwrap().is_empty());

    // Ends by a finish checkpoint.
    let Claim::Acquired(lc, _) = s
        .claim_run(finished.id, "w", Duration::from_secs(10))
        .await
        .unwrap()
    else {
        panic!()
    };
    s.checkpoint(
        &lc,
        Checkpoint {
            finish: Some(Finish::Succeeded {
                result: "r".into(),
                forced: false,
            }),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(
        s.due_waiters(finished.id).await.unwrap(),
        [second.id],
        "the later run of the thread is woken"
    );
    let woken = s.get_run(second.id).await.unwrap().unwrap();
    assert_eq!(woken.status, RunStatus::Waiting);
    assert!(woken.wake_at.is_some_and(|w| w <= now_ms()));
    // Re-park on the rest; ends by cancel while queued.
    let Claim::Acquired(l2, _) = s
        .claim_run(second.id, "w", Duration::from_secs(10))
        .await
        .unwrap()
    else {
        panic!()
    };
    let park = Park {
        waits_on: vec![cancelled_queued.id, lost.id],
        ..Default::default()
    };
    assert_eq!(
        s.park(&l2, park).await.unwrap(),
        Parked::Parked { due: false }
    );
    assert_eq!(
        s.request_cancel(cancelled_queued.id).await.unwrap(),
        CancelOutcome::Cancelled
    );
    assert_eq!(
        s.due_waiters(cancelled_queued.id).await.unwrap(),
        [second.id]
    );
    // Re-park on the last; it ends by giving up after a crash.
    let Claim::Acquired(l2, _) = s
        .claim_run(second.id, "w", Duration::from_secs(10))
        .await
        .unwrap()
    else {
        panic!()
    };
    assert_eq!(
        s.park(
            &l2,
            Park {
                waits_on: vec![lost.id],
                ..Default::default()
            }
        )
        .await
        .unwrap(),
        Parked::Parked { due: false }
    );
    let Claim::Acquired(..) = s
        .claim_run(lost.id, "w", Duration::from_millis(5))
        .await
        .unwrap()
    else {
        panic!()
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    let expired = s.expire_leases(1).await.unwrap();
    assert!(
        expired.contains(&Expired {
            run_id: lost.id,
            gave_up: true
        }),
        "{expired:?}"
    );
    assert_eq!(s.due_waiters(lost.id).await.unwrap(), [second.id]);

    // The first run had ended before its children: nothing follows its terminal event.
    let ev = s.events_after(first.id, 0, 100).await.unwrap();
    assert_eq!(
        ev.last().unwrap().kind,
        "run.succeeded",
        "{:?}",
        ev.iter().map(|e| &e.kind).collect::<Vec<_>>()
    );
    assert!(
        !s.append_events(first.id, vec![sample("child.started")])
            .await
            .unwrap()
    );
    assert_eq!(
        s.events_after(first.id, 0, 100).await.unwrap().len(),
        ev.len()
    );
}

/// A live parent gets `child.finished` in its outbox with the child's end, whichever way the
/// child ended.
async fn a_live_parent_hears_of_every_childs_end(s: Backend) {
    let parent = s
        .create_run(new_run(&ThreadId::generate()))
        .await
        .unwrap()
        .run;
    let Claim::Acquired(lp, _) = s
        .claim_run(parent.id, "w", Duration::from_secs(10))
        .await
        .unwrap()
    else {
        panic!()
    };
    let a = s.create_run(child_of(&parent)).await.unwrap().run;
    let b = s.create_run(child_of(&parent)).await.unwrap().run;
    assert_eq!(
        s.request_cancel(a.id).await.unwrap(),
        CancelOutcome::Cancelled
    );
    let Claim::Acquired(lb, _) = s
        .claim_run(b.id, "w", Duration::from_secs(10))
        .await
        .unwrap()
    else {
        panic!()
    };
    let err = RunError {
        kind: ErrorKind::Model,
        message: "m".into(),
    };
    s.checkpoint(
        &lb,
        Checkpoint {
            finish: Some(Finish::Failed(err)),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let ev = s.events_after(parent.id, 0, 100).await.unwrap();
    let finished: Vec<_> = ev
        .iter()
        .filter(|e| e.kind == "child.finished")
        .map(|e| (e.data["child_run_id"].clone(), e.data["status"].clone()))
        .collect();
    assert_eq!(
        finished,
        [
            (json!(a.id), json!("cancelled")),
            (json!(b.id), json!("failed"))
        ]
    );
    assert_eq!(
        ev.iter().map(|e| e.seq).collect::<Vec<_>>(),
        (1..=ev.len() as u64).collect::<Vec<_>>()
    );
    // The parent never parked on them: nothing to wake, and it still holds its lease.
    s.renew_lease(&lp).await.unwrap();
}

/// Hole 2: a park on runs that already ended is due at once (the end raced the park).
async fn a_park_on_ended_runs_is_due_at_once(s: Backend) {
    let parent = s
        .create_run(new_run(&ThreadId::generate()))
        .await
        .unwrap()
        .run;
    let Claim::Acquired(lp, _) = s
        .claim_run(parent.id, "w", Duration::from_secs(10))
        .await
        .unwrap()
    else {
        panic!()
    };
    let child = s.create_run(child_of(&parent)).await.unwrap().run;
    assert_eq!(
        s.request_cancel(child.id).await.unwrap(),
        CancelOutcome::Cancelled
    );
    let park = Park {
        waits_on: vec![child.id],
        ..Default::default()
    };
    assert_eq!(
        s.park(&lp, park).await.unwrap(),
        Parked::Parked { due: true }
    );
    let r = s.get_run(parent.id).await.unwrap().unwrap();
    assert!(r.status == RunStatus::Waiting && r.wake_at.is_some_and(|w| w <= now_ms()));
    assert!(
        s.orphans(Duration::ZERO)
            .await
            .unwrap()
            .iter()
            .any(|o| o.run_id == parent.id),
        "the reaper finds it due"
    );
}

/// A parent's end takes its attached children with it in the same commit — queued and parked
/// ones cancelled (and their own children), running ones asked to stop — so a crash right after
/// the parent's end cannot leave them going; detached children live on.
async fn a_runs_end_ends_its_attached_children_in_the_same_commit(s: Backend) {
    let parent = s
        .create_run(new_run(&ThreadId::generate()))
        .await
        .unwrap()
        .run;
    let Claim::Acquired(lp, _) = s
        .claim_run(parent.id, "w", Duration::from_secs(10))
        .await
        .unwrap()
    else {
        panic!()
    };
    let queued = s.create_run(child_of(&parent)).await.unwrap().run;
    let running = s.create_run(child_of(&parent)).await.unwrap().run;
    let Claim::Acquired(lr, _) = s
        .claim_run(running.id, "w", Duration::from_secs(10))
        .await
        .unwrap()
    else {
        panic!()
    };
    let parked = s.create_run(child_of(&parent)).await.unwrap().run;
    let Claim::Acquired(lw, _) = s
        .claim_run(parked.id, "w", Duration::from_secs(10))
        .await
        .unwrap()
    else {
        panic!()
    };
    let grandchild = s.create_run(child_of(&parked)).await.unwrap().run;
    s.park(
        &lw,
        Park {
            waits_on: vec![grandchild.id],
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let mut d = child_of(&parent);
    d.tree.detached = true;
    let detached = s.create_run(d).await.unwrap().run;
    let err = RunError {
        kind: ErrorKind::Model,
        message: "m".into(),
    };
    let ending = s
        .checkpoint(
            &lp,
            Checkpoint {
                finish: Some(Finish::Failed(err)),
                ..Default::default()
            },
        )
        .await
        .unwrap()
        .unwrap();
    assert!(
        ending.children_going,
        "its worker tells the running child at once"
    );
    let store = &s;
    let status = |id| async move { store.get_run(id).await.unwrap().unwrap() };
    assert_eq!(status(queued.id).await.status, RunStatus::Cancelled);
    assert_eq!(status(parked.id).await.status, RunStatus::Cancelled);
    assert_eq!(
        status(grandchild.id).await.status,
        RunStatus::Cancelled,
        "and their own children"
    );
    let r = status(running.id).await;
    assert!(
        r.status == RunStatus::Running && r.cancel_requested,
        "a running child is asked to stop: {r:?}"
    );
    assert!(s.renew_lease(&lr).await.unwrap().cancel_requested);
    assert_eq!(
        status(detached.id).await.status,
        RunStatus::Queued,
        "a detached child lives on"
    );
    for id in [queued.id, parked.id, grandchild.id] {
        let ev = s.events_after(id, 0, 100).await.unwrap();
        assert_eq!(ev.last().unwrap().kind, "run.cancelled");
        assert_eq!(
            ev.iter().map(|e| e.seq).collect::<Vec<_>>(),
            (1..=ev.len() as u64).collect::<Vec<_>>()
        );
    }
}

/// The state machine of `subagents::lifecycle`, walked pair by pair through the store's own
/// operations: every allowed pair moves the run to `next_status`, every other pair is refused
/// and leaves it as it was.
async fn the_transition_table_is_enforced(s: Backend) {
    use subagents::lifecycle::{Terminal, Transition, next_status};
    for from in RunStatus::ALL {
        for event in Transition::ALL {
            // `request_cancel` is one operation for two transitions (cancel what holds no
            // worker, ask a running run to stop): each is checked where the other is illegal.
            let other = match event {
                Transition::RequestCancel => Some(Transition::Cancel),
                Transition::Cancel => Some(Transition::RequestCancel),
                _ => None,
            };
            if other.is_some_and(|o| next_status(from, o).is_ok()) {
                continue;
            }
            let (run, lease) = run_in(&s, from).await;
            let applied = apply(&s, &run, &lease, event).await;
            let now = s.get_run(run.id).await.unwrap().unwrap().status;
            match next_status(from, event) {
                Ok(to) => {
                    assert!(
                        applied,
                        "{} on {}: allowed but refused",
                        from.as_str(),
                        event.name()
                    );
                    assert_eq!(now, to, "{} on {}", from.as_str(), event.name());
                }
                Err(_) => {
                    assert!(
                        !applied,
                        "{} on {}: illegal but applied",
                        from.as_str(),
                        event.name()
                    );
                    assert_eq!(
                        now,
                        from,
                        "{} on {}: refused but moved",
                        from.as_str(),
                        event.name()
                    );
                }
            }
        }
    }

    /// A run in `st`, with a lease carrying its current epoch (so only the status can refuse).
    async fn run_in(s: &Backend, st: RunStatus) -> (RunRecord, Lease) {
        let run = s
            .create_run(new_run(&ThreadId::generate()))
            .await
            .unwrap()
            .run;
        let ttl = Duration::from_millis(5);
        if st != RunStatus::Queued && st != RunStatus::Cancelled {
            let Claim::Acquired(lease, _) = s.claim_run(run.id, "w", ttl).await.unwrap() else {
                panic!()
            };
            match st {
                RunStatus::Waiting => {
                    s.park(
                        &lease,
                        Park {
                            wake_at: Some(now_ms() + 600_000),
                            ..Default::default()
                        },
                    )
                    .await
                    .unwrap();
                }
                RunStatus::Succeeded => {
                    let f = Finish::Succeeded {
                        result: "r".into(),
                        forced: false,
                    };
                    s.checkpoint(
                        &lease,
                        Checkpoint {
                            finish: Some(f),
                            ..Default::default()
                        },
                    )
                    .await
                    .unwrap();
                }
                RunStatus::Failed => {
                    let f = Finish::Failed(RunError {
                        kind: ErrorKind::Tool,
                        message: "t".into(),
                    });
                    s.checkpoint(
                        &lease,
                        Checkpoint {
                            finish: Some(f),
                            ..Default::default()
                        },
                    )
                    .await
                    .unwrap();
                }
                _ => {}
            }
        }
        if st == RunStatus::Cancelled {
            s.request_cancel(run.id).await.unwrap();
        }
        // Expired for `expire`/`give-up`; the epoch still matches for everything else.
        tokio::time::sleep(Duration::from_millis(10)).await;
        let run = s.get_run(run.id).await.unwrap().unwrap();
        assert_eq!(run.status, st);
        let lease = Lease {
            run_id: run.id,
            epoch: run.lease_epoch,
            owner: "w".into(),
            ttl,
            child: run.parent_run_id.is_some(),
        };
        (run, lease)
    }

    async fn apply(s: &Backend, run: &RunRecord, lease: &Lease, event: Transition) -> bool {
        match event {
            Transition::Claim => matches!(
                s.claim_run(run.id, "w2", Duration::from_secs(10))
                    .await
                    .unwrap(),
                Claim::Acquired(..)
            ),
            Transition::Heartbeat => s.renew_lease(lease).await.is_ok(),
            Transition::Park => {
                let park = Park {
                    wake_at: Some(now_ms() + 600_000),
                    ..Default::default()
                };
                matches!(s.park(lease, park).await, Ok(Parked::Parked { .. }))
            }
            Transition::Wake => s.wake(run.id).await.unwrap(),
            Transition::Release => s.release_lease(lease, &new_job_id(), false).await.unwrap(),
            Transition::Finish(t) => {
                let finish = match t {
                    Terminal::Succeeded => Finish::Succeeded {
                        result: "r".into(),
                        forced: false,
                    },
                    Terminal::Failed => Finish::Failed(RunError {
                        kind: ErrorKind::Tool,
                        message: "t".into(),
                    }),
                    Terminal::Cancelled => Finish::Cancelled,
                };
                s.checkpoint(
                    lease,
                    Checkpoint {
                        finish: Some(finish),
                        ..Default::default()
                    },
                )
                .await
                .is_ok()
            }
            Transition::RequestCancel => {
                s.request_cancel(run.id).await.unwrap() == CancelOutcome::Requested
            }
            Transition::Cancel => {
                s.request_cancel(run.id).await.unwrap() == CancelOutcome::Cancelled
            }
            Transition::Expire => s.expire_leases(1000).await.unwrap().contains(&Expired {
                run_id: run.id,
                gave_up: false,
            }),
            Transition::GiveUp => s.expire_leases(1).await.unwrap().contains(&Expired {
                run_id: run.id,
                gave_up: true,
            }),
        }
    }
}

async fn listing_and_tree_queries(s: Backend) {
    let t = ThreadId::generate();
    let root = s.create_run(new_run(&t)).await.unwrap().run;
    let mut c = new_run(&ThreadId::generate());
    c.parent_run_id = Some(root.id);
    c.tree = TreePosition {
        root_run_id: Some(root.id),
        depth: 1,
        detached: false,
    };
    let child = s.create_run(c).await.unwrap().run;
    let Claim::Acquired(lease, _) = s
        .claim_run(child.id, "w", Duration::from_secs(10))
        .await
        .unwrap()
    else {
        panic!()
    };
    let usage = subagents::model::Usage {
        prompt_tokens: 10,
        completion_tokens: 5,
        cache_read_tokens: 6,
        cache_write_tokens: 2,
    };
    s.checkpoint(
        &lease,
        Checkpoint {
            step: Some(2),
            usage,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let (tree, steps) = s.tree_usage(root.id).await.unwrap();
    assert_eq!((tree.total(), steps), (15, 2));
    assert_eq!((tree.cache_read_tokens, tree.cache_write_tokens), (6, 2));
    let row = s.get_run(child.id).await.unwrap().unwrap();
    assert_eq!(row.usage, usage, "the run's row sums the cache figures too");
    assert_eq!(
        s.children(root.id)
            .await
            .unwrap()
            .iter()
            .map(|r| r.id)
            .collect::<Vec<_>>(),
        [child.id]
    );
    let all = s
        .list_runs(&"o".into(), &RunFilter::default(), 10)
        .await
        .unwrap();
    assert_eq!(
        all.iter().map(|r| r.id).collect::<Vec<_>>(),
        [child.id, root.id],
        "newest first"
    );
    let running = s
        .list_runs(
            &"o".into(),
            &RunFilter {
                status: vec![RunStatus::Running],
                ..Default::default()
            },
            10,
        )
        .await
        .unwrap();
    assert_eq!(running.len(), 1);
    let page2 = s
        .list_runs(
            &"o".into(),
            &RunFilter {
                before: Some(child.id),
                ..Default::default()
            },
            10,
        )
        .await
        .unwrap();
    assert_eq!(page2.iter().map(|r| r.id).collect::<Vec<_>>(), [root.id]);
    assert!(
        s.list_runs(&"someone-else".into(), &RunFilter::default(), 10)
            .await
            .unwrap()
            .is_empty()
    );
    let counts = s.status_counts().await.unwrap();
    assert!(
        counts.contains(&(RunStatus::Queued, 1)) && counts.contains(&(RunStatus::Running, 1)),
        "{counts:?}"
    );
    assert_eq!(s.queue_position(root.id).await.unwrap(), 0);
    s.append_events(root.id, vec![sample("child.finished")])
        .await
        .unwrap();
    let ev = s.events_after(root.id, 0, 10).await.unwrap();
    assert_eq!(ev.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2]);
    assert!(s.get_thread(&t).await.unwrap().is_some());
    assert_eq!(s.next_queued(&t).await.unwrap(), None, "its job is pending");
    s.set_job_status(&root.job_id, "Killed").await;
    assert_eq!(s.next_queued(&t).await.unwrap(), Some(root.id));
}

/// `queue_rank` places a run among its owner's queued runs, from counts the database keeps
/// through every change of status (create, claim, cancel, release back to the queue): at the
/// back, behind every other queued run of its priority or a higher one; at the front, behind
/// only those of a higher priority. Checked against those definitions counted by hand.
async fn a_runs_rank_counts_the_queued_runs_ahead_of_it_in_its_owners_queue(s: Backend) {
    let mut runs: Vec<(RunId, &str, u8)> = vec![];
    for (i, priority) in [3u8, 5, 3, 1, 5, 3, 2, 5].into_iter().enumerate() {
        for owner in ["a", "b"] {
            let mut n = new_run(&ThreadId::generate());
            n.owner = owner.into();
            n.priority = priority;
            // Every other start joins at the front, as a child does.
            n.place = if i % 2 == 1 {
                QueuePlace::Front
            } else {
                QueuePlace::Back
            };
            let place = n.place;
            let created = s.create_run(n).await.unwrap();
            // The start answers with its place, counted as the rank counts it.
            let mine = runs.iter().filter(|o| o.1 == owner);
            let expected = match place {
                QueuePlace::Back => mine.filter(|o| o.2 >= priority).count(),
                QueuePlace::Front => mine.filter(|o| o.2 > priority).count(),
            } as u32;
            assert_eq!(
                created.ahead, expected,
                "start {i} of owner {owner}, priority {priority}, {place:?}"
            );
            runs.push((created.run.id, owner, priority));
        }
    }
    // Owner a's runs leave the queue: one runs, one is cancelled; a third runs and is given
    // back to the queue by a draining worker, so it counts again.
    let (running, cancelled, released) = (runs[2].0, runs[4].0, runs[6].0);
    assert!(matches!(
        s.claim_run(running, "w", Duration::from_secs(30))
            .await
            .unwrap(),
        Claim::Acquired(..)
    ));
    assert_eq!(
        s.request_cancel(cancelled).await.unwrap(),
        CancelOutcome::Cancelled
    );
    let Claim::Acquired(lease, _) = s
        .claim_run(released, "w", Duration::from_secs(30))
        .await
        .unwrap()
    else {
        panic!("claimable")
    };
    assert!(s.release_lease(&lease, &new_job_id(), false).await.unwrap());
    let queued: Vec<_> = runs
        .iter()
        .filter(|r| r.0 != running && r.0 != cancelled)
        .collect();
    for &(id, owner, priority) in &queued {
        let mine = || queued.iter().filter(|o| o.1 == *owner && o.0 != *id);
        let back = mine().filter(|o| o.2 >= *priority).count() as u32;
        let front = mine().filter(|o| o.2 > *priority).count() as u32;
        assert_eq!(
            s.queue_rank(*id, QueuePlace::Back).await.unwrap(),
            (back, *priority),
            "owner {owner}, priority {priority}, at the back"
        );
        assert_eq!(
            s.queue_rank(*id, QueuePlace::Front).await.unwrap(),
            (front, *priority),
            "owner {owner}, priority {priority}, at the front"
        );
    }
    // The counts hold under concurrent enqueues and claims (PostgreSQL spreads each owner's
    // count over stripes so these do not wait on one row).
    let made = futures::future::join_all((0..48).map(|_| {
        let mut n = new_run(&ThreadId::generate());
        n.owner = "c".into();
        s.create_run(n)
    }))
    .await;
    let ids: Vec<RunId> = made.into_iter().map(|c| c.unwrap().run.id).collect();
    let claims = futures::future::join_all(
        ids[..20]
            .iter()
            .map(|id| s.claim_run(*id, "w", Duration::from_secs(30))),
    )
    .await;
    assert!(claims.iter().all(|c| matches!(c, Ok(Claim::Acquired(..)))));
    assert_eq!(
        s.queue_rank(ids[47], QueuePlace::Back).await.unwrap(),
        (27, 3),
        "48 made, 20 claimed, itself not counted"
    );
    // A run no longer queued is ranked among the queued ones without counting itself.
    for (id, priority) in [(running, runs[2].2), (cancelled, runs[4].2)] {
        let of_a =
            |p: &dyn Fn(u8) -> bool| queued.iter().filter(|o| o.1 == "a" && p(o.2)).count() as u32;
        assert_eq!(
            s.queue_rank(id, QueuePlace::Back).await.unwrap(),
            (of_a(&|p| p >= priority), priority)
        );
        assert_eq!(
            s.queue_rank(id, QueuePlace::Front).await.unwrap(),
            (of_a(&|p| p > priority), priority)
        );
    }
}

/// A write transaction held open (SQLite: its one writing connection and the file's write lock;
/// PostgreSQL: the run's row lock) does not hold up the API's reads, which see the last commit;
/// and a write behind it queues and goes through once it ends, instead of failing.
async fn the_apis_reads_never_wait_for_an_open_write(s: Backend) {
    let t = ThreadId::generate();
    let run = s.create_run(new_run(&t)).await.unwrap().run;
    let held: Box<dyn std::any::Any + Send> = match &s.jobs {
        Jobs::Sqlite(p) => {
            let mut tx = p.begin().await.unwrap();
            sqlx::query("UPDATE sa_runs SET input = 'uncommitted' WHERE id = ?")
                .bind(run.id.to_string())
                .execute(&mut *tx)
                .await
                .unwrap();
            Box::new(tx)
        }
        Jobs::Postgres(p) => {
            let mut tx = p.begin().await.unwrap();
            sqlx::query("UPDATE sa_runs SET input = 'uncommitted' WHERE id = $1")
                .bind(run.id.to_string())
                .execute(&mut *tx)
                .await
                .unwrap();
            Box::new(tx)
        }
    };
    let quick = Duration::from_secs(3);
    let seen = tokio::time::timeout(quick, s.get_run(run.id))
        .await
        .expect("a run view waited for the writer")
        .unwrap()
        .unwrap();
    assert_eq!(
        seen.input, "hi",
        "a read sees the last commit, not the open write"
    );
    tokio::time::timeout(quick, s.events_after(run.id, 0, 10))
        .await
        .expect("an event page waited for the writer")
        .unwrap();
    let listed = tokio::time::timeout(quick, s.list_runs(&"o".into(), &RunFilter::default(), 10))
        .await
        .expect("a listing waited for the writer")
        .unwrap();
    assert_eq!(listed.len(), 1);
    tokio::time::timeout(quick, s.status_counts())
        .await
        .expect("the counts waited for the writer")
        .unwrap();
    // A start behind the open write waits for it rather than failing.
    let store = s.store.clone();
    let behind =
        tokio::spawn(async move { store.create_run(new_run(&ThreadId::generate())).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(held); // rolled back
    let started = tokio::time::timeout(Duration::from_secs(10), behind)
        .await
        .expect("the start behind the write never went through")
        .unwrap();
    assert!(started.is_ok(), "{started:?}");
    assert_eq!(s.get_run(run.id).await.unwrap().unwrap().input, "hi");
}

/// A `step.started` event, as the engine writes it.
fn step_started(step: u32) -> NewEvent {
    Event::StepStarted(subagents::domain::event::StepStarted {
        step,
        forced: false,
    })
    .into()
}

/// A `step.completed` event.
fn step_completed(step: u32) -> NewEvent {
    Event::StepCompleted(subagents::domain::event::StepCompleted { step }).into()
}

/// An event of type `name` (its sample payload: these tests look at seqs and effects, not data).
/// The compaction of a thread's first two messages (`all`, oldest first).
fn two_compacted(all: &[StoredMessage]) -> CompactionBody {
    CompactionBody {
        first_message_id: all[0].id,
        last_message_id: all[1].id,
        messages: 2,
        summary: "a and b".into(),
        tokens_before: 900,
        tokens_after: 300,
        reason: "threshold".into(),
    }
}

/// A checkpoint that ends its run succeeded (result "r"), with `events`.
fn succeeded(events: Vec<NewEvent>) -> Checkpoint {
    Checkpoint {
        events,
        finish: Some(Finish::Succeeded {
            result: "r".into(),
            forced: false,
        }),
        ..Default::default()
    }
}

fn sample(name: &str) -> NewEvent {
    Event::samples()
        .into_iter()
        .find(|e| e.name() == name)
        .expect("a sample of every type")
        .into()
}
