-- How many runs each owner has queued, per priority, kept by triggers on every change of a
-- run's status. A new run's place in its owner's queue (the job's fetch order) is read from
-- here in O(1) instead of counting the owner's queued runs on every enqueue.
CREATE TABLE IF NOT EXISTS sa_queue_depth (
    owner    TEXT NOT NULL,
    priority INTEGER NOT NULL,
    queued   INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (owner, priority)
);

CREATE TRIGGER IF NOT EXISTS sa_queue_depth_insert AFTER INSERT ON sa_runs
WHEN NEW.status = 'queued'
BEGIN
    INSERT INTO sa_queue_depth (owner, priority, queued) VALUES (NEW.owner, NEW.priority, 1)
        ON CONFLICT (owner, priority) DO UPDATE SET queued = queued + 1;
END;

-- Only a change into or out of `queued` does anything: checkpoints and lease renewals pay
-- nothing but the WHEN test.
CREATE TRIGGER IF NOT EXISTS sa_queue_depth_update AFTER UPDATE ON sa_runs
WHEN (OLD.status = 'queued' OR NEW.status = 'queued')
    AND (OLD.status IS NOT NEW.status OR OLD.owner IS NOT NEW.owner OR OLD.priority IS NOT NEW.priority)
BEGIN
    UPDATE sa_queue_depth SET queued = queued - 1
        WHERE OLD.status = 'queued' AND owner = OLD.owner AND priority = OLD.priority;
    INSERT INTO sa_queue_depth (owner, priority, queued) SELECT NEW.owner, NEW.priority, 1
        WHERE NEW.status = 'queued'
        ON CONFLICT (owner, priority) DO UPDATE SET queued = queued + 1;
END;

CREATE TRIGGER IF NOT EXISTS sa_queue_depth_delete AFTER DELETE ON sa_runs
WHEN OLD.status = 'queued'
BEGIN
    UPDATE sa_queue_depth SET queued = queued - 1 WHERE owner = OLD.owner AND priority = OLD.priority;
END;

-- The runs queued before this migration.
DELETE FROM sa_queue_depth;
INSERT INTO sa_queue_depth (owner, priority, queued)
    SELECT owner, priority, COUNT(*) FROM sa_runs WHERE status = 'queued' GROUP BY owner, priority;
