//! The PostgreSQL store: the scale-out backend, the mirror of [`super::sqlite`] statement for
//! statement (schema in `migrations/postgres`). Where SQLite serializes every writer,
//! PostgreSQL locks rows: the fenced `UPDATE … WHERE lease_epoch = $n` at the start of each
//! checkpoint locks the run's row, which keeps event `seq` gap-free; a start upserts (and so
//! locks) the thread row first, so two starts on one thread cannot both pass the busy check;
//! and the unique index on active runs turns a lost claim race into "not claimable".

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::postgres::{PgPoolOptions, PgRow};
use sqlx::{PgPool, Row};

use super::*;

/// The PostgreSQL implementation of [`Store`].
#[derive(Clone, Debug)]
pub struct PgStore {
    pool: PgPool,
    notifier: std::sync::Arc<crate::notify::Notifier>,
    cancels: std::sync::Arc<crate::notify::Notifier>,
}

impl PgStore {
    /// Connects and migrates both our schema and apalis's.
    pub async fn connect(url: &str) -> Result<PgStore> {
        // One direct connection first: a wrong URL or a server that is down fails here at once
        // with its real cause, instead of after the pool's acquire timeout.
        use sqlx::Connection;
        let probe = tokio::time::timeout(Duration::from_secs(10), sqlx::PgConnection::connect(url))
            .await
            .map_err(|_| sqlx::Error::PoolTimedOut)??;
        probe.close().await?;
        let pool = PgPoolOptions::new()
            .max_connections(16)
            .acquire_timeout(Duration::from_secs(30))
            .connect(url)
            .await?;
        let store = PgStore { pool, notifier: Default::default(), cancels: Default::default() };
        store.migrate().await?;
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
        Ok(())
    }

    /// The pool, shared with the apalis storage so one file has one set of connections.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }
}

