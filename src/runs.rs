//! The runs service: the operations on a run that are not the step loop itself — start, cancel,
//! and what follows a run's end (the thread's next run, and whoever waits on it). Every front end
//! (API, CLI, a parent delegating to a child, the worker) goes through here, so each of these
//! has one path.
//!
//! Layering: `runs` uses the store and the queue; delegation and the engine use `runs`; the
//! worker uses the engine; `app` only wires them together.

use serde_json::Value;

use crate::agents::GENERAL_PURPOSE;
use crate::domain::{IfBusy, NewRun, RunLimits, RunRecord, TreePosition};
use crate::ids::{OwnerId, RunId, ThreadId};
use crate::pinning::Agents;
use crate::queue::{Queue, new_job_id};
use crate::store::{CancelOutcome, Created, NextQueued, RunLog, RunStatus, StoreError};

pub use crate::agents::MAX_TIMEOUT_SECS;

/// A run's priority when the start names none.
pub const DEFAULT_PRIORITY: u8 = 3;

/// Owner of runs started without authentication (the CLI, the embedded default).
pub const LOCAL_OWNER: &str = "local";

/// A request to start a run.
#[derive(Clone, Debug, Default)]
pub struct StartRun {
    /// Agent name; `general-purpose` when absent.
    pub agent: Option<String>,
    /// The task.
    pub input: String,
    /// Continue this thread (created if new).
    pub thread_id: Option<ThreadId>,
    /// Owner; [`LOCAL_OWNER`] when absent.
    pub owner: Option<OwnerId>,
    /// Override of the agent's `max_steps`.
    pub max_steps: Option<u32>,
    /// Override of the agent's `timeout`, in seconds.
    pub timeout_secs: Option<u64>,
    /// Token budget for the run and its descendants.
    pub max_total_tokens: Option<u64>,
    /// Step budget for the run and its descendants.
    pub max_total_steps: Option<u64>,
    /// Percent of the context window at which the run compacts (10..=95).
    pub compact_at: Option<u8>,
    /// Caller data kept with the run.
    pub metadata: Option<Value>,
    /// Busy thread: refuse (default) or queue behind the active run.
    pub if_busy: IfBusy,
    /// A repeated start with the same key returns the first run.
    pub idempotency_key: Option<String>,
    /// The delegating run (children only).
    pub parent_run_id: Option<RunId>,
    /// Place in the delegation tree (children only).
    pub tree: TreePosition,
    /// The failed or cancelled run this one retries ([`retry`]).
    pub retry_of: Option<RunId>,
    /// 1 (lowest) to 5; 3 when absent.
    pub priority: Option<u8>,
    /// Run this version of the agent instead of its current definition (a child of the same
    /// agent as its parent runs its parent's version).
    pub agent_version: Option<String>,
    /// The new run's id, when the caller must know it before the run exists (a run's own
    /// webhook is stored first, so no event of the run can pass before it); else a new one.
    pub run_id: Option<RunId>,
    /// The JSON Schema the final answer must match (overrides the agent's `output_schema:`).
    pub output_schema: Option<Value>,
    /// Invalid answers sent back to the model before the run fails (default: the agent's, then
    /// 2).
    pub output_retries: Option<u32>,
    /// Refuse the start when the owner already has this many runs queued (0: no cap); see
    /// [`NewRun::max_queued`].
    pub max_queued: u64,
}

