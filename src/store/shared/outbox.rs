//! [`Outbox`](crate::store::Outbox) for every [`SqlStore`]: what the relay reads and marks.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::{ColumnIndex, Decode, Encode, Executor, IntoArguments, Type};

use super::*;

#[async_trait]
impl<S> Outbox for S
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
{
    async fn unrelayed(&self, limit: u32) -> Result<Vec<EventRecord>> {
        self.unrelayed_events(limit).await
    }

    async fn mark_relayed(&self, ranges: &[(RunId, u64, u64)]) -> Result<()> {
        if ranges.is_empty() {
            return Ok(());
        }
        self.mark_relayed_ranges(ranges).await
    }

    fn open_handoff(&self) {
        self.notifier().open_handoff();
    }

    fn take_handed(&self) -> crate::notify::Handed {
        self.notifier().take_handed()
    }

    fn wake_local(&self, run: RunId, wake: Wake) {
        self.notifier().heard(run, wake != Wake::Progress);
        if wake == Wake::Cancel {
            // A cancel, or a message sent to the run: written by another process.
            self.notifier().forget_seq(run);
            self.cancels().notify(run);
        }
    }
}
