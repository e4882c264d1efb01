//! What operators and agent files say about tool use, as data: hooks (Claude Code's shape: event
//! → `[{matcher, hooks: [{type, command|url, timeout}]}]`) and permission rules (Claude Code's
//! `permissions: {allow, deny, ask, defaultMode}` with rules such as `Bash(git status:*)`,
//! `Read(./docs/**)`, `WebFetch(domain:example.com)`). Parsing lives here, at the bottom, so
//! agent files and the settings file are checked when they load; evaluating rules
//! ([`crate::permissions`]) and running hooks ([`crate::hooks`]) live above the tools.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The hook events, as Claude Code names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum HookEvent {
    /// Before a tool call runs; may allow, deny, ask, rewrite the input, or block (exit 2).
    PreToolUse,
    /// After a tool call succeeded; may add context for the model or block with feedback.
    PostToolUse,
    /// After a tool call failed.
    PostToolUseFailure,
    /// A delegation call started a child run.
    SubagentStart,
    /// A child run reached its final answer.
    SubagentStop,
    /// A top-level run reached its final answer.
    Stop,
    /// A compaction step is about to summarise the context.
    PreCompact,
    /// A run starts (its first claim).
    RunStart,
}

impl HookEvent {
    /// Every event, for messages listing them.
    pub const ALL: [HookEvent; 8] = [
        HookEvent::PreToolUse,
        HookEvent::PostToolUse,
        HookEvent::PostToolUseFailure,
        HookEvent::SubagentStart,
        HookEvent::SubagentStop,
        HookEvent::Stop,
        HookEvent::PreCompact,
        HookEvent::RunStart,
    ];

    /// The name in settings files and in the hook's input.
    pub fn as_str(self) -> &'static str {
        match self {
            HookEvent::PreToolUse => "PreToolUse",
            HookEvent::PostToolUse => "PostToolUse",
            HookEvent::PostToolUseFailure => "PostToolUseFailure",
            HookEvent::SubagentStart => "SubagentStart",
            HookEvent::SubagentStop => "SubagentStop",
            HookEvent::Stop => "Stop",
            HookEvent::PreCompact => "PreCompact",
            HookEvent::RunStart => "RunStart",
        }
    }
}

/// How a hook is reached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HookKind {
    /// A shell command (`bash -c`), JSON on stdin.
    Command(String),
    /// An HTTP endpoint, the same JSON POSTed.
    Http(String),
}

/// One hook.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hook {
    /// Command or URL.
    pub kind: HookKind,
    /// Longest it may take (default 60 s, as Claude Code).
    pub timeout: Duration,
}

/// Hooks for one event whose matcher fits the tool name (`""`/`*`: every tool).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HookGroup {
    /// A regular expression over the tool name (ours or Claude Code's), anchored.
    pub matcher: String,
    /// The hooks to run, in order.
    pub hooks: Vec<Hook>,
}

/// Hooks by event.
pub type HookConfig = BTreeMap<HookEvent, Vec<HookGroup>>;

/// What a run may do without asking (Claude Code's `permissionMode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Mode {
    /// Reading is free; anything else asks.
    Default,
    /// Reading and editing files are free; anything else asks.
    AcceptEdits,
    /// Read-only: anything else is denied.
    Plan,
    /// Everything not denied or asked by a rule is allowed.
    BypassPermissions,
    /// Everything not allowed by a rule is denied; nothing asks.
    DontAsk,
}

impl Mode {
    /// Parses Claude Code's spelling.
    pub fn parse(s: &str) -> Result<Mode, String> {
        serde_json::from_value(Value::String(s.trim().to_owned()))
            .map_err(|_| format!("permission mode `{s}` is not one of default, acceptEdits, plan, bypassPermissions, dontAsk"))
    }
}

/// One permission rule: a tool name (ours or Claude Code's) and an optional specifier.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    /// As written, e.g. `Bash(git status:*)`.
    pub text: String,
    /// The tool part, e.g. `Bash`.
    pub tool: String,
    /// The part in parentheses, e.g. `git status:*`.
    pub specifier: Option<String>,
}

impl Rule {
    /// Parses `Tool` or `Tool(specifier)`.
    pub fn parse(text: &str) -> Result<Rule, String> {
        let t = text.trim();
        let (tool, specifier) = match t.split_once('(') {
            Some((tool, rest)) => {
                let spec = rest
                    .strip_suffix(')')
                    .ok_or_else(|| format!("rule `{t}` opens `(` without closing it"))?;
                (
                    tool.trim(),
                    Some(spec.trim().to_owned()).filter(|s| !s.is_empty() && s != "*"),
                )
            }
            None => (t, None),
        };
        if tool.is_empty()
            || !tool
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '*')
        {
            return Err(format!(
                "rule `{t}` does not start with a tool name (e.g. `Bash(git status:*)`, `Read(./docs/**)`, `WebFetch(domain:example.com)`)"
            ));
        }
        Ok(Rule {
            text: t.to_owned(),
            tool: tool.to_owned(),
            specifier,
        })
    }
}

