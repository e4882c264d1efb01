//! What the SQL both backends share stands on: [`SqlStore`], the little a backend provides
//! (its pools, its notifiers, the statements that really differ, and its own start, claim and
//! checkpoint), and the helpers every store trait's shared statements use.
//!
//! The store traits are implemented once, generically, for every `SqlStore` (in `shared/`, one
//! file per trait). Every statement there is valid on SQLite and on PostgreSQL (`$N`
//! placeholders, which sqlx binds positionally on both; `CAST` instead of `::`). Status guards
//! come from [`crate::lifecycle::sql_sources`], so a statement can only apply a move the state
//! machine allows.
//!
//! Generic code over a sqlx database must name what it uses of it: that its connections
//! execute, and that the column types it binds and reads encode and decode. Rust does not carry
//! such bounds from a trait to its users, so each generic impl repeats the list (the `where`
//! clause of [`SqlStore`]); a concrete backend meets it without a word.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::{ColumnIndex, Database, Decode, Encode, Executor, IntoArguments, Row, Type};

use super::*;
use crate::notify::Notifier;

/// A column type both backends bind and read the same way.
pub(crate) trait Col<DB: Database>:
    Type<DB> + for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB>
{
}

impl<DB: Database, T: Type<DB> + for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB>> Col<DB> for T {}

/// A backend's connection, arguments and row (the names the generic impls' bounds use).
pub(crate) type Conn<S> = <<S as SqlStore>::Db as Database>::Connection;
/// See [`Conn`].
pub(crate) type Args<S> = <<S as SqlStore>::Db as Database>::Arguments;
/// See [`Conn`].
pub(crate) type DbRow<S> = <<S as SqlStore>::Db as Database>::Row;

/// How many rows a statement changed, whichever the backend.
pub(crate) trait Affected {
    /// The rows the statement inserted, changed or deleted.
    fn rows_affected(&self) -> u64;
}

impl Affected for sqlx::sqlite::SqliteQueryResult {
    fn rows_affected(&self) -> u64 {
        self.rows_affected()
    }
}

impl Affected for sqlx::postgres::PgQueryResult {
    fn rows_affected(&self) -> u64 {
        self.rows_affected()
    }
}

/// The statements that differ between the backends only in a table name or a lock clause,
/// built once per backend (a `static` in a generic function would be one for both).
pub(crate) struct Statements {
    /// [`Runs::next_queued`].
    pub(crate) next_queued: String,
    /// [`Claims::fetched_not_started`].
    pub(crate) fetched_not_started: String,
    /// [`Claims::held_elsewhere`].
    pub(crate) held_elsewhere: String,
    /// [`Claims::settle_held_job`].
    pub(crate) settle_held_job: String,
    /// A run's end marking the job its worker holds done, as [`Claims::settle_held_job`] does:
    /// the `UPDATE` up to its `WHERE`, to which each backend adds which job and which worker
    /// ([`super::Ending::job_done`]).
    pub(crate) mark_job_done: String,
    /// [`Claims::take_job`].
    pub(crate) take_job: String,
    /// [`Claims::orphans`].
    pub(crate) orphans: String,
    /// The overview's events (see [`Queries::overview`]).
    pub(crate) overview_events: String,
    /// [`Harness::wipe`]'s jobs.
    pub(crate) wipe_jobs: String,
    /// A run's status, read with the park's lock (see [`SqlStore::any_ended`]).
    pub(crate) run_status: String,
    /// An approval's status, read with the park's lock (see [`SqlStore::answered`]).
    pub(crate) approval_status: String,
}

/// [`Runs::next_queued`]'s question about the thread `thread` (an SQL expression: a parameter,
/// or the ending run's own column in SQLite's terminal fence), with apalis's job table `jobs`:
/// the thread's oldest queued run, NULL when that already has a pending job, no row when none
/// is queued. The thread's runs come from `sa_runs_thread_live`, as in `none_queued_before!`.
pub(crate) fn next_queued(jobs: &str, thread: &str) -> String {
    format!(
        "SELECT CASE WHEN EXISTS (SELECT 1 FROM {jobs} j WHERE j.id = q.job_id AND j.status = 'Pending') \
           THEN NULL ELSE q.id END \
         FROM sa_runs q WHERE q.thread_id = {thread} \
           AND q.status IN ('queued', 'running', 'waiting') AND q.status NOT IN ('running', 'waiting') \
         ORDER BY q.id LIMIT 1"
    )
}

/// [`Claims::take_job`]'s `UPDATE` without its `RETURNING`, about the job, the worker and the
/// queue named by `[job, worker, queue]` (SQL expressions, parameters). Locked as apalis's fetch
/// locks a job, only when that fetch would have taken this one: the worker is registered and no
/// other job waits to be fetched. A NULL worker takes nothing.
pub(crate) fn take_job(
    jobs: &str,
    workers: &str,
    now: &str,
    [job, worker, queue]: [&str; 3],
) -> String {
    format!(
        "UPDATE {jobs} SET status = 'Queued', lock_by = {worker}, lock_at = {now} \
         WHERE id = {job} AND job_type = {queue} AND status = 'Pending' AND lock_by IS NULL AND run_at <= {now} \
           AND EXISTS (SELECT 1 FROM {workers} w WHERE w.id = {worker}) \
           AND NOT EXISTS (SELECT 1 FROM {jobs} o WHERE o.job_type = {queue} AND o.id <> {job} \
             AND o.lock_by IS NULL AND o.run_at <= {now} \
             AND (o.status = 'Pending' OR (o.status = 'Failed' AND o.attempts < o.max_attempts)))"
    )
}

/// A job's take, then its run's claim: two round trips, where a backend has no statement
/// for both ([`SqlStore::take_claim`]'s default).
pub(crate) async fn take_then_claim(
    store: &dyn Claims,
    job_id: &str,
    worker: &str,
    ttl: Duration,
    limit: u32,
) -> Result<Option<Taken>> {
    let Some(run_id) = store.take_job(job_id, worker).await? else {
        return Ok(None);
    };
    let (claim, context) = store.claim_with_context(run_id, worker, ttl, limit).await?;
    Ok(Some(Taken {
        run_id,
        claim,
        context,
    }))
}

