//! Search tools on the crates ripgrep is made of: `glob` (file names) and `grep` (contents).
//! Both honour `.gitignore` files wherever they are, skip hidden files, never follow symlinks,
//! sort what they find and cap it, saying what was cut. They have no side effects.
//!
//! Confinement: the directory searched is opened through the owner's workspace capability (so
//! no `..`, absolute path or link leaves it), and the walk goes on by directory handles,
//! opening each entry relative to its directory without following links, so swapping a link in
//! while it runs cannot redirect it. Files with more than one hard link are skipped, and so are
//! files the run's read rules do not let it read.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use cap_std::fs::{Dir, OpenOptionsExt};
use ignore::gitignore::{Gitignore, GitignoreBuilder};

use async_trait::async_trait;
use globset::{GlobBuilder, GlobMatcher};
use grep_regex::RegexMatcherBuilder;
use grep_searcher::{BinaryDetection, Searcher, SearcherBuilder, Sink, SinkContext, SinkMatch};
use serde_json::{Value, json};

use super::{
    ErrorCode, Readable, Tool, ToolCtx, ToolError, blocking, io_error, relative, spec, str_arg,
    workspace_dir,
};
use crate::model::ToolSpec;

/// Most paths `glob` lists, and most files or lines `grep` reports.
const MAX_RESULTS: usize = 200;
/// Most context lines around a `grep` match.
const MAX_CONTEXT: u64 = 10;

/// Deepest directory a search descends into.
const MAX_DEPTH: usize = 64;
/// Most directory entries one search looks at.
const MAX_ENTRIES: usize = 1_000_000;

/// A file the walk found: where it is, and how to open it.
struct Found<'a> {
    /// Its workspace-relative path.
    shown: &'a str,
    dir: &'a Dir,
    name: &'a std::ffi::OsStr,
}

impl Found<'_> {
    /// Opens it, relative to its directory's handle: never through a link (one swapped in
    /// since the directory was read is refused), never blocking, and only a plain file.
    fn open(&self) -> Option<std::fs::File> {
        let mut options = cap_std::fs::OpenOptions::new();
        options
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK);
        let file = self.dir.open_with(self.name, &options).ok()?.into_std();
        let meta = file.metadata().ok()?;
        (meta.is_file() && meta.nlink() == 1).then_some(file)
    }
}

/// Walks the files beneath `rel` in the workspace, sorted, and hands each to `visit` (which
/// returns false to stop). The walk holds a handle on each directory and opens what is in it
/// relative to that handle without following links, so a directory swapped for a link while
/// the walk runs leads nowhere. Hidden entries are skipped, and `.gitignore` and `.ignore`
/// files are honoured wherever they are. Files the run may not read (`readable`) are not shown.
fn walk(
    workspace: &Path,
    rel: &str,
    readable: Option<&Readable>,
    mut visit: impl FnMut(&Found) -> bool,
) -> Result<(), ToolError> {
    let dir = workspace_dir(workspace)?;
    let start = if rel.is_empty() {
        Path::new(".")
    } else {
        relative(rel)?
    };
    let opened = dir.open_dir(start).map_err(|e| io_error(rel, e))?;
    let prefix = if rel.is_empty() || rel == "." {
        String::new()
    } else {
        format!("{}/", rel.trim_end_matches('/'))
    };
    let mut ignores = vec![];
    let mut budget = MAX_ENTRIES;
    walk_dir(
        &opened,
        &prefix,
        0,
        &mut ignores,
        &mut budget,
        readable,
        &mut visit,
    );
    Ok(())
}

