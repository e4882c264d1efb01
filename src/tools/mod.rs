//! Tools a run may call: a registry of built-ins — files ([`fs`]), search ([`search`]), the
//! web ([`web`]) and, when an operator enables it, a shell ([`shell`]) — working in the owner's
//! workspace directory (every path opened through a `cap-std` capability, so nothing leaves
//! it), and the mapping of Claude Code's tool names onto them ([`lookup`]). Every call
//! gets the idempotency key `{run_id}:{step}:{call_id}`: a call that was
//! in flight when a worker died runs again with the same key, and a tool with side effects can
//! use it to do its work only once.

mod error;
pub mod fs;
pub mod search;
pub mod search_web;
pub mod shell;
pub mod todo;
pub mod web;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use cap_std::fs::Dir;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::agents::AgentDef;
use crate::ids::OwnerId;
use crate::model::{FunctionSpec, ToolSpec};
pub use error::{ErrorCode, ToolError};
pub use fs::{EditFile, ListDir, MultiEdit, ReadFile, WriteFile};
pub use web::{FetchPolicy, WebFetch};

/// What a tool knows about the call it is serving.
#[derive(Clone, Debug)]
pub struct ToolCtx {
    /// The owner's workspace: every path is resolved beneath it (see [`owner_workspace`]).
    pub workspace: PathBuf,
    /// `{run_id}:{step}:{call_id}`.
    pub idempotency_key: String,
    /// Bytes a paging tool (`read_file`, `grep`) shows per call before it says where to read on;
    /// derived from the result's token budget. Other tools return everything (up to
    /// [`MAX_OUTPUT_BYTES`]) and the engine offloads a long result to a file.
    pub output_limit: usize,
    /// Which files a search may show: those the read rules let the run read. `None` shows
    /// every file.
    pub readable: Option<Readable>,
}

impl ToolCtx {
    /// A call's context with no read rules to apply.
    pub fn new(
        workspace: impl Into<PathBuf>,
        idempotency_key: impl Into<String>,
        output_limit: usize,
    ) -> ToolCtx {
        ToolCtx {
            workspace: workspace.into(),
            idempotency_key: idempotency_key.into(),
            output_limit,
            readable: None,
        }
    }
}

/// Whether a workspace-relative path may be shown to the run (its read rules): `grep` and
/// `glob` over a directory must not hand over what `read_file` on the file would be refused.
#[derive(Clone)]
pub struct Readable(pub Arc<dyn Fn(&str) -> bool + Send + Sync>);

impl std::fmt::Debug for Readable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Readable(..)")
    }
}

/// `rel` as the file tools reach it: resolved through the links inside the workspace (a path
/// that does not exist yet, through its deepest existing directory), workspace-relative.
/// `None` when it leads outside the workspace or cannot be looked at.
pub fn resolve_in(workspace: &Path, rel: &str) -> Option<String> {
    let dir = Dir::open_ambient_dir(workspace, cap_std::ambient_authority()).ok()?;
    let mut tail = vec![];
    let mut cur = Path::new(rel);
    let resolved = loop {
        let probe = if cur.as_os_str().is_empty() {
            Path::new(".")
        } else {
            cur
        };
        match dir.canonicalize(probe) {
            Ok(p) => break p,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                tail.push(cur.file_name()?.to_owned());
                cur = cur.parent()?;
            }
            Err(_) => return None,
        }
    };
    let mut parts: Vec<String> = resolved
        .components()
        .filter_map(|c| match c {
            Component::Normal(s) => Some(s.to_string_lossy().into_owned()),
            _ => None,
        })
        .collect();
    parts.extend(tail.iter().rev().map(|t| t.to_string_lossy().into_owned()));
    Some(if parts.is_empty() {
        ".".into()
    } else {
        parts.join("/")
    })
}

/// Most output a tool keeps in memory; past it, output is dropped with a marker.
pub const MAX_OUTPUT_BYTES: usize = 16 * 1024 * 1024;

/// What the model gets instead of a result too long for its context: the head, what was
/// left out, and where the whole result is, in the form `read_file` pages on from.
pub struct Offloaded {
    /// The text for the context.
    pub notice: String,
    /// Where the whole result was written, relative to the workspace.
    pub path: String,
}

