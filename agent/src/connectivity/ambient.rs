//! Ambient enrollment: on a node whose agent runs ambient mode, a pod labelled
//! `istio.io/dataplane-mode=ambient` is enrolled, which the agent marks, as Istio's node agent
//! does (`AnnotateEnrolledPod`, cni/pkg/util/podutil.go), with the pod's annotation
//! `ambient.istio.io/redirection: enabled`, the one istiod reads before it sends the pod HBONE.
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use meshcap_policy::ambient::ambient_keys;

use super::report::Outcome;

/// How often the pod is looked at while it is not enrolled yet.
const POLL: Duration = Duration::from_secs(1);

/// The outcome where no pod is needed: ambient mode off (or not known) on the node.
#[must_use]
pub fn not_checked(ambient: Option<bool>) -> Option<Outcome> {
    match ambient {
        Some(true) => None,
        Some(false) => Some(Outcome::NotChecked(
            "ambient mode is off on this node".into(),
        )),
        None => Some(Outcome::NotChecked(
            "the agent does not say whether ambient mode is on".into(),
        )),
    }
}

/// Whether `pod` is enrolled, from its annotation.
#[must_use]
pub fn judge(pod: &Pod) -> Outcome {
    let name = pod.metadata.name.as_deref().unwrap_or("unnamed");
    let redirection = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ambient_keys::REDIRECTION));
    match redirection.map(String::as_str) {
        Some("enabled") => Outcome::Ok,
        Some(other) => Outcome::Fail(format!(
            "pod {name} is not enrolled: {} is {other:?}",
            ambient_keys::REDIRECTION
        )),
        None => Outcome::Fail(format!(
            "pod {name} is not enrolled: it has no {} annotation",
            ambient_keys::REDIRECTION
        )),
    }
}

/// A failed enrollment with what the node's agent said of its ztunnels: none connected is the
/// likely cause (ztunnel not running on the node, or not reaching the agent's socket).
#[must_use]
pub fn with_ztunnels(outcome: Outcome, ztunnels: Option<u64>) -> Outcome {
    match (outcome, ztunnels) {
        (Outcome::Fail(why), Some(0)) => Outcome::Fail(format!(
            "{why}; no ztunnel is connected to the node's agent (its ztunnel_connected is 0): \
             is ztunnel running on the node?"
        )),
        (outcome, _) => outcome,
    }
}

/// Waits until the pod `name` is enrolled, or `deadline`; the outcome.
pub async fn enrolled(pods: &Api<Pod>, name: &str, deadline: Instant) -> Outcome {
    loop {
        let outcome = match pods.get(name).await {
            Ok(pod) => judge(&pod),
            Err(e) => Outcome::Fail(format!("pod {name}: {e}")),
        };
        if outcome == Outcome::Ok || Instant::now() >= deadline {
            return outcome;
        }
        tokio::time::sleep(POLL).await;
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn pod(annotations: &serde_json::Value) -> Pod {
        serde_json::from_value(
            json!({"metadata": {"name": "ambient-0", "annotations": annotations}}),
        )
        .expect("pod")
    }

    #[test]
    fn enrolled_only_when_the_agent_says_enabled() {
        let enabled = json!({"ambient.istio.io/redirection": "enabled"});
        assert_eq!(judge(&pod(&enabled)), Outcome::Ok);
        let pending = json!({"ambient.istio.io/redirection": "pending"});
        assert_eq!(
            judge(&pod(&pending)),
            Outcome::Fail(
                "pod ambient-0 is not enrolled: ambient.istio.io/redirection is \"pending\"".into()
            )
        );
        assert_eq!(
            judge(&pod(&json!({}))),
            Outcome::Fail(
                "pod ambient-0 is not enrolled: it has no ambient.istio.io/redirection annotation"
                    .into()
            )
        );
    }

    #[test]
    fn a_failure_with_no_ztunnel_connected_says_so() {
        let fail = Outcome::Fail("pod ambient-0 is not enrolled: x".into());
        let Outcome::Fail(why) = with_ztunnels(fail.clone(), Some(0)) else {
            panic!("a failure")
        };
        assert!(why.ends_with("is ztunnel running on the node?"), "{why}");
        assert_eq!(with_ztunnels(fail.clone(), Some(1)), fail);
        assert_eq!(with_ztunnels(fail.clone(), None), fail);
        assert_eq!(with_ztunnels(Outcome::Ok, Some(0)), Outcome::Ok);
    }

    #[test]
    fn only_a_node_in_ambient_mode_is_checked() {
        assert_eq!(not_checked(Some(true)), None);
        assert_eq!(
            not_checked(Some(false)),
            Some(Outcome::NotChecked(
                "ambient mode is off on this node".into()
            ))
        );
        assert!(matches!(not_checked(None), Some(Outcome::NotChecked(_))));
    }
}
