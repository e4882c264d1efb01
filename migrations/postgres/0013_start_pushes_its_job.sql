-- A run's start also writes its first job to apalis's queue, in the same transaction: the run
-- and its job exist together or not at all (no run waits for the reaper because a push after
-- the start failed), and a start is one round trip and one commit instead of four round trips
-- and two commits (apalis pushes in a transaction of its own).
--
-- The job is what apalis's own push writes (`queries/task/sink.sql` of apalis-postgres):
-- `p_job_body` is the run id in apalis's JSON codec, the priority is `store::job_priority`
-- of the run's place in its owner's queue (the store suite checks the two agree). plpgsql,
-- so the body is not checked against apalis's table before apalis's migrations created it.
-- `sa_start_run` (0012) stays as it was, for binaries from before this migration.
CREATE OR REPLACE FUNCTION sa_start_run_with_job(
    p_id TEXT, p_thread TEXT, p_owner TEXT, p_agent TEXT, p_input TEXT, p_metadata TEXT,
    p_limits TEXT, p_parent TEXT, p_key TEXT, p_job TEXT, p_enqueued BIGINT, p_now TIMESTAMPTZ,
    p_root TEXT, p_depth BIGINT, p_detached BIGINT, p_reject BOOLEAN, p_event TEXT, p_retry_of TEXT,
    p_priority BIGINT, p_back BOOLEAN, p_job_type TEXT, p_job_body BYTEA, p_max_attempts INTEGER)
RETURNS TABLE (outcome TEXT, rid TEXT, ahead BIGINT, run sa_runs) LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    s RECORD;
BEGIN
    FOR s IN SELECT * FROM sa_start_run(p_id, p_thread, p_owner, p_agent, p_input, p_metadata, p_limits,
        p_parent, p_key, p_job, p_enqueued, p_now, p_root, p_depth, p_detached, p_reject, p_event,
        p_retry_of, p_priority, p_back) LOOP
        IF s.outcome = 'created' THEN
            INSERT INTO apalis.jobs (id, job_type, job, status, attempts, max_attempts, run_at, priority)
                VALUES (p_job, p_job_type, p_job_body, 'Pending', 0, p_max_attempts, now(),
                    (1000000000 - LEAST(s.ahead, 100000000) * 8 + LEAST(p_priority, 7))::INTEGER);
        END IF;
        outcome := s.outcome;
        rid := s.rid;
        ahead := s.ahead;
        run := s.run;
        RETURN NEXT;
    END LOOP;
END;
$$;
