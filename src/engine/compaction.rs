//! Keeping a run inside its model's context window.
//!
//! Before every model call the executor estimates the request ([`Window::estimate`]). When it
//! would pass `compact_at` (default 85 % of the window), or a new run starts on a thread whose
//! carried-over context already fills half of that, the run takes a **compaction step**: one
//! model call without tools summarises the oldest part of the context, and the summary commits
//! with the range of messages it stands for ([`crate::domain::Compaction`]). Nothing is deleted;
//! the context is rebuilt as system prompt, task, summary, kept tail. A committed compaction is
//! never redone: the rebuilt context starts after it. When the provider refuses a request as
//! too long anyway, the same step runs and the call is retried; three failed compactions in a
//! row fail the run with `kind=context`.
//!
//! What is kept verbatim: the system prompt, the run's task, the newest messages (default the
//! newest 10 % of the window, never a tool call without its result), and the ids of sub-agent
//! runs still running (listed under the summary from the store, not left to the model).

use std::collections::HashMap;
use std::sync::Arc;

use serde_json::json;

use super::attempt::Attempt;
use super::{Engine, Flow, context};
use crate::agents::AgentDef;
use crate::domain::event;
use crate::domain::{Compaction, CompactionBody, Event, RunRecord, StoredMessage};
use crate::ids::RunId;
use crate::model::compact::{self, Entry};
use crate::model::tokens::{Calibration, Counter, ModelTable};
use crate::model::{ChatRequest, Message, ToolSpec, Usage};
use crate::store::ThreadContext;

/// Context settings that do not vary per run.
#[derive(Clone, Debug)]
pub struct ContextSettings {
    /// Context windows by model.
    pub table: ModelTable,
    /// Percent of the window at which a run compacts.
    pub compact_at: u8,
    /// Percent of the window a compaction keeps verbatim.
    pub keep: u8,
    /// Tokens of one tool result the model sees (then it is offloaded to a file).
    pub tool_result_tokens: usize,
    /// Provider-reported vs estimated prompt tokens, per model, shared by the process.
    pub calibration: Arc<Calibration>,
}

impl Default for ContextSettings {
    fn default() -> Self {
        Self {
            table: ModelTable::default(),
            compact_at: 85,
            keep: 10,
            tool_result_tokens: 20_000,
            calibration: Arc::default(),
        }
    }
}

/// A run's context window and the thresholds in it, resolved once per claim.
#[derive(Clone, Debug)]
pub struct Window {
    /// The model the run calls.
    pub model: String,
    /// Its tokenizer.
    pub counter: Counter,
    /// Its window, in tokens.
    pub tokens: u64,
    /// Compact when an estimated request passes this many tokens.
    pub compact_at: u64,
    /// Tokens of newest messages a compaction keeps.
    pub keep: u64,
    /// Tokens of one tool result before it is offloaded.
    pub result_tokens: usize,
    compact_percent: u64,
    keep_percent: u64,
    calibration: Arc<Calibration>,
    memo: Arc<std::sync::Mutex<Memo>>,
}

/// Token counts already made in this run: per message (by content hash) and per tool list (by
/// length: a run offers all its tools or, forced, none).
#[derive(Debug, Default)]
struct Memo {
    messages: HashMap<u64, usize>,
    tools: HashMap<usize, usize>,
}

fn message_key(m: &Message) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    m.role().hash(&mut h);
    match m {
        Message::System { content } | Message::User { content } => content.hash(&mut h),
        Message::Assistant {
            content,
            tool_calls,
            ..
        } => {
            content.hash(&mut h);
            for c in tool_calls {
                (&c.id, &c.function.name, &c.function.arguments).hash(&mut h);
            }
        }
        Message::Tool {
            tool_call_id,
            content,
        } => (tool_call_id, content).hash(&mut h),
    }
    h.finish()
}

