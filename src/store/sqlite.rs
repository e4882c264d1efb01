//! The SQLite store: the embedded default. WAL mode, `synchronous=NORMAL` (a committed step
//! survives a killed process), one writing connection per process (writers queue in its pool,
//! see [`SqliteStore::connect`]), a busy timeout for other processes on the same file, and the
//! schema in `migrations/sqlite`.
//!
//! SQLite serializes writers, so a fenced `UPDATE … WHERE lease_epoch = ?` at the start of each
//! transaction is both the fencing check and the lock that keeps event `seq` gap-free.

use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteRow, SqliteSynchronous,
};
use sqlx::{Row, SqlitePool};

use super::sql::{Common, SqlStore, Statements, corrupt};
use super::*;

/// The SQLite implementation of [`Store`].
#[derive(Clone, Debug)]
pub struct SqliteStore {
    /// The one connection that writes (see [`SqliteStore::connect`]).
    pool: SqlitePool,
    /// Connections for the API's reads (run views, waits, event pages, lists, the overview), so
    /// they never queue behind the writer. The worker's own reads (its context, the queue's
    /// rank, the next run of a thread) go through the writer, between its writes: there the
    /// page cache is warm, where a reading connection drops its whole cache each time the
    /// writer committed since its last read.
    reads: SqlitePool,
    common: Common,
    /// Stops the [`checkpointer`] when the last copy of the store goes.
    _checkpoints: std::sync::Arc<tokio_util::sync::DropGuard>,
}

/// How often a store folds the write-ahead log back into the database file.
const CHECKPOINT_EVERY: Duration = Duration::from_millis(100);

/// Frames (pages) in the write-ahead log past which [`checkpointer`] also folds it on the
/// writing connection: 16,384 pages, 64 MB at SQLite's default page size. Each such fold
/// holds the writer about 1.5 ms (measured in `serve` under sequential short runs); at 4,096
/// pages it came every quarter second there, and the slowest runs showed it.
const FOLD_ON_THE_WRITER_PAST: i64 = 16384;

/// The size the write-ahead log file is cut back to when the writer restarts it
/// (`journal_size_limit`): without it the file keeps the largest size it ever reached. 80 MB:
/// above the file [`FOLD_ON_THE_WRITER_PAST`] pages make (16,384 frames of 4 KB and their
/// headers, 67.5 MB), so a restart at the threshold does not cut what is regrown at once.
const LOG_FILE_LIMIT: &str = "83886080";

/// Folds the write-ahead log into the database file every [`CHECKPOINT_EVERY`], on a
/// connection of its own, so no commit waits for it. SQLite's automatic checkpoint is off
/// (`wal_autocheckpoint=0`): it ran inside whichever commit took the log past 1,000 pages, and
/// held that commit about 10 ms (measured: one short run in eight waited for it in
/// `bench-latency`, whatever step it was at). A passive checkpoint copies what no reader still
/// needs and never blocks the writer; the writer restarts the log once all of it was copied.
///
/// Under a steady stream of commits that moment never comes: each checkpoint copies the log
/// as it was when it began, and by its end the writer has appended more, so the log was never
/// all copied when a write began, and it grew by every commit (measured: 363 MB after 800
/// sequential short runs in `serve`, about 100 MB a second). So once the log holds more than
/// [`FOLD_ON_THE_WRITER_PAST`] pages, a second passive checkpoint runs on the writing
/// connection `writes`, where no commit can land during it: it copies only what came since
/// the first (about 1.5 ms here; it fsyncs the log and the database file, so a slower disk
/// holds the writer longer), and the next commit restarts the log from its start, the file
/// cut back to [`LOG_FILE_LIMIT`] (measured: the log file stayed at 25 MB through the same
/// 800 runs with a 4,096-page threshold). Being passive, it never waits for a reader: one still
/// reading old pages only delays the restart to a later tick.
async fn checkpointer(
    reads: SqlitePool,
    writes: SqlitePool,
    stop: tokio_util::sync::CancellationToken,
) {
    let mut tick = tokio::time::interval(CHECKPOINT_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        match fold_log(&reads).await {
            Ok(log) if log > FOLD_ON_THE_WRITER_PAST => {
                if let Err(e) = fold_log(&writes).await {
                    tracing::debug!(error = %e, "write-ahead log checkpoint on the writer failed; retrying at the next tick");
                }
            }
            Ok(_) => {}
            Err(e) => {
                tracing::debug!(error = %e, "write-ahead log checkpoint failed; retrying at the next tick")
            }
        }
    }
}

/// One passive checkpoint on a connection of `pool`; the pages in the log when it ran.
async fn fold_log(pool: &SqlitePool) -> Result<i64> {
    let (_busy, log, _copied): (i64, i64, i64) = sqlx::query_as("PRAGMA wal_checkpoint(PASSIVE)")
        .fetch_one(pool)
        .await?;
    Ok(log)
}

/// What the group committer needs of the store: the pool and the wake-ups (not the store
/// itself, which owns the committer's queue).
#[derive(Clone)]
pub(crate) struct Commits {
    pool: SqlitePool,
    notifier: std::sync::Arc<crate::notify::Notifier>,
    /// What a new event's `relayed` is (see `relays`).
    relayed: i64,
}

/// How long a pooled connection may sit idle before it is tested on its way out of the pool.
const PING_AFTER_IDLE: Duration = Duration::from_secs(1);

/// Both pools' settings. sqlx tests a connection when it leaves the idle queue
/// (`test_before_acquire`) and pings it again when it goes back (that one cannot be turned
/// off); each test is a hand-off to the connection's thread, with the one writing connection
/// held through it, so a statement cost three hand-offs. Here a connection is tested on its way
/// out only when it sat idle for a while: one that just came back has just passed the release
/// test, and nothing outside this process can drop a SQLite connection.
fn pool_options() -> SqlitePoolOptions {
    SqlitePoolOptions::new()
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for >= PING_AFTER_IDLE {
                    sqlx::Connection::ping(conn).await?;
                }
                Ok(true)
            })
        })
}

