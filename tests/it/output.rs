//! Structured results end to end: answers checked against an output schema, sent back with the
//! errors while retries last, a run that fails `kind=output` rather than succeed with an answer
//! its schema refuses, and the JSON handed to parents, the run view and the CLI.

use serde_json::{Value, json};
use subagents::model::mock::Script;
use subagents::store::RunStatus;

use crate::delegation::{call, calls, parent_job, say, start_parent, tool_results};
use crate::support::*;

/// An agent whose answers must be a person; its turns come from the script `name`.
fn person_agent(name: &str, retries: Option<u32>) -> (String, String) {
    let retries = retries
        .map(|r| format!("output_retries: {r}\n"))
        .unwrap_or_default();
    (
        name.to_owned(),
        format!(
            "---\nname: {name}\ndescription: extracts a person\ntools: [echo]\n{retries}output_schema:\n  type: object\n  properties:\n    name: {{type: string}}\n    age: {{type: integer, minimum: 0}}\n  required: [name, age]\n  additionalProperties: false\n---\nAnswer with the person as JSON. MOCK:{name}\n"
        ),
    )
}

fn kinds_of(events: &[subagents::store::EventRecord], kind: &str) -> Vec<Value> {
    events
        .iter()
        .filter(|e| e.kind == kind)
        .map(|e| e.data.clone())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_childs_invalid_answer_goes_back_and_its_valid_answer_reaches_the_parent_as_json() {
    let t = spawn_app_with(Options {
        jobs: vec![parent_job("boss"), person_agent("extractor", None)],
        ..Default::default()
    })
    .await;
    t.mock.state.set_script(Script::from([
        (
            "boss".to_owned(),
            vec![
                calls(vec![call(
                    "task",
                    json!({"description": "Who is in the text?", "subagent": "extractor"}),
                )]),
                say("the parent is done"),
            ],
        ),
        (
            "extractor".to_owned(),
            vec![
                // A model that ignores the format, then one that fixes its answer.
                say("The person is Ada, aged 36."),
                say("```json\n{\"name\": \"Ada\", \"age\": 36}\n```"),
            ],
        ),
    ]));
    let parent = start_parent(&t, "boss").await;
    let parent = t.wait(parent.id).await;
    assert_eq!(parent.status, RunStatus::Succeeded, "{parent:?}");
    let results = tool_results(&t, &parent).await;
    assert_eq!(
        results[0]["result"],
        json!({"name": "Ada", "age": 36}),
        "the task result is the child's JSON itself: {results:?}"
    );
    let children = t.app.store.children(parent.id).await.unwrap();
    let child = children[0].clone();
    assert_eq!(child.status, RunStatus::Succeeded);
    let stored: Value = serde_json::from_str(child.result.as_deref().unwrap()).unwrap();
    assert_eq!(stored, json!({"name": "Ada", "age": 36}), "fence dropped");
    let events = t.events(child.id).await;
    let rejected = kinds_of(&events, "output.rejected");
    assert_eq!(rejected.len(), 1, "{rejected:?}");
    assert_eq!(rejected[0]["retries_left"], 1);
    assert!(
        rejected[0]["errors"][0]
            .as_str()
            .unwrap()
            .contains("not JSON"),
        "{rejected:?}"
    );
    // Both of the child's requests asked for the schema; the second carried the errors.
    let asked: Vec<_> = t
        .mock
        .state
        .log()
        .into_iter()
        .filter(|e| e.step_key.starts_with(&child.id.to_string()))
        .collect();
    assert_eq!(asked.len(), 2, "{asked:?}");
    assert!(asked.iter().all(|e| e.structured), "{asked:?}");
    assert!(
        asked[1]
            .user_texts
            .iter()
            .any(|u| u.starts_with("[subagents:output_invalid]")),
        "{:?}",
        asked[1].user_texts
    );
    // The run view carries the answer as JSON.
    let base = t.serve("").await;
    let view: Value = reqwest::get(format!("{base}/v1/runs/{}", child.id))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        view["result_json"],
        json!({"name": "Ada", "age": 36}),
        "{view}"
    );
    let plain: Value = reqwest::get(format!("{base}/v1/runs/{}", parent.id))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(plain.get("result_json").is_none(), "{plain}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_that_stays_invalid_fails_the_run_with_kind_output_never_success() {
    let t = spawn_app_with(Options {
        jobs: vec![person_agent("stubborn", Some(3))],
        ..Default::default()
    })
    .await;
    t.mock.state.set_script(Script::from([(
        "stubborn".to_owned(),
        vec![
            say("no JSON here"),
            say("{\"name\": \"Ada\"}"),
            say("{\"name\": \"Ada\", \"age\": 36}"),
        ],
    )]));
    let base = t.serve("").await;
    let http = reqwest::Client::new();
    // The start's retries (1) override the agent file's (3).
    let started: Value = http
        .post(format!("{base}/v1/runs/wait"))
        .json(&json!({"agent": "stubborn", "input": "Who?", "output_retries": 1, "timeout_s": 60}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(started["status"], "failed", "{started}");
    assert_eq!(started["error"]["kind"], "output", "{started}");
    let message = started["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("/age") || message.contains("\"age\""),
        "the last errors are in the failure: {message}"
    );
    assert!(started.get("result_json").is_none(), "{started}");
    let id: subagents::ids::RunId = started["id"].as_str().unwrap().parse().unwrap();
    let events = t.events(id).await;
    assert_eq!(kinds_of(&events, "output.rejected").len(), 1);
    assert_eq!(kinds_of(&events, "run.succeeded").len(), 0);
    assert_eq!(kinds_of(&events, "run.failed").len(), 1);
    let served = t
        .mock
        .state
        .log()
        .iter()
        .filter(|e| e.step_key.starts_with(&id.to_string()))
        .count();
    assert_eq!(
        served, 2,
        "one answer and one retry, the third turn never asked"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_with_a_schema_gets_the_providers_structured_answer_and_bad_schemas_are_refused() {
    let t = spawn_app().await;
    let base = t.serve("").await;
    let http = reqwest::Client::new();
    let schema = json!({
        "type": "object",
        "properties": {
            "title": {"type": "string", "minLength": 2},
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
            "score": {"type": "integer", "minimum": 3}
        },
        "required": ["title", "tags", "score"]
    });
    let done: Value = http
        .post(format!("{base}/v1/runs/wait"))
        .json(&json!({"input": "Summarise.", "output_schema": schema, "timeout_s": 60}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(done["status"], "succeeded", "{done}");
    let data = &done["result_json"];
    assert!(jsonschema::is_valid(&schema, data), "{data}");
    assert_eq!(data["score"], 3, "{data}");
    let log = t.mock.state.log();
    assert!(log.iter().all(|e| e.structured), "{log:?}");
    // Refusals, each with its stable code, before anything is stored.
    for (body, why) in [
        (
            json!({"input": "x", "output_schema": {"type": "bogus"}}),
            "not a schema",
        ),
        (
            json!({"input": "x", "output_schema": {"$ref": "http://169.254.169.254/schema"}}),
            "an outside reference",
        ),
        (
            json!({"input": "x", "output_schema": {"$ref": "file:///etc/passwd"}}),
            "a file reference",
        ),
        (
            json!({"input": "x", "output_schema": {"type": "string", "pattern": "(?<=a)b"}}),
            "a backtracking pattern",
        ),
        (
            json!({"input": "x", "output_schema": {}, "output_retries": 11}),
            "too many retries",
        ),
        (
            json!({"input": "x", "output_retries": 1}),
            "retries without a schema",
        ),
    ] {
        let r = http
            .post(format!("{base}/v1/runs"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 422, "{why}");
        let e: Value = r.json().await.unwrap();
        assert_eq!(e["error"]["code"], "invalid_output_schema", "{why}: {e}");
    }
    let r = http
        .post(format!("{base}/v1/runs"))
        .json(&json!({"input": "x", "output_schema": "object"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 422);
    let runs: Value = reqwest::get(format!("{base}/v1/runs"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(runs["runs"].as_array().unwrap().len(), 1, "{runs}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parent_names_its_childs_schema_in_the_task_call() {
    let t = spawn_app_with(Options {
        jobs: vec![parent_job("asker")],
        ..Default::default()
    })
    .await;
    let schema = json!({"type": "object", "properties": {"count": {"type": "integer", "minimum": 7}}, "required": ["count"]});
    t.mock.state.set_script(Script::from([(
        "asker".to_owned(),
        vec![
            calls(vec![call(
                "task",
                json!({"description": "Count them.", "subagent": "general-purpose", "output_schema": schema}),
            )]),
            calls(vec![call(
                "task",
                json!({"description": "Again.", "subagent": "general-purpose", "output_schema": {"type": "nonsense"}}),
            )]),
            say("done"),
        ],
    )]));
    let parent = start_parent(&t, "asker").await;
    let parent = t.wait(parent.id).await;
    assert_eq!(parent.status, RunStatus::Succeeded, "{parent:?}");
    let results = tool_results(&t, &parent).await;
    assert_eq!(results[0]["result"], json!({"count": 7}), "{results:?}");
    let refused = results[1].as_str().unwrap_or_default();
    assert!(
        refused.starts_with("error[invalid_output_schema]"),
        "{results:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_prints_a_structured_answer_as_json() {
    let t = spawn_app_with(Options {
        workers: false,
        ..Default::default()
    })
    .await;
    let schema_file = t.dir.path().join("answer.json");
    std::fs::write(
        &schema_file,
        json!({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})
            .to_string(),
    )
    .unwrap();
    let out = cli_command(&t, env!("CARGO_BIN_EXE_subagents"))
        .args(["run", "--quiet", "--output-schema"])
        .arg(&schema_file)
        .arg("Is it fine?")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let printed: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(printed, json!({"ok": true}));
    let bad = cli_command(&t, env!("CARGO_BIN_EXE_subagents"))
        .args([
            "run",
            "--quiet",
            "--output-schema",
            "/nonexistent/schema.json",
            "x",
        ])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("--output-schema"),
        "{bad:?}"
    );
}
