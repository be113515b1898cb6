//! istio-cni's sidecar captures found at start, made the hub's ([`crate::takeover`]): each
//! pod adopted under its request lock by the node's sidecar backend before the plugin's socket
//! is served, counted (`meshcap_sidecar_adoptions_total`), and a pod left as it is reported:
//! logged, a Warning Event on it, and `explain` until its DEL. With `meshcap.takeover.toKernel`
//! an adopted pod is then moved to the kernel programs in place
//! ([`crate::backend::CaptureBackend::take_in`]), except one whose capture needs a policy
//! route (`TPROXY` mode, rerouted interfaces): Istio's rules own that route, and removing them
//! would take it from under the kernel capture; it keeps Istio's rules, logged.
use std::sync::Arc;

use meshcap_policy::{DataplaneMode, RedirectPolicy};
use tracing::{info, warn};

use super::{CaptureError, Hub, request::off_the_runtime};
use crate::{
    backend::PodPolicy,
    pod::PodRef,
    takeover::{self, IstioCaptured, Taken},
};

/// The Event's reason on a pod whose istio-cni capture is left as it is.
const LEFT: &str = "IstioCaptureNotAdopted";

impl Hub {
    /// Adopts the sidecar pods istio-cni captured (found at start, [`IstioCaptured::on_node`]);
    /// `to_kernel`: then moves each to the kernel programs where they serve the node.
    pub async fn adopt_istio_sidecars(&self, pods: Vec<IstioCaptured>, to_kernel: bool) {
        if pods.is_empty() {
            return;
        }
        let backend = self.captures.router().node_backend().clone();
        let listing = backend.clone();
        let held = match off_the_runtime(move || listing.list(DataplaneMode::Sidecar)).await {
            Ok(Ok(held)) => Arc::new(held),
            Ok(Err(err)) => return self.not_adopted(pods.len(), &err.into()),
            Err(err) => return self.not_adopted(pods.len(), &err),
        };
        for pod in pods {
            let (backend, held) = (backend.clone(), held.clone());
            let moving = to_kernel.then(|| (pod.pod.clone(), pod.policy.clone()));
            let (id, name, uid) = (
                pod.pod.container_id.clone(),
                pod.pod.pod_name(),
                pod.uid.clone(),
            );
            let who = pod.pod.to_string();
            let work = off_the_runtime(move || takeover::adopt(backend.as_ref(), &pod, &held));
            let taken = match self.locks.run(&id, work).await {
                Ok(taken) => taken.map_err(CaptureError::from),
                Err(err) => Err(err),
            };
            match taken {
                Ok(Taken::Adopted(_)) => {
                    self.metrics.sidecar_adoption("adopted");
                    if let Some((pod, policy)) = moving {
                        self.take_in(pod, policy).await;
                    }
                }
                Ok(Taken::Known) => {}
                Ok(Taken::Left(why)) => {
                    self.metrics.sidecar_adoption("left");
                    if let Some(events) = &self.events {
                        events.warn(name.clone(), Some(uid), LEFT, "Adopt", why.clone());
                    }
                    self.left.record(name, why);
                }
                Err(err) => {
                    self.metrics.sidecar_adoption("failed");
                    warn!(pod = who, error = %err, "adopting istio-cni's capture of a sidecar pod failed: it keeps Istio's rules as they are");
                }
            }
        }
        self.captures.update_gauge(&self.metrics);
    }

    /// None of `count` pods could be looked at: the node's captures could not be listed.
    fn not_adopted(&self, count: usize, err: &CaptureError) {
        for _ in 0..count {
            self.metrics.sidecar_adoption("failed");
        }
        warn!(pods = count, error = %err, "listing this agent's captures to adopt istio-cni's sidecar pods failed: they keep Istio's rules as they are");
    }

    /// Moves an adopted pod to the node's backend's own capture (the kernel programs), under
    /// its lock, unless its capture needs a policy route.
    async fn take_in(&self, pod: PodRef, policy: Box<RedirectPolicy>) {
        if policy.routes().mark_route.is_some() {
            info!(%pod, "meshcap.takeover.toKernel: keeps Istio's rules, which own its policy route (TPROXY or rerouted interfaces), until it goes");
            return;
        }
        let backend = self.captures.router().node_backend().clone();
        let id = pod.container_id.clone();
        let who = pod.to_string();
        let policy = PodPolicy::Sidecar(policy);
        let work = off_the_runtime(move || backend.take_in(&pod, &policy));
        let moved = match self.locks.run(&id, work).await {
            Ok(moved) => moved.map_err(CaptureError::from),
            Err(err) => Err(err),
        };
        match moved {
            Ok(true) => info!(
                pod = who,
                "moved from Istio's rules to the kernel programs in place (meshcap.takeover.toKernel)"
            ),
            Ok(false) => {}
            Err(err) => {
                warn!(pod = who, error = %err, "moving an adopted pod to the kernel programs failed: it keeps Istio's rules");
            }
        }
    }
}
