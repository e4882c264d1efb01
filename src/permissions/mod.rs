//! Permission rules evaluated on a tool call, in Claude Code's order: deny, then ask, then
//! allow, then the permission mode for what no rule matched (hooks come before all of these; see
//! [`crate::hooks`]). Rules name tools as Claude Code does (`Bash`, `Read`, `Edit`, `WebFetch`,
//! `Task`, `mcp__server__tool`) or by our names; `Read(…)` covers every reading tool and
//! `Edit(…)` every editing tool, as in Claude Code.
//!
//! Specifiers: `Bash(git status:*)` is a command prefix, `Bash(npm test)` an exact command;
//! `Read(./docs/**)` / `Edit(src/**)` are gitignore-style globs over the workspace-relative path;
//! `WebFetch(domain:example.com)` is a host and its subdomains, `WebFetch(https://docs.rs/)` a
//! URL prefix; `Task(researcher)` a subagent.
//!
//! A call is looked at as it will run ([`Call`]): a `bash` command as the simple commands it is
//! made of ([`shell`]), a path as the file tool will open it (normalised, and resolved through
//! links inside the workspace), a URL parsed. An allow rule must vouch for every part of a
//! call; a deny or ask rule needs to touch only one. Deny rules on `bash` are a best effort, not
//! a boundary (a shell can spell any command another way): deny by allowing less.

pub mod shell;

use std::collections::HashMap;
use std::path::{Component, Path};
use std::sync::{LazyLock, Mutex};

use globset::GlobBuilder;
use serde_json::Value;
use sha2::{Digest, Sha256};

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
        if other.severity() > self.severity() {
            other
        } else {
            self
        }
    }
}

/// Tools that only read (free in `default` and `plan` mode).
pub const READ_ONLY: &[&str] = &[
    "read_file",
    "grep",
    "glob",
    "list_dir",
    "todo_write",
    "echo",
    "subagent_status",
    "subagent_events",
    "subagent_await",
];
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

/// Whether a rule's tool part names a tool this build knows (`*`, ours, Claude Code's, the
/// delegation tools, or an MCP server of `mcp_servers`). A rule that names none can never match:
/// it is worth a warning at load.
pub fn names_a_tool(rule_tool: &str, mcp_servers: &[&str]) -> bool {
    match rule_tool {
        "*" | "Read" | "Edit" | "Task" | "Agent" | "task" => true,
        t if t.starts_with("mcp__") => {
            crate::mcp::split(t).is_some_and(|(server, _)| mcp_servers.contains(&server))
        }
        t => !matches!(crate::tools::lookup(t), crate::tools::Named::Unavailable(_)),
    }
}

/// The rules of `rules` whose tool part names no tool this build knows (see
/// [`names_a_tool`]): they can never match, which for a deny rule is a hole, so they are
/// reported when the rules load.
pub fn unknown_tools(rules: &Rules, mcp_servers: &[&str]) -> Vec<String> {
    [&rules.allow, &rules.deny, &rules.ask]
        .into_iter()
        .flatten()
        .filter(|r| !names_a_tool(&r.tool, mcp_servers))
        .map(|r| r.text.clone())
        .collect()
}

/// A tool call as the rules see it: for `bash`, the simple commands it runs; for a file tool,
/// every form of the path the tool opens; for `web_fetch`, the parsed URL.
#[derive(Debug)]
pub struct Call<'a> {
    tool: &'a str,
    input: &'a Value,
    view: View,
}

#[derive(Debug)]
enum View {
    Bash {
        analysis: shell::Analysis,
        raw: String,
    },
    Paths(Vec<String>),
    Url(Option<reqwest::Url>),
    Other,
}

