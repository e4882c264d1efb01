//! The engine: one run's step loop, as a planner, decisions and an executor. The planner
//! ([`plan`]) is a pure function of the run's committed messages and [`decide`] holds the rules
//! the limits impose (compact, force the answer, park, fail); the executor ([`attempt`]) does the
//! I/O (the model call, the tools, the commits) and asks again after each commit. So a fresh
//! start and a resume after a crash are the same code path ("replay, don't redo"):
//!
//! - an assistant message with tool calls commits before any tool runs;
//! - each tool result commits as soon as its tool returns, with the same idempotency key on a
//!   replay; a call with a committed result is never run again;
//! - a committed model response is never requested again;
//! - every write is fenced by the run's lease epoch; a lost lease stops the loop at once.
//!
//! How an attempt ends is one value, [`End`], whether the loop reached it (a final answer, a
//! park, a failure) or something stopped it from outside (a cancel, the wall-time limit, a
//! drain, a lost lease); [`Engine::execute`] turns it into the run's commits. Limits (steps,
//! tokens, wall time, tool time, tool output) all end in a defined outcome.

mod attempt;
mod call;
pub mod compaction;
pub mod decide;
mod gate;
mod pins;
pub mod plan;
mod steer;
mod tool_calls;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info_span};

use crate::agents::AgentDef;
pub use crate::budget::RateLimits;
use crate::delegation::{DelegationSettings, Wait};
use crate::domain::event;
use crate::domain::{ErrorKind, Event, Finish, RunError, RunRecord};
use crate::failpoints::Failpoints;
use crate::ids::RunId;
use crate::model::ChatModel;
use crate::queue::Queue;
use crate::store::{
    Checkpoint, Claim, Lease, NewEvent, Park, Parked, RunLog, StoreError, ThreadContext,
};
use crate::tools::ToolRegistry;
pub use compaction::{ContextSettings, Window};
pub use gate::PolicySettings;
pub use pins::menus;
pub use plan::{Next, context, plan};

/// The text a refused repeated call gets; the marker is stable so models (and the mock) can
/// recognise it.
pub const LOOP_MESSAGE: &str = "[loop_detected] You called this tool with identical arguments 3 times in a row; the call was not executed. Stop repeating it: use the results you already have and give your final answer.";

/// Appended (not stored) when a limit forces the final answer.
pub const FORCE_MESSAGE: &str = "You have reached this task's step or token limit. Do not call tools. Give your final answer now, using what you have found so far, and say what is left undone.";

/// Engine settings that do not vary per run.
#[derive(Clone, Debug)]
pub struct EngineSettings {
    /// Used when an agent names no model.
    pub default_model: String,
    /// Model names in agent files mapped onto the endpoint's models (`sonnet=gpt-4.1`).
    pub model_aliases: std::collections::BTreeMap<String, String>,
    /// Which provider serves which model (pinned on each run, named on traces).
    pub routes: Arc<crate::model::providers::ModelRoutes>,
    /// Root of the owners' workspaces (each owner gets a directory beneath it).
    pub workspace: PathBuf,
    /// Lease length; renewed every third of it.
    pub lease_ttl: Duration,
    /// Expired leases before a run whose workers keep dying fails with `kind=lost`.
    pub max_attempts: u32,
    /// Limit on one tool call.
    pub tool_timeout: Duration,
    /// Context windows, compaction and the tool-result limit.
    pub context: ContextSettings,
    /// Hooks, permission rules and approvals.
    pub policy: PolicySettings,
    /// MCP servers (their tools are `mcp__<server>__<tool>`).
    pub mcp: Arc<crate::mcp::Hub>,
    /// Model calls allowed per window, by model, shared by the fleet through the database.
    pub rate_limits: RateLimits,
    /// Prices per model: each call's cost commits with it.
    pub prices: Arc<crate::model::prices::PriceTable>,
    /// Delegation limits.
    pub delegation: DelegationSettings,
    /// Largest input a child run may be given.
    pub max_input_bytes: usize,
    /// How long a draining worker lets the step in flight finish before releasing the run.
    pub drain_grace: Duration,
    /// Newest messages of the thread read back to rebuild the context.
    pub context_messages: u32,
    /// Failure points for tests (none by default).
    pub failpoints: Arc<Failpoints>,
}

