//! Delegation: the `task` and `subagent_*` tools a parent run uses to hand work to child runs.
//!
//! A child is an ordinary run with a parent. Its thread id and its idempotency key follow from
//! the parent's run id and the tool call id, so a parent replaying a call after a crash finds
//! the child it already started instead of starting another.
//!
//! `task` and `subagent_await` may have to wait. They then answer [`Call::Park`] with what they
//! wait on: the engine parks the parent (`waiting`, no worker held), the store records the runs
//! it waits on, and whoever ends one of them wakes it in the same commit (or the await's
//! deadline passes). On the claim that follows, the engine replays the call, which this time
//! finds its answer. Waiting is the replay path, not a second mechanism.

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::agents::{AgentDef, AgentRegistry};
use crate::domain::{Event, IfBusy, RunRecord, TreePosition};
use crate::events::progress_line;
use crate::ids::{RunId, ThreadId};
use crate::model::{FunctionSpec, ToolSpec};
use crate::queue::Queue;
use crate::runs::{StartError, StartRun};
use crate::store::{CancelOutcome, NewEvent, RunLog, RunStatus, StoreError};

/// A delegation call's result for the model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    /// The compact text the model sees.
    pub text: String,
    /// False for refusals and bad arguments (reported as `ok: false` in `tool.completed`).
    pub ok: bool,
}

/// What a parked call waits for: any of these runs ending, or the deadline.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Wait {
    /// Wake when any of these ends (the call then replays and decides again).
    pub on: Vec<RunId>,
    /// Wake at this time (Unix ms) at the latest.
    pub wake_at: Option<i64>,
    /// Wake when any of these approvals is answered (a tool call asked a person).
    pub approvals: Vec<crate::ids::ApprovalId>,
    /// The model's rate limit is used up until `wake_at`.
    pub rate_limited: bool,
}

impl Wait {
    /// What the run waits for, as `run.waiting` says.
    pub fn reason(&self) -> crate::domain::event::WaitingOn {
        use crate::domain::event::WaitingOn;
        if self.rate_limited {
            WaitingOn::RateLimit
        } else if self.on.is_empty() && !self.approvals.is_empty() {
            WaitingOn::Approval
        } else {
            WaitingOn::Children
        }
    }

    /// A wait on a model's rate limit until `at` (Unix ms).
    pub fn rate_limited(at: i64) -> Wait {
        Wait {
            wake_at: Some(at),
            rate_limited: true,
            ..Wait::default()
        }
    }

    /// Two calls of one step that both wait: wake on either's runs, at the earlier deadline.
    pub fn merge(mut self, other: Wait) -> Wait {
        for r in other.on {
            if !self.on.contains(&r) {
                self.on.push(r);
            }
        }
        for a in other.approvals {
            if !self.approvals.contains(&a) {
                self.approvals.push(a);
            }
        }
        self.wake_at = match (self.wake_at, other.wake_at) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        self
    }
}

/// Names of the delegation tools.
pub const TOOL_NAMES: [&str; 6] = [
    "task",
    "subagent_start",
    "subagent_status",
    "subagent_events",
    "subagent_cancel",
    "subagent_await",
];

/// Settings of delegation.
#[derive(Clone, Debug)]
pub struct DelegationSettings {
    /// Runs at this depth get no delegation tools (1: only roots delegate).
    pub max_depth: u32,
    /// A child's final text longer than this many bytes is written whole to the owner's
    /// workspace (`.results/<child run>/result.txt`); the parent gets its head and the path.
    pub result_limit: usize,
    /// Root of the owners' workspaces; without one, a long text is cut with a marker instead.
    pub workspace: Option<std::path::PathBuf>,
}

impl Default for DelegationSettings {
    fn default() -> Self {
        Self {
            max_depth: 1,
            result_limit: 4000,
            workspace: None,
        }
    }
}

/// What a delegation call came to.
#[derive(Debug, PartialEq)]
pub enum Call {
    /// The tool result for the model.
    Done(Answer),
    /// Not yet: park the parent on this.
    Park(Wait),
}

impl Call {
    fn done(text: String) -> Call {
        Call::Done(Answer { text, ok: true })
    }
}

