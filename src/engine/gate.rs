//! The gate every tool call passes before it runs: PreToolUse hooks, then the permission rules
//! (the run's own, and every ancestor's: a child never gets more than its parent), then, for an
//! `ask`, a durable approval the run parks on. The decision commits before the call runs, keyed
//! by the call, so a replay after a crash never runs a hook or asks again for a decided call.
//! A call no hook sees and the rules simply allow is not recorded: the same configuration
//! allows it again on a replay.
//! After the call, PostToolUse (or PostToolUseFailure) hooks may add to its result.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};

use super::attempt::Attempt;
use super::{Engine, Flow};
use crate::agents::AgentDef;
use crate::delegation::Wait;
use crate::domain::event;
use crate::domain::{ApprovalStatus, Event, NewApproval, RunRecord};
use crate::hooks::{self, HookDecision};
use crate::ids::ApprovalId;
use crate::model::ToolCall;
use crate::permissions::{self, Verdict};
use crate::policy::{HookEvent, Policy};
use crate::store::NewEvent;

/// Policy settings that do not vary per run.
#[derive(Clone, Debug)]
pub struct PolicySettings {
    /// The operator's settings file: hooks and rules for every run (each run under the version
    /// it pinned).
    pub settings: Arc<crate::pinning::Settings>,
    /// How long an approval waits when neither the agent nor the settings file says.
    pub approval_timeout: Duration,
    /// For http hooks.
    pub http: reqwest::Client,
    /// Where command hooks run (`SUBAGENTS_HOOK_CWD`); `None`: the owner's workspace.
    pub hook_cwd: Option<std::path::PathBuf>,
    /// Variables of the worker's environment that command hooks get (`SUBAGENTS_HOOK_ENV`).
    pub hook_env_pass: Vec<String>,
}

impl Default for PolicySettings {
    fn default() -> Self {
        Self {
            settings: Arc::default(),
            approval_timeout: Duration::from_secs(86_400),
            http: reqwest::Client::new(),
            hook_cwd: None,
            hook_env_pass: vec![],
        }
    }
}

impl PolicySettings {
    /// Where and with what a command hook of a run in `workspace` runs.
    pub fn hook_env(&self, workspace: &Path) -> hooks::HookEnv {
        hooks::HookEnv::new(workspace, self.hook_cwd.as_deref(), &self.hook_env_pass)
    }
}

/// What the gate lets a call do.
pub(super) enum Gate {
    /// Run it with these arguments (a hook or an approver may have rewritten them); `context`
    /// is added to its result for the model.
    Run {
        arguments: String,
        context: Vec<String>,
    },
    /// Do not run it; the model gets this text as its result.
    Refuse(String),
    /// Wait for a person: park on this.
    Park(Wait),
}

/// The verdict a committed decision (`sa_tool_decisions`) records. Read back, anything else
/// (missing, misspelt, from a newer build) is no verdict at all, and the call is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
enum Decided {
    /// Run the call.
    Allow,
    /// Refused by a rule, a mode or a hook's deny.
    Deny,
    /// A person decides: the decision names its approval.
    Ask,
    /// A hook blocked it.
    Blocked,
}

impl Decided {
    fn read(decision: &Value) -> Option<Decided> {
        serde_json::from_value(decision.get("verdict")?.clone()).ok()
    }
}

/// Tools that manage children already started: they pass without a decision.
const UNGATED: &[&str] = &[
    "subagent_status",
    "subagent_events",
    "subagent_await",
    "subagent_cancel",
];

