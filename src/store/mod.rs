//! The store: threads, runs, the checkpointed conversation (messages) and the event outbox.
//! The database is the truth (DESIGN.md invariant 1): every write a run makes goes through
//! [`Store::checkpoint`], which is fenced by the run's lease epoch (invariant 3) and commits the
//! run's counters, its new messages and its events in one transaction (the outbox).
//!
//! The engine talks to a `dyn Store`, so the SQLite implementation here and a PostgreSQL one
//! can be swapped without touching it.

/// Row-to-record mapping, written once and instantiated per backend: the two backends store
/// the same columns, and sqlx's row types differ only in name.
macro_rules! row_mappers {
    ($row:ty) => {
        fn corrupt(what: &str, v: impl std::fmt::Display) -> StoreError {
            StoreError::Corrupt(format!("{what}: {v}"))
        }

        fn run_from_row(r: &$row) -> Result<RunRecord> {
            let id: String = r.get("id");
            let status: String = r.get("status");
            let limits: String = r.get("limits");
            let metadata: String = r.get("metadata");
            let parent: Option<String> = r.get("parent_run_id");
            let ekind: Option<String> = r.get("error_kind");
            let thread: String = r.get("thread_id");
            Ok(RunRecord {
                id: id.parse().map_err(|e| corrupt("run id", e))?,
                thread_id: thread.parse().map_err(|e| corrupt("thread id", e))?,
                owner: r.get("owner"),
                agent: r.get("agent"),
                status: RunStatus::parse(&status).ok_or_else(|| corrupt("status", &status))?,
                input: r.get("input"),
                metadata: serde_json::from_str(&metadata).map_err(|e| corrupt("metadata", e))?,
                limits: serde_json::from_str(&limits).map_err(|e| corrupt("limits", e))?,
                parent_run_id: parent.map(|p| p.parse()).transpose().map_err(|e| corrupt("parent id", e))?,
                tree: TreePosition {
                    root_run_id: r
                        .get::<Option<String>, _>("root_run_id")
                        .map(|p| p.parse())
                        .transpose()
                        .map_err(|e| corrupt("root id", e))?,
                    depth: r.get::<i64, _>("depth") as u32,
                    detached: r.get::<i64, _>("detached") != 0,
                },
                wake_at: r.get("wake_at"),
                claimed_from: r.get::<Option<String>, _>("claimed_from").and_then(|s| RunStatus::parse(&s)),
                step: r.get::<i64, _>("step") as u32,
                forced: r.get::<i64, _>("forced") != 0,
                result: r.get("result"),
                error: match ekind {
                    None => None,
                    Some(k) => Some(RunError {
                        kind: ErrorKind::parse(&k).ok_or_else(|| corrupt("error kind", &k))?,
                        message: r.get::<Option<String>, _>("error_message").unwrap_or_default(),
                    }),
                },
                usage: Usage {
                    prompt_tokens: r.get::<i64, _>("prompt_tokens") as u64,
                    completion_tokens: r.get::<i64, _>("completion_tokens") as u64,
                },
                attempts: r.get::<i64, _>("attempts") as u32,
                crashes: r.get::<i64, _>("crashes") as u32,
                lease_epoch: r.get("lease_epoch"),
                cancel_requested: r.get::<i64, _>("cancel_requested") != 0,
                job_id: r.get("job_id"),
                event_seq: r.get::<i64, _>("event_seq") as u64,
                created_at: r.get::<DateTime<Utc>, _>("created_at"),
                started_at: r.get("started_at"),
                finished_at: r.get("finished_at"),
                heartbeat_at: r.get("heartbeat_at"),
            })
        }

        fn message_from_row(r: &$row) -> Result<StoredMessage> {
            let run: String = r.get("run_id");
            let body: String = r.get("body");
            Ok(StoredMessage {
                id: r.get("id"),
                run_id: run.parse().map_err(|e| corrupt("message run id", e))?,
                step: r.get::<i64, _>("step") as u32,
                key: r.get("key"),
                message: serde_json::from_str(&body).map_err(|e| corrupt("message body", e))?,
            })
        }

        fn event_from_row(r: &$row) -> Result<EventRecord> {
            let run: String = r.get("run_id");
            let data: String = r.get("data");
            Ok(EventRecord {
                seq: r.get::<i64, _>("seq") as u64,
                kind: r.get("type"),
                run_id: run.parse().map_err(|e| corrupt("event run id", e))?,
                created_at: r.get("created_at"),
                data: serde_json::from_str(&data).map_err(|e| corrupt("event data", e))?,
            })
        }

    };
}

