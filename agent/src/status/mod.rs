//! What the agent reports about itself: the status report (`meshcap-agent status`, over the
//! plugin socket) and Prometheus metrics (served by [`crate::api::http`]), the process's own
//! among them.
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::{
    backend::{AttachedProgram, CapturedPod, OtherProgram},
    probe::ProbeReport,
};

pub mod metrics;
pub mod process;

/// The agent's state, as `meshcap-agent status` shows it.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct StatusReport {
    /// The agent's version.
    pub version: String,
    /// Whether the agent answers CNI requests.
    pub ready: bool,
    /// The backend in use.
    pub backend: String,
    /// Why that backend.
    pub backend_reason: String,
    /// The kernel probe, when one ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probe: Option<ProbeReport>,
    /// Where pods come from.
    pub pod_source: String,
    /// The plugin socket.
    pub socket: String,
    /// Captured pods with their policies.
    pub pods: Vec<PodStatus>,
    /// The node-wide programs in place (eBPF backend).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub programs: Vec<AttachedProgram>,
    /// Other programs on the node-wide hooks (a primary CNI's), and where they run.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub other_programs: Vec<OtherProgram>,
    /// What is wrong with the captures in place (the backend's warnings).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

/// One captured pod.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PodStatus {
    /// What the backend holds.
    #[serde(flatten)]
    pub captured: CapturedPod,
    /// The policy in one line, when this agent process applied it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
}

impl StatusReport {
    /// The report for humans.
    #[must_use]
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "meshcap-agent {} ({})",
            self.version,
            if self.ready { "ready" } else { "not ready" }
        );
        let _ = writeln!(
            out,
            "backend:    {} ({})",
            self.backend, self.backend_reason
        );
        if let Some(probe) = &self.probe {
            for check in &probe.checks {
                let mark = if check.ok { "ok  " } else { "FAIL" };
                let _ = write!(out, "  probe {mark} {}", check.what);
                if !check.detail.is_empty() {
                    let _ = write!(out, ": {}", check.detail);
                }
                out.push('\n');
            }
        }
        let _ = writeln!(out, "pods from:  {}", self.pod_source);
        let _ = writeln!(out, "socket:     {}", self.socket);
        for p in &self.programs {
            let id = |v: Option<u32>| v.map_or_else(|| "-".to_owned(), |v| v.to_string());
            let _ = writeln!(
                out,
                "  program {:<22} id {:>5} tag {} link {}{}",
                p.program,
                id(p.prog_id),
                p.tag.as_deref().unwrap_or("-"),
                id(p.link_id),
                if p.this_agent {
                    ""
                } else {
                    " (not this agent's)"
                }
            );
        }
        for other in &self.other_programs {
            let _ = writeln!(out, "  other {other}");
        }
        for warning in &self.warnings {
            let _ = writeln!(out, "WARNING: {warning}");
        }
        let _ = writeln!(out, "captured pods: {}", self.pods.len());
        for pod in &self.pods {
            let p = &pod.captured.pod;
            let short: String = p.container_id.chars().take(12).collect();
            let _ = writeln!(
                out,
                "  {}/{} (container {short}): {}",
                p.namespace, p.name, pod.captured.summary
            );
            if let Some(policy) = &pod.policy {
                let _ = writeln!(out, "    policy: {policy}");
            }
        }
        out
    }
}
