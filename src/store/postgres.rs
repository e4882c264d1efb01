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
use sqlx::{PgPool, Row, Transaction};

use super::*;

/// The PostgreSQL implementation of [`Store`].
#[derive(Clone, Debug)]
pub struct PgStore {
    pool: PgPool,
    notifier: std::sync::Arc<crate::notify::Notifier>,
    cancels: std::sync::Arc<crate::notify::Notifier>,
}

macro_rules! run_columns {
    () => {
        "id, thread_id, owner, agent, status, input, metadata, limits, parent_run_id, root_run_id, depth, detached, \
    wake_at, claimed_from, step, forced, \
    result, error_kind, error_message, prompt_tokens, completion_tokens, attempts, lease_epoch, cancel_requested, \
    job_id, event_seq, created_at, started_at, finished_at, heartbeat_at"
    };
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

    /// Inserts a commit's events in one statement (one round trip, whatever their number).
    async fn insert_events(
        tx: &mut Transaction<'_, sqlx::Postgres>,
        run: RunId,
        first_seq: u64,
        events: &[NewEvent],
    ) -> Result<()> {
        if events.is_empty() {
            return Ok(());
        }
        let now = Utc::now();
        let run = run.to_string();
        let mut q = sqlx::QueryBuilder::<sqlx::Postgres>::new("INSERT INTO sa_events (run_id, seq, type, data, created_at) ");
        q.push_values(events.iter().enumerate(), |mut b, (i, ev)| {
            b.push_bind(run.clone())
                .push_bind((first_seq + i as u64) as i64)
                .push_bind(ev.kind.as_str())
                .push_bind(ev.data.to_string())
                .push_bind(now);
        });
        q.build().execute(&mut **tx).await?;
        Ok(())
    }
}



#[async_trait]
impl Store for PgStore {
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

    async fn get_run(&self, id: RunId) -> Result<Option<RunRecord>> {
        let row = sqlx::query(concat!("SELECT ", run_columns!(), " FROM sa_runs WHERE id = $1"))
            .bind(id.to_string())
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(run_from_row).transpose()
    }

    async fn claim_run(&self, id: RunId, owner: &str, ttl: Duration, max_attempts: u32) -> Result<Claim> {
        let now = Utc::now();
        let nms = now_ms();
        // One statement: the claim and its `run.started` / `run.resumed` event.
        let row = sqlx::query(concat!(
            "WITH c AS (UPDATE sa_runs SET claimed_from = status, status = 'running', lease_owner = $1, lease_epoch = lease_epoch + 1, \
             lease_expires_at = $2, attempts = attempts + 1, started_at = COALESCE(started_at, $3), \
             heartbeat_at = $3, updated_at = $3, event_seq = event_seq + 1 \
             WHERE id = $4 AND ( \
               (status = 'queued' \
                 AND NOT EXISTS (SELECT 1 FROM sa_runs a WHERE a.thread_id = sa_runs.thread_id AND a.status IN ('running','waiting')) \
                 AND NOT EXISTS (SELECT 1 FROM sa_runs q WHERE q.thread_id = sa_runs.thread_id AND q.status = 'queued' AND q.id < sa_runs.id)) \
               OR status = 'waiting' \
               OR (status = 'running' AND lease_expires_at < $5 AND attempts < $6)) \
             RETURNING *), \
             e AS (INSERT INTO sa_events (run_id, seq, type, data, created_at) \
               SELECT c.id, c.event_seq, CASE WHEN c.claimed_from = 'waiting' THEN 'run.resumed' ELSE 'run.started' END, \
                 json_build_object('attempt', c.attempts, 'worker', $1::text, 'from', c.claimed_from)::text, $3 FROM c) \
             SELECT ",
            run_columns!(),
            " FROM c"
        ))
        .bind(owner)
        .bind(nms + ttl.as_millis() as i64)
        .bind(now)
        .bind(id.to_string())
        .bind(nms)
        .bind(max_attempts as i64)
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
        if let Some(row) = row {
            // The claimed row comes back whole: no second read.
            let run = run_from_row(&row)?;
            self.notifier.notify(id);
            return Ok(Claim::Acquired(Lease { run_id: id, epoch: run.lease_epoch, owner: owner.to_owned(), ttl }, Box::new(run)));
        }
        let mut tx = self.pool.begin().await?;
        // Not claimable; if that is because its workers keep dying, fail it for good.
        let gave_up = sqlx::query(
            "UPDATE sa_runs SET status = 'failed', error_kind = 'lost', \
             error_message = 'the run was abandoned by ' || attempts || ' workers in a row (crashes or kills); giving up', \
             finished_at = $1, updated_at = $1, lease_expires_at = 0, event_seq = event_seq + 1 \
             WHERE id = $2 AND status = 'running' AND lease_expires_at < $3 AND attempts >= $4 RETURNING event_seq, attempts",
        )
        .bind(now)
        .bind(id.to_string())
        .bind(nms)
        .bind(max_attempts as i64)
        .fetch_optional(&mut *tx)
        .await?;
        if let Some(row) = gave_up {
            let seq: i64 = row.get(0);
            let attempts: i64 = row.get(1);
            Self::insert_events(
                &mut tx,
                id,
                seq as u64,
                &[NewEvent::new(
                    EventKind::RunFailed,
                    serde_json::json!({"error": {"kind": "lost", "message": format!("abandoned by {attempts} workers")}}),
                )],
            )
            .await?;
            tx.commit().await?;
            self.notifier.notify(id);
            return Ok(Claim::GaveUp);
        }
        tx.rollback().await?;
        let status = self.get_run(id).await?.map(|r| r.status);
        Ok(Claim::NotClaimable(status))
    }

