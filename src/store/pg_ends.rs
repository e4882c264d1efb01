//! A run's end, heard at once by the other processes on the same PostgreSQL database.
//!
//! A waiter (`POST /v1/runs/wait`, `GET /v1/runs/{id}/wait`, an MCP client's `run_agent`) sleeps
//! on its process's [`Notifier`], which the store fires after its own commits. A run that a
//! worker in another process ends was heard there only through Redis (the relay's `change:`
//! message, after it has read the outbox and written the streams) or at the waiter's re-check
//! timer. On PostgreSQL the committer now also announces each end with `NOTIFY` on
//! [`CHANNEL`], and every store LISTENs and fires its notifier for the runs named. The re-check
//! stays as the net for a notification lost while a listener reconnects.
//!
//! The announcements are batched: the ends that arrive while one `pg_notify` is in flight go
//! out together in the next (a comma-separated list of run ids, within PostgreSQL's 8,000-byte
//! payload), so a busy fleet sends a handful of statements a second, not one per run.

use std::sync::Weak;
use std::time::Duration;

use sqlx::PgPool;

use crate::ids::RunId;
use crate::notify::Notifier;

/// The channel runs' ends are announced on.
pub(crate) const CHANNEL: &str = "subagents_run_ended";

/// Run ids per notification: 36 bytes and a comma each stay under the 8,000-byte payload.
const PER_NOTIFY: usize = 200;

/// The sending half: hands run ids to a task that announces them.
#[derive(Clone, Debug)]
pub(crate) struct Ends(tokio::sync::mpsc::UnboundedSender<RunId>);

impl Ends {
    /// Starts the announcing task on `pool`; it ends when every `Ends` is dropped.
    pub(crate) fn start(pool: PgPool) -> Ends {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<RunId>();
        tokio::spawn(async move {
            let mut batch = Vec::with_capacity(PER_NOTIFY);
            while rx.recv_many(&mut batch, PER_NOTIFY).await > 0 {
                let payload = batch
                    .drain(..)
                    .map(|r| r.to_string())
                    .collect::<Vec<_>>()
                    .join(",");
                if let Err(e) = sqlx::query("SELECT pg_notify($1, $2)")
                    .bind(CHANNEL)
                    .bind(payload)
                    .execute(&pool)
                    .await
                {
                    tracing::debug!(error = %e, "could not announce runs' ends; waiters in other processes re-check on their timer");
                }
            }
        });
        Ends(tx)
    }

    /// Announces that `run` ended (after the commit that ended it).
    pub(crate) fn ended(&self, run: RunId) {
        let _ = self.0.send(run);
    }
}

/// A connection of `pool`'s listening on `channel`.
pub(crate) async fn listener(
    pool: &PgPool,
    channel: &str,
) -> Result<sqlx::postgres::PgListener, sqlx::Error> {
    let mut listener = sqlx::postgres::PgListener::connect_with(pool).await?;
    listener.listen(channel).await?;
    Ok(listener)
}

/// Listens on [`CHANNEL`] and fires `notifier` for every run announced, reconnecting when the
/// connection drops, until the notifier is gone. Resolves its returned receiver once it
/// listens, so a store is not handed out before it can hear an end.
///
/// The listening connection is also how the pool hears its connections cut (a restart, or
/// `pg_terminate_backend` for the database's sessions): it sleeps on its socket, so it hears
/// the cut first, and tells `liveness` (see `super::pg_pool`) until it listens again.
pub(crate) fn listen(
    pool: PgPool,
    notifier: Weak<Notifier>,
    liveness: std::sync::Arc<super::pg_pool::Liveness>,
) -> tokio::sync::oneshot::Receiver<()> {
    let (ready, listening) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        // Whatever ends this task, nobody hears cuts after it: the pool (which apalis may
        // still use) tests every connection again.
        let _deaf = Deafens(liveness.clone());
        let mut ready = Some(ready);
        while notifier.strong_count() > 0 {
            let mut listener = match listener(&pool, CHANNEL).await {
                Ok(mut l) => {
                    // A lost connection returns at once instead of reconnecting inside
                    // `try_recv`: the pool must hear of the cut before anything reconnects.
                    l.eager_reconnect(false);
                    liveness.listening();
                    l
                }
                Err(e) => {
                    tracing::debug!(error = %e, "cannot listen for runs' ends; retrying");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            };
            if let Some(r) = ready.take() {
                let _ = r.send(());
            }
            loop {
                // A timeout now and then, to notice a store that is gone.
                match tokio::time::timeout(Duration::from_secs(5), listener.try_recv()).await {
                    Err(_) => {
                        if notifier.strong_count() == 0 {
                            return;
                        }
                    }
                    Ok(Ok(Some(n))) => {
                        let Some(notifier) = notifier.upgrade() else {
                            return;
                        };
                        for run in n.payload().split(',').filter_map(|id| id.parse().ok()) {
                            notifier.heard(run, true);
                        }
                    }
                    // The connection dropped: what was sent meanwhile is lost, and the waiters'
                    // re-check finds it.
                    Ok(Ok(None)) => {
                        liveness.cut();
                        tracing::info!(
                            "the database cut the listening connection; testing pooled connections until it listens again"
                        );
                        break;
                    }
                    Ok(Err(e)) => {
                        liveness.cut();
                        tracing::debug!(error = %e, "listening for runs' ends failed; reconnecting");
                        break;
                    }
                }
            }
        }
    });
    listening
}

/// Makes its [`super::pg_pool::Liveness`] deaf when dropped.
struct Deafens(std::sync::Arc<super::pg_pool::Liveness>);

impl Drop for Deafens {
    fn drop(&mut self) {
        self.0.deaf();
    }
}
