//! The store: threads, runs, the checkpointed conversation (messages) and the event outbox.
//! The database is the truth: every write a run makes goes through
//! [`Store::checkpoint`], which is fenced by the run's lease epoch (invariant 3) and commits the
//! run's counters, its new messages and its events in one transaction (the outbox).
//!
//! The engine talks to a `dyn Store`, so the SQLite implementation here and a PostgreSQL one
//! can be swapped without touching it.

/// The two questions a run's end asks of the database, as SQL literals so constants can be
/// built from them: is some wait row about the run (someone waits on it, or it waited on
/// someone), and has it an attached child still going. [`REACH_COLUMNS`] asks them after the
/// fence, [`ENDS_ALONE`] before it; one text keeps the two asking the same thing.
macro_rules! reach_waits {
    () => {
        "EXISTS (SELECT 1 FROM sa_run_waits w WHERE w.target = sa_runs.id OR w.waiter = sa_runs.id)"
    };
}
macro_rules! reach_children {
    () => {
        "EXISTS (SELECT 1 FROM sa_runs c WHERE c.parent_run_id = sa_runs.id AND c.detached = 0 AND c.status IN ('queued','running','waiting'))"
    };
}

#[macro_use]
mod common;
mod group;
mod kept;
pub(crate) mod pg_ends;
mod pg_pool;
pub mod postgres;
mod seed;
mod shared;
mod sql;
pub mod sqlite;

use std::collections::BTreeMap;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde_json::Value;

use crate::ids::{ApprovalId, MessageId, OwnerId, RunId, ThreadId};
use crate::model::Usage;

pub use postgres::PgStore;

pub use sqlite::SqliteStore;

pub use crate::domain::job::{JOB_MAX_ATTEMPTS, QUEUE_NAME, RunJob, job_body, job_priority};
pub use crate::domain::rate::{OwnerBudget, next_wake};

/// `Result` with the store's error.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

pub use crate::lifecycle::{IllegalTransition, RunStatus, Terminal, Transition};

#[allow(unused_imports)]
use crate::domain::event;
pub use crate::domain::schedule::{CatchUp, Overlap, Schedule};
pub use crate::domain::webhook::{
    Attempted, Delivery, DeliveryStatus, DueDelivery, NewDelivery, QueuedEvent, Webhook,
    WebhookPatch,
};
pub use crate::domain::{
    Answered, Approval, ApprovalAnswer, ApprovalScope, ApprovalStatus, Compaction, CompactionBody,
    ErrorKind, Event, Finish, IfBusy, NewApproval, NewMessage, NewRun, OverviewData, QueuePlace,
    RunError, RunLimits, RunRecord, StoredMessage, ThreadRecord, TreePosition, TreeTotals,
};

/// The answer to [`Store::create_run`].
#[derive(Clone, Debug)]
pub struct Created {
    /// The run.
    pub run: RunRecord,
    /// True when an earlier start with the same idempotency key made it.
    pub existing: bool,
    /// Its owner's queued runs ahead of it as it was created, by [`NewRun::place`] (what
    /// [`Claims::queue_rank`] answers, read in the same round trip); 0 for an existing run.
    pub ahead: u32,
    /// Whether the run's job was written locked to [`NewRun::held_by`]: that worker starts
    /// it now, and nobody else fetches it.
    pub held: bool,
}

/// How a job handed to a worker of this process ended ([`Claims::settle_held_job`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JobEnd {
    /// Handled: the run went as far as this worker could take it (whatever its outcome).
    Done,
    /// The handling failed (the database, most often): any worker fetches it again.
    Retry,
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
    /// Only runs whose input or result contains this text (case-insensitive).
    pub text: Option<String>,
    /// Only runs created at or after this time.
    pub created_after: Option<DateTime<Utc>>,
    /// Only runs created before this time.
    pub created_before: Option<DateTime<Utc>>,
    /// Oldest first instead of newest first.
    pub oldest_first: bool,
    /// The cursor: only runs past this one in the page order (ids are time-ordered).
    pub before: Option<RunId>,
    /// Only runs this schedule started.
    pub schedule_id: Option<String>,
}

/// An event to append to a run's outbox: the stored form of an [`Event`], and built only from
/// one.
#[derive(Clone, Debug)]
pub struct NewEvent {
    kind: &'static str,
    data: Value,
}

impl From<Event> for NewEvent {
    fn from(e: Event) -> Self {
        NewEvent {
            kind: e.name(),
            data: e.data(),
        }
    }
}

impl NewEvent {
    /// The type's wire name.
    pub fn kind(&self) -> &'static str {
        self.kind
    }

    /// The payload.
    pub fn data(&self) -> &Value {
        &self.data
    }

    /// This event as committed: event `seq` of `run`, stamped `at`.
    pub(crate) fn record(&self, run: RunId, seq: u64, at: DateTime<Utc>) -> EventRecord {
        EventRecord {
            seq,
            kind: self.kind.to_owned(),
            run_id: run,
            created_at: at,
            data: self.data.clone(),
        }
    }
}

pub use crate::domain::event::EventRecord;

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
    /// The run has a parent, as its claim read it: its end tells the parent, so the
    /// one-statement end of a run that tells nobody ([`ENDS_ALONE`]) is not tried first.
    pub child: bool,
}

/// The answer to a claim.
#[derive(Debug)]
pub enum Claim {
    /// The caller now holds the run.
    Acquired(Lease, Box<RunRecord>),
    /// Someone else holds it, or it is finished or missing: nothing to do.
    NotClaimable(Option<RunStatus>),
}

/// A job a worker took and the claim of its run that came with it
/// ([`Claims::take_and_claim`]).
#[derive(Debug)]
pub struct Taken {
    /// The job's run.
    pub run_id: RunId,
    /// Its claim by the worker that took the job: a run that is not claimable (its thread's
    /// earlier run still going, a concurrency limit) leaves the job taken all the same, as a
    /// fetched job whose run turns out not claimable is.
    pub claim: Claim,
    /// The run's context where the claim read it ([`Claims::claim_with_context`]).
    pub context: Option<ThreadContext>,
}

impl Claim {
    /// The claim of `run`, as its claim returned it, by `owner` for `ttl`.
    pub(crate) fn acquired(run: RunRecord, owner: &str, ttl: Duration) -> Claim {
        Claim::Acquired(
            Lease {
                run_id: run.id,
                epoch: run.lease_epoch,
                owner: owner.to_owned(),
                ttl,
                child: run.parent_run_id.is_some(),
            },
            Box::new(run),
        )
    }
}