/// One directory of [`walk`]; false when the visitor asked to stop.
fn walk_dir(
    dir: &Dir,
    prefix: &str,
    depth: usize,
    ignores: &mut Vec<(String, Gitignore)>,
    budget: &mut usize,
    readable: Option<&Readable>,
    visit: &mut impl FnMut(&Found) -> bool,
) -> bool {
    if depth > MAX_DEPTH {
        return true;
    }
    let Ok(entries) = dir.entries() else {
        return true;
    };
    let mut list: Vec<(std::ffi::OsString, bool)> = vec![];
    for e in entries.flatten() {
        if *budget == 0 {
            break;
        }
        *budget -= 1;
        let name = e.file_name();
        if name.as_encoded_bytes().starts_with(b".") {
            continue;
        }
        // The entry's own type, not a link's target: links are never followed.
        let Ok(kind) = e.file_type() else { continue };
        if kind.is_dir() || kind.is_file() {
            list.push((name, kind.is_dir()));
        }
    }
    list.sort();
    // This directory's ignore files, read through its handle.
    let mut builder = GitignoreBuilder::new("");
    let mut any = false;
    for f in [".gitignore", ".ignore"] {
        if let Ok(text) = dir.read_to_string(f) {
            for line in text.lines() {
                any |= builder.add_line(None, line).is_ok();
            }
        }
    }
    let pushed = any
        && builder
            .build()
            .map(|g| ignores.push((prefix.to_owned(), g)))
            .is_ok();
    let mut go_on = true;
    for (name, is_dir) in &list {
        let shown = format!("{prefix}{}", name.to_string_lossy());
        if ignored(ignores, &shown, *is_dir) {
            continue;
        }
        if *is_dir {
            let mut options = cap_std::fs::OpenOptions::new();
            options
                .read(true)
                .custom_flags(libc::O_NOFOLLOW | libc::O_DIRECTORY);
            let Ok(sub) = dir.open_with(name, &options) else {
                continue;
            };
            let sub = Dir::from_std_file(sub.into_std());
            if !walk_dir(
                &sub,
                &format!("{shown}/"),
                depth + 1,
                ignores,
                budget,
                readable,
                visit,
            ) {
                go_on = false;
                break;
            }
        } else {
            if readable.is_some_and(|r| !(r.0)(&shown)) {
                continue;
            }
            if !visit(&Found {
                shown: &shown,
                dir,
                name,
            }) {
                go_on = false;
                break;
            }
        }
    }
    if pushed {
        ignores.pop();
    }
    go_on
}

/// Whether the ignore files above an entry exclude it: the nearest one that has a word on
/// it decides, as in git. Each matcher sees the path relative to its own directory.
fn ignored(ignores: &[(String, Gitignore)], shown: &str, is_dir: bool) -> bool {
    for (dir, g) in ignores.iter().rev() {
        let rel = shown.strip_prefix(dir.as_str()).unwrap_or(shown);
        match g.matched(rel, is_dir) {
            ignore::Match::Ignore(_) => return true,
            ignore::Match::Whitelist(_) => return false,
            ignore::Match::None => {}
        }
    }
    false
}

fn matcher(pattern: &str) -> Result<GlobMatcher, ToolError> {
    let glob = GlobBuilder::new(pattern)
        .literal_separator(true)
        .build()
        .map_err(|e| {
            ToolError::new(
                ErrorCode::BadArguments,
                format!("`{pattern}` is not a glob pattern: {e}"),
            )
        })?;
    Ok(glob.compile_matcher())
}

/// A glob without a `/` matches file names anywhere below (as `--glob` in ripgrep).
fn glob_matches(m: &GlobMatcher, pattern: &str, rel_to_start: &str) -> bool {
    if pattern.contains('/') {
        m.is_match(rel_to_start)
    } else {
        m.is_match(
            Path::new(rel_to_start)
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
        )
    }
}

/// `glob`: paths matching a pattern, sorted.
pub struct Glob;

