//! Pod → capture decision, with Istio's CNI semantics down to the edge cases.
//!
//! - [`decide`] is the pod's decision, the only one the agent makes: left alone, its sidecar's
//!   [`RedirectPolicy`], or ambient mode's [`ambient::InpodPolicy`]; it asks the two below;
//! - [`select`] decides, as Istio's CNI plugin does, whether a pod is captured for its sidecar,
//!   and builds its [`RedirectPolicy`];
//! - [`RedirectPolicy`] is the one model both backends translate (the eBPF maps and the
//!   iptables rules); nothing else in meshcap reads the annotations;
//! - [`RedirectPolicy::decide`] is the policy's own per-packet decision, written from the
//!   semantics;
//! - [`RedirectPolicy::render`] writes Istio's exact iptables rules ([`IptablesRules`]), and
//!   [`nftables`] writes Istio's exact native nftables rules (`global.nativeNftables`) for the
//!   same policies; [`RuleEvaluator`] parses and walks rendered rules: an oracle independent of the model, to
//!   check the eBPF decision and [`RedirectPolicy::decide`] against;
//! - [`PolicyRoutes`]: the policy routes and `lo` addresses a capture needs besides rules;
//! - [`ambient`]: ambient mode's enrollment ([`ambient::enroll`]) and its in-pod policy, whose
//!   [`ambient::InpodPolicy::render`] writes Istio's exact in-pod rules.
//!
//! Everything here is pure: no I/O, no kernel.

mod addr;
pub mod ambient;
pub mod annotations;
mod decision;
mod error;
mod eval;
mod iptables;
pub mod manifest;
mod model;
pub mod nftables;
mod packet;
mod per_packet;
mod routes;
mod sidecar;

pub use decision::{
    DataplaneMode, Decision, DecisionError, NodeSettings, decide, reads_namespace_labels,
};
pub use error::{ManifestError, PolicyError};
pub use eval::{RuleEvaluator, RuleParseError, RuleSet, Trace};
pub use iptables::{IptablesRules, hostprobe};
pub use manifest::parse_pod_manifest;
pub use model::*;
pub use packet::{CtState, Direction, Outcome, Packet, Protocol, Verdict};
pub use per_packet::{INBOUND_PASSTHROUGH_V4, INBOUND_PASSTHROUGH_V6, LOOPBACK_INTERFACE};
pub use routes::{MarkRoute, PolicyRoutes};
pub use sidecar::{SelectConfig, select, status_pod_ips};
