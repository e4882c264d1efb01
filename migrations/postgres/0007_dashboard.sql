-- Cost and retries, the indexes the dashboard's overview reads through, and fair sharing:
-- run priorities and concurrency limits.
-- Cost is kept in nano-dollars (integer): sums stay exact on both backends.
ALTER TABLE sa_runs ADD COLUMN IF NOT EXISTS cost_nanos BIGINT NOT NULL DEFAULT 0;
-- A retry is a new run on the same thread, linked to the run it retries.
ALTER TABLE sa_runs ADD COLUMN IF NOT EXISTS retry_of TEXT;
CREATE INDEX IF NOT EXISTS sa_runs_finished ON sa_runs(finished_at);
CREATE INDEX IF NOT EXISTS sa_runs_owner_status ON sa_runs(owner, status);
-- Priority 1 (lowest) to 5 within an owner's runs.
ALTER TABLE sa_runs ADD COLUMN IF NOT EXISTS priority BIGINT NOT NULL DEFAULT 3;
-- Concurrency limits the claim enforces: `*` (every owner's default), `owner:<name>`,
-- `agent:<name>`. Written by the processes from their configuration.
CREATE TABLE IF NOT EXISTS sa_limits (
    key          TEXT PRIMARY KEY,
    concurrency  BIGINT NOT NULL
);

-- A model's shared budget blocked until this time (ms) because the provider said so
-- (x-ratelimit-remaining-*: 0, or 429s through every retry).
ALTER TABLE sa_rate_keys ADD COLUMN IF NOT EXISTS blocked_until BIGINT NOT NULL DEFAULT 0;

-- sa_create_run (0002) with the retry link: the old signature goes, so no caller can start a
-- run through it without saying whether it is a retry.
DROP FUNCTION IF EXISTS sa_create_run(TEXT, TEXT, TEXT, TEXT, TEXT, TEXT, TEXT, TEXT, TEXT, TEXT, BIGINT, TIMESTAMPTZ, TEXT, BIGINT, BIGINT, BOOLEAN, TEXT);
CREATE OR REPLACE FUNCTION sa_create_run(
    p_id TEXT, p_thread TEXT, p_owner TEXT, p_agent TEXT, p_input TEXT, p_metadata TEXT,
    p_limits TEXT, p_parent TEXT, p_key TEXT, p_job TEXT, p_enqueued BIGINT, p_now TIMESTAMPTZ,
    p_root TEXT, p_depth BIGINT, p_detached BIGINT, p_reject BOOLEAN, p_event TEXT, p_retry_of TEXT, p_priority BIGINT)
RETURNS TABLE (outcome TEXT, rid TEXT) LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_owner TEXT;
    v_id TEXT;
BEGIN
    INSERT INTO sa_threads (id, owner, created_at, updated_at) VALUES (p_thread, p_owner, p_now, p_now)
        ON CONFLICT (id) DO UPDATE SET updated_at = EXCLUDED.updated_at
        RETURNING sa_threads.owner INTO v_owner;
    IF v_owner <> p_owner THEN
        RETURN QUERY SELECT 'owned_elsewhere'::TEXT, NULL::TEXT;
        RETURN;
    END IF;
    IF p_key IS NOT NULL THEN
        SELECT r.id INTO v_id FROM sa_runs r WHERE r.owner = p_owner AND r.idempotency_key = p_key;
        IF FOUND THEN
            RETURN QUERY SELECT 'existing'::TEXT, v_id;
            RETURN;
        END IF;
    END IF;
    IF p_reject THEN
        SELECT r.id INTO v_id FROM sa_runs r
            WHERE r.thread_id = p_thread AND r.status IN ('queued', 'running', 'waiting') ORDER BY r.id LIMIT 1;
        IF FOUND THEN
            RETURN QUERY SELECT 'busy'::TEXT, v_id;
            RETURN;
        END IF;
    END IF;
    INSERT INTO sa_runs (id, thread_id, owner, agent, status, input, metadata, limits, parent_run_id,
        idempotency_key, job_id, enqueued_at, created_at, updated_at, event_seq, root_run_id, depth, detached, retry_of, priority)
        VALUES (p_id, p_thread, p_owner, p_agent, 'queued', p_input, p_metadata, p_limits, p_parent,
        p_key, p_job, p_enqueued, p_now, p_now, 1, p_root, p_depth, p_detached, p_retry_of, p_priority);
    INSERT INTO sa_events (run_id, seq, type, data, created_at) VALUES (p_id, 1, 'run.queued', p_event, p_now);
    RETURN QUERY SELECT 'created'::TEXT, p_id;
END;
$$;
