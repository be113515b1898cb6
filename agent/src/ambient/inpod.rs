//! Where an enrolled pod's in-pod capture is applied: Istio's in-pod rules through the iptables
//! machinery, or meshcap's kernel programs through the eBPF backend that serves the node's
//! sidecar pods (one set of maps and programs for both modes). Both keep their own records, so
//! a restarted agent finds every enrolled pod's capture again.
use std::{net::IpAddr, sync::Arc};

use crate::{
    backend::{
        BackendError, CaptureBackend as _, CapturedPod,
        ebpf::{EbpfBackend, EbpfError},
        iptables::IptablesBackend,
    },
    pod::PodRef,
    policy::ambient::InpodPolicy,
};

/// The in-pod capture of ambient pods.
pub enum InpodCapture {
    /// Istio's in-pod rules (`iptables-restore` in the pod's netns).
    Iptables(IptablesBackend),
    /// The same decisions in the kernel programs: outbound at connect, inbound at TC, and the
    /// replies to ztunnel's connections told apart on the pod's `lo`.
    Ebpf(Arc<EbpfBackend>),
}

impl InpodCapture {
    /// `iptables` or `ebpf`.
    #[must_use]
    pub const fn name(&self) -> &'static str {
        match self {
            Self::Iptables(_) => "iptables",
            Self::Ebpf(_) => "ebpf",
        }
    }

    /// Captures `pod` (whose addresses are `ips`) as `policy` says, or updates it.
    pub(super) fn add(
        &self,
        pod: &PodRef,
        policy: &InpodPolicy,
        ips: &[IpAddr],
    ) -> Result<(), BackendError> {
        match self {
            Self::Iptables(rules) => rules.add_ambient(pod, &policy.render()),
            Self::Ebpf(ebpf) => Ok(ebpf.add_ambient(pod, policy, ips)?),
        }
    }

    /// Whether `pod` is captured as `policy` says.
    pub(super) fn check(&self, pod: &PodRef, policy: &InpodPolicy) -> Result<(), BackendError> {
        match self {
            Self::Iptables(rules) => rules.check_ambient(pod, &policy.render()),
            Self::Ebpf(ebpf) => ebpf
                .check_ambient(pod, policy)
                .map_err(EbpfError::into_check),
        }
    }

    /// Removes `pod`'s capture, if any.
    pub(super) fn remove(&self, pod: &PodRef) -> Result<(), BackendError> {
        match self {
            Self::Iptables(rules) => rules.remove(pod),
            Self::Ebpf(ebpf) => Ok(ebpf.remove(pod)?),
        }
    }

    /// The pods captured.
    pub(super) fn list(&self) -> Result<Vec<CapturedPod>, BackendError> {
        match self {
            Self::Iptables(rules) => rules.list(),
            Self::Ebpf(ebpf) => Ok(ebpf.list_ambient()),
        }
    }

    /// Drops the captures whose netns is gone; returns those pods.
    pub(super) fn prune_gone(&self) -> Result<Vec<PodRef>, BackendError> {
        match self {
            Self::Iptables(rules) => rules.prune_gone(),
            Self::Ebpf(ebpf) => Ok(ebpf.prune_gone_ambient()?),
        }
    }
}
