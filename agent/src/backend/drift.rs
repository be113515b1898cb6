//! What a capture is compared with its record by ([`super::CaptureBackend::verify`]): the kinds
//! of drift a capture can suffer behind meshcap's back, each found difference and whether it was
//! put back, and what was found installed.
use serde::{Deserialize, Serialize};

/// A kind of drift: what part of a capture differed from its record. The metrics count drift by
/// these names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DriftKind {
    /// Istio's iptables rules in the pod's netns (a sidecar's, or ambient mode's in-pod ones).
    Rules,
    /// A policy route in the pod's netns (TPROXY's, rerouted interfaces', ambient mode's).
    Route,
    /// A sysctl of the pod's netns the capture relies on (`tcp_fwmark_accept`).
    Sysctl,
    /// The pod's inbound TC stub on an interface (a netlink filter or a TCX link).
    TcFilter,
    /// The pod's socket lookup program (kernels before Linux 6.5).
    Handoff,
    /// The pod's entries in the per-pod maps.
    MapEntry,
    /// A node-wide cgroup link, or the program it runs.
    CgroupLink,
    /// The shared inbound classifier every pod's stub tail-calls.
    TcProgram,
    /// ztunnel does not serve an enrolled pod (ambient mode).
    Ztunnel,
    /// An enrolled pod's addresses in the node's probe set (ambient mode).
    ProbeSet,
    /// meshcap's entry in the runtime's CNI configuration.
    CniConfig,
}

impl DriftKind {
    /// The name the metrics, logs and events use.
    #[must_use]
    pub const fn label(self) -> &'static str {
        match self {
            Self::Rules => "rules",
            Self::Route => "route",
            Self::Sysctl => "sysctl",
            Self::TcFilter => "tc_filter",
            Self::Handoff => "handoff",
            Self::MapEntry => "map_entry",
            Self::CgroupLink => "cgroup_link",
            Self::TcProgram => "tc_program",
            Self::Ztunnel => "ztunnel",
            Self::ProbeSet => "probe_set",
            Self::CniConfig => "cni_config",
        }
    }
}

impl DriftKind {
    /// The action an Event about it names (one per kind, so that Events of two kinds on one
    /// pod are two Events, not one series).
    #[must_use]
    pub const fn action(self) -> &'static str {
        match self {
            Self::Rules => "RepairRules",
            Self::Route => "RepairRoute",
            Self::Sysctl => "RepairSysctl",
            Self::TcFilter => "RepairTcFilter",
            Self::Handoff => "RepairHandoff",
            Self::MapEntry => "RepairMapEntry",
            Self::CgroupLink => "RepairCgroupLink",
            Self::TcProgram => "RepairTcProgram",
            Self::Ztunnel => "RepairZtunnel",
            Self::ProbeSet => "RepairProbeSet",
            Self::CniConfig => "RepairCniConfig",
        }
    }
}

impl std::fmt::Display for DriftKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label())
    }
}

/// What became of a difference.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "state", content = "why")]
pub enum Outcome {
    /// Put back in place.
    Repaired,
    /// Only looked at (`meshcap-agent explain` never changes anything).
    Found,
    /// It could not be put back, and why: the agent is not ready until it is.
    Failed(String),
}

/// One difference between a capture and its record.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Drift {
    /// What part of the capture.
    pub kind: DriftKind,
    /// What differed, in words.
    pub what: String,
    /// Whether it was put back.
    pub outcome: Outcome,
}

impl Drift {
    /// A difference of `kind`, described by `what`, and what became of it.
    #[must_use]
    pub fn new(kind: DriftKind, what: impl Into<String>, outcome: Outcome) -> Self {
        Self {
            kind,
            what: what.into(),
            outcome,
        }
    }

    /// Whether it could not be put back.
    #[must_use]
    pub const fn failed(&self) -> bool {
        matches!(self.outcome, Outcome::Failed(_))
    }
}

impl std::fmt::Display for Drift {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.kind, self.what)?;
        match &self.outcome {
            Outcome::Repaired => f.write_str(" (put back)"),
            Outcome::Found => Ok(()),
            Outcome::Failed(why) => write!(f, " (not put back: {why})"),
        }
    }
}

/// One pod's capture compared with its record.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodCheck {
    /// What is installed for the pod now, in words (what `explain` shows).
    pub installed: Vec<String>,
    /// What differed from the record.
    pub drift: Vec<Drift>,
}

impl PodCheck {
    /// Adds what `other` found.
    pub fn extend(&mut self, other: Self) {
        self.installed.extend(other.installed);
        self.drift.extend(other.drift);
    }
}

/// Whether to put back what differs, or only to look.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verify {
    /// Put back what differs (the verifier's pass).
    Repair,
    /// Only look (`explain`).
    Look,
}

impl Verify {
    /// Records a difference of `kind` described by `what`: with [`Verify::Repair`], `repair` is
    /// run and its outcome kept (its error's words, when it fails); with [`Verify::Look`] it is
    /// not run.
    pub fn handle<E: std::error::Error>(
        self,
        kind: DriftKind,
        what: impl Into<String>,
        repair: impl FnOnce() -> Result<(), E>,
    ) -> Drift {
        let outcome = match self {
            Self::Repair => match repair() {
                Ok(()) => Outcome::Repaired,
                Err(why) => Outcome::Failed(why.to_string()),
            },
            Self::Look => Outcome::Found,
        };
        Drift::new(kind, what, outcome)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_look_never_repairs_and_a_repair_keeps_its_outcome() {
        let mut ran = false;
        let found = Verify::Look.handle(DriftKind::Rules, "gone", || {
            ran = true;
            Ok::<_, std::io::Error>(())
        });
        assert!(!ran);
        assert_eq!(found.outcome, Outcome::Found);
        assert_eq!(found.to_string(), "rules: gone");
        let failed = Verify::Repair.handle(DriftKind::TcFilter, "no filter on eth0", || {
            Err(std::io::Error::other("EPERM"))
        });
        assert!(failed.failed());
        assert_eq!(
            failed.to_string(),
            "tc_filter: no filter on eth0 (not put back: EPERM)"
        );
        let repaired = Verify::Repair.handle(DriftKind::MapEntry, "entry changed", || {
            Ok::<_, std::io::Error>(())
        });
        assert_eq!(repaired.to_string(), "map_entry: entry changed (put back)");
        assert_eq!(
            serde_json::to_value(&failed.outcome).unwrap(),
            serde_json::json!({"state": "failed", "why": "EPERM"})
        );
    }
}
