//! The PostgreSQL store: the scale-out backend, the mirror of [`super::sqlite`] statement for
//! statement (schema in `migrations/postgres`). Where SQLite serializes every writer,
//! PostgreSQL locks rows: the fenced `UPDATE … WHERE lease_epoch = $n` at the start of each
//! checkpoint locks the run's row, which keeps event `seq` gap-free; a start upserts (and so
//! locks) the thread row first, so two starts on one thread cannot both pass the busy check;
//! and the unique index on active runs turns a lost claim race into "not claimable".

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::{PgPool, Row};

use super::kept::{Keeper, Kept};
use super::sql::{Common, SqlStore, Statements, corrupt};
use super::*;

/// The PostgreSQL implementation of [`Store`].
#[derive(Clone, Debug)]
pub struct PgStore {
    pool: PgPool,
    common: Common,
    /// Runs' ends, announced to the other processes on this database.
    ends: super::pg_ends::Ends,
    /// The connection the relay keeps between its statements (see [`PgStore::relay_statement`]).
    relay_conn: std::sync::Arc<std::sync::Mutex<Option<Held>>>,
    /// Which pooled connections may be used untested (see [`Liveness`]).
    liveness: std::sync::Arc<Liveness>,
    /// The connections a run's own short statements keep between them (see `super::kept`).
    kept: std::sync::Arc<Keeper<sqlx::Postgres>>,
}

pub use super::pg_pool::{Liveness, pool_options};

/// The connection options of `url`. TLS is turned off for a server on this machine (a
/// loopback address or a socket) unless the URL asks for it with `sslmode=`: encrypting bytes
/// that never leave the machine cost a third of the worker's CPU per step in a profile, and
/// protects nothing. Any other host keeps sqlx's default (`prefer`).
pub fn connect_options(
    url: &str,
) -> std::result::Result<sqlx::postgres::PgConnectOptions, sqlx::Error> {
    use std::str::FromStr;
    let options = sqlx::postgres::PgConnectOptions::from_str(url)?;
    let host = options.get_host();
    let local = options.get_socket().is_some()
        || host.starts_with('/')
        || host == "localhost"
        || host
            .trim_matches(['[', ']'])
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    if local && !url.contains("sslmode=") {
        return Ok(options.ssl_mode(sqlx::postgres::PgSslMode::Disable));
    }
    Ok(options)
}

/// Group commits under way at once; each committer keeps a connection (see `Commits::held`).
///
/// One: a batch is whatever queued while the previous one committed, so fewer committers make
/// fewer, larger batches. Four committers that each kept a connection cycled so fast that they
/// made twice the transactions (half-size batches) and held 10,000 runs in flight back to
/// half; one made about as many as the pooled committers did and reached all of them (the
/// figures are in docs/benchmarks.md).
const COMMITTERS: usize = 1;

/// The pool's connections besides the committers' own: starts, claims, terminal commits,
/// reads, apalis's fetches and acks.
const SHARED_CONNECTIONS: u32 = 16;

/// How many of the shared connections a run's short statements may keep aside between them
/// (see `super::kept`): about as many as are busy at once at a few thousand steps a second,
/// and a quarter of the pool, so everything else still finds connections in it.
const KEPT_CONNECTIONS: usize = 4;

/// What the group committer needs of the store: the pool and the wake-ups.
#[derive(Clone)]
pub(crate) struct Commits {
    pool: PgPool,
    notifier: std::sync::Arc<crate::notify::Notifier>,
    /// Announces the ends it commits to the other processes.
    ends: super::pg_ends::Ends,
    /// What a new event's `relayed` is (see `relays`).
    relayed: i64,
    /// A committer's own connection, kept between its batches (`None` outside a committer).
    ///
    /// sqlx pings a connection when it leaves the pool (`test_before_acquire`, which stays on
    /// here: see [`PgStore::connect`]) and always when it goes back, so a statement run on
    /// `&pool` is three round trips to a backend that has to wake up for each. Progress
    /// checkpoints are most of our statements (two a step), and a committer runs them one after
    /// another, so it keeps one connection and skips both pings. A connection idle for
    /// [`HELD_UNTESTED`] or longer is pinged before use, and one that fails a statement is
    /// closed: the next statement takes a tested connection from the pool.
    held: Option<std::sync::Arc<std::sync::Mutex<Option<Held>>>>,
}

/// A connection a committer keeps, and when it last finished a statement.
#[derive(Debug)]
struct Held {
    conn: sqlx::pool::PoolConnection<sqlx::Postgres>,
    used: std::time::Instant,
}

/// How long a held connection may sit unused and still be trusted without a ping: within it
/// a connection cut by a restart fails its next statement, which the committer then commits
/// again on a tested connection from the pool (`commit_one`, and `group`'s fallback for a
/// batch), so nobody sees the cut.
const HELD_UNTESTED: Duration = Duration::from_secs(1);

/// Whether `e` says the connection was gone (cut by a restart or `pg_terminate_backend`, or
/// its socket closed) rather than that the statement was refused.
fn connection_gone(e: &StoreError) -> bool {
    match e {
        StoreError::Db(sqlx::Error::Io(_) | sqlx::Error::Protocol(_)) => true,
        // Class 57P (operator intervention: admin or crash shutdown) and 08 (connection
        // exception).
        StoreError::Db(sqlx::Error::Database(db)) => db
            .code()
            .is_some_and(|c| c.starts_with("57P") || c.starts_with("08")),
        _ => false,
    }
}

impl Commits {
    /// A connection for one statement, and whether it was held: the committer's own where it
    /// has one, else one from the pool (tested on the way out).
    async fn connection(&self) -> Result<(sqlx::pool::PoolConnection<sqlx::Postgres>, bool)> {
        let taken = self
            .held
            .as_ref()
            .and_then(|slot| slot.lock().expect("held connection slot").take());
        if let Some(Held { mut conn, used }) = taken {
            if used.elapsed() < HELD_UNTESTED || sqlx::Connection::ping(&mut *conn).await.is_ok() {
                return Ok((conn, true));
            }
            conn.close_on_drop();
        }
        Ok((self.pool.acquire().await?, false))
    }

    /// Ends a statement on `conn`: kept for the next one when it succeeded and this is a
    /// committer, closed when it failed (a connection that failed a statement may be broken;
    /// the pool opens a new one), otherwise given back to the pool.
    fn done<T>(&self, mut conn: sqlx::pool::PoolConnection<sqlx::Postgres>, r: &Result<T>) {
        match (&self.held, r) {
            (Some(slot), Ok(_)) => {
                *slot.lock().expect("held connection slot") = Some(Held {
                    conn,
                    used: std::time::Instant::now(),
                })
            }
            (_, Err(_)) => conn.close_on_drop(),
            (None, Ok(_)) => {}
        }
    }
}

