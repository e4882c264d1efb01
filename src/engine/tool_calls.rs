//! A step's tool calls. They run concurrently; each is routed (refused as a loop, a delegation
//! call, a tool the agent lacks, or a plain tool), passes the crash guard and the gate
//! ([`super::gate`]), runs under its timeout, and commits its result as soon as it returns,
//! with the same key on a replay. The last result of the step closes it. Calls that must wait
//! (on children, on a person) are merged into one [`Wait`] and the run parks.

use serde_json::json;
use tracing::{Instrument, info_span};

use super::attempt::{Attempt, settle_slot};
use super::gate::Gate;
use super::plan::{prior_calls, refusals};
use super::{End, Engine, Flow, LOOP_MESSAGE};
use crate::agents::AgentDef;
use crate::delegation::{Answer, Wait};
use crate::domain::event;
use crate::domain::{Event, NewMessage, RunRecord};
use crate::ids::OwnerId;
use crate::model::{Message, ToolCall};
use crate::store::{Checkpoint, NewEvent};
use crate::tools::ToolCtx;

/// Starts of one call that each ended in its worker's death, after which a replay does not run
/// it again.
const MAX_CRASHES_UNDER_A_CALL: u32 = 2;

/// Bytes of a call's arguments a `tool.started` event carries (the full call is in the thread).
const EVENT_ARGUMENTS_BYTES: usize = 2000;

/// How a call is handled, from what is known without any I/O.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Route {
    /// The same call a third time in a row: not run, the model is told to stop repeating it.
    Refused,
    /// A delegation tool the run was offered.
    Delegation,
    /// A tool the agent was not offered.
    Unknown,
    /// One of the agent's tools (built-in or MCP).
    Plain,
}

/// Routes a call of `name` (`refused`: the loop guard refused it) for a run offered `offered`.
pub(super) fn route(name: &str, refused: bool, offered: &[String]) -> Route {
    let is_offered = offered.iter().any(|t| t == name);
    if refused {
        Route::Refused
    } else if !is_offered {
        Route::Unknown
    } else if crate::delegation::TOOL_NAMES.contains(&name) {
        Route::Delegation
    } else {
        Route::Plain
    }
}

/// A call's result as the model will see it.
struct ToolResult {
    text: String,
    ok: bool,
    /// The whole result went to a file; the model sees its head.
    offloaded: bool,
}

impl ToolResult {
    fn error(text: String) -> ToolResult {
        ToolResult {
            text,
            ok: false,
            offloaded: false,
        }
    }
}

/// What the step's calls share while they run: how many are left, and the `step.started` of
/// the next step that rides on the last commit.
struct StepClose {
    left: tokio::sync::Mutex<usize>,
    next_step: Option<NewEvent>,
}