impl SqliteStore {
    /// Opens (creating the file if needed) and migrates both our schema and apalis's.
    ///
    /// Every write goes through one connection. SQLite lets one writer in at a time anyway;
    /// with several writing connections, the ones shut out sleep in SQLite's busy handler (1, 2,
    /// 5, 10 ms …) instead of queueing: measured about one such sleep per step in `bench`
    /// (`perf stat -e syscalls:sys_enter_clock_nanosleep`). The pool's queue hands the one
    /// connection over at once instead, and its page cache stays warm (a connection drops its
    /// whole cache whenever another one wrote since its last transaction): about a third less
    /// CPU per step than eight writing connections (docs/benchmarks.md). The API's reads have connections of their own (`reads`).
    pub async fn connect(url: &str) -> Result<SqliteStore> {
        let opts = SqliteConnectOptions::from_str(url)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(Duration::from_secs(30))
            .foreign_keys(true)
            .pragma("wal_autocheckpoint", "0")
            .pragma("journal_size_limit", LOG_FILE_LIMIT);
        let pool = pool_options()
            .max_connections(1)
            .min_connections(1)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(opts.clone())
            .await?;
        // The same options, so `sqlite::memory:` names the same shared in-memory database.
        let reads = pool_options()
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(30))
            .connect_lazy_with(opts);
        let stop = tokio_util::sync::CancellationToken::new();
        tokio::spawn(checkpointer(reads.clone(), pool.clone(), stop.clone()));
        // SQLite has one writer: one committer, so checkpoints never queue on its lock.
        let store = SqliteStore {
            pool,
            reads,
            common: Common::new(Default::default(), 1),
            _checkpoints: std::sync::Arc::new(stop.drop_guard()),
        };
        store.migrate().await?;
        Ok(store)
    }

    /// Applies migrations. apalis's and ours share `_sqlx_migrations`, so each migrator is told
    /// to ignore the other's entries.
    pub async fn migrate(&self) -> Result<()> {
        let mut ours = sqlx::migrate!("./migrations/sqlite");
        ours.set_ignore_missing(true);
        ours.run(&self.pool).await?;
        let mut apalis = apalis_sqlite::SqliteStorage::<()>::migrations();
        apalis.set_ignore_missing(true);
        apalis.run(&self.pool).await?;
        // apalis's `Jobs(lock_by)` index makes acks slow as finished jobs pile up (trap 2).
        sqlx::query("DROP INDEX IF EXISTS LIdx")
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// The writer's pool, shared with the apalis storage (whose fetches and acks are writes), so
    /// one connection writes the file.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// Tells the store whether a relay takes its events to Redis (this process has a
    /// `REDIS_URL`); without one, its events are written as relayed from now on.
    pub fn relaying(mut self, relays: bool) -> Self {
        self.common.relays = relays;
        self
    }
}

// SQLite serializes writers: the park's fence (a write) must come first, so the reads after it
// see the latest state (a read first would pin a snapshot that the write could not upgrade).
#[async_trait]
impl SqlStore for SqliteStore {
    type Db = sqlx::Sqlite;
    type Commits = Commits;
    const PARK_READS_FIRST: bool = false;
    const STATEMENTS_PER_COMMAND: bool = true;

