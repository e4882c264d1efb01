//! Anthropic's Messages API, natively: the checkpointed conversation (OpenAI's message shape) is
//! turned into content blocks at the edge, prompt-cache breakpoints are placed so each step reads
//! the previous step's prefix, and the streamed answer (text, `tool_use` with
//! `input_json_delta`, `thinking` with its signature) is assembled into one [`ChatResponse`].
//!
//! The request is a pure function of the [`ChatRequest`] and the configuration, so a step
//! replayed after a crash sends the same bytes and hits the same cache entries.

use std::collections::BTreeMap;
use std::time::Duration;

use async_trait::async_trait;
use eventsource_stream::Eventsource;
use futures::StreamExt;
use serde_json::{Value, json};

use super::{
    Attempt, ChatModel, ChatRequest, ChatResponse, DeltaSink, Endpoint, FunctionCall, Message,
    ModelError, ToolCall, Usage,
};

/// The API version this client speaks (sent as `anthropic-version`).
pub const API_VERSION: &str = "2023-06-01";

/// The tool a structured answer is asked for through: Anthropic has no `response_format`, so the
/// schema becomes a tool's input schema and its input is the answer.
pub const RESULT_TOOL: &str = "final_result";

/// Where and how to reach Anthropic, and what every request asks for.
#[derive(Clone, Debug)]
pub struct AnthropicConfig {
    /// The API's URL and key, retries and timeout.
    pub endpoint: Endpoint,
    /// `max_tokens` of every request (the API requires one).
    pub max_tokens: u32,
    /// Extended thinking's token budget; `None` leaves thinking off.
    pub thinking_budget: Option<u32>,
    /// Mark prompt-cache breakpoints (on by default; off only to measure what caching saves).
    pub caching: bool,
}

/// A streaming Messages API client.
#[derive(Clone, Debug)]
pub struct AnthropicClient {
    http: reqwest::Client,
    config: AnthropicConfig,
}

impl AnthropicClient {
    /// A client with its own connection pool.
    pub fn new(config: AnthropicConfig) -> Self {
        Self {
            http: super::http_client(),
            config,
        }
    }

    async fn attempt(
        &self,
        req: &ChatRequest,
        body: &Value,
        on_delta: DeltaSink<'_>,
    ) -> Result<ChatResponse, Attempt> {
        let url = format!(
            "{}/messages",
            self.config.endpoint.base_url.trim_end_matches('/')
        );
        let mut builder = self
            .http
            .post(url)
            .header("anthropic-version", API_VERSION)
            .json(body);
        if !self.config.endpoint.api_key.is_empty() {
            builder = builder.header("x-api-key", &self.config.endpoint.api_key);
        }
        if self.config.endpoint.step_header {
            builder = builder.header("x-subagents-step", &req.step_key);
        }
        let resp = builder
            .send()
            .await
            .map_err(|e| Attempt::broken(format!("connection: {e}")))?;
        if !resp.status().is_success() {
            return Err(Attempt::refused(resp).await);
        }
        let budget_resets_in = budget_reset(resp.headers(), chrono::Utc::now());
        let is_sse = resp
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        let mut acc = Assembly::default();
        if !is_sse {
            let v: Value = resp
                .json()
                .await
                .map_err(|e| Attempt::broken(format!("reading body: {e}")))?;
            acc.whole(&v).map_err(Attempt::Fatal)?;
        } else {
            let mut events = resp.bytes_stream().eventsource();
            while let Some(ev) = events.next().await {
                let ev = ev.map_err(|e| Attempt::broken(format!("stream broke: {e}")))?;
                let v: Value = serde_json::from_str(&ev.data).map_err(|e| {
                    Attempt::Fatal(ModelError::Malformed(format!("{e} in event {}", ev.data)))
                })?;
                if acc.event(&v, on_delta)? {
                    break;
                }
            }
            if !acc.stopped {
                return Err(Attempt::broken(
                    "stream ended before message_stop: the response was not complete",
                ));
            }
        }
        Ok(ChatResponse {
            budget_resets_in,
            ..acc.finish(structured(req).is_some())
        })
    }
}