// PostgreSQL locks rows: a park share-locks the runs it waits on before its own row, the order
// a child's terminal commit takes (its own row, then its parent's and waiters').
store_impl!(PgStore, sqlx::Postgres, "apalis.jobs", park_reads_first = true, share = " FOR SHARE", run_log = {
    async fn create_run(&self, new: NewRun) -> Result<Created> {
        // One round trip for the checks and inserts (`sa_create_run`, migrations/postgres/0002),
        // one to read the run back.
        let event = serde_json::json!({"agent": new.agent, "thread_id": new.thread_id, "parent_run_id": new.parent_run_id});
        let row = sqlx::query("SELECT outcome, rid FROM sa_create_run($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17)")
            .bind(new.id.to_string())
            .bind(new.thread_id.as_str())
            .bind(&new.owner)
            .bind(&new.agent)
            .bind(&new.input)
            .bind(new.metadata.to_string())
            .bind(serde_json::to_string(&new.limits).expect("limits serialize"))
            .bind(new.parent_run_id.map(|p| p.to_string()))
            .bind(&new.idempotency_key)
            .bind(&new.job_id)
            .bind(now_ms())
            .bind(Utc::now())
            .bind(new.tree.root_run_id.map(|r| r.to_string()))
            .bind(new.tree.depth as i64)
            .bind(new.tree.detached as i64)
            .bind(new.if_busy == IfBusy::Reject)
            .bind(event.to_string())
            .fetch_one(&self.pool)
            .await?;
        let outcome: String = row.get(0);
        let rid: Option<String> = row.get(1);
        let rid = rid.map(|r| r.parse::<RunId>().map_err(|e| corrupt("run id", e))).transpose()?;
        let read = |id: RunId| async move { self.get_run(id).await?.ok_or_else(|| corrupt("run vanished", id)) };
        match (outcome.as_str(), rid) {
            ("created", Some(id)) => Ok(Created { run: read(id).await?, existing: false }),
            ("existing", Some(id)) => Ok(Created { run: read(id).await?, existing: true }),
            ("busy", Some(active_run)) => Err(StoreError::Busy { thread_id: new.thread_id, active_run }),
            ("owned_elsewhere", _) => Err(StoreError::ThreadOwnedElsewhere(new.thread_id)),
            (other, _) => Err(corrupt("sa_create_run outcome", other)),
        }
    }

    async fn claim_run(&self, id: RunId, owner: &str, ttl: Duration) -> Result<Claim> {
        let now = Utc::now();
        let nms = now_ms();
        // One statement: the claim and its `run.started` / `run.resumed` event. A queued run is
        // claimable once its thread is free and it is the thread's oldest; a parked one at any
        // time (a spurious claim replays and parks again).
        let row = sqlx::query(sql!(
            concat!(
                "WITH c AS (UPDATE sa_runs SET claimed_from = status, status = 'running', lease_owner = $1, lease_epoch = lease_epoch + 1, \
                 lease_expires_at = $2, attempts = attempts + 1, started_at = COALESCE(started_at, $3), \
                 heartbeat_at = $3, updated_at = $3, event_seq = event_seq + 1, wake_at = NULL \
                 WHERE id = $4 AND status IN ({}) AND (status <> 'queued' OR ( \
                   NOT EXISTS (SELECT 1 FROM sa_runs a WHERE a.thread_id = sa_runs.thread_id AND a.status IN ('running','waiting')) \
                   AND NOT EXISTS (SELECT 1 FROM sa_runs q WHERE q.thread_id = sa_runs.thread_id AND q.status = 'queued' AND q.id < sa_runs.id))) \
                 RETURNING *), \
                 e AS (INSERT INTO sa_events (run_id, seq, type, data, created_at) \
                   SELECT c.id, c.event_seq, CASE WHEN c.claimed_from = 'waiting' THEN 'run.resumed' ELSE 'run.started' END, \
                     json_build_object('attempt', c.attempts, 'crashes', c.crashes, 'worker', $1::text, 'from', c.claimed_from)::text, $3 FROM c) \
                 SELECT ",
                run_columns!(),
                " FROM c"
            ),
            Transition::Claim
        ))
        .bind(owner)
        .bind(nms + ttl.as_millis() as i64)
        .bind(now)
        .bind(id.to_string())
        .fetch_optional(&self.pool)
        .await;
        // Two workers claiming two queued runs of one thread at once: the unique index on
        // active runs lets one win; the other simply finds nothing to claim.
        let row = match row {
            Err(sqlx::Error::Database(db)) if db.is_unique_violation() => {
                return Ok(Claim::NotClaimable(Some(RunStatus::Queued)));
            }
            other => other?,
        };
        let Some(row) = row else {
            let status = self.get_run(id).await?.map(|r| r.status);
            return Ok(Claim::NotClaimable(status));
        };
        // The claimed row comes back whole: no second read.
        let run = run_from_row(&row)?;
        self.notifier.notify(id);
        Ok(Claim::Acquired(Lease { run_id: id, epoch: run.lease_epoch, owner: owner.to_owned(), ttl }, Box::new(run)))
    }

    async fn checkpoint(&self, lease: &Lease, cp: Checkpoint) -> Result<()> {
        // One statement, so one round trip and one implicit transaction: the fenced UPDATE of
        // the run row (which also locks it and reserves the event seqs), the messages and the
        // events, as data-modifying CTEs that all see the fence's RETURNING row. If the fence
        // matches nothing, nothing is inserted and no row comes back: the lease is lost. A
        // terminal checkpoint adds its effects on the parent and the waiters in the same
        // transaction.
        let now = Utc::now();
        let ff = cp.fence_fields(now);
        let (status, guard, reach_columns) = (ff.status, ff.guard, ff.reach_columns);
        let m_step: Vec<i64> = cp.messages.iter().map(|m| m.step as i64).collect();
        let m_role: Vec<String> = cp.messages.iter().map(|m| m.message.role().to_owned()).collect();
        let m_key: Vec<String> = cp.messages.iter().map(|m| m.key.clone()).collect();
        let m_body: Vec<String> = cp.messages.iter().map(|m| serde_json::to_string(&m.message).expect("message serializes")).collect();
        let e_type: Vec<String> = cp.events.iter().map(|e| e.kind.as_str().to_owned()).collect();
        let e_data: Vec<String> = cp.events.iter().map(|e| e.data.to_string()).collect();
        let sql = format!(
            "WITH f AS ( \
               UPDATE sa_runs SET event_seq = event_seq + $1, step = COALESCE($2, step), \
               prompt_tokens = prompt_tokens + $3, completion_tokens = completion_tokens + $4, \
               lease_expires_at = CASE WHEN $5::text IS NULL THEN $6 ELSE 0 END, heartbeat_at = $7, updated_at = $7, \
               status = COALESCE($5, status), result = COALESCE($8, result), forced = COALESCE($9, forced), \
               error_kind = COALESCE($10, error_kind), error_message = COALESCE($11, error_message), \
               finished_at = COALESCE($12, finished_at), \
               cancel_requested = CASE WHEN $5::text IS NULL THEN cancel_requested ELSE 0 END \
               WHERE id = $13 AND lease_epoch = $14 AND status IN ({guard}) RETURNING event_seq, thread_id, parent_run_id{reach_columns} \
             ), m AS ( \
               INSERT INTO sa_messages (thread_id, run_id, step, role, key, body, created_at) \
               SELECT f.thread_id, $13, x.step, x.role, x.key, x.body, $7 \
               FROM f, unnest($15::bigint[], $16::text[], $17::text[], $18::text[]) AS x(step, role, key, body) \
               ON CONFLICT (key) DO NOTHING \
             ), e AS ( \
               INSERT INTO sa_events (run_id, seq, type, data, created_at) \
               SELECT $13, f.event_seq - $1 + x.ord, x.type, x.data, $7 \
               FROM f, unnest($19::text[], $20::text[]) WITH ORDINALITY AS x(type, data, ord) \
             ) SELECT * FROM f"
        );
        let query = bind_fence!(sqlx::query(sqlx::AssertSqlSafe(sql)), cp, ff, lease, now)
            .bind(m_step)
            .bind(m_role)
            .bind(m_key)
            .bind(m_body)
            .bind(e_type)
            .bind(e_data);
        match status {
            Some(status) => {
                let mut tx = self.pool.begin().await?;
                let Some(row) = query.fetch_optional(&mut *tx).await? else { return Err(StoreError::LeaseLost(lease.run_id)) };
                let thread: String = row.get(1);
                let parent: Option<String> = row.get(2);
                let reach = Reach { waits: row.get(3), children: row.get(4) };
                Self::terminal_effects(&mut tx, lease.run_id, &thread, parent.as_deref(), status, cp.error(), reach).await?;
                tx.commit().await?;
            }
            None => {
                if query.fetch_optional(&self.pool).await?.is_none() {
                    return Err(StoreError::LeaseLost(lease.run_id));
                }
            }
        }
        self.notifier.notify(lease.run_id);
        Ok(())
    }

}, queries = {
    async fn list_runs(&self, owner: &str, f: &RunFilter, limit: u32) -> Result<Vec<RunRecord>> {
        let RunFilter { status, agent, thread_id, parent_run_id, before } = f;
        let statuses: Vec<&str> = status.iter().map(|s| s.as_str()).collect();
        let rows = sqlx::query(concat!(
            "SELECT ",
            run_columns!(),
            " FROM sa_runs WHERE owner = $1 \
             AND ($2::text[] IS NULL OR status = ANY($2)) \
             AND ($3 IS NULL OR agent = $3) AND ($4 IS NULL OR thread_id = $4) \
             AND ($5 IS NULL OR parent_run_id = $5) AND ($6 IS NULL OR id < $6) \
             ORDER BY id DESC LIMIT $7"
        ))
        .bind(owner)
        .bind((!statuses.is_empty()).then(|| statuses.iter().map(|s| s.to_string()).collect::<Vec<String>>()))
        .bind(agent)
        .bind(thread_id.as_ref().map(|t| t.as_str().to_owned()))
        .bind(parent_run_id.map(|p| p.to_string()))
        .bind(before.map(|b| b.to_string()))
        .bind(limit as i64)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(run_from_row).collect()
    }

});

row_mappers!(PgRow);
