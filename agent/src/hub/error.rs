//! Why a request to the hub failed ([`CaptureError`]), with the class it is counted and
//! answered under ([`ErrorClass`]); `api` turns the class into the plugin's protocol.
use meshcap_policy::{DecisionError, PodName};

use crate::{
    ambient::AmbientError,
    backend::BackendError,
    podnet::PodNetError,
    pods::{NamespaceError, PodSourceError},
};

/// Why a request failed, naming the pod and what is wrong.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    /// The agent does not serve requests (yet, or any more).
    #[error("{0}")]
    NotReady(String),
    /// The pod source does not have the pod, or cannot be asked.
    #[error(transparent)]
    PodSource(Box<PodSourceError>),
    /// The labels of the pod's namespace, which its decision reads, cannot be read.
    #[error("pod {pod}: {source}")]
    Namespace {
        /// The pod.
        pod: PodName,
        /// Why.
        #[source]
        source: Box<NamespaceError>,
    },
    /// The pod's annotations are refused by the mode that would capture it.
    #[error(transparent)]
    Invalid(#[from] DecisionError),
    /// A running pod to enroll in place is not one ambient mode enrolls (any more).
    #[error("ambient mode does not enroll it")]
    NotEnrolled,
    /// The pod's netns, whose addresses the decision needs, cannot be entered.
    #[error("pod {pod}: {source}")]
    Netns {
        /// The pod.
        pod: PodName,
        /// Why.
        #[source]
        source: PodNetError,
    },
    /// The pod's addresses cannot be listed in its netns.
    #[error("pod {pod}: listing addresses in {netns}: {source}")]
    Addresses {
        /// The pod.
        pod: PodName,
        /// Its netns.
        netns: String,
        /// Why.
        #[source]
        source: PodNetError,
    },
    /// A pod to capture in place: its netns holds none of its IPs (any more), so it is not the
    /// pod's; nothing is captured.
    #[error(
        "pod {pod}: network namespace {netns} holds none of its IPs {ips:?} (the pod is gone, or \
         the namespace is another pod's): not captured in place"
    )]
    NotThePodsNetns {
        /// The pod.
        pod: PodName,
        /// The netns found for it.
        netns: String,
        /// The pod's IPs (its status').
        ips: Vec<std::net::IpAddr>,
    },
    /// A running pod to capture in place already holds another agent's capture (istio-cni's
    /// rules): nothing is added on top of it, nor anything of it removed.
    #[error(
        "pod {pod}: its network namespace holds rules meshcap did not write ({found}): left as \
         they are, not captured on top of them"
    )]
    Found {
        /// The pod.
        pod: PodName,
        /// What was found, in words.
        found: String,
    },
    /// The backend failed, or (CHECK) the capture is not as the policy says.
    #[error(transparent)]
    Backend(Box<BackendError>),
    /// Ambient mode failed to enroll or release the pod.
    #[error(transparent)]
    Ambient(Box<AmbientError>),
    /// An ambient pod on a node that does not run ambient mode.
    #[error("ambient mode is not running on this node")]
    NoAmbient,
    /// The backend's work did not finish (it panicked).
    #[error("backend task failed: {0}")]
    Task(String),
}

/// The classes failures are counted and answered under.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorClass {
    /// Not serving.
    NotReady,
    /// The pod is not in the pod source.
    PodNotFound,
    /// The pod source cannot be asked.
    PodSourceUnavailable,
    /// The pod's annotations are refused.
    InvalidPod,
    /// The request names a netns that cannot be entered.
    BadRequest,
    /// The backend failed.
    Backend,
    /// CHECK: the capture is not in place.
    CheckFailed,
    /// Anything else.
    Internal,
}

impl ErrorClass {
    /// The class as the metrics count it.
    #[must_use]
    pub const fn label(self) -> &'static str {
        match self {
            Self::NotReady => "not_ready",
            Self::PodNotFound => "pod_not_found",
            Self::PodSourceUnavailable => "pod_source_unavailable",
            Self::InvalidPod => "invalid_pod",
            Self::BadRequest => "bad_request",
            Self::Backend => "backend",
            Self::CheckFailed => "check_failed",
            Self::Internal => "internal",
        }
    }
}

impl CaptureError {
    /// The class this failure is counted and answered under.
    #[must_use]
    pub const fn class(&self) -> ErrorClass {
        match self {
            Self::NotReady(_) => ErrorClass::NotReady,
            Self::PodSource(err) => match **err {
                PodSourceError::NotFound { .. } => ErrorClass::PodNotFound,
                PodSourceError::Unavailable { .. } => ErrorClass::PodSourceUnavailable,
            },
            Self::Namespace { .. } => ErrorClass::PodSourceUnavailable,
            Self::Invalid(_) | Self::NotEnrolled => ErrorClass::InvalidPod,
            Self::Netns { .. } | Self::NotThePodsNetns { .. } => ErrorClass::BadRequest,
            Self::Found { .. } => ErrorClass::Backend,
            Self::Backend(err) => backend_class(err),
            Self::Ambient(err) => match &**err {
                AmbientError::Rules(err) => backend_class(err),
                _ => ErrorClass::Backend,
            },
            Self::Addresses { .. } | Self::NoAmbient | Self::Task(_) => ErrorClass::Internal,
        }
    }
}

impl From<PodSourceError> for CaptureError {
    fn from(err: PodSourceError) -> Self {
        Self::PodSource(Box::new(err))
    }
}

impl From<BackendError> for CaptureError {
    fn from(err: BackendError) -> Self {
        Self::Backend(Box::new(err))
    }
}

impl From<AmbientError> for CaptureError {
    fn from(err: AmbientError) -> Self {
        Self::Ambient(Box::new(err))
    }
}

const fn backend_class(err: &BackendError) -> ErrorClass {
    match err {
        BackendError::NotCaptured { .. } => ErrorClass::CheckFailed,
        _ => ErrorClass::Backend,
    }
}
