//! `subagents`: a durable executor for LLM subagent runs.
//!
//! A parent hands a task to a subagent; the subagent works in a fresh context (its own ReAct
//! loop) and only its final text comes back. Every run is a queued job whose every step is
//! checkpointed, so it survives crashed workers and can be continued on its thread.
//!
//! Modules, in the order data flows:
//! - [`agents`]: definitions from `jobs/*.md`;
//! - [`app`]: wiring — start a run, wait for it, run workers;
//! - [`queue`]: apalis jobs, workers and the reaper;
//! - [`engine`]: the step loop (replay, tools, limits, forced answers);
//! - [`model`]: the chat client and the mock server;
//! - [`tools`]: built-in tools confined to a workspace;
//! - [`delegation`]: `task` and the `subagent_*` tools, parking and waking parents;
//! - [`store`]: threads, runs, messages and the event outbox (SQLite and PostgreSQL);
//! - [`relay`]: the outbox to Redis Streams, readers, and cross-process wake-ups;
//! - [`config`], [`cli`], [`telemetry`], [`bench`]: the program's edges.
#![warn(missing_docs)]

pub mod agents;
pub mod api;
pub mod app;
pub mod bench;
pub mod cli;
pub mod client;
pub mod config;
pub mod delegation;
pub mod engine;
pub mod events;
pub mod ids;
pub mod model;
pub mod notify;
pub mod queue;
pub mod relay;
pub mod store;
pub mod telemetry;
pub mod tools;
