//! Istio's documented behaviour, case by case: each case builds a pod, checks the policy it
//! gets, and checks packets against both the policy's own decision and the evaluator of the
//! rendered rules (which must agree).

use std::net::IpAddr;

use meshcap_policy::{
    self as policy, CtState, InterceptionMode, IpRanges, Packet, PolicyError, PortSelection,
    RedirectPolicy, RuleEvaluator, SelectConfig, Selection, SkipReason, Verdict,
};
use serde_json::{Value, json};

const POD_IP: &str = "10.0.0.2";
const POD_IP6: &str = "fd00::2";

/// A pod like the goldens' (injected, status annotation present) with extra annotations and
/// `istio-proxy` env / securityContext.
fn pod(
    annotations: &[(&str, &str)],
    env: &[(&str, &str)],
    security: Value,
) -> k8s_openapi::api::core::v1::Pod {
    let mut all = serde_json::Map::new();
    all.insert("sidecar.istio.io/status".into(), json!("{}"));
    for (key, value) in annotations {
        all.insert((*key).into(), json!(value));
    }
    let env: Vec<Value> = env
        .iter()
        .map(|(name, value)| json!({"name": name, "value": value}))
        .collect();
    serde_json::from_value(json!({
        "metadata": {"name": "web", "namespace": "default", "annotations": all},
        "spec": {"containers": [
            {"name": "app"},
            {"name": "istio-proxy", "args": ["proxy", "sidecar"], "env": env, "securityContext": security},
        ]},
    }))
    .unwrap()
}

fn ips(list: &[&str]) -> Vec<IpAddr> {
    list.iter().map(|ip| ip.parse().unwrap()).collect()
}

fn policy_of(
    annotations: &[(&str, &str)],
    env: &[(&str, &str)],
    security: Value,
    addrs: &[&str],
) -> RedirectPolicy {
    match policy::select(
        &pod(annotations, env, security),
        &ips(addrs),
        &SelectConfig::default(),
    ) {
        Ok(Selection::Capture { policy }) => *policy,
        other => panic!("not captured: {other:?}"),
    }
}

fn annotated(annotations: &[(&str, &str)]) -> RedirectPolicy {
    policy_of(annotations, &[], json!({}), &[POD_IP])
}

fn error_of(annotations: &[(&str, &str)], security: Value) -> PolicyError {
    policy::select(
        &pod(annotations, &[], security),
        &ips(&[POD_IP]),
        &SelectConfig::default(),
    )
    .unwrap_err()
}

fn ip(text: &str) -> IpAddr {
    text.parse().unwrap()
}

/// App (uid/gid 1000) TCP to `dst:port` leaving by `interface`.
fn app(dst: &str, port: u16, interface: &str) -> Packet {
    let src = if ip(dst).is_ipv4() { POD_IP } else { POD_IP6 };
    Packet::outbound_tcp(ip(src), ip(dst), port, 1000, 1000, interface)
}

/// The proxy (1337/1337) TCP to `dst:port` leaving by `interface`.
fn proxy(dst: &str, port: u16, interface: &str) -> Packet {
    Packet {
        uid: 1337,
        gid: 1337,
        ..app(dst, port, interface)
    }
}

fn inbound(dst: &str, port: u16, interface: &str) -> Packet {
    let src = if ip(dst).is_ipv4() {
        "10.9.9.9"
    } else {
        "fd00::9"
    };
    Packet::inbound_tcp(ip(src), ip(dst), port, interface)
}

/// Both the policy's decision and the rendered rules give `want` (and the same mark).
#[track_caller]
fn expect(policy: &RedirectPolicy, packet: &Packet, want: Verdict) {
    let decided = policy.decide(packet);
    let evaluator = RuleEvaluator::new(&policy.render()).unwrap();
    let trace = evaluator.trace(packet);
    assert_eq!(decided.verdict, want, "policy decision for {packet:?}");
    assert_eq!(
        trace.outcome, decided,
        "rules vs policy for {packet:?}; matched {:#?}",
        trace.matched
    );
}

#[test]
fn defaults() {
    let policy = annotated(&[]);
    assert_eq!(policy.mode, InterceptionMode::Redirect);
    assert_eq!(policy.include_outbound_ip_ranges, IpRanges::All);
    assert!(policy.exclude_outbound_ip_ranges.is_empty());
    assert_eq!(policy.include_inbound_ports, PortSelection::All);
    assert_eq!(policy.exclude_inbound_ports, [15020, 15021, 15090]);
    assert_eq!(policy.exclude_outbound_ports, [15020]);
    assert!(policy.include_outbound_ports.is_empty());
    assert!(policy.exclude_interfaces.is_empty() && policy.reroute_virtual_interfaces.is_empty());
    assert_eq!((policy.proxy_uid, policy.proxy_gid), (1337, 1337));
    assert!(!policy.dns_capture && !policy.invalid_drop && !policy.ipv6 && !policy.dual_stack);
    assert_eq!(policy.pod.to_string(), "default/web");
}

