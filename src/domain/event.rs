//! What happens to a run, as one type: [`Event`], a variant per event type with a payload
//! struct of its own. It is the only way an event is built (`NewEvent` comes from it) and the
//! way one is read back ([`Event::parse`]); the wire form is `{"type": …, "data": {…}}`, as the
//! API and Redis serve it. `docs/design.md`'s events table is checked against [`Event::samples`].

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A stored event: one row of a run's outbox, as readers and Redis get it.
#[derive(Clone, Debug, PartialEq, Serialize, utoipa::ToSchema)]
pub struct EventRecord {
    /// Gap-free per run, from 1.
    pub seq: u64,
    /// Type name, e.g. `step.completed`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Run.
    pub run_id: RunId,
    /// Commit time.
    pub created_at: chrono::DateTime<chrono::Utc>,
    /// Payload.
    #[schema(value_type = Object)]
    pub data: Value,
}

use super::RunError;
use super::approval::{ApprovalScope, ApprovalStatus};
use crate::ids::{AgentName, ApprovalId, MessageId, OwnerId, RunId};
use crate::lifecycle::RunStatus;
use crate::model::Usage;

/// A durable event of a run's stream.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", content = "data")]
pub enum Event {
    /// The run is created (seq 1).
    #[serde(rename = "run.queued")]
    RunQueued(RunQueued),
    /// A worker claimed it from `queued` (a first start, or after an expiry or a release).
    #[serde(rename = "run.started")]
    RunStarted(Claimed),
    /// A worker claimed it from `waiting`.
    #[serde(rename = "run.resumed")]
    RunResumed(Claimed),
    /// A step begins: before its model call.
    #[serde(rename = "step.started")]
    StepStarted(StepStarted),
    /// The step's model call answered; commits with the assistant message.
    #[serde(rename = "model.completed")]
    ModelCompleted(ModelCompleted),
    /// A tool call starts (with the assistant message, or on its own when replayed).
    #[serde(rename = "tool.started")]
    ToolStarted(ToolStarted),
    /// A tool call's result is committed.
    #[serde(rename = "tool.completed")]
    ToolCompleted(ToolCompleted),
    /// The step's last result, or its final answer, is committed.
    #[serde(rename = "step.completed")]
    StepCompleted(StepCompleted),
    /// The final answer broke the run's output schema and went back to the model with the
    /// errors (in the commit of that answer and the message that sends it back).
    #[serde(rename = "output.rejected")]
    OutputRejected(OutputRejected),
    /// A compaction step begins, before its summary request.
    #[serde(rename = "context.compacting")]
    ContextCompacting(Compacting),
    /// A compaction's summary is committed.
    #[serde(rename = "context.compacted")]
    ContextCompacted(Compacted),
    /// A call waits for a person (its approval opens in the same commit).
    #[serde(rename = "approval.requested")]
    ApprovalRequested(ApprovalRequested),
    /// A person answered (written by the API, not the worker).
    #[serde(rename = "approval.resolved")]
    ApprovalResolved(ApprovalResolved),
    /// A message for the run was committed (written by the API, not the worker).
    #[serde(rename = "message.received")]
    MessageReceived(MessageReceived),
    /// A step boundary put a received message into the thread: the step's model request is
    /// the first to carry it.
    #[serde(rename = "message.delivered")]
    MessageDelivered(MessageDelivered),
    /// A rule, a mode or a hook's deny refused a call.
    #[serde(rename = "tool.denied")]
    ToolDenied(ToolDenied),
    /// A hook blocked a call (exit 2, or `decision: block`).
    #[serde(rename = "hook.blocked")]
    HookBlocked(HookBlocked),
    /// The run parked: it holds no worker until what it waits on happens.
    #[serde(rename = "run.waiting")]
    RunWaiting(RunWaiting),
    /// In the parent's stream: a delegation call started a new child.
    #[serde(rename = "child.started")]
    ChildStarted(ChildStarted),
    /// In the parent's stream, with the child's terminal commit.
    #[serde(rename = "child.finished")]
    ChildFinished(ChildFinished),
    /// Terminal: the final answer.
    #[serde(rename = "run.succeeded")]
    RunSucceeded(RunSucceeded),
    /// Terminal: the run failed.
    #[serde(rename = "run.failed")]
    RunFailed(RunFailed),
    /// Terminal: the run was cancelled.
    #[serde(rename = "run.cancelled")]
    RunCancelled(RunCancelled),
}

