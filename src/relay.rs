//! Events to Redis Streams, and wake-ups across processes.
//!
//! The outbox (`sa_events`) is the truth; this relay copies it to Redis in order: each durable
//! event `N` of a run becomes entry `N-0` of the run's stream `subagents:run:<id>` and an entry
//! of the global stream `subagents:events` (trimmed with `MAXLEN ~`). A Lua script makes each
//! publish atomic and idempotent: an event already in the run's stream is skipped, so any
//! number of relays (one per process) may race and re-publishing never duplicates. A run's
//! stream expires a retention period after its terminal event.
//!
//! Redis down: runs go on, events wait in the outbox, and the relay catches up when Redis
//! returns. Readers ([`RedisEvents::events_after`]) check that what Redis returns continues the
//! caller's cursor without a gap, and read the outbox otherwise, so a trimmed or lost range
//! never hides a durable event.
//!
//! The outbox is read back only where it must be: a start, a claim and a step's checkpoint hand
//! the events they committed, with their seqs, to this process's relay
//! ([`crate::notify::Notifier::committed`]), which publishes them from memory and marks them
//! relayed in batches (`Relay`). The outbox is read when a commit wrote events it did not hand
//! over, when Redis refused a handed event (an earlier one of its run is not there yet), and
//! every 100 ms as the net for events whose process died before relaying them.
//!
//! After relaying a run's events the relay publishes `change:<run>` on `subagents:wake`
//! (`step:<run>` when none of them ends the run); every process subscribes and wakes its local
//! waiters, so a waiter hears of a run that ended in another process in milliseconds, and a
//! wait for a run's end does not read the run again for each of its steps. Cancel requests
//! travel the same way (`cancel:<run>`).

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use redis::AsyncCommands;
use tokio_util::sync::CancellationToken;

use crate::events::is_terminal;
use crate::ids::RunId;
use crate::store::{EventRecord, Store, StoreError, Wake};

/// Prefix of every key.
pub const PREFIX: &str = "subagents";
const WAKE_CHANNEL: &str = "subagents:wake";

/// Outbox rows one relay pass reads at most.
const RELAY_BATCH: u32 = 500;

const PUBLISH: &str = r#"
local last = 0
local top = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if #top > 0 then last = tonumber(string.match(top[1][1], '^(%d+)')) end
local seq = tonumber(ARGV[1])
if seq <= last then return 0 end
if seq > last + 1 and ARGV[4] ~= '1' then return -1 end
redis.call('XADD', KEYS[1], ARGV[1] .. '-0', 'event', ARGV[2])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'event', ARGV[2])
if ARGV[5] == '1' then redis.call('EXPIRE', KEYS[1], ARGV[6]) end
return 1
"#;

const DELTA: &str = r#"
local top = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if #top == 0 then return 0 end
local ms, sq = string.match(top[1][1], '^(%d+)-(%d+)$')
if tonumber(ms) ~= tonumber(ARGV[1]) or tonumber(sq) >= tonumber(ARGV[2]) then return 0 end
redis.call('XADD', KEYS[1], ARGV[1] .. '-' .. ARGV[2], 'delta', ARGV[3])
return 1
"#;

/// One model call's deltas on their way to Redis.
pub struct DeltaStream {
    tx: tokio::sync::mpsc::UnboundedSender<String>,
    task: tokio::task::JoinHandle<()>,
}

impl DeltaStream {
    /// Queues a delta (never blocks the model stream).
    pub fn send(&self, text: &str) {
        let _ = self.tx.send(text.to_owned());
    }

    /// Waits (briefly) until the queued deltas are in Redis, so they precede the durable
    /// event that ends the call.
    pub async fn finish(self) {
        drop(self.tx);
        let _ = tokio::time::timeout(Duration::from_secs(1), self.task).await;
    }
}

/// Redis settings.
#[derive(Clone, Debug)]
pub struct RedisSettings {
    /// `redis://…`
    pub url: String,
    /// Approximate length of the global stream.
    pub global_maxlen: u64,
    /// How long a finished run's stream is kept.
    pub retention: Duration,
}

/// A connection to Redis for events and wake-ups.
#[derive(Clone)]
pub struct RedisEvents {
    client: redis::Client,
    conn: redis::aio::ConnectionManager,
    settings: RedisSettings,
    script: Arc<redis::Script>,
    delta: Arc<redis::Script>,
    /// Events this connection's relay published: from memory, from the outbox.
    published: Arc<[std::sync::atomic::AtomicU64; 2]>,
}

