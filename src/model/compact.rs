//! The wire side of compaction: the request that asks the model for a summary, the transcript
//! it summarises, and the message the summary becomes in a rebuilt context. The engine decides
//! when and what to compact (`engine::compaction`); the mock reads these same shapes to answer
//! deterministically.

use super::Message;
use super::tokens::Counter;

/// In the system prompt of every summarisation request (servers and tests can tell them apart).
pub const REQUEST_MARKER: &str = "[subagents:compaction]";

/// First line of a summary in a rebuilt context.
pub const SUMMARY_HEADER: &str = "[Context summary]";

/// Section heads of a transcript.
pub const USER: &str = "### user";
/// See [`USER`].
pub const ASSISTANT: &str = "### assistant";
/// See [`USER`].
pub const TOOL_RESULT: &str = "### tool result";
/// See [`USER`].
pub const EARLIER_SUMMARY: &str = "### earlier summary";
/// Where the compacting run's own task sits; it is kept verbatim, so it is not summarised.
pub const TASK: &str = "### the task (kept verbatim above; do not summarise it)";

/// The system prompt of a summarisation request.
pub fn prompt(max_words: usize) -> String {
    format!(
        "{REQUEST_MARKER}\nYou compact the working memory of an agent that is in the middle of a task. The user message \
         is a transcript of the oldest part of its conversation (and, if present, the summary of what came before it). \
         Write a summary the agent can continue from without the transcript: the facts it found, with exact names, \
         paths, numbers, identifiers and URLs; what it has done and decided; what failed and why; what is still to do. \
         Keep every sub-agent run id and thread id that appears. Do not address the user, do not call tools, do not \
         add anything that is not in the transcript. At most {max_words} words."
    )
}

/// One piece of a transcript.
pub enum Entry<'a> {
    /// The summary of what came before this range.
    EarlierSummary(&'a str),
    /// The compacting run's task, kept verbatim: marked, not repeated.
    Task,
    /// A message of the range.
    Message(&'a Message),
}

/// Renders `entries` as a transcript, each message cut to `per_message` tokens (the whole
/// message stays in the thread; the cut says so).
pub fn transcript(entries: &[Entry<'_>], counter: &Counter, per_message: usize) -> String {
    let mut out = String::new();
    let mut push = |head: &str, body: &str| {
        out.push_str(head);
        out.push('\n');
        let (kept, whole) = counter.head(body, per_message);
        out.push_str(kept);
        if !whole {
            out.push_str(&format!(
                "\n[… cut here for the summary: {} more bytes]",
                body.len() - kept.len()
            ));
        }
        out.push_str("\n\n");
    };
    for e in entries {
        match e {
            Entry::EarlierSummary(s) => push(EARLIER_SUMMARY, s),
            Entry::Task => push(TASK, ""),
            Entry::Message(Message::System { content }) => push("### system", content),
            Entry::Message(Message::User { content }) => push(USER, content),
            Entry::Message(Message::Assistant {
                content,
                tool_calls,
                ..
            }) => {
                let mut body = content.clone().unwrap_or_default();
                for c in tool_calls {
                    body.push_str(&format!(
                        "\n→ called {} {}",
                        c.function.name, c.function.arguments
                    ));
                }
                push(ASSISTANT, body.trim_start());
            }
            Entry::Message(Message::Tool {
                tool_call_id,
                content,
            }) => push(&format!("{TOOL_RESULT} ({tool_call_id})"), content),
        }
    }
    out
}

/// The message a summary becomes in a rebuilt context: a user message, so every
/// OpenAI-compatible server accepts it wherever it sits.
pub fn summary_message(summary: &str, first: i64, last: i64, pending: &[String]) -> Message {
    let mut content = format!(
        "{SUMMARY_HEADER} Earlier messages of this conversation (#{first}–#{last}) were compacted to fit the context \
         window; they are kept in the thread's record. What they contained:\n{}",
        summary.trim()
    );
    if !pending.is_empty() {
        content.push_str("\n\nSub-agent runs you started that are still running (collect them with subagent_await or check them with subagent_status):");
        for p in pending {
            content.push_str("\n- ");
            content.push_str(p);
        }
    }
    Message::User { content }
}

/// Whether a user message is a summary (not input from the caller).
pub fn is_summary(content: &str) -> bool {
    content.starts_with(SUMMARY_HEADER)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{FunctionCall, ToolCall};

    #[test]
    fn transcripts_mark_their_parts_and_cut_long_messages() {
        let c = Counter::for_model("gpt-4o");
        let call = Message::Assistant {
            content: Some("looking".into()),
            tool_calls: vec![ToolCall {
                id: "c1".into(),
                kind: "function".into(),
                function: FunctionCall {
                    name: "grep".into(),
                    arguments: "{}".into(),
                },
            }],
            thinking: vec![],
        };
        let big = Message::Tool {
            tool_call_id: "c1".into(),
            content: "word ".repeat(5000),
        };
        let t = transcript(
            &[
                Entry::EarlierSummary("before"),
                Entry::Task,
                Entry::Message(&call),
                Entry::Message(&big),
            ],
            &c,
            100,
        );
        assert!(t.starts_with(EARLIER_SUMMARY));
        assert!(t.contains(TASK));
        assert!(t.contains("→ called grep {}"));
        assert!(t.contains("### tool result (c1)"));
        assert!(t.contains("[… cut here for the summary:"));
        assert!(c.text(&t) < 200);
    }

    #[test]
    fn summaries_are_recognisable_and_carry_pending_runs() {
        let Message::User { content } =
            summary_message("found X", 3, 9, &["run 0190… (researcher)".into()])
        else {
            panic!()
        };
        assert!(is_summary(&content));
        assert!(content.contains("#3–#9"));
        assert!(content.contains("run 0190… (researcher)"));
        assert!(!is_summary("hello"));
    }
}
