//! CLI clients of a running server (`subagents start|status|events|cancel|wait`), so an
//! operator needs no curl.

use std::time::Duration;

use clap::{Args, Subcommand};
use futures::StreamExt;
use eventsource_stream::Eventsource;
use serde_json::{Value, json};

/// Where the server is.
#[derive(Args, Clone, Debug)]
pub struct ClientArgs {
    /// Server base URL.
    #[arg(long, env = "SUBAGENTS_URL", default_value = "http://127.0.0.1:8080", global = true)]
    pub url: String,
    /// Bearer key (when the server has keys configured).
    #[arg(long, env = "SUBAGENTS_KEY", hide_env_values = true, global = true)]
    pub key: Option<String>,
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
    },
    /// Ask a run to stop.
    Cancel {
        /// Run id.
        run_id: String,
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
    #[error("cannot reach the server at {url}: {source} (is `subagents serve` running? set --url or SUBAGENTS_URL)")]
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
}

struct Client {
    http: reqwest::Client,
    args: ClientArgs,
}

impl Client {
    fn req(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let mut b = self.http.request(method, format!("{}{path}", self.args.url.trim_end_matches('/')));
        if let Some(k) = &self.args.key {
            b = b.bearer_auth(k);
        }
        b
    }

    async fn send(&self, b: reqwest::RequestBuilder) -> Result<Value, ClientError> {
        let resp = b.send().await.map_err(|source| ClientError::Unreachable { url: self.args.url.clone(), source })?;
        let status = resp.status().as_u16();
        let body: Value = resp.json().await.unwrap_or(Value::Null);
        if status >= 400 {
            return Err(ClientError::Api {
                status,
                code: body["error"]["code"].as_str().unwrap_or("unknown").to_owned(),
                message: body["error"]["message"].as_str().unwrap_or("").to_owned(),
            });
        }
        Ok(body)
    }
}

/// Runs one client command; returns the exit code.
pub async fn run(args: ClientArgs, cmd: ClientCommand) -> Result<u8, ClientError> {
    let c = Client { http: reqwest::Client::new(), args };
    match cmd {
        ClientCommand::Start { agent, thread, enqueue, prompt } => {
            let body = json!({"agent": agent, "input": prompt.join(" "), "thread_id": thread, "if_busy": if enqueue { "enqueue" } else { "reject" }});
            let v = c.send(c.req(reqwest::Method::POST, "/v1/runs").json(&body)).await?;
            println!("{}", serde_json::to_string_pretty(&v).unwrap());
            Ok(0)
        }
        ClientCommand::Status { run_id } => {
            let v = c.send(c.req(reqwest::Method::GET, &format!("/v1/runs/{run_id}"))).await?;
            println!("{}", serde_json::to_string_pretty(&v).unwrap());
            Ok(0)
        }
        ClientCommand::Cancel { run_id } => {
            let v = c.send(c.req(reqwest::Method::POST, &format!("/v1/runs/{run_id}/cancel"))).await?;
            println!("{}", serde_json::to_string_pretty(&v).unwrap());
            Ok(0)
        }
        ClientCommand::Wait { run_id, timeout_s } => {
            let deadline = tokio::time::Instant::now() + Duration::from_secs_f64(timeout_s);
            loop {
                let left = deadline.saturating_duration_since(tokio::time::Instant::now()).as_secs_f64().min(300.0);
                let v = c.send(c.req(reqwest::Method::GET, &format!("/v1/runs/{run_id}/wait?timeout_s={left:.3}"))).await?;
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
        ClientCommand::Events { run_id, after, follow } => {
            if !follow {
                let v = c.send(c.req(reqwest::Method::GET, &format!("/v1/runs/{run_id}/events?after={after}&limit=1000"))).await?;
                for e in v["events"].as_array().into_iter().flatten() {
                    println!("{e}");
                }
                return Ok(0);
            }
            let resp = c
                .req(reqwest::Method::GET, &format!("/v1/runs/{run_id}/events?after={after}"))
                .header("accept", "text/event-stream")
                .send()
                .await
                .map_err(|source| ClientError::Unreachable { url: c.args.url.clone(), source })?;
            if !resp.status().is_success() {
                let status = resp.status().as_u16();
                let body: Value = resp.json().await.unwrap_or(Value::Null);
                return Err(ClientError::Api {
                    status,
                    code: body["error"]["code"].as_str().unwrap_or("unknown").to_owned(),
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