/// What one execution attempt ended with (the run's own outcome is in the store).
#[derive(Debug, PartialEq, Eq)]
pub enum Executed {
    /// The run reached a terminal state here.
    Finished(crate::runs::Ended),
    /// Nothing to do: finished already, or another worker holds it.
    Skipped,
    /// Queued (or woken), but its owner or its agent is at its concurrency limit: it waits for
    /// a slot (its job is pushed again, due a little later).
    Deferred,
    /// Another worker took the run over (our lease expired); we stopped.
    LeaseLost,
    /// We were draining and gave the run back to the queue (its job is pushed).
    Released,
    /// The run parked and left the worker; `due` when what it waits on had already happened,
    /// so it needs a job at once.
    Parked {
        /// Push a job for it now.
        due: bool,
        /// When it wakes by itself (ms since the epoch), if it does: its job is pushed for
        /// then, so the wake is on time (the reaper only backs this up).
        wake_at: Option<i64>,
    },
}

/// Runs the step loop for claimed runs.
pub struct Engine {
    /// Storage.
    pub store: Arc<dyn RunLog>,
    /// Agent definitions.
    pub agents: Arc<crate::pinning::Agents>,
    /// Tools.
    pub tools: Arc<ToolRegistry>,
    /// The model.
    pub model: Arc<dyn ChatModel>,
    /// For starting children and releasing runs.
    pub queue: Queue,
    /// Where token deltas go across processes (Redis), if configured.
    pub deltas: Option<crate::relay::RedisEvents>,
    /// Where token deltas go in this process (SSE clients with `include=deltas`).
    pub live: Arc<crate::deltas::DeltaHub>,
    /// The fleet's shared model budgets (per model and per owner).
    pub budgets: crate::budget::Budgets,
    /// Settings.
    pub settings: EngineSettings,
    /// The MCP tool lists runs pinned, by version ([`pins`]).
    pub menus: crate::pinning::Texts<Vec<crate::model::ToolSpec>>,
    /// This process's queue workers with a free slot, to hand a parent's children to as they
    /// are written (as the API's starts are), not through a fetch.
    pub local: Arc<dyn crate::runs::FreeSlots>,
}

/// How one attempt at a run ends: reached by the loop, or imposed on it from outside. It is
/// also the error type of the loop's parts ([`Flow`]): `Err(end)` means "the attempt ends
/// here, with this", which is not always a failure.
#[derive(Debug)]
enum End {
    /// The final answer and the terminal state are committed already; what the commit saw.
    Committed(crate::store::Ending),
    /// Commit this terminal state (a replayed answer, a failure, a cancel).
    Finish(Finish),
    /// Park on this until it happens (children, approvals, a rate limit).
    Park(Wait),
    /// Give the run back to the queue: the worker is draining.
    Release(Release),
    /// Another worker owns the run now: stop, writing nothing.
    LeaseLost,
    /// A read or write of the run failed (see [`Engine::storage_failed`]).
    Storage(StoreError),
}

/// Why a draining worker gives a run back.
#[derive(Debug)]
enum Release {
    /// At a step boundary: everything so far is committed.
    Drained,
    /// The drain grace ran out with a step still in flight.
    GraceOver,
}

/// What the loop's parts return: a value, or how the attempt ends.
type Flow<T = ()> = Result<T, End>;

impl From<StoreError> for End {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::LeaseLost(_) => End::LeaseLost,
            // Replaying cannot get past unreadable data: fail instead of looping.
            StoreError::Corrupt(what) => End::fail(
                ErrorKind::Internal,
                format!("stored data of this run could not be read: {what}"),
            ),
            e => End::Storage(e),
        }
    }
}