/// Redis failures.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// Redis refused or is unreachable.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The wake-ups a relay pass publishes: one per run (per stretch of its events in the batch),
/// saying whether any of them ends the run (a waiter for its end reads again only then).
fn wake_ups(batch: &[EventRecord]) -> Vec<(RunId, bool)> {
    let mut out: Vec<(RunId, bool)> = vec![];
    for e in batch {
        let ends = is_terminal(&e.kind);
        match out.last_mut() {
            Some((run, any)) if *run == e.run_id => *any |= ends,
            _ => out.push((e.run_id, ends)),
        }
    }
    out
}

/// What one publication did: how many events went through, the `(run, first, last)` ranges
/// they form (for [`Outbox::mark_relayed`](crate::store::Outbox::mark_relayed)), and whether
/// an event was refused because an earlier one of its run is not in Redis yet.
#[derive(Debug, Default)]
struct Published {
    ranges: Vec<(RunId, u64, u64)>,
    refused: bool,
}

impl Published {
    /// Events that went through (the ranges hold each once).
    fn relayed(&self) -> usize {
        self.ranges
            .iter()
            .map(|(_, f, l)| (l - f + 1) as usize)
            .sum()
    }
}

/// How often the relay reads the outbox even when nothing asked it to (events committed by a
/// process that died before relaying them), and marks what it published from memory.
const SWEEP: Duration = Duration::from_millis(100);

/// Most published ranges whose marks wait for the next sweep.
const MARKS_PENDING: usize = 256;

/// The relay loop's state. Its common path publishes the events this process's commits hand
/// it ([`crate::notify::Notifier::committed`]) straight from memory, one Redis pipeline per
/// pass and no statement; the outbox is read only when a commit wrote events it did not hand
/// over (a run's end that wrote its parent's events, an approval, a parent's note of a child…),
/// when a handed event was refused (its run's earlier events are not in Redis), and on the
/// sweep. Marks for what went out from memory wait for the sweep (or [`MARKS_PENDING`]) and go
/// in one statement: until then the rows stay unrelayed, which only means a relay that reads
/// them publishes them again, and publishing is idempotent.
struct Relay {
    redis: RedisEvents,
    /// Published, not yet marked.
    marks: Vec<(RunId, u64, u64)>,
    /// When the outbox is read next regardless.
    sweep_at: tokio::time::Instant,
    /// Read the outbox at the next pass (a refusal, or a failure to retry).
    read_outbox: bool,
    backoff: Duration,
}

impl Relay {
    fn new(redis: RedisEvents) -> Self {
        Relay {
            redis,
            marks: vec![],
            sweep_at: tokio::time::Instant::now(),
            read_outbox: true,
            backoff: SWEEP,
        }
    }

    /// One pass; `true` when another should follow at once (a full batch, or a refusal: the
    /// outbox is to be read again, `read_outbox`).
    async fn pass(&mut self, store: &dyn Store) -> bool {
        let handed = store.take_handed();
        let sweep =
            handed.unhanded || self.read_outbox || tokio::time::Instant::now() >= self.sweep_at;
        let result = if sweep {
            // The handed events are in the outbox too (committed before they were handed):
            // the outbox pass publishes them in order with everything else.
            self.read_outbox = false;
            self.sweep(store).await
        } else if handed.events.is_empty() {
            Ok(())
        } else {
            self.publish_handed(store, &handed.events).await
        };
        match result {
            Ok(()) => {
                self.backoff = SWEEP;
                self.read_outbox
            }
            Err(e) => {
                tracing::warn!(error = %e, backoff = ?self.backoff, "relay to Redis failed; events wait in the outbox");
                // What was handed is in the outbox: the retry reads it there.
                self.read_outbox = true;
                self.sweep_at = tokio::time::Instant::now() + self.backoff;
                self.backoff = (self.backoff * 2).min(Duration::from_secs(5));
                false
            }
        }
    }

    /// Marks what went out from memory, then one outbox pass.
    async fn sweep(&mut self, store: &dyn Store) -> Result<(), RelayError> {
        self.sweep_at = tokio::time::Instant::now() + SWEEP;
        self.mark(store).await?;
        let (read, relayed) = self.redis.relay_once(store).await?;
        // A full batch may have left more behind: the next pass reads on.
        self.read_outbox = read == RELAY_BATCH as usize && relayed > 0;
        Ok(())
    }

