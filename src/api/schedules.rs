//! `/v1/schedules`: an owner's schedules, with their next fire times and recent runs; pause,
//! resume and trigger. What fires and when: `crate::schedules`.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use super::auth::Owner;
use super::views::ErrorBody;
use super::{ApiError, ApiJson, ApiState};
use crate::domain::schedule::{self, CatchUp, Clock, Overlap, Schedule};
use crate::ids::{OwnerId, RunId};
use crate::store::RunStatus;

/// Schedules one owner may have.
const MAX_PER_OWNER: usize = 100;

/// One of a schedule's recent runs.
#[derive(Serialize, Debug, ToSchema)]
pub struct ScheduledRun {
    /// The run.
    #[schema(value_type = String)]
    pub run_id: RunId,
    /// The tick it fired for.
    pub scheduled_for: DateTime<Utc>,
    /// Its state.
    pub status: RunStatus,
}

/// A schedule as the API shows it.
#[derive(Serialize, Debug, ToSchema)]
pub struct ScheduleView {
    /// `sch_…`.
    pub id: String,
    /// Five fields, or six with seconds first.
    pub cron: String,
    /// IANA time zone.
    pub timezone: String,
    /// The agent its runs run.
    pub agent: String,
    /// Their input.
    pub input: String,
    /// The thread every run continues; absent: a new thread each time.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub thread_id: Option<String>,
    /// Whether each run gets a new thread.
    pub new_thread_each_time: bool,
    /// What a tick does when the previous run is still going.
    pub overlap: Overlap,
    /// Which missed ticks fire after downtime.
    pub catch_up: CatchUp,
    /// Paused schedules fire nothing.
    pub paused: bool,
    /// Given to each run (with `schedule_id`).
    #[schema(value_type = Object)]
    pub metadata: Value,
    /// The runs' priority.
    pub priority: u8,
    /// The next five ticks (none while paused).
    pub next_fire_times: Vec<DateTime<Utc>>,
    /// The latest runs it started, newest first.
    pub recent_runs: Vec<ScheduledRun>,
    /// Created.
    pub created_at: DateTime<Utc>,
    /// Last changed.
    pub updated_at: DateTime<Utc>,
}

impl ScheduleView {
    async fn build(state: &ApiState, s: Schedule) -> Result<ScheduleView, ApiError> {
        let next_fire_times = match (s.paused, Clock::new(&s.cron, &s.timezone)) {
            (false, Ok(clock)) => std::iter::once(s.next_fire_at)
                .chain(clock.upcoming(s.next_fire_at, 4))
                .filter_map(DateTime::from_timestamp_millis)
                .collect(),
            _ => vec![],
        };
        let recent_runs = state
            .app
            .store
            .schedule_runs(&s.id, 10)
            .await?
            .into_iter()
            .filter_map(|(tick, run_id, status)| {
                Some(ScheduledRun {
                    run_id,
                    scheduled_for: DateTime::from_timestamp_millis(tick)?,
                    status,
                })
            })
            .collect();
        Ok(ScheduleView {
            new_thread_each_time: s.thread_id.is_none(),
            id: s.id,
            cron: s.cron,
            timezone: s.timezone,
            agent: s.agent,
            input: s.input,
            thread_id: s.thread_id,
            overlap: s.overlap,
            catch_up: s.catch_up,
            paused: s.paused,
            metadata: s.metadata,
            priority: s.priority,
            next_fire_times,
            recent_runs,
            created_at: s.created_at,
            updated_at: s.updated_at,
        })
    }
}

