//! Deciding a pod without the agent: what `meshcap-agent decide` answers the plugin when the
//! agent does not (crash loop, image pull failure, eviction). The same lookup and the same
//! [`policy::decide`] as an ADD through the agent, once and without retries, so that a pod the
//! mesh does not concern starts and one it does fails closed (docs/install.md, "Agent
//! outage"). A pod whose annotations do not parse is the mesh's: it fails closed too. On a node
//! that runs ambient mode, a pod ambient mode enrolls is the mesh's as well.
use std::net::IpAddr;

use meshcap_policy as policy;
use meshcap_policy::{Decision, NodeSettings, PodName};
use serde::{Deserialize, Serialize};

use crate::pods::{PodSource, PodSourceError, Retry};

/// What the plugin knows of the pod, and the node's settings it passes.
#[derive(Clone, Debug)]
pub struct Request {
    /// `K8S_POD_NAMESPACE` and `K8S_POD_NAME`.
    pub pod: PodName,
    /// `K8S_POD_UID`, when the runtime passes it.
    pub uid: Option<String>,
    /// The pod's addresses from `prevResult` (none: from the pod's status).
    pub ips: Vec<IpAddr>,
    /// The node's excluded namespaces and ambient mode, as the plugin's configuration says.
    pub node: NodeSettings,
}

/// The answer, one JSON line on stdout.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Answer {
    /// Whether the pod must be captured (the plugin then fails its ADD: no agent, no capture).
    pub capture: bool,
    /// Why, in words.
    pub reason: String,
}

/// Decides `request` from `source`, looking the pod up once.
///
/// # Errors
/// When the pod (or, where the decision reads it, its namespace) cannot be found or the source
/// cannot be asked: the plugin fails closed.
pub async fn decide(source: &PodSource, request: &Request) -> Result<Answer, PodSourceError> {
    let once = Retry {
        attempts: 1,
        interval: std::time::Duration::ZERO,
    };
    let name = &request.pod;
    let pod = source
        .get(&name.namespace, &name.name, request.uid.as_deref(), once)
        .await?;
    let ips = if request.ips.is_empty() {
        policy::status_pod_ips(&pod)
    } else {
        request.ips.clone()
    };
    let labels = source
        .labels_for_decision(&pod, &request.node)
        .await
        .map_err(|err| PodSourceError::Unavailable {
            namespace: name.namespace.clone(),
            name: name.name.clone(),
            source_name: source.describe(),
            attempts: 1,
            reason: err.to_string(),
        })?;
    let (capture, reason) = match policy::decide(&pod, &ips, &labels, &request.node) {
        Ok(Decision::Ambient { .. }) => (
            true,
            "ambient mode enrolls it: ztunnel must capture its traffic".to_owned(),
        ),
        Ok(Decision::Sidecar { .. }) => (true, "its sidecar's traffic must be captured".to_owned()),
        Ok(Decision::Skip { reason, .. }) => (false, reason.to_string()),
        Err(err) => (true, err.to_string()),
    };
    Ok(Answer { capture, reason })
}
