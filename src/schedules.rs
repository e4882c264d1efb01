//! Firing schedules. Every `serve` and `worker` process runs a scheduler: a pass every 250 ms
//! (and, while no schedule exists, a look every 2 s whether one appeared) reads the schedules
//! whose next tick is due, fires the ticks their `catch_up` keeps, and moves `next_fire_at`
//! past them with a compare-and-set.
//!
//! A tick fires exactly once across a fleet: its run is started with the idempotency key
//! `schedule:<id>:<tick>` (and, on a new thread each time, a thread id made of the same), so
//! two processes firing it at once, or a process firing it again after a crash before it moved
//! `next_fire_at`, get the same run back. Which run a tick started is recorded beside it
//! (`sa_schedule_runs`), once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::app::App;
use crate::domain::schedule::{self, CatchUp, Clock, GRACE_MS, MAX_CATCH_UP, Overlap, Schedule};
use crate::ids::{RunId, ThreadId};
use crate::runs::{StartError, StartRun};
use crate::store::{IfBusy, StoreError, now_ms};

/// How often the scheduler looks for due ticks.
const TICK: Duration = Duration::from_millis(250);
/// How often a scheduler with no schedules looks whether one appeared.
const IDLE_CHECK: Duration = Duration::from_secs(2);

/// What firing a tick did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fired {
    /// It started this run (or found the one an earlier firing of the tick started).
    Started(RunId),
    /// `overlap: skip` and the previous run was still going.
    Skipped {
        /// The run still going.
        previous: RunId,
    },
}

/// Why a tick could not fire.
#[derive(Debug, thiserror::Error)]
pub enum FireError {
    /// The run could not start (an agent gone, a bad input): the tick is given up, and the
    /// schedule goes on.
    #[error(transparent)]
    Start(#[from] StartError),
    /// Storage failed: the tick fires again at the next pass.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Starts the scheduler of this process; it stops at `shutdown`.
pub fn spawn(app: Arc<App>, shutdown: CancellationToken) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut last_look = None::<Instant>;
        let mut any = false;
        loop {
            if last_look.is_none_or(|t| t.elapsed() >= IDLE_CHECK) {
                // Any schedule of any owner: a due read is what tells.
                any = match app.store.due_schedules(i64::MAX, 1).await {
                    Ok(s) => !s.is_empty(),
                    Err(_) => true,
                };
                last_look = Some(Instant::now());
            }
            if any && let Err(e) = pass(&app).await {
                tracing::warn!(error = %e, "schedule pass failed; trying again");
            }
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(TICK) => {}
            }
        }
    })
}

/// One pass: fires what is due.
async fn pass(app: &App) -> Result<(), StoreError> {
    let now = now_ms();
    for s in app.store.due_schedules(now, 50).await? {
        let span = tracing::info_span!("schedule", schedule_id = %s.id, agent = %s.agent);
        let _enter = span.enter();
        let clock = match Clock::new(&s.cron, &s.timezone) {
            Ok(c) => c,
            Err(e) => {
                // Validated when stored; a later build that reads it otherwise must not loop.
                tracing::error!(error = %e, "a stored schedule no longer parses; it is paused");
                let mut paused = s.clone();
                paused.paused = true;
                app.store.update_schedule(&paused).await?;
                continue;
            }
        };
        let due = clock.between(s.next_fire_at, now, usize::MAX);
        let fire: Vec<i64> = match s.catch_up {
            CatchUp::None => due
                .iter()
                .copied()
                .filter(|t| now - t <= GRACE_MS)
                .collect(),
            CatchUp::Last => due.last().copied().into_iter().collect(),
            CatchUp::All => due[due.len().saturating_sub(MAX_CATCH_UP)..].to_vec(),
        };
        let skipped = due.len() - fire.len();
        if skipped > 0 {
            tracing::info!(
                skipped,
                catch_up = s.catch_up.as_str(),
                "missed ticks not fired"
            );
        }
        for tick in fire {
            match fire_tick(app, &s, tick).await {
                Ok(Fired::Started(run)) => tracing::info!(%run, tick, "schedule fired"),
                Ok(Fired::Skipped { previous }) => {
                    tracing::info!(%previous, tick, "tick skipped: the previous run is still going")
                }
                Err(FireError::Start(e)) => {
                    tracing::warn!(error = %e, tick, "the tick's run could not start; the schedule goes on")
                }
                Err(FireError::Store(e)) => return Err(e),
            }
        }
        let last = due.last().copied().unwrap_or(s.next_fire_at);
        let next = clock.next_after(last.max(now)).unwrap_or(i64::MAX);
        app.store
            .advance_schedule(&s.id, s.next_fire_at, next)
            .await?;
    }
    Ok(())
}

/// Fires `tick` of `s`: starts its run as `overlap` says, or finds the run an earlier firing
/// of the same tick started. A manual trigger fires the tick "now".
pub async fn fire_tick(app: &App, s: &Schedule, tick: i64) -> Result<Fired, FireError> {
    let key = schedule::tick_key(&s.id, tick);
    // A second firing of a tick finds its run by key, whatever the previous run does now.
    if let Some(run) = app.store.run_by_key(&s.owner, &key).await? {
        app.store.record_schedule_run(&s.id, tick, run).await?;
        return Ok(Fired::Started(run));
    }
    let previous = match app.store.schedule_runs(&s.id, 1).await?.first() {
        Some((_, run, status)) if !status.is_terminal() => Some(*run),
        _ => None,
    };
    if let Some(previous) = previous {
        match s.overlap {
            Overlap::Skip => return Ok(Fired::Skipped { previous }),
            Overlap::Enqueue => {}
            Overlap::CancelPrevious => {
                crate::runs::cancel(app.store.as_ref(), &app.queue, previous).await?;
            }
        }
    }
    let thread_id = match &s.thread_id {
        Some(t) => ThreadId::chosen(t).ok(),
        None => ThreadId::chosen(&format!("sched-{}-{tick}", s.id)).ok(),
    };
    let mut metadata = match &s.metadata {
        serde_json::Value::Object(m) => m.clone(),
        _ => serde_json::Map::new(),
    };
    metadata.insert("schedule_id".into(), s.id.clone().into());
    let run = app
        .start_run(StartRun {
            agent: Some(s.agent.clone()),
            input: s.input.clone(),
            thread_id,
            owner: Some(s.owner.clone()),
            metadata: Some(serde_json::Value::Object(metadata)),
            if_busy: IfBusy::Enqueue,
            idempotency_key: Some(key),
            priority: Some(s.priority),
            ..Default::default()
        })
        .await?;
    app.store.record_schedule_run(&s.id, tick, run.id).await?;
    Ok(Fired::Started(run.id))
}
