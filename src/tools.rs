//! Tools a run may call: a registry of built-ins confined to a workspace directory. Every call
//! gets the idempotency key `{run_id}:{step}:{call_id}` (DESIGN.md invariant 2): a call that was
//! in flight when a worker died runs again with the same key, and a tool with side effects can
//! use it to do its work only once.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use serde_json::{Value, json};

use crate::agents::AgentDef;
use crate::model::{FunctionSpec, ToolSpec};

/// What a tool knows about the call it is serving.
#[derive(Clone, Debug)]
pub struct ToolCtx {
    /// The directory every path is confined to.
    pub workspace: PathBuf,
    /// `{run_id}:{step}:{call_id}`.
    pub idempotency_key: String,
}

/// A tool failure the model should see (it is sent back as the tool result, not raised).
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error("error[{code}]: {message}")]
pub struct ToolError {
    /// Stable machine code, e.g. `path_outside_workspace`.
    pub code: &'static str,
    /// What went wrong and what to do instead.
    pub message: String,
}

impl ToolError {
    /// Shorthand.
    pub fn new(code: &'static str, message: impl Into<String>) -> Self {
        Self { code, message: message.into() }
    }
}

/// One tool.
#[async_trait]
pub trait Tool: Send + Sync {
    /// Name, description and JSON schema.
    fn spec(&self) -> ToolSpec;
    /// Runs the call; `args` is the parsed argument object.
    async fn call(&self, args: Value, ctx: &ToolCtx) -> Result<String, ToolError>;
}

fn spec(name: &str, description: &str, parameters: Value) -> ToolSpec {
    ToolSpec {
        kind: "function".into(),
        function: FunctionSpec { name: name.into(), description: description.into(), parameters },
    }
}

fn str_arg<'a>(args: &'a Value, key: &str) -> Result<&'a str, ToolError> {
    args.get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| ToolError::new("bad_arguments", format!("missing string argument `{key}`")))
}

/// Resolves `rel` inside `workspace`, refusing anything that would leave it: absolute paths,
/// `..`, and symlinks that point outside. Never follows an escaping path.
pub fn confine(workspace: &Path, rel: &str) -> Result<PathBuf, ToolError> {
    let p = Path::new(rel);
    if rel.is_empty() {
        return Ok(workspace.to_owned());
    }
    for c in p.components() {
        match c {
            Component::Normal(_) | Component::CurDir => {}
            _ => {
                return Err(ToolError::new(
                    "path_outside_workspace",
                    format!("`{rel}` is not allowed: use a relative path inside the workspace, without `..`"),
                ));
            }
        }
    }
    let root = workspace
        .canonicalize()
        .map_err(|e| ToolError::new("workspace_unavailable", format!("workspace {}: {e}", workspace.display())))?;
    let full = root.join(p);
    // Check the deepest existing ancestor: a symlink anywhere on the way is resolved here.
    let mut existing = full.as_path();
    while !existing.exists() {
        existing = existing.parent().unwrap_or(&root);
    }
    let real = existing.canonicalize().map_err(|e| ToolError::new("io_error", e.to_string()))?;
    if !real.starts_with(&root) {
        return Err(ToolError::new(
            "path_outside_workspace",
            format!("`{rel}` leads outside the workspace (through a link); it was not followed"),
        ));
    }
    Ok(full)
}

/// `echo`: returns its text. Harmless and deterministic: the tool tests and the mock use.
pub struct Echo;

#[async_trait]
impl Tool for Echo {
    fn spec(&self) -> ToolSpec {
        spec("echo", "Returns the given text unchanged.", json!({"type":"object","properties":{"text":{"type":"string"}},"required":["text"]}))
    }
    async fn call(&self, args: Value, _: &ToolCtx) -> Result<String, ToolError> {
        Ok(str_arg(&args, "text")?.to_owned())
    }
}

/// `read_file`: a UTF-8 file from the workspace.
pub struct ReadFile;

