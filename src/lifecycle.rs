//! The run's life as one state machine: every status a run can have, every event that moves
//! it, and the one function, [`next_status`], that says which moves are legal. Both stores
//! derive the `WHERE status IN (…)` guard of each status write from [`sources`], so the SQL
//! can only apply a move this table allows; the conformance suite walks every pair on both
//! backends. (The shape follows oxidecomputer/steno's `next_status`: every `(state, event)`
//! pair in one `match`, every other pair an explicit error.)
//!
//! | from \ event | claim | heartbeat | park | wake | release | finish(t) | request-cancel | cancel | expire | give-up |
//! |---|---|---|---|---|---|---|---|---|---|---|
//! | queued | running | – | – | – | – | – | – | cancelled | – | – |
//! | running | – | running | waiting | – | queued | t | running | – | queued | failed |
//! | waiting | running | – | – | waiting | – | – | – | cancelled | – | – |
//! | succeeded, failed, cancelled | – | – | – | – | – | – | – | – | – | – |

use serde::{Deserialize, Serialize};

/// Where a run is in its life. Stored as its lowercase name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum RunStatus {
    /// Waiting for a worker.
    Queued,
    /// A worker holds its lease and is executing it.
    Running,
    /// Parked (on children, or until a deadline); holds no worker.
    Waiting,
    /// Finished with a final answer.
    Succeeded,
    /// Finished with an error.
    Failed,
    /// Stopped on request.
    Cancelled,
}

stored_names!(RunStatus {
    Queued => "queued",
    Running => "running",
    Waiting => "waiting",
    Succeeded => "succeeded",
    Failed => "failed",
    Cancelled => "cancelled",
});

impl RunStatus {
    /// A terminal state never changes again.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            RunStatus::Succeeded | RunStatus::Failed | RunStatus::Cancelled
        )
    }

    /// Whether some event moves a run from `self` to `to`. Derived from [`next_status`], so it
    /// can never disagree with the rule.
    pub fn can_become(self, to: RunStatus) -> bool {
        Transition::ALL
            .into_iter()
            .any(|t| next_status(self, t) == Ok(to))
    }
}

/// How a run ends: the target of [`Transition::Finish`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Terminal {
    /// With a final answer.
    Succeeded,
    /// With an error.
    Failed,
    /// On request.
    Cancelled,
}

impl Terminal {
    /// The status it ends in.
    pub fn status(self) -> RunStatus {
        match self {
            Terminal::Succeeded => RunStatus::Succeeded,
            Terminal::Failed => RunStatus::Failed,
            Terminal::Cancelled => RunStatus::Cancelled,
        }
    }
}

/// Everything that can happen to a run's status. Who causes each is in its doc.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Transition {
    /// A worker takes the run: a queued run starts, a parked run resumes. Bumps the lease
    /// epoch; never counts as a crash.
    Claim,
    /// The lease holder renews its lease.
    Heartbeat,
    /// The lease holder parks the run on what it waits for, giving up its lease and worker.
    Park,
    /// Something a parked run waits on happened (a child ended, a deadline passed): it is due
    /// for a claim. The status stays `waiting` until that claim.
    Wake,
    /// The lease holder gives the run back without ending it (a draining worker); it is queued
    /// again at once and does not count as a crash.
    Release,
    /// The lease holder ends the run.
    Finish(Terminal),
    /// Someone asks a running run to stop; its worker acts on it within a second.
    RequestCancel,
    /// Someone cancels a run that holds no worker (queued or parked): it ends at once.
    Cancel,
    /// The lease ran out (its worker died or froze): the run goes back on the queue, and the
    /// crash counts toward the attempts limit.
    Expire,
    /// The lease ran out once too often: the run fails with `kind=lost`.
    GiveUp,
}

impl Transition {
    /// Every event, in the order of the documentation's table.
    pub const ALL: [Transition; 12] = [
        Transition::Claim,
        Transition::Heartbeat,
        Transition::Park,
        Transition::Wake,
        Transition::Release,
        Transition::Finish(Terminal::Succeeded),
        Transition::Finish(Terminal::Failed),
        Transition::Finish(Terminal::Cancelled),
        Transition::RequestCancel,
        Transition::Cancel,
        Transition::Expire,
        Transition::GiveUp,
    ];

    /// A short name for logs and errors.
    pub fn name(self) -> &'static str {
        match self {
            Transition::Claim => "claim",
            Transition::Heartbeat => "heartbeat",
            Transition::Park => "park",
            Transition::Wake => "wake",
            Transition::Release => "release",
            Transition::Finish(Terminal::Succeeded) => "finish(succeeded)",
            Transition::Finish(Terminal::Failed) => "finish(failed)",
            Transition::Finish(Terminal::Cancelled) => "finish(cancelled)",
            Transition::RequestCancel => "request-cancel",
            Transition::Cancel => "cancel",
            Transition::Expire => "expire",
            Transition::GiveUp => "give-up",
        }
    }
}

