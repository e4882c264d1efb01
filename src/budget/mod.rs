//! The fleet's shared model budgets: per model (`SUBAGENTS_MODEL_LIMITS`) and per owner (the
//! keys file's `rpm=`/`tpm=`), each a sliding window of calls and prompt tokens. They live in
//! Redis when it is configured (one atomic script per call, no database transaction), else in
//! the database. When Redis fails (or does not answer within half a second), the database
//! keeps the count for the next few seconds, then Redis is tried again: for that time the two
//! halves of the fleet may each spend a full window, which is the price of not stopping (or
//! slowing) every model call during an outage.
//!
//! In this crate "budget" means only this: what a rate window still allows. A run's own limits
//! (steps, tokens, wall time; a tree's totals) are limits, and what fits a model's context is
//! its window ([`crate::engine::Window`]). The whole of it is here: the admission of a call
//! ([`Budgets::admit`]), the Redis half (`redis.rs`), the scheduling of refused takers
//! ([`next_wake`]), and the owners' budgets; the database's half is the store's
//! [`crate::store::RateBudgets`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::ids::OwnerId;
use crate::relay::RedisEvents;

pub use crate::domain::rate::{OwnerBudget, next_wake};
use crate::store::{RunLog, StoreError};

mod redis;

/// How long an owner's budget, as the keys file set it, is trusted before it is read again.
const OWNER_TTL: Duration = Duration::from_secs(5);

/// How long a model's shared block (the provider's word) is trusted before it is read again,
/// for models without a configured limit (they take nothing from a budget, so nothing else
/// reads the block for them).
const BLOCK_TTL: Duration = Duration::from_millis(200);

/// Longest a budget call waits for Redis before the database counts instead.
const REDIS_WAIT: Duration = Duration::from_millis(500);

/// After Redis failed, how long the database keeps the count before Redis is tried again (so
/// an outage does not slow every model call by a failed attempt).
pub const REDIS_BACKOFF: Duration = Duration::from_secs(5);

/// Model rate limits: by model, at most `requests` calls and `tokens` prompt tokens per `window`.
#[derive(Clone, Debug, Default)]
pub struct RateLimits {
    /// Limits by model name.
    pub by_model: crate::config::ModelLimits,
    /// The window (a minute; tests shorten it).
    pub window: Duration,
}

/// Whether a model call may go now.
#[derive(Debug, PartialEq, Eq)]
pub enum Admission {
    /// It took its share of every budget that applies.
    Go,
    /// A budget is used up: wait until `until` (Unix ms).
    Wait {
        /// When to try again.
        until: i64,
        /// The provider said so (its headers or a 429), rather than a configured limit.
        provider: bool,
    },
}

/// Where budgets are taken from.
pub struct Budgets {
    store: Arc<dyn RunLog>,
    redis: Option<RedisEvents>,
    owners: Mutex<HashMap<String, (Instant, Option<OwnerBudget>)>>,
    /// Until when Redis is left alone after a failure.
    redis_down_until: Mutex<Option<Instant>>,
    /// Blocks read (or set) lately, by key: when read, and until when.
    blocks: Mutex<HashMap<String, (Instant, i64)>>,
    /// Budget calls Redis failed (or did not answer in time) since start.
    redis_failures: std::sync::atomic::AtomicU64,
}

impl Budgets {
    /// Budgets in Redis when `redis` is given, else in `store`.
    pub fn new(store: Arc<dyn RunLog>, redis: Option<RedisEvents>) -> Self {
        Budgets {
            store,
            redis,
            owners: Mutex::new(HashMap::new()),
            redis_down_until: Mutex::new(None),
            blocks: Mutex::new(HashMap::new()),
            redis_failures: Default::default(),
        }
    }

    /// Redis, unless it failed a moment ago.
    fn redis(&self) -> Option<&RedisEvents> {
        let down = self
            .redis_down_until
            .lock()
            .unwrap()
            .is_some_and(|t| Instant::now() < t);
        if down { None } else { self.redis.as_ref() }
    }

