-- Pinning, the rest of what a run's behaviour depends on: each value a run fixed at its first
-- claim (the settings file's version, the model and its provider, the version of each MCP
-- server's tool list), one row per name, never changed once written; and the text of each such
-- version (a settings file, a tool list), kept once by its content hash.
CREATE TABLE IF NOT EXISTS sa_run_pins (
    run_id      TEXT NOT NULL,
    name        TEXT NOT NULL,
    value       TEXT NOT NULL,
    PRIMARY KEY (run_id, name)
);

CREATE TABLE IF NOT EXISTS sa_pinned_texts (
    version     TEXT PRIMARY KEY,
    text        TEXT NOT NULL,
    created_at  TIMESTAMPTZ NOT NULL
);