/// A move the state machine does not allow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("a {} run cannot {}", from.as_str(), event.name())]
pub struct IllegalTransition {
    /// The status it was in.
    pub from: RunStatus,
    /// What was attempted.
    pub event: Transition,
}

/// The rule: the status a run in `from` moves to on `event`, or why it cannot.
pub fn next_status(from: RunStatus, event: Transition) -> Result<RunStatus, IllegalTransition> {
    use RunStatus::*;
    use Transition::*;
    let to = match (from, event) {
        (Queued, Claim) => Running,
        (Queued, Cancel) => Cancelled,

        (Running, Heartbeat) => Running,
        (Running, Park) => Waiting,
        (Running, Release) => Queued,
        (Running, Finish(t)) => t.status(),
        (Running, RequestCancel) => Running,
        (Running, Expire) => Queued,
        (Running, GiveUp) => Failed,

        (Waiting, Claim) => Running,
        (Waiting, Wake) => Waiting,
        (Waiting, Cancel) => Cancelled,

        // Every other pair is illegal, spelled out so a new status or event must be placed.
        (
            Queued,
            Heartbeat | Park | Wake | Release | Finish(_) | RequestCancel | Expire | GiveUp,
        )
        | (Running, Claim | Wake | Cancel)
        | (Waiting, Heartbeat | Park | Release | Finish(_) | RequestCancel | Expire | GiveUp)
        | (Succeeded | Failed | Cancelled, _) => return Err(IllegalTransition { from, event }),
    };
    Ok(to)
}

/// The statuses from which `event` is legal: what a store's `WHERE status IN (…)` may contain.
pub fn sources(event: Transition) -> Vec<RunStatus> {
    RunStatus::ALL
        .into_iter()
        .filter(|s| next_status(*s, event).is_ok())
        .collect()
}

/// [`sources`] as an SQL list literal, e.g. `'queued','waiting'`, for building guards.
pub fn sql_sources(event: Transition) -> String {
    sources(event)
        .iter()
        .map(|s| format!("'{}'", s.as_str()))
        .collect::<Vec<_>>()
        .join(",")
}

/// The target of `event` for stores that only apply events from their legal sources; panics
/// (a bug in the caller) if `event` has more than one target among its sources, which only
/// `Finish` callers avoid by naming the terminal status.
pub fn target(event: Transition) -> RunStatus {
    let mut targets: Vec<RunStatus> = sources(event)
        .into_iter()
        .filter_map(|s| next_status(s, event).ok())
        .collect();
    targets.dedup();
    assert_eq!(targets.len(), 1, "{} has no single target", event.name());
    targets[0]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table in the module documentation, row by row; `None` is "illegal".
    #[test]
    fn the_documented_table_is_the_rule() {
        use RunStatus::*;
        let table: [(RunStatus, [Option<RunStatus>; 12]); 6] = [
            (
                Queued,
                [
                    Some(Running),
                    None,
                    None,
                    None,
                    None,
                    None,
                    None,
                    None,
                    None,
                    Some(Cancelled),
                    None,
                    None,
                ],
            ),
            (
                Running,
                [
                    None,
                    Some(Running),
                    Some(Waiting),
                    None,
                    Some(Queued),
                    Some(Succeeded),
                    Some(Failed),
                    Some(Cancelled),
                    Some(Running),
                    None,
                    Some(Queued),
                    Some(Failed),
                ],
            ),
            (
                Waiting,
                [
                    Some(Running),
                    None,
                    None,
                    Some(Waiting),
                    None,
                    None,
                    None,
                    None,
                    None,
                    Some(Cancelled),
                    None,
                    None,
                ],
            ),
            (Succeeded, [None; 12]),
            (Failed, [None; 12]),
            (Cancelled, [None; 12]),
        ];
        for (from, row) in table {
            for (event, want) in Transition::ALL.into_iter().zip(row) {
                assert_eq!(
                    next_status(from, event).ok(),
                    want,
                    "{} on {}",
                    from.as_str(),
                    event.name()
                );
            }
        }
    }

    #[test]
    fn terminal_states_never_change() {
        for s in RunStatus::ALL.into_iter().filter(|s| s.is_terminal()) {
            for t in Transition::ALL {
                assert!(next_status(s, t).is_err());
            }
        }
    }

    #[test]
    fn sources_and_targets() {
        assert_eq!(sql_sources(Transition::Claim), "'queued','waiting'");
        assert_eq!(sql_sources(Transition::Cancel), "'queued','waiting'");
        assert_eq!(target(Transition::Expire), RunStatus::Queued);
        assert!(RunStatus::Waiting.can_become(RunStatus::Running));
        assert!(!RunStatus::Queued.can_become(RunStatus::Waiting));
        assert!(!RunStatus::Waiting.can_become(RunStatus::Failed));
        assert_eq!(
            IllegalTransition {
                from: RunStatus::Succeeded,
                event: Transition::Claim
            }
            .to_string(),
            "a succeeded run cannot claim"
        );
    }
}
