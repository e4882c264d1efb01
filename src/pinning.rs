//! Which agent definition a run runs. A new run takes the current one; every later claim of it,
//! and every child it starts with the same agent, takes the version it started with, even after
//! its file changed or was deleted: the run records the version (a hash of the file's content)
//! and the store keeps each version's text once, so a worker whose own `jobs/` lacks the file
//! can still run it.
//!
//! The current definitions are re-read when the jobs directory changes: any look at them checks
//! the directory's files (names, sizes, modification times) at most once a second, and a change
//! is reloaded and logged. A broken file keeps its last good definition out of the way exactly
//! as at start: it is reported, and the other files load.
//!
//! The settings file (hooks, permission rules) is versioned and re-read the same way
//! ([`Settings`]); a run pins the version it first ran under, as it pins its model and each MCP
//! server's tool list (the engine's `pins`). Those texts are kept once per version too
//! ([`Texts`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime};

use crate::agents::{AgentDef, AgentRegistry, content_version};
use crate::domain::RunRecord;
use crate::policy::Policy;
use crate::store::{RunLog, StoreError};

/// How often the jobs directory is looked at for changes, at most.
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// What a look at the jobs directory sees: each definition file's size and modification time.
type Fingerprint = BTreeMap<PathBuf, (u64, Option<SystemTime>)>;

/// The current definitions (reloaded when their files change) and the pinned ones.
pub struct Agents {
    dir: PathBuf,
    current: RwLock<Arc<AgentRegistry>>,
    seen: Watch,
    kept: Kept<AgentDef>,
}

/// The last look at watched files: when, and what it saw.
struct Watch(Mutex<(Instant, Fingerprint)>);

impl Watch {
    fn new(seen: Fingerprint) -> Watch {
        Watch(Mutex::new((Instant::now(), seen)))
    }

    /// Whether the files changed since the last look, looking at most once a second (and
    /// never while another look is under way).
    fn changed(&self, look: impl FnOnce() -> Fingerprint) -> bool {
        let Ok(mut seen) = self.0.try_lock() else {
            return false;
        };
        if seen.0.elapsed() < CHECK_EVERY {
            return false;
        }
        seen.0 = Instant::now();
        let now = look();
        if now == seen.1 {
            return false;
        }
        seen.1 = now;
        true
    }

    #[cfg(test)]
    fn look_now(&self) {
        self.0.lock().unwrap().0 -= CHECK_EVERY;
    }
}

/// The versions this process wrote to the store, and those it read back, parsed.
struct Kept<T> {
    recorded: Mutex<HashSet<String>>,
    read: Mutex<HashMap<String, Arc<T>>>,
}

impl<T> Default for Kept<T> {
    fn default() -> Self {
        Kept {
            recorded: Mutex::default(),
            read: Mutex::default(),
        }
    }
}

impl<T> Kept<T> {
    /// Writes `version` with `write` the first time this process pins it: every later start
    /// costs a lookup here, not a copy.
    async fn record<F>(&self, version: &str, write: F) -> Result<(), StoreError>
    where
        F: std::future::Future<Output = Result<(), StoreError>>,
    {
        let fresh = {
            let mut recorded = self.recorded.lock().expect("pinning lock");
            !recorded.contains(version) && recorded.insert(version.to_owned())
        };
        if fresh && let Err(e) = write.await {
            self.recorded.lock().expect("pinning lock").remove(version);
            return Err(e);
        }
        Ok(())
    }

    fn get(&self, version: &str) -> Option<Arc<T>> {
        self.read
            .lock()
            .expect("pinning lock")
            .get(version)
            .cloned()
    }

    fn keep(&self, version: &str, value: Arc<T>) -> Arc<T> {
        self.read
            .lock()
            .expect("pinning lock")
            .insert(version.to_owned(), value.clone());
        value
    }
}

impl Agents {
    /// The definitions of `dir` (and the built-ins), with the errors of the files that did not
    /// load.
    pub fn load(dir: &Path) -> (Agents, Vec<crate::agents::AgentFileError>) {
        let (reg, errors) = AgentRegistry::load_dir(dir);
        let agents = Agents {
            dir: dir.to_owned(),
            current: RwLock::new(Arc::new(reg)),
            seen: Watch::new(fingerprint(dir)),
            kept: Kept::default(),
        };
        (agents, errors)
    }