impl Engine {
    fn hook_configs<'a>(
        settings: &'a Policy,
        agent: &'a AgentDef,
    ) -> [&'a crate::policy::HookConfig; 2] {
        [&settings.hooks, &agent.policy.hooks]
    }

    /// Decides whether `call` runs (see the module doc).
    pub(super) async fn gate(
        &self,
        a: &Attempt<'_>,
        step: u32,
        call: &ToolCall,
        key: &str,
    ) -> Flow<Gate> {
        let tool = call.function.name.as_str();
        let as_asked = || Gate::Run {
            arguments: call.function.arguments.clone(),
            context: vec![],
        };
        if UNGATED.contains(&tool) {
            return Ok(as_asked());
        }
        let input: Value =
            serde_json::from_str(&call.function.arguments).unwrap_or_else(|_| json!({}));
        let configs = Self::hook_configs(&a.settings, &a.agent);
        let pre = hooks::matching(&configs, HookEvent::PreToolUse, Some(tool));
        let chain = self.rule_chain(a.run, &a.settings).await?;
        // No hook to ask and the rules allow it: configuration alone decides, the same way on
        // a replay, so there is nothing to look up or commit (a read and a commit per call
        // saved). A call that an approver answered is asked again by these rules, so it still
        // finds its committed answer below.
        if pre.is_empty() && matches!(chain.verdict(tool, &input, &a.workspace), Verdict::Allow) {
            return Ok(as_asked());
        }
        if let Some(decided) = self.store.tool_decision(key).await? {
            return self.apply(&decided, call, &chain, &a.workspace).await;
        }
        let outcome = if pre.is_empty() {
            hooks::Outcome::default()
        } else {
            let extra = json!({"tool_name": hooks::claude_name(tool), "subagents_tool": tool, "tool_use_id": call.id, "tool_input": input});
            let payload = hooks::input(HookEvent::PreToolUse, a.run, &a.workspace, extra);
            let env = self.settings.policy.hook_env(&a.workspace);
            hooks::run(&pre, payload, &env, &self.settings.policy.http).await
        };
        let used = outcome.updated_input.clone().unwrap_or(input);
        let (verdict, by) = self.verdict(a, tool, &used, &outcome, &chain).await?;
        let decision = self
            .record(a, step, call, key, &used, outcome, verdict, by, &chain)
            .await?;
        self.apply(&decision, call, &chain, &a.workspace).await
    }

    /// The verdict on a call that runs with `used`, and who gave it. The rules see the input
    /// the call would run with (a hook may have rewritten it), and a hook may settle what they
    /// ask, never what they deny: its `allow` cannot lift a deny of the agent's own rules, the
    /// settings file or any ancestor's. `None`: a hook blocked it. An ask an earlier approval
    /// granted for the run's tree is allowed.
    async fn verdict(
        &self,
        a: &Attempt<'_>,
        tool: &str,
        used: &Value,
        outcome: &hooks::Outcome,
        chain: &RuleChain,
    ) -> Flow<(Option<Verdict>, &'static str)> {
        let rules = chain.verdict(tool, used, &a.workspace);
        Ok(match (&outcome.blocked, &outcome.decision, rules) {
            (Some(_), _, _) => (None, "hook"),
            (None, Some((HookDecision::Deny, r)), _) => (Some(Verdict::Deny(r.clone())), "hook"),
            (None, _, Verdict::Deny(r)) => (Some(Verdict::Deny(r)), "rules"),
            (None, Some((HookDecision::Ask, r)), _) => (Some(Verdict::Ask(r.clone())), "hook"),
            (None, Some((HookDecision::Allow, _)), _) => (Some(Verdict::Allow), "hook"),
            (None, None, Verdict::Ask(r)) => {
                let root = a.run.tree.root_run_id.unwrap_or(a.run.id);
                let scope = chain.grant_scope(tool, used);
                if self.store.has_grant(root, &scope).await? {
                    (Some(Verdict::Allow), "grant")
                } else {
                    (Some(Verdict::Ask(r)), "rules")
                }
            }
            (None, None, v) => (Some(v), "rules"),
        })
    }

    /// Commits the decision on a call, keyed by it, with its event and, for an ask, the
    /// approval it waits on. Returns the decision as committed.
    #[allow(clippy::too_many_arguments)]
    async fn record(
        &self,
        a: &Attempt<'_>,
        step: u32,
        call: &ToolCall,
        key: &str,
        used: &Value,
        outcome: hooks::Outcome,
        verdict: Option<Verdict>,
        by: &str,
        chain: &RuleChain,
    ) -> Flow<Value> {
        let tool = call.function.name.as_str();
        let mut decision = json!({"call_id": call.id, "tool": tool, "by": by});
        if let Some(u) = &outcome.updated_input {
            decision["updated_input"] = u.clone();
        }
        if !outcome.additional_context.is_empty() {
            decision["context"] = json!(outcome.additional_context);
        }
        let mut approval = None;
        let (decided, reason, event) = match verdict {
            None => {
                metrics::counter!("subagents_hook_blocks_total").increment(1);
                let reason = outcome.blocked.unwrap_or_default();
                let e = Event::HookBlocked(event::HookBlocked {
                    step,
                    call_id: call.id.clone(),
                    tool: tool.to_owned(),
                    reason: reason.clone(),
                });
                (Decided::Blocked, Some(reason), Some(e))
            }
            Some(Verdict::Allow) => (Decided::Allow, None, None),
            Some(Verdict::Deny(reason)) => {
                metrics::counter!("subagents_permission_denials_total").increment(1);
                let e = Event::ToolDenied(event::ToolDenied {
                    step,
                    call_id: call.id.clone(),
                    tool: tool.to_owned(),
                    reason: reason.clone(),
                    by: by.to_owned(),
                });
                (Decided::Deny, Some(reason), Some(e))
            }
            Some(Verdict::Ask(reason)) => {
                let (new, e) = self.approval_for(a, step, call, used, &reason, by, chain);
                decision["approval_id"] = json!(new.id);
                approval = Some(new);
                (Decided::Ask, Some(reason), Some(e))
            }
        };
        decision["verdict"] = json!(decided);
        if let Some(r) = reason {
            decision["reason"] = json!(r);
        }
        tracing::info!(tool, verdict = %decision["verdict"], by, "tool call decided");
        let events: Vec<NewEvent> = event.into_iter().map(NewEvent::from).collect();
        self.store
            .commit_decision(a.lease, key, decision.clone(), approval, events)
            .await?;
        Ok(decision)
    }

    /// The approval an ask waits on, and its `approval.requested` event; it expires after the
    /// agent's approval timeout, else the settings file's, else the process's.
    #[allow(clippy::too_many_arguments)]
    fn approval_for(
        &self,
        a: &Attempt<'_>,
        step: u32,
        call: &ToolCall,
        used: &Value,
        reason: &str,
        by: &str,
        chain: &RuleChain,
    ) -> (NewApproval, Event) {
        let tool = call.function.name.as_str();
        let id = ApprovalId::generate();
        let timeout = a
            .agent
            .policy
            .approval_timeout
            .or(a.settings.approval_timeout)
            .unwrap_or(self.settings.policy.approval_timeout);
        let expires_at = chrono::Utc::now()
            .timestamp_millis()
            .saturating_add(timeout.as_millis().min(i64::MAX as u128) as i64);
        metrics::counter!("subagents_approvals_requested_total").increment(1);
        let event = Event::ApprovalRequested(event::ApprovalRequested {
            step,
            call_id: call.id.clone(),
            approval_id: id.clone(),
            tool: tool.to_owned(),
            input: used.clone(),
            reason: reason.to_owned(),
            by: by.to_owned(),
            expires_at,
            answerable_by: a.run.owner.clone(),
        });
        let approval = NewApproval {
            id,
            tool: tool.to_owned(),
            input: used.clone(),
            reason: reason.to_owned(),
            expires_at,
            grant_scope: chain.grant_scope(tool, used),
        };
        (approval, event)
    }

    /// What a committed decision means now (an approval may have been answered since). Only a
    /// verdict it names runs the call: anything else, missing or misspelt, refuses it. An
    /// approver's rewritten input meets the deny rules again.
    async fn apply(
        &self,
        d: &Value,
        call: &ToolCall,
        chain: &RuleChain,
        workspace: &Path,
    ) -> Flow<Gate> {
        let context: Vec<String> = d["context"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|c| c.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        let arguments = |updated: Option<&Value>| {
            updated
                .filter(|u| u.is_object())
                .map(|u| u.to_string())
                .unwrap_or_else(|| call.function.arguments.clone())
        };
        let reason = d["reason"].as_str().unwrap_or("").to_owned();
        Ok(match Decided::read(d) {
            Some(Decided::Allow) => Gate::Run {
                arguments: arguments(d.get("updated_input")),
                context,
            },
            Some(Decided::Blocked) => Gate::Refuse(format!("error[blocked_by_hook]: {reason}")),
            Some(Decided::Deny) => Gate::Refuse(format!(
                "error[permission_denied]: {reason}; this call was not run. Do not repeat it: continue without it or answer."
            )),
            Some(Decided::Ask) => {
                let id = ApprovalId::from(d["approval_id"].as_str().unwrap_or(""));
                let Some(mut a) = self.store.approval(&id).await? else {
                    return Ok(Gate::Refuse(format!(
                        "error[permission_denied]: the approval {id} for this call is gone"
                    )));
                };
                if a.status == ApprovalStatus::Pending
                    && chrono::Utc::now().timestamp_millis() >= a.expires_at
                {
                    self.store.expire_approval(&id).await?;
                    a = self.store.approval(&id).await?.unwrap_or(a);
                }
                match a.status {
                    ApprovalStatus::Pending => Gate::Park(Wait { approvals: vec![a.id.clone()], wake_at: Some(a.expires_at), ..Default::default() }),
                    ApprovalStatus::Allowed => {
                        let updated = a.updated_input.as_ref().or(d.get("updated_input")).filter(|u| u.is_object());
                        if let Some(u) = a.updated_input.as_ref().filter(|u| u.is_object())
                            && let Verdict::Deny(why) = chain.verdict(&call.function.name, u, workspace)
                        {
                            return Ok(Gate::Refuse(format!("error[permission_denied]: the approved call was rewritten into one the rules deny ({why}); it was not run.")));
                        }
                        Gate::Run { arguments: arguments(updated), context }
                    }
                    ApprovalStatus::Denied => Gate::Refuse(format!(
                        "error[permission_denied]: a person denied this call{}; it was not run. Do not repeat it.",
                        a.answer_reason.map(|r| format!(": {r}")).unwrap_or_default()
                    )),
                    ApprovalStatus::Expired => Gate::Refuse("error[approval_expired]: nobody approved this call in time; it was not run. Continue without it or answer.".into()),
                }
            }
            None => {
                tracing::error!(verdict = %d["verdict"], "a committed tool decision names no verdict this build knows; refusing the call");
                Gate::Refuse("error[permission_denied]: the decision recorded for this call cannot be read; it was not run.".into())
            }
        })
    }

    /// The rule sources this run answers to: its agent's, then every ancestor's agent's, each
    /// with the settings file (a child never gets more than its parent).
    /// Each run's agent is the version that run pinned, so an edited or deleted file changes
    /// no rule a running tree answers to.
    pub(super) async fn rule_chain(
        &self,
        run: &RunRecord,
        settings: &Arc<Policy>,
    ) -> Flow<RuleChain> {
        let store = self.store.as_ref();
        let mut defs = vec![self.agents.for_run(store, run).await?];
        let mut parent = run.parent_run_id;
        while let Some(id) = parent {
            let Some(p) = self.store.get_run(id).await? else {
                break;
            };
            defs.push(self.agents.for_run(store, &p).await?);
            parent = p.parent_run_id;
        }
        Ok(RuleChain {
            settings: settings.clone(),
            defs,
        })
    }

    /// PostToolUse (or PostToolUseFailure) hooks on a finished call: their feedback and context
    /// are added to the result the model sees.
    pub(super) async fn after_tool(
        &self,
        a: &Attempt<'_>,
        call: &ToolCall,
        arguments: &str,
        text: String,
        ok: bool,
    ) -> String {
        let (run, agent, workspace) = (a.run, &a.agent, a.workspace.as_path());
        let tool = call.function.name.as_str();
        let event = if ok {
            HookEvent::PostToolUse
        } else {
            HookEvent::PostToolUseFailure
        };
        let configs = Self::hook_configs(&a.settings, agent);
        let post = hooks::matching(&configs, event, Some(tool));
        if post.is_empty() {
            return text;
        }
        let input: Value = serde_json::from_str(arguments).unwrap_or_else(|_| json!({}));
        let response = if ok {
            json!({"tool_response": text})
        } else {
            json!({"error": text})
        };
        let mut extra = json!({"tool_name": hooks::claude_name(tool), "subagents_tool": tool, "tool_use_id": call.id, "tool_input": input});
        if let (Value::Object(o), Value::Object(r)) = (&mut extra, response) {
            o.extend(r);
        }
        let outcome = hooks::run(
            &post,
            hooks::input(event, run, workspace, extra),
            &self.settings.policy.hook_env(workspace),
            &self.settings.policy.http,
        )
        .await;
        let mut text = text;
        if let Some(reason) = outcome.blocked {
            metrics::counter!("subagents_hook_blocks_total").increment(1);
            text.push_str(&format!("\n[{} hook] {reason}", event.as_str()));
        }
        for c in outcome.additional_context {
            text.push_str(&format!("\n[hook context] {c}"));
        }
        text
    }

    /// Whether any hook answers `event` for this run: a commit that such a hook follows is
    /// awaited before it runs, never sent beside the next model call.
    pub(super) fn hooks_on(settings: &Policy, agent: &AgentDef, event: HookEvent) -> bool {
        !hooks::matching(&Self::hook_configs(settings, agent), event, None).is_empty()
    }

    /// Hooks of a run's lifecycle (RunStart, SubagentStart, Stop, SubagentStop, PreCompact):
    /// they observe, they cannot block; failures are logged.
    pub(super) async fn lifecycle_hooks(
        &self,
        run: &RunRecord,
        settings: &Policy,
        agent: &AgentDef,
        event: HookEvent,
        extra: Value,
    ) {
        let configs = Self::hook_configs(settings, agent);
        let list = hooks::matching(&configs, event, None);
        if list.is_empty() {
            return;
        }
        let workspace = crate::tools::owner_workspace(&self.settings.workspace, &run.owner);
        let outcome = hooks::run(
            &list,
            hooks::input(event, run, &workspace, extra),
            &self.settings.policy.hook_env(&workspace),
            &self.settings.policy.http,
        )
        .await;
        if outcome.blocked.is_some() {
            tracing::info!(
                event = event.as_str(),
                "a lifecycle hook asked to block; lifecycle hooks only observe"
            );
        }
    }
}

