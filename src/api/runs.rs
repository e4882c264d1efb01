//! `/v1/runs…`: start, wait, list, snapshot, events (JSON pages and SSE), messages, cancel.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use super::auth::Owner;
use super::views::{ErrorBody, EventsPage, PLAN_TOOL, RunView, RunsPage};
use super::{ApiError, ApiJson, ApiQuery, ApiState};
use crate::app::{CROSS_PROCESS_RECHECK, StartRun};
use crate::domain::{IfBusy, RunRecord};
use crate::events::is_terminal;
use crate::ids::{OwnerId, RunId, ThreadId};
use crate::store::{CancelOutcome, RunFilter, RunStatus};
use utoipa::{IntoParams, ToSchema};

/// Largest cursor accepted (2^53 - 1: exact in every JSON client).
const MAX_SEQ: u64 = 9_007_199_254_740_991;

/// Longest accepted wait.
pub const MAX_WAIT_S: f64 = 3600.0;
const DEFAULT_WAIT_S: f64 = 30.0;

/// Limits a caller may set on one run.
#[derive(Deserialize, Debug, Default, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LimitsBody {
    /// Tool-using steps before a forced final answer (1..=10000; default: the agent's).
    #[serde(default, deserialize_with = "whole_number")]
    #[schema(minimum = 1, maximum = 10000)]
    max_steps: Option<u64>,
    /// Wall-time limit in seconds (1..=604800; default: the agent's).
    #[serde(default, deserialize_with = "whole_number")]
    #[schema(minimum = 1, maximum = 604800)]
    timeout_s: Option<u64>,
    /// Token budget of the run and all its subagents; past it, answers are forced.
    #[serde(default, deserialize_with = "whole_number")]
    #[schema(minimum = 1, maximum = 9007199254740991_i64)]
    max_total_tokens: Option<u64>,
    /// Step budget of the run and all its subagents; past it, answers are forced.
    #[serde(default, deserialize_with = "whole_number")]
    #[schema(minimum = 1, maximum = 9007199254740991_i64)]
    max_total_steps: Option<u64>,
    /// When to compact the context: a fraction of the model's window (0.1..=0.95) or a
    /// percent (10..=95). Default: the agent's `compact_at:`, then `SUBAGENTS_COMPACT_AT` (85).
    #[serde(default)]
    compact_at: Option<f64>,
}

/// JSON Schema counts `9999.0` as an integer; accept any number with no fraction.
fn whole_number<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    let v: Option<serde_json::Number> = Option::deserialize(d)?;
    match v {
        None => Ok(None),
        Some(n) => n
            .as_u64()
            .or_else(|| {
                n.as_f64()
                    .filter(|f| f.fract() == 0.0 && *f >= 0.0 && *f < 18_446_744_073_709_551_616.0)
                    .map(|f| f as u64)
            })
            .map(Some)
            .ok_or_else(|| {
                serde::de::Error::custom(format!("expected a whole number >= 0, got {n}"))
            }),
    }
}

/// serde accepts a struct written as an array; the API takes objects only.
fn object_only<'de, D: serde::Deserializer<'de>, T: serde::de::DeserializeOwned>(
    d: D,
) -> Result<Option<T>, D::Error> {
    match Option::<Value>::deserialize(d)? {
        None | Some(Value::Null) => Ok(None),
        Some(v @ Value::Object(_)) => serde_json::from_value(v)
            .map(Some)
            .map_err(serde::de::Error::custom),
        Some(other) => Err(serde::de::Error::custom(format!(
            "expected an object, got {other}"
        ))),
    }
}

