//! Delivering webhooks. A trigger on `sa_events` queues each event a subscription can name in
//! the event's own transaction, so an event that committed is never missed, whatever crashes
//! after. A dispatcher in every `serve` and `worker` process then, at each pass:
//!
//! 1. turns queued events into deliveries, one per subscription that wants the event, and takes
//!    them off the queue in the same transaction. A delivery's id derives from the event and
//!    the subscription, so doing this twice after a crash creates nothing twice; its body (the
//!    run view, or the approval) is fixed here, so every attempt sends the same bytes;
//! 2. claims due deliveries, per subscription at most its in-flight bound less what it has in
//!    flight here, each locked for the attempt's timeout (a process that dies mid-attempt leaves
//!    it to be tried again once the lock lapses: at least once, always under one `webhook-id`);
//! 3. sends each on its own task, signed as Standard Webhooks says, to the address the guard
//!    checked (the same guard as `web_fetch`, with `SUBAGENTS_WEBHOOK_ALLOW`), and records the
//!    outcome: delivered, due again after a doubling back-off, or dead once the retry window is
//!    over. A subscription whose deliveries keep dying is paused with the reason.
//!
//! Nothing here runs on a worker's step path or in the relay: a slow receiver holds up only its
//! own deliveries.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::app::App;
use crate::domain::webhook::{self, Attempted, DueDelivery, NewDelivery, QueuedEvent, Webhook};
use crate::store::{Store, StoreError, now_ms};

/// How often a dispatcher looks for work.
const TICK: Duration = Duration::from_millis(250);
/// How often a dispatcher with no subscriptions to serve looks whether one appeared.
const IDLE_CHECK: Duration = Duration::from_secs(2);
/// Characters of a receiver's answer kept with the delivery.
const BODY_EXCERPT: usize = 500;

/// What a dispatcher is allowed.
#[derive(Clone, Debug)]
pub struct DispatchSettings {
    /// Retries stop this long after the first attempt.
    pub retry_for: Duration,
    /// The first retry's wait (it doubles).
    pub backoff: Duration,
    /// A receiver's time to answer.
    pub timeout: Duration,
    /// Deliveries in flight per subscription.
    pub in_flight: u32,
    /// Dead deliveries in a row that pause a subscription.
    pub pause_after: u32,
    /// Hosts allowed despite resolving to private addresses.
    pub allow: Vec<String>,
}

impl DispatchSettings {
    /// From the process's settings.
    pub fn from(settings: &crate::config::Settings) -> DispatchSettings {
        let secs = |s: f64, lo: f64, hi: f64| Duration::from_secs_f64(s.clamp(lo, hi));
        DispatchSettings {
            retry_for: secs(settings.webhook_retry_for_secs, 0.0, 30.0 * 86_400.0),
            backoff: secs(settings.webhook_backoff_secs, 0.01, 3600.0),
            timeout: secs(settings.webhook_timeout_secs, 0.1, 300.0),
            in_flight: settings.webhook_in_flight.clamp(1, 256),
            pause_after: settings.webhook_pause_after.max(1),
            allow: settings.webhook_allow_hosts(),
        }
    }
}

/// Starts the dispatcher of this process; it stops at `shutdown` (attempts in flight finish or
/// are tried again by whoever claims them after their lock).
pub fn spawn(app: Arc<App>, shutdown: CancellationToken) -> tokio::task::JoinHandle<()> {
    let d = Arc::new(Dispatcher {
        store: app.store.clone(),
        settings: DispatchSettings::from(&app.settings),
        in_flight: Mutex::default(),
        failpoints: app.engine.settings.failpoints.clone(),
    });
    tokio::spawn(async move {
        let mut last_look = None::<Instant>;
        let mut any = false;
        loop {
            if last_look.is_none_or(|t| t.elapsed() >= IDLE_CHECK) {
                // Work is a queued event (the trigger queues none without a subscription) or
                // a delivery due (a retry, a redelivery, one a resume released).
                any = match (
                    d.store.queued_webhook_events(1).await,
                    d.store.due_webhooks(i64::MAX).await,
                ) {
                    (Ok(q), Ok(due)) => !q.is_empty() || !due.is_empty(),
                    _ => true,
                };
                last_look = Some(Instant::now());
            }
            if any && let Err(e) = d.pass().await {
                tracing::warn!(error = %e, "webhook dispatch pass failed; trying again");
            }
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(TICK) => {}
            }
        }
    })
}