#[async_trait]
impl Tool for ReadFile {
    fn spec(&self) -> ToolSpec {
        spec(
            "read_file",
            "Reads a UTF-8 text file from the workspace. `path` is relative to the workspace.",
            json!({"type":"object","properties":{"path":{"type":"string"}},"required":["path"]}),
        )
    }
    async fn call(&self, args: Value, ctx: &ToolCtx) -> Result<String, ToolError> {
        let rel = str_arg(&args, "path")?;
        let path = confine(&ctx.workspace, rel)?;
        let bytes = tokio::fs::read(&path).await.map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => ToolError::new("not_found", format!("`{rel}` does not exist; list_dir shows what does")),
            _ => ToolError::new("io_error", format!("`{rel}`: {e}")),
        })?;
        String::from_utf8(bytes).map_err(|_| ToolError::new("not_text", format!("`{rel}` is not UTF-8 text")))
    }
}

/// `write_file`: creates or replaces a file (and its parent directories) in the workspace.
pub struct WriteFile;

#[async_trait]
impl Tool for WriteFile {
    fn spec(&self) -> ToolSpec {
        spec(
            "write_file",
            "Creates or overwrites a text file in the workspace (parent directories are created). `path` is relative to the workspace.",
            json!({"type":"object","properties":{"path":{"type":"string"},"content":{"type":"string"}},"required":["path","content"]}),
        )
    }
    async fn call(&self, args: Value, ctx: &ToolCtx) -> Result<String, ToolError> {
        let rel = str_arg(&args, "path")?;
        let content = str_arg(&args, "content")?;
        let path = confine(&ctx.workspace, rel)?;
        if path.is_dir() {
            return Err(ToolError::new("is_directory", format!("`{rel}` is a directory")));
        }
        if let Some(parent) = path.parent() {
            tokio::fs::create_dir_all(parent).await.map_err(|e| ToolError::new("io_error", e.to_string()))?;
        }
        // Writing the whole content is idempotent: a replay after a crash leaves the same file.
        tokio::fs::write(&path, content).await.map_err(|e| ToolError::new("io_error", format!("`{rel}`: {e}")))?;
        Ok(format!("wrote {} bytes to {rel}", content.len()))
    }
}

/// `list_dir`: entries of a workspace directory, directories marked with `/`.
pub struct ListDir;

#[async_trait]
impl Tool for ListDir {
    fn spec(&self) -> ToolSpec {
        spec(
            "list_dir",
            "Lists a directory in the workspace (default: its root). Directories end with `/`.",
            json!({"type":"object","properties":{"path":{"type":"string"}}}),
        )
    }
    async fn call(&self, args: Value, ctx: &ToolCtx) -> Result<String, ToolError> {
        let rel = args.get("path").and_then(Value::as_str).unwrap_or("");
        let path = confine(&ctx.workspace, rel)?;
        let mut rd = tokio::fs::read_dir(&path).await.map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => ToolError::new("not_found", format!("`{rel}` does not exist")),
            _ => ToolError::new("io_error", format!("`{rel}`: {e}")),
        })?;
        let mut names = vec![];
        while let Some(e) = rd.next_entry().await.map_err(|e| ToolError::new("io_error", e.to_string()))? {
            let mut n = e.file_name().to_string_lossy().into_owned();
            if e.file_type().await.map(|t| t.is_dir()).unwrap_or(false) {
                n.push('/');
            }
            names.push(n);
        }
        names.sort();
        Ok(if names.is_empty() { "(empty)".into() } else { names.join("\n") })
    }
}

/// The tools this process can offer, by name.
#[derive(Clone)]
pub struct ToolRegistry {
    tools: BTreeMap<String, Arc<dyn Tool>>,
    journal: Option<PathBuf>,
}

impl std::fmt::Debug for ToolRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ToolRegistry").field("tools", &self.tools.keys().collect::<Vec<_>>()).finish()
    }
}

/// Claude Code tool names that map onto ours, so its agent files keep their meaning.
fn alias(name: &str) -> &str {
    match name {
        "Read" => "read_file",
        "Write" | "Edit" | "MultiEdit" => "write_file",
        "LS" => "list_dir",
        other => other,
    }
}

impl ToolRegistry {
    /// The built-ins. `journal`, if set, gets one line per tool execution (`key<TAB>tool`),
    /// written before the tool runs: an audit trail operators (and the kill tests) read to see
    /// exactly what was executed.
    pub fn builtin(journal: Option<PathBuf>) -> Self {
        let mut tools: BTreeMap<String, Arc<dyn Tool>> = BTreeMap::new();
        for t in [Arc::new(Echo) as Arc<dyn Tool>, Arc::new(ReadFile), Arc::new(WriteFile), Arc::new(ListDir)] {
            tools.insert(t.spec().function.name.clone(), t);
        }
        Self { tools, journal }
    }