#[test]
fn default_outbound_capture() {
    let policy = annotated(&[]);
    expect(
        &policy,
        &app("10.1.2.3", 80, "eth0"),
        Verdict::Redirect(15001),
    );
    expect(&policy, &app("10.1.2.3", 80, "eth0").udp(), Verdict::Pass);
    expect(&policy, &app("10.1.2.3", 15020, "eth0"), Verdict::Pass);
    expect(
        &policy,
        &app("10.1.2.3", 15020, "eth0").udp(),
        Verdict::Pass,
    );
    let established = Packet {
        ct_state: CtState::Established,
        ..app("10.1.2.3", 80, "eth0")
    };
    expect(&policy, &established, Verdict::Pass);
}

#[test]
fn default_inbound_capture() {
    let policy = annotated(&[]);
    expect(
        &policy,
        &inbound(POD_IP, 8080, "eth0"),
        Verdict::Redirect(15006),
    );
    for port in [15008, 15020, 15021, 15090] {
        expect(&policy, &inbound(POD_IP, port, "eth0"), Verdict::Pass);
    }
    expect(&policy, &inbound(POD_IP, 53, "eth0").udp(), Verdict::Pass);
}

#[test]
fn proxy_traffic_is_never_captured_except_loopback_hairpin() {
    let policy = annotated(&[]);
    expect(&policy, &proxy("10.1.2.3", 80, "eth0"), Verdict::Pass);
    expect(
        &policy,
        &proxy(POD_IP, 8080, "lo"),
        Verdict::Redirect(15006),
    );
    expect(&policy, &proxy(POD_IP, 15008, "lo"), Verdict::Pass);
    expect(&policy, &proxy("127.0.0.1", 8080, "lo"), Verdict::Pass);
    // Istio's istio-validation probe: uid 1337 to 127.0.0.6:15002 must reach 15006.
    let validation =
        Packet::outbound_tcp(ip("127.0.0.1"), ip("127.0.0.6"), 15002, 1337, 1337, "lo");
    expect(&policy, &validation, Verdict::Redirect(15006));
    // Envoy's inbound passthrough connections come from 127.0.0.6 and pass.
    let passthrough = Packet {
        src: ip("127.0.0.6"),
        ..proxy(POD_IP, 8080, "lo")
    };
    expect(&policy, &passthrough, Verdict::Pass);
    // The gid alone identifies the proxy too.
    expect(
        &policy,
        &Packet {
            uid: 5,
            ..proxy("10.1.2.3", 80, "eth0")
        },
        Verdict::Pass,
    );
    // …but over lo the uid rules come first: a non-proxy uid passes there (Istio's order).
    expect(
        &policy,
        &Packet {
            uid: 5,
            ..proxy(POD_IP, 80, "lo")
        },
        Verdict::Pass,
    );
}

#[test]
fn app_loopback_traffic_passes() {
    let policy = annotated(&[]);
    expect(&policy, &app("127.0.0.1", 8080, "lo"), Verdict::Pass);
    expect(&policy, &app(POD_IP, 8080, "lo"), Verdict::Pass);
    expect(&policy, &app("127.0.0.5", 8080, "lo").udp(), Verdict::Pass);
}

#[test]
fn loopback_range_in_include_list_captures_app_loopback() {
    let policy = annotated(&[(
        "traffic.sidecar.istio.io/includeOutboundIPRanges",
        "127.0.0.0/8",
    )]);
    assert!(policy.include_outbound_ip_ranges.has_loopback());
    expect(
        &policy,
        &app("127.0.0.5", 8080, "lo"),
        Verdict::Redirect(15001),
    );
    expect(&policy, &app("127.0.0.1", 8080, "lo"), Verdict::Pass);
    expect(&policy, &app("10.1.2.3", 80, "eth0"), Verdict::Pass);
}

#[test]
fn include_ranges_list_and_empty() {
    let policy = annotated(&[(
        "traffic.sidecar.istio.io/includeOutboundIPRanges",
        "10.0.0.0/8,192.168.1.0/24",
    )]);
    expect(
        &policy,
        &app("10.1.2.3", 80, "eth0"),
        Verdict::Redirect(15001),
    );
    expect(
        &policy,
        &app("192.168.1.7", 80, "eth0"),
        Verdict::Redirect(15001),
    );
    expect(&policy, &app("192.168.2.7", 80, "eth0"), Verdict::Pass);
    let none = annotated(&[("traffic.sidecar.istio.io/includeOutboundIPRanges", "")]);
    assert_eq!(
        none.include_outbound_ip_ranges,
        IpRanges::Cidrs(policy::CidrSet::default())
    );
    expect(&none, &app("10.1.2.3", 80, "eth0"), Verdict::Pass);
    expect(
        &none,
        &inbound(POD_IP, 8080, "eth0"),
        Verdict::Redirect(15006),
    );
}

