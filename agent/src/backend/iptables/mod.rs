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
//! - **Idempotence and updates**: what was applied is recorded per pod (the rules backends'
//!   [`Records`], in memory and in `<state dir>/iptables/<container id>.json`, so a restarted
//!   agent still knows; DEL's course is theirs too, [`Records::release`]). A repeated
//!   ADD with the same rules is a no-op after a check; a different policy is swapped in one
//!   `iptables-restore` transaction per table (inverse of the old rules, then the new ones).
//!   A failure part-way rolls back what this call applied.
//! - **TPROXY**: the policy route over netlink ([`crate::podnet::route`]).
//! - **The node's rules** (ambient mode's probe SNAT): [`node`].
mod adopt;
mod flavour;
mod inpod;
mod legacy_tables;
pub mod node;
mod records;
mod restore;
mod verify;
mod xtables;

use std::{
    fs,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
};

pub use flavour::{Flavour, FlavourChoice};
use inpod::Ctx;
use meshcap_policy::{DataplaneMode, InterceptionMode, IptablesRules, PolicyRoutes};
use records::Applied;
use tracing::{debug, info, warn};
use verify::{Then, Whole};
use xtables::Xtables;

use super::{
    BackendError, CaptureBackend, CapturedPod, PodCheck, PodPolicy, Verify,
    baseline::Baselines,
    records::{Record as _, Records},
    rules_backend::not_captured,
};
use crate::{crashpoint, pod::PodRef, podnet};

/// Backend configuration.
#[derive(Clone, Debug)]
pub struct IptablesConfig {
    /// Where records of applied rules and the per-netns lock files live.
    pub state_dir: PathBuf,
    /// Which iptables.
    pub flavour: FlavourChoice,
}

/// Nothing: what a removed capture is swapped for.
fn nothing(_: &IptablesRules) -> IptablesRules {
    IptablesRules {
        v4: String::new(),
        v6: None,
        routes: PolicyRoutes::default(),
    }
}

/// What keeps conntrack on in a pod's netns: a chain no rule jumps to (no packet crosses it)
/// with one conntrack match, which the kernel counts as a user of the netns' conntrack.
const KEEP_CONNTRACK: &str = "*nat\n-N MESHCAP_CONNTRACK\n-A MESHCAP_CONNTRACK -m conntrack --ctstate INVALID -j RETURN\nCOMMIT\n";

/// What `rules` are swapped for when the kernel programs take their pod in place
/// ([`CaptureBackend::hand_over`]): [`KEEP_CONNTRACK`] in each family they cover. The
/// connections their `REDIRECT`s made keep their NAT only while conntrack runs in the netns,
/// and those rules were its only users there: without one, the kernel stops tracking the
/// netns once they go (after an RCU grace period), and an established connection's next
/// packet goes to its original destination (the app's, on inbound; a peer that answers RST,
/// on outbound). NAT itself goes on: iptables never deletes the `nat` table's base chains.
fn keeping_conntrack(rules: &IptablesRules) -> IptablesRules {
    IptablesRules {
        v4: KEEP_CONNTRACK.to_owned(),
        v6: rules.v6.as_ref().map(|_| KEEP_CONNTRACK.to_owned()),
        routes: PolicyRoutes::default(),
    }
}

/// The iptables backend.
#[derive(Debug)]
pub struct IptablesBackend {
    records: Records<Applied>,
    locks: PathBuf,
    flavour: FlavourChoice,
    /// The verifier's view of each pod's tables when its rules were last found whole.
    baselines: Baselines,
}

