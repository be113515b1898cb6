//! Which backend serves each data plane mode ([`Router`]).
use std::sync::Arc;

use meshcap_policy::DataplaneMode;

use super::{BackendError, CaptureBackend, CapturedPod, PodPolicy};
use crate::pod::PodRef;

/// Which backend serves each data plane mode, chosen at start: the node's backend (the kernel
/// programs, or Istio's rules) serves sidecar pods; ambient pods, when the node runs ambient
/// mode, go to ambient mode's own layer around the backend that captures them (the same kernel
/// programs with `ambient.inKernel`, else Istio's in-pod rules). A request that knows its mode
/// (ADD, CHECK) goes to the one backend; one that does not (DEL) to each.
#[derive(Clone)]
pub struct Router {
    sidecar: Arc<dyn CaptureBackend>,
    ambient: Option<Arc<dyn CaptureBackend>>,
}

impl Router {
    /// `sidecar` serves sidecar pods; `ambient`, when the node runs ambient mode, ambient ones.
    #[must_use]
    pub fn new(sidecar: Arc<dyn CaptureBackend>, ambient: Option<Arc<dyn CaptureBackend>>) -> Self {
        Self { sidecar, ambient }
    }

    /// The node's backend: the one that serves sidecar pods, whose name, programs and
    /// warnings the agent reports.
    #[must_use]
    pub fn node_backend(&self) -> &Arc<dyn CaptureBackend> {
        &self.sidecar
    }

    /// The backend serving `mode`, if the node captures pods of that mode.
    #[must_use]
    pub fn serving(&self, mode: DataplaneMode) -> Option<&Arc<dyn CaptureBackend>> {
        match mode {
            DataplaneMode::Sidecar => Some(&self.sidecar),
            DataplaneMode::Ambient => self.ambient.as_ref(),
        }
    }

    /// The modes served, each with its backend: ambient mode's first, so that a pod leaving
    /// is taken from ztunnel before anything else of it goes.
    pub fn modes(&self) -> impl Iterator<Item = (DataplaneMode, &Arc<dyn CaptureBackend>)> {
        self.ambient
            .iter()
            .map(|ambient| (DataplaneMode::Ambient, ambient))
            .chain([(DataplaneMode::Sidecar, &self.sidecar)])
    }

    fn backend_for(&self, policy: &PodPolicy) -> Result<&Arc<dyn CaptureBackend>, BackendError> {
        let mode = policy.dataplane();
        self.serving(mode).ok_or(BackendError::NotServed(mode))
    }

    /// Captures `pod` as `policy` says, with the backend serving its mode.
    ///
    /// # Errors
    /// As [`CaptureBackend::add`]; [`BackendError::NotServed`] when no backend serves the mode.
    pub fn add(&self, pod: &PodRef, policy: &PodPolicy) -> Result<(), BackendError> {
        self.backend_for(policy)?.add(pod, policy)
    }

    /// Whether `pod` is captured as `policy` says, by the backend serving its mode.
    ///
    /// # Errors
    /// As [`CaptureBackend::check`]; [`BackendError::NotServed`] when no backend serves the
    /// mode.
    pub fn check(&self, pod: &PodRef, policy: &PodPolicy) -> Result<(), BackendError> {
        self.backend_for(policy)?.check(pod, policy)
    }

    /// Releases whatever captures `pod`, in every mode (a DEL does not say which).
    ///
    /// # Errors
    /// The first backend that holds a capture of `pod` it cannot remove.
    pub fn remove(&self, pod: &PodRef) -> Result<(), BackendError> {
        for (_, backend) in self.modes() {
            backend.remove(pod)?;
        }
        Ok(())
    }

    /// Every capture, sidecar pods first.
    ///
    /// # Errors
    /// When a backend's state cannot be read.
    pub fn list(&self) -> Result<Vec<CapturedPod>, BackendError> {
        let mut captured = self.sidecar.list(DataplaneMode::Sidecar)?;
        if let Some(ambient) = &self.ambient {
            captured.extend(ambient.list(DataplaneMode::Ambient)?);
        }
        Ok(captured)
    }
}
