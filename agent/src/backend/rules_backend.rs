//! What the two rules backends (`iptables`, `nftables`) do alike around their [`Records`]:
//!
//! - **DEL** ([`Records::release`]): the record found by container or netns; a netns already
//!   gone took the rules with it, so only the record goes; else the backend removes whatever
//!   of every rule set the record names is there, and the record is forgotten last, so that a
//!   DEL stopped part-way is completed by the next one.
//! - **CHECK** and an idempotent ADD ([`Records::applied_whole`]): the record must say that the
//!   policy's rules, and nothing else, were applied to the end before the netns is looked at.
//! - **The verifier** ([`Records::to_verify`]): what the record says, and whether the netns is
//!   there to compare it with; in the netns, the rules' policy route ([`route_drift`]).
//! - **Gone pods and the status list**: read off the records alone.
//!
//! What each backend does inside the netns (iptables' swaps, nftables' transactions) is its
//! own.
use meshcap_policy::{DataplaneMode, PolicyRoutes};
use tracing::{debug, info};

use super::{
    BackendError, CapturedPod, Drift, DriftKind, PodCheck, Verify,
    records::{Record, Records},
};
use crate::{
    crashpoint,
    pod::PodRef,
    podnet::{Visit, route},
};

/// CHECK's error: `pod` is not captured as its policy says, `missing` saying how.
pub(super) fn not_captured(pod: &PodRef, missing: String) -> BackendError {
    BackendError::NotCaptured {
        pod: pod.to_string(),
        missing,
    }
}

/// The verifier's look at the policy route `routes` need (TPROXY's, ambient mode's) in the
/// visited netns of `pod` (its name): a drift when it is missing, put back as `verify` says.
pub(super) fn route_drift(
    visit: &mut Visit,
    pod: &str,
    routes: &PolicyRoutes,
    verify: Verify,
) -> Result<Option<Drift>, BackendError> {
    if routes.mark_route.is_none() {
        return Ok(None);
    }
    let missing = visit
        .netlink()
        .and_then(|netlink| route::missing(netlink, routes))
        .map_err(|source| BackendError::PodNet {
            pod: pod.to_owned(),
            source,
        })?;
    Ok(missing.map(|missing| {
        verify.handle(DriftKind::Route, format!("{missing} is missing"), || {
            visit
                .netlink()
                .and_then(|netlink| route::update(netlink, &PolicyRoutes::default(), routes))
        })
    }))
}

impl<R: Record> Records<R> {
    /// DEL: `remove` takes what the record of `pod` names out of the netns (given the pod whose
    /// netns to enter: the DEL's, or the recorded one's when the runtime gave none), then the
    /// record goes. Nothing recorded, or the netns gone: only the record goes.
    pub(super) fn release(
        &self,
        pod: &PodRef,
        remove: impl FnOnce(&PodRef, &R) -> Result<(), BackendError>,
    ) -> Result<(), BackendError> {
        let Some((recorded_id, record)) = self.recorded(pod) else {
            debug!("nothing applied for this container");
            return Ok(());
        };
        let target = if pod.netns.as_os_str().is_empty() {
            record.pod()
        } else {
            pod
        };
        if !target.netns.exists() {
            debug!(netns = %target.netns.display(), "netns gone: its rules went with it");
            self.forget(&recorded_id);
            return Ok(());
        }
        remove(target, &record)?;
        crashpoint::here(R::REMOVED);
        self.forget(&recorded_id);
        info!("{} rules removed", R::BACKEND);
        Ok(())
    }

    /// The record of `pod`, and the id it is under, when it says that `rules` were applied
    /// whole (what is in the netns is for the caller to compare); else
    /// [`BackendError::NotCaptured`] saying why not.
    pub(super) fn applied_whole(
        &self,
        pod: &PodRef,
        rules: &R::Rules,
    ) -> Result<(String, R), BackendError> {
        let Some((id, record)) = self.recorded(pod) else {
            return Err(not_captured(
                pod,
                "meshcap never applied rules to this container".into(),
            ));
        };
        if !record.replacing().is_empty() {
            return Err(not_captured(
                pod,
                "an earlier ADD or update did not finish (ADD again)".into(),
            ));
        }
        if record.rules() != rules {
            return Err(not_captured(
                pod,
                "the applied rules are not the ones the pod's current policy renders (ADD again to update)".into(),
            ));
        }
        Ok((id, record))
    }

    /// The verifier's look at `pod`'s record: what is installed, in `describe`'s words, with
    /// the record and the id it is under when its netns is there to compare; else (nothing
    /// recorded, an ADD that did not finish, the netns gone) the whole check.
    pub(super) fn to_verify(
        &self,
        pod: &PodRef,
        describe: impl FnOnce(&R) -> String,
    ) -> Result<(PodCheck, String, R), PodCheck> {
        let mut check = PodCheck::default();
        let Some((id, record)) = self.recorded(pod) else {
            return Err(check);
        };
        check.installed.push(describe(&record));
        if !record.replacing().is_empty() {
            check
                .installed
                .push("an ADD or update did not finish: the next ADD completes it".to_owned());
            return Err(check);
        }
        if !record.pod().netns.exists() {
            check.installed.push(format!(
                "netns {} is gone (its record is dropped within --gone-check-seconds)",
                record.pod().netns.display()
            ));
            return Err(check);
        }
        Ok((check, id, record))
    }

    /// The pods of `mode` whose netns no longer exists.
    pub(super) fn gone(&self, mode: DataplaneMode) -> Vec<PodRef> {
        self.of_mode(mode)
            .into_iter()
            .filter(|record| !record.pod().netns.exists())
            .map(|record| record.pod().clone())
            .collect()
    }

    /// At start: drops the records of the pods, of either mode, whose netns is gone, and
    /// returns those pods.
    pub(super) fn prune_gone(&self) -> Vec<PodRef> {
        let gone: Vec<PodRef> = [DataplaneMode::Sidecar, DataplaneMode::Ambient]
            .into_iter()
            .flat_map(|mode| self.gone(mode))
            .collect();
        for pod in &gone {
            // The rules lived in the netns and went with it: only the record is left.
            self.forget(&pod.container_id);
            info!(pod = %pod, container = %pod.container_id, netns = %pod.netns.display(), "netns gone: record dropped");
        }
        gone
    }

    /// Drops the record of `pod` if its netns is gone, and says whether it did.
    pub(super) fn drop_if_gone(&self, pod: &PodRef) -> bool {
        let Some((id, record)) = self.recorded(pod) else {
            return false;
        };
        let recorded = record.pod();
        if recorded.netns.exists() {
            return false;
        }
        // The rules lived in the netns and went with it: only the record is left.
        self.forget(&id);
        info!(pod = %recorded, container = %id, netns = %recorded.netns.display(), "netns gone without a DEL this agent saw: record dropped");
        true
    }

    /// The captures of `mode`, as the status report lists them, by namespace and name.
    pub(super) fn list(&self, mode: DataplaneMode) -> Vec<CapturedPod> {
        let mut out: Vec<CapturedPod> = self
            .of_mode(mode)
            .into_iter()
            .map(|record| CapturedPod {
                summary: format!("{} via {}", record.capture(), record.via()),
                adopted: record.adopted(),
                pod: record.pod().clone(),
                backend: R::BACKEND.to_owned(),
            })
            .collect();
        out.sort_by(|a, b| (&a.pod.namespace, &a.pod.name).cmp(&(&b.pod.namespace, &b.pod.name)));
        out
    }
}
