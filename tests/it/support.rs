//! `spawn_app()`: a fresh database and workspace in a temp dir, the mock model on port 0, and
//! embedded workers; everything stops when the returned value is dropped.

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;
use std::time::Instant;

use subagents::app::{App, StartRun};
use subagents::config::Settings;
use subagents::ids::RunId;
use subagents::model::mock::{LogEntry, MockOptions, MockServer};
use subagents::store::{EventRecord, RunRecord, RunStatus};
use subagents::tools::ToolRegistry;
use tokio_util::sync::CancellationToken;

pub struct TestApp {
    pub app: Arc<App>,
    pub mock: MockServer,
    pub dir: tempfile::TempDir,
    pub shutdown: CancellationToken,
    workers: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for TestApp {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// Settings for a test: a fresh SQLite file, short leases, fast retries.
pub fn test_settings(dir: &std::path::Path, mock: &MockServer) -> Settings {
    let mut s = Settings::defaults(&format!("sqlite://{}", dir.join("test.db").display()));
    s.jobs_dir = dir.join("jobs");
    s.workspace = dir.join("workspace");
    s.openai_base_url = mock.base_url();
    s.openai_api_key = Some("test-key".into());
    s.default_model = "mock-model".into();
    s.lease_ttl_secs = 1.5;
    s.poll_ms = 20;
    s.concurrency = 4;
    s.model_retries = 4;
    s
}

/// Replaces the model client with one wrapping it.
pub type WrapModel =
    fn(Arc<dyn subagents::model::ChatModel>) -> Arc<dyn subagents::model::ChatModel>;

pub struct Options {
    pub workers: bool,
    pub latency: Duration,
    pub tools: Option<ToolRegistry>,
    pub tweak: Box<dyn FnOnce(&mut Settings)>,
    /// Agent files to write into jobs/: (file stem, content).
    pub jobs: Vec<(String, String)>,
    /// Wraps the model client (a test's stand-in for a provider that misbehaves).
    pub wrap_model: Option<WrapModel>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            workers: true,
            latency: Duration::ZERO,
            tools: None,
            tweak: Box::new(|_| {}),
            jobs: vec![],
            wrap_model: None,
        }
    }
}

pub async fn spawn_app() -> TestApp {
    spawn_app_with(Options::default()).await
}

