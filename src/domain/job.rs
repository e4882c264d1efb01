//! A run's job in the queue: the queue's name, the job's body and its priority. Kept below both
//! the store (which writes a new run's first job in the transaction that creates the run, and
//! reads apalis's job table) and the queue (which pushes the rest).

use serde::{Deserialize, Serialize};

use crate::ids::RunId;

/// The queue's name in apalis's job table, which the store reads (to find runs whose job is
/// not waiting to be fetched) and the queue writes. Fixed: apalis's default (the Rust type
/// path) would orphan queued jobs whenever the type moved.
pub const QUEUE_NAME: &str = "subagents.runs";

/// Queue-level retries of one job (a job fails only when storage fails mid-run).
pub const JOB_MAX_ATTEMPTS: usize = 10;

/// Job priorities start here and go down with the rank (apalis fetches the highest first;
/// PostgreSQL keeps it in an `int4`). `migrations/postgres/0014` computes the same.
const TOP_PRIORITY: u64 = 1_000_000_000;
/// Ranks beyond this share the lowest priority.
const MAX_RANK: u64 = 100_000_000;

/// A job's priority: its run's rank in its owner's queue, then the run's own priority (1–5).
pub fn job_priority(rank: u32, priority: u8) -> usize {
    (TOP_PRIORITY - u64::from(rank).min(MAX_RANK) * 8 + u64::from(priority.min(7))) as usize
}

/// The job: run this run. Defined beside the queue's name because the store writes a new
/// run's first job itself (in the transaction that creates the run).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct RunJob {
    /// The run to execute.
    pub run_id: RunId,
}

/// A run's job as apalis stores it (its JSON codec).
pub fn job_body(run: RunId) -> Vec<u8> {
    serde_json::to_vec(&RunJob { run_id: run }).expect("a run id serializes")
}
