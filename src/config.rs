//! Configuration, from flags and environment (every flag has an `env` fallback). Secrets are
//! never printed: `Debug` redacts the API key.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

/// Model rate limits by model: (calls, prompt tokens) per window, either may be unset.
pub type ModelLimits = std::collections::BTreeMap<String, (Option<u64>, Option<u64>)>;

/// Settings shared by every subcommand.
#[derive(Args, Clone)]
pub struct Settings {
    /// Where runs, threads and the queue live. `sqlite://FILE` is the embedded default
    /// (created if missing); `sqlite::memory:` keeps nothing.
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "sqlite://subagents.db",
        global = true
    )]
    pub database_url: String,

    /// Directory of agent definitions (`*.md` with YAML front matter).
    #[arg(
        long,
        env = "SUBAGENTS_JOBS_DIR",
        default_value = "jobs",
        global = true
    )]
    pub jobs_dir: PathBuf,

    /// The only directory file tools may touch (created if missing).
    #[arg(
        long,
        env = "SUBAGENTS_WORKSPACE",
        default_value = "workspace",
        global = true
    )]
    pub workspace: PathBuf,

    /// OpenAI-compatible endpoint, up to and including `/v1`.
    #[arg(
        long,
        env = "OPENAI_BASE_URL",
        default_value = "https://api.openai.com/v1",
        global = true
    )]
    pub openai_base_url: String,

    /// API key for the endpoint (never printed).
    #[arg(long, env = "OPENAI_API_KEY", hide_env_values = true, global = true)]
    pub openai_api_key: Option<String>,

    /// Anthropic API key (never printed). When set, `claude-*` models and the `sonnet`, `opus`
    /// and `haiku` aliases go to Anthropic's Messages API, with prompt caching.
    #[arg(long, env = "ANTHROPIC_API_KEY", hide_env_values = true, global = true)]
    pub anthropic_api_key: Option<String>,

    /// Anthropic's endpoint, up to and including `/v1`.
    #[arg(
        long,
        env = "ANTHROPIC_BASE_URL",
        default_value = "https://api.anthropic.com/v1",
        global = true
    )]
    pub anthropic_base_url: String,

    /// The models table: which provider (`openai` or `anthropic`) serves which model, with its
    /// endpoint, key variable, context window, prices and thinking budget. A JSON list inline or
    /// the path of a file holding one; see docs/operating.md. Models no entry matches go to
    /// OPENAI_BASE_URL.
    #[arg(long, env = "SUBAGENTS_MODELS", default_value = "", global = true)]
    pub models: String,

    /// Model used when an agent definition names none.
    #[arg(
        long = "model",
        env = "SUBAGENTS_MODEL",
        default_value = "gpt-4o-mini",
        global = true
    )]
    pub default_model: String,

    /// Runs one worker process executes at once.
    #[arg(
        long,
        env = "SUBAGENTS_CONCURRENCY",
        default_value_t = 4,
        global = true
    )]
    pub concurrency: usize,

    /// Seconds a run's lease lasts without renewal; a crashed worker's runs resume after this.
    #[arg(
        long,
        env = "SUBAGENTS_LEASE_TTL",
        default_value_t = 15.0,
        global = true
    )]
    pub lease_ttl_secs: f64,

    /// Expired leases (its worker crashed, was killed or froze) after which a run fails with
    /// `kind=lost`. Parking, waking and graceful releases do not count.
    #[arg(
        long,
        env = "SUBAGENTS_MAX_ATTEMPTS",
        default_value_t = 5,
        global = true
    )]
    pub max_attempts: u32,

    /// Seconds a stopping worker (SIGTERM) gives the steps in flight to finish before it
    /// releases their runs to the queue, where another worker resumes them at once.
    #[arg(
        long,
        env = "SUBAGENTS_DRAIN_GRACE",
        default_value_t = 10.0,
        global = true
    )]
    pub drain_grace_secs: f64,

    /// Messages of a thread a run reads back to rebuild its context (the newest ones).
    #[arg(
        long,
        env = "SUBAGENTS_CONTEXT_MESSAGES",
        default_value_t = 2000,
        global = true
    )]
    pub context_messages: u32,

    /// Milliseconds between the reaper's passes (expired leases, lost jobs, due wake-ups);
    /// 0 derives it from the lease (half of it). For tests, a very large value turns it off.
    #[arg(
        long,
        env = "SUBAGENTS_REAP_MS",
        default_value_t = 0,
        global = true,
        hide = true
    )]
    pub reap_ms: u64,

    /// Failure points for tests (`name=sleep(MS)` or `name=crash`, comma-separated); off by
    /// default. See the `failpoints` module.
    #[arg(
        long,
        env = "SUBAGENTS_FAILPOINTS",
        default_value = "",
        global = true,
        hide = true
    )]
    pub failpoints: String,

    /// Seconds one tool call may take; then the model is told it timed out.
    #[arg(
        long,
        env = "SUBAGENTS_TOOL_TIMEOUT",
        default_value_t = 60.0,
        global = true
    )]
    pub tool_timeout_secs: f64,

    /// Tokens of one tool result the model sees. A longer result is written whole to the
    /// owner's workspace (`.results/<run>/<call>.txt`) and the model gets its head, its size and
    /// that path, which `read_file` pages through; `read_file` itself stops here and says
    /// where to read on. Never more than a quarter of the model's context window.
    #[arg(
        long,
        env = "SUBAGENTS_TOOL_RESULT_TOKENS",
        default_value_t = 20_000,
        global = true
    )]
    pub tool_result_tokens: usize,

    /// MCP servers in Claude Code's `.mcp.json` format (`{"mcpServers": {name: {command, args,
    /// env} | {type: "http", url, headers}}}`, `${VAR}` expanded); their tools are
    /// `mcp__<server>__<tool>`. A missing file declares none.
    #[arg(
        long,
        env = "SUBAGENTS_MCP_CONFIG",
        default_value = ".mcp.json",
        global = true
    )]
    pub mcp_config: std::path::PathBuf,

    /// Seconds an MCP server may take to start and list its tools (a server that does not is
    /// left alone for 15 s, and its tools give the model an error meanwhile).
    #[arg(
        long,
        env = "SUBAGENTS_MCP_TIMEOUT",
        default_value_t = 30.0,
        global = true
    )]
    pub mcp_timeout_secs: f64,

    /// The settings file: `hooks` and `permissions` in Claude Code's settings.json shape, and
    /// `approvalTimeout` (seconds). A missing file means no hooks and no rules.
    #[arg(
        long,
        env = "SUBAGENTS_SETTINGS",
        default_value = "subagents.json",
        global = true
    )]
    pub settings_file: std::path::PathBuf,

    /// Seconds an approval waits for an answer before it counts as denied (the settings file's
    /// `approvalTimeout` and an agent's `approval_timeout:` override it).
    #[arg(
        long,
        env = "SUBAGENTS_APPROVAL_TIMEOUT",
        default_value_t = 86_400,
        global = true
    )]
    pub approval_timeout_secs: u64,

    /// Model rate limits shared by every worker on the database: `model:rpm=N:tpm=M`,
    /// comma-separated (either part may be left out). Over budget, a run parks until it frees
    /// up instead of provoking the provider's 429s.
    #[arg(
        long,
        env = "SUBAGENTS_MODEL_LIMITS",
        default_value = "",
        global = true
    )]
    pub model_limits: String,

    /// The rate-limit window in ms (a minute; tests shorten it).
    #[arg(
        long,
        env = "SUBAGENTS_RATE_WINDOW_MS",
        default_value_t = 60_000,
        global = true,
        hide = true
    )]
    pub rate_window_ms: u64,

    /// Most runs of one owner running at once, fleet-wide (0: no limit); the keys file sets it
    /// per owner (`owner <hash> concurrency=N`). More wait queued; owners with work queued
    /// take turns for the workers in any case.
    #[arg(
        long,
        env = "SUBAGENTS_OWNER_CONCURRENCY",
        default_value_t = 0,
        global = true
    )]
    pub owner_concurrency: u32,

    /// Most runs of one API key's owner running at once, fleet-wide, when the keys file sets no
    /// `concurrency=N` for it (0: no limit). Without keys (one local owner) it does not apply.
    #[arg(
        long,
        env = "SUBAGENTS_KEY_CONCURRENCY",
        default_value_t = 32,
        global = true
    )]
    pub key_concurrency: u32,

    /// Model prices in dollars per million tokens, `model=INPUT:OUTPUT`, comma-separated; a
    /// name also matches as a prefix (`gpt-4.1=2:8,my-llama=0:0`). Common models have built-in
    /// list prices; a model with no price costs 0.
    #[arg(long, env = "SUBAGENTS_PRICES", default_value = "", global = true)]
    pub prices: String,

    /// Context windows of models the built-in table does not know, or overrides of it:
    /// `name=WINDOW[:MAX_OUTPUT]`, comma-separated; a name also matches as a prefix
    /// (`my-llama=32768:4096`).
    #[arg(
        long,
        env = "SUBAGENTS_CONTEXT_WINDOWS",
        default_value = "",
        global = true
    )]
    pub context_windows: String,

    /// Context window assumed for a model nobody knows (tokens).
    #[arg(
        long,
        env = "SUBAGENTS_DEFAULT_CONTEXT_WINDOW",
        default_value_t = 128_000,
        global = true
    )]
    pub default_context_window: u64,

    /// Percent of the context window at which a run compacts its context before the next
    /// model call (agents set `compact_at:`, runs `limits.compact_at`).
    #[arg(long, env = "SUBAGENTS_COMPACT_AT", default_value_t = 85, value_parser = clap::value_parser!(u8).range(10..=95), global = true)]
    pub compact_at: u8,

    /// Percent of the context window a compaction keeps verbatim (the newest messages).
    #[arg(long, env = "SUBAGENTS_COMPACT_KEEP", default_value_t = 10, value_parser = clap::value_parser!(u8).range(1..=50), global = true)]
    pub compact_keep: u8,

    /// Retries of a model call on 429, 5xx or a broken connection.
    #[arg(
        long,
        env = "SUBAGENTS_MODEL_RETRIES",
        default_value_t = 5,
        global = true
    )]
    pub model_retries: u32,

    /// Seconds one model call attempt may take in all.
    #[arg(
        long,
        env = "SUBAGENTS_MODEL_TIMEOUT",
        default_value_t = 300.0,
        global = true
    )]
    pub model_timeout_secs: f64,

    /// Milliseconds between an idle worker's looks at the queue.
    #[arg(long, env = "SUBAGENTS_POLL_MS", default_value_t = 50, global = true)]
    pub poll_ms: u64,

    /// Largest accepted input (prompt) in bytes.
    #[arg(long, env = "SUBAGENTS_MAX_INPUT_BYTES", default_value_t = 256 * 1024, global = true)]
    pub max_input_bytes: usize,

    /// Delegation depth: runs at this depth get no delegation tools (1: only top-level runs
    /// delegate).
    #[arg(long, env = "SUBAGENTS_MAX_DEPTH", default_value_t = 1, global = true)]
    pub max_depth: u32,

    /// Bytes of a child's final text handed to its parent; a longer text is written whole to
    /// `.results/<child run>/result.txt` in the workspace and the parent gets its head and the
    /// path.
    #[arg(
        long,
        env = "SUBAGENTS_CHILD_RESULT_LIMIT",
        default_value_t = 4000,
        global = true
    )]
    pub child_result_limit: usize,

    /// Redis for event streams and cross-process wake-ups (`redis://HOST:PORT`); without it,
    /// events are served from the outbox table.
    #[arg(long, env = "REDIS_URL", global = true)]
    pub redis_url: Option<String>,

    /// Approximate length kept of the global event stream (`MAXLEN ~`).
    #[arg(
        long,
        env = "SUBAGENTS_REDIS_MAXLEN",
        default_value_t = 100_000,
        global = true
    )]
    pub redis_maxlen: u64,

    /// Seconds a finished run's event stream stays in Redis (the outbox keeps it for good).
    #[arg(
        long,
        env = "SUBAGENTS_REDIS_RETENTION",
        default_value_t = 86_400,
        global = true
    )]
    pub redis_retention_secs: u64,

    /// Offer the `bash` tool (to agents that list it). A shell is not confined to the
    /// workspace the way the file tools are: enable it only where agents may run commands (see
    /// docs/security.md). The variable takes 1/0, true/false, yes/no, on/off.
    #[arg(long, env = "SUBAGENTS_ALLOW_BASH", default_value_t = false, global = true, value_parser = clap::builder::BoolishValueParser::new())]
    pub allow_bash: bool,

    /// Hosts `web_fetch` may reach even though they resolve to a private or local address
    /// (comma-separated names or addresses).
    #[arg(
        long,
        env = "SUBAGENTS_FETCH_ALLOW",
        value_delimiter = ',',
        global = true
    )]
    pub fetch_allow: Vec<String>,

    /// Hosts a webhook may be delivered to even though they resolve to a private or local
    /// address (comma-separated names or addresses, like `SUBAGENTS_FETCH_ALLOW`).
    #[arg(
        long,
        env = "SUBAGENTS_WEBHOOK_ALLOW",
        value_delimiter = ',',
        global = true
    )]
    pub webhook_allow: Vec<String>,

    /// How long a webhook delivery is retried (seconds from its first attempt) before it is
    /// `dead`.
    #[arg(
        long,
        env = "SUBAGENTS_WEBHOOK_RETRY_FOR",
        default_value_t = 86_400.0,
        global = true
    )]
    pub webhook_retry_for_secs: f64,

    /// The wait before a failed webhook delivery's first retry (seconds); it doubles at each
    /// retry, up to an hour.
    #[arg(
        long,
        env = "SUBAGENTS_WEBHOOK_BACKOFF",
        default_value_t = 5.0,
        global = true
    )]
    pub webhook_backoff_secs: f64,

    /// Seconds a webhook receiver has to answer one delivery.
    #[arg(
        long,
        env = "SUBAGENTS_WEBHOOK_TIMEOUT",
        default_value_t = 10.0,
        global = true
    )]
    pub webhook_timeout_secs: f64,

    /// Deliveries in flight at once to one subscription, per process: a slow receiver holds
    /// up only its own.
    #[arg(
        long,
        env = "SUBAGENTS_WEBHOOK_IN_FLIGHT",
        default_value_t = 4,
        global = true
    )]
    pub webhook_in_flight: u32,

    /// A subscription whose deliveries go dead this many times in a row is paused (with the
    /// reason) until its owner resumes it; what it missed waits, nothing is dropped.
    #[arg(
        long,
        env = "SUBAGENTS_WEBHOOK_PAUSE_AFTER",
        default_value_t = 5,
        global = true
    )]
    pub webhook_pause_after: u32,

    /// Hosts `web_fetch` never reaches (comma-separated).
    #[arg(
        long,
        env = "SUBAGENTS_FETCH_DENY",
        value_delimiter = ',',
        global = true
    )]
    pub fetch_deny: Vec<String>,

    /// The search backend of `web_search`: an endpoint answering SearXNG's JSON format
    /// (`GET URL?q=…&format=json`); without it, agents do not get `web_search`.
    #[arg(long, env = "SUBAGENTS_SEARCH_URL", global = true)]
    pub search_url: Option<String>,

    /// Model names agent files use, mapped onto the endpoint's models:
    /// `sonnet=gpt-4.1,haiku=gpt-4.1-mini`. Claude's `sonnet`, `opus` and `haiku` without an
    /// entry use the default model.
    #[arg(
        long,
        env = "SUBAGENTS_MODEL_ALIASES",
        default_value = "",
        global = true
    )]
    pub model_aliases: String,

    /// The directory command hooks run in. Default: the owner's workspace (as Claude Code runs
    /// them in the project), which the model writes; point it elsewhere for hooks that need not
    /// look at the workspace (they still get `CLAUDE_PROJECT_DIR`).
    #[arg(long, env = "SUBAGENTS_HOOK_CWD", global = true)]
    pub hook_cwd: Option<PathBuf>,

    /// Names of variables of the worker's environment that command hooks get, comma-separated.
    /// Hooks otherwise get only PATH, HOME, LANG and a few other harmless variables, never the
    /// worker's keys.
    #[arg(long, env = "SUBAGENTS_HOOK_ENV", value_delimiter = ',', global = true)]
    pub hook_env: Vec<String>,

    /// Most event streams (SSE: a run's events, the overview) one API key may hold open on a
    /// server at once (0: no cap); past it, 429 `too_many_streams`.
    #[arg(
        long,
        env = "SUBAGENTS_MAX_STREAMS_PER_KEY",
        default_value_t = 2000,
        global = true
    )]
    pub max_streams_per_key: usize,

    /// Most waits (`/v1/runs/wait`, `/v1/runs/{id}/wait`) one API key may hold open on a
    /// server at once (0: no cap); past it, 429 `too_many_waits`.
    #[arg(
        long,
        env = "SUBAGENTS_MAX_WAITS_PER_KEY",
        default_value_t = 2000,
        global = true
    )]
    pub max_waits_per_key: usize,

    /// Most runs one owner may have queued for a start through the API to be accepted (0: no
    /// cap); past it, 429 `queue_full`.
    #[arg(
        long,
        env = "SUBAGENTS_MAX_QUEUED_PER_KEY",
        default_value_t = 100_000,
        global = true
    )]
    pub max_queued_per_key: u64,

    /// A token that opens `/metrics` (and `/readyz`'s details) to a scraper without an API key
    /// (`Authorization: Bearer TOKEN`); with API keys configured, those need a key or this.
    #[arg(
        long,
        env = "SUBAGENTS_METRICS_TOKEN",
        hide_env_values = true,
        global = true
    )]
    pub metrics_token: Option<String>,

    /// Send each model request's run and step (`x-subagents-step: RUN:STEP`) to the model
    /// endpoint. Unset: only to an endpoint on this machine (the mock reads it); a provider
    /// elsewhere is not told our ids unless this says so.
    #[arg(long, env = "SUBAGENTS_STEP_HEADER", global = true, value_parser = clap::builder::BoolishValueParser::new())]
    pub step_header: Option<bool>,

    /// Offer the built-in `echo` tool (it returns its text: for tests and benchmarks). Unset:
    /// only when the model endpoint is on this machine (the mock); a real model is not offered
    /// a tool that does nothing.
    #[arg(long, env = "SUBAGENTS_ECHO_TOOL", global = true, value_parser = clap::builder::BoolishValueParser::new())]
    pub echo_tool: Option<bool>,

    /// Append one line per tool execution (`idempotency-key<TAB>tool`) to this file.
    #[arg(long, env = "SUBAGENTS_TOOL_JOURNAL", global = true)]
    pub tool_journal: Option<PathBuf>,
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settings")
            .field("database_url", &self.database_url)
            .field("jobs_dir", &self.jobs_dir)
            .field("workspace", &self.workspace)
            .field("openai_base_url", &self.openai_base_url)
            .field(
                "openai_api_key",
                &self.openai_api_key.as_ref().map(|_| "<redacted>"),
            )
            .field(
                "anthropic_api_key",
                &self.anthropic_api_key.as_ref().map(|_| "<redacted>"),
            )
            .field("models", &self.models)
            .field("default_model", &self.default_model)
            .field("concurrency", &self.concurrency)
            .field("lease_ttl_secs", &self.lease_ttl_secs)
            .finish_non_exhaustive()
    }
}