    fn statements() -> &'static Statements {
        static S: std::sync::LazyLock<Statements> =
            std::sync::LazyLock::new(|| Statements::new(JOBS, WORKERS, "", "+owner", JOBS_NOW, ""));
        &S
    }

    fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    fn reads(&self) -> &SqlitePool {
        &self.reads
    }

    fn common(&self) -> &Common {
        &self.common
    }

    fn commits(&self) -> Commits {
        Commits {
            pool: self.pool.clone(),
            notifier: self.common.notifier.clone(),
            relayed: self.relayed_at_insert(),
        }
    }

    async fn start_run(&self, new: NewRun) -> Result<Created> {
        let now = group::Landed::stamp();
        let queued: NewEvent = Event::RunQueued(event::RunQueued {
            agent: new.agent.clone(),
            thread_id: new.thread_id.visible_to(&new.owner).to_string(),
            parent_run_id: new.parent_run_id,
        })
        .into();
        // One command to the connection's thread ([`START`]): its checks, its writes and its
        // `COMMIT`. A refused start writes nothing and commits an empty transaction; the rows
        // it answers with say why.
        let query = bind_new_run!(sqlx::query(START.as_str()), new, now)
            .bind(new.retry_of.map(|r| r.to_string()))
            .bind(i64::from(new.priority.clamp(1, 5)))
            .bind(new.agent_version.as_deref())
            .bind(queued.kind())
            .bind(queued.data().to_string())
            .bind(self.relayed_at_insert())
            .bind(new.if_busy == IfBusy::Reject)
            .bind(new.place == QueuePlace::Back)
            .bind(new.max_queued.min(i64::MAX as u64) as i64)
            .bind(new.held_by.as_deref())
            .bind(QUEUE_NAME)
            .bind(job_body(new.id))
            .bind(JOB_MAX_ATTEMPTS as i64)
            .bind(now.timestamp());
        // A failed command may leave the transaction open: its connection is closed, not
        // pooled (see `Unpooled`).
        let mut conn = Unpooled::new(self.pool.acquire().await?);
        let rows = query.fetch_all(&mut **conn.get()).await?;
        conn.pool();
        let part = |p: i32| rows.iter().find(|r| r.get::<i32, _>("part") == p);
        let (Some(inserted), Some(rank)) = (part(3), part(4)) else {
            let owner: Option<OwnerId> = part(0).map(|r| r.get("owner"));
            if owner.as_ref() != Some(&new.owner) {
                return Err(StoreError::ThreadOwnedElsewhere(new.thread_id));
            }
            if let Some(id) = part(1).map(|r| r.get::<String, _>("id")) {
                let id: RunId = id.parse().map_err(|e| corrupt("run id", e))?;
                let run = self
                    .get_run(id)
                    .await?
                    .ok_or_else(|| corrupt("run vanished", id))?;
                return Ok(Created {
                    run,
                    existing: true,
                    ahead: 0,
                    held: false,
                });
            }
            let owners_queued: i64 = part(5).map_or(0, |r| r.get("queued"));
            if new.max_queued > 0 && owners_queued.max(0) as u64 >= new.max_queued {
                return Err(StoreError::QueueFull {
                    cap: new.max_queued,
                });
            }
            if let Some(a) = part(2).map(|r| r.get::<String, _>("id")) {
                let active_run = a.parse().map_err(|e| corrupt("run id", e))?;
                return Err(StoreError::Busy {
                    thread_id: new.thread_id,
                    active_run,
                });
            }
            return Err(corrupt("a start wrote no run", new.id));
        };
        let run = Self::run_from_row(inserted)?;
        let (ahead, _) = Self::rank_from_row(rank, new.place);
        let held = part(6).is_some();
        if !held {
            self.common.notifier.job_queued();
        }
        self.committed_one(new.id, 1, || queued, now);
        Ok(Created {
            run,
            existing: false,
            ahead,
            held,
        })
    }

    async fn claim(
        &self,
        id: RunId,
        owner: &str,
        ttl: Duration,
        context: Option<u32>,
    ) -> Result<(Claim, Option<ThreadContext>)> {
        let now = group::Landed::stamp();
        let nms = now_ms();
        // One command to the connection's thread ([`CLAIM`], or [`CLAIM_WITH_CONTEXT`]): the
        // fenced UPDATE, the claim's event and the COMMIT, which commits nothing when the run
        // was not claimable.
        let query = sqlx::query(match context {
            None => CLAIM.as_str(),
            Some(_) => CLAIM_WITH_CONTEXT.as_str(),
        })
        .bind(owner)
        .bind(nms + ttl.as_millis() as i64)
        .bind(now)
        .bind(id.to_string())
        .bind(self.relayed_at_insert());
        let query = match context {
            None => query,
            Some(limit) => query.bind(i64::from(limit)),
        };
        let mut conn = Unpooled::new(self.pool.acquire().await?);
        let rows = query.fetch_all(&mut **conn.get()).await?;
        conn.pool();
        // The claimed row comes back whole, first and marked: no second read.
        let (claimed, context_rows) = match rows.split_first() {
            Some((r, rest)) if r.get::<i32, _>("part") == CLAIMED => (r, rest),
            _ => {
                let status = self.get_run(id).await?.map(|r| r.status);
                return Ok((Claim::NotClaimable(status), None));
            }
        };
        let run = Self::run_from_row(claimed)?;
        self.claimed(&run, owner, now);
        // The claim is committed: it never fails over its context. A fork's context goes on in
        // the threads it shares, and rows that do not read fail the run when its claimer reads
        // them itself (as `End::from(StoreError::Corrupt)` does): both read it apart.
        let context = context.and_then(|_| match Self::context_parts(context_rows) {
            Ok((whole, lineage)) if lineage.is_empty() => Some(whole),
            _ => None,
        });
        Ok((Claim::acquired(run, owner, ttl), context))
    }

    async fn commit_checkpoint(&self, lease: &Lease, cp: Checkpoint) -> Result<Option<Ending>> {
        let commits = self.commits();
        self.common.group.commit(&commits, lease, cp).await
    }

    /// One statement per run, in one transaction (SQLite statements cost no round trip).
    async fn unrelayed_events(&self, limit: u32) -> Result<Vec<EventRecord>> {
        let rows = sqlx::query(super::sql::UNRELAYED)
            .bind(limit as i64)
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(Self::event_from_row).collect()
    }

    async fn mark_relayed_ranges(&self, ranges: &[(RunId, u64, u64)]) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        for (run, first, last) in ranges {
            sqlx::query("UPDATE sa_events SET relayed = 1 WHERE run_id = $1 AND seq BETWEEN $2 AND $3 AND relayed = 0")
                .bind(run.to_string())
                .bind(*first as i64)
                .bind(*last as i64)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn workers(&self) -> Result<Vec<(String, DateTime<Utc>)>> {
        let rows =
            sqlx::query("SELECT id, last_seen FROM Workers ORDER BY last_seen DESC LIMIT 200")
                .fetch_all(self.reads())
                .await?;
        Ok(rows
            .iter()
            .map(|r| {
                (
                    r.get::<String, _>(0),
                    DateTime::from_timestamp(r.get::<i64, _>(1), 0).unwrap_or_default(),
                )
            })
            .collect())
    }
}

/// The `part` of a claim's own row, ahead of its context's rows (`context_rows!`'s 0, 1, 2).
const CLAIMED: i32 = 9;

/// A claim as one command: the fenced `UPDATE` (which takes SQLite's write lock) answering the
/// run's row and `part` [`CLAIMED`], the claim's `run.started` or `run.resumed` event as
/// [`super::sql::claim_event`] writes it, only where the `UPDATE` changed the run (`changes()`
/// is the last finished statement's), and the `COMMIT`, which commits nothing when the run was
/// not claimable. A queued run is claimable once its thread is free and it is the thread's
/// oldest; a parked one at any time (a spurious claim replays and parks again). The parameters
/// are the worker, the lease's expiry, the time, the run and the event's `relayed`.
static CLAIM: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| claim_sql(""));

/// [`CLAIM`] that also reads the run's context (`context_rows!` for its thread, the messages
/// limited by `$6`) in the claim's transaction, so it is what the claim saw; only when the
/// claim was made (the run is running under this worker since this claim's time), so an
/// unclaimable run reads nothing under the write lock.
static CLAIM_WITH_CONTEXT: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    claim_sql(concat!(
        "; SELECT * FROM (",
        context_rows!("(SELECT thread_id FROM sa_runs WHERE id = $4)", "$6"),
        ") WHERE EXISTS (SELECT 1 FROM sa_runs WHERE id = $4 AND status = 'running' \
           AND lease_owner = $1 AND heartbeat_at = $3) ORDER BY part, id"
    ))
});

fn claim_sql(context: &str) -> String {
    format!(
        concat!(
            "BEGIN IMMEDIATE; UPDATE sa_runs SET claimed_from = status, status = 'running', lease_owner = $1, lease_epoch = lease_epoch + 1, \
             lease_expires_at = $2, attempts = attempts + 1, started_at = COALESCE(started_at, $3), \
             heartbeat_at = $3, updated_at = $3, event_seq = event_seq + 1, wake_at = NULL \
             WHERE id = $4 AND status IN ({sources}) AND (status <> 'queued' OR ( \
               ",
            next_in_its_thread!("sa_runs", ""),
            ")) ",
            limits_guard!(),
            " RETURNING ",
            run_columns!(),
            ", {claimed} AS part; \
             INSERT INTO sa_events (run_id, seq, type, data, created_at, relayed) \
               SELECT id, event_seq, CASE WHEN claimed_from = 'waiting' THEN 'run.resumed' ELSE 'run.started' END, \
                 json_object('attempt', attempts, 'crashes', crashes, 'worker', $1, 'from', claimed_from), $3, $5 \
               FROM sa_runs WHERE id = $4 AND changes() = 1{context}; COMMIT"
        ),
        sources = crate::lifecycle::sql_sources(Transition::Claim),
        claimed = CLAIMED,
        context = context,
    )
}

