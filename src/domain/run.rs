//! A run as the system knows it: what a caller asks for ([`NewRun`]), the limits it runs
//! under, where it sits in its tree, its record as stored, and how it ends ([`Finish`]).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::RunError;
use crate::ids::{AgentName, OwnerId, RunId, ThreadId};
use crate::lifecycle::{RunStatus, Terminal};
use crate::model::Usage;

/// Limits resolved when the run is created (agent definition, then caller overrides), stored
/// with the run so a resumed run obeys the same limits as the first attempt.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunLimits {
    /// Tool-using steps before a forced final answer.
    pub max_steps: u32,
    /// Wall time from the first start, in seconds.
    pub timeout_secs: u64,
    /// Tokens (prompt + completion, summed over every call of the run and its descendants)
    /// before a forced final answer. Children inherit it: a limit set on a root bounds the tree.
    #[serde(default)]
    pub max_total_tokens: Option<u64>,
    /// Model calls of the run and its descendants before a forced final answer; inherited like
    /// `max_total_tokens`.
    #[serde(default)]
    pub max_total_steps: Option<u64>,
    /// Percent of the context window at which this run compacts, when the caller set it
    /// (otherwise the agent's `compact_at:`, then `SUBAGENTS_COMPACT_AT`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compact_at: Option<u8>,
    /// What the final answer must be (a JSON Schema and how many invalid answers go back to
    /// the model), when the agent or the caller asked for structured output.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<crate::output::OutputContract>,
}

/// What the caller asks for when starting a run.
#[derive(Clone, Debug)]
pub struct NewRun {
    /// Chosen by the caller so a job can be pushed with it.
    pub id: RunId,
    /// New or existing thread.
    pub thread_id: ThreadId,
    /// Owner of the thread and run.
    pub owner: OwnerId,
    /// Agent name.
    pub agent: AgentName,
    /// The user message.
    pub input: String,
    /// Free caller data.
    pub metadata: Value,
    /// Limits.
    pub limits: RunLimits,
    /// The delegating run, if any.
    pub parent_run_id: Option<RunId>,
    /// Where this run sits in a delegation tree.
    pub tree: TreePosition,
    /// The queue job that will execute it.
    pub job_id: String,
    /// What to do when the thread already has an unfinished run.
    pub if_busy: IfBusy,
    /// A repeated start with the same key (per owner) returns the first run.
    pub idempotency_key: Option<String>,
    /// The run this one retries.
    pub retry_of: Option<RunId>,
    /// 1 (lowest) to 5.
    pub priority: u8,
    /// Where it joins its owner's queue: a new root run at the back, a child (its parent
    /// already had its turn) at the front. The store answers with the runs ahead of it.
    pub place: QueuePlace,
    /// The agent definition version it runs ([`crate::pinning`]).
    pub agent_version: Option<String>,
    /// A queue worker of this process with a free slot, to be handed the run's job as it is
    /// written (locked to it, as apalis's fetch would) rather than left for a fetch: see
    /// [`crate::worker::Local`]. The store hands it over only when the run is next in line:
    /// none of its owner's runs queued ahead and no other job waiting to be fetched.
    pub held_by: Option<String>,
    /// Refuse the start ([`crate::store::StoreError::QueueFull`]) when its owner already has
    /// this many runs queued; 0: no cap. The API's starts pass `SUBAGENTS_MAX_QUEUED_PER_KEY`.
    pub max_queued: u64,
}

/// A run's place in its delegation tree.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TreePosition {
    /// The top of the tree (None for a root).
    pub root_run_id: Option<RunId>,
    /// 0 for a root, 1 for its children, …
    pub depth: u32,
    /// A detached child survives its parent's end and cancel.
    pub detached: bool,
}

/// What a start does when its thread already has an unfinished run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum IfBusy {
    /// Refuse with [`StoreError::Busy`].
    #[default]
    Reject,
    /// Queue behind it; runs of one thread execute one at a time, in order.
    Enqueue,
}

/// A thread as stored.
#[derive(Clone, Debug, PartialEq)]
pub struct ThreadRecord {
    /// Id.
    pub id: ThreadId,
    /// Owner.
    pub owner: OwnerId,
    /// Creation time.
    pub created_at: DateTime<Utc>,
    /// Last run start.
    pub updated_at: DateTime<Utc>,
    /// The thread it was forked from, and the last message of that thread's history it
    /// shares (`POST /v1/threads/{id}/fork`).
    pub forked_from: Option<(ThreadId, i64)>,
}

