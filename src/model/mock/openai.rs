//! The mock's reading of a Chat Completions request, strict where OpenAI is: from its own
//! description of the wire format, not the product's types. Unknown parameters, a missing
//! `model`, unknown message fields, tool calls without their results (or results without their
//! call) are refused with OpenAI's 400 `invalid_request_error`.
//!
//! The prompt's tokens are counted here too, from the wire JSON with the model's tiktoken
//! encoding and OpenAI's published per-message recipe (3 tokens a message and 3 to prime the
//! reply; 3 a tool call; 12 for the tool list and 8 a tool), not with the product's counter:
//! what the product sends is what is counted.

use serde::Deserialize;
use serde_json::{Map, Value};

use super::CompletionRequest;
use crate::model::tokens::Counter;
use crate::model::{FunctionCall, FunctionSpec, Message, ToolCall, ToolSpec};

/// The request's top level: every parameter Chat Completions has; any other is refused.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)] // sampling and bookkeeping parameters are accepted, not acted on
struct Wire {
    model: String,
    messages: Vec<Value>,
    #[serde(default)]
    tools: Option<Vec<Value>>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    parallel_tool_calls: Option<bool>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    response_format: Option<Value>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_p: Option<f64>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    #[serde(default)]
    n: Option<u32>,
    #[serde(default)]
    stop: Option<Value>,
    #[serde(default)]
    seed: Option<i64>,
    #[serde(default)]
    user: Option<String>,
    #[serde(default)]
    metadata: Option<Value>,
    #[serde(default)]
    store: Option<bool>,
    #[serde(default)]
    reasoning_effort: Option<String>,
    #[serde(default)]
    service_tier: Option<String>,
    #[serde(default)]
    presence_penalty: Option<f64>,
    #[serde(default)]
    frequency_penalty: Option<f64>,
    #[serde(default)]
    logit_bias: Option<Value>,
    #[serde(default)]
    logprobs: Option<bool>,
    #[serde(default)]
    top_logprobs: Option<u32>,
    #[serde(default)]
    prompt_cache_key: Option<String>,
    #[serde(default)]
    safety_identifier: Option<String>,
    #[serde(default)]
    verbosity: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
    #[serde(default)]
    #[allow(dead_code)]
    include_obfuscation: Option<bool>,
}

/// A request that passed every check, whether a stream should end with usage, and its
/// prompt's tokens as the mock counts them.
pub(super) struct Parsed {
    pub request: CompletionRequest,
    pub include_usage: bool,
    pub prompt_tokens: u64,
}

/// The tiktoken encoding OpenAI uses for `model`: `cl100k_base` for GPT-4 and GPT-3.5, else
/// `o200k_base` (GPT-4o, 4.1, 5, the o-series, and whatever the mock is asked to be).
fn encoding(model: &str) -> Counter {
    let m = model.rsplit('/').next().unwrap_or(model);
    Counter::encoding(
        (m.starts_with("gpt-4") && !m.starts_with("gpt-4o") && !m.starts_with("gpt-4.1"))
            || m.starts_with("gpt-3.5"),
    )
}

/// Tokens of a message as it came on the wire. Every text is looked up after its first count
/// ([`Counter::remembered`]): a run sends its whole conversation again at every step.
fn message_tokens(bpe: Counter, o: &Map<String, Value>, text: &str) -> usize {
    let count = |s: &str| bpe.remembered(s);
    let role = o.get("role").and_then(Value::as_str).unwrap_or("");
    let mut n = 3 + count(role) + count(text);
    for c in o
        .get("tool_calls")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let f = &c["function"];
        n += 3
            + count(f["name"].as_str().unwrap_or(""))
            + count(f["arguments"].as_str().unwrap_or(""))
            + count(c["id"].as_str().unwrap_or(""));
    }
    n
}

/// Tokens of the tool list as it came on the wire.
fn tools_tokens(bpe: Counter, tools: &[Value]) -> usize {
    if tools.is_empty() {
        return 0;
    }
    let count = |s: &str| bpe.remembered(s);
    12 + tools
        .iter()
        .map(|t| {
            let f = &t["function"];
            8 + count(f["name"].as_str().unwrap_or(""))
                + count(f["description"].as_str().unwrap_or(""))
                + f.get("parameters").map_or(2, |p| count(&p.to_string()))
        })
        .sum::<usize>()
}

fn only(o: &Map<String, Value>, allowed: &[&str], at: &str) -> Result<(), String> {
    match o.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(k) => Err(format!("Unrecognized parameter: '{at}.{k}'")),
        None => Ok(()),
    }
}

