-- A refused start writes nothing, as on SQLite. 0018's start upserted the thread before its
-- checks, so a start refused for a busy thread or answered with a keyed run moved the thread's
-- `updated_at`, a start naming another owner's thread moved that owner's thread, and a keyed
-- replay naming a new thread created it. Now the thread's row is only locked (`FOR UPDATE`, the
-- lock that lines up the starts of one thread, as the upsert's was) for the checks, and written
-- once they pass: a new thread inserted, an existing one's last start moved. Two starts creating
-- one new thread at once: the second's insert finds the first's row (after waiting for its
-- commit) and goes round again, now with that row locked and checked. Same arguments as 0018's,
-- so every binary that calls 0018's calls this one.
CREATE OR REPLACE FUNCTION sa_start_run_with_job(
    p_id TEXT, p_thread TEXT, p_owner TEXT, p_agent TEXT, p_input TEXT, p_metadata TEXT,
    p_limits TEXT, p_parent TEXT, p_key TEXT, p_job TEXT, p_enqueued BIGINT, p_now TIMESTAMPTZ,
    p_root TEXT, p_depth BIGINT, p_detached BIGINT, p_reject BOOLEAN, p_event TEXT, p_retry_of TEXT,
    p_priority BIGINT, p_back BOOLEAN, p_job_type TEXT, p_job_body BYTEA, p_max_attempts INTEGER,
    p_relayed BIGINT, p_agent_version TEXT)
RETURNS TABLE (outcome TEXT, rid TEXT, ahead BIGINT, run sa_runs) LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_owner TEXT;
    v_id TEXT;
    v_run sa_runs;
    v_ahead BIGINT;
BEGIN
    LOOP
        SELECT t.owner INTO v_owner FROM sa_threads t WHERE t.id = p_thread FOR UPDATE;
        IF FOUND AND v_owner <> p_owner THEN
            RETURN QUERY SELECT 'owned_elsewhere'::TEXT, NULL::TEXT, 0::BIGINT, NULL::sa_runs;
            RETURN;
        END IF;
        IF p_key IS NOT NULL THEN
            SELECT r.* INTO v_run FROM sa_runs r WHERE r.owner = p_owner AND r.idempotency_key = p_key;
            IF FOUND THEN
                RETURN QUERY SELECT 'existing'::TEXT, v_run.id, 0::BIGINT, v_run;
                RETURN;
            END IF;
        END IF;
        IF p_reject THEN
            SELECT r.id INTO v_id FROM sa_runs r
                WHERE r.thread_id = p_thread AND r.status IN ('queued', 'running', 'waiting') ORDER BY r.id LIMIT 1;
            IF FOUND THEN
                RETURN QUERY SELECT 'busy'::TEXT, v_id, 0::BIGINT, NULL::sa_runs;
                RETURN;
            END IF;
        END IF;
        IF v_owner IS NOT NULL THEN
            UPDATE sa_threads SET updated_at = p_now WHERE id = p_thread;
            EXIT;
        END IF;
        INSERT INTO sa_threads (id, owner, created_at, updated_at) VALUES (p_thread, p_owner, p_now, p_now)
            ON CONFLICT (id) DO NOTHING;
        EXIT WHEN FOUND;
    END LOOP;
    INSERT INTO sa_runs (id, thread_id, owner, agent, status, input, metadata, limits, parent_run_id,
        idempotency_key, job_id, enqueued_at, created_at, updated_at, event_seq, root_run_id, depth, detached, retry_of, priority, agent_version)
        VALUES (p_id, p_thread, p_owner, p_agent, 'queued', p_input, p_metadata, p_limits, p_parent,
        p_key, p_job, p_enqueued, p_now, p_now, 1, p_root, p_depth, p_detached, p_retry_of, p_priority, p_agent_version)
        RETURNING * INTO v_run;
    INSERT INTO sa_events (run_id, seq, type, data, created_at, relayed) VALUES (p_id, 1, 'run.queued', p_event, p_now, p_relayed);
    -- After the insert's trigger counted this run: at the back it does not count itself.
    SELECT GREATEST(COALESCE(SUM(d.queued), 0) - CASE WHEN p_back THEN 1 ELSE 0 END, 0) INTO v_ahead
        FROM sa_queue_depth d
        WHERE d.owner = p_owner AND (d.priority > p_priority OR (p_back AND d.priority = p_priority));
    INSERT INTO apalis.jobs (id, job_type, job, status, attempts, max_attempts, run_at, priority)
        VALUES (p_job, p_job_type, p_job_body, 'Pending', 0, p_max_attempts, now(),
            (1000000000 - LEAST(v_ahead, 100000000) * 8 + LEAST(p_priority, 7))::INTEGER);
    RETURN QUERY SELECT 'created'::TEXT, p_id, v_ahead, v_run;
END;
$$;
