//! Crash consistency: the agent killed between any two steps of an ADD, a DEL or an update
//! (at the named points of `meshcap_agent::crashpoint`, where the test build's agent kills
//! itself with SIGKILL), on every backend. After each kill:
//!
//! - the plugin's ADD fails with code 11, try again later (kubelet retries), and its DEL
//!   succeeds, wherever the conversation broke;
//! - the next agent start reaches a state where the pod is either fully captured as its policy
//!   says or fully released: the runtime's DEL releases it, an ADD captures it whole, and
//!   nothing is left that nothing refers to (pins, map entries, TC filters, qdiscs, iptables
//!   rules, routes, records, temporary records).
use meshcap_agent::crashpoint;
use meshcap_tests::{
    agent::Backend,
    fixtures::{sidecar_pod, write_manifest},
    one_pod::OnePod,
    require_root,
};

meshcap_tests::test_on_every_backend!(
    an_interrupted_add_leaves_a_pod_that_add_captures_and_del_releases,
    an_interrupted_del_leaves_a_pod_the_next_del_releases,
);

/// The crash points on `backend`'s ADD path, and on its DEL path.
fn points(backend: Backend) -> (&'static [&'static str], &'static [&'static str]) {
    match backend {
        Backend::Ebpf => (
            &[
                crashpoint::EBPF_ADD_PINNED,
                crashpoint::EBPF_ADD_QDISC,
                crashpoint::EBPF_ADD_FILTER,
                crashpoint::EBPF_ADD_ATTACHED,
                crashpoint::EBPF_ADD_LISTS,
                crashpoint::EBPF_ADD_IFACES,
            ],
            &[
                crashpoint::EBPF_REMOVE_ENTRY,
                crashpoint::EBPF_REMOVE_DETACHED,
            ],
        ),
        Backend::Iptables => (
            &[
                crashpoint::IPTABLES_ADD_APPLIED,
                crashpoint::IPTABLES_ADD_RECORD_WRITTEN,
            ],
            &[crashpoint::IPTABLES_REMOVE_REMOVED],
        ),
        Backend::Nftables => (
            &[
                crashpoint::NFTABLES_ADD_APPLIED,
                crashpoint::NFTABLES_ADD_RECORD_WRITTEN,
            ],
            &[crashpoint::NFTABLES_REMOVE_REMOVED],
        ),
    }
}

/// A crash point added to the agent is one these tests kill it at (ambient mode's in
/// tests/tests/ambient.rs).
#[test]
fn every_crash_point_is_exercised() {
    let mut exercised: Vec<&str> = [Backend::Ebpf, Backend::Iptables, Backend::Nftables]
        .into_iter()
        .flat_map(|backend| {
            let (add, del) = points(backend);
            add.iter().chain(del).copied()
        })
        .chain(crashpoint::AMBIENT_ADD)
        .chain(crashpoint::AMBIENT_REMOVE)
        .collect();
    exercised.sort_unstable();
    let mut all = crashpoint::POINTS.to_vec();
    all.sort_unstable();
    assert_eq!(exercised, all);
}

fn an_interrupted_add_leaves_a_pod_that_add_captures_and_del_releases(backend: Backend) {
    require_root();
    for &point in points(backend).0 {
        let mut scene = OnePod::new(backend, Some(point));
        let _servers = scene.wired.servers();
        let add = scene.cni("ADD");
        assert!(
            !add.success,
            "{point}: ADD succeeded though the agent died: {add:?}"
        );
        assert_eq!(
            add.stdout["code"], 11,
            "{point}: an agent gone mid-request is a transient failure: {add:?}"
        );
        scene.restart_after_crash(point);
        if point == crashpoint::EBPF_ADD_LISTS {
            assert_eq!(
                scene
                    .agent
                    .ebpf_leftovers()
                    .expect("eBPF state")
                    .iter()
                    .filter(|l| l.contains("PORTS") || l.contains("CIDRS"))
                    .count(),
                0,
                "{point}: the lists written before the pod entry are swept at start"
            );
        }
        if let Some(dir) = [
            (crashpoint::IPTABLES_ADD_RECORD_WRITTEN, "iptables"),
            (crashpoint::NFTABLES_ADD_RECORD_WRITTEN, "nftables"),
        ]
        .iter()
        .find_map(|(at, dir)| (point == *at).then_some(dir))
        {
            let tmp: Vec<_> = std::fs::read_dir(scene.agent.state_dir().join(dir))
                .expect("records")
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
                .collect();
            assert!(
                tmp.is_empty(),
                "{point}: a temporary record is left: {tmp:?}"
            );
        }
        // The runtime tears the failed sandbox's network down: DEL releases everything.
        let del = scene.cni("DEL");
        assert!(del.success, "{point}: DEL after the restart: {del:?}");
        scene.assert_released(&format!("{point}: after DEL"));
        // kubelet's next attempt captures the pod whole, and DEL releases it again.
        let add = scene.cni("ADD");
        assert!(add.success, "{point}: ADD after the restart: {add:?}");
        scene.assert_captured(&format!("{point}: after ADD"));
        let del = scene.cni("DEL");
        assert!(del.success, "{point}: DEL: {del:?}");
        scene.assert_released(&format!("{point}: after the last DEL"));
    }
}

