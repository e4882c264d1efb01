-- subagents schema, SQLite. Timestamps are RFC 3339 text; lease deadlines are Unix milliseconds.

CREATE TABLE IF NOT EXISTS sa_threads (
    id          TEXT PRIMARY KEY,
    owner       TEXT NOT NULL,
    created_at  TEXT NOT NULL,
    updated_at  TEXT NOT NULL
);

CREATE TABLE IF NOT EXISTS sa_runs (
    id                TEXT PRIMARY KEY,
    thread_id         TEXT NOT NULL REFERENCES sa_threads(id),
    owner             TEXT NOT NULL,
    agent             TEXT NOT NULL,
    status            TEXT NOT NULL CHECK (status IN ('queued','running','waiting','succeeded','failed','cancelled')),
    input             TEXT NOT NULL,
    metadata          TEXT NOT NULL DEFAULT '{}',
    limits            TEXT NOT NULL,
    parent_run_id     TEXT,
    root_run_id       TEXT,
    depth             INTEGER NOT NULL DEFAULT 0,
    detached          INTEGER NOT NULL DEFAULT 0,
    wake_at           INTEGER,
    claimed_from      TEXT,
    step              INTEGER NOT NULL DEFAULT 0,
    forced            INTEGER NOT NULL DEFAULT 0,
    result            TEXT,
    error_kind        TEXT,
    error_message     TEXT,
    prompt_tokens     INTEGER NOT NULL DEFAULT 0,
    completion_tokens INTEGER NOT NULL DEFAULT 0,
    attempts          INTEGER NOT NULL DEFAULT 0,
    lease_owner       TEXT,
    lease_epoch       INTEGER NOT NULL DEFAULT 0,
    lease_expires_at  INTEGER NOT NULL DEFAULT 0,
    cancel_requested  INTEGER NOT NULL DEFAULT 0,
    event_seq         INTEGER NOT NULL DEFAULT 0,
    idempotency_key   TEXT,
    job_id            TEXT NOT NULL,
    enqueued_at       INTEGER NOT NULL,
    created_at        TEXT NOT NULL,
    started_at        TEXT,
    finished_at       TEXT,
    heartbeat_at      TEXT,
    updated_at        TEXT NOT NULL
);

-- Invariant 4: one active (executing or parked) run per thread, enforced by the database.
-- Runs enqueued behind it wait as `queued` and are claimed in order once the thread is free.
CREATE UNIQUE INDEX IF NOT EXISTS sa_runs_one_active_per_thread
    ON sa_runs(thread_id) WHERE status IN ('running','waiting');
CREATE UNIQUE INDEX IF NOT EXISTS sa_runs_idempotency
    ON sa_runs(owner, idempotency_key) WHERE idempotency_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS sa_runs_owner ON sa_runs(owner, id);
CREATE INDEX IF NOT EXISTS sa_runs_thread ON sa_runs(thread_id, created_at);
CREATE INDEX IF NOT EXISTS sa_runs_status ON sa_runs(status, lease_expires_at);
CREATE INDEX IF NOT EXISTS sa_runs_parent ON sa_runs(parent_run_id);

-- Deadlines of parked awaits, fixed at the first attempt so a replay waits for the same end.
CREATE TABLE IF NOT EXISTS sa_waits (
    key         TEXT PRIMARY KEY,
    deadline    INTEGER NOT NULL
);

-- The checkpointed conversation: append-only, idempotent by key.
CREATE TABLE IF NOT EXISTS sa_messages (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    thread_id   TEXT NOT NULL REFERENCES sa_threads(id),
    run_id      TEXT NOT NULL REFERENCES sa_runs(id),
    step        INTEGER NOT NULL,
    role        TEXT NOT NULL,
    key         TEXT NOT NULL UNIQUE,
    body        TEXT NOT NULL,
    created_at  TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS sa_messages_thread ON sa_messages(thread_id, id);
CREATE INDEX IF NOT EXISTS sa_messages_run ON sa_messages(run_id, id);

-- The outbox: durable events, seq gap-free per run.
CREATE TABLE IF NOT EXISTS sa_events (
    run_id      TEXT NOT NULL REFERENCES sa_runs(id),
    seq         INTEGER NOT NULL,
    type        TEXT NOT NULL,
    data        TEXT NOT NULL,
    created_at  TEXT NOT NULL,
    relayed     INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (run_id, seq)
);
CREATE INDEX IF NOT EXISTS sa_events_unrelayed ON sa_events(run_id, seq) WHERE relayed = 0;
