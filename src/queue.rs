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

use crate::ids::RunId;

pub use crate::domain::job::{JOB_MAX_ATTEMPTS, QUEUE_NAME, RunJob, job_body, job_priority};

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
        let storage = Storage::Sqlite(
            SqliteStorage::new(pool).with_config(Self::sqlite_config(heartbeat, 4)),
        );
        Self { storage, heartbeat }
    }

    /// A queue on the given PostgreSQL pool (the store's).
    pub fn postgres(pool: &PgPool, heartbeat: Duration) -> Self {
        let storage = Storage::Postgres(
            PostgresStorage::new(pool).with_config(Self::pg_config(heartbeat, 4)),
        );
        Self { storage, heartbeat }
    }

    /// `concurrency`: runs the worker executes at once. It fetches no more jobs than that (at
    /// most 4): a fetched batch runs in whatever order the database returns it, so a worker
    /// that can run one job at a time must fetch one at a time for ranks and priorities to hold.
    ///
    /// On both backends apalis does not mark a started job `Running` (`lock_tasks(false)`):
    /// that was one more write transaction per run (an `UPDATE` through every index of the job
    /// table), and nothing reads the difference. The fetch already locks the job to the worker
    /// (`Queued`, `lock_by`), which is what the ack, apalis's orphan recovery and our store
    /// (`next_queued`, `fetched_not_started`, the reaper) go by; none of them tells `Queued`
    /// from `Running`, since apalis wrote `Running` through a channel after the handler began.
    pub(crate) fn sqlite_config(heartbeat: Duration, concurrency: usize) -> SqliteQueueConfig {
        SqliteQueueConfig::default()
            .queue(QUEUE_NAME)
            .heartbeat_interval(heartbeat)
            .batch_size(concurrency.clamp(1, 4))
            .lock_tasks(false)
    }

    /// `batch`: jobs fetched per query. As many as the worker can run at once: fewer costs
    /// round trips (measured: 4 → 32 took 880 to 1,000+ steps/s), more would hoard jobs that
    /// other workers could start.
    pub(crate) fn pg_config(heartbeat: Duration, batch: usize) -> PgQueueConfig {
        PgQueueConfig::default()
            .queue(QUEUE_NAME)
            .heartbeat_interval(heartbeat)
            .batch_size(batch.clamp(1, 64))
            .lock_tasks(false)
    }

    /// Pushes the job for `run` under `job_id` (already recorded on the run).
    ///
    /// `rank` is the run's place among its owner's queued runs (0 = next) and `priority` its
    /// priority (1–5): jobs are fetched by rank first, so owners with work queued take turns
    /// however long one owner's queue is (the k-th run of every owner before the (k+1)-th of
    /// any); the priority breaks ties within a rank. `delay` holds the job back, never less.
    pub async fn push(
        &self,
        run: RunId,
        job_id: &str,
        (rank, priority): (u32, u8),
        delay: std::time::Duration,
    ) -> Result<(), QueueError> {
        let id: ulid::Ulid = job_id.parse().map_err(|e| QueueError::Push {
            run,
            message: format!("bad job id: {e}"),
        })?;
        let mut task = TaskBuilder::new(RunJob { run_id: run })
            .task_id(TaskId::from_string(id.to_string()))
            .max_attempts(JOB_MAX_ATTEMPTS)
            .priority(job_priority(rank, priority));
        if !delay.is_zero() {
            task = task.run_at_timestamp(due_second(std::time::SystemTime::now() + delay));
        }
        let task = task.build();
        match self.storage.clone() {
            Storage::Sqlite(mut s) => s.push_task(task).await.map_err(|e| QueueError::Push {
                run,
                message: e.to_string(),
            }),
            Storage::Postgres(mut s) => s.push_task(task).await.map_err(|e| QueueError::Push {
                run,
                message: e.to_string(),
            }),
        }
    }
}

