//! Forking threads over HTTP: a fork shares the history up to its point, both threads go on
//! apart (each model request sees only its own thread), and a retry may run a new input.

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use subagents::ids::RunId;
use subagents::model::mock::LogEntry;
use subagents::store::RunStatus;

use crate::api::{KEYS, code, setup};

fn first_request<'a>(log: &'a [LogEntry], marker: &str) -> &'a LogEntry {
    log.iter()
        .find(|e| e.scenario.contains(marker))
        .unwrap_or_else(|| panic!("no request for {marker}"))
}

fn run_id(v: &Value) -> RunId {
    v["id"].as_str().unwrap().parse().unwrap()
}

#[tokio::test]
async fn a_fork_goes_on_apart_from_its_thread() {
    let (t, alice) = setup(KEYS, 0).await;
    let (s, v) = alice
        .call(
            Method::POST,
            "/v1/runs",
            Some(json!({"input": "FIRST-TASK\nSCENARIO steps=2 run=fork-a", "thread_id": "forked-thread"})),
        )
        .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    assert_eq!(t.wait(run_id(&v)).await.status, RunStatus::Succeeded);
    let (_, thread) = alice
        .call(Method::GET, "/v1/threads/forked-thread", None)
        .await;
    let messages = thread["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 4, "{thread}");
    let input_id = messages[0]["id"].as_i64().unwrap();

    // Fork at the first message and try a different task from there.
    let (s, f) = alice
        .call(
            Method::POST,
            "/v1/threads/forked-thread/fork",
            Some(
                json!({"at_message": input_id, "input": "FORK-TASK\nSCENARIO steps=1 run=fork-b"}),
            ),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{f}");
    assert_eq!(f["forked_from"]["thread_id"], "forked-thread");
    assert_eq!(f["forked_from"]["at_message"], input_id);
    let fork_thread = f["thread_id"].as_str().unwrap().to_owned();
    let fork_run = run_id(&f["run"]);
    assert_eq!(t.wait(fork_run).await.status, RunStatus::Succeeded);
    // The original goes on as if nothing happened.
    let (_, v) = alice
        .call(
            Method::POST,
            "/v1/runs",
            Some(json!({"input": "ORIGINAL-GOES-ON\nSCENARIO steps=1 run=fork-c", "thread_id": "forked-thread"})),
        )
        .await;
    assert_eq!(t.wait(run_id(&v)).await.status, RunStatus::Succeeded);

    let log = t.mock.state.log();
    let on_fork = first_request(&log, "run=fork-b");
    assert_eq!(on_fork.user_texts.len(), 2, "{:?}", on_fork.user_texts);
    assert!(on_fork.user_texts[0].starts_with("FIRST-TASK"));
    assert!(on_fork.user_texts[1].starts_with("FORK-TASK"));
    // The fork shares the first message only: no answer of the first run (system, 2 users).
    assert_eq!(on_fork.messages, 3, "{on_fork:?}");
    let on_original = first_request(&log, "run=fork-c");
    assert!(
        on_original
            .user_texts
            .iter()
            .all(|u| !u.contains("FORK-TASK")),
        "{:?}",
        on_original.user_texts
    );
    assert!(on_original.user_texts[0].starts_with("FIRST-TASK"));
    assert!(on_original.messages > on_fork.messages, "{on_original:?}");

    // The views say where each came from.
    let (_, fv) = alice
        .call(Method::GET, &format!("/v1/threads/{fork_thread}"), None)
        .await;
    assert_eq!(fv["forked_from"]["thread_id"], "forked-thread", "{fv}");
    let fork_messages = fv["messages"].as_array().unwrap();
    assert_eq!(
        fork_messages[0]["id"], input_id,
        "the shared message is listed"
    );
    assert_eq!(fork_messages.len(), 3, "{fv}");
    let (_, ov) = alice
        .call(Method::GET, "/v1/threads/forked-thread", None)
        .await;
    assert_eq!(ov["forks"][0]["thread_id"], json!(fork_thread), "{ov}");
    assert_eq!(ov["forked_from"], Value::Null);

    // Refusals: another owner's thread is not found; a point outside the history is refused.
    let bob = alice.as_(Some("bob-secret-key"));
    let (s, v) = bob
        .call(
            Method::POST,
            "/v1/threads/forked-thread/fork",
            Some(json!({})),
        )
        .await;
    assert_eq!((s, code(&v)), (StatusCode::NOT_FOUND, "not_found"), "{v}");
    let later = ov["messages"].as_array().unwrap().last().unwrap()["id"].clone();
    let refused = [
        // A message of the source after the fork point is not in the fork's history.
        (
            fork_thread.clone(),
            json!({"at_message": later}),
            "no_such_message",
        ),
        (
            "forked-thread".to_owned(),
            json!({"at_message": input_id, "at_run": fork_run}),
            "invalid_request",
        ),
        // The fork's run is not a run of the original thread.
        (
            "forked-thread".to_owned(),
            json!({"at_run": fork_run}),
            "no_such_run",
        ),
    ];
    for (thread, body, want) in refused {
        let (s, v) = alice
            .call(
                Method::POST,
                &format!("/v1/threads/{thread}/fork"),
                Some(body),
            )
            .await;
        assert_eq!(
            (s, code(&v)),
            (StatusCode::UNPROCESSABLE_ENTITY, want),
            "{v}"
        );
    }
    // `subagents fork` is the same call from the command line.
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_subagents"))
        .args(["fork", &fork_thread, "--at", &input_id.to_string()])
        .env("SUBAGENTS_URL", &alice.base)
        .env("SUBAGENTS_KEY", "alice-secret-key")
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let printed: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(printed["forked_from"]["thread_id"], json!(fork_thread));
    assert_eq!(printed["run"], Value::Null);
}

#[tokio::test]
async fn a_retry_may_run_a_new_input() {
    let (t, alice) = setup(KEYS, 0).await;
    let (_, v) = alice
        .call(
            Method::POST,
            "/v1/runs",
            Some(json!({"input": "SCENARIO steps=2 fail_every=1 fail_status=400 run=retry-in"})),
        )
        .await;
    let failed = run_id(&v);
    assert_eq!(t.wait(failed).await.status, RunStatus::Failed);
    let path = format!("/v1/runs/{failed}/retry");
    let (s, v) = alice
        .call(
            Method::POST,
            &path,
            Some(json!({"input": "DIFFERENTLY\nSCENARIO steps=1 run=retry-new"})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["retry_of"], json!(failed));
    let retried = run_id(&v);
    let done = t.wait(retried).await;
    assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
    assert!(done.input.starts_with("DIFFERENTLY"));
    // The same new input again is the same retry; a plain retry is another.
    let (s, v) = alice
        .call(
            Method::POST,
            &path,
            Some(json!({"input": "DIFFERENTLY\nSCENARIO steps=1 run=retry-new"})),
        )
        .await;
    assert_eq!((s, run_id(&v)), (StatusCode::OK, retried), "{v}");
    let (s, v) = alice.call(Method::POST, &path, None).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_ne!(run_id(&v), retried);
    let (s, v) = alice
        .call(Method::POST, &path, Some(json!({"prompt": "x"})))
        .await;
    assert_eq!(
        (s, code(&v)),
        (StatusCode::UNPROCESSABLE_ENTITY, "invalid_request"),
        "{v}"
    );
}