    /// Adds a tool (embedders, tests).
    pub fn register(&mut self, tool: Arc<dyn Tool>) {
        self.tools.insert(tool.spec().function.name.clone(), tool);
    }

    /// Names of the tools an agent may use; unknown names in its definition are skipped.
    pub fn allowed_for(&self, agent: &AgentDef) -> Vec<String> {
        match &agent.tools {
            None => self.tools.keys().cloned().collect(),
            Some(list) => {
                let mut out: Vec<String> = vec![];
                for n in list {
                    let n = alias(n);
                    if self.tools.contains_key(n) {
                        if !out.iter().any(|o| o == n) {
                            out.push(n.to_owned());
                        }
                    } else {
                        tracing::debug!(agent = %agent.name, tool = n, "agent lists a tool this process does not have; skipped");
                    }
                }
                out
            }
        }
    }

    /// Specs for the named tools.
    pub fn specs(&self, names: &[String]) -> Vec<ToolSpec> {
        names.iter().filter_map(|n| self.tools.get(n)).map(|t| t.spec()).collect()
    }

    /// Runs one call by name with raw JSON arguments. Errors come back as `Err` so the caller
    /// can report them to the model.
    pub async fn execute(&self, name: &str, raw_args: &str, ctx: &ToolCtx) -> Result<String, ToolError> {
        let tool = self.tools.get(name).ok_or_else(|| {
            ToolError::new("unknown_tool", format!("there is no tool `{name}`; use one of the tools offered"))
        })?;
        let args: Value = if raw_args.trim().is_empty() {
            json!({})
        } else {
            serde_json::from_str(raw_args)
                .map_err(|e| ToolError::new("bad_arguments", format!("arguments are not valid JSON ({e}); send a JSON object")))?
        };
        if !args.is_object() {
            return Err(ToolError::new("bad_arguments", "arguments must be a JSON object"));
        }
        if let Some(j) = &self.journal {
            if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(j) {
                let _ = writeln!(f, "{}\t{name}", ctx.idempotency_key);
            }
        }
        tool.call(args, ctx).await
    }
}

/// Cuts `text` to at most `limit` bytes (on a char boundary) and says so.
pub fn truncate_output(text: String, limit: usize) -> String {
    if text.len() <= limit {
        return text;
    }
    let mut cut = limit;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}\n[output truncated: {} of {} bytes shown]", &text[..cut], cut, text.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn confine_refuses_escapes() {
        let dir = tempfile::tempdir().unwrap();
        assert!(confine(dir.path(), "a/b.txt").is_ok());
        assert_eq!(confine(dir.path(), "../x").unwrap_err().code, "path_outside_workspace");
        assert_eq!(confine(dir.path(), "/etc/passwd").unwrap_err().code, "path_outside_workspace");
        #[cfg(unix)]
        {
            std::os::unix::fs::symlink("/etc", dir.path().join("link")).unwrap();
            assert_eq!(confine(dir.path(), "link/passwd").unwrap_err().code, "path_outside_workspace");
        }
    }

    #[test]
    fn truncation_is_marked() {
        assert_eq!(truncate_output("abc".into(), 10), "abc");
        let t = truncate_output("é".repeat(10), 5);
        assert!(t.starts_with("éé\n[output truncated: 4 of 20 bytes shown]"), "{t}");
    }

    #[tokio::test]
    async fn files_round_trip_and_bad_args_are_reported() {
        let dir = tempfile::tempdir().unwrap();
        let reg = ToolRegistry::builtin(None);
        let ctx = ToolCtx { workspace: dir.path().to_owned(), idempotency_key: "k".into() };
        reg.execute("write_file", r#"{"path":"d/x.txt","content":"hi"}"#, &ctx).await.unwrap();
        assert_eq!(reg.execute("read_file", r#"{"path":"d/x.txt"}"#, &ctx).await.unwrap(), "hi");
        assert_eq!(reg.execute("list_dir", "{}", &ctx).await.unwrap(), "d/");
        assert_eq!(reg.execute("read_file", "{", &ctx).await.unwrap_err().code, "bad_arguments");
        assert_eq!(reg.execute("nope", "{}", &ctx).await.unwrap_err().code, "unknown_tool");
        assert_eq!(reg.execute("read_file", r#"{"path":"zz"}"#, &ctx).await.unwrap_err().code, "not_found");
    }
}