#[test]
fn exclude_ranges_come_before_include_ranges_and_ports() {
    let policy = annotated(&[
        (
            "traffic.sidecar.istio.io/includeOutboundIPRanges",
            "10.0.0.0/8",
        ),
        (
            "traffic.sidecar.istio.io/excludeOutboundIPRanges",
            "10.1.0.0/16",
        ),
        ("traffic.sidecar.istio.io/includeOutboundPorts", "5432"),
    ]);
    expect(
        &policy,
        &app("10.2.0.1", 80, "eth0"),
        Verdict::Redirect(15001),
    );
    expect(&policy, &app("10.1.0.1", 80, "eth0"), Verdict::Pass);
    expect(&policy, &app("10.1.0.1", 5432, "eth0"), Verdict::Pass);
    expect(
        &policy,
        &app("8.8.8.8", 5432, "eth0"),
        Verdict::Redirect(15001),
    );
    expect(&policy, &app("8.8.8.8", 5432, "eth0").udp(), Verdict::Pass);
    expect(&policy, &app("8.8.8.8", 80, "eth0"), Verdict::Pass);
}

#[test]
fn exclude_ranges_with_wildcard_include() {
    let policy = annotated(&[(
        "traffic.sidecar.istio.io/excludeOutboundIPRanges",
        "10.0.0.0/8,fd00::/8",
    )]);
    assert_eq!(policy.exclude_outbound_ip_ranges.v4.len(), 1);
    assert_eq!(policy.exclude_outbound_ip_ranges.v6.len(), 1);
    expect(&policy, &app("10.1.0.1", 80, "eth0"), Verdict::Pass);
    expect(
        &policy,
        &app("11.1.0.1", 80, "eth0"),
        Verdict::Redirect(15001),
    );
}

#[test]
fn include_inbound_ports_list() {
    let policy = annotated(&[
        ("traffic.sidecar.istio.io/includeInboundPorts", "80, 443"),
        ("traffic.sidecar.istio.io/excludeInboundPorts", "80"),
    ]);
    assert_eq!(
        policy.include_inbound_ports,
        PortSelection::Ports(vec![80, 443])
    );
    // The exclude list only applies to `*`.
    expect(
        &policy,
        &inbound(POD_IP, 80, "eth0"),
        Verdict::Redirect(15006),
    );
    expect(
        &policy,
        &inbound(POD_IP, 443, "eth0"),
        Verdict::Redirect(15006),
    );
    expect(&policy, &inbound(POD_IP, 8080, "eth0"), Verdict::Pass);
}

#[test]
fn include_inbound_ports_empty_captures_no_inbound() {
    let policy = annotated(&[("traffic.sidecar.istio.io/includeInboundPorts", "")]);
    assert!(policy.include_inbound_ports.is_none());
    assert!(!policy.render().v4.contains("-A PREROUTING"));
    expect(&policy, &inbound(POD_IP, 8080, "eth0"), Verdict::Pass);
    expect(
        &policy,
        &app("10.1.2.3", 80, "eth0"),
        Verdict::Redirect(15001),
    );
}

#[test]
fn exclude_inbound_ports_add_to_the_fixed_ones() {
    let policy = annotated(&[(
        "traffic.sidecar.istio.io/excludeInboundPorts",
        "15021, 3333",
    )]);
    assert_eq!(policy.exclude_inbound_ports, [15021, 3333, 15020, 15090]);
    expect(&policy, &inbound(POD_IP, 3333, "eth0"), Verdict::Pass);
    expect(&policy, &inbound(POD_IP, 15020, "eth0"), Verdict::Pass);
    let empty = annotated(&[("traffic.sidecar.istio.io/excludeInboundPorts", "")]);
    assert_eq!(empty.exclude_inbound_ports, [15020, 15021, 15090]);
}

#[test]
fn exclude_outbound_ports_replace_the_default() {
    let policy = annotated(&[("traffic.sidecar.istio.io/excludeOutboundPorts", "5555")]);
    assert_eq!(policy.exclude_outbound_ports, [5555]);
    expect(
        &policy,
        &app("10.1.2.3", 15020, "eth0"),
        Verdict::Redirect(15001),
    );
    expect(&policy, &app("10.1.2.3", 5555, "eth0"), Verdict::Pass);
    // Excluded ports win even for the proxy's loopback hairpin.
    expect(&policy, &proxy(POD_IP, 5555, "lo"), Verdict::Pass);
    let empty = annotated(&[("traffic.sidecar.istio.io/excludeOutboundPorts", "")]);
    assert!(empty.exclude_outbound_ports.is_empty());
    expect(
        &empty,
        &app("10.1.2.3", 15020, "eth0"),
        Verdict::Redirect(15001),
    );
}

