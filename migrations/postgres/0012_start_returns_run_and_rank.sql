-- Starting a run answers with everything its caller reads next, in the same round trip: the
-- run's row (it was read back with a second query) and its owner's queued runs ahead of it
-- (a third: `RunLog::queue_rank`). Each statement a run makes costs the machine about as much
-- as a tenth of a step here, and a run of five steps made about twelve besides its steps.
-- `p_back`: the run joins its owner's queue at the back (a new root run) or the front (a
-- child, whose parent already had its turn); the count is `queue_rank`'s, read after the
-- insert (whose trigger counted the run) in the same transaction.
-- `sa_create_run` (0002, 0007) stays for binaries from before this migration during a rolling
-- upgrade, as a wrapper of this one (at the end); nothing here calls it.
CREATE OR REPLACE FUNCTION sa_start_run(
    p_id TEXT, p_thread TEXT, p_owner TEXT, p_agent TEXT, p_input TEXT, p_metadata TEXT,
    p_limits TEXT, p_parent TEXT, p_key TEXT, p_job TEXT, p_enqueued BIGINT, p_now TIMESTAMPTZ,
    p_root TEXT, p_depth BIGINT, p_detached BIGINT, p_reject BOOLEAN, p_event TEXT, p_retry_of TEXT,
    p_priority BIGINT, p_back BOOLEAN)
RETURNS TABLE (outcome TEXT, rid TEXT, ahead BIGINT, run sa_runs) LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_owner TEXT;
    v_id TEXT;
    v_run sa_runs;
    v_ahead BIGINT;
BEGIN
    INSERT INTO sa_threads (id, owner, created_at, updated_at) VALUES (p_thread, p_owner, p_now, p_now)
        ON CONFLICT (id) DO UPDATE SET updated_at = EXCLUDED.updated_at
        RETURNING sa_threads.owner INTO v_owner;
    IF v_owner <> p_owner THEN
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
    INSERT INTO sa_runs (id, thread_id, owner, agent, status, input, metadata, limits, parent_run_id,
        idempotency_key, job_id, enqueued_at, created_at, updated_at, event_seq, root_run_id, depth, detached, retry_of, priority)
        VALUES (p_id, p_thread, p_owner, p_agent, 'queued', p_input, p_metadata, p_limits, p_parent,
        p_key, p_job, p_enqueued, p_now, p_now, 1, p_root, p_depth, p_detached, p_retry_of, p_priority)
        RETURNING * INTO v_run;
    INSERT INTO sa_events (run_id, seq, type, data, created_at) VALUES (p_id, 1, 'run.queued', p_event, p_now);
    -- After the insert's trigger counted this run: at the back it does not count itself.
    SELECT COALESCE(SUM(d.queued), 0) - CASE WHEN p_back THEN 1 ELSE 0 END INTO v_ahead
        FROM sa_queue_depth d
        WHERE d.owner = p_owner AND (d.priority > p_priority OR (p_back AND d.priority = p_priority));
    RETURN QUERY SELECT 'created'::TEXT, p_id, GREATEST(v_ahead, 0), v_run;
END;
$$;

-- The old entry point, for binaries from before this migration during a rolling upgrade, now
-- goes through the new one, so a start's logic lives once. They pushed a child's job to the
-- front (`QueuePlace::Front`) and every other run's to the back, and read the rank themselves.
CREATE OR REPLACE FUNCTION sa_create_run(
    p_id TEXT, p_thread TEXT, p_owner TEXT, p_agent TEXT, p_input TEXT, p_metadata TEXT,
    p_limits TEXT, p_parent TEXT, p_key TEXT, p_job TEXT, p_enqueued BIGINT, p_now TIMESTAMPTZ,
    p_root TEXT, p_depth BIGINT, p_detached BIGINT, p_reject BOOLEAN, p_event TEXT, p_retry_of TEXT, p_priority BIGINT)
RETURNS TABLE (outcome TEXT, rid TEXT) LANGUAGE sql VOLATILE AS $$
    SELECT s.outcome, s.rid FROM sa_start_run(p_id, p_thread, p_owner, p_agent, p_input, p_metadata, p_limits,
        p_parent, p_key, p_job, p_enqueued, p_now, p_root, p_depth, p_detached, p_reject, p_event, p_retry_of,
        p_priority, p_parent IS NULL) s;
$$;