struct Dispatcher {
    store: Arc<dyn Store>,
    settings: DispatchSettings,
    /// Attempts under way in this process, per subscription.
    in_flight: Mutex<HashMap<String, u32>>,
    failpoints: Arc<crate::failpoints::Failpoints>,
}

impl Dispatcher {
    async fn pass(self: &Arc<Self>) -> Result<(), StoreError> {
        self.make_deliveries().await?;
        let now = now_ms();
        let due = self.store.due_webhooks(now).await?;
        if due.is_empty() {
            return Ok(());
        }
        let hooks: HashMap<String, Webhook> = self
            .store
            .all_webhooks()
            .await?
            .into_iter()
            .map(|h| (h.id.clone(), h))
            .collect();
        for (id, count) in due {
            // A run's own webhook is not among every owner's: read it by its id.
            let fetched;
            let hook = match hooks.get(&id) {
                Some(h) => h,
                None => match self.store.webhook_by_id(&id).await? {
                    Some(h) => {
                        fetched = h;
                        &fetched
                    }
                    None => continue,
                },
            };
            let busy = self.busy(&id);
            let free = self.settings.in_flight.saturating_sub(busy).min(count);
            if free == 0 {
                continue;
            }
            let lock = now + self.settings.timeout.as_millis() as i64 + 5_000;
            for d in self.store.claim_deliveries(&id, now, lock, free).await? {
                self.adjust(&id, 1);
                let me = self.clone();
                let hook = hook.clone();
                let span = tracing::info_span!("webhook", webhook_id = %hook.id, delivery = %d.id, attempt = d.attempts);
                tokio::spawn(
                    async move {
                        let outcome = me.attempt(&hook, &d).await;
                        if outcome.delivered {
                            tracing::debug!("delivered");
                        } else {
                            tracing::info!(status = ?outcome.status, error = ?outcome.error, retry_at = ?outcome.retry_at, "webhook delivery failed");
                        }
                        if let Err(e) = me
                            .store
                            .record_attempt(&d, &outcome, me.settings.pause_after)
                            .await
                        {
                            tracing::warn!(error = %e, "could not record a webhook attempt; it is tried again when its lock lapses");
                        }
                        me.adjust(&hook.id, -1);
                    }
                    .instrument(span),
                );
            }
        }
        Ok(())
    }

    fn busy(&self, id: &str) -> u32 {
        *self
            .in_flight
            .lock()
            .expect("in-flight lock")
            .get(id)
            .unwrap_or(&0)
    }

    fn adjust(&self, id: &str, by: i32) {
        let mut m = self.in_flight.lock().expect("in-flight lock");
        let n = m.entry(id.to_owned()).or_default();
        *n = n.saturating_add_signed(by);
        if *n == 0 {
            m.remove(id);
        }
    }

    /// Step 1 of the module doc.
    async fn make_deliveries(&self) -> Result<(), StoreError> {
        let events = self.store.queued_webhook_events(200).await?;
        if events.is_empty() {
            return Ok(());
        }
        let mut hooks = self.store.all_webhooks().await?;
        let mut runs: Vec<_> = events.iter().map(|e| e.run_id).collect();
        runs.dedup();
        hooks.extend(self.store.webhooks_of_runs(&runs).await?);
        let mut deliveries = vec![];
        let mut done = vec![];
        for e in events {
            let wanting: Vec<&Webhook> = hooks.iter().filter(|h| h.hears(&e)).collect();
            if !wanting.is_empty() {
                let body = self.body(&e).await?;
                for h in wanting {
                    deliveries.push(NewDelivery {
                        id: webhook::delivery_id(&h.id, e.run_id, e.seq),
                        webhook_id: h.id.clone(),
                        event_type: e.kind.clone(),
                        run_id: e.run_id,
                        body: body.clone(),
                    });
                }
            }
            done.push((e.run_id, e.seq));
        }
        self.store.create_deliveries(deliveries, done).await
    }

