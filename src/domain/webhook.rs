//! Webhooks, as stored and as sent: an owner's subscriptions, their deliveries, and the
//! Standard Webhooks signature (`webhook-id`, `webhook-timestamp`, `webhook-signature:
//! v1,<base64 HMAC-SHA256 of "id.timestamp.body">`, the key being the secret's base64 after
//! `whsec_`).

use std::time::Duration;

use base64::Engine as _;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::ids::{OwnerId, RunId};

/// The event types a subscription can name (besides `*`): a run's start and end, and a call
/// waiting for a person and its answer. The database trigger that queues them lists the same.
pub const EVENT_TYPES: &[&str] = &[
    "run.started",
    "run.succeeded",
    "run.failed",
    "run.cancelled",
    "approval.requested",
    "approval.resolved",
];

/// How long the secret before a rotation stays valid (both sign meanwhile).
pub const ROTATION_GRACE: Duration = Duration::from_secs(24 * 3600);

/// The longest wait between two attempts of one delivery.
pub const MAX_BACKOFF: Duration = Duration::from_secs(3600);

/// A subscription.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Webhook {
    /// `wh_…`.
    pub id: String,
    /// Whose runs it hears.
    pub owner: OwnerId,
    /// Where deliveries go.
    pub url: String,
    /// Event types, or `["*"]`.
    pub events: Vec<String>,
    /// Only runs of these agents (`None`: every agent).
    pub agents: Option<Vec<String>>,
    /// The owner's note.
    pub description: String,
    /// The signing secret (`whsec_…`).
    pub secret: String,
    /// The secret before the last rotation and until when (ms since the epoch) it still signs.
    pub old_secret: Option<(String, i64)>,
    /// Why deliveries to it stopped (`None`: they go).
    pub paused_reason: Option<String>,
    /// The one run it hears, for a run's own webhook (`webhook` on `POST /v1/runs`); `None`:
    /// every run of its owner.
    pub run_id: Option<RunId>,
    /// Created.
    pub created_at: DateTime<Utc>,
    /// Last changed.
    pub updated_at: DateTime<Utc>,
}

impl Webhook {
    /// Whether `e` goes to it: the owner's runs (or its one run), the types, the agents.
    pub fn hears(&self, e: &QueuedEvent) -> bool {
        let whose = match self.run_id {
            Some(run) => run == e.run_id,
            None => self.owner == e.owner,
        };
        whose && self.wants(&e.kind, &e.agent)
    }

    /// Whether an event of `kind` of a run of `agent` goes to it.
    pub fn wants(&self, kind: &str, agent: &str) -> bool {
        self.events.iter().any(|e| e == "*" || e == kind)
            && self
                .agents
                .as_ref()
                .is_none_or(|list| list.iter().any(|a| a == agent))
    }

    /// The secrets that sign a delivery at `now_ms`: the current one, and the one before a
    /// rotation while its grace lasts.
    pub fn signing_secrets(&self, now_ms: i64) -> Vec<&str> {
        let mut out = vec![self.secret.as_str()];
        if let Some((old, until)) = &self.old_secret
            && *until > now_ms
        {
            out.push(old.as_str());
        }
        out
    }
}

/// What a change to a subscription sets (`None`: left as it is).
#[derive(Clone, Debug, Default)]
pub struct WebhookPatch {
    /// New destination.
    pub url: Option<String>,
    /// New event types.
    pub events: Option<Vec<String>>,
    /// New agent filter (`Some(None)`: every agent).
    pub agents: Option<Option<Vec<String>>>,
    /// New note.
    pub description: Option<String>,
    /// Pause (`true`, with its reason) or resume (`false`: it also forgets past failures).
    pub paused: Option<bool>,
}

/// Where a delivery stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum DeliveryStatus {
    /// Not attempted yet.
    Pending,
    /// The receiver answered 2xx.
    Delivered,
    /// The last attempt failed; another is due at `next_attempt_at`.
    Failed,
    /// Retries ran out; `last_status`/`last_error` say what the receiver last did.
    Dead,
}

stored_names!(DeliveryStatus {
    Pending => "pending",
    Delivered => "delivered",
    Failed => "failed",
    Dead => "dead",
});

/// One event for one subscription, with its attempts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Delivery {
    /// `msg_…`: the `webhook-id` of every attempt.
    pub id: String,
    /// The subscription.
    #[serde(skip)]
    pub webhook_id: String,
    /// The event's type.
    pub event_type: String,
    /// The run it is about.
    #[schema(value_type = Option<String>)]
    pub run_id: Option<RunId>,
    /// Where it stands.
    pub status: DeliveryStatus,
    /// Attempts made.
    pub attempts: u32,
    /// The receiver's last HTTP status.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_status: Option<u16>,
    /// Why the last attempt failed, when it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// The start of the receiver's last answer (at most 500 characters).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_body: Option<String>,
    /// When the next attempt is due (pending and failed only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_attempt_at: Option<DateTime<Utc>>,
    /// Created.
    pub created_at: DateTime<Utc>,
}