/// Writes `text` whole to `rel` in the workspace (replacing any earlier copy: a replay writes
/// the same bytes) and builds the notice the model sees, from `head` (a prefix of `text`).
pub async fn offload(
    workspace: &Path,
    rel: String,
    text: String,
    head_len: usize,
    tokens: usize,
    limit: usize,
) -> Result<Offloaded, ToolError> {
    let workspace = workspace.to_owned();
    blocking(move || {
        let dir = workspace_dir(&workspace)?;
        let path = relative(&rel)?;
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            dir.create_dir_all(parent).map_err(|e| io_error(&rel, e))?;
        }
        write_plain(&dir, path, &rel, text.as_bytes())?;
        let head = &text[..head_len];
        let shown_lines = head.matches('\n').count();
        let lines = text.lines().count();
        let mut notice = head.to_owned();
        if !notice.is_empty() && !notice.ends_with('\n') {
            notice.push('\n');
        }
        notice.push_str(&format!(
            "[result offloaded: it is {} bytes ({tokens} tokens, {lines} lines), more than the {limit} tokens a result may take here; above are its first {shown_lines} lines. The whole result is saved at `{rel}`: read_file with path=`{rel}` offset={} reads on]",
            text.len(),
            shown_lines + 1
        ));
        Ok(Offloaded { notice, path: rel })
    })
    .await
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
        function: FunctionSpec {
            name: name.into(),
            description: description.into(),
            parameters,
        },
    }
}

fn str_arg<'a>(args: &'a Value, key: &str) -> Result<&'a str, ToolError> {
    args.get(key).and_then(Value::as_str).ok_or_else(|| {
        ToolError::new(
            ErrorCode::BadArguments,
            format!("missing string argument `{key}`"),
        )
    })
}

/// The directory of one owner beneath the workspace root: owners never see each other's files.
/// Plain owner names (letters, digits, `-`, `_`, up to 64) are used as they are; any other is
/// hashed, so no owner name can point elsewhere.
pub fn owner_workspace(root: &Path, owner: &OwnerId) -> PathBuf {
    let owner = owner.as_str();
    let plain = !owner.is_empty()
        && owner.len() <= 64
        && owner
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if plain {
        return root.join(owner);
    }
    let h = Sha256::digest(owner.as_bytes());
    root.join(format!(
        "owner-{}",
        h.iter()
            .take(8)
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    ))
}

/// The workspace as a capability: every path is opened relative to it, and the kernel-level
/// resolution in `cap-std` refuses absolute paths, `..` and symlinks that lead outside, at open
/// time. So no check-then-open race exists (a link swapped in between is still refused).
fn workspace_dir(workspace: &Path) -> Result<Dir, ToolError> {
    std::fs::create_dir_all(workspace).map_err(|e| {
        ToolError::new(
            ErrorCode::WorkspaceUnavailable,
            format!("workspace {}: {e}", workspace.display()),
        )
    })?;
    Dir::open_ambient_dir(workspace, cap_std::ambient_authority()).map_err(|e| {
        ToolError::new(
            ErrorCode::WorkspaceUnavailable,
            format!("workspace {}: {e}", workspace.display()),
        )
    })
}

/// Refuses what no workspace path may be, with a message that says what to write instead. The
/// capability refuses these too; this only makes the message clearer.
fn relative(rel: &str) -> Result<&Path, ToolError> {
    let p = Path::new(rel);
    if p.components()
        .all(|c| matches!(c, Component::Normal(_) | Component::CurDir))
    {
        Ok(p)
    } else {
        Err(ToolError::new(
            ErrorCode::PathOutsideWorkspace,
            format!(
                "`{rel}` is not allowed: use a relative path inside the workspace, without `..`"
            ),
        ))
    }
}

