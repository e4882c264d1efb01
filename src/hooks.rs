//! Running hooks, as Claude Code does: a command hook gets the event's JSON on stdin, runs in the
//! owner's workspace (or the directory the operator chose), and answers by its exit code (0 go on, 2 block with stderr as the reason,
//! anything else a logged error that blocks nothing) and optionally JSON on stdout
//! (`permissionDecision`, `permissionDecisionReason`, `updatedInput`, `additionalContext`, or the
//! older `decision: "block"` with `reason`); an http hook gets the same JSON POSTed and answers
//! with the same JSON. A hook that outlives its timeout is killed with its process group.
//!
//! Which hooks run: those of the event whose matcher (an anchored pattern) fits the tool's name,
//! ours (`bash`) or Claude Code's (`Bash`), from the settings file first, then the agent's.
//!
//! A hook is the operator's code, but the workspace it starts in is written by the model. So a
//! command hook never gets the worker's environment: only the harmless variables of
//! [`crate::procs::child_env`], `CLAUDE_PROJECT_DIR`, and the variables the operator names
//! ([`HookEnv`]); git's per-repository settings that run programs (`core.fsmonitor`,
//! `core.hooksPath`, pagers, editors, credential helpers, `.gitattributes` filters) are
//! overridden; and it keeps no capabilities ([`crate::procs::confine`]).

use std::path::{Path, PathBuf};
use std::process::Stdio;

use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;

use crate::policy::{Hook, HookConfig, HookEvent, HookKind, regex_for};

/// A permission decision a hook made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HookDecision {
    /// Allow the call without asking.
    Allow,
    /// Deny it.
    Deny,
    /// Ask a person.
    Ask,
}

/// What the hooks of one event came to.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Outcome {
    /// A hook blocked (exit 2, or `decision: "block"`): the reason the model is given.
    pub blocked: Option<String>,
    /// A permission decision, with its reason.
    pub decision: Option<(HookDecision, String)>,
    /// A rewritten tool input.
    pub updated_input: Option<Value>,
    /// Text to add to the model's context.
    pub additional_context: Vec<String>,
    /// Hooks that failed without blocking (logged and counted).
    pub errors: Vec<String>,
    /// How many hooks ran.
    pub ran: usize,
}

/// Claude Code's name of one of our tools, for matchers written for Claude Code.
pub fn claude_name(tool: &str) -> &str {
    match tool {
        "read_file" => "Read",
        "write_file" => "Write",
        "edit_file" => "Edit",
        "multi_edit" => "MultiEdit",
        "list_dir" => "LS",
        "glob" => "Glob",
        "grep" => "Grep",
        "bash" => "Bash",
        "web_fetch" => "WebFetch",
        "web_search" => "WebSearch",
        "todo_write" => "TodoWrite",
        "task" => "Task",
        other => other,
    }
}

/// The hooks of `event` that apply to `tool` (empty for events without a tool), in order.
pub fn matching<'a>(
    configs: &[&'a HookConfig],
    event: HookEvent,
    tool: Option<&str>,
) -> Vec<&'a Hook> {
    let mut out = vec![];
    for c in configs {
        for g in c.get(&event).into_iter().flatten() {
            let fits = match tool {
                None => true,
                Some(t) => regex_for(&g.matcher)
                    .is_ok_and(|re| re.is_match(t) || re.is_match(claude_name(t))),
            };
            if fits {
                out.extend(g.hooks.iter());
            }
        }
    }
    out
}

/// Where and with what a command hook runs.
#[derive(Clone, Debug)]
pub struct HookEnv {
    /// Its working directory.
    pub cwd: PathBuf,
    /// Its whole environment.
    pub vars: Vec<(String, String)>,
}

/// Settings that neutralise what a repository's own configuration would make git run: a hook
/// that calls `git status` in a workspace whose `.git/config` the model wrote must not run the
/// model's program.
const GIT_OVERRIDES: &[(&str, &str)] = &[
    ("core.fsmonitor", "false"),
    ("core.hooksPath", "/dev/null"),
    ("core.pager", "cat"),
    ("core.editor", "true"),
    ("core.askPass", ""),
    ("core.sshCommand", "ssh"),
    ("core.gitProxy", ""),
    ("credential.helper", ""),
    ("sequence.editor", "true"),
    ("protocol.ext.allow", "never"),
    ("gpg.program", "gpg"),
];

