//! `subagents mock-llm`: a deterministic model server speaking OpenAI's Chat Completions and
//! Anthropic's Messages API, streaming and not, for tests, demos and load tests. It speaks the
//! real wire formats, so the clients under test are the production clients.
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

use super::{Message, ToolSpec, compact};

mod anthropic;
mod openai;

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
  window=N        refuse a request over N tokens (counted with the model's tiktoken encoding,
                  as the client counts) with OpenAI's 400 `context_length_exceeded`
                  (default: the server's --window)
  pad=B           make each call's text about B bytes long (realistic tool outputs)
  pad_max=B2      vary that length between pad and pad_max, deterministically per call
  chunk_ms=C      wait C ms between streamed chunks (an answer written slowly)
  stamp=1         begin a text answer with the microseconds since the Unix epoch at which its
                  first chunk is sent (for measuring how late a client sees it)
  read=PATH       call read_file on PATH (read=tool:NAME: call tool NAME first), then page
                  on wherever a result says
                  `read_file with path=`P` offset=N reads on`, and answer `READ DONE` with the
                  last line read

SUMMARIES
  A request whose system prompt holds [subagents:compaction] is a compaction: the mock
  answers `MOCK SUMMARY steps=K tool_results=R`, counting the transcript's assistant turns
  and tool results after its last user turn (plus an earlier summary's). A context that holds
  such a summary after its latest user message continues the count, so a compacted scenario
  ends at the same step as an uncompacted one.

STRUCTURED OUTPUT
  A request with `response_format: {type: json_schema, ...}` gets a value of that schema where
  it would get text (scripted turns are sent as written: they stand for models that ignore the
  format). A malformed response_format is refused with 400, as OpenAI refuses it. A user
  message starting [subagents:output_invalid] (an answer sent back for its schema) does not
  restart the step count.

WIRE FORMATS
  POST /v1/chat/completions is OpenAI's Chat Completions; POST /v1/messages is Anthropic's
  Messages API (x-api-key and anthropic-version headers required). Both are strict as the real
  APIs are: unknown parameters, a missing model, tool calls without their results and results
  without their call are refused with 400. A Chat Completions stream ends with usage only when
  stream_options.include_usage asks for it. The Messages API side counts its own tokens (a token
  per four bytes of each block's JSON), keeps a prompt cache that follows the cache_control
  breakpoints it is sent (prefixes of 1024 tokens or more, five minutes), answers with a signed
  thinking block when thinking is enabled and checks the signature when it comes back, and
  answers a schema through a tool named final_result (always through a forced tool_choice).
  fail_status=529 sends Anthropic's overloaded_error; --rpm adds the
  anthropic-ratelimit-requests-* headers there and x-ratelimit-* on Chat Completions.

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
    window: Option<u64>,
    pad: usize,
    pad_max: usize,
    read: Option<String>,
    chunk_ms: u64,
    stamp: bool,
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
            window: None,
            pad: 0,
            pad_max: 0,
            read: None,
            chunk_ms: 0,
            stamp: false,
        };
        for pair in rest.split_whitespace() {
            let Some((k, v)) = pair.split_once('=') else {
                return Some(Err(format!("scenario token `{pair}` is not key=value")));
            };
            let num = |v: &str| {
                v.parse::<u64>()
                    .map_err(|_| format!("scenario key `{k}` needs a whole number, got `{v}`"))
            };
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
                    "window" => s.window = Some(num(v)?.max(1)),
                    "pad" => s.pad = num(v)?.min(1 << 20) as usize,
                    "pad_max" => s.pad_max = num(v)?.min(1 << 20) as usize,
                    "read" => s.read = Some(v.to_owned()),
                    "chunk_ms" => s.chunk_ms = num(v)?.min(60_000),
                    "stamp" => s.stamp = num(v)? != 0,
                    "run" => {}
                    _ => {
                        return Err(format!(
                            "unknown scenario key `{k}`; known: steps tool parallel loop fail_every fail_status retry_after latency_ms window pad pad_max read run"
                        ));
                    }
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
    /// Prompt tokens of the request, counted with the model's encoding (what the usage says).
    #[serde(default)]
    pub prompt_tokens: u64,
    /// Whether it was a compaction (summarisation) request.
    #[serde(default)]
    pub summary: bool,
    /// The request's user messages in order, each cut to its first 200 characters (what a
    /// test checks a message reached the model, and how often).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub user_texts: Vec<String>,
    /// The request's first system message, cut to its first 200 characters.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub system: String,
    /// The names of the tools the request offered, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tools: Vec<String>,
    /// Whether it asked for structured output (`response_format: json_schema`, or Anthropic's
    /// forced result tool).
    #[serde(default)]
    pub structured: bool,
    /// The wire format it came in: `openai` (`/v1/chat/completions`) or `anthropic`
    /// (`/v1/messages`).
    #[serde(default)]
    pub api: String,
    /// Prompt tokens the mock's prompt cache served (Anthropic requests with breakpoints).
    #[serde(default)]
    pub cache_read_tokens: u64,
    /// Prompt tokens the request wrote to the mock's prompt cache.
    #[serde(default)]
    pub cache_write_tokens: u64,
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
    /// Refuse requests over this many tokens, as a provider does (`context_length_exceeded`).
    pub window: Option<u64>,
    /// Answer 429 (with `Retry-After`) to a request beyond this many in any rolling window, as
    /// a provider's rate limit does.
    pub rate_limit: Option<(usize, Duration)>,
}

/// Shared state of a running mock.
#[derive(Debug, Default)]
pub struct MockState {
    options: MockOptions,
    script: Mutex<Option<Arc<Script>>>,
    counters: Mutex<HashMap<String, u64>>,
    log: Mutex<Vec<LogEntry>>,
    accepted: Mutex<std::collections::VecDeque<std::time::Instant>>,
    /// The prompt cache of the Messages API: prefix hashes and when each was last used.
    prompt_cache: Mutex<HashMap<u64, std::time::Instant>>,
    /// Chat Completions request bodies, kept while a capture is on ([`MockState::capture`]).
    captured: Mutex<Option<Vec<axum::body::Bytes>>>,
}

impl MockState {
    /// Replaces the script (tests that need ids known only after start-up).
    pub fn set_script(&self, script: Script) {
        *self.script.lock().unwrap() = Some(Arc::new(script));
    }

    /// Keeps the bodies of the Chat Completions requests from now on, until
    /// [`MockState::take_captured`]: `bench-latency` replays a run's own requests to time the
    /// model calls alone.
    pub fn capture(&self) {
        *self.captured.lock().unwrap() = Some(vec![]);
    }

    /// The bodies kept since [`MockState::capture`], in the order they came; stops keeping.
    pub fn take_captured(&self) -> Vec<axum::body::Bytes> {
        self.captured.lock().unwrap().take().unwrap_or_default()
    }

    /// Every request answered so far.
    pub fn log(&self) -> Vec<LogEntry> {
        self.log.lock().unwrap().clone()
    }

    /// With a rate limit: the limit, what is left of it now, and when the oldest request in the
    /// window leaves it.
    fn budget(&self) -> Option<(usize, usize, Duration)> {
        let (max, per) = self.options.rate_limit?;
        let now = std::time::Instant::now();
        let q = self.accepted.lock().unwrap();
        let live: Vec<_> = q.iter().filter(|t| now.duration_since(**t) < per).collect();
        let reset = live
            .first()
            .map(|t| per.saturating_sub(now.duration_since(**t)))
            .unwrap_or_default();
        Some((max, max.saturating_sub(live.len()), reset))
    }

    fn record(&self, e: LogEntry) {
        if let Some(path) = &self.options.log_file {
            let line = serde_json::to_string(&e).unwrap();
            if let Ok(mut f) = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
            {
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
        // Requests are counted with the tokenizer: load it before the first one.
        let _ = tokio::task::spawn_blocking(|| super::tokens::Counter::warm("gpt-4o")).await;
        let listener = tokio::net::TcpListener::bind(bind).await?;
        let addr = listener.local_addr()?;
        let script = Mutex::new(options.script.clone());
        let state = Arc::new(MockState {
            options,
            script,
            ..Default::default()
        });
        let app = router(state.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app.into_make_service()).await;
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

/// The mock's routes: `POST /v1/chat/completions`, `POST /v1/messages`, `GET /v1/models`,
/// `GET /healthz`.
pub fn router(state: Arc<MockState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(completions))
        .route("/chat/completions", post(completions))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/models", get(|| async { Json(json!({"object":"list","data":[{"id":"mock-model","object":"model","owned_by":"subagents"}]})) }))
        .route("/healthz", get(|| async { "ok" }))
        .route("/_mock/stats", get(stats))
        .with_state(state)
}

/// Request counts, for benchmarks that run the mock as a separate process.
async fn stats(State(state): State<Arc<MockState>>) -> Json<Value> {
    let log = state.log.lock().unwrap();
    let ok = log.iter().filter(|e| e.status == 200).count();
    let refused = log.iter().filter(|e| e.status == 429).count();
    Json(json!({"requests": log.len(), "ok": ok, "refused_429": refused}))
}

/// A request in the decision logic's terms, read from either wire format.
struct CompletionRequest {
    model: String,
    messages: Vec<Message>,
    tools: Vec<ToolSpec>,
    stream: bool,
    response_format: Option<Value>,
}

/// The schema a `response_format` asks for, or why OpenAI would refuse it.
fn asked_schema(format: Option<&Value>) -> Result<Option<&Value>, String> {
    let Some(f) = format else { return Ok(None) };
    match f["type"].as_str() {
        Some("text") | Some("json_object") => Ok(None),
        Some("json_schema") => {
            let js = &f["json_schema"];
            let name = js["name"].as_str().unwrap_or("");
            let name_ok = (1..=64).contains(&name.len())
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
            if !name_ok {
                return Err(
                    "response_format.json_schema.name must be 1 to 64 of a-z, A-Z, 0-9, _ and -"
                        .into(),
                );
            }
            match &js["schema"] {
                v @ Value::Object(_) => Ok(Some(v)),
                _ => Err("response_format.json_schema.schema must be an object".into()),
            }
        }
        _ => Err("response_format.type must be one of text, json_object, json_schema".into()),
    }
}

/// A value the schema accepts, as a provider honouring `response_format` would answer: the
/// first of `const`/`enum`/`anyOf`/`oneOf`, objects with their required properties, one
/// item in arrays that need one, numbers at their minimum.
fn schema_example(schema: &Value) -> Value {
    if let Some(c) = schema.get("const") {
        return c.clone();
    }
    if let Some(first) = schema["enum"].as_array().and_then(|e| e.first()) {
        return first.clone();
    }
    for k in ["anyOf", "oneOf"] {
        if let Some(first) = schema[k].as_array().and_then(|e| e.first()) {
            return schema_example(first);
        }
    }
    let kind = match &schema["type"] {
        Value::String(t) => t.as_str(),
        Value::Array(ts) => ts
            .iter()
            .filter_map(Value::as_str)
            .find(|t| *t != "null")
            .unwrap_or("null"),
        _ if schema.get("properties").is_some() => "object",
        _ => "string",
    };
    match kind {
        "object" => {
            let props = schema["properties"].as_object();
            let required: Vec<&str> = schema["required"]
                .as_array()
                .map(|r| r.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            let mut out = serde_json::Map::new();
            for (k, v) in props.into_iter().flatten() {
                if required.is_empty() || required.contains(&k.as_str()) {
                    out.insert(k.clone(), schema_example(v));
                }
            }
            Value::Object(out)
        }
        "array" => {
            let n = schema["minItems"].as_u64().unwrap_or(1).max(1);
            Value::Array((0..n).map(|_| schema_example(&schema["items"])).collect())
        }
        "integer" => json!(schema["minimum"].as_i64().unwrap_or(0)),
        "number" => json!(schema["minimum"].as_f64().unwrap_or(0.0)),
        "boolean" => json!(true),
        "null" => Value::Null,
        _ => {
            let min = schema["minLength"].as_u64().unwrap_or(0) as usize;
            json!(format!("{:m<min$}", "mock"))
        }
    }
}

fn context_length_error(window: u64, tokens: u64) -> Response {
    let message = format!(
        "This model's maximum context length is {window} tokens. However, your messages resulted in {tokens} tokens. Please reduce the length of the messages."
    );
    (StatusCode::BAD_REQUEST, Json(json!({"error": {"message": message, "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}))).into_response()
}

/// Where a conversation stands: assistant turns and tool results since the latest caller
/// message, a compaction summary's counts included.
fn progress(messages: &[Message]) -> (usize, u32, usize) {
    let last_user = messages
        .iter()
        .rposition(|m| matches!(m, Message::User { content } if !compact::is_summary(content) && !crate::output::is_feedback(content)));
    let from = last_user.map(|i| i + 1).unwrap_or(0);
    let (mut steps, mut results) = (0u32, 0usize);
    for m in &messages[from..] {
        match m {
            Message::Assistant { .. } => steps += 1,
            Message::Tool { .. } => results += 1,
            Message::User { content } => {
                let (s, r) = summary_counts(content);
                steps += s;
                results += r;
            }
            Message::System { .. } => {}
        }
    }
    (from, steps, results)
}

/// `steps=K tool_results=R` out of a mock summary (zeros when absent).
fn summary_counts(text: &str) -> (u32, usize) {
    let field = |name: &str| {
        text.find(&format!("{name}="))
            .map(|i| {
                text[i + name.len() + 1..]
                    .chars()
                    .take_while(|c| c.is_ascii_digit())
                    .collect::<String>()
            })
            .and_then(|d| d.parse::<usize>().ok())
            .unwrap_or(0)
    };
    (field("steps") as u32, field("tool_results"))
}

/// The deterministic answer to a compaction request: counts of the transcript's turns since
/// its last user turn (an earlier summary before any user turn counts too).
fn summarise(transcript: &str) -> String {
    let (mut steps, mut results) = (0u32, 0usize);
    for section in transcript
        .split(
            "

",
        )
        .map(str::trim_start)
    {
        if section.starts_with(compact::USER) || section.starts_with(compact::TASK) {
            (steps, results) = (0, 0);
        } else if section.starts_with(compact::ASSISTANT) {
            steps += 1;
        } else if section.starts_with(compact::TOOL_RESULT) {
            results += 1;
        } else if let Some(rest) = section.strip_prefix(compact::EARLIER_SUMMARY) {
            let (s, r) = summary_counts(rest);
            steps += s;
            results += r;
        }
    }
    format!("MOCK SUMMARY steps={steps} tool_results={results}")
}

/// Deterministic filler of about `bytes` bytes, varied enough to tokenize like prose.
fn filler(bytes: usize, seed: u32) -> String {
    const WORDS: &[&str] = &[
        "alpha", "river", "stone", "quiet", "market", "signal", "orbit", "lantern", "copper",
        "meadow", "vector", "harbor", "pixel", "summit", "ember", "glacier", "the", "of", "and",
        "report", "found", "42", "config", "server", "latency", "percent", "user", "error",
        "returns", "file", "module", "2024", "value", "request", "index", "table", "which",
        "shows", "that", "between",
    ];
    let mut out = String::with_capacity(bytes + 8);
    let mut x = u64::from(seed)
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    while out.len() < bytes {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let r = (x >> 33) as usize;
        out.push_str(WORDS[r % WORDS.len()]);
        out.push_str(if r.is_multiple_of(13) {
            ". "
        } else if r.is_multiple_of(17) {
            ", "
        } else {
            " "
        });
    }
    out
}

/// The next `read=` call: page on where the latest result says to, or `None` when done.
fn next_read(first: &str, results: &[&str]) -> Option<(String, u64)> {
    let Some(last) = results.last() else {
        return Some((first.to_owned(), 1));
    };
    let at = last.rfind("read_file with path=`")?;
    let rest = &last[at + "read_file with path=`".len()..];
    let (path, rest) = rest.split_once('`')?;
    let offset = rest
        .trim_start()
        .strip_prefix("offset=")?
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect::<String>()
        .parse()
        .ok()?;
    Some((path.to_owned(), offset))
}

fn oai_error(status: StatusCode, message: &str) -> Response {
    (
        status,
        Json(json!({"error": {"message": message, "type": "invalid_request_error", "code": null}})),
    )
        .into_response()
}

/// Replaced, as a chunk is sent, by the microseconds since the Unix epoch (`stamp=1`).
const NOW_US: &str = "{{now_us}}";

/// A chunk's data with the send time filled in.
fn stamped(data: String) -> String {
    if !data.contains(NOW_US) {
        return data;
    }
    let us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_micros();
    data.replace(NOW_US, &us.to_string())
}

/// What the mock decided to say.
#[derive(Clone, Debug, PartialEq)]
enum Reply {
    Text(String),
    Calls(Vec<(String, String, String)>),
}

async fn completions(
    State(state): State<Arc<MockState>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    if let Some(kept) = state.captured.lock().unwrap().as_mut() {
        kept.push(body.clone());
    }
    let parsed = match openai::parse(&body) {
        Ok(p) => p,
        Err(e) => return oai_error(StatusCode::BAD_REQUEST, &e),
    };
    let dialect = Dialect::OpenAi {
        include_usage: parsed.include_usage,
        prompt_tokens: parsed.prompt_tokens,
    };
    let mut resp = answer(state.clone(), &headers, parsed.request, dialect).await;
    // A rate-limited mock reports its budget on every answer, as OpenAI does.
    if let Some((max, remaining, reset)) = state.budget()
        && resp.status().is_success()
    {
        let h = resp.headers_mut();
        h.insert(
            "x-ratelimit-limit-requests",
            max.to_string().parse().unwrap(),
        );
        h.insert(
            "x-ratelimit-remaining-requests",
            remaining.to_string().parse().unwrap(),
        );
        h.insert(
            "x-ratelimit-reset-requests",
            format!("{}ms", reset.as_millis()).parse().unwrap(),
        );
    }
    resp
}

/// The wire format a request came in, and what only that format carries.
enum Dialect {
    /// Chat Completions; a stream ends with usage only when the request asked for it
    /// (`stream_options.include_usage`), as OpenAI's does.
    OpenAi {
        include_usage: bool,
        prompt_tokens: u64,
    },
    /// The Messages API.
    Anthropic(anthropic::Extras),
}

impl Dialect {
    fn name(&self) -> &'static str {
        match self {
            Dialect::OpenAi { .. } => "openai",
            Dialect::Anthropic(_) => "anthropic",
        }
    }

    fn error(&self, status: StatusCode, message: &str) -> Response {
        match self {
            Dialect::OpenAi { .. } => oai_error(status, message),
            Dialect::Anthropic(_) => anthropic::error(status, message),
        }
    }

    fn too_long(&self, window: u64, tokens: u64) -> Response {
        match self {
            Dialect::OpenAi { .. } => context_length_error(window, tokens),
            Dialect::Anthropic(_) => anthropic::error(
                StatusCode::BAD_REQUEST,
                &format!("prompt is too long: {tokens} tokens > {window} maximum"),
            ),
        }
    }

    fn cache(&self) -> Option<&anthropic::CacheUse> {
        match self {
            Dialect::OpenAi { .. } => None,
            Dialect::Anthropic(x) => Some(&x.cache),
        }
    }

    fn result_tool(&self) -> Option<&(String, Value)> {
        match self {
            Dialect::OpenAi { .. } => None,
            Dialect::Anthropic(x) => x.result_tool.as_ref(),
        }
    }
}

/// The log entry of a request refused before it was read further (a bad scenario, the rate
/// limit).
#[allow(clippy::too_many_arguments)]
fn refused(
    req: &CompletionRequest,
    dialect: &Dialect,
    step_key: String,
    scenario: String,
    done_steps: u32,
    status: u16,
    prompt_tokens: u64,
    summary: bool,
) -> LogEntry {
    LogEntry {
        step_key,
        scenario,
        step: done_steps + 1,
        status,
        messages: req.messages.len(),
        offered_tools: !req.tools.is_empty(),
        prompt_chars: 0,
        model: req.model.clone(),
        prompt_tokens,
        summary,
        user_texts: vec![],
        system: String::new(),
        tools: vec![],
        structured: false,
        api: dialect.name().into(),
        cache_read_tokens: 0,
        cache_write_tokens: 0,
    }
}

/// Decides and renders the answer to one request, whichever wire format it came in.
async fn answer(
    state: Arc<MockState>,
    headers: &HeaderMap,
    req: CompletionRequest,
    dialect: Dialect,
) -> Response {
    let step_key = headers
        .get("x-subagents-step")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let schema = match asked_schema(req.response_format.as_ref()) {
        Ok(s) => s.cloned(),
        Err(e) => return dialect.error(StatusCode::BAD_REQUEST, &e),
    };
    let (from, done_steps, tool_results) = progress(&req.messages);
    let after_user = &req.messages[from..];
    let prompt_tokens = match &dialect {
        Dialect::Anthropic(x) => x.cache.total,
        Dialect::OpenAi { prompt_tokens, .. } => *prompt_tokens,
    };
    let is_summary = req.messages.iter().any(
        |m| matches!(m, Message::System { content } if content.contains(compact::REQUEST_MARKER)),
    );
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
            state.record(refused(
                &req,
                &dialect,
                step_key,
                String::new(),
                done_steps,
                400,
                prompt_tokens,
                is_summary,
            ));
            return dialect.error(StatusCode::BAD_REQUEST, &e);
        }
        Some(Ok(s)) => Some(s),
        None => None,
    };
    let latency = scenario
        .as_ref()
        .and_then(|s| s.latency_ms)
        .map(Duration::from_millis)
        .unwrap_or(state.options.latency);
    if let Some((max, per)) = state.options.rate_limit {
        let now = std::time::Instant::now();
        let retry = {
            let mut q = state.accepted.lock().unwrap();
            while q.front().is_some_and(|t| now.duration_since(*t) >= per) {
                q.pop_front();
            }
            if q.len() >= max {
                Some(per.saturating_sub(now.duration_since(*q.front().unwrap())))
            } else {
                q.push_back(now);
                None
            }
        };
        if let Some(after) = retry {
            let key = scenario.as_ref().map(|s| s.key.clone()).unwrap_or_default();
            state.record(refused(
                &req,
                &dialect,
                step_key.clone(),
                key,
                done_steps,
                429,
                prompt_tokens,
                is_summary,
            ));
            let mut resp = dialect.error(
                StatusCode::TOO_MANY_REQUESTS,
                &format!(
                    "Rate limit reached: {max} requests per {}s",
                    per.as_secs_f64()
                ),
            );
            resp.headers_mut().insert(
                "retry-after",
                format!("{}", after.as_secs_f64().ceil().max(1.0))
                    .parse()
                    .unwrap(),
            );
            return resp;
        }
    }
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
        prompt_chars: req
            .messages
            .iter()
            .map(|m| serde_json::to_string(m).map(|s| s.len()).unwrap_or(0))
            .sum(),
        model: req.model.clone(),
        prompt_tokens,
        summary: is_summary,
        user_texts: req
            .messages
            .iter()
            .filter_map(|m| match m {
                Message::User { content } => Some(content.chars().take(200).collect()),
                _ => None,
            })
            .collect(),
        system: req
            .messages
            .iter()
            .find_map(|m| match m {
                Message::System { content } => Some(content.chars().take(200).collect()),
                _ => None,
            })
            .unwrap_or_default(),
        tools: req.tools.iter().map(|t| t.function.name.clone()).collect(),
        structured: schema.is_some() || dialect.result_tool().is_some(),
        api: dialect.name().into(),
        cache_read_tokens: dialect.cache().map_or(0, |c| c.read),
        cache_write_tokens: dialect.cache().map_or(0, |c| c.write),
    };
    if let Some(window) = scenario
        .as_ref()
        .and_then(|s| s.window)
        .or(state.options.window)
        && prompt_tokens > window
    {
        state.record(log(400));
        return dialect.too_long(window, prompt_tokens);
    }
    if let Some(s) = &scenario
        && s.fail_every > 0
    {
        let n = {
            let mut c = state.counters.lock().unwrap();
            let n = c.entry(s.key.clone()).or_default();
            *n += 1;
            *n
        };
        if n % s.fail_every as u64 == 0 {
            state.record(log(s.fail_status));
            let status =
                StatusCode::from_u16(s.fail_status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            let mut resp = dialect.error(
                status,
                &format!(
                    "scripted failure (request {n} of scenario, fail_every={})",
                    s.fail_every
                ),
            );
            if let Some(ra) = s.retry_after {
                resp.headers_mut()
                    .insert("retry-after", ra.to_string().parse().unwrap());
            }
            return resp;
        }
    }
    let script = state.script.lock().unwrap().clone();
    let scripted = script
        .as_ref()
        .and_then(|s| scripted(s, &req, after_user, done_steps as usize));
    let reply = if is_summary {
        let transcript = req.messages.iter().rev().find_map(|m| match m {
            Message::User { content } => Some(content.as_str()),
            _ => None,
        });
        Reply::Text(summarise(transcript.unwrap_or("")))
    } else {
        match scripted {
            Some(r) if !req.tools.is_empty() => r,
            _ => match decide(
                scenario.as_ref(),
                &req,
                after_user,
                done_steps,
                tool_results,
            ) {
                // A provider honouring `response_format` answers with JSON of the schema
                // (scripts stand for models that do not).
                Reply::Text(_) if schema.is_some() => {
                    Reply::Text(schema_example(schema.as_ref().unwrap()).to_string())
                }
                r => r,
            },
        }
    };
    let reply = match reply {
        Reply::Text(t) if scenario.as_ref().is_some_and(|s| s.stamp) => {
            Reply::Text(format!("{NOW_US} {t}"))
        }
        r => r,
    };
    let reply = match (&dialect, reply) {
        (Dialect::Anthropic(x), r) => x.shape(r, done_steps),
        (Dialect::OpenAi { .. }, r) => r,
    };
    state.record(log(200));
    let prompt_chars: usize = req
        .messages
        .iter()
        .map(|m| serde_json::to_string(m).map(|s| s.len()).unwrap_or(0))
        .sum();
    let completion_chars = match &reply {
        Reply::Text(t) => t.len(),
        Reply::Calls(c) => c.iter().map(|(_, n, a)| n.len() + a.len()).sum(),
    };
    let _ = prompt_chars;
    let usage = json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_chars / 4 + 1,
        "total_tokens": prompt_tokens + completion_chars as u64 / 4 + 1,
    });
    let model = if req.model.is_empty() {
        "mock-model".to_owned()
    } else {
        req.model.clone()
    };
    let gap = Duration::from_millis(scenario.as_ref().map_or(0, |s| s.chunk_ms));
    match &dialect {
        Dialect::Anthropic(x) => x.reply(
            model,
            reply,
            completion_chars as u64 / 4 + 1,
            req.stream,
            gap,
        ),
        Dialect::OpenAi { include_usage, .. } if req.stream => {
            stream_reply(model, reply, include_usage.then_some(usage), gap)
        }
        Dialect::OpenAi { .. } => plain_reply(model, reply, usage),
    }
}

/// The scripted reply, if the system prompt names a script.
fn scripted(
    script: &Script,
    req: &CompletionRequest,
    after_user: &[Message],
    done: usize,
) -> Option<Reply> {
    let system = req.messages.iter().find_map(|m| match m {
        Message::System { content } => Some(content.as_str()),
        _ => None,
    })?;
    let at = system.find("MOCK:")? + 5;
    let name: String = system[at..]
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == '-')
        .collect();
    let turns = script.get(&name)?;
    let Some(turn) = turns.get(done) else {
        return Some(Reply::Text("script ended".into()));
    };
    let results: Vec<Value> = after_user
        .iter()
        .filter_map(|m| match m {
            Message::Tool { content, .. } => {
                Some(serde_json::from_str(content).unwrap_or(Value::Null))
            }
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
            .map(|(j, c)| {
                (
                    format!("call_{}_{}", done + 1, j + 1),
                    c.name.clone(),
                    fill(&c.arguments, &results).to_string(),
                )
            })
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
                ["all", f] => {
                    Value::Array(results.iter().filter_map(|r| r.get(*f).cloned()).collect())
                }
                ["last", f] => results
                    .iter()
                    .rev()
                    .find_map(|r| r.get(*f).cloned())
                    .unwrap_or(Value::Null),
                ["nth", n, f] => n
                    .parse::<usize>()
                    .ok()
                    .and_then(|n| results.get(n))
                    .and_then(|r| r.get(*f).cloned())
                    .unwrap_or(Value::Null),
                _ => v.clone(),
            }
        }
        Value::Array(a) => Value::Array(a.iter().map(|x| fill(x, results)).collect()),
        Value::Object(o) => Value::Object(
            o.iter()
                .map(|(k, x)| (k.clone(), fill(x, results)))
                .collect(),
        ),
        other => other.clone(),
    }
}

fn decide(
    s: Option<&Scenario>,
    req: &CompletionRequest,
    after_user: &[Message],
    done: u32,
    tool_results: usize,
) -> Reply {
    // `done` and `tool_results` include what a compaction summary reports.
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
        let told = after_user.iter().any(
            |m| matches!(m, Message::Tool { content, .. } if content.contains("[loop_detected]")),
        );
        return if told {
            Reply::Text(format!(
                "stopped repeating after {tool_results} tool results"
            ))
        } else {
            Reply::Calls(vec![(
                format!("call_{}", done + 1),
                s.tool.clone(),
                json!({"text": "loop"}).to_string(),
            )])
        };
    }
    let step = done + 1;
    if let Some(first) = &s.read {
        let results: Vec<&str> = after_user
            .iter()
            .filter_map(|m| match m {
                Message::Tool { content, .. } => Some(content.as_str()),
                _ => None,
            })
            .collect();
        if results.is_empty()
            && let Some(tool) = first.strip_prefix("tool:")
        {
            return Reply::Calls(vec![(
                format!("call_{step}_1"),
                tool.to_owned(),
                json!({}).to_string(),
            )]);
        }
        return match next_read(first, &results) {
            Some((path, offset)) => Reply::Calls(vec![(
                format!("call_{step}_1"),
                "read_file".into(),
                json!({"path": path, "offset": offset}).to_string(),
            )]),
            None => {
                let last_line = results
                    .last()
                    .and_then(|r| r.lines().rev().find(|l| l.contains('\t')))
                    .unwrap_or("")
                    .trim()
                    .to_owned();
                Reply::Text(format!(
                    "READ DONE after {} reads; last line: {last_line}",
                    results.len()
                ))
            }
        };
    }
    if step >= s.steps {
        return Reply::Text(if s.pad > 0 {
            format!(
                "DONE after {} steps; saw {tool_results} tool results",
                s.steps
            )
        } else {
            format!("DONE after {} steps", s.steps)
        });
    }
    Reply::Calls(
        (1..=s.parallel)
            .map(|j| {
                let mut text = format!("step {step} call {j}");
                if s.pad > 0 {
                    let spread = s.pad_max.saturating_sub(s.pad) + 1;
                    let len = s.pad + (step as usize * 7919 + j as usize * 104_729) % spread;
                    text.push_str(": ");
                    text.push_str(&filler(len, step * 64 + j));
                }
                (
                    format!("call_{step}_{j}"),
                    s.tool.clone(),
                    json!({"text": text}).to_string(),
                )
            })
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
    let body = json!({
        "id": format!("chatcmpl-{}", uuid::Uuid::new_v4().simple()),
        "object": "chat.completion",
        "created": chrono::Utc::now().timestamp(),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": usage,
    });
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        stamped(body.to_string()),
    )
        .into_response()
}

fn stream_reply(model: String, reply: Reply, usage: Option<Value>, gap: Duration) -> Response {
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
                let mid = args
                    .char_indices()
                    .nth(args.chars().count() / 2)
                    .map(|(b, _)| b)
                    .unwrap_or(0);
                for part in [&args[..mid], &args[mid..]] {
                    chunks.push(chunk(
                        json!({"tool_calls": [{"index": i, "function": {"arguments": part}}]}),
                        None,
                    ));
                }
            }
            chunks.push(chunk(json!({}), Some("tool_calls")));
        }
    }
    if let Some(usage) = usage {
        chunks.push(json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [], "usage": usage}));
    }
    let mut data: Vec<String> = chunks.into_iter().map(|c| c.to_string()).collect();
    data.push("[DONE]".into());
    let slow = futures::StreamExt::then(futures::stream::iter(data), move |d| async move {
        if !gap.is_zero() {
            tokio::time::sleep(gap).await;
        }
        Ok::<_, std::convert::Infallible>(Event::default().data(stamped(d)))
    });
    Sse::new(slow).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scenarios_parse() {
        let s = Scenario::find("hello\nSCENARIO steps=5 tool=echo parallel=2 run=x")
            .unwrap()
            .unwrap();
        assert_eq!((s.steps, s.parallel, s.tool.as_str()), (5, 2, "echo"));
        assert!(Scenario::find("no scenario").is_none());
        let e = Scenario::find("SCENARIO stepz=5").unwrap().unwrap_err();
        assert!(e.contains("unknown scenario key `stepz`"), "{e}");
        assert!(Scenario::find("SCENARIO steps=x").unwrap().is_err());
        let s = Scenario::find("SCENARIO window=8000 pad=1500 read=big.txt")
            .unwrap()
            .unwrap();
        assert_eq!(
            (s.window, s.pad, s.read.as_deref()),
            (Some(8000), 1500, Some("big.txt"))
        );
    }

    #[test]
    fn summaries_carry_the_count_across_a_compaction() {
        let t = format!(
            "{}\nMOCK SUMMARY steps=4 tool_results=4\n\n{}\n\n{}\nx\n\n{} (c)\ny\n\n",
            compact::EARLIER_SUMMARY,
            compact::USER,
            compact::ASSISTANT,
            compact::TOOL_RESULT
        );
        assert_eq!(summarise(&t), "MOCK SUMMARY steps=1 tool_results=1");
        let t = format!(
            "{}\nMOCK SUMMARY steps=4 tool_results=4\n\n{}\nx\n\n",
            compact::EARLIER_SUMMARY,
            compact::ASSISTANT
        );
        assert_eq!(summarise(&t), "MOCK SUMMARY steps=5 tool_results=4");
        let task = Message::User {
            content: "SCENARIO steps=9".into(),
        };
        let summary = compact::summary_message("MOCK SUMMARY steps=5 tool_results=5", 2, 20, &[]);
        let a = Message::Assistant {
            content: None,
            tool_calls: vec![],
            thinking: vec![],
        };
        assert_eq!(progress(&[task, summary, a]), (1, 6, 5));
    }

    #[test]
    fn reads_page_on_where_the_result_says() {
        assert_eq!(next_read("big.txt", &[]), Some(("big.txt".into(), 1)));
        let r = "     1\tx\n[output limit reached at line 900 of `big.txt` (1048576 bytes): read_file with path=`big.txt` offset=900 reads on]";
        assert_eq!(next_read("big.txt", &[r]), Some(("big.txt".into(), 900)));
        assert_eq!(next_read("big.txt", &["  1\tend"]), None);
    }
}