#[async_trait]
impl Tool for Glob {
    fn spec(&self) -> ToolSpec {
        spec(
            "glob",
            "Finds files by name pattern in the workspace: `**/*.rs`, `src/*.toml`, `*.md` (a pattern without `/` matches file names at any depth). `path` is the directory to search (default: the workspace). Honours .gitignore; returns sorted paths, at most 200.",
            json!({"type":"object","properties":{"pattern":{"type":"string"},"path":{"type":"string"}},"required":["pattern"]}),
        )
    }
    async fn call(&self, args: Value, ctx: &ToolCtx) -> Result<String, ToolError> {
        let pattern = str_arg(&args, "pattern")?.to_owned();
        let rel = args
            .get("path")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned();
        let workspace = ctx.workspace.clone();
        let readable = ctx.readable.clone();
        blocking(move || {
            let m = matcher(&pattern)?;
            let start_len = if rel.is_empty() || rel == "." {
                0
            } else {
                rel.trim_end_matches('/').len() + 1
            };
            let mut found = vec![];
            let mut more = false;
            walk(&workspace, &rel, readable.as_ref(), |file| {
                let shown = file.shown;
                if glob_matches(&m, &pattern, &shown[start_len..]) {
                    if found.len() == MAX_RESULTS {
                        more = true;
                        return false;
                    }
                    found.push(shown.to_owned());
                }
                true
            })?;
            if found.is_empty() {
                return Ok(format!("no files match `{pattern}`"));
            }
            let mut out = found.join("\n");
            if more {
                out.push_str(&format!(
                    "\n[more than {MAX_RESULTS} files match; narrow the pattern or the path]"
                ));
            }
            Ok(out)
        })
        .await
    }
}

/// What `grep` reports.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Files,
    Content,
    Count,
}

/// Collects a file's matching lines (and context lines) for `grep`.
struct Lines<'a> {
    path: &'a str,
    out: &'a mut Vec<String>,
    matches: usize,
    content: bool,
    budget_left: &'a mut usize,
}

impl Lines<'_> {
    fn push(&mut self, sep: char, line: Option<u64>, bytes: &[u8]) -> bool {
        if !self.content {
            return true;
        }
        let text = String::from_utf8_lossy(bytes);
        let entry = format!(
            "{}{sep}{}{sep}{}",
            self.path,
            line.unwrap_or(0),
            text.trim_end_matches(['\n', '\r'])
        );
        if self.out.len() >= MAX_RESULTS || *self.budget_left < entry.len() {
            return false;
        }
        *self.budget_left -= entry.len() + 1;
        self.out.push(entry);
        true
    }
}

impl Sink for Lines<'_> {
    type Error = std::io::Error;

    fn matched(&mut self, _: &Searcher, m: &SinkMatch<'_>) -> Result<bool, std::io::Error> {
        self.matches += 1;
        Ok(self.push(':', m.line_number(), m.bytes()))
    }

    fn context(&mut self, _: &Searcher, c: &SinkContext<'_>) -> Result<bool, std::io::Error> {
        Ok(self.push('-', c.line_number(), c.bytes()))
    }
}

/// `grep`: a regular expression over the workspace's files.
pub struct Grep;