/// `run.queued`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunQueued {
    /// The agent it runs.
    pub agent: AgentName,
    /// Its thread, as its owner chose it.
    pub thread_id: String,
    /// Its parent, for a child.
    pub parent_run_id: Option<RunId>,
}

/// `run.started`, `run.resumed`: a claim.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Claimed {
    /// Claims so far, this one included.
    pub attempt: u32,
    /// Expired leases so far.
    pub crashes: u32,
    /// The worker that claimed it.
    pub worker: String,
    /// The status it was claimed from.
    pub from: RunStatus,
}

/// `step.started`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepStarted {
    /// The step.
    pub step: u32,
    /// The step must answer without tools (a limit was reached).
    pub forced: bool,
}

/// `model.completed`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelCompleted {
    /// The step.
    pub step: u32,
    /// The names of the tools it called, in its order.
    pub tool_calls: Vec<String>,
    /// Its tokens.
    pub usage: Usage,
    /// Why the model stopped, as the provider said.
    pub finish_reason: Option<String>,
    /// The model that answered (events written before it was recorded have none).
    #[serde(default)]
    pub model: String,
    /// How long the call took, retries included.
    #[serde(default)]
    pub ms: u64,
    /// Its price, when the model has one.
    pub cost_usd: Option<f64>,
}

/// `tool.started`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolStarted {
    /// The step.
    pub step: u32,
    /// The call.
    pub call_id: String,
    /// The tool.
    pub tool: String,
    /// Its arguments, cut to a preview.
    pub arguments: String,
    /// The run's crashes when it started: a replay counts the starts a crash followed.
    #[serde(default)]
    pub crashes: u32,
}

/// `tool.completed`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolCompleted {
    /// The step.
    pub step: u32,
    /// The call.
    pub call_id: String,
    /// The tool.
    pub tool: String,
    /// It succeeded.
    pub ok: bool,
    /// The result went to a file (the same as `offloaded`, for older readers).
    pub truncated: bool,
    /// The result went to a file; the model got its head and the path.
    pub offloaded: bool,
    /// Not run: the identical call came a third time in a row.
    pub refused: bool,
    /// The result's first 200 characters.
    pub preview: String,
    /// How long the call took.
    #[serde(default)]
    pub ms: u64,
}

/// `step.completed`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepCompleted {
    /// The step.
    pub step: u32,
}

/// `output.rejected`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputRejected {
    /// The step whose answer was refused.
    pub step: u32,
    /// What the schema found wrong (at most ten).
    pub errors: Vec<String>,
    /// Answers that may still be refused before the run fails with `kind=output`.
    pub retries_left: u32,
}

/// The messages a compaction replaces.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Range {
    /// The first replaced message.
    pub first_message_id: i64,
    /// The last replaced message.
    pub last_message_id: i64,
    /// How many it replaces.
    pub messages: i64,
}

/// `context.compacting`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Compacting {
    /// The step it precedes.
    pub step: u32,
    /// Why it runs.
    pub reason: CompactionReason,
    /// The request's estimate before.
    pub tokens_before: u64,
    /// What it replaces.
    pub range: Range,
}

/// Why a compaction runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CompactionReason {
    /// The next request would pass `compact_at`.
    Threshold,
    /// The provider refused the request as too long.
    ContextLength,
    /// A new run starts on a thread whose carried-over context is already large.
    NewRun,
}

stored_names!(CompactionReason {
    Threshold => "threshold",
    ContextLength => "context_length",
    NewRun => "new_run",
});

/// `context.compacted`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Compacted {
    /// The step it precedes.
    pub step: u32,
    /// Why it runs.
    pub reason: CompactionReason,
    /// The request's estimate before.
    pub tokens_before: u64,
    /// The request's estimate after.
    pub tokens_after: u64,
    /// What it replaced.
    pub range: Range,
    /// Of `tokens_after`, the estimate of the prefix left unchanged (tools, system prompt,
    /// task): what a provider's prompt cache can still serve. A compaction breaks the cached
    /// prefix from the first replaced message on; the next step writes the rest anew.
    #[serde(default)]
    pub cache_prefix_tokens: u64,
    /// The summary request's tokens.
    pub usage: Usage,
    /// Its price, when the model has one.
    pub cost_usd: Option<f64>,
}

