//! The node's host prerequisites (docs/install.md, "Host prerequisites"), as the agent's pod
//! shows them. Where one is missing the agent often never runs and so cannot say it: the
//! runtime refuses its container, and the refusal is in the container's waiting state. Where
//! the container runs, the runtime gave it its mounts and capabilities, and the agent's own
//! `/readyz` names a capability taken away on the way or a kernel that charges its maps to
//! `RLIMIT_MEMLOCK`.
use k8s_openapi::api::core::v1::Pod;

use super::{pod_state::state, report::Outcome};

/// Where the host prerequisites and their fixes are described.
const DOCS: &str = "docs/install.md, Host prerequisites";

/// The check from the agent's pod (none on the node: not checked) and what its `/readyz`
/// answered.
#[must_use]
pub fn judge(pod: Option<&Pod>, readyz: &Result<String, String>) -> Outcome {
    let Some(pod) = pod else {
        return Outcome::NotChecked("no agent pod on the node".into());
    };
    if let Some((reason, message)) = waiting(pod) {
        return refused(&reason, &message).map_or_else(
            || {
                Outcome::NotChecked(format!(
                    "the agent's container has not started ({reason}: {message})"
                ))
            },
            Outcome::Fail,
        );
    }
    if !started(pod) {
        return Outcome::NotChecked(format!(
            "the agent's container has not started ({})",
            state(pod)
        ));
    }
    match readyz {
        Err(why) if why.contains("lacks CAP_") || why.contains("RLIMIT_MEMLOCK") => {
            Outcome::Fail(format!("the agent says: {why} ({DOCS})"))
        }
        _ => Outcome::Ok,
    }
}

/// The first of the pod's containers that waits: its reason and the runtime's message.
fn waiting(pod: &Pod) -> Option<(String, String)> {
    let status = pod.status.as_ref()?;
    status
        .init_container_statuses
        .iter()
        .chain(status.container_statuses.iter())
        .flatten()
        .find_map(|c| {
            let waiting = c.state.as_ref()?.waiting.as_ref()?;
            Some((
                waiting.reason.clone().unwrap_or_else(|| "waiting".into()),
                waiting.message.clone().unwrap_or_default(),
            ))
        })
}

/// Whether the agent's container has run: the runtime created it with its mounts and
/// capabilities.
fn started(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .into_iter()
        .flatten()
        .any(|c| {
            c.state
                .as_ref()
                .is_some_and(|s| s.running.is_some() || s.terminated.is_some())
        })
}

/// The missing prerequisite a runtime's refusal names, in words, or `None` when the refusal
/// is not one of a host prerequisite's (an image that cannot be pulled, a crash).
fn refused(reason: &str, message: &str) -> Option<String> {
    if !matches!(
        reason,
        "CreateContainerError" | "RunContainerError" | "CreateContainerConfigError"
    ) {
        return None;
    }
    let missing = if message.contains("not a shared or slave mount") {
        "a host path the DaemonSet mounts with HostToContainer propagation is not on a shared \
         or slave mount (`mount --make-rshared /` at boot, before the runtime)"
    } else if message.contains("unable to apply caps") {
        "the runtime cannot grant a capability the DaemonSet adds (not in its own bounding \
         set; `meshcap.sysResource` adds SYS_RESOURCE)"
    } else {
        "the runtime refused the agent's container"
    };
    Some(format!("{missing}: {reason}: {message} ({DOCS})"))
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    fn pod(status: &Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "meshcap-agent-ab12c"},
            "spec": {"nodeName": "n", "containers": [{"name": "agent"}]},
            "status": status,
        }))
        .expect("pod")
    }

    fn waiting(reason: &str, message: &str) -> Pod {
        pod(&json!({"phase": "Pending", "containerStatuses": [{
            "name": "agent", "ready": false, "restartCount": 0, "image": "i", "imageID": "",
            "state": {"waiting": {"reason": reason, "message": message}},
        }]}))
    }

    #[test]
    fn a_mount_without_propagation_is_named_from_the_runtimes_refusal() {
        let message = "Error: failed to generate container spec: path \"/sys/fs/bpf\" is \
                       mounted on \"/sys/fs/bpf\" but it is not a shared or slave mount";
        let outcome = judge(
            Some(&waiting("CreateContainerError", message)),
            &Err("connection refused".into()),
        );
        let Outcome::Fail(why) = outcome else {
            panic!("{outcome:?}")
        };
        assert!(why.contains("not on a shared or slave mount"), "{why}");
        assert!(why.contains(message), "the runtime's own words: {why}");
        assert!(why.contains(DOCS), "{why}");
    }

    #[test]
    fn a_capability_the_runtime_cannot_grant_is_named() {
        let message = "runc create failed: unable to start container process: unable to apply \
                       caps: operation not permitted";
        let Outcome::Fail(why) = judge(
            Some(&waiting("RunContainerError", message)),
            &Err(String::new()),
        ) else {
            panic!("a failure")
        };
        assert!(why.contains("cannot grant a capability"), "{why}");
    }

    #[test]
    fn a_capability_taken_away_is_what_the_agents_readyz_says() {
        let running = pod(&json!({"phase": "Running", "containerStatuses": [{
            "name": "agent", "ready": false, "restartCount": 0, "image": "i", "imageID": "",
            "state": {"running": {}},
        }]}));
        let why = "answered 503: not ready: the agent lacks CAP_SYS_ADMIN: the DaemonSet adds it";
        assert_eq!(
            judge(Some(&running), &Err(why.into())),
            Outcome::Fail(format!("the agent says: {why} ({DOCS})"))
        );
        let other = "answered 503: not ready: meshcap-cni is not in place";
        assert_eq!(judge(Some(&running), &Err(other.into())), Outcome::Ok);
        assert_eq!(judge(Some(&running), &Ok("ready".into())), Outcome::Ok);
    }

    #[test]
    fn a_container_not_started_for_another_reason_is_not_checked() {
        let outcome = judge(
            Some(&waiting("ImagePullBackOff", "Back-off pulling image")),
            &Err(String::new()),
        );
        assert!(
            matches!(&outcome, Outcome::NotChecked(why) if why.contains("ImagePullBackOff")),
            "{outcome:?}"
        );
        assert!(matches!(
            judge(None, &Ok(String::new())),
            Outcome::NotChecked(_)
        ));
    }
}
