//! The overview the dashboard shows of an owner's runs, as the store reads it.

use chrono::{DateTime, Utc};
use serde_json::Value;

use crate::ids::RunId;
use crate::lifecycle::RunStatus;

/// What the dashboard's overview shows, read in one pass: counts now, the last hour's
/// activity, and the fleet.
#[derive(Clone, Debug, Default)]
pub struct OverviewData {
    /// Runs per state.
    pub by_status: Vec<(RunStatus, u64)>,
    /// When the oldest queued run was enqueued (ms since the epoch).
    pub oldest_queued_ms: Option<i64>,
    /// Recent events that carry figures (`model.completed`, run ends), newest first.
    pub events: Vec<(RunId, String, Value, DateTime<Utc>)>,
    /// Whether `events` hit its cap (then per-minute figures are a sample).
    pub events_capped: bool,
    /// Failed runs per `error.kind` since the day mark.
    pub failures: Vec<(String, u64)>,
    /// Worker processes with their last heartbeat.
    pub workers: Vec<(String, DateTime<Utc>)>,
    /// The owner's running runs: id, worker, last heartbeat.
    pub running: Vec<(RunId, Option<String>, Option<DateTime<Utc>>)>,
}
