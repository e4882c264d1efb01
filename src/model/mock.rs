//! `subagents mock-llm`: a deterministic OpenAI-compatible Chat Completions server, streaming and
//! not, for tests, demos and load tests. It speaks the real wire format, so the client under test
//! is the production client.
//!
//! Behaviour comes from a scenario line in the conversation's latest user message that contains
//! one (see [`SCENARIO_HELP`]). Without a scenario it answers at once with a short text.

use std::collections::HashMap;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::{Message, ToolSpec};

/// The scenario grammar, shown by `subagents mock-llm --help`.
pub const SCENARIO_HELP: &str = "\
SCENARIO GRAMMAR
  The mock reads the latest user message that contains the word SCENARIO and takes
  space-separated key=value pairs after it, up to the end of that line:

    SCENARIO steps=5 tool=echo

  steps=K         answer after K steps: steps 1..K-1 call the tool, step K answers
                  `DONE after K steps` (default 1)
  tool=NAME       the tool to call (default echo); arguments are {\"text\": \"step i call j\"}
  parallel=N      N tool calls per step (default 1)
  loop=1          always make the identical call `NAME {\"text\":\"loop\"}`; once a tool result
                  says [loop_detected], answer `stopped repeating`
  fail_every=N    answer HTTP fail_status on every Nth request of this scenario (default off)
  fail_status=S   the status for fail_every (default 500); 400 makes a permanent failure
  retry_after=S   send `Retry-After: S` with failures
  latency_ms=L    wait L ms before answering (default: the server's --latency-ms)
  run=ID          any text that keeps scenarios apart (counters are per scenario line)

SCRIPTS (--script FILE)
  A JSON object of named turn lists, for scripting any tool call (parents and children apart):

    {\"parent\": [
       {\"tool_calls\": [{\"name\": \"subagent_start\", \"arguments\": {\"description\": \"...\", \"subagent\": \"general-purpose\"}}]},
       {\"tool_calls\": [{\"name\": \"subagent_await\", \"arguments\": {\"run_ids\": \"{{all:run_id}}\"}}]},
       {\"content\": \"all done\"}]}

  A request whose system prompt contains MOCK:parent gets turn K of \"parent\", K being the number
  of assistant messages after the latest user message. In arguments, \"{{all:F}}\" becomes the
  list of field F of every JSON tool result so far, \"{{nth:N:F}}\" field F of the Nth (from 0),
  \"{{last:F}}\" of the last. Past the last turn it answers `script ended`.

  A request that offers no tools (a forced final answer) is answered with
  `FORCED after N tool results`. Steps are counted as assistant messages after the latest
  user message, so a resumed conversation continues where it was.";

/// A parsed scenario line.
#[derive(Clone, Debug, PartialEq)]
pub struct Scenario {
    /// The line itself: counters are kept per line.
    pub key: String,
    steps: u32,
    tool: String,
    parallel: u32,
    looping: bool,
    fail_every: u32,
    fail_status: u16,
    retry_after: Option<u32>,
    latency_ms: Option<u64>,
}

impl Scenario {
    /// Parses the scenario from a user message, if the message has one.
    pub fn find(text: &str) -> Option<Result<Scenario, String>> {
        let line = text.lines().find(|l| l.contains("SCENARIO"))?;
        let rest = &line[line.find("SCENARIO").unwrap() + "SCENARIO".len()..];
        let mut s = Scenario {
            key: line.trim().to_owned(),
            steps: 1,
            tool: "echo".into(),
            parallel: 1,
            looping: false,
            fail_every: 0,
            fail_status: 500,
            retry_after: None,
            latency_ms: None,
        };
        for pair in rest.split_whitespace() {
            let Some((k, v)) = pair.split_once('=') else {
                return Some(Err(format!("scenario token `{pair}` is not key=value")));
            };
            let num = |v: &str| v.parse::<u64>().map_err(|_| format!("scenario key `{k}` needs a whole number, got `{v}`"));
            let r: Result<(), String> = (|| {
                match k {
                    "steps" => s.steps = num(v)?.clamp(1, 100_000) as u32,
                    "tool" => s.tool = v.to_owned(),
                    "parallel" => s.parallel = num(v)?.clamp(1, 64) as u32,
                    "loop" => s.looping = num(v)? != 0,
                    "fail_every" => s.fail_every = num(v)? as u32,
                    "fail_status" => s.fail_status = num(v)?.clamp(100, 599) as u16,
                    "retry_after" => s.retry_after = Some(num(v)? as u32),
                    "latency_ms" => s.latency_ms = Some(num(v)?),
                    "run" => {}
                    _ => return Err(format!("unknown scenario key `{k}`; known: steps tool parallel loop fail_every fail_status retry_after latency_ms run")),
                }
                Ok(())
            })();
            if let Err(e) = r {
                return Some(Err(e));
            }
        }
        Some(Ok(s))
    }
}

/// One request the mock answered, for tests that prove nothing was asked twice.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct LogEntry {
    /// The `x-subagents-step` header (`{run_id}:{step}`), empty if absent.
    pub step_key: String,
    /// The scenario line, empty if none.
    pub scenario: String,
    /// Assistant messages after the latest user message, plus one.
    pub step: u32,
    /// HTTP status answered.
    pub status: u16,
    /// Messages in the request (shows what context the model was given).
    pub messages: usize,
    /// Whether the request offered tools.
    pub offered_tools: bool,
    /// Characters of all messages in the request (the context the model was given).
    #[serde(default)]
    pub prompt_chars: usize,
    /// The model the request named.
    #[serde(default)]
    pub model: String,
}

/// One scripted turn: text, tool calls, or both.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Turn {
    /// Text of the answer.
    #[serde(default)]
    pub content: Option<String>,
    /// Calls to make.
    #[serde(default)]
    pub tool_calls: Vec<ScriptCall>,
}

/// A scripted tool call.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ScriptCall {
    /// Tool name.
    pub name: String,
    /// Arguments; strings of the form `{{all:F}}`, `{{nth:N:F}}`, `{{last:F}}` are filled in.
    #[serde(default)]
    pub arguments: Value,
}

/// Named turn lists.
pub type Script = HashMap<String, Vec<Turn>>;

/// Server settings.
#[derive(Clone, Debug, Default)]
pub struct MockOptions {
    /// Default wait before each answer.
    pub latency: Duration,
    /// Append every answered request to this file as a JSON line.
    pub log_file: Option<PathBuf>,
    /// Scripted turns, chosen by a `MOCK:<name>` marker in the system prompt.
    pub script: Option<Arc<Script>>,
}

/// Shared state of a running mock.
#[derive(Debug, Default)]
pub struct MockState {
    options: MockOptions,
    script: Mutex<Option<Arc<Script>>>,
    counters: Mutex<HashMap<String, u64>>,
    log: Mutex<Vec<LogEntry>>,
}

impl MockState {
    /// Replaces the script (tests that need ids known only after start-up).
    pub fn set_script(&self, script: Script) {
        *self.script.lock().unwrap() = Some(Arc::new(script));
    }

    /// Every request answered so far.
    pub fn log(&self) -> Vec<LogEntry> {
        self.log.lock().unwrap().clone()
    }

    fn record(&self, e: LogEntry) {
        if let Some(path) = &self.options.log_file {
            let line = serde_json::to_string(&e).unwrap();
            if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
                let _ = writeln!(f, "{line}");
            }
        }
        self.log.lock().unwrap().push(e);
    }
}

/// A mock bound to a port, serving in the background until dropped.
pub struct MockServer {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Its state (request log).
    pub state: Arc<MockState>,
    task: tokio::task::JoinHandle<()>,
}

impl MockServer {
    /// Binds (port 0 picks a free port) and serves in a background task.
    pub async fn start(bind: SocketAddr, options: MockOptions) -> std::io::Result<MockServer> {
        let listener = tokio::net::TcpListener::bind(bind).await?;
        let addr = listener.local_addr()?;
        let script = Mutex::new(options.script.clone());
        let state = Arc::new(MockState { options, script, ..Default::default() });
        let app = router(state.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(MockServer { addr, state, task })
    }

    /// The base URL to give a client (`http://addr/v1`).
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }
}

impl Drop for MockServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The mock's routes: `POST /v1/chat/completions`, `GET /v1/models`, `GET /healthz`.
pub fn router(state: Arc<MockState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(completions))
        .route("/chat/completions", post(completions))
        .route("/v1/models", get(|| async { Json(json!({"object":"list","data":[{"id":"mock-model","object":"model","owned_by":"subagents"}]})) }))
        .route("/healthz", get(|| async { "ok" }))
        .route("/_mock/stats", get(stats))
        .with_state(state)
}

/// Request counts, for benchmarks that run the mock as a separate process.
async fn stats(State(state): State<Arc<MockState>>) -> Json<Value> {
    let log = state.log.lock().unwrap();
    let ok = log.iter().filter(|e| e.status == 200).count();
    Json(json!({"requests": log.len(), "ok": ok}))
}

#[derive(Deserialize)]
struct CompletionRequest {
    #[serde(default)]
    model: String,
    messages: Vec<Message>,
    #[serde(default)]
    tools: Vec<ToolSpec>,
    #[serde(default)]
    stream: bool,
}

fn oai_error(status: StatusCode, message: &str) -> Response {
    (status, Json(json!({"error": {"message": message, "type": "invalid_request_error", "code": null}}))).into_response()
}

/// What the mock decided to say.
enum Reply {
    Text(String),
    Calls(Vec<(String, String, String)>),
}

async fn completions(State(state): State<Arc<MockState>>, headers: HeaderMap, body: axum::body::Bytes) -> Response {
    let step_key = headers.get("x-subagents-step").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
    let req: CompletionRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return oai_error(StatusCode::BAD_REQUEST, &format!("bad request body: {e}")),
    };
    let last_user = req.messages.iter().rposition(|m| matches!(m, Message::User { .. }));
    let after_user = last_user.map(|i| &req.messages[i + 1..]).unwrap_or(&req.messages[..]);
    let done_steps = after_user.iter().filter(|m| matches!(m, Message::Assistant { .. })).count() as u32;
    let tool_results = after_user.iter().filter(|m| matches!(m, Message::Tool { .. })).count();
    let scenario = req
        .messages
        .iter()
        .rev()
        .filter_map(|m| match m {
            Message::User { content } => Scenario::find(content),
            _ => None,
        })
        .next();
    let scenario = match scenario {
        Some(Err(e)) => {
            let (messages, offered_tools) = (req.messages.len(), !req.tools.is_empty());
            state.record(LogEntry { step_key, scenario: String::new(), step: done_steps + 1, status: 400, messages, offered_tools, prompt_chars: 0, model: req.model.clone() });
            return oai_error(StatusCode::BAD_REQUEST, &e);
        }
        Some(Ok(s)) => Some(s),
        None => None,
    };
    let latency = scenario
        .as_ref()
        .and_then(|s| s.latency_ms)
        .map(Duration::from_millis)
        .unwrap_or(state.options.latency);
    if !latency.is_zero() {
        tokio::time::sleep(latency).await;
    }
    let log = |status: u16| LogEntry {
        step_key: step_key.clone(),
        scenario: scenario.as_ref().map(|s| s.key.clone()).unwrap_or_default(),
        step: done_steps + 1,
        status,
        messages: req.messages.len(),
        offered_tools: !req.tools.is_empty(),
        prompt_chars: req.messages.iter().map(|m| serde_json::to_string(m).map(|s| s.len()).unwrap_or(0)).sum(),
        model: req.model.clone(),
    };
    if let Some(s) = &scenario {
        if s.fail_every > 0 {
            let n = {
                let mut c = state.counters.lock().unwrap();
                let n = c.entry(s.key.clone()).or_default();
                *n += 1;
                *n
            };
            if n % s.fail_every as u64 == 0 {
                state.record(log(s.fail_status));
                let status = StatusCode::from_u16(s.fail_status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
                let mut resp = oai_error(status, &format!("scripted failure (request {n} of scenario, fail_every={})", s.fail_every));
                if let Some(ra) = s.retry_after {
                    resp.headers_mut().insert("retry-after", ra.to_string().parse().unwrap());
                }
                return resp;
            }
        }
    }
    let script = state.script.lock().unwrap().clone();
    let scripted = script.as_ref().and_then(|s| scripted(s, &req, after_user, done_steps as usize));
    let reply = match scripted {
        Some(r) if !req.tools.is_empty() => r,
        _ => decide(scenario.as_ref(), &req, after_user, done_steps, tool_results),
    };
    state.record(log(200));
    let prompt_chars: usize = req.messages.iter().map(|m| serde_json::to_string(m).map(|s| s.len()).unwrap_or(0)).sum();
    let completion_chars = match &reply {
        Reply::Text(t) => t.len(),
        Reply::Calls(c) => c.iter().map(|(_, n, a)| n.len() + a.len()).sum(),
    };
    let usage = json!({
        "prompt_tokens": prompt_chars / 4 + 1,
        "completion_tokens": completion_chars / 4 + 1,
        "total_tokens": prompt_chars / 4 + completion_chars / 4 + 2,
    });
    let model = if req.model.is_empty() { "mock-model".to_owned() } else { req.model.clone() };
    if req.stream { stream_reply(model, reply, usage) } else { plain_reply(model, reply, usage) }
}

/// The scripted reply, if the system prompt names a script.
fn scripted(script: &Script, req: &CompletionRequest, after_user: &[Message], done: usize) -> Option<Reply> {
    let system = req.messages.iter().find_map(|m| match m {
        Message::System { content } => Some(content.as_str()),
        _ => None,
    })?;
    let at = system.find("MOCK:")? + 5;
    let name: String = system[at..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == '-').collect();
    let turns = script.get(&name)?;
    let Some(turn) = turns.get(done) else { return Some(Reply::Text("script ended".into())) };
    let results: Vec<Value> = after_user
        .iter()
        .filter_map(|m| match m {
            Message::Tool { content, .. } => Some(serde_json::from_str(content).unwrap_or(Value::Null)),
            _ => None,
        })
        .collect();
    if turn.tool_calls.is_empty() {
        return Some(Reply::Text(turn.content.clone().unwrap_or_default()));
    }
    Some(Reply::Calls(
        turn.tool_calls
            .iter()
            .enumerate()
            .map(|(j, c)| (format!("call_{}_{}", done + 1, j + 1), c.name.clone(), fill(&c.arguments, &results).to_string()))
            .collect(),
    ))
}

/// Fills `{{all:F}}`, `{{nth:N:F}}` and `{{last:F}}` from earlier tool results.
fn fill(v: &Value, results: &[Value]) -> Value {
    match v {
        Value::String(s) if s.starts_with("{{") && s.ends_with("}}") => {
            let inner = &s[2..s.len() - 2];
            let parts: Vec<&str> = inner.split(':').collect();
            match parts.as_slice() {
                ["all", f] => Value::Array(results.iter().filter_map(|r| r.get(*f).cloned()).collect()),
                ["last", f] => results.iter().rev().find_map(|r| r.get(*f).cloned()).unwrap_or(Value::Null),
                ["nth", n, f] => n.parse::<usize>().ok().and_then(|n| results.get(n)).and_then(|r| r.get(*f).cloned()).unwrap_or(Value::Null),
                _ => v.clone(),
            }
        }
        Value::Array(a) => Value::Array(a.iter().map(|x| fill(x, results)).collect()),
        Value::Object(o) => Value::Object(o.iter().map(|(k, x)| (k.clone(), fill(x, results))).collect()),
        other => other.clone(),
    }
}

fn decide(s: Option<&Scenario>, req: &CompletionRequest, after_user: &[Message], done: u32, tool_results: usize) -> Reply {
    let Some(s) = s else {
        let last = after_user
            .iter()
            .chain(req.messages.iter())
            .rev()
            .find_map(|m| match m {
                Message::User { content } => Some(content.as_str()),
                _ => None,
            })
            .unwrap_or("");
        let snippet: String = last.chars().take(80).collect();
        return Reply::Text(format!("mock answer to: {snippet}"));
    };
    if req.tools.is_empty() {
        return Reply::Text(format!("FORCED after {tool_results} tool results"));
    }
    if s.looping {
        let told = after_user.iter().any(|m| matches!(m, Message::Tool { content, .. } if content.contains("[loop_detected]")));
        return if told {
            Reply::Text(format!("stopped repeating after {tool_results} tool results"))
        } else {
            Reply::Calls(vec![(format!("call_{}", done + 1), s.tool.clone(), json!({"text": "loop"}).to_string())])
        };
    }
    let step = done + 1;
    if step >= s.steps {
        return Reply::Text(format!("DONE after {} steps", s.steps));
    }
    Reply::Calls(
        (1..=s.parallel)
            .map(|j| (format!("call_{step}_{j}"), s.tool.clone(), json!({"text": format!("step {step} call {j}")}).to_string()))
            .collect(),
    )
}

fn plain_reply(model: String, reply: Reply, usage: Value) -> Response {
    let (message, finish) = match reply {
        Reply::Text(t) => (json!({"role": "assistant", "content": t}), "stop"),
        Reply::Calls(calls) => (
            json!({"role": "assistant", "content": null, "tool_calls": calls.iter().map(|(id, n, a)| json!({"id": id, "type": "function", "function": {"name": n, "arguments": a}})).collect::<Vec<_>>()}),
            "tool_calls",
        ),
    };
    Json(json!({
        "id": format!("chatcmpl-{}", uuid::Uuid::new_v4().simple()),
        "object": "chat.completion",
        "created": chrono::Utc::now().timestamp(),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": usage,
    }))
    .into_response()
}

fn stream_reply(model: String, reply: Reply, usage: Value) -> Response {
    let id = format!("chatcmpl-{}", uuid::Uuid::new_v4().simple());
    let created = chrono::Utc::now().timestamp();
    let chunk = |delta: Value, finish: Option<&str>| {
        json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    };
    let mut chunks = vec![chunk(json!({"role": "assistant", "content": ""}), None)];
    match reply {
        Reply::Text(t) => {
            // Word by word, as real servers stream.
            for w in t.split_inclusive(' ') {
                chunks.push(chunk(json!({"content": w}), None));
            }
            chunks.push(chunk(json!({}), Some("stop")));
        }
        Reply::Calls(calls) => {
            for (i, (cid, name, args)) in calls.iter().enumerate() {
                chunks.push(chunk(
                    json!({"tool_calls": [{"index": i, "id": cid, "type": "function", "function": {"name": name, "arguments": ""}}]}),
                    None,
                ));
                // Arguments arrive in fragments; the client must join them.
                let mid = args.char_indices().nth(args.chars().count() / 2).map(|(b, _)| b).unwrap_or(0);
                for part in [&args[..mid], &args[mid..]] {
                    chunks.push(chunk(json!({"tool_calls": [{"index": i, "function": {"arguments": part}}]}), None));
                }
            }
            chunks.push(chunk(json!({}), Some("tool_calls")));
        }
    }
    chunks.push(json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [], "usage": usage}));
    let mut events: Vec<Result<Event, std::convert::Infallible>> =
        chunks.into_iter().map(|c| Ok(Event::default().data(c.to_string()))).collect();
    events.push(Ok(Event::default().data("[DONE]")));
    Sse::new(futures::stream::iter(events)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scenarios_parse() {
        let s = Scenario::find("hello\nSCENARIO steps=5 tool=echo parallel=2 run=x").unwrap().unwrap();
        assert_eq!((s.steps, s.parallel, s.tool.as_str()), (5, 2, "echo"));
        assert!(Scenario::find("no scenario").is_none());
        let e = Scenario::find("SCENARIO stepz=5").unwrap().unwrap_err();
        assert!(e.contains("unknown scenario key `stepz`"), "{e}");
        assert!(Scenario::find("SCENARIO steps=x").unwrap().is_err());
    }
}