#[test]
fn dns_capture() {
    let policy = policy_of(
        &[],
        &[("ISTIO_META_DNS_CAPTURE", "true")],
        json!({}),
        &[POD_IP],
    );
    assert!(policy.dns_capture);
    expect(
        &policy,
        &app("10.96.0.10", 53, "eth0").udp(),
        Verdict::Redirect(15053),
    );
    expect(
        &policy,
        &app("10.96.0.10", 53, "eth0"),
        Verdict::Redirect(15053),
    );
    expect(
        &policy,
        &app("127.0.0.53", 53, "lo").udp(),
        Verdict::Redirect(15053),
    );
    expect(
        &policy,
        &app("127.0.0.53", 53, "lo"),
        Verdict::Redirect(15053),
    );
    expect(
        &policy,
        &proxy("10.96.0.10", 53, "eth0").udp(),
        Verdict::Pass,
    );
    expect(&policy, &proxy(POD_IP, 53, "lo"), Verdict::Pass);
    expect(&policy, &app(POD_IP, 8080, "lo"), Verdict::Pass);
    let unparsable = policy_of(
        &[],
        &[("ISTIO_META_DNS_CAPTURE", "yes")],
        json!({}),
        &[POD_IP],
    );
    assert!(!unparsable.dns_capture);
}

#[test]
fn invalid_drop() {
    let policy = policy_of(&[], &[("INVALID_DROP", "1")], json!({}), &[POD_IP]);
    let invalid = Packet {
        ct_state: CtState::Invalid,
        ..inbound(POD_IP, 8080, "eth0")
    };
    expect(&policy, &invalid, Verdict::Drop);
    expect(&annotated(&[]), &invalid, Verdict::Pass);
}

#[test]
fn tproxy_inbound() {
    let policy = annotated(&[("sidecar.istio.io/interceptionMode", "TPROXY")]);
    assert_eq!(policy.mode, InterceptionMode::Tproxy);
    expect(
        &policy,
        &inbound(POD_IP, 8080, "eth0"),
        Verdict::Tproxy(15006),
    );
    expect(
        &policy,
        &inbound(POD_IP, 15008, "eth0"),
        Verdict::Tproxy(15006),
    );
    expect(&policy, &inbound(POD_IP, 15020, "eth0"), Verdict::Pass);
    let established = Packet {
        ct_state: CtState::Established,
        ..inbound(POD_IP, 8080, "eth0")
    };
    assert_eq!(policy.decide(&established).mark, 1337);
    expect(&policy, &established, Verdict::Pass);
    // The app calling itself over lo passes; the proxy's marked traffic is captured.
    let app_lo = Packet {
        src: ip(POD_IP),
        ..inbound(POD_IP, 8080, "lo")
    };
    expect(&policy, &app_lo, Verdict::Pass);
    expect(
        &policy,
        &Packet {
            mark: 1338,
            ..app_lo.clone()
        },
        Verdict::Tproxy(15006),
    );
    expect(
        &policy,
        &Packet {
            mark: 1338,
            src: ip("127.0.0.6"),
            ..app_lo
        },
        Verdict::Pass,
    );
    let route = policy.render().routes.mark_route.expect("policy route");
    assert_eq!((route.mark, route.table), (1337, 133));
}

#[test]
fn tproxy_outbound_marks_proxy_loopback_traffic() {
    let policy = annotated(&[("sidecar.istio.io/interceptionMode", "TPROXY")]);
    let hairpin = proxy(POD_IP, 8080, "lo");
    assert_eq!(policy.decide(&hairpin).mark, 1338);
    expect(&policy, &hairpin, Verdict::Redirect(15006));
    expect(
        &policy,
        &app("10.1.2.3", 80, "eth0"),
        Verdict::Redirect(15001),
    );
    let no_inbound = annotated(&[
        ("sidecar.istio.io/interceptionMode", "TPROXY"),
        ("traffic.sidecar.istio.io/includeInboundPorts", ""),
    ]);
    assert!(no_inbound.render().routes.mark_route.is_none());
    expect(&no_inbound, &inbound(POD_IP, 8080, "eth0"), Verdict::Pass);
}

