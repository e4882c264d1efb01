//! The SQL both backends share, written once. Every statement here is valid on SQLite and on
//! PostgreSQL (`$N` placeholders, which sqlx binds positionally on both; `CAST` instead of
//! `::`), so [`store_impl!`] instantiates it for each backend beside the few statements that
//! really differ (start, claim, checkpoint, park, listing, orphans), which each backend passes
//! in. Status guards come from [`crate::lifecycle::sql_sources`], so a statement can only apply
//! a move the state machine allows.

/// The `WHERE status IN (…)` list for a transition, computed once.
macro_rules! sources {
    ($t:expr) => {{
        static S: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| crate::lifecycle::sql_sources($t));
        S.as_str()
    }};
}

/// A statement with status guards spliced in, built once: `sql!("… IN ({}) …", Transition::X)`.
macro_rules! sql {
    ($fmt:expr $(, $t:expr)* $(,)?) => {{
        static S: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| format!($fmt $(, crate::lifecycle::sql_sources($t))*));
        S.as_str()
    }};
}

/// Binds `$1`..`$14` of a checkpoint's fence, identical on both backends: counters, lease
/// deadline, the terminal columns of [`FenceFields`](super::FenceFields), run id and epoch.
macro_rules! bind_fence {
    ($q:expr, $cp:expr, $ff:expr, $lease:expr, $now:expr) => {
        $q.bind($cp.events.len() as i64)
            .bind($cp.step.map(|s| s as i64))
            .bind($cp.usage.prompt_tokens as i64)
            .bind($cp.usage.completion_tokens as i64)
            .bind($ff.status.map(RunStatus::as_str))
            .bind(now_ms() + $lease.ttl.as_millis() as i64)
            .bind($now)
            .bind($ff.result)
            .bind($ff.forced)
            .bind($ff.error_kind)
            .bind($ff.error_message)
            .bind($ff.finished_at)
            .bind($lease.run_id.to_string())
            .bind($lease.epoch)
    };
}

/// The columns of a run, in the order `run_from_row` reads them.
macro_rules! run_columns {
    () => {
        "id, thread_id, owner, agent, status, input, metadata, limits, parent_run_id, root_run_id, depth, detached, \
    wake_at, claimed_from, step, forced, \
    result, error_kind, error_message, prompt_tokens, completion_tokens, attempts, crashes, lease_epoch, cancel_requested, \
    job_id, event_seq, created_at, started_at, finished_at, heartbeat_at"
    };
}