/// Declares the start body once, for both start endpoints (serde's `flatten` cannot be combined
/// with `deny_unknown_fields`, and unknown fields must be refused).
macro_rules! start_body {
    ($(#[$m:meta])* $name:ident { $($extra:tt)* }) => {
        $(#[$m])*
        #[derive(Deserialize, Debug, ToSchema)]
        #[serde(deny_unknown_fields)]
        pub struct $name {
            /// Agent name (default `general-purpose`); an unknown name answers 404 `unknown_agent`.
            #[serde(default)]
            agent: Option<String>,
            /// The task (not blank; at most SUBAGENTS_MAX_INPUT_BYTES, default 262144 bytes).
            #[schema(min_length = 1, max_length = 262144, pattern = "\\S")]
            input: String,
            /// Continue this thread (created if new).
            #[serde(default)]
            #[schema(value_type = Option<String>, pattern = "^[A-Za-z0-9_.:-]{1,200}$")]
            thread_id: Option<String>,
            /// Caller data kept with the run (a JSON object).
            #[serde(default)]
            #[schema(value_type = Option<Object>)]
            metadata: Option<Value>,
            /// Limit overrides.
            #[serde(default, deserialize_with = "object_only")]
            limits: Option<LimitsBody>,
            /// Busy thread: `reject` (409 thread_busy), `enqueue` behind its active run,
            /// `interrupt` (cancel the active run at its next step boundary, its work kept on the
            /// thread, and start this one when it has ended) or `steer` (deliver the input into the active
            /// run as a message instead of starting a run).
            #[serde(default)]
            if_busy: BusyPolicy,
            /// A repeated start with the same key returns the first run.
            #[serde(default)]
            #[schema(min_length = 1, max_length = 200)]
            idempotency_key: Option<String>,
            /// 1 (lowest) to 5 (default 3): the order of this owner's queued runs. Owners share
            /// the workers round robin whatever their priorities.
            #[serde(default)]
            #[schema(minimum = 1, maximum = 5)]
            priority: Option<u8>,
            /// This run's own webhook: its events go to `url` (default events `run.succeeded`,
            /// `run.failed`, `run.cancelled`), signed with a secret the answer carries once
            /// (`webhook: {id, secret}`); see docs/webhooks.md.
            #[serde(default)]
            webhook: Option<RunWebhookBody>,
            /// A JSON Schema the final answer must match (overrides the agent's
            /// `output_schema:`). The answer is validated; an invalid one goes back to the model
            /// with the errors, then the run fails with `kind=output`. The run view carries the
            /// answer as `result_json`.
            #[serde(default)]
            #[schema(value_type = Option<Object>)]
            output_schema: Option<Value>,
            /// Invalid answers sent back before the run fails (0..=10; default: the agent's,
            /// then 2).
            #[serde(default)]
            #[schema(minimum = 0, maximum = 10)]
            output_retries: Option<u32>,
            $($extra)*
        }
    };
}

/// A run's own webhook on `POST /v1/runs`.
#[derive(Deserialize, Debug, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RunWebhookBody {
    /// An http(s) URL (the same address guard as subscriptions).
    url: String,
    /// Event types, or `["*"]` (default: the run's end).
    events: Option<Vec<String>>,
}

start_body!(
    /// The body of `POST /v1/runs`.
    StartBody {}
);

start_body!(
    /// The body of `POST /v1/runs/wait`: a start plus how long to wait.
    WaitStartBody {
        /// Seconds to wait for the end (0..=3600, default 30).
        #[serde(default)]
        #[schema(minimum = 0, maximum = 3600)]
        timeout_s: Option<f64>,
    }
);

impl From<WaitStartBody> for StartBody {
    fn from(w: WaitStartBody) -> StartBody {
        StartBody {
            agent: w.agent,
            input: w.input,
            thread_id: w.thread_id,
            metadata: w.metadata,
            limits: w.limits,
            if_busy: w.if_busy,
            idempotency_key: w.idempotency_key,
            priority: w.priority,
            webhook: w.webhook,
            output_schema: w.output_schema,
            output_retries: w.output_retries,
        }
    }
}

/// What a start does when its thread has an unfinished run (the store knows only `reject` and
/// `enqueue`; the other two are built on them here).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum BusyPolicy {
    /// 409 `thread_busy`.
    #[default]
    Reject,
    /// Queue behind the active run.
    Enqueue,
    /// Cancel the active run at its next step boundary (its committed work stays on the
    /// thread) and queue behind it: this run starts as soon as that one has ended.
    Interrupt,
    /// Send the input to the active run as a message (`POST /v1/runs/{id}/messages`).
    Steer,
}

/// What a start came to.
enum Started {
    /// A run was created (or found by its idempotency key).
    Run { run: RunRecord },
    /// `steer`: the input went into the thread's active run as this message.
    Steered {
        run: RunRecord,
        message_id: crate::ids::MessageId,
    },
}

impl Started {
    fn run(&self) -> &RunRecord {
        match self {
            Started::Run { run, .. } | Started::Steered { run, .. } => run,
        }
    }
}

fn parse_run_id(s: &str) -> Result<RunId, ApiError> {
    s.parse()
        .map_err(|e: crate::ids::IdError| ApiError::bad_request("invalid_id", e.to_string()))
}

fn wait_duration(t: Option<f64>) -> Result<Duration, ApiError> {
    let t = t.unwrap_or(DEFAULT_WAIT_S);
    if !(0.0..=MAX_WAIT_S).contains(&t) {
        return Err(ApiError::bad_request(
            "invalid_timeout",
            format!("timeout_s must be between 0 and {MAX_WAIT_S}"),
        ));
    }
    Ok(Duration::from_secs_f64(t))
}

/// Reads a run, answering 404 for other owners' runs exactly as for missing ones.
pub async fn owned_run(state: &ApiState, owner: &Owner, id: RunId) -> Result<RunRecord, ApiError> {
    match state.app.store.get_run(id).await? {
        // An admin (an operator) may open any owner's run.
        Some(r) if r.owner == owner.0 || state.keys.is_admin(&owner.0) => Ok(r),
        _ => Err(ApiError::not_found("run")),
    }
}

/// A run's own webhook, stored before its run starts (the run's id chosen here), so no event
/// of the run can pass before it exists. Its secret goes in the start's answer only.
async fn run_webhook(
    state: &ApiState,
    owner: &Owner,
    body: RunWebhookBody,
) -> Result<crate::domain::webhook::Webhook, ApiError> {
    let events = body.events.unwrap_or_else(|| {
        ["run.succeeded", "run.failed", "run.cancelled"]
            .map(String::from)
            .to_vec()
    });
    super::webhooks::check_events(&events)?;
    super::webhooks::check_url(state, &body.url).await?;
    let run = RunId::new();
    let now = chrono::Utc::now();
    let hook = crate::domain::webhook::Webhook {
        id: crate::domain::webhook::new_webhook_id(),
        owner: owner.0.clone(),
        url: body.url,
        events,
        agents: None,
        description: format!("run {run}"),
        secret: crate::domain::webhook::new_secret(),
        old_secret: None,
        paused_reason: None,
        run_id: Some(run),
        created_at: now,
        updated_at: now,
    };
    state.app.store.create_webhook(&hook).await?;
    Ok(hook)
}

/// [`start_from_body`], with the run's own webhook when the body asks for one: `(id, secret)`
/// when the start made a new run for it (a steer, or an idempotent repeat, makes none: the
/// webhook is dropped).
async fn start_from(
    state: &ApiState,
    owner: &Owner,
    mut body: StartBody,
) -> Result<(Started, Option<(String, String)>), ApiError> {
    let Some(w) = body.webhook.take() else {
        return Ok((start_from_body(state, owner, body, None).await?, None));
    };
    let hook = run_webhook(state, owner, w).await?;
    let started = start_from_body(state, owner, body, hook.run_id).await;
    match started {
        Ok(s) if Some(s.run().id) == hook.run_id => Ok((s, Some((hook.id, hook.secret)))),
        other => {
            state.app.store.delete_webhook(&owner.0, &hook.id).await?;
            Ok((other?, None))
        }
    }
}

