//! The step loop's decisions, as pure functions of values: what happens before a model call
//! (call, compact, force the answer) and after it (go on, compact and retry, park on the
//! provider's rate limit, fail). Whether the rate budgets let a call go is [`crate::budget`]'s. The executor ([`super::attempt`]) gathers the inputs, asks, and
//! performs; nothing here reads the database or the clock, so each rule has a unit test below.

use std::time::Duration;

use super::compaction::{Compacted, Reason};
use crate::domain::{ErrorKind, RunError, RunLimits};
use crate::model::ModelError;

/// Compactions that may fail in a row before the run fails with `kind=context`.
pub const MAX_COMPACTION_FAILURES: u32 = 3;

/// Whether the step must give its final answer now (no tools offered): the run's own step limit
/// is reached, or its tree's token or step limit is.
pub fn forced(steps_done: u32, limits: &RunLimits, tree_limit_reached: bool) -> bool {
    steps_done >= limits.max_steps || tree_limit_reached
}

/// Where the run stands with its context window, carried from step to step within an attempt.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pressure {
    /// Compactions that failed in a row (or did not stop the provider refusing the request).
    pub failures: u32,
    /// The provider refused the last request as too long: compact before retrying it.
    pub refused_too_long: bool,
    /// A step whose context could not be compacted further (it is all task and tail).
    pub incompressible_step: Option<u32>,
}

/// What the next request looks like, for the compaction decision.
#[derive(Clone, Copy, Debug)]
pub struct Request {
    /// The step it is for.
    pub step: u32,
    /// Its estimated size in tokens.
    pub estimate: u64,
    /// Whether this run has not called the model yet.
    pub first_call: bool,
    /// Whether the context carries messages from before this run (earlier runs, a summary).
    pub carried: bool,
}

/// What a failed model call means for the run.
#[derive(Debug, PartialEq, Eq)]
pub enum ModelFailure {
    /// The request was too long: learn the window from `body`, compact, and retry.
    TooLong {
        /// The HTTP status it came with.
        status: u16,
        /// The provider's answer (it may state the real window).
        body: String,
    },
    /// The provider's rate limit held through every retry: park until it allows again.
    RateLimited {
        /// How long it asked to wait.
        retry_after: Duration,
        /// Its last refusal.
        last: String,
    },
    /// The run fails with this.
    Fail(RunError),
}

impl Pressure {
    /// Whether to compact before calling the model, and why: the provider refused the request
    /// as too long; it would pass `compact_at`; or a new run starts on a long thread. A step
    /// already found incompressible calls the model as it is.
    pub fn compaction(&self, req: Request, compact_at: u64) -> Option<Reason> {
        if self.refused_too_long {
            Some(Reason::ContextLength)
        } else if self.incompressible_step == Some(req.step) {
            None
        } else if req.estimate > compact_at {
            Some(Reason::Threshold)
        } else if req.first_call && req.carried && req.estimate > compact_at / 2 {
            Some(Reason::NewRun)
        } else {
            None
        }
    }

    /// Takes a compaction's outcome. `Ok` means "plan again" (the context is reloaded); `Err`
    /// fails the run: nothing left to compact while the request does not fit, or too many
    /// failures in a row.
    pub fn compacted(
        &mut self,
        outcome: &Compacted,
        reason: Reason,
        req: Request,
        window: u64,
        model: &str,
    ) -> Result<(), RunError> {
        self.refused_too_long = false;
        match outcome {
            Compacted::Done => Ok(()),
            Compacted::Nothing if reason == Reason::ContextLength || req.estimate > window => {
                Err(context_error(format!(
                    "the next request needs about {} tokens and model `{model}` holds {window}; nothing more can be compacted (the system prompt, the task and the newest messages alone are too large). Give the agent a model with a larger window or set its context_window:, or shorten the task",
                    req.estimate
                )))
            }
            Compacted::Nothing => {
                self.incompressible_step = Some(req.step);
                Ok(())
            }
            Compacted::Failed(why) => {
                self.failures += 1;
                if self.failures >= MAX_COMPACTION_FAILURES {
                    return Err(context_error(format!(
                        "the context could not be compacted: {MAX_COMPACTION_FAILURES} compactions in a row failed; the last one: {why}"
                    )));
                }
                Ok(())
            }
        }
    }

