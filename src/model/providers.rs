//! Which provider serves which model: the models table (`SUBAGENTS_MODELS`), and the
//! [`Router`] that sends each request to its model's client.
//!
//! An entry matches a model by exact name or by prefix (`claude-*`); the exact name wins, then
//! the longest prefix. A model no entry matches goes to the OpenAI-compatible endpoint
//! (`OPENAI_BASE_URL`). With `ANTHROPIC_API_KEY` set, `claude-*` goes to Anthropic unless the
//! table says otherwise.

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use serde::Deserialize;

use super::prices::Price;
use super::tokens::Window;
use super::{ChatModel, ChatRequest, ChatResponse, DeltaSink, ModelError};
use crate::config::Settings;

/// A wire format a model is reached through.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Provider {
    /// OpenAI's Chat Completions (and every compatible server).
    OpenAi,
    /// Anthropic's Messages API.
    Anthropic,
}

impl Provider {
    /// The name pinned on a run and put on traces (`gen_ai.provider.name`).
    pub fn as_str(self) -> &'static str {
        match self {
            Provider::OpenAi => "openai",
            Provider::Anthropic => "anthropic",
        }
    }

    /// The variable that holds the key when an entry names none.
    pub fn default_key_env(self) -> &'static str {
        match self {
            Provider::OpenAi => "OPENAI_API_KEY",
            Provider::Anthropic => "ANTHROPIC_API_KEY",
        }
    }
}

/// Dollars per million tokens of one entry (cache rates default to the input rate).
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EntryPrices {
    /// Fresh prompt tokens.
    pub input: f64,
    /// Completion tokens.
    pub output: f64,
    /// Prompt tokens read from the cache.
    #[serde(default)]
    pub cache_read: Option<f64>,
    /// Prompt tokens written to the cache.
    #[serde(default)]
    pub cache_write: Option<f64>,
}

/// One entry of the models table.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    /// A model name, or a prefix ending in `*` (`claude-*`).
    #[serde(rename = "match")]
    pub pattern: String,
    /// The wire format.
    pub provider: Provider,
    /// Up to and including `/v1`; the provider's own endpoint when absent.
    #[serde(default)]
    pub base_url: Option<String>,
    /// The environment variable holding the key (`ANTHROPIC_API_KEY` / `OPENAI_API_KEY` when
    /// absent). Never the key itself: the table may be checked in.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// Tokens of request plus answer.
    #[serde(default)]
    pub context_window: Option<u64>,
    /// Tokens the model may answer with (Anthropic's `max_tokens`).
    #[serde(default)]
    pub max_output: Option<u64>,
    /// Prices, overriding the built-in list.
    #[serde(default)]
    pub prices: Option<EntryPrices>,
    /// Anthropic's extended thinking budget in tokens; off when absent.
    #[serde(default)]
    pub thinking_budget: Option<u32>,
    /// Anthropic prompt-cache breakpoints (default on).
    #[serde(default)]
    pub caching: Option<bool>,
}

impl Entry {
    fn matches(&self, model: &str) -> Option<usize> {
        match self.pattern.strip_suffix('*') {
            Some(prefix) => model.starts_with(prefix).then_some(prefix.len()),
            None => (model == self.pattern).then_some(usize::MAX),
        }
    }

    /// Tokens the model may answer with: `max_output`, else an eighth of the context window
    /// (what the window table assumes).
    pub fn output_limit(&self) -> Option<u64> {
        self.max_output
            .or_else(|| self.context_window.map(|c| (c / 8).clamp(256, 16_384)))
    }

    /// The key's variable.
    pub fn key_env(&self) -> &str {
        self.api_key_env
            .as_deref()
            .unwrap_or(self.provider.default_key_env())
    }

    /// The entry's name as the price and window tables take it (a prefix without its `*`).
    fn table_name(&self) -> &str {
        self.pattern.strip_suffix('*').unwrap_or(&self.pattern)
    }
}

/// The models table.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ModelRoutes {
    entries: Vec<Entry>,
}

/// Claude Code's aliases and the models they stand for when Anthropic serves Claude.
pub const CLAUDE_ALIASES: [(&str, &str); 3] = [
    ("sonnet", "claude-sonnet-4-5"),
    ("opus", "claude-opus-4-5"),
    ("haiku", "claude-haiku-4-5"),
];

