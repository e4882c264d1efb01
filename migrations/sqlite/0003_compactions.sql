-- Compaction (docs/design.md, "Context"): a summary that stands in for a range of a thread's
-- messages when the context is rebuilt. The messages themselves stay; the newest compaction of a
-- thread is where a new context starts.
CREATE TABLE IF NOT EXISTS sa_compactions (
    id                INTEGER PRIMARY KEY AUTOINCREMENT,
    thread_id         TEXT NOT NULL REFERENCES sa_threads(id),
    run_id            TEXT NOT NULL REFERENCES sa_runs(id),
    key               TEXT NOT NULL UNIQUE,
    first_message_id  INTEGER NOT NULL,
    last_message_id   INTEGER NOT NULL,
    messages          INTEGER NOT NULL,
    summary           TEXT NOT NULL,
    tokens_before     INTEGER NOT NULL,
    tokens_after      INTEGER NOT NULL,
    reason            TEXT NOT NULL,
    created_at        TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS sa_compactions_thread ON sa_compactions(thread_id, id);
