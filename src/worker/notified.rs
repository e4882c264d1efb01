//! Jobs queued by another process, taken as their notification arrives (PostgreSQL).
//!
//! apalis's PostgreSQL trigger announces every new job on `apalis::job::insert` with its id.
//! apalis's own answer to it is a fetch: a transaction of three statements and a hop through
//! its stream for the job, then its ack (three more) after the handler, and an empty fetch or
//! two after that. Here a worker with a free slot takes the job it was told of and claims its
//! run in one fenced statement ([`crate::store::Claims::take_and_claim`]: only when apalis's
//! fetch would have taken that job: nothing else is waiting), runs it at once and settles the
//! job itself. Any other notification (no free slot, the queue has older work, another worker
//! was quicker) wakes apalis's fetch as before, which takes whatever is next in line, and a
//! job this process wrote itself is passed over ([`crate::store::Claims::started_here`]: its
//! run went to a worker here as it started, or its start woke the fetch). The poll stays as
//! the net for a notification lost while the listener reconnects.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::Local;
use crate::queue::QUEUE_NAME;
use crate::store::RunLog;

/// apalis's channel for new jobs (`migrations/*_notify_run_at.sql` of apalis-postgres).
const CHANNEL: &str = "apalis::job::insert";

/// What the notification says of a job.
#[derive(serde::Deserialize)]
struct Inserted {
    job_type: String,
    id: String,
}

/// Listens for new jobs until `shutdown`, reconnecting when the connection drops.
pub(super) async fn take_notified(
    pool: PgPool,
    store: Arc<dyn RunLog>,
    starts: Arc<Local>,
    shutdown: CancellationToken,
) {
    while !shutdown.is_cancelled() {
        let mut listener = match crate::store::pg_ends::listener(&pool, CHANNEL).await {
            Ok(l) => l,
            Err(e) => {
                tracing::debug!(error = %e, "cannot listen for new jobs; the poll finds them meanwhile");
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    _ = shutdown.cancelled() => return,
                }
            }
        };
        loop {
            let n = tokio::select! {
                n = listener.try_recv() => n,
                _ = shutdown.cancelled() => return,
            };
            match n {
                Ok(Some(n)) => take(store.as_ref(), &starts, n.payload()).await,
                // The connection dropped and sqlx reconnected: what was sent meanwhile is
                // lost, and the poll finds it.
                Ok(None) => store.job_queued(),
                Err(e) => {
                    tracing::debug!(error = %e, "listening for new jobs failed; reconnecting");
                    store.job_queued();
                    break;
                }
            }
        }
    }
}

/// Takes the job `payload` names when a worker of this process has a free slot and the job is
/// next in line; otherwise wakes apalis's fetch.
async fn take(store: &dyn RunLog, starts: &Local, payload: &str) {
    let Ok(job) = serde_json::from_str::<Inserted>(payload) else {
        store.job_queued();
        return;
    };
    // A run started in this process: running here already, or its start woke the fetch.
    if job.job_type != QUEUE_NAME || store.started_here(&job.id) {
        return;
    }
    let Some(slot) = starts.reserve() else {
        store.job_queued();
        return;
    };
    match slot
        .take_and_run(job.id.clone(), super::Handed::Notification)
        .await
    {
        Ok(true) => {}
        Ok(false) => store.job_queued(),
        Err(e) => {
            tracing::debug!(error = %e, job_id = %job.id, "could not take a queued job; the fetch will");
            store.job_queued();
        }
    }
}
