//! Wiring: opens the store and queue, loads agents, builds the model client and the engine, and
//! offers the operations every front end (CLI, API, tests) uses: start a run, wait for it,
//! follow its events, run workers.

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::agents::{AgentFileError, AgentRegistry, GENERAL_PURPOSE};
use crate::config::Settings;
use crate::engine::{Engine, EngineSettings};
use crate::ids::{RunId, ThreadId};
use crate::model::openai::{OpenAiClient, OpenAiConfig};
use crate::model::{ChatModel, RetryPolicy};
use crate::queue::{Queue, QueueError, WorkerSettings, new_job_id, run_workers};
use crate::store::{Created, IfBusy, NewRun, RunLimits, RunRecord, SqliteStore, Store, StoreError, TreePosition};
use crate::tools::ToolRegistry;

/// How often waiters re-read a run in case a worker in another process changed it (in-process
/// changes wake them at once).
pub const CROSS_PROCESS_RECHECK: Duration = Duration::from_millis(250);

/// Longest wall-time limit a run may have: 7 days.
pub const MAX_TIMEOUT_SECS: u64 = 7 * 24 * 3600;

/// Owner of runs started without authentication (the CLI, the embedded default).
pub const LOCAL_OWNER: &str = "local";

/// A request to start a run.
#[derive(Clone, Debug, Default)]
pub struct StartRun {
    /// Agent name; `general-purpose` when absent.
    pub agent: Option<String>,
    /// The task.
    pub input: String,
    /// Continue this thread (created if new).
    pub thread_id: Option<ThreadId>,
    /// Owner; [`LOCAL_OWNER`] when absent.
    pub owner: Option<String>,
    /// Override of the agent's `max_steps`.
    pub max_steps: Option<u32>,
    /// Override of the agent's `timeout`, in seconds.
    pub timeout_secs: Option<u64>,
    /// Token budget for the run and its descendants.
    pub max_total_tokens: Option<u64>,
    /// Step budget for the run and its descendants.
    pub max_total_steps: Option<u64>,
    /// Caller data kept with the run.
    pub metadata: Option<Value>,
    /// Busy thread: refuse (default) or queue behind the active run.
    pub if_busy: IfBusy,
    /// A repeated start with the same key returns the first run.
    pub idempotency_key: Option<String>,
    /// The delegating run (children only).
    pub parent_run_id: Option<RunId>,
    /// Place in the delegation tree (children only).
    pub tree: TreePosition,
}

/// Why a run could not be started. Each has a stable code for APIs and scripts.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// No such agent.
    #[error("unknown agent `{name}`; known agents: {}", known.join(", "))]
    UnknownAgent {
        /// Requested name.
        name: String,
        /// What exists.
        known: Vec<String>,
    },
    /// Nothing to do.
    #[error("the input is empty: say what the agent should do")]
    EmptyInput,
    /// Over the configured limit.
    #[error("the input is {got} bytes; the limit is {limit} (SUBAGENTS_MAX_INPUT_BYTES)")]
    InputTooLarge {
        /// Limit.
        limit: usize,
        /// Actual size.
        got: usize,
    },
    /// A limit override out of range.
    #[error("{0}")]
    BadLimit(String),
    /// Storage refused or failed (busy thread included).
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl StartError {
    /// Stable machine code.
    pub fn code(&self) -> &'static str {
        match self {
            StartError::UnknownAgent { .. } => "unknown_agent",
            StartError::EmptyInput => "empty_input",
            StartError::InputTooLarge { .. } => "input_too_large",
            StartError::BadLimit(_) => "bad_limit",
            StartError::Store(StoreError::Busy { .. }) => "thread_busy",
            StartError::Store(StoreError::ThreadOwnedElsewhere(_)) => "thread_not_found",
            StartError::Store(_) => "storage_unavailable",
        }
    }
}

