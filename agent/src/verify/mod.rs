//! The verifier: every capture on the node compared with its record every
//! `--verify-interval-seconds` (`meshcap.verifyIntervalSeconds`, 30 by default, 0 off), and what
//! drifted put back in place — Istio's rules in a pod's netns as CHECK compares them, its TC
//! stubs, its map entries, its policy route, the node-wide cgroup links and classifier, an
//! ambient pod's hand-over to ztunnel and its addresses in the node's probe set (each
//! backend's [`crate::backend::CaptureBackend::verify`] says how, and why no repair opens a
//! window). Every drift is counted (`meshcap_capture_drift_total{kind,result}`), logged and
//! reported as a Warning Event on its pod (node-wide drift on the node); drift that cannot be
//! put back keeps the agent not ready until a pass puts it back ([`Ledger`]).
//!
//! A pass runs pod by pod under each pod's request lock ([`crate::hub::Hub::verify_pass`]), so
//! it never races an ADD, a DEL or a CHECK of the same pod; it stops when the agent stops
//! serving, before an uninstall begins. The CNI configuration has its own watch
//! ([`crate::install::watch`]), whose repairs are counted and reported the same way.
//!
//! - [`ledger`]: what the passes found, for `explain` and readiness;
//! - [`explain`]: `meshcap-agent explain NAMESPACE/POD`'s answer.
pub mod explain;
pub mod ledger;

use std::{sync::Arc, time::Duration};

pub use explain::{CaptureNow, Explanation};
pub use ledger::{Dated, Ledger, PassStats, Verified};
use tokio::sync::watch;
use tracing::{info, warn};

use crate::hub::Hub;

/// The default interval, in seconds (`meshcap.verifyIntervalSeconds`).
pub const DEFAULT_INTERVAL_SECONDS: u64 = 30;

/// Verifies every capture every `every` until `stop` turns true (the agent stops serving):
/// the pass in progress finishes first, so nothing is put back once an uninstall may begin.
pub async fn run(hub: Arc<Hub>, every: Duration, mut stop: watch::Receiver<bool>) {
    hub.ledger().set_interval(every);
    info!(
        every_seconds = every.as_secs(),
        "verifying every capture against its record"
    );
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticks.tick() => {}
            _ = stop.wait_for(|stop| *stop) => return,
        }
        if *stop.borrow() {
            return;
        }
        let stats = hub.verify_pass().await;
        if stats.failed > 0 {
            warn!(
                pods = stats.pods,
                repaired = stats.repaired,
                failed = stats.failed,
                "verification pass: drift that could not be put back (the agent is not ready)"
            );
        } else if stats.repaired > 0 {
            info!(
                pods = stats.pods,
                repaired = stats.repaired,
                "verification pass: drift put back"
            );
        }
    }
}
