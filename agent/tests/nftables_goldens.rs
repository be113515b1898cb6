//! Istio's native nftables goldens (`testdata/istio-nftables-golden/`, vendored unchanged):
//! meshcap's rendering of each golden's inputs must equal it line for line, table by table.
//!
//! The sidecar cases are Istio's `getCommonTestCases` (`tools/istio-nftables/pkg/capture/
//! run_test.go`) on its `constructTestConfig`; the ambient ones `GetCommonInPodTestCases` and
//! `GetCommonHostTestCases` (`cni/pkg/nftables/common_test.go`) on the probe addresses of
//! `nftables_test.go`, each without and with IPv6.

use std::{collections::BTreeMap, path::PathBuf, process::Command};

use meshcap_policy::{
    CidrSet, InterceptionMode, IpPrefix, IpRanges, PodName, PortSelection, RedirectPolicy,
    ambient::{self, Enrollment, HostProbeSnat},
    nftables::sidecar::{DnsRedirect, OwnerGroups, SidecarCapture},
};

#[path = "support/inpod_cases.rs"]
mod inpod_cases;

use inpod_cases::{CASES, PROBE_V6, config, pod};

fn golden_path(kind: &str, name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/testdata/istio-nftables-golden")
        .join(kind)
        .join(format!("{name}.golden"))
}

fn golden(kind: &str, name: &str) -> String {
    let path = golden_path(kind, name);
    std::fs::read_to_string(&path).unwrap_or_else(|err| panic!("{}: {err}", path.display()))
}

/// Table name → its lines, in order.
fn tables(text: &str) -> BTreeMap<String, Vec<String>> {
    let mut tables: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in text.lines() {
        let table = line
            .split_whitespace()
            .nth(3)
            .unwrap_or_default()
            .to_owned();
        tables.entry(table).or_default().push(line.to_owned());
    }
    tables
}

fn assert_golden(got: &str, kind: &str, name: &str) {
    let want = golden(kind, name);
    let (got_tables, want_tables) = (tables(got), tables(&want));
    assert_eq!(
        got_tables.keys().collect::<Vec<_>>(),
        want_tables.keys().collect::<Vec<_>>(),
        "{kind}/{name}: tables"
    );
    for (table, lines) in &want_tables {
        assert_eq!(&got_tables[table], lines, "{kind}/{name}: table {table}");
    }
    assert_eq!(got, want, "{kind}/{name}: whole text");
}

/// `istio-nftables`' configuration of one test case.
struct Case {
    policy: RedirectPolicy,
    uids: Vec<u32>,
    gids: Vec<u32>,
    dns: DnsRedirect,
    owner_groups: OwnerGroups,
    host_loopback_v4: IpPrefix,
}

impl Case {
    /// Istio's `constructTestConfig`: uid and gid 1337, no inbound or outbound capture lists,
    /// REDIRECT mode, IPv4 only.
    fn istio_test_config() -> Self {
        let policy = RedirectPolicy {
            pod: PodName::default(),
            pod_ips: Vec::new(),
            ipv6: false,
            dual_stack: false,
            mode: InterceptionMode::Redirect,
            include_outbound_ip_ranges: IpRanges::Cidrs(CidrSet::default()),
            exclude_outbound_ip_ranges: CidrSet::default(),
            include_inbound_ports: PortSelection::Ports(Vec::new()),
            exclude_inbound_ports: Vec::new(),
            include_outbound_ports: Vec::new(),
            exclude_outbound_ports: Vec::new(),
            exclude_interfaces: Vec::new(),
            reroute_virtual_interfaces: Vec::new(),
            proxy_uid: 1337,
            proxy_gid: 1337,
            dns_capture: false,
            invalid_drop: false,
        };
        Self {
            policy,
            uids: vec![1337],
            gids: vec![1337],
            dns: DnsRedirect::Off,
            owner_groups: OwnerGroups::AllExcept(Vec::new()),
            host_loopback_v4: "127.0.0.1/32".parse().unwrap(),
        }
    }

    fn render(&self) -> String {
        SidecarCapture {
            policy: &self.policy,
            proxy_uids: self.uids.clone(),
            proxy_gids: self.gids.clone(),
            dns: self.dns.clone(),
            owner_groups: self.owner_groups.clone(),
            host_loopback_v4: self.host_loopback_v4,
        }
        .render()
    }
}

/// Istio's `config.SeparateV4V6` of a comma list.
fn cidrs(list: &str) -> CidrSet {
    let mut set = CidrSet::default();
    for cidr in list.split(',').filter(|c| !c.is_empty()) {
        let prefix: IpPrefix = cidr.parse().unwrap();
        if prefix.addr().is_ipv4() {
            set.v4.push(prefix);
        } else {
            set.v6.push(prefix);
        }
    }
    set
}

