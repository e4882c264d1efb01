//! The integration suite: one binary, real SQLite files, the mock model over real HTTP, and
//! worker processes killed with SIGKILL.

mod anthropic;
mod api;
mod browser;
mod cli;
mod context;
mod dashboard;
mod delegation;
mod deltas;
mod docs;
mod fleet;
mod forks;
mod kill;
mod layers;
mod lifecycle;
mod mcp;
mod mcp_server;
mod output;
mod pinning;
mod policy;
mod provider_clients;
mod redis;
mod runs;
mod schedules;
mod security;
mod steer;
mod store;
mod support;
mod tools;
mod webhooks;
