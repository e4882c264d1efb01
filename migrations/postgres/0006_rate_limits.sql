-- Model rate limits shared by the fleet (docs/design.md, "Rate limits"): a log of the model
-- calls of the last window per key (a model), and a row per key that serialises its takers.
CREATE TABLE IF NOT EXISTS sa_rate_keys (
    key      TEXT PRIMARY KEY,
    touched  BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS sa_rate_log (
    key     TEXT NOT NULL,
    at      BIGINT NOT NULL,
    tokens  BIGINT NOT NULL
);
CREATE INDEX IF NOT EXISTS sa_rate_log_key ON sa_rate_log(key, at);