impl ModelRoutes {
    /// `SUBAGENTS_MODELS`: empty, a JSON table inline (`[...]` or `{"models": [...]}`), or the
    /// path of a file holding one. `anthropic_key` says whether `ANTHROPIC_API_KEY` is set: then
    /// `claude-*` goes to Anthropic unless an entry says otherwise.
    pub fn load(spec: &str, anthropic_key: bool) -> Result<ModelRoutes, String> {
        let spec = spec.trim();
        let text = if spec.is_empty() {
            "[]".to_owned()
        } else if spec.starts_with('[') || spec.starts_with('{') {
            spec.to_owned()
        } else {
            std::fs::read_to_string(spec).map_err(|e| format!("cannot read {spec}: {e}"))?
        };
        let mut routes = Self::parse(&text)?;
        if anthropic_key && routes.route("claude-x").is_none() {
            routes.entries.push(Entry {
                pattern: "claude-*".into(),
                provider: Provider::Anthropic,
                base_url: None,
                api_key_env: None,
                context_window: None,
                max_output: None,
                prices: None,
                thinking_budget: None,
                caching: None,
            });
        }
        Ok(routes)
    }

    /// Parses a table's JSON, saying which entry is wrong and why.
    pub fn parse(text: &str) -> Result<ModelRoutes, String> {
        let shape = |e: &dyn std::fmt::Display| {
            format!(
                "{e}: expected a list of {{\"match\": \"claude-*\", \"provider\": \"anthropic\" | \"openai\", \"base_url\"?, \"api_key_env\"?, \"context_window\"?, \"max_output\"?, \"prices\"?: {{\"input\", \"output\", \"cache_read\"?, \"cache_write\"?}}, \"thinking_budget\"?, \"caching\"?}}"
            )
        };
        let mut v: serde_json::Value = serde_json::from_str(text).map_err(|e| shape(&e))?;
        if let Some(models) = v.get_mut("models") {
            v = models.take();
        }
        let entries: Vec<Entry> = serde_json::from_value(v).map_err(|e| shape(&e))?;
        for e in &entries {
            let name = e.table_name();
            if name.is_empty() || e.pattern.trim() != e.pattern || name.contains('*') {
                return Err(format!(
                    "`{}`: a match is a model name or a prefix ending in one `*`",
                    e.pattern
                ));
            }
            if let Some(u) = &e.base_url
                && reqwest::Url::parse(u).is_err()
            {
                return Err(format!("`{}`: base_url `{u}` is not a URL", e.pattern));
            }
            if let (Some(b), Some(m)) = (e.thinking_budget, e.max_output)
                && u64::from(b) >= m
            {
                return Err(format!(
                    "`{}`: thinking_budget {b} must be below max_output {m} (Anthropic counts thinking in max_tokens)",
                    e.pattern
                ));
            }
            if e.thinking_budget.is_some_and(|b| b < 1024) {
                return Err(format!(
                    "`{}`: thinking_budget must be at least 1024 tokens (Anthropic's minimum)",
                    e.pattern
                ));
            }
            if let Some(p) = &e.prices {
                let all = [Some(p.input), Some(p.output), p.cache_read, p.cache_write];
                if all
                    .iter()
                    .flatten()
                    .any(|v| !v.is_finite() || !(0.0..=100_000.0).contains(v))
                {
                    return Err(format!(
                        "`{}`: prices must be numbers from 0 to 100000 (dollars per million tokens)",
                        e.pattern
                    ));
                }
            }
        }
        Ok(ModelRoutes { entries })
    }

    /// The entry serving `model`: the exact name first, then the longest prefix.
    pub fn route(&self, model: &str) -> Option<&Entry> {
        self.entries
            .iter()
            .filter_map(|e| e.matches(model).map(|rank| (rank, e)))
            .max_by_key(|(rank, _)| *rank)
            .map(|(_, e)| e)
    }

    /// The provider of `model` (OpenAI-compatible when no entry names it).
    pub fn provider(&self, model: &str) -> Provider {
        self.route(model).map_or(Provider::OpenAi, |e| e.provider)
    }

    /// Every entry.
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// Aliases the table implies: `sonnet`/`opus`/`haiku` name Claude models when Anthropic
    /// serves them.
    pub fn implied_aliases(&self) -> Vec<(String, String)> {
        CLAUDE_ALIASES
            .iter()
            .filter(|(_, model)| self.provider(model) == Provider::Anthropic)
            .map(|(a, m)| ((*a).to_owned(), (*m).to_owned()))
            .collect()
    }

