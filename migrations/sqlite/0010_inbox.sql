-- Messages sent to a run while it is queued, running or parked (`POST /v1/runs/{id}/messages`),
-- kept here until its next step boundary delivers them into its thread. `sa_runs.inbox` counts
-- the undelivered ones, so a claim, a lease renewal and a run's final commit see them without
-- another query.
ALTER TABLE sa_runs ADD COLUMN inbox INTEGER NOT NULL DEFAULT 0;

CREATE TABLE sa_inbox (
    n           INTEGER PRIMARY KEY AUTOINCREMENT,
    id          TEXT NOT NULL UNIQUE,
    run_id      TEXT NOT NULL,
    content     TEXT NOT NULL,
    created_at  TEXT NOT NULL
);
CREATE INDEX sa_inbox_run ON sa_inbox (run_id, n);
