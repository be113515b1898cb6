//! What goes wrong in ambient mode, and how the backend interface carries it.
use std::path::PathBuf;

use super::KubeletNotFound;
use crate::{backend::BackendError, ztunnel::ZdsError};

/// What went wrong enrolling or removing an ambient pod.
#[derive(Debug, thiserror::Error)]
pub enum AmbientError {
    /// The in-pod capture could not be applied, checked or removed.
    #[error(transparent)]
    Rules(#[from] BackendError),
    /// ztunnel did not take the pod (its capture was removed again).
    #[error("pod {pod}: ztunnel did not take the pod: {source}")]
    Ztunnel {
        /// The pod.
        pod: String,
        /// What ztunnel (or its socket) said.
        source: ZdsError,
    },
    /// The pod's `ambient.istio.io/redirection` annotation could not be written (its
    /// enrollment was undone).
    #[error("pod {pod}: annotating it {annotation}=enabled: {reason}")]
    Annotation {
        /// The pod.
        pod: String,
        /// The annotation.
        annotation: &'static str,
        /// Why.
        reason: String,
    },
    /// The node's probe set could not be read or written.
    #[error("kubelet's probe set on the node: {what}: {reason}")]
    ProbeSet {
        /// What was being done.
        what: String,
        /// Why.
        reason: String,
    },
    /// Kubelet, whose uid the node's nftables probe rule matches, was not found.
    #[error(transparent)]
    Kubelet(#[from] KubeletNotFound),
    /// The agent's own state could not be written.
    #[error("{path}: {reason}")]
    State {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
}

/// Through the backend interface, ambient mode's own failures keep their words; a failure of
/// the capture under it is the backend's.
impl From<AmbientError> for BackendError {
    fn from(err: AmbientError) -> Self {
        match err {
            AmbientError::Rules(err) => err,
            other => Self::Ambient(Box::new(other)),
        }
    }
}