impl Engine {
    /// Runs a step's pending calls concurrently; each result commits as soon as it is ready,
    /// and the last one carries `step.completed`. Returns what committed, the last commit left
    /// on the attempt when it opens the next step (it goes beside that step's model call); or
    /// parks, with everything committed.
    pub(super) async fn run_tools(
        &self,
        a: &Attempt<'_>,
        step: u32,
        calls: &[ToolCall],
        pending: &[ToolCall],
        next_step: Option<NewEvent>,
    ) -> Flow<Vec<NewMessage>> {
        let refused = refusals(&prior_calls(&a.own(), step), calls);
        let close = StepClose {
            left: tokio::sync::Mutex::new(pending.len()),
            next_step,
        };
        let futs = pending.iter().map(|call| {
            let refused = refused.get(&call.id).copied().unwrap_or(false);
            self.run_call(a, step, call, refused, &close)
                .instrument(tool_span(a.run, step, call))
        });
        let results = futures::future::join_all(futs).await;
        let mut wait: Option<Wait> = None;
        let mut committed = vec![];
        let mut failed = None;
        for r in results {
            match r {
                Ok(Ok(msg)) => committed.push(msg),
                Ok(Err(w)) => {
                    wait = Some(match wait {
                        None => w,
                        Some(acc) => acc.merge(w),
                    })
                }
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        // A step that does not go on to a model call commits what it answered first (the first
        // failure stays the one reported).
        match (failed, wait) {
            (None, None) => Ok(committed),
            (Some(e), _) => {
                let _ = settle_slot(a.pending).await;
                Err(e)
            }
            (None, Some(w)) => {
                settle_slot(a.pending).await?;
                Err(End::Park(w))
            }
        }
    }

    /// One call, answered and committed, or the wait it parks on.
    async fn run_call(
        &self,
        a: &Attempt<'_>,
        step: u32,
        call: &ToolCall,
        refused: bool,
        close: &StepClose,
    ) -> Flow<Result<NewMessage, Wait>> {
        let t0 = std::time::Instant::now();
        let key = format!("{}:{}:{}", a.run.id, step, call.id);
        let answered = match route(&call.function.name, refused, &a.tools.names) {
            Route::Refused => {
                tracing::warn!("identical call repeated 3 times; not executed");
                ToolResult::error(LOOP_MESSAGE.to_owned())
            }
            Route::Unknown => ToolResult::error(format!(
                "error[unknown_tool]: `{}` is not available to agent `{}`; use one of: {}",
                call.function.name,
                a.agent.name,
                a.tools.names.join(", ")
            )),
            Route::Delegation => match self.delegate(a, step, call, &key).await? {
                Ok(answered) => answered,
                Err(wait) => return Ok(Err(wait)),
            },
            Route::Plain => match self.run_plain(a, step, call, &key).await? {
                Ok(answered) => answered,
                Err(wait) => return Ok(Err(wait)),
            },
        };
        self.settings.failpoints.hit("before_tool_commit").await;
        if !answered.ok {
            let span = tracing::Span::current();
            span.record("otel.status_code", "ERROR");
            let kind = if refused {
                "loop_refused"
            } else {
                "tool_error"
            };
            span.record("error.type", kind);
        }
        let completed = event::ToolCompleted {
            step,
            call_id: call.id.clone(),
            tool: call.function.name.clone(),
            ok: answered.ok,
            truncated: answered.offloaded,
            offloaded: answered.offloaded,
            refused,
            preview: answered.text.chars().take(200).collect(),
            ms: t0.elapsed().as_millis() as u64,
        };
        let message = Message::Tool {
            tool_call_id: call.id.clone(),
            content: answered.text,
        };
        let msg = NewMessage {
            step,
            key: format!("{}:{}:tool:{}", a.run.id, step, call.id),
            message,
        };
        self.commit_result(a, step, msg, completed, close)
            .await
            .map(Ok)
    }

    /// Commits a call's result; the step's last one closes it (the commits of a step are
    /// serialised so exactly one is last). The last one, when it opens the next step, is left
    /// on the attempt to go beside that step's model call.
    async fn commit_result(
        &self,
        a: &Attempt<'_>,
        step: u32,
        msg: NewMessage,
        completed: event::ToolCompleted,
        close: &StepClose,
    ) -> Flow<NewMessage> {
        let mut events: Vec<NewEvent> = vec![Event::ToolCompleted(completed).into()];
        let mut left = close.left.lock().await;
        *left -= 1;
        let opens_next = *left == 0 && close.next_step.is_some();
        if *left == 0 {
            events.push(Event::StepCompleted(event::StepCompleted { step }).into());
            events.extend(close.next_step.clone());
        }
        let cp = Checkpoint {
            messages: vec![msg.clone()],
            events,
            ..Default::default()
        };
        if opens_next {
            a.put_pending(self.defer(a.lease, cp));
        } else {
            self.store.checkpoint(a.lease, cp).await?;
        }
        Ok(msg)
    }

    /// A delegation call: gated like any tool, then started, awaited or answered by
    /// [`crate::delegation`].
    async fn delegate(
        &self,
        a: &Attempt<'_>,
        step: u32,
        call: &ToolCall,
        key: &str,
    ) -> Flow<Result<ToolResult, Wait>> {
        let arguments = match self.gate(a, step, call, key).await? {
            Gate::Park(wait) => return Ok(Err(wait)),
            Gate::Refuse(text) => return Ok(Ok(ToolResult::error(text))),
            Gate::Run { arguments, .. } => arguments,
        };
        let ctx = self.delegation_ctx(a.run, &a.agent);
        Ok(
            match ctx.call(&call.function.name, &arguments, &call.id).await? {
                // A message waits: the model hears it now rather than after the children.
                crate::delegation::Call::Park(wait) if !wait.on.is_empty() && a.inbox.waiting() => {
                    tracing::info!(waits_on = ?wait.on, "a message arrived; answering the wait with where the children stand");
                    Ok(ToolResult {
                        text: super::steer::interrupted_wait(&wait),
                        ok: true,
                        offloaded: false,
                    })
                }
                crate::delegation::Call::Park(wait) => Err(wait),
                crate::delegation::Call::Done(Answer { text, ok }) => Ok(ToolResult {
                    text,
                    ok,
                    offloaded: false,
                }),
            },
        )
    }

    /// One of the agent's own tools: the crash guard, its announcement on a replay, the gate,
    /// then the call.
    async fn run_plain(
        &self,
        a: &Attempt<'_>,
        step: u32,
        call: &ToolCall,
        key: &str,
    ) -> Flow<Result<ToolResult, Wait>> {
        // A fresh step announced its tools with its assistant message (one commit fewer per
        // call); a replayed call announces itself again.
        let announced = a.announced == Some(step);
        if !announced {
            if self.crashes_under(a.run, step, &call.id).await? >= MAX_CRASHES_UNDER_A_CALL {
                // Its worker died every time this call ran: run it again and the fleet loses
                // another worker. The model hears why instead.
                tracing::error!(tool = %call.function.name, "this call's worker died each of the last times it ran; not running it again");
                metrics::counter!("subagents_tool_crash_refusals_total").increment(1);
                return Ok(Ok(ToolResult::error(format!(
                    "error[tool_crashed]: this call was started {MAX_CRASHES_UNDER_A_CALL} times and its worker died each time before it returned; it was not run again. Do not repeat it: try a smaller or different call."
                ))));
            }
            let started = tool_started(step, call, a.run.crashes);
            let cp = Checkpoint {
                events: vec![Event::ToolStarted(started).into()],
                ..Default::default()
            };
            self.store.checkpoint(a.lease, cp).await?;
        }
        Ok(match self.gate(a, step, call, key).await? {
            Gate::Park(wait) => Err(wait),
            Gate::Refuse(text) => Ok(ToolResult::error(text)),
            Gate::Run { arguments, context } => Ok(self
                .execute_gated(a, call, key, &arguments, context)
                .await?),
        })
    }

    /// Runs a call the gate let through, under the tool timeout; PostToolUse hooks and the
    /// hooks' context are added, and a result too large for the context goes to a file.
    async fn execute_gated(
        &self,
        a: &Attempt<'_>,
        call: &ToolCall,
        key: &str,
        arguments: &str,
        context: Vec<String>,
    ) -> Flow<ToolResult> {
        let name = call.function.name.as_str();
        // A search shows only the files the run's read rules let it read.
        let readable = match name {
            "grep" | "glob" => Some(self.rule_chain(a.run, &a.settings).await?.readable()),
            _ => None,
        };
        let ctx = ToolCtx {
            workspace: a.workspace.clone(),
            idempotency_key: key.to_owned(),
            output_limit: a.window.page_bytes(),
            readable,
        };
        let t0 = std::time::Instant::now();
        let limit = self.settings.tool_timeout;
        let run = self.execute_tool(name, arguments, &ctx, &a.run.owner);
        let out = tokio::time::timeout(limit, run).await;
        // A tool that held its thread past the limit returns late rather than being cut: it
        // still timed out.
        let late = t0.elapsed() > limit;
        let (mut text, ok) = match out {
            Ok(Ok(t)) if !late => (t, true),
            Ok(Err(e)) if !late => (e.to_string(), false),
            _ => (
                format!(
                    "error[tool_timeout]: the tool did not finish within {}s and was stopped",
                    limit.as_secs_f64()
                ),
                false,
            ),
        };
        self.settings.failpoints.hit("after_tool_run").await;
        crate::model::scrub_nul(&mut text);
        let ms = t0.elapsed().as_millis() as u64;
        tracing::info!(ok, ms, bytes = text.len(), "tool finished");
        let mut text = self.after_tool(a, call, arguments, text, ok).await;
        for c in context {
            text.push_str(&format!("\n[hook context] {c}"));
        }
        let fitted = (self.fit_result(&a.window, &a.workspace, a.run.id, &call.id, text)).await;
        Ok(ToolResult {
            text: fitted.0,
            ok,
            offloaded: fitted.1,
        })
    }

    /// Runs a built-in tool or an MCP server's (the owner's own process of a stdio server).
    async fn execute_tool(
        &self,
        name: &str,
        arguments: &str,
        ctx: &ToolCtx,
        owner: &OwnerId,
    ) -> Result<String, crate::tools::ToolError> {
        let Some((server, Some(tool))) = crate::mcp::split(name) else {
            return self.tools.execute(name, arguments, ctx).await;
        };
        let args: serde_json::Value = if arguments.trim().is_empty() {
            json!({})
        } else {
            serde_json::from_str(arguments).map_err(|e| {
                crate::tools::ToolError::new(
                    crate::tools::ErrorCode::BadArguments,
                    format!("arguments are not valid JSON ({e}); send a JSON object"),
                )
            })?
        };
        match self.settings.mcp.call(server, tool, args, owner).await {
            Ok((text, true)) => Ok(text),
            Ok((text, false)) => Err(crate::tools::ToolError::new(
                crate::tools::ErrorCode::McpToolError,
                text,
            )),
            Err(e @ crate::mcp::McpError::Gone { .. }) => Err(crate::tools::ToolError::new(
                crate::tools::ErrorCode::ToolUnavailable,
                e.to_string(),
            )),
            Err(e) => Err(crate::tools::ToolError::new(
                crate::tools::ErrorCode::McpUnavailable,
                e.to_string(),
            )),
        }
    }

    /// How many times the worker running this call died before its result committed: each
    /// `tool.started` of the call whose run crashed (its lease expired) before the next start.
    /// Read only when a call is replayed, which is rare.
    async fn crashes_under(&self, run: &RunRecord, step: u32, call_id: &str) -> Flow<u32> {
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
        Ok(crashes_between(&starts, run.crashes))
    }
}

/// Of a call's starts (the run's crash count at each), those after which the run crashed
/// before the next start (or before now, at `crashes_now`).
fn crashes_between(starts: &[u32], crashes_now: u32) -> u32 {
    let next = starts
        .iter()
        .skip(1)
        .copied()
        .chain(std::iter::once(crashes_now));
    starts
        .iter()
        .zip(next)
        .filter(|(at, after)| after > at)
        .count() as u32
}

fn tool_span(run: &RunRecord, step: u32, call: &ToolCall) -> tracing::Span {
    info_span!(
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
    )
}

/// Whether `agent`'s `tools:` list (none: every tool) names `tool`, directly, through Claude
/// Code's name, or as one of an MCP server's tools.
pub(super) fn lists(agent: &AgentDef, tool: &str) -> bool {
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

/// `tool.started`: which call, and its arguments (cut), so a timeline shows what was asked;
/// `crashes` is the run's count when the call started, so a replay can tell how often the
/// call's worker died under it (see [`Engine::crashes_under`]).
pub(super) fn tool_started(step: u32, call: &ToolCall, crashes: u32) -> event::ToolStarted {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_are_routed_by_the_loop_guard_then_what_the_run_was_offered() {
        let offered = vec!["read_file".to_owned(), "task".to_owned()];
        assert_eq!(route("read_file", false, &offered), Route::Plain);
        assert_eq!(route("task", false, &offered), Route::Delegation);
        assert_eq!(route("read_file", true, &offered), Route::Refused);
        assert_eq!(route("bash", false, &offered), Route::Unknown);
        // A delegation tool the run was not offered (too deep) is unknown to it.
        assert_eq!(route("task", false, &offered[..1]), Route::Unknown);
    }

    #[test]
    fn a_call_counts_the_crashes_that_followed_its_starts() {
        assert_eq!(crashes_between(&[], 3), 0);
        // Started at 0 crashes, the run crashed, started again at 1 and it is running now.
        assert_eq!(crashes_between(&[0, 1], 1), 1);
        // Both starts died under it.
        assert_eq!(crashes_between(&[0, 1], 2), 2);
        // A restart for another reason (a drain) between two starts is not a crash.
        assert_eq!(crashes_between(&[1, 1], 1), 0);
    }

    #[test]
    fn a_started_event_cuts_long_arguments_at_a_character() {
        let call = ToolCall {
            id: "c".into(),
            kind: "function".into(),
            function: crate::model::FunctionCall {
                name: "write_file".into(),
                arguments: "é".repeat(EVENT_ARGUMENTS_BYTES),
            },
        };
        let e = tool_started(1, &call, 0);
        assert!(e.arguments.ends_with('…'));
        assert!(e.arguments.len() <= EVENT_ARGUMENTS_BYTES + '…'.len_utf8());
    }
}
