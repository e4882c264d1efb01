//! [`Forks`](crate::store::Forks) for every [`SqlStore`]: a fork is a thread row and its
//! lineage (which threads its history comes from, and up to which message), never a copy of
//! the messages.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::{ColumnIndex, Decode, Encode, Executor, IntoArguments, Row, Type};

use super::*;

#[async_trait]
impl<S> Forks for S
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
    async fn fork_thread(
        &self,
        owner: &OwnerId,
        source: &ThreadId,
        at: ForkAt,
        new: &ThreadId,
    ) -> Result<Forked> {
        let src = source.as_str();
        let owned: Option<String> =
            sqlx::query_scalar("SELECT owner FROM sa_threads WHERE id = $1")
                .bind(src)
                .fetch_optional(self.pool())
                .await?;
        if owned.as_deref() != Some(owner.as_str()) {
            return Ok(Forked::NoThread);
        }
        let lineage = S::lineage(self.pool(), source).await?;
        let at_message = match at {
            ForkAt::Message(m) => {
                let thread: Option<String> =
                    sqlx::query_scalar("SELECT thread_id FROM sa_messages WHERE id = $1")
                        .bind(m)
                        .fetch_optional(self.pool())
                        .await?;
                let visible = thread.is_some_and(|t| {
                    t == src || lineage.iter().any(|(a, upto)| *a == t && m <= *upto)
                });
                if !visible {
                    return Ok(Forked::NoMessage);
                }
                m
            }
            ForkAt::Run(run) => {
                let row = sqlx::query(
                    "SELECT (SELECT MAX(m.id) FROM sa_messages m WHERE m.run_id = r.id) FROM sa_runs r \
                     WHERE r.id = $1 AND r.thread_id = $2",
                )
                .bind(run.to_string())
                .bind(src)
                .fetch_optional(self.pool())
                .await?;
                match row.map(|r| r.get::<Option<i64>, _>(0)) {
                    None => return Ok(Forked::NoRun),
                    Some(None) => return Ok(Forked::Empty),
                    Some(Some(m)) => m,
                }
            }
            ForkAt::End => {
                match S::shared_messages(self.pool(), source, &lineage, 0, 1, false)
                    .await?
                    .pop()
                {
                    Some(m) => m.id,
                    None => return Ok(Forked::Empty),
                }
            }
        };
        let now = Utc::now();
        let mut tx = self.pool().begin().await?;
        sqlx::query(
            "INSERT INTO sa_threads (id, owner, created_at, updated_at, forked_from, forked_at) \
             VALUES ($1, $2, $3, $3, $4, $5)",
        )
        .bind(new.as_str())
        .bind(owner)
        .bind(now)
        .bind(src)
        .bind(at_message)
        .execute(&mut *tx)
        .await?;
        let rows = std::iter::once((src.to_owned(), at_message)).chain(
            lineage
                .into_iter()
                .map(|(a, upto)| (a, upto.min(at_message))),
        );
        for (ancestor, upto) in rows {
            sqlx::query(
                "INSERT INTO sa_thread_lineage (thread, ancestor, upto) VALUES ($1, $2, $3)",
            )
            .bind(new.as_str())
            .bind(ancestor)
            .bind(upto)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(Forked::Done { at_message })
    }

    async fn forks_of(&self, thread: &ThreadId) -> Result<Vec<(ThreadId, i64)>> {
        let rows = sqlx::query(
            "SELECT id, forked_at FROM sa_threads WHERE forked_from = $1 ORDER BY created_at, id LIMIT 1000",
        )
        .bind(thread.as_str())
        .fetch_all(self.reads())
        .await?;
        rows.iter()
            .map(|r| {
                let id: String = r.get(0);
                Ok((id.parse().map_err(|e| corrupt("thread id", e))?, r.get(1)))
            })
            .collect()
    }
}
