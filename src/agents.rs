//! Agent definitions: `jobs/<name>.md` files with YAML front matter and the system prompt as the
//! body. Claude Code's subagent files load unchanged: unknown keys are ignored (logged at debug),
//! `tools` may be a list or a comma-separated string, and Claude's model aliases fall back to the
//! configured default model.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

/// Longest wall-time limit a run may have: 7 days.
pub const MAX_TIMEOUT_SECS: u64 = 7 * 24 * 3600;

/// Steps allowed when a definition does not say.
pub const DEFAULT_MAX_STEPS: u32 = 25;
/// Wall time allowed when a definition does not say.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30 * 60);
/// Name of the agent that always exists.
pub const GENERAL_PURPOSE: &str = "general-purpose";

/// One loaded agent.
#[derive(Clone, Debug, PartialEq)]
pub struct AgentDef {
    /// Unique name (`[a-z0-9_-]`).
    pub name: String,
    /// One line for humans and for parent models choosing a subagent.
    pub description: String,
    /// Tools the agent may use, as written; `None` means every built-in tool.
    pub tools: Option<Vec<String>>,
    /// Model override; `None` uses the configured default.
    pub model: Option<String>,
    /// Step limit.
    pub max_steps: u32,
    /// Wall-time limit of one run.
    pub timeout: Duration,
    /// Subagents this agent may delegate to (empty: any).
    pub subagents: Vec<String>,
    /// The model's context window in tokens, when the agent file says (`context_window:`);
    /// otherwise the model table's.
    pub context_window: Option<u64>,
    /// Percent of the window at which its runs compact (`compact_at:`).
    pub compact_at: Option<u8>,
    /// Its hooks, permission rules (`hooks:`, `permissions:`, `permissionMode:`) and
    /// `approval_timeout:`.
    pub policy: crate::policy::Policy,
    /// MCP servers it declares (`mcpServers:`, the `.mcp.json` shape), as written; the worker
    /// adds them to the servers it knows.
    pub mcp_servers: Option<serde_json::Value>,
    /// The system prompt.
    pub system_prompt: String,
    /// Most of its runs running at once, fleet-wide (`max_concurrency:`); more wait queued.
    pub max_concurrency: Option<u32>,
    /// What its final answers must be (`output_schema:`, `output_retries:`): see
    /// [`crate::output`].
    pub output: Option<crate::output::OutputContract>,
    /// Where it came from (`None` for the built-in).
    pub source: Option<PathBuf>,
    /// A short hash of its file's content (`builtin-…` for the built-ins): what a run pins.
    pub version: String,
    /// Its file's content, kept so a run pinned to this version can be given it again after
    /// the file changed ([`crate::pinning`]); `None` for the built-ins.
    pub text: Option<std::sync::Arc<str>>,
}

/// The version of a definition file's content: the first 12 hex digits of its SHA-256.
pub fn content_version(text: &str) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(text.as_bytes())[..6]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A built-in's version: its content as this build defines it.
fn builtin_version(def: &AgentDef) -> String {
    let content = format!(
        "{}\0{}\0{:?}\0{}",
        def.name, def.description, def.tools, def.system_prompt
    );
    format!("builtin-{}", content_version(&content))
}

impl AgentDef {
    /// The built-in `general-purpose` agent, offered every built-in tool.
    pub fn general_purpose() -> AgentDef {
        AgentDef {
            name: GENERAL_PURPOSE.into(),
            description: "General-purpose agent for multi-step tasks: reads and writes files in its workspace and answers with a concise result.".into(),
            tools: None,
            model: None,
            max_steps: DEFAULT_MAX_STEPS,
            timeout: DEFAULT_TIMEOUT,
            subagents: vec![],
            context_window: None,
            compact_at: None,
            policy: Default::default(),
            mcp_servers: None,
            max_concurrency: None,
            output: None,
            system_prompt: "You are a capable general-purpose agent working on one delegated task. Use the tools you are given when they help, keep going until the task is done, and finish with a concise final answer that contains everything the caller needs: they will see only that answer, not your intermediate steps.".into(),
            source: None,
            version: String::new(),
            text: None,
        }
        .versioned()
    }

    /// The definition with its built-in version set (for definitions made in code).
    pub fn versioned(mut self) -> AgentDef {
        self.version = builtin_version(&self);
        self
    }
}

