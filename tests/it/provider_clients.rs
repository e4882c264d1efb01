//! The mock model checked by the providers' own official clients: the `anthropic` and `openai`
//! Python packages (pinned, in a virtualenv under `target/`) drive it, streaming and not, with
//! tool calls. What they accept and parse is what the real APIs send, so the mock cannot drift
//! from them unnoticed, and our clients are tested against it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use serde_json::Value;
use subagents::model::mock::{MockOptions, MockServer};

/// The official clients, pinned (also in scripts/test.sh).
const PACKAGES: [&str; 2] = ["anthropic==0.75.0", "openai==2.8.1"];
static INSTALL: Mutex<()> = Mutex::new(());

/// The virtualenv's python (`SUBAGENTS_TEST_PYCLIENTS`, else `target/pyclients`), created and
/// filled when missing.
fn python() -> PathBuf {
    let dir = std::env::var("SUBAGENTS_TEST_PYCLIENTS")
        .map(PathBuf::from)
        .unwrap_or_else(|_| Path::new(env!("CARGO_MANIFEST_DIR")).join("target/pyclients"));
    let py = dir.join("bin/python");
    let _guard = INSTALL.lock().unwrap_or_else(|e| e.into_inner());
    let ready = |py: &Path| {
        Command::new(py)
            .args(["-c", "import anthropic, openai"])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if !ready(&py) {
        let venv = Command::new("python3")
            .args(["-m", "venv"])
            .arg(&dir)
            .status()
            .unwrap_or_else(|e| {
                panic!("the provider-client tests need python3 with venv: {e}; .ci/run installs it")
            });
        assert!(venv.success(), "python3 -m venv {} failed", dir.display());
        let pip = Command::new(dir.join("bin/pip"))
            .args(["install", "--quiet", "--disable-pip-version-check"])
            .args(PACKAGES)
            .status()
            .unwrap();
        assert!(pip.success(), "pip install {PACKAGES:?} failed");
        assert!(ready(&py), "{PACKAGES:?} do not import after installing");
    }
    py
}

const SCRIPT: &str = r#"
import json, sys
import anthropic, openai

base = sys.argv[1]
out = {}

# Anthropic: tools, a cached system prompt, a whole message, then a stream.
a = anthropic.Anthropic(base_url=base, api_key="test-key", max_retries=0)
tools = [{"name": "echo", "description": "Echo the text.",
          "input_schema": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}]
system = [{"type": "text", "text": "You are the test's model. " * 300, "cache_control": {"type": "ephemeral"}}]
msgs = [{"role": "user", "content": "Go.\nSCENARIO steps=2 tool=echo run=py-anthropic"}]
m = a.messages.create(model="claude-sonnet-4-5", max_tokens=1024, system=system, tools=tools, messages=msgs)
use = [b for b in m.content if b.type == "tool_use"][0]
out["a_plain"] = {"stop": m.stop_reason, "tool": use.name, "input": use.input,
                  "write": m.usage.cache_creation_input_tokens, "read": m.usage.cache_read_input_tokens}
msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "echoed"}]}]
with a.messages.stream(model="claude-sonnet-4-5", max_tokens=1024, system=system, tools=tools, messages=msgs) as s:
    text = "".join(s.text_stream)
    final = s.get_final_message()
out["a_stream"] = {"text": text, "stop": final.stop_reason, "read": final.usage.cache_read_input_tokens}
with a.messages.stream(model="claude-sonnet-4-5", max_tokens=1024, tools=tools,
                       messages=[{"role": "user", "content": "Go.\nSCENARIO steps=2 tool=echo run=py-a2"}]) as s:
    final = s.get_final_message()
out["a_stream_tool"] = {"stop": final.stop_reason,
                        "input": [b.input for b in final.content if b.type == "tool_use"][0]}
try:
    a.messages.create(model="claude-sonnet-4-5", max_tokens=10,
                      messages=[{"role": "user", "content": [{"type": "text", "text": ""}]}])
    out["a_error"] = None
