//! `bash`: a shell command in the owner's workspace. Off unless the operator enables it
//! (`SUBAGENTS_ALLOW_BASH=1`), and then offered only to agents that list it: a shell is not
//! confined the way the file tools are (it can read and write whatever the worker's user can,
//! and reach the network), so it is a deliberate choice. What it does not get: the worker's
//! environment (only `PATH`, `HOME` = the workspace, `LANG` and `SUBAGENTS_IDEMPOTENCY_KEY`),
//! the worker's secrets through `/proc` (the worker wipes them and is non-dumpable, see
//! [`crate::secrets`]), and any capability (it runs confined, see [`crate::procs::confine`]).
//! The command runs in its own process group, which is killed at the timeout, and output
//! (stdout and stderr together) is capped.
//!
//! A replay after a crash runs the command again with the same `SUBAGENTS_IDEMPOTENCY_KEY`:
//! commands with side effects should use it to do their work once.

use std::process::Stdio;
use std::time::Duration;

use async_trait::async_trait;
use serde_json::{Value, json};
use tokio::io::AsyncReadExt;

use super::{ErrorCode, Tool, ToolCtx, ToolError, spec, str_arg};
use crate::model::ToolSpec;

/// The longest a command may be given.
const MAX_TIMEOUT: Duration = Duration::from_secs(600);
/// When the call names no timeout.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// `bash`.
pub struct Bash;

#[async_trait]
impl Tool for Bash {
    fn spec(&self) -> ToolSpec {
        spec(
            "bash",
            "Runs a bash command in the workspace directory and returns its output (stdout and stderr together) and exit code. `timeout_s` (default 120, at most 600) stops it. The environment is minimal; nothing persists between calls but files.",
            json!({"type":"object","properties":{"command":{"type":"string"},"timeout_s":{"type":"number","minimum":1,"maximum":600}},"required":["command"]}),
        )
    }
    async fn call(&self, args: Value, ctx: &ToolCtx) -> Result<String, ToolError> {
        let command = str_arg(&args, "command")?;
        let timeout = args
            .get("timeout_s")
            .and_then(Value::as_f64)
            .filter(|t| t.is_finite() && *t > 0.0)
            .map(|t| Duration::from_secs_f64(t).min(MAX_TIMEOUT))
            .unwrap_or(DEFAULT_TIMEOUT);
        std::fs::create_dir_all(&ctx.workspace)
            .map_err(|e| ToolError::new(ErrorCode::WorkspaceUnavailable, e.to_string()))?;
        let mut cmd = tokio::process::Command::new("bash");
        cmd.arg("-c")
            .arg(format!("exec 2>&1\n{command}"))
            .current_dir(&ctx.workspace)
            .env_clear()
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .env("HOME", &ctx.workspace)
            .env("LANG", "C.UTF-8")
            .env("SUBAGENTS_IDEMPOTENCY_KEY", &ctx.idempotency_key)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .process_group(0)
            .kill_on_drop(true);
        crate::procs::confine(&mut cmd);
        let mut child = cmd.spawn().map_err(|e| {
            ToolError::new(ErrorCode::BashFailed, format!("cannot start bash: {e}"))
        })?;
        let pid = child.id();
        let mut stdout = child.stdout.take().expect("piped");
        // The whole output is kept (the engine offloads a long one to a file), up to a hard cap.
        let cap = super::MAX_OUTPUT_BYTES;
        let run = async {
            let mut out = Vec::new();
            let mut buf = [0u8; 8192];
            let mut total = 0usize;
            loop {
                let n = stdout.read(&mut buf).await.unwrap_or(0);
                if n == 0 {
                    break;
                }
                total += n;
                // Keep reading past the cap (so the command is not blocked), keep nothing more.
                let room = cap.saturating_sub(out.len());
                out.extend_from_slice(&buf[..n.min(room)]);
            }
            let status = child.wait().await;
            (out, total, status)
        };
        match tokio::time::timeout(timeout, run).await {
            Ok((out, total, status)) => {
                let code = status
                    .ok()
                    .and_then(|s| s.code())
                    .map(|c| c.to_string())
                    .unwrap_or_else(|| "killed".into());
                let mut text = String::from_utf8_lossy(&out).into_owned();
                if total > out.len() {
                    text.push_str(&format!(
                        "\n[output truncated: {} of {total} bytes shown]",
                        out.len()
                    ));
                }
                Ok(format!("exit code: {code}\n{text}"))
            }
            Err(_) => {
                // The whole group: whatever the command started dies with it.
                if let Some(pid) = pid {
                    let _ = crate::procs::kill_group(pid);
                }
                Err(ToolError::new(
                    ErrorCode::ToolTimeout,
                    format!(
                        "the command did not finish within {}s and was killed",
                        timeout.as_secs_f64()
                    ),
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::ToolRegistry;
    use super::*;

    #[tokio::test]
    async fn bash_is_off_unless_enabled_and_bounded_when_on() {
        let dir = tempfile::tempdir().unwrap();
        let c = ToolCtx::new(dir.path(), "run:1:c", 2000);
        let off = ToolRegistry::builtin(None);
        assert_eq!(
            off.execute("bash", r#"{"command":"echo hi"}"#, &c)
                .await
                .unwrap_err()
                .code,
            "unknown_tool"
        );
        let on = ToolRegistry::with_settings(super::super::ToolSettings {
            allow_bash: true,
            ..Default::default()
        });
        let out = on.execute("bash", r#"{"command":"pwd; echo $SUBAGENTS_IDEMPOTENCY_KEY; echo ${OPENAI_API_KEY:-scrubbed}; exit 3"}"#, &c).await.unwrap();
        let pwd = dir.path().canonicalize().unwrap();
        assert_eq!(
            out,
            format!("exit code: 3\n{}\nrun:1:c\nscrubbed\n", pwd.display())
        );
        // Output is kept whole (the engine offloads a long result to a file), up to a hard cap.
        let big = on
            .execute("bash", r#"{"command":"yes | head -c 100000"}"#, &c)
            .await
            .unwrap();
        assert_eq!(big.len(), "exit code: 0\n".len() + 100_000);
        // A timeout kills the whole group: the background sleeper does not outlive it.
        let t0 = std::time::Instant::now();
        let e = on
            .execute(
                "bash",
                r#"{"command":"sleep 30 & sleep 30; echo never", "timeout_s": 1}"#,
                &c,
            )
            .await
            .unwrap_err();
        assert_eq!(e.code, "tool_timeout");
        assert!(t0.elapsed() < Duration::from_secs(10));
    }
}
