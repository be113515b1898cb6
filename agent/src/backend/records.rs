//! The rules backends' record store: what was applied to each pod, recorded ahead of the rules
//! in memory and in `<state dir>/<backend>/<container id>.json` (`iptables`, `nftables`; ambient
//! mode's in-pod rules under a state directory of their own), so that a DEL, an ADD or a
//! restarted agent knows what the pod's netns may hold. A record is written to a temporary file
//! and renamed into place; a starting agent adopts the complete records of interrupted ADDs
//! (a temporary file that parses: the record names what the netns may hold) and drops partial
//! ones.
//!
//! One store serves both backends; what differs, the record itself, is the backend's
//! ([`Record`]: `iptables/records.rs`, `nftables/records.rs`). The steps both backends take
//! over their records (DEL's course, CHECK's and the verifier's first look, gone pods) are
//! [`super::rules_backend`]'s.
use std::{
    collections::HashMap,
    fs,
    path::{Path, PathBuf},
    sync::Mutex,
};

use meshcap_policy::{DataplaneMode, Family, InterceptionMode};
use serde::{Serialize, de::DeserializeOwned};
use tracing::{info, warn};

use super::BackendError;
use crate::{
    crashpoint,
    pod::{PodRef, record_file_name},
};

/// One pod's record, as a rules backend writes it.
pub(super) trait Record: Clone + Serialize + DeserializeOwned {
    /// The backend's name: its records' directory under the state directory, and its log
    /// lines'.
    const BACKEND: &'static str;
    /// The crash point between writing a record's temporary file and renaming it into place.
    const RECORD_WRITTEN: &'static str;
    /// The crash point after a DEL removed the rules, before it forgets the record.
    const REMOVED: &'static str;
    /// What the backend applies to a pod.
    type Rules: PartialEq;

    /// The pod the rules were applied to.
    fn pod(&self) -> &PodRef;
    /// The rules the pod's capture consists of.
    fn rules(&self) -> &Self::Rules;
    /// Rule sets that may still be in the netns besides [`Self::rules`]: those of an update or
    /// an ADD that has not finished (empty once it has).
    fn replacing(&self) -> &[Self::Rules];
    /// The interception mode of a sidecar's rules.
    fn mode(&self) -> InterceptionMode;
    /// Whether the rules are ambient mode's in-pod rules (ztunnel's), not a sidecar's.
    fn ambient(&self) -> bool;
    /// What carries the rules, for the status report (`iptables-nft`, `nft (tables)`).
    fn via(&self) -> String;
    /// Whether the rules were adopted: istio-cni's, found in the pod's netns.
    fn adopted(&self) -> bool;
    /// The families whose policy route the netns held before this capture (istio-cni's), left
    /// in place whatever becomes of the capture.
    fn found_routes_mut(&mut self) -> &mut Vec<Family>;

    /// Every rule set the netns may hold.
    fn rule_sets(&self) -> impl Iterator<Item = &Self::Rules> {
        std::iter::once(self.rules()).chain(self.replacing())
    }

    /// Whose rules these are, in words: `ambient (ztunnel)` or the interception mode.
    fn capture(&self) -> String {
        if self.ambient() {
            "ambient (ztunnel)".to_owned()
        } else {
            self.mode().to_string()
        }
    }

    /// Whose rules these are, for the verifier: `ambient (ztunnel) in-pod` or `<mode> mode`.
    fn whose(&self) -> String {
        if self.ambient() {
            "ambient (ztunnel) in-pod".to_owned()
        } else {
            format!("{} mode", self.mode())
        }
    }
}

/// The records of one backend, by container.
#[derive(Debug)]
pub(super) struct Records<R> {
    dir: PathBuf,
    applied: Mutex<HashMap<String, R>>,
}

impl<R: Record> Records<R> {
    /// Whether `<state_dir>/<backend>/` holds any record (complete or being written): pods an
    /// earlier agent captured with this backend. Reads the directory only; creates nothing.
    pub(super) fn present(state_dir: &Path) -> bool {
        fs::read_dir(state_dir.join(R::BACKEND)).is_ok_and(|entries| {
            entries
                .flatten()
                .any(|e| e.file_name().to_string_lossy().contains(".json"))
        })
    }

