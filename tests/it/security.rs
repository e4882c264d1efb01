//! The trust boundaries, each attacked the way an outside review attacked them: a scripted
//! model tries the bypass through the real queue, and the test checks that it fails (and, where
//! it can, that the same attack works without the guard, so the check cannot pass by accident).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use subagents::app::StartRun;
use subagents::model::mock::{Script, Turn};
use subagents::store::{RunRecord, RunStatus};

use crate::delegation::{call, calls, say};
use crate::support::*;

/// An agent that calls what its script says (`MOCK:prober`).
fn prober(tools: &str, extra: &str) -> (String, String) {
    (
        "prober".into(),
        format!(
            "---\nname: prober\ndescription: tries to get past the rules\ntools: [{tools}]\n{extra}---\nYou probe. MOCK:prober\n"
        ),
    )
}

/// An app whose settings file holds `settings`, with the prober and `jobs`.
async fn app(
    settings: Value,
    jobs: Vec<(String, String)>,
    tweak: impl FnOnce(&mut subagents::config::Settings) + 'static,
) -> TestApp {
    let cfg = tempfile::tempdir().unwrap().keep();
    let path = cfg.join("subagents.json");
    std::fs::write(&path, settings.to_string()).unwrap();
    spawn_app_with(Options {
        jobs,
        tweak: Box::new(move |s| {
            s.settings_file = path;
            tweak(s);
        }),
        ..Default::default()
    })
    .await
}

/// Starts the prober on `turns`.
async fn start_probe(t: &TestApp, turns: Vec<Turn>) -> RunRecord {
    t.mock
        .state
        .set_script(Script::from([("prober".to_owned(), turns)]));
    t.app
        .start_run(StartRun {
            agent: Some("prober".into()),
            input: "Probe.".into(),
            ..Default::default()
        })
        .await
        .unwrap()
}

/// Runs the prober on `turns` to its end.
async fn probe(t: &TestApp, turns: Vec<Turn>) -> RunRecord {
    let r = start_probe(t, turns).await;
    t.wait(r.id).await
}

fn workspace(t: &TestApp) -> PathBuf {
    subagents::tools::owner_workspace(&t.app.settings.workspace, &"local".into())
}

fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, format!("#!/usr/bin/env bash\n{body}\n")).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p
}

// 1. Prefix allow rules admit no compound command.
#[tokio::test]
async fn a_prefix_rule_does_not_let_a_chained_command_run() {
    let settings =
        json!({"permissions": {"allow": ["Bash(git status:*)"], "defaultMode": "dontAsk"}});
    let t = app(settings, vec![prober("Bash", "")], |s| s.allow_bash = true).await;
    let bypasses = [
        "git status ; touch pwned1",
        "git status && env > env.txt",
        "git status | tee pwned2",
        "git status $(touch pwned3)",
        "git status\ntouch pwned4",
        "git status `touch pwned5`",
    ];
    let mut turns: Vec<Turn> = bypasses
        .iter()
        .map(|c| calls(vec![call("bash", json!({"command": c}))]))
        .collect();
    turns.push(calls(vec![call(
        "bash",
        json!({"command": "git status --short"}),
    )]));
    turns.push(say("done"));
    let r = probe(&t, turns).await;
    assert_eq!(r.status, RunStatus::Succeeded);
    let results = tool_texts(&t, &r).await;
    for (cmd, res) in bypasses.iter().zip(&results) {
        assert!(
            res.starts_with("error[permission_denied]"),
            "`{cmd}` ran under `Bash(git status:*)`: {res}"
        );
    }
    assert!(
        results[bypasses.len()].starts_with("exit code:"),
        "the plain command still runs: {}",
        results[bypasses.len()]
    );
    let ws = workspace(&t);
    for f in ["pwned1", "pwned2", "pwned3", "pwned4", "pwned5", "env.txt"] {
        assert!(!ws.join(f).exists(), "{f} was written");
    }
}

// 2. Bash cannot read the worker's secrets through /proc.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bash_cannot_read_the_workers_keys_through_proc() {
    let t = spawn_app_with(Options {
        workers: false,
        jobs: vec![prober("Bash", "")],
        ..Default::default()
    })
    .await;
    let look = "for f in environ cmdline; do echo \"== $f\"; tr '\\0' '\\n' < /proc/$PPID/$f; done; echo '== mem'; grep -a -c secret /proc/$PPID/mem; echo '== env'; env";
    let r = start_probe(
        &t,
        vec![
            calls(vec![call("bash", json!({"command": look}))]),
            say("done"),
        ],
    )
    .await;
    let secrets = [
        ("OPENAI_API_KEY", "sk-test-secret-4242"),
        ("SUBAGENTS_API_KEYS", "alice:alice-key-secret-9999"),
        ("GITHUB_TOKEN", "ghp-secret-7777"),
    ];
    let mut env: Vec<(&str, String)> = secrets.iter().map(|(k, v)| (*k, (*v).to_owned())).collect();
    // `1`, as the README writes it, turns bash on.
    env.push(("SUBAGENTS_ALLOW_BASH", "1".into()));
    let mut worker = spawn_worker(t.dir.path(), &t.mock, &env);
    let done = t
        .app
        .wait(r.id, Duration::from_secs(60))
        .await
        .unwrap()
        .unwrap();
    worker.kill().unwrap();
    worker.wait().unwrap();
    assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
    let out = &tool_texts(&t, &done).await[0];
    assert!(out.starts_with("exit code:"), "bash ran: {out}");
    assert!(
        out.contains("== environ") && out.contains("== mem"),
        "{out}"
    );
    for (k, v) in secrets {
        let secret = v.rsplit(':').next().unwrap();
        assert!(!out.contains(secret), "{k} is readable from bash:\n{out}");
    }
    // The worker's /proc files are closed to its children, not merely empty.
    assert!(out.matches("Permission denied").count() >= 2, "{out}");
}