/// Validates a start, records the run and pushes its job: the one path every start takes (API,
/// CLI, and parents delegating to children). Once it returns, the run is durable: if the push
/// fails, the reaper enqueues it later.
pub async fn start_run(
    store: &dyn Store,
    queue: &Queue,
    agents: &AgentRegistry,
    max_input_bytes: usize,
    req: StartRun,
) -> Result<Created, StartError> {
    let agent_name = req.agent.unwrap_or_else(|| GENERAL_PURPOSE.to_owned());
    let agent = agents.get(&agent_name).ok_or_else(|| StartError::UnknownAgent { name: agent_name.clone(), known: agents.names() })?;
    if req.input.trim().is_empty() {
        return Err(StartError::EmptyInput);
    }
    if req.input.len() > max_input_bytes {
        return Err(StartError::InputTooLarge { limit: max_input_bytes, got: req.input.len() });
    }
    let max_steps = req.max_steps.unwrap_or(agent.max_steps);
    if max_steps == 0 || max_steps > 10_000 {
        return Err(StartError::BadLimit(format!("max_steps {max_steps} is out of range 1..=10000")));
    }
    let timeout_secs = req.timeout_secs.unwrap_or(agent.timeout.as_secs().max(1));
    if !(1..=MAX_TIMEOUT_SECS).contains(&timeout_secs) {
        return Err(StartError::BadLimit(format!("timeout must be 1 to {MAX_TIMEOUT_SECS} seconds (7 days)")));
    }
    if let Some(k) = &req.idempotency_key {
        if k.is_empty() || k.len() > 200 {
            return Err(StartError::BadLimit("idempotency_key must be 1 to 200 characters".into()));
        }
    }
    let job_id = new_job_id();
    let created = store
        .create_run(NewRun {
            id: RunId::new(),
            thread_id: req.thread_id.unwrap_or_else(ThreadId::generate),
            owner: req.owner.unwrap_or_else(|| LOCAL_OWNER.to_owned()),
            agent: agent_name,
            input: req.input,
            metadata: req.metadata.unwrap_or_else(|| Value::Object(Default::default())),
            limits: RunLimits { max_steps, timeout_secs, max_total_tokens: req.max_total_tokens, max_total_steps: req.max_total_steps },
            parent_run_id: req.parent_run_id,
            tree: req.tree,
            job_id: job_id.clone(),
            if_busy: req.if_busy,
            idempotency_key: req.idempotency_key,
        })
        .await?;
    if !created.existing {
        if let Err(e) = queue.push(created.run.id, &job_id).await {
            let QueueError::Push { message, .. } = &e;
            tracing::warn!(run_id = %created.run.id, error = %message, "enqueue failed; the reaper will enqueue the run");
        }
    }
    Ok(created)
}

/// The assembled system.
pub struct App {
    /// Settings it was opened with.
    pub settings: Settings,
    /// Storage.
    pub store: Arc<dyn Store>,
    /// Queue.
    pub queue: Queue,
    /// Engine.
    pub engine: Arc<Engine>,
    /// Agents.
    pub agents: Arc<AgentRegistry>,
    /// Definition files that failed to load (reported, not fatal).
    pub agent_errors: Vec<AgentFileError>,
    /// Redis, when configured.
    pub redis: Option<crate::relay::RedisEvents>,
}

/// Start-up failures, with what to do about them.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The URL names a backend this build cannot use.
    #[error("DATABASE_URL `{0}` is not supported: use sqlite://FILE or postgres://USER@HOST/DB")]
    UnsupportedDatabase(String),
    /// The database could not be opened or migrated.
    #[error("cannot open the database {url}: {source}")]
    Database {
        /// Redacted URL.
        url: String,
        /// Cause.
        source: StoreError,
    },
    /// Redis could not be reached.
    #[error("cannot reach Redis at {url}: {source} (check REDIS_URL, or unset it to serve events from the database)")]
    Redis {
        /// Redacted URL.
        url: String,
        /// Cause.
        source: crate::relay::RelayError,
    },
    /// The workspace directory could not be created.
    #[error("cannot create the workspace {path}: {source}")]
    Workspace {
        /// Path.
        path: String,
        /// Cause.
        source: std::io::Error,
    },
}

impl App {
    /// Opens everything with the production model client.
    pub async fn open(settings: Settings) -> Result<App, OpenError> {
        let model = Self::model_client(&settings);
        Self::open_with_model(settings, model).await
    }

    /// The OpenAI-compatible client the settings describe.
    pub fn model_client(settings: &Settings) -> Arc<dyn ChatModel> {
        Arc::new(OpenAiClient::new(OpenAiConfig {
            base_url: settings.openai_base_url.clone(),
            api_key: settings.openai_api_key.clone().unwrap_or_default(),
            retry: RetryPolicy { retries: settings.model_retries, ..RetryPolicy::default() },
            request_timeout: settings.model_timeout(),
        }))
    }

    /// Opens everything with the given model and the built-in tools.
    pub async fn open_with_model(settings: Settings, model: Arc<dyn ChatModel>) -> Result<App, OpenError> {
        let tools = ToolRegistry::builtin(settings.tool_journal.clone());
        Self::open_custom(settings, model, tools).await
    }

