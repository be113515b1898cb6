//! meshcap-agent: the node daemon that captures sidecar pods' traffic.
//!
//! Layout, one concern per module:
//! - [`backend`]: the capture backends ([`backend::ebpf`]: the kernel programs, pinned);
//! - [`bpf`]: the embedded kernel programs and how they are loaded;
//! - [`cgroup`]: finding the cgroup v2 hierarchy the programs attach to;
//! - [`logging`]: `tracing` set-up, with aya-log and `log` records bridged in;
//! - [`netns`]: entering a pod's network namespace and learning its cookie;
//! - [`policy`]: pod → capture decision and [`policy::RedirectPolicy`], Istio's semantics, its
//!   iptables rendering and an evaluator of the rendered rules.

pub mod backend;
pub mod bpf;
pub mod cgroup;
pub mod logging;
pub mod netns;
pub mod policy;
