//! The CNI side: spec versions, the network configuration with meshcap's keys (read, and the
//! entry the agent writes), the runtime's configuration files, the environment the runtime
//! passes, results and errors.
//!
//! Spec versions 1.0.0 and 1.1.0 are spoken natively; 0.3.0, 0.3.1 and 0.4.0 configurations
//! (as kubelets and older conflists still write them) are accepted, and `prevResult` is
//! converted between the two result formats (they differ only in the `version` field of
//! `ips` entries).
mod config;
pub mod conflist;
mod entry;
mod error;
mod invocation;
mod result;
mod version;

pub use config::{
    Attachment, DEFAULT_AGENT_POD_NAMESPACE, DEFAULT_AGENT_POD_PREFIX, DEFAULT_AGENT_SOCKET,
    DEFAULT_TIMEOUT_SECONDS, LogLevel, NetConf, PLUGIN_TYPE, PluginConfig,
};
pub use entry::PluginSettings;
pub use error::{CniError, code};
#[cfg(test)]
pub(crate) use invocation::tests::env;
pub use invocation::{Command, Invocation, parse_cni_args};
pub use result::{convert_result, result_ips};
pub use version::{LATEST_VERSION, SUPPORTED_VERSIONS, check_version};
