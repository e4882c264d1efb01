//! Permission rules evaluated on a tool call, in Claude Code's order: deny, then ask, then
//! allow, then the permission mode for what no rule matched (hooks come before all of these; see
//! [`crate::hooks`]). Rules name tools as Claude Code does (`Bash`, `Read`, `Edit`, `WebFetch`,
//! `Task`, `mcp__server__tool`) or by our names; `Read(…)` covers every reading tool and
//! `Edit(…)` every editing tool, as in Claude Code.
//!
//! Specifiers: `Bash(git status:*)` is a command prefix, `Bash(npm test)` an exact command;
//! `Read(./docs/**)` / `Edit(src/**)` are gitignore-style globs over the workspace-relative path;
//! `WebFetch(domain:example.com)` is a host and its subdomains; `Task(researcher)` a subagent.

use globset::GlobBuilder;
use serde_json::Value;

use crate::policy::{Mode, Rule, Rules};

/// What the rules say about a call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Run it.
    Allow,
    /// Do not run it; the model is told why.
    Deny(String),
    /// A person decides (the run parks on an approval).
    Ask(String),
}

impl Verdict {
    fn severity(&self) -> u8 {
        match self {
            Verdict::Allow => 0,
            Verdict::Ask(_) => 1,
            Verdict::Deny(_) => 2,
        }
    }

    /// The stricter of two verdicts (deny over ask over allow); the first on a tie.
    pub fn stricter(self, other: Verdict) -> Verdict {
        if other.severity() > self.severity() { other } else { self }
    }
}

/// Tools that only read (free in `default` and `plan` mode).
pub const READ_ONLY: &[&str] = &["read_file", "grep", "glob", "list_dir", "todo_write", "echo", "subagent_status", "subagent_events", "subagent_await"];
/// Tools that edit files in the workspace (free in `acceptEdits` mode).
pub const EDITS: &[&str] = &["write_file", "edit_file", "multi_edit"];

/// The tools (our names) a rule's tool part covers.
fn covers(rule_tool: &str, tool: &str) -> bool {
    match rule_tool {
        "*" => true,
        "Read" => ["read_file", "grep", "glob", "list_dir"].contains(&tool),
        "Edit" => EDITS.contains(&tool),
        "Task" | "Agent" | "task" => tool == "task" || tool == "subagent_start",
        t if t.starts_with("mcp__") => tool == t || tool.starts_with(&format!("{t}__")),
        t => match crate::tools::lookup(t) {
            crate::tools::Named::Tool(ours) => ours == tool,
            _ => t == tool,
        },
    }
}

/// The path a file tool acts on, workspace-relative, without `./`.
fn call_path(input: &Value) -> String {
    let p = input.get("path").and_then(Value::as_str).unwrap_or(".");
    let p = p.trim_start_matches("./");
    if p.is_empty() { ".".into() } else { p.to_owned() }
}

fn matches(rule: &Rule, tool: &str, input: &Value) -> bool {
    if !covers(&rule.tool, tool) {
        return false;
    }
    let Some(spec) = rule.specifier.as_deref() else { return true };
    match tool {
        "bash" => {
            let cmd = input.get("command").and_then(Value::as_str).unwrap_or("").trim();
            match spec.strip_suffix(":*") {
                Some(prefix) => cmd == prefix || cmd.starts_with(&format!("{prefix} ")),
                None => cmd == spec,
            }
        }
        "web_fetch" => {
            let url = input.get("url").and_then(Value::as_str).unwrap_or("");
            match spec.strip_prefix("domain:") {
                Some(domain) => reqwest::Url::parse(url).ok().and_then(|u| u.host_str().map(str::to_ascii_lowercase)).is_some_and(|h| {
                    let d = domain.to_ascii_lowercase();
                    h == d || h.ends_with(&format!(".{d}"))
                }),
                None => url.starts_with(spec),
            }
        }
        "task" | "subagent_start" => input.get("subagent").and_then(Value::as_str) == Some(spec),
        t if covers("Read", t) || covers("Edit", t) => {
            // `./x`, `x` and `/x` are all workspace-relative here (the workspace is the root).
            let pattern = spec.trim_start_matches("./").trim_start_matches('/');
            let path = call_path(input);
            GlobBuilder::new(pattern)
                .literal_separator(true)
                .build()
                .map(|g| {
                    let m = g.compile_matcher();
                    m.is_match(&path) || (pattern.ends_with("/**") && path == pattern.trim_end_matches("/**"))
                })
                .unwrap_or(false)
        }
        _ => {
            // Other tools: the specifier is compared with their string arguments.
            input.as_object().is_some_and(|o| {
                o.values().filter_map(Value::as_str).any(|v| match spec.strip_suffix(":*") {
                    Some(prefix) => v.starts_with(prefix),
                    None => v == spec,
                })
            })
        }
    }
}