#[macro_use]
mod common;
pub mod postgres;
pub mod sqlite;

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::ids::{RunId, ThreadId};
use crate::model::{Message, Usage};

pub use postgres::PgStore;
pub use sqlite::SqliteStore;

/// The queue's name in apalis's job table, which the store reads (to find runs whose job is
/// not waiting to be fetched) and the queue writes. Fixed: apalis's default (the Rust type
/// path) would orphan queued jobs whenever the type moved.
pub const QUEUE_NAME: &str = "subagents.runs";

/// `Result` with the store's error.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

pub use crate::lifecycle::{IllegalTransition, RunStatus, Terminal, Transition};

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

/// Limits resolved when the run is created (agent definition, then caller overrides), stored
/// with the run so a resumed run obeys the same limits as the first attempt.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunLimits {
    /// Tool-using steps before a forced final answer.
    pub max_steps: u32,
    /// Wall time from the first start, in seconds.
    pub timeout_secs: u64,
    /// Tokens (prompt + completion, summed over every call of the run and its descendants)
    /// before a forced final answer. Children inherit it: a budget set on a root bounds the tree.
    #[serde(default)]
    pub max_total_tokens: Option<u64>,
    /// Model calls of the run and its descendants before a forced final answer; inherited like
    /// `max_total_tokens`.
    #[serde(default)]
    pub max_total_steps: Option<u64>,
}

/// What the caller asks for when starting a run.
#[derive(Clone, Debug)]
pub struct NewRun {
    /// Chosen by the caller so a job can be pushed with it.
    pub id: RunId,
    /// New or existing thread.
    pub thread_id: ThreadId,
    /// Owner of the thread and run.
    pub owner: String,
    /// Agent name.
    pub agent: String,
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

/// The answer to [`Store::create_run`].
#[derive(Clone, Debug)]
pub struct Created {
    /// The run.
    pub run: RunRecord,
    /// True when an earlier start with the same idempotency key made it.
    pub existing: bool,
}

/// Filters for listing runs; absent fields do not filter.
#[derive(Clone, Debug, Default)]
pub struct RunFilter {
    /// Only runs in these states.
    pub status: Vec<RunStatus>,
    /// Only this agent.
    pub agent: Option<String>,
    /// Only this thread.
    pub thread_id: Option<ThreadId>,
    /// Only children of this run.
    pub parent_run_id: Option<RunId>,
    /// Only runs older than this one (the cursor; ids are time-ordered).
    pub before: Option<RunId>,
}

/// A thread as stored.
#[derive(Clone, Debug, PartialEq)]
pub struct ThreadRecord {
    /// Id.
    pub id: ThreadId,
    /// Owner.
    pub owner: String,
    /// Creation time.
    pub created_at: DateTime<Utc>,
    /// Last run start.
    pub updated_at: DateTime<Utc>,
}

/// A run as stored.
#[derive(Clone, Debug, PartialEq)]
pub struct RunRecord {
    /// Id.
    pub id: RunId,
    /// Thread.
    pub thread_id: ThreadId,
    /// Owner.
    pub owner: String,
    /// Agent name.
    pub agent: String,
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
}

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

/// Durable event types (DESIGN.md "Events").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum EventKind {
    /// `run.queued`
    #[serde(rename = "run.queued")]
    RunQueued,
    /// `run.started`
    #[serde(rename = "run.started")]
    RunStarted,
    /// `step.started`
    #[serde(rename = "step.started")]
    StepStarted,
    /// `model.completed`
    #[serde(rename = "model.completed")]
    ModelCompleted,
    /// `tool.started`
    #[serde(rename = "tool.started")]
    ToolStarted,
    /// `tool.completed`
    #[serde(rename = "tool.completed")]
    ToolCompleted,
    /// `step.completed`
    #[serde(rename = "step.completed")]
    StepCompleted,
    /// `run.succeeded`
    #[serde(rename = "run.succeeded")]
    RunSucceeded,
    /// `run.failed`
    #[serde(rename = "run.failed")]
    RunFailed,
    /// `run.cancelled`
    #[serde(rename = "run.cancelled")]
    RunCancelled,
    /// `run.waiting`
    #[serde(rename = "run.waiting")]
    RunWaiting,
    /// `run.resumed`
    #[serde(rename = "run.resumed")]
    RunResumed,
    /// `child.started`
    #[serde(rename = "child.started")]
    ChildStarted,
    /// `child.finished`
    #[serde(rename = "child.finished")]
    ChildFinished,
}

