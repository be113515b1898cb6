//! Pod → capture decision, with Istio's CNI semantics down to the edge cases.
//!
//! - [`select`] decides, as Istio's CNI plugin does, whether a pod is captured at all;
//! - [`RedirectPolicy`] is the one model both backends translate (the eBPF maps and the
//!   iptables rules); nothing else in meshcap reads the annotations;
//! - [`RedirectPolicy::decide`] is the policy's own per-packet decision, written from the
//!   semantics;
//! - [`RedirectPolicy::render`] writes Istio's exact iptables rules, and [`RuleSet`] parses and
//!   walks rendered rules: an oracle independent of the model, to check the eBPF decision and
//!   [`RedirectPolicy::decide`] against.
//!
//! Everything here is pure: no I/O, no kernel.

mod error;
mod model;
mod packet;

pub use error::PolicyError;
pub use model::*;
pub use packet::{CtState, Direction, Outcome, Packet, Protocol, Verdict};
