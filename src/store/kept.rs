//! A few connections a store keeps aside between the short statements on a run's path (its
//! start, its claim, the read of its context, the look for its thread's next run), so those
//! statements skip the pool's way back.
//!
//! sqlx pings every connection that goes back to its pool, and that cannot be turned off: on
//! PostgreSQL a `Sync` round trip that wakes the backend once more after each statement. With
//! the acquire test gone (`pg_pool`), that ping was one round trip in two of a run's own
//! statements. A connection whose statement just succeeded sits at `ReadyForQuery`: there is
//! nothing to flush, so a [`Kept`] that is told so ([`Kept::keep`]) goes back on the keeper's
//! stack untested instead.
//!
//! Everything else goes the pool's way: a statement that failed, or a future dropped halfway
//! (a caller gave up), drops its connection into the pool, whose release ping flushes it or
//! closes it. A connection taken from the stack is trusted by the same rule as the pool's own
//! (`pg_pool::Liveness`: idle under a second, since before no cut was heard), else pinged, and
//! closed when the ping fails.
//!
//! The stack holds a handful: connections on it are out of the pool, so it stays a small part
//! of the pool and a taker with an empty stack simply takes from the pool.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::{Database, Pool};

/// Whether a connection idle for the given time may be used without a ping.
type Trust = Arc<dyn Fn(Duration) -> bool + Send + Sync>;

/// The stack of kept connections of one store.
pub(crate) struct Keeper<DB: Database> {
    pool: Pool<DB>,
    idle: Mutex<Vec<(PoolConnection<DB>, Instant)>>,
    room: usize,
    trust: Trust,
}

impl<DB: Database> std::fmt::Debug for Keeper<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keeper")
            .field("room", &self.room)
            .finish_non_exhaustive()
    }
}

impl<DB: Database> Keeper<DB> {
    /// Keeps up to `room` connections of `pool`, trusted untested while `trust` says so.
    pub(crate) fn new(pool: Pool<DB>, room: usize, trust: Trust) -> Arc<Self> {
        Arc::new(Keeper {
            pool,
            idle: Mutex::new(Vec::with_capacity(room)),
            room,
            trust,
        })
    }

    /// A connection for one statement: the newest kept one (the one most likely alive and
    /// warm), else one from the pool.
    pub(crate) async fn take(self: &Arc<Self>) -> Result<Kept<DB>, sqlx::Error> {
        loop {
            let top = self.idle.lock().expect("kept connections").pop();
            let Some((mut conn, since)) = top else {
                return Ok(Kept {
                    conn: Some(self.pool.acquire().await?),
                    home: Some(self.clone()),
                });
            };
            if (self.trust)(since.elapsed()) || sqlx::Connection::ping(&mut *conn).await.is_ok() {
                return Ok(Kept {
                    conn: Some(conn),
                    home: Some(self.clone()),
                });
            }
            conn.close_on_drop();
        }
    }

    fn put(&self, conn: PoolConnection<DB>) {
        let mut idle = self.idle.lock().expect("kept connections");
        if idle.len() < self.room {
            idle.push((conn, Instant::now()));
        }
        // Else it drops, back into the pool.
    }

    /// How many connections sit on the stack now.
    #[cfg(test)]
    pub(crate) fn idle(&self) -> usize {
        self.idle.lock().expect("kept connections").len()
    }
}

/// One statement's connection. Dropped, it goes back to the pool (tested there); [`Kept::keep`]
/// after a statement that succeeded puts it back on its keeper's stack untested.
pub(crate) struct Kept<DB: Database> {
    conn: Option<PoolConnection<DB>>,
    home: Option<Arc<Keeper<DB>>>,
}

impl<DB: Database> Kept<DB> {
    /// A pooled connection with no keeper: it always goes back to the pool.
    pub(crate) fn pooled(conn: PoolConnection<DB>) -> Self {
        Kept {
            conn: Some(conn),
            home: None,
        }
    }

    /// The statement on it succeeded: keep it for the next one.
    pub(crate) fn keep(mut self) {
        if let (Some(home), Some(conn)) = (self.home.take(), self.conn.take()) {
            home.put(conn);
        }
    }
}

impl<DB: Database> std::ops::Deref for Kept<DB> {
    type Target = DB::Connection;
    fn deref(&self) -> &DB::Connection {
        self.conn.as_ref().expect("a kept connection until kept")
    }
}

impl<DB: Database> std::ops::DerefMut for Kept<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        self.conn.as_mut().expect("a kept connection until kept")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only a connection told so goes back on the stack, never more than its room; one dropped
    /// (a failed statement, a caller that gave up) goes back to the pool; an untrusted one is
    /// pinged before use.
    #[tokio::test]
    async fn only_connections_kept_after_success_are_kept_and_within_room() {
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(4)
            .connect("sqlite::memory:")
            .await
            .unwrap();
        let trusted = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let trust = trusted.clone();
        let keeper = Keeper::new(
            pool.clone(),
            2,
            Arc::new(move |_| trust.load(std::sync::atomic::Ordering::SeqCst)),
        );
        let mut taken = vec![];
        for _ in 0..3 {
            taken.push(keeper.take().await.unwrap());
        }
        assert_eq!(pool.size() - pool.num_idle() as u32, 3, "three in use");
        for mut conn in taken {
            sqlx::query("SELECT 1").execute(&mut *conn).await.unwrap();
            conn.keep();
        }
        assert_eq!(keeper.idle(), 2, "kept within its room");
        // The third went back to the pool (after its release ping).
        tokio::time::timeout(Duration::from_secs(10), async {
            while pool.num_idle() < 1 {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the one over the room went back to the pool");
        // Dropped without `keep`: back to the pool, not to the stack.
        let conn = keeper.take().await.unwrap();
        assert_eq!(keeper.idle(), 1);
        drop(conn);
        assert_eq!(keeper.idle(), 1, "a dropped connection is not kept");
        // Untrusted: pinged, still handed out when alive, and kept again after use.
        trusted.store(false, std::sync::atomic::Ordering::SeqCst);
        let mut conn = keeper.take().await.unwrap();
        assert_eq!(keeper.idle(), 0);
        sqlx::query("SELECT 1").execute(&mut *conn).await.unwrap();
        conn.keep();
        assert_eq!(keeper.idle(), 1);
        // A plain pooled one has no keeper.
        let conn = Kept::pooled(pool.acquire().await.unwrap());
        conn.keep();
        assert_eq!(keeper.idle(), 1);
    }
}
