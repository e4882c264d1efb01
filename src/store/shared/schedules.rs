//! [`Schedules`](crate::store::Schedules) for every [`SqlStore`].

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::{ColumnIndex, Decode, Encode, Executor, IntoArguments, Row, Type};

use super::*;

macro_rules! schedule_columns {
    () => {
        "id, owner, cron, timezone, agent, input, thread_id, overlap, catch_up, paused, metadata, \
         priority, next_fire_at, created_at, updated_at"
    };
}

#[async_trait]
impl<S> Schedules for S
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
    async fn create_schedule(&self, s: &Schedule) -> Result<()> {
        sqlx::query(
            "INSERT INTO sa_schedules (id, owner, cron, timezone, agent, input, thread_id, overlap, catch_up, \
             paused, metadata, priority, next_fire_at, created_at, updated_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $14)",
        )
        .bind(s.id.as_str())
        .bind(s.owner.as_str())
        .bind(s.cron.as_str())
        .bind(s.timezone.as_str())
        .bind(s.agent.as_str())
        .bind(s.input.as_str())
        .bind(s.thread_id.as_deref())
        .bind(s.overlap.as_str())
        .bind(s.catch_up.as_str())
        .bind(i64::from(s.paused))
        .bind(s.metadata.to_string())
        .bind(i64::from(s.priority))
        .bind(s.next_fire_at)
        .bind(s.created_at)
        .execute(self.pool())
        .await?;
        Ok(())
    }

    async fn list_schedules(&self, owner: &OwnerId) -> Result<Vec<Schedule>> {
        let rows = sqlx::query(concat!(
            "SELECT ",
            schedule_columns!(),
            " FROM sa_schedules WHERE owner = $1 ORDER BY created_at, id"
        ))
        .bind(owner.as_str())
        .fetch_all(self.reads())
        .await?;
        rows.iter().map(schedule_row::<S>).collect()
    }

    async fn get_schedule(&self, owner: &OwnerId, id: &str) -> Result<Option<Schedule>> {
        let row = sqlx::query(concat!(
            "SELECT ",
            schedule_columns!(),
            " FROM sa_schedules WHERE owner = $1 AND id = $2"
        ))
        .bind(owner.as_str())
        .bind(id)
        .fetch_optional(self.pool())
        .await?;
        row.as_ref().map(schedule_row::<S>).transpose()
    }

    async fn update_schedule(&self, s: &Schedule) -> Result<bool> {
        Ok(sqlx::query(
            "UPDATE sa_schedules SET cron = $1, timezone = $2, agent = $3, input = $4, thread_id = $5, \
             overlap = $6, catch_up = $7, paused = $8, metadata = $9, priority = $10, next_fire_at = $11, \
             updated_at = $12 WHERE owner = $13 AND id = $14",
        )
        .bind(s.cron.as_str())
        .bind(s.timezone.as_str())
        .bind(s.agent.as_str())
        .bind(s.input.as_str())
        .bind(s.thread_id.as_deref())
        .bind(s.overlap.as_str())
        .bind(s.catch_up.as_str())
        .bind(i64::from(s.paused))
        .bind(s.metadata.to_string())
        .bind(i64::from(s.priority))
        .bind(s.next_fire_at)
        .bind(Utc::now())
        .bind(s.owner.as_str())
        .bind(s.id.as_str())
        .execute(self.pool())
        .await?
        .rows_affected()
            > 0)
    }

    async fn delete_schedule(&self, owner: &OwnerId, id: &str) -> Result<bool> {
        Ok(
            sqlx::query("DELETE FROM sa_schedules WHERE owner = $1 AND id = $2")
                .bind(owner.as_str())
                .bind(id)
                .execute(self.pool())
                .await?
                .rows_affected()
                > 0,
        )
    }

    async fn due_schedules(&self, now: i64, limit: u32) -> Result<Vec<Schedule>> {
        let rows = sqlx::query(concat!(
            "SELECT ",
            schedule_columns!(),
            " FROM sa_schedules WHERE paused = 0 AND next_fire_at <= $1 ORDER BY next_fire_at LIMIT $2"
        ))
        .bind(now)
        .bind(i64::from(limit))
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(schedule_row::<S>).collect()
    }

    async fn advance_schedule(&self, id: &str, from: i64, to: i64) -> Result<bool> {
        Ok(sqlx::query(
            "UPDATE sa_schedules SET next_fire_at = $1 WHERE id = $2 AND next_fire_at = $3",
        )
        .bind(to)
        .bind(id)
        .bind(from)
        .execute(self.pool())
        .await?
        .rows_affected()
            > 0)
    }

    async fn record_schedule_run(&self, schedule: &str, tick: i64, run: RunId) -> Result<()> {
        sqlx::query(
            "INSERT INTO sa_schedule_runs (schedule_id, tick, run_id) VALUES ($1, $2, $3) \
             ON CONFLICT (schedule_id, tick) DO NOTHING",
        )
        .bind(schedule)
        .bind(tick)
        .bind(run.to_string())
        .execute(self.pool())
        .await?;
        Ok(())
    }

    async fn schedule_runs(
        &self,
        schedule: &str,
        limit: u32,
    ) -> Result<Vec<(i64, RunId, RunStatus)>> {
        let rows = sqlx::query(
            "SELECT t.tick, t.run_id, r.status FROM sa_schedule_runs t JOIN sa_runs r ON r.id = t.run_id \
             WHERE t.schedule_id = $1 ORDER BY t.tick DESC LIMIT $2",
        )
        .bind(schedule)
        .bind(i64::from(limit))
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|r| {
                let id: String = r.get(1);
                let status: String = r.get(2);
                Ok((
                    r.get(0),
                    id.parse()
                        .map_err(|_| StoreError::Corrupt(format!("run id `{id}`")))?,
                    RunStatus::parse(&status)
                        .ok_or_else(|| StoreError::Corrupt(format!("run status `{status}`")))?,
                ))
            })
            .collect()
    }

    async fn run_schedule(&self, run: RunId) -> Result<Option<(String, i64)>> {
        let row = sqlx::query("SELECT schedule_id, tick FROM sa_schedule_runs WHERE run_id = $1")
            .bind(run.to_string())
            .fetch_optional(self.reads())
            .await?;
        Ok(row.map(|r| (r.get(0), r.get(1))))
    }

    async fn run_by_key(&self, owner: &OwnerId, key: &str) -> Result<Option<RunId>> {
        let row = sqlx::query("SELECT id FROM sa_runs WHERE owner = $1 AND idempotency_key = $2")
            .bind(owner.as_str())
            .bind(key)
            .fetch_optional(self.pool())
            .await?;
        row.map(|r| {
            let id: String = r.get(0);
            id.parse()
                .map_err(|_| StoreError::Corrupt(format!("run id `{id}`")))
        })
        .transpose()
    }
}

fn schedule_row<S>(r: &DbRow<S>) -> Result<Schedule>
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
    let overlap: String = r.get(7);
    let catch_up: String = r.get(8);
    let metadata: String = r.get(10);
    Ok(Schedule {
        id: r.get(0),
        owner: OwnerId::from(r.get::<String, _>(1)),
        cron: r.get(2),
        timezone: r.get(3),
        agent: r.get(4),
        input: r.get(5),
        thread_id: r.get(6),
        overlap: Overlap::parse(&overlap)
            .ok_or_else(|| StoreError::Corrupt(format!("schedule overlap `{overlap}`")))?,
        catch_up: CatchUp::parse(&catch_up)
            .ok_or_else(|| StoreError::Corrupt(format!("schedule catch_up `{catch_up}`")))?,
        paused: r.get::<i64, _>(9) != 0,
        metadata: serde_json::from_str(&metadata).unwrap_or(serde_json::Value::Null),
        priority: r.get::<i64, _>(11).clamp(1, 5) as u8,
        next_fire_at: r.get(12),
        created_at: r.get(13),
        updated_at: r.get(14),
    })
}