    /// Publishes handed events. One refused makes the next pass, at once, read the outbox,
    /// which publishes it after the events it waits for.
    async fn publish_handed(
        &mut self,
        store: &dyn Store,
        events: &[EventRecord],
    ) -> Result<(), RelayError> {
        let published = self.redis.publish(events, false).await?;
        self.read_outbox = published.refused;
        self.marks.extend(published.ranges);
        if self.marks.len() >= MARKS_PENDING {
            self.mark(store).await?;
        }
        Ok(())
    }

    /// Marks the pending ranges relayed, in one statement.
    async fn mark(&mut self, store: &dyn Store) -> Result<(), RelayError> {
        if self.marks.is_empty() {
            return Ok(());
        }
        let ranges = merged(std::mem::take(&mut self.marks));
        if let Err(e) = store.mark_relayed(&ranges).await {
            self.marks = ranges;
            return Err(e.into());
        }
        Ok(())
    }

    /// At shutdown: what was published goes marked (best effort; unmarked rows are only
    /// published again).
    async fn flush_marks(&mut self, store: &dyn Store) {
        if let Err(e) = self.mark(store).await {
            tracing::debug!(error = %e, "marking relayed events at shutdown failed; they will be published again");
        }
    }
}

/// `ranges` with each run's adjacent ranges joined (fewer rows for the marking statement).
fn merged(mut ranges: Vec<(RunId, u64, u64)>) -> Vec<(RunId, u64, u64)> {
    ranges.sort_unstable();
    let mut out: Vec<(RunId, u64, u64)> = Vec::with_capacity(ranges.len());
    for (run, first, last) in ranges {
        match out.last_mut() {
            Some((r, _, l)) if *r == run && first <= *l + 1 => *l = (*l).max(last),
            _ => out.push((run, first, last)),
        }
    }
    out
}

/// The stream key of a run.
pub fn run_stream(run: RunId) -> String {
    format!("{PREFIX}:run:{run}")
}

/// The global stream.
pub fn global_stream() -> String {
    format!("{PREFIX}:events")
}

impl RedisEvents {
    /// Connects; fails at once (with the reason) if Redis is unreachable, so a wrong URL is a
    /// clear start-up error.
    pub async fn connect(settings: RedisSettings) -> Result<RedisEvents, RelayError> {
        let client = redis::Client::open(settings.url.as_str())?;
        // A plain connection first: a refused connection fails at once with its cause (the
        // managed connection below would keep retrying).
        let mut probe = tokio::time::timeout(
            Duration::from_secs(5),
            client.get_multiplexed_async_connection(),
        )
        .await
        .map_err(|_| redis::RedisError::from((redis::ErrorKind::Io, "connect timed out")))??;
        redis::cmd("PING").query_async::<String>(&mut probe).await?;
        let conn = tokio::time::timeout(Duration::from_secs(5), client.get_connection_manager())
            .await
            .map_err(|_| redis::RedisError::from((redis::ErrorKind::Io, "connect timed out")))??;
        Ok(RedisEvents {
            client,
            conn,
            settings,
            script: Arc::new(redis::Script::new(PUBLISH)),
            delta: Arc::new(redis::Script::new(DELTA)),
            published: Default::default(),
        })
    }

    /// How many events this relay published to Redis: handed from memory by this process's
    /// commits, and read from the outbox (also on `/metrics` as
    /// `subagents_relay_events_total{source="memory"|"outbox"}`).
    pub fn published(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (
            self.published[0].load(Relaxed),
            self.published[1].load(Relaxed),
        )
    }

    /// Whether Redis answers now (for `/readyz`).
    pub async fn ping(&self) -> bool {
        let mut c = self.conn.clone();
        tokio::time::timeout(
            Duration::from_secs(1),
            redis::cmd("PING").query_async::<String>(&mut c),
        )
        .await
        .is_ok_and(|r| r.is_ok())
    }

    /// Adds the publication of one event to `pipe`; `allow_gap` when every earlier event of the
    /// run is known relayed (Redis may have lost them). The script answers 1 (published), 0
    /// (already there) or -1 (an earlier event must go first).
    fn publish_into(&self, pipe: &mut redis::Pipeline, e: &EventRecord, allow_gap: bool) {
        let payload = serde_json::to_string(e).expect("event serializes");
        pipe.invoke_script(
            self.script
                .key(run_stream(e.run_id))
                .key(global_stream())
                .arg(e.seq)
                .arg(payload)
                .arg(self.settings.global_maxlen)
                .arg(if allow_gap { "1" } else { "0" })
                .arg(if is_terminal(&e.kind) { "1" } else { "0" })
                .arg(self.settings.retention.as_secs().max(1)),
        );
    }

