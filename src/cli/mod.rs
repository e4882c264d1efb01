//! The command line: `run`, `worker`, `agents`, `demo`, `migrate`, `mock-llm`.

pub mod demo;

use std::io::{IsTerminal, Read};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use tokio_util::sync::CancellationToken;

use crate::app::{App, StartRun};
use crate::config::Settings;
use crate::domain::RunRecord;
use crate::ids::{RunId, ThreadId};
use crate::model::mock::{MockOptions, MockServer, SCENARIO_HELP};
use crate::store::{EventRecord, RunStatus};

const ABOUT: &str = "A durable executor for LLM subagent runs.";
const LONG_ABOUT: &str = "\
A durable executor for LLM subagent runs.

A subagent works on one task in a fresh context (its own loop of model calls and tool calls) and
hands back only its final text. Every run is a queued job and every step is checkpointed to the
database, so a run survives a crashed worker and a thread can be continued later.

Start here:   subagents demo                       (no key, no service: an in-process mock model)
Real model:   OPENAI_API_KEY=... subagents run \"Summarize the files in the workspace\"
Continue:     subagents run --thread THREAD_ID \"Now list open questions\"";

/// Command line.
#[derive(Parser)]
#[command(name = "subagents", version, about = ABOUT, long_about = LONG_ABOUT)]
pub struct Cli {
    #[command(flatten)]
    settings: Settings,
    #[command(flatten)]
    client: crate::client::ClientArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run one task: enqueue it, execute it with embedded workers, print the final answer.
    ///
    /// Progress goes to stderr (a line per step and tool call), the final text to stdout, and
    /// the thread id to continue with to stderr. Exit status: 0 succeeded, 1 failed,
    /// 2 bad input or configuration, 3 cancelled, 130 interrupted (the run stays resumable:
    /// `subagents worker` finishes it).
    Run {
        /// Agent to run (see `subagents agents`).
        #[arg(long, short, default_value = "general-purpose")]
        agent: String,
        /// Continue this thread (its earlier messages are the new run's context).
        #[arg(long)]
        thread: Option<String>,
        /// Override the agent's step limit; at the limit the model must answer without tools.
        #[arg(long)]
        max_steps: Option<u32>,
        /// Override the agent's wall-time limit, in seconds.
        #[arg(long)]
        timeout_secs: Option<u64>,
        /// Token budget; past it the model must answer without tools.
        #[arg(long)]
        max_tokens: Option<u64>,
        /// A JSON Schema file the final answer must match (overrides the agent's
        /// `output_schema:`); the answer is then printed as that JSON.
        #[arg(long, value_name = "FILE")]
        output_schema: Option<std::path::PathBuf>,
        /// No progress lines.
        #[arg(long, short)]
        quiet: bool,
        /// The task. `-` reads it from stdin.
        #[arg(required = true)]
        prompt: Vec<String>,
    },
    /// Execute queued runs until SIGTERM or Ctrl-C (then running runs go back to the queue).
    Worker,
    /// Serve the HTTP API and the dashboard (at `/`), with embedded workers unless
    /// `--workers 0`.
    ///
    /// Without keys (SUBAGENTS_API_KEYS or --keys-file) it binds to 127.0.0.1 only and every
    /// request belongs to the owner `local`.
    Serve {
        /// Port.
        #[arg(long, env = "PORT", default_value_t = 8080)]
        port: u16,
        /// Address to bind (needs keys unless it is a loopback address).
        #[arg(long, env = "SUBAGENTS_HOST", default_value = "0.0.0.0")]
        host: std::net::IpAddr,
        /// Embedded worker concurrency; 0 runs the API only (use `subagents worker` processes).
        #[arg(long, env = "SUBAGENTS_WORKERS")]
        workers: Option<usize>,
        /// `owner:key` pairs, comma-separated.
        #[arg(long, env = "SUBAGENTS_API_KEYS", hide_env_values = true)]
        api_keys: Option<String>,
        /// File of `owner <sha256 hex of key>` lines (hashes only: keys never stored).
        #[arg(long, env = "SUBAGENTS_KEYS_FILE")]
        keys_file: Option<PathBuf>,
    },
    /// Talk to a running server: start, status, events, cancel, wait.
    #[command(flatten)]
    Client(crate::client::ClientCommand),
    /// List agent definitions (built-in and from the jobs directory) with the tools and model
    /// each really gets, warn about tools it names but cannot have, and report broken files.
    Agents {
        /// Exit non-zero when any agent names a tool it cannot have.
        #[arg(long)]
        strict: bool,
    },
    /// Show what durable runs add, against an in-process mock model (no key, no service): a
    /// parent delegates to two children and parks; their worker process is killed with SIGKILL
    /// mid-step; this process takes over and every run resumes from its last checkpoint, with
    /// no model call asked twice; a second run continues the thread.
    Demo {
        /// Also serve the API and the dashboard on a free loopback port, print its URL to
        /// watch the runs live, and keep serving after the demo until Ctrl-C.
        #[arg(long)]
        serve: bool,
    },
    /// Create or upgrade the database schema, then exit.
    Migrate,
    /// Measure throughput: N runs of K steps against an OpenAI-compatible mock; prints one
    /// JSON line and exits non-zero if any run did not end as expected.
    Bench(crate::bench::BenchArgs),
    /// Measure the API under many open waits and SSE streams: server memory, and the delay
    /// from a run's end to each client's answer; prints one JSON line.
    BenchApi(crate::bench::ApiBenchArgs),
    /// Serve durable runs to MCP clients over stdio (`claude mcp add subagents -- subagents mcp`):
    /// a `run_agent` tool (a task for clients with the Tasks extension), and run_status,
    /// run_wait, run_events, run_cancel. Runs execute on embedded workers unless `--workers 0`.
    Mcp {
        /// Embedded workers (0: only enqueue; `subagents worker` processes execute).
        #[arg(long)]
        workers: Option<usize>,
        /// The owner runs are started as.
        #[arg(long, default_value = "local")]
        owner: String,
        /// Seconds a client without the Tasks extension waits for an answer before it gets the
        /// run id to follow instead.
        #[arg(long, default_value_t = 60.0)]
        wait_s: f64,
    },
    /// Measure the context economy of delegation: the same work inline and delegated with
    /// `task`, in the model's tokens; prints one JSON line.
    BenchContext(crate::bench::ContextBenchArgs),
    /// Time the dashboard's first render over a big history: seeds N runs (100,000 by default)
    /// and measures the page, its assets and /v1/overview, and the runs table; one JSON line.
    BenchDashboard(crate::bench::DashboardBenchArgs),
    /// Time a short run's round trip (`POST /v1/runs/wait`, 1 and 3 steps, one caller and
    /// several) on SQLite and on PostgreSQL with Redis, in processes of their own, next to the
    /// floor the machine sets for the same work (the run's own model requests sent again and as
    /// many durable commits, timed alone); prints one JSON line.
    BenchLatency(crate::bench::latency::LatencyBenchArgs),
    /// Time from the model's first token to a client's first `model.delta` on
    /// `GET /v1/runs/{id}/events?include=deltas`, with many streams open at once, on SQLite (one
    /// process) and on PostgreSQL with Redis (API and worker apart); prints one JSON line each.
    BenchDeltas(crate::bench::deltas::DeltaBenchArgs),
    /// Time forking a long thread (shared, not copied) and the context read of a run on the
    /// fork against one on the original; prints one JSON line.
    BenchFork(crate::bench::fork::ForkBenchArgs),
    /// Serve a deterministic OpenAI-compatible model for tests, demos and load tests.
    #[command(after_long_help = SCENARIO_HELP)]
    MockLlm {
        /// Port to listen on (0 picks a free one and prints it).
        #[arg(long, default_value_t = 8089)]
        port: u16,
        /// Address to bind.
        #[arg(long, default_value = "127.0.0.1")]
        host: std::net::IpAddr,
        /// Default delay before each answer, in ms (a scenario's latency_ms overrides it).
        #[arg(long, default_value_t = 0)]
        latency_ms: u64,
        /// Append each answered request to this file as a JSON line.
        #[arg(long)]
        log: Option<PathBuf>,
        /// Refuse requests over this many tokens with OpenAI's `context_length_exceeded` 400
        /// (a scenario's window=N overrides it).
        #[arg(long)]
        window: Option<u64>,
        /// A JSON file of scripted turns (see SCRIPTS below).
        #[arg(long)]
        script: Option<PathBuf>,
        /// Answer 429 to requests beyond this many per rolling minute, as a provider does.
        #[arg(long)]
        rpm: Option<usize>,
    },
}