// 3. Hooks get no secrets, and the model's .git/config runs nothing in an operator's git hook.
#[tokio::test]
async fn a_hook_running_git_in_the_workspace_runs_no_model_written_config() {
    let dir = tempfile::tempdir().unwrap();
    let env_out = dir.path().join("hook-env.txt");
    let pwd_out = dir.path().join("hook-pwd.txt");
    let hook_cwd = dir.path().join("hooks-home");
    std::fs::create_dir_all(&hook_cwd).unwrap();
    let h = script(
        dir.path(),
        "git-status.sh",
        &format!(
            "cat > /dev/null; pwd > {}; env > {}; cd \"$CLAUDE_PROJECT_DIR\" && git status --short > /dev/null 2>&1; exit 0",
            pwd_out.display(),
            env_out.display()
        ),
    );
    let settings = json!({"hooks": {"PostToolUse": [{"matcher": "Write|write_file", "hooks": [{"type": "command", "command": h}]}]}});
    let hc = hook_cwd.clone();
    let t = app(settings, vec![prober("Write", "")], move |s| {
        s.hook_cwd = Some(hc)
    })
    .await;
    let write =
        |p: &str, c: &str| calls(vec![call("write_file", json!({"path": p, "content": c}))]);
    let r = probe(
        &t,
        vec![
            write(".git/HEAD", "ref: refs/heads/main\n"),
            write(".git/objects/.keep", ""),
            write(".git/refs/heads/.keep", ""),
            write(".git/config", "[core]\n\trepositoryformatversion = 0\n\tfsmonitor = \"env > FSMONITOR_RAN; false\"\n"),
            write("notes.txt", "hello\n"),
            say("done"),
        ],
    )
    .await;
    assert_eq!(r.status, RunStatus::Succeeded);
    let ws = workspace(&t);
    assert!(ws.join(".git/config").exists());
    assert!(
        !ws.join("FSMONITOR_RAN").exists(),
        "the operator's git hook ran the model's fsmonitor"
    );
    // The hook ran where the operator said, with nothing but harmless variables.
    assert_eq!(
        std::fs::read_to_string(&pwd_out).unwrap().trim(),
        hook_cwd.canonicalize().unwrap().display().to_string()
    );
    let env = std::fs::read_to_string(&env_out).unwrap();
    for line in env.lines() {
        let name = line.split('=').next().unwrap();
        let allowed = subagents::procs::INHERITED.contains(&name)
            || name.starts_with("GIT_")
            || ["CLAUDE_PROJECT_DIR", "PWD", "OLDPWD", "SHLVL", "_"].contains(&name);
        assert!(
            allowed,
            "the hook got `{name}` from the worker's environment"
        );
    }
    // The payload is live: plain git, without the hook's settings, runs it.
    std::process::Command::new("git")
        .arg("status")
        .current_dir(&ws)
        .output()
        .unwrap();
    assert!(
        ws.join("FSMONITOR_RAN").exists(),
        "the test's payload never runs, so it proves nothing"
    );
}

/// A page server on port 0 that answers every request with `body` as HTML.
async fn page_server(body: String) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = axum::Router::new().fallback(move || {
        let body = body.clone();
        async move { ([(axum::http::header::CONTENT_TYPE, "text/html")], body) }
    });
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://127.0.0.1:{}/page", addr.port())
}

// 4. One fetched page cannot freeze the worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_of_nested_elements_is_read_without_freezing_the_worker() {
    let mut page = String::from("<html><body>");
    // Under the fetch's 2 MiB cap, so the text at the end arrives.
    while page.len() < 1536 * 1024 {
        page.push_str("<div>");
    }
    page.push_str("the answer is 42");
    let url = page_server(page).await;
    let t = app(json!({}), vec![prober("WebFetch", "")], |s| {
        s.fetch_allow = vec!["127.0.0.1".into()]
    })
    .await;
    let t0 = Instant::now();
    let r = probe(
        &t,
        vec![
            calls(vec![call("web_fetch", json!({"url": url}))]),
            say("done"),
        ],
    )
    .await;
    assert_eq!(r.status, RunStatus::Succeeded);
    let out = &tool_texts(&t, &r).await[0];
    assert!(
        out.contains("the answer is 42"),
        "{}",
        &out[..out.len().min(300)]
    );
    // html2text took minutes on this page; the stripper takes milliseconds. A minute is a
    // margin no loaded machine needs.
    assert!(t0.elapsed() < Duration::from_secs(60), "{:?}", t0.elapsed());
}

/// A tool that holds its thread (as a synchronous library call does), ignoring cancellation.
struct Stall(Duration);

