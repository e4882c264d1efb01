//! Token counting that matches the model, and what the model can hold.
//!
//! - [`Counter`] counts a chat request the way OpenAI's published recipe does (tiktoken's
//!   chat format: 3 tokens of framing per message, the role, the content, 3 to prime the
//!   reply), plus what the recipe leaves out: tool calls, tool results and the tool schemas.
//!   The encoding follows the model name: `o200k_base` for gpt-4o, gpt-4.1, the o-series and
//!   newer (and for names tiktoken does not know), `cl100k_base` for gpt-4 and gpt-3.5.
//! - [`Calibration`] keeps, per model, the ratio between what the provider reported as
//!   `prompt_tokens` and what we estimated, so a model with another tokenizer (a local Llama,
//!   Claude behind a proxy) is still estimated within a few percent after its first call.
//! - [`ModelTable`] knows the context window and largest output of common models; operators
//!   override it (`SUBAGENTS_CONTEXT_WINDOWS`), agents override it (`context_window:`), and
//!   unknown models get a configurable default.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use tiktoken_rs::CoreBPE;
use tiktoken_rs::tokenizer::Tokenizer;

use super::{Message, ToolSpec};

/// Framing tokens of every message (`<|start|>{role}<|message|>…<|end|>`), per the recipe.
const PER_MESSAGE: usize = 3;
/// Priming of the reply (`<|start|>assistant<|message|>`), once per request.
pub const REPLY_PRIMING: usize = 3;
/// Framing of one tool call inside an assistant message (beyond its id, name and arguments).
const PER_TOOL_CALL: usize = 3;
/// Framing of one tool schema in the request's tool list.
const PER_TOOL_SPEC: usize = 8;
/// Framing of the tool list as a whole.
const TOOLS_OVERHEAD: usize = 12;

/// A tokenizer for one model.
#[derive(Clone, Copy)]
pub struct Counter {
    bpe: &'static CoreBPE,
    /// Which encoding: `o200k_base` or `cl100k_base`.
    pub encoding: &'static str,
}

impl std::fmt::Debug for Counter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Counter")
            .field("encoding", &self.encoding)
            .finish()
    }
}

impl Counter {
    /// The counter for `model`: its own encoding where tiktoken knows the name, `o200k_base`
    /// otherwise (the encoding of every current OpenAI model; for other families the
    /// [`Calibration`] ratio corrects the difference).
    pub fn for_model(model: &str) -> Counter {
        Counter::encoding(matches!(
            tiktoken_rs::tokenizer::get_tokenizer(model),
            Some(Tokenizer::Cl100kBase)
        ))
    }

    /// `cl100k_base` when `cl100k`, else `o200k_base` (the mock picks by OpenAI's own rule).
    pub(crate) fn encoding(cl100k: bool) -> Counter {
        match cl100k {
            true => Counter {
                bpe: tiktoken_rs::cl100k_base_singleton(),
                encoding: "cl100k_base",
            },
            false => Counter {
                bpe: tiktoken_rs::o200k_base_singleton(),
                encoding: "o200k_base",
            },
        }
    }

    /// Loads both encodings' tables now (they load lazily otherwise, on the first count).
    pub fn warm(model: &str) {
        Counter::for_model(model).text("warm");
        Counter::for_model("gpt-4o").text("warm");
    }

    /// Tokens of a text.
    pub fn text(&self, text: &str) -> usize {
        self.bpe.count_with_special_tokens(text)
    }

