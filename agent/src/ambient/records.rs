//! The workload records: what ztunnel is told about each enrolled pod (its uid, name,
//! namespace and service account), with the policy it was enrolled with and its addresses, one
//! file per container under `<state dir>/ambient/workloads/`. Written before the pod's capture
//! and removed after it, so that a ztunnel that connects later, or to a restarted agent, is
//! sent every enrolled pod in the snapshot; a pod on its way out (ztunnel being told it is gone,
//! its record not removed yet) is left out of it.
use std::{
    collections::HashSet,
    fs,
    net::IpAddr,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, MutexGuard, PoisonError},
};

use meshcap_policy::ambient::InpodPolicy;
use serde::{Deserialize, Serialize};
use tracing::warn;

use super::AmbientError;
use crate::{
    pod::{PodRef, record_file_name, same_netns},
    ztunnel::{Enrolled, proto::WorkloadInfo},
};

/// What ztunnel is told about an enrolled pod, kept per container.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct Workload {
    /// The id the pod is enrolled under: the runtime's sandbox, or one of
    /// [`crate::pod::InPlace`]'s for a pod enrolled while it runs.
    #[serde(default)]
    pub(super) container_id: String,
    pub(super) uid: String,
    pub(super) name: String,
    pub(super) namespace: String,
    pub(super) service_account: String,
    pub(super) netns: PathBuf,
    /// The policy the pod was enrolled with (none in records of builds before it was kept).
    #[serde(default)]
    pub(super) policy: Option<InpodPolicy>,
    /// The pod's addresses, in the node's probe set (none in records of builds before it).
    #[serde(default)]
    pub(super) ips: Vec<IpAddr>,
}

impl Workload {
    /// What ztunnel is told.
    pub(super) fn info(&self) -> WorkloadInfo {
        WorkloadInfo {
            name: self.name.clone(),
            namespace: self.namespace.clone(),
            service_account: self.service_account.clone(),
        }
    }

    /// The pod, as its DEL names it.
    pub(super) fn pod(&self) -> PodRef {
        PodRef {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            container_id: self.container_id.clone(),
            netns: self.netns.clone(),
        }
    }
}

/// The records' directory, and the pods leaving (shared by every clone: the snapshot's too).
#[derive(Clone)]
pub(super) struct Records {
    dir: PathBuf,
    leaving: Arc<Mutex<HashSet<String>>>,
}

/// A pod leaving, by uid, until dropped: no snapshot names it ([`Records::leaving`]).
pub(super) struct Leaving<'a> {
    records: &'a Records,
    uid: String,
}

impl Drop for Leaving<'_> {
    fn drop(&mut self) {
        lock(&self.records.leaving).remove(&self.uid);
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Records {
    /// The records under `dir`, created when missing.
    pub(super) fn open(dir: PathBuf) -> Result<Self, AmbientError> {
        fs::create_dir_all(&dir).map_err(|e| state(&dir, &e))?;
        Ok(Self {
            dir,
            leaving: Arc::default(),
        })
    }

    /// Marks the pod whose uid is `uid` as leaving until the guard drops: from here no snapshot
    /// names it, though its record stays until its capture is gone. Taken before the connected
    /// ztunnels are told it is gone, so a ztunnel connecting meanwhile is either told too (it
    /// was listed before the telling) or never handed it (its snapshot comes after this).
    pub(super) fn leaving(&self, uid: &str) -> Leaving<'_> {
        lock(&self.leaving).insert(uid.to_owned());
        Leaving {
            records: self,
            uid: uid.to_owned(),
        }
    }

    /// The record of one container's pod.
    pub(super) fn path(&self, container_id: &str) -> PathBuf {
        self.dir.join(record_file_name(container_id))
    }

    /// Writes `workload`'s record.
    pub(super) fn write(&self, workload: &Workload) -> Result<PathBuf, AmbientError> {
        let path = self.path(&workload.container_id);
        let bytes = serde_json::to_vec(workload).map_err(|e| state(&path, &e))?;
        fs::write(&path, bytes).map_err(|e| state(&path, &e))?;
        Ok(path)
    }

    /// The record of one container's pod, if there is one.
    pub(super) fn get(&self, container_id: &str) -> Option<Workload> {
        read(&self.path(container_id))
    }

    /// The record of `pod`: by its container, else by its netns (a pod enrolled while it ran
    /// is recorded under an id of meshcap's, which the runtime's DEL does not name).
    pub(super) fn of(&self, pod: &PodRef) -> Option<(PathBuf, Workload)> {
        let path = self.path(&pod.container_id);
        if let Some(workload) = read(&path) {
            return Some((path, workload));
        }
        self.all().find(|(_, w)| same_netns(&w.netns, &pod.netns))
    }

    /// Every record, with its path.
    pub(super) fn all(&self) -> impl Iterator<Item = (PathBuf, Workload)> {
        fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|entry| {
                let path = entry.path();
                read(&path).map(|workload| (path, workload))
            })
    }

    /// Every enrolled pod not leaving, for a connecting ztunnel: with its netns when it is still
    /// there.
    pub(super) fn snapshot(&self) -> Vec<Enrolled> {
        let leaving = lock(&self.leaving).clone();
        self.all()
            .filter(|(_, workload)| !leaving.contains(&workload.uid))
            .map(|(_, workload)| Enrolled {
                uid: workload.uid.clone(),
                workload: workload.info(),
                netns: fs::File::open(&workload.netns).ok().map(Into::into),
            })
            .collect()
    }
}

/// Removes a record; a failure is logged (the record names a pod that has left).
pub(super) fn remove(path: &Path) {
    if let Err(err) = fs::remove_file(path)
        && err.kind() != std::io::ErrorKind::NotFound
    {
        warn!(path = %path.display(), error = %err, "removing an ambient record");
    }
}

fn read(path: &Path) -> Option<Workload> {
    let bytes = fs::read(path).ok()?;
    match serde_json::from_slice(&bytes) {
        Ok(workload) => Some(workload),
        Err(err) => {
            warn!(path = %path.display(), error = %err, "ignoring an unreadable ambient record");
            None
        }
    }
}

/// The agent's own state could not be written.
pub(super) fn state(path: &Path, err: &impl std::fmt::Display) -> AmbientError {
    AmbientError::State {
        path: path.to_owned(),
        reason: err.to_string(),
    }
}
