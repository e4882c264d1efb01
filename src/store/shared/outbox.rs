//! [`Outbox`](crate::store::Outbox) for both backends: what the relay reads and marks. The
//! statements both backends share; a backend's own items come in as `extra`. Invoked by
//! `store_impl!`.

/// Implements [`Outbox`](crate::store::Outbox) for `$store` (see `store_impl!` for the parameters).
macro_rules! outbox_impl {
    ($store:ty, $db:ty, $jobs:literal, $reads_first:literal, $share:literal, $owner_unindexed:literal, { $($extra:tt)* }) => {
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
