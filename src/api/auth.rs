//! Owners and keys. Every request carries `Authorization: Bearer KEY`; a key maps to an owner,
//! and an owner sees only its own threads and runs. Only SHA-256 hashes of keys are kept.
//! Without configured keys the server is local-only (bound to 127.0.0.1) and every request
//! belongs to the owner `local`.

use std::collections::HashMap;
use std::path::Path;

use axum::extract::FromRequestParts;
use axum::http::StatusCode;
use axum::http::request::Parts;
use sha2::{Digest, Sha256};

use super::{ApiError, ApiState};
use crate::ids::OwnerId;

/// Key hashes to owners.
#[derive(Clone, Debug, Default)]
pub struct Keys {
    by_hash: HashMap<[u8; 32], OwnerId>,
    /// Owners' own concurrency limits from the keys file (`concurrency=N`).
    limits: std::collections::BTreeMap<String, u32>,
    /// Owners' own model budgets from the keys file (`rpm=N`, `tpm=N`).
    budgets: std::collections::BTreeMap<String, crate::store::OwnerBudget>,
    /// Owners marked `admin` in the keys file: operators who may look at every owner's runs.
    admins: std::collections::BTreeSet<String>,
}

fn hash(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

impl Keys {
    /// True when no key is configured (local mode).
    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }

    /// Adds `owner:key` pairs from a comma-separated list (`SUBAGENTS_API_KEYS`).
    pub fn add_pairs(&mut self, list: &str) -> Result<(), String> {
        for pair in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (owner, key) = pair.split_once(':').ok_or_else(|| {
                "SUBAGENTS_API_KEYS must be owner:key pairs separated by commas".to_owned()
            })?;
            if owner.is_empty() || key.len() < 8 {
                return Err(format!(
                    "bad entry for owner `{owner}`: owners must be named and keys at least 8 characters"
                ));
            }
            self.by_hash.insert(hash(key), owner.into());
        }
        Ok(())
    }

    /// The owners' concurrency limits, as `owner:<name>` limit keys: what the keys file sets,
    /// and `default` (0: none) for every other owner with a key, so that no key can hold every
    /// worker of the fleet.
    pub fn owner_limits(&self, default: u32) -> Vec<(String, u32)> {
        let mut out: std::collections::BTreeMap<&str, u32> = std::collections::BTreeMap::new();
        if default > 0 {
            for o in self.by_hash.values() {
                out.insert(o.as_str(), default);
            }
        }
        out.extend(self.limits.iter().map(|(o, n)| (o.as_str(), *n)));
        out.into_iter()
            .map(|(o, n)| (format!("owner:{o}"), n))
            .collect()
    }

    /// Whether `owner` is an operator (`admin` on its line of the keys file): it may list and
    /// open every owner's runs and threads; approvals stay their owner's.
    pub fn is_admin(&self, owner: &OwnerId) -> bool {
        self.admins.contains(owner.as_str())
    }

    /// The owners' model budgets the keys file sets.
    pub fn owner_budgets(&self) -> Vec<(OwnerId, crate::store::OwnerBudget)> {
        self.budgets
            .iter()
            .map(|(o, b)| (o.as_str().into(), *b))
            .collect()
    }

    /// Adds entries from a keys file: one `owner sha256-hex-of-key [concurrency=N] [rpm=N]
    /// [tpm=N] [admin]` per line, `#` comments.
    pub fn add_file(&mut self, path: &Path) -> Result<(), String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read keys file {}: {e}", path.display()))?;
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let bad = || {
                format!(
                    "{}:{}: expected `owner <sha256 hex of the key> [concurrency=N] [rpm=N] [tpm=N] [admin]`",
                    path.display(),
                    i + 1
                )
            };
            let mut words = line.split_whitespace();
            let (Some(owner), Some(hex)) = (words.next(), words.next()) else {
                return Err(bad());
            };
            for extra in words {
                let (name, value) = extra.split_once('=').unwrap_or((extra, ""));
                let refuse = |range: &str| {
                    Err(format!(
                        "{}:{}: `{extra}` is not `{name}=N` (N from {range})",
                        path.display(),
                        i + 1
                    ))
                };
                match name {
                    "admin" if value.is_empty() => {
                        self.admins.insert(owner.to_owned());
                    }
                    "concurrency" => match value
                        .parse::<u32>()
                        .ok()
                        .filter(|n| (1..=100_000).contains(n))
                    {
                        Some(n) => {
                            self.limits.insert(owner.to_owned(), n);
                        }
                        None => return refuse("1 to 100000"),
                    },
                    "rpm" | "tpm" => match value.parse::<u64>().ok().filter(|n| *n > 0) {
                        Some(n) => {
                            let b = self.budgets.entry(owner.to_owned()).or_default();
                            if name == "rpm" {
                                b.rpm = Some(n)
                            } else {
                                b.tpm = Some(n)
                            }
                        }
                        None => return refuse("1 up"),
                    },
                    _ => {
                        return Err(format!(
                            "{}:{}: `{extra}` is not one of concurrency=N, rpm=N, tpm=N, admin",
                            path.display(),
                            i + 1
                        ));
                    }
                }
            }
            if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(bad());
            }
            let mut h = [0u8; 32];
            for (j, b) in h.iter_mut().enumerate() {
                *b = u8::from_str_radix(&hex[j * 2..j * 2 + 2], 16).map_err(|_| bad())?;
            }
            self.by_hash.insert(h, owner.into());
        }
        Ok(())
    }

    /// Every owner with a key.
    pub fn owners(&self) -> impl Iterator<Item = &OwnerId> {
        let mut all: Vec<&OwnerId> = self.by_hash.values().collect();
        all.sort_unstable();
        all.dedup();
        all.into_iter()
    }

    /// The owner of a presented key.
    pub fn owner_of(&self, key: &str) -> Option<&OwnerId> {
        self.by_hash.get(&hash(key))
    }
}