/// A definition file that could not be loaded.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
#[error("{}:{line}: {message}", path.display())]
pub struct AgentFileError {
    /// The file.
    pub path: PathBuf,
    /// 1-based line the problem is on.
    pub line: usize,
    /// What is wrong and how to fix it.
    pub message: String,
}

/// Either a list or a comma-separated string: Claude Code writes `tools: Read, Grep`.
#[derive(Deserialize)]
#[serde(untagged)]
enum ListOrString {
    List(Vec<String>),
    Str(String),
}

impl ListOrString {
    fn into_vec(self) -> Vec<String> {
        match self {
            ListOrString::List(v) => v
                .into_iter()
                .map(|s| s.trim().to_owned())
                .filter(|s| !s.is_empty())
                .collect(),
            ListOrString::Str(s) => split_top_level(&s),
        }
    }
}

/// Splits `Read, Task(a, b), Bash(git status:*)` on the commas outside parentheses.
fn split_top_level(s: &str) -> Vec<String> {
    let mut out = vec![];
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = (depth - 1).max(0),
            ',' if depth == 0 => {
                out.push(s[start..i].trim().to_owned());
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(s[start..].trim().to_owned());
    out.retain(|t| !t.is_empty());
    out
}

/// `Task(a, b)` / `Agent(a)` name the sub-agents a Claude Code agent may delegate to.
fn named_subagents(tool: &str) -> Option<Vec<String>> {
    let (name, rest) = tool.split_once('(')?;
    if !matches!(name.trim(), "Task" | "Agent") {
        return None;
    }
    Some(
        rest.trim_end_matches(')')
            .split(',')
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
            .collect(),
    )
}

/// Claude Code's model names, which an OpenAI-compatible endpoint does not know.
const CLAUDE_ALIASES: [&str; 3] = ["sonnet", "opus", "haiku"];

/// The model a run uses: the agent's `model:` through the alias map; `inherit` (or none) the
/// parent's model for a child and the default for a root; Claude's `sonnet`/`opus`/`haiku`
/// without an alias entry the default. Returns the model and, when a name was mapped or
/// replaced, how (for `subagents agents` and the logs).
pub fn resolve_model(
    agent_model: Option<&str>,
    parent_model: Option<&str>,
    default: &str,
    aliases: &BTreeMap<String, String>,
) -> (String, Option<String>) {
    match agent_model.map(str::trim) {
        None | Some("") => (default.to_owned(), None),
        Some("inherit") => match parent_model {
            Some(p) => (p.to_owned(), Some("inherited from the parent run".into())),
            None => (
                default.to_owned(),
                Some("inherit: a top-level run uses the default model".into()),
            ),
        },
        Some(m) => match aliases.get(m) {
            Some(to) => (to.clone(), Some(format!("alias {m} -> {to}"))),
            None if CLAUDE_ALIASES.contains(&m) => (
                default.to_owned(),
                Some(format!(
                    "{m}: no alias in SUBAGENTS_MODEL_ALIASES, so the default model"
                )),
            ),
            None => (m.to_owned(), None),
        },
    }
}

/// `30m`, `90s`, `2h`, `1h30m` or plain seconds.
#[derive(Deserialize)]
#[serde(untagged)]
enum TimeoutValue {
    Secs(u64),
    Text(String),
}

#[derive(Deserialize)]
struct FrontMatter {
    name: Option<String>,
    description: Option<String>,
    tools: Option<ListOrString>,
    model: Option<String>,
    max_steps: Option<i64>,
    max_concurrency: Option<i64>,
    timeout: Option<TimeoutValue>,
    subagents: Option<ListOrString>,
    context_window: Option<serde_yaml_ng::Value>,
    compact_at: Option<serde_yaml_ng::Value>,
    hooks: Option<serde_yaml_ng::Value>,
    permissions: Option<serde_yaml_ng::Value>,
    #[serde(rename = "permissionMode")]
    permission_mode: Option<String>,
    #[serde(rename = "mcpServers")]
    mcp_servers: Option<serde_yaml_ng::Value>,
    approval_timeout: Option<TimeoutValue>,
    output_schema: Option<serde_yaml_ng::Value>,
    output_retries: Option<i64>,
    #[serde(flatten)]
    extra: BTreeMap<String, serde_yaml_ng::Value>,
}

/// Parses a token count: `8000`, `8k`, `200k`, `1m`.
fn parse_tokens(v: &serde_yaml_ng::Value) -> Result<u64, String> {
    let text = match v {
        serde_yaml_ng::Value::Number(n) => n.to_string(),
        serde_yaml_ng::Value::String(s) => s.trim().to_ascii_lowercase(),
        _ => return Err("context_window must be a number of tokens, e.g. 8000 or 200k".into()),
    };
    let (digits, unit) = match text.strip_suffix('k') {
        Some(d) => (d, 1_000),
        None => match text.strip_suffix('m') {
            Some(d) => (d, 1_000_000),
            None => (text.as_str(), 1),
        },
    };
    digits
        .trim()
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(unit))
        .filter(|n| (1024..=100_000_000).contains(n))
        .ok_or_else(|| {
            format!("context_window `{text}` must be 1024 to 100000000 tokens (e.g. 8000 or 200k)")
        })
}