/// When an idle worker looks for jobs again: every `period`, and (PostgreSQL) whenever a
/// notification of a new job arrives. Used in place of apalis's `IntervalStrategy` and its
/// `Strategy` builder, which leave the worker with nothing armed to wake it: the interval,
/// once fired, makes a new timer without polling it, and the builder stops at the first
/// strategy that fired. When the fetch that wake-up started came back empty in the same
/// poll, nothing woke the worker again until its heartbeat: seen as every run of a SQLite
/// bench starting about 5 s late, in about one bench of ten.
///
/// Here every poll drains the notifications until none is ready and re-arms the timer until
/// it is pending, so both are armed whenever this returns.
///
/// apalis fetches whenever the worker is polled and its backend is idle, whatever the strategy
/// says, and a wake-up that comes while a fetch is in flight is spent on that fetch, which may
/// have read the table before the new job committed. Seen: a caller that starts its next run
/// the moment the last one ended met the fetch that the end itself started, and one run in
/// thirty waited for the next period (250 ms on PostgreSQL). So a notification is followed by
/// more wake-ups, [`FOLLOW_UPS`] apart: the first fetch after the one in flight reads after
/// the commit. They stop once the worker was handed a job after the notification
/// ([`Wakeups::settled_by`]): apalis fetches again after every job it yields while a slot is
/// free, so a fetch has then started after the notification, and the follow-ups would only be
/// empty fetches (on PostgreSQL four statements each, with a short run's own about a hundred).
pub struct Wakeups {
    period: Duration,
    timer: std::pin::Pin<Box<tokio::time::Sleep>>,
    notifications: Option<std::sync::Mutex<futures::stream::BoxStream<'static, ()>>>,
    follow_up: std::pin::Pin<Box<tokio::time::Sleep>>,
    /// The follow-ups still owed for the last notification (index into [`FOLLOW_UPS`]).
    owed: usize,
    /// Jobs the worker was handed, ever, and how many when the last notification came.
    handed: Option<(std::sync::Arc<std::sync::atomic::AtomicU64>, u64)>,
}

/// When the wake-ups that follow a notification come, after it and after each other: past a
/// fetch that was in flight (a millisecond or two), then past one slowed by a loaded machine.
const FOLLOW_UPS: [Duration; 4] = [
    Duration::from_millis(2),
    Duration::from_millis(10),
    Duration::from_millis(50),
    Duration::from_millis(250),
];

impl Wakeups {
    /// Every `period` (at least a millisecond).
    pub fn every(period: Duration) -> Self {
        let period = period.max(Duration::from_millis(1));
        Wakeups {
            period,
            timer: Box::pin(tokio::time::sleep(period)),
            notifications: None,
            follow_up: Box::pin(tokio::time::sleep(Duration::ZERO)),
            owed: FOLLOW_UPS.len(),
            handed: None,
        }
    }

    /// Drops the follow-ups owed for a notification once `handed` (the jobs the worker was
    /// handed, counted by its handler) moves past its value when the notification came.
    pub fn settled_by(mut self, handed: std::sync::Arc<std::sync::atomic::AtomicU64>) -> Self {
        self.handed = Some((handed, 0));
        self
    }

    /// Also whenever `stream` yields (its items are only a signal); several streams add up.
    pub fn and_on<S: futures::Stream + Send + 'static>(mut self, stream: S) -> Self {
        use futures::StreamExt;
        let stream = stream.map(|_| ()).boxed();
        let merged = match self.notifications.take() {
            Some(old) => futures::stream::select(old.into_inner().unwrap(), stream).boxed(),
            None => stream,
        };
        self.notifications = Some(std::sync::Mutex::new(merged));
        self
    }
}

impl apalis_core::backend::ext::poll_strategy::PollStrategy for Wakeups {
    fn poll_drive(
        &mut self,
        cx: &mut std::task::Context<'_>,
        _: &apalis_core::backend::ext::poll_strategy::PollSnapshot,
    ) -> std::task::Poll<Option<()>> {
        use futures::StreamExt;
        let mut woke = false;
        let mut notified = false;
        if let Some(n) = &self.notifications {
            let mut n = n.lock().unwrap();
            while let std::task::Poll::Ready(item) = n.poll_next_unpin(cx) {
                if item.is_none() {
                    // The listener ended: the timer alone wakes the worker from now on.
                    drop(n);
                    self.notifications = None;
                    break;
                }
                notified = true;
            }
        }
        if notified {
            woke = true;
            self.owed = 0;
            let at = tokio::time::Instant::now() + FOLLOW_UPS[0];
            self.follow_up.as_mut().reset(at);
            if let Some((count, at_notice)) = &mut self.handed {
                *at_notice = count.load(std::sync::atomic::Ordering::SeqCst);
            }
        } else if let Some((count, at_notice)) = &self.handed
            && count.load(std::sync::atomic::Ordering::SeqCst) > *at_notice
        {
            self.owed = FOLLOW_UPS.len();
        }
        while self.owed < FOLLOW_UPS.len() && self.follow_up.as_mut().poll(cx).is_ready() {
            woke = true;
            self.owed += 1;
            if let Some(next) = FOLLOW_UPS.get(self.owed) {
                let at = tokio::time::Instant::now() + *next;
                self.follow_up.as_mut().reset(at);
            }
        }
        while self.timer.as_mut().poll(cx).is_ready() {
            woke = true;
            let next = tokio::time::Instant::now() + self.period;
            self.timer.as_mut().reset(next);
        }
        if woke {
            std::task::Poll::Ready(Some(()))
        } else {
            std::task::Poll::Pending
        }
    }
}