/// apalis's job table.
const JOBS: &str = "Jobs";
/// apalis's worker table.
const WORKERS: &str = "Workers";
/// apalis's clock in its job table: seconds.
const JOBS_NOW: &str = "CAST(strftime('%s', 'now') AS INTEGER)";

/// What a start may not pass (repeated in each of its writes, so a refused start writes
/// nothing): the thread is new or the owner's, no run of the owner has the idempotency key, the
/// thread is not busy when a busy thread refuses (`$22`), and the owner's queue is under its
/// cap (`$24`, none when 0).
macro_rules! start_allowed {
    () => {
        "COALESCE((SELECT owner FROM sa_threads WHERE id = $2), $3) = $3 \
         AND NOT EXISTS (SELECT 1 FROM sa_runs WHERE owner = $3 AND idempotency_key = $9) \
         AND NOT ($22 AND EXISTS (SELECT 1 FROM sa_runs WHERE thread_id = $2 AND status IN ('queued','running','waiting'))) \
         AND ($24 = 0 OR (SELECT COALESCE(SUM(queued), 0) FROM sa_queue_depth WHERE owner = $3) < $24)"
    };
}

/// A start as one command: `BEGIN IMMEDIATE` takes SQLite's write lock first, so the checks and
/// the writes see one state and no other start slips in between. Each row says in `part` which
/// statement it comes from:
///
/// - 0, 1, 2, 5: what the checks saw (the thread's owner, a new thread counting as the
///   starter's; the run with the idempotency key; the thread's active run when a busy thread
///   refuses; the owner's queued runs), read before the writes so a refusal can say why.
/// - 3: the inserted run. The thread is upserted, and the run and its `run.queued` event
///   inserted, only where [`start_allowed!`] holds.
/// - 4: the run's place in its owner's queue ([`rank_of!`]).
/// - 6: the run's first job, as apalis's own push writes it (`queries/task/sink.sql` of
///   apalis-sqlite), with the priority `job_priority` gives its rank, handed to the worker
///   `$25` by the fence a notified worker's take has too ([`super::sql::take_job`]) when
///   the run is next in line. No row when it was left to the queue.
///
/// The parameters are `bind_new_run!`'s fifteen, then the retry's source, the priority, the
/// agent's version, the event's kind and data, its `relayed`, whether a busy thread refuses,
/// whether the run goes to the back of its priority, the owner's cap, the worker to hand the
/// job to, the queue, the job's body, its attempts and its `run_at`.
static START: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    // The run's rank as the row `rank_from_row` reads it: at the back, it does not count itself.
    let ahead = concat!(
        "(SELECT MAX(x.ahead - CASE WHEN $23 THEN x.queued ELSE 0 END, 0) FROM (SELECT ",
        rank_of!("$1", "$23"),
        ") x)"
    );
    format!(
        concat!(
            "BEGIN IMMEDIATE; \
             SELECT 0 AS part, COALESCE((SELECT owner FROM sa_threads WHERE id = $2), $3) AS owner; \
             SELECT 1 AS part, id FROM sa_runs WHERE owner = $3 AND idempotency_key = $9; \
             SELECT 2 AS part, id FROM sa_runs WHERE $22 AND thread_id = $2 \
               AND status IN ('queued','running','waiting') ORDER BY id LIMIT 1; \
             SELECT 5 AS part, CAST(COALESCE(SUM(queued), 0) AS BIGINT) AS queued FROM sa_queue_depth WHERE owner = $3; \
             INSERT INTO sa_threads (id, owner, created_at, updated_at) SELECT $2, $3, $12, $12 WHERE ",
            start_allowed!(),
            " ON CONFLICT(id) DO UPDATE SET updated_at = excluded.updated_at; \
             INSERT INTO sa_runs (id, thread_id, owner, agent, status, input, metadata, limits, parent_run_id, \
               idempotency_key, job_id, enqueued_at, created_at, updated_at, event_seq, root_run_id, depth, detached, retry_of, priority, agent_version) \
             SELECT $1, $2, $3, $4, 'queued', $5, $6, $7, $8, $9, $10, $11, $12, $12, 1, $13, $14, $15, $16, $17, $18 WHERE ",
            start_allowed!(),
            " RETURNING 3 AS part, ",
            run_columns!(),
            "; INSERT INTO sa_events (run_id, seq, type, data, created_at, relayed) \
               SELECT $1, 1, $19, $20, $12, $21 WHERE EXISTS (SELECT 1 FROM sa_runs WHERE id = $1); \
             SELECT 4 AS part, ",
            rank_of!("$1", "$23"),
            "; INSERT INTO {jobs} (job, id, job_type, status, attempts, max_attempts, run_at, priority) \
               SELECT $27, $10, $26, 'Pending', 0, $28, $29, 1000000000 - MIN({ahead}, 100000000) * 8 + MIN($17, 7) \
               WHERE EXISTS (SELECT 1 FROM sa_runs WHERE id = $1); \
             {take} AND {ahead} = 0 RETURNING 6 AS part; \
             COMMIT"
        ),
        jobs = JOBS,
        ahead = ahead,
        take = super::sql::take_job(JOBS, WORKERS, JOBS_NOW, ["$10", "$25", "$26"]),
    )
});

/// The thread's next queued run as a column of the terminal fence's `RETURNING`
/// ([`super::sql::next_queued`] about the ending run's own thread).
pub(super) static NEXT_QUEUED: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| super::sql::next_queued(JOBS, "sa_runs.thread_id"));

