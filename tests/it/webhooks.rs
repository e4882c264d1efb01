//! Webhooks against a receiver written with the official Standard Webhooks library (npm,
//! pinned; installed with the MCP servers): every signature verifies; a receiver that is down,
//! then answers 500, then comes back gets every event, each under one `webhook-id` however many
//! attempts it took; a process killed mid-attempt leaves the delivery to the next; a private
//! destination is refused unless allowed; a receiver that keeps failing is paused and resumed.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use subagents::app::StartRun;
use subagents::store::RunStatus;

use crate::support::*;

/// A receiver: verifies each request with `standardwebhooks`' `Webhook.verify`, logs it as a
/// JSON line (`id`, `verified`, `type`, `mode`), and answers as the mode file says (`500`, or
/// 204).
struct Receiver {
    dir: PathBuf,
    port: u16,
    child: Option<std::process::Child>,
}

impl Receiver {
    fn new(dir: &Path) -> Receiver {
        let lib = crate::mcp::servers_dir().join("node_modules/standardwebhooks");
        std::fs::write(
            dir.join("receiver.cjs"),
            format!(
                r#"const http = require("node:http");
const fs = require("node:fs");
const {{ Webhook }} = require("{lib}");
const [port, dir] = process.argv.slice(2);
http.createServer((req, res) => {{
  let body = "";
  req.on("data", (c) => (body += c));
  req.on("end", () => {{
    const mode = fs.existsSync(dir + "/mode") ? fs.readFileSync(dir + "/mode", "utf8").trim() : "ok";
    let verified = false, type = null, run_id = null;
    try {{
      const payload = new Webhook(fs.readFileSync(dir + "/secret", "utf8").trim()).verify(body, req.headers);
      verified = true; type = payload.type; run_id = payload.data.id || payload.data.run_id;
    }} catch (e) {{ verified = String(e); }}
    fs.appendFileSync(dir + "/log", JSON.stringify({{ id: req.headers["webhook-id"], verified, type, run_id, mode }}) + "\n");
    if (mode === "500") {{ res.writeHead(500); res.end("not now"); }} else {{ res.writeHead(204); res.end(); }}
  }});
}}).listen(Number(port), "127.0.0.1");
"#,
                lib = lib.display()
            ),
        )
        .unwrap();
        Receiver {
            dir: dir.to_owned(),
            port: free_port(),
            child: None,
        }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}/hook", self.port)
    }

    fn mode(&self, mode: &str) {
        std::fs::write(self.dir.join("mode"), mode).unwrap();
    }

    fn secret(&self, secret: &str) {
        std::fs::write(self.dir.join("secret"), secret).unwrap();
    }

    async fn start(&mut self) {
        let child = std::process::Command::new("node")
            .arg(self.dir.join("receiver.cjs"))
            .arg(self.port.to_string())
            .arg(&self.dir)
            .spawn()
            .expect("node runs the receiver");
        self.child = Some(child);
        let t0 = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "the receiver listens"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// What it received, in order.
    fn log(&self) -> Vec<Value> {
        std::fs::read_to_string(self.dir.join("log"))
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        if let Some(c) = &mut self.child {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

async fn until(what: &str, secs: u64, mut f: impl AsyncFnMut() -> bool) {
    let t0 = Instant::now();
    while !f().await {
        assert!(t0.elapsed() < Duration::from_secs(secs), "{what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn app(allow: bool) -> (TestApp, String) {
    let t = spawn_app_with(Options {
        tweak: Box::new(move |s| {
            if allow {
                s.webhook_allow = vec!["127.0.0.1".into()];
            }
            s.webhook_backoff_secs = 0.2;
            s.webhook_timeout_secs = 2.0;
        }),
        ..Default::default()
    })
    .await;
    let base = t.serve("").await;
    subagents::webhooks::spawn(t.app.clone(), t.shutdown.clone());
    (t, base)
}

async fn get_json(http: &reqwest::Client, url: String) -> Value {
    http.get(url).send().await.unwrap().json().await.unwrap()
}

async fn deliveries(http: &reqwest::Client, base: &str, hook: &str) -> Vec<Value> {
    let page: Value = get_json(http, format!("{base}/v1/webhooks/{hook}/deliveries")).await;
    page["deliveries"].as_array().unwrap().clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_down_then_failing_then_back_gets_every_event_once_signed() {
    let (t, base) = app(true).await;
    let dir = tempfile::tempdir().unwrap();
    let mut receiver = Receiver::new(dir.path());
    let http = reqwest::Client::new();
    let created = http
        .post(format!("{base}/v1/webhooks"))
        .json(&json!({"url": receiver.url(), "events": ["run.started", "run.succeeded"], "description": "test"}))
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), 201);
    let hook: Value = created.json().await.unwrap();
    let secret = hook["secret"].as_str().unwrap();
    assert!(secret.starts_with("whsec_"), "{hook}");
    receiver.secret(secret);
    let id = hook["id"].as_str().unwrap().to_owned();
    let listed: Value = get_json(&http, format!("{base}/v1/webhooks/{id}")).await;
    assert!(
        listed.get("secret").is_none(),
        "the secret is shown once: {listed}"
    );

    // The receiver is down: two runs end, their deliveries fail and are retried.
    let mut runs = vec![];
    for _ in 0..2 {
        let r = t.start("SCENARIO steps=1").await;
        assert_eq!(t.wait(r.id).await.status, RunStatus::Succeeded);
        runs.push(r.id.to_string());
    }
    until(
        "the deliveries are tried while the receiver is down",
        60,
        async || {
            let d = deliveries(&http, &base, &id).await;
            d.len() == 4 && d.iter().all(|d| d["attempts"].as_u64() >= Some(2))
        },
    )
    .await;
    // Up, but failing.
    receiver.mode("500");
    receiver.start().await;
    until("the receiver sees attempts it fails", 60, async || {
        let log = receiver.log();
        let ids: BTreeSet<&str> = log.iter().filter_map(|e| e["id"].as_str()).collect();
        ids.len() == 4
    })
    .await;
    // The receiver logs a request before its answer is recorded on the delivery: wait for
    // every delivery's record of a failing attempt (CI once read one still at its unreachable
    // attempt, the answer in flight).
    until(
        "every delivery records the receiver's 500",
        60,
        async || {
            let d = deliveries(&http, &base, &id).await;
            d.len() == 4
                && d.iter()
                    .all(|d| d["status"] == "failed" && d["last_status"] == 500)
        },
    )
    .await;
    // Back.
    receiver.mode("ok");
    until("every delivery is delivered", 90, async || {
        deliveries(&http, &base, &id)
            .await
            .iter()
            .all(|d| d["status"] == "delivered")
    })
    .await;

    let log = receiver.log();
    assert!(
        log.iter().all(|e| e["verified"] == true),
        "every signature verifies with the Standard Webhooks library: {log:?}"
    );
    let mut by_id: BTreeMap<String, Vec<&Value>> = BTreeMap::new();
    for e in &log {
        by_id
            .entry(e["id"].as_str().unwrap().to_owned())
            .or_default()
            .push(e);
    }
    assert_eq!(by_id.len(), 4, "one webhook-id per delivery: {log:?}");
    let mut got: BTreeSet<(String, String)> = BTreeSet::new();
    for (wid, attempts) in &by_id {
        assert!(
            attempts.iter().all(|a| a["type"] == attempts[0]["type"]),
            "{wid}: one event per id"
        );
        assert_eq!(
            attempts.iter().filter(|a| a["mode"] == "ok").count(),
            1,
            "{wid}: delivered once: {attempts:?}"
        );
        got.insert((
            attempts[0]["run_id"].as_str().unwrap().to_owned(),
            attempts[0]["type"].as_str().unwrap().to_owned(),
        ));
    }
    let want: BTreeSet<(String, String)> = runs
        .iter()
        .flat_map(|r| ["run.started", "run.succeeded"].map(|k| (r.clone(), k.to_owned())))
        .collect();
    assert_eq!(got, want);

    // A redelivery sends the same id again.
    let one = &deliveries(&http, &base, &id).await[0];
    let did = one["id"].as_str().unwrap();
    let before = receiver.log().len();
    let r = http
        .post(format!(
            "{base}/v1/webhooks/{id}/deliveries/{did}/redeliver"
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    until("the redelivery arrives", 30, async || {
        receiver.log().len() > before
    })
    .await;
    assert_eq!(receiver.log().last().unwrap()["id"], did);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_private_destination_is_refused_unless_allowed_and_bad_subscriptions_say_why() {
    let (_t, base) = app(false).await;
    let http = reqwest::Client::new();
    let post = async |body: Value| {
        let r = http
            .post(format!("{base}/v1/webhooks"))
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json::<Value>().await.unwrap())
    };
    for url in [
        "http://127.0.0.1:9/hook",
        "http://169.254.169.254/latest",
        "http://[::1]:9/",
    ] {
        let (status, body) = post(json!({"url": url, "events": ["*"]})).await;
        assert_eq!(status, 422, "{url}: {body}");
        assert_eq!(body["error"]["code"], "private_address", "{body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("SUBAGENTS_WEBHOOK_ALLOW"),
            "{body}"
        );
    }
    let (status, body) = post(json!({"url": "ftp://example.com/", "events": ["*"]})).await;
    assert_eq!(
        (status, &body["error"]["code"]),
        (422, &json!("invalid_webhook"))
    );
    let (status, body) =
        post(json!({"url": "https://example.com/", "events": ["run.exploded"]})).await;
    assert_eq!(
        (status, &body["error"]["code"]),
        (422, &json!("unknown_event_type"))
    );
    let (status, body) = post(json!({"url": "https://example.com/", "events": []})).await;
    assert_eq!(
        (status, &body["error"]["code"]),
        (422, &json!("invalid_webhook"))
    );
    let r = http
        .get(format!("{base}/v1/webhooks/wh_nope/deliveries"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_that_keeps_failing_is_paused_and_a_resume_sends_what_waited() {
    let t = spawn_app_with(Options {
        tweak: Box::new(|s| {
            s.webhook_allow = vec!["127.0.0.1".into()];
            s.webhook_backoff_secs = 0.1;
            s.webhook_retry_for_secs = 0.5;
            s.webhook_pause_after = 2;
        }),
        ..Default::default()
    })
    .await;
    let base = t.serve("").await;
    subagents::webhooks::spawn(t.app.clone(), t.shutdown.clone());
    let dir = tempfile::tempdir().unwrap();
    let mut receiver = Receiver::new(dir.path());
    receiver.mode("500");
    receiver.start().await;
    let http = reqwest::Client::new();
    let hook: Value = http
        .post(format!("{base}/v1/webhooks"))
        .json(&json!({"url": receiver.url(), "events": ["run.succeeded"]}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    receiver.secret(hook["secret"].as_str().unwrap());
    let id = hook["id"].as_str().unwrap().to_owned();
    for _ in 0..2 {
        let r = t.start("SCENARIO steps=1").await;
        t.wait(r.id).await;
    }
    until(
        "both deliveries die and the subscription pauses",
        60,
        async || {
            let h: Value = get_json(&http, format!("{base}/v1/webhooks/{id}")).await;
            h["paused"] == true
        },
    )
    .await;
    let h: Value = get_json(&http, format!("{base}/v1/webhooks/{id}")).await;
    assert!(
        h["paused_reason"].as_str().unwrap().contains("HTTP 500"),
        "{h}"
    );
    let d = deliveries(&http, &base, &id).await;
    assert!(d.iter().all(|d| d["status"] == "dead"), "{d:?}");
    // The dashboard shows it, in a real browser.
    let b = crate::browser::Browser::start(1280, 900).await;
    b.goto(&format!("{base}/ui/webhooks")).await;
    b.wait_for("[data-paused]", 30).await;
    let shown = b.text(&format!("[data-webhook='{id}']")).await;
    assert!(
        shown.contains("paused") && shown.contains("HTTP 500") && shown.contains("dead"),
        "{shown}"
    );
    drop(b);
    // While paused, a new event waits rather than being sent or lost.
    receiver.mode("ok");
    let r = t.start("SCENARIO steps=1").await;
    t.wait(r.id).await;
    until("the third delivery exists", 30, async || {
        deliveries(&http, &base, &id).await.len() == 3
    })
    .await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    let ok = |log: &[Value]| log.iter().filter(|e| e["mode"] == "ok").count();
    assert_eq!(ok(&receiver.log()), 0, "nothing is sent while paused");
    let resumed = http
        .patch(format!("{base}/v1/webhooks/{id}"))
        .json(&json!({"paused": false}))
        .send()
        .await
        .unwrap();
    assert_eq!(resumed.status(), 200);
    until("the waiting delivery goes out on resume", 30, async || {
        ok(&receiver.log()) == 1
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_attempt_leaves_the_delivery_to_the_next_one() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("jobs")).unwrap();
    let mock =
        subagents::model::mock::MockServer::start(([127, 0, 0, 1], 0).into(), Default::default())
            .await
            .unwrap();
    let app = subagents::app::App::open(test_settings(dir.path(), &mock))
        .await
        .unwrap();
    let rdir = tempfile::tempdir().unwrap();
    let mut receiver = Receiver::new(rdir.path());
    receiver.start().await;
    let hook = subagents::store::Webhook {
        id: "wh_kill".into(),
        owner: subagents::ids::OwnerId::local(),
        url: receiver.url(),
        events: vec!["run.succeeded".into()],
        agents: None,
        description: String::new(),
        secret: "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".into(),
        old_secret: None,
        paused_reason: None,
        run_id: None,
        created_at: chrono::Utc::now(),
        updated_at: chrono::Utc::now(),
    };
    app.store.create_webhook(&hook).await.unwrap();
    receiver.secret(&hook.secret);
    let run = app
        .start_run(StartRun {
            input: "SCENARIO steps=1".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let env = |fail: bool| {
        let mut v = vec![
            ("SUBAGENTS_WEBHOOK_ALLOW", "127.0.0.1".to_owned()),
            ("SUBAGENTS_WEBHOOK_TIMEOUT", "1".to_owned()),
        ];
        if fail {
            v.push((
                "SUBAGENTS_FAILPOINTS",
                "before_webhook_send=crash".to_owned(),
            ));
        }
        v
    };
    // The first worker runs the run, claims its delivery, and dies before sending it.
    let mut first = spawn_worker(dir.path(), &mock, &env(true));
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = first.try_wait().unwrap() {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the worker reaches the failpoint"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(!status.success(), "it crashed at the failpoint: {status:?}");
    let done = app.store.get_run(run.id).await.unwrap().unwrap();
    assert_eq!(done.status, RunStatus::Succeeded);
    let d = app
        .store
        .list_deliveries("wh_kill", None, 10)
        .await
        .unwrap();
    assert_eq!(d.len(), 1);
    assert_eq!(d[0].attempts, 1, "claimed once: {d:?}");
    assert!(receiver.log().is_empty(), "nothing was sent");

    // The next worker sends it once the dead one's lock lapses, under the same id.
    let _second = spawn_worker(dir.path(), &mock, &env(false));
    until("the delivery arrives", 60, async || {
        !receiver.log().is_empty()
    })
    .await;
    let log = receiver.log();
    assert_eq!(log.len(), 1, "{log:?}");
    assert_eq!(log[0]["id"], d[0].id.as_str());
    assert_eq!(log[0]["verified"], true);
    assert_eq!(log[0]["run_id"], run.id.to_string());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_carries_its_own_webhook_signed_with_a_secret_shown_once() {
    let (t, base) = app(true).await;
    let dir = tempfile::tempdir().unwrap();
    let mut receiver = Receiver::new(dir.path());
    receiver.start().await;
    let http = reqwest::Client::new();
    let r = http
        .post(format!("{base}/v1/runs"))
        .json(&json!({"input": "SCENARIO steps=1", "webhook": {"url": receiver.url()}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let run: Value = r.json().await.unwrap();
    let secret = run["webhook"]["secret"].as_str().unwrap();
    receiver.secret(secret);
    let hook = run["webhook"]["id"].as_str().unwrap().to_owned();
    let id: subagents::ids::RunId = run["id"].as_str().unwrap().parse().unwrap();
    assert_eq!(t.wait(id).await.status, RunStatus::Succeeded);
    until("the run's end reaches its webhook", 30, async || {
        !receiver.log().is_empty()
    })
    .await;
    let log = receiver.log();
    assert_eq!(
        log.len(),
        1,
        "the default events are the run's end: {log:?}"
    );
    assert_eq!(log[0]["type"], "run.succeeded");
    assert_eq!(log[0]["verified"], true);
    assert_eq!(log[0]["run_id"], id.to_string());
    // Another run ends: nothing more for this webhook, which is not among the owner's.
    let other = t.start("SCENARIO steps=1").await;
    t.wait(other.id).await;
    let listed: Value = get_json(&http, format!("{base}/v1/webhooks")).await;
    assert_eq!(listed["webhooks"], json!([]), "{listed}");
    let d = deliveries(&http, &base, &hook).await;
    assert_eq!(d.len(), 1, "{d:?}");
    assert_eq!(d[0]["status"], "delivered");
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(receiver.log().len(), 1);
    // A private destination is refused before any run starts.
    let r = http
        .post(format!("{base}/v1/runs"))
        .json(&json!({"input": "x", "webhook": {"url": "http://10.0.0.1/"}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 422);
    let (t2, base2) = app(false).await;
    let r = http
        .post(format!("{base2}/v1/runs"))
        .json(&json!({"input": "x", "webhook": {"url": receiver.url()}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 422, "loopback without SUBAGENTS_WEBHOOK_ALLOW");
    let none = t2
        .app
        .store
        .list_runs(&subagents::ids::OwnerId::local(), &Default::default(), 10)
        .await
        .unwrap();
    assert!(none.is_empty(), "no run started: {none:?}");
}