    /// A fixed set of definitions (tests and embedders); its directory is never re-read.
    pub fn fixed(reg: AgentRegistry) -> Agents {
        Agents {
            dir: PathBuf::new(),
            current: RwLock::new(Arc::new(reg)),
            seen: Watch::new(Fingerprint::new()),
            kept: Kept::default(),
        }
    }

    /// The current definitions (re-read first when the directory changed).
    pub fn current(&self) -> Arc<AgentRegistry> {
        self.refresh();
        self.current.read().expect("agents lock").clone()
    }

    /// Re-reads the directory when a second has passed since the last look and its files
    /// changed; says in the log what changed.
    fn refresh(&self) {
        if self.dir.as_os_str().is_empty() || !self.seen.changed(|| fingerprint(&self.dir)) {
            return;
        }
        let (reg, errors) = AgentRegistry::load_dir(&self.dir);
        for e in &errors {
            tracing::warn!("agent definition skipped: {e}");
        }
        let old = self.current.read().expect("agents lock").clone();
        for (name, change) in changes(&old, &reg) {
            tracing::info!(agent = %name, change, "agent definitions changed; new runs take the new version, running ones keep theirs");
        }
        *self.current.write().expect("agents lock") = Arc::new(reg);
    }

    /// Pins `agent` for a new run: records the version's text in the store the first time this
    /// process pins it (a built-in has no text to keep), and returns the version.
    pub async fn pin(&self, store: &dyn RunLog, agent: &AgentDef) -> Result<String, StoreError> {
        if let Some(text) = &agent.text {
            self.kept
                .record(
                    &agent.version,
                    store.record_agent_version(&agent.version, &agent.name, text),
                )
                .await?;
        }
        Ok(agent.version.clone())
    }

    /// The definition of `agent` at `version`: the current one when it is that version, else
    /// the one the store kept. `None` when neither knows it (a built-in of another build).
    pub async fn at_version(
        &self,
        store: &dyn RunLog,
        agent: &str,
        version: &str,
    ) -> Result<Option<Arc<AgentDef>>, StoreError> {
        if let Some(d) = self.current().shared(agent)
            && d.version == version
        {
            return Ok(Some(d));
        }
        if let Some(d) = self.kept.get(version) {
            return Ok(Some(d));
        }
        let Some((name, text)) = store.agent_version(version).await? else {
            return Ok(None);
        };
        // In the jobs directory, so an `output_schema:` path resolves beside it.
        match crate::agents::parse_agent(&self.dir.join(format!("{name}.md")), &text) {
            Ok(def) => Ok(Some(self.kept.keep(version, Arc::new(def)))),
            Err(e) => {
                tracing::warn!(agent, version, error = %e, "a pinned agent definition no longer parses; using the current one");
                Ok(None)
            }
        }
    }

    /// The definition a run runs: the version it pinned, else (a run from before pinning, or
    /// a version nobody kept) the current one.
    pub async fn for_run(
        &self,
        store: &dyn RunLog,
        run: &RunRecord,
    ) -> Result<Option<Arc<AgentDef>>, StoreError> {
        if let Some(v) = &run.agent_version
            && let Some(d) = self.at_version(store, run.agent.as_str(), v).await?
        {
            return Ok(Some(d));
        }
        if let Some(v) = &run.agent_version {
            tracing::warn!(agent = %run.agent, version = %v, "the run's pinned agent version is unknown here; using the current definition");
        }
        Ok(self.current().shared(run.agent.as_str()))
    }
}

/// Pinned texts of one kind (settings files, MCP tool lists), parsed: each version written to
/// the store once by this process, and read back and parsed once.
pub struct Texts<T> {
    kept: Kept<T>,
    what: &'static str,
    parse: fn(&str) -> Result<T, String>,
}

impl<T> Texts<T> {
    /// Texts of a kind named `what` (for the log), read with `parse`.
    pub fn new(what: &'static str, parse: fn(&str) -> Result<T, String>) -> Texts<T> {
        Texts {
            kept: Kept::default(),
            what,
            parse,
        }
    }

