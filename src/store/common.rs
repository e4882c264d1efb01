//! Fragments of SQL both backends build their statements from, as literals (so `concat!` can
//! join them) or built once (status guards, from [`crate::lifecycle::sql_sources`], so a
//! statement can only apply a move the state machine allows).

/// The `WHERE status IN (…)` list for a transition, computed once.
macro_rules! sources {
    ($t:expr) => {{
        static S: std::sync::LazyLock<String> =
            std::sync::LazyLock::new(|| crate::lifecycle::sql_sources($t));
        S.as_str()
    }};
}

/// A statement with status guards spliced in, built once: `sql!("… IN ({}) …", Transition::X)`.
macro_rules! sql {
    ($fmt:expr $(, $t:expr)* $(,)?) => {{
        static S: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| format!($fmt $(, crate::lifecycle::sql_sources($t))*));
        S.as_str()
    }};
}

/// Binds `$1`..`$14` of a checkpoint's fence, identical on both backends: counters, lease
/// deadline, the terminal columns of [`FenceFields`](super::FenceFields), run id and epoch.
macro_rules! bind_fence {
    ($q:expr, $cp:expr, $ff:expr, $lease:expr, $now:expr) => {
        $q.bind($cp.events.len() as i64)
            .bind($cp.step.map(|s| s as i64))
            .bind($cp.usage.prompt_tokens as i64)
            .bind($cp.usage.completion_tokens as i64)
            .bind($ff.status)
            .bind(now_ms() + $lease.ttl.as_millis() as i64)
            .bind($now)
            .bind($ff.result)
            .bind($ff.forced)
            .bind($ff.error_kind)
            .bind($ff.error_message)
            .bind($ff.finished_at)
            .bind($lease.run_id.to_string())
            .bind($lease.epoch)
    };
}

/// Binds `$1`..`$15` of a start, identical on both backends: the run, its thread and owner,
/// what it runs, its links, its job, its times and its place in the tree.
macro_rules! bind_new_run {
    ($q:expr, $new:expr, $now:expr) => {
        $q.bind($new.id.to_string())
            .bind($new.thread_id.as_str())
            .bind(&$new.owner)
            .bind(&$new.agent)
            .bind(&$new.input)
            .bind($new.metadata.to_string())
            .bind(serde_json::to_string(&$new.limits).expect("limits serialize"))
            .bind($new.parent_run_id.map(|p| p.to_string()))
            .bind(&$new.idempotency_key)
            .bind(&$new.job_id)
            .bind(now_ms())
            .bind($now)
            .bind($new.tree.root_run_id.map(|r| r.to_string()))
            .bind($new.tree.depth as i64)
            .bind($new.tree.detached as i64)
    };
}

/// No run of `$run`'s thread queued before it (a `WHERE` fragment; `$run` names the outer
/// row). The thread's runs come from `sa_runs_thread_live` (migrations postgres/0024 and sqlite/0018), whose
/// predicate is repeated word for word; the status wanted is then tested with `NOT IN`, which
/// no index answers, so the planner cannot take the status index instead and walk every
/// queued run there is. `$subplan` is `" OFFSET 0"` on PostgreSQL: it keeps the lookup a
/// subplan run with the thread as its index condition. Pulled up into an anti join, its inner
/// side could be a whole scan of the partial index, which the planner prices at nothing while
/// its statistics say no run is live, and which then walks every live run (`EXPLAIN` showed
/// both traps on statistics taken with nothing queued; `store::sql::thread_lookups` pins it).
/// SQLite takes no `OFFSET` without a `LIMIT`, and runs a correlated `EXISTS` as a subquery
/// anyway.
macro_rules! none_queued_before {
    ($run:literal, $subplan:literal) => {
        concat!(
            "NOT EXISTS (SELECT 1 FROM sa_runs q WHERE q.thread_id = ",
            $run,
            ".thread_id AND q.status IN ('queued', 'running', 'waiting') AND q.status NOT IN ('running', 'waiting') AND q.id < ",
            $run,
            ".id",
            $subplan,
            ")"
        )
    };
}

/// `$run` is next in its thread (a `WHERE` fragment): no run of the thread active, none queued
/// before it. What a claim asks of a queued run, and what the recovery of queued runs asks.
macro_rules! next_in_its_thread {
    ($run:literal, $subplan:literal) => {
        concat!(
            "NOT EXISTS (SELECT 1 FROM sa_runs a WHERE a.thread_id = ",
            $run,
            ".thread_id AND a.status IN ('running','waiting')) AND ",
            none_queued_before!($run, $subplan)
        )
    };
}

