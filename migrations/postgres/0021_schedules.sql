-- Schedules: agent runs on a clock. `next_fire_at` is the next tick not fired yet (ms since the
-- epoch); a pass fires what is due and moves it forward with a compare-and-set, and each tick's
-- run has the idempotency key `schedule:<id>:<tick>`, so a tick fired twice starts one run.
CREATE TABLE IF NOT EXISTS sa_schedules (
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
    paused        BIGINT NOT NULL DEFAULT 0,
    metadata      TEXT NOT NULL,
    priority      BIGINT NOT NULL,
    next_fire_at  BIGINT NOT NULL,
    created_at    TIMESTAMPTZ NOT NULL,
    updated_at    TIMESTAMPTZ NOT NULL
);
CREATE INDEX IF NOT EXISTS sa_schedules_owner ON sa_schedules (owner, created_at);
CREATE INDEX IF NOT EXISTS sa_schedules_due ON sa_schedules (next_fire_at) WHERE paused = 0;

-- Which run each fired tick started.
CREATE TABLE IF NOT EXISTS sa_schedule_runs (
    schedule_id  TEXT NOT NULL,
    tick         BIGINT NOT NULL,
    run_id       TEXT NOT NULL,
    PRIMARY KEY (schedule_id, tick)
);
CREATE INDEX IF NOT EXISTS sa_schedule_runs_run ON sa_schedule_runs (run_id);
