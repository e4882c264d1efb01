//! `subagents mcp`: durable subagent runs for any MCP client, over stdio.
//!
//! One `run_agent(agent, input, thread_id?)` tool rather than one tool per agent: the tool list
//! stays the same when agent files change (clients cache it), and the agents are listed in the
//! tool's description and schema enum, as `task` lists them for our own agents. `run_status`,
//! `run_wait`, `run_events`, `run_message` and `run_cancel` act on runs by id.
//!
//! A client that declares the Tasks extension (`io.modelcontextprotocol/tasks`) gets a task
//! back from `run_agent` — the run, already committed — and follows it with `tasks/get` and
//! `tasks/cancel` (the task id is the run id). A client without it gets the answer when the run
//! ends, with progress notifications on the way, or, after `--wait-s`, the run id and its state,
//! so no call hangs for an hour.

use std::sync::Arc;
use std::time::Duration;

use rmcp::ErrorData;
use rmcp::handler::server::ServerHandler;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, CancelTaskParams, ContentBlock,
    CreateTaskResult, DetailedTask, GetTaskParams, GetTaskResult, ListToolsResult,
    PaginatedRequestParams, ProgressNotificationParam, ServerCapabilities, ServerConfig, Task,
    TaskPayload, TaskStatus, Tool,
};
use rmcp::service::{RequestContext, RoleServer};
use serde_json::{Value, json};

use crate::app::{App, StartRun};
use crate::domain::RunRecord;
use crate::ids::{OwnerId, RunId};
use crate::store::RunStatus;

/// The owner of an HTTP request to `/mcp`, put in the request's extensions by the API's
/// authentication (stdio has one owner, given on the command line).
#[derive(Clone, Debug)]
pub struct McpOwner(pub OwnerId);

/// The server: runs are started as `owner` (or as the request's [`McpOwner`] over HTTP).
pub struct McpRuns {
    app: Arc<App>,
    owner: OwnerId,
    wait: Duration,
}

impl McpRuns {
    /// Serves `app` to MCP clients; runs belong to `owner`; a client without tasks waits at most
    /// `wait` for an answer.
    pub fn new(app: Arc<App>, owner: OwnerId, wait: Duration) -> McpRuns {
        McpRuns { app, owner, wait }
    }

    fn tools(&self) -> Vec<Tool> {
        let current = self.app.agents.current();
        let agents: Vec<String> = current.all().map(|a| a.name.clone()).collect();
        let menu: String = current
            .all()
            .map(|a| {
                format!(
                    "\n- {}: {}",
                    a.name,
                    a.description.chars().take(200).collect::<String>()
                )
            })
            .collect();
        let obj = |v: Value| v.as_object().cloned().unwrap_or_default();
        let run_id = obj(
            json!({"type": "object", "properties": {"run_id": {"type": "string"}}, "required": ["run_id"]}),
        );
        vec![
            Tool::new(
                "run_agent",
                format!(
                    "Start a durable subagent run: it works on the task in a fresh context, survives restarts, and answers with its final text (or, if it takes longer than this call waits, its run_id to follow with run_wait or run_status). Agents:{menu}"
                ),
                obj(json!({"type": "object", "properties": {
                    "agent": {"type": "string", "enum": agents},
                    "input": {"type": "string", "description": "The complete task."},
                    "thread_id": {"type": "string", "description": "Continue this thread instead of starting a new one."},
                    "output_schema": {"type": "object", "description": "A JSON Schema the final answer must match; the answer then also comes as structuredContent."}},
                    "required": ["agent", "input"]})),
            ),
            Tool::new(
                "run_status",
                "A run's state, step, progress lines, and its result or error once it ended.",
                run_id.clone(),
            ),
            Tool::new(
                "run_wait",
                "Wait until runs end: all of them (mode all) or the first (mode any), at most timeout_s (default 60, at most 600).",
                obj(
                    json!({"type": "object", "properties": {"run_ids": {"type": "array", "items": {"type": "string"}, "minItems": 1}, "mode": {"type": "string", "enum": ["all", "any"]}, "timeout_s": {"type": "number", "minimum": 0, "maximum": 600}}, "required": ["run_ids"]}),
                ),
            ),
            Tool::new(
                "run_events",
                "A run's progress lines after a cursor (seq).",
                obj(
                    json!({"type": "object", "properties": {"run_id": {"type": "string"}, "after": {"type": "integer", "minimum": 0}}, "required": ["run_id"]}),
                ),
            ),
            Tool::new("run_cancel", "Cancel a run (and its subagents).", run_id),
            Tool::new(
                "run_message",
                "Send a queued, running or waiting run a message: it reaches the model before its next call (a run waiting on its subagents wakes for it). A finished run cannot take one: start a new run on its thread instead.",
                obj(
                    json!({"type": "object", "properties": {"run_id": {"type": "string"}, "content": {"type": "string", "minLength": 1}}, "required": ["run_id", "content"]}),
                ),
            ),
        ]
    }