/// Parses a share of the window: `85`, `85%` or `0.85`, within 10..=95 percent.
fn parse_percent(v: &serde_yaml_ng::Value) -> Result<u8, String> {
    let n = match v {
        serde_yaml_ng::Value::Number(n) => n.as_f64(),
        serde_yaml_ng::Value::String(s) => {
            s.trim().trim_end_matches('%').trim().parse::<f64>().ok()
        }
        _ => None,
    }
    .ok_or_else(|| {
        "compact_at must be a percent (85 or 85%) or a fraction (0.85) of the context window"
            .to_owned()
    })?;
    let percent = if n <= 1.0 { n * 100.0 } else { n };
    if !percent.is_finite() || !(10.0..=95.0).contains(&percent.round()) {
        return Err(format!(
            "compact_at {n} is out of range: use 10% to 95% of the context window"
        ));
    }
    Ok(percent.round() as u8)
}

/// Parses `30m`-style durations.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if let Ok(n) = s.parse::<u64>() {
        return Ok(Duration::from_secs(n));
    }
    let mut total = 0u64;
    let mut num = String::new();
    for c in s.chars() {
        if c.is_ascii_digit() {
            num.push(c);
            continue;
        }
        let n: u64 = num
            .parse()
            .map_err(|_| format!("`{s}` is not a duration (use e.g. 90s, 30m, 2h)"))?;
        num.clear();
        let unit = match c {
            's' => 1,
            'm' => 60,
            'h' => 3600,
            _ => {
                return Err(format!(
                    "`{s}` is not a duration: unknown unit `{c}` (use s, m or h)"
                ));
            }
        };
        total = n
            .checked_mul(unit)
            .and_then(|x| x.checked_add(total))
            .ok_or_else(|| format!("`{s}` is too long"))?;
    }
    if !num.is_empty() {
        return Err(format!(
            "`{s}` is not a duration: `{num}` has no unit (use s, m or h)"
        ));
    }
    Ok(Duration::from_secs(total))
}

/// As Claude Code: anything but `:`, `/` and whitespace (collections use `.` and capitals).
fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.chars().count() <= 64
        && !n
            .chars()
            .any(|c| c == ':' || c == '/' || c.is_whitespace() || c.is_control())
}

/// Claude Code reads a one-line value such as `description: Use it when X. Examples: …` as
/// text, where YAML sees a second mapping. This quotes such values (top-level keys only, values
/// not already quoted, block or flow), so the files load as they do there.
fn quote_plain_values(yaml: &str) -> String {
    let mut out = String::with_capacity(yaml.len() + 64);
    for line in yaml.split_inclusive('\n') {
        let body = line.trim_end_matches(['\n', '\r']);
        let plain = body.split_once(": ").filter(|(key, value)| {
            !key.is_empty()
                && !key.starts_with([' ', '\t', '-', '#'])
                && key
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
                && value.contains(": ")
                && !value
                    .trim_start()
                    .starts_with(['"', '\'', '|', '>', '[', '{'])
        });
        match plain {
            Some((key, value)) => {
                let escaped = value.trim().replace('\\', "\\\\").replace('"', "\\\"");
                out.push_str(&format!("{key}: \"{escaped}\"\n"));
            }
            None => out.push_str(line),
        }
    }
    out
}