impl Window {
    /// The limits for `run` on `agent` calling `model`: the run's `compact_at`, then the
    /// agent's, then the process's; the agent's `context_window:`, then the model table.
    pub fn resolve(
        settings: &ContextSettings,
        agent: &AgentDef,
        run_compact_at: Option<u8>,
        model: &str,
    ) -> Window {
        let (known, _) = settings.table.window(model);
        let mut window = agent.context_window.unwrap_or(known.context);
        // A provider that refused a request as too long taught us a smaller window.
        if let Some(learned) = settings.calibration.learned_window(model) {
            window = window.min(learned);
        }
        let percent = run_compact_at
            .or(agent.compact_at)
            .unwrap_or(settings.compact_at)
            .clamp(10, 95) as u64;
        let mut b = Window {
            model: model.to_owned(),
            counter: Counter::for_model(model),
            tokens: 0,
            compact_at: 0,
            keep: 0,
            result_tokens: 0,
            compact_percent: percent,
            keep_percent: settings.keep.clamp(1, 50) as u64,
            calibration: settings.calibration.clone(),
            memo: Arc::default(),
        };
        b.set_window(window, settings.tool_result_tokens);
        b
    }

    fn set_window(&mut self, window: u64, tool_result_tokens: usize) {
        self.tokens = window;
        self.compact_at = window * self.compact_percent / 100;
        self.keep = window * self.keep_percent / 100;
        // A result may take a quarter of a small window at most.
        self.result_tokens = tool_result_tokens.clamp(256, (window / 4).max(256) as usize);
    }

    /// The provider's likely count of a request: ours, corrected by what it reported before.
    /// Returns (ours, corrected). Messages already counted in this run are looked up, not
    /// tokenized again: a long context costs a hash per message per step.
    pub fn estimate(&self, messages: &[Message], tools: &[ToolSpec]) -> (usize, usize) {
        let mut memo = self.memo.lock().unwrap();
        let mut raw = crate::model::tokens::REPLY_PRIMING;
        for m in messages {
            let key = message_key(m);
            raw += *memo
                .messages
                .entry(key)
                .or_insert_with(|| self.counter.message(m));
        }
        raw += *memo
            .tools
            .entry(tools.len())
            .or_insert_with(|| self.counter.tools(tools));
        (raw, self.calibration.scale(&self.model, raw))
    }

    /// Records the provider's count of a request we estimated at `raw`.
    pub fn observe(&self, raw: usize, reported: u64) {
        self.calibration.observe(&self.model, raw, reported);
    }

    /// The provider refused a request we estimated at `raw` as too long; `body` is its error,
    /// which often names the real window ("maximum context length is 8192 tokens"). The
    /// window shrinks to that (or to 90 % of the refused request) for this run and, remembered
    /// per model, for the runs after it.
    pub fn too_long(&mut self, raw: usize, body: &str) {
        let scaled = self.calibration.scale(&self.model, raw) as u64;
        let stated = stated_window(body).filter(|w| *w >= 256 && *w < self.tokens);
        let window = stated
            .unwrap_or(scaled * 9 / 10)
            .clamp(256, self.tokens.max(256));
        if window < self.tokens {
            tracing::warn!(model = %self.model, from = self.tokens, to = window, "the provider's window is smaller than configured; using it");
            self.calibration.learn_window(&self.model, window);
            let result_tokens = self.result_tokens;
            self.set_window(window, result_tokens);
        }
    }

    /// Bytes a paging tool shows per call, so its page stays under the result window.
    pub fn page_bytes(&self) -> usize {
        self.result_tokens.saturating_mul(3)
    }
}

/// The window a provider's context-length error states, if it does.
fn stated_window(body: &str) -> Option<u64> {
    let lower = body.to_ascii_lowercase();
    for marker in [
        "maximum context length is ",
        "context window is ",
        "context length is ",
        "maximum context length of ",
    ] {
        if let Some(i) = lower.find(marker) {
            let digits: String = lower[i + marker.len()..]
                .chars()
                .take_while(|c| c.is_ascii_digit() || *c == ',')
                .filter(|c| *c != ',')
                .collect();
            if let Ok(n) = digits.parse() {
                return Some(n);
            }
        }
    }
    None
}

/// A run's context as rebuilt from the store: the thread's latest compaction and the messages
/// after it, with the run's own task always present.
#[derive(Clone, Debug, Default)]
pub struct RunContext {
    /// The thread's latest compaction, if any.
    pub compaction: Option<Compaction>,
    /// Messages after it, in order (the task first when it was compacted away).
    pub history: Vec<StoredMessage>,
    /// The task was inside the compacted range and is put back before the summary.
    pub task_restored: bool,
}