impl Settings {
    /// `SUBAGENTS_WEBHOOK_ALLOW`'s hosts, trimmed, empty entries dropped.
    pub fn webhook_allow_hosts(&self) -> Vec<String> {
        self.webhook_allow
            .iter()
            .map(|h| h.trim().to_owned())
            .filter(|h| !h.is_empty())
            .collect()
    }

    /// The declared defaults (environment fallbacks still apply, as on the command line), with
    /// the given database: for tests and embedders.
    pub fn defaults(database_url: &str) -> Settings {
        #[derive(clap::Parser)]
        struct Only {
            #[command(flatten)]
            s: Settings,
        }
        // Parsing an empty command line keeps the declared defaults the single source of truth.
        let mut s =
            <Only as clap::Parser>::try_parse_from(["subagents", "--database-url", database_url])
                .map(|o| o.s)
                .expect("defaults parse");
        s.database_url = database_url.to_owned();
        s
    }

    /// `ANTHROPIC_API_KEY`, when set to something.
    pub fn anthropic_key(&self) -> Option<&str> {
        self.anthropic_api_key
            .as_deref()
            .filter(|k| !k.trim().is_empty())
    }

    /// Whether the model endpoint is on this machine (a loopback host): the mock, a local
    /// server, a test.
    pub fn local_model_endpoint(&self) -> bool {
        is_loopback_url(&self.openai_base_url)
    }

