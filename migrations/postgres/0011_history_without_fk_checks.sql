-- The history tables (messages and events) lose their foreign keys; the other tables keep
-- theirs. Every row of them is written by a statement that first locks and updates its run
-- (the fenced checkpoint's CTEs insert `FROM` the fence's returned rows; other event writes
-- follow a fenced update or the run's insert in the same transaction), so a row for a run or
-- thread that does not exist cannot be written; runs are never deleted. Yet the checks cost:
-- a run of five steps writes 36 such rows, each checked by a trigger and a `FOR KEY SHARE`
-- read of its run. perf under `bench --concurrency 64`: the checks were about a tenth of
-- PostgreSQL's CPU; without them the bench ran 1,707-1,760 steps/s against 1,560-1,587.
-- `store::a_stale_epoch_cannot_write` checks that a write under a lease of a run that does
-- not exist leaves nothing.
ALTER TABLE sa_messages DROP CONSTRAINT IF EXISTS sa_messages_thread_id_fkey;
ALTER TABLE sa_messages DROP CONSTRAINT IF EXISTS sa_messages_run_id_fkey;
ALTER TABLE sa_events DROP CONSTRAINT IF EXISTS sa_events_run_id_fkey;
