//! File tools: `read_file`, `write_file`, `edit_file`, `multi_edit`, `list_dir`. Every path is
//! opened through the owner's workspace capability (see [`super::workspace_dir`]).
//!
//! Replays after a crash: `read_file` and `list_dir` have no effect; `write_file` writes the
//! same whole content again (same file); `edit_file` and `multi_edit` apply their replacement
//! again only if `old_string` is still found — after an edit that had already been applied, a
//! replay reports "not found" (the file already holds the new text), never edits twice.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use async_trait::async_trait;
use serde_json::{Value, json};

use super::{
    ErrorCode, Tool, ToolCtx, ToolError, blocking, io_error, open_plain, relative, spec, str_arg,
    workspace_dir, write_plain,
};
use crate::model::ToolSpec;

/// Room kept under the output limit for the closing note.
const NOTE_ROOM: usize = 160;
/// Lines read when the call gives no `limit` (as Claude Code's Read).
const DEFAULT_LINES: u64 = 2000;
/// A longer line is cut (minified files would otherwise fill the output with one line).
const MAX_LINE_CHARS: usize = 2000;
/// Bytes looked at to tell text from binary.
const SNIFF_BYTES: usize = 8192;
/// The largest file the edit tools load, and the largest result an edit may produce.
pub const MAX_EDIT_BYTES: usize = 8 * 1024 * 1024;

/// `read_file`: numbered lines of a UTF-8 text file, from `offset`, at most `limit` lines, and
/// never more than the output limit: the file is read as a stream, so a huge file (or a pipe
/// that never ends) costs no more than a small one.
pub struct ReadFile;

#[async_trait]
impl Tool for ReadFile {
    fn spec(&self) -> ToolSpec {
        spec(
            "read_file",
            "Reads a UTF-8 text file from the workspace, as numbered lines (`   12\\tline`). `path` is relative to the workspace. `offset` is the first line to read (1-based, default 1), `limit` the number of lines (default 2000). Long outputs stop with a note saying where to continue. Binary files are refused.",
            json!({"type":"object","properties":{
                "path":{"type":"string"},
                "offset":{"type":"integer","minimum":1},
                "limit":{"type":"integer","minimum":1}},"required":["path"]}),
        )
    }
    async fn call(&self, args: Value, ctx: &ToolCtx) -> Result<String, ToolError> {
        let rel = str_arg(&args, "path")?.to_owned();
        let offset = positive(&args, "offset")?.unwrap_or(1);
        let limit = positive(&args, "limit")?.unwrap_or(DEFAULT_LINES);
        let workspace = ctx.workspace.clone();
        let budget = ctx.output_limit.saturating_sub(NOTE_ROOM).max(64);
        blocking(move || {
            let dir = workspace_dir(&workspace)?;
            let file = open_plain(&dir, relative(&rel)?, &rel, false)?;
            let meta = file.metadata().map_err(|e| io_error(&rel, e))?;
            let mut reader = BufReader::with_capacity(64 * 1024, file);
            let head = reader.fill_buf().map_err(|e| io_error(&rel, e))?;
            if head[..head.len().min(SNIFF_BYTES)].contains(&0) {
                return Err(ToolError::new(
                    ErrorCode::NotText,
                    format!("`{rel}` is a binary file; read_file reads text only"),
                ));
            }
            numbered_lines(&mut reader, &rel, meta.len(), offset, limit, budget)
        })
        .await
    }
}