impl PgStore {
    /// Runs one of the relay's statements (two per pass, a pass per burst of commits) on the
    /// connection the relay keeps, as a committer keeps its own: a pooled connection costs a
    /// test on the way out and a ping on the way back, which made a quarter of a short run's
    /// statements on PostgreSQL. When the kept connection was cut (a restart), once more on a
    /// tested one. Both statements are idempotent (a read, and marking rows relayed).
    async fn relay_statement<T>(
        &self,
        statement: impl for<'c> Fn(
            &'c mut sqlx::PgConnection,
        ) -> futures::future::BoxFuture<
            'c,
            std::result::Result<T, sqlx::Error>,
        >,
    ) -> Result<T> {
        let relay = Commits {
            held: Some(self.relay_conn.clone()),
            ..self.commits()
        };
        let (mut conn, held) = relay.connection().await?;
        let mut r = statement(&mut conn).await.map_err(StoreError::from);
        relay.done(conn, &r);
        if held && r.as_ref().is_err_and(connection_gone) {
            let mut conn = self.pool.acquire().await?;
            r = statement(&mut conn).await.map_err(StoreError::from);
            relay.done(conn, &r);
        }
        r
    }

    /// Connects and migrates both our schema and apalis's.
    pub async fn connect(url: &str) -> Result<PgStore> {
        // One direct connection first: a wrong URL or a server that is down fails here at once
        // with its real cause, instead of after the pool's acquire timeout.
        use sqlx::ConnectOptions;
        let options = connect_options(url)?;
        let probe = tokio::time::timeout(Duration::from_secs(10), options.connect())
            .await
            .map_err(|_| sqlx::Error::PoolTimedOut)??;
        sqlx::Connection::close(probe).await?;
        // Each group committer keeps a connection of its own (see `Commits::held`), so the pool
        // has one more per committer: the starts, claims and reads keep their 16.
        let liveness = std::sync::Arc::new(Liveness::default());
        let pool = pool_options(liveness.clone())
            .max_connections(SHARED_CONNECTIONS + COMMITTERS as u32)
            .connect_with(options)
            .await?;
        let notifier: std::sync::Arc<crate::notify::Notifier> = Default::default();
        // This process's waiters hear the runs other processes end; a store is handed out once
        // it listens (or, with the listener failing, after a bounded wait: the waiters'
        // re-check still finds every end).
        let listening = super::pg_ends::listen(
            pool.clone(),
            std::sync::Arc::downgrade(&notifier),
            liveness.clone(),
        );
        let trust = liveness.clone();
        let store = PgStore {
            ends: super::pg_ends::Ends::start(pool.clone()),
            relay_conn: Default::default(),
            kept: Keeper::new(
                pool.clone(),
                KEPT_CONNECTIONS,
                std::sync::Arc::new(move |idle| trust.trusts(idle)),
            ),
            liveness,
            pool,
            common: Common::new(notifier, COMMITTERS),
        };
        store.migrate().await?;
        if tokio::time::timeout(Duration::from_secs(5), listening)
            .await
            .is_err()
        {
            tracing::warn!(
                "not yet listening for runs' ends; waiters hear other processes' ends at their re-check"
            );
        }
        Ok(store)
    }

    /// Applies migrations; apalis's and ours share `_sqlx_migrations`, so each migrator ignores
    /// the other's entries. A transaction-level advisory lock keeps concurrent starters from
    /// migrating at once.
    pub async fn migrate(&self) -> Result<()> {
        let mut ours = sqlx::migrate!("./migrations/postgres");
        ours.set_ignore_missing(true);
        ours.run(&self.pool).await?;
        let mut apalis = apalis_postgres::PostgresStorage::<()>::migrations();
        apalis.set_ignore_missing(true);
        apalis.run(&self.pool).await?;
        // Two of apalis's indexes repeat others (`lidx` is `idx_apalis_jobs_lock_by`,
        // `unique_job_id` the primary key) and every job's insert and each of its status changes
        // (fetched, done; neither is a HOT update) writes into both.
        sqlx::raw_sql(
            "DROP INDEX IF EXISTS apalis.lidx; DROP INDEX IF EXISTS apalis.unique_job_id;",
        )
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// The pool, shared with the apalis storage so one file has one set of connections.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// What this store's listener has heard of its connections being cut.
    pub fn liveness(&self) -> &Liveness {
        &self.liveness
    }

    /// Tells the store whether a relay takes its events to Redis (this process has a
    /// `REDIS_URL`); without one, its events are written as relayed from now on.
    pub fn relaying(mut self, relays: bool) -> Self {
        self.common.relays = relays;
        self
    }
}

/// A run's start: one call of `sa_start_run_with_job` (migrations/postgres/0014 and 0018).
const START: &str = "SELECT outcome, rid, ahead, (run).* FROM sa_start_run_with_job($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21, $22, $23, $24, $25)";

/// [`START`] under an owner's cap of queued runs (`$26`): the owner's count is read first, in
/// the same statement, and the function runs only below the cap. The subquery's `OFFSET 0`
/// keeps it from being pulled up into the join, so its condition, which names only the outer
/// row, is a one-time filter above the function scan (`EXPLAIN` shows `One-Time Filter`)
/// rather than a join filter applied after the function has run. Over the cap the row comes
/// back with a NULL `outcome` and nothing was written
/// (`store::a_start_past_its_owners_cap_of_queued_runs_is_refused`).
const START_CAPPED: &str = "WITH q AS (SELECT CAST(COALESCE(SUM(queued), 0) AS BIGINT) AS n FROM sa_queue_depth WHERE owner = $3) \
     SELECT s.* FROM q LEFT JOIN LATERAL (SELECT outcome, rid, ahead, (run).* FROM sa_start_run_with_job($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21, $22, $23, $24, $25) \
     WHERE q.n < $26 OFFSET 0) s ON true";

