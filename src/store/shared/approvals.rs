//! [`Approvals`](crate::store::Approvals) for every [`SqlStore`]: tool-call decisions and
//! approvals.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::{ColumnIndex, Decode, Encode, Executor, IntoArguments, Row, Type};

use super::*;

#[async_trait]
impl<S> Approvals for S
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
    async fn tool_decision(&self, key: &str) -> Result<Option<Value>> {
        let d: Option<String> =
            sqlx::query_scalar("SELECT decision FROM sa_tool_decisions WHERE key = $1")
                .bind(key)
                .fetch_optional(self.pool())
                .await?;
        d.map(|d| serde_json::from_str(&d).map_err(|e| corrupt("tool decision", e)))
            .transpose()
    }

    async fn commit_decision(
        &self,
        lease: &Lease,
        key: &str,
        decision: Value,
        approval: Option<NewApproval>,
        events: Vec<NewEvent>,
    ) -> Result<()> {
        let now = Utc::now();
        let mut tx = self.pool().begin().await?;
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
        if inserted == 1
            && let Some(a) = approval
        {
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
        self.commit_events(tx, lease.run_id, last, &events).await
    }

    async fn approval(&self, id: &ApprovalId) -> Result<Option<Approval>> {
        let row = sqlx::query("SELECT * FROM sa_approvals WHERE id = $1")
            .bind(id)
            .fetch_optional(self.reads())
            .await?;
        row.as_ref().map(S::approval_from_row).transpose()
    }

    async fn expire_approval(&self, id: &ApprovalId) -> Result<bool> {
        let done = sqlx::query(
            "UPDATE sa_approvals SET status = 'expired', answer_reason = 'nobody answered before the approval timeout', resolved_by = 'timeout', resolved_at = $1 \
             WHERE id = $2 AND status = 'pending' AND expires_at <= $3",
        )
        .bind(Utc::now())
        .bind(id)
        .bind(now_ms())
        .execute(self.pool())
        .await?
        .rows_affected();
        Ok(done == 1)
    }

    async fn has_grant(&self, root: RunId, tool: &str) -> Result<bool> {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM sa_grants WHERE root_run_id = $1 AND tool = $2",
        )
        .bind(root.to_string())
        .bind(tool)
        .fetch_one(self.pool())
        .await?;
        Ok(n > 0)
    }

    async fn list_approvals(
        &self,
        owner: &OwnerId,
        status: Option<ApprovalStatus>,
        run: Option<RunId>,
        before: Option<&ApprovalId>,
        limit: u32,
    ) -> Result<Vec<Approval>> {
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
        .bind(before.map(ApprovalId::as_str))
        .bind(limit as i64)
        .fetch_all(self.reads())
        .await?;
        rows.iter().map(S::approval_from_row).collect()
    }

    async fn answer_approval(
        &self,
        id: &ApprovalId,
        owner: &OwnerId,
        answer: ApprovalAnswer,
    ) -> Result<Answered> {
        let now = Utc::now();
        let mut tx = self.pool().begin().await?;
        let status = if answer.allow {
            ApprovalStatus::Allowed
        } else {
            ApprovalStatus::Denied
        };
        let scope = if answer.run_tree {
            ApprovalScope::RunTree
        } else {
            ApprovalScope::Once
        };
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
            let existing: Option<(ApprovalStatus, OwnerId)> =
                sqlx::query_as("SELECT status, owner FROM sa_approvals WHERE id = $1")
                    .bind(id)
                    .fetch_optional(self.pool())
                    .await?;
            return Ok(match existing {
                Some((st, o)) if o == *owner => {
                    // Pending but past its time, or its run ended: closed either way.
                    Answered::Closed(if st == ApprovalStatus::Pending {
                        ApprovalStatus::Expired
                    } else {
                        st
                    })
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
        let event = Event::ApprovalResolved(event::ApprovalResolved {
            approval_id: id.clone(),
            tool,
            decision: status,
            reason: answer.reason.clone(),
            scope,
        });
        Self::insert_events(
            &mut tx,
            run_id,
            seq as u64,
            &[event.into()],
            self.relayed_at_insert(),
        )
        .await?;
        tx.commit().await?;
        self.notifier().notify(run_id);
        Ok(Answered::Done { run_id })
    }
}
