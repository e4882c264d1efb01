//! The engine: one run's step loop. It rebuilds the run's state from committed messages and
//! continues from there, so a fresh start and a resume after a crash are the same code path
//! (steno's "replay, don't redo"):
//!
//! - an assistant message with tool calls commits before any tool runs;
//! - each tool result commits as soon as its tool returns, with the same idempotency key on a
//!   replay; a call with a committed result is never run again;
//! - a committed model response is never requested again;
//! - every write is fenced by the run's lease epoch; a lost lease stops the loop at once.
//!
//! Limits (steps, tokens, wall time, tool time, tool output) all end in a defined outcome.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info_span};

use crate::agents::{AgentDef, AgentRegistry};
use crate::delegation::DelegationSettings;
use crate::queue::Queue;
use crate::ids::RunId;
use crate::model::{ChatModel, ChatRequest, Message, ModelError, ToolCall};
use crate::store::{
    Checkpoint, Claim, ErrorKind, EventKind, Finish, Lease, NewEvent, NewMessage, RunError, RunRecord, Store, StoreError,
    StoredMessage,
};
use crate::tools::{ToolCtx, ToolRegistry, truncate_output};

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
    /// Root of every tool path.
    pub workspace: PathBuf,
    /// Lease length; renewed every third of it.
    pub lease_ttl: Duration,
    /// Claims before a run whose workers keep dying fails with `kind=lost`.
    pub max_attempts: u32,
    /// Limit on one tool call.
    pub tool_timeout: Duration,
    /// Tool output beyond this many bytes is cut, with a marker.
    pub tool_output_limit: usize,
    /// Delegation limits.
    pub delegation: DelegationSettings,
    /// Largest input a child run may be given.
    pub max_input_bytes: usize,
}

/// Where a finished run sat: what its worker must tell others (the thread's next run, the
/// parent) without reading the run again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ended {
    /// Its thread.
    pub thread_id: crate::ids::ThreadId,
    /// Its parent, if it was a child.
    pub parent_run_id: Option<RunId>,
}

/// What one execution attempt ended with (the run's own outcome is in the store).
#[derive(Debug, PartialEq, Eq)]
pub enum Executed {
    /// The run reached a terminal state here (`None`: failed as lost at claim time).
    Finished(Option<Ended>),
    /// Nothing to do: finished already, or another worker holds it.
    Skipped,
    /// Another worker took the run over (our lease expired); we stopped.
    LeaseLost,
    /// We were shutting down and gave the run back to the queue.
    Released,
    /// The run parked (`waiting`) on its children and left the worker.
    Parked,
}

/// Runs the step loop for claimed runs.
pub struct Engine {
    /// Storage.
    pub store: Arc<dyn Store>,
    /// Agent definitions.
    pub agents: Arc<AgentRegistry>,
    /// Tools.
    pub tools: Arc<ToolRegistry>,
    /// The model.
    pub model: Arc<dyn ChatModel>,
    /// For starting children and waking parents.
    pub queue: Queue,
    /// Where token deltas go (Redis only), if configured.
    pub deltas: Option<crate::relay::RedisEvents>,
    /// Settings.
    pub settings: EngineSettings,
}

/// How the step loop ended.
enum LoopEnd {
    /// The final answer and terminal state are committed.
    Committed,
    /// The run must be finished with this.
    Finish(Finish),
    /// The run parked on its children.
    Parked,
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

impl Engine {
    /// Claims and executes one run until it ends, is handed over, or `shutdown` fires.
    pub async fn execute(&self, run_id: RunId, worker: &str, shutdown: &CancellationToken) -> Result<Executed, StoreError> {
        let s = &self.settings;
        let (lease, run) = match self.store.claim_run(run_id, worker, s.lease_ttl, s.max_attempts).await? {
            Claim::Acquired(lease, run) => (lease, *run),
            Claim::GaveUp => {
                tracing::warn!(%run_id, "run abandoned by too many workers; failed with kind=lost");
                return Ok(Executed::Finished(None));
            }
            Claim::NotClaimable(status) => {
                tracing::debug!(%run_id, ?status, "run not claimable; skipping job");
                return Ok(Executed::Skipped);
            }
        };
        let span = info_span!("run", run_id = %run.id, agent = %run.agent, thread_id = %run.thread_id, attempt = run.attempts);
        self.execute_claimed(lease, run, shutdown).instrument(span).await
    }