#[async_trait]
impl ChatModel for AnthropicClient {
    async fn complete(
        &self,
        req: &ChatRequest,
        on_delta: DeltaSink<'_>,
    ) -> Result<ChatResponse, ModelError> {
        let body = request_body(req, &self.config);
        super::with_retries(
            self.config.endpoint.retry,
            self.config.endpoint.request_timeout,
            || self.attempt(req, &body, on_delta),
        )
        .await
    }
}

/// The JSON schema the request's `response_format` asks for, if any.
fn structured(req: &ChatRequest) -> Option<&Value> {
    let f = req.response_format.as_ref()?;
    (f["type"] == "json_schema").then(|| &f["json_schema"]["schema"])
}

fn ephemeral() -> Value {
    json!({"type": "ephemeral"})
}

/// The Messages API request for `req`: a pure function, so a replayed step sends the same bytes.
pub fn request_body(req: &ChatRequest, config: &AnthropicConfig) -> Value {
    let system_text: Vec<&str> = req
        .messages
        .iter()
        .filter_map(|m| match m {
            Message::System { content } if !content.is_empty() => Some(content.as_str()),
            _ => None,
        })
        .collect();
    let mut tools: Vec<Value> = req
        .tools
        .iter()
        .map(|t| {
            json!({
                "name": t.function.name,
                "description": t.function.description,
                "input_schema": t.function.parameters,
            })
        })
        .collect();
    let schema = structured(req);
    if let Some(schema) = schema {
        tools.push(json!({
            "name": RESULT_TOOL,
            "description": "Give your final answer by calling this tool once, with the answer as its input. Call it only when the work is done.",
            "input_schema": schema,
        }));
    }
    let mut messages = convert(&req.messages);
    let mut body = json!({
        "model": req.model,
        "max_tokens": config.max_tokens,
        "stream": true,
    });
    let mut system: Vec<Value> = system_text
        .iter()
        .map(|t| json!({"type": "text", "text": t}))
        .collect();
    if config.caching {
        // The prefix (tools, then system) is the same on every step: one breakpoint at its end.
        if let Some(last) = system.last_mut() {
            last["cache_control"] = ephemeral();
        } else if let Some(last) = tools.last_mut() {
            last["cache_control"] = ephemeral();
        }
        mark_conversation(&mut messages);
    }
    if !system.is_empty() {
        body["system"] = Value::Array(system);
    }
    if !tools.is_empty() {
        body["tools"] = Value::Array(tools);
    }
    if let Some(budget) = config.thinking_budget {
        body["thinking"] = json!({"type": "enabled", "budget_tokens": budget});
    }
    // A forced final answer (no tools offered) with a schema must come through the result tool;
    // the API does not allow forcing a tool while thinking.
    if schema.is_some() && req.tools.is_empty() && config.thinking_budget.is_none() {
        body["tool_choice"] = json!({"type": "tool", "name": RESULT_TOOL});
    }
    body["messages"] = Value::Array(messages);
    body
}

/// Breakpoints on the conversation: its last message, and the message that was last when the
/// previous step was sent (just before the newest assistant turn), so this step reads the
/// previous one's whole prefix from the cache and writes only what is new. With the system's,
/// three breakpoints: the API allows four.
fn mark_conversation(messages: &mut [Value]) {
    let n = messages.len();
    let mut marks = vec![];
    if n > 0 {
        marks.push(n - 1);
    }
    if let Some(a) = messages.iter().rposition(|m| m["role"] == "assistant")
        && a > 0
        && a - 1 != n - 1
    {
        marks.push(a - 1);
    }
    for i in marks {
        if let Some(block) = messages[i]["content"]
            .as_array_mut()
            .and_then(|blocks| blocks.iter_mut().rev().find(|b| cacheable(b)))
        {
            block["cache_control"] = ephemeral();
        }
    }
}

/// Thinking blocks cannot carry a breakpoint; every other block can.
fn cacheable(block: &Value) -> bool {
    !matches!(
        block["type"].as_str(),
        Some("thinking") | Some("redacted_thinking")
    )
}