impl EventKind {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::RunQueued => "run.queued",
            EventKind::RunStarted => "run.started",
            EventKind::StepStarted => "step.started",
            EventKind::ModelCompleted => "model.completed",
            EventKind::ToolStarted => "tool.started",
            EventKind::ToolCompleted => "tool.completed",
            EventKind::StepCompleted => "step.completed",
            EventKind::RunSucceeded => "run.succeeded",
            EventKind::RunFailed => "run.failed",
            EventKind::RunCancelled => "run.cancelled",
            EventKind::RunWaiting => "run.waiting",
            EventKind::RunResumed => "run.resumed",
            EventKind::ChildStarted => "child.started",
            EventKind::ChildFinished => "child.finished",
        }
    }
}

/// An event to append to a run's outbox.
#[derive(Clone, Debug)]
pub struct NewEvent {
    /// Type.
    pub kind: EventKind,
    /// Payload.
    pub data: Value,
}

impl NewEvent {
    /// Shorthand.
    pub fn new(kind: EventKind, data: Value) -> Self {
        Self { kind, data }
    }
}

/// A stored event.
#[derive(Clone, Debug, PartialEq, Serialize, utoipa::ToSchema)]
pub struct EventRecord {
    /// Gap-free per run, from 1.
    pub seq: u64,
    /// Type name, e.g. `step.completed`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Run.
    pub run_id: RunId,
    /// Commit time.
    pub created_at: DateTime<Utc>,
    /// Payload.
    #[schema(value_type = Object)]
    pub data: Value,
}

/// Proof of holding a run: writes carrying a stale epoch are refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    /// The run.
    pub run_id: RunId,
    /// Fencing token.
    pub epoch: i64,
    /// Worker name, for operators.
    pub owner: String,
    /// How long each renewal keeps it.
    pub ttl: Duration,
}

/// The answer to a claim.
#[derive(Debug)]
pub enum Claim {
    /// The caller now holds the run.
    Acquired(Lease, Box<RunRecord>),
    /// Someone else holds it, or it is finished or missing: nothing to do.
    NotClaimable(Option<RunStatus>),
}

/// A park: the lease holder gives up its worker until what it waits for happens.
#[derive(Clone, Debug, Default)]
pub struct Park {
    /// Events to append with the park (`run.waiting`).
    pub events: Vec<NewEvent>,
    /// Wake at this time (Unix ms) at the latest, if set (an await's timeout).
    pub wake_at: Option<i64>,
    /// The runs whose end wakes it. Any that already ended when the park commits make it due at
    /// once, so an end that raced the park is never missed.
    pub waits_on: Vec<RunId>,
}

/// The answer to [`Store::park`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Parked {
    /// Parked; `due` is true when something it waits on had already happened, so it needs a
    /// claim at once.
    Parked {
        /// Wake it now.
        due: bool,
    },
    /// Not parked: a cancel is pending, and the lease holder must finish the run as cancelled.
    CancelPending,
}

/// A run whose lease had expired, as [`Store::expire_leases`] left it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Expired {
    /// The run.
    pub run_id: RunId,
    /// True when it failed with `kind=lost` (too many crashes) instead of being queued again.
    pub gave_up: bool,
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