pub async fn spawn_app_with(opts: Options) -> TestApp {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("jobs")).unwrap();
    for (name, content) in &opts.jobs {
        std::fs::write(dir.path().join("jobs").join(format!("{name}.md")), content).unwrap();
    }
    let mock = MockServer::start(
        ([127, 0, 0, 1], 0).into(),
        MockOptions {
            latency: opts.latency,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let mut settings = test_settings(dir.path(), &mock);
    (opts.tweak)(&mut settings);
    let mut model = App::model_client(&settings).expect("the models table parses");
    if let Some(wrap) = opts.wrap_model {
        model = wrap(model);
    }
    let tools = opts
        .tools
        .unwrap_or_else(|| ToolRegistry::with_settings(App::tool_settings(&settings)));
    let app = Arc::new(App::open_custom(settings, model, tools).await.unwrap());
    let shutdown = CancellationToken::new();
    let workers = opts.workers.then(|| app.spawn_workers(shutdown.clone()));
    TestApp {
        app,
        mock,
        dir,
        shutdown,
        workers,
    }
}

impl TestApp {
    pub async fn start(&self, input: &str) -> RunRecord {
        self.app
            .start_run(StartRun {
                input: input.into(),
                ..Default::default()
            })
            .await
            .unwrap()
    }

    pub async fn wait(&self, run: RunId) -> RunRecord {
        let r = self
            .app
            .wait(run, Duration::from_secs(60))
            .await
            .unwrap()
            .unwrap();
        assert!(
            r.status.is_terminal(),
            "run {run} did not finish within 60 s: {r:?}"
        );
        r
    }

    pub async fn run(&self, input: &str) -> RunRecord {
        let r = self.start(input).await;
        self.wait(r.id).await
    }

    pub async fn events(&self, run: RunId) -> Vec<EventRecord> {
        self.app.store.events_after(run, 0, 10_000).await.unwrap()
    }

    /// Successful (200) answers per step key.
    pub fn served(&self) -> HashMap<String, usize> {
        count_served(&self.mock.state.log())
    }

    /// Serves the API for this app on a free port; returns its base URL.
    pub async fn serve(&self, keys: &str) -> String {
        let mut k = subagents::api::auth::Keys::default();
        k.add_pairs(keys).unwrap();
        self.serve_keys(k).await
    }

    /// Serves the API with keys built by the caller (a keys file, say).
    pub async fn serve_keys(&self, k: subagents::api::auth::Keys) -> String {
        let server = subagents::api::Server::start(
            self.app.clone(),
            k,
            ([127, 0, 0, 1], 0).into(),
            self.shutdown.clone(),
        )
        .await
        .unwrap();
        format!("http://{}", server.addr)
    }

    pub async fn stop_workers(&mut self) {
        self.shutdown.cancel();
        if let Some(w) = self.workers.take() {
            w.await.unwrap();
        }
    }
}

/// `program` (the `subagents` binary, or a wrapper such as `script`) set up as a `subagents`
/// process on this app's database, jobs, workspace and mock.
pub fn cli_command(t: &TestApp, program: &str) -> Command {
    let mut cmd = Command::new(program);
    cmd.env(
        "DATABASE_URL",
        format!("sqlite://{}", t.dir.path().join("test.db").display()),
    )
    .env("SUBAGENTS_JOBS_DIR", t.dir.path().join("jobs"))
    .env("SUBAGENTS_WORKSPACE", t.dir.path().join("workspace"))
    .env("OPENAI_BASE_URL", t.mock.base_url())
    .env("OPENAI_API_KEY", "x")
    .env("SUBAGENTS_MODEL", "mock-model")
    .env("RUST_LOG", "warn");
    cmd
}

pub fn count_served(log: &[LogEntry]) -> HashMap<String, usize> {
    let mut m = HashMap::new();
    for e in log.iter().filter(|e| e.status == 200) {
        *m.entry(e.step_key.clone()).or_default() += 1;
    }
    m
}

/// Asserts the event stream is 1..=n without gaps and ends with the run's terminal event.
pub fn assert_gap_free(events: &[EventRecord], status: RunStatus) {
    // Every event, however it was written (in Rust or in SQL), is one of the typed events.
    for e in events {
        assert!(
            subagents::domain::Event::parse(&e.kind, &e.data).is_some(),
            "event {} (seq {}) does not match its type's payload: {}",
            e.kind,
            e.seq,
            e.data
        );
    }
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e.seq, i as u64 + 1, "event seq gap at {i}: {events:#?}");
    }
    assert_eq!(events.first().map(|e| e.kind.as_str()), Some("run.queued"));
    let last = events.last().unwrap().kind.as_str();
    let want = match status {
        RunStatus::Succeeded => "run.succeeded",
        RunStatus::Failed => "run.failed",
        RunStatus::Cancelled => "run.cancelled",
        other => panic!("not terminal: {other:?}"),
    };
    assert_eq!(last, want);
    assert_eq!(
        events.iter().filter(|e| e.kind == want).count(),
        1,
        "exactly one terminal event"
    );
}

pub fn kinds(events: &[EventRecord]) -> Vec<&str> {
    events.iter().map(|e| e.kind.as_str()).collect()
}

/// A tool that sleeps, for tool-timeout and cancel tests.
pub struct Sleep(pub Duration);

#[async_trait::async_trait]
impl subagents::tools::Tool for Sleep {
    fn spec(&self) -> subagents::model::ToolSpec {
        subagents::model::ToolSpec {
            kind: "function".into(),
            function: subagents::model::FunctionSpec {
                name: "sleep".into(),
                description: "sleeps".into(),
                parameters: serde_json::json!({"type": "object"}),
            },
        }
    }
    async fn call(
        &self,
        _: serde_json::Value,
        _: &subagents::tools::ToolCtx,
    ) -> Result<String, subagents::tools::ToolError> {
        tokio::time::sleep(self.0).await;
        Ok("slept".into())
    }
}

/// A tool that returns a lot, for truncation tests.
pub struct Big(pub usize);

#[async_trait::async_trait]
impl subagents::tools::Tool for Big {
    fn spec(&self) -> subagents::model::ToolSpec {
        subagents::model::ToolSpec {
            kind: "function".into(),
            function: subagents::model::FunctionSpec {
                name: "big".into(),
                description: "returns a lot".into(),
                parameters: serde_json::json!({"type": "object"}),
            },
        }
    }
    async fn call(
        &self,
        _: serde_json::Value,
        _: &subagents::tools::ToolCtx,
    ) -> Result<String, subagents::tools::ToolError> {
        Ok("x".repeat(self.0))
    }
}

pub fn tools_with(extra: Vec<Arc<dyn subagents::tools::Tool>>) -> ToolRegistry {
    let mut t = ToolRegistry::builtin(None);
    for x in extra {
        t.register(x);
    }
    t
}

