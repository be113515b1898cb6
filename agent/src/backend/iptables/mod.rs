//! The iptables fallback: Istio's own rules, rendered by the policy module, applied in the
//! pod's network namespace with `iptables-restore --noflush`.
//!
//! - **Which iptables**: as Istio decides (`tools/istio-iptables/pkg/dependencies`): legacy
//!   when `iptables-legacy-save` already shows rules in the pod's netns, else nft when
//!   `iptables-nft-save` works, else plain `iptables`; `--iptables-flavour` forces one (Istio's
//!   `FORCE_IPTABLES_BINARY`).
//! - **Lock**: legacy iptables serializes on `/run/xtables.lock`, one file for the whole node,
//!   so one slow pod (or the host's kube-proxy) would stall every other pod. Istio bind-mounts a
//!   per-netns file over it in a private mount namespace; meshcap gets the same effect with
//!   less machinery: `XTABLES_LOCKFILE` (iptables ≥ 1.8.3) points each netns at its own lock
//!   file, and `-w` waits for it. Two operations on one pod are already serialized by the
//!   agent, so the lock only guards against foreign writers in that netns. nft takes no lock.
//! - **Idempotence and updates**: what was applied is recorded per pod (in memory and in
//!   `<state dir>/iptables/<container id>.json`, so a restarted agent still knows). A repeated
//!   ADD with the same rules is a no-op after a check; a different policy is swapped in one
//!   `iptables-restore` transaction per table (inverse of the old rules, then the new ones).
//!   A failure part-way rolls back what this call applied.
//! - **TPROXY**: the policy route over netlink ([`crate::podnet::route`]).
mod flavour;
mod inpod;
mod restore;

use std::{
    collections::HashMap,
    fs,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    sync::Mutex,
};

pub use flavour::{Flavour, FlavourChoice};
use inpod::Ctx;
use serde::{Deserialize, Serialize};
use tracing::{debug, info, warn};

use super::{BackendError, CaptureBackend, CapturedPod, PodRef};
use crate::{
    podnet,
    policy::{Family, InterceptionMode, IptablesRules, PolicyRoutes, RedirectPolicy},
};

/// Backend configuration.
#[derive(Clone, Debug)]
pub struct IptablesConfig {
    /// Where records of applied rules and the per-netns lock files live.
    pub state_dir: PathBuf,
    /// Which iptables.
    pub flavour: FlavourChoice,
}

/// Nothing: what a removed capture is swapped for.
fn nothing() -> IptablesRules {
    IptablesRules {
        v4: String::new(),
        v6: None,
        routes: PolicyRoutes::default(),
    }
}

/// What was applied to a pod.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Applied {
    pod: PodRef,
    flavour: Flavour,
    rules: IptablesRules,
    mode: InterceptionMode,
}

/// The iptables backend.
#[derive(Debug)]
pub struct IptablesBackend {
    records: PathBuf,
    locks: PathBuf,
    flavour: FlavourChoice,
    applied: Mutex<HashMap<String, Applied>>,
}

