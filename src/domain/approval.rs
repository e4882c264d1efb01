//! Approvals: a person's answer to a tool call that the rules (or a hook) said to ask about.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::ids::{ApprovalId, RunId};

/// Where an approval stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ApprovalStatus {
    /// Waiting for an answer.
    Pending,
    /// Allowed: the call runs.
    Allowed,
    /// Denied: the model is told.
    Denied,
    /// Nobody answered within the approval timeout: denied.
    Expired,
}

stored_names!(ApprovalStatus {
    Pending => "pending",
    Allowed => "allowed",
    Denied => "denied",
    Expired => "expired",
});

/// What an allow covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalScope {
    /// This call only.
    Once,
    /// The tool (or the rule that asked) for the rest of the run tree: later calls that the
    /// same rule would ask about run without asking.
    RunTree,
}

stored_names!(ApprovalScope {
    Once => "once",
    RunTree => "run_tree",
});

/// A tool call a run waits on a person for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Approval {
    /// `apr_…`, time-ordered.
    pub id: ApprovalId,
    /// The run that asked.
    #[schema(value_type = String)]
    pub run_id: RunId,
    /// Its root (a child's approval shows with its root run).
    #[schema(value_type = String)]
    pub root_run_id: RunId,
    /// The tool.
    pub tool: String,
    /// The call's arguments.
    #[schema(value_type = Object)]
    pub input: Value,
    /// Why it was asked: the rule or hook that asked.
    pub reason: String,
    /// Where it stands.
    pub status: ApprovalStatus,
    /// The answer's reason (or why it expired).
    pub answer_reason: Option<String>,
    /// Who answered (the owner's key), or `timeout`.
    pub resolved_by: Option<String>,
    /// Arguments the approver replaced the call's with.
    #[schema(value_type = Option<Object>)]
    pub updated_input: Option<Value>,
    /// What the answer covers (set once answered).
    pub scope: Option<ApprovalScope>,
    /// Asked at.
    pub created_at: DateTime<Utc>,
    /// Counts as denied after this (Unix ms).
    pub expires_at: i64,
    /// Answered (or expired) at.
    pub resolved_at: Option<DateTime<Utc>>,
}

/// An approval to open with a call's decision.
#[derive(Clone, Debug)]
pub struct NewApproval {
    /// Its id.
    pub id: ApprovalId,
    /// The tool.
    pub tool: String,
    /// The call's arguments.
    pub input: Value,
    /// Why it is asked: the rule or hook that asked.
    pub reason: String,
    /// Unix ms after which it counts as denied.
    pub expires_at: i64,
    /// What a `run_tree` grant of it covers (see [`crate::permissions::grant_scope`]).
    pub grant_scope: String,
}

/// An answer to an approval.
#[derive(Clone, Debug)]
pub struct ApprovalAnswer {
    /// Allow or deny.
    pub allow: bool,
    /// Why (the model sees it on a deny).
    pub reason: Option<String>,
    /// Replacement arguments (allow only).
    pub updated_input: Option<Value>,
    /// Allow the tool for the whole run tree, not just this call.
    pub run_tree: bool,
    /// Who answers (recorded as `resolved_by`).
    pub by: String,
}

/// What answering an approval did.
#[derive(Clone, Debug, PartialEq)]
pub enum Answered {
    /// Recorded; the run was woken (push a job for it).
    Done {
        /// The run to push.
        run_id: RunId,
    },
    /// No such approval for this owner.
    NotFound,
    /// It was answered (or expired, or its run ended) already.
    Closed(ApprovalStatus),
}
