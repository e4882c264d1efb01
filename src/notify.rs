//! In-process wake-ups: "something about run X changed". Waiters (`wait` endpoints, SSE streams,
//! a run's heartbeat watching for cancel) sleep on a per-run [`Signal`] instead of polling; the
//! store fires it after every commit that touches the run. Writers in other processes are heard
//! through the scale-out backends (a run's end over PostgreSQL's LISTEN/NOTIFY, every change
//! over the Redis relay); waiters keep a slow re-check as the net for what those miss.
//!
//! Each signal also carries a generation that moves on before every wake-up, so a thousand
//! waiters woken by one commit can share one read made after it ([`SharedReads`]) instead of
//! sending a thousand identical reads to the database.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use tokio::sync::{Notify, OnceCell};

use crate::domain::event::EventRecord;
use crate::ids::RunId;

/// The key under which "any run changed" waiters wait.
const ANY: RunId = RunId(uuid::Uuid::nil());

/// Generations of every signal come from one counter, so a run's generation only grows, even
/// when its signal is dropped (nobody waiting) and made again later.
static GENERATIONS: AtomicU64 = AtomicU64::new(1);

/// One run's wake-up: a [`Notify`] (it derefs to one), the generation of the last change
/// announced through it, and that of the last change that may have ended the run.
#[derive(Debug)]
pub struct Signal {
    notify: Arc<Notify>,
    generation: AtomicU64,
    /// Moves on with every change except a step's progress (a checkpoint that cannot end the
    /// run): a wait for the run's end reads again only when this moved.
    decisive: AtomicU64,
}

impl Signal {
    fn new() -> Self {
        let now = GENERATIONS.load(Ordering::SeqCst);
        Signal {
            notify: Arc::new(Notify::new()),
            generation: AtomicU64::new(now),
            decisive: AtomicU64::new(now),
        }
    }

    /// A wake-up registration that owns its `Notify`, so it can be kept across the steps of a
    /// stream (a `Notified` borrows the signal). `enable()` it before reading what it guards.
    pub fn notified_owned(&self) -> tokio::sync::futures::OwnedNotified {
        self.notify.clone().notified_owned()
    }

    /// The generation now. A read started after this was taken sees every change announced up
    /// to it (a change moves the generation on only after it committed).
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// The generation of the last change that may have ended the run. A wait for the end that
    /// took it before a read need not read again until it moves: every change between was a
    /// step's progress.
    pub fn decisive(&self) -> u64 {
        self.decisive.load(Ordering::SeqCst)
    }

    fn fire(&self, decisive: bool) {
        let g = GENERATIONS.fetch_add(1, Ordering::SeqCst) + 1;
        if decisive {
            self.decisive.store(g, Ordering::SeqCst);
        }
        self.generation.store(g, Ordering::SeqCst);
        self.notify.notify_waiters();
    }
}

impl std::ops::Deref for Signal {
    type Target = Notify;
    fn deref(&self) -> &Notify {
        &self.notify
    }
}

/// Most events the hand-off keeps for a relay that has not taken them; past it, commits are
/// announced without their events and the relay reads them from the outbox.
const HANDOFF_CAP: usize = 10_000;

/// Events this process committed, handed to its relay with the seqs they were committed under,
/// so the relay publishes them to Redis without reading them back from the outbox: that read,
/// one per commit, was half of the relay's statements. The outbox stays the truth: a handed
/// event is committed and unrelayed there until the relay marks it, so a crash or a failed
/// publication loses nothing.
#[derive(Debug, Default)]
struct Handoff {
    /// A relay takes what is handed (it opened the hand-off); until then nothing is kept.
    open: AtomicBool,
    events: Mutex<Vec<EventRecord>>,
    /// A commit of this process was announced without its events: the relay reads the outbox.
    unhanded: AtomicBool,
    /// Each run's latest event as this process committed and handed it, while nothing else is
    /// known to have written to the run since (see [`Notifier::latest_seq`]).
    latest: Mutex<HashMap<RunId, u64>>,
}

/// What the relay takes from the hand-off ([`Notifier::take_handed`]).
#[derive(Debug, Default)]
pub struct Handed {
    /// Events committed since the last take, each run's in seq order.
    pub events: Vec<EventRecord>,
    /// Some commit since the last take was announced without its events (or the hand-off was
    /// full): what it wrote is only in the outbox.
    pub unhanded: bool,
}

