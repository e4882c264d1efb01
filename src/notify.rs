//! In-process wake-ups: "something about run X changed". Waiters (`wait` endpoints, SSE streams,
//! a run's heartbeat watching for cancel) sleep on a per-run [`Notify`] instead of polling; the
//! store fires it after every commit that touches the run. Writers in other processes are not
//! heard here, so waiters keep a slow fallback re-check (cross-process notifications over Redis
//! or LISTEN/NOTIFY are the scale-out backends' job).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::Notify;

use crate::ids::RunId;

/// The key under which "any run changed" waiters wait.
const ANY: RunId = RunId(uuid::Uuid::nil());

/// Per-run wake-up registry.
#[derive(Debug, Default)]
pub struct Notifier {
    runs: Mutex<HashMap<RunId, Weak<Notify>>>,
}

impl Notifier {
    /// The run's `Notify`; keep the `Arc` while waiting. Create the `notified()` future (and
    /// `enable()` it) *before* reading the state it guards, so no wake-up falls in between.
    pub fn subscribe(&self, run: RunId) -> Arc<Notify> {
        let mut map = self.runs.lock().unwrap();
        if let Some(n) = map.get(&run).and_then(Weak::upgrade) {
            return n;
        }
        if map.len() >= 1024 {
            map.retain(|_, w| w.strong_count() > 0);
        }
        let n = Arc::new(Notify::new());
        map.insert(run, Arc::downgrade(&n));
        n
    }

    /// Wakes everyone waiting on the run, and everyone waiting on any run.
    pub fn notify(&self, run: RunId) {
        let (n, all) = {
            let map = self.runs.lock().unwrap();
            (map.get(&run).and_then(Weak::upgrade), map.get(&ANY).and_then(Weak::upgrade))
        };
        if let Some(n) = n {
            n.notify_waiters();
        }
        if let Some(all) = all {
            all.notify_waiters();
        }
    }

    /// Wakes on a change to any run (the relay uses it to publish promptly).
    pub fn subscribe_all(&self) -> Arc<Notify> {
        self.subscribe(ANY)
    }
}
