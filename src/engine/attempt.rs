//! One attempt at a run, from its claim to its end: what the run resolves to when it is claimed
//! (agent, tools, model, context window, context), the loop's state between steps, and the loop
//! itself. Each turn of the loop asks the planner ([`super::plan`]) what the run's committed
//! messages call for, asks [`super::decide`] what the limits make of it, and performs that: run a
//! step's tools, compact, call the model, commit. Anything that ends the attempt comes back as
//! an [`End`] through `Err`, so every part may stop the loop with `?`.

use std::convert::Infallible;
use std::path::PathBuf;

use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info_span};

use super::compaction::{Compacted, RunContext, Window};
use super::decide::{self, ModelFailure, Pressure, Verdict};
use super::plan::{Next, plan, prior_calls, refusals, unique_call_ids};
use super::steer::Flag;
use super::{End, Engine, FORCE_MESSAGE, Flow, Release};
use crate::agents::AgentDef;
use crate::delegation::Wait;
use crate::domain::event;
use crate::domain::{ErrorKind, Event, Finish, NewMessage, RunError, RunRecord, StoredMessage};
use crate::model::{ChatResponse, Message, ModelError, ToolSpec, Usage};
use crate::policy::HookEvent;
use crate::store::{Checkpoint, Lease, NewEvent, StoreError, ThreadContext};

/// The tools a run is offered: their names, and their specs as the model gets them.
pub(super) struct Offered {
    pub names: Vec<String>,
    pub specs: Vec<ToolSpec>,
}

/// A commit sent off but not yet awaited ([`Engine::defer`]): the checkpoint that comes right
/// before a model call (the run's input, a step's last tool result) goes beside that call, so
/// its round trip to the database is off the step's path. It runs as a task of its own from
/// the moment it is made, so nothing that cuts the attempt short can drop it; it is awaited
/// before anything else writes or ends the attempt: the commits stay in order, and the model's
/// answer never commits before it.
pub(super) type Pending = tokio::task::JoinHandle<Result<(), StoreError>>;

/// Where an attempt leaves its [`Pending`] commit: owned by the claim's execution
/// ([`Engine::execute_claimed`]), so the commit is still awaited when a cancel, a lost lease,
/// the drain's grace or the wall-time limit cuts the loop short.
pub(super) type PendingSlot = std::sync::Mutex<Option<Pending>>;

/// Awaits the commit left in `slot`, if any: its own answer, or the panic of the task that ran
/// it. Cut short (the loop dropped by a cancel, a lost lease, the drain's grace or the
/// wall-time limit), it puts the commit back, for [`Engine::execute_claimed`] to await before
/// the end.
pub(super) async fn settle_slot(slot: &PendingSlot) -> Result<(), StoreError> {
    let Some(handle) = lock(slot).take() else {
        return Ok(());
    };
    let mut held = Held {
        slot,
        handle: Some(handle),
    };
    let answer = held.handle.as_mut().expect("held until answered").await;
    held.handle = None;
    match answer {
        Ok(r) => r,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

/// Whether a commit waits in `slot`.
pub(super) fn is_pending(slot: &PendingSlot) -> bool {
    lock(slot).is_some()
}

fn lock(slot: &PendingSlot) -> std::sync::MutexGuard<'_, Option<Pending>> {
    slot.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A pending commit being awaited, returned to its slot if the wait is dropped.
struct Held<'a> {
    slot: &'a PendingSlot,
    handle: Option<Pending>,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if let Some(h) = self.handle.take() {
            *lock(self.slot) = Some(h);
        }
    }
}

