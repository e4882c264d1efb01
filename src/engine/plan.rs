//! The planner: a pure function from a run's committed history to what it must do next. The
//! executor ([`super::Engine`]) does the I/O and commits; it asks the planner again after every
//! commit, so a fresh run, a resumed run and a replay after a crash take the same path.
//!
//! Parking is the executor's outcome, not the planner's: whether a delegation call must wait
//! depends on its children's state, which only the store knows (see [`super::End`]).

use std::collections::{HashMap, HashSet};

use crate::domain::StoredMessage;
use crate::ids::RunId;
use crate::model::{Message, ToolCall};

/// What the run does next.
#[derive(Clone, Debug, PartialEq)]
pub enum Next {
    /// Its latest assistant message has no tool calls: that is its final answer.
    Finish {
        /// The final text.
        result: String,
    },
    /// Its latest step has calls without a committed result: run those.
    RunTools {
        /// The step they belong to.
        step: u32,
        /// Every call of that step, in order (loop detection looks at all of them).
        calls: Vec<ToolCall>,
        /// The calls still without a result.
        pending: Vec<ToolCall>,
    },
    /// Every call is answered (or nothing happened yet): ask the model, as step `step`.
    CallModel {
        /// The new step's number.
        step: u32,
    },
}

/// Decides the next action from the run's own committed messages (in commit order) and the
/// number of steps it has committed.
pub fn plan(own: &[&StoredMessage], steps_done: u32) -> Next {
    let Some(at) = own
        .iter()
        .rposition(|m| matches!(m.message, Message::Assistant { .. }))
    else {
        return Next::CallModel {
            step: steps_done + 1,
        };
    };
    let last = own[at];
    let Message::Assistant {
        content,
        tool_calls,
        ..
    } = &last.message
    else {
        unreachable!("filtered above")
    };
    if tool_calls.is_empty() {
        // A message delivered after the answer (see `steer`) is for the model to answer.
        let steered = own[at + 1..]
            .iter()
            .any(|m| matches!(m.message, Message::User { .. }));
        if steered {
            return Next::CallModel {
                step: steps_done.max(last.step) + 1,
            };
        }
        return Next::Finish {
            result: content.clone().unwrap_or_default(),
        };
    }
    let answered: HashSet<&str> = own
        .iter()
        .filter(|m| m.step == last.step)
        .filter_map(|m| match &m.message {
            Message::Tool { tool_call_id, .. } => Some(tool_call_id.as_str()),
            _ => None,
        })
        .collect();
    let pending: Vec<ToolCall> = tool_calls
        .iter()
        .filter(|c| !answered.contains(c.id.as_str()))
        .cloned()
        .collect();
    if pending.is_empty() {
        Next::CallModel {
            step: steps_done.max(last.step) + 1,
        }
    } else {
        Next::RunTools {
            step: last.step,
            calls: tool_calls.clone(),
            pending,
        }
    }
}

/// The model's view of the thread: every committed message in order, each step's tool results
/// right after its assistant message in the order of its calls (they commit in completion
/// order, which a replay cannot reproduce). Calls left unanswered by an earlier run that ended
/// mid-step get a placeholder result, because the API rejects dangling tool calls.
pub fn context(history: &[StoredMessage], current: RunId) -> Vec<Message> {
    let results: HashMap<(RunId, u32, &str), &Message> = history
        .iter()
        .filter_map(|m| match &m.message {
            Message::Tool { tool_call_id, .. } => {
                Some(((m.run_id, m.step, tool_call_id.as_str()), &m.message))
            }
            _ => None,
        })
        .collect();
    let mut out = Vec::with_capacity(history.len());
    for m in history {
        match &m.message {
            Message::Tool { .. } => {}
            Message::Assistant { tool_calls, .. } => {
                out.push(m.message.clone());
                for c in tool_calls {
                    match results.get(&(m.run_id, m.step, c.id.as_str())) {
                        Some(r) => out.push((*r).clone()),
                        None if m.run_id != current => out.push(Message::Tool {
                            tool_call_id: c.id.clone(),
                            content: "[no result: the run ended before this call completed]".into(),
                        }),
                        None => {}
                    }
                }
            }
            _ => out.push(m.message.clone()),
        }
    }
    out
}

/// Loop detection over the run's whole call sequence, in order, so a replay decides the same
/// way: a call identical to the two before it is refused.
pub fn refusals(prior: &[(String, String)], calls: &[ToolCall]) -> HashMap<String, bool> {
    let mut seq: Vec<(String, String)> = prior.to_vec();
    let mut refused = HashMap::new();
    for c in calls {
        let sig = (
            c.function.name.clone(),
            canonical_args(&c.function.arguments),
        );
        let n = seq.len();
        refused.insert(
            c.id.clone(),
            n >= 2 && seq[n - 1] == sig && seq[n - 2] == sig,
        );
        seq.push(sig);
    }
    refused
}