impl Statements {
    /// The statements for a backend whose apalis job table is `jobs`, whose park reads with the
    /// lock clause `share`, and whose overview names the owner column as `owner_unindexed` to
    /// keep its planner off the owner index.
    ///
    /// `workers` is apalis's worker table, and `now` the job table's clock (`run_at` and
    /// `done_at` are seconds on SQLite, timestamps on PostgreSQL). `subplan` ends a thread
    /// lookup that must stay a subplan (see `none_queued_before!`).
    pub(crate) fn new(
        jobs: &str,
        workers: &str,
        share: &str,
        owner_unindexed: &str,
        now: &str,
        subplan: &str,
    ) -> Statements {
        Statements {
            take_job: format!(
                "{} RETURNING job",
                take_job(jobs, workers, now, ["$1", "$2", "$3"])
            ),
            // What apalis's ack writes (`queries/task/ack.sql`) for a job its handler finished,
            // or, for one whose handler failed, the job back on the queue for any worker.
            settle_held_job: format!(
                "UPDATE {jobs} SET attempts = attempts + 1, \
                   status = CASE WHEN $3 THEN 'Done' ELSE 'Pending' END, \
                   last_result = CASE WHEN $3 THEN '{{\"Ok\":null}}' ELSE last_result END, \
                   done_at = CASE WHEN $3 THEN {now} ELSE NULL END, \
                   lock_at = CASE WHEN $3 THEN lock_at ELSE NULL END, \
                   lock_by = CASE WHEN $3 THEN lock_by ELSE NULL END \
                 WHERE id = $1 AND lock_by = $2"
            ),
            mark_job_done: format!(
                "UPDATE {jobs} SET attempts = attempts + 1, status = 'Done', \
                   last_result = '{{\"Ok\":null}}', done_at = {now} WHERE "
            ),
            // The thread's runs from `sa_runs_thread_live`, as in `none_queued_before!`.
            next_queued: next_queued(jobs, "$1"),
            fetched_not_started: format!(
                "SELECT r.id FROM sa_runs r JOIN {jobs} j ON j.id = r.job_id \
                 WHERE r.status = 'queued' AND j.lock_by = $1 AND j.status IN ('Queued', 'Running')"
            ),
            // Only a run its thread would start now: no run of the thread active, none queued
            // before it (as for orphans).
            held_elsewhere: format!(
                concat!(
                    "SELECT r.id FROM sa_runs r JOIN {jobs} j ON j.id = r.job_id \
                     WHERE r.status = 'queued' AND r.enqueued_at < $1 \
                       AND j.status IN ('Queued', 'Running') AND j.lock_by IS NOT NULL AND j.lock_by <> $2 \
                       AND ",
                    next_in_its_thread!("r", "{subplan}"),
                    " ORDER BY r.enqueued_at LIMIT $3"
                ),
                jobs = jobs,
                subplan = subplan
            ),
            // apalis's job table is only read here. A queued run needs a new job when its
            // own is not `Pending` (free for any worker to fetch) after the grace period: gone,
            // finished, or fetched (`Queued`, `Running`) by a worker that has not started it —
            // the batch of a dead or full worker. A duplicate job is harmless.
            orphans: format!(
                concat!(
                    "SELECT id, status FROM sa_runs r WHERE r.enqueued_at < $1 AND ( \
                       (r.status = 'waiting' AND r.wake_at IS NOT NULL AND r.wake_at <= $2) OR \
                       (r.status = 'queued' \
                         AND NOT EXISTS (SELECT 1 FROM {jobs} j WHERE j.id = r.job_id AND j.status = 'Pending') \
                         AND ",
                    next_in_its_thread!("r", "{subplan}"),
                    ")) LIMIT 1000"
                ),
                jobs = jobs,
                subplan = subplan
            ),
            // Events of the runs that were active in the last hour (finished in it, or not
            // finished): the runs come from indexes, their events from the primary key. On
            // SQLite `+owner` keeps the planner on the finished_at index (without statistics it
            // takes the owner index and walks every run the owner ever had); PostgreSQL's
            // planner needs no hint, and misjudges the hinted form.
            overview_events: format!(
                "SELECT e.run_id, e.type, e.data, e.created_at FROM sa_events e \
                 WHERE e.run_id IN (SELECT id FROM sa_runs WHERE finished_at >= $2 AND {owner_unindexed} = $1 \
                                    UNION SELECT id FROM sa_runs WHERE owner = $1 AND status IN ('running', 'waiting')) \
                   AND e.type IN ('model.completed', 'run.succeeded', 'run.failed', 'run.cancelled') AND e.created_at >= $2 \
                 ORDER BY e.created_at DESC LIMIT $3"
            ),
            wipe_jobs: format!("DELETE FROM {jobs} WHERE job_type = $1"),
            run_status: format!("SELECT status FROM sa_runs WHERE id = $1{share}"),
            approval_status: format!("SELECT status FROM sa_approvals WHERE id = $1{share}"),
        }
    }
}

/// What every backend keeps beside its pools; clones share it.
#[derive(Clone, Debug)]
pub(crate) struct Common {
    /// This process's waiters on runs' changes.
    pub(crate) notifier: Arc<Notifier>,
    /// This process's waiters on cancel requests.
    pub(crate) cancels: Arc<Notifier>,
    /// This process configured concurrency limits (claims then serialise per owner).
    pub(crate) limits_seen: Arc<AtomicBool>,
    /// Progress checkpoints of all runs, committed in groups.
    pub(crate) group: Arc<group::GroupCommit>,
    /// Lease renewals of all runs, one statement per group.
    pub(crate) renewals: Arc<group::GroupRenew>,
    /// Whether a relay takes this store's events to Redis. Without one, events are written as
    /// relayed: the outbox index (`sa_events_unrelayed`) then holds only what a relay will
    /// take, instead of every event ever written, and turning Redis on later does not replay
    /// the whole history into it.
    pub(crate) relays: bool,
    /// The jobs of the runs this process started, until the queue's notification of each
    /// comes back ([`Claims::started_here`]).
    pub(crate) started_here: Arc<StartedHere>,
}

/// Job ids a process wrote itself, until the queue's notification of each comes back: such a
/// job is running in this process already or its start woke this process's fetch, so the
/// notification is nothing new to it. Bounded: past [`StartedHere::MOST`] ids it starts
/// afresh (a process without workers has no listener to take its ids back, and a notification
/// lost while the listener reconnected leaves its id behind), and a forgotten id only costs a
/// take that finds the job gone.
#[derive(Debug, Default)]
pub(crate) struct StartedHere(std::sync::Mutex<std::collections::HashSet<String>>);