    /// Lease length.
    pub fn lease_ttl(&self) -> Duration {
        Duration::from_secs_f64(self.lease_ttl_secs.max(0.2))
    }

    /// `SUBAGENTS_MODEL_LIMITS` parsed: model → (requests, tokens) per window.
    pub fn model_limit_map(&self) -> Result<ModelLimits, String> {
        let mut map = std::collections::BTreeMap::new();
        for item in self
            .model_limits
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
        {
            let mut parts = item.split(':');
            let model = parts.next().unwrap_or("").trim();
            if model.is_empty() {
                return Err(format!(
                    "SUBAGENTS_MODEL_LIMITS: `{item}` does not start with a model name (e.g. gpt-4.1:rpm=500:tpm=200000)"
                ));
            }
            let (mut rpm, mut tpm) = (None, None);
            for p in parts {
                let (k, v) = p.split_once('=').ok_or_else(|| {
                    format!("SUBAGENTS_MODEL_LIMITS: `{p}` in `{item}` is not rpm=N or tpm=N")
                })?;
                let n: u64 = v.trim().parse().ok().filter(|n| *n > 0).ok_or_else(|| {
                    format!("SUBAGENTS_MODEL_LIMITS: `{p}` needs a whole number above 0")
                })?;
                match k.trim() {
                    "rpm" => rpm = Some(n),
                    "tpm" => tpm = Some(n),
                    other => {
                        return Err(format!(
                            "SUBAGENTS_MODEL_LIMITS: `{other}` is not rpm or tpm"
                        ));
                    }
                }
            }
            if rpm.is_none() && tpm.is_none() {
                return Err(format!(
                    "SUBAGENTS_MODEL_LIMITS: `{item}` sets neither rpm nor tpm"
                ));
            }
            map.insert(model.to_owned(), (rpm, tpm));
        }
        Ok(map)
    }

