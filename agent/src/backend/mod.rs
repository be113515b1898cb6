//! Capture backends: translations of a pod's policy into kernel state for one pod —
//! [`ebpf`], the kernel programs (primary), and [`iptables`] or [`nftables`], Istio's rules
//! (the rules path: fallback, or pinned) — behind
//! one interface for both data plane modes, [`CaptureBackend`]: the policy is the variant
//! ([`PodPolicy`]). [`Router`] sends each mode to the backend chosen at start to serve it: the
//! node's backend for sidecar pods; for ambient pods the same kernel programs, or Istio's
//! in-pod rules in a state directory of their own, wrapped by ambient mode's own layer
//! ([`crate::ambient`]).
//!
//! Every method is blocking (they enter network namespaces, fork `iptables-restore`, talk
//! netlink or BPF): the agent calls them through `tokio::task::block_in_place` (or the
//! blocking pool), never as plain async work.
use std::{net::IpAddr, path::PathBuf};

use meshcap_policy::{DataplaneMode, RedirectPolicy, ambient::InpodPolicy};
use serde::{Deserialize, Serialize};

use crate::{pod::PodRef, podnet::PodNetError};

mod baseline;
mod drift;
pub mod ebpf;
pub mod found;
pub mod handover;
pub mod iptables;
pub mod nftables;
mod records;
mod router;
mod rules_backend;
pub use drift::{Drift, DriftKind, Outcome as DriftOutcome, PodCheck, Verify};
pub use router::Router;

/// What a backend is asked to capture a pod as: the mode is the variant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PodPolicy {
    /// Its sidecar's capture.
    Sidecar(Box<RedirectPolicy>),
    /// Ambient mode's in-pod capture, for ztunnel.
    Ambient(Box<AmbientCapture>),
}

impl PodPolicy {
    /// The mode this policy captures for.
    #[must_use]
    pub const fn dataplane(&self) -> DataplaneMode {
        match self {
            Self::Sidecar(_) => DataplaneMode::Sidecar,
            Self::Ambient(_) => DataplaneMode::Ambient,
        }
    }
}

impl From<RedirectPolicy> for PodPolicy {
    fn from(policy: RedirectPolicy) -> Self {
        Self::Sidecar(Box::new(policy))
    }
}

/// An ambient pod's capture: its in-pod policy, its addresses, and what ztunnel is told it is
/// (which only ambient mode's own layer reads).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AmbientCapture {
    /// The in-pod capture.
    pub policy: InpodPolicy,
    /// The pod's addresses: the local address of its redirected connections, and the probe
    /// set's entries (none: read in its netns).
    pub ips: Vec<IpAddr>,
    /// The pod's uid, by which ztunnel knows the workload.
    pub uid: String,
    /// The pod's service account (its workload identity).
    pub service_account: String,
}

/// A capture in place, as a backend reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CapturedPod {
    /// The pod.
    pub pod: PodRef,
    /// The backend holding the capture ([`CaptureBackend::name`]).
    pub backend: String,
    /// What is applied, in one line (mode, and backend details such as the iptables flavour).
    pub summary: String,
    /// Whether the capture is istio-cni's, adopted as it was found.
    #[serde(default)]
    pub adopted: bool,
}

/// A node-wide program in place, as the status report shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttachedProgram {
    /// The program (and its hook).
    pub program: String,
    /// The pinned link's id (none for the TC classifier, which sits in a program array).
    pub link_id: Option<u32>,
    /// The attached program's id (none: not attached).
    pub prog_id: Option<u32>,
    /// Its tag: the kernel's hash of its instructions, the same for the same build.
    pub tag: Option<String>,
    /// Whether this agent process loaded it (after a restart or an upgrade every program must
    /// be the running agent's).
    pub this_agent: bool,
}

/// Another program on one of the backend's node-wide hooks (a primary CNI's socket load
/// balancer, say), as the status report and the metrics show it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OtherProgram {
    /// The backend's program on that hook.
    pub hook: String,
    /// The other program's id.
    pub prog_id: u32,
    /// Its name.
    pub name: String,
    /// Whether it runs before the backend's.
    pub before: bool,
}

impl std::fmt::Display for OtherProgram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "program {} ({}) runs {} meshcap's {}",
            self.prog_id,
            if self.name.is_empty() {
                "unnamed"
            } else {
                &self.name
            },
            if self.before { "before" } else { "after" },
            self.hook
        )
    }
}

