//! The eBPF backend's life cycle on the real kernel: pins survive the agent, a restart adopts
//! them without attaching twice, removal releases the pod, and two pods with identical
//! loopback 4-tuples keep their own original destinations. The inbound stubs attach as
//! netlink TC filters by default (every kernel); pods captured with TCX links (asked for, or
//! by an agent before netlink TC became the default) must still be adopted, checked and
//! released by a default agent. The original destinations' hand-off tables hold open
//! connections only; the app's socket keeps its dialled peer after they let go.
use std::{path::Path, process::Command, thread, time::Duration};

use aya::maps::{Array, HashMap, Map, MapData};
use meshcap_agent::{
    backend::{
        CaptureBackend as _,
        ebpf::{Pins, TcAttach},
    },
    pod::PodRef,
};
use meshcap_common::{Dialing, FlowKey, OrigDst, PodConfig, maps};
use meshcap_policy::RedirectPolicy;
use meshcap_tests::{
    TcpSocket, dial, require_root,
    scenario::{EbpfUnderTest, default_policy, tcx_where_supported},
    world::{APP_UID, Node, PROXY, Pod},
};

fn captured(node: &Node, pod: &Pod) -> bool {
    let at = pod.at(
        node,
        meshcap_tests::world::APP_UID,
        meshcap_tests::world::APP_UID,
    );
    let report = dial(at, &format!("tcp:{}:80", pod.peer_v4()), None)
        .expect("dial")
        .expect("an answer");
    report.server == "envoy"
}

/// A client on the node dials the pod's app port: captured inbound, the TC stub's work.
fn captured_inbound(node: &Node, pod: &Pod) -> bool {
    let report = dial(node.client(), &format!("tcp:{}:8080", pod.v4()), None)
        .expect("dial")
        .expect("an answer");
    report.server == "envoy" && report.listener == 15006
}

