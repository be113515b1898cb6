//! A real container runtime runs the CNI chain: a private containerd 1.6 (tests/src/containerd.rs),
//! driven through CRI as kubelet drives it, with a bridge + host-local primary network and
//! meshcap-cni chained last by the agent itself. What containerd does that a stand-in kubelet
//! would not (two DELs, the second with an empty `CNI_NETNS` and no `prevResult`; the pod's
//! `eth0` at index 2 of `prevResult.interfaces`; `CNI_ARGS` in its own order; its own netns
//! files and cgroups) is exercised here, on both backends.
use std::{fs, path::Path};

use meshcap_tests::{
    APP_UID, Netns, PROXY_UID, Placement, Report,
    agent::{Agent, Backend},
    bin,
    containerd::{Containerd, IMAGE},
    cri::{ContainerSpec, Cri, PodMeta},
    fixtures::{ManifestDir, eventually, plain_pod, sidecar_pod, write_manifest},
    require_root, start_server, unique_name,
};

meshcap_tests::test_on_both_backends!(containerd_runs_the_chain_with_meshcap_last);

/// Where the apps dial: a server in the node's network namespace, on the pods' gateway
/// ([`meshcap_tests::containerd::GATEWAY`]).
const PEER: &str = "10.244.0.1:8080";

fn pod(name: &str) -> PodMeta {
    let name = unique_name(name);
    PodMeta {
        namespace: "shop".into(),
        uid: format!("uid-{name}"),
        name,
    }
}

/// Runs an app container in `sandbox` that dials [`PEER`] once, and returns what answered.
fn app_dial(cri: &mut Cri, ctd: &Containerd, sandbox: &str, pod: &PodMeta) -> Report {
    let log_dir = ctd.log_dir.join(&pod.name);
    let dial = bin::dial().display().to_string();
    let container = cri
        .run_container(
            sandbox,
            pod,
            &ctd.cgroup_parent(),
            &log_dir,
            &ContainerSpec {
                name: "app".into(),
                image: IMAGE.into(),
                command: vec!["/meshcap-dial".into(), format!("tcp:{PEER}")],
                mounts: vec![
                    ("/usr".into(), "/usr".into()),
                    (dial, "/meshcap-dial".into()),
                ],
                uid: i64::from(APP_UID),
                log_path: "app.log".into(),
            },
        )
        .unwrap_or_else(|e| panic!("app container: {e:#}\n{}", ctd.log()));
    let mut exit = None;
    eventually("the app container exits", || {
        exit = cri.container_exit(&container).expect("ContainerStatus");
        exit.is_some()
    })
    .expect("app exit");
    assert_eq!(exit, Some(0), "{}", ctd.log());
    // CRI's log format: `<time> stdout F <line>`.
    let log = fs::read_to_string(log_dir.join("app.log")).expect("app log");
    let line = log
        .lines()
        .find_map(|l| l.splitn(4, ' ').nth(3))
        .unwrap_or_else(|| panic!("app printed nothing: {log:?}"));
    serde_json::from_str(line).unwrap_or_else(|e| panic!("app said {line:?}: {e}"))
}

/// The agent's `meshcap_<name>` samples with their labels, from `/metrics`.
fn samples(agent: &Agent, name: &str) -> Vec<String> {
    let (_, metrics) = agent.http_get("/metrics").expect("metrics");
    metrics
        .lines()
        .filter(|l| l.starts_with(&format!("meshcap_{name}")))
        .map(str::to_owned)
        .collect()
}