#[async_trait]
impl Tool for Grep {
    fn spec(&self) -> ToolSpec {
        spec(
            "grep",
            "Searches file contents in the workspace with a regular expression (Rust regex syntax, as ripgrep). `output_mode`: `files_with_matches` (default: the files that match), `content` (matching lines as `path:line:text`, with `context` lines around as `path-line-text`), or `count` (`path:matches`). `glob` filters files (`*.rs`, `src/**/*.ts`); `path` is the directory to search; `case_insensitive` ignores case. Honours .gitignore, skips binary files; sorted, at most 200 results.",
            json!({"type":"object","properties":{
                "pattern":{"type":"string"},"path":{"type":"string"},"glob":{"type":"string"},
                "output_mode":{"type":"string","enum":["files_with_matches","content","count"]},
                "context":{"type":"integer","minimum":0,"maximum":10},
                "case_insensitive":{"type":"boolean"}},"required":["pattern"]}),
        )
    }
    async fn call(&self, args: Value, ctx: &ToolCtx) -> Result<String, ToolError> {
        let pattern = str_arg(&args, "pattern")?.to_owned();
        let rel = args
            .get("path")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned();
        let glob = args.get("glob").and_then(Value::as_str).map(str::to_owned);
        let mode = match args
            .get("output_mode")
            .and_then(Value::as_str)
            .unwrap_or("files_with_matches")
        {
            "files_with_matches" => Mode::Files,
            "content" => Mode::Content,
            "count" => Mode::Count,
            other => {
                return Err(ToolError::new(
                    ErrorCode::BadArguments,
                    format!("output_mode `{other}` is not files_with_matches, content or count"),
                ));
            }
        };
        let context = args
            .get("context")
            .and_then(Value::as_u64)
            .unwrap_or(0)
            .min(MAX_CONTEXT) as usize;
        let ci = args
            .get("case_insensitive")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let workspace = ctx.workspace.clone();
        let readable = ctx.readable.clone();
        let mut budget = ctx.output_limit.saturating_sub(200);
        blocking(move || {
            let regex = RegexMatcherBuilder::new()
                .case_insensitive(ci)
                .build(&pattern)
                .map_err(|e| {
                    ToolError::new(
                        ErrorCode::BadArguments,
                        format!("`{pattern}` is not a valid regular expression: {e}"),
                    )
                })?;
            let filter = glob
                .as_deref()
                .map(|g| matcher(g).map(|m| (m, g.to_owned())))
                .transpose()?;
            let mut searcher = SearcherBuilder::new()
                .line_number(true)
                .before_context(if mode == Mode::Content { context } else { 0 })
                .after_context(if mode == Mode::Content { context } else { 0 })
                .binary_detection(BinaryDetection::quit(0))
                .build();
            let start_len = if rel.is_empty() || rel == "." {
                0
            } else {
                rel.trim_end_matches('/').len() + 1
            };
            let mut out: Vec<String> = vec![];
            let mut files = 0usize;
            let mut cut = false;
            walk(&workspace, &rel, readable.as_ref(), |found| {
                let shown = found.shown;
                if let Some((m, g)) = &filter
                    && !glob_matches(m, g, &shown[start_len..])
                {
                    return true;
                }
                let mut sink = Lines {
                    path: shown,
                    out: &mut out,
                    matches: 0,
                    content: mode == Mode::Content,
                    budget_left: &mut budget,
                };
                let Some(file) = found.open() else {
                    return true;
                };
                if searcher.search_file(&regex, &file, &mut sink).is_err() {
                    return true;
                }
                let n = sink.matches;
                if n == 0 {
                    return true;
                }
                files += 1;
                match mode {
                    Mode::Content => {}
                    Mode::Files | Mode::Count => {
                        let entry = if mode == Mode::Count {
                            format!("{shown}:{n}")
                        } else {
                            shown.to_owned()
                        };
                        if out.len() >= MAX_RESULTS || budget < entry.len() {
                            cut = true;
                            return false;
                        }
                        budget -= entry.len() + 1;
                        out.push(entry);
                    }
                }
                if mode == Mode::Content && (out.len() >= MAX_RESULTS || budget < 64) {
                    cut = true;
                    return false;
                }
                true
            })?;
            if out.is_empty() {
                return Ok(format!("no matches for `{pattern}`"));
            }
            let mut text = out.join("\n");
            if cut {
                text.push_str(&format!(
                    "\n[results cut after {} lines; narrow the pattern, path or glob]",
                    out.len()
                ));
            } else if mode == Mode::Content {
                text.push_str(&format!(
                    "\n[{files} file{} matched]",
                    if files == 1 { "" } else { "s" }
                ));
            }
            Ok(text)
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::super::ToolRegistry;
    use super::*;

    fn tree() -> (tempfile::TempDir, ToolCtx) {
        let dir = tempfile::tempdir().unwrap();
        let w = dir.path();
        for (p, c) in [
            ("src/main.rs", "fn main() {\n    retry(3);\n}\n"),
            (
                "src/retry.rs",
                "// Retry with backoff.\npub fn retry(n: u32) {}\n",
            ),
            ("docs/notes.md", "Retries: see src/retry.rs\n"),
            ("target/debug/junk.rs", "fn retry() {}\n"),
            ("bin.dat", "retry\0binary"),
        ] {
            std::fs::create_dir_all(w.join(p).parent().unwrap()).unwrap();
            std::fs::write(w.join(p), c).unwrap();
        }
        std::fs::write(w.join(".gitignore"), "target/\n").unwrap();
        let ctx = ToolCtx::new(w, "k", 16 * 1024);
        (dir, ctx)
    }

    async fn run(c: &ToolCtx, tool: &str, args: Value) -> Result<String, ToolError> {
        ToolRegistry::builtin(None)
            .execute(tool, &args.to_string(), c)
            .await
    }

    #[tokio::test]
    async fn glob_finds_files_by_pattern_and_honours_gitignore() {
        let (_d, c) = tree();
        assert_eq!(
            run(&c, "glob", json!({"pattern": "**/*.rs"}))
                .await
                .unwrap(),
            "src/main.rs\nsrc/retry.rs"
        );
        assert_eq!(
            run(&c, "glob", json!({"pattern": "*.md"})).await.unwrap(),
            "docs/notes.md"
        );
        assert_eq!(
            run(&c, "glob", json!({"pattern": "*.rs", "path": "src"}))
                .await
                .unwrap(),
            "src/main.rs\nsrc/retry.rs"
        );
        assert_eq!(
            run(&c, "glob", json!({"pattern": "*.zip"})).await.unwrap(),
            "no files match `*.zip`"
        );
        assert_eq!(
            run(&c, "glob", json!({"pattern": "a[", "path": ""}))
                .await
                .unwrap_err()
                .code,
            "bad_arguments"
        );
    }

    #[tokio::test]
    async fn grep_modes_context_and_refusals() {
        let (_d, c) = tree();
        assert_eq!(
            run(&c, "grep", json!({"pattern": "retry"})).await.unwrap(),
            "docs/notes.md\nsrc/main.rs\nsrc/retry.rs"
        );
        assert_eq!(
            run(
                &c,
                "grep",
                json!({"pattern": "retry", "glob": "*.rs", "output_mode": "count"})
            )
            .await
            .unwrap(),
            "src/main.rs:1\nsrc/retry.rs:1"
        );
        assert_eq!(
            run(
                &c,
                "grep",
                json!({"pattern": "^retries", "case_insensitive": true, "output_mode": "content"})
            )
            .await
            .unwrap(),
            "docs/notes.md:1:Retries: see src/retry.rs\n[1 file matched]"
        );
        let ctx_out = run(
            &c,
            "grep",
            json!({"pattern": "retry\\(3\\)", "output_mode": "content", "context": 1}),
        )
        .await
        .unwrap();
        assert_eq!(
            ctx_out,
            "src/main.rs-1-fn main() {\nsrc/main.rs:2:    retry(3);\nsrc/main.rs-3-}\n[1 file matched]"
        );
        assert_eq!(
            run(&c, "grep", json!({"pattern": "("}))
                .await
                .unwrap_err()
                .code,
            "bad_arguments"
        );
        assert_eq!(
            run(&c, "grep", json!({"pattern": "x", "output_mode": "lines"}))
                .await
                .unwrap_err()
                .code,
            "bad_arguments"
        );
        assert_eq!(
            run(&c, "grep", json!({"pattern": "nothing-here"}))
                .await
                .unwrap(),
            "no matches for `nothing-here`"
        );
    }

    #[tokio::test]
    async fn grep_output_is_capped() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("big.txt"), "match me\n".repeat(10_000)).unwrap();
        let c = ToolCtx::new(dir.path(), "k", 4096);
        let out = run(
            &c,
            "grep",
            json!({"pattern": "match", "output_mode": "content"}),
        )
        .await
        .unwrap();
        assert!(
            out.len() <= 4096 && out.ends_with("narrow the pattern, path or glob]"),
            "{}",
            out.len()
        );
    }
}
