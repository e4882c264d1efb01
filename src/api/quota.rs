//! Per-key caps on what one owner holds open on this server (SSE streams, waits) and keeps
//! queued: one key must not be able to take the server's connections, or the fleet's queue,
//! from everyone else. Past a cap the request is answered at once with 429 and a stable code.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::http::StatusCode;

use super::ApiError;
use crate::ids::OwnerId;

/// What is counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    /// An open SSE stream (a run's events, the overview).
    Stream,
    /// An open wait (`…/wait`).
    Wait,
}

/// The caps (0: none).
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Open streams per owner.
    pub streams: usize,
    /// Open waits per owner.
    pub waits: usize,
    /// Queued runs per owner a start may add to.
    pub queued: u64,
}

/// What every owner holds open now.
#[derive(Debug)]
pub struct Quotas {
    /// The caps.
    pub limits: Limits,
    held: Mutex<HashMap<(OwnerId, Kind), usize>>,
}

/// One stream or wait counted against its owner until it is dropped.
#[derive(Debug)]
pub struct Held {
    quotas: Arc<Quotas>,
    key: (OwnerId, Kind),
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut held = self.quotas.held.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = held.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.key);
            }
        }
    }
}

impl Quotas {
    /// Caps as given.
    pub fn new(limits: Limits) -> Arc<Quotas> {
        Arc::new(Quotas {
            limits,
            held: Mutex::default(),
        })
    }

    /// Counts one more `kind` for `owner`, or refuses it (429) when the owner is at its cap.
    pub fn take(self: &Arc<Self>, owner: &OwnerId, kind: Kind) -> Result<Held, ApiError> {
        let (cap, code, what) = match kind {
            Kind::Stream => (
                self.limits.streams,
                "too_many_streams",
                "open event streams (SUBAGENTS_MAX_STREAMS_PER_KEY)",
            ),
            Kind::Wait => (
                self.limits.waits,
                "too_many_waits",
                "open waits (SUBAGENTS_MAX_WAITS_PER_KEY)",
            ),
        };
        let key = (owner.to_owned(), kind);
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        let n = held.entry(key.clone()).or_default();
        if cap > 0 && *n >= cap {
            return Err(ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                code,
                format!("this key already holds {cap} {what}; close one first"),
            ));
        }
        *n += 1;
        Ok(Held {
            quotas: self.clone(),
            key,
        })
    }

    /// How many of `kind` `owner` holds now.
    pub fn held(&self, owner: &OwnerId, kind: Kind) -> usize {
        self.held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&(owner.clone(), kind))
            .copied()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cap_refuses_the_next_one_and_a_drop_frees_a_place() {
        let q = Quotas::new(Limits {
            streams: 2,
            waits: 0,
            queued: 0,
        });
        let a = q.take(&"alice".into(), Kind::Stream).unwrap();
        let _b = q.take(&"alice".into(), Kind::Stream).unwrap();
        let e = q.take(&"alice".into(), Kind::Stream).unwrap_err();
        assert_eq!(
            (e.status, e.code),
            (StatusCode::TOO_MANY_REQUESTS, "too_many_streams")
        );
        // Another owner, and another kind without a cap, are not affected.
        let _c = q.take(&"bob".into(), Kind::Stream).unwrap();
        let _w: Vec<Held> = (0..100)
            .map(|_| q.take(&"alice".into(), Kind::Wait).unwrap())
            .collect();
        drop(a);
        assert_eq!(q.held(&"alice".into(), Kind::Stream), 1);
        let _d = q.take(&"alice".into(), Kind::Stream).unwrap();
    }
}