    async fn execute_claimed(&self, lease: Lease, run: RunRecord, shutdown: &CancellationToken) -> Result<Executed, StoreError> {
        tracing::info!(step = run.step, "run claimed");
        let cancel = CancellationToken::new();
        let lost = CancellationToken::new();
        let heartbeat = tokio::spawn(heartbeat(self.store.clone(), lease.clone(), cancel.clone(), lost.clone()));
        let _stop_heartbeat = AbortOnDrop(heartbeat);

        // Limits are validated at start; still, stored data must never make the engine panic.
        let started = run.started_at.unwrap_or_else(chrono::Utc::now);
        let limit = chrono::Duration::try_seconds(run.limits.timeout_secs.min(i64::MAX as u64 / 1000) as i64).unwrap_or(chrono::Duration::MAX);
        let deadline_in = started
            .checked_add_signed(limit)
            .map(|d| (d - chrono::Utc::now()).to_std().unwrap_or(Duration::ZERO))
            .unwrap_or(Duration::MAX / 4);
        let result = tokio::select! {
            r = self.run_loop(&lease, &run) => Ok(r),
            _ = cancel.cancelled() => Err("cancel"),
            _ = lost.cancelled() => Err("lost"),
            _ = shutdown.cancelled() => Err("shutdown"),
            _ = tokio::time::sleep(deadline_in) => Err("timeout"),
        };
        let finish = match result {
            Ok(Ok(LoopEnd::Committed)) => {
                self.end_children(&run).await;
                return Ok(Executed::Finished(Some(ended(&run))));
            }
            Ok(Ok(LoopEnd::Parked)) => return Ok(Executed::Parked),
            Ok(Ok(LoopEnd::Finish(finish))) => finish,
            Ok(Err(Stop::Fail(e))) => Finish::Failed(e),
            Ok(Err(Stop::Store(StoreError::LeaseLost(_)))) | Err("lost") => {
                tracing::warn!("lease lost: another worker owns this run now; dropping it");
                return Ok(Executed::LeaseLost);
            }
            Ok(Err(Stop::Store(e))) => {
                // Give the run back at once so a retry (or another worker) resumes it from the
                // last checkpoint instead of waiting for the lease to expire.
                tracing::error!(error = %e, "storage failed mid-run; releasing the run for a retry");
                let _ = self.store.release_lease(&lease).await;
                return Err(e);
            }
            Err("cancel") => Finish::Cancelled,
            Err("shutdown") => {
                tracing::info!("shutting down: releasing the run to the queue");
                self.store.release_lease(&lease).await?;
                return Ok(Executed::Released);
            }
            Err(_) => Finish::Failed(RunError {
                kind: ErrorKind::Timeout,
                message: format!("the run exceeded its wall-time limit of {}s", run.limits.timeout_secs),
            }),
        };
        let event = match &finish {
            Finish::Succeeded { result, forced } => NewEvent::new(
                EventKind::RunSucceeded,
                json!({"result": result, "forced": forced}),
            ),
            Finish::Failed(e) => NewEvent::new(EventKind::RunFailed, json!({"error": e})),
            Finish::Cancelled => NewEvent::new(EventKind::RunCancelled, json!({})),
        };
        let status = match &finish {
            Finish::Succeeded { .. } => "succeeded",
            Finish::Failed(_) => "failed",
            Finish::Cancelled => "cancelled",
        };
        metrics::counter!("subagents_runs_finished_total", "status" => status).increment(1);
        match &finish {
            Finish::Succeeded { forced, .. } => tracing::info!(forced, "run succeeded"),
            Finish::Failed(e) => tracing::warn!(kind = e.kind.as_str(), error = %e.message, "run failed"),
            Finish::Cancelled => tracing::info!("run cancelled"),
        }
        match self.store.checkpoint(&lease, Checkpoint { events: vec![event], finish: Some(finish), ..Default::default() }).await {
            Ok(()) => {
                self.end_children(&run).await;
                Ok(Executed::Finished(Some(ended(&run))))
            }
            Err(StoreError::LeaseLost(_)) => Ok(Executed::LeaseLost),
            Err(e) => {
                let _ = self.store.release_lease(&lease).await;
                Err(e)
            }
        }
    }

