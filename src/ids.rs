//! Typed identifiers. A run id can never be passed where a thread id is expected, and every id
//! has one canonical string form that is what the database and the API store and show.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// The id of one run: a UUID v7, so ids sort by creation time.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    utoipa::ToSchema,
)]
#[serde(transparent)]
#[schema(value_type = String, format = Uuid)]
pub struct RunId(pub Uuid);

impl RunId {
    /// A fresh, time-ordered id.
    pub fn new() -> Self {
        Self(Uuid::now_v7())
    }
}

impl RunId {
    /// The smallest id a run created at `at` can have: ids are time-ordered, so a time range
    /// of runs is an id range (and uses the primary key).
    pub fn lower_bound(at: chrono::DateTime<chrono::Utc>) -> Self {
        let ms = at.timestamp_millis().max(0) as u64;
        Self(uuid::Builder::from_unix_timestamp_millis(ms, &[0u8; 10]).into_uuid())
    }
}

impl Default for RunId {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Display for RunId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl FromStr for RunId {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, IdError> {
        Uuid::parse_str(s)
            .map(Self)
            .map_err(|_| IdError::BadRunId(s.to_owned()))
    }
}

/// The id of a thread: free-form text chosen by the caller (or generated), because callers want
/// to name conversations after their own entities (`ticket-4711`). Limited to a safe alphabet so
/// it can appear in URLs, stream keys and file names unescaped.
///
/// Thread ids are each owner's own namespace: two owners may both have a thread `ticket-4711`.
/// A thread is stored under [`ThreadId::scoped`] (its owner's scope, `o<16 hex>.`, before the
/// id the caller chose; none for the local owner) and shown as [`ThreadId::visible_to`] its
/// owner.
#[derive(
    Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, utoipa::ToSchema,
)]
#[serde(try_from = "String", into = "String")]
#[schema(value_type = String, pattern = "^[A-Za-z0-9_.:-]{1,200}$")]
pub struct ThreadId(String);

/// Longest thread id a caller may choose, in bytes.
pub const MAX_THREAD_ID_LEN: usize = 200;
/// Longest thread id as stored: a caller's, its owner's scope before it, and (for a child's
/// thread) the suffix delegation adds.
const MAX_STORED_LEN: usize = 256;
/// The owner whose threads are stored under the ids it chose: the CLI's and a keyless server's.
const UNSCOPED_OWNER: &str = "local";

/// The prefix `owner`'s thread ids are stored under (`None` for the local owner).
fn scope(owner: &OwnerId) -> Option<String> {
    use sha2::Digest;
    let owner = owner.as_str();
    if owner == UNSCOPED_OWNER {
        return None;
    }
    let h = sha2::Sha256::digest(owner.as_bytes());
    Some(format!(
        "o{}.",
        h.iter()
            .take(8)
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    ))
}

impl ThreadId {
    /// A thread id as a caller chose it: at most [`MAX_THREAD_ID_LEN`] bytes (stored ids may
    /// be longer, see [`ThreadId::scoped`]).
    pub fn chosen(s: &str) -> Result<ThreadId, IdError> {
        if s.len() > MAX_THREAD_ID_LEN {
            return Err(IdError::BadThreadId(s.to_owned()));
        }
        s.parse()
    }

    /// The id `owner`'s thread `self` (as the owner chose it) is stored under.
    pub fn scoped(&self, owner: &OwnerId) -> ThreadId {
        match scope(owner) {
            Some(prefix) => ThreadId(format!("{prefix}{}", self.0)),
            None => self.clone(),
        }
    }

    /// This stored id as `owner` sees it: without `owner`'s scope (an id stored before threads
    /// were scoped, or another owner's, is shown as it is).
    pub fn visible_to(&self, owner: &OwnerId) -> ThreadId {
        match scope(owner) {
            Some(prefix) => match self.0.strip_prefix(&prefix) {
                Some(rest) if !rest.is_empty() => ThreadId(rest.to_owned()),
                _ => self.clone(),
            },
            None => self.clone(),
        }
    }

    /// A fresh thread id: `thr_` and a UUID v7 in simple form.
    pub fn generate() -> Self {
        Self(format!("thr_{}", Uuid::now_v7().simple()))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ThreadId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for ThreadId {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, IdError> {
        let ok = !s.is_empty()
            && s.len() <= MAX_STORED_LEN
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b':'));
        if ok {
            Ok(Self(s.to_owned()))
        } else {
            Err(IdError::BadThreadId(s.to_owned()))
        }
    }
}

impl TryFrom<String> for ThreadId {
    type Error = IdError;
    fn try_from(s: String) -> Result<Self, IdError> {
        s.parse()
    }
}

impl From<ThreadId> for String {
    fn from(t: ThreadId) -> String {
        t.0
    }
}