except anthropic.BadRequestError as e:
    out["a_error"] = e.body["error"]["type"]

# OpenAI: the same, through Chat Completions.
o = openai.OpenAI(base_url=base + "/v1", api_key="test-key", max_retries=0)
otools = [{"type": "function", "function": {"name": "echo", "description": "Echo the text.",
           "parameters": tools[0]["input_schema"]}}]
user = {"role": "user", "content": "Go.\nSCENARIO steps=2 tool=echo run=py-openai"}
r = o.chat.completions.create(model="gpt-4.1", messages=[user], tools=otools)
call = r.choices[0].message.tool_calls[0]
out["o_plain"] = {"finish": r.choices[0].finish_reason, "tool": call.function.name,
                  "args": json.loads(call.function.arguments), "prompt": r.usage.prompt_tokens}
msgs = [user, r.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "echoed"}]
text, usage, finish = "", None, None
for ch in o.chat.completions.create(model="gpt-4.1", messages=msgs, tools=otools, stream=True,
                                    stream_options={"include_usage": True}):
    if ch.usage:
        usage = ch.usage.prompt_tokens
    for c in ch.choices:
        text += c.delta.content or ""
        finish = c.finish_reason or finish
out["o_stream"] = {"text": text, "finish": finish, "usage": usage}
with o.chat.completions.stream(model="gpt-4.1", tools=otools,
                               messages=[{"role": "user", "content": "Go.\nSCENARIO steps=2 tool=echo run=py-o2"}]) as s:
    final = s.get_final_completion()
out["o_stream_tool"] = {"args": json.loads(final.choices[0].message.tool_calls[0].function.arguments)}
print(json.dumps(out))
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_clients_accept_what_the_mock_sends() {
    let py = tokio::task::spawn_blocking(python).await.unwrap();
    let mock = MockServer::start(([127, 0, 0, 1], 0).into(), MockOptions::default())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("clients.py");
    std::fs::write(&script, SCRIPT).unwrap();
    let base = format!("http://{}", mock.addr);
    let out = tokio::task::spawn_blocking(move || {
        Command::new(py).arg(script).arg(base).output().unwrap()
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the clients failed:\n{stderr}");
    let v: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));

    let a = &v["a_plain"];
    assert_eq!(a["stop"], "tool_use", "{v:#}");
    assert_eq!(a["tool"], "echo");
    assert_eq!(a["input"]["text"], "step 1 call 1");
    assert!(
        a["write"].as_u64().unwrap() >= 1024,
        "the system prompt was cached: {a}"
    );
    assert_eq!(a["read"], 0);
    let s = &v["a_stream"];
    assert_eq!(s["text"], "DONE after 2 steps");
    assert_eq!(s["stop"], "end_turn");
    assert!(
        s["read"].as_u64().unwrap() >= a["write"].as_u64().unwrap(),
        "the second request read what the first wrote: {v:#}"
    );
    assert_eq!(v["a_stream_tool"]["stop"], "tool_use");
    assert_eq!(v["a_stream_tool"]["input"]["text"], "step 1 call 1");
    assert_eq!(v["a_error"], "invalid_request_error");

    let o = &v["o_plain"];
    assert_eq!(o["finish"], "tool_calls");
    assert_eq!(o["args"]["text"], "step 1 call 1");
    assert!(o["prompt"].as_u64().unwrap() > 0);
    assert_eq!(v["o_stream"]["text"], "DONE after 2 steps");
    assert_eq!(v["o_stream"]["finish"], "stop");
    assert!(v["o_stream"]["usage"].as_u64().unwrap() > 0);
    assert_eq!(v["o_stream_tool"]["args"]["text"], "step 1 call 1");

    let log = mock.state.log();
    assert_eq!(
        log.iter().filter(|e| e.api == "anthropic").count(),
        3,
        "{log:#?}"
    );
    assert_eq!(log.iter().filter(|e| e.api == "openai").count(), 3);
}
