//! `todo_write`: the agent's plan as a checklist. The list lives in the run's checkpointed
//! conversation (the call's arguments and this result are committed messages, so a resumed run
//! sees its latest plan), and the checklist it returns shows in the run's progress lines. It has
//! no side effect: a replay writes the same list again.

use async_trait::async_trait;
use serde_json::{Value, json};

use super::{ErrorCode, Tool, ToolCtx, ToolError, spec};
use crate::model::ToolSpec;

/// Most items a plan may hold.
const MAX_ITEMS: usize = 100;

/// `todo_write`.
pub struct TodoWrite;

#[async_trait]
impl Tool for TodoWrite {
    fn spec(&self) -> ToolSpec {
        spec(
            "todo_write",
            "Writes your plan for this task as a checklist, replacing the previous one. Each item has `content` and `status` (`pending`, `in_progress` or `completed`); keep exactly one item in progress while you work, and mark items completed as soon as they are done.",
            json!({"type":"object","properties":{"todos":{"type":"array","maxItems":MAX_ITEMS,"items":{"type":"object","properties":{
                "content":{"type":"string"},"status":{"type":"string","enum":["pending","in_progress","completed"]},
                "activeForm":{"type":"string"}},"required":["content","status"]}}},"required":["todos"]}),
        )
    }
    async fn call(&self, args: Value, _: &ToolCtx) -> Result<String, ToolError> {
        let items = args.get("todos").and_then(Value::as_array).ok_or_else(|| {
            ToolError::new(
                ErrorCode::BadArguments,
                "`todos` must be a list of {content, status}",
            )
        })?;
        if items.len() > MAX_ITEMS {
            return Err(ToolError::new(
                ErrorCode::BadArguments,
                format!("a plan holds at most {MAX_ITEMS} items; merge some"),
            ));
        }
        let mut lines = vec![];
        let (mut done, mut active) = (0, 0);
        for (i, item) in items.iter().enumerate() {
            let content = item
                .get("content")
                .and_then(Value::as_str)
                .map(str::trim)
                .filter(|c| !c.is_empty())
                .ok_or_else(|| {
                    ToolError::new(
                        ErrorCode::BadArguments,
                        format!("item {}: `content` must be a non-empty string", i + 1),
                    )
                })?;
            let mark = match item.get("status").and_then(Value::as_str) {
                Some("pending") => "[ ]",
                Some("in_progress") => {
                    active += 1;
                    "[>]"
                }
                Some("completed") => {
                    done += 1;
                    "[x]"
                }
                other => {
                    return Err(ToolError::new(
                        ErrorCode::BadArguments,
                        format!(
                            "item {}: status {:?} is not pending, in_progress or completed",
                            i + 1,
                            other.unwrap_or("(missing)")
                        ),
                    ));
                }
            };
            lines.push(format!("{mark} {content}"));
        }
        if items.is_empty() {
            return Ok("Plan cleared.".into());
        }
        let mut out = format!("Plan: {done} of {} done\n{}", items.len(), lines.join("\n"));
        if active > 1 {
            out.push_str(&format!(
                "\nnote: {active} items are in progress; keep one at a time"
            ));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_plan_renders_and_bad_items_are_refused() {
        let ctx = ToolCtx::new("/nonexistent", "k", 1000);
        let out = TodoWrite
            .call(
                json!({"todos": [
                {"content": "find the config", "status": "completed"},
                {"content": "read it", "status": "in_progress"},
                {"content": "answer", "status": "pending"}]}),
                &ctx,
            )
            .await
            .unwrap();
        assert_eq!(
            out,
            "Plan: 1 of 3 done\n[x] find the config\n[>] read it\n[ ] answer"
        );
        let e = TodoWrite
            .call(
                json!({"todos": [{"content": "x", "status": "doing"}]}),
                &ctx,
            )
            .await
            .unwrap_err();
        assert_eq!(e.code, "bad_arguments");
        assert_eq!(
            TodoWrite
                .call(
                    json!({"todos": [{"content": " ", "status": "pending"}]}),
                    &ctx
                )
                .await
                .unwrap_err()
                .code,
            "bad_arguments"
        );
        assert_eq!(
            TodoWrite.call(json!({"todos": []}), &ctx).await.unwrap(),
            "Plan cleared."
        );
    }
}