impl HookEnv {
    /// A hook's environment for a run whose workspace is `workspace`: the harmless variables,
    /// `CLAUDE_PROJECT_DIR`, the operator's `pass` variables (their values from the worker's
    /// start), and git's overrides; it runs in `cwd` (default: the workspace).
    pub fn new(workspace: &Path, cwd: Option<&Path>, pass: &[String]) -> HookEnv {
        let mut extra: Vec<(String, String)> =
            vec![("CLAUDE_PROJECT_DIR".into(), workspace.display().to_string())];
        extra.extend(
            pass.iter()
                .filter_map(|k| crate::secrets::var(k).map(|v| (k.clone(), v))),
        );
        extra.push(("GIT_CONFIG_COUNT".into(), GIT_OVERRIDES.len().to_string()));
        for (i, (k, v)) in GIT_OVERRIDES.iter().enumerate() {
            extra.push((format!("GIT_CONFIG_KEY_{i}"), (*k).into()));
            extra.push((format!("GIT_CONFIG_VALUE_{i}"), (*v).into()));
        }
        // Attributes (and so filter drivers) from the empty tree, not the working tree.
        extra.push((
            "GIT_ATTR_SOURCE".into(),
            "4b825dc642cb6eb9a060e54bf8d69288fbee4904".into(),
        ));
        extra.push(("GIT_TERMINAL_PROMPT".into(), "0".into()));
        HookEnv {
            cwd: cwd.unwrap_or(workspace).to_owned(),
            vars: crate::procs::child_env(&extra),
        }
    }
}

/// Runs `hooks` in order with `input` (the event's JSON), in `env`. A rewritten input is
/// passed on to the next hook; a block or a deny stops the chain.
pub async fn run(
    hooks: &[&Hook],
    mut input: Value,
    env: &HookEnv,
    http: &reqwest::Client,
) -> Outcome {
    let mut out = Outcome::default();
    for hook in hooks {
        out.ran += 1;
        let answer = match &hook.kind {
            HookKind::Command(cmd) => run_command(cmd, hook.timeout, &input, env).await,
            HookKind::Http(url) => run_http(url, hook.timeout, &input, http).await,
        };
        match answer {
            Answer::Block(reason) => {
                out.blocked = Some(reason);
                return out;
            }
            Answer::Error(e) => {
                tracing::warn!(error = %e, "hook failed (not blocking)");
                metrics::counter!("subagents_hook_errors_total").increment(1);
                out.errors.push(e);
            }
            Answer::Json(v) => {
                let specific = v.get("hookSpecificOutput").unwrap_or(&Value::Null);
                let field = |k: &str| {
                    specific
                        .get(k)
                        .or_else(|| v.get(k))
                        .filter(|x| !x.is_null())
                };
                if v.get("decision").and_then(Value::as_str) == Some("block") {
                    out.blocked = Some(
                        v.get("reason")
                            .and_then(Value::as_str)
                            .unwrap_or("blocked by a hook")
                            .to_owned(),
                    );
                    return out;
                }
                if let Some(ctx) = field("additionalContext").and_then(Value::as_str) {
                    out.additional_context.push(ctx.to_owned());
                }
                if let Some(updated) = field("updatedInput").filter(|u| u.is_object()) {
                    out.updated_input = Some(updated.clone());
                    if let Some(ti) = input.get_mut("tool_input") {
                        *ti = updated.clone();
                    }
                }
                let reason = field("permissionDecisionReason")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_owned();
                match field("permissionDecision").and_then(Value::as_str) {
                    Some("deny") => {
                        out.decision = Some((
                            HookDecision::Deny,
                            if reason.is_empty() {
                                "denied by a hook".into()
                            } else {
                                reason
                            },
                        ));
                        return out;
                    }
                    Some("ask") => {
                        out.decision = Some((
                            HookDecision::Ask,
                            if reason.is_empty() {
                                "a hook asks for approval".into()
                            } else {
                                reason
                            },
                        ))
                    }
                    Some("allow") if out.decision.is_none() => {
                        out.decision = Some((HookDecision::Allow, reason))
                    }
                    _ => {}
                }
            }
            Answer::Nothing => {}
        }
    }
    out
}

