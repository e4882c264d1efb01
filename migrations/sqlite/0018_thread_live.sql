-- A thread's runs that are not over, by thread (see migrations/postgres/0024): a claim's and a
-- start's look at the thread never walks the queued runs of every owner through the status
-- index. SQLite uses a partial index only when the query repeats its WHERE term word for word,
-- as `none_queued_before!` does.
CREATE INDEX IF NOT EXISTS sa_runs_thread_live ON sa_runs (thread_id, id)
    WHERE status IN ('queued', 'running', 'waiting');