/// Parses one definition file's text. `path` is for messages and the fallback name.
pub fn parse_agent(path: &Path, text: &str) -> Result<AgentDef, AgentFileError> {
    let err = |line: usize, message: String| AgentFileError {
        path: path.to_owned(),
        line,
        message,
    };
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut lines = text.split_inclusive('\n');
    let first = lines.next().unwrap_or("");
    if first.trim_end() != "---" {
        return Err(err(
            1,
            "expected YAML front matter: the file must start with a line `---`".into(),
        ));
    }
    let mut yaml = String::new();
    let mut body_start = None;
    let mut offset = first.len();
    for (i, l) in lines.enumerate() {
        if l.trim_end() == "---" {
            body_start = Some((offset + l.len(), i + 2));
            break;
        }
        yaml.push_str(l);
        offset += l.len();
    }
    let Some((body_at, close_line)) = body_start else {
        return Err(err(
            1,
            "front matter is not closed: add a line `---` after the YAML".into(),
        ));
    };
    let fm: FrontMatter = if yaml.trim().is_empty() {
        return Err(err(
            2,
            "front matter is empty: it needs at least `description:`".into(),
        ));
    } else {
        match serde_yaml_ng::from_str(&yaml) {
            Ok(fm) => fm,
            // What Claude Code accepts, we accept: retry with one-line values quoted.
            Err(e) => serde_yaml_ng::from_str(&quote_plain_values(&yaml)).map_err(|_| {
                let line = e.location().map(|l| l.line() + 1).unwrap_or(2);
                err(
                    line,
                    format!(
                        "front matter is not valid YAML: {e}. If a value contains `: ` or starts with a special character, quote it (\"...\") or write it as a block (`description: |` with the text indented on the next lines)"
                    ),
                )
            })?,
        }
    };
    for key in fm.extra.keys() {
        tracing::debug!(path = %path.display(), key, "ignoring unknown front matter key");
    }
    let line_of = |key: &str| {
        yaml.lines()
            .position(|l| l.trim_start().starts_with(&format!("{key}:")))
            .map(|i| i + 2)
            .unwrap_or(2)
    };
    let stem = path
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("")
        .to_owned();
    let name = fm.name.unwrap_or(stem);
    if !valid_name(&name) {
        return Err(err(
            line_of("name"),
            format!(
                "name `{name}` is not valid: use 1 to 64 characters, without `:`, `/` or spaces"
            ),
        ));
    }
    let description = fm.description.unwrap_or_default().trim().to_owned();
    if description.is_empty() {
        return Err(err(
            line_of("description"),
            "`description` is missing: say in one line what this agent is for".into(),
        ));
    }
    let max_steps = match fm.max_steps {
        None => DEFAULT_MAX_STEPS,
        Some(n) if (1..=10_000).contains(&n) => n as u32,
        Some(n) => {
            return Err(err(
                line_of("max_steps"),
                format!("max_steps {n} is out of range 1..=10000"),
            ));
        }
    };
    let max_concurrency = match fm.max_concurrency {
        None => None,
        Some(n) if (1..=100_000).contains(&n) => Some(n as u32),
        Some(n) => {
            return Err(err(
                line_of("max_concurrency"),
                format!(
                    "max_concurrency {n} is out of range 1..=100000 (runs of this agent at once, fleet-wide)"
                ),
            ));
        }
    };
    let timeout = match fm.timeout {
        None => DEFAULT_TIMEOUT,
        Some(TimeoutValue::Secs(s)) => Duration::from_secs(s),
        Some(TimeoutValue::Text(t)) => {
            parse_duration(&t).map_err(|m| err(line_of("timeout"), m))?
        }
    };
    if timeout.is_zero() || timeout.as_secs() > MAX_TIMEOUT_SECS {
        return Err(err(
            line_of("timeout"),
            "timeout must be between 1 second and 7 days".into(),
        ));
    }
    // Kept as written: `inherit` and aliases are resolved per run (see `resolve_model`).
    let model = fm
        .model
        .map(|m| m.trim().to_owned())
        .filter(|m| !m.is_empty());
    let tools = fm.tools.map(ListOrString::into_vec);
    let mut subagents = fm.subagents.map(ListOrString::into_vec).unwrap_or_default();
    if subagents.is_empty() {
        for t in tools.iter().flatten() {
            subagents.extend(named_subagents(t).unwrap_or_default());
        }
    }
    let context_window = match &fm.context_window {
        None => None,
        Some(v) => Some(parse_tokens(v).map_err(|m| err(line_of("context_window"), m))?),
    };
    let compact_at = match &fm.compact_at {
        None => None,
        Some(v) => Some(parse_percent(v).map_err(|m| err(line_of("compact_at"), m))?),
    };
    let json = |v: &serde_yaml_ng::Value| serde_json::to_value(v).map_err(|e| e.to_string());
    let mut policy = crate::policy::Policy::default();
    if let Some(h) = &fm.hooks {
        policy.hooks = json(h)
            .and_then(|v| crate::policy::parse_hooks(&v))
            .map_err(|m| err(line_of("hooks"), m))?;
    }
    if let Some(p) = &fm.permissions {
        policy.rules = json(p)
            .and_then(|v| crate::policy::parse_permissions(&v))
            .map_err(|m| err(line_of("permissions"), m))?;
    }
    if let Some(m) = &fm.permission_mode {
        policy.rules.mode =
            Some(crate::policy::Mode::parse(m).map_err(|m| err(line_of("permissionMode"), m))?);
    }
    policy.approval_timeout = match fm.approval_timeout {
        None => None,
        Some(TimeoutValue::Secs(s)) => Some(Duration::from_secs(s)),
        Some(TimeoutValue::Text(t)) => {
            Some(parse_duration(&t).map_err(|m| err(line_of("approval_timeout"), m))?)
        }
    };
    let mcp_servers = match &fm.mcp_servers {
        None => None,
        Some(v) => match json(v) {
            Ok(v @ serde_json::Value::Object(_)) => Some(v),
            _ => {
                return Err(err(
                    line_of("mcpServers"),
                    "mcpServers must be an object of servers by name, as in .mcp.json".into(),
                ));
            }
        },
    };
    // A schema kept in its own file is part of the definition: editing it is a new version.
    let mut version = content_version(text);
    let output = match &fm.output_schema {
        None if fm.output_retries.is_some() => {
            return Err(err(
                line_of("output_retries"),
                "output_retries needs output_schema: (the JSON Schema the answers are checked against)".into(),
            ));
        }
        None => None,
        Some(v) => {
            let (schema, file) =
                output_schema(path, v).map_err(|m| err(line_of("output_schema"), m))?;
            if let Some(file) = file {
                version = content_version(&format!("{text}\0{file}"));
            }
            let retries = match fm.output_retries {
                None => None,
                Some(n) if (0..=crate::output::MAX_RETRIES as i64).contains(&n) => Some(n as u32),
                Some(n) => {
                    return Err(err(
                        line_of("output_retries"),
                        format!(
                            "output_retries {n} is out of range 0..={}",
                            crate::output::MAX_RETRIES
                        ),
                    ));
                }
            };
            Some(
                crate::output::OutputContract::new(schema, retries)
                    .map_err(|m| err(line_of("output_schema"), m))?,
            )
        }
    };
    let system_prompt = text[body_at..].trim().to_owned();
    let _ = close_line;
    Ok(AgentDef {
        name,
        description,
        tools,
        model,
        max_steps,
        timeout,
        subagents,
        context_window,
        compact_at,
        policy,
        mcp_servers,
        system_prompt,
        max_concurrency,
        output,
        source: Some(path.to_owned()),
        version,
        text: Some(text.into()),
    })
}