impl Engine {
    /// Claims and executes one run until it ends, parks, is handed over, or `shutdown` drains it.
    pub async fn execute(
        &self,
        run_id: RunId,
        worker: &str,
        shutdown: &CancellationToken,
    ) -> Result<Executed, StoreError> {
        // The claim brings the run's context where the store reads it in the same round trip.
        let (claim, context) = self
            .store
            .claim_with_context(
                run_id,
                worker,
                self.settings.lease_ttl,
                self.context_limit(),
            )
            .await?;
        self.execute_claim(run_id, claim, context, shutdown).await
    }

    /// Takes the job a notification named for `worker` and claims its run in one round trip
    /// where the store can ([`crate::store::Claims::take_and_claim`]), for
    /// [`Engine::execute_claim`]. `None` when the job was not this worker's to take.
    pub async fn take_and_claim(
        &self,
        job_id: &str,
        worker: &str,
    ) -> Result<Option<crate::store::Taken>, StoreError> {
        self.store
            .take_and_claim(
                job_id,
                worker,
                self.settings.lease_ttl,
                self.context_limit(),
            )
            .await
    }

    /// [`Engine::execute`] from the claim of `run_id` (and the context it read) already made.
    pub async fn execute_claim(
        &self,
        run_id: RunId,
        claim: Claim,
        context: Option<ThreadContext>,
        shutdown: &CancellationToken,
    ) -> Result<Executed, StoreError> {
        let (lease, run) = match claim {
            Claim::Acquired(lease, run) => (lease, *run),
            Claim::NotClaimable(status) => {
                if matches!(
                    status,
                    Some(crate::store::RunStatus::Queued | crate::store::RunStatus::Waiting)
                ) && self.store.at_limit(run_id).await?
                {
                    tracing::debug!(%run_id, "the run's owner or agent is at its concurrency limit; it waits for a slot");
                    metrics::counter!("subagents_runs_deferred_total").increment(1);
                    return Ok(Executed::Deferred);
                }
                tracing::debug!(%run_id, ?status, "run not claimable; skipping job");
                return Ok(Executed::Skipped);
            }
        };
        // Span names and gen_ai.* attributes follow the OpenTelemetry GenAI conventions
        // (invoke_agent / chat / execute_tool); run_id and thread_id are on every span.
        let span = info_span!(
            "run",
            otel.name = format!("invoke_agent {}", run.agent),
            gen_ai.operation.name = "invoke_agent",
            gen_ai.agent.name = %run.agent,
            gen_ai.conversation.id = %run.thread_id,
            run_id = %run.id,
            agent = %run.agent,
            thread_id = %run.thread_id,
            attempt = run.attempts,
            parent_run_id = run.parent_run_id.map(|p| p.to_string()),
        );
        // A child (or a run whose caller passed its own trace) continues that trace; any other
        // run continues its own, whichever attempt this is.
        let traceparent = match run.metadata.get("traceparent").and_then(|v| v.as_str()) {
            Some(tp) => tp.to_owned(),
            None => {
                let root = run.tree.root_run_id.unwrap_or(run.id);
                crate::telemetry::run_traceparent(root.0, run.id.0)
            }
        };
        crate::telemetry::adopt(&span, &traceparent);
        self.execute_claimed(lease, run, context, shutdown)
            .instrument(span)
            .await
    }