fn an_interrupted_del_leaves_a_pod_the_next_del_releases(backend: Backend) {
    require_root();
    for &point in points(backend).1 {
        let mut scene = OnePod::new(backend, Some(point));
        let _servers = scene.wired.servers();
        let add = scene.cni("ADD");
        assert!(add.success, "{point}: ADD: {add:?}");
        scene.assert_captured(&format!("{point}: before DEL"));
        let del = scene.cni("DEL");
        assert!(
            del.success,
            "{point}: DEL must succeed when the agent dies mid-request: {del:?}"
        );
        scene.restart_after_crash(point);
        // containerd's second DEL (RemovePodSandbox) finds what is left and removes it.
        let del = scene.cni("DEL");
        assert!(del.success, "{point}: the second DEL: {del:?}");
        scene.assert_released(&format!("{point}: after the second DEL"));
        let add = scene.cni("ADD");
        assert!(add.success, "{point}: ADD after the restart: {add:?}");
        scene.assert_captured(&format!("{point}: after ADD"));
        let del = scene.cni("DEL");
        assert!(del.success, "{point}: DEL: {del:?}");
        scene.assert_released(&format!("{point}: after the last DEL"));
    }
}

/// An update (a new policy for a captured pod) killed after it wrote the new lists and before
/// it swapped the pod entry: the pod keeps its old policy whole, the new lists are swept at
/// start, and the next ADD applies the new policy.
#[test]
fn an_interrupted_update_keeps_the_old_policy_whole() {
    require_root();
    if !meshcap_tests::ebpf_runs_here() {
        return;
    }
    let mut scene = OnePod::new(Backend::Ebpf, None);
    let _servers = scene.wired.servers();
    let add = scene.cni("ADD");
    assert!(add.success, "ADD: {add:?}");
    let before = scene.held();
    write_manifest(
        &scene.dir.0,
        &sidecar_pod(
            "shop",
            "web",
            &[("traffic.sidecar.istio.io/excludeOutboundPorts", "9000,9001")],
        ),
    );
    scene.agent.kill().expect("kill");
    scene
        .agent
        .set_env(crashpoint::ENV, Some(crashpoint::EBPF_ADD_LISTS));
    scene.agent.restart().expect("restart with the crash point");
    let update = scene.cni("ADD");
    assert!(
        !update.success,
        "the update succeeded though the agent died"
    );
    scene.restart_after_crash(crashpoint::EBPF_ADD_LISTS);
    assert_eq!(
        scene.held(),
        before,
        "the old policy's entries, and nothing of the new one"
    );
    assert_eq!(
        scene.wired.app_dial(),
        ("envoy".into(), Some("10.0.0.1:80".into())),
        "still captured"
    );
    let check = scene.cni("CHECK");
    assert_eq!(
        check.stdout["code"], 106,
        "CHECK against the new policy is a mismatch: {check:?}"
    );
    let update = scene.cni("ADD");
    assert!(update.success, "the update, again: {update:?}");
    scene.assert_captured("after the update");
    let del = scene.cni("DEL");
    assert!(del.success, "DEL: {del:?}");
    scene.assert_released("after DEL");
}
