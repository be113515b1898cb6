//! CNI errors: the spec's error codes and the error JSON a failed command prints.
use serde_json::Value;

/// CNI error codes from the spec (meshcap's own start at 100, see the protocol module).
pub mod code {
    /// Incompatible CNI version.
    pub const INCOMPATIBLE_VERSION: u32 = 1;
    /// Unknown or unsupported environment variable / missing one.
    pub const INVALID_ENV: u32 = 4;
    /// I/O failure.
    pub const IO: u32 = 5;
    /// Failed to decode content.
    pub const DECODE: u32 = 6;
    /// Invalid network configuration.
    pub const INVALID_CONFIG: u32 = 7;
    /// Try again later.
    pub const TRY_AGAIN_LATER: u32 = 11;
    /// STATUS: the plugin is not available.
    pub const NOT_AVAILABLE: u32 = 50;
}

/// A CNI error, printed as the spec's error JSON on stdout.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{msg}")]
pub struct CniError {
    /// The error code.
    pub code: u32,
    /// A one-line message.
    pub msg: String,
    /// Longer context, possibly empty.
    pub details: String,
}

impl CniError {
    /// An error without details.
    #[must_use]
    pub fn new(code: u32, msg: impl Into<String>) -> Self {
        Self {
            code,
            msg: msg.into(),
            details: String::new(),
        }
    }

    /// The error JSON for a given spec version.
    #[must_use]
    pub fn to_json(&self, cni_version: &str) -> Value {
        let mut out = serde_json::json!({
            "cniVersion": cni_version,
            "code": self.code,
            "msg": self.msg,
        });
        if !self.details.is_empty() {
            out["details"] = Value::String(self.details.clone());
        }
        out
    }
}