/// A fresh, empty PostgreSQL database for one test. The server comes from
/// `SUBAGENTS_TEST_POSTGRES` (default: the local one, trust auth), which `.ci/run` starts.
pub async fn fresh_postgres_database() -> String {
    let admin = std::env::var("SUBAGENTS_TEST_POSTGRES")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let name = format!("sa_test_{}", uuid::Uuid::now_v7().simple());
    let pool = sqlx::PgPool::connect(&admin)
        .await
        .expect("PostgreSQL for the tests (set SUBAGENTS_TEST_POSTGRES)");
    // Drop test databases left by runs over an hour old (their names carry a UUID v7, whose
    // first 48 bits are the creation time in ms), so a developer machine does not fill up.
    let old: Vec<String> =
        sqlx::query_scalar("SELECT datname FROM pg_database WHERE datname LIKE 'sa\\_test\\_%'")
            .fetch_all(&pool)
            .await
            .unwrap_or_default();
    let hour_ago = chrono::Utc::now().timestamp_millis() - 3_600_000;
    for db in old {
        let born = db
            .strip_prefix("sa_test_")
            .and_then(|h| i64::from_str_radix(h.get(..12)?, 16).ok());
        if born.is_some_and(|b| b < hour_ago) {
            let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
                "DROP DATABASE IF EXISTS {db} WITH (FORCE)"
            )))
            .execute(&pool)
            .await;
        }
    }
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&pool)
        .await
        .unwrap();
    pool.close().await;
    let base = admin.rsplit_once('/').map(|(b, _)| b).unwrap_or(&admin);
    format!("{base}/{name}")
}

/// A private redis-server on a free port (append-only file, so a restart keeps its data).
pub struct RedisServer {
    pub port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

impl RedisServer {
    pub fn start() -> RedisServer {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut s = RedisServer {
            port,
            dir: tempfile::tempdir().unwrap(),
            child: None,
        };
        s.restart();
        s
    }