    /// Whether the tree this run belongs to has used up its token or step budget (set on the
    /// root, inherited by every descendant). Only asks the database when a budget is set.
    async fn over_tree_budget(&self, run: &RunRecord, own: crate::model::Usage, own_steps: u32) -> Result<bool, Stop> {
        let l = &run.limits;
        if l.max_total_tokens.is_none() && l.max_total_steps.is_none() {
            return Ok(false);
        }
        let (tokens, steps) = match run.tree.root_run_id {
            // A root counts its own (possibly not yet visible) usage plus its descendants'.
            None => {
                let (tree, tree_steps) = self.store.tree_usage(run.id).await?;
                (tree.total().max(own.total()), tree_steps.max(u64::from(own_steps)))
            }
            Some(root) => {
                let (tree, tree_steps) = self.store.tree_usage(root).await?;
                (tree.total(), tree_steps)
            }
        };
        Ok(l.max_total_tokens.is_some_and(|m| tokens >= m) || l.max_total_steps.is_some_and(|m| steps >= m))
    }

    /// The `step.started` event of the step after `done`, when it can be known without asking
    /// the database (no tree budget to check); `None` means "write it on its own".
    fn next_step_event(&self, run: &RunRecord, done: u32) -> Option<NewEvent> {
        if run.limits.max_total_tokens.is_some() || run.limits.max_total_steps.is_some() {
            return None;
        }
        Some(NewEvent::new(EventKind::StepStarted, json!({"step": done + 1, "forced": done >= run.limits.max_steps})))
    }

    /// A parent that ends cancels its still-running attached children. A run whose agent was
    /// never offered the delegation tools has none, and costs no query.
    async fn end_children(&self, run: &RunRecord) {
        let may_delegate = self
            .agents
            .get(&run.agent)
            .is_none_or(|a| crate::delegation::offered(a, run.tree.depth, &self.settings.delegation));
        if !may_delegate {
            return;
        }
        if let Err(e) = crate::delegation::cancel_attached_children(self.store.as_ref(), run.id).await {
            tracing::warn!(error = %e, "could not cancel the children of a finished run");
        }
    }

    fn delegation_ctx<'a>(&'a self, run: &'a RunRecord, agent: &'a AgentDef) -> crate::delegation::Ctx<'a> {
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

    /// Parks the run: `running → waiting` with the lease given up. Then looks once more at what
    /// it waits for, since a child may have ended (or a cancel arrived) just before the park
    /// committed, when nobody could wake it.
    async fn park(&self, lease: &Lease, run: &RunRecord, agent: &AgentDef, step: u32, wake_at: Option<i64>, pending: &[ToolCall]) -> Result<LoopEnd, Stop> {
        self.store
            .checkpoint(lease, Checkpoint {
                events: vec![NewEvent::new(EventKind::RunWaiting, json!({"step": step, "wake_at": wake_at}))],
                park: Some(wake_at),
                ..Default::default()
            })
            .await?;
        tracing::info!(step, ?wake_at, "parked: waiting for children");
        let now = self.store.get_run(run.id).await?;
        if now.as_ref().is_some_and(|r| r.cancel_requested) {
            crate::delegation::cancel_tree(self.store.as_ref(), run.id).await?;
            return Ok(LoopEnd::Parked);
        }
        let ctx = self.delegation_ctx(run, agent);
        for call in pending.iter().filter(|c| crate::delegation::TOOL_NAMES.contains(&c.function.name.as_str())) {
            if let crate::delegation::Call::Done(_) = ctx.call(&call.function.name, &call.function.arguments, &call.id).await? {
                crate::delegation::wake(self.store.as_ref(), &self.queue, run.id).await?;
                break;
            }
        }
        Ok(LoopEnd::Parked)
    }

