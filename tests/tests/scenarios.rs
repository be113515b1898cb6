//! The scenario table (every row of the redirect semantics in docs/development.md, Istio's
//! validation probe, hairpin, loopback, dual stack, DNS, TPROXY) against every backend (eBPF,
//! Istio's iptables rules and its native nftables ones) on the real kernel, directly and
//! through the agent and the real plugin binary.
use std::net::IpAddr;

use meshcap_agent::{backend::ebpf::unpin_link, pod::PodRef};
use meshcap_policy::{InterceptionMode, IpRanges, PortSelection, RedirectPolicy};
use meshcap_tests::{
    agent::Backend as AgentBackend,
    plugin::{PluginUnderTest, ensure_exact, pod_manifest},
    require_root,
    scenario::{
        Backend, Case, EbpfUnderTest, Expect::*, IptablesUnderTest, NftablesUnderTest, To::*,
        Who::*, case, cidrs, default_policy, run_case, run_table, tcx_where_supported,
    },
    world::Node,
};

const OUTBOUND: u16 = 15001;
const INBOUND: u16 = 15006;
const DNS: u16 = 15053;

fn table() -> Vec<Case> {
    vec![
        // Defaults (basic golden).
        case(
            "app to a peer is captured",
            App,
            Peer(80),
            Captured(OUTBOUND),
        ),
        case(
            "addresses: the app sees the service it dialled and its own pod address, the proxy sees the pod address",
            App,
            Service(80),
            CapturedFromPod(OUTBOUND),
        ),
        Case {
            ipv6: true,
            ..case(
                "addresses: IPv6, the app sees the peer it dialled and its own pod address",
                App,
                PeerV6(80),
                CapturedFromPod(OUTBOUND),
            )
        },
        case(
            "app to a service IP is captured (hairpin, first hop)",
            App,
            Service(80),
            Captured(OUTBOUND),
        ),
        case(
            "proxy to its own pod IP goes inbound (hairpin, second hop)",
            Proxy,
            Own(8080),
            Captured(INBOUND),
        ),
        Case {
            bind: Some("127.0.0.1"),
            ..case(
                "istio-validation: uid 1337 dials 127.0.0.6:15002 from 127.0.0.1",
                Proxy,
                Addr("127.0.0.6", 15002),
                Captured(INBOUND),
            )
        },
        case(
            "app to 127.0.0.1 is left alone",
            App,
            Addr("127.0.0.1", 8080),
            Server("app"),
        ),
        case(
            "proxy to 127.0.0.1 is left alone",
            Proxy,
            Addr("127.0.0.1", 8080),
            Server("app"),
        ),
        case(
            "app to its own pod IP passes (app loopback)",
            App,
            Own(8080),
            Server("app"),
        ),
        case(
            "app to another loopback address passes",
            App,
            Addr("127.0.0.5", 8080),
            Server("app"),
        ),
        case(
            "proxy's own upstream passes",
            Proxy,
            Peer(80),
            Server("peer"),
        ),
        case(
            "proxy gid alone passes",
            Ids(2000, 1337),
            Peer(80),
            Server("peer"),
        ),
        Case {
            bind: Some("127.0.0.6"),
            ..case(
                "inbound passthrough from 127.0.0.6 passes",
                Proxy,
                Own(8080),
                Server("app"),
            )
        },
        case(
            "proxy to 15008 on its own IP passes",
            Proxy,
            Own(15008),
            Server("app"),
        ),
        case(
            "excludeOutboundPorts default 15020",
            App,
            Peer(15020),
            Server("peer"),
        ),
        case(
            "inbound to the app is captured",
            Node,
            Own(8080),
            Captured(INBOUND),
        ),
        case(
            "inbound status port 15020 is not captured",
            Node,
            Own(15020),
            Server("app"),
        ),
        case(
            "inbound HBONE 15008 is not captured (REDIRECT)",
            Node,
            Own(15008),
            Server("app"),
        ),
        // excludeOutboundPorts.
        Case {
            policy: |p| p.exclude_outbound_ports = vec![3306],
            ..case("excludeOutboundPorts 3306", App, Peer(3306), Server("peer"))
        },
        Case {
            policy: |p| p.exclude_outbound_ports = vec![3306],
            ..case(
                "explicit excludeOutboundPorts replaces 15020",
                App,
                Peer(15020),
                Captured(OUTBOUND),
            )
        },
        // includeOutboundIPRanges / excludeOutboundIPRanges.
        Case {
            policy: |p| p.include_outbound_ip_ranges = IpRanges::Cidrs(cidrs(&["10.96.0.0/16"])),
            ..case(
                "includeOutboundIPRanges captures the listed range",
                App,
                Service(80),
                Captured(OUTBOUND),
            )
        },
        Case {
            policy: |p| p.include_outbound_ip_ranges = IpRanges::Cidrs(cidrs(&["10.96.0.0/16"])),
            ..case(
                "includeOutboundIPRanges leaves the rest",
                App,
                Peer(80),
                Server("peer"),
            )
        },
        Case {
            policy: |p| p.include_outbound_ip_ranges = IpRanges::Cidrs(cidrs(&[])),
            ..case(
                "empty includeOutboundIPRanges captures nothing",
                App,
                Peer(80),
                Server("peer"),
            )
        },
        Case {
            policy: |p| p.exclude_outbound_ip_ranges = cidrs(&["10.77.0.0/16"]),
            ..case("excludeOutboundIPRanges", App, Peer(80), Server("peer"))
        },
        Case {
            policy: |p| p.exclude_outbound_ip_ranges = cidrs(&["10.77.0.0/16"]),
            ..case(
                "excludeOutboundIPRanges leaves the rest captured",
                App,
                Service(80),
                Captured(OUTBOUND),
            )
        },
        Case {
            policy: |p| p.include_outbound_ip_ranges = IpRanges::Cidrs(cidrs(&["127.0.0.0/8"])),
            ..case(
                "a loopback include range captures app loopback",
                App,
                Addr("127.0.0.5", 8080),
                Captured(OUTBOUND),
            )
        },
        Case {
            policy: |p| p.include_outbound_ip_ranges = IpRanges::Cidrs(cidrs(&["127.0.0.0/8"])),
            ..case(
                "a loopback include range still leaves 127.0.0.1",
                App,
                Addr("127.0.0.1", 8080),
                Server("app"),
            )
        },
        // includeOutboundPorts.
        Case {
            policy: |p| {
                p.include_outbound_ip_ranges = IpRanges::Cidrs(cidrs(&[]));
                p.include_outbound_ports = vec![3306];
            },
            ..case(
                "includeOutboundPorts captures whatever the destination",
                App,
                Peer(3306),
                Captured(OUTBOUND),
            )
        },
        Case {
            policy: |p| {
                p.include_outbound_ip_ranges = IpRanges::Cidrs(cidrs(&[]));
                p.include_outbound_ports = vec![3306];
            },
            ..case(
                "includeOutboundPorts leaves other ports",
                App,
                Peer(80),
                Server("peer"),
            )
        },
        // Inbound ports.
        Case {
            policy: |p| p.include_inbound_ports = PortSelection::Ports(vec![8081]),
            ..case(
                "includeInboundPorts captures the listed port",
                Node,
                Own(8081),
                Captured(INBOUND),
            )
        },
        Case {
            policy: |p| p.include_inbound_ports = PortSelection::Ports(vec![8081]),
            ..case(
                "includeInboundPorts leaves the rest",
                Node,
                Own(8080),
                Server("app"),
            )
        },
        Case {
            policy: |p| p.include_inbound_ports = PortSelection::Ports(vec![]),
            ..case(
                "empty includeInboundPorts captures nothing",
                Node,
                Own(8080),
                Server("app"),
            )
        },
        Case {
            policy: |p| p.exclude_inbound_ports = vec![8081, 15020, 15021, 15090],
            ..case("excludeInboundPorts", Node, Own(8081), Server("app"))
        },
        // Interfaces.
        Case {
            policy: |p| p.exclude_interfaces = vec!["eth1".into()],
            ..case(
                "excludeInterfaces: outbound by eth1 is left alone",
                App,
                Side(80),
                Server("peer"),
            )
        },
        Case {
            policy: |p| p.exclude_interfaces = vec!["eth1".into()],
            ..case(
                "excludeInterfaces: other outbound is captured",
                App,
                Peer(80),
                Captured(OUTBOUND),
            )
        },
        Case {
            policy: |p| p.exclude_interfaces = vec!["eth1".into()],
            ..case(
                "excludeInterfaces: inbound on eth1 is left alone",
                Node,
                OwnSide(8080),
                Server("app"),
            )
        },
        Case {
            policy: |p| p.reroute_virtual_interfaces = vec!["eth1".into()],
            ..case(
                "reroute-virtual-interfaces: inbound on eth1 goes to the outbound listener",
                Node,
                OwnSide(8080),
                Captured(OUTBOUND),
            )
        },
        // Proxy uid/gid.
        Case {
            policy: |p| {
                p.proxy_uid = 1_000_670_000;
                p.proxy_gid = 1_000_670_001;
            },
            ..case(
                "custom proxy uid: its upstream passes",
                Ids(1_000_670_000, 1_000_670_001),
                Peer(80),
                Server("peer"),
            )
        },
        Case {
            policy: |p| {
                p.proxy_uid = 1_000_670_000;
                p.proxy_gid = 1_000_670_001;
            },
            ..case(
                "custom proxy uid: uid 1337 is an app",
                Proxy,
                Peer(80),
                Captured(OUTBOUND),
            )
        },
        // DNS.
        Case {
            policy: |p| p.dns_capture = true,
            proto: "udp",
            ..case(
                "DNS capture: unconnected UDP 53 goes to 15053 from the pod address, reply source restored",
                App,
                Peer(53),
                CapturedFromPod(DNS),
            )
        },
        Case {
            policy: |p| p.dns_capture = true,
            proto: "udpc",
            ..case(
                "DNS capture: connected UDP 53, getpeername and getsockname as under NAT",
                App,
                Peer(53),
                CapturedFromPod(DNS),
            )
        },
        Case {
            policy: |p| p.dns_capture = true,
            ..case("DNS capture: TCP 53", App, Peer(53), Captured(DNS))
        },
        Case {
            policy: |p| p.dns_capture = true,
            proto: "udp",
            ..case(
                "DNS capture: the proxy's own DNS passes",
                Proxy,
                Peer(53),
                Server("peer"),
            )
        },
        Case {
            proto: "udp",
            ..case(
                "no DNS capture: UDP 53 passes",
                App,
                Peer(53),
                Server("peer"),
            )
        },
        // IPv6 (dual-stack pod).
        Case {
            ipv6: true,
            ..case(
                "IPv6: app to a peer is captured",
                App,
                PeerV6(80),
                Captured(OUTBOUND),
            )
        },
        Case {
            ipv6: true,
            ..case(
                "IPv6: IPv4 still captured in a dual-stack pod",
                App,
                Peer(80),
                Captured(OUTBOUND),
            )
        },
        Case {
            ipv6: true,
            ..case(
                "IPv6: proxy to its own IPv6 goes inbound",
                Proxy,
                OwnV6(8080),
                Captured(INBOUND),
            )
        },
        Case {
            ipv6: true,
            ..case(
                "IPv6: app to ::1 is left alone",
                App,
                Addr("::1", 8080),
                Server("app"),
            )
        },
        Case {
            ipv6: true,
            bind: Some("::1"),
            ..case(
                "IPv6: validation probe to [::6]:15002",
                Proxy,
                Addr("::6", 15002),
                Captured(INBOUND),
            )
        },
        Case {
            ipv6: true,
            ..case(
                "IPv6: inbound is captured",
                Node,
                OwnV6(8080),
                Captured(INBOUND),
            )
        },
        Case {
            ipv6: true,
            policy: |p| p.dns_capture = true,
            proto: "udp",
            ..case("IPv6: DNS capture", App, PeerV6(53), Captured(DNS))
        },
        // TPROXY.
        Case {
            policy: |p| p.mode = InterceptionMode::Tproxy,
            ..case(
                "TPROXY: outbound is captured",
                App,
                Peer(80),
                Captured(OUTBOUND),
            )
        },
        Case {
            policy: |p| p.mode = InterceptionMode::Tproxy,
            ..case(
                "TPROXY: inbound HBONE 15008 is captured",
                Node,
                Own(15008),
                AppSeesClient,
            )
        },
        // No proxy listening (Envoy not started yet, or gone): REDIRECT finds no listener and
        // the kernel answers a reset, NAT-ed back from the address dialled; TPROXY finds none
        // and drops (`xt_TPROXY.c`, `tproxy_tg4`). Never the app on the port dialled.
        Case {
            proxy: false,
            ..case(
                "no proxy listening: inbound is refused",
                Node,
                Own(8080),
                Refused,
            )
        },
        Case {
            proxy: false,
            ipv6: true,
            ..case(
                "no proxy listening: IPv6 inbound is refused",
                Node,
                OwnV6(8080),
                Refused,
            )
        },
        Case {
            proxy: false,
            policy: |p| p.reroute_virtual_interfaces = vec!["eth1".into()],
            ..case(
                "no proxy listening: inbound on a rerouted interface is refused",
                Node,
                OwnSide(8080),
                Refused,
            )
        },
        Case {
            proxy: false,
            ..case(
                "no proxy listening: outbound is refused",
                App,
                Peer(80),
                Refused,
            )
        },
        Case {
            proxy: false,
            policy: |p| p.mode = InterceptionMode::Tproxy,
            ..case(
                "no proxy listening: TPROXY inbound goes unanswered",
                Node,
                Own(8080),
                Unanswered,
            )
        },
    ]
}

