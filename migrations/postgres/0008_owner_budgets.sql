-- Each owner's own model budget per minute (the keys file's rpm= and tpm=): written by the
-- server that reads the keys file, read by every worker before a model call.
CREATE TABLE IF NOT EXISTS sa_owner_budgets (
    owner TEXT PRIMARY KEY,
    rpm BIGINT,
    tpm BIGINT
);

-- When the last refused taker of a budget was told to come back: the next one is told a slot
-- later, so runs over budget wake one by one as it frees instead of all at once.
ALTER TABLE sa_rate_keys ADD COLUMN IF NOT EXISTS next_wake BIGINT NOT NULL DEFAULT 0;

-- Every checkpoint and lease renewal moves lease_expires_at; indexed, it made each of those
-- updates write a new entry into every index of sa_runs (no HOT update: 14 of 39,200 in a
-- benchmark). The reaper's scan of running runs needs only the status, and free room on each
-- page lets PostgreSQL update the row in place.
DROP INDEX IF EXISTS sa_runs_status;
CREATE INDEX IF NOT EXISTS sa_runs_status ON sa_runs (status);
ALTER TABLE sa_runs SET (fillfactor = 70);
