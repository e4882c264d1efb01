//! The binary as users meet it: `run`, `agents`, `--help`, bad input and exit codes.

use std::process::{Command, Output};
use std::time::Duration;

use subagents::model::mock::{MockOptions, MockServer};

use crate::support::{Logged, Reaped};

fn subagents(dir: &std::path::Path, mock: Option<&MockServer>, args: &[&str]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_subagents"));
    c.args(args)
        .current_dir(dir)
        .env(
            "DATABASE_URL",
            format!("sqlite://{}", dir.join("cli.db").display()),
        )
        .env_remove("SUBAGENTS_JOBS_DIR")
        .env_remove("SUBAGENTS_WORKSPACE")
        .env("RUST_LOG", "warn");
    if let Some(m) = mock {
        c.env("OPENAI_BASE_URL", m.base_url())
            .env("OPENAI_API_KEY", "x")
            .env("SUBAGENTS_MODEL", "mock-model");
    }
    c.output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

async fn mock() -> MockServer {
    MockServer::start(
        ([127, 0, 0, 1], 0).into(),
        MockOptions {
            latency: Duration::ZERO,
            ..Default::default()
        },
    )
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_prints_the_answer_and_the_thread_and_continues_it() {
    let dir = tempfile::tempdir().unwrap();
    let m = mock().await;
    let out = subagents(
        dir.path(),
        Some(&m),
        &["run", "Task one.\nSCENARIO steps=3"],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "DONE after 3 steps\n");
    let err = text(&out.stderr);
    assert!(
        err.contains("step 1: model calls echo"),
        "progress per step: {err}"
    );
    assert!(err.contains("echo ok"), "progress per tool call: {err}");
    let thread = err
        .split("--thread ")
        .nth(1)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned();
    let out = subagents(
        dir.path(),
        Some(&m),
        &[
            "run",
            "--thread",
            &thread,
            "Task two.\nSCENARIO steps=2 run=2",
        ],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains(&thread));
    // A thread id that cannot exist is refused before anything is written.
    let out = subagents(dir.path(), Some(&m), &["run", "--thread", "bad/id", "x"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("not a valid thread id"),
        "{}",
        text(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_exit_codes_tell_failure_from_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    let m = mock().await;
    let out = subagents(
        dir.path(),
        Some(&m),
        &["run", "SCENARIO fail_every=1 fail_status=401"],
    );
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains("[model]") && err.contains("OPENAI_API_KEY"),
        "{err}"
    );
    let out = subagents(dir.path(), Some(&m), &["run", "  "]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("error[empty_input]"),
        "{}",
        text(&out.stderr)
    );
    let out = subagents(dir.path(), Some(&m), &["run", "--agent", "nobody", "x"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("error[unknown_agent]"));
    let out = subagents(
        dir.path(),
        Some(&m),
        &["run", "--max-steps", "2", "SCENARIO steps=9"],
    );
    assert!(out.status.success());
    assert_eq!(text(&out.stdout), "FORCED after 2 tool results\n");
    assert!(text(&out.stderr).contains("forced"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_lists_definitions_and_reports_broken_files_with_their_line() {
    let dir = tempfile::tempdir().unwrap();
    let jobs = dir.path().join("jobs");
    std::fs::create_dir_all(&jobs).unwrap();
    std::fs::write(
        jobs.join("good.md"),
        "---\nname: good\ndescription: a good one\ntools: Read, Grep\n---\nprompt",
    )
    .unwrap();
    std::fs::write(
        jobs.join("bad.md"),
        "---\ndescription: bad\nmax_steps: many\n---\n",
    )
    .unwrap();
    let out = subagents(dir.path(), None, &["agents"]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "broken files make a non-zero exit"
    );
    let o = text(&out.stdout);
    assert!(o.contains("good") && o.contains("general-purpose"), "{o}");
    let e = text(&out.stderr);
    assert!(e.contains("bad.md:3:"), "path and line of the problem: {e}");
    assert!(
        o.contains("tools: read_file, grep"),
        "the tools it really gets: {o}"
    );
}

#[test]
fn agents_warns_about_tools_it_cannot_honour_and_strict_fails() {
    let dir = tempfile::tempdir().unwrap();
    let jobs = dir.path().join("jobs");
    std::fs::create_dir_all(&jobs).unwrap();
    std::fs::write(jobs.join("planner.md"), "---\nname: planner\ndescription: plans\ntools: Read, WebSearch, Bash\nmodel: haiku\n---\nprompt").unwrap();
    let out = subagents(dir.path(), None, &["agents"]);
    assert_eq!(out.status.code(), Some(0), "warnings alone do not fail");
    let o = text(&out.stdout);
    assert!(o.contains("warning: `WebSearch` is not available"), "{o}");
    assert!(
        o.contains("warning: `Bash` is not available: bash is off"),
        "{o}"
    );
    assert!(
        o.contains("haiku: no alias in SUBAGENTS_MODEL_ALIASES"),
        "{o}"
    );
    let strict = subagents(dir.path(), None, &["agents", "--strict"]);
    assert_eq!(
        strict.status.code(),
        Some(1),
        "--strict makes an unknown tool an error"
    );
    // An MCP name counts as unknown only when its server is not configured.
    std::fs::write(jobs.join("planner.md"), "---\nname: planner\ndescription: plans\ntools: Read, mcp__github, mcp__files__read_text_file\n---\nprompt").unwrap();
    std::fs::write(
        dir.path().join(".mcp.json"),
        r#"{"mcpServers": {"files": {"command": "true"}}}"#,
    )
    .unwrap();
    let out = subagents(dir.path(), None, &["agents", "--strict"]);
    let o = text(&out.stdout);
    assert!(o.contains("mcp: mcp__github (no such server in SUBAGENTS_MCP_CONFIG), mcp__files__read_text_file\n"), "{o}");
    assert_eq!(out.status.code(), Some(1), "{o}");
}

#[test]
fn the_repository_agents_load_cleanly() {
    let jobs = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("jobs");
    let (reg, errors) = subagents::agents::AgentRegistry::load_dir(&jobs);
    assert!(errors.is_empty(), "{errors:?}");
    for name in ["general-purpose", "researcher", "reviewer"] {
        let a = reg.get(name).unwrap_or_else(|| panic!("{name} missing"));
        assert!(a.source.is_some(), "{name} comes from jobs/");
        assert!(a.system_prompt.len() > 200, "{name} has a real prompt");
    }
    let tools = subagents::tools::ToolRegistry::builtin(None);
    assert_eq!(
        tools.allowed_for(reg.get("researcher").unwrap()),
        ["read_file", "grep", "glob", "list_dir", "web_fetch"]
    );
}

#[test]
fn help_explains_the_commands_and_the_scenario_grammar() {
    let dir = tempfile::tempdir().unwrap();
    let out = subagents(dir.path(), None, &["--help"]);
    let h = text(&out.stdout);
    for w in [
        "run",
        "worker",
        "agents",
        "demo",
        "migrate",
        "mock-llm",
        "DATABASE_URL",
        "OPENAI_BASE_URL",
        "SUBAGENTS_CONCURRENCY",
    ] {
        assert!(h.contains(w), "--help lacks {w}:\n{h}");
    }
    let out = subagents(dir.path(), None, &["mock-llm", "--help"]);
    let h = text(&out.stdout);
    for w in ["SCENARIO", "steps=K", "fail_every", "loop=1", "latency_ms"] {
        assert!(h.contains(w), "mock-llm --help lacks {w}");
    }
}

/// The demo shows what it claims: the parent delegated to two children, their worker process
/// was killed mid-step (each child was claimed again after a crash), every run ended, and no
/// model answer was asked for twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_runs_with_no_key_and_no_service() {
    use subagents::store::{Queries, RunFilter, RunStatus, Runs};
    let dir = tempfile::tempdir().unwrap();
    let out = tokio::task::block_in_place(|| {
        Command::new(env!("CARGO_BIN_EXE_subagents"))
            .arg("demo")
            .current_dir(dir.path())
            .env_remove("DATABASE_URL")
            .env_remove("OPENAI_API_KEY")
            .env_remove("OPENAI_BASE_URL")
            .env_remove("REDIS_URL")
            .output()
            .unwrap()
    });
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(
        text(&out.stdout),
        format!(
            "{}\nDONE after 2 steps\n",
            subagents::cli::demo::LEAD_ANSWER
        )
    );
    assert!(stderr.contains("SIGKILL"), "{stderr}");
    assert!(
        stderr.contains("answers asked for again after the kill: 0."),
        "{stderr}"
    );
    let db = dir.path().join("subagents.db");
    assert!(db.exists(), "embedded default database created");
    let store = subagents::store::SqliteStore::connect(&format!("sqlite://{}", db.display()))
        .await
        .unwrap();
    let filter = RunFilter {
        agent: Some("lead".into()),
        ..Default::default()
    };
    let lead = store.list_runs(&"local".into(), &filter, 10).await.unwrap();
    assert_eq!(lead.len(), 1, "{lead:?}");
    assert_eq!(lead[0].status, RunStatus::Succeeded);
    let children = store.children(lead[0].id).await.unwrap();
    assert_eq!(children.len(), 2, "{children:?}");
    for c in &children {
        let c = store.get_run(c.id).await.unwrap().unwrap();
        assert_eq!(c.status, RunStatus::Succeeded, "{c:?}");
        assert_eq!(
            c.crashes, 1,
            "each child's worker died under it once: {c:?}"
        );
    }
}

#[test]
fn a_bad_database_url_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_subagents"))
        .args(["run", "x"])
        .current_dir(dir.path())
        .env("DATABASE_URL", "mysql://nowhere/db")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("DATABASE_URL"),
        "{}",
        text(&out.stderr)
    );
    let out = Command::new(env!("CARGO_BIN_EXE_subagents"))
        .args(["run", "x"])
        .current_dir(dir.path())
        .env("DATABASE_URL", "sqlite:///nonexistent-dir/sub/x.db")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("cannot open the database"),
        "{}",
        text(&out.stderr)
    );
    // Unreachable servers are named at start, not discovered later.
    let out = Command::new(env!("CARGO_BIN_EXE_subagents"))
        .args(["worker"])
        .current_dir(dir.path())
        .env("DATABASE_URL", "postgres://postgres@127.0.0.1:9/nowhere")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr)
            .contains("cannot open the database postgres://postgres@127.0.0.1:9/nowhere"),
        "{}",
        text(&out.stderr)
    );
    let out = Command::new(env!("CARGO_BIN_EXE_subagents"))
        .args(["worker"])
        .current_dir(dir.path())
        .env(
            "DATABASE_URL",
            format!("sqlite://{}", dir.path().join("x.db").display()),
        )
        .env("REDIS_URL", "redis://127.0.0.1:9")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("cannot reach Redis at redis://127.0.0.1:9"),
        "{}",
        text(&out.stderr)
    );
}

/// A worker stopped while it is still starting (here: its database accepts the connection and
/// never answers) exits at once and cleanly, as an orchestrator stopping a pod expects, rather
/// than dying of the signal half-way through its start.
#[test]
fn a_worker_stopped_while_starting_exits_cleanly() {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let dir = tempfile::tempdir().unwrap();
    let mut child = Reaped(
        Command::new(env!("CARGO_BIN_EXE_subagents"))
            .args(["worker"])
            .current_dir(dir.path())
            .env(
                "DATABASE_URL",
                format!("postgres://postgres@127.0.0.1:{port}/silent"),
            )
            .env("RUST_LOG", "warn")
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    // The connection reaching the listener means the worker is inside its start.
    let (_held, _) = silent.accept().unwrap();
    let t0 = std::time::Instant::now();
    assert!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) } == 0);
    let status = child.wait().unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert!(status.success(), "{status:?}: {err}");
    assert!(err.contains("shutdown requested while starting"), "{err}");
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "the start was abandoned, not waited out: {:?}",
        t0.elapsed()
    );
}