/// Rows only the eBPF backend passes.
fn ebpf_only() -> Vec<Case> {
    vec![
        // The programs act on the cgroup they are attached to (the node's root in
        // production, a throwaway child here), not on a whole netns as iptables does.
        case(
            "a process outside the attached cgroup is untouched",
            Outside,
            Peer(80),
            Server("peer"),
        ),
        // The stand-in proxy dials the original destination transparently (client source,
        // mark 1337) as uid 1337. Istio's nat ISTIO_OUTPUT sends that loopback connection
        // back to 15006 (`-o lo ! -d 127.0.0.1 --uid-owner 1337 -j ISTIO_IN_REDIRECT`), so
        // the iptables fallback, which must write Istio's rules unchanged, cannot pass this
        // row; the eBPF path exempts the proxy's mark-1337 sockets (docs/ebpf.md, TPROXY).
        Case {
            policy: |p| p.mode = InterceptionMode::Tproxy,
            ..case(
                "TPROXY: the app sees the original client address",
                Node,
                Own(8080),
                AppSeesClient,
            )
        },
    ]
}

#[test]
fn ebpf_backend_makes_istios_decisions() {
    require_root();
    if !meshcap_tests::ebpf_runs_here() {
        return;
    }
    let mut node = Node::new().expect("node netns");
    let backend = EbpfUnderTest::new(&node.cgroup).expect("eBPF backend");
    let mut cases = table();
    cases.extend(ebpf_only());
    run_table(&backend, &mut node, &cases);
}

