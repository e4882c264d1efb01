//! `/v1/webhooks`: an owner's subscriptions (the signing secret shown only on creation and on
//! rotation), their deliveries, and a redelivery. What is sent and when: `crate::webhooks`.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::auth::Owner;
use super::views::ErrorBody;
use super::{ApiError, ApiJson, ApiQuery, ApiState};
use crate::domain::webhook::{self, Delivery, EVENT_TYPES, Webhook, WebhookPatch};
use crate::ids::OwnerId;

/// Subscriptions one owner may have.
const MAX_PER_OWNER: usize = 50;

/// A subscription as the API shows it.
#[derive(Serialize, Debug, ToSchema)]
pub struct WebhookView {
    /// `wh_…`.
    pub id: String,
    /// Where deliveries go.
    pub url: String,
    /// Event types, or `["*"]`.
    pub events: Vec<String>,
    /// Only runs of these agents (absent: every agent).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agents: Option<Vec<String>>,
    /// The owner's note.
    pub description: String,
    /// The signing secret: only in the answers to a creation and a rotation.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
    /// Whether deliveries are held back.
    pub paused: bool,
    /// Why (a pause by its owner, or the failures that paused it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub paused_reason: Option<String>,
    /// Until when the secret before the last rotation still signs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub old_secret_valid_until: Option<DateTime<Utc>>,
    /// Created.
    pub created_at: DateTime<Utc>,
}

impl WebhookView {
    fn of(h: Webhook, with_secret: bool) -> WebhookView {
        WebhookView {
            secret: with_secret.then(|| h.secret.clone()),
            paused: h.paused_reason.is_some(),
            old_secret_valid_until: h
                .old_secret
                .as_ref()
                .and_then(|(_, until)| DateTime::from_timestamp_millis(*until))
                .filter(|t| *t > Utc::now()),
            id: h.id,
            url: h.url,
            events: h.events,
            agents: h.agents,
            description: h.description,
            paused_reason: h.paused_reason,
            created_at: h.created_at,
        }
    }
}

/// The body of `POST /v1/webhooks`.
#[derive(Deserialize, Debug, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewWebhookBody {
    /// An http(s) URL; its host must resolve to a public address unless the operator allows
    /// it (`SUBAGENTS_WEBHOOK_ALLOW`).
    url: String,
    /// Event types (`run.started`, `run.succeeded`, `run.failed`, `run.cancelled`,
    /// `approval.requested`, `approval.resolved`), or `["*"]`.
    events: Vec<String>,
    /// Only runs of these agents.
    agents: Option<Vec<String>>,
    /// A note (at most 500 characters).
    description: Option<String>,
}

/// The body of `PATCH /v1/webhooks/{id}`: what to change.
#[derive(Deserialize, Debug, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PatchWebhookBody {
    url: Option<String>,
    events: Option<Vec<String>>,
    /// `null` clears the filter.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<Vec<String>>)]
    agents: Option<Option<Vec<String>>>,
    description: Option<String>,
    /// `true` holds deliveries back; `false` resumes them (what was held back goes out).
    paused: Option<bool>,
}

/// Tells an absent field (`None`) from a `null` one (`Some(None)`).
fn present<'de, D, T>(d: D) -> Result<Option<Option<T>>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(d).map(Some)
}

/// The owner's subscriptions.
#[derive(Serialize, Debug, ToSchema)]
pub struct WebhooksList {
    /// Oldest first.
    pub webhooks: Vec<WebhookView>,
}

/// A page of deliveries.
#[derive(Serialize, Debug, ToSchema)]
pub struct DeliveriesPage {
    /// Newest first.
    pub deliveries: Vec<Delivery>,
    /// Pass as `cursor` for the next page; absent on the last.
    pub next_cursor: Option<String>,
}

/// Query of `GET /v1/webhooks/{id}/deliveries`.
#[derive(Deserialize, Debug, IntoParams)]
#[serde(deny_unknown_fields)]
pub struct DeliveriesQuery {
    /// `next_cursor` of the previous page.
    cursor: Option<String>,
    /// 1..=200, default 50.
    #[param(minimum = 1, maximum = 200)]
    limit: Option<u32>,
}

fn invalid(message: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_webhook", message)
}

