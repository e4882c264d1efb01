-- How many runs each owner has queued, per priority, kept by triggers on every change of a
-- run's status. A new run's place in its owner's queue (the job's fetch order) is read from
-- here in O(1); counting the queued runs themselves cost O(the owner's backlog) per enqueue
-- (4.9 ms a call with 10,000 queued), and any index over queued rows also pays for the dead
-- entries of every run that passed through the queue.
-- Each owner and priority is counted in 16 stripes (a run is counted in the stripe its id
-- hashes to), so concurrent enqueues and claims of one owner do not queue up on one row's lock
-- until their commits: the count is the stripes' sum (a stripe alone may go negative).
CREATE TABLE IF NOT EXISTS sa_queue_depth (
    owner    TEXT NOT NULL,
    priority BIGINT NOT NULL,
    stripe   INTEGER NOT NULL DEFAULT 0,
    queued   BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (owner, priority, stripe)
);

CREATE OR REPLACE FUNCTION sa_queue_depth_track() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP <> 'INSERT' AND OLD.status = 'queued' THEN
        INSERT INTO sa_queue_depth (owner, priority, stripe, queued) VALUES (OLD.owner, OLD.priority, hashtext(OLD.id) & 15, -1)
            ON CONFLICT (owner, priority, stripe) DO UPDATE SET queued = sa_queue_depth.queued - 1;
    END IF;
    IF TG_OP <> 'DELETE' AND NEW.status = 'queued' THEN
        INSERT INTO sa_queue_depth (owner, priority, stripe, queued) VALUES (NEW.owner, NEW.priority, hashtext(NEW.id) & 15, 1)
            ON CONFLICT (owner, priority, stripe) DO UPDATE SET queued = sa_queue_depth.queued + 1;
    END IF;
    RETURN NULL;
END $$;

DROP TRIGGER IF EXISTS sa_queue_depth_insert ON sa_runs;
CREATE TRIGGER sa_queue_depth_insert AFTER INSERT ON sa_runs
    FOR EACH ROW WHEN (NEW.status = 'queued') EXECUTE FUNCTION sa_queue_depth_track();
-- Only a change into or out of `queued` calls the function: checkpoints and lease renewals
-- (which never change the status) pay nothing but the WHEN test.
DROP TRIGGER IF EXISTS sa_queue_depth_update ON sa_runs;
CREATE TRIGGER sa_queue_depth_update AFTER UPDATE ON sa_runs
    FOR EACH ROW WHEN ((OLD.status = 'queued' OR NEW.status = 'queued')
        AND (OLD.status, OLD.owner, OLD.priority) IS DISTINCT FROM (NEW.status, NEW.owner, NEW.priority))
    EXECUTE FUNCTION sa_queue_depth_track();
DROP TRIGGER IF EXISTS sa_queue_depth_delete ON sa_runs;
CREATE TRIGGER sa_queue_depth_delete AFTER DELETE ON sa_runs
    FOR EACH ROW WHEN (OLD.status = 'queued') EXECUTE FUNCTION sa_queue_depth_track();

-- The runs queued before this migration (after the triggers: creating them locks out
-- writers until this migration commits, so no change falls between the count and them).
DELETE FROM sa_queue_depth;
INSERT INTO sa_queue_depth (owner, priority, stripe, queued)
    SELECT owner, priority, 0, COUNT(*) FROM sa_runs WHERE status = 'queued' GROUP BY owner, priority;
