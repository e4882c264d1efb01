//! [`Queries`](crate::store::Queries) for every [`SqlStore`]: what the API and metrics read.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::{ColumnIndex, Decode, Encode, Executor, IntoArguments, Row, Type};

use super::*;

/// A LIKE pattern for a stored assistant message that calls `tool`.
fn call_pattern(tool: &str) -> String {
    format!("%\"name\":\"{tool}\"%")
}

/// The arguments of the last call to `tool` in a stored assistant message's body.
fn call_arguments(body: &str, tool: &str) -> Result<Option<String>> {
    let message: crate::model::Message =
        serde_json::from_str(body).map_err(|e| corrupt("message body", e))?;
    Ok(match message {
        crate::model::Message::Assistant { tool_calls, .. } => tool_calls
            .into_iter()
            .rev()
            .find(|c| c.function.name == tool)
            .map(|c| c.function.arguments),
        _ => None,
    })
}

/// A run's view extras from the rows of [`view_extras!`] (by name).
fn extras_from_rows<'r, R: Row + 'r>(
    rows: impl IntoIterator<Item = &'r R>,
    tool: &str,
) -> Result<ViewExtras>
where
    for<'a> &'a str: ColumnIndex<R>,
    String: Col<R::Database>,
    i32: Col<R::Database>,
    Option<String>: Col<R::Database>,
{
    extras_from_parts(
        rows.into_iter()
            .map(|r| (r.get::<i32, _>("part"), r.get("a"), r.get("b"))),
        tool,
    )
}

/// A run's view extras from the `(part, a, b)` of [`view_extras!`]'s rows, however they came.
fn extras_from_parts(
    parts: impl IntoIterator<Item = (i32, String, Option<String>)>,
    tool: &str,
) -> Result<ViewExtras> {
    let mut extras = ViewExtras::default();
    for (part, a, b) in parts {
        match part {
            0 => {
                extras.pins.insert(a, b.unwrap_or_default());
            }
            1 => {
                let tick = b.as_deref().unwrap_or("").parse::<i64>();
                extras.schedule = Some((a, tick.map_err(|e| corrupt("schedule tick", e))?));
            }
            2 => extras.last_call = call_arguments(&a, tool)?,
            _ => extras
                .children
                .push(a.parse().map_err(|e| corrupt("run id", e))?),
        }
    }
    Ok(extras)
}