/// The inbound rows with the pods' stubs attached as TCX links (asked for; the default is
/// netlink TC), where the kernel has TCX.
#[test]
fn ebpf_backend_with_tcx_makes_istios_inbound_decisions() {
    require_root();
    if !meshcap_tests::ebpf_runs_here() {
        return;
    }
    let mut node = Node::new().expect("node netns");
    let backend =
        EbpfUnderTest::with_tc_attach(&node.cgroup, tcx_where_supported()).expect("eBPF backend");
    let mut cases = table();
    cases.extend(ebpf_only());
    cases.retain(|c| matches!(c.from, meshcap_tests::scenario::Who::Node));
    assert!(cases.len() >= 10, "the inbound rows: {}", cases.len());
    run_table(&backend, &mut node, &cases);
}

/// The same table, unchanged, through the iptables fallback: both backends make Istio's
/// decisions.
#[test]
fn iptables_backend_makes_istios_decisions() {
    require_root();
    let mut node = Node::new().expect("node netns");
    let backend = IptablesUnderTest::new().expect("iptables backend");
    run_table(&backend, &mut node, &table());
}

/// The same table, unchanged, through Istio's native nftables rules (`global.nativeNftables`):
/// a pod captured with nftables behaves as with iptables in every row, the `TPROXY` rows with
/// no proxy listening too (meshcap's one rule after Istio's `tproxy` rules:
/// `policy/src/nftables/sidecar/unclaimed.rs`).
#[test]
fn nftables_backend_makes_istios_decisions() {
    require_root();
    let mut node = Node::new().expect("node netns");
    let backend = NftablesUnderTest::new().expect("nftables backend");
    run_table(&backend, &mut node, &table());
}

