-- Schedules: agent runs on a clock. `next_fire_at` is the next tick not fired yet (ms since the
-- epoch); a pass fires what is due and moves it forward with a compare-and-set, and each tick's
-- run has the idempotency key `schedule:<id>:<tick>`, so a tick fired twice starts one run.
CREATE TABLE sa_schedules (
    id            TEXT PRIMARY KEY,
    owner         TEXT NOT NULL,
    cron          TEXT NOT NULL,
    timezone      TEXT NOT NULL,
    agent         TEXT NOT NULL,
    input         TEXT NOT NULL,
    -- NULL: a new thread each time.
    thread_id     TEXT,
    overlap       TEXT NOT NULL,
    catch_up      TEXT NOT NULL,
    paused        INTEGER NOT NULL DEFAULT 0,
    metadata      TEXT NOT NULL,
    priority      INTEGER NOT NULL,
    next_fire_at  INTEGER NOT NULL,
    created_at    TEXT NOT NULL,
    updated_at    TEXT NOT NULL
);
CREATE INDEX sa_schedules_owner ON sa_schedules (owner, created_at);
CREATE INDEX sa_schedules_due ON sa_schedules (next_fire_at) WHERE paused = 0;

-- Which run each fired tick started.
CREATE TABLE sa_schedule_runs (
    schedule_id  TEXT NOT NULL,
    tick         INTEGER NOT NULL,
    run_id       TEXT NOT NULL,
    PRIMARY KEY (schedule_id, tick)
);
CREATE INDEX sa_schedule_runs_run ON sa_schedule_runs (run_id);