/// Checks a destination: scheme, host, and the address guard.
pub(super) async fn check_url(state: &ApiState, url: &str) -> Result<(), ApiError> {
    let parsed =
        reqwest::Url::parse(url).map_err(|e| invalid(format!("`url` is not a URL: {e}")))?;
    if !matches!(parsed.scheme(), "http" | "https") || parsed.host_str().is_none() {
        return Err(invalid("`url` must be an http or https URL with a host"));
    }
    let guard = crate::tools::WebFetch::webhook_guard(state.app.settings.webhook_allow_hosts());
    guard.check(&parsed).await.map_err(|e| {
        ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            e.code.as_str(),
            format!("the destination is refused: {}", e.message),
        )
    })?;
    Ok(())
}

pub(super) fn check_events(events: &[String]) -> Result<(), ApiError> {
    if events.is_empty() {
        return Err(invalid("`events` names no event type; use [\"*\"] for all"));
    }
    if let Some(bad) = events
        .iter()
        .find(|e| *e != "*" && !EVENT_TYPES.contains(&e.as_str()))
    {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "unknown_event_type",
            format!(
                "`{bad}` is not an event type a webhook can receive; use one of {} or \"*\"",
                EVENT_TYPES.join(", ")
            ),
        ));
    }
    Ok(())
}

fn check_description(d: &str) -> Result<(), ApiError> {
    if d.chars().count() > 500 {
        return Err(invalid("`description` is longer than 500 characters"));
    }
    Ok(())
}

async fn owned(state: &ApiState, owner: &OwnerId, id: &str) -> Result<Webhook, ApiError> {
    state
        .app
        .store
        .get_webhook(owner, id)
        .await?
        .ok_or_else(|| ApiError::not_found("webhook"))
}

/// `POST /v1/webhooks`: subscribes a URL to the owner's events. The answer carries the signing
/// secret, shown this once.
#[utoipa::path(post, path = "/v1/webhooks", tag = "webhooks", request_body = NewWebhookBody,
    responses((status = 201, body = WebhookView), (status = 401, body = ErrorBody), (status = 409, body = ErrorBody), (status = 422, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn create(
    State(state): State<ApiState>,
    owner: Owner,
    ApiJson(body): ApiJson<NewWebhookBody>,
) -> Result<(StatusCode, Json<WebhookView>), ApiError> {
    check_events(&body.events)?;
    let description = body.description.unwrap_or_default();
    check_description(&description)?;
    check_url(&state, &body.url).await?;
    let store = state.app.store.as_ref();
    if store.list_webhooks(&owner.0).await?.len() >= MAX_PER_OWNER {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "too_many_webhooks",
            format!("an owner may have {MAX_PER_OWNER} webhooks; delete one first"),
        ));
    }
    let now = Utc::now();
    let hook = Webhook {
        id: webhook::new_webhook_id(),
        owner: owner.0,
        url: body.url,
        events: body.events,
        agents: body.agents,
        description,
        secret: webhook::new_secret(),
        old_secret: None,
        paused_reason: None,
        run_id: None,
        created_at: now,
        updated_at: now,
    };
    store.create_webhook(&hook).await?;
    Ok((StatusCode::CREATED, Json(WebhookView::of(hook, true))))
}