/// A claim's writes as `c` (the claimed row) and `e` (its `run.started` or `run.resumed`
/// event) of a `WITH`, for the run `$id` names: `$1` the worker, `$2` the lease's deadline,
/// `$3` the time, `$5` the event's `relayed`; `{}` the statuses a claim takes
/// (`lifecycle::sql_sources`). A queued run is claimable once its thread is free and it is
/// the thread's oldest; a parked one at any time (a spurious claim replays and parks again).
macro_rules! claim_writes {
    ($id:literal) => {
        concat!(
            "c AS (UPDATE sa_runs SET claimed_from = status, status = 'running', lease_owner = $1, lease_epoch = lease_epoch + 1, \
             lease_expires_at = $2, attempts = attempts + 1, started_at = COALESCE(started_at, $3), \
             heartbeat_at = $3, updated_at = $3, event_seq = event_seq + 1, wake_at = NULL \
             WHERE id = ",
            $id,
            " AND status IN ({}) AND (status <> 'queued' OR ( \
               ",
            next_in_its_thread!("sa_runs", " OFFSET 0"),
            ")) ",
            limits_guard!(),
            " RETURNING *), \
             e AS (INSERT INTO sa_events (run_id, seq, type, data, created_at, relayed) \
               SELECT c.id, c.event_seq, CASE WHEN c.claimed_from = 'waiting' THEN 'run.resumed' ELSE 'run.started' END, \
                 json_build_object('attempt', c.attempts, 'crashes', c.crashes, 'worker', $1::text, 'from', c.claimed_from)::text, $3, $5 FROM c)"
        )
    };
}

/// The claimed run's context, as a column of [`Claims::claim`]'s statement (`$6` the most
/// messages): the thread's newest messages as a JSON array of `[id, run_id, step, key, body]`,
/// oldest first (the claim's statement has one row, and sqlx sends PostgreSQL one statement
/// per round trip). NULL where the context is more than messages, a compaction or a fork's
/// shared history: then the claimer reads it itself (`SqlStore::context_parts`).
macro_rules! claim_context {
    () => {
        ", CASE WHEN NOT EXISTS (SELECT 1 FROM sa_compactions WHERE thread_id = c.thread_id) \
           AND NOT EXISTS (SELECT 1 FROM sa_thread_lineage WHERE thread = c.thread_id) THEN \
           (SELECT CAST(COALESCE(json_agg(json_build_array(m.id, m.run_id, m.step, m.key, m.body) ORDER BY m.id), '[]') AS TEXT) \
            FROM (SELECT id, run_id, step, key, body FROM sa_messages WHERE thread_id = c.thread_id \
              ORDER BY id DESC LIMIT $6) m) END AS context"
    };
}

/// A notified worker's take of a job ([`super::sql::take_job`], `$4` the job, `$7` the queue)
/// and the claim of its run (`$6` the context's most messages) in one statement: one round
/// trip and one commit where they were two. The run is the one the taken job's body names.
/// The row comes back once the job was taken: with the claimed run's columns, or NULLs where
/// its run was not claimable (the job stays taken, as a fetched job whose run is not claimable
/// does; the worker settles it).
static TAKE_AND_CLAIM: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let take = super::sql::take_job("apalis.jobs", "apalis.workers", "now()", ["$4", "$1", "$7"]);
    format!(
        concat!(
            "WITH t AS ({take} RETURNING job), ",
            claim_writes!("(SELECT convert_from(t.job, 'UTF8')::json ->> 'run_id' FROM t)"),
            " SELECT convert_from(t.job, 'UTF8') AS taken_job, c.* FROM t LEFT JOIN (SELECT ",
            run_columns!(),
            claim_context!(),
            " FROM c) c ON true"
        ),
        crate::lifecycle::sql_sources(Transition::Claim),
        take = take,
    )
});

/// A thread's context from [`claim_context`]'s column.
fn context_from_json(json: &str) -> Result<ThreadContext> {
    let rows: Vec<(i64, String, i64, String, String)> =
        serde_json::from_str(json).map_err(|e| corrupt("claimed context", e))?;
    let messages = rows
        .into_iter()
        .map(|(id, run, step, key, body)| super::sql::stored_message(id, &run, step, key, &body))
        .collect::<Result<Vec<_>>>()?;
    Ok((None, messages))
}

// PostgreSQL locks rows: a park share-locks the runs it waits on before its own row, the order
// a child's terminal commit takes (its own row, then its parent's and waiters').
impl PgStore {
    /// A start past its owner's cap of queued runs: answered as SQLite's start answers it,
    /// whose checks run in this order: another owner's thread is not found, a replay of a
    /// keyed start gets its run (`Ok`: the start function answers it without inserting), and
    /// only then is the queue full.
    async fn full_queue(&self, new: &NewRun) -> Result<()> {
        let row = sqlx::query(
            "SELECT (SELECT owner FROM sa_threads WHERE id = $1), \
             EXISTS (SELECT 1 FROM sa_runs WHERE owner = $2 AND idempotency_key = $3)",
        )
        .bind(new.thread_id.as_str())
        .bind(&new.owner)
        .bind(new.idempotency_key.as_deref())
        .fetch_one(&self.pool)
        .await?;
        let owner: Option<OwnerId> = row.get(0);
        if owner.is_some_and(|o| o != new.owner) {
            return Err(StoreError::ThreadOwnedElsewhere(new.thread_id.clone()));
        }
        match row.get::<bool, _>(1) {
            true => Ok(()),
            false => Err(StoreError::QueueFull {
                cap: new.max_queued,
            }),
        }
    }

    /// A claim's row, its run claimed by `owner`, with the context its statement read when
    /// `context` (see [`claim_context`]).
    fn claimed_row(
        &self,
        row: &sqlx::postgres::PgRow,
        owner: &str,
        ttl: Duration,
        now: DateTime<Utc>,
        context: bool,
    ) -> Result<(Claim, Option<ThreadContext>)> {
        // The claimed row comes back whole: no second read.
        let run = Self::run_from_row(row)?;
        self.claimed(&run, owner, now);
        // The claim is committed: it never fails over its context. Where the statement read
        // none (a compaction, a fork's shared history) or it does not read, the claimer reads
        // it itself (and a row that does not read then fails the run, as
        // `End::from(StoreError::Corrupt)` does).
        let context = match context {
            true => row.get::<Option<String>, _>("context").and_then(|json| {
                context_from_json(&json)
                    .inspect_err(|e| tracing::debug!(run_id = %run.id, error = %e, "the claim's context did not read; the claimer reads it apart"))
                    .ok()
            }),
            false => None,
        };
        Ok((Claim::acquired(run, owner, ttl), context))
    }
}

#[async_trait]
impl SqlStore for PgStore {
    type Db = sqlx::Postgres;
    type Commits = Commits;
    const PARK_READS_FIRST: bool = true;
    const STATEMENTS_PER_COMMAND: bool = false;