/// What a run rebuilds its context from: its thread's newest compaction, and the messages after
/// it, in order ([`Checkpoints::context`]).
pub type ThreadContext = (Option<Compaction>, Vec<StoredMessage>);

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
    /// The approvals whose answer wakes it; one already answered when the park commits makes it
    /// due at once (an answer that raced the park is never missed).
    pub approvals: Vec<ApprovalId>,
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

/// What a run's terminal commit saw of the runs its end touches, and did for its worker, so that
/// the worker acts on the end without reading or writing again: a short run's end used to cost
/// two reads and a write after its commit (its children, its thread's next run, its job).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ending {
    /// An attached child was still going when the run ended. The commit already cancelled it
    /// or asked it to stop; its worker in this process is told at once ([`Runs::request_cancel`]).
    pub children_going: bool,
    /// The thread's run that may start now.
    pub next: NextQueued,
    /// The run's job, held by the worker that ended it, marked done by the same commit: its
    /// worker need not settle it after ([`Claims::settle_held_job`]).
    pub job_done: Option<String>,
}

impl Ending {
    /// What a worker assumes when its commit could not tell: children may be going, and the
    /// thread's next run is read after the commit.
    pub const UNKNOWN: Ending = Ending {
        children_going: true,
        next: NextQueued::Unknown,
        job_done: None,
    };
}

/// A thread's next run after one of its runs ended: its oldest queued run, unless that already
/// has a pending job ([`Runs::next_queued`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NextQueued {
    /// Read inside the end's transaction, where no start could commit in between (SQLite's
    /// single writer): that run, or none.
    Known(Option<RunId>),
    /// Not read with the end; read it after the commit. PostgreSQL's end reads a snapshot a
    /// start committing at the same moment may not be in.
    Unknown,
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
    /// Cost to add, in nano-dollars.
    pub cost_nanos: u64,
    /// Terminal transition, if this write ends the run. The parent's `child.finished` event and
    /// the wake-up of every run waiting on this one commit with it.
    pub finish: Option<Finish>,
    /// Pins to write (`name`, `value`), each only if the run has none of that name: a run's
    /// first claim commits them with its input (see [`Pins::pin_run`] for the rest).
    pub pins: Vec<(String, String)>,
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
    pub(crate) const ALL: Reach = Reach {
        waits: true,
        children: true,
    };
}

/// The fence of a run's end that tells nobody: the run has no parent (no `child.finished` to
/// write), no run waits on it and it waits on none (no wake-up, no waits to drop), and no
/// attached child of it is still going (none to cancel). What [`REACH_COLUMNS`] and the parent
/// column report after the fact, asked before, in the same snapshot.
pub(crate) const ENDS_ALONE: &str = concat!(
    " AND parent_run_id IS NULL AND NOT ",
    reach_waits!(),
    " AND NOT ",
    reach_children!()
);

/// The extra columns a terminal fence returns: what [`Reach`] is read from.
pub(crate) const REACH_COLUMNS: &str = concat!(", ", reach_waits!(), ", ", reach_children!());

/// What a checkpoint's fenced `UPDATE` writes besides the counters: the terminal columns (if
/// it finishes the run) and the status guard its transition allows. Both backends bind these
/// the same way (see `bind_fence!`).
/// The fence of a final answer: no message waits for the run. A refused fence looks like a
/// lost lease to the committer; the engine then renews the lease, hears the messages, and goes
/// on with them instead of finishing.
pub(crate) const UNSTEERED: &str = " AND inbox = 0";

pub(crate) struct FenceFields {
    pub(crate) status: Option<RunStatus>,
    pub(crate) result: Option<String>,
    pub(crate) forced: Option<i64>,
    pub(crate) error_kind: Option<ErrorKind>,
    pub(crate) error_message: Option<String>,
    pub(crate) finished_at: Option<DateTime<Utc>>,
    pub(crate) guard: &'static str,
    /// More of the fence's `WHERE`: a final answer that was not forced holds only while no
    /// message waits for the run ([`UNSTEERED`]), so a message that committed before it is
    /// delivered, not dropped.
    pub(crate) only_if: &'static str,
    /// [`REACH_COLUMNS`] for a terminal checkpoint, nothing otherwise.
    pub(crate) reach_columns: &'static str,
}

impl Checkpoint {
    /// This checkpoint's events as they were committed: numbered to end at `last` (where the
    /// fence moved the run's `event_seq`) and stamped `at`, as the outbox holds them.
    pub(crate) fn records(&self, run: RunId, last: i64, at: DateTime<Utc>) -> Vec<EventRecord> {
        let first = last - self.events.len() as i64 + 1;
        self.events
            .iter()
            .zip(first..)
            .map(|(e, seq)| e.record(run, seq as u64, at))
            .collect()
    }

    pub(crate) fn fence_fields(&self, now: DateTime<Utc>) -> FenceFields {
        let mut f = FenceFields {
            status: self.finish.as_ref().map(|f| f.terminal().status()),
            result: None,
            forced: None,
            error_kind: None,
            error_message: None,
            finished_at: self.finish.as_ref().map(|_| now),
            guard: sources!(Transition::Heartbeat),
            only_if: "",
            reach_columns: if self.finish.is_some() {
                REACH_COLUMNS
            } else {
                ""
            },
        };
        match &self.finish {
            None => {}
            Some(Finish::Succeeded { result, forced }) => {
                f.result = Some(result.clone());
                f.forced = Some(*forced as i64);
                f.guard = sources!(Transition::Finish(Terminal::Succeeded));
                if !forced {
                    f.only_if = UNSTEERED;
                }
            }
            Some(Finish::Failed(e)) => {
                f.error_kind = Some(e.kind);
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

/// The answer to a lease renewal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseStatus {
    /// Somebody asked to cancel this run.
    pub cancel_requested: bool,
    /// Messages wait for its next step boundary ([`Inbox`]).
    pub messages_waiting: bool,
    /// It is to be cancelled at its next step boundary ([`Runs::request_interrupt`]).
    pub interrupt_requested: bool,
}

impl LeaseStatus {
    /// Reads a renewal's `cancel_requested` and `inbox` columns: 1 asks for a cancel now, 2 for
    /// one at the next step boundary (any other value but 0 is a cancel now).
    pub(crate) fn from_columns(cancel: i64, inbox: i64) -> LeaseStatus {
        LeaseStatus {
            cancel_requested: cancel != 0 && cancel != INTERRUPT,
            messages_waiting: inbox > 0,
            interrupt_requested: cancel == INTERRUPT,
        }
    }
}

/// `sa_runs.cancel_requested` for a cancel at the run's next step boundary (an interrupt);
/// 1 is a cancel now. Everything that reads the column at a boundary (a claim, a park) treats
/// both alike; only a running run's lease renewal tells them apart.
pub(crate) const INTERRUPT: i64 = 2;

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
    #[error(
        "thread {thread_id} is busy with run {active_run}; wait for it to end or enqueue behind it"
    )]
    Busy {
        /// The thread.
        thread_id: ThreadId,
        /// Its active run.
        active_run: RunId,
    },
    /// The caller's lease epoch is stale: another worker owns the run now.
    #[error("lease lost: another worker owns run {0} now")]
    LeaseLost(RunId),
    /// The thread exists under another owner. Its message is a missing thread's, so that no
    /// front end (the API, MCP, the CLI) tells one owner what another's ids are.
    #[error("thread {0} was not found; start a new thread, or continue one of yours")]
    ThreadOwnedElsewhere(ThreadId),
    /// The owner already has its cap of queued runs ([`NewRun::max_queued`]).
    #[error("this owner already has {cap} runs queued; wait for some to start, or cancel some")]
    QueueFull {
        /// The cap.
        cap: u64,
    },
    /// A stored value could not be read back.
    #[error("corrupt row: {0}")]
    Corrupt(String),
    /// The database failed.
    #[error("database error: {0}")]
    Db(sqlx::Error),
    /// Migrations failed.
    #[error("migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
}