    /// The model alias map (`SUBAGENTS_MODEL_ALIASES`), or what is wrong with it.
    pub fn model_alias_map(&self) -> Result<std::collections::BTreeMap<String, String>, String> {
        let mut map = std::collections::BTreeMap::new();
        for item in self
            .model_aliases
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
        {
            let (from, to) = item
                .split_once('=')
                .filter(|(f, t)| !f.trim().is_empty() && !t.trim().is_empty())
                .ok_or_else(|| {
                    format!(
                        "SUBAGENTS_MODEL_ALIASES: `{item}` is not NAME=MODEL (e.g. sonnet=gpt-4.1)"
                    )
                })?;
            map.insert(from.trim().to_owned(), to.trim().to_owned());
        }
        Ok(map)
    }

    /// How long a draining worker lets the steps in flight finish.
    pub fn drain_grace(&self) -> Duration {
        Duration::from_secs_f64(self.drain_grace_secs.clamp(0.0, 3600.0))
    }

    /// Tool time limit.
    pub fn tool_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.tool_timeout_secs.max(0.001))
    }

    /// Model attempt time limit.
    pub fn model_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.model_timeout_secs.max(0.001))
    }
}

/// Whether `url`'s host is this machine (`localhost` or a loopback address).
pub fn is_loopback_url(url: &str) -> bool {
    reqwest::Url::parse(url)
        .ok()
        .and_then(|u| u.host_str().map(str::to_owned))
        .is_some_and(|h| {
            let h = h
                .trim_matches(['[', ']'])
                .trim_end_matches('.')
                .to_ascii_lowercase();
            h == "localhost"
                || h.parse::<std::net::IpAddr>()
                    .is_ok_and(|ip| ip.is_loopback())
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_limits_parse_and_refuse_nonsense() {
        let mut s = Settings::defaults("sqlite://x.db");
        s.model_limits = "gpt-4.1:rpm=500:tpm=200000, mock-model:rpm=8, big:tpm=1000000".into();
        let m = s.model_limit_map().unwrap();
        assert_eq!(m["gpt-4.1"], (Some(500), Some(200_000)));
        assert_eq!(m["mock-model"], (Some(8), None));
        assert_eq!(m["big"], (None, Some(1_000_000)));
        for bad in ["gpt:rpm=0", "gpt:rps=3", ":rpm=3", "gpt", "gpt:rpm"] {
            s.model_limits = bad.into();
            assert!(s.model_limit_map().is_err(), "{bad}");
        }
    }
}
