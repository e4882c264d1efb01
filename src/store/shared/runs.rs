//! [`Runs`](crate::store::Runs) for every [`SqlStore`]: starting runs (the backend's own) and
//! reading them.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::{ColumnIndex, Decode, Encode, Executor, IntoArguments, Row, Type};

use super::*;

#[async_trait]
impl<S> Runs for S
where
    S: SqlStore,
    for<'c> &'c mut Conn<S>: Executor<'c, Database = S::Db>,
    Args<S>: IntoArguments<S::Db>,
    usize: ColumnIndex<DbRow<S>>,
    for<'a> &'a str: ColumnIndex<DbRow<S>> + Encode<'a, S::Db> + Decode<'a, S::Db>,
    for<'a> Option<&'a str>: Encode<'a, S::Db>,
    str: Type<S::Db>,
    String: Col<S::Db>,
    i64: Col<S::Db>,
    i32: Col<S::Db>,
    bool: Col<S::Db>,
    DateTime<Utc>: Col<S::Db>,
    Option<String>: Col<S::Db>,
    Option<i64>: Col<S::Db>,
    Option<DateTime<Utc>>: Col<S::Db>,
{
    async fn create_run(&self, new: NewRun) -> Result<Created> {
        self.start_run(new).await
    }

    async fn get_run(&self, id: RunId) -> Result<Option<RunRecord>> {
        let row = sqlx::query(concat!(
            "SELECT ",
            run_columns!(),
            " FROM sa_runs WHERE id = $1"
        ))
        .bind(id.to_string())
        .fetch_optional(self.reads())
        .await?;
        row.as_ref().map(S::run_from_row).transpose()
    }

    async fn events_after(&self, run: RunId, after: u64, limit: u32) -> Result<Vec<EventRecord>> {
        let rows = sqlx::query(
            "SELECT run_id, seq, type, data, created_at FROM sa_events WHERE run_id = $1 AND seq > $2 ORDER BY seq LIMIT $3",
        )
        .bind(run.to_string())
        .bind(after.min(i64::MAX as u64) as i64)
        .bind(limit as i64)
        .fetch_all(self.reads())
        .await?;
        rows.iter().map(S::event_from_row).collect()
    }

    async fn request_cancel(&self, run: RunId) -> Result<CancelOutcome> {
        let now = Utc::now();
        let mut tx = self.pool().begin().await?;
        // A queued or parked run holds no worker: it ends here and now (`cancel`).
        for state in crate::lifecycle::sources(Transition::Cancel) {
            let row = sqlx::query(
                "UPDATE sa_runs SET status = 'cancelled', finished_at = $1, updated_at = $1, event_seq = event_seq + 1, \
                 cancel_requested = 0, lease_expires_at = 0, wake_at = NULL WHERE id = $2 AND status = $3 \
                 RETURNING event_seq, thread_id, parent_run_id",
            )
            .bind(now)
            .bind(run.to_string())
            .bind(state)
            .fetch_optional(&mut *tx)
            .await?;
            if let Some(row) = row {
                let seq: i64 = row.get(0);
                let thread: String = row.get(1);
                let parent: Option<String> = row.get(2);
                Self::insert_events(
                    &mut tx,
                    run,
                    seq as u64,
                    &[Event::RunCancelled(event::RunCancelled {
                        while_: Some(state),
                        ..Default::default()
                    })
                    .into()],
                    self.relayed_at_insert(),
                )
                .await?;
                Self::terminal_effects(
                    &mut tx,
                    run,
                    &thread,
                    parent.as_deref(),
                    RunStatus::Cancelled,
                    None,
                    Reach::ALL,
                    self.relayed_at_insert(),
                )
                .await?;
                tx.commit().await?;
                self.notifier().notify(run);
                return Ok(CancelOutcome::Cancelled);
            }
        }
        // A running run is asked to stop (`request-cancel`); its worker finishes it.
        let flagged = sqlx::query(sql!(
            "UPDATE sa_runs SET cancel_requested = 1, updated_at = $1 WHERE id = $2 AND status IN ({})",
            Transition::RequestCancel
        ))
        .bind(now)
        .bind(run.to_string())
        .execute(&mut *tx)
        .await?
        .rows_affected();
        tx.commit().await?;
        if flagged > 0 {
            self.notifier().notify(run);
            self.cancels().notify(run);
            return Ok(CancelOutcome::Requested);
        }
        Ok(match self.get_run(run).await? {
            Some(r) => CancelOutcome::AlreadyFinished(r.status),
            None => CancelOutcome::NotFound,
        })
    }

    async fn request_interrupt(&self, run: RunId) -> Result<CancelOutcome> {
        // A cancel now already asked for stays one.
        let flagged = sqlx::query(
            "UPDATE sa_runs SET cancel_requested = CASE WHEN cancel_requested = 0 THEN $1 ELSE cancel_requested END, \
             updated_at = $2 WHERE id = $3 AND status = 'running'",
        )
        .bind(INTERRUPT)
        .bind(Utc::now())
        .bind(run.to_string())
        .execute(self.pool())
        .await?
        .rows_affected();
        if flagged > 0 {
            self.notifier().notify(run);
            self.cancels().notify(run);
            return Ok(CancelOutcome::Requested);
        }
        // Queued or parked, it is at a boundary now; ended or missing, the answer says so.
        self.request_cancel(run).await
    }

    async fn next_queued(&self, thread: &ThreadId) -> Result<Option<RunId>> {
        let mut conn = self.kept().await?;
        let id: Option<Option<String>> = sqlx::query_scalar(S::statements().next_queued.as_str())
            .bind(thread.as_str())
            .fetch_optional(&mut *conn)
            .await?;
        conn.keep();
        id.flatten()
            .map(|i| i.parse().map_err(|e| corrupt("run id", e)))
            .transpose()
    }

    fn subscribe(&self, run: RunId) -> std::sync::Arc<crate::notify::Signal> {
        self.notifier().subscribe(run)
    }

    fn latest_seq(&self, run: RunId) -> Option<u64> {
        self.notifier().latest_seq(run)
    }

    fn subscribe_cancel(&self, run: RunId) -> std::sync::Arc<crate::notify::Signal> {
        self.cancels().subscribe(run)
    }

    async fn children(&self, run: RunId) -> Result<Vec<RunRecord>> {
        let rows = sqlx::query(concat!(
            "SELECT ",
            run_columns!(),
            " FROM sa_runs WHERE parent_run_id = $1 ORDER BY id"
        ))
        .bind(run.to_string())
        .fetch_all(self.reads())
        .await?;
        rows.iter().map(S::run_from_row).collect()
    }

    async fn tree_totals(&self, run: RunId) -> Result<TreeTotals> {
        let row = sqlx::query(
            "WITH RECURSIVE tree(id) AS (SELECT CAST($1 AS TEXT) UNION ALL \
               SELECT r.id FROM sa_runs r JOIN tree t ON r.parent_run_id = t.id) \
             SELECT CAST(COALESCE(SUM(prompt_tokens), 0) AS BIGINT), CAST(COALESCE(SUM(completion_tokens), 0) AS BIGINT), \
               CAST(COALESCE(SUM(step), 0) AS BIGINT), CAST(COALESCE(SUM(cost_nanos), 0) AS BIGINT), \
               CAST(COALESCE(SUM(cache_read_tokens), 0) AS BIGINT), CAST(COALESCE(SUM(cache_write_tokens), 0) AS BIGINT) \
             FROM sa_runs WHERE id IN (SELECT id FROM tree)",
        )
        .bind(run.to_string())
        .fetch_one(self.reads())
        .await?;
        Ok(TreeTotals {
            usage: Usage {
                prompt_tokens: row.get::<i64, _>(0) as u64,
                completion_tokens: row.get::<i64, _>(1) as u64,
                cache_read_tokens: row.get::<i64, _>(4) as u64,
                cache_write_tokens: row.get::<i64, _>(5) as u64,
            },
            steps: row.get::<i64, _>(2) as u64,
            cost_nanos: row.get::<i64, _>(3).max(0) as u64,
        })
    }
}
