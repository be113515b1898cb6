//! A node moved from one rules backend to the other (`global.nativeNftables` turned on or off),
//! or from Istio's rules to the kernel programs (istio-cni's sidecar pods adopted, or a kernel
//! upgraded past the eBPF floor): the pods the earlier one captured keep their rules as they
//! are until each goes, as Istio's node agent does from 1.29 (its iptables-to-nftables
//! migration). [`Handover`] serves new pods
//! with the backend chosen now, and every request about a pod the earlier backend holds (a
//! repeated ADD, CHECK, the verifier's pass) with the earlier one; DEL and the reconciliation
//! at start go to both. Once the last earlier pod has gone, only its empty state is left.
use std::sync::Arc;

use meshcap_policy::DataplaneMode;

use super::{
    Adoption, AttachedProgram, BackendError, CaptureBackend, CapturedPod, OtherProgram, PodCheck,
    PodPolicy, Verify,
};
use crate::pod::PodRef;

/// The backend chosen now, in front of the one that captured pods before.
pub struct Handover {
    now: Arc<dyn CaptureBackend>,
    earlier: Arc<dyn CaptureBackend>,
}

impl Handover {
    /// `now` serves new pods; `earlier` keeps the pods it holds.
    #[must_use]
    pub fn new(now: Arc<dyn CaptureBackend>, earlier: Arc<dyn CaptureBackend>) -> Self {
        Self { now, earlier }
    }

    /// Whether the earlier backend holds `pod` (its container, or its netns).
    fn earlier_holds(&self, pod: &PodRef) -> Result<bool, BackendError> {
        for mode in [DataplaneMode::Sidecar, DataplaneMode::Ambient] {
            let held = self.earlier.list(mode)?.into_iter().any(|captured| {
                captured.pod.container_id == pod.container_id
                    || (!pod.netns.as_os_str().is_empty() && captured.pod.in_netns(&pod.netns))
            });
            if held {
                return Ok(true);
            }
        }
        Ok(false)
    }

    fn serving(&self, pod: &PodRef) -> Result<&dyn CaptureBackend, BackendError> {
        Ok(if self.earlier_holds(pod)? {
            self.earlier.as_ref()
        } else {
            self.now.as_ref()
        })
    }
}

impl CaptureBackend for Handover {
    fn name(&self) -> &'static str {
        self.now.name()
    }

    fn add(&self, pod: &PodRef, policy: &PodPolicy) -> Result<(), BackendError> {
        self.serving(pod)?.add(pod, policy)
    }

    fn check(&self, pod: &PodRef, policy: &PodPolicy) -> Result<(), BackendError> {
        self.serving(pod)?.check(pod, policy)
    }

    fn remove(&self, pod: &PodRef) -> Result<(), BackendError> {
        self.earlier.remove(pod)?;
        self.now.remove(pod)
    }

    fn list(&self, mode: DataplaneMode) -> Result<Vec<CapturedPod>, BackendError> {
        let mut captured = self.now.list(mode)?;
        captured.extend(self.earlier.list(mode)?);
        Ok(captured)
    }

    fn programs(&self) -> Vec<AttachedProgram> {
        self.now.programs()
    }

    fn other_programs(&self) -> Vec<OtherProgram> {
        self.now.other_programs()
    }

    fn warnings(&self) -> Vec<String> {
        let mut warnings = self.now.warnings();
        let held = self.earlier.captured_count().unwrap_or_default();
        if held > 0 {
            warnings.push(format!(
                "{held} pods keep the {} rules an earlier agent or istio-cni gave them until they go; new pods get {}",
                self.earlier.name(),
                self.now.name()
            ));
        }
        warnings.extend(self.earlier.warnings());
        warnings
    }

    fn captured_count(&self) -> Result<usize, BackendError> {
        Ok(self.now.captured_count()? + self.earlier.captured_count()?)
    }

    fn prune_gone(&self) -> Result<Vec<PodRef>, BackendError> {
        let mut gone = self.earlier.prune_gone()?;
        gone.extend(self.now.prune_gone()?);
        Ok(gone)
    }

    fn gone(&self, mode: DataplaneMode) -> Result<Vec<PodRef>, BackendError> {
        let mut gone = self.earlier.gone(mode)?;
        gone.extend(self.now.gone(mode)?);
        Ok(gone)
    }

    fn drop_if_gone(&self, pod: &PodRef) -> Result<bool, BackendError> {
        let earlier = self.earlier.drop_if_gone(pod)?;
        Ok(self.now.drop_if_gone(pod)? || earlier)
    }

    fn verify(&self, pod: &PodRef, verify: Verify) -> Result<PodCheck, BackendError> {
        self.serving(pod)?.verify(pod, verify)
    }

    fn verify_node(&self, verify: Verify) -> PodCheck {
        self.now.verify_node(verify)
    }

    fn take_in(&self, pod: &PodRef, policy: &PodPolicy) -> Result<bool, BackendError> {
        if !self.earlier_holds(pod)? {
            return Ok(false);
        }
        self.now.add_moving(pod, policy)?;
        if let Err(err) = self.earlier.hand_over(pod) {
            if let Err(undo) = self.now.remove(pod) {
                tracing::error!(%pod, error = %undo, "taking back the capture added to move the pod: both are in place");
            }
            return Err(err);
        }
        Ok(true)
    }

    /// By the backend whose kind of rules the netns holds (the one chosen now first).
    fn adopt(
        &self,
        pod: &PodRef,
        policy: &PodPolicy,
        reconcile: bool,
    ) -> Result<Adoption, BackendError> {
        match self.now.adopt(pod, policy, reconcile)? {
            Adoption::Nothing => self.earlier.adopt(pod, policy, reconcile),
            adopted => Ok(adopted),
        }
    }
}
