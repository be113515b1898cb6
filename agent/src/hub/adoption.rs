//! istio-cni's sidecar captures found at start, made the hub's ([`crate::takeover`]): each
//! pod adopted under its request lock by the node's sidecar backend before the plugin's socket
//! is served, counted (`meshcap_sidecar_adoptions_total`), and a pod left as it is reported:
//! logged, a Warning Event on it, and `explain` until its DEL.
use tracing::warn;

use super::{Hub, request::off_the_runtime};
use crate::takeover::{self, IstioCaptured, Taken};

/// The Event's reason on a pod whose istio-cni capture is left as it is.
const LEFT: &str = "IstioCaptureNotAdopted";

impl Hub {
    /// Adopts the sidecar pods istio-cni captured (found at start, [`IstioCaptured::on_node`]).
    pub async fn adopt_istio_sidecars(&self, pods: Vec<IstioCaptured>) {
        for pod in pods {
            let backend = self.captures.router().node_backend().clone();
            let (id, name, uid) = (
                pod.pod.container_id.clone(),
                pod.pod.pod_name(),
                pod.uid.clone(),
            );
            let who = pod.pod.to_string();
            let work = off_the_runtime(move || takeover::adopt(backend.as_ref(), &pod));
            match self.locks.run(&id, work).await {
                Ok(Ok(Taken::Adopted(_))) => self.metrics.sidecar_adoption("adopted"),
                Ok(Ok(Taken::Known)) => {}
                Ok(Ok(Taken::Left(why))) => {
                    self.metrics.sidecar_adoption("left");
                    if let Some(events) = &self.events {
                        events.warn(name.clone(), Some(uid), LEFT, "Adopt", why.clone());
                    }
                    self.left.record(name, why);
                }
                Ok(Err(err)) => {
                    self.metrics.sidecar_adoption("failed");
                    warn!(pod = who, error = %err, "adopting istio-cni's capture of a sidecar pod failed: it keeps Istio's rules as they are");
                }
                Err(err) => {
                    self.metrics.sidecar_adoption("failed");
                    warn!(pod = who, error = %err, "adopting istio-cni's capture of a sidecar pod failed: it keeps Istio's rules as they are");
                }
            }
        }
        self.captures.update_gauge(&self.metrics);
    }
}