/// A message's content: a string, or text parts joined (other parts are accepted, not read).
fn content(v: Option<&Value>, at: &str, nullable: bool) -> Result<Option<String>, String> {
    match v {
        None | Some(Value::Null) if nullable => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (i, p) in parts.iter().enumerate() {
                let pat = format!("{at}.content[{i}]");
                let o = p
                    .as_object()
                    .ok_or_else(|| format!("Invalid type for '{pat}': expected an object"))?;
                if o.get("type").and_then(Value::as_str) == Some("text") {
                    only(o, &["type", "text"], &pat)?;
                    text.push_str(o.get("text").and_then(Value::as_str).unwrap_or(""));
                }
            }
            Ok(Some(text))
        }
        _ => Err(format!(
            "Invalid type for '{at}.content': expected a string or an array of parts"
        )),
    }
}

pub(super) fn parse(body: &[u8]) -> Result<Parsed, String> {
    let w: Wire = serde_json::from_slice(body).map_err(|e| {
        let e = e.to_string();
        match e.strip_prefix("unknown field `") {
            Some(rest) => format!(
                "Unrecognized request argument supplied: {}",
                rest.split('`').next().unwrap_or("")
            ),
            None => e,
        }
    })?;
    if w.model.is_empty() {
        return Err("you must provide a model parameter".into());
    }
    if w.messages.is_empty() {
        return Err("Invalid 'messages': empty array. Expected an array with minimum length 1, but got an empty array instead.".into());
    }
    let mut tools = vec![];
    for (i, t) in w.tools.iter().flatten().enumerate() {
        let at = format!("tools[{i}]");
        let o = t
            .as_object()
            .ok_or_else(|| format!("Invalid type for '{at}': expected an object"))?;
        only(o, &["type", "function"], &at)?;
        if o.get("type").and_then(Value::as_str) != Some("function") {
            return Err(format!(
                "Invalid value for '{at}.type': expected 'function'"
            ));
        }
        let f = o
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| format!("Missing required parameter: '{at}.function'"))?;
        only(
            f,
            &["name", "description", "parameters", "strict"],
            &format!("{at}.function"),
        )?;
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| {
                (1..=64).contains(&n.len())
                    && n.chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
            })
            .ok_or_else(|| {
                format!("Invalid '{at}.function.name': string does not match pattern. Expected a string that matches the pattern '^[a-zA-Z0-9_-]{{1,64}}$'.")
            })?;
        tools.push(ToolSpec {
            kind: "function".into(),
            function: FunctionSpec {
                name: name.to_owned(),
                description: f
                    .get("description")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_owned(),
                parameters: f
                    .get("parameters")
                    .cloned()
                    .unwrap_or(Value::Object(Map::new())),
            },
        });
    }
    let bpe = encoding(&w.model);
    let mut tokens = 3 + tools_tokens(bpe, w.tools.as_deref().unwrap_or(&[]));
    let mut messages = vec![];
    // The calls of the latest assistant turn still waiting for their results.
    let mut pending: Vec<String> = vec![];
    for (i, m) in w.messages.iter().enumerate() {
        let at = format!("messages[{i}]");
        let o = m
            .as_object()
            .ok_or_else(|| format!("Invalid type for '{at}': expected an object"))?;
        let role = o.get("role").and_then(Value::as_str).unwrap_or("");
        if role != "tool" && !pending.is_empty() {
            return Err(format!(
                "An assistant message with 'tool_calls' must be followed by tool messages responding to each 'tool_call_id'. The following tool_call_ids did not have response messages: {}",
                pending.join(", ")
            ));
        }
        match role {
            "system" | "developer" => {
                only(o, &["role", "content", "name"], &at)?;
                messages.push(Message::System {
                    content: content(o.get("content"), &at, false)?.unwrap_or_default(),
                });
            }
            "user" => {
                only(o, &["role", "content", "name"], &at)?;
                messages.push(Message::User {
                    content: content(o.get("content"), &at, false)?.unwrap_or_default(),
                });
            }
            "assistant" => {
                only(
                    o,
                    &["role", "content", "tool_calls", "name", "refusal", "audio"],
                    &at,
                )?;
                let text = content(o.get("content"), &at, true)?;
                let mut calls = vec![];
                for (j, c) in o
                    .get("tool_calls")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .enumerate()
                {
                    let cat = format!("{at}.tool_calls[{j}]");
                    let co = c
                        .as_object()
                        .ok_or_else(|| format!("Invalid type for '{cat}': expected an object"))?;
                    only(co, &["id", "type", "function"], &cat)?;
                    let f = co
                        .get("function")
                        .and_then(Value::as_object)
                        .ok_or_else(|| format!("Missing required parameter: '{cat}.function'"))?;
                    only(f, &["name", "arguments"], &format!("{cat}.function"))?;
                    let id = co
                        .get("id")
                        .and_then(Value::as_str)
                        .ok_or_else(|| format!("Missing required parameter: '{cat}.id'"))?;
                    let arguments =
                        f.get("arguments").and_then(Value::as_str).ok_or_else(|| {
                            format!(
                                "Invalid type for '{cat}.function.arguments': expected a string"
                            )
                        })?;
                    pending.push(id.to_owned());
                    calls.push(ToolCall {
                        id: id.to_owned(),
                        kind: "function".into(),
                        function: FunctionCall {
                            name: f
                                .get("name")
                                .and_then(Value::as_str)
                                .unwrap_or("")
                                .to_owned(),
                            arguments: arguments.to_owned(),
                        },
                    });
                }
                if text.is_none() && calls.is_empty() {
                    return Err(format!(
                        "Invalid value for '{at}': an assistant message needs 'content' or 'tool_calls'"
                    ));
                }
                messages.push(Message::Assistant {
                    content: text,
                    tool_calls: calls,
                    thinking: vec![],
                });
            }
            "tool" => {
                only(o, &["role", "content", "tool_call_id"], &at)?;
                let id = o
                    .get("tool_call_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| format!("Missing required parameter: '{at}.tool_call_id'"))?;
                let Some(k) = pending.iter().position(|p| p == id) else {
                    return Err(format!(
                        "Invalid parameter: messages with role 'tool' must be a response to a preceeding message with 'tool_calls' ({at}, tool_call_id {id})."
                    ));
                };
                pending.remove(k);
                messages.push(Message::Tool {
                    tool_call_id: id.to_owned(),
                    content: content(o.get("content"), &at, false)?.unwrap_or_default(),
                });
            }
            other => {
                return Err(format!(
                    "Invalid value: '{other}'. Supported values are: 'system', 'assistant', 'user', 'tool', and 'developer' ({at}.role)."
                ));
            }
        }
        let text = content(o.get("content"), &at, true)?.unwrap_or_default();
        tokens += message_tokens(bpe, o, &text);
    }
    if !pending.is_empty() {
        return Err(format!(
            "An assistant message with 'tool_calls' must be followed by tool messages responding to each 'tool_call_id'. The following tool_call_ids did not have response messages: {}",
            pending.join(", ")
        ));
    }
    let stream = w.stream.unwrap_or(false);
    if w.stream_options.is_some() && !stream {
        return Err(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.".into(),
        );
    }
    Ok(Parsed {
        prompt_tokens: tokens as u64,
        include_usage: w
            .stream_options
            .and_then(|s| s.include_usage)
            .unwrap_or(false),
        request: CompletionRequest {
            model: w.model,
            messages,
            tools,
            stream,
            response_format: w.response_format,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn what_openai_refuses_the_mock_refuses() {
        let ok = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": true, "stream_options": {"include_usage": true}});
        let p = parse(ok.to_string().as_bytes()).unwrap();
        assert!(p.include_usage && p.request.stream);
        let call = json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "echo", "arguments": "{}"}}]});
        for (req, says) in [
            (
                json!({"messages": [{"role": "user", "content": "hi"}]}),
                "model",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tempreature": 1}),
                "Unrecognized request argument supplied: tempreature",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": "x"}, call.clone(), {"role": "user", "content": "y"}]}),
                "did not have response messages: c1",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": "x"}, call.clone()]}),
                "did not have response messages",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "c9", "content": "r"}]}),
                "preceeding message with 'tool_calls'",
            ),
            (
                json!({"model": "m", "messages": [{"role": "assistant", "content": "x", "thinking": []}]}),
                "Unrecognized parameter",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": true}}),
                "only allowed when 'stream'",
            ),
            (json!({"model": "m", "messages": []}), "empty array"),
        ] {
            let e = parse(req.to_string().as_bytes()).err().unwrap_or_default();
            assert!(e.contains(says), "{req}: {e}");
        }
        let answered = json!({"model": "m", "messages": [{"role": "user", "content": "x"}, call, {"role": "tool", "tool_call_id": "c1", "content": "r"}]});
        assert_eq!(
            parse(answered.to_string().as_bytes())
                .unwrap()
                .request
                .messages
                .len(),
            3
        );
    }
}
