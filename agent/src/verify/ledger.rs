//! What the verifier found, kept for what an operator asks (`explain`, readiness): per capture
//! the last time it was verified and the drift put back lately, node-wide the same, and the
//! drift the last pass could not put back.
use std::{
    collections::{BTreeMap, HashMap, VecDeque},
    sync::Mutex,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use meshcap_policy::PodName;
use serde::{Deserialize, Serialize};

use crate::backend::Drift;

/// How many repairs are kept per capture (and node-wide): the latest.
const KEPT: usize = 8;

/// A drift put back (or not), and when.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dated {
    /// When it was found, in seconds since the Unix epoch.
    pub at: u64,
    /// What differed and what became of it.
    pub drift: Drift,
}

/// What the verifier knows of one capture, or of the node's shared part.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verified {
    /// When it was last verified, in seconds since the Unix epoch (none: not yet).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last: Option<u64>,
    /// The latest drift found, newest last.
    #[serde(default, skip_serializing_if = "VecDeque::is_empty")]
    pub drift: VecDeque<Dated>,
}

impl Verified {
    fn note(&mut self, at: u64, drift: &[Drift]) {
        self.last = Some(at);
        for drift in drift {
            if self.drift.len() == KEPT {
                self.drift.pop_front();
            }
            self.drift.push_back(Dated {
                at,
                drift: drift.clone(),
            });
        }
    }
}

/// One pass, in numbers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PassStats {
    /// Captures verified.
    pub pods: usize,
    /// Drift put back.
    pub repaired: usize,
    /// Drift that could not be put back.
    pub failed: usize,
    /// Wall time.
    pub seconds: f64,
    /// CPU time of the agent and the commands it ran (user and system).
    pub cpu_seconds: f64,
}

/// The verifier's findings.
#[derive(Default)]
pub struct Ledger {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    pods: HashMap<String, (PodName, Verified)>,
    node: Verified,
    /// Drift the pass in progress could not put back, by whom: `pod ns/name` or `the node`.
    failing: BTreeMap<String, Vec<String>>,
    /// The same, of the last finished pass.
    failed: BTreeMap<String, Vec<String>>,
    last_pass: Option<PassStats>,
    /// How often passes run (none: verification is off).
    interval: Option<Duration>,
}

impl State {
    /// Adds what of `drift` could not be put back to the pass's failures, under `whom`.
    fn note_failing(&mut self, whom: String, drift: &[Drift]) {
        let failed: Vec<String> = drift
            .iter()
            .filter(|d| d.failed())
            .map(ToString::to_string)
            .collect();
        if !failed.is_empty() {
            self.failing.entry(whom).or_default().extend(failed);
        }
    }
}

impl Ledger {
    /// Says how often passes run.
    pub fn set_interval(&self, every: Duration) {
        self.lock().interval = Some(every);
    }

    /// How often passes run; `None` when verification is off.
    #[must_use]
    pub fn interval(&self) -> Option<Duration> {
        self.lock().interval
    }

    /// Records a verification of the capture of `container` (`pod`) that found `drift`.
    pub fn pod(&self, container: &str, pod: &PodName, drift: &[Drift]) {
        let at = now();
        let mut state = self.lock();
        state.note_failing(format!("pod {pod}"), drift);
        state
            .pods
            .entry(container.to_owned())
            .or_insert_with(|| (pod.clone(), Verified::default()))
            .1
            .note(at, drift);
    }

    /// Records a verification of the node's shared part that found `drift` (a pass's, or the
    /// CNI configuration watch's).
    pub fn node(&self, drift: &[Drift]) {
        let at = now();
        let mut state = self.lock();
        state.note_failing("the node".to_owned(), drift);
        state.node.note(at, drift);
    }

    /// Ends a pass: what it could not put back is what keeps the agent not ready; captures
    /// not among `seen` (released since) are forgotten.
    pub fn finish(&self, stats: PassStats, seen: &[String]) {
        let mut state = self.lock();
        state.failed = std::mem::take(&mut state.failing);
        state.pods.retain(|id, _| seen.contains(id));
        state.last_pass = Some(stats);
    }

    /// Why the agent is not ready, when the last pass left drift it could not put back.
    #[must_use]
    pub fn not_ready_reason(&self) -> Option<String> {
        let state = self.lock();
        let first = state.failed.iter().next()?;
        let more = state.failed.len() - 1;
        Some(format!(
            "capture drift that could not be put back: {}: {}{}",
            first.0,
            first.1.join("; "),
            if more > 0 {
                format!(" (and {more} more)")
            } else {
                String::new()
            }
        ))
    }

    /// What is known of the capture of `container`.
    #[must_use]
    pub fn of_pod(&self, container: &str) -> Verified {
        self.lock()
            .pods
            .get(container)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    }

    /// What is known of the node's shared part.
    #[must_use]
    pub fn of_node(&self) -> Verified {
        self.lock().node.clone()
    }

    /// The last finished pass.
    #[must_use]
    pub fn last_pass(&self) -> Option<PassStats> {
        self.lock().last_pass
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Seconds since the Unix epoch.
#[must_use]
pub fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_secs()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{DriftKind, DriftOutcome};

    fn pod() -> PodName {
        PodName {
            namespace: "shop".into(),
            name: "web".into(),
        }
    }

    #[test]
    fn a_failed_repair_keeps_the_agent_not_ready_until_a_pass_without_one() {
        let ledger = Ledger::default();
        assert_eq!(ledger.not_ready_reason(), None);
        let failed = Drift::new(
            DriftKind::TcFilter,
            "no stub on eth0",
            DriftOutcome::Failed("EPERM".into()),
        );
        ledger.pod("c1", &pod(), &[failed]);
        // Not before the pass ends: a reason is a whole pass's.
        assert_eq!(ledger.not_ready_reason(), None);
        ledger.finish(PassStats::default(), &["c1".to_owned()]);
        assert_eq!(
            ledger.not_ready_reason().as_deref(),
            Some(
                "capture drift that could not be put back: pod shop/web: tc_filter: no stub on eth0 (not put back: EPERM)"
            )
        );
        let repaired = Drift::new(
            DriftKind::TcFilter,
            "no stub on eth0",
            DriftOutcome::Repaired,
        );
        ledger.pod("c1", &pod(), &[repaired]);
        ledger.finish(PassStats::default(), &["c1".to_owned()]);
        assert_eq!(ledger.not_ready_reason(), None);
        let kept = ledger.of_pod("c1");
        assert_eq!(kept.drift.len(), 2);
        assert!(kept.last.is_some());
        ledger.finish(PassStats::default(), &[]);
        assert_eq!(
            ledger.of_pod("c1"),
            Verified::default(),
            "released: forgotten"
        );
    }

    #[test]
    fn only_the_latest_drift_is_kept() {
        let ledger = Ledger::default();
        for i in 0..20 {
            let drift = Drift::new(
                DriftKind::MapEntry,
                format!("change {i}"),
                DriftOutcome::Repaired,
            );
            ledger.node(&[drift]);
        }
        let node = ledger.of_node();
        assert_eq!(node.drift.len(), KEPT);
        assert_eq!(
            node.drift.back().map(|d| d.drift.what.as_str()),
            Some("change 19")
        );
    }
}