impl RunContext {
    /// The request's messages: system prompt, task (when restored), summary, the rest.
    pub fn messages(&self, system: &str, run: RunId) -> Vec<Message> {
        let mut out = vec![Message::System {
            content: system.to_owned(),
        }];
        let mut rest = &self.history[..];
        if self.task_restored
            && let Some((task, tail)) = rest.split_first()
        {
            out.push(task.message.clone());
            rest = tail;
        }
        if let Some(c) = &self.compaction {
            out.push(compact::summary_message(
                &c.summary,
                c.first_message_id,
                c.last_message_id,
                &[],
            ));
        }
        out.extend(context(rest, run));
        out
    }
}

/// Which messages a compaction replaces: `history[..end]` minus the run's task.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Eviction {
    /// History index one past the last replaced message.
    pub end: usize,
    /// First replaced message id.
    pub first_id: i64,
    /// Last replaced message id.
    pub last_id: i64,
    /// Messages replaced.
    pub count: usize,
}

/// Chooses what to compact: the oldest whole groups (a user message, or an assistant message
/// with its tool results) that leave at least `keep` tokens of newest groups — and always the
/// newest group — and that fit `chunk` tokens for the summariser (at least one group). `None`
/// when nothing can go. `task_key` (the run's own task) is never replaced. Messages appended
/// locally (id `i64::MAX`) are not committed under a known id and are never replaced.
pub fn select(
    history: &[StoredMessage],
    task_key: &str,
    tokens: &dyn Fn(&StoredMessage) -> usize,
    keep: u64,
    chunk: u64,
) -> Option<Eviction> {
    // Group starts: every message that is not a tool result.
    let starts: Vec<usize> = history
        .iter()
        .enumerate()
        .filter(|(_, m)| !matches!(m.message, Message::Tool { .. }))
        .map(|(i, _)| i)
        .collect();
    if starts.len() < 2 {
        return None;
    }
    let group_end = |g: usize| starts.get(g + 1).copied().unwrap_or(history.len());
    let group_tokens = |g: usize| {
        history[starts[g]..group_end(g)]
            .iter()
            .filter(|m| m.key != task_key)
            .map(tokens)
            .sum::<usize>() as u64
    };
    // The kept tail: newest groups until `keep` is reached (at least one).
    let mut kept_from = starts.len() - 1;
    let mut kept = group_tokens(kept_from);
    while kept_from > 0 && kept < keep {
        kept_from -= 1;
        kept += group_tokens(kept_from);
    }
    // The tail that reached `keep` ends the candidates; its first group is kept too.
    let mut end_group = 0;
    let mut taken = 0u64;
    while end_group < kept_from {
        let t = group_tokens(end_group);
        if taken > 0 && taken + t > chunk {
            break;
        }
        taken += t;
        end_group += 1;
    }
    let end = starts.get(end_group).copied().unwrap_or(history.len());
    let replaced: Vec<&StoredMessage> = history[..end]
        .iter()
        .filter(|m| m.key != task_key)
        .collect();
    if replaced.is_empty() || replaced.iter().any(|m| m.id == i64::MAX) {
        return None;
    }
    Some(Eviction {
        end,
        first_id: replaced.iter().map(|m| m.id).min()?,
        last_id: replaced.iter().map(|m| m.id).max()?,
        count: replaced.len(),
    })
}

/// What to compact of `ctx` (see [`select`]), each message counted once. The task sits at
/// index 0 when restored; it is never part of a range.
fn choose(run: &RunRecord, window: &Window, ctx: &RunContext, chunk: u64) -> Option<Eviction> {
    let input_key = format!("{}:input", run.id);
    let counter = window.counter;
    let cache: HashMap<&str, usize> = ctx
        .history
        .iter()
        .map(|m| (m.key.as_str(), counter.message(&m.message)))
        .collect();
    let tokens = |m: &StoredMessage| cache.get(m.key.as_str()).copied().unwrap_or(0);
    select(
        &ctx.history,
        &input_key,
        &tokens,
        window.keep,
        chunk.max(256),
    )
}

/// The context as it is rebuilt once `body` commits: the summary, the task (restored when it
/// was in the range), and the messages after the range.
fn rebuilt(run: &RunRecord, ctx: &RunContext, ev: &Eviction, body: &CompactionBody) -> RunContext {
    let input_key = format!("{}:input", run.id);
    RunContext {
        compaction: Some(Compaction {
            id: 0,
            run_id: run.id,
            body: body.clone(),
            created_at: chrono::Utc::now(),
        }),
        history: ctx
            .history
            .iter()
            .enumerate()
            .filter(|(i, m)| *i >= ev.end || m.key == input_key)
            .map(|(_, m)| m.clone())
            .collect(),
        task_restored: ctx.history[..ev.end].iter().any(|m| m.key == input_key)
            || ctx.task_restored,
    }
}

