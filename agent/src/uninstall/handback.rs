//! Hand back: every pod the kernel programs capture is given Istio's own rules for it, the
//! rules meshcap's rules backend renders (held to Istio's goldens) — iptables, or native
//! nftables with `global.nativeNftables` — so that istio-cni's agent, installed after meshcap,
//! finds in each pod exactly what its own plugin would have written, and the node-wide programs
//! can go. One pod at a time, in an order that never leaves a new connection of the pod
//! uncaptured: Istio's rules are written (and recorded) first, while the kernel capture still
//! runs; only then is the kernel capture released. Where the two overlap, a connection is
//! redirected once: the kernel program rewrites its destination to the proxy's loopback
//! listener, which Istio's `ISTIO_OUTPUT` returns on (`-d 127.0.0.1/32 -j RETURN`).
//!
//! What each pod's rules are made from: its policy, which the kernel does not keep whole (its
//! maps hold an encoding of the policy — ports, CIDRs, flags — that cannot give back the
//! rules' own form, and bpffs keeps names, no files). The caller gives it: for a sidecar pod
//! re-derived from the pod object and the node's settings, as at its ADD; for an ambient pod
//! from ambient mode's record of its enrollment. Before anything is written the kernel capture
//! is compared with that policy (the backend's CHECK): a pod whose capture is not what the
//! policy asks (its annotations edited since its ADD) is not handed back, so a pod is never
//! given rules other than those of the capture it had.
use std::{error::Error, net::IpAddr};

use meshcap_policy::DataplaneMode;

use crate::{
    backend::{Adoption, BackendError, CaptureBackend, PodPolicy, ebpf::EbpfBackend},
    pod::PodRef,
    podnet::{self, PodNetError},
};

/// Why the caller found no policy for a pod.
pub type PolicyError = Box<dyn Error + Send + Sync>;

/// Where each pod's policy comes from: the caller finds it for the pod, the mode it is captured
/// for and its netns's global addresses.
pub type PolicyOf<'a> =
    dyn FnMut(&PodRef, DataplaneMode, &[IpAddr]) -> Result<PodPolicy, PolicyError> + 'a;

/// Why one pod was not handed back. Its kernel capture is kept, except where
/// [`Self::Release`] says otherwise.
#[derive(Debug, thiserror::Error)]
pub enum HandBackError {
    /// Its netns could not be read (its addresses).
    #[error("reading its network namespace: {0}")]
    PodNet(#[from] PodNetError),
    /// Its policy could not be found.
    #[error("its policy cannot be found: {0}")]
    Policy(PolicyError),
    /// Its kernel capture is not what the policy found asks for.
    #[error("its capture in the kernel differs from the policy found for it: {0}")]
    Differs(BackendError),
    /// Istio's rules could not be written (nothing of them stays).
    #[error("writing Istio's rules: {0}")]
    Rules(BackendError),
    /// Its netns already holds Istio's rules in another form than its policy's (written by
    /// istio-cni's plugin or agent for other annotations or settings): left as they are, with
    /// the kernel capture.
    #[error("its network namespace holds Istio's rules in another form: {0}")]
    OtherRules(String),
    /// Istio's rules are in place, but the kernel capture could not be released: the pod is
    /// captured by both until it goes.
    #[error("Istio's rules are in place, but releasing its kernel capture failed: {0}")]
    Release(BackendError),
}

/// What a hand-back did.
#[derive(Debug, Default)]
pub struct HandedBack {
    /// Pods now captured by Istio's rules only.
    pub pods: Vec<PodRef>,
    /// Pods whose netns was gone: their kernel capture dropped.
    pub dropped: Vec<PodRef>,
    /// Pods not handed back, and why.
    pub failed: Vec<(PodRef, HandBackError)>,
}

/// Hands every pod `kernel` captures to the rules backend serving its mode (`rules`; a mode
/// without one is a failure for its pods), each with the policy `policy_of` finds for it.
///
/// # Errors
/// When the kernel's captures cannot be listed or a gone pod's entry cannot be dropped; each
/// pod's own failure is in [`HandedBack::failed`].
pub fn hand_back<'r>(
    kernel: &EbpfBackend,
    rules: &dyn Fn(DataplaneMode) -> Option<&'r dyn CaptureBackend>,
    policy_of: &mut PolicyOf<'_>,
) -> Result<HandedBack, BackendError> {
    let mut out = HandedBack::default();
    let live = podnet::live_netns();
    for pinned in kernel.pinned_pods() {
        let mode = pinned.mode();
        let Some(netns) = live.get(&pinned.netns_cookie) else {
            let pod = pinned.pod_ref();
            kernel.drop_if_gone(&pod)?;
            out.dropped.push(pod);
            continue;
        };
        let pod = PodRef {
            netns: netns.clone(),
            ..pinned.pod_ref()
        };
        let Some(backend) = rules(mode) else {
            out.failed
                .push((pod, HandBackError::Rules(BackendError::NotServed(mode))));
            continue;
        };
        match one(kernel, backend, &pod, mode, policy_of) {
            Ok(()) => {
                tracing::info!(pod = %pod, mode = %mode, rules = backend.name(), "handed back: Istio's rules in place, the kernel capture released");
                out.pods.push(pod);
            }
            Err(err) => {
                tracing::warn!(pod = %pod, error = %err, "not handed back");
                out.failed.push((pod, err));
            }
        }
    }
    Ok(out)
}

