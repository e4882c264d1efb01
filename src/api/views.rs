//! What the API shows: views built from store records (rows and views are separate types, so
//! the schema can change without breaking clients).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use crate::agents::AgentDef;
use crate::domain::{RunError, RunRecord, StoredMessage};
use crate::events::progress_line;
use crate::ids::{RunId, ThreadId};
use crate::model::Message;
use crate::store::{EventRecord, RunStatus, Store};

/// Token and step counts.
#[derive(Serialize, Clone, Debug, ToSchema)]
pub struct UsageView {
    /// Tokens sent.
    pub prompt_tokens: u64,
    /// Tokens produced.
    pub completion_tokens: u64,
    /// Both.
    pub total_tokens: u64,
    /// Prompt tokens the provider's prompt cache served (part of `prompt_tokens`, billed at the
    /// cached rate).
    pub cache_read_tokens: u64,
    /// Prompt tokens written to the provider's prompt cache (Anthropic bills them at 1.25×).
    pub cache_write_tokens: u64,
    /// Model calls.
    pub steps: u32,
    /// What the model calls cost in US dollars, from the price table at the time of each call
    /// (`SUBAGENTS_PRICES`; a model without a price adds 0).
    pub cost_usd: f64,
}

/// One item of an agent's plan.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, ToSchema)]
pub struct TodoView {
    /// What is to be done.
    pub content: String,
    /// `pending`, `in_progress` or `completed`.
    pub status: String,
}

/// A run, as the API shows it (docs/http-api.md).
#[derive(Serialize, Clone, Debug, ToSchema)]
pub struct RunView {
    /// Id.
    pub id: RunId,
    /// Thread.
    pub thread_id: ThreadId,
    /// Agent.
    pub agent: String,
    /// The version of its agent's definition it runs (a hash of the file it started with; it
    /// keeps running that one when the file changes); `null` for runs from before versions.
    pub agent_version: Option<String>,
    /// What else it fixed at its first claim and keeps for good: `settings` (the settings
    /// file's version), `model`, `provider`, and `mcp:<server>` (the version of that server's
    /// tool list as the run saw it). Empty until it first runs.
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub pins: std::collections::BTreeMap<String, String>,
    /// State.
    pub status: RunStatus,
    /// Delegating run.
    pub parent_run_id: Option<RunId>,
    /// The failed or cancelled run this one retries.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_of: Option<RunId>,
    /// The schedule that started it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub schedule_id: Option<String>,
    /// The tick it was started for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scheduled_for: Option<DateTime<Utc>>,
    /// Model calls committed.
    pub step: u32,
    /// Times a worker claimed it (more than 1 after a crash, a drain or a park).
    pub attempts: u32,
    /// 1 (lowest) to 5: the order of its owner's queued runs.
    pub priority: u8,
    /// Created.
    pub created_at: DateTime<Utc>,
    /// First claimed.
    pub started_at: Option<DateTime<Utc>>,
    /// Ended.
    pub finished_at: Option<DateTime<Utc>>,
    /// Last lease renewal or checkpoint.
    pub last_heartbeat_at: Option<DateTime<Utc>>,
    /// Queued runs ahead of it, while queued.
    pub queue_position: Option<i64>,
    /// The start of the input (up to 500 characters; the whole input is the thread's first
    /// message of the run).
    pub input_preview: String,
    /// Final text.
    pub result: Option<String>,
    /// The final answer as JSON, when the run had an output schema (it was validated against
    /// it before the run succeeded).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub result_json: Option<Value>,
    /// Why it failed.
    pub error: Option<RunError>,
    /// True when a limit forced the final answer.
    pub forced: bool,
    /// Its own usage.
    pub usage: UsageView,
    /// Usage of it and all its descendants.
    pub usage_tree: UsageView,
    /// The last three progress lines.
    pub progress: Vec<String>,
    /// Child runs (delegation).
    pub children: Vec<RunId>,
    /// The agent's latest plan (`todo_write`), when it wrote one.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub todos: Vec<TodoView>,
    /// Tool calls this run waits on a person for (`POST /v1/approvals/{id}` answers them).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub approvals: Vec<crate::domain::Approval>,
    /// Caller data.
    #[schema(value_type = Object)]
    pub metadata: Value,
    /// Seq of the latest event (a cursor for `/events`).
    pub last_event_seq: u64,
    /// Only on wait answers: the wait ended before the run did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wait_timed_out: Option<bool>,
}

/// The tool whose latest call's arguments are a run's plan (its todos).
pub const PLAN_TOOL: &str = "todo_write";

impl RunView {
    /// Builds the view, reading the few extra facts it shows (progress, queue position).
    pub async fn build(store: &dyn Store, r: RunRecord) -> crate::store::Result<RunView> {
        Self::build_from(store, r, None, None).await
    }

