-- A run's rank in its owner's queue (`queue_rank`, the order jobs are fetched in) counts only the
-- owner's queued runs ahead of it, in this index: a range of index entries instead of a read of
-- every queued run of the owner (with 10,000 queued: 7-11 ms a rank before, 0.2-2 ms after).
CREATE INDEX IF NOT EXISTS sa_runs_queued_rank ON sa_runs (owner, priority, id) WHERE status = 'queued';