impl IptablesBackend {
    /// Whether `state_dir` holds records of pods an earlier agent captured with this backend
    /// (they keep its rules until they go). Reads the directory only; creates nothing.
    #[must_use]
    pub fn has_records(state_dir: &std::path::Path) -> bool {
        Records::<Applied>::present(state_dir)
    }

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
        let records = Records::open(&config.state_dir)?;
        info!(adopted = records.count(), flavour = ?config.flavour, "iptables backend ready");
        Ok(Self {
            records,
            locks,
            flavour: config.flavour,
            baselines: Baselines::open(&config.state_dir, "iptables"),
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
    /// ([`meshcap_policy::ambient::InpodPolicy::render`]), with their interception mode and
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
            // A first capture: the policy routes already there are not meshcap's.
            let found_routes = match &previous {
                Some(prev) => prev.found_routes.clone(),
                None => ctx.found_routes(&rules.routes)?,
            };
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
                found_routes,
                adopted: false,
            };
            self.records.save(&intent)?;
            let old = previous
                .as_ref()
                .filter(|p| p.replacing.is_empty())
                .map(|p| p.owned(&p.rules));
            if let Err(err) = ctx.swap(flavour, old.as_ref(), rules) {
                if previous.is_none() {
                    // Nothing of meshcap's was there: what the netns holds is not its to
                    // remove (another agent's rules), and the swap undid its own part.
                    self.records.forget(&pod.container_id);
                    return Err(err);
                }
                // The netns is not as recorded: rules removed behind meshcap's back, or the
                // leftovers of an interrupted call. What is there of every rule set the record
                // names goes, then the new set is applied whole.
                warn!(error = %err, "the pod's rules are not as recorded: removing what is left and applying them afresh");
                for set in intent.rule_sets() {
                    ctx.scrub(flavour, &intent.owned(set))?;
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
        Ok(())
    }

    /// Whether the pod's netns holds `rules` as recorded: its tables unchanged since the
    /// verifier last found them whole ([`crate::backend::baseline`]: one netlink request, or
    /// the legacy tables read in process), or as another pod's with the same rules were, else
    /// every rule asked for; and its policy route. (An ADD of a pod already captured so, and a
    /// start reconciling every ambient pod, pay no fork per rule but for the first pod of each
    /// kind when no baseline was kept.)
    fn verify(&self, pod: &PodRef, rules: &IptablesRules) -> Result<(), BackendError> {
        let (id, record) = self.records.applied_whole(pod, rules)?;
        let baseline = self.baselines.get(&id);
        let then = Then {
            baseline: baseline.as_ref(),
            elsewhere: &self.baselines,
        };
        let (missing, found) = self.in_netns(pod, |ctx| {
            Ok(match ctx.whole(record.flavour, rules, then)? {
                Whole::Found(now) => (ctx.missing_route(rules)?, Some(now)),
                Whole::Missing(rule) => (Some(rule), None),
            })
        })?;
        match missing {
            None => {
                if let Some(now) = found {
                    self.baselines.set(&id, now);
                }
                Ok(())
            }
            Some(missing) => Err(not_captured(pod, missing)),
        }
    }

    /// Releases `pod`'s capture, swapping its rules for what `after` makes of them in one
    /// transaction per table.
    fn release(
        &self,
        pod: &PodRef,
        after: fn(&IptablesRules) -> IptablesRules,
    ) -> Result<(), BackendError> {
        let released = self.records.release(pod, |target, record| {
            self.in_netns(target, |ctx| {
                let replaced = after(&record.rules);
                let removed = if record.replacing.is_empty() {
                    ctx.swap(record.flavour, Some(&record.owned(&record.rules)), &replaced)
                } else {
                    Err(ctx.xt.failed(
                        "an earlier ADD".into(),
                        "did not finish: the netns may hold more than one rule set",
                    ))
                };
                if let Err(err) = removed {
                    // Part of the capture is already gone (removed behind meshcap's back, or by
                    // an interrupted call), or more than one rule set may be there: remove what
                    // is left of each, whatever it is.
                    warn!(error = %err, "the pod's rules are not as recorded: removing what is left");
                    for set in record.rule_sets() {
                        ctx.scrub(record.flavour, &record.owned(set))?;
                    }
                    ctx.swap(record.flavour, None, &replaced)?;
                }
                Ok(())
            })
        });
        self.baselines.retain(|id| self.records.get(id).is_some());
        released
    }

    fn in_netns<T: Send>(
        &self,
        pod: &PodRef,
        f: impl FnOnce(&mut Ctx<'_>) -> Result<T, BackendError> + Send,
    ) -> Result<T, BackendError> {
        let pod_name = pod.to_string();
        let lock = self.lock_file(&pod.netns);
        let podnet_error = |source| BackendError::PodNet {
            pod: pod.to_string(),
            source,
        };
        let userns = podnet::userns::owner_of(&pod.netns).map_err(podnet_error)?;
        podnet::run_in(&pod.netns, |visit| {
            f(&mut Ctx {
                xt: Xtables {
                    who: pod_name,
                    lock: Some(lock),
                    userns,
                },
                visit,
            })
        })
        .map_err(podnet_error)?
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
        Ok(self.records.prune_gone())
    }

    fn verify(&self, pod: &PodRef, verify: Verify) -> Result<PodCheck, BackendError> {
        self.verify_pod(pod, verify)
    }

    fn gone(&self, mode: DataplaneMode) -> Result<Vec<PodRef>, BackendError> {
        Ok(self.records.gone(mode))
    }

    fn drop_if_gone(&self, pod: &PodRef) -> Result<bool, BackendError> {
        Ok(self.records.drop_if_gone(pod))
    }

    #[tracing::instrument(name = "iptables_remove", skip_all, fields(pod = %pod, container = %pod.container_id))]
    fn remove(&self, pod: &PodRef) -> Result<(), BackendError> {
        self.release(pod, nothing)
    }

    #[tracing::instrument(name = "iptables_hand_over", skip_all, fields(pod = %pod, container = %pod.container_id))]
    fn hand_over(&self, pod: &PodRef) -> Result<(), BackendError> {
        self.release(pod, keeping_conntrack)
    }

    #[tracing::instrument(name = "iptables_check", skip_all, fields(pod = %pod, container = %pod.container_id))]
    fn check(&self, pod: &PodRef, policy: &PodPolicy) -> Result<(), BackendError> {
        self.verify(pod, &Self::rules(policy).0)
    }

    fn list(&self, mode: DataplaneMode) -> Result<Vec<CapturedPod>, BackendError> {
        Ok(self.records.list(mode))
    }

    fn forget_found_routes(&self, pod: &PodRef) -> Result<(), BackendError> {
        self.records.forget_found_routes(&pod.container_id)
    }

    #[tracing::instrument(name = "iptables_adopt", skip_all, fields(pod = %pod, container = %pod.container_id))]
    fn adopt(
        &self,
        pod: &PodRef,
        policy: &PodPolicy,
        reconcile: bool,
    ) -> Result<super::Adoption, BackendError> {
        self.adopt_pod(pod, policy, reconcile)
    }
}