    /// (Re)starts it; the append-only file makes a restart keep what was written.
    pub fn restart(&mut self) {
        let child = Command::new("redis-server")
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
            ])
            .arg("--dir")
            .arg(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server on PATH");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A `subagents worker` process on the test's SQLite file (in `dir`) and mock model; `extra`
/// environment variables are added or override the defaults.
pub fn spawn_worker(dir: &std::path::Path, mock: &MockServer, extra: &[(&str, String)]) -> Worker {
    let mut c = process(dir, mock, &["worker"]);
    for (k, v) in extra {
        c.env(k, v);
    }
    Reaped(c.spawn().expect("spawn worker"))
}

/// A `subagents` process (`args`) on the test's SQLite file (in `dir`), agents, workspace and
/// mock model, with short leases and polls and warnings only; its error output inherited.
pub fn process(dir: &std::path::Path, mock: &MockServer, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_subagents"));
    c.args(args)
        .env(
            "DATABASE_URL",
            format!("sqlite://{}", dir.join("test.db").display()),
        )
        .env("SUBAGENTS_JOBS_DIR", dir.join("jobs"))
        .env("SUBAGENTS_WORKSPACE", dir.join("workspace"))
        .env("OPENAI_BASE_URL", mock.base_url())
        .env("OPENAI_API_KEY", "x")
        .env("SUBAGENTS_MODEL", "mock-model")
        .env("SUBAGENTS_LEASE_TTL", "1.5")
        .env("SUBAGENTS_POLL_MS", "20")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    c
}

/// A worker process of a test (see [`Reaped`]).
pub type Worker = Reaped;

/// A child process of a test (a worker, `serve`, a server the test talks to) that is killed
/// and reaped when dropped, so a test that fails half-way leaves nothing behind to load the
/// machine for the tests after it.
pub struct Reaped(pub Child);

impl std::ops::Deref for Reaped {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Reaped {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for Reaped {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
        }
        let _ = self.0.wait();
    }
}

/// The tool results of a run, as the model saw them (text).
pub async fn tool_texts(t: &TestApp, r: &RunRecord) -> Vec<String> {
    let msgs = t
        .app
        .store
        .thread_messages(&r.thread_id, 10_000)
        .await
        .unwrap();
    subagents::engine::context(&msgs, r.id)
        .into_iter()
        .filter_map(|m| match m {
            subagents::model::Message::Tool { content, .. } => Some(content),
            _ => None,
        })
        .collect()
}

/// A PostgreSQL server of its own (initdb in a temporary directory, on a free port), for tests
/// that stop and start the server itself; the shared one on 5432 serves every other test.
/// PostgreSQL will not run as root, so as root its commands run as the `postgres` user.
pub struct PrivatePostgres {
    pub port: u16,
    dir: tempfile::TempDir,
    bin: std::path::PathBuf,
}

impl PrivatePostgres {
    pub fn start() -> PrivatePostgres {
        let bindir = Command::new("pg_config").arg("--bindir").output();
        let bindir = bindir
            .ok()
            .filter(|o| o.status.success())
            .map(|o| std::path::PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()))
            .filter(|d| d.join("initdb").exists());
        let bin = match bindir {
            Some(d) => d,
            None => {
                // Debian keeps the server's programs out of PATH.
                let mut versions: Vec<_> = std::fs::read_dir("/usr/lib/postgresql")
                    .expect("PostgreSQL's programs (initdb, pg_ctl): scripts/test.sh installs them")
                    .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
                    .filter(|p| p.join("initdb").exists())
                    .collect();
                versions.sort();
                versions.pop().expect("initdb")
            }
        };
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let s = PrivatePostgres {
            port,
            dir: tempfile::tempdir().unwrap(),
            bin,
        };
        if unsafe { libc::geteuid() } == 0 {
            let ok = Command::new("chown")
                .args(["-R", "postgres"])
                .arg(s.dir.path())
                .status()
                .unwrap();
            assert!(ok.success(), "chown to postgres");
        }
        let data = s.dir.path().join("data");
        s.run(
            "initdb",
            &[
                "-D",
                data.to_str().unwrap(),
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
            ],
        );
        s.up();
        s
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Starts the server and waits until it accepts connections.
    pub fn up(&self) {
        let data = self.dir.path().join("data");
        let log = self.dir.path().join("log");
        let opts = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=100",
            self.port,
            self.dir.path().display()
        );
        self.run(
            "pg_ctl",
            &[
                "-D",
                data.to_str().unwrap(),
                "-l",
                log.to_str().unwrap(),
                "-o",
                &opts,
                "-w",
                "start",
            ],
        );
    }

    /// Stops the server (`fast`: open connections are cut, as at a restart).
    pub fn down(&self) {
        let data = self.dir.path().join("data");
        self.run(
            "pg_ctl",
            &["-D", data.to_str().unwrap(), "-m", "fast", "-w", "stop"],
        );
    }

    /// `program` of the server's, as the `postgres` user when we are root.
    fn command(&self, program: &str, args: &[&str]) -> Command {
        let path = self.bin.join(program);
        let mut c = if unsafe { libc::geteuid() } == 0 {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(path);
            c
        } else {
            Command::new(path)
        };
        c.args(args).stdout(Stdio::null());
        c
    }

    fn run(&self, program: &str, args: &[&str]) {
        let status = self.command(program, args).status();
        assert!(
            status.unwrap().success(),
            "{program} {args:?} failed (log: {})",
            self.dir.path().join("log").display()
        );
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        let data = self.dir.path().join("data");
        let args = ["-D", data.to_str().unwrap(), "-m", "immediate", "stop"];
        let _ = self.command("pg_ctl", &args).stderr(Stdio::null()).status();
    }
}

/// A child process whose error output the test reads line by line (each line also echoed to
/// the test's own output, prefixed with `name`).
pub struct Logged {
    pub child: Reaped,
    pub lines: std::sync::mpsc::Receiver<String>,
}

impl Logged {
    /// Spawns `cmd` with its error output piped.
    pub fn spawn(cmd: &mut Command, name: &'static str) -> Logged {
        use std::io::{BufRead, BufReader};
        let mut child = Reaped(cmd.stderr(Stdio::piped()).spawn().expect("spawn"));
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("{name}: {line}");
                let _ = tx.send(line);
            }
        });
        Logged { child, lines }
    }

    /// Whether a line containing every one of `needles` comes within `within`.
    pub fn saw(&self, needles: &[&str], within: Duration) -> bool {
        let until = std::time::Instant::now() + within;
        tokio::task::block_in_place(|| {
            while let Ok(line) = self
                .lines
                .recv_timeout(until.saturating_duration_since(std::time::Instant::now()))
            {
                if needles.iter().all(|n| line.contains(n)) {
                    return true;
                }
            }
            false
        })
    }

    /// `serve`'s base URL, from the line where it says where it listens.
    pub fn listening_on(&self) -> String {
        tokio::task::block_in_place(|| {
            loop {
                let line = self
                    .lines
                    .recv_timeout(Duration::from_secs(60))
                    .expect("serve says where it listens");
                if let Some(i) = line.find("listening on ") {
                    break line[i + "listening on ".len()..]
                        .split_whitespace()
                        .next()
                        .unwrap()
                        .to_owned();
                }
            }
        })
    }
}
