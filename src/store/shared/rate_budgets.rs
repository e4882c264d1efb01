//! [`RateBudgets`](crate::store::RateBudgets) for every [`SqlStore`]: the database's half of
//! the rate budgets.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::{ColumnIndex, Decode, Encode, Executor, IntoArguments, Row, Type};

use super::*;

#[async_trait]
impl<S> RateBudgets for S
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
    async fn take_budget(
        &self,
        key: &str,
        window_ms: i64,
        max_requests: Option<u64>,
        max_tokens: Option<u64>,
        tokens: u64,
    ) -> Result<Option<i64>> {
        let now = now_ms();
        let mut tx = self.pool().begin().await?;
        // The key's row is the lock: takers of one key go one at a time, on both backends.
        let (blocked_until, next_wake): (i64, i64) = sqlx::query_as(
            "INSERT INTO sa_rate_keys (key, touched) VALUES ($1, $2) ON CONFLICT(key) DO UPDATE SET touched = $2 RETURNING blocked_until, next_wake",
        )
        .bind(key)
        .bind(now)
        .fetch_one(&mut *tx)
        .await?;
        // The provider said the budget is used up: nobody takes from it until then.
        if blocked_until > now {
            tx.commit().await?;
            return Ok(Some(blocked_until));
        }
        sqlx::query("DELETE FROM sa_rate_log WHERE key = $1 AND at <= $2")
            .bind(key)
            .bind(now - window_ms)
            .execute(&mut *tx)
            .await?;
        let row = sqlx::query(
            "SELECT count(*), CAST(COALESCE(SUM(tokens), 0) AS BIGINT), CAST(COALESCE(MIN(at), 0) AS BIGINT) FROM sa_rate_log WHERE key = $1",
        )
        .bind(key)
        .fetch_one(&mut *tx)
        .await?;
        let (used, spent, oldest): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
        let over = max_requests.is_some_and(|m| used as u64 + 1 > m)
            || max_tokens.is_some_and(|m| used > 0 && spent as u64 + tokens > m);
        if over {
            // Each refused taker gets its own slot: the first when the oldest call
            // leaves the window, each next one a slot's share of the window later.
            let at = super::next_wake(oldest + window_ms + 1, next_wake, window_ms, max_requests);
            sqlx::query("UPDATE sa_rate_keys SET next_wake = $1 WHERE key = $2")
                .bind(at)
                .bind(key)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            return Ok(Some(at));
        }
        sqlx::query("INSERT INTO sa_rate_log (key, at, tokens) VALUES ($1, $2, $3)")
            .bind(key)
            .bind(now)
            .bind(tokens.min(i64::MAX as u64) as i64)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(None)
    }

    async fn block_budget(&self, key: &str, until_ms: i64) -> Result<()> {
        sqlx::query(
            "INSERT INTO sa_rate_keys (key, touched, blocked_until) VALUES ($1, $2, $3) ON CONFLICT(key) DO UPDATE SET \
             blocked_until = CASE WHEN sa_rate_keys.blocked_until > EXCLUDED.blocked_until THEN sa_rate_keys.blocked_until ELSE EXCLUDED.blocked_until END",
        )
        .bind(key)
        .bind(now_ms())
        .bind(until_ms)
        .execute(self.pool())
        .await?;
        Ok(())
    }

    async fn budget_blocked_until(&self, key: &str) -> Result<i64> {
        let until: Option<i64> =
            sqlx::query_scalar("SELECT blocked_until FROM sa_rate_keys WHERE key = $1")
                .bind(key)
                .fetch_optional(self.pool())
                .await?;
        Ok(until.unwrap_or(0))
    }

    async fn set_owner_budgets(&self, entries: &[(OwnerId, OwnerBudget)]) -> Result<()> {
        let mut tx = self.pool().begin().await?;
        sqlx::query("DELETE FROM sa_owner_budgets")
            .execute(&mut *tx)
            .await?;
        for (owner, b) in entries
            .iter()
            .filter(|(_, b)| b.rpm.is_some() || b.tpm.is_some())
        {
            sqlx::query("INSERT INTO sa_owner_budgets (owner, rpm, tpm) VALUES ($1, $2, $3)")
                .bind(owner)
                .bind(b.rpm.map(|n| n.min(i64::MAX as u64) as i64))
                .bind(b.tpm.map(|n| n.min(i64::MAX as u64) as i64))
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn owner_budget(&self, owner: &OwnerId) -> Result<Option<OwnerBudget>> {
        let row: Option<(Option<i64>, Option<i64>)> =
            sqlx::query_as("SELECT rpm, tpm FROM sa_owner_budgets WHERE owner = $1")
                .bind(owner)
                .fetch_optional(self.pool())
                .await?;
        Ok(row.map(|(rpm, tpm)| OwnerBudget {
            rpm: rpm.map(|n| n.max(0) as u64),
            tpm: tpm.map(|n| n.max(0) as u64),
        }))
    }
}
