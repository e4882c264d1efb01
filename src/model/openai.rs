//! The OpenAI-compatible Chat Completions client: streamed (SSE) responses assembled into one
//! [`ChatResponse`], tool calls included, with retry and backoff on 429, 5xx and broken
//! connections, honouring `Retry-After`.

use std::collections::BTreeMap;
use std::time::Duration;

use async_trait::async_trait;
use eventsource_stream::Eventsource;
use futures::StreamExt;
use serde::Deserialize;
use serde_json::json;

use super::{
    Attempt, ChatModel, ChatRequest, ChatResponse, DeltaSink, Endpoint, FunctionCall, ModelError,
    ToolCall, Usage,
};

/// A streaming Chat Completions client.
#[derive(Clone, Debug)]
pub struct OpenAiClient {
    http: reqwest::Client,
    config: Endpoint,
}

impl OpenAiClient {
    /// A client with its own connection pool.
    pub fn new(config: Endpoint) -> Self {
        Self {
            http: super::http_client(),
            config,
        }
    }

    fn url(&self) -> String {
        format!(
            "{}/chat/completions",
            self.config.base_url.trim_end_matches('/')
        )
    }

    async fn attempt(
        &self,
        req: &ChatRequest,
        on_delta: DeltaSink<'_>,
    ) -> Result<ChatResponse, Attempt> {
        let mut body = json!({
            "model": req.model,
            "messages": wire_messages(&req.messages),
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        if !req.tools.is_empty() {
            body["tools"] = json!(req.tools);
        }
        if let Some(f) = &req.response_format {
            body["response_format"] = f.clone();
        }
        let mut builder = self.http.post(self.url()).json(&body);
        if self.config.step_header {
            builder = builder.header("x-subagents-step", &req.step_key);
        }
        if !self.config.api_key.is_empty() {
            builder = builder.bearer_auth(&self.config.api_key);
        }
        let resp = builder
            .send()
            .await
            .map_err(|e| Attempt::broken(format!("connection: {e}")))?;
        if !resp.status().is_success() {
            return Err(Attempt::refused(resp).await);
        }
        let budget_resets_in = budget_reset(resp.headers());
        let is_sse = resp
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        if !is_sse {
            // Some compatible servers ignore `stream`; accept a plain completion too.
            let v: serde_json::Value = resp
                .json()
                .await
                .map_err(|e| Attempt::broken(format!("reading body: {e}")))?;
            return parse_plain(&v)
                .map(|r| ChatResponse {
                    budget_resets_in,
                    ..r
                })
                .map_err(Attempt::Fatal);
        }
        let mut acc = Accumulator::default();
        let mut events = resp.bytes_stream().eventsource();
        while let Some(ev) = events.next().await {
            let ev = ev.map_err(|e| Attempt::broken(format!("stream broke: {e}")))?;
            if ev.data.trim() == "[DONE]" {
                return Ok(ChatResponse {
                    budget_resets_in,
                    ..acc.finish()
                });
            }
            let chunk: Chunk = serde_json::from_str(&ev.data).map_err(|e| {
                Attempt::Fatal(ModelError::Malformed(format!("{e} in chunk {}", ev.data)))
            })?;
            acc.add(chunk, on_delta);
        }
        // Some servers end the stream without `[DONE]`; what arrived is complete only if a
        // finish reason came with it.
        if acc.finish_reason.is_some() {
            Ok(ChatResponse {
                budget_resets_in,
                ..acc.finish()
            })
        } else {
            Err(Attempt::broken(
                "stream ended before the response was complete",
            ))
        }
    }
}

#[async_trait]
impl ChatModel for OpenAiClient {
    async fn complete(
        &self,
        req: &ChatRequest,
        on_delta: DeltaSink<'_>,
    ) -> Result<ChatResponse, ModelError> {
        super::with_retries(self.config.retry, self.config.request_timeout, || {
            self.attempt(req, on_delta)
        })
        .await
    }
}

/// When a response's rate-limit headers (OpenAI's `x-ratelimit-remaining-requests` /
/// `-tokens` with their `x-ratelimit-reset-*`) say a budget is used up: how long until it resets.
fn budget_reset(headers: &reqwest::header::HeaderMap) -> Option<Duration> {
    let get = |k: &str| headers.get(k).and_then(|v| v.to_str().ok()).map(str::trim);
    ["requests", "tokens"]
        .iter()
        .filter(|kind| {
            get(&format!("x-ratelimit-remaining-{kind}")).and_then(|v| v.parse::<f64>().ok())
                == Some(0.0)
        })
        .filter_map(|kind| get(&format!("x-ratelimit-reset-{kind}")).and_then(parse_reset))
        .max()
}

/// OpenAI's reset durations: `1s`, `6m0s`, `20ms`, `1h2m3.5s`, or plain seconds.
fn parse_reset(s: &str) -> Option<Duration> {
    if let Ok(secs) = s.parse::<f64>() {
        return (secs.is_finite() && secs >= 0.0)
            .then(|| Duration::from_secs_f64(secs.min(86_400.0)));
    }
    let mut total = 0.0f64;
    let mut rest = s;
    while !rest.is_empty() {
        let n_end = rest.find(|c: char| !(c.is_ascii_digit() || c == '.'))?;
        let n: f64 = rest[..n_end].parse().ok()?;
        rest = &rest[n_end..];
        let (unit, len) = if rest.starts_with("ms") {
            (0.001, 2)
        } else if rest.starts_with('h') {
            (3600.0, 1)
        } else if rest.starts_with('m') {
            (60.0, 1)
        } else if rest.starts_with('s') {
            (1.0, 1)
        } else {
            return None;
        };
        total += n * unit;
        rest = &rest[len..];
    }
    Some(Duration::from_secs_f64(total.min(86_400.0)))
}

#[cfg(test)]
mod reset_tests {
    use super::*;

    #[test]
    fn openai_reset_durations_parse() {
        assert_eq!(parse_reset("1s"), Some(Duration::from_secs(1)));
        assert_eq!(parse_reset("6m0s"), Some(Duration::from_secs(360)));
        assert_eq!(parse_reset("20ms"), Some(Duration::from_millis(20)));
        assert_eq!(
            parse_reset("1h2m3.5s"),
            Some(Duration::from_secs_f64(3723.5))
        );
        assert_eq!(parse_reset("2.5"), Some(Duration::from_secs_f64(2.5)));
        assert_eq!(parse_reset("soon"), None);
        let mut h = reqwest::header::HeaderMap::new();
        h.insert("x-ratelimit-remaining-requests", "0".parse().unwrap());
        h.insert("x-ratelimit-reset-requests", "1500ms".parse().unwrap());
        assert_eq!(budget_reset(&h), Some(Duration::from_millis(1500)));
        h.insert("x-ratelimit-remaining-requests", "3".parse().unwrap());
        assert_eq!(budget_reset(&h), None, "budget left: nothing to wait for");
    }
}

#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<ChunkChoice>,
    #[serde(default)]
    usage: Option<WireUsage>,
}

/// OpenAI's usage object: the cached part of the prompt is in `prompt_tokens_details`.
#[derive(Deserialize, Default)]
struct WireUsage {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
    #[serde(default)]
    prompt_tokens_details: Option<PromptDetails>,
}

#[derive(Deserialize, Default)]
struct PromptDetails {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

impl From<WireUsage> for Usage {
    fn from(u: WireUsage) -> Usage {
        Usage {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            cache_read_tokens: u
                .prompt_tokens_details
                .and_then(|d| d.cached_tokens)
                .unwrap_or(0),
            cache_write_tokens: 0,
        }
    }
}

#[derive(Deserialize)]
struct ChunkChoice {
    #[serde(default)]
    delta: Delta,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Deserialize, Default)]
struct Delta {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    tool_calls: Vec<ToolCallDelta>,
}

#[derive(Deserialize)]
struct ToolCallDelta {
    #[serde(default)]
    index: usize,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    function: Option<FunctionDelta>,
}

#[derive(Deserialize)]
struct FunctionDelta {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    arguments: Option<String>,
}

/// Builds one response out of stream chunks; tool call fragments are keyed by their index.
#[derive(Default)]
struct Accumulator {
    content: String,
    saw_content: bool,
    calls: BTreeMap<usize, (String, String, String)>,
    usage: Usage,
    finish_reason: Option<String>,
}

impl Accumulator {
    fn add(&mut self, chunk: Chunk, on_delta: DeltaSink<'_>) {
        if let Some(u) = chunk.usage {
            self.usage = u.into();
        }
        for choice in chunk.choices {
            if let Some(text) = choice.delta.content {
                if !text.is_empty() {
                    on_delta(super::Delta::Text(&text));
                }
                self.saw_content = true;
                self.content.push_str(&text);
            }
            for tc in choice.delta.tool_calls {
                let entry = self.calls.entry(tc.index).or_default();
                if let Some(id) = tc.id {
                    entry.0 = id;
                }
                if let Some(f) = tc.function {
                    let args = f.arguments.unwrap_or_default();
                    if f.name.is_some() || !args.is_empty() {
                        on_delta(super::Delta::ToolArguments {
                            index: tc.index,
                            name: f.name.as_deref(),
                            text: &args,
                        });
                    }
                    if let Some(n) = f.name {
                        entry.1.push_str(&n);
                    }
                    entry.2.push_str(&args);
                }
            }
            if choice.finish_reason.is_some() {
                self.finish_reason = choice.finish_reason;
            }
        }
    }