/// A terminal checkpoint's fence, with the `BEGIN` of its transaction in the same command:
/// moves the run's counters and its status only under this lease's epoch (and takes SQLite's
/// write lock, so the seqs it reserves stay gap-free). `None` when the fence did not hold; the
/// transaction is open either way.
///
/// Its row is the run's `event_seq`, `thread_id` and `parent_run_id`, the end's reach
/// ([`super::REACH_COLUMNS`]), and the thread's next queued run ([`NEXT_QUEUED`]): under the
/// write lock, no start can commit between that read and the end's `COMMIT`.
async fn fence(
    conn: &mut sqlx::SqliteConnection,
    lease: &Lease,
    cp: &Checkpoint,
    ff: FenceFields,
    now: DateTime<Utc>,
) -> Result<Option<SqliteRow>> {
    let sql = format!("BEGIN IMMEDIATE; {}", fence_sql(&ff, ""));
    let rows = bind_fence!(sqlx::query(sqlx::AssertSqlSafe(sql)), cp, ff, lease, now)
        .bind(cp.cost_nanos.min(i64::MAX as u64) as i64)
        .bind(cp.usage.cache_read_tokens as i64)
        .bind(cp.usage.cache_write_tokens as i64)
        .fetch_all(conn)
        .await?;
    Ok(rows.into_iter().next())
}

/// The terminal fence's `UPDATE` ([`fence`]), its `WHERE` narrowed further by `only_if`: its
/// values are `$1`..`$17` (`bind_fence!`, then the cost and the cache tokens).
fn fence_sql(ff: &FenceFields, only_if: &str) -> String {
    let (guard, reach_columns, unsteered) = (ff.guard, ff.reach_columns, ff.only_if);
    format!(
        "UPDATE sa_runs SET event_seq = event_seq + $1, step = COALESCE($2, step), \
         prompt_tokens = prompt_tokens + $3, completion_tokens = completion_tokens + $4, cost_nanos = cost_nanos + $15, \
         cache_read_tokens = cache_read_tokens + $16, cache_write_tokens = cache_write_tokens + $17, \
         lease_expires_at = CASE WHEN $5 IS NULL THEN $6 ELSE 0 END, heartbeat_at = $7, updated_at = $7, \
         status = COALESCE($5, status), result = COALESCE($8, result), forced = COALESCE($9, forced), \
         error_kind = COALESCE($10, error_kind), error_message = COALESCE($11, error_message), \
         finished_at = COALESCE($12, finished_at), \
         cancel_requested = CASE WHEN $5 IS NULL THEN cancel_requested ELSE 0 END \
         WHERE id = $13 AND lease_epoch = $14 AND status IN ({guard}){unsteered}{only_if} \
         RETURNING event_seq, thread_id, parent_run_id{reach_columns}, ({next})",
        next = *NEXT_QUEUED,
    )
}

/// Binds values as the `?`s of a `SELECT` that answers no row, placed before statements that
/// name them `$1`, `$2`, …: sqlx-sqlite numbers a command's `?`s across its statements, after
/// those of the statements before, so the `?`s of the statements after go on from there.
/// This lets one command hold a `$N` statement and `QueryBuilder` rows after it.
struct Leading<'a>(sqlx::query_builder::Separated<'a, sqlx::Sqlite, &'static str>);

impl Leading<'_> {
    fn bind<'t, T: sqlx::Encode<'t, sqlx::Sqlite> + sqlx::Type<sqlx::Sqlite>>(
        mut self,
        value: T,
    ) -> Self {
        self.0.push_bind(value);
        self
    }
}

/// A run's end that tells nobody, as one command: the terminal fence narrowed by
/// [`super::ENDS_ALONE`] (no parent, no waits, no attached child going), its rows and the
/// settle of its job, each written only where that fence changed the run, and the `COMMIT`.
/// `None` when the fence did not hold (the run is not alone, or the lease is lost): the command
/// then committed nothing, and the end goes the long way, which finds out which.
async fn end_alone(
    conn: &mut sqlx::SqliteConnection,
    lease: &Lease,
    cp: &Checkpoint,
    now: DateTime<Utc>,
    relayed: i64,
) -> Result<Option<(SqliteRow, Option<String>)>> {
    let ff = cp.fence_fields(now);
    let status = ff.status;
    let sql = fence_sql(&ff, super::ENDS_ALONE);
    let mut q = sqlx::QueryBuilder::<sqlx::Sqlite>::new("BEGIN IMMEDIATE; SELECT ");
    bind_fence!(Leading(q.separated(", ")), cp, ff, lease, now)
        .bind(cp.cost_nanos.min(i64::MAX as u64) as i64)
        .bind(cp.usage.cache_read_tokens as i64)
        .bind(cp.usage.cache_write_tokens as i64);
    q.push(" WHERE 0; ").push(sql);
    // The run as this fence leaves it, and no other way: its epoch, the terminal status and
    // this commit's own time.
    let ended = |q: &mut sqlx::QueryBuilder<sqlx::Sqlite>| {
        q.push(" AND r.status = ")
            .push_bind(status)
            .push(" AND r.lease_expires_at = 0 AND r.updated_at = ")
            .push_bind(now);
    };
    rows_sql(&mut q, [(lease, cp)], now, relayed, &ended);
    q.push("; ");
    settle_sql(&mut q, &lease.run_id.to_string(), &lease.owner, &|q| {
        q.push(" AND r.lease_epoch = ").push_bind(lease.epoch);
        ended(q);
    });
    q.push("; COMMIT");
    let rows = q.build().fetch_all(conn).await?;
    let mut rows = rows.into_iter();
    let Some(fenced) = rows.next().filter(|r| r.columns().len() > 1) else {
        return Ok(None);
    };
    Ok(Some((fenced, rows.next().map(|r| r.get(0)))))
}

/// Appends to `q` the statement that marks the job of the ending run `run` done when `worker`
/// holds it, as `settle_held_job` does ([`Ending::job_done`]), `RETURNING` its id; `fenced` adds
/// to the `WHERE` that finds the run `r` (what its fence left).
fn settle_sql(
    q: &mut sqlx::QueryBuilder<sqlx::Sqlite>,
    run: &str,
    worker: &str,
    fenced: &dyn Fn(&mut sqlx::QueryBuilder<sqlx::Sqlite>),
) {
    q.push(&SqliteStore::statements().mark_job_done)
        .push("id = (SELECT r.job_id FROM sa_runs r WHERE r.id = ")
        .push_bind(run);
    fenced(q);
    q.push(") AND lock_by = ")
        .push_bind(worker)
        .push(" RETURNING id");
}

/// The thread's next queued run, from a terminal fence's row ([`NEXT_QUEUED`], column 5).
fn next_queued_of(row: &SqliteRow) -> Result<Option<RunId>> {
    row.get::<Option<String>, _>(5)
        .map(|id| id.parse().map_err(|e| corrupt("run id", e)))
        .transpose()
}

