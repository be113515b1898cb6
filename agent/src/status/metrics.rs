//! Prometheus metrics: Istio's node agent's under Istio's names, labels and meanings, the
//! standard `process_*` ([`super::process`]), and meshcap's own (`meshcap_*`).
//!
//! Istio's, each counted where the same event happens in meshcap (istio/istio 86c9f01):
//! - `istio_cni_install_ready`, `istio_cni_installs_total{result}`
//!   (`cni/pkg/install/monitoring.go`, counted in `cni/pkg/install/install.go`);
//! - `istio_cni_repair_pods_repaired_total{type,result}` (`cni/pkg/repair/monitoring.go`);
//! - `istio_cni_plugin_requests_total{response_code}` (`cni/pkg/nodeagent/cni-watcher.go`);
//! - `nodeagent_reconcile_events_total{type}` (`cni/pkg/nodeagent/informers.go`);
//! - `ztunnel_connected` (`cni/pkg/nodeagent/ztunnelserver.go`).
use std::{sync::atomic::AtomicU64, time::Duration};

use prometheus_client::{
    encoding::text::encode,
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};

use crate::install::Step;

type Labels = Vec<(&'static str, String)>;

/// `istio_cni_installs_total`'s `result` for an installation that put meshcap in place.
pub const INSTALL_SUCCESS: &str = "SUCCESS";

/// The agent's metrics.
pub struct Metrics {
    registry: Registry,
    requests: Family<Labels, Counter>,
    errors: Family<Labels, Counter>,
    latency: Family<Labels, Histogram>,
    captured: Family<Labels, Gauge>,
    install_ready: Gauge,
    installs: Family<Labels, Counter>,
    repairs: Family<Labels, Counter>,
    other_programs: Family<Labels, Gauge>,
    plugin_requests: Family<Labels, Counter>,
    istio_plugin_requests: Family<Labels, Counter>,
    reconcile_events: Family<Labels, Counter>,
    ztunnel_connected: Gauge,
    drift: Family<Labels, Counter>,
    verify_passes: Counter,
    verify_seconds: Gauge<f64, AtomicU64>,
    verify_cpu_seconds: Gauge<f64, AtomicU64>,
    enrollment_retries: Family<Labels, Counter>,
    enrollment_pending: Gauge,
    sidecar_adoptions: Family<Labels, Counter>,
    ambient_enabled: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers every metric.
    #[must_use]
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let install_ready = Gauge::default();
        registry.register(
            "istio_cni_install_ready",
            "Whether the CNI plugin installation is ready or not",
            install_ready.clone(),
        );
        let installs = Family::<Labels, Counter>::default();
        registry.register(
            "istio_cni_installs",
            "Total number of CNI plugins installed by the Istio CNI installer",
            installs.clone(),
        );
        let repairs = Family::<Labels, Counter>::default();
        registry.register(
            "istio_cni_repair_pods_repaired",
            "Total number of pods repaired by repair controller",
            repairs.clone(),
        );
        let istio_plugin_requests = Family::<Labels, Counter>::default();
        registry.register(
            "istio_cni_plugin_requests",
            "The total number of CNI plugin requests handled by the node agent.",
            istio_plugin_requests.clone(),
        );
        let reconcile_events = Family::<Labels, Counter>::default();
        registry.register(
            "nodeagent_reconcile_events",
            "The total number of node agent reconcile events.",
            reconcile_events.clone(),
        );
        let ztunnel_connected = Gauge::default();
        registry.register(
            "ztunnel_connected",
            "number of connections to ztunnel",
            ztunnel_connected.clone(),
        );
        registry.register_collector(Box::new(super::process::ProcessCollector));
        let meshcap = registry.sub_registry_with_prefix("meshcap");
        let requests = Family::<Labels, Counter>::default();
        let errors = Family::<Labels, Counter>::default();
        let latency = Family::<Labels, Histogram>::new_with_constructor(|| {
            // 1 ms … ~16 s: pod lookups with retries sit at the top end.
            Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
                0.001, 2.0, 15,
            ))
        });
        let captured = Family::<Labels, Gauge>::default();
        meshcap.register(
            "cni_requests",
            "Plugin requests handled, by operation (add, del, check, gc, ping, status) and outcome",
            requests.clone(),
        );
        meshcap.register(
            "cni_errors",
            "Plugin requests that failed, by operation and reason",
            errors.clone(),
        );
        meshcap.register(
            "cni_request_duration_seconds",
            "Time to handle a plugin request, by operation",
            latency.clone(),
        );
        meshcap.register(
            "pods_captured",
            "Pods whose traffic is captured, by backend",
            captured.clone(),
        );
        let other_programs = Family::<Labels, Gauge>::default();
        meshcap.register(
            "other_programs",
            "Other programs on meshcap's cgroup hooks (a primary CNI's socket load balancer), by \
             hook and whether they run before or after meshcap's",
            other_programs.clone(),
        );
        let plugin_requests = Family::<Labels, Counter>::default();
        meshcap.register(
            "cni_plugin_requests",
            "Requests on the plugin socket, by verb (add, del, check, gc, ping, status, explain; \
             decode for one that could not be read) and the CNI result code the plugin returns \
             for the answer (0: success)",
            plugin_requests.clone(),
        );
        let drift = Family::<Labels, Counter>::default();
        meshcap.register(
            "capture_drift",
            "Differences between a capture and its record the verifier found, by kind (rules, \
             route, sysctl, tc_filter, handoff, map_entry, cgroup_link, tc_program, ztunnel, \
             probe_set, cni_config) and result (repaired, failed)",
            drift.clone(),
        );
        let verify_passes = Counter::default();
        meshcap.register(
            "verify_passes",
            "Verification passes over every capture of the node",
            verify_passes.clone(),
        );
        let verify_seconds = Gauge::<f64, AtomicU64>::default();
        meshcap.register(
            "verify_last_pass_seconds",
            "Wall time of the last verification pass",
            verify_seconds.clone(),
        );
        let verify_cpu_seconds = Gauge::<f64, AtomicU64>::default();
        meshcap.register(
            "verify_last_pass_cpu_seconds",
            "CPU time (user and system, the commands it ran included) of the last verification pass",
            verify_cpu_seconds.clone(),
        );
        let enrollment_retries = Family::<Labels, Counter>::default();
        meshcap.register(
            "enrollment_retries",
            "Live enrollments of running pods in ambient mode that failed and are tried again \
             (result failed), and pods enrolled after such a failure (result enrolled)",
            enrollment_retries.clone(),
        );
        let enrollment_pending = Gauge::default();
        meshcap.register(
            "enrollment_pending",
            "Running pods that should be in ambient mode whose enrollment is still to be retried",
            enrollment_pending.clone(),
        );
        let sidecar_adoptions = Family::<Labels, Counter>::default();
        meshcap.register(
            "sidecar_adoptions",
            "Running sidecar pods whose istio-cni capture the agent found at start: recorded as \
             its own (result adopted), left exactly as they are because they are not the rules \
             Istio writes for the pod now (result left), or not looked at in full (result failed)",
            sidecar_adoptions.clone(),
        );
        let ambient_enabled = Gauge::default();
        meshcap.register(
            "ambient_enabled",
            "Whether this node's agent runs ambient mode (1) or not (0): ambient.enabled",
            ambient_enabled.clone(),
        );
        Self {
            registry,
            ambient_enabled,
            sidecar_adoptions,
            enrollment_retries,
            enrollment_pending,
            requests,
            errors,
            latency,
            captured,
            install_ready,
            installs,
            repairs,
            other_programs,
            plugin_requests,
            istio_plugin_requests,
            reconcile_events,
            ztunnel_connected,
            drift,
            verify_passes,
            verify_seconds,
            verify_cpu_seconds,
        }
    }

    /// Counts one handled request.
    pub fn observe(&self, op: &str, outcome: &str, took: Duration) {
        self.requests
            .get_or_create(&vec![
                ("op", op.to_owned()),
                ("outcome", outcome.to_owned()),
            ])
            .inc();
        self.latency
            .get_or_create(&vec![("op", op.to_owned())])
            .observe(took.as_secs_f64());
    }

    /// Counts one failure.
    pub fn error(&self, op: &str, reason: &str) {
        self.errors
            .get_or_create(&vec![("op", op.to_owned()), ("reason", reason.to_owned())])
            .inc();
    }

    /// Sets the number of captured pods of a backend.
    pub fn set_captured(&self, backend: &str, pods: usize) {
        self.captured
            .get_or_create(&vec![("backend", backend.to_owned())])
            .set(i64::try_from(pods).unwrap_or(i64::MAX));
    }

    /// Records whether the plugin's entry is in place.
    pub fn set_install_ready(&self, installed: bool) {
        self.install_ready.set(i64::from(installed));
    }

    /// Sets the count of other programs per hook and position.
    pub fn set_other_programs(&self, others: &[crate::backend::OtherProgram]) {
        self.other_programs.clear();
        for other in others {
            let position = if other.before { "before" } else { "after" };
            self.other_programs
                .get_or_create(&vec![
                    ("hook", other.hook.clone()),
                    ("position", position.to_owned()),
                ])
                .inc();
        }
    }

    /// Counts one action of the repair controller.
    pub fn repaired(&self, kind: &str, result: &str) {
        self.repairs
            .get_or_create(&vec![
                ("type", kind.to_owned()),
                ("result", result.to_owned()),
            ])
            .inc();
    }

    /// Counts one request on the plugin socket: its verb and the CNI result code of its answer
    /// (`meshcap_cni_plugin_requests_total`) and, for the CNI plugin's own requests,
    /// `http_status`, the HTTP status Istio's node agent would have answered with
    /// (`istio_cni_plugin_requests_total`).
    pub fn plugin_request(&self, verb: &str, code: u32, http_status: Option<u16>) {
        self.plugin_requests
            .get_or_create(&vec![("verb", verb.to_owned()), ("code", code.to_string())])
            .inc();
        if let Some(status) = http_status {
            self.istio_plugin_requests
                .get_or_create(&vec![("response_code", status.to_string())])
                .inc();
        }
    }

    /// Counts one event of ambient mode's pod or namespace watch, as Istio's informers count
    /// theirs: `add`, `update` or `delete`.
    pub fn reconcile_event(&self, kind: &'static str) {
        self.reconcile_events
            .get_or_create(&vec![("type", kind.to_owned())])
            .inc();
    }

    /// Records whether this node runs ambient mode.
    pub fn set_ambient_enabled(&self, enabled: bool) {
        self.ambient_enabled.set(i64::from(enabled));
    }

    /// Sets the number of ztunnels connected now.
    pub fn set_ztunnel_connected(&self, connected: usize) {
        self.ztunnel_connected
            .set(i64::try_from(connected).unwrap_or(i64::MAX));
    }

    /// Counts one drift the verifier found: its kind and what became of it.
    pub fn drift(&self, kind: &str, result: &str) {
        self.drift
            .get_or_create(&vec![
                ("kind", kind.to_owned()),
                ("result", result.to_owned()),
            ])
            .inc();
    }

    /// Records one verification pass: its wall and CPU time.
    pub fn verified(&self, seconds: f64, cpu_seconds: f64) {
        self.verify_passes.inc();
        self.verify_seconds.set(seconds);
        self.verify_cpu_seconds.set(cpu_seconds);
    }

    /// Counts one live enrollment that failed (`failed`) or succeeded after failing
    /// (`enrolled`), with the pods still pending.
    pub fn enrollment_retry(&self, result: &str, pending: usize) {
        self.enrollment_retries
            .get_or_create(&vec![("result", result.to_owned())])
            .inc();
        self.enrollment_pending
            .set(i64::try_from(pending).unwrap_or(i64::MAX));
    }

    /// Counts one sidecar pod of istio-cni's found at start, by what became of it (`adopted`,
    /// `left`, `failed`).
    pub fn sidecar_adoption(&self, result: &str) {
        self.sidecar_adoptions
            .get_or_create(&vec![("result", result.to_owned())])
            .inc();
    }

    /// Counts one installation: [`INSTALL_SUCCESS`] when meshcap's entry is in place, else
    /// the step that failed, in Istio's words.
    pub fn count_install(&self, failed: Option<Step>) {
        let result = failed.map_or(INSTALL_SUCCESS, Step::istio_result);
        self.installs
            .get_or_create(&vec![("result", result.to_owned())])
            .inc();
    }

    /// The Prometheus text exposition.
    #[must_use]
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_names_the_labels() {
        let m = Metrics::new();
        m.observe("add", "captured", Duration::from_millis(3));
        m.error("add", "invalid_pod");
        m.set_captured("iptables", 2);
        m.set_ambient_enabled(true);
        let text = m.render();
        assert!(text.contains("meshcap_ambient_enabled 1"), "{text}");
        assert!(
            text.contains(r#"meshcap_cni_requests_total{op="add",outcome="captured"} 1"#),
            "{text}"
        );
        assert!(text.contains(r#"meshcap_cni_errors_total{op="add",reason="invalid_pod"} 1"#));
        assert!(text.contains(r#"meshcap_pods_captured{backend="iptables"} 2"#));
        assert!(text.contains("meshcap_cni_request_duration_seconds_bucket"));
        m.plugin_request("add", 104, Some(500));
        m.drift("tc_filter", "repaired");
        m.verified(0.25, 0.01);
        let text = m.render();
        assert!(
            text.contains(r#"meshcap_cni_plugin_requests_total{verb="add",code="104"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(r#"meshcap_capture_drift_total{kind="tc_filter",result="repaired"} 1"#),
            "{text}"
        );
        assert!(text.contains("meshcap_verify_passes_total 1"), "{text}");
        assert!(
            text.contains("meshcap_verify_last_pass_seconds 0.25"),
            "{text}"
        );
    }

    /// Istio's names, types and labels (istio/istio 86c9f01, the files cited at the top).
    #[test]
    fn istios_metrics_have_istios_names_types_and_labels() {
        let m = Metrics::new();
        m.set_install_ready(true);
        m.count_install(None);
        m.count_install(Some(Step::Binaries));
        m.repaired("label", "success");
        m.plugin_request("add", 0, Some(200));
        m.plugin_request("status", 0, None);
        m.reconcile_event("add");
        m.set_ztunnel_connected(2);
        let text = m.render();
        for line in [
            "# TYPE istio_cni_install_ready gauge",
            "istio_cni_install_ready 1",
            "# TYPE istio_cni_installs counter",
            r#"istio_cni_installs_total{result="SUCCESS"} 1"#,
            r#"istio_cni_installs_total{result="COPY_BINARIES_FAILURE"} 1"#,
            "# TYPE istio_cni_repair_pods_repaired counter",
            r#"istio_cni_repair_pods_repaired_total{type="label",result="success"} 1"#,
            "# TYPE istio_cni_plugin_requests counter",
            r#"istio_cni_plugin_requests_total{response_code="200"} 1"#,
            "# TYPE nodeagent_reconcile_events counter",
            r#"nodeagent_reconcile_events_total{type="add"} 1"#,
            "# TYPE ztunnel_connected gauge",
            "ztunnel_connected 2",
            "# TYPE process_cpu_seconds counter",
            "# TYPE process_resident_memory_bytes gauge",
        ] {
            assert!(text.lines().any(|l| l == line), "{line}:\n{text}");
        }
        // meshcap's own requests (status) are not the CNI plugin's.
        assert!(!text.contains(r#"response_code="0""#), "{text}");
        for gone in [
            "meshcap_cni_install_ready",
            "meshcap_cni_installs",
            "meshcap_cni_repair",
        ] {
            assert!(!text.contains(gone), "{gone} duplicates Istio's:\n{text}");
        }
    }
}