    fn finish(self) -> ChatResponse {
        let tool_calls = self
            .calls
            .into_iter()
            .map(|(i, (id, name, arguments))| ToolCall {
                id: if id.is_empty() {
                    format!("call_{i}")
                } else {
                    id
                },
                kind: "function".into(),
                function: FunctionCall { name, arguments },
            })
            .collect();
        ChatResponse {
            content: self.saw_content.then_some(self.content),
            tool_calls,
            usage: self.usage,
            finish_reason: self.finish_reason,
            budget_resets_in: None,
            thinking: vec![],
        }
    }
}

/// The messages as Chat Completions takes them: the reasoning blocks an Anthropic model left in
/// the checkpoint are not part of this format (a run may change provider between steps).
fn wire_messages(messages: &[super::Message]) -> serde_json::Value {
    let mut v = json!(messages);
    if let Some(list) = v.as_array_mut() {
        for m in list {
            if let Some(o) = m.as_object_mut() {
                o.remove("thinking");
            }
        }
    }
    v
}

fn parse_plain(v: &serde_json::Value) -> Result<ChatResponse, ModelError> {
    let msg = &v["choices"][0]["message"];
    if msg.is_null() {
        return Err(ModelError::Malformed(format!(
            "no choices[0].message in {v}"
        )));
    }
    let tool_calls: Vec<ToolCall> = match msg.get("tool_calls") {
        Some(tc) if !tc.is_null() => serde_json::from_value(tc.clone())
            .map_err(|e| ModelError::Malformed(format!("tool_calls: {e}")))?,
        _ => vec![],
    };
    let usage = serde_json::from_value::<WireUsage>(v["usage"].clone())
        .unwrap_or_default()
        .into();
    Ok(ChatResponse {
        content: msg["content"].as_str().map(str::to_owned),
        tool_calls,
        usage,
        finish_reason: v["choices"][0]["finish_reason"].as_str().map(str::to_owned),
        budget_resets_in: None,
        thinking: vec![],
    })
}
