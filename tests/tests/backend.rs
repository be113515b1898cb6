//! The eBPF backend's life cycle on the real kernel: pins survive the agent, a restart adopts
//! them without attaching twice, removal releases the pod, and two pods with identical
//! loopback 4-tuples keep their own original destinations.
use meshcap_agent::backend::PodRef;
use meshcap_tests::{
    dial, require_root,
    scenario::{EbpfUnderTest, default_policy},
    world::{Node, PROXY, Pod},
};

fn pod_ref(pod: &Pod) -> PodRef {
    PodRef {
        namespace: "default".into(),
        name: format!("pod-{}", pod.index),
        container_id: format!("c{}", pod.index),
        netns: pod.netns.path(),
    }
}

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

#[test]
fn pins_survive_the_agent_and_a_restart_adopts_them() {
    require_root();
    let mut node = Node::new().expect("node");
    let mut pod = node.add_pod(false).expect("pod");
    pod.start_servers(&node, PROXY, false).expect("servers");
    let policy = default_policy("web", pod.ips(false));
    let r = pod_ref(&pod);

    let first = EbpfUnderTest::new(&node.cgroup).expect("backend");
    first.get().add(&r, &policy).expect("add");
    first
        .get()
        .add(&r, &policy)
        .expect("add again (idempotent)");
    first.get().check(&r, &policy).expect("check");
    // The agent goes away: nothing it attached may go with it.
    let dir = first.leave();
    assert!(captured(&node, &pod), "capture must outlive the agent");

    let second = EbpfUnderTest::at(&node.cgroup, &dir).expect("restarted backend");
    for (program, count) in second.get().attachments().expect("query") {
        assert_eq!(count, 1, "{program} attached {count} times after a restart");
    }
    second
        .get()
        .check(&r, &policy)
        .expect("check after restart");
    let listed = second.get().list().expect("list");
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].name, r.name);
    assert_eq!(listed[0].interfaces.len(), 2, "{listed:?}");

    second.get().remove(&r).expect("remove");
    second.get().remove(&r).expect("remove again (idempotent)");
    assert!(!captured(&node, &pod), "a removed pod is not captured");
    assert!(second.get().list().expect("list").is_empty());
    assert!(second.get().check(&r, &policy).is_err());
}

#[test]
fn identical_loopback_tuples_in_two_pods_do_not_cross() {
    require_root();
    let mut node = Node::new().expect("node");
    let backend = EbpfUnderTest::new(&node.cgroup).expect("backend");
    let mut pods = Vec::new();
    for _ in 0..2 {
        let mut pod = node.add_pod(false).expect("pod");
        pod.start_servers(&node, PROXY, false).expect("servers");
        backend
            .get()
            .add(&pod_ref(&pod), &default_policy("twin", pod.ips(false)))
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
        backend.get().remove(&pod_ref(pod)).expect("remove");
    }
}