/// The conversation as Messages API turns: tool results become `tool_result` blocks of a user
/// turn, consecutive turns of one role merge (the API requires alternation), and a reasoning
/// block goes back first in its assistant turn, as the API requires.
pub fn convert(messages: &[Message]) -> Vec<Value> {
    let mut out: Vec<(&'static str, Vec<Value>)> = vec![];
    let mut push = |role: &'static str, blocks: Vec<Value>| {
        if blocks.is_empty() {
            return;
        }
        match out.last_mut() {
            Some((r, b)) if *r == role => b.extend(blocks),
            _ => out.push((role, blocks)),
        }
    };
    for m in messages {
        match m {
            Message::System { .. } => {}
            Message::User { content } => push("user", vec![text_block(content)]),
            Message::Tool {
                tool_call_id,
                content,
            } => {
                let mut block = json!({"type": "tool_result", "tool_use_id": tool_call_id});
                if !content.is_empty() {
                    block["content"] = json!(content);
                }
                push("user", vec![block]);
            }
            Message::Assistant {
                content,
                tool_calls,
                thinking,
            } => {
                let mut blocks: Vec<Value> = thinking.clone();
                if let Some(text) = content.as_deref().filter(|t| !t.trim().is_empty()) {
                    blocks.push(json!({"type": "text", "text": text}));
                }
                for call in tool_calls {
                    blocks.push(json!({
                        "type": "tool_use",
                        "id": call.id,
                        "name": call.function.name,
                        "input": tool_input(&call.function.arguments),
                    }));
                }
                if blocks.iter().all(|b| !cacheable(b)) {
                    // The API refuses an empty assistant turn; this one said nothing.
                    blocks.push(json!({"type": "text", "text": "(no answer)"}));
                }
                push("assistant", blocks);
            }
        }
    }
    if out.first().is_some_and(|(r, _)| *r == "assistant") {
        out.insert(0, ("user", vec![text_block("(continue)")]));
    }
    out.into_iter()
        .map(|(role, content)| json!({"role": role, "content": content}))
        .collect()
}

/// A text block; the API refuses empty ones.
fn text_block(text: &str) -> Value {
    let text = if text.is_empty() { "(empty)" } else { text };
    json!({"type": "text", "text": text})
}

/// A tool call's arguments as the API's `input` object. Arguments that are not a JSON object
/// (a model's malformed call, already answered with an error) are kept under `_raw` so the turn
/// still says what was asked.
fn tool_input(arguments: &str) -> Value {
    match serde_json::from_str::<Value>(arguments) {
        Ok(v @ Value::Object(_)) => v,
        _ if arguments.trim().is_empty() => json!({}),
        _ => json!({ "_raw": arguments }),
    }
}

/// One content block as it streams in.
enum Block {
    Text(String),
    ToolUse {
        call: usize,
        id: String,
        name: String,
        input: String,
    },
    /// A reasoning block as it started (its type, and `data` for a redacted one), with the
    /// thinking text and signature its deltas append.
    Thinking {
        start: Value,
        thinking: String,
        signature: String,
    },
    Other,
}

/// Builds one response out of stream events (or a whole message).
#[derive(Default)]
struct Assembly {
    blocks: BTreeMap<usize, Block>,
    calls: usize,
    usage: Usage,
    stop_reason: Option<String>,
    stopped: bool,
}