impl From<sqlx::Error> for StoreError {
    /// A value that does not decode (a status name the code does not know, text where a number
    /// belongs) is a corrupt row, not a database failure: it fails the same way on every read.
    fn from(e: sqlx::Error) -> Self {
        match e {
            sqlx::Error::ColumnDecode { index, source } => {
                StoreError::Corrupt(format!("column {index}: {source}"))
            }
            sqlx::Error::Decode(source) => StoreError::Corrupt(source.to_string()),
            e => StoreError::Db(e),
        }
    }
}

impl StoreError {
    /// Whether the database was out of reach (a broken or refused connection, a restart): the
    /// failure says nothing about the run, and a run goes on when the database is back however
    /// often that happens. A subset of [`StoreError::is_transient`].
    pub fn is_outage(&self) -> bool {
        match self {
            StoreError::Db(e) => match e {
                sqlx::Error::Io(_)
                | sqlx::Error::Tls(_)
                | sqlx::Error::Protocol(_)
                | sqlx::Error::PoolTimedOut
                | sqlx::Error::PoolClosed
                | sqlx::Error::WorkerCrashed => true,
                sqlx::Error::Database(d)
                    if d.try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
                        .is_some() =>
                {
                    let code = d.code().unwrap_or_default();
                    code.starts_with("08") || ["57P01", "57P02", "57P03"].contains(&code.as_ref())
                }
                _ => false,
            },
            _ => false,
        }
    }

    /// Whether trying again later may succeed: the database was out of reach, busy, restarting,
    /// or chose this transaction to abort (a deadlock, a serialization failure). Anything else
    /// (data the database refuses, a constraint, a broken statement) fails the same way on
    /// every attempt.
    pub fn is_transient(&self) -> bool {
        match self {
            StoreError::Db(e) => match e {
                sqlx::Error::Io(_)
                | sqlx::Error::Tls(_)
                | sqlx::Error::Protocol(_)
                | sqlx::Error::PoolTimedOut
                | sqlx::Error::PoolClosed
                | sqlx::Error::WorkerCrashed => true,
                sqlx::Error::Database(d) => {
                    let code = d.code().unwrap_or_default();
                    if d.try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
                        .is_some()
                    {
                        // PostgreSQL: connection, resources, operator intervention, system
                        // errors; serialization failures, deadlocks and lock timeouts.
                        ["08", "53", "57", "58"].iter().any(|c| code.starts_with(c))
                            || ["40001", "40P01", "55P03"].contains(&code.as_ref())
                    } else {
                        // SQLite: the primary result code is the low byte (BUSY, LOCKED, IOERR,
                        // FULL, CANTOPEN, PROTOCOL).
                        code.parse::<i64>()
                            .is_ok_and(|n| matches!(n & 0xff, 5 | 6 | 10 | 13 | 14 | 15))
                    }
                }
                _ => false,
            },
            StoreError::Busy { .. } | StoreError::LeaseLost(_) => true,
            StoreError::ThreadOwnedElsewhere(_)
            | StoreError::QueueFull { .. }
            | StoreError::Corrupt(_)
            | StoreError::Migrate(_) => false,
        }
    }
}

/// What a run runs, fixed for its whole life ([`crate::pinning`]): the versions of the files it
/// depends on, each version's text kept once, and the values a run pinned at its first claim.
#[async_trait]
pub trait Pins: Send + Sync + 'static {
    /// Keeps the text of an agent definition's version (once: the same version again is a
    /// no-op), so runs pinned to it can be given it after its file changed.
    async fn record_agent_version(&self, version: &str, agent: &str, text: &str) -> Result<()>;

    /// A kept agent definition version: its agent's name and its file's text.
    async fn agent_version(&self, version: &str) -> Result<Option<(String, String)>>;

    /// Keeps a pinned text by its version (a hash of it): a settings file, an MCP server's tool
    /// list. Once: the same version again is a no-op.
    async fn record_pinned_text(&self, version: &str, text: &str) -> Result<()>;

    /// A kept pinned text.
    async fn pinned_text(&self, version: &str) -> Result<Option<String>>;

    /// Everything `run` pinned so far, by name.
    async fn run_pins(&self, run: RunId) -> Result<BTreeMap<String, String>>;

    /// Pins each of `pins` the run has no value of that name for yet; a value once pinned never
    /// changes (of two claims racing, the first to commit wins). Returns the values now in
    /// force for the names given.
    async fn pin_run(
        &self,
        run: RunId,
        pins: Vec<(String, String)>,
    ) -> Result<BTreeMap<String, String>>;
}