    fn statements() -> &'static Statements {
        static S: std::sync::LazyLock<Statements> = std::sync::LazyLock::new(|| {
            Statements::new(
                "apalis.jobs",
                "apalis.workers",
                " FOR SHARE",
                "owner",
                "now()",
                " OFFSET 0",
            )
        });
        &S
    }

    fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The same pool: PostgreSQL's readers never wait for its writers (the SQLite store gives
    /// them connections of their own).
    fn reads(&self) -> &PgPool {
        &self.pool
    }

    fn common(&self) -> &Common {
        &self.common
    }

    async fn kept(&self) -> Result<Kept<sqlx::Postgres>> {
        Ok(self.kept.take().await?)
    }

    fn commits(&self) -> Commits {
        Commits {
            pool: self.pool.clone(),
            notifier: self.common.notifier.clone(),
            ends: self.ends.clone(),
            relayed: self.relayed_at_insert(),
            held: None,
        }
    }

    async fn start_run(&self, new: NewRun) -> Result<Created> {
        // One round trip (`sa_start_run_with_job`, migrations/postgres/0014): the checks and
        // inserts, the run's first job, and the answer with the run's row and its place in its
        // owner's queue.
        // The function writes it as the run's `run.queued` (seq 1).
        let queued: NewEvent = Event::RunQueued(event::RunQueued {
            agent: new.agent.clone(),
            thread_id: new.thread_id.visible_to(&new.owner).to_string(),
            parent_run_id: new.parent_run_id,
        })
        .into();
        let event = queued.data();
        let now = group::Landed::stamp();
        let start = |sql: &'static str| {
            bind_new_run!(sqlx::query(sql), new, now)
                .bind(new.if_busy == IfBusy::Reject)
                .bind(event.to_string())
                .bind(new.retry_of.map(|r| r.to_string()))
                .bind(i64::from(new.priority.clamp(1, 5)))
                .bind(new.place == QueuePlace::Back)
                .bind(QUEUE_NAME)
                .bind(job_body(new.id))
                .bind(JOB_MAX_ATTEMPTS as i32)
                .bind(self.relayed_at_insert())
                .bind(new.agent_version.as_deref())
        };
        // Its notification comes back to this process's listener too, which leaves it alone;
        // forgotten again unless the start writes the job.
        let mut started = self.common.started_here.remember(&new.job_id);
        let mut conn = self.kept().await?;
        // The owner's cap of queued runs is read in the same statement, just before the start
        // function, which runs only below it (`START_CAPPED`'s one-time filter): a start costs
        // one round trip with a cap as without. The cap's read is not in the function's
        // transaction snapshot (its parameters are fixed by its migration), so a burst of
        // starts may pass the cap by a few.
        let row = match new.max_queued {
            0 => start(START).fetch_one(&mut *conn).await?,
            cap => {
                let row = start(START_CAPPED)
                    .bind(cap.min(i64::MAX as u64) as i64)
                    .fetch_one(&mut *conn)
                    .await?;
                match row.get::<Option<String>, _>("outcome") {
                    Some(_) => row,
                    None => {
                        conn.keep();
                        // Over the cap: refused unless the thread is another owner's, or this
                        // is a replay of a keyed start, which the function answers with its run.
                        self.full_queue(&new).await?;
                        conn = self.kept().await?;
                        start(START).fetch_one(&mut *conn).await?
                    }
                }
            }
        };
        conn.keep();
        let outcome: String = row.get("outcome");
        if outcome == "created" {
            started.keep();
        }
        let rid: Option<String> = row.get("rid");
        let rid = rid
            .map(|r| r.parse::<RunId>().map_err(|e| corrupt("run id", e)))
            .transpose()?;
        let ahead = row.get::<i64, _>("ahead").clamp(0, i64::from(u32::MAX)) as u32;
        match (outcome.as_str(), rid) {
            ("created", Some(_)) => {
                // Handed to `held_by` when the run is next in line, by the take whose fence a
                // notified worker's take has too ([`Claims::take_job`]); after the start's own
                // statement, so the start function stays one for every caller, and a fetch
                // that got there first simply wins. The run and its job are committed: a failed
                // hand-over leaves the job to the queue, and the start stands.
                let held = match &new.held_by {
                    Some(worker) if ahead == 0 => self
                        .take_job(&new.job_id, worker)
                        .await
                        .inspect_err(|e| tracing::debug!(error = %e, "could not hand the new run's job to this process's worker; it waits on the queue"))
                        .is_ok_and(|run| run.is_some()),
                    _ => false,
                };
                if !held {
                    self.common.notifier.job_queued();
                }
                self.committed_one(new.id, 1, || queued, now);
                Ok(Created {
                    run: Self::run_from_row(&row)?,
                    existing: false,
                    ahead,
                    held,
                })
            }
            ("existing", Some(_)) => Ok(Created {
                run: Self::run_from_row(&row)?,
                existing: true,
                ahead: 0,
                held: false,
            }),
            ("busy", Some(active_run)) => Err(StoreError::Busy {
                thread_id: new.thread_id,
                active_run,
            }),
            ("owned_elsewhere", _) => Err(StoreError::ThreadOwnedElsewhere(new.thread_id)),
            (other, _) => Err(corrupt("sa_start_run outcome", other)),
        }
    }

    /// PostgreSQL's claim is one statement, and with `context` it also reads the run's
    /// context (see [`claim_context`]) where the claimer's first read had been a round trip
    /// of its own.
    async fn claim(
        &self,
        id: RunId,
        owner: &str,
        ttl: Duration,
        context: Option<u32>,
    ) -> Result<(Claim, Option<ThreadContext>)> {
        let now = group::Landed::stamp();
        let nms = now_ms();
        // One statement: the claim and its `run.started` / `run.resumed` event. A queued run is
        // claimable once its thread is free and it is the thread's oldest; a parked one at any
        // time (a spurious claim replays and parks again).
        macro_rules! claim {
            ($context:expr) => {
                sql!(
                    concat!(
                        "WITH ",
                        claim_writes!("$4"),
                        " SELECT ",
                        run_columns!(),
                        $context,
                        " FROM c"
                    ),
                    Transition::Claim
                )
            };
        }
        let row = sqlx::query(match context {
            None => claim!(""),
            Some(_) => claim!(claim_context!()),
        })
        .bind(owner)
        .bind(nms + ttl.as_millis() as i64)
        .bind(now)
        .bind(id.to_string())
        .bind(self.relayed_at_insert());
        let row = match context {
            None => row,
            Some(limit) => row.bind(i64::from(limit)),
        };
        // With concurrency limits, claims of one owner (and of one agent) take turns: under READ
        // COMMITTED two concurrent claims would both count the same running runs and both
        // pass. The locks go with the transaction.
        let row = if self.common.limits_in_force() {
            let mut tx = self.pool.begin().await?;
            sqlx::query(
                "SELECT pg_advisory_xact_lock(hashtext('owner:' || owner)), pg_advisory_xact_lock(hashtext('agent:' || agent)) FROM sa_runs WHERE id = $1",
            )
            .bind(id.to_string())
            .fetch_optional(&mut *tx)
            .await?;
            let r = row.fetch_optional(&mut *tx).await;
            if r.is_ok() {
                tx.commit().await?;
            }
            r
        } else {
            let mut conn = self.kept().await?;
            let r = row.fetch_optional(&mut *conn).await;
            if r.is_ok() {
                conn.keep();
            }
            r
        };
        // Two workers claiming two queued runs of one thread at once: the unique index on
        // active runs lets one win; the other simply finds nothing to claim.
        let row = match row {
            Err(sqlx::Error::Database(db)) if db.is_unique_violation() => {
                return Ok((Claim::NotClaimable(Some(RunStatus::Queued)), None));
            }
            other => other?,
        };
        match row {
            Some(row) => self.claimed_row(&row, owner, ttl, now, context.is_some()),
            None => {
                let status = self.get_run(id).await?.map(|r| r.status);
                Ok((Claim::NotClaimable(status), None))
            }
        }
    }

    /// The take and the claim in one statement ([`TAKE_AND_CLAIM`]), unless concurrency
    /// limits are in force: their claims take the owner's and the agent's advisory locks
    /// first ([`SqlStore::claim`]), so the two go one after the other then.
    async fn take_claim(
        &self,
        job_id: &str,
        worker: &str,
        ttl: Duration,
        limit: u32,
    ) -> Result<Option<Taken>> {
        if self.common.limits_in_force() {
            return super::sql::take_then_claim(self, job_id, worker, ttl, limit).await;
        }
        let now = group::Landed::stamp();
        let mut conn = self.kept().await?;
        let row = sqlx::query(TAKE_AND_CLAIM.as_str())
            .bind(worker)
            .bind(now_ms() + ttl.as_millis() as i64)
            .bind(now)
            .bind(job_id)
            .bind(self.relayed_at_insert())
            .bind(i64::from(limit))
            .bind(QUEUE_NAME)
            .fetch_optional(&mut *conn)
            .await;
        if row.is_ok() {
            conn.keep();
        }
        let row = match row {
            // The run's thread had another run claimed at the same moment (the unique index on
            // active runs): the statement is undone, take and all, and the job stays queued
            // for the fetch, which finds its run not claimable.
            Err(sqlx::Error::Database(db)) if db.is_unique_violation() => return Ok(None),
            other => other?,
        };
        let Some(row) = row else {
            return Ok(None);
        };
        let job: String = row.get("taken_job");
        let run_id = serde_json::from_str::<crate::domain::job::RunJob>(&job)
            .map_err(|e| StoreError::Corrupt(format!("job {job_id}: {e}")))?
            .run_id;
        let (claim, context) = match row.get::<Option<String>, _>("id") {
            Some(_) => self.claimed_row(&row, worker, ttl, now, true)?,
            None => {
                let status = self.get_run(run_id).await?.map(|r| r.status);
                (Claim::NotClaimable(status), None)
            }
        };
        Ok(Some(Taken {
            run_id,
            claim,
            context,
        }))
    }

    async fn commit_checkpoint(&self, lease: &Lease, cp: Checkpoint) -> Result<Option<Ending>> {
        self.common.group.commit(&self.commits(), lease, cp).await
    }

    /// In one statement, whatever the number of runs.
    ///
    /// Every process with `REDIS_URL` runs a relay, and two relays may mark overlapping ranges
    /// at once. A plain `UPDATE … FROM unnest(…)` locks rows in whatever order its plan visits
    /// them, so two such statements could each hold rows the other wanted ("deadlock
    /// detected", seen in CI's log). Here the rows are locked first, skipping any another
    /// relay holds: those are that relay's to mark (and if its transaction fails they stay
    /// unrelayed and are relayed again, which is idempotent), so no statement ever waits for
    /// another and none can deadlock.
    async fn mark_relayed_ranges(&self, ranges: &[(RunId, u64, u64)]) -> Result<()> {
        let runs: Vec<String> = ranges.iter().map(|(r, _, _)| r.to_string()).collect();
        let first: Vec<i64> = ranges.iter().map(|(_, f, _)| *f as i64).collect();
        let last: Vec<i64> = ranges.iter().map(|(_, _, l)| *l as i64).collect();
        self.relay_statement(|c| {
            let (runs, first, last) = (runs.clone(), first.clone(), last.clone());
            Box::pin(async move {
                sqlx::query(
                    "WITH s AS ( \
                       SELECT e.run_id, e.seq FROM sa_events e \
                       JOIN unnest($1::text[], $2::bigint[], $3::bigint[]) AS t(run_id, first, last) \
                         ON e.run_id = t.run_id AND e.seq BETWEEN t.first AND t.last \
                       WHERE e.relayed = 0 FOR UPDATE OF e SKIP LOCKED \
                     ) UPDATE sa_events e SET relayed = 1 FROM s WHERE e.run_id = s.run_id AND e.seq = s.seq",
                )
                .bind(runs)
                .bind(first)
                .bind(last)
                .execute(c)
                .await
                .map(drop)
            })
        })
        .await
    }

    async fn unrelayed_events(&self, limit: u32) -> Result<Vec<EventRecord>> {
        let rows = self
            .relay_statement(|c| {
                Box::pin(
                    sqlx::query(super::sql::UNRELAYED)
                        .bind(limit as i64)
                        .fetch_all(c),
                )
            })
            .await?;
        rows.iter().map(Self::event_from_row).collect()
    }

    async fn workers(&self) -> Result<Vec<(String, DateTime<Utc>)>> {
        let rows = sqlx::query(
            "SELECT id, last_seen FROM apalis.workers ORDER BY last_seen DESC LIMIT 200",
        )
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .iter()
            .map(|r| (r.get::<String, _>(0), r.get::<DateTime<Utc>, _>(1)))
            .collect())
    }
}