fn ports(list: &str) -> PortSelection {
    match list {
        "*" => PortSelection::All,
        list => PortSelection::Ports(
            list.split(',')
                .filter(|p| !p.is_empty())
                .map(|p| p.parse().unwrap())
                .collect(),
        ),
    }
}

fn names(list: &str) -> Vec<String> {
    list.split(',').map(str::to_owned).collect()
}

/// `REDIRECT_DNS` with these `DNS_SERVERS` and `CAPTURE_ALL_DNS` off.
fn servers(v4: &[&str], v6: &[&str]) -> DnsRedirect {
    DnsRedirect::Servers {
        v4: v4.iter().map(|s| (*s).to_owned()).collect(),
        v6: v6.iter().map(|s| (*s).to_owned()).collect(),
    }
}

/// Each case of Istio's `getCommonTestCases`, in its order, as its `config` function sets it.
#[expect(
    clippy::too_many_lines,
    reason = "one entry per Istio test case, in its order"
)]
fn sidecar_cases() -> Vec<(&'static str, Case)> {
    let case = |name, set: &dyn Fn(&mut Case)| {
        let mut case = Case::istio_test_config();
        set(&mut case);
        (name, case)
    };
    vec![
        case("ipv6-empty-inbound-ports", &|c| c.policy.ipv6 = true),
        case("ip-range", &|c| {
            c.policy.exclude_outbound_ip_ranges = cidrs("1.1.0.0/16");
            c.policy.include_outbound_ip_ranges = IpRanges::Cidrs(cidrs("9.9.0.0/16"));
            c.dns = servers(&["127.0.0.53"], &[]);
            c.gids = vec![1, 2];
            c.uids = vec![3, 4];
        }),
        case("tproxy", &|c| {
            c.policy.mode = InterceptionMode::Tproxy;
            c.policy.include_inbound_ports = PortSelection::All;
            c.policy.exclude_outbound_ip_ranges = cidrs("1.1.0.0/16");
            c.policy.include_outbound_ip_ranges = IpRanges::Cidrs(cidrs("9.9.0.0/16"));
            c.dns = servers(&["127.0.0.53"], &[]);
            c.policy.exclude_interfaces = names("not-istio-nic");
            c.policy.ipv6 = true;
        }),
        case("ipv6-inbound-ports", &|c| {
            c.policy.include_inbound_ports = ports("4000,5000");
            c.policy.ipv6 = true;
        }),
        case("ipv6-virt-interfaces", &|c| {
            c.policy.include_inbound_ports = ports("4000,5000");
            c.policy.reroute_virtual_interfaces = names("eth0,eth1");
            c.policy.ipv6 = true;
        }),
        case("ipv6-ipnets", &|c| {
            c.policy.include_inbound_ports = ports("4000,5000");
            c.policy.exclude_inbound_ports = vec![6000, 7000];
            c.policy.reroute_virtual_interfaces = names("eth0,eth1");
            c.policy.exclude_outbound_ip_ranges = cidrs("2001:db8::/32");
            c.policy.include_outbound_ip_ranges = IpRanges::Cidrs(cidrs("2001:db8::/32"));
            c.policy.ipv6 = true;
        }),
        case("ipv6-uid-gid", &|c| {
            c.policy.include_inbound_ports = ports("4000,5000");
            c.policy.exclude_inbound_ports = vec![6000, 7000];
            c.policy.reroute_virtual_interfaces = names("eth0,eth1");
            c.gids = vec![1, 2];
            c.uids = vec![3, 4];
            c.policy.ipv6 = true;
            c.policy.exclude_outbound_ip_ranges = cidrs("2001:db8::/32");
            c.policy.include_outbound_ip_ranges = IpRanges::Cidrs(cidrs("2001:db8::/32"));
        }),
        case("ipv6-outbound-ports", &|c| {
            c.policy.include_outbound_ports = vec![32000, 31000];
            c.policy.ipv6 = true;
        }),
        case("empty", &|_| {}),
        case("kube-virt-interfaces", &|c| {
            c.policy.reroute_virtual_interfaces = names("eth1,eth2");
            c.policy.include_outbound_ip_ranges = IpRanges::All;
        }),
        case("ipnets", &|c| {
            c.policy.include_outbound_ip_ranges = IpRanges::Cidrs(cidrs("10.0.0.0/8"));
        }),
        case("ipnets-with-kube-virt-interfaces", &|c| {
            c.policy.reroute_virtual_interfaces = names("eth1,eth2");
            c.policy.include_outbound_ip_ranges = IpRanges::Cidrs(cidrs("10.0.0.0/8"));
        }),
        case("inbound-ports-include", &|c| {
            c.policy.include_inbound_ports = ports("32000,31000");
        }),
        case("inbound-ports-wildcard", &|c| {
            c.policy.include_inbound_ports = PortSelection::All;
        }),
        case("inbound-ports-tproxy", &|c| {
            c.policy.include_inbound_ports = ports("32000,31000");
            c.policy.mode = InterceptionMode::Tproxy;
        }),
        case("inbound-ports-wildcard-tproxy", &|c| {
            c.policy.include_inbound_ports = PortSelection::All;
            c.policy.mode = InterceptionMode::Tproxy;
        }),
        case("inbound-ports-empty-tproxy", &|c| {
            c.policy.mode = InterceptionMode::Tproxy;
        }),
        case("dns-uid-gid", &|c| {
            c.dns = servers(&["127.0.0.53"], &["::127.0.0.53"]);
            c.gids = vec![1, 2];
            c.uids = vec![3, 4];
            c.policy.ipv6 = true;
        }),
        case("ipv6-dns-uid-gid", &|c| {
            c.policy.ipv6 = true;
            c.dns = servers(&[], &[]);
            c.gids = vec![1, 2];
            c.uids = vec![3, 4];
        }),
        case("outbound-owner-groups", &|c| {
            c.owner_groups = OwnerGroups::Only(names("java,202"));
        }),
        case("outbound-owner-groups-exclude", &|c| {
            c.owner_groups = OwnerGroups::AllExcept(names("888,ftp"));
        }),
        case("ipv6-dns-outbound-owner-groups", &|c| {
            c.policy.ipv6 = true;
            c.dns = servers(&[], &[]);
            c.owner_groups = OwnerGroups::Only(names("java,202"));
        }),
        case("ipv6-dns-outbound-owner-groups-exclude", &|c| {
            c.policy.ipv6 = true;
            c.dns = servers(&[], &[]);
            c.owner_groups = OwnerGroups::AllExcept(names("888,ftp"));
        }),
        case("outbound-ports-include", &|c| {
            c.policy.include_outbound_ports = vec![32000, 31000];
        }),
        case("loopback-outbound-iprange", &|c| {
            c.policy.include_outbound_ip_ranges = IpRanges::Cidrs(cidrs("127.1.2.3/32"));
            c.dns = servers(&["127.0.0.53"], &[]);
            c.gids = vec![1, 2];
            c.uids = vec![3, 4];
        }),
        case("basic-exclude-nic", &|c| {
            c.policy.exclude_interfaces = names("not-istio-nic");
        }),
        case("drop-invalid", &|c| c.policy.invalid_drop = true),
        case("host-ipv4-loopback-cidr", &|c| {
            c.host_loopback_v4 = "127.0.0.1/8".parse().unwrap();
        }),
    ]
}

