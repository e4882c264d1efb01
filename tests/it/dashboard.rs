//! Operating the fleet (issue 13): retry, cost, the overview's figures, bulk actions, the
//! dashboard in a real headless Chromium, and OTLP traces.

use std::time::{Duration, Instant};

use reqwest::{Client, StatusCode};
use serde_json::{Value, json};

use crate::api::{Api, KEYS, code};
use crate::support::*;

/// An app priced at $1,000 / $2,000 per million mock tokens (so cents show), served with keys.
async fn priced(latency_ms: u64) -> (TestApp, Api) {
    let t = spawn_app_with(Options {
        latency: Duration::from_millis(latency_ms),
        tweak: Box::new(|s| s.prices = "mock-model=1000:2000".into()),
        ..Default::default()
    })
    .await;
    let base = t.serve(KEYS).await;
    (
        t,
        Api {
            base,
            http: Client::new(),
            key: Some("alice-secret-key"),
        },
    )
}

async fn wait_done(api: &Api, id: &str) -> Value {
    let (s, v) = api.get(&format!("/v1/runs/{id}/wait?timeout_s=30")).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_ne!(v["wait_timed_out"], true, "{v}");
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_run_is_retried_once_on_its_thread_and_only_failed_or_cancelled_roots_are() {
    let (_t, api) = priced(0).await;
    // A provider that refuses every request for good: the run fails with kind=model.
    let (s, run) = api.post("/v1/runs", json!({"input": "SCENARIO steps=2 fail_every=1 fail_status=400 run=r1", "metadata": {"ticket": 9}})).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{run}");
    let id = run["id"].as_str().unwrap();
    let failed = wait_done(&api, id).await;
    assert_eq!(failed["status"], "failed", "{failed}");
    assert_eq!(failed["error"]["kind"], "model");

    let (s, retry) = api.post(&format!("/v1/runs/{id}/retry"), json!({})).await;
    assert_eq!(s, StatusCode::CREATED, "{retry}");
    assert_eq!(retry["retry_of"], id);
    assert_ne!(retry["id"], id);
    assert_eq!(retry["thread_id"], failed["thread_id"], "same thread");
    assert_eq!(retry["agent"], failed["agent"]);
    assert_eq!(retry["metadata"]["ticket"], 9);
    // A double click returns the same retry, not a second one.
    let (s, again) = api.post(&format!("/v1/runs/{id}/retry"), json!({})).await;
    assert_eq!(s, StatusCode::OK, "{again}");
    assert_eq!(again["id"], retry["id"]);
    let retried = wait_done(&api, retry["id"].as_str().unwrap()).await;
    assert_eq!(
        retried["status"], "failed",
        "the same input fails the same way: {retried}"
    );
    // The thread holds both runs.
    let (_, th) = api
        .get(&format!(
            "/v1/threads/{}",
            failed["thread_id"].as_str().unwrap()
        ))
        .await;
    assert_eq!(th["runs"].as_array().unwrap().len(), 2, "{th}");

    // A succeeded run is not retryable; nor is a run still going; another owner's is not found.
    let (_, ok) = api
        .post("/v1/runs", json!({"input": "SCENARIO steps=1 run=r2"}))
        .await;
    let ok_id = ok["id"].as_str().unwrap();
    wait_done(&api, ok_id).await;
    let (s, e) = api
        .post(&format!("/v1/runs/{ok_id}/retry"), json!({}))
        .await;
    assert_eq!(
        (s, code(&e)),
        (StatusCode::CONFLICT, "not_retryable"),
        "{e}"
    );
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("succeeded"),
        "{e}"
    );
    let (s, e) = api
        .as_(Some("bob-secret-key"))
        .post(&format!("/v1/runs/{id}/retry"), json!({}))
        .await;
    assert_eq!((s, code(&e)), (StatusCode::NOT_FOUND, "not_found"), "{e}");
    let (s, e) = api.post("/v1/runs/not-a-uuid/retry", json!({})).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{e}");
    let (s, e) = api
        .as_(None)
        .post(&format!("/v1/runs/{id}/retry"), json!({}))
        .await;
    assert_eq!(
        (s, code(&e)),
        (StatusCode::UNAUTHORIZED, "unauthorized"),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_run_still_going_cannot_be_retried_and_a_cancelled_one_can() {
    let (_t, api) = priced(300).await;
    let (_, run) = api
        .post("/v1/runs", json!({"input": "SCENARIO steps=50 run=slow"}))
        .await;
    let id = run["id"].as_str().unwrap();
    let (s, e) = api.post(&format!("/v1/runs/{id}/retry"), json!({})).await;
    assert_eq!(
        (s, code(&e)),
        (StatusCode::CONFLICT, "not_retryable"),
        "{e}"
    );
    let (s, _) = api.post(&format!("/v1/runs/{id}/cancel"), json!({})).await;
    assert_eq!(s, StatusCode::ACCEPTED);
    assert_eq!(wait_done(&api, id).await["status"], "cancelled");
    let (s, retry) = api.post(&format!("/v1/runs/{id}/retry"), json!({})).await;
    assert_eq!(s, StatusCode::CREATED, "{retry}");
    assert_eq!(retry["retry_of"], id);
    let (s, _) = api
        .post(
            &format!("/v1/runs/{}/cancel", retry["id"].as_str().unwrap()),
            json!({}),
        )
        .await;
    assert_eq!(s, StatusCode::ACCEPTED);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_model_call_is_priced_and_the_cost_adds_up_in_the_run_and_its_events() {
    subagents::telemetry::init_metrics();
    let (_t, api) = priced(0).await;
    let (_, run) = api
        .post("/v1/runs", json!({"input": "SCENARIO steps=3 run=c1"}))
        .await;
    let id = run["id"].as_str().unwrap();
    let done = wait_done(&api, id).await;
    assert_eq!(done["status"], "succeeded");
    let u = &done["usage"];
    let (p, c) = (
        u["prompt_tokens"].as_f64().unwrap(),
        u["completion_tokens"].as_f64().unwrap(),
    );
    assert!(p > 0.0 && c > 0.0, "{u}");
    let want = p * 1000.0 / 1e6 + c * 2000.0 / 1e6;
    let got = u["cost_usd"].as_f64().unwrap();
    assert!((got - want).abs() < 1e-6, "cost {got} != {want} for {u}");
    assert_eq!(
        done["usage_tree"]["cost_usd"], u["cost_usd"],
        "no children: the tree is the run"
    );
    // Each model call's event says what it cost, which model, and how long it took.
    let (_, ev) = api.get(&format!("/v1/runs/{id}/events?limit=1000")).await;
    let calls: Vec<&Value> = ev["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["type"] == "model.completed")
        .collect();
    assert_eq!(calls.len(), 3);
    let sum: f64 = calls
        .iter()
        .map(|e| e["data"]["cost_usd"].as_f64().unwrap())
        .sum();
    assert!(
        (sum - got).abs() < 1e-6,
        "events add up to the run: {sum} vs {got}"
    );
    for e in calls {
        assert_eq!(e["data"]["model"], "mock-model");
        assert!(e["data"]["ms"].is_u64(), "{e}");
    }
    // /metrics counts cost per model.
    let text = api
        .http
        .get(format!("{}/metrics", api.base))
        .bearer_auth("alice-secret-key")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        text.contains("subagents_cost_nanodollars_total{model=\"mock-model\"}"),
        "{text}"
    );
}

const ASKER: &str = "---\nname: asker\ndescription: asks before echoing\ntools: [echo]\npermissions:\n  ask: [\"echo\"]\n---\nYou echo.";

/// The dashboard in a real headless Chromium: the key prompt, the overview, a run's timeline
/// filling live, the tree and a child, cancel from the page, bulk retry of failed runs, an
/// approval answered, a thread, the agents, another owner's run not found, a phone-width
/// screen. Screenshots of each view go to `$SUBAGENTS_SCREENSHOTS` (docs/screenshots holds a
/// committed set).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_in_a_real_browser() {
    use crate::delegation::{call, calls, parent_job, say};
    let t = spawn_app_with(Options {
        latency: Duration::from_millis(120),
        jobs: vec![parent_job("boss"), ("asker".into(), ASKER.into())],
        tweak: Box::new(|s| s.prices = "mock-model=2:8".into()),
        ..Default::default()
    })
    .await;
    t.mock.state.set_script(subagents::model::mock::Script::from([(
        "boss".to_owned(),
        vec![calls(vec![call("task", json!({"description": "Look it up.\nSCENARIO steps=3 run=kid", "subagent": "general-purpose"}))]), say("all done")],
    )]));
    let base = t.serve(KEYS).await;
    let api = Api {
        base: base.clone(),
        http: Client::new(),
        key: Some("alice-secret-key"),
    };
    // Without a key the server refuses the API (the page itself holds no data).
    let (s, e) = api.as_(None).get("/v1/overview").await;
    assert_eq!((s, code(&e)), (StatusCode::UNAUTHORIZED, "unauthorized"));
    let page = api.http.get(format!("{base}/")).send().await.unwrap();
    assert_eq!(page.url().path(), "/ui/", "/ leads to the dashboard");
    assert!(
        page.headers()["content-security-policy"]
            .to_str()
            .unwrap()
            .contains("script-src 'self'")
    );

    // Some history: two succeeded runs, two failed ones.
    for i in 0..2 {
        let (_, r) = api
            .post(
                "/v1/runs",
                json!({"input": format!("SCENARIO steps=2 run=ok{i}")}),
            )
            .await;
        wait_done(&api, r["id"].as_str().unwrap()).await;
    }
    let mut failed = vec![];
    for i in 0..2 {
        let (_, r) = api.post("/v1/runs", json!({"input": format!("SCENARIO steps=2 fail_every=1 fail_status=400 run=bad{i}")})).await;
        assert_eq!(
            wait_done(&api, r["id"].as_str().unwrap()).await["status"],
            "failed"
        );
        failed.push(r["id"].as_str().unwrap().to_owned());
    }

    let b = crate::browser::Browser::start(1280, 900).await;
    // The key prompt: a wrong key is refused, the right one kept for the session.
    b.goto(&format!("{base}/ui/")).await;
    b.wait_until(
        "the key prompt",
        "return document.querySelector('#keydlg').open",
        10,
    )
    .await;
    b.type_into("#keyinput", "not-the-key").await;
    b.click("#keysubmit").await;
    b.wait_until(
        "a refused key is said so",
        "return document.querySelector('#keyerr').textContent.includes('refused')",
        10,
    )
    .await;
    b.type_into("#keyinput", "alice-secret-key").await;
    b.click("#keysubmit").await;
    b.wait_until("the overview counts", "const e = document.querySelector('[data-count=succeeded] .n'); return e && e.textContent === '2'", 10).await;
    assert_eq!(b.text("[data-count=failed] .n").await, "2");
    b.wait_until(
        "the stream is live",
        "return document.querySelector('#live').classList.contains('on')",
        10,
    )
    .await;
    b.wait_for("#workers", 10).await;
    assert!(
        b.text("#failures").await.contains("model"),
        "failures by kind"
    );
    // Live: a run started through the API shows in the counts without a reload.
    let (_, parent) = api
        .post("/v1/runs", json!({"agent": "boss", "input": "Coordinate."}))
        .await;
    let parent_id = parent["id"].as_str().unwrap().to_owned();
    b.wait_until("the overview moves by itself", "const e = document.querySelector('[data-count=succeeded] .n'); return e && Number(e.textContent) >= 4", 20).await;
    b.screenshot("overview").await;

    // A run's timeline fills live; its tree shows the child, which opens.
    let (_, long) = api
        .post(
            "/v1/runs",
            json!({"input": "SCENARIO steps=12 latency_ms=250 run=live"}),
        )
        .await;
    let long_id = long["id"].as_str().unwrap().to_owned();
    b.goto(&format!("{base}/ui/runs/{long_id}")).await;
    let first = b
        .wait_until(
            "a model call on the timeline",
            "return document.querySelectorAll('#timeline [data-type=\"model.completed\"]').length",
            20,
        )
        .await
        .as_u64()
        .unwrap();
    let more = b
        .wait_until("more calls arrive without a reload", &format!("const n = document.querySelectorAll('#timeline [data-type=\"model.completed\"]').length; return n > {first} ? n : 0"), 20)
        .await;
    assert!(more.as_u64().unwrap() > first);
    b.wait_for("#timeline [data-type='tool.started'] pre", 10)
        .await;
    b.wait_for("#timeline [data-type='run.succeeded']", 30)
        .await;
    b.wait_for("#run-head [data-status=succeeded]", 10).await;
    assert!(b.text("#usage").await.contains("$"), "cost shows");
    b.screenshot("run").await;

    wait_done(&api, &parent_id).await;
    b.goto(&format!("{base}/ui/runs/{parent_id}")).await;
    b.wait_for("#tree li[data-run] a", 20).await;
    assert!(b.text("#usage-tree").await.contains("steps"));
    b.screenshot("tree").await;
    b.click("#tree li[data-run] a").await;
    let child = t
        .app
        .store
        .children(parent_id.parse().unwrap())
        .await
        .unwrap()
        .remove(0);
    b.wait_until("the child's page", &format!("return location.pathname.endsWith('{}') && document.querySelector('#run-head [data-status]')", child.id), 10).await;
    b.click("#thread-link").await;
    b.wait_for("#messages [data-message]", 10).await;
    b.screenshot("thread").await;
    // "Fork from here" on the first message opens the new thread, which says where it came
    // from and lists that message as its whole history.
    b.click("#messages [data-message] button[data-fork]").await;
    b.wait_for("#forked-from", 10).await;
    let shared = b
        .js(
            "return document.querySelectorAll('#messages [data-message]').length",
            json!([]),
        )
        .await;
    assert_eq!(shared, 1, "the fork shares the first message only");

    // Cancel from the page.
    let (_, slow) = api
        .post(
            "/v1/runs",
            json!({"input": "SCENARIO steps=200 latency_ms=300 run=slow"}),
        )
        .await;
    let slow_id = slow["id"].as_str().unwrap().to_owned();
    b.goto(&format!("{base}/ui/runs/{slow_id}")).await;
    b.wait_for("#timeline [data-type='model.completed']", 20)
        .await;
    // A message from the page reaches the run's next model call.
    b.type_into("#say-text", "STEER-DASHBOARD also look left")
        .await;
    b.click("#say-send").await;
    b.wait_for("#timeline [data-type='message.delivered']", 20)
        .await;
    let heard = Instant::now();
    while !t
        .mock
        .state
        .log()
        .iter()
        .any(|e| e.user_texts.iter().any(|u| u.contains("STEER-DASHBOARD")))
    {
        assert!(
            heard.elapsed() < Duration::from_secs(20),
            "the model heard the message sent from the dashboard"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    b.click("#cancel").await;
    b.wait_for("#run-head [data-status=cancelled]", 20).await;
    b.wait_until(
        "the message box goes once the run has ended",
        "return document.querySelector('#say').hidden",
        10,
    )
    .await;
    assert_eq!(wait_done(&api, &slow_id).await["status"], "cancelled");

    // Bulk retry of the failed runs, from the filtered table.
    b.goto(&format!("{base}/ui/runs?status=failed")).await;
    b.wait_for("#runs-body tr[data-run]", 10).await;
    let rows = b
        .js(
            "return document.querySelectorAll('#runs-body tr[data-run]').length",
            json!([]),
        )
        .await;
    assert_eq!(rows, 2, "only the failed runs are listed");
    b.screenshot("runs").await;
    b.click("#select-all").await;
    b.click("#bulk-retry").await;
    b.wait_until(
        "the bulk result",
        "return document.querySelector('#bulk-result').textContent.includes('retry: 2 done')",
        10,
    )
    .await;
    for id in &failed {
        let (_, page) = api
            .get(&format!(
                "/v1/runs?thread_id={}",
                t.app
                    .store
                    .get_run(id.parse().unwrap())
                    .await
                    .unwrap()
                    .unwrap()
                    .thread_id
            ))
            .await;
        let retried = page["runs"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["retry_of"] == id.as_str());
        assert!(retried, "run {id} was retried: {page}");
    }

    // An approval answered from the run page.
    let (_, asking) = api
        .post(
            "/v1/runs",
            json!({"agent": "asker", "input": "SCENARIO steps=2 tool=echo run=ask"}),
        )
        .await;
    let asking_id = asking["id"].as_str().unwrap().to_owned();
    b.goto(&format!("{base}/ui/runs/{asking_id}")).await;
    b.wait_for("#approvals [data-approval] [data-answer=allow]", 30)
        .await;
    b.screenshot("approval").await;
    b.click("#approvals [data-answer=allow]").await;
    b.wait_for("#run-head [data-status=succeeded]", 30).await;

    // The agents with what they really get.
    b.goto(&format!("{base}/ui/agents")).await;
    let boss = b.text("#agents [data-agent=boss]").await;
    assert!(
        boss.contains("task") && boss.contains("mock-model"),
        "{boss}"
    );
    b.screenshot("agents").await;

    // A phone-width screen: the run page fits without sideways scrolling.
    b.resize(390, 844).await;
    b.goto(&format!("{base}/ui/runs/{long_id}")).await;
    b.wait_for("#timeline [data-type='run.succeeded']", 10)
        .await;
    b.screenshot("run-phone").await;
    let overflow = b
        .js(
            "return document.documentElement.scrollWidth - window.innerWidth",
            json!([]),
        )
        .await;
    let wide = b.js("return [...document.querySelectorAll('main *')].filter(e => e.getBoundingClientRect().right > window.innerWidth + 1).slice(0, 5).map(e => e.tagName + '.' + e.className + '#' + e.id + ' ' + Math.round(e.getBoundingClientRect().right)).join('; ')", json!([])).await;
    assert!(
        overflow.as_i64().unwrap() <= 1,
        "horizontal overflow of {overflow}px on a phone: {wide}"
    );

    // Another owner's run is not found, even by its exact link.
    b.js(
        "sessionStorage.setItem('subagents.key', 'bob-secret-key')",
        json!([]),
    )
    .await;
    b.goto(&format!("{base}/ui/runs/{long_id}")).await;
    assert_eq!(
        b.text("main h1").await,
        "Not found",
        "bob cannot see alice's run"
    );
    assert!(b.text("#error").await.contains("no run with that id"));
    // Bob's runs page offers no owner filter: he is no admin.
    b.goto(&format!("{base}/ui/runs")).await;
    b.wait_for("#filters", 10).await;
    assert_eq!(
        b.js(
            "return document.querySelectorAll('#filters input[name=owner]').length",
            json!([])
        )
        .await,
        json!(0)
    );

    // An admin (a second server on the same store, with a keys file) filters by owner and sees
    // Alice's runs, without bulk actions on them.
    use sha2::Digest;
    let hash = |k: &str| {
        sha2::Sha256::digest(k.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    };
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("keys"),
        format!(
            "alice {}\nops {} admin\n",
            hash("alice-secret-key"),
            hash("ops-secret-key")
        ),
    )
    .unwrap();
    let mut keys = subagents::api::auth::Keys::default();
    keys.add_file(&dir.path().join("keys")).unwrap();
    let admin_base = t.serve_keys(keys).await;
    b.goto(&format!("{admin_base}/ui/runs")).await;
    b.wait_until(
        "the key prompt",
        "return document.querySelector('#keydlg').open",
        10,
    )
    .await;
    b.type_into("#keyinput", "ops-secret-key").await;
    b.click("#keysubmit").await;
    b.type_into("#filters input[name=owner]", "alice").await;
    b.click("#filters button[type=submit]").await;
    b.wait_for(&format!("#runs-body [data-run='{long_id}']"), 10)
        .await;
    assert!(
        b.url().await.contains("owner=alice"),
        "the filter is in the link"
    );
    assert_eq!(b.text("main h1").await, "Runs of alice");
    assert_eq!(
        b.js(
            "return document.querySelectorAll('#bulk-cancel-all').length",
            json!([])
        )
        .await,
        json!(0),
        "no bulk actions on another owner's runs"
    );
    b.screenshot("runs-admin").await;
}

/// Spans as a receiver got them: (name, trace id, span id, parent span id, attributes).
#[derive(Debug, Clone)]
struct Span {
    name: String,
    trace: String,
    id: String,
    parent: String,
    attrs: std::collections::HashMap<String, Value>,
}

fn spans_of(bodies: &[Value]) -> Vec<Span> {
    let mut out = vec![];
    for b in bodies {
        for rs in b["resourceSpans"].as_array().into_iter().flatten() {
            for ss in rs["scopeSpans"].as_array().into_iter().flatten() {
                for s in ss["spans"].as_array().into_iter().flatten() {
                    let attrs = s["attributes"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(|a| {
                            let v = &a["value"];
                            let v = v
                                .get("stringValue")
                                .or(v.get("intValue"))
                                .or(v.get("boolValue"))
                                .or(v.get("doubleValue"))
                                .cloned()
                                .unwrap_or(Value::Null);
                            (a["key"].as_str().unwrap_or_default().to_owned(), v)
                        })
                        .collect();
                    out.push(Span {
                        name: s["name"].as_str().unwrap_or_default().to_owned(),
                        trace: s["traceId"].as_str().unwrap_or_default().to_owned(),
                        id: s["spanId"].as_str().unwrap_or_default().to_owned(),
                        parent: s["parentSpanId"].as_str().unwrap_or_default().to_owned(),
                        attrs,
                    });
                }
            }
        }
    }
    out
}

/// A delegating run on a worker process with `OTEL_EXPORTER_OTLP_ENDPOINT` set sends its spans
/// to a small OTLP/HTTP (JSON) receiver here: GenAI names and attributes, run and thread ids
/// on every span, the child's run span a child of the parent's `task` tool span.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delegating_runs_spans_reach_an_otlp_receiver_named_per_gen_ai_and_linked() {
    use crate::delegation::{call, calls, parent_job, say, start_parent};
    use std::sync::{Arc, Mutex};
    let got: Arc<Mutex<Vec<Value>>> = Arc::default();
    let sink = got.clone();
    let receiver = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: axum::body::Bytes| {
            let sink = sink.clone();
            async move {
                sink.lock()
                    .unwrap()
                    .push(serde_json::from_slice(&body).unwrap_or(Value::Null));
                "{}"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, receiver).await });

    let t = spawn_app_with(Options {
        workers: false,
        jobs: vec![parent_job("boss")],
        ..Default::default()
    })
    .await;
    t.mock.state.set_script(subagents::model::mock::Script::from([(
        "boss".to_owned(),
        vec![calls(vec![call("task", json!({"description": "Look it up.\nSCENARIO steps=2 run=otel", "subagent": "general-purpose"}))]), say("all done")],
    )]));
    let mut worker = spawn_worker(
        t.dir.path(),
        &t.mock,
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://{addr}")),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json".into()),
            ("OTEL_BSP_SCHEDULE_DELAY", "100".into()),
        ],
    );
    let parent = start_parent(&t, "boss").await;
    let done = t.wait(parent.id).await;
    assert_eq!(
        done.status,
        subagents::store::RunStatus::Succeeded,
        "{done:?}"
    );
    let child = t.app.store.children(parent.id).await.unwrap().remove(0);
    // A graceful stop flushes what is still buffered.
    std::process::Command::new("kill")
        .args(["-TERM", &worker.id().to_string()])
        .status()
        .unwrap();
    tokio::task::block_in_place(|| worker.wait()).unwrap();

    let spans = spans_of(&got.lock().unwrap());
    let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
    let one = |name: &str, run: &subagents::store::RunRecord| -> Span {
        spans
            .iter()
            .find(|s| s.name == name && s.attrs.get("run_id") == Some(&json!(run.id.to_string())))
            .unwrap_or_else(|| panic!("no `{name}` span of run {}: {names:?}", run.id))
            .clone()
    };
    let p_run = one("invoke_agent boss", &parent);
    assert_eq!(p_run.attrs["gen_ai.operation.name"], "invoke_agent");
    assert_eq!(p_run.attrs["gen_ai.agent.name"], "boss");
    assert_eq!(
        p_run.attrs["gen_ai.conversation.id"],
        json!(parent.thread_id.as_str())
    );
    let chat = one("chat mock-model", &parent);
    assert_eq!(chat.attrs["gen_ai.operation.name"], "chat");
    assert_eq!(chat.attrs["gen_ai.request.model"], "mock-model");
    assert!(
        chat.attrs["gen_ai.usage.input_tokens"]
            .as_str()
            .and_then(|v| v.parse::<u64>().ok())
            .is_some_and(|n| n > 0),
        "{:?}",
        chat.attrs
    );
    // The parent parked on its child and was claimed again: still one trace.
    let attempts: Vec<&Span> = spans
        .iter()
        .filter(|s| {
            s.name == "invoke_agent boss"
                && s.attrs.get("run_id") == Some(&json!(parent.id.to_string()))
        })
        .collect();
    assert!(attempts.len() >= 2, "the parent ran twice: {names:?}");
    assert!(
        attempts.iter().all(|s| s.trace == p_run.trace),
        "every attempt of the parent is in one trace: {attempts:?}"
    );
    let task = one("execute_tool task", &parent);
    assert_eq!(task.attrs["gen_ai.tool.name"], "task");
    assert_eq!(task.trace, p_run.trace, "the parent's spans are one trace");
    // The child's run continues the parent's trace, under the tool call that started it.
    let c_run = one("invoke_agent general-purpose", &child);
    assert_eq!(
        c_run.trace, p_run.trace,
        "the child joins the parent's trace"
    );
    assert_eq!(
        c_run.parent, task.id,
        "the child's run span hangs under the parent's task call"
    );
    one("execute_tool echo", &child);
    // Every span of ours carries the run and the thread.
    for s in &spans {
        assert!(
            s.attrs.contains_key("run_id") && s.attrs.contains_key("thread_id"),
            "span `{}` lacks run_id/thread_id: {:?}",
            s.name,
            s.attrs
        );
    }
}