    /// Prices the table sets, for the price table's overrides.
    pub fn prices(&self) -> Vec<(String, Price)> {
        self.entries
            .iter()
            .filter_map(|e| {
                let p = e.prices?;
                Some((
                    e.table_name().to_owned(),
                    Price {
                        input: p.input,
                        output: p.output,
                        cache_read: p.cache_read.unwrap_or(p.input),
                        cache_write: p.cache_write.unwrap_or(p.input),
                    },
                ))
            })
            .collect()
    }

    /// Context windows the table sets, for the window table's overrides.
    pub fn windows(&self) -> BTreeMap<String, Window> {
        self.entries
            .iter()
            .filter_map(|e| {
                Some((
                    e.table_name().to_owned(),
                    Window {
                        context: e.context_window?,
                        max_output: e.output_limit()?,
                    },
                ))
            })
            .collect()
    }
}

/// The key held in `var`: the settings' own for the two well-known variables (so flags work
/// too), the process's starting environment for any other a models-table entry names (read
/// through [`crate::secrets::var`]: the live environment no longer holds secrets by then).
pub fn key(settings: &Settings, var: &str) -> Option<String> {
    let k = match var {
        "OPENAI_API_KEY" => settings.openai_api_key.clone(),
        "ANTHROPIC_API_KEY" => settings.anthropic_key().map(str::to_owned),
        other => crate::secrets::var(other),
    };
    k.filter(|k| !k.trim().is_empty())
}

/// The models table the settings describe (`SUBAGENTS_MODELS`, plus Anthropic for `claude-*`
/// when `ANTHROPIC_API_KEY` is set), or what is wrong with it.
pub fn routes_for(settings: &Settings) -> Result<ModelRoutes, String> {
    ModelRoutes::load(&settings.models, settings.anthropic_key().is_some())
        .map_err(|e| format!("SUBAGENTS_MODELS: {e}"))
}

/// Why runs here could not reach their model as configured, said before any run starts:
/// the default model's provider has no key (every call would be refused, each run failing
/// after its retries), or the models table is wrong. OpenAI-compatible endpoints other than
/// OpenAI's own may need no key (a local server, a gateway); nor does a loopback one.
pub fn key_problem(settings: &Settings) -> Option<String> {
    let routes = match routes_for(settings) {
        Ok(r) => r,
        Err(e) => return Some(e),
    };
    if let Some(var) = missing_key(settings, &routes, &settings.default_model) {
        return Some(format!(
            "no API key for {} (served by Anthropic per the models table): set {var}; `subagents demo` runs without one",
            settings.default_model,
        ));
    }
    if let Some(entry) = routes.route(&settings.default_model)
        && (entry.provider == Provider::Anthropic || entry.base_url.is_some())
    {
        return None;
    }
    let no_key = settings
        .openai_api_key
        .as_deref()
        .is_none_or(|k| k.trim().is_empty());
    let openai = reqwest::Url::parse(&settings.openai_base_url)
        .ok()
        .and_then(|u| u.host_str().map(str::to_ascii_lowercase))
        .is_some_and(|h| h.trim_end_matches('.') == "api.openai.com");
    (no_key && openai).then(|| {
        format!(
            "no API key for the model endpoint {} (model {}): set OPENAI_API_KEY, or OPENAI_BASE_URL to another OpenAI-compatible endpoint (one on this machine needs no key), or ANTHROPIC_API_KEY with a Claude model (SUBAGENTS_MODEL=claude-sonnet-4-5); `subagents demo` runs without either",
            settings.openai_base_url,
            settings.default_model
        )
    })
}

/// The variable holding the key `model`'s provider needs, when it is unset: Anthropic's API
/// always wants one (unless the entry points at this machine). An OpenAI-compatible entry may
/// need none (a gateway, a local server).
pub fn missing_key<'a>(
    settings: &Settings,
    routes: &'a ModelRoutes,
    model: &str,
) -> Option<&'a str> {
    let entry = routes.route(model)?;
    let local = entry
        .base_url
        .as_deref()
        .is_some_and(crate::config::is_loopback_url);
    (entry.provider == Provider::Anthropic && !local && key(settings, entry.key_env()).is_none())
        .then(|| entry.key_env())
}

/// A [`ChatModel`] that sends each request to the client of its model's entry, and the rest to
/// the default (OpenAI-compatible) client.
pub struct Router {
    routes: ModelRoutes,
    clients: Vec<Arc<dyn ChatModel>>,
    fallback: Arc<dyn ChatModel>,
}

