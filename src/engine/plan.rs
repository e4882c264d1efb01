//! The planner: a pure function from a run's committed history to what it must do next. The
//! executor ([`super::Engine`]) does the I/O and commits; it asks the planner again after every
//! commit, so a fresh run, a resumed run and a replay after a crash take the same path.
//!
//! Parking is the executor's outcome, not the planner's: whether a delegation call must wait
//! depends on its children's state, which only the store knows (see [`super::LoopEnd`]).

use std::collections::HashSet;

use crate::model::{Message, ToolCall};
use crate::store::StoredMessage;

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
    let Some(last) = own
        .iter()
        .rev()
        .find(|m| matches!(m.message, Message::Assistant { .. }))
    else {
        return Next::CallModel {
            step: steps_done + 1,
        };
    };
    let Message::Assistant {
        content,
        tool_calls,
    } = &last.message
    else {
        unreachable!("filtered above")
    };
    if tool_calls.is_empty() {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::RunId;
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
    fn the_committed_step_counter_wins_over_a_cut_history() {
        // The context read is bounded: older messages of a long run may be missing, but the
        // next step number must still follow the committed counter.
        let r = RunId::new();
        let a = msg(r, 7, assistant(vec![call("a")], None));
        let ra = msg(r, 7, result("a"));
        assert_eq!(plan(&[&a, &ra], 9), Next::CallModel { step: 10 });
    }
}
