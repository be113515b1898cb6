//! Capture backends: translations of a [`RedirectPolicy`] into kernel state for one pod —
//! [`ebpf`], the kernel programs (primary), and [`iptables`], Istio's rules (fallback).
//!
//! Every method is blocking (they enter network namespaces, fork `iptables-restore`, talk
//! netlink or BPF): the agent calls them through `tokio::task::block_in_place` (or the
//! blocking pool), never as plain async work.
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::{pod::PodRef, podnet::PodNetError, policy::RedirectPolicy};

pub mod ebpf;
pub mod iptables;

/// A capture in place, as a backend reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CapturedPod {
    /// The pod.
    pub pod: PodRef,
    /// The backend holding the capture ([`CaptureBackend::name`]).
    pub backend: String,
    /// What is applied, in one line (mode, and backend details such as the iptables flavour).
    pub summary: String,
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
    /// The eBPF backend's own failure (maps, programs, links, pins).
    #[error(transparent)]
    Ebpf(#[from] ebpf::EbpfError),
}

/// A way of capturing a pod's traffic. Implementations are shared between threads.
pub trait CaptureBackend: Send + Sync {
    /// The backend's name: `ebpf` or `iptables`.
    fn name(&self) -> &'static str;

    /// Captures the pod as the policy says. Idempotent; when the pod is already captured with
    /// another policy, the capture is updated. On error nothing of this call stays applied.
    ///
    /// # Errors
    /// When the capture cannot be applied.
    fn add(&self, pod: &PodRef, policy: &RedirectPolicy) -> Result<(), BackendError>;

    /// Removes the pod's capture. Idempotent: an unknown pod, or one whose netns is gone,
    /// succeeds.
    ///
    /// # Errors
    /// When capture state exists but cannot be removed.
    fn remove(&self, pod: &PodRef) -> Result<(), BackendError>;

    /// Verifies that the pod is captured exactly as the policy says.
    ///
    /// # Errors
    /// [`BackendError::NotCaptured`] naming what is missing, or a failure to look.
    fn check(&self, pod: &PodRef, policy: &RedirectPolicy) -> Result<(), BackendError>;

    /// The captures this backend holds.
    ///
    /// # Errors
    /// When its state cannot be read.
    fn list(&self) -> Result<Vec<CapturedPod>, BackendError>;

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

    /// How many pods this backend captures (the metrics' gauge, updated after every ADD and
    /// DEL): what [`Self::list`] would count, without building the list where the backend
    /// keeps the number.
    ///
    /// # Errors
    /// When its state cannot be read.
    fn captured_count(&self) -> Result<usize, BackendError> {
        self.list().map(|pods| pods.len())
    }

    /// Reconciles the state a previous agent left with the live pods: drops every capture
    /// whose network namespace no longer exists (its pod went while no agent ran), and
    /// returns those pods, and drops what an agent stopped part-way through a request left
    /// that nothing refers to. Live pods stay captured. Called once at start, before any
    /// request is served.
    ///
    /// # Errors
    /// When the state cannot be read or an entry cannot be dropped.
    fn prune_gone(&self) -> Result<Vec<PodRef>, BackendError>;

    /// The captured pods whose network namespace no longer exists, while the agent runs:
    /// their runtime's DEL came while an earlier agent was down or dying (the plugin lets such
    /// a DEL succeed) and the netns went after this agent started. Nothing is removed.
    ///
    /// # Errors
    /// When the state cannot be read.
    fn gone(&self) -> Result<Vec<PodRef>, BackendError>;

    /// Drops `pod`'s capture if its network namespace is still gone, and says whether it did.
    /// The caller holds the container's request lock, so an ADD that captured the container
    /// anew since [`Self::gone`] looked is seen here and kept.
    ///
    /// # Errors
    /// When an entry cannot be dropped.
    fn drop_if_gone(&self, pod: &PodRef) -> Result<bool, BackendError>;
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
}
