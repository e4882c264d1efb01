//! Live model deltas in one process: the text and tool-argument fragments of a step in flight,
//! handed from the worker that streams them to the SSE clients of the same process that asked
//! for them (`GET /v1/runs/{id}/events?include=deltas`). Across processes they travel through
//! Redis instead ([`crate::relay`]).
//!
//! Ephemeral by design: nothing is kept, a client that is not listening misses them, and the
//! step's durable `model.completed` carries the whole answer. Publishing costs one map lookup
//! when nobody listens to the run.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use serde_json::Value;
use tokio::sync::broadcast;

use crate::ids::RunId;

/// Fragments a slow listener may fall behind by before it skips ahead (it is told nothing:
/// the durable events still tell the whole answer).
const BACKLOG: usize = 1024;

/// One run's live deltas: a broadcast channel per run someone listens to.
#[derive(Default)]
pub struct DeltaHub {
    runs: Mutex<HashMap<RunId, broadcast::Sender<Arc<Value>>>>,
}

impl DeltaHub {
    /// Starts listening to `run`'s deltas.
    pub fn subscribe(&self, run: RunId) -> broadcast::Receiver<Arc<Value>> {
        let mut runs = self.runs.lock().unwrap();
        runs.retain(|_, tx| tx.receiver_count() > 0);
        runs.entry(run)
            .or_insert_with(|| broadcast::channel(BACKLOG).0)
            .subscribe()
    }

    /// `run`'s deltas from now on, as a stream (it never ends by itself: drop it). A slow
    /// reader skips ahead: the durable events still carry the whole answer.
    pub fn stream(&self, run: RunId) -> impl futures::Stream<Item = Arc<Value>> + Send + use<> {
        futures::stream::unfold(self.subscribe(run), |mut rx| async move {
            loop {
                match rx.recv().await {
                    Ok(v) => return Some((v, rx)),
                    Err(broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(broadcast::error::RecvError::Closed) => return None,
                }
            }
        })
    }

    /// Whether anyone in this process listens to `run` (publishing is free otherwise).
    pub fn listened(&self, run: RunId) -> bool {
        self.runs
            .lock()
            .unwrap()
            .get(&run)
            .is_some_and(|tx| tx.receiver_count() > 0)
    }

    /// Hands a delta (a `model.delta` event's data) to `run`'s listeners.
    pub fn publish(&self, run: RunId, data: Value) {
        let runs = self.runs.lock().unwrap();
        if let Some(tx) = runs.get(&run) {
            let _ = tx.send(Arc::new(data));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn listeners_of_a_run_get_its_deltas_and_nobody_keeps_them() {
        let hub = DeltaHub::default();
        let (a, b) = (RunId::new(), RunId::new());
        hub.publish(a, serde_json::json!({"text": "lost"}));
        assert!(!hub.listened(a));
        let mut rx = hub.subscribe(a);
        assert!(hub.listened(a) && !hub.listened(b));
        hub.publish(b, serde_json::json!({"text": "other"}));
        hub.publish(a, serde_json::json!({"text": "hi"}));
        assert_eq!(rx.recv().await.unwrap()["text"], "hi");
        drop(rx);
        assert!(!hub.listened(a));
    }
}
