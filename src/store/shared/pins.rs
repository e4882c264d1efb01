//! [`Pins`](crate::store::Pins) for every [`SqlStore`]: the texts of pinned versions, and each
//! run's pinned values.

use std::collections::BTreeMap;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::{ColumnIndex, Decode, Encode, Executor, IntoArguments, Row, Type};

use super::*;

#[async_trait]
impl<S> Pins for S
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
    async fn record_agent_version(&self, version: &str, agent: &str, text: &str) -> Result<()> {
        sqlx::query(
            "INSERT INTO sa_agent_versions (version, agent, text, created_at) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (version) DO NOTHING",
        )
        .bind(version)
        .bind(agent)
        .bind(text)
        .bind(Utc::now())
        .execute(self.pool())
        .await?;
        Ok(())
    }

    async fn agent_version(&self, version: &str) -> Result<Option<(String, String)>> {
        let row = sqlx::query("SELECT agent, text FROM sa_agent_versions WHERE version = $1")
            .bind(version)
            .fetch_optional(self.pool())
            .await?;
        Ok(row.map(|r| (r.get(0), r.get(1))))
    }

    async fn record_pinned_text(&self, version: &str, text: &str) -> Result<()> {
        sqlx::query(
            "INSERT INTO sa_pinned_texts (version, text, created_at) VALUES ($1, $2, $3) \
             ON CONFLICT (version) DO NOTHING",
        )
        .bind(version)
        .bind(text)
        .bind(Utc::now())
        .execute(self.pool())
        .await?;
        Ok(())
    }

    async fn pinned_text(&self, version: &str) -> Result<Option<String>> {
        let row = sqlx::query("SELECT text FROM sa_pinned_texts WHERE version = $1")
            .bind(version)
            .fetch_optional(self.pool())
            .await?;
        Ok(row.map(|r| r.get(0)))
    }

    async fn run_pins(&self, run: RunId) -> Result<BTreeMap<String, String>> {
        let rows = sqlx::query("SELECT name, value FROM sa_run_pins WHERE run_id = $1")
            .bind(run.to_string())
            .fetch_all(self.pool())
            .await?;
        Ok(rows.into_iter().map(|r| (r.get(0), r.get(1))).collect())
    }

    async fn pin_run(
        &self,
        run: RunId,
        pins: Vec<(String, String)>,
    ) -> Result<BTreeMap<String, String>> {
        if pins.is_empty() {
            return Ok(BTreeMap::new());
        }
        let id = run.to_string();
        let mut q =
            sqlx::QueryBuilder::<S::Db>::new("INSERT INTO sa_run_pins (run_id, name, value) ");
        q.push_values(&pins, |mut b, (name, value)| {
            b.push_bind(id.clone())
                .push_bind(name.clone())
                .push_bind(value.clone());
        });
        q.push(" ON CONFLICT (run_id, name) DO NOTHING RETURNING name");
        let inserted = q.build().fetch_all(self.pool()).await?;
        let mut wanted: BTreeMap<String, String> = pins.into_iter().collect();
        if inserted.len() < wanted.len() {
            // Another claim pinned some first: its values hold.
            let held = self.run_pins(run).await?;
            for (name, value) in wanted.iter_mut() {
                if let Some(v) = held.get(name) {
                    value.clone_from(v);
                }
            }
        }
        Ok(wanted)
    }
}
