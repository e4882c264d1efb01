//! Named failure points (after oxidecomputer/steno's `inject_error`): places in the worker where
//! a test can make it stop for a while or die on the spot, to make races and crashes that are
//! otherwise a matter of luck happen every time.
//!
//! They are off unless `SUBAGENTS_FAILPOINTS` names some, e.g.
//! `SUBAGENTS_FAILPOINTS="before_park_commit=sleep(800),after_terminal_commit=crash"`. Each
//! point is looked up in a small map, so an unset point costs one hash lookup. Points:
//!
//! | point | where |
//! |---|---|
//! | `after_model_response` | a model response arrived; its checkpoint is not yet written |
//! | `after_tool_run` | an ordinary tool returned, before its hooks and commit |
//! | `before_tool_commit` | a tool returned; its result is not yet committed |
//! | `before_commit_beside_call` | the commit before a model call (the input, a step's last tool result) is about to be sent; the call may be under way already |
//! | `after_attempt_cut` | a cancel, a lost lease, the drain's grace or the wall-time limit cut a run's loop short with a commit still under way beside a model call; it is not yet awaited |
//! | `before_park_commit` | a run decided to park; the park is not yet committed |
//! | `after_park_commit` | the park is committed; nothing else done yet |
//! | `after_terminal_commit` | a run's terminal state is committed; the thread's next run and its waiters are not yet pushed |
//! | `before_message_delivery` | a step boundary found messages waiting; they are not yet delivered |
//! | `after_message_delivery` | the messages are in the thread; the step's model call is not yet made |
//! | `before_compaction_commit` | a compaction's summary arrived; it is not yet committed |
//! | `after_compaction_commit` | the compaction is committed; the context is not yet rebuilt |
//! | `before_webhook_send` | a webhook delivery is claimed for an attempt; nothing is sent yet |
//!
//! Actions: `sleep(MS)` pauses the task there; `wait(PATH)` pauses it until the file `PATH`
//! exists (at most a minute), so a test can hold a run at a point until the world is as it
//! needs; `touch(PATH)` creates the file `PATH` and goes on, so a test knows the point was
//! reached; `crash` aborts the whole process (as a SIGKILL would: nothing is flushed or
//! released).

use std::collections::HashMap;
use std::time::Duration;

/// What a failure point does when reached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Pause the task for this long.
    Sleep(Duration),
    /// Pause the task until this file exists (at most a minute).
    WaitFor(std::path::PathBuf),
    /// Create this (empty) file and go on.
    Touch(std::path::PathBuf),
    /// Abort the process at once.
    Crash,
}

/// The configured failure points (none by default).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Failpoints {
    points: HashMap<String, Action>,
}

/// A `SUBAGENTS_FAILPOINTS` value that does not parse.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "bad failure point `{0}`: write name=sleep(MS), name=wait(PATH), name=touch(PATH) or name=crash, separated by commas"
)]
pub struct BadFailpoint(pub String);

impl Failpoints {
    /// Parses `name=sleep(MS),name=crash,…`; an empty string means none.
    pub fn parse(spec: &str) -> Result<Failpoints, BadFailpoint> {
        let mut points = HashMap::new();
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (name, action) = item
                .split_once('=')
                .ok_or_else(|| BadFailpoint(item.into()))?;
            let action = match action.trim() {
                "crash" => Action::Crash,
                a if a.starts_with("wait(") && a.ends_with(')') && a.len() > 6 => {
                    Action::WaitFor(a[5..a.len() - 1].into())
                }
                a if a.starts_with("touch(") && a.ends_with(')') && a.len() > 7 => {
                    Action::Touch(a[6..a.len() - 1].into())
                }
                a => {
                    let ms = a
                        .strip_prefix("sleep(")
                        .and_then(|r| r.strip_suffix(')'))
                        .and_then(|n| n.trim().parse::<u64>().ok())
                        .ok_or_else(|| BadFailpoint(item.into()))?;
                    Action::Sleep(Duration::from_millis(ms))
                }
            };
            points.insert(name.trim().to_owned(), action);
        }
        Ok(Failpoints { points })
    }

    /// True when no point is set.
    pub fn is_empty(&self) -> bool {
        self.points.is_empty()
    }

    /// Reaches the point `name`: does what it is set to do, if anything.
    pub async fn hit(&self, name: &str) {
        match self.points.get(name) {
            None => {}
            Some(Action::Sleep(d)) => {
                tracing::warn!(
                    failpoint = name,
                    ms = d.as_millis() as u64,
                    "failure point: sleeping"
                );
                tokio::time::sleep(*d).await;
            }
            Some(Action::WaitFor(path)) => {
                tracing::warn!(failpoint = name, path = %path.display(), "failure point: waiting for the file");
                let until = tokio::time::Instant::now() + Duration::from_secs(60);
                while !path.exists() && tokio::time::Instant::now() < until {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            Some(Action::Touch(path)) => {
                tracing::warn!(failpoint = name, path = %path.display(), "failure point: reached");
                if let Err(e) = std::fs::write(path, "") {
                    tracing::warn!(failpoint = name, error = %e, "failure point: could not create the file");
                }
            }
            Some(Action::Crash) => {
                tracing::error!(failpoint = name, "failure point: crashing the process");
                std::process::abort();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_points_and_refuses_nonsense() {
        let f =
            Failpoints::parse(" a=sleep(20), b=crash, c=wait(/tmp/go), d=touch(/tmp/at) ").unwrap();
        assert_eq!(f.points["a"], Action::Sleep(Duration::from_millis(20)));
        assert_eq!(f.points["b"], Action::Crash);
        assert_eq!(f.points["c"], Action::WaitFor("/tmp/go".into()));
        assert_eq!(f.points["d"], Action::Touch("/tmp/at".into()));
        assert!(Failpoints::parse("a=touch()").is_err());
        assert!(Failpoints::parse("").unwrap().is_empty());
        assert!(Failpoints::parse("a").is_err());
        assert!(Failpoints::parse("a=sleep(x)").is_err());
        assert!(Failpoints::parse("a=explode").is_err());
    }
}
