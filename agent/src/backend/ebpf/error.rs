//! The eBPF backend's errors; each names what it was doing.
use std::io;

use aya::programs::ProgramError;

use super::sys;
use crate::{backend::BackendError, pod::PodRef, podnet::PodNetError};

/// Errors of the eBPF backend.
#[derive(Debug, thiserror::Error)]
pub enum EbpfError {
    /// A filesystem or syscall failure.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Why it failed.
        #[source]
        source: io::Error,
    },
    /// aya refused (object, map or link).
    #[error("{what}: {source}")]
    Bpf {
        /// What was being done.
        what: String,
        /// Why it failed.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The kernel refused a program.
    #[error("program {name}: {source}")]
    Program {
        /// The program.
        name: &'static str,
        /// aya's error (with the verifier log).
        #[source]
        source: ProgramError,
    },
    /// The embedded object lacks a program or map.
    #[error("the embedded eBPF object has no {0}")]
    Missing(&'static str),
    /// The pod's netns could not be entered, or the kernel refused a request inside it
    /// (interfaces, routes, TC filters).
    #[error(transparent)]
    PodNet(#[from] PodNetError),
    /// The kernel refused a pod's TC stub.
    #[error("loading the pod's TC stub: {0}")]
    Stub(#[from] sys::Refused),
    /// A pod-level failure.
    #[error("{pod}: {message}")]
    Pod {
        /// `pod namespace/name`.
        pod: String,
        /// What is wrong.
        message: String,
    },
}

impl EbpfError {
    pub(super) fn io(what: &str, source: io::Error) -> Self {
        Self::Io {
            what: what.to_owned(),
            source,
        }
    }

    pub(super) fn program(name: &'static str, source: ProgramError) -> Self {
        Self::Program { name, source }
    }

    pub(super) fn map(what: &str, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self::Bpf {
            what: what.to_owned(),
            source: Box::new(source),
        }
    }

    pub(super) fn pod(pod: &PodRef, message: impl Into<String>) -> Self {
        Self::Pod {
            pod: pod.to_string(),
            message: message.into(),
        }
    }

    /// A CHECK's answer: what the kernel holds differing from the policy is a mismatch
    /// ([`BackendError::NotCaptured`]), not a failure to look.
    #[must_use]
    pub fn into_check(self) -> BackendError {
        match self {
            Self::Pod { pod, message } => BackendError::NotCaptured {
                pod,
                missing: message,
            },
            err => err.into(),
        }
    }
}
