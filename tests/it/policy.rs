//! Hooks, permissions and approvals with real command hooks (shell scripts written here), real
//! worker processes killed with SIGKILL, and the approvals API over HTTP.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use subagents::store::RunStatus;

use crate::delegation::{call, calls, say, start_parent};
use crate::support::*;

/// Writes an executable script into `dir` and returns its path.
fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, format!("#!/usr/bin/env bash\n{body}\n")).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p
}

/// An app whose settings file holds `settings` (and whose agent files are `jobs`).
async fn app_with_settings(
    settings: Value,
    jobs: Vec<(String, String)>,
    workers: bool,
) -> (TestApp, tempfile::TempDir) {
    let cfg = tempfile::tempdir().unwrap();
    let path = cfg.path().join("subagents.json");
    std::fs::write(&path, settings.to_string()).unwrap();
    let t = spawn_app_with(Options {
        jobs,
        workers,
        tweak: Box::new(move |s| s.settings_file = path),
        ..Default::default()
    })
    .await;
    (t, cfg)
}

fn hook(event: &str, matcher: &str, command: &Path, timeout: f64) -> Value {
    json!({"hooks": {event: [{"matcher": matcher, "hooks": [{"type": "command", "command": command, "timeout": timeout}]}]}})
}

#[tokio::test]
async fn a_hook_exiting_2_blocks_and_the_model_sees_its_stderr() {
    let dir = tempfile::tempdir().unwrap();
    let h = script(
        dir.path(),
        "block.sh",
        "cat > /dev/null; echo 'echo is closed for maintenance' >&2; exit 2",
    );
    let (t, _cfg) = app_with_settings(hook("PreToolUse", "echo", &h, 10.0), vec![], true).await;
    let r = t.run("SCENARIO steps=2 tool=echo run=block").await;
    assert_eq!(r.status, RunStatus::Succeeded);
    assert_eq!(
        tool_texts(&t, &r).await,
        ["error[blocked_by_hook]: echo is closed for maintenance"]
    );
    let events = t.events(r.id).await;
    let blocked = events
        .iter()
        .find(|e| e.kind == "hook.blocked")
        .expect("hook.blocked event");
    assert_eq!(blocked.data["reason"], "echo is closed for maintenance");
    assert!(
        events
            .iter()
            .any(|e| e.kind == "tool.completed" && e.data["ok"] == false)
    );
}

#[tokio::test]
async fn a_hook_rewrites_the_input_or_denies_by_json() {
    let dir = tempfile::tempdir().unwrap();
    let rewrite = script(
        dir.path(),
        "rewrite.sh",
        r#"cat > /dev/null; echo '{"hookSpecificOutput":{"hookEventName":"PreToolUse","permissionDecision":"allow","updatedInput":{"text":"rewritten by the hook"},"additionalContext":"remember the style guide"}}'"#,
    );
    let (t, _cfg) = app_with_settings(
        hook("PreToolUse", "Echo|echo", &rewrite, 10.0),
        vec![],
        true,
    )
    .await;
    let r = t.run("SCENARIO steps=2 tool=echo run=rewrite").await;
    assert_eq!(
        tool_texts(&t, &r).await,
        ["rewritten by the hook\n[hook context] remember the style guide"]
    );

    let deny = script(
        dir.path(),
        "deny.sh",
        r#"cat > /dev/null; echo '{"hookSpecificOutput":{"permissionDecision":"deny","permissionDecisionReason":"no echoes after midnight"}}'"#,
    );
    let (t, _cfg) = app_with_settings(hook("PreToolUse", "", &deny, 10.0), vec![], true).await;
    let r = t.run("SCENARIO steps=2 tool=echo run=deny").await;
    let res = tool_texts(&t, &r).await;
    assert!(
        res[0].starts_with("error[permission_denied]: no echoes after midnight"),
        "{res:?}"
    );
    let events = t.events(r.id).await;
    let denied = events.iter().find(|e| e.kind == "tool.denied").unwrap();
    assert_eq!(
        (denied.data["by"].as_str(), denied.data["tool"].as_str()),
        (Some("hook"), Some("echo"))
    );
}

