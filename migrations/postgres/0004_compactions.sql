-- Compaction (docs/design.md, "Context"): a summary that stands in for a range of a thread's
-- messages when the context is rebuilt. The messages themselves stay; the newest compaction of a
-- thread is where a new context starts.
CREATE TABLE IF NOT EXISTS sa_compactions (
    id                BIGSERIAL PRIMARY KEY,
    thread_id         TEXT NOT NULL REFERENCES sa_threads(id),
    run_id            TEXT NOT NULL REFERENCES sa_runs(id),
    key               TEXT NOT NULL UNIQUE,
    first_message_id  BIGINT NOT NULL,
    last_message_id   BIGINT NOT NULL,
    messages          BIGINT NOT NULL,
    summary           TEXT NOT NULL,
    tokens_before     BIGINT NOT NULL,
    tokens_after      BIGINT NOT NULL,
    reason            TEXT NOT NULL,
    created_at        TIMESTAMPTZ NOT NULL
);
CREATE INDEX IF NOT EXISTS sa_compactions_thread ON sa_compactions(thread_id, id);