impl Router {
    /// `clients[i]` serves `routes.entries()[i]`.
    pub fn new(
        routes: ModelRoutes,
        clients: Vec<Arc<dyn ChatModel>>,
        fallback: Arc<dyn ChatModel>,
    ) -> Router {
        assert_eq!(routes.entries.len(), clients.len(), "one client per entry");
        Router {
            routes,
            clients,
            fallback,
        }
    }
}

#[async_trait]
impl ChatModel for Router {
    async fn complete(
        &self,
        req: &ChatRequest,
        on_delta: DeltaSink<'_>,
    ) -> Result<ChatResponse, ModelError> {
        let client = self
            .routes
            .route(&req.model)
            .and_then(|e| {
                let i = self
                    .routes
                    .entries
                    .iter()
                    .position(|x| std::ptr::eq(x, e))?;
                self.clients.get(i)
            })
            .unwrap_or(&self.fallback);
        client.complete(req, on_delta).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_names_beat_prefixes_and_the_key_routes_claude() {
        let t = ModelRoutes::load(
            r#"[{"match": "claude-*", "provider": "openai", "base_url": "http://gw/v1"},
                {"match": "claude-haiku-*", "provider": "anthropic", "thinking_budget": 2048, "max_output": 8192},
                {"match": "claude-haiku-4-5-special", "provider": "openai"}]"#,
            true,
        )
        .unwrap();
        assert_eq!(t.provider("claude-sonnet-4-5"), Provider::OpenAi);
        assert_eq!(t.provider("claude-haiku-4-5"), Provider::Anthropic);
        assert_eq!(t.provider("claude-haiku-4-5-special"), Provider::OpenAi);
        assert_eq!(t.provider("gpt-4.1"), Provider::OpenAi);
        assert_eq!(
            t.entries().len(),
            3,
            "the table's claude-* wins over the default"
        );
        let by_key = ModelRoutes::load("", true).unwrap();
        assert_eq!(by_key.provider("claude-opus-4-5"), Provider::Anthropic);
        assert_eq!(
            by_key.route("claude-x").unwrap().key_env(),
            "ANTHROPIC_API_KEY"
        );
        assert_eq!(
            by_key.implied_aliases()[0],
            ("sonnet".to_owned(), "claude-sonnet-4-5".to_owned())
        );
        let none = ModelRoutes::load("", false).unwrap();
        assert_eq!(none.provider("claude-opus-4-5"), Provider::OpenAi);
        assert!(none.implied_aliases().is_empty());
    }

    #[test]
    fn prices_and_windows_feed_their_tables() {
        let t = ModelRoutes::parse(
            r#"{"models": [{"match": "mine-*", "provider": "anthropic", "context_window": 50000, "prices": {"input": 1, "output": 2, "cache_read": 0.1}}]}"#,
        )
        .unwrap();
        assert_eq!(
            t.prices(),
            vec![(
                "mine-".to_owned(),
                Price {
                    input: 1.0,
                    output: 2.0,
                    cache_read: 0.1,
                    cache_write: 1.0
                }
            )]
        );
        assert_eq!(t.windows()["mine-"].context, 50000);
    }

    #[test]
    fn a_wrong_table_says_what_is_wrong() {
        for (bad, says) in [
            (
                r#"[{"match": "x", "provider": "gemini"}]"#,
                "unknown variant",
            ),
            (
                r#"[{"match": "x", "provider": "openai", "key": "sk-1"}]"#,
                "unknown field",
            ),
            (r#"[{"match": "*", "provider": "openai"}]"#, "prefix"),
            (r#"[{"match": "a*b*", "provider": "openai"}]"#, "prefix"),
            (
                r#"[{"match": "x", "provider": "openai", "base_url": "nope"}]"#,
                "not a URL",
            ),
            (
                r#"[{"match": "x", "provider": "anthropic", "thinking_budget": 9000, "max_output": 8000}]"#,
                "below max_output",
            ),
            (
                r#"[{"match": "x", "provider": "anthropic", "thinking_budget": 10}]"#,
                "at least 1024",
            ),
            (
                r#"[{"match": "x", "provider": "openai", "prices": {"input": -1, "output": 1}}]"#,
                "prices",
            ),
            ("/nonexistent/models.json", "cannot read"),
        ] {
            let e = ModelRoutes::load(bad, false).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
