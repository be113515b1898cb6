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
//! - **Idempotence and updates**: what was applied is recorded per pod (`records`: in memory
//!   and in `<state dir>/iptables/<container id>.json`, so a restarted agent still knows). A repeated
//!   ADD with the same rules is a no-op after a check; a different policy is swapped in one
//!   `iptables-restore` transaction per table (inverse of the old rules, then the new ones).
//!   A failure part-way rolls back what this call applied.
//! - **TPROXY**: the policy route over netlink ([`crate::podnet::route`]).
//! - **The node's rules** (ambient mode's probe SNAT): [`node`].
mod flavour;
mod inpod;
pub mod node;
mod records;
mod restore;
mod xtables;

use std::{
    fs,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
};

pub use flavour::{Flavour, FlavourChoice};
use inpod::Ctx;
use records::{Applied, Records};
use tracing::{debug, info, warn};
use xtables::Xtables;

use super::{BackendError, CaptureBackend, CapturedPod, PodPolicy};
use crate::{
    crashpoint,
    pod::PodRef,
    podnet,
    policy::{DataplaneMode, Family, InterceptionMode, IptablesRules, PolicyRoutes},
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

/// The iptables backend.
#[derive(Debug)]
pub struct IptablesBackend {
    records: Records,
    locks: PathBuf,
    flavour: FlavourChoice,
}

impl IptablesBackend {
    /// Opens the backend and adopts the records of a previous run.
    ///
    /// # Errors
    /// When the state directory cannot be created or read.
    pub fn new(config: &IptablesConfig) -> Result<Self, BackendError> {
        let locks = config.state_dir.join("xtables-locks");
        fs::create_dir_all(&locks).map_err(|e| BackendError::State {
            path: locks.clone(),
            reason: e.to_string(),
        })?;
        let records = Records::open(config.state_dir.join("iptables"))?;
        info!(adopted = records.count(), flavour = ?config.flavour, "iptables backend ready");
        Ok(Self {
            records,
            locks,
            flavour: config.flavour,
        })
    }

    /// The lock file for one netns: its device and inode identify it.
    fn lock_file(&self, netns: &Path) -> PathBuf {
        let id = fs::metadata(netns).map_or_else(
            |_| "unknown".to_owned(),
            |m| format!("{}-{}", m.dev(), m.ino()),
        );
        self.locks.join(format!("{id}.lock"))
    }

    /// The rules a policy renders: Istio's sidecar rules, or ambient mode's in-pod rules
    /// ([`crate::policy::ambient::InpodPolicy::render`]), with their interception mode and
    /// whether they are ambient mode's. Both get the same records, rollback and crash
    /// consistency.
    fn rules(policy: &PodPolicy) -> (IptablesRules, InterceptionMode, bool) {
        match policy {
            PodPolicy::Sidecar(policy) => (policy.render(), policy.mode, false),
            PodPolicy::Ambient(ambient) => {
                (ambient.policy.render(), InterceptionMode::Redirect, true)
            }
        }
    }

    /// Applies `rules` to the pod's netns, recorded (ahead) so that a DEL, an ADD or a
    /// restarted agent removes whatever of them is there.
    fn apply(
        &self,
        pod: &PodRef,
        rules: &IptablesRules,
        mode: InterceptionMode,
        ambient: bool,
    ) -> Result<(), BackendError> {
        let previous = self.records.get(&pod.container_id);
        if let Some(prev) = &previous
            && prev.rules == *rules
            && prev.replacing.is_empty()
            && self.verify(pod, rules).is_ok()
        {
            debug!("already captured with these rules");
            return Ok(());
        }
        let choice = self.flavour;
        let record = self.in_netns(pod, |ctx| {
            let flavour = previous
                .as_ref()
                .map_or_else(|| ctx.xt.detect(choice), |p| p.flavour);
            // Written ahead: from here on the netns may hold the old rules, the new ones or a
            // mix (an agent killed part-way), and the record says so, so that whoever comes
            // next (a DEL, an ADD, a restarted agent) removes whatever of them is there.
            let intent = Applied {
                pod: pod.clone(),
                flavour,
                rules: rules.clone(),
                replacing: previous
                    .iter()
                    .flat_map(Applied::rule_sets)
                    .filter(|r| *r != rules)
                    .cloned()
                    .collect(),
                mode,
                ambient,
            };
            self.records.save(&intent)?;
            self.records.insert(intent.clone());
            let old = previous
                .as_ref()
                .filter(|p| p.replacing.is_empty())
                .map(|p| &p.rules);
            if let Err(err) = ctx.swap(flavour, old, rules) {
                // The netns is not as recorded: rules removed behind meshcap's back, or the
                // leftovers of an interrupted call. What is there of every rule set the record
                // names goes, then the new set is applied whole.
                warn!(error = %err, "the pod's rules are not as recorded: removing what is left and applying them afresh");
                for set in intent.rule_sets() {
                    ctx.scrub(flavour, set)?;
                }
                ctx.swap(flavour, None, rules)?;
            }
            Ok(intent)
        })?;
        crashpoint::here(crashpoint::IPTABLES_ADD_APPLIED);
        let record = Applied {
            replacing: Vec::new(),
            ..record
        };
        self.records.save(&record)?;
        info!(flavour = ?record.flavour, %mode, ambient, "iptables rules applied");
        self.records.insert(record);
        Ok(())
    }

    /// Whether the pod's netns holds `rules` as recorded.
    fn verify(&self, pod: &PodRef, rules: &IptablesRules) -> Result<(), BackendError> {
        let not_captured = |missing: String| BackendError::NotCaptured {
            pod: pod.to_string(),
            missing,
        };
        let Some((_, record)) = self.records.recorded(pod) else {
            return Err(not_captured(
                "meshcap never applied rules to this container".into(),
            ));
        };
        if !record.replacing.is_empty() {
            return Err(not_captured(
                "an earlier ADD or update did not finish (ADD again)".into(),
            ));
        }
        if record.rules != *rules {
            return Err(not_captured(
                "the applied rules are not the ones the pod's current policy renders (ADD again to update)".into(),
            ));
        }
        match self.in_netns(pod, |ctx| ctx.first_missing(record.flavour, rules))? {
            None => Ok(()),
            Some(missing) => Err(not_captured(missing)),
        }
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
                xt: Xtables {
                    who: pod_name,
                    lock: Some(lock),
                },
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
    fn add(&self, pod: &PodRef, policy: &PodPolicy) -> Result<(), BackendError> {
        let (rules, mode, ambient) = Self::rules(policy);
        self.apply(pod, &rules, mode, ambient)
    }

    fn prune_gone(&self) -> Result<Vec<PodRef>, BackendError> {
        let gone: Vec<PodRef> = [DataplaneMode::Sidecar, DataplaneMode::Ambient]
            .into_iter()
            .flat_map(|mode| self.records.of_mode(mode))
            .filter(|record| !record.pod.netns.exists())
            .map(|record| record.pod)
            .collect();
        for pod in &gone {
            // The rules lived in the netns and went with it: only the record is left.
            self.records.forget(&pod.container_id);
            info!(pod = %pod, container = %pod.container_id, netns = %pod.netns.display(), "netns gone: record dropped");
        }
        Ok(gone)
    }

    fn gone(&self, mode: DataplaneMode) -> Result<Vec<PodRef>, BackendError> {
        Ok(self
            .records
            .of_mode(mode)
            .into_iter()
            .filter(|record| !record.pod.netns.exists())
            .map(|record| record.pod)
            .collect())
    }

    fn drop_if_gone(&self, pod: &PodRef) -> Result<bool, BackendError> {
        let Some((id, record)) = self.records.recorded(pod) else {
            return Ok(false);
        };
        if record.pod.netns.exists() {
            return Ok(false);
        }
        // The rules lived in the netns and went with it: only the record is left.
        self.records.forget(&id);
        info!(pod = %record.pod, container = %id, netns = %record.pod.netns.display(), "netns gone without a DEL this agent saw: record dropped");
        Ok(true)
    }

    #[tracing::instrument(name = "iptables_remove", skip_all, fields(pod = %pod, container = %pod.container_id))]
    fn remove(&self, pod: &PodRef) -> Result<(), BackendError> {
        let Some((recorded_id, record)) = self.records.recorded(pod) else {
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
            self.records.forget(&recorded_id);
            return Ok(());
        }
        self.in_netns(&target, |ctx| {
            let removed = if record.replacing.is_empty() {
                ctx.swap(record.flavour, Some(&record.rules), &nothing())
            } else {
                Err(ctx.xt.failed(
                    "an earlier ADD".into(),
                    "did not finish: the netns may hold more than one rule set",
                ))
            };
            if let Err(err) = removed {
                // Part of the capture is already gone (removed behind meshcap's back, or by an
                // interrupted call), or more than one rule set may be there: remove what is
                // left of each, whatever it is.
                warn!(error = %err, "the pod's rules are not as recorded: removing what is left");
                for set in record.rule_sets() {
                    ctx.scrub(record.flavour, set)?;
                }
            }
            Ok(())
        })?;
        crashpoint::here(crashpoint::IPTABLES_REMOVE_REMOVED);
        self.records.forget(&recorded_id);
        info!("iptables rules removed");
        Ok(())
    }

    #[tracing::instrument(name = "iptables_check", skip_all, fields(pod = %pod, container = %pod.container_id))]
    fn check(&self, pod: &PodRef, policy: &PodPolicy) -> Result<(), BackendError> {
        self.verify(pod, &Self::rules(policy).0)
    }

    fn list(&self, mode: DataplaneMode) -> Result<Vec<CapturedPod>, BackendError> {
        let mut out: Vec<CapturedPod> = self
            .records
            .of_mode(mode)
            .iter()
            .map(|a| CapturedPod {
                pod: a.pod.clone(),
                backend: self.name().to_owned(),
                summary: format!(
                    "{} via {}{}",
                    if a.ambient {
                        "ambient (ztunnel)".to_owned()
                    } else {
                        a.mode.to_string()
                    },
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
