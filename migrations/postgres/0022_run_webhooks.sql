-- A run's own webhook (`webhook` on POST /v1/runs): a subscription scoped to that run.
ALTER TABLE sa_webhooks ADD COLUMN IF NOT EXISTS run_id TEXT;
CREATE INDEX IF NOT EXISTS sa_webhooks_run ON sa_webhooks (run_id) WHERE run_id IS NOT NULL;