    /// The provider refused a request as too long: compact and retry, unless it kept refusing.
    pub fn refused(&mut self, model: &str) -> Result<(), RunError> {
        self.failures += 1;
        if self.failures >= MAX_COMPACTION_FAILURES {
            return Err(context_error(format!(
                "model `{model}` refused the request as longer than its context window {MAX_COMPACTION_FAILURES} times in a row, compacting in between; set the agent's context_window: to the model's real window"
            )));
        }
        self.refused_too_long = true;
        Ok(())
    }

    /// The model answered: the failures in a row are over.
    pub fn answered(&mut self) {
        self.failures = 0;
    }
}

/// How a failed model call ends for the run.
pub fn model_failure(e: ModelError) -> ModelFailure {
    match e {
        ModelError::ContextLength { status, body } => ModelFailure::TooLong { status, body },
        ModelError::RateLimited { retry_after, last } => {
            ModelFailure::RateLimited { retry_after, last }
        }
        e => ModelFailure::Fail(RunError {
            kind: ErrorKind::Model,
            message: model_error_message(&e),
        }),
    }
}

/// A model error as the run's failure message, with what to check for the common ones.
fn model_error_message(e: &ModelError) -> String {
    match e {
        ModelError::Rejected {
            status: 401 | 403, ..
        } => format!(
            "{e} (check the model's API key: OPENAI_API_KEY, ANTHROPIC_API_KEY for Claude models, or the variable its SUBAGENTS_MODELS entry names)"
        ),
        ModelError::Rejected { status: 404, .. } => {
            format!("{e} (check OPENAI_BASE_URL and the model name)")
        }
        _ => e.to_string(),
    }
}

/// What a final answer comes to under the run's output schema.
#[derive(Debug, PartialEq)]
pub enum Verdict {
    /// The run ends with this result (the validated JSON, compact).
    Accept(String),
    /// The answer goes back to the model with these errors; `left` more may go back after it.
    SendBack {
        /// What the schema found wrong.
        errors: Vec<String>,
        /// Send-backs still allowed after this one.
        left: u32,
    },
    /// The run fails with `kind=output`.
    Refuse(RunError),
}

/// Judges a final answer: `checked` is the schema's word on it (`None`: the run has no
/// schema), `sent_back` how many answers of this run went back already, `retries` how many
/// may.
pub fn verdict(
    answer: String,
    checked: Option<Result<serde_json::Value, Vec<String>>>,
    sent_back: u32,
    retries: u32,
) -> Verdict {
    match checked {
        None => Verdict::Accept(answer),
        Some(Ok(v)) => Verdict::Accept(v.to_string()),
        Some(Err(errors)) if sent_back < retries => Verdict::SendBack {
            errors,
            left: retries - sent_back - 1,
        },
        Some(Err(errors)) => Verdict::Refuse(RunError {
            kind: ErrorKind::Output,
            message: format!(
                "the final answer does not match the output schema ({} sent back with the errors first): {}",
                match retries {
                    0 => "no answer was".to_owned(),
                    1 => "1 answer was".to_owned(),
                    n => format!("{n} answers were"),
                },
                errors.join("; ")
            ),
        }),
    }
}

/// The failure of a run that passed its wall-time limit.
pub fn timed_out(limits: &RunLimits) -> RunError {
    RunError {
        kind: ErrorKind::Timeout,
        message: format!(
            "the run exceeded its wall-time limit of {}s",
            limits.timeout_secs
        ),
    }
}

