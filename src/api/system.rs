//! Threads, agents, health, readiness and metrics.

use crate::store::StoreError;
use axum::Json;
use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::auth::Owner;
use super::views::{AgentsList, ErrorBody, ForkPoint, Health, MessageView, RunView, ThreadView};
use super::{ApiError, ApiQuery, ApiState};
use crate::ids::ThreadId;
use crate::store::{ForkAt, Forked, RunFilter, RunStatus};
use utoipa::IntoParams;

/// Query of `GET /v1/threads/{id}`.
#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ThreadQuery {
    /// Messages with id greater than this (default 0).
    #[param(minimum = 0)]
    after: Option<i64>,
    /// 1..=1000, default 100.
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<u32>,
}

/// `GET /v1/threads/{id}`: the thread, its newest runs, and a page of its messages.
#[utoipa::path(get, path = "/v1/threads/{id}", tag = "threads", params(("id" = String, Path, pattern = "^[A-Za-z0-9_.:-]{1,200}$", description = "thread id"), ThreadQuery),
    responses((status = 200, body = ThreadView), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn thread(
    State(state): State<ApiState>,
    owner: Owner,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<ThreadQuery>,
) -> Result<Json<ThreadView>, ApiError> {
    let id: ThreadId = id
        .parse()
        .map_err(|e: crate::ids::IdError| ApiError::bad_request("invalid_id", e.to_string()))?;
    let limit = q.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(ApiError::bad_request(
            "invalid_limit",
            "limit must be 1 to 1000",
        ));
    }
    let after = q.after.unwrap_or(0);
    if after < 0 {
        return Err(ApiError::bad_request(
            "invalid_cursor",
            "after must be a message id from an earlier page",
        ));
    }
    let store = state.app.store.as_ref();
    let admin = state.keys.is_admin(&owner.0);
    let mut stored = state.app.thread_for(&owner.0, &id).await?;
    let mut found = store.get_thread(&stored).await?;
    // An admin may open any owner's thread, as any run: by its stored id, or by the id its
    // owner chose.
    if admin && found.as_ref().is_none_or(|t| t.owner != owner.0) {
        for candidate in
            std::iter::once(id.clone()).chain(state.keys.owners().map(|o| id.scoped(o)))
        {
            if let Some(t) = store.get_thread(&candidate).await? {
                (stored, found) = (candidate, Some(t));
                break;
            }
        }
    }
    let t = match found {
        Some(t) if t.owner == owner.0 || admin => t,
        _ => return Err(ApiError::not_found("thread")),
    };
    let id = stored;
    let runs = store
        .list_runs(
            &t.owner,
            &RunFilter {
                thread_id: Some(id.clone()),
                ..Default::default()
            },
            50,
        )
        .await?;
    let mut run_views = vec![];
    for r in runs {
        run_views.push(RunView::build(store, r).await?);
    }
    let messages: Vec<MessageView> = store
        .messages_page(&id, after, limit)
        .await?
        .into_iter()
        .map(Into::into)
        .collect();
    let next_after = messages.last().map(|m| m.id).unwrap_or(after);
    let compactions = store.compactions(&id).await?;
    let point = |(thread, at): (ThreadId, i64)| ForkPoint {
        thread_id: thread.visible_to(&t.owner),
        at_message: at,
    };
    let forks = store.forks_of(&id).await?.into_iter().map(point).collect();
    Ok(Json(ThreadView {
        id: t.id.visible_to(&t.owner),
        created_at: t.created_at,
        updated_at: t.updated_at,
        runs: run_views,
        messages,
        next_after,
        compactions,
        forked_from: t.forked_from.clone().map(point),
        forks,
    }))
}

/// The body of `POST /v1/threads/{id}/fork`.
#[derive(Deserialize, Debug, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkBody {
    /// Share the history up to this message (an id from the thread view), included.
    #[serde(default)]
    at_message: Option<i64>,
    /// Share the history up to the end of this run of the thread.
    #[serde(default)]
    #[schema(value_type = Option<String>)]
    at_run: Option<String>,
    /// Start a run on the new thread at once, with this task.
    #[serde(default)]
    input: Option<String>,
    /// The agent of that run (default `general-purpose`).
    #[serde(default)]
    agent: Option<String>,
}

