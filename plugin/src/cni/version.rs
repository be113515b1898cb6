//! The CNI spec versions this plugin speaks.
use super::{CniError, code};

/// CNI spec versions this plugin speaks, oldest first.
pub const SUPPORTED_VERSIONS: &[&str] = &["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];
/// The newest spec version, used when the configuration's is unknown.
pub const LATEST_VERSION: &str = "1.1.0";

/// Fails with code 1 unless `version` is one this plugin speaks.
///
/// # Errors
/// When it is not supported.
pub fn check_version(version: &str) -> Result<(), CniError> {
    if SUPPORTED_VERSIONS.contains(&version) {
        Ok(())
    } else {
        Err(CniError {
            code: code::INCOMPATIBLE_VERSION,
            msg: format!("CNI version {version:?} is not supported by meshcap-cni"),
            details: format!("supported versions: {}", SUPPORTED_VERSIONS.join(", ")),
        })
    }
}

/// Whether a version uses the 1.x result format (no `version` in `ips`).
pub(super) fn is_v1(version: &str) -> bool {
    version.starts_with("1.")
}
