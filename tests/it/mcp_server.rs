//! `subagents mcp` driven by a real MCP client (rmcp's) over stdio: tools listed, a run started
//! with progress and its answer; the Tasks extension (a task back, `tasks/get`, `tasks/cancel`);
//! a worker SIGKILLed under a task; a task that exists once it is returned.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rmcp::ServiceExt;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CancelTaskParams, ClientCapabilities, ClientConfig,
    GetTaskParams, NumberOrString, ProgressNotificationParam, ProgressToken, RequestMetaObject,
    TaskStatus,
};
use rmcp::service::{NotificationContext, RoleClient, RunningService};
use serde_json::{Value, json};
use subagents::app::App;
use subagents::model::mock::{MockOptions, MockServer};
use subagents::store::RunStatus;

use crate::support::*;

/// A client that records progress notifications.
#[derive(Clone, Default)]
pub(crate) struct Recorder {
    progress: Arc<Mutex<Vec<String>>>,
    info: ClientConfig,
}

impl rmcp::ClientHandler for Recorder {
    async fn on_progress(
        &self,
        params: ProgressNotificationParam,
        _context: NotificationContext<RoleClient>,
    ) {
        self.progress
            .lock()
            .unwrap()
            .push(params.message.unwrap_or_default());
    }
    fn get_info(&self) -> ClientConfig {
        self.info.clone()
    }
}

fn with_tasks() -> ClientConfig {
    let mut info = ClientConfig::default();
    info.capabilities = serde_json::from_value::<ClientCapabilities>(
        json!({"extensions": {"io.modelcontextprotocol/tasks": {}}}),
    )
    .unwrap();
    info
}

struct Setup {
    dir: tempfile::TempDir,
    mock: MockServer,
    app: App,
}

