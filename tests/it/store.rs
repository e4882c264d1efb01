//! The store's contract — fencing, idempotent appends, gap-free sequences, one active run per
//! thread, the lease lifecycle, enqueue order, idempotency keys, orphans — as one conformance
//! suite run against both backends: a real SQLite file and a fresh PostgreSQL database.

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use subagents::ids::{RunId, ThreadId};
use subagents::model::Message;
use subagents::queue::new_job_id;
use subagents::store::*;

/// A backend under test; keeps its temp dir alive.
pub struct Backend {
    pub store: Arc<dyn Store>,
    _dir: Option<tempfile::TempDir>,
}

impl std::ops::Deref for Backend {
    type Target = dyn Store;
    fn deref(&self) -> &(dyn Store + 'static) {
        self.store.as_ref()
    }
}

pub async fn sqlite() -> Backend {
    let dir = tempfile::tempdir().unwrap();
    let s = SqliteStore::connect(&format!("sqlite://{}", dir.path().join("s.db").display())).await.unwrap();
    Backend { store: Arc::new(s), _dir: Some(dir) }
}

pub async fn postgres() -> Backend {
    let url = crate::support::fresh_postgres_database().await;
    Backend { store: Arc::new(PgStore::connect(&url).await.unwrap()), _dir: None }
}

