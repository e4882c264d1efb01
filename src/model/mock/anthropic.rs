//! The mock's Anthropic Messages API (`POST /v1/messages`), strict where the real one is: the
//! request is checked against the mock's own description of the wire format (unknown fields,
//! a missing `model` or `max_tokens`, empty text blocks, tool uses without their results, more
//! than four cache breakpoints, thinking without its signature are all refused with Anthropic's
//! 400 `invalid_request_error`), then answered by the same scenario logic as Chat Completions
//! and rendered as content blocks, streamed or whole.
//!
//! Tokens are counted by the mock itself (a token per four bytes of each block's JSON), and its
//! prompt cache follows the breakpoints it is sent: a prefix ending at a breakpoint is stored
//! once it is at least [`MIN_CACHEABLE`] tokens, and a later request whose breakpoint (or one of
//! the 20 blocks before it) ends the same prefix reads it, as Anthropic's automatic prefix check
//! does.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::{CompletionRequest, Dialect, MockState, Reply, schema_example};
use crate::model::{FunctionCall, FunctionSpec, Message, ToolCall, ToolSpec};

/// The shortest prefix the cache stores, in tokens (Anthropic's minimum for Sonnet and Opus).
pub const MIN_CACHEABLE: u64 = 1024;

/// How long a cached prefix lives without being read (Anthropic's default five minutes).
const CACHE_TTL: Duration = Duration::from_secs(300);

/// How many blocks before a breakpoint the cache looks for an earlier hit.
const LOOKBACK: usize = 20;

/// The name of the tool the mock treats as the structured answer's channel (what the
/// product's client offers when a run has an output schema).
const RESULT_TOOL: &str = crate::model::anthropic::RESULT_TOOL;

/// What the prompt cache did for one request.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(super) struct CacheUse {
    /// The whole prompt, in the mock's tokens.
    pub total: u64,
    /// Served from the cache.
    pub read: u64,
    /// Written to the cache.
    pub write: u64,
}

/// What a Messages API request carries beyond the shared decision logic.
pub(super) struct Extras {
    thinking: bool,
    forced: Option<(String, Value)>,
    pub(super) result_tool: Option<(String, Value)>,
    pub(super) cache: CacheUse,
}

impl Extras {
    /// A forced tool is always called; a structured answer goes through the result tool.
    pub(super) fn shape(&self, r: Reply, done: u32) -> Reply {
        let via = match (&self.forced, &r) {
            (Some(f), _) => Some(f),
            (None, Reply::Text(_)) => self.result_tool.as_ref(),
            _ => None,
        };
        match via {
            Some((name, schema)) if !matches!(&r, Reply::Calls(c) if c.iter().all(|(_, n, _)| n == name)) => {
                Reply::Calls(vec![(
                    format!("toolu_result_{}", done + 1),
                    name.clone(),
                    schema_example(schema).to_string(),
                )])
            }
            _ => r,
        }
    }

