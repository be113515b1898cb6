//! `meshcap-agent explain NAMESPACE/POD` ([`crate::verify::explain`]): the pod's decision as
//! the agent would make it now, from the pod as the pod source has it, and every capture the
//! node holds for it compared with its record on the spot (under its request lock; nothing is
//! put back), with what the verifier last found.
use std::{collections::BTreeMap, time::Duration};

use k8s_openapi::api::core::v1::Pod;
use meshcap_policy as policy;
use meshcap_policy::{Decision, PodName};

use super::{
    CaptureError, Done, Hub,
    request::{Verb, off_the_runtime},
};
use crate::{
    backend::Verify,
    pods::Retry,
    verify::{CaptureNow, Explanation},
};

/// The label and annotation prefixes Istio's selection and policy read.
const READ: [&str; 5] = [
    "sidecar.istio.io/",
    "traffic.sidecar.istio.io/",
    "istio.io/",
    "ambient.istio.io/",
    "proxy.istio.io/",
];

impl Hub {
    /// Why `pod` is (not) captured, and what is installed for it.
    ///
    /// # Errors
    /// When the captures cannot be listed.
    pub async fn explain(&self, pod: PodName) -> Result<Done, CaptureError> {
        let work = async {
            let mut explanation = Explanation {
                pod: pod.clone(),
                ..Explanation::default()
            };
            self.explain_decision(&pod, &mut explanation).await;
            let router = self.captures.router().clone();
            for (mode, backend) in router.modes() {
                let listed = {
                    let backend = backend.clone();
                    off_the_runtime(move || backend.list(mode)).await??
                };
                for captured in listed
                    .into_iter()
                    .filter(|c| c.pod.namespace == pod.namespace && c.pod.name == pod.name)
                {
                    let id = captured.pod.container_id.clone();
                    let (backend, target) = (backend.clone(), captured.pod.clone());
                    let work = off_the_runtime(move || backend.verify(&target, Verify::Look));
                    let check = self.locks.run(&id, work).await??;
                    explanation.captures.push(CaptureNow {
                        verified: self.ledger.of_pod(&id),
                        container_id: id,
                        mode,
                        backend: captured.backend,
                        summary: captured.summary,
                        installed: check.installed,
                        differs: check.drift,
                    });
                }
            }
            explanation.node = self.ledger.of_node();
            explanation.verify_interval_seconds = self.ledger.interval().map(|d| d.as_secs());
            explanation.not_ready = self.readiness.not_ready_reason();
            explanation.pending_enrollment = self.pending.of(&pod);
            explanation.istio_capture_left = self.left.of(&pod);
            Ok(Done::Explained(Box::new(explanation)))
        };
        self.observed(Verb::Explain, None, work).await
    }

    /// The decision for `pod` now, why, and what it was read from.
    async fn explain_decision(&self, pod: &PodName, explanation: &mut Explanation) {
        let source = self.lookup.source();
        let once = Retry {
            attempts: 1,
            interval: Duration::ZERO,
        };
        let found = match source.get(&pod.namespace, &pod.name, None, once).await {
            Ok(found) => found,
            Err(err) => {
                explanation.decision = "not decided: the pod is not found".to_owned();
                explanation.because.push(err.to_string());
                return;
            }
        };
        let node = self.lookup.node();
        let labels = match source.labels_for_decision(&found, node).await {
            Ok(labels) => labels,
            Err(err) => {
                explanation.decision =
                    "not decided: its namespace's labels cannot be read".to_owned();
                explanation.because.push(err.to_string());
                return;
            }
        };
        explanation.inputs = inputs(&found, &labels);
        let ips = policy::status_pod_ips(&found);
        let (decision, because, policy) = match policy::decide(&found, &ips, &labels, node) {
            Err(err) => (
                "refused: it would not start (its ADD fails)".to_owned(),
                vec![format!("{} mode: {err}", err.dataplane)],
                None,
            ),
            Ok(Decision::Skip {
                reason,
                not_enrolled,
            }) => (
                "left alone, as Istio's CNI plugin leaves it".to_owned(),
                with_ambient(vec![format!("sidecar mode: {reason}")], not_enrolled),
                None,
            ),
            Ok(Decision::Sidecar {
                policy,
                not_enrolled,
            }) => (
                "captured for its sidecar".to_owned(),
                with_ambient(
                    vec![
                        "sidecar mode: Istio injected its sidecar (sidecar.istio.io/status, an istio-proxy container) and nothing excludes it"
                            .to_owned(),
                    ],
                    not_enrolled,
                ),
                Some(policy.summary()),
            ),
            Ok(Decision::Ambient { policy, ignored }) => {
                let mut because = vec![
                    "ambient mode: an enablement selector (ambient.enablementSelectors) matches the pod and its namespace"
                        .to_owned(),
                ];
                because.extend(
                    ignored
                        .iter()
                        .map(|a| format!("{}={:?} is not a boolean: ignored, as Istio does", a.key, a.value)),
                );
                (
                    "enrolled in ambient mode: captured in the pod for ztunnel".to_owned(),
                    because,
                    Some(format!(
                        "inbound {}, DNS {}, IPv6 {}, rerouted interfaces {}",
                        on(policy.inbound),
                        on(policy.dns),
                        on(policy.ipv6),
                        if policy.virtual_interfaces.is_empty() {
                            "none".to_owned()
                        } else {
                            policy.virtual_interfaces.join(",")
                        }
                    )),
                )
            }
        };
        explanation.decision = decision;
        explanation.because = because;
        explanation.policy = policy;
    }
}

fn with_ambient(
    mut because: Vec<String>,
    not_enrolled: Option<policy::ambient::NotEnrolledReason>,
) -> Vec<String> {
    because.extend(not_enrolled.map(|reason| format!("ambient mode: {reason}")));
    because
}

const fn on(on: bool) -> &'static str {
    if on { "captured" } else { "not captured" }
}

/// The pod's labels and annotations the decision reads, and its namespace's labels when read.
fn inputs(pod: &Pod, namespace: &BTreeMap<String, String>) -> Vec<String> {
    let read = |key: &str| READ.iter().any(|prefix| key.starts_with(prefix));
    let mut out = Vec::new();
    for (what, map) in [
        ("label", pod.metadata.labels.as_ref()),
        ("annotation", pod.metadata.annotations.as_ref()),
    ] {
        for (key, value) in map.into_iter().flatten().filter(|(k, _)| read(k)) {
            // sidecar.istio.io/status is a long JSON document: only whether it is there counts.
            if key == "sidecar.istio.io/status" {
                out.push(format!("pod {what} {key} (set)"));
            } else {
                out.push(format!("pod {what} {key}={value}"));
            }
        }
    }
    out.extend(
        namespace
            .iter()
            .filter(|(k, _)| read(k))
            .map(|(key, value)| format!("namespace label {key}={value}")),
    );
    out
}