/// What `POST /v1/threads/{id}/fork` answers.
#[derive(serde::Serialize, Debug, utoipa::ToSchema)]
pub struct ForkCreated {
    /// The new thread.
    pub thread_id: ThreadId,
    /// Where it was forked from.
    pub forked_from: ForkPoint,
    /// The run started on it, when `input` was given.
    pub run: Option<RunView>,
}

/// `POST /v1/threads/{id}/fork`: a new thread whose history is this one's up to a message
/// (`at_message`), the end of a run (`at_run`), or now; shared, not copied, so a fork costs the
/// same whatever the thread's length. Both threads go on independently. With `input`, a run
/// starts on the new thread at once.
#[utoipa::path(post, path = "/v1/threads/{id}/fork", tag = "threads", params(("id" = String, Path, pattern = "^[A-Za-z0-9_.:-]{1,200}$", description = "thread id")), request_body = ForkBody,
    responses((status = 201, body = ForkCreated), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody), (status = 413, body = ErrorBody), (status = 422, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn fork(
    State(state): State<ApiState>,
    owner: Owner,
    Path(id): Path<String>,
    super::ApiJson(body): super::ApiJson<ForkBody>,
) -> Result<Response, ApiError> {
    let id: ThreadId = id
        .parse()
        .map_err(|e: crate::ids::IdError| ApiError::bad_request("invalid_id", e.to_string()))?;
    let at = match (body.at_message, body.at_run.as_deref()) {
        (Some(_), Some(_)) => {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_request",
                "give at_message or at_run, not both",
            ));
        }
        (Some(m), None) => ForkAt::Message(m),
        (None, Some(r)) => ForkAt::Run(r.parse().map_err(|e: crate::ids::IdError| {
            ApiError::bad_request("invalid_id", e.to_string())
        })?),
        (None, None) => ForkAt::End,
    };
    let source = state.app.thread_for(&owner.0, &id).await?;
    let new = ThreadId::generate();
    let store = state.app.store.as_ref();
    let at_message = match store.fork_thread(&owner.0, &source, at, &new).await? {
        Forked::Done { at_message } => at_message,
        Forked::NoThread => return Err(ApiError::not_found("thread")),
        Forked::NoMessage => {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "no_such_message",
                "at_message is not a message of this thread's history; take an id from GET /v1/threads/{id}",
            ));
        }
        Forked::NoRun => {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "no_such_run",
                "at_run is not a run of this thread",
            ));
        }
        Forked::Empty => {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "nothing_to_fork",
                "there is no message to fork from yet (the thread, or that run, has none)",
            ));
        }
    };
    tracing::info!(thread_id = %source, fork = %new, at_message, "thread forked");
    let run = match body.input {
        None => None,
        Some(input) => {
            let created = state
                .app
                .start(crate::app::StartRun {
                    agent: body.agent,
                    input,
                    thread_id: Some(new.clone()),
                    owner: Some(owner.0.clone()),
                    ..Default::default()
                })
                .await?;
            Some(RunView::build(store, created.run).await?)
        }
    };
    Ok((
        StatusCode::CREATED,
        Json(ForkCreated {
            thread_id: new.visible_to(&owner.0),
            forked_from: ForkPoint {
                thread_id: source.visible_to(&owner.0),
                at_message,
            },
            run,
        }),
    )
        .into_response())
}

/// `GET /v1/agents`
#[utoipa::path(get, path = "/v1/agents", tag = "agents", responses((status = 200, body = AgentsList), (status = 401, body = ErrorBody)))]
pub async fn agents(State(state): State<ApiState>, _owner: Owner) -> Json<AgentsList> {
    Json(AgentsList {
        agents: state
            .app
            .agents
            .current()
            .all()
            .map(|a| super::views::AgentView::build(a, &state.app.engine))
            .collect(),
    })
}

/// `GET /healthz`: the process is up.
#[utoipa::path(get, path = "/healthz", tag = "system", security(()), responses((status = 200, body = Health)))]
pub async fn healthz() -> Json<Health> {
    Json(Health {
        status: "ok".into(),
        db: None,
        redis: None,
    })
}

