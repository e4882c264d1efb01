//! The SQLite store: the embedded default. WAL mode, `synchronous=NORMAL` (a committed step
//! survives a killed process), a busy timeout so writers queue instead of failing, and the
//! schema in `migrations/sqlite`.
//!
//! SQLite serializes writers, so a fenced `UPDATE … WHERE lease_epoch = ?` at the start of each
//! transaction is both the fencing check and the lock that keeps event `seq` gap-free.

use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteRow, SqliteSynchronous};
use sqlx::{Row, SqlitePool, Transaction};

use super::*;

/// The SQLite implementation of [`Store`].
#[derive(Clone, Debug)]
pub struct SqliteStore {
    pool: SqlitePool,
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

impl SqliteStore {
    /// Opens (creating the file if needed) and migrates both our schema and apalis's.
    pub async fn connect(url: &str) -> Result<SqliteStore> {
        let opts = SqliteConnectOptions::from_str(url)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(Duration::from_secs(30))
            .foreign_keys(true);
        let pool = SqlitePoolOptions::new()
            .max_connections(8)
            .min_connections(1)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(opts)
            .await?;
        let store = SqliteStore { pool, notifier: Default::default(), cancels: Default::default() };
        store.migrate().await?;
        Ok(store)
    }

    /// Applies migrations. apalis's and ours share `_sqlx_migrations`, so each migrator is told
    /// to ignore the other's entries (apalis trap 3 in shared/notes).
    pub async fn migrate(&self) -> Result<()> {
        let mut ours = sqlx::migrate!("./migrations/sqlite");
        ours.set_ignore_missing(true);
        ours.run(&self.pool).await?;
        let mut apalis = apalis_sqlite::SqliteStorage::<()>::migrations();
        apalis.set_ignore_missing(true);
        apalis.run(&self.pool).await?;
        // apalis's `Jobs(lock_by)` index makes acks slow as finished jobs pile up (trap 2).
        sqlx::query("DROP INDEX IF EXISTS LIdx").execute(&self.pool).await?;
        Ok(())
    }