/// Per-run wake-up registry, the process's "a job was queued" signal, and the hand-off of
/// committed events to the relay.
#[derive(Debug)]
pub struct Notifier {
    runs: Mutex<HashMap<RunId, Weak<Signal>>>,
    handoff: Handoff,
    /// Moves on whenever this process queued a job that can start now: its workers fetch at
    /// once instead of at their next poll. A watch, so every worker hears each change (and one
    /// made while it was busy), and none takes another's wake-up.
    jobs: tokio::sync::watch::Sender<u64>,
}

impl Default for Notifier {
    fn default() -> Self {
        Notifier {
            runs: Default::default(),
            handoff: Handoff::default(),
            jobs: tokio::sync::watch::Sender::new(0),
        }
    }
}

impl Notifier {
    /// The run's signal; keep the `Arc` while waiting. Create the `notified()` future (and
    /// `enable()` it) *before* reading the state it guards, so no wake-up falls in between.
    pub fn subscribe(&self, run: RunId) -> Arc<Signal> {
        let mut map = self.runs.lock().unwrap();
        if let Some(n) = map.get(&run).and_then(Weak::upgrade) {
            return n;
        }
        if map.len() >= 1024 {
            map.retain(|_, w| w.strong_count() > 0);
        }
        let n = Arc::new(Signal::new());
        map.insert(run, Arc::downgrade(&n));
        n
    }

    /// Wakes everyone waiting on the run, and everyone waiting on any run.
    pub fn notify(&self, run: RunId) {
        self.unhanded(run);
        self.fire(run, true, true)
    }

    /// [`Notifier::notify`] for a commit that cannot have ended the run (a step's checkpoint):
    /// streams read it, waits for the run's end sleep on.
    pub fn progress(&self, run: RunId) {
        self.unhanded(run);
        self.fire(run, false, true)
    }

    /// [`Notifier::notify`] (`decisive`) or [`Notifier::progress`] for a commit whose events
    /// are `events`, as committed: they are handed to this process's relay, if it has one (a
    /// process without a relay never opens the hand-off, and `events` is not called).
    pub fn committed(&self, run: RunId, decisive: bool, events: impl FnOnce() -> Vec<EventRecord>) {
        if self.handoff.open.load(Ordering::SeqCst) {
            let events = events();
            {
                let mut latest = self.handoff.latest.lock().unwrap();
                match events.last() {
                    // A run's end: nothing follows it.
                    Some(_) if decisive => drop(latest.remove(&run)),
                    Some(e) => {
                        if latest.len() >= HANDOFF_CAP {
                            latest.clear();
                        }
                        latest.insert(run, e.seq);
                    }
                    None => {}
                }
            }
            let mut kept = self.handoff.events.lock().unwrap();
            if kept.len() < HANDOFF_CAP {
                kept.extend(events);
            } else {
                self.handoff.unhanded.store(true, Ordering::SeqCst);
            }
        }
        self.fire(run, decisive, true)
    }

    /// A commit of `run` was announced without its events: the relay must read the outbox, and
    /// the run's latest seq is no longer known here.
    fn unhanded(&self, run: RunId) {
        self.handoff.unhanded.store(true, Ordering::SeqCst);
        self.forget_seq(run);
    }

    /// Forgets `run`'s latest seq: another process wrote to it (a message sent to it, a
    /// cancel). Wake-ups heard for a run's progress are not that: they are mostly this
    /// process's own relay's, coming back.
    pub fn forget_seq(&self, run: RunId) {
        if self.handoff.open.load(Ordering::SeqCst) {
            self.handoff.latest.lock().unwrap().remove(&run);
        }
    }

    /// The seq of `run`'s latest event, when this process committed it and handed it over
    /// ([`Notifier::committed`]) and has heard of no other write to the run since: what a
    /// token-delta sink follows, known without reading the run. `None` means "read it".
    pub fn latest_seq(&self, run: RunId) -> Option<u64> {
        self.handoff.latest.lock().unwrap().get(&run).copied()
    }

    /// Says a relay takes this process's committed events from now on ([`Notifier::committed`]).
    pub fn open_handoff(&self) {
        self.handoff.unhanded.store(true, Ordering::SeqCst);
        self.handoff.open.store(true, Ordering::SeqCst);
    }