/// Opens an existing workspace file that must be a plain file: the open never blocks (a FIFO
/// opens non-blocking), and a device, a FIFO, a socket or a file with more than one hard link
/// is refused (a hard link may lead to a
/// file outside the workspace, which no path check can see).
fn open_plain(dir: &Dir, path: &Path, rel: &str, write: bool) -> Result<std::fs::File, ToolError> {
    use cap_std::fs::OpenOptionsExt;
    let mut options = cap_std::fs::OpenOptions::new();
    options
        .read(true)
        .write(write)
        .custom_flags(libc::O_NONBLOCK);
    let file = dir
        .open_with(path, &options)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ENXIO) => ToolError::new(
                ErrorCode::NotAFile,
                format!("`{rel}` is not a regular file"),
            ),
            Some(libc::EISDIR) => ToolError::new(
                ErrorCode::IsDirectory,
                format!("`{rel}` is a directory; list_dir lists it"),
            ),
            _ => io_error(rel, e),
        })?;
    let file = file.into_std();
    let meta = file.metadata().map_err(|e| io_error(rel, e))?;
    check_plain(&meta, rel)?;
    // Back to blocking reads and writes: a regular file never waits anyway.
    // SAFETY: fcntl on a descriptor we own, with plain integer arguments.
    unsafe {
        use std::os::fd::AsRawFd;
        let fd = file.as_raw_fd();
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags >= 0 {
            libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK);
        }
    }
    Ok(file)
}

/// Refuses what is not a plain, singly linked file.
fn check_plain(meta: &std::fs::Metadata, rel: &str) -> Result<(), ToolError> {
    use std::os::unix::fs::MetadataExt;
    if meta.is_dir() {
        return Err(ToolError::new(
            ErrorCode::IsDirectory,
            format!("`{rel}` is a directory; list_dir lists it"),
        ));
    }
    if !meta.is_file() {
        return Err(ToolError::new(
            ErrorCode::NotAFile,
            format!(
                "`{rel}` is not a regular file (a device, FIFO or socket); file tools read and write regular files only"
            ),
        ));
    }
    if meta.nlink() > 1 {
        return Err(ToolError::new(
            ErrorCode::HardLink,
            format!(
                "`{rel}` has {} hard links; file tools refuse such files, since another name of it may lie outside the workspace",
                meta.nlink()
            ),
        ));
    }
    Ok(())
}

/// Writes `bytes` to a workspace file, creating it if missing; an existing one must be a plain
/// file (see [`open_plain`]).
fn write_plain(dir: &Dir, path: &Path, rel: &str, bytes: &[u8]) -> Result<(), ToolError> {
    use std::io::Write as _;
    let file = match open_plain(dir, path, rel, true) {
        Ok(f) => f,
        Err(e) if e.code == "not_found" => {
            let mut options = cap_std::fs::OpenOptions::new();
            options.write(true).create_new(true);
            dir.open_with(path, &options)
                .map_err(|e| io_error(rel, e))?
                .into_std()
        }
        Err(e) => return Err(e),
    };
    let mut file = file;
    file.set_len(0).map_err(|e| io_error(rel, e))?;
    file.write_all(bytes).map_err(|e| io_error(rel, e))
}

/// Turns an I/O error on `rel` into what the model should hear.
fn io_error(rel: &str, e: std::io::Error) -> ToolError {
    match e.kind() {
        std::io::ErrorKind::NotFound => ToolError::new(
            ErrorCode::NotFound,
            format!("`{rel}` does not exist; list_dir shows what does"),
        ),
        std::io::ErrorKind::PermissionDenied if e.to_string().contains("outside") => {
            ToolError::new(
                ErrorCode::PathOutsideWorkspace,
                format!(
                    "`{rel}` leads outside the workspace (through a link); it was not followed"
                ),
            )
        }
        _ => ToolError::new(ErrorCode::IoError, format!("`{rel}`: {e}")),
    }
}

/// Runs blocking file work off the async threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ToolError> + Send + 'static,
) -> Result<T, ToolError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ToolError::new(ErrorCode::IoError, format!("file task failed: {e}")))?
}

/// `echo`: returns its text. Harmless and deterministic: the tool tests and the mock use.
pub struct Echo;

#[async_trait]
impl Tool for Echo {
    fn spec(&self) -> ToolSpec {
        spec(
            "echo",
            "Returns the given text unchanged.",
            json!({"type":"object","properties":{"text":{"type":"string"}},"required":["text"]}),
        )
    }
    async fn call(&self, args: Value, _: &ToolCtx) -> Result<String, ToolError> {
        Ok(str_arg(&args, "text")?.to_owned())
    }
}