/// Entry point of the binary.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let default_log = match cli.command {
        Command::Worker | Command::MockLlm { .. } | Command::Serve { .. } => "info",
        _ => "warn",
    };
    crate::telemetry::init(default_log);
    // The settings are read: take the secrets out of what the process's children could read,
    // before any thread starts.
    crate::secrets::protect();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let code = match rt.block_on(dispatch(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    };
    // Spans still buffered go out before the process ends.
    crate::telemetry::shutdown();
    code
}

async fn dispatch(cli: Cli) -> anyhow::Result<ExitCode> {
    let settings = cli.settings;
    match cli.command {
        Command::Client(cmd) => match crate::client::run(cli.client, cmd).await {
            Ok(code) => Ok(ExitCode::from(code)),
            Err(e) => {
                eprintln!("error: {e}");
                Ok(ExitCode::from(2))
            }
        },
        Command::Serve {
            port,
            host,
            workers,
            api_keys,
            keys_file,
        } => serve(settings, port, host, workers, api_keys, keys_file).await,
        Command::Run {
            agent,
            thread,
            max_steps,
            timeout_secs,
            max_tokens,
            output_schema,
            quiet,
            prompt,
        } => {
            let output_schema = match output_schema {
                None => None,
                Some(path) => {
                    let text = std::fs::read_to_string(&path)
                        .map_err(|e| anyhow::anyhow!("--output-schema {}: {e}", path.display()))?;
                    Some(
                        serde_json::from_str::<serde_json::Value>(&text).map_err(|e| {
                            anyhow::anyhow!("--output-schema {} is not JSON: {e}", path.display())
                        })?,
                    )
                }
            };
            let input = if prompt == ["-"] {
                let mut s = String::new();
                std::io::stdin().read_to_string(&mut s)?;
                s
            } else {
                prompt.join(" ")
            };
            let thread_id = thread.map(|t| t.parse::<ThreadId>()).transpose()?;
            let app = App::open(settings).await?;
            if let Some(code) = refuse_without_model_key(&app.settings) {
                return Ok(code);
            }
            let req = StartRun {
                agent: Some(agent),
                input,
                thread_id,
                max_steps,
                timeout_secs,
                max_total_tokens: max_tokens,
                output_schema,
                ..Default::default()
            };
            run_to_end(&app, req, quiet).await
        }
        Command::Worker => worker(settings).await,
        Command::Agents { strict } => agents(settings, strict).await,
        Command::Migrate => {
            // Opening applies the migrations of the store and of the queue.
            App::open(settings.clone()).await?;
            eprintln!(
                "schema is up to date in {}",
                crate::app::redact(&settings.database_url)
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::MockLlm {
            port,
            host,
            latency_ms,
            log,
            window,
            script,
            rpm,
        } => mock_llm(port, host, latency_ms, log, window, script, rpm).await,
        Command::Demo { serve } => demo::run(settings, serve).await,
        Command::BenchApi(args) => Ok(if crate::bench::run_api(args).await? {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(1)
        }),
        Command::Mcp {
            workers,
            owner,
            wait_s,
        } => mcp(settings, workers, owner, wait_s).await,
        Command::BenchContext(args) => Ok(if crate::bench::run_context(settings, args).await? {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(1)
        }),
        Command::BenchDashboard(args) => {
            Ok(if crate::bench::run_dashboard(settings, args).await? {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
        Command::BenchFork(args) => Ok(if crate::bench::fork::run(settings, args).await? {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        }),
        Command::BenchDeltas(args) => Ok(if crate::bench::deltas::run(args).await? {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        }),
        Command::BenchLatency(args) => Ok(if crate::bench::latency::run(args).await? {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        }),
        Command::Bench(args) => Ok(if crate::bench::run(settings, args).await? {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(1)
        }),
    }
}

/// `subagents serve`: the API and the dashboard, with embedded workers unless `--workers 0`.
async fn serve(
    settings: Settings,
    port: u16,
    host: std::net::IpAddr,
    workers: Option<usize>,
    api_keys: Option<String>,
    keys_file: Option<PathBuf>,
) -> anyhow::Result<ExitCode> {
    let mut keys = crate::api::auth::Keys::default();
    if let Some(k) = api_keys {
        keys.add_pairs(&k).map_err(anyhow::Error::msg)?;
    }
    if let Some(f) = keys_file {
        keys.add_file(&f).map_err(anyhow::Error::msg)?;
    }
    let host = if keys.is_empty() && !host.is_loopback() {
        eprintln!(
            "no API keys configured (SUBAGENTS_API_KEYS or --keys-file): serving on 127.0.0.1 only, every request as owner `local`"
        );
        std::net::IpAddr::from([127, 0, 0, 1])
    } else {
        host
    };
    let mut signal = ShutdownSignal::listen();
    crate::telemetry::init_metrics();
    let mut settings = settings;
    if let Some(w) = workers {
        settings.concurrency = w;
    }
    let app = tokio::select! {
        app = App::open(settings) => Arc::new(app?),
        _ = signal.recv() => return Ok(stopped_while_starting()),
    };
    // Embedded workers call the model; an API-only server does not.
    if app.settings.concurrency > 0
        && let Some(code) = refuse_without_model_key(&app.settings)
    {
        return Ok(code);
    }
    let shutdown = CancellationToken::new();
    let workers = if app.settings.concurrency > 0 {
        Some(app.spawn_workers(shutdown.clone()))
    } else {
        app.spawn_relay(shutdown.clone())
    };
    let webhooks = crate::webhooks::spawn(app.clone(), shutdown.clone());
    let scheduler = crate::schedules::spawn(app.clone(), shutdown.clone());
    let server = crate::api::Server::start(
        app.clone(),
        keys,
        SocketAddr::new(host, port),
        shutdown.clone(),
    )
    .await
    .map_err(|e| anyhow::anyhow!("cannot listen on {host}:{port}: {e}"))?;
    eprintln!(
        "subagents serve: listening on http://{} ({} embedded workers)",
        server.addr, app.settings.concurrency
    );
    signal.recv().await;
    tracing::info!("shutdown requested");
    shutdown.cancel();
    let _ = server.join().await;
    let _ = webhooks.await;
    let _ = scheduler.await;
    if let Some(w) = workers {
        let _ = w.await;
    }
    Ok(ExitCode::SUCCESS)
}

/// `subagents worker`: a worker process until SIGTERM, then a drain.
async fn worker(settings: Settings) -> anyhow::Result<ExitCode> {
    let mut signal = ShutdownSignal::listen();
    crate::telemetry::init_metrics();
    let app = tokio::select! {
        app = App::open(settings) => app?,
        _ = signal.recv() => return Ok(stopped_while_starting()),
    };
    eprintln!(
        "subagents worker: {} agents, concurrency {}, database {}",
        app.agents.current().all().count(),
        app.settings.concurrency,
        crate::app::redact(&app.settings.database_url)
    );
    if let Some(code) = refuse_without_model_key(&app.settings) {
        return Ok(code);
    }
    let app = Arc::new(app);
    let shutdown = CancellationToken::new();
    let workers = app.spawn_workers(shutdown.clone());
    let webhooks = crate::webhooks::spawn(app.clone(), shutdown.clone());
    let scheduler = crate::schedules::spawn(app.clone(), shutdown.clone());
    signal.recv().await;
    tracing::info!("shutdown requested: finishing the current step boundary and releasing runs");
    shutdown.cancel();
    let _ = webhooks.await;
    let _ = scheduler.await;
    let _ = workers.await;
    Ok(ExitCode::SUCCESS)
}

/// `subagents agents`: each definition with what it really gets here, and the broken files.
async fn agents(settings: Settings, strict: bool) -> anyhow::Result<ExitCode> {
    let (reg, errors) = crate::agents::AgentRegistry::load_dir(&settings.jobs_dir);
    let tools = crate::tools::ToolRegistry::with_settings(App::tool_settings(&settings));
    let aliases = settings.model_alias_map().map_err(|e| anyhow::anyhow!(e))?;
    let delegation = crate::delegation::DelegationSettings {
        max_depth: settings.max_depth,
        ..Default::default()
    };
    let table = crate::model::tokens::ModelTable::new(
        crate::model::tokens::ModelTable::parse_overrides(&settings.context_windows)
            .map_err(|e| anyhow::anyhow!("SUBAGENTS_CONTEXT_WINDOWS: {e}"))?,
        settings.default_context_window.max(1024),
    );
    let mcp_servers = crate::mcp::load(&settings.mcp_config)
        .map_err(|e| anyhow::anyhow!("SUBAGENTS_MCP_CONFIG: {e}"))?;
    let mut unavailable = 0;
    for a in reg.all() {
        let r = tools.resolve(a);
        let mut got = r.tools.clone();
        if crate::delegation::offered(a, 0, &delegation) {
            let to: Vec<&str> = crate::delegation::allowed(a, &reg)
                .iter()
                .map(|d| d.name.as_str())
                .collect();
            got.push(format!("task/subagent_* (to: {})", to.join(", ")));
        }
        let (model, note) = crate::agents::resolve_model(
            a.model.as_deref(),
            None,
            &settings.default_model,
            &aliases,
        );
        let (known, listed) = table.window(&model);
        let window = match a.context_window {
            Some(w) => format!("{w} tokens (context_window:)"),
            None if listed => format!("{} tokens", known.context),
            None => format!(
                "{} tokens (unknown model: SUBAGENTS_DEFAULT_CONTEXT_WINDOW)",
                known.context
            ),
        };
        let compact_at = a.compact_at.unwrap_or(settings.compact_at);
        let model = match note {
            Some(n) => format!("{model} ({n})"),
            None => model,
        };
        let src = a
            .source
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| "built-in".into());
        println!(
            "{}\n  {}\n  tools: {}\n  model: {model}  max_steps: {}  timeout: {}s  ({src})\n  context: {window}, compacts at {compact_at}%",
            a.name,
            a.description,
            if got.is_empty() {
                "(none)".into()
            } else {
                got.join(", ")
            },
            a.max_steps,
            a.timeout.as_secs()
        );
        if !r.mcp.is_empty() {
            let hub_names: Vec<String> = mcp_servers.keys().cloned().collect();
            let shown: Vec<String> = r
                .mcp
                .iter()
                .map(|m| match crate::mcp::split(m) {
                    Some((server, _))
                        if hub_names.iter().any(|h| h == server)
                            || a.mcp_servers
                                .as_ref()
                                .is_some_and(|s| s.get(server).is_some()) =>
                    {
                        m.clone()
                    }
                    _ => format!("{m} (no such server in SUBAGENTS_MCP_CONFIG)"),
                })
                .collect();
            unavailable += shown
                .iter()
                .filter(|m| m.ends_with("(no such server in SUBAGENTS_MCP_CONFIG)"))
                .count();
            println!("  mcp: {}", shown.join(", "));
        }
        for (name, why) in &r.unavailable {
            println!("  warning: `{name}` is not available: {why}");
            unavailable += 1;
        }
        for rule in crate::permissions::unknown_tools(
            &a.policy.rules,
            &mcp_servers
                .keys()
                .map(String::as_str)
                .chain(
                    a.mcp_servers
                        .as_ref()
                        .and_then(|v| v.as_object())
                        .into_iter()
                        .flat_map(|o| o.keys().map(String::as_str)),
                )
                .collect::<Vec<_>>(),
        ) {
            println!(
                "  warning: the permission rule `{rule}` names no tool this server has; it never matches (names are case-sensitive: Bash, Read, Edit, Write, WebFetch, mcp__<server>…)"
            );
            unavailable += 1;
        }
        println!();
    }
    for e in &errors {
        eprintln!("broken definition: {e}");
    }
    let policy =
        crate::policy::load_settings(&settings.settings_file).map_err(anyhow::Error::msg)?;
    for rule in crate::permissions::unknown_tools(
        &policy.rules,
        &mcp_servers.keys().map(String::as_str).collect::<Vec<_>>(),
    ) {
        println!(
            "warning: the permission rule `{rule}` in {} names no tool this server has; it never matches",
            settings.settings_file.display()
        );
        unavailable += 1;
    }
    if strict && unavailable > 0 {
        eprintln!("{unavailable} tool name(s) cannot be honoured (--strict)");
        return Ok(ExitCode::from(1));
    }
    Ok(if errors.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// `subagents mock-llm`: the mock model until a signal.
async fn mock_llm(
    port: u16,
    host: std::net::IpAddr,
    latency_ms: u64,
    log: Option<PathBuf>,
    window: Option<u64>,
    script: Option<PathBuf>,
    rpm: Option<usize>,
) -> anyhow::Result<ExitCode> {
    let script = match script {
        Some(p) => {
            let text = std::fs::read_to_string(&p)
                .map_err(|e| anyhow::anyhow!("cannot read script {}: {e}", p.display()))?;
            let s: crate::model::mock::Script = serde_json::from_str(&text)
                .map_err(|e| anyhow::anyhow!("script {} is not valid: {e}", p.display()))?;
            Some(Arc::new(s))
        }
        None => None,
    };
    let server = MockServer::start(
        SocketAddr::new(host, port),
        MockOptions {
            latency: Duration::from_millis(latency_ms),
            log_file: log,
            script,
            window,
            rate_limit: rpm.map(|n| (n, Duration::from_secs(60))),
        },
    )
    .await?;
    println!(
        "mock-llm listening on {} (OPENAI_BASE_URL={})",
        server.addr,
        server.base_url()
    );
    shutdown_signal().await;
    Ok(ExitCode::SUCCESS)
}

/// `subagents mcp`: the MCP server on stdio.
async fn mcp(
    settings: Settings,
    workers: Option<usize>,
    owner: String,
    wait_s: f64,
) -> anyhow::Result<ExitCode> {
    let mut settings = settings;
    if let Some(w) = workers {
        settings.concurrency = w;
    }
    let app = Arc::new(App::open(settings).await?);
    let shutdown = CancellationToken::new();
    let running = if app.settings.concurrency > 0 {
        Some(app.spawn_workers(shutdown.clone()))
    } else {
        app.spawn_relay(shutdown.clone())
    };
    let served = crate::mcp_server::serve_stdio(
        app.clone(),
        owner.into(),
        Duration::from_secs_f64(wait_s.clamp(0.0, 3600.0)),
    )
    .await;
    shutdown.cancel();
    if let Some(w) = running {
        let _ = w.await;
    }
    served?;
    Ok(ExitCode::SUCCESS)
}

/// Starts a run with embedded workers and follows it to the end.
async fn run_to_end(app: &App, req: StartRun, quiet: bool) -> anyhow::Result<ExitCode> {
    let run = match app.start_run(req).await {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error[{}]: {e}", e.code());
            return Ok(ExitCode::from(2));
        }
    };
    // On a terminal the answer shows as it is written (data asked for prints once, whole).
    let live = (std::io::stdout().is_terminal() && run.limits.output.is_none())
        .then(|| Streamed::start(app, run.id));
    let shutdown = CancellationToken::new();
    let workers = app.spawn_workers(shutdown.clone());
    let progress = Progress::new(quiet);
    progress.line(format!(
        "run {} · agent {} · thread {}",
        run.id, run.agent, run.thread_id
    ));
    let end = tokio::select! {
        r = follow(app, run.id, &progress) => Some(r?),
        _ = shutdown_signal() => None,
    };
    progress.finish();
    shutdown.cancel();
    let _ = workers.await;
    let Some(end) = end else {
        eprintln!(
            "interrupted: run {} is saved at its last checkpoint; `subagents worker` will finish it",
            run.id
        );
        return Ok(ExitCode::from(130));
    };
    if let Some(live) = live
        && live.showed(&end)
    {
        // The answer is on the screen already: end its line, and report the rest.
        println!();
        return Ok(report_with(&end, false));
    }
    Ok(report(&end))
}

/// The model's text as it streams, printed to stdout (`subagents run` on a terminal).
struct Streamed {
    task: tokio::task::JoinHandle<()>,
    /// The latest step's text so far.
    last: Arc<std::sync::Mutex<String>>,
}

impl Streamed {
    fn start(app: &App, run: RunId) -> Streamed {
        use futures::StreamExt;
        use std::io::Write;
        let mut live = Box::pin(app.engine.live.stream(run));
        let last = Arc::new(std::sync::Mutex::new(String::new()));
        let shown = last.clone();
        let task = tokio::spawn(async move {
            let mut step = None;
            while let Some(d) = live.next().await {
                let Some(text) = d["text"].as_str() else {
                    continue;
                };
                let mut last = shown.lock().unwrap();
                if step != d["step"].as_u64() {
                    if !last.is_empty() {
                        println!();
                    }
                    last.clear();
                    step = d["step"].as_u64();
                }
                last.push_str(text);
                print!("{text}");
                let _ = std::io::stdout().flush();
            }
        });
        Streamed { task, last }
    }

    /// Stops, and says whether the run's answer is what was printed.
    fn showed(self, run: &RunRecord) -> bool {
        self.task.abort();
        let last = self.last.lock().unwrap();
        run.status == RunStatus::Succeeded
            && !last.is_empty()
            && run.result.as_deref() == Some(&last)
    }
}

/// Prints the outcome; returns the exit code.
pub(crate) fn report(run: &RunRecord) -> ExitCode {
    report_with(run, true)
}

/// [`report`], printing the answer or not (it may be on the screen already).
fn report_with(run: &RunRecord, answer: bool) -> ExitCode {
    match run.status {
        RunStatus::Succeeded => {
            match crate::output::result_json(run.limits.output.as_ref(), run.result.as_deref()) {
                _ if !answer => {}
                Some(v) => println!(
                    "{}",
                    serde_json::to_string_pretty(&v).unwrap_or_else(|_| v.to_string())
                ),
                None => println!("{}", run.result.as_deref().unwrap_or("")),
            }
            let forced = if run.forced {
                " (answer forced by a limit)"
            } else {
                ""
            };
            eprintln!(
                "succeeded in {} steps{forced}, {} tokens. Continue with: subagents run --thread {} \"...\"",
                run.step,
                run.usage.total(),
                run.thread_id
            );
            ExitCode::SUCCESS
        }
        RunStatus::Failed => {
            let e = run
                .error
                .clone()
                .map(|e| format!("[{}] {}", e.kind.as_str(), e.message))
                .unwrap_or_default();
            eprintln!("run {} failed: {e}\nthread: {}", run.id, run.thread_id);
            ExitCode::from(1)
        }
        RunStatus::Cancelled => {
            eprintln!("run {} was cancelled", run.id);
            ExitCode::from(3)
        }
        other => {
            eprintln!("run {} is {}", run.id, other.as_str());
            ExitCode::from(1)
        }
    }
}

/// Prints each event of the run until it is terminal, then returns the run.
pub(crate) async fn follow(
    app: &App,
    run: RunId,
    progress: &Progress,
) -> anyhow::Result<RunRecord> {
    let mut cursor = 0;
    loop {
        let events = app.store.events_after(run, cursor, 200).await?;
        for e in &events {
            cursor = e.seq;
            progress.event(e);
        }
        if events.is_empty() {
            if let Some(r) = app.store.get_run(run).await?
                && r.status.is_terminal()
            {
                // Drain anything committed with the terminal state.
                for e in app.store.events_after(run, cursor, 1000).await? {
                    progress.event(&e);
                }
                return Ok(r);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Progress on stderr: a spinner plus lines on a terminal, plain lines otherwise.
pub(crate) struct Progress {
    bar: Option<ProgressBar>,
    quiet: bool,
}

impl Progress {
    pub(crate) fn new(quiet: bool) -> Self {
        let bar = (!quiet && std::io::stderr().is_terminal()).then(|| {
            let b = ProgressBar::new_spinner();
            b.set_style(
                ProgressStyle::with_template("{spinner} {elapsed} {msg}").expect("template"),
            );
            b.enable_steady_tick(Duration::from_millis(120));
            b
        });
        Self { bar, quiet }
    }

    fn line(&self, s: String) {
        if self.quiet {
            return;
        }
        match &self.bar {
            Some(b) => b.println(s),
            None => eprintln!("{s}"),
        }
    }

    fn status(&self, s: String) {
        if let Some(b) = &self.bar {
            b.set_message(s);
        }
    }

    fn event(&self, e: &EventRecord) {
        match e.kind.as_str() {
            "step.started" => {
                let forced = if e.data["forced"] == true {
                    " (final answer forced)"
                } else {
                    ""
                };
                self.status(format!(
                    "step {}: waiting for the model{forced}",
                    e.data["step"]
                ));
            }
            // The final outcome is reported once, by `report`.
            "run.queued" | "run.succeeded" => {}
            _ => {
                if let Some(line) = crate::events::progress_line(e) {
                    self.line(line);
                }
            }
        }
    }

    fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}

/// A signal before the process had started anything: nothing to drain, an orderly exit.
fn stopped_while_starting() -> ExitCode {
    eprintln!("shutdown requested while starting: nothing was started, nothing to drain");
    ExitCode::SUCCESS
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    ShutdownSignal::listen().recv().await
}

/// Ctrl-C or SIGTERM, listened for from the moment this is made. A long-lived command makes it
/// before it connects and migrates: a signal that arrives while the process is still starting
/// (an orchestrator stopping a pod it just started) is then an orderly exit, not the default
/// action that kills the process half-way through its start.
pub struct ShutdownSignal {
    #[cfg(unix)]
    term: Option<tokio::signal::unix::Signal>,
    #[cfg(unix)]
    int: Option<tokio::signal::unix::Signal>,
}

impl ShutdownSignal {
    /// Starts listening; signals from now on are kept until `recv`.
    pub fn listen() -> Self {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            ShutdownSignal {
                term: signal(SignalKind::terminate()).ok(),
                int: signal(SignalKind::interrupt()).ok(),
            }
        }
        #[cfg(not(unix))]
        ShutdownSignal {}
    }

    /// Resolves at the first signal received since `listen`.
    pub async fn recv(&mut self) {
        #[cfg(unix)]
        {
            async fn one(s: &mut Option<tokio::signal::unix::Signal>) {
                match s {
                    Some(s) => {
                        s.recv().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            }
            tokio::select! {
                _ = one(&mut self.term) => {}
                _ = one(&mut self.int) => {}
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// Exit 2 with why, when runs here could not reach their model (see
/// [`crate::model::providers::key_problem`]): before any run starts, not after one failed its
/// retries.
fn refuse_without_model_key(settings: &Settings) -> Option<ExitCode> {
    // A start error's code, as `run` prints a `StartError`'s (not a tool's error code).
    const CODE: &str = "no_model_key";
    let problem = crate::model::providers::key_problem(settings)?;
    eprintln!("error[{CODE}]: {problem}");
    Some(ExitCode::from(2))
}