/// Evaluates `tool` called with `input` against rule sources, most general first (the
/// settings file, then the agent): any deny wins, then any ask, then any allow, then the last
/// source's mode that sets one (`bypassPermissions` when none does, so a deployment without
/// rules runs as before).
pub fn evaluate(sources: &[&Rules], tool: &str, input: &Value) -> Verdict {
    let first = |pick: fn(&Rules) -> &Vec<Rule>| sources.iter().flat_map(|s| pick(s).iter()).find(|r| matches(r, tool, input));
    if let Some(r) = first(|s| &s.deny) {
        return Verdict::Deny(format!("denied by the rule `{}`", r.text));
    }
    if let Some(r) = first(|s| &s.ask) {
        return Verdict::Ask(format!("the rule `{}` asks for approval", r.text));
    }
    if first(|s| &s.allow).is_some() {
        return Verdict::Allow;
    }
    let mode = sources.iter().rev().find_map(|s| s.mode).unwrap_or(Mode::BypassPermissions);
    let read_only = READ_ONLY.contains(&tool);
    match mode {
        Mode::BypassPermissions => Verdict::Allow,
        Mode::Default if read_only => Verdict::Allow,
        Mode::Default => Verdict::Ask(format!("`{tool}` needs approval in default mode")),
        Mode::AcceptEdits if read_only || EDITS.contains(&tool) => Verdict::Allow,
        Mode::AcceptEdits => Verdict::Ask(format!("`{tool}` needs approval in acceptEdits mode")),
        Mode::Plan if read_only => Verdict::Allow,
        Mode::Plan => Verdict::Deny(format!("plan mode is read-only: `{tool}` is not allowed")),
        Mode::DontAsk => Verdict::Deny(format!("`{tool}` is not allowed by any rule (dontAsk mode)")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::parse_permissions;
    use serde_json::json;

    fn rules(v: Value) -> Rules {
        parse_permissions(&v).unwrap()
    }

    #[test]
    fn the_rule_syntax_on_a_table_of_cases() {
        let cases: Vec<(&str, &str, Value, bool)> = vec![
            ("Bash(git status:*)", "bash", json!({"command": "git status --short"}), true),
            ("Bash(git status:*)", "bash", json!({"command": "git status"}), true),
            ("Bash(git status:*)", "bash", json!({"command": "git statusx"}), false),
            ("Bash(git status:*)", "bash", json!({"command": "git push"}), false),
            ("Bash(npm test)", "bash", json!({"command": "npm test"}), true),
            ("Bash(npm test)", "bash", json!({"command": "npm test --watch"}), false),
            ("Bash", "bash", json!({"command": "anything"}), true),
            ("Read(./docs/**)", "read_file", json!({"path": "docs/a/b.md"}), true),
            ("Read(./docs/**)", "read_file", json!({"path": "./docs/x.md"}), true),
            ("Read(./docs/**)", "read_file", json!({"path": "src/main.rs"}), false),
            ("Read(./docs/**)", "grep", json!({"path": "docs"}), true),
            ("Read(*.md)", "read_file", json!({"path": "README.md"}), true),
            ("Read(*.md)", "read_file", json!({"path": "docs/README.md"}), false),
            ("Read", "list_dir", json!({}), true),
            ("Read", "write_file", json!({"path": "a"}), false),
            ("Edit(src/**)", "write_file", json!({"path": "src/lib.rs"}), true),
            ("Edit(src/**)", "multi_edit", json!({"path": "tests/a.rs"}), false),
            ("Write", "write_file", json!({"path": "x"}), true),
            ("WebFetch(domain:example.com)", "web_fetch", json!({"url": "https://docs.example.com/a"}), true),
            ("WebFetch(domain:example.com)", "web_fetch", json!({"url": "https://example.com.evil.io/"}), false),
            ("WebFetch", "web_fetch", json!({"url": "http://x"}), true),
            ("Task(researcher)", "task", json!({"subagent": "researcher"}), true),
            ("Task(researcher)", "subagent_start", json!({"subagent": "reviewer"}), false),
            ("mcp__github", "mcp__github__create_issue", json!({}), true),
            ("mcp__github__create_issue", "mcp__github__create_issue", json!({}), true),
            ("mcp__github", "mcp__gitlab__x", json!({}), false),
            ("echo(hi)", "echo", json!({"text": "hi"}), true),
            ("*", "bash", json!({"command": "x"}), true),
        ];
        for (rule, tool, input, want) in cases {
            let r = Rule::parse(rule).unwrap();
            assert_eq!(matches(&r, tool, &input), want, "{rule} on {tool} {input}");
        }
    }

    #[test]
    fn deny_beats_ask_beats_allow_beats_the_mode() {
        let settings = rules(json!({"allow": ["Bash(git:*)"], "ask": ["Bash(git push:*)"], "deny": ["Bash(git push --force:*)"]}));
        let s = [&settings];
        let git = |c: &str| json!({"command": c});
        assert_eq!(evaluate(&s, "bash", &git("git log")), Verdict::Allow);
        assert!(matches!(evaluate(&s, "bash", &git("git push origin")), Verdict::Ask(_)));
        assert!(matches!(evaluate(&s, "bash", &git("git push --force x")), Verdict::Deny(_)));
        // Nothing matched: the mode decides; none set runs as before (everything allowed).
        assert_eq!(evaluate(&s, "bash", &git("ls")), Verdict::Allow);
        let agent = rules(json!({"defaultMode": "default"}));
        let s = [&settings, &agent];
        assert!(matches!(evaluate(&s, "bash", &git("ls")), Verdict::Ask(_)));
        assert_eq!(evaluate(&s, "read_file", &json!({"path": "a"})), Verdict::Allow);
        for (mode, tool, want) in [
            ("acceptEdits", "write_file", 0),
            ("acceptEdits", "web_fetch", 1),
            ("plan", "read_file", 0),
            ("plan", "edit_file", 2),
            ("dontAsk", "bash", 2),
            ("bypassPermissions", "bash", 0),
        ] {
            let r = rules(json!({ "defaultMode": mode }));
            assert_eq!(evaluate(&[&r], tool, &json!({})).severity(), want, "{mode} {tool}");
        }
    }

    #[test]
    fn the_stricter_verdict_wins() {
        assert!(matches!(Verdict::Allow.stricter(Verdict::Ask("a".into())), Verdict::Ask(_)));
        assert!(matches!(Verdict::Deny("d".into()).stricter(Verdict::Ask("a".into())), Verdict::Deny(_)));
        assert_eq!(Verdict::Allow.stricter(Verdict::Allow), Verdict::Allow);
    }
}
