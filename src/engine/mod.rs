//! The engine: one run's step loop, as a planner and an executor. The planner ([`plan`]) is a
//! pure function of the run's committed messages; the executor here does the I/O — the model
//! call, the tools, the commits — and asks the planner again after each commit. So a fresh
//! start and a resume after a crash are the same code path (steno's "replay, don't redo"):
//!
//! - an assistant message with tool calls commits before any tool runs;
//! - each tool result commits as soon as its tool returns, with the same idempotency key on a
//!   replay; a call with a committed result is never run again;
//! - a committed model response is never requested again;
//! - every write is fenced by the run's lease epoch; a lost lease stops the loop at once.
//!
//! How an attempt ends is decided in one place ([`Engine::execute`]): a final answer, a park
//! (the run waits on children, holding no worker), a release (the worker is draining), a
//! cancel, a timeout, or a lost lease. Limits (steps, tokens, wall time, tool time, tool
//! output) all end in a defined outcome.

pub mod budget;
pub mod compaction;
mod gate;
pub mod plan;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info_span};

use crate::agents::{AgentDef, AgentRegistry};
use crate::delegation::{Answer, DelegationSettings, Wait};
use crate::domain::event;
use crate::failpoints::Failpoints;
use crate::ids::RunId;
use crate::model::{ChatModel, ChatRequest, Message, ModelError, ToolCall};
use crate::queue::Queue;
use crate::store::{
    Checkpoint, Claim, ErrorKind, Event, Finish, Lease, NewEvent, NewMessage, Park, Parked,
    RunError, RunLog, RunRecord, StoreError, StoredMessage,
};
use crate::tools::{ToolCtx, ToolRegistry};
pub use compaction::{Budget, ContextSettings};
use compaction::{Compacted, Reason};
use gate::Gate;
pub use gate::PolicySettings;
pub use plan::{Next, plan};

/// Compactions that may fail in a row before the run fails with `kind=context`.
const MAX_COMPACTION_FAILURES: u32 = 3;

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
    /// Root of the owners' workspaces (each owner gets a directory beneath it).
    pub workspace: PathBuf,
    /// Lease length; renewed every third of it.
    pub lease_ttl: Duration,
    /// Expired leases before a run whose workers keep dying fails with `kind=lost`.
    pub max_attempts: u32,
    /// Limit on one tool call.
    pub tool_timeout: Duration,
    /// Context windows, compaction and the tool-result budget.
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

/// Model rate limits: by model, at most `requests` calls and `tokens` prompt tokens per `window`.
#[derive(Clone, Debug, Default)]
pub struct RateLimits {
    /// Limits by model name.
    pub by_model: crate::config::ModelLimits,
    /// The window (a minute; tests shorten it).
    pub window: Duration,
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
    pub agents: Arc<AgentRegistry>,
    /// Tools.
    pub tools: Arc<ToolRegistry>,
    /// The model.
    pub model: Arc<dyn ChatModel>,
    /// For starting children and releasing runs.
    pub queue: Queue,
    /// Where token deltas go (Redis only), if configured.
    pub deltas: Option<crate::relay::RedisEvents>,
    /// The fleet's shared model budgets (per model and per owner).
    pub budgets: budget::Budgets,
    /// Settings.
    pub settings: EngineSettings,
}

/// Starts of one call that each ended in its worker's death, after which a replay does not run
/// it again.
const MAX_CRASHES_UNDER_A_CALL: u32 = 2;

/// How the step loop ended, when it ended by itself.
enum LoopEnd {
    /// The final answer and terminal state are committed.
    Committed,
    /// The run must be finished with this.
    Finish(Finish),
    /// Delegation calls must wait: park on this.
    Park(Wait),
    /// The worker is draining: the step in flight is done, give the run back.
    Drained,
}

/// What stopped the loop from outside.
#[derive(Debug)]
enum Interrupt {
    /// A cancel was requested.
    Cancel,
    /// Another worker owns the run now.
    LeaseLost,
    /// The drain grace ran out with a step still in flight.
    DrainCut,
    /// The run's wall-time limit passed.
    Timeout,
}

/// Why the loop stopped before reaching a final answer.
enum Stop {
    Fail(RunError),
    Store(StoreError),
}

impl From<StoreError> for Stop {
    fn from(e: StoreError) -> Self {
        Stop::Store(e)
    }
}

/// What a step's tools came to.
struct ToolsOutcome {
    /// Results committed in this pass.
    committed: Vec<NewMessage>,
    /// Delegation calls that must wait, merged.
    wait: Option<Wait>,
}

