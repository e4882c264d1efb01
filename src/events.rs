//! Reading events: compact one-line descriptions (for progress displays and for parents'
//! status tools, which must not fill a model's context with raw envelopes), and which event
//! types end a run's stream.

use crate::domain::Event;
use crate::store::EventRecord;

/// True for the event that ends a run's stream.
pub fn is_terminal(kind: &str) -> bool {
    matches!(kind, "run.succeeded" | "run.failed" | "run.cancelled")
}

/// A short human line for an event, or `None` for events not worth a line (or data that is not
/// an event this build knows).
pub fn progress_line(e: &EventRecord) -> Option<String> {
    Some(match Event::parse(&e.kind, &e.data)? {
        Event::RunQueued(_) => "queued".to_owned(),
        Event::RunStarted(c) => format!("started (attempt {}, worker {})", c.attempt, c.worker),
        Event::ModelCompleted(m) if m.tool_calls.is_empty() => {
            format!("step {}: model answered", m.step)
        }
        Event::ModelCompleted(m) => {
            format!("step {}: model calls {}", m.step, m.tool_calls.join(", "))
        }
        Event::ToolCompleted(t) => {
            let preview: String = t
                .preview
                .chars()
                .take(70)
                .collect::<String>()
                .replace('\n', " ");
            format!(
                "  {} {}: {preview}",
                t.tool,
                if t.ok { "ok" } else { "error" }
            )
        }
        Event::RunSucceeded(r) => format!(
            "succeeded{}",
            if r.forced {
                " (answer forced by a limit)"
            } else {
                ""
            }
        ),
        Event::RunFailed(f) => format!("failed [{}]: {}", f.error.kind.as_str(), f.error.message),
        Event::RunCancelled(_) => "cancelled".to_owned(),
        Event::RunWaiting(w) if w.waiting_on == crate::domain::event::WaitingOn::Approval => {
            "waiting for approval".to_owned()
        }
        Event::ApprovalRequested(a) => format!(
            "  {} needs approval ({}): {}",
            a.tool, a.approval_id, a.reason
        ),
        Event::ApprovalResolved(a) => {
            format!("  approval {} {}", a.approval_id, a.decision.as_str())
        }
        Event::ToolDenied(d) => format!("  {} denied: {}", d.tool, d.reason),
        Event::OutputRejected(o) => format!(
            "answer refused by the output schema ({} more {}): {}",
            o.retries_left,
            if o.retries_left == 1 { "try" } else { "tries" },
            o.errors.first().map(String::as_str).unwrap_or("")
        ),
        Event::HookBlocked(h) => format!("  {} blocked by a hook: {}", h.tool, h.reason),
        Event::ContextCompacted(c) => format!(
            "context compacted: {} -> {} tokens",
            c.tokens_before, c.tokens_after
        ),
        _ => return None,
    })
}