/// Errors of a backend, naming the pod and what failed.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The pod's network namespace cannot be entered, or the kernel refused a request inside
    /// it (netlink: routes, addresses).
    #[error("{pod}: {source}")]
    PodNet {
        /// The pod.
        pod: String,
        /// Why.
        #[source]
        source: PodNetError,
    },
    /// A command run in the pod's network namespace failed.
    #[error("{pod}: {command} failed: {stderr}")]
    Command {
        /// The pod.
        pod: String,
        /// The command line (program and arguments).
        command: String,
        /// Its error output (or why it could not run).
        stderr: String,
    },
    /// CHECK: the kernel state differs from the policy.
    #[error("{pod}: capture is not in place: {missing}")]
    NotCaptured {
        /// The pod.
        pod: String,
        /// What is missing or different.
        missing: String,
    },
    /// The backend's own state (on disk) could not be read or written.
    #[error("backend state {path}: {reason}")]
    State {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The backend cannot run here (missing binaries, kernel features).
    #[error("{0}")]
    Unavailable(String),
    /// No backend on this node captures pods of this mode.
    #[error("no backend on this node captures {0} pods")]
    NotServed(DataplaneMode),
    /// The eBPF backend's own failure (maps, programs, links, pins).
    #[error(transparent)]
    Ebpf(#[from] ebpf::EbpfError),
    /// Ambient mode's own failure around the capture (ztunnel, the probe set, its records).
    #[error(transparent)]
    Ambient(Box<dyn std::error::Error + Send + Sync>),
}

/// What adopting a running pod's capture found, and did ([`CaptureBackend::adopt`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Adoption {
    /// The netns holds none of Istio's rules of this backend's kind.
    Nothing,
    /// Exactly the rules meshcap renders for the pod now (how they were found): recorded.
    Recognised(String),
    /// Istio's rules in another form (an earlier version's, or written for other annotations
    /// or node settings; how they differed): replaced with the pod's rules now and recorded.
    Reconciled(String),
    /// Istio's rules in another form (how they differ): left exactly as they are, not
    /// recorded.
    NotRecognised(String),
}

/// A way of capturing a pod's traffic. Implementations are shared between threads.
pub trait CaptureBackend: Send + Sync {
    /// The backend's name: `ebpf`, `iptables` or `nftables`.
    fn name(&self) -> &'static str;

    /// Captures the pod as the policy says. Idempotent; when the pod is already captured with
    /// another policy, the capture is updated, and what was removed behind meshcap's back is
    /// put back. On error nothing of this call stays applied.
    ///
    /// # Errors
    /// When the capture cannot be applied, or this backend does not serve the policy's mode.
    fn add(&self, pod: &PodRef, policy: &PodPolicy) -> Result<(), BackendError>;

    /// Verifies that the pod is captured exactly as the policy says.
    ///
    /// # Errors
    /// [`BackendError::NotCaptured`] naming what is missing, or a failure to look.
    fn check(&self, pod: &PodRef, policy: &PodPolicy) -> Result<(), BackendError>;

    /// Removes the pod's capture, whatever its mode. Idempotent: an unknown pod, or one whose
    /// netns is gone, succeeds.
    ///
    /// # Errors
    /// When capture state exists but cannot be removed.
    fn remove(&self, pod: &PodRef) -> Result<(), BackendError>;

    /// The captures of `mode` this backend holds.
    ///
    /// # Errors
    /// When its state cannot be read.
    fn list(&self, mode: DataplaneMode) -> Result<Vec<CapturedPod>, BackendError>;

    /// The node-wide programs in place (none for a backend without kernel programs).
    fn programs(&self) -> Vec<AttachedProgram> {
        Vec::new()
    }

    /// Other programs on the backend's node-wide hooks, and where they run.
    fn other_programs(&self) -> Vec<OtherProgram> {
        Vec::new()
    }

    /// What an operator should know about the captures in place, in words: pods the backend
    /// holds but cannot capture in full (for the eBPF backend, processes outside the cgroup its
    /// programs are attached to). Shown in the status report, logged periodically.
    fn warnings(&self) -> Vec<String> {
        Vec::new()
    }

    /// How many pods this backend captures, in either mode (the metrics' gauge, updated after
    /// every ADD and DEL): what [`Self::list`] would count, without building the lists where
    /// the backend keeps the number.
    ///
    /// # Errors
    /// When its state cannot be read.
    fn captured_count(&self) -> Result<usize, BackendError> {
        Ok(self.list(DataplaneMode::Sidecar)?.len() + self.list(DataplaneMode::Ambient)?.len())
    }

    /// Reconciles the state a previous agent left with the live pods: drops every capture
    /// whose network namespace no longer exists (its pod went while no agent ran), in either
    /// mode, and returns those pods, and drops what an agent stopped part-way through a request
    /// left that nothing refers to. Live pods stay captured. Called once at start, before any
    /// request is served.
    ///
    /// # Errors
    /// When the state cannot be read or an entry cannot be dropped.
    fn prune_gone(&self) -> Result<Vec<PodRef>, BackendError>;

