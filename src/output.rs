//! Structured results: a run whose final answer must be JSON that a JSON Schema accepts.
//!
//! The schema comes from the agent file (`output_schema:`), the start (`output_schema` on
//! `POST /v1/runs`) or a parent's `task` call, and is stored with the run's limits
//! ([`crate::domain::RunLimits::output`]) so every attempt checks the same contract. The
//! provider is asked for it (OpenAI's `response_format: json_schema`), and whatever comes back
//! is validated here: an invalid answer goes back to the model with the errors, at most
//! [`OutputContract::retries`] times, then the run fails with `kind=output`. A run never
//! succeeds with an answer its schema refuses.
//!
//! Schemas come from callers and from models (a parent names its child's schema), so building
//! one is bounded: at most [`MAX_SCHEMA_BYTES`], no reference is fetched from anywhere
//! (`$ref` resolves inside the schema only), and `pattern`s run on the `regex` engine (linear
//! time: no pattern can stall a worker on a long answer).

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Largest schema accepted, serialized.
pub const MAX_SCHEMA_BYTES: usize = 64 * 1024;

/// Answers that may be refused before the run fails, when the caller does not say.
pub const DEFAULT_RETRIES: u32 = 2;

/// Most `output_retries` a caller may ask for.
pub const MAX_RETRIES: u32 = 10;

/// Starts the message that sends an invalid answer back: the mock model (and a reader of the
/// thread) tells it from a caller's message by this.
pub const FEEDBACK_MARKER: &str = "[subagents:output_invalid]";

/// Errors listed back to the model, at most.
const MAX_ERRORS: usize = 10;

/// What a run's final answer must be.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputContract {
    /// The JSON Schema the answer must satisfy (checked to build when the run started).
    pub schema: Value,
    /// Invalid answers sent back to the model before the run fails with `kind=output`.
    pub retries: u32,
}

impl OutputContract {
    /// A contract for `schema`, checked to build, with `retries` (default [`DEFAULT_RETRIES`]).
    pub fn new(schema: Value, retries: Option<u32>) -> Result<OutputContract, String> {
        Checker::build(&schema)?;
        OutputContract {
            schema,
            retries: DEFAULT_RETRIES,
        }
        .with_retries(retries)
    }

    /// The same schema with `retries` instead, when given (0..=[`MAX_RETRIES`]).
    pub fn with_retries(self, retries: Option<u32>) -> Result<OutputContract, String> {
        let retries = retries.unwrap_or(self.retries);
        if retries > MAX_RETRIES {
            return Err(format!(
                "output_retries {retries} is out of range 0..={MAX_RETRIES}"
            ));
        }
        Ok(OutputContract { retries, ..self })
    }

    /// The `response_format` that asks an OpenAI-compatible provider for this schema. Not
    /// `strict`: strict mode accepts only a subset of JSON Schema, and the answer is validated
    /// here whatever the provider does.
    pub fn response_format(&self) -> Value {
        serde_json::json!({
            "type": "json_schema",
            "json_schema": {"name": "result", "schema": self.schema, "strict": false}
        })
    }
}

/// A schema built once per attempt, to check answers with.
pub struct Checker {
    validator: jsonschema::Validator,
}

impl std::fmt::Debug for Checker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Checker")
    }
}

impl Checker {
    /// Builds `schema`, or says why it cannot be one (too large, not a schema, a reference to
    /// something outside it, a pattern the linear-time engine cannot run).
    pub fn build(schema: &Value) -> Result<Checker, String> {
        if !matches!(schema, Value::Object(_) | Value::Bool(_)) {
            return Err("output_schema must be a JSON Schema: an object (or true/false)".into());
        }
        let size = serde_json::to_string(schema).map(|s| s.len()).unwrap_or(0);
        if size > MAX_SCHEMA_BYTES {
            return Err(format!(
                "output_schema is {size} bytes; the limit is {MAX_SCHEMA_BYTES}"
            ));
        }
        let validator = jsonschema::options()
            .offline()
            .with_pattern_options(jsonschema::PatternOptions::regex().size_limit(1 << 20))
            .build(schema)
            .map_err(|e| format!("output_schema is not a valid JSON Schema: {e}"))?;
        Ok(Checker { validator })
    }

    /// The answer as JSON its schema accepts, or what is wrong with it (each error with where
    /// in the answer it is).
    pub fn check(&self, answer: &str) -> Result<Value, Vec<String>> {
        let text = unfenced(answer);
        let value: Value = serde_json::from_str(text).map_err(|e| {
            vec![format!(
                "the answer is not JSON ({e}); answer with the JSON value alone"
            )]
        })?;
        let errors: Vec<String> = self
            .validator
            .iter_errors(&value)
            .take(MAX_ERRORS)
            .map(|e| {
                let at = e.instance_path().to_string();
                if at.is_empty() {
                    format!("at the top level: {e}")
                } else {
                    format!("at {at}: {e}")
                }
            })
            .collect();
        if errors.is_empty() {
            Ok(value)
        } else {
            Err(errors)
        }
    }
}