/// An agent's `output_schema:`: the schema written inline (YAML or JSON), or a path to a JSON
/// file beside the agent file (relative, and inside the agent file's directory).
/// Returns the schema, and the file's text when it came from one.
fn output_schema(
    agent_file: &Path,
    v: &serde_yaml_ng::Value,
) -> Result<(serde_json::Value, Option<String>), String> {
    let serde_yaml_ng::Value::String(rel) = v else {
        return serde_json::to_value(v)
            .map(|s| (s, None))
            .map_err(|e| format!("output_schema: {e}"));
    };
    let rel = Path::new(rel.trim());
    if rel.is_absolute()
        || rel
            .components()
            .any(|c| !matches!(c, std::path::Component::Normal(_)))
    {
        return Err(format!(
            "output_schema path `{}` must be relative to the agent file and stay beside it (no `..`, no absolute path)",
            rel.display()
        ));
    }
    let full = agent_file.parent().unwrap_or(Path::new(".")).join(rel);
    let text = std::fs::read_to_string(&full)
        .map_err(|e| format!("output_schema file {}: {e}", full.display()))?;
    let schema = serde_json::from_str(&text)
        .map_err(|e| format!("output_schema file {} is not JSON: {e}", full.display()))?;
    Ok((schema, Some(text)))
}

/// Every definition file under `dir`: each `*.md` in it and its subdirectories, hidden ones
/// left out, in path order (a missing directory has none).
pub fn definition_files(dir: &Path) -> Vec<PathBuf> {
    let mut paths: Vec<PathBuf> = vec![];
    let mut dirs = vec![dir.to_owned()];
    while let Some(d) = dirs.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            let hidden = p
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with('.'));
            match e.file_type() {
                Ok(t) if t.is_dir() && !hidden => dirs.push(p),
                Ok(t) if t.is_file() && p.extension().is_some_and(|x| x == "md") && !hidden => {
                    paths.push(p)
                }
                _ => {}
            }
        }
    }
    paths.sort();
    paths
}