impl Assembly {
    /// Takes one stream event; `true` at `message_stop`.
    fn event(&mut self, v: &Value, on_delta: DeltaSink<'_>) -> Result<bool, Attempt> {
        match v["type"].as_str().unwrap_or("") {
            "message_start" => self.usage_from(&v["message"]["usage"]),
            "content_block_start" => {
                let index = v["index"].as_u64().unwrap_or(0) as usize;
                let block = self.start(&v["content_block"]);
                if let Block::ToolUse { call, name, .. } = &block {
                    on_delta(super::Delta::ToolArguments {
                        index: *call,
                        name: Some(name),
                        text: "",
                    });
                }
                self.blocks.insert(index, block);
            }
            "content_block_delta" => {
                let index = v["index"].as_u64().unwrap_or(0) as usize;
                let d = &v["delta"];
                match (self.blocks.get_mut(&index), d["type"].as_str()) {
                    (Some(Block::Text(t)), Some("text_delta")) => {
                        let piece = d["text"].as_str().unwrap_or("");
                        if !piece.is_empty() {
                            on_delta(super::Delta::Text(piece));
                        }
                        t.push_str(piece);
                    }
                    (Some(Block::ToolUse { call, input, .. }), Some("input_json_delta")) => {
                        let piece = d["partial_json"].as_str().unwrap_or("");
                        if !piece.is_empty() {
                            on_delta(super::Delta::ToolArguments {
                                index: *call,
                                name: None,
                                text: piece,
                            });
                        }
                        input.push_str(piece);
                    }
                    (Some(Block::Thinking { thinking, .. }), Some("thinking_delta")) => {
                        thinking.push_str(d["thinking"].as_str().unwrap_or(""));
                    }
                    (Some(Block::Thinking { signature, .. }), Some("signature_delta")) => {
                        signature.push_str(d["signature"].as_str().unwrap_or(""));
                    }
                    (None, _) => {
                        return Err(Attempt::Fatal(ModelError::Malformed(format!(
                            "content_block_delta for block {index}, which never started"
                        ))));
                    }
                    _ => {}
                }
            }
            "message_delta" => {
                if let Some(r) = v["delta"]["stop_reason"].as_str() {
                    self.stop_reason = Some(r.to_owned());
                }
                // The final counts; input figures are repeated here by newer API versions.
                self.usage_from(&v["usage"]);
            }
            "message_stop" => {
                self.stopped = true;
                return Ok(true);
            }
            "error" => {
                let e = &v["error"];
                // Mid-stream errors (`overloaded_error`, `api_error`) are transient.
                return Err(Attempt::Retry {
                    why: format!(
                        "stream error {}: {}",
                        e["type"].as_str().unwrap_or("unknown"),
                        e["message"].as_str().unwrap_or("")
                    ),
                    after: None,
                    throttled: e["type"] == "rate_limit_error",
                });
            }
            _ => {} // ping, content_block_stop, and whatever a newer API adds
        }
        Ok(false)
    }

    fn start(&mut self, b: &Value) -> Block {
        match b["type"].as_str().unwrap_or("") {
            "text" => Block::Text(b["text"].as_str().unwrap_or("").to_owned()),
            "tool_use" => {
                let call = self.calls;
                self.calls += 1;
                // A whole message carries the input as an object; a stream sends `{}` and
                // then the JSON text in deltas.
                let input = match &b["input"] {
                    Value::Object(o) if !o.is_empty() => b["input"].to_string(),
                    _ => String::new(),
                };
                Block::ToolUse {
                    call,
                    id: b["id"].as_str().unwrap_or("").to_owned(),
                    name: b["name"].as_str().unwrap_or("").to_owned(),
                    input,
                }
            }
            "thinking" | "redacted_thinking" => Block::Thinking {
                start: b.clone(),
                thinking: b["thinking"].as_str().unwrap_or("").to_owned(),
                signature: b["signature"].as_str().unwrap_or("").to_owned(),
            },
            _ => Block::Other,
        }
    }

    /// A whole (non-streamed) message.
    fn whole(&mut self, v: &Value) -> Result<(), ModelError> {
        let Some(content) = v["content"].as_array() else {
            return Err(ModelError::Malformed(format!("no content array in {v}")));
        };
        for (i, b) in content.iter().enumerate() {
            let block = self.start(b);
            self.blocks.insert(i, block);
        }
        self.usage_from(&v["usage"]);
        self.stop_reason = v["stop_reason"].as_str().map(str::to_owned);
        self.stopped = true;
        Ok(())
    }

    /// Anthropic's `input_tokens` excludes the cached part: the whole prompt is the three summed.
    fn usage_from(&mut self, u: &Value) {
        let get = |k: &str| u[k].as_u64();
        if let Some(input) = get("input_tokens") {
            let read = get("cache_read_input_tokens").unwrap_or(0);
            let write = get("cache_creation_input_tokens").unwrap_or(0);
            self.usage.prompt_tokens = input + read + write;
            self.usage.cache_read_tokens = read;
            self.usage.cache_write_tokens = write;
        }
        if let Some(out) = get("output_tokens") {
            self.usage.completion_tokens = out;
        }
    }