#[async_trait::async_trait]
impl subagents::tools::Tool for Stall {
    fn spec(&self) -> subagents::model::ToolSpec {
        subagents::model::ToolSpec {
            kind: "function".into(),
            function: subagents::model::FunctionSpec {
                name: "stall".into(),
                description: "stalls".into(),
                parameters: json!({"type": "object"}),
            },
        }
    }
    async fn call(
        &self,
        _: Value,
        _: &subagents::tools::ToolCtx,
    ) -> Result<String, subagents::tools::ToolError> {
        std::thread::sleep(self.0);
        Ok("finished late".into())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_that_returns_after_its_timeout_is_not_ok() {
    let tools = tools_with(vec![std::sync::Arc::new(Stall(Duration::from_millis(
        1500,
    )))]);
    let t = spawn_app_with(Options {
        jobs: vec![prober("stall", "")],
        tools: Some(tools),
        tweak: Box::new(|s| s.tool_timeout_secs = 0.3),
        ..Default::default()
    })
    .await;
    let r = probe(&t, vec![calls(vec![call("stall", json!({}))]), say("done")]).await;
    let res = tool_texts(&t, &r).await;
    assert!(res[0].starts_with("error[tool_timeout]"), "{res:?}");
    let events = t.events(r.id).await;
    let done = events.iter().find(|e| e.kind == "tool.completed").unwrap();
    assert_eq!(done.data["ok"], false);
}

// 5. An edit cannot ask for gigabytes, and a call that kills its worker is not run a third time.
#[tokio::test]
async fn a_replace_all_that_would_explode_is_refused_and_the_worker_lives() {
    let t = spawn_app_with(Options {
        jobs: vec![prober("Edit", "")],
        ..Default::default()
    })
    .await;
    let ws = workspace(&t);
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::write(ws.join("big.txt"), "a".repeat(100_000)).unwrap();
    let r = probe(&t, vec![calls(vec![call("edit_file", json!({"path": "big.txt", "old_string": "a", "new_string": "b".repeat(50_000), "replace_all": true}))]), say("done")]).await;
    assert_eq!(r.status, RunStatus::Succeeded);
    let res = tool_texts(&t, &r).await;
    assert!(res[0].starts_with("error[edit_too_large]"), "{res:?}");
    assert_eq!(
        std::fs::metadata(ws.join("big.txt")).unwrap().len(),
        100_000
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_whose_worker_died_twice_is_not_run_a_third_time() {
    let t = spawn_app_with(Options {
        workers: false,
        jobs: vec![prober("echo", "")],
        ..Default::default()
    })
    .await;
    let r = start_probe(
        &t,
        vec![
            calls(vec![call("echo", json!({"text": "boom"}))]),
            say("survived"),
        ],
    )
    .await;
    let journal = t.dir.path().join("journal.txt");
    // The tool's return takes its worker down, every time (as an allocation that aborts did).
    let env = [
        ("SUBAGENTS_FAILPOINTS", "after_tool_run=crash".to_owned()),
        ("SUBAGENTS_TOOL_JOURNAL", journal.display().to_string()),
    ];
    for attempt in 1..=2 {
        let mut w = spawn_worker(t.dir.path(), &t.mock, &env);
        let status = tokio::task::spawn_blocking(move || w.wait().unwrap())
            .await
            .unwrap();
        assert!(
            !status.success(),
            "worker {attempt} was meant to die in the tool"
        );
    }
    let mut w = spawn_worker(t.dir.path(), &t.mock, &env);
    let done = t
        .app
        .wait(r.id, Duration::from_secs(60))
        .await
        .unwrap()
        .unwrap();
    let _ = w.kill();
    let _ = w.wait();
    assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
    let res = tool_texts(&t, &done).await;
    assert!(res[0].starts_with("error[tool_crashed]"), "{res:?}");
    let runs = std::fs::read_to_string(&journal)
        .unwrap()
        .lines()
        .filter(|l| l.contains("\techo"))
        .count();
    assert_eq!(runs, 2, "the call ran twice, then never again");
    assert_eq!(done.crashes, 2);
}

// 6. Path rules see the path the tool opens, and searches do not hand over denied files.
#[tokio::test]
async fn path_deny_rules_hold_for_odd_spellings_and_for_searches() {
    let settings = json!({"permissions": {"deny": ["Read(secrets/**)", "Edit(secrets/**)"]}});
    let t = app(
        settings,
        vec![prober("Read, Write, Grep, Glob", "")],
        |_| {},
    )
    .await;
    let ws = workspace(&t);
    std::fs::create_dir_all(ws.join("secrets")).unwrap();
    std::fs::write(ws.join("secrets/key.txt"), "TOPSECRET-1234\n").unwrap();
    std::fs::write(ws.join("notes.txt"), "nothing here\n").unwrap();
    let one = |name: &str, args: Value| calls(vec![call(name, args)]);
    let r = probe(
        &t,
        vec![
            one("read_file", json!({"path": ".//secrets/key.txt"})),
            one("read_file", json!({"path": "secrets//key.txt"})),
            one("read_file", json!({"path": "./secrets/./key.txt"})),
            one(
                "write_file",
                json!({"path": ".//secrets/new.txt", "content": "x"}),
            ),
            one(
                "grep",
                json!({"pattern": "TOPSECRET", "output_mode": "content"}),
            ),
            one("grep", json!({"pattern": "TOPSECRET", "path": "."})),
            one("glob", json!({"pattern": "**/*.txt"})),
            say("done"),
        ],
    )
    .await;
    let res = tool_texts(&t, &r).await;
    for r in &res[..4] {
        assert!(r.starts_with("error[permission_denied]"), "{r}");
    }
    assert!(!ws.join("secrets/new.txt").exists());
    for r in &res[4..] {
        assert!(
            !r.contains("TOPSECRET-1234") && !r.contains("secrets/key.txt"),
            "a search handed over a denied file: {r}"
        );
    }
    assert_eq!(res[6], "notes.txt");
}

// 7. A hook settles an ask, never a deny: not the child's own allow hook against its parent's
// deny rule, and not a rewritten input.
#[tokio::test]
async fn a_childs_allow_hook_does_not_lift_its_parents_deny() {
    let dir = tempfile::tempdir().unwrap();
    let allow = script(
        dir.path(),
        "allow.sh",
        r#"cat > /dev/null; echo '{"hookSpecificOutput":{"permissionDecision":"allow"}}'"#,
    );
    let parent = "---\nname: careful\ndescription: may not echo\ntools: [echo, Task]\npermissions:\n  deny: [\"echo\"]\n---\nYou delegate. MOCK:careful\n";
    let child = format!(
        "---\nname: eager\ndescription: allows itself everything\ntools: [echo]\nhooks:\n  PreToolUse:\n    - matcher: \"\"\n      hooks:\n        - type: command\n          command: {}\n---\nYou echo.\n",
        allow.display()
    );
    let t = spawn_app_with(Options {
        jobs: vec![("careful".into(), parent.into()), ("eager".into(), child)],
        ..Default::default()
    })
    .await;
    t.mock.state.set_script(Script::from([(
        "careful".to_owned(),
        vec![calls(vec![call("task", json!({"description": "Echo it.\nSCENARIO steps=2 tool=echo run=eager", "subagent": "eager"}))]), say("done")],
    )]));
    let p = t
        .app
        .start_run(StartRun {
            agent: Some("careful".into()),
            input: "Go.".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(t.wait(p.id).await.status, RunStatus::Succeeded);
    let child = t.app.store.children(p.id).await.unwrap().remove(0);
    let res = tool_texts(&t, &child).await;
    assert!(
        res[0].starts_with("error[permission_denied]") && res[0].contains("parent agent `careful`"),
        "{res:?}"
    );
}

#[tokio::test]
async fn a_rewritten_input_meets_the_deny_rules_again() {
    let dir = tempfile::tempdir().unwrap();
    let rewrite = script(
        dir.path(),
        "rewrite.sh",
        r#"cat > /dev/null; echo '{"hookSpecificOutput":{"permissionDecision":"allow","updatedInput":{"text":"forbidden words"}}}'"#,
    );
    let settings = json!({
        "permissions": {"deny": ["echo(forbidden words)"], "ask": ["echo(ask me)"]},
        "hooks": {"PreToolUse": [{"matcher": "echo", "hooks": [{"type": "command", "command": rewrite}]}]},
    });
    let t = app(settings.clone(), vec![prober("echo", "")], |_| {}).await;
    let r = probe(
        &t,
        vec![
            calls(vec![call("echo", json!({"text": "harmless"}))]),
            say("done"),
        ],
    )
    .await;
    assert!(
        tool_texts(&t, &r).await[0].starts_with("error[permission_denied]"),
        "a hook's rewrite slipped past a deny rule"
    );

    // An approver's rewrite is checked the same way.
    let no_hook =
        json!({"permissions": {"deny": ["echo(forbidden words)"], "ask": ["echo(ask me)"]}});
    let t = app(no_hook, vec![prober("echo", "")], |_| {}).await;
    let base = t.serve("").await;
    let r = start_probe(
        &t,
        vec![
            calls(vec![call("echo", json!({"text": "ask me"}))]),
            say("done"),
        ],
    )
    .await;
    let http = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    let approval = loop {
        let v: Value = http
            .get(format!("{base}/v1/approvals?status=pending"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if let Some(a) = v["approvals"].as_array().and_then(|a| a.first()) {
            break a.clone();
        }
        assert!(Instant::now() < deadline, "no approval appeared");
        tokio::time::sleep(Duration::from_millis(30)).await;
    };
    let answer = http
        .post(format!(
            "{base}/v1/approvals/{}",
            approval["id"].as_str().unwrap()
        ))
        .json(&json!({"decision": "allow", "updated_input": {"text": "forbidden words"}}))
        .send()
        .await
        .unwrap();
    assert!(
        answer.status().is_success(),
        "{}",
        answer.text().await.unwrap()
    );
    let done = t.wait(r.id).await;
    let res = tool_texts(&t, &done).await;
    assert!(
        res[0].starts_with("error[permission_denied]") && res[0].contains("rewritten"),
        "{res:?}"
    );
}

// 8. A NUL character neither wedges a run nor passes for an outage.
#[tokio::test]
async fn a_nul_is_refused_at_the_api_and_scrubbed_from_model_and_tool_text_on_postgres() {
    let db = fresh_postgres_database().await;
    let t = spawn_app_with(Options {
        jobs: vec![prober("echo", "")],
        tweak: Box::new(move |s| s.database_url = db),
        ..Default::default()
    })
    .await;
    let base = t.serve("").await;
    let http = reqwest::Client::new();
    for body in [
        json!({"input": "hello\u{0}world"}),
        json!({"input": "hi", "metadata": {"k": "a\u{0}b"}}),
    ] {
        let resp = http
            .post(format!("{base}/v1/runs"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), reqwest::StatusCode::UNPROCESSABLE_ENTITY);
        let v: Value = resp.json().await.unwrap();
        assert_eq!(v["error"]["code"], "nul_character", "{v}");
    }
    // A literal backslash followed by u0000 is not a NUL.
    let resp = http
        .post(format!("{base}/v1/runs"))
        .json(&json!({"input": "a \\u0000 b"}))
        .send()
        .await
        .unwrap();
    assert_eq!(
        resp.status(),
        reqwest::StatusCode::ACCEPTED,
        "{}",
        resp.text().await.unwrap()
    );
    // The model answers with NUL in a tool's argument and in its final text.
    let t0 = Instant::now();
    let r = probe(
        &t,
        vec![
            calls(vec![call("echo", json!({"text": "in\u{0}tool"}))]),
            say("final\u{0}answer"),
        ],
    )
    .await;
    assert_eq!(r.status, RunStatus::Succeeded, "{r:?}");
    assert_eq!(r.result.as_deref(), Some("final\u{FFFD}answer"));
    assert_eq!(tool_texts(&t, &r).await[0], "in\u{FFFD}tool");
    assert!(t0.elapsed() < Duration::from_secs(30));
    assert_eq!(r.crashes, 0);
}

#[tokio::test]
async fn data_the_database_refuses_is_not_taken_for_a_passing_failure() {
    let db = fresh_postgres_database().await;
    let pool = sqlx::PgPool::connect(&db).await.unwrap();
    let refused = subagents::store::StoreError::Db(
        sqlx::query("SELECT $1::text")
            .bind("a\u{0}b")
            .execute(&pool)
            .await
            .unwrap_err(),
    );
    assert!(!refused.is_transient() && !refused.is_outage(), "{refused}");
    // A lock timeout is worth a retry, counted: a run that meets it every time must end.
    let mut a = pool.begin().await.unwrap();
    sqlx::query("CREATE TABLE t (id int primary key)")
        .execute(&mut *a)
        .await
        .unwrap();
    a.commit().await.unwrap();
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE t IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let mut waiter = pool.begin().await.unwrap();
    sqlx::query("SET LOCAL lock_timeout = '50ms'")
        .execute(&mut *waiter)
        .await
        .unwrap();
    let timed_out = subagents::store::StoreError::Db(
        sqlx::query("SELECT * FROM t")
            .execute(&mut *waiter)
            .await
            .unwrap_err(),
    );
    assert!(
        timed_out.is_transient() && !timed_out.is_outage(),
        "{timed_out}"
    );
    drop(waiter);
    drop(holder);
    pool.close().await;
    // The database away is an outage: a run waits it out, however often.
    let gone = subagents::store::StoreError::Db(
        sqlx::PgPool::connect("postgres://postgres@127.0.0.1:1/none")
            .await
            .unwrap_err(),
    );
    assert!(gone.is_transient() && gone.is_outage(), "{gone}");
}

// 9. One owner's overview streams cost one computation, and a key holds a bounded number.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overview_streams_share_one_computation_and_are_capped_per_key() {
    use subagents::api::{ApiState, overview::Feeds, quota};
    let t = spawn_app_with(Options {
        workers: false,
        ..Default::default()
    })
    .await;
    let overviews = std::sync::Arc::new(Feeds::default());
    let state = ApiState {
        app: t.app.clone(),
        keys: Default::default(),
        waits: Default::default(),
        views: Default::default(),
        overviews: overviews.clone(),
        quotas: quota::Quotas::new(quota::Limits {
            streams: 30,
            waits: 0,
            queued: 0,
        }),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let router = subagents::api::router(state);
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    let http = reqwest::Client::new();
    let mut open = vec![];
    for _ in 0..30 {
        let resp = http
            .get(format!("{base}/v1/overview/stream"))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), reqwest::StatusCode::OK);
        let mut body = resp.bytes_stream();
        let first = futures::StreamExt::next(&mut body).await.unwrap().unwrap();
        assert!(String::from_utf8_lossy(&first).contains("event: overview"));
        open.push(body);
    }
    assert_eq!(
        overviews.running(),
        1,
        "thirty streams of one owner share one computation"
    );
    let over = http
        .get(format!("{base}/v1/overview/stream"))
        .send()
        .await
        .unwrap();
    assert_eq!(over.status(), reqwest::StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        over.json::<Value>().await.unwrap()["error"]["code"],
        "too_many_streams"
    );
    drop(open);
    // The server hears of a closed stream at its next write (at the latest the 15 s keep-alive),
    // and the feed looks every 2 s.
    let deadline = Instant::now() + Duration::from_secs(90);
    while overviews.running() > 0 {
        assert!(
            Instant::now() < deadline,
            "the feed kept computing for nobody"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The places are free again.
    assert_eq!(
        http.get(format!("{base}/v1/overview/stream"))
            .send()
            .await
            .unwrap()
            .status(),
        reqwest::StatusCode::OK
    );
}

// 10. Without keys, only local names reach the server.
#[tokio::test]
async fn a_keyless_server_refuses_foreign_hosts_and_origins() {
    let t = spawn_app_with(Options {
        workers: false,
        ..Default::default()
    })
    .await;
    let base = t.serve("").await;
    let port = base.rsplit(':').next().unwrap().to_owned();
    let http = reqwest::Client::new();
    let get = |host: String, origin: Option<&'static str>| {
        let mut b = http.get(format!("{base}/v1/runs")).header("host", host);
        if let Some(o) = origin {
            b = b.header("origin", o);
        }
        b.send()
    };
    for (host, origin) in [
        (format!("attacker.test:{port}"), None),
        (format!("127.0.0.1:{port}"), Some("http://attacker.test")),
        (format!("localhost.attacker.test:{port}"), None),
    ] {
        let resp = get(host.clone(), origin).await.unwrap();
        assert_eq!(
            resp.status(),
            reqwest::StatusCode::FORBIDDEN,
            "{host} {origin:?}"
        );
        assert_eq!(
            resp.json::<Value>().await.unwrap()["error"]["code"],
            "forbidden_host"
        );
    }
    for (host, origin) in [
        (format!("127.0.0.1:{port}"), None),
        (format!("localhost:{port}"), Some("http://localhost:3000")),
        (format!("[::1]:{port}"), None),
    ] {
        assert_eq!(
            get(host.clone(), origin).await.unwrap().status(),
            reqwest::StatusCode::OK,
            "{host} {origin:?}"
        );
    }
    // MCP over HTTP is behind the same guard.
    let mcp = http
        .post(format!("{base}/mcp"))
        .header("host", format!("attacker.test:{port}"))
        .header("accept", "application/json, text/event-stream")
        .json(&json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}))
        .send()
        .await
        .unwrap();
    assert_eq!(mcp.status(), reqwest::StatusCode::FORBIDDEN);
    // With keys, the bearer key is the boundary and any Host is served.
    let keyed = t.serve("alice:alice-secret-key").await;
    let resp = http
        .get(format!("{keyed}/v1/runs"))
        .header("host", "api.example.com")
        .bearer_auth("alice-secret-key")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), reqwest::StatusCode::OK);
}

// Lower findings.
#[tokio::test]
async fn metrics_need_a_key_or_the_metrics_token_and_readyz_shows_details_only_to_them() {
    let t = spawn_app_with(Options {
        workers: false,
        tweak: Box::new(|s| s.metrics_token = Some("scrape-token-123".into())),
        ..Default::default()
    })
    .await;
    let base = t.serve("alice:alice-secret-key").await;
    let http = reqwest::Client::new();
    assert_eq!(
        http.get(format!("{base}/metrics"))
            .send()
            .await
            .unwrap()
            .status(),
        reqwest::StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        http.get(format!("{base}/metrics"))
            .bearer_auth("wrong")
            .send()
            .await
            .unwrap()
            .status(),
        reqwest::StatusCode::UNAUTHORIZED
    );
    for key in ["scrape-token-123", "alice-secret-key"] {
        assert_eq!(
            http.get(format!("{base}/metrics"))
                .bearer_auth(key)
                .send()
                .await
                .unwrap()
                .status(),
            reqwest::StatusCode::OK,
            "{key}"
        );
    }
    let anon: Value = http
        .get(format!("{base}/readyz"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(anon["status"], "ready");
    assert!(anon.get("db").is_none_or(Value::is_null), "{anon}");
    let op: Value = http
        .get(format!("{base}/readyz"))
        .bearer_auth("scrape-token-123")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(op["db"], "ok");
}

#[tokio::test]
async fn a_key_cannot_queue_or_wait_without_bound() {
    let t = spawn_app_with(Options {
        workers: false,
        tweak: Box::new(|s| {
            s.max_queued_per_key = 2;
            s.max_waits_per_key = 1;
        }),
        ..Default::default()
    })
    .await;
    let base = t.serve("alice:alice-secret-key,bob:bob-secret-key").await;
    let http = reqwest::Client::new();
    let start = |key: &'static str| {
        http.post(format!("{base}/v1/runs"))
            .bearer_auth(key)
            .json(&json!({"input": "hi", "if_busy": "enqueue"}))
            .send()
    };
    let mut ids = vec![];
    for _ in 0..2 {
        let r = start("alice-secret-key").await.unwrap();
        assert_eq!(r.status(), reqwest::StatusCode::ACCEPTED);
        ids.push(
            r.json::<Value>().await.unwrap()["id"]
                .as_str()
                .unwrap()
                .to_owned(),
        );
    }
    let full = start("alice-secret-key").await.unwrap();
    assert_eq!(full.status(), reqwest::StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        full.json::<Value>().await.unwrap()["error"]["code"],
        "queue_full"
    );
    assert_eq!(
        start("bob-secret-key").await.unwrap().status(),
        reqwest::StatusCode::ACCEPTED,
        "another owner is not held back"
    );
    // MCP's `run_agent` is a start like the API's: the key's full queue refuses it too.
    let mcp = crate::mcp_server::http_client(&base, Some("alice-secret-key"))
        .await
        .unwrap();
    let refused = serde_json::to_value(
        mcp.call_tool(crate::mcp_server::call(
            "run_agent",
            json!({"agent": "general-purpose", "input": "one more"}),
        ))
        .await
        .unwrap(),
    )
    .unwrap();
    assert_eq!(refused["isError"], true, "{refused}");
    assert!(
        crate::mcp_server::text(&refused).contains("error[queue_full]"),
        "{refused}"
    );
    mcp.cancel().await.unwrap();
    // One wait per key: while a long wait is open, a second is refused. Probing races the long
    // wait for the one place, so a long wait that lost (it ended at once) is opened again.
    let long_wait = || {
        tokio::spawn(
            http.get(format!("{base}/v1/runs/{}/wait?timeout_s=60", ids[0]))
                .bearer_auth("alice-secret-key")
                .send(),
        )
    };
    let mut first = long_wait();
    let deadline = Instant::now() + Duration::from_secs(30);
    let refused = loop {
        if first.is_finished() {
            first = long_wait();
        }
        let second = http
            .get(format!("{base}/v1/runs/{}/wait?timeout_s=0", ids[1]))
            .bearer_auth("alice-secret-key")
            .send()
            .await
            .unwrap();
        if second.status() == reqwest::StatusCode::TOO_MANY_REQUESTS {
            break second.json::<Value>().await.unwrap();
        }
        assert!(Instant::now() < deadline, "a second wait was never refused");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(refused["error"]["code"], "too_many_waits");
    // Another key waits as it likes.
    let bobs = http
        .get(format!("{base}/v1/runs/{}/wait?timeout_s=0", ids[1]))
        .bearer_auth("bob-secret-key")
        .send()
        .await
        .unwrap();
    assert_eq!(
        bobs.status(),
        reqwest::StatusCode::NOT_FOUND,
        "bob may wait, on his own runs"
    );
    first.abort();
}

#[tokio::test]
async fn file_tools_refuse_fifos_and_hard_links_at_once() {
    let t = spawn_app_with(Options {
        workers: false,
        ..Default::default()
    })
    .await;
    let ws = t.dir.path().join("ws");
    std::fs::create_dir_all(&ws).unwrap();
    let fifo = ws.join("pipe");
    assert!(
        std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    let outside = t.dir.path().join("outside.txt");
    std::fs::write(&outside, "OUTSIDE-SECRET\n").unwrap();
    std::fs::hard_link(&outside, ws.join("linked.txt")).unwrap();
    let ctx = subagents::tools::ToolCtx::new(&ws, "k", 16_000);
    let tools = &t.app.engine.tools;
    let t0 = Instant::now();
    for (tool, args) in [
        ("read_file", json!({"path": "pipe"})),
        ("write_file", json!({"path": "pipe", "content": "x"})),
        (
            "edit_file",
            json!({"path": "pipe", "old_string": "a", "new_string": "b"}),
        ),
    ] {
        let e = tools
            .execute(tool, &args.to_string(), &ctx)
            .await
            .unwrap_err();
        assert_eq!(e.code, "not_a_file", "{tool}: {e}");
    }
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "a FIFO blocked a file tool"
    );
    for (tool, args) in [
        ("read_file", json!({"path": "linked.txt"})),
        (
            "write_file",
            json!({"path": "linked.txt", "content": "overwritten"}),
        ),
        (
            "edit_file",
            json!({"path": "linked.txt", "old_string": "OUTSIDE", "new_string": "x"}),
        ),
    ] {
        assert_eq!(
            tools
                .execute(tool, &args.to_string(), &ctx)
                .await
                .unwrap_err()
                .code,
            "hard_link",
            "{tool}"
        );
    }
    let found = tools
        .execute(
            "grep",
            &json!({"pattern": "OUTSIDE", "output_mode": "content"}).to_string(),
            &ctx,
        )
        .await
        .unwrap();
    assert!(!found.contains("OUTSIDE-SECRET"), "{found}");
    assert_eq!(
        std::fs::read_to_string(&outside).unwrap(),
        "OUTSIDE-SECRET\n"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_swapped_for_a_link_mid_search_leads_nowhere() {
    let dir = tempfile::tempdir().unwrap();
    let ws = dir.path().join("ws");
    let outside = dir.path().join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(outside.join("secret.txt"), "OUTSIDE-SECRET\n").unwrap();
    std::fs::create_dir_all(ws.join("sub")).unwrap();
    for i in 0..200 {
        std::fs::write(ws.join(format!("f{i:03}.txt")), "filler\n").unwrap();
    }
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let swapper = {
        let (ws, outside, stop) = (ws.clone(), outside.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = std::fs::remove_dir_all(ws.join("sub"));
                let _ = std::os::unix::fs::symlink(&outside, ws.join("sub"));
                std::thread::yield_now();
                let _ = std::fs::remove_file(ws.join("sub"));
                let _ = std::fs::create_dir(ws.join("sub"));
                let _ = std::fs::write(ws.join("sub/secret.txt"), "inside\n");
            }
        })
    };
    let tools = subagents::tools::ToolRegistry::builtin(None);
    let ctx = subagents::tools::ToolCtx::new(&ws, "k", 16_000);
    for _ in 0..50 {
        let out = tools
            .execute(
                "grep",
                &json!({"pattern": "SECRET|inside", "output_mode": "content"}).to_string(),
                &ctx,
            )
            .await
            .unwrap();
        assert!(
            !out.contains("OUTSIDE-SECRET"),
            "a search followed a swapped-in link: {out}"
        );
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    swapper.join().unwrap();
}

#[tokio::test]
async fn a_parents_tools_list_bounds_its_childrens_tools() {
    let parent = "---\nname: narrow\ndescription: may only echo\ntools: [echo, Task]\n---\nYou delegate. MOCK:narrow\n";
    let t = spawn_app_with(Options {
        jobs: vec![("narrow".into(), parent.into()), prober("echo, Write", "")],
        ..Default::default()
    })
    .await;
    t.mock.state.set_script(Script::from([
        (
            "narrow".to_owned(),
            vec![
                calls(vec![call(
                    "task",
                    json!({"description": "Write a file.", "subagent": "prober"}),
                )]),
                say("done"),
            ],
        ),
        (
            "prober".to_owned(),
            vec![
                calls(vec![call(
                    "write_file",
                    json!({"path": "escaped.txt", "content": "x"}),
                )]),
                say("child done"),
            ],
        ),
    ]));
    let p = t
        .app
        .start_run(StartRun {
            agent: Some("narrow".into()),
            input: "Go.".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(t.wait(p.id).await.status, RunStatus::Succeeded);
    let child = t.app.store.children(p.id).await.unwrap().remove(0);
    let res = tool_texts(&t, &child).await;
    assert!(res[0].starts_with("error[unknown_tool]"), "{res:?}");
    assert!(!workspace(&t).join("escaped.txt").exists());
}

#[tokio::test]
async fn rules_that_name_no_tool_are_reported_at_load() {
    let settings = json!({"permissions": {"deny": ["WRITE", "write", "Write_File", "mcp__Files", "Bash(rm:*)", "mcp__github"]}});
    let cfg = tempfile::tempdir().unwrap();
    std::fs::write(
        cfg.path().join(".mcp.json"),
        json!({"mcpServers": {"github": {"command": "true"}}}).to_string(),
    )
    .unwrap();
    let path = cfg.path().join("subagents.json");
    std::fs::write(&path, settings.to_string()).unwrap();
    let mcp = cfg.path().join(".mcp.json");
    let t = spawn_app_with(Options {
        workers: false,
        tweak: Box::new(move |s| {
            s.settings_file = path;
            s.mcp_config = mcp;
        }),
        ..Default::default()
    })
    .await;
    let policy = subagents::policy::load_settings(&t.app.settings.settings_file).unwrap();
    let reported: Vec<String> = subagents::app::App::rules_naming_no_tool(
        &t.app.settings,
        &t.app.agents.current(),
        &policy,
    )
    .into_iter()
    .map(|(_, r)| r)
    .collect();
    assert_eq!(reported, ["WRITE", "write", "Write_File", "mcp__Files"]);
}

// Thread ids are each owner's own: a name one owner used first is still free for another.
#[tokio::test]
async fn thread_ids_are_each_owners_own() {
    let t = spawn_app_with(Options::default()).await;
    let base = t.serve("alice:alice-secret-key,bob:bob-secret-key").await;
    let http = reqwest::Client::new();
    let start = |key: &'static str, input: &str, thread: &str| {
        http.post(format!("{base}/v1/runs/wait"))
            .bearer_auth(key)
            .json(&json!({"input": input, "thread_id": thread, "timeout_s": 30, "if_busy": "enqueue"}))
            .send()
    };
    // Bob takes the name first; Alice uses it all the same.
    let b: Value = start(
        "bob-secret-key",
        "bob's words\nSCENARIO steps=1 run=b",
        "shared",
    )
    .await
    .unwrap()
    .json()
    .await
    .unwrap();
    let a: Value = start(
        "alice-secret-key",
        "alice's words\nSCENARIO steps=1 run=a",
        "shared",
    )
    .await
    .unwrap()
    .json()
    .await
    .unwrap();
    assert_eq!(
        (b["status"].as_str(), a["status"].as_str()),
        (Some("succeeded"), Some("succeeded")),
        "{b} {a}"
    );
    assert_eq!(
        (b["thread_id"].as_str(), a["thread_id"].as_str()),
        (Some("shared"), Some("shared"))
    );
    let view = |key: &'static str, path: String| {
        let http = http.clone();
        async move {
            http.get(path)
                .bearer_auth(key)
                .send()
                .await
                .unwrap()
                .json::<Value>()
                .await
                .unwrap()
        }
    };
    let alices = view("alice-secret-key", format!("{base}/v1/threads/shared")).await;
    let bobs = view("bob-secret-key", format!("{base}/v1/threads/shared")).await;
    assert_eq!(alices["id"], "shared");
    assert!(
        alices.to_string().contains("alice's words") && !alices.to_string().contains("bob's words"),
        "{alices}"
    );
    assert!(
        bobs.to_string().contains("bob's words") && !bobs.to_string().contains("alice's words"),
        "{bobs}"
    );
    let listed = view(
        "alice-secret-key",
        format!("{base}/v1/runs?thread_id=shared"),
    )
    .await;
    assert_eq!(listed["runs"].as_array().unwrap().len(), 1);
    let events = view(
        "alice-secret-key",
        format!("{base}/v1/runs/{}/events", a["id"].as_str().unwrap()),
    )
    .await;
    assert_eq!(
        events["events"][0]["data"]["thread_id"], "shared",
        "events name the thread as its owner does"
    );
    // A thread stored before threads were scoped stays its owner's, under the same id.
    let old = t
        .app
        .start_run(StartRun {
            input: "old words\nSCENARIO steps=1 run=old".into(),
            thread_id: Some("legacy-1".parse().unwrap()),
            owner: Some("alice".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    t.wait(old.id).await;
    // Starts a run through the API; the answer and the run as stored.
    let stored = |key: &'static str, input: &'static str| {
        let (start, t) = (&start, &t);
        async move {
            let v: Value = start(key, input, "legacy-1")
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            let id = v["id"].as_str().unwrap().parse().unwrap();
            (v.clone(), t.app.store.get_run(id).await.unwrap().unwrap())
        }
    };
    let (cont, cont_run) = stored("alice-secret-key", "more\nSCENARIO steps=1 run=more").await;
    assert_eq!(
        cont_run.thread_id.as_str(),
        "legacy-1",
        "alice continues her old thread"
    );
    assert_eq!(cont["thread_id"], "legacy-1");
    let (_, theirs_run) = stored("bob-secret-key", "bob again\nSCENARIO steps=1 run=b2").await;
    assert_ne!(
        theirs_run.thread_id.as_str(),
        "legacy-1",
        "bob's legacy-1 is his own"
    );
    let old_thread = view("alice-secret-key", format!("{base}/v1/threads/legacy-1")).await;
    assert_eq!(
        old_thread["runs"].as_array().unwrap().len(),
        2,
        "{old_thread}"
    );
}

// A committed decision whose verdict cannot be read refuses the call (it was replayed as
// `allow` when the verdict was misspelt).
#[tokio::test]
async fn a_decision_with_an_unknown_verdict_is_refused_not_allowed() {
    let t = app(
        json!({"permissions": {"ask": ["echo"]}}),
        vec![prober("echo", "")],
        |_| {},
    )
    .await;
    let r = start_probe(
        &t,
        vec![
            calls(vec![call("echo", json!({"text": "hi"}))]),
            say("done"),
        ],
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let approval = loop {
        let pending = t
            .app
            .store
            .list_approvals(
                &"local".into(),
                Some(subagents::store::ApprovalStatus::Pending),
                Some(r.id),
                None,
                10,
            )
            .await
            .unwrap();
        if let Some(a) = pending.into_iter().next() {
            break a;
        }
        assert!(Instant::now() < deadline, "no approval");
        tokio::time::sleep(Duration::from_millis(30)).await;
    };
    // The stored decision's verdict is damaged while the run waits.
    let db = sqlx::SqlitePool::connect(&t.app.settings.database_url)
        .await
        .unwrap();
    let changed = sqlx::query("UPDATE sa_tool_decisions SET decision = replace(decision, '\"verdict\":\"ask\"', '\"verdict\":\"allwo\"')")
        .execute(&db)
        .await
        .unwrap()
        .rows_affected();
    assert_eq!(changed, 1);
    t.app
        .answer_approval(
            &approval.id,
            &"local".into(),
            subagents::store::ApprovalAnswer {
                allow: true,
                reason: None,
                updated_input: None,
                run_tree: false,
                by: "test".into(),
            },
        )
        .await
        .unwrap();
    let done = t.wait(r.id).await;
    let res = tool_texts(&t, &done).await;
    assert!(
        res[0].starts_with("error[permission_denied]") && res[0].contains("cannot be read"),
        "{res:?}"
    );
}