/// Why a run could not be started. Each has a stable code for APIs and scripts.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// No such agent.
    #[error("unknown agent `{name}`; known agents: {}", known.join(", "))]
    UnknownAgent {
        /// Requested name.
        name: String,
        /// What exists.
        known: Vec<String>,
    },
    /// Nothing to do.
    #[error("the input is empty: say what the agent should do")]
    EmptyInput,
    /// Over the configured limit.
    #[error("the input is {got} bytes; the limit is {limit} (SUBAGENTS_MAX_INPUT_BYTES)")]
    InputTooLarge {
        /// Limit.
        limit: usize,
        /// Actual size.
        got: usize,
    },
    /// The input holds a NUL character, which no database text can store.
    #[error("the input holds a NUL character (\\u0000), which cannot be stored; remove it")]
    NulCharacter,
    /// A limit override out of range.
    #[error("{0}")]
    BadLimit(String),
    /// The output schema cannot be built, or its retries are out of range.
    #[error("{0}")]
    BadOutputSchema(String),
    /// A retry of a run that cannot be retried (still going, succeeded, or a child).
    #[error("{0}")]
    NotRetryable(String),
    /// Storage refused or failed (busy thread included).
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl StartError {
    /// Stable machine code.
    pub fn code(&self) -> &'static str {
        match self {
            StartError::UnknownAgent { .. } => "unknown_agent",
            StartError::EmptyInput => "empty_input",
            StartError::InputTooLarge { .. } => "input_too_large",
            StartError::NulCharacter => "nul_character",
            StartError::BadLimit(_) => "bad_limit",
            StartError::BadOutputSchema(_) => "invalid_output_schema",
            StartError::NotRetryable(_) => "not_retryable",
            StartError::Store(StoreError::Busy { .. }) => "thread_busy",
            StartError::Store(StoreError::ThreadOwnedElsewhere(_)) => "thread_not_found",
            StartError::Store(StoreError::QueueFull { .. }) => "queue_full",
            StartError::Store(_) => "storage_unavailable",
        }
    }
}

/// Validates a start and records the run with its first job (one transaction): the one path
/// every start takes (API, CLI, and parents delegating to children). Once it returns, the run
/// and its job are durable.
pub async fn start_run(
    store: &dyn RunLog,
    agents: &Agents,
    max_input_bytes: usize,
    req: StartRun,
) -> Result<Created, StartError> {
    start_run_held(store, agents, max_input_bytes, req, None).await
}

/// This process's queue workers with a free slot, as the layers below the worker see them
/// (`worker::Local` is the one implementation): a parent's `task` offers its child to one.
pub trait FreeSlots: Send + Sync {
    /// A free slot, unless none is free or no worker runs in this process.
    fn reserve(&self) -> Option<Box<dyn FreeSlot>>;
}

/// A reserved slot: dropped unused, it is free again.
pub trait FreeSlot: Send {
    /// The queue worker to lock the run's job to ([`crate::domain::NewRun::held_by`]).
    fn worker(&self) -> &str;
    /// Runs, in the slot, the run whose job the start locked to [`FreeSlot::worker`].
    fn run(self: Box<Self>, run_id: RunId, job_id: String);
}