/// The authenticated owner of a request.
#[derive(Clone, Debug)]
pub struct Owner(pub OwnerId);

impl FromRequestParts<ApiState> for Owner {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &ApiState) -> Result<Self, ApiError> {
        if state.keys.is_empty() {
            return Ok(Owner(OwnerId::local()));
        }
        let unauthorized = |m: &str| ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", m);
        let header = parts
            .headers
            .get(axum::http::header::AUTHORIZATION)
            .ok_or_else(|| unauthorized("send Authorization: Bearer <key>"))?;
        let value = header
            .to_str()
            .map_err(|_| unauthorized("the Authorization header is not text"))?;
        let key = value
            .strip_prefix("Bearer ")
            .ok_or_else(|| unauthorized("use the Bearer scheme: Authorization: Bearer <key>"))?;
        state
            .keys
            .owner_of(key.trim())
            .map(|o| Owner(o.clone()))
            .ok_or_else(|| unauthorized("unknown key"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_files_carry_limits_and_budgets_and_refuse_nonsense() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys");
        let hex = "ab".repeat(32);
        std::fs::write(
            &path,
            format!("# owners\nacme {hex} concurrency=4 rpm=500 tpm=200000\nsolo {hex}2 admin\n")
                .replace(&format!("{hex}2"), &"cd".repeat(32)),
        )
        .unwrap();
        let mut keys = Keys::default();
        keys.add_file(&path).unwrap();
        assert_eq!(keys.owner_limits(0), [("owner:acme".to_owned(), 4)]);
        // Every other keyed owner gets the default; the file's own limit wins.
        assert_eq!(
            keys.owner_limits(32),
            [("owner:acme".to_owned(), 4), ("owner:solo".to_owned(), 32)]
        );
        assert_eq!(
            keys.owner_budgets(),
            [(
                "acme".into(),
                crate::store::OwnerBudget {
                    rpm: Some(500),
                    tpm: Some(200_000)
                }
            )]
        );
        assert!(keys.is_admin(&"solo".into()) && !keys.is_admin(&"acme".into()));
        for (line, says) in [
            (
                format!("acme {hex} rpm=0"),
                "`rpm=0` is not `rpm=N` (N from 1 up)",
            ),
            (format!("acme {hex} tpm=lots"), "`tpm=lots` is not `tpm=N`"),
            (format!("acme {hex} concurrency=0"), "N from 1 to 100000"),
            (
                format!("acme {hex} burst=3"),
                "is not one of concurrency=N, rpm=N, tpm=N, admin",
            ),
            (format!("acme {hex} admin=yes"), "is not one of"),
            (
                format!("acme {}aéb", "ab".repeat(30)),
                "expected `owner <sha256 hex of the key>",
            ),
            (
                format!("acme {}", "zz".repeat(32)),
                "expected `owner <sha256 hex of the key>",
            ),
        ] {
            std::fs::write(&path, &line).unwrap();
            let err = Keys::default().add_file(&path).unwrap_err();
            assert!(err.contains(says) && err.contains(":1:"), "{line}: {err}");
        }
    }
}
