//! [`Checkpoints`](crate::store::Checkpoints) for every [`SqlStore`]: fenced progress and the
//! reads that rebuild a context. The checkpoint itself is the backend's own.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::{ColumnIndex, Decode, Encode, Executor, IntoArguments, Row, Type};

use super::*;

#[async_trait]
impl<S> Checkpoints for S
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
    async fn checkpoint(&self, lease: &Lease, cp: Checkpoint) -> Result<Option<Ending>> {
        self.commit_checkpoint(lease, cp).await
    }

    async fn messages_after(
        &self,
        thread: &ThreadId,
        after: i64,
        limit: u32,
    ) -> Result<Vec<StoredMessage>> {
        let lineage = S::lineage(self.reads(), thread).await?;
        if !lineage.is_empty() {
            return S::shared_messages(self.reads(), thread, &lineage, after, limit, false).await;
        }
        let rows = sqlx::query(
            "SELECT id, run_id, step, key, body FROM (SELECT id, run_id, step, key, body FROM sa_messages \
             WHERE thread_id = $1 AND id > $2 ORDER BY id DESC LIMIT $3) t ORDER BY id",
        )
        .bind(thread.as_str())
        .bind(after)
        .bind(limit as i64)
        .fetch_all(self.reads())
        .await?;
        rows.iter().map(S::message_from_row).collect()
    }

    async fn context(&self, thread: &ThreadId, limit: u32) -> Result<ThreadContext> {
        let rows = sqlx::query(context_rows!("$1", "$2"))
            .bind(thread.as_str())
            .bind(limit as i64);
        let mut conn = self.kept().await?;
        let rows = rows.fetch_all(&mut *conn).await?;
        conn.keep();
        let ((compaction, _), lineage) = match S::context_parts(&rows)? {
            (whole, lineage) if lineage.is_empty() => return Ok(whole),
            parts => parts,
        };
        // A forked thread: its history goes on in the threads it shares (a second read, for
        // forked threads only).
        let compaction = S::shared_compaction(self.pool(), compaction, &lineage).await?;
        let after = compaction.as_ref().map_or(0, |c| c.last_message_id);
        let messages =
            S::shared_messages(self.pool(), thread, &lineage, after, limit, false).await?;
        Ok((compaction, messages))
    }

    async fn latest_compaction(&self, thread: &ThreadId) -> Result<Option<Compaction>> {
        let row = sqlx::query(
            "SELECT id, run_id, first_message_id, last_message_id, messages, summary, tokens_before, \
             tokens_after, reason, created_at FROM sa_compactions WHERE thread_id = $1 ORDER BY id DESC LIMIT 1",
        )
        .bind(thread.as_str())
        .fetch_optional(self.reads())
        .await?;
        row.as_ref().map(S::compaction_from_row).transpose()
    }

    async fn commit_compaction(
        &self,
        lease: &Lease,
        c: CompactionBody,
        spent: (Usage, u64),
        events: Vec<NewEvent>,
    ) -> Result<()> {
        let now = Utc::now();
        let mut tx = self.pool().begin().await?;
        // The fence first, as in a checkpoint: it proves the epoch and reserves the seqs.
        let row = Self::fence(&mut tx, lease, events.len(), now, sql!(
            "UPDATE sa_runs SET event_seq = event_seq + $1, lease_expires_at = $2, heartbeat_at = $3, updated_at = $3 \
             WHERE id = $4 AND lease_epoch = $5 AND status IN ({}) RETURNING event_seq, thread_id",
            Transition::Heartbeat
        )).await?;
        let last: i64 = row.get(0);
        let thread: String = row.get(1);
        // The summary call is a model call: its tokens and cost count in the run's usage.
        let (usage, cost) = spent;
        if usage.total() > 0 || cost > 0 {
            sqlx::query(
                "UPDATE sa_runs SET prompt_tokens = prompt_tokens + $1, completion_tokens = completion_tokens + $2, cost_nanos = cost_nanos + $3, \
                 cache_read_tokens = cache_read_tokens + $5, cache_write_tokens = cache_write_tokens + $6 WHERE id = $4",
            )
            .bind(usage.prompt_tokens as i64)
            .bind(usage.completion_tokens as i64)
            .bind(cost.min(i64::MAX as u64) as i64)
            .bind(lease.run_id.to_string())
            .bind(usage.cache_read_tokens as i64)
            .bind(usage.cache_write_tokens as i64)
            .execute(&mut *tx)
            .await?;
        }
        sqlx::query(
            "INSERT INTO sa_compactions (thread_id, run_id, key, first_message_id, last_message_id, messages, \
             summary, tokens_before, tokens_after, reason, created_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) ON CONFLICT(key) DO NOTHING",
        )
        .bind(&thread)
        .bind(lease.run_id.to_string())
        .bind(format!("{}:compact:{}-{}", lease.run_id, c.first_message_id, c.last_message_id))
        .bind(c.first_message_id)
        .bind(c.last_message_id)
        .bind(c.messages)
        .bind(&c.summary)
        .bind(c.tokens_before)
        .bind(c.tokens_after)
        .bind(&c.reason)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        self.commit_events(tx, lease.run_id, last, &events).await
    }

    async fn append_events(&self, run: RunId, events: Vec<NewEvent>) -> Result<bool> {
        let mut tx = self.pool().begin().await?;
        let row = sqlx::query(
            "UPDATE sa_runs SET event_seq = event_seq + $1 WHERE id = $2 \
             AND status IN ('queued','running','waiting') RETURNING event_seq",
        )
        .bind(events.len() as i64)
        .bind(run.to_string())
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else { return Ok(false) };
        let last: i64 = row.get(0);
        self.commit_events(tx, run, last, &events).await?;
        Ok(true)
    }
}