impl StartedHere {
    const MOST: usize = 4096;

    /// Remembers `job_id`, before the statement that writes it commits (and notifies), until
    /// the answer is dropped: kept only if [`Remembered::keep`] says the job was written.
    pub(crate) fn remember<'a>(&'a self, job_id: &'a str) -> Remembered<'a> {
        let mut ids = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if ids.len() >= Self::MOST {
            ids.clear();
        }
        ids.insert(job_id.to_owned());
        Remembered {
            ids: self,
            job_id,
            kept: false,
        }
    }

    /// Whether `job_id` was written here; forgets it.
    pub(crate) fn take(&self, job_id: &str) -> bool {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(job_id)
    }
}

/// A job id [`StartedHere`] holds while its start runs: forgotten when this is dropped (the
/// start was refused, or failed) unless [`Remembered::keep`] was called.
pub(crate) struct Remembered<'a> {
    ids: &'a StartedHere,
    job_id: &'a str,
    kept: bool,
}

impl Remembered<'_> {
    /// The start wrote the job: the id stays until its notification comes back.
    pub(crate) fn keep(&mut self) {
        self.kept = true;
    }
}

impl Drop for Remembered<'_> {
    fn drop(&mut self) {
        if !self.kept {
            self.ids.take(self.job_id);
        }
    }
}

impl Common {
    /// With `committers` group committers, telling `notifier`'s waiters of changes.
    pub(crate) fn new(notifier: Arc<Notifier>, committers: usize) -> Common {
        Common {
            notifier,
            cancels: Default::default(),
            limits_seen: Default::default(),
            group: Arc::new(group::GroupCommit::new(committers)),
            renewals: Default::default(),
            relays: true,
            started_here: Default::default(),
        }
    }