/// A delivery to make, as the dispatcher creates it from a queued event.
#[derive(Clone, Debug)]
pub struct NewDelivery {
    /// [`delivery_id`].
    pub id: String,
    /// The subscription.
    pub webhook_id: String,
    /// The event's type.
    pub event_type: String,
    /// The run.
    pub run_id: RunId,
    /// The body every attempt sends.
    pub body: String,
}

/// A delivery claimed for an attempt.
#[derive(Clone, Debug)]
pub struct DueDelivery {
    /// Its id.
    pub id: String,
    /// The subscription.
    pub webhook_id: String,
    /// The body.
    pub body: String,
    /// Attempts so far, this one included.
    pub attempts: u32,
    /// Retries stop `retry_for` after this (ms since the epoch).
    pub window_start: i64,
}

/// How an attempt went.
#[derive(Clone, Debug)]
pub struct Attempted {
    /// The receiver answered 2xx.
    pub delivered: bool,
    /// Its HTTP status, when it answered.
    pub status: Option<u16>,
    /// Why it failed, when it did.
    pub error: Option<String>,
    /// The start of its answer.
    pub body: Option<String>,
    /// When to try again (ms since the epoch); `None` after a failure: the delivery is dead.
    pub retry_at: Option<i64>,
}

/// A queued event the dispatcher turns into deliveries.
#[derive(Clone, Debug)]
pub struct QueuedEvent {
    /// The run.
    pub run_id: RunId,
    /// The event's seq.
    pub seq: u64,
    /// Its type.
    pub kind: String,
    /// Its data.
    pub data: serde_json::Value,
    /// The run's owner.
    pub owner: OwnerId,
    /// The run's agent.
    pub agent: String,
}

/// A new subscription's id.
pub fn new_webhook_id() -> String {
    format!("wh_{}", uuid::Uuid::now_v7().simple())
}

/// A new signing secret: `whsec_` and 32 random bytes in base64.
pub fn new_secret() -> String {
    let bytes: [u8; 32] = rand::random();
    format!(
        "whsec_{}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    )
}

/// The id of the delivery of event `seq` of `run` to `webhook`: the same however often the
/// event is turned into deliveries (after a crash), so a delivery is created once.
pub fn delivery_id(webhook: &str, run: RunId, seq: u64) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(format!("{webhook}\0{run}\0{seq}").as_bytes());
    let hex: String = digest[..12].iter().map(|b| format!("{b:02x}")).collect();
    format!("msg_{hex}")
}

/// The `webhook-signature` value for one secret: `v1,<base64 HMAC-SHA256>` of
/// `id.timestamp.body`. `None` for a secret that is not `whsec_` + base64.
pub fn sign(secret: &str, id: &str, timestamp: i64, body: &str) -> Option<String> {
    use hmac::{KeyInit, Mac};
    let key = base64::engine::general_purpose::STANDARD
        .decode(secret.strip_prefix("whsec_")?)
        .ok()?;
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(&key).ok()?;
    mac.update(format!("{id}.{timestamp}.{body}").as_bytes());
    Some(format!(
        "v1,{}",
        base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes())
    ))
}

/// The wait after attempt `attempts` (1 for the first) failed: `first` doubled per attempt,
/// at most [`MAX_BACKOFF`].
pub fn backoff(attempts: u32, first: Duration) -> Duration {
    let factor = 2u32.saturating_pow(attempts.saturating_sub(1).min(20));
    first.saturating_mul(factor).min(MAX_BACKOFF)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signature_is_the_standard_webhooks_one() {
        // The example of the Standard Webhooks specification's test vectors.
        let sig = sign(
            "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1614265330,
            r#"{"test": 2432232314}"#,
        );
        assert_eq!(
            sig.as_deref(),
            Some("v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=")
        );
        assert_eq!(sign("nope", "a", 1, "b"), None);
    }

    #[test]
    fn backoff_doubles_up_to_an_hour() {
        let first = Duration::from_secs(5);
        assert_eq!(backoff(1, first), first);
        assert_eq!(backoff(3, first), Duration::from_secs(20));
        assert_eq!(backoff(40, first), MAX_BACKOFF);
    }

    #[test]
    fn delivery_ids_are_stable_and_distinct() {
        let run = RunId::new();
        assert_eq!(delivery_id("wh_a", run, 3), delivery_id("wh_a", run, 3));
        assert_ne!(delivery_id("wh_a", run, 3), delivery_id("wh_b", run, 3));
        assert_ne!(delivery_id("wh_a", run, 3), delivery_id("wh_a", run, 4));
        assert!(new_secret().starts_with("whsec_"));
    }
}