fn vendored(kind: &str) -> Vec<String> {
    let dir = golden_path(kind, "x").parent().unwrap().to_owned();
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().into_string().unwrap())
        .filter_map(|name| name.strip_suffix(".golden").map(str::to_owned))
        .collect();
    names.sort();
    names
}

#[test]
fn every_sidecar_golden_is_rendered_exactly() {
    let cases = sidecar_cases();
    for (name, case) in &cases {
        assert_golden(&case.render(), "sidecar", name);
    }
    let mut covered: Vec<String> = cases.iter().map(|(name, _)| (*name).to_owned()).collect();
    covered.sort();
    assert_eq!(covered, vendored("sidecar"), "a case for every golden");
}

/// The CNI plugin's configuration (one uid and gid, all DNS) is what a policy renders to.
#[test]
fn a_policy_renders_as_the_cni_plugin_configures_istio_nftables() {
    let mut case = Case::istio_test_config();
    case.policy.include_inbound_ports = PortSelection::All;
    case.policy.dns_capture = true;
    case.dns = DnsRedirect::All;
    assert_eq!(case.policy.render_nftables(), case.render());
    let text = case.render();
    assert!(
        text.contains("istio-output-dns meta l4proto tcp tcp dport 53 counter redirect to :15053"),
        "{text}"
    );
}

/// What meshcap applies is Istio's transaction, golden for golden, plus one drop rule per
/// family in `istio-tproxy` where Istio's `tproxy` rules are (TPROXY mode, inbound captured):
/// nothing else, in no other case.
#[test]
fn meshcap_adds_only_the_drop_after_istios_tproxy_rules() {
    let mut tproxy_cases = 0;
    for (name, case) in sidecar_cases() {
        let policy = &case.policy;
        let added = policy.render_nftables_applied();
        let added = added
            .strip_prefix(&policy.render_nftables())
            .unwrap_or_else(|| panic!("{name}: Istio's transaction is not applied first"));
        let closes =
            policy.mode == InterceptionMode::Tproxy && !policy.include_inbound_ports.is_none();
        let mut expected = String::new();
        if closes {
            tproxy_cases += 1;
            expected.push_str(
                "add rule inet istio-proxy-mangle istio-tproxy meta l4proto tcp ip daddr != 127.0.0.1/32 counter drop\n",
            );
            if policy.ipv6 {
                expected.push_str(
                    "add rule inet istio-proxy-mangle istio-tproxy meta l4proto tcp ip6 daddr != ::1/128 counter drop\n",
                );
            }
        }
        assert_eq!(added, expected, "{name}");
    }
    assert!(tproxy_cases >= 3, "the TPROXY goldens: {tproxy_cases}");
}