/// The table through the product path on the eBPF backend: a running agent with a
/// manifest directory as its pod source, each row's policy written as the pod's annotations,
/// proxy environment and security context, and the real `meshcap-cni` ADD and DEL.
#[test]
fn ebpf_agent_through_the_plugin_makes_istios_decisions() {
    require_root();
    if !meshcap_tests::ebpf_runs_here() {
        return;
    }
    let mut node = Node::new().expect("node netns");
    let backend = PluginUnderTest::new(AgentBackend::Ebpf, node.cgroup.path()).expect("agent");
    let mut cases = table();
    cases.extend(ebpf_only());
    run_table(&backend, &mut node, &cases);
    assert_eq!(
        backend.agent().ebpf_leftovers().expect("eBPF state"),
        Vec::<String>::new(),
        "every DEL released its pod"
    );
}

/// The same table through the product path on the iptables fallback.
#[test]
fn iptables_agent_through_the_plugin_makes_istios_decisions() {
    require_root();
    let mut node = Node::new().expect("node netns");
    let backend = PluginUnderTest::new(AgentBackend::Iptables, node.cgroup.path()).expect("agent");
    run_table(&backend, &mut node, &table());
}

/// The same table through the product path on Istio's native nftables rules.
#[test]
fn nftables_agent_through_the_plugin_makes_istios_decisions() {
    require_root();
    let mut node = Node::new().expect("node netns");
    let backend = PluginUnderTest::new(AgentBackend::Nftables, node.cgroup.path()).expect("agent");
    run_table(&backend, &mut node, &table());
}