/// One checkpoint as one statement (so one round trip, and alone one implicit transaction):
/// the fenced UPDATE of the run row (which also locks it and reserves the event seqs), the
/// messages and the events, as data-modifying CTEs that all see the fence's RETURNING row. If
/// the fence matches nothing, nothing is inserted and no row comes back: the lease is lost.
///
/// `only_if` narrows the fence further (SQL appended to its `WHERE`; see [`super::ENDS_ALONE`]).
/// `announce` also sends the run's end to the other processes' waiters
/// ([`super::pg_ends::CHANNEL`]) from the statement itself, delivered as it commits: no
/// statement after it for the waiter to wait on.
fn checkpoint_query<'q>(
    lease: &Lease,
    cp: &Checkpoint,
    ff: FenceFields,
    now: DateTime<Utc>,
    relayed: i64,
    only_if: &str,
    announce: bool,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    let (guard, reach_columns, unsteered) = (ff.guard, ff.reach_columns, ff.only_if);
    let m_step: Vec<i64> = cp.messages.iter().map(|m| m.step as i64).collect();
    let m_role: Vec<String> = cp
        .messages
        .iter()
        .map(|m| m.message.role().to_owned())
        .collect();
    let m_key: Vec<String> = cp.messages.iter().map(|m| m.key.clone()).collect();
    let m_body: Vec<String> = cp
        .messages
        .iter()
        .map(|m| serde_json::to_string(&m.message).expect("message serializes"))
        .collect();
    let e_type: Vec<String> = cp.events.iter().map(|e| e.kind().to_owned()).collect();
    let e_data: Vec<String> = cp.events.iter().map(|e| e.data().to_string()).collect();
    // A terminal checkpoint also marks the run's job done, when the worker that ends the run
    // holds it (as `settle_held_job` would after it): column 5 of its row, the job settled.
    let terminal = ff.status.is_some();
    let (settle, settled) = match terminal {
        true => (
            format!(
                ", j AS ({}id = (SELECT r.job_id FROM sa_runs r, f WHERE r.id = $13) AND lock_by = $27 RETURNING id)",
                PgStore::statements().mark_job_done
            ),
            ", (SELECT id FROM j)",
        ),
        false => (String::new(), ""),
    };
    // A plain SELECT in a WITH runs only when the statement reads it.
    let announced = match announce {
        true => format!(
            ", n AS (SELECT pg_notify('{}', $13::text) FROM f) SELECT f.*{settled}, (SELECT count(*) FROM n) FROM f",
            super::pg_ends::CHANNEL
        ),
        false => format!(" SELECT f.*{settled} FROM f"),
    };
    let sql = format!(
        "WITH f AS ( \
           UPDATE sa_runs SET event_seq = event_seq + $1, step = COALESCE($2, step), \
           prompt_tokens = prompt_tokens + $3, completion_tokens = completion_tokens + $4, cost_nanos = cost_nanos + $21, \
           cache_read_tokens = cache_read_tokens + $25, cache_write_tokens = cache_write_tokens + $26, \
           lease_expires_at = CASE WHEN $5::text IS NULL THEN $6 ELSE 0 END, heartbeat_at = $7, updated_at = $7, \
           status = COALESCE($5, status), result = COALESCE($8, result), forced = COALESCE($9, forced), \
           error_kind = COALESCE($10, error_kind), error_message = COALESCE($11, error_message), \
           finished_at = COALESCE($12, finished_at), \
           cancel_requested = CASE WHEN $5::text IS NULL THEN cancel_requested ELSE 0 END \
           WHERE id = $13 AND lease_epoch = $14 AND status IN ({guard}){unsteered}{only_if} RETURNING event_seq, thread_id, parent_run_id{reach_columns} \
         ), m AS ( \
           INSERT INTO sa_messages (thread_id, run_id, step, role, key, body, created_at) \
           SELECT f.thread_id, $13, x.step, x.role, x.key, x.body, $7 \
           FROM f, unnest($15::bigint[], $16::text[], $17::text[], $18::text[]) AS x(step, role, key, body) \
           ON CONFLICT (key) DO NOTHING \
         ), e AS ( \
           INSERT INTO sa_events (run_id, seq, type, data, created_at, relayed) \
           SELECT $13, f.event_seq - $1 + x.ord, x.type, x.data, $7, $22 \
           FROM f, unnest($19::text[], $20::text[]) WITH ORDINALITY AS x(type, data, ord) \
         ), p AS ( \
           INSERT INTO sa_run_pins (run_id, name, value) \
           SELECT $13, x.name, x.value FROM f, unnest($23::text[], $24::text[]) AS x(name, value) \
           ON CONFLICT (run_id, name) DO NOTHING \
         ){settle}{announced}"
    );
    let (p_name, p_value): (Vec<String>, Vec<String>) = cp.pins.iter().cloned().unzip();
    let query = bind_fence!(sqlx::query(sqlx::AssertSqlSafe(sql)), cp, ff, lease, now)
        .bind(m_step)
        .bind(m_role)
        .bind(m_key)
        .bind(m_body)
        .bind(e_type)
        .bind(e_data)
        .bind(cp.cost_nanos.min(i64::MAX as u64) as i64)
        .bind(relayed)
        .bind(p_name)
        .bind(p_value)
        .bind(cp.usage.cache_read_tokens as i64)
        .bind(cp.usage.cache_write_tokens as i64);
    match terminal {
        true => query.bind(lease.owner.clone()),
        false => query,
    }
}