/// The definitions visible to this process.
#[derive(Clone, Debug)]
pub struct AgentRegistry {
    agents: BTreeMap<String, std::sync::Arc<AgentDef>>,
}

impl AgentRegistry {
    /// The built-ins: `general-purpose`, and `echo` (only the `echo` tool; a fixed, cheap agent
    /// for benchmarks and smoke tests).
    pub fn builtin() -> Self {
        let mut agents = BTreeMap::new();
        agents.insert(
            GENERAL_PURPOSE.to_owned(),
            std::sync::Arc::new(AgentDef::general_purpose()),
        );
        let echo = AgentDef {
            name: "echo".into(),
            description: "Benchmark and smoke-test agent: may only call the echo tool.".into(),
            tools: Some(vec!["echo".into()]),
            system_prompt: "You test the executor. Call the echo tool when asked, then answer."
                .into(),
            ..AgentDef::general_purpose()
        }
        .versioned();
        agents.insert(echo.name.clone(), std::sync::Arc::new(echo));
        Self { agents }
    }

    /// Loads every `*.md` in `dir` and its subdirectories (collections install that way; a
    /// missing directory is empty). Broken files are returned beside the registry; the others
    /// still load. A file may redefine `general-purpose`.
    pub fn load_dir(dir: &Path) -> (Self, Vec<AgentFileError>) {
        let mut reg = Self::builtin();
        let mut errors = vec![];
        let paths = definition_files(dir);
        let mut from_files: BTreeMap<String, PathBuf> = BTreeMap::new();
        for path in paths {
            let text = match std::fs::read_to_string(&path) {
                Ok(t) => t,
                Err(e) => {
                    errors.push(AgentFileError {
                        path,
                        line: 1,
                        message: format!("cannot read: {e}"),
                    });
                    continue;
                }
            };
            match parse_agent(&path, &text) {
                Ok(def) => {
                    if let Some(prev) = from_files.get(&def.name) {
                        let line_in = |p: &Path| {
                            std::fs::read_to_string(p)
                                .ok()
                                .and_then(|t| {
                                    t.lines()
                                        .position(|l| l.trim_start().starts_with("name:"))
                                        .map(|i| i + 1)
                                })
                                .unwrap_or(1)
                        };
                        errors.push(AgentFileError {
                            path: path.clone(),
                            line: line_in(&path),
                            message: format!(
                                "agent `{}` is defined twice: here and in {}:{} (the first one is used); rename one of them",
                                def.name,
                                prev.display(),
                                line_in(prev)
                            ),
                        });
                        continue;
                    }
                    from_files.insert(def.name.clone(), path.clone());
                    reg.agents
                        .insert(def.name.clone(), std::sync::Arc::new(def));
                }
                Err(e) => errors.push(e),
            }
        }
        (reg, errors)
    }

    /// Looks an agent up by name.
    pub fn get(&self, name: &str) -> Option<&AgentDef> {
        self.agents.get(name).map(|a| a.as_ref())
    }

    /// Looks an agent up by name, as a shared handle (no copy of the definition).
    pub fn shared(&self, name: &str) -> Option<std::sync::Arc<AgentDef>> {
        self.agents.get(name).cloned()
    }

    /// All agents, by name.
    pub fn all(&self) -> impl Iterator<Item = &AgentDef> {
        self.agents.values().map(|a| a.as_ref())
    }

    /// Adds or replaces a definition (used by tests and embedders).
    pub fn insert(&mut self, def: AgentDef) {
        self.agents
            .insert(def.name.clone(), std::sync::Arc::new(def));
    }