async fn setup(latency_ms: u64) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("jobs")).unwrap();
    let mock = MockServer::start(
        ([127, 0, 0, 1], 0).into(),
        MockOptions {
            latency: Duration::from_millis(latency_ms),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let app = App::open(test_settings(dir.path(), &mock)).await.unwrap();
    Setup { dir, mock, app }
}

impl Setup {
    /// The environment of a `subagents` process on this setup's database and mock.
    fn env(&self, cmd: &mut tokio::process::Command) {
        cmd.env(
            "DATABASE_URL",
            format!("sqlite://{}", self.dir.path().join("test.db").display()),
        )
        .env("SUBAGENTS_JOBS_DIR", self.dir.path().join("jobs"))
        .env("SUBAGENTS_WORKSPACE", self.dir.path().join("workspace"))
        .env("OPENAI_BASE_URL", self.mock.base_url())
        .env("OPENAI_API_KEY", "x")
        .env("SUBAGENTS_MODEL", "mock-model")
        .env("SUBAGENTS_LEASE_TTL", "1.5")
        .env("SUBAGENTS_POLL_MS", "20")
        .env("RUST_LOG", "warn");
    }

    /// `subagents mcp` as a child process speaking MCP on stdio.
    async fn client(
        &self,
        handler: Recorder,
        workers: usize,
    ) -> RunningService<RoleClient, Recorder> {
        self.client_waiting(handler, workers, 30.0).await
    }

    async fn client_waiting(
        &self,
        handler: Recorder,
        workers: usize,
        wait_s: f64,
    ) -> RunningService<RoleClient, Recorder> {
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_subagents"));
        cmd.args([
            "mcp",
            "--workers",
            &workers.to_string(),
            "--wait-s",
            &wait_s.to_string(),
        ])
        .kill_on_drop(true);
        self.env(&mut cmd);
        let (transport, _) = rmcp::transport::TokioChildProcess::builder(cmd)
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .unwrap();
        handler.serve(transport).await.unwrap()
    }
}

pub(crate) fn call(name: &str, args: Value) -> CallToolRequestParams {
    let mut p = CallToolRequestParams::new(name.to_owned());
    p.arguments = args.as_object().cloned();
    p
}

pub(crate) fn text(v: &Value) -> String {
    v["content"][0]["text"].as_str().unwrap_or("").to_owned()
}

async fn task_until(
    client: &RunningService<RoleClient, Recorder>,
    id: &str,
    done: impl Fn(TaskStatus) -> bool,
) -> Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let t = client
            .get_task(GetTaskParams::new(id.to_owned()))
            .await
            .unwrap();
        if done(t.task.task.status) {
            return serde_json::to_value(&t).unwrap();
        }
        assert!(
            Instant::now() < deadline,
            "task {id} never got there: {t:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_lists_tools_starts_a_run_hears_progress_and_gets_the_answer() {
    let s = setup(100).await;
    let rec = Recorder::default();
    let client = s.client(rec.clone(), 2).await;
    let tools: Vec<String> = client
        .list_all_tools()
        .await
        .unwrap()
        .into_iter()
        .map(|t| t.name.to_string())
        .collect();
    for t in [
        "run_agent",
        "run_status",
        "run_wait",
        "run_events",
        "run_cancel",
        "run_message",
    ] {
        assert!(tools.contains(&t.to_owned()), "{tools:?}");
    }
    let mut params = call(
        "run_agent",
        json!({"agent": "general-purpose", "input": "SCENARIO steps=3 run=mcp1"}),
    );
    let mut meta = RequestMetaObject::default();
    meta.set_progress_token(ProgressToken(NumberOrString::Number(7)));
    params.meta = Some(meta);
    let result = serde_json::to_value(client.call_tool(params).await.unwrap()).unwrap();
    assert_eq!(text(&result), "DONE after 3 steps", "{result}");
    let progress = rec.progress.lock().unwrap().clone();
    assert!(
        progress.iter().any(|p| p.contains("model calls echo")),
        "progress notifications arrived: {progress:?}"
    );
    // The run is an ordinary durable run, followed by the other tools.
    let runs = s
        .app
        .store
        .list_runs(&"local".into(), &Default::default(), 10)
        .await
        .unwrap();
    assert_eq!(runs.len(), 1);
    let status = serde_json::to_value(
        client
            .call_tool(call("run_status", json!({"run_id": runs[0].id})))
            .await
            .unwrap(),
    )
    .unwrap();
    let snap: Value = serde_json::from_str(&text(&status)).unwrap();
    assert_eq!(
        (snap["status"].as_str(), snap["result"].as_str()),
        (Some("succeeded"), Some("DONE after 3 steps"))
    );
    let bad = serde_json::to_value(
        client
            .call_tool(call("run_status", json!({"run_id": "nope"})))
            .await
            .unwrap(),
    )
    .unwrap();
    assert_eq!(bad["isError"], true);
    // A run with an output schema answers data as structuredContent (an object; another
    // JSON value comes wrapped as {"result": …}).
    let structured = serde_json::to_value(
        client
            .call_tool(call(
                "run_agent",
                json!({"agent": "general-purpose", "input": "Count.", "output_schema": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 4}}, "required": ["n"]}}),
            ))
            .await
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        structured["structuredContent"],
        json!({"n": 4}),
        "{structured}"
    );
    let listed = serde_json::to_value(
        client
            .call_tool(call(
                "run_agent",
                json!({"agent": "general-purpose", "input": "List.", "output_schema": {"type": "array", "items": {"type": "boolean"}}}),
            ))
            .await
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        listed["structuredContent"],
        json!({"result": [true]}),
        "{listed}"
    );
    // The agents, as resources.
    let resources = client.list_all_resources().await.unwrap();
    let uris: Vec<String> = resources
        .iter()
        .map(|r| {
            serde_json::to_value(r).unwrap()["uri"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert!(
        uris.contains(&"agent://general-purpose".to_owned()),
        "{uris:?}"
    );
    let read = client
        .read_resource(rmcp::model::ReadResourceRequestParams::new(
            "agent://general-purpose",
        ))
        .await
        .unwrap();
    let read = serde_json::to_value(read).unwrap();
    assert!(
        read["contents"][0]["text"]
            .as_str()
            .unwrap()
            .starts_with("# general-purpose"),
        "{read}"
    );
    client.cancel().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_survives_a_killed_worker_and_completes() {
    let s = setup(200).await;
    // The MCP process only enqueues; a worker process executes.
    let rec = Recorder {
        info: with_tasks(),
        ..Default::default()
    };
    let client = s.client(rec.clone(), 0).await;
    let mut params = call(
        "run_agent",
        json!({"agent": "general-purpose", "input": "SCENARIO steps=6 run=mcptask"}),
    );
    let mut meta = RequestMetaObject::default();
    meta.set_progress_token(ProgressToken(NumberOrString::Number(9)));
    params.meta = Some(meta);
    let response = client.call_tool_once(params).await.unwrap();
    let CallToolResponse::Task(created) = response else {
        panic!("a tasks client gets a task: {response:?}")
    };
    let id = created.task.task_id.clone();
    // Committed before it was returned.
    let run = s
        .app
        .store
        .get_run(id.parse().unwrap())
        .await
        .unwrap()
        .expect("the run exists once the task is returned");
    assert_eq!(run.agent, "general-purpose");
    let mut worker = spawn_worker(s.dir.path(), &s.mock, &[]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while s.app.store.get_run(run.id).await.unwrap().unwrap().step < 2 {
        assert!(Instant::now() < deadline, "the worker made no progress");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let working = task_until(&client, &id, |st| st == TaskStatus::Working).await;
    assert_eq!(working["status"], "working");
    worker.kill().unwrap();
    worker.wait().unwrap();
    let mut second = spawn_worker(s.dir.path(), &s.mock, &[]);
    let done = task_until(&client, &id, |st| st != TaskStatus::Working).await;
    second.kill().unwrap();
    second.wait().unwrap();
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(
        done["result"]["content"][0]["text"], "DONE after 6 steps",
        "{done}"
    );
    let progress = rec.progress.lock().unwrap().clone();
    assert!(
        progress.iter().any(|p| p.contains("model calls echo")),
        "a task's progress reaches its client: {progress:?}"
    );
    let r = s.app.store.get_run(run.id).await.unwrap().unwrap();
    assert_eq!((r.status, r.attempts), (RunStatus::Succeeded, 2));
    client.cancel().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_is_cancelled_and_a_killed_server_leaves_its_task_behind() {
    let s = setup(300).await;
    let client = s
        .client(
            Recorder {
                info: with_tasks(),
                ..Default::default()
            },
            1,
        )
        .await;
    let CallToolResponse::Task(created) = client
        .call_tool_once(call(
            "run_agent",
            json!({"agent": "general-purpose", "input": "SCENARIO steps=50 run=long"}),
        ))
        .await
        .unwrap()
    else {
        panic!("expected a task")
    };
    let id = created.task.task_id.clone();
    client
        .cancel_task(CancelTaskParams::new(id.clone()))
        .await
        .unwrap();
    let t = task_until(&client, &id, |st| st != TaskStatus::Working).await;
    assert_eq!(t["status"], "cancelled");
    // Kill the server the moment it answered: the run it returned is already in the database.
    let CallToolResponse::Task(created) = client
        .call_tool_once(call(
            "run_agent",
            json!({"agent": "general-purpose", "input": "SCENARIO steps=2 run=orphan"}),
        ))
        .await
        .unwrap()
    else {
        panic!("expected a task")
    };
    drop(client); // kill_on_drop: the server process dies with its transport
    let kept = s
        .app
        .store
        .get_run(created.task.task_id.parse().unwrap())
        .await
        .unwrap();
    assert!(
        kept.is_some(),
        "the task outlives the server that returned it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_typescript_sdk_client_runs_an_agent() {
    let sdk =
        crate::mcp::servers_dir().join("node_modules/@modelcontextprotocol/sdk/dist/esm/client");
    let s = setup(50).await;
    let script = s.dir.path().join("client.mjs");
    std::fs::write(
        &script,
        format!(
            r#"import {{ Client }} from "{client}/index.js";
import {{ StdioClientTransport }} from "{client}/stdio.js";
const transport = new StdioClientTransport({{ command: process.env.SUBAGENTS_BIN, args: ["mcp", "--workers", "2"], env: process.env, stderr: "inherit" }});
const client = new Client({{ name: "sdk-test", version: "1.0.0" }});
await client.connect(transport);
const tools = await client.listTools();
const progress = [];
const result = await client.callTool({{ name: "run_agent", arguments: {{ agent: "general-purpose", input: "SCENARIO steps=3 run=sdk" }} }}, undefined, {{ onprogress: (p) => progress.push(p.message) }});
console.log(JSON.stringify({{ tools: tools.tools.map((t) => t.name), text: result.content[0].text, progress }}));
await client.close();
"#,
            client = sdk.display()
        ),
    )
    .unwrap();
    let mut node = tokio::process::Command::new("node");
    node.arg(&script)
        .env("SUBAGENTS_BIN", env!("CARGO_BIN_EXE_subagents"));
    s.env(&mut node);
    let out = node.output().await.unwrap();
    assert!(
        out.status.success(),
        "node client failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(out.stdout.trim_ascii())
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));
    assert!(
        v["tools"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t == "run_agent"),
        "{v}"
    );
    assert_eq!(v["text"], "DONE after 3 steps", "{v}");
    assert!(
        !v["progress"].as_array().unwrap().is_empty(),
        "progress reached the SDK client: {v}"
    );
}

pub(crate) async fn http_client(
    base: &str,
    key: Option<&str>,
) -> Result<RunningService<RoleClient, Recorder>, String> {
    let mut config =
        rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig::with_uri(
            format!("{base}/mcp"),
        );
    if let Some(k) = key {
        config = config.auth_header(k.to_owned());
    }
    let transport =
        rmcp::transport::StreamableHttpClientTransport::with_client(reqwest::Client::new(), config);
    Recorder::default()
        .serve(transport)
        .await
        .map_err(|e| e.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_offers_the_same_over_streamable_http_behind_its_keys_and_owners() {
    let t = spawn_app().await;
    let base = t.serve("alice:alice-secret-key,bob:bob-secret-key").await;
    assert!(
        http_client(&base, None).await.is_err(),
        "no key, no MCP session"
    );
    assert!(http_client(&base, Some("wrong-key-123")).await.is_err());
    let alice = http_client(&base, Some("alice-secret-key")).await.unwrap();
    let result = serde_json::to_value(
        alice
            .call_tool(call(
                "run_agent",
                json!({"agent": "general-purpose", "input": "SCENARIO steps=2 run=http-mcp"}),
            ))
            .await
            .unwrap(),
    )
    .unwrap();
    assert_eq!(text(&result), "DONE after 2 steps", "{result}");
    let runs = t
        .app
        .store
        .list_runs(&"alice".into(), &Default::default(), 10)
        .await
        .unwrap();
    assert_eq!(runs.len(), 1, "the run belongs to alice");
    let bob = http_client(&base, Some("bob-secret-key")).await.unwrap();
    // Not one of the run tools tells bob that alice's run exists, or acts on it.
    for tool in [
        "run_status",
        "run_events",
        "run_wait",
        "run_cancel",
        "run_message",
    ] {
        let seen = serde_json::to_value(
            bob.call_tool(call(
                tool,
                json!({"run_id": runs[0].id, "run_ids": [runs[0].id], "timeout_s": 0, "content": "hi"}),
            ))
            .await
            .unwrap(),
        )
        .unwrap();
        assert_eq!(
            seen["isError"], true,
            "{tool}: bob cannot see alice's run: {seen}"
        );
        assert!(text(&seen).contains("there is no run"), "{tool}: {seen}");
    }
    alice.cancel().await.unwrap();
    bob.cancel().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_without_tasks_gets_the_run_id_when_the_run_takes_longer_than_it_waits() {
    let s = setup(300).await;
    let client = s.client_waiting(Recorder::default(), 1, 1.0).await;
    let t0 = Instant::now();
    let result = serde_json::to_value(
        client
            .call_tool(call(
                "run_agent",
                json!({"agent": "general-purpose", "input": "SCENARIO steps=8 run=slow"}),
            ))
            .await
            .unwrap(),
    )
    .unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "the call did not hang"
    );
    assert!(text(&result).contains("still working"), "{result}");
    let id = result["structuredContent"]["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    // The run goes on; run_wait collects it.
    let waited = serde_json::to_value(
        client
            .call_tool(call("run_wait", json!({"run_ids": [id], "timeout_s": 60})))
            .await
            .unwrap(),
    )
    .unwrap();
    let v: Value = serde_json::from_str(&text(&waited)).unwrap();
    assert_eq!(
        (
            v["wait_timed_out"].as_bool(),
            v["runs"][0]["result"].as_str()
        ),
        (Some(false), Some("DONE after 8 steps")),
        "{v}"
    );
    client.cancel().await.unwrap();
}
