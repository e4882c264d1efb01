//! Tools for real work, end to end through the queue: a scripted `researcher` greps the
//! workspace, reads the matching lines by offset, fetches a page from a local HTTP server and
//! answers; `web_fetch` refuses redirects to private addresses; Claude Code agent files keep
//! their meaning (effective tools, delegation, models).

use axum::response::{Html, Redirect};
use axum::routing::get;
use serde_json::json;
use subagents::agents::AgentRegistry;
use subagents::app::StartRun;
use subagents::model::mock::Script;
use subagents::store::RunStatus;
use subagents::tools::ToolRegistry;

use crate::delegation::{call, calls, say, tool_results};
use crate::support::*;

const PAGE: &str = "<!doctype html><html><head><title>Retry policy</title><style>p{color:red}</style></head>\
<body><h1>Retry policy</h1><p>Clients retry <b>three</b> times with exponential backoff.</p>\
<script>var hidden = 1;</script></body></html>";

/// A local site: a page, and a redirect to the cloud metadata address.
async fn site() -> String {
    let app = axum::Router::new()
        .route("/policy", get(|| async { Html(PAGE) }))
        .route("/hop", get(|| async { Redirect::temporary("/policy") }))
        .route("/sneaky", get(|| async { Redirect::temporary("http://169.254.169.254/latest/meta-data/") }))
        // A search backend answering SearXNG's JSON format.
        .route(
            "/search",
            get(|q: axum::extract::Query<std::collections::HashMap<String, String>>| async move {
                let query = q.get("q").cloned().unwrap_or_default();
                assert_eq!(q.get("format").map(String::as_str), Some("json"));
                let results: Vec<serde_json::Value> = (1..=30)
                    .map(|i| json!({"title": format!("Result {i} for {query}"), "url": format!("https://example.org/{i}"), "content": format!("snippet {i}")}))
                    .collect();
                axum::Json(json!({"query": query, "results": results}))
            }),
        )
        .route("/broken-search", get(|| async { (axum::http::StatusCode::BAD_GATEWAY, "upstream down") }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

/// The shipped `researcher`, with the mock's script marker added to its prompt.
fn scripted_researcher() -> (String, String) {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/jobs/researcher.md"))
        .unwrap();
    (
        "researcher".into(),
        format!("{}\nMOCK:researcher\n", text.trim_end()),
    )
}

#[tokio::test]
async fn a_researcher_greps_reads_by_offset_fetches_and_answers() {
    let base = site().await;
    let t = spawn_app_with(Options {
        jobs: vec![scripted_researcher()],
        tweak: Box::new(|s| s.fetch_allow = vec!["127.0.0.1".into()]),
        ..Default::default()
    })
    .await;
    let ws = t.dir.path().join("workspace/local");
    std::fs::create_dir_all(ws.join("src")).unwrap();
    std::fs::write(
        ws.join("src/client.rs"),
        "// HTTP client\nconst RETRIES: u32 = 3;\nfn backoff() {}\n",
    )
    .unwrap();
    std::fs::write(ws.join("README.md"), "See src/client.rs for RETRIES.\n").unwrap();
    t.mock.state.set_script(Script::from([(
        "researcher".to_owned(),
        vec![
            calls(vec![call(
                "grep",
                json!({"pattern": "RETRIES", "output_mode": "content"}),
            )]),
            calls(vec![call(
                "read_file",
                json!({"path": "src/client.rs", "offset": 2, "limit": 1}),
            )]),
            calls(vec![call(
                "web_fetch",
                json!({"url": format!("{base}/hop"), "prompt": "how many retries?"}),
            )]),
            say("Three retries with exponential backoff (src/client.rs:2; the policy page)."),
        ],
    )]));
    let run = t
        .app
        .start_run(StartRun {
            agent: Some("researcher".into()),
            input: "How often do clients retry?".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let done = t.wait(run.id).await;
    assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
    let results: Vec<String> = tool_results(&t, &run)
        .await
        .into_iter()
        .map(|v| v.as_str().map(str::to_owned).unwrap_or(v.to_string()))
        .collect();
    assert_eq!(
        results[0],
        "README.md:1:See src/client.rs for RETRIES.\nsrc/client.rs:2:const RETRIES: u32 = 3;\n[2 files matched]"
    );
    assert_eq!(
        results[1],
        "     2\tconst RETRIES: u32 = 3;\n[more lines follow: read_file with path=`src/client.rs` offset=3 reads on]"
    );
    let page = &results[2];
    assert!(
        page.starts_with(&format!("URL: {base}/policy\nStatus: 200")),
        "{page}"
    );
    assert!(
        page.contains("Clients retry")
            && page.contains("three")
            && page.contains("exponential backoff"),
        "{page}"
    );
    assert!(
        !page.contains("<p>") && !page.contains("var hidden") && !page.contains("color:red"),
        "readable text only: {page}"
    );
}

#[tokio::test]
async fn web_fetch_refuses_private_addresses_and_redirects_to_them() {
    let base = site().await;
    let ctx = subagents::tools::ToolCtx::new("/nonexistent", "k", 16_000);
    let allowed = ToolRegistry::with_settings(subagents::tools::ToolSettings {
        fetch: subagents::tools::FetchPolicy {
            allow_hosts: vec!["127.0.0.1".into()],
            ..Default::default()
        },
        ..Default::default()
    });
    let hop = allowed
        .execute(
            "web_fetch",
            &json!({"url": format!("{base}/sneaky")}).to_string(),
            &ctx,
        )
        .await
        .unwrap_err();
    assert_eq!(hop.code, "private_address", "{hop}");
    assert!(hop.message.contains("169.254.169.254"), "{hop}");
    // Without the operator's allowlist, the local server itself is out of reach.
    let default = ToolRegistry::builtin(None);
    let e = default
        .execute(
            "web_fetch",
            &json!({"url": format!("{base}/policy")}).to_string(),
            &ctx,
        )
        .await
        .unwrap_err();
    assert_eq!(e.code, "private_address");
}

/// Claude Code agent files, as collections write them, and what each agent really gets.
#[tokio::test]
async fn claude_code_agent_files_keep_their_meaning() {
    let dir = tempfile::tempdir().unwrap();
    let files = [
        (
            "code-reviewer",
            "---\nname: code-reviewer\ndescription: Reviews code\ntools: Read, Grep, Glob\nmodel: sonnet\ncolor: blue\n---\nReview.\n",
        ),
        (
            "fixer",
            "---\nname: fixer\ndescription: Fixes bugs\ntools: Read, Edit, MultiEdit, Write, Bash\nmodel: inherit\n---\nFix.\n",
        ),
        (
            "lead",
            "---\nname: lead\ndescription: Leads\ntools: Task(code-reviewer, fixer), WebFetch, TodoWrite, mcp__github__create_issue\nmodel: opus\n---\nLead.\n",
        ),
        (
            "open",
            "---\nname: open\ndescription: Everything\n---\nAll tools.\n",
        ),
    ];
    for (name, text) in files {
        std::fs::write(dir.path().join(format!("{name}.md")), text).unwrap();
    }
    let (reg, errors) = AgentRegistry::load_dir(dir.path());
    assert!(errors.is_empty(), "{errors:?}");
    let tools = ToolRegistry::builtin(None);
    let get = |n: &str| tools.resolve(reg.get(n).unwrap());
    assert_eq!(get("code-reviewer").tools, ["read_file", "grep", "glob"]);
    let fixer = get("fixer");
    assert_eq!(
        fixer.tools,
        ["read_file", "edit_file", "multi_edit", "write_file"],
        "Edit is an edit, not an overwrite"
    );
    assert_eq!(fixer.unavailable.len(), 1);
    assert!(
        fixer.unavailable[0].0 == "Bash" && fixer.unavailable[0].1.contains("SUBAGENTS_ALLOW_BASH"),
        "{:?}",
        fixer.unavailable
    );
    let lead = get("lead");
    assert_eq!(lead.tools, ["web_fetch", "todo_write"]);
    assert!(lead.unavailable.is_empty(), "{:?}", lead.unavailable);
    assert_eq!(
        lead.mcp,
        ["mcp__github__create_issue"],
        "MCP names are resolved against the configured servers at run time"
    );
    let settings = subagents::delegation::DelegationSettings::default();
    let lead_def = reg.get("lead").unwrap();
    assert!(
        subagents::delegation::offered(lead_def, 0, &settings),
        "Task(...) turns delegation on"
    );
    let to: Vec<&str> = subagents::delegation::allowed(lead_def, &reg)
        .iter()
        .map(|a| a.name.as_str())
        .collect();
    assert_eq!(to, ["code-reviewer", "fixer"]);
    assert!(!subagents::delegation::offered(
        reg.get("code-reviewer").unwrap(),
        0,
        &settings
    ));
    let open = get("open");
    assert!(
        open.tools.contains(&"grep".to_owned()) && !open.tools.contains(&"bash".to_owned()),
        "{:?}",
        open.tools
    );
    let with_bash = ToolRegistry::with_settings(subagents::tools::ToolSettings {
        allow_bash: true,
        ..Default::default()
    });
    assert!(
        with_bash
            .resolve(reg.get("fixer").unwrap())
            .tools
            .contains(&"bash".to_owned())
    );
}

/// `model: inherit` runs on the parent's model; Claude's names go through the alias map.
#[tokio::test]
async fn models_follow_aliases_and_inherit_through_delegation() {
    let parent =
        "---\nname: p-model\ndescription: parent\nmodel: sonnet\n---\nDelegate. MOCK:p-model\n";
    let child = "---\nname: c-inherit\ndescription: child\nmodel: inherit\ntools: Read\n---\nChild. MOCK:c-inherit\n";
    let t = spawn_app_with(Options {
        jobs: vec![
            ("p-model".into(), parent.into()),
            ("c-inherit".into(), child.into()),
        ],
        tweak: Box::new(|s| s.model_aliases = "sonnet=mock-large".into()),
        ..Default::default()
    })
    .await;
    t.mock.state.set_script(Script::from([
        (
            "p-model".to_owned(),
            vec![
                calls(vec![call(
                    "task",
                    json!({"description": "Do it.", "subagent": "c-inherit"}),
                )]),
                say("done"),
            ],
        ),
        ("c-inherit".to_owned(), vec![say("child done")]),
    ]));
    let run = t
        .app
        .start_run(StartRun {
            agent: Some("p-model".into()),
            input: "Go.".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(t.wait(run.id).await.status, RunStatus::Succeeded);
    let models: Vec<String> = t.mock.state.log().iter().map(|l| l.model.clone()).collect();
    assert_eq!(models.len(), 3, "{models:?}");
    assert!(
        models.iter().all(|m| m == "mock-large"),
        "alias for the parent, inherited by the child: {models:?}"
    );
}

/// `todo_write`: the plan is a checkpointed tool call, shown in the run view and its progress.
#[tokio::test]
async fn the_agents_plan_shows_in_the_run_view() {
    let planner = "---\nname: planner\ndescription: plans\ntools: Read, TodoWrite\n---\nPlan first. MOCK:planner\n";
    let t = spawn_app_with(Options {
        jobs: vec![("planner".into(), planner.into())],
        ..Default::default()
    })
    .await;
    let todos = |second: &str| json!({"todos": [{"content": "read the spec", "status": "completed"}, {"content": "answer", "status": second}]});
    t.mock.state.set_script(Script::from([(
        "planner".to_owned(),
        vec![
            calls(vec![call("todo_write", todos("in_progress"))]),
            calls(vec![call("todo_write", todos("completed"))]),
            say("done"),
        ],
    )]));
    let run = t
        .app
        .start_run(StartRun {
            agent: Some("planner".into()),
            input: "Go.".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let done = t.wait(run.id).await;
    assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
    let view = subagents::api::views::RunView::build(t.app.store.as_ref(), done)
        .await
        .unwrap();
    let plan: Vec<(&str, &str)> = view
        .todos
        .iter()
        .map(|i| (i.content.as_str(), i.status.as_str()))
        .collect();
    assert_eq!(
        plan,
        [("read the spec", "completed"), ("answer", "completed")],
        "the latest plan"
    );
    assert_eq!(
        tool_results(&t, &run).await[0],
        json!("Plan: 1 of 2 done\n[x] read the spec\n[>] answer")
    );
    // A run that never planned has none.
    let plain = t.run("SCENARIO steps=1 run=noplan").await;
    assert!(
        subagents::api::views::RunView::build(t.app.store.as_ref(), plain)
            .await
            .unwrap()
            .todos
            .is_empty()
    );
}

/// `web_search` against a SearXNG-compatible backend; off (and said so) without one.
#[tokio::test]
async fn web_search_uses_the_configured_backend() {
    let base = site().await;
    let ctx = subagents::tools::ToolCtx::new("/nonexistent", "k", 16_000);
    let with = |url: String| {
        ToolRegistry::with_settings(subagents::tools::ToolSettings {
            search_url: Some(url),
            ..Default::default()
        })
    };
    let reg = with(format!("{base}/search"));
    let out = reg
        .execute(
            "web_search",
            &json!({"query": "retry policy", "max_results": 2}).to_string(),
            &ctx,
        )
        .await
        .unwrap();
    assert_eq!(
        out,
        "1. Result 1 for retry policy\n   https://example.org/1\n   snippet 1\n2. Result 2 for retry policy\n   https://example.org/2\n   snippet 2"
    );
    let capped = reg
        .execute(
            "web_search",
            &json!({"query": "x", "max_results": 500}).to_string(),
            &ctx,
        )
        .await
        .unwrap();
    assert_eq!(
        capped.lines().filter(|l| !l.starts_with(' ')).count(),
        20,
        "at most 20 results"
    );
    let down = with(format!("{base}/broken-search"))
        .execute("web_search", r#"{"query":"x"}"#, &ctx)
        .await
        .unwrap_err();
    assert_eq!(down.code, "search_failed");
    // Without a backend, an agent that names WebSearch is told why it does not get it.
    let agent = subagents::agents::parse_agent(
        std::path::Path::new("s.md"),
        "---\nname: s\ndescription: d\ntools: WebSearch\n---\nx",
    )
    .unwrap();
    let r = ToolRegistry::builtin(None).resolve(&agent);
    assert!(
        r.tools.is_empty() && r.unavailable[0].1.contains("SUBAGENTS_SEARCH_URL"),
        "{r:?}"
    );
    assert_eq!(reg.resolve(&agent).tools, ["web_search"]);
}

#[test]
fn only_an_endpoint_on_this_machine_gets_echo_and_the_step_header_by_default() {
    let mut s = subagents::config::Settings::defaults("sqlite://x.db");
    for (url, local) in [
        ("http://127.0.0.1:8089/v1", true),
        ("http://localhost:1/v1", true),
        ("http://[::1]:1/v1", true),
        ("https://api.openai.com/v1", false),
        ("http://10.0.0.5/v1", false),
    ] {
        s.openai_base_url = url.into();
        assert_eq!(s.local_model_endpoint(), local, "{url}");
        let tools =
            subagents::tools::ToolRegistry::with_settings(subagents::app::App::tool_settings(&s));
        assert_eq!(
            tools.specs(&["echo".to_owned()]).len(),
            usize::from(local),
            "{url}"
        );
    }
    s.echo_tool = Some(true);
    let tools =
        subagents::tools::ToolRegistry::with_settings(subagents::app::App::tool_settings(&s));
    assert_eq!(tools.specs(&["echo".to_owned()]).len(), 1);
}