/// Starting runs and reading them: what the runs service, delegation and the worker ask of a
/// run and its tree, and the wake-ups they wait on.
#[async_trait]
pub trait Runs: Send + Sync + 'static {
    /// Creates the thread if new and the run (`queued`) with its `run.queued` event.
    /// With [`IfBusy::Reject`], refuses with [`StoreError::Busy`] when the thread has an
    /// unfinished run.
    async fn create_run(&self, new: NewRun) -> Result<Created>;

    /// Reads a run.
    async fn get_run(&self, id: RunId) -> Result<Option<RunRecord>>;

    /// Events of a run with `seq > after`, at most `limit`.
    async fn events_after(&self, run: RunId, after: u64, limit: u32) -> Result<Vec<EventRecord>>;

    /// Like [`Runs::request_cancel`], except that a running run is cancelled at its next step
    /// boundary (the step in flight finishes and commits) rather than at once.
    async fn request_interrupt(&self, run: RunId) -> Result<CancelOutcome>;

    /// Asks a run to stop; idempotent.
    async fn request_cancel(&self, run: RunId) -> Result<CancelOutcome>;

    /// The oldest queued run of a thread, the one to start when the thread frees up, if it
    /// needs a job: not when its own job is still `Pending` (any worker will fetch it and, the
    /// thread now free, claim it). A run started just as the thread's previous run ended got
    /// a second job from that end, and the second claim found it parked on something and
    /// replayed it for nothing. A `Queued` job still gets a second one: apalis marks a job
    /// `Running` (and `Done`) through a channel after its handler started, so `Queued` may be a
    /// job whose handler already found the thread busy and let go; a duplicate costs one
    /// harmless replay, a missing job a stall until the reaper.
    async fn next_queued(&self, thread: &ThreadId) -> Result<Option<RunId>>;

    /// Wake-ups for changes to `run` made through this store (see [`crate::notify`]).
    fn subscribe(&self, run: RunId) -> std::sync::Arc<crate::notify::Signal>;

    /// Wake-ups for cancel requests of `run` made through this store.
    fn subscribe_cancel(&self, run: RunId) -> std::sync::Arc<crate::notify::Signal>;

    /// The seq of `run`'s latest event when this process knows it without a read (see
    /// [`crate::notify::Notifier::latest_seq`]).
    fn latest_seq(&self, run: RunId) -> Option<u64>;

    /// The run's children, oldest first.
    async fn children(&self, run: RunId) -> Result<Vec<RunRecord>>;

    /// Usage of the run and all its descendants: (prompt tokens, completion tokens, steps).
    async fn tree_usage(&self, run: RunId) -> Result<(Usage, u64)> {
        let t = self.tree_totals(run).await?;
        Ok((t.usage, t.steps))
    }

    /// Usage, steps and cost of a run and all its descendants.
    async fn tree_totals(&self, run: RunId) -> Result<TreeTotals>;
}

/// Claims and leases: taking a run for a worker (within its owner's and its agent's
/// concurrency limits), keeping it, giving it back, and finding runs whose worker is gone. Every
/// status write applies `lifecycle::next_status`.
#[async_trait]
pub trait Claims: Send + Sync + 'static {
    /// [`Transition::Claim`]: takes a queued run (when its thread is free and it is the
    /// thread's oldest) or a parked one; bumps the epoch.
    async fn claim_run(&self, id: RunId, owner: &str, ttl: Duration) -> Result<Claim>;

    /// [`Self::claim_run`] for the worker that runs the claimed run next: with its context
    /// ([`Checkpoints::context`] of its thread, the newest `limit` messages) when the backend
    /// can read it with the claim, in the same round trip (SQLite reads it in the claim's
    /// transaction, PostgreSQL in the claim's statement where the thread has no compaction).
    /// `None` when it cannot, or the thread is a fork: then the caller reads it.
    async fn claim_with_context(
        &self,
        id: RunId,
        owner: &str,
        ttl: Duration,
        limit: u32,
    ) -> Result<(Claim, Option<ThreadContext>)>;

    /// [`Transition::Heartbeat`]: extends the lease. Fails with [`StoreError::LeaseLost`] if
    /// the epoch is stale or the run is no longer running.
    async fn renew_lease(&self, lease: &Lease) -> Result<LeaseStatus>;

    /// [`Transition::Release`]: gives the run back to the queue at once (a draining worker, a
    /// storage failure) under a new job id, which the caller pushes. A release `after_failure`
    /// counts as a crash toward `SUBAGENTS_MAX_ATTEMPTS`, so a run that fails the same way at
    /// every attempt ends. Returns false when the lease was already lost.
    async fn release_lease(&self, lease: &Lease, job_id: &str, after_failure: bool)
    -> Result<bool>;

    /// [`Transition::Expire`] or, after `max_crashes` expiries, [`Transition::GiveUp`], for
    /// every running run whose lease has run out.
    async fn expire_leases(&self, max_crashes: u32) -> Result<Vec<Expired>>;

    /// Runs that need a new queue job: queued without a job that will start them (none, a
    /// finished one, or one held by a worker without being started), or parked and due;
    /// `grace` keeps fresh enqueues and recent re-enqueues out.
    async fn orphans(&self, grace: Duration) -> Result<Vec<Orphan>>;

    /// Queued runs whose current job the queue worker `worker` fetched and never started: what
    /// a draining worker hands back before it exits (apalis may have fetched a batch the
    /// moment before it stopped), so they are not left to the reaper's grace.
    async fn fetched_not_started(&self, worker: &str) -> Result<Vec<RunId>>;

    /// Queued runs, oldest first (at most `limit`), whose current job a queue worker other than
    /// `worker` fetched at least `held_for` ago and has not started: the batch a busy worker
    /// holds while its slots are taken (apalis fetches a batch whenever one slot frees). A worker
    /// with free slots gives them fresh jobs to start them itself; the busy worker's copy finds
    /// its run taken when it gets to it.
    async fn held_elsewhere(
        &self,
        worker: &str,
        held_for: Duration,
        limit: u32,
    ) -> Result<Vec<RunId>>;

    /// Records the queue job now responsible for the run.
    async fn set_job(&self, run: RunId, job_id: &str) -> Result<()>;

    /// Ends a job that a start handed to `worker` of this process ([`Created::held`]), as
    /// apalis acks the jobs it fetched: `Done`, or back on the queue for any worker when the
    /// handling failed. Nothing when the job is no longer locked to `worker` (apalis's orphan
    /// recovery gave it back after the worker's heartbeat lapsed).
    async fn settle_held_job(&self, job_id: &str, worker: &str, end: JobEnd) -> Result<()>;

    /// Locks a job that was just queued (its id as the queue's notification named it) to
    /// `worker` of this process, as apalis's fetch would, when that fetch would have taken it:
    /// `worker` is registered, the job is still waiting, and no other job waits to be fetched.
    /// Returns the job's run, for the worker to start at once and settle with
    /// [`Claims::settle_held_job`]; `None` when the job is not this worker's to take (a fetch
    /// was quicker, or the queue has other work first).
    async fn take_job(&self, job_id: &str, worker: &str) -> Result<Option<RunId>>;

    /// [`Claims::take_job`] and, when the job was taken, [`Claims::claim_with_context`] of its
    /// run by `worker`: one statement on PostgreSQL (the take and the claim commit together),
    /// the two one after the other elsewhere and while concurrency limits are in force (their
    /// claims take advisory locks first). `None` when the job is not this worker's to take.
    async fn take_and_claim(
        &self,
        job_id: &str,
        worker: &str,
        ttl: Duration,
        limit: u32,
    ) -> Result<Option<Taken>>;

    /// Whether this process started the run whose job is `job_id` (forgetting it): its job is
    /// held by a worker here already, or its start woke this process's fetch, so the queue's
    /// notification of it is nothing new here. False for any job another process wrote, and
    /// on SQLite, whose workers hear of no other process's jobs but by their poll.
    fn started_here(&self, job_id: &str) -> bool;

    /// Tells this process's workers that a job they can start now was queued, so they fetch at
    /// once rather than at their next poll (a start does it itself).
    fn job_queued(&self);

    /// What [`Claims::job_queued`] announces, for this process's workers.
    fn jobs_queued(&self) -> futures::stream::BoxStream<'static, ()>;

    /// The run's rank for its job's fetch order (0 = next), taking `place` in its owner's queue:
    /// how many of the owner's other queued runs go first; and its priority. O(1): read from
    /// per-owner counts the database keeps, not by counting the queue (the run view's
    /// `queue_position` counts exactly, on demand).
    async fn queue_rank(&self, run: RunId, place: QueuePlace) -> Result<(u32, u8)>;

    /// Whether the queued (or woken) run is held back by a concurrency limit (its owner's or
    /// its agent's running runs are at the limit).
    async fn at_limit(&self, run: RunId) -> Result<bool>;

    /// Replaces the concurrency limits whose keys start with `prefix` (`owner:`, `agent:`, or
    /// `*` for every owner's default) with `entries`; 0 means no limit.
    async fn set_limits(&self, prefix: &str, entries: &[(String, u32)]) -> Result<()>;

    /// Whether any concurrency limit is set (another process may have set it); remembered for
    /// the claims of this process.
    async fn refresh_limits(&self) -> Result<bool>;
}