/// Permission rules of one source (the settings file, or one agent).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rules {
    /// Allowed without asking.
    pub allow: Vec<Rule>,
    /// Never allowed.
    pub deny: Vec<Rule>,
    /// Asked (a person approves).
    pub ask: Vec<Rule>,
    /// What happens when no rule matches; `None` leaves it to the next source.
    pub mode: Option<Mode>,
}

impl Rules {
    /// Whether this source says anything.
    pub fn is_empty(&self) -> bool {
        self.allow.is_empty() && self.deny.is_empty() && self.ask.is_empty() && self.mode.is_none()
    }
}

/// Everything one source says: hooks and rules.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Policy {
    /// Hooks by event.
    pub hooks: HookConfig,
    /// Permission rules.
    pub rules: Rules,
    /// How long an approval waits before it counts as denied.
    pub approval_timeout: Option<Duration>,
}

/// Parses a `hooks` value (Claude Code's shape).
pub fn parse_hooks(v: &Value) -> Result<HookConfig, String> {
    let Value::Object(events) = v else {
        return Err("`hooks` must be an object of events, e.g. {\"PreToolUse\": [...]}".into());
    };
    let mut out = HookConfig::new();
    for (name, groups) in events {
        let event = HookEvent::ALL
            .into_iter()
            .find(|e| e.as_str() == name)
            .ok_or_else(|| {
                format!(
                    "unknown hook event `{name}`; known: {}",
                    HookEvent::ALL.map(HookEvent::as_str).join(", ")
                )
            })?;
        let Value::Array(groups) = groups else {
            return Err(format!("hooks.{name} must be a list of {{matcher, hooks}}"));
        };
        for g in groups {
            let matcher = g
                .get("matcher")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_owned();
            regex_for(&matcher).map_err(|e| {
                format!("hooks.{name}: matcher `{matcher}` is not a valid pattern: {e}")
            })?;
            let Some(Value::Array(hooks)) = g.get("hooks") else {
                return Err(format!("hooks.{name}: each entry needs a `hooks` list"));
            };
            let mut parsed = vec![];
            for h in hooks {
                let timeout = match h.get("timeout") {
                    None | Some(Value::Null) => Duration::from_secs(60),
                    Some(t) => t
                        .as_f64()
                        .filter(|t| *t > 0.0 && *t <= 3600.0)
                        .map(Duration::from_secs_f64)
                        .ok_or_else(|| {
                            format!("hooks.{name}: timeout must be seconds, 0 < t <= 3600")
                        })?,
                };
                let kind = match h.get("type").and_then(Value::as_str).unwrap_or("command") {
                    "command" => HookKind::Command(
                        h.get("command")
                            .and_then(Value::as_str)
                            .filter(|c| !c.trim().is_empty())
                            .ok_or_else(|| format!("hooks.{name}: a command hook needs `command`"))?
                            .to_owned(),
                    ),
                    "http" => {
                        let url = h
                            .get("url")
                            .and_then(Value::as_str)
                            .ok_or_else(|| format!("hooks.{name}: an http hook needs `url`"))?;
                        if !(url.starts_with("http://") || url.starts_with("https://")) {
                            return Err(format!("hooks.{name}: `{url}` is not an http(s) URL"));
                        }
                        HookKind::Http(url.to_owned())
                    }
                    other => {
                        return Err(format!(
                            "hooks.{name}: hook type `{other}` is not command or http"
                        ));
                    }
                };
                parsed.push(Hook { kind, timeout });
            }
            out.entry(event).or_default().push(HookGroup {
                matcher,
                hooks: parsed,
            });
        }
    }
    Ok(out)
}

/// The anchored regular expression of a matcher (`""` and `*` match everything).
pub fn regex_for(matcher: &str) -> Result<regex::Regex, regex::Error> {
    let m = matcher.trim();
    if m.is_empty() || m == "*" {
        return regex::Regex::new(".*");
    }
    regex::Regex::new(&format!("^(?:{m})$"))
}

/// Parses a `permissions` value: `{allow, deny, ask, defaultMode}` (lists of rules).
pub fn parse_permissions(v: &Value) -> Result<Rules, String> {
    let Value::Object(o) = v else {
        return Err("`permissions` must be an object with allow, deny, ask and defaultMode".into());
    };
    let list = |key: &str| -> Result<Vec<Rule>, String> {
        match o.get(key) {
            None | Some(Value::Null) => Ok(vec![]),
            Some(Value::Array(a)) => a
                .iter()
                .map(|r| {
                    r.as_str()
                        .ok_or_else(|| format!("permissions.{key} must hold strings"))
                        .and_then(Rule::parse)
                })
                .collect(),
            Some(_) => Err(format!("permissions.{key} must be a list of rules")),
        }
    };
    for k in o.keys() {
        if ![
            "allow",
            "deny",
            "ask",
            "defaultMode",
            "additionalDirectories",
        ]
        .contains(&k.as_str())
        {
            tracing::debug!(key = %k, "ignoring unknown permissions key");
        }
    }
    let mode = o
        .get("defaultMode")
        .and_then(Value::as_str)
        .map(Mode::parse)
        .transpose()?;
    Ok(Rules {
        allow: list("allow")?,
        deny: list("deny")?,
        ask: list("ask")?,
        mode,
    })
}

