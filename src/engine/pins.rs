//! What a run fixes at its first claim beyond its agent definition ([`crate::pinning`]): the
//! settings file's version (hooks, permission rules), its model and the model's provider, and
//! the tool list of each MCP server it may use. Each is a row of the run's pins, written once
//! (of two claims racing, the first write holds) and read back at every later claim, so a run
//! parked for hours wakes to what it started with, whatever the files and servers say now.
//!
//! A child takes its parent's settings version (a tree runs under one), and `model: inherit`
//! takes the parent's pinned model.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::{Engine, Flow};
use crate::agents::AgentDef;
use crate::domain::RunRecord;
use crate::model::ToolSpec;
use crate::policy::Policy;

/// The pin of the settings file's version.
const SETTINGS: &str = "settings";
/// The pin of the model.
const MODEL: &str = "model";
/// The pin of the model's provider (`openai` or `anthropic`, from the models table).
const PROVIDER: &str = "provider";
/// The prefix of an MCP server's pin (its tool list's version).
const MCP: &str = "mcp:";

/// What a claim runs under.
pub(super) struct Pinned {
    /// The settings file's hooks and rules, as the run pinned them.
    pub settings: Arc<Policy>,
    /// The model it calls.
    pub model: String,
    /// Each MCP server's tools as the run first saw them.
    pub menus: BTreeMap<String, Arc<Vec<ToolSpec>>>,
    /// The servers the run wants but has no list of yet, and why they could not be asked.
    pub unreachable: BTreeMap<String, String>,
    /// Pins chosen at a fresh start, to commit with the run's input.
    pub unwritten: Vec<(String, String)>,
}

/// The MCP servers an agent wants, each with the one tool it names (`None`: all of them): all
/// it can see when its file names no tools, else the servers and tools it names.
pub(super) fn mcp_wanted(agent: &AgentDef, visible: Vec<String>) -> Vec<(String, Option<String>)> {
    match &agent.tools {
        None => visible.into_iter().map(|s| (s, None)).collect(),
        Some(list) => list
            .iter()
            .filter_map(|t| crate::mcp::split(t.trim()))
            .map(|(s, t)| (s.to_owned(), t.map(str::to_owned)))
            .collect(),
    }
}

/// The cache of pinned MCP tool lists an engine keeps.
pub fn menus() -> crate::pinning::Texts<Vec<ToolSpec>> {
    crate::pinning::Texts::new("MCP tool list", |text| {
        serde_json::from_str(text).map_err(|e| e.to_string())
    })
}

impl Engine {
    /// The run's pins: read back, or chosen now for what it has none of yet. `fresh` (its
    /// input is not committed yet: nothing ran, nothing was pinned) chooses them all and leaves
    /// them in [`Pinned::unwritten`] to commit with the input, saving a write per run; else
    /// what was missing (a server unreachable before, a run from before pins) is written here.
    pub(super) async fn pinned(
        &self,
        run: &RunRecord,
        agent: &AgentDef,
        fresh: bool,
    ) -> Flow<Pinned> {
        let store = self.store.as_ref();
        let mut held = if fresh {
            BTreeMap::new()
        } else {
            store.run_pins(run.id).await?
        };
        let mut chosen: Vec<(String, String)> = vec![];
        let needs_parent = !held.contains_key(SETTINGS)
            || (!held.contains_key(MODEL) && is_inherit(agent.model.as_deref()));
        let parent = match run.parent_run_id {
            Some(p) if needs_parent => store.run_pins(p).await?,
            _ => BTreeMap::new(),
        };
        if !held.contains_key(SETTINGS) {
            let v = match parent.get(SETTINGS) {
                Some(v) => v.clone(),
                None => self.settings.policy.settings.pin(store).await?,
            };
            chosen.push((SETTINGS.into(), v));
        }
        if !held.contains_key(MODEL) {
            let model = self
                .model_for(run, agent, parent.get(MODEL).map(String::as_str))
                .await?;
            let provider = self.settings.routes.provider(&model).as_str();
            chosen.push((MODEL.into(), model));
            chosen.push((PROVIDER.into(), provider.into()));
        }
        let hub = &self.settings.mcp;
        let mut unreachable = BTreeMap::new();
        // A server named for several tools is asked once: the check below skips it after.
        for (server, _) in mcp_wanted(agent, hub.visible(&agent.name)) {
            let name = format!("{MCP}{server}");
            if held.contains_key(&name) || chosen.iter().any(|(n, _)| *n == name) {
                continue;
            }
            match hub.specs(&server, None, &run.owner).await {
                Ok(specs) => {
                    let text = serde_json::to_string(&specs).unwrap_or_else(|_| "[]".into());
                    let version = crate::agents::content_version(&text);
                    self.menus.pin(store, &version, &text).await?;
                    chosen.push((name, version));
                }
                Err(e) => {
                    tracing::warn!(server = %server, error = %e, "MCP server unavailable for this run");
                    unreachable.insert(server, e.to_string());
                }
            }
        }
        let mut unwritten = vec![];
        if fresh {
            held.extend(chosen.iter().cloned());
            unwritten = chosen;
        } else if !chosen.is_empty() {
            held.extend(store.pin_run(run.id, chosen).await?);
        }
        let mut p = self.interpret(run, held, unreachable).await?;
        p.unwritten = unwritten;
        Ok(p)
    }

    /// What the pinned values stand for.
    async fn interpret(
        &self,
        run: &RunRecord,
        held: BTreeMap<String, String>,
        unreachable: BTreeMap<String, String>,
    ) -> Flow<Pinned> {
        let store = self.store.as_ref();
        let version = held
            .get(SETTINGS)
            .map_or(crate::pinning::NO_SETTINGS, String::as_str);
        let settings = match self
            .settings
            .policy
            .settings
            .at_version(store, version)
            .await?
        {
            Some(p) => p,
            None => {
                tracing::warn!(run_id = %run.id, version, "the run's pinned settings version is unknown here; using the current settings file");
                self.settings.policy.settings.current().policy.clone()
            }
        };
        let mut menus = BTreeMap::new();
        for (name, version) in &held {
            let Some(server) = name.strip_prefix(MCP) else {
                continue;
            };
            match self.menus.at_version(store, version).await? {
                Some(list) => {
                    menus.insert(server.to_owned(), list);
                }
                None => {
                    tracing::warn!(run_id = %run.id, server, version, "the run's pinned MCP tool list is unknown here; the server offers nothing to it");
                }
            }
        }
        Ok(Pinned {
            settings,
            model: held
                .get(MODEL)
                .cloned()
                .unwrap_or_else(|| self.settings.default_model.clone()),
            menus,
            unreachable,
            unwritten: vec![],
        })
    }
}

fn is_inherit(model: Option<&str>) -> bool {
    model.map(str::trim) == Some("inherit")
}
