//! Istio's CNI golden rule sets: meshcap's rendering of each golden's pod must equal it table
//! by table, in order, through the library and through the `meshcap-agent policy` command.

use std::{collections::BTreeMap, path::PathBuf, process::Command};

use meshcap_policy::{self as policy, Family, Selection};

/// (pod manifest, golden) pairs; `custom-uid-zero` (runAsUser: 0) must give `basic`.
const CASES: [(&str, &str); 9] = [
    ("basic", "basic"),
    ("include-exclude-ip", "include-exclude-ip"),
    ("include-exclude-ports", "include-exclude-ports"),
    ("tproxy", "tproxy"),
    ("dns", "dns"),
    ("invalid-drop", "invalid-drop"),
    ("custom-uid", "custom-uid"),
    ("custom-uid-tproxy", "custom-uid-tproxy"),
    ("custom-uid-zero", "basic"),
];

fn testdata() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/testdata")
}

fn pod_path(name: &str) -> PathBuf {
    testdata().join("pods").join(format!("{name}.yaml"))
}

fn golden(name: &str) -> String {
    let path = testdata()
        .join("istio-cni-golden")
        .join(format!("{name}.txt.golden"));
    std::fs::read_to_string(&path).unwrap_or_else(|err| panic!("{}: {err}", path.display()))
}

/// Table name → its lines up to and including COMMIT (Istio's `getRules`).
fn tables(text: &str) -> BTreeMap<String, Vec<String>> {
    let mut tables = BTreeMap::new();
    let mut current: Option<(String, Vec<String>)> = None;
    for line in text.lines() {
        if let Some(name) = line.strip_prefix("* ") {
            current = Some((name.to_owned(), vec![line.to_owned()]));
        } else if let Some((name, mut lines)) = current.take() {
            lines.push(line.to_owned());
            if line == "COMMIT" {
                tables.insert(name, lines);
            } else {
                current = Some((name, lines));
            }
        }
    }
    tables
}

fn render(name: &str) -> policy::IptablesRules {
    let text = std::fs::read_to_string(pod_path(name)).unwrap();
    let pod = policy::parse_pod_manifest(&text).unwrap();
    let ips = policy::status_pod_ips(&pod);
    match policy::select(&pod, &ips, &policy::SelectConfig::default()).unwrap() {
        Selection::Capture { policy } => policy.render(),
        Selection::Skip { reason } => panic!("{name}: not captured: {reason}"),
    }
}

#[test]
fn goldens_match_table_by_table() {
    for (pod, golden_name) in CASES {
        let rules = render(pod);
        let want = golden(golden_name);
        assert!(
            rules.v6.is_none(),
            "{pod}: an IPv4-only pod gets no IPv6 rules"
        );
        let (got, want_tables) = (tables(&rules.v4), tables(&want));
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            want_tables.keys().collect::<Vec<_>>(),
            "{pod}: tables"
        );
        for (table, lines) in &want_tables {
            assert_eq!(&got[table], lines, "{pod}: table {table}");
        }
        assert_eq!(rules.v4, want, "{pod}: whole text");
    }
}

#[test]
fn tproxy_goldens_carry_the_policy_route() {
    for pod in ["tproxy", "custom-uid-tproxy"] {
        let route = render(pod)
            .routes
            .mark_route
            .expect("a TPROXY policy route");
        assert_eq!(
            (route.mark, route.table, route.families),
            (1337, 133, vec![Family::V4])
        );
    }
    assert_eq!(render("basic").routes, policy::PolicyRoutes::default());
}

#[test]
fn every_golden_parses_in_the_evaluator() {
    for (_, golden_name) in CASES {
        policy::RuleSet::parse(&golden(golden_name))
            .unwrap_or_else(|err| panic!("{golden_name}: {err}"));
    }
}

#[test]
fn policy_command_prints_each_golden() {
    for (pod, golden_name) in CASES {
        let output = Command::new(env!("CARGO_BIN_EXE_meshcap-agent"))
            .args(["policy", "--format", "iptables", "--pod"])
            .arg(pod_path(pod))
            .output()
            .expect("run meshcap-agent");
        assert!(
            output.status.success(),
            "{pod}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        assert_eq!(
            String::from_utf8(output.stdout).unwrap(),
            golden(golden_name),
            "{pod}"
        );
    }
}

#[test]
fn policy_command_prints_decision_and_policy_as_json() {
    let output = Command::new(env!("CARGO_BIN_EXE_meshcap-agent"))
        // An IPv6-only pod: Istio installs IPv6 rules (a dual-stack one gets them only with
        // ISTIO_DUAL_STACK).
        .args(["policy", "--ip", "fd00::2", "--pod"])
        .arg(pod_path("custom-uid-tproxy"))
        .output()
        .expect("run meshcap-agent");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(json["decision"], "capture");
    assert_eq!(json["policy"]["mode"], "TPROXY");
    assert_eq!(json["policy"]["proxy_uid"], 1_000_670_000);
    assert_eq!(json["policy"]["proxy_gid"], 1_000_670_001);
    assert_eq!(json["policy"]["ipv6"], true);
}

#[test]
fn policy_command_reports_skips_and_errors() {
    let dir = std::env::temp_dir().join(format!("meshcap-policy-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let basic = std::fs::read_to_string(pod_path("basic")).unwrap();

    let skipped = dir.join("kube-system.yaml");
    std::fs::write(
        &skipped,
        basic.replace("namespace: test-ns", "namespace: kube-system"),
    )
    .unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_meshcap-agent"))
        .args(["policy", "--format", "iptables", "--pod"])
        .arg(&skipped)
        .output()
        .unwrap();
    assert!(output.status.success());
    assert_eq!(
        String::from_utf8(output.stdout).unwrap(),
        "# not captured: namespace kube-system is excluded\n"
    );

    let bad = dir.join("bad.yaml");
    let annotation = "    traffic.sidecar.istio.io/excludeOutboundIPRanges: \"10.0.0.0/33\"\n";
    std::fs::write(
        &bad,
        basic.replace("spec:\n", &format!("{annotation}spec:\n")),
    )
    .unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_meshcap-agent"))
        .args(["policy", "--pod"])
        .arg(&bad)
        .output()
        .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(
            "pod test-ns/basic: annotation traffic.sidecar.istio.io/excludeOutboundIPRanges: \"10.0.0.0/33\" is not a CIDR list"
        ),
        "{stderr}"
    );
}