    /// The events handed since the last take, and whether some commit was announced without
    /// them.
    pub fn take_handed(&self) -> Handed {
        let events = std::mem::take(&mut *self.handoff.events.lock().unwrap());
        Handed {
            events,
            unhanded: self.handoff.unhanded.swap(false, Ordering::SeqCst),
        }
    }

    /// Wakes the run's waiters for a change another process made and announced (over Redis or
    /// PostgreSQL's NOTIFY); `decisive` as for [`Notifier::notify`] against
    /// [`Notifier::progress`]. Those waiting on any run are not woken: they relay this
    /// process's own commits, and another process's were relayed by that process.
    pub fn heard(&self, run: RunId, decisive: bool) {
        self.fire(run, decisive, false)
    }

    /// Wakes the run's waiters, and with `local` (a commit of this process) those waiting on
    /// any run.
    fn fire(&self, run: RunId, decisive: bool, local: bool) {
        let (n, all) = {
            let map = self.runs.lock().unwrap();
            (
                map.get(&run).and_then(Weak::upgrade),
                map.get(&ANY).filter(|_| local).and_then(Weak::upgrade),
            )
        };
        if let Some(n) = n {
            n.fire(decisive);
        }
        if let Some(all) = all {
            all.fire(true);
        }
    }

    /// Wakes on a change to any run (the relay uses it to publish promptly).
    pub fn subscribe_all(&self) -> Arc<Signal> {
        self.subscribe(ANY)
    }

    /// Announces a job that can start now to this process's workers.
    pub fn job_queued(&self) {
        self.jobs.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Yields whenever [`Notifier::job_queued`] was called since the last item (several calls
    /// in between yield once: a worker's fetch takes what there is).
    pub fn jobs_queued(&self) -> impl futures::Stream<Item = ()> + Send + 'static {
        let mut rx = self.jobs.subscribe();
        rx.mark_unchanged();
        futures::stream::unfold(rx, |mut rx| async move {
            rx.changed().await.ok()?;
            Some(((), rx))
        })
    }
}

/// A waiter's watch on one run: its wake-up registration and its re-check timer, kept for as
/// long as it waits (across timed re-checks and while a stream writes its events). The
/// registration is renewed the moment it fires, before the read it guards, so a commit wakes
/// a run's waiters in the order they last woke: none is put behind the others by its own timer
/// or by the time it spent writing.
pub struct Watch {
    signal: Arc<Signal>,
    changed: std::pin::Pin<Box<tokio::sync::futures::OwnedNotified>>,
    recheck: std::pin::Pin<Box<tokio::time::Sleep>>,
    every: std::time::Duration,
    age: std::time::Duration,
}

impl Watch {
    /// Watches `signal`, re-checking every `every` for writers in other processes (who are not
    /// heard here); a re-check accepts a shared read at most `age` old.
    pub fn new(signal: Arc<Signal>, every: std::time::Duration, age: std::time::Duration) -> Self {
        let mut changed = Box::pin(signal.notified_owned());
        changed.as_mut().enable();
        Watch {
            signal,
            changed,
            recheck: Box::pin(tokio::time::sleep(every)),
            every,
            age,
        }
    }

    /// What the next read must satisfy: the generation now, and `not_before`.
    pub fn fresh(&self, not_before: Option<Instant>) -> Fresh {
        Fresh {
            generation: self.signal.generation(),
            not_before,
        }
    }

    /// The watched signal's [`Signal::decisive`] generation now.
    pub fn decisive(&self) -> u64 {
        self.signal.decisive()
    }