/// Implements the store traits ([`RunLog`](super::RunLog), [`Queries`](super::Queries),
/// [`Outbox`](super::Outbox)) for `$store` on sqlx database `$db`, whose apalis job
/// table is `$jobs`: the shared statements below plus the backend's own items for each trait. How a
/// park orders its reads and its fence is the one locking difference between the backends
/// (`park_reads_first`, and `share`: the lock clause of those reads).
macro_rules! store_impl {
    ($store:ty, $db:ty, $jobs:literal, park_reads_first = $reads_first:literal, share = $share:literal, run_log = { $($run_log:tt)* }, queries = { $($queries:tt)* }) => {
        impl $store {
            /// Inserts a commit's events in one statement (one round trip, whatever their number).
            async fn insert_events(
                tx: &mut sqlx::Transaction<'_, $db>,
                run: RunId,
                first_seq: u64,
                events: &[NewEvent],
            ) -> Result<()> {
                if events.is_empty() {
                    return Ok(());
                }
                let now = Utc::now();
                let run = run.to_string();
                let mut q = sqlx::QueryBuilder::<$db>::new("INSERT INTO sa_events (run_id, seq, type, data, created_at) ");
                q.push_values(events.iter().enumerate(), |mut b, (i, ev)| {
                    b.push_bind(run.clone())
                        .push_bind((first_seq + i as u64) as i64)
                        .push_bind(ev.kind.as_str())
                        .push_bind(ev.data.to_string())
                        .push_bind(now);
                });
                q.build().execute(&mut **tx).await?;
                Ok(())
            }

            /// What every terminal transition commits with it, whichever way the run ended
            /// (finish, cancel, give-up): the parent's `child.finished` event (unless the parent
            /// has ended: nothing follows a terminal event), the wake-up of every run parked on
            /// this one (a parent only wakes for the children it waits on: a detached child
            /// ending does not disturb it), the end of this run's own waits, and the end of its
            /// attached children.
            async fn terminal_effects(
                tx: &mut sqlx::Transaction<'_, $db>,
                run: RunId,
                thread: &str,
                parent: Option<&str>,
                status: RunStatus,
                error: Option<&RunError>,
                reach: Reach,
            ) -> Result<()> {
                if let Some(parent) = parent {
                    let row = sqlx::query(
                        "UPDATE sa_runs SET event_seq = event_seq + 1 \
                         WHERE id = $1 AND status IN ('queued','running','waiting') RETURNING event_seq",
                    )
                    .bind(parent)
                    .fetch_optional(&mut **tx)
                    .await?;
                    if let Some(row) = row {
                        let seq: i64 = row.get(0);
                        let mut data = serde_json::json!({"child_run_id": run, "thread_id": thread, "status": status});
                        if let Some(e) = error {
                            data["error"] = serde_json::json!(e);
                        }
                        let parent_id: RunId = parent.parse().map_err(|e| corrupt("parent id", e))?;
                        Self::insert_events(tx, parent_id, seq as u64, &[NewEvent::new(EventKind::ChildFinished, data)]).await?;
                    }
                }
                if reach.waits {
                    Self::end_waits(tx, &run.to_string()).await?;
                }
                if reach.children {
                    Self::end_attached_children(tx, run).await?;
                }
                Ok(())
            }

            /// The waits around a run that ended: whoever is parked on it is woken (`wake`), and
            /// its own waits are dropped.
            async fn end_waits(tx: &mut sqlx::Transaction<'_, $db>, run: &str) -> Result<()> {
                sqlx::query(sql!(
                    "UPDATE sa_runs SET wake_at = $1 WHERE status IN ({}) \
                     AND id IN (SELECT waiter FROM sa_run_waits WHERE target = $2)",
                    Transition::Wake
                ))
                .bind(now_ms())
                .bind(run)
                .execute(&mut **tx)
                .await?;
                sqlx::query("DELETE FROM sa_run_waits WHERE waiter = $1").bind(run).execute(&mut **tx).await?;
                Ok(())
            }

            /// A run that ends takes its attached (non-detached) descendants with it, in the same
            /// commit: parked and queued ones are cancelled here (their waiters woken), running
            /// ones are asked to stop (their workers finish them within a second). So a crash
            /// right after a parent's end cannot leave its children running.
            async fn end_attached_children(tx: &mut sqlx::Transaction<'_, $db>, run: RunId) -> Result<()> {
                let now = Utc::now();
                let mut stack = vec![run.to_string()];
                while let Some(parent) = stack.pop() {
                    sqlx::query(sql!(
                        "UPDATE sa_runs SET cancel_requested = 1, updated_at = $1 \
                         WHERE parent_run_id = $2 AND detached = 0 AND status IN ({})",
                        Transition::RequestCancel
                    ))
                    .bind(now)
                    .bind(&parent)
                    .execute(&mut **tx)
                    .await?;
                    let running: Vec<String> = sqlx::query_scalar(sql!(
                        "SELECT id FROM sa_runs WHERE parent_run_id = $1 AND detached = 0 AND status IN ({})",
                        Transition::RequestCancel
                    ))
                    .bind(&parent)
                    .fetch_all(&mut **tx)
                    .await?;
                    stack.extend(running);
                    let ended = sqlx::query(sql!(
                        "UPDATE sa_runs SET status = 'cancelled', finished_at = $1, updated_at = $1, event_seq = event_seq + 1, \
                         cancel_requested = 0, lease_expires_at = 0, wake_at = NULL \
                         WHERE parent_run_id = $2 AND detached = 0 AND status IN ({}) RETURNING id, event_seq",
                        Transition::Cancel
                    ))
                    .bind(now)
                    .bind(&parent)
                    .fetch_all(&mut **tx)
                    .await?;
                    for row in &ended {
                        let id: String = row.get(0);
                        let child: RunId = id.parse().map_err(|e| corrupt("run id", e))?;
                        let seq: i64 = row.get(1);
                        let data = serde_json::json!({"reason": "parent_ended", "parent_run_id": parent});
                        Self::insert_events(tx, child, seq as u64, &[NewEvent::new(EventKind::RunCancelled, data)]).await?;
                        Self::end_waits(tx, &id).await?;
                        stack.push(id);
                    }
                }
                Ok(())
            }
        }

        impl $store {
            /// Whether any of `targets` has ended (or is missing): a park on them is due at once.
            async fn any_ended(tx: &mut sqlx::Transaction<'_, $db>, targets: &[RunId]) -> Result<bool> {
                let mut ended = false;
                for target in targets {
                    let status: Option<String> = sqlx::query_scalar(concat!("SELECT status FROM sa_runs WHERE id = $1", $share))
                        .bind(target.to_string())
                        .fetch_optional(&mut **tx)
                        .await?;
                    ended |= status.and_then(|s| RunStatus::parse(&s)).is_none_or(RunStatus::is_terminal);
                }
                Ok(ended)
            }
        }

        #[async_trait]
        impl RunLog for $store {
            $($run_log)*

            async fn park(&self, lease: &Lease, park: Park) -> Result<Parked> {
                debug_assert!(park.wake_at.is_some() || !park.waits_on.is_empty(), "a park needs something to wake it");
                let now = Utc::now();
                let mut tx = self.pool.begin().await?;
                // Either order leaves no window: a child that ends now either commits first (and
                // is seen ended here) or after this park (and then finds it parked and wakes it).
                let mut due = $reads_first && Self::any_ended(&mut tx, &park.waits_on).await?;
                let row = sqlx::query(sql!(
                    "UPDATE sa_runs SET heartbeat_at = $1 WHERE id = $2 AND lease_epoch = $3 AND status IN ({}) RETURNING cancel_requested",
                    Transition::Park
                ))
                .bind(now)
                .bind(lease.run_id.to_string())
                .bind(lease.epoch)
                .fetch_optional(&mut *tx)
                .await?;
                let Some(row) = row else { return Err(StoreError::LeaseLost(lease.run_id)) };
                if row.get::<i64, _>(0) != 0 {
                    tx.rollback().await?;
                    return Ok(Parked::CancelPending);
                }
                if !$reads_first {
                    due = Self::any_ended(&mut tx, &park.waits_on).await?;
                }
                sqlx::query("DELETE FROM sa_run_waits WHERE waiter = $1").bind(lease.run_id.to_string()).execute(&mut *tx).await?;
                for target in &park.waits_on {
                    sqlx::query("INSERT INTO sa_run_waits (waiter, target) VALUES ($1, $2) ON CONFLICT DO NOTHING")
                        .bind(lease.run_id.to_string())
                        .bind(target.to_string())
                        .execute(&mut *tx)
                        .await?;
                }
                let wake_at = if due { Some(now_ms()) } else { park.wake_at };
                let n = park.events.len() as i64;
                let row = sqlx::query(
                    "UPDATE sa_runs SET status = 'waiting', lease_expires_at = 0, lease_owner = NULL, wake_at = $1, \
                     event_seq = event_seq + $2, updated_at = $3 WHERE id = $4 RETURNING event_seq",
                )
                .bind(wake_at)
                .bind(n)
                .bind(now)
                .bind(lease.run_id.to_string())
                .fetch_one(&mut *tx)
                .await?;
                let last: i64 = row.get(0);
                Self::insert_events(&mut tx, lease.run_id, (last - n + 1) as u64, &park.events).await?;
                tx.commit().await?;
                self.notifier.notify(lease.run_id);
                Ok(Parked::Parked { due })
            }

            async fn get_run(&self, id: RunId) -> Result<Option<RunRecord>> {
                let row = sqlx::query(concat!("SELECT ", run_columns!(), " FROM sa_runs WHERE id = $1"))
                    .bind(id.to_string())
                    .fetch_optional(&self.pool)
                    .await?;
                row.as_ref().map(run_from_row).transpose()
            }

            async fn renew_lease(&self, lease: &Lease) -> Result<LeaseStatus> {
                let row = sqlx::query(sql!(
                    "UPDATE sa_runs SET lease_expires_at = $1, heartbeat_at = $2 \
                     WHERE id = $3 AND lease_epoch = $4 AND status IN ({}) RETURNING cancel_requested",
                    Transition::Heartbeat
                ))
                .bind(now_ms() + lease.ttl.as_millis() as i64)
                .bind(Utc::now())
                .bind(lease.run_id.to_string())
                .bind(lease.epoch)
                .fetch_optional(&self.pool)
                .await?;
                match row {
                    Some(r) => Ok(LeaseStatus { cancel_requested: r.get::<i64, _>(0) != 0 }),
                    None => Err(StoreError::LeaseLost(lease.run_id)),
                }
            }

            async fn release_lease(&self, lease: &Lease, job_id: &str) -> Result<bool> {
                debug_assert_eq!(crate::lifecycle::target(Transition::Release), RunStatus::Queued);
                let done = sqlx::query(sql!(
                    "UPDATE sa_runs SET status = 'queued', lease_expires_at = 0, lease_owner = NULL, \
                     job_id = $1, enqueued_at = $2, updated_at = $3 \
                     WHERE id = $4 AND lease_epoch = $5 AND status IN ({})",
                    Transition::Release
                ))
                .bind(job_id)
                .bind(now_ms())
                .bind(Utc::now())
                .bind(lease.run_id.to_string())
                .bind(lease.epoch)
                .execute(&self.pool)
                .await?
                .rows_affected();
                if done > 0 {
                    self.notifier.notify(lease.run_id);
                }
                Ok(done > 0)
            }

            async fn wake(&self, run: RunId) -> Result<bool> {
                let done = sqlx::query(sql!("UPDATE sa_runs SET wake_at = $1 WHERE id = $2 AND status IN ({})", Transition::Wake))
                    .bind(now_ms())
                    .bind(run.to_string())
                    .execute(&self.pool)
                    .await?
                    .rows_affected();
                Ok(done > 0)
            }

            async fn expire_leases(&self, max_crashes: u32) -> Result<Vec<Expired>> {
                let now = Utc::now();
                let nms = now_ms();
                let mut tx = self.pool.begin().await?;
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
                    let error = RunError { kind: ErrorKind::Lost, message: row.get(5) };
                    Self::insert_events(
                        &mut tx,
                        run,
                        seq as u64,
                        &[NewEvent::new(EventKind::RunFailed, serde_json::json!({"error": error, "crashes": crashes}))],
                    )
                    .await?;
                    Self::terminal_effects(&mut tx, run, &thread, parent.as_deref(), RunStatus::Failed, Some(&error), Reach::ALL).await?;
                    out.push(Expired { run_id: run, gave_up: true });
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
                    out.push(Expired { run_id: id.parse().map_err(|e| corrupt("run id", e))?, gave_up: false });
                }
                tx.commit().await?;
                for e in &out {
                    self.notifier.notify(e.run_id);
                }
                Ok(out)
            }

            async fn due_waiters(&self, run: RunId) -> Result<Vec<RunId>> {
                let rows = sqlx::query(sql!(
                    "SELECT id FROM sa_runs WHERE status IN ({}) AND wake_at <= $1 \
                     AND id IN (SELECT waiter FROM sa_run_waits WHERE target = $2)",
                    Transition::Wake
                ))
                .bind(now_ms())
                .bind(run.to_string())
                .fetch_all(&self.pool)
                .await?;
                rows.iter()
                    .map(|r| r.get::<String, _>(0).parse().map_err(|e| corrupt("run id", e)))
                    .collect()
            }

            async fn thread_messages(&self, thread: &ThreadId, limit: u32) -> Result<Vec<StoredMessage>> {
                let rows = sqlx::query(
                    "SELECT id, run_id, step, key, body FROM (SELECT id, run_id, step, key, body FROM sa_messages \
                     WHERE thread_id = $1 ORDER BY id DESC LIMIT $2) t ORDER BY id",
                )
                .bind(thread.as_str())
                .bind(limit as i64)
                .fetch_all(&self.pool)
                .await?;
                rows.iter().map(message_from_row).collect()
            }

            async fn events_after(&self, run: RunId, after: u64, limit: u32) -> Result<Vec<EventRecord>> {
                let rows = sqlx::query(
                    "SELECT run_id, seq, type, data, created_at FROM sa_events WHERE run_id = $1 AND seq > $2 ORDER BY seq LIMIT $3",
                )
                .bind(run.to_string())
                .bind(after.min(i64::MAX as u64) as i64)
                .bind(limit as i64)
                .fetch_all(&self.pool)
                .await?;
                rows.iter().map(event_from_row).collect()
            }

            async fn request_cancel(&self, run: RunId) -> Result<CancelOutcome> {
                let now = Utc::now();
                let mut tx = self.pool.begin().await?;
                // A queued or parked run holds no worker: it ends here and now (`cancel`).
                for state in crate::lifecycle::sources(Transition::Cancel) {
                    let row = sqlx::query(
                        "UPDATE sa_runs SET status = 'cancelled', finished_at = $1, updated_at = $1, event_seq = event_seq + 1, \
                         cancel_requested = 0, lease_expires_at = 0, wake_at = NULL WHERE id = $2 AND status = $3 \
                         RETURNING event_seq, thread_id, parent_run_id",
                    )
                    .bind(now)
                    .bind(run.to_string())
                    .bind(state.as_str())
                    .fetch_optional(&mut *tx)
                    .await?;
                    if let Some(row) = row {
                        let seq: i64 = row.get(0);
                        let thread: String = row.get(1);
                        let parent: Option<String> = row.get(2);
                        Self::insert_events(
                            &mut tx,
                            run,
                            seq as u64,
                            &[NewEvent::new(EventKind::RunCancelled, serde_json::json!({"while": state.as_str()}))],
                        )
                        .await?;
                        Self::terminal_effects(&mut tx, run, &thread, parent.as_deref(), RunStatus::Cancelled, None, Reach::ALL).await?;
                        tx.commit().await?;
                        self.notifier.notify(run);
                        return Ok(CancelOutcome::Cancelled);
                    }
                }
                // A running run is asked to stop (`request-cancel`); its worker finishes it.
                let flagged = sqlx::query(sql!(
                    "UPDATE sa_runs SET cancel_requested = 1, updated_at = $1 WHERE id = $2 AND status IN ({})",
                    Transition::RequestCancel
                ))
                .bind(now)
                .bind(run.to_string())
                .execute(&mut *tx)
                .await?
                .rows_affected();
                tx.commit().await?;
                if flagged > 0 {
                    self.notifier.notify(run);
                    self.cancels.notify(run);
                    return Ok(CancelOutcome::Requested);
                }
                Ok(match self.get_run(run).await? {
                    Some(r) => CancelOutcome::AlreadyFinished(r.status),
                    None => CancelOutcome::NotFound,
                })
            }

            async fn orphans(&self, grace: Duration) -> Result<Vec<Orphan>> {
                let nms = now_ms();
                // apalis's job table is read, never written. A queued run needs a new job when
                // its own is not `Pending` (free for any worker to fetch) after the grace period:
                // gone, finished, or fetched (`Queued`, `Running`) by a worker that has not
                // started it — the batch of a dead or full worker. A duplicate job is harmless.
                let rows = sqlx::query(concat!(
                    "SELECT id, status FROM sa_runs r WHERE r.enqueued_at < $1 AND ( \
                       (r.status = 'waiting' AND r.wake_at IS NOT NULL AND r.wake_at <= $2) OR \
                       (r.status = 'queued' \
                         AND NOT EXISTS (SELECT 1 FROM ", $jobs, " j WHERE j.id = r.job_id AND j.status = 'Pending') \
                         AND NOT EXISTS (SELECT 1 FROM sa_runs a WHERE a.thread_id = r.thread_id AND a.status IN ('running','waiting')) \
                         AND NOT EXISTS (SELECT 1 FROM sa_runs q WHERE q.thread_id = r.thread_id AND q.status = 'queued' AND q.id < r.id)) \
                     ) LIMIT 1000"
                ))
                .bind(nms - grace.as_millis() as i64)
                .bind(nms)
                .fetch_all(&self.pool)
                .await?;
                rows.iter()
                    .map(|r| {
                        let id: String = r.get(0);
                        let st: String = r.get(1);
                        Ok(Orphan {
                            run_id: id.parse().map_err(|e| corrupt("run id", e))?,
                            status: RunStatus::parse(&st).ok_or_else(|| corrupt("status", &st))?,
                        })
                    })
                    .collect()
            }

            async fn set_job(&self, run: RunId, job_id: &str) -> Result<()> {
                sqlx::query("UPDATE sa_runs SET job_id = $1, enqueued_at = $2 WHERE id = $3")
                    .bind(job_id)
                    .bind(now_ms())
                    .bind(run.to_string())
                    .execute(&self.pool)
                    .await?;
                Ok(())
            }

            async fn next_queued(&self, thread: &ThreadId) -> Result<Option<RunId>> {
                let id: Option<String> =
                    sqlx::query_scalar("SELECT id FROM sa_runs WHERE thread_id = $1 AND status = 'queued' ORDER BY id LIMIT 1")
                        .bind(thread.as_str())
                        .fetch_optional(&self.pool)
                        .await?;
                id.map(|i| i.parse().map_err(|e| corrupt("run id", e))).transpose()
            }

            fn subscribe(&self, run: RunId) -> std::sync::Arc<tokio::sync::Notify> {
                self.notifier.subscribe(run)
            }

            fn subscribe_cancel(&self, run: RunId) -> std::sync::Arc<tokio::sync::Notify> {
                self.cancels.subscribe(run)
            }

            async fn append_events(&self, run: RunId, events: Vec<NewEvent>) -> Result<bool> {
                let mut tx = self.pool.begin().await?;
                let row = sqlx::query(
                    "UPDATE sa_runs SET event_seq = event_seq + $1 WHERE id = $2 \
                     AND status IN ('queued','running','waiting') RETURNING event_seq",
                )
                .bind(events.len() as i64)
                .bind(run.to_string())
                .fetch_optional(&mut *tx)
                .await?;
                let Some(row) = row else { return Ok(false) };
                let last: i64 = row.get(0);
                Self::insert_events(&mut tx, run, (last - events.len() as i64 + 1) as u64, &events).await?;
                tx.commit().await?;
                self.notifier.notify(run);
                Ok(true)
            }

            async fn children(&self, run: RunId) -> Result<Vec<RunRecord>> {
                let rows = sqlx::query(concat!("SELECT ", run_columns!(), " FROM sa_runs WHERE parent_run_id = $1 ORDER BY id"))
                    .bind(run.to_string())
                    .fetch_all(&self.pool)
                    .await?;
                rows.iter().map(run_from_row).collect()
            }

            async fn tree_usage(&self, run: RunId) -> Result<(Usage, u64)> {
                let row = sqlx::query(
                    "WITH RECURSIVE tree(id) AS (SELECT CAST($1 AS TEXT) UNION ALL \
                       SELECT r.id FROM sa_runs r JOIN tree t ON r.parent_run_id = t.id) \
                     SELECT CAST(COALESCE(SUM(prompt_tokens), 0) AS BIGINT), CAST(COALESCE(SUM(completion_tokens), 0) AS BIGINT), \
                       CAST(COALESCE(SUM(step), 0) AS BIGINT) FROM sa_runs WHERE id IN (SELECT id FROM tree)",
                )
                .bind(run.to_string())
                .fetch_one(&self.pool)
                .await?;
                Ok((
                    Usage { prompt_tokens: row.get::<i64, _>(0) as u64, completion_tokens: row.get::<i64, _>(1) as u64 },
                    row.get::<i64, _>(2) as u64,
                ))
            }

            async fn wait_deadline(&self, key: &str, proposed: i64) -> Result<i64> {
                Ok(sqlx::query_scalar(
                    "INSERT INTO sa_waits (key, deadline) VALUES ($1, $2) ON CONFLICT(key) DO UPDATE SET key = EXCLUDED.key RETURNING deadline",
                )
                .bind(key)
                .bind(proposed)
                .fetch_one(&self.pool)
                .await?)
            }
        }

        #[async_trait]
        impl Queries for $store {
            $($queries)*

            async fn wipe(&self) -> Result<()> {
                let mut tx = self.pool.begin().await?;
                for t in ["sa_events", "sa_messages", "sa_run_waits", "sa_runs", "sa_threads", "sa_waits"] {
                    sqlx::query(sqlx::AssertSqlSafe(format!("DELETE FROM {t}"))).execute(&mut *tx).await?;
                }
                sqlx::query(concat!("DELETE FROM ", $jobs, " WHERE job_type = $1"))
                    .bind(super::QUEUE_NAME)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                Ok(())
            }

            async fn checkpoint_rows(&self) -> Result<i64> {
                Ok(sqlx::query_scalar("SELECT (SELECT count(*) FROM sa_messages) + (SELECT count(*) FROM sa_events)")
                    .fetch_one(&self.pool)
                    .await?)
            }

            async fn get_thread(&self, id: &ThreadId) -> Result<Option<ThreadRecord>> {
                let row = sqlx::query("SELECT id, owner, created_at, updated_at FROM sa_threads WHERE id = $1")
                    .bind(id.as_str())
                    .fetch_optional(&self.pool)
                    .await?;
                Ok(row.map(|r| ThreadRecord {
                    id: id.clone(),
                    owner: r.get("owner"),
                    created_at: r.get("created_at"),
                    updated_at: r.get("updated_at"),
                }))
            }

            async fn messages_page(&self, thread: &ThreadId, after: i64, limit: u32) -> Result<Vec<StoredMessage>> {
                let rows = sqlx::query(
                    "SELECT id, run_id, step, key, body FROM sa_messages WHERE thread_id = $1 AND id > $2 ORDER BY id LIMIT $3",
                )
                .bind(thread.as_str())
                .bind(after)
                .bind(limit as i64)
                .fetch_all(&self.pool)
                .await?;
                rows.iter().map(message_from_row).collect()
            }

            async fn queue_position(&self, run: RunId) -> Result<i64> {
                Ok(sqlx::query_scalar("SELECT count(*) FROM sa_runs WHERE status = 'queued' AND id < $1")
                    .bind(run.to_string())
                    .fetch_one(&self.pool)
                    .await?)
            }

            async fn last_call_arguments(&self, run: RunId, tool: &str) -> Result<Option<String>> {
                // The run's assistant messages, newest first; the index on (run_id, id) keeps it
                // to this run's rows.
                let pattern = format!("%\"name\":\"{tool}\"%");
                let rows = sqlx::query(
                    "SELECT body FROM sa_messages WHERE run_id = $1 AND role = 'assistant' AND body LIKE $2 ORDER BY id DESC LIMIT 1",
                )
                .bind(run.to_string())
                .bind(pattern)
                .fetch_all(&self.pool)
                .await?;
                let Some(row) = rows.first() else { return Ok(None) };
                let body: String = row.get(0);
                let message: crate::model::Message = serde_json::from_str(&body).map_err(|e| corrupt("message body", e))?;
                Ok(match message {
                    crate::model::Message::Assistant { tool_calls, .. } => {
                        tool_calls.into_iter().rev().find(|c| c.function.name == tool).map(|c| c.function.arguments)
                    }
                    _ => None,
                })
            }

            async fn status_counts(&self) -> Result<Vec<(RunStatus, i64)>> {
                let rows = sqlx::query("SELECT status, count(*) FROM sa_runs GROUP BY status").fetch_all(&self.pool).await?;
                rows.iter()
                    .map(|r| {
                        let s: String = r.get(0);
                        Ok((RunStatus::parse(&s).ok_or_else(|| corrupt("status", &s))?, r.get::<i64, _>(1)))
                    })
                    .collect()
            }

            fn subscribe_all(&self) -> std::sync::Arc<tokio::sync::Notify> {
                self.notifier.subscribe_all()
            }
        }

        #[async_trait]
        impl Outbox for $store {
            async fn unrelayed(&self, limit: u32) -> Result<Vec<EventRecord>> {
                let rows = sqlx::query(
                    "SELECT run_id, seq, type, data, created_at FROM sa_events WHERE relayed = 0 ORDER BY run_id, seq LIMIT $1",
                )
                .bind(limit as i64)
                .fetch_all(&self.pool)
                .await?;
                rows.iter().map(event_from_row).collect()
            }

            async fn mark_relayed(&self, events: &[(RunId, u64)]) -> Result<()> {
                if events.is_empty() {
                    return Ok(());
                }
                let mut tx = self.pool.begin().await?;
                for (run, seq) in events {
                    sqlx::query("UPDATE sa_events SET relayed = 1 WHERE run_id = $1 AND seq = $2")
                        .bind(run.to_string())
                        .bind(*seq as i64)
                        .execute(&mut *tx)
                        .await?;
                }
                tx.commit().await?;
                Ok(())
            }

            fn wake_local(&self, run: RunId, cancel: bool) {
                self.notifier.notify(run);
                if cancel {
                    self.cancels.notify(run);
                }
            }
        }
    };
}