/// [`start_run`], offering the run's job to `held_by`, a queue worker of this process with a
/// free slot ([`crate::worker::Local`]); [`Created::held`] says whether it took it.
pub async fn start_run_held(
    store: &dyn RunLog,
    agents: &Agents,
    max_input_bytes: usize,
    req: StartRun,
    held_by: Option<String>,
) -> Result<Created, StartError> {
    let agent_name = req.agent.unwrap_or_else(|| GENERAL_PURPOSE.to_owned());
    let current = agents.current();
    let inherited = match &req.agent_version {
        Some(v) => agents.at_version(store, &agent_name, v).await?,
        None => None,
    };
    let agent = match inherited {
        Some(a) => a,
        None => current
            .shared(&agent_name)
            .ok_or_else(|| StartError::UnknownAgent {
                name: agent_name.clone(),
                known: current.names(),
            })?,
    };
    if req.input.trim().is_empty() {
        return Err(StartError::EmptyInput);
    }
    if req.input.len() > max_input_bytes {
        return Err(StartError::InputTooLarge {
            limit: max_input_bytes,
            got: req.input.len(),
        });
    }
    if req.input.contains('\0') {
        return Err(StartError::NulCharacter);
    }
    let max_steps = req.max_steps.unwrap_or(agent.max_steps);
    if max_steps == 0 || max_steps > 10_000 {
        return Err(StartError::BadLimit(format!(
            "max_steps {max_steps} is out of range 1..=10000"
        )));
    }
    let timeout_secs = req.timeout_secs.unwrap_or(agent.timeout.as_secs().max(1));
    if !(1..=MAX_TIMEOUT_SECS).contains(&timeout_secs) {
        return Err(StartError::BadLimit(format!(
            "timeout must be 1 to {MAX_TIMEOUT_SECS} seconds (7 days)"
        )));
    }
    if let Some(p) = req.compact_at
        && !(10..=95).contains(&p)
    {
        return Err(StartError::BadLimit(format!(
            "compact_at {p}% is out of range 10..=95 (percent of the context window)"
        )));
    }
    if let Some(k) = &req.idempotency_key
        && (k.is_empty() || k.len() > 200)
    {
        return Err(StartError::BadLimit(
            "idempotency_key must be 1 to 200 characters".into(),
        ));
    }
    let priority = req.priority.unwrap_or(DEFAULT_PRIORITY);
    if !(1..=5).contains(&priority) {
        return Err(StartError::BadLimit(format!(
            "priority {priority} is out of range 1..=5 (5 runs first)"
        )));
    }
    let output = match (req.output_schema, &agent.output) {
        (Some(schema), _) => Some(
            crate::output::OutputContract::new(schema, req.output_retries)
                .map_err(StartError::BadOutputSchema)?,
        ),
        (None, Some(from_agent)) => Some(
            from_agent
                .clone()
                .with_retries(req.output_retries)
                .map_err(StartError::BadOutputSchema)?,
        ),
        (None, None) if req.output_retries.is_some() => {
            return Err(StartError::BadOutputSchema(
                "output_retries needs an output_schema (on the start or in the agent file)".into(),
            ));
        }
        (None, None) => None,
    };
    let agent_version = Some(agents.pin(store, &agent).await?);
    let created = store
        .create_run(NewRun {
            agent_version,
            held_by,
            max_queued: req.max_queued,
            id: req.run_id.unwrap_or_default(),
            thread_id: req.thread_id.unwrap_or_else(ThreadId::generate),
            owner: req.owner.unwrap_or_else(OwnerId::local),
            agent: agent_name.into(),
            input: req.input,
            metadata: req
                .metadata
                .unwrap_or_else(|| Value::Object(Default::default())),
            limits: RunLimits {
                max_steps,
                timeout_secs,
                max_total_tokens: req.max_total_tokens,
                max_total_steps: req.max_total_steps,
                compact_at: req.compact_at,
                output,
            },
            parent_run_id: req.parent_run_id,
            tree: req.tree,
            job_id: new_job_id(),
            if_busy: req.if_busy,
            idempotency_key: req.idempotency_key,
            retry_of: req.retry_of,
            priority,
            // A child continues work its parent already started, parked and holding its context:
            // it goes ahead of its owner's new work.
            place: if req.parent_run_id.is_some() {
                crate::domain::QueuePlace::Front
            } else {
                crate::domain::QueuePlace::Back
            },
        })
        .await?;
    Ok(created)
}