/// A run's durable progress, fenced by its lease (checkpoints, compactions, extra events),
/// and the reads that rebuild its context.
#[async_trait]
pub trait Checkpoints: Send + Sync + 'static {
    /// Commits progress atomically, fenced by the lease ([`Transition::Heartbeat`], or
    /// [`Transition::Finish`] when `cp.finish` is set). A terminal checkpoint answers what its
    /// commit saw of the runs the end touches; progress answers `None`.
    async fn checkpoint(&self, lease: &Lease, cp: Checkpoint) -> Result<Option<Ending>>;

    /// The newest `limit` messages of a thread, in order.
    async fn thread_messages(&self, thread: &ThreadId, limit: u32) -> Result<Vec<StoredMessage>> {
        self.messages_after(thread, 0, limit).await
    }

    /// The newest `limit` messages of a thread with an id above `after`, in order (the context
    /// a run rebuilds starts after the thread's latest compaction).
    async fn messages_after(
        &self,
        thread: &ThreadId,
        after: i64,
        limit: u32,
    ) -> Result<Vec<StoredMessage>>;

    /// The thread's newest compaction, where a rebuilt context starts.
    async fn latest_compaction(&self, thread: &ThreadId) -> Result<Option<Compaction>>;

    /// What a claimed run rebuilds its context from: the thread's newest compaction and the
    /// newest `limit` messages after it, in order ([`Self::latest_compaction`], then
    /// [`Self::messages_after`]), read in one round trip.
    async fn context(&self, thread: &ThreadId, limit: u32) -> Result<ThreadContext>;

    /// Commits a compaction with its events, fenced by the lease ([`Transition::Heartbeat`]).
    /// Idempotent by key: a replay of the same compaction adds nothing.
    /// The summary call's tokens and cost (`spent`) count in the run's usage like any call's.
    async fn commit_compaction(
        &self,
        lease: &Lease,
        compaction: CompactionBody,
        spent: (Usage, u64),
        events: Vec<NewEvent>,
    ) -> Result<()>;

    /// Appends events to a run's stream without holding its lease (a parent announcing a
    /// child it started). The seq stays gap-free: it is reserved under the run row's write
    /// lock. Nothing is appended to a finished run (returns false): nothing follows a terminal
    /// event.
    async fn append_events(&self, run: RunId, events: Vec<NewEvent>) -> Result<bool>;
}

/// Parking a run on what it waits for (children, approvals, a time), and finding whom to
/// wake when something it waits on ends.
#[async_trait]
pub trait Parking: Send + Sync + 'static {
    /// [`Transition::Park`], fenced by the lease; refused with [`Parked::CancelPending`] when a
    /// cancel was requested (the holder must finish the run instead).
    async fn park(&self, lease: &Lease, park: Park) -> Result<Parked>;

    /// Parked runs that are due and wait on `run`: who to push a job for after `run` ended.
    async fn due_waiters(&self, run: RunId) -> Result<Vec<RunId>>;

    /// The deadline recorded under `key`, recording `proposed` if there is none yet.
    async fn wait_deadline(&self, key: &str, proposed: i64) -> Result<i64>;
}

/// Tool-call decisions and the approvals they wait on: a decision commits once per call, an
/// approval is answered once.
#[async_trait]
pub trait Approvals: Send + Sync + 'static {
    /// The decision committed for a tool call (its key `{run}:{step}:{call}`), if any.
    async fn tool_decision(&self, key: &str) -> Result<Option<Value>>;

    /// Commits the decision for a tool call before it runs (and the approval it opens, if it
    /// asks), with its events, fenced by the lease. Idempotent by key.
    async fn commit_decision(
        &self,
        lease: &Lease,
        key: &str,
        decision: Value,
        approval: Option<NewApproval>,
        events: Vec<NewEvent>,
    ) -> Result<()>;

    /// Reads an approval.
    async fn approval(&self, id: &ApprovalId) -> Result<Option<Approval>>;

    /// Marks a pending approval past its time as expired; true if this call did.
    async fn expire_approval(&self, id: &ApprovalId) -> Result<bool>;

    /// Whether the run tree of `root` holds a grant (an approval answered with `scope:
    /// run_tree`) for `scope`: the rule that asked, or one exact call (see
    /// [`crate::permissions::grant_scope`]).
    async fn has_grant(&self, root: RunId, scope: &str) -> Result<bool>;

    /// The owner's approvals, newest first: `status` and `run` filter, `before` is the cursor
    /// (an approval id). Pending ones whose run ended are not listed as pending.
    async fn list_approvals(
        &self,
        owner: &OwnerId,
        status: Option<ApprovalStatus>,
        run: Option<RunId>,
        before: Option<&ApprovalId>,
        limit: u32,
    ) -> Result<Vec<Approval>>;

    /// Answers a pending approval of `owner`: records the answer (and a run-tree grant), appends
    /// `approval.resolved` to the run and wakes it, in one transaction.
    async fn answer_approval(
        &self,
        id: &ApprovalId,
        owner: &OwnerId,
        answer: ApprovalAnswer,
    ) -> Result<Answered>;
}

