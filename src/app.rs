//! Wiring: opens the store and queue, loads agents, builds the model client and the engine, and
//! hands every front end (CLI, API, tests) one value to call: start a run, wait for it, follow
//! its events, cancel it, run workers. The operations themselves live in [`crate::runs`] and
//! [`crate::worker`]; this module only wires.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::agents::{AgentFileError, AgentRegistry};
use crate::config::Settings;
use crate::domain::RunRecord;
use crate::engine::{Engine, EngineSettings};
use crate::ids::{ApprovalId, OwnerId, RunId, ThreadId};
use crate::model::openai::OpenAiClient;
use crate::model::{ChatModel, Endpoint, RetryPolicy};
use crate::queue::Queue;
use crate::store::{Created, SqliteStore, Store, StoreError};
use crate::tools::ToolRegistry;
use crate::worker::{WorkerSettings, run_workers};

/// How often waiters re-read a run in case a worker in another process changed it (in-process
/// changes wake them at once).
pub const CROSS_PROCESS_RECHECK: Duration = Duration::from_millis(250);

/// How old a shared read may be for a waiter re-checking on its timer (changes made in other
/// processes are heard only that way, at most [`CROSS_PROCESS_RECHECK`] late anyway).
pub const SHARED_READ_AGE: Duration = Duration::from_millis(50);

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
    pub agents: Arc<crate::pinning::Agents>,
    /// Definition files that failed to load (reported, not fatal).
    pub agent_errors: Vec<AgentFileError>,
    /// Redis, when configured.
    pub redis: Option<crate::relay::RedisEvents>,
    /// Run reads shared by the waiters one commit wakes.
    run_reads: crate::notify::SharedReads<RunId, Option<Arc<RunRecord>>>,
    /// Event pages shared by the streams one commit wakes, by run and cursor.
    event_reads: crate::notify::SharedReads<(RunId, u64, u32), Arc<Vec<StreamedEvent>>>,
    /// This process's queue workers (once [`App::spawn_workers`] runs them), which the runs
    /// started here are handed to directly when one has a free slot.
    local: Arc<crate::worker::Local>,
}

/// An event as streams send it: the record, and its JSON, serialized once for every stream
/// that reads it.
#[derive(Debug)]
pub struct StreamedEvent {
    /// The event.
    pub record: crate::store::EventRecord,
    /// `record` as JSON.
    pub json: String,
}