/// Everything a delegation call needs.
pub struct Ctx<'a> {
    /// Storage.
    pub store: &'a dyn RunLog,
    /// For pushing child jobs.
    pub queue: &'a Queue,
    /// Agent definitions, current and pinned.
    pub agents: &'a crate::pinning::Agents,
    /// The calling (parent) run.
    pub parent: &'a RunRecord,
    /// The parent's agent.
    pub agent: &'a AgentDef,
    /// Settings.
    pub settings: &'a DelegationSettings,
    /// Largest accepted input.
    pub max_input_bytes: usize,
    /// This process's workers with a free slot: a child next in line is handed to one as it is
    /// written.
    pub local: &'a dyn crate::runs::FreeSlots,
}

/// Whether this run, with this agent, is offered the delegation tools.
pub fn offered(agent: &AgentDef, depth: u32, settings: &DelegationSettings) -> bool {
    if depth >= settings.max_depth {
        return false;
    }
    match &agent.tools {
        None => true,
        // An explicit tool list delegates only if it names `task` (Claude Code writes `Task`,
        // `Agent`, or `Task(a, b)` naming the sub-agents).
        Some(list) => list
            .iter()
            .any(|t| crate::tools::lookup(t) == crate::tools::Named::Delegation),
    }
}

/// The agents this agent may delegate to: its `subagents:` list, or every agent.
pub fn allowed<'a>(agent: &AgentDef, agents: &'a AgentRegistry) -> Vec<&'a AgentDef> {
    agents
        .all()
        .filter(|a| agent.subagents.is_empty() || agent.subagents.iter().any(|s| s == &a.name))
        .collect()
}

fn spec(name: &str, description: String, parameters: Value) -> ToolSpec {
    ToolSpec {
        kind: "function".into(),
        function: FunctionSpec {
            name: name.into(),
            description,
            parameters,
        },
    }
}

/// Specs of the delegation tools; descriptions list the allowed subagents so the model can choose.
pub fn specs(agent: &AgentDef, agents: &AgentRegistry) -> Vec<ToolSpec> {
    let allowed = allowed(agent, agents);
    let names: Vec<&str> = allowed.iter().map(|a| a.name.as_str()).collect();
    // The menu goes in `task` only (`subagent_start` points to it), each entry cut short: it
    // is sent with every request of the run.
    let menu: String = allowed
        .iter()
        .map(|a| format!("\n- {}: {}", a.name, menu_entry(&a.description)))
        .collect();
    let start_params = |extra: Value| {
        let mut p = json!({
            "type": "object",
            "properties": {
                "description": {"type": "string", "description": "The complete task for the subagent: it sees nothing else of your conversation."},
                "subagent": {"type": "string", "enum": names},
                "thread_id": {"type": "string", "description": "Continue an earlier subagent's thread (the thread_id a task or subagent_start gave you) instead of starting fresh."},
                "output_schema": {"type": "object", "description": "A JSON Schema the subagent's final answer must match, when you want data back: its result is then that JSON."}
            },
            "required": ["description", "subagent"]
        });
        if let Value::Object(extra) = extra {
            for (k, v) in extra {
                p["properties"][k] = v;
            }
        }
        p
    };
    let run_id = json!({"type": "object", "properties": {"run_id": {"type": "string"}}, "required": ["run_id"]});
    vec![
        spec("task", format!("Delegate a task to a subagent and wait for its final answer. The subagent works in a fresh context; you get back only its final text and its thread_id. Subagents:{menu}"), start_params(json!({}))),
        spec("subagent_start", "Start a subagent in the background; returns its run_id and thread_id at once. Use subagent_await to collect results. The subagents are listed under `task`.".into(), start_params(json!({"detached": {"type": "boolean", "description": "Keep running after you finish (default false: it is cancelled when you end)."}}))),
        spec("subagent_status", "State of one of your subagents: status, its last 3 progress lines, and its result once finished.".into(), run_id.clone()),
        spec("subagent_events", "Progress lines of one of your subagents after a cursor.".into(), json!({"type": "object", "properties": {"run_id": {"type": "string"}, "after_seq": {"type": "integer", "minimum": 0}, "limit": {"type": "integer", "minimum": 1, "maximum": 50}}, "required": ["run_id"]})),
        spec("subagent_cancel", "Cancel one of your subagents (and its own subagents).".into(), run_id),
        spec("subagent_await", "Wait until your subagents end: all of them (mode all) or the first (mode any). On timeout you get their current state with wait_timed_out: true.".into(), json!({"type": "object", "properties": {"run_ids": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 50}, "mode": {"type": "string", "enum": ["all", "any"]}, "timeout_s": {"type": "number", "minimum": 0, "maximum": 86400}}, "required": ["run_ids"]})),
    ]
}

