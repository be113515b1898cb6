//! The verifier's pass ([`crate::verify`]) over the set of captures: each backend's node-wide
//! part, then every capture, each under its container's request lock so that no pass races an
//! ADD, a DEL or a CHECK of it; and what it found as an operator sees it: counted
//! (`meshcap_capture_drift_total{kind,result}`), logged, and a Warning Event on the pod (on the
//! node for node-wide drift).
use std::time::Instant;

use tracing::{error, warn};

use super::{Hub, request::off_the_runtime};
use crate::{
    backend::{Drift, DriftKind, DriftOutcome, PodCheck, Verify},
    pod::PodRef,
    verify::PassStats,
};

/// The Event reasons.
const REPAIRED: &str = "CaptureDriftRepaired";
const NOT_REPAIRED: &str = "CaptureDriftNotRepaired";

impl Hub {
    /// One verification pass; stops early once the agent stops serving (it is shutting down,
    /// and may be about to uninstall). What it found goes to the ledger, the metrics, the log
    /// and the pods' Events.
    pub async fn verify_pass(&self) -> PassStats {
        let started = Instant::now();
        let cpu = cpu_seconds();
        let router = self.captures.router().clone();
        let mut stats = PassStats::default();
        let mut node = PodCheck::default();
        for (_, backend) in router.modes() {
            let backend = backend.clone();
            if let Ok(check) = off_the_runtime(move || backend.verify_node(Verify::Repair)).await {
                node.extend(check);
            }
        }
        self.report(None, &node.drift, &mut stats);
        self.ledger.node(&node.drift);
        let mut seen = Vec::new();
        'modes: for (mode, backend) in router.modes() {
            let listed = {
                let backend = backend.clone();
                off_the_runtime(move || backend.list(mode)).await
            };
            let listed = match listed {
                Ok(Ok(listed)) => listed,
                Ok(Err(err)) => {
                    warn!(%mode, error = %err, "verifying: the captures cannot be listed");
                    continue;
                }
                Err(err) => {
                    warn!(%mode, error = %err, "verifying: the captures cannot be listed");
                    continue;
                }
            };
            for captured in listed {
                if !self
                    .readiness
                    .serving
                    .load(std::sync::atomic::Ordering::Acquire)
                {
                    break 'modes;
                }
                let pod = captured.pod;
                let id = pod.container_id.clone();
                let (backend, target) = (backend.clone(), pod.clone());
                let work = off_the_runtime(move || backend.verify(&target, Verify::Repair));
                match self.locks.run(&id, work).await {
                    Ok(Ok(check)) => {
                        stats.pods += 1;
                        self.report(Some(&pod), &check.drift, &mut stats);
                        self.ledger.pod(&id, &pod.pod_name(), &check.drift);
                    }
                    Ok(Err(err)) => {
                        warn!(pod = %pod, container = %id, error = %err, "verifying the capture");
                    }
                    Err(err) => {
                        warn!(pod = %pod, container = %id, error = %err, "verifying the capture");
                    }
                }
                seen.push(id);
            }
        }
        stats.seconds = started.elapsed().as_secs_f64();
        stats.cpu_seconds = (cpu_seconds() - cpu).max(0.0);
        self.ledger.finish(stats, &seen);
        self.metrics.verified(stats.seconds, stats.cpu_seconds);
        stats
    }

    /// The CNI configuration's watch put meshcap's entry back (a primary CNI rewrote its file):
    /// counted, logged and reported as node-wide drift is.
    pub fn cni_config_repaired(&self, what: String) {
        let drift = Drift::new(DriftKind::CniConfig, what, DriftOutcome::Repaired);
        self.report(
            None,
            std::slice::from_ref(&drift),
            &mut PassStats::default(),
        );
        self.ledger.node(&[drift]);
    }

    /// Counts, logs and publishes each of `drift` (`pod`'s, or the node's).
    fn report(&self, pod: Option<&PodRef>, drift: &[Drift], stats: &mut PassStats) {
        for drift in drift {
            let result = match &drift.outcome {
                DriftOutcome::Repaired => {
                    stats.repaired += 1;
                    "repaired"
                }
                DriftOutcome::Failed(_) => {
                    stats.failed += 1;
                    "failed"
                }
                DriftOutcome::Found => "found",
            };
            self.metrics.drift(drift.kind.label(), result);
            let (kind, what) = (drift.kind.label(), &drift.what);
            match (pod, &drift.outcome) {
                (Some(pod), DriftOutcome::Failed(why)) => {
                    error!(pod = %pod, container = %pod.container_id, kind, %why, "capture drift could not be put back: {what}");
                }
                (Some(pod), _) => {
                    warn!(pod = %pod, container = %pod.container_id, kind, "capture drift put back: {what}");
                }
                (None, DriftOutcome::Failed(why)) => {
                    error!(kind, %why, "node-wide capture drift could not be put back: {what}");
                }
                (None, _) => warn!(kind, "node-wide capture drift put back: {what}"),
            }
            let Some(sink) = &self.events else {
                continue;
            };
            let (reason, note) = if drift.failed() {
                (NOT_REPAIRED, format!("meshcap could not put back {drift}"))
            } else {
                (REPAIRED, format!("meshcap put back {kind}: {what}"))
            };
            let action = drift.kind.action();
            match pod {
                Some(pod) => sink.warn(pod.pod_name(), None, reason, action, note),
                None => sink.warn_node(reason, action, note),
            }
        }
    }
}

/// CPU time of the agent and of the commands it ran and waited for (user and system).
fn cpu_seconds() -> f64 {
    use nix::sys::resource::{UsageWho, getrusage};
    [UsageWho::RUSAGE_SELF, UsageWho::RUSAGE_CHILDREN]
        .into_iter()
        .filter_map(|who| getrusage(who).ok())
        .map(|usage| {
            let (user, system) = (usage.user_time(), usage.system_time());
            seconds(user.tv_sec(), user.tv_usec()) + seconds(system.tv_sec(), system.tv_usec())
        })
        .sum()
}

fn seconds(secs: i64, micros: i64) -> f64 {
    secs as f64 + micros as f64 / 1e6
}