/// A claimed run and the state its loop carries from step to step.
pub(super) struct Attempt<'a> {
    pub lease: &'a Lease,
    pub run: &'a RunRecord,
    pub agent: AgentDef,
    pub tools: Offered,
    /// The model it calls (the agent's, through aliases and `inherit`).
    pub model: String,
    pub window: Window,
    /// The owner's workspace.
    pub workspace: PathBuf,
    /// The thread as the model sees it: read once per claim (and after a compaction), then
    /// extended with exactly what this attempt commits.
    pub ctx: RunContext,
    /// Steps committed so far.
    pub steps_done: u32,
    /// The step whose `step.started` already committed (it rides on the commit that ends the
    /// step before, saving a commit per step; after a replay it is written on its own).
    pub prestarted: Option<u32>,
    /// The step whose `tool.started` events went out with its assistant message.
    pub announced: Option<u32>,
    /// The run's usage, this attempt's calls included.
    pub usage: Usage,
    pub pressure: Pressure,
    /// Whether messages wait for the next step boundary ([`super::steer`]).
    pub inbox: Flag,
    /// Whether the run is to be cancelled at its next step boundary (`if_busy: interrupt`).
    pub interrupt: Flag,
    /// The settings file's hooks and rules, as the run pinned them.
    pub settings: std::sync::Arc<crate::policy::Policy>,
    /// Pins chosen at this fresh start, committed with the input.
    pub unpinned: Vec<(String, String)>,
    /// The run's output schema, built once per claim.
    pub output: Option<crate::output::Checker>,
    /// Where the commit still to be awaited is left, if any.
    pub pending: &'a PendingSlot,
}

impl Attempt<'_> {
    /// Leaves `p` to be awaited before the next write (there is never more than one).
    pub fn put_pending(&self, p: Pending) {
        let mut slot = lock(self.pending);
        debug_assert!(slot.is_none(), "a commit was left pending over another");
        *slot = Some(p);
    }

    /// The run's own committed messages, in commit order.
    pub fn own(&self) -> Vec<&StoredMessage> {
        self.ctx
            .history
            .iter()
            .filter(|m| m.run_id == self.run.id)
            .collect()
    }

    /// Adds what was just committed to the local copy of the thread: the store holds exactly
    /// that, so there is nothing to read back.
    pub fn remember(&mut self, m: NewMessage) {
        self.ctx.history.push(StoredMessage {
            id: i64::MAX,
            run_id: self.run.id,
            step: m.step,
            key: m.key,
            message: m.message,
        });
    }

    /// The tools offered to this call: none when the answer is forced.
    pub fn tools_now(&self, forced: bool) -> &[ToolSpec] {
        if forced { &[] } else { &self.tools.specs }
    }

    /// The next request's messages (with the instruction to answer now, when forced).
    fn messages(&self, forced: bool) -> Vec<Message> {
        let mut messages = self.ctx.messages(&self.agent.system_prompt, self.run.id);
        if forced {
            messages.push(Message::System {
                content: FORCE_MESSAGE.into(),
            });
        }
        messages
    }

    /// What a final answer comes to under the run's output schema.
    fn verdict(&self, answer: String) -> decide::Verdict {
        let checked = self.output.as_ref().map(|c| c.check(&answer));
        let sent_back = self
            .own()
            .iter()
            .filter(|m| matches!(&m.message, Message::User { content } if crate::output::is_feedback(content)))
            .count() as u32;
        let retries = self.run.limits.output.as_ref().map_or(0, |o| o.retries);
        decide::verdict(answer, checked, sent_back, retries)
    }

    fn hook_for_stop(&self) -> HookEvent {
        if self.run.parent_run_id.is_some() {
            HookEvent::SubagentStop
        } else {
            HookEvent::Stop
        }
    }
}

impl Engine {
    /// Runs the claimed run's loop until something ends the attempt.
    pub(super) async fn drive(
        &self,
        lease: &Lease,
        run: &RunRecord,
        context: Option<ThreadContext>,
        heard: super::steer::Heard,
        shutdown: &CancellationToken,
        pending: &PendingSlot,
    ) -> End {
        let steps = async {
            let mut a = self.begin(lease, run, context, heard, pending).await?;
            let end = self.steps(&mut a, shutdown).await;
            // Whatever ended the loop, a commit still under way lands (or fails) first: the end
            // is handled on what is committed.
            self.settle(&a).await?;
            end
        };
        match steps.await {
            Ok(never) => match never {},
            Err(end) => end,
        }
    }

    /// `cp`, committing from now on beside whatever comes next ([`Pending`]).
    pub(super) fn defer(&self, lease: &Lease, cp: Checkpoint) -> Pending {
        let store = self.store.clone();
        let failpoints = self.settings.failpoints.clone();
        let lease = lease.clone();
        tokio::spawn(
            async move {
                failpoints.hit("before_commit_beside_call").await;
                store.checkpoint(&lease, cp).await.map(drop)
            }
            .in_current_span(),
        )
    }

