//! CLI clients of a running server (`subagents start|status|events|cancel|wait`, and
//! `approvals|approve|deny` for tool calls waiting on a person), so an operator needs no curl.

use std::time::Duration;

use clap::{Args, Subcommand};
use eventsource_stream::Eventsource;
use futures::StreamExt;
use serde_json::{Value, json};

/// Where the server is.
#[derive(Args, Clone, Debug)]
pub struct ClientArgs {
    /// Server base URL.
    #[arg(
        long,
        env = "SUBAGENTS_URL",
        default_value = "http://127.0.0.1:8080",
        global = true
    )]
    pub url: String,
    /// Bearer key (when the server has keys configured).
    #[arg(long, env = "SUBAGENTS_KEY", hide_env_values = true, global = true)]
    pub key: Option<String>,
}

/// What `subagents schedules` does.
#[derive(Subcommand, Debug)]
pub enum ScheduleAction {
    /// One line per schedule: id, cron, time zone, agent, state, next tick.
    List,
    /// Add a schedule; prints it as JSON.
    Add {
        /// Five fields (minute hour day month weekday), or six with seconds first; quote it.
        cron: String,
        /// IANA time zone.
        #[arg(long, default_value = "UTC")]
        timezone: String,
        /// Agent.
        #[arg(long)]
        agent: Option<String>,
        /// Continue this thread at every tick (default: a new thread each time).
        #[arg(long)]
        thread: Option<String>,
        /// `skip`, `enqueue` or `cancel_previous`: what a tick does while the last run goes on.
        #[arg(long, default_value = "enqueue")]
        overlap: String,
        /// `none`, `last` or `all`: which ticks missed during downtime still fire.
        #[arg(long, default_value = "none")]
        catch_up: String,
        /// The task (`-` reads it from stdin).
        #[arg(required = true)]
        prompt: Vec<String>,
    },
    /// Stop it firing until resumed.
    Pause {
        /// Schedule id (`sch_…`).
        id: String,
    },
    /// Let it fire again (missed ticks as its catch_up says).
    Resume {
        /// Schedule id.
        id: String,
    },
    /// Fire it now; prints the run id.
    Trigger {
        /// Schedule id.
        id: String,
    },
}

/// Client commands.
#[derive(Subcommand, Debug)]
pub enum ClientCommand {
    /// Start a run on the server; prints the run as JSON.
    Start {
        /// Agent.
        #[arg(long, short, default_value = "general-purpose")]
        agent: String,
        /// Continue this thread.
        #[arg(long)]
        thread: Option<String>,
        /// Queue behind the thread's active run instead of failing with thread_busy.
        #[arg(long)]
        enqueue: bool,
        /// The task.
        #[arg(required = true)]
        prompt: Vec<String>,
    },
    /// Show a run's snapshot as JSON.
    Status {
        /// Run id.
        run_id: String,
    },
    /// Print a run's events as JSON lines; `--follow` streams until the run ends.
    Events {
        /// Run id.
        run_id: String,
        /// Start after this seq.
        #[arg(long, default_value_t = 0)]
        after: u64,
        /// Keep streaming (SSE) until the run ends.
        #[arg(long, short)]
        follow: bool,
        /// With --follow: also the model's text and tool-argument fragments of the step in
        /// flight, as `model.delta` lines (live only, never numbered).
        #[arg(long, requires = "follow")]
        deltas: bool,
    },
    /// Ask a run to stop.
    Cancel {
        /// Run id.
        run_id: String,
    },
    /// Send a queued, running or waiting run a message: it reaches the model before its next
    /// call (a run waiting on its subagents wakes for it). Prints the message id.
    Say {
        /// Run id.
        run_id: String,
        /// The message; `-` reads it from stdin.
        #[arg(required = true)]
        text: Vec<String>,
    },
    /// Fork a thread: a new thread whose history is this one's up to message `--at` (default:
    /// all of it), shared rather than copied; with a prompt, a run starts on it at once. Prints
    /// the new thread (and run) as JSON.
    Fork {
        /// Thread id.
        thread_id: String,
        /// The last message to share (an id from the thread view).
        #[arg(long)]
        at: Option<i64>,
        /// The agent of the run started with the prompt.
        #[arg(long)]
        agent: Option<String>,
        /// A task for a run on the new thread (`-` reads it from stdin).
        prompt: Vec<String>,
    },
    /// Retry a failed or cancelled run: a new run on its thread with the same agent and input,
    /// linked by `retry_of`; prints it as JSON. Retrying twice returns the first retry.
    Retry {
        /// Run id.
        run_id: String,
    },
    /// List tool calls waiting for a person (newest first), one per line: id, tool, run, why.
    Approvals {
        /// `pending` (default), `allowed`, `denied`, `expired` or `all`.
        #[arg(long, default_value = "pending")]
        status: String,
        /// Only this run's.
        #[arg(long)]
        run: Option<String>,
    },
    /// Allow a tool call that waits for approval; its run resumes.
    Approve {
        /// Approval id (`apr_…`).
        id: String,
        /// Why (recorded).
        #[arg(long)]
        reason: Option<String>,
        /// Allow this tool for the whole run tree, not just this call.
        #[arg(long)]
        run_tree: bool,
    },
    /// Deny a tool call that waits for approval; the model is told, with the reason.
    Deny {
        /// Approval id (`apr_…`).
        id: String,
        /// Why (the model sees it).
        #[arg(long)]
        reason: Option<String>,
    },
    /// Schedules: agent runs on a clock (`list` when no action is given).
    Schedules {
        /// What to do (default: list).
        #[command(subcommand)]
        action: Option<ScheduleAction>,
    },
    /// Wait for a run to end; prints the final snapshot. Exit 0 succeeded, 1 otherwise.
    Wait {
        /// Run id.
        run_id: String,
        /// Give up after this many seconds (exit 4).
        #[arg(long, default_value_t = 600.0)]
        timeout_s: f64,
    },
}