/// The body of `POST /v1/schedules`.
#[derive(Deserialize, Debug, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewScheduleBody {
    /// Five fields (minute hour day month weekday), or six with seconds first.
    cron: String,
    /// IANA time zone; default `UTC`.
    timezone: Option<String>,
    /// Agent; default `general-purpose`.
    agent: Option<String>,
    /// The task every run gets.
    input: String,
    /// Continue this thread at every tick (one of it or `new_thread_each_time`).
    thread_id: Option<String>,
    /// A new thread at every tick (the default without `thread_id`).
    new_thread_each_time: Option<bool>,
    /// `skip`, `enqueue` (default) or `cancel_previous`.
    overlap: Option<Overlap>,
    /// `none` (default), `last` or `all` (the latest 100).
    catch_up: Option<CatchUp>,
    /// Created paused.
    paused: Option<bool>,
    /// Given to each run.
    #[schema(value_type = Option<Object>)]
    metadata: Option<Value>,
    /// 1..=5, default 3.
    priority: Option<u8>,
}

/// The body of `PATCH /v1/schedules/{id}`: what to change.
#[derive(Deserialize, Debug, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PatchScheduleBody {
    cron: Option<String>,
    timezone: Option<String>,
    agent: Option<String>,
    input: Option<String>,
    /// A thread to continue; `null` with `new_thread_each_time: true` for a new one each time.
    thread_id: Option<String>,
    new_thread_each_time: Option<bool>,
    overlap: Option<Overlap>,
    catch_up: Option<CatchUp>,
    paused: Option<bool>,
    #[schema(value_type = Option<Object>)]
    metadata: Option<Value>,
    priority: Option<u8>,
}

/// The owner's schedules.
#[derive(Serialize, Debug, ToSchema)]
pub struct SchedulesList {
    /// Oldest first.
    pub schedules: Vec<ScheduleView>,
}

/// What a manual trigger did.
#[derive(Serialize, Debug, ToSchema)]
pub struct Triggered {
    /// The run it started; absent when `overlap: skip` skipped it.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>)]
    pub run_id: Option<RunId>,
    /// The run still going, when it skipped.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>)]
    pub skipped_for: Option<RunId>,
}

fn invalid(message: impl Into<String>) -> ApiError {
    ApiError::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        "invalid_schedule",
        message,
    )
}

/// Checks what a schedule's fields must be; the next tick after now.
fn check(state: &ApiState, s: &Schedule) -> Result<i64, ApiError> {
    let clock = Clock::new(&s.cron, &s.timezone).map_err(invalid)?;
    if s.input.trim().is_empty() {
        return Err(invalid("`input` is empty: say what each run should do"));
    }
    if s.input.len() > state.app.settings.max_input_bytes {
        return Err(invalid(format!(
            "`input` is {} bytes; the limit is {}",
            s.input.len(),
            state.app.settings.max_input_bytes
        )));
    }
    if !(1..=5).contains(&s.priority) {
        return Err(invalid("`priority` is 1 to 5"));
    }
    if state.app.agents.current().get(&s.agent).is_none() {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "unknown_agent",
            format!("there is no agent `{}`", s.agent),
        ));
    }
    if let Some(t) = &s.thread_id {
        crate::ids::ThreadId::chosen(t).map_err(|e| invalid(format!("`thread_id`: {e}")))?;
    }
    if !s.metadata.is_object() {
        return Err(invalid("`metadata` must be an object"));
    }
    clock
        .next_after(crate::store::now_ms())
        .ok_or_else(|| invalid(format!("`{}` never fires again", s.cron)))
}

fn thread_choice(
    thread: Option<String>,
    new_each: Option<bool>,
) -> Result<Option<String>, ApiError> {
    match (thread, new_each) {
        (Some(_), Some(true)) => Err(invalid(
            "give `thread_id` or `new_thread_each_time: true`, not both",
        )),
        (Some(t), _) => Ok(Some(t)),
        (None, Some(false)) => Err(invalid(
            "`new_thread_each_time: false` needs a `thread_id` to continue",
        )),
        (None, _) => Ok(None),
    }
}

async fn owned(state: &ApiState, owner: &OwnerId, id: &str) -> Result<Schedule, ApiError> {
    state
        .app
        .store
        .get_schedule(owner, id)
        .await?
        .ok_or_else(|| ApiError::not_found("schedule"))
}