/// Whether a request may see what the operator sees: always without API keys (the server is
/// local-only then); with keys, one of them or the metrics token (`SUBAGENTS_METRICS_TOKEN`).
fn operator(state: &ApiState, headers: &axum::http::HeaderMap) -> bool {
    if state.keys.is_empty() {
        return true;
    }
    let Some(key) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
    else {
        return false;
    };
    let token = state
        .app
        .settings
        .metrics_token
        .as_deref()
        .filter(|t| !t.is_empty());
    token.is_some_and(|t| constant_time_eq(t.as_bytes(), key.as_bytes()))
        || state.keys.owner_of(key).is_some()
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// How long `/readyz` waits for the database.
const READY_CHECK: std::time::Duration = std::time::Duration::from_secs(2);

/// `GET /readyz`: the database answers (within two seconds). Load balancers get the status alone; what is down
/// (`db`, `redis`) is shown to an operator (see `/metrics`).
#[utoipa::path(get, path = "/readyz", tag = "system", security(()), responses((status = 200, body = Health), (status = 503, body = Health)))]
pub async fn readyz(State(state): State<ApiState>, headers: axum::http::HeaderMap) -> Response {
    let detail = operator(&state, &headers);
    let redact = move |mut h: Health| {
        if !detail {
            h.db = None;
            h.redis = None;
        }
        h
    };
    // A database that is away makes a pooled connection wait out the pool's acquire timeout
    // (30 s); a health check must answer well inside a load balancer's own timeout.
    let db = tokio::time::timeout(READY_CHECK, state.app.store.status_counts()).await;
    match db.unwrap_or(Err(StoreError::Db(sqlx::Error::PoolTimedOut))) {
        Ok(_) => {
            // Without Redis, runs go on and events wait in the outbox: degraded, not down.
            let redis = match &state.app.redis {
                None => None,
                Some(r) => Some(if r.ping().await { "ok" } else { "unreachable" }),
            };
            let status = if redis == Some("unreachable") {
                "degraded"
            } else {
                "ready"
            };
            Json(redact(Health {
                status: status.into(),
                db: Some("ok".into()),
                redis: redis.map(Into::into),
            }))
            .into_response()
        }
        Err(e) => {
            tracing::warn!(error = %e, "readiness check failed");
            (
                StatusCode::SERVICE_UNAVAILABLE,
                Json(redact(Health {
                    status: "unavailable".into(),
                    db: Some("unreachable".into()),
                    redis: None,
                })),
            )
                .into_response()
        }
    }
}

/// `GET /metrics`: Prometheus text. Run counts are read from the database at scrape time;
/// latency histograms and token counters come from this process's recorder. With API keys
/// configured it needs `Authorization: Bearer` with a key or `SUBAGENTS_METRICS_TOKEN`.
#[utoipa::path(get, path = "/metrics", tag = "system", responses((status = 200, description = "Prometheus text format", content_type = "text/plain", body = String), (status = 401, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn metrics(
    State(state): State<ApiState>,
    headers: axum::http::HeaderMap,
) -> Result<Response, ApiError> {
    if !operator(&state, &headers) {
        return Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "send Authorization: Bearer with an API key or the metrics token (SUBAGENTS_METRICS_TOKEN)",
        ));
    }
    let counts = state.app.store.status_counts().await?;
    let mut out =
        String::from("# HELP subagents_runs Runs by status.\n# TYPE subagents_runs gauge\n");
    for s in [
        RunStatus::Queued,
        RunStatus::Running,
        RunStatus::Waiting,
        RunStatus::Succeeded,
        RunStatus::Failed,
        RunStatus::Cancelled,
    ] {
        let n = counts
            .iter()
            .find(|(k, _)| *k == s)
            .map(|(_, n)| *n)
            .unwrap_or(0);
        out.push_str(&format!(
            "subagents_runs{{status=\"{}\"}} {n}\n",
            s.as_str()
        ));
    }
    let queued = counts
        .iter()
        .find(|(k, _)| *k == RunStatus::Queued)
        .map(|(_, n)| *n)
        .unwrap_or(0);
    out.push_str(&format!("# HELP subagents_queue_depth Runs waiting for a worker.\n# TYPE subagents_queue_depth gauge\nsubagents_queue_depth {queued}\n"));
    out.push_str(&crate::telemetry::render_metrics());
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response())
}
