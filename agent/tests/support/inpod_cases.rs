//! Istio's in-pod (ambient) test cases (`cni/pkg/iptables` and `cni/pkg/nftables`,
//! `GetCommonInPodTestCases`), shared by the iptables and the nftables golden suites: each
//! golden's name, `ambient.dnsCapture` and pod annotations, the pod and the configuration they
//! make.

use k8s_openapi::api::core::v1::Pod;
use meshcap_policy::ambient::AmbientConfig;

/// Pod annotations, as (name, value) pairs.
pub type Annotations = &'static [(&'static str, &'static str)];

/// (golden, `ambient.dnsCapture`, pod annotations).
pub const CASES: [(&str, bool, Annotations); 6] = [
    ("default", true, &[]),
    (
        "ingress",
        false,
        &[("ambient.istio.io/bypass-inbound-capture", "true")],
    ),
    (
        "virtual_interfaces",
        false,
        &[("istio.io/reroute-virtual-interfaces", "fake1s0f0,fake1s0f1")],
    ),
    (
        "ingress_and_virtual_interfaces",
        false,
        &[
            ("ambient.istio.io/bypass-inbound-capture", "true"),
            ("istio.io/reroute-virtual-interfaces", "fake1s0f0,fake1s0f1"),
        ],
    ),
    (
        "dns_pod_enabled_and_off_globally",
        false,
        &[("ambient.istio.io/dns-capture", "true")],
    ),
    (
        "dns_pod_disabled_and_on_globally",
        true,
        &[("ambient.istio.io/dns-capture", "false")],
    ),
];

/// Istio's test configuration's IPv6 probe address.
pub const PROBE_V6: &str = "e9ac:1e77:90ca:399f:4d6d:ece2:2f9b:3164";

/// The enrolled pod of a case, with its annotations.
pub fn pod(annotations: &[(&str, &str)]) -> Pod {
    let annotations: serde_json::Map<String, serde_json::Value> = annotations
        .iter()
        .map(|(k, v)| ((*k).to_owned(), serde_json::Value::from(*v)))
        .collect();
    serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "app",
            "namespace": "default",
            "labels": {"istio.io/dataplane-mode": "ambient"},
            "annotations": annotations,
        },
        "spec": {"containers": [{"name": "app", "image": "app"}]},
    }))
    .unwrap()
}

/// Istio's test configuration with the case's `ambient.dnsCapture`, for one family or both.
pub fn config(dns: bool, ipv6: bool) -> AmbientConfig {
    let mut config = AmbientConfig::default();
    config.dns_capture = dns;
    config.ipv6 = ipv6;
    config.host_probe_snat.v6 = PROBE_V6.parse().unwrap();
    config
}