    async fn execute_claimed(
        &self,
        lease: Lease,
        run: RunRecord,
        context: Option<ThreadContext>,
        shutdown: &CancellationToken,
    ) -> Result<Executed, StoreError> {
        tracing::info!(step = run.step, crashes = run.crashes, "run claimed");
        // A cancel that arrived while its worker was gone is honoured before anything else: no
        // model call, no tool.
        if run.cancel_requested {
            tracing::info!("a cancel was pending at claim");
            return self.finish(&lease, &run, Finish::Cancelled).await;
        }
        // A run parked past its wall-time limit is claimed at its deadline (see `park`) and
        // ends here, before any other call.
        let deadline_in = time_left(&run);
        if deadline_in.is_zero() {
            let timed_out = Finish::Failed(decide::timed_out(&run.limits));
            return self.finish(&lease, &run, timed_out).await;
        }
        let cancel = CancellationToken::new();
        let lost = CancellationToken::new();
        let inbox = steer::Flag::new(run.inbox > 0);
        let interrupt = steer::Flag::new(false);
        let heartbeat = AbortOnDrop(tokio::spawn(heartbeat(
            self.store.clone(),
            lease.clone(),
            Heard {
                cancel: cancel.clone(),
                lost: lost.clone(),
                inbox: inbox.clone(),
                interrupt: interrupt.clone(),
            },
        )));
        // A drain lets the step in flight finish (the loop stops at the next step boundary),
        // but only for so long.
        let grace = self.settings.drain_grace;
        let drain_cut = async move {
            shutdown.cancelled().await;
            tokio::time::sleep(grace).await;
        };
        let pending = attempt::PendingSlot::default();
        let heard = steer::Heard { inbox, interrupt };
        let end = tokio::select! {
            end = self.drive(&lease, &run, context, heard, shutdown, &pending) => end,
            _ = cancel.cancelled() => End::Finish(Finish::Cancelled),
            _ = lost.cancelled() => End::LeaseLost,
            _ = drain_cut => End::Release(Release::GraceOver),
            _ = tokio::time::sleep(deadline_in) => {
                End::Finish(Finish::Failed(decide::timed_out(&run.limits)))
            }
        };
        // The loop was cut short with a commit still under way beside a model call: it lands
        // (or fails) before the end is committed, as it would have before the call.
        if attempt::is_pending(&pending) {
            self.settings.failpoints.hit("after_attempt_cut").await;
            if let Err(e) = attempt::settle_slot(&pending).await {
                tracing::warn!(error = %e, "the commit under way when the run was cut short failed");
            }
        }
        // The heartbeat stops before any park or release: its renewal requires `running`, and
        // must not report a lease "lost" that we are giving up on purpose.
        drop(heartbeat);
        self.conclude(&lease, &run, end).await
    }

    /// Turns how the attempt ended into the run's commits.
    async fn conclude(
        &self,
        lease: &Lease,
        run: &RunRecord,
        end: End,
    ) -> Result<Executed, StoreError> {
        match end {
            End::Committed(ending) => Ok(self.ended(run, ending).await),
            End::Finish(finish) => self.finish(lease, run, finish).await,
            End::Park(wait) => self.park(lease, run, wait).await,
            End::Release(Release::Drained) => {
                self.release(lease, "draining: the step in flight finished")
                    .await
            }
            End::Release(Release::GraceOver) => {
                // The step's model call (if it was answered) is lost and will be asked again:
                // worth a warning, since the grace is meant to cover a step.
                tracing::warn!(
                    grace_s = self.settings.drain_grace.as_secs_f64(),
                    "draining: the grace period ran out mid-step; the step in flight is dropped and runs again elsewhere"
                );
                self.release(lease, "draining: the grace period ran out mid-step")
                    .await
            }
            End::LeaseLost => {
                tracing::warn!("lease lost: another worker owns this run now; dropping it");
                Ok(Executed::LeaseLost)
            }
            End::Storage(e) => self.storage_failed(lease, run, e).await,
        }
    }

