//! A NAT table made in a captured pod's netns after its capture: an app with `NET_ADMIN`, a
//! debug container, or an operator listing the legacy `nat` table (which creates it) gives the
//! netns netfilter's NAT hooks and conntrack. From then on `nf_nat_ipv4_local_in` (and its IPv6
//! twin) take back the socket TC assigned to an inbound SYN, since a listener's port is never
//! the connection's reply port, and the SYN would go on to the app's own port: the sidecar
//! bypassed, silently. Every inbound connection must still reach the proxy, with the
//! destination the client dialled (docs/ebpf.md, "A nat chain in the pod's netns").
use meshcap_tests::{
    dial, require_root, run,
    scenario::{Backend as _, EbpfUnderTest, default_policy},
    world::{Node, PROXY, Pod},
};

/// Runs `program` with `args` in the pod's netns.
fn in_pod(pod: &Pod, program: &str, args: &[&str]) {
    let mut all = vec!["netns", "exec", pod.netns.name(), program];
    all.extend(args);
    run("ip", &all).unwrap_or_else(|e| panic!("{program} {args:?}: {e:#}"));
}

/// Where the node's connections to the pod's 8080, IPv4 and IPv6, go: the listener that took
/// each and the destination it reports.
fn inbound(node: &Node, pod: &Pod) -> Vec<(String, u16, Option<String>)> {
    [
        format!("tcp:{}:8080", pod.v4()),
        format!("tcp:[{}]:8080", pod.v6()),
    ]
    .iter()
    .map(|target| {
        let report = dial(node.client(), target, None)
            .expect("dial")
            .unwrap_or_else(|| panic!("no answer from {target}"));
        (
            report.server,
            report.listener,
            report.original_dst.map(|a| a.to_string()),
        )
    })
    .collect()
}

/// The proxy's answers to [`inbound`]: captured.
fn to_envoy(pod: &Pod) -> Vec<(String, u16, Option<String>)> {
    vec![
        ("envoy".into(), 15006, Some(format!("{}:8080", pod.v4()))),
        ("envoy".into(), 15006, Some(format!("[{}]:8080", pod.v6()))),
    ]
}

/// A pod captured in the kernel, its inbound connections checked, then `make` run in its netns,
/// and its inbound connections checked again.
fn inbound_stays_captured(make: &[(&str, &[&str])]) {
    require_root();
    if !meshcap_tests::ebpf_runs_here() {
        return;
    }
    let mut node = Node::new().expect("node");
    let backend = EbpfUnderTest::new(&node.cgroup).expect("eBPF backend");
    let mut pod = node.add_pod(true).expect("pod");
    pod.start_servers(&node, PROXY, false).expect("servers");
    let r = pod.pod_ref();
    backend
        .add(&r, &default_policy("natchain", pod.ips(true)))
        .expect("add");
    assert_eq!(inbound(&node, &pod), to_envoy(&pod), "before the NAT table");
    for (program, args) in make {
        in_pod(&pod, program, args);
    }
    for round in 0..3 {
        assert_eq!(
            inbound(&node, &pod),
            to_envoy(&pod),
            "after {make:?}, connection {round}"
        );
    }
    backend.remove(&r).expect("remove");
}

/// A legacy iptables `nat` rule that changes nothing meshcap captures, for both families.
#[test]
fn a_legacy_iptables_nat_rule_leaves_inbound_captured() {
    let rule = [
        "-t",
        "nat",
        "-A",
        "PREROUTING",
        "-p",
        "tcp",
        "--dport",
        "9999",
        "-j",
        "REDIRECT",
        "--to-ports",
        "9998",
    ];
    inbound_stays_captured(&[("iptables-legacy", &rule), ("ip6tables-legacy", &rule)]);
}

/// An nftables NAT chain with a rule that changes nothing meshcap captures, for both families.
#[test]
fn an_nftables_nat_chain_leaves_inbound_captured() {
    inbound_stays_captured(&[(
        "nft",
        &["add table inet app; \
             add chain inet app pre { type nat hook prerouting priority dstnat; }; \
             add rule inet app pre tcp dport 9999 redirect to :9998"],
    )]);
}
