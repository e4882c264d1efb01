//! `/v1/overview` (and its SSE stream) and `/v1/runs/bulk`: what a queue-monitoring dashboard
//! reads and does. The overview is computed from the database, so every worker's work shows,
//! not only this process's.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, DurationRound, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::watch;
use utoipa::ToSchema;

use super::auth::Owner;
use super::runs::ListQuery;
use super::views::ErrorBody;
use super::{ApiError, ApiJson, ApiState};
use crate::domain::OverviewData;
use crate::ids::{OwnerId, RunId};
use crate::store::RunStatus;

/// At most this many recent events feed the per-minute figures (beyond: a sample, flagged).
const EVENT_CAP: u32 = 20_000;
/// A worker whose heartbeat is older than this is shown as gone.
const WORKER_ALIVE_S: i64 = 30;
/// Most runs one bulk request acts on.
pub const BULK_MAX: usize = 1000;

/// One minute of the last hour.
#[derive(Serialize, Clone, Debug, PartialEq, ToSchema)]
pub struct Minute {
    /// Start of the minute.
    pub at: DateTime<Utc>,
    /// Runs that ended in it (any way).
    pub runs_finished: u64,
    /// Runs that failed in it.
    pub runs_failed: u64,
    /// Model calls completed in it.
    pub steps: u64,
    /// Median model-call latency in ms (absent without calls).
    pub step_ms_p50: Option<u64>,
    /// 95th percentile model-call latency in ms.
    pub step_ms_p95: Option<u64>,
    /// Tokens sent and produced.
    pub tokens: u64,
    /// What those calls cost in US dollars.
    pub cost_usd: f64,
}

/// A worker process and the owner's runs it holds.
#[derive(Serialize, Clone, Debug, PartialEq, ToSchema)]
pub struct WorkerView {
    /// Worker name (`subagents-<pid>-<id>`).
    pub name: String,
    /// Its last heartbeat.
    pub last_seen: DateTime<Utc>,
    /// Heartbeat within the last 30 s.
    pub alive: bool,
    /// The owner's runs it executes now.
    pub runs: Vec<RunId>,
}

/// Queue depth and age.
#[derive(Serialize, Clone, Debug, PartialEq, ToSchema)]
pub struct QueueView {
    /// Runs waiting for a worker.
    pub depth: u64,
    /// When the oldest of them was enqueued.
    pub oldest_queued_at: Option<DateTime<Utc>>,
    /// How long it has waited, in seconds.
    pub oldest_age_s: Option<f64>,
}

/// Totals of the last hour.
#[derive(Serialize, Clone, Debug, PartialEq, ToSchema)]
pub struct HourTotals {
    /// Runs ended.
    pub runs_finished: u64,
    /// Runs failed.
    pub runs_failed: u64,
    /// Model calls.
    pub steps: u64,
    /// Tokens.
    pub tokens: u64,
    /// Cost in US dollars.
    pub cost_usd: f64,
}

/// The owner's runs and the fleet at a glance.
#[derive(Serialize, Clone, Debug, PartialEq, ToSchema)]
pub struct Overview {
    /// When it was computed.
    pub now: DateTime<Utc>,
    /// Runs per state (every state present, 0 included).
    pub runs: BTreeMap<String, u64>,
    /// The queue.
    pub queue: QueueView,
    /// The last 60 minutes, oldest first.
    pub minutes: Vec<Minute>,
    /// The last hour in sum.
    pub last_hour: HourTotals,
    /// True when the hour held more events than are read (the minutes are then a sample).
    pub sampled: bool,
    /// Failed runs of the last 24 hours per `error.kind`.
    pub failures_24h: BTreeMap<String, u64>,
    /// Worker processes seen in the last day, newest heartbeat first.
    pub workers: Vec<WorkerView>,
    /// Who is looking: the page offers an owner filter to admins.
    pub viewer: Viewer,
}

/// The owner a key belongs to, and whether it is an admin (`admin` in the keys file: may list
/// and open every owner's runs).
#[derive(Clone, Debug, Default, Serialize, ToSchema, PartialEq)]
pub struct Viewer {
    /// The key's owner.
    #[schema(value_type = String)]
    pub owner: OwnerId,
    /// May look at other owners' runs.
    pub admin: bool,
}

