//! What a starting agent makes of the ambient pods an earlier one enrolled: the captures and
//! records of pods whose netns went while no agent ran dropped, pods an earlier agent captured
//! the other way (`ambient.inKernel` switched since) moved to this one's, and, with
//! `ambient.reconcileIptablesOnStartup`, every enrolled pod's capture made this build's.
use std::sync::Arc;

use meshcap_policy::{DataplaneMode, ambient::AmbientConfig};
use tracing::{info, warn};

use super::{
    AmbientError, handback,
    records::{self, Records},
};
use crate::{
    backend::{CaptureBackend, PodPolicy},
    pod::PodRef,
};

/// Drops the ambient captures `backend` holds whose netns is gone; returns those pods.
pub(super) fn drop_gone(backend: &dyn CaptureBackend) -> Result<Vec<PodRef>, AmbientError> {
    let mut dropped = Vec::new();
    for pod in backend.gone(DataplaneMode::Ambient)? {
        if backend.drop_if_gone(&pod)? {
            dropped.push(pod);
        }
    }
    Ok(dropped)
}

/// Pods whose netns went while no agent ran: their captures went with it, and no ztunnel is to
/// be told about them. (A record of what ztunnel is told is written before the capture's own,
/// so that of a pod whose ADD was cut off may stand alone: it goes too.)
pub(super) fn drop_left(
    now: &dyn CaptureBackend,
    earlier: Option<&Arc<dyn CaptureBackend>>,
    records: &Records,
) -> Result<(), AmbientError> {
    drop_gone(now)?;
    if let Some(earlier) = earlier {
        drop_gone(earlier.as_ref())?;
    }
    for (path, workload) in records.all() {
        if !workload.netns.exists() {
            records::remove(&path);
        }
    }
    Ok(())
}

/// `ambient.reconcileIptablesOnStartup`, as Istio's node agent's `reconcileExistingPod`: the
/// in-pod capture of every pod already enrolled is made this build's, from the policy the pod
/// was enrolled with and the node's settings now. Nothing happens to a pod whose capture is
/// already that; a failure is logged and leaves the pod as it was, as in Istio.
pub(super) fn reconcile(backend: &dyn CaptureBackend, records: &Records, config: &AmbientConfig) {
    for held in held_by(backend, records, config, "reconciling in-pod rules", true) {
        let Some(policy) = held.capture.clone() else {
            continue;
        };
        if let Err(err) = backend.add(&held.pod, &policy) {
            warn!(pod = %held.pod, error = %err, "reconciling in-pod rules failed: the pod keeps the rules it had; restart it, or take it out of ambient mode and back");
        }
    }
}

/// Moves every enrolled pod `earlier` captures (an agent before this one, with
/// `ambient.inKernel` the other way) to `now`: captured by `now`, then released by `earlier`,
/// then captured by `now` once more, as both keep the same reply route (the release took it):
/// the pod is captured throughout. A pod that cannot be moved keeps the capture it has, with a
/// warning naming it; the next start tries again.
pub(super) fn move_captures(
    earlier: &dyn CaptureBackend,
    now: &dyn CaptureBackend,
    records: &Records,
    config: &AmbientConfig,
) {
    let (from, to) = (earlier.name(), now.name());
    // Pods adopted from istio-cni keep Istio's rules until they go.
    for held in held_by(earlier, records, config, "moving captures", false) {
        let Some(policy) = held.capture.clone() else {
            warn!(pod = %held.pod, from, "an enrolled pod's record has no policy (an older build's): it keeps the capture it has");
            continue;
        };
        let pod = &held.pod;
        let moved = now
            .add(pod, &policy)
            .and_then(|()| earlier.remove(pod))
            .and_then(|()| now.add(pod, &policy))
            .and_then(|()| now.forget_found_routes(pod));
        match moved {
            Ok(()) => {
                info!(pod = %pod, from, to, "ambient.inKernel changed: the enrolled pod's capture moved");
            }
            Err(err) => {
                warn!(pod = %pod, from, to, error = %err, "moving an enrolled pod's capture failed: it stays captured as it was, and only this agent's next start can release it; restart the pod, or the agent to try again");
            }
        }
    }
}

/// An enrolled pod a backend holds.
struct Held {
    pod: PodRef,
    /// Its capture, as enrolled (none in records of builds before the policy was kept).
    capture: Option<PodPolicy>,
}

/// The enrolled pods `backend` holds (those adopted from istio-cni only with `adopted`); none
/// when its captures cannot be listed (logged, as `doing`).
fn held_by(
    backend: &dyn CaptureBackend,
    records: &Records,
    config: &AmbientConfig,
    doing: &str,
    adopted: bool,
) -> Vec<Held> {
    let captured: Vec<String> = match backend.list(DataplaneMode::Ambient) {
        Ok(captured) => captured
            .into_iter()
            .filter(|c| adopted || !c.adopted)
            .map(|c| c.pod.container_id)
            .collect(),
        Err(err) => {
            warn!(error = %err, capture = backend.name(), "{doing}: the captures cannot be listed");
            return Vec::new();
        }
    };
    records
        .all()
        .filter(|(_, w)| captured.contains(&w.container_id))
        .map(|(_, w)| Held {
            pod: w.pod(),
            capture: handback::capture_of(w, config),
        })
        .collect()
}
