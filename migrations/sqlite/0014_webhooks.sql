-- Webhooks: each owner's subscriptions, the events waiting to be turned into deliveries (written
-- by a trigger in the same transaction as the event, so a committed event is never missed),
-- and the deliveries with their attempts.
CREATE TABLE sa_webhooks (
    id                TEXT PRIMARY KEY,
    owner             TEXT NOT NULL,
    url               TEXT NOT NULL,
    -- JSON array of event types, or ["*"].
    events            TEXT NOT NULL,
    -- JSON array of agent names; NULL: every agent.
    agents            TEXT,
    description       TEXT NOT NULL DEFAULT '',
    secret            TEXT NOT NULL,
    -- The secret before the last rotation, valid until old_secret_until (ms since the epoch).
    old_secret        TEXT,
    old_secret_until  INTEGER,
    -- Why deliveries to it stopped (NULL: they go).
    paused_reason     TEXT,
    -- Deliveries that went dead since its last success.
    dead_in_row       INTEGER NOT NULL DEFAULT 0,
    created_at        TEXT NOT NULL,
    updated_at        TEXT NOT NULL
);
CREATE INDEX sa_webhooks_owner ON sa_webhooks (owner, created_at);

CREATE TABLE sa_webhook_queue (
    run_id  TEXT NOT NULL,
    seq     INTEGER NOT NULL,
    PRIMARY KEY (run_id, seq)
);

-- Only the event types a subscription can name, and only once any subscription exists.
CREATE TRIGGER sa_webhook_enqueue AFTER INSERT ON sa_events
    WHEN NEW.type IN ('run.started', 'run.succeeded', 'run.failed', 'run.cancelled',
                      'approval.requested', 'approval.resolved')
        AND EXISTS (SELECT 1 FROM sa_webhooks)
BEGIN
    INSERT OR IGNORE INTO sa_webhook_queue (run_id, seq) VALUES (NEW.run_id, NEW.seq);
END;

CREATE TABLE sa_webhook_deliveries (
    id               TEXT PRIMARY KEY,
    webhook_id       TEXT NOT NULL,
    event_type       TEXT NOT NULL,
    run_id           TEXT,
    -- The body every attempt sends.
    body             TEXT NOT NULL,
    -- pending | delivered | failed (retrying) | dead
    status           TEXT NOT NULL,
    attempts         INTEGER NOT NULL DEFAULT 0,
    next_attempt_at  INTEGER NOT NULL,
    locked_until     INTEGER NOT NULL DEFAULT 0,
    -- Retries stop this long after it (ms since the epoch): the first attempt, or a redelivery.
    window_start     INTEGER NOT NULL,
    last_status      INTEGER,
    last_error       TEXT,
    last_body        TEXT,
    created_at       TEXT NOT NULL,
    updated_at       TEXT NOT NULL
);
CREATE INDEX sa_webhook_deliveries_due ON sa_webhook_deliveries (next_attempt_at)
    WHERE status IN ('pending', 'failed');
CREATE INDEX sa_webhook_deliveries_by_hook ON sa_webhook_deliveries (webhook_id, created_at, id);
