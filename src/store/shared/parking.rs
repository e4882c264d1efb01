//! [`Parking`](crate::store::Parking) for every [`SqlStore`]: parking a run and finding whom to
//! wake.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::{ColumnIndex, Decode, Encode, Executor, IntoArguments, Row, Type};

use super::*;

#[async_trait]
impl<S> Parking for S
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
    async fn park(&self, lease: &Lease, park: Park) -> Result<Parked> {
        debug_assert!(
            park.wake_at.is_some() || !park.waits_on.is_empty() || !park.approvals.is_empty(),
            "a park needs something to wake it"
        );
        let now = Utc::now();
        let mut tx = self.pool().begin().await?;
        // Either order leaves no window: a child that ends now either commits first (and
        // is seen ended here) or after this park (and then finds it parked and wakes it).
        let mut due = S::PARK_READS_FIRST
            && (Self::any_ended(&mut tx, &park.waits_on).await?
                || Self::answered(&mut tx, &park.approvals).await?);
        let row = sqlx::query(sql!(
            "UPDATE sa_runs SET heartbeat_at = $1 WHERE id = $2 AND lease_epoch = $3 AND status IN ({}) RETURNING cancel_requested",
            Transition::Park
        ))
        .bind(now)
        .bind(lease.run_id.to_string())
        .bind(lease.epoch)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else {
            return Err(StoreError::LeaseLost(lease.run_id));
        };
        if row.get::<i64, _>(0) != 0 {
            tx.rollback().await?;
            return Ok(Parked::CancelPending);
        }
        if !S::PARK_READS_FIRST {
            due = Self::any_ended(&mut tx, &park.waits_on).await?
                || Self::answered(&mut tx, &park.approvals).await?;
        }
        sqlx::query("DELETE FROM sa_run_waits WHERE waiter = $1")
            .bind(lease.run_id.to_string())
            .execute(&mut *tx)
            .await?;
        for target in &park.waits_on {
            sqlx::query(
                "INSERT INTO sa_run_waits (waiter, target) VALUES ($1, $2) ON CONFLICT DO NOTHING",
            )
            .bind(lease.run_id.to_string())
            .bind(target.to_string())
            .execute(&mut *tx)
            .await?;
        }
        let wake_at = if due { Some(now_ms()) } else { park.wake_at };
        let n = park.events.len() as i64;
        let row = sqlx::query(
            "UPDATE sa_runs SET status = 'waiting', lease_expires_at = 0, lease_owner = NULL, wake_at = $1, \
             event_seq = event_seq + $2, updated_at = $3 WHERE id = $4 RETURNING event_seq",
        )
        .bind(wake_at)
        .bind(n)
        .bind(now)
        .bind(lease.run_id.to_string())
        .fetch_one(&mut *tx)
        .await?;
        let last: i64 = row.get(0);
        self.commit_events(tx, lease.run_id, last, &park.events)
            .await?;
        Ok(Parked::Parked { due })
    }

    async fn due_waiters(&self, run: RunId) -> Result<Vec<RunId>> {
        let rows = sqlx::query(sql!(
            "SELECT id FROM sa_runs WHERE status IN ({}) AND wake_at <= $1 \
             AND id IN (SELECT waiter FROM sa_run_waits WHERE target = $2)",
            Transition::Wake
        ))
        .bind(now_ms())
        .bind(run.to_string())
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|r| {
                r.get::<String, _>(0)
                    .parse()
                    .map_err(|e| corrupt("run id", e))
            })
            .collect()
    }

    async fn wait_deadline(&self, key: &str, proposed: i64) -> Result<i64> {
        Ok(sqlx::query_scalar(
            "INSERT INTO sa_waits (key, deadline) VALUES ($1, $2) ON CONFLICT(key) DO UPDATE SET key = EXCLUDED.key RETURNING deadline",
        )
        .bind(key)
        .bind(proposed)
        .fetch_one(self.pool())
        .await?)
    }
}
