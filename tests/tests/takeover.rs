//! Issue 48, item 1 for sidecar pods: a node istio-cni captured, taken over without a restart.
//! A pod Istio injected runs with the rules istio-cni's plugin wrote into its netns (meshcap's
//! renderer, held to Istio's goldens, applied as Istio applies them), the stand-in Envoy and
//! app in it, and a new agent (its pods from the API server, no record of the pod) starts on
//! the node. Each test runs on every backend: on the eBPF one the rules backend serves the
//! adopted pod in front of the kernel programs.
use std::{
    sync::atomic::{AtomicBool, Ordering},
    thread,
    time::Duration,
};

use aya::maps::{HashMap, Map, MapData};
use meshcap_agent::podnet;
use meshcap_common::{PodConfig, flags, maps};
use meshcap_tests::{
    APP_UID, ENVOY_OPTIONS, Held, PROXY_UID, Proc, Report,
    agent::{Agent, Backend},
    apiserver::ApiServer,
    dial,
    fixtures::{eventually, fed_in_netns, sidecar_pod, unique_ip},
    kubelet::{Sandbox, cni, config},
    require_root, start_server_with, unique_name,
    world::{Node, Pod},
};
use serde_json::{Value, json};

meshcap_tests::test_on_every_backend!(
    a_sidecar_pod_istio_cni_captured_is_adopted,
    a_sidecar_pod_whose_rules_istio_writes_differently_now_is_left_and_reported,
);

/// Which rules istio-cni writes where `backend` runs: Istio's native nftables where meshcap
/// runs with `global.nativeNftables`, else its iptables rules.
fn nftables(backend: Backend) -> bool {
    backend == Backend::Nftables
}