    /// The pods of `mode` captured here whose network namespace no longer exists, while the
    /// agent runs: their runtime's DEL came while an earlier agent was down or dying (the
    /// plugin lets such a DEL succeed) and the netns went after this agent started. Nothing is
    /// removed.
    ///
    /// # Errors
    /// When the state cannot be read.
    fn gone(&self, mode: DataplaneMode) -> Result<Vec<PodRef>, BackendError>;

    /// Drops `pod`'s capture if its network namespace is still gone, and says whether it did.
    /// The caller holds the container's request lock, so an ADD that captured the container
    /// anew since [`Self::gone`] looked is seen here and kept.
    ///
    /// # Errors
    /// When an entry cannot be dropped.
    fn drop_if_gone(&self, pod: &PodRef) -> Result<bool, BackendError>;

    /// Compares `pod`'s capture (one [`Self::list`] names) with this backend's record of it:
    /// what it applied, or adopted from an earlier agent. With [`Verify::Repair`] what differs
    /// is put back in place: no DEL and ADD, nothing established broken, and never a moment in
    /// which less is in place than before the repair (what is missing is added; what is wrong
    /// is replaced atomically). The caller holds the container's request lock. A backend that
    /// keeps no record verifies nothing.
    ///
    /// # Errors
    /// When the capture cannot be looked at (its netns cannot be entered); a difference is no
    /// error.
    fn verify(&self, _pod: &PodRef, _verify: Verify) -> Result<PodCheck, BackendError> {
        Ok(PodCheck::default())
    }

    /// The same for what the backend has node-wide (programs and links shared by every pod, the
    /// node's probe set): once per pass, before the pods.
    fn verify_node(&self, _verify: Verify) -> PodCheck {
        PodCheck::default()
    }

    /// Makes the policy routes a capture found in place its own (they were the other way's
    /// capture of the same pod, moved here: [`crate::ambient`]'s move between ways).
    ///
    /// # Errors
    /// When its record cannot be written.
    fn forget_found_routes(&self, _pod: &PodRef) -> Result<(), BackendError> {
        Ok(())
    }

    /// Moves `pod` from the capture of a backend this one keeps in front of (rules adopted from
    /// istio-cni) to its own, as `policy` says: [`Self::add_moving`] first, then the earlier
    /// capture handed over ([`Self::hand_over`]; a failure takes the new one away again), so
    /// established connections keep their NAT. Whether it moved (false: nothing in front of
    /// it, or a pod not held there).
    ///
    /// # Errors
    /// When the new capture cannot be applied or the earlier one removed (nothing changes).
    fn take_in(&self, _pod: &PodRef, _policy: &PodPolicy) -> Result<bool, BackendError> {
        Ok(false)
    }

    /// [`Self::remove`] for a pod the backend in front of this one takes in place
    /// ([`Self::take_in`]): what the connections this capture made still need stays (Istio's
    /// rules: conntrack kept on in the netns, so that their NAT goes on).
    ///
    /// # Errors
    /// As [`Self::remove`].
    fn hand_over(&self, pod: &PodRef) -> Result<(), BackendError> {
        self.remove(pod)
    }

    /// [`Self::add`] for a pod whose netns keeps netfilter NAT hooks (Istio's `nat` rules being
    /// removed, their empty base chains left): the kernel programs then hand every captured
    /// SYN to the socket lookup, as the kernel's NAT drops a listener `bpf_sk_assign` chose.
    ///
    /// # Errors
    /// As [`Self::add`].
    fn add_moving(&self, pod: &PodRef, policy: &PodPolicy) -> Result<(), BackendError> {
        self.add(pod, policy)
    }

    /// Adopts what another agent (istio-cni) left in a running pod's netns that this backend
    /// writes too ([`found`]): rules exactly as `policy` renders them are recorded as this
    /// backend's capture; rules in another form are replaced with `policy`'s (one transaction
    /// per table) and recorded when `reconcile` (ambient mode, as Istio's agent at start),
    /// else left exactly as they are. Nothing by default: Istio writes no kernel programs.
    ///
    /// # Errors
    /// When the netns cannot be looked at, or a reconciliation fails (nothing is recorded).
    fn adopt(
        &self,
        _pod: &PodRef,
        _policy: &PodPolicy,
        _reconcile: bool,
    ) -> Result<Adoption, BackendError> {
        Ok(Adoption::Nothing)
    }
}

/// Which backend the agent uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum BackendChoice {
    /// eBPF when the kernel probe passes, else iptables.
    #[default]
    Auto,
    /// eBPF, or fail to start.
    Ebpf,
    /// Istio's iptables rules.
    Iptables,
    /// Istio's native nftables rules (`global.nativeNftables`).
    Nftables,
}

#[cfg(test)]
mod tests;