    /// A delivery's body: `{type, timestamp, data}`, `data` being the run view for `run.*`
    /// and the approval for `approval.*`.
    async fn body(&self, e: &QueuedEvent) -> Result<String, StoreError> {
        let data = if e.kind.starts_with("approval.") {
            let id = e.data["approval_id"].as_str().unwrap_or_default();
            match self.store.approval(&id.into()).await? {
                Some(a) => serde_json::to_value(a).unwrap_or(Value::Null),
                None => e.data.clone(),
            }
        } else {
            match self.store.get_run(e.run_id).await? {
                Some(r) => serde_json::to_value(
                    crate::api::views::RunView::build(self.store.as_ref(), r).await?,
                )
                .unwrap_or(Value::Null),
                None => e.data.clone(),
            }
        };
        Ok(json!({
            "type": e.kind,
            "timestamp": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            "data": data,
        })
        .to_string())
    }

    /// One attempt, and what it makes of the delivery.
    async fn attempt(&self, hook: &Webhook, d: &DueDelivery) -> Attempted {
        let (status, error, body) = match self.send(hook, d).await {
            Ok((status, body)) if (200..300).contains(&status) => {
                return Attempted {
                    delivered: true,
                    status: Some(status),
                    error: None,
                    body: Some(body),
                    retry_at: None,
                };
            }
            Ok((status, body)) => (
                Some(status),
                Some(format!("the receiver answered HTTP {status}")),
                Some(body),
            ),
            Err(e) => (None, Some(e), None),
        };
        let next =
            now_ms() + webhook::backoff(d.attempts, self.settings.backoff).as_millis() as i64;
        let window_end = d.window_start + self.settings.retry_for.as_millis() as i64;
        Attempted {
            delivered: false,
            status,
            error,
            body,
            retry_at: (next <= window_end).then_some(next),
        }
    }

    /// Posts the delivery to the address the guard checked; the receiver's status and the
    /// start of its answer, or why there was none.
    async fn send(&self, hook: &Webhook, d: &DueDelivery) -> Result<(u16, String), String> {
        let url = reqwest::Url::parse(&hook.url).map_err(|e| format!("bad URL: {e}"))?;
        let guard = crate::tools::WebFetch::webhook_guard(self.settings.allow.clone());
        let addr = guard.check(&url).await.map_err(|e| e.to_string())?;
        self.failpoints.hit("before_webhook_send").await;
        let host = url.host_str().unwrap_or_default().to_owned();
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(self.settings.timeout)
            .resolve(&host, addr)
            .no_proxy()
            .build()
            .map_err(|e| e.to_string())?;
        let now = now_ms();
        let ts = now / 1000;
        let signature = hook
            .signing_secrets(now)
            .into_iter()
            .filter_map(|s| webhook::sign(s, &d.id, ts, &d.body))
            .collect::<Vec<_>>()
            .join(" ");
        let resp = client
            .post(url)
            .header("content-type", "application/json")
            .header(
                "user-agent",
                concat!("subagents/", env!("CARGO_PKG_VERSION")),
            )
            .header("webhook-id", &d.id)
            .header("webhook-timestamp", ts.to_string())
            .header("webhook-signature", signature)
            .body(d.body.clone())
            .send()
            .await
            .map_err(|e| {
                if e.is_timeout() {
                    format!(
                        "the receiver did not answer within {:?}",
                        self.settings.timeout
                    )
                } else {
                    format!("could not reach the receiver: {e}")
                }
            })?;
        let status = resp.status().as_u16();
        let text = tokio::time::timeout(Duration::from_secs(2), resp.text())
            .await
            .ok()
            .and_then(Result::ok)
            .unwrap_or_default();
        Ok((status, text.chars().take(BODY_EXCERPT).collect()))
    }
}