/// The messages, events and pins of a terminal checkpoint whose fence held, written as one
/// command (one INSERT per table, sqlx binding each statement's `?`s in turn): on SQLite every
/// command is a round trip to the connection's thread, two thread switches.
#[derive(Default)]
struct Appends<'a> {
    /// Thread, run and message.
    messages: Vec<(String, String, &'a NewMessage)>,
    /// Run, seq and event.
    events: Vec<(String, i64, &'a NewEvent)>,
    /// Run, name and value of each pin.
    pins: Vec<(String, &'a str, &'a str)>,
    /// The ending run and its worker: the run's job, held by that worker, is marked done in
    /// the same transaction ([`Ending::job_done`]).
    settle: Option<(String, &'a str)>,
}

impl<'a> Appends<'a> {
    /// Adds `cp`'s rows, its events numbered to end at `last` (where its fence moved `event_seq`).
    fn add(&mut self, run: RunId, thread: String, last: i64, cp: &'a Checkpoint) {
        let run = run.to_string();
        let first = last - cp.events.len() as i64 + 1;
        self.events.extend(
            cp.events
                .iter()
                .enumerate()
                .map(|(i, e)| (run.clone(), first + i as i64, e)),
        );
        self.messages
            .extend(cp.messages.iter().map(|m| (thread.clone(), run.clone(), m)));
        self.pins.extend(
            cp.pins
                .iter()
                .map(|(n, v)| (run.clone(), n.as_str(), v.as_str())),
        );
    }

    /// Writes the rows; `relayed` is what a new event's `relayed` is (the store's).
    /// With `commit`, the transaction's `COMMIT` goes in the same command. Answers the job it
    /// settled, if any.
    async fn insert(
        &self,
        conn: &mut sqlx::SqliteConnection,
        now: DateTime<Utc>,
        relayed: i64,
        commit: bool,
    ) -> Result<Option<String>> {
        // SQLite allows 32,766 bound values per statement: 7 per message, 6 per event. The
        // statements go as one query (sqlx binds each statement's `?`s in turn): one round
        // trip to the connection's thread rather than one per table.
        let mut q = sqlx::QueryBuilder::<sqlx::Sqlite>::new("");
        let mut statements = 0;
        let mut next = |q: &mut sqlx::QueryBuilder<sqlx::Sqlite>, sql: &str| {
            if statements > 0 {
                q.push("; ");
            }
            statements += 1;
            q.push(sql);
        };
        for chunk in self.messages.chunks(1000) {
            next(
                &mut q,
                "INSERT INTO sa_messages (thread_id, run_id, step, role, key, body, created_at) ",
            );
            q.push_values(chunk, |mut b, (thread, run, m)| {
                b.push_bind(thread.as_str())
                    .push_bind(run.as_str())
                    .push_bind(m.step as i64)
                    .push_bind(m.message.role())
                    .push_bind(m.key.as_str())
                    .push_bind(serde_json::to_string(&m.message).expect("message serializes"))
                    .push_bind(now);
            });
            q.push(" ON CONFLICT(key) DO NOTHING");
        }
        for chunk in self.events.chunks(1000) {
            next(
                &mut q,
                "INSERT INTO sa_events (run_id, seq, type, data, created_at, relayed) ",
            );
            q.push_values(chunk, |mut b, (run, seq, e)| {
                b.push_bind(run.as_str())
                    .push_bind(*seq)
                    .push_bind(e.kind())
                    .push_bind(e.data().to_string())
                    .push_bind(now)
                    .push_bind(relayed);
            });
        }
        for chunk in self.pins.chunks(1000) {
            next(&mut q, "INSERT INTO sa_run_pins (run_id, name, value) ");
            q.push_values(chunk, |mut b, (run, name, value)| {
                b.push_bind(run.as_str()).push_bind(*name).push_bind(*value);
            });
            q.push(" ON CONFLICT(run_id, name) DO NOTHING");
        }
        if let Some((run, worker)) = &self.settle {
            // As `settle_held_job` marks it done; the only statement here that returns rows.
            next(&mut q, "");
            settle_sql(&mut q, run, worker, &|_| {});
        }
        if commit {
            next(&mut q, "COMMIT");
        }
        if statements == 0 {
            return Ok(None);
        }
        let rows = q.build().fetch_all(conn).await?;
        Ok(rows.first().map(|r| r.get(0)))
    }
}

/// Appends to `q` (after its `BEGIN`) the statements of a progress commit of `items`: one
/// fenced `UPDATE` of their runs, each row under its own epoch (`RETURNING` the run and where
/// its events end), then one `INSERT … SELECT` each for their messages, events and pins. Those
/// join every row to its run under the same fence, so a run whose fence failed writes nothing,
/// and number the events back from the run's new `event_seq`: no answer from the `UPDATE` is
/// needed before the rows go, and the whole commit is one command. The fence reads the same
/// after the `UPDATE` as before it: a progress checkpoint moves neither the epoch nor the
/// status. (Each `SELECT` ends in a `WHERE`, which SQLite needs to tell an upsert's `ON` from a
/// join's.)
fn progress_sql(
    q: &mut sqlx::QueryBuilder<sqlx::Sqlite>,
    items: &[(Lease, Checkpoint)],
    now: DateTime<Utc>,
    relayed: i64,
    guard: &str,
) {
    let now_ms = now_ms();
    // 10 bound values per run, 7 per message, 8 per event, 4 per pin: SQLite allows 32,766
    // per statement.
    for chunk in items.chunks(1000) {
        q.push(
            "; UPDATE sa_runs SET event_seq = event_seq + t.column3, step = COALESCE(t.column4, step), \
             prompt_tokens = prompt_tokens + t.column5, completion_tokens = completion_tokens + t.column6, \
             cost_nanos = cost_nanos + t.column7, lease_expires_at = t.column8, \
             cache_read_tokens = cache_read_tokens + t.column9, cache_write_tokens = cache_write_tokens + t.column10, heartbeat_at = ",
        );
        q.push_bind(now)
            .push(", updated_at = ")
            .push_bind(now)
            .push(" FROM (");
        q.push_values(chunk, |mut b, (lease, cp)| {
            b.push_bind(lease.run_id.to_string())
                .push_bind(lease.epoch)
                .push_bind(cp.events.len() as i64)
                .push_bind(cp.step.map(i64::from))
                .push_bind(cp.usage.prompt_tokens as i64)
                .push_bind(cp.usage.completion_tokens as i64)
                .push_bind(cp.cost_nanos.min(i64::MAX as u64) as i64)
                .push_bind(now_ms + lease.ttl.as_millis().min(i64::MAX as u128 / 2) as i64)
                .push_bind(cp.usage.cache_read_tokens as i64)
                .push_bind(cp.usage.cache_write_tokens as i64);
        });
        q.push(") AS t WHERE sa_runs.id = t.column1 AND sa_runs.lease_epoch = t.column2 AND sa_runs.status IN (")
            .push(guard)
            .push(") RETURNING sa_runs.id, sa_runs.event_seq");
    }
    rows_sql(q, items.iter().map(|(l, cp)| (l, cp)), now, relayed, &|q| {
        q.push(" AND r.status IN (").push(guard).push(")");
    });
}

/// Appends to `q` one `INSERT … SELECT` each for the messages, events and pins of `items`,
/// after the `UPDATE` that fenced their runs: each row joins its run under its epoch and
/// `fenced` (more of the join's `WHERE`, about the run `r`: what the fence left), so a run
/// whose fence failed writes nothing, and the events are numbered back from the run's new
/// `event_seq`.
fn rows_sql<'a>(
    q: &mut sqlx::QueryBuilder<sqlx::Sqlite>,
    items: impl IntoIterator<Item = (&'a Lease, &'a Checkpoint)>,
    now: DateTime<Utc>,
    relayed: i64,
    fenced: &dyn Fn(&mut sqlx::QueryBuilder<sqlx::Sqlite>),
) {
    // Each row with its run and epoch (the fence). `CROSS JOIN` keeps the rows in their order
    // (SQLite loops over its left side first), so a thread's messages take their ids in the
    // order the checkpoints hold them, and each run is found by its key.
    let mut messages = vec![];
    let mut events = vec![];
    let mut pins = vec![];
    for (lease, cp) in items {
        let run = lease.run_id.to_string();
        messages.extend(cp.messages.iter().map(|m| (run.clone(), lease.epoch, m)));
        let n = cp.events.len() as i64;
        events.extend(
            cp.events
                .iter()
                .enumerate()
                .map(|(i, e)| (run.clone(), lease.epoch, n - 1 - i as i64, e)),
        );
        pins.extend(
            cp.pins
                .iter()
                .map(|(k, v)| (run.clone(), lease.epoch, k.as_str(), v.as_str())),
        );
    }
    let fence = |q: &mut sqlx::QueryBuilder<sqlx::Sqlite>, epoch: &str| {
        q.push(") AS v CROSS JOIN sa_runs r WHERE r.id = v.column1 AND r.lease_epoch = v.")
            .push(epoch);
        fenced(q);
    };
    for chunk in messages.chunks(1000) {
        q.push(
            "; INSERT INTO sa_messages (thread_id, run_id, step, role, key, body, created_at) \
             SELECT r.thread_id, v.column1, v.column3, v.column4, v.column5, v.column6, v.column7 FROM (",
        );
        q.push_values(chunk, |mut b, (run, epoch, m)| {
            b.push_bind(run.as_str())
                .push_bind(*epoch)
                .push_bind(m.step as i64)
                .push_bind(m.message.role())
                .push_bind(m.key.as_str())
                .push_bind(serde_json::to_string(&m.message).expect("message serializes"))
                .push_bind(now);
        });
        fence(q, "column2");
        q.push(" ON CONFLICT(key) DO NOTHING");
    }
    for chunk in events.chunks(1000) {
        q.push(
            "; INSERT INTO sa_events (run_id, seq, type, data, created_at, relayed) \
             SELECT v.column1, r.event_seq - v.column3, v.column4, v.column5, v.column6, v.column7 FROM (",
        );
        q.push_values(chunk, |mut b, (run, epoch, back, e)| {
            b.push_bind(run.as_str())
                .push_bind(*epoch)
                .push_bind(*back)
                .push_bind(e.kind())
                .push_bind(e.data().to_string())
                .push_bind(now)
                .push_bind(relayed);
        });
        fence(q, "column2");
    }
    for chunk in pins.chunks(1000) {
        q.push("; INSERT INTO sa_run_pins (run_id, name, value) SELECT v.column1, v.column3, v.column4 FROM (");
        q.push_values(chunk, |mut b, (run, epoch, name, value)| {
            b.push_bind(run.as_str())
                .push_bind(*epoch)
                .push_bind(*name)
                .push_bind(*value);
        });
        fence(q, "column2");
        q.push(" ON CONFLICT(run_id, name) DO NOTHING");
    }
}

/// A pooled connection that goes back to the pool only when told ([`Unpooled::pool`]): one
/// dropped before that, mid-transaction or after an error, is closed instead, which rolls back
/// whatever it had not committed.
struct Unpooled(Option<sqlx::pool::PoolConnection<sqlx::Sqlite>>);

impl Unpooled {
    fn new(conn: sqlx::pool::PoolConnection<sqlx::Sqlite>) -> Self {
        Unpooled(Some(conn))
    }

    fn get(&mut self) -> &mut sqlx::pool::PoolConnection<sqlx::Sqlite> {
        self.0.as_mut().expect("held until pooled or dropped")
    }

    /// Its transaction is over: back to the pool.
    fn pool(mut self) {
        self.0.take();
    }

    /// Rolls its transaction back; back to the pool if that worked, else closed.
    async fn rollback(mut self) {
        if sqlx::query("ROLLBACK")
            .execute(&mut **self.get())
            .await
            .is_ok()
        {
            self.pool();
        }
    }
}

impl Drop for Unpooled {
    fn drop(&mut self) {
        if let Some(mut conn) = self.0.take() {
            conn.close_on_drop();
        }
    }
}

/// What a renewal's `RETURNING …, cancel_requested, inbox` row tells the holder.
fn lease_status(r: &SqliteRow) -> LeaseStatus {
    LeaseStatus::from_columns(r.get(1), r.get(2))
}

impl group::Renewals for Commits {
    async fn renew_many(&self, leases: &[Lease]) -> Result<Vec<Option<LeaseStatus>>> {
        // One fenced UPDATE for the whole group (one write transaction): each row only under
        // its own epoch and in a status a heartbeat may renew.
        let now = now_ms();
        let mut q = sqlx::QueryBuilder::<sqlx::Sqlite>::new(
            "UPDATE sa_runs SET lease_expires_at = t.column3, heartbeat_at = ",
        );
        q.push_bind(Utc::now()).push(" FROM (");
        q.push_values(leases, |mut b, l| {
            b.push_bind(l.run_id.to_string())
                .push_bind(l.epoch)
                .push_bind(now + l.ttl.as_millis() as i64);
        });
        q.push(") AS t WHERE sa_runs.id = t.column1 AND sa_runs.lease_epoch = t.column2 AND sa_runs.status IN (")
            .push(crate::lifecycle::sql_sources(Transition::Heartbeat))
            .push(") RETURNING sa_runs.id, sa_runs.cancel_requested, sa_runs.inbox");
        let rows = q.build().fetch_all(&self.pool).await?;
        let renewed: std::collections::HashMap<String, LeaseStatus> = rows
            .iter()
            .map(|r| (r.get::<String, _>(0), lease_status(r)))
            .collect();
        Ok(leases
            .iter()
            .map(|l| renewed.get(&l.run_id.to_string()).copied())
            .collect())
    }
}

impl group::Progress for Commits {
    async fn commit_one(&self, lease: Lease, cp: Checkpoint) -> Result<Option<Ending>> {
        if cp.finish.is_none() {
            // Progress: the group's single command, with one item.
            let run = lease.run_id;
            let items = [(lease, cp)];
            let landed = self.commit_many(&items).await?.pop().flatten();
            let Some(landed) = landed else {
                return Err(StoreError::LeaseLost(run));
            };
            self.announce(run, &items[0].1, landed);
            return Ok(None);
        }
        let now = group::Landed::stamp();
        let ff = cp.fence_fields(now);
        let Some(status) = ff.status else {
            return Err(StoreError::Corrupt(
                "a terminal checkpoint without a status".into(),
            ));
        };
        // Most runs' ends tell nobody (a top-level run nobody awaits, without children still
        // going): those end in one command, fenced on having none ([`end_alone`]). Any other
        // end, and a lost lease, wrote nothing there and take two commands or more: the fence
        // with its BEGIN, the rows, and the effects on other runs between them and the COMMIT.
        // A child's end (its lease knows) goes there at once: it tells its parent.
        let mut conn = Unpooled::new(self.pool.acquire().await?);
        let alone = match lease.child {
            false => end_alone(conn.get(), &lease, &cp, now, self.relayed).await?,
            true => None,
        };
        if let Some((row, job_done)) = alone {
            conn.pool();
            let next = next_queued_of(&row)?;
            self.notifier.notify(lease.run_id);
            // Fenced on having no child still going.
            return Ok(Some(Ending {
                children_going: false,
                next: NextQueued::Known(next),
                job_done,
            }));
        }
        let Some(row) = fence(conn.get(), &lease, &cp, ff, now).await? else {
            conn.rollback().await;
            return Err(StoreError::LeaseLost(lease.run_id));
        };
        let mut rows = Appends {
            settle: Some((lease.run_id.to_string(), lease.owner.as_str())),
            ..Default::default()
        };
        rows.add(lease.run_id, row.get(1), row.get(0), &cp);
        let children_going = row.get::<bool, _>(4);
        let alone =
            row.get::<Option<String>, _>(2).is_none() && !row.get::<bool, _>(3) && !children_going;
        let next = next_queued_of(&row)?;
        let job_done = rows.insert(conn.get(), now, self.relayed, alone).await?;
        if !alone {
            SqliteStore::end_effects(
                conn.get(),
                lease.run_id,
                &row,
                status,
                cp.error(),
                self.relayed,
            )
            .await?;
            sqlx::query("COMMIT").execute(&mut **conn.get()).await?;
        }
        conn.pool();
        // A run's end may have written events of other runs (its parent's): the relay reads
        // the outbox for those.
        self.notifier.notify(lease.run_id);
        Ok(Some(Ending {
            children_going,
            next: NextQueued::Known(next),
            job_done,
        }))
    }

    async fn commit_many(
        &self,
        items: &[(Lease, Checkpoint)],
    ) -> Result<Vec<Option<group::Landed>>> {
        let now = group::Landed::stamp();
        // Progress only (a terminal checkpoint commits alone): one fenced UPDATE for every run
        // of the group, each row under its own epoch, then one INSERT for all their messages,
        // one for all their events and one for their pins, in one transaction sent as one
        // command ([`progress_sql`]), whatever the group's size.
        if items.iter().any(|(_, cp)| cp.finish.is_some()) {
            return Err(StoreError::Corrupt(
                "a terminal checkpoint in a group commit".into(),
            ));
        }
        // A run has one checkpoint in flight; were it twice here, the join would apply only
        // one of them: the group then goes one by one.
        if items
            .iter()
            .map(|(l, _)| l.run_id)
            .collect::<std::collections::HashSet<_>>()
            .len()
            != items.len()
        {
            return Err(StoreError::Corrupt(
                "one run twice in a group commit".into(),
            ));
        }
        let mut q = sqlx::QueryBuilder::<sqlx::Sqlite>::new("BEGIN IMMEDIATE");
        let guard = crate::lifecycle::sql_sources(Transition::Heartbeat);
        progress_sql(&mut q, items, now, self.relayed, &guard);
        q.push("; COMMIT");
        // The statements go as one command to the connection's thread: one hand-off, where a
        // transaction of its own costs four (BEGIN, the fence, the rows, COMMIT), each two
        // thread switches (docs/benchmarks.md). A failed command may leave the transaction
        // open, and a dropped one stops wherever it was: either way the connection is closed,
        // not pooled (closing rolls back what it had not committed), and the next statement
        // opens a fresh one.
        let mut conn = Unpooled::new(self.pool.acquire().await?);
        let rows = q.build().fetch_all(&mut **conn.get()).await?;
        conn.pool();
        let mut fenced: std::collections::HashMap<String, i64> =
            rows.iter().map(|r| (r.get(0), r.get(1))).collect();
        Ok(items
            .iter()
            .map(|(lease, _)| {
                fenced
                    .remove(&lease.run_id.to_string())
                    .map(|last| group::Landed { last, at: now })
            })
            .collect())
    }

    fn announce(&self, run: RunId, cp: &Checkpoint, landed: group::Landed) {
        self.notifier
            .committed(run, false, || cp.records(run, landed.last, landed.at));
    }
}
