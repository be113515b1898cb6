//! Which pods are broken: exactly Istio's `matchesFilter` (`cni/pkg/repair/repaircontroller.go`).
//! A pod is broken when it carries the sidecar annotation and its `istio-validation` init
//! container is not currently completed (not terminated with reason `Completed` or exit code 0)
//! but last terminated with the validation's exit code (126, `ValidationErrorCode` in
//! `tools/istio-iptables/pkg/constants`) and, when a message is configured, that termination
//! message. Pods without the annotation are never looked at.
use k8s_openapi::api::core::v1::{ContainerStateTerminated, Pod};

use super::RepairConfig;

/// Whether `pod` started without its capture, by Istio's criteria.
#[must_use]
pub fn is_broken(pod: &Pod, config: &RepairConfig) -> bool {
    if !config.sidecar_annotation.is_empty()
        && !pod
            .metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(&config.sidecar_annotation))
    {
        return false;
    }
    let matches = |state: &ContainerStateTerminated| {
        let message = config.init_termination_msg.trim();
        (message.is_empty() || message == state.message.as_deref().unwrap_or_default().trim())
            && (config.init_exit_code == 0 || config.init_exit_code == state.exit_code)
    };
    let statuses = pod
        .status
        .as_ref()
        .and_then(|s| s.init_container_statuses.as_deref())
        .unwrap_or_default();
    statuses.iter().any(|container| {
        if !config.init_container_name.is_empty() && container.name != config.init_container_name {
            return false;
        }
        // A container that completed is never broken, whatever it did before.
        if let Some(now) = container.state.as_ref().and_then(|s| s.terminated.as_ref())
            && (now.reason.as_deref() == Some("Completed") || now.exit_code == 0)
        {
            return false;
        }
        container
            .last_state
            .as_ref()
            .and_then(|s| s.terminated.as_ref())
            .is_some_and(matches)
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn pod(annotated: bool, statuses: serde_json::Value) -> Pod {
        let annotations = if annotated {
            json!({"sidecar.istio.io/status": "{}"})
        } else {
            json!({})
        };
        serde_json::from_value(json!({
            "metadata": {"name": "web", "namespace": "shop", "annotations": annotations},
            "status": {"initContainerStatuses": statuses},
        }))
        .expect("pod")
    }

    fn validation(state: serde_json::Value, last: serde_json::Value) -> serde_json::Value {
        json!([{"name": "istio-validation", "image": "proxyv2", "imageID": "", "ready": false,
                "restartCount": 3, "state": state, "lastState": last}])
    }

    fn crashed(code: i32, message: &str) -> serde_json::Value {
        json!({"terminated": {"exitCode": code, "reason": "Error", "message": message}})
    }

    #[test]
    fn a_validation_that_last_failed_with_126_is_broken() {
        let config = RepairConfig::default();
        let waiting = json!({"waiting": {"reason": "CrashLoopBackOff"}});
        assert!(is_broken(
            &pod(
                true,
                validation(waiting.clone(), crashed(126, "no capture"))
            ),
            &config
        ));
        // Istio's checks, one by one: another exit code, no sidecar annotation, another init
        // container, a validation that now completed, one that never failed.
        assert!(!is_broken(
            &pod(true, validation(waiting.clone(), crashed(1, ""))),
            &config
        ));
        assert!(!is_broken(
            &pod(false, validation(waiting.clone(), crashed(126, ""))),
            &config
        ));
        let mut other = validation(waiting.clone(), crashed(126, ""));
        other[0]["name"] = json!("app-init");
        assert!(!is_broken(&pod(true, other), &config));
        let completed = json!({"terminated": {"exitCode": 0, "reason": "Completed"}});
        assert!(!is_broken(
            &pod(true, validation(completed, crashed(126, ""))),
            &config
        ));
        assert!(!is_broken(
            &pod(true, validation(waiting.clone(), json!({}))),
            &config
        ));
        assert!(!is_broken(&pod(true, json!([])), &config));
        // A configured termination message must match (trimmed), and exit code 0 in the
        // configuration accepts any code.
        let strict = RepairConfig {
            init_termination_msg: "  no capture ".into(),
            init_exit_code: 0,
            ..RepairConfig::default()
        };
        assert!(is_broken(
            &pod(
                true,
                validation(waiting.clone(), crashed(7, "no capture\n"))
            ),
            &strict
        ));
        assert!(!is_broken(
            &pod(true, validation(waiting, crashed(126, "other"))),
            &strict
        ));
    }
}