/// Reads lines `offset..offset+limit` as `{n:>6}\t{line}`, within `budget` bytes of output.
fn numbered_lines(
    reader: &mut impl BufRead,
    rel: &str,
    size: u64,
    offset: u64,
    limit: u64,
    budget: usize,
) -> Result<String, ToolError> {
    let mut out = String::new();
    let mut n: u64 = 0;
    let mut line = Vec::new();
    loop {
        line.clear();
        // A line is read only up to what could be shown, so one endless line stays bounded.
        let read = reader
            .by_ref()
            .take(MAX_LINE_CHARS as u64 * 4 + 1)
            .read_until(b'\n', &mut line)
            .map_err(|e| io_error(rel, e))?;
        if read == 0 {
            break;
        }
        if line.last() != Some(&b'\n') && read > MAX_LINE_CHARS * 4 {
            // The rest of an over-long line is skipped.
            let mut rest = Vec::new();
            reader
                .read_until(b'\n', &mut rest)
                .map_err(|e| io_error(rel, e))?;
        }
        n += 1;
        if n < offset {
            continue;
        }
        if n >= offset + limit {
            out.push_str(&format!(
                "[more lines follow: read_file with path=`{rel}` offset={n} reads on]"
            ));
            return Ok(out);
        }
        let text = match std::str::from_utf8(&line) {
            Ok(t) => t.to_owned(),
            // A cut inside the last character of an over-long line is not binary data.
            Err(e) if e.error_len().is_none() => {
                String::from_utf8_lossy(&line[..e.valid_up_to()]).into_owned()
            }
            Err(_) => {
                return Err(ToolError::new(
                    ErrorCode::NotText,
                    format!("`{rel}` is not UTF-8 text (line {n})"),
                ));
            }
        };
        let text = text.trim_end_matches(['\n', '\r']);
        let shown: String = text.chars().take(MAX_LINE_CHARS).collect();
        let cut = if shown.len() < text.len() {
            " [line cut]"
        } else {
            ""
        };
        let entry = format!("{n:>6}\t{shown}{cut}\n");
        if out.len() + entry.len() > budget {
            out.push_str(&format!("[output limit reached at line {n} of `{rel}` ({size} bytes): read_file with path=`{rel}` offset={n} reads on]"));
            return Ok(out);
        }
        out.push_str(&entry);
    }
    if n < offset {
        return Ok(if n == 0 {
            "(empty file)".into()
        } else {
            format!("(the file has {n} lines; offset {offset} is past its end)")
        });
    }
    Ok(out)
}

fn positive(args: &Value, key: &str) -> Result<Option<u64>, ToolError> {
    match args.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64().or_else(|| {
            v.as_f64()
                .filter(|f| f.fract() == 0.0 && *f >= 1.0)
                .map(|f| f as u64)
        }) {
            Some(n) if n >= 1 => Ok(Some(n)),
            _ => Err(ToolError::new(
                ErrorCode::BadArguments,
                format!("`{key}` must be a whole number from 1"),
            )),
        },
    }
}

/// `write_file`: creates or replaces a file (and its parent directories) in the workspace.
pub struct WriteFile;

#[async_trait]
impl Tool for WriteFile {
    fn spec(&self) -> ToolSpec {
        spec(
            "write_file",
            "Creates or overwrites a text file in the workspace (parent directories are created). `path` is relative to the workspace. To change part of a file, use edit_file.",
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
                return Err(ToolError::new(
                    ErrorCode::IsDirectory,
                    format!("`{rel}` is a directory"),
                ));
            }
            if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
                dir.create_dir_all(parent).map_err(|e| io_error(&rel, e))?;
            }
            write_plain(&dir, path, &rel, content.as_bytes())?;
            Ok(format!("wrote {} bytes to {rel}", content.len()))
        })
        .await
    }
}

/// One replacement of [`EditFile`] or [`MultiEdit`].
struct Edit {
    old: String,
    new: String,
    all: bool,
}

impl Edit {
    fn from(v: &Value) -> Result<Edit, ToolError> {
        let old = str_arg(v, "old_string")?.to_owned();
        let new = str_arg(v, "new_string")?.to_owned();
        if old.is_empty() {
            return Err(ToolError::new(
                ErrorCode::BadArguments,
                "`old_string` is empty: to create a file, use write_file",
            ));
        }
        if old == new {
            return Err(ToolError::new(
                ErrorCode::BadArguments,
                "`old_string` and `new_string` are the same: nothing would change",
            ));
        }
        Ok(Edit {
            old,
            new,
            all: v
                .get("replace_all")
                .and_then(Value::as_bool)
                .unwrap_or(false),
        })
    }