/// A throwaway directory for the agent's kubeconfig, removed on drop.
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(unique_name("meshcap-takeover"));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        Self(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Gives `pod` an address of its own among every test's pods (scenario pods' addresses repeat
/// across nodes, and the agent finds a running pod's netns by its address).
fn unique_address(pod: &Pod) -> String {
    let ip = unique_ip();
    pod.netns
        .add_address("eth0", &format!("{ip}/32"))
        .expect("the pod's address");
    ip
}

/// A scenario node with one pod running its stand-in Envoy and app, and the pod's own address
/// ([`unique_address`]).
fn injected_pod_running() -> (Node, Pod, String) {
    let mut node = Node::new().expect("node");
    let mut pod = node.add_pod(false).expect("pod");
    pod.start_servers(&node, PROXY_UID, false)
        .expect("its Envoy and app");
    let ip = unique_address(&pod);
    (node, pod, ip)
}

/// The stand-in Envoy of [`Pod::start_servers`] holding each outbound connection open
/// (`+hold`), as Envoy does a proxied one (the default stand-in answers and closes), and the
/// app: a connection made before a move is exchanged on after it.
fn start_holding_servers(node: &Node, pod: &mut Pod) -> Proc {
    let envoy = start_server_with(
        pod.at(node, PROXY_UID, PROXY_UID),
        "envoy",
        &["tcp:0.0.0.0:15001+hold", "tcp:0.0.0.0:15006"],
        ENVOY_OPTIONS,
    )
    .expect("the stand-in Envoy");
    pod.start_app(node).expect("the app");
    envoy
}

/// Pod `shop/<name>` as the API server has it once it runs: injected, on node-1, at `ip`.
fn running(name: &str, ip: &str, annotations: &[(&str, &str)]) -> Value {
    let mut manifest = sidecar_pod("shop", name, annotations);
    manifest["status"] = json!({"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]});
    manifest
}

/// Writes into `pod`'s netns what istio-cni's plugin writes for `manifest`: the rules meshcap
/// renders for it (held to Istio's goldens), applied as Istio applies them
/// (`iptables-nft-restore --noflush`, or `nft -f` with `global.nativeNftables`).
fn as_istio_cni_wrote(pod: &Pod, manifest: &Value, nftables: bool) {
    use meshcap_policy::{self as policy, Decision, NodeSettings};
    let found = policy::manifest::parse_pod_manifest(&manifest.to_string()).expect("the pod");
    let ips = policy::status_pod_ips(&found);
    let Ok(Decision::Sidecar { policy, .. }) =
        policy::decide(&found, &ips, &Default::default(), &NodeSettings::default())
    else {
        panic!("a sidecar pod");
    };
    let (program, args, text): (&str, &[&str], String) = if nftables {
        ("nft", &["-f", "-"], policy.render_nftables())
    } else {
        ("iptables-nft-restore", &["--noflush"], policy.render().v4)
    };
    fed_in_netns(&pod.netns, program, args, &text);
}

/// What the netns holds of Istio's, as text to compare before and after.
fn istio_state(pod: &Pod, nftables: bool) -> String {
    let (program, args): (&str, &[&str]) = if nftables {
        ("nft", &["list", "ruleset"])
    } else {
        ("iptables-nft-save", &[])
    };
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", pod.netns.name(), program])
        .args(args)
        .output()
        .expect(program);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.starts_with('#'))
        .collect::<Vec<_>>()
        .join("\n")
}

/// An agent with its pods from `api`, as node `node-1`.
fn kube_agent(backend: Backend, node: &Node, api: &ApiServer, scratch: &Scratch) -> Agent {
    kube_agent_with(backend, node, api, scratch, &[])
}

/// [`kube_agent`] with more settings.
fn kube_agent_with(
    backend: Backend,
    node: &Node,
    api: &ApiServer,
    scratch: &Scratch,
    more: &[(&str, &str)],
) -> Agent {
    let kubeconfig = api.kubeconfig(&scratch.0);
    let mut env = vec![
        ("KUBECONFIG", kubeconfig.to_str().expect("utf-8")),
        ("MESHCAP_STARTUP_TAINT", ""),
        ("MESHCAP_VERIFY_INTERVAL_SECONDS", "1"),
    ];
    env.extend_from_slice(more);
    Agent::start_in(
        backend,
        &["--pods", "kube", "--node-name", "node-1"],
        &env,
        Some(node.cgroup.path()),
    )
    .expect("agent")
}

fn answer(report: Option<Report>) -> (String, u16, Option<String>) {
    let report = report.expect("an answer");
    (
        report.server,
        report.listener,
        report.original_dst.map(|a| a.to_string()),
    )
}

/// Where the app's connection to its node's port 80 goes, and where the node's to its 8080.
fn outbound_and_inbound(node: &Node, pod: &Pod) -> [(String, u16, Option<String>); 2] {
    let (peer, ip) = (pod.peer_v4(), pod.v4());
    let app = pod.at(node, APP_UID, APP_UID);
    [
        answer(dial(app, &format!("tcp:{peer}:80"), None).expect("dial")),
        answer(dial(node.client(), &format!("tcp:{ip}:8080"), None).expect("dial")),
    ]
}

/// Envoy's answers to [`outbound_and_inbound`]: captured.
fn to_envoy(pod: &Pod) -> [(String, u16, Option<String>); 2] {
    [
        ("envoy".into(), 15001, Some(format!("{}:80", pod.peer_v4()))),
        ("envoy".into(), 15006, Some(format!("{}:8080", pod.v4()))),
    ]
}

/// The line of `/metrics` counting adoptions with `result`.
fn adoptions(agent: &Agent, result: &str) -> Option<String> {
    let (code, text) = agent.http_get("/metrics").expect("metrics");
    assert_eq!(code, 200, "{text}");
    let prefix = format!("meshcap_sidecar_adoptions_total{{result=\"{result}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix).map(str::to_owned))
}

/// A pod istio-cni captured is recorded as the agent's before it serves a request: `status`
/// lists it (by the rules backend, "adopted from istio-cni"), `explain` says so, the metric
/// counts it, CHECK answers 0, and its traffic reaches Envoy both ways all along; on the eBPF
/// backend it gets no kernel capture while a pod ADDed after is captured by the kernel
/// programs; a rule deleted behind the agent's back is put back; the runtime's DEL takes
/// Istio's rules away.
fn a_sidecar_pod_istio_cni_captured_is_adopted(backend: Backend) {
    require_root();
    let (mut node, pod, ip) = injected_pod_running();
    let manifest = running("web", &ip, &[]);
    as_istio_cni_wrote(&pod, &manifest, nftables(backend));
    assert_eq!(outbound_and_inbound(&node, &pod), to_envoy(&pod), "Istio's");
    let api = ApiServer::start();
    api.apply_pod(manifest);
    let scratch = Scratch::new();
    let agent = kube_agent(backend, &node, &api, &scratch);

    let status = agent.status().expect("status");
    let listed: Vec<_> = status
        .pods
        .iter()
        .filter(|p| p.captured.pod.name == "web")
        .map(|p| (p.captured.backend.clone(), p.captured.summary.clone()))
        .collect();
    let rules = if nftables(backend) {
        "nftables"
    } else {
        "iptables"
    };
    assert_eq!(listed.len(), 1, "{status:?}\n{}", agent.log());
    assert_eq!(listed[0].0, rules, "{listed:?}");
    assert!(listed[0].1.contains("adopted from istio-cni"), "{listed:?}");
    let explained = agent.explain("shop/web");
    assert!(explained.contains("adopted from istio-cni"), "{explained}");
    assert_eq!(adoptions(&agent, "adopted").as_deref(), Some("1"));
    assert!(
        agent
            .log()
            .contains("adopted istio-cni's rules as they are"),
        "{}",
        agent.log()
    );
    let sandbox = Sandbox::new("shop", "web", &pod.netns);
    let conf = config("1.0.0", &agent.socket, &pod.v4().to_string());
    let check = cni("CHECK", &sandbox, &conf).expect("CHECK");
    assert!(check.success, "CHECK: {check:?}\n{}", agent.log());
    assert_eq!(outbound_and_inbound(&node, &pod), to_envoy(&pod), "adopted");

    if backend == Backend::Ebpf {
        // A pod ADDed now goes to the kernel programs; the adopted one has no kernel capture.
        let mut next = node.add_pod(false).expect("a new pod");
        next.start_servers(&node, PROXY_UID, false)
            .expect("its Envoy and app");
        api.apply_pod(running("cart", &unique_address(&next), &[]));
        let next_sandbox = Sandbox::new("shop", "cart", &next.netns);
        let next_conf = config("1.0.0", &agent.socket, &next.v4().to_string());
        let add = cni("ADD", &next_sandbox, &next_conf).expect("ADD");
        assert!(add.success, "ADD: {add:?}\n{}", agent.log());
        let backends: Vec<_> = agent
            .status()
            .expect("status")
            .pods
            .iter()
            .map(|p| (p.captured.pod.name.clone(), p.captured.backend.clone()))
            .collect();
        assert!(
            backends.contains(&("cart".into(), "ebpf".into())),
            "{backends:?}"
        );
        assert!(
            !backends.contains(&("web".into(), "ebpf".into())),
            "{backends:?}"
        );
        assert_eq!(
            outbound_and_inbound(&node, &next),
            to_envoy(&next),
            "new pod"
        );
        assert_eq!(outbound_and_inbound(&node, &pod), to_envoy(&pod), "adopted");
        let del = cni("DEL", &next_sandbox, &next_conf).expect("DEL");
        assert!(del.success, "DEL: {del:?}");
    }

    // A rule deleted behind its back is put back by the verifier (every second here).
    let rule: &[&str] = if nftables(backend) {
        &["nft", "flush", "chain", "inet", "istio-proxy-nat", "output"]
    } else {
        &[
            "iptables-nft",
            "-t",
            "nat",
            "-D",
            "OUTPUT",
            "-j",
            "ISTIO_OUTPUT",
        ]
    };
    let mut args = vec!["netns", "exec", pod.netns.name()];
    args.extend_from_slice(rule);
    meshcap_tests::run("ip", &args).expect("a rule deleted behind the agent's back");
    eventually("the verifier put it back", || {
        outbound_and_inbound(&node, &pod) == to_envoy(&pod)
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", agent.log()));

    let del = cni("DEL", &sandbox, &conf).expect("DEL");
    assert!(del.success, "DEL: {del:?}\n{}", agent.log());
    assert_eq!(
        outbound_and_inbound(&node, &pod)[0].0,
        "peer",
        "after its DEL, direct"
    );
    assert!(
        !agent
            .status()
            .expect("status")
            .pods
            .iter()
            .any(|p| p.captured.pod.name == "web"),
        "nothing listed after DEL"
    );
}

/// A pod whose rules istio-cni wrote for other annotations than it carries now (its
/// `excludeOutboundPorts` changed since its ADD): not the rules Istio writes for it now, so
/// they are left exactly as they are — never rewritten under its running proxy — and reported:
/// not listed, `explain` and a Warning Event say why, the metric counts it; its traffic still
/// reaches Envoy.
fn a_sidecar_pod_whose_rules_istio_writes_differently_now_is_left_and_reported(backend: Backend) {
    require_root();
    let (node, pod, ip) = injected_pod_running();
    let then = running(
        "web",
        &ip,
        &[("traffic.sidecar.istio.io/excludeOutboundPorts", "9090")],
    );
    as_istio_cni_wrote(&pod, &then, nftables(backend));
    let before = istio_state(&pod, nftables(backend));
    let api = ApiServer::start();
    api.apply_pod(running("web", &ip, &[]));
    let scratch = Scratch::new();
    let agent = kube_agent(backend, &node, &api, &scratch);

    assert!(
        !agent
            .status()
            .expect("status")
            .pods
            .iter()
            .any(|p| p.captured.pod.name == "web"),
        "not adopted\n{}",
        agent.log()
    );
    let explained = agent.explain("shop/web");
    assert!(
        explained.contains("istio-cni's capture NOT ADOPTED")
            && explained.contains("not the ones Istio writes for it now"),
        "{explained}"
    );
    assert_eq!(adoptions(&agent, "left").as_deref(), Some("1"));
    eventually("a Warning Event on the pod", || {
        api.events.lock().expect("events").iter().any(|e| {
            e["reason"] == "IstioCaptureNotAdopted"
                && e["regarding"]["name"] == "web"
                && e["type"] == "Warning"
        })
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", agent.log()));
    assert_eq!(
        istio_state(&pod, nftables(backend)),
        before,
        "left as it was"
    );
    assert_eq!(
        outbound_and_inbound(&node, &pod),
        to_envoy(&pod),
        "still Istio's"
    );
}

/// Issue 48, item 3: with `meshcap.takeover.toKernel`, a pod istio-cni captured is adopted and
/// then moved to the kernel programs in place while its app connects all along and the node
/// connects to it: every connection reaches Envoy with its original destination, a connection
/// established through Istio's rules before the agent started keeps working, and afterwards
/// the pod is the eBPF backend's alone (no Istio rule left in its netns) until its DEL.
#[test]
fn an_adopted_sidecar_pod_moves_to_the_kernel_with_no_connection_missed() {
    moves_to_the_kernel(false);
}

/// The same from Istio's native nftables rules (`global.nativeNftables`).
#[test]
fn an_adopted_sidecar_pod_moves_to_the_kernel_from_native_nftables() {
    moves_to_the_kernel(true);
}

/// A pod istio-cni captured with its iptables rules, or its native nftables rules
/// (`nftables`), moved to the kernel programs.
fn moves_to_the_kernel(nftables: bool) {
    require_root();
    if !meshcap_tests::ebpf_runs_here() {
        return;
    }
    let mut node = Node::new().expect("node");
    let mut pod = node.add_pod(false).expect("pod");
    let _envoy = start_holding_servers(&node, &mut pod);
    let ip = unique_address(&pod);
    let manifest = running("web", &ip, &[]);
    as_istio_cni_wrote(&pod, &manifest, nftables);
    let api = ApiServer::start();
    api.apply_pod(manifest);
    let scratch = Scratch::new();
    let peer = format!("{}:80", pod.peer_v4());
    let mut held = Held::connect(pod.at(&node, APP_UID, APP_UID), peer.parse().expect("addr"))
        .expect("a connection through Istio's rules");
    let first = held.first().clone();
    assert_eq!(first.server, "envoy", "{first:?}");

    let done = AtomicBool::new(false);
    let (answers, agent) = thread::scope(|scope| {
        let dials = scope.spawn(|| {
            let mut answers = Vec::new();
            while !done.load(Ordering::Relaxed) {
                answers.push(outbound_and_inbound(&node, &pod));
            }
            answers
        });
        thread::sleep(Duration::from_millis(300));
        let agent = kube_agent_with(
            Backend::Ebpf,
            &node,
            &api,
            &scratch,
            &[
                ("MESHCAP_TAKEOVER_TO_KERNEL", "true"),
                (
                    "MESHCAP_NATIVE_NFTABLES",
                    if nftables { "true" } else { "false" },
                ),
            ],
        );
        thread::sleep(Duration::from_millis(300));
        done.store(true, Ordering::Relaxed);
        (dials.join().expect("the dial loop"), agent)
    });
    let missed: Vec<_> = answers.iter().filter(|a| **a != to_envoy(&pod)).collect();
    assert!(
        missed.is_empty(),
        "{} of {} rounds not captured with their original destination: {missed:?}\n{}",
        missed.len(),
        answers.len(),
        agent.log()
    );
    assert!(answers.len() > 5, "the loop ran: {} rounds", answers.len());
    assert!(
        agent
            .log()
            .contains("moved from Istio's rules to the kernel programs in place"),
        "{}",
        agent.log()
    );
    let listed: Vec<_> = agent
        .status()
        .expect("status")
        .pods
        .iter()
        .filter(|p| p.captured.pod.name == "web")
        .map(|p| p.captured.backend.clone())
        .collect();
    assert_eq!(listed, ["ebpf"], "{}", agent.log());
    let rules = istio_state(&pod, nftables);
    assert!(
        !rules.to_ascii_lowercase().contains("istio"),
        "Istio's rules are gone: {rules}"
    );
    assert_eq!(
        held.exchange("after the move")
            .expect("the established connection"),
        first,
        "the connection made through Istio's rules still reaches its proxy"
    );
    assert_eq!(
        outbound_and_inbound(&node, &pod),
        to_envoy(&pod),
        "in the kernel"
    );

    let sandbox = Sandbox::new("shop", "web", &pod.netns);
    let conf = config("1.0.0", &agent.socket, &pod.v4().to_string());
    let check = cni("CHECK", &sandbox, &conf).expect("CHECK");
    assert!(check.success, "CHECK: {check:?}\n{}", agent.log());

    // Its entry deleted behind meshcap's back and written again by an ADD: the netns still
    // keeps the NAT hooks, so every captured SYN must still go through the socket lookup.
    let pins = agent.ebpf_config().expect("eBPF agent").pins();
    let cookie = podnet::cookie_of(&pod.netns.path()).expect("cookie");
    let mut entries: HashMap<_, u64, PodConfig> = HashMap::try_from(Map::HashMap(
        MapData::from_pin(pins.map(maps::PODS)).expect("pinned MESHCAP_PODS"),
    ))
    .expect("a hash map");
    entries.remove(&cookie).expect("removing the entry");
    let add = cni("ADD", &sandbox, &conf).expect("ADD");
    assert!(add.success, "ADD: {add:?}\n{}", agent.log());
    assert_ne!(
        entries.get(&cookie, 0).expect("the entry").flags & flags::HANDOFF_ALWAYS,
        0,
        "written again with the socket lookup for every SYN"
    );
    assert_eq!(
        outbound_and_inbound(&node, &pod),
        to_envoy(&pod),
        "in the kernel after the repair"
    );
    let del = cni("DEL", &sandbox, &conf).expect("DEL");
    assert!(del.success, "DEL: {del:?}\n{}", agent.log());
    assert_eq!(outbound_and_inbound(&node, &pod)[0].0, "peer", "released");
    assert_eq!(
        agent.ebpf_leftovers().expect("the eBPF backend's pins"),
        Vec::<String>::new()
    );
}
