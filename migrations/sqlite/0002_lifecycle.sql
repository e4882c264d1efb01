-- The run state machine (src/lifecycle.rs): crashes (expired leases) are counted apart from
-- claims, and a parked run records what it waits on, so whoever ends one of those wakes it.
ALTER TABLE sa_runs ADD COLUMN crashes INTEGER NOT NULL DEFAULT 0;

CREATE TABLE IF NOT EXISTS sa_run_waits (
    waiter  TEXT NOT NULL,
    target  TEXT NOT NULL,
    PRIMARY KEY (waiter, target)
);
CREATE INDEX IF NOT EXISTS sa_run_waits_target ON sa_run_waits(target);
CREATE INDEX IF NOT EXISTS sa_runs_due ON sa_runs(status, wake_at);