    fn finish(self, structured: bool) -> ChatResponse {
        let mut text: Option<String> = None;
        let mut thinking = vec![];
        let mut tool_calls = vec![];
        let mut result: Option<String> = None;
        for block in self.blocks.into_values() {
            match block {
                Block::Text(t) => text.get_or_insert_with(String::new).push_str(&t),
                Block::Thinking {
                    mut start,
                    thinking: reasoning,
                    signature,
                } => {
                    if let Some(o) = start.as_object_mut() {
                        o.remove("cache_control");
                        if o.get("type").and_then(Value::as_str) == Some("thinking") {
                            o.insert("thinking".into(), json!(reasoning));
                            o.insert("signature".into(), json!(signature));
                        }
                    }
                    thinking.push(start)
                }
                Block::ToolUse {
                    id, name, input, ..
                } => {
                    let arguments = if input.trim().is_empty() {
                        "{}".to_owned()
                    } else {
                        input
                    };
                    if structured && name == RESULT_TOOL {
                        result = Some(arguments);
                    } else {
                        tool_calls.push(ToolCall {
                            id,
                            kind: "function".into(),
                            function: FunctionCall { name, arguments },
                        });
                    }
                }
                Block::Other => {}
            }
        }
        let mut finish_reason = self.stop_reason.map(|r| stop_reason(&r).to_owned());
        if let Some(r) = result
            && tool_calls.is_empty()
        {
            // The structured answer arrived as the result tool's input: that input is the answer.
            text = Some(r);
            finish_reason = Some("stop".into());
        }
        ChatResponse {
            content: text,
            tool_calls,
            usage: self.usage,
            finish_reason,
            budget_resets_in: None,
            thinking,
        }
    }
}

/// Anthropic's stop reasons in the engine's (OpenAI's) words.
pub fn stop_reason(r: &str) -> &str {
    match r {
        "end_turn" | "stop_sequence" | "pause_turn" => "stop",
        "tool_use" => "tool_calls",
        "max_tokens" => "length",
        other => other, // `refusal` and anything newer pass through
    }
}

