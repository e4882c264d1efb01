//! Model access: the chat message types (which are also the OpenAI wire format), the
//! provider-agnostic [`ChatModel`] trait the engine calls, the OpenAI-compatible streaming client,
//! and the scripted mock server used by tests, demos and benchmarks.

pub mod anthropic;
pub mod compact;
pub mod mock;
pub mod openai;
pub mod prices;
pub mod providers;
pub mod tokens;

use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

/// One message of a conversation, serialized exactly as OpenAI Chat Completions expects it.
/// The same type is what the store checkpoints, so replay needs no conversion.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(tag = "role", rename_all = "lowercase")]
pub enum Message {
    /// The agent's system prompt.
    System {
        /// Prompt text.
        content: String,
    },
    /// Input from the caller.
    User {
        /// Prompt text.
        content: String,
    },
    /// What the model said: text, tool calls, or both.
    Assistant {
        /// Text; absent when the model only called tools.
        #[serde(default)]
        content: Option<String>,
        /// Calls the model asked for, in its order.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        tool_calls: Vec<ToolCall>,
        /// The provider's reasoning blocks (Anthropic's `thinking` and `redacted_thinking`),
        /// kept verbatim with their signatures: Anthropic requires them back unchanged after a
        /// tool-use turn. Only the Anthropic client sends them; others drop them.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        #[schema(value_type = Vec<Object>)]
        thinking: Vec<serde_json::Value>,
    },
    /// A tool's answer to one call.
    Tool {
        /// The call this answers.
        tool_call_id: String,
        /// The (possibly truncated) output or error text.
        content: String,
    },
}

impl Message {
    /// The role as the wire names it.
    pub fn role(&self) -> &'static str {
        match self {
            Message::System { .. } => "system",
            Message::User { .. } => "user",
            Message::Assistant { .. } => "assistant",
            Message::Tool { .. } => "tool",
        }
    }
}

/// A tool call as the model emits it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ToolCall {
    /// The model's id for the call; tool results refer to it.
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type", default = "function_kind")]
    pub kind: String,
    /// Name and JSON-encoded arguments.
    pub function: FunctionCall,
}

fn function_kind() -> String {
    "function".into()
}

/// The function part of a tool call.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct FunctionCall {
    /// Tool name.
    pub name: String,
    /// Arguments as a JSON string (the model may produce invalid JSON; tools report that).
    #[serde(default)]
    pub arguments: String,
}

/// A tool offered to the model, in OpenAI's `tools` format.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Name, description and JSON-schema parameters.
    pub function: FunctionSpec,
}

/// The function part of a tool spec.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FunctionSpec {
    /// Tool name.
    pub name: String,
    /// What it does, for the model.
    pub description: String,
    /// JSON schema of the arguments.
    pub parameters: serde_json::Value,
}

/// Token counts of one call, or summed over a run.
///
/// `prompt_tokens` is always the whole prompt, cached or not, so context accounting never depends
/// on the provider; the cache figures say how much of it the provider's prompt cache served
/// (`cache_read_tokens`, billed at the cached rate) and how much it stored for the next call
/// (`cache_write_tokens`, Anthropic's `cache_creation_input_tokens`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Tokens sent, cached ones included.
    pub prompt_tokens: u64,
    /// Tokens produced.
    pub completion_tokens: u64,
    /// Prompt tokens read from the provider's cache.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cache_read_tokens: u64,
    /// Prompt tokens written to the provider's cache.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cache_write_tokens: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl Usage {
    /// Prompt plus completion.
    pub fn total(&self) -> u64 {
        self.prompt_tokens + self.completion_tokens
    }

    /// Adds another call's counts.
    pub fn add(&mut self, other: &Usage) {
        self.prompt_tokens += other.prompt_tokens;
        self.completion_tokens += other.completion_tokens;
        self.cache_read_tokens += other.cache_read_tokens;
        self.cache_write_tokens += other.cache_write_tokens;
    }
}

/// One request to the model.
#[derive(Clone, Debug)]
pub struct ChatRequest {
    /// Model name.
    pub model: String,
    /// The whole context.
    pub messages: Vec<Message>,
    /// Tools offered; empty forces a text answer.
    pub tools: Vec<ToolSpec>,
    /// `{run_id}:{step}`: sent as a header so a server's logs can tie requests to steps.
    pub step_key: String,
    /// The provider's structured-output request (OpenAI's `response_format`), when the run's
    /// answer must match a schema.
    pub response_format: Option<serde_json::Value>,
}