#[test]
fn custom_and_zero_proxy_ids() {
    let custom = policy_of(
        &[],
        &[],
        json!({"runAsUser": 1_000_670_000, "runAsGroup": 1_000_670_001}),
        &[POD_IP],
    );
    assert_eq!(
        (custom.proxy_uid, custom.proxy_gid),
        (1_000_670_000, 1_000_670_001)
    );
    let custom_proxy = Packet {
        uid: 1_000_670_000,
        gid: 1_000_670_001,
        ..app("10.1.2.3", 80, "eth0")
    };
    expect(&custom, &custom_proxy, Verdict::Pass);
    expect(
        &custom,
        &proxy("10.1.2.3", 80, "eth0"),
        Verdict::Redirect(15001),
    );
    let zero = policy_of(
        &[],
        &[],
        json!({"runAsUser": 0, "runAsGroup": 0}),
        &[POD_IP],
    );
    assert_eq!((zero.proxy_uid, zero.proxy_gid), (1337, 1337));
}

#[test]
fn exclude_interfaces() {
    let policy = annotated(&[("traffic.sidecar.istio.io/excludeInterfaces", "eth1, net2")]);
    assert_eq!(policy.exclude_interfaces, ["eth1", "net2"]);
    expect(&policy, &app("10.1.2.3", 80, "eth1"), Verdict::Pass);
    expect(&policy, &inbound(POD_IP, 8080, "net2"), Verdict::Pass);
    expect(
        &policy,
        &inbound(POD_IP, 8080, "eth0"),
        Verdict::Redirect(15006),
    );
    let tproxy = annotated(&[
        ("sidecar.istio.io/interceptionMode", "TPROXY"),
        ("traffic.sidecar.istio.io/excludeInterfaces", "eth1"),
    ]);
    expect(&tproxy, &inbound(POD_IP, 8080, "eth1"), Verdict::Pass);
    expect(
        &tproxy,
        &inbound(POD_IP, 8080, "eth0"),
        Verdict::Tproxy(15006),
    );
}

#[test]
fn reroute_virtual_interfaces() {
    let policy = annotated(&[("istio.io/reroute-virtual-interfaces", "eth1")]);
    assert_eq!(policy.reroute_virtual_interfaces, ["eth1"]);
    expect(
        &policy,
        &inbound("8.8.8.8", 80, "eth1"),
        Verdict::Redirect(15001),
    );
    expect(
        &policy,
        &inbound("8.8.8.8", 80, "eth1").udp(),
        Verdict::Pass,
    );
    expect(
        &policy,
        &inbound(POD_IP, 8080, "eth0"),
        Verdict::Redirect(15006),
    );
    let ranged = annotated(&[
        ("istio.io/reroute-virtual-interfaces", "eth1"),
        (
            "traffic.sidecar.istio.io/includeOutboundIPRanges",
            "10.0.0.0/8",
        ),
    ]);
    expect(
        &ranged,
        &inbound("10.1.1.1", 80, "eth1"),
        Verdict::Redirect(15001),
    );
    expect(&ranged, &inbound("8.8.8.8", 80, "eth1"), Verdict::Pass);
}

#[test]
fn kubevirt_interfaces_only_when_new_key_absent() {
    let old = annotated(&[("traffic.sidecar.istio.io/kubevirtInterfaces", "vnet0")]);
    assert_eq!(old.reroute_virtual_interfaces, ["vnet0"]);
    let both = annotated(&[
        ("traffic.sidecar.istio.io/kubevirtInterfaces", "vnet0"),
        ("istio.io/reroute-virtual-interfaces", "vnet1"),
    ]);
    assert_eq!(both.reroute_virtual_interfaces, ["vnet1"]);
    let explicit_empty = annotated(&[
        ("traffic.sidecar.istio.io/kubevirtInterfaces", "vnet0"),
        ("istio.io/reroute-virtual-interfaces", ""),
    ]);
    assert!(explicit_empty.reroute_virtual_interfaces.is_empty());
}

#[test]
fn ipv6_pod_gets_mirrored_rules() {
    let policy = policy_of(&[], &[], json!({}), &[POD_IP6]);
    assert!(policy.ipv6);
    let rules = policy.render();
    let v6 = rules.v6.as_deref().expect("ip6tables rules");
    assert!(v6.contains("-A ISTIO_OUTPUT -o lo -s ::6/128 -j RETURN"));
    assert_eq!(rules.routes.loopback_addresses[0].to_string(), "::6/128");
    expect(
        &policy,
        &app("fd00::99", 80, "eth0"),
        Verdict::Redirect(15001),
    );
    expect(&policy, &app("::1", 80, "lo"), Verdict::Pass);
    expect(
        &policy,
        &proxy(POD_IP6, 8080, "lo"),
        Verdict::Redirect(15006),
    );
    expect(
        &policy,
        &Packet {
            src: ip("::6"),
            ..proxy(POD_IP6, 8080, "lo")
        },
        Verdict::Pass,
    );
    expect(
        &policy,
        &inbound(POD_IP6, 8080, "eth0"),
        Verdict::Redirect(15006),
    );
}