    /// Moves unrelayed outbox rows to Redis, in order; returns how many were read and how
    /// many of them were marked relayed.
    ///
    /// One pass is three round trips whatever its size: the batch read from the outbox, one
    /// Redis pipeline (see [`RedisEvents::publish`]), and one statement marking what went
    /// through.
    pub async fn relay_once(&self, store: &dyn Store) -> Result<(usize, usize), RelayError> {
        let batch = store.unrelayed(RELAY_BATCH).await?;
        if batch.is_empty() {
            return Ok((0, 0));
        }
        let published = self.publish(&batch, true).await?;
        store.mark_relayed(&published.ranges).await?;
        Ok((batch.len(), published.relayed()))
    }

    /// Publishes `batch` (each run's events in seq order) in one Redis pipeline: the script
    /// loaded first, so a restarted Redis needs no retry, then each event's publication, run by
    /// run in order, then a wake-up per run. `from_outbox`: the batch is the outbox's oldest
    /// unrelayed rows, so the first event of a run in it may follow a gap (trimmed or lost
    /// entries): everything before it was relayed. Events handed from memory make no such
    /// claim, and one that does not follow its run's stream is refused.
    async fn publish(
        &self,
        batch: &[EventRecord],
        from_outbox: bool,
    ) -> Result<Published, RelayError> {
        let mut pipe = redis::pipe();
        pipe.load_script(&self.script).ignore();
        let mut previous = None;
        for e in batch {
            self.publish_into(&mut pipe, e, from_outbox && previous != Some(e.run_id));
            previous = Some(e.run_id);
        }
        // Then the wake-ups, in the same pipeline: a process waiting on one of these runs reads
        // it from the database, where it is already committed, so it need not wait for the
        // outbox to be marked. (A run whose event was refused is woken for nothing: harmless.)
        for (run, ends) in wake_ups(batch) {
            let kind = if ends { "change" } else { "step" };
            pipe.publish(WAKE_CHANNEL, format!("{kind}:{run}")).ignore();
        }
        let mut c = self.conn.clone();
        let answers: Vec<i64> = pipe.query_async(&mut c).await?;
        // What went through, per run: from its first event in the batch up to the one before
        // the first refused (Redis runs the scripts in order, so every later one of that run
        // was refused too).
        let mut out = Published::default();
        let mut blocked: Option<RunId> = None;
        for (e, answer) in batch.iter().zip(answers) {
            if blocked == Some(e.run_id) {
                continue;
            }
            if answer < 0 {
                blocked = Some(e.run_id);
                out.refused = true;
                continue;
            }
            match out.ranges.last_mut() {
                Some((run, _, last)) if *run == e.run_id && *last + 1 == e.seq => *last = e.seq,
                _ => out.ranges.push((e.run_id, e.seq, e.seq)),
            }
        }
        let (slot, source) = if from_outbox {
            (1, "outbox")
        } else {
            (0, "memory")
        };
        let relayed = out.relayed() as u64;
        self.published[slot].fetch_add(relayed, std::sync::atomic::Ordering::Relaxed);
        metrics::counter!("subagents_relay_events_total", "source" => source).increment(relayed);
        Ok(out)
    }

    /// A sink for one model call's token deltas: entries `N-1`, `N-2`, … of the run's stream,
    /// `N` being the run's latest durable event. Best effort and ephemeral: a delta is dropped
    /// when `N-0` is not in the stream yet (the relay has not caught up) or a later durable event
    /// already is, so deltas never block or reorder durable events.
    ///
    /// `N` comes from `after_seq`, which the sink awaits beside the model call rather than the
    /// call after it (a read of the run: on a short call its round trips were a fifth of the
    /// step); `None` (the read failed) drops the call's deltas.
    pub fn delta_sink(
        &self,
        run: RunId,
        after_seq: impl Future<Output = Option<u64>> + Send + 'static,
    ) -> DeltaStream {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
        let me = self.clone();
        let task = tokio::spawn(async move {
            let Some(after_seq) = after_seq.await else {
                tracing::debug!(%run, "token deltas not published: the run's latest event is unknown");
                return;
            };
            let mut k = 0u64;
            let mut c = me.conn.clone();
            while let Some(text) = rx.recv().await {
                k += 1;
                let r: Result<i64, _> = me
                    .delta
                    .key(run_stream(run))
                    .arg(after_seq)
                    .arg(k)
                    .arg(text)
                    .invoke_async(&mut c)
                    .await;
                if let Err(e) = r {
                    tracing::debug!(error = %e, "token delta not published");
                }
            }
        });
        DeltaStream { tx, task }
    }