    /// How many budget calls Redis failed in this process: during an outage, one per
    /// [`REDIS_BACKOFF`], not one per model call (also `subagents_budget_redis_failures_total`).
    pub fn redis_failures(&self) -> u64 {
        self.redis_failures
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    fn redis_failed(&self, key: &str, error: &dyn std::fmt::Display) {
        self.redis_failures
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        metrics::counter!("subagents_budget_redis_failures_total").increment(1);
        tracing::warn!(%error, key, "Redis holds no budget now; the database counts for the next {}s", REDIS_BACKOFF.as_secs());
        *self.redis_down_until.lock().unwrap() = Some(Instant::now() + REDIS_BACKOFF);
    }

    /// `op` on Redis, unless it failed a moment ago; `None` (and Redis left alone for a while)
    /// when it fails or does not answer in time: the caller then asks the database.
    async fn in_redis<T, Fut>(&self, key: &str, op: impl FnOnce(RedisEvents) -> Fut) -> Option<T>
    where
        Fut: Future<Output = Result<T, crate::relay::RelayError>>,
    {
        let r = self.redis()?.clone();
        match tokio::time::timeout(REDIS_WAIT, op(r)).await {
            Ok(Ok(v)) => Some(v),
            Ok(Err(e)) => {
                self.redis_failed(key, &e);
                None
            }
            Err(_) => {
                self.redis_failed(key, &"no answer in time");
                None
            }
        }
    }

    /// Takes one call of `tokens` prompt tokens from the budget `key`: `None` when taken, else
    /// when to try again (ms since the epoch).
    pub async fn take(
        &self,
        key: &str,
        window_ms: i64,
        max_requests: Option<u64>,
        max_tokens: Option<u64>,
        tokens: u64,
    ) -> Result<Option<i64>, StoreError> {
        if let Some(at) = self
            .in_redis(key, |r| async move {
                r.take_budget(key, window_ms, max_requests, max_tokens, tokens)
                    .await
            })
            .await
        {
            return Ok(at);
        }
        self.store
            .take_budget(key, window_ms, max_requests, max_tokens, tokens)
            .await
    }

    /// Until when `key` is blocked, if it is now (the provider said so, here or in another
    /// process; read at most every 200 ms per key).
    pub async fn blocked(&self, key: &str) -> Result<Option<i64>, StoreError> {
        let now = crate::store::now_ms();
        let cached = self
            .blocks
            .lock()
            .unwrap()
            .get(key)
            .filter(|(at, _)| at.elapsed() < BLOCK_TTL)
            .map(|(_, until)| *until);
        let until = match cached {
            Some(u) => u,
            None => {
                let u = match self
                    .in_redis(key, |r| async move { r.budget_blocked_until(key).await })
                    .await
                {
                    Some(v) => v,
                    None => self.store.budget_blocked_until(key).await?,
                };
                let mut blocks = self.blocks.lock().unwrap();
                if blocks.len() > 10_000 {
                    blocks.clear();
                }
                blocks.insert(key.to_owned(), (Instant::now(), u));
                u
            }
        };
        Ok((until > now).then_some(until))
    }

    /// Nobody takes from `key` until `until_ms` (the provider said its budget is used up).
    pub async fn block(&self, key: &str, until_ms: i64) -> Result<(), StoreError> {
        {
            let mut blocks = self.blocks.lock().unwrap();
            let e = blocks.entry(key.to_owned()).or_insert((Instant::now(), 0));
            *e = (Instant::now(), e.1.max(until_ms));
        }
        if self
            .in_redis(key, |r| async move { r.block_budget(key, until_ms).await })
            .await
            .is_some()
        {
            return Ok(());
        }
        self.store.block_budget(key, until_ms).await
    }

    /// Takes one call of `model` for `owner` from every budget that applies: the owner's first
    /// (a call the owner may not make takes nothing from the model's), then the model's
    /// configured limit. A model with no configured limit takes from no budget, but the
    /// provider's word (its rate-limit headers, a 429) still holds the whole fleet back.
    /// `estimate` (the call's prompt tokens) is only counted when a budget applies.
    pub async fn admit(
        &self,
        limits: &RateLimits,
        owner: &OwnerId,
        model: &str,
        estimate: impl FnOnce() -> u64,
    ) -> Result<Admission, StoreError> {
        let model_limit = limits.by_model.get(model).copied();
        let owner_limit = self.owner(owner).await?;
        if model_limit.is_some() || owner_limit.is_some() {
            let window = counted_window_ms(limits.window);
            let estimate = estimate();
            if let Some(o) = owner_limit
                && let Some(until) = self
                    .take(&format!("owner:{owner}"), window, o.rpm, o.tpm, estimate)
                    .await?
            {
                return Ok(Admission::Wait {
                    until,
                    provider: false,
                });
            }
            if let Some((requests, tokens)) = model_limit
                && let Some(until) = self
                    .take(
                        &format!("model:{model}"),
                        window,
                        requests,
                        tokens,
                        estimate,
                    )
                    .await?
            {
                return Ok(Admission::Wait {
                    until,
                    provider: false,
                });
            }
        }
        if model_limit.is_none()
            && let Some(until) = self.blocked(&format!("model:{model}")).await?
        {
            let noise = uuid::Uuid::new_v4().as_u128();
            return Ok(Admission::Wait {
                until: spread_wake(until, crate::store::now_ms(), noise),
                provider: true,
            });
        }
        Ok(Admission::Go)
    }

    /// The owner's own budget from the keys file, if it sets one (read at most every
    /// few seconds).
    pub async fn owner(&self, owner: &OwnerId) -> Result<Option<OwnerBudget>, StoreError> {
        if let Some((at, b)) = self.owners.lock().unwrap().get(owner.as_str())
            && at.elapsed() < OWNER_TTL
        {
            return Ok(*b);
        }
        let b = self.store.owner_budget(owner).await?;
        let mut owners = self.owners.lock().unwrap();
        if owners.len() > 10_000 {
            owners.clear();
        }
        owners.insert(owner.to_string(), (Instant::now(), b));
        Ok(b)
    }
}

/// When a run parked on the provider's reset (`until`, Unix ms) wakes: spread over a quarter
/// of the wait after it (at most a second), so the parked runs do not all call at once.
/// `noise` is any random number.
pub fn spread_wake(until: i64, now: i64, noise: u128) -> i64 {
    let spread = ((until - now) / 4).clamp(1, 1000) as u128;
    until + (noise % spread) as i64
}

/// How long a call counts against a rate window of `window`: a call counts from when it is
/// taken here, the provider counts it from when it arrives, so a margin keeps the two windows
/// from disagreeing at the edges.
pub fn counted_window_ms(window: Duration) -> i64 {
    let window = window.as_millis().min(i64::MAX as u128 / 2) as i64;
    window + window / 10 + 100
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wake_ups_after_a_reset_spread_over_at_most_a_second() {
        let until = 10_000;
        for noise in [0, 1, 999, 12_345, u128::MAX] {
            let at = spread_wake(until, 0, noise);
            assert!((until..until + 1000).contains(&at), "{at}");
        }
        // A reset already due still wakes at it, not before.
        assert_eq!(spread_wake(until, until + 50, 77), until);
        assert_eq!(counted_window_ms(Duration::from_secs(60)), 66_100);
    }
}