    /// Opens the records under `<state_dir>/<backend>/` and adopts what a previous run left.
    pub(super) fn open(state_dir: &Path) -> Result<Self, BackendError> {
        let dir = state_dir.join(R::BACKEND);
        let failed = |path: &PathBuf, e: &std::io::Error| BackendError::State {
            path: path.clone(),
            reason: e.to_string(),
        };
        fs::create_dir_all(&dir).map_err(|e| failed(&dir, &e))?;
        let mut applied = HashMap::new();
        for entry in fs::read_dir(&dir).map_err(|e| failed(&dir, &e))?.flatten() {
            let path = entry.path();
            let parsed = fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<R>(&b).map_err(|e| e.to_string()));
            if entry.file_name().to_string_lossy().ends_with(".json.tmp") {
                // An ADD stopped between writing its record and renaming it into place: a
                // complete record names what the netns may hold, so it is adopted; a partial
                // one says nothing and goes.
                let target = path.with_extension("");
                let reason = match parsed {
                    Ok(record) => match fs::rename(&path, &target) {
                        Ok(()) => {
                            info!(path = %target.display(), "adopted the record of an interrupted ADD");
                            applied.insert(record.pod().container_id.clone(), record);
                            continue;
                        }
                        Err(e) => e.to_string(),
                    },
                    Err(reason) => reason,
                };
                info!(path = %path.display(), %reason, "dropping the partial record of an interrupted ADD");
                let _ = fs::remove_file(&path);
                continue;
            }
            match parsed {
                Ok(record) => {
                    applied.insert(record.pod().container_id.clone(), record);
                }
                Err(reason) => {
                    warn!(path = %path.display(), %reason, "ignoring unreadable {} record", R::BACKEND);
                }
            }
        }
        Ok(Self {
            dir,
            applied: Mutex::new(applied),
        })
    }

    /// How many pods are recorded.
    pub(super) fn count(&self) -> usize {
        self.lock().len()
    }

    fn path(&self, container_id: &str) -> PathBuf {
        self.dir.join(record_file_name(container_id))
    }

    /// Writes `record` (to a temporary file, renamed into place) and keeps it in memory.
    pub(super) fn save(&self, record: &R) -> Result<(), BackendError> {
        let id = &record.pod().container_id;
        let path = self.path(id);
        let tmp = path.with_extension("json.tmp");
        let write = || -> std::io::Result<()> {
            fs::write(
                &tmp,
                serde_json::to_vec(record).map_err(std::io::Error::other)?,
            )?;
            crashpoint::here(R::RECORD_WRITTEN);
            fs::rename(&tmp, &path)
        };
        write().map_err(|e| BackendError::State {
            path,
            reason: e.to_string(),
        })?;
        self.lock().insert(id.clone(), record.clone());
        Ok(())
    }

    /// Removes the record of `container_id`, on disk and in memory.
    pub(super) fn forget(&self, container_id: &str) {
        let path = self.path(container_id);
        for path in [path.with_extension("json.tmp"), path] {
            if let Err(e) = fs::remove_file(&path)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                warn!(path = %path.display(), error = %e, "removing {} record", R::BACKEND);
            }
        }
        self.lock().remove(container_id);
    }

    /// The record of `container_id`.
    pub(super) fn get(&self, container_id: &str) -> Option<R> {
        self.lock().get(container_id).cloned()
    }

    /// Forgets the routes a pod's capture found in place: they are the capture's own from now
    /// on, so its removal takes them.
    pub(super) fn forget_found_routes(&self, container_id: &str) -> Result<(), BackendError> {
        let Some(mut record) = self.get(container_id) else {
            return Ok(());
        };
        if record.found_routes_mut().is_empty() {
            return Ok(());
        }
        record.found_routes_mut().clear();
        self.save(&record)
    }

    /// What was applied for `pod`, and the id it is recorded under: by the container, else by
    /// the netns (a pod captured in place is recorded under an id of meshcap's, not the
    /// runtime's sandbox id).
    pub(super) fn recorded(&self, pod: &PodRef) -> Option<(String, R)> {
        let applied = self.lock();
        applied
            .get(&pod.container_id)
            .map(|r| (pod.container_id.clone(), r.clone()))
            .or_else(|| {
                applied
                    .iter()
                    .find(|(_, r)| r.pod().in_netns(&pod.netns))
                    .map(|(id, r)| (id.clone(), r.clone()))
            })
    }

    /// The records of `mode`'s pods.
    pub(super) fn of_mode(&self, mode: DataplaneMode) -> Vec<R> {
        let ambient = mode == DataplaneMode::Ambient;
        self.lock()
            .values()
            .filter(|record| record.ambient() == ambient)
            .cloned()
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, R>> {
        // A panic while holding the map leaves it consistent (single inserts and removes).
        self.applied
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}