async fn start_from_body(
    state: &ApiState,
    owner: &Owner,
    body: StartBody,
    run_id: Option<RunId>,
) -> Result<Started, ApiError> {
    let thread_id = match body.thread_id.as_deref().map(ThreadId::chosen).transpose() {
        Ok(Some(t)) => Some(state.app.thread_for(&owner.0, &t).await?),
        Ok(None) => None,
        Err(e) => return Err(ApiError::bad_request("invalid_id", e.to_string())),
    };
    if let Some(m) = &body.metadata
        && !m.is_object()
    {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
            "metadata must be a JSON object",
        ));
    }
    let limits = body.limits.unwrap_or_default();
    if limits
        .max_total_tokens
        .is_some_and(|t| t == 0 || t > MAX_SEQ)
        || limits
            .max_total_steps
            .is_some_and(|t| t == 0 || t > MAX_SEQ)
    {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "bad_limit",
            "max_total_tokens and max_total_steps must be 1 to 9007199254740991",
        ));
    }
    let compact_at = match limits.compact_at {
        None => None,
        Some(f) => {
            let percent = if f <= 1.0 { f * 100.0 } else { f };
            if !percent.is_finite() || !(10.0..=95.0).contains(&percent.round()) {
                return Err(ApiError::new(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "bad_limit",
                    "compact_at must be a fraction 0.1 to 0.95 or a percent 10 to 95 of the context window",
                ));
            }
            Some(percent.round() as u8)
        }
    };
    let req = StartRun {
        agent: body.agent,
        input: body.input,
        thread_id,
        owner: Some(owner.0.clone()),
        max_steps: limits
            .max_steps
            .map(|m| u32::try_from(m).unwrap_or(u32::MAX)),
        timeout_secs: limits.timeout_s,
        max_total_tokens: limits.max_total_tokens,
        max_total_steps: limits.max_total_steps,
        compact_at,
        metadata: body.metadata,
        if_busy: IfBusy::Reject,
        idempotency_key: body.idempotency_key,
        priority: body.priority,
        run_id,
        output_schema: body.output_schema,
        output_retries: body.output_retries,
        // Past the cap, 429 `queue_full`: checked by the store's start (in its transaction on
        // SQLite, just before it on PostgreSQL).
        max_queued: state.quotas.limits.queued,
        ..Default::default()
    };
    start_busy(state, owner, req, body.if_busy).await
}

/// Starts `req` under `policy`. `interrupt` and `steer` first try a plain start; on a busy
/// thread they act on its active run. Should that run end in between (a steer then finds it
/// finished), the start is tried again, a few times at most.
async fn start_busy(
    state: &ApiState,
    owner: &Owner,
    mut req: StartRun,
    policy: BusyPolicy,
) -> Result<Started, ApiError> {
    if policy == BusyPolicy::Enqueue {
        req.if_busy = IfBusy::Enqueue;
    }
    for _ in 0..3 {
        let active = match state.app.start(req.clone()).await {
            Ok(c) => {
                return Ok(Started::Run { run: c.run });
            }
            Err(crate::app::StartError::Store(crate::store::StoreError::Busy {
                active_run,
                ..
            })) if matches!(policy, BusyPolicy::Interrupt | BusyPolicy::Steer) => active_run,
            Err(e) => return Err(e.into()),
        };
        if policy == BusyPolicy::Steer {
            let (message_id, sent) = state.app.send_message(active, &owner.0, &req.input).await?;
            if sent == crate::store::Sent::Full {
                return Err(inbox_full(active));
            }
            if let crate::store::Sent::Accepted { .. } = sent
                && let Some(run) = state.app.store.get_run(active).await?
            {
                tracing::info!(run_id = %active, %message_id, "a start steered the thread's active run");
                return Ok(Started::Steered { run, message_id });
            }
            continue;
        }
        // Interrupt: queue behind the active run first, so nothing else takes the thread in
        // between, then have it cancelled at its next step boundary; its end starts this run.
        let mut queued = req.clone();
        queued.if_busy = IfBusy::Enqueue;
        let created = state.app.start(queued).await?;
        let outcome = state.app.interrupt(active).await?;
        tracing::info!(interrupted = %active, run_id = %created.run.id, ?outcome, "a start interrupted the thread's active run");
        return Ok(Started::Run { run: created.run });
    }
    Err(ApiError::new(
        StatusCode::CONFLICT,
        "thread_busy",
        "the thread's active run kept changing while this start tried to act on it; retry",
    ))
}