fn percentile(sorted: &[u64], p: f64) -> Option<u64> {
    if sorted.is_empty() {
        return None;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    Some(sorted[i.min(sorted.len() - 1)])
}

impl Overview {
    /// Folds the store's rows into the view (pure: tested without a database).
    pub fn build(d: OverviewData, now: DateTime<Utc>) -> Overview {
        let mut runs: BTreeMap<String, u64> = RunStatus::ALL
            .iter()
            .map(|s| (s.as_str().to_owned(), 0))
            .collect();
        for (s, n) in &d.by_status {
            runs.insert(s.as_str().to_owned(), *n);
        }
        let this_minute = now
            .duration_trunc(chrono::Duration::minutes(1))
            .unwrap_or(now);
        let first = this_minute - chrono::Duration::minutes(59);
        let mut minutes: Vec<Minute> = (0..60)
            .map(|i| Minute {
                at: first + chrono::Duration::minutes(i),
                runs_finished: 0,
                runs_failed: 0,
                steps: 0,
                step_ms_p50: None,
                step_ms_p95: None,
                tokens: 0,
                cost_usd: 0.0,
            })
            .collect();
        let mut latencies: Vec<Vec<u64>> = vec![vec![]; 60];
        for (_, kind, data, at) in &d.events {
            let i = (*at - first).num_minutes();
            if !(0..60).contains(&i) || *at < first {
                continue;
            }
            let m = &mut minutes[i as usize];
            match kind.as_str() {
                "model.completed" => {
                    m.steps += 1;
                    let u = &data["usage"];
                    m.tokens += u["prompt_tokens"].as_u64().unwrap_or(0)
                        + u["completion_tokens"].as_u64().unwrap_or(0);
                    m.cost_usd += data["cost_usd"].as_f64().unwrap_or(0.0);
                    if let Some(ms) = data["ms"].as_u64() {
                        latencies[i as usize].push(ms);
                    }
                }
                "run.failed" => {
                    m.runs_finished += 1;
                    m.runs_failed += 1;
                }
                _ => m.runs_finished += 1,
            }
        }
        for (m, l) in minutes.iter_mut().zip(latencies.iter_mut()) {
            l.sort_unstable();
            m.step_ms_p50 = percentile(l, 0.5);
            m.step_ms_p95 = percentile(l, 0.95);
        }
        let last_hour = HourTotals {
            runs_finished: minutes.iter().map(|m| m.runs_finished).sum(),
            runs_failed: minutes.iter().map(|m| m.runs_failed).sum(),
            steps: minutes.iter().map(|m| m.steps).sum(),
            tokens: minutes.iter().map(|m| m.tokens).sum(),
            cost_usd: minutes.iter().map(|m| m.cost_usd).sum(),
        };
        let oldest_queued_at = d.oldest_queued_ms.and_then(DateTime::from_timestamp_millis);
        let mut held: BTreeMap<String, Vec<RunId>> = BTreeMap::new();
        for (id, worker, _) in &d.running {
            if let Some(w) = worker {
                held.entry(w.clone()).or_default().push(*id);
            }
        }
        let day_ago = now - chrono::Duration::days(1);
        let workers = d
            .workers
            .iter()
            .filter(|(_, seen)| *seen >= day_ago)
            .map(|(name, seen)| WorkerView {
                name: name.clone(),
                last_seen: *seen,
                alive: (now - *seen).num_seconds() <= WORKER_ALIVE_S,
                runs: held.remove(name).unwrap_or_default(),
            })
            .collect();
        Overview {
            now,
            queue: QueueView {
                depth: runs.get("queued").copied().unwrap_or(0),
                oldest_queued_at,
                oldest_age_s: oldest_queued_at
                    .map(|t| ((now - t).num_milliseconds().max(0) as f64) / 1000.0),
            },
            runs,
            minutes,
            last_hour,
            sampled: d.events_capped,
            failures_24h: d.failures.into_iter().collect(),
            workers,
            viewer: Viewer::default(),
        }
    }
}

async fn compute(state: &ApiState, owner: &OwnerId) -> Result<Overview, ApiError> {
    let now = Utc::now();
    let data = state
        .app
        .store
        .overview(
            owner,
            now - chrono::Duration::hours(1) - chrono::Duration::minutes(1),
            now - chrono::Duration::days(1),
            EVENT_CAP,
        )
        .await?;
    let mut o = Overview::build(data, now);
    o.viewer = Viewer {
        owner: owner.to_owned(),
        admin: state.keys.is_admin(owner),
    };
    Ok(o)
}

/// `GET /v1/overview`: the owner's runs by state, the queue, the last hour per minute
/// (throughput, model-call latency, tokens, cost), failures by kind, and the workers.
#[utoipa::path(get, path = "/v1/overview", tag = "dashboard", responses((status = 200, body = Overview), (status = 401, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn get(State(state): State<ApiState>, owner: Owner) -> Result<Json<Overview>, ApiError> {
    Ok(Json(compute(&state, &owner.0).await?))
}