    /// Names, for error messages.
    pub fn names(&self) -> Vec<String> {
        self.agents.keys().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p() -> PathBuf {
        PathBuf::from("jobs/x.md")
    }

    #[test]
    fn claude_code_files_load_unchanged() {
        let text = "---\nname: code-reviewer\ndescription: Reviews code\ntools: Read, Grep, Glob\nmodel: sonnet\ncolor: blue\n---\nYou review code.\n";
        let a = parse_agent(&p(), text).unwrap();
        assert_eq!(a.name, "code-reviewer");
        assert_eq!(
            a.tools,
            Some(vec!["Read".into(), "Grep".into(), "Glob".into()])
        );
        assert_eq!(a.model.as_deref(), Some("sonnet"));
        assert_eq!(a.system_prompt, "You review code.");
        assert_eq!(a.max_steps, DEFAULT_MAX_STEPS);
    }

    #[test]
    fn task_forms_name_subagents_and_commas_in_parentheses_do_not_split() {
        let text = "---\nname: lead\ndescription: d\ntools: Read, Task(researcher, reviewer), Bash(git status:*, git log:*)\n---\nbody";
        let a = parse_agent(&p(), text).unwrap();
        assert_eq!(
            a.tools.unwrap(),
            [
                "Read",
                "Task(researcher, reviewer)",
                "Bash(git status:*, git log:*)"
            ]
        );
        assert_eq!(a.subagents, ["researcher", "reviewer"]);
    }

    #[test]
    fn models_resolve_through_aliases_and_inherit() {
        let aliases: BTreeMap<String, String> =
            [("sonnet".to_owned(), "gpt-4.1".to_owned())].into();
        assert_eq!(resolve_model(None, Some("p"), "d", &aliases).0, "d");
        assert_eq!(
            resolve_model(Some("inherit"), Some("p"), "d", &aliases).0,
            "p"
        );
        assert_eq!(resolve_model(Some("inherit"), None, "d", &aliases).0, "d");
        assert_eq!(
            resolve_model(Some("sonnet"), None, "d", &aliases).0,
            "gpt-4.1"
        );
        assert_eq!(resolve_model(Some("opus"), None, "d", &aliases).0, "d");
        assert_eq!(
            resolve_model(Some("gpt-4o"), None, "d", &aliases),
            ("gpt-4o".to_owned(), None)
        );
    }

    #[test]
    fn claude_code_leniency() {
        // An unquoted one-line description with `: ` in it, as collections write them.
        let text = "---\nname: api.designer\ndescription: Use this agent for APIs. Examples: <example>Context: a REST API</example>\ntools: Read\n---\nbody";
        let a = parse_agent(&p(), text).unwrap();
        assert_eq!(a.name, "api.designer");
        assert_eq!(
            a.description,
            "Use this agent for APIs. Examples: <example>Context: a REST API</example>"
        );
        // Still refused: what Claude Code refuses.
        assert!(parse_agent(&p(), "name: x\n---\n").is_err());
        assert!(parse_agent(&p(), "---\nname: a/b\ndescription: d\n---\n").is_err());
        let e = parse_agent(&p(), "---\ndescription: [broken\n---\n").unwrap_err();
        assert!(e.message.contains("quote it"), "{e}");
    }

    #[test]
    fn subdirectories_load_and_duplicates_name_both_files() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("collection/engineering")).unwrap();
        std::fs::write(
            dir.path().join("a.md"),
            "---\nname: dup\ndescription: first\n---\nx",
        )
        .unwrap();
        std::fs::write(
            dir.path().join("collection/engineering/b.md"),
            "---\ndescription: second\nname: dup\n---\nx",
        )
        .unwrap();
        std::fs::write(
            dir.path().join("collection/engineering/deep.md"),
            "---\ndescription: nested\n---\nx",
        )
        .unwrap();
        let (reg, errors) = AgentRegistry::load_dir(dir.path());
        assert_eq!(reg.get("dup").unwrap().description, "first");
        assert!(reg.get("deep").is_some(), "files in subdirectories load");
        assert_eq!(errors.len(), 1);
        let e = errors[0].to_string();
        assert!(e.contains("b.md:3:") && e.contains("a.md:2"), "{e}");
    }

    #[test]
    fn our_keys_load() {
        let text = "---\ndescription: d\ntools: [echo, read_file]\nmodel: gpt-4o\nmax_steps: 7\ntimeout: 1h30m\nsubagents: a, b\n---\nbody";
        let a = parse_agent(&p(), text).unwrap();
        assert_eq!(a.name, "x");
        assert_eq!(a.max_steps, 7);
        assert_eq!(a.timeout, Duration::from_secs(5400));
        assert_eq!(a.subagents, vec!["a", "b"]);
        assert_eq!(a.model.as_deref(), Some("gpt-4o"));
        assert_eq!((a.context_window, a.compact_at), (None, None));
    }

    #[test]
    fn context_keys_load_and_refuse_nonsense() {
        for (window, at, want) in [
            ("8000", "85", (8000, 85)),
            ("200k", "70%", (200_000, 70)),
            ("1m", "0.5", (1_000_000, 50)),
        ] {
            let a = parse_agent(
                &p(),
                &format!("---\ndescription: d\ncontext_window: {window}\ncompact_at: {at}\n---\n"),
            )
            .unwrap();
            assert_eq!(
                (a.context_window, a.compact_at),
                (Some(want.0), Some(want.1))
            );
        }
        let e = parse_agent(&p(), "---\ndescription: d\ncontext_window: 12\n---\n").unwrap_err();
        assert_eq!(e.line, 3);
        assert!(e.message.contains("1024"), "{e}");
        let e = parse_agent(&p(), "---\ndescription: d\ncompact_at: 99\n---\n").unwrap_err();
        assert!(e.message.contains("10% to 95%"), "{e}");
        assert!(parse_agent(&p(), "---\ndescription: d\ncompact_at: lots\n---\n").is_err());
    }

    #[test]
    fn output_schemas_load_inline_or_from_a_file_beside_the_agent() {
        let a = parse_agent(
            &p(),
            "---\ndescription: d\noutput_schema:\n  type: object\n  required: [n]\noutput_retries: 4\n---\n",
        )
        .unwrap();
        let o = a.output.unwrap();
        assert_eq!(
            o.schema,
            serde_json::json!({"type": "object", "required": ["n"]})
        );
        assert_eq!(o.retries, 4);
        let a = parse_agent(
            &p(),
            "---\ndescription: d\noutput_schema: {\"type\": \"string\"}\n---\n",
        )
        .unwrap();
        assert_eq!(a.output.unwrap().retries, crate::output::DEFAULT_RETRIES);

        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("schemas")).unwrap();
        std::fs::write(dir.path().join("schemas/n.json"), r#"{"type": "integer"}"#).unwrap();
        let file = dir.path().join("counter.md");
        let text = "---\ndescription: d\noutput_schema: schemas/n.json\n---\n";
        let a = parse_agent(&file, text).unwrap();
        assert_eq!(
            a.output.unwrap().schema,
            serde_json::json!({"type": "integer"})
        );
        let v1 = a.version;
        // The schema's file is part of the definition: changing it is a new version.
        std::fs::write(dir.path().join("schemas/n.json"), r#"{"type": "number"}"#).unwrap();
        assert_ne!(parse_agent(&file, text).unwrap().version, v1);

        for (schema, why) in [
            ("../secret.json", "`..`"),
            ("/etc/passwd", "absolute"),
            ("schemas/missing.json", "missing"),
        ] {
            let text = format!("---\ndescription: d\noutput_schema: '{schema}'\n---\n");
            let e = parse_agent(&file, &text).unwrap_err();
            assert_eq!(e.line, 3, "{why}: {e}");
        }
        let e = parse_agent(
            &p(),
            "---\ndescription: d\noutput_schema: {type: bogus}\n---\n",
        )
        .unwrap_err();
        assert!(e.message.contains("not a valid JSON Schema"), "{e}");
        let e = parse_agent(&p(), "---\ndescription: d\noutput_retries: 1\n---\n").unwrap_err();
        assert!(e.message.contains("needs output_schema"), "{e}");
        let e = parse_agent(
            &p(),
            "---\ndescription: d\noutput_schema: {}\noutput_retries: 11\n---\n",
        )
        .unwrap_err();
        assert!(e.message.contains("out of range"), "{e}");
    }

    #[test]
    fn broken_files_say_where() {
        let e = parse_agent(&p(), "no front matter").unwrap_err();
        assert_eq!(e.line, 1);
        let e = parse_agent(&p(), "---\ndescription: d\nmax_steps: 0\n---\n").unwrap_err();
        assert_eq!(e.line, 3, "{e}");
        assert!(e.message.contains("max_steps"));
        let e = parse_agent(&p(), "---\ndescription: d\ntools: [a\n---\n").unwrap_err();
        assert!(e.to_string().starts_with("jobs/x.md:"), "{e}");
        let e = parse_agent(&p(), "---\nname: d\n---\n").unwrap_err();
        assert!(e.message.contains("description"));
        let e = parse_agent(&p(), "---\ndescription: d\ntimeout: 5x\n---\n").unwrap_err();
        assert_eq!(e.line, 3);
        let e = parse_agent(&p(), "---\ndescription: d\n").unwrap_err();
        assert!(e.message.contains("not closed"));
    }
}