    /// Tokens of a text that recurs (a system prompt, a tool's schema; for the mock, every
    /// message a run sends again at each step), looked up in a process-wide table after the
    /// first count: a short run would otherwise spend a good part of its CPU tokenizing the
    /// same schemas at every start (seen: an eighth of a worker's CPU on one-step runs), and
    /// the mock a third of its own re-tokenizing conversations.
    pub(crate) fn remembered(&self, text: &str) -> usize {
        use std::hash::{Hash, Hasher};
        /// The encoding's name, the text's hash and its length.
        type Key = (&'static str, u64, usize);
        static SEEN: Mutex<Option<HashMap<Key, usize>>> = Mutex::new(None);
        let mut h = std::collections::hash_map::DefaultHasher::new();
        text.hash(&mut h);
        let key = (self.encoding, h.finish(), text.len());
        if let Some(n) = SEEN.lock().unwrap().as_ref().and_then(|m| m.get(&key)) {
            return *n;
        }
        let n = self.text(text);
        let mut seen = SEEN.lock().unwrap();
        let map = seen.get_or_insert_with(HashMap::new);
        if map.len() >= 16_384 {
            map.clear();
        }
        map.insert(key, n);
        n
    }

    /// Tokens one message adds to a request, framing included.
    pub fn message(&self, m: &Message) -> usize {
        PER_MESSAGE
            + self.text(m.role())
            + match m {
                Message::System { content } => self.remembered(content),
                Message::User { content } => self.text(content),
                Message::Assistant {
                    content,
                    tool_calls,
                    ..
                } => {
                    content.as_deref().map_or(0, |c| self.text(c))
                        + tool_calls
                            .iter()
                            .map(|c| {
                                PER_TOOL_CALL
                                    + self.text(&c.function.name)
                                    + self.text(&c.function.arguments)
                                    + self.text(&c.id)
                            })
                            .sum::<usize>()
                }
                Message::Tool { content, .. } => self.text(content),
            }
    }

    /// Tokens the tool schemas add to a request.
    pub fn tools(&self, tools: &[ToolSpec]) -> usize {
        if tools.is_empty() {
            return 0;
        }
        TOOLS_OVERHEAD
            + tools
                .iter()
                .map(|t| {
                    PER_TOOL_SPEC
                        + self.text(&t.function.name)
                        + self.remembered(&t.function.description)
                        + self.remembered(&t.function.parameters.to_string())
                })
                .sum::<usize>()
    }

    /// Tokens of a whole request: its messages, its tools, and the reply priming.
    pub fn request(&self, messages: &[Message], tools: &[ToolSpec]) -> usize {
        messages.iter().map(|m| self.message(m)).sum::<usize>() + self.tools(tools) + REPLY_PRIMING
    }

    /// The longest prefix of `text` (cut at a line end where one is near) that holds at most
    /// `tokens` tokens, and whether it is the whole text.
    pub fn head<'a>(&self, text: &'a str, tokens: usize) -> (&'a str, bool) {
        if text.len() <= tokens {
            // A token is at least one byte.
            return (text, true);
        }
        // Bytes per token vary (about 4 in English, less in code); search the cut by halving.
        let (mut lo, mut hi) = (0usize, text.len());
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            let mut cut = mid;
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            if self.text(&text[..cut]) <= tokens {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        let mut cut = lo;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        if cut == text.len() {
            return (text, true);
        }
        let head = &text[..cut];
        // Prefer a whole line when the last line break is not far back.
        let at = match head.rfind('\n') {
            Some(nl) if nl + 1 >= cut.saturating_sub(400) && nl > 0 => nl + 1,
            _ => cut,
        };
        (&text[..at], false)
    }
}

/// Per model, the ratio of the provider's reported `prompt_tokens` to our estimate, smoothed
/// over calls. Starts at 1.
#[derive(Debug, Default)]
pub struct Calibration {
    ratios: Mutex<HashMap<String, f64>>,
    windows: Mutex<HashMap<String, u64>>,
}

impl Calibration {
    /// Records one call: we estimated `estimated`, the provider counted `reported`.
    pub fn observe(&self, model: &str, estimated: usize, reported: u64) {
        if estimated < 16 || reported == 0 {
            return;
        }
        let sample = (reported as f64 / estimated as f64).clamp(0.25, 4.0);
        let mut r = self.ratios.lock().unwrap();
        let e = r.entry(model.to_owned()).or_insert(sample);
        // Smoothed, so one odd response does not swing the estimate.
        *e = 0.7 * *e + 0.3 * sample;
    }

    /// Remembers that `model` holds at most `window` tokens (the provider said so).
    pub fn learn_window(&self, model: &str, window: u64) {
        let mut w = self.windows.lock().unwrap();
        let e = w.entry(model.to_owned()).or_insert(window);
        *e = (*e).min(window);
    }

    /// The window the provider taught us for `model`, if it refused a request.
    pub fn learned_window(&self, model: &str) -> Option<u64> {
        self.windows.lock().unwrap().get(model).copied()
    }

    /// The current ratio for `model` (1 before its first call).
    pub fn ratio(&self, model: &str) -> f64 {
        self.ratios
            .lock()
            .unwrap()
            .get(model)
            .copied()
            .unwrap_or(1.0)
    }

