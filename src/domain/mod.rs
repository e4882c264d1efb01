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

use serde::{Deserialize, Serialize};

pub use approval::{Answered, Approval, ApprovalAnswer, ApprovalStatus, NewApproval};
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
}

impl ErrorKind {
    /// Stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Model => "model",
            ErrorKind::Tool => "tool",
            ErrorKind::Timeout => "timeout",
            ErrorKind::Internal => "internal",
            ErrorKind::Lost => "lost",
            ErrorKind::Context => "context",
        }
    }

    /// Parses a stored name.
    pub fn parse(s: &str) -> Option<ErrorKind> {
        Some(match s {
            "model" => ErrorKind::Model,
            "tool" => ErrorKind::Tool,
            "timeout" => ErrorKind::Timeout,
            "internal" => ErrorKind::Internal,
            "lost" => ErrorKind::Lost,
            "context" => ErrorKind::Context,
            _ => return None,
        })
    }
}

/// A failed run's error.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RunError {
    /// Class of failure.
    pub kind: ErrorKind,
    /// What happened, for people.
    pub message: String,
}