fn containerd_runs_the_chain_with_meshcap_last(backend: Backend) {
    require_root();
    let mut ctd = Containerd::prepare().expect("containerd's directories");
    let pods = ManifestDir::new();
    let (mesh, plain) = (pod("web"), pod("plain"));
    write_manifest(&pods.0, &sidecar_pod(&mesh.namespace, &mesh.name, &[]));
    write_manifest(&pods.0, &plain_pod(&plain.namespace, &plain.name));
    let (conf, bins) = (
        ctd.conf_dir.display().to_string(),
        ctd.bin_dir.display().to_string(),
    );
    let mut agent = Agent::start_in(
        backend,
        &[
            "--pods",
            "dir",
            "--pod-dir",
            pods.0.to_str().expect("utf-8"),
        ],
        &[
            ("MESHCAP_INSTALL_CNI", "true"),
            ("MESHCAP_CNI_CONF_DIR", &conf),
            ("MESHCAP_CNI_BIN_DIR", &bins),
        ],
        Some(ctd.cgroup.path()),
    )
    .expect("agent");
    eventually(
        "the agent chains meshcap-cni into containerd's conflist",
        || agent.http_get("/readyz").is_ok_and(|(code, _)| code == 200),
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", agent.log()));
    let mut cri = ctd.start().expect("containerd");
    let node = Placement {
        netns: &ctd.node,
        cgroup: None,
        uid: 0,
        gid: 0,
    };
    let _peer = start_server(node, "peer", &["tcp:0.0.0.0:8080"]).expect("peer");

    // A sidecar pod: captured, the app's connection reaches Envoy with its original
    // destination, and the app sees the address it dialled.
    let parent = ctd.cgroup_parent();
    let sandbox = cri
        .run_pod_sandbox(&mesh, &parent, &ctd.log_dir.join(&mesh.name))
        .unwrap_or_else(|e| panic!("{e:#}\n{}\n{}", ctd.log(), agent.log()));
    let netns = cri.sandbox_netns(&sandbox).expect("sandbox netns");
    assert!(
        Path::new(&netns).starts_with(ctd.netns_dir()),
        "the pod's netns is this containerd's own: {netns}"
    );
    let pod_netns = Netns::existing(Path::new(&netns));
    let _envoy = start_server(
        Placement {
            netns: &pod_netns,
            cgroup: Some(&ctd.cgroup),
            uid: PROXY_UID,
            gid: PROXY_UID,
        },
        "envoy",
        &["tcp:0.0.0.0:15001", "tcp:0.0.0.0:15006"],
    )
    .expect("stand-in envoy");
    let report = app_dial(&mut cri, &ctd, &sandbox, &mesh);
    assert_eq!(report.server, "envoy", "{report:?}");
    assert_eq!(
        report.original_dst.map(|a| a.to_string()).as_deref(),
        Some(PEER),
        "{report:?}"
    );
    assert_eq!(
        report.app_peer.map(|a| a.to_string()).as_deref(),
        Some(PEER)
    );
    assert_eq!(
        samples(&agent, "pods_captured"),
        [format!(
            "meshcap_pods_captured{{backend=\"{}\"}} 1",
            backend.name()
        )]
    );

    // A pod without a sidecar starts untouched: its app reaches the peer itself.
    let plain_sandbox = cri
        .run_pod_sandbox(&plain, &parent, &ctd.log_dir.join(&plain.name))
        .unwrap_or_else(|e| panic!("{e:#}\n{}", ctd.log()));
    let report = app_dial(&mut cri, &ctd, &plain_sandbox, &plain);
    assert_eq!(
        (report.server.as_str(), report.original_dst),
        ("peer", None),
        "{report:?}"
    );
    assert!(
        report.peer.ip().to_string().starts_with("10.244.0."),
        "the peer sees the pod's own address: {report:?}"
    );

    // Removal as kubelet does it: StopPodSandbox (DEL with the netns), RemovePodSandbox
    // (containerd's second DEL: empty CNI_NETNS, no prevResult). Both succeed, and nothing is
    // left: no capture, no sandbox, no netns, no address.
    for id in [&sandbox, &plain_sandbox] {
        cri.stop_pod_sandbox(id)
            .unwrap_or_else(|e| panic!("{e:#}\n{}", agent.log()));
        cri.remove_pod_sandbox(id)
            .unwrap_or_else(|e| panic!("{e:#}\n{}", agent.log()));
    }
    // Two DELs per pod, each answered "removed" (idempotent).
    assert_eq!(
        samples(&agent, "cni_requests_total{op=\"del\""),
        ["meshcap_cni_requests_total{op=\"del\",outcome=\"removed\"} 4"],
        "{}",
        agent.log()
    );
    assert!(
        samples(&agent, "cni_errors_total").is_empty(),
        "{:?}\n{}",
        samples(&agent, "cni_errors_total"),
        agent.log()
    );
    assert_eq!(
        samples(&agent, "pods_captured"),
        [format!(
            "meshcap_pods_captured{{backend=\"{}\"}} 0",
            backend.name()
        )]
    );
    assert_eq!(
        agent.ebpf_leftovers().expect("eBPF leftovers"),
        Vec::<String>::new()
    );
    assert_eq!(cri.sandboxes().expect("sandboxes"), Vec::<String>::new());
    assert_eq!(ctd.own_netns(), Vec::<std::path::PathBuf>::new());
    assert_eq!(ctd.allocated_addresses(), Vec::<String>::new());

    // The agent down: containerd reports meshcap's error for a mesh pod and keeps no sandbox;
    // a pod outside the mesh still starts (the plugin decides without the agent).
    agent.kill().expect("kill the agent");
    let later = pod("later");
    write_manifest(&pods.0, &sidecar_pod(&later.namespace, &later.name, &[]));
    let err = cri
        .run_pod_sandbox(&later, &parent, &ctd.log_dir.join(&later.name))
        .expect_err("a mesh pod must not start while the agent is down");
    let err = format!("{err:#}");
    assert!(
        err.contains("meshcap") && err.contains(&later.name),
        "containerd reports meshcap's error: {err}"
    );
    assert_eq!(cri.sandboxes().expect("sandboxes"), Vec::<String>::new());
    let outside = pod("outside");
    write_manifest(&pods.0, &plain_pod(&outside.namespace, &outside.name));
    let started = cri
        .run_pod_sandbox(&outside, &parent, &ctd.log_dir.join(&outside.name))
        .unwrap_or_else(|e| panic!("a pod outside the mesh starts: {e:#}"));
    cri.stop_pod_sandbox(&started).expect("stop");
    cri.remove_pod_sandbox(&started).expect("remove");
    assert_eq!(ctd.own_netns(), Vec::<std::path::PathBuf>::new());
    assert_eq!(ctd.allocated_addresses(), Vec::<String>::new());
}