    /// Who is asking: the HTTP request's authenticated owner, else the server's.
    fn owner_of(&self, ctx: &RequestContext<RoleServer>) -> OwnerId {
        ctx.extensions
            .get::<axum::http::request::Parts>()
            .and_then(|p| p.extensions.get::<McpOwner>())
            .map(|o| o.0.clone())
            .unwrap_or_else(|| self.owner.clone())
    }

    async fn owned(&self, owner: &OwnerId, id: &Value) -> Result<RunRecord, String> {
        let id: RunId = id
            .as_str()
            .and_then(|s| s.parse().ok())
            .ok_or("run_id must be a run id (a UUID)")?;
        match self.app.store.get_run(id).await {
            Ok(Some(r)) if r.owner == *owner => Ok(r),
            Ok(_) => Err(format!("there is no run {id}")),
            Err(e) => Err(format!("storage: {e}")),
        }
    }

    async fn snapshot(&self, r: &RunRecord) -> Value {
        let recent = self
            .app
            .store
            .events_after(r.id, r.event_seq.saturating_sub(8), 8)
            .await
            .unwrap_or_default();
        let progress: Vec<String> = recent
            .iter()
            .filter_map(crate::events::progress_line)
            .collect();
        let mut v = json!({"run_id": r.id, "thread_id": r.thread_id.visible_to(&r.owner), "agent": r.agent, "status": r.status, "step": r.step, "progress": progress});
        if let Some(res) = &r.result {
            v["result"] = json!(res);
        }
        if let Some(e) = &r.error {
            v["error"] = json!(format!("[{}] {}", e.kind.as_str(), e.message));
        }
        v
    }

    fn task_of(r: &RunRecord) -> Task {
        let mut t = Task::new(
            r.id.to_string(),
            task_status(r.status),
            r.created_at.to_rfc3339(),
            r.finished_at
                .or(r.heartbeat_at)
                .unwrap_or(r.created_at)
                .to_rfc3339(),
        );
        t.status_message = Some(format!("{} (step {})", r.status.as_str(), r.step));
        t.poll_interval_ms = Some(500);
        t
    }

    /// The answer of an ended run as a tool result.
    fn outcome(r: &RunRecord) -> CallToolResult {
        match r.status {
            RunStatus::Succeeded => {
                let mut res = CallToolResult::success(vec![ContentBlock::text(
                    r.result.clone().unwrap_or_default(),
                )]);
                // A run with an output schema answers data too; MCP's structured content is
                // an object, so another JSON value comes as `{"result": value}`.
                res.structured_content =
                    crate::output::result_json(r.limits.output.as_ref(), r.result.as_deref()).map(
                        |v| match v {
                            Value::Object(_) => v,
                            other => json!({ "result": other }),
                        },
                    );
                res
            }
            _ => CallToolResult::error(vec![ContentBlock::text(match &r.error {
                Some(e) => format!(
                    "run {} {}: [{}] {}",
                    r.id,
                    r.status.as_str(),
                    e.kind.as_str(),
                    e.message
                ),
                None => format!("run {} {}", r.id, r.status.as_str()),
            })]),
        }
    }

