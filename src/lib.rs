//! `subagents`: a durable executor for LLM subagent runs.
//!
//! A parent hands a task to a subagent; the subagent works in a fresh context (its own ReAct
//! loop) and only its final text comes back. Every run is a queued job whose every step is
//! checkpointed, so it survives crashed workers and can be continued on its thread.
//!
//! Modules, from the bottom layer up (each uses only the ones before it):
//! - [`ids`], [`domain`] (runs, messages, approvals, events: the vocabulary), [`lifecycle`] (the
//!   run state machine), [`failpoints`], [`model`] (the chat client and the mock server),
//!   [`agents`] (definitions from `jobs/*.md`), [`tools`] (built-ins, confined to the owner's
//!   workspace), [`events`], [`notify`];
//! - [`store`]: threads, runs, messages and the event outbox (SQLite and PostgreSQL), applying
//!   the state machine;
//! - [`queue`]: pushes apalis jobs;
//! - [`runs`]: start, cancel, and what follows a run's end;
//! - [`delegation`]: `task` and the `subagent_*` tools;
//! - [`budget`]: the fleet's shared model rate budgets (Redis, else the database);
//! - [`engine`]: the step loop, as a planner, pure decisions and an executor;
//! - [`worker`]: apalis workers, the drain, the reaper; [`relay`]: the outbox to Redis Streams;
//! - [`app`]: wiring; [`api`], [`client`], [`cli`], [`config`], [`telemetry`], [`bench`]: the
//!   program's edges;
//! - [`permissions`], [`hooks`], [`secrets`], [`procs`]: what a model may do on the machine, and
//!   what the processes it starts cannot reach (see `docs/security.md`).
#![warn(missing_docs)]

/// `ALL`, `as_str`, `parse` and the sqlx `Type`/`Encode`/`Decode` for an enum stored and sent by
/// name, from one list of variants and names, so the directions cannot drift apart: binds take
/// the enum, and a read that meets a name the list lacks is a corrupt row. (Each type's serde
/// names are checked against `as_str` by a unit test beside it.)
macro_rules! stored_names {
    (@unit $v:ident) => {
        ()
    };
    ($ty:ident { $($variant:ident => $name:literal,)+ }) => {
        impl $ty {
            /// Every value, in declaration order.
            pub const ALL: [$ty; [$(stored_names!(@unit $variant)),+].len()] =
                [$($ty::$variant),+];

            /// The name it is stored and sent as.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($ty::$variant => $name,)+
                }
            }

            /// Parses a stored name; anything else is `None` (the store reports it as corrupt).
            pub fn parse(s: &str) -> Option<$ty> {
                match s {
                    $($name => Some($ty::$variant),)+
                    _ => None,
                }
            }
        }

        // Bound and read as its name (a TEXT column on both backends). A name the list does not
        // know is a decode error, which the store reports as a corrupt row.
        impl<DB: sqlx::Database> sqlx::Type<DB> for $ty
        where
            str: sqlx::Type<DB>,
        {
            fn type_info() -> DB::TypeInfo {
                <str as sqlx::Type<DB>>::type_info()
            }

            fn compatible(ty: &DB::TypeInfo) -> bool {
                <str as sqlx::Type<DB>>::compatible(ty)
            }
        }

        impl<'q, DB: sqlx::Database> sqlx::Encode<'q, DB> for $ty
        where
            &'static str: sqlx::Encode<'q, DB>,
        {
            fn encode_by_ref(
                &self,
                buf: &mut <DB as sqlx::Database>::ArgumentBuffer,
            ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
                <&'static str as sqlx::Encode<'q, DB>>::encode(self.as_str(), buf)
            }
        }

        impl<'r, DB: sqlx::Database> sqlx::Decode<'r, DB> for $ty
        where
            &'r str: sqlx::Decode<'r, DB>,
        {
            fn decode(
                value: <DB as sqlx::Database>::ValueRef<'r>,
            ) -> Result<Self, sqlx::error::BoxDynError> {
                let name = <&'r str as sqlx::Decode<'r, DB>>::decode(value)?;
                $ty::parse(name).ok_or_else(|| {
                    format!("`{name}` is not a stored {} name", stringify!($ty)).into()
                })
            }
        }
    };
}

pub mod agents;
pub mod api;
pub mod app;
pub mod bench;
pub mod budget;
pub mod cli;
pub mod client;
pub mod config;
pub mod delegation;
pub mod deltas;
pub mod domain;
pub mod engine;
pub mod events;
pub mod failpoints;
pub mod hooks;
pub mod ids;
pub mod lifecycle;
pub mod mcp;
pub mod mcp_server;
pub mod model;
pub mod notify;
pub mod output;
pub mod permissions;
pub mod pinning;
pub mod policy;
pub mod procs;
pub mod queue;
pub mod relay;
pub mod runs;
pub mod schedules;
pub mod secrets;
pub mod store;
pub mod telemetry;
pub mod tools;
pub mod webhooks;
pub mod worker;