    /// Applies it to `text`, or says why not; returns the number of replacements. The size of
    /// the result is known before it is built, and one over [`MAX_EDIT_BYTES`] is refused: a
    /// `replace_all` of a short string by a long one could otherwise ask for gigabytes.
    fn apply(&self, text: &mut String, rel: &str, which: &str) -> Result<usize, ToolError> {
        let found = text.matches(self.old.as_str()).count();
        let size = (text.len() as u128 - (found * self.old.len()) as u128)
            + (found as u128) * (self.new.len() as u128);
        if found > 0 && (found == 1 || self.all) && size > MAX_EDIT_BYTES as u128 {
            return Err(ToolError::new(
                ErrorCode::EditTooLarge,
                format!(
                    "{which}the edit would make `{rel}` {size} bytes, more than the {MAX_EDIT_BYTES} an edit may produce; edit fewer occurrences at a time"
                ),
            ));
        }
        match found {
            0 => Err(ToolError::new(
                ErrorCode::NotFound,
                format!(
                    "{which}`old_string` was not found in `{rel}`; read the file and copy the text exactly, including whitespace"
                ),
            )),
            n if n > 1 && !self.all => Err(ToolError::new(
                ErrorCode::NotUnique,
                format!(
                    "{which}`old_string` occurs {n} times in `{rel}`; add surrounding lines to make it unique, or set replace_all"
                ),
            )),
            n => {
                *text = text.replace(self.old.as_str(), &self.new);
                Ok(n)
            }
        }
    }
}

/// Reads a text file, applies `edits` in order (all or none), writes it back.
fn edit_in_place(workspace: &Path, rel: &str, edits: &[Edit]) -> Result<String, ToolError> {
    let dir = workspace_dir(workspace)?;
    let path = relative(rel)?;
    let mut file = open_plain(&dir, path, rel, false)?;
    let size = file.metadata().map_err(|e| io_error(rel, e))?.len();
    if size > MAX_EDIT_BYTES as u64 {
        return Err(ToolError::new(
            ErrorCode::FileTooLarge,
            format!(
                "`{rel}` is {size} bytes; the edit tools load files up to {MAX_EDIT_BYTES} bytes"
            ),
        ));
    }
    let mut bytes = Vec::with_capacity(size as usize);
    file.by_ref()
        .take(MAX_EDIT_BYTES as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| io_error(rel, e))?;
    drop(file);
    if bytes.len() > MAX_EDIT_BYTES {
        return Err(ToolError::new(
            ErrorCode::FileTooLarge,
            format!("`{rel}` grew past {MAX_EDIT_BYTES} bytes while it was read"),
        ));
    }
    let mut text = String::from_utf8(bytes)
        .map_err(|_| ToolError::new(ErrorCode::NotText, format!("`{rel}` is not UTF-8 text")))?;
    let mut total = 0;
    for (i, e) in edits.iter().enumerate() {
        let which = if edits.len() > 1 {
            format!("edit {}: ", i + 1)
        } else {
            String::new()
        };
        total += e.apply(&mut text, rel, &which)?;
    }
    write_plain(&dir, path, rel, text.as_bytes())?;
    Ok(format!(
        "edited {rel}: {total} replacement{}",
        if total == 1 { "" } else { "s" }
    ))
}

/// `edit_file`: replaces an exact string in a file.
pub struct EditFile;

#[async_trait]
impl Tool for EditFile {
    fn spec(&self) -> ToolSpec {
        spec(
            "edit_file",
            "Replaces `old_string` with `new_string` in a workspace file. `old_string` must match exactly (whitespace included) and occur once, unless `replace_all` is true. Read the file first.",
            json!({"type":"object","properties":{
                "path":{"type":"string"},"old_string":{"type":"string"},"new_string":{"type":"string"},
                "replace_all":{"type":"boolean"}},"required":["path","old_string","new_string"]}),
        )
    }
    async fn call(&self, args: Value, ctx: &ToolCtx) -> Result<String, ToolError> {
        let rel = str_arg(&args, "path")?.to_owned();
        let edit = Edit::from(&args)?;
        let workspace = ctx.workspace.clone();
        blocking(move || edit_in_place(&workspace, &rel, &[edit])).await
    }
}