/// `POST /v1/schedules`: runs `agent` with `input` at every tick of `cron` in `timezone`.
#[utoipa::path(post, path = "/v1/schedules", tag = "schedules", request_body = NewScheduleBody,
    responses((status = 201, body = ScheduleView), (status = 401, body = ErrorBody), (status = 409, body = ErrorBody), (status = 422, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn create(
    State(state): State<ApiState>,
    owner: Owner,
    ApiJson(body): ApiJson<NewScheduleBody>,
) -> Result<(StatusCode, Json<ScheduleView>), ApiError> {
    let now = Utc::now();
    let mut s = Schedule {
        id: schedule::new_schedule_id(),
        owner: owner.0,
        cron: body.cron.trim().to_owned(),
        timezone: body.timezone.unwrap_or_else(|| "UTC".into()),
        agent: body
            .agent
            .unwrap_or_else(|| crate::agents::GENERAL_PURPOSE.into()),
        input: body.input,
        thread_id: thread_choice(body.thread_id, body.new_thread_each_time)?,
        overlap: body.overlap.unwrap_or(Overlap::Enqueue),
        catch_up: body.catch_up.unwrap_or(CatchUp::None),
        paused: body.paused.unwrap_or(false),
        metadata: body.metadata.unwrap_or_else(|| serde_json::json!({})),
        priority: body.priority.unwrap_or(crate::runs::DEFAULT_PRIORITY),
        next_fire_at: 0,
        created_at: now,
        updated_at: now,
    };
    s.next_fire_at = check(&state, &s)?;
    let store = state.app.store.as_ref();
    if store.list_schedules(&s.owner).await?.len() >= MAX_PER_OWNER {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "too_many_schedules",
            format!("an owner may have {MAX_PER_OWNER} schedules; delete one first"),
        ));
    }
    store.create_schedule(&s).await?;
    Ok((
        StatusCode::CREATED,
        Json(ScheduleView::build(&state, s).await?),
    ))
}