/// The whole second a job held back until `at` is due. apalis keeps a job's due time in whole
/// seconds and its own `run_after` rounds down, so a job was fetched up to a second early: a
/// run parked until a rate limit's reset (or an await's deadline) was claimed before it, found
/// the limit still closed and parked again, over and over for that second. Rounding up makes
/// it up to a second late instead.
fn due_second(at: std::time::SystemTime) -> u64 {
    let t = at.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    t.as_secs() + u64::from(t.subsec_nanos() > 0)
}

#[cfg(test)]
mod tests {
    use super::{due_second, job_priority};

    #[test]
    fn a_held_back_job_is_never_due_before_its_time() {
        let at = |s: u64, ms: u64| {
            std::time::UNIX_EPOCH + std::time::Duration::from_millis(s * 1000 + ms)
        };
        assert_eq!(due_second(at(100, 0)), 100, "a whole second stays");
        assert_eq!(due_second(at(100, 1)), 101);
        assert_eq!(due_second(at(100, 999)), 101);
    }

    /// A waker that counts its wake-ups.
    struct Count(std::sync::atomic::AtomicUsize);
    impl std::task::Wake for Count {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// After the timer fired and was polled once (the worker woke, fetched nothing and went
    /// back to sleep without polling the strategy again), the worker is still woken one period
    /// later; apalis's own interval leaves nothing armed then.
    #[tokio::test]
    async fn the_timer_is_armed_again_whenever_it_fired() {
        use apalis_core::backend::ext::poll_strategy::{
            IntervalStrategy, PollSnapshot, PollStrategy,
        };
        use std::sync::atomic::Ordering::SeqCst;
        let period = std::time::Duration::from_millis(20);
        let wakes = |s: &mut dyn PollStrategy| {
            let count = std::sync::Arc::new(Count(Default::default()));
            let waker = std::task::Waker::from(count.clone());
            let mut cx = std::task::Context::from_waker(&waker);
            let snapshot = PollSnapshot::default();
            (
                s.poll_drive(&mut cx, &snapshot).is_pending(),
                count,
                move |s: &mut dyn PollStrategy| {
                    let mut cx = std::task::Context::from_waker(&waker);
                    s.poll_drive(&mut cx, &snapshot).is_ready()
                },
            )
        };
        let mut ours = super::Wakeups::every(period);
        let (pending, count, poll) = wakes(&mut ours);
        assert!(pending);
        tokio::time::sleep(period * 3).await;
        assert_eq!(count.0.load(SeqCst), 1, "woken when the period passed");
        assert!(poll(&mut ours), "and fired");
        tokio::time::sleep(period * 3).await;
        assert_eq!(
            count.0.load(SeqCst),
            2,
            "woken again a period later, with no poll between"
        );
        // apalis's interval, the same way: fired once, then nothing.
        let mut theirs = IntervalStrategy::new(period);
        let (pending, count, poll) = wakes(&mut theirs);
        assert!(pending);
        tokio::time::sleep(period * 3).await;
        assert!(poll(&mut theirs));
        tokio::time::sleep(period * 3).await;
        assert_eq!(
            count.0.load(SeqCst),
            1,
            "apalis's interval no longer wakes (if it does, apalis fixed it)"
        );
    }

    /// A notification is followed by more wake-ups (a fetch in flight when it came may have
    /// read the table before the job committed), until the worker was handed a job after it.
    #[tokio::test]
    async fn follow_ups_stop_once_a_job_was_handed_after_the_notification() {
        use apalis_core::backend::ext::poll_strategy::{PollSnapshot, PollStrategy};
        use std::sync::Arc;
        use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
        let poll = |s: &mut super::Wakeups| {
            let waker = std::task::Waker::noop();
            let mut cx = std::task::Context::from_waker(waker);
            s.poll_drive(&mut cx, &PollSnapshot::default()).is_ready()
        };
        let follow_up = super::FOLLOW_UPS[0] * 3;
        for handed_a_job in [false, true] {
            let (tx, rx) = futures::channel::mpsc::unbounded::<()>();
            let handed = Arc::new(AtomicU64::new(7));
            let mut w = super::Wakeups::every(std::time::Duration::from_secs(600))
                .and_on(rx)
                .settled_by(handed.clone());
            poll(&mut w);
            tx.unbounded_send(()).unwrap();
            assert!(poll(&mut w), "the notification wakes the worker");
            if handed_a_job {
                handed.fetch_add(1, SeqCst);
            }
            tokio::time::sleep(follow_up).await;
            assert_eq!(
                poll(&mut w),
                !handed_a_job,
                "a follow-up comes only while no job was handed since the notification"
            );
        }
    }

    #[test]
    fn rank_comes_first_and_priority_breaks_ties() {
        assert!(job_priority(0, 1) > job_priority(1, 5), "rank dominates");
        assert!(job_priority(0, 5) > job_priority(0, 3), "then the priority");
        assert!(
            job_priority(u32::MAX, 5) > 0 && job_priority(0, 5) <= i32::MAX as usize,
            "fits PostgreSQL's int4"
        );
    }
}