/// `POST /v1/runs`
#[utoipa::path(post, path = "/v1/runs", tag = "runs", request_body = StartBody,
    responses((status = 202, description = "queued", body = RunView), (status = 409, description = "thread_busy", body = ErrorBody), (status = 413, body = ErrorBody), (status = 415, body = ErrorBody), (status = 422, body = ErrorBody), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn start(
    State(state): State<ApiState>,
    owner: Owner,
    ApiJson(body): ApiJson<StartBody>,
) -> Result<Response, ApiError> {
    let (started, webhook) = start_from(&state, &owner, body).await?;
    let message_id = match &started {
        Started::Steered { message_id, .. } => Some(message_id.clone()),
        Started::Run { .. } => None,
    };
    let view = RunView::build(state.app.store.as_ref(), started.run().clone()).await?;
    let mut v = serde_json::to_value(view).unwrap_or_default();
    if let Some(id) = message_id {
        // `steer`: the thread's active run, and the message it was sent.
        v["steered"] = json!({"message_id": id});
    }
    if let Some((id, secret)) = webhook {
        // Shown once, as a subscription's.
        v["webhook"] = json!({"id": id, "secret": secret});
    }
    Ok((StatusCode::ACCEPTED, Json(v)).into_response())
}

/// `POST /v1/runs/wait`: start, then wait for the end (`timeout_s`, default 30).
#[utoipa::path(post, path = "/v1/runs/wait", tag = "runs", request_body = WaitStartBody,
    responses((status = 200, description = "the finished run, or its snapshot with wait_timed_out", body = RunView), (status = 409, body = ErrorBody), (status = 413, body = ErrorBody), (status = 415, body = ErrorBody), (status = 422, body = ErrorBody), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn start_and_wait(
    State(state): State<ApiState>,
    owner: Owner,
    ApiJson(body): ApiJson<WaitStartBody>,
) -> Result<Response, ApiError> {
    let timeout = wait_duration(body.timeout_s)?;
    let _held = state.quotas.take(&owner.0, super::quota::Kind::Wait)?;
    if body.webhook.is_some() {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
            "`webhook` is for POST /v1/runs: a wait answers with the run itself",
        ));
    }
    // The new run's signal is held from before it exists: its waiter then skips the read that
    // would find it queued, and hears everything after the start.
    let id = RunId::default();
    let signal = state.app.store.subscribe(id);
    let before = signal.decisive();
    let started = start_from_body(&state, &owner, body.into(), Some(id)).await?;
    let created = (started.run().id == id).then_some(before);
    let r = wait_view(&state, started.run().id, timeout, created).await;
    drop(signal);
    r
}

/// Latest events a [`RunSnapshot`] carries: a stream at most this far behind is answered
/// from it.
const SNAPSHOT_EVENTS: u64 = 32;

/// What one read after a commit tells every wait and stream on the run: the run; once it has
/// ended, a wait's whole answer; and its latest events. Waits and streams woken by one commit
/// share it, so both kinds are answered after the same round of reads, in the order they came,
/// and none of them needs another read (each round of reads puts all of them behind everything
/// else the process has to do).
#[derive(Clone, Default)]
pub struct RunSnapshot {
    run: Option<Arc<RunRecord>>,
    /// A wait's answer, once the run has ended.
    body: Option<axum::body::Bytes>,
    /// `events` are the run's events after this seq, gap-free.
    events_after: u64,
    events: Arc<Vec<crate::app::StreamedEvent>>,
}

impl RunSnapshot {
    async fn read(state: &ApiState, id: RunId) -> crate::store::Result<RunSnapshot> {
        let store = state.app.store.as_ref();
        let read = match &state.app.redis {
            // Without Redis the events come from the database: the run, its events and (when
            // it has ended) its view's extras in one read.
            None => {
                store
                    .run_with_latest(id, SNAPSHOT_EVENTS as u32, PLAN_TOOL)
                    .await?
            }
            // With it, from the relay's stream.
            Some(_) => {
                let events = |after| state.app.events_after(id, after, SNAPSHOT_EVENTS as u32);
                crate::store::RunRead::apart(store, id, SNAPSHOT_EVENTS as u32, PLAN_TOOL, events)
                    .await?
            }
        };
        let Some(crate::store::RunRead {
            run: r,
            events,
            events_after,
            extras,
        }) = read
        else {
            return Ok(RunSnapshot::default());
        };
        let terminal = r.status.is_terminal();
        // A finished run's answer, built from the events just read when they reach its last.
        let body = match terminal {
            true => {
                let whole = events.last().is_some_and(|e| e.seq == r.event_seq);
                let latest = whole.then_some(events.as_slice());
                Some(view_body(store, r.clone(), false, latest, extras).await?)
            }
            false => None,
        };
        let events = Arc::new(
            events
                .into_iter()
                .map(crate::app::StreamedEvent::new)
                .collect(),
        );
        Ok(RunSnapshot {
            run: Some(Arc::new(r)),
            body,
            events_after,
            events,
        })
    }

    /// The events after `cursor`, when this snapshot holds every one the run had when it was
    /// read; `None` when it does not (the stream is further behind, or the read fell short):
    /// then the stream reads them itself.
    fn events_for(&self, cursor: u64) -> Option<&[crate::app::StreamedEvent]> {
        let run = self.run.as_ref()?;
        let last = self
            .events
            .last()
            .map_or(self.events_after, |e| e.record.seq);
        if cursor < self.events_after || last < run.event_seq {
            return None;
        }
        Some(&self.events[self.events.partition_point(|e| e.record.seq <= cursor)..])
    }
}

async fn view_body(
    store: &dyn crate::store::Store,
    r: RunRecord,
    timed_out: bool,
    latest: Option<&[crate::store::EventRecord]>,
    extras: Option<crate::store::ViewExtras>,
) -> crate::store::Result<axum::body::Bytes> {
    let mut view = RunView::build_from(store, r, latest, extras).await?;
    view.wait_timed_out = Some(timed_out);
    Ok(axum::body::Bytes::from(
        serde_json::to_vec(&view).expect("a view serializes"),
    ))
}