pub use crate::domain::event::CompactionReason as Reason;

/// What a compaction step came to.
#[derive(Debug)]
pub enum Compacted {
    /// A summary is committed.
    Done,
    /// Nothing could be replaced (the context is all task and newest messages).
    Nothing,
    /// The summary could not be made (the summariser failed or answered nothing).
    Failed(String),
}

/// Words a summary may take, for a window.
fn summary_words(window: u64) -> usize {
    (window / 16).clamp(150, 1500) as usize
}

impl Engine {
    /// Reads the run's context: the thread's latest compaction and the messages after it.
    pub(super) async fn load_context(&self, run: &RunRecord) -> Flow<RunContext> {
        let read = self
            .store
            .context(&run.thread_id, self.context_limit())
            .await?;
        Ok(context_of(run, read))
    }

    /// How many of a thread's newest messages a run's context reads.
    pub(super) fn context_limit(&self) -> u32 {
        self.settings.context_messages.max(1)
    }
}

/// The run's context from what its thread holds ([`crate::store::Checkpoints::context`]),
/// with its task put back when the thread does not hold it.
pub(super) fn context_of(run: &RunRecord, (compaction, mut history): ThreadContext) -> RunContext {
    let input_key = format!("{}:input", run.id);
    let mut task_restored = false;
    // The task is missing when it is not committed yet (a fresh run) or when this run's own
    // compaction covered its position; a long thread's oldest messages may also fall
    // outside the bounded read. Then it is put back in front (the summary follows it).
    let compacted_by_me = compaction.as_ref().is_some_and(|c| c.run_id == run.id);
    if !history.iter().any(|m| m.key == input_key) && (run.step > 0 || compacted_by_me) {
        let input = StoredMessage {
            id: 0,
            run_id: run.id,
            step: 0,
            key: input_key,
            message: Message::User {
                content: run.input.clone(),
            },
        };
        history.insert(0, input);
        task_restored = compaction.is_some();
    }
    RunContext {
        compaction,
        history,
        task_restored,
    }
}

impl Engine {
    /// One compaction step: chooses the oldest part of the context, has the model summarise
    /// it, and commits the summary with the range it replaces. The caller reloads the context.
    pub(super) async fn compact(
        &self,
        a: &Attempt<'_>,
        tools: &[ToolSpec],
        reason: Reason,
        step: u32,
    ) -> Flow<Compacted> {
        let (run, window, ctx) = (a.run, &a.window, &a.ctx);
        // The summariser's input must fit the window with room for its answer; each failure
        // halves it.
        let summary_room = summary_words(window.tokens) as u64 * 2;
        let chunk =
            (window.tokens.saturating_sub(summary_room) * 6 / 10) >> a.pressure.failures.min(4);
        let Some(ev) = choose(run, window, ctx, chunk) else {
            return Ok(Compacted::Nothing);
        };
        let (tokens_before, range) = self.announce(a, &ev, tools, reason, step).await?;
        let t0 = std::time::Instant::now();
        let (summary, spent) = match self.summarise(a, &ev, chunk).await {
            Ok(done) => done,
            Err(why) => return Ok(Compacted::Failed(why)),
        };
        metrics::histogram!("subagents_compaction_seconds").record(t0.elapsed().as_secs_f64());
        let summary = summary + &self.children_going(run).await?;
        let mut body = CompactionBody {
            first_message_id: ev.first_id,
            last_message_id: ev.last_id,
            messages: ev.count as i64,
            summary,
            tokens_before: tokens_before as i64,
            tokens_after: 0,
            reason: reason.as_str().into(),
        };
        // The context as it will be rebuilt, to report the tokens after.
        let after = rebuilt(run, ctx, &ev, &body);
        let after_messages = after.messages(&a.agent.system_prompt, run.id);
        let (_, tokens_after) = window.estimate(&after_messages, tools);
        body.tokens_after = tokens_after as i64;
        // What a provider's prompt cache can still serve: the new context's prefix that is
        // unchanged (tools, system prompt, task); everything from the summary on is new.
        let before = ctx.messages(&a.agent.system_prompt, run.id);
        let same = before
            .iter()
            .zip(&after_messages)
            .take_while(|(x, y)| x == y)
            .count();
        let (_, cache_prefix_tokens) = window.estimate(&after_messages[..same], tools);
        let compacted = Event::ContextCompacted(event::Compacted {
            step,
            reason,
            tokens_before: tokens_before as u64,
            tokens_after: tokens_after as u64,
            range,
            cache_prefix_tokens: cache_prefix_tokens as u64,
            usage: spent.0,
            cost_usd: (spent.1 > 0).then(|| crate::model::prices::dollars(spent.1)),
        });
        let fp = &self.settings.failpoints;
        fp.hit("before_compaction_commit").await;
        self.store
            .commit_compaction(a.lease, body, spent, vec![compacted.into()])
            .await?;
        fp.hit("after_compaction_commit").await;
        metrics::counter!("subagents_compactions_total", "reason" => reason.as_str()).increment(1);
        let ms = t0.elapsed().as_millis() as u64;
        tracing::info!(tokens_before, tokens_after, ms, "context compacted");
        Ok(Compacted::Done)
    }

