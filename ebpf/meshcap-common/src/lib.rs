//! What the kernel programs and the agent agree on: map names, map value layouts and the
//! capture decision. `no_std`, no allocation, no panics: the same code runs in the verifier's
//! world and in host tests.
#![no_std]

/// Map names, as the programs declare them and the agent opens them.
pub mod maps {
    /// Per-pod capture configuration, keyed by the pod's network namespace cookie.
    pub const PODS: &str = "MESHCAP_PODS";
}

/// The proxy's outbound listener port (Istio's fixed `15001`).
pub const PROXY_OUTBOUND_PORT: u16 = 15001;

/// Capture configuration of one pod, the value of [`maps::PODS`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodConfig {
    /// The proxy's uid: its own connections are never captured.
    pub proxy_uid: u32,
    /// The proxy's gid: its own connections are never captured.
    pub proxy_gid: u32,
}

#[cfg(feature = "user")]
// SAFETY: `PodConfig` is `repr(C)`, `Copy`, has no padding and every bit pattern is valid.
unsafe impl aya::Pod for PodConfig {}
