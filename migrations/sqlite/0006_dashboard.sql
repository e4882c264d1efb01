-- Cost and retries, the indexes the dashboard's overview reads through, and fair sharing:
-- run priorities and concurrency limits.
-- Cost is kept in nano-dollars (integer): sums stay exact on both backends.
ALTER TABLE sa_runs ADD COLUMN cost_nanos INTEGER NOT NULL DEFAULT 0;
-- A retry is a new run on the same thread, linked to the run it retries.
ALTER TABLE sa_runs ADD COLUMN retry_of TEXT;
-- Runs finished in the last hour (throughput), without scanning every finished run.
CREATE INDEX IF NOT EXISTS sa_runs_finished ON sa_runs(finished_at);
-- Runs by status per owner (the overview's counts).
CREATE INDEX IF NOT EXISTS sa_runs_owner_status ON sa_runs(owner, status);
-- Priority 1 (lowest) to 5 within an owner's runs.
ALTER TABLE sa_runs ADD COLUMN priority INTEGER NOT NULL DEFAULT 3;
-- Concurrency limits the claim enforces: `*` (every owner's default), `owner:<name>`,
-- `agent:<name>`. Written by the processes from their configuration.
CREATE TABLE IF NOT EXISTS sa_limits (
    key          TEXT PRIMARY KEY,
    concurrency  INTEGER NOT NULL
);
-- A model's shared budget blocked until this time (ms) because the provider said so
-- (x-ratelimit-remaining-*: 0, or 429s through every retry).
ALTER TABLE sa_rate_keys ADD COLUMN blocked_until INTEGER NOT NULL DEFAULT 0;
