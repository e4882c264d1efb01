//! Group commit: the progress checkpoints of many runs that arrive while a commit is under way
//! go to the database together, in one transaction, instead of one transaction each.
//!
//! Nothing about a checkpoint changes: each item is still fenced by its own lease (an item
//! whose lease is gone is skipped and answered [`StoreError::LeaseLost`], the others commit),
//! and a caller hears back only after the transaction holding its item committed, so every
//! step is still durable before the next one starts. What changes is the cost: one commit (one
//! WAL write, one lock hand-over on SQLite) carries a whole batch. Nobody waits for a batch to
//! fill: a committer takes what is queued the moment it is free, so a lone run commits at once
//! and a busy fleet commits in groups as large as the database is slow.
//!
//! Terminal checkpoints do not come here: they carry effects on other runs (the parent, the
//! waiters) and commit on their own.
//!
//! Lease renewals get the same treatment ([`GroupRenew`]): one fenced statement renews every
//! lease queued, each still under its own epoch.

use std::sync::OnceLock;

use tokio::sync::{Mutex, mpsc, oneshot};

use super::{Checkpoint, Ending, Lease, LeaseStatus, Result, StoreError};
use crate::ids::RunId;

/// Most checkpoints in one transaction.
pub(crate) const MAX_BATCH: usize = 64;

/// How a backend commits progress: one checkpoint alone (also the fallback when a batch
/// fails), or many in one transaction.
pub(crate) trait Progress: Clone + Send + Sync + 'static {
    /// Commits one checkpoint and announces it (see [`super::Checkpoints::checkpoint`]): what
    /// a terminal one saw of the runs its end touches.
    fn commit_one(
        &self,
        lease: Lease,
        cp: Checkpoint,
    ) -> impl Future<Output = Result<Option<Ending>>> + Send;
    /// Commits non-terminal checkpoints in one transaction: where each item's events landed,
    /// `None` where its lease was gone (that item wrote nothing). An error means nothing
    /// committed.
    fn commit_many(
        &self,
        items: &[(Lease, Checkpoint)],
    ) -> impl Future<Output = Result<Vec<Option<Landed>>>> + Send;
    /// Commits alone a checkpoint whose earlier commit failed in a way that can hide success:
    /// the database committed, then the connection broke before the answer came back. Committing
    /// it again would write its events twice (its messages are idempotent by key), so a backend
    /// that can tell a checkpoint landed answers it done instead. The default cannot tell.
    fn recommit_one(
        &self,
        lease: Lease,
        cp: Checkpoint,
    ) -> impl Future<Output = Result<()>> + Send {
        async move { self.commit_one(lease, cp).await.map(drop) }
    }
    /// Tells this process's waiters (and its relay, with the events) that `cp`, a step of
    /// `run`, committed where `landed` says (progress: a group holds no terminal checkpoint).
    fn announce(&self, run: RunId, cp: &Checkpoint, landed: Landed);
    /// The backend as one committer task uses it. A committer commits one transaction at a
    /// time, so what this returns may keep state no other task touches: PostgreSQL's keeps a
    /// connection of its own across batches (see `postgres::Commits`).
    fn for_committer(&self) -> Self {
        self.clone()
    }
}

/// Where a committed checkpoint's events landed: the seq of its last event and their commit
/// time (see [`Checkpoint::records`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Landed {
    pub(crate) last: i64,
    pub(crate) at: chrono::DateTime<chrono::Utc>,
}

impl Landed {
    /// A commit time for events committed now, at the precision both databases keep
    /// (PostgreSQL's is the microsecond), so an event handed to the relay from memory is the
    /// outbox's row to the byte.
    pub(crate) fn stamp() -> chrono::DateTime<chrono::Utc> {
        use chrono::SubsecRound;
        chrono::Utc::now().trunc_subsecs(6)
    }
}

struct Item {
    lease: Lease,
    cp: Checkpoint,
    reply: oneshot::Sender<Result<()>>,
}

/// The queue in front of a backend's committers, started on first use (in the caller's
/// runtime).
#[derive(Debug)]
pub(crate) struct GroupCommit {
    committers: usize,
    queue: OnceLock<mpsc::UnboundedSender<Item>>,
}

impl GroupCommit {
    /// `committers` transactions may be under way at once (one on both backends: SQLite has a
    /// single writer, and on PostgreSQL one committer makes the largest batches; see
    /// `postgres::COMMITTERS`).
    pub(crate) fn new(committers: usize) -> Self {
        GroupCommit {
            committers: committers.max(1),
            queue: OnceLock::new(),
        }
    }