/// `approval.requested`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApprovalRequested {
    /// The step.
    pub step: u32,
    /// The call.
    pub call_id: String,
    /// The approval.
    pub approval_id: ApprovalId,
    /// The tool.
    pub tool: String,
    /// The arguments it would run with.
    pub input: Value,
    /// Why it asks: the rule or hook.
    pub reason: String,
    /// `rules`, `hook` or `grant`.
    pub by: String,
    /// Unix ms after which nobody answering is a deny.
    pub expires_at: i64,
    /// The owner who may answer.
    pub answerable_by: OwnerId,
}

/// `approval.resolved`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApprovalResolved {
    /// The approval.
    pub approval_id: ApprovalId,
    /// The tool.
    pub tool: String,
    /// `allowed` or `denied`.
    pub decision: ApprovalStatus,
    /// The answer's reason.
    pub reason: Option<String>,
    /// `once` or `run_tree`.
    pub scope: ApprovalScope,
}

/// `message.received`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MessageReceived {
    /// The message.
    pub message_id: MessageId,
    /// Its length in characters (the text itself is in the thread once delivered).
    pub chars: u64,
}

/// `message.delivered`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MessageDelivered {
    /// The message.
    pub message_id: MessageId,
    /// The step whose model request first carries it.
    pub step: u32,
}

/// `tool.denied`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolDenied {
    /// The step.
    pub step: u32,
    /// The call.
    pub call_id: String,
    /// The tool.
    pub tool: String,
    /// Why.
    pub reason: String,
    /// `rules` or `hook`.
    pub by: String,
}

/// `hook.blocked`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HookBlocked {
    /// The step.
    pub step: u32,
    /// The call.
    pub call_id: String,
    /// The tool.
    pub tool: String,
    /// The hook's reason.
    pub reason: String,
}

/// What a parked run waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WaitingOn {
    /// Children it started (or awaits) to end.
    Children,
    /// A person to answer an approval.
    Approval,
    /// A model's rate limit to free up.
    RateLimit,
}

/// `run.waiting`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunWaiting {
    /// The step it parked in.
    pub step: u32,
    /// What it waits for.
    pub waiting_on: WaitingOn,
    /// The children it waits for.
    pub run_ids: Vec<RunId>,
    /// When it wakes by itself (Unix ms), if it does.
    pub wake_at: Option<i64>,
    /// The approvals it waits for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval_ids: Option<Vec<ApprovalId>>,
}

/// `child.started`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChildStarted {
    /// The child.
    pub child_run_id: RunId,
    /// Its thread, as the owner sees it.
    pub thread_id: String,
    /// Its agent.
    pub agent: AgentName,
    /// The delegation call that started it.
    pub call_id: String,
    /// It outlives its parent.
    pub detached: bool,
}

/// `child.finished`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChildFinished {
    /// The child.
    pub child_run_id: RunId,
    /// Its thread, as the owner sees it.
    pub thread_id: String,
    /// How it ended.
    pub status: RunStatus,
    /// Why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<RunError>,
}

/// `run.succeeded`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunSucceeded {
    /// The final answer.
    pub result: String,
    /// Given without tools, at a limit.
    pub forced: bool,
}

/// `run.failed`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunFailed {
    /// Why.
    pub error: RunError,
    /// Expired leases, when it gave up after them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crashes: Option<u32>,
}

/// `run.cancelled`: `{}` from its worker; `while` when it ended without one; `reason` and
/// `parent_run_id` when its parent's end took it along.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunCancelled {
    /// `queued` or `waiting`: it held no worker.
    #[serde(rename = "while", default, skip_serializing_if = "Option::is_none")]
    pub while_: Option<RunStatus>,
    /// `parent_ended`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The parent whose end it was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_run_id: Option<RunId>,
}