impl StreamedEvent {
    /// The event with its JSON.
    pub fn new(record: crate::store::EventRecord) -> Self {
        StreamedEvent {
            json: serde_json::to_string(&record).unwrap_or_default(),
            record,
        }
    }
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
    #[error(
        "cannot reach Redis at {url}: {source} (check REDIS_URL, or unset it to serve events from the database)"
    )]
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
        let model = Self::model_client(&settings).map_err(OpenError::Config)?;
        Self::open_with_model(settings, model).await
    }

    /// The model clients the settings describe: one per models-table entry (Anthropic's
    /// Messages API or an OpenAI-compatible endpoint), and the OpenAI-compatible endpoint of
    /// `OPENAI_BASE_URL` for every other model.
    pub fn model_client(settings: &Settings) -> Result<Arc<dyn ChatModel>, String> {
        use crate::model::anthropic::{AnthropicClient, AnthropicConfig};
        use crate::model::providers::{Provider, Router};
        let retry = RetryPolicy {
            retries: settings.model_retries,
            ..RetryPolicy::default()
        };
        let endpoint = |base_url: &str, api_key: Option<String>| Endpoint {
            base_url: base_url.to_owned(),
            api_key: api_key.unwrap_or_default(),
            retry,
            request_timeout: settings.model_timeout(),
            step_header: settings
                .step_header
                .unwrap_or_else(|| crate::config::is_loopback_url(base_url)),
        };
        let fallback: Arc<dyn ChatModel> = Arc::new(OpenAiClient::new(endpoint(
            &settings.openai_base_url,
            settings.openai_api_key.clone(),
        )));
        let routes = crate::model::providers::routes_for(settings)?;
        let clients = routes
            .entries()
            .iter()
            .map(|e| -> Arc<dyn ChatModel> {
                let key = crate::model::providers::key(settings, e.key_env());
                match e.provider {
                    Provider::OpenAi => Arc::new(OpenAiClient::new(endpoint(
                        e.base_url.as_deref().unwrap_or(&settings.openai_base_url),
                        key,
                    ))),
                    Provider::Anthropic => Arc::new(AnthropicClient::new(AnthropicConfig {
                        endpoint: endpoint(
                            e.base_url
                                .as_deref()
                                .unwrap_or(&settings.anthropic_base_url),
                            key,
                        ),
                        max_tokens: e.output_limit().unwrap_or(8192).clamp(1, u32::MAX as u64)
                            as u32,
                        thinking_budget: e.thinking_budget,
                        caching: e.caching.unwrap_or(true),
                    })),
                }
            })
            .collect();
        Ok(Arc::new(Router::new(routes, clients, fallback)))
    }

    /// The MCP servers of `SUBAGENTS_MCP_CONFIG` plus those agent files declare (each visible
    /// to its agent only). A broken `.mcp.json` stops start-up; a broken `mcpServers:` in an agent
    /// file is logged and that agent gets none.
    pub fn mcp_hub(
        settings: &Settings,
        agents: &AgentRegistry,
    ) -> Result<crate::mcp::Hub, OpenError> {
        let servers = crate::mcp::load(&settings.mcp_config)
            .map_err(|e| OpenError::Config(format!("SUBAGENTS_MCP_CONFIG: {e}")))?;
        let mut hub = crate::mcp::Hub::new(
            servers,
            Duration::from_secs_f64(settings.mcp_timeout_secs.clamp(0.1, 600.0)),
        );
        for a in agents.all() {
            if let Some(v) = &a.mcp_servers {
                match crate::mcp::parse_servers(v) {
                    Ok(s) => hub.add_private(&a.name, s),
                    Err(e) => {
                        tracing::warn!(agent = %a.name, error = %e, "the agent's mcpServers cannot be used")
                    }
                }
            }
        }
        Ok(hub)
    }

    /// Permission rules (of the settings file and of each agent) that name no tool this server
    /// has, with where they are: they never match.
    pub fn rules_naming_no_tool(
        settings: &Settings,
        agents: &AgentRegistry,
        policy: &crate::policy::Policy,
    ) -> Vec<(String, String)> {
        let configured: Vec<String> = crate::mcp::load(&settings.mcp_config)
            .map(|s| s.keys().cloned().collect())
            .unwrap_or_default();
        let mut out: Vec<(String, String)> = crate::permissions::unknown_tools(
            &policy.rules,
            &configured.iter().map(String::as_str).collect::<Vec<_>>(),
        )
        .into_iter()
        .map(|r| (settings.settings_file.display().to_string(), r))
        .collect();
        for a in agents.all() {
            let mut servers: Vec<&str> = configured.iter().map(String::as_str).collect();
            if let Some(serde_json::Value::Object(own)) = &a.mcp_servers {
                servers.extend(own.keys().map(String::as_str));
            }
            out.extend(
                crate::permissions::unknown_tools(&a.policy.rules, &servers)
                    .into_iter()
                    .map(|r| (format!("agent `{}`", a.name), r)),
            );
        }
        out
    }

    /// The built-in tools' settings.
    pub fn tool_settings(settings: &Settings) -> crate::tools::ToolSettings {
        let clean = |v: &[String]| {
            v.iter()
                .map(|h| h.trim().to_owned())
                .filter(|h| !h.is_empty())
                .collect()
        };
        crate::tools::ToolSettings {
            journal: settings.tool_journal.clone(),
            allow_bash: settings.allow_bash,
            fetch: crate::tools::FetchPolicy {
                allow_hosts: clean(&settings.fetch_allow),
                deny_hosts: clean(&settings.fetch_deny),
                ..Default::default()
            },
            search_url: settings.search_url.clone(),
            hide_echo: !settings
                .echo_tool
                .unwrap_or_else(|| settings.local_model_endpoint()),
        }
    }

    /// Opens everything with the given model and the built-in tools.
    pub async fn open_with_model(
        settings: Settings,
        model: Arc<dyn ChatModel>,
    ) -> Result<App, OpenError> {
        let tools = ToolRegistry::with_settings(Self::tool_settings(&settings));
        Self::open_custom(settings, model, tools).await
    }

    /// Opens everything with the given model and tools (tests, embedders with their own tools).
    pub async fn open_custom(
        settings: Settings,
        model: Arc<dyn ChatModel>,
        tools: ToolRegistry,
    ) -> Result<App, OpenError> {
        let url = settings.database_url.clone();
        let routes =
            Arc::new(crate::model::providers::routes_for(&settings).map_err(OpenError::Config)?);
        let db_err = |source| OpenError::Database {
            url: redact(&url),
            source,
        };
        let heartbeat = Duration::from_secs(5);
        // A process without Redis has no relay: its events are written as relayed, so the
        // outbox holds only what a relay will take.
        let relays = settings.redis_url.is_some();
        let (store, queue): (Arc<dyn Store>, Queue) = if url.starts_with("sqlite:") {
            let s = SqliteStore::connect(&url)
                .await
                .map_err(db_err)?
                .relaying(relays);
            let q = Queue::sqlite(s.pool(), heartbeat);
            (Arc::new(s), q)
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let s = crate::store::PgStore::connect(&url)
                .await
                .map_err(db_err)?
                .relaying(relays);
            let q = Queue::postgres(s.pool(), heartbeat);
            (Arc::new(s), q)
        } else {
            return Err(OpenError::UnsupportedDatabase(redact(&url)));
        };
        std::fs::create_dir_all(&settings.workspace).map_err(|source| OpenError::Workspace {
            path: settings.workspace.display().to_string(),
            source,
        })?;
        let (pins, agent_errors) = crate::pinning::Agents::load(&settings.jobs_dir);
        let agents = pins.current();
        for e in &agent_errors {
            tracing::warn!("agent definition skipped: {e}");
        }
        let mut aliases = settings.model_alias_map().map_err(OpenError::Config)?;
        for (alias, model) in routes.implied_aliases() {
            aliases.entry(alias).or_insert(model);
        }
        // What an agent names but cannot have is said once at start, not hidden in a debug log.
        for a in agents.all() {
            for (name, why) in tools.resolve(a).unavailable {
                tracing::warn!(agent = %a.name, tool = %name, "agent lists a tool it will not get: {why}");
            }
            if let Some(named) = a.model.as_deref().filter(|m| *m != "inherit") {
                let (model, _) = crate::agents::resolve_model(
                    Some(named),
                    None,
                    &settings.default_model,
                    &aliases,
                );
                if let Some(var) = crate::model::providers::missing_key(&settings, &routes, &model)
                {
                    tracing::warn!(agent = %a.name, %model, "the agent's model is served by Anthropic but {var} is not set: its runs will fail kind=model until it is");
                }
            }
        }
        let policy =
            crate::pinning::Settings::load(&settings.settings_file).map_err(OpenError::Config)?;
        for (source, rule) in
            Self::rules_naming_no_tool(&settings, &agents, &policy.current().policy)
        {
            tracing::warn!(source = %source, rule = %rule, "a permission rule names no tool this server has (names are case-sensitive: Bash, Read, Edit, Write, WebFetch, mcp__<server>…); it never matches");
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
                .map_err(|source| OpenError::Redis {
                    url: redact(url),
                    source,
                })?,
            ),
        };
        let agents = Arc::new(pins);
        let local: Arc<crate::worker::Local> = Default::default();
        let engine = Arc::new(Engine {
            store: store.clone(),
            agents: agents.clone(),
            tools: Arc::new(tools),
            model,
            settings: EngineSettings {
                default_model: settings.default_model.clone(),
                model_aliases: aliases,
                routes: routes.clone(),
                workspace: settings.workspace.clone(),
                lease_ttl: settings.lease_ttl(),
                max_attempts: settings.max_attempts,
                tool_timeout: settings.tool_timeout(),
                context: crate::engine::ContextSettings {
                    table: crate::model::tokens::ModelTable::new(
                        {
                            let mut w = crate::model::tokens::ModelTable::parse_overrides(
                                &settings.context_windows,
                            )
                            .map_err(|e| {
                                OpenError::Config(format!("SUBAGENTS_CONTEXT_WINDOWS: {e}"))
                            })?;
                            for (name, window) in routes.windows() {
                                w.entry(name).or_insert(window);
                            }
                            w
                        },
                        settings.default_context_window.max(1024),
                    ),
                    compact_at: settings.compact_at,
                    keep: settings.compact_keep,
                    tool_result_tokens: settings.tool_result_tokens,
                    calibration: Default::default(),
                },
                policy: crate::engine::PolicySettings {
                    settings: Arc::new(policy),
                    approval_timeout: Duration::from_secs(
                        settings.approval_timeout_secs.clamp(1, 30 * 86_400),
                    ),
                    http: reqwest::Client::builder()
                        .connect_timeout(Duration::from_secs(10))
                        .build()
                        .expect("reqwest client with static settings"),
                    hook_cwd: settings.hook_cwd.clone(),
                    hook_env_pass: settings
                        .hook_env
                        .iter()
                        .map(|v| v.trim().to_owned())
                        .filter(|v| !v.is_empty())
                        .collect(),
                },
                mcp: Arc::new(Self::mcp_hub(&settings, &agents.current())?),
                rate_limits: crate::engine::RateLimits {
                    by_model: settings.model_limit_map().map_err(OpenError::Config)?,
                    window: Duration::from_millis(settings.rate_window_ms.max(100)),
                },
                prices: Arc::new(
                    crate::model::prices::PriceTable::parse(&settings.prices)
                        .map_err(|e| OpenError::Config(format!("SUBAGENTS_PRICES: {e}")))?
                        .with_defaults(routes.prices()),
                ),
                delegation: crate::delegation::DelegationSettings {
                    max_depth: settings.max_depth,
                    result_limit: settings.child_result_limit,
                    workspace: Some(settings.workspace.clone()),
                },
                max_input_bytes: settings.max_input_bytes,
                drain_grace: settings.drain_grace(),
                context_messages: settings.context_messages,
                failpoints: Arc::new(crate::failpoints::Failpoints::parse(&settings.failpoints)?),
            },
            queue: queue.clone(),
            deltas: redis.clone(),
            live: Default::default(),
            budgets: crate::budget::Budgets::new(store.clone(), redis.clone()),
            menus: crate::engine::menus(),
            local: local.clone() as Arc<dyn crate::runs::FreeSlots>,
        });
        Ok(App {
            settings,
            store,
            queue,
            engine,
            agents,
            agent_errors,
            redis,
            run_reads: Default::default(),
            event_reads: Default::default(),
            local,
        })
    }

    /// Validates, records and enqueues a run (the run and its job in one transaction). Once
    /// this returns, the run and its job are durable.
    pub async fn start_run(&self, req: StartRun) -> Result<RunRecord, StartError> {
        Ok(self.start(req).await?.run)
    }

    /// [`App::start_run`], also telling whether an idempotency key matched an earlier start.
    ///
    /// When one of this process's workers has a free slot and the run is next in line, the run
    /// is handed to that worker as it is written ([`crate::worker::Local`]), not left for a
    /// fetch.
    pub async fn start(&self, req: StartRun) -> Result<Created, StartError> {
        let slot = self.local.reserve();
        let created = crate::runs::start_run_held(
            self.store.as_ref(),
            &self.agents,
            self.settings.max_input_bytes,
            req,
            slot.as_ref().map(|s| s.worker().to_owned()),
        )
        .await?;
        if let Some(slot) = slot.filter(|_| created.held) {
            slot.run(
                created.run.id,
                created.run.job_id.clone(),
                crate::worker::Handed::Start,
            );
        }
        Ok(created)
    }

    /// The concurrency limits this process configures, by the key prefix it owns: the
    /// default for every owner (`*`) and the agents' `max_concurrency:`. Owners' own limits
    /// come from the keys file, which only `serve` reads.
    pub fn concurrency_limits(&self) -> Vec<(&'static str, Vec<(String, u32)>)> {
        let agents = self
            .agents
            .current()
            .all()
            .filter_map(|a| a.max_concurrency.map(|n| (format!("agent:{}", a.name), n)))
            .collect();
        vec![
            ("*", vec![("*".to_owned(), self.settings.owner_concurrency)]),
            ("agent:", agents),
        ]
    }

    /// Retries a failed or cancelled root run ([`crate::runs::retry`]).
    pub async fn retry(
        &self,
        original: &RunRecord,
        input: Option<String>,
    ) -> Result<Created, StartError> {
        crate::runs::retry(
            self.store.as_ref(),
            &self.agents,
            self.settings.max_input_bytes,
            original,
            input,
        )
        .await
    }

    /// Waits until the run is terminal or `timeout` passes; returns its latest state. Sleeps
    /// on the run's notification (no polling loop); a slow re-check covers writers in other
    /// processes.
    pub async fn wait(
        &self,
        run: RunId,
        timeout: Duration,
    ) -> Result<Option<RunRecord>, StoreError> {
        Ok(self
            .wait_shared(run, timeout)
            .await?
            .0
            .map(|r| (*r).clone()))
    }

    /// [`App::wait`], sharing reads with every other waiter on the run: one commit wakes them
    /// all, and they share one read made after it. Also returns when the answering read
    /// started, so what the caller reads next can be shared the same way.
    pub async fn wait_shared(
        &self,
        run: RunId,
        timeout: Duration,
    ) -> Result<(Option<Arc<RunRecord>>, std::time::Instant), StoreError> {
        let read = || async { Ok::<_, StoreError>(self.store.get_run(run).await?.map(Arc::new)) };
        self.wait_with(run, timeout, &self.run_reads, read, None, |r| {
            r.as_ref().is_none_or(|r| r.status.is_terminal())
        })
        .await
    }

    /// The wait loop of [`App::wait_shared`], for callers that want more than the run from the
    /// read that answers them: `read` runs once per commit for all the waiters sharing `reads`
    /// (the API builds a finished run's whole answer in it, so a thousand waits are answered
    /// after one round of reads rather than two), until `done` says its value ends the wait.
    /// Commits announced as a step's progress ([`crate::notify::Notifier::progress`]) are not
    /// read: `done` must wait for the run's end (or its absence), which no such commit makes.
    ///
    /// `created`: the caller has just created the run, and this is the run's
    /// [`crate::notify::Signal::decisive`] generation from before it did (its signal held since):
    /// unless something decisive happened since, the first read is skipped too (it would find
    /// the run queued).
    pub async fn wait_with<V, F, Fut>(
        &self,
        run: RunId,
        timeout: Duration,
        reads: &crate::notify::SharedReads<RunId, V>,
        read: F,
        created: Option<u64>,
        done: impl Fn(&V) -> bool,
    ) -> Result<(V, std::time::Instant), StoreError>
    where
        V: Clone,
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Result<V, StoreError>>,
    {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut watch = crate::notify::Watch::new(
            self.store.subscribe(run),
            CROSS_PROCESS_RECHECK,
            SHARED_READ_AGE,
        );
        // The first read starts after this call: it must see whatever the caller did before.
        let mut not_before = Some(std::time::Instant::now());
        let until = tokio::time::sleep_until(deadline);
        tokio::pin!(until);
        let mut unread = created.filter(|g| *g == watch.decisive());
        loop {
            // The generations are taken after the watch registered and before the read: a
            // commit announced later wakes us again.
            let seen = watch.decisive();
            if unread.take().is_none() {
                let (v, started) = reads.read(run, watch.fresh(not_before), &read).await?;
                if done(&v) || tokio::time::Instant::now() >= deadline {
                    return Ok((v, started));
                }
            }
            not_before = loop {
                let nb = tokio::select! {
                    nb = watch.next() => nb,
                    _ = until.as_mut() => break Some(std::time::Instant::now()),
                };
                // A step's checkpoint cannot have ended the run: no read for it (a short run
                // commits a few of them, each of which had every waiter read the run again).
                if nb.is_some() || watch.decisive() != seen {
                    break nb;
                }
            };
        }
    }

    /// [`App::events_after`] for a stream, sharing one read with the other streams at the same
    /// cursor that need no fresher one (see [`crate::notify::Fresh`]), and each event's JSON
    /// serialized once for all of them.
    pub async fn events_after_shared(
        &self,
        run: RunId,
        after: u64,
        limit: u32,
        fresh: crate::notify::Fresh,
    ) -> Result<Arc<Vec<StreamedEvent>>, StoreError> {
        let read = || async {
            let events = self.events_after(run, after, limit).await?;
            Ok::<_, StoreError>(Arc::new(
                events.into_iter().map(StreamedEvent::new).collect(),
            ))
        };
        Ok(self
            .event_reads
            .read((run, after, limit), fresh, read)
            .await?
            .0)
    }

    /// Answers a pending approval of `owner` (see [`crate::runs::answer_approval`]).
    pub async fn answer_approval(
        &self,
        id: &ApprovalId,
        owner: &OwnerId,
        answer: crate::domain::ApprovalAnswer,
    ) -> Result<crate::domain::Answered, StoreError> {
        crate::runs::answer_approval(self.store.as_ref(), &self.queue, id, owner, answer).await
    }

    /// The stored id of `owner`'s thread `chosen` (see [`ThreadId::scoped`]): its scoped id, or,
    /// for a thread stored before threads were scoped (or a stored id its owner was shown, as in
    /// an event), that id when the thread is the owner's. A thread that does not exist yet gets
    /// the scoped id.
    pub async fn thread_for(
        &self,
        owner: &OwnerId,
        chosen: &ThreadId,
    ) -> Result<ThreadId, StoreError> {
        let scoped = chosen.scoped(owner);
        if scoped == *chosen || self.store.get_thread(&scoped).await?.is_some() {
            return Ok(scoped);
        }
        Ok(match self.store.get_thread(chosen).await? {
            Some(t) if t.owner == *owner => chosen.clone(),
            _ => scoped,
        })
    }

    /// Cancels a run and its attached descendants; a run that ends here (queued or parked)
    /// reports to its parent at once.
    pub async fn cancel(&self, run: RunId) -> Result<crate::store::CancelOutcome, StoreError> {
        let outcome = crate::runs::cancel(self.store.as_ref(), &self.queue, run).await?;
        // The worker holding it may be another process: tell it now, not at its next lease renewal.
        if outcome == crate::store::CancelOutcome::Requested
            && let Some(r) = &self.redis
        {
            r.announce_cancel(run).await;
        }
        Ok(outcome)
    }

    /// Sends `owner`'s run a message for its next step boundary (see [`crate::store::Inbox`]):
    /// a run parked on children gets its job now; the worker holding a running one hears it at
    /// once, in any process when Redis is configured (else at its next lease renewal, within a
    /// second).
    pub async fn send_message(
        &self,
        run: RunId,
        owner: &OwnerId,
        content: &str,
    ) -> Result<(crate::ids::MessageId, crate::store::Sent), StoreError> {
        let id = crate::ids::MessageId::generate();
        let sent = self.store.send_message(run, owner, &id, content).await?;
        match sent {
            crate::store::Sent::Accepted { woken: true, .. } => {
                crate::runs::push(self.store.as_ref(), &self.queue, run).await?
            }
            crate::store::Sent::Accepted {
                status: crate::store::RunStatus::Running,
                ..
            } => {
                if let Some(r) = &self.redis {
                    r.announce_cancel(run).await;
                }
            }
            _ => {}
        }
        Ok((id, sent))
    }

    /// Interrupts a run ([`crate::runs::interrupt`]): the worker holding a running one hears it
    /// at once (through Redis in another process, else at its next lease renewal).
    pub async fn interrupt(&self, run: RunId) -> Result<crate::store::CancelOutcome, StoreError> {
        let outcome = crate::runs::interrupt(self.store.as_ref(), &self.queue, run).await?;
        if outcome == crate::store::CancelOutcome::Requested
            && let Some(r) = &self.redis
        {
            r.announce_cancel(run).await;
        }
        Ok(outcome)
    }

    /// Events of a run after a cursor: from Redis when configured (falling back to the outbox
    /// for any range Redis lacks), else from the outbox.
    pub async fn events_after(
        &self,
        run: RunId,
        after: u64,
        limit: u32,
    ) -> Result<Vec<crate::store::EventRecord>, StoreError> {
        match &self.redis {
            Some(r) => r.events_after(self.store.as_ref(), run, after, limit).await,
            None => self.store.events_after(run, after, limit).await,
        }
    }

    /// Starts the Redis relay and wake-up subscriber, if Redis is configured.
    pub fn spawn_relay(&self, shutdown: CancellationToken) -> Option<tokio::task::JoinHandle<()>> {
        self.redis
            .clone()
            .map(|r| r.spawn(self.store.clone(), shutdown))
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
        let workers = run_workers(
            self.engine.clone(),
            self.queue.clone(),
            settings,
            self.local.clone(),
            shutdown,
        );
        let limits = self.concurrency_limits();
        let store = self.store.clone();
        tokio::spawn(async move {
            // The claims enforce the limits; this process's configuration goes in first.
            for (prefix, entries) in limits {
                if let Err(e) = store.set_limits(prefix, &entries).await {
                    tracing::warn!(error = %e, prefix, "could not record the concurrency limits; claims go on without them");
                }
            }
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
