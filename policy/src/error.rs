//! Why a pod's capture configuration is refused. Each error names the pod, the input and the
//! offending value, so that the CNI ADD failure kubelet shows says what to fix.

use super::model::PodName;

/// A pod whose annotations (or `istio-proxy` settings) Istio would refuse: the pod must not
/// start uncaptured, so CNI ADD fails with this message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// An entry of a CIDR list is not a CIDR.
    #[error(
        "pod {pod}: annotation {key}: {value:?} is not a CIDR list: {entry:?} is not a CIDR ({reason})"
    )]
    InvalidCidr {
        /// The pod.
        pod: PodName,
        /// The annotation.
        key: &'static str,
        /// The annotation's whole value.
        value: String,
        /// The entry that does not parse.
        entry: String,
        /// What is wrong with it.
        reason: super::model::PrefixParseError,
    },
    /// `*` where it means nothing (`excludeOutboundIPRanges`, and the port lists other than
    /// `includeInboundPorts`: Istio accepts it there but writes rules iptables refuses).
    #[error("pod {pod}: annotation {key}: {value:?}: \"*\" is not allowed here")]
    WildcardNotAllowed {
        /// The pod.
        pod: PodName,
        /// The annotation.
        key: &'static str,
        /// The annotation's whole value.
        value: String,
    },
    /// An entry of a port list is not a number from 0 to 65535.
    #[error(
        "pod {pod}: annotation {key}: {value:?} is not a port list: {entry:?} is not a port (0-65535)"
    )]
    InvalidPort {
        /// The pod.
        pod: PodName,
        /// The annotation.
        key: &'static str,
        /// The annotation's whole value.
        value: String,
        /// The entry that does not parse.
        entry: String,
    },
    /// The interception mode is neither `REDIRECT` nor `TPROXY`.
    #[error(
        "pod {pod}: annotation {key}: {value:?} is not an interception mode (REDIRECT or TPROXY)"
    )]
    InvalidInterceptionMode {
        /// The pod.
        pod: PodName,
        /// The annotation.
        key: &'static str,
        /// Its value.
        value: String,
    },
    /// An entry of an interface list is not an interface name.
    #[error(
        "pod {pod}: annotation {key}: {value:?} is not an interface list: {entry:?} is not an interface name"
    )]
    InvalidInterface {
        /// The pod.
        pod: PodName,
        /// The annotation.
        key: &'static str,
        /// The annotation's whole value.
        value: String,
        /// The entry that is not a name.
        entry: String,
    },
    /// `istio-proxy`'s `runAsUser`/`runAsGroup` is not a valid id.
    #[error("pod {pod}: container istio-proxy: securityContext.{field}: {value} is not a valid id")]
    InvalidProxyId {
        /// The pod.
        pod: PodName,
        /// `runAsUser` or `runAsGroup`.
        field: &'static str,
        /// Its value.
        value: i64,
    },
}

/// A manifest that does not parse, or whose pod document is not a pod.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// JSON (the text starts with `{` or `[`) that does not parse.
    #[error("not a pod manifest (JSON): {0}")]
    Json(#[from] serde_json::Error),
    /// YAML that does not parse.
    #[error("not a pod manifest (YAML): {0}")]
    Yaml(#[from] yaml_serde::Error),
    /// A `Pod` document does not parse as a pod.
    #[error("pod {name}: {source}")]
    Pod {
        /// The document's `metadata.name`.
        name: String,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
}
