//! The integration suite: one binary, real SQLite files, the mock model over real HTTP, and
//! worker processes killed with SIGKILL.

mod api;
mod cli;
mod delegation;
mod fleet;
mod kill;
mod layers;
mod lifecycle;
mod redis;
mod runs;
mod store;
mod support;
mod tools;