    /// The answer as a Messages API response, streamed or whole.
    pub(super) fn reply(
        &self,
        model: String,
        reply: Reply,
        output_tokens: u64,
        stream: bool,
        gap: Duration,
    ) -> Response {
        let mut blocks: Vec<Value> = vec![];
        if self.thinking {
            let t = format!(
                "The mock considers the request ({} prompt tokens).",
                self.cache.total
            );
            blocks.push(json!({"type": "thinking", "thinking": t, "signature": sign(&t)}));
        }
        let stop = match reply {
            Reply::Text(t) => {
                blocks.push(json!({"type": "text", "text": t}));
                "end_turn"
            }
            Reply::Calls(calls) => {
                for (id, name, args) in calls {
                    let id = if id.starts_with("toolu_") {
                        id
                    } else {
                        format!("toolu_{id}")
                    };
                    let input: Value = serde_json::from_str(&args).unwrap_or(json!({}));
                    blocks
                        .push(json!({"type": "tool_use", "id": id, "name": name, "input": input}));
                }
                "tool_use"
            }
        };
        let c = self.cache;
        let usage = json!({
            "input_tokens": c.total - c.read - c.write,
            "cache_creation_input_tokens": c.write,
            "cache_read_input_tokens": c.read,
            "output_tokens": output_tokens,
        });
        let id = format!("msg_mock_{}", uuid::Uuid::new_v4().simple());
        if !stream {
            return Json(json!({
                "id": id, "type": "message", "role": "assistant", "model": model,
                "content": blocks, "stop_reason": stop, "stop_sequence": null, "usage": usage,
            }))
            .into_response();
        }
        let mut events: Vec<(&'static str, Value)> = vec![(
            "message_start",
            json!({"type": "message_start", "message": {
                "id": id, "type": "message", "role": "assistant", "model": model, "content": [],
                "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": usage["input_tokens"], "cache_creation_input_tokens": c.write,
                          "cache_read_input_tokens": c.read, "output_tokens": 1},
            }}),
        )];
        for (index, b) in blocks.iter().enumerate() {
            let start = match b["type"].as_str() {
                Some("text") => json!({"type": "text", "text": ""}),
                Some("thinking") => json!({"type": "thinking", "thinking": "", "signature": ""}),
                _ => json!({"type": "tool_use", "id": b["id"], "name": b["name"], "input": {}}),
            };
            events.push((
                "content_block_start",
                json!({"type": "content_block_start", "index": index, "content_block": start}),
            ));
            let delta = |d: Value| {
                (
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": index, "delta": d}),
                )
            };
            match b["type"].as_str() {
                Some("text") => {
                    // Word by word, as the API streams.
                    for w in b["text"].as_str().unwrap_or("").split_inclusive(' ') {
                        events.push(delta(json!({"type": "text_delta", "text": w})));
                    }
                }
                Some("thinking") => {
                    events.push(delta(
                        json!({"type": "thinking_delta", "thinking": b["thinking"]}),
                    ));
                    events.push(delta(
                        json!({"type": "signature_delta", "signature": b["signature"]}),
                    ));
                }
                _ => {
                    // The input arrives as JSON text in fragments; the client joins them.
                    let args = b["input"].to_string();
                    let mid = args
                        .char_indices()
                        .nth(args.chars().count() / 2)
                        .map_or(0, |(i, _)| i);
                    for part in [&args[..mid], &args[mid..]] {
                        events.push(delta(
                            json!({"type": "input_json_delta", "partial_json": part}),
                        ));
                    }
                }
            }
            events.push((
                "content_block_stop",
                json!({"type": "content_block_stop", "index": index}),
            ));
            if index == 0 {
                events.push(("ping", json!({"type": "ping"})));
            }
        }
        events.push((
            "message_delta",
            json!({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": null},
                   "usage": {"output_tokens": output_tokens}}),
        ));
        events.push(("message_stop", json!({"type": "message_stop"})));
        let events: Vec<Result<Event, std::convert::Infallible>> = events
            .into_iter()
            .map(|(name, data)| Ok(Event::default().event(name).data(data.to_string())))
            .collect();
        if gap.is_zero() {
            return Sse::new(futures::stream::iter(events)).into_response();
        }
        let slow = futures::StreamExt::then(futures::stream::iter(events), move |e| async move {
            tokio::time::sleep(gap).await;
            e
        });
        Sse::new(slow).into_response()
    }
}

/// The mock's signature of a thinking block: what it checks when the block comes back.
fn sign(thinking: &str) -> String {
    format!(
        "mocksig_{:016x}",
        fnv(0x5375_6261_6765_6e74, thinking.as_bytes())
    )
}

