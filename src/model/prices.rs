//! What model calls cost: a price table (input and output dollars per million tokens) that turns
//! a call's usage into nano-dollars, committed with the call. Kept per call rather than derived
//! from a run's totals later, so a price change or a model switch mid-run never rewrites history.

use std::collections::BTreeMap;

use super::Usage;

/// Dollars per million tokens: fresh input, output, and the prompt cache's two rates.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Price {
    /// Per million prompt tokens not served from the cache.
    pub input: f64,
    /// Per million completion tokens.
    pub output: f64,
    /// Per million prompt tokens read from the provider's cache (Anthropic: 0.1× input; OpenAI:
    /// 0.1× to 0.5× depending on the model).
    pub cache_read: f64,
    /// Per million prompt tokens written to the cache (Anthropic's 5-minute cache: 1.25× input;
    /// OpenAI charges no surcharge: 1× input).
    pub cache_write: f64,
}

impl Price {
    /// A price whose cache rates are the input rate (no discount, no surcharge): what a model
    /// without known cache pricing costs.
    pub fn flat(input: f64, output: f64) -> Price {
        Price {
            input,
            output,
            cache_read: input,
            cache_write: input,
        }
    }

    /// Nano-dollars for `usage` (1 $/M tokens is 1,000 nano-dollars a token). The prompt's cached
    /// and cache-written tokens are priced at their own rates, the rest at the input rate.
    pub fn cost_nanos(&self, usage: &Usage) -> u64 {
        let fresh = usage
            .prompt_tokens
            .saturating_sub(usage.cache_read_tokens)
            .saturating_sub(usage.cache_write_tokens);
        let n = fresh as f64 * self.input * 1000.0
            + usage.cache_read_tokens as f64 * self.cache_read * 1000.0
            + usage.cache_write_tokens as f64 * self.cache_write * 1000.0
            + usage.completion_tokens as f64 * self.output * 1000.0;
        n.round().clamp(0.0, u64::MAX as f64) as u64
    }
}

/// List prices of common models (USD per million tokens, standard tier): input, output, cached
/// input read, cache write; matched by the longest prefix. Operators override or extend them with
/// `SUBAGENTS_PRICES`.
const BUILTIN: &[(&str, f64, f64, f64, f64)] = &[
    ("gpt-5", 1.25, 10.0, 0.125, 1.25),
    ("gpt-5-mini", 0.25, 2.0, 0.025, 0.25),
    ("gpt-5-nano", 0.05, 0.4, 0.005, 0.05),
    ("gpt-4.1", 2.0, 8.0, 0.5, 2.0),
    ("gpt-4.1-mini", 0.4, 1.6, 0.1, 0.4),
    ("gpt-4.1-nano", 0.1, 0.4, 0.025, 0.1),
    ("gpt-4o", 2.5, 10.0, 1.25, 2.5),
    ("gpt-4o-mini", 0.15, 0.6, 0.075, 0.15),
    ("o1", 15.0, 60.0, 7.5, 15.0),
    ("o3", 2.0, 8.0, 0.5, 2.0),
    ("o3-mini", 1.1, 4.4, 0.55, 1.1),
    ("o4-mini", 1.1, 4.4, 0.275, 1.1),
    ("claude-opus-4", 15.0, 75.0, 1.5, 18.75),
    ("claude-sonnet-4", 3.0, 15.0, 0.3, 3.75),
    ("claude-haiku-4", 1.0, 5.0, 0.1, 1.25),
    ("claude-3-5-haiku", 0.8, 4.0, 0.08, 1.0),
    ("claude-3-7-sonnet", 3.0, 15.0, 0.3, 3.75),
    ("gemini-2.5-pro", 1.25, 10.0, 0.31, 1.25),
    ("gemini-2.5-flash", 0.3, 2.5, 0.075, 0.3),
    ("deepseek-chat", 0.27, 1.1, 0.07, 0.27),
    ("deepseek-reasoner", 0.55, 2.19, 0.14, 0.55),
];

/// The price table: the operator's entries first (exact name, then longest prefix), then the
/// built-in list. A model found in neither has no price: its calls cost 0 and say so.
#[derive(Clone, Debug, Default)]
pub struct PriceTable {
    overrides: BTreeMap<String, Price>,
}