/// Client failures.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server could not be reached.
    #[error(
        "cannot reach the server at {url}: {source} (is `subagents serve` running? set --url or SUBAGENTS_URL)"
    )]
    Unreachable {
        /// URL.
        url: String,
        /// Cause.
        source: reqwest::Error,
    },
    /// The server answered with an error.
    #[error("server answered {status}: [{code}] {message}")]
    Api {
        /// HTTP status.
        status: u16,
        /// Error code.
        code: String,
        /// Message.
        message: String,
    },
    /// Standard input could not be read (`-` as the text).
    #[error("cannot read the text from stdin: {0}")]
    Stdin(#[from] std::io::Error),
}

struct Client {
    http: reqwest::Client,
    args: ClientArgs,
}

impl Client {
    fn req(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let mut b = self.http.request(
            method,
            format!("{}{path}", self.args.url.trim_end_matches('/')),
        );
        if let Some(k) = &self.args.key {
            b = b.bearer_auth(k);
        }
        b
    }

    async fn send(&self, b: reqwest::RequestBuilder) -> Result<Value, ClientError> {
        let resp = b.send().await.map_err(|source| ClientError::Unreachable {
            url: self.args.url.clone(),
            source,
        })?;
        let status = resp.status().as_u16();
        let body: Value = resp.json().await.unwrap_or(Value::Null);
        if status >= 400 {
            return Err(ClientError::Api {
                status,
                code: body["error"]["code"]
                    .as_str()
                    .unwrap_or("unknown")
                    .to_owned(),
                message: body["error"]["message"].as_str().unwrap_or("").to_owned(),
            });
        }
        Ok(body)
    }
}

