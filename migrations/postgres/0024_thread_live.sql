-- A thread's runs that are not over, by thread: what a claim, a start and the look for a
-- thread's next run ask ("is anything queued before this run, or active, on its thread?").
-- Without it those lookups could be answered from the status index (`status = 'queued'`), and
-- the planner took it whenever its statistics held few queued runs: a fresh database, or one
-- analyzed while idle. Under a burst each lookup then walked every queued run of every owner
-- (in `bench`: a bitmap AND of the status and thread indexes, 6 % of PostgreSQL's CPU, growing
-- with the backlog). The lookups name this index's predicate exactly, and test the one status
-- they want with `NOT IN`, which no index can answer (see `none_queued_before!`).
CREATE INDEX IF NOT EXISTS sa_runs_thread_live ON sa_runs (thread_id, id)
    WHERE status IN ('queued', 'running', 'waiting');
