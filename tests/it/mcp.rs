//! MCP servers nobody here wrote, from the npm registry (`.ci/run` installs them; this module
//! installs them itself when missing): their tools called by a scripted run over stdio and over
//! streamable HTTP, a server killed mid-run and started again, a server that never answers.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use subagents::app::StartRun;
use subagents::model::mock::{Script, Turn};
use subagents::store::{RunRecord, RunStatus};

use crate::delegation::{call, calls, say};
use crate::support::*;

const PACKAGES: &[&str] = &[
    "@modelcontextprotocol/server-everything@2026.8.31",
    "@modelcontextprotocol/server-filesystem@2026.8.31",
    "@modelcontextprotocol/sdk@1.32.2",
    "standardwebhooks@1.3.0",
];
static INSTALL: Mutex<()> = Mutex::new(());

/// Where the reference servers are installed (`SUBAGENTS_TEST_MCP_DIR`, else `target/mcp-servers`).
pub(crate) fn servers_dir() -> PathBuf {
    let dir = std::env::var("SUBAGENTS_TEST_MCP_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| Path::new(env!("CARGO_MANIFEST_DIR")).join("target/mcp-servers"));
    let _guard = INSTALL.lock().unwrap_or_else(|e| e.into_inner());
    let sdk = dir.join("node_modules/@modelcontextprotocol/sdk/dist/esm/client/index.js");
    if !entry(&dir, "server-everything").exists()
        || !entry(&dir, "server-filesystem").exists()
        || !sdk.exists()
        || !dir
            .join("node_modules/standardwebhooks/package.json")
            .exists()
    {
        std::fs::create_dir_all(&dir).unwrap();
        let ok = std::process::Command::new("npm")
            .args(["install", "--no-audit", "--no-fund", "--prefix"])
            .arg(&dir)
            .args(PACKAGES)
            .status()
            .unwrap_or_else(|e| panic!("the MCP tests need npm (and node) to install {PACKAGES:?}: {e}; .ci/run installs them"));
        assert!(ok.success(), "npm install {PACKAGES:?} failed");
    }
    dir
}

fn entry(dir: &Path, package: &str) -> PathBuf {
    dir.join("node_modules/@modelcontextprotocol")
        .join(package)
        .join("dist/index.js")
}

fn agent(name: &str, tools: &str) -> (String, String) {
    (
        name.to_owned(),
        format!(
            "---\nname: {name}\ndescription: uses MCP tools\ntools: [{tools}]\n---\nYou use MCP tools. MOCK:{name}\n"
        ),
    )
}

async fn app(
    mcp: Value,
    jobs: Vec<(String, String)>,
    script: Vec<Turn>,
    latency: Duration,
    timeout: f64,
) -> TestApp {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join(".mcp.json");
    std::fs::write(&config, json!({"mcpServers": mcp}).to_string()).unwrap();
    let name = jobs[0].0.clone();
    let t = spawn_app_with(Options {
        jobs,
        latency,
        tweak: Box::new(move |s| {
            s.mcp_config = config;
            s.mcp_timeout_secs = timeout;
            s.tool_timeout_secs = 5.0;
            let _ = dir.keep();
        }),
        ..Default::default()
    })
    .await;
    t.mock.state.set_script(Script::from([(name, script)]));
    t
}

async fn run(t: &TestApp, agent: &str) -> RunRecord {
    let r = t
        .app
        .start_run(StartRun {
            agent: Some(agent.into()),
            input: "Use the tools.".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let done = t
        .app
        .wait(r.id, Duration::from_secs(120))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
    done
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_calls_real_mcp_servers_over_stdio() {
    let dir = servers_dir();
    let t_dir = tempfile::tempdir().unwrap();
    std::fs::write(t_dir.path().join("notes.txt"), "MCP works").unwrap();
    let mcp = json!({
        "everything": {"command": "node", "args": [entry(&dir, "server-everything")]},
        "files": {"command": "node", "args": [entry(&dir, "server-filesystem"), t_dir.path()]},
    });
    let script = vec![
        calls(vec![
            call(
                "mcp__everything__echo",
                json!({"message": "hello over stdio"}),
            ),
            call("mcp__everything__get-sum", json!({"a": 2, "b": 40})),
        ]),
        calls(vec![call(
            "mcp__files__read_text_file",
            json!({"path": t_dir.path().join("notes.txt")}),
        )]),
        calls(vec![call("mcp__everything__get-tiny-image", json!({}))]),
        calls(vec![call(
            "mcp__files__list_directory",
            json!({"path": t_dir.path()}),
        )]),
        say("done"),
    ];
    let t = app(
        mcp,
        vec![agent(
            "mcper",
            "mcp__everything, mcp__files__read_text_file",
        )],
        script,
        Duration::ZERO,
        60.0,
    )
    .await;
    let done = run(&t, "mcper").await;
    let res = tool_texts(&t, &done).await;
    assert_eq!(res[0], "Echo: hello over stdio");
    assert!(res[1].contains("42"), "{res:?}");
    assert_eq!(res[2], "MCP works");
    assert!(
        res[3].contains("[image image/png"),
        "images are summarised: {}",
        res[3]
    );
    // Of `files` it gets only the tool it named (all of `everything`'s).
    assert!(
        res[4].starts_with("error[unknown_tool]: `mcp__files__list_directory` is not available"),
        "{}",
        res[4]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_calls_a_real_mcp_server_over_streamable_http() {
    let dir = servers_dir();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut server = Reaped(
        std::process::Command::new("node")
            .arg(entry(&dir, "server-everything"))
            .arg("streamableHttp")
            .env("PORT", port.to_string())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "the HTTP server did not start");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mcp = json!({"remote": {"type": "http", "url": format!("http://127.0.0.1:{port}/mcp")}});
    let script = vec![
        calls(vec![call(
            "mcp__remote__echo",
            json!({"message": "hello over http"}),
        )]),
        say("done"),
    ];
    let t = app(
        mcp,
        vec![agent("http-user", "mcp__remote")],
        script,
        Duration::ZERO,
        30.0,
    )
    .await;
    let done = run(&t, "http-user").await;
    assert_eq!(tool_texts(&t, &done).await, ["Echo: hello over http"]);
    server.kill().unwrap();
    server.wait().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_mid_run_is_started_again_and_the_run_goes_on() {
    let dir = servers_dir();
    let pids = tempfile::tempdir().unwrap();
    let pidfile = pids.path().join("pid");
    // A wrapper that records the server's pid, so the test can kill exactly it.
    let command = format!(
        "echo $$ > {}; exec node {}",
        pidfile.display(),
        entry(&dir, "server-everything").display()
    );
    let mcp = json!({"everything": {"command": "bash", "args": ["-c", command]}});
    let script = vec![
        calls(vec![call(
            "mcp__everything__echo",
            json!({"message": "before"}),
        )]),
        calls(vec![call(
            "mcp__everything__echo",
            json!({"message": "after"}),
        )]),
        say("done"),
    ];
    let t = app(
        mcp,
        vec![agent("survivor", "mcp__everything")],
        script,
        Duration::from_millis(700),
        60.0,
    )
    .await;
    let r = t
        .app
        .start_run(StartRun {
            agent: Some("survivor".into()),
            input: "Use the tools.".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    // After the first result is committed, kill the server before the second call.
    let deadline = Instant::now() + Duration::from_secs(60);
    while tool_texts(&t, &r).await.is_empty() {
        assert!(Instant::now() < deadline, "the first call never finished");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let first_pid = std::fs::read_to_string(&pidfile).unwrap().trim().to_owned();
    assert!(
        std::process::Command::new("kill")
            .args(["-9", &first_pid])
            .status()
            .unwrap()
            .success()
    );
    let done = t
        .app
        .wait(r.id, Duration::from_secs(120))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
    assert_eq!(tool_texts(&t, &done).await, ["Echo: before", "Echo: after"]);
    let second_pid = std::fs::read_to_string(&pidfile).unwrap().trim().to_owned();
    assert_ne!(
        first_pid, second_pid,
        "a new server process answered the second call"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_never_answers_or_a_call_that_hangs_gives_a_clear_tool_error() {
    let dir = servers_dir();
    let mcp = json!({
        "silent": {"command": "sleep", "args": ["60"]},
        "everything": {"command": "node", "args": [entry(&dir, "server-everything")]},
    });
    let script = vec![
        calls(vec![call("mcp__silent__lookup", json!({"q": "x"}))]),
        calls(vec![call(
            "mcp__everything__trigger-long-running-operation",
            json!({"duration": 30, "steps": 3}),
        )]),
        say("done anyway"),
    ];
    // The start timeout covers the real server's start too: node takes over a second to
    // answer its handshake when the whole suite loads the two cores (seen once), so 5 s.
    let t = app(
        mcp,
        vec![agent("patient", "mcp__silent__lookup, mcp__everything")],
        script,
        Duration::ZERO,
        5.0,
    )
    .await;
    let t0 = Instant::now();
    let done = run(&t, "patient").await;
    assert_eq!(done.result.as_deref(), Some("done anyway"));
    let res = tool_texts(&t, &done).await;
    assert!(
        res[0].contains("mcp_unavailable")
            && res[0].contains("silent")
            && res[0].contains("did not answer within 5s"),
        "{res:?}"
    );
    assert!(res[1].starts_with("error[tool_timeout]"), "{res:?}");
    assert!(t0.elapsed() < Duration::from_secs(60));
}

/// A stdio server written here with the official TypeScript SDK: its `whoami` tool answers with
/// its process id and the names of the variables it was started with.
fn probe_server(dir: &Path) -> PathBuf {
    let sdk = servers_dir().join("node_modules/@modelcontextprotocol/sdk/dist/esm/server");
    let script = dir.join("probe.mjs");
    std::fs::write(
        &script,
        format!(
            r#"import {{ McpServer }} from "{sdk}/mcp.js";
import {{ StdioServerTransport }} from "{sdk}/stdio.js";
const server = new McpServer({{ name: "probe", version: "1.0.0" }});
server.tool("whoami", async () => ({{ content: [{{ type: "text", text: JSON.stringify({{ pid: process.pid, env: Object.keys(process.env).sort() }}) }}] }}));
await server.connect(new StdioServerTransport());
"#,
            sdk = sdk.display()
        ),
    )
    .unwrap();
    script
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stdio_server_is_one_process_per_owner_and_gets_no_worker_secrets() {
    let dir = tempfile::tempdir().unwrap();
    let script = probe_server(dir.path());
    let agent = (
        "prober".to_owned(),
        "---\nname: prober\ndescription: asks who serves it\ntools: [mcp__probe__whoami]\n---\nMOCK:prober\n".to_owned(),
    );
    let t = app(
        json!({"probe": {"command": "node", "args": [script], "env": {"DECLARED": "yes"}}}),
        vec![agent],
        vec![
            calls(vec![call("mcp__probe__whoami", json!({}))]),
            say("done"),
        ],
        Duration::ZERO,
        30.0,
    )
    .await;
    let mut seen = vec![];
    for owner in ["alice", "bob", "alice"] {
        let r = t
            .app
            .start_run(StartRun {
                agent: Some("prober".into()),
                input: "Who?".into(),
                owner: Some(owner.into()),
                ..Default::default()
            })
            .await
            .unwrap();
        let done = t.wait(r.id).await;
        assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
        let v: Value = serde_json::from_str(&tool_texts(&t, &done).await[0]).unwrap();
        seen.push(v);
    }
    assert_ne!(
        seen[0]["pid"], seen[1]["pid"],
        "alice's and bob's runs share a server process"
    );
    assert_eq!(
        seen[0]["pid"], seen[2]["pid"],
        "an owner's runs reuse its process"
    );
    for name in seen[0]["env"].as_array().unwrap() {
        let name = name.as_str().unwrap();
        assert!(
            subagents::procs::INHERITED.contains(&name) || name == "DECLARED",
            "the server got `{name}` from the worker's environment"
        );
    }
}

/// A stdio server written here with the official TypeScript SDK whose tools are the names in
/// the JSON list at `tools`, read when it starts; each answers `<name> answered`.
fn shifting_server(dir: &Path, tools: &Path) -> PathBuf {
    let sdk = servers_dir().join("node_modules/@modelcontextprotocol/sdk/dist/esm/server");
    let script = dir.join("shifting.mjs");
    std::fs::write(
        &script,
        format!(
            r#"import {{ McpServer }} from "{sdk}/mcp.js";
import {{ StdioServerTransport }} from "{sdk}/stdio.js";
import {{ readFileSync }} from "node:fs";
const server = new McpServer({{ name: "shifting", version: "1.0.0" }});
for (const name of JSON.parse(readFileSync("{tools}", "utf8"))) {{
  server.tool(name, `the ${{name}} tool`, async () => ({{ content: [{{ type: "text", text: `${{name}} answered` }}] }}));
}}
await server.connect(new StdioServerTransport());
"#,
            sdk = sdk.display(),
            tools = tools.display()
        ),
    )
    .unwrap();
    script
}

/// The tools offered in the model requests of the run whose input is `input`.
fn offered(t: &TestApp, input: &str) -> Vec<Vec<String>> {
    t.mock
        .state
        .log()
        .into_iter()
        .filter(|e| e.status == 200 && e.user_texts.first().map(String::as_str) == Some(input))
        .map(|e| e.tools)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_keeps_its_mcp_menu_when_the_server_changes_its_tools() {
    let dir = tempfile::tempdir().unwrap();
    let tools = dir.path().join("tools.json");
    std::fs::write(&tools, r#"["alpha", "beta"]"#).unwrap();
    let script = shifting_server(dir.path(), &tools);
    let pidfile = dir.path().join("pid");
    let command = format!(
        "echo $$ > {}; exec node {}",
        pidfile.display(),
        script.display()
    );
    let mcp = json!({"shift": {"command": "bash", "args": ["-c", command]}});
    let turns = vec![
        calls(vec![call(
            "task",
            json!({"description": "Slow child.\nSCENARIO steps=3 latency_ms=1500 run=menu-kid", "subagent": "general-purpose"}),
        )]),
        calls(vec![
            call("mcp__shift__alpha", json!({})),
            call("mcp__shift__beta", json!({})),
        ]),
        say("done"),
    ];
    let t = app(
        mcp,
        vec![agent("shifter", "mcp__shift, Task")],
        turns,
        Duration::ZERO,
        30.0,
    )
    .await;
    let start = |input: &str| StartRun {
        agent: Some("shifter".into()),
        input: input.into(),
        ..Default::default()
    };
    let first = t.app.start_run(start("FIRST")).await.unwrap();
    let t0 = Instant::now();
    while t.app.store.get_run(first.id).await.unwrap().unwrap().status != RunStatus::Waiting {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the run parks on its child"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // While it is parked, the server changes its tools: alpha goes, gamma comes.
    std::fs::write(&tools, r#"["beta", "gamma"]"#).unwrap();
    let pid = std::fs::read_to_string(&pidfile).unwrap().trim().to_owned();
    assert!(
        std::process::Command::new("kill")
            .args(["-9", &pid])
            .status()
            .unwrap()
            .success()
    );
    assert_eq!(
        t.app.store.get_run(first.id).await.unwrap().unwrap().status,
        RunStatus::Waiting,
        "the server changed before the run woke (the child is slow enough)"
    );

    let done = t
        .app
        .wait(first.id, Duration::from_secs(120))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
    let menus = offered(&t, "FIRST");
    assert_eq!(menus.len(), 3, "{menus:?}");
    for menu in &menus {
        assert!(
            menu.contains(&"mcp__shift__alpha".to_owned())
                && menu.contains(&"mcp__shift__beta".to_owned())
                && !menu.contains(&"mcp__shift__gamma".to_owned()),
            "every request of the run offers the menu it started with: {menu:?}"
        );
    }
    let results = tool_texts(&t, &done).await;
    assert_eq!(results.len(), 3, "{results:?}");
    assert!(
        results[1].starts_with("error[tool_unavailable]") && results[1].contains("alpha"),
        "{results:?}"
    );
    assert_eq!(results[2], "beta answered");
    assert_ne!(
        std::fs::read_to_string(&pidfile).unwrap().trim(),
        pid,
        "a new server process answered"
    );

    // A new run takes the server's list as it is now.
    let second = t.app.start_run(start("SECOND")).await.unwrap();
    t.app
        .wait(second.id, Duration::from_secs(120))
        .await
        .unwrap()
        .unwrap();
    let menu = &offered(&t, "SECOND")[0];
    assert!(
        menu.contains(&"mcp__shift__gamma".to_owned())
            && !menu.contains(&"mcp__shift__alpha".to_owned()),
        "{menu:?}"
    );
}