impl IptablesBackend {
    /// Opens the backend and adopts the records of a previous run.
    ///
    /// # Errors
    /// When the state directory cannot be created or read.
    pub fn new(config: &IptablesConfig) -> Result<Self, BackendError> {
        let records = config.state_dir.join("iptables");
        let locks = config.state_dir.join("xtables-locks");
        for dir in [&records, &locks] {
            fs::create_dir_all(dir).map_err(|e| BackendError::State {
                path: dir.clone(),
                reason: e.to_string(),
            })?;
        }
        let mut applied = HashMap::new();
        let entries = fs::read_dir(&records).map_err(|e| BackendError::State {
            path: records.clone(),
            reason: e.to_string(),
        })?;
        for entry in entries.flatten() {
            let path = entry.path();
            match fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<Applied>(&b).map_err(|e| e.to_string()))
            {
                Ok(record) => {
                    applied.insert(record.pod.container_id.clone(), record);
                }
                Err(reason) => {
                    warn!(path = %path.display(), %reason, "ignoring unreadable iptables record")
                }
            }
        }
        info!(adopted = applied.len(), flavour = ?config.flavour, "iptables backend ready");
        Ok(Self {
            records,
            locks,
            flavour: config.flavour,
            applied: Mutex::new(applied),
        })
    }

    fn record_path(&self, container_id: &str) -> PathBuf {
        // Container IDs are hex from the runtime, but never trust a file name.
        let safe: String = container_id
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        self.records.join(format!("{safe}.json"))
    }

    fn save(&self, record: &Applied) -> Result<(), BackendError> {
        let path = self.record_path(&record.pod.container_id);
        let tmp = path.with_extension("json.tmp");
        let write = || -> std::io::Result<()> {
            fs::write(
                &tmp,
                serde_json::to_vec(record).map_err(std::io::Error::other)?,
            )?;
            fs::rename(&tmp, &path)
        };
        write().map_err(|e| BackendError::State {
            path,
            reason: e.to_string(),
        })
    }

    fn forget(&self, container_id: &str) {
        let path = self.record_path(container_id);
        if let Err(e) = fs::remove_file(&path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            warn!(path = %path.display(), error = %e, "removing iptables record");
        }
        self.lock().remove(container_id);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Applied>> {
        // A panic while holding the map leaves it consistent (single inserts and removes).
        self.applied
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The lock file for one netns: its device and inode identify it.
    fn lock_file(&self, netns: &Path) -> PathBuf {
        let id = fs::metadata(netns).map_or_else(
            |_| "unknown".to_owned(),
            |m| format!("{}-{}", m.dev(), m.ino()),
        );
        self.locks.join(format!("{id}.lock"))
    }

    fn in_netns<T: Send>(
        &self,
        pod: &PodRef,
        f: impl FnOnce(&mut Ctx<'_>) -> Result<T, BackendError> + Send,
    ) -> Result<T, BackendError> {
        let pod_name = pod.to_string();
        let lock = self.lock_file(&pod.netns);
        podnet::run_in(&pod.netns, |visit| {
            f(&mut Ctx {
                pod: pod_name,
                lock,
                visit,
            })
        })
        .map_err(|source| BackendError::PodNet {
            pod: pod.to_string(),
            source,
        })?
    }
}

impl CaptureBackend for IptablesBackend {
    fn name(&self) -> &'static str {
        "iptables"
    }

    #[tracing::instrument(name = "iptables_add", skip_all, fields(pod = %pod, container = %pod.container_id))]
    fn add(&self, pod: &PodRef, policy: &RedirectPolicy) -> Result<(), BackendError> {
        let rules = policy.render();
        let previous = self.lock().get(&pod.container_id).cloned();
        if let Some(prev) = &previous
            && prev.rules == rules
            && self.check(pod, policy).is_ok()
        {
            debug!("already captured with these rules");
            return Ok(());
        }
        let choice = self.flavour;
        let flavour = self.in_netns(pod, |ctx| {
            let flavour = previous
                .as_ref()
                .map_or_else(|| ctx.detect(choice), |p| p.flavour);
            ctx.swap(flavour, previous.as_ref().map(|p| &p.rules), &rules)?;
            Ok(flavour)
        })?;
        let record = Applied {
            pod: pod.clone(),
            flavour,
            rules,
            mode: policy.mode,
        };
        if let Err(err) = self.save(&record) {
            // Without a record a restarted agent could not remove these rules: undo them.
            let _ = self.in_netns(pod, |ctx| {
                ctx.swap(flavour, Some(&record.rules), &nothing())
            });
            return Err(err);
        }
        info!(?flavour, mode = %policy.mode, "iptables rules applied");
        self.lock().insert(pod.container_id.clone(), record);
        Ok(())
    }

    fn prune_gone(&self) -> Result<Vec<PodRef>, BackendError> {
        let gone: Vec<PodRef> = self
            .lock()
            .values()
            .filter(|record| !record.pod.netns.exists())
            .map(|record| record.pod.clone())
            .collect();
        for pod in &gone {
            // The rules lived in the netns and went with it: only the record is left.
            self.forget(&pod.container_id);
            info!(pod = %pod, container = %pod.container_id, netns = %pod.netns.display(), "netns gone: record dropped");
        }
        Ok(gone)
    }

    #[tracing::instrument(name = "iptables_remove", skip_all, fields(pod = %pod, container = %pod.container_id))]
    fn remove(&self, pod: &PodRef) -> Result<(), BackendError> {
        let Some(record) = self.lock().get(&pod.container_id).cloned() else {
            debug!("nothing applied for this container");
            return Ok(());
        };
        let target = if pod.netns.as_os_str().is_empty() {
            record.pod.clone()
        } else {
            pod.clone()
        };
        if !target.netns.exists() {
            debug!(netns = %target.netns.display(), "netns gone: its rules went with it");
            self.forget(&pod.container_id);
            return Ok(());
        }
        self.in_netns(&target, |ctx| {
            ctx.swap(record.flavour, Some(&record.rules), &nothing())
        })?;
        self.forget(&pod.container_id);
        info!("iptables rules removed");
        Ok(())
    }

    #[tracing::instrument(name = "iptables_check", skip_all, fields(pod = %pod, container = %pod.container_id))]
    fn check(&self, pod: &PodRef, policy: &RedirectPolicy) -> Result<(), BackendError> {
        let rules = policy.render();
        let not_captured = |missing: String| BackendError::NotCaptured {
            pod: pod.to_string(),
            missing,
        };
        let Some(record) = self.lock().get(&pod.container_id).cloned() else {
            return Err(not_captured(
                "meshcap never applied rules to this container".into(),
            ));
        };
        if record.rules != rules {
            return Err(not_captured(
                "the applied rules are not the ones the pod's current policy renders (ADD again to update)".into(),
            ));
        }
        match self.in_netns(pod, |ctx| ctx.first_missing(record.flavour, &rules))? {
            None => Ok(()),
            Some(missing) => Err(not_captured(missing)),
        }
    }

    fn list(&self) -> Result<Vec<CapturedPod>, BackendError> {
        let mut out: Vec<CapturedPod> = self
            .lock()
            .values()
            .map(|a| CapturedPod {
                pod: a.pod.clone(),
                backend: self.name().to_owned(),
                summary: format!(
                    "{} via {}{}",
                    a.mode,
                    a.flavour.binary(false, ""),
                    if a.rules.family(Family::V6).is_some() {
                        ", IPv4+IPv6"
                    } else {
                        ""
                    }
                ),
            })
            .collect();
        out.sort_by(|a, b| (&a.pod.namespace, &a.pod.name).cmp(&(&b.pod.namespace, &b.pod.name)));
        Ok(out)
    }
}
