//! Worker processes: apalis workers that hand each job's run to the engine, the drain on
//! shutdown, and the reaper that keeps the queue honest.
//!
//! apalis traps handled here: workers poll on a short interval (an idle worker otherwise waits
//! for its 30 s heartbeat), worker names are unique per process, and a worker that dies on a
//! database error is restarted.
//!
//! The reaper, in every worker process, applies the state machine's time-driven moves: runs
//! whose lease expired go back on the queue (or fail as `lost` after too many crashes), queued
//! runs without a job that will start them get one (a crash between a run's end or wake-up
//! and the push of the next job, or a job prefetched by a worker that died or is full), and
//! parked runs that are due get one. A start writes its run's first job in its own
//! transaction, so it never leaves work for the reaper.

use std::sync::Arc;
use std::time::Duration;

use apalis::prelude::*;
use apalis_postgres::PostgresStorage;
use apalis_sqlite::SqliteStorage;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

mod local;
mod notified;

pub use local::{Handed, Local, Reserved};

use crate::engine::{Engine, Executed};
use crate::ids::RunId;
use crate::queue::{Queue, RunJob, Storage, Wakeups};
use crate::store::{RunStatus, StoreError};

/// What a worker needs to execute jobs.
pub struct WorkerContext {
    /// The engine.
    pub engine: Arc<Engine>,
    /// Worker name (unique per process), used as the lease owner.
    pub name: String,
    /// Fires on shutdown: runs finish their step in flight (within the drain grace) and are
    /// released to the queue.
    pub shutdown: CancellationToken,
    /// For pushing the next run of a thread, waiters, released runs.
    pub queue: Queue,
    /// Every run this process is executing, so a shutdown can wait for them to drain.
    pub in_flight: TaskTracker,
    /// Jobs this process's workers were handed, ever: a worker with free slots whose count
    /// stands still is starved, and only then looks for runs other workers hold.
    pub handed: Arc<std::sync::atomic::AtomicU64>,
    /// The process's `concurrency` slots, shared by the runs apalis hands this worker and the
    /// runs a start hands it in-process ([`Local`]).
    pub slots: Arc<tokio::sync::Semaphore>,
}

/// How long a run held back by a concurrency limit waits before it is looked at again: until
/// the next whole second (apalis schedules in whole seconds, and a delay is never cut short).
const LIMIT_RETRY: Duration = Duration::from_millis(1);

async fn handle(job: RunJob, ctx: Data<Arc<WorkerContext>>) -> Result<(), BoxDynError> {
    let ctx: Arc<WorkerContext> = (*ctx).clone();
    ctx.handed
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let run_id = job.run_id;
    // Spawned so runs use every core (apalis polls one worker's jobs in one task), and tracked
    // so a shutdown waits for the drain even if apalis stops waiting for us. The task is
    // tracked before it looks at the shutdown token: either the drain's wait sees it, or the
    // task sees the shutdown and starts nothing.
    let tracker = ctx.in_flight.clone();
    let ctx_shutdown = ctx.shutdown.clone();
    let task = tracker.spawn(async move {
        // A slot of the process's concurrency, which runs handed over in-process share.
        let _slot = ctx.slots.clone().acquire_owned().await;
        serve(&ctx, run_id, None).await
    });
    // On shutdown apalis stops polling its backend (possibly between a statement of one of its
    // own SQLite transactions and the commit, the write lock held) and waits for the handlers
    // before it finishes that transaction. A handler that waited here for its run to drain would
    // wait on that lock (seen: the drain's commits stuck for the 30 s busy timeout). So on
    // shutdown the handler returns at once; the run drains on in `in_flight`, which
    // `run_workers` waits for, and its lease (not the job) says who owns it.
    tokio::select! {
        r = task => match r {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(Box::new(e)),
            Err(join) => Err(Box::new(join)),
        },
        _ = ctx_shutdown.cancelled() => Ok(()),
    }
}