#[test]
fn dual_stack_and_per_family_include_lists() {
    let policy = policy_of(
        &[(
            "traffic.sidecar.istio.io/includeOutboundIPRanges",
            "10.0.0.0/8",
        )],
        &[("ISTIO_DUAL_STACK", "true")],
        json!({}),
        &[POD_IP, POD_IP6],
    );
    assert!(policy.ipv6 && policy.dual_stack);
    // A v4-only include list installs no IPv6 outbound capture at all.
    expect(&policy, &app("fd00::99", 80, "eth0"), Verdict::Pass);
    expect(
        &policy,
        &app("10.1.2.3", 80, "eth0"),
        Verdict::Redirect(15001),
    );
    let route_families = annotated(&[("sidecar.istio.io/interceptionMode", "TPROXY")])
        .render()
        .routes
        .mark_route
        .unwrap()
        .families;
    assert_eq!(route_families, [policy::Family::V4]);
}

/// Istio enables IPv6 rules from the pod's first global address in the kernel's order (IPv4
/// first), or any IPv6 one with `ISTIO_DUAL_STACK` (`tools/common/config/config.go`
/// `getLocalIP`): a dual-stack pod without it gets IPv4 rules only, an IPv6-only pod gets both.
#[test]
fn ipv6_rules_exactly_when_istio_installs_them() {
    for (addrs, env, want) in [
        (&[POD_IP, POD_IP6][..], &[][..], false),
        (&[POD_IP6, POD_IP][..], &[][..], false),
        (&[POD_IP6][..], &[][..], true),
        (&["fe80::1", POD_IP6][..], &[][..], true),
        (
            &[POD_IP6, POD_IP][..],
            &[("ISTIO_DUAL_STACK", "true")][..],
            true,
        ),
        (&[POD_IP][..], &[("ISTIO_DUAL_STACK", "true")][..], false),
        (&["::ffff:10.0.0.2", POD_IP6][..], &[][..], false),
    ] {
        let policy = policy_of(&[], env, json!({}), addrs);
        assert_eq!(policy.ipv6, want, "{addrs:?} {env:?}");
        assert_eq!(policy.render().v6.is_some(), want, "{addrs:?} {env:?}");
    }
}

/// `ValidateInterfaceNames` (pkg/util/net/ip.go, Istio ≥ 1.30) refuses an empty entry in
/// each of the three interface annotations.
#[test]
fn interface_lists_with_an_empty_entry_are_refused() {
    for key in [
        "traffic.sidecar.istio.io/excludeInterfaces",
        "istio.io/reroute-virtual-interfaces",
        "traffic.sidecar.istio.io/kubevirtInterfaces",
    ] {
        let err = error_of(&[(key, "eth1,,eth2")], json!({}));
        assert!(
            matches!(err, PolicyError::InvalidInterface { .. }),
            "{key}: {err}"
        );
        assert!(err.to_string().contains(key), "{err}");
    }
}

/// `excludeInboundPorts` is validated with `validatePortListWithWildcard`
/// (cni/pkg/plugin/sidecar_redirect.go): `*` is accepted, and with a port-list
/// `includeInboundPorts` the exclude list is unused.
#[test]
fn wildcard_exclude_inbound_ports_with_a_port_list_include_is_accepted() {
    let policy = annotated(&[
        ("traffic.sidecar.istio.io/includeInboundPorts", "8080"),
        ("traffic.sidecar.istio.io/excludeInboundPorts", "*"),
    ]);
    assert_eq!(
        policy.include_inbound_ports,
        PortSelection::Ports(vec![8080])
    );
    expect(
        &policy,
        &inbound(POD_IP, 8080, "eth0"),
        Verdict::Redirect(15006),
    );
    expect(&policy, &inbound(POD_IP, 9090, "eth0"), Verdict::Pass);
    // With `*` included, Istio would write `--dport *`, which iptables refuses.
    let err = error_of(
        &[("traffic.sidecar.istio.io/excludeInboundPorts", "*")],
        json!({}),
    );
    assert!(err.to_string().contains("is not allowed here"), "{err}");
}

/// Go's `netip.Addr.IsLoopback`, which `SeparateV4V6` (tools/common/config/config.go) calls,
/// unmaps an IPv4-mapped address: `::ffff:127.0.0.1/128` is a loopback range, so the app's
/// loopback traffic stays in the capture path as for `127.0.0.1/32`.
#[test]
fn an_ipv4_mapped_loopback_include_range_counts_as_loopback() {
    let policy = annotated(&[(
        "traffic.sidecar.istio.io/includeOutboundIPRanges",
        "::ffff:127.0.0.1/128",
    )]);
    assert!(policy.include_outbound_ip_ranges.has_loopback());
    assert!(
        !policy.render().v4.contains("-o lo -m owner ! --uid-owner"),
        "no app-loopback RETURN rules"
    );
}

