//! A thread's messages as committed, and the summaries that stand for a range of them.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::ids::RunId;
use crate::model::Message;

/// A checkpointed message.
#[derive(Clone, Debug, PartialEq)]
pub struct StoredMessage {
    /// Position in the thread (increasing).
    pub id: i64,
    /// The run that wrote it.
    pub run_id: RunId,
    /// The step it belongs to (0 = input).
    pub step: u32,
    /// Idempotency key: `{run}:input`, `{run}:{step}:assistant`, `{run}:{step}:tool:{call}`.
    pub key: String,
    /// The message.
    pub message: Message,
}

/// A message to append. The key makes the append idempotent.
#[derive(Clone, Debug)]
pub struct NewMessage {
    /// Step.
    pub step: u32,
    /// Idempotency key.
    pub key: String,
    /// The message.
    pub message: Message,
}

/// A committed compaction: its [`CompactionBody`] (reachable through `Deref`: `c.summary`) says
/// which of the thread's messages the summary stands for when a context is rebuilt (all but the
/// compacting run's own task, which is always kept verbatim). Nothing is deleted: the thread
/// view still pages through every message.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Compaction {
    /// Position among the thread's compactions (increasing).
    pub id: i64,
    /// The run whose step compacted.
    #[schema(value_type = String)]
    pub run_id: RunId,
    /// What was compacted, and into what.
    #[serde(flatten)]
    pub body: CompactionBody,
    /// When it was committed.
    pub created_at: DateTime<Utc>,
}

impl std::ops::Deref for Compaction {
    type Target = CompactionBody;
    fn deref(&self) -> &CompactionBody {
        &self.body
    }
}

/// What a compaction commits (see [`Checkpoints::commit_compaction`]); the range is its identity, so
/// committing the same range twice adds nothing.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CompactionBody {
    /// First message replaced.
    pub first_message_id: i64,
    /// Last message replaced; a rebuilt context holds only messages after it.
    pub last_message_id: i64,
    /// How many messages it replaced.
    pub messages: i64,
    /// The summary text the model wrote (plus the still-pending delegations).
    pub summary: String,
    /// Estimated tokens of the request before and after.
    pub tokens_before: i64,
    /// See `tokens_before`.
    pub tokens_after: i64,
    /// `threshold` (the next request would pass `compact_at`), `context_length` (the provider
    /// refused the request as too long) or `new_run` (a new run on a long thread).
    pub reason: String,
}
