//! Runs handed to a worker of this process directly, not through apalis's fetch: a start in
//! the same process ([`Local`]), or a job the queue's notification named
//! ([`super::notified`]).

use std::sync::Arc;

use super::{WorkerContext, serve};
use crate::engine::Executed;
use crate::ids::RunId;
use crate::store::{JobEnd, StoreError};

/// This process's queue workers as its own starts see them, so a run started here is handed
/// to a worker here at once: no notification, no fetch (on SQLite a write transaction of its
/// own), no task hand-offs between them. The start writes the run's job already locked to the
/// worker, as apalis's fetch would leave it, and the worker settles it as apalis's ack would
/// ([`crate::store::Claims::settle_held_job`]). Only a run next in line is handed over (no
/// other job waiting to be fetched, none of its owner's runs ahead): everything else keeps the
/// queue's order.
///
/// Runs handed over this way and runs apalis fetched share the process's `concurrency` slots,
/// so the two paths together never run more at once than configured. A crash loses nothing:
/// the job is locked to a worker whose heartbeat stops, and apalis's orphan recovery gives it
/// back to the queue like any job a dead worker fetched.
#[derive(Default)]
pub struct Local {
    current: std::sync::Mutex<Option<Arc<WorkerContext>>>,
}

/// A free slot of one of this process's queue workers, taken for a run about to start.
/// Dropping it unused frees the slot.
pub struct Reserved {
    ctx: Arc<WorkerContext>,
    slot: tokio::sync::OwnedSemaphorePermit,
}

impl Local {
    /// A free slot of the worker running now, unless there is none, no worker runs in this
    /// process, or it is shutting down.
    pub fn reserve(&self) -> Option<Reserved> {
        let ctx = self
            .current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()?;
        if ctx.shutdown.is_cancelled() {
            return None;
        }
        let slot = ctx.slots.clone().try_acquire_owned().ok()?;
        Some(Reserved { ctx, slot })
    }

    pub(super) fn set(&self, ctx: Option<Arc<WorkerContext>>) {
        *self.current.lock().unwrap_or_else(|e| e.into_inner()) = ctx;
    }
}

/// A parent's `task` offers its child to this process's workers through the layers below.
impl crate::runs::FreeSlots for Local {
    fn reserve(&self) -> Option<Box<dyn crate::runs::FreeSlot>> {
        Local::reserve(self).map(|r| Box::new(r) as Box<dyn crate::runs::FreeSlot>)
    }
}

impl crate::runs::FreeSlot for Reserved {
    fn worker(&self) -> &str {
        Reserved::worker(self)
    }

    fn run(self: Box<Self>, run_id: RunId, job_id: String) {
        Reserved::run(*self, run_id, job_id, Handed::Delegation)
    }
}

/// How a run reached a worker without apalis's fetch (the `via` of
/// `subagents_jobs_direct_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Handed {
    /// Started in this process ([`Local`]).
    Start,
    /// Started by a parent's `task` in this process ([`Local`]).
    Delegation,
    /// Named by the queue's notification (`super::notified`).
    Notification,
}

impl Handed {
    /// The metric's label.
    pub fn as_str(self) -> &'static str {
        match self {
            Handed::Start => "start",
            Handed::Delegation => "delegation",
            Handed::Notification => "notification",
        }
    }
}

impl Reserved {
    /// The queue worker the run's job is to be locked to ([`crate::domain::NewRun::held_by`]).
    pub fn worker(&self) -> &str {
        &self.ctx.name
    }

    /// Executes the run whose job the start locked to [`Reserved::worker`], in the slot, and
    /// settles the job: done, or back on the queue when the handling failed (as apalis retries
    /// a job whose handler failed).
    pub fn run(self, run_id: RunId, job_id: String, via: Handed) {
        self.spawn(run_id, job_id, via, None);
    }

    /// Takes the job a notification named and claims its run in one round trip
    /// ([`crate::store::Claims::take_and_claim`]), then executes the run in the slot as
    /// [`Reserved::run`] does. `Ok(false)` when the job was not this worker's to take (the
    /// slot is freed). On an error the job is given back to the queue, as a failed handling
    /// gives it back: the take may have committed before it (the claim after the take failed,
    /// or its answer did not read), and a job locked to a live worker is fetched by nobody.
    pub async fn take_and_run(self, job_id: String, via: Handed) -> Result<bool, StoreError> {
        let taken = match self
            .ctx
            .engine
            .take_and_claim(&job_id, &self.ctx.name)
            .await
        {
            Ok(Some(taken)) => taken,
            Ok(None) => return Ok(false),
            Err(e) => {
                // Nothing when the take did not commit: only a job locked to this worker moves.
                let store = self.ctx.engine.store.as_ref();
                if let Err(e) = store
                    .settle_held_job(&job_id, &self.ctx.name, JobEnd::Retry)
                    .await
                {
                    tracing::warn!(%job_id, error = %e, "could not give back a job whose take failed; the queue gives it back once this worker's heartbeat lapses");
                }
                return Err(e);
            }
        };
        tracing::debug!(run_id = %taken.run_id, %job_id, "took a job as it was queued");
        self.spawn(
            taken.run_id,
            job_id,
            via,
            Some((taken.claim, taken.context)),
        );
        Ok(true)
    }

    fn spawn(self, run_id: RunId, job_id: String, via: Handed, claimed: Option<super::Claimed>) {
        let Reserved { ctx, slot } = self;
        metrics::counter!("subagents_jobs_direct_total", "via" => via.as_str()).increment(1);
        tracing::debug!(%run_id, worker = %ctx.name, via = via.as_str(), "run handed to this process's worker");
        let tracker = ctx.in_flight.clone();
        tracker.spawn(async move {
            let served = serve(&ctx, run_id, claimed).await;
            drop(slot);
            let end = match served {
                // The run's end marked its job done in the same commit.
                Ok(Executed::Finished(ended)) if ended.job_done.as_deref() == Some(&job_id) => {
                    return;
                }
                Ok(_) => JobEnd::Done,
                Err(e) => {
                    tracing::warn!(%run_id, error = %e, "run failed in its worker; its job goes back on the queue");
                    JobEnd::Retry
                }
            };
            let store = ctx.engine.store.as_ref();
            match store.settle_held_job(&job_id, &ctx.name, end).await {
                Ok(()) if end == JobEnd::Retry => store.job_queued(),
                Ok(()) => {}
                Err(e) => tracing::warn!(
                    %run_id, error = %e,
                    "could not settle the run's job; the queue gives it back once this worker's heartbeat lapses"
                ),
            }
        });
    }
}