/// Runs one client command; returns the exit code.
pub async fn run(args: ClientArgs, cmd: ClientCommand) -> Result<u8, ClientError> {
    let c = Client {
        http: reqwest::Client::new(),
        args,
    };
    match cmd {
        ClientCommand::Start {
            agent,
            thread,
            enqueue,
            prompt,
        } => {
            let body = json!({"agent": agent, "input": prompt.join(" "), "thread_id": thread, "if_busy": if enqueue { "enqueue" } else { "reject" }});
            let v = c
                .send(c.req(reqwest::Method::POST, "/v1/runs").json(&body))
                .await?;
            println!("{}", serde_json::to_string_pretty(&v).unwrap());
            Ok(0)
        }
        ClientCommand::Approvals { status, run } => {
            let mut path = "/v1/approvals?limit=200".to_owned();
            if status != "all" {
                path.push_str(&format!("&status={status}"));
            }
            if let Some(r) = run {
                path.push_str(&format!("&run_id={r}"));
            }
            let v = c.send(c.req(reqwest::Method::GET, &path)).await?;
            let list = v["approvals"].as_array().cloned().unwrap_or_default();
            if list.is_empty() {
                eprintln!(
                    "no {} approvals",
                    if status == "all" { "" } else { status.as_str() }
                );
            }
            for a in list {
                println!(
                    "{}\t{}\t{}\trun {}\t{}\t{}",
                    a["id"].as_str().unwrap_or(""),
                    a["status"].as_str().unwrap_or(""),
                    a["tool"].as_str().unwrap_or(""),
                    a["run_id"].as_str().unwrap_or(""),
                    a["reason"].as_str().unwrap_or(""),
                    a["input"]
                );
            }
            Ok(0)
        }
        ClientCommand::Approve {
            id,
            reason,
            run_tree,
        } => {
            let body = json!({"decision": "allow", "reason": reason, "scope": if run_tree { "run_tree" } else { "once" }});
            let v = c
                .send(
                    c.req(reqwest::Method::POST, &format!("/v1/approvals/{id}"))
                        .json(&body),
                )
                .await?;
            println!("{}", serde_json::to_string_pretty(&v).unwrap());
            Ok(0)
        }
        ClientCommand::Deny { id, reason } => {
            let v = c
                .send(
                    c.req(reqwest::Method::POST, &format!("/v1/approvals/{id}"))
                        .json(&json!({"decision": "deny", "reason": reason})),
                )
                .await?;
            println!("{}", serde_json::to_string_pretty(&v).unwrap());
            Ok(0)
        }
        ClientCommand::Status { run_id } => {
            let v = c
                .send(c.req(reqwest::Method::GET, &format!("/v1/runs/{run_id}")))
                .await?;
            println!("{}", serde_json::to_string_pretty(&v).unwrap());
            Ok(0)
        }
        ClientCommand::Cancel { run_id } => {
            let v = c
                .send(c.req(reqwest::Method::POST, &format!("/v1/runs/{run_id}/cancel")))
                .await?;
            println!("{}", serde_json::to_string_pretty(&v).unwrap());
            Ok(0)
        }
        ClientCommand::Say { run_id, text } => {
            let mut content = text.join(" ");
            if content == "-" {
                content = std::io::read_to_string(std::io::stdin())?;
            }
            let v = c
                .send(
                    c.req(
                        reqwest::Method::POST,
                        &format!("/v1/runs/{run_id}/messages"),
                    )
                    .json(&serde_json::json!({"content": content})),
                )
                .await?;
            println!("{}", v["message_id"].as_str().unwrap_or_default());
            Ok(0)
        }
        ClientCommand::Schedules { action } => {
            schedules(&c, action.unwrap_or(ScheduleAction::List)).await
        }
        ClientCommand::Fork {
            thread_id,
            at,
            agent,
            prompt,
        } => {
            let mut input = prompt.join(" ");
            if input == "-" {
                input = std::io::read_to_string(std::io::stdin())?;
            }
            let mut body = serde_json::json!({"at_message": at, "agent": agent});
            if !input.is_empty() {
                body["input"] = serde_json::json!(input);
            }
            let v = c
                .send(
                    c.req(
                        reqwest::Method::POST,
                        &format!("/v1/threads/{thread_id}/fork"),
                    )
                    .json(&body),
                )
                .await?;
            println!("{}", serde_json::to_string_pretty(&v).unwrap());
            Ok(0)
        }
        ClientCommand::Retry { run_id } => {
            let v = c
                .send(c.req(reqwest::Method::POST, &format!("/v1/runs/{run_id}/retry")))
                .await?;
            println!("{}", serde_json::to_string_pretty(&v).unwrap());
            Ok(0)
        }
        ClientCommand::Wait { run_id, timeout_s } => {
            let deadline = tokio::time::Instant::now() + Duration::from_secs_f64(timeout_s);
            loop {
                let left = deadline
                    .saturating_duration_since(tokio::time::Instant::now())
                    .as_secs_f64()
                    .min(300.0);
                let v = c
                    .send(c.req(
                        reqwest::Method::GET,
                        &format!("/v1/runs/{run_id}/wait?timeout_s={left:.3}"),
                    ))
                    .await?;
                if v["wait_timed_out"] != true {
                    println!("{}", serde_json::to_string_pretty(&v).unwrap());
                    return Ok(if v["status"] == "succeeded" { 0 } else { 1 });
                }
                if tokio::time::Instant::now() >= deadline {
                    println!("{}", serde_json::to_string_pretty(&v).unwrap());
                    return Ok(4);
                }
            }
        }
        ClientCommand::Events {
            run_id,
            after,
            follow,
            deltas,
        } => {
            if !follow {
                let v = c
                    .send(c.req(
                        reqwest::Method::GET,
                        &format!("/v1/runs/{run_id}/events?after={after}&limit=1000"),
                    ))
                    .await?;
                for e in v["events"].as_array().into_iter().flatten() {
                    println!("{e}");
                }
                return Ok(0);
            }
            let resp = c
                .req(
                    reqwest::Method::GET,
                    &format!(
                        "/v1/runs/{run_id}/events?after={after}{}",
                        if deltas { "&include=deltas" } else { "" }
                    ),
                )
                .header("accept", "text/event-stream")
                .send()
                .await
                .map_err(|source| ClientError::Unreachable {
                    url: c.args.url.clone(),
                    source,
                })?;
            if !resp.status().is_success() {
                let status = resp.status().as_u16();
                let body: Value = resp.json().await.unwrap_or(Value::Null);
                return Err(ClientError::Api {
                    status,
                    code: body["error"]["code"]
                        .as_str()
                        .unwrap_or("unknown")
                        .to_owned(),
                    message: body["error"]["message"].as_str().unwrap_or("").to_owned(),
                });
            }
            let mut stream = resp.bytes_stream().eventsource();
            while let Some(ev) = stream.next().await {
                match ev {
                    Ok(ev) => println!("{}", ev.data),
                    Err(e) => {
                        eprintln!("stream interrupted: {e}; resume with --after <last seq>");
                        return Ok(1);
                    }
                }
            }
            Ok(0)
        }
    }
}

