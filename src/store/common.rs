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
            .bind($ff.status)
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
/// whose apalis job table is `$jobs`: the helpers below, the shared statements of each trait
/// (`shared/`, one file per trait), and the backend's own start (`runs`), claim (`claims`) and
/// checkpoint (`checkpoints`). How a park orders its reads and its fence is the one locking
/// difference between the backends (`park_reads_first`, and `share`: the lock clause of those
/// reads).
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
                        let owner: OwnerId = row.get(1);
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
            async fn answered(tx: &mut sqlx::Transaction<'_, $db>, approvals: &[ApprovalId]) -> Result<bool> {
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

        runs_impl!($store, $db, $jobs, $reads_first, $share, $owner_unindexed, { $($runs)* });
        claims_impl!($store, $db, $jobs, $reads_first, $share, $owner_unindexed, { $($claims)* });
        checkpoints_impl!($store, $db, $jobs, $reads_first, $share, $owner_unindexed, { $($checkpoints)* });
        parking_impl!($store, $db, $jobs, $reads_first, $share, $owner_unindexed, {});
        approvals_impl!($store, $db, $jobs, $reads_first, $share, $owner_unindexed, {});
        rate_budgets_impl!($store, $db, $jobs, $reads_first, $share, $owner_unindexed, {});
        queries_impl!($store, $db, $jobs, $reads_first, $share, $owner_unindexed, {});
        harness_impl!($store, $db, $jobs, $reads_first, $share, $owner_unindexed, {});
        outbox_impl!($store, $db, $jobs, $reads_first, $share, $owner_unindexed, {});
    };
}