#[tokio::test]
async fn post_tool_use_sees_the_response_and_broken_or_hanging_hooks_block_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let seen = dir.path().join("seen.json");
    let post = script(
        dir.path(),
        "post.sh",
        &format!(
            "cat > {}; echo '{{\"additionalContext\":\"checked\"}}'",
            seen.display()
        ),
    );
    let crash = script(dir.path(), "crash.sh", "kill -SEGV $$");
    let hang = script(dir.path(), "hang.sh", "sleep 30 & sleep 30");
    let settings = json!({"hooks": {
        "PreToolUse": [{"matcher": "echo", "hooks": [{"command": crash}, {"command": hang, "timeout": 0.5}]}],
        "PostToolUse": [{"matcher": "echo", "hooks": [{"command": post}]}],
    }});
    let (t, _cfg) = app_with_settings(settings, vec![], true).await;
    let t0 = Instant::now();
    let r = t.run("SCENARIO steps=2 tool=echo run=post").await;
    assert_eq!(r.status, RunStatus::Succeeded);
    assert!(
        t0.elapsed() < Duration::from_secs(20),
        "the hanging hook was cut at its timeout"
    );
    // The tool ran (a crashing and a hanging hook block nothing) and PostToolUse added its context.
    assert_eq!(
        tool_texts(&t, &r).await,
        ["step 1 call 1\n[hook context] checked"]
    );
    let input: Value = serde_json::from_str(&std::fs::read_to_string(&seen).unwrap()).unwrap();
    assert_eq!(input["hook_event_name"], "PostToolUse");
    assert_eq!(input["tool_name"], "echo");
    assert_eq!(input["tool_response"], "step 1 call 1");
    assert_eq!(input["tool_input"]["text"], "step 1 call 1");
    assert_eq!(input["run_id"], r.id.to_string());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_workers_replay_does_not_run_a_hook_twice() {
    let t = spawn_app_with(Options {
        workers: false,
        ..Default::default()
    })
    .await;
    let count = t.dir.path().join("hook-runs.txt");
    let h = script(
        t.dir.path(),
        "count.sh",
        &format!("cat >> {}; echo >> {}", count.display(), count.display()),
    );
    let settings = t.dir.path().join("subagents.json");
    std::fs::write(&settings, hook("PreToolUse", "echo", &h, 10.0).to_string()).unwrap();
    let r = t.start("SCENARIO steps=3 tool=echo run=replay").await;
    let go = t.dir.path().join("never");
    let env = |fp: Option<String>| {
        let mut e = vec![("SUBAGENTS_SETTINGS", settings.display().to_string())];
        if let Some(fp) = fp {
            e.push(("SUBAGENTS_FAILPOINTS", fp));
        }
        e
    };
    // Held after the first tool returned (decided, hook run) and before its result commits.
    let mut first = spawn_worker(
        t.dir.path(),
        &t.mock,
        &env(Some(format!("before_tool_commit=wait({})", go.display()))),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while !std::fs::read_to_string(&count)
        .unwrap_or_default()
        .contains("step 1 call 1")
    {
        assert!(Instant::now() < deadline, "the hook never ran");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    first.kill().unwrap();
    first.wait().unwrap();
    let mut second = spawn_worker(t.dir.path(), &t.mock, &env(None));
    let done = t
        .app
        .wait(r.id, Duration::from_secs(60))
        .await
        .unwrap()
        .unwrap();
    second.kill().unwrap();
    second.wait().unwrap();
    assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
    let log = std::fs::read_to_string(&count).unwrap();
    assert_eq!(
        log.matches("step 1 call 1").count(),
        1,
        "the committed decision was not decided again:\n{log}"
    );
    assert_eq!(log.matches("step 2 call 1").count(), 1);
}

#[tokio::test]
async fn a_child_never_gets_more_than_its_parent() {
    let parent = "---\nname: careful\ndescription: a parent that may not echo\ntools: [echo, Task]\npermissions:\n  deny: [\"echo\"]\n---\nYou delegate. MOCK:careful\n";
    let t = spawn_app_with(Options {
        jobs: vec![("careful".into(), parent.into())],
        ..Default::default()
    })
    .await;
    t.mock.state.set_script(subagents::model::mock::Script::from([(
        "careful".to_owned(),
        vec![calls(vec![call("task", json!({"description": "Echo it.\nSCENARIO steps=2 tool=echo run=kid", "subagent": "general-purpose"}))]), say("done")],
    )]));
    let p = start_parent(&t, "careful").await;
    assert_eq!(t.wait(p.id).await.status, RunStatus::Succeeded);
    let child = t.app.store.children(p.id).await.unwrap().remove(0);
    let res = tool_texts(&t, &child).await;
    assert!(
        res[0].starts_with("error[permission_denied]: denied by the rule `echo`")
            && res[0].contains("parent agent `careful`"),
        "{res:?}"
    );
    // The same child agent at the top level may echo.
    let top = t.run("SCENARIO steps=2 tool=echo run=top").await;
    assert_eq!(tool_texts(&t, &top).await, ["step 1 call 1"]);
}

const ASKER: &str = "---\nname: asker\ndescription: asks before echoing\ntools: [echo]\npermissions:\n  ask: [\"echo\"]\n---\nYou echo.";

struct Fleet {
    t: TestApp,
    api_base: String,
    settings: PathBuf,
    /// The database the app and its workers share, when not the test directory's SQLite file.
    database: Option<String>,
}

async fn approvals_fleet(jobs: Vec<(String, String)>) -> Fleet {
    approvals_fleet_on(jobs, None).await
}

async fn approvals_fleet_on(jobs: Vec<(String, String)>, database: Option<String>) -> Fleet {
    let url = database.clone();
    let t = spawn_app_with(Options {
        workers: false,
        jobs,
        tweak: Box::new(move |s| {
            if let Some(url) = url {
                s.database_url = url;
            }
        }),
        ..Default::default()
    })
    .await;
    let settings = t.dir.path().join("subagents.json");
    std::fs::write(&settings, "{}").unwrap();
    let api_base = t.serve("alice:alice-secret-key,bob:bob-secret-key").await;
    Fleet {
        t,
        api_base,
        settings,
        database,
    }
}

impl Fleet {
    fn worker(&self) -> Worker {
        let mut env = vec![
            ("SUBAGENTS_SETTINGS", self.settings.display().to_string()),
            ("SUBAGENTS_CONCURRENCY", "1".into()),
        ];
        if let Some(url) = &self.database {
            env.push(("DATABASE_URL", url.clone()));
        }
        spawn_worker(self.t.dir.path(), &self.t.mock, &env)
    }
    async fn api(
        &self,
        key: &str,
        m: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (u16, Value) {
        let mut b = reqwest::Client::new()
            .request(m, format!("{}{path}", self.api_base))
            .bearer_auth(key);
        if let Some(body) = body {
            b = b.json(&body);
        }
        let r = b.send().await.unwrap();
        (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
    }
    async fn start(&self, agent: &str, input: &str) -> Value {
        let (s, v) = self
            .api(
                "alice-secret-key",
                reqwest::Method::POST,
                "/v1/runs",
                Some(json!({"agent": agent, "input": input})),
            )
            .await;
        assert_eq!(s, 202, "{v}");
        v
    }
    async fn pending(&self, run: &str) -> Value {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let (_, v) = self
                .api(
                    "alice-secret-key",
                    reqwest::Method::GET,
                    &format!("/v1/approvals?status=pending&run_id={run}"),
                    None,
                )
                .await;
            if let Some(a) = v["approvals"].as_array().and_then(|a| a.first()) {
                return a.clone();
            }
            assert!(Instant::now() < deadline, "no approval appeared for {run}");
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
    }
    async fn status(&self, run: &str) -> Value {
        self.api(
            "alice-secret-key",
            reqwest::Method::GET,
            &format!("/v1/runs/{run}"),
            None,
        )
        .await
        .1
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_parks_the_run_survives_a_sigkill_and_resumes_when_answered() {
    let f = approvals_fleet(vec![("asker".into(), ASKER.into())]).await;
    approval_survives_a_sigkill(f).await;
}

/// The same on PostgreSQL, end to end: app and workers on one database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_an_approval_parks_survives_a_sigkill_and_resumes_when_answered() {
    let url = fresh_postgres_database().await;
    let f = approvals_fleet_on(vec![("asker".into(), ASKER.into())], Some(url)).await;
    approval_survives_a_sigkill(f).await;
}

async fn approval_survives_a_sigkill(f: Fleet) {
    let mut worker = f.worker();
    let asking = f.start("asker", "SCENARIO steps=2 tool=echo run=ask").await;
    let id = asking["id"].as_str().unwrap().to_owned();
    let approval = f.pending(&id).await;
    assert_eq!(approval["tool"], "echo");
    assert_eq!(approval["input"]["text"], "step 1 call 1");
    assert!(
        approval["reason"].as_str().unwrap().contains("echo"),
        "{approval}"
    );
    // Parked without its worker slot: with one slot, another run finishes meanwhile.
    let run = f.status(&id).await;
    assert_eq!(run["status"], "waiting");
    assert_eq!(run["approvals"][0]["id"], approval["id"]);
    let other = f
        .start("general-purpose", "SCENARIO steps=2 run=meanwhile")
        .await;
    assert_eq!(
        f.t.wait(other["id"].as_str().unwrap().parse().unwrap())
            .await
            .status,
        RunStatus::Succeeded
    );
    // The worker dies and another starts; the approval is still there.
    worker.kill().unwrap();
    worker.wait().unwrap();
    let mut worker = f.worker();
    let aid = approval["id"].as_str().unwrap();
    // Another owner cannot see or answer it.
    let (s, _) = f
        .api(
            "bob-secret-key",
            reqwest::Method::POST,
            &format!("/v1/approvals/{aid}"),
            Some(json!({"decision": "allow"})),
        )
        .await;
    assert_eq!(s, 404);
    let (s, _) = f
        .api(
            "bob-secret-key",
            reqwest::Method::GET,
            &format!("/v1/approvals/{aid}"),
            None,
        )
        .await;
    assert_eq!(s, 404);
    let (s, bad) = f
        .api(
            "alice-secret-key",
            reqwest::Method::POST,
            &format!("/v1/approvals/{aid}"),
            Some(json!({"decision": "maybe"})),
        )
        .await;
    assert_eq!(
        (s, bad["error"]["code"].as_str()),
        (422, Some("invalid_request"))
    );
    let (s, answered) = f.api("alice-secret-key", reqwest::Method::POST, &format!("/v1/approvals/{aid}"), Some(json!({"decision": "allow", "reason": "fine", "updated_input": {"text": "approved text"}}))).await;
    assert_eq!(s, 200, "{answered}");
    assert_eq!(answered["status"], "allowed");
    assert_eq!(answered["resolved_by"], "alice");
    let done = f.t.wait(id.parse().unwrap()).await;
    assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
    assert_eq!(tool_texts(&f.t, &done).await, ["approved text"]);
    // Answered once; a second answer is a conflict.
    let (s, again) = f
        .api(
            "alice-secret-key",
            reqwest::Method::POST,
            &format!("/v1/approvals/{aid}"),
            Some(json!({"decision": "deny"})),
        )
        .await;
    assert_eq!(
        (s, again["error"]["code"].as_str()),
        (409, Some("already_resolved"))
    );
    let kinds: Vec<String> =
        f.t.events(done.id)
            .await
            .into_iter()
            .map(|e| e.kind)
            .collect();
    for k in [
        "approval.requested",
        "run.waiting",
        "approval.resolved",
        "run.resumed",
        "run.succeeded",
    ] {
        assert!(kinds.iter().any(|x| x == k), "{k} missing from {kinds:?}");
    }
    worker.kill().unwrap();
    worker.wait().unwrap();
}

/// A run parked on an approval holds no worker, so a cancel ends it at once; its approval then
/// leaves the pending list, cannot be answered, and the call it asked about never runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_parked_on_an_approval_is_cancelled_at_once_and_its_approval_closes() {
    let f = approvals_fleet(vec![("asker".into(), ASKER.into())]).await;
    let mut worker = f.worker();
    let asking = f
        .start("asker", "SCENARIO steps=2 tool=echo run=cancel-ask")
        .await;
    let id = asking["id"].as_str().unwrap().to_owned();
    let approval = f.pending(&id).await;
    let aid = approval["id"].as_str().unwrap().to_owned();
    assert_eq!(f.status(&id).await["status"], "waiting");
    let (s, v) = f
        .api(
            "alice-secret-key",
            reqwest::Method::POST,
            &format!("/v1/runs/{id}/cancel"),
            Some(json!({})),
        )
        .await;
    assert_eq!(s, 202, "{v}");
    assert_eq!(
        v["status"], "cancelled",
        "a parked run holds no worker: it ends at once"
    );
    let (s, v) = f
        .api(
            "alice-secret-key",
            reqwest::Method::POST,
            &format!("/v1/approvals/{aid}"),
            Some(json!({"decision": "allow"})),
        )
        .await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (409, Some("already_resolved")),
        "{v}"
    );
    let (_, list) = f
        .api(
            "alice-secret-key",
            reqwest::Method::GET,
            &format!("/v1/approvals?status=pending&run_id={id}"),
            None,
        )
        .await;
    assert_eq!(
        list["approvals"].as_array().map(Vec::len),
        Some(0),
        "{list}"
    );
    let done = f.t.wait(id.parse().unwrap()).await;
    assert_eq!(done.status, RunStatus::Cancelled);
    let kinds: Vec<String> =
        f.t.events(done.id)
            .await
            .into_iter()
            .map(|e| e.kind)
            .collect();
    assert!(
        !kinds.iter().any(|k| k == "tool.completed"),
        "the call asked about never ran: {kinds:?}"
    );
    worker.kill().unwrap();
    worker.wait().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn denied_and_expired_approvals_reach_the_model() {
    let quick = ASKER
        .replace("name: asker", "name: quick")
        .replace("tools: [echo]", "tools: [echo]\napproval_timeout: 1s");
    let f = approvals_fleet(vec![
        ("asker".into(), ASKER.into()),
        ("quick".into(), quick),
    ])
    .await;
    let mut worker = f.worker();
    let denied = f
        .start("asker", "SCENARIO steps=2 tool=echo run=deny")
        .await;
    let id = denied["id"].as_str().unwrap().to_owned();
    let a = f.pending(&id).await;
    // Through the CLI this time: list the inbox, then deny.
    let cli = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_subagents"))
            .args(args)
            .args(["--url", &f.api_base, "--key", "alice-secret-key"])
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let aid = a["id"].as_str().unwrap();
    let (code, listed) = tokio::task::block_in_place(|| cli(&["approvals"]));
    assert_eq!(code, Some(0));
    assert!(
        listed.contains(aid) && listed.contains("echo") && listed.contains("pending"),
        "{listed}"
    );
    let (code, denied_out) =
        tokio::task::block_in_place(|| cli(&["deny", aid, "--reason", "not in production"]));
    assert_eq!(code, Some(0), "{denied_out}");
    assert!(denied_out.contains("\"denied\""), "{denied_out}");
    let done = f.t.wait(id.parse().unwrap()).await;
    let res = tool_texts(&f.t, &done).await;
    assert!(
        res[0]
            .starts_with("error[permission_denied]: a person denied this call: not in production"),
        "{res:?}"
    );

    let expiring = f
        .start("quick", "SCENARIO steps=2 tool=echo run=expire")
        .await;
    let id = expiring["id"].as_str().unwrap().to_owned();
    let a = f.pending(&id).await;
    let done = f.t.wait(id.parse().unwrap()).await;
    assert_eq!(done.status, RunStatus::Succeeded);
    assert!(tool_texts(&f.t, &done).await[0].starts_with("error[approval_expired]"));
    let (_, after) = f
        .api(
            "alice-secret-key",
            reqwest::Method::GET,
            &format!("/v1/approvals/{}", a["id"].as_str().unwrap()),
            None,
        )
        .await;
    assert_eq!(after["status"], "expired");
    let (s, _) = f
        .api(
            "alice-secret-key",
            reqwest::Method::POST,
            &format!("/v1/approvals/{}", a["id"].as_str().unwrap()),
            Some(json!({"decision": "allow"})),
        )
        .await;
    assert_eq!(s, 409, "too late");
    worker.kill().unwrap();
    worker.wait().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_for_the_run_tree_is_not_asked_again_in_children() {
    let parent = "---\nname: boss\ndescription: delegates twice\ntools: [Task, echo]\n---\nYou delegate. MOCK:boss\n";
    let f = approvals_fleet(vec![
        ("asker".into(), ASKER.into()),
        ("boss".into(), parent.into()),
    ])
    .await;
    f.t.mock.state.set_script(subagents::model::mock::Script::from([(
        "boss".to_owned(),
        vec![
            calls(vec![call("task", json!({"description": "First.\nSCENARIO steps=2 tool=echo run=c1", "subagent": "asker"}))]),
            calls(vec![call("task", json!({"description": "Second.\nSCENARIO steps=2 tool=echo run=c2", "subagent": "asker"}))]),
            say("both done"),
        ],
    )]));
    let mut worker = f.worker();
    let boss = f.start("boss", "Coordinate.").await;
    let boss_id = boss["id"].as_str().unwrap().to_owned();
    // The first child's approval shows in the inbox with its root run.
    let deadline = Instant::now() + Duration::from_secs(30);
    let a = loop {
        let (_, v) = f
            .api(
                "alice-secret-key",
                reqwest::Method::GET,
                "/v1/approvals?status=pending",
                None,
            )
            .await;
        if let Some(a) = v["approvals"].as_array().and_then(|a| a.first()).cloned() {
            break a;
        }
        assert!(Instant::now() < deadline, "no approval");
        tokio::time::sleep(Duration::from_millis(30)).await;
    };
    assert_eq!(a["root_run_id"], boss_id.as_str());
    assert_ne!(a["run_id"], boss_id.as_str());
    let (s, _) = f
        .api(
            "alice-secret-key",
            reqwest::Method::POST,
            &format!("/v1/approvals/{}", a["id"].as_str().unwrap()),
            Some(json!({"decision": "allow", "scope": "run_tree"})),
        )
        .await;
    assert_eq!(s, 200);
    let done = f.t.wait(boss_id.parse().unwrap()).await;
    assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
    let kids = f.t.app.store.children(done.id).await.unwrap();
    assert_eq!(kids.len(), 2);
    for k in &kids {
        assert_eq!(
            tool_texts(&f.t, k).await,
            ["step 1 call 1"],
            "child {}",
            k.id
        );
    }
    let (_, all) = f
        .api(
            "alice-secret-key",
            reqwest::Method::GET,
            "/v1/approvals",
            None,
        )
        .await;
    assert_eq!(
        all["approvals"].as_array().unwrap().len(),
        1,
        "the second child was not asked: {all}"
    );
    // Elsewhere the same agent still asks.
    let other = f
        .start("asker", "SCENARIO steps=2 tool=echo run=outside")
        .await;
    f.pending(other["id"].as_str().unwrap()).await;
    worker.kill().unwrap();
    worker.wait().unwrap();
}

#[tokio::test]
async fn an_http_hook_gets_the_same_json_and_answers_the_same_way() {
    use std::sync::{Arc, Mutex};
    let seen: Arc<Mutex<Vec<Value>>> = Arc::default();
    let store = seen.clone();
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post(move |axum::Json(v): axum::Json<Value>| {
            let store = store.clone();
            async move {
                store.lock().unwrap().push(v);
                axum::Json(json!({"hookSpecificOutput": {"permissionDecision": "deny", "permissionDecisionReason": "the policy service says no"}}))
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let settings = json!({"hooks": {"PreToolUse": [{"matcher": "echo", "hooks": [{"type": "http", "url": format!("http://{addr}/hook"), "timeout": 5}]}]}});
    let (t, _cfg) = app_with_settings(settings, vec![], true).await;
    let r = t.run("SCENARIO steps=2 tool=echo run=http").await;
    assert!(
        tool_texts(&t, &r).await[0]
            .starts_with("error[permission_denied]: the policy service says no")
    );
    let got = seen.lock().unwrap().clone();
    assert_eq!(got.len(), 1);
    assert_eq!(
        (
            got[0]["hook_event_name"].as_str(),
            got[0]["tool_name"].as_str()
        ),
        (Some("PreToolUse"), Some("echo"))
    );
    assert_eq!(got[0]["tool_input"]["text"], "step 1 call 1");
}

#[tokio::test]
async fn a_broken_settings_file_stops_start_up_with_the_reason() {
    let cfg = tempfile::tempdir().unwrap();
    let path = cfg.path().join("subagents.json");
    std::fs::write(&path, r#"{"permissions": {"deny": ["Bash(rm"]}}"#).unwrap();
    let mock =
        subagents::model::mock::MockServer::start(([127, 0, 0, 1], 0).into(), Default::default())
            .await
            .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut s = test_settings(dir.path(), &mock);
    s.settings_file = path;
    let e = subagents::app::App::open(s).await.err().expect("refused");
    assert!(
        e.to_string().contains("subagents.json") && e.to_string().contains("Bash(rm"),
        "{e}"
    );
}