/// `bench-deltas` as the README runs it, small: every stream sees its first token, and the
/// delay is a real measurement (positive, far below the mock's chunk interval).
#[test]
fn bench_deltas_times_the_first_token_of_every_stream() {
    let dir = tempfile::tempdir().unwrap();
    let out = subagents(
        dir.path(),
        None,
        &["bench-deltas", "--streams", "5", "--setup", "sqlite"],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_str(text(&out.stdout).trim()).unwrap();
    assert_eq!(
        (v["missed"].as_u64(), v["streams"].as_u64()),
        (Some(0), Some(5)),
        "{v}"
    );
    let d = &v["first_delta_ms"];
    assert_eq!(d["n"], 5);
    let p50 = d["p50"].as_f64().unwrap();
    assert!(p50 > 0.0 && p50 <= d["p99"].as_f64().unwrap(), "{v}");
}

/// `bench` as its users run it (README, Benchmarks): one JSON line with the figures, every run
/// succeeded and counted, and the database's own commit rate beside it (`--calibrate`).
#[test]
fn bench_prints_one_json_line_with_its_figures() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("bench.db").display());
    let out = subagents(
        dir.path(),
        None,
        &[
            "bench",
            "--runs",
            "6",
            "--steps",
            "3",
            "--concurrency",
            "3",
            "--owners",
            "2",
            "--dsn",
            &db,
            "--calibrate",
            "--calibrate-secs",
            "1",
        ],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let line = text(&out.stdout);
    assert_eq!(line.lines().count(), 1, "one line: {line}");
    let v: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(v["ok"], true, "{v}");
    assert_eq!(v["failures"], 0);
    assert_eq!(v["steps"], 18);
    assert_eq!(v["mock_requests"], 18, "one model call a step");
    assert!(
        v["steps_per_s"].as_f64().unwrap() > 0.0 && v["cpu_ms_per_step"].as_f64().unwrap() > 0.0,
        "{v}"
    );
    let (commits, ratio) = (
        v["commits_per_s"].as_f64().unwrap(),
        v["commit_ratio"].as_f64().unwrap(),
    );
    assert!(
        commits > 0.0 && (ratio - v["steps_per_s"].as_f64().unwrap() / commits).abs() < 0.01,
        "{v}"
    );
    let owners = v["owners"].as_object().unwrap();
    assert_eq!(
        owners
            .values()
            .map(|o| o["runs"].as_u64().unwrap())
            .sum::<u64>(),
        6,
        "every run's queue wait counted: {v}"
    );
}

