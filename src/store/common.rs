//! The SQL both backends share, written once. Every statement here is valid on SQLite and on
//! PostgreSQL (`$N` placeholders, which sqlx binds positionally on both; `CAST` instead of
//! `::`), so [`store_impl!`] instantiates it for each backend beside the few statements that
//! really differ (start, claim, checkpoint, park, listing, orphans), which each backend passes
//! in. Status guards come from [`crate::lifecycle::sql_sources`], so a statement can only apply
//! a move the state machine allows.

/// The `WHERE status IN (…)` list for a transition, computed once.
macro_rules! sources {
    ($t:expr) => {{
        static S: std::sync::LazyLock<String> =
            std::sync::LazyLock::new(|| crate::lifecycle::sql_sources($t));
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

/// The claim's concurrency guard (a `WHERE` fragment on `sa_runs`): the run's owner below its
/// limit (its own, else the default `*`), and its agent below its own. Nothing to check when
/// `sa_limits` is empty, which the first probe of each `NOT EXISTS` finds at once.
macro_rules! limits_guard {
    () => {
        " AND NOT EXISTS (SELECT 1 FROM sa_limits l WHERE \
           (l.key = 'owner:' || sa_runs.owner OR (l.key = '*' AND NOT EXISTS (SELECT 1 FROM sa_limits lo WHERE lo.key = 'owner:' || sa_runs.owner))) \
           AND l.concurrency <= (SELECT COUNT(*) FROM sa_runs o WHERE o.owner = sa_runs.owner AND o.status = 'running')) \
         AND NOT EXISTS (SELECT 1 FROM sa_limits l WHERE l.key = 'agent:' || sa_runs.agent \
           AND l.concurrency <= (SELECT COUNT(*) FROM sa_runs g WHERE g.agent = sa_runs.agent AND g.status = 'running'))"
    };
}

/// The columns of a run, in the order `run_from_row` reads them.
macro_rules! run_columns {
    () => {
        "id, thread_id, owner, agent, status, input, metadata, limits, parent_run_id, root_run_id, depth, detached, \
    wake_at, claimed_from, step, forced, \
    result, error_kind, error_message, prompt_tokens, completion_tokens, attempts, crashes, lease_epoch, cancel_requested, \
    job_id, event_seq, created_at, started_at, finished_at, heartbeat_at, cost_nanos, retry_of, priority"
    };
}

/// Implements the store traits (the parts of [`RunLog`](super::RunLog), [`Queries`](super::Queries),
/// [`Outbox`](super::Outbox), [`Harness`](super::Harness)) for `$store` on sqlx database `$db`,
/// whose apalis job table is `$jobs`: the shared statements below plus the backend's own start
/// (`runs`), claim (`claims`) and checkpoint (`checkpoints`). How a
/// park orders its reads and its fence is the one locking difference between the backends
/// (`park_reads_first`, and `share`: the lock clause of those reads).
macro_rules! store_impl {
    ($store:ty, $db:ty, $jobs:literal, park_reads_first = $reads_first:literal, share = $share:literal, owner_unindexed = $owner_unindexed:literal, runs = { $($runs:tt)* }, claims = { $($claims:tt)* }, checkpoints = { $($checkpoints:tt)* } $(,)?) => {
        impl $store {
            /// A run's place in its owner's queue: the runs queued ahead of it by `place`, and its
            /// priority; None if there is no such run. Read from `sa_queue_depth`, which triggers
            /// keep (migrations */queue_depth): one row per owner and priority (and stripe),
            /// whatever the backlog. On any executor, so a start can read it in its transaction.
            async fn rank_in<'e, E: sqlx::Executor<'e, Database = $db>>(exec: E, run: RunId, place: QueuePlace) -> Result<Option<(u32, u8)>> {
                let row = sqlx::query(
                    "SELECT CAST(COALESCE((SELECT SUM(d.queued) FROM sa_queue_depth d WHERE d.owner = r.owner \
                       AND (d.priority > r.priority OR ($2 AND d.priority = r.priority))), 0) AS BIGINT), \
                       r.priority, CASE WHEN r.status = 'queued' THEN 1 ELSE 0 END \
                     FROM sa_runs r WHERE r.id = $1",
                )
                .bind(run.to_string())
                .bind(place == QueuePlace::Back)
                .fetch_optional(exec)
                .await?;
                Ok(row.map(|r| {
                    // At the back, the run does not count itself.
                    let ahead = r.get::<i64, _>(0) - if place == QueuePlace::Back { i64::from(r.get::<i32, _>(2)) } else { 0 };
                    (ahead.clamp(0, i64::from(u32::MAX)) as u32, r.get::<i64, _>(1).clamp(1, 5) as u8)
                }))
            }

            /// Inserts a commit's events in one statement (one round trip, whatever their number).
            async fn insert_events(
                tx: &mut sqlx::Transaction<'_, $db>,
                run: RunId,
                first_seq: u64,
                events: &[NewEvent],
                relayed: i64,
            ) -> Result<()> {
                if events.is_empty() {
                    return Ok(());
                }
                let now = Utc::now();
                let run = run.to_string();
                let mut q = sqlx::QueryBuilder::<$db>::new("INSERT INTO sa_events (run_id, seq, type, data, created_at, relayed) ");
                q.push_values(events.iter().enumerate(), |mut b, (i, ev)| {
                    b.push_bind(run.clone())
                        .push_bind((first_seq + i as u64) as i64)
                        .push_bind(ev.kind())
                        .push_bind(ev.data().to_string())
                        .push_bind(now)
                        .push_bind(relayed);
                });
                q.build().execute(&mut **tx).await?;
                Ok(())
            }

            /// Inserts `events` as the run's seqs ending at `last` (where the fence just moved
            /// `event_seq`), commits, and wakes this process's waiters on the run.
            async fn commit_events(&self, mut tx: sqlx::Transaction<'_, $db>, run: RunId, last: i64, events: &[NewEvent]) -> Result<()> {
                Self::insert_events(&mut tx, run, (last - events.len() as i64 + 1) as u64, events, self.relayed_at_insert()).await?;
                tx.commit().await?;
                self.notifier.notify(run);
                Ok(())
            }

            /// What every terminal transition commits with it, whichever way the run ended
            /// (finish, cancel, give-up): the parent's `child.finished` event (unless the parent
            /// has ended: nothing follows a terminal event), the wake-up of every run parked on
            /// this one (a parent only wakes for the children it waits on: a detached child
            /// ending does not disturb it), the end of this run's own waits, and the end of its
            /// attached children.
            #[allow(clippy::too_many_arguments)]
            async fn terminal_effects(
                tx: &mut sqlx::Transaction<'_, $db>,
                run: RunId,
                thread: &str,
                parent: Option<&str>,
                status: RunStatus,
                error: Option<&RunError>,
                reach: Reach,
                relayed: i64,
            ) -> Result<()> {
                if let Some(parent) = parent {
                    let row = sqlx::query(
                        "UPDATE sa_runs SET event_seq = event_seq + 1 \
                         WHERE id = $1 AND status IN ('queued','running','waiting') RETURNING event_seq, owner",
                    )
                    .bind(parent)
                    .fetch_optional(&mut **tx)
                    .await?;
                    if let Some(row) = row {
                        let seq: i64 = row.get(0);
                        // As the owner (the parent's, so the child's) chose it.
                        let owner: String = row.get(1);
                        let shown = thread.parse::<ThreadId>().map(|t| t.visible_to(&owner).to_string()).unwrap_or_else(|_| thread.to_owned());
                        let event = Event::ChildFinished(event::ChildFinished { child_run_id: run, thread_id: shown, status, error: error.cloned() });
                        let parent_id: RunId = parent.parse().map_err(|e| corrupt("parent id", e))?;
                        Self::insert_events(tx, parent_id, seq as u64, &[event.into()], relayed).await?;
                    }
                }
                if reach.waits {
                    Self::end_waits(tx, &run.to_string()).await?;
                }
                if reach.children {
                    Self::end_attached_children(tx, run, relayed).await?;
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
            async fn end_attached_children(tx: &mut sqlx::Transaction<'_, $db>, run: RunId, relayed: i64) -> Result<()> {
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
                        let parent_run_id = Some(parent.parse().map_err(|e| corrupt("parent id", e))?);
                        let event = Event::RunCancelled(event::RunCancelled { reason: Some("parent_ended".into()), parent_run_id, while_: None });
                        Self::insert_events(tx, child, seq as u64, &[event.into()], relayed).await?;
                        Self::end_waits(tx, &id).await?;
                        stack.push(id);
                    }
                }
                Ok(())
            }
        }

        impl $store {
            /// Tells the store whether a relay takes its events to Redis (this process has a
            /// `REDIS_URL`); without one, its events are written as relayed from now on.
            pub fn relaying(mut self, relays: bool) -> Self {
                self.relays = relays;
                self
            }

            /// The `relayed` column of an event written now.
            fn relayed_at_insert(&self) -> i64 {
                i64::from(!self.relays)
            }

            /// Whether any of `targets` has ended (or is missing): a park on them is due at once.
            /// Opens a write made under a lease besides a checkpoint (a compaction, a tool
            /// decision): `statement` proves the epoch ([`Transition::Heartbeat`]), renews the
            /// lease and reserves `events` seqs; its row (`RETURNING event_seq, …`) comes back.
            async fn fence(
                tx: &mut sqlx::Transaction<'_, $db>,
                lease: &Lease,
                events: usize,
                now: DateTime<Utc>,
                statement: &'static str,
            ) -> Result<<$db as sqlx::Database>::Row> {
                let row = sqlx::query(sqlx::AssertSqlSafe(statement))
                    .bind(events as i64)
                    .bind(now_ms() + lease.ttl.as_millis() as i64)
                    .bind(now)
                    .bind(lease.run_id.to_string())
                    .bind(lease.epoch)
                    .fetch_optional(&mut **tx)
                    .await?;
                row.ok_or(StoreError::LeaseLost(lease.run_id))
            }

            /// Whether an approval a park waits on is no longer pending (read with the same lock
            /// as the runs in [`Self::any_ended`]).
            async fn answered(tx: &mut sqlx::Transaction<'_, $db>, approvals: &[String]) -> Result<bool> {
                let mut answered = false;
                for id in approvals {
                    let status: Option<String> = sqlx::query_scalar(concat!("SELECT status FROM sa_approvals WHERE id = $1", $share))
                        .bind(id)
                        .fetch_optional(&mut **tx)
                        .await?;
                    answered |= status.as_deref() != Some("pending");
                }
                Ok(answered)
            }

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
        impl Runs for $store {
            $($runs)*

            async fn get_run(&self, id: RunId) -> Result<Option<RunRecord>> {
                let row = sqlx::query(concat!("SELECT ", run_columns!(), " FROM sa_runs WHERE id = $1"))
                    .bind(id.to_string())
                    .fetch_optional(self.reads())
                    .await?;
                row.as_ref().map(run_from_row).transpose()
            }

            async fn events_after(&self, run: RunId, after: u64, limit: u32) -> Result<Vec<EventRecord>> {
                let rows = sqlx::query(
                    "SELECT run_id, seq, type, data, created_at FROM sa_events WHERE run_id = $1 AND seq > $2 ORDER BY seq LIMIT $3",
                )
                .bind(run.to_string())
                .bind(after.min(i64::MAX as u64) as i64)
                .bind(limit as i64)
                .fetch_all(self.reads())
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
                            &[Event::RunCancelled(event::RunCancelled { while_: Some(state), ..Default::default() }).into()],
                            self.relayed_at_insert(),
                        )
                        .await?;
                        Self::terminal_effects(&mut tx, run, &thread, parent.as_deref(), RunStatus::Cancelled, None, Reach::ALL, self.relayed_at_insert()).await?;
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

            async fn next_queued(&self, thread: &ThreadId) -> Result<Option<RunId>> {
                let id: Option<String> = sqlx::query_scalar(concat!(
                    "SELECT id FROM (SELECT id, job_id FROM sa_runs WHERE thread_id = $1 AND status = 'queued' ORDER BY id LIMIT 1) r \
                     WHERE NOT EXISTS (SELECT 1 FROM ", $jobs, " j WHERE j.id = r.job_id AND j.status = 'Pending')"
                ))
                .bind(thread.as_str())
                .fetch_optional(&self.pool)
                .await?;
                id.map(|i| i.parse().map_err(|e| corrupt("run id", e))).transpose()
            }

            fn subscribe(&self, run: RunId) -> std::sync::Arc<crate::notify::Signal> {
                self.notifier.subscribe(run)
            }

            fn subscribe_cancel(&self, run: RunId) -> std::sync::Arc<crate::notify::Signal> {
                self.cancels.subscribe(run)
            }

            async fn children(&self, run: RunId) -> Result<Vec<RunRecord>> {
                let rows = sqlx::query(concat!("SELECT ", run_columns!(), " FROM sa_runs WHERE parent_run_id = $1 ORDER BY id"))
                    .bind(run.to_string())
                    .fetch_all(self.reads())
                    .await?;
                rows.iter().map(run_from_row).collect()
            }

            async fn tree_totals(&self, run: RunId) -> Result<TreeTotals> {
                let row = sqlx::query(
                    "WITH RECURSIVE tree(id) AS (SELECT CAST($1 AS TEXT) UNION ALL \
                       SELECT r.id FROM sa_runs r JOIN tree t ON r.parent_run_id = t.id) \
                     SELECT CAST(COALESCE(SUM(prompt_tokens), 0) AS BIGINT), CAST(COALESCE(SUM(completion_tokens), 0) AS BIGINT), \
                       CAST(COALESCE(SUM(step), 0) AS BIGINT), CAST(COALESCE(SUM(cost_nanos), 0) AS BIGINT) \
                     FROM sa_runs WHERE id IN (SELECT id FROM tree)",
                )
                .bind(run.to_string())
                .fetch_one(self.reads())
                .await?;
                Ok(TreeTotals {
                    usage: Usage { prompt_tokens: row.get::<i64, _>(0) as u64, completion_tokens: row.get::<i64, _>(1) as u64 },
                    steps: row.get::<i64, _>(2) as u64,
                    cost_nanos: row.get::<i64, _>(3).max(0) as u64,
                })
            }
        }

        #[async_trait]
        impl Claims for $store {
            $($claims)*

            async fn renew_lease(&self, lease: &Lease) -> Result<LeaseStatus> {
                // With whatever other runs renew now, in one statement (see `group::GroupRenew`).
                match self.renewals.renew(&self.commits(), lease).await? {
                    Some(cancel_requested) => Ok(LeaseStatus { cancel_requested }),
                    None => Err(StoreError::LeaseLost(lease.run_id)),
                }
            }

            async fn release_lease(&self, lease: &Lease, job_id: &str, after_failure: bool) -> Result<bool> {
                debug_assert_eq!(crate::lifecycle::target(Transition::Release), RunStatus::Queued);
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
                .execute(&self.pool)
                .await?
                .rows_affected();
                if done > 0 {
                    self.notifier.notify(lease.run_id);
                }
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
                        &[Event::RunFailed(event::RunFailed { error: error.clone(), crashes: Some(crashes.max(0) as u32) }).into()],
                        self.relayed_at_insert(),
                    )
                    .await?;
                    Self::terminal_effects(&mut tx, run, &thread, parent.as_deref(), RunStatus::Failed, Some(&error), Reach::ALL, self.relayed_at_insert()).await?;
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

            async fn fetched_not_started(&self, worker: &str) -> Result<Vec<RunId>> {
                let ids: Vec<String> = sqlx::query_scalar(concat!(
                    "SELECT r.id FROM sa_runs r JOIN ", $jobs, " j ON j.id = r.job_id \
                     WHERE r.status = 'queued' AND j.lock_by = $1 AND j.status IN ('Queued', 'Running')"
                ))
                .bind(worker)
                .fetch_all(&self.pool)
                .await?;
                ids.iter().map(|id| id.parse().map_err(|e| corrupt("run id", e))).collect()
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

            async fn queue_rank(&self, run: RunId, place: QueuePlace) -> Result<(u32, u8)> {
                Ok(Self::rank_in(&self.pool, run, place).await?.unwrap_or((0, 3)))
            }

            async fn at_limit(&self, run: RunId) -> Result<bool> {
                let held: Option<i64> = sqlx::query_scalar(concat!(
                    "SELECT CAST(1 AS BIGINT) FROM sa_runs WHERE id = $1 AND status IN ('queued', 'waiting') AND NOT (1 = 1 ",
                    limits_guard!(),
                    ")"
                ))
                .bind(run.to_string())
                .fetch_optional(&self.pool)
                .await?;
                Ok(held.is_some())
            }

            async fn set_limits(&self, prefix: &str, entries: &[(String, u32)]) -> Result<()> {
                let mut tx = self.pool.begin().await?;
                sqlx::query("DELETE FROM sa_limits WHERE key LIKE $1").bind(format!("{prefix}%")).execute(&mut *tx).await?;
                for (key, n) in entries.iter().filter(|(k, n)| *n > 0 && k.starts_with(prefix)) {
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
                let any: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM sa_limits)").fetch_one(&self.pool).await?;
                self.limits_seen.store(any, std::sync::atomic::Ordering::Relaxed);
                Ok(any)
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
        }

        #[async_trait]
        impl Checkpoints for $store {
            $($checkpoints)*

            async fn messages_after(&self, thread: &ThreadId, after: i64, limit: u32) -> Result<Vec<StoredMessage>> {
                let rows = sqlx::query(
                    "SELECT id, run_id, step, key, body FROM (SELECT id, run_id, step, key, body FROM sa_messages \
                     WHERE thread_id = $1 AND id > $2 ORDER BY id DESC LIMIT $3) t ORDER BY id",
                )
                .bind(thread.as_str())
                .bind(after)
                .bind(limit as i64)
                .fetch_all(self.reads())
                .await?;
                rows.iter().map(message_from_row).collect()
            }

            async fn context(&self, thread: &ThreadId, limit: u32) -> Result<(Option<Compaction>, Vec<StoredMessage>)> {
                // The compaction's row (part 0) and the messages after it (part 1), each
                // mapped by its own columns' names.
                let rows = sqlx::query(
                    "WITH c AS (SELECT id, run_id, first_message_id, last_message_id, messages, summary, tokens_before, \
                       tokens_after, reason, created_at FROM sa_compactions WHERE thread_id = $1 ORDER BY id DESC LIMIT 1) \
                     SELECT 0 AS part, id, run_id, first_message_id, last_message_id, messages, summary, tokens_before, \
                       tokens_after, reason, created_at, NULL AS step, NULL AS key, NULL AS body FROM c \
                     UNION ALL \
                     SELECT 1, id, run_id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, step, key, body \
                     FROM (SELECT id, run_id, step, key, body FROM sa_messages \
                       WHERE thread_id = $1 AND id > COALESCE((SELECT last_message_id FROM c), 0) ORDER BY id DESC LIMIT $2) m \
                     ORDER BY part, id",
                )
                .bind(thread.as_str())
                .bind(limit as i64)
                .fetch_all(&self.pool)
                .await?;
                let mut compaction = None;
                let mut messages = Vec::with_capacity(rows.len());
                for r in &rows {
                    if r.get::<i32, _>("part") == 0 {
                        compaction = Some(compaction_from_row(r)?);
                    } else {
                        messages.push(message_from_row(r)?);
                    }
                }
                Ok((compaction, messages))
            }

            async fn latest_compaction(&self, thread: &ThreadId) -> Result<Option<Compaction>> {
                let row = sqlx::query(
                    "SELECT id, run_id, first_message_id, last_message_id, messages, summary, tokens_before, \
                     tokens_after, reason, created_at FROM sa_compactions WHERE thread_id = $1 ORDER BY id DESC LIMIT 1",
                )
                .bind(thread.as_str())
                .fetch_optional(self.reads())
                .await?;
                row.as_ref().map(compaction_from_row).transpose()
            }

            async fn commit_compaction(&self, lease: &Lease, c: CompactionBody, spent: (Usage, u64), events: Vec<NewEvent>) -> Result<()> {
                let now = Utc::now();
                let mut tx = self.pool.begin().await?;
                // The fence first, as in a checkpoint: it proves the epoch and reserves the seqs.
                let row = Self::fence(&mut tx, lease, events.len(), now, sql!(
                    "UPDATE sa_runs SET event_seq = event_seq + $1, lease_expires_at = $2, heartbeat_at = $3, updated_at = $3 \
                     WHERE id = $4 AND lease_epoch = $5 AND status IN ({}) RETURNING event_seq, thread_id",
                    Transition::Heartbeat
                )).await?;
                let last: i64 = row.get(0);
                let thread: String = row.get(1);
                // The summary call is a model call: its tokens and cost count in the run's usage.
                let (usage, cost) = spent;
                if usage.total() > 0 || cost > 0 {
                    sqlx::query(
                        "UPDATE sa_runs SET prompt_tokens = prompt_tokens + $1, completion_tokens = completion_tokens + $2, cost_nanos = cost_nanos + $3 WHERE id = $4",
                    )
                    .bind(usage.prompt_tokens as i64)
                    .bind(usage.completion_tokens as i64)
                    .bind(cost.min(i64::MAX as u64) as i64)
                    .bind(lease.run_id.to_string())
                    .execute(&mut *tx)
                    .await?;
                }
                sqlx::query(
                    "INSERT INTO sa_compactions (thread_id, run_id, key, first_message_id, last_message_id, messages, \
                     summary, tokens_before, tokens_after, reason, created_at) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) ON CONFLICT(key) DO NOTHING",
                )
                .bind(&thread)
                .bind(lease.run_id.to_string())
                .bind(format!("{}:compact:{}-{}", lease.run_id, c.first_message_id, c.last_message_id))
                .bind(c.first_message_id)
                .bind(c.last_message_id)
                .bind(c.messages)
                .bind(&c.summary)
                .bind(c.tokens_before)
                .bind(c.tokens_after)
                .bind(&c.reason)
                .bind(now)
                .execute(&mut *tx)
                .await?;
                self.commit_events(tx, lease.run_id, last, &events).await
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
                self.commit_events(tx, run, last, &events).await?;
                Ok(true)
            }
        }

        #[async_trait]
        impl Parking for $store {
            async fn park(&self, lease: &Lease, park: Park) -> Result<Parked> {
                debug_assert!(park.wake_at.is_some() || !park.waits_on.is_empty() || !park.approvals.is_empty(), "a park needs something to wake it");
                let now = Utc::now();
                let mut tx = self.pool.begin().await?;
                // Either order leaves no window: a child that ends now either commits first (and
                // is seen ended here) or after this park (and then finds it parked and wakes it).
                let mut due = $reads_first && (Self::any_ended(&mut tx, &park.waits_on).await? || Self::answered(&mut tx, &park.approvals).await?);
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
                    due = Self::any_ended(&mut tx, &park.waits_on).await? || Self::answered(&mut tx, &park.approvals).await?;
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
                self.commit_events(tx, lease.run_id, last, &park.events).await?;
                Ok(Parked::Parked { due })
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
        impl Approvals for $store {
            async fn tool_decision(&self, key: &str) -> Result<Option<Value>> {
                let d: Option<String> = sqlx::query_scalar("SELECT decision FROM sa_tool_decisions WHERE key = $1").bind(key).fetch_optional(&self.pool).await?;
                d.map(|d| serde_json::from_str(&d).map_err(|e| corrupt("tool decision", e))).transpose()
            }

            async fn commit_decision(&self, lease: &Lease, key: &str, decision: Value, approval: Option<NewApproval>, events: Vec<NewEvent>) -> Result<()> {
                let now = Utc::now();
                let mut tx = self.pool.begin().await?;
                let row = Self::fence(&mut tx, lease, events.len(), now, sql!(
                    "UPDATE sa_runs SET event_seq = event_seq + $1, lease_expires_at = $2, heartbeat_at = $3, updated_at = $3 \
                     WHERE id = $4 AND lease_epoch = $5 AND status IN ({}) RETURNING event_seq, COALESCE(root_run_id, id), owner",
                    Transition::Heartbeat
                )).await?;
                let last: i64 = row.get(0);
                let root: String = row.get(1);
                let owner: String = row.get(2);
                let inserted = sqlx::query("INSERT INTO sa_tool_decisions (key, run_id, decision, created_at) VALUES ($1, $2, $3, $4) ON CONFLICT(key) DO NOTHING")
                    .bind(key)
                    .bind(lease.run_id.to_string())
                    .bind(decision.to_string())
                    .bind(now)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                if inserted == 1 {
                    if let Some(a) = approval {
                        sqlx::query(
                            "INSERT INTO sa_approvals (id, run_id, root_run_id, owner, call_key, tool, input, reason, status, created_at, expires_at, grant_scope) \
                             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 'pending', $9, $10, $11) ON CONFLICT(call_key) DO NOTHING",
                        )
                        .bind(&a.id)
                        .bind(lease.run_id.to_string())
                        .bind(&root)
                        .bind(&owner)
                        .bind(key)
                        .bind(&a.tool)
                        .bind(a.input.to_string())
                        .bind(&a.reason)
                        .bind(now)
                        .bind(a.expires_at)
                        .bind(&a.grant_scope)
                        .execute(&mut *tx)
                        .await?;
                    }
                }
                self.commit_events(tx, lease.run_id, last, &events).await
            }

            async fn approval(&self, id: &str) -> Result<Option<Approval>> {
                let row = sqlx::query("SELECT * FROM sa_approvals WHERE id = $1").bind(id).fetch_optional(self.reads()).await?;
                row.as_ref().map(approval_from_row).transpose()
            }

            async fn expire_approval(&self, id: &str) -> Result<bool> {
                let done = sqlx::query(
                    "UPDATE sa_approvals SET status = 'expired', answer_reason = 'nobody answered before the approval timeout', resolved_by = 'timeout', resolved_at = $1 \
                     WHERE id = $2 AND status = 'pending' AND expires_at <= $3",
                )
                .bind(Utc::now())
                .bind(id)
                .bind(now_ms())
                .execute(&self.pool)
                .await?
                .rows_affected();
                Ok(done == 1)
            }

            async fn has_grant(&self, root: RunId, tool: &str) -> Result<bool> {
                let n: i64 = sqlx::query_scalar("SELECT count(*) FROM sa_grants WHERE root_run_id = $1 AND tool = $2")
                    .bind(root.to_string())
                    .bind(tool)
                    .fetch_one(&self.pool)
                    .await?;
                Ok(n > 0)
            }

            async fn list_approvals(&self, owner: &str, status: Option<ApprovalStatus>, run: Option<RunId>, before: Option<&str>, limit: u32) -> Result<Vec<Approval>> {
                // A pending approval whose run ended (cancelled, timed out) is closed, not pending.
                let rows = sqlx::query(
                    "SELECT a.* FROM sa_approvals a JOIN sa_runs r ON r.id = a.run_id WHERE a.owner = $1 \
                     AND ($2 IS NULL OR a.status = $2) AND ($3 IS NULL OR a.run_id = $3) AND ($4 IS NULL OR a.id < $4) \
                     AND ($2 IS NULL OR $2 <> 'pending' OR r.status = 'waiting' OR r.status = 'running' OR r.status = 'queued') \
                     ORDER BY a.id DESC LIMIT $5",
                )
                .bind(owner)
                .bind(status.map(ApprovalStatus::as_str))
                .bind(run.map(|r| r.to_string()))
                .bind(before)
                .bind(limit as i64)
                .fetch_all(self.reads())
                .await?;
                rows.iter().map(approval_from_row).collect()
            }

            async fn answer_approval(&self, id: &str, owner: &str, answer: ApprovalAnswer) -> Result<Answered> {
                let now = Utc::now();
                let mut tx = self.pool.begin().await?;
                let status = if answer.allow { "allowed" } else { "denied" };
                let scope = if answer.run_tree { "run_tree" } else { "once" };
                let row = sqlx::query(
                    "UPDATE sa_approvals SET status = $1, answer_reason = $2, updated_input = $3, scope = $4, resolved_at = $5, resolved_by = $9 \
                     WHERE id = $6 AND owner = $7 AND status = 'pending' AND expires_at > $8 \
                     AND run_id IN (SELECT id FROM sa_runs WHERE status IN ('waiting', 'running', 'queued')) \
                     RETURNING run_id, root_run_id, tool, COALESCE(grant_scope, tool)",
                )
                .bind(status)
                .bind(&answer.reason)
                .bind(answer.updated_input.as_ref().map(|v| v.to_string()))
                .bind(scope)
                .bind(now)
                .bind(id)
                .bind(owner)
                .bind(now_ms())
                .bind(&answer.by)
                .fetch_optional(&mut *tx)
                .await?;
                let Some(row) = row else {
                    tx.rollback().await?;
                    let existing: Option<(String, String)> = sqlx::query_as("SELECT status, owner FROM sa_approvals WHERE id = $1").bind(id).fetch_optional(&self.pool).await?;
                    return Ok(match existing {
                        Some((st, o)) if o == owner => {
                            let st = ApprovalStatus::parse(&st).ok_or_else(|| corrupt("approval status", &st))?;
                            // Pending but past its time, or its run ended: closed either way.
                            Answered::Closed(if st == ApprovalStatus::Pending { ApprovalStatus::Expired } else { st })
                        }
                        _ => Answered::NotFound,
                    });
                };
                let run: String = row.get(0);
                let root: String = row.get(1);
                let tool: String = row.get(2);
                let scope_key: String = row.get(3);
                if answer.allow && answer.run_tree {
                    sqlx::query("INSERT INTO sa_grants (root_run_id, tool, approval_id) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING")
                        .bind(&root)
                        .bind(&scope_key)
                        .bind(id)
                        .execute(&mut *tx)
                        .await?;
                }
                // Wake the run (it may still be running towards its park: the park then finds
                // the approval answered and is due at once) and tell its stream.
                let row = sqlx::query(sql!(
                    "UPDATE sa_runs SET event_seq = event_seq + 1, wake_at = CASE WHEN status IN ({}) THEN $1 ELSE wake_at END WHERE id = $2 RETURNING event_seq",
                    Transition::Wake
                ))
                    .bind(now_ms())
                    .bind(&run)
                    .fetch_one(&mut *tx)
                    .await?;
                let seq: i64 = row.get(0);
                let run_id: RunId = run.parse().map_err(|e| corrupt("approval run id", e))?;
                let event = Event::ApprovalResolved(event::ApprovalResolved { approval_id: id.to_owned(), tool, decision: status.to_owned(), reason: answer.reason.clone(), scope: scope.to_owned() });
                Self::insert_events(&mut tx, run_id, seq as u64, &[event.into()], self.relayed_at_insert()).await?;
                tx.commit().await?;
                self.notifier.notify(run_id);
                Ok(Answered::Done { run_id })
            }
        }

        #[async_trait]
        impl RateBudgets for $store {
            async fn take_budget(&self, key: &str, window_ms: i64, max_requests: Option<u64>, max_tokens: Option<u64>, tokens: u64) -> Result<Option<i64>> {
                let now = now_ms();
                let mut tx = self.pool.begin().await?;
                // The key's row is the lock: takers of one key go one at a time, on both backends.
                let (blocked_until, next_wake): (i64, i64) = sqlx::query_as(
                    "INSERT INTO sa_rate_keys (key, touched) VALUES ($1, $2) ON CONFLICT(key) DO UPDATE SET touched = $2 RETURNING blocked_until, next_wake",
                )
                .bind(key)
                .bind(now)
                .fetch_one(&mut *tx)
                .await?;
                // The provider said the budget is used up: nobody takes from it until then.
                if blocked_until > now {
                    tx.commit().await?;
                    return Ok(Some(blocked_until));
                }
                sqlx::query("DELETE FROM sa_rate_log WHERE key = $1 AND at <= $2").bind(key).bind(now - window_ms).execute(&mut *tx).await?;
                let row = sqlx::query(
                    "SELECT count(*), CAST(COALESCE(SUM(tokens), 0) AS BIGINT), CAST(COALESCE(MIN(at), 0) AS BIGINT) FROM sa_rate_log WHERE key = $1",
                )
                .bind(key)
                .fetch_one(&mut *tx)
                .await?;
                let (used, spent, oldest): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
                let over = max_requests.is_some_and(|m| used as u64 + 1 > m) || max_tokens.is_some_and(|m| used > 0 && spent as u64 + tokens > m);
                if over {
                    // Each refused taker gets its own slot: the first when the oldest call
                    // leaves the window, each next one a slot's share of the window later.
                    let at = super::next_wake(oldest + window_ms + 1, next_wake, window_ms, max_requests);
                    sqlx::query("UPDATE sa_rate_keys SET next_wake = $1 WHERE key = $2").bind(at).bind(key).execute(&mut *tx).await?;
                    tx.commit().await?;
                    return Ok(Some(at));
                }
                sqlx::query("INSERT INTO sa_rate_log (key, at, tokens) VALUES ($1, $2, $3)")
                    .bind(key)
                    .bind(now)
                    .bind(tokens.min(i64::MAX as u64) as i64)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                Ok(None)
            }

            async fn block_budget(&self, key: &str, until_ms: i64) -> Result<()> {
                sqlx::query(
                    "INSERT INTO sa_rate_keys (key, touched, blocked_until) VALUES ($1, $2, $3) ON CONFLICT(key) DO UPDATE SET \
                     blocked_until = CASE WHEN sa_rate_keys.blocked_until > EXCLUDED.blocked_until THEN sa_rate_keys.blocked_until ELSE EXCLUDED.blocked_until END",
                )
                .bind(key)
                .bind(now_ms())
                .bind(until_ms)
                .execute(&self.pool)
                .await?;
                Ok(())
            }

            async fn budget_blocked_until(&self, key: &str) -> Result<i64> {
                let until: Option<i64> = sqlx::query_scalar("SELECT blocked_until FROM sa_rate_keys WHERE key = $1").bind(key).fetch_optional(&self.pool).await?;
                Ok(until.unwrap_or(0))
            }

            async fn set_owner_budgets(&self, entries: &[(String, OwnerBudget)]) -> Result<()> {
                let mut tx = self.pool.begin().await?;
                sqlx::query("DELETE FROM sa_owner_budgets").execute(&mut *tx).await?;
                for (owner, b) in entries.iter().filter(|(_, b)| b.rpm.is_some() || b.tpm.is_some()) {
                    sqlx::query("INSERT INTO sa_owner_budgets (owner, rpm, tpm) VALUES ($1, $2, $3)")
                        .bind(owner)
                        .bind(b.rpm.map(|n| n.min(i64::MAX as u64) as i64))
                        .bind(b.tpm.map(|n| n.min(i64::MAX as u64) as i64))
                        .execute(&mut *tx)
                        .await?;
                }
                tx.commit().await?;
                Ok(())
            }

            async fn owner_budget(&self, owner: &str) -> Result<Option<OwnerBudget>> {
                let row: Option<(Option<i64>, Option<i64>)> =
                    sqlx::query_as("SELECT rpm, tpm FROM sa_owner_budgets WHERE owner = $1").bind(owner).fetch_optional(&self.pool).await?;
                Ok(row.map(|(rpm, tpm)| OwnerBudget { rpm: rpm.map(|n| n.max(0) as u64), tpm: tpm.map(|n| n.max(0) as u64) }))
            }
        }

        #[async_trait]
        impl Queries for $store {
            async fn overview(&self, owner: &str, hour: DateTime<Utc>, day: DateTime<Utc>, cap: u32) -> Result<OverviewData> {
                let mut out = OverviewData::default();
                for row in sqlx::query("SELECT status, COUNT(*) FROM sa_runs WHERE owner = $1 GROUP BY status").bind(owner).fetch_all(self.reads()).await? {
                    let s: String = row.get(0);
                    let status = RunStatus::parse(&s).ok_or_else(|| corrupt("status", &s))?;
                    out.by_status.push((status, row.get::<i64, _>(1) as u64));
                }
                out.oldest_queued_ms = sqlx::query_scalar("SELECT MIN(enqueued_at) FROM sa_runs WHERE owner = $1 AND status = 'queued'")
                    .bind(owner)
                    .fetch_one(self.reads())
                    .await?;
                // Events of the runs that were active in the last hour (finished in it, or not
                // finished): the runs come from indexes, their events from the primary key.
                // On SQLite `+owner` keeps the planner on the finished_at index (without
                // statistics it takes the owner index and walks every run the owner ever had);
                // PostgreSQL's planner needs no hint, and misjudges the hinted form.
                let rows = sqlx::query(concat!(
                    "SELECT e.run_id, e.type, e.data, e.created_at FROM sa_events e \
                     WHERE e.run_id IN (SELECT id FROM sa_runs WHERE finished_at >= $2 AND ", $owner_unindexed, " = $1 \
                                        UNION SELECT id FROM sa_runs WHERE owner = $1 AND status IN ('running', 'waiting')) \
                       AND e.type IN ('model.completed', 'run.succeeded', 'run.failed', 'run.cancelled') AND e.created_at >= $2 \
                     ORDER BY e.created_at DESC LIMIT $3",
                ))
                .bind(owner)
                .bind(hour)
                .bind(i64::from(cap) + 1)
                .fetch_all(self.reads())
                .await?;
                out.events_capped = rows.len() > cap as usize;
                for row in rows.iter().take(cap as usize) {
                    let run: String = row.get(0);
                    let data: String = row.get(2);
                    out.events.push((
                        run.parse().map_err(|e| corrupt("event run id", e))?,
                        row.get(1),
                        serde_json::from_str(&data).map_err(|e| corrupt("event data", e))?,
                        row.get(3),
                    ));
                }
                for row in sqlx::query(
                    "SELECT COALESCE(error_kind, 'unknown'), COUNT(*) FROM sa_runs \
                     WHERE owner = $1 AND finished_at >= $2 AND status = 'failed' GROUP BY error_kind",
                )
                .bind(owner)
                .bind(day)
                .fetch_all(self.reads())
                .await?
                {
                    out.failures.push((row.get(0), row.get::<i64, _>(1) as u64));
                }
                // No ORDER BY: sorting by id would walk the (owner, id) index over every run.
                for row in sqlx::query("SELECT id, lease_owner, heartbeat_at FROM sa_runs WHERE owner = $1 AND status = 'running' LIMIT 500")
                    .bind(owner)
                    .fetch_all(self.reads())
                    .await?
                {
                    let id: String = row.get(0);
                    out.running.push((id.parse().map_err(|e| corrupt("run id", e))?, row.get(1), row.get(2)));
                }
                out.workers = self.workers().await?;
                Ok(out)
            }

            async fn list_runs(&self, owner: &str, f: &RunFilter, limit: u32) -> Result<Vec<RunRecord>> {
                let mut q = sqlx::QueryBuilder::<$db>::new(concat!("SELECT ", run_columns!(), " FROM sa_runs WHERE owner = "));
                q.push_bind(owner.to_owned());
                if !f.status.is_empty() {
                    q.push(" AND status IN (");
                    let mut list = q.separated(", ");
                    for s in &f.status {
                        list.push_bind(s.as_str());
                    }
                    list.push_unseparated(")");
                }
                if let Some(a) = &f.agent {
                    q.push(" AND agent = ").push_bind(a.clone());
                }
                if let Some(t) = &f.thread_id {
                    q.push(" AND thread_id = ").push_bind(t.as_str().to_owned());
                }
                if let Some(p) = f.parent_run_id {
                    q.push(" AND parent_run_id = ").push_bind(p.to_string());
                }
                if let Some(text) = &f.text {
                    // LIKE's wildcards in the text are matched literally.
                    let pattern = format!("%{}%", text.to_lowercase().replace('\\', "\\\\").replace('%', "\\%").replace('_', "\\_"));
                    q.push(" AND (LOWER(input) LIKE ").push_bind(pattern.clone()).push(" ESCAPE '\\' OR LOWER(COALESCE(result, '')) LIKE ").push_bind(pattern).push(" ESCAPE '\\')");
                }
                // Ids are time-ordered: a time range is an id range, served by the primary key.
                if let Some(t) = f.created_after {
                    q.push(" AND id >= ").push_bind(RunId::lower_bound(t).to_string());
                }
                if let Some(t) = f.created_before {
                    q.push(" AND id < ").push_bind(RunId::lower_bound(t).to_string());
                }
                if let Some(c) = f.before {
                    q.push(if f.oldest_first { " AND id > " } else { " AND id < " }).push_bind(c.to_string());
                }
                q.push(if f.oldest_first { " ORDER BY id ASC LIMIT " } else { " ORDER BY id DESC LIMIT " }).push_bind(i64::from(limit));
                let rows = q.build().fetch_all(self.reads()).await?;
                rows.iter().map(run_from_row).collect()
            }

            async fn get_thread(&self, id: &ThreadId) -> Result<Option<ThreadRecord>> {
                let row = sqlx::query("SELECT id, owner, created_at, updated_at FROM sa_threads WHERE id = $1")
                    .bind(id.as_str())
                    .fetch_optional(self.reads())
                    .await?;
                Ok(row.map(|r| ThreadRecord {
                    id: id.clone(),
                    owner: r.get("owner"),
                    created_at: r.get("created_at"),
                    updated_at: r.get("updated_at"),
                }))
            }

            async fn compactions(&self, thread: &ThreadId) -> Result<Vec<Compaction>> {
                let rows = sqlx::query(
                    "SELECT id, run_id, first_message_id, last_message_id, messages, summary, tokens_before, \
                     tokens_after, reason, created_at FROM sa_compactions WHERE thread_id = $1 ORDER BY id",
                )
                .bind(thread.as_str())
                .fetch_all(self.reads())
                .await?;
                rows.iter().map(compaction_from_row).collect()
            }

            async fn messages_page(&self, thread: &ThreadId, after: i64, limit: u32) -> Result<Vec<StoredMessage>> {
                let rows = sqlx::query(
                    "SELECT id, run_id, step, key, body FROM sa_messages WHERE thread_id = $1 AND id > $2 ORDER BY id LIMIT $3",
                )
                .bind(thread.as_str())
                .bind(after)
                .bind(limit as i64)
                .fetch_all(self.reads())
                .await?;
                rows.iter().map(message_from_row).collect()
            }

            async fn queue_position(&self, run: RunId) -> Result<i64> {
                // Jobs go by rank in their owner's queue: ahead of a run of rank r are the r
                // runs ahead in its own owner's queue and, from every other owner, its first
                // r + 1 queued runs (at most). One statement: a runs page asks for each run.
                let n: Option<i64> = sqlx::query_scalar(
                    "WITH me AS (SELECT owner, priority, id FROM sa_runs WHERE id = $1), \
                     rk AS (SELECT COUNT(*) AS r FROM sa_runs q, me WHERE q.owner = me.owner AND q.status = 'queued' \
                       AND (q.priority > me.priority OR (q.priority = me.priority AND q.id < me.id))), \
                     per_owner AS (SELECT COUNT(*) AS n FROM sa_runs o, me WHERE o.status = 'queued' AND o.owner <> me.owner GROUP BY o.owner) \
                     SELECT CAST(rk.r + COALESCE((SELECT SUM(CASE WHEN n < rk.r + 1 THEN n ELSE rk.r + 1 END) FROM per_owner), 0) AS BIGINT) \
                     FROM rk, me",
                )
                .bind(run.to_string())
                .fetch_optional(self.reads())
                .await?;
                Ok(n.unwrap_or(0))
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
                .fetch_all(self.reads())
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

            async fn queued_count(&self, owner: &str) -> Result<u64> {
                let n: i64 = sqlx::query_scalar("SELECT CAST(COALESCE(SUM(queued), 0) AS BIGINT) FROM sa_queue_depth WHERE owner = $1")
                    .bind(owner)
                    .fetch_one(self.reads())
                    .await?;
                Ok(n.max(0) as u64)
            }

            async fn status_counts(&self) -> Result<Vec<(RunStatus, i64)>> {
                let rows = sqlx::query("SELECT status, count(*) FROM sa_runs GROUP BY status").fetch_all(self.reads()).await?;
                rows.iter()
                    .map(|r| {
                        let s: String = r.get(0);
                        Ok((RunStatus::parse(&s).ok_or_else(|| corrupt("status", &s))?, r.get::<i64, _>(1)))
                    })
                    .collect()
            }

            fn subscribe_all(&self) -> std::sync::Arc<crate::notify::Signal> {
                self.notifier.subscribe_all()
            }
        }

        #[async_trait]
        impl Harness for $store {
            async fn wake(&self, run: RunId) -> Result<bool> {
                let done = sqlx::query(sql!("UPDATE sa_runs SET wake_at = $1 WHERE id = $2 AND status IN ({})", Transition::Wake))
                    .bind(now_ms())
                    .bind(run.to_string())
                    .execute(&self.pool)
                    .await?
                    .rows_affected();
                Ok(done > 0)
            }

            async fn seed_history(&self, owner: &str, count: u32, now: DateTime<Utc>) -> Result<()> {
                const BATCH: u32 = 500;
                let mut done = 0;
                while done < count {
                    let n = BATCH.min(count - done);
                    let rows = super::seed::seed_rows(done, n, now);
                    let mut tx = self.pool.begin().await?;
                    let mut q = sqlx::QueryBuilder::<$db>::new("INSERT INTO sa_threads (id, owner, created_at, updated_at) ");
                    q.push_values(&rows, |mut b, r| {
                        b.push_bind(r.1.clone()).push_bind(owner.to_owned()).push_bind(r.2).push_bind(r.2);
                    });
                    q.build().execute(&mut *tx).await?;
                    let mut q = sqlx::QueryBuilder::<$db>::new(
                        "INSERT INTO sa_runs (id, thread_id, owner, agent, status, input, metadata, limits, step, result, error_kind, error_message, \
                         prompt_tokens, completion_tokens, cost_nanos, attempts, event_seq, job_id, enqueued_at, created_at, started_at, finished_at, updated_at) ",
                    );
                    q.push_values(&rows, |mut b, r| {
                        let ok = r.4 == "succeeded";
                        b.push_bind(r.0.clone())
                            .push_bind(r.1.clone())
                            .push_bind(owner.to_owned())
                            .push_bind("general-purpose")
                            .push_bind(r.4)
                            .push_bind(format!("Seeded task {} for the dashboard benchmark", r.0))
                            .push_bind("{}")
                            .push_bind(r#"{"max_steps":25,"timeout_secs":600}"#)
                            .push_bind(if r.3.is_some() { 3i64 } else { 0 })
                            .push_bind(ok.then(|| "seeded result".to_owned()))
                            .push_bind(r.5)
                            .push_bind(r.5.map(|k| format!("seeded {k} failure")))
                            .push_bind(if r.3.is_some() { 5400i64 } else { 0 })
                            .push_bind(if r.3.is_some() { 300i64 } else { 0 })
                            .push_bind(if r.3.is_some() { 13_200_000i64 } else { 0 })
                            .push_bind(if r.3.is_some() { 1i64 } else { 0 })
                            .push_bind(if r.6 && r.3.is_some() { 5i64 } else { 1 })
                            .push_bind(format!("seed-{}", r.0))
                            .push_bind(r.2.timestamp_millis())
                            .push_bind(r.2)
                            .push_bind(r.3.map(|_| r.2))
                            .push_bind(r.3)
                            .push_bind(r.3.unwrap_or(r.2));
                    });
                    q.build().execute(&mut *tx).await?;
                    // The last hour's runs get the events the overview's charts read.
                    let mut events = vec![];
                    for r in rows.iter().filter(|r| r.6) {
                        let Some(fin) = r.3 else {
                            events.push((r.0.clone(), 1i64, "run.queued", "{}".to_owned(), r.2));
                            continue;
                        };
                        events.push((r.0.clone(), 1, "run.queued", "{}".to_owned(), r.2));
                        let span = (fin - r.2) / 4;
                        for k in 1..=3i64 {
                            let data = serde_json::json!({"step": k, "model": "gpt-4.1-mini", "ms": 400 + 50 * k, "usage": {"prompt_tokens": 1800, "completion_tokens": 100}, "cost_usd": 0.00088, "tool_calls": []});
                            events.push((r.0.clone(), k + 1, "model.completed", data.to_string(), r.2 + span * k as i32));
                        }
                        let end = match r.4 { "succeeded" => "run.succeeded", "failed" => "run.failed", _ => "run.cancelled" };
                        events.push((r.0.clone(), 5, end, "{}".to_owned(), fin));
                    }
                    if !events.is_empty() {
                        let mut q = sqlx::QueryBuilder::<$db>::new("INSERT INTO sa_events (run_id, seq, type, data, created_at, relayed) ");
                        q.push_values(&events, |mut b, e| {
                            b.push_bind(e.0.clone()).push_bind(e.1).push_bind(e.2).push_bind(e.3.clone()).push_bind(e.4).push_bind(1i64);
                        });
                        q.build().execute(&mut *tx).await?;
                    }
                    tx.commit().await?;
                    done += n;
                }
                Ok(())
            }

            async fn wipe(&self) -> Result<()> {
                let mut tx = self.pool.begin().await?;
                for t in ["sa_events", "sa_compactions", "sa_tool_decisions", "sa_approvals", "sa_grants", "sa_messages", "sa_run_waits", "sa_runs", "sa_threads", "sa_waits"] {
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
                    .fetch_one(self.reads())
                    .await?)
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

            async fn mark_relayed(&self, ranges: &[(RunId, u64, u64)]) -> Result<()> {
                if ranges.is_empty() {
                    return Ok(());
                }
                Self::mark_relayed_ranges(&self.pool, ranges).await
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
