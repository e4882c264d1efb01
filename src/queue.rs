//! The queue: apalis 1.0 on the store's database. A job carries only a run id; the run row is
//! the truth, so a duplicate job is harmless (its claim finds the run taken or finished) and a
//! lost job is repaired by the reaper, which re-enqueues runs that are queued without a live
//! job or running under an expired lease.
//!
//! apalis traps handled here (shared/notes/apalis-1.0.md): the queue has a fixed name, workers
//! poll on a short interval (an idle worker otherwise waits for its 30 s heartbeat), worker
//! names are unique per process, and a worker that dies on a database error is restarted.

use std::sync::Arc;
use std::time::Duration;

use apalis::prelude::*;
use apalis_postgres::{Config as PgQueueConfig, PgPool, PostgresStorage};
use apalis_sqlite::{Config as SqliteQueueConfig, SqlitePool, SqliteStorage};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::engine::{Engine, Executed};
use crate::ids::RunId;

/// The queue's name in apalis's tables. Fixed: the default (the Rust type path) would orphan
/// queued jobs whenever the type moved.
pub const QUEUE_NAME: &str = "subagents.runs";

/// Queue-level retries of one job (a job fails only when storage fails mid-run).
const JOB_MAX_ATTEMPTS: usize = 10;

/// The job: run this run.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct RunJob {
    /// The run to execute.
    pub run_id: RunId,
}

/// Queue failures.
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    /// apalis could not store the job.
    #[error("could not enqueue run {run}: {message}")]
    Push {
        /// The run.
        run: RunId,
        /// apalis's error.
        message: String,
    },
}

/// The apalis storage, on the store's database.
#[derive(Clone)]
enum Storage {
    Sqlite(SqliteStorage<RunJob>),
    Postgres(PostgresStorage<RunJob>),
}

/// Handle for pushing jobs.
#[derive(Clone)]
pub struct Queue {
    storage: Storage,
    heartbeat: Duration,
}

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue").field("name", &QUEUE_NAME).finish()
    }
}

/// A fresh job id. apalis's SQLite storage keys jobs by ULID.
pub fn new_job_id() -> String {
    ulid::Ulid::new().to_string()
}

impl Queue {
    /// A queue on the given SQLite pool (the store's), with apalis's worker heartbeat.
    pub fn sqlite(pool: &SqlitePool, heartbeat: Duration) -> Self {
        let storage = Storage::Sqlite(SqliteStorage::new(pool).with_config(Self::sqlite_config(heartbeat)));
        Self { storage, heartbeat }
    }

    /// A queue on the given PostgreSQL pool (the store's).
    pub fn postgres(pool: &PgPool, heartbeat: Duration) -> Self {
        let storage = Storage::Postgres(PostgresStorage::new(pool).with_config(Self::pg_config(heartbeat, 4)));
        Self { storage, heartbeat }
    }

    fn sqlite_config(heartbeat: Duration) -> SqliteQueueConfig {
        SqliteQueueConfig::default().queue(QUEUE_NAME).heartbeat_interval(heartbeat).batch_size(4)
    }

    /// `batch`: jobs fetched per query. As many as the worker can run at once: fewer costs
    /// round trips (measured: 4 → 32 took 880 to 1,000+ steps/s), more would hoard jobs that
    /// other workers could start.
    fn pg_config(heartbeat: Duration, batch: usize) -> PgQueueConfig {
        PgQueueConfig::default().queue(QUEUE_NAME).heartbeat_interval(heartbeat).batch_size(batch.clamp(1, 64))
    }

    /// Pushes the job for `run` under `job_id` (already recorded on the run).
    pub async fn push(&self, run: RunId, job_id: &str) -> Result<(), QueueError> {
        let id: ulid::Ulid = job_id.parse().map_err(|e| QueueError::Push { run, message: format!("bad job id: {e}") })?;
        let task = TaskBuilder::new(RunJob { run_id: run }).task_id(TaskId::from_string(id.to_string())).max_attempts(JOB_MAX_ATTEMPTS).build();
        match self.storage.clone() {
            Storage::Sqlite(mut s) => s.push_task(task).await.map_err(|e| QueueError::Push { run, message: e.to_string() }),
            Storage::Postgres(mut s) => s.push_task(task).await.map_err(|e| QueueError::Push { run, message: e.to_string() }),
        }
    }
}

/// What a worker needs to execute jobs.
pub struct WorkerContext {
    /// The engine.
    pub engine: Arc<Engine>,
    /// Worker name (unique per process), used as the lease owner.
    pub name: String,
    /// Fires on shutdown: running runs are released to the queue.
    pub shutdown: CancellationToken,
    /// For pushing the next run of a thread.
    pub queue: Queue,
}

