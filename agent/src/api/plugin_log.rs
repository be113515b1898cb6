//! The plugin's log lines, written into the agent's log: under Istio's `cni-plugin` scope
//! ([`logging::PLUGIN_TARGET`]), with the pod the command concerned and the time the plugin
//! wrote them, as Istio's agent logs its plugin's (`cni/pkg/log/uds.go`, `processLog`).
use meshcap_cni::protocol::{LogLine, Outcome, Response};
use tracing::{debug, error, info, warn};

use crate::logging::{self, PLUGIN_TARGET};

/// Logs `lines` of the plugin's command for `pod` (`namespace/name`, or empty).
pub(super) fn write(pod: &str, lines: &[LogLine]) -> Response {
    for line in lines {
        let time = logging::utc_time(line.unix_micros);
        let msg = line.msg.as_str();
        match line.level.as_str() {
            "error" => error!(target: PLUGIN_TARGET, pod, time, "{msg}"),
            "warn" => warn!(target: PLUGIN_TARGET, pod, time, "{msg}"),
            "debug" => debug!(target: PLUGIN_TARGET, pod, time, "{msg}"),
            _ => info!(target: PLUGIN_TARGET, pod, time, "{msg}"),
        }
    }
    Response::ok(Outcome::Logged, format!("{} lines logged", lines.len()))
}
