-- Each owner's own model budget per minute (the keys file's rpm= and tpm=): written by the
-- server that reads the keys file, read by every worker before a model call.
CREATE TABLE IF NOT EXISTS sa_owner_budgets (
    owner TEXT PRIMARY KEY,
    rpm BIGINT,
    tpm BIGINT
);

-- When the last refused taker of a budget was told to come back: the next one is told a slot
-- later, so runs over budget wake one by one as it frees instead of all at once.
ALTER TABLE sa_rate_keys ADD COLUMN next_wake INTEGER NOT NULL DEFAULT 0;

-- Every checkpoint and lease renewal moves lease_expires_at: indexed, each of those updates
-- also rewrote an index entry. The reaper's scan of running runs needs only the status.
DROP INDEX IF EXISTS sa_runs_status;
CREATE INDEX IF NOT EXISTS sa_runs_status ON sa_runs (status);