/// `GET /v1/overview/stream`: the overview as SSE `overview` events: one at once, then one
/// whenever it changes (checked every 2 s), so a page stays live without polling. Every stream
/// of one owner shares one computation ([`Feeds`]), and each counts against the key's cap on
/// open streams.
#[utoipa::path(get, path = "/v1/overview/stream", tag = "dashboard", responses((status = 200, description = "text/event-stream of `overview` events", content_type = "text/event-stream"), (status = 401, body = ErrorBody), (status = 429, body = ErrorBody)))]
pub async fn stream(State(state): State<ApiState>, owner: Owner) -> Result<Response, ApiError> {
    let held = state.quotas.take(&owner.0, super::quota::Kind::Stream)?;
    let mut feed = state.overviews.subscribe(&state, &owner.0);
    let current = feed.borrow_and_update().clone();
    let first = match current {
        Some(o) => o,
        None => Arc::new(compute(&state, &owner.0).await?),
    };
    let stream = overview_events(feed, first, held);
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response())
}

/// What changes between two sends; `now` and ages always move, so they are not compared.
fn change_key(o: &Overview) -> Value {
    serde_json::json!([
        o.runs,
        o.minutes,
        o.failures_24h,
        o.workers
            .iter()
            .map(|w| (&w.name, w.alive, &w.runs))
            .collect::<Vec<_>>()
    ])
}

fn overview_events(
    feed: watch::Receiver<Option<Arc<Overview>>>,
    first: Arc<Overview>,
    held: super::quota::Held,
) -> impl futures::Stream<Item = Result<Event, Infallible>> {
    futures::stream::unfold(
        (feed, Some(first), None::<Value>, held),
        |(mut feed, mut pending, last, held)| async move {
            loop {
                if let Some(o) = pending.take() {
                    let k = change_key(&o);
                    if last.as_ref() != Some(&k) {
                        let ev = Event::default()
                            .event("overview")
                            .json_data(&*o)
                            .unwrap_or_default();
                        return Some((Ok(ev), (feed, None, Some(k), held)));
                    }
                }
                // The feed ends only with the server; a stream that outlives it ends too.
                feed.changed().await.ok()?;
                pending = feed.borrow_and_update().clone();
            }
        },
    )
}

/// The overview of each owner that has a stream open, computed once every 2 s however many
/// streams the owner has: 200 streams of one owner cost what one does. The computing task
/// stops when the owner's last stream closes.
#[derive(Default)]
pub struct Feeds {
    by_owner: Mutex<HashMap<String, watch::Receiver<Option<Arc<Overview>>>>>,
}

impl Feeds {
    /// The owner's feed, started if it is not running.
    fn subscribe(
        self: &Arc<Self>,
        state: &ApiState,
        owner: &OwnerId,
    ) -> watch::Receiver<Option<Arc<Overview>>> {
        let mut map = self.by_owner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(rx) = map.get(owner.as_str()) {
            return rx.clone();
        }
        let (tx, rx) = watch::channel(None);
        map.insert(owner.to_string(), rx.clone());
        let (state, owner, feeds) = (state.clone(), owner.to_owned(), self.clone());
        tokio::spawn(async move {
            loop {
                // The database away: keep the feed and try again at the next tick.
                if let Ok(o) = compute(&state, &owner).await {
                    tx.send_replace(Some(Arc::new(o)));
                }
                tokio::time::sleep(Duration::from_secs(2)).await;
                // Under the map's lock, so a stream subscribing now either counts here or
                // starts a new feed.
                let mut map = feeds.by_owner.lock().unwrap_or_else(|e| e.into_inner());
                if tx.receiver_count() <= 1 {
                    if map
                        .get(owner.as_str())
                        .is_some_and(|rx| rx.same_channel(&tx.subscribe()))
                    {
                        map.remove(owner.as_str());
                    }
                    break;
                }
            }
        });
        rx
    }

