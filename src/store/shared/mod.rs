//! The store traits, implemented once for every [`SqlStore`]: one file per trait, each the
//! statements both backends share. What a backend does its own way it provides through
//! [`SqlStore`].

mod approvals;
mod checkpoints;
mod claims;
mod forks;
mod harness;
mod inbox;
mod outbox;
mod parking;
mod pins;
mod queries;
mod rate_budgets;
mod runs;
mod schedules;
mod webhooks;

use super::sql::{Affected, Args, Col, Conn, DbRow, SqlStore, corrupt};
use super::*;