impl PriceTable {
    /// Parses `model=INPUT:OUTPUT[:CACHE_READ[:CACHE_WRITE]]` entries, comma-separated
    /// (`SUBAGENTS_PRICES`), in dollars per million tokens: `my-llama=0:0,claude-x=3:15:0.3:3.75`.
    /// A missing cache rate is the input rate.
    pub fn parse(spec: &str) -> Result<PriceTable, String> {
        let mut overrides = BTreeMap::new();
        for pair in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let bad = || {
                format!(
                    "`{pair}` is not `model=INPUT:OUTPUT[:CACHE_READ[:CACHE_WRITE]]` in dollars per million tokens (e.g. `gpt-4.1=2:8` or `claude-sonnet-4=3:15:0.3:3.75`)"
                )
            };
            let (name, figures) = pair.split_once('=').ok_or_else(bad)?;
            let parts: Vec<&str> = figures.split(':').collect();
            if !(2..=4).contains(&parts.len()) {
                return Err(bad());
            }
            let figures: Option<Vec<f64>> = parts
                .iter()
                .map(|x| {
                    x.trim()
                        .parse::<f64>()
                        .ok()
                        .filter(|v| v.is_finite() && (0.0..=100_000.0).contains(v))
                })
                .collect();
            let Some(f) = figures else {
                return Err(format!(
                    "the prices in `{pair}` must be numbers from 0 to 100000 (dollars per million tokens)"
                ));
            };
            if name.trim().is_empty() {
                return Err(bad());
            }
            let mut price = Price::flat(f[0], f[1]);
            if let Some(r) = f.get(2) {
                price.cache_read = *r;
            }
            if let Some(w) = f.get(3) {
                price.cache_write = *w;
            }
            overrides.insert(name.trim().to_owned(), price);
        }
        Ok(PriceTable { overrides })
    }

    /// Adds prices (the models table's) where the operator's list has none for that name.
    pub fn with_defaults(mut self, prices: Vec<(String, Price)>) -> PriceTable {
        for (name, p) in prices {
            self.overrides.entry(name).or_insert(p);
        }
        self
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
            .filter(|(n, ..)| bare.starts_with(n))
            .max_by_key(|(n, ..)| n.len())
            .map(|(_, input, output, cache_read, cache_write)| Price {
                input: *input,
                output: *output,
                cache_read: *cache_read,
                cache_write: *cache_write,
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
        assert_eq!(t.price("gpt-4.1-2025-04-14"), Some(Price::flat(1.0, 2.0)));
        // The built-in mini entry is longer than the override's prefix, but overrides come first.
        assert_eq!(t.price("gpt-4.1-mini"), Some(Price::flat(1.0, 2.0)));
        assert_eq!(
            t.price("gpt-4o-mini-2024"),
            Some(Price {
                input: 0.15,
                output: 0.6,
                cache_read: 0.075,
                cache_write: 0.15
            })
        );
        assert_eq!(
            t.price("openai/gpt-4o"),
            Some(Price {
                input: 2.5,
                output: 10.0,
                cache_read: 1.25,
                cache_write: 2.5
            })
        );
        assert_eq!(t.price("mine"), Some(Price::flat(0.0, 0.0)));
        assert_eq!(t.price("unknown-model"), None);
        let u = Usage {
            prompt_tokens: 1_000_000,
            completion_tokens: 500_000,
            ..Default::default()
        };
        assert_eq!(t.cost_nanos("gpt-4.1", &u), Some(2_000_000_000));
        assert_eq!(dollars(2_000_000_000), 2.0);
    }

    #[test]
    fn cached_prompt_tokens_cost_their_own_rates() {
        let t = PriceTable::parse("c=3:15:0.3:3.75, half=2:8:1").unwrap();
        // 1M prompt tokens: 800k read from the cache, 100k written, 100k fresh.
        let u = Usage {
            prompt_tokens: 1_000_000,
            cache_read_tokens: 800_000,
            cache_write_tokens: 100_000,
            ..Default::default()
        };
        // 0.1M x 3 + 0.8M x 0.3 + 0.1M x 3.75 = 0.3 + 0.24 + 0.375 dollars.
        assert_eq!(t.cost_nanos("c", &u), Some(915_000_000));
        let uncached = Usage {
            prompt_tokens: 1_000_000,
            ..Default::default()
        };
        assert_eq!(t.cost_nanos("c", &uncached), Some(3_000_000_000));
        assert_eq!(
            t.price("half"),
            Some(Price {
                input: 2.0,
                output: 8.0,
                cache_read: 1.0,
                cache_write: 2.0
            })
        );
        let sonnet = t.price("claude-sonnet-4-5").unwrap();
        assert_eq!((sonnet.cache_read, sonnet.cache_write), (0.3, 3.75));
    }

    #[test]
    fn nonsense_is_refused_with_the_reason() {
        for bad in [
            "gpt-4.1",
            "gpt-4.1=2",
            "x=a:b",
            "x=-1:2",
            "=1:2",
            "x=1:NaN",
            "x=1:2:3:4:5",
            "x=1:2:-1",
        ] {
            assert!(PriceTable::parse(bad).is_err(), "{bad}");
        }
    }
}