/// The settings of the built-in tools.
#[derive(Clone, Debug, Default)]
pub struct ToolSettings {
    /// Append one line per tool execution (`key<TAB>tool`) to this file.
    pub journal: Option<PathBuf>,
    /// Offer `bash` (to agents that list it).
    pub allow_bash: bool,
    /// Who `web_fetch` may reach.
    pub fetch: FetchPolicy,
    /// The search backend of `web_search` (a SearXNG-compatible JSON endpoint), if any.
    pub search_url: Option<String>,
    /// Leave `echo` out (a real model has no use for a tool that does nothing; see
    /// `SUBAGENTS_ECHO_TOOL`).
    pub hide_echo: bool,
}

/// The tools this process can offer, by name.
#[derive(Clone)]
pub struct ToolRegistry {
    tools: BTreeMap<String, Arc<dyn Tool>>,
    journal: Option<PathBuf>,
    allow_bash: bool,
}

impl std::fmt::Debug for ToolRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ToolRegistry")
            .field("tools", &self.tools.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// What a name in an agent's `tools:` list means here: one of our tools, the delegation tools,
/// or something this process cannot honour (and why).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Named {
    /// This tool.
    Tool(&'static str),
    /// `Task`/`Agent`: turns delegation on (see [`crate::delegation::offered`]).
    Delegation,
    /// `mcp__<server>` or `mcp__<server>__<tool>`: an MCP server's tools (see [`crate::mcp`]).
    Mcp,
    /// Not available, with the reason for people.
    Unavailable(&'static str),
}

/// Claude Code's tool names (and ours), so its agent files keep their meaning. A rule suffix
/// such as `Bash(git status:*)` names the same tool.
pub fn lookup(name: &str) -> Named {
    let base = name.split('(').next().unwrap_or(name).trim();
    match base {
        "Read" | "read_file" => Named::Tool("read_file"),
        "Write" | "write_file" => Named::Tool("write_file"),
        "Edit" | "edit_file" => Named::Tool("edit_file"),
        "MultiEdit" | "multi_edit" => Named::Tool("multi_edit"),
        "LS" | "list_dir" => Named::Tool("list_dir"),
        "Glob" | "glob" => Named::Tool("glob"),
        "Grep" | "grep" => Named::Tool("grep"),
        "Bash" | "bash" => Named::Tool("bash"),
        "WebFetch" | "web_fetch" => Named::Tool("web_fetch"),
        "WebSearch" | "web_search" => Named::Tool("web_search"),
        "echo" => Named::Tool("echo"),
        "TodoWrite" | "todo_write" => Named::Tool("todo_write"),
        "Task" | "Agent" | "task" => Named::Delegation,
        n if n.starts_with("subagent_") => Named::Delegation,
        "TodoRead" => {
            Named::Unavailable("the plan is in the conversation: todo_write's result shows it")
        }
        "NotebookEdit" | "NotebookRead" => Named::Unavailable("notebooks are not supported"),
        n if n.starts_with("mcp__") => Named::Mcp,
        _ => Named::Unavailable("no such tool"),
    }
}

/// What an agent's tool list comes to on this process.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Resolution {
    /// The tools it gets, in the order it named them.
    pub tools: Vec<String>,
    /// Names it cannot have, each with the reason.
    pub unavailable: Vec<(String, String)>,
    /// MCP servers and tools it names (`mcp__…`), resolved at run time from the configured
    /// servers.
    pub mcp: Vec<String>,
}

impl ToolRegistry {
    /// The built-ins with default settings; `journal`, if set, gets one line per tool
    /// execution (`key<TAB>tool`), written before the tool runs: an audit trail operators (and
    /// the kill tests) read to see exactly what was executed.
    pub fn builtin(journal: Option<PathBuf>) -> Self {
        Self::with_settings(ToolSettings {
            journal,
            ..Default::default()
        })
    }

    /// The built-ins with these settings.
    pub fn with_settings(settings: ToolSettings) -> Self {
        let mut tools: BTreeMap<String, Arc<dyn Tool>> = BTreeMap::new();
        let mut builtins: Vec<Arc<dyn Tool>> = vec![
            Arc::new(fs::ReadFile),
            Arc::new(fs::WriteFile),
            Arc::new(fs::EditFile),
            Arc::new(fs::MultiEdit),
            Arc::new(fs::ListDir),
            Arc::new(search::Glob),
            Arc::new(search::Grep),
            Arc::new(web::WebFetch {
                policy: settings.fetch.clone(),
            }),
            Arc::new(todo::TodoWrite),
        ];
        if !settings.hide_echo {
            builtins.push(Arc::new(Echo));
        }
        for t in builtins {
            tools.insert(t.spec().function.name.clone(), t);
        }
        if settings.allow_bash {
            tools.insert("bash".into(), Arc::new(shell::Bash));
        }
        if let Some(url) = settings.search_url.filter(|u| !u.trim().is_empty()) {
            tools.insert(
                "web_search".into(),
                Arc::new(search_web::WebSearch {
                    url,
                    timeout: settings.fetch.timeout,
                }),
            );
        }
        Self {
            tools,
            journal: settings.journal,
            allow_bash: settings.allow_bash,
        }
    }

    /// Adds a tool (embedders, tests).
    pub fn register(&mut self, tool: Arc<dyn Tool>) {
        self.tools.insert(tool.spec().function.name.clone(), tool);
    }

    /// What an agent gets. Without a `tools:` list: every tool but `bash` (a shell must be
    /// asked for by name).
    pub fn resolve(&self, agent: &AgentDef) -> Resolution {
        let Some(list) = &agent.tools else {
            return Resolution {
                tools: self
                    .tools
                    .keys()
                    .filter(|n| *n != "bash")
                    .cloned()
                    .collect(),
                ..Default::default()
            };
        };
        let mut r = Resolution::default();
        for name in list {
            match lookup(name) {
                Named::Delegation => {}
                // MCP tools come from the configured servers at run time (`crate::mcp`).
                Named::Mcp => r.mcp.push(name.trim().to_owned()),
                Named::Tool(t) if self.tools.contains_key(t) => {
                    if !r.tools.iter().any(|o| o == t) {
                        r.tools.push(t.to_owned());
                    }
                }
                Named::Tool("bash") if !self.allow_bash => {
                    r.unavailable.push((
                        name.clone(),
                        "bash is off: an operator enables it with SUBAGENTS_ALLOW_BASH=1".into(),
                    ));
                }
                Named::Tool("web_search") => {
                    r.unavailable.push((name.clone(), "no web search backend is configured: an operator sets SUBAGENTS_SEARCH_URL".into()));
                }
                Named::Tool(_) => r
                    .unavailable
                    .push((name.clone(), "not offered by this process".into())),
                Named::Unavailable(_) if self.tools.contains_key(name.as_str()) => {
                    // An embedder's own tool (registered under its own name).
                    if !r.tools.iter().any(|o| o == name) {
                        r.tools.push(name.clone());
                    }
                }
                Named::Unavailable(why) => r.unavailable.push((name.clone(), why.into())),
            }
        }
        r
    }

    /// Names of the tools an agent may use (see [`ToolRegistry::resolve`]).
    pub fn allowed_for(&self, agent: &AgentDef) -> Vec<String> {
        self.resolve(agent).tools
    }

    /// Specs for the named tools.
    pub fn specs(&self, names: &[String]) -> Vec<ToolSpec> {
        names
            .iter()
            .filter_map(|n| self.tools.get(n))
            .map(|t| t.spec())
            .collect()
    }

    /// Runs one call by name with raw JSON arguments. Errors come back as `Err` so the caller
    /// can report them to the model.
    pub async fn execute(
        &self,
        name: &str,
        raw_args: &str,
        ctx: &ToolCtx,
    ) -> Result<String, ToolError> {
        let tool = self.tools.get(name).ok_or_else(|| {
            ToolError::new(
                ErrorCode::UnknownTool,
                format!("there is no tool `{name}`; use one of the tools offered"),
            )
        })?;
        let args: Value = if raw_args.trim().is_empty() {
            json!({})
        } else {
            serde_json::from_str(raw_args).map_err(|e| {
                ToolError::new(
                    ErrorCode::BadArguments,
                    format!("arguments are not valid JSON ({e}); send a JSON object"),
                )
            })?
        };
        if !args.is_object() {
            return Err(ToolError::new(
                ErrorCode::BadArguments,
                "arguments must be a JSON object",
            ));
        }
        if let Some(j) = &self.journal
            && let Ok(mut f) = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(j)
        {
            let _ = writeln!(f, "{}\t{name}", ctx.idempotency_key);
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
    format!(
        "{}\n[output truncated: {} of {} bytes shown]",
        &text[..cut],
        cut,
        text.len()
    )
}
