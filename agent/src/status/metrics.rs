//! Prometheus metrics of the CNI path.
use std::time::Duration;

use prometheus_client::{
    encoding::text::encode,
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};

type Labels = Vec<(&'static str, String)>;

/// The agent's metrics.
pub struct Metrics {
    registry: Registry,
    requests: Family<Labels, Counter>,
    errors: Family<Labels, Counter>,
    latency: Family<Labels, Histogram>,
    captured: Family<Labels, Gauge>,
    install_ready: Gauge,
    installs: Counter,
    repairs: Family<Labels, Counter>,
    other_programs: Family<Labels, Gauge>,
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
        let mut registry = Registry::with_prefix("meshcap");
        let requests = Family::<Labels, Counter>::default();
        let errors = Family::<Labels, Counter>::default();
        let latency = Family::<Labels, Histogram>::new_with_constructor(|| {
            // 1 ms … ~16 s: pod lookups with retries sit at the top end.
            Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
                0.001, 2.0, 15,
            ))
        });
        let captured = Family::<Labels, Gauge>::default();
        registry.register(
            "cni_requests",
            "Plugin requests handled, by operation (add, del, check, gc, ping, status) and outcome",
            requests.clone(),
        );
        registry.register(
            "cni_errors",
            "Plugin requests that failed, by operation and reason",
            errors.clone(),
        );
        registry.register(
            "cni_request_duration_seconds",
            "Time to handle a plugin request, by operation",
            latency.clone(),
        );
        registry.register(
            "pods_captured",
            "Pods whose traffic is captured, by backend",
            captured.clone(),
        );
        let install_ready = Gauge::default();
        registry.register(
            "cni_install_ready",
            "Whether meshcap-cni is chained into the node's CNI configuration (1) or not (0); \
             istio_cni_install_ready",
            install_ready.clone(),
        );
        let installs = Counter::default();
        registry.register(
            "cni_installs",
            "Times this agent wrote meshcap-cni's entry into the CNI configuration \
             (istio_cni_installs_total)",
            installs.clone(),
        );
        let repairs = Family::<Labels, Counter>::default();
        registry.register(
            "cni_repair_pods_repaired",
            "Broken pods the repair controller acted on, by mode (repair, delete, label) and \
             result (success, skip, fail); istio_cni_repair_pods_repaired_total",
            repairs.clone(),
        );
        let other_programs = Family::<Labels, Gauge>::default();
        registry.register(
            "other_programs",
            "Other programs on meshcap's cgroup hooks (a primary CNI's socket load balancer), by \
             hook and whether they run before or after meshcap's",
            other_programs.clone(),
        );
        Self {
            registry,
            requests,
            errors,
            latency,
            captured,
            install_ready,
            installs,
            repairs,
            other_programs,
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

    /// Counts one write of the plugin's entry.
    pub fn count_install(&self) {
        self.installs.inc();
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
        let text = m.render();
        assert!(
            text.contains(r#"meshcap_cni_requests_total{op="add",outcome="captured"} 1"#),
            "{text}"
        );
        assert!(text.contains(r#"meshcap_cni_errors_total{op="add",reason="invalid_pod"} 1"#));
        assert!(text.contains(r#"meshcap_pods_captured{backend="iptables"} 2"#));
        assert!(text.contains("meshcap_cni_request_duration_seconds_bucket"));
    }
}