/// Retries a failed or cancelled root run: a new run on the same thread with the same agent,
/// input, limits and metadata, linked by `retry_of`, queued behind whatever the thread runs now.
/// Idempotent per original (its key is `retry:<id>`): a double click or a repeated bulk retry
/// returns the first retry; to try once more, retry the retry.
///
/// With `input`, the retry runs that instead of the original's input ("do that differently");
/// retries with the same new input are one retry, as plain retries are.
pub async fn retry(
    store: &dyn RunLog,
    agents: &Agents,
    max_input_bytes: usize,
    original: &RunRecord,
    input: Option<String>,
) -> Result<Created, StartError> {
    if !matches!(original.status, RunStatus::Failed | RunStatus::Cancelled) {
        return Err(StartError::NotRetryable(format!(
            "run {} is {}; only a failed or cancelled run can be retried",
            original.id,
            original.status.as_str()
        )));
    }
    if original.parent_run_id.is_some() {
        return Err(StartError::NotRetryable(format!(
            "run {} is a sub-agent run; retry its root run {} (its parent decides what its children do)",
            original.id,
            original
                .tree
                .root_run_id
                .or(original.parent_run_id)
                .map(|r| r.to_string())
                .unwrap_or_default()
        )));
    }
    let l = &original.limits;
    let idempotency_key = match &input {
        None => format!("retry:{}", original.id),
        Some(text) => {
            use sha2::{Digest, Sha256};
            let h = Sha256::digest(text.as_bytes());
            let hex: String = h[..8].iter().map(|b| format!("{b:02x}")).collect();
            format!("retry:{}:{hex}", original.id)
        }
    };
    start_run(
        store,
        agents,
        max_input_bytes,
        StartRun {
            agent: Some(original.agent.to_string()),
            input: input.unwrap_or_else(|| original.input.clone()),
            thread_id: Some(original.thread_id.clone()),
            owner: Some(original.owner.clone()),
            max_steps: Some(l.max_steps),
            timeout_secs: Some(l.timeout_secs),
            max_total_tokens: l.max_total_tokens,
            max_total_steps: l.max_total_steps,
            compact_at: l.compact_at,
            metadata: Some(original.metadata.clone()),
            if_busy: IfBusy::Enqueue,
            idempotency_key: Some(idempotency_key),
            parent_run_id: None,
            tree: TreePosition::default(),
            retry_of: Some(original.id),
            priority: Some(original.priority),
            // A retry is a new run: it takes the agent's current definition.
            agent_version: None,
            run_id: None,
            output_schema: l.output.as_ref().map(|o| o.schema.clone()),
            output_retries: l.output.as_ref().map(|o| o.retries),
            max_queued: 0,
        },
    )
    .await
}

/// Cancels a run and, below it, every attached (non-detached) descendant still going; a run
/// that ends here (queued or parked) frees its thread and wakes its waiters at once. The
/// child's `child.finished` event and its parent's wake-up commit with the cancel itself.
pub async fn cancel(
    store: &dyn RunLog,
    queue: &Queue,
    run: RunId,
) -> Result<CancelOutcome, StoreError> {
    let outcome = store.request_cancel(run).await?;
    if outcome == CancelOutcome::Cancelled {
        after_end_of(store, queue, run).await?;
    }
    cancel_attached_children(store, queue, run).await?;
    Ok(outcome)
}

/// Interrupts a run: a running one is cancelled at its next step boundary (the step in flight
/// finishes and commits; its end then takes its attached children along), a queued or parked
/// one at once, as [`cancel`] does.
pub async fn interrupt(
    store: &dyn RunLog,
    queue: &Queue,
    run: RunId,
) -> Result<CancelOutcome, StoreError> {
    let outcome = store.request_interrupt(run).await?;
    if outcome == CancelOutcome::Cancelled {
        after_end_of(store, queue, run).await?;
        cancel_attached_children(store, queue, run).await?;
    }
    Ok(outcome)
}

/// Cancels the attached children (and theirs) of a run: what happens when a parent ends or is
/// cancelled.
pub async fn cancel_attached_children(
    store: &dyn RunLog,
    queue: &Queue,
    run: RunId,
) -> Result<(), StoreError> {
    let mut stack = vec![run];
    while let Some(r) = stack.pop() {
        for c in store.children(r).await? {
            if c.tree.detached {
                continue;
            }
            if !c.status.is_terminal()
                && store.request_cancel(c.id).await? == CancelOutcome::Cancelled
            {
                after_end(
                    store,
                    queue,
                    &Ended {
                        run_id: c.id,
                        thread_id: c.thread_id.clone(),
                        is_child: true,
                        next: NextQueued::Unknown,
                        job_done: None,
                    },
                )
                .await?;
            }
            stack.push(c.id);
        }
    }
    Ok(())
}

