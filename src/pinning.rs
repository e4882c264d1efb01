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

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime};

use crate::agents::{AgentDef, AgentRegistry};
use crate::domain::RunRecord;
use crate::store::{RunLog, StoreError};

/// How often the jobs directory is looked at for changes, at most.
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// What a look at the jobs directory sees: each definition file's size and modification time.
type Fingerprint = BTreeMap<PathBuf, (u64, Option<SystemTime>)>;

/// The current definitions (reloaded when their files change) and the pinned ones.
pub struct Agents {
    dir: PathBuf,
    current: RwLock<Arc<AgentRegistry>>,
    seen: Mutex<(Instant, Fingerprint)>,
    /// Pinned definitions read back from the store, by version.
    pinned: Mutex<HashMap<String, Arc<AgentDef>>>,
    /// Versions this process has recorded in the store.
    recorded: Mutex<HashSet<String>>,
}

impl Agents {
    /// The definitions of `dir` (and the built-ins), with the errors of the files that did not
    /// load.
    pub fn load(dir: &Path) -> (Agents, Vec<crate::agents::AgentFileError>) {
        let (reg, errors) = AgentRegistry::load_dir(dir);
        let agents = Agents {
            dir: dir.to_owned(),
            current: RwLock::new(Arc::new(reg)),
            seen: Mutex::new((Instant::now(), fingerprint(dir))),
            pinned: Mutex::default(),
            recorded: Mutex::default(),
        };
        (agents, errors)
    }

    /// A fixed set of definitions (tests and embedders); its directory is never re-read.
    pub fn fixed(reg: AgentRegistry) -> Agents {
        Agents {
            dir: PathBuf::new(),
            current: RwLock::new(Arc::new(reg)),
            seen: Mutex::new((Instant::now(), Fingerprint::new())),
            pinned: Mutex::default(),
            recorded: Mutex::default(),
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
        if self.dir.as_os_str().is_empty() {
            return;
        }
        let Ok(mut seen) = self.seen.try_lock() else {
            return;
        };
        if seen.0.elapsed() < CHECK_EVERY {
            return;
        }
        seen.0 = Instant::now();
        let now = fingerprint(&self.dir);
        if now == seen.1 {
            return;
        }
        seen.1 = now;
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
            // Known versions (every start but the first of each) cost a lookup, not a copy.
            let fresh = {
                let mut recorded = self.recorded.lock().expect("agents lock");
                !recorded.contains(&agent.version) && recorded.insert(agent.version.clone())
            };
            if fresh
                && let Err(e) = store
                    .record_agent_version(&agent.version, &agent.name, text)
                    .await
            {
                self.recorded
                    .lock()
                    .expect("agents lock")
                    .remove(&agent.version);
                return Err(e);
            }
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
        if let Some(d) = self.pinned.lock().expect("agents lock").get(version) {
            return Ok(Some(d.clone()));
        }
        let Some((name, text)) = store.agent_version(version).await? else {
            return Ok(None);
        };
        match crate::agents::parse_agent(Path::new(&format!("{name}.md")), &text) {
            Ok(def) => {
                let def = Arc::new(def);
                self.pinned
                    .lock()
                    .expect("agents lock")
                    .insert(version.to_owned(), def.clone());
                Ok(Some(def))
            }
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
        agents.seen.lock().unwrap().0 -= CHECK_EVERY;
        let now = agents.current();
        let a = now.get("a").unwrap();
        assert_ne!(a.version, v1);
        assert!(a.system_prompt.starts_with("second"));
        assert!(now.get("b").is_some());
        std::fs::remove_file(dir.path().join("b.md")).unwrap();
        agents.seen.lock().unwrap().0 -= CHECK_EVERY;
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