/// The rule sources a run answers to: the settings file with its own agent, then with each
/// ancestor's agent, nearest first.
#[derive(Clone)]
pub(super) struct RuleChain {
    settings: Arc<Policy>,
    /// The run's agent, then its ancestors', as each run pinned it (`None`: a definition
    /// neither the files nor the store know any more).
    defs: Vec<Option<Arc<AgentDef>>>,
}

impl RuleChain {
    /// The run's ancestors' agents, nearest first.
    pub(super) fn ancestors(&self) -> impl Iterator<Item = &AgentDef> {
        self.defs.iter().skip(1).flatten().map(|a| a.as_ref())
    }

    /// Every source agent, with its place (0: the run's own).
    fn sources(&self) -> impl Iterator<Item = (usize, &AgentDef)> {
        self.defs
            .iter()
            .enumerate()
            .filter_map(|(i, a)| a.as_deref().map(|a| (i, a)))
    }

    /// Whether any source has a rule that names a path: only then is a path worth resolving
    /// through the workspace's links.
    fn names_paths(&self) -> bool {
        let has = |r: &crate::policy::Rules| {
            [&r.allow, &r.deny, &r.ask]
                .iter()
                .any(|l| l.iter().any(|x| x.specifier.is_some()))
        };
        has(&self.settings.rules) || self.sources().any(|(_, a)| has(&a.policy.rules))
    }

