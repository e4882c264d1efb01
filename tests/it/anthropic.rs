//! Claude models through Anthropic's Messages API, natively: the mock's `/v1/messages` is the
//! API, the queue and the store are real. Prompt caching is checked by the figures the mock's
//! own cache reports, a killed worker's resumed step by what the mock served.

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use subagents::app::{App, StartRun};
use subagents::config::Settings;
use subagents::model::mock::{LogEntry, MockOptions, MockServer};
use subagents::store::RunStatus;

use crate::support::*;

/// Claude models go to the test's mock as Anthropic: the key is set and the endpoint is the
/// mock's.
fn claude(s: &mut Settings) {
    s.anthropic_api_key = Some("test-key".into());
    s.anthropic_base_url = s.openai_base_url.clone();
    s.default_model = "claude-sonnet-4-5".into();
}

/// A task long enough for the prompt cache (the mock caches prefixes of 1024 tokens and more).
fn long_task(scenario: &str) -> String {
    format!(
        "{}\nSCENARIO {scenario}",
        "Background for the task, read it all. ".repeat(150)
    )
}

fn requests(log: &[LogEntry], marker: &str) -> Vec<LogEntry> {
    log.iter()
        .filter(|e| e.scenario.contains(marker) && e.status == 200)
        .cloned()
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claude_run_with_tools_reads_the_previous_step_from_the_cache() {
    let t = spawn_app_with(Options {
        tweak: Box::new(claude),
        ..Default::default()
    })
    .await;
    let r = t.run(&long_task("steps=4 tool=echo run=cached")).await;
    assert_eq!(r.status, RunStatus::Succeeded, "{r:?}");
    assert_eq!(r.result.as_deref(), Some("DONE after 4 steps"));
    let log = requests(&t.mock.state.log(), "run=cached");
    assert_eq!(log.len(), 4, "{log:#?}");
    assert!(
        log.iter()
            .all(|e| e.api == "anthropic" && e.model == "claude-sonnet-4-5")
    );
    assert_eq!(
        log[0].cache_read_tokens, 0,
        "nothing cached before the first step"
    );
    assert_eq!(
        log[0].cache_write_tokens, log[0].prompt_tokens,
        "the first step writes its whole prefix"
    );
    for pair in log.windows(2) {
        assert_eq!(
            pair[1].cache_read_tokens, pair[0].prompt_tokens,
            "each step reads the whole previous request from the cache: {pair:#?}"
        );
        assert!(pair[1].cache_write_tokens > 0);
        assert!(pair[1].cache_write_tokens < pair[1].cache_read_tokens / 4);
    }
    // The usage the run committed carries the cache figures the provider reported.
    let events = t.events(r.id).await;
    let reads: Vec<u64> = events
        .iter()
        .filter(|e| e.kind == "model.completed")
        .map(|e| e.data["usage"]["cache_read_tokens"].as_u64().unwrap_or(0))
        .collect();
    assert_eq!(reads.len(), 4);
    assert_eq!(reads[0], 0);
    assert!(reads[1..].iter().all(|n| *n > 0), "{reads:?}");
    assert_eq!(
        r.usage.cache_read_tokens,
        reads.iter().sum::<u64>(),
        "the run's usage sums its steps' cache reads"
    );
    assert_eq!(
        r.usage.cache_write_tokens,
        log.iter().map(|e| e.cache_write_tokens).sum::<u64>()
    );
    let pinned = t.app.store.run_pins(r.id).await.unwrap();
    assert_eq!(
        pinned.get("provider").map(String::as_str),
        Some("anthropic")
    );

    // The same run with caching off costs more: every step pays for its whole prompt.
    let off = spawn_app_with(Options {
        tweak: Box::new(|s| {
            claude(s);
            s.models =
                r#"[{"match": "claude-*", "provider": "anthropic", "caching": false}]"#.into();
        }),
        ..Default::default()
    })
    .await;
    let uncached = off.run(&long_task("steps=4 tool=echo run=cached")).await;
    assert_eq!(uncached.status, RunStatus::Succeeded);
    let log_off = requests(&off.mock.state.log(), "run=cached");
    assert!(
        log_off
            .iter()
            .all(|e| e.cache_read_tokens == 0 && e.cache_write_tokens == 0)
    );
    let (with, without) = (r.cost_nanos, uncached.cost_nanos);
    println!(
        "4-step claude-sonnet-4-5 run: ${:.6} with prompt caching, ${:.6} without ({:.0}% saved)",
        with as f64 / 1e9,
        without as f64 / 1e9,
        100.0 * (1.0 - with as f64 / without as f64)
    );
    assert!(with > 0 && with * 10 < without * 6, "{with} vs {without}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claude_answer_to_a_schema_comes_through_the_result_tool() {
    let t = spawn_app_with(Options {
        tweak: Box::new(claude),
        ..Default::default()
    })
    .await;
    let schema = json!({
        "type": "object",
        "properties": {"title": {"type": "string", "minLength": 3}, "n": {"type": "integer", "minimum": 2}},
        "required": ["title", "n"]
    });
    let run = t
        .app
        .start_run(StartRun {
            input: "Summarise as data.".into(),
            output_schema: Some(schema.clone()),
            ..Default::default()
        })
        .await
        .unwrap();
    let r = t.wait(run.id).await;
    assert_eq!(r.status, RunStatus::Succeeded, "{r:?}");
    let data: Value = serde_json::from_str(r.result.as_deref().unwrap()).unwrap();
    assert!(jsonschema::is_valid(&schema, &data), "{data}");
    assert_eq!(data["n"], 2);
    let log = t.mock.state.log();
    assert!(
        log.iter().any(|e| e.api == "anthropic"
            && e.structured
            && e.tools.iter().any(|n| n == "final_result")),
        "{log:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overloaded_and_rate_limited_answers_are_retried() {
    let t = spawn_app_with(Options {
        tweak: Box::new(claude),
        ..Default::default()
    })
    .await;
    for status in [529, 429] {
        let r = t
            .run(&format!(
                "Go.\nSCENARIO steps=3 tool=echo fail_every=2 fail_status={status} retry_after=0 run=f{status}"
            ))
            .await;
        assert_eq!(r.status, RunStatus::Succeeded, "{status}: {r:?}");
        let log = t.mock.state.log();
        let refused = log
            .iter()
            .filter(|e| e.scenario.contains(&format!("run=f{status}")) && e.status == status)
            .count();
        assert!(refused >= 1, "{status} was never sent");
    }
}

/// A worker killed while a Claude step streams: the new worker sends the same request again,
/// which the cache serves whole, and no committed step is asked twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claude_run_killed_mid_stream_resumes_from_its_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("jobs")).unwrap();
    let mock = MockServer::start(([127, 0, 0, 1], 0).into(), MockOptions::default())
        .await
        .unwrap();
    let mut settings = test_settings(dir.path(), &mock);
    claude(&mut settings);
    let app = App::open(settings).await.unwrap();
    let run = app
        .start_run(StartRun {
            input: long_task("steps=6 tool=echo chunk_ms=30 run=killed"),
            ..Default::default()
        })
        .await
        .unwrap();
    let env = [
        ("ANTHROPIC_API_KEY", "x".to_owned()),
        ("ANTHROPIC_BASE_URL", mock.base_url()),
        ("SUBAGENTS_MODEL", "claude-sonnet-4-5".to_owned()),
    ];
    let mut first = spawn_worker(dir.path(), &mock, &env);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let r = app.store.get_run(run.id).await.unwrap().unwrap();
        if r.step >= 2 {
            break;
        }
        assert!(Instant::now() < deadline, "worker made no progress: {r:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Into the next step's stream.
    let streaming = Instant::now() + Duration::from_secs(30);
    while !mock
        .state
        .log()
        .iter()
        .any(|e| e.step_key == format!("{}:3", run.id))
    {
        assert!(Instant::now() < streaming, "step 3 was never asked");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    first.kill().unwrap();
    first.wait().unwrap();
    let committed = app.store.get_run(run.id).await.unwrap().unwrap().step;

    let mut second = spawn_worker(dir.path(), &mock, &env);
    let done = app
        .wait(run.id, Duration::from_secs(90))
        .await
        .unwrap()
        .unwrap();
    second.kill().unwrap();
    second.wait().unwrap();
    assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
    assert_eq!(done.result.as_deref(), Some("DONE after 6 steps"));
    let log = mock.state.log();
    let served = count_served(&log);
    for step in 1..=6u32 {
        let key = format!("{}:{step}", run.id);
        let n = served.get(&key).copied().unwrap_or(0);
        if step == committed + 1 {
            assert!(
                (1..=2).contains(&n),
                "in-flight step {step} served {n} times"
            );
            if n == 2 {
                let again: Vec<&LogEntry> = log
                    .iter()
                    .filter(|e| e.step_key == key && e.status == 200)
                    .collect();
                assert_eq!(
                    again[1].cache_read_tokens, again[1].prompt_tokens,
                    "the replayed request is the same bytes: the cache serves all of it"
                );
            }
        } else {
            assert_eq!(
                n, 1,
                "step {step} served {n} times (committed: {committed})"
            );
        }
    }
    assert!(log.iter().all(|e| e.api == "anthropic"));
    assert_gap_free(
        &app.store.events_after(run.id, 0, 10_000).await.unwrap(),
        RunStatus::Succeeded,
    );
}

/// With extended thinking on, each answer starts with a signed thinking block; the checkpoint
/// keeps it and the next step sends it back first in its turn, signature intact (the mock
/// refuses a tool-use turn without it, as the API does).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thinking_blocks_are_kept_and_sent_back_with_their_signatures() {
    let t = spawn_app_with(Options {
        tweak: Box::new(|s| {
            claude(s);
            s.models = r#"[{"match": "claude-*", "provider": "anthropic", "thinking_budget": 2048, "max_output": 8192}]"#.into();
        }),
        ..Default::default()
    })
    .await;
    let r = t
        .run("Think.\nSCENARIO steps=3 tool=echo run=thinking")
        .await;
    assert_eq!(r.status, RunStatus::Succeeded, "{r:?}");
    assert_eq!(r.result.as_deref(), Some("DONE after 3 steps"));
    let msgs = t
        .app
        .store
        .thread_messages(&r.thread_id, 1000)
        .await
        .unwrap();
    let kept: Vec<&Value> = msgs
        .iter()
        .filter_map(|m| match &m.message {
            subagents::model::Message::Assistant { thinking, .. } => thinking.first(),
            _ => None,
        })
        .collect();
    assert_eq!(kept.len(), 3, "every answer kept its thinking: {msgs:#?}");
    assert!(kept.iter().all(|b| {
        b["type"] == "thinking"
            && b["signature"]
                .as_str()
                .is_some_and(|s| s.starts_with("mocksig_"))
    }));
    let served = requests(&t.mock.state.log(), "run=thinking");
    assert_eq!(served.len(), 3, "no step was refused and retried");
}

/// A Claude Code agent file naming `model: sonnet` runs on Claude through Anthropic when its key
/// is set, with no alias configured; without the key the same file runs on the default model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claude_code_agent_file_reaches_claude_through_its_alias() {
    let agent = (
        "reviewer".to_owned(),
        "---\nname: reviewer\ndescription: Reviews code\ntools: Read, Grep\nmodel: sonnet\n---\nYou review code.\n"
            .to_owned(),
    );
    for (with_key, expected) in [(true, "claude-sonnet-4-5"), (false, "mock-model")] {
        let t = spawn_app_with(Options {
            tweak: Box::new(move |s| {
                if with_key {
                    claude(s);
                    s.default_model = "mock-model".into();
                } else {
                    s.anthropic_api_key = None;
                }
            }),
            jobs: vec![agent.clone()],
            ..Default::default()
        })
        .await;
        let run = t
            .app
            .start_run(StartRun {
                agent: Some("reviewer".into()),
                input: "Review it.".into(),
                ..Default::default()
            })
            .await
            .unwrap();
        let r = t.wait(run.id).await;
        assert_eq!(r.status, RunStatus::Succeeded, "{r:?}");
        let log = t.mock.state.log();
        assert_eq!(log.len(), 1, "{log:#?}");
        assert_eq!(log[0].model, expected);
        assert_eq!(log[0].api, if with_key { "anthropic" } else { "openai" });
    }
}

/// A models-table entry's `api_key_env` holds the key in a real process, whose environment no
/// longer shows secrets once it has started: `subagents run` on a Claude model reaches the mock's
/// `/v1/messages` with that key (the mock refuses a request without one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_entrys_own_key_variable_is_used_by_a_real_process() {
    let t = spawn_app_with(Options {
        workers: false,
        ..Default::default()
    })
    .await;
    let table = json!([{
        "match": "claude-*", "provider": "anthropic",
        "base_url": t.mock.base_url(), "api_key_env": "MY_CLAUDE_KEY"
    }]);
    let out = tokio::task::spawn_blocking({
        let mut cmd = cli_command(&t, env!("CARGO_BIN_EXE_subagents"));
        cmd.args([
            "run",
            "--quiet",
            "Go.\nSCENARIO steps=2 tool=echo run=own-key",
        ])
        .env("SUBAGENTS_MODEL", "claude-haiku-4-5")
        .env("SUBAGENTS_MODELS", table.to_string())
        .env("MY_CLAUDE_KEY", "sk-ant-test")
        .env_remove("ANTHROPIC_API_KEY");
        move || cmd.output().unwrap()
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "DONE after 2 steps"
    );
    let log = requests(&t.mock.state.log(), "run=own-key");
    assert_eq!(log.len(), 2);
    assert!(
        log.iter()
            .all(|e| e.api == "anthropic" && e.model == "claude-haiku-4-5")
    );
}

/// An agent whose model's provider has no key is named at start, in the log, while the default
/// model (which has one) still runs: the agent's runs would fail `kind=model`, and the operator
/// hears it before the first one does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_on_a_provider_without_its_key_is_named_at_start() {
    let t = spawn_app_with(Options {
        workers: false,
        jobs: vec![(
            "claude-reviewer".into(),
            "---\nname: claude-reviewer\ndescription: Reviews\nmodel: claude-opus-4-5\n---\nYou review.\n"
                .into(),
        )],
        ..Default::default()
    })
    .await;
    let out = tokio::task::spawn_blocking({
        let mut cmd = cli_command(&t, env!("CARGO_BIN_EXE_subagents"));
        cmd.args(["run", "--quiet", "Hello."])
            .env(
                "SUBAGENTS_MODELS",
                r#"[{"match": "claude-*", "provider": "anthropic"}]"#,
            )
            .env_remove("ANTHROPIC_API_KEY");
        move || cmd.output().unwrap()
    })
    .await
    .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("claude-reviewer") && err.contains("ANTHROPIC_API_KEY is not set"),
        "{err}"
    );
}
