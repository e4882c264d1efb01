//! The budgets' Redis half: one atomic script per call, so a fleet shares a budget without a
//! database transaction. The database's half ([`crate::store::RateBudgets`]) counts the same
//! way while Redis is away.

use std::sync::LazyLock;

use crate::relay::{PREFIX, RedisEvents, RelayError};

/// A sliding-window budget (see `RateBudgets::take_budget`), atomically: KEYS[1] is the log (a
/// sorted set of calls scored by time, each member ending in its tokens), KEYS[2] the time
/// the provider said the budget is blocked until, KEYS[3] the time the last refused taker was
/// told to come back (see [`super::next_wake`]). ARGV: now, window (ms), most requests and
/// most tokens (0 = no limit), this call's tokens, a unique id. Returns 0 when taken, else
/// when to try again (ms since the epoch).
static TAKE: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new(
        r#"
local now = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
local blocked = tonumber(redis.call('GET', KEYS[2]) or '0')
if blocked > now then return blocked end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
local entries = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
local used = #entries / 2
local spent = 0
for i = 1, #entries, 2 do spent = spent + tonumber(string.match(entries[i], ':(%d+)$')) end
local oldest = 0
if used > 0 then oldest = tonumber(entries[2]) end
local max_req, max_tok, tokens = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
if (max_req > 0 and used + 1 > max_req) or (max_tok > 0 and used > 0 and spent + tokens > max_tok) then
  local per = max_req
  if per <= 0 then per = 100 end
  local slot = math.max(1, math.floor(window / per))
  local at = math.max(oldest + window + 1, tonumber(redis.call('GET', KEYS[3]) or '0') + slot)
  redis.call('SET', KEYS[3], at, 'PX', math.max(1, at - now) + window)
  return at
end
redis.call('ZADD', KEYS[1], now, ARGV[6] .. ':' .. ARGV[5])
redis.call('PEXPIRE', KEYS[1], window + 1000)
return 0
"#,
    )
});

/// Moves the block time of a budget later (never earlier), expiring with it.
static BLOCK: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new(
        r#"
local till = tonumber(ARGV[1])
local now = tonumber(ARGV[2])
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
if till > cur and till > now then redis.call('SET', KEYS[1], till, 'PX', till - now) end
return 1
"#,
    )
});

impl RedisEvents {
    /// Takes one call from the budget `key` held in Redis, as `RateBudgets::take_budget` does
    /// in the database: `None` when taken, else when to try again (ms since the epoch).
    pub async fn take_budget(
        &self,
        key: &str,
        window_ms: i64,
        max_requests: Option<u64>,
        max_tokens: Option<u64>,
        tokens: u64,
    ) -> Result<Option<i64>, RelayError> {
        let mut c = self.connection();
        let at: i64 = TAKE
            .key(format!("{PREFIX}:budget:{key}"))
            .key(format!("{PREFIX}:budget:{key}:blocked"))
            .key(format!("{PREFIX}:budget:{key}:next"))
            .arg(crate::store::now_ms())
            .arg(window_ms)
            .arg(max_requests.unwrap_or(0))
            .arg(max_tokens.unwrap_or(0))
            .arg(tokens)
            .arg(uuid::Uuid::now_v7().simple().to_string())
            .invoke_async(&mut c)
            .await?;
        Ok((at > 0).then_some(at))
    }

    /// Until when the budget `key` is blocked (Unix ms; 0: it is not).
    pub async fn budget_blocked_until(&self, key: &str) -> Result<i64, RelayError> {
        use redis::AsyncCommands;
        let mut c = self.connection();
        let v: Option<i64> = c.get(format!("{PREFIX}:budget:{key}:blocked")).await?;
        Ok(v.unwrap_or(0))
    }

    /// Nobody takes from the budget `key` until `until_ms` (the provider said so).
    pub async fn block_budget(&self, key: &str, until_ms: i64) -> Result<(), RelayError> {
        let mut c = self.connection();
        let _: i64 = BLOCK
            .key(format!("{PREFIX}:budget:{key}:blocked"))
            .arg(until_ms)
            .arg(crate::store::now_ms())
            .invoke_async(&mut c)
            .await?;
        Ok(())
    }
}
