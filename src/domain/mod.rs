//! The run's vocabulary, apart from where it is kept: a run ([`run`]), its messages
//! ([`message`]), its approvals ([`approval`]), what happens to it ([`Event`], a payload type per
//! event), why it failed ([`RunError`]), and the overview of an owner's runs. The store writes
//! and reads these; nothing builds an event's JSON by hand.

pub mod approval;
pub mod event;
pub mod job;
pub mod message;
pub mod overview;
pub mod rate;
pub mod run;
pub mod schedule;
pub mod webhook;

use serde::{Deserialize, Serialize};

pub use approval::{
    Answered, Approval, ApprovalAnswer, ApprovalScope, ApprovalStatus, NewApproval,
};
pub use event::Event;
pub use message::{Compaction, CompactionBody, NewMessage, StoredMessage};
pub use overview::OverviewData;
pub use run::{
    Finish, IfBusy, NewRun, QueuePlace, RunLimits, RunRecord, ThreadRecord, TreePosition,
    TreeTotals,
};

/// Why a run failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ErrorKind {
    /// The model endpoint refused or kept failing.
    Model,
    /// A tool failed in a way the run cannot continue from.
    Tool,
    /// The run's wall-time limit passed.
    Timeout,
    /// A bug or an unexpected storage failure.
    Internal,
    /// Workers kept dying on this run; retries exhausted.
    Lost,
    /// The context could not be brought inside the model's window (compaction failed three
    /// times in a row, or the system prompt and task alone do not fit).
    Context,
    /// The final answer kept failing its output schema (`output_retries` answers were sent
    /// back with the errors).
    Output,
}

stored_names!(ErrorKind {
    Model => "model",
    Tool => "tool",
    Timeout => "timeout",
    Internal => "internal",
    Lost => "lost",
    Context => "context",
    Output => "output",
});

/// A failed run's error.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RunError {
    /// Class of failure.
    pub kind: ErrorKind,
    /// What happened, for people.
    pub message: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names serde sends are the names the store keeps.
    #[test]
    fn stored_names_are_the_serde_names() {
        for k in ErrorKind::ALL {
            assert_eq!(serde_json::to_value(k).unwrap(), k.as_str());
            assert_eq!(ErrorKind::parse(k.as_str()), Some(k));
        }
        for s in ApprovalStatus::ALL {
            assert_eq!(serde_json::to_value(s).unwrap(), s.as_str());
            assert_eq!(ApprovalStatus::parse(s.as_str()), Some(s));
        }
        for s in crate::lifecycle::RunStatus::ALL {
            assert_eq!(serde_json::to_value(s).unwrap(), s.as_str());
            assert_eq!(crate::lifecycle::RunStatus::parse(s.as_str()), Some(s));
        }
        for s in ApprovalScope::ALL {
            assert_eq!(serde_json::to_value(s).unwrap(), s.as_str());
            assert_eq!(ApprovalScope::parse(s.as_str()), Some(s));
        }
        for r in event::CompactionReason::ALL {
            assert_eq!(serde_json::to_value(r).unwrap(), r.as_str());
        }
        assert_eq!(ErrorKind::parse("Model"), None, "names are exact");
    }
}