async fn wait_view(
    state: &ApiState,
    id: RunId,
    timeout: Duration,
    created: Option<u64>,
) -> Result<Response, ApiError> {
    let store = state.app.store.as_ref();
    let read = || RunSnapshot::read(state, id);
    let (RunSnapshot { run: r, body, .. }, started) = state
        .app
        .wait_with(
            id,
            timeout,
            &state.waits,
            read,
            created,
            |s: &RunSnapshot| s.run.is_none() || s.body.is_some(),
        )
        .await?;
    let r = r.ok_or_else(|| ApiError::not_found("run"))?;
    let body = match body {
        Some(body) => body,
        // Timed out: the snapshot, built once for every wait the same read answered.
        None => {
            let fresh = crate::notify::Fresh {
                generation: 0,
                not_before: Some(started),
            };
            state
                .views
                .read(id, fresh, || {
                    view_body(store, (*r).clone(), true, None, None)
                })
                .await?
                .0
        }
    };
    Ok(([(header::CONTENT_TYPE, "application/json")], body).into_response())
}

/// Query of `GET /v1/runs/{id}/wait`.
#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct WaitQuery {
    /// Seconds to wait (0..=3600, default 30).
    #[param(minimum = 0, maximum = 3600)]
    timeout_s: Option<f64>,
}

/// `GET /v1/runs/{id}/wait`
#[utoipa::path(get, path = "/v1/runs/{id}/wait", tag = "runs", params(("id" = uuid::Uuid, Path, description = "run id"), WaitQuery),
    responses((status = 200, body = RunView), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn wait(
    State(state): State<ApiState>,
    owner: Owner,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<WaitQuery>,
) -> Result<Response, ApiError> {
    let id = parse_run_id(&id)?;
    let timeout = wait_duration(q.timeout_s)?;
    owned_run(&state, &owner, id).await?;
    let _held = state.quotas.take(&owner.0, super::quota::Kind::Wait)?;
    wait_view(&state, id, timeout, None).await
}

/// `GET /v1/runs/{id}`
#[utoipa::path(get, path = "/v1/runs/{id}", tag = "runs", params(("id" = uuid::Uuid, Path, description = "run id")),
    responses((status = 200, body = RunView), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn get(
    State(state): State<ApiState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<Json<RunView>, ApiError> {
    let r = owned_run(&state, &owner, parse_run_id(&id)?).await?;
    Ok(Json(RunView::build(state.app.store.as_ref(), r).await?))
}

/// Query of `GET /v1/runs`.
#[derive(Deserialize, IntoParams, Default)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// Comma-separated states (queued, running, waiting, succeeded, failed, cancelled).
    #[param(
        pattern = "^(queued|running|waiting|succeeded|failed|cancelled)(,(queued|running|waiting|succeeded|failed|cancelled))*$"
    )]
    status: Option<String>,
    /// Agent name.
    agent: Option<String>,
    /// Thread id.
    #[param(pattern = "^[A-Za-z0-9_.:-]{1,200}$")]
    thread_id: Option<String>,
    /// Parent run id.
    #[param(value_type = Option<String>, format = Uuid)]
    parent_run_id: Option<String>,
    /// Only runs this schedule started.
    schedule_id: Option<String>,
    /// Text the input or the result contains (case-insensitive, at most 200 characters).
    #[param(max_length = 200)]
    q: Option<String>,
    /// Only runs created at or after this time (RFC 3339).
    #[param(value_type = Option<String>, format = DateTime)]
    since: Option<String>,
    /// Only runs created before this time (RFC 3339).
    #[param(value_type = Option<String>, format = DateTime)]
    until: Option<String>,
    /// `newest` (default) or `oldest` first.
    #[param(pattern = "^(newest|oldest)$")]
    order: Option<String>,
    /// Another owner's runs: admins only (`admin` in the keys file); anyone may name itself.
    #[param(max_length = 200)]
    owner: Option<String>,
    /// `next_cursor` of the previous page.
    #[param(value_type = Option<String>, format = Uuid)]
    cursor: Option<String>,
    /// 1..=100, default 20.
    #[param(minimum = 1, maximum = 100)]
    limit: Option<u32>,
}

impl ListQuery {
    /// The owner it names, if any.
    pub fn owner(&self) -> Option<&str> {
        self.owner.as_deref()
    }

    /// The store filter this query asks for, or the 400 that says what is wrong with it.
    pub fn filter(self) -> Result<RunFilter, ApiError> {
        if self.status.as_deref().is_some_and(|s| s.trim().is_empty()) {
            return Err(ApiError::bad_request(
                "invalid_status",
                "status must name at least one state",
            ));
        }
        let mut status = vec![];
        for s in self
            .status
            .iter()
            .flat_map(|s| s.split(','))
            .map(str::trim)
            .filter(|s| !s.is_empty())
        {
            status.push(RunStatus::parse(s).ok_or_else(|| {
                ApiError::bad_request("invalid_status", format!("unknown status `{s}`; use queued, running, waiting, succeeded, failed or cancelled"))
            })?);
        }
        let time = |name: &str,
                    v: Option<String>|
         -> Result<Option<chrono::DateTime<chrono::Utc>>, ApiError> {
            v.map(|t| {
                chrono::DateTime::parse_from_rfc3339(&t)
                    .map(|d| d.with_timezone(&chrono::Utc))
                    .map_err(|_| ApiError::bad_request("invalid_time", format!("{name} must be an RFC 3339 time such as 2026-12-01T09:30:00Z, not `{t}`")))
            })
            .transpose()
        };
        let text = self
            .q
            .map(|q| q.trim().to_owned())
            .filter(|q| !q.is_empty());
        if text.as_ref().is_some_and(|t| t.chars().count() > 200) {
            return Err(ApiError::bad_request(
                "invalid_query",
                "q must be at most 200 characters",
            ));
        }
        let oldest_first = match self.order.as_deref() {
            None | Some("newest") => false,
            Some("oldest") => true,
            Some(o) => {
                return Err(ApiError::bad_request(
                    "invalid_order",
                    format!("order must be newest or oldest, not `{o}`"),
                ));
            }
        };
        Ok(RunFilter {
            status,
            agent: self.agent,
            thread_id: self
                .thread_id
                .as_deref()
                .map(ThreadId::chosen)
                .transpose()
                .map_err(|e| ApiError::bad_request("invalid_id", e.to_string()))?,
            parent_run_id: self
                .parent_run_id
                .as_deref()
                .map(parse_run_id)
                .transpose()?,
            text,
            schedule_id: self.schedule_id,
            created_after: time("since", self.since)?,
            created_before: time("until", self.until)?,
            oldest_first,
            before: self
                .cursor
                .as_deref()
                .map(|c| {
                    c.parse().map_err(|_| {
                        ApiError::bad_request(
                            "invalid_cursor",
                            "cursor must be a next_cursor from an earlier page",
                        )
                    })
                })
                .transpose()?,
        })
    }
}