impl<'a> Call<'a> {
    /// Prepares `tool` called with `input`. With `workspace`, a file tool's path is also
    /// resolved through the links inside the workspace, as the tool will open it.
    pub fn new(tool: &'a str, input: &'a Value, workspace: Option<&Path>) -> Call<'a> {
        let view = match tool {
            "bash" => {
                let raw = input
                    .get("command")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .trim()
                    .to_owned();
                View::Bash {
                    analysis: shell::analyze(&raw),
                    raw,
                }
            }
            "web_fetch" => View::Url(
                input
                    .get("url")
                    .and_then(Value::as_str)
                    .and_then(|u| reqwest::Url::parse(u.trim()).ok()),
            ),
            t if covers("Read", t) || covers("Edit", t) => {
                let lexical = normalize(input.get("path").and_then(Value::as_str).unwrap_or("."));
                let mut paths = vec![lexical.clone()];
                if let Some(resolved) = workspace
                    .and_then(|w| crate::tools::resolve_in(w, &lexical))
                    .filter(|r| *r != lexical)
                {
                    paths.push(resolved);
                }
                View::Paths(paths)
            }
            _ => View::Other,
        };
        Call { tool, input, view }
    }
}

/// A workspace-relative path as the rules match it: `.` and empty components gone, `..`
/// applied, no leading `/` (the workspace is the root). `.//secrets/./key.txt` is
/// `secrets/key.txt`.
pub fn normalize(path: &str) -> String {
    let mut parts: Vec<String> = vec![];
    for c in Path::new(path.trim()).components() {
        match c {
            Component::Normal(s) => parts.push(s.to_string_lossy().into_owned()),
            Component::ParentDir => {
                parts.pop();
            }
            Component::CurDir | Component::RootDir | Component::Prefix(_) => {}
        }
    }
    if parts.is_empty() {
        ".".into()
    } else {
        parts.join("/")
    }
}

/// Compiled glob matchers by pattern: rules are few and matched often (once per file a search
/// finds), so each pattern is compiled once.
fn glob(pattern: &str) -> Option<globset::GlobMatcher> {
    static CACHE: LazyLock<Mutex<HashMap<String, Option<globset::GlobMatcher>>>> =
        LazyLock::new(Default::default);
    let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    if cache.len() > 4096 {
        cache.clear();
    }
    cache
        .entry(pattern.to_owned())
        .or_insert_with(|| {
            GlobBuilder::new(pattern)
                .literal_separator(true)
                .build()
                .ok()
                .map(|g| g.compile_matcher())
        })
        .clone()
}

fn path_matches(spec: &str, path: &str) -> bool {
    // `./x`, `x` and `/x` are all workspace-relative here (the workspace is the root).
    let pattern = spec.trim_start_matches("./").trim_start_matches('/');
    glob(pattern).is_some_and(|m| {
        m.is_match(path) || (pattern.ends_with("/**") && path == pattern.trim_end_matches("/**"))
    })
}

/// `git status:*` (or `git status *`) is a prefix of words, `npm test` exact words.
fn bash_spec(spec: &str) -> (Vec<String>, bool) {
    let (text, prefix) = match spec.strip_suffix(":*").or_else(|| spec.strip_suffix(" *")) {
        Some(p) => (p, true),
        None => (spec, false),
    };
    let a = shell::analyze(text);
    let words = match (a.opaque, a.commands.as_slice()) {
        (None, [one]) => one.clone(),
        _ => text.split_whitespace().map(str::to_owned).collect(),
    };
    (words, prefix)
}

fn command_matches(words: &[String], spec: &str) -> bool {
    let (want, prefix) = bash_spec(spec);
    if prefix {
        words.len() >= want.len() && words[..want.len()] == want[..]
    } else {
        words == want
    }
}

/// The host as rules compare it: lower case, without a trailing dot.
fn host(u: &reqwest::Url) -> Option<String> {
    u.host_str()
        .map(|h| {
            h.trim_end_matches('.')
                .trim_matches(['[', ']'])
                .to_ascii_lowercase()
        })
        .filter(|h| !h.is_empty())
}

fn url_matches(spec: &str, url: &reqwest::Url) -> bool {
    if let Some(domain) = spec.strip_prefix("domain:") {
        let d = domain.trim().trim_end_matches('.').to_ascii_lowercase();
        return host(url).is_some_and(|h| h == d || h.ends_with(&format!(".{d}")));
    }
    // A URL prefix, compared part by part: scheme, host, port, then the path by segments (so
    // `http://localhost:1@evil.test/` is evil.test, and `/docs` does not cover `/docsx`).
    let Ok(rule) = reqwest::Url::parse(spec.trim()) else {
        return false;
    };
    if rule.scheme() != url.scheme()
        || host(&rule) != host(url)
        || rule.port_or_known_default() != url.port_or_known_default()
    {
        return false;
    }
    let (want, got) = (rule.path(), url.path());
    got == want
        || (got.starts_with(want) && (want.ends_with('/') || got[want.len()..].starts_with('/')))
}