    /// `estimated` corrected by the model's ratio.
    pub fn scale(&self, model: &str, estimated: usize) -> usize {
        (estimated as f64 * self.ratio(model)).ceil() as usize
    }
}

/// What a model can hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    /// Tokens of a whole request plus its answer.
    pub context: u64,
    /// Tokens the model may answer with.
    pub max_output: u64,
}

/// Context windows of common models, by name prefix (longest prefix wins). The figures are the
/// providers' published limits; operators override them (`SUBAGENTS_CONTEXT_WINDOWS`).
const BUILTIN: &[(&str, u64, u64)] = &[
    ("gpt-3.5-turbo", 16_385, 4_096),
    ("gpt-4", 8_192, 8_192),
    ("gpt-4-32k", 32_768, 8_192),
    ("gpt-4-turbo", 128_000, 4_096),
    ("gpt-4o", 128_000, 16_384),
    ("chatgpt-4o", 128_000, 16_384),
    ("gpt-4.1", 1_047_576, 32_768),
    ("gpt-4.5", 128_000, 16_384),
    ("gpt-5", 400_000, 128_000),
    ("gpt-oss", 131_072, 32_768),
    ("o1", 200_000, 100_000),
    ("o1-mini", 128_000, 65_536),
    ("o3", 200_000, 100_000),
    ("o4-mini", 200_000, 100_000),
    ("claude-3", 200_000, 4_096),
    ("claude-3-5", 200_000, 8_192),
    ("claude-3-7", 200_000, 64_000),
    ("claude-sonnet-4", 200_000, 64_000),
    ("claude-opus-4", 200_000, 32_000),
    ("claude-haiku-4", 200_000, 64_000),
    ("gemini-1.5", 1_048_576, 8_192),
    ("gemini-2", 1_048_576, 65_536),
    ("llama-3.1", 131_072, 8_192),
    ("llama-3.3", 131_072, 8_192),
    ("qwen2.5", 32_768, 8_192),
    ("qwen3", 131_072, 32_768),
    ("mistral-large", 131_072, 8_192),
    ("deepseek-chat", 65_536, 8_192),
    ("deepseek-reasoner", 65_536, 32_768),
];

/// The model table: built-in figures, the operator's overrides, and a default for the rest.
#[derive(Clone, Debug)]
pub struct ModelTable {
    overrides: BTreeMap<String, Window>,
    default: Window,
}

impl ModelTable {
    /// The built-in table with `overrides` (exact names or prefixes) and `default_window` for
    /// unknown models.
    pub fn new(overrides: BTreeMap<String, Window>, default_window: u64) -> ModelTable {
        let default = Window {
            context: default_window,
            max_output: (default_window / 8).clamp(256, 16_384),
        };
        ModelTable { overrides, default }
    }

    /// Parses `name=WINDOW[:MAX_OUTPUT]` pairs (comma-separated), as `SUBAGENTS_CONTEXT_WINDOWS`.
    pub fn parse_overrides(spec: &str) -> Result<BTreeMap<String, Window>, String> {
        let mut out = BTreeMap::new();
        for pair in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (name, figures) = pair
                .split_once('=')
                .ok_or_else(|| format!("`{pair}` is not `model=window` (e.g. `my-llama=32768` or `my-llama=32768:4096`)"))?;
            let (window, output) = match figures.split_once(':') {
                Some((w, o)) => (w, Some(o)),
                None => (figures, None),
            };
            let window: u64 = window
                .trim()
                .parse()
                .ok()
                .filter(|w| (1024..=100_000_000).contains(w))
                .ok_or_else(|| format!("the window in `{pair}` must be a whole number of tokens from 1024 to 100000000"))?;
            let max_output = match output {
                Some(o) => o
                    .trim()
                    .parse()
                    .ok()
                    .filter(|o| *o > 0 && *o < window)
                    .ok_or_else(|| {
                        format!("the max output in `{pair}` must be below the window")
                    })?,
                None => (window / 8).clamp(256, 16_384),
            };
            out.insert(
                name.trim().to_owned(),
                Window {
                    context: window,
                    max_output,
                },
            );
        }
        Ok(out)
    }

    /// What `model` can hold, and whether the figure is known (not the default).
    pub fn window(&self, model: &str) -> (Window, bool) {
        let longest = |names: &mut dyn Iterator<Item = (&str, Window)>| {
            names
                .filter(|(n, _)| model.starts_with(n))
                .max_by_key(|(n, _)| n.len())
                .map(|(_, w)| w)
        };
        if let Some(w) = self.overrides.get(model) {
            return (*w, true);
        }
        if let Some(w) = longest(&mut self.overrides.iter().map(|(n, w)| (n.as_str(), *w))) {
            return (w, true);
        }
        // Routers prefix names with the provider (`openai/gpt-4o`); the model is the last part.
        let bare = model.rsplit('/').next().unwrap_or(model);
        let builtin = BUILTIN
            .iter()
            .filter(|(n, _, _)| bare.starts_with(n))
            .max_by_key(|(n, _, _)| n.len());
        match builtin {
            Some((_, context, max_output)) => (
                Window {
                    context: *context,
                    max_output: *max_output,
                },
                true,
            ),
            None => (self.default, false),
        }
    }
}

