//! What the verifier found, and `explain`'s answer. The verifier is the hub's
//! ([`crate::hub::Hub::verify_every`], `hub/verify.rs`): every capture on the node compared
//! with its record every `--verify-interval-seconds` (`meshcap.verifyIntervalSeconds`, 30 by
//! default, 0 off), and what drifted put back in place — Istio's rules in a pod's netns as
//! CHECK compares them, its TC stubs, its map entries, its policy route, the node-wide cgroup
//! links and classifier, an ambient pod's hand-over to ztunnel and its addresses in the node's
//! probe set (each backend's [`crate::backend::CaptureBackend::verify`] says how, and why no
//! repair opens a window). Every drift is counted (`meshcap_capture_drift_total{kind,result}`), logged and
//! reported as a Warning Event on its pod (node-wide drift on the node); drift that cannot be
//! put back keeps the agent not ready until a pass puts it back ([`Ledger`]).
//!
//! A pass runs pod by pod under each pod's request lock ([`crate::hub::Hub::verify_pass`]), so
//! it never races an ADD, a DEL or a CHECK of the same pod; it stops when the agent stops
//! serving, before an uninstall begins. The CNI configuration has its own watch
//! ([`crate::install::watch`]), whose repairs are counted and reported the same way.
//!
//! This module is below the hub (docs/development.md, "Layers"): the hub writes what its passes
//! find here and reads it back for readiness and `explain`.
//!
//! - [`ledger`]: what the passes found, for `explain` and readiness;
//! - [`explain`]: `meshcap-agent explain NAMESPACE/POD`'s answer.
pub mod explain;
pub mod ledger;

pub use explain::{CaptureNow, Explanation};
pub use ledger::{Dated, Ledger, PassStats, Verified};

/// The default interval, in seconds (`meshcap.verifyIntervalSeconds`).
pub const DEFAULT_INTERVAL_SECONDS: u64 = 30;