    /// The strictest verdict of every source on `tool` called with `input`.
    pub(super) fn verdict(&self, tool: &str, input: &Value, workspace: &Path) -> Verdict {
        let call = permissions::Call::new(tool, input, self.names_paths().then_some(workspace));
        self.verdict_of(&call)
    }

    fn verdict_of(&self, call: &permissions::Call) -> Verdict {
        let settings = &self.settings.rules;
        let mut verdict: Option<Verdict> = None;
        for (i, a) in self.sources() {
            let v = match permissions::evaluate(&[settings, &a.policy.rules], call) {
                Verdict::Deny(r) if i > 0 => Verdict::Deny(format!(
                    "{r} (for the parent agent `{}`: a subagent never gets more than its parent)",
                    a.name
                )),
                v => v,
            };
            verdict = Some(match verdict {
                None => v,
                Some(acc) => acc.stricter(v),
            });
        }
        verdict.unwrap_or_else(|| permissions::evaluate(&[settings], call))
    }

    /// What a `run_tree` grant of an ask on this call covers.
    fn grant_scope(&self, tool: &str, input: &Value) -> String {
        let call = permissions::Call::new(tool, input, None);
        let mut sources: Vec<&crate::policy::Rules> = vec![&self.settings.rules];
        sources.extend(self.sources().map(|(_, a)| &a.policy.rules));
        permissions::grant_scope(&sources, &call)
    }

    /// Which files a search may show: those `read_file` would be allowed to read.
    pub(super) fn readable(&self) -> crate::tools::Readable {
        let chain = self.clone();
        crate::tools::Readable(Arc::new(move |path: &str| {
            let input = json!({"path": path});
            matches!(
                chain.verdict_of(&permissions::Call::new("read_file", &input, None)),
                Verdict::Allow
            )
        }))
    }
}