async fn handle(job: RunJob, ctx: Data<Arc<WorkerContext>>) -> Result<(), BoxDynError> {
    let ctx: Arc<WorkerContext> = (*ctx).clone();
    let run_id = job.run_id;
    // Spawned so runs use every core: apalis polls one worker's jobs in one task.
    let handle = tokio::spawn(
        async move {
            let executed = ctx.engine.execute(run_id, &ctx.name, &ctx.shutdown).await?;
            if let Executed::Finished(ended) = &executed {
                if let Err(e) = after_finish(&ctx, run_id, ended.clone()).await {
                    tracing::warn!(error = %e, "could not start the thread's next run or wake the parent; the reaper will");
                }
            }
            Ok::<_, crate::store::StoreError>(executed)
        }
        .instrument(tracing::info_span!("job", %run_id)),
    );
    match handle.await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(Box::new(e)),
        Err(join) => Err(Box::new(join)),
    }
}

/// A finished run frees its thread (push the job of the run enqueued behind it) and, if it is a
/// child, tells its parent and wakes it when parked. If this process dies first, the reaper
/// does both.
async fn after_finish(ctx: &WorkerContext, finished: RunId, ended: Option<crate::engine::Ended>) -> Result<(), crate::store::StoreError> {
    let store = ctx.engine.store.as_ref();
    let ended = match ended {
        Some(e) => e,
        None => match store.get_run(finished).await? {
            Some(r) => crate::engine::Ended { thread_id: r.thread_id, parent_run_id: r.parent_run_id },
            None => return Ok(()),
        },
    };
    if let Some(next) = store.next_queued(&ended.thread_id).await? {
        crate::delegation::wake(store, &ctx.queue, next).await?;
    }
    // Only a child needs its final state read, for the parent's `child.finished`.
    if ended.parent_run_id.is_some() {
        crate::delegation::after_end(store, &ctx.queue, finished).await?;
    }
    Ok(())
}

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
}

/// Runs a worker (restarted on failure) and the reaper until `shutdown`.
pub async fn run_workers(engine: Arc<Engine>, queue: Queue, settings: WorkerSettings, shutdown: CancellationToken) {
    let reaper = tokio::spawn(reap(engine.clone(), queue.clone(), settings.clone(), shutdown.clone()));
    let mut restarts = 0u32;
    loop {
        let name = format!("subagents-{}-{}", std::process::id(), &uuid::Uuid::new_v4().simple().to_string()[..8]);
        let ctx = Arc::new(WorkerContext { engine: engine.clone(), name: name.clone(), shutdown: shutdown.clone(), queue: queue.clone() });
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
        let res = match &queue.storage {
            // SQLite has no notifications: an idle worker polls (apalis trap 1).
            Storage::Sqlite(s) => run_worker!(SqliteStorage::<RunJob>::new(s.pool())
                .with_config(Queue::sqlite_config(queue.heartbeat))
                .poll_with_interval(settings.poll_interval)),
            // PostgreSQL wakes idle workers with LISTEN/NOTIFY; a slow interval catches a
            // notification that was missed (seen: a job waiting for the 5 s heartbeat).
            Storage::Postgres(s) => {
                let strategy = apalis_core::backend::ext::poll_strategy::Strategy::new()
                    .stream(apalis_postgres::Pubsub::new(s.pool().clone(), QUEUE_NAME.to_owned()))
                    .interval(settings.poll_interval.max(Duration::from_millis(250)));
                run_worker!(PostgresStorage::<RunJob>::new(s.pool())
                    .with_config(Queue::pg_config(queue.heartbeat, settings.concurrency))
                    .poll_with_strategy(strategy))
            }
        };
        if shutdown.is_cancelled() {
            break;
        }
        restarts += 1;
        let wait = Duration::from_millis(500 * u64::from(restarts.min(10)));
        match res {
            Ok(()) => tracing::warn!(worker = %name, "worker stopped unexpectedly; restarting"),
            Err(e) => tracing::error!(worker = %name, error = %e, ?wait, "worker failed (database unavailable?); restarting"),
        }
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = shutdown.cancelled() => break,
        }
    }
    let _ = reaper.await;
    tracing::info!("workers stopped");
}

/// Re-enqueues runs whose job is gone or whose worker vanished.
async fn reap(engine: Arc<Engine>, queue: Queue, settings: WorkerSettings, shutdown: CancellationToken) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(settings.reap_every) => {}
            _ = shutdown.cancelled() => return,
        }
        let orphans = match engine.store.orphans(settings.reap_grace).await {
            Ok(o) => o,
            Err(e) => {
                tracing::warn!(error = %e, "reaper could not read orphans");
                continue;
            }
        };
        for o in orphans {
            let job = new_job_id();
            tracing::info!(run_id = %o.run_id, status = o.status.as_str(), "re-enqueueing orphaned run");
            if let Err(e) = engine.store.set_job(o.run_id, &job).await {
                tracing::warn!(error = %e, "reaper could not record job");
                continue;
            }
            if let Err(e) = queue.push(o.run_id, &job).await {
                tracing::warn!(error = %e, "reaper could not push job");
            }
        }
    }
}
