//! What was applied to each pod, recorded ahead of the transaction in memory and in
//! `<state dir>/nftables/<container id>.json`, so that a DEL, an ADD or a restarted agent knows
//! which tables the pod's netns may hold. A record is written to a temporary file and renamed
//! into place; a starting agent adopts complete records of interrupted ADDs and drops partial
//! ones (as the iptables backend's records).
use std::{collections::HashMap, fs, path::PathBuf, sync::Mutex};

use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use super::NftablesRules;
use crate::{
    backend::BackendError,
    crashpoint,
    pod::{PodRef, record_file_name},
    policy::{DataplaneMode, InterceptionMode},
};

/// What was applied to a pod: the record, written before the transaction runs.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct Applied {
    pub(super) pod: PodRef,
    /// The rules the pod's capture consists of.
    pub(super) rules: NftablesRules,
    /// Rule sets whose tables may still be in the netns besides `rules`' (an update or an ADD
    /// that has not finished; empty once it has).
    #[serde(default)]
    pub(super) replacing: Vec<NftablesRules>,
    /// The tables as the kernel listed them (`nft -s list table`) once the rules were in
    /// place: what CHECK and the verifier compare with. Empty until then.
    #[serde(default)]
    pub(super) listing: String,
    pub(super) mode: InterceptionMode,
    /// Ambient mode's in-pod rules (ztunnel's), not a sidecar's.
    pub(super) ambient: bool,
}

impl Applied {
    /// Every rule set the netns may hold.
    pub(super) fn rule_sets(&self) -> impl Iterator<Item = &NftablesRules> {
        std::iter::once(&self.rules).chain(&self.replacing)
    }
}

/// The records, by container.
#[derive(Debug)]
pub(super) struct Records {
    dir: PathBuf,
    applied: Mutex<HashMap<String, Applied>>,
}

impl Records {
    /// Opens the records under `dir` and adopts what a previous run left.
    pub(super) fn open(dir: PathBuf) -> Result<Self, BackendError> {
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
                .and_then(|b| serde_json::from_slice::<Applied>(&b).map_err(|e| e.to_string()));
            if entry.file_name().to_string_lossy().ends_with(".json.tmp") {
                // Written ahead of an ADD that stopped before renaming it: a complete record
                // names what the netns may hold, so it is adopted; a partial one goes (its
                // transaction never ran: the record is written first).
                let target = path.with_extension("");
                match parsed {
                    Ok(record) if fs::rename(&path, &target).is_ok() => {
                        info!(path = %target.display(), "adopted the record of an interrupted ADD");
                        applied.insert(record.pod.container_id.clone(), record);
                    }
                    _ => {
                        info!(path = %path.display(), "dropping the partial record of an interrupted ADD");
                        let _ = fs::remove_file(&path);
                    }
                }
                continue;
            }
            match parsed {
                Ok(record) => {
                    applied.insert(record.pod.container_id.clone(), record);
                }
                Err(reason) => {
                    warn!(path = %path.display(), %reason, "ignoring unreadable nftables record");
                }
            }
        }
        Ok(Self {
            dir,
            applied: Mutex::new(applied),
        })
    }

    pub(super) fn count(&self) -> usize {
        self.lock().len()
    }

    fn path(&self, container_id: &str) -> PathBuf {
        self.dir.join(record_file_name(container_id))
    }

    /// Writes `record` (to a temporary file, renamed into place) and keeps it in memory.
    pub(super) fn save(&self, record: &Applied) -> Result<(), BackendError> {
        let path = self.path(&record.pod.container_id);
        let tmp = path.with_extension("json.tmp");
        let write = || -> std::io::Result<()> {
            fs::write(
                &tmp,
                serde_json::to_vec(record).map_err(std::io::Error::other)?,
            )?;
            crashpoint::here(crashpoint::NFTABLES_ADD_RECORD_WRITTEN);
            fs::rename(&tmp, &path)
        };
        write().map_err(|e| BackendError::State {
            path,
            reason: e.to_string(),
        })?;
        self.lock()
            .insert(record.pod.container_id.clone(), record.clone());
        Ok(())
    }

    /// Removes the record of `container_id`, on disk and in memory.
    pub(super) fn forget(&self, container_id: &str) {
        let path = self.path(container_id);
        for path in [path.with_extension("json.tmp"), path] {
            if let Err(e) = fs::remove_file(&path)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                warn!(path = %path.display(), error = %e, "removing nftables record");
            }
        }
        self.lock().remove(container_id);
    }

    pub(super) fn get(&self, container_id: &str) -> Option<Applied> {
        self.lock().get(container_id).cloned()
    }

    /// What was applied for `pod`, and the id it is recorded under: by the container, else by
    /// the netns (a pod captured in place is recorded under an id of meshcap's).
    pub(super) fn recorded(&self, pod: &PodRef) -> Option<(String, Applied)> {
        let applied = self.lock();
        applied
            .get(&pod.container_id)
            .map(|r| (pod.container_id.clone(), r.clone()))
            .or_else(|| {
                applied
                    .iter()
                    .find(|(_, r)| r.pod.in_netns(&pod.netns))
                    .map(|(id, r)| (id.clone(), r.clone()))
            })
    }

    /// The records of `mode`'s pods.
    pub(super) fn of_mode(&self, mode: DataplaneMode) -> Vec<Applied> {
        let ambient = mode == DataplaneMode::Ambient;
        self.lock()
            .values()
            .filter(|record| record.ambient == ambient)
            .cloned()
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Applied>> {
        // A panic while holding the map leaves it consistent (single inserts and removes).
        self.applied
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}
