//! A client that dials a captured port again at once from the same address and port, after
//! the proxy closed the first connection first: the pod's end of the first connection is in
//! `TIME_WAIT` under the very 4-tuple of the second, and the second must still reach the
//! proxy, as under Istio's rules (conntrack reopens a connection in `TIME_WAIT` on a SYN, and
//! the NAT table sends it to 15006 again). Busy clients reuse ports that soon: Linux's
//! ephemeral port choice for one destination walks the range from a per-destination offset.
//!
//! On the eBPF backend, TC lets packets of a 4-tuple a socket holds reach that socket, and the
//! pod's `TIME_WAIT` socket takes the new SYN (`tcp_timewait_state_process`: `TCP_TW_SYN`) and
//! has the kernel look a listener up for it by the packet's own destination, the app's port:
//! without more, the connection would bypass the proxy. TC hands such a SYN to the pod's socket
//! lookup program, which that listener lookup runs (docs/ebpf.md); a pod captured by an agent
//! that gave the program only to kernels before Linux 6.5 gets it from the verifier.
use std::{thread, time::Duration};

use aya::maps::{HashMap, Map, MapData};
use meshcap_agent::backend::{
    CaptureBackend as _, DriftKind, DriftOutcome, Verify,
    ebpf::{Pins, unpin_link},
};
use meshcap_common::{PodConfig, flags, maps};
use meshcap_tests::{
    TcpSocket, dial, dial_after_close_with, require_root,
    scenario::{Backend, EbpfUnderTest, IptablesUnderTest, NftablesUnderTest, default_policy},
    world::{Node, PROXY, Pod},
};

/// Whether `sockets` hold a socket in `TIME_WAIT` on `local_port` to `remote_port`.
fn time_wait(sockets: &[TcpSocket], local_port: u16, remote_port: u16) -> bool {
    sockets.iter().any(|s| {
        s.state == TcpSocket::TIME_WAIT
            && s.local_port == local_port
            && s.remote_port == remote_port
    })
}

/// The client dials the pod's 8080 from `client`:`port` (IPv4 `v6 == false`, or IPv6), the
/// proxy answers and closes first, the client reads to the end and closes; then, with the
/// pod's end in `TIME_WAIT` and the client's gone, it dials again from the same address and
/// port. Both connections must reach the proxy.
fn dial_twice_from_one_port(node: &Node, pod: &Pod, v6: bool, port: u16) {
    let (target, from) = if v6 {
        (
            format!("tcp:[{}]:8080", pod.v6()),
            format!("[{}]:{port}", pod.peer_v6()),
        )
    } else {
        (
            format!("tcp:{}:8080", pod.v4()),
            format!("{}:{port}", pod.peer_v4()),
        )
    };
    // `closed` runs once the proxy's end has closed; the client closes after it.
    let first = dial_after_close_with(node.client(), &target, &["--bind", &from], || {})
        .expect("first dial");
    assert_eq!(
        (first.server.as_str(), first.listener),
        ("envoy", 15006),
        "the first connection from {from}: {first:?}"
    );
    // The pod's end (the proxy's accepted socket: its local port is the app's port on the eBPF
    // backend, 15006 behind Istio's REDIRECT) goes to TIME_WAIT when the client's FIN comes,
    // and the client's end goes when the pod's ACK of it does: wait for both, boundedly.
    let mut settled = false;
    for _ in 0..1000 {
        let pod_end = time_wait(
            &pod.netns.tcp_sockets().expect("the pod's sockets"),
            first.local.port(),
            port,
        );
        let client_end = node
            .netns
            .tcp_sockets()
            .expect("the node's sockets")
            .iter()
            .any(|s| s.local_port == port);
        if pod_end && !client_end {
            settled = true;
            break;
        }
        thread::sleep(Duration::from_millis(10));
    }
    assert!(
        settled,
        "after the first connection from {from}: the pod's end never in TIME_WAIT on port {}, or the client's end never gone",
        first.local.port()
    );
    let second = dial(node.client(), &target, Some(&from))
        .expect("second dial")
        .expect("an answer to the second dial");
    assert_eq!(
        (second.server.as_str(), second.listener),
        ("envoy", 15006),
        "the second connection from {from}, while the pod's end of the first is in TIME_WAIT: {second:?}"
    );
}

