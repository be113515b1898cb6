//! meshcap-cni: the CNI side of meshcap. Knows the CNI spec and the agent's socket protocol,
//! nothing of Kubernetes or BPF. Small and synchronous: no async runtime, no kube client.
//!
//! - [`cni`]: spec versions, the network configuration (with meshcap's keys), the runtime's
//!   environment, results and errors;
//! - [`protocol`]: the plugin ⇄ agent protocol (the agent depends on this module);
//! - [`fallback`]: with the agent down, the decision `meshcap-agent decide` makes (the agent's
//!   own selection, run from its copy beside the plugin);
//! - [`plugin`]: one invocation, from environment and stdin to stdout and exit status.
#![forbid(unsafe_code)]

pub mod cni;
pub mod fallback;
pub mod plugin;
pub mod protocol;
