//! The pure half of the fleet's rate budgets, kept below the store because the store's own
//! count ([`crate::store::RateBudgets`]) uses it: an owner's budget, and when a refused taker may
//! come back. The rest is [`crate::budget`].

/// An owner's own model budget per window (a minute): calls and prompt tokens, either may be
/// unlimited.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OwnerBudget {
    /// Model calls.
    pub rpm: Option<u64>,
    /// Prompt tokens.
    pub tpm: Option<u64>,
}

/// When a taker refused by a budget should try again: when the oldest call leaves the window
/// (`free_at`), or a slot's share of the window (`window / max_requests`, a hundredth without
/// a request limit) after the time the last refused taker was given, whichever is later. Runs
/// over budget so wake one by one as it frees, instead of all at once with all but one parking
/// again.
pub fn next_wake(free_at: i64, last_given: i64, window_ms: i64, max_requests: Option<u64>) -> i64 {
    let slot = (window_ms / max_requests.unwrap_or(100).clamp(1, i64::MAX as u64) as i64).max(1);
    free_at.max(last_given.saturating_add(slot))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refused_takers_get_one_slot_each() {
        // 40 calls per 5 s: a slot is 125 ms. The first refused taker comes back when the
        // oldest call leaves; the next ones a slot apart.
        let first = next_wake(10_000, 0, 5_000, Some(40));
        assert_eq!(first, 10_000);
        let second = next_wake(10_000, first, 5_000, Some(40));
        assert_eq!(second, 10_125);
        assert_eq!(next_wake(10_000, second, 5_000, Some(40)), 10_250);
        // Once the schedule is behind, the oldest call's leaving is what counts again.
        assert_eq!(next_wake(20_000, second, 5_000, Some(40)), 20_000);
        // Tokens only: a hundredth of the window.
        assert_eq!(next_wake(0, 1_000, 5_000, None), 1_050);
        assert!(next_wake(0, i64::MAX, 5_000, Some(0)) == i64::MAX);
    }
}
