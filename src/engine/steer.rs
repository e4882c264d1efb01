//! Messages sent to a run while it works ([`crate::store::Inbox`]): when they reach the model.
//!
//! A message commits at once, and its run hears of it three ways: its claim reads the run's
//! `inbox` count, its lease renewal reports it (at once in the process that took the message,
//! within a second elsewhere), and a final answer's commit is refused while one waits. It is
//! delivered at the next step boundary, before a model call, never between a step's tool calls:
//!
//! - before a step's model call, every waiting message goes into the thread (one commit, with
//!   `message.delivered`), so that call is the first to carry it;
//! - a final answer that meets a waiting message is not final: it commits as an ordinary
//!   assistant turn and the model is asked again, with the message after it;
//! - a delegation call parked on children is answered at once with where they stand, so the
//!   model hears the message without waiting for them (it can wait again, or cancel them).
//!
//! A forced answer (a step or token limit) still ends the run: the limit wins, and messages
//! still waiting then are not delivered.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use serde_json::json;

use super::attempt::Attempt;
use super::{End, Engine, Flow};
use crate::delegation::Wait;
use crate::store::StoreError;

/// Something the next step boundary must act on, raised from outside the loop (its claim, its
/// lease renewals): messages to deliver, or an interrupt.
#[derive(Clone, Debug, Default)]
pub(super) struct Flag(Arc<AtomicBool>);

impl Flag {
    /// A flag that starts raised when `waiting`.
    pub fn new(waiting: bool) -> Self {
        Self(Arc::new(AtomicBool::new(waiting)))
    }

    /// Raises it.
    pub fn raise(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    /// Whether it is raised, without lowering it.
    pub fn waiting(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }

    /// Whether it was raised; lowered, so only what arrives after this raises it again.
    pub fn take(&self) -> bool {
        self.0.swap(false, Ordering::SeqCst)
    }
}

/// What the attempt hears from outside its loop, for its step boundaries.
pub(super) struct Heard {
    /// Messages wait.
    pub inbox: Flag,
    /// End the run as cancelled at the next boundary.
    pub interrupt: Flag,
}

/// The result a delegation call parked on children gets when a message arrives: the model
/// reads the message next, and may wait for the same children again.
pub(super) fn interrupted_wait(wait: &Wait) -> String {
    json!({
        "status": "still_running",
        "run_ids": wait.on,
        "note": "A message from the user arrived while this call waited; it follows these results. \
                 The subagents above are still running: call subagent_await with their run_ids to \
                 wait for them again, or subagent_cancel to stop them.",
    })
    .to_string()
}

impl Engine {
    /// Delivers the messages waiting for the run into its thread as part of `step`.
    pub(super) async fn deliver(&self, a: &mut Attempt<'_>, step: u32) -> Flow {
        let fp = &self.settings.failpoints;
        fp.hit("before_message_delivery").await;
        let delivered = self.store.deliver_messages(a.lease, step).await?;
        if !delivered.is_empty() {
            tracing::info!(step, messages = delivered.len(), "messages delivered");
            metrics::counter!("subagents_messages_delivered_total")
                .increment(delivered.len() as u64);
        }
        for m in delivered {
            a.remember(m);
        }
        fp.hit("after_message_delivery").await;
        Ok(())
    }

    /// After a final answer's commit was refused: whether that was a message waiting (the
    /// lease still ours), rather than a lost lease.
    pub(super) async fn refused_for_messages(&self, a: &Attempt<'_>) -> Flow<bool> {
        match self.store.renew_lease(a.lease).await {
            Ok(st) => {
                if st.messages_waiting {
                    a.inbox.raise();
                }
                Ok(st.messages_waiting)
            }
            Err(StoreError::LeaseLost(_)) => Err(End::LeaseLost),
            Err(e) => Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flag_is_taken_once_per_raise() {
        let m = Flag::new(true);
        assert!(m.waiting());
        assert!(m.take());
        assert!(!m.take());
        m.raise();
        assert!(m.clone().take(), "clones share the flag");
        assert!(!m.waiting());
    }

    #[test]
    fn an_interrupted_wait_names_the_children_still_running() {
        let run = crate::ids::RunId::new();
        let text = interrupted_wait(&Wait {
            on: vec![run],
            ..Wait::default()
        });
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["status"], "still_running");
        assert_eq!(v["run_ids"][0], run.to_string());
    }
}