/// `GET /v1/runs`: newest first; `next_cursor` pages on.
#[utoipa::path(get, path = "/v1/runs", tag = "runs", params(ListQuery), responses((status = 200, body = RunsPage), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 403, description = "forbidden: another owner's runs, asked by a key that is not an admin's", body = ErrorBody), (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn list(
    State(state): State<ApiState>,
    owner: Owner,
    ApiQuery(mut q): ApiQuery<ListQuery>,
) -> Result<Json<RunsPage>, ApiError> {
    let limit = q.limit.unwrap_or(20);
    if !(1..=100).contains(&limit) {
        return Err(ApiError::bad_request(
            "invalid_limit",
            "limit must be 1 to 100",
        ));
    }
    let whose = match q.owner.take().map(OwnerId::from) {
        Some(o) if o != owner.0 && !state.keys.is_admin(&owner.0) => {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "forbidden",
                "only an admin (`admin` on its line of the keys file) may list another owner's runs",
            ));
        }
        Some(o) => o,
        None => owner.0.clone(),
    };
    let mut filter = q.filter()?;
    if let Some(t) = &filter.thread_id {
        filter.thread_id = Some(state.app.thread_for(&whose, t).await?);
    }
    let runs = state.app.store.list_runs(&whose, &filter, limit).await?;
    let next_cursor = (runs.len() == limit as usize)
        .then(|| runs.last().map(|r| r.id))
        .flatten();
    let mut views = Vec::with_capacity(runs.len());
    for r in runs {
        views.push(RunView::build(state.app.store.as_ref(), r).await?);
    }
    Ok(Json(RunsPage {
        runs: views,
        next_cursor,
    }))
}

/// Query of `GET /v1/runs/{id}/events`.
#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct EventsQuery {
    /// Events with seq greater than this (default 0).
    #[param(minimum = 0, maximum = 9007199254740991_i64)]
    after: Option<u64>,
    /// 1..=1000, default 100 (JSON pages only).
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<u32>,
    /// `deltas` (SSE only): between the durable events, the step in flight's text and
    /// tool-argument fragments as `model.delta` events (no id: never numbered, never replayed).
    include: Option<String>,
}

/// `GET /v1/runs/{id}/events`: a JSON page, or with `Accept: text/event-stream` an SSE stream
/// that resumes from `Last-Event-ID` and ends after the terminal event; `include=deltas` adds
/// the step in flight's fragments as unnumbered `model.delta` events.
#[utoipa::path(get, path = "/v1/runs/{id}/events", tag = "runs", params(("id" = uuid::Uuid, Path, description = "run id"), EventsQuery),
    responses((status = 200, description = "a page, or with Accept: text/event-stream an SSE stream", body = EventsPage), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn events(
    State(state): State<ApiState>,
    owner: Owner,
    Path(id): Path<String>,
    headers: HeaderMap,
    ApiQuery(q): ApiQuery<EventsQuery>,
) -> Result<Response, ApiError> {
    let id = parse_run_id(&id)?;
    owned_run(&state, &owner, id).await?;
    let limit = q.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(ApiError::bad_request(
            "invalid_limit",
            "limit must be 1 to 1000",
        ));
    }
    if q.after.is_some_and(|a| a > MAX_SEQ) {
        return Err(ApiError::bad_request(
            "invalid_cursor",
            "after is larger than any event seq",
        ));
    }
    let wants_sse = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("text/event-stream"));
    let deltas = match q.include.as_deref() {
        None => false,
        Some("deltas") if wants_sse => true,
        Some("deltas") => {
            return Err(ApiError::bad_request(
                "invalid_query",
                "include=deltas needs an SSE stream (Accept: text/event-stream)",
            ));
        }
        Some(other) => {
            return Err(ApiError::bad_request(
                "invalid_query",
                format!("include={other} is not known; the one value is `deltas`"),
            ));
        }
    };
    if !wants_sse {
        let after = q.after.unwrap_or(0);
        let events = state.app.events_after(id, after, limit).await?;
        let next_after = events.last().map(|e| e.seq).unwrap_or(after);
        return Ok(Json(EventsPage { events, next_after }).into_response());
    }
    let last_event_id = match headers.get("last-event-id") {
        None => None,
        Some(v) => Some(
            v.to_str()
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
                .ok_or_else(|| {
                    ApiError::bad_request("invalid_cursor", "Last-Event-ID must be an event seq")
                })?,
        ),
    };
    let cursor = last_event_id.or(q.after).unwrap_or(0);
    if cursor > MAX_SEQ {
        return Err(ApiError::bad_request(
            "invalid_cursor",
            "Last-Event-ID is larger than any event seq",
        ));
    }
    let held = state.quotas.take(&owner.0, super::quota::Kind::Stream)?;
    // Listening starts before the first durable read, so no fragment after it is missed.
    let live = if deltas {
        Some(live_deltas(&state, id).await)
    } else {
        None
    };
    let durable = async_stream(state.clone(), id, cursor);
    let merged: futures::stream::BoxStream<'static, Result<Event, Infallible>> = match live {
        None => Box::pin(durable),
        Some(live) => {
            use futures::StreamExt;
            // The deltas end with the durable stream (after the terminal event).
            let ended = tokio_util::sync::CancellationToken::new();
            let end = ended.clone();
            let durable = durable.chain(futures::stream::poll_fn(move |_| {
                end.cancel();
                std::task::Poll::Ready(None)
            }));
            let live = live.take_until(ended.cancelled_owned()).map(|mut d| {
                d["type"] = json!("model.delta");
                Ok(Event::default().event("model.delta").data(d.to_string()))
            });
            Box::pin(futures::stream::select(durable, live))
        }
    };
    // The stream holds its place against the key's cap until it ends.
    let stream = futures::StreamExt::map(merged, move |e| {
        let _ = &held;
        e
    });
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response())
}