/// Every call this run made before `step`, flattened in order, as (name, canonical args).
pub fn prior_calls(mine: &[&StoredMessage], step: u32) -> Vec<(String, String)> {
    mine.iter()
        .filter(|m| m.step < step)
        .filter_map(|m| match &m.message {
            Message::Assistant { tool_calls, .. } => Some(tool_calls),
            _ => None,
        })
        .flatten()
        .map(|c| {
            (
                c.function.name.clone(),
                canonical_args(&c.function.arguments),
            )
        })
        .collect()
}

/// Arguments compared as JSON values, so key order and spacing do not hide a repeat.
fn canonical_args(raw: &str) -> String {
    serde_json::from_str::<serde_json::Value>(raw)
        .map(|v| v.to_string())
        .unwrap_or_else(|_| raw.trim().to_owned())
}

/// Call ids key the checkpoints of tool results, so they must be unique and non-empty within a
/// step; models occasionally repeat or omit them.
pub fn unique_call_ids(calls: Vec<ToolCall>, step: u32) -> Vec<ToolCall> {
    let mut seen = HashSet::new();
    calls
        .into_iter()
        .enumerate()
        .map(|(i, mut c)| {
            let ok_chars =
                c.id.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
            if c.id.is_empty() || !ok_chars || !seen.insert(c.id.clone()) {
                c.id = format!("call_s{step}_{i}");
                seen.insert(c.id.clone());
            }
            c
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::FunctionCall;

    fn call(id: &str) -> ToolCall {
        ToolCall {
            id: id.into(),
            kind: "function".into(),
            function: FunctionCall {
                name: "echo".into(),
                arguments: "{}".into(),
            },
        }
    }

    fn msg(run: RunId, step: u32, message: Message) -> StoredMessage {
        StoredMessage {
            id: 0,
            run_id: run,
            step,
            key: String::new(),
            message,
        }
    }

    fn assistant(calls: Vec<ToolCall>, text: Option<&str>) -> Message {
        Message::Assistant {
            content: text.map(str::to_owned),
            tool_calls: calls,
            thinking: vec![],
        }
    }

    fn result(id: &str) -> Message {
        Message::Tool {
            tool_call_id: id.into(),
            content: "ok".into(),
        }
    }

    #[test]
    fn a_fresh_run_calls_the_model() {
        let r = RunId::new();
        let input = msg(
            r,
            0,
            Message::User {
                content: "hi".into(),
            },
        );
        assert_eq!(plan(&[&input], 0), Next::CallModel { step: 1 });
        assert_eq!(plan(&[], 0), Next::CallModel { step: 1 });
    }

    #[test]
    fn unanswered_calls_run_and_answered_ones_do_not() {
        let r = RunId::new();
        let a = msg(r, 1, assistant(vec![call("a"), call("b")], None));
        let ra = msg(r, 1, result("a"));
        match plan(&[&a], 1) {
            Next::RunTools {
                step: 1,
                pending,
                calls,
            } => {
                assert_eq!(pending.len(), 2);
                assert_eq!(calls.len(), 2);
            }
            other => panic!("{other:?}"),
        }
        match plan(&[&a, &ra], 1) {
            Next::RunTools {
                step: 1, pending, ..
            } => assert_eq!(pending, vec![call("b")]),
            other => panic!("{other:?}"),
        }
        let rb = msg(r, 1, result("b"));
        assert_eq!(plan(&[&a, &rb, &ra], 1), Next::CallModel { step: 2 });
    }

    #[test]
    fn a_result_of_an_earlier_step_does_not_answer_a_later_call() {
        let r = RunId::new();
        let a1 = msg(r, 1, assistant(vec![call("x")], None));
        let r1 = msg(r, 1, result("x"));
        let a2 = msg(r, 2, assistant(vec![call("x")], None));
        assert!(matches!(
            plan(&[&a1, &r1, &a2], 2),
            Next::RunTools { step: 2, .. }
        ));
    }

    #[test]
    fn a_message_without_calls_is_the_final_answer() {
        let r = RunId::new();
        let a = msg(r, 3, assistant(vec![], Some("done")));
        assert_eq!(
            plan(&[&a], 3),
            Next::Finish {
                result: "done".into()
            }
        );
    }

    #[test]
    fn a_message_delivered_after_an_answer_asks_the_model_again() {
        let r = RunId::new();
        let a = msg(r, 3, assistant(vec![], Some("done")));
        let user = msg(
            r,
            4,
            Message::User {
                content: "also check the tests".into(),
            },
        );
        assert_eq!(plan(&[&a, &user], 3), Next::CallModel { step: 4 });
        // Between a step's calls and their results, a message waits for them.
        let b = msg(r, 5, assistant(vec![call("x")], None));
        assert!(matches!(
            plan(&[&a, &user, &b], 5),
            Next::RunTools { step: 5, .. }
        ));
    }

    #[test]
    fn the_committed_step_counter_wins_over_a_cut_history() {
        // The context read is bounded: older messages of a long run may be missing, but the
        // next step number must still follow the committed counter.
        let r = RunId::new();
        let a = msg(r, 7, assistant(vec![call("a")], None));
        let ra = msg(r, 7, result("a"));
        assert_eq!(plan(&[&a, &ra], 9), Next::CallModel { step: 10 });
    }
}
