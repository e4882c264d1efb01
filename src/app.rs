//! Wiring: opens the store and queue, loads agents, builds the model client and the engine, and
//! hands every front end (CLI, API, tests) one value to call: start a run, wait for it, follow
//! its events, cancel it, run workers. The operations themselves live in [`crate::runs`] and
//! [`crate::worker`]; this module only wires.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::agents::{AgentFileError, AgentRegistry};
use crate::config::Settings;
use crate::engine::{Engine, EngineSettings};
use crate::ids::RunId;
use crate::model::openai::{OpenAiClient, OpenAiConfig};
use crate::model::{ChatModel, RetryPolicy};
use crate::queue::Queue;
use crate::store::{Created, RunRecord, SqliteStore, Store, StoreError};
use crate::tools::ToolRegistry;
use crate::worker::{WorkerSettings, run_workers};

/// How often waiters re-read a run in case a worker in another process changed it (in-process
/// changes wake them at once).
pub const CROSS_PROCESS_RECHECK: Duration = Duration::from_millis(250);

pub use crate::runs::{LOCAL_OWNER, MAX_TIMEOUT_SECS, StartError, StartRun, start_run};

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
    /// A setting does not parse.
    #[error("{0}")]
    Config(String),
    /// `SUBAGENTS_FAILPOINTS` does not parse.
    #[error("{0}")]
    Failpoints(#[from] crate::failpoints::BadFailpoint),
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

    /// The built-in tools' settings.
    pub fn tool_settings(settings: &Settings) -> crate::tools::ToolSettings {
        let clean = |v: &[String]| v.iter().map(|h| h.trim().to_owned()).filter(|h| !h.is_empty()).collect();
        crate::tools::ToolSettings {
            journal: settings.tool_journal.clone(),
            allow_bash: settings.allow_bash,
            fetch: crate::tools::FetchPolicy { allow_hosts: clean(&settings.fetch_allow), deny_hosts: clean(&settings.fetch_deny), ..Default::default() },
            search_url: settings.search_url.clone(),
        }
    }

    /// Opens everything with the given model and the built-in tools.
    pub async fn open_with_model(settings: Settings, model: Arc<dyn ChatModel>) -> Result<App, OpenError> {
        let tools = ToolRegistry::with_settings(Self::tool_settings(&settings));
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
        // What an agent names but cannot have is said once at start, not hidden in a debug log.
        for a in agents.all() {
            for (name, why) in tools.resolve(a).unavailable {
                tracing::warn!(agent = %a.name, tool = %name, "agent lists a tool it will not get: {why}");
            }
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
                model_aliases: settings.model_alias_map().map_err(OpenError::Config)?,
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
                drain_grace: settings.drain_grace(),
                context_messages: settings.context_messages,
                failpoints: Arc::new(crate::failpoints::Failpoints::parse(&settings.failpoints)?),
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
        let outcome = crate::runs::cancel(self.store.as_ref(), &self.queue, run).await?;
        // The worker holding it may be another process: tell it now, not at its next lease renewal.
        if outcome == crate::store::CancelOutcome::Requested {
            if let Some(r) = &self.redis {
                r.announce_cancel(run).await;
            }
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
        let reap_every = match self.settings.reap_ms {
            0 => (ttl / 2).max(Duration::from_millis(200)),
            ms => Duration::from_millis(ms),
        };
        let settings = WorkerSettings {
            concurrency: self.settings.concurrency,
            poll_interval: Duration::from_millis(self.settings.poll_ms.max(1)),
            reap_every,
            reap_grace: ttl.max(Duration::from_secs(2)),
            drain_grace: self.settings.drain_grace(),
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