fn fnv(seed: u64, bytes: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// An Anthropic error answer: `{"type": "error", "error": {"type", "message"}}`.
pub(super) fn error(status: StatusCode, message: &str) -> Response {
    let kind = match status.as_u16() {
        400 | 413 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        429 => "rate_limit_error",
        529 => "overloaded_error",
        _ => "api_error",
    };
    let mut resp = (
        status,
        Json(json!({"type": "error", "error": {"type": kind, "message": message}})),
    )
        .into_response();
    resp.headers_mut().insert(
        "request-id",
        format!("req_mock_{}", uuid::Uuid::new_v4().simple())
            .parse()
            .unwrap(),
    );
    resp
}

/// `POST /v1/messages`.
pub(super) async fn messages(
    State(state): State<Arc<MockState>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    if headers.get("anthropic-version").is_none() {
        return error(
            StatusCode::BAD_REQUEST,
            "anthropic-version: header is required",
        );
    }
    if headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .is_none_or(|k| k.trim().is_empty())
    {
        return error(StatusCode::UNAUTHORIZED, "x-api-key header is required");
    }
    let parsed = match parse(&body) {
        Ok(p) => p,
        Err(e) => return error(StatusCode::BAD_REQUEST, &e),
    };
    let (cache, store) = state.cache_use(&parsed.segments);
    let extras = Extras {
        thinking: parsed.thinking,
        forced: parsed.forced,
        result_tool: parsed.result_tool,
        cache,
    };
    let mut resp = super::answer(
        state.clone(),
        &headers,
        parsed.request,
        Dialect::Anthropic(extras),
    )
    .await;
    if resp.status().is_success() {
        state.cache_store(&store);
    }
    if let Some((max, remaining, reset)) = state.budget() {
        // Whole seconds, as the API sends them, rounded up so the budget is back by then.
        let at = chrono::Utc::now() + chrono::Duration::from_std(reset).unwrap_or_default();
        let at = chrono::DateTime::from_timestamp(at.timestamp() + 1, 0).unwrap_or(at);
        let h = resp.headers_mut();
        h.insert(
            "anthropic-ratelimit-requests-limit",
            max.to_string().parse().unwrap(),
        );
        h.insert(
            "anthropic-ratelimit-requests-remaining",
            remaining.to_string().parse().unwrap(),
        );
        h.insert(
            "anthropic-ratelimit-requests-reset",
            at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
                .parse()
                .unwrap(),
        );
    }
    resp
}

impl MockState {
    /// What the cache serves for a request's prefix, and the prefix hashes to store if it
    /// succeeds.
    fn cache_use(&self, segments: &[Segment]) -> (CacheUse, Vec<u64>) {
        let total = segments.last().map_or(0, |s| s.upto);
        let now = Instant::now();
        let mut cache = self.prompt_cache.lock().unwrap();
        cache.retain(|_, at| now.duration_since(*at) < CACHE_TTL);
        let mut read = 0;
        for (i, s) in segments.iter().enumerate() {
            if !s.breakpoint {
                continue;
            }
            let from = i.saturating_sub(LOOKBACK);
            if let Some(hit) = segments[from..=i]
                .iter()
                .rev()
                .find(|p| cache.contains_key(&p.hash))
            {
                read = read.max(hit.upto);
                cache.insert(hit.hash, now);
            }
        }
        let store: Vec<u64> = segments
            .iter()
            .filter(|s| s.breakpoint && s.upto >= MIN_CACHEABLE)
            .map(|s| s.hash)
            .collect();
        let last = segments
            .iter()
            .rev()
            .find(|s| s.breakpoint)
            .map_or(0, |s| s.upto);
        let write = if last >= MIN_CACHEABLE && last > read {
            last - read
        } else {
            0
        };
        (CacheUse { total, read, write }, store)
    }

    fn cache_store(&self, hashes: &[u64]) {
        let now = Instant::now();
        let mut cache = self.prompt_cache.lock().unwrap();
        for h in hashes {
            cache.insert(*h, now);
        }
    }
}

/// One block of the prompt in order (tools, system, messages): the hash of the prefix it
/// ends, the tokens up to and including it, and whether a breakpoint sits on it.
#[derive(Debug)]
struct Segment {
    hash: u64,
    upto: u64,
    breakpoint: bool,
}

/// A request that passed every check, in the shared decision logic's terms.
struct Parsed {
    request: CompletionRequest,
    segments: Vec<Segment>,
    thinking: bool,
    forced: Option<(String, Value)>,
    result_tool: Option<(String, Value)>,
}

/// The request's top level. Sampling fields are accepted (the API has them) but do not change
/// what the mock says.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
struct Wire {
    model: String,
    max_tokens: u64,
    messages: Vec<Value>,
    #[serde(default)]
    system: Option<Value>,
    #[serde(default)]
    tools: Option<Vec<Value>>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    thinking: Option<Value>,
    #[serde(default)]
    metadata: Option<Value>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_p: Option<f64>,
    #[serde(default)]
    top_k: Option<u64>,
    #[serde(default)]
    stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    service_tier: Option<String>,
}

/// Builds the prefix segments while the request is walked.
struct Prefix {
    seed: u64,
    hash: u64,
    upto: u64,
    marks: usize,
    segments: Vec<Segment>,
}

impl Prefix {
    /// A message's block: its breakpoint counted, and the turn's role marked on its first
    /// block so a turn boundary is part of the prefix.
    fn block(
        &mut self,
        o: &Map<String, Value>,
        block: &Value,
        at: &str,
        first_of: Option<&str>,
    ) -> Result<(), String> {
        cache_control(o, at, self)?;
        let mut seg = block.clone();
        if let Some(role) = first_of {
            seg["_role"] = json!(role);
        }
        self.push(&seg);
        Ok(())
    }

    fn push(&mut self, block: &Value) {
        let mut plain = block.clone();
        let breakpoint = plain
            .as_object_mut()
            .and_then(|o| o.remove("cache_control"))
            .is_some();
        let text = plain.to_string();
        self.hash = fnv(self.hash ^ self.seed, text.as_bytes());
        self.upto += (text.len() as u64).div_ceil(4);
        self.segments.push(Segment {
            hash: self.hash,
            upto: self.upto,
            breakpoint,
        });
    }
}

fn obj<'a>(v: &'a Value, at: &str) -> Result<&'a Map<String, Value>, String> {
    v.as_object()
        .ok_or_else(|| format!("{at}: Input should be an object"))
}