    /// Owners whose overview is being computed now.
    pub fn running(&self) -> usize {
        self.by_owner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }
}

/// What a bulk request does.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum BulkAction {
    /// Cancel each run (already ended ones are skipped).
    Cancel,
    /// Retry each failed or cancelled root run.
    Retry,
}

/// `POST /v1/runs/bulk`: an action on listed runs or on every run a filter matches.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BulkBody {
    /// `cancel` or `retry`.
    pub action: BulkAction,
    /// These runs (at most 1000).
    pub run_ids: Option<Vec<String>>,
    /// Or every run matching these `GET /v1/runs` filters (`status`, `agent`, `thread_id`,
    /// `parent_run_id`, `q`, `since`, `until`), at most 1000 per request.
    #[schema(value_type = Option<Object>)]
    pub filter: Option<Value>,
}

/// One run a bulk action acted on.
#[derive(Serialize, Debug, ToSchema)]
pub struct BulkDone {
    /// The run.
    pub run_id: RunId,
    /// For a retry: the new run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub new_run_id: Option<RunId>,
}

/// One run a bulk action left alone, and why.
#[derive(Serialize, Debug, ToSchema)]
pub struct BulkSkipped {
    /// The run (as given).
    pub run_id: String,
    /// Stable code (`not_found`, `already_finished`, `not_retryable`, …).
    pub code: String,
    /// Why.
    pub message: String,
}

/// What a bulk action did.
#[derive(Serialize, Debug, ToSchema)]
pub struct BulkResult {
    /// The action.
    pub action: BulkAction,
    /// Runs acted on.
    pub done: Vec<BulkDone>,
    /// Runs left alone.
    pub skipped: Vec<BulkSkipped>,
    /// A filter matched more than 1000 runs: repeat the request for the rest.
    pub truncated: bool,
}

#[utoipa::path(post, path = "/v1/runs/bulk", tag = "runs", request_body = BulkBody,
    responses((status = 200, body = BulkResult), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 422, body = ErrorBody), (status = 503, body = ErrorBody)))]