    /// Commits `cp` with whatever else is queued; returns once it is durable.
    pub(crate) async fn commit<P: Progress>(
        &self,
        backend: &P,
        lease: &Lease,
        cp: Checkpoint,
    ) -> Result<Option<Ending>> {
        if cp.finish.is_some() {
            return backend.commit_one(lease.clone(), cp).await;
        }
        let queue = self.queue.get_or_init(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            let rx = std::sync::Arc::new(Mutex::new(rx));
            for _ in 0..self.committers {
                tokio::spawn(committer(backend.for_committer(), rx.clone()));
            }
            tx
        });
        let (reply, answer) = oneshot::channel();
        if let Err(mpsc::error::SendError(item)) = queue.send(Item {
            lease: lease.clone(),
            cp,
            reply,
        }) {
            // The committers are gone (their runtime ended): commit alone.
            return backend.commit_one(item.lease, item.cp).await;
        }
        match answer.await {
            Ok(r) => r.map(|()| None),
            // The committer was dropped with the item (its runtime is ending): whether the item
            // committed is unknown, which is what a lost connection would say.
            Err(_) => Err(StoreError::Db(sqlx::Error::PoolClosed)),
        }
    }
}

async fn committer<P: Progress>(
    backend: P,
    queue: std::sync::Arc<Mutex<mpsc::UnboundedReceiver<Item>>>,
) {
    loop {
        let mut batch = Vec::new();
        {
            // One committer takes what is queued now; the others wait their turn for the next.
            let mut rx = queue.lock().await;
            let Some(first) = rx.recv().await else { return };
            batch.push(first);
            while batch.len() < MAX_BATCH {
                match rx.try_recv() {
                    Ok(item) => batch.push(item),
                    Err(_) => break,
                }
            }
        }
        if batch.len() == 1 {
            let item = batch.pop().expect("one item");
            let r = backend.commit_one(item.lease, item.cp).await;
            let _ = item.reply.send(r.map(drop));
            continue;
        }
        metrics::histogram!("subagents_group_commit_size").record(batch.len() as f64);
        let (replies, items): (Vec<_>, Vec<_>) = batch
            .into_iter()
            .map(|i| (i.reply, (i.lease, i.cp)))
            .unzip();
        match backend.commit_many(&items).await {
            Ok(applied) => {
                for ((reply, (lease, cp)), landed) in replies.into_iter().zip(&items).zip(applied) {
                    if let Some(landed) = landed {
                        backend.announce(lease.run_id, cp, landed);
                        let _ = reply.send(Ok(()));
                    } else {
                        let _ = reply.send(Err(StoreError::LeaseLost(lease.run_id)));
                    }
                }
            }
            Err(e) => {
                // Nothing committed (a deadlock), or, when the connection broke, possibly
                // everything: each item alone, unless it landed, so one item's trouble is its own.
                tracing::warn!(error = %e, size = items.len(), "a group commit failed; committing its items one by one");
                metrics::counter!("subagents_group_commit_fallbacks_total").increment(1);
                for (reply, (lease, cp)) in replies.into_iter().zip(items) {
                    let _ = reply.send(backend.recommit_one(lease, cp).await);
                }
            }
        }
    }
}

/// Most lease renewals in one statement.
pub(crate) const MAX_RENEWALS: usize = 512;

/// How a backend renews leases: many in one statement. Each lease is still fenced by its own
/// epoch; `None` where a lease was gone, else what the holder must hear (a cancel, messages).
pub(crate) trait Renewals: Clone + Send + Sync + 'static {
    fn renew_many(
        &self,
        leases: &[Lease],
    ) -> impl Future<Output = Result<Vec<Option<LeaseStatus>>>> + Send;
}

struct Renewal {
    lease: Lease,
    reply: oneshot::Sender<Result<Option<LeaseStatus>>>,
}

/// The queue in front of a backend's lease renewals. Every run in flight renews its lease
/// every third of its length, at least once a second (so a cancel made in another process is
/// seen within a second): with thousands in flight, one commit per renewal would take more of
/// the database than the steps do (10,000 runs in flight are 10,000 renewals a second). One renewer takes whatever is queued and renews it in one statement; a renewal is
/// answered only once that statement committed, so a heartbeat means what it did.
#[derive(Debug, Default)]
pub(crate) struct GroupRenew {
    queue: OnceLock<mpsc::UnboundedSender<Renewal>>,
}

impl GroupRenew {
    /// Renews `lease` with whatever else is queued: `Some(status)`, or `None` when
    /// the lease was gone.
    pub(crate) async fn renew<B: Renewals>(
        &self,
        backend: &B,
        lease: &Lease,
    ) -> Result<Option<LeaseStatus>> {
        let queue = self.queue.get_or_init(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            tokio::spawn(renewer(backend.clone(), rx));
            tx
        });
        let (reply, answer) = oneshot::channel();
        if let Err(mpsc::error::SendError(item)) = queue.send(Renewal {
            lease: lease.clone(),
            reply,
        }) {
            return Ok(backend
                .renew_many(std::slice::from_ref(&item.lease))
                .await?
                .pop()
                .flatten());
        }
        match answer.await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Db(sqlx::Error::PoolClosed)),
        }
    }
}