impl group::Renewals for Commits {
    async fn renew_many(&self, leases: &[Lease]) -> Result<Vec<Option<LeaseStatus>>> {
        // One fenced UPDATE for the whole group: each row only under its own epoch and in a
        // status a heartbeat may renew. It takes no row another transaction holds (SKIP
        // LOCKED): a statement holding many row locks while waiting for one more would
        // deadlock against a group commit or a terminal commit holding that one and waiting
        // for ours (seen at 10,000 runs in flight). The rows it skipped are renewed one by one
        // afterwards, each holding only its own lock while it waits, as a lone heartbeat does.
        let now = now_ms();
        let ids: Vec<String> = leases.iter().map(|l| l.run_id.to_string()).collect();
        let epochs: Vec<i64> = leases.iter().map(|l| l.epoch).collect();
        let expires: Vec<i64> = leases
            .iter()
            .map(|l| now + l.ttl.as_millis() as i64)
            .collect();
        let rows = sqlx::query(sql!(
            "WITH t AS (SELECT * FROM unnest($2::text[], $3::bigint[], $4::bigint[]) AS t(id, epoch, exp)), \
             l AS (SELECT r.id, t.exp FROM sa_runs r JOIN t ON r.id = t.id AND r.lease_epoch = t.epoch \
                   WHERE r.status IN ({}) FOR UPDATE OF r SKIP LOCKED) \
             UPDATE sa_runs r SET lease_expires_at = l.exp, heartbeat_at = $1 FROM l WHERE r.id = l.id \
             RETURNING r.id, r.cancel_requested, r.inbox",
            Transition::Heartbeat
        ))
        .bind(Utc::now())
        .bind(&ids)
        .bind(&epochs)
        .bind(&expires)
        .fetch_all(&self.pool)
        .await?;
        let renewed: std::collections::HashMap<String, LeaseStatus> = rows
            .iter()
            .map(|r| (r.get::<String, _>(0), lease_status(r, 1)))
            .collect();
        let mut out = Vec::with_capacity(leases.len());
        for (lease, id) in leases.iter().zip(&ids) {
            out.push(match renewed.get(id) {
                Some(c) => Some(*c),
                // Skipped while locked, or its lease is gone: asked alone.
                None => self.renew_one(lease).await?,
            });
        }
        Ok(out)
    }
}