/// `tc <args>` inside the pod's netns.
fn tc(pod: &Pod, args: &[&str]) -> String {
    let path = pod.netns.path();
    let name = path.file_name().expect("netns name").to_string_lossy();
    let out = Command::new("ip")
        .args(["netns", "exec", &name, "tc"])
        .args(args)
        .output()
        .expect("running tc");
    assert!(
        out.status.success(),
        "tc {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A node with one pod whose proxy and app servers listen, its default policy and reference.
fn serving_pod() -> (Node, Pod, RedirectPolicy, PodRef) {
    require_root();
    let mut node = Node::new().expect("node");
    let mut pod = node.add_pod(false).expect("pod");
    pod.start_servers(&node, PROXY, false).expect("servers");
    let policy = default_policy("web", pod.ips(false));
    let r = pod.pod_ref();
    (node, pod, policy, r)
}

/// The filters on an interface's ingress, one line each (`tc` prints each priority's
/// classifier on a line of its own, without a handle: left out).
fn ingress_filters(pod: &Pod, dev: &str) -> Vec<String> {
    tc(pod, &["filter", "show", "dev", dev, "ingress"])
        .lines()
        .filter(|l| l.contains("handle"))
        .map(str::to_owned)
        .collect()
}

#[test]
fn netlink_tc_is_recorded_checked_adopted_and_removed_exactly() {
    if !meshcap_tests::ebpf_runs_here() {
        return;
    }
    let (node, pod, policy, r) = serving_pod();
    // eth1 already has a clsact qdisc with another tool's filter (a classic BPF program that
    // never matches, so classification goes on to meshcap's): both must stay.
    tc(&pod, &["qdisc", "add", "dev", "eth1", "clsact"]);
    tc(
        &pod,
        &[
            "filter",
            "add",
            "dev",
            "eth1",
            "ingress",
            "pref",
            "10",
            "handle",
            "7",
            "bpf",
            "bytecode",
            "1,6 0 0 0",
        ],
    );

    let first = EbpfUnderTest::new(&node.cgroup).expect("backend");
    assert_eq!(
        first.get().config().tc_attach,
        TcAttach::Netlink,
        "the default"
    );
    first.get().add(&r, &policy.clone().into()).expect("add");
    first
        .get()
        .add(&r, &policy.clone().into())
        .expect("add again (idempotent)");
    first
        .get()
        .check(&r, &policy.clone().into())
        .expect("check");
    for dev in ["eth0", "eth1"] {
        let ours: Vec<_> = ingress_filters(&pod, dev)
            .into_iter()
            .filter(|l| l.contains("meshcap_tc_stub"))
            .collect();
        assert_eq!(ours.len(), 1, "{dev}: {ours:?}");
        assert!(
            ours[0].contains("pref 49153") && ours[0].contains("direct-action"),
            "{dev}: {ours:?}"
        );
    }
    assert!(captured_inbound(&node, &pod), "inbound must be captured");

    // The agent goes away: the filters stay, and a restarted one adopts them.
    let dir = first.leave();
    assert!(
        captured_inbound(&node, &pod),
        "capture must outlive the agent"
    );
    let second = EbpfUnderTest::at(&node.cgroup, &dir).expect("restarted backend");
    second
        .get()
        .add(&r, &policy.clone().into())
        .expect("add after restart");
    second
        .get()
        .check(&r, &policy.clone().into())
        .expect("check after restart");
    for dev in ["eth0", "eth1"] {
        let ours = ingress_filters(&pod, dev)
            .iter()
            .filter(|l| l.contains("meshcap_tc_stub"))
            .count();
        assert_eq!(ours, 1, "{dev}: attached {ours} times after a restart");
    }

    // CHECK looks at the kernel, not only at the pins.
    tc(
        &pod,
        &[
            "filter", "del", "dev", "eth0", "ingress", "pref", "49153", "handle", "1", "bpf",
        ],
    );
    let err = second
        .get()
        .check(&r, &policy.clone().into())
        .expect_err("check must notice the missing filter");
    assert!(err.to_string().contains("eth0"), "{err}");
    // ADD repairs it: the stale record is dropped and the stub attached afresh.
    second
        .get()
        .add(&r, &policy.clone().into())
        .expect("add repairs");
    second
        .get()
        .check(&r, &policy.clone().into())
        .expect("check after the repair");
    assert_eq!(
        ingress_filters(&pod, "eth0")
            .iter()
            .filter(|l| l.contains("meshcap_tc_stub"))
            .count(),
        1
    );

    second.get().remove(&r).expect("remove");
    second.get().remove(&r).expect("remove again (idempotent)");
    assert!(
        !captured_inbound(&node, &pod),
        "a removed pod is not captured"
    );
    assert!(second.get().pinned_pods().is_empty());
    let pods = Pins::new(&dir).pods();
    assert!(
        !pods.exists() || std::fs::read_dir(&pods).expect("pods").count() == 0,
        "the pod's pins are gone"
    );
    // meshcap's qdisc went with its filter; the shared one stays with the other filter.
    assert_eq!(ingress_filters(&pod, "eth0"), Vec::<String>::new());
    assert!(
        !tc(&pod, &["qdisc", "show", "dev", "eth0"]).contains("clsact"),
        "meshcap's own clsact qdisc is removed"
    );
    let left = ingress_filters(&pod, "eth1");
    assert_eq!(left.len(), 1, "{left:?}");
    assert!(left[0].contains("handle 0x7"), "{left:?}");
}

/// Nothing half-applied: when the stub cannot be attached to one interface (another tool
/// holds meshcap's filter priority there with another protocol, which the kernel refuses to
/// share), the ADD fails naming it and leaves nothing: no filter or qdisc on the other
/// interface, no pins, no capture. Once the way is clear, the next ADD captures.
#[test]
fn a_failed_add_leaves_nothing_behind() {
    if !meshcap_tests::ebpf_runs_here() {
        return;
    }
    let (node, pod, policy, r) = serving_pod();
    tc(&pod, &["qdisc", "add", "dev", "eth1", "clsact"]);
    let blocker = [
        "dev",
        "eth1",
        "ingress",
        "pref",
        "49153",
        "protocol",
        "ip",
        "handle",
        "7",
        "bpf",
        "bytecode",
        "1,6 0 0 0",
    ];
    tc(&pod, &[&["filter", "add"][..], &blocker[..]].concat());

    let backend = EbpfUnderTest::new(&node.cgroup).expect("backend");
    let err = backend
        .get()
        .add(&r, &policy.clone().into())
        .expect_err("the stub cannot go on eth1");
    assert!(err.to_string().contains("eth1"), "{err}");
    assert_eq!(ingress_filters(&pod, "eth0"), Vec::<String>::new());
    assert!(
        !tc(&pod, &["qdisc", "show", "dev", "eth0"]).contains("clsact"),
        "the qdisc meshcap added on eth0 is gone again"
    );
    assert!(backend.get().pinned_pods().is_empty());
    let pods = backend.get().config().pins().pods();
    assert_eq!(
        std::fs::read_dir(&pods).expect("pods").count(),
        0,
        "no pins of the pod are left"
    );
    assert!(backend.get().check(&r, &policy.clone().into()).is_err());
    assert!(!captured(&node, &pod), "a failed ADD captures nothing");

    tc(
        &pod,
        &[&["filter", "del"][..], &blocker[..blocker.len() - 2]].concat(),
    );
    backend
        .get()
        .add(&r, &policy.clone().into())
        .expect("add once the way is clear");
    backend
        .get()
        .check(&r, &policy.clone().into())
        .expect("check");
    assert!(captured(&node, &pod) && captured_inbound(&node, &pod));
    backend.get().remove(&r).expect("remove");
}

/// A full map (the node's pod table at its 1,024 entries): the ADD fails naming the limit and
/// leaves nothing (no pins, no list entries, no capture), the pods already captured keep their
/// entries, and once there is room the next ADD captures.
#[test]
fn a_full_pod_table_fails_the_add_whole() {
    if !meshcap_tests::ebpf_runs_here() {
        return;
    }
    let (node, pod, policy, r) = serving_pod();
    let backend = EbpfUnderTest::new(&node.cgroup).expect("backend");
    let pins = backend.get().config().pins();
    let open = || {
        let data = MapData::from_pin(pins.map(maps::PODS)).expect("pinned MESHCAP_PODS");
        HashMap::<_, u64, PodConfig>::try_from(Map::HashMap(data)).expect("a hash map")
    };
    // Other pods' entries, under cookies no netns has, until the kernel says the table is full.
    let mut table = open();
    let mut filler = Vec::new();
    for cookie in (0..u64::MAX).rev() {
        let config = PodConfig {
            pod_id: u32::MAX,
            ..PodConfig::default()
        };
        if table.insert(cookie, config, 0).is_err() {
            break;
        }
        filler.push(cookie);
    }
    assert_eq!(filler.len(), 1_024, "the table holds 1,024 pods");
    let lists = |name: &str| entries_of::<meshcap_common::PortKey, u8>(&pins, name);
    let ports_before = lists(maps::PORTS);

    let err = backend
        .get()
        .add(&r, &policy.clone().into())
        .expect_err("no room for the pod");
    assert!(err.to_string().contains("at most 1024 pods"), "{err}");
    assert!(backend.get().pinned_pods().is_empty(), "no pins of the pod");
    assert_eq!(lists(maps::PORTS), ports_before, "no list entries left");
    assert_eq!(
        open().keys().flatten().count(),
        1_024,
        "the others keep theirs"
    );
    assert!(!captured(&node, &pod), "a failed ADD captures nothing");

    let mut table = open();
    for cookie in filler {
        table.remove(&cookie).expect("removing a filler entry");
    }
    backend
        .get()
        .add(&r, &policy.clone().into())
        .expect("add once there is room");
    backend
        .get()
        .check(&r, &policy.clone().into())
        .expect("check");
    assert!(captured(&node, &pod));
    backend.get().remove(&r).expect("remove");
}

/// Entries in the pinned hash `name`.
fn entries_of<K: aya::Pod, V: aya::Pod>(pins: &Pins, name: &str) -> usize {
    let data = MapData::from_pin(pins.map(name)).expect("pinned map");
    let map: HashMap<_, K, V> = HashMap::try_from(Map::HashMap(data)).expect("a hash map");
    map.keys().flatten().count()
}

/// A pod captured with TCX links (where the kernel has TCX), then an agent restarted with the
/// default (netlink TC): it adopts the TCX records as they are (no second attachment, no
/// filter), CHECKs and DELs them.
#[test]
fn pins_survive_the_agent_and_a_default_restart_adopts_tcx_ones() {
    if !meshcap_tests::ebpf_runs_here() {
        return;
    }
    let (node, pod, policy, r) = serving_pod();
    let tcx = tcx_where_supported();

    let first = EbpfUnderTest::with_tc_attach(&node.cgroup, tcx).expect("backend");
    first.get().add(&r, &policy.clone().into()).expect("add");
    first
        .get()
        .add(&r, &policy.clone().into())
        .expect("add again (idempotent)");
    first
        .get()
        .check(&r, &policy.clone().into())
        .expect("check");
    // The agent goes away: nothing it attached may go with it.
    let dir = first.leave();
    assert!(captured(&node, &pod), "capture must outlive the agent");

    let second = EbpfUnderTest::at(&node.cgroup, &dir).expect("restarted backend");
    assert_eq!(second.get().config().tc_attach, TcAttach::Netlink);
    for (program, count) in second.get().attachments().expect("query") {
        assert_eq!(count, 1, "{program} attached {count} times after a restart");
    }
    second
        .get()
        .check(&r, &policy.clone().into())
        .expect("check after restart");
    second
        .get()
        .add(&r, &policy.clone().into())
        .expect("add after restart");
    second
        .get()
        .check(&r, &policy.clone().into())
        .expect("check after the second add");
    let listed = second.get().pinned_pods();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].name, r.name);
    assert_eq!(listed[0].interfaces.len(), 2, "{listed:?}");
    if tcx == TcAttach::Tcx {
        for dev in ["eth0", "eth1"] {
            assert!(
                Pins::new(&dir)
                    .pod(listed[0].netns_cookie)
                    .tc(dev)
                    .path()
                    .is_file(),
                "{dev}: the TCX link's pin is kept, not replaced"
            );
            assert!(
                !ingress_filters(&pod, dev)
                    .iter()
                    .any(|l| l.contains("meshcap_tc_stub")),
                "{dev}: a TCX pod got a netlink filter too"
            );
        }
    }

    second.get().remove(&r).expect("remove");
    second.get().remove(&r).expect("remove again (idempotent)");
    assert!(!captured(&node, &pod), "a removed pod is not captured");
    assert!(
        !captured_inbound(&node, &pod),
        "a removed pod's inbound is not captured"
    );
    assert!(second.get().pinned_pods().is_empty());
    assert!(second.get().check(&r, &policy.clone().into()).is_err());
}

