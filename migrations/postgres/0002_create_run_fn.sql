-- Starting a run in one round trip. The steps must run in this order, each seeing the latest
-- committed state (which every statement of a volatile PL/pgSQL function does under READ
-- COMMITTED): lock the thread row (upsert), check its owner, the idempotency key, whether the
-- thread is busy, then insert the run and its `run.queued` event.
CREATE OR REPLACE FUNCTION sa_create_run(
    p_id TEXT, p_thread TEXT, p_owner TEXT, p_agent TEXT, p_input TEXT, p_metadata TEXT,
    p_limits TEXT, p_parent TEXT, p_key TEXT, p_job TEXT, p_enqueued BIGINT, p_now TIMESTAMPTZ,
    p_root TEXT, p_depth BIGINT, p_detached BIGINT, p_reject BOOLEAN, p_event TEXT)
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
        idempotency_key, job_id, enqueued_at, created_at, updated_at, event_seq, root_run_id, depth, detached)
        VALUES (p_id, p_thread, p_owner, p_agent, 'queued', p_input, p_metadata, p_limits, p_parent,
        p_key, p_job, p_enqueued, p_now, p_now, 1, p_root, p_depth, p_detached);
    INSERT INTO sa_events (run_id, seq, type, data, created_at) VALUES (p_id, 1, 'run.queued', p_event, p_now);
    RETURN QUERY SELECT 'created'::TEXT, p_id;
END;
$$;