/// The fleet's shared model rate budgets when Redis does not hold them, and the owners'
/// budgets from the keys file.
#[async_trait]
pub trait RateBudgets: Send + Sync + 'static {
    /// Takes one model call of `tokens` from the budget of `key` over the last `window_ms`
    /// (at most `max_requests` calls and `max_tokens` tokens), shared by every process on this
    /// database. `None`: taken. `Some(at)`: over budget until `at` (Unix ms); nothing taken.
    async fn take_budget(
        &self,
        key: &str,
        window_ms: i64,
        max_requests: Option<u64>,
        max_tokens: Option<u64>,
        tokens: u64,
    ) -> Result<Option<i64>>;

    /// Blocks `key`'s budget until `until_ms` (the provider said it is used up); a later block
    /// wins, an earlier one changes nothing.
    async fn block_budget(&self, key: &str, until_ms: i64) -> Result<()>;

    /// Until when `key`'s budget is blocked (Unix ms; 0 or past: it is not).
    async fn budget_blocked_until(&self, key: &str) -> Result<i64>;

    /// Replaces every owner's model budget (the keys file's `rpm=`/`tpm=`) with `entries`.
    async fn set_owner_budgets(&self, entries: &[(OwnerId, OwnerBudget)]) -> Result<()>;

    /// The owner's model budget, if the keys file sets one.
    async fn owner_budget(&self, owner: &OwnerId) -> Result<Option<OwnerBudget>>;
}

/// Messages sent to a run while it works (`POST /v1/runs/{id}/messages`): committed at once,
/// delivered into its thread at its next step boundary, each exactly once.
#[async_trait]
pub trait Inbox: Send + Sync + 'static {
    /// Commits a message for `owner`'s run `run` with its `message.received`, if the run has
    /// not ended. A run parked on children is made due (the caller pushes its job when
    /// [`Sent::Accepted::woken`] says so); a running one is told through its lease renewal.
    async fn send_message(
        &self,
        run: RunId,
        owner: &OwnerId,
        id: &MessageId,
        content: &str,
    ) -> Result<Sent>;

    /// Delivers every message waiting for the run into its thread as user messages of
    /// `step`, with their `message.delivered`, fenced by the lease. Returns what it delivered
    /// (nothing when none waits).
    async fn deliver_messages(&self, lease: &Lease, step: u32) -> Result<Vec<NewMessage>>;
}

/// Schedules: each owner's, the due ones, and which run each fired tick started.
#[async_trait]
pub trait Schedules: Send + Sync + 'static {
    /// Stores a new schedule.
    async fn create_schedule(&self, s: &Schedule) -> Result<()>;

    /// An owner's schedules, oldest first.
    async fn list_schedules(&self, owner: &OwnerId) -> Result<Vec<Schedule>>;

    /// One of an owner's schedules.
    async fn get_schedule(&self, owner: &OwnerId, id: &str) -> Result<Option<Schedule>>;

    /// Writes a changed schedule (every field but its id, owner and creation time); false when
    /// it is gone.
    async fn update_schedule(&self, s: &Schedule) -> Result<bool>;

    /// Deletes a schedule (its runs stay); false when the owner has no such one.
    async fn delete_schedule(&self, owner: &OwnerId, id: &str) -> Result<bool>;

    /// Schedules not paused whose next tick is due at `now` (ms), the most overdue first.
    async fn due_schedules(&self, now: i64, limit: u32) -> Result<Vec<Schedule>>;

    /// Moves a schedule's next tick from `from` to `to`; false when another pass (or a change
    /// by its owner) moved it first.
    async fn advance_schedule(&self, id: &str, from: i64, to: i64) -> Result<bool>;

    /// Records the run a tick started (once: a second firing of the tick records nothing).
    async fn record_schedule_run(&self, schedule: &str, tick: i64, run: RunId) -> Result<()>;

    /// A schedule's latest ticks with their runs and the runs' states, newest first.
    async fn schedule_runs(
        &self,
        schedule: &str,
        limit: u32,
    ) -> Result<Vec<(i64, RunId, RunStatus)>>;

    /// The schedule and tick that started `run`, if one did.
    async fn run_schedule(&self, run: RunId) -> Result<Option<(String, i64)>>;

    /// The run an owner started with an idempotency key, if any.
    async fn run_by_key(&self, owner: &OwnerId, key: &str) -> Result<Option<RunId>>;
}