fn suffixed(name: &str, ipv6: bool) -> String {
    if ipv6 {
        format!("{name}_ipv6")
    } else {
        name.to_owned()
    }
}

#[test]
fn every_in_pod_golden_is_rendered_exactly() {
    let mut covered = vec![suffixed("hostprobe", false), suffixed("hostprobe", true)];
    for (name, dns, annotations) in CASES {
        for ipv6 in [false, true] {
            let config = config(dns, ipv6);
            let pod = pod(annotations);
            let enrollment = ambient::enroll(&pod, &BTreeMap::new(), &[], &config).unwrap();
            let Enrollment::Enrolled { policy, ignored } = enrollment else {
                panic!("{name}: not enrolled: {enrollment:?}");
            };
            assert!(ignored.is_empty(), "{name}: {ignored:?}");
            assert_golden(&policy.render_nftables(), "ambient", &suffixed(name, ipv6));
            covered.push(suffixed(name, ipv6));
        }
    }
    covered.sort();
    assert_eq!(covered, vendored("ambient"), "a case for every golden");
}

/// `GetCommonHostTestCases`, with the kubelet uid Istio's test gives (1000).
#[test]
fn the_node_probe_rules_are_istios() {
    let snat = HostProbeSnat {
        v4: HostProbeSnat::default().v4,
        v6: PROBE_V6.parse().unwrap(),
    };
    for ipv6 in [false, true] {
        let text = snat.render_nftables(ipv6, 1000);
        assert_golden(&text, "ambient", &suffixed("hostprobe", ipv6));
    }
}

fn run_policy_command(args: &[&str], manifest: &std::path::Path) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_meshcap-agent"))
        .arg("policy")
        .args(args)
        .args(["--format", "nftables", "--pod"])
        .arg(manifest)
        .output()
        .expect("run meshcap-agent");
    assert!(output.status.success(), "{output:?}");
    String::from_utf8(output.stdout).unwrap()
}

/// The operator's dry run: `meshcap-agent policy --format nftables` prints the transaction
/// the pod gets, for a sidecar pod and for an ambient one (Istio's golden), and with
/// `--kubelet-uid` the node's (Istio's `hostprobe` golden).
#[test]
fn the_policy_command_prints_the_transaction() {
    let pods = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/testdata/pods");
    let manifest = pods.join("custom-uid-tproxy.yaml");
    let text = std::fs::read_to_string(&manifest).unwrap();
    let pod = meshcap_policy::parse_pod_manifest(&text).unwrap();
    let ips = meshcap_policy::status_pod_ips(&pod);
    let selection =
        meshcap_policy::select(&pod, &ips, &meshcap_policy::SelectConfig::default()).unwrap();
    let meshcap_policy::Selection::Capture { policy } = selection else {
        panic!("not captured: {selection:?}");
    };
    let printed = run_policy_command(&[], &manifest);
    assert_eq!(printed, policy.render_nftables_applied());
    // A TPROXY pod: Istio's transaction, then meshcap's rule dropping what `tproxy` leaves.
    assert_eq!(
        printed.strip_prefix(&policy.render_nftables()),
        Some(
            "add rule inet istio-proxy-mangle istio-tproxy meta l4proto tcp ip daddr != 127.0.0.1/32 counter drop\n"
        ),
        "{printed}"
    );
    assert!(
        printed.contains("skuid 1000670000 counter meta mark set 1338"),
        "{printed}"
    );

    let dir = tempfile::tempdir().unwrap();
    let manifest = dir.path().join("pod.json");
    let annotations = [("istio.io/reroute-virtual-interfaces", "fake1s0f0,fake1s0f1")];
    std::fs::write(
        &manifest,
        serde_json::to_vec(&inpod_cases::pod(&annotations)).unwrap(),
    )
    .unwrap();
    let args = [
        "--ambient",
        "--ambient-dns-capture=false",
        "--ambient-ipv6=false",
    ];
    let printed = run_policy_command(&args, &manifest);
    assert_eq!(printed, golden("ambient", "virtual_interfaces"));
    // With kubelet's uid, the node's transaction follows (Istio's test gives 1000).
    let args = [&args[..], &["--kubelet-uid", "1000"]].concat();
    let printed = run_policy_command(&args, &manifest);
    let want =
        golden("ambient", "virtual_interfaces") + "# node\n" + &golden("ambient", "hostprobe");
    assert_eq!(printed, want);
}
