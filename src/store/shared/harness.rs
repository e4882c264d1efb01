//! [`Harness`](crate::store::Harness) for every [`SqlStore`]: what only tests and benchmarks do.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::{ColumnIndex, Decode, Encode, Executor, IntoArguments, Type};

use super::*;

#[async_trait]
impl<S> Harness for S
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
    async fn wake(&self, run: RunId) -> Result<bool> {
        let done = sqlx::query(sql!(
            "UPDATE sa_runs SET wake_at = $1 WHERE id = $2 AND status IN ({})",
            Transition::Wake
        ))
        .bind(now_ms())
        .bind(run.to_string())
        .execute(self.pool())
        .await?
        .rows_affected();
        Ok(done > 0)
    }

    async fn seed_history(&self, owner: &OwnerId, count: u32, now: DateTime<Utc>) -> Result<()> {
        const BATCH: u32 = 500;
        let mut done = 0;
        while done < count {
            let n = BATCH.min(count - done);
            let rows = super::seed::seed_rows(done, n, now);
            let mut tx = self.pool().begin().await?;
            let mut q = sqlx::QueryBuilder::<S::Db>::new(
                "INSERT INTO sa_threads (id, owner, created_at, updated_at) ",
            );
            q.push_values(&rows, |mut b, r| {
                b.push_bind(r.1.clone())
                    .push_bind(owner.to_owned())
                    .push_bind(r.2)
                    .push_bind(r.2);
            });
            q.build().execute(&mut *tx).await?;
            let mut q = sqlx::QueryBuilder::<S::Db>::new(
                "INSERT INTO sa_runs (id, thread_id, owner, agent, status, input, metadata, limits, step, result, error_kind, error_message, \
                 prompt_tokens, completion_tokens, cost_nanos, attempts, event_seq, job_id, enqueued_at, created_at, started_at, finished_at, updated_at) ",
            );
            q.push_values(&rows, |mut b, r| {
                let ok = r.4 == "succeeded";
                b.push_bind(r.0.clone())
                    .push_bind(r.1.clone())
                    .push_bind(owner.to_owned())
                    .push_bind("general-purpose")
                    .push_bind(r.4)
                    .push_bind(format!("Seeded task {} for the dashboard benchmark", r.0))
                    .push_bind("{}")
                    .push_bind(r#"{"max_steps":25,"timeout_secs":600}"#)
                    .push_bind(if r.3.is_some() { 3i64 } else { 0 })
                    .push_bind(ok.then(|| "seeded result".to_owned()))
                    .push_bind(r.5)
                    .push_bind(r.5.map(|k| format!("seeded {k} failure")))
                    .push_bind(if r.3.is_some() { 5400i64 } else { 0 })
                    .push_bind(if r.3.is_some() { 300i64 } else { 0 })
                    .push_bind(if r.3.is_some() { 13_200_000i64 } else { 0 })
                    .push_bind(if r.3.is_some() { 1i64 } else { 0 })
                    .push_bind(if r.6 && r.3.is_some() { 5i64 } else { 1 })
                    .push_bind(format!("seed-{}", r.0))
                    .push_bind(r.2.timestamp_millis())
                    .push_bind(r.2)
                    .push_bind(r.3.map(|_| r.2))
                    .push_bind(r.3)
                    .push_bind(r.3.unwrap_or(r.2));
            });
            q.build().execute(&mut *tx).await?;
            // The last hour's runs get the events the overview's charts read.
            let mut events = vec![];
            for r in rows.iter().filter(|r| r.6) {
                let Some(fin) = r.3 else {
                    events.push((r.0.clone(), 1i64, "run.queued", "{}".to_owned(), r.2));
                    continue;
                };
                events.push((r.0.clone(), 1, "run.queued", "{}".to_owned(), r.2));
                let span = (fin - r.2) / 4;
                for k in 1..=3i64 {
                    let data = serde_json::json!({"step": k, "model": "gpt-4.1-mini", "ms": 400 + 50 * k, "usage": {"prompt_tokens": 1800, "completion_tokens": 100}, "cost_usd": 0.00088, "tool_calls": []});
                    events.push((
                        r.0.clone(),
                        k + 1,
                        "model.completed",
                        data.to_string(),
                        r.2 + span * k as i32,
                    ));
                }
                let end = match r.4 {
                    "succeeded" => "run.succeeded",
                    "failed" => "run.failed",
                    _ => "run.cancelled",
                };
                events.push((r.0.clone(), 5, end, "{}".to_owned(), fin));
            }
            if !events.is_empty() {
                let mut q = sqlx::QueryBuilder::<S::Db>::new(
                    "INSERT INTO sa_events (run_id, seq, type, data, created_at, relayed) ",
                );
                q.push_values(&events, |mut b, e| {
                    b.push_bind(e.0.clone())
                        .push_bind(e.1)
                        .push_bind(e.2)
                        .push_bind(e.3.clone())
                        .push_bind(e.4)
                        .push_bind(1i64);
                });
                q.build().execute(&mut *tx).await?;
            }
            tx.commit().await?;
            done += n;
        }
        Ok(())
    }

    async fn wipe(&self) -> Result<()> {
        let mut tx = self.pool().begin().await?;
        for t in [
            "sa_events",
            "sa_compactions",
            "sa_tool_decisions",
            "sa_approvals",
            "sa_grants",
            "sa_messages",
            "sa_run_waits",
            "sa_runs",
            "sa_threads",
            "sa_waits",
        ] {
            sqlx::query(sqlx::AssertSqlSafe(format!("DELETE FROM {t}")))
                .execute(&mut *tx)
                .await?;
        }
        sqlx::query(S::statements().wipe_jobs.as_str())
            .bind(super::QUEUE_NAME)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn checkpoint_rows(&self) -> Result<i64> {
        Ok(sqlx::query_scalar(
            "SELECT (SELECT count(*) FROM sa_messages) + (SELECT count(*) FROM sa_events)",
        )
        .fetch_one(self.reads())
        .await?)
    }
}