/// Refuses keys the block type does not have, as the API's validation does.
fn only(o: &Map<String, Value>, allowed: &[&str], at: &str) -> Result<(), String> {
    match o.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(k) => Err(format!("{at}.{k}: Extra inputs are not permitted")),
        None => Ok(()),
    }
}

fn text_of<'a>(o: &'a Map<String, Value>, key: &str, at: &str) -> Result<&'a str, String> {
    o.get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| format!("{at}.{key}: Field required (a string)"))
}

fn cache_control(o: &Map<String, Value>, at: &str, prefix: &mut Prefix) -> Result<(), String> {
    if let Some(cc) = o.get("cache_control") {
        let c = obj(cc, &format!("{at}.cache_control"))?;
        only(c, &["type", "ttl"], &format!("{at}.cache_control"))?;
        if c.get("type").and_then(Value::as_str) != Some("ephemeral") {
            return Err(format!(
                "{at}.cache_control.type: Input should be 'ephemeral'"
            ));
        }
        if let Some(ttl) = c.get("ttl")
            && ttl != "5m"
            && ttl != "1h"
        {
            return Err(format!(
                "{at}.cache_control.ttl: Input should be '5m' or '1h'"
            ));
        }
        prefix.marks += 1;
    }
    Ok(())
}

fn parse(body: &[u8]) -> Result<Parsed, String> {
    let w: Wire = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    if w.model.trim().is_empty() {
        return Err("model: String should have at least 1 character".into());
    }
    if w.max_tokens == 0 {
        return Err("max_tokens: Input should be greater than or equal to 1".into());
    }
    let mut prefix = Prefix {
        seed: fnv(0, w.model.as_bytes()),
        hash: 0,
        upto: 0,
        marks: 0,
        segments: vec![],
    };
    // Thinking.
    let mut thinking = false;
    if let Some(t) = &w.thinking {
        let o = obj(t, "thinking")?;
        match o.get("type").and_then(Value::as_str) {
            Some("enabled") => {
                only(o, &["type", "budget_tokens"], "thinking.enabled")?;
                let b = o
                    .get("budget_tokens")
                    .and_then(Value::as_u64)
                    .ok_or("thinking.enabled.budget_tokens: Field required")?;
                if b < 1024 {
                    return Err(
                        "thinking.enabled.budget_tokens: Input should be greater than or equal to 1024"
                            .into(),
                    );
                }
                if b >= w.max_tokens {
                    return Err("`max_tokens` must be greater than `thinking.budget_tokens`".into());
                }
                thinking = true;
            }
            Some("disabled") => only(o, &["type"], "thinking.disabled")?,
            _ => return Err("thinking.type: Input should be 'enabled' or 'disabled'".into()),
        }
    }
    // Tools.
    let mut tools: Vec<ToolSpec> = vec![];
    for (i, t) in w.tools.iter().flatten().enumerate() {
        let at = format!("tools.{i}");
        let o = obj(t, &at)?;
        only(
            o,
            &[
                "type",
                "name",
                "description",
                "input_schema",
                "cache_control",
            ],
            &at,
        )?;
        let name = text_of(o, "name", &at)?;
        if name.is_empty()
            || name.len() > 128
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        {
            return Err(format!(
                "{at}.name: String should match pattern '^[a-zA-Z0-9_-]{{1,128}}$'"
            ));
        }
        if tools.iter().any(|x| x.function.name == name) {
            return Err(format!("tools: Tool names must be unique ({name})"));
        }
        let schema = o
            .get("input_schema")
            .ok_or_else(|| format!("{at}.input_schema: Field required"))?;
        if schema.get("type").and_then(Value::as_str) != Some("object") {
            return Err(format!("{at}.input_schema.type: Input should be 'object'"));
        }
        cache_control(o, &at, &mut prefix)?;
        prefix.push(t);
        tools.push(ToolSpec {
            kind: "function".into(),
            function: FunctionSpec {
                name: name.to_owned(),
                description: o
                    .get("description")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_owned(),
                parameters: schema.clone(),
            },
        });
    }
    let schema_of = |name: &str| {
        tools
            .iter()
            .find(|t| t.function.name == name)
            .map(|t| (name.to_owned(), t.function.parameters.clone()))
    };
    let result_tool = schema_of(RESULT_TOOL);
    let mut forced = None;
    if let Some(tc) = &w.tool_choice {
        let o = obj(tc, "tool_choice")?;
        match o.get("type").and_then(Value::as_str) {
            Some("auto") | Some("none") => {
                only(o, &["type", "disable_parallel_tool_use"], "tool_choice")?
            }
            Some("any") | Some("tool") if thinking => {
                return Err("Thinking may not be enabled when tool_choice forces tool use.".into());
            }
            Some("any") => only(o, &["type", "disable_parallel_tool_use"], "tool_choice")?,
            Some("tool") => {
                only(
                    o,
                    &["type", "name", "disable_parallel_tool_use"],
                    "tool_choice",
                )?;
                let name = text_of(o, "name", "tool_choice")?;
                forced = Some(schema_of(name).ok_or_else(|| {
                    format!("tool_choice.name: no tool named `{name}` was offered")
                })?);
            }
            _ => {
                return Err(
                    "tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none'".into(),
                );
            }
        }
    }
    // System.
    let mut messages: Vec<Message> = vec![];
    match &w.system {
        None => {}
        Some(Value::String(s)) => {
            prefix.push(&json!({"type": "text", "text": s}));
            messages.push(Message::System { content: s.clone() });
        }
        Some(Value::Array(blocks)) => {
            let mut text = String::new();
            for (j, b) in blocks.iter().enumerate() {
                let at = format!("system.{j}");
                let o = obj(b, &at)?;
                if o.get("type").and_then(Value::as_str) != Some("text") {
                    return Err(format!("{at}.type: Input should be 'text'"));
                }
                only(o, &["type", "text", "cache_control", "citations"], &at)?;
                let t = text_of(o, "text", &at)?;
                if t.is_empty() {
                    return Err(format!("{at}: text content blocks must be non-empty"));
                }
                cache_control(o, &at, &mut prefix)?;
                prefix.push(b);
                text.push_str(t);
            }
            messages.push(Message::System { content: text });
        }
        Some(_) => return Err("system: Input should be a string or a list of text blocks".into()),
    }
    // Messages.
    if w.messages.is_empty() {
        return Err("messages: at least one message is required".into());
    }
    let last_assistant = w.messages.iter().rposition(|m| m["role"] == "assistant");
    let mut pending: Vec<String> = vec![];
    for (i, m) in w.messages.iter().enumerate() {
        let at = format!("messages.{i}");
        let o = obj(m, &at)?;
        only(o, &["role", "content"], &at)?;
        let role = o.get("role").and_then(Value::as_str).unwrap_or("");
        if role != "user" && role != "assistant" {
            return Err(format!("{at}.role: Input should be 'user' or 'assistant'"));
        }
        if i == 0 && role != "user" {
            return Err("messages: first message must use the \"user\" role".into());
        }
        let blocks: Vec<Value> = match o.get("content") {
            Some(Value::String(s)) if s.is_empty() && i + 1 < w.messages.len() => {
                return Err(format!("{at}: {role} messages must have non-empty content"));
            }
            Some(Value::String(s)) => vec![json!({"type": "text", "text": s})],
            Some(Value::Array(b)) if b.is_empty() && i + 1 < w.messages.len() => {
                return Err(format!("{at}: {role} messages must have non-empty content"));
            }
            Some(Value::Array(b)) => b.clone(),
            _ => return Err(format!("{at}.content: Field required")),
        };
        let explicit_blocks = matches!(o.get("content"), Some(Value::Array(_)));
        if role == "user" {
            user_turn(i, &blocks, &mut pending, &mut prefix, &mut messages)?;
        } else {
            if !pending.is_empty() {
                return Err(unanswered(i - 1, &pending.join(", ")));
            }
            let must_think = thinking && Some(i) == last_assistant;
            let turn = assistant_turn(&at, &blocks, explicit_blocks, must_think, &mut prefix)?;
            if let Message::Assistant { tool_calls, .. } = &turn {
                pending.extend(tool_calls.iter().map(|c| c.id.clone()));
            }
            messages.push(turn);
        }
    }
    if prefix.marks > 4 {
        return Err(format!(
            "A maximum of 4 blocks with cache_control may be provided. Found {}.",
            prefix.marks
        ));
    }
    Ok(Parsed {
        request: CompletionRequest {
            model: w.model,
            messages,
            tools,
            stream: w.stream.unwrap_or(false),
            response_format: None,
        },
        segments: prefix.segments,
        thinking,
        forced,
        result_tool,
    })
}