/// The model's complete answer to one request.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatResponse {
    /// Text, if any.
    pub content: Option<String>,
    /// Tool calls, if any.
    pub tool_calls: Vec<ToolCall>,
    /// Tokens used by this call.
    pub usage: Usage,
    /// Why the model stopped (`stop`, `tool_calls`, `length`, …).
    pub finish_reason: Option<String>,
    /// The provider said this call used up its request or token budget
    /// (`x-ratelimit-remaining-*: 0`): how long until it resets.
    pub budget_resets_in: Option<std::time::Duration>,
    /// Reasoning blocks to keep with the answer (see [`Message::Assistant`]'s `thinking`).
    pub thinking: Vec<serde_json::Value>,
}

/// Replaces every NUL character in `text` with U+FFFD: PostgreSQL's text cannot hold one, and a
/// model answer or a tool's output that carries one must still be stored.
pub fn scrub_nul(text: &mut String) {
    if text.contains('\0') {
        *text = text.replace('\0', "\u{FFFD}");
    }
}

impl ChatResponse {
    /// The response with every NUL in its text, tool names, ids and arguments replaced (see
    /// [`scrub_nul`]).
    pub fn scrubbed(mut self) -> ChatResponse {
        if let Some(c) = &mut self.content {
            scrub_nul(c);
        }
        for call in &mut self.tool_calls {
            scrub_nul(&mut call.id);
            scrub_nul(&mut call.function.name);
            scrub_nul(&mut call.function.arguments);
        }
        if let Some(f) = &mut self.finish_reason {
            scrub_nul(f);
        }
        self
    }
}

/// How a model call failed, classified once so the engine knows what to do.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ModelError {
    /// The server refused the request for good (a 4xx other than 408/409/429): retrying cannot help.
    #[error("model endpoint rejected the request with HTTP {status}: {body}")]
    Rejected {
        /// HTTP status.
        status: u16,
        /// Start of the response body.
        body: String,
    },
    /// Transient failures (429, 5xx, connection, broken stream) persisted through every retry.
    #[error("model endpoint kept failing after {attempts} attempts; last error: {last}")]
    Exhausted {
        /// Attempts made.
        attempts: u32,
        /// The last failure.
        last: String,
    },
    /// The request is longer than the model's context window (OpenAI's
    /// `context_length_exceeded`, a 413, or the 400 other compatible servers send). The engine
    /// compacts and retries instead of failing the run.
    #[error("the request is longer than the model's context window (HTTP {status}): {body}")]
    ContextLength {
        /// HTTP status.
        status: u16,
        /// Start of the response body.
        body: String,
    },
    /// The response could not be understood.
    #[error("model response could not be parsed: {0}")]
    Malformed(String),
    /// The provider kept answering 429 through every retry: its rate limit, not our request.
    /// The engine parks the run until `retry_after` instead of failing it.
    #[error("model endpoint rate-limited every attempt; retry after {retry_after:?}: {last}")]
    RateLimited {
        /// How long the provider asked to wait (its `Retry-After`, else our backoff).
        retry_after: std::time::Duration,
        /// The last refusal.
        last: String,
    },
}

impl ModelError {
    /// A short stable name of the failure (`error.type` on traces).
    pub fn kind(&self) -> &'static str {
        match self {
            ModelError::Rejected { .. } => "rejected",
            ModelError::Exhausted { .. } => "exhausted",
            ModelError::ContextLength { .. } => "context_length_exceeded",
            ModelError::Malformed(_) => "malformed_response",
            ModelError::RateLimited { .. } => "rate_limited",
        }
    }
}

/// Whether a refusal says the request was too long for the model (the shapes OpenAI, vLLM,
/// llama.cpp, Ollama, LiteLLM and Anthropic-compatible proxies send).
pub fn is_context_length_error(status: u16, body: &str) -> bool {
    if status == 413 {
        return true;
    }
    if status != 400 && status != 422 {
        return false;
    }
    let b = body.to_ascii_lowercase();
    [
        "context_length_exceeded",
        "maximum context length",
        "context length",
        "context window",
        "prompt is too long",
        "too many tokens",
        "input is too long",
        "reduce the length",
        "exceeds the context",
    ]
    .iter()
    .any(|p| b.contains(p))
}