    /// A write or read of the run failed. Data the database refuses fails the run (replaying
    /// would fail the same way, paying for a model call each time). Any other failure gives the
    /// run back at once so a retry resumes it from the last checkpoint; one that is not the
    /// database being away (a deadlock, a lock or statement timeout, a full disk) counts as a
    /// crash, so a run that keeps failing that way ends after `SUBAGENTS_MAX_ATTEMPTS` like one
    /// that keeps crashing, while a run survives any number of database restarts.
    async fn storage_failed(
        &self,
        lease: &Lease,
        run: &RunRecord,
        e: StoreError,
    ) -> Result<Executed, StoreError> {
        if !e.is_transient() {
            tracing::error!(error = %e, "the database refused this run's data; failing the run");
            let message = format!(
                "the database refused this run's data, and replaying it would fail the same way: {e}"
            );
            return self
                .finish(
                    lease,
                    run,
                    Finish::Failed(RunError {
                        kind: ErrorKind::Internal,
                        message,
                    }),
                )
                .await;
        }
        let counted = !e.is_outage();
        if counted && run.crashes.saturating_add(1) >= self.settings.max_attempts {
            tracing::error!(error = %e, crashes = run.crashes, "storage kept failing for this run; giving up");
            let message = format!(
                "storage kept failing; gave up after {} attempts: {e}",
                run.crashes + 1
            );
            return self
                .finish(
                    lease,
                    run,
                    Finish::Failed(RunError {
                        kind: ErrorKind::Lost,
                        message,
                    }),
                )
                .await;
        }
        tracing::error!(error = %e, counted, "storage failed mid-run; releasing the run for a retry");
        let _ = self
            .store
            .release_lease(lease, &crate::queue::new_job_id(), counted)
            .await;
        Err(e)
    }

    /// Commits the run's end (its event, and the parent's `child.finished` and wake-ups in the
    /// same transaction), then cancels its attached children.
    async fn finish(
        &self,
        lease: &Lease,
        run: &RunRecord,
        mut finish: Finish,
    ) -> Result<Executed, StoreError> {
        match &mut finish {
            Finish::Failed(e) => crate::model::scrub_nul(&mut e.message),
            Finish::Succeeded { result, .. } => crate::model::scrub_nul(result),
            Finish::Cancelled => {}
        }
        let event = match &finish {
            Finish::Succeeded { result, forced } => Event::RunSucceeded(event::RunSucceeded {
                result: result.clone(),
                forced: *forced,
            }),
            Finish::Failed(e) => Event::RunFailed(event::RunFailed {
                error: e.clone(),
                crashes: None,
            }),
            Finish::Cancelled => Event::RunCancelled(event::RunCancelled::default()),
        };
        let status = finish.terminal().status();
        match &finish {
            Finish::Succeeded { forced, .. } => tracing::info!(forced, "run succeeded"),
            Finish::Failed(e) => {
                tracing::warn!(kind = e.kind.as_str(), error = %e.message, "run failed")
            }
            Finish::Cancelled => tracing::info!("run cancelled"),
        }
        match self
            .store
            .checkpoint(
                lease,
                Checkpoint {
                    events: vec![event.into()],
                    finish: Some(finish),
                    ..Default::default()
                },
            )
            .await
        {
            Ok(ending) => {
                metrics::counter!("subagents_runs_finished_total", "status" => status.as_str())
                    .increment(1);
                let ending = ending.unwrap_or(crate::store::Ending::UNKNOWN);
                Ok(self.ended(run, ending).await)
            }
            Err(StoreError::LeaseLost(_)) => Ok(Executed::LeaseLost),
            Err(e) => {
                let _ = self
                    .store
                    .release_lease(lease, &crate::queue::new_job_id(), !e.is_outage())
                    .await;
                Err(e)
            }
        }
    }