    /// Tells what a compaction is about to replace: the PreCompact hooks, the log and the
    /// `context.compacting` event. Returns the tokens before and the range.
    async fn announce(
        &self,
        a: &Attempt<'_>,
        ev: &Eviction,
        tools: &[ToolSpec],
        reason: Reason,
        step: u32,
    ) -> Flow<(usize, event::Range)> {
        let trigger = if reason == Reason::Threshold {
            "auto"
        } else {
            reason.as_str()
        };
        let extra = json!({"trigger": trigger, "first_message_id": ev.first_id, "last_message_id": ev.last_id});
        let hook = crate::policy::HookEvent::PreCompact;
        self.lifecycle_hooks(a.run, &a.settings, &a.agent, hook, extra)
            .await;
        let messages_before = a.ctx.messages(&a.agent.system_prompt, a.run.id);
        let (_, tokens_before) = a.window.estimate(&messages_before, tools);
        let range = event::Range {
            first_message_id: ev.first_id,
            last_message_id: ev.last_id,
            messages: ev.count as i64,
        };
        tracing::info!(
            reason = reason.as_str(),
            tokens_before,
            first = ev.first_id,
            last = ev.last_id,
            messages = ev.count,
            "compacting the context"
        );
        let compacting = Event::ContextCompacting(event::Compacting {
            step,
            reason,
            tokens_before: tokens_before as u64,
            range: range.clone(),
        });
        let cp = crate::store::Checkpoint {
            events: vec![compacting.into()],
            ..Default::default()
        };
        self.store.checkpoint(a.lease, cp).await?;
        Ok((tokens_before, range))
    }

    /// Has the model summarise the chosen range (after any earlier summary); returns the
    /// summary and what it cost, or why there is none.
    async fn summarise(
        &self,
        a: &Attempt<'_>,
        ev: &Eviction,
        chunk: u64,
    ) -> Result<(String, (Usage, u64)), String> {
        let (run, window, ctx) = (a.run, &a.window, &a.ctx);
        let input_key = format!("{}:input", run.id);
        // The transcript: the earlier summary, then the range in order (the task marked).
        let mut entries = vec![];
        if let Some(c) = &ctx.compaction {
            entries.push(Entry::EarlierSummary(&c.summary));
        }
        for m in &ctx.history[..ev.end] {
            if m.key != input_key {
                entries.push(Entry::Message(&m.message));
            } else if !ctx.task_restored {
                entries.push(Entry::Task);
            }
        }
        let per_message = (chunk / 4).clamp(200, 4000) as usize;
        let transcript = compact::transcript(&entries, &window.counter, per_message);
        let req = ChatRequest {
            model: window.model.clone(),
            messages: vec![
                Message::System {
                    content: compact::prompt(summary_words(window.tokens)),
                },
                Message::User {
                    content: transcript,
                },
            ],
            tools: vec![],
            step_key: format!("{}:compact:{}-{}", run.id, ev.first_id, ev.last_id),
            response_format: None,
        };
        let r = match self.model.complete(&req, &|_| {}).await {
            Ok(r) => r,
            Err(e) => return Err(format!("the summary request failed: {e}")),
        };
        let prices = &self.settings.prices;
        let cost = prices.cost_nanos(&window.model, &r.usage).unwrap_or(0);
        match r.content.map(|c| c.trim().to_owned()) {
            Some(s) if !s.is_empty() => Ok((s, (r.usage, cost))),
            _ => Err("the model answered the summary request with nothing".into()),
        }
    }

