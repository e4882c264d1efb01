//! Tools a run may call: a registry of built-ins confined to the owner's workspace directory
//! (every path opened through a `cap-std` capability, so nothing leaves it). Every call
//! gets the idempotency key `{run_id}:{step}:{call_id}` (DESIGN.md invariant 2): a call that was
//! in flight when a worker died runs again with the same key, and a tool with side effects can
//! use it to do its work only once.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use cap_std::fs::Dir;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::agents::AgentDef;
use crate::model::{FunctionSpec, ToolSpec};

/// What a tool knows about the call it is serving.
#[derive(Clone, Debug)]
pub struct ToolCtx {
    /// The owner's workspace: every path is resolved beneath it (see [`owner_workspace`]).
    pub workspace: PathBuf,
    /// `{run_id}:{step}:{call_id}`.
    pub idempotency_key: String,
    /// Bytes of output the run keeps; tools that read should not read (much) more.
    pub output_limit: usize,
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

/// The directory of one owner beneath the workspace root: owners never see each other's files.
/// Plain owner names (letters, digits, `-`, `_`, up to 64) are used as they are; any other is
/// hashed, so no owner name can point elsewhere.
pub fn owner_workspace(root: &Path, owner: &str) -> PathBuf {
    let plain = !owner.is_empty() && owner.len() <= 64 && owner.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if plain {
        return root.join(owner);
    }
    let h = Sha256::digest(owner.as_bytes());
    root.join(format!("owner-{}", h.iter().take(8).map(|b| format!("{b:02x}")).collect::<String>()))
}

/// The workspace as a capability: every path is opened relative to it, and the kernel-level
/// resolution in `cap-std` refuses absolute paths, `..` and symlinks that lead outside, at open
/// time. So no check-then-open race exists (a link swapped in between is still refused).
fn workspace_dir(workspace: &Path) -> Result<Dir, ToolError> {
    std::fs::create_dir_all(workspace)
        .map_err(|e| ToolError::new("workspace_unavailable", format!("workspace {}: {e}", workspace.display())))?;
    Dir::open_ambient_dir(workspace, cap_std::ambient_authority())
        .map_err(|e| ToolError::new("workspace_unavailable", format!("workspace {}: {e}", workspace.display())))
}

/// Refuses what no workspace path may be, with a message that says what to write instead. The
/// capability refuses these too; this only makes the message clearer.
fn relative(rel: &str) -> Result<&Path, ToolError> {
    let p = Path::new(rel);
    if p.components().all(|c| matches!(c, Component::Normal(_) | Component::CurDir)) {
        Ok(p)
    } else {
        Err(ToolError::new(
            "path_outside_workspace",
            format!("`{rel}` is not allowed: use a relative path inside the workspace, without `..`"),
        ))
    }
}

/// Turns an I/O error on `rel` into what the model should hear.
fn io_error(rel: &str, e: std::io::Error) -> ToolError {
    match e.kind() {
        std::io::ErrorKind::NotFound => ToolError::new("not_found", format!("`{rel}` does not exist; list_dir shows what does")),
        std::io::ErrorKind::PermissionDenied if e.to_string().contains("outside") => ToolError::new(
            "path_outside_workspace",
            format!("`{rel}` leads outside the workspace (through a link); it was not followed"),
        ),
        _ => ToolError::new("io_error", format!("`{rel}`: {e}")),
    }
}

/// Runs blocking file work off the async threads.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T, ToolError> + Send + 'static) -> Result<T, ToolError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| ToolError::new("io_error", format!("file task failed: {e}")))?
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

/// Room kept under the output limit for the truncation marker.
const MARKER_ROOM: usize = 128;

/// `read_file`: a UTF-8 file from the workspace, read only as far as the output limit (a huge
/// file, or a pipe that never ends, costs no more than a small one).
pub struct ReadFile;

#[async_trait]
impl Tool for ReadFile {
    fn spec(&self) -> ToolSpec {
        spec(
            "read_file",
            "Reads a UTF-8 text file from the workspace. `path` is relative to the workspace. Long files are cut at the output limit, with a note saying so.",
            json!({"type":"object","properties":{"path":{"type":"string"}},"required":["path"]}),
        )
    }
    async fn call(&self, args: Value, ctx: &ToolCtx) -> Result<String, ToolError> {
        let rel = str_arg(&args, "path")?.to_owned();
        let workspace = ctx.workspace.clone();
        let keep = ctx.output_limit.saturating_sub(MARKER_ROOM).max(1);
        blocking(move || {
            let dir = workspace_dir(&workspace)?;
            let file = dir.open(relative(&rel)?).map_err(|e| io_error(&rel, e))?;
            let meta = file.metadata().map_err(|e| io_error(&rel, e))?;
            if meta.is_dir() {
                return Err(ToolError::new("is_directory", format!("`{rel}` is a directory; list_dir lists it")));
            }
            let mut buf = Vec::with_capacity(keep.min(1 << 20) + 1);
            file.into_std().take(keep as u64 + 1).read_to_end(&mut buf).map_err(|e| io_error(&rel, e))?;
            let more = buf.len() > keep;
            buf.truncate(keep);
            let text = match std::str::from_utf8(&buf) {
                Ok(t) => t.to_owned(),
                // A cut through the last character is not binary data.
                Err(e) if more && e.error_len().is_none() => String::from_utf8_lossy(&buf[..e.valid_up_to()]).into_owned(),
                Err(_) => return Err(ToolError::new("not_text", format!("`{rel}` is not UTF-8 text"))),
            };
            if !more {
                return Ok(text);
            }
            let shown = text.len();
            let total = if meta.is_file() { format!("{} bytes", meta.len()) } else { "longer (a stream)".into() };
            Ok(format!("{text}\n[output truncated: the first {shown} bytes shown; the file is {total}]"))
        })
        .await
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
        let rel = str_arg(&args, "path")?.to_owned();
        let content = str_arg(&args, "content")?.to_owned();
        let workspace = ctx.workspace.clone();
        blocking(move || {
            let dir = workspace_dir(&workspace)?;
            let path = relative(&rel)?;
            if rel.is_empty() || dir.is_dir(path) {
                return Err(ToolError::new("is_directory", format!("`{rel}` is a directory")));
            }
            if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
                dir.create_dir_all(parent).map_err(|e| io_error(&rel, e))?;
            }
            // Writing the whole content is idempotent: a replay after a crash leaves the same file.
            dir.write(path, content.as_bytes()).map_err(|e| io_error(&rel, e))?;
            Ok(format!("wrote {} bytes to {rel}", content.len()))
        })
        .await
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
        let rel = args.get("path").and_then(Value::as_str).unwrap_or("").to_owned();
        let workspace = ctx.workspace.clone();
        blocking(move || {
            let dir = workspace_dir(&workspace)?;
            let path = if rel.is_empty() { Path::new(".") } else { relative(&rel)? };
            let mut names = vec![];
            for e in dir.read_dir(path).map_err(|e| io_error(&rel, e))? {
                let e = e.map_err(|e| io_error(&rel, e))?;
                let mut n = e.file_name().to_string_lossy().into_owned();
                if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                    n.push('/');
                }
                names.push(n);
            }
            names.sort();
            Ok(if names.is_empty() { "(empty)".into() } else { names.join("\n") })
        })
        .await
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