#[test]
fn identical_loopback_tuples_in_two_pods_do_not_cross() {
    require_root();
    if !meshcap_tests::ebpf_runs_here() {
        return;
    }
    let mut node = Node::new().expect("node");
    let backend = EbpfUnderTest::new(&node.cgroup).expect("backend");
    let mut pods = Vec::new();
    for _ in 0..2 {
        let mut pod = node.add_pod(false).expect("pod");
        pod.start_servers(&node, PROXY, false).expect("servers");
        backend
            .get()
            .add(
                &pod.pod_ref(),
                &default_policy("twin", pod.ips(false)).into(),
            )
            .expect("add");
        pods.push(pod);
    }
    // Both proxies connect from 127.0.0.1:40000; after the redirect both connections are
    // 127.0.0.1:40000 -> 127.0.0.1:15006, each in its own netns, at the same time.
    let targets = ["127.0.0.6:15002", "127.0.0.7:15003"];
    let reports: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = pods
            .iter()
            .zip(targets)
            .map(|(pod, target)| {
                let at = pod.at(&node, PROXY, PROXY);
                s.spawn(move || {
                    dial(at, &format!("tcp:{target}"), Some("127.0.0.1:40000"))
                        .expect("dial")
                        .expect("an answer")
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("dial thread"))
            .collect()
    });
    for (report, target) in reports.iter().zip(targets) {
        assert_eq!(report.listener, 15006, "{report:?}");
        assert_eq!(report.peer.to_string(), "127.0.0.1:40000", "{report:?}");
        assert_eq!(
            report.original_dst.map(|a| a.to_string()).as_deref(),
            Some(target),
            "{report:?}"
        );
    }
    for pod in &pods {
        backend.get().remove(&pod.pod_ref()).expect("remove");
    }
}

/// Entries in the pinned LRU hash `name` under the layout `dir`.
fn entries<K: aya::Pod>(dir: &Path, name: &str) -> usize {
    let data = MapData::from_pin(Pins::new(dir).map(name)).expect("pinned map");
    let map: HashMap<_, K, OrigDst> =
        HashMap::try_from(Map::LruHashMap(data)).expect("an LRU hash map");
    map.keys().flatten().count()
}

/// Slots of the pinned `MESHCAP_DIALING` under the layout `dir` that hold a socket's original
/// destination.
fn dialing(dir: &Path) -> usize {
    let data = MapData::from_pin(Pins::new(dir).map(maps::DIALING)).expect("pinned map");
    let slots: Array<_, Dialing> = Array::try_from(Map::Array(data)).expect("an array");
    slots
        .iter()
        .flatten()
        .filter(|slot| slot.cookie != 0)
        .count()
}

#[test]
fn closed_captured_connections_leave_no_entries_behind() {
    require_root();
    if !meshcap_tests::ebpf_runs_here() {
        return;
    }
    let mut node = Node::new().expect("node");
    let dir = EbpfUnderTest::unique_dir();
    let backend = EbpfUnderTest::at(&node.cgroup, &dir).expect("backend");
    let mut pod = node.add_pod(false).expect("pod");
    pod.start_servers(&node, PROXY, false).expect("servers");
    backend
        .get()
        .add(
            &pod.pod_ref(),
            &default_policy("flows", pod.ips(false)).into(),
        )
        .expect("add");
    let service = format!("{}:80", pod.peer_v4());
    let dials = [
        (pod.at(&node, APP_UID, APP_UID), service.as_str(), 15001),
        (pod.at(&node, PROXY, PROXY), "127.0.0.6:15002", 15006),
    ];
    for _ in 0..3 {
        for (at, target, listener) in &dials {
            let report = dial(*at, &format!("tcp:{target}"), None)
                .expect("dial")
                .expect("an answer");
            assert_eq!(report.listener, *listener, "{report:?}");
            assert_eq!(
                report.original_dst.map(|a| a.to_string()).as_deref(),
                Some(*target),
                "{report:?}"
            );
        }
    }
    // The proxy's end closes after the client's (the stand-in closes when the client has):
    // wait for it, boundedly.
    let mut left = usize::MAX;
    for _ in 0..1000 {
        left = entries::<FlowKey>(&dir, maps::FLOWS);
        if left == 0 {
            break;
        }
        thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(
        left, 0,
        "MESHCAP_FLOWS entries left after every connection closed"
    );
    assert_eq!(
        entries::<u64>(&dir, maps::CONNECTING),
        0,
        "MESHCAP_CONNECTING entries left after every connection was established"
    );
    assert_eq!(
        dialing(&dir),
        0,
        "MESHCAP_DIALING slots still held after every connection was established"
    );
    backend.get().remove(&pod.pod_ref()).expect("remove");
}

/// Whether a connection accepted on the proxy's outbound port 15001 in `pod` still has a full
/// socket: the listener aside, a row of `/proc/net/tcp` without the time-wait timer (`03`,
/// which a full socket's close turns into a time-wait one, in `FIN_WAIT2` or `TIME_WAIT`).
fn proxy_end_open(pod: &Pod) -> bool {
    pod.netns
        .tcp_sockets()
        .expect("the pod's sockets")
        .iter()
        .any(|s| {
            s.local_port == 15001
                && s.state != TcpSocket::LISTEN
                && s.timer != TcpSocket::TIME_WAIT_TIMER
        })
}

/// The app's socket reports the address it dialled for as long as it lives, as under Istio's
/// NAT: also after the proxy closed its end for good (a short connection whose app asks late).
/// IPv4 and IPv6.
#[test]
fn the_app_sees_its_dialled_peer_after_the_proxy_closed() {
    require_root();
    if !meshcap_tests::ebpf_runs_here() {
        return;
    }
    let mut node = Node::new().expect("node");
    let dir = EbpfUnderTest::unique_dir();
    let backend = EbpfUnderTest::at(&node.cgroup, &dir).expect("backend");
    let mut pod = node.add_pod(true).expect("pod");
    pod.start_servers(&node, PROXY, false).expect("servers");
    backend
        .get()
        .add(
            &pod.pod_ref(),
            &default_policy("peer", pod.ips(true)).into(),
        )
        .expect("add");
    for target in [
        format!("{}:80", pod.peer_v4()),
        format!("[{}]:80", pod.peer_v6()),
    ] {
        let report = meshcap_tests::dial_after_close(
            pod.at(&node, APP_UID, APP_UID),
            &format!("tcp:{target}"),
            || {
                // The stand-in closed its end first: wait, boundedly, until it is closed for
                // good (no full socket left: a time-wait one at most), where an entry kept for
                // the proxy's end would be gone.
                for _ in 0..1000 {
                    if !proxy_end_open(&pod) {
                        return;
                    }
                    thread::sleep(Duration::from_millis(10));
                }
                panic!("the proxy's end of {target} never closed");
            },
        )
        .expect("dial");
        assert_eq!(report.listener, 15001, "{report:?}");
        assert_eq!(
            report.app_peer.map(|a| a.to_string()),
            Some(target.clone()),
            "{report:?}"
        );
    }
    backend.get().remove(&pod.pod_ref()).expect("remove");
}

/// A connection the policy lets through reaches the app even when an earlier connection with
/// the same 4-tuple was captured: the client dials the pod's 8080 from one port, captured;
/// the pod is updated to exclude 8080 and the client dials again from the same port. Before
/// Linux 6.5 the first SYN was handed to the socket lookup under that 4-tuple (the proxy's
/// `SO_REUSEPORT` listener), and the entry outlives the connection: the classifier must drop
/// it when it lets the second SYN through, or the socket lookup sends it to the proxy.
#[test]
fn a_connection_let_through_reaches_the_app_after_its_4_tuple_was_captured() {
    require_root();
    if !meshcap_tests::ebpf_runs_here() {
        return;
    }
    let (node, pod, mut policy, r) = serving_pod();
    let backend = EbpfUnderTest::new(&node.cgroup).expect("eBPF backend");
    backend.get().add(&r, &policy.clone().into()).expect("add");
    let target = format!("tcp:{}:8080", pod.v4());
    let from = format!("{}:41234", pod.peer_v4());
    let first = dial(node.client(), &target, Some(&from))
        .expect("dial")
        .expect("an answer");
    assert_eq!(
        (first.server.as_str(), first.listener),
        ("envoy", 15006),
        "captured first: {first:?}"
    );
    policy.exclude_inbound_ports.push(8080);
    backend
        .get()
        .add(&r, &policy.clone().into())
        .expect("update");
    let second = dial(node.client(), &target, Some(&from))
        .expect("dial")
        .expect("an answer");
    assert_eq!(
        (second.server.as_str(), second.listener),
        ("app", 8080),
        "let through after the update: {second:?}"
    );
    backend.get().remove(&r).expect("remove");
}