/// A description cut to about 200 characters at a word boundary.
fn menu_entry(description: &str) -> String {
    let one_line = description.split_whitespace().collect::<Vec<_>>().join(" ");
    if one_line.chars().count() <= MENU_ENTRY_CHARS {
        return one_line;
    }
    let mut cut: String = one_line.chars().take(MENU_ENTRY_CHARS).collect();
    if let Some(sp) = cut.rfind(' ').filter(|sp| *sp > MENU_ENTRY_CHARS / 2) {
        cut.truncate(sp);
    }
    cut.push('…');
    cut
}

/// Characters of an agent's description in the delegation menu.
const MENU_ENTRY_CHARS: usize = 200;

fn err(code: &str, message: impl std::fmt::Display) -> Call {
    Call::Done(Answer {
        text: format!("error[{code}]: {message}"),
        ok: false,
    })
}

/// A child's final text as its parent sees it: whole when short; otherwise its head and the
/// path of the whole text, which `read_file` pages through (never silently cut).
async fn child_text(settings: &DelegationSettings, child: &RunRecord, text: &str) -> String {
    if text.len() <= settings.result_limit {
        return text.to_owned();
    }
    let mut head = settings.result_limit.min(text.len());
    while !text.is_char_boundary(head) {
        head -= 1;
    }
    if let Some(nl) = text[..head]
        .rfind('\n')
        .filter(|nl| *nl + 1 >= head.saturating_sub(400) && *nl > 0)
    {
        head = nl + 1;
    }
    let Some(root) = &settings.workspace else {
        return crate::tools::truncate_output(text.to_owned(), settings.result_limit);
    };
    let workspace = crate::tools::owner_workspace(root, &child.owner);
    let rel = format!(".results/{}/result.txt", child.id);
    let tokens = text.len() / 4;
    match crate::tools::offload(
        &workspace,
        rel,
        text.to_owned(),
        head,
        tokens,
        settings.result_limit / 4,
    )
    .await
    {
        Ok(o) => o.notice,
        Err(e) => {
            tracing::warn!(error = %e, "could not save a long child result; cutting it instead");
            crate::tools::truncate_output(text.to_owned(), settings.result_limit)
        }
    }
}

/// A child's result as its parent gets it: the JSON itself when the child had an output schema
/// (and it fits the result limit), else its text as [`child_text`] gives it.
async fn child_result(settings: &DelegationSettings, child: &RunRecord, text: &str) -> Value {
    match crate::output::result_json(child.limits.output.as_ref(), Some(text)) {
        Some(data) if text.len() <= settings.result_limit => data,
        _ => json!(child_text(settings, child, text).await),
    }
}

/// The child thread a call names: `<parent_thread>_sub_<agent>_<8 hex>`.
pub fn child_thread(
    parent_thread: &ThreadId,
    parent_run: RunId,
    call_id: &str,
    agent: &str,
) -> ThreadId {
    let h = Sha256::digest(format!("{parent_run}:{call_id}").as_bytes());
    let hex: String = h.iter().take(4).map(|b| format!("{b:02x}")).collect();
    // Agent names may hold characters a thread id cannot (Claude Code allows most): those
    // become `-`, so every name yields a valid id.
    let agent: String = agent
        .chars()
        .take(64)
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.') {
                c
            } else {
                '-'
            }
        })
        .collect();
    let id = format!("{parent_thread}_sub_{agent}_{hex}");
    id.parse().unwrap_or_else(|_| {
        // A parent thread id near the length limit: fall back to a hash of the whole name.
        let h = Sha256::digest(id.as_bytes());
        let hex: String = h.iter().take(8).map(|b| format!("{b:02x}")).collect();
        format!("sub_{agent}_{hex}")
            .parse()
            .expect("short thread id is valid")
    })
}

/// A snapshot fit for a model's context: status, 3 progress lines, the (cut) result or error.
pub async fn snapshot(
    store: &dyn RunLog,
    r: &RunRecord,
    settings: &DelegationSettings,
) -> Result<Value, StoreError> {
    let recent = store
        .events_after(r.id, r.event_seq.saturating_sub(12), 12)
        .await?;
    let mut progress: Vec<String> = recent
        .iter()
        .filter_map(progress_line)
        .map(|l| l.trim().to_owned())
        .collect();
    let n = progress.len();
    progress.drain(..n.saturating_sub(3));
    let mut v = json!({"run_id": r.id, "thread_id": r.thread_id, "agent": r.agent, "status": r.status, "progress": progress});
    if let Some(res) = &r.result {
        v["result"] = child_result(settings, r, res).await;
    }
    if let Some(e) = &r.error {
        v["error"] = json!(format!("[{}] {}", e.kind.as_str(), e.message));
    }
    Ok(v)
}