/// One atomic, fenced write of a run's progress.
#[derive(Clone, Debug, Default)]
pub struct Checkpoint {
    /// Messages to append (idempotent by key).
    pub messages: Vec<NewMessage>,
    /// Events to append, in order.
    pub events: Vec<NewEvent>,
    /// New step counter, if it moved.
    pub step: Option<u32>,
    /// Tokens to add.
    pub usage: Usage,
    /// Terminal transition, if this write ends the run. The parent's `child.finished` event and
    /// the wake-up of every run waiting on this one commit with it.
    pub finish: Option<Finish>,
}

/// Which of a terminal commit's effects can apply, as the fence found out in the same
/// statement: skipping the ones that cannot keeps an ordinary run's end one statement.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Reach {
    /// Some run waits on it, or it waited on some: wake-ups and its own waits.
    pub(crate) waits: bool,
    /// It has attached children not yet ended.
    pub(crate) children: bool,
}

impl Reach {
    /// Every effect (paths that did not ask).
    pub(crate) const ALL: Reach = Reach { waits: true, children: true };
}

/// The extra columns a terminal fence returns: what [`Reach`] is read from.
pub(crate) const REACH_COLUMNS: &str = ", EXISTS (SELECT 1 FROM sa_run_waits w WHERE w.target = sa_runs.id OR w.waiter = sa_runs.id), \
    EXISTS (SELECT 1 FROM sa_runs c WHERE c.parent_run_id = sa_runs.id AND c.detached = 0 AND c.status IN ('queued','running','waiting'))";

/// What a checkpoint's fenced `UPDATE` writes besides the counters: the terminal columns (if
/// it finishes the run) and the status guard its transition allows. Both backends bind these
/// the same way (see `bind_fence!`).
pub(crate) struct FenceFields {
    pub(crate) status: Option<RunStatus>,
    pub(crate) result: Option<String>,
    pub(crate) forced: Option<i64>,
    pub(crate) error_kind: Option<&'static str>,
    pub(crate) error_message: Option<String>,
    pub(crate) finished_at: Option<DateTime<Utc>>,
    pub(crate) guard: &'static str,
    /// [`REACH_COLUMNS`] for a terminal checkpoint, nothing otherwise.
    pub(crate) reach_columns: &'static str,
}

impl Checkpoint {
    pub(crate) fn fence_fields(&self, now: DateTime<Utc>) -> FenceFields {
        let mut f = FenceFields {
            status: self.finish.as_ref().map(|f| f.terminal().status()),
            result: None,
            forced: None,
            error_kind: None,
            error_message: None,
            finished_at: self.finish.as_ref().map(|_| now),
            guard: sources!(Transition::Heartbeat),
            reach_columns: if self.finish.is_some() { REACH_COLUMNS } else { "" },
        };
        match &self.finish {
            None => {}
            Some(Finish::Succeeded { result, forced }) => {
                f.result = Some(result.clone());
                f.forced = Some(*forced as i64);
                f.guard = sources!(Transition::Finish(Terminal::Succeeded));
            }
            Some(Finish::Failed(e)) => {
                f.error_kind = Some(e.kind.as_str());
                f.error_message = Some(e.message.clone());
                f.guard = sources!(Transition::Finish(Terminal::Failed));
            }
            Some(Finish::Cancelled) => f.guard = sources!(Transition::Finish(Terminal::Cancelled)),
        }
        f
    }

    /// The error it finishes the run with, if any (for the parent's `child.finished`).
    pub(crate) fn error(&self) -> Option<&RunError> {
        match &self.finish {
            Some(Finish::Failed(e)) => Some(e),
            _ => None,
        }
    }
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

/// The answer to a lease renewal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseStatus {
    /// Somebody asked to cancel this run.
    pub cancel_requested: bool,
}

/// The answer to a cancel request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CancelOutcome {
    /// It was queued or parked and is now cancelled.
    Cancelled,
    /// It is executing; the worker will stop it.
    Requested,
    /// It had already ended.
    AlreadyFinished(RunStatus),
    /// No such run.
    NotFound,
}

/// A run that needs a (new) queue job: queued without a job that will start it, or parked
/// and due.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Orphan {
    /// The run.
    pub run_id: RunId,
    /// Its state now.
    pub status: RunStatus,
}