    /// `run`'s token deltas from now on, as published by any process (each a `model.delta`
    /// event's data), until the stream is dropped. One connection of its own per reader: a
    /// blocking read on the shared connection would hold up every other command.
    pub async fn live_deltas(
        &self,
        run: RunId,
    ) -> Result<impl futures::Stream<Item = serde_json::Value> + Send + use<>, RelayError> {
        let mut conn = self.client.get_multiplexed_async_connection().await?;
        let key = run_stream(run);
        // Everything after the stream's newest entry now.
        let top: redis::streams::StreamRangeReply = conn.xrevrange_count(&key, "+", "-", 1).await?;
        let from = top
            .ids
            .first()
            .map(|e| e.id.clone())
            .unwrap_or_else(|| "0-0".into());
        let state = (
            conn,
            key,
            from,
            std::collections::VecDeque::<serde_json::Value>::new(),
        );
        Ok(futures::stream::unfold(
            state,
            |(mut conn, key, mut from, mut buf)| async move {
                loop {
                    if let Some(v) = buf.pop_front() {
                        return Some((v, (conn, key, from, buf)));
                    }
                    // Under the connection's 500 ms response timeout.
                    let opts = redis::streams::StreamReadOptions::default()
                        .block(250)
                        .count(500);
                    let reply: Result<Option<redis::streams::StreamReadReply>, _> =
                        conn.xread_options(&[&key], &[&from], &opts).await;
                    match reply {
                        Ok(reply) => {
                            for entry in reply.into_iter().flat_map(|r| r.keys).flat_map(|k| k.ids)
                            {
                                from = entry.id.clone();
                                if let Some(v) = entry
                                    .get::<String>("delta")
                                    .and_then(|d| serde_json::from_str(&d).ok())
                                {
                                    buf.push_back(v);
                                }
                            }
                        }
                        Err(e) => {
                            tracing::debug!(error = %e, "reading token deltas from Redis failed; retrying");
                            tokio::time::sleep(Duration::from_millis(500)).await;
                        }
                    }
                }
            },
        ))
    }

    /// A handle on the managed connection (cheap: it is shared).
    pub(crate) fn connection(&self) -> redis::aio::ConnectionManager {
        self.conn.clone()
    }

    /// Tells every process that a cancel was requested for `run`.
    ///
    /// Its receivers renew the run's lease at once, which is also how the worker holding it
    /// hears a message sent to it ([`crate::app::App::send_message`]).
    pub async fn announce_cancel(&self, run: RunId) {
        let mut c = self.conn.clone();
        let _: Result<i64, _> = c.publish(WAKE_CHANNEL, format!("cancel:{run}")).await;
    }

    /// Events of `run` after `after`, from Redis when it holds a gap-free continuation of the
    /// cursor, otherwise from the outbox.
    pub async fn events_after(
        &self,
        store: &dyn Store,
        run: RunId,
        after: u64,
        limit: u32,
    ) -> Result<Vec<EventRecord>, StoreError> {
        match self.read_redis(run, after, limit).await {
            Ok(Some(events)) => Ok(events),
            Ok(None) => store.events_after(run, after, limit).await,
            Err(e) => {
                tracing::debug!(error = %e, "reading events from Redis failed; using the outbox");
                store.events_after(run, after, limit).await
            }
        }
    }

