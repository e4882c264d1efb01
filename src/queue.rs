//! The queue: apalis 1.0 on the store's database. A job carries only a run id; the run row is
//! the truth, so a duplicate job is harmless (its claim finds the run taken or finished) and a
//! lost job is repaired by the reaper (in the worker module). This module only knows jobs: it
//! pushes them, and builds the apalis storage the worker consumes. It knows nothing of runs'
//! execution, so the dependencies point one way (runs, delegation and the engine push jobs;
//! the worker consumes them).
//!
//! apalis traps handled here: the queue has a fixed name (the default, the Rust type path,
//! would orphan queued jobs whenever the type moved) and PostgreSQL workers fetch in batches.

use std::time::Duration;

use apalis::prelude::*;
use apalis_postgres::{Config as PgQueueConfig, PgPool, PostgresStorage};
use apalis_sqlite::{Config as SqliteQueueConfig, SqlitePool, SqliteStorage};
use serde::{Deserialize, Serialize};

use crate::ids::RunId;

pub use crate::store::QUEUE_NAME;

/// Queue-level retries of one job (a job fails only when storage fails mid-run).
pub(crate) const JOB_MAX_ATTEMPTS: usize = 10;

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
pub(crate) enum Storage {
    Sqlite(SqliteStorage<RunJob>),
    Postgres(PostgresStorage<RunJob>),
}

/// Handle for pushing jobs.
#[derive(Clone)]
pub struct Queue {
    pub(crate) storage: Storage,
    pub(crate) heartbeat: Duration,
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
        let storage = Storage::Sqlite(SqliteStorage::new(pool).with_config(Self::sqlite_config(heartbeat, 4)));
        Self { storage, heartbeat }
    }

    /// A queue on the given PostgreSQL pool (the store's).
    pub fn postgres(pool: &PgPool, heartbeat: Duration) -> Self {
        let storage = Storage::Postgres(PostgresStorage::new(pool).with_config(Self::pg_config(heartbeat, 4)));
        Self { storage, heartbeat }
    }

    /// `concurrency`: runs the worker executes at once. It fetches no more jobs than that (at
    /// most 4): a fetched batch runs in whatever order the database returns it, so a worker
    /// that can run one job at a time must fetch one at a time for ranks and priorities to hold.
    pub(crate) fn sqlite_config(heartbeat: Duration, concurrency: usize) -> SqliteQueueConfig {
        SqliteQueueConfig::default().queue(QUEUE_NAME).heartbeat_interval(heartbeat).batch_size(concurrency.clamp(1, 4))
    }

    /// `batch`: jobs fetched per query. As many as the worker can run at once: fewer costs
    /// round trips (measured: 4 → 32 took 880 to 1,000+ steps/s), more would hoard jobs that
    /// other workers could start.
    pub(crate) fn pg_config(heartbeat: Duration, batch: usize) -> PgQueueConfig {
        PgQueueConfig::default().queue(QUEUE_NAME).heartbeat_interval(heartbeat).batch_size(batch.clamp(1, 64))
    }

    /// Pushes the job for `run` under `job_id` (already recorded on the run).
    ///
    /// `rank` is the run's place among its owner's queued runs (0 = next) and `priority` its
    /// priority (1–5): jobs are fetched by rank first, so owners with work queued take turns
    /// however long one owner's queue is (the k-th run of every owner before the (k+1)-th of
    /// any); the priority breaks ties within a rank. `delay` holds the job back.
    pub async fn push(&self, run: RunId, job_id: &str, (rank, priority): (u32, u8), delay: std::time::Duration) -> Result<(), QueueError> {
        let id: ulid::Ulid = job_id.parse().map_err(|e| QueueError::Push { run, message: format!("bad job id: {e}") })?;
        let mut task = TaskBuilder::new(RunJob { run_id: run })
            .task_id(TaskId::from_string(id.to_string()))
            .max_attempts(JOB_MAX_ATTEMPTS)
            .priority(job_priority(rank, priority));
        if !delay.is_zero() {
            task = task.run_after(delay);
        }
        let task = task.build();
        match self.storage.clone() {
            Storage::Sqlite(mut s) => s.push_task(task).await.map_err(|e| QueueError::Push { run, message: e.to_string() }),
            Storage::Postgres(mut s) => s.push_task(task).await.map_err(|e| QueueError::Push { run, message: e.to_string() }),
        }
    }
}

/// Job priorities start here and go down with the rank (apalis fetches the highest first;
/// PostgreSQL keeps it in an `int4`).
const TOP_PRIORITY: u64 = 1_000_000_000;
/// Ranks beyond this share the lowest priority.
const MAX_RANK: u64 = 100_000_000;

/// A job's priority: its run's rank in its owner's queue, then the run's own priority (1–5).
pub fn job_priority(rank: u32, priority: u8) -> usize {
    (TOP_PRIORITY - u64::from(rank).min(MAX_RANK) * 8 + u64::from(priority.min(7))) as usize
}

#[cfg(test)]
mod tests {
    use super::job_priority;

    #[test]
    fn rank_comes_first_and_priority_breaks_ties() {
        assert!(job_priority(0, 1) > job_priority(1, 5), "rank dominates");
        assert!(job_priority(0, 5) > job_priority(0, 3), "then the priority");
        assert!(job_priority(u32::MAX, 5) > 0 && job_priority(0, 5) <= i32::MAX as usize, "fits PostgreSQL's int4");
    }
}
