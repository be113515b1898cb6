//! Istio's in-pod (ambient) golden rule sets: a pod enrolled with the golden's configuration
//! and annotations must render exactly the restore inputs of the golden, line for line, in
//! order, through the library and through the `meshcap-agent policy --ambient` command; the
//! node's probe rules must equal Istio's `hostprobe` goldens.

use std::{collections::BTreeMap, path::PathBuf, process::Command};

use meshcap_policy::ambient::{self, Enrollment, HostProbeSnat};

#[path = "support/inpod_cases.rs"]
mod inpod_cases;

use inpod_cases::{CASES, config, pod};

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
