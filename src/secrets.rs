//! The process's secrets, kept out of reach of what it starts. A `bash` call, a hook or an MCP
//! server runs as a child of the worker, under the same user: it could read the worker's
//! environment through `/proc/$PPID/environ` (which shows the environment the process was
//! started with, whatever it unset since) or its memory through `/proc/$PPID/mem`.
//! [`protect`], called once at start after the settings are parsed, therefore
//! - keeps a copy of the environment for the few later lookups (`${VAR}` in `.mcp.json`, the
//!   variables an operator passes through to hooks),
//! - overwrites the values of secret variables (keys, tokens, passwords, database and Redis URLs)
//!   where the kernel shows them, and removes them from the environment,
//! - makes the process non-dumpable, so processes of the same user cannot read its memory or
//!   environment through `/proc` or attach to it (children drop the capabilities that would
//!   let root do it anyway: see [`crate::procs::confine`]).

use std::collections::BTreeMap;
use std::sync::OnceLock;

static START_ENV: OnceLock<BTreeMap<String, String>> = OnceLock::new();

/// Variables that hold secrets by name, beyond the patterns of [`is_secret`].
const SECRET_NAMES: &[&str] = &[
    "DATABASE_URL",
    "REDIS_URL",
    "SUBAGENTS_API_KEYS",
    "PGPASSWORD",
    "OTEL_EXPORTER_OTLP_HEADERS",
    "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
];

/// Whether a variable's value is a secret: a listed name, or a name that says key, token,
/// secret, password or credential.
pub fn is_secret(name: &str) -> bool {
    let upper = name.to_ascii_uppercase();
    SECRET_NAMES.contains(&upper.as_str())
        || [
            "KEY",
            "TOKEN",
            "SECRET",
            "PASSWORD",
            "PASSWD",
            "CREDENTIAL",
            "_AUTH",
            "COOKIE",
        ]
        .iter()
        .any(|p| upper.contains(p))
            && !upper.ends_with("_FILE")
}

/// The value `name` had when the process started (secrets included), for lookups made after
/// [`protect`] took them out of the environment.
pub fn var(name: &str) -> Option<String> {
    match START_ENV.get() {
        Some(env) => env.get(name).cloned(),
        None => std::env::var(name).ok(),
    }
}

/// Keeps the environment, wipes the secrets from what the kernel shows, removes them from the
/// environment, and makes the process non-dumpable. Call it once, before any thread starts
/// (changing the environment is not thread-safe), after the settings have been read.
pub fn protect() {
    let env: BTreeMap<String, String> = std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .collect();
    let _ = START_ENV.set(env);
    wipe_initial_environment();
    let names: Vec<String> = START_ENV
        .get()
        .map(|e| e.keys().filter(|k| is_secret(k)).cloned().collect())
        .unwrap_or_default();
    for name in names {
        // SAFETY: called at start, before the runtime's threads exist (see the doc).
        unsafe { std::env::remove_var(&name) };
    }
    // SAFETY: prctl with plain integer arguments.
    unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) };
}

/// Overwrites, in place, the values of secret variables in the environment block the process
/// started with: `/proc/PID/environ` reads that memory, and unsetting a variable does not
/// touch it.
fn wipe_initial_environment() {
    unsafe extern "C" {
        static mut environ: *mut *mut libc::c_char;
    }
    // SAFETY: `environ` is the C library's NULL-terminated array of NUL-terminated strings; we
    // run before any other thread, and write only inside each string, keeping its length.
    unsafe {
        let mut p = environ;
        if p.is_null() {
            return;
        }
        while !(*p).is_null() {
            let entry = *p;
            let len = libc::strlen(entry);
            let bytes = std::slice::from_raw_parts_mut(entry as *mut u8, len);
            if let Some(eq) = bytes.iter().position(|b| *b == b'=') {
                let name = String::from_utf8_lossy(&bytes[..eq]).into_owned();
                if is_secret(&name) {
                    for b in &mut bytes[eq + 1..] {
                        *b = b'*';
                    }
                }
            }
            p = p.add(1);
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn secret_names_are_recognised() {
        for s in [
            "OPENAI_API_KEY",
            "ANTHROPIC_API_KEY",
            "DATABASE_URL",
            "REDIS_URL",
            "SUBAGENTS_API_KEYS",
            "GITHUB_TOKEN",
            "MY_SECRET",
            "PGPASSWORD",
            "aws_secret_access_key",
        ] {
            assert!(super::is_secret(s), "{s}");
        }
        for s in [
            "PATH",
            "HOME",
            "LANG",
            "SUBAGENTS_KEYS_FILE",
            "SUBAGENTS_WORKSPACE",
            "RUST_LOG",
            "OPENAI_BASE_URL",
        ] {
            assert!(!super::is_secret(s), "{s}");
        }
    }
}