/// What a finished run's worker knows without reading it again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ended {
    /// The run.
    pub run_id: RunId,
    /// Its thread (whose next queued run may start now).
    pub thread_id: ThreadId,
    /// Only a child can be awaited, so only a child's end can have made waiters due.
    pub is_child: bool,
    /// The thread's next run, when the end's commit read it.
    pub next: crate::store::NextQueued,
    /// The run's job, when the end's commit marked it done.
    pub job_done: Option<String>,
}

/// After a run ended (however it ended): push the job of the run enqueued behind it on its
/// thread, and of every parked run its end made due. Both are already durable (the terminal
/// commit woke the waiters; the reaper finds queued runs without a job), so this is only the
/// fast path: if the process dies first, the reaper does the same.
pub async fn after_end(store: &dyn RunLog, queue: &Queue, ended: &Ended) -> Result<(), StoreError> {
    let next = match &ended.next {
        NextQueued::Known(next) => *next,
        NextQueued::Unknown => store.next_queued(&ended.thread_id).await?,
    };
    if let Some(next) = next {
        push(store, queue, next).await?;
    }
    if ended.is_child {
        for waiter in store.due_waiters(ended.run_id).await? {
            push(store, queue, waiter).await?;
        }
    }
    Ok(())
}

/// [`after_end`] for a run the caller has not read (a cancel, the reaper).
pub async fn after_end_of(store: &dyn RunLog, queue: &Queue, run: RunId) -> Result<(), StoreError> {
    let Some(r) = store.get_run(run).await? else {
        return Ok(());
    };
    after_end(
        store,
        queue,
        &Ended {
            run_id: r.id,
            thread_id: r.thread_id,
            is_child: r.parent_run_id.is_some(),
            next: NextQueued::Unknown,
            job_done: None,
        },
    )
    .await
}

/// Answers an approval and, when its run is parked on it, pushes the run's job (a run still on
/// its way to the park finds the answer there and is due at once).
pub async fn answer_approval(
    store: &dyn crate::store::Store,
    queue: &Queue,
    id: &crate::ids::ApprovalId,
    owner: &OwnerId,
    answer: crate::domain::ApprovalAnswer,
) -> Result<crate::domain::Answered, StoreError> {
    let outcome = store.answer_approval(id, owner, answer).await?;
    if let crate::domain::Answered::Done { run_id } = &outcome
        && store
            .get_run(*run_id)
            .await?
            .is_some_and(|r| r.status == crate::store::RunStatus::Waiting)
    {
        push(store, queue, *run_id).await?;
    }
    Ok(outcome)
}

/// Pushes a fresh job for a run that can go on now (a due parked run, a queued run whose thread
/// just became free, a released run). A failed push is logged: the reaper repairs it.
pub async fn push(store: &dyn RunLog, queue: &Queue, run: RunId) -> Result<(), StoreError> {
    push_after(store, queue, run, std::time::Duration::ZERO).await
}

/// [`push`], the job due after `delay` (a run its owner's concurrency limit held back). Every
/// run pushed here already had its turn, so it goes ahead of its owner's newer work of the same
/// priority ([`QueuePlace::Front`](crate::domain::QueuePlace::Front)).
pub async fn push_after(
    store: &dyn RunLog,
    queue: &Queue,
    run: RunId,
    delay: std::time::Duration,
) -> Result<(), StoreError> {
    let job = new_job_id();
    store.set_job(run, &job).await?;
    let rank = store
        .queue_rank(run, crate::domain::QueuePlace::Front)
        .await?;
    match queue.push(run, &job, rank, delay).await {
        Ok(()) if delay.is_zero() => store.job_queued(),
        Ok(()) => {}
        Err(e) => {
            tracing::warn!(run_id = %run, error = %e, "could not push the run's job; the reaper will")
        }
    }
    Ok(())
}
