//! What model calls cost: a price table (input and output dollars per million tokens) that turns
//! a call's usage into nano-dollars, committed with the call. Kept per call rather than derived
//! from a run's totals later, so a price change or a model switch mid-run never rewrites history.

use std::collections::BTreeMap;

use super::Usage;

/// Dollars per million tokens, input and output.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Price {
    /// Per million prompt tokens.
    pub input: f64,
    /// Per million completion tokens.
    pub output: f64,
}

impl Price {
    /// Nano-dollars for `usage` (1 $/M tokens is 1,000 nano-dollars a token).
    pub fn cost_nanos(&self, usage: &Usage) -> u64 {
        let n = usage.prompt_tokens as f64 * self.input * 1000.0
            + usage.completion_tokens as f64 * self.output * 1000.0;
        n.round().clamp(0.0, u64::MAX as f64) as u64
    }
}

/// List prices of common models (USD per million tokens, standard tier, no caching discount),
/// matched by the longest prefix. Operators override or extend them with `SUBAGENTS_PRICES`.
const BUILTIN: &[(&str, f64, f64)] = &[
    ("gpt-5", 1.25, 10.0),
    ("gpt-5-mini", 0.25, 2.0),
    ("gpt-5-nano", 0.05, 0.4),
    ("gpt-4.1", 2.0, 8.0),
    ("gpt-4.1-mini", 0.4, 1.6),
    ("gpt-4.1-nano", 0.1, 0.4),
    ("gpt-4o", 2.5, 10.0),
    ("gpt-4o-mini", 0.15, 0.6),
    ("o1", 15.0, 60.0),
    ("o3", 2.0, 8.0),
    ("o3-mini", 1.1, 4.4),
    ("o4-mini", 1.1, 4.4),
    ("claude-opus-4", 15.0, 75.0),
    ("claude-sonnet-4", 3.0, 15.0),
    ("claude-haiku-4", 1.0, 5.0),
    ("claude-3-5-haiku", 0.8, 4.0),
    ("claude-3-7-sonnet", 3.0, 15.0),
    ("gemini-2.5-pro", 1.25, 10.0),
    ("gemini-2.5-flash", 0.3, 2.5),
    ("deepseek-chat", 0.27, 1.1),
    ("deepseek-reasoner", 0.55, 2.19),
];

/// The price table: the operator's entries first (exact name, then longest prefix), then the
/// built-in list. A model found in neither has no price: its calls cost 0 and say so.
#[derive(Clone, Debug, Default)]
pub struct PriceTable {
    overrides: BTreeMap<String, Price>,
}

impl PriceTable {
    /// Parses `model=INPUT:OUTPUT` pairs, comma-separated (`SUBAGENTS_PRICES`), in dollars per
    /// million tokens: `my-llama=0:0,gpt-4.1=1.5:6`.
    pub fn parse(spec: &str) -> Result<PriceTable, String> {
        let mut overrides = BTreeMap::new();
        for pair in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let bad = || {
                format!(
                    "`{pair}` is not `model=INPUT:OUTPUT` in dollars per million tokens (e.g. `gpt-4.1=2:8`)"
                )
            };
            let (name, figures) = pair.split_once('=').ok_or_else(bad)?;
            let (i, o) = figures.split_once(':').ok_or_else(bad)?;
            let parse = |x: &str| {
                x.trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|v| v.is_finite() && (0.0..=100_000.0).contains(v))
            };
            let (Some(input), Some(output)) = (parse(i), parse(o)) else {
                return Err(format!(
                    "the prices in `{pair}` must be numbers from 0 to 100000 (dollars per million tokens)"
                ));
            };
            if name.trim().is_empty() {
                return Err(bad());
            }
            overrides.insert(name.trim().to_owned(), Price { input, output });
        }
        Ok(PriceTable { overrides })
    }

    /// The price of `model`, if known.
    pub fn price(&self, model: &str) -> Option<Price> {
        if let Some(p) = self.overrides.get(model) {
            return Some(*p);
        }
        if let Some((_, p)) = self
            .overrides
            .iter()
            .filter(|(n, _)| model.starts_with(n.as_str()))
            .max_by_key(|(n, _)| n.len())
        {
            return Some(*p);
        }
        // Routers prefix names with the provider (`openai/gpt-4o`); the model is the last part.
        let bare = model.rsplit('/').next().unwrap_or(model);
        BUILTIN
            .iter()
            .filter(|(n, _, _)| bare.starts_with(n))
            .max_by_key(|(n, _, _)| n.len())
            .map(|(_, input, output)| Price {
                input: *input,
                output: *output,
            })
    }

    /// Nano-dollars of one call, `None` when the model has no price.
    pub fn cost_nanos(&self, model: &str, usage: &Usage) -> Option<u64> {
        self.price(model).map(|p| p.cost_nanos(usage))
    }
}

/// Dollars from nano-dollars, for views.
pub fn dollars(nanos: u64) -> f64 {
    nanos as f64 / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_prefix_wins_and_overrides_come_first() {
        let t = PriceTable::parse("gpt-4.1=1:2, mine=0:0").unwrap();
        assert_eq!(
            t.price("gpt-4.1-2025-04-14"),
            Some(Price {
                input: 1.0,
                output: 2.0
            })
        );
        // The built-in mini entry is longer than the override's prefix, but overrides come first.
        assert_eq!(
            t.price("gpt-4.1-mini"),
            Some(Price {
                input: 1.0,
                output: 2.0
            })
        );
        assert_eq!(
            t.price("gpt-4o-mini-2024"),
            Some(Price {
                input: 0.15,
                output: 0.6
            })
        );
        assert_eq!(
            t.price("openai/gpt-4o"),
            Some(Price {
                input: 2.5,
                output: 10.0
            })
        );
        assert_eq!(
            t.price("mine"),
            Some(Price {
                input: 0.0,
                output: 0.0
            })
        );
        assert_eq!(t.price("unknown-model"), None);
        let u = Usage {
            prompt_tokens: 1_000_000,
            completion_tokens: 500_000,
        };
        assert_eq!(t.cost_nanos("gpt-4.1", &u), Some(2_000_000_000));
        assert_eq!(dollars(2_000_000_000), 2.0);
    }

    #[test]
    fn nonsense_is_refused_with_the_reason() {
        for bad in ["gpt-4.1", "gpt-4.1=2", "x=a:b", "x=-1:2", "=1:2", "x=1:NaN"] {
            assert!(PriceTable::parse(bad).is_err(), "{bad}");
        }
    }
}