impl Engine {
    /// Claims and executes one run until it ends, parks, is handed over, or `shutdown` drains it.
    pub async fn execute(
        &self,
        run_id: RunId,
        worker: &str,
        shutdown: &CancellationToken,
    ) -> Result<Executed, StoreError> {
        let (lease, run) = match self
            .store
            .claim_run(run_id, worker, self.settings.lease_ttl)
            .await?
        {
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
        // A child (or a run whose caller passed its own trace) continues that trace.
        if let Some(tp) = run.metadata.get("traceparent").and_then(|v| v.as_str()) {
            crate::telemetry::adopt(&span, tp);
        }
        self.execute_claimed(lease, run, shutdown)
            .instrument(span)
            .await
    }

    async fn execute_claimed(
        &self,
        lease: Lease,
        run: RunRecord,
        shutdown: &CancellationToken,
    ) -> Result<Executed, StoreError> {
        tracing::info!(step = run.step, crashes = run.crashes, "run claimed");
        // A cancel that arrived while its worker was gone is honoured before anything else: no
        // model call, no tool.
        if run.cancel_requested {
            tracing::info!("a cancel was pending at claim");
            return self.finish(&lease, &run, Finish::Cancelled).await;
        }
        let cancel = CancellationToken::new();
        let lost = CancellationToken::new();
        let heartbeat = AbortOnDrop(tokio::spawn(heartbeat(
            self.store.clone(),
            lease.clone(),
            cancel.clone(),
            lost.clone(),
        )));

        // Limits are validated at start; still, stored data must never make the engine panic.
        let started = run.started_at.unwrap_or_else(chrono::Utc::now);
        let limit = chrono::Duration::try_seconds(
            run.limits.timeout_secs.min(i64::MAX as u64 / 1000) as i64,
        )
        .unwrap_or(chrono::Duration::MAX);
        let deadline_in = started
            .checked_add_signed(limit)
            .map(|d| (d - chrono::Utc::now()).to_std().unwrap_or(Duration::ZERO))
            .unwrap_or(Duration::MAX / 4);
        // A run parked past its wall-time limit is claimed at its deadline (see `park`) and
        // ends here, before any other call.
        if deadline_in.is_zero() {
            let message = format!(
                "the run exceeded its wall-time limit of {}s",
                run.limits.timeout_secs
            );
            return self
                .finish(
                    &lease,
                    &run,
                    Finish::Failed(RunError {
                        kind: ErrorKind::Timeout,
                        message,
                    }),
                )
                .await;
        }
        // A drain lets the step in flight finish (the loop stops at the next step boundary),
        // but only for so long.
        let grace = self.settings.drain_grace;
        let drain_cut = async move {
            shutdown.cancelled().await;
            tokio::time::sleep(grace).await;
        };
        let result = tokio::select! {
            r = self.run_loop(&lease, &run, shutdown) => Ok(r),
            _ = cancel.cancelled() => Err(Interrupt::Cancel),
            _ = lost.cancelled() => Err(Interrupt::LeaseLost),
            _ = drain_cut => Err(Interrupt::DrainCut),
            _ = tokio::time::sleep(deadline_in) => Err(Interrupt::Timeout),
        };
        // The heartbeat stops before any park or release: its renewal requires `running`, and
        // must not report a lease "lost" that we are giving up on purpose.
        drop(heartbeat);
        match result {
            Ok(Ok(LoopEnd::Committed)) => {
                self.end_children(&run).await;
                Ok(Executed::Finished(ended(&run)))
            }
            Ok(Ok(LoopEnd::Finish(finish))) => self.finish(&lease, &run, finish).await,
            Ok(Ok(LoopEnd::Park(wait))) => self.park(&lease, &run, wait).await,
            Ok(Ok(LoopEnd::Drained)) => {
                self.release(&lease, "draining: the step in flight finished")
                    .await
            }
            Err(Interrupt::DrainCut) => {
                // The step's model call (if it was answered) is lost and will be asked again:
                // worth a warning, since the grace is meant to cover a step.
                tracing::warn!(
                    grace_s = grace.as_secs_f64(),
                    "draining: the grace period ran out mid-step; the step in flight is dropped and runs again elsewhere"
                );
                self.release(&lease, "draining: the grace period ran out mid-step")
                    .await
            }
            Ok(Err(Stop::Fail(e))) => self.finish(&lease, &run, Finish::Failed(e)).await,
            Err(Interrupt::Cancel) => self.finish(&lease, &run, Finish::Cancelled).await,
            Err(Interrupt::Timeout) => {
                let message = format!(
                    "the run exceeded its wall-time limit of {}s",
                    run.limits.timeout_secs
                );
                self.finish(
                    &lease,
                    &run,
                    Finish::Failed(RunError {
                        kind: ErrorKind::Timeout,
                        message,
                    }),
                )
                .await
            }
            Ok(Err(Stop::Store(StoreError::LeaseLost(_)))) | Err(Interrupt::LeaseLost) => {
                tracing::warn!("lease lost: another worker owns this run now; dropping it");
                Ok(Executed::LeaseLost)
            }
            Ok(Err(Stop::Store(StoreError::Corrupt(what)))) => {
                // Replaying cannot get past unreadable data: fail instead of looping.
                let message = format!("stored data of this run could not be read: {what}");
                self.finish(
                    &lease,
                    &run,
                    Finish::Failed(RunError {
                        kind: ErrorKind::Internal,
                        message,
                    }),
                )
                .await
            }
            Ok(Err(Stop::Store(e))) => self.storage_failed(&lease, &run, e).await,
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
            Ok(()) => {
                metrics::counter!("subagents_runs_finished_total", "status" => status.as_str())
                    .increment(1);
                self.end_children(run).await;
                Ok(Executed::Finished(ended(run)))
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
        let waiting_on = if wait.rate_limited {
            "rate_limit"
        } else if wait.on.is_empty() && !wait.approvals.is_empty() {
            "approval"
        } else {
            "children"
        };
        let event: NewEvent = Event::RunWaiting(event::RunWaiting {
            step: run.step.max(1),
            waiting_on: waiting_on.into(),
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
                tracing::info!(waits_on = ?wait.on, wake_at = ?wait.wake_at, due, "parked: waiting for children");
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
            .queue_rank(lease.run_id, crate::store::QueuePlace::Front)
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

    /// Whether the tree this run belongs to has used up its token or step budget (set on the
    /// root, inherited by every descendant). Only asks the database when a budget is set.
    async fn over_tree_budget(
        &self,
        run: &RunRecord,
        own: crate::model::Usage,
        own_steps: u32,
    ) -> Result<bool, Stop> {
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
    /// the database (no tree budget to check); `None` means "write it on its own".
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

    /// A parent that ends cancels its still-running attached children. The terminal commit
    /// already did that durably (parked and queued ones cancelled, running ones asked to stop);
    /// this is the fast path that wakes their workers in this process at once. A run whose
    /// agent was never offered the delegation tools has none, and costs no query.
    async fn end_children(&self, run: &RunRecord) {
        let may_delegate = self.agents.get(&run.agent).is_none_or(|a| {
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

    /// The model this run calls: its agent's `model:` through the alias map; `inherit` walks up
    /// to the nearest ancestor whose agent names one (the default at the root).
    async fn model_for(&self, run: &RunRecord, agent: &AgentDef) -> Result<String, Stop> {
        let mut chain = vec![agent.model.clone()];
        let mut parent = run.parent_run_id;
        while chain.last().and_then(|m| m.as_deref()).map(str::trim) == Some("inherit") {
            let Some(id) = parent else { break };
            let Some(p) = self.store.get_run(id).await? else {
                break;
            };
            chain.push(self.agents.get(&p.agent).and_then(|a| a.model.clone()));
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

    /// The tools of the MCP servers the agent may use: all it can see when its file names no
    /// tools, else the servers and tools it names (`mcp__server`, `mcp__server__tool`). A server
    /// that cannot be reached offers nothing this time; a tool named explicitly is still offered,
    /// so a call of it tells the model what is wrong.
    async fn add_mcp_tools(
        &self,
        agent: &AgentDef,
        owner: &str,
        names: &mut Vec<String>,
        specs: &mut Vec<crate::model::ToolSpec>,
    ) {
        let hub = &self.settings.mcp;
        let visible = hub.visible(&agent.name);
        let wanted: Vec<(String, Option<String>)> = match &agent.tools {
            None => visible.into_iter().map(|s| (s, None)).collect(),
            Some(list) => list
                .iter()
                .filter_map(|t| crate::mcp::split(t.trim()))
                .map(|(s, t)| (s.to_owned(), t.map(str::to_owned)))
                .collect(),
        };
        for (server, only) in wanted {
            match hub.specs(&server, only.as_deref(), owner).await {
                Ok(found) => {
                    for s in found {
                        if !names.contains(&s.function.name) {
                            names.push(s.function.name.clone());
                            specs.push(s);
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(server = %server, error = %e, "MCP server unavailable for this run");
                    if let Some(tool) = only {
                        let name = format!("mcp__{server}__{tool}");
                        names.push(name.clone());
                        specs.push(crate::model::ToolSpec {
                            kind: "function".into(),
                            function: crate::model::FunctionSpec {
                                name,
                                description: format!(
                                    "(The MCP server `{server}` is not available right now: {e})"
                                ),
                                parameters: json!({"type": "object"}),
                            },
                        });
                    }
                }
            }
        }
    }

    /// Runs a built-in tool or an MCP server's (the owner's own process of a stdio server).
    async fn execute_tool(
        &self,
        name: &str,
        arguments: &str,
        ctx: &ToolCtx,
        owner: &str,
    ) -> Result<String, crate::tools::ToolError> {
        let Some((server, Some(tool))) = crate::mcp::split(name) else {
            return self.tools.execute(name, arguments, ctx).await;
        };
        let args: serde_json::Value = if arguments.trim().is_empty() {
            json!({})
        } else {
            serde_json::from_str(arguments).map_err(|e| {
                crate::tools::ToolError::new(
                    "bad_arguments",
                    format!("arguments are not valid JSON ({e}); send a JSON object"),
                )
            })?
        };
        match self.settings.mcp.call(server, tool, args, owner).await {
            Ok((text, true)) => Ok(text),
            Ok((text, false)) => Err(crate::tools::ToolError::new("mcp_tool_error", text)),
            Err(e) => Err(crate::tools::ToolError::new(
                "mcp_unavailable",
                e.to_string(),
            )),
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
        }
    }

    /// The executor's loop: ask the planner, do what it says, commit, repeat.
    async fn run_loop(
        &self,
        lease: &Lease,
        run: &RunRecord,
        shutdown: &CancellationToken,
    ) -> Result<LoopEnd, Stop> {
        let agent = self.agents.get(&run.agent).cloned().ok_or_else(|| {
            Stop::Fail(RunError {
                kind: ErrorKind::Internal,
                message: format!(
                    "agent `{}` is not defined on this worker; add jobs/{}.md",
                    run.agent, run.agent
                ),
            })
        })?;
        let mut tool_names = self.tools.allowed_for(&agent);
        let mut tool_specs = self.tools.specs(&tool_names);
        if crate::delegation::offered(&agent, run.tree.depth, &self.settings.delegation) {
            tool_specs.extend(crate::delegation::specs(&agent, &self.agents));
            tool_names.extend(crate::delegation::TOOL_NAMES.iter().map(|s| s.to_string()));
        }
        self.add_mcp_tools(&agent, &run.owner, &mut tool_names, &mut tool_specs)
            .await;
        // A subagent never gets a tool an ancestor's `tools:` list leaves out (delegation is
        // bounded by depth instead).
        if run.parent_run_id.is_some() {
            let chain = self.rule_chain(run).await?;
            tool_names.retain(|t| {
                crate::delegation::TOOL_NAMES.contains(&t.as_str())
                    || chain.ancestors().all(|a| lists(a, t))
            });
            tool_specs.retain(|s| tool_names.contains(&s.function.name));
        }
        let model = self.model_for(run, &agent).await?;
        let mut budget = Budget::resolve(
            &self.settings.context,
            &agent,
            run.limits.compact_at,
            &model,
        );
        let workspace = crate::tools::owner_workspace(&self.settings.workspace, &run.owner);

        // One bounded read of the thread per claim, from its latest compaction on; after that
        // the local copy is extended with exactly what this loop commits (and re-read after a
        // compaction).
        let mut ctx = self.load_context(run).await?;
        let input_key = format!("{}:input", run.id);
        let mut steps_done = run.step;
        // `step.started` of the next step rides on the commit that ends the previous one (or on
        // the input's), saving a commit per step; after a replay it is written on its own.
        let mut prestarted: Option<u32> = None;
        if run.step == 0 && !ctx.history.iter().any(|m| m.key == input_key) {
            let msg = NewMessage {
                step: 0,
                key: input_key,
                message: Message::User {
                    content: run.input.clone(),
                },
            };
            let events = self.next_step_event(run, 0).into_iter().collect::<Vec<_>>();
            prestarted = (!events.is_empty()).then_some(1);
            self.store
                .checkpoint(
                    lease,
                    Checkpoint {
                        messages: vec![msg.clone()],
                        events,
                        ..Default::default()
                    },
                )
                .await?;
            ctx.history.push(StoredMessage {
                id: i64::MAX,
                run_id: run.id,
                step: 0,
                key: msg.key,
                message: msg.message,
            });
            let event = if run.parent_run_id.is_some() {
                crate::policy::HookEvent::SubagentStart
            } else {
                crate::policy::HookEvent::RunStart
            };
            self.lifecycle_hooks(
                run,
                &agent,
                event,
                json!({"input": run.input, "parent_run_id": run.parent_run_id}),
            )
            .await;
        }
        // Compactions that failed in a row (or did not stop the provider refusing the request).
        let mut compaction_failures: u32 = 0;
        // The provider refused the last request as too long: compact before retrying it.
        let mut refused_too_long = false;
        // A step whose context could not be compacted further (it is all task and tail).
        let mut incompressible_step: Option<u32> = None;
        let mut usage = run.usage;
        // The step whose tool.started events went out with its assistant message.
        let mut announced_step: Option<u32> = None;
        loop {
            // A draining worker stops at a step boundary: everything so far is committed.
            if shutdown.is_cancelled() {
                return Ok(LoopEnd::Drained);
            }
            let mine: Vec<&StoredMessage> =
                ctx.history.iter().filter(|m| m.run_id == run.id).collect();
            let step = match plan(&mine, steps_done) {
                Next::Finish { result } => {
                    return Ok(LoopEnd::Finish(Finish::Succeeded {
                        result,
                        forced: run.forced,
                    }));
                }
                Next::RunTools {
                    step,
                    calls,
                    pending,
                } => {
                    let prior = prior_calls(&mine, step);
                    let announced = announced_step == Some(step);
                    let next = self.next_step_event(run, step);
                    let had_next = next.is_some();
                    let out = self
                        .run_tools(
                            lease,
                            run,
                            &agent,
                            &budget,
                            &workspace,
                            step,
                            &calls,
                            &pending,
                            &prior,
                            &tool_names,
                            announced,
                            next,
                        )
                        .await?;
                    if let Some(wait) = out.wait {
                        return Ok(LoopEnd::Park(wait));
                    }
                    prestarted = had_next.then_some(step + 1);
                    ctx.history
                        .extend(out.committed.into_iter().map(|m| StoredMessage {
                            id: i64::MAX,
                            run_id: run.id,
                            step: m.step,
                            key: m.key,
                            message: m.message,
                        }));
                    continue;
                }
                Next::CallModel { step } => step,
            };

            // A new step: one model call.
            let step_t0 = std::time::Instant::now();
            let over_budget = self.over_tree_budget(run, usage, steps_done).await?;
            let forced = steps_done >= run.limits.max_steps || over_budget;
            let span = info_span!("step", otel.name = format!("step {step}"), step, forced, gen_ai.request.model = %model, run_id = %run.id, thread_id = %run.thread_id);
            // The fleet's budgets for this model and for this owner: over either, park until
            // it frees up (no slot held).
            let model_limit = self.settings.rate_limits.by_model.get(&model).copied();
            let owner_limit = self.budgets.owner(&run.owner).await?;
            if model_limit.is_some() || owner_limit.is_some() {
                // A call counts from when it is taken here, the provider counts it from when it
                // arrives: a margin keeps the two windows from disagreeing at the edges.
                let window = self
                    .settings
                    .rate_limits
                    .window
                    .as_millis()
                    .min(i64::MAX as u128 / 2) as i64;
                let window = window + window / 10 + 100;
                let estimate = budget
                    .estimate(
                        &ctx.messages(&agent.system_prompt, run.id),
                        if forced { &[] } else { &tool_specs },
                    )
                    .0 as u64;
                // The owner's first: a call the owner may not make takes nothing from the model.
                let mut wake_at = None;
                if let Some(o) = owner_limit {
                    wake_at = self
                        .budgets
                        .take(
                            &format!("owner:{}", run.owner),
                            window,
                            o.rpm,
                            o.tpm,
                            estimate,
                        )
                        .await?;
                }
                if wake_at.is_none()
                    && let Some((requests, tokens)) = model_limit
                {
                    wake_at = self
                        .budgets
                        .take(
                            &format!("model:{model}"),
                            window,
                            requests,
                            tokens,
                            estimate,
                        )
                        .await?;
                }
                if let Some(at) = wake_at {
                    metrics::counter!("subagents_rate_limited_total").increment(1);
                    tracing::info!(model = %model, owner = %run.owner, wake_at = at, "a rate limit is used up; parking until it frees up");
                    return Ok(LoopEnd::Park(Wait {
                        wake_at: Some(at),
                        rate_limited: true,
                        ..Default::default()
                    }));
                }
            }
            // A model with no configured limit takes from no budget, but the provider's word
            // (its rate-limit headers, a 429) still holds the whole fleet back.
            if model_limit.is_none()
                && let Some(until) = self.budgets.blocked(&format!("model:{model}")).await?
            {
                // Spread the wake-ups over a little while after the reset (a quarter of the
                // wait, at most a second), so the parked runs do not all call at once.
                let spread = ((until - crate::store::now_ms()) / 4).clamp(1, 1000) as u128;
                let at = until + (uuid::Uuid::new_v4().as_u128() % spread) as i64;
                metrics::counter!("subagents_rate_limited_total").increment(1);
                tracing::info!(model = %model, wake_at = at, "the provider said the model's rate limit is used up; parking until it resets");
                return Ok(LoopEnd::Park(Wait {
                    wake_at: Some(at),
                    rate_limited: true,
                    ..Default::default()
                }));
            }
            if prestarted != Some(step) {
                self.store
                    .checkpoint(
                        lease,
                        Checkpoint {
                            events: vec![
                                Event::StepStarted(event::StepStarted { step, forced }).into(),
                            ],
                            ..Default::default()
                        },
                    )
                    .instrument(span.clone())
                    .await?;
                prestarted = Some(step);
            }
            let tools_now: &[crate::model::ToolSpec] = if forced { &[] } else { &tool_specs };
            let mut messages = ctx.messages(&agent.system_prompt, run.id);
            if forced {
                messages.push(Message::System {
                    content: FORCE_MESSAGE.into(),
                });
            }
            let (raw_estimate, estimate) = budget.estimate(&messages, tools_now);

            // Compact first when the request would not fit, or a new run starts on a long thread.
            let first_call = !mine
                .iter()
                .any(|m| matches!(m.message, Message::Assistant { .. }));
            let carried =
                ctx.compaction.is_some() || ctx.history.iter().any(|m| m.run_id != run.id);
            let reason = if refused_too_long {
                Some(Reason::ContextLength)
            } else if incompressible_step == Some(step) {
                None
            } else if estimate as u64 > budget.compact_at {
                Some(Reason::Threshold)
            } else if first_call && carried && estimate as u64 > budget.compact_at / 2 {
                Some(Reason::NewRun)
            } else {
                None
            };
            if let Some(reason) = reason {
                refused_too_long = false;
                // Compaction works on committed ids: read the context back first.
                ctx = self.load_context(run).await?;
                let outcome = self
                    .compact(
                        lease,
                        run,
                        &agent,
                        &budget,
                        &ctx,
                        tools_now,
                        reason,
                        step,
                        compaction_failures,
                    )
                    .instrument(span.clone())
                    .await?;
                match outcome {
                    Compacted::Done => {
                        ctx = self.load_context(run).await?;
                        continue;
                    }
                    Compacted::Nothing
                        if reason == Reason::ContextLength || estimate as u64 > budget.window =>
                    {
                        return Err(Stop::Fail(RunError {
                            kind: ErrorKind::Context,
                            message: format!(
                                "the next request needs about {estimate} tokens and model `{model}` holds {}; nothing more can be compacted (the system prompt, the task and the newest messages alone are too large). Give the agent a model with a larger window or set its context_window:, or shorten the task",
                                budget.window
                            ),
                        }));
                    }
                    Compacted::Nothing => {
                        tracing::debug!(
                            estimate,
                            "nothing to compact yet; calling the model as is"
                        );
                        incompressible_step = Some(step);
                        ctx = self.load_context(run).await?;
                        continue;
                    }
                    Compacted::Failed(why) => {
                        compaction_failures += 1;
                        tracing::warn!(failures = compaction_failures, %why, "compaction failed");
                        if compaction_failures >= MAX_COMPACTION_FAILURES {
                            return Err(Stop::Fail(RunError {
                                kind: ErrorKind::Context,
                                message: format!(
                                    "the context could not be compacted: {MAX_COMPACTION_FAILURES} compactions in a row failed; the last one: {why}"
                                ),
                            }));
                        }
                        ctx = self.load_context(run).await?;
                        continue;
                    }
                }
            }

            let resp = async {
                let req = ChatRequest {
                    model: model.clone(),
                    messages,
                    tools: tools_now.to_vec(),
                    step_key: format!("{}:{}", run.id, step),
                };
                let t0 = std::time::Instant::now();
                // Deltas follow the run's latest durable event (this step's `step.started`).
                let deltas = match &self.deltas {
                    Some(r) => Some(
                        r.delta_sink(
                            run.id,
                            self.store
                                .get_run(run.id)
                                .await?
                                .map(|r| r.event_seq)
                                .unwrap_or(0),
                        ),
                    ),
                    None => None,
                };
                let on_delta = |t: &str| {
                    if let Some(d) = &deltas {
                        d.send(t);
                    }
                };
                let chat = info_span!(
                    "chat",
                    otel.name = format!("chat {}", req.model),
                    otel.kind = "client",
                    otel.status_code = tracing::field::Empty,
                    gen_ai.operation.name = "chat",
                    gen_ai.provider.name = "openai",
                    gen_ai.request.model = %req.model,
                    gen_ai.usage.input_tokens = tracing::field::Empty,
                    gen_ai.usage.output_tokens = tracing::field::Empty,
                    gen_ai.response.finish_reasons = tracing::field::Empty,
                    error.r#type = tracing::field::Empty,
                    run_id = %run.id,
                    thread_id = %run.thread_id,
                    step,
                );
                let resp = self
                    .model
                    .complete(&req, &on_delta)
                    .instrument(chat.clone())
                    .await;
                match &resp {
                    Ok(r) => {
                        chat.record("gen_ai.usage.input_tokens", r.usage.prompt_tokens);
                        chat.record("gen_ai.usage.output_tokens", r.usage.completion_tokens);
                        if let Some(f) = &r.finish_reason {
                            chat.record("gen_ai.response.finish_reasons", f.as_str());
                        }
                    }
                    Err(e) => {
                        chat.record("otel.status_code", "ERROR");
                        chat.record("error.type", e.kind());
                    }
                }
                if let Some(d) = deltas {
                    d.finish().await;
                }
                let resp = match resp {
                    Ok(r) => r,
                    Err(e) => return Ok::<_, Stop>(Err(e)),
                };
                metrics::histogram!("subagents_model_call_seconds")
                    .record(t0.elapsed().as_secs_f64());
                metrics::counter!("subagents_tokens_total", "kind" => "prompt")
                    .increment(resp.usage.prompt_tokens);
                metrics::counter!("subagents_tokens_total", "kind" => "completion")
                    .increment(resp.usage.completion_tokens);
                tracing::info!(
                    ms = t0.elapsed().as_millis() as u64,
                    tool_calls = resp.tool_calls.len(),
                    estimated_tokens = estimate,
                    gen_ai.usage.input_tokens = resp.usage.prompt_tokens,
                    gen_ai.usage.output_tokens = resp.usage.completion_tokens,
                    "model responded"
                );
                Ok(Ok((resp, t0.elapsed().as_millis() as u64)))
            }
            .instrument(span.clone())
            .await?;
            let (resp, model_ms) = match resp {
                Ok((r, ms)) => (r.scrubbed(), ms),
                Err(crate::model::ModelError::ContextLength { status, body }) => {
                    // The model holds less than we thought: learn its window, compact, retry.
                    budget.too_long(raw_estimate, &body);
                    compaction_failures += 1;
                    tracing::warn!(
                        status,
                        estimate,
                        window = budget.window,
                        failures = compaction_failures,
                        "the provider refused the request as too long; compacting"
                    );
                    if compaction_failures >= MAX_COMPACTION_FAILURES {
                        return Err(Stop::Fail(RunError {
                            kind: ErrorKind::Context,
                            message: format!(
                                "model `{model}` refused the request as longer than its context window {MAX_COMPACTION_FAILURES} times in a row, compacting in between; set the agent's context_window: to the model's real window"
                            ),
                        }));
                    }
                    refused_too_long = true;
                    continue;
                }
                Err(crate::model::ModelError::RateLimited { retry_after, last }) => {
                    // The provider's limit, not our request: wait for it (no slot held), and
                    // tell the fleet when the model's budget is shared.
                    let at = crate::store::now_ms()
                        + retry_after.as_millis().min(i64::MAX as u128 / 2) as i64;
                    self.budgets.block(&format!("model:{model}"), at).await?;
                    metrics::counter!("subagents_rate_limited_total").increment(1);
                    tracing::warn!(model = %model, ?retry_after, error = %last, "the provider rate-limited every attempt; parking until it allows again");
                    return Ok(LoopEnd::Park(Wait {
                        wake_at: Some(at),
                        rate_limited: true,
                        ..Default::default()
                    }));
                }
                Err(e) => {
                    return Err(Stop::Fail(RunError {
                        kind: ErrorKind::Model,
                        message: model_error_message(&e),
                    }));
                }
            };
            // The provider says this call used up the model's budget: the fleet waits for the
            // reset instead of provoking 429s.
            if let Some(reset) = resp.budget_resets_in {
                let at =
                    crate::store::now_ms() + reset.as_millis().min(i64::MAX as u128 / 2) as i64;
                if let Err(e) = self.budgets.block(&format!("model:{model}"), at).await {
                    tracing::warn!(error = %e, "could not record the provider's rate-limit reset");
                }
            }
            budget.observe(raw_estimate, resp.usage.prompt_tokens);
            compaction_failures = 0;
            self.settings.failpoints.hit("after_model_response").await;
            usage.prompt_tokens += resp.usage.prompt_tokens;
            usage.completion_tokens += resp.usage.completion_tokens;

            let calls = if forced {
                vec![]
            } else {
                unique_call_ids(resp.tool_calls, step)
            };
            let message = Message::Assistant {
                content: resp.content.clone(),
                tool_calls: calls.clone(),
            };
            let key = format!("{}:{}:assistant", run.id, step);
            let cost = self.settings.prices.cost_nanos(&model, &resp.usage);
            if let Some(c) = cost {
                metrics::counter!("subagents_cost_nanodollars_total", "model" => model.clone())
                    .increment(c);
            }
            let model_event: NewEvent = Event::ModelCompleted(event::ModelCompleted {
                step,
                tool_calls: calls.iter().map(|c| c.function.name.clone()).collect(),
                usage: resp.usage,
                finish_reason: resp.finish_reason.clone(),
                model: model.clone(),
                ms: model_ms,
                cost_usd: cost.map(crate::model::prices::dollars),
            })
            .into();
            let mut cp = Checkpoint {
                messages: vec![NewMessage { step, key, message }],
                events: vec![model_event],
                step: Some(step),
                usage: resp.usage,
                cost_nanos: cost.unwrap_or(0),
                ..Default::default()
            };
            if calls.is_empty() {
                // The final answer: message, events and terminal state in one commit.
                let result = resp.content.unwrap_or_default();
                cp.events
                    .push(Event::StepCompleted(event::StepCompleted { step }).into());
                cp.events.push(
                    Event::RunSucceeded(event::RunSucceeded {
                        result: result.clone(),
                        forced,
                    })
                    .into(),
                );
                cp.finish = Some(Finish::Succeeded {
                    result: result.clone(),
                    forced,
                });
                self.store.checkpoint(lease, cp).instrument(span).await?;
                metrics::counter!("subagents_runs_finished_total", "status" => "succeeded")
                    .increment(1);
                tracing::info!(forced, steps = step, "run succeeded");
                let event = if run.parent_run_id.is_some() {
                    crate::policy::HookEvent::SubagentStop
                } else {
                    crate::policy::HookEvent::Stop
                };
                self.lifecycle_hooks(run, &agent, event, json!({"result": result, "steps": step}))
                    .await;
                return Ok(LoopEnd::Committed);
            }
            // Announce the calls that will run as ordinary tools in the same commit.
            let refused = refusals(&prior_calls(&mine, step), &calls);
            for c in &calls {
                let name = c.function.name.as_str();
                let plain = tool_names.iter().any(|t| t == name)
                    && !crate::delegation::TOOL_NAMES.contains(&name);
                if plain && !refused.get(&c.id).copied().unwrap_or(false) {
                    cp.events
                        .push(Event::ToolStarted(tool_started(step, c, run.crashes)).into());
                }
            }
            let committed = cp.messages[0].clone();
            self.store.checkpoint(lease, cp).instrument(span).await?;
            steps_done = step;
            announced_step = Some(step);
            // The store holds exactly what we just wrote: extend the local copy, no re-read.
            ctx.history.push(StoredMessage {
                id: i64::MAX,
                run_id: run.id,
                step,
                key: committed.key,
                message: committed.message,
            });
            metrics::histogram!("subagents_step_seconds").record(step_t0.elapsed().as_secs_f64());
        }
    }

    /// Runs a step's pending calls concurrently; each result commits as soon as it is ready,
    /// and the last one carries `step.completed`. Delegation calls that must wait are merged
    /// into one [`Wait`] (the run then parks; the earliest deadline wins).
    #[allow(clippy::too_many_arguments)]
    async fn run_tools(
        &self,
        lease: &Lease,
        run: &RunRecord,
        agent: &AgentDef,
        budget: &Budget,
        workspace: &std::path::Path,
        step: u32,
        all_calls: &[ToolCall],
        pending: &[ToolCall],
        prior: &[(String, String)],
        allowed: &[String],
        announced: bool,
        next_step: Option<NewEvent>,
    ) -> Result<ToolsOutcome, Stop> {
        let refused = refusals(prior, all_calls);
        let remaining = tokio::sync::Mutex::new(pending.len());
        let next_step = &next_step;
        let futs = pending.iter().map(|call| {
            let remaining = &remaining;
            let refused = refused.get(&call.id).copied().unwrap_or(false);
            let span = info_span!(
                "tool",
                otel.name = format!("execute_tool {}", call.function.name),
                gen_ai.operation.name = "execute_tool",
                gen_ai.tool.name = %call.function.name,
                gen_ai.tool.call.id = %call.id,
                tool = %call.function.name,
                call_id = %call.id,
                step,
                run_id = %run.id,
                thread_id = %run.thread_id,
                error.r#type = tracing::field::Empty,
                otel.status_code = tracing::field::Empty,
            );
            async move {
                let key = format!("{}:{}:{}", run.id, step, call.id);
                let delegation = crate::delegation::TOOL_NAMES.contains(&call.function.name.as_str())
                    && allowed.iter().any(|a| a == &call.function.name);
                let call_t0 = std::time::Instant::now();
                let (text, ok, truncated) = if refused {
                    tracing::warn!("identical call repeated 3 times; not executed");
                    (LOOP_MESSAGE.to_owned(), false, false)
                } else if delegation {
                    match self.gate(lease, run, agent, step, call, &key, workspace).await? {
                        Gate::Park(wait) => return Ok::<_, Stop>((Some(wait), None)),
                        Gate::Refuse(text) => (text, false, false),
                        Gate::Run { arguments, .. } => match self.delegation_ctx(run, agent).call(&call.function.name, &arguments, &call.id).await? {
                            crate::delegation::Call::Park(wait) => return Ok::<_, Stop>((Some(wait), None)),
                            crate::delegation::Call::Done(Answer { text, ok }) => (text, ok, false),
                        },
                    }
                } else if !allowed.iter().any(|a| a == &call.function.name) {
                    (format!("error[unknown_tool]: `{}` is not available to agent `{}`; use one of: {}", call.function.name, agent.name, allowed.join(", ")), false, false)
                } else if !announced && self.crashes_under(run, step, &call.id).await? >= MAX_CRASHES_UNDER_A_CALL {
                    // Its worker died every time this call ran: run it again and the fleet
                    // loses another worker. The model hears why instead.
                    tracing::error!(tool = %call.function.name, "this call's worker died each of the last times it ran; not running it again");
                    metrics::counter!("subagents_tool_crash_refusals_total").increment(1);
                    (format!("error[tool_crashed]: this call was started {MAX_CRASHES_UNDER_A_CALL} times and its worker died each time before it returned; it was not run again. Do not repeat it: try a smaller or different call."), false, false)
                } else {
                    // A fresh step announced its tools with its assistant message (one commit
                    // fewer per call); a replayed call announces itself again.
                    if !announced {
                        self.store
                            .checkpoint(lease, Checkpoint {
                                events: vec![Event::ToolStarted(tool_started(step, call, run.crashes)).into()],
                                ..Default::default()
                            })
                            .await?;
                    }
                    match self.gate(lease, run, agent, step, call, &key, workspace).await? {
                        Gate::Park(wait) => return Ok::<_, Stop>((Some(wait), None)),
                        Gate::Refuse(text) => (text, false, false),
                        Gate::Run { arguments, context } => {
                            // A search shows only the files the run's read rules let it read.
                            let readable = if matches!(call.function.name.as_str(), "grep" | "glob") { Some(self.rule_chain(run).await?.readable()) } else { None };
                            let ctx = ToolCtx { workspace: workspace.to_owned(), idempotency_key: key.clone(), output_limit: budget.page_bytes(), readable };
                            let t0 = std::time::Instant::now();
                            let limit = self.settings.tool_timeout;
                            let out = tokio::time::timeout(limit, self.execute_tool(&call.function.name, &arguments, &ctx, &run.owner)).await;
                            // A tool that held its thread past the limit returns late rather
                            // than being cut: it still timed out.
                            let late = t0.elapsed() > limit;
                            let (mut text, ok) = match out {
                                Ok(Ok(t)) if !late => (t, true),
                                Ok(Err(e)) if !late => (e.to_string(), false),
                                _ => (format!("error[tool_timeout]: the tool did not finish within {}s and was stopped", limit.as_secs_f64()), false),
                            };
                            self.settings.failpoints.hit("after_tool_run").await;
                            crate::model::scrub_nul(&mut text);
                            tracing::info!(ok, ms = t0.elapsed().as_millis() as u64, bytes = text.len(), "tool finished");
                            let mut text = self.after_tool(run, agent, call, &arguments, text, ok, workspace).await;
                            for c in context {
                                text.push_str(&format!("\n[hook context] {c}"));
                            }
                            let (text, offloaded) = self.fit_result(budget, workspace, run.id, &call.id, text).await;
                            (text, ok, offloaded)
                        }
                    }
                };
                self.settings.failpoints.hit("before_tool_commit").await;
                if !ok {
                    let span = tracing::Span::current();
                    span.record("otel.status_code", "ERROR");
                    span.record("error.type", if refused { "loop_refused" } else { "tool_error" });
                }
                let preview: String = text.chars().take(200).collect();
                let mut events: Vec<NewEvent> = vec![Event::ToolCompleted(event::ToolCompleted {
                    step,
                    call_id: call.id.clone(),
                    tool: call.function.name.clone(),
                    ok,
                    truncated,
                    offloaded: truncated,
                    refused,
                    preview,
                    ms: call_t0.elapsed().as_millis() as u64,
                })
                .into()];
                // Serialize the commits of this step so exactly the last one closes the step.
                let mut left = remaining.lock().await;
                *left -= 1;
                if *left == 0 {
                    events.push(Event::StepCompleted(event::StepCompleted { step }).into());
                    events.extend(next_step.clone());
                }
                let msg = NewMessage {
                    step,
                    key: format!("{}:{}:tool:{}", run.id, step, call.id),
                    message: Message::Tool { tool_call_id: call.id.clone(), content: text },
                };
                self.store.checkpoint(lease, Checkpoint { messages: vec![msg.clone()], events, ..Default::default() }).await?;
                Ok::<_, Stop>((None, Some(msg)))
            }
            .instrument(span)
        });
        let mut wait: Option<Wait> = None;
        let mut committed = vec![];
        for r in futures::future::join_all(futs).await {
            let (parked, msg) = r?;
            committed.extend(msg);
            if let Some(w) = parked {
                wait = Some(match wait {
                    None => w,
                    Some(acc) => acc.merge(w),
                });
            }
        }
        Ok(ToolsOutcome { committed, wait })
    }

    /// How many times the worker running this call died before its result committed: each
    /// `tool.started` of the call whose run crashed (its lease expired) before the next start.
    /// Read only when a call is replayed, which is rare.
    async fn crashes_under(&self, run: &RunRecord, step: u32, call_id: &str) -> Result<u32, Stop> {
        let events = self.store.events_after(run.id, 0, 100_000).await?;
        let starts: Vec<u32> = events
            .iter()
            .filter_map(|e| match Event::parse(&e.kind, &e.data) {
                Some(Event::ToolStarted(t)) if t.step == step && t.call_id == call_id => {
                    Some(t.crashes)
                }
                _ => None,
            })
            .collect();
        let next = starts
            .iter()
            .skip(1)
            .copied()
            .chain(std::iter::once(run.crashes));
        Ok(starts
            .iter()
            .zip(next)
            .filter(|(at, after)| after > at)
            .count() as u32)
    }
}

fn ended(run: &RunRecord) -> crate::runs::Ended {
    crate::runs::Ended {
        run_id: run.id,
        thread_id: run.thread_id.clone(),
        is_child: run.parent_run_id.is_some(),
    }
}

/// When the run's wall-time limit ends (Unix ms), counted from its first start.
fn run_deadline_ms(run: &RunRecord) -> Option<i64> {
    let started = run.started_at?.timestamp_millis();
    let limit = i64::try_from(run.limits.timeout_secs)
        .ok()?
        .checked_mul(1000)?;
    started.checked_add(limit)
}

/// Renews the lease every third of its length (at least every second, so a cancel from another
/// process is seen within a second; one from this process wakes it at once); trips `cancel`
/// when a cancel was requested and `lost` when the lease is gone. A failed renewal (database
/// briefly away) is retried until the lease would have expired.
async fn heartbeat(
    store: Arc<dyn RunLog>,
    lease: Lease,
    cancel: CancellationToken,
    lost: CancellationToken,
) {
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

/// The model's view of the thread: every committed message in order, each step's tool results
/// right after its assistant message in the order of its calls (they commit in completion
/// order, which a replay cannot reproduce). Calls left unanswered by an earlier run that ended
/// mid-step get a placeholder result, because the API rejects dangling tool calls.
pub fn context(history: &[StoredMessage], current: RunId) -> Vec<Message> {
    let results: HashMap<(RunId, u32, &str), &Message> = history
        .iter()
        .filter_map(|m| match &m.message {
            Message::Tool { tool_call_id, .. } => {
                Some(((m.run_id, m.step, tool_call_id.as_str()), &m.message))
            }
            _ => None,
        })
        .collect();
    let mut out = Vec::with_capacity(history.len());
    for m in history {
        match &m.message {
            Message::Tool { .. } => {}
            Message::Assistant { tool_calls, .. } => {
                out.push(m.message.clone());
                for c in tool_calls {
                    match results.get(&(m.run_id, m.step, c.id.as_str())) {
                        Some(r) => out.push((*r).clone()),
                        None if m.run_id != current => out.push(Message::Tool {
                            tool_call_id: c.id.clone(),
                            content: "[no result: the run ended before this call completed]".into(),
                        }),
                        None => {}
                    }
                }
            }
            _ => out.push(m.message.clone()),
        }
    }
    out
}

/// Loop detection over the run's whole call sequence, in order, so a replay decides the same
/// way: a call identical to the two before it is refused.
fn refusals(prior: &[(String, String)], calls: &[ToolCall]) -> HashMap<String, bool> {
    let mut seq: Vec<(String, String)> = prior.to_vec();
    let mut refused = HashMap::new();
    for c in calls {
        let sig = (
            c.function.name.clone(),
            canonical_args(&c.function.arguments),
        );
        let n = seq.len();
        refused.insert(
            c.id.clone(),
            n >= 2 && seq[n - 1] == sig && seq[n - 2] == sig,
        );
        seq.push(sig);
    }
    refused
}

/// Every call this run made before `step`, flattened in order, as (name, canonical args).
fn prior_calls(mine: &[&StoredMessage], step: u32) -> Vec<(String, String)> {
    mine.iter()
        .filter(|m| m.step < step)
        .filter_map(|m| match &m.message {
            Message::Assistant { tool_calls, .. } => Some(tool_calls),
            _ => None,
        })
        .flatten()
        .map(|c| {
            (
                c.function.name.clone(),
                canonical_args(&c.function.arguments),
            )
        })
        .collect()
}

/// Arguments compared as JSON values, so key order and spacing do not hide a repeat.
fn canonical_args(raw: &str) -> String {
    serde_json::from_str::<serde_json::Value>(raw)
        .map(|v| v.to_string())
        .unwrap_or_else(|_| raw.trim().to_owned())
}

/// Call ids key the checkpoints of tool results, so they must be unique and non-empty within a
/// step; models occasionally repeat or omit them.
fn unique_call_ids(calls: Vec<ToolCall>, step: u32) -> Vec<ToolCall> {
    let mut seen = HashSet::new();
    calls
        .into_iter()
        .enumerate()
        .map(|(i, mut c)| {
            let ok_chars =
                c.id.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
            if c.id.is_empty() || !ok_chars || !seen.insert(c.id.clone()) {
                c.id = format!("call_s{step}_{i}");
                seen.insert(c.id.clone());
            }
            c
        })
        .collect()
}

fn model_error_message(e: &ModelError) -> String {
    match e {
        ModelError::Rejected {
            status: 401 | 403, ..
        } => format!("{e} (check OPENAI_API_KEY)"),
        ModelError::Rejected { status: 404, .. } => {
            format!("{e} (check OPENAI_BASE_URL and the model name)")
        }
        _ => e.to_string(),
    }
}

/// Bytes of a call's arguments a `tool.started` event carries (the full call is in the thread).
const EVENT_ARGUMENTS_BYTES: usize = 2000;

/// `tool.started`: which call, and its arguments (cut), so a timeline shows what was asked.
/// Whether `agent`'s `tools:` list (none: every tool) names `tool`, directly, through Claude
/// Code's name, or as one of an MCP server's tools.
fn lists(agent: &AgentDef, tool: &str) -> bool {
    let Some(list) = &agent.tools else {
        return true;
    };
    list.iter().any(|n| match crate::tools::lookup(n) {
        crate::tools::Named::Tool(t) => t == tool,
        crate::tools::Named::Mcp => {
            let n = n.trim();
            tool == n || tool.starts_with(&format!("{n}__"))
        }
        crate::tools::Named::Unavailable(_) => n.trim() == tool,
        crate::tools::Named::Delegation => false,
    })
}

/// `tool.started`'s data; `crashes` is the run's count when the call started, so a replay can
/// tell how often the call's worker died under it (see [`Engine::crashes_under`]).
fn tool_started(step: u32, call: &crate::model::ToolCall, crashes: u32) -> event::ToolStarted {
    let args = &call.function.arguments;
    let cut = if args.len() > EVENT_ARGUMENTS_BYTES {
        let mut end = EVENT_ARGUMENTS_BYTES;
        while !args.is_char_boundary(end) {
            end -= 1;
        }
        format!("{}…", &args[..end])
    } else {
        args.clone()
    };
    event::ToolStarted {
        step,
        call_id: call.id.clone(),
        tool: call.function.name.clone(),
        arguments: cut,
        crashes,
    }
}
