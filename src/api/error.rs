//! The API's one error type: a stable machine `code`, the right status, and a message that says
//! what to fix. Internal details go to the log, never into the response.

use axum::Json;
use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::app::StartError;
use crate::store::StoreError;

/// An error answer.
#[derive(Debug)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Stable code, e.g. `thread_busy`.
    pub code: &'static str,
    /// For people: what happened and what to do.
    pub message: String,
    /// Extra machine-readable fields (e.g. `active_run_id`).
    pub details: Option<serde_json::Value>,
}

impl ApiError {
    /// Shorthand.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            details: None,
        }
    }

    /// 404 `not_found`: also what another owner's ids answer, so they cannot be probed.
    pub fn not_found(what: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no {what} with that id"),
        )
    }

    /// 400 for a malformed parameter.
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut err = json!({"code": self.code, "message": self.message});
        if let Some(serde_json::Value::Object(d)) = self.details {
            for (k, v) in d {
                err[k] = v;
            }
        }
        (self.status, Json(json!({ "error": err }))).into_response()
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Busy {
                thread_id,
                active_run,
            } => ApiError {
                status: StatusCode::CONFLICT,
                code: "thread_busy",
                message: format!(
                    "thread {thread_id} is busy with run {active_run}; wait for it, or start with \"if_busy\": \"enqueue\" to run after it"
                ),
                details: Some(json!({"active_run_id": active_run})),
            },
            StoreError::ThreadOwnedElsewhere(_) => ApiError::not_found("thread"),
            StoreError::QueueFull { cap } => ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "queue_full",
                format!(
                    "this key already has {cap} runs queued (SUBAGENTS_MAX_QUEUED_PER_KEY); wait for some to start, or cancel some"
                ),
            ),
            other => {
                tracing::error!(error = %other, "storage error");
                ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "storage_unavailable",
                    "the database is unavailable; retry shortly",
                )
            }
        }
    }
}

impl From<StartError> for ApiError {
    fn from(e: StartError) -> Self {
        let code = e.code();
        match e {
            StartError::Store(s) => s.into(),
            StartError::UnknownAgent { .. } => {
                ApiError::new(StatusCode::NOT_FOUND, code, e.to_string())
            }
            StartError::InputTooLarge { .. } => {
                ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, code, e.to_string())
            }
            StartError::NotRetryable(_) => ApiError::new(StatusCode::CONFLICT, code, e.to_string()),
            _ => ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, code, e.to_string()),
        }
    }
}

impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> Self {
        match r {
            JsonRejection::JsonDataError(e) => ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_request",
                format!(
                    "the request body does not match the schema: {}",
                    e.body_text()
                ),
            ),
            JsonRejection::JsonSyntaxError(e) => ApiError::bad_request(
                "malformed_json",
                format!("the request body is not valid JSON: {}", e.body_text()),
            ),
            JsonRejection::MissingJsonContentType(_) => ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                "send the body as JSON with Content-Type: application/json",
            ),
            JsonRejection::BytesRejection(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "payload_too_large",
                    "the request body is larger than the server accepts (SUBAGENTS_MAX_INPUT_BYTES)",
                )
            }
            other => ApiError::bad_request("bad_body", other.body_text()),
        }
    }
}

impl From<QueryRejection> for ApiError {
    fn from(r: QueryRejection) -> Self {
        ApiError::bad_request(
            "invalid_query",
            format!("bad query parameters: {}", r.body_text()),
        )
    }
}

impl From<PathRejection> for ApiError {
    fn from(r: PathRejection) -> Self {
        ApiError::bad_request("invalid_path", r.body_text())
    }
}