/// The claim's concurrency guard (a `WHERE` fragment on `sa_runs`): the run's owner below its
/// limit (its own, else the default `*`), and its agent below its own. Nothing to check when
/// `sa_limits` is empty, which the first probe of each `NOT EXISTS` finds at once.
macro_rules! limits_guard {
    () => {
        " AND NOT EXISTS (SELECT 1 FROM sa_limits l WHERE \
           (l.key = 'owner:' || sa_runs.owner OR (l.key = '*' AND NOT EXISTS (SELECT 1 FROM sa_limits lo WHERE lo.key = 'owner:' || sa_runs.owner))) \
           AND l.concurrency <= (SELECT COUNT(*) FROM sa_runs o WHERE o.owner = sa_runs.owner AND o.status = 'running')) \
         AND NOT EXISTS (SELECT 1 FROM sa_limits l WHERE l.key = 'agent:' || sa_runs.agent \
           AND l.concurrency <= (SELECT COUNT(*) FROM sa_runs g WHERE g.agent = sa_runs.agent AND g.status = 'running'))"
    };
}

/// A run's place in its owner's queue (what `SqlStore::rank_from_row` reads): the queued runs
/// of higher priority, and of its own when `$back` is true (it counts itself then), with the
/// run's priority and whether it is queued. `$run` and `$back` are the parameters (`"$1"`).
/// The columns and `FROM` of a `SELECT`.
macro_rules! rank_of {
    ($run:literal, $back:literal) => {
        concat!(
            "CAST(COALESCE((SELECT SUM(d.queued) FROM sa_queue_depth d WHERE d.owner = r.owner \
               AND (d.priority > r.priority OR (",
            $back,
            " AND d.priority = r.priority))), 0) AS BIGINT) AS ahead, \
             r.priority AS priority, CASE WHEN r.status = 'queued' THEN 1 ELSE 0 END AS queued \
             FROM sa_runs r WHERE r.id = ",
            $run
        )
    };
}

/// What a run's view shows beside the run (`Queries::view_extras`), as one `SELECT` of three
/// columns `part`, `a`, `b`: one row per pin (part 0), the schedule tick (1), the latest message
/// calling the plan's tool (2), and one per child (3). `$run` and `$pattern` (the call's `LIKE`
/// pattern) are the parameters.
macro_rules! view_extras {
    ($run:literal, $pattern:literal) => {
        concat!(
            "SELECT 0 AS part, name AS a, value AS b FROM sa_run_pins WHERE run_id = ", $run, " \
             UNION ALL SELECT 1, schedule_id, CAST(tick AS TEXT) FROM sa_schedule_runs WHERE run_id = ", $run, " \
             UNION ALL SELECT 2, body, NULL FROM (SELECT body FROM sa_messages WHERE run_id = ", $run, " \
               AND role = 'assistant' AND body LIKE ", $pattern, " ORDER BY id DESC LIMIT 1) m \
             UNION ALL SELECT 3, id, NULL FROM sa_runs WHERE parent_run_id = ", $run
        )
    };
}

/// What a claimed run rebuilds its context from, as one `SELECT`: the thread's newest compaction
/// (`part` 0), the newest `$limit` messages after it (`part` 1, each with its own columns), and
/// the threads it shares history with when it is a fork (`part` 2: `run_id` the ancestor,
/// `id` the last message shared), in that order. `$thread` and `$limit` are the parameters
/// (`"$1"`); `SqlStore::context_parts` reads the rows.
macro_rules! context_rows {
    ($thread:literal, $limit:literal) => {
        concat!(
            "WITH c AS (SELECT id, run_id, first_message_id, last_message_id, messages, summary, tokens_before, \
               tokens_after, reason, created_at FROM sa_compactions WHERE thread_id = ", $thread, " ORDER BY id DESC LIMIT 1) \
             SELECT 0 AS part, id, run_id, first_message_id, last_message_id, messages, summary, tokens_before, \
               tokens_after, reason, created_at, NULL AS step, NULL AS key, NULL AS body FROM c \
             UNION ALL \
             SELECT 1, id, run_id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, step, key, body \
             FROM (SELECT id, run_id, step, key, body FROM sa_messages \
               WHERE thread_id = ", $thread, " AND id > COALESCE((SELECT last_message_id FROM c), 0) ORDER BY id DESC LIMIT ", $limit, ") m \
             UNION ALL \
             SELECT 2, upto, ancestor, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL \
             FROM sa_thread_lineage WHERE thread = ", $thread, " \
             ORDER BY part, id"
        )
    };
}

/// The columns of a run, in the order `run_from_row` reads them.
macro_rules! run_columns {
    () => {
        "id, thread_id, owner, agent, status, input, metadata, limits, parent_run_id, root_run_id, depth, detached, \
    wake_at, claimed_from, step, forced, \
    result, error_kind, error_message, prompt_tokens, completion_tokens, attempts, crashes, lease_epoch, cancel_requested, \
    job_id, event_seq, created_at, started_at, finished_at, heartbeat_at, cost_nanos, retry_of, priority, inbox, agent_version, \
    cache_read_tokens, cache_write_tokens"
    };
}