/// A run as stored.
#[derive(Clone, Debug, PartialEq)]
pub struct RunRecord {
    /// Id.
    pub id: RunId,
    /// Thread.
    pub thread_id: ThreadId,
    /// Owner.
    pub owner: OwnerId,
    /// Agent name.
    pub agent: AgentName,
    /// State.
    pub status: RunStatus,
    /// The user message that started it.
    pub input: String,
    /// Caller data.
    pub metadata: Value,
    /// Limits.
    pub limits: RunLimits,
    /// Delegating run.
    pub parent_run_id: Option<RunId>,
    /// Place in the delegation tree.
    pub tree: TreePosition,
    /// When a parked run should be looked at again (Unix ms), if it has a deadline.
    pub wake_at: Option<i64>,
    /// The state it was claimed from last (`queued`, `waiting`, `running` after a crash).
    pub claimed_from: Option<RunStatus>,
    /// Model calls committed so far.
    pub step: u32,
    /// True when the final answer was forced by a limit.
    pub forced: bool,
    /// Final text once succeeded.
    pub result: Option<String>,
    /// Error once failed.
    pub error: Option<RunError>,
    /// Tokens used.
    pub usage: Usage,
    /// Times a worker claimed it (starts, resumes after parking or draining, and reclaims).
    pub attempts: u32,
    /// Times its lease expired under a worker (crashes, kills, freezes): only these count
    /// toward the attempts limit.
    pub crashes: u32,
    /// Current lease epoch.
    pub lease_epoch: i64,
    /// A cancel was requested and not yet acted on.
    pub cancel_requested: bool,
    /// Messages sent to it (`POST /v1/runs/{id}/messages`) that its next step boundary has
    /// not delivered yet.
    pub inbox: u32,
    /// Latest queue job id.
    pub job_id: String,
    /// Seq of the run's latest event.
    pub event_seq: u64,
    /// Creation time.
    pub created_at: DateTime<Utc>,
    /// First claim.
    pub started_at: Option<DateTime<Utc>>,
    /// Terminal time.
    pub finished_at: Option<DateTime<Utc>>,
    /// Last lease renewal or checkpoint.
    pub heartbeat_at: Option<DateTime<Utc>>,
    /// What its model calls cost, in nano-dollars (the price table at the time of each call).
    pub cost_nanos: u64,
    /// The run this one retries (`POST /v1/runs/{id}/retry`).
    pub retry_of: Option<RunId>,
    /// 1 (lowest) to 5: the order of an owner's queued runs.
    pub priority: u8,
    /// The agent definition version it runs, whatever its file says now ([`crate::pinning`]);
    /// `None` for runs from before pinning (they run the current definition).
    pub agent_version: Option<String>,
}

/// How a run ends.
#[derive(Clone, Debug, PartialEq)]
pub enum Finish {
    /// With a final answer.
    Succeeded {
        /// The final text.
        result: String,
        /// Whether a limit forced it.
        forced: bool,
    },
    /// With an error.
    Failed(RunError),
    /// On request.
    Cancelled,
}

/// What a run and its descendants used together.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TreeTotals {
    /// Tokens.
    pub usage: Usage,
    /// Model calls.
    pub steps: u64,
    /// Cost in nano-dollars.
    pub cost_nanos: u64,
}

impl Finish {
    /// The terminal status it ends in.
    pub fn terminal(&self) -> Terminal {
        match self {
            Finish::Succeeded { .. } => Terminal::Succeeded,
            Finish::Failed(_) => Terminal::Failed,
            Finish::Cancelled => Terminal::Cancelled,
        }
    }
}

/// Where a run joins its owner's queue ([`Claims::queue_rank`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueuePlace {
    /// Behind every queued run of its priority or a higher one: a new run waits its turn.
    Back,
    /// Ahead of the other queued runs of its priority, behind those of a higher one: a run that
    /// already had its turn (released by a draining worker, woken from a park, freed by its
    /// thread, or held back by a concurrency limit) does not queue again behind newer work.
    Front,
}