impl Commits {
    /// One lease renewed by itself: `None` when the lease is gone.
    async fn renew_one(&self, lease: &Lease) -> Result<Option<LeaseStatus>> {
        let row = sqlx::query(sql!(
            "UPDATE sa_runs SET lease_expires_at = $1, heartbeat_at = $2 \
             WHERE id = $3 AND lease_epoch = $4 AND status IN ({}) RETURNING cancel_requested, inbox",
            Transition::Heartbeat
        ))
        .bind(now_ms() + lease.ttl.as_millis() as i64)
        .bind(Utc::now())
        .bind(lease.run_id.to_string())
        .bind(lease.epoch)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.map(|r| lease_status(&r, 0)))
    }
}

/// What a renewal's `cancel_requested, inbox` columns (from `at`) tell the holder.
fn lease_status(r: &sqlx::postgres::PgRow, at: usize) -> LeaseStatus {
    LeaseStatus::from_columns(r.get(at), r.get(at + 1))
}

impl group::Progress for Commits {
    async fn commit_one(&self, lease: Lease, cp: Checkpoint) -> Result<Option<Ending>> {
        let now = group::Landed::stamp();
        let status = cp.fence_fields(now).status;
        // The checkpoint as one statement, fenced further by `only_if`, announcing its end
        // when `announce` (see [`checkpoint_query`]).
        let statement = |only_if, announce| {
            checkpoint_query(
                &lease,
                &cp,
                cp.fence_fields(now),
                now,
                self.relayed,
                only_if,
                announce,
            )
        };
        match status {
            // A terminal checkpoint adds its effects on the parent and the waiters in the same
            // transaction. Most runs' ends have none (a top-level run nobody awaits, without
            // children still going): those end in the one statement, fenced on having none,
            // without a transaction around it (two statements and two round trips fewer per
            // run). Any other end, and a lost lease, match nothing there and take the
            // transaction, which finds out again what to do; a child's end (its lease knows)
            // takes it at once, as it tells its parent.
            Some(status) => {
                let alone = (!lease.child).then(|| statement(ENDS_ALONE, true));
                let alone = match alone {
                    Some(q) => q.fetch_optional(&self.pool).await?,
                    None => None,
                };
                if let Some(row) = alone {
                    let run = lease.run_id;
                    self.notifier
                        .committed(run, true, || cp.records(run, row.get(0), now));
                    // Fenced on having no child still going.
                    return Ok(Some(Ending {
                        children_going: false,
                        next: NextQueued::Unknown,
                        job_done: row.get(5),
                    }));
                }
                let query = statement("", false);
                let mut tx = self.pool.begin().await?;
                let Some(row) = query.fetch_optional(&mut *tx).await? else {
                    return Err(StoreError::LeaseLost(lease.run_id));
                };
                let children_going = row.get::<bool, _>(4);
                let job_done = row.get(5);
                PgStore::end_effects(
                    &mut tx,
                    lease.run_id,
                    &row,
                    status,
                    cp.error(),
                    self.relayed,
                )
                .await?;
                tx.commit().await?;
                self.ends.ended(lease.run_id);
                self.notifier.notify(lease.run_id);
                Ok(Some(Ending {
                    children_going,
                    next: NextQueued::Unknown,
                    job_done,
                }))
            }
            None => {
                let query = statement("", false);
                let (mut conn, held) = self.connection().await?;
                let mut row = query
                    .fetch_optional(&mut *conn)
                    .await
                    .map_err(StoreError::from);
                self.done(conn, &row);
                if held && row.as_ref().is_err_and(connection_gone) {
                    // The kept connection was cut (a restart): once more on a tested one,
                    // unless the statement had committed before the cut.
                    tracing::debug!(run_id = %lease.run_id, "a committer's connection was gone; committing on a fresh one");
                    if self.landed(&lease, &cp).await? {
                        self.notifier.progress(lease.run_id);
                        return Ok(None);
                    }
                    let mut conn = self.pool.acquire().await?;
                    let query = statement("", false);
                    row = query
                        .fetch_optional(&mut *conn)
                        .await
                        .map_err(StoreError::from);
                    self.done(conn, &row);
                }
                let Some(row) = row? else {
                    return Err(StoreError::LeaseLost(lease.run_id));
                };
                let landed = group::Landed {
                    last: row.get(0),
                    at: now,
                };
                self.announce(lease.run_id, &cp, landed);
                Ok(None)
            }
        }
    }