/// A newtype over text that names something: an id with one canonical string form, stored and
/// sent as that string (serde and sqlx see the text), which cannot be passed where another kind
/// of name is expected. Built from text already checked where it entered (a keys file, an agent
/// file, the store), so construction does not validate.
macro_rules! text_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(
            Clone,
            Debug,
            PartialEq,
            Eq,
            Hash,
            PartialOrd,
            Ord,
            Serialize,
            Deserialize,
            sqlx::Type,
            utoipa::ToSchema,
        )]
        #[serde(transparent)]
        #[sqlx(transparent)]
        #[schema(value_type = String)]
        pub struct $name(String);

        impl $name {
            /// The name as text.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl From<&str> for $name {
            fn from(s: &str) -> Self {
                Self(s.to_owned())
            }
        }

        impl From<String> for $name {
            fn from(s: String) -> Self {
                Self(s)
            }
        }

        impl From<$name> for String {
            fn from(n: $name) -> String {
                n.0
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl std::borrow::Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl PartialEq<str> for $name {
            fn eq(&self, other: &str) -> bool {
                self.0 == other
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                self.0 == *other
            }
        }
    };
}

text_id!(
    /// Who a thread, a run, an approval and a rate budget belong to: the name a key maps to
    /// (`local` for the CLI and a keyless server). Every read and write of the store is scoped
    /// by it.
    OwnerId
);

impl Default for OwnerId {
    fn default() -> Self {
        Self::local()
    }
}

impl OwnerId {
    /// The owner of the CLI's runs and of a keyless server's.
    pub fn local() -> Self {
        Self(UNSCOPED_OWNER.to_owned())
    }
}

text_id!(
    /// The name of an agent definition (`jobs/<name>.md`, or a built-in such as `general`):
    /// what a run executes, and the key of its concurrency limit.
    AgentName
);

text_id!(
    /// The id of an approval: `apr_` and a time-ordered suffix.
    ApprovalId
);

impl ApprovalId {
    /// A fresh id: `apr_` and a UUID v7 in simple form, so ids sort by creation time (the
    /// approvals list pages by them).
    pub fn generate() -> Self {
        Self(format!("apr_{}", Uuid::now_v7().simple()))
    }
}

text_id!(
    /// The id of a message sent to a run (`POST /v1/runs/{id}/messages`): `msg_` and a
    /// time-ordered suffix. It keys the message's delivery, so a replay delivers it once.
    MessageId
);

impl MessageId {
    /// A fresh id: `msg_` and a UUID v7 in simple form.
    pub fn generate() -> Self {
        Self(format!("msg_{}", Uuid::now_v7().simple()))
    }
}

/// A malformed id, with the offending text.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum IdError {
    /// Not a UUID.
    #[error("`{0}` is not a run id (expected a UUID such as 0192f0c1-7a3e-7c4e-9a51-3f0e2b1c4d5e)")]
    BadRunId(String),
    /// Empty, too long, or with characters outside `[A-Za-z0-9_.:-]`.
    #[error("`{0}` is not a valid thread id: use 1 to 200 characters from A-Z a-z 0-9 _ - . :")]
    BadThreadId(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_ids_are_checked() {
        assert!("ticket-4711".parse::<ThreadId>().is_ok());
        assert!("".parse::<ThreadId>().is_err());
        assert!("a/b".parse::<ThreadId>().is_err());
        assert!(ThreadId::chosen(&"x".repeat(201)).is_err());
        assert!(ThreadId::chosen(&"x".repeat(200)).is_ok());
        assert!("x".repeat(257).parse::<ThreadId>().is_err());
        // Each owner its own namespace; the local owner's ids are stored as chosen.
        let t: ThreadId = "ticket-4711".parse().unwrap();
        let (a, b) = (t.scoped(&"alice".into()), t.scoped(&"bob".into()));
        assert_ne!(a, b);
        assert_eq!(t.scoped(&"local".into()), t);
        assert_eq!(
            (a.visible_to(&"alice".into()), b.visible_to(&"bob".into())),
            (t.clone(), t.clone())
        );
        assert_eq!(
            a.visible_to(&"bob".into()),
            a,
            "another owner's scope is not stripped"
        );
        assert!(
            a.as_str().parse::<ThreadId>().is_ok(),
            "a stored id is an id"
        );
        assert!(
            ThreadId::chosen(&"x".repeat(200))
                .unwrap()
                .scoped(&"alice".into())
                .as_str()
                .parse::<ThreadId>()
                .is_ok()
        );
        assert!(ThreadId::generate().as_str().starts_with("thr_"));
    }

    #[test]
    fn run_ids_round_trip() {
        let id = RunId::new();
        assert_eq!(id.to_string().parse::<RunId>().unwrap(), id);
        assert!("nope".parse::<RunId>().is_err());
    }
}