/// `run`'s live model fragments: through Redis when the deployment has it (the worker may be
/// another process), else from this process's workers.
async fn live_deltas(state: &ApiState, run: RunId) -> futures::stream::BoxStream<'static, Value> {
    if let Some(redis) = &state.app.redis {
        match redis.live_deltas(run).await {
            Ok(s) => return Box::pin(s),
            Err(e) => {
                tracing::warn!(error = %e, "cannot read token deltas from Redis; the stream has durable events only");
                return Box::pin(futures::stream::empty());
            }
        }
    }
    Box::pin(futures::StreamExt::map(
        state.app.engine.live.stream(run),
        |v| (*v).clone(),
    ))
}

/// The SSE stream: sleeps on the run's notification between batches; ends after the terminal
/// event.
fn async_stream(
    state: ApiState,
    id: RunId,
    cursor: u64,
) -> impl futures::Stream<Item = Result<Event, Infallible>> {
    struct St {
        state: ApiState,
        cursor: u64,
        done: bool,
        buf: VecDeque<Event>,
        /// What the next read must be fresher than, besides the run's generation.
        not_before: Option<std::time::Instant>,
        /// Kept while the events go out, so a stream is not put behind the run's other
        /// waiters by the time it spent writing.
        watch: crate::notify::Watch,
    }
    let watch = crate::notify::Watch::new(
        state.app.store.subscribe(id),
        CROSS_PROCESS_RECHECK * 4,
        crate::app::SHARED_READ_AGE,
    );
    // The first read starts after the request came in.
    let init = St {
        state,
        cursor,
        done: false,
        buf: VecDeque::new(),
        not_before: Some(std::time::Instant::now()),
        watch,
    };
    futures::stream::unfold(init, move |mut st| async move {
        loop {
            if let Some(e) = st.buf.pop_front() {
                return Some((Ok(e), st));
            }
            if st.done {
                return None;
            }
            // Until there is something to send: read, then sleep on the watch.
            loop {
                // Waits and streams woken by the same commit share one snapshot of the run; a
                // stream it does not cover shares a page with the others at its cursor.
                let fresh = st.watch.fresh(st.not_before);
                let state = &st.state;
                let snapshot = state
                    .waits
                    .read(id, fresh, || RunSnapshot::read(state, id))
                    .await;
                let page;
                let events = match snapshot.as_ref().map(|(s, _)| s.events_for(st.cursor)) {
                    Ok(Some(events)) => Ok(events),
                    Ok(None) => match state
                        .app
                        .events_after_shared(id, st.cursor, 200, fresh)
                        .await
                    {
                        Ok(e) => {
                            page = e;
                            Ok(page.as_slice())
                        }
                        Err(err) => Err(err.to_string()),
                    },
                    Err(err) => Err(err.to_string()),
                };
                let events = match events {
                    Ok(events) => events,
                    Err(err) => {
                        tracing::warn!(error = %err, "SSE read failed; retrying");
                        tokio::time::sleep(Duration::from_millis(500)).await;
                        continue;
                    }
                };
                for e in events {
                    st.cursor = e.record.seq;
                    st.done |= is_terminal(&e.record.kind);
                    st.buf.push_back(
                        Event::default()
                            .id(e.record.seq.to_string())
                            .event(&e.record.kind)
                            .data(&e.json),
                    );
                }
                if !st.buf.is_empty() {
                    // The generation taken before the next read covers what this one missed.
                    st.not_before = None;
                    break;
                }
                st.not_before = st.watch.next().await;
            }
        }
    })
}

/// `POST /v1/runs/{id}/cancel`: idempotent; 409 `already_finished` once the run has ended.
#[utoipa::path(post, path = "/v1/runs/{id}/cancel", tag = "runs", params(("id" = uuid::Uuid, Path, description = "run id")),
    responses((status = 202, body = RunView), (status = 409, description = "already_finished", body = ErrorBody), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn cancel(
    State(state): State<ApiState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let id = parse_run_id(&id)?;
    let run = owned_run(&state, &owner, id).await?;
    match state.app.cancel(id).await? {
        // Repeating a cancel of a cancelled run is not an error: cancel is idempotent.
        CancelOutcome::Cancelled
        | CancelOutcome::Requested
        | CancelOutcome::AlreadyFinished(RunStatus::Cancelled) => {
            let r = state.app.store.get_run(id).await?.unwrap_or(run);
            Ok((
                StatusCode::ACCEPTED,
                Json(RunView::build(state.app.store.as_ref(), r).await?),
            )
                .into_response())
        }
        CancelOutcome::AlreadyFinished(s) => Err(ApiError {
            status: StatusCode::CONFLICT,
            code: "already_finished",
            message: format!(
                "run {id} already ended as {}; there is nothing to cancel",
                s.as_str()
            ),
            details: Some(json!({"status": s})),
        }),
        CancelOutcome::NotFound => Err(ApiError::not_found("run")),
    }
}

/// 429 `inbox_full`: as many messages as may wait for one run already do.
fn inbox_full(run: RunId) -> ApiError {
    ApiError::new(
        StatusCode::TOO_MANY_REQUESTS,
        "inbox_full",
        format!(
            "{} messages already wait for run {run}; send more once it has read them (its next step)",
            crate::store::MAX_WAITING_MESSAGES
        ),
    )
}

/// The body of `POST /v1/runs/{id}/messages`.
#[derive(Deserialize, Debug, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MessageBody {
    /// The message, as the user's words to the model (not empty; at most
    /// `SUBAGENTS_MAX_INPUT_BYTES`).
    content: String,
}