/// The API's refusal of tool uses whose results are not in the next turn.
fn unanswered(turn: usize, ids: &str) -> String {
    format!(
        "messages.{turn}: `tool_use` ids were found without `tool_result` blocks immediately after: {ids}. Each `tool_use` block must have a corresponding `tool_result` block in the next message."
    )
}

/// A text block's text; an empty one is refused unless `may_be_empty`.
fn text_block<'a>(
    o: &'a Map<String, Value>,
    at: &str,
    may_be_empty: bool,
) -> Result<&'a str, String> {
    only(o, &["type", "text", "cache_control", "citations"], at)?;
    let t = text_of(o, "text", at)?;
    if t.is_empty() && !may_be_empty {
        return Err(format!("{at}: text content blocks must be non-empty"));
    }
    Ok(t)
}

/// A `tool_result`'s content as text: a string, or its text blocks joined.
fn tool_result_text(o: &Map<String, Value>, at: &str) -> Result<String, String> {
    match o.get("content") {
        None => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut s = String::new();
            for (k, p) in parts.iter().enumerate() {
                let pat = format!("{at}.content.{k}");
                let po = obj(p, &pat)?;
                if po.get("type").and_then(Value::as_str) == Some("text") {
                    s.push_str(text_block(po, &pat, true)?);
                }
            }
            Ok(s)
        }
        Some(_) => Err(format!(
            "{at}.content: Input should be a string or a list of blocks"
        )),
    }
}

