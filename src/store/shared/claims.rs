//! [`Claims`](crate::store::Claims) for every [`SqlStore`]: leases, expiry and the queue's
//! repairs. The claim itself is the backend's own.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::{ColumnIndex, Decode, Encode, Executor, IntoArguments, Row, Type};

use super::*;

#[async_trait]
impl<S> Claims for S
where
    S: SqlStore,
    for<'c> &'c mut Conn<S>: Executor<'c, Database = S::Db>,
    Args<S>: IntoArguments<S::Db>,
    usize: ColumnIndex<DbRow<S>>,
    for<'a> &'a str: ColumnIndex<DbRow<S>> + Encode<'a, S::Db> + Decode<'a, S::Db>,
    for<'a> Option<&'a str>: Encode<'a, S::Db>,
    str: Type<S::Db>,
    String: Col<S::Db>,
    i64: Col<S::Db>,
    i32: Col<S::Db>,
    bool: Col<S::Db>,
    DateTime<Utc>: Col<S::Db>,
    Option<String>: Col<S::Db>,
    Option<i64>: Col<S::Db>,
    Option<DateTime<Utc>>: Col<S::Db>,
    Vec<u8>: Col<S::Db>,
{
    async fn claim_run(&self, id: RunId, owner: &str, ttl: Duration) -> Result<Claim> {
        Ok(self.claim(id, owner, ttl, None).await?.0)
    }

    async fn claim_with_context(
        &self,
        id: RunId,
        owner: &str,
        ttl: Duration,
        limit: u32,
    ) -> Result<(Claim, Option<ThreadContext>)> {
        self.claim(id, owner, ttl, Some(limit)).await
    }

    async fn renew_lease(&self, lease: &Lease) -> Result<LeaseStatus> {
        // With whatever other runs renew now, in one statement (see `group::GroupRenew`).
        match self.common().renewals.renew(&self.commits(), lease).await? {
            Some(status) => Ok(status),
            None => Err(StoreError::LeaseLost(lease.run_id)),
        }
    }

    async fn release_lease(
        &self,
        lease: &Lease,
        job_id: &str,
        after_failure: bool,
    ) -> Result<bool> {
        debug_assert_eq!(
            crate::lifecycle::target(Transition::Release),
            RunStatus::Queued
        );
        let done = sqlx::query(sql!(
            "UPDATE sa_runs SET status = 'queued', lease_expires_at = 0, lease_owner = NULL, \
             job_id = $1, enqueued_at = $2, updated_at = $3, crashes = crashes + $6 \
             WHERE id = $4 AND lease_epoch = $5 AND status IN ({})",
            Transition::Release
        ))
        .bind(job_id)
        .bind(now_ms())
        .bind(Utc::now())
        .bind(lease.run_id.to_string())
        .bind(lease.epoch)
        .bind(i64::from(after_failure))
        .execute(self.pool())
        .await?
        .rows_affected();
        if done > 0 {
            self.notifier().notify(lease.run_id);
        }
        Ok(done > 0)
    }

    async fn expire_leases(&self, max_crashes: u32) -> Result<Vec<Expired>> {
        let now = Utc::now();
        let nms = now_ms();
        let mut tx = self.pool().begin().await?;
        // Give up first, so a run is never both re-queued and failed.
        let lost = sqlx::query(sql!(
            "UPDATE sa_runs SET status = 'failed', error_kind = 'lost', \
             error_message = 'the run was abandoned by ' || CAST(crashes + 1 AS TEXT) || ' workers in a row (crashes, kills or freezes); giving up', \
             crashes = crashes + 1, finished_at = $1, updated_at = $1, lease_expires_at = 0, cancel_requested = 0, \
             event_seq = event_seq + 1 \
             WHERE status IN ({}) AND lease_expires_at < $2 AND crashes + 1 >= $3 \
             RETURNING id, event_seq, thread_id, parent_run_id, crashes, error_message",
            Transition::GiveUp
        ))
        .bind(now)
        .bind(nms)
        .bind(max_crashes.max(1) as i64)
        .fetch_all(&mut *tx)
        .await?;
        let mut out = vec![];
        for row in &lost {
            let id: String = row.get(0);
            let run: RunId = id.parse().map_err(|e| corrupt("run id", e))?;
            let seq: i64 = row.get(1);
            let thread: String = row.get(2);
            let parent: Option<String> = row.get(3);
            let crashes: i64 = row.get(4);
            let error = RunError {
                kind: ErrorKind::Lost,
                message: row.get(5),
            };
            Self::insert_events(
                &mut tx,
                run,
                seq as u64,
                &[Event::RunFailed(event::RunFailed {
                    error: error.clone(),
                    crashes: Some(crashes.max(0) as u32),
                })
                .into()],
                self.relayed_at_insert(),
            )
            .await?;
            Self::terminal_effects(
                &mut tx,
                run,
                &thread,
                parent.as_deref(),
                RunStatus::Failed,
                Some(&error),
                Reach::ALL,
                self.relayed_at_insert(),
            )
            .await?;
            out.push(Expired {
                run_id: run,
                gave_up: true,
            });
        }
        let requeued = sqlx::query(sql!(
            "UPDATE sa_runs SET status = 'queued', crashes = crashes + 1, lease_expires_at = 0, lease_owner = NULL, \
             updated_at = $1 WHERE status IN ({}) AND lease_expires_at < $2 RETURNING id",
            Transition::Expire
        ))
        .bind(now)
        .bind(nms)
        .fetch_all(&mut *tx)
        .await?;
        for row in &requeued {
            let id: String = row.get(0);
            out.push(Expired {
                run_id: id.parse().map_err(|e| corrupt("run id", e))?,
                gave_up: false,
            });
        }
        tx.commit().await?;
        for e in &out {
            self.notifier().notify(e.run_id);
        }
        Ok(out)
    }

    async fn fetched_not_started(&self, worker: &str) -> Result<Vec<RunId>> {
        let ids: Vec<String> = sqlx::query_scalar(S::statements().fetched_not_started.as_str())
            .bind(worker)
            .fetch_all(self.pool())
            .await?;
        ids.iter()
            .map(|id| id.parse().map_err(|e| corrupt("run id", e)))
            .collect()
    }

    async fn take_job(&self, job_id: &str, worker: &str) -> Result<Option<RunId>> {
        let body: Option<Vec<u8>> = sqlx::query_scalar(S::statements().take_job.as_str())
            .bind(job_id)
            .bind(worker)
            .bind(QUEUE_NAME)
            .fetch_optional(self.pool())
            .await?;
        body.map(|b| {
            serde_json::from_slice::<RunJob>(&b)
                .map(|j| j.run_id)
                .map_err(|e| StoreError::Corrupt(format!("job {job_id}: {e}")))
        })
        .transpose()
    }

    async fn take_and_claim(
        &self,
        job_id: &str,
        worker: &str,
        ttl: Duration,
        limit: u32,
    ) -> Result<Option<Taken>> {
        self.take_claim(job_id, worker, ttl, limit).await
    }

    fn started_here(&self, job_id: &str) -> bool {
        self.common().started_here.take(job_id)
    }

    async fn settle_held_job(&self, job_id: &str, worker: &str, end: JobEnd) -> Result<()> {
        sqlx::query(S::statements().settle_held_job.as_str())
            .bind(job_id)
            .bind(worker)
            .bind(end == JobEnd::Done)
            .execute(self.pool())
            .await?;
        Ok(())
    }

    async fn held_elsewhere(
        &self,
        worker: &str,
        held_for: Duration,
        limit: u32,
    ) -> Result<Vec<RunId>> {
        let ids: Vec<String> = sqlx::query_scalar(S::statements().held_elsewhere.as_str())
            .bind(now_ms() - held_for.as_millis() as i64)
            .bind(worker)
            .bind(i64::from(limit))
            .fetch_all(self.pool())
            .await?;
        ids.iter()
            .map(|id| id.parse().map_err(|e| corrupt("run id", e)))
            .collect()
    }

    async fn orphans(&self, grace: Duration) -> Result<Vec<Orphan>> {
        let nms = now_ms();
        let rows = sqlx::query(S::statements().orphans.as_str())
            .bind(nms - grace.as_millis() as i64)
            .bind(nms)
            .fetch_all(self.pool())
            .await?;
        rows.iter()
            .map(|r| {
                let id: String = r.get(0);
                Ok(Orphan {
                    run_id: id.parse().map_err(|e| corrupt("run id", e))?,
                    status: r.try_get(1)?,
                })
            })
            .collect()
    }

    async fn queue_rank(&self, run: RunId, place: QueuePlace) -> Result<(u32, u8)> {
        let mut conn = self.pool().acquire().await?;
        Ok(S::rank_in(&mut conn, run, place).await?.unwrap_or((0, 3)))
    }

    async fn at_limit(&self, run: RunId) -> Result<bool> {
        let held: Option<i64> = sqlx::query_scalar(concat!(
            "SELECT CAST(1 AS BIGINT) FROM sa_runs WHERE id = $1 AND status IN ('queued', 'waiting') AND NOT (1 = 1 ",
            limits_guard!(),
            ")"
        ))
        .bind(run.to_string())
        .fetch_optional(self.pool())
        .await?;
        Ok(held.is_some())
    }

    async fn set_limits(&self, prefix: &str, entries: &[(String, u32)]) -> Result<()> {
        let mut tx = self.pool().begin().await?;
        sqlx::query("DELETE FROM sa_limits WHERE key LIKE $1")
            .bind(format!("{prefix}%"))
            .execute(&mut *tx)
            .await?;
        for (key, n) in entries
            .iter()
            .filter(|(k, n)| *n > 0 && k.starts_with(prefix))
        {
            sqlx::query("INSERT INTO sa_limits (key, concurrency) VALUES ($1, $2) ON CONFLICT (key) DO UPDATE SET concurrency = EXCLUDED.concurrency")
                .bind(key)
                .bind(i64::from(*n))
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        self.refresh_limits().await?;
        Ok(())
    }

    async fn refresh_limits(&self) -> Result<bool> {
        let any: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM sa_limits)")
            .fetch_one(self.pool())
            .await?;
        self.common()
            .limits_seen
            .store(any, std::sync::atomic::Ordering::Relaxed);
        Ok(any)
    }

    async fn set_job(&self, run: RunId, job_id: &str) -> Result<()> {
        sqlx::query("UPDATE sa_runs SET job_id = $1, enqueued_at = $2 WHERE id = $3")
            .bind(job_id)
            .bind(now_ms())
            .bind(run.to_string())
            .execute(self.pool())
            .await?;
        Ok(())
    }

    fn job_queued(&self) {
        self.notifier().job_queued();
    }

    fn jobs_queued(&self) -> futures::stream::BoxStream<'static, ()> {
        use futures::StreamExt;
        self.notifier().jobs_queued().boxed()
    }
}
