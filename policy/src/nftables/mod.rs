//! Istio's native nftables rules (`global.nativeNftables`), as `nft -f` input: one
//! transaction per pod that adds, flushes and refills Istio's `inet` tables, exactly as
//! `knftables` prints what Istio's node agent runs.
//!
//! - [`sidecar`]: a sidecar pod's rules (`tools/istio-nftables/`), from its
//!   [`super::RedirectPolicy`] (through [`sidecar::SidecarCapture`], `istio-nftables`' own
//!   configuration);
//! - [`inpod`]: an ambient pod's in-pod rules (`cni/pkg/nftables/`), from its
//!   [`super::ambient::InpodPolicy`];
//! - [`hostprobe`]: the node's rule SNAT-ing kubelet's probes of ambient pods.
//!
//! Policy routes are the same as with iptables ([`super::PolicyRoutes`]).

pub mod hostprobe;
pub mod inpod;
pub mod sidecar;
mod transaction;