/// Generates one test per backend from one async fn taking the backend.
macro_rules! conformance {
    ($($name:ident),* $(,)?) => {
        mod sqlite_backend {
            $(#[tokio::test] async fn $name() { super::$name(super::sqlite().await).await })*
        }
        mod postgres_backend {
            $(#[tokio::test] async fn $name() { super::$name(super::postgres().await).await })*
        }
    };
}

conformance!(
    a_stale_epoch_cannot_write,
    appends_are_idempotent_and_sequences_gap_free,
    terminal_states_never_change,
    the_database_enforces_one_active_run_per_thread,
    enqueued_runs_wait_for_the_thread_and_go_in_order,
    idempotency_keys_return_the_first_run,
    runs_whose_workers_keep_dying_fail_as_lost,
    orphans_are_found_after_the_grace_period,
    parked_runs_are_claimed_again_and_cancelled_at_once,
    listing_and_tree_queries,
);

fn new_run(thread: &ThreadId) -> NewRun {
    NewRun {
        id: RunId::new(),
        thread_id: thread.clone(),
        owner: "o".into(),
        agent: "general-purpose".into(),
        input: "hi".into(),
        metadata: json!({}),
        limits: RunLimits { max_steps: 5, timeout_secs: 60, max_total_tokens: None, max_total_steps: None },
        parent_run_id: None,
        tree: TreePosition::default(),
        job_id: new_job_id(),
        if_busy: IfBusy::Reject,
        idempotency_key: None,
    }
}

fn msg(run: RunId, key: &str) -> NewMessage {
    NewMessage { step: 1, key: format!("{run}:{key}"), message: Message::User { content: key.into() } }
}

async fn a_stale_epoch_cannot_write(s: Backend) {
    let t = ThreadId::generate();
    let run = s.create_run(new_run(&t)).await.unwrap().run;
    let Claim::Acquired(old, _) = s.claim_run(run.id, "w1", Duration::from_millis(100), 5).await.unwrap() else { panic!() };
    // Not claimable while the lease is valid.
    assert!(matches!(s.claim_run(run.id, "w2", Duration::from_secs(10), 5).await.unwrap(), Claim::NotClaimable(Some(RunStatus::Running))));
    tokio::time::sleep(Duration::from_millis(150)).await;
    let Claim::Acquired(new, rec) = s.claim_run(run.id, "w2", Duration::from_secs(10), 5).await.unwrap() else { panic!() };
    assert_eq!(new.epoch, old.epoch + 1);
    assert_eq!(rec.attempts, 2);
    let err = s.checkpoint(&old, Checkpoint { messages: vec![msg(run.id, "a")], ..Default::default() }).await.unwrap_err();
    assert!(matches!(err, StoreError::LeaseLost(_)), "{err}");
    assert!(matches!(s.renew_lease(&old).await.unwrap_err(), StoreError::LeaseLost(_)));
    // The zombie's write left nothing behind.
    assert!(s.thread_messages(&t).await.unwrap().is_empty());
    s.checkpoint(&new, Checkpoint { messages: vec![msg(run.id, "a")], ..Default::default() }).await.unwrap();
    assert_eq!(s.thread_messages(&t).await.unwrap().len(), 1);
}

async fn appends_are_idempotent_and_sequences_gap_free(s: Backend) {
    let t = ThreadId::generate();
    let run = s.create_run(new_run(&t)).await.unwrap().run;
    let Claim::Acquired(lease, _) = s.claim_run(run.id, "w", Duration::from_secs(10), 5).await.unwrap() else { panic!() };
    for _ in 0..2 {
        s.checkpoint(
            &lease,
            Checkpoint {
                messages: vec![msg(run.id, "a"), msg(run.id, "b")],
                events: vec![NewEvent::new(EventKind::StepStarted, json!({})), NewEvent::new(EventKind::StepCompleted, json!({}))],
                ..Default::default()
            },
        )
        .await
        .unwrap();
    }
    assert_eq!(s.thread_messages(&t).await.unwrap().len(), 2, "same keys appended once");
    let ev = s.events_after(run.id, 0, 100).await.unwrap();
    assert_eq!(ev.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2, 3, 4, 5, 6]);
    assert_eq!(s.events_after(run.id, 4, 1).await.unwrap()[0].seq, 5, "cursor and limit");
}

async fn terminal_states_never_change(s: Backend) {
    let t = ThreadId::generate();
    let run = s.create_run(new_run(&t)).await.unwrap().run;
    let Claim::Acquired(lease, _) = s.claim_run(run.id, "w", Duration::from_secs(10), 5).await.unwrap() else { panic!() };
    s.checkpoint(&lease, Checkpoint { finish: Some(Finish::Succeeded { result: "r".into(), forced: false }), ..Default::default() })
        .await
        .unwrap();
    let again = s.checkpoint(&lease, Checkpoint { finish: Some(Finish::Cancelled), ..Default::default() }).await;
    assert!(matches!(again, Err(StoreError::LeaseLost(_))));
    assert!(matches!(s.claim_run(run.id, "w2", Duration::from_secs(1), 5).await.unwrap(), Claim::NotClaimable(Some(RunStatus::Succeeded))));
    assert_eq!(s.request_cancel(run.id).await.unwrap(), CancelOutcome::AlreadyFinished(RunStatus::Succeeded));
    let r = s.get_run(run.id).await.unwrap().unwrap();
    assert_eq!((r.status, r.result.as_deref()), (RunStatus::Succeeded, Some("r")));
    // The thread is free again.
    s.create_run(new_run(&t)).await.unwrap();
}

async fn the_database_enforces_one_active_run_per_thread(s: Backend) {
    let t = ThreadId::generate();
    let first = s.create_run(new_run(&t)).await.unwrap().run;
    match s.create_run(new_run(&t)).await.unwrap_err() {
        StoreError::Busy { active_run, .. } => assert_eq!(active_run, first.id),
        e => panic!("{e}"),
    }
    let mut other = new_run(&t);
    other.owner = "someone-else".into();
    assert!(matches!(s.create_run(other).await.unwrap_err(), StoreError::ThreadOwnedElsewhere(_)));
}

async fn enqueued_runs_wait_for_the_thread_and_go_in_order(s: Backend) {
    let t = ThreadId::generate();
    let first = s.create_run(new_run(&t)).await.unwrap().run;
    let mut n = new_run(&t);
    n.if_busy = IfBusy::Enqueue;
    let second = s.create_run(n).await.unwrap().run;
    let mut n = new_run(&t);
    n.if_busy = IfBusy::Enqueue;
    let third = s.create_run(n).await.unwrap().run;
    // Only the oldest queued run of the thread is claimable.
    assert!(matches!(s.claim_run(third.id, "w", Duration::from_secs(10), 5).await.unwrap(), Claim::NotClaimable(Some(RunStatus::Queued))));
    let Claim::Acquired(l1, _) = s.claim_run(first.id, "w", Duration::from_secs(10), 5).await.unwrap() else { panic!() };
    // While the first runs, the second waits.
    assert!(matches!(s.claim_run(second.id, "w", Duration::from_secs(10), 5).await.unwrap(), Claim::NotClaimable(Some(RunStatus::Queued))));
    assert!(s.orphans(Duration::ZERO).await.unwrap().iter().all(|o| o.run_id != second.id), "a blocked run is not an orphan");
    s.checkpoint(&l1, Checkpoint { finish: Some(Finish::Cancelled), ..Default::default() }).await.unwrap();
    assert_eq!(s.next_queued(&t).await.unwrap(), Some(second.id));
    assert!(matches!(s.claim_run(second.id, "w", Duration::from_secs(10), 5).await.unwrap(), Claim::Acquired(..)));
}

async fn idempotency_keys_return_the_first_run(s: Backend) {
    let mut a = new_run(&ThreadId::generate());
    a.idempotency_key = Some("k1".into());
    let first = s.create_run(a.clone()).await.unwrap();
    assert!(!first.existing);
    a.id = RunId::new();
    let again = s.create_run(a).await.unwrap();
    assert!(again.existing);
    assert_eq!(again.run.id, first.run.id);
    // Keys are per owner.
    let mut b = new_run(&ThreadId::generate());
    b.idempotency_key = Some("k1".into());
    b.owner = "other".into();
    assert!(!s.create_run(b).await.unwrap().existing);
}

async fn runs_whose_workers_keep_dying_fail_as_lost(s: Backend) {
    let run = s.create_run(new_run(&ThreadId::generate())).await.unwrap().run;
    for _ in 0..2 {
        assert!(matches!(s.claim_run(run.id, "w", Duration::from_millis(10), 2).await.unwrap(), Claim::Acquired(..)));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(matches!(s.claim_run(run.id, "w", Duration::from_millis(10), 2).await.unwrap(), Claim::GaveUp));
    let r = s.get_run(run.id).await.unwrap().unwrap();
    assert_eq!(r.status, RunStatus::Failed);
    assert_eq!(r.error.unwrap().kind, ErrorKind::Lost);
    let ev = s.events_after(run.id, 0, 100).await.unwrap();
    assert_eq!(ev.last().unwrap().kind, "run.failed");
    assert_eq!(ev.iter().map(|e| e.seq).collect::<Vec<_>>(), (1..=ev.len() as u64).collect::<Vec<_>>());
}

async fn orphans_are_found_after_the_grace_period(s: Backend) {
    let queued = s.create_run(new_run(&ThreadId::generate())).await.unwrap().run;
    let running = s.create_run(new_run(&ThreadId::generate())).await.unwrap().run;
    let Claim::Acquired(lease, _) = s.claim_run(running.id, "w", Duration::from_millis(10), 5).await.unwrap() else { panic!() };
    assert!(s.orphans(Duration::from_secs(60)).await.unwrap().is_empty(), "fresh enqueues are left alone");
    tokio::time::sleep(Duration::from_millis(50)).await;
    let found = s.orphans(Duration::from_millis(1)).await.unwrap();
    // The queued run's job was never pushed; the running one's lease expired.
    assert!(found.iter().any(|o| o.run_id == queued.id && o.status == RunStatus::Queued), "{found:?}");
    assert!(found.iter().any(|o| o.run_id == running.id && o.status == RunStatus::Running), "{found:?}");
    s.renew_lease(&lease).await.unwrap();
    s.set_job(queued.id, &new_job_id()).await.unwrap();
    let found = s.orphans(Duration::from_secs(1)).await.unwrap();
    assert!(found.is_empty(), "renewed and re-enqueued runs are not orphans: {found:?}");
}

#[test]
fn status_transitions_are_checked_in_one_place() {
    use RunStatus::*;
    assert!(Queued.can_become(Running));
    assert!(Running.can_become(Succeeded));
    assert!(!Succeeded.can_become(Running));
    assert!(!Cancelled.can_become(Queued));
    assert!(!Queued.can_become(Succeeded));
    for s in [Succeeded, Failed, Cancelled] {
        for to in [Queued, Running, Waiting, Succeeded, Failed, Cancelled] {
            assert!(!s.can_become(to), "{s:?} -> {to:?}");
        }
    }
}

async fn parked_runs_are_claimed_again_and_cancelled_at_once(s: Backend) {
    let run = s.create_run(new_run(&ThreadId::generate())).await.unwrap().run;
    let Claim::Acquired(lease, _) = s.claim_run(run.id, "w", Duration::from_secs(10), 5).await.unwrap() else { panic!() };
    s.checkpoint(&lease, Checkpoint { park: Some(Some(12345)), ..Default::default() }).await.unwrap();
    let parked = s.get_run(run.id).await.unwrap().unwrap();
    assert_eq!((parked.status, parked.wake_at), (RunStatus::Waiting, Some(12345)));
    // A parked run holds no lease: the old epoch cannot write.
    assert!(matches!(s.checkpoint(&lease, Checkpoint::default()).await, Err(StoreError::LeaseLost(_))));
    let Claim::Acquired(again, rec) = s.claim_run(run.id, "w2", Duration::from_secs(10), 5).await.unwrap() else { panic!() };
    assert_eq!(rec.claimed_from, Some(RunStatus::Waiting));
    let ev = s.events_after(run.id, 0, 100).await.unwrap();
    assert_eq!(ev.last().unwrap().kind, "run.resumed");
    s.checkpoint(&again, Checkpoint { park: Some(None), ..Default::default() }).await.unwrap();
    assert_eq!(s.request_cancel(run.id).await.unwrap(), CancelOutcome::Cancelled, "parked runs are cancelled at once");
    assert_eq!(s.get_run(run.id).await.unwrap().unwrap().status, RunStatus::Cancelled);
    let d1 = s.wait_deadline("k", 100).await.unwrap();
    let d2 = s.wait_deadline("k", 999).await.unwrap();
    assert_eq!((d1, d2), (100, 100), "a deadline is fixed at the first attempt");
}

async fn listing_and_tree_queries(s: Backend) {
    let t = ThreadId::generate();
    let root = s.create_run(new_run(&t)).await.unwrap().run;
    let mut c = new_run(&ThreadId::generate());
    c.parent_run_id = Some(root.id);
    c.tree = TreePosition { root_run_id: Some(root.id), depth: 1, detached: false };
    let child = s.create_run(c).await.unwrap().run;
    let Claim::Acquired(lease, _) = s.claim_run(child.id, "w", Duration::from_secs(10), 5).await.unwrap() else { panic!() };
    let usage = subagents::model::Usage { prompt_tokens: 10, completion_tokens: 5 };
    s.checkpoint(&lease, Checkpoint { step: Some(2), usage, ..Default::default() }).await.unwrap();
    let (tree, steps) = s.tree_usage(root.id).await.unwrap();
    assert_eq!((tree.total(), steps), (15, 2));
    assert_eq!(s.children(root.id).await.unwrap().iter().map(|r| r.id).collect::<Vec<_>>(), [child.id]);
    let all = s.list_runs("o", &RunFilter::default(), 10).await.unwrap();
    assert_eq!(all.iter().map(|r| r.id).collect::<Vec<_>>(), [child.id, root.id], "newest first");
    let running = s.list_runs("o", &RunFilter { status: vec![RunStatus::Running], ..Default::default() }, 10).await.unwrap();
    assert_eq!(running.len(), 1);
    let page2 = s.list_runs("o", &RunFilter { before: Some(child.id), ..Default::default() }, 10).await.unwrap();
    assert_eq!(page2.iter().map(|r| r.id).collect::<Vec<_>>(), [root.id]);
    assert!(s.list_runs("someone-else", &RunFilter::default(), 10).await.unwrap().is_empty());
    let counts = s.status_counts().await.unwrap();
    assert!(counts.contains(&(RunStatus::Queued, 1)) && counts.contains(&(RunStatus::Running, 1)), "{counts:?}");
    assert_eq!(s.queue_position(root.id).await.unwrap(), 0);
    s.append_events(root.id, vec![NewEvent::new(EventKind::ChildFinished, json!({}))]).await.unwrap();
    let ev = s.events_after(root.id, 0, 10).await.unwrap();
    assert_eq!(ev.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2]);
    assert!(s.get_thread(&t).await.unwrap().is_some());
    assert_eq!(s.next_queued(&t).await.unwrap(), Some(root.id));
}