    async fn read_redis(
        &self,
        run: RunId,
        after: u64,
        limit: u32,
    ) -> Result<Option<Vec<EventRecord>>, redis::RedisError> {
        let mut c = self.conn.clone();
        let reply: redis::streams::StreamRangeReply = c
            .xrange_count(
                run_stream(run),
                format!("{}-0", after + 1),
                "+",
                limit as usize,
            )
            .await?;
        let mut out = Vec::with_capacity(reply.ids.len());
        // Token deltas (`N-k`, k > 0) share the stream; durable readers skip them.
        for (i, entry) in reply
            .ids
            .iter()
            .filter(|e| e.id.ends_with("-0"))
            .enumerate()
        {
            let Some(payload) = entry.get::<String>("event") else {
                return Ok(None);
            };
            let Ok(e) = serde_json::from_str::<serde_json::Value>(&payload) else {
                return Ok(None);
            };
            let Some(seq) = e["seq"].as_u64() else {
                return Ok(None);
            };
            if seq != after + 1 + i as u64 {
                return Ok(None); // a gap: trimmed, lost or not yet relayed; the outbox decides
            }
            out.push(EventRecord {
                seq,
                kind: e["type"].as_str().unwrap_or_default().to_owned(),
                run_id: run,
                created_at: serde_json::from_value(e["created_at"].clone())
                    .unwrap_or_else(|_| chrono::Utc::now()),
                data: e["data"].clone(),
            });
        }
        // Nothing in Redis may mean "nothing new" or "not relayed yet": the outbox knows.
        if out.is_empty() {
            Ok(None)
        } else {
            Ok(Some(out))
        }
    }

    /// Runs the relay and the wake-up subscriber until `shutdown`. Redis being down only
    /// delays them: they retry with backoff.
    pub fn spawn(
        self,
        store: Arc<dyn Store>,
        shutdown: CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        let relay = {
            let (me, store, shutdown) = (self.clone(), store.clone(), shutdown.clone());
            async move {
                let any = store.subscribe_all();
                store.open_handoff();
                let mut relay = Relay::new(me);
                loop {
                    let changed = any.notified();
                    tokio::pin!(changed);
                    changed.as_mut().enable();
                    // Whatever was committed since this pass began wakes `changed`.
                    let again = relay.pass(store.as_ref()).await;
                    if again {
                        continue;
                    }
                    tokio::select! {
                        _ = shutdown.cancelled() => {
                            relay.flush_marks(store.as_ref()).await;
                            return;
                        }
                        _ = changed => {}
                        _ = tokio::time::sleep_until(relay.sweep_at) => {}
                    }
                }
            }
        };
        let subscriber = async move {
            loop {
                if shutdown.is_cancelled() {
                    return;
                }
                match self.client.get_async_pubsub().await {
                    Ok(mut ps) => {
                        if ps.subscribe(WAKE_CHANNEL).await.is_ok() {
                            let mut msgs = ps.on_message();
                            loop {
                                tokio::select! {
                                    _ = shutdown.cancelled() => return,
                                    m = msgs.next() => {
                                        let Some(m) = m else { break };
                                        let text: String = m.get_payload().unwrap_or_default();
                                        if let Some((kind, id)) = text.split_once(':')
                                            && let Ok(run) = id.parse::<RunId>() {
                                                store.wake_local(run, match kind {
                                                    "cancel" => Wake::Cancel,
                                                    "step" => Wake::Progress,
                                                    _ => Wake::Change,
                                                });
                                            }
                                    }
                                }
                            }
                        }
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "wake-up subscriber cannot reach Redis; retrying")
                    }
                }
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
        };
        tokio::spawn(async move {
            tokio::join!(relay, subscriber);
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pass_wakes_each_run_once_and_says_whether_it_ended() {
        let (a, b) = (RunId::default(), RunId::default());
        let e = |run: RunId, seq: u64, kind: &str| EventRecord {
            seq,
            kind: kind.into(),
            run_id: run,
            created_at: chrono::Utc::now(),
            data: serde_json::json!({}),
        };
        let batch = [
            e(a, 1, "step.started"),
            e(a, 2, "model.completed"),
            e(b, 7, "tool.completed"),
            e(b, 8, "run.succeeded"),
        ];
        assert_eq!(wake_ups(&batch), vec![(a, false), (b, true)]);
        assert_eq!(wake_ups(&[]), vec![]);
    }

    #[test]
    fn pending_marks_join_per_run_without_covering_a_gap() {
        let (a, b) = (RunId::new(), RunId::new());
        let (lo, hi) = if a < b { (a, b) } else { (b, a) };
        let joined = merged(vec![
            (hi, 4, 4),
            (lo, 1, 2),
            (hi, 1, 3),
            (lo, 3, 3),
            (lo, 6, 7),
        ]);
        assert_eq!(joined, vec![(lo, 1, 3), (lo, 6, 7), (hi, 1, 4)]);
        assert_eq!(merged(vec![]), vec![]);
    }
}