/// A job's run, however the job reached this worker: executed, then what its outcome asks of
/// the queue (the thread's next run, a parked run's wake-up job, a deferred run's retry).
/// `claimed` is the run's claim (and the context it read) when the job's take made it
/// ([`local::Reserved::take_and_run`]).
pub(super) async fn serve(
    ctx: &WorkerContext,
    run_id: RunId,
    claimed: Option<Claimed>,
) -> Result<Executed, StoreError> {
    let store = ctx.engine.store.as_ref();
    // A draining worker starts nothing new: apalis may still hand it a job it fetched (even
    // the job of a run this worker just released), and claiming it would take the run back
    // from the queue. The run gets a fresh job instead, for a worker that is not stopping.
    // A run claimed with its job's take is this worker's already: its loop releases it at its
    // first step boundary, as it releases any run a drain finds going.
    if claimed.is_none() && ctx.shutdown.is_cancelled() {
        tracing::info!(%run_id, "draining: not starting this run; handing it back to the queue");
        if store
            .get_run(run_id)
            .await?
            .is_some_and(|r| r.status == RunStatus::Queued)
        {
            crate::runs::push(store, &ctx.queue, run_id).await?;
        }
        return Ok(Executed::Skipped);
    }
    let executed = match claimed {
        None => ctx.engine.execute(run_id, &ctx.name, &ctx.shutdown).await?,
        Some((claim, context)) => {
            ctx.engine
                .execute_claim(run_id, claim, context, &ctx.shutdown)
                .await?
        }
    };
    match &executed {
        Executed::Finished(ended) => {
            ctx.engine
                .settings
                .failpoints
                .hit("after_terminal_commit")
                .await;
            if let Err(e) = crate::runs::after_end(store, &ctx.queue, ended).await {
                tracing::warn!(%run_id, error = %e, "could not start the thread's next run or wake its waiters; the reaper will");
            }
        }
        Executed::Parked { due: true, .. } => crate::runs::push(store, &ctx.queue, run_id).await?,
        // A timed park (a rate limit, a wait's timeout, the run's deadline): a job due then,
        // so it wakes on time; whatever wakes it earlier pushes its own, and the late one
        // finds nothing to claim.
        Executed::Parked {
            due: false,
            wake_at: Some(at),
        } => {
            let delay =
                Duration::from_millis(at.saturating_sub(crate::store::now_ms()).max(0) as u64);
            crate::runs::push_after(store, &ctx.queue, run_id, delay).await?
        }
        // Held back by a concurrency limit: looked at again shortly, by rank as ever.
        Executed::Deferred => {
            crate::runs::push_after(store, &ctx.queue, run_id, LIMIT_RETRY).await?
        }
        // A released run's job was pushed with the release.
        Executed::Released
        | Executed::Parked {
            due: false,
            wake_at: None,
        }
        | Executed::Skipped
        | Executed::LeaseLost => {}
    }
    Ok(executed)
}

/// A run's claim made before its worker serves it, with the context the claim read.
type Claimed = (crate::store::Claim, Option<crate::store::ThreadContext>);

/// Settings of a worker process's pool.
#[derive(Clone, Debug)]
pub struct WorkerSettings {
    /// Runs executed at once.
    pub concurrency: usize,
    /// How often an idle worker looks for jobs.
    pub poll_interval: Duration,
    /// Reaper period.
    pub reap_every: Duration,
    /// How long a fresh enqueue is left alone by the reaper.
    pub reap_grace: Duration,
    /// How long a shutdown waits for the runs in flight to finish their step and be released.
    pub drain_grace: Duration,
}

