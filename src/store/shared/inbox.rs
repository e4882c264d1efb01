//! [`Inbox`](crate::store::Inbox) for every [`SqlStore`]: messages sent to a run while it
//! works, and their delivery at its step boundaries.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::{ColumnIndex, Decode, Encode, Executor, IntoArguments, Row, Type};

use super::*;
use crate::model::Message;

#[async_trait]
impl<S> Inbox for S
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
    async fn send_message(
        &self,
        run: RunId,
        owner: &OwnerId,
        id: &MessageId,
        content: &str,
    ) -> Result<Sent> {
        let now = Utc::now();
        let mut tx = self.pool().begin().await?;
        // The run row first: it serialises this with the run's own commits (a delivery reads
        // the inbox after locking the row; a final answer is refused while `inbox` > 0). Only a
        // run parked on children is made due: one parked on an approval or a rate limit could
        // not call the model before that ends anyway, and hears the message then.
        let row = sqlx::query(
            "UPDATE sa_runs SET inbox = inbox + 1, event_seq = event_seq + 1, updated_at = $1, \
             wake_at = CASE WHEN status = 'waiting' AND EXISTS (SELECT 1 FROM sa_run_waits w WHERE w.waiter = sa_runs.id) \
               THEN $2 ELSE wake_at END \
             WHERE id = $3 AND owner = $4 AND status IN ('queued', 'running', 'waiting') AND inbox < $5 \
             RETURNING event_seq, status, wake_at",
        )
        .bind(now)
        .bind(now_ms())
        .bind(run.to_string())
        .bind(owner)
        .bind(MAX_WAITING_MESSAGES)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else {
            tx.rollback().await?;
            let status: Option<(RunStatus, OwnerId)> =
                sqlx::query_as("SELECT status, owner FROM sa_runs WHERE id = $1")
                    .bind(run.to_string())
                    .fetch_optional(self.pool())
                    .await?;
            return Ok(match status {
                Some((st, o)) if o == *owner && st.is_terminal() => Sent::Finished(st),
                Some((_, o)) if o == *owner => Sent::Full,
                _ => Sent::NotFound,
            });
        };
        let seq: i64 = row.get(0);
        let status: RunStatus = row.try_get(1)?;
        let wake_at: Option<i64> = row.get(2);
        sqlx::query(
            "INSERT INTO sa_inbox (id, run_id, content, created_at) VALUES ($1, $2, $3, $4)",
        )
        .bind(id)
        .bind(run.to_string())
        .bind(content)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        let event = Event::MessageReceived(event::MessageReceived {
            message_id: id.clone(),
            chars: content.chars().count() as u64,
        });
        Self::insert_events(
            &mut tx,
            run,
            seq as u64,
            &[event.into()],
            self.relayed_at_insert(),
        )
        .await?;
        tx.commit().await?;
        self.notifier().notify(run);
        // A worker of this process holding the run renews its lease at once and hears it.
        self.cancels().notify(run);
        let woken = status == RunStatus::Waiting && wake_at.is_some_and(|w| w <= now_ms());
        Ok(Sent::Accepted { status, woken })
    }

    async fn deliver_messages(&self, lease: &Lease, step: u32) -> Result<Vec<NewMessage>> {
        let now = Utc::now();
        let mut tx = self.pool().begin().await?;
        // The fence locks the row before the inbox is read, so a message committing now
        // either is read here or waits for this commit and stays for the next boundary.
        let row = sqlx::query(sql!(
            "UPDATE sa_runs SET heartbeat_at = $1 WHERE id = $2 AND lease_epoch = $3 AND status IN ({}) \
             RETURNING thread_id",
            Transition::Heartbeat
        ))
        .bind(now)
        .bind(lease.run_id.to_string())
        .bind(lease.epoch)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else {
            return Err(StoreError::LeaseLost(lease.run_id));
        };
        let thread: String = row.get(0);
        let waiting = sqlx::query("SELECT id, content FROM sa_inbox WHERE run_id = $1 ORDER BY n")
            .bind(lease.run_id.to_string())
            .fetch_all(&mut *tx)
            .await?;
        if waiting.is_empty() {
            tx.commit().await?;
            return Ok(vec![]);
        }
        let n = waiting.len() as i64;
        let last: i64 = sqlx::query_scalar(
            "UPDATE sa_runs SET inbox = CASE WHEN inbox > $1 THEN inbox - $1 ELSE 0 END, \
             event_seq = event_seq + $1, updated_at = $2 WHERE id = $3 RETURNING event_seq",
        )
        .bind(n)
        .bind(now)
        .bind(lease.run_id.to_string())
        .fetch_one(&mut *tx)
        .await?;
        let mut delivered = Vec::with_capacity(waiting.len());
        let mut events: Vec<NewEvent> = Vec::with_capacity(waiting.len());
        for r in &waiting {
            let id = MessageId::from(r.get::<String, _>(0));
            let content: String = r.get(1);
            let message = NewMessage {
                step,
                key: format!("{}:message:{}", lease.run_id, id),
                message: Message::User { content },
            };
            sqlx::query(
                "INSERT INTO sa_messages (thread_id, run_id, step, role, key, body, created_at) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (key) DO NOTHING",
            )
            .bind(&thread)
            .bind(lease.run_id.to_string())
            .bind(step as i64)
            .bind(message.message.role())
            .bind(&message.key)
            .bind(serde_json::to_string(&message.message).expect("a message serializes"))
            .bind(now)
            .execute(&mut *tx)
            .await?;
            sqlx::query("DELETE FROM sa_inbox WHERE id = $1")
                .bind(&id)
                .execute(&mut *tx)
                .await?;
            events.push(
                Event::MessageDelivered(event::MessageDelivered {
                    message_id: id,
                    step,
                })
                .into(),
            );
            delivered.push(message);
        }
        self.commit_events(tx, lease.run_id, last, &events).await?;
        Ok(delivered)
    }
}