enum Answer {
    Nothing,
    Json(Value),
    Block(String),
    Error(String),
}

async fn run_command(
    cmd: &str,
    timeout: std::time::Duration,
    input: &Value,
    env: &HookEnv,
) -> Answer {
    if let Err(e) = std::fs::create_dir_all(&env.cwd) {
        return Answer::Error(format!(
            "hook `{cmd}`: directory {}: {e}",
            env.cwd.display()
        ));
    }
    let mut command = tokio::process::Command::new("bash");
    command
        .arg("-c")
        .arg(cmd)
        .current_dir(&env.cwd)
        .env_clear()
        .envs(env.vars.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    crate::procs::confine(&mut command);
    let child = command.spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => return Answer::Error(format!("hook `{cmd}` could not start: {e}")),
    };
    let pid = child.id();
    if let Some(mut stdin) = child.stdin.take() {
        let body = input.to_string();
        // A hook that does not read its input must not block us.
        let _ = tokio::time::timeout(timeout, stdin.write_all(body.as_bytes())).await;
    }
    match tokio::time::timeout(timeout, child.wait_with_output()).await {
        Err(_) => {
            if let Some(pid) = pid {
                let _ = crate::procs::kill_group(pid);
            }
            Answer::Error(format!(
                "hook `{cmd}` did not finish within {}s and was killed",
                timeout.as_secs_f64()
            ))
        }
        Ok(Err(e)) => Answer::Error(format!("hook `{cmd}`: {e}")),
        Ok(Ok(out)) => {
            let mut stderr = String::from_utf8_lossy(&out.stderr).trim().to_owned();
            crate::model::scrub_nul(&mut stderr);
            match out.status.code() {
                Some(0) => parse_stdout(&out.stdout),
                Some(2) => Answer::Block(if stderr.is_empty() {
                    format!("blocked by the hook `{cmd}`")
                } else {
                    stderr
                }),
                code => Answer::Error(format!(
                    "hook `{cmd}` exited with {}{}",
                    code.map(|c| c.to_string())
                        .unwrap_or_else(|| "a signal".into()),
                    if stderr.is_empty() {
                        String::new()
                    } else {
                        format!(": {}", stderr.chars().take(300).collect::<String>())
                    }
                )),
            }
        }
    }
}

/// Replaces NULs in every string of `v` (see [`crate::model::scrub_nul`]): a hook's reason or
/// rewritten input is stored, and no database text holds a NUL.
fn scrub(v: &mut Value) {
    match v {
        Value::String(s) => crate::model::scrub_nul(s),
        Value::Array(a) => a.iter_mut().for_each(scrub),
        Value::Object(o) => o.values_mut().for_each(scrub),
        _ => {}
    }
}

fn parse_stdout(stdout: &[u8]) -> Answer {
    let text = String::from_utf8_lossy(stdout);
    let t = text.trim();
    if t.starts_with('{') {
        match serde_json::from_str::<Value>(t) {
            Ok(mut v) => {
                scrub(&mut v);
                Answer::Json(v)
            }
            Err(e) => Answer::Error(format!("hook printed JSON that does not parse: {e}")),
        }
    } else {
        Answer::Nothing
    }
}

async fn run_http(
    url: &str,
    timeout: std::time::Duration,
    input: &Value,
    http: &reqwest::Client,
) -> Answer {
    let resp = match http.post(url).timeout(timeout).json(input).send().await {
        Ok(r) => r,
        Err(e) => return Answer::Error(format!("hook {url}: {e}")),
    };
    let status = resp.status();
    let body = resp.bytes().await.unwrap_or_default();
    if !status.is_success() {
        return Answer::Error(format!("hook {url} answered HTTP {status}"));
    }
    parse_stdout(&body)
}