/// Runs a worker (restarted on failure) and the reaper until `shutdown`, then drains: the runs
/// in flight finish their current step (within `drain_grace`) and go back to the queue.
pub async fn run_workers(
    engine: Arc<Engine>,
    queue: Queue,
    settings: WorkerSettings,
    starts: Arc<Local>,
    shutdown: CancellationToken,
) {
    // The tokenizers load once per process (tens of ms, more in debug builds): before the first
    // claim, off the async threads, so no run's heartbeat waits on it.
    let model = engine.settings.default_model.clone();
    let _ = tokio::task::spawn_blocking(move || crate::model::tokens::Counter::warm(&model)).await;
    let reaper = tokio::spawn(reap(
        engine.clone(),
        queue.clone(),
        settings.clone(),
        shutdown.clone(),
    ));
    let in_flight = TaskTracker::new();
    // The queue worker running now, for the look at what other workers hold.
    let current = Arc::new(std::sync::Mutex::new(String::new()));
    let handed = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let slots = Arc::new(tokio::sync::Semaphore::new(settings.concurrency.max(1)));
    let relief = tokio::spawn(relieve(
        engine.clone(),
        queue.clone(),
        Slots {
            concurrency: settings.concurrency.max(1),
            in_flight: in_flight.clone(),
            handed: handed.clone(),
        },
        current.clone(),
        shutdown.clone(),
    ));
    let notified = match &queue.storage {
        Storage::Postgres(s) => Some(tokio::spawn(notified::take_notified(
            s.pool().clone(),
            engine.store.clone(),
            starts.clone(),
            shutdown.clone(),
        ))),
        Storage::Sqlite(_) => None,
    };
    let mut restarts = 0u32;
    // Every queue worker name this process used: its fetched jobs are handed back at the end.
    let mut names = vec![];
    loop {
        let name = format!(
            "subagents-{}-{}",
            std::process::id(),
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        names.push(name.clone());
        *current.lock().unwrap_or_else(|e| e.into_inner()) = name.clone();
        let ctx = Arc::new(WorkerContext {
            engine: engine.clone(),
            name: name.clone(),
            shutdown: shutdown.clone(),
            queue: queue.clone(),
            in_flight: in_flight.clone(),
            handed: handed.clone(),
            slots: slots.clone(),
        });
        starts.set(Some(ctx.clone()));
        tracing::info!(worker = %name, concurrency = settings.concurrency, "worker started");
        let stop = shutdown.clone();
        let until = async move {
            stop.cancelled().await;
            Ok::<(), std::io::Error>(())
        };
        // The two storages are different types, so the (identical) worker is built per arm.
        macro_rules! run_worker {
            ($backend:expr) => {
                WorkerBuilder::new(name.as_str())
                    .backend($backend)
                    .concurrency(settings.concurrency.max(1))
                    .data(ctx)
                    .build(handle)
                    .run_until(until)
                    .await
            };
        }
        // Jobs queued by this process (a start, a parent woken by its children) wake the worker
        // at once; the interval is only the net for jobs queued elsewhere (SQLite) or a
        // notification that was lost (PostgreSQL).
        let local = engine.store.jobs_queued();
        let res = match &queue.storage {
            Storage::Sqlite(s) => run_worker!(
                SqliteStorage::<RunJob>::new(s.pool())
                    .with_config(Queue::sqlite_config(queue.heartbeat, settings.concurrency))
                    .poll_with_strategy(
                        Wakeups::every(settings.poll_interval)
                            .and_on(local)
                            .settled_by(handed.clone())
                    )
            ),
            // PostgreSQL's LISTEN/NOTIFY announces jobs queued in other processes: a worker
            // with a free slot takes the job it was told of, and any other notification wakes
            // this fetch (`notified`). A slow interval catches a notification that was missed
            // (seen: a job waiting for the 5 s heartbeat).
            Storage::Postgres(s) => {
                let wakeups =
                    Wakeups::every(settings.poll_interval.max(Duration::from_millis(250)))
                        .and_on(local)
                        .settled_by(handed.clone());
                run_worker!(
                    PostgresStorage::<RunJob>::new(s.pool())
                        .with_config(Queue::pg_config(queue.heartbeat, settings.concurrency))
                        .poll_with_strategy(wakeups)
                )
            }
        };
        // Starts stop handing runs to a worker that stopped (its name is no longer registered
        // either way once its heartbeat lapses).
        starts.set(None);
        if shutdown.is_cancelled() {
            break;
        }
        restarts += 1;
        let wait = Duration::from_millis(500 * u64::from(restarts.min(10)));
        match res {
            Ok(()) => tracing::warn!(worker = %name, "worker stopped unexpectedly; restarting"),
            Err(e) => {
                tracing::error!(worker = %name, error = %e, ?wait, "worker failed (database unavailable?); restarting")
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = shutdown.cancelled() => break,
        }
    }
    // The listener first: a take it had under way when the shutdown came hands its run to
    // `in_flight` before that closes, so the drain releases it like any run in flight.
    if let Some(n) = notified {
        let _ = tokio::time::timeout(settings.drain_grace + Duration::from_secs(2), n).await;
    }
    // The drain: every run in flight finishes its step (or is cut at the grace) and is released.
    in_flight.close();
    let n = in_flight.len();
    if n > 0 {
        tracing::info!(
            runs = n,
            grace_s = settings.drain_grace.as_secs_f64(),
            "draining: finishing the steps in flight"
        );
    }
    if tokio::time::timeout(
        settings.drain_grace + Duration::from_secs(2),
        in_flight.wait(),
    )
    .await
    .is_err()
    {
        tracing::warn!(
            "drain did not finish in time; the remaining runs resume when their leases expire"
        );
    }
    hand_back_fetched(&engine, &queue, &names).await;
    let _ = reaper.await;
    let _ = relief.await;
    tracing::info!("workers stopped");
}

/// Gives a fresh job to every queued run whose job this process's queue workers fetched and
/// never started (apalis fetches a batch as slots free, and may have fetched one the moment
/// before it stopped), so another worker starts it now rather than after the reaper's grace.
async fn hand_back_fetched(engine: &Engine, queue: &Queue, names: &[String]) {
    let store = engine.store.as_ref();
    for name in names {
        match store.fetched_not_started(name).await {
            Ok(runs) => {
                for run_id in runs {
                    tracing::info!(%run_id, "draining: handing a fetched, unstarted run back to the queue");
                    if let Err(e) = crate::runs::push(store, queue, run_id).await {
                        tracing::warn!(%run_id, error = %e, "could not hand the run back; the reaper will");
                    }
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not look for fetched, unstarted runs; the reaper will give them new jobs")
            }
        }
    }
}

/// How often a worker with free slots looks for runs another worker fetched and holds.
const RELIEVE_EVERY: Duration = Duration::from_millis(250);

/// How long a fetched run may wait in another worker's batch before a worker with a free slot
/// takes it: longer than a fetch normally takes to reach the claim, so a run being started is
/// rarely taken (a run taken twice is still claimed once: the other copy finds it taken).
const HELD_FOR: Duration = Duration::from_millis(250);

/// A process's worker slots, as the relief sees them.
struct Slots {
    concurrency: usize,
    in_flight: TaskTracker,
    handed: Arc<std::sync::atomic::AtomicU64>,
}

/// No run waits in a busy worker's batch while this one has a free slot: apalis fetches a batch
/// whenever one slot frees, and the runs beyond the free slots would wait there for the busy
/// worker's runs to end (seen: 4.6 s while other workers were idle). Every [`RELIEVE_EVERY`] in
/// which this process had free slots and was handed no job (starved: whatever is queued is
/// held elsewhere), it gives up to that many such runs fresh jobs (waking its own worker to
/// fetch them). A worker that is busy or still being fed never looks: the look reads every
/// queued run, and paying that at every tick cost a quarter more CPU per step on a SQLite
/// backlog; nor does anything churn when every slot of the fleet is taken.
async fn relieve(
    engine: Arc<Engine>,
    queue: Queue,
    slots: Slots,
    current: Arc<std::sync::Mutex<String>>,
    shutdown: CancellationToken,
) {
    let store = engine.store.as_ref();
    let mut seen = u64::MAX;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(RELIEVE_EVERY) => {}
            _ = shutdown.cancelled() => return,
        }
        let handed = slots.handed.load(std::sync::atomic::Ordering::Relaxed);
        let fed = std::mem::replace(&mut seen, handed) != handed;
        let free = slots.concurrency.saturating_sub(slots.in_flight.len());
        let name = current.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if fed || free == 0 || name.is_empty() {
            continue;
        }
        let held = match store.held_elsewhere(&name, HELD_FOR, free as u32).await {
            Ok(held) => held,
            Err(e) => {
                tracing::debug!(error = %e, "could not look for runs other workers hold");
                continue;
            }
        };
        for run_id in held {
            tracing::info!(%run_id, "taking over a run another worker fetched but cannot start yet");
            if let Err(e) = crate::runs::push(store, &queue, run_id).await {
                tracing::warn!(%run_id, error = %e, "could not take the run over; the reaper will");
            }
        }
    }
}

/// One reaper pass every `reap_every`: expired leases, queued runs without a live job, due
/// parked runs.
async fn reap(
    engine: Arc<Engine>,
    queue: Queue,
    settings: WorkerSettings,
    shutdown: CancellationToken,
) {
    let store = engine.store.as_ref();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(settings.reap_every) => {}
            _ = shutdown.cancelled() => return,
        }
        // Limits another process set count for this one's claims from now on.
        let _ = store.refresh_limits().await;
        match store.expire_leases(engine.settings.max_attempts).await {
            Ok(expired) => {
                for e in expired {
                    if e.gave_up {
                        tracing::warn!(run_id = %e.run_id, "run abandoned by too many workers; failed with kind=lost");
                        // A parent that ends takes its attached children with it, however it ended.
                        let ended = async {
                            crate::runs::after_end_of(store, &queue, e.run_id).await?;
                            crate::runs::cancel_attached_children(store, &queue, e.run_id).await
                        };
                        if let Err(err) = ended.await {
                            tracing::warn!(error = %err, "reaper could not finish the ending of a lost run");
                        }
                    } else {
                        tracing::info!(run_id = %e.run_id, "lease expired: run back on the queue");
                        if let Err(err) = crate::runs::push(store, &queue, e.run_id).await {
                            tracing::warn!(error = %err, "reaper could not re-enqueue an expired run");
                        }
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "reaper could not expire leases"),
        }
        let orphans = match store.orphans(settings.reap_grace).await {
            Ok(o) => o,
            Err(e) => {
                tracing::warn!(error = %e, "reaper could not read orphans");
                continue;
            }
        };
        for o in orphans {
            tracing::info!(run_id = %o.run_id, status = o.status.as_str(), "re-enqueueing a run that has no live job");
            if let Err(e) = crate::runs::push(store, &queue, o.run_id).await {
                tracing::warn!(error = %e, "reaper could not re-enqueue a run");
            }
        }
    }
}