/// Every row's policy, written as a pod manifest, is read back by the agent's selection as
/// exactly that policy: the plugin tests above test the rows they name. (No root needed.)
#[test]
fn every_rows_policy_maps_exactly_to_a_pod_manifest() {
    let ips: Vec<IpAddr> = vec![
        "10.77.1.2".parse().expect("ip"),
        "fd77:1::2".parse().expect("ip"),
    ];
    let mut rows = table();
    rows.extend(ebpf_only());
    let mut policies: Vec<RedirectPolicy> = rows
        .iter()
        .map(|c| {
            let ips = if c.ipv6 { &ips[..] } else { &ips[..1] };
            let mut policy = default_policy("case-1", ips.to_vec());
            (c.policy)(&mut policy);
            policy
        })
        .collect();
    // What no row sets: INVALID_DROP, v6 ranges, wildcard-free include lists.
    let mut extra = default_policy("extra", ips.clone());
    extra.invalid_drop = true;
    // Dual stack off with an IPv4 address first: Istio installs IPv4 rules only.
    extra.dual_stack = false;
    extra.ipv6 = false;
    extra.include_outbound_ip_ranges = IpRanges::Cidrs(cidrs(&["10.0.0.0/8", "fd00::/8"]));
    extra.exclude_outbound_ip_ranges = cidrs(&["10.1.0.0/16", "fd00:1::/32"]);
    extra.include_inbound_ports = PortSelection::Ports(vec![80, 443]);
    extra.include_outbound_ports = vec![5432, 6379];
    extra.exclude_interfaces = vec!["eth1".into(), "eth2".into()];
    policies.push(extra);
    for policy in &policies {
        let manifest = pod_manifest(policy);
        ensure_exact(&manifest, policy).unwrap_or_else(|e| panic!("{e:#}"));
    }
}

