//! Reading events: compact one-line descriptions (for progress displays and for parents'
//! status tools, which must not fill a model's context with raw envelopes), and which event
//! types end a run's stream.

use crate::store::EventRecord;

/// True for the event that ends a run's stream.
pub fn is_terminal(kind: &str) -> bool {
    matches!(kind, "run.succeeded" | "run.failed" | "run.cancelled")
}

/// A short human line for an event, or `None` for events not worth a line.
pub fn progress_line(e: &EventRecord) -> Option<String> {
    let d = &e.data;
    let step = d["step"].as_u64().unwrap_or(0);
    Some(match e.kind.as_str() {
        "run.queued" => "queued".to_owned(),
        "run.started" => format!(
            "started (attempt {}, worker {})",
            d["attempt"],
            d["worker"].as_str().unwrap_or("?")
        ),
        "model.completed" => {
            let calls: Vec<&str> = d["tool_calls"]
                .as_array()
                .map(|a| a.iter().filter_map(|v| v.as_str()).collect())
                .unwrap_or_default();
            if calls.is_empty() {
                format!("step {step}: model answered")
            } else {
                format!("step {step}: model calls {}", calls.join(", "))
            }
        }
        "tool.completed" => {
            let preview: String = d["preview"]
                .as_str()
                .unwrap_or("")
                .chars()
                .take(70)
                .collect::<String>()
                .replace('\n', " ");
            let mark = if d["ok"] == true { "ok" } else { "error" };
            format!("  {} {mark}: {preview}", d["tool"].as_str().unwrap_or("?"))
        }
        "run.succeeded" => format!(
            "succeeded{}",
            if d["forced"] == true {
                " (answer forced by a limit)"
            } else {
                ""
            }
        ),
        "run.failed" => format!(
            "failed [{}]: {}",
            d["error"]["kind"].as_str().unwrap_or("?"),
            d["error"]["message"].as_str().unwrap_or("")
        ),
        "run.cancelled" => "cancelled".to_owned(),
        "run.waiting" if d["waiting_on"] == "approval" => "waiting for approval".to_owned(),
        "approval.requested" => format!(
            "  {} needs approval ({}): {}",
            d["tool"].as_str().unwrap_or("?"),
            d["approval_id"].as_str().unwrap_or("?"),
            d["reason"].as_str().unwrap_or("")
        ),
        "approval.resolved" => format!(
            "  approval {} {}",
            d["approval_id"].as_str().unwrap_or("?"),
            d["decision"].as_str().unwrap_or("?")
        ),
        "tool.denied" => format!(
            "  {} denied: {}",
            d["tool"].as_str().unwrap_or("?"),
            d["reason"].as_str().unwrap_or("")
        ),
        "hook.blocked" => format!(
            "  {} blocked by a hook: {}",
            d["tool"].as_str().unwrap_or("?"),
            d["reason"].as_str().unwrap_or("")
        ),
        "context.compacted" => format!(
            "context compacted: {} -> {} tokens",
            d["tokens_before"], d["tokens_after"]
        ),
        _ => return None,
    })
}
