-- Hooks, permissions and approvals (docs/design.md, "Permissions"): the decision made for a
-- tool call is committed before the call runs, so a replay never asks again; an approval is
-- what a run parked on `ask` waits for; a grant lets a run tree skip asking again for a tool.
CREATE TABLE IF NOT EXISTS sa_tool_decisions (
    key         TEXT PRIMARY KEY,
    run_id      TEXT NOT NULL REFERENCES sa_runs(id),
    decision    TEXT NOT NULL,
    created_at  TEXT NOT NULL
);

CREATE TABLE IF NOT EXISTS sa_approvals (
    id               TEXT PRIMARY KEY,
    run_id           TEXT NOT NULL REFERENCES sa_runs(id),
    root_run_id      TEXT NOT NULL,
    owner            TEXT NOT NULL,
    call_key         TEXT NOT NULL UNIQUE,
    tool             TEXT NOT NULL,
    input            TEXT NOT NULL,
    reason           TEXT NOT NULL,
    status           TEXT NOT NULL,
    answer_reason    TEXT,
    resolved_by      TEXT,
    updated_input    TEXT,
    scope            TEXT,
    created_at       TEXT NOT NULL,
    expires_at       INTEGER NOT NULL,
    resolved_at      TEXT
);
CREATE INDEX IF NOT EXISTS sa_approvals_owner ON sa_approvals(owner, id);
CREATE INDEX IF NOT EXISTS sa_approvals_run ON sa_approvals(run_id);

CREATE TABLE IF NOT EXISTS sa_grants (
    root_run_id  TEXT NOT NULL,
    tool         TEXT NOT NULL,
    approval_id  TEXT NOT NULL,
    PRIMARY KEY (root_run_id, tool)
);
