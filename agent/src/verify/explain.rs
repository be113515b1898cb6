//! `meshcap-agent explain NAMESPACE/POD`: why a pod is (not) captured, as the running agent sees
//! it — its decision and the labels and annotations behind it, what is installed for it now
//! (compared with its record on the spot, nothing changed), the last verification and the drift
//! put back lately.
use std::fmt::Write as _;

use meshcap_policy::{DataplaneMode, PodName};
use serde::{Deserialize, Serialize};

use super::{Verified, ledger::now};
use crate::backend::{Drift, DriftOutcome};
pub use crate::pending::PendingEnrollment;

/// The answer.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Explanation {
    /// The pod asked about.
    pub pod: PodName,
    /// What the agent decides for it now, in a few words.
    pub decision: String,
    /// Why: the selection rule or annotation behind the decision.
    pub because: Vec<String>,
    /// The labels and annotations the decision reads, as the pod and its namespace carry them.
    pub inputs: Vec<String>,
    /// The capture the decision asks for, in one line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
    /// The captures in place for the pod (one per sandbox).
    pub captures: Vec<CaptureNow>,
    /// The node-wide part every capture relies on, as last verified.
    pub node: Verified,
    /// Seconds between two verifications (none: verification is off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verify_interval_seconds: Option<u64>,
    /// Why the agent is not ready, when it is not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_ready: Option<String>,
    /// Its live enrollment in ambient mode, when it failed and is to be tried again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_enrollment: Option<PendingEnrollment>,
    /// Why the capture istio-cni gave it, found at start, was left as it is (not adopted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub istio_capture_left: Option<String>,
}

/// One capture of the pod, as it is now.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CaptureNow {
    /// The sandbox it is recorded under.
    pub container_id: String,
    /// The mode it captures for.
    pub mode: DataplaneMode,
    /// The backend holding it.
    pub backend: String,
    /// The backend's summary.
    pub summary: String,
    /// What is installed, compared with the record just now.
    pub installed: Vec<String>,
    /// What differs from the record just now (the verifier puts it back on its next pass).
    pub differs: Vec<Drift>,
    /// The verifier's record of it.
    pub verified: Verified,
}

impl Explanation {
    /// The answer for humans.
    #[must_use]
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "pod {}: {}", self.pod, self.decision);
        for why in &self.because {
            let _ = writeln!(out, "  because {why}");
        }
        if !self.inputs.is_empty() {
            let _ = writeln!(out, "  read from: {}", self.inputs.join(", "));
        }
        if let Some(policy) = &self.policy {
            let _ = writeln!(out, "  policy: {policy}");
        }
        if let Some(pending) = &self.pending_enrollment {
            let _ = writeln!(
                out,
                "enrollment PENDING: {} attempt(s) failed, the last: {}; next attempt in {} s",
                pending.attempts, pending.last_error, pending.next_attempt_in_seconds
            );
        }
        if let Some(why) = &self.istio_capture_left {
            let _ = writeln!(out, "istio-cni's capture NOT ADOPTED: {why}");
        }
        if self.captures.is_empty() {
            let _ = writeln!(out, "installed: nothing");
        }
        let now = now();
        for capture in &self.captures {
            let short: String = capture.container_id.chars().take(12).collect();
            let _ = writeln!(
                out,
                "installed ({} pod, {} backend, container {short}): {}",
                capture.mode, capture.backend, capture.summary
            );
            for line in &capture.installed {
                let _ = writeln!(out, "  {line}");
            }
            for drift in &capture.differs {
                let _ = writeln!(out, "  DIFFERS {drift}");
            }
            verified(&mut out, "  ", "", &capture.verified, now);
        }
        let _ = match self.verify_interval_seconds {
            Some(every) => writeln!(out, "verification: every {every} s"),
            None => writeln!(
                out,
                "verification: off (meshcap.verifyIntervalSeconds is 0)"
            ),
        };
        verified(&mut out, "  ", "node-wide: ", &self.node, now);
        if let Some(reason) = &self.not_ready {
            let _ = writeln!(out, "agent NOT READY: {reason}");
        }
        out
    }
}

/// What the verifier knows of a capture (or of the node's part, `label`), and the drift it put
/// back lately, each with how long ago.
fn verified(out: &mut String, indent: &str, label: &str, verified: &Verified, now: u64) {
    match verified.last {
        Some(at) => {
            let ago = now.saturating_sub(at);
            let _ = writeln!(out, "{indent}{label}last verified {ago} s ago");
        }
        None => {
            let _ = writeln!(out, "{indent}{label}not verified yet");
        }
    }
    for dated in &verified.drift {
        let (drift, ago) = (&dated.drift, now.saturating_sub(dated.at));
        let (kind, what) = (drift.kind, &drift.what);
        let _ = match &drift.outcome {
            DriftOutcome::Repaired => {
                writeln!(out, "{indent}  {ago} s ago, put back {kind}: {what}")
            }
            DriftOutcome::Found => writeln!(out, "{indent}  {ago} s ago, found {kind}: {what}"),
            DriftOutcome::Failed(why) => writeln!(
                out,
                "{indent}  {ago} s ago, NOT put back {kind}: {what} ({why})"
            ),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{backend::DriftKind, verify::Dated};

    #[test]
    fn the_text_names_decision_capture_and_repairs() {
        let at = now();
        let explanation = Explanation {
            pod: PodName {
                namespace: "shop".into(),
                name: "web".into(),
            },
            decision: "captured for its sidecar".into(),
            because: vec!["sidecar mode: Istio injected its sidecar".into()],
            inputs: vec!["annotation sidecar.istio.io/status (set)".into()],
            policy: Some("REDIRECT; outbound *".into()),
            captures: vec![CaptureNow {
                container_id: "0123456789abcdef".into(),
                mode: DataplaneMode::Sidecar,
                backend: "ebpf".into(),
                summary: "netns cookie 7".into(),
                installed: vec!["inbound TC stub on eth0".into()],
                differs: Vec::new(),
                verified: Verified {
                    last: Some(at),
                    drift: [Dated {
                        at,
                        drift: Drift::new(
                            DriftKind::TcFilter,
                            "no stub on eth0",
                            DriftOutcome::Repaired,
                        ),
                    }]
                    .into(),
                },
            }],
            node: Verified::default(),
            verify_interval_seconds: Some(30),
            not_ready: None,
            pending_enrollment: Some(PendingEnrollment {
                attempts: 2,
                last_error: "no ztunnel is connected".into(),
                next_attempt_in_seconds: 4,
            }),
            istio_capture_left: Some("istio-cni's rules are not the ones Istio writes".into()),
        };
        let text = explanation.to_text();
        for needle in [
            "pod shop/web: captured for its sidecar",
            "because sidecar mode: Istio injected its sidecar",
            "installed (sidecar pod, ebpf backend, container 0123456789ab): netns cookie 7",
            "  inbound TC stub on eth0",
            "last verified 0 s ago",
            "0 s ago, put back tc_filter: no stub on eth0",
            "verification: every 30 s",
            "node-wide: not verified yet",
            "enrollment PENDING: 2 attempt(s) failed, the last: no ztunnel is connected; next attempt in 4 s",
            "istio-cni's capture NOT ADOPTED: istio-cni's rules are not the ones Istio writes",
        ] {
            assert!(text.contains(needle), "{needle:?} in\n{text}");
        }
        let back: Explanation =
            serde_json::from_value(serde_json::to_value(&explanation).unwrap()).unwrap();
        assert_eq!(back, explanation);
    }
}