    /// The pool, shared with the apalis storage so one file has one set of connections.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// The fenced opening of every checkpoint transaction: proves the epoch, extends the lease
    /// and reserves `n_events` sequence numbers. Returns the first reserved seq.
    async fn fence(tx: &mut Transaction<'_, sqlx::Sqlite>, lease: &Lease, cp: &Checkpoint) -> Result<u64> {
        let now = Utc::now();
        let n = cp.events.len() as i64;
        let (status, result, forced, ekind, emsg, finished) = match &cp.finish {
            None => (None, None, None, None, None, None),
            Some(Finish::Succeeded { result, forced }) => {
                (Some(RunStatus::Succeeded), Some(result.clone()), Some(*forced as i64), None, None, Some(now))
            }
            Some(Finish::Failed(e)) => {
                (Some(RunStatus::Failed), None, None, Some(e.kind.as_str()), Some(e.message.clone()), Some(now))
            }
            Some(Finish::Cancelled) => (Some(RunStatus::Cancelled), None, None, None, None, Some(now)),
        };
        let (status, park, wake_at) = match (status, cp.park) {
            (None, Some(wake)) => (Some(RunStatus::Waiting), 1i64, wake),
            (s, _) => (s, 0i64, None),
        };
        if let Some(to) = status {
            debug_assert!(RunStatus::Running.can_become(to));
        }
        let row = sqlx::query(
            "UPDATE sa_runs SET event_seq = event_seq + ?1, step = COALESCE(?2, step), \
             prompt_tokens = prompt_tokens + ?3, completion_tokens = completion_tokens + ?4, \
             lease_expires_at = CASE WHEN ?5 IS NULL THEN ?6 ELSE 0 END, heartbeat_at = ?7, updated_at = ?7, \
             status = COALESCE(?5, status), result = COALESCE(?8, result), forced = COALESCE(?9, forced), \
             error_kind = COALESCE(?10, error_kind), error_message = COALESCE(?11, error_message), \
             finished_at = COALESCE(?12, finished_at), \
             cancel_requested = CASE WHEN ?5 IS NULL OR ?15 = 1 THEN cancel_requested ELSE 0 END, \
             wake_at = CASE WHEN ?15 = 1 THEN ?16 ELSE wake_at END \
             WHERE id = ?13 AND lease_epoch = ?14 AND status = 'running' RETURNING event_seq",
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
        .fetch_optional(&mut **tx)
        .await?;
        let Some(row) = row else { return Err(StoreError::LeaseLost(lease.run_id)) };
        let last: i64 = row.get(0);
        Ok((last - n + 1) as u64)
    }

    /// Inserts a commit's events in one statement (one round trip, whatever their number).
    async fn insert_events(
        tx: &mut Transaction<'_, sqlx::Sqlite>,
        run: RunId,
        first_seq: u64,
        events: &[NewEvent],
    ) -> Result<()> {
        if events.is_empty() {
            return Ok(());
        }
        let now = Utc::now();
        let run = run.to_string();
        let mut q = sqlx::QueryBuilder::<sqlx::Sqlite>::new("INSERT INTO sa_events (run_id, seq, type, data, created_at) ");
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
impl Store for SqliteStore {
    async fn create_run(&self, new: NewRun) -> Result<Created> {
        let now = Utc::now();
        let mut tx = self.pool.begin().await?;
        // The upsert takes SQLite's write lock first, so the checks below and the insert see
        // one state: no other start can slip in between.
        let inserted = sqlx::query(
            "INSERT INTO sa_threads (id, owner, created_at, updated_at) VALUES (?1, ?2, ?3, ?3) \
             ON CONFLICT(id) DO UPDATE SET updated_at = excluded.updated_at RETURNING owner",
        )
        .bind(new.thread_id.as_str())
        .bind(&new.owner)
        .bind(now)
        .fetch_one(&mut *tx)
        .await?;
        let owner: String = inserted.get(0);
        if owner != new.owner {
            return Err(StoreError::ThreadOwnedElsewhere(new.thread_id));
        }
        if let Some(key) = &new.idempotency_key {
            let existing: Option<String> =
                sqlx::query_scalar("SELECT id FROM sa_runs WHERE owner = ?1 AND idempotency_key = ?2")
                    .bind(&new.owner)
                    .bind(key)
                    .fetch_optional(&mut *tx)
                    .await?;
            if let Some(id) = existing {
                tx.rollback().await?;
                let id: RunId = id.parse().map_err(|e| corrupt("run id", e))?;
                let run = self.get_run(id).await?.ok_or_else(|| corrupt("run vanished", id))?;
                return Ok(Created { run, existing: true });
            }
        }
        if new.if_busy == IfBusy::Reject {
            let active: Option<String> = sqlx::query_scalar(
                "SELECT id FROM sa_runs WHERE thread_id = ?1 AND status IN ('queued','running','waiting') ORDER BY id LIMIT 1",
            )
            .bind(new.thread_id.as_str())
            .fetch_optional(&mut *tx)
            .await?;
            if let Some(a) = active {
                let active_run = a.parse().map_err(|e| corrupt("run id", e))?;
                return Err(StoreError::Busy { thread_id: new.thread_id, active_run });
            }
        }
        let inserted = sqlx::query(concat!(
            "INSERT INTO sa_runs (id, thread_id, owner, agent, status, input, metadata, limits, parent_run_id, \
             idempotency_key, job_id, enqueued_at, created_at, updated_at, event_seq, root_run_id, depth, detached) \
             VALUES (?1, ?2, ?3, ?4, 'queued', ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?12, 1, ?13, ?14, ?15) RETURNING ",
            run_columns!()
        ))
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
        .bind(now)
        .bind(new.tree.root_run_id.map(|r| r.to_string()))
        .bind(new.tree.depth as i64)
        .bind(new.tree.detached as i64)
        .fetch_one(&mut *tx)
        .await?;
        let run = run_from_row(&inserted)?;
        Self::insert_events(
            &mut tx,
            new.id,
            1,
            &[NewEvent::new(
                EventKind::RunQueued,
                serde_json::json!({"agent": new.agent, "thread_id": new.thread_id, "parent_run_id": new.parent_run_id}),
            )],
        )
        .await?;
        tx.commit().await?;
        Ok(Created { run, existing: false })
    }

    async fn get_run(&self, id: RunId) -> Result<Option<RunRecord>> {
        let row = sqlx::query(concat!("SELECT ", run_columns!(), " FROM sa_runs WHERE id = ?1"))
            .bind(id.to_string())
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(run_from_row).transpose()
    }

    async fn claim_run(&self, id: RunId, owner: &str, ttl: Duration, max_attempts: u32) -> Result<Claim> {
        let now = Utc::now();
        let nms = now_ms();
        let mut tx = self.pool.begin().await?;
        let row = sqlx::query(concat!(
            "UPDATE sa_runs SET claimed_from = status, status = 'running', lease_owner = ?1, lease_epoch = lease_epoch + 1, \
             lease_expires_at = ?2, attempts = attempts + 1, started_at = COALESCE(started_at, ?3), \
             heartbeat_at = ?3, updated_at = ?3, event_seq = event_seq + 1 \
             WHERE id = ?4 AND ( \
               (status = 'queued' \
                 AND NOT EXISTS (SELECT 1 FROM sa_runs a WHERE a.thread_id = sa_runs.thread_id AND a.status IN ('running','waiting')) \
                 AND NOT EXISTS (SELECT 1 FROM sa_runs q WHERE q.thread_id = sa_runs.thread_id AND q.status = 'queued' AND q.id < sa_runs.id)) \
               OR status = 'waiting' \
               OR (status = 'running' AND lease_expires_at < ?5 AND attempts < ?6)) \
             RETURNING ",
            run_columns!(),
        ))
        .bind(owner)
        .bind(nms + ttl.as_millis() as i64)
        .bind(now)
        .bind(id.to_string())
        .bind(nms)
        .bind(max_attempts as i64)
        .fetch_optional(&mut *tx)
        .await?;
        if let Some(row) = row {
            // The claimed row comes back whole: no second read.
            let run = run_from_row(&row)?;
            let epoch = run.lease_epoch;
            let seq = run.event_seq as i64;
            let attempts = run.attempts as i64;
            let from = run.claimed_from.map(RunStatus::as_str).unwrap_or("queued");
            let kind = if from == "waiting" { EventKind::RunResumed } else { EventKind::RunStarted };
            Self::insert_events(
                &mut tx,
                id,
                seq as u64,
                &[NewEvent::new(kind, serde_json::json!({"attempt": attempts, "worker": owner, "from": from}))],
            )
            .await?;
            tx.commit().await?;
            self.notifier.notify(id);
            return Ok(Claim::Acquired(Lease { run_id: id, epoch, owner: owner.to_owned(), ttl }, Box::new(run)));
        }
        // Not claimable; if that is because its workers keep dying, fail it for good.
        let gave_up = sqlx::query(
            "UPDATE sa_runs SET status = 'failed', error_kind = 'lost', \
             error_message = 'the run was abandoned by ' || attempts || ' workers in a row (crashes or kills); giving up', \
             finished_at = ?1, updated_at = ?1, lease_expires_at = 0, event_seq = event_seq + 1 \
             WHERE id = ?2 AND status = 'running' AND lease_expires_at < ?3 AND attempts >= ?4 RETURNING event_seq, attempts",
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
            "UPDATE sa_runs SET lease_expires_at = ?1, heartbeat_at = ?2 \
             WHERE id = ?3 AND lease_epoch = ?4 AND status = 'running' RETURNING cancel_requested",
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
        sqlx::query("UPDATE sa_runs SET lease_expires_at = 0 WHERE id = ?1 AND lease_epoch = ?2 AND status = 'running'")
            .bind(lease.run_id.to_string())
            .bind(lease.epoch)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn checkpoint(&self, lease: &Lease, cp: Checkpoint) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        let first_seq = Self::fence(&mut tx, lease, &cp).await?;
        let now = Utc::now();
        for m in &cp.messages {
            sqlx::query(
                "INSERT INTO sa_messages (thread_id, run_id, step, role, key, body, created_at) \
                 SELECT thread_id, id, ?1, ?2, ?3, ?4, ?5 FROM sa_runs WHERE id = ?6 \
                 ON CONFLICT(key) DO NOTHING",
            )
            .bind(m.step as i64)
            .bind(m.message.role())
            .bind(&m.key)
            .bind(serde_json::to_string(&m.message).expect("message serializes"))
            .bind(now)
            .bind(lease.run_id.to_string())
            .execute(&mut *tx)
            .await?;
        }
        Self::insert_events(&mut tx, lease.run_id, first_seq, &cp.events).await?;
        tx.commit().await?;
        self.notifier.notify(lease.run_id);
        Ok(())
    }

    async fn thread_messages(&self, thread: &ThreadId) -> Result<Vec<StoredMessage>> {
        let rows = sqlx::query("SELECT id, run_id, step, key, body FROM sa_messages WHERE thread_id = ?1 ORDER BY id")
            .bind(thread.as_str())
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(message_from_row).collect()
    }

    async fn events_after(&self, run: RunId, after: u64, limit: u32) -> Result<Vec<EventRecord>> {
        let rows = sqlx::query(
            "SELECT run_id, seq, type, data, created_at FROM sa_events WHERE run_id = ?1 AND seq > ?2 ORDER BY seq LIMIT ?3",
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
                "UPDATE sa_runs SET status = 'cancelled', finished_at = ?1, updated_at = ?1, event_seq = event_seq + 1, \
                 cancel_requested = 0, lease_expires_at = 0 WHERE id = ?2 AND status = ?3 RETURNING event_seq",
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
            "UPDATE sa_runs SET cancel_requested = 1, updated_at = ?1 WHERE id = ?2 AND status = 'running'",
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
            "SELECT id, status FROM sa_runs r WHERE r.enqueued_at < ?1 AND ( \
               (r.status = 'running' AND r.lease_expires_at < ?2) OR \
               (r.status = 'waiting' AND r.wake_at IS NOT NULL AND r.wake_at < ?2) OR \
               (r.status = 'waiting' AND NOT EXISTS (SELECT 1 FROM sa_runs c WHERE c.parent_run_id = r.id \
                  AND c.status IN ('queued','running','waiting'))) OR \
               (r.status = 'queued' \
                 AND NOT EXISTS (SELECT 1 FROM Jobs j WHERE j.id = r.job_id AND j.status IN ('Pending','Queued','Running')) \
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
        sqlx::query("UPDATE sa_runs SET job_id = ?1, enqueued_at = ?2 WHERE id = ?3")
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
        sqlx::query("DELETE FROM Jobs WHERE job_type = ?1").bind(crate::queue::QUEUE_NAME).execute(&mut *tx).await?;
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
            " FROM sa_runs WHERE owner = ?1 \
             AND (?2 IS NULL OR status IN (SELECT value FROM json_each(?2))) \
             AND (?3 IS NULL OR agent = ?3) AND (?4 IS NULL OR thread_id = ?4) \
             AND (?5 IS NULL OR parent_run_id = ?5) AND (?6 IS NULL OR id < ?6) \
             ORDER BY id DESC LIMIT ?7"
        ))
        .bind(owner)
        .bind((!statuses.is_empty()).then(|| serde_json::to_string(&statuses).unwrap()))
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
        let row = sqlx::query("SELECT id, owner, created_at, updated_at FROM sa_threads WHERE id = ?1")
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
            "SELECT id, run_id, step, key, body FROM sa_messages WHERE thread_id = ?1 AND id > ?2 ORDER BY id LIMIT ?3",
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
            sqlx::query_scalar("SELECT id FROM sa_runs WHERE thread_id = ?1 AND status = 'queued' ORDER BY id LIMIT 1")
                .bind(thread.as_str())
                .fetch_optional(&self.pool)
                .await?;
        id.map(|i| i.parse().map_err(|e| corrupt("run id", e))).transpose()
    }

    async fn queue_position(&self, run: RunId) -> Result<i64> {
        Ok(sqlx::query_scalar("SELECT count(*) FROM sa_runs WHERE status = 'queued' AND id < ?1")
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
        let row = sqlx::query("UPDATE sa_runs SET event_seq = event_seq + ?1 WHERE id = ?2 RETURNING event_seq")
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
        let rows = sqlx::query(concat!("SELECT ", run_columns!(), " FROM sa_runs WHERE parent_run_id = ?1 ORDER BY id"))
            .bind(run.to_string())
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(run_from_row).collect()
    }

    async fn tree_usage(&self, run: RunId) -> Result<(Usage, u64)> {
        let row = sqlx::query(
            "WITH RECURSIVE tree(id) AS (SELECT ?1 UNION ALL SELECT r.id FROM sa_runs r JOIN tree t ON r.parent_run_id = t.id) \
             SELECT COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(completion_tokens), 0), COALESCE(SUM(step), 0) \
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
            "INSERT INTO sa_waits (key, deadline) VALUES (?1, ?2) ON CONFLICT(key) DO UPDATE SET key = key RETURNING deadline",
        )
        .bind(key)
        .bind(proposed)
        .fetch_one(&self.pool)
        .await?)
    }
    async fn unrelayed(&self, limit: u32) -> Result<Vec<EventRecord>> {
        let rows = sqlx::query("SELECT run_id, seq, type, data, created_at FROM sa_events WHERE relayed = 0 ORDER BY run_id, seq LIMIT ?1")
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
            sqlx::query("UPDATE sa_events SET relayed = 1 WHERE run_id = ?1 AND seq = ?2")
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

row_mappers!(SqliteRow);
