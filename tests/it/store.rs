//! The store's contract, checked directly on a real SQLite file: fencing, idempotent appends,
//! gap-free sequences, one active run per thread, and the lease lifecycle.

use std::time::Duration;

use serde_json::json;
use subagents::ids::{RunId, ThreadId};
use subagents::model::Message;
use subagents::queue::new_job_id;
use subagents::store::*;

async fn store() -> (SqliteStore, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let s = SqliteStore::connect(&format!("sqlite://{}", dir.path().join("s.db").display())).await.unwrap();
    (s, dir)
}

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

#[tokio::test]
async fn a_stale_epoch_cannot_write() {
    let (s, _d) = store().await;
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

#[tokio::test]
async fn appends_are_idempotent_and_sequences_gap_free() {
    let (s, _d) = store().await;
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

#[tokio::test]
async fn terminal_states_never_change() {
    let (s, _d) = store().await;
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

#[tokio::test]
async fn the_database_enforces_one_active_run_per_thread() {
    let (s, _d) = store().await;
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

#[tokio::test]
async fn enqueued_runs_wait_for_the_thread_and_go_in_order() {
    let (s, _d) = store().await;
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

#[tokio::test]
async fn idempotency_keys_return_the_first_run() {
    let (s, _d) = store().await;
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

#[tokio::test]
async fn runs_whose_workers_keep_dying_fail_as_lost() {
    let (s, _d) = store().await;
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

#[tokio::test]
async fn orphans_are_found_after_the_grace_period() {
    let (s, _d) = store().await;
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

#[tokio::test]
async fn status_transitions_are_checked_in_one_place() {
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