    /// Parks the run on what its delegation calls wait for. The store records what it waits
    /// on and makes it due at once if any of that already ended, so an end that raced the park
    /// is never missed; a cancel pending at the park finishes the run instead.
    async fn park(
        &self,
        lease: &Lease,
        run: &RunRecord,
        mut wait: Wait,
    ) -> Result<Executed, StoreError> {
        let fp = &self.settings.failpoints;
        // The wall-time limit holds while parked too: wake at the deadline at the latest.
        if let Some(deadline) = run_deadline_ms(run) {
            wait.wake_at = Some(wait.wake_at.map_or(deadline, |w| w.min(deadline)));
        }
        fp.hit("before_park_commit").await;
        let event: NewEvent = Event::RunWaiting(event::RunWaiting {
            step: run.step.max(1),
            waiting_on: wait.reason(),
            run_ids: wait.on.clone(),
            wake_at: wait.wake_at,
            approval_ids: (!wait.approvals.is_empty()).then(|| wait.approvals.clone()),
        })
        .into();
        let park = Park {
            events: vec![event],
            wake_at: wait.wake_at,
            waits_on: wait.on.clone(),
            approvals: wait.approvals.clone(),
        };
        match self.store.park(lease, park).await {
            Ok(Parked::Parked { due }) => {
                fp.hit("after_park_commit").await;
                tracing::info!(waiting_on = ?wait.reason(), waits_on = ?wait.on, wake_at = ?wait.wake_at, due, "parked");
                Ok(Executed::Parked {
                    due,
                    wake_at: wait.wake_at,
                })
            }
            Ok(Parked::CancelPending) => {
                tracing::info!("a cancel arrived before the park: finishing as cancelled");
                self.finish(lease, run, Finish::Cancelled).await
            }
            Err(StoreError::LeaseLost(_)) => Ok(Executed::LeaseLost),
            Err(e) => self.storage_failed(lease, run, e).await,
        }
    }

    /// Gives the run back to the queue and pushes its job, so another worker resumes it at once.
    async fn release(&self, lease: &Lease, why: &str) -> Result<Executed, StoreError> {
        let job = crate::queue::new_job_id();
        if !self.store.release_lease(lease, &job, false).await? {
            return Ok(Executed::LeaseLost);
        }
        tracing::info!(why, "run released to the queue");
        let rank = self
            .store
            .queue_rank(lease.run_id, crate::domain::QueuePlace::Front)
            .await
            .unwrap_or((0, crate::runs::DEFAULT_PRIORITY));
        if let Err(e) = self
            .queue
            .push(lease.run_id, &job, rank, Duration::ZERO)
            .await
        {
            tracing::warn!(error = %e, "could not push the released run; the reaper will");
        }
        Ok(Executed::Released)
    }

    /// Whether the tree this run belongs to has reached its token or step limit (set on the
    /// root, inherited by every descendant). Only asks the database when such a limit is set.
    async fn tree_limit_reached(
        &self,
        run: &RunRecord,
        own: crate::model::Usage,
        own_steps: u32,
    ) -> Flow<bool> {
        let l = &run.limits;
        if l.max_total_tokens.is_none() && l.max_total_steps.is_none() {
            return Ok(false);
        }
        let (tokens, steps) = match run.tree.root_run_id {
            // A root counts its own (possibly not yet visible) usage plus its descendants'.
            None => {
                let (tree, tree_steps) = self.store.tree_usage(run.id).await?;
                (
                    tree.total().max(own.total()),
                    tree_steps.max(u64::from(own_steps)),
                )
            }
            Some(root) => {
                let (tree, tree_steps) = self.store.tree_usage(root).await?;
                (tree.total(), tree_steps)
            }
        };
        Ok(l.max_total_tokens.is_some_and(|m| tokens >= m)
            || l.max_total_steps.is_some_and(|m| steps >= m))
    }

    /// The `step.started` event of the step after `done`, when it can be known without asking
    /// the database (no tree limit to check); `None` means "write it on its own".
    fn next_step_event(&self, run: &RunRecord, done: u32) -> Option<NewEvent> {
        if run.limits.max_total_tokens.is_some() || run.limits.max_total_steps.is_some() {
            return None;
        }
        Some(
            Event::StepStarted(event::StepStarted {
                step: done + 1,
                forced: done >= run.limits.max_steps,
            })
            .into(),
        )
    }

