//! The store traits' shared implementations, one file per trait, each a macro that `store_impl!`
//! (in `common.rs`) expands for both backends.

#[macro_use]
mod runs;
#[macro_use]
mod claims;
#[macro_use]
mod checkpoints;
#[macro_use]
mod parking;
#[macro_use]
mod approvals;
#[macro_use]
mod rate_budgets;
#[macro_use]
mod queries;
#[macro_use]
mod harness;
#[macro_use]
mod outbox;