async fn renewer<B: Renewals>(backend: B, mut rx: mpsc::UnboundedReceiver<Renewal>) {
    loop {
        let Some(first) = rx.recv().await else { return };
        let mut batch = vec![first];
        while batch.len() < MAX_RENEWALS {
            match rx.try_recv() {
                Ok(r) => batch.push(r),
                Err(_) => break,
            }
        }
        // A run renews once at a time; should one appear twice, the later renewal waits for
        // the next statement (a statement must not update one row twice).
        let mut seen = std::collections::HashSet::new();
        let (now, later): (Vec<_>, Vec<_>) =
            batch.into_iter().partition(|r| seen.insert(r.lease.run_id));
        let leases: Vec<Lease> = now.iter().map(|r| r.lease.clone()).collect();
        metrics::histogram!("subagents_lease_renewal_batch_size").record(leases.len() as f64);
        match backend.renew_many(&leases).await {
            Ok(answers) => {
                for (r, a) in now.into_iter().zip(answers) {
                    let _ = r.reply.send(Ok(a));
                }
            }
            Err(e) => {
                // Nothing was renewed: every heartbeat hears the error and retries, as it
                // would after a failed statement of its own.
                let msg = e.to_string();
                for r in now {
                    let _ =
                        r.reply
                            .send(Err(StoreError::Db(sqlx::Error::Io(std::io::Error::other(
                                msg.clone(),
                            )))));
                }
            }
        }
        for r in later {
            let answer = backend
                .renew_many(std::slice::from_ref(&r.lease))
                .await
                .map(|mut v| v.pop().flatten());
            let _ = r.reply.send(answer);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex as StdMutex};

    use super::*;
    use crate::model::Message;
    use crate::store::NewMessage;

    /// A backend whose group commits land and then report an error, as when the connection
    /// breaks between the database's commit and its answer; it keeps every event it wrote.
    #[derive(Clone, Default)]
    struct LostAnswers {
        events: Arc<StdMutex<HashMap<RunId, Vec<String>>>>,
        keys: Arc<StdMutex<Vec<String>>>,
    }

    impl LostAnswers {
        fn write(&self, lease: &Lease, cp: &Checkpoint) {
            let mut keys = self.keys.lock().unwrap();
            for m in &cp.messages {
                if !keys.contains(&m.key) {
                    keys.push(m.key.clone());
                }
            }
            let mut events = self.events.lock().unwrap();
            events
                .entry(lease.run_id)
                .or_default()
                .extend(cp.events.iter().map(|e| e.kind().to_owned()));
        }
    }

    impl Progress for LostAnswers {
        async fn commit_one(&self, lease: Lease, cp: Checkpoint) -> Result<Option<Ending>> {
            self.write(&lease, &cp);
            Ok(None)
        }
        async fn commit_many(&self, items: &[(Lease, Checkpoint)]) -> Result<Vec<Option<Landed>>> {
            for (lease, cp) in items {
                self.write(lease, cp);
            }
            Err(StoreError::Db(sqlx::Error::Io(std::io::Error::other(
                "connection reset after the commit",
            ))))
        }
        async fn recommit_one(&self, lease: Lease, cp: Checkpoint) -> Result<()> {
            // What PostgreSQL's does: a checkpoint whose first message is there has landed.
            let landed = cp
                .messages
                .first()
                .is_some_and(|m| self.keys.lock().unwrap().contains(&m.key));
            if landed {
                Ok(())
            } else {
                self.commit_one(lease, cp).await.map(drop)
            }
        }
        fn announce(&self, _run: RunId, _cp: &Checkpoint, _landed: Landed) {}
    }

    /// A group whose commit landed but answered an error is not written a second time by the
    /// item-by-item fallback: every run's events appear once.
    #[tokio::test]
    async fn a_group_that_landed_without_an_answer_is_not_written_twice() {
        let backend = LostAnswers::default();
        let group = GroupCommit::new(1);
        let leases: Vec<Lease> = (0..20)
            .map(|_| Lease {
                run_id: RunId::new(),
                epoch: 1,
                owner: "w".into(),
                ttl: std::time::Duration::from_secs(30),
                child: false,
            })
            .collect();
        let commits = leases.iter().map(|lease| {
            let cp = Checkpoint {
                messages: vec![NewMessage {
                    step: 1,
                    key: format!("{}:1:assistant", lease.run_id),
                    message: Message::User {
                        content: "x".into(),
                    },
                }],
                events: vec![
                    crate::store::Event::StepCompleted(crate::domain::event::StepCompleted {
                        step: 1,
                    })
                    .into(),
                ],
                ..Default::default()
            };
            group.commit(&backend, lease, cp)
        });
        for r in futures::future::join_all(commits).await {
            r.expect("every caller hears its checkpoint is durable");
        }
        let events = backend.events.lock().unwrap();
        assert!(
            events.values().all(|e| e.len() == 1),
            "a checkpoint's events written twice: {events:?}"
        );
        assert_eq!(events.len(), 20);
    }
}
