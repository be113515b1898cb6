//! istio-cni's sidecar captures found at start, made the hub's ([`crate::takeover`]): each
//! pod adopted under its request lock by the node's sidecar backend before the plugin's socket
//! is served, counted (`meshcap_sidecar_adoptions_total`), and a pod left as it is reported:
//! logged, a Warning Event on it, and `explain` until its DEL.
use std::sync::Arc;

use tracing::warn;

use super::{CaptureError, Hub, request::off_the_runtime};
use crate::{
    policy::DataplaneMode,
    takeover::{self, IstioCaptured, Taken},
};

/// The Event's reason on a pod whose istio-cni capture is left as it is.
const LEFT: &str = "IstioCaptureNotAdopted";

impl Hub {
    /// Adopts the sidecar pods istio-cni captured (found at start, [`IstioCaptured::on_node`]).
    pub async fn adopt_istio_sidecars(&self, pods: Vec<IstioCaptured>) {
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
                Ok(Taken::Adopted(_)) => self.metrics.sidecar_adoption("adopted"),
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
}
