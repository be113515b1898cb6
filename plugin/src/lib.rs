//! meshcap-cni: the CNI side. Knows the CNI spec and the agent's socket protocol, nothing of
//! Kubernetes or BPF.
#![forbid(unsafe_code)]

/// CNI spec versions this plugin speaks.
pub const SUPPORTED_VERSIONS: &[&str] = &["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];

/// The `VERSION` command's answer.
#[must_use]
pub fn version_info() -> serde_json::Value {
    serde_json::json!({ "cniVersion": "1.1.0", "supportedVersions": SUPPORTED_VERSIONS })
}