/// A fragment of the answer as it streams in: ephemeral, never checkpointed (the step's commit
/// holds the whole answer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delta<'a> {
    /// Text of the answer.
    Text(&'a str),
    /// A piece of a tool call's JSON arguments (`name` on the call's first fragment).
    ToolArguments {
        /// The call's place in the answer.
        index: usize,
        /// The tool's name, when this fragment names it.
        name: Option<&'a str>,
        /// The arguments' text in this fragment.
        text: &'a str,
    },
}

impl Delta<'_> {
    /// The fragment as a `model.delta` event's data (without the run and step).
    pub fn to_json(&self) -> serde_json::Value {
        match self {
            Delta::Text(t) => serde_json::json!({ "text": t }),
            Delta::ToolArguments { index, name, text } => {
                let mut call = serde_json::json!({"index": index, "arguments": text});
                if let Some(n) = name {
                    call["name"] = serde_json::json!(n);
                }
                serde_json::json!({ "tool_call": call })
            }
        }
    }
}

/// Called with each fragment as it streams in.
pub type DeltaSink<'a> = &'a (dyn Fn(Delta<'_>) + Send + Sync);

/// A provider of chat completions. The engine depends on this, not on HTTP, so other providers
/// and in-process fakes plug in.
#[async_trait]
pub trait ChatModel: Send + Sync {
    /// One completion, with transient failures already retried.
    async fn complete(
        &self,
        req: &ChatRequest,
        on_delta: DeltaSink<'_>,
    ) -> Result<ChatResponse, ModelError>;
}

/// A provider client's own connection pool.
pub(crate) fn http_client() -> reqwest::Client {
    reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .build()
        .expect("reqwest client with static settings")
}

/// Where and how a provider client reaches its API.
#[derive(Clone)]
pub struct Endpoint {
    /// Base URL up to and including `/v1`.
    pub base_url: String,
    /// The key (a bearer token for OpenAI, `x-api-key` for Anthropic); may be empty for local
    /// servers.
    pub api_key: String,
    /// Retry policy for transient failures.
    pub retry: RetryPolicy,
    /// Limit on one whole attempt (connect, wait, stream).
    pub request_timeout: Duration,
    /// Send `x-subagents-step: RUN:STEP` with each request (see `SUBAGENTS_STEP_HEADER`).
    pub step_header: bool,
}

impl std::fmt::Debug for Endpoint {
    // The key is a secret: never printed.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("base_url", &self.base_url)
            .field(
                "api_key",
                &if self.api_key.is_empty() {
                    "<unset>"
                } else {
                    "<redacted>"
                },
            )
            .field("retry", &self.retry)
            .field("request_timeout", &self.request_timeout)
            .field("step_header", &self.step_header)
            .finish()
    }
}

/// One failed attempt of a provider client: worth retrying (with an optional server-given delay)
/// or final.
pub(crate) enum Attempt {
    /// `throttled`: the provider answered 429 (its rate limit).
    Retry {
        why: String,
        after: Option<Duration>,
        throttled: bool,
    },
    Fatal(ModelError),
}

impl Attempt {
    /// A broken connection or stream: retried after the policy's backoff.
    pub(crate) fn broken(why: impl Into<String>) -> Attempt {
        Attempt::Retry {
            why: why.into(),
            after: None,
            throttled: false,
        }
    }

    /// Classifies a non-success answer the way every provider means it: 429 (throttled), 408,
    /// 409 and 5xx (Anthropic's 529 `overloaded_error` among them) are retried, honouring
    /// `Retry-After`; a too-long prompt is [`ModelError::ContextLength`]; any other 4xx is final.
    pub(crate) async fn refused(resp: reqwest::Response) -> Attempt {
        let status = resp.status();
        let after = resp
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|s| s.trim().parse::<f64>().ok())
            .filter(|s| s.is_finite())
            .map(|s| Duration::from_secs_f64(s.clamp(0.0, 86_400.0)));
        let text = resp.text().await.unwrap_or_default();
        let body: String = text.chars().take(500).collect();
        let code = status.as_u16();
        if code == 429 || code == 408 || code == 409 || status.is_server_error() {
            Attempt::Retry {
                why: format!("HTTP {code}: {body}"),
                after,
                throttled: code == 429,
            }
        } else if is_context_length_error(code, &body) {
            Attempt::Fatal(ModelError::ContextLength { status: code, body })
        } else {
            Attempt::Fatal(ModelError::Rejected { status: code, body })
        }
    }
}