    /// The run's sub-agent runs still going, listed from the store under the summary, so no
    /// summary can lose them; empty when there are none.
    async fn children_going(&self, run: &RunRecord) -> Flow<String> {
        let pending: Vec<String> = self
            .store
            .children(run.id)
            .await?
            .into_iter()
            .filter(|c| !c.status.is_terminal())
            .map(|c| {
                let what: String = c
                    .input
                    .lines()
                    .next()
                    .unwrap_or("")
                    .chars()
                    .take(80)
                    .collect();
                let status = c.status.as_str();
                format!(
                    "run_id {} (agent {}, {status}): {}",
                    c.id,
                    c.agent,
                    what.trim()
                )
            })
            .collect();
        if pending.is_empty() {
            return Ok(String::new());
        }
        let Message::User { content } = compact::summary_message("", 0, 0, &pending) else {
            unreachable!("a summary message is a user message")
        };
        Ok(content
            .find("\n\nSub-agent runs")
            .map(|i| content[i..].to_owned())
            .unwrap_or_default())
    }

    /// A tool result as the model gets it: whole when it fits the result limit, otherwise
    /// written to `.results/<run>/<call>.txt` in the workspace, with its head and that path.
    pub(super) async fn fit_result(
        &self,
        window: &Window,
        workspace: &std::path::Path,
        run: RunId,
        call_id: &str,
        text: String,
    ) -> (String, bool) {
        // A token is at least one byte: short texts need no count.
        if text.len() <= window.result_tokens {
            return (text, false);
        }
        let tokens = window.counter.text(&text);
        if tokens <= window.result_tokens {
            return (text, false);
        }
        let head_tokens = (window.result_tokens / 4).clamp(64, 2000);
        let head_len = window.counter.head(&text, head_tokens).0.len();
        let rel = format!(".results/{run}/{call_id}.txt");
        match crate::tools::offload(
            workspace,
            rel,
            text.clone(),
            head_len,
            tokens,
            window.result_tokens,
        )
        .await
        {
            Ok(o) => {
                tracing::info!(tokens, path = %o.path, "tool result offloaded to the workspace");
                (o.notice, true)
            }
            Err(e) => {
                // Still a defined outcome: cut, and say why.
                tracing::warn!(error = %e, "could not offload a long tool result; cutting it");
                let mut cut = text[..head_len].to_owned();
                cut.push_str(&format!("\n[output truncated: {head_len} of {} bytes shown; the whole result could not be saved ({e})]", text.len()));
                (cut, true)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{FunctionCall, ToolCall};

    fn m(id: i64, run: RunId, key: &str, message: Message) -> StoredMessage {
        StoredMessage {
            id,
            run_id: run,
            step: 0,
            key: key.into(),
            message,
        }
    }

    fn call(id: &str) -> Message {
        Message::Assistant {
            content: None,
            tool_calls: vec![ToolCall {
                id: id.into(),
                kind: "function".into(),
                function: FunctionCall {
                    name: "echo".into(),
                    arguments: "{}".into(),
                },
            }],
            thinking: vec![],
        }
    }

    fn result(id: &str) -> Message {
        Message::Tool {
            tool_call_id: id.into(),
            content: "x".into(),
        }
    }

    /// task, then 5 steps of (call, result): ids 1..=11.
    fn history(run: RunId) -> Vec<StoredMessage> {
        let mut h = vec![m(
            1,
            run,
            "task",
            Message::User {
                content: "do it".into(),
            },
        )];
        for s in 0..5 {
            h.push(m(2 + 2 * s, run, &format!("a{s}"), call(&format!("c{s}"))));
            h.push(m(
                3 + 2 * s,
                run,
                &format!("r{s}"),
                result(&format!("c{s}")),
            ));
        }
        h
    }

    #[test]
    fn the_newest_groups_and_the_task_stay_and_pairs_stay_together() {
        let run = RunId::new();
        let h = history(run);
        // Every message weighs 10: keep 30 tokens = two groups of 20 (the second reaches it).
        let ev = select(&h, "task", &|_| 10, 30, 10_000).unwrap();
        // Replaced: steps 0..3 (ids 2..=7); kept: steps 3 and 4 (ids 8..=11).
        assert_eq!(
            ev,
            Eviction {
                end: 7,
                first_id: 2,
                last_id: 7,
                count: 6
            }
        );
        assert!(
            !matches!(h[ev.end].message, Message::Tool { .. }),
            "the tail starts at a group"
        );
    }

    #[test]
    fn the_chunk_bounds_what_one_summary_takes() {
        let run = RunId::new();
        let h = history(run);
        let ev = select(&h, "task", &|_| 10, 10, 45).unwrap();
        // The task group weighs 0 (the task never counts), then 20 + 20 fit 45.
        assert_eq!((ev.first_id, ev.last_id, ev.count), (2, 5, 4));
        // At least one group even when it alone is over the chunk.
        let ev = select(&h, "task", &|_| 10, 10, 1).unwrap();
        assert_eq!((ev.first_id, ev.last_id), (2, 3));
    }

    #[test]
    fn nothing_goes_when_everything_is_the_tail_or_uncommitted() {
        let run = RunId::new();
        let h = history(run);
        assert_eq!(select(&h, "task", &|_| 10, 1_000, 10_000), None);
        assert_eq!(select(&h[..1], "task", &|_| 10, 0, 10_000), None);
        let mut local = h.clone();
        local[1].id = i64::MAX;
        assert_eq!(select(&local, "task", &|_| 10, 10, 10_000), None);
    }

    #[test]
    fn estimates_are_the_counters_whether_memoised_or_not() {
        let b = Window::resolve(
            &ContextSettings::default(),
            &AgentDef::general_purpose(),
            None,
            "gpt-4o",
        );
        let run = RunId::new();
        let msgs: Vec<Message> = history(run).into_iter().map(|m| m.message).collect();
        let want = Counter::for_model("gpt-4o").request(&msgs, &[]);
        assert_eq!(b.estimate(&msgs, &[]).0, want);
        assert_eq!(
            b.estimate(&msgs, &[]).0,
            want,
            "the second time from the memo"
        );
        assert_eq!(
            b.estimate(&msgs[..3], &[]).0,
            Counter::for_model("gpt-4o").request(&msgs[..3], &[])
        );
    }

    #[test]
    fn a_refusal_teaches_the_real_window() {
        let settings = ContextSettings::default();
        let agent = AgentDef {
            context_window: Some(16_000),
            ..AgentDef::general_purpose()
        };
        let mut b = Window::resolve(&settings, &agent, None, "m");
        assert_eq!((b.tokens, b.compact_at, b.keep), (16_000, 13_600, 1_600));
        b.too_long(7_000, r#"{"error":{"message":"This model's maximum context length is 6,000 tokens. However, your messages resulted in 7000 tokens."}}"#);
        assert_eq!((b.tokens, b.compact_at), (6_000, 5_100));
        // Remembered for the next run on this model.
        assert_eq!(Window::resolve(&settings, &agent, None, "m").tokens, 6_000);
        let mut b = Window::resolve(&settings, &agent, None, "other");
        b.too_long(10_000, "prompt too long");
        assert_eq!(b.tokens, 9_000);
    }

    #[test]
    fn a_restored_task_comes_before_the_summary() {
        let run = RunId::new();
        let h = history(run);
        let body = CompactionBody {
            first_message_id: 2,
            last_message_id: 7,
            messages: 6,
            summary: "did steps 0-2".into(),
            tokens_before: 0,
            tokens_after: 0,
            reason: "threshold".into(),
        };
        let c = Compaction {
            id: 1,
            run_id: run,
            body,
            created_at: chrono::Utc::now(),
        };
        let ctx = RunContext {
            compaction: Some(c),
            history: [&h[..1], &h[7..]].concat(),
            task_restored: true,
        };
        let msgs = ctx.messages("sys", run);
        assert!(matches!(&msgs[0], Message::System { .. }));
        assert!(matches!(&msgs[1], Message::User { content } if content == "do it"));
        assert!(
            matches!(&msgs[2], Message::User { content } if compact::is_summary(content) && content.contains("did steps 0-2"))
        );
        assert_eq!(msgs.len(), 3 + 4);
    }
}