    async fn run_agent(
        &self,
        args: &Value,
        ctx: &RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let agent = args["agent"]
            .as_str()
            .ok_or_else(|| ErrorData::invalid_params("`agent` is required", None))?;
        let input = args["input"]
            .as_str()
            .ok_or_else(|| ErrorData::invalid_params("`input` is required", None))?;
        let owner = self.owner_of(ctx);
        let chosen = args["thread_id"]
            .as_str()
            .map(crate::ids::ThreadId::chosen)
            .transpose()
            .map_err(|e| ErrorData::invalid_params(format!("thread_id: {e}"), None))?;
        let thread_id = match chosen {
            Some(t) => Some(
                self.app
                    .thread_for(&owner, &t)
                    .await
                    .map_err(|e| ErrorData::internal_error(e.to_string(), None))?,
            ),
            None => None,
        };
        let req = StartRun {
            agent: Some(agent.to_owned()),
            input: input.to_owned(),
            thread_id,
            owner: Some(owner),
            output_schema: args.get("output_schema").filter(|v| !v.is_null()).cloned(),
            // The per-key cap of queued runs holds for MCP's starts as for the API's.
            max_queued: self.app.settings.max_queued_per_key,
            ..Default::default()
        };
        // Committed before anything is returned: the run survives this process from here on.
        let run = match self.app.start_run(req).await {
            Ok(r) => r,
            Err(e) => {
                return Ok(CallToolResult::error(vec![ContentBlock::text(format!(
                    "error[{}]: {e}",
                    e.code()
                ))])
                .into());
            }
        };
        tracing::info!(run_id = %run.id, agent, "MCP client started a run");
        let tasks = ctx
            .peer
            .peer_info()
            .is_some_and(|i| i.capabilities.supports_tasks());
        let token = ctx.meta.get_progress_token();
        if tasks {
            // The task goes back at once; its progress follows while the client is connected.
            if let Some(token) = token {
                let mut progress = Progress::new(self.app.store.subscribe(run.id), token);
                let (app, peer, id) = (self.app.clone(), ctx.peer.clone(), run.id);
                tokio::spawn(async move { progress.until_end(&app, id, None, &peer, None).await });
            }
            return Ok(CallToolResponse::Task(CreateTaskResult::new(
                Self::task_of(&run),
            )));
        }
        // Without tasks: wait, sending progress, up to the configured time.
        let deadline = tokio::time::Instant::now() + self.wait;
        let mut progress = token.map(|t| Progress::new(self.app.store.subscribe(run.id), t));
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let mut gone = false;
            let r = match &mut progress {
                // Each step's progress goes out as it commits, not in one burst with the
                // answer: a client may drop notifications that arrive with the response (the
                // TypeScript SDK does), and a long run shows it is moving. Then the run.
                Some(p) => {
                    let heard = p
                        .until_end(&self.app, run.id, Some(deadline), &ctx.peer, Some(&ctx.ct))
                        .await;
                    gone = heard == Heard::Gone;
                    self.app.wait(run.id, Duration::ZERO).await
                }
                None => {
                    self.app
                        .wait(run.id, left.min(Duration::from_secs(1)))
                        .await
                }
            }
            .map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
            let Some(r) = r else {
                return Err(ErrorData::internal_error("the run vanished", None));
            };
            if gone {
                progress = None;
            }
            if r.status.is_terminal() {
                return Ok(Self::outcome(&r).into());
            }
            if tokio::time::Instant::now() >= deadline || ctx.ct.is_cancelled() {
                let mut res = CallToolResult::success(vec![ContentBlock::text(format!(
                    "The run is still working (run_id {}, status {}, step {}). It goes on without this call: follow it with run_wait or run_status.",
                    r.id,
                    r.status.as_str(),
                    r.step
                ))]);
                res.structured_content = Some(
                    json!({"run_id": r.id, "thread_id": r.thread_id.visible_to(&r.owner), "status": r.status}),
                );
                return Ok(res.into());
            }
        }
    }

    async fn call(
        &self,
        name: &str,
        args: Value,
        ctx: &RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let text = |v: Value| -> Result<CallToolResponse, ErrorData> {
            Ok(CallToolResult::success(vec![ContentBlock::text(v.to_string())]).into())
        };
        let refuse = |m: String| -> Result<CallToolResponse, ErrorData> {
            Ok(CallToolResult::error(vec![ContentBlock::text(m)]).into())
        };
        let owner = self.owner_of(ctx);
        match name {
            "run_agent" => self.run_agent(&args, ctx).await,
            "run_status" => match self.owned(&owner, &args["run_id"]).await {
                Ok(r) => text(self.snapshot(&r).await),
                Err(e) => refuse(e),
            },
            "run_events" => match self.owned(&owner, &args["run_id"]).await {
                Ok(r) => {
                    let after = args["after"].as_u64().unwrap_or(0);
                    let events = self
                        .app
                        .store
                        .events_after(r.id, after, 200)
                        .await
                        .unwrap_or_default();
                    let lines: Vec<Value> = events
                        .iter()
                        .filter_map(|e| {
                            crate::events::progress_line(e)
                                .map(|l| json!({"seq": e.seq, "line": l}))
                        })
                        .collect();
                    text(
                        json!({"events": lines, "next_after": events.last().map_or(after, |e| e.seq)}),
                    )
                }
                Err(e) => refuse(e),
            },
            "run_message" => match self.owned(&owner, &args["run_id"]).await {
                Ok(r) => {
                    let content = args["content"].as_str().unwrap_or_default();
                    if content.trim().is_empty() || content.contains('\0') {
                        return refuse("content must be non-empty text without NUL".into());
                    }
                    if content.len() > self.app.settings.max_input_bytes {
                        return refuse(format!(
                            "the message is longer than {} bytes (SUBAGENTS_MAX_INPUT_BYTES)",
                            self.app.settings.max_input_bytes
                        ));
                    }
                    match self.app.send_message(r.id, &owner, content).await {
                        Ok((id, crate::store::Sent::Accepted { .. })) => {
                            text(json!({"run_id": r.id, "message_id": id, "status": "pending"}))
                        }
                        Ok((_, crate::store::Sent::Finished(s))) => refuse(format!(
                            "run {} already ended as {}; start a new run on its thread to go on",
                            r.id,
                            s.as_str()
                        )),
                        Ok((_, crate::store::Sent::NotFound)) => {
                            refuse(format!("there is no run {}", r.id))
                        }
                        Ok((_, crate::store::Sent::Full)) => refuse(format!(
                            "{} messages already wait for run {}; send more after its next step",
                            crate::store::MAX_WAITING_MESSAGES,
                            r.id
                        )),
                        Err(e) => refuse(format!("storage: {e}")),
                    }
                }
                Err(e) => refuse(e),
            },
            "run_cancel" => match self.owned(&owner, &args["run_id"]).await {
                Ok(r) => match self.app.cancel(r.id).await {
                    Ok(o) => text(json!({"run_id": r.id, "outcome": format!("{o:?}")})),
                    Err(e) => refuse(format!("storage: {e}")),
                },
                Err(e) => refuse(e),
            },
            "run_wait" => {
                let ids = args["run_ids"].as_array().cloned().unwrap_or_default();
                if ids.is_empty() || ids.len() > 50 {
                    return refuse("run_ids must list 1 to 50 run ids".into());
                }
                let any = args["mode"].as_str() == Some("any");
                let deadline = tokio::time::Instant::now()
                    + Duration::from_secs_f64(
                        args["timeout_s"].as_f64().unwrap_or(60.0).clamp(0.0, 600.0),
                    );
                loop {
                    let mut runs = vec![];
                    for id in &ids {
                        match self.owned(&owner, id).await {
                            Ok(r) => runs.push(r),
                            Err(e) => return refuse(e),
                        }
                    }
                    let ended = runs.iter().filter(|r| r.status.is_terminal()).count();
                    let done = if any { ended > 0 } else { ended == runs.len() };
                    let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                    if done || left.is_zero() {
                        let mut snaps = vec![];
                        for r in &runs {
                            snaps.push(self.snapshot(r).await);
                        }
                        return text(json!({"runs": snaps, "wait_timed_out": !done}));
                    }
                    let pending = runs.iter().find(|r| !r.status.is_terminal()).map(|r| r.id);
                    if let Some(p) = pending {
                        let _ = self.app.wait(p, left.min(Duration::from_secs(1))).await;
                    }
                }
            }
            other => Err(ErrorData::invalid_params(
                format!("there is no tool `{other}`"),
                None,
            )),
        }
    }
}

