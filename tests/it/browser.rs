//! A small W3C WebDriver client over reqwest, driving Debian's headless Chromium through
//! chromedriver: enough to open pages, find, click, type, read text, run a script and take
//! screenshots. `.ci/run` installs `chromium` and `chromium-driver` when they are missing.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde_json::{Value, json};

const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// A chromedriver process and one browser session; both end on drop.
pub struct Browser {
    driver: Child,
    base: String,
    http: reqwest::Client,
}

fn find_binary(names: &[&str]) -> Option<PathBuf> {
    for n in names {
        for dir in std::env::var("PATH")
            .unwrap_or_default()
            .split(':')
            .chain(["/usr/bin", "/usr/lib/chromium"])
        {
            let p = PathBuf::from(dir).join(n);
            if p.is_file() {
                return Some(p);
            }
        }
    }
    None
}

impl Browser {
    /// Starts chromedriver on a free port and opens a headless session `width`×`height`.
    pub async fn start(width: u32, height: u32) -> Browser {
        let driver_bin = find_binary(&["chromedriver"]).expect(
            "chromedriver not found: install Debian's chromium and chromium-driver (.ci/run does)",
        );
        let chrome = find_binary(&["chromium", "chromium-browser"])
            .expect("chromium not found: install Debian's chromium (.ci/run does)");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        // Its own process group, so the browsers it starts are killed with it.
        let driver = {
            use std::os::unix::process::CommandExt;
            Command::new(driver_bin)
                .arg(format!("--port={port}"))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .process_group(0)
                .spawn()
                .expect("start chromedriver")
        };
        let http = reqwest::Client::new();
        let base = format!("http://127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(r) = http.get(format!("{base}/status")).send().await
                && r.status().is_success()
            {
                break;
            }
            assert!(Instant::now() < deadline, "chromedriver did not start");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let caps = json!({"capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": {
            "binary": chrome,
            // No background traffic: this machine's network is closed, and refused connections
            // only slow the browser down.
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                     "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-quic",
                     format!("--window-size={width},{height}")]
        }}}});
        let v: Value = http
            .post(format!("{base}/session"))
            .json(&caps)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let session = v["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no WebDriver session: {v}"))
            .to_owned();
        Browser {
            driver,
            base: format!("{base}/session/{session}"),
            http,
        }
    }

    async fn cmd(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        let mut r = self.http.request(method, format!("{}{path}", self.base));
        if let Some(b) = body {
            r = r.json(&b);
        }
        let v: Value = r.send().await.unwrap().json().await.unwrap();
        v["value"].clone()
    }

    /// Opens `url`.
    pub async fn goto(&self, url: &str) {
        self.cmd(reqwest::Method::POST, "/url", Some(json!({"url": url})))
            .await;
    }

    /// The page's URL now.
    pub async fn url(&self) -> String {
        self.cmd(reqwest::Method::GET, "/url", None)
            .await
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    /// Runs `script` (a function body; `arguments` holds `args`) and returns its value.
    pub async fn js(&self, script: &str, args: Value) -> Value {
        self.cmd(
            reqwest::Method::POST,
            "/execute/sync",
            Some(json!({"script": script, "args": args})),
        )
        .await
    }

    async fn find(&self, css: &str) -> Option<String> {
        let v = self
            .cmd(
                reqwest::Method::POST,
                "/element",
                Some(json!({"using": "css selector", "value": css})),
            )
            .await;
        v[ELEMENT].as_str().map(str::to_owned)
    }

    /// Waits (up to `secs`) for an element matching `css` and returns its id.
    pub async fn wait_for(&self, css: &str, secs: u64) -> String {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            if let Some(e) = self.find(css).await {
                return e;
            }
            if Instant::now() > deadline {
                let body = self
                    .js("return document.body.innerText.slice(0, 2000)", json!([]))
                    .await;
                panic!(
                    "no `{css}` on {} within {secs}s; the page says:\n{}",
                    self.url().await,
                    body.as_str().unwrap_or_default()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until `script` (returning a value) returns something truthy; returns it.
    pub async fn wait_until(&self, what: &str, script: &str, secs: u64) -> Value {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let v = self.js(script, json!([])).await;
            if !(v.is_null() || v == json!(false) || v == json!(0) || v == json!("")) {
                return v;
            }
            if Instant::now() > deadline {
                let body = self
                    .js("return document.body.innerText.slice(0, 2000)", json!([]))
                    .await;
                panic!(
                    "{what}: not within {secs}s on {}; the page says:\n{}",
                    self.url().await,
                    body.as_str().unwrap_or_default()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Clicks the element matching `css` (waiting for it first; a live page may replace the
    /// element between finding and clicking it, so a stale one is looked up again).
    pub async fn click(&self, css: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let e = self.wait_for(css, 10).await;
            let v = self
                .cmd(
                    reqwest::Method::POST,
                    &format!("/element/{e}/click"),
                    Some(json!({})),
                )
                .await;
            if v.get("error").is_none() {
                return;
            }
            assert!(Instant::now() < deadline, "could not click `{css}`: {v}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Types `text` into the element matching `css`.
    pub async fn type_into(&self, css: &str, text: &str) {
        let e = self.wait_for(css, 10).await;
        self.cmd(
            reqwest::Method::POST,
            &format!("/element/{e}/clear"),
            Some(json!({})),
        )
        .await;
        self.cmd(
            reqwest::Method::POST,
            &format!("/element/{e}/value"),
            Some(json!({"text": text})),
        )
        .await;
    }

    /// The visible text of the element matching `css`.
    pub async fn text(&self, css: &str) -> String {
        // The page redraws as events arrive: an element found a moment ago may be gone
        // ("stale element reference", an error object instead of text). Find it again.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let e = self.wait_for(css, 10).await;
            let v = self
                .cmd(reqwest::Method::GET, &format!("/element/{e}/text"), None)
                .await;
            if let Some(t) = v.as_str() {
                return t.to_owned();
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no text for {css}: {v}"
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }

    /// Resizes the window.
    pub async fn resize(&self, width: u32, height: u32) {
        self.cmd(
            reqwest::Method::POST,
            "/window/rect",
            Some(json!({"width": width, "height": height})),
        )
        .await;
    }

    /// Writes a PNG of the window to `$SUBAGENTS_SCREENSHOTS/<name>.png` (default
    /// `target/screenshots`).
    pub async fn screenshot(&self, name: &str) -> PathBuf {
        let dir = std::env::var("SUBAGENTS_SCREENSHOTS")
            .map(PathBuf::from)
            .unwrap_or_else(|_| {
                PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/screenshots")
            });
        std::fs::create_dir_all(&dir).unwrap();
        let b64 = self.cmd(reqwest::Method::GET, "/screenshot", None).await;
        let png = base64::engine::general_purpose::STANDARD
            .decode(b64.as_str().expect("screenshot data"))
            .unwrap();
        assert!(png.starts_with(b"\x89PNG"), "a screenshot is a PNG");
        let path = dir.join(format!("{name}.png"));
        std::fs::write(&path, png).unwrap();
        path
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // Chromium first, through the driver; then the driver and anything left of its group. Never through
        // `/usr/bin/kill -9 -PGID`: procps-ng 4.0 reads a group id starting with 1 as `-1`
        // and kills every process on the machine (see `subagents::procs`).
        end_session(&self.base);
        let _ = subagents::procs::kill_group(self.driver.id());
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

/// `DELETE` the WebDriver session (the driver quits Chromium), over a plain socket: a drop
/// cannot await.
fn end_session(session_url: &str) {
    use std::io::{Read, Write};
    let Some((host, path)) = session_url
        .strip_prefix("http://")
        .and_then(|r| r.split_once('/'))
    else {
        return;
    };
    let Ok(mut s) = std::net::TcpStream::connect(host) else {
        return;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = write!(
        s,
        "DELETE /{path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    );
    let _ = s.read_to_end(&mut Vec::new());
}