/// Other tools: the specifier is compared with their string arguments.
fn other_matches(spec: &str, call: &Call) -> bool {
    match call.tool {
        "task" | "subagent_start" => {
            call.input.get("subagent").and_then(Value::as_str) == Some(spec)
        }
        _ => call.input.as_object().is_some_and(|o| {
            o.values()
                .filter_map(Value::as_str)
                .any(|v| match spec.strip_suffix(":*") {
                    Some(prefix) => v.starts_with(prefix),
                    None => v == spec,
                })
        }),
    }
}

/// Whether a deny or ask rule touches any part of the call: any simple command a `bash` call
/// runs (and what common wrappers run), any form of a path.
fn hits(rule: &Rule, call: &Call) -> bool {
    if !covers(&rule.tool, call.tool) {
        return false;
    }
    let Some(spec) = rule.specifier.as_deref() else {
        return true;
    };
    match &call.view {
        View::Bash { analysis, raw } => {
            let textual = match spec.strip_suffix(":*") {
                Some(prefix) => raw == prefix || raw.starts_with(&format!("{prefix} ")),
                None => raw == spec,
            };
            textual
                || analysis
                    .commands
                    .iter()
                    .flat_map(|c| shell::deny_forms(c))
                    .any(|c| command_matches(&c, spec))
        }
        View::Paths(paths) => paths.iter().any(|p| path_matches(spec, p)),
        View::Url(url) => {
            url.as_ref().is_some_and(|u| url_matches(spec, u))
                || call
                    .input
                    .get("url")
                    .and_then(Value::as_str)
                    .is_some_and(|u| u.starts_with(spec))
        }
        View::Other => other_matches(spec, call),
    }
}

/// Whether allow rules vouch for every part of the call: each simple command of a vetted
/// `bash` command by some rule, and each form of a path.
fn vouched<'r>(rules: impl Iterator<Item = &'r Rule>, call: &Call) -> bool {
    let rules: Vec<&Rule> = rules.filter(|r| covers(&r.tool, call.tool)).collect();
    if rules.iter().any(|r| r.specifier.is_none()) {
        return true;
    }
    let specs: Vec<&str> = rules
        .iter()
        .filter_map(|r| r.specifier.as_deref())
        .collect();
    if specs.is_empty() {
        return false;
    }
    match &call.view {
        View::Bash { analysis, .. } => {
            analysis.opaque.is_none()
                && !analysis.commands.is_empty()
                && analysis
                    .commands
                    .iter()
                    .all(|c| specs.iter().any(|s| command_matches(c, s)))
        }
        View::Paths(paths) => paths
            .iter()
            .all(|p| specs.iter().any(|s| path_matches(s, p))),
        View::Url(url) => url
            .as_ref()
            .is_some_and(|u| specs.iter().any(|s| url_matches(s, u))),
        View::Other => specs.iter().any(|s| other_matches(s, call)),
    }
}

