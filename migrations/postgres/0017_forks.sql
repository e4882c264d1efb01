-- Forked threads share their history with the thread they were forked from instead of copying
-- it: `sa_thread_lineage` lists, for a forked thread, every thread its history comes from and
-- the last message of that thread it includes (flattened: a fork of a fork lists both).
ALTER TABLE sa_threads ADD COLUMN IF NOT EXISTS forked_from TEXT;
ALTER TABLE sa_threads ADD COLUMN IF NOT EXISTS forked_at BIGINT;
CREATE INDEX IF NOT EXISTS sa_threads_forked_from ON sa_threads (forked_from);

CREATE TABLE IF NOT EXISTS sa_thread_lineage (
    thread    TEXT NOT NULL,
    ancestor  TEXT NOT NULL,
    upto      BIGINT NOT NULL,
    PRIMARY KEY (thread, ancestor)
);