fn task_status(s: RunStatus) -> TaskStatus {
    match s {
        RunStatus::Succeeded | RunStatus::Failed => TaskStatus::Completed,
        RunStatus::Cancelled => TaskStatus::Cancelled,
        _ => TaskStatus::Working,
    }
}
/// The progress notifications of one `run_agent` call: each of its run's events that has a
/// progress line, sent once and in order.
struct Progress {
    signal: Arc<crate::notify::Signal>,
    token: rmcp::model::ProgressToken,
    /// The last event sent (or passed over).
    cursor: u64,
}

impl Progress {
    fn new(signal: Arc<crate::notify::Signal>, token: rmcp::model::ProgressToken) -> Progress {
        Progress {
            signal,
            token,
            cursor: 0,
        }
    }

    /// Sends the run's events committed since the last call. A failed read is sent later (the
    /// next call reads from the same place).
    async fn send_new(&mut self, app: &App, run: RunId, peer: &rmcp::Peer<RoleServer>) -> Heard {
        const PAGE: u32 = 100;
        let mut heard = Heard::Stopped;
        loop {
            let events = match app.store.events_after(run, self.cursor, PAGE).await {
                Ok(events) => events,
                Err(e) => {
                    tracing::warn!(%run, error = %e, "could not read the run's events for its progress");
                    return heard;
                }
            };
            for e in &events {
                self.cursor = e.seq;
                if crate::events::is_terminal(&e.kind) {
                    heard = Heard::Ended;
                }
                if let Some(line) = crate::events::progress_line(e) {
                    let mut p = ProgressNotificationParam::new(self.token.clone(), e.seq as f64);
                    p.message = Some(line);
                    if peer.notify_progress(p).await.is_err() {
                        return Heard::Gone;
                    }
                }
            }
            if events.len() < PAGE as usize {
                return heard;
            }
        }
    }

