//! What a test pod's status says: its address once it runs, whether its app has ended, and its
//! state in words for a check it failed.
use std::net::IpAddr;

use k8s_openapi::api::core::v1::Pod;

/// The pod's address, once its containers have started: a pod gets its address with its
/// sandbox, before they run.
pub(super) fn address(pod: &Pod) -> Option<IpAddr> {
    let status = pod.status.as_ref()?;
    let started = matches!(
        status.phase.as_deref(),
        Some("Running" | "Succeeded" | "Failed")
    );
    if !started {
        return None;
    }
    status.pod_ip.as_deref()?.parse().ok()
}

/// The pod's address of the other family than [`address`]'s, in a dual-stack cluster (its
/// `status.podIPs`).
pub(super) fn second_address(pod: &Pod) -> Option<IpAddr> {
    let first = address(pod)?;
    pod.status
        .as_ref()?
        .pod_ips
        .iter()
        .flatten()
        .filter_map(|ip| ip.ip.parse::<IpAddr>().ok())
        .find(|ip| ip.is_ipv4() != first.is_ipv4())
}

/// Whether the `app` container has exited.
pub(super) fn app_ended(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .into_iter()
        .flatten()
        .any(|c| c.name == "app" && c.state.as_ref().is_some_and(|s| s.terminated.is_some()))
}

/// The pod's state in words: its phase and the reason a container waits, or that it was never
/// scheduled.
pub(super) fn state(pod: &Pod) -> String {
    let Some(status) = &pod.status else {
        return "not scheduled (no status)".into();
    };
    let phase = status.phase.as_deref().unwrap_or("no phase");
    let waiting: Vec<String> = status
        .container_statuses
        .iter()
        .flatten()
        .filter_map(|c| {
            let waiting = c.state.as_ref()?.waiting.as_ref()?;
            Some(format!(
                "{} {}",
                c.name,
                waiting.reason.as_deref().unwrap_or("waiting")
            ))
        })
        .collect();
    if waiting.is_empty() {
        phase.to_owned()
    } else {
        format!("{phase}, {}", waiting.join(", "))
    }
}