    /// A run whose end committed: its still-going attached children are told, and its worker
    /// gets what the commit saw of the thread's next run.
    async fn ended(&self, run: &RunRecord, ending: crate::store::Ending) -> Executed {
        if ending.children_going {
            self.end_children(run).await;
        }
        Executed::Finished(crate::runs::Ended {
            run_id: run.id,
            thread_id: run.thread_id.clone(),
            is_child: run.parent_run_id.is_some(),
            next: ending.next,
            job_done: ending.job_done,
        })
    }

    /// A parent that ends cancels its still-running attached children. The terminal commit
    /// already did that durably (parked and queued ones cancelled, running ones asked to stop);
    /// this is the fast path that wakes their workers in this process at once. It runs only
    /// when the commit saw a child still going, and a run whose agent was never offered the
    /// delegation tools has none, and costs no query.
    async fn end_children(&self, run: &RunRecord) {
        let may_delegate = self
            .agents
            .current()
            .get(run.agent.as_str())
            .is_none_or(|a| {
                crate::delegation::offered(a, run.tree.depth, &self.settings.delegation)
            });
        if !may_delegate {
            return;
        }
        if let Err(e) =
            crate::runs::cancel_attached_children(self.store.as_ref(), &self.queue, run.id).await
        {
            tracing::warn!(error = %e, "could not cancel the children of a finished run");
        }
    }

    /// The model this run calls: its agent's `model:` through the alias map; `inherit` takes
    /// the parent's pinned model, else (a parent from before pins) walks up to the nearest
    /// ancestor whose agent names one (the default at the root).
    async fn model_for(
        &self,
        run: &RunRecord,
        agent: &AgentDef,
        parent_model: Option<&str>,
    ) -> Flow<String> {
        if let Some(parent_model) = parent_model {
            let (model, _) = crate::agents::resolve_model(
                agent.model.as_deref(),
                Some(parent_model),
                &self.settings.default_model,
                &self.settings.model_aliases,
            );
            return Ok(model);
        }
        let mut chain = vec![agent.model.clone()];
        let mut parent = run.parent_run_id;
        while chain.last().and_then(|m| m.as_deref()).map(str::trim) == Some("inherit") {
            let Some(id) = parent else { break };
            let Some(p) = self.store.get_run(id).await? else {
                break;
            };
            chain.push(
                self.agents
                    .for_run(self.store.as_ref(), &p)
                    .await?
                    .and_then(|a| a.model.clone()),
            );
            parent = p.parent_run_id;
        }
        let mut resolved: Option<String> = None;
        for m in chain.iter().rev() {
            let (model, note) = crate::agents::resolve_model(
                m.as_deref(),
                resolved.as_deref(),
                &self.settings.default_model,
                &self.settings.model_aliases,
            );
            if let Some(note) = note {
                tracing::debug!(%model, note, "model resolved");
            }
            resolved = Some(model);
        }
        Ok(resolved.unwrap_or_else(|| self.settings.default_model.clone()))
    }

    /// The tools of the MCP servers the agent may use, from the lists the run pinned (see
    /// [`pins::mcp_wanted`]). A server that could not be reached offers nothing this time; a
    /// tool named explicitly is still offered, so a call of it tells the model what is wrong.
    fn add_mcp_tools(
        &self,
        agent: &AgentDef,
        pinned: &pins::Pinned,
        names: &mut Vec<String>,
        specs: &mut Vec<crate::model::ToolSpec>,
    ) {
        let visible = self.settings.mcp.visible(&agent.name);
        for (server, only) in pins::mcp_wanted(agent, visible) {
            if let Some(menu) = pinned.menus.get(&server) {
                let prefix = format!("mcp__{server}__");
                for s in menu.iter() {
                    let tool = s.function.name.strip_prefix(&prefix);
                    if only.as_deref().is_none_or(|o| tool == Some(o))
                        && !names.contains(&s.function.name)
                    {
                        names.push(s.function.name.clone());
                        specs.push(s.clone());
                    }
                }
            } else if let Some(tool) = only {
                let why = pinned
                    .unreachable
                    .get(&server)
                    .map_or("it could not be reached", String::as_str);
                let name = format!("mcp__{server}__{tool}");
                names.push(name.clone());
                specs.push(crate::model::ToolSpec {
                    kind: "function".into(),
                    function: crate::model::FunctionSpec {
                        name,
                        description: format!(
                            "(The MCP server `{server}` is not available right now: {why})"
                        ),
                        parameters: json!({"type": "object"}),
                    },
                });
            }
        }
    }