    /// Opens everything with the given model and tools (tests, embedders with their own tools).
    pub async fn open_custom(settings: Settings, model: Arc<dyn ChatModel>, tools: ToolRegistry) -> Result<App, OpenError> {
        let url = settings.database_url.clone();
        let db_err = |source| OpenError::Database { url: redact(&url), source };
        let heartbeat = Duration::from_secs(5);
        let (store, queue): (Arc<dyn Store>, Queue) = if url.starts_with("sqlite:") {
            let s = SqliteStore::connect(&url).await.map_err(db_err)?;
            let q = Queue::sqlite(s.pool(), heartbeat);
            (Arc::new(s), q)
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let s = crate::store::PgStore::connect(&url).await.map_err(db_err)?;
            let q = Queue::postgres(s.pool(), heartbeat);
            (Arc::new(s), q)
        } else {
            return Err(OpenError::UnsupportedDatabase(redact(&url)));
        };
        std::fs::create_dir_all(&settings.workspace)
            .map_err(|source| OpenError::Workspace { path: settings.workspace.display().to_string(), source })?;
        let (agents, agent_errors) = AgentRegistry::load_dir(&settings.jobs_dir);
        for e in &agent_errors {
            tracing::warn!("agent definition skipped: {e}");
        }
        let redis = match &settings.redis_url {
            None => None,
            Some(url) => Some(
                crate::relay::RedisEvents::connect(crate::relay::RedisSettings {
                    url: url.clone(),
                    global_maxlen: settings.redis_maxlen,
                    retention: Duration::from_secs(settings.redis_retention_secs),
                })
                .await
                .map_err(|source| OpenError::Redis { url: redact(url), source })?,
            ),
        };
        let agents = Arc::new(agents);
        let engine = Arc::new(Engine {
            store: store.clone(),
            agents: agents.clone(),
            tools: Arc::new(tools),
            model,
            settings: EngineSettings {
                default_model: settings.default_model.clone(),
                workspace: settings.workspace.clone(),
                lease_ttl: settings.lease_ttl(),
                max_attempts: settings.max_attempts,
                tool_timeout: settings.tool_timeout(),
                tool_output_limit: settings.tool_output_limit,
                delegation: crate::delegation::DelegationSettings {
                    max_depth: settings.max_depth,
                    result_limit: settings.child_result_limit,
                },
                max_input_bytes: settings.max_input_bytes,
            },
            queue: queue.clone(),
            deltas: redis.clone(),
        });
        Ok(App { settings, store, queue, engine, agents, agent_errors, redis })
    }

    /// Validates, records and enqueues a run. Once this returns, the run is durable: if the
    /// push to the queue fails, the reaper enqueues it later.
    pub async fn start_run(&self, req: StartRun) -> Result<RunRecord, StartError> {
        Ok(self.start(req).await?.run)
    }

    /// [`App::start_run`], also telling whether an idempotency key matched an earlier start.
    pub async fn start(&self, req: StartRun) -> Result<Created, StartError> {
        start_run(self.store.as_ref(), &self.queue, &self.agents, self.settings.max_input_bytes, req).await
    }

    /// Waits until the run is terminal or `timeout` passes; returns its latest state. Sleeps
    /// on the run's notification (no polling loop); a slow re-check covers writers in other
    /// processes.
    pub async fn wait(&self, run: RunId, timeout: Duration) -> Result<Option<RunRecord>, StoreError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let notify = self.store.subscribe(run);
        loop {
            let changed = notify.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let r = self.store.get_run(run).await?;
            match &r {
                None => return Ok(None),
                Some(r) if r.status.is_terminal() => return Ok(Some(r.clone())),
                _ => {}
            }
            if tokio::time::Instant::now() >= deadline {
                return Ok(r);
            }
            tokio::select! {
                _ = changed => {}
                _ = tokio::time::sleep(CROSS_PROCESS_RECHECK) => {}
                _ = tokio::time::sleep_until(deadline) => {}
            }
        }
    }

    /// Cancels a run and its attached descendants; a run that ends here (queued or parked)
    /// reports to its parent at once.
    pub async fn cancel(&self, run: RunId) -> Result<crate::store::CancelOutcome, StoreError> {
        let outcome = crate::delegation::cancel_tree(self.store.as_ref(), run).await?;
        match outcome {
            crate::store::CancelOutcome::Cancelled => crate::delegation::after_end(self.store.as_ref(), &self.queue, run).await?,
            // The worker holding it may be another process: tell it now, not at its next lease renewal.
            crate::store::CancelOutcome::Requested => {
                if let Some(r) = &self.redis {
                    r.announce_cancel(run).await;
                }
            }
            _ => {}
        }
        Ok(outcome)
    }

    /// Events of a run after a cursor: from Redis when configured (falling back to the outbox
    /// for any range Redis lacks), else from the outbox.
    pub async fn events_after(&self, run: RunId, after: u64, limit: u32) -> Result<Vec<crate::store::EventRecord>, StoreError> {
        match &self.redis {
            Some(r) => r.events_after(self.store.as_ref(), run, after, limit).await,
            None => self.store.events_after(run, after, limit).await,
        }
    }

    /// Starts the Redis relay and wake-up subscriber, if Redis is configured.
    pub fn spawn_relay(&self, shutdown: CancellationToken) -> Option<tokio::task::JoinHandle<()>> {
        self.redis.clone().map(|r| r.spawn(self.store.clone(), shutdown))
    }

    /// Runs workers and the reaper in this process until `shutdown`.
    pub fn spawn_workers(&self, shutdown: CancellationToken) -> tokio::task::JoinHandle<()> {
        let ttl = self.settings.lease_ttl();
        let settings = WorkerSettings {
            concurrency: self.settings.concurrency,
            poll_interval: Duration::from_millis(self.settings.poll_ms.max(1)),
            reap_every: (ttl / 2).max(Duration::from_millis(200)),
            reap_grace: ttl.max(Duration::from_secs(2)),
        };
        let relay = self.spawn_relay(shutdown.clone());
        let workers = run_workers(self.engine.clone(), self.queue.clone(), settings, shutdown);
        tokio::spawn(async move {
            workers.await;
            if let Some(r) = relay {
                let _ = r.await;
            }
        })
    }
}

/// The URL without a password, for messages.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            match creds.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..s + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}
