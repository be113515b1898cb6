//! Istio's in-pod (ambient) golden rule sets: a pod enrolled with the golden's configuration
//! and annotations must render exactly the restore inputs of the golden, line for line, in
//! order, through the library and through the `meshcap-agent policy --ambient` command; the
//! node's probe rules must equal Istio's `hostprobe` goldens.

use std::{collections::BTreeMap, path::PathBuf, process::Command};

use k8s_openapi::api::core::v1::Pod;
use meshcap_agent::policy::ambient::{self, AmbientConfig, Enrollment, HostProbeSnat};

/// Pod annotations, as (name, value) pairs.
type Annotations = &'static [(&'static str, &'static str)];

/// (golden, `ambient.dnsCapture`, pod annotations).
const CASES: [(&str, bool, Annotations); 6] = [
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
const PROBE_V6: &str = "e9ac:1e77:90ca:399f:4d6d:ece2:2f9b:3164";

fn golden_path(name: &str, ipv6: bool) -> PathBuf {
    let suffix = if ipv6 { "_ipv6" } else { "" };
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/testdata/istio-cni-ambient-golden")
        .join(format!("{name}{suffix}.golden"))
}

/// The golden's restore inputs: its lines from the first table on (before it, the
/// `iptables-save` and `ip6tables-save` Istio runs to read the current state).
fn golden(name: &str, ipv6: bool) -> Vec<String> {
    let path = golden_path(name, ipv6);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let lines: Vec<String> = text.lines().map(str::to_owned).collect();
    let first = lines.iter().position(|l| l.starts_with("* ")).unwrap();
    assert_eq!(
        lines[..first],
        ["iptables-save", "ip6tables-save"],
        "{}",
        path.display()
    );
    lines[first..].to_vec()
}

fn pod(annotations: &[(&str, &str)]) -> Pod {
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

fn config(dns: bool, ipv6: bool) -> AmbientConfig {
    let mut config = AmbientConfig::default();
    config.dns_capture = dns;
    config.ipv6 = ipv6;
    config.host_probe_snat.v6 = PROBE_V6.parse().unwrap();
    config
}

fn lines(text: &str) -> Vec<String> {
    text.lines().map(str::to_owned).collect()
}

#[test]
fn every_in_pod_golden_is_rendered_exactly() {
    for (name, dns, annotations) in CASES {
        for ipv6 in [false, true] {
            let enrollment =
                ambient::enroll(&pod(annotations), &BTreeMap::new(), &[], &config(dns, ipv6))
                    .unwrap();
            let Enrollment::Enrolled { policy, ignored } = enrollment else {
                panic!("{name}: not enrolled: {enrollment:?}");
            };
            assert!(ignored.is_empty(), "{name}: {ignored:?}");
            let rules = policy.render();
            let mut actual = lines(&rules.v4);
            if let Some(v6) = &rules.v6 {
                actual.extend(lines(v6));
            }
            assert_eq!(rules.v6.is_some(), ipv6, "{name}");
            assert_eq!(
                actual,
                golden(name, ipv6),
                "{name} ipv6={ipv6}: meshcap's rendering differs from {}",
                golden_path(name, ipv6).display()
            );
        }
    }
}

/// The node's side (Istio's `hostprobe` goldens, its default probe addresses): kubelet's
/// probes to an enrolled pod SNAT-ed to the probe address.
#[test]
fn the_node_probe_rules_are_istios() {
    for ipv6 in [false, true] {
        let rules = HostProbeSnat::default().render(ipv6);
        let mut actual = lines(&rules.v4);
        if let Some(v6) = &rules.v6 {
            actual.extend(lines(v6));
        }
        assert_eq!(rules.v6.is_some(), ipv6);
        assert_eq!(actual, golden("hostprobe", ipv6), "ipv6={ipv6}");
    }
}

/// The operator's view: `meshcap-agent policy --ambient --format iptables` prints the same.
#[test]
fn the_policy_command_prints_the_in_pod_rules() {
    let dir = tempfile::tempdir().unwrap();
    let manifest = dir.path().join("pod.json");
    let annotations = [("istio.io/reroute-virtual-interfaces", "fake1s0f0,fake1s0f1")];
    std::fs::write(&manifest, serde_json::to_vec(&pod(&annotations)).unwrap()).unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_meshcap-agent"))
        .args(["policy", "--ambient", "--ambient-dns-capture=false"])
        .args(["--ambient-ipv6=false", "--format", "iptables", "--pod"])
        .arg(&manifest)
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let stdout = String::from_utf8(output.stdout).unwrap();
    assert_eq!(lines(&stdout), golden("virtual_interfaces", false));
}