/// The text inside one Markdown code fence, when the whole answer is one (models often wrap
/// JSON in ```json … ```); otherwise the text, trimmed.
fn unfenced(answer: &str) -> &str {
    let t = answer.trim();
    let Some(rest) = t.strip_prefix("```") else {
        return t;
    };
    let Some(body) = rest.strip_suffix("```") else {
        return t;
    };
    // Drop the info string (`json`) on the opening line.
    match body.find('\n') {
        Some(nl) if !body[..nl].contains(['{', '[', '"']) => body[nl + 1..].trim(),
        _ => body.trim(),
    }
}

/// The message that sends an invalid answer back to the model.
pub fn feedback(errors: &[String], left: u32) -> String {
    let list: String = errors.iter().map(|e| format!("\n- {e}")).collect();
    format!(
        "{FEEDBACK_MARKER} Your final answer does not match the required JSON Schema:{list}\nAnswer again with only a JSON value that matches the schema ({left} more {} allowed).",
        if left == 1 { "try" } else { "tries" }
    )
}

/// Whether a user message is such a send-back (not a caller's message).
pub fn is_feedback(text: &str) -> bool {
    text.starts_with(FEEDBACK_MARKER)
}

/// The result of a succeeded run held to `contract`, as JSON (it was validated before it
/// committed, so it parses); `None` for runs without one.
pub fn result_json(contract: Option<&OutputContract>, result: Option<&str>) -> Option<Value> {
    contract?;
    serde_json::from_str(result?).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn person() -> Checker {
        Checker::build(&json!({
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
            "required": ["name", "age"],
            "additionalProperties": false
        }))
        .unwrap()
    }

    #[test]
    fn a_valid_answer_is_its_json_value_fenced_or_not() {
        let c = person();
        assert_eq!(
            c.check(r#"{"name": "Ada", "age": 36}"#).unwrap(),
            json!({"name": "Ada", "age": 36})
        );
        assert_eq!(
            c.check("```json\n{\"name\": \"Ada\", \"age\": 36}\n```")
                .unwrap(),
            json!({"name": "Ada", "age": 36})
        );
    }

    #[test]
    fn an_invalid_answer_says_where_and_what() {
        let c = person();
        let e = c.check(r#"{"name": 5, "age": -1, "x": 1}"#).unwrap_err();
        assert_eq!(e.len(), 3, "{e:?}");
        assert!(e.iter().any(|m| m.starts_with("at /name:")), "{e:?}");
        assert!(e.iter().any(|m| m.starts_with("at /age:")), "{e:?}");
        let e = c.check("Ada is 36").unwrap_err();
        assert!(e[0].contains("not JSON"), "{e:?}");
        let e = c.check("[]").unwrap_err();
        assert!(e[0].starts_with("at the top level"), "{e:?}");
    }

    #[test]
    fn schemas_that_cannot_be_built_are_refused_with_why() {
        assert!(Checker::build(&json!("object")).is_err());
        assert!(Checker::build(&json!({"type": "bogus"})).is_err());
        // Nothing is fetched: an outside reference does not resolve.
        assert!(Checker::build(&json!({"$ref": "https://example.com/s.json"})).is_err());
        assert!(Checker::build(&json!({"$ref": "file:///etc/passwd"})).is_err());
        // Look-around needs backtracking: the linear-time engine refuses it.
        assert!(Checker::build(&json!({"type": "string", "pattern": "(?=a)a"})).is_err());
        let big = json!({"description": "x".repeat(MAX_SCHEMA_BYTES)});
        assert!(Checker::build(&big).unwrap_err().contains("limit"));
        assert!(OutputContract::new(json!({}), Some(MAX_RETRIES + 1)).is_err());
        assert_eq!(OutputContract::new(json!({}), None).unwrap().retries, 2);
    }

    #[test]
    fn a_pattern_that_would_backtrack_runs_in_linear_time() {
        let c = Checker::build(&json!({"type": "string", "pattern": "^(a+)+$"})).unwrap();
        let evil = format!("\"{}!\"", "a".repeat(100_000));
        let t = std::time::Instant::now();
        assert!(c.check(&evil).is_err());
        // Generous: catastrophic backtracking would take far longer than a minute.
        assert!(t.elapsed() < std::time::Duration::from_secs(60));
    }

    #[test]
    fn feedback_is_marked_and_counts_down() {
        let f = feedback(&["at /a: wrong".into()], 1);
        assert!(is_feedback(&f));
        assert!(f.contains("- at /a: wrong") && f.contains("1 more try"));
        assert!(!is_feedback("please fix [subagents:output_invalid]"));
    }
}
