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
use crate::app::LOCAL_OWNER;

/// Key hashes to owners.
#[derive(Clone, Debug, Default)]
pub struct Keys {
    by_hash: HashMap<[u8; 32], String>,
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
            let (owner, key) = pair.split_once(':').ok_or_else(|| "SUBAGENTS_API_KEYS must be owner:key pairs separated by commas".to_owned())?;
            if owner.is_empty() || key.len() < 8 {
                return Err(format!("bad entry for owner `{owner}`: owners must be named and keys at least 8 characters"));
            }
            self.by_hash.insert(hash(key), owner.to_owned());
        }
        Ok(())
    }

    /// Adds entries from a keys file: one `owner sha256-hex-of-key` per line, `#` comments.
    pub fn add_file(&mut self, path: &Path) -> Result<(), String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read keys file {}: {e}", path.display()))?;
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let bad = || format!("{}:{}: expected `owner <sha256 hex of the key>`", path.display(), i + 1);
            let (owner, hex) = line.split_once(char::is_whitespace).ok_or_else(bad)?;
            let hex = hex.trim();
            if hex.len() != 64 {
                return Err(bad());
            }
            let mut h = [0u8; 32];
            for (j, b) in h.iter_mut().enumerate() {
                *b = u8::from_str_radix(&hex[j * 2..j * 2 + 2], 16).map_err(|_| bad())?;
            }
            self.by_hash.insert(h, owner.to_owned());
        }
        Ok(())
    }

    /// The owner of a presented key.
    pub fn owner_of(&self, key: &str) -> Option<&str> {
        self.by_hash.get(&hash(key)).map(String::as_str)
    }
}

/// The authenticated owner of a request.
#[derive(Clone, Debug)]
pub struct Owner(pub String);

impl FromRequestParts<ApiState> for Owner {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &ApiState) -> Result<Self, ApiError> {
        if state.keys.is_empty() {
            return Ok(Owner(LOCAL_OWNER.to_owned()));
        }
        let unauthorized = |m: &str| ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", m);
        let header = parts
            .headers
            .get(axum::http::header::AUTHORIZATION)
            .ok_or_else(|| unauthorized("send Authorization: Bearer <key>"))?;
        let value = header.to_str().map_err(|_| unauthorized("the Authorization header is not text"))?;
        let key = value.strip_prefix("Bearer ").ok_or_else(|| unauthorized("use the Bearer scheme: Authorization: Bearer <key>"))?;
        state.keys.owner_of(key.trim()).map(|o| Owner(o.to_owned())).ok_or_else(|| unauthorized("unknown key"))
    }
}