    /// The step loop. Returns the final answer; every intermediate write is committed inside.
    async fn run_loop(&self, lease: &Lease, run: &RunRecord) -> Result<LoopEnd, Stop> {
        let agent = self.agents.get(&run.agent).cloned().ok_or_else(|| {
            Stop::Fail(RunError {
                kind: ErrorKind::Internal,
                message: format!("agent `{}` is not defined on this worker; add jobs/{}.md", run.agent, run.agent),
            })
        })?;
        let mut tool_names = self.tools.allowed_for(&agent);
        let mut tool_specs = self.tools.specs(&tool_names);
        if crate::delegation::offered(&agent, run.tree.depth, &self.settings.delegation) {
            tool_specs.extend(crate::delegation::specs(&agent, &self.agents));
            tool_names.extend(crate::delegation::TOOL_NAMES.iter().map(|s| s.to_string()));
        }
        let model = agent.model.clone().unwrap_or_else(|| self.settings.default_model.clone());

        let mut history = self.store.thread_messages(&run.thread_id).await?;
        // `step.started` of the next step rides on the commit that ends the previous one (or on
        // the input's), saving a commit per step; after a replay it is written on its own.
        let mut prestarted: Option<u32> = None;
        let input_key = format!("{}:input", run.id);
        if !history.iter().any(|m| m.key == input_key) {
            let msg = NewMessage { step: 0, key: input_key, message: Message::User { content: run.input.clone() } };
            let events = self.next_step_event(run, 0).into_iter().collect::<Vec<_>>();
            prestarted = (!events.is_empty()).then_some(1);
            self.store.checkpoint(lease, Checkpoint { messages: vec![msg], events, ..Default::default() }).await?;
            history = self.store.thread_messages(&run.thread_id).await?;
        }
        let mut usage = run.usage;
        // The step whose tool.started events went out with its assistant message.
        let mut announced_step: Option<u32> = None;
        loop {
            let mine: Vec<&StoredMessage> = history.iter().filter(|m| m.run_id == run.id).collect();
            let steps_done = mine.iter().filter(|m| matches!(m.message, Message::Assistant { .. })).count() as u32;
            // A committed final answer (crash between it and the status write) ends the run.
            if let Some(last) = mine.iter().rev().find(|m| matches!(m.message, Message::Assistant { .. })) {
                if let Message::Assistant { content, tool_calls } = &last.message {
                    if tool_calls.is_empty() {
                        let result = content.clone().unwrap_or_default();
                        return Ok(LoopEnd::Finish(Finish::Succeeded { result, forced: run.forced }));
                    }
                    let answered: HashSet<&str> = mine
                        .iter()
                        .filter_map(|m| match &m.message {
                            Message::Tool { tool_call_id, .. } if m.step == last.step => Some(tool_call_id.as_str()),
                            _ => None,
                        })
                        .collect();
                    let pending: Vec<ToolCall> =
                        tool_calls.iter().filter(|c| !answered.contains(c.id.as_str())).cloned().collect();
                    if !pending.is_empty() {
                        let prior = prior_calls(&mine, last.step);
                        let announced = announced_step == Some(last.step);
                        let next = self.next_step_event(run, last.step);
                        let had_next = next.is_some();
                        let step = last.step;
                        let (parked, committed) =
                            self.run_tools(lease, run, &agent, step, tool_calls, &pending, &prior, &tool_names, announced, next).await?;
                        if let Some(wake_at) = parked {
                            return self.park(lease, run, &agent, step, wake_at, &pending).await;
                        }
                        prestarted = had_next.then_some(step + 1);
                        // What was committed is known: extend the local copy instead of re-reading.
                        history.extend(committed.into_iter().map(|m| StoredMessage {
                            id: i64::MAX,
                            run_id: run.id,
                            step: m.step,
                            key: m.key,
                            message: m.message,
                        }));
                        continue;
                    }
                }
            }

            // A new step: one model call.
            let step = steps_done + 1;
            let step_t0 = std::time::Instant::now();
            let over_budget = self.over_tree_budget(run, usage, steps_done).await?;
            let forced = steps_done >= run.limits.max_steps || over_budget;
            let span = info_span!("step", step, forced, gen_ai.request.model = %model);
            let resp = async {
                if prestarted != Some(step) {
                    self.store
                        .checkpoint(lease, Checkpoint { events: vec![NewEvent::new(EventKind::StepStarted, json!({"step": step, "forced": forced}))], ..Default::default() })
                        .await?;
                }
                let mut messages = vec![Message::System { content: agent.system_prompt.clone() }];
                messages.extend(context(&history, run.id));
                if forced {
                    messages.push(Message::System { content: FORCE_MESSAGE.into() });
                }
                let req = ChatRequest {
                    model: model.clone(),
                    messages,
                    tools: if forced { vec![] } else { tool_specs.clone() },
                    step_key: format!("{}:{}", run.id, step),
                };
                let t0 = std::time::Instant::now();
                // Deltas follow the run's latest durable event (this step's `step.started`).
                let deltas = match &self.deltas {
                    Some(r) => Some(r.delta_sink(run.id, self.store.get_run(run.id).await?.map(|r| r.event_seq).unwrap_or(0))),
                    None => None,
                };
                let on_delta = |t: &str| {
                    if let Some(d) = &deltas {
                        d.send(t);
                    }
                };
                let resp = self.model.complete(&req, &on_delta).await;
                if let Some(d) = deltas {
                    d.finish().await;
                }
                let resp = resp.map_err(|e| {
                    Stop::Fail(RunError { kind: ErrorKind::Model, message: model_error_message(&e) })
                })?;
                metrics::histogram!("subagents_model_call_seconds").record(t0.elapsed().as_secs_f64());
                metrics::counter!("subagents_tokens_total", "kind" => "prompt").increment(resp.usage.prompt_tokens);
                metrics::counter!("subagents_tokens_total", "kind" => "completion").increment(resp.usage.completion_tokens);
                tracing::info!(
                    ms = t0.elapsed().as_millis() as u64,
                    tool_calls = resp.tool_calls.len(),
                    gen_ai.usage.input_tokens = resp.usage.prompt_tokens,
                    gen_ai.usage.output_tokens = resp.usage.completion_tokens,
                    "model responded"
                );
                Ok::<_, Stop>(resp)
            }
            .instrument(span.clone())
            .await?;
            usage.prompt_tokens += resp.usage.prompt_tokens;
            usage.completion_tokens += resp.usage.completion_tokens;

            let calls = if forced { vec![] } else { unique_call_ids(resp.tool_calls, step) };
            let message = Message::Assistant { content: resp.content.clone(), tool_calls: calls.clone() };
            let key = format!("{}:{}:assistant", run.id, step);
            let model_event = NewEvent::new(
                EventKind::ModelCompleted,
                json!({"step": step, "tool_calls": calls.iter().map(|c| &c.function.name).collect::<Vec<_>>(),
                       "usage": resp.usage, "finish_reason": resp.finish_reason}),
            );
            let mut cp = Checkpoint {
                messages: vec![NewMessage { step, key, message }],
                events: vec![model_event],
                step: Some(step),
                usage: resp.usage,
                ..Default::default()
            };
            if calls.is_empty() {
                // The final answer: message, events and terminal state in one commit.
                let result = resp.content.unwrap_or_default();
                cp.events.push(NewEvent::new(EventKind::StepCompleted, json!({"step": step})));
                cp.events.push(NewEvent::new(EventKind::RunSucceeded, json!({"result": result, "forced": forced})));
                let finish = Finish::Succeeded { result, forced };
                cp.finish = Some(finish.clone());
                self.store.checkpoint(lease, cp).instrument(span).await?;
                metrics::counter!("subagents_runs_finished_total", "status" => "succeeded").increment(1);
                tracing::info!(forced, steps = step, "run succeeded");
                return Ok(LoopEnd::Committed);
            }
            // Announce the calls that will run as ordinary tools in the same commit.
            let mine: Vec<&StoredMessage> = history.iter().filter(|m| m.run_id == run.id).collect();
            let refused = refusals(&prior_calls(&mine, step), &calls);
            for c in &calls {
                let name = c.function.name.as_str();
                let plain = tool_names.iter().any(|t| t == name) && !crate::delegation::TOOL_NAMES.contains(&name);
                if plain && !refused.get(&c.id).copied().unwrap_or(false) {
                    cp.events.push(NewEvent::new(EventKind::ToolStarted, json!({"step": step, "call_id": c.id, "tool": name})));
                }
            }
            let committed = cp.messages[0].clone();
            self.store.checkpoint(lease, cp).instrument(span).await?;
            announced_step = Some(step);
            // The store holds exactly what we just wrote: extend the local copy, no re-read.
            history.push(StoredMessage { id: i64::MAX, run_id: run.id, step, key: committed.key, message: committed.message });
            metrics::histogram!("subagents_step_seconds").record(step_t0.elapsed().as_secs_f64());
        }
    }

