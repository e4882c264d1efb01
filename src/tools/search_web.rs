//! `web_search`: a query against the operator's search backend (`SUBAGENTS_SEARCH_URL`, an
//! endpoint that answers SearXNG's JSON format: `GET URL?q=…&format=json` →
//! `{"results": [{"title", "url", "content"}]}`). Only offered when configured. The endpoint is
//! the operator's own choice, so it is not subject to `web_fetch`'s address rules. No side
//! effect: a replay searches again.

use std::time::Duration;

use async_trait::async_trait;
use serde_json::{Value, json};

use super::{ErrorCode, Tool, ToolCtx, ToolError, spec, str_arg};
use crate::model::ToolSpec;

/// Results returned when the call names no number.
const DEFAULT_RESULTS: u64 = 8;
/// Most results a call may ask for.
const MAX_RESULTS: u64 = 20;

/// `web_search`.
pub struct WebSearch {
    /// The search endpoint.
    pub url: String,
    /// Time for one search.
    pub timeout: Duration,
}

#[async_trait]
impl Tool for WebSearch {
    fn spec(&self) -> ToolSpec {
        spec(
            "web_search",
            "Searches the web and returns the top results (title, URL, snippet). Use web_fetch to read a result.",
            json!({"type":"object","properties":{"query":{"type":"string"},"max_results":{"type":"integer","minimum":1,"maximum":MAX_RESULTS}},"required":["query"]}),
        )
    }
    async fn call(&self, args: Value, _: &ToolCtx) -> Result<String, ToolError> {
        let query = str_arg(&args, "query")?.trim().to_owned();
        if query.is_empty() {
            return Err(ToolError::new(ErrorCode::BadArguments, "`query` is empty"));
        }
        let n = args
            .get("max_results")
            .and_then(Value::as_u64)
            .unwrap_or(DEFAULT_RESULTS)
            .clamp(1, MAX_RESULTS) as usize;
        let client = reqwest::Client::builder()
            .timeout(self.timeout)
            .build()
            .map_err(|e| ToolError::new(ErrorCode::SearchFailed, e.to_string()))?;
        let mut url = reqwest::Url::parse(&self.url).map_err(|e| {
            ToolError::new(
                ErrorCode::SearchFailed,
                format!("SUBAGENTS_SEARCH_URL `{}` is not a URL: {e}", self.url),
            )
        })?;
        url.query_pairs_mut()
            .append_pair("q", &query)
            .append_pair("format", "json");
        let resp = client.get(url).send().await.map_err(|e| {
            ToolError::new(
                ErrorCode::SearchFailed,
                format!("the search backend did not answer: {e}"),
            )
        })?;
        if !resp.status().is_success() {
            return Err(ToolError::new(
                ErrorCode::SearchFailed,
                format!("the search backend answered {}", resp.status()),
            ));
        }
        let body: Value = resp.json().await.map_err(|e| {
            ToolError::new(
                ErrorCode::SearchFailed,
                format!("the search backend's answer is not JSON: {e}"),
            )
        })?;
        let results = body
            .get("results")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        if results.is_empty() {
            return Ok(format!("no results for `{query}`"));
        }
        let field = |r: &Value, k: &str| {
            r.get(k)
                .and_then(Value::as_str)
                .unwrap_or("")
                .trim()
                .to_owned()
        };
        let lines: Vec<String> = results
            .iter()
            .take(n)
            .enumerate()
            .map(|(i, r)| {
                let snippet: String = field(r, "content").chars().take(300).collect();
                format!(
                    "{}. {}\n   {}\n   {}",
                    i + 1,
                    field(r, "title"),
                    field(r, "url"),
                    snippet
                )
            })
            .collect();
        Ok(lines.join("\n"))
    }
}