async fn schedules(c: &Client, action: ScheduleAction) -> Result<u8, ClientError> {
    let post = |path: String| c.req(reqwest::Method::POST, &path);
    match action {
        ScheduleAction::List => {
            let v = c.send(c.req(reqwest::Method::GET, "/v1/schedules")).await?;
            let list = v["schedules"].as_array().cloned().unwrap_or_default();
            if list.is_empty() {
                eprintln!("no schedules");
            }
            for s in list {
                println!(
                    "{}\t{}\t{}\t{}\t{}\tnext {}",
                    s["id"].as_str().unwrap_or(""),
                    s["cron"].as_str().unwrap_or(""),
                    s["timezone"].as_str().unwrap_or(""),
                    s["agent"].as_str().unwrap_or(""),
                    if s["paused"] == true {
                        "paused"
                    } else {
                        "active"
                    },
                    s["next_fire_times"][0].as_str().unwrap_or("-"),
                );
            }
            Ok(0)
        }
        ScheduleAction::Add {
            cron,
            timezone,
            agent,
            thread,
            overlap,
            catch_up,
            prompt,
        } => {
            let mut input = prompt.join(" ");
            if input == "-" {
                input = std::io::read_to_string(std::io::stdin())?;
            }
            let body = json!({"cron": cron, "timezone": timezone, "agent": agent, "thread_id": thread,
                "overlap": overlap, "catch_up": catch_up, "input": input});
            let v = c.send(post("/v1/schedules".into()).json(&body)).await?;
            println!("{}", serde_json::to_string_pretty(&v).unwrap());
            Ok(0)
        }
        ScheduleAction::Pause { id } => {
            let v = c.send(post(format!("/v1/schedules/{id}/pause"))).await?;
            println!("{} paused", v["id"].as_str().unwrap_or(""));
            Ok(0)
        }
        ScheduleAction::Resume { id } => {
            let v = c.send(post(format!("/v1/schedules/{id}/resume"))).await?;
            println!(
                "{} resumed; next {}",
                v["id"].as_str().unwrap_or(""),
                v["next_fire_times"][0].as_str().unwrap_or("-")
            );
            Ok(0)
        }
        ScheduleAction::Trigger { id } => {
            let v = c.send(post(format!("/v1/schedules/{id}/trigger"))).await?;
            match v["run_id"].as_str() {
                Some(r) => println!("{r}"),
                None => eprintln!(
                    "skipped: the previous run {} is still going (overlap: skip)",
                    v["skipped_for"].as_str().unwrap_or("")
                ),
            }
            Ok(0)
        }
    }
}