    /// Sends progress as the run commits it, until its end, `deadline` or `cancel` (when
    /// given; a task's progress has neither), or the client is gone. Woken by each commit in
    /// this process, and every [`crate::app::CROSS_PROCESS_RECHECK`] for workers elsewhere.
    async fn until_end(
        &mut self,
        app: &App,
        run: RunId,
        deadline: Option<tokio::time::Instant>,
        peer: &rmcp::Peer<RoleServer>,
        cancel: Option<&tokio_util::sync::CancellationToken>,
    ) -> Heard {
        // Registered before the first read: a commit during it wakes the next.
        let mut watch = crate::notify::Watch::new(
            self.signal.clone(),
            crate::app::CROSS_PROCESS_RECHECK,
            crate::app::SHARED_READ_AGE,
        );
        let deadline = async {
            match deadline {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let cancelled = async {
            match cancel {
                Some(c) => c.cancelled().await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(deadline, cancelled);
        loop {
            match self.send_new(app, run, peer).await {
                Heard::Stopped => {}
                heard => return heard,
            }
            tokio::select! {
                _ = watch.next() => {}
                _ = &mut deadline => return Heard::Stopped,
                _ = &mut cancelled => return Heard::Stopped,
            }
        }
    }
}

/// How a run of [`Progress`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Heard {
    /// The run's terminal event was sent.
    Ended,
    /// Not ended yet: the deadline, the caller's cancel, or (from one read) nothing more now.
    Stopped,
    /// A notification could not be sent: the client is gone.
    Gone,
}

impl ServerHandler for McpRuns {
    fn get_info(&self) -> ServerConfig {
        let mut info = ServerConfig::new(
            ServerCapabilities::builder()
                .enable_tools()
                .enable_resources()
                .enable_tasks()
                .build(),
        );
        info.server_info.name = "subagents".into();
        info.server_info.version = env!("CARGO_PKG_VERSION").into();
        info.instructions = Some("Durable subagent runs: run_agent starts one (it survives restarts); follow long ones with run_wait or run_status.".into());
        info
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(self.tools()))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let args = Value::Object(request.arguments.clone().unwrap_or_default());
        self.call(&request.name, args, &context).await
    }

    async fn list_resources(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<rmcp::model::ListResourcesResult, ErrorData> {
        // The agents, as resources: what each is for, its tools and its prompt.
        let resources = self
            .app
            .agents
            .current()
            .all()
            .filter_map(|a| {
                serde_json::from_value(json!({"uri": format!("agent://{}", a.name), "name": a.name, "description": a.description, "mimeType": "text/markdown"})).ok()
            })
            .collect();
        Ok(rmcp::model::ListResourcesResult::with_all_items(resources))
    }

    async fn read_resource(
        &self,
        request: rmcp::model::ReadResourceRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<rmcp::model::ReadResourceResponse, ErrorData> {
        let name = request.uri.strip_prefix("agent://").unwrap_or("");
        let current = self.app.agents.current();
        let Some(a) = current.get(name) else {
            return Err(ErrorData::resource_not_found(
                format!("no resource {}; agents are agent://<name>", request.uri),
                None,
            ));
        };
        let tools = a
            .tools
            .as_ref()
            .map(|t| t.join(", "))
            .unwrap_or_else(|| "every built-in tool".into());
        let text = format!(
            "# {}\n\n{}\n\nTools: {tools}\nModel: {}\n\n## Prompt\n\n{}\n",
            a.name,
            a.description,
            a.model.as_deref().unwrap_or("the default"),
            a.system_prompt
        );
        let result: rmcp::model::ReadResourceResult = serde_json::from_value(
            json!({"contents": [{"uri": request.uri, "mimeType": "text/markdown", "text": text}]}),
        )
        .map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
        Ok(result.into())
    }

    async fn get_task(
        &self,
        request: GetTaskParams,
        context: RequestContext<RoleServer>,
    ) -> Result<GetTaskResult, ErrorData> {
        let r = self
            .owned(&self.owner_of(&context), &json!(request.task_id))
            .await
            .map_err(|e| ErrorData::invalid_params(e, None))?;
        let payload = match r.status {
            RunStatus::Succeeded | RunStatus::Failed => TaskPayload::Completed {
                result: serde_json::to_value(Self::outcome(&r))
                    .ok()
                    .and_then(|v| v.as_object().cloned())
                    .unwrap_or_default(),
            },
            RunStatus::Cancelled => TaskPayload::Cancelled,
            _ => TaskPayload::Working,
        };
        Ok(GetTaskResult::new(DetailedTask::new(
            Self::task_of(&r),
            payload,
        )))
    }

    async fn cancel_task(
        &self,
        request: CancelTaskParams,
        context: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        let r = self
            .owned(&self.owner_of(&context), &json!(request.task_id))
            .await
            .map_err(|e| ErrorData::invalid_params(e, None))?;
        self.app
            .cancel(r.id)
            .await
            .map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
        Ok(())
    }
}

/// The streamable HTTP service `serve` mounts at `/mcp` (behind its bearer keys: the API puts
/// the request's owner in its extensions as [`McpOwner`]). Without keys (`keyless`), rmcp's own
/// guard against DNS rebinding stays on: only a local `Host` is served.
pub fn http_service(
    app: Arc<App>,
    wait: Duration,
    keyless: bool,
) -> rmcp::transport::StreamableHttpService<
    McpRuns,
    rmcp::transport::streamable_http_server::session::local::LocalSessionManager,
> {
    // With keys, a bearer key authenticates every request, and the Host check (meant for
    // unauthenticated local servers) would only refuse legitimate remote clients.
    let config = rmcp::transport::StreamableHttpServerConfig::default();
    let config = if keyless {
        config
    } else {
        config.disable_allowed_hosts()
    };
    rmcp::transport::StreamableHttpService::new(
        move || Ok(McpRuns::new(app.clone(), OwnerId::local(), wait)),
        Default::default(),
        config,
    )
}

/// Serves `app` over stdin/stdout until the client disconnects.
pub async fn serve_stdio(app: Arc<App>, owner: OwnerId, wait: Duration) -> anyhow::Result<()> {
    use rmcp::ServiceExt;
    let service = McpRuns::new(app, owner, wait)
        .serve(rmcp::transport::stdio())
        .await?;
    service.waiting().await?;
    Ok(())
}
