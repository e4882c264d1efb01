//! `subagents demo`: what a plain agent loop cannot do, in well under a minute, with no key and
//! no service. A parent run delegates to two children and parks (holding no worker) while they
//! work; the worker process running them is killed with SIGKILL mid-step; this process then
//! takes over, every run resumes from its last checkpoint, and the model is asked nothing it
//! had already answered. Finally a second run continues the parent's thread. With `--serve` the
//! dashboard shows it all live.
//!
//! The model is the in-process mock; the parent agent comes from a file the demo writes into a
//! temporary directory; the database is the configured one (by default `subagents.db`).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::app::App;
use crate::config::Settings;
use crate::domain::Event;
use crate::ids::RunId;
use crate::model::mock::{MockOptions, MockServer, Script, ScriptCall, Turn};
use crate::runs::StartRun;
use crate::store::RunStatus;

/// The parent agent: its system prompt carries the mock's script marker.
const LEAD: &str = "---
name: lead
description: Splits a question between two researchers and joins what they find.
---
MOCK:lead You lead a small research team. Give each part of the question to a general-purpose
subagent with the task tool, then join what they report into one answer.
";

/// The parent's final answer (the mock's script says it).
pub const LEAD_ANSWER: &str = "Both researchers reported back: a crashed step resumes from its last checkpoint, and a parent waiting on children holds no worker.";

/// The demo's lease: short, so the takeover after the kill comes within seconds.
const LEASE_SECS: f64 = 2.0;