/// When Anthropic's rate-limit headers (`anthropic-ratelimit-{requests,tokens,input-tokens,
/// output-tokens}-remaining: 0` with the RFC 3339 `-reset`) say a budget is used up: how long until
/// it resets.
pub fn budget_reset(
    headers: &reqwest::header::HeaderMap,
    now: chrono::DateTime<chrono::Utc>,
) -> Option<Duration> {
    let get = |k: &str| headers.get(k).and_then(|v| v.to_str().ok()).map(str::trim);
    ["requests", "tokens", "input-tokens", "output-tokens"]
        .iter()
        .filter(|kind| {
            get(&format!("anthropic-ratelimit-{kind}-remaining"))
                .and_then(|v| v.parse::<u64>().ok())
                == Some(0)
        })
        .filter_map(|kind| get(&format!("anthropic-ratelimit-{kind}-reset")))
        .filter_map(|at| chrono::DateTime::parse_from_rfc3339(at).ok())
        .map(|at| {
            (at.with_timezone(&chrono::Utc) - now)
                .to_std()
                .unwrap_or_default()
                .min(Duration::from_secs(86_400))
        })
        .max()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{FunctionSpec, ToolSpec};

    fn config() -> AnthropicConfig {
        AnthropicConfig {
            endpoint: Endpoint {
                base_url: "http://x/v1".into(),
                api_key: String::new(),
                retry: crate::model::RetryPolicy::default(),
                request_timeout: Duration::from_secs(5),
                step_header: false,
            },
            max_tokens: 4096,
            thinking_budget: None,
            caching: true,
        }
    }

    fn call(id: &str, args: &str) -> ToolCall {
        ToolCall {
            id: id.into(),
            kind: "function".into(),
            function: FunctionCall {
                name: "echo".into(),
                arguments: args.into(),
            },
        }
    }

    fn conversation() -> Vec<Message> {
        vec![
            Message::System {
                content: "be brief".into(),
            },
            Message::User {
                content: "go".into(),
            },
            Message::Assistant {
                content: Some("calling".into()),
                tool_calls: vec![call("t1", r#"{"text":"a"}"#), call("t2", "not json")],
                thinking: vec![json!({"type":"thinking","thinking":"hmm","signature":"sig"})],
            },
            Message::Tool {
                tool_call_id: "t1".into(),
                content: "a".into(),
            },
            Message::Tool {
                tool_call_id: "t2".into(),
                content: String::new(),
            },
            Message::User {
                content: "and then?".into(),
            },
        ]
    }

    #[test]
    fn the_conversation_becomes_alternating_content_blocks() {
        let m = convert(&conversation());
        assert_eq!(m.len(), 3, "{m:#?}");
        assert_eq!(m[0]["role"], "user");
        let a = &m[1]["content"];
        assert_eq!(a[0]["type"], "thinking", "thinking first, verbatim");
        assert_eq!(a[0]["signature"], "sig");
        assert_eq!(a[1], json!({"type": "text", "text": "calling"}));
        assert_eq!(a[2]["input"], json!({"text": "a"}));
        assert_eq!(a[3]["input"], json!({"_raw": "not json"}));
        let u = &m[2]["content"];
        assert_eq!(u[0]["type"], "tool_result");
        assert_eq!(u[0]["tool_use_id"], "t1");
        assert!(
            u[1].get("content").is_none(),
            "an empty result has no content"
        );
        assert_eq!(
            u[2]["text"], "and then?",
            "tool results come first in the turn"
        );
    }

    #[test]
    fn breakpoints_sit_on_the_system_the_previous_prefix_and_the_end() {
        let req = ChatRequest {
            model: "claude-sonnet-4-5".into(),
            messages: conversation(),
            tools: vec![ToolSpec {
                kind: "function".into(),
                function: FunctionSpec {
                    name: "echo".into(),
                    description: "echo".into(),
                    parameters: json!({"type": "object"}),
                },
            }],
            step_key: "r:1".into(),
            response_format: None,
        };
        let body = request_body(&req, &config());
        let text = body.to_string();
        assert_eq!(text.matches("cache_control").count(), 3, "{body:#}");
        assert_eq!(body["system"][0]["cache_control"]["type"], "ephemeral");
        assert!(body["tools"][0].get("cache_control").is_none());
        let m = body["messages"].as_array().unwrap();
        assert!(
            m[0]["content"][0].get("cache_control").is_some(),
            "previous step's end"
        );
        assert!(
            m[2]["content"][2].get("cache_control").is_some(),
            "this step's end"
        );
        assert_eq!(body["max_tokens"], 4096);
        // Replay sends the same bytes.
        assert_eq!(request_body(&req, &config()).to_string(), text);
        let off = AnthropicConfig {
            caching: false,
            ..config()
        };
        assert!(
            !request_body(&req, &off)
                .to_string()
                .contains("cache_control")
        );
    }

    #[test]
    fn a_schema_becomes_a_forced_result_tool_whose_input_is_the_answer() {
        let req = ChatRequest {
            model: "claude-haiku-4-5".into(),
            messages: vec![Message::User {
                content: "x".into(),
            }],
            tools: vec![],
            step_key: String::new(),
            response_format: Some(
                json!({"type": "json_schema", "json_schema": {"name": "out", "schema": {"type": "object"}}}),
            ),
        };
        let body = request_body(&req, &config());
        assert_eq!(body["tools"][0]["name"], RESULT_TOOL);
        assert_eq!(body["tool_choice"]["name"], RESULT_TOOL);
        let mut acc = Assembly::default();
        acc.whole(&json!({
            "content": [{"type": "tool_use", "id": "toolu_1", "name": RESULT_TOOL, "input": {"n": 1}}],
            "stop_reason": "tool_use",
            "usage": {"input_tokens": 5, "cache_read_input_tokens": 100, "cache_creation_input_tokens": 20, "output_tokens": 7}
        }))
        .unwrap();
        let r = acc.finish(true);
        assert_eq!(r.content.as_deref(), Some(r#"{"n":1}"#));
        assert!(r.tool_calls.is_empty());
        assert_eq!(r.finish_reason.as_deref(), Some("stop"));
        assert_eq!(
            r.usage,
            Usage {
                prompt_tokens: 125,
                completion_tokens: 7,
                cache_read_tokens: 100,
                cache_write_tokens: 20
            }
        );
    }

    #[test]
    fn a_stream_assembles_text_tool_input_and_signed_thinking() {
        let events = [
            json!({"type":"message_start","message":{"usage":{"input_tokens":3,"cache_read_input_tokens":2000,"output_tokens":1}}}),
            json!({"type":"content_block_start","index":0,"content_block":{"type":"thinking","thinking":"","signature":""}}),
            json!({"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"let me "}}),
            json!({"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"see"}}),
            json!({"type":"content_block_delta","index":0,"delta":{"type":"signature_delta","signature":"SIG"}}),
            json!({"type":"ping"}),
            json!({"type":"content_block_start","index":1,"content_block":{"type":"text","text":""}}),
            json!({"type":"content_block_delta","index":1,"delta":{"type":"text_delta","text":"Hi"}}),
            json!({"type":"content_block_start","index":2,"content_block":{"type":"tool_use","id":"toolu_9","name":"echo","input":{}}}),
            json!({"type":"content_block_delta","index":2,"delta":{"type":"input_json_delta","partial_json":"{\"te"}}),
            json!({"type":"content_block_delta","index":2,"delta":{"type":"input_json_delta","partial_json":"xt\":\"a\"}"}}),
            json!({"type":"content_block_stop","index":2}),
            json!({"type":"message_delta","delta":{"stop_reason":"tool_use"},"usage":{"output_tokens":42}}),
            json!({"type":"message_stop"}),
        ];
        let seen = std::sync::Mutex::new(vec![]);
        let sink = |d: super::super::Delta<'_>| seen.lock().unwrap().push(d.to_json());
        let mut acc = Assembly::default();
        let mut stopped = false;
        for e in &events {
            stopped = acc.event(e, &sink).ok().unwrap();
        }
        assert!(stopped);
        let r = acc.finish(false);
        assert_eq!(r.content.as_deref(), Some("Hi"));
        assert_eq!(r.tool_calls[0].function.arguments, r#"{"text":"a"}"#);
        assert_eq!(r.tool_calls[0].id, "toolu_9");
        assert_eq!(r.finish_reason.as_deref(), Some("tool_calls"));
        assert_eq!(
            r.thinking,
            vec![json!({"type":"thinking","thinking":"let me see","signature":"SIG"})]
        );
        assert_eq!(
            (r.usage.prompt_tokens, r.usage.cache_read_tokens),
            (2003, 2000)
        );
        assert_eq!(r.usage.completion_tokens, 42);
        let seen = seen.into_inner().unwrap();
        assert_eq!(seen[0], json!({"text": "Hi"}));
        assert_eq!(seen[1]["tool_call"]["name"], "echo");
        assert_eq!(seen.len(), 4);
    }

    #[test]
    fn overloaded_mid_stream_is_retried() {
        let mut acc = Assembly::default();
        let e = json!({"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}});
        assert!(matches!(
            acc.event(&e, &|_| {}),
            Err(Attempt::Retry {
                throttled: false,
                ..
            })
        ));
        assert_eq!(stop_reason("max_tokens"), "length");
        assert_eq!(stop_reason("refusal"), "refusal");
    }

    #[test]
    fn an_exhausted_budget_waits_for_its_reset() {
        let now = chrono::DateTime::parse_from_rfc3339("2026-01-01T00:00:00Z")
            .unwrap()
            .with_timezone(&chrono::Utc);
        let mut h = reqwest::header::HeaderMap::new();
        h.insert(
            "anthropic-ratelimit-input-tokens-remaining",
            "0".parse().unwrap(),
        );
        h.insert(
            "anthropic-ratelimit-input-tokens-reset",
            "2026-01-01T00:00:12Z".parse().unwrap(),
        );
        h.insert(
            "anthropic-ratelimit-requests-remaining",
            "9".parse().unwrap(),
        );
        assert_eq!(budget_reset(&h, now), Some(Duration::from_secs(12)));
        h.insert(
            "anthropic-ratelimit-input-tokens-remaining",
            "10".parse().unwrap(),
        );
        assert_eq!(budget_reset(&h, now), None);
    }
}