/// Evaluates a call against rule sources, most general first (the settings file, then the
/// agent): any deny wins, then any ask, then allow when the allow rules vouch for every part
/// of the call, then the last source's mode that sets one (`bypassPermissions` when none
/// does, so a deployment without rules runs as before).
pub fn evaluate(sources: &[&Rules], call: &Call) -> Verdict {
    let first = |pick: fn(&Rules) -> &Vec<Rule>| {
        sources
            .iter()
            .flat_map(|s| pick(s).iter())
            .find(|r| hits(r, call))
    };
    if let Some(r) = first(|s| &s.deny) {
        return Verdict::Deny(format!("denied by the rule `{}`", r.text));
    }
    if let Some(r) = first(|s| &s.ask) {
        return Verdict::Ask(format!("the rule `{}` asks for approval", r.text));
    }
    if vouched(sources.iter().flat_map(|s| s.allow.iter()), call) {
        return Verdict::Allow;
    }
    let tool = call.tool;
    let mode = sources
        .iter()
        .rev()
        .find_map(|s| s.mode)
        .unwrap_or(Mode::BypassPermissions);
    let read_only = READ_ONLY.contains(&tool);
    let why_not = match &call.view {
        View::Bash {
            analysis: shell::Analysis {
                opaque: Some(why), ..
            },
            ..
        } if sources
            .iter()
            .any(|s| s.allow.iter().any(|r| covers(&r.tool, tool))) =>
        {
            format!(" (no allow rule can vouch for this command: {why})")
        }
        _ => String::new(),
    };
    match mode {
        Mode::BypassPermissions => Verdict::Allow,
        Mode::Default if read_only => Verdict::Allow,
        Mode::Default => Verdict::Ask(format!("`{tool}` needs approval in default mode{why_not}")),
        Mode::AcceptEdits if read_only || EDITS.contains(&tool) => Verdict::Allow,
        Mode::AcceptEdits => Verdict::Ask(format!(
            "`{tool}` needs approval in acceptEdits mode{why_not}"
        )),
        Mode::Plan if read_only => Verdict::Allow,
        Mode::Plan => Verdict::Deny(format!("plan mode is read-only: `{tool}` is not allowed")),
        Mode::DontAsk => Verdict::Deny(format!(
            "`{tool}` is not allowed by any rule (dontAsk mode){why_not}"
        )),
    }
}