    /// Sleeps until a commit here or the re-check; returns the `not_before` for the next read
    /// (`None` after a commit: its generation is enough).
    pub async fn next(&mut self) -> Option<Instant> {
        tokio::select! {
            _ = self.changed.as_mut() => {
                self.changed = Box::pin(self.signal.notified_owned());
                self.changed.as_mut().enable();
                None
            }
            _ = self.recheck.as_mut() => {
                self.recheck.as_mut().reset(tokio::time::Instant::now() + self.every);
                Instant::now().checked_sub(self.age)
            }
        }
    }
}

/// What a caller of [`SharedReads::read`] needs of a read to share it.
#[derive(Clone, Copy, Debug)]
pub struct Fresh {
    /// The read must have started at or after this generation of the run's signal (a caller
    /// woken by a commit passes the generation it saw on waking).
    pub generation: u64,
    /// And at or after this instant (a caller with no wake-up to go by, such as a timed
    /// re-check for writers in other processes, passes when it decided to look again).
    pub not_before: Option<Instant>,
}

struct Slot<V> {
    generation: u64,
    started: Instant,
    cell: Arc<OnceCell<V>>,
}

/// Single-flight reads: callers that need the same thing, fresh enough, share one read and its
/// result. This is what lets a run's end reach a thousand open waits and streams with a
/// handful of database reads instead of a thousand. A failed read is not shared: each caller
/// then tries on its own.
pub struct SharedReads<K, V> {
    slots: Mutex<HashMap<K, Slot<V>>>,
}

impl<K, V> Default for SharedReads<K, V> {
    fn default() -> Self {
        SharedReads {
            slots: Mutex::new(HashMap::new()),
        }
    }
}

/// Completed reads kept for later callers, at most; beyond it the oldest half goes.
const KEEP: usize = 4096;

impl<K: Eq + Hash + Clone, V: Clone> SharedReads<K, V> {
    /// The value of `key`, from a read that satisfies `fresh` (joining one in flight or done),
    /// or from a new read by `f`. Also returns when the read that answered started.
    pub async fn read<F, Fut, E>(&self, key: K, fresh: Fresh, f: F) -> Result<(V, Instant), E>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<V, E>>,
    {
        let (cell, started) = {
            let mut slots = self.slots.lock().unwrap();
            match slots.get(&key) {
                Some(s)
                    if s.generation >= fresh.generation
                        && fresh.not_before.is_none_or(|nb| s.started >= nb) =>
                {
                    (s.cell.clone(), s.started)
                }
                _ => {
                    if slots.len() >= KEEP {
                        let mut ages: Vec<Instant> = slots.values().map(|s| s.started).collect();
                        ages.sort();
                        let cut = ages[ages.len() / 2];
                        slots.retain(|_, s| s.started > cut);
                    }
                    let slot = Slot {
                        generation: fresh.generation,
                        started: Instant::now(),
                        cell: Arc::new(OnceCell::new()),
                    };
                    let out = (slot.cell.clone(), slot.started);
                    slots.insert(key, slot);
                    out
                }
            }
        };
        let v = cell.get_or_try_init(f).await?;
        Ok((v.clone(), started))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    fn records(run: RunId, seqs: std::ops::RangeInclusive<u64>) -> Vec<EventRecord> {
        seqs.map(|seq| EventRecord {
            seq,
            kind: "step.completed".into(),
            run_id: run,
            created_at: chrono::Utc::now(),
            data: serde_json::json!({}),
        })
        .collect()
    }

    #[test]
    fn the_hand_off_keeps_events_only_for_an_open_relay_and_knows_what_it_saw_whole() {
        let n = Notifier::default();
        let (a, b) = (RunId::new(), RunId::new());
        // No relay: nothing kept, nothing known.
        n.committed(a, false, || records(a, 1..=2));
        assert!(n.take_handed().events.is_empty());
        assert_eq!(n.latest_seq(a), None);
        // A relay opens: its first take reads the outbox, then what commits hand it.
        n.open_handoff();
        assert!(n.take_handed().unhanded);
        n.committed(a, false, || records(a, 3..=4));
        n.committed(b, false, || records(b, 1..=1));
        let handed = n.take_handed();
        assert!(!handed.unhanded);
        assert_eq!(
            handed
                .events
                .iter()
                .map(|e| (e.run_id, e.seq))
                .collect::<Vec<_>>(),
            vec![(a, 3), (a, 4), (b, 1)]
        );
        assert_eq!((n.latest_seq(a), n.latest_seq(b)), (Some(4), Some(1)));
        // A commit announced without its events: the outbox is read, the seq no longer known.
        n.progress(a);
        assert!(n.take_handed().unhanded);
        assert_eq!(n.latest_seq(a), None);
        // A progress wake-up heard (this process's own, echoed by Redis) keeps it; a write
        // from elsewhere (a message, a cancel) or the run's end forgets it.
        n.heard(b, false);
        assert_eq!(n.latest_seq(b), Some(1));
        n.forget_seq(b);
        assert_eq!(n.latest_seq(b), None);
        n.committed(b, false, || records(b, 2..=2));
        n.committed(b, true, || records(b, 3..=3));
        assert_eq!(n.latest_seq(b), None);
        assert_eq!(n.take_handed().events.len(), 2);
    }

    #[tokio::test]
    async fn callers_of_one_generation_share_a_read_and_a_newer_one_reads_again() {
        let reads: SharedReads<u32, u32> = SharedReads::default();
        let n = Notifier::default();
        let run = RunId(uuid::Uuid::now_v7());
        let sig = n.subscribe(run);
        let count = AtomicUsize::new(0);
        let read = || async {
            count.fetch_add(1, Ordering::SeqCst);
            tokio::task::yield_now().await;
            Ok::<_, ()>(7)
        };
        let g = sig.generation();
        let fresh = Fresh {
            generation: g,
            not_before: None,
        };
        let all = futures::future::join_all((0..100).map(|_| reads.read(1, fresh, read))).await;
        assert!(all.iter().all(|r| r.as_ref().unwrap().0 == 7));
        assert_eq!(
            count.load(Ordering::SeqCst),
            1,
            "a hundred callers, one read"
        );
        // A commit moves the generation on: the next caller does not get the old read.
        n.notify(run);
        assert!(sig.generation() > g);
        reads
            .read(
                1,
                Fresh {
                    generation: sig.generation(),
                    not_before: None,
                },
                read,
            )
            .await
            .unwrap();
        assert_eq!(count.load(Ordering::SeqCst), 2);
        // Nor does a caller that needs a read started after now.
        reads
            .read(
                1,
                Fresh {
                    generation: 0,
                    not_before: Some(Instant::now()),
                },
                read,
            )
            .await
            .unwrap();
        assert_eq!(count.load(Ordering::SeqCst), 3);
        // A failed read is not shared.
        let failing = || async { Err::<u32, &str>("down") };
        let g = sig.generation() + 1_000_000;
        assert!(
            reads
                .read(
                    2,
                    Fresh {
                        generation: g,
                        not_before: None
                    },
                    failing
                )
                .await
                .is_err()
        );
        assert_eq!(
            reads
                .read(
                    2,
                    Fresh {
                        generation: g,
                        not_before: None
                    },
                    || async { Ok::<_, &str>(9) }
                )
                .await
                .unwrap()
                .0,
            9
        );
    }

    #[tokio::test]
    async fn a_watch_hears_a_commit_made_while_it_was_not_waiting_and_rechecks_on_time() {
        let n = Notifier::default();
        let run = RunId(uuid::Uuid::now_v7());
        let every = std::time::Duration::from_millis(250);
        let mut watch = Watch::new(
            n.subscribe(run),
            every,
            std::time::Duration::from_millis(50),
        );
        let g = watch.fresh(None).generation;
        // A commit while the waiter is busy elsewhere (a stream writing) is not missed.
        n.notify(run);
        assert_eq!(watch.next().await, None, "woken by the commit");
        assert!(watch.fresh(None).generation > g);
        // No commit: the re-check comes after `every`, asking for a read at most 50 ms old.
        let t0 = tokio::time::Instant::now();
        assert!(watch.next().await.is_some(), "a timed re-check");
        assert!(t0.elapsed() >= every);
    }

    #[test]
    fn progress_and_changes_heard_from_elsewhere_move_only_what_they_should() {
        let n = Notifier::default();
        let run = RunId(uuid::Uuid::now_v7());
        let (sig, any) = (n.subscribe(run), n.subscribe_all());
        let (g, d, a) = (sig.generation(), sig.decisive(), any.generation());
        // A step's checkpoint: streams (and the relay) hear it, a wait for the end need not.
        n.progress(run);
        assert!(sig.generation() > g);
        assert_eq!(sig.decisive(), d);
        assert!(any.generation() > a);
        // Another process's change: this process's waiters hear it, its relay does not (it
        // relays this process's commits; that process relayed its own).
        let a = any.generation();
        n.heard(run, false);
        assert_eq!(sig.decisive(), d);
        n.heard(run, true);
        assert!(sig.decisive() > d);
        assert_eq!(any.generation(), a);
        // Any other commit here is decisive.
        let d = sig.decisive();
        n.notify(run);
        assert!(sig.decisive() > d);
    }

    #[test]
    fn a_signal_made_again_keeps_a_later_generation() {
        let n = Notifier::default();
        let run = RunId(uuid::Uuid::now_v7());
        let first = n.subscribe(run);
        n.notify(run);
        let g = first.generation();
        drop(first);
        assert!(n.subscribe(run).generation() >= g);
    }
}