    /// [`RunView::build`], given the run's latest events and its extras (what
    /// [`crate::store::Queries::view_extras`] answers for [`PLAN_TOOL`]) when the caller has
    /// just read them (a wait's snapshot does): a read fewer for each.
    pub async fn build_from(
        store: &dyn Store,
        r: RunRecord,
        latest: Option<&[crate::store::EventRecord]>,
        extras: Option<crate::store::ViewExtras>,
    ) -> crate::store::Result<RunView> {
        let recent = async {
            match latest {
                Some(events) => {
                    let from = r.event_seq.saturating_sub(12);
                    Ok(events.iter().filter(|e| e.seq > from).cloned().collect())
                }
                None => {
                    store
                        .events_after(r.id, r.event_seq.saturating_sub(12), 12)
                        .await
                }
            }
        };
        // The reads are independent: made at once, they cost one wait, not one each (a run's
        // end answers a thousand waits with the view built once; every extra round trip of
        // that build puts all of them behind whatever else the process has to do).
        let queue_position = async {
            match r.status {
                RunStatus::Queued => store.queue_position(r.id).await.map(Some),
                _ => Ok(None),
            }
        };
        // Its pins, schedule, plan and children in one read; the tree's totals only when it
        // has children.
        let tree = async {
            let extras = match extras {
                Some(extras) => extras,
                None => store.view_extras(r.id, PLAN_TOOL).await?,
            };
            let tree = if extras.children.is_empty() {
                crate::domain::TreeTotals {
                    usage: r.usage,
                    steps: u64::from(r.step),
                    cost_nanos: r.cost_nanos,
                }
            } else {
                store.tree_totals(r.id).await?
            };
            Ok((extras, tree))
        };
        // Only a parked run can be waiting for a person.
        let approvals = async {
            match r.status {
                RunStatus::Waiting => {
                    store
                        .list_approvals(
                            &r.owner,
                            Some(crate::domain::ApprovalStatus::Pending),
                            Some(r.id),
                            None,
                            50,
                        )
                        .await
                }
                _ => Ok(vec![]),
            }
        };
        let (recent, queue_position, (extras, tree), approvals) =
            futures::try_join!(recent, queue_position, tree, approvals)?;
        let crate::store::ViewExtras {
            pins,
            schedule: scheduled,
            // The plan as the agent last wrote it.
            last_call: plan,
            children,
        } = extras;
        let mut progress: Vec<String> = recent.iter().filter_map(progress_line).collect();
        let n = progress.len();
        progress.drain(..n.saturating_sub(3));
        let usage_tree = UsageView {
            prompt_tokens: tree.usage.prompt_tokens,
            completion_tokens: tree.usage.completion_tokens,
            total_tokens: tree.usage.total(),
            cache_read_tokens: tree.usage.cache_read_tokens,
            cache_write_tokens: tree.usage.cache_write_tokens,
            steps: tree.steps as u32,
            cost_usd: crate::model::prices::dollars(tree.cost_nanos),
        };
        let todos = match plan {
            Some(args) => serde_json::from_str::<Value>(&args)
                .ok()
                .and_then(|v| serde_json::from_value::<Vec<TodoView>>(v.get("todos")?.clone()).ok())
                .unwrap_or_default(),
            None => vec![],
        };
        let usage = UsageView {
            prompt_tokens: r.usage.prompt_tokens,
            completion_tokens: r.usage.completion_tokens,
            total_tokens: r.usage.total(),
            cache_read_tokens: r.usage.cache_read_tokens,
            cache_write_tokens: r.usage.cache_write_tokens,
            steps: r.step,
            cost_usd: crate::model::prices::dollars(r.cost_nanos),
        };
        Ok(RunView {
            id: r.id,
            // As its owner chose it (stored ids carry the owner's scope).
            thread_id: r.thread_id.visible_to(&r.owner),
            agent: r.agent.into(),
            agent_version: r.agent_version,
            pins,
            status: r.status,
            parent_run_id: r.parent_run_id,
            retry_of: r.retry_of,
            scheduled_for: scheduled
                .as_ref()
                .and_then(|(_, t)| DateTime::from_timestamp_millis(*t)),
            schedule_id: scheduled.map(|(s, _)| s),
            step: r.step,
            attempts: r.attempts,
            priority: r.priority,
            created_at: r.created_at,
            started_at: r.started_at,
            finished_at: r.finished_at,
            last_heartbeat_at: r.heartbeat_at,
            queue_position,
            input_preview: r.input.chars().take(500).collect(),
            result_json: crate::output::result_json(r.limits.output.as_ref(), r.result.as_deref()),
            result: r.result,
            error: r.error,
            forced: r.forced,
            usage_tree,
            usage,
            progress,
            children,
            todos,
            approvals,
            metadata: r.metadata,
            last_event_seq: r.event_seq,
            wait_timed_out: None,
        })
    }
}

/// An event: `{seq, type, run_id, created_at, data}`.
pub type EventView = EventRecord;

/// A page of events.
#[derive(Serialize, Debug, ToSchema)]
pub struct EventsPage {
    /// Events in order.
    pub events: Vec<EventView>,
    /// Pass as `after` to get the next page.
    pub next_after: u64,
}