    /// This process configured concurrency limits, as [`Claims::refresh_limits`] last read:
    /// claims then take turns per owner and agent.
    pub(crate) fn limits_in_force(&self) -> bool {
        self.limits_seen.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// A stored message from its columns (`id`, `run_id`, `step`, `key`, `body`), however they
/// were read: a row of its own, or an element of PostgreSQL's claimed context.
pub(crate) fn stored_message(
    id: i64,
    run: &str,
    step: i64,
    key: String,
    body: &str,
) -> Result<StoredMessage> {
    Ok(StoredMessage {
        id,
        run_id: run.parse().map_err(|e| corrupt("message run id", e))?,
        step: step as u32,
        key,
        message: serde_json::from_str(body).map_err(|e| corrupt("message body", e))?,
    })
}

/// A row the code cannot read: a value it does not know, or a broken reference.
pub(crate) fn corrupt(what: &str, v: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(format!("{what}: {v}"))
}

/// The outbox's rows not yet relayed, each run's in seq order (bind: the limit).
pub(crate) const UNRELAYED: &str = "SELECT run_id, seq, type, data, created_at FROM sa_events WHERE relayed = 0 ORDER BY run_id, seq LIMIT $1";

/// The event a claim of `run` (as the claim returned it) commits: `run.resumed` for a parked
/// run, else `run.started`.
pub(crate) fn claim_event(run: &RunRecord, worker: &str) -> NewEvent {
    let from = run.claimed_from.unwrap_or(RunStatus::Queued);
    let claim = event::Claimed {
        attempt: run.attempts,
        crashes: run.crashes,
        worker: worker.to_owned(),
        from,
    };
    match from {
        RunStatus::Waiting => Event::RunResumed(claim),
        _ => Event::RunStarted(claim),
    }
    .into()
}

/// A backend the shared statements run on: its pools and notifiers, the statements that differ
/// ([`Statements`]), how its park orders its reads, and its own start, claim, checkpoint and
/// outbox reads and marks. Both [`SqliteStore`] and [`PgStore`] are one; the store traits are
/// implemented for every one (`shared/`). The provided methods are the helpers those share.
#[async_trait]
pub(crate) trait SqlStore: Send + Sync + Sized + 'static
where
    for<'c> &'c mut <Self::Db as Database>::Connection: Executor<'c, Database = Self::Db>,
    <Self::Db as Database>::Arguments: IntoArguments<Self::Db>,
    usize: ColumnIndex<<Self::Db as Database>::Row>,
    for<'a> &'a str:
        ColumnIndex<<Self::Db as Database>::Row> + Encode<'a, Self::Db> + Decode<'a, Self::Db>,
    for<'a> Option<&'a str>: Encode<'a, Self::Db>,
    str: Type<Self::Db>,
    String: Col<Self::Db>,
    i64: Col<Self::Db>,
    i32: Col<Self::Db>,
    bool: Col<Self::Db>,
    DateTime<Utc>: Col<Self::Db>,
    Option<String>: Col<Self::Db>,
    Option<i64>: Col<Self::Db>,
    Option<DateTime<Utc>>: Col<Self::Db>,
{
    /// The sqlx database.
    type Db: Database<QueryResult: Affected>;
    /// What the group committer and the lease renewer use of the store.
    type Commits: group::Renewals;

    /// Whether a park reads what it waits on before its own fence (PostgreSQL: share locks in
    /// the order a child's end takes them) or after it (SQLite: the fence, a write, takes the
    /// write lock first, so the reads after it see the latest state).
    const PARK_READS_FIRST: bool;

    /// Whether one command may hold several statements with their parameters (SQLite runs
    /// them in turn on its connection's thread; sqlx sends PostgreSQL one statement per round
    /// trip): then reads that go together are sent together.
    const STATEMENTS_PER_COMMAND: bool;

    /// The statements that differ (see [`Statements`]).
    fn statements() -> &'static Statements;
    /// The pool that writes.
    fn pool(&self) -> &sqlx::Pool<Self::Db>;
    /// Where the API's reads go.
    fn reads(&self) -> &sqlx::Pool<Self::Db>;
    /// What every backend keeps beside its pools.
    fn common(&self) -> &Common;
    /// A connection for one short statement on a run's path; [`super::kept::Kept::keep`] after
    /// it succeeded spares it the pool's release ping where the backend keeps connections
    /// aside (PostgreSQL). By default, one from the pool.
    async fn kept(&self) -> Result<super::kept::Kept<Self::Db>> {
        Ok(super::kept::Kept::pooled(self.pool().acquire().await?))
    }
    /// What the group committer and the renewer need of the store.
    fn commits(&self) -> Self::Commits;

    /// The backend's own [`Runs::create_run`].
    async fn start_run(&self, new: NewRun) -> Result<Created>;
    /// The backend's own [`Claims::claim_with_context`] (and [`Claims::claim_run`], with no
    /// `context`).
    async fn claim(
        &self,
        id: RunId,
        owner: &str,
        ttl: Duration,
        context: Option<u32>,
    ) -> Result<(Claim, Option<ThreadContext>)>;
    /// The backend's own [`Claims::take_and_claim`]; by default [`take_then_claim`].
    async fn take_claim(
        &self,
        job_id: &str,
        worker: &str,
        ttl: Duration,
        limit: u32,
    ) -> Result<Option<Taken>>
    where
        Self: Claims + Sized,
    {
        take_then_claim(self, job_id, worker, ttl, limit).await
    }
    /// The backend's own [`Checkpoints::checkpoint`].
    async fn commit_checkpoint(&self, lease: &Lease, cp: Checkpoint) -> Result<Option<Ending>>;
    /// Marks the outbox's `(run, first seq, last seq)` ranges relayed.
    async fn mark_relayed_ranges(&self, ranges: &[(RunId, u64, u64)]) -> Result<()>;
    /// The backend's own [`crate::store::Outbox::unrelayed`] ([`UNRELAYED`]).
    async fn unrelayed_events(&self, limit: u32) -> Result<Vec<EventRecord>>;
    /// apalis's worker registry (heartbeats every few seconds), newest first.
    async fn workers(&self) -> Result<Vec<(String, DateTime<Utc>)>>;

    /// The `relayed` column of an event written now: without a relay, events are written as
    /// relayed (the outbox index then holds only what a relay will take).
    fn relayed_at_insert(&self) -> i64 {
        i64::from(!self.common().relays)
    }

    /// This process's waiters on runs' changes.
    fn notifier(&self) -> &Notifier {
        &self.common().notifier
    }

    /// Announces a claim of `run` (as the claim returned it, committed at `at`) to this
    /// process's waiters, handing its `run.started` / `run.resumed` to the relay when it has
    /// one (see [`Notifier::committed`]). A claim starts the run: nothing a wait for its end
    /// needs to read.
    fn claimed(&self, run: &RunRecord, worker: &str, at: DateTime<Utc>) {
        self.committed_one(run.id, run.event_seq, || claim_event(run, worker), at);
    }

    /// Announces a commit that wrote one event of `run`, `event()` as event `seq` stamped `at`
    /// (a start's `run.queued`, a claim's): handed to the relay when this process has one, as
    /// progress (nothing a wait for the run's end needs to read).
    fn committed_one(
        &self,
        run: RunId,
        seq: u64,
        event: impl FnOnce() -> NewEvent,
        at: DateTime<Utc>,
    ) {
        self.notifier()
            .committed(run, false, || vec![event().record(run, seq, at)]);
    }

    /// This process's waiters on cancel requests.
    fn cancels(&self) -> &Notifier {
        &self.common().cancels
    }

    /// Where a forked thread's history comes from besides its own messages: each thread it
    /// shares and the last message of it that it includes (empty for a thread never forked).
    /// Read on `pool`: the run's own pool for its context, the API's for its views.
    async fn lineage(pool: &sqlx::Pool<Self::Db>, thread: &ThreadId) -> Result<Vec<(String, i64)>> {
        let rows = sqlx::query("SELECT ancestor, upto FROM sa_thread_lineage WHERE thread = $1")
            .bind(thread.as_str())
            .fetch_all(pool)
            .await?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }

    /// The messages of a forked thread's history (its own, and its lineage's up to each one's
    /// last shared message) with an id above `after`: the first `limit` when `oldest_first`,
    /// else the newest `limit`; in order either way.
    async fn shared_messages(
        pool: &sqlx::Pool<Self::Db>,
        thread: &ThreadId,
        lineage: &[(String, i64)],
        after: i64,
        limit: u32,
        oldest_first: bool,
    ) -> Result<Vec<StoredMessage>> {
        // One index-ordered, limited read per thread of the lineage (each walks
        // `sa_messages_thread` from its end, so a fork at the middle of a long thread does not
        // scan the source's messages past the fork point), merged and cut to `limit`.
        let order = if oldest_first { "" } else { " DESC" };
        let mut q = sqlx::QueryBuilder::<Self::Db>::new(
            "SELECT id, run_id, step, key, body FROM (SELECT id, run_id, step, key, body FROM (",
        );
        let own = std::iter::once((thread.as_str().to_owned(), None));
        let ancestors = lineage.iter().map(|(a, upto)| (a.clone(), Some(*upto)));
        for (i, (t, upto)) in own.chain(ancestors).enumerate() {
            if i > 0 {
                q.push(" UNION ALL ");
            }
            q.push("SELECT id, run_id, step, key, body FROM (SELECT id, run_id, step, key, body FROM sa_messages WHERE thread_id = ")
                .push_bind(t)
                .push(" AND id > ")
                .push_bind(after);
            if let Some(upto) = upto {
                q.push(" AND id <= ").push_bind(upto);
            }
            q.push(" ORDER BY id")
                .push(order)
                .push(" LIMIT ")
                .push_bind(i64::from(limit))
                .push(format!(") s{i}"));
        }
        q.push(") u ORDER BY id")
            .push(order)
            .push(" LIMIT ")
            .push_bind(i64::from(limit))
            .push(") t ORDER BY id");
        let rows = q.build().fetch_all(pool).await?;
        rows.iter().map(Self::message_from_row).collect()
    }

    /// The compaction a forked thread's context starts after: its own newest, else the newest
    /// of its lineage that lies within the shared history.
    async fn shared_compaction(
        pool: &sqlx::Pool<Self::Db>,
        own: Option<Compaction>,
        lineage: &[(String, i64)],
    ) -> Result<Option<Compaction>> {
        if own.is_some() || lineage.is_empty() {
            return Ok(own);
        }
        let mut q = sqlx::QueryBuilder::<Self::Db>::new(
            "SELECT id, run_id, first_message_id, last_message_id, messages, summary, tokens_before, \
             tokens_after, reason, created_at FROM sa_compactions WHERE 1 = 0",
        );
        for (ancestor, upto) in lineage {
            q.push(" OR (thread_id = ")
                .push_bind(ancestor.clone())
                .push(" AND last_message_id <= ")
                .push_bind(*upto)
                .push(")");
        }
        q.push(" ORDER BY id DESC LIMIT 1");
        let row = q.build().fetch_optional(pool).await?;
        row.as_ref().map(Self::compaction_from_row).transpose()
    }

    /// A run's place in its owner's queue: the runs queued ahead of it by `place`, and its
    /// priority; None if there is no such run. Read from `sa_queue_depth`, which triggers keep
    /// (migrations */queue_depth): one row per owner and priority (and stripe), whatever the
    /// backlog. On any connection, so a start can read it in its transaction.
    async fn rank_in(
        conn: &mut <Self::Db as Database>::Connection,
        run: RunId,
        place: QueuePlace,
    ) -> Result<Option<(u32, u8)>> {
        let row = sqlx::query(concat!("SELECT ", rank_of!("$1", "$2")))
            .bind(run.to_string())
            .bind(place == QueuePlace::Back)
            .fetch_optional(conn)
            .await?;
        Ok(row.map(|r| Self::rank_from_row(&r, place)))
    }

    /// The runs ahead of a run and its priority, from the columns `rank_of!` reads.
    fn rank_from_row(r: &<Self::Db as Database>::Row, place: QueuePlace) -> (u32, u8) {
        // At the back, the run does not count itself.
        let ahead = r.get::<i64, _>("ahead")
            - if place == QueuePlace::Back {
                i64::from(r.get::<i32, _>("queued"))
            } else {
                0
            };
        (
            ahead.clamp(0, i64::from(u32::MAX)) as u32,
            r.get::<i64, _>("priority").clamp(1, 5) as u8,
        )
    }

    /// Inserts a commit's events in one statement (one round trip, whatever their number).
    async fn insert_events(
        conn: &mut <Self::Db as Database>::Connection,
        run: RunId,
        first_seq: u64,
        events: &[NewEvent],
        relayed: i64,
    ) -> Result<()> {
        Self::insert_events_at(conn, run, first_seq, events, relayed, Utc::now()).await
    }

    /// [`SqlStore::insert_events`] stamped `now` (a commit that hands its events to the relay
    /// hands them with the time they were written with).
    async fn insert_events_at(
        conn: &mut <Self::Db as Database>::Connection,
        run: RunId,
        first_seq: u64,
        events: &[NewEvent],
        relayed: i64,
        now: DateTime<Utc>,
    ) -> Result<()> {
        if events.is_empty() {
            return Ok(());
        }
        let run = run.to_string();
        let mut q = sqlx::QueryBuilder::<Self::Db>::new(
            "INSERT INTO sa_events (run_id, seq, type, data, created_at, relayed) ",
        );
        q.push_values(events.iter().enumerate(), |mut b, (i, ev)| {
            b.push_bind(run.clone())
                .push_bind((first_seq + i as u64) as i64)
                .push_bind(ev.kind())
                .push_bind(ev.data().to_string())
                .push_bind(now)
                .push_bind(relayed);
        });
        q.build().execute(conn).await?;
        Ok(())
    }

    /// Inserts `events` as the run's seqs ending at `last` (where the fence just moved
    /// `event_seq`), commits, and wakes this process's waiters on the run.
    async fn commit_events(
        &self,
        mut tx: sqlx::Transaction<'_, Self::Db>,
        run: RunId,
        last: i64,
        events: &[NewEvent],
    ) -> Result<()> {
        Self::insert_events(
            &mut tx,
            run,
            (last - events.len() as i64 + 1) as u64,
            events,
            self.relayed_at_insert(),
        )
        .await?;
        tx.commit().await?;
        self.notifier().notify(run);
        Ok(())
    }

    /// What every terminal transition commits with it, whichever way the run ended (finish,
    /// cancel, give-up): the parent's `child.finished` event (unless the parent has ended:
    /// nothing follows a terminal event), the wake-up of every run parked on this one (a parent
    /// only wakes for the children it waits on: a detached child ending does not disturb it),
    /// the end of this run's own waits, and the end of its attached children.
    /// [`SqlStore::terminal_effects`] of a run's end whose terminal fence returned `fence`
    /// (`event_seq, thread_id, parent_run_id`, then the [`Reach`] columns).
    async fn end_effects(
        conn: &mut <Self::Db as Database>::Connection,
        run: RunId,
        fence: &<Self::Db as Database>::Row,
        status: RunStatus,
        error: Option<&RunError>,
        relayed: i64,
    ) -> Result<()> {
        let thread: String = fence.get(1);
        let parent: Option<String> = fence.get(2);
        let reach = Reach {
            waits: fence.get(3),
            children: fence.get(4),
        };
        Self::terminal_effects(
            conn,
            run,
            &thread,
            parent.as_deref(),
            status,
            error,
            reach,
            relayed,
        )
        .await
    }

    #[allow(clippy::too_many_arguments)]
    async fn terminal_effects(
        conn: &mut <Self::Db as Database>::Connection,
        run: RunId,
        thread: &str,
        parent: Option<&str>,
        status: RunStatus,
        error: Option<&RunError>,
        reach: Reach,
        relayed: i64,
    ) -> Result<()> {
        if let Some(parent) = parent {
            let row = sqlx::query(
                "UPDATE sa_runs SET event_seq = event_seq + 1 \
                 WHERE id = $1 AND status IN ('queued','running','waiting') RETURNING event_seq, owner",
            )
            .bind(parent)
            .fetch_optional(&mut *conn)
            .await?;
            if let Some(row) = row {
                let seq: i64 = row.get(0);
                // As the owner (the parent's, so the child's) chose it.
                let owner: OwnerId = row.get(1);
                let shown = thread
                    .parse::<ThreadId>()
                    .map(|t| t.visible_to(&owner).to_string())
                    .unwrap_or_else(|_| thread.to_owned());
                let event = Event::ChildFinished(event::ChildFinished {
                    child_run_id: run,
                    thread_id: shown,
                    status,
                    error: error.cloned(),
                });
                let parent_id: RunId = parent.parse().map_err(|e| corrupt("parent id", e))?;
                Self::insert_events(conn, parent_id, seq as u64, &[event.into()], relayed).await?;
            }
        }
        if reach.waits {
            Self::end_waits(conn, &run.to_string()).await?;
        }
        if reach.children {
            Self::end_attached_children(conn, run, relayed).await?;
        }
        Ok(())
    }

    /// The waits around a run that ended: whoever is parked on it is woken (`wake`), and its
    /// own waits are dropped.
    async fn end_waits(conn: &mut <Self::Db as Database>::Connection, run: &str) -> Result<()> {
        sqlx::query(sql!(
            "UPDATE sa_runs SET wake_at = $1 WHERE status IN ({}) \
             AND id IN (SELECT waiter FROM sa_run_waits WHERE target = $2)",
            Transition::Wake
        ))
        .bind(now_ms())
        .bind(run)
        .execute(&mut *conn)
        .await?;
        sqlx::query("DELETE FROM sa_run_waits WHERE waiter = $1")
            .bind(run)
            .execute(conn)
            .await?;
        Ok(())
    }

    /// A run that ends takes its attached (non-detached) descendants with it, in the same
    /// commit: parked and queued ones are cancelled here (their waiters woken), running ones
    /// are asked to stop (their workers finish them within a second). So a crash right after a
    /// parent's end cannot leave its children running.
    async fn end_attached_children(
        conn: &mut <Self::Db as Database>::Connection,
        run: RunId,
        relayed: i64,
    ) -> Result<()> {
        let now = Utc::now();
        let mut stack = vec![run.to_string()];
        while let Some(parent) = stack.pop() {
            sqlx::query(sql!(
                "UPDATE sa_runs SET cancel_requested = 1, updated_at = $1 \
                 WHERE parent_run_id = $2 AND detached = 0 AND status IN ({})",
                Transition::RequestCancel
            ))
            .bind(now)
            .bind(&parent)
            .execute(&mut *conn)
            .await?;
            let running: Vec<String> = sqlx::query_scalar(sql!(
                "SELECT id FROM sa_runs WHERE parent_run_id = $1 AND detached = 0 AND status IN ({})",
                Transition::RequestCancel
            ))
            .bind(&parent)
            .fetch_all(&mut *conn)
            .await?;
            stack.extend(running);
            let ended = sqlx::query(sql!(
                "UPDATE sa_runs SET status = 'cancelled', finished_at = $1, updated_at = $1, event_seq = event_seq + 1, \
                 cancel_requested = 0, lease_expires_at = 0, wake_at = NULL \
                 WHERE parent_run_id = $2 AND detached = 0 AND status IN ({}) RETURNING id, event_seq",
                Transition::Cancel
            ))
            .bind(now)
            .bind(&parent)
            .fetch_all(&mut *conn)
            .await?;
            for row in &ended {
                let id: String = row.get(0);
                let child: RunId = id.parse().map_err(|e| corrupt("run id", e))?;
                let seq: i64 = row.get(1);
                let parent_run_id = Some(parent.parse().map_err(|e| corrupt("parent id", e))?);
                let event = Event::RunCancelled(event::RunCancelled {
                    reason: Some("parent_ended".into()),
                    parent_run_id,
                    while_: None,
                });
                Self::insert_events(conn, child, seq as u64, &[event.into()], relayed).await?;
                Self::end_waits(conn, &id).await?;
                stack.push(id);
            }
        }
        Ok(())
    }

    /// Opens a write made under a lease besides a checkpoint (a compaction, a tool decision):
    /// `statement` proves the epoch ([`Transition::Heartbeat`]), renews the lease and reserves
    /// `events` seqs; its row (`RETURNING event_seq, …`) comes back.
    async fn fence(
        conn: &mut <Self::Db as Database>::Connection,
        lease: &Lease,
        events: usize,
        now: DateTime<Utc>,
        statement: &'static str,
    ) -> Result<<Self::Db as Database>::Row> {
        let row = sqlx::query(statement)
            .bind(events as i64)
            .bind(now_ms() + lease.ttl.as_millis() as i64)
            .bind(now)
            .bind(lease.run_id.to_string())
            .bind(lease.epoch)
            .fetch_optional(conn)
            .await?;
        row.ok_or(StoreError::LeaseLost(lease.run_id))
    }

    /// Whether an approval a park waits on is no longer pending (read with the same lock as the
    /// runs in [`SqlStore::any_ended`]).
    async fn answered(
        conn: &mut <Self::Db as Database>::Connection,
        approvals: &[ApprovalId],
    ) -> Result<bool> {
        let mut answered = false;
        for id in approvals {
            let status: Option<String> =
                sqlx::query_scalar(Self::statements().approval_status.as_str())
                    .bind(id)
                    .fetch_optional(&mut *conn)
                    .await?;
            answered |= status.as_deref() != Some("pending");
        }
        Ok(answered)
    }

    /// Whether any of `targets` has ended (or is missing): a park on them is due at once.
    async fn any_ended(
        conn: &mut <Self::Db as Database>::Connection,
        targets: &[RunId],
    ) -> Result<bool> {
        let mut ended = false;
        for target in targets {
            let status: Option<String> = sqlx::query_scalar(Self::statements().run_status.as_str())
                .bind(target.to_string())
                .fetch_optional(&mut *conn)
                .await?;
            ended |= status
                .and_then(|s| RunStatus::parse(&s))
                .is_none_or(RunStatus::is_terminal);
        }
        Ok(ended)
    }

    /// A run from a row of [`run_columns!`] (by name).
    fn run_from_row(r: &<Self::Db as Database>::Row) -> Result<RunRecord> {
        let id: String = r.get("id");
        let limits: String = r.get("limits");
        let metadata: String = r.get("metadata");
        let parent: Option<String> = r.get("parent_run_id");
        let ekind: Option<ErrorKind> = r.try_get("error_kind")?;
        let thread: String = r.get("thread_id");
        Ok(RunRecord {
            id: id.parse().map_err(|e| corrupt("run id", e))?,
            thread_id: thread.parse().map_err(|e| corrupt("thread id", e))?,
            owner: r.get("owner"),
            agent: r.get("agent"),
            status: r.try_get("status")?,
            input: r.get("input"),
            metadata: serde_json::from_str(&metadata).map_err(|e| corrupt("metadata", e))?,
            limits: serde_json::from_str(&limits).map_err(|e| corrupt("limits", e))?,
            parent_run_id: parent
                .map(|p| p.parse())
                .transpose()
                .map_err(|e| corrupt("parent id", e))?,
            tree: TreePosition {
                root_run_id: r
                    .get::<Option<String>, _>("root_run_id")
                    .map(|p| p.parse())
                    .transpose()
                    .map_err(|e| corrupt("root id", e))?,
                depth: r.get::<i64, _>("depth") as u32,
                detached: r.get::<i64, _>("detached") != 0,
            },
            wake_at: r.get("wake_at"),
            claimed_from: r
                .get::<Option<String>, _>("claimed_from")
                .and_then(|s| RunStatus::parse(&s)),
            step: r.get::<i64, _>("step") as u32,
            forced: r.get::<i64, _>("forced") != 0,
            result: r.get("result"),
            error: ekind.map(|kind| RunError {
                kind,
                message: r
                    .get::<Option<String>, _>("error_message")
                    .unwrap_or_default(),
            }),
            usage: Usage {
                prompt_tokens: r.get::<i64, _>("prompt_tokens") as u64,
                completion_tokens: r.get::<i64, _>("completion_tokens") as u64,
                cache_read_tokens: r.get::<i64, _>("cache_read_tokens") as u64,
                cache_write_tokens: r.get::<i64, _>("cache_write_tokens") as u64,
            },
            attempts: r.get::<i64, _>("attempts") as u32,
            crashes: r.get::<i64, _>("crashes") as u32,
            lease_epoch: r.get("lease_epoch"),
            cancel_requested: r.get::<i64, _>("cancel_requested") != 0,
            inbox: r.get::<i64, _>("inbox").clamp(0, u32::MAX as i64) as u32,
            agent_version: r.get("agent_version"),
            job_id: r.get("job_id"),
            event_seq: r.get::<i64, _>("event_seq") as u64,
            created_at: r.get::<DateTime<Utc>, _>("created_at"),
            started_at: r.get("started_at"),
            finished_at: r.get("finished_at"),
            heartbeat_at: r.get("heartbeat_at"),
            cost_nanos: r.get::<i64, _>("cost_nanos").max(0) as u64,
            priority: r.get::<i64, _>("priority").clamp(1, 5) as u8,
            retry_of: r
                .get::<Option<String>, _>("retry_of")
                .map(|p| p.parse())
                .transpose()
                .map_err(|e| corrupt("retry_of id", e))?,
        })
    }

    /// A stored message from its row (by name).
    fn message_from_row(r: &<Self::Db as Database>::Row) -> Result<StoredMessage> {
        let run: String = r.get("run_id");
        let body: String = r.get("body");
        stored_message(r.get("id"), &run, r.get("step"), r.get("key"), &body)
    }

    /// An approval from its row (by name).
    fn approval_from_row(r: &<Self::Db as Database>::Row) -> Result<Approval> {
        let run: String = r.get("run_id");
        let root: String = r.get("root_run_id");
        let input: String = r.get("input");
        let updated: Option<String> = r.get("updated_input");
        Ok(Approval {
            id: r.get("id"),
            run_id: run.parse().map_err(|e| corrupt("approval run id", e))?,
            root_run_id: root.parse().map_err(|e| corrupt("approval root id", e))?,
            tool: r.get("tool"),
            input: serde_json::from_str(&input).map_err(|e| corrupt("approval input", e))?,
            reason: r.get("reason"),
            status: r.try_get("status")?,
            answer_reason: r.get("answer_reason"),
            resolved_by: r.get("resolved_by"),
            updated_input: updated
                .map(|u| serde_json::from_str(&u))
                .transpose()
                .map_err(|e| corrupt("approval updated input", e))?,
            scope: r.try_get("scope")?,
            created_at: r.get("created_at"),
            expires_at: r.get("expires_at"),
            resolved_at: r.get("resolved_at"),
        })
    }

    /// A thread's context from the rows of [`context_rows!`], with the threads it shares
    /// history with when it is a fork (empty otherwise: then the context is whole).
    fn context_parts(
        rows: &[<Self::Db as Database>::Row],
    ) -> Result<(ThreadContext, Vec<(String, i64)>)> {
        let mut compaction = None;
        let mut messages = Vec::with_capacity(rows.len());
        let mut lineage = vec![];
        for r in rows {
            match r.get::<i32, _>("part") {
                0 => compaction = Some(Self::compaction_from_row(r)?),
                1 => messages.push(Self::message_from_row(r)?),
                _ => lineage.push((r.get::<String, _>("run_id"), r.get::<i64, _>("id"))),
            }
        }
        Ok(((compaction, messages), lineage))
    }

    /// A compaction from its row (by name).
    fn compaction_from_row(r: &<Self::Db as Database>::Row) -> Result<Compaction> {
        let run: String = r.get("run_id");
        Ok(Compaction {
            id: r.get("id"),
            run_id: run.parse().map_err(|e| corrupt("compaction run id", e))?,
            body: CompactionBody {
                first_message_id: r.get("first_message_id"),
                last_message_id: r.get("last_message_id"),
                messages: r.get("messages"),
                summary: r.get("summary"),
                tokens_before: r.get("tokens_before"),
                tokens_after: r.get("tokens_after"),
                reason: r.get("reason"),
            },
            created_at: r.get("created_at"),
        })
    }

    /// A stored event from its row (by name).
    fn event_from_row(r: &<Self::Db as Database>::Row) -> Result<EventRecord> {
        let run: String = r.get("run_id");
        let data: String = r.get("data");
        Ok(EventRecord {
            seq: r.get::<i64, _>("seq") as u64,
            kind: r.get("type"),
            run_id: run.parse().map_err(|e| corrupt("event run id", e))?,
            created_at: r.get("created_at"),
            data: serde_json::from_str(&data).map_err(|e| corrupt("event data", e))?,
        })
    }
}

/// A thread's lookups ("is a run of this thread queued before this one?", "which run of it is
/// next?") take `sa_runs_thread_live` with the thread as their index condition, also when the
/// planner's statistics were taken while nothing was queued and a backlog has come since: the
/// state in which the earlier `status = 'queued'` form walked every queued run through the
/// status index. That form is planned too, so the setup is known to lay the trap.
#[cfg(test)]
mod thread_lookups {
    use super::*;
    use crate::store::{PgStore, Runs, SqliteStore};

    fn new_run() -> NewRun {
        NewRun {
            id: RunId::new(),
            thread_id: crate::ids::ThreadId::generate(),
            owner: "o".into(),
            agent: "general-purpose".into(),
            input: "hi".into(),
            metadata: serde_json::json!({}),
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
            // A job id as `queue::new_job_id` makes one (the store may not name the queue).
            job_id: ulid::Ulid::new().to_string(),
            if_busy: IfBusy::Reject,
            idempotency_key: None,
            retry_of: None,
            priority: 3,
            place: QueuePlace::Back,
            agent_version: None,
            held_by: None,
            max_queued: 0,
        }
    }

    /// The claim's lookup (`none_queued_before!`), for the run `y`.
    const CLAIM_LOOKUP_PG: &str = concat!(
        "SELECT 1 FROM sa_runs WHERE id = 'y' AND ",
        none_queued_before!("sa_runs", " OFFSET 0")
    );
    const CLAIM_LOOKUP_SQLITE: &str = concat!(
        "SELECT 1 FROM sa_runs WHERE id = 'y' AND ",
        none_queued_before!("sa_runs", "")
    );

    #[tokio::test]
    async fn postgres_thread_lookups_never_walk_the_backlog() {
        let admin_url = std::env::var("SUBAGENTS_TEST_POSTGRES")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
        let admin = sqlx::PgPool::connect(&admin_url)
            .await
            .expect("PostgreSQL for the tests (set SUBAGENTS_TEST_POSTGRES)");
        // Named as the integration tests name theirs, so a run that fails here is swept too.
        let db = format!("sa_test_{}", uuid::Uuid::now_v7().simple());
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}")))
            .execute(&admin)
            .await
            .unwrap();
        let (server, _) = admin_url
            .split('?')
            .next()
            .and_then(|u| u.rsplit_once('/'))
            .expect("a database URL");
        let s = PgStore::connect(&format!("{server}/{db}")).await.unwrap();
        let pool = s.pool().clone();
        let exec = |sql: &'static str| {
            let pool = pool.clone();
            async move { sqlx::query(sql).execute(&pool).await.unwrap() }
        };
        // No analyze of its own between the statistics and the plans.
        exec("ALTER TABLE sa_runs SET (autovacuum_enabled = false)").await;
        for _ in 0..60 {
            s.create_run(new_run()).await.unwrap();
        }
        exec("UPDATE sa_runs SET status = 'succeeded'").await;
        exec("ANALYZE sa_runs").await;
        for _ in 0..300 {
            s.create_run(new_run()).await.unwrap();
        }
        let plan = |sql: String| {
            let pool = pool.clone();
            async move {
                let rows: Vec<String> =
                    sqlx::query_scalar(sqlx::AssertSqlSafe(format!("EXPLAIN {sql}")))
                        .fetch_all(&pool)
                        .await
                        .unwrap();
                rows.join("\n")
            }
        };
        let old = plan(
            "SELECT 1 FROM sa_runs WHERE id = 'y' AND NOT EXISTS (SELECT 1 FROM sa_runs q \
             WHERE q.thread_id = sa_runs.thread_id AND q.status = 'queued' AND q.id < sa_runs.id)"
                .into(),
        )
        .await;
        assert!(
            old.contains("sa_runs_status"),
            "the setup no longer lays the trap:\n{old}"
        );
        let claim = plan(CLAIM_LOOKUP_PG.into()).await;
        assert!(
            claim.contains("Index Scan using sa_runs_thread_live")
                && claim.contains("Index Cond: ((thread_id = sa_runs.thread_id)")
                && !claim.contains("sa_runs_status"),
            "the claim's lookup:\n{claim}"
        );
        let next = PgStore::statements().next_queued.replace("$1", "'t'");
        let next = plan(next).await;
        assert!(
            next.contains("sa_runs_thread_live")
                && next.contains("Index Cond: (thread_id = 't'::text)")
                && !next.contains("sa_runs_status"),
            "the next queued run's lookup:\n{next}"
        );
        drop(s);
        pool.close().await;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {db} WITH (FORCE)"
        )))
        .execute(&admin)
        .await
        .unwrap();
    }

    #[tokio::test]
    async fn sqlite_thread_lookups_take_the_thread_index() {
        let file = std::env::temp_dir().join(format!("sa-lookups-{}.db", uuid::Uuid::now_v7()));
        let s = SqliteStore::connect(&format!("sqlite://{}", file.display()))
            .await
            .unwrap();
        for _ in 0..50 {
            s.create_run(new_run()).await.unwrap();
        }
        let plan = |sql: String| {
            let pool = s.pool().clone();
            async move {
                let rows = sqlx::query(sqlx::AssertSqlSafe(format!("EXPLAIN QUERY PLAN {sql}")))
                    .fetch_all(&pool)
                    .await
                    .unwrap();
                rows.iter()
                    .map(|r| r.get::<String, _>("detail"))
                    .collect::<Vec<_>>()
                    .join("\n")
            }
        };
        let claim = plan(CLAIM_LOOKUP_SQLITE.into()).await;
        assert!(
            claim.contains("USING INDEX sa_runs_thread_live (thread_id=? AND id<?)"),
            "the claim's lookup:\n{claim}"
        );
        let next = plan(SqliteStore::statements().next_queued.replace("$1", "'t'")).await;
        assert!(
            next.contains("USING INDEX sa_runs_thread_live (thread_id=?)"),
            "the next queued run's lookup:\n{next}"
        );
        // The same question asked in a run's end, about the ending run's own thread: a
        // correlated subquery of the terminal fence's `RETURNING`.
        let end = plan(format!(
            "UPDATE sa_runs SET updated_at = updated_at WHERE id = 'y' RETURNING ({})",
            *crate::store::sqlite::NEXT_QUEUED
        ))
        .await;
        assert!(
            end.contains("CORRELATED SCALAR SUBQUERY")
                && end.contains("USING INDEX sa_runs_thread_live (thread_id=?)")
                && !end.contains("SCAN q"),
            "the end's next queued run:\n{end}"
        );
        drop(s);
        let _ = std::fs::remove_file(&file);
    }
}