/// What a `run_tree` grant of an ask covers: the ask rule that asked (every later call that
/// rule asks about), or, when the mode asked, this tool with exactly this input.
pub fn grant_scope(sources: &[&Rules], call: &Call) -> String {
    match sources
        .iter()
        .flat_map(|s| s.ask.iter())
        .find(|r| hits(r, call))
    {
        Some(r) => format!("rule:{}", r.text),
        None => {
            let canonical = serde_json::to_string(call.input).unwrap_or_default();
            let h = Sha256::digest(canonical.as_bytes());
            format!(
                "call:{}:{}",
                call.tool,
                h.iter()
                    .take(16)
                    .map(|b| format!("{b:02x}"))
                    .collect::<String>()
            )
        }
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

    fn eval(sources: &[&Rules], tool: &str, input: Value) -> Verdict {
        evaluate(sources, &Call::new(tool, &input, None))
    }

    #[test]
    fn a_prefix_rule_vouches_for_no_command_chained_to_it() {
        let s = rules(
            json!({"allow": ["Bash(git status:*)", "Bash(git diff:*)"], "defaultMode": "dontAsk"}),
        );
        let bash = |c: &str| eval(&[&s], "bash", json!({"command": c}));
        for ok in [
            "git status",
            "git status --short",
            "git status && git diff",
            "git status | git diff --stat",
            "git 'status' 2>&1",
        ] {
            assert_eq!(bash(ok), Verdict::Allow, "{ok}");
        }
        for bad in [
            "git status ; touch pwned",
            "git status && env",
            "git status || cat /proc/self/environ",
            "git status | sh",
            "git status $(touch pwned)",
            "git status `touch pwned`",
            "git status > pwned",
            "git status & touch pwned",
            "git status\ntouch pwned",
            "X=1 git status",
            "(git status)",
            "git status 'unterminated",
            "git statusx",
        ] {
            assert!(
                matches!(bash(bad), Verdict::Deny(_)),
                "{bad} must not run under the prefix rules: {:?}",
                bash(bad)
            );
        }
        // In default mode the same commands ask instead, and say why no rule vouched.
        let d = rules(json!({"allow": ["Bash(git status:*)"], "defaultMode": "default"}));
        match eval(&[&d], "bash", json!({"command": "git status; rm -rf x"})) {
            Verdict::Ask(why) => assert!(why.contains("default mode"), "{why}"),
            v => panic!("{v:?}"),
        }
    }

    #[test]
    fn deny_rules_see_every_command_and_common_wrappers() {
        let s = rules(json!({"deny": ["Bash(rm:*)"]}));
        for cmd in [
            "rm -rf x",
            "echo hi; rm -rf x",
            "ls && /bin/rm x",
            "env rm x",
            "sudo -n rm x",
            "echo $(rm x)",
            "bash -c 'rm x'",
            "xargs rm < list",
        ] {
            assert!(
                matches!(
                    eval(&[&s], "bash", json!({"command": cmd})),
                    Verdict::Deny(_)
                ),
                "{cmd}"
            );
        }
        assert_eq!(
            eval(&[&s], "bash", json!({"command": "echo rm"})),
            Verdict::Allow
        );
    }

    #[test]
    fn paths_are_matched_as_the_tool_opens_them() {
        let s = rules(json!({"deny": ["Read(secrets/**)", "Edit(secrets/**)"]}));
        for p in [
            "secrets/key.txt",
            "./secrets/key.txt",
            ".//secrets/key.txt",
            "secrets//key.txt",
            "./secrets/./key.txt",
            "docs/../secrets/key.txt",
            "/secrets/key.txt",
            "secrets",
        ] {
            assert!(
                matches!(
                    eval(&[&s], "read_file", json!({"path": p})),
                    Verdict::Deny(_)
                ),
                "{p}"
            );
            assert!(
                matches!(
                    eval(&[&s], "write_file", json!({"path": p, "content": "x"})),
                    Verdict::Deny(_)
                ),
                "{p}"
            );
        }
        assert_eq!(
            eval(&[&s], "read_file", json!({"path": "docs/secrets.md"})),
            Verdict::Allow
        );
        // A link inside the workspace is followed as the tool follows it.
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("secrets")).unwrap();
        std::fs::write(dir.path().join("secrets/key.txt"), "k").unwrap();
        std::os::unix::fs::symlink("secrets", dir.path().join("innocent")).unwrap();
        let input = json!({"path": "innocent/key.txt"});
        assert!(matches!(
            evaluate(&[&s], &Call::new("read_file", &input, Some(dir.path()))),
            Verdict::Deny(_)
        ));
        let only_docs = rules(json!({"allow": ["Read(docs/**)"], "defaultMode": "dontAsk"}));
        std::os::unix::fs::symlink("secrets", dir.path().join("docs")).unwrap();
        let input = json!({"path": "docs/key.txt"});
        assert!(
            matches!(
                evaluate(
                    &[&only_docs],
                    &Call::new("read_file", &input, Some(dir.path()))
                ),
                Verdict::Deny(_)
            ),
            "a link out of docs/ is not docs/"
        );
    }

    #[test]
    fn url_rules_are_urls_and_hosts_are_normalised() {
        let s = rules(
            json!({"allow": ["WebFetch(http://localhost:21050/)", "WebFetch(https://docs.rs/tokio)"], "deny": ["WebFetch(domain:example.org)"], "defaultMode": "dontAsk"}),
        );
        let fetch = |u: &str| eval(&[&s], "web_fetch", json!({"url": u}));
        assert_eq!(fetch("http://localhost:21050/a"), Verdict::Allow);
        assert_eq!(fetch("https://docs.rs/tokio/latest"), Verdict::Allow);
        for bad in [
            "http://localhost:21050@attacker.test/",
            "https://docs.rs/tokio-evil",
            "http://localhost:21051/",
            "https://example.org./",
            "https://WWW.Example.ORG/x",
            "https://sub.example.org../",
        ] {
            assert!(matches!(fetch(bad), Verdict::Deny(_)), "{bad}");
        }
    }

    #[test]
    fn the_rule_syntax_on_a_table_of_cases() {
        let cases: Vec<(&str, &str, Value, bool)> = vec![
            (
                "Bash(git status:*)",
                "bash",
                json!({"command": "git status --short"}),
                true,
            ),
            (
                "Bash(git status:*)",
                "bash",
                json!({"command": "git status"}),
                true,
            ),
            (
                "Bash(git status:*)",
                "bash",
                json!({"command": "git statusx"}),
                false,
            ),
            (
                "Bash(git status:*)",
                "bash",
                json!({"command": "git push"}),
                false,
            ),
            (
                "Bash(npm test)",
                "bash",
                json!({"command": "npm test"}),
                true,
            ),
            (
                "Bash(npm test)",
                "bash",
                json!({"command": "npm test --watch"}),
                false,
            ),
            ("Bash", "bash", json!({"command": "anything"}), true),
            (
                "Read(./docs/**)",
                "read_file",
                json!({"path": "docs/a/b.md"}),
                true,
            ),
            (
                "Read(./docs/**)",
                "read_file",
                json!({"path": "./docs/x.md"}),
                true,
            ),
            (
                "Read(./docs/**)",
                "read_file",
                json!({"path": "src/main.rs"}),
                false,
            ),
            ("Read(./docs/**)", "grep", json!({"path": "docs"}), true),
            (
                "Read(*.md)",
                "read_file",
                json!({"path": "README.md"}),
                true,
            ),
            (
                "Read(*.md)",
                "read_file",
                json!({"path": "docs/README.md"}),
                false,
            ),
            ("Read", "list_dir", json!({}), true),
            ("Read", "write_file", json!({"path": "a"}), false),
            (
                "Edit(src/**)",
                "write_file",
                json!({"path": "src/lib.rs"}),
                true,
            ),
            (
                "Edit(src/**)",
                "multi_edit",
                json!({"path": "tests/a.rs"}),
                false,
            ),
            ("Write", "write_file", json!({"path": "x"}), true),
            (
                "WebFetch(domain:example.com)",
                "web_fetch",
                json!({"url": "https://docs.example.com/a"}),
                true,
            ),
            (
                "WebFetch(domain:example.com)",
                "web_fetch",
                json!({"url": "https://example.com.evil.io/"}),
                false,
            ),
            ("WebFetch", "web_fetch", json!({"url": "http://x"}), true),
            (
                "Task(researcher)",
                "task",
                json!({"subagent": "researcher"}),
                true,
            ),
            (
                "Task(researcher)",
                "subagent_start",
                json!({"subagent": "reviewer"}),
                false,
            ),
            ("mcp__github", "mcp__github__create_issue", json!({}), true),
            (
                "mcp__github__create_issue",
                "mcp__github__create_issue",
                json!({}),
                true,
            ),
            ("mcp__github", "mcp__gitlab__x", json!({}), false),
            ("echo(hi)", "echo", json!({"text": "hi"}), true),
            ("*", "bash", json!({"command": "x"}), true),
        ];
        for (rule, tool, input, want) in cases {
            let r = Rule::parse(rule).unwrap();
            assert_eq!(
                vouched(std::iter::once(&r), &Call::new(tool, &input, None)),
                want,
                "{rule} on {tool} {input}"
            );
        }
    }

    #[test]
    fn deny_beats_ask_beats_allow_beats_the_mode() {
        let settings = rules(
            json!({"allow": ["Bash(git:*)"], "ask": ["Bash(git push:*)"], "deny": ["Bash(git push --force:*)"]}),
        );
        let s = [&settings];
        let git = |c: &str| eval(&s, "bash", json!({"command": c}));
        assert_eq!(git("git log"), Verdict::Allow);
        assert!(matches!(git("git push origin"), Verdict::Ask(_)));
        assert!(matches!(git("git push --force x"), Verdict::Deny(_)));
        // Nothing matched: the mode decides; none set runs as before (everything allowed).
        assert_eq!(git("ls"), Verdict::Allow);
        let agent = rules(json!({"defaultMode": "default"}));
        let s = [&settings, &agent];
        assert!(matches!(
            eval(&s, "bash", json!({"command": "ls"})),
            Verdict::Ask(_)
        ));
        assert_eq!(eval(&s, "read_file", json!({"path": "a"})), Verdict::Allow);
        for (mode, tool, want) in [
            ("acceptEdits", "write_file", 0),
            ("acceptEdits", "web_fetch", 1),
            ("plan", "read_file", 0),
            ("plan", "edit_file", 2),
            ("dontAsk", "bash", 2),
            ("bypassPermissions", "bash", 0),
        ] {
            let r = rules(json!({ "defaultMode": mode }));
            assert_eq!(
                eval(&[&r], tool, json!({})).severity(),
                want,
                "{mode} {tool}"
            );
        }
    }

    #[test]
    fn the_stricter_verdict_wins() {
        assert!(matches!(
            Verdict::Allow.stricter(Verdict::Ask("a".into())),
            Verdict::Ask(_)
        ));
        assert!(matches!(
            Verdict::Deny("d".into()).stricter(Verdict::Ask("a".into())),
            Verdict::Deny(_)
        ));
        assert_eq!(Verdict::Allow.stricter(Verdict::Allow), Verdict::Allow);
    }
}
