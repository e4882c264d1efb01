-- What the providers' prompt caches served and stored, summed over each run's model calls
-- (prompt_tokens still counts the whole prompt).
ALTER TABLE sa_runs ADD COLUMN cache_read_tokens BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN cache_write_tokens BIGINT NOT NULL DEFAULT 0;
