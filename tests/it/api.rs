//! The HTTP API over real HTTP against a server on port 0: every endpoint, status and error
//! code, owners, SSE resume, cancel in each state, waits, busy and enqueue.

use std::time::{Duration, Instant};

use futures::StreamExt;
use reqwest::{Client, StatusCode};
use serde_json::{Value, json};

use crate::support::*;

pub(crate) const KEYS: &str = "alice:alice-secret-key,bob:bob-secret-key";

pub(crate) struct Api {
    pub(crate) base: String,
    pub(crate) http: Client,
    pub(crate) key: Option<&'static str>,
}

impl Api {
    pub(crate) fn as_(&self, key: Option<&'static str>) -> Api {
        Api {
            base: self.base.clone(),
            http: self.http.clone(),
            key,
        }
    }
    pub(crate) fn req(&self, m: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let b = self.http.request(m, format!("{}{path}", self.base));
        match self.key {
            Some(k) => b.bearer_auth(k),
            None => b,
        }
    }
    pub(crate) async fn call(
        &self,
        m: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let mut b = self.req(m, path);
        if let Some(body) = body {
            b = b.json(&body);
        }
        let r = b.send().await.unwrap();
        let s = r.status();
        (s, r.json().await.unwrap_or(Value::Null))
    }
    pub(crate) async fn post(&self, path: &str, body: Value) -> (StatusCode, Value) {
        self.call(reqwest::Method::POST, path, Some(body)).await
    }
    pub(crate) async fn get(&self, path: &str) -> (StatusCode, Value) {
        self.call(reqwest::Method::GET, path, None).await
    }
}

pub(crate) async fn setup(keys: &str, latency_ms: u64) -> (TestApp, Api) {
    let t = spawn_app_with(Options {
        latency: Duration::from_millis(latency_ms),
        ..Default::default()
    })
    .await;
    let base = t.serve(keys).await;
    let api = Api {
        base,
        http: Client::new(),
        key: Some("alice-secret-key"),
    };
    (t, api)
}