/// One pod: its policy, checked against its kernel capture; Istio's rules written; the kernel
/// capture released; the rules written once more and their policy routes made theirs (the
/// release takes the routes both captures use, which the rules found in place: as ambient
/// mode's move between its ways, `ambient::start::move_captures`).
fn one(
    kernel: &EbpfBackend,
    rules: &dyn CaptureBackend,
    pod: &PodRef,
    mode: DataplaneMode,
    policy_of: &mut PolicyOf<'_>,
) -> Result<(), HandBackError> {
    let ips = podnet::run_in(&pod.netns, |_| podnet::global_addresses())??;
    let policy = policy_of(pod, mode, &ips).map_err(HandBackError::Policy)?;
    kernel.check(pod, &policy).map_err(HandBackError::Differs)?;
    // Istio's `nat` rules start conntrack and netfilter's NAT hooks in the netns (the hooks
    // while the rules' transaction is still being prepared): from then on the NAT hook at
    // `LOCAL_IN` drops a listener TC assigned to a SYN. Every captured SYN goes through the
    // socket lookup instead, after netfilter, until the release.
    kernel
        .add_moving(pod, &policy)
        .map_err(HandBackError::Rules)?;
    // The connections the kernel carried are not tracked: not taken up mid-stream by the rules.
    let loose_off = podnet::run_in(&pod.netns, |_| podnet::conntrack::no_loose_pickup())??;
    // istio-cni's agent, started beside meshcap's as a node is handed back to it, writes its
    // in-pod rules into every ambient pod (`reconcileExistingPod`), and its plugin writes a
    // pod's rules when its entry was in the chain with meshcap's: rules found are kept as they
    // are (or, for ambient pods, reconciled as Istio's agent does), never written twice.
    match rules
        .adopt(pod, &policy, mode == DataplaneMode::Ambient)
        .map_err(HandBackError::Rules)?
    {
        Adoption::Nothing => rules.add(pod, &policy).map_err(HandBackError::Rules)?,
        Adoption::Recognised(how) | Adoption::Reconciled(how) => {
            tracing::info!(pod = %pod, %how, "Istio's rules were in place already: kept");
        }
        Adoption::NotRecognised(how) => return Err(HandBackError::OtherRules(how)),
    }
    if !loose_off {
        podnet::run_in(&pod.netns, |_| podnet::conntrack::no_loose_pickup())??;
    }
    crate::crashpoint::here(crate::crashpoint::HAND_BACK_BOTH);
    kernel.remove(pod).map_err(HandBackError::Release)?;
    rules
        .add(pod, &policy)
        .and_then(|()| rules.forget_found_routes(pod))
        .map_err(HandBackError::Rules)
}
