-- Pinning: the agent definition version a run started with, and each version's file text,
-- kept once, so a run's later claims (and its children of the same agent) run that version even
-- after the file changed or was deleted.
ALTER TABLE sa_runs ADD COLUMN agent_version TEXT;

CREATE TABLE sa_agent_versions (
    version     TEXT PRIMARY KEY,
    agent       TEXT NOT NULL,
    text        TEXT NOT NULL,
    created_at  TEXT NOT NULL
);