    /// Runs a step's pending calls concurrently; each result commits as soon as it is ready,
    /// and the last one carries `step.completed`. Returns `Some(wake_at)` when a delegation call
    /// must wait (the run then parks; the earliest deadline wins).
    #[allow(clippy::too_many_arguments)]
    async fn run_tools(
        &self,
        lease: &Lease,
        run: &RunRecord,
        agent: &AgentDef,
        step: u32,
        all_calls: &[ToolCall],
        pending: &[ToolCall],
        prior: &[(String, String)],
        allowed: &[String],
        announced: bool,
        next_step: Option<NewEvent>,
    ) -> Result<(Option<Option<i64>>, Vec<NewMessage>), Stop> {
        let refused = refusals(prior, all_calls);
        let remaining = tokio::sync::Mutex::new(pending.len());
        let next_step = &next_step;
        let futs = pending.iter().map(|call| {
            let remaining = &remaining;
            let refused = refused.get(&call.id).copied().unwrap_or(false);
            let span = info_span!("tool", tool = %call.function.name, call_id = %call.id, step);
            async move {
                let key = format!("{}:{}:{}", run.id, step, call.id);
                let delegation = crate::delegation::TOOL_NAMES.contains(&call.function.name.as_str())
                    && allowed.iter().any(|a| a == &call.function.name);
                let (text, ok, truncated) = if refused {
                    tracing::warn!("identical call repeated 3 times; not executed");
                    (LOOP_MESSAGE.to_owned(), false, false)
                } else if delegation {
                    match self.delegation_ctx(run, agent).call(&call.function.name, &call.function.arguments, &call.id).await? {
                        crate::delegation::Call::Park(wake_at) => return Ok::<_, Stop>((Some(wake_at), None)),
                        crate::delegation::Call::Done(text) => {
                            let ok = !text.starts_with("error[");
                            (text, ok, false)
                        }
                    }
                } else if !allowed.iter().any(|a| a == &call.function.name) {
                    (format!("error[unknown_tool]: `{}` is not available to agent `{}`; use one of: {}", call.function.name, agent.name, allowed.join(", ")), false, false)
                } else {
                    // A fresh step announced its tools with its assistant message (one commit
                    // fewer per call); a replayed call announces itself again.
                    if !announced {
                        self.store
                            .checkpoint(lease, Checkpoint {
                                events: vec![NewEvent::new(EventKind::ToolStarted, json!({"step": step, "call_id": call.id, "tool": call.function.name}))],
                                ..Default::default()
                            })
                            .await?;
                    }
                    let ctx = ToolCtx { workspace: self.settings.workspace.clone(), idempotency_key: key.clone() };
                    let t0 = std::time::Instant::now();
                    let out = tokio::time::timeout(self.settings.tool_timeout, self.tools.execute(&call.function.name, &call.function.arguments, &ctx)).await;
                    let (text, ok) = match out {
                        Ok(Ok(t)) => (t, true),
                        Ok(Err(e)) => (e.to_string(), false),
                        Err(_) => (format!("error[tool_timeout]: the tool did not finish within {}s and was stopped", self.settings.tool_timeout.as_secs_f64()), false),
                    };
                    tracing::info!(ok, ms = t0.elapsed().as_millis() as u64, bytes = text.len(), "tool finished");
                    let len = text.len();
                    let text = truncate_output(text, self.settings.tool_output_limit);
                    let truncated = text.len() != len;
                    (text, ok, truncated)
                };
                let preview: String = text.chars().take(200).collect();
                let mut events = vec![NewEvent::new(
                    EventKind::ToolCompleted,
                    json!({"step": step, "call_id": call.id, "tool": call.function.name, "ok": ok, "truncated": truncated, "refused": refused, "preview": preview}),
                )];
                // Serialize the commits of this step so exactly the last one closes the step.
                let mut left = remaining.lock().await;
                *left -= 1;
                if *left == 0 {
                    events.push(NewEvent::new(EventKind::StepCompleted, json!({"step": step})));
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
        let mut park: Option<Option<i64>> = None;
        let mut committed = vec![];
        for r in futures::future::join_all(futs).await {
            let (parked, msg) = r?;
            committed.extend(msg);
            if let Some(wake_at) = parked {
                // The earliest deadline wins; no deadline means "when a child ends".
                park = Some(match (park.flatten(), wake_at) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                });
            }
        }
        Ok((park, committed))
    }
}

fn ended(run: &RunRecord) -> Ended {
    Ended { thread_id: run.thread_id.clone(), parent_run_id: run.parent_run_id }
}

/// Renews the lease every third of its length (at least every second, so a cancel from another
/// process is seen within a second; one from this process wakes it at once); trips `cancel`
/// when a cancel was requested and `lost` when the lease is gone. A failed renewal (database
/// briefly away) is retried until the lease would have expired.
async fn heartbeat(store: Arc<dyn Store>, lease: Lease, cancel: CancellationToken, lost: CancellationToken) {
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
            Message::Tool { tool_call_id, .. } => Some(((m.run_id, m.step, tool_call_id.as_str()), &m.message)),
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
        let sig = (c.function.name.clone(), canonical_args(&c.function.arguments));
        let n = seq.len();
        refused.insert(c.id.clone(), n >= 2 && seq[n - 1] == sig && seq[n - 2] == sig);
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
        .map(|c| (c.function.name.clone(), canonical_args(&c.function.arguments)))
        .collect()
}

/// Arguments compared as JSON values, so key order and spacing do not hide a repeat.
fn canonical_args(raw: &str) -> String {
    serde_json::from_str::<serde_json::Value>(raw).map(|v| v.to_string()).unwrap_or_else(|_| raw.trim().to_owned())
}

/// Call ids key the checkpoints of tool results, so they must be unique and non-empty within a
/// step; models occasionally repeat or omit them.
fn unique_call_ids(calls: Vec<ToolCall>, step: u32) -> Vec<ToolCall> {
    let mut seen = HashSet::new();
    calls
        .into_iter()
        .enumerate()
        .map(|(i, mut c)| {
            let ok_chars = c.id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
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
        ModelError::Rejected { status: 401 | 403, .. } => format!("{e} (check OPENAI_API_KEY)"),
        ModelError::Rejected { status: 404, .. } => format!("{e} (check OPENAI_BASE_URL and the model name)"),
        _ => e.to_string(),
    }
}