impl Ctx<'_> {
    /// Runs one delegation call (or replays it after a park).
    pub async fn call(
        &self,
        name: &str,
        raw_args: &str,
        call_id: &str,
    ) -> Result<Call, StoreError> {
        let args: Value = match serde_json::from_str(if raw_args.trim().is_empty() {
            "{}"
        } else {
            raw_args
        }) {
            Ok(v @ Value::Object(_)) => v,
            _ => return Ok(err("bad_arguments", "arguments must be a JSON object")),
        };
        match name {
            "task" => self.task(&args, call_id).await,
            "subagent_start" => self.start(&args, call_id).await,
            "subagent_status" => {
                let Some(run) = self.owned(&args["run_id"]).await? else {
                    return Ok(self.no_such(&args["run_id"]));
                };
                Ok(Call::done(
                    snapshot(self.store, &run, self.settings).await?.to_string(),
                ))
            }
            "subagent_events" => {
                let Some(run) = self.owned(&args["run_id"]).await? else {
                    return Ok(self.no_such(&args["run_id"]));
                };
                let after = args["after_seq"].as_u64().unwrap_or(0);
                let limit = args["limit"].as_u64().unwrap_or(20).clamp(1, 50) as u32;
                let events = self.store.events_after(run.id, after, limit).await?;
                let lines: Vec<String> = events
                    .iter()
                    .map(|e| {
                        format!(
                            "{} {}",
                            e.seq,
                            progress_line(e)
                                .map(|l| l.trim().to_owned())
                                .unwrap_or_else(|| e.kind.clone())
                        )
                    })
                    .collect();
                let next = events.last().map(|e| e.seq).unwrap_or(after);
                Ok(Call::done(json!({"run_id": run.id, "status": run.status, "events": lines, "next_after_seq": next}).to_string()))
            }
            "subagent_cancel" => {
                let Some(run) = self.owned(&args["run_id"]).await? else {
                    return Ok(self.no_such(&args["run_id"]));
                };
                let outcome = crate::runs::cancel(self.store, self.queue, run.id).await?;
                let text = match outcome {
                    CancelOutcome::Cancelled => "cancelled".to_owned(),
                    CancelOutcome::Requested => {
                        "cancel requested; it stops within a second".to_owned()
                    }
                    CancelOutcome::AlreadyFinished(s) => {
                        format!("already finished: {}", s.as_str())
                    }
                    CancelOutcome::NotFound => return Ok(self.no_such(&args["run_id"])),
                };
                Ok(Call::done(
                    json!({"run_id": run.id, "result": text}).to_string(),
                ))
            }
            "subagent_await" => self.await_runs(&args, call_id).await,
            other => Ok(err(
                "unknown_tool",
                format!("`{other}` is not a delegation tool"),
            )),
        }
    }

    fn no_such(&self, id: &Value) -> Call {
        err(
            "no_such_run",
            format!(
                "there is no run {} among your subagents",
                id.as_str().unwrap_or("(missing run_id)")
            ),
        )
    }

    /// The run, if it is a child of a run on the caller's thread (so a later run of the same
    /// parent thread may reach a child started earlier); otherwise `None`, as for a missing id.
    async fn owned(&self, id: &Value) -> Result<Option<RunRecord>, StoreError> {
        let Some(id) = id.as_str().and_then(|s| s.parse::<RunId>().ok()) else {
            return Ok(None);
        };
        let Some(run) = self.store.get_run(id).await? else {
            return Ok(None);
        };
        let Some(parent) = run.parent_run_id else {
            return Ok(None);
        };
        if parent == self.parent.id {
            return Ok(Some(run));
        }
        Ok(match self.store.get_run(parent).await? {
            Some(p) if p.thread_id == self.parent.thread_id && p.owner == self.parent.owner => {
                Some(run)
            }
            _ => None,
        })
    }

    /// Starts (or finds) the child a call names.
    async fn start_child(
        &self,
        args: &Value,
        call_id: &str,
        detached: bool,
    ) -> Result<Result<RunRecord, Call>, StoreError> {
        let Some(description) = args["description"].as_str() else {
            return Ok(Err(err(
                "bad_arguments",
                "`description` (the task for the subagent) is required",
            )));
        };
        let Some(subagent) = args["subagent"].as_str() else {
            return Ok(Err(err("bad_arguments", "`subagent` is required")));
        };
        let current = self.agents.current();
        let allowed = allowed(self.agent, &current);
        if !allowed.iter().any(|a| a.name == subagent) {
            let names: Vec<&str> = allowed.iter().map(|a| a.name.as_str()).collect();
            return Ok(Err(err(
                "unknown_subagent",
                format!(
                    "`{subagent}` is not available; choose one of: {}",
                    names.join(", ")
                ),
            )));
        }
        let thread = match args["thread_id"].as_str() {
            // `task` hands back the short form (`sub_…`, within this parent's thread).
            Some(t) => match (if t.starts_with("sub_") {
                format!("{}_{t}", self.parent.thread_id)
            } else {
                t.to_owned()
            })
            .parse::<ThreadId>()
            {
                Ok(t)
                    if t.as_str()
                        .starts_with(&format!("{}_sub_", self.parent.thread_id)) =>
                {
                    t
                }
                _ => {
                    return Ok(Err(err(
                        "no_such_thread",
                        format!("there is no subagent thread {t} of yours"),
                    )));
                }
            },
            None => child_thread(&self.parent.thread_id, self.parent.id, call_id, subagent),
        };
        // With traces on, the child's spans continue this tool call's trace.
        let metadata = crate::telemetry::traceparent(&tracing::Span::current())
            .map(|tp| serde_json::json!({ "traceparent": tp }));
        let req = StartRun {
            agent: Some(subagent.to_owned()),
            input: description.to_owned(),
            metadata,
            thread_id: Some(thread),
            owner: Some(self.parent.owner.clone()),
            if_busy: IfBusy::Reject,
            idempotency_key: Some(format!("child:{}:{}", self.parent.id, call_id)),
            parent_run_id: Some(self.parent.id),
            priority: Some(self.parent.priority),
            // A child of its parent's own agent runs the parent's version of it.
            agent_version: (subagent == self.parent.agent.as_str())
                .then(|| self.parent.agent_version.clone())
                .flatten(),
            max_total_tokens: self.parent.limits.max_total_tokens,
            max_total_steps: self.parent.limits.max_total_steps,
            output_schema: args.get("output_schema").filter(|v| !v.is_null()).cloned(),
            tree: TreePosition {
                root_run_id: Some(self.parent.tree.root_run_id.unwrap_or(self.parent.id)),
                depth: self.parent.tree.depth + 1,
                detached,
            },
            ..Default::default()
        };
        let slot = self.local.reserve();
        let started = crate::runs::start_run_held(
            self.store,
            self.agents,
            self.max_input_bytes,
            req,
            slot.as_ref().map(|s| s.worker().to_owned()),
        )
        .await;
        match started {
            Ok(created) => {
                if let Some(slot) = slot.filter(|_| created.held) {
                    slot.run(created.run.id, created.run.job_id.clone());
                }
                if !created.existing {
                    let r = &created.run;
                    self.store
                        .append_events(
                            self.parent.id,
                            vec![NewEvent::from(Event::ChildStarted(
                                crate::domain::event::ChildStarted {
                                    child_run_id: r.id,
                                    thread_id: r.thread_id.visible_to(&r.owner).to_string(),
                                    agent: r.agent.clone(),
                                    call_id: call_id.to_owned(),
                                    detached,
                                },
                            ))],
                        )
                        .await?;
                }
                Ok(Ok(created.run))
            }
            Err(StartError::Store(StoreError::Busy { active_run, .. })) => Ok(Err(err(
                "busy",
                format!(
                    "that thread is busy with run {active_run}; await it or use another thread"
                ),
            ))),
            Err(StartError::Store(e)) => Err(e),
            Err(e) => Ok(Err(err(e.code(), e))),
        }
    }

    async fn task(&self, args: &Value, call_id: &str) -> Result<Call, StoreError> {
        let child = match self.start_child(args, call_id, false).await? {
            Ok(c) => c,
            Err(answer) => return Ok(answer),
        };
        if !child.status.is_terminal() {
            return Ok(Call::Park(Wait {
                on: vec![child.id],
                ..Default::default()
            }));
        }
        // A success is its text and the thread to continue, nothing more: this result stays in
        // the parent's context for the rest of its run.
        let short = child
            .thread_id
            .as_str()
            .strip_prefix(&format!("{}_", self.parent.thread_id))
            .unwrap_or(child.thread_id.as_str());
        let mut v = json!({"thread_id": short});
        match child.status {
            RunStatus::Succeeded => {
                let text = child.result.as_deref().unwrap_or("");
                v["result"] = child_result(self.settings, &child, text).await;
            }
            _ => {
                v["run_id"] = json!(child.id);
                v["status"] = json!(child.status);
                if let Some(e) = &child.error {
                    v["error"] = json!(format!("[{}] {}", e.kind.as_str(), e.message));
                }
            }
        }
        Ok(Call::done(v.to_string()))
    }

    async fn start(&self, args: &Value, call_id: &str) -> Result<Call, StoreError> {
        let detached = args["detached"].as_bool().unwrap_or(false);
        Ok(match self.start_child(args, call_id, detached).await? {
            Ok(c) => Call::done(
                json!({"run_id": c.id, "thread_id": c.thread_id, "status": c.status}).to_string(),
            ),
            Err(answer) => answer,
        })
    }

    async fn await_runs(&self, args: &Value, call_id: &str) -> Result<Call, StoreError> {
        let Some(ids) = args["run_ids"]
            .as_array()
            .filter(|a| !a.is_empty() && a.len() <= 50)
        else {
            return Ok(err("bad_arguments", "`run_ids` must list 1 to 50 run ids"));
        };
        let any = match args["mode"].as_str().unwrap_or("all") {
            "all" => false,
            "any" => true,
            other => {
                return Ok(err(
                    "bad_arguments",
                    format!("mode `{other}` is not all or any"),
                ));
            }
        };
        let mut runs = vec![];
        for id in ids {
            match self.owned(id).await? {
                Some(r) => runs.push(r),
                None => return Ok(self.no_such(id)),
            }
        }
        let done = |r: &RunRecord| r.status.is_terminal();
        let ready = if any {
            runs.iter().any(done)
        } else {
            runs.iter().all(done)
        };
        // The deadline is fixed at the first attempt, so a replay waits for the same end.
        let deadline = match args["timeout_s"].as_f64() {
            Some(t) if t.is_finite() && t >= 0.0 => {
                let proposed = crate::store::now_ms() + (t.min(86_400.0) * 1000.0) as i64;
                Some(
                    self.store
                        .wait_deadline(&format!("{}:{call_id}", self.parent.id), proposed)
                        .await?,
                )
            }
            _ => None,
        };
        let timed_out = deadline.is_some_and(|d| crate::store::now_ms() >= d);
        if !ready && !timed_out {
            // Wait on the ones still going: the end of any of them replays this call.
            let on = runs.iter().filter(|r| !done(r)).map(|r| r.id).collect();
            return Ok(Call::Park(Wait {
                on,
                wake_at: deadline,
                ..Default::default()
            }));
        }
        let mut snaps = vec![];
        for r in &runs {
            snaps.push(snapshot(self.store, r, self.settings).await?);
        }
        Ok(Call::done(
            json!({"runs": snaps, "wait_timed_out": !ready}).to_string(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_menu_is_sent_once_and_each_entry_is_short() {
        let mut agents = AgentRegistry::builtin();
        let long = AgentDef {
            name: "researcher".into(),
            description: "Finds things. ".repeat(60),
            ..AgentDef::general_purpose()
        };
        agents.insert(long.clone());
        let specs = specs(&AgentDef::general_purpose(), &agents);
        let task = &specs
            .iter()
            .find(|s| s.function.name == "task")
            .unwrap()
            .function
            .description;
        let start = &specs
            .iter()
            .find(|s| s.function.name == "subagent_start")
            .unwrap()
            .function
            .description;
        assert!(task.contains("\n- researcher: Finds things."), "{task}");
        assert!(!start.contains("researcher"), "{start}");
        let entry = task
            .lines()
            .find(|l| l.starts_with("- researcher"))
            .unwrap();
        assert!(
            entry.chars().count() <= "- researcher: ".len() + 201,
            "{entry}"
        );
        assert!(entry.ends_with('…'));
        assert_eq!(menu_entry("short\n  and   spaced"), "short and spaced");
    }
}
