//! Deciding a pod without the agent: what `meshcap-agent decide` answers the plugin when the
//! agent does not (crash loop, image pull failure, eviction). The same lookup and the same
//! [`policy::select`] as an ADD through the agent, once and without retries, so that a pod the
//! mesh does not concern starts and one it does fails closed (docs/install.md, "Agent
//! outage"). A pod whose annotations do not parse is the mesh's: it fails closed too. On a node
//! that runs ambient mode, a pod ambient mode enrolls is the mesh's as well.
use std::net::IpAddr;

use k8s_openapi::api::core::v1::Pod;
use serde::{Deserialize, Serialize};

use crate::{
    pods::{PodSource, PodSourceError, Retry},
    policy::{
        self, PodRef, PolicyError, SelectConfig, Selection,
        ambient::{AmbientConfig, Enrollment},
    },
};

/// What the plugin knows of the pod.
#[derive(Clone, Debug)]
pub struct Request {
    /// `K8S_POD_NAMESPACE`.
    pub namespace: String,
    /// `K8S_POD_NAME`.
    pub name: String,
    /// `K8S_POD_UID`, when the runtime passes it.
    pub uid: Option<String>,
    /// The pod's addresses from `prevResult` (none: from the pod's status).
    pub ips: Vec<IpAddr>,
    /// Namespaces never captured.
    pub exclude_namespaces: Vec<String>,
    /// Ambient mode, when the node runs it.
    pub ambient: Option<AmbientConfig>,
}

/// The answer, one JSON line on stdout.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decision {
    /// Whether the pod must be captured (the plugin then fails its ADD: no agent, no capture).
    pub capture: bool,
    /// Why, in words.
    pub reason: String,
}

/// Decides `request` from `source`, looking the pod up once.
///
/// # Errors
/// When the pod cannot be found or the source cannot be asked: the plugin fails closed.
pub async fn decide(source: &PodSource, request: &Request) -> Result<Decision, PodSourceError> {
    let once = Retry {
        attempts: 1,
        interval: std::time::Duration::ZERO,
    };
    let pod = source
        .get(
            &request.namespace,
            &request.name,
            request.uid.as_deref(),
            once,
        )
        .await?;
    let ips = if request.ips.is_empty() {
        policy::status_pod_ips(&pod)
    } else {
        request.ips.clone()
    };
    if let Some(ambient) = &request.ambient {
        let enrollment = ambient_enrollment(source, &pod, &request.exclude_namespaces, ambient)
            .await
            .map_err(|reason| PodSourceError::Unavailable {
                namespace: request.namespace.clone(),
                name: request.name.clone(),
                source_name: source.describe(),
                attempts: 1,
                reason,
            })?;
        match enrollment {
            Ok(Enrollment::Enrolled { .. }) => {
                return Ok(Decision {
                    capture: true,
                    reason: "ambient mode enrolls it: ztunnel must capture its traffic".to_owned(),
                });
            }
            Err(err) => {
                return Ok(Decision {
                    capture: true,
                    reason: err.to_string(),
                });
            }
            Ok(Enrollment::NotEnrolled { .. }) => {}
        }
    }
    let config = SelectConfig {
        exclude_namespaces: request.exclude_namespaces.clone(),
    };
    Ok(match policy::select(&pod, &ips, &config) {
        Ok(Selection::Skip { reason }) => Decision {
            capture: false,
            reason: reason.to_string(),
        },
        Ok(Selection::Capture { .. }) => Decision {
            capture: true,
            reason: "its sidecar's traffic must be captured".to_owned(),
        },
        Err(err) => Decision {
            capture: true,
            reason: err.to_string(),
        },
    })
}

/// Whether ambient mode enrolls `pod`, as [`policy::ambient::enroll`] decides: what the pod
/// alone rules out first, then its namespace's labels (one lookup, only when the selectors
/// decide). An ADD through the agent and `meshcap-agent decide` both ask this.
///
/// # Errors
/// The outer error when the namespace cannot be looked up (why, in words); the inner one when
/// the pod's annotations do not parse.
pub async fn ambient_enrollment(
    source: &PodSource,
    pod: &Pod,
    exclude_namespaces: &[String],
    config: &AmbientConfig,
) -> Result<Result<Enrollment, PolicyError>, String> {
    if let Some(reason) = policy::ambient::never_enrolled(pod, exclude_namespaces, config) {
        return Ok(Ok(Enrollment::NotEnrolled { reason }));
    }
    let namespace = PodRef::of(pod).namespace;
    let labels = source.namespace_labels(&namespace).await?;
    Ok(policy::ambient::enroll(
        pod,
        &labels,
        exclude_namespaces,
        config,
    ))
}