/// `GET /v1/webhooks`: the owner's subscriptions (without their secrets).
#[utoipa::path(get, path = "/v1/webhooks", tag = "webhooks",
    responses((status = 200, body = WebhooksList), (status = 401, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn list(
    State(state): State<ApiState>,
    owner: Owner,
) -> Result<Json<WebhooksList>, ApiError> {
    let hooks = state.app.store.list_webhooks(&owner.0).await?;
    Ok(Json(WebhooksList {
        webhooks: hooks
            .into_iter()
            .map(|h| WebhookView::of(h, false))
            .collect(),
    }))
}

/// `GET /v1/webhooks/{id}`.
#[utoipa::path(get, path = "/v1/webhooks/{id}", tag = "webhooks", params(("id" = String, Path, description = "webhook id")),
    responses((status = 200, body = WebhookView), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn get(
    State(state): State<ApiState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<Json<WebhookView>, ApiError> {
    Ok(Json(WebhookView::of(
        owned(&state, &owner.0, &id).await?,
        false,
    )))
}

/// `PATCH /v1/webhooks/{id}`: changes the destination, the filters or the note; pauses or
/// resumes it (a resume sends what was held back).
#[utoipa::path(patch, path = "/v1/webhooks/{id}", tag = "webhooks", params(("id" = String, Path, description = "webhook id")), request_body = PatchWebhookBody,
    responses((status = 200, body = WebhookView), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody), (status = 422, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn update(
    State(state): State<ApiState>,
    owner: Owner,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<PatchWebhookBody>,
) -> Result<Json<WebhookView>, ApiError> {
    owned(&state, &owner.0, &id).await?;
    if let Some(events) = &body.events {
        check_events(events)?;
    }
    if let Some(d) = &body.description {
        check_description(d)?;
    }
    if let Some(url) = &body.url {
        check_url(&state, url).await?;
    }
    let patch = WebhookPatch {
        url: body.url,
        events: body.events,
        agents: body.agents,
        description: body.description,
        paused: body.paused,
    };
    let hook = state
        .app
        .store
        .update_webhook(&owner.0, &id, patch)
        .await?
        .ok_or_else(|| ApiError::not_found("webhook"))?;
    Ok(Json(WebhookView::of(hook, false)))
}

/// `DELETE /v1/webhooks/{id}`: the subscription and its deliveries.
#[utoipa::path(delete, path = "/v1/webhooks/{id}", tag = "webhooks", params(("id" = String, Path, description = "webhook id")),
    responses((status = 204), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn delete(
    State(state): State<ApiState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    if state.app.store.delete_webhook(&owner.0, &id).await? {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::not_found("webhook"))
    }
}

/// `POST /v1/webhooks/{id}/rotate`: a new secret (shown this once); the old one keeps signing
/// beside it for 24 hours, so receivers can switch without missing a delivery.
#[utoipa::path(post, path = "/v1/webhooks/{id}/rotate", tag = "webhooks", params(("id" = String, Path, description = "webhook id")),
    responses((status = 200, body = WebhookView), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn rotate(
    State(state): State<ApiState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<Json<WebhookView>, ApiError> {
    let until = Utc::now().timestamp_millis() + webhook::ROTATION_GRACE.as_millis() as i64;
    let hook = state
        .app
        .store
        .rotate_webhook_secret(&owner.0, &id, &webhook::new_secret(), until)
        .await?
        .ok_or_else(|| ApiError::not_found("webhook"))?;
    Ok(Json(WebhookView::of(hook, true)))
}

/// `GET /v1/webhooks/{id}/deliveries`: newest first, with their attempts and the receiver's
/// last answer.
#[utoipa::path(get, path = "/v1/webhooks/{id}/deliveries", tag = "webhooks", params(("id" = String, Path, description = "webhook id"), DeliveriesQuery),
    responses((status = 200, body = DeliveriesPage), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn deliveries(
    State(state): State<ApiState>,
    owner: Owner,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<DeliveriesQuery>,
) -> Result<Json<DeliveriesPage>, ApiError> {
    let limit = q.limit.unwrap_or(50);
    if !(1..=200).contains(&limit) {
        return Err(ApiError::bad_request(
            "invalid_limit",
            "limit must be 1 to 200",
        ));
    }
    owned(&state, &owner.0, &id).await?;
    let mut page = state
        .app
        .store
        .list_deliveries(&id, q.cursor.as_deref(), limit + 1)
        .await?;
    let next_cursor = if page.len() > limit as usize {
        page.truncate(limit as usize);
        page.last().map(|d| d.id.clone())
    } else {
        None
    };
    Ok(Json(DeliveriesPage {
        deliveries: page,
        next_cursor,
    }))
}

/// `POST /v1/webhooks/{id}/deliveries/{delivery}/redeliver`: sends a delivery again (same
/// `webhook-id`), with a fresh retry window.
#[utoipa::path(post, path = "/v1/webhooks/{id}/deliveries/{delivery}/redeliver", tag = "webhooks",
    params(("id" = String, Path, description = "webhook id"), ("delivery" = String, Path, description = "delivery id")),
    responses((status = 202), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn redeliver(
    State(state): State<ApiState>,
    owner: Owner,
    Path((id, delivery)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    owned(&state, &owner.0, &id).await?;
    if state.app.store.redeliver(&id, &delivery).await? {
        Ok(StatusCode::ACCEPTED)
    } else {
        Err(ApiError::not_found("delivery"))
    }
}