/// The JSON a hook gets, in Claude Code's shape plus our ids.
pub fn input(event: HookEvent, run: &crate::domain::RunRecord, cwd: &Path, extra: Value) -> Value {
    let mut v = json!({
        "hook_event_name": event.as_str(),
        "session_id": run.thread_id,
        "run_id": run.id,
        "root_run_id": run.tree.root_run_id.unwrap_or(run.id),
        "agent": run.agent,
        "cwd": cwd,
    });
    if let (Value::Object(o), Value::Object(e)) = (&mut v, extra) {
        o.extend(e);
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::parse_hooks;
    use std::time::Duration;

    fn hook(cmd: &str) -> Hook {
        Hook {
            kind: HookKind::Command(cmd.into()),
            timeout: Duration::from_secs(5),
        }
    }

    #[tokio::test]
    async fn exit_codes_and_json_answers() {
        let dir = tempfile::tempdir().unwrap();
        let http = reqwest::Client::new();
        let input = json!({"tool_name": "bash", "tool_input": {"command": "ls"}});
        let env = HookEnv::new(dir.path(), None, &[]);
        let run1 = |h: Hook| {
            let (input, http, env) = (input.clone(), http.clone(), env.clone());
            async move { run(&[&h], input, &env, &http).await }
        };
        assert_eq!(
            run1(hook("cat > /dev/null; exit 0")).await,
            Outcome {
                ran: 1,
                ..Default::default()
            }
        );
        let o = run1(hook("echo 'no rm here' >&2; exit 2")).await;
        assert_eq!(o.blocked.as_deref(), Some("no rm here"));
        let o = run1(hook("exit 7")).await;
        assert!(o.blocked.is_none() && o.errors[0].contains("exited with 7"));
        let o = run1(hook(r#"echo '{"hookSpecificOutput":{"permissionDecision":"deny","permissionDecisionReason":"not today"}}'"#)).await;
        assert_eq!(o.decision, Some((HookDecision::Deny, "not today".into())));
        let o = run1(hook(r#"echo '{"hookSpecificOutput":{"permissionDecision":"allow","updatedInput":{"command":"ls -la"},"additionalContext":"be brief"}}'"#)).await;
        assert_eq!(o.decision, Some((HookDecision::Allow, String::new())));
        assert_eq!(o.updated_input, Some(json!({"command": "ls -la"})));
        assert_eq!(o.additional_context, vec!["be brief"]);
        let o = run1(hook(r#"echo '{"decision":"block","reason":"old style"}'"#)).await;
        assert_eq!(o.blocked.as_deref(), Some("old style"));
        // The hook reads the event on stdin and runs in the workspace.
        let o = run1(hook(r#"read -r line; test "$PWD" = "$CLAUDE_PROJECT_DIR" && echo "$line" | grep -q '"tool_name":"bash"' || exit 2"#)).await;
        assert!(o.blocked.is_none(), "{o:?}");
    }

    #[tokio::test]
    async fn a_hanging_hook_is_killed_with_its_children() {
        let dir = tempfile::tempdir().unwrap();
        let h = Hook {
            kind: HookKind::Command("sleep 30 & sleep 30".into()),
            timeout: Duration::from_millis(300),
        };
        let t0 = std::time::Instant::now();
        let o = run(
            &[&h],
            json!({}),
            &HookEnv::new(dir.path(), None, &[]),
            &reqwest::Client::new(),
        )
        .await;
        assert!(t0.elapsed() < Duration::from_secs(5));
        assert!(o.errors[0].contains("was killed"), "{o:?}");
    }

    #[test]
    fn matchers_fit_our_names_and_claude_codes() {
        let c = parse_hooks(&json!({"PreToolUse": [{"matcher": "Bash|Edit", "hooks": [{"command": "a"}]}, {"matcher": "", "hooks": [{"command": "b"}]}]})).unwrap();
        assert_eq!(
            matching(&[&c], HookEvent::PreToolUse, Some("bash")).len(),
            2
        );
        assert_eq!(
            matching(&[&c], HookEvent::PreToolUse, Some("edit_file")).len(),
            2
        );
        assert_eq!(
            matching(&[&c], HookEvent::PreToolUse, Some("read_file")).len(),
            1
        );
        assert!(matching(&[&c], HookEvent::PostToolUse, Some("bash")).is_empty());
    }
}