/// `multi_edit`: several replacements in one file, applied in order, all or none.
pub struct MultiEdit;

#[async_trait]
impl Tool for MultiEdit {
    fn spec(&self) -> ToolSpec {
        spec(
            "multi_edit",
            "Applies several edit_file replacements to one file, in order; if any fails, none is applied.",
            json!({"type":"object","properties":{
                "path":{"type":"string"},
                "edits":{"type":"array","minItems":1,"items":{"type":"object","properties":{
                    "old_string":{"type":"string"},"new_string":{"type":"string"},"replace_all":{"type":"boolean"}},
                    "required":["old_string","new_string"]}}},"required":["path","edits"]}),
        )
    }
    async fn call(&self, args: Value, ctx: &ToolCtx) -> Result<String, ToolError> {
        let rel = str_arg(&args, "path")?.to_owned();
        let edits = args
            .get("edits")
            .and_then(Value::as_array)
            .filter(|a| !a.is_empty())
            .ok_or_else(|| {
                ToolError::new(
                    ErrorCode::BadArguments,
                    "`edits` must be a non-empty list of {old_string, new_string}",
                )
            })?
            .iter()
            .map(Edit::from)
            .collect::<Result<Vec<_>, _>>()?;
        let workspace = ctx.workspace.clone();
        blocking(move || edit_in_place(&workspace, &rel, &edits)).await
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
        let rel = args
            .get("path")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned();
        let workspace = ctx.workspace.clone();
        blocking(move || {
            let dir = workspace_dir(&workspace)?;
            let path = if rel.is_empty() {
                Path::new(".")
            } else {
                relative(&rel)?
            };
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
            Ok(if names.is_empty() {
                "(empty)".into()
            } else {
                names.join("\n")
            })
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::super::{ToolRegistry, owner_workspace, truncate_output};
    use super::*;

    fn ctx(dir: &Path) -> ToolCtx {
        ToolCtx::new(dir, "k", 16 * 1024)
    }

    async fn run(
        reg: &ToolRegistry,
        c: &ToolCtx,
        tool: &str,
        args: Value,
    ) -> Result<String, ToolError> {
        reg.execute(tool, &args.to_string(), c).await
    }

    #[tokio::test]
    async fn paths_that_leave_the_workspace_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let ws = dir.path().join("ws");
        let reg = ToolRegistry::builtin(None);
        let c = ctx(&ws);
        for bad in ["../x", "/etc/passwd", "a/../../x"] {
            let e = run(&reg, &c, "read_file", json!({"path": bad}))
                .await
                .unwrap_err();
            assert_eq!(e.code, "path_outside_workspace", "{bad}");
        }
        std::fs::create_dir_all(&ws).unwrap();
        std::os::unix::fs::symlink("/etc", ws.join("link")).unwrap();
        assert_eq!(
            run(&reg, &c, "read_file", json!({"path": "link/passwd"}))
                .await
                .unwrap_err()
                .code,
            "path_outside_workspace"
        );
        assert_eq!(
            run(&reg, &c, "grep", json!({"pattern": "root", "path": "link"}))
                .await
                .unwrap_err()
                .code,
            "path_outside_workspace"
        );
        assert_eq!(
            run(&reg, &c, "glob", json!({"pattern": "*", "path": "link"}))
                .await
                .unwrap_err()
                .code,
            "path_outside_workspace"
        );
        // A dangling link: writing through it would create a file outside.
        let outside = dir.path().join("outside.txt");
        std::os::unix::fs::symlink(&outside, ws.join("dangling")).unwrap();
        for (tool, args) in [
            ("write_file", json!({"path": "dangling", "content": "x"})),
            (
                "edit_file",
                json!({"path": "dangling", "old_string": "a", "new_string": "b"}),
            ),
        ] {
            let e = run(&reg, &c, tool, args).await.unwrap_err();
            assert!(
                matches!(
                    e.code,
                    ErrorCode::PathOutsideWorkspace | ErrorCode::NotFound
                ),
                "{tool}: {e}"
            );
        }
        assert!(
            !outside.exists(),
            "a tool created a file outside the workspace"
        );
    }

    #[test]
    fn owners_get_their_own_directories() {
        let root = Path::new("/w");
        assert_eq!(
            owner_workspace(root, &"alice".into()),
            Path::new("/w/alice")
        );
        let odd = owner_workspace(root, &"../etc".into());
        assert!(
            odd.to_str().unwrap().starts_with("/w/owner-") && odd.components().count() == 3,
            "{odd:?}"
        );
        assert_ne!(
            owner_workspace(root, &"a/b".into()),
            owner_workspace(root, &"a/c".into())
        );
    }

    #[test]
    fn truncation_is_marked() {
        assert_eq!(truncate_output("abc".into(), 10), "abc");
        let t = truncate_output("é".repeat(10), 5);
        assert!(
            t.starts_with("éé\n[output truncated: 4 of 20 bytes shown]"),
            "{t}"
        );
    }

    #[tokio::test]
    async fn files_round_trip_and_bad_args_are_reported() {
        let dir = tempfile::tempdir().unwrap();
        let reg = ToolRegistry::builtin(None);
        let c = ctx(dir.path());
        run(
            &reg,
            &c,
            "write_file",
            json!({"path": "d/x.txt", "content": "hi\nthere\n"}),
        )
        .await
        .unwrap();
        assert_eq!(
            run(&reg, &c, "read_file", json!({"path": "d/x.txt"}))
                .await
                .unwrap(),
            "     1\thi\n     2\tthere\n"
        );
        assert_eq!(run(&reg, &c, "list_dir", json!({})).await.unwrap(), "d/");
        assert_eq!(
            run(&reg, &c, "list_dir", json!({"path": "d"}))
                .await
                .unwrap(),
            "x.txt"
        );
        assert_eq!(
            reg.execute("read_file", "{", &c).await.unwrap_err().code,
            "bad_arguments"
        );
        assert_eq!(
            run(&reg, &c, "nope", json!({})).await.unwrap_err().code,
            "unknown_tool"
        );
        assert_eq!(
            run(&reg, &c, "read_file", json!({"path": "zz"}))
                .await
                .unwrap_err()
                .code,
            "not_found"
        );
        assert_eq!(
            run(&reg, &c, "read_file", json!({"path": "d"}))
                .await
                .unwrap_err()
                .code,
            "is_directory"
        );
        assert_eq!(
            run(
                &reg,
                &c,
                "read_file",
                json!({"path": "d/x.txt", "offset": 0})
            )
            .await
            .unwrap_err()
            .code,
            "bad_arguments"
        );
        assert_eq!(
            run(&reg, &c, "write_file", json!({"path": "d", "content": ""}))
                .await
                .unwrap_err()
                .code,
            "is_directory"
        );
        std::fs::write(dir.path().join("empty"), "").unwrap();
        assert_eq!(
            run(&reg, &c, "read_file", json!({"path": "empty"}))
                .await
                .unwrap(),
            "(empty file)"
        );
    }

    #[tokio::test]
    async fn read_file_pages_by_line_and_refuses_binary() {
        let dir = tempfile::tempdir().unwrap();
        let reg = ToolRegistry::builtin(None);
        let c = ctx(dir.path());
        let text: String = (1..=50).map(|i| format!("line {i}\n")).collect();
        std::fs::write(dir.path().join("f.txt"), &text).unwrap();
        let page = run(
            &reg,
            &c,
            "read_file",
            json!({"path": "f.txt", "offset": 10, "limit": 3}),
        )
        .await
        .unwrap();
        assert_eq!(
            page,
            "    10\tline 10\n    11\tline 11\n    12\tline 12\n[more lines follow: read_file with path=`f.txt` offset=13 reads on]"
        );
        let past = run(
            &reg,
            &c,
            "read_file",
            json!({"path": "f.txt", "offset": 99}),
        )
        .await
        .unwrap();
        assert_eq!(past, "(the file has 50 lines; offset 99 is past its end)");
        std::fs::write(dir.path().join("b.bin"), [0x7f, b'E', b'L', b'F', 0, 1, 2]).unwrap();
        assert_eq!(
            run(&reg, &c, "read_file", json!({"path": "b.bin"}))
                .await
                .unwrap_err()
                .code,
            "not_text"
        );
        let long = "x".repeat(5000);
        std::fs::write(dir.path().join("long.txt"), format!("{long}\nafter\n")).unwrap();
        let out = run(&reg, &c, "read_file", json!({"path": "long.txt"}))
            .await
            .unwrap();
        assert!(
            out.contains("[line cut]") && out.contains("     2\tafter"),
            "{out}"
        );
    }

    #[tokio::test]
    async fn reads_stop_at_the_output_limit() {
        let dir = tempfile::tempdir().unwrap();
        let reg = ToolRegistry::builtin(None);
        let mut c = ctx(dir.path());
        c.output_limit = 1000;
        // A 4 GiB file of one endless line, and a 4 GiB file of short lines: either read whole
        // would take the worker down; both answer at once.
        let f = std::fs::File::create(dir.path().join("huge.txt")).unwrap();
        f.set_len(4 << 30).unwrap();
        assert_eq!(
            run(&reg, &c, "read_file", json!({"path": "huge.txt"}))
                .await
                .unwrap_err()
                .code,
            "not_text",
            "zeros are binary"
        );
        let lines = "a line of text\n".repeat(200);
        std::fs::write(dir.path().join("many.txt"), lines.repeat(1000)).unwrap();
        let out = run(&reg, &c, "read_file", json!({"path": "many.txt"}))
            .await
            .unwrap();
        assert!(out.len() <= 1000, "{}", out.len());
        assert!(out.ends_with("reads on]"), "{out}");
    }

    #[tokio::test]
    async fn edits_are_exact_and_all_or_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let reg = ToolRegistry::builtin(None);
        let c = ctx(dir.path());
        std::fs::write(dir.path().join("e.txt"), "alpha beta\nbeta gamma\n").unwrap();
        let e = run(
            &reg,
            &c,
            "edit_file",
            json!({"path": "e.txt", "old_string": "beta", "new_string": "B"}),
        )
        .await
        .unwrap_err();
        assert_eq!(e.code, "not_unique");
        let e = run(
            &reg,
            &c,
            "edit_file",
            json!({"path": "e.txt", "old_string": "delta", "new_string": "D"}),
        )
        .await
        .unwrap_err();
        assert_eq!(e.code, "not_found");
        run(
            &reg,
            &c,
            "edit_file",
            json!({"path": "e.txt", "old_string": "alpha beta", "new_string": "ALPHA"}),
        )
        .await
        .unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.path().join("e.txt")).unwrap(),
            "ALPHA\nbeta gamma\n"
        );
        let all = run(
            &reg,
            &c,
            "edit_file",
            json!({"path": "e.txt", "old_string": "a", "new_string": "4", "replace_all": true}),
        )
        .await
        .unwrap();
        assert_eq!(all, "edited e.txt: 3 replacements");
        // multi_edit applies in order; a failing edit leaves the file as it was.
        let before = std::fs::read_to_string(dir.path().join("e.txt")).unwrap();
        let e = run(&reg, &c, "multi_edit", json!({"path": "e.txt", "edits": [
            {"old_string": "ALPHA", "new_string": "one"}, {"old_string": "missing", "new_string": "x"}]})).await.unwrap_err();
        assert!(
            e.code == "not_found" && e.message.starts_with("edit 2:"),
            "{e}"
        );
        assert_eq!(
            std::fs::read_to_string(dir.path().join("e.txt")).unwrap(),
            before
        );
        run(&reg, &c, "multi_edit", json!({"path": "e.txt", "edits": [
            {"old_string": "ALPHA", "new_string": "one"}, {"old_string": "one", "new_string": "two"}]})).await.unwrap();
        assert!(
            std::fs::read_to_string(dir.path().join("e.txt"))
                .unwrap()
                .starts_with("two\n")
        );
    }
}