impl Default for ModelTable {
    fn default() -> Self {
        ModelTable::new(BTreeMap::new(), 128_000)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{FunctionCall, FunctionSpec, ToolCall};

    #[test]
    fn encodings_follow_the_model() {
        assert_eq!(Counter::for_model("gpt-4o-mini").encoding, "o200k_base");
        assert_eq!(Counter::for_model("gpt-4-0613").encoding, "cl100k_base");
        assert_eq!(Counter::for_model("gpt-3.5-turbo").encoding, "cl100k_base");
        assert_eq!(
            Counter::for_model("some-local-llama").encoding,
            "o200k_base"
        );
        let c = Counter::for_model("gpt-4o");
        assert_eq!(c.text("hello world"), 2);
    }

    /// A fixed set of requests, counted by tiktoken's own implementation of OpenAI's published
    /// chat-format recipe (`num_tokens_from_messages`) and by ours: within 2 %.
    #[test]
    fn counts_match_the_published_recipe_within_two_percent() {
        let prose = "The quick brown fox jumps over the lazy dog; then it reads `src/main.rs` and reports 42 findings. ";
        let code = "fn main() {\n    let x: Vec<u32> = (0..10).map(|i| i * 2).collect();\n    println!(\"{x:?}\");\n}\n";
        let call = |name: &str, args: &str| ToolCall {
            id: "call_abc123".into(),
            kind: "function".into(),
            function: FunctionCall {
                name: name.into(),
                arguments: args.into(),
            },
        };
        let requests: Vec<(&str, Vec<Message>)> = vec![
            ("gpt-4o", vec![Message::System { content: "You are a careful research agent.".repeat(3) }, Message::User { content: prose.repeat(20) }]),
            ("gpt-4o-mini", vec![
                Message::System { content: "Answer briefly.".into() },
                Message::User { content: prose.repeat(5) },
                Message::Assistant { content: Some(prose.repeat(8)), tool_calls: vec![], thinking: vec![] },
                Message::User { content: "And the code?".into() },
                Message::Assistant { content: Some(code.repeat(6)), tool_calls: vec![], thinking: vec![] },
            ]),
            ("gpt-4-0613", vec![Message::System { content: code.repeat(10) }, Message::User { content: prose.repeat(12) }]),
            ("gpt-4.1", vec![
                Message::User { content: prose.repeat(4) },
                Message::Assistant { content: None, tool_calls: vec![call("grep", r#"{"pattern":"RETRIES","path":"src"}"#)], thinking: vec![] },
                Message::Tool { tool_call_id: "call_abc123".into(), content: code.repeat(15) },
                Message::Assistant { content: Some(prose.repeat(3)), tool_calls: vec![], thinking: vec![] },
            ]),
            ("o3-mini", vec![Message::User { content: "é日本語 mixed text, with numbers 1234567 and URLs https://example.com/a?b=c ".repeat(30) }]),
        ];
        for (model, messages) in requests {
            let reference: Vec<tiktoken_rs::ChatCompletionRequestMessage> = messages
                .iter()
                .map(|m| tiktoken_rs::ChatCompletionRequestMessage {
                    role: m.role().into(),
                    content: match m {
                        Message::System { content }
                        | Message::User { content }
                        | Message::Tool { content, .. } => Some(content.clone()),
                        Message::Assistant { content, .. } => content.clone(),
                    },
                    tool_calls: match m {
                        Message::Assistant { tool_calls, .. } => tool_calls
                            .iter()
                            .map(|c| tiktoken_rs::FunctionCall {
                                name: c.function.name.clone(),
                                arguments: c.function.arguments.clone(),
                            })
                            .collect(),
                        _ => vec![],
                    },
                    ..Default::default()
                })
                .collect();
            let want = tiktoken_rs::num_tokens_from_messages(model, &reference).unwrap() as f64;
            let got = Counter::for_model(model).request(&messages, &[]) as f64;
            let off = (got - want).abs() / want;
            assert!(
                off <= 0.02,
                "{model}: ours {got}, the recipe {want} ({:.2} %)",
                off * 100.0
            );
        }
    }

    #[test]
    fn tool_calls_results_and_schemas_count() {
        let c = Counter::for_model("gpt-4o");
        let plain = c.request(
            &[Message::User {
                content: "hi".into(),
            }],
            &[],
        );
        assert_eq!(plain, PER_MESSAGE + 1 + 1 + REPLY_PRIMING);
        let call = Message::Assistant {
            content: None,
            tool_calls: vec![ToolCall {
                id: "c1".into(),
                kind: "function".into(),
                function: FunctionCall {
                    name: "grep".into(),
                    arguments: r#"{"pattern":"fn main"}"#.into(),
                },
            }],
            thinking: vec![],
        };
        assert!(c.message(&call) > PER_MESSAGE + PER_TOOL_CALL);
        let spec = ToolSpec {
            kind: "function".into(),
            function: FunctionSpec {
                name: "grep".into(),
                description: "Search files".into(),
                parameters: serde_json::json!({"type":"object"}),
            },
        };
        assert!(c.tools(&[spec]) > TOOLS_OVERHEAD + PER_TOOL_SPEC);
    }

    #[test]
    fn heads_stay_within_their_tokens() {
        let c = Counter::for_model("gpt-4o");
        let text: String = (0..2000)
            .map(|i| format!("line {i}: the quick brown fox\n"))
            .collect();
        let (head, whole) = c.head(&text, 300);
        assert!(!whole);
        assert!(c.text(head) <= 300, "{}", c.text(head));
        assert!(c.text(head) > 250, "{}", c.text(head));
        assert!(head.ends_with('\n'));
        assert_eq!(c.head("short", 300), ("short", true));
        let accents = "é".repeat(5000);
        let (h, whole) = c.head(&accents, 100);
        assert!(!whole && c.text(h) <= 100);
    }

    #[test]
    fn calibration_moves_towards_the_provider() {
        let cal = Calibration::default();
        assert_eq!(cal.scale("m", 1000), 1000);
        for _ in 0..20 {
            cal.observe("m", 1000, 1200);
        }
        assert!((cal.ratio("m") - 1.2).abs() < 0.01);
        assert_eq!(cal.ratio("other"), 1.0);
        cal.learn_window("m", 8000);
        cal.learn_window("m", 9000);
        assert_eq!(cal.learned_window("m"), Some(8000));
        assert_eq!(cal.learned_window("other"), None);
    }

    #[test]
    fn the_table_knows_common_models_and_takes_overrides() {
        let t = ModelTable::default();
        assert_eq!(t.window("gpt-4o-2024-08-06").0.context, 128_000);
        assert_eq!(t.window("gpt-4-0613").0.context, 8_192);
        assert_eq!(t.window("openai/gpt-4.1-mini").0.context, 1_047_576);
        assert_eq!(
            t.window("unknown-model"),
            (
                Window {
                    context: 128_000,
                    max_output: 16_000
                },
                false
            )
        );
        let o = ModelTable::parse_overrides("my-llama=32768:4096, gpt-4o=64000").unwrap();
        let t = ModelTable::new(o, 32_000);
        assert_eq!(
            t.window("my-llama-8b").0,
            Window {
                context: 32_768,
                max_output: 4_096
            }
        );
        assert_eq!(t.window("gpt-4o").0.context, 64_000);
        assert_eq!(t.window("nope").0.context, 32_000);
        assert!(
            ModelTable::parse_overrides("x=12")
                .unwrap_err()
                .contains("1024")
        );
        assert!(
            ModelTable::parse_overrides("x")
                .unwrap_err()
                .contains("model=window")
        );
    }
}