    /// Keeps `text` as `version` in the store (the first time this process pins it).
    pub async fn pin(
        &self,
        store: &dyn RunLog,
        version: &str,
        text: &str,
    ) -> Result<(), StoreError> {
        self.kept
            .record(version, store.record_pinned_text(version, text))
            .await
    }

    /// The kept text of `version`, parsed; `None` when the store has no such version or it no
    /// longer parses (said in the log).
    pub async fn at_version(
        &self,
        store: &dyn RunLog,
        version: &str,
    ) -> Result<Option<Arc<T>>, StoreError> {
        if let Some(v) = self.kept.get(version) {
            return Ok(Some(v));
        }
        let Some(text) = store.pinned_text(version).await? else {
            return Ok(None);
        };
        match (self.parse)(&text) {
            Ok(v) => Ok(Some(self.kept.keep(version, Arc::new(v)))),
            Err(e) => {
                tracing::warn!(what = self.what, version, error = %e, "a pinned version no longer parses");
                Ok(None)
            }
        }
    }
}

/// The version of "no settings file": no hooks, no rules.
pub const NO_SETTINGS: &str = "none";

/// One version of the settings file.
pub struct SettingsVersion {
    /// A hash of the file's text ([`NO_SETTINGS`] without a file).
    pub version: String,
    /// The file's text (`None` without a file, or for a fixed policy: nothing to keep).
    text: Option<String>,
    /// What it says.
    pub policy: Arc<Policy>,
}

/// The operator's settings file (`SUBAGENTS_SETTINGS`): its current version, re-read when the
/// file changes (looked at, at most once a second, when a run starts), and the versions runs
/// pinned. A file that no longer parses keeps the last good version in force, and says why.
pub struct Settings {
    path: PathBuf,
    current: RwLock<Arc<SettingsVersion>>,
    seen: Watch,
    texts: Texts<Policy>,
}

impl Settings {
    /// The file at `path` (missing: no hooks and no rules). A file that does not parse is an
    /// error at start: nothing has run under it yet.
    pub fn load(path: &Path) -> Result<Settings, String> {
        Ok(Settings {
            path: path.to_owned(),
            current: RwLock::new(Arc::new(read_settings(path)?)),
            seen: Watch::new(file_fingerprint(path)),
            texts: Texts::new("settings file", crate::policy::parse_settings),
        })
    }

    /// A fixed policy (tests and embedders): never re-read, never kept in the store.
    pub fn fixed(policy: Policy) -> Settings {
        Settings {
            path: PathBuf::new(),
            current: RwLock::new(Arc::new(SettingsVersion {
                version: "fixed".into(),
                text: None,
                policy: Arc::new(policy),
            })),
            seen: Watch::new(Fingerprint::new()),
            texts: Texts::new("settings file", crate::policy::parse_settings),
        }
    }

    /// The current version (the file re-read first when it changed).
    pub fn current(&self) -> Arc<SettingsVersion> {
        if !self.path.as_os_str().is_empty() && self.seen.changed(|| file_fingerprint(&self.path)) {
            match read_settings(&self.path) {
                Ok(now) => {
                    tracing::info!(file = %self.path.display(), version = %now.version, "settings file changed; new runs take the new version, running ones keep theirs");
                    *self.current.write().expect("settings lock") = Arc::new(now);
                }
                Err(e) => {
                    tracing::error!(file = %self.path.display(), error = %e, "settings file changed but does not load; new runs keep the last good version");
                }
            }
        }
        self.current.read().expect("settings lock").clone()
    }

    /// Pins the current version for a new run: keeps its text in the store (once), and
    /// returns the version.
    pub async fn pin(&self, store: &dyn RunLog) -> Result<String, StoreError> {
        let now = self.current();
        if let Some(text) = &now.text {
            self.texts.pin(store, &now.version, text).await?;
        }
        Ok(now.version.clone())
    }