    fn delegation_ctx<'a>(
        &'a self,
        run: &'a RunRecord,
        agent: &'a AgentDef,
    ) -> crate::delegation::Ctx<'a> {
        crate::delegation::Ctx {
            store: self.store.as_ref(),
            queue: &self.queue,
            agents: &self.agents,
            parent: run,
            agent,
            settings: &self.settings.delegation,
            max_input_bytes: self.settings.max_input_bytes,
            local: self.local.as_ref(),
        }
    }
}

/// How long the run has left before its wall-time limit (counted from its first start). Limits
/// are validated at start; still, stored data must never make the engine panic.
fn time_left(run: &RunRecord) -> Duration {
    let started = run.started_at.unwrap_or_else(chrono::Utc::now);
    let limit =
        chrono::Duration::try_seconds(run.limits.timeout_secs.min(i64::MAX as u64 / 1000) as i64)
            .unwrap_or(chrono::Duration::MAX);
    started
        .checked_add_signed(limit)
        .map(|d| (d - chrono::Utc::now()).to_std().unwrap_or(Duration::ZERO))
        .unwrap_or(Duration::MAX / 4)
}

/// When the run's wall-time limit ends (Unix ms), counted from its first start.
fn run_deadline_ms(run: &RunRecord) -> Option<i64> {
    let started = run.started_at?.timestamp_millis();
    let limit = i64::try_from(run.limits.timeout_secs)
        .ok()?
        .checked_mul(1000)?;
    started.checked_add(limit)
}

/// What the heartbeat tells the attempt.
struct Heard {
    /// A cancel was requested.
    cancel: CancellationToken,
    /// The lease is gone.
    lost: CancellationToken,
    /// Messages wait for the next step boundary.
    inbox: steer::Flag,
    /// The run is to be cancelled at its next step boundary.
    interrupt: steer::Flag,
}

/// Renews the lease every third of its length (at least every second, so a cancel or a message
/// from another process is seen within a second; one from this process wakes it at once); trips
/// `cancel` when a cancel was requested, `lost` when the lease is gone, and raises `inbox` when
/// messages wait. A failed renewal (database briefly away) is retried until the lease would
/// have expired.
async fn heartbeat(store: Arc<dyn RunLog>, lease: Lease, heard: Heard) {
    let Heard {
        cancel,
        lost,
        inbox,
        interrupt,
    } = heard;
    let every = (lease.ttl / 3).clamp(Duration::from_millis(50), Duration::from_secs(1));
    let mut last_ok = std::time::Instant::now();
    let cancel_asked = store.subscribe_cancel(lease.run_id);
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = cancel_asked.notified() => {}
        }
        match store.renew_lease(&lease).await {
            Ok(st) => {
                last_ok = std::time::Instant::now();
                if st.cancel_requested {
                    cancel.cancel();
                }
                if st.messages_waiting {
                    inbox.raise();
                }
                if st.interrupt_requested {
                    interrupt.raise();
                }
            }
            Err(StoreError::LeaseLost(_)) => {
                lost.cancel();
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, "lease renewal failed; retrying");
                if last_ok.elapsed() >= lease.ttl {
                    lost.cancel();
                    return;
                }
            }
        }
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
