//! Pinning: a run keeps the agent definition it started with while its file is edited or
//! deleted (seen in the model's requests), a new run takes the current file, and a long-running
//! process notices the change without a restart.

use std::time::{Duration, Instant};

use serde_json::json;
use subagents::app::StartRun;
use subagents::model::mock::Script;
use subagents::store::RunStatus;

use crate::delegation::{call, calls, say};
use crate::support::*;

fn job(prompt: &str) -> String {
    format!(
        "---\nname: pinned\ndescription: a parent whose file changes\n---\n{prompt} MOCK:pinned\n"
    )
}

async fn start(t: &TestApp, input: &str) -> subagents::store::RunRecord {
    t.app
        .start_run(StartRun {
            agent: Some("pinned".into()),
            input: input.into(),
            ..Default::default()
        })
        .await
        .unwrap()
}

async fn parked(t: &TestApp, run: subagents::ids::RunId) {
    let t0 = Instant::now();
    while t.app.store.get_run(run).await.unwrap().unwrap().status != RunStatus::Waiting {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the run parks on its child"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until this process sees the file's new version (it looks at most once a second).
async fn reloaded(t: &TestApp, old: &str) -> Option<String> {
    let t0 = Instant::now();
    loop {
        let now = t
            .app
            .agents
            .current()
            .get("pinned")
            .map(|a| a.version.clone());
        if now.as_deref() != Some(old) {
            return now;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the change is noticed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The system prompts of the model requests made for the run whose input is `input`.
fn prompts(t: &TestApp, input: &str) -> Vec<String> {
    t.mock
        .state
        .log()
        .into_iter()
        .filter(|e| e.status == 200 && e.user_texts.first().map(String::as_str) == Some(input))
        .map(|e| e.system)
        .collect()
}

#[tokio::test]
async fn a_parked_run_keeps_its_agent_version_when_the_file_changes_or_goes() {
    let t = spawn_app_with(Options {
        jobs: vec![("pinned".into(), job("PROMPT-V1"))],
        ..Default::default()
    })
    .await;
    t.mock.state.set_script(Script::from([(
        "pinned".to_owned(),
        vec![
            calls(vec![call(
                "task",
                json!({"description": "Slow child.\nSCENARIO steps=2 latency_ms=1200 run=pin-kid", "subagent": "general-purpose"}),
            )]),
            say("parent done"),
        ],
    )]));
    let v1 = t
        .app
        .agents
        .current()
        .get("pinned")
        .unwrap()
        .version
        .clone();
    let first = start(&t, "FIRST PARENT").await;
    assert_eq!(first.agent_version.as_deref(), Some(v1.as_str()));
    parked(&t, first.id).await;

    // Edited while the first run is parked: new runs take the new file.
    let file = t.dir.path().join("jobs").join("pinned.md");
    std::fs::write(&file, job("PROMPT-V2")).unwrap();
    let v2 = reloaded(&t, &v1).await.expect("the agent still exists");
    let second = start(&t, "SECOND PARENT").await;
    assert_eq!(second.agent_version.as_deref(), Some(v2.as_str()));
    parked(&t, second.id).await;

    // Deleted while the second one is parked.
    std::fs::remove_file(&file).unwrap();
    assert_eq!(reloaded(&t, &v2).await, None, "the deletion is noticed");
    match t
        .app
        .start_run(StartRun {
            agent: Some("pinned".into()),
            input: "THIRD".into(),
            ..Default::default()
        })
        .await
    {
        Err(subagents::app::StartError::UnknownAgent { .. }) => {}
        other => panic!("a new run of a deleted agent is refused: {other:?}"),
    }

    for run in [&first, &second] {
        let done = t.wait(run.id).await;
        assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
        assert_eq!(done.result.as_deref(), Some("parent done"));
        assert_eq!(done.agent_version, run.agent_version);
    }
    let first_prompts = prompts(&t, "FIRST PARENT");
    assert!(
        first_prompts.len() >= 2,
        "before and after the park: {first_prompts:?}"
    );
    assert!(
        first_prompts.iter().all(|p| p.starts_with("PROMPT-V1")),
        "the first run ran its own version throughout: {first_prompts:?}"
    );
    let second_prompts = prompts(&t, "SECOND PARENT");
    assert!(second_prompts.len() >= 2, "{second_prompts:?}");
    assert!(
        second_prompts.iter().all(|p| p.starts_with("PROMPT-V2")),
        "the second run ran the version it started with, after its file was deleted: {second_prompts:?}"
    );
}

/// The run as `GET /v1/runs/{id}` shows it.
async fn view(t: &TestApp, run: &str) -> serde_json::Value {
    let id: subagents::ids::RunId = run.parse().unwrap();
    let r = t.app.store.get_run(id).await.unwrap().unwrap();
    let v = subagents::api::views::RunView::build(t.app.store.as_ref(), r)
        .await
        .unwrap();
    serde_json::to_value(v).unwrap()
}

#[tokio::test]
async fn a_parked_run_keeps_its_settings_and_model_when_the_settings_file_changes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("settings.json");
    std::fs::write(
        &path,
        json!({"permissions": {"allow": ["echo"]}}).to_string(),
    )
    .unwrap();
    let file = path.clone();
    let t = spawn_app_with(Options {
        jobs: vec![("pinned".into(), job("PROMPT"))],
        tweak: Box::new(move |s| s.settings_file = file),
        ..Default::default()
    })
    .await;
    t.mock.state.set_script(Script::from([(
        "pinned".to_owned(),
        vec![
            calls(vec![call(
                "task",
                json!({"description": "Slow child.\nSCENARIO steps=2 latency_ms=1200 run=pin-set", "subagent": "general-purpose"}),
            )]),
            calls(vec![call("echo", json!({"text": "after the park"}))]),
            say("parent done"),
        ],
    )]));
    let settings = &t.app.engine.settings.policy.settings;
    let v1 = settings.current().version.clone();
    let first = start(&t, "FIRST PARENT").await;
    parked(&t, first.id).await;

    // Tightened while the first run is parked: new runs answer to the new file.
    std::fs::write(
        &path,
        json!({"permissions": {"deny": ["echo"]}}).to_string(),
    )
    .unwrap();
    let t0 = Instant::now();
    while settings.current().version == v1 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the change is noticed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let v2 = settings.current().version.clone();
    let second = start(&t, "SECOND PARENT").await;

    let done = t.wait(first.id).await;
    assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
    let view = view(&t, &first.id.to_string()).await;
    assert_eq!(view["pins"]["settings"], v1.as_str(), "{view}");
    assert_eq!(view["pins"]["provider"], "openai", "{view}");
    assert_eq!(
        view["pins"]["model"],
        t.app.settings.default_model.as_str(),
        "{view}"
    );
    let child = view["children"][0].as_str().unwrap().to_owned();
    let child_view = self::view(&t, &child).await;
    assert_eq!(
        child_view["pins"]["settings"],
        v1.as_str(),
        "a child runs under its parent's settings, though it started after the change: {child_view}"
    );
    let results = tool_texts(&t, &done).await;
    assert!(
        results.last().is_some_and(|r| r.contains("after the park")),
        "the first run's echo ran under the settings it started with: {results:?}"
    );

    let done = t.wait(second.id).await;
    assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
    let view = self::view(&t, &second.id.to_string()).await;
    assert_eq!(view["pins"]["settings"], v2.as_str(), "{view}");
    let results = tool_texts(&t, &done).await;
    assert!(
        results
            .last()
            .is_some_and(|r| r.starts_with("error[permission_denied]")),
        "a new run answers to the new file: {results:?}"
    );
}