/// The operator's settings file (`SUBAGENTS_SETTINGS`, Claude Code's `settings.json` shape):
/// `hooks`, `permissions`, and `approvalTimeout` (seconds). A missing file is no policy.
pub fn load_settings(path: &Path) -> Result<Policy, String> {
    match read_settings_text(path)? {
        None => Ok(Policy::default()),
        Some(text) => parse_settings(&text).map_err(|e| format!("{}: {e}", path.display())),
    }
}

/// The settings file's text; `None` when there is no file.
pub fn read_settings_text(path: &Path) -> Result<Option<String>, String> {
    match std::fs::read_to_string(path) {
        Ok(t) => Ok(Some(t)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

/// A settings file's text, parsed.
pub fn parse_settings(text: &str) -> Result<Policy, String> {
    let v: Value = serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?;
    parse_policy(&v)
}

/// `hooks`, `permissions` and `approvalTimeout` out of one JSON object.
pub fn parse_policy(v: &Value) -> Result<Policy, String> {
    let hooks = v
        .get("hooks")
        .map(parse_hooks)
        .transpose()?
        .unwrap_or_default();
    let rules = v
        .get("permissions")
        .map(parse_permissions)
        .transpose()?
        .unwrap_or_default();
    let approval_timeout = match v.get("approvalTimeout") {
        None | Some(Value::Null) => None,
        Some(t) => Some(
            t.as_f64()
                .filter(|t| *t >= 1.0 && *t <= 30.0 * 86_400.0)
                .map(Duration::from_secs_f64)
                .ok_or("approvalTimeout must be seconds, 1 to 30 days")?,
        ),
    };
    Ok(Policy {
        hooks,
        rules,
        approval_timeout,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn claude_code_hook_settings_parse() {
        let v = json!({"PreToolUse": [{"matcher": "Bash|Edit", "hooks": [{"type": "command", "command": "./check.sh", "timeout": 5}]}],
                       "PostToolUse": [{"hooks": [{"type": "http", "url": "http://127.0.0.1:9/h"}]}]});
        let h = parse_hooks(&v).unwrap();
        assert_eq!(
            h[&HookEvent::PreToolUse][0].hooks[0],
            Hook {
                kind: HookKind::Command("./check.sh".into()),
                timeout: Duration::from_secs(5)
            }
        );
        assert_eq!(h[&HookEvent::PostToolUse][0].matcher, "");
        assert!(
            parse_hooks(&json!({"OnWhatever": []}))
                .unwrap_err()
                .contains("unknown hook event")
        );
        assert!(
            parse_hooks(&json!({"PreToolUse": [{"matcher": "(", "hooks": []}]}))
                .unwrap_err()
                .contains("not a valid pattern")
        );
        assert!(
            parse_hooks(&json!({"PreToolUse": [{"hooks": [{"type": "command"}]}]}))
                .unwrap_err()
                .contains("needs `command`")
        );
        assert!(
            regex_for("Bash").unwrap().is_match("Bash")
                && !regex_for("Bash").unwrap().is_match("BashX")
        );
        assert!(regex_for("").unwrap().is_match("anything"));
    }

    #[test]
    fn rules_and_modes_parse() {
        assert_eq!(
            Rule::parse("Bash(git status:*)").unwrap(),
            Rule {
                text: "Bash(git status:*)".into(),
                tool: "Bash".into(),
                specifier: Some("git status:*".into())
            }
        );
        assert_eq!(Rule::parse("Read").unwrap().specifier, None);
        assert_eq!(Rule::parse("WebFetch(*)").unwrap().specifier, None);
        assert!(Rule::parse("Bash(ls").is_err());
        assert!(Rule::parse("(ls)").is_err());
        let r = parse_permissions(&json!({"allow": ["Read"], "deny": ["Bash(rm:*)"], "ask": ["WebFetch"], "defaultMode": "acceptEdits"})).unwrap();
        assert_eq!(
            (r.allow.len(), r.deny.len(), r.ask.len(), r.mode),
            (1, 1, 1, Some(Mode::AcceptEdits))
        );
        assert!(
            parse_permissions(&json!({"defaultMode": "yolo"}))
                .unwrap_err()
                .contains("not one of")
        );
        assert!(parse_permissions(&json!({"allow": "Read"})).is_err());
    }

    #[test]
    fn a_missing_settings_file_is_no_policy() {
        assert_eq!(
            load_settings(Path::new("/nonexistent/subagents.json")).unwrap(),
            Policy::default()
        );
        let p = parse_policy(&json!({"approvalTimeout": 60, "permissions": {"deny": ["Bash"]}}))
            .unwrap();
        assert_eq!(p.approval_timeout, Some(Duration::from_secs(60)));
        assert!(parse_policy(&json!({"approvalTimeout": 0})).is_err());
    }
}