#[test]
fn ipv4_only_pod_leaves_ipv6_alone() {
    for addrs in [&[POD_IP][..], &["10.0.0.2", "fe80::1"][..]] {
        let policy = policy_of(&[], &[], json!({}), addrs);
        assert!(!policy.ipv6);
        assert!(policy.render().v6.is_none());
        expect(&policy, &app("fd00::99", 80, "eth0"), Verdict::Pass);
        expect(&policy, &inbound(POD_IP6, 8080, "eth0"), Verdict::Pass);
    }
}

fn selection(pod: Value, config: &SelectConfig) -> Selection {
    let pod = serde_json::from_value(pod).unwrap();
    policy::select(&pod, &ips(&[POD_IP]), config).unwrap()
}

fn skip_reason(pod: Value) -> Option<SkipReason> {
    match selection(pod, &SelectConfig::default()) {
        Selection::Skip { reason } => Some(reason),
        Selection::Capture { .. } => None,
    }
}

fn pod_json(labels: Value, annotations: Value, spec: Value) -> Value {
    json!({"metadata": {"name": "web", "namespace": "default", "labels": labels, "annotations": annotations}, "spec": spec})
}

#[test]
fn selection_follows_istio() {
    let status = json!({"sidecar.istio.io/status": "{}"});
    let sidecar = json!({"containers": [{"name": "app"}, {"name": "istio-proxy"}]});
    assert_eq!(
        skip_reason(pod_json(json!({}), status.clone(), sidecar.clone())),
        None
    );
    let kube_system = json!({"metadata": {"name": "dns", "namespace": "kube-system", "annotations": status}, "spec": sidecar});
    assert_eq!(
        skip_reason(kube_system.clone()),
        Some(SkipReason::ExcludedNamespace("kube-system".into()))
    );
    assert!(matches!(
        selection(
            kube_system,
            &SelectConfig {
                exclude_namespaces: vec![]
            }
        ),
        Selection::Capture { .. }
    ));
    let host = json!({"hostNetwork": true, "containers": [{"name": "istio-proxy"}]});
    assert_eq!(
        skip_reason(pod_json(json!({}), status.clone(), host)),
        Some(SkipReason::HostNetwork)
    );
    let init = json!({"initContainers": [{"name": "istio-init"}], "containers": [{"name": "istio-proxy"}]});
    assert_eq!(
        skip_reason(pod_json(json!({}), status.clone(), init)),
        Some(SkipReason::IstioInit)
    );
    let disabled = |value: &str| json!({"containers": [{"name": "istio-proxy", "env": [{"name": "DISABLE_ENVOY", "value": value}]}]});
    assert_eq!(
        skip_reason(pod_json(json!({}), status.clone(), disabled("true"))),
        Some(SkipReason::EnvoyDisabled)
    );
    assert_eq!(
        skip_reason(pod_json(json!({}), status.clone(), disabled("maybe"))),
        None
    );
    let no_proxy = json!({"containers": [{"name": "app"}]});
    assert_eq!(
        skip_reason(pod_json(json!({}), status.clone(), no_proxy)),
        Some(SkipReason::NoProxy)
    );
    let native = json!({"initContainers": [{"name": "istio-proxy", "restartPolicy": "Always"}], "containers": [{"name": "app"}]});
    assert_eq!(
        skip_reason(pod_json(json!({}), status.clone(), native)),
        None
    );
    let router = json!({"containers": [{"name": "istio-proxy", "args": ["proxy", "router"]}]});
    assert_eq!(
        skip_reason(pod_json(json!({}), status.clone(), router)),
        Some(SkipReason::NotSidecar("router".into()))
    );
}

#[test]
fn inject_label_wins_over_annotation_and_only_false_skips() {
    let sidecar = json!({"containers": [{"name": "istio-proxy"}]});
    let with = |labels: Value, inject: Option<&str>| {
        let mut annotations = json!({"sidecar.istio.io/status": "{}"});
        if let Some(value) = inject {
            annotations["sidecar.istio.io/inject"] = json!(value);
        }
        skip_reason(pod_json(labels, annotations, sidecar.clone()))
    };
    assert_eq!(
        with(json!({"sidecar.istio.io/inject": "false"}), None),
        Some(SkipReason::InjectDisabled("false".into()))
    );
    assert_eq!(
        with(json!({}), Some("False")),
        Some(SkipReason::InjectDisabled("False".into()))
    );
    assert_eq!(
        with(json!({"sidecar.istio.io/inject": "true"}), Some("false")),
        None
    );
    assert_eq!(with(json!({}), Some("no")), None);
    assert_eq!(with(json!({}), Some("true")), None);
    let no_status = pod_json(json!({}), json!({}), sidecar.clone());
    assert_eq!(skip_reason(no_status), Some(SkipReason::NoSidecarStatus));
}