/// Webhooks: each owner's subscriptions, the events a trigger queued for them in the event's own
/// transaction, and the deliveries made of those with their attempts (`crate::webhooks` sends
/// them).
#[async_trait]
pub trait Webhooks: Send + Sync + 'static {
    /// Stores a new subscription.
    async fn create_webhook(&self, hook: &Webhook) -> Result<()>;

    /// An owner's subscriptions, oldest first (not its runs' own webhooks).
    async fn list_webhooks(&self, owner: &OwnerId) -> Result<Vec<Webhook>>;

    /// Every owner's subscriptions, not runs' own webhooks (the dispatcher matches events
    /// against them).
    async fn all_webhooks(&self) -> Result<Vec<Webhook>>;

    /// The own webhooks of these runs.
    async fn webhooks_of_runs(&self, runs: &[RunId]) -> Result<Vec<Webhook>>;

    /// Any subscription, by id.
    async fn webhook_by_id(&self, id: &str) -> Result<Option<Webhook>>;

    /// One of an owner's subscriptions.
    async fn get_webhook(&self, owner: &OwnerId, id: &str) -> Result<Option<Webhook>>;

    /// Changes a subscription; `None` when the owner has no such one.
    async fn update_webhook(
        &self,
        owner: &OwnerId,
        id: &str,
        patch: WebhookPatch,
    ) -> Result<Option<Webhook>>;

    /// Deletes a subscription and its deliveries; false when the owner has no such one.
    async fn delete_webhook(&self, owner: &OwnerId, id: &str) -> Result<bool>;

    /// Replaces the secret; the old one signs too until `old_until` (ms since the epoch).
    async fn rotate_webhook_secret(
        &self,
        owner: &OwnerId,
        id: &str,
        secret: &str,
        old_until: i64,
    ) -> Result<Option<Webhook>>;

    /// A subscription's deliveries, newest first, older than the delivery `before` if given.
    async fn list_deliveries(
        &self,
        webhook: &str,
        before: Option<&str>,
        limit: u32,
    ) -> Result<Vec<Delivery>>;

    /// Makes a delivery due again now, with a fresh retry window; false when the subscription
    /// has no such delivery.
    async fn redeliver(&self, webhook: &str, delivery: &str) -> Result<bool>;

    /// Events queued for webhooks, oldest first.
    async fn queued_webhook_events(&self, limit: u32) -> Result<Vec<QueuedEvent>>;

    /// Creates the deliveries made of queued events (each once: its id is derived from the
    /// event and the subscription) and takes those events off the queue, in one transaction.
    async fn create_deliveries(
        &self,
        deliveries: Vec<NewDelivery>,
        done: Vec<(RunId, u64)>,
    ) -> Result<()>;

    /// Subscriptions with deliveries due at `now` (ms), with how many, paused ones left out.
    async fn due_webhooks(&self, now: i64) -> Result<Vec<(String, u32)>>;

    /// Claims up to `limit` due deliveries of `webhook` for an attempt: each is locked until
    /// `lock_until` (a process that dies mid-attempt leaves it to be tried again after that)
    /// and its attempt counted.
    async fn claim_deliveries(
        &self,
        webhook: &str,
        now: i64,
        lock_until: i64,
        limit: u32,
    ) -> Result<Vec<DueDelivery>>;

    /// Records an attempt: delivered, due again, or dead; a subscription whose deliveries went
    /// dead `pause_after` times in a row without a success in between is paused with the reason.
    async fn record_attempt(
        &self,
        delivery: &DueDelivery,
        outcome: &Attempted,
        pause_after: u32,
    ) -> Result<()>;
}

/// Forking threads: a new thread whose history is another's up to a point, shared rather than
/// copied (`sa_thread_lineage`), so a fork costs the same whatever the thread's length.
#[async_trait]
pub trait Forks: Send + Sync + 'static {
    /// Creates `new`, `owner`'s fork of `source` at `at`.
    async fn fork_thread(
        &self,
        owner: &OwnerId,
        source: &ThreadId,
        at: ForkAt,
        new: &ThreadId,
    ) -> Result<Forked>;

    /// The threads forked from `thread`, oldest first.
    async fn forks_of(&self, thread: &ThreadId) -> Result<Vec<(ThreadId, i64)>>;
}

/// Where a fork's shared history ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ForkAt {
    /// At this message (included), which must be in the thread's history.
    Message(i64),
    /// At the last message of this run of the thread.
    Run(RunId),
    /// At the thread's newest message.
    End,
}

/// The answer to [`Forks::fork_thread`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Forked {
    /// Forked; the new thread's history ends at this message.
    Done {
        /// The last shared message.
        at_message: i64,
    },
    /// No such thread of this owner.
    NoThread,
    /// The message is not in the thread's history.
    NoMessage,
    /// The run is not one of the thread's.
    NoRun,
    /// Nothing to fork: the thread (or the run) has no message yet.
    Empty,
}

/// Messages that may wait for one run at once; more are refused until it takes them (a
/// client cannot grow a run's inbox, and its next request, without bound).
pub const MAX_WAITING_MESSAGES: i64 = 64;

/// The answer to [`Inbox::send_message`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sent {
    /// Committed; the run's next step boundary delivers it.
    Accepted {
        /// The run's state when the message committed.
        status: RunStatus,
        /// The run was parked on children and is due now: push its job.
        woken: bool,
    },
    /// The run has ended: a message can no longer reach it.
    Finished(RunStatus),
    /// [`MAX_WAITING_MESSAGES`] already wait for the run: nothing more until it takes them.
    Full,
    /// No such run of this owner.
    NotFound,
}

/// Everything the engine and the services write and read of runs, as one bound: [`Runs`], [`Claims`], [`Checkpoints`], [`Parking`], [`Approvals`], [`RateBudgets`], [`Inbox`].
pub trait RunLog:
    Runs + Pins + Claims + Checkpoints + Parking + Approvals + RateBudgets + Inbox
{
}

impl<T: Runs + Pins + Claims + Checkpoints + Parking + Approvals + RateBudgets + Inbox> RunLog
    for T
{
}

/// What the API and metrics read beyond a single run.
#[async_trait]
pub trait Queries: Send + Sync + 'static {
    /// The overview of an owner's runs: counts now, events since `hour` (at most `cap`),
    /// failures since `day`, and the workers.
    async fn overview(
        &self,
        owner: &OwnerId,
        hour: DateTime<Utc>,
        day: DateTime<Utc>,
        cap: u32,
    ) -> Result<OverviewData>;

    /// Runs of `owner` matching `filter`, newest first.
    async fn list_runs(
        &self,
        owner: &OwnerId,
        filter: &RunFilter,
        limit: u32,
    ) -> Result<Vec<RunRecord>>;

    /// A thread, if it exists.
    async fn get_thread(&self, id: &ThreadId) -> Result<Option<ThreadRecord>>;

    /// Every compaction of a thread, oldest first (what was summarised, and when).
    async fn compactions(&self, thread: &ThreadId) -> Result<Vec<Compaction>>;

    /// A page of a thread's messages with `id > after`, oldest first.
    async fn messages_page(
        &self,
        thread: &ThreadId,
        after: i64,
        limit: u32,
    ) -> Result<Vec<StoredMessage>>;

    /// How many queued runs are ahead of this one (0 = next).
    async fn queue_position(&self, run: RunId) -> Result<i64>;

    /// The arguments (raw JSON) of the run's latest call to `tool`, if it made one: the run
    /// view reads the agent's plan (`todo_write`) this way.
    async fn last_call_arguments(&self, run: RunId, tool: &str) -> Result<Option<String>>;

    /// What a run's view shows beside the run, in one read: its pins, the schedule tick that
    /// started it, the arguments of its latest call to `tool` (the plan), and its children's
    /// ids. Each of these was a read of its own: four round trips for every answer.
    async fn view_extras(&self, run: RunId, tool: &str) -> Result<ViewExtras>;

    /// A run and, once it has ended, its [`Queries::view_extras`], in one round trip: a wait's
    /// answer reads both, where the extras had been a statement of their own beside the
    /// events read after the run (one statement and one connection fewer; the events now
    /// follow it).
    async fn run_and_extras(
        &self,
        run: RunId,
        tool: &str,
    ) -> Result<Option<(RunRecord, Option<ViewExtras>)>>;

    /// What answers every wait and stream on a run after a commit: the run, its latest `last`
    /// events, and once it has ended its [`Self::view_extras`]. One command on SQLite (its
    /// statements run in turn on the reading connection's thread); on PostgreSQL the run with
    /// its extras ([`Self::run_and_extras`]), then its events. `None`: no such run.
    async fn run_with_latest(&self, run: RunId, last: u32, tool: &str) -> Result<Option<RunRead>>;

    /// How many runs `owner` has queued (all priorities), from the queue-depth counters: one
    /// read, whatever the backlog.
    async fn queued_count(&self, owner: &OwnerId) -> Result<u64>;

    /// Number of runs per state, for metrics.
    async fn status_counts(&self) -> Result<Vec<(RunStatus, i64)>>;

    /// Wake-ups on a change to any run made through this store.
    fn subscribe_all(&self) -> std::sync::Arc<crate::notify::Signal>;
}