/// A user turn: its tool results must answer every call of the turn before (`pending`, emptied
/// here), and nothing else; its text becomes one user message after the results.
fn user_turn(
    i: usize,
    blocks: &[Value],
    pending: &mut Vec<String>,
    prefix: &mut Prefix,
    messages: &mut Vec<Message>,
) -> Result<(), String> {
    let at = format!("messages.{i}");
    let mut answered: Vec<String> = vec![];
    let mut texts: Vec<String> = vec![];
    for (j, b) in blocks.iter().enumerate() {
        let at = format!("{at}.content.{j}");
        let bo = obj(b, &at)?;
        match bo.get("type").and_then(Value::as_str) {
            Some("text") => texts.push(text_block(bo, &at, false)?.to_owned()),
            Some("image") | Some("document") => only(
                bo,
                &[
                    "type",
                    "source",
                    "cache_control",
                    "title",
                    "context",
                    "citations",
                ],
                &at,
            )?,
            Some("tool_result") => {
                only(
                    bo,
                    &[
                        "type",
                        "tool_use_id",
                        "content",
                        "is_error",
                        "cache_control",
                    ],
                    &at,
                )?;
                let id = text_of(bo, "tool_use_id", &at)?;
                if !pending.iter().any(|p| p == id) {
                    return Err(format!(
                        "{at}: unexpected `tool_use_id` found in `tool_result` blocks: {id}. Each `tool_result` block must have a corresponding `tool_use` block in the previous message."
                    ));
                }
                answered.push(id.to_owned());
                messages.push(Message::Tool {
                    tool_call_id: id.to_owned(),
                    content: tool_result_text(bo, &at)?,
                });
            }
            other => {
                return Err(format!(
                    "{at}.type: `{}` is not a user content block (text, image, document, tool_result)",
                    other.unwrap_or("")
                ));
            }
        }
        prefix.block(bo, b, &at, (j == 0).then_some("user"))?;
    }
    if let Some(missing) = pending.iter().find(|p| !answered.contains(p)) {
        return Err(unanswered(i.saturating_sub(1), missing));
    }
    pending.clear();
    if !texts.is_empty() {
        messages.push(Message::User {
            content: texts.join("\n"),
        });
    }
    Ok(())
}