/// What `POST /v1/runs/{id}/messages` answers.
#[derive(serde::Serialize, Debug, ToSchema)]
pub struct MessageSent {
    /// The run.
    #[schema(value_type = String)]
    run_id: RunId,
    /// The message (`msg_…`): its `message.received` and `message.delivered` events name it.
    #[schema(value_type = String)]
    message_id: crate::ids::MessageId,
    /// Always `pending`: it is committed, and the run's next step boundary delivers it.
    status: &'static str,
}

/// `POST /v1/runs/{id}/messages`: a message for a queued, running or waiting run, committed at
/// once (`message.received`) and delivered at the run's next step boundary
/// (`message.delivered`): the model sees it before its next call, never between a step's tool
/// calls. A run parked on children wakes for it; one parked on an approval or a rate limit
/// hears it when that ends. 409 `already_finished` once the run has ended.
#[utoipa::path(post, path = "/v1/runs/{id}/messages", tag = "runs", params(("id" = uuid::Uuid, Path, description = "run id")), request_body = MessageBody,
    responses((status = 202, body = MessageSent), (status = 409, description = "already_finished", body = ErrorBody), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody), (status = 413, body = ErrorBody), (status = 422, body = ErrorBody), (status = 429, description = "inbox_full", body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn message(
    State(state): State<ApiState>,
    owner: Owner,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<MessageBody>,
) -> Result<Response, ApiError> {
    let id = parse_run_id(&id)?;
    let run = owned_run(&state, &owner, id).await?;
    if body.content.trim().is_empty() {
        return Err(ApiError::bad_request(
            "empty_input",
            "content is empty; send the words the run should hear",
        ));
    }
    let limit = state.app.settings.max_input_bytes;
    if body.content.len() > limit {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "input_too_large",
            format!(
                "the message is {} bytes; the limit is {limit} (SUBAGENTS_MAX_INPUT_BYTES)",
                body.content.len()
            ),
        ));
    }
    if body.content.contains('\0') {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "nul_character",
            "the message contains a NUL character, which cannot be stored; remove it",
        ));
    }
    match state
        .app
        .send_message(id, &run.owner, &body.content)
        .await?
    {
        (message_id, crate::store::Sent::Accepted { .. }) => Ok((
            StatusCode::ACCEPTED,
            Json(MessageSent {
                run_id: id,
                message_id,
                status: "pending",
            }),
        )
            .into_response()),
        (_, crate::store::Sent::Finished(s)) => {
            let thread = run.thread_id.visible_to(&run.owner);
            Err(ApiError {
                status: StatusCode::CONFLICT,
                code: "already_finished",
                message: format!(
                    "run {id} already ended as {}; to go on, start a new run on its thread (POST /v1/runs with \"thread_id\": \"{thread}\")",
                    s.as_str()
                ),
                details: Some(json!({"status": s, "thread_id": thread.to_string()})),
            })
        }
        (_, crate::store::Sent::Full) => Err(inbox_full(id)),
        (_, crate::store::Sent::NotFound) => Err(ApiError::not_found("run")),
    }
}

/// The optional body of `POST /v1/runs/{id}/retry`.
#[derive(Deserialize, Debug, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RetryBody {
    /// Run this instead of the original's input ("do that differently").
    #[serde(default)]
    input: Option<String>,
}

/// `POST /v1/runs/{id}/retry`: a new run on the same thread with the same agent, input, limits
/// and metadata, linked by `retry_of` (201; 200 with the same run when this run was retried
/// before). Only a failed or cancelled root run: otherwise 409 `not_retryable`.
#[utoipa::path(post, path = "/v1/runs/{id}/retry", tag = "runs", params(("id" = uuid::Uuid, Path, description = "run id")), request_body(content = Option<RetryBody>, description = "optional: `{input}` to run instead of the original's"),
    responses((status = 201, body = RunView), (status = 200, description = "retried before: the first retry", body = RunView), (status = 409, description = "not_retryable", body = ErrorBody), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn retry(
    State(state): State<ApiState>,
    owner: Owner,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let id = parse_run_id(&id)?;
    let run = owned_run(&state, &owner, id).await?;
    // The body is optional: none (or `{}`) reruns the same input.
    let input = if body.iter().all(u8::is_ascii_whitespace) {
        None
    } else {
        let b: RetryBody = serde_json::from_slice(&body).map_err(|e| {
            if e.is_data() {
                ApiError::new(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "invalid_request",
                    format!("the request body does not match the schema: {e}"),
                )
            } else {
                ApiError::bad_request(
                    "malformed_json",
                    format!("the request body is not valid JSON: {e}"),
                )
            }
        })?;
        b.input
    };
    let created = state.app.retry(&run, input).await?;
    let status = if created.existing {
        StatusCode::OK
    } else {
        StatusCode::CREATED
    };
    Ok((
        status,
        Json(RunView::build(state.app.store.as_ref(), created.run).await?),
    )
        .into_response())
}