/// [`dial_twice_from_one_port`] against `backend`, IPv4 and IPv6.
fn the_proxy_keeps_a_reused_client_port(node: &mut Node, backend: &dyn Backend) {
    let mut pod = node.add_pod(true).expect("pod");
    pod.start_servers(node, PROXY, false).expect("servers");
    let r = pod.pod_ref();
    backend
        .add(&r, &default_policy("timewait", pod.ips(true)))
        .expect("add");
    dial_twice_from_one_port(node, &pod, false, 41301);
    dial_twice_from_one_port(node, &pod, true, 41302);
    backend.remove(&r).expect("remove");
}

#[test]
fn ebpf_a_reused_client_port_reaches_the_proxy_past_time_wait() {
    require_root();
    if !meshcap_tests::ebpf_runs_here() {
        return;
    }
    let mut node = Node::new().expect("node");
    let backend = EbpfUnderTest::new(&node.cgroup).expect("eBPF backend");
    the_proxy_keeps_a_reused_client_port(&mut node, &backend);
}

#[test]
fn iptables_a_reused_client_port_reaches_the_proxy_past_time_wait() {
    require_root();
    let mut node = Node::new().expect("node");
    let backend = IptablesUnderTest::new().expect("iptables backend");
    the_proxy_keeps_a_reused_client_port(&mut node, &backend);
}

#[test]
fn nftables_a_reused_client_port_reaches_the_proxy_past_time_wait() {
    require_root();
    let mut node = Node::new().expect("node");
    let backend = NftablesUnderTest::new().expect("nftables backend");
    the_proxy_keeps_a_reused_client_port(&mut node, &backend);
}

/// The pod entries of the pinned `MESHCAP_PODS` under `dir`.
fn pod_entries(dir: &std::path::Path) -> HashMap<MapData, u64, PodConfig> {
    let data = MapData::from_pin(Pins::new(dir).map(maps::PODS)).expect("pinned map");
    HashMap::try_from(Map::HashMap(data)).expect("a hash map")
}

/// A pod captured by an earlier agent on Linux 6.5 or later has neither the socket lookup
/// program nor its flag (there it was only for kernels before 6.5): the verifier attaches the
/// program, then sets the flag, and a reused client port reaches the proxy.
#[test]
fn ebpf_a_pod_captured_without_the_socket_lookup_gets_it_from_the_verifier() {
    require_root();
    if !meshcap_tests::ebpf_runs_here() {
        return;
    }
    let mut node = Node::new().expect("node");
    let dir = EbpfUnderTest::unique_dir();
    let earlier = EbpfUnderTest::at(&node.cgroup, &dir).expect("eBPF backend");
    let mut pod = node.add_pod(false).expect("pod");
    pod.start_servers(&node, PROXY, false).expect("servers");
    let r = pod.pod_ref();
    earlier
        .add(&r, &default_policy("timewait", pod.ips(false)))
        .expect("add");
    // What the earlier agent left: no link, no flag.
    let cookie = pod.netns.cookie().expect("cookie");
    let link = Pins::new(&dir).pod(cookie).handoff_link();
    unpin_link(&link).expect("detaching the socket lookup");
    let mut entries = pod_entries(&dir);
    let mut config = entries.get(&cookie, 0).expect("the pod's entry");
    config.flags &= !flags::HANDOFF;
    entries.insert(cookie, config, 0).expect("the pod's entry");
    let dir = earlier.leave();
    let backend = EbpfUnderTest::at(&node.cgroup, &dir).expect("adopting backend");
    // One difference a pass: the link, then the flag (set only where the link is).
    let mut found = Vec::new();
    for _ in 0..3 {
        backend.get().verify_node(Verify::Repair);
        let check = backend.get().verify(&r, Verify::Repair).expect("verify");
        found.extend(check.drift.into_iter().map(|d| (d.kind, d.what, d.outcome)));
    }
    assert_eq!(found.len(), 2, "{found:?}");
    assert!(
        found
            .iter()
            .all(|(kind, _, outcome)| *kind == DriftKind::Handoff
                && *outcome == DriftOutcome::Repaired),
        "{found:?}"
    );
    let config = pod_entries(&dir).get(&cookie, 0).expect("the pod's entry");
    assert!(
        config.flags & flags::HANDOFF != 0,
        "flags {:#x} after the verifier",
        config.flags
    );
    dial_twice_from_one_port(&node, &pod, false, 41303);
    backend.remove(&r).expect("remove");
}