/// Detaching any one program (by unpinning its link) makes its scenario fail: every program
/// is load-bearing, and the table notices when one is missing.
#[test]
fn every_program_is_needed() {
    require_root();
    if !meshcap_tests::ebpf_runs_here() {
        return;
    }
    let mut node = Node::new().expect("node netns");
    let rows = table();
    let row = |name: &str| {
        *rows
            .iter()
            .find(|c| c.name == name)
            .unwrap_or_else(|| panic!("no row {name:?}"))
    };
    let probe = "istio-validation: uid 1337 dials 127.0.0.6:15002 from 127.0.0.1";
    for (program, name) in [
        ("meshcap_connect4", "app to a peer is captured"),
        ("meshcap_connect6", "IPv6: app to a peer is captured"),
        (
            "meshcap_sendmsg4",
            "DNS capture: unconnected UDP 53 goes to 15053 from the pod address, reply source restored",
        ),
        (
            "meshcap_recvmsg4",
            "DNS capture: unconnected UDP 53 goes to 15053 from the pod address, reply source restored",
        ),
        (
            "meshcap_getpeername4",
            "addresses: the app sees the service it dialled and its own pod address, the proxy sees the pod address",
        ),
        (
            "meshcap_getpeername6",
            "addresses: IPv6, the app sees the peer it dialled and its own pod address",
        ),
        ("meshcap_sendmsg6", "IPv6: DNS capture"),
        ("meshcap_recvmsg6", "IPv6: DNS capture"),
        ("meshcap_sockops", probe),
        ("meshcap_getsockopt", probe),
    ] {
        let backend = EbpfUnderTest::new(&node.cgroup).expect("eBPF backend");
        let c = row(name);
        run_case(&mut node, &backend, &c)
            .unwrap_or_else(|e| panic!("{name} fails with every program attached: {e:#}"));
        let pin = backend.get().config().pins().link(program);
        unpin_link(&pin).expect("detaching the link");
        assert!(
            run_case(&mut node, &backend, &c).is_err(),
            "{name:?} still passes without {program}"
        );
    }
    // The TC program is per pod: detach it after the pod is added.
    struct NoTc<'a>(&'a EbpfUnderTest);
    impl Backend for NoTc<'_> {
        fn add(&self, pod: &PodRef, policy: &RedirectPolicy) -> anyhow::Result<()> {
            self.0.add(pod, policy)?;
            let cookie = meshcap_agent::podnet::cookie_of(&pod.netns)?;
            for record in self.0.get().config().pins().pod(cookie).tc_records() {
                let ifname = record.ifname();
                if record.is_filter() {
                    // A netlink TC filter (the default): its clsact qdisc goes with it.
                    let netns = pod.netns.file_name().ok_or_else(|| {
                        anyhow::anyhow!("netns {} has no name", pod.netns.display())
                    })?;
                    let netns = netns.to_string_lossy();
                    meshcap_tests::run(
                        "tc",
                        &["-n", &netns, "qdisc", "del", "dev", ifname, "clsact"],
                    )?;
                } else {
                    unpin_link(record.path())?;
                }
            }
            Ok(())
        }

        fn remove(&self, pod: &PodRef) -> anyhow::Result<()> {
            self.0.remove(pod)
        }
    }
    let backend = EbpfUnderTest::new(&node.cgroup).expect("eBPF backend");
    assert!(
        run_case(
            &mut node,
            &NoTc(&backend),
            &row("inbound to the app is captured")
        )
        .is_err(),
        "inbound capture still works without the TC program"
    );
    // The socket lookup program is per pod too, and only where bpf_sk_assign refuses the
    // stand-in Envoy's SO_REUSEPORT listeners (before Linux 6.5).
    struct NoHandoff<'a>(&'a EbpfUnderTest);
    impl Backend for NoHandoff<'_> {
        fn add(&self, pod: &PodRef, policy: &RedirectPolicy) -> anyhow::Result<()> {
            self.0.add(pod, policy)?;
            let cookie = meshcap_agent::podnet::cookie_of(&pod.netns)?;
            unpin_link(&self.0.get().config().pins().pod(cookie).handoff_link())?;
            Ok(())
        }

        fn remove(&self, pod: &PodRef) -> anyhow::Result<()> {
            self.0.remove(pod)
        }
    }
    if !meshcap_agent::probe::assigns_to_reuseport_listeners().expect("kernel release") {
        let backend = EbpfUnderTest::new(&node.cgroup).expect("eBPF backend");
        assert!(
            run_case(
                &mut node,
                &NoHandoff(&backend),
                &row("inbound to the app is captured")
            )
            .is_err(),
            "inbound capture still works without the socket lookup program"
        );
    }
}