/// What `subagents demo` shows; see the module doc.
pub async fn run(mut settings: Settings, serve: bool) -> anyhow::Result<ExitCode> {
    let dir = std::env::temp_dir().join(format!("subagents-demo-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("jobs"))?;
    std::fs::write(dir.join("jobs/lead.md"), LEAD)?;
    let mock = MockServer::start(
        SocketAddr::from(([127, 0, 0, 1], 0)),
        MockOptions {
            latency: Duration::from_millis(150),
            script: Some(Arc::new(script())),
            ..Default::default()
        },
    )
    .await?;
    settings.openai_base_url = mock.base_url();
    settings.openai_api_key = Some("demo".into());
    settings.default_model = "mock-model".into();
    settings.jobs_dir = dir.join("jobs");
    settings.lease_ttl_secs = LEASE_SECS;
    settings.redis_url = None;
    eprintln!(
        "demo: mock model at {}, database {}\n",
        mock.base_url(),
        settings.database_url
    );
    let app = Arc::new(App::open(settings.clone()).await?);
    let shutdown = CancellationToken::new();
    let server = if serve {
        Some(start_dashboard(&app, shutdown.clone()).await?)
    } else {
        None
    };
    let dashboard = server.as_ref().map(|s| format!("http://{}", s.addr));
    let outcome = show(
        &app,
        &settings,
        &mock,
        &dir,
        dashboard.as_deref(),
        &shutdown,
    )
    .await;
    if outcome.is_ok()
        && let Some(url) = &dashboard
    {
        eprintln!("\nthe dashboard stays up at {url}; Ctrl-C to stop");
        crate::cli::shutdown_signal().await;
    }
    shutdown.cancel();
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
    outcome
}

/// The demo's story, told on stderr; the runs' answers go to stdout.
async fn show(
    app: &Arc<App>,
    settings: &Settings,
    mock: &MockServer,
    dir: &Path,
    dashboard: Option<&str>,
    shutdown: &CancellationToken,
) -> anyhow::Result<ExitCode> {
    let mut worker = spawn_worker(settings, dir)?;
    let start = StartRun {
        agent: Some("lead".into()),
        input: "How does a durable executor keep an agent's work when a machine dies?".into(),
        ..Default::default()
    };
    let parent = app
        .start_run(start)
        .await
        .map_err(|e| anyhow::anyhow!("demo could not start: {e}"))?;
    eprintln!(
        "1) run {} (agent `lead`) starts on worker process {}: it delegates to two researchers.",
        parent.id,
        worker.id()
    );
    if let Some(url) = dashboard {
        eprintln!("   watch it live: {url}/ui/runs/{}", parent.id);
    }
    let children = mid_step(app, parent.id).await?;
    // `Child::kill` is SIGKILL on Unix: nothing is flushed or released.
    worker.kill().context("could not kill the demo's worker")?;
    worker.wait()?;
    eprintln!(
        "2) the parent parked on its children {} and {} (no worker slot held); both were mid-step, their last tool results not yet committed, when worker {} was killed with SIGKILL.",
        children[0],
        children[1],
        worker.id()
    );
    eprintln!(
        "3) this process takes over once the dead worker's leases expire ({LEASE_SECS}s here): every run resumes from its last checkpoint."
    );
    let workers = app.spawn_workers(shutdown.clone());
    let done = crate::cli::follow(app, parent.id, &crate::cli::Progress::new(false)).await?;
    let mut code = crate::cli::report(&done);
    for c in &children {
        if let Some(c) = app.store.get_run(*c).await? {
            eprintln!(
                "   child {}: claimed {} times, {} of them after its worker died; {} steps, {}.",
                c.id,
                c.attempts,
                c.crashes,
                c.step,
                c.status.as_str()
            );
        }
    }
    let (calls, repeated) = asked_twice(mock);
    eprintln!(
        "   {calls} model calls for the three runs; answers asked for again after the kill: {repeated}."
    );
    if repeated > 0 || done.status != RunStatus::Succeeded {
        code = ExitCode::FAILURE;
    }
    eprintln!("\n4) a second run continues the parent's thread, from its messages.");
    let second = StartRun {
        input: "Now say it in one line.\nSCENARIO steps=2 tool=echo".into(),
        thread_id: Some(parent.thread_id.clone()),
        ..Default::default()
    };
    let run2 = app
        .start_run(second)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let r2 = crate::cli::follow(app, run2.id, &crate::cli::Progress::new(false)).await?;
    if crate::cli::report(&r2) != ExitCode::SUCCESS {
        code = ExitCode::FAILURE;
    }
    let messages = app
        .store
        .thread_messages(&parent.thread_id, 100_000)
        .await?;
    eprintln!(
        "\nthread {} holds {} checkpointed messages; the parent's context got one line from each child, not their steps.",
        parent.thread_id,
        messages.len()
    );
    if dashboard.is_none() {
        shutdown.cancel();
        let _ = workers.await;
    }
    Ok(code)
}

/// The parent's script: two `task` calls in one step, then the joined answer.
fn script() -> Script {
    let task = |description: &str| ScriptCall {
        name: "task".into(),
        arguments: json!({"description": description, "subagent": "general-purpose"}),
    };
    HashMap::from([(
        "lead".to_owned(),
        vec![
            Turn {
                content: None,
                tool_calls: vec![
                    task("Find how a crashed step is resumed.\nSCENARIO steps=4 tool=echo run=a"),
                    task("Find what a waiting parent holds.\nSCENARIO steps=4 tool=echo run=b"),
                ],
            },
            Turn {
                content: Some(LEAD_ANSWER.into()),
                tool_calls: vec![],
            },
        ],
    )])
}

/// A `subagents worker` process on the same database, which stops each run before it commits a
/// tool result (a failure point that waits for a file nobody creates), so the kill lands
/// mid-step.
fn spawn_worker(settings: &Settings, dir: &Path) -> anyhow::Result<Child> {
    let exe = std::env::current_exe().context("the demo starts a copy of itself as a worker")?;
    let never: PathBuf = dir.join("never");
    Command::new(exe)
        .arg("worker")
        .env("DATABASE_URL", &settings.database_url)
        .env("OPENAI_BASE_URL", &settings.openai_base_url)
        .env("OPENAI_API_KEY", "demo")
        .env("SUBAGENTS_MODEL", &settings.default_model)
        .env("SUBAGENTS_JOBS_DIR", &settings.jobs_dir)
        .env("SUBAGENTS_LEASE_TTL", LEASE_SECS.to_string())
        .env(
            "SUBAGENTS_FAILPOINTS",
            format!("before_tool_commit=wait({})", never.display()),
        )
        .env_remove("REDIS_URL")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("could not start the demo's worker process")
}

/// Waits until the parent is parked and both its children have a tool call started (and so
/// are held at the failure point), then returns the children.
async fn mid_step(app: &App, parent: RunId) -> anyhow::Result<Vec<RunId>> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let parked = app
            .store
            .get_run(parent)
            .await?
            .is_some_and(|r| r.status == RunStatus::Waiting);
        let children: Vec<RunId> = app
            .store
            .children(parent)
            .await?
            .into_iter()
            .map(|c| c.id)
            .collect();
        let mut started = 0;
        for c in &children {
            let events = app.store.events_after(*c, 0, 1000).await?;
            let tool_started = |e: &crate::store::EventRecord| {
                matches!(Event::parse(&e.kind, &e.data), Some(Event::ToolStarted(_)))
            };
            started += usize::from(events.iter().any(tool_started));
        }
        if parked && children.len() == 2 && started == 2 {
            // Let the tools return and reach the failure point.
            tokio::time::sleep(Duration::from_millis(300)).await;
            return Ok(children);
        }
        if Instant::now() > deadline {
            anyhow::bail!("the demo's worker did not reach the middle of a step within 30 s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Model calls made, and how many of them asked for a step whose answer had been given before
/// (the mock logs each request's step key).
fn asked_twice(mock: &MockServer) -> (usize, usize) {
    let log = mock.state.log();
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for e in &log {
        *seen.entry(e.step_key.as_str()).or_default() += 1;
    }
    let repeated = seen.values().map(|n| n.saturating_sub(1)).sum();
    (log.len(), repeated)
}

/// Serves the API and the dashboard on a free loopback port until `shutdown`.
async fn start_dashboard(
    app: &Arc<App>,
    shutdown: CancellationToken,
) -> anyhow::Result<crate::api::Server> {
    crate::api::Server::start(
        app.clone(),
        crate::api::auth::Keys::default(),
        SocketAddr::from(([127, 0, 0, 1], 0)),
        shutdown,
    )
    .await
    .context("could not serve the dashboard")
}