fn context_error(message: String) -> RunError {
    RunError {
        kind: ErrorKind::Context,
        message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(step: u32, estimate: u64) -> Request {
        Request {
            step,
            estimate,
            first_call: false,
            carried: false,
        }
    }

    #[test]
    fn an_answer_goes_back_while_retries_last_then_the_run_fails_with_kind_output() {
        let bad = || Some(Err(vec!["at /a: wrong".to_owned()]));
        assert_eq!(verdict("x".into(), None, 0, 0), Verdict::Accept("x".into()));
        assert_eq!(
            verdict(
                " {\"a\": 1}".into(),
                Some(Ok(serde_json::json!({"a": 1}))),
                2,
                2
            ),
            Verdict::Accept("{\"a\":1}".into())
        );
        assert_eq!(
            verdict("x".into(), bad(), 0, 2),
            Verdict::SendBack {
                errors: vec!["at /a: wrong".into()],
                left: 1
            }
        );
        assert!(matches!(
            verdict("x".into(), bad(), 1, 2),
            Verdict::SendBack { left: 0, .. }
        ));
        let Verdict::Refuse(e) = verdict("x".into(), bad(), 2, 2) else {
            panic!("refused")
        };
        assert_eq!(e.kind, ErrorKind::Output);
        assert!(e.message.contains("2 answers were") && e.message.contains("at /a: wrong"));
        assert!(matches!(
            verdict("x".into(), bad(), 0, 0),
            Verdict::Refuse(_)
        ));
    }

    #[test]
    fn the_answer_is_forced_at_the_step_limit_or_the_trees() {
        let limits = RunLimits {
            max_steps: 3,
            timeout_secs: 60,
            max_total_tokens: None,
            max_total_steps: None,
            compact_at: None,
            output: None,
        };
        assert!(!forced(2, &limits, false));
        assert!(forced(3, &limits, false));
        assert!(forced(0, &limits, true));
    }

    #[test]
    fn compaction_runs_for_a_refusal_a_full_window_or_a_long_thread() {
        let p = Pressure::default();
        assert_eq!(p.compaction(req(1, 80), 100), None);
        assert_eq!(p.compaction(req(1, 101), 100), Some(Reason::Threshold));
        let new_run = Request {
            first_call: true,
            carried: true,
            ..req(1, 51)
        };
        assert_eq!(p.compaction(new_run, 100), Some(Reason::NewRun));
        // Only a carried context makes a first call compact early.
        let own = Request {
            carried: false,
            ..new_run
        };
        assert_eq!(p.compaction(own, 100), None);
        let refused = Pressure {
            refused_too_long: true,
            ..Pressure::default()
        };
        assert_eq!(
            refused.compaction(req(1, 1), 100),
            Some(Reason::ContextLength)
        );
    }

    #[test]
    fn an_incompressible_step_calls_the_model_as_it_is_once() {
        let mut p = Pressure::default();
        let r = req(4, 150);
        p.compacted(&Compacted::Nothing, Reason::Threshold, r, 200, "m")
            .unwrap();
        assert_eq!(
            p.compaction(r, 100),
            None,
            "the same step does not compact again"
        );
        assert_eq!(p.compaction(req(5, 150), 100), Some(Reason::Threshold));
    }

    #[test]
    fn nothing_to_compact_fails_when_the_request_cannot_fit() {
        let mut p = Pressure::default();
        let e = p
            .compacted(
                &Compacted::Nothing,
                Reason::Threshold,
                req(1, 300),
                200,
                "m",
            )
            .unwrap_err();
        assert_eq!(e.kind, ErrorKind::Context);
        let mut p = Pressure {
            refused_too_long: true,
            ..Pressure::default()
        };
        let e = p.compacted(
            &Compacted::Nothing,
            Reason::ContextLength,
            req(1, 10),
            200,
            "m",
        );
        assert!(
            e.is_err(),
            "a refused request with nothing to compact cannot be retried"
        );
    }

    #[test]
    fn three_failures_in_a_row_fail_the_run_and_an_answer_resets_them() {
        let mut p = Pressure::default();
        let failed = Compacted::Failed("no".into());
        let r = req(1, 150);
        p.compacted(&failed, Reason::Threshold, r, 200, "m")
            .unwrap();
        p.refused("m").unwrap();
        assert!(p.refused_too_long);
        let e = p
            .compacted(&failed, Reason::ContextLength, r, 200, "m")
            .unwrap_err();
        assert!(
            e.message.contains("3 compactions in a row"),
            "{}",
            e.message
        );
        let mut p = Pressure::default();
        p.refused("m").unwrap();
        p.refused("m").unwrap();
        p.answered();
        p.refused("m").unwrap();
        assert_eq!(p.failures, 1);
        p.refused("m").unwrap();
        let e = p.refused("m").unwrap_err();
        assert_eq!(e.kind, ErrorKind::Context);
    }

    #[test]
    fn model_errors_compact_park_or_fail() {
        let too_long = ModelError::ContextLength {
            status: 400,
            body: "max 8192".into(),
        };
        assert_eq!(
            model_failure(too_long),
            ModelFailure::TooLong {
                status: 400,
                body: "max 8192".into()
            }
        );
        let limited = ModelError::RateLimited {
            retry_after: Duration::from_secs(7),
            last: "429".into(),
        };
        assert_eq!(
            model_failure(limited),
            ModelFailure::RateLimited {
                retry_after: Duration::from_secs(7),
                last: "429".into()
            }
        );
        let ModelFailure::Fail(e) = model_failure(ModelError::Rejected {
            status: 401,
            body: "no".into(),
        }) else {
            panic!("a rejected key fails the run")
        };
        assert_eq!(e.kind, ErrorKind::Model);
        assert!(e.message.contains("OPENAI_API_KEY") && e.message.contains("ANTHROPIC_API_KEY"));
    }
}