#[async_trait]
impl<S> Queries for S
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
    async fn overview(
        &self,
        owner: &OwnerId,
        hour: DateTime<Utc>,
        day: DateTime<Utc>,
        cap: u32,
    ) -> Result<OverviewData> {
        let mut out = OverviewData::default();
        for row in
            sqlx::query("SELECT status, COUNT(*) FROM sa_runs WHERE owner = $1 GROUP BY status")
                .bind(owner)
                .fetch_all(self.reads())
                .await?
        {
            out.by_status
                .push((row.try_get(0)?, row.get::<i64, _>(1) as u64));
        }
        out.oldest_queued_ms = sqlx::query_scalar(
            "SELECT MIN(enqueued_at) FROM sa_runs WHERE owner = $1 AND status = 'queued'",
        )
        .bind(owner)
        .fetch_one(self.reads())
        .await?;
        let rows = sqlx::query(S::statements().overview_events.as_str())
            .bind(owner)
            .bind(hour)
            .bind(i64::from(cap) + 1)
            .fetch_all(self.reads())
            .await?;
        out.events_capped = rows.len() > cap as usize;
        for row in rows.iter().take(cap as usize) {
            let run: String = row.get(0);
            let data: String = row.get(2);
            out.events.push((
                run.parse().map_err(|e| corrupt("event run id", e))?,
                row.get(1),
                serde_json::from_str(&data).map_err(|e| corrupt("event data", e))?,
                row.get(3),
            ));
        }
        for row in sqlx::query(
            "SELECT COALESCE(error_kind, 'unknown'), COUNT(*) FROM sa_runs \
             WHERE owner = $1 AND finished_at >= $2 AND status = 'failed' GROUP BY error_kind",
        )
        .bind(owner)
        .bind(day)
        .fetch_all(self.reads())
        .await?
        {
            out.failures.push((row.get(0), row.get::<i64, _>(1) as u64));
        }
        // No ORDER BY: sorting by id would walk the (owner, id) index over every run.
        for row in sqlx::query("SELECT id, lease_owner, heartbeat_at FROM sa_runs WHERE owner = $1 AND status = 'running' LIMIT 500")
            .bind(owner)
            .fetch_all(self.reads())
            .await?
        {
            let id: String = row.get(0);
            out.running.push((id.parse().map_err(|e| corrupt("run id", e))?, row.get(1), row.get(2)));
        }
        out.workers = self.workers().await?;
        Ok(out)
    }

    async fn list_runs(
        &self,
        owner: &OwnerId,
        f: &RunFilter,
        limit: u32,
    ) -> Result<Vec<RunRecord>> {
        let mut q = sqlx::QueryBuilder::<S::Db>::new(concat!(
            "SELECT ",
            run_columns!(),
            " FROM sa_runs WHERE owner = "
        ));
        q.push_bind(owner.to_owned());
        if !f.status.is_empty() {
            q.push(" AND status IN (");
            let mut list = q.separated(", ");
            for s in &f.status {
                list.push_bind(*s);
            }
            list.push_unseparated(")");
        }
        if let Some(a) = &f.agent {
            q.push(" AND agent = ").push_bind(a.clone());
        }
        if let Some(t) = &f.thread_id {
            q.push(" AND thread_id = ").push_bind(t.as_str().to_owned());
        }
        if let Some(p) = f.parent_run_id {
            q.push(" AND parent_run_id = ").push_bind(p.to_string());
        }
        if let Some(sched) = &f.schedule_id {
            q.push(" AND id IN (SELECT run_id FROM sa_schedule_runs WHERE schedule_id = ")
                .push_bind(sched.clone())
                .push(")");
        }
        if let Some(text) = &f.text {
            // LIKE's wildcards in the text are matched literally.
            let pattern = format!(
                "%{}%",
                text.to_lowercase()
                    .replace('\\', "\\\\")
                    .replace('%', "\\%")
                    .replace('_', "\\_")
            );
            q.push(" AND (LOWER(input) LIKE ")
                .push_bind(pattern.clone())
                .push(" ESCAPE '\\' OR LOWER(COALESCE(result, '')) LIKE ")
                .push_bind(pattern)
                .push(" ESCAPE '\\')");
        }
        // Ids are time-ordered: a time range is an id range, served by the primary key.
        if let Some(t) = f.created_after {
            q.push(" AND id >= ")
                .push_bind(RunId::lower_bound(t).to_string());
        }
        if let Some(t) = f.created_before {
            q.push(" AND id < ")
                .push_bind(RunId::lower_bound(t).to_string());
        }
        if let Some(c) = f.before {
            q.push(if f.oldest_first {
                " AND id > "
            } else {
                " AND id < "
            })
            .push_bind(c.to_string());
        }
        q.push(if f.oldest_first {
            " ORDER BY id ASC LIMIT "
        } else {
            " ORDER BY id DESC LIMIT "
        })
        .push_bind(i64::from(limit));
        let rows = q.build().fetch_all(self.reads()).await?;
        rows.iter().map(S::run_from_row).collect()
    }

    async fn get_thread(&self, id: &ThreadId) -> Result<Option<ThreadRecord>> {
        let row = sqlx::query(
            "SELECT id, owner, created_at, updated_at, forked_from, forked_at FROM sa_threads WHERE id = $1",
        )
        .bind(id.as_str())
        .fetch_optional(self.reads())
        .await?;
        let Some(r) = row else { return Ok(None) };
        let from: Option<String> = r.get("forked_from");
        let at: Option<i64> = r.get("forked_at");
        Ok(Some(ThreadRecord {
            id: id.clone(),
            owner: r.get("owner"),
            created_at: r.get("created_at"),
            updated_at: r.get("updated_at"),
            forked_from: from
                .zip(at)
                .map(|(t, at)| t.parse().map(|t| (t, at)))
                .transpose()
                .map_err(|e| corrupt("thread id", e))?,
        }))
    }

    async fn compactions(&self, thread: &ThreadId) -> Result<Vec<Compaction>> {
        let rows = sqlx::query(
            "SELECT id, run_id, first_message_id, last_message_id, messages, summary, tokens_before, \
             tokens_after, reason, created_at FROM sa_compactions WHERE thread_id = $1 ORDER BY id",
        )
        .bind(thread.as_str())
        .fetch_all(self.reads())
        .await?;
        rows.iter().map(S::compaction_from_row).collect()
    }

    async fn messages_page(
        &self,
        thread: &ThreadId,
        after: i64,
        limit: u32,
    ) -> Result<Vec<StoredMessage>> {
        let lineage = S::lineage(self.reads(), thread).await?;
        if !lineage.is_empty() {
            return S::shared_messages(self.reads(), thread, &lineage, after, limit, true).await;
        }
        let rows = sqlx::query(
            "SELECT id, run_id, step, key, body FROM sa_messages WHERE thread_id = $1 AND id > $2 ORDER BY id LIMIT $3",
        )
        .bind(thread.as_str())
        .bind(after)
        .bind(limit as i64)
        .fetch_all(self.reads())
        .await?;
        rows.iter().map(S::message_from_row).collect()
    }

    async fn queue_position(&self, run: RunId) -> Result<i64> {
        // Jobs go by rank in their owner's queue: ahead of a run of rank r are the r
        // runs ahead in its own owner's queue and, from every other owner, its first
        // r + 1 queued runs (at most). One statement: a runs page asks for each run.
        let n: Option<i64> = sqlx::query_scalar(
            "WITH me AS (SELECT owner, priority, id FROM sa_runs WHERE id = $1), \
             rk AS (SELECT COUNT(*) AS r FROM sa_runs q, me WHERE q.owner = me.owner AND q.status = 'queued' \
               AND (q.priority > me.priority OR (q.priority = me.priority AND q.id < me.id))), \
             per_owner AS (SELECT COUNT(*) AS n FROM sa_runs o, me WHERE o.status = 'queued' AND o.owner <> me.owner GROUP BY o.owner) \
             SELECT CAST(rk.r + COALESCE((SELECT SUM(CASE WHEN n < rk.r + 1 THEN n ELSE rk.r + 1 END) FROM per_owner), 0) AS BIGINT) \
             FROM rk, me",
        )
        .bind(run.to_string())
        .fetch_optional(self.reads())
        .await?;
        Ok(n.unwrap_or(0))
    }

    async fn last_call_arguments(&self, run: RunId, tool: &str) -> Result<Option<String>> {
        // The run's assistant messages, newest first; the index on (run_id, id) keeps it
        // to this run's rows.
        let rows = sqlx::query(
            "SELECT body FROM sa_messages WHERE run_id = $1 AND role = 'assistant' AND body LIKE $2 ORDER BY id DESC LIMIT 1",
        )
        .bind(run.to_string())
        .bind(call_pattern(tool))
        .fetch_all(self.reads())
        .await?;
        match rows.first() {
            Some(row) => call_arguments(&row.get::<String, _>(0), tool),
            None => Ok(None),
        }
    }

    async fn view_extras(&self, run: RunId, tool: &str) -> Result<ViewExtras> {
        let rows = sqlx::query(concat!(view_extras!("$1", "$2"), " ORDER BY 1, 2"))
            .bind(run.to_string())
            .bind(call_pattern(tool))
            .fetch_all(self.reads())
            .await?;
        extras_from_rows(&rows, tool)
    }

    async fn run_and_extras(
        &self,
        run: RunId,
        tool: &str,
    ) -> Result<Option<(RunRecord, Option<ViewExtras>)>> {
        // The extras come only for a run that had ended, which it then stays.
        if S::STATEMENTS_PER_COMMAND {
            // `run_with_latest`'s one command, asking for no events.
            let read = self.run_with_latest(run, 0, tool).await?;
            return Ok(read.map(|r| (r.run, r.extras)));
        }
        // One statement, one row: the extras as a JSON array of `[part, a, b]` beside the
        // run's columns (sqlx sends PostgreSQL one statement per round trip; `CASE` reads them
        // only for a run that has ended).
        let row = sqlx::query(concat!(
            "SELECT ",
            run_columns!(),
            ", CASE WHEN status NOT IN ('queued', 'running', 'waiting') THEN \
               (SELECT CAST(COALESCE(json_agg(json_build_array(part, a, b) ORDER BY part, a), '[]') AS TEXT) FROM (",
            view_extras!("$1", "$2"),
            ") x) END AS extras FROM sa_runs WHERE id = $1"
        ))
        .bind(run.to_string())
        .bind(call_pattern(tool))
        .fetch_optional(self.reads())
        .await?;
        let Some(row) = row else {
            return Ok(None);
        };
        // The column is NULL exactly while the run has not ended (its `CASE`).
        let extras = match row.get::<Option<String>, _>("extras") {
            Some(json) => {
                let parts: Vec<(i32, String, Option<String>)> =
                    serde_json::from_str(&json).map_err(|e| corrupt("view extras", e))?;
                Some(extras_from_parts(parts, tool)?)
            }
            None => None,
        };
        Ok(Some((S::run_from_row(&row)?, extras)))
    }

    async fn run_with_latest(&self, run: RunId, last: u32, tool: &str) -> Result<Option<RunRead>> {
        if !S::STATEMENTS_PER_COMMAND {
            let events = |after| self.events_after(run, after, last);
            return RunRead::apart(self, run, last, tool, events).await;
        }
        // One command, three statements (`src` tells whose a row is), each its own snapshot:
        // the events are cut from what their statement saw, so they say themselves where they
        // start; the extras come only for a run that had ended, which it then stays.
        let rows = sqlx::query(concat!(
            "SELECT 0 AS src, ",
            run_columns!(),
            " FROM sa_runs WHERE id = $1; \
             SELECT 1 AS src, run_id, seq, type, data, created_at FROM sa_events WHERE run_id = $1 \
               AND seq > (SELECT event_seq FROM sa_runs WHERE id = $1) - $2 ORDER BY seq LIMIT $2; \
             SELECT 2 AS src, part, a, b FROM (",
            view_extras!("$1", "$3"),
            ") x WHERE EXISTS (SELECT 1 FROM sa_runs WHERE id = $1 \
               AND status NOT IN ('queued', 'running', 'waiting')) ORDER BY 2, 3"
        ))
        .bind(run.to_string())
        .bind(i64::from(last))
        .bind(call_pattern(tool))
        .fetch_all(self.reads())
        .await?;
        let of = |src: i32| rows.iter().filter(move |r| r.get::<i32, _>("src") == src);
        let Some(r) = of(0).next().map(S::run_from_row).transpose()? else {
            return Ok(None);
        };
        let events = of(1).map(S::event_from_row).collect::<Result<Vec<_>>>()?;
        let events_after = match events.first() {
            Some(e) => e.seq - 1,
            None => r.event_seq.saturating_sub(u64::from(last)),
        };
        let extras = match r.status.is_terminal() {
            true => Some(extras_from_rows(of(2), tool)?),
            false => None,
        };
        Ok(Some(RunRead {
            run: r,
            events,
            events_after,
            extras,
        }))
    }

    async fn queued_count(&self, owner: &OwnerId) -> Result<u64> {
        let n: i64 = sqlx::query_scalar(
            "SELECT CAST(COALESCE(SUM(queued), 0) AS BIGINT) FROM sa_queue_depth WHERE owner = $1",
        )
        .bind(owner)
        .fetch_one(self.reads())
        .await?;
        Ok(n.max(0) as u64)
    }

    async fn status_counts(&self) -> Result<Vec<(RunStatus, i64)>> {
        let rows = sqlx::query("SELECT status, count(*) FROM sa_runs GROUP BY status")
            .fetch_all(self.reads())
            .await?;
        rows.iter()
            .map(|r| Ok((r.try_get(0)?, r.get::<i64, _>(1))))
            .collect()
    }

    fn subscribe_all(&self) -> std::sync::Arc<crate::notify::Signal> {
        self.notifier().subscribe_all()
    }
}