/// Storage failures, classified.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The thread already has an active run.
    #[error("thread {thread_id} is busy with run {active_run}; wait for it to end or enqueue behind it")]
    Busy {
        /// The thread.
        thread_id: ThreadId,
        /// Its active run.
        active_run: RunId,
    },
    /// The caller's lease epoch is stale: another worker owns the run now.
    #[error("lease lost: another worker owns run {0} now")]
    LeaseLost(RunId),
    /// The thread exists under another owner.
    #[error("thread {0} belongs to another owner")]
    ThreadOwnedElsewhere(ThreadId),
    /// A stored value could not be read back.
    #[error("corrupt row: {0}")]
    Corrupt(String),
    /// The database failed.
    #[error("database error: {0}")]
    Db(#[from] sqlx::Error),
    /// Migrations failed.
    #[error("migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
}

/// What runs need from storage: the run log the engine writes (claims, checkpoints, parks,
/// terminal commits) and the reads and moves the runs service, delegation and the worker make.
/// Every status write applies `lifecycle::next_status`.
#[async_trait]
pub trait RunLog: Send + Sync + 'static {
    /// Creates the thread if new and the run (`queued`) with its `run.queued` event.
    /// With [`IfBusy::Reject`], refuses with [`StoreError::Busy`] when the thread has an
    /// unfinished run.
    async fn create_run(&self, new: NewRun) -> Result<Created>;

    /// Reads a run.
    async fn get_run(&self, id: RunId) -> Result<Option<RunRecord>>;

    /// [`Transition::Claim`]: takes a queued run (when its thread is free and it is the
    /// thread's oldest) or a parked one; bumps the epoch.
    async fn claim_run(&self, id: RunId, owner: &str, ttl: Duration) -> Result<Claim>;

    /// [`Transition::Heartbeat`]: extends the lease. Fails with [`StoreError::LeaseLost`] if
    /// the epoch is stale or the run is no longer running.
    async fn renew_lease(&self, lease: &Lease) -> Result<LeaseStatus>;

    /// [`Transition::Release`]: gives the run back to the queue at once (a draining worker, a
    /// storage failure) under a new job id, which the caller pushes. Returns false when the
    /// lease was already lost.
    async fn release_lease(&self, lease: &Lease, job_id: &str) -> Result<bool>;

    /// Commits progress atomically, fenced by the lease ([`Transition::Heartbeat`], or
    /// [`Transition::Finish`] when `cp.finish` is set).
    async fn checkpoint(&self, lease: &Lease, cp: Checkpoint) -> Result<()>;

    /// [`Transition::Park`], fenced by the lease; refused with [`Parked::CancelPending`] when a
    /// cancel was requested (the holder must finish the run instead).
    async fn park(&self, lease: &Lease, park: Park) -> Result<Parked>;

    /// [`Transition::Wake`]: makes a parked run due for a claim. False if it was not parked.
    async fn wake(&self, run: RunId) -> Result<bool>;

    /// [`Transition::Expire`] or, after `max_crashes` expiries, [`Transition::GiveUp`], for
    /// every running run whose lease has run out.
    async fn expire_leases(&self, max_crashes: u32) -> Result<Vec<Expired>>;

    /// Parked runs that are due and wait on `run`: who to push a job for after `run` ended.
    async fn due_waiters(&self, run: RunId) -> Result<Vec<RunId>>;

    /// The newest `limit` messages of a thread, in order (the context a run rebuilds).
    async fn thread_messages(&self, thread: &ThreadId, limit: u32) -> Result<Vec<StoredMessage>>;

    /// Events of a run with `seq > after`, at most `limit`.
    async fn events_after(&self, run: RunId, after: u64, limit: u32) -> Result<Vec<EventRecord>>;

    /// Asks a run to stop; idempotent.
    async fn request_cancel(&self, run: RunId) -> Result<CancelOutcome>;

    /// Runs that need a new queue job: queued without a job that will start them (none, a
    /// finished one, or one held by a worker without being started), or parked and due;
    /// `grace` keeps fresh enqueues and recent re-enqueues out.
    async fn orphans(&self, grace: Duration) -> Result<Vec<Orphan>>;

    /// Records the queue job now responsible for the run.
    async fn set_job(&self, run: RunId, job_id: &str) -> Result<()>;

    /// The oldest queued run of a thread: the one to start when the thread frees up.
    async fn next_queued(&self, thread: &ThreadId) -> Result<Option<RunId>>;

    /// Wake-ups for changes to `run` made through this store (see [`crate::notify`]).
    fn subscribe(&self, run: RunId) -> std::sync::Arc<tokio::sync::Notify>;

    /// Wake-ups for cancel requests of `run` made through this store.
    fn subscribe_cancel(&self, run: RunId) -> std::sync::Arc<tokio::sync::Notify>;

    /// Appends events to a run's stream without holding its lease (a parent announcing a
    /// child it started). The seq stays gap-free: it is reserved under the run row's write
    /// lock. Nothing is appended to a finished run (returns false): nothing follows a terminal
    /// event.
    async fn append_events(&self, run: RunId, events: Vec<NewEvent>) -> Result<bool>;

    /// The run's children, oldest first.
    async fn children(&self, run: RunId) -> Result<Vec<RunRecord>>;

    /// Usage of the run and all its descendants: (prompt tokens, completion tokens, steps).
    async fn tree_usage(&self, run: RunId) -> Result<(Usage, u64)>;

    /// The deadline recorded under `key`, recording `proposed` if there is none yet.
    async fn wait_deadline(&self, key: &str, proposed: i64) -> Result<i64>;
}

