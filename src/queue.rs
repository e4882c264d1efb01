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
        let storage = Storage::Sqlite(SqliteStorage::new(pool).with_config(Self::sqlite_config(heartbeat)));
        Self { storage, heartbeat }
    }

    /// A queue on the given PostgreSQL pool (the store's).
    pub fn postgres(pool: &PgPool, heartbeat: Duration) -> Self {
        let storage = Storage::Postgres(PostgresStorage::new(pool).with_config(Self::pg_config(heartbeat, 4)));
        Self { storage, heartbeat }
    }

    pub(crate) fn sqlite_config(heartbeat: Duration) -> SqliteQueueConfig {
        SqliteQueueConfig::default().queue(QUEUE_NAME).heartbeat_interval(heartbeat).batch_size(4)
    }

    /// `batch`: jobs fetched per query. As many as the worker can run at once: fewer costs
    /// round trips (measured: 4 → 32 took 880 to 1,000+ steps/s), more would hoard jobs that
    /// other workers could start.
    pub(crate) fn pg_config(heartbeat: Duration, batch: usize) -> PgQueueConfig {
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