/// `GET /v1/schedules`.
#[utoipa::path(get, path = "/v1/schedules", tag = "schedules",
    responses((status = 200, body = SchedulesList), (status = 401, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn list(
    State(state): State<ApiState>,
    owner: Owner,
) -> Result<Json<SchedulesList>, ApiError> {
    let mut schedules = vec![];
    for s in state.app.store.list_schedules(&owner.0).await? {
        schedules.push(ScheduleView::build(&state, s).await?);
    }
    Ok(Json(SchedulesList { schedules }))
}

/// `GET /v1/schedules/{id}`: with its next fire times and recent runs.
#[utoipa::path(get, path = "/v1/schedules/{id}", tag = "schedules", params(("id" = String, Path, description = "schedule id")),
    responses((status = 200, body = ScheduleView), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn get(
    State(state): State<ApiState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<Json<ScheduleView>, ApiError> {
    let s = owned(&state, &owner.0, &id).await?;
    Ok(Json(ScheduleView::build(&state, s).await?))
}

/// `PATCH /v1/schedules/{id}`: changes it; a new clock (or a resume) counts from now.
#[utoipa::path(patch, path = "/v1/schedules/{id}", tag = "schedules", params(("id" = String, Path, description = "schedule id")), request_body = PatchScheduleBody,
    responses((status = 200, body = ScheduleView), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody), (status = 422, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn update(
    State(state): State<ApiState>,
    owner: Owner,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<PatchScheduleBody>,
) -> Result<Json<ScheduleView>, ApiError> {
    let mut s = owned(&state, &owner.0, &id).await?;
    let clock_changed = body.cron.is_some() || body.timezone.is_some();
    if let Some(c) = body.cron {
        s.cron = c.trim().to_owned();
    }
    if let Some(t) = body.timezone {
        s.timezone = t;
    }
    if let Some(a) = body.agent {
        s.agent = a;
    }
    if let Some(i) = body.input {
        s.input = i;
    }
    if body.thread_id.is_some() || body.new_thread_each_time.is_some() {
        s.thread_id = thread_choice(body.thread_id, body.new_thread_each_time)?;
    }
    if let Some(o) = body.overlap {
        s.overlap = o;
    }
    if let Some(c) = body.catch_up {
        s.catch_up = c;
    }
    if let Some(p) = body.paused {
        s.paused = p;
    }
    if let Some(m) = body.metadata {
        s.metadata = m;
    }
    if let Some(p) = body.priority {
        s.priority = p;
    }
    let next = check(&state, &s)?;
    // A resumed schedule's missed ticks are its catch_up's to fire; a new clock starts now.
    if clock_changed {
        s.next_fire_at = next;
    }
    if !state.app.store.update_schedule(&s).await? {
        return Err(ApiError::not_found("schedule"));
    }
    Ok(Json(ScheduleView::build(&state, s).await?))
}

/// `DELETE /v1/schedules/{id}`: it fires no more; its runs stay.
#[utoipa::path(delete, path = "/v1/schedules/{id}", tag = "schedules", params(("id" = String, Path, description = "schedule id")),
    responses((status = 204), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn delete(
    State(state): State<ApiState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    if state.app.store.delete_schedule(&owner.0, &id).await? {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::not_found("schedule"))
    }
}

async fn set_paused(
    state: &ApiState,
    owner: &OwnerId,
    id: &str,
    paused: bool,
) -> Result<Json<ScheduleView>, ApiError> {
    let mut s = owned(state, owner, id).await?;
    s.paused = paused;
    if !state.app.store.update_schedule(&s).await? {
        return Err(ApiError::not_found("schedule"));
    }
    Ok(Json(ScheduleView::build(state, s).await?))
}

/// `POST /v1/schedules/{id}/pause`: it fires nothing until resumed.
#[utoipa::path(post, path = "/v1/schedules/{id}/pause", tag = "schedules", params(("id" = String, Path, description = "schedule id")),
    responses((status = 200, body = ScheduleView), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn pause(
    State(state): State<ApiState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<Json<ScheduleView>, ApiError> {
    set_paused(&state, &owner.0, &id, true).await
}

/// `POST /v1/schedules/{id}/resume`: the ticks missed while paused fire as `catch_up` says.
#[utoipa::path(post, path = "/v1/schedules/{id}/resume", tag = "schedules", params(("id" = String, Path, description = "schedule id")),
    responses((status = 200, body = ScheduleView), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn resume(
    State(state): State<ApiState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<Json<ScheduleView>, ApiError> {
    set_paused(&state, &owner.0, &id, false).await
}

/// `POST /v1/schedules/{id}/trigger`: fires it now, outside its clock (as `overlap` says).
#[utoipa::path(post, path = "/v1/schedules/{id}/trigger", tag = "schedules", params(("id" = String, Path, description = "schedule id")),
    responses((status = 201, body = Triggered), (status = 200, body = Triggered), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody), (status = 422, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn trigger(
    State(state): State<ApiState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<(StatusCode, Json<Triggered>), ApiError> {
    let s = owned(&state, &owner.0, &id).await?;
    match crate::schedules::fire_tick(&state.app, &s, crate::store::now_ms()).await {
        Ok(crate::schedules::Fired::Started(run)) => Ok((
            StatusCode::CREATED,
            Json(Triggered {
                run_id: Some(run),
                skipped_for: None,
            }),
        )),
        Ok(crate::schedules::Fired::Skipped { previous }) => Ok((
            StatusCode::OK,
            Json(Triggered {
                run_id: None,
                skipped_for: Some(previous),
            }),
        )),
        Err(crate::schedules::FireError::Start(e)) => Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            e.code(),
            e.to_string(),
        )),
        Err(crate::schedules::FireError::Store(e)) => Err(e.into()),
    }
}