/// Runs `attempt` until it succeeds, fails for good, or the policy's retries are spent; each try
/// is bounded by `timeout` (connect, wait and stream together).
pub(crate) async fn with_retries<F, Fut>(
    policy: RetryPolicy,
    timeout: Duration,
    mut attempt: F,
) -> Result<ChatResponse, ModelError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<ChatResponse, Attempt>>,
{
    let mut attempt_no = 0u32;
    loop {
        attempt_no += 1;
        let outcome = match tokio::time::timeout(timeout, attempt()).await {
            Ok(r) => r,
            Err(_) => Err(Attempt::broken(format!(
                "no complete response within {timeout:?}"
            ))),
        };
        match outcome {
            Ok(r) => return Ok(r),
            Err(Attempt::Fatal(e)) => return Err(e),
            Err(Attempt::Retry {
                why,
                after,
                throttled,
            }) => {
                if attempt_no > policy.retries {
                    if throttled {
                        return Err(ModelError::RateLimited {
                            retry_after: policy.delay(attempt_no, after),
                            last: why,
                        });
                    }
                    return Err(ModelError::Exhausted {
                        attempts: attempt_no,
                        last: why,
                    });
                }
                let delay = policy.delay(attempt_no, after);
                tracing::warn!(attempt = attempt_no, ?delay, error = %why, "model call failed; retrying");
                tokio::time::sleep(delay).await;
            }
        }
    }
}

/// How retries back off: exponential from `base`, capped at `max`, at most `retries` retries.
#[derive(Clone, Copy, Debug)]
pub struct RetryPolicy {
    /// Retries after the first attempt.
    pub retries: u32,
    /// First delay.
    pub base: Duration,
    /// Longest delay, also the cap on a server's `Retry-After`.
    pub max: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            retries: 5,
            base: Duration::from_millis(200),
            max: Duration::from_secs(30),
        }
    }
}

impl RetryPolicy {
    /// Delay before retry number `n` (1-based), honouring a server-sent `Retry-After`.
    pub fn delay(&self, n: u32, retry_after: Option<Duration>) -> Duration {
        if let Some(ra) = retry_after {
            return ra.min(self.max);
        }
        let exp = self
            .base
            .saturating_mul(1u32 << (n.saturating_sub(1)).min(16));
        // Up to 25% jitter so a fleet of workers does not retry in lockstep.
        let jitter = exp.mul_f64(rand::random::<f64>() * 0.25);
        (exp + jitter).min(self.max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_use_the_openai_wire_format() {
        let m = Message::Assistant {
            content: None,
            tool_calls: vec![ToolCall {
                id: "c1".into(),
                kind: "function".into(),
                function: FunctionCall {
                    name: "echo".into(),
                    arguments: "{}".into(),
                },
            }],
            thinking: vec![],
        };
        let v = serde_json::to_value(&m).unwrap();
        assert_eq!(v["role"], "assistant");
        assert_eq!(v["tool_calls"][0]["type"], "function");
        assert_eq!(serde_json::from_value::<Message>(v).unwrap(), m);
        let t: Message =
            serde_json::from_str(r#"{"role":"tool","tool_call_id":"c1","content":"x"}"#).unwrap();
        assert_eq!(t.role(), "tool");
    }

    #[test]
    fn retry_after_wins_and_is_capped() {
        let p = RetryPolicy::default();
        assert_eq!(
            p.delay(1, Some(Duration::from_secs(2))),
            Duration::from_secs(2)
        );
        assert_eq!(p.delay(1, Some(Duration::from_secs(999))), p.max);
        assert!(p.delay(3, None) >= Duration::from_millis(800));
    }

    #[test]
    fn context_length_refusals_are_recognised() {
        let openai = r#"{"error":{"message":"This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 tokens.","type":"invalid_request_error","param":"messages","code":"context_length_exceeded"}}"#;
        assert!(is_context_length_error(400, openai));
        assert!(is_context_length_error(413, "Payload Too Large"));
        assert!(is_context_length_error(
            400,
            r#"{"error":"the prompt is too long: 300000 tokens > 200000 maximum"}"#
        ));
        assert!(!is_context_length_error(
            400,
            r#"{"error":{"message":"invalid tool schema"}}"#
        ));
        assert!(!is_context_length_error(500, openai));
    }
}
