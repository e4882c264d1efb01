-- Messages sent to a run while it is queued, running or parked (`POST /v1/runs/{id}/messages`),
-- kept here until its next step boundary delivers them into its thread. `sa_runs.inbox` counts
-- the undelivered ones, so a claim, a lease renewal and a run's final commit see them without
-- another query.
ALTER TABLE sa_runs ADD COLUMN IF NOT EXISTS inbox BIGINT NOT NULL DEFAULT 0;

CREATE TABLE IF NOT EXISTS sa_inbox (
    n           BIGSERIAL PRIMARY KEY,
    id          TEXT NOT NULL UNIQUE,
    run_id      TEXT NOT NULL,
    content     TEXT NOT NULL,
    created_at  TIMESTAMPTZ NOT NULL
);
CREATE INDEX IF NOT EXISTS sa_inbox_run ON sa_inbox (run_id, n);