    /// The policy of `version`: the current one's, none for [`NO_SETTINGS`], else the one the
    /// store kept. `None` when neither knows it.
    pub async fn at_version(
        &self,
        store: &dyn RunLog,
        version: &str,
    ) -> Result<Option<Arc<Policy>>, StoreError> {
        let now = self.current();
        if now.version == version {
            return Ok(Some(now.policy.clone()));
        }
        if version == NO_SETTINGS {
            return Ok(Some(Arc::default()));
        }
        self.texts.at_version(store, version).await
    }
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settings")
            .field("path", &self.path)
            .field(
                "version",
                &self.current.read().expect("settings lock").version,
            )
            .finish()
    }
}

impl Default for Settings {
    fn default() -> Self {
        Settings::fixed(Policy::default())
    }
}

/// The settings file's current version: its text parsed and hashed.
fn read_settings(path: &Path) -> Result<SettingsVersion, String> {
    let Some(text) = crate::policy::read_settings_text(path)? else {
        return Ok(SettingsVersion {
            version: NO_SETTINGS.into(),
            text: None,
            policy: Arc::default(),
        });
    };
    let policy =
        crate::policy::parse_settings(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(SettingsVersion {
        version: content_version(&text),
        text: Some(text),
        policy: Arc::new(policy),
    })
}

/// One file's size and modification time (nothing when it is missing).
fn file_fingerprint(path: &Path) -> Fingerprint {
    std::fs::metadata(path)
        .map(|m| Fingerprint::from([(path.to_owned(), (m.len(), m.modified().ok()))]))
        .unwrap_or_default()
}

/// Every definition file's size and modification time under `dir` (the files `load_dir` reads).
fn fingerprint(dir: &Path) -> Fingerprint {
    crate::agents::definition_files(dir)
        .into_iter()
        .map(|p| {
            let meta = std::fs::metadata(&p).ok();
            let seen = (
                meta.as_ref().map_or(0, |m| m.len()),
                meta.and_then(|m| m.modified().ok()),
            );
            (p, seen)
        })
        .collect()
}

/// What changed between two loads, per agent: `added`, `removed`, or `version a -> b`.
fn changes(old: &AgentRegistry, new: &AgentRegistry) -> Vec<(String, String)> {
    let mut out = vec![];
    for d in new.all() {
        match old.get(&d.name) {
            None => out.push((d.name.clone(), format!("added (version {})", d.version))),
            Some(o) if o.version != d.version => out.push((
                d.name.clone(),
                format!("version {} -> {}", o.version, d.version),
            )),
            Some(_) => {}
        }
    }
    for o in old.all() {
        if new.get(&o.name).is_none() {
            out.push((o.name.clone(), "removed".to_owned()));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, prompt: &str) {
        std::fs::write(
            dir.join(format!("{name}.md")),
            format!("---\nname: {name}\ndescription: d\n---\n{prompt}\n"),
        )
        .unwrap();
    }

    #[test]
    fn a_changed_file_is_reloaded_and_its_version_moves() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "a", "first");
        let (agents, errors) = Agents::load(dir.path());
        assert!(errors.is_empty());
        let v1 = agents.current().get("a").unwrap().version.clone();
        write(dir.path(), "a", "second, and longer");
        write(dir.path(), "b", "new");
        // The look happens at most once a second.
        agents.seen.look_now();
        let now = agents.current();
        let a = now.get("a").unwrap();
        assert_ne!(a.version, v1);
        assert!(a.system_prompt.starts_with("second"));
        assert!(now.get("b").is_some());
        std::fs::remove_file(dir.path().join("b.md")).unwrap();
        agents.seen.look_now();
        assert!(
            agents.current().get("b").is_none(),
            "a deleted file is gone for new runs"
        );
    }

    #[test]
    fn versions_are_content_hashes_and_built_ins_have_their_own() {
        let gp = AgentDef::general_purpose();
        assert!(gp.version.starts_with("builtin-"), "{}", gp.version);
        let echo = AgentRegistry::builtin()
            .get("echo")
            .unwrap()
            .version
            .clone();
        assert_ne!(echo, gp.version);
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "a", "same");
        let (one, _) = Agents::load(dir.path());
        let (two, _) = Agents::load(dir.path());
        assert_eq!(
            one.current().get("a").unwrap().version,
            two.current().get("a").unwrap().version
        );
        assert_eq!(one.current().get("a").unwrap().version.len(), 12);
    }
}