/// `POST /v1/runs/bulk`: cancel or retry listed runs, or every run a filter matches; each run is
/// reported as done or skipped with the code a single request would have answered.
pub async fn bulk(
    State(state): State<ApiState>,
    owner: Owner,
    ApiJson(body): ApiJson<BulkBody>,
) -> Result<Json<BulkResult>, ApiError> {
    let (ids, truncated): (Vec<String>, bool) = match (body.run_ids, body.filter) {
        (Some(ids), None) => {
            if ids.is_empty() || ids.len() > BULK_MAX {
                return Err(ApiError::bad_request(
                    "invalid_run_ids",
                    format!("run_ids must list 1 to {BULK_MAX} runs"),
                ));
            }
            (ids, false)
        }
        (None, Some(filter)) => {
            let q: ListQuery = serde_json::from_value(filter)
                .map_err(|e| ApiError::bad_request("invalid_filter", format!("filter: {e}")))?;
            if q.owner().is_some_and(|o| owner.0 != o) {
                return Err(ApiError::bad_request(
                    "invalid_filter",
                    "a bulk action works on your own runs: leave owner out of the filter",
                ));
            }
            let mut f = q.filter()?;
            if let Some(t) = &f.thread_id {
                f.thread_id = Some(state.app.thread_for(&owner.0, t).await?);
            }
            let mut ids = vec![];
            loop {
                let page = state.app.store.list_runs(&owner.0, &f, 100).await?;
                let n = page.len();
                f.before = page.last().map(|r| r.id);
                ids.extend(page.into_iter().map(|r| r.id.to_string()));
                if n < 100 || ids.len() > BULK_MAX {
                    break;
                }
            }
            let truncated = ids.len() > BULK_MAX;
            ids.truncate(BULK_MAX);
            (ids, truncated)
        }
        _ => {
            return Err(ApiError::bad_request(
                "invalid_request",
                "give either run_ids or filter",
            ));
        }
    };
    let mut done = vec![];
    let mut skipped = vec![];
    for raw in ids {
        let skip = |code: &str, message: String| BulkSkipped {
            run_id: raw.clone(),
            code: code.to_owned(),
            message,
        };
        let Ok(id) = raw.parse::<RunId>() else {
            skipped.push(skip("invalid_id", format!("`{raw}` is not a run id")));
            continue;
        };
        let run = match state.app.store.get_run(id).await? {
            Some(r) if r.owner == owner.0 => r,
            _ => {
                skipped.push(skip("not_found", "no such run".into()));
                continue;
            }
        };
        match body.action {
            BulkAction::Cancel => match state.app.cancel(id).await? {
                crate::store::CancelOutcome::AlreadyFinished(s) => skipped.push(skip(
                    "already_finished",
                    format!("already ended as {}", s.as_str()),
                )),
                crate::store::CancelOutcome::NotFound => {
                    skipped.push(skip("not_found", "no such run".into()))
                }
                _ => done.push(BulkDone {
                    run_id: id,
                    new_run_id: None,
                }),
            },
            BulkAction::Retry => match state.app.retry(&run, None).await {
                Ok(created) => done.push(BulkDone {
                    run_id: id,
                    new_run_id: Some(created.run.id),
                }),
                Err(e @ crate::runs::StartError::Store(crate::store::StoreError::Db(_))) => {
                    return Err(e.into());
                }
                Err(e) => skipped.push(skip(e.code(), e.to_string())),
            },
        }
    }
    Ok(Json(BulkResult {
        action: body.action,
        done,
        skipped,
        truncated,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn minutes_fold_latency_tokens_cost_and_ends() {
        let now = DateTime::parse_from_rfc3339("2026-12-01T10:30:20Z")
            .unwrap()
            .with_timezone(&Utc);
        let at = |s: &str| DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc);
        let run = RunId::new();
        let call = |ms: u64| json!({"ms": ms, "usage": {"prompt_tokens": 10, "completion_tokens": 5}, "cost_usd": 0.5});
        let d = OverviewData {
            by_status: vec![(RunStatus::Queued, 3), (RunStatus::Failed, 1)],
            oldest_queued_ms: Some(at("2026-12-01T10:30:00Z").timestamp_millis()),
            events: vec![
                (
                    run,
                    "model.completed".into(),
                    call(100),
                    at("2026-12-01T10:30:05Z"),
                ),
                (
                    run,
                    "model.completed".into(),
                    call(300),
                    at("2026-12-01T10:30:06Z"),
                ),
                (
                    run,
                    "model.completed".into(),
                    call(200),
                    at("2026-12-01T10:30:07Z"),
                ),
                (
                    run,
                    "run.failed".into(),
                    json!({}),
                    at("2026-12-01T10:29:59Z"),
                ),
                (
                    run,
                    "run.succeeded".into(),
                    json!({}),
                    at("2026-12-01T09:00:00Z"),
                ),
            ],
            failures: vec![("model".into(), 1)],
            workers: vec![
                ("w1".into(), at("2026-12-01T10:30:10Z")),
                ("w0".into(), at("2026-12-01T10:00:00Z")),
            ],
            running: vec![(run, Some("w1".into()), None)],
            ..Default::default()
        };
        let o = Overview::build(d, now);
        assert_eq!(o.runs["queued"], 3);
        assert_eq!(o.runs["running"], 0, "every state is listed");
        assert_eq!(o.queue.depth, 3);
        assert_eq!(o.queue.oldest_age_s, Some(20.0));
        assert_eq!(o.minutes.len(), 60);
        let last = o.minutes.last().unwrap();
        assert_eq!(last.at, at("2026-12-01T10:30:00Z"));
        assert_eq!(
            (last.steps, last.tokens, last.step_ms_p50, last.step_ms_p95),
            (3, 45, Some(200), Some(300))
        );
        assert!((last.cost_usd - 1.5).abs() < 1e-9);
        assert_eq!(
            (o.minutes[58].runs_finished, o.minutes[58].runs_failed),
            (1, 1)
        );
        assert_eq!(
            o.last_hour.runs_finished, 1,
            "the 09:00 end is outside the hour"
        );
        assert_eq!(o.failures_24h["model"], 1);
        assert!(o.workers[0].alive && !o.workers[1].alive);
        assert_eq!(o.workers[0].runs, vec![run]);
    }
}