    fn ctx(dir: &Path) -> ToolCtx {
        ToolCtx { workspace: dir.to_owned(), idempotency_key: "k".into(), output_limit: 16 * 1024 }
    }

    #[tokio::test]
    async fn paths_that_leave_the_workspace_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let ws = dir.path().join("ws");
        let reg = ToolRegistry::builtin(None);
        let c = ctx(&ws);
        for bad in ["../x", "/etc/passwd", "a/../../x"] {
            let e = reg.execute("read_file", &json!({"path": bad}).to_string(), &c).await.unwrap_err();
            assert_eq!(e.code, "path_outside_workspace", "{bad}");
        }
        std::fs::create_dir_all(&ws).unwrap();
        std::os::unix::fs::symlink("/etc", ws.join("link")).unwrap();
        let e = reg.execute("read_file", r#"{"path":"link/passwd"}"#, &c).await.unwrap_err();
        assert_eq!(e.code, "path_outside_workspace");
        // A dangling link: writing through it would create a file outside.
        let outside = dir.path().join("outside.txt");
        std::os::unix::fs::symlink(&outside, ws.join("dangling")).unwrap();
        let e = reg.execute("write_file", r#"{"path":"dangling","content":"x"}"#, &c).await.unwrap_err();
        assert_eq!(e.code, "path_outside_workspace");
        assert!(!outside.exists(), "write_file created a file outside the workspace");
    }

    #[test]
    fn owners_get_their_own_directories() {
        let root = Path::new("/w");
        assert_eq!(owner_workspace(root, "alice"), Path::new("/w/alice"));
        let odd = owner_workspace(root, "../etc");
        assert!(odd.to_str().unwrap().starts_with("/w/owner-") && odd.components().count() == 3, "{odd:?}");
        assert_ne!(owner_workspace(root, "a/b"), owner_workspace(root, "a/c"));
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
        let ctx = ctx(dir.path());
        reg.execute("write_file", r#"{"path":"d/x.txt","content":"hi"}"#, &ctx).await.unwrap();
        assert_eq!(reg.execute("read_file", r#"{"path":"d/x.txt"}"#, &ctx).await.unwrap(), "hi");
        assert_eq!(reg.execute("list_dir", "{}", &ctx).await.unwrap(), "d/");
        assert_eq!(reg.execute("list_dir", r#"{"path":"d"}"#, &ctx).await.unwrap(), "x.txt");
        assert_eq!(reg.execute("read_file", "{", &ctx).await.unwrap_err().code, "bad_arguments");
        assert_eq!(reg.execute("nope", "{}", &ctx).await.unwrap_err().code, "unknown_tool");
        assert_eq!(reg.execute("read_file", r#"{"path":"zz"}"#, &ctx).await.unwrap_err().code, "not_found");
        assert_eq!(reg.execute("read_file", r#"{"path":"d"}"#, &ctx).await.unwrap_err().code, "is_directory");
        assert_eq!(reg.execute("write_file", r#"{"path":"d","content":""}"#, &ctx).await.unwrap_err().code, "is_directory");
    }

    #[tokio::test]
    async fn reads_stop_at_the_output_limit() {
        let dir = tempfile::tempdir().unwrap();
        let reg = ToolRegistry::builtin(None);
        let mut c = ctx(dir.path());
        c.output_limit = 1000;
        // A sparse 4 GiB file: reading it whole would take the worker down.
        let f = std::fs::File::create(dir.path().join("huge.txt")).unwrap();
        f.set_len(4 << 30).unwrap();
        let out = reg.execute("read_file", r#"{"path":"huge.txt"}"#, &c).await.unwrap();
        assert!(out.len() <= 1000, "{}", out.len());
        assert!(out.ends_with("the file is 4294967296 bytes]"), "{}", &out[out.len() - 80..]);
    }
}
