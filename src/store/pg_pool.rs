//! Which pooled PostgreSQL connections are tested before use.
//!
//! sqlx pings a connection when it goes back to the pool (that cannot be turned off), and by
//! default tests it again when it is taken out. The second test was a round trip on the path of
//! every statement and, as a query, 46 % of the statements PostgreSQL ran in `subagents bench`.
//! A connection that passed its release ping a moment ago can only have died since by being
//! cut from outside: a restart, `pg_terminate_backend`, a proxy going away. Those cut the
//! store's listening connection too (`super::pg_ends::listen`, which sleeps on its socket and so
//! hears the cut at once), so the pool trusts a connection untested only while it idled less
//! than [`UNTESTED`] and since before the listener last heard a cut. Everything else is pinged
//! first, and a dead one is replaced before any caller meets it.
//!
//! What is left: a statement that takes a connection in the moment between a cut and the
//! listener hearing it (microseconds to milliseconds) fails as a statement in flight at the cut
//! fails; the callers already survive those (the committer commits again on a tested
//! connection, the relay and waiters retry, a run's step is retried by its lease). A cut of a
//! single idle connection the listener does not share (an administrator ending one backend)
//! fails that connection's next statement if it idled less than [`UNTESTED`].
//!
//! The test no longer asks whether the connection sits inside a transaction nobody holds (a
//! `BEGIN` whose caller was dropped before the answer): sqlx-postgres 0.9.1 rolls that back at
//! its source (transact-rs/sqlx#4394: the transaction's depth is claimed before the round trip,
//! so the drop guard queues the `ROLLBACK`, and the release ping sends it). A `BEGIN` sent as
//! raw SQL would still escape sqlx's count (transact-rs/sqlx#4409); this crate opens every
//! transaction with `begin()`, and so does apalis-postgres.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sqlx::postgres::PgPoolOptions;

/// How long a connection may idle in the pool and still be taken untested. Longer than any gap
/// between statements of a working process, far shorter than a server's idle timeouts.
pub const UNTESTED: Duration = Duration::from_secs(1);

/// Since when this process's listener has been hearing its database: connections that went
/// idle after that are trusted without a test (for [`UNTESTED`]). Deaf (the default) until a
/// listener says it listens, and again from the moment its connection drops until it listens
/// once more: a deaf store tests every connection, as sqlx does by default.
#[derive(Debug)]
pub struct Liveness {
    base: Instant,
    /// Microseconds after `base` since which the listener has heard every cut; [`DEAF`] while
    /// it hears none.
    trusted_since: AtomicU64,
    /// Cuts heard, for tests and logs.
    cuts: AtomicU64,
}

const DEAF: u64 = u64::MAX;

impl Default for Liveness {
    fn default() -> Self {
        Liveness {
            base: Instant::now(),
            trusted_since: AtomicU64::new(DEAF),
            cuts: AtomicU64::new(0),
        }
    }
}

impl Liveness {
    /// The listener listens (again): a connection released from now on was alive at its
    /// release ping and any later cut will be heard.
    pub(crate) fn listening(&self) {
        self.listening_at(self.base.elapsed());
    }

    fn listening_at(&self, now: Duration) {
        self.trusted_since
            .store(now.as_micros() as u64, Ordering::SeqCst);
    }

    /// The listener's connection dropped: every idle connection may be dead too.
    pub(crate) fn cut(&self) {
        self.deaf();
        self.cuts.fetch_add(1, Ordering::SeqCst);
    }

    /// Nobody listens any more (the listener stopped): every connection is tested.
    pub(crate) fn deaf(&self) {
        self.trusted_since.store(DEAF, Ordering::SeqCst);
    }

    /// How many cuts the listener has heard.
    pub fn cuts_heard(&self) -> u64 {
        self.cuts.load(Ordering::SeqCst)
    }

    /// Whether a connection idle for `idle_for` may be used without a test.
    pub(crate) fn trusts(&self, idle_for: Duration) -> bool {
        self.trusts_at(self.base.elapsed(), idle_for)
    }

    /// [`Liveness::trusts`] at `now` (after `base`).
    fn trusts_at(&self, now: Duration, idle_for: Duration) -> bool {
        if idle_for >= UNTESTED {
            return false;
        }
        let since = self.trusted_since.load(Ordering::SeqCst);
        let idle_since = now.saturating_sub(idle_for).as_micros() as u64;
        since != DEAF && idle_since > since
    }
}

/// The pool's options: a connection is pinged as it is taken out unless `liveness` trusts it
/// (see the module's comment). A connection that fails its ping is closed and another taken.
pub fn pool_options(liveness: Arc<Liveness>) -> PgPoolOptions {
    PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(30))
        .test_before_acquire(false)
        .before_acquire(move |conn, meta| {
            let liveness = liveness.clone();
            Box::pin(async move {
                if !liveness.trusts(meta.idle_for) {
                    sqlx::Connection::ping(conn).await?;
                }
                Ok(true)
            })
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_is_trusted_only_while_heard_and_released_since() {
        let ms = Duration::from_millis;
        let l = Liveness::default();
        assert!(!l.trusts_at(ms(10), ms(0)), "deaf until listening");
        l.listening_at(ms(10));
        assert!(l.trusts_at(ms(20), ms(5)), "released after listening");
        assert!(!l.trusts_at(ms(20), ms(15)), "released before listening");
        assert!(!l.trusts_at(ms(5000), UNTESTED), "idle too long");
        assert!(l.trusts_at(ms(5000), UNTESTED - ms(1)));
        l.cut();
        assert!(!l.trusts_at(ms(30), ms(0)), "deaf after a cut");
        assert_eq!(l.cuts_heard(), 1);
        l.listening_at(ms(40));
        assert!(!l.trusts_at(ms(45), ms(10)), "idle since before the cut");
        assert!(l.trusts_at(ms(45), ms(1)));
        l.deaf();
        assert!(!l.trusts_at(ms(50), ms(0)), "deaf once nobody listens");
        assert_eq!(l.cuts_heard(), 1, "going deaf is not a cut");
    }
}