impl Event {
    /// The wire name of its type.
    pub fn name(&self) -> &'static str {
        match self {
            Event::RunQueued(_) => "run.queued",
            Event::RunStarted(_) => "run.started",
            Event::RunResumed(_) => "run.resumed",
            Event::StepStarted(_) => "step.started",
            Event::ModelCompleted(_) => "model.completed",
            Event::ToolStarted(_) => "tool.started",
            Event::ToolCompleted(_) => "tool.completed",
            Event::StepCompleted(_) => "step.completed",
            Event::OutputRejected(_) => "output.rejected",
            Event::ContextCompacting(_) => "context.compacting",
            Event::ContextCompacted(_) => "context.compacted",
            Event::ApprovalRequested(_) => "approval.requested",
            Event::ApprovalResolved(_) => "approval.resolved",
            Event::MessageReceived(_) => "message.received",
            Event::MessageDelivered(_) => "message.delivered",
            Event::ToolDenied(_) => "tool.denied",
            Event::HookBlocked(_) => "hook.blocked",
            Event::RunWaiting(_) => "run.waiting",
            Event::ChildStarted(_) => "child.started",
            Event::ChildFinished(_) => "child.finished",
            Event::RunSucceeded(_) => "run.succeeded",
            Event::RunFailed(_) => "run.failed",
            Event::RunCancelled(_) => "run.cancelled",
        }
    }

    /// Its payload as stored (`data`): the payload struct serialised on its own (an event is
    /// built at every step; going through the tagged enum would build the envelope too).
    pub fn data(&self) -> Value {
        let v = match self {
            Event::RunQueued(p) => serde_json::to_value(p),
            Event::RunStarted(p) | Event::RunResumed(p) => serde_json::to_value(p),
            Event::StepStarted(p) => serde_json::to_value(p),
            Event::ModelCompleted(p) => serde_json::to_value(p),
            Event::ToolStarted(p) => serde_json::to_value(p),
            Event::ToolCompleted(p) => serde_json::to_value(p),
            Event::StepCompleted(p) => serde_json::to_value(p),
            Event::OutputRejected(p) => serde_json::to_value(p),
            Event::ContextCompacting(p) => serde_json::to_value(p),
            Event::ContextCompacted(p) => serde_json::to_value(p),
            Event::ApprovalRequested(p) => serde_json::to_value(p),
            Event::ApprovalResolved(p) => serde_json::to_value(p),
            Event::MessageReceived(p) => serde_json::to_value(p),
            Event::MessageDelivered(p) => serde_json::to_value(p),
            Event::ToolDenied(p) => serde_json::to_value(p),
            Event::HookBlocked(p) => serde_json::to_value(p),
            Event::RunWaiting(p) => serde_json::to_value(p),
            Event::ChildStarted(p) => serde_json::to_value(p),
            Event::ChildFinished(p) => serde_json::to_value(p),
            Event::RunSucceeded(p) => serde_json::to_value(p),
            Event::RunFailed(p) => serde_json::to_value(p),
            Event::RunCancelled(p) => serde_json::to_value(p),
        };
        // Payloads are plain structs of strings, numbers and JSON: they always serialise.
        v.unwrap_or_else(|_| Value::Object(Default::default()))
    }

    /// An event read back from its type and payload; `None` for data that is not one.
    pub fn parse(kind: &str, data: &Value) -> Option<Event> {
        serde_json::from_value(serde_json::json!({"type": kind, "data": data})).ok()
    }

    /// One event of every type, every optional field set: what the documentation's events
    /// table is checked against (a type or a field it does not name fails the suite).
    pub fn samples() -> Vec<Event> {
        let run = RunId::new();
        let error = RunError {
            kind: super::ErrorKind::Model,
            message: "m".into(),
        };
        let usage = Usage {
            prompt_tokens: 1,
            completion_tokens: 1,
            ..Default::default()
        };
        let range = Range {
            first_message_id: 1,
            last_message_id: 2,
            messages: 2,
        };
        let claim = Claimed {
            attempt: 1,
            crashes: 0,
            worker: "w".into(),
            from: RunStatus::Queued,
        };
        vec![
            Event::RunQueued(RunQueued {
                agent: "a".into(),
                thread_id: "t".into(),
                parent_run_id: Some(run),
            }),
            Event::RunStarted(claim.clone()),
            Event::RunResumed(claim),
            Event::StepStarted(StepStarted {
                step: 1,
                forced: false,
            }),
            Event::ModelCompleted(ModelCompleted {
                step: 1,
                tool_calls: vec![],
                usage,
                finish_reason: Some("stop".into()),
                model: "m".into(),
                ms: 1,
                cost_usd: Some(0.1),
            }),
            Event::ToolStarted(ToolStarted {
                step: 1,
                call_id: "c".into(),
                tool: "t".into(),
                arguments: "{}".into(),
                crashes: 0,
            }),
            Event::ToolCompleted(ToolCompleted {
                step: 1,
                call_id: "c".into(),
                tool: "t".into(),
                ok: true,
                truncated: false,
                offloaded: false,
                refused: false,
                preview: "p".into(),
                ms: 1,
            }),
            Event::StepCompleted(StepCompleted { step: 1 }),
            Event::OutputRejected(OutputRejected {
                step: 1,
                errors: vec!["at /a: wrong".into()],
                retries_left: 1,
            }),
            Event::ContextCompacting(Compacting {
                step: 1,
                reason: CompactionReason::Threshold,
                tokens_before: 1,
                range: range.clone(),
            }),
            Event::ContextCompacted(Compacted {
                step: 1,
                reason: CompactionReason::Threshold,
                tokens_before: 2,
                tokens_after: 1,
                range,
                cache_prefix_tokens: 1,
                usage,
                cost_usd: Some(0.1),
            }),
            Event::ApprovalRequested(ApprovalRequested {
                step: 1,
                call_id: "c".into(),
                approval_id: "apr".into(),
                tool: "t".into(),
                input: serde_json::json!({}),
                reason: "r".into(),
                by: "rules".into(),
                expires_at: 1,
                answerable_by: "o".into(),
            }),
            Event::ApprovalResolved(ApprovalResolved {
                approval_id: "apr".into(),
                tool: "t".into(),
                decision: ApprovalStatus::Allowed,
                reason: Some("r".into()),
                scope: ApprovalScope::Once,
            }),
            Event::MessageReceived(MessageReceived {
                message_id: "msg".into(),
                chars: 1,
            }),
            Event::MessageDelivered(MessageDelivered {
                message_id: "msg".into(),
                step: 1,
            }),
            Event::ToolDenied(ToolDenied {
                step: 1,
                call_id: "c".into(),
                tool: "t".into(),
                reason: "r".into(),
                by: "rules".into(),
            }),
            Event::HookBlocked(HookBlocked {
                step: 1,
                call_id: "c".into(),
                tool: "t".into(),
                reason: "r".into(),
            }),
            Event::RunWaiting(RunWaiting {
                step: 1,
                waiting_on: WaitingOn::Children,
                run_ids: vec![run],
                wake_at: Some(1),
                approval_ids: Some(vec![]),
            }),
            Event::ChildStarted(ChildStarted {
                child_run_id: run,
                thread_id: "t".into(),
                agent: "a".into(),
                call_id: "c".into(),
                detached: false,
            }),
            Event::ChildFinished(ChildFinished {
                child_run_id: run,
                thread_id: "t".into(),
                status: RunStatus::Failed,
                error: Some(error.clone()),
            }),
            Event::RunSucceeded(RunSucceeded {
                result: "r".into(),
                forced: false,
            }),
            Event::RunFailed(RunFailed {
                error,
                crashes: Some(1),
            }),
            Event::RunCancelled(RunCancelled {
                while_: Some(RunStatus::Queued),
                reason: Some("parent_ended".into()),
                parent_run_id: Some(run),
            }),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_round_trips_through_its_stored_form() {
        let samples = Event::samples();
        let mut names: Vec<&str> = samples.iter().map(Event::name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), samples.len(), "one sample per type");
        for e in samples {
            assert_eq!(
                Event::parse(e.name(), &e.data()),
                Some(e.clone()),
                "{}",
                e.name()
            );
        }
        assert_eq!(
            Event::parse("run.succeeded", &serde_json::json!({"result": "r"})),
            None,
            "a field missing"
        );
        assert_eq!(
            Event::parse(
                "run.succeeded",
                &serde_json::json!({"result": "r", "forced": false, "extra": 1})
            ),
            None,
            "a field unknown"
        );
        assert_eq!(Event::parse("run.exploded", &serde_json::json!({})), None);
        assert_eq!(
            Event::RunCancelled(RunCancelled::default()).data(),
            serde_json::json!({})
        );
    }
}