#[test]
fn errors_name_pod_key_and_value() {
    let cases: [(&[(&str, &str)], &str); 14] = [
        (
            &[(
                "traffic.sidecar.istio.io/excludeOutboundIPRanges",
                "10.0.0.0/33",
            )],
            "pod default/web: annotation traffic.sidecar.istio.io/excludeOutboundIPRanges: \"10.0.0.0/33\" is not a CIDR list: \"10.0.0.0/33\" is not a CIDR (bad prefix length)",
        ),
        (
            &[(
                "traffic.sidecar.istio.io/includeOutboundIPRanges",
                "10.0.0.0/8, 192.168.0.0/16",
            )],
            "annotation traffic.sidecar.istio.io/includeOutboundIPRanges: \"10.0.0.0/8, 192.168.0.0/16\" is not a CIDR list: \" 192.168.0.0/16\" is not a CIDR (bad address)",
        ),
        (
            &[(
                "traffic.sidecar.istio.io/includeOutboundIPRanges",
                "10.0.0.1",
            )],
            "\"10.0.0.1\" is not a CIDR (no \"/\" with a prefix length)",
        ),
        (
            &[("traffic.sidecar.istio.io/excludeOutboundIPRanges", "*")],
            "pod default/web: annotation traffic.sidecar.istio.io/excludeOutboundIPRanges: \"*\": \"*\" is not allowed here",
        ),
        (
            &[("traffic.sidecar.istio.io/includeInboundPorts", "80,65536")],
            "pod default/web: annotation traffic.sidecar.istio.io/includeInboundPorts: \"80,65536\" is not a port list: \"65536\" is not a port (0-65535)",
        ),
        (
            &[("traffic.sidecar.istio.io/excludeInboundPorts", "http")],
            "excludeInboundPorts: \"http\" is not a port list: \"http\" is not a port",
        ),
        (
            &[("traffic.sidecar.istio.io/includeOutboundPorts", "80,")],
            "includeOutboundPorts: \"80,\" is not a port list: \"\" is not a port",
        ),
        (
            &[("traffic.sidecar.istio.io/excludeOutboundPorts", "-1")],
            "excludeOutboundPorts: \"-1\" is not a port list",
        ),
        (
            &[("traffic.sidecar.istio.io/excludeOutboundPorts", "*")],
            "excludeOutboundPorts: \"*\": \"*\" is not allowed here",
        ),
        (
            &[("traffic.sidecar.istio.io/includeOutboundPorts", "*")],
            "includeOutboundPorts: \"*\": \"*\" is not allowed here",
        ),
        (
            &[("sidecar.istio.io/interceptionMode", "NONE")],
            "pod default/web: annotation sidecar.istio.io/interceptionMode: \"NONE\" is not an interception mode (REDIRECT or TPROXY)",
        ),
        (
            &[("sidecar.istio.io/interceptionMode", "redirect")],
            "\"redirect\" is not an interception mode",
        ),
        (
            &[("traffic.sidecar.istio.io/excludeInterfaces", "eth0,")],
            "annotation traffic.sidecar.istio.io/excludeInterfaces: \"eth0,\" is not an interface list: \"\" is not an interface name",
        ),
        (
            &[("istio.io/reroute-virtual-interfaces", "eth 1")],
            "istio.io/reroute-virtual-interfaces: \"eth 1\" is not an interface list",
        ),
    ];
    for (annotations, want) in cases {
        let message = error_of(annotations, json!({})).to_string();
        assert!(message.contains(want), "{annotations:?}: {message}");
        assert!(message.starts_with("pod default/web: "), "{message}");
    }
    let negative = error_of(&[], json!({"runAsUser": -5})).to_string();
    assert_eq!(
        negative,
        "pod default/web: container istio-proxy: securityContext.runAsUser: -5 is not a valid id"
    );
    let huge = error_of(&[], json!({"runAsGroup": 1_i64 << 40})).to_string();
    assert!(
        huge.contains("securityContext.runAsGroup: 1099511627776 is not a valid id"),
        "{huge}"
    );
}

#[test]
fn malformed_manifest_is_an_error() {
    let err = policy::parse_pod_manifest("metadata: [1, 2]").unwrap_err();
    assert!(err.to_string().starts_with("not a pod manifest"), "{err}");
    let json_pod = policy::parse_pod_manifest(
        r#"{"metadata":{"name":"x"},"status":{"podIPs":[{"ip":"fd00::1"}]}}"#,
    )
    .unwrap();
    assert_eq!(policy::status_pod_ips(&json_pod), [ip("fd00::1")]);
}
