//! [`Webhooks`](crate::store::Webhooks) for every [`SqlStore`]: subscriptions, the queue a
//! trigger fills from `sa_events`, and the deliveries with their attempts.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::{ColumnIndex, Decode, Encode, Executor, IntoArguments, Row, Type};

use super::*;

macro_rules! webhook_columns {
    () => {
        "id, owner, url, events, agents, description, secret, old_secret, old_secret_until, \
         paused_reason, created_at, updated_at, run_id"
    };
}

macro_rules! delivery_columns {
    () => {
        "id, webhook_id, event_type, run_id, status, attempts, last_status, last_error, last_body, \
         next_attempt_at, created_at"
    };
}

fn list_json(v: &[String]) -> String {
    serde_json::to_string(v).unwrap_or_else(|_| "[]".into())
}

#[async_trait]
impl<S> Webhooks for S
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
    async fn create_webhook(&self, hook: &Webhook) -> Result<()> {
        sqlx::query(
            "INSERT INTO sa_webhooks (id, owner, url, events, agents, description, secret, created_at, updated_at, run_id) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $8, $9)",
        )
        .bind(hook.id.as_str())
        .bind(hook.owner.as_str())
        .bind(hook.url.as_str())
        .bind(list_json(&hook.events))
        .bind(hook.agents.as_deref().map(list_json))
        .bind(hook.description.as_str())
        .bind(hook.secret.as_str())
        .bind(hook.created_at)
        .bind(hook.run_id.map(|r| r.to_string()))
        .execute(self.pool())
        .await?;
        Ok(())
    }

    async fn list_webhooks(&self, owner: &OwnerId) -> Result<Vec<Webhook>> {
        let rows = sqlx::query(concat!(
            "SELECT ",
            webhook_columns!(),
            " FROM sa_webhooks WHERE owner = $1 AND run_id IS NULL ORDER BY created_at, id"
        ))
        .bind(owner.as_str())
        .fetch_all(self.reads())
        .await?;
        rows.iter().map(webhook_row::<S>).collect()
    }

    async fn all_webhooks(&self) -> Result<Vec<Webhook>> {
        let rows = sqlx::query(concat!(
            "SELECT ",
            webhook_columns!(),
            " FROM sa_webhooks WHERE run_id IS NULL"
        ))
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(webhook_row::<S>).collect()
    }

    async fn webhooks_of_runs(&self, runs: &[RunId]) -> Result<Vec<Webhook>> {
        if runs.is_empty() {
            return Ok(vec![]);
        }
        let mut q = sqlx::QueryBuilder::<S::Db>::new(concat!(
            "SELECT ",
            webhook_columns!(),
            " FROM sa_webhooks WHERE run_id IN ("
        ));
        let mut list = q.separated(", ");
        for r in runs {
            list.push_bind(r.to_string());
        }
        list.push_unseparated(")");
        let rows = q.build().fetch_all(self.pool()).await?;
        rows.iter().map(webhook_row::<S>).collect()
    }

    async fn webhook_by_id(&self, id: &str) -> Result<Option<Webhook>> {
        let row = sqlx::query(concat!(
            "SELECT ",
            webhook_columns!(),
            " FROM sa_webhooks WHERE id = $1"
        ))
        .bind(id)
        .fetch_optional(self.pool())
        .await?;
        row.as_ref().map(webhook_row::<S>).transpose()
    }

    async fn get_webhook(&self, owner: &OwnerId, id: &str) -> Result<Option<Webhook>> {
        let row = sqlx::query(concat!(
            "SELECT ",
            webhook_columns!(),
            " FROM sa_webhooks WHERE owner = $1 AND id = $2"
        ))
        .bind(owner.as_str())
        .bind(id)
        .fetch_optional(self.pool())
        .await?;
        row.as_ref().map(webhook_row::<S>).transpose()
    }

    async fn update_webhook(
        &self,
        owner: &OwnerId,
        id: &str,
        patch: WebhookPatch,
    ) -> Result<Option<Webhook>> {
        let Some(mut hook) = self.get_webhook(owner, id).await? else {
            return Ok(None);
        };
        if let Some(url) = patch.url {
            hook.url = url;
        }
        if let Some(events) = patch.events {
            hook.events = events;
        }
        if let Some(agents) = patch.agents {
            hook.agents = agents;
        }
        if let Some(d) = patch.description {
            hook.description = d;
        }
        // Resuming forgets the failures that paused it.
        let (reason, reset) = match patch.paused {
            Some(true) => (
                Some(
                    hook.paused_reason
                        .clone()
                        .unwrap_or_else(|| "paused by its owner".into()),
                ),
                false,
            ),
            Some(false) => (None, true),
            None => (hook.paused_reason.clone(), false),
        };
        hook.paused_reason = reason;
        hook.updated_at = Utc::now();
        sqlx::query(
            "UPDATE sa_webhooks SET url = $1, events = $2, agents = $3, description = $4, paused_reason = $5, \
             dead_in_row = CASE WHEN $6 THEN 0 ELSE dead_in_row END, updated_at = $7 WHERE owner = $8 AND id = $9",
        )
        .bind(hook.url.as_str())
        .bind(list_json(&hook.events))
        .bind(hook.agents.as_deref().map(list_json))
        .bind(hook.description.as_str())
        .bind(hook.paused_reason.as_deref())
        .bind(reset)
        .bind(hook.updated_at)
        .bind(owner.as_str())
        .bind(id)
        .execute(self.pool())
        .await?;
        Ok(Some(hook))
    }

    async fn delete_webhook(&self, owner: &OwnerId, id: &str) -> Result<bool> {
        let mut tx = self.pool().begin().await?;
        let gone = sqlx::query("DELETE FROM sa_webhooks WHERE owner = $1 AND id = $2")
            .bind(owner.as_str())
            .bind(id)
            .execute(&mut *tx)
            .await?
            .rows_affected()
            > 0;
        if gone {
            sqlx::query("DELETE FROM sa_webhook_deliveries WHERE webhook_id = $1")
                .bind(id)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(gone)
    }

    async fn rotate_webhook_secret(
        &self,
        owner: &OwnerId,
        id: &str,
        secret: &str,
        old_until: i64,
    ) -> Result<Option<Webhook>> {
        let changed = sqlx::query(
            "UPDATE sa_webhooks SET old_secret = secret, old_secret_until = $1, secret = $2, updated_at = $3 \
             WHERE owner = $4 AND id = $5",
        )
        .bind(old_until)
        .bind(secret)
        .bind(Utc::now())
        .bind(owner.as_str())
        .bind(id)
        .execute(self.pool())
        .await?
        .rows_affected();
        if changed == 0 {
            return Ok(None);
        }
        self.get_webhook(owner, id).await
    }

    async fn list_deliveries(
        &self,
        webhook: &str,
        before: Option<&str>,
        limit: u32,
    ) -> Result<Vec<Delivery>> {
        let rows = match before {
            None => {
                sqlx::query(concat!("SELECT ", delivery_columns!(), " FROM sa_webhook_deliveries WHERE webhook_id = $1 \
                     ORDER BY created_at DESC, id DESC LIMIT $2"))
                .bind(webhook)
                .bind(i64::from(limit))
                .fetch_all(self.reads())
                .await?
            }
            Some(cursor) => {
                sqlx::query(concat!("SELECT ", delivery_columns!(), " FROM sa_webhook_deliveries d WHERE webhook_id = $1 \
                     AND (created_at, id) < (SELECT created_at, id FROM sa_webhook_deliveries WHERE id = $2) \
                     ORDER BY created_at DESC, id DESC LIMIT $3"))
                .bind(webhook)
                .bind(cursor)
                .bind(i64::from(limit))
                .fetch_all(self.reads())
                .await?
            }
        };
        rows.iter().map(delivery_row::<S>).collect()
    }

    async fn redeliver(&self, webhook: &str, delivery: &str) -> Result<bool> {
        let now = now_ms();
        Ok(sqlx::query(
            "UPDATE sa_webhook_deliveries SET status = 'pending', next_attempt_at = $1, window_start = $1, \
             locked_until = 0, updated_at = $2 WHERE webhook_id = $3 AND id = $4",
        )
        .bind(now)
        .bind(Utc::now())
        .bind(webhook)
        .bind(delivery)
        .execute(self.pool())
        .await?
        .rows_affected()
            > 0)
    }

    async fn queued_webhook_events(&self, limit: u32) -> Result<Vec<QueuedEvent>> {
        let rows = sqlx::query(
            "SELECT q.run_id, q.seq, e.type, e.data, r.owner, r.agent FROM sa_webhook_queue q \
             JOIN sa_events e ON e.run_id = q.run_id AND e.seq = q.seq \
             JOIN sa_runs r ON r.id = q.run_id ORDER BY e.created_at, q.run_id, q.seq LIMIT $1",
        )
        .bind(i64::from(limit))
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|r| {
                let run: String = r.get(0);
                let data: String = r.get(3);
                Ok(QueuedEvent {
                    run_id: run
                        .parse()
                        .map_err(|_| StoreError::Corrupt(format!("run id `{run}`")))?,
                    seq: r.get::<i64, _>(1) as u64,
                    kind: r.get(2),
                    data: serde_json::from_str(&data).unwrap_or(serde_json::Value::Null),
                    owner: OwnerId::from(r.get::<String, _>(4)),
                    agent: r.get(5),
                })
            })
            .collect()
    }

    async fn create_deliveries(
        &self,
        deliveries: Vec<NewDelivery>,
        done: Vec<(RunId, u64)>,
    ) -> Result<()> {
        let now = Utc::now();
        let ms = now_ms();
        let mut tx = self.pool().begin().await?;
        for chunk in deliveries.chunks(100) {
            let mut q = sqlx::QueryBuilder::<S::Db>::new(
                "INSERT INTO sa_webhook_deliveries (id, webhook_id, event_type, run_id, body, status, \
                 next_attempt_at, window_start, created_at, updated_at) ",
            );
            q.push_values(chunk, |mut b, d| {
                b.push_bind(d.id.clone())
                    .push_bind(d.webhook_id.clone())
                    .push_bind(d.event_type.clone())
                    .push_bind(d.run_id.to_string())
                    .push_bind(d.body.clone())
                    .push_bind("pending")
                    .push_bind(ms)
                    .push_bind(ms)
                    .push_bind(now)
                    .push_bind(now);
            });
            q.push(" ON CONFLICT (id) DO NOTHING");
            q.build().execute(&mut *tx).await?;
        }
        for (run, seq) in done {
            sqlx::query("DELETE FROM sa_webhook_queue WHERE run_id = $1 AND seq = $2")
                .bind(run.to_string())
                .bind(seq as i64)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn due_webhooks(&self, now: i64) -> Result<Vec<(String, u32)>> {
        let rows = sqlx::query(
            "SELECT d.webhook_id, COUNT(*) FROM sa_webhook_deliveries d JOIN sa_webhooks w ON w.id = d.webhook_id \
             WHERE d.status IN ('pending', 'failed') AND d.next_attempt_at <= $1 AND d.locked_until <= $1 \
             AND w.paused_reason IS NULL GROUP BY d.webhook_id",
        )
        .bind(now)
        .fetch_all(self.pool())
        .await?;
        Ok(rows
            .iter()
            .map(|r| {
                (
                    r.get(0),
                    r.get::<i64, _>(1).clamp(0, u32::MAX as i64) as u32,
                )
            })
            .collect())
    }

    async fn claim_deliveries(
        &self,
        webhook: &str,
        now: i64,
        lock_until: i64,
        limit: u32,
    ) -> Result<Vec<DueDelivery>> {
        // The outer condition is checked again on the row it updates: of two processes
        // claiming at once, one gets each delivery.
        let rows = sqlx::query(
            "UPDATE sa_webhook_deliveries SET locked_until = $1, attempts = attempts + 1 \
             WHERE id IN (SELECT id FROM sa_webhook_deliveries WHERE webhook_id = $2 \
                 AND status IN ('pending', 'failed') AND next_attempt_at <= $3 AND locked_until <= $3 \
                 ORDER BY next_attempt_at LIMIT $4) \
             AND status IN ('pending', 'failed') AND locked_until <= $3 \
             RETURNING id, webhook_id, body, attempts, window_start",
        )
        .bind(lock_until)
        .bind(webhook)
        .bind(now)
        .bind(i64::from(limit))
        .fetch_all(self.pool())
        .await?;
        Ok(rows
            .iter()
            .map(|r| DueDelivery {
                id: r.get(0),
                webhook_id: r.get(1),
                body: r.get(2),
                attempts: r.get::<i64, _>(3).clamp(0, u32::MAX as i64) as u32,
                window_start: r.get(4),
            })
            .collect())
    }

    async fn record_attempt(
        &self,
        delivery: &DueDelivery,
        outcome: &Attempted,
        pause_after: u32,
    ) -> Result<()> {
        let status = match (outcome.delivered, outcome.retry_at) {
            (true, _) => DeliveryStatus::Delivered,
            (false, Some(_)) => DeliveryStatus::Failed,
            (false, None) => DeliveryStatus::Dead,
        };
        let mut tx = self.pool().begin().await?;
        sqlx::query(
            "UPDATE sa_webhook_deliveries SET status = $1, next_attempt_at = $2, locked_until = 0, \
             last_status = $3, last_error = $4, last_body = $5, updated_at = $6 WHERE id = $7",
        )
        .bind(status.as_str())
        .bind(outcome.retry_at.unwrap_or(0))
        .bind(outcome.status.map(i64::from))
        .bind(outcome.error.as_deref())
        .bind(outcome.body.as_deref())
        .bind(Utc::now())
        .bind(delivery.id.as_str())
        .execute(&mut *tx)
        .await?;
        match status {
            DeliveryStatus::Delivered => {
                sqlx::query(
                    "UPDATE sa_webhooks SET dead_in_row = 0 WHERE id = $1 AND dead_in_row > 0",
                )
                .bind(delivery.webhook_id.as_str())
                .execute(&mut *tx)
                .await?;
            }
            DeliveryStatus::Dead => {
                let why = format!(
                    "{pause_after} deliveries in a row failed every attempt; the last answer: {}",
                    outcome
                        .status
                        .map(|s| format!("HTTP {s}"))
                        .or_else(|| outcome.error.clone())
                        .unwrap_or_default()
                );
                sqlx::query(
                    "UPDATE sa_webhooks SET dead_in_row = dead_in_row + 1, \
                     paused_reason = CASE WHEN paused_reason IS NULL AND dead_in_row + 1 >= $1 THEN $2 ELSE paused_reason END \
                     WHERE id = $3",
                )
                .bind(i64::from(pause_after.max(1)))
                .bind(why)
                .bind(delivery.webhook_id.as_str())
                .execute(&mut *tx)
                .await?;
            }
            _ => {}
        }
        tx.commit().await?;
        Ok(())
    }
}

fn webhook_row<S>(r: &DbRow<S>) -> Result<Webhook>
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
    let list = |v: String| -> Result<Vec<String>> {
        serde_json::from_str(&v).map_err(|e| StoreError::Corrupt(format!("webhook list: {e}")))
    };
    let old: Option<String> = r.get(7);
    let until: Option<i64> = r.get(8);
    Ok(Webhook {
        id: r.get(0),
        owner: OwnerId::from(r.get::<String, _>(1)),
        url: r.get(2),
        events: list(r.get(3))?,
        agents: r.get::<Option<String>, _>(4).map(list).transpose()?,
        description: r.get(5),
        secret: r.get(6),
        old_secret: old.zip(until),
        paused_reason: r.get(9),
        created_at: r.get(10),
        updated_at: r.get(11),
        run_id: r.get::<Option<String>, _>(12).and_then(|s| s.parse().ok()),
    })
}

fn delivery_row<S>(r: &DbRow<S>) -> Result<Delivery>
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
    let status: String = r.get(4);
    let status = DeliveryStatus::parse(&status)
        .ok_or_else(|| StoreError::Corrupt(format!("delivery status `{status}`")))?;
    let next: i64 = r.get(9);
    Ok(Delivery {
        id: r.get(0),
        webhook_id: r.get(1),
        event_type: r.get(2),
        run_id: r.get::<Option<String>, _>(3).and_then(|s| s.parse().ok()),
        status,
        attempts: r.get::<i64, _>(5).clamp(0, u32::MAX as i64) as u32,
        last_status: r
            .get::<Option<i64>, _>(6)
            .and_then(|s| u16::try_from(s).ok()),
        last_error: r.get(7),
        last_body: r.get(8),
        next_attempt_at: matches!(status, DeliveryStatus::Pending | DeliveryStatus::Failed)
            .then(|| DateTime::from_timestamp_millis(next))
            .flatten(),
        created_at: r.get(10),
    })
}
