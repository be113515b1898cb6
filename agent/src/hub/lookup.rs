//! Looking a pod up and deciding it ([`Lookup`]: the pod source, the node's settings, the
//! decision with the addresses the runtime gave or those in its netns), and checking, before
//! an in-place capture, that the netns found is still the pod's.
use std::net::IpAddr;

use k8s_openapi::api::core::v1::Pod;
use meshcap_policy as policy;
use meshcap_policy::{DataplaneMode, Decision, DecisionError, NodeSettings};
use tracing::warn;

use super::{CaptureError, request::off_the_runtime};
use crate::{
    pod::{Sandbox, made_in_place},
    podnet,
    pods::{PodSource, Retry},
};

/// Looks pods up and decides them, with the node's settings.
pub(super) struct Lookup {
    source: std::sync::Arc<PodSource>,
    node: NodeSettings,
    retry: Retry,
}

impl Lookup {
    pub(super) const fn new(
        source: std::sync::Arc<PodSource>,
        node: NodeSettings,
        retry: Retry,
    ) -> Self {
        Self {
            source,
            node,
            retry,
        }
    }

    pub(super) fn source(&self) -> &PodSource {
        &self.source
    }

    /// The node's settings every decision reads.
    pub(super) const fn node(&self) -> &NodeSettings {
        &self.node
    }

    /// The pod `sandbox` is of, as the pod source has it (retried while it is missing), and its
    /// decision. The addresses the runtime gave decide; without any, those in the pod's netns
    /// do (what Istio reads there), unless ambient mode decides the pod, which needs none.
    pub(super) async fn decide(&self, sandbox: &Sandbox) -> Result<(Pod, Decision), CaptureError> {
        let pod = &sandbox.pod;
        let found = self
            .source
            .get(
                &pod.namespace,
                &pod.name,
                sandbox.uid.as_deref(),
                self.retry,
            )
            .await?;
        let decision = self.decide_on(sandbox, &found, true).await?;
        Ok((found, decision))
    }

    /// `found`'s decision for `sandbox` (`found`: the pod as a watch last saw it, which the pod
    /// source may not have seen yet). With `read_addresses`, a pod whose runtime gave no
    /// addresses is decided on those in its netns.
    pub(super) async fn decide_on(
        &self,
        sandbox: &Sandbox,
        found: &Pod,
        read_addresses: bool,
    ) -> Result<Decision, CaptureError> {
        let labels = self
            .source
            .labels_for_decision(found, &self.node)
            .await
            .map_err(|source| CaptureError::Namespace {
                pod: sandbox.pod.pod_name(),
                source: Box::new(source),
            })?;
        let mut decision = policy::decide(found, &sandbox.ips, &labels, &self.node);
        let ambient = matches!(
            &decision,
            Ok(Decision::Ambient { .. })
                | Err(DecisionError {
                    dataplane: DataplaneMode::Ambient,
                    ..
                })
        );
        if read_addresses && sandbox.ips.is_empty() && !ambient {
            let ips = netns_addresses(sandbox).await?;
            decision = policy::decide(found, &ips, &labels, &self.node);
        }
        let decision = decision?;
        if let Decision::Ambient { ignored, .. } = &decision {
            for annotation in ignored {
                warn!(
                    annotation = annotation.key,
                    value = annotation.value,
                    "not a boolean: ignored, as Istio does"
                );
            }
        }
        Ok(decision)
    }
}

/// The global addresses in `sandbox`'s netns.
async fn netns_addresses(sandbox: &Sandbox) -> Result<Vec<IpAddr>, CaptureError> {
    let netns = sandbox.pod.netns.clone();
    let pod = || sandbox.pod.pod_name();
    off_the_runtime(move || podnet::run_in(&netns, |_| podnet::global_addresses()))
        .await?
        .map_err(|source| CaptureError::Netns { pod: pod(), source })?
        .map_err(|source| CaptureError::Addresses {
            pod: pod(),
            netns: sandbox.pod.netns.display().to_string(),
            source,
        })
}

/// For a pod captured in place (the repair controller, live enrollment): that its netns still
/// holds one of the pod's IPs, as Istio checks before it enrolls a running pod (1.31,
/// `releasenotes/notes/validate-netns-ownership.yaml`). meshcap found the netns by those IPs
/// ([`podnet::find`]), but its decision came after (an API call away): by now the pod may be
/// gone and its netns another's. Checked under the pod's lock, just before the capture; a
/// runtime's ADD names the netns it made and is not checked.
pub(super) async fn netns_still_the_pods(sandbox: &Sandbox) -> Result<(), CaptureError> {
    if !made_in_place(&sandbox.pod.container_id) {
        return Ok(());
    }
    let held = netns_addresses(sandbox).await?;
    if sandbox.ips.iter().any(|ip| held.contains(ip)) {
        return Ok(());
    }
    Err(CaptureError::NotThePodsNetns {
        pod: sandbox.pod.pod_name(),
        netns: sandbox.pod.netns.display().to_string(),
        ips: sandbox.ips.clone(),
    })
}