    async fn renew_lease(&self, lease: &Lease) -> Result<LeaseStatus> {
        let row = sqlx::query(
            "UPDATE sa_runs SET lease_expires_at = $1, heartbeat_at = $2 \
             WHERE id = $3 AND lease_epoch = $4 AND status = 'running' RETURNING cancel_requested",
        )
        .bind(now_ms() + lease.ttl.as_millis() as i64)
        .bind(Utc::now())
        .bind(lease.run_id.to_string())
        .bind(lease.epoch)
        .fetch_optional(&self.pool)
        .await?;
        match row {
            Some(r) => Ok(LeaseStatus { cancel_requested: r.get::<i64, _>(0) != 0 }),
            None => Err(StoreError::LeaseLost(lease.run_id)),
        }
    }

    async fn release_lease(&self, lease: &Lease) -> Result<()> {
        sqlx::query("UPDATE sa_runs SET lease_expires_at = 0 WHERE id = $1 AND lease_epoch = $2 AND status = 'running'")
            .bind(lease.run_id.to_string())
            .bind(lease.epoch)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn checkpoint(&self, lease: &Lease, cp: Checkpoint) -> Result<()> {
        // One statement, so one round trip and one implicit transaction: the fenced UPDATE of
        // the run row (which also locks it and reserves the event seqs), the messages and the
        // events, as data-modifying CTEs that all see the fence's RETURNING row. If the fence
        // matches nothing, nothing is inserted and no row comes back: the lease is lost.
        let now = Utc::now();
        let n = cp.events.len() as i64;
        let (status, result, forced, ekind, emsg, finished) = match &cp.finish {
            None => (None, None, None, None, None, None),
            Some(Finish::Succeeded { result, forced }) => {
                (Some(RunStatus::Succeeded), Some(result.clone()), Some(*forced as i64), None, None, Some(now))
            }
            Some(Finish::Failed(e)) => (Some(RunStatus::Failed), None, None, Some(e.kind.as_str()), Some(e.message.clone()), Some(now)),
            Some(Finish::Cancelled) => (Some(RunStatus::Cancelled), None, None, None, None, Some(now)),
        };
        let (status, park, wake_at) = match (status, cp.park) {
            (None, Some(wake)) => (Some(RunStatus::Waiting), 1i64, wake),
            (s, _) => (s, 0i64, None),
        };
        if let Some(to) = status {
            debug_assert!(RunStatus::Running.can_become(to));
        }
        let m_step: Vec<i64> = cp.messages.iter().map(|m| m.step as i64).collect();
        let m_role: Vec<String> = cp.messages.iter().map(|m| m.message.role().to_owned()).collect();
        let m_key: Vec<String> = cp.messages.iter().map(|m| m.key.clone()).collect();
        let m_body: Vec<String> = cp.messages.iter().map(|m| serde_json::to_string(&m.message).expect("message serializes")).collect();
        let e_type: Vec<String> = cp.events.iter().map(|e| e.kind.as_str().to_owned()).collect();
        let e_data: Vec<String> = cp.events.iter().map(|e| e.data.to_string()).collect();
        let row = sqlx::query(
            "WITH f AS ( \
               UPDATE sa_runs SET event_seq = event_seq + $1, step = COALESCE($2, step), \
               prompt_tokens = prompt_tokens + $3, completion_tokens = completion_tokens + $4, \
               lease_expires_at = CASE WHEN $5::text IS NULL THEN $6 ELSE 0 END, heartbeat_at = $7, updated_at = $7, \
               status = COALESCE($5, status), result = COALESCE($8, result), forced = COALESCE($9, forced), \
               error_kind = COALESCE($10, error_kind), error_message = COALESCE($11, error_message), \
               finished_at = COALESCE($12, finished_at), \
               cancel_requested = CASE WHEN $5::text IS NULL OR $15 = 1 THEN cancel_requested ELSE 0 END, \
               wake_at = CASE WHEN $15 = 1 THEN $16 ELSE wake_at END \
               WHERE id = $13 AND lease_epoch = $14 AND status = 'running' RETURNING event_seq, thread_id \
             ), m AS ( \
               INSERT INTO sa_messages (thread_id, run_id, step, role, key, body, created_at) \
               SELECT f.thread_id, $13, x.step, x.role, x.key, x.body, $7 \
               FROM f, unnest($17::bigint[], $18::text[], $19::text[], $20::text[]) AS x(step, role, key, body) \
               ON CONFLICT (key) DO NOTHING \
             ), e AS ( \
               INSERT INTO sa_events (run_id, seq, type, data, created_at) \
               SELECT $13, f.event_seq - $1 + x.ord, x.type, x.data, $7 \
               FROM f, unnest($21::text[], $22::text[]) WITH ORDINALITY AS x(type, data, ord) \
             ) SELECT event_seq FROM f",
        )
        .bind(n)
        .bind(cp.step.map(|s| s as i64))
        .bind(cp.usage.prompt_tokens as i64)
        .bind(cp.usage.completion_tokens as i64)
        .bind(status.map(RunStatus::as_str))
        .bind(now_ms() + lease.ttl.as_millis() as i64)
        .bind(now)
        .bind(result)
        .bind(forced)
        .bind(ekind)
        .bind(emsg)
        .bind(finished)
        .bind(lease.run_id.to_string())
        .bind(lease.epoch)
        .bind(park)
        .bind(wake_at)
        .bind(m_step)
        .bind(m_role)
        .bind(m_key)
        .bind(m_body)
        .bind(e_type)
        .bind(e_data)
        .fetch_optional(&self.pool)
        .await?;
        if row.is_none() {
            return Err(StoreError::LeaseLost(lease.run_id));
        }
        self.notifier.notify(lease.run_id);
        Ok(())
    }

    async fn thread_messages(&self, thread: &ThreadId) -> Result<Vec<StoredMessage>> {
        let rows = sqlx::query("SELECT id, run_id, step, key, body FROM sa_messages WHERE thread_id = $1 ORDER BY id")
            .bind(thread.as_str())
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(message_from_row).collect()
    }

    async fn events_after(&self, run: RunId, after: u64, limit: u32) -> Result<Vec<EventRecord>> {
        let rows = sqlx::query(
            "SELECT run_id, seq, type, data, created_at FROM sa_events WHERE run_id = $1 AND seq > $2 ORDER BY seq LIMIT $3",
        )
        .bind(run.to_string())
        .bind(after as i64)
        .bind(limit as i64)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(event_from_row).collect()
    }

    async fn request_cancel(&self, run: RunId) -> Result<CancelOutcome> {
        let now = Utc::now();
        let mut tx = self.pool.begin().await?;
        // A queued or parked run holds no worker: cancel it here and now.
        let mut row = None;
        for state in ["queued", "waiting"] {
            row = sqlx::query(
                "UPDATE sa_runs SET status = 'cancelled', finished_at = $1, updated_at = $1, event_seq = event_seq + 1, \
                 cancel_requested = 0, lease_expires_at = 0 WHERE id = $2 AND status = $3 RETURNING event_seq",
            )
            .bind(now)
            .bind(run.to_string())
            .bind(state)
            .fetch_optional(&mut *tx)
            .await?
            .map(|r| (r, state));
            if row.is_some() {
                break;
            }
        }
        if let Some((row, state)) = row {
            let seq: i64 = row.get(0);
            Self::insert_events(&mut tx, run, seq as u64, &[NewEvent::new(EventKind::RunCancelled, serde_json::json!({"while": state}))])
                .await?;
            tx.commit().await?;
            self.notifier.notify(run);
            return Ok(CancelOutcome::Cancelled);
        }
        let flagged = sqlx::query(
            "UPDATE sa_runs SET cancel_requested = 1, updated_at = $1 WHERE id = $2 AND status = 'running'",
        )
        .bind(now)
        .bind(run.to_string())
        .execute(&mut *tx)
        .await?
        .rows_affected();
        tx.commit().await?;
        if flagged > 0 {
            self.notifier.notify(run);
            self.cancels.notify(run);
            return Ok(CancelOutcome::Requested);
        }
        Ok(match self.get_run(run).await? {
            Some(r) => CancelOutcome::AlreadyFinished(r.status),
            None => CancelOutcome::NotFound,
        })
    }

    async fn orphans(&self, grace: Duration) -> Result<Vec<Orphan>> {
        let nms = now_ms();
        // apalis's `Jobs` table is read, never written: a queued run whose job is gone (a crash
        // between our commit and the push) or finished needs a new one.
        let rows = sqlx::query(
            "SELECT id, status FROM sa_runs r WHERE r.enqueued_at < $1 AND ( \
               (r.status = 'running' AND r.lease_expires_at < $2) OR \
               (r.status = 'waiting' AND r.wake_at IS NOT NULL AND r.wake_at < $2) OR \
               (r.status = 'waiting' AND NOT EXISTS (SELECT 1 FROM sa_runs c WHERE c.parent_run_id = r.id \
                  AND c.status IN ('queued','running','waiting'))) OR \
               (r.status = 'queued' \
                 AND NOT EXISTS (SELECT 1 FROM apalis.jobs j WHERE j.id = r.job_id AND j.status IN ('Pending','Queued','Running')) \
                 AND NOT EXISTS (SELECT 1 FROM sa_runs a WHERE a.thread_id = r.thread_id AND a.status IN ('running','waiting'))) \
             ) LIMIT 1000",
        )
        .bind(nms - grace.as_millis() as i64)
        .bind(nms)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                let id: String = r.get(0);
                let st: String = r.get(1);
                Ok(Orphan {
                    run_id: id.parse().map_err(|e| corrupt("run id", e))?,
                    status: RunStatus::parse(&st).ok_or_else(|| corrupt("status", &st))?,
                })
            })
            .collect()
    }

    async fn set_job(&self, run: RunId, job_id: &str) -> Result<()> {
        sqlx::query("UPDATE sa_runs SET job_id = $1, enqueued_at = $2 WHERE id = $3")
            .bind(job_id)
            .bind(now_ms())
            .bind(run.to_string())
            .execute(&self.pool)
            .await?;
        Ok(())
    }
    async fn wipe(&self) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        for t in ["sa_events", "sa_messages", "sa_runs", "sa_threads", "sa_waits"] {
            sqlx::query(sqlx::AssertSqlSafe(format!("DELETE FROM {t}"))).execute(&mut *tx).await?;
        }
        sqlx::query("DELETE FROM apalis.jobs WHERE job_type = $1").bind(crate::queue::QUEUE_NAME).execute(&mut *tx).await?;
        tx.commit().await?;
        Ok(())
    }

    async fn checkpoint_rows(&self) -> Result<i64> {
        Ok(sqlx::query_scalar("SELECT (SELECT count(*) FROM sa_messages) + (SELECT count(*) FROM sa_events)").fetch_one(&self.pool).await?)
    }

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

    async fn get_thread(&self, id: &ThreadId) -> Result<Option<ThreadRecord>> {
        let row = sqlx::query("SELECT id, owner, created_at, updated_at FROM sa_threads WHERE id = $1")
            .bind(id.as_str())
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.map(|r| ThreadRecord {
            id: id.clone(),
            owner: r.get("owner"),
            created_at: r.get("created_at"),
            updated_at: r.get("updated_at"),
        }))
    }

    async fn messages_page(&self, thread: &ThreadId, after: i64, limit: u32) -> Result<Vec<StoredMessage>> {
        let rows = sqlx::query(
            "SELECT id, run_id, step, key, body FROM sa_messages WHERE thread_id = $1 AND id > $2 ORDER BY id LIMIT $3",
        )
        .bind(thread.as_str())
        .bind(after)
        .bind(limit as i64)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(message_from_row).collect()
    }

    async fn next_queued(&self, thread: &ThreadId) -> Result<Option<RunId>> {
        let id: Option<String> =
            sqlx::query_scalar("SELECT id FROM sa_runs WHERE thread_id = $1 AND status = 'queued' ORDER BY id LIMIT 1")
                .bind(thread.as_str())
                .fetch_optional(&self.pool)
                .await?;
        id.map(|i| i.parse().map_err(|e| corrupt("run id", e))).transpose()
    }

    async fn queue_position(&self, run: RunId) -> Result<i64> {
        Ok(sqlx::query_scalar("SELECT count(*) FROM sa_runs WHERE status = 'queued' AND id < $1")
            .bind(run.to_string())
            .fetch_one(&self.pool)
            .await?)
    }

    async fn status_counts(&self) -> Result<Vec<(RunStatus, i64)>> {
        let rows = sqlx::query("SELECT status, count(*) FROM sa_runs GROUP BY status").fetch_all(&self.pool).await?;
        rows.iter()
            .map(|r| {
                let s: String = r.get(0);
                Ok((RunStatus::parse(&s).ok_or_else(|| corrupt("status", &s))?, r.get::<i64, _>(1)))
            })
            .collect()
    }

    fn subscribe(&self, run: RunId) -> std::sync::Arc<tokio::sync::Notify> {
        self.notifier.subscribe(run)
    }

    fn subscribe_cancel(&self, run: RunId) -> std::sync::Arc<tokio::sync::Notify> {
        self.cancels.subscribe(run)
    }

    async fn append_events(&self, run: RunId, events: Vec<NewEvent>) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        let row = sqlx::query("UPDATE sa_runs SET event_seq = event_seq + $1 WHERE id = $2 RETURNING event_seq")
            .bind(events.len() as i64)
            .bind(run.to_string())
            .fetch_optional(&mut *tx)
            .await?;
        let Some(row) = row else { return Ok(()) };
        let last: i64 = row.get(0);
        Self::insert_events(&mut tx, run, (last - events.len() as i64 + 1) as u64, &events).await?;
        tx.commit().await?;
        self.notifier.notify(run);
        Ok(())
    }

    async fn children(&self, run: RunId) -> Result<Vec<RunRecord>> {
        let rows = sqlx::query(concat!("SELECT ", run_columns!(), " FROM sa_runs WHERE parent_run_id = $1 ORDER BY id"))
            .bind(run.to_string())
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(run_from_row).collect()
    }

    async fn tree_usage(&self, run: RunId) -> Result<(Usage, u64)> {
        let row = sqlx::query(
            "WITH RECURSIVE tree(id) AS (SELECT $1::text UNION ALL SELECT r.id FROM sa_runs r JOIN tree t ON r.parent_run_id = t.id) \
             SELECT COALESCE(SUM(prompt_tokens), 0)::BIGINT, COALESCE(SUM(completion_tokens), 0)::BIGINT, COALESCE(SUM(step), 0)::BIGINT \
             FROM sa_runs WHERE id IN (SELECT id FROM tree)",
        )
        .bind(run.to_string())
        .fetch_one(&self.pool)
        .await?;
        Ok((
            Usage { prompt_tokens: row.get::<i64, _>(0) as u64, completion_tokens: row.get::<i64, _>(1) as u64 },
            row.get::<i64, _>(2) as u64,
        ))
    }

    async fn wait_deadline(&self, key: &str, proposed: i64) -> Result<i64> {
        Ok(sqlx::query_scalar(
            "INSERT INTO sa_waits (key, deadline) VALUES ($1, $2) ON CONFLICT(key) DO UPDATE SET key = EXCLUDED.key RETURNING deadline",
        )
        .bind(key)
        .bind(proposed)
        .fetch_one(&self.pool)
        .await?)
    }
    async fn unrelayed(&self, limit: u32) -> Result<Vec<EventRecord>> {
        let rows = sqlx::query("SELECT run_id, seq, type, data, created_at FROM sa_events WHERE relayed = 0 ORDER BY run_id, seq LIMIT $1")
            .bind(limit as i64)
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(event_from_row).collect()
    }

    async fn mark_relayed(&self, events: &[(RunId, u64)]) -> Result<()> {
        if events.is_empty() {
            return Ok(());
        }
        let mut tx = self.pool.begin().await?;
        for (run, seq) in events {
            sqlx::query("UPDATE sa_events SET relayed = 1 WHERE run_id = $1 AND seq = $2")
                .bind(run.to_string())
                .bind(*seq as i64)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    fn subscribe_all(&self) -> std::sync::Arc<tokio::sync::Notify> {
        self.notifier.subscribe_all()
    }

    fn wake_local(&self, run: RunId, cancel: bool) {
        self.notifier.notify(run);
        if cancel {
            self.cancels.notify(run);
        }
    }
}

row_mappers!(PgRow);