/// What the API, metrics and benchmarks read (and wipe) beyond a single run.
#[async_trait]
pub trait Queries: Send + Sync + 'static {
    /// Deletes every thread, run, message, event and queued run job. For benchmarks, which
    /// must start from empty tables; the server never calls it.
    async fn wipe(&self) -> Result<()>;

    /// Rows written by checkpoints (messages plus events), for benchmarks.
    async fn checkpoint_rows(&self) -> Result<i64>;

    /// Runs of `owner` matching `filter`, newest first.
    async fn list_runs(&self, owner: &str, filter: &RunFilter, limit: u32) -> Result<Vec<RunRecord>>;

    /// A thread, if it exists.
    async fn get_thread(&self, id: &ThreadId) -> Result<Option<ThreadRecord>>;

    /// A page of a thread's messages with `id > after`, oldest first.
    async fn messages_page(&self, thread: &ThreadId, after: i64, limit: u32) -> Result<Vec<StoredMessage>>;

    /// How many queued runs are ahead of this one (0 = next).
    async fn queue_position(&self, run: RunId) -> Result<i64>;

    /// The arguments (raw JSON) of the run's latest call to `tool`, if it made one: the run
    /// view reads the agent's plan (`todo_write`) this way.
    async fn last_call_arguments(&self, run: RunId, tool: &str) -> Result<Option<String>>;

    /// Number of runs per state, for metrics.
    async fn status_counts(&self) -> Result<Vec<(RunStatus, i64)>>;

    /// Wake-ups on a change to any run made through this store.
    fn subscribe_all(&self) -> std::sync::Arc<tokio::sync::Notify>;
}

/// What the relay needs: outbox rows not yet in Redis, and local wake-ups for changes heard
/// from other processes.
#[async_trait]
pub trait Outbox: Send + Sync + 'static {
    /// Outbox rows not yet relayed to Redis, each run's in seq order.
    async fn unrelayed(&self, limit: u32) -> Result<Vec<EventRecord>>;

    /// Marks outbox rows as relayed.
    async fn mark_relayed(&self, events: &[(RunId, u64)]) -> Result<()>;

    /// Wakes this process's waiters for a change made elsewhere (heard over Redis).
    fn wake_local(&self, run: RunId, cancel: bool);
}

/// The whole store, split by its users ([`RunLog`], [`Queries`], [`Outbox`]); both backends
/// implement all three.
pub trait Store: RunLog + Queries + Outbox {}

impl<T: RunLog + Queries + Outbox> Store for T {}

/// Milliseconds since the Unix epoch: lease deadlines are stored as integers so every backend
/// compares them the same way.
pub fn now_ms() -> i64 {
    Utc::now().timestamp_millis()
}