/// What the relay needs: outbox rows not yet in Redis, and local wake-ups for changes heard
/// from other processes.
#[async_trait]
pub trait Outbox: Send + Sync + 'static {
    /// Outbox rows not yet relayed to Redis, each run's in seq order.
    async fn unrelayed(&self, limit: u32) -> Result<Vec<EventRecord>>;

    /// Marks outbox rows as relayed: each `(run, first, last)` says events `first..=last` of
    /// `run` are in Redis (the relay publishes a run's events in order, so what it relayed of a
    /// run in one pass is one range, and a pass costs one statement rather than one per event).
    async fn mark_relayed(&self, ranges: &[(RunId, u64, u64)]) -> Result<()>;

    /// Wakes this process's waiters for a change made elsewhere (heard over Redis).
    fn wake_local(&self, run: RunId, wake: Wake);

    /// Says this process's relay takes the events its commits hand over from now on (see
    /// [`crate::notify::Notifier::committed`]).
    fn open_handoff(&self);

    /// The events committed and handed over since the last take, and whether some commit
    /// wrote events only the outbox holds.
    fn take_handed(&self) -> crate::notify::Handed;
}

/// [`Queries::view_extras`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ViewExtras {
    /// [`Pins::run_pins`].
    pub pins: std::collections::BTreeMap<String, String>,
    /// The schedule and the tick (ms) that started the run ([`Schedules::run_schedule`]).
    pub schedule: Option<(String, i64)>,
    /// [`Queries::last_call_arguments`].
    pub last_call: Option<String>,
    /// The children's ids, oldest first.
    pub children: Vec<RunId>,
}

/// [`Queries::run_with_latest`].
#[derive(Clone, Debug)]
pub struct RunRead {
    /// The run.
    pub run: RunRecord,
    /// Its latest events, in order, gap-free: every event after `events_after`.
    pub events: Vec<EventRecord>,
    /// The seq the events follow.
    pub events_after: u64,
    /// Its view's extras, when `run` has ended.
    pub extras: Option<ViewExtras>,
}

impl RunRead {
    /// [`Queries::run_with_latest`] as separate reads: the run with its view's extras when it
    /// has ended ([`Queries::run_and_extras`], one round trip), then its latest `last` events
    /// (from `events`, given the seq they follow: the database's, or a relay's stream).
    pub async fn apart<S, F, Fut>(
        store: &S,
        run: RunId,
        last: u32,
        tool: &str,
        events: F,
    ) -> Result<Option<RunRead>>
    where
        S: Runs + Queries + ?Sized,
        F: FnOnce(u64) -> Fut + Send,
        Fut: std::future::Future<Output = Result<Vec<EventRecord>>> + Send,
    {
        let Some((r, extras)) = store.run_and_extras(run, tool).await? else {
            return Ok(None);
        };
        let events_after = r.event_seq.saturating_sub(u64::from(last));
        Ok(Some(RunRead {
            run: r,
            events: events(events_after).await?,
            events_after,
            extras,
        }))
    }
}

/// What another process said changed about a run (see [`Outbox::wake_local`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wake {
    /// A step's progress: nothing that can end the run.
    Progress,
    /// Anything else, its end included.
    Change,
    /// A cancel was asked for: the worker holding the run stops it.
    Cancel,
}

/// What tests and benchmarks do to a store and the server never does: wake a parked run by
/// hand, fill a long history, empty the tables, count what checkpoints wrote. Kept apart from
/// the traits the server runs on, so no production path can reach them by accident.
#[async_trait]
pub trait Harness: Send + Sync + 'static {
    /// [`Transition::Wake`]: makes a parked run due for a claim. False if it was not parked.
    async fn wake(&self, run: RunId) -> Result<bool>;

    /// Writes `count` finished-looking runs of `owner` (each on its own thread) spread over the
    /// 30 days before `now`, one in a hundred within the last hour with its events. For the
    /// dashboard benchmark, which needs a big history fast; the server never calls it.
    async fn seed_history(&self, owner: &OwnerId, count: u32, now: DateTime<Utc>) -> Result<()>;

    /// Deletes every thread, run, message, event and queued run job. For benchmarks, which
    /// must start from empty tables; the server never calls it.
    async fn wipe(&self) -> Result<()>;

    /// Rows written by checkpoints (messages plus events), for benchmarks.
    async fn checkpoint_rows(&self) -> Result<i64>;
}

/// The whole store, split by its users: the run log's parts ([`RunLog`]), the API's reads
/// ([`Queries`]), the relay's [`Outbox`], [`Forks`], and [`Harness`] for tests and benchmarks. Both backends
/// implement every part.
pub trait Store: RunLog + Queries + Outbox + Harness + Forks + Webhooks + Schedules {}

impl<T: RunLog + Queries + Outbox + Harness + Forks + Webhooks + Schedules> Store for T {}

/// Milliseconds since the Unix epoch: lease deadlines are stored as integers so every backend
/// compares them the same way.
pub fn now_ms() -> i64 {
    Utc::now().timestamp_millis()
}