    /// Awaits the commit still under way, if any.
    async fn settle(&self, a: &Attempt<'_>) -> Flow {
        Ok(settle_slot(a.pending).await?)
    }

    /// The loop: ask the planner, perform, repeat. A draining worker stops at a step boundary,
    /// where everything so far is committed.
    async fn steps(&self, a: &mut Attempt<'_>, shutdown: &CancellationToken) -> Flow<Infallible> {
        loop {
            if shutdown.is_cancelled() {
                return Err(End::Release(Release::Drained));
            }
            match plan(&a.own(), a.steps_done) {
                Next::Finish { result } => {
                    self.settle(a).await?;
                    self.finish_replayed(a, result).await?
                }
                Next::RunTools {
                    step,
                    calls,
                    pending,
                } => {
                    self.settle(a).await?;
                    self.tools_step(a, step, &calls, &pending).await?
                }
                // The only step that may go beside a commit under way.
                Next::CallModel { step } => self.model_step(a, step).await?,
            }
        }
    }

    /// Resolves the run for this claim, and commits its input when it starts. `context` is
    /// the run's context when its claim read it.
    async fn begin<'a>(
        &self,
        lease: &'a Lease,
        run: &'a RunRecord,
        context: Option<ThreadContext>,
        heard: super::steer::Heard,
        pending: &'a PendingSlot,
    ) -> Flow<Attempt<'a>> {
        // The version the run pinned when it started, whatever its file says now.
        let agent = self
            .agents
            .for_run(self.store.as_ref(), run)
            .await?
            .map(|a| (*a).clone())
            .ok_or_else(|| {
                End::fail(
                    ErrorKind::Internal,
                    format!(
                        "agent `{}` is not defined on this worker; add jobs/{}.md",
                        run.agent, run.agent
                    ),
                )
            })?;
        let output = match &run.limits.output {
            Some(c) => Some(
                crate::output::Checker::build(&c.schema)
                    .map_err(|m| End::fail(ErrorKind::Output, m))?,
            ),
            None => None,
        };
        let ctx = match context {
            Some(read) => super::compaction::context_of(run, read),
            None => self.load_context(run).await?,
        };
        let input_key = format!("{}:input", run.id);
        let fresh = run.step == 0 && !ctx.history.iter().any(|m| m.key == input_key);
        let pinned = self.pinned(run, &agent, fresh).await?;
        let tools = self.offered_tools(run, &agent, &pinned).await?;
        let model = pinned.model;
        let window = Window::resolve(
            &self.settings.context,
            &agent,
            run.limits.compact_at,
            &model,
        );
        let mut a = Attempt {
            lease,
            run,
            workspace: crate::tools::owner_workspace(&self.settings.workspace, &run.owner),
            ctx,
            agent,
            tools,
            model,
            window,
            steps_done: run.step,
            prestarted: None,
            announced: None,
            usage: run.usage,
            pressure: Pressure::default(),
            inbox: heard.inbox,
            interrupt: heard.interrupt,
            settings: pinned.settings,
            unpinned: pinned.unwritten,
            output,
            pending,
        };
        if fresh {
            self.commit_input(&mut a, input_key).await?;
        }
        Ok(a)
    }

    /// What the run may call: the agent's tools, delegation when offered at its depth, its MCP
    /// servers' tools; a subagent never gets a tool an ancestor's `tools:` list leaves out
    /// (delegation is bounded by depth instead).
    async fn offered_tools(
        &self,
        run: &RunRecord,
        agent: &AgentDef,
        pinned: &super::pins::Pinned,
    ) -> Flow<Offered> {
        let mut names = self.tools.allowed_for(agent);
        let mut specs = self.tools.specs(&names);
        if crate::delegation::offered(agent, run.tree.depth, &self.settings.delegation) {
            specs.extend(crate::delegation::specs(agent, &self.agents.current()));
            names.extend(crate::delegation::TOOL_NAMES.iter().map(|s| s.to_string()));
        }
        self.add_mcp_tools(agent, pinned, &mut names, &mut specs);
        if run.parent_run_id.is_some() {
            let chain = self.rule_chain(run, &pinned.settings).await?;
            names.retain(|t| {
                crate::delegation::TOOL_NAMES.contains(&t.as_str())
                    || chain.ancestors().all(|a| super::tool_calls::lists(a, t))
            });
            specs.retain(|s| names.contains(&s.function.name));
        }
        Ok(Offered { names, specs })
    }

    /// The run's input, committed with the first step's `step.started`; then the start hooks.
    async fn commit_input(&self, a: &mut Attempt<'_>, key: String) -> Flow {
        let run = a.run;
        let msg = NewMessage {
            step: 0,
            key,
            message: Message::User {
                content: run.input.clone(),
            },
        };
        let events: Vec<NewEvent> = self.next_step_event(run, 0).into_iter().collect();
        a.prestarted = (!events.is_empty()).then_some(1);
        let cp = Checkpoint {
            messages: vec![msg.clone()],
            events,
            pins: std::mem::take(&mut a.unpinned),
            ..Default::default()
        };
        let event = if run.parent_run_id.is_some() {
            HookEvent::SubagentStart
        } else {
            HookEvent::RunStart
        };
        if Self::hooks_on(&a.settings, &a.agent, event) {
            // The hook runs on a committed start.
            self.store.checkpoint(a.lease, cp).await?;
        } else {
            // Nothing runs between here and the first model call but the loop's own checks.
            a.put_pending(self.defer(a.lease, cp));
        }
        a.remember(msg);
        let extra = json!({"input": run.input, "parent_run_id": run.parent_run_id});
        self.lifecycle_hooks(run, &a.settings, &a.agent, event, extra)
            .await;
        Ok(())
    }

    /// Runs a step's calls still without a result; parks when one must wait.
    async fn tools_step(
        &self,
        a: &mut Attempt<'_>,
        step: u32,
        calls: &[crate::model::ToolCall],
        pending: &[crate::model::ToolCall],
    ) -> Flow {
        let next = self.next_step_event(a.run, step);
        let had_next = next.is_some();
        let committed = self.run_tools(a, step, calls, pending, next).await?;
        a.prestarted = had_next.then_some(step + 1);
        for m in committed {
            a.remember(m);
        }
        Ok(())
    }

    /// A new step: one model call, or what must come before it (a park on a rate limit, a
    /// compaction), then its commit.
    async fn model_step(&self, a: &mut Attempt<'_>, step: u32) -> Flow {
        let t0 = std::time::Instant::now();
        let tree_limit = self
            .tree_limit_reached(a.run, a.usage, a.steps_done)
            .await?;
        let forced = decide::forced(a.steps_done, &a.run.limits, tree_limit);
        let span = info_span!("step", otel.name = format!("step {step}"), step, forced, gen_ai.request.model = %a.model, run_id = %a.run.id, thread_id = %a.run.thread_id);
        // A step boundary: an interrupt ends the run here, with everything so far committed.
        if a.interrupt.waiting() {
            tracing::info!(step, "interrupted: ending the run at this step boundary");
            return Err(End::Finish(Finish::Cancelled));
        }
        if a.inbox.take() {
            self.settle(a).await?;
            self.deliver(a, step).await?;
        }
        self.admit(a, forced).await?;
        if a.prestarted != Some(step) {
            self.settle(a).await?;
            let started = Event::StepStarted(event::StepStarted { step, forced });
            let cp = Checkpoint {
                events: vec![started.into()],
                ..Default::default()
            };
            self.store
                .checkpoint(a.lease, cp)
                .instrument(span.clone())
                .await?;
            a.prestarted = Some(step);
        }
        let messages = a.messages(forced);
        let (raw, estimate) = a.window.estimate(&messages, a.tools_now(forced));
        let own = a.own();
        let req = decide::Request {
            step,
            estimate: estimate as u64,
            first_call: !own
                .iter()
                .any(|m| matches!(m.message, Message::Assistant { .. })),
            carried: a.ctx.compaction.is_some() || own.len() < a.ctx.history.len(),
        };
        if let Some(reason) = a.pressure.compaction(req, a.window.compact_at) {
            self.settle(a).await?;
            return self
                .compact_step(a, reason, req, forced)
                .instrument(span)
                .await;
        }
        let answer = if is_pending(a.pending) {
            self.call_beside(a, step, messages, forced, estimate)
                .instrument(span.clone())
                .await?
        } else {
            self.call_model(a, step, messages, forced, estimate, None)
                .instrument(span.clone())
                .await?
        };
        let (resp, ms) = match answer {
            Ok(r) => r,
            Err(e) => return self.model_failed(a, e, raw, estimate).await,
        };
        self.heed_reset(&a.model, &resp).await;
        a.window.observe(raw, resp.usage.prompt_tokens);
        a.pressure.answered();
        self.settings.failpoints.hit("after_model_response").await;
        a.usage.add(&resp.usage);
        self.commit_response(a, step, forced, resp, ms)
            .instrument(span)
            .await?;
        metrics::histogram!("subagents_step_seconds").record(t0.elapsed().as_secs_f64());
        Ok(())
    }

    /// The model call with the commit before it under way beside it. A commit that fails drops
    /// the call (its answer could not be committed); a call that ends first waits for the
    /// commit, so its answer commits after it. Deltas are numbered once the commit landed.
    async fn call_beside(
        &self,
        a: &Attempt<'_>,
        step: u32,
        messages: Vec<crate::model::Message>,
        forced: bool,
        estimate: usize,
    ) -> Flow<Result<(ChatResponse, u64), ModelError>> {
        let (done, after) = tokio::sync::oneshot::channel();
        let commit = async move {
            settle_slot(a.pending).await?;
            let _ = done.send(());
            Ok::<_, End>(())
        };
        let call = self.call_model(a, step, messages, forced, estimate, Some(after));
        tokio::pin!(commit, call);
        tokio::select! {
            biased;
            c = &mut commit => {
                c?;
                call.await
            }
            answer = &mut call => {
                commit.await?;
                answer
            }
        }
    }

    /// A compaction step in place of the model call; the loop then plans again.
    async fn compact_step(
        &self,
        a: &mut Attempt<'_>,
        reason: super::compaction::Reason,
        req: decide::Request,
        forced: bool,
    ) -> Flow {
        // Compaction works on committed ids: read the context back first.
        a.ctx = self.load_context(a.run).await?;
        let outcome = self
            .compact(a, a.tools_now(forced), reason, req.step)
            .await?;
        let decided = a
            .pressure
            .compacted(&outcome, reason, req, a.window.tokens, &a.model);
        match &outcome {
            Compacted::Failed(why) => {
                tracing::warn!(failures = a.pressure.failures, %why, "compaction failed")
            }
            Compacted::Nothing => tracing::debug!(
                estimate = req.estimate,
                "nothing to compact yet; calling the model as is"
            ),
            Compacted::Done => {}
        }
        decided.map_err(End::failed)?;
        a.ctx = self.load_context(a.run).await?;
        Ok(())
    }

    /// A model call that failed: compact and retry, park on the provider's limit, or fail.
    async fn model_failed(
        &self,
        a: &mut Attempt<'_>,
        e: ModelError,
        raw_estimate: usize,
        estimate: usize,
    ) -> Flow {
        match decide::model_failure(e) {
            ModelFailure::TooLong { status, body } => {
                // The model holds less than we thought: learn its window, compact, retry.
                a.window.too_long(raw_estimate, &body);
                let decided = a.pressure.refused(&a.model);
                tracing::warn!(
                    status,
                    estimate,
                    window = a.window.tokens,
                    failures = a.pressure.failures,
                    "the provider refused the request as too long; compacting"
                );
                decided.map_err(End::failed)
            }
            ModelFailure::RateLimited { retry_after, last } => {
                // The provider's limit, not our request: wait for it (no slot held), and tell
                // the fleet when the model's budget is shared.
                let at = crate::store::now_ms()
                    + retry_after.as_millis().min(i64::MAX as u128 / 2) as i64;
                self.budgets
                    .block(&format!("model:{}", a.model), at)
                    .await?;
                metrics::counter!("subagents_rate_limited_total").increment(1);
                tracing::warn!(model = %a.model, ?retry_after, error = %last, "the provider rate-limited every attempt; parking until it allows again");
                Err(End::Park(Wait::rate_limited(at)))
            }
            ModelFailure::Fail(e) => Err(End::failed(e)),
        }
    }

    /// Commits the model's answer: the final answer ends the run in the same commit; tool calls
    /// commit before any of them runs, announced by their `tool.started` events.
    async fn commit_response(
        &self,
        a: &mut Attempt<'_>,
        step: u32,
        forced: bool,
        resp: ChatResponse,
        ms: u64,
    ) -> Flow {
        let calls = if forced {
            vec![]
        } else {
            unique_call_ids(resp.tool_calls, step)
        };
        let cost = self.settings.prices.cost_nanos(&a.model, &resp.usage);
        if let Some(c) = cost {
            metrics::counter!("subagents_cost_nanodollars_total", "model" => a.model.clone())
                .increment(c);
        }
        let completed = Event::ModelCompleted(event::ModelCompleted {
            step,
            tool_calls: calls.iter().map(|c| c.function.name.clone()).collect(),
            usage: resp.usage,
            finish_reason: resp.finish_reason.clone(),
            model: a.model.clone(),
            ms,
            cost_usd: cost.map(crate::model::prices::dollars),
        });
        let message = Message::Assistant {
            content: resp.content.clone(),
            tool_calls: calls.clone(),
            thinking: resp.thinking.clone(),
        };
        let key = format!("{}:{}:assistant", a.run.id, step);
        let mut cp = Checkpoint {
            messages: vec![NewMessage { step, key, message }],
            events: vec![completed.into()],
            step: Some(step),
            usage: resp.usage,
            cost_nanos: cost.unwrap_or(0),
            ..Default::default()
        };
        if calls.is_empty() {
            return match a.verdict(resp.content.unwrap_or_default()) {
                Verdict::Accept(result) => self.commit_answer(a, step, forced, result, cp).await,
                Verdict::SendBack { errors, left } => {
                    self.send_back(a, step, cp, errors, left).await
                }
                Verdict::Refuse(e) => {
                    // The answer stays in the thread; the run fails on it.
                    cp.events
                        .push(Event::StepCompleted(event::StepCompleted { step }).into());
                    self.store.checkpoint(a.lease, cp).await?;
                    Err(End::failed(e))
                }
            };
        }
        let refused = refusals(&prior_calls(&a.own(), step), &calls);
        for c in &calls {
            let name = c.function.name.as_str();
            let plain = a.tools.names.iter().any(|t| t == name)
                && !crate::delegation::TOOL_NAMES.contains(&name);
            if plain && !refused.get(&c.id).copied().unwrap_or(false) {
                let started = super::tool_calls::tool_started(step, c, a.run.crashes);
                cp.events.push(Event::ToolStarted(started).into());
            }
        }
        let committed = cp.messages[0].clone();
        self.store.checkpoint(a.lease, cp).await?;
        a.steps_done = step;
        a.announced = Some(step);
        a.remember(committed);
        Ok(())
    }

    /// The final answer: message, events and terminal state in one commit; then the stop hooks.
    /// A message waiting for the run makes it an ordinary turn instead ([`super::steer`]).
    async fn commit_answer(
        &self,
        a: &mut Attempt<'_>,
        step: u32,
        forced: bool,
        result: String,
        mut cp: Checkpoint,
    ) -> Flow {
        cp.events
            .push(Event::StepCompleted(event::StepCompleted { step }).into());
        if !forced && a.inbox.take() {
            return self.answer_steered(a, step, cp).await;
        }
        let mut finishing = cp.clone();
        let succeeded = event::RunSucceeded {
            result: result.clone(),
            forced,
        };
        finishing.events.push(Event::RunSucceeded(succeeded).into());
        finishing.finish = Some(Finish::Succeeded {
            result: result.clone(),
            forced,
        });
        let ending = match self.store.checkpoint(a.lease, finishing).await {
            Ok(ending) => ending.unwrap_or(crate::store::Ending::UNKNOWN),
            Err(StoreError::LeaseLost(_)) if !forced && self.refused_for_messages(a).await? => {
                a.inbox.take();
                return self.answer_steered(a, step, cp).await;
            }
            Err(e) => return Err(e.into()),
        };
        metrics::counter!("subagents_runs_finished_total", "status" => "succeeded").increment(1);
        tracing::info!(forced, steps = step, "run succeeded");
        let extra = json!({"result": result, "steps": step});
        self.lifecycle_hooks(a.run, &a.settings, &a.agent, a.hook_for_stop(), extra)
            .await;
        Err(End::Committed(ending))
    }

    /// An answer its schema refused: it commits as an ordinary turn, with the message that
    /// sends it back to the model with the errors, and the loop asks the model again. The
    /// send-back is what counts the retries, so a replay counts the same.
    async fn send_back(
        &self,
        a: &mut Attempt<'_>,
        step: u32,
        mut cp: Checkpoint,
        errors: Vec<String>,
        left: u32,
    ) -> Flow {
        tracing::info!(
            step,
            errors = errors.len(),
            left,
            "the answer does not match the output schema; sending it back"
        );
        metrics::counter!("subagents_output_rejected_total").increment(1);
        if !cp.messages.is_empty() {
            cp.events
                .push(Event::StepCompleted(event::StepCompleted { step }).into());
        }
        let feedback = NewMessage {
            step: step + 1,
            key: format!("{}:{}:output_check", a.run.id, step + 1),
            message: Message::User {
                content: crate::output::feedback(&errors, left + 1),
            },
        };
        cp.events.push(
            Event::OutputRejected(event::OutputRejected {
                step,
                errors,
                retries_left: left,
            })
            .into(),
        );
        cp.messages.push(feedback);
        let committed = cp.messages.clone();
        self.store.checkpoint(a.lease, cp).await?;
        a.steps_done = a.steps_done.max(step);
        for m in committed {
            a.remember(m);
        }
        Ok(())
    }

    /// An answer that met a waiting message: it commits as an ordinary turn, then the message
    /// follows it, and the loop asks the model again.
    async fn answer_steered(&self, a: &mut Attempt<'_>, step: u32, cp: Checkpoint) -> Flow {
        tracing::info!(
            step,
            "a message arrived before the final answer; going on with it"
        );
        let committed = cp.messages[0].clone();
        self.store.checkpoint(a.lease, cp).await?;
        a.steps_done = step;
        a.remember(committed);
        self.deliver(a, step + 1).await
    }

    /// A final answer committed before, without its run's end (it met a message, and the
    /// worker stopped before delivering it): deliver and go on, or end the run.
    async fn finish_replayed(&self, a: &mut Attempt<'_>, result: String) -> Flow {
        let forced = a.run.forced;
        if !forced && a.inbox.take() {
            return self.deliver(a, a.steps_done + 1).await;
        }
        let result = match a.verdict(result) {
            Verdict::Accept(result) => result,
            Verdict::SendBack { errors, left } => {
                let step = a.steps_done;
                return self
                    .send_back(a, step, Checkpoint::default(), errors, left)
                    .await;
            }
            Verdict::Refuse(e) => return Err(End::failed(e)),
        };
        let cp = Checkpoint {
            events: vec![
                Event::RunSucceeded(event::RunSucceeded {
                    result: result.clone(),
                    forced,
                })
                .into(),
            ],
            finish: Some(Finish::Succeeded { result, forced }),
            ..Default::default()
        };
        match self.store.checkpoint(a.lease, cp).await {
            Ok(ending) => {
                metrics::counter!("subagents_runs_finished_total", "status" => "succeeded")
                    .increment(1);
                tracing::info!(forced, "run succeeded");
                Err(End::Committed(
                    ending.unwrap_or(crate::store::Ending::UNKNOWN),
                ))
            }
            Err(StoreError::LeaseLost(_)) if !forced && self.refused_for_messages(a).await? => {
                a.inbox.take();
                self.deliver(a, a.steps_done + 1).await
            }
            Err(e) => Err(e.into()),
        }
    }
}

impl End {
    /// The run fails with `e`.
    pub(super) fn failed(e: RunError) -> End {
        End::Finish(Finish::Failed(e))
    }

    /// The run fails with `kind` and `message`.
    pub(super) fn fail(kind: ErrorKind, message: String) -> End {
        End::failed(RunError { kind, message })
    }
}