pub(crate) fn code(v: &Value) -> &str {
    v["error"]["code"].as_str().unwrap_or("<none>")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_get_wait_events_and_thread() {
    let (_t, api) = setup(KEYS, 0).await;
    let (s, run) = api
        .post(
            "/v1/runs",
            json!({"input": "SCENARIO steps=3", "metadata": {"ticket": 7}}),
        )
        .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{run}");
    for k in [
        "id",
        "thread_id",
        "agent",
        "status",
        "parent_run_id",
        "step",
        "created_at",
        "started_at",
        "finished_at",
        "result",
        "error",
        "usage",
        "progress",
        "children",
    ] {
        assert!(run.get(k).is_some(), "run view lacks {k}: {run}");
    }
    let id = run["id"].as_str().unwrap();
    let (s, done) = api.get(&format!("/v1/runs/{id}/wait?timeout_s=30")).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(done["status"], "succeeded");
    assert_eq!(done["result"], "DONE after 3 steps");
    assert_eq!(done["wait_timed_out"], false);
    assert_eq!(done["metadata"]["ticket"], 7);
    assert_eq!(done["usage"]["steps"], 3);
    let (s, snap) = api.get(&format!("/v1/runs/{id}")).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(snap["progress"].as_array().unwrap().len(), 3);
    assert!(snap.get("wait_timed_out").is_none());
    // Events in pages, following next_after.
    let (_, p1) = api.get(&format!("/v1/runs/{id}/events?limit=5")).await;
    assert_eq!(p1["events"].as_array().unwrap().len(), 5);
    assert_eq!(p1["next_after"], 5);
    let (_, p2) = api
        .get(&format!("/v1/runs/{id}/events?after=5&limit=1000"))
        .await;
    let all: Vec<Value> = p1["events"]
        .as_array()
        .unwrap()
        .iter()
        .chain(p2["events"].as_array().unwrap())
        .cloned()
        .collect();
    for (i, e) in all.iter().enumerate() {
        assert_eq!(e["seq"], i as u64 + 1);
        for k in ["seq", "type", "run_id", "created_at", "data"] {
            assert!(e.get(k).is_some(), "event lacks {k}");
        }
    }
    assert_eq!(all.last().unwrap()["type"], "run.succeeded");
    // The thread: its runs and its messages, paged.
    let thread = run["thread_id"].as_str().unwrap();
    let (s, th) = api.get(&format!("/v1/threads/{thread}?limit=4")).await;
    assert_eq!(s, StatusCode::OK, "{th}");
    assert_eq!(th["runs"].as_array().unwrap().len(), 1);
    assert_eq!(th["messages"].as_array().unwrap().len(), 4);
    assert_eq!(th["messages"][0]["message"]["role"], "user");
    assert_eq!(
        th["compactions"],
        json!([]),
        "a short thread was never compacted"
    );
    let after = th["next_after"].as_i64().unwrap();
    let (_, th2) = api
        .get(&format!("/v1/threads/{thread}?after={after}"))
        .await;
    assert_eq!(
        th2["messages"].as_array().unwrap().len(),
        2,
        "6 messages in all"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_and_wait_in_one_call_and_time_out() {
    let (_t, api) = setup(KEYS, 300).await;
    let (s, v) = api
        .post(
            "/v1/runs/wait",
            json!({"input": "SCENARIO steps=2", "timeout_s": 30}),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["status"], "succeeded");
    assert_eq!(v["wait_timed_out"], false);
    let started = Instant::now();
    let (s, v) = api
        .post(
            "/v1/runs/wait",
            json!({"input": "SCENARIO steps=5", "timeout_s": 0.2}),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["wait_timed_out"], true);
    assert!(!["succeeded", "failed", "cancelled"].contains(&v["status"].as_str().unwrap()));
    assert!(started.elapsed() < Duration::from_secs(5));
    let id = v["id"].as_str().unwrap();
    let (_, v) = api.get(&format!("/v1/runs/{id}/wait?timeout_s=0.1")).await;
    assert_eq!(v["wait_timed_out"], true);
    let (_, v) = api.get(&format!("/v1/runs/{id}/wait?timeout_s=30")).await;
    assert_eq!(v["status"], "succeeded");
}

/// An admin (`admin` in the keys file) may list another owner's runs (`?owner=`) and open
/// them and their threads; nobody else may, and a bulk action stays with its caller's runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_may_look_at_every_owners_runs_and_nobody_else_may() {
    let t = spawn_app_with(Options::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let hash = |k: &str| {
        sha2::Sha256::digest(k.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    };
    use sha2::Digest;
    let file = dir.path().join("keys");
    std::fs::write(
        &file,
        format!(
            "alice {}\nbob {}\nops {} admin\n",
            hash("alice-secret-key"),
            hash("bob-secret-key"),
            hash("ops-secret-key")
        ),
    )
    .unwrap();
    let mut keys = subagents::api::auth::Keys::default();
    keys.add_file(&file).unwrap();
    let base = t.serve_keys(keys).await;
    let alice = Api {
        base,
        http: Client::new(),
        key: Some("alice-secret-key"),
    };
    let (bob, ops) = (
        alice.as_(Some("bob-secret-key")),
        alice.as_(Some("ops-secret-key")),
    );
    let (_, run) = alice
        .post(
            "/v1/runs/wait",
            json!({"input": "SCENARIO steps=1", "timeout_s": 30}),
        )
        .await;
    let id = run["id"].as_str().unwrap();
    let thread = run["thread_id"].as_str().unwrap();

    // The admin lists Alice's runs and opens them, their events and their thread.
    let (s, list) = ops.get("/v1/runs?owner=alice").await;
    assert_eq!(s, StatusCode::OK, "{list}");
    assert_eq!(
        list["runs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["id"].as_str().unwrap())
            .collect::<Vec<_>>(),
        [id]
    );
    for path in [
        format!("/v1/runs/{id}"),
        format!("/v1/runs/{id}/events"),
        format!("/v1/threads/{thread}"),
    ] {
        let (s, v) = ops.get(&path).await;
        assert_eq!(s, StatusCode::OK, "{path}: {v}");
    }
    let (_, own) = ops.get("/v1/runs").await;
    assert_eq!(
        own["runs"].as_array().unwrap().len(),
        0,
        "without owner=, an admin's own runs"
    );
    let (_, ov) = ops.get("/v1/overview").await;
    assert_eq!(ov["viewer"], json!({"owner": "ops", "admin": true}));
    let (_, ov) = bob.get("/v1/overview").await;
    assert_eq!(ov["viewer"], json!({"owner": "bob", "admin": false}));

    // Bob is no admin: refused with a reason, and Alice's run stays invisible to him.
    let (s, v) = bob.get("/v1/runs?owner=alice").await;
    assert_eq!((s, code(&v)), (StatusCode::FORBIDDEN, "forbidden"), "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("admin"),
        "{v}"
    );
    let (s, _) = bob.get(&format!("/v1/runs/{id}")).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    // Naming oneself is fine for anyone.
    let (s, _) = bob.get("/v1/runs?owner=bob").await;
    assert_eq!(s, StatusCode::OK);
    // Bulk actions work on the caller's own runs only.
    let (s, v) = ops
        .post(
            "/v1/runs/bulk",
            json!({"action": "cancel", "filter": {"owner": "alice"}}),
        )
        .await;
    assert_eq!(
        (s, code(&v)),
        (StatusCode::BAD_REQUEST, "invalid_filter"),
        "{v}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owners_are_isolated_and_keys_required() {
    let (_t, alice) = setup(KEYS, 0).await;
    let bob = alice.as_(Some("bob-secret-key"));
    let nobody = alice.as_(None);
    let wrong = alice.as_(Some("not-a-key-at-all"));
    let (_, run) = alice
        .post(
            "/v1/runs/wait",
            json!({"input": "SCENARIO steps=2", "timeout_s": 30}),
        )
        .await;
    let id = run["id"].as_str().unwrap();
    let thread = run["thread_id"].as_str().unwrap();
    let (s_missing, missing) = bob.get(&format!("/v1/runs/{}", uuid::Uuid::now_v7())).await;
    let (s_other, other) = bob.get(&format!("/v1/runs/{id}")).await;
    assert_eq!(
        (s_other, &other),
        (s_missing, &missing),
        "another owner's run looks exactly like a missing one"
    );
    assert_eq!(s_other, StatusCode::NOT_FOUND);
    for path in [
        format!("/v1/runs/{id}/events"),
        format!("/v1/runs/{id}/wait?timeout_s=0"),
        format!("/v1/threads/{thread}"),
    ] {
        let (s, _) = bob.get(&path).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "{path}");
    }
    let (s, _) = bob.post(&format!("/v1/runs/{id}/cancel"), json!({})).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (_, list) = bob.get("/v1/runs").await;
    assert_eq!(list["runs"].as_array().unwrap().len(), 0);
    let (_, list) = alice.get("/v1/runs").await;
    assert_eq!(list["runs"].as_array().unwrap().len(), 1);
    // The overview counts one's own runs only.
    let (_, mine) = alice.get("/v1/overview").await;
    assert_eq!(mine["runs"]["succeeded"], 1, "{mine}");
    let (_, theirs) = bob.get("/v1/overview").await;
    assert_eq!(theirs["runs"]["succeeded"], 0, "{theirs}");
    // A bulk action on another owner's run finds nothing to act on: to alice the same request
    // is `already_finished`, to bob `not_found`.
    let cancel = json!({"action": "cancel", "run_ids": [id]});
    let (s, v) = bob.post("/v1/runs/bulk", cancel.clone()).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["done"].as_array().unwrap().len(), 0, "{v}");
    assert_eq!(v["skipped"][0]["code"], "not_found", "{v}");
    let (_, v) = alice.post("/v1/runs/bulk", cancel).await;
    assert_eq!(v["skipped"][0]["code"], "already_finished", "{v}");
    let (_, v) = bob
        .post("/v1/runs/bulk", json!({"action": "cancel", "filter": {}}))
        .await;
    assert_eq!(v["done"].as_array().unwrap().len(), 0, "{v}");
    assert_eq!(v["skipped"].as_array().unwrap().len(), 0, "{v}");
    // Bob cannot continue Alice's thread either: the same id names a thread of his own.
    let (s, v) = bob
        .post("/v1/runs", json!({"input": "x", "thread_id": thread}))
        .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    assert_eq!(v["thread_id"], thread, "bob sees the id he chose");
    let (_, mine) = alice.get(&format!("/v1/threads/{thread}")).await;
    assert_eq!(
        mine["runs"].as_array().unwrap().len(),
        1,
        "alice's thread holds only her run: {mine}"
    );
    assert!(!mine.to_string().contains(v["id"].as_str().unwrap()));
    for api in [&nobody, &wrong] {
        let (s, v) = api.get("/v1/runs").await;
        assert_eq!(s, StatusCode::UNAUTHORIZED);
        assert_eq!(code(&v), "unauthorized");
    }
    // Health is open.
    let (s, _) = nobody.get("/healthz").await;
    assert_eq!(s, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_resumes_from_last_event_id_with_nothing_lost_or_repeated() {
    let (_t, api) = setup(KEYS, 150).await;
    let (_, run) = api
        .post("/v1/runs", json!({"input": "SCENARIO steps=5"}))
        .await;
    let id = run["id"].as_str().unwrap().to_owned();
    let sse = |last: Option<u64>| {
        let mut b = api
            .req(reqwest::Method::GET, &format!("/v1/runs/{id}/events"))
            .header("accept", "text/event-stream");
        if let Some(l) = last {
            b = b.header("last-event-id", l.to_string());
        }
        b
    };
    // First connection: read 4 events, then drop it mid-run.
    let resp = sse(None).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert!(
        resp.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let mut first = vec![];
    let mut s = eventsource_stream::Eventsource::eventsource(resp.bytes_stream());
    while first.len() < 4 {
        let ev = s.next().await.unwrap().unwrap();
        let data: Value = serde_json::from_str(&ev.data).unwrap();
        assert_eq!(ev.id, data["seq"].to_string(), "id: is the cursor");
        assert_eq!(
            ev.event,
            data["type"].as_str().unwrap(),
            "event: is the type"
        );
        first.push(data);
    }
    drop(s);
    let last = first.last().unwrap()["seq"].as_u64().unwrap();
    // Reconnect with Last-Event-ID: exactly the rest, and the stream ends after the terminal event.
    let resp = sse(Some(last)).send().await.unwrap();
    let rest: Vec<Value> = eventsource_stream::Eventsource::eventsource(resp.bytes_stream())
        .map(|e| serde_json::from_str::<Value>(&e.unwrap().data).unwrap())
        .collect()
        .await;
    assert_eq!(rest.last().unwrap()["type"], "run.succeeded");
    let seqs: Vec<u64> = first
        .iter()
        .chain(&rest)
        .map(|e| e["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(
        seqs,
        (1..=seqs.len() as u64).collect::<Vec<_>>(),
        "no gap, no repeat"
    );
    let (_, page) = api.get(&format!("/v1/runs/{id}/events?limit=1000")).await;
    assert_eq!(page["events"].as_array().unwrap().len(), seqs.len());
    // A finished run's stream replays and ends at once.
    let resp = sse(Some(0)).send().await.unwrap();
    let all: Vec<_> = eventsource_stream::Eventsource::eventsource(resp.bytes_stream())
        .collect()
        .await;
    assert_eq!(all.len(), seqs.len());
    let (s, v) = api
        .call(reqwest::Method::GET, &format!("/v1/runs/{id}/events"), None)
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let resp = sse(None).header("last-event-id", "x").send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
}

/// Streams are answered from the run's shared snapshot (its latest 32 events) when it covers
/// their cursor, and from their own page read when they are further behind: both ways every
/// event comes once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_streams_behind_the_shared_snapshot_get_every_event() {
    let (_t, api) = setup(KEYS, 0).await;
    let (_, run) = api
        .post(
            "/v1/runs/wait",
            json!({"input": "SCENARIO steps=15", "timeout_s": 60}),
        )
        .await;
    assert_eq!(run["status"], "succeeded", "{run}");
    let id = run["id"].as_str().unwrap().to_owned();
    let (_, page) = api.get(&format!("/v1/runs/{id}/events?limit=1000")).await;
    let n = page["events"].as_array().unwrap().len() as u64;
    assert!(n > 40, "the run has more events than a snapshot holds: {n}");
    for from in [0, 3, n - 40, n - 20, n - 3, n - 1] {
        let resp = api
            .req(reqwest::Method::GET, &format!("/v1/runs/{id}/events"))
            .header("accept", "text/event-stream")
            .header("last-event-id", from.to_string())
            .send()
            .await
            .unwrap();
        let seqs: Vec<u64> = eventsource_stream::Eventsource::eventsource(resp.bytes_stream())
            .map(|e| e.unwrap().id.parse::<u64>().unwrap())
            .collect()
            .await;
        assert_eq!(
            seqs,
            (from + 1..=n).collect::<Vec<_>>(),
            "from {from}: every later event once, in order"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_threads_reject_or_enqueue_in_order() {
    let (_t, api) = setup(KEYS, 100).await;
    let (_, a) = api
        .post("/v1/runs", json!({"input": "SCENARIO steps=4 run=a"}))
        .await;
    let thread = a["thread_id"].as_str().unwrap();
    let (s, v) = api
        .post(
            "/v1/runs",
            json!({"input": "SCENARIO steps=2 run=b", "thread_id": thread}),
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert_eq!(code(&v), "thread_busy");
    assert_eq!(v["error"]["active_run_id"], a["id"]);
    let (s, b) = api
        .post(
            "/v1/runs",
            json!({"input": "SCENARIO steps=2 run=b", "thread_id": thread, "if_busy": "enqueue"}),
        )
        .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{b}");
    assert_eq!(b["status"], "queued");
    assert!(b["queue_position"].is_number());
    let (_, b_done) = api
        .get(&format!(
            "/v1/runs/{}/wait?timeout_s=30",
            b["id"].as_str().unwrap()
        ))
        .await;
    let (_, a_done) = api
        .get(&format!("/v1/runs/{}", a["id"].as_str().unwrap()))
        .await;
    assert_eq!(a_done["status"], "succeeded");
    assert_eq!(b_done["status"], "succeeded", "{b_done}");
    assert!(
        b_done["started_at"].as_str().unwrap() >= a_done["finished_at"].as_str().unwrap(),
        "b ran after a"
    );
    // b saw a's conversation: it answered after its own step count.
    assert_eq!(b_done["result"], "DONE after 2 steps");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_in_each_state() {
    let (_t, api) = setup(KEYS, 0).await;
    // Running: a long model latency keeps it in a model call; cancel aborts the stream.
    let (_, a) = api
        .post(
            "/v1/runs",
            json!({"input": "SCENARIO steps=3 latency_ms=20000"}),
        )
        .await;
    let a_id = a["id"].as_str().unwrap().to_owned();
    let thread = a["thread_id"].as_str().unwrap();
    // Queued behind it on the same thread.
    let (_, b) = api
        .post(
            "/v1/runs",
            json!({"input": "SCENARIO steps=2", "thread_id": thread, "if_busy": "enqueue"}),
        )
        .await;
    let b_id = b["id"].as_str().unwrap().to_owned();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, v) = api.get(&format!("/v1/runs/{a_id}")).await;
        if v["status"] == "running" {
            break;
        }
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (s, v) = api
        .post(&format!("/v1/runs/{b_id}/cancel"), json!({}))
        .await;
    assert_eq!(s, StatusCode::ACCEPTED);
    assert_eq!(
        v["status"], "cancelled",
        "a queued run is cancelled at once"
    );
    let asked = Instant::now();
    let (s, _) = api
        .post(&format!("/v1/runs/{a_id}/cancel"), json!({}))
        .await;
    assert_eq!(s, StatusCode::ACCEPTED);
    let (_, v) = api.get(&format!("/v1/runs/{a_id}/wait?timeout_s=5")).await;
    assert_eq!(v["status"], "cancelled");
    let took = asked.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "a running run stops promptly (took {took:?})"
    );
    // Idempotent.
    let (s, _) = api
        .post(&format!("/v1/runs/{a_id}/cancel"), json!({}))
        .await;
    assert_eq!(s, StatusCode::ACCEPTED);
    // A finished run cannot be cancelled.
    let (_, c) = api
        .post(
            "/v1/runs/wait",
            json!({"input": "SCENARIO steps=1", "timeout_s": 30}),
        )
        .await;
    let (s, v) = api
        .post(
            &format!("/v1/runs/{}/cancel", c["id"].as_str().unwrap()),
            json!({}),
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert_eq!(code(&v), "already_finished");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_a_4xx_with_a_stable_code() {
    let (t, api) = setup(KEYS, 0).await;
    let raw = |body: &'static str, ct: Option<&'static str>| {
        let mut b = api.req(reqwest::Method::POST, "/v1/runs").body(body);
        if let Some(ct) = ct {
            b = b.header("content-type", ct);
        }
        b
    };
    let cases: Vec<(reqwest::RequestBuilder, StatusCode, &str)> = vec![
        (
            raw("{\"input\":", Some("application/json")),
            StatusCode::BAD_REQUEST,
            "malformed_json",
        ),
        (
            raw("{\"input\":\"x\"}", None),
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
        ),
        (
            raw("{\"input\":\"x\",\"extra\":1}", Some("application/json")),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        ),
        (
            raw("{\"input\":5}", Some("application/json")),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        ),
        (
            raw("{}", Some("application/json")),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        ),
        (
            raw("{\"input\":\"  \"}", Some("application/json")),
            StatusCode::UNPROCESSABLE_ENTITY,
            "empty_input",
        ),
        (
            raw(
                "{\"input\":\"x\",\"agent\":\"nope\"}",
                Some("application/json"),
            ),
            StatusCode::NOT_FOUND,
            "unknown_agent",
        ),
        (
            raw(
                "{\"input\":\"x\",\"thread_id\":\"a/b\"}",
                Some("application/json"),
            ),
            StatusCode::BAD_REQUEST,
            "invalid_id",
        ),
        (
            raw(
                "{\"input\":\"x\",\"if_busy\":\"maybe\"}",
                Some("application/json"),
            ),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        ),
        (
            raw(
                "{\"input\":\"x\",\"limits\":{\"max_steps\":0}}",
                Some("application/json"),
            ),
            StatusCode::UNPROCESSABLE_ENTITY,
            "bad_limit",
        ),
        (
            raw(
                "{\"input\":\"x\",\"metadata\":[1]}",
                Some("application/json"),
            ),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        ),
        (
            raw(
                "{\"input\":\"x\",\"timeout_s\":3}",
                Some("application/json"),
            ),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        ),
        // Found by schemathesis: limits past what the engine can represent are refused up front.
        (
            raw(
                "{\"input\":\"x\",\"limits\":{\"timeout_s\":9223372036854775808}}",
                Some("application/json"),
            ),
            StatusCode::UNPROCESSABLE_ENTITY,
            "bad_limit",
        ),
        (
            raw(
                "{\"input\":\"x\",\"limits\":{\"max_steps\":2.5}}",
                Some("application/json"),
            ),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        ),
        (
            raw(
                "{\"input\":\"x\",\"limits\":[null,null]}",
                Some("application/json"),
            ),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        ),
        (
            raw(
                "{\"input\":\"x\",\"limits\":{\"compact_at\":0.99}}",
                Some("application/json"),
            ),
            StatusCode::UNPROCESSABLE_ENTITY,
            "bad_limit",
        ),
        (
            raw(
                "{\"input\":\"x\",\"limits\":{\"compact_at\":5}}",
                Some("application/json"),
            ),
            StatusCode::UNPROCESSABLE_ENTITY,
            "bad_limit",
        ),
        (
            raw(
                "{\"input\":\"x\",\"limits\":{\"compact_at\":\"most\"}}",
                Some("application/json"),
            ),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        ),
    ];
    for (req, status, c) in cases {
        let r = req.send().await.unwrap();
        let s = r.status();
        let v: Value = r.json().await.unwrap();
        assert_eq!((s, code(&v)), (status, c), "{v}");
        assert!(!v["error"]["message"].as_str().unwrap().is_empty());
    }
    // A whole number written as a float is a whole number (JSON Schema agrees).
    let (s, v) = api.post("/v1/runs", json!({"input": "SCENARIO steps=1", "limits": {"max_steps": 3.0, "compact_at": 0.7}, "thread_id": "float-limits"})).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    let id = v["id"].as_str().unwrap().to_owned();
    let stored = t
        .app
        .store
        .get_run(id.parse().unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        stored.limits.compact_at,
        Some(70),
        "a fraction is kept as a percent"
    );
    let (s, v) = api
        .get(&format!("/v1/runs/{id}/events?after=9223372036854775808"))
        .await;
    assert_eq!((s, code(&v)), (StatusCode::BAD_REQUEST, "invalid_cursor"));
    api.get(&format!("/v1/runs/{id}/wait?timeout_s=30")).await;
    let big = "x".repeat(300 * 1024);
    let (s, v) = api.post("/v1/runs", json!({"input": big})).await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE, "{v}");
    for (path, status, c) in [
        ("/v1/runs/not-a-uuid", StatusCode::BAD_REQUEST, "invalid_id"),
        (
            "/v1/runs/0192f0c1-7a3e-7c4e-9a51-3f0e2b1c4d5e",
            StatusCode::NOT_FOUND,
            "not_found",
        ),
        (
            "/v1/runs?cursor=zzz",
            StatusCode::BAD_REQUEST,
            "invalid_cursor",
        ),
        ("/v1/runs?limit=0", StatusCode::BAD_REQUEST, "invalid_limit"),
        (
            "/v1/runs?status=done",
            StatusCode::BAD_REQUEST,
            "invalid_status",
        ),
        (
            "/v1/runs?status=",
            StatusCode::BAD_REQUEST,
            "invalid_status",
        ),
        ("/v1/runs?bogus=1", StatusCode::BAD_REQUEST, "invalid_query"),
        (
            "/v1/runs/0192f0c1-7a3e-7c4e-9a51-3f0e2b1c4d5e/wait?timeout_s=-1",
            StatusCode::BAD_REQUEST,
            "invalid_timeout",
        ),
        (
            "/v1/runs/0192f0c1-7a3e-7c4e-9a51-3f0e2b1c4d5e/events?after=-3",
            StatusCode::BAD_REQUEST,
            "invalid_query",
        ),
        ("/v1/threads/a%2Fb", StatusCode::BAD_REQUEST, "invalid_id"),
        ("/v1/threads/thr_nope", StatusCode::NOT_FOUND, "not_found"),
        ("/v1/nothing", StatusCode::NOT_FOUND, "no_route"),
    ] {
        let (s, v) = api.get(path).await;
        assert_eq!((s, code(&v)), (status, c), "{path}: {v}");
    }
    let (s, v) = api.call(reqwest::Method::DELETE, "/v1/runs", None).await;
    assert_eq!(
        (s, code(&v)),
        (StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed")
    );
    // Nothing half-written: only the one accepted run exists after all those refusals.
    let (_, list) = api.get("/v1/runs").await;
    assert_eq!(list["runs"].as_array().unwrap().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_filters_cursor_and_idempotency() {
    let (_t, api) = setup(KEYS, 0).await;
    let (_, a) = api
        .post(
            "/v1/runs",
            json!({"input": "SCENARIO steps=1", "idempotency_key": "job-1"}),
        )
        .await;
    let (s, again) = api
        .post(
            "/v1/runs",
            json!({"input": "SCENARIO steps=1", "idempotency_key": "job-1"}),
        )
        .await;
    assert_eq!(s, StatusCode::ACCEPTED);
    assert_eq!(again["id"], a["id"], "same key, same run");
    for i in 0..3 {
        api.post(
            "/v1/runs/wait",
            json!({"input": format!("SCENARIO steps=1 run={i}"), "agent": "echo", "timeout_s": 30}),
        )
        .await;
    }
    let (_, p1) = api.get("/v1/runs?limit=2").await;
    assert_eq!(p1["runs"].as_array().unwrap().len(), 2);
    let cursor = p1["next_cursor"].as_str().unwrap();
    let (_, p2) = api.get(&format!("/v1/runs?limit=2&cursor={cursor}")).await;
    assert_eq!(p2["runs"].as_array().unwrap().len(), 2);
    assert!(p2["next_cursor"].is_string());
    let ids: Vec<&str> = p1["runs"]
        .as_array()
        .unwrap()
        .iter()
        .chain(p2["runs"].as_array().unwrap())
        .map(|r| r["id"].as_str().unwrap())
        .collect();
    let mut sorted = ids.clone();
    sorted.sort_by(|a, b| b.cmp(a));
    assert_eq!(ids, sorted, "newest first");
    let (_, echo) = api.get("/v1/runs?agent=echo&status=succeeded,failed").await;
    assert_eq!(echo["runs"].as_array().unwrap().len(), 3);
    let thread = a["thread_id"].as_str().unwrap();
    let (_, by_thread) = api.get(&format!("/v1/runs?thread_id={thread}")).await;
    assert_eq!(by_thread["runs"].as_array().unwrap().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_health_readiness_and_metrics() {
    subagents::telemetry::init_metrics();
    let (_t, api) = setup(KEYS, 0).await;
    let (s, v) = api.get("/v1/agents").await;
    assert_eq!(s, StatusCode::OK);
    let names: Vec<&str> = v["agents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["name"].as_str().unwrap())
        .collect();
    assert!(
        names.contains(&"general-purpose") && names.contains(&"echo"),
        "{names:?}"
    );
    assert_eq!(api.get("/healthz").await.0, StatusCode::OK);
    let (s, v) = api.get("/readyz").await;
    assert_eq!((s, v["db"].as_str()), (StatusCode::OK, Some("ok")));
    api.post(
        "/v1/runs/wait",
        json!({"input": "SCENARIO steps=2", "timeout_s": 30}),
    )
    .await;
    let text = api
        .req(reqwest::Method::GET, "/metrics")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for m in [
        "subagents_runs{status=\"succeeded\"}",
        "subagents_queue_depth",
        "subagents_model_call_seconds_bucket",
        "subagents_tokens_total",
        "subagents_step_seconds",
    ] {
        assert!(text.contains(m), "/metrics lacks {m}:\n{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_clients_talk_to_the_server() {
    let (_t, api) = setup("ops:ops-secret-key", 0).await;
    let cli = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_subagents"))
            .args(args)
            .env("SUBAGENTS_URL", &api.base)
            .env("SUBAGENTS_KEY", "ops-secret-key")
            .output()
            .unwrap()
    };
    let out = cli(&["start", "SCENARIO steps=2"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run: Value = serde_json::from_slice(&out.stdout).unwrap();
    let id = run["id"].as_str().unwrap();
    let out = cli(&["wait", id]);
    assert!(out.status.success());
    let done: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(done["result"], "DONE after 2 steps");
    let out = cli(&["events", "--follow", id]);
    let lines: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.last().unwrap()["type"], "run.succeeded");
    let out = cli(&["status", id]);
    assert!(out.status.success());
    let out = cli(&["cancel", id]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("already_finished"));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_subagents"))
        .args(["status", id])
        .env("SUBAGENTS_URL", "http://127.0.0.1:9")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot reach the server"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openapi_document_describes_every_endpoint() {
    let (_t, api) = setup(KEYS, 0).await;
    let (s, doc) = api.as_(None).get("/openapi.json").await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(doc["openapi"], "3.1.0");
    let paths = doc["paths"].as_object().unwrap();
    for (p, m) in [
        ("/v1/runs", "post"),
        ("/v1/runs", "get"),
        ("/v1/runs/wait", "post"),
        ("/v1/runs/{id}", "get"),
        ("/v1/runs/{id}/events", "get"),
        ("/v1/runs/{id}/cancel", "post"),
        ("/v1/runs/{id}/wait", "get"),
        ("/v1/threads/{id}", "get"),
        ("/v1/agents", "get"),
        ("/healthz", "get"),
        ("/readyz", "get"),
        ("/metrics", "get"),
    ] {
        assert!(
            paths.get(p).and_then(|x| x.get(m)).is_some(),
            "{m} {p} missing from the spec"
        );
    }
    let run = &doc["components"]["schemas"]["RunView"]["properties"];
    for k in ["id", "thread_id", "status", "usage", "progress", "children"] {
        assert!(run.get(k).is_some(), "RunView schema lacks {k}");
    }
    assert!(doc["components"]["securitySchemes"]["bearer"].is_object());
}

/// The live overview is per owner: while alice's run is running, her stream's first
/// `overview` event counts it and names it, bob's counts nothing and never names it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_overview_stream_shows_each_owner_only_their_runs() {
    let (t, alice) = setup(KEYS, 0).await;
    let bob = alice.as_(Some("bob-secret-key"));
    let (_, run) = alice
        .post(
            "/v1/runs",
            json!({"input": "SCENARIO steps=3 latency_ms=20000"}),
        )
        .await;
    let id: subagents::ids::RunId = run["id"].as_str().unwrap().parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while t.app.store.get_run(id).await.unwrap().unwrap().status
        != subagents::store::RunStatus::Running
    {
        assert!(Instant::now() < deadline, "the run never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    async fn first_overview(api: &Api) -> String {
        let resp = api
            .req(reqwest::Method::GET, "/v1/overview/stream")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        let mut body = resp.bytes_stream();
        let mut text = String::new();
        while !text.contains("\n\n") {
            let chunk = body.next().await.unwrap().unwrap();
            text.push_str(&String::from_utf8_lossy(&chunk));
        }
        text
    }
    let hers = first_overview(&alice).await;
    assert!(hers.contains("event: overview"), "{hers}");
    assert!(hers.contains("\"running\":1"), "{hers}");
    assert!(
        hers.contains(&id.to_string()),
        "her running run is named: {hers}"
    );
    let his = first_overview(&bob).await;
    assert!(his.contains("\"running\":0"), "{his}");
    assert!(
        !his.contains(&id.to_string()),
        "bob's stream names alice's run: {his}"
    );
    let (s, _) = alice
        .post(&format!("/v1/runs/{id}/cancel"), json!({}))
        .await;
    assert_eq!(s, StatusCode::ACCEPTED);
}
