//! What a request decides on: the pod as the pod source has it, its namespace's labels where
//! the decision reads them, and its addresses; then [`policy::decide`], the one decision.
use std::net::IpAddr;

use k8s_openapi::api::core::v1::Pod;
use tracing::warn;

use super::{CaptureError, blocking::off_the_runtime};
use crate::{
    backend::AmbientCapture,
    pod::Sandbox,
    podnet,
    pods::{PodSource, Retry},
    policy::{self, DataplaneMode, Decision, DecisionError, NodeSettings, ambient::InpodPolicy},
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

/// An enrolled pod's capture: `policy` with the pod's addresses and what ztunnel is told it is,
/// its uid (the runtime's, else the API's) and its service account (`default` when the spec
/// names none).
pub(super) fn ambient_capture(
    sandbox: &Sandbox,
    found: &Pod,
    policy: InpodPolicy,
) -> AmbientCapture {
    AmbientCapture {
        policy,
        ips: sandbox.ips.clone(),
        uid: sandbox
            .uid
            .clone()
            .or_else(|| found.metadata.uid.clone())
            .unwrap_or_default(),
        service_account: found
            .spec
            .as_ref()
            .and_then(|spec| spec.service_account_name.clone())
            .unwrap_or_else(|| "default".to_owned()),
    }
}