/// The `serve` binary itself: it listens where it says, reports ready, answers a wait with a
/// run its embedded workers ran, and a SIGTERM drains it to a clean exit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_serve_binary_runs_a_run_and_stops_cleanly_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let m = mock().await;
    let logged = Logged::spawn(
        Command::new(env!("CARGO_BIN_EXE_subagents"))
            .args(["serve", "--host", "127.0.0.1", "--port", "0"])
            .current_dir(dir.path())
            .env(
                "DATABASE_URL",
                format!("sqlite://{}", dir.path().join("serve.db").display()),
            )
            .env("OPENAI_BASE_URL", m.base_url())
            .env("OPENAI_API_KEY", "x")
            .env("SUBAGENTS_MODEL", "mock-model")
            .env("RUST_LOG", "warn")
            .env_remove("REDIS_URL")
            .env_remove("SUBAGENTS_API_KEYS")
            .env_remove("SUBAGENTS_KEYS_FILE")
            .stdout(std::process::Stdio::null()),
        "serve",
    );
    let base = logged.listening_on();
    let mut serve = logged.child;
    let client = reqwest::Client::new();
    let ready = client.get(format!("{base}/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 200);
    let run: serde_json::Value = client
        .post(format!("{base}/v1/runs/wait"))
        .json(&serde_json::json!({"input": "SCENARIO steps=2"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(run["status"], "succeeded", "{run}");
    assert_eq!(run["result"], "DONE after 2 steps");
    let term = Command::new("kill")
        .args(["-TERM", &serve.id().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = serve.try_wait().unwrap() {
            break s;
        }
        if std::time::Instant::now() > deadline {
            serve.kill().unwrap();
            panic!("serve did not exit within 30 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "serve exited with {status}");
}

/// With OpenAI's endpoint and no key, or a Claude model whose provider's key is unset, `run`,
/// `worker` and `serve` say so before any run starts (exit 2), naming the variable to set,
/// instead of a run failing `kind=model` after its retries.
#[test]
fn no_key_for_the_model_is_said_before_any_run_starts() {
    let dir = tempfile::tempdir().unwrap();
    let claude: &[(&str, &str)] = &[
        ("SUBAGENTS_MODEL", "claude-sonnet-4-5"),
        (
            "SUBAGENTS_MODELS",
            r#"[{"match": "claude-*", "provider": "anthropic", "api_key_env": "MY_CLAUDE_KEY"}]"#,
        ),
    ];
    for (env, names) in [(&[][..], "OPENAI_API_KEY"), (claude, "MY_CLAUDE_KEY")] {
        for args in [
            &["run", "Say hello."][..],
            &["worker"][..],
            &["serve", "--host", "127.0.0.1", "--port", "0"][..],
        ] {
            let t0 = std::time::Instant::now();
            let out = Command::new(env!("CARGO_BIN_EXE_subagents"))
                .args(args)
                .current_dir(dir.path())
                .env(
                    "DATABASE_URL",
                    format!("sqlite://{}", dir.path().join("k.db").display()),
                )
                .env_remove("OPENAI_API_KEY")
                .env_remove("OPENAI_BASE_URL")
                .env_remove("ANTHROPIC_API_KEY")
                .env_remove("MY_CLAUDE_KEY")
                .env_remove("REDIS_URL")
                .env("RUST_LOG", "warn")
                .envs(env.iter().copied())
                .output()
                .unwrap();
            let err = text(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
            assert!(
                err.contains("error[no_model_key]")
                    && err.contains(names)
                    && err.contains("subagents demo"),
                "{args:?}: {err}"
            );
            assert!(t0.elapsed() < Duration::from_secs(30), "{args:?}: at once");
        }
    }
}