    async fn commit_many(
        &self,
        items: &[(Lease, Checkpoint)],
    ) -> Result<Vec<Option<group::Landed>>> {
        // One statement for the whole group (one round trip, one implicit transaction): the
        // fenced UPDATE of every run row at once, then the messages and events of the rows it
        // matched. A run appears at most once (a run has one checkpoint in flight); if not, the
        // group goes one by one.
        let ids: Vec<String> = items.iter().map(|(l, _)| l.run_id.to_string()).collect();
        if ids.iter().collect::<std::collections::HashSet<_>>().len() != ids.len() {
            return Err(StoreError::Corrupt(
                "one run twice in a group commit".into(),
            ));
        }
        let now = group::Landed::stamp();
        let now_ms = now_ms();
        let mut r = BatchColumns::default();
        for (lease, cp) in items {
            let run = lease.run_id.to_string();
            r.epoch.push(lease.epoch);
            r.events.push(cp.events.len() as i64);
            r.step.push(cp.step.map(i64::from));
            r.prompt.push(cp.usage.prompt_tokens as i64);
            r.completion.push(cp.usage.completion_tokens as i64);
            r.cost.push(cp.cost_nanos.min(i64::MAX as u64) as i64);
            r.cache_read.push(cp.usage.cache_read_tokens as i64);
            r.cache_write.push(cp.usage.cache_write_tokens as i64);
            r.lease_until
                .push(now_ms + lease.ttl.as_millis().min(i64::MAX as u128 / 2) as i64);
            for m in &cp.messages {
                r.m_run.push(run.clone());
                r.m_step.push(m.step as i64);
                r.m_role.push(m.message.role().to_owned());
                r.m_key.push(m.key.clone());
                r.m_body
                    .push(serde_json::to_string(&m.message).expect("message serializes"));
            }
            for (name, value) in &cp.pins {
                r.p_run.push(run.clone());
                r.p_name.push(name.clone());
                r.p_value.push(value.clone());
            }
            for (i, e) in cp.events.iter().enumerate() {
                r.e_run.push(run.clone());
                r.e_ord.push(i as i64 + 1);
                r.e_type.push(e.kind().to_owned());
                r.e_data.push(e.data().to_string());
            }
        }
        let (mut conn, _) = self.connection().await?;
        let applied: Result<Vec<(String, i64)>> = sqlx::query_as(group_sql())
            .bind(&ids)
            .bind(r.epoch)
            .bind(r.events)
            .bind(r.step)
            .bind(r.prompt)
            .bind(r.completion)
            .bind(r.cost)
            .bind(r.lease_until)
            .bind(now)
            .bind(r.m_run)
            .bind(r.m_step)
            .bind(r.m_role)
            .bind(r.m_key)
            .bind(r.m_body)
            .bind(r.e_run)
            .bind(r.e_ord)
            .bind(r.e_type)
            .bind(r.e_data)
            .bind(self.relayed)
            .bind(r.p_run)
            .bind(r.p_name)
            .bind(r.p_value)
            .bind(r.cache_read)
            .bind(r.cache_write)
            .fetch_all(&mut *conn)
            .await
            .map_err(StoreError::from);
        // On an error the group's fallback commits each item alone, on a tested connection.
        self.done(conn, &applied);
        let applied: std::collections::HashMap<String, i64> = applied?.into_iter().collect();
        Ok(ids
            .iter()
            .map(|id| applied.get(id).map(|&last| group::Landed { last, at: now }))
            .collect())
    }

    fn announce(&self, run: RunId, cp: &Checkpoint, landed: group::Landed) {
        self.notifier
            .committed(run, false, || cp.records(run, landed.last, landed.at));
    }

    fn for_committer(&self) -> Self {
        Commits {
            held: Some(Default::default()),
            ..self.clone()
        }
    }

    async fn recommit_one(&self, lease: Lease, cp: Checkpoint) -> Result<()> {
        if self.landed(&lease, &cp).await? {
            self.notifier.notify(lease.run_id);
            return Ok(());
        }
        self.commit_one(lease, cp).await.map(drop)
    }
}

impl Commits {
    /// Whether a progress checkpoint whose commit went unanswered is in the database. Its
    /// messages and events commit in one statement, and the engine never appends a message it
    /// has committed (a replay reads them first), so its first message's key being there for
    /// this run means the whole checkpoint landed. A checkpoint of events alone cannot be told,
    /// and is committed again.
    async fn landed(&self, lease: &Lease, cp: &Checkpoint) -> Result<bool> {
        let Some(first) = cp.messages.first() else {
            return Ok(false);
        };
        Ok(sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM sa_messages WHERE key = $1 AND run_id = $2)",
        )
        .bind(&first.key)
        .bind(lease.run_id.to_string())
        .fetch_one(&self.pool)
        .await?)
    }
}

/// The columns of a group commit, one array per column (bound as PostgreSQL arrays).
#[derive(Default)]
struct BatchColumns {
    p_run: Vec<String>,
    p_name: Vec<String>,
    p_value: Vec<String>,
    epoch: Vec<i64>,
    events: Vec<i64>,
    step: Vec<Option<i64>>,
    prompt: Vec<i64>,
    completion: Vec<i64>,
    cost: Vec<i64>,
    cache_read: Vec<i64>,
    cache_write: Vec<i64>,
    lease_until: Vec<i64>,
    m_run: Vec<String>,
    m_step: Vec<i64>,
    m_role: Vec<String>,
    m_key: Vec<String>,
    m_body: Vec<String>,
    e_run: Vec<String>,
    e_ord: Vec<i64>,
    e_type: Vec<String>,
    e_data: Vec<String>,
}

/// A group of progress checkpoints as one statement: what [`checkpoint_query`] does for one
/// run, for every run of the group, returning the id and new `event_seq` of each run whose
/// fence matched.
fn group_sql() -> &'static str {
    sql!(
        "WITH i AS ( \
           SELECT * FROM unnest($1::text[], $2::bigint[], $3::bigint[], $4::bigint[], $5::bigint[], $6::bigint[], $7::bigint[], $8::bigint[], $23::bigint[], $24::bigint[]) \
             AS i(id, epoch, n, step, pt, ct, cost, lease_until, cr, cw) \
         ), f AS ( \
           UPDATE sa_runs r SET event_seq = r.event_seq + i.n, step = COALESCE(i.step, r.step), \
             prompt_tokens = r.prompt_tokens + i.pt, completion_tokens = r.completion_tokens + i.ct, cost_nanos = r.cost_nanos + i.cost, \
             cache_read_tokens = r.cache_read_tokens + i.cr, cache_write_tokens = r.cache_write_tokens + i.cw, \
             lease_expires_at = i.lease_until, heartbeat_at = $9, updated_at = $9 \
           FROM i WHERE r.id = i.id AND r.lease_epoch = i.epoch AND r.status IN ({}) \
           RETURNING r.id, r.event_seq, r.thread_id, i.n \
         ), m AS ( \
           INSERT INTO sa_messages (thread_id, run_id, step, role, key, body, created_at) \
           SELECT f.thread_id, f.id, x.step, x.role, x.key, x.body, $9 \
           FROM unnest($10::text[], $11::bigint[], $12::text[], $13::text[], $14::text[]) AS x(run_id, step, role, key, body) \
           JOIN f ON f.id = x.run_id \
           ON CONFLICT (key) DO NOTHING \
         ), e AS ( \
           INSERT INTO sa_events (run_id, seq, type, data, created_at, relayed) \
           SELECT f.id, f.event_seq - f.n + x.ord, x.type, x.data, $9, $19 \
           FROM unnest($15::text[], $16::bigint[], $17::text[], $18::text[]) AS x(run_id, ord, type, data) \
           JOIN f ON f.id = x.run_id \
         ), p AS ( \
           INSERT INTO sa_run_pins (run_id, name, value) \
           SELECT f.id, x.name, x.value \
           FROM unnest($20::text[], $21::text[], $22::text[]) AS x(run_id, name, value) \
           JOIN f ON f.id = x.run_id \
           ON CONFLICT (run_id, name) DO NOTHING \
         ) SELECT id, event_seq FROM f",
        crate::lifecycle::Transition::Heartbeat
    )
}