/// A checkpointed message.
#[derive(Serialize, Debug, ToSchema)]
pub struct MessageView {
    /// Position in the thread; a cursor for paging.
    pub id: i64,
    /// The run that wrote it.
    pub run_id: RunId,
    /// Step (0 = the run's input).
    pub step: u32,
    /// The message in OpenAI format.
    pub message: Message,
}

impl From<StoredMessage> for MessageView {
    fn from(m: StoredMessage) -> Self {
        Self {
            id: m.id,
            run_id: m.run_id,
            step: m.step,
            message: m.message,
        }
    }
}

/// An agent definition, as callers may see it.
#[derive(Serialize, Debug, ToSchema)]
pub struct AgentView {
    /// Name.
    pub name: String,
    /// What it is for.
    pub description: String,
    /// Tools it may use (`null`: all built-ins).
    pub tools: Option<Vec<String>>,
    /// Model override.
    pub model: Option<String>,
    /// Step limit.
    pub max_steps: u32,
    /// Wall-time limit in seconds.
    pub timeout_s: u64,
    /// Who it may delegate to.
    pub subagents: Vec<String>,
    /// The tools it really gets on this server (built-ins it may have, MCP tools it names, and
    /// the delegation tools when it may delegate).
    pub effective_tools: Vec<String>,
    /// The model its runs call (after aliases and the server default).
    pub effective_model: String,
    /// Its current version (a hash of its file): what new runs pin.
    pub version: String,
}

impl AgentView {
    /// The definition with what the engine really gives it.
    pub fn build(a: &AgentDef, engine: &crate::engine::Engine) -> Self {
        let mut effective_tools = engine.tools.allowed_for(a);
        if crate::delegation::offered(a, 0, &engine.settings.delegation) {
            effective_tools.extend(crate::delegation::TOOL_NAMES.iter().map(|s| s.to_string()));
        }
        let (effective_model, _) = crate::agents::resolve_model(
            a.model.as_deref(),
            None,
            &engine.settings.default_model,
            &engine.settings.model_aliases,
        );
        Self {
            name: a.name.clone(),
            description: a.description.clone(),
            tools: a.tools.clone(),
            model: a.model.clone(),
            max_steps: a.max_steps,
            timeout_s: a.timeout.as_secs(),
            subagents: a.subagents.clone(),
            effective_tools,
            effective_model,
            version: a.version.clone(),
        }
    }
}

/// A page of runs, newest first.
#[derive(Serialize, Debug, ToSchema)]
pub struct RunsPage {
    /// Runs.
    pub runs: Vec<RunView>,
    /// Pass as `cursor` for the next page; absent on the last page.
    pub next_cursor: Option<RunId>,
}

/// A thread with its newest runs and a page of its messages.
#[derive(Serialize, Debug, ToSchema)]
pub struct ThreadView {
    /// Id.
    pub id: ThreadId,
    /// Created.
    pub created_at: DateTime<Utc>,
    /// Last run start.
    pub updated_at: DateTime<Utc>,
    /// Newest runs (up to 50).
    pub runs: Vec<RunView>,
    /// Messages after `after`, oldest first.
    pub messages: Vec<MessageView>,
    /// Pass as `after` for the next page.
    pub next_after: i64,
    /// Every compaction of the thread, oldest first: which messages each summary stands for
    /// when a context is rebuilt (the messages themselves are all still here).
    pub compactions: Vec<crate::domain::Compaction>,
    /// The thread it was forked from and the last message it shares with it (its messages up
    /// to that one are the other thread's, listed here too), or null.
    pub forked_from: Option<ForkPoint>,
    /// The threads forked from this one, oldest first (at most 1,000).
    pub forks: Vec<ForkPoint>,
}

/// One end of a fork: a thread, and the last message its history shares.
#[derive(Serialize, Debug, Clone, ToSchema)]
pub struct ForkPoint {
    /// The thread.
    pub thread_id: ThreadId,
    /// The last shared message's id.
    pub at_message: i64,
}

/// The agent definitions.
#[derive(Serialize, Debug, ToSchema)]
pub struct AgentsList {
    /// Agents by name.
    pub agents: Vec<AgentView>,
}

/// Every error answer: `{"error": {"code", "message"}}`.
#[derive(Serialize, Debug, ToSchema)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// Code and message of an error.
#[derive(Serialize, Debug, ToSchema)]
pub struct ErrorDetail {
    /// Stable machine code (e.g. `thread_busy`, `not_found`, `invalid_request`).
    pub code: String,
    /// What happened and what to do.
    pub message: String,
}

/// Health and readiness answers.
#[derive(Serialize, Debug, ToSchema)]
pub struct Health {
    /// `ok`, `ready` or `unavailable`.
    pub status: String,
    /// Database state (readiness only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub db: Option<String>,
    /// Redis state, when configured (readiness only); `unreachable` makes the status `degraded`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub redis: Option<String>,
}