/// An assistant turn: its text, its tool uses, and its thinking blocks, whose signatures must be
/// the mock's. With thinking on, the last assistant turn that uses tools (`must_think`) must
/// start with a thinking block, as the API requires.
fn assistant_turn(
    at: &str,
    blocks: &[Value],
    explicit_blocks: bool,
    must_think: bool,
    prefix: &mut Prefix,
) -> Result<Message, String> {
    let mut text: Option<String> = None;
    let mut calls: Vec<ToolCall> = vec![];
    for (j, b) in blocks.iter().enumerate() {
        let at = format!("{at}.content.{j}");
        let bo = obj(b, &at)?;
        match bo.get("type").and_then(Value::as_str) {
            Some("text") => text.get_or_insert_with(String::new).push_str(text_block(
                bo,
                &at,
                !explicit_blocks,
            )?),
            Some("tool_use") => {
                only(bo, &["type", "id", "name", "input", "cache_control"], &at)?;
                let input = bo
                    .get("input")
                    .filter(|v| v.is_object())
                    .ok_or_else(|| format!("{at}.input: Input should be an object"))?;
                calls.push(ToolCall {
                    id: text_of(bo, "id", &at)?.to_owned(),
                    kind: "function".into(),
                    function: FunctionCall {
                        name: text_of(bo, "name", &at)?.to_owned(),
                        arguments: input.to_string(),
                    },
                });
            }
            Some("thinking") => {
                only(bo, &["type", "thinking", "signature"], &at)?;
                let t = text_of(bo, "thinking", &at)?;
                if text_of(bo, "signature", &at)? != sign(t) {
                    return Err(format!("{at}: Invalid `signature` in `thinking` block"));
                }
            }
            Some("redacted_thinking") => only(bo, &["type", "data"], &at)?,
            other => {
                return Err(format!(
                    "{at}.type: `{}` is not an assistant content block (text, tool_use, thinking, redacted_thinking)",
                    other.unwrap_or("")
                ));
            }
        }
        prefix.block(bo, b, &at, (j == 0).then_some("assistant"))?;
    }
    if must_think && !calls.is_empty() {
        let first = blocks
            .first()
            .and_then(|b| b["type"].as_str())
            .unwrap_or("");
        if first != "thinking" && first != "redacted_thinking" {
            return Err(format!(
                "{at}.content.0.type: Expected `thinking` or `redacted_thinking`, but found `{first}`. When `thinking` is enabled, a final `assistant` message must start with a thinking block (preceeding the lastmost set of `tool_use` and `tool_result` blocks)."
            ));
        }
    }
    Ok(Message::Assistant {
        content: text,
        tool_calls: calls,
        thinking: vec![],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(v: Value) -> Vec<u8> {
        v.to_string().into_bytes()
    }

    #[test]
    fn what_the_api_refuses_the_mock_refuses() {
        let ok = json!({"model": "claude-x", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]});
        assert!(parse(&body(ok.clone())).is_ok());
        let cases = [
            (
                json!({"max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}),
                "model",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
                "max_tokens",
            ),
            (
                json!({"model": "m", "max_tokens": 1, "messages": [], "stream_options": {}}),
                "unknown field",
            ),
            (
                json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]}),
                "non-empty",
            ),
            (
                json!({"model": "m", "max_tokens": 1, "messages": [
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "echo", "input": {}}]},
                {"role": "user", "content": "no result"}]}),
                "without `tool_result`",
            ),
            (
                json!({"model": "m", "max_tokens": 1, "messages": [
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t9", "content": "x"}]}]}),
                "unexpected `tool_use_id`",
            ),
            (
                json!({"model": "m", "max_tokens": 1, "system": [
                {"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "b", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "c", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "d", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "e", "cache_control": {"type": "ephemeral"}}],
                "messages": [{"role": "user", "content": "x"}]}),
                "maximum of 4",
            ),
            (
                json!({"model": "m", "max_tokens": 2000, "thinking": {"type": "enabled", "budget_tokens": 1500}, "messages": [
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "echo", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]}]}),
                "must start with a thinking block",
            ),
            (
                json!({"model": "m", "max_tokens": 2000, "messages": [
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "x", "signature": "forged"}, {"type": "text", "text": "y"}]},
                {"role": "user", "content": "z"}]}),
                "Invalid `signature`",
            ),
            (
                json!({"model": "m", "max_tokens": 2000, "thinking": {"type": "enabled", "budget_tokens": 1500},
                "tools": [{"name": "echo", "input_schema": {"type": "object"}}], "tool_choice": {"type": "tool", "name": "echo"},
                "messages": [{"role": "user", "content": "x"}]}),
                "forces tool use",
            ),
            (
                json!({"model": "m", "max_tokens": 1, "tools": [{"name": "echo", "input_schema": {"type": "object"}, "parameters": {}}],
                "messages": [{"role": "user", "content": "x"}]}),
                "Extra inputs",
            ),
        ];
        for (req, says) in cases {
            let e = parse(&body(req.clone())).err().unwrap_or_default();
            assert!(e.contains(says), "{req}: {e}");
        }
    }

    #[test]
    fn the_cache_follows_the_breakpoints() {
        let state = MockState::default();
        let long = "word ".repeat(2000);
        let step = |n: usize| {
            let mut messages =
                vec![json!({"role": "user", "content": [{"type": "text", "text": long}]})];
            for k in 0..n {
                messages.push(json!({"role": "assistant", "content": [{"type": "tool_use", "id": format!("t{k}"), "name": "echo", "input": {"k": k}}]}));
                messages.push(json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": format!("t{k}"), "content": "ok"}]}));
            }
            let last = messages.len() - 1;
            let c = messages[last]["content"].as_array().unwrap().len() - 1;
            messages[last]["content"][c]["cache_control"] = json!({"type": "ephemeral"});
            if last >= 2 {
                let prev = last - 2;
                let c = messages[prev]["content"].as_array().unwrap().len() - 1;
                messages[prev]["content"][c]["cache_control"] = json!({"type": "ephemeral"});
            }
            json!({"model": "claude-x", "max_tokens": 100,
                   "system": [{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}],
                   "messages": messages})
        };
        let first = parse(&body(step(0))).unwrap();
        let (c1, store) = state.cache_use(&first.segments);
        assert_eq!(c1.read, 0);
        assert!(c1.write >= MIN_CACHEABLE && c1.write == c1.total, "{c1:?}");
        state.cache_store(&store);
        let second = parse(&body(step(1))).unwrap();
        let (c2, store) = state.cache_use(&second.segments);
        assert_eq!(c2.read, c1.total, "the previous step's prefix is read");
        assert_eq!(c2.read + c2.write, c2.total, "{c2:?}");
        state.cache_store(&store);
        let (again, _) = state.cache_use(&second.segments);
        assert_eq!(again.read, c2.total, "a replay reads it all");
        let mut other = step(1);
        other["model"] = json!("claude-y");
        let (cold, _) = state.cache_use(&parse(&body(other)).unwrap().segments);
        assert_eq!(cold.read, 0, "caches are per model");
    }
}
