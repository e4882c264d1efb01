//! `/v1/approvals`: the owner's inbox of tool calls waiting for a person, and the answer that
//! resumes the run.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use utoipa::{IntoParams, ToSchema};

use super::auth::Owner;
use super::views::ErrorBody;
use super::{ApiError, ApiJson, ApiQuery, ApiState};
use crate::domain::{Answered, Approval, ApprovalAnswer, ApprovalStatus};
use crate::ids::ApprovalId;

/// Query of `GET /v1/approvals`.
#[derive(Deserialize, Debug, IntoParams)]
#[serde(deny_unknown_fields)]
pub struct ApprovalsQuery {
    /// `pending`, `allowed`, `denied` or `expired`.
    status: Option<String>,
    /// Only this run's.
    run_id: Option<String>,
    /// `next_cursor` of the previous page.
    cursor: Option<String>,
    /// 1..=200, default 50.
    #[param(minimum = 1, maximum = 200)]
    limit: Option<u32>,
}

/// A page of approvals, newest first.
#[derive(Serialize, Debug, ToSchema)]
pub struct ApprovalsPage {
    /// The approvals.
    pub approvals: Vec<Approval>,
    /// Pass as `cursor` for the next page; absent on the last.
    #[schema(value_type = Option<String>)]
    pub next_cursor: Option<ApprovalId>,
}

/// The answer to an approval.
#[derive(Deserialize, Debug, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AnswerBody {
    /// `allow` or `deny`.
    decision: String,
    /// Why; the model sees it on a deny.
    reason: Option<String>,
    /// Arguments to run the call with instead (allow only).
    #[schema(value_type = Option<Object>)]
    updated_input: Option<Value>,
    /// `once` (default) or `run_tree`: allow this tool for the whole run tree.
    scope: Option<String>,
}

/// `GET /v1/approvals`: the owner's approvals, newest first (a child's show with its root run).
#[utoipa::path(get, path = "/v1/approvals", tag = "approvals", params(ApprovalsQuery),
    responses((status = 200, body = ApprovalsPage), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn list(
    State(state): State<ApiState>,
    owner: Owner,
    ApiQuery(q): ApiQuery<ApprovalsQuery>,
) -> Result<Json<ApprovalsPage>, ApiError> {
    let status = q
        .status
        .as_deref()
        .map(|s| {
            ApprovalStatus::parse(s).ok_or_else(|| {
                ApiError::bad_request(
                    "invalid_status",
                    format!("status `{s}` is not pending, allowed, denied or expired"),
                )
            })
        })
        .transpose()?;
    let run = q
        .run_id
        .as_deref()
        .map(|r| {
            r.parse()
                .map_err(|_| ApiError::bad_request("invalid_id", format!("`{r}` is not a run id")))
        })
        .transpose()?;
    let limit = q.limit.unwrap_or(50);
    if !(1..=200).contains(&limit) {
        return Err(ApiError::bad_request(
            "invalid_limit",
            "limit must be 1 to 200",
        ));
    }
    if let Some(c) = &q.cursor
        && (!c.starts_with("apr_") || c.len() > 64)
    {
        return Err(ApiError::bad_request(
            "invalid_cursor",
            "cursor must be the next_cursor of an earlier page",
        ));
    }
    let approvals = state
        .app
        .store
        .list_approvals(
            &owner.0,
            status,
            run,
            q.cursor.as_deref().map(ApprovalId::from).as_ref(),
            limit,
        )
        .await?;
    let next_cursor = (approvals.len() == limit as usize)
        .then(|| approvals.last().map(|a| a.id.clone()))
        .flatten();
    Ok(Json(ApprovalsPage {
        approvals,
        next_cursor,
    }))
}

/// `GET /v1/approvals/{id}`
#[utoipa::path(get, path = "/v1/approvals/{id}", tag = "approvals", params(("id" = String, Path, description = "approval id")),
    responses((status = 200, body = Approval), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn get(
    State(state): State<ApiState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<Json<Approval>, ApiError> {
    owned(&state, &owner, &id).await.map(Json)
}

async fn owned(state: &ApiState, owner: &Owner, id: &str) -> Result<Approval, ApiError> {
    // Another owner's approval answers exactly like a missing one.
    match state.app.store.approval(&ApprovalId::from(id)).await? {
        Some(a)
            if state
                .app
                .store
                .get_run(a.run_id)
                .await?
                .is_some_and(|r| r.owner == owner.0) =>
        {
            Ok(a)
        }
        _ => Err(ApiError::not_found("approval")),
    }
}

/// `POST /v1/approvals/{id}`: allow or deny; the run resumes. 409 `already_resolved` once it
/// was answered, expired, or its run ended.
#[utoipa::path(post, path = "/v1/approvals/{id}", tag = "approvals", params(("id" = String, Path, description = "approval id")), request_body = AnswerBody,
    responses((status = 200, body = Approval), (status = 409, description = "already_resolved", body = ErrorBody), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody), (status = 422, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn answer(
    State(state): State<ApiState>,
    owner: Owner,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<AnswerBody>,
) -> Result<Json<Approval>, ApiError> {
    let allow = match body.decision.as_str() {
        "allow" => true,
        "deny" => false,
        other => {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_request",
                format!("decision `{other}` is not allow or deny"),
            ));
        }
    };
    let run_tree = match body.scope.as_deref().unwrap_or("once") {
        "once" => false,
        "run_tree" => true,
        other => {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_request",
                format!("scope `{other}` is not once or run_tree"),
            ));
        }
    };
    if body
        .updated_input
        .as_ref()
        .is_some_and(|u| !u.is_object() || !allow)
    {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
            "updated_input must be a JSON object, and only with allow",
        ));
    }
    if body.reason.as_ref().is_some_and(|r| r.len() > 4000) {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
            "reason is longer than 4000 bytes",
        ));
    }
    let answer = ApprovalAnswer {
        allow,
        reason: body.reason,
        updated_input: body.updated_input,
        run_tree,
        by: owner.0.to_string(),
    };
    match state
        .app
        .answer_approval(&ApprovalId::from(id.as_str()), &owner.0, answer)
        .await?
    {
        Answered::Done { .. } => owned(&state, &owner, &id).await.map(Json),
        Answered::NotFound => Err(ApiError::not_found("approval")),
        Answered::Closed(status) => Err(ApiError {
            status: StatusCode::CONFLICT,
            code: "already_resolved",
            message: format!(
                "approval {id} is {} already; it cannot be answered",
                status.as_str()
            ),
            details: Some(json!({"status": status})),
        }),
    }
}
