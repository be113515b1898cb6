//! The verifier end to end (issue 34), through the real binaries: an agent verifying every
//! second (`MESHCAP_VERIFY_INTERVAL_SECONDS=1`), a pod captured through the real `meshcap-cni`,
//! and each kind of drift made behind the agent's back — Istio's rules flushed or a jump
//! deleted, the TC filter deleted, a cgroup link detached, the pod's map entry changed, the
//! shared classifier taken out of its slot, an interface added without a stub, an ambient
//! pod's in-pod rules flushed, its stub deleted, its address taken out of the node's probe set,
//! the node's probe rule removed, the probe sets removed with it, ztunnel refusing it. Each is
//! found and put back (waited for on the agent's own count, never on a clock), counted
//! (`meshcap_capture_drift_total`), logged and reported as a Warning Event on the pod through
//! the in-test API server; the pod is captured again and a connection held open through the
//! repair still carries data. Drift that cannot be put back makes the agent not ready, saying
//! why, until it can. With verification off nothing is touched. `meshcap-agent explain` shows
//! the decision, what is installed and what was put back.
use std::{
    net::SocketAddr,
    thread,
    time::{Duration, Instant},
};

use aya::maps::{HashMap, Map, MapData, ProgramArray};
use meshcap_agent::{
    ambient::remove_from_node,
    backend::{
        ebpf::detach_link,
        iptables::{self, FlavourChoice},
    },
    ipset::IpSets,
    podnet,
};
use meshcap_common::{PodConfig, maps, programs};
use meshcap_policy::{
    ambient::HostProbeSnat, hostprobe::PROBE_SET_V4, nftables::hostprobe::NODE_TABLE,
};
use meshcap_tests::{
    APP_UID, Held, Proc,
    agent::{Agent, Backend},
    apiserver::ApiServer,
    bin, dial,
    fixtures::{ManifestDir, ambient_pod, sidecar_pod, write_manifest},
    kubelet::{Sandbox, cni, config},
    require_root, run,
    wired::Wired,
    world::{Node, Pod},
};
use serde_json::json;

meshcap_tests::test_on_every_backend!(drift_of_a_sidecar_capture_is_put_back);

meshcap_tests::test_on_both_backends!(with_verification_off_nothing_is_touched);

/// The tests' verification interval, in seconds.
const EVERY: (&str, &str) = ("MESHCAP_VERIFY_INTERVAL_SECONDS", "1");

/// Waits until `f` holds. The passes run every second; the bound only keeps an agent that never
/// repairs from hanging the test (on a loaded machine or an emulated VM a pass takes longer).
fn wait_for(what: &str, agent: &Agent, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(90);
    while !f() {
        assert!(
            Instant::now() < deadline,
            "{what} never happened\n{}",
            agent.log()
        );
        thread::sleep(Duration::from_millis(100));
    }
}

/// A counter of the agent's metrics (0 when it has no such line yet).
fn metric(agent: &Agent, series: &str) -> u64 {
    let (_, metrics) = agent.http_get("/metrics").expect("metrics");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

/// How many drifts of `kind` the agent counted with `result`.
fn drift(agent: &Agent, kind: &str, result: &str) -> u64 {
    metric(
        agent,
        &format!(r#"meshcap_capture_drift_total{{kind="{kind}",result="{result}"}}"#),
    )
}

/// The kinds of drift that are the node's, not one pod's: their Events are on the node.
const NODE_WIDE: [&str; 2] = ["cgroup_link", "tc_program"];

/// Whether the API server got a Warning Event `reason` whose note names `kind`, on pod `name`
/// (on the node `node-1` for node-wide drift).
fn event(api: &ApiServer, name: &str, reason: &str, kind: &str) -> bool {
    let (object, name) = if NODE_WIDE.contains(&kind) {
        ("Node", "node-1")
    } else {
        ("Pod", name)
    };
    api.events.lock().expect("events").iter().any(|e| {
        e["regarding"]["kind"] == object
            && e["regarding"]["name"] == name
            && e["type"] == "Warning"
            && e["reason"] == reason
            && e["note"].as_str().is_some_and(|n| n.contains(kind))
    })
}

/// Runs `args` in `netns`.
fn in_netns(netns: &str, args: &[&str]) {
    let mut all = vec!["netns", "exec", netns];
    all.extend(args);
    run("ip", &all).unwrap_or_else(|e| panic!("{args:?}: {e:#}"));
}

/// A kind of drift: what is done, the kind the agent counts it as, and how.
type Tamper = (&'static str, &'static str, fn(&Agent, &Wired));

/// The drift made to a sidecar capture on `backend` (given the agent and the pod).
fn sidecar_tampers(backend: Backend) -> Vec<Tamper> {
    match backend {
        Backend::Iptables => vec![
            ("the nat table flushed", "rules", |_, wired| {
                in_netns(wired.pod.name(), &["iptables-nft", "-t", "nat", "-F"]);
            }),
            ("a jump from a kernel chain deleted", "rules", |_, wired| {
                in_netns(
                    wired.pod.name(),
                    &[
                        "iptables-nft",
                        "-t",
                        "nat",
                        "-D",
                        "OUTPUT",
                        "-j",
                        "ISTIO_OUTPUT",
                    ],
                );
            }),
        ],
        Backend::Nftables => vec![
            ("the nat table flushed", "rules", |_, wired| {
                in_netns(
                    wired.pod.name(),
                    &["nft", "flush", "table", "inet", "istio-proxy-nat"],
                );
            }),
            (
                "the jump from the output hook flushed",
                "rules",
                |_, wired| {
                    in_netns(
                        wired.pod.name(),
                        &["nft", "flush", "chain", "inet", "istio-proxy-nat", "output"],
                    );
                },
            ),
            ("a chain added to Istio's table", "rules", |_, wired| {
                in_netns(
                    wired.pod.name(),
                    &["nft", "add", "chain", "inet", "istio-proxy-nat", "foreign"],
                );
            }),
        ],
        Backend::Ebpf => vec![
            ("the TC filter deleted", "tc_filter", |_, wired| {
                in_netns(
                    wired.pod.name(),
                    &[
                        "tc", "filter", "del", "dev", "eth0", "ingress", "pref", "49153",
                    ],
                );
            }),
            (
                "the pod's map entry changed: the app's uid as the proxy's",
                "map_entry",
                |agent, wired| {
                    let pins = agent.ebpf_config().expect("eBPF").pins();
                    let data = MapData::from_pin(pins.map(maps::PODS)).expect("MESHCAP_PODS");
                    let mut pods: HashMap<_, u64, PodConfig> =
                        HashMap::try_from(Map::HashMap(data)).expect("a hash map");
                    let cookie = podnet::cookie_of(&wired.pod.path()).expect("cookie");
                    let mut config = pods.get(&cookie, 0).expect("the pod's entry");
                    config.proxy_uid = APP_UID;
                    pods.insert(cookie, config, 0).expect("changing the entry");
                },
            ),
            (
                "connect4's cgroup link detached",
                "cgroup_link",
                |agent, _| {
                    let pins = agent.ebpf_config().expect("eBPF").pins();
                    detach_link(&pins.link(programs::CONNECT4)).expect("detaching the link");
                },
            ),
            (
                "the shared classifier taken out of its slot",
                "tc_program",
                |agent, _| {
                    let pins = agent.ebpf_config().expect("eBPF").pins();
                    let data = MapData::from_pin(pins.map(maps::TC_PROG)).expect("MESHCAP_TC_PROG");
                    let mut slots: ProgramArray<_> =
                        ProgramArray::try_from(Map::ProgramArray(data)).expect("a program array");
                    slots.clear_index(&0).expect("emptying slot 0");
                },
            ),
            (
                "an interface added after the capture",
                "tc_filter",
                |_, wired| {
                    in_netns(
                        wired.pod.name(),
                        &[
                            "ip", "link", "add", "late0", "type", "veth", "peer", "name", "late1",
                        ],
                    );
                },
            ),
        ],
    }
}

fn drift_of_a_sidecar_capture_is_put_back(backend: Backend) {
    require_root();
    let api = ApiServer::start();
    api.apply_pod(sidecar_pod("shop", "web", &[]));
    let dir = ManifestDir::new();
    let kubeconfig = api.kubeconfig(&dir.0);
    let agent = Agent::start(
        backend,
        &["--pods", "kube", "--node-name", "node-1"],
        &[
            ("KUBECONFIG", kubeconfig.to_str().expect("utf-8")),
            ("MESHCAP_STARTUP_TAINT", ""),
            EVERY,
        ],
    )
    .expect("agent");
    let wired = Wired::new(&agent);
    let _servers = wired.servers();
    wait_for("the pod watch syncs", &agent, || {
        agent.http_get("/readyz").is_ok_and(|(code, _)| code == 200)
    });
    let sandbox = Sandbox::new("shop", "web", &wired.pod);
    let conf = config("1.0.0", &agent.socket, "10.0.0.2");
    let add = cni("ADD", &sandbox, &conf).expect("ADD");
    assert!(add.success, "ADD: {add:?}");
    let captured = ("envoy".to_owned(), Some("10.0.0.1:80".to_owned()));
    assert_eq!(wired.app_dial(), captured, "captured");
    let target: SocketAddr = "10.0.0.1:80".parse().expect("address");
    let mut held = Held::connect(wired.in_pod(APP_UID), target).expect("a held connection");
    assert_eq!(
        held.first().server,
        "envoy",
        "the held connection is captured"
    );

    for (what, kind, tamper) in sidecar_tampers(backend) {
        let before = drift(&agent, kind, "repaired");
        tamper(&agent, &wired);
        wait_for(&format!("{what}: put back"), &agent, || {
            drift(&agent, kind, "repaired") > before
        });
        assert_eq!(wired.app_dial(), captured, "{what}: captured again");
        let echoed = held
            .exchange(what)
            .expect("the held connection carries data");
        assert_eq!(
            echoed.server, "envoy",
            "{what}: the held connection survived"
        );
        let check = cni("CHECK", &sandbox, &conf).expect("CHECK");
        assert!(check.success, "{what}: CHECK after the repair: {check:?}");
        wait_for(&format!("{what}: an Event"), &agent, || {
            event(&api, "web", "CaptureDriftRepaired", kind)
        });
    }
    assert!(
        agent.log().contains("capture drift put back"),
        "logged:\n{}",
        agent.log()
    );
    assert_eq!(
        drift(&agent, "rules", "failed") + drift(&agent, "tc_filter", "failed"),
        0
    );
    assert_eq!(agent.http_get("/readyz").expect("readyz").0, 200);
    let explained = agent.explain("shop/web");
    for needle in [
        "pod shop/web: captured for its sidecar",
        "pod annotation sidecar.istio.io/status (set)",
        "verification: every 1 s",
        "put back",
    ] {
        assert!(explained.contains(needle), "{needle:?} in\n{explained}");
    }
    let del = cni("DEL", &sandbox, &conf).expect("DEL");
    assert!(del.success, "DEL: {del:?}");
}

/// A restarted agent's first pass (issue 47): what the verifier last found whole outlives the
/// agent (`<state dir>/iptables-baselines`), so an untouched pod is not read again rule by rule
/// — with nft iptables its netns's nf_tables generation is compared, with legacy iptables the
/// kernel's tables read in process — while a rule deleted while no agent ran is still found and put back.
fn a_restarted_agent_reads_only_what_changed(
    backend: Backend,
    flavour: &[&str],
    unchanged: &str,
    delete: &[&str],
) {
    require_root();
    let dir = ManifestDir::new();
    write_manifest(&dir.0, &sidecar_pod("shop", "web", &[]));
    let mut args = vec!["--pods", "dir", "--pod-dir", dir.0.to_str().expect("utf-8")];
    args.extend_from_slice(flavour);
    let mut agent = Agent::start(backend, &args, &[EVERY]).expect("agent");
    let wired = Wired::new(&agent);
    let _servers = wired.servers();
    let sandbox = Sandbox::new("shop", "web", &wired.pod);
    let conf = config("1.0.0", &agent.socket, "10.0.0.2");
    let add = cni("ADD", &sandbox, &conf).expect("ADD");
    assert!(add.success, "ADD: {add:?}");
    let captured = ("envoy".to_owned(), Some("10.0.0.1:80".to_owned()));
    let baselines = agent
        .state_dir()
        .join(format!("{}-baselines", backend.name()));
    wait_for("a pass found the rules whole", &agent, || {
        std::fs::read_dir(&baselines).is_ok_and(|mut d| d.next().is_some())
    });

    agent.kill().expect("kill");
    agent.restart().expect("restart");
    let explained = agent.explain("shop/web");
    assert!(
        explained.contains(unchanged),
        "{unchanged:?} in\n{explained}"
    );

    agent.kill().expect("kill");
    let mut args = vec!["netns", "exec", wired.pod.name()];
    args.extend_from_slice(delete);
    run("ip", &args).expect("a rule deleted while no agent runs");
    assert_eq!(wired.app_dial().0, "upstream", "no longer captured");
    agent.restart().expect("restart");
    wait_for("the restarted agent put it back", &agent, || {
        drift(&agent, "rules", "repaired") > 0
    });
    assert_eq!(wired.app_dial(), captured, "captured again");
    let del = cni("DEL", &sandbox, &conf).expect("DEL");
    assert!(del.success, "DEL: {del:?}");
    assert!(
        std::fs::read_dir(&baselines).is_ok_and(|mut d| d.next().is_none()),
        "kept only while the pod is recorded"
    );
}

#[test]
fn a_restarted_agent_reads_only_what_changed_with_nft_iptables() {
    a_restarted_agent_reads_only_what_changed(
        Backend::Iptables,
        &["--iptables-flavour", "nft"],
        "nf_tables unchanged since last found whole",
        &[
            "iptables-nft",
            "-t",
            "nat",
            "-D",
            "OUTPUT",
            "-j",
            "ISTIO_OUTPUT",
        ],
    );
}

#[test]
fn a_restarted_agent_reads_only_what_changed_with_legacy_iptables() {
    a_restarted_agent_reads_only_what_changed(
        Backend::Iptables,
        &["--iptables-flavour", "legacy"],
        "tables unchanged since last found whole",
        &[
            "iptables-legacy",
            "-t",
            "nat",
            "-D",
            "OUTPUT",
            "-j",
            "ISTIO_OUTPUT",
        ],
    );
}

#[test]
fn a_restarted_agent_reads_only_what_changed_with_native_nftables() {
    a_restarted_agent_reads_only_what_changed(
        Backend::Nftables,
        &[],
        "nf_tables unchanged since last found so",
        &["nft", "flush", "chain", "inet", "istio-proxy-nat", "output"],
    );
}

/// A pod with no baseline of its own (none kept, or adopted) whose tables read as another
/// pod's did when the same rules were found whole there is whole too: one `iptables-save` per
/// family, not a `-C` per rule. A pod with the same rules whose tables differ is still compared
/// rule by rule, and its drift found. No pass runs (verification off), so what each look
/// compares with is known: `explain` compares the pod at once.
#[test]
fn a_pod_like_one_found_whole_is_not_compared_rule_by_rule() {
    require_root();
    let dir = ManifestDir::new();
    for name in ["web", "api", "db"] {
        write_manifest(&dir.0, &sidecar_pod("shop", name, &[]));
    }
    let agent = Agent::start(
        Backend::Iptables,
        &[
            "--pods",
            "dir",
            "--pod-dir",
            dir.0.to_str().expect("utf-8"),
            "--iptables-flavour",
            "nft",
        ],
        &[("MESHCAP_VERIFY_INTERVAL_SECONDS", "0")],
    )
    .expect("agent");
    let conf = config("1.0.0", &agent.socket, "10.0.0.2");
    let pods: Vec<(Wired, Sandbox)> = ["web", "api", "db"]
        .into_iter()
        .map(|name| {
            let wired = Wired::new(&agent);
            let sandbox = Sandbox::new("shop", name, &wired.pod);
            let add = cni("ADD", &sandbox, &conf).expect("ADD");
            assert!(add.success, "ADD of {name}: {add:?}");
            (wired, sandbox)
        })
        .collect();
    let (what, _, tamper) = sidecar_tampers(Backend::Iptables)[1];
    tamper(&agent, &pods[2].0);
    for (pod, expected) in [
        ("shop/web", "every rule in place (as CHECK compares them)"),
        (
            "shop/api",
            "every rule in place (tables as another pod's were when the same rules were found whole there)",
        ),
        ("shop/db", "DIFFERS"),
    ] {
        let explained = agent.explain(pod);
        assert!(
            explained.contains(expected),
            "{pod}: {expected:?} in\n{explained}"
        );
    }
    let check = cni("CHECK", &pods[2].1, &conf).expect("CHECK");
    assert_eq!(check.stdout["code"], 106, "{what}: {check:?}");
    for (_, sandbox) in &pods {
        let del = cni("DEL", sandbox, &conf).expect("DEL");
        assert!(del.success, "DEL: {del:?}");
    }
}

/// With `meshcap.verifyIntervalSeconds: 0` no pass runs: drift stays until CHECK finds it (and
/// an ADD puts it back), as before the verifier.
fn with_verification_off_nothing_is_touched(backend: Backend) {
    require_root();
    let dir = ManifestDir::new();
    write_manifest(&dir.0, &sidecar_pod("shop", "web", &[]));
    let agent = Agent::start(
        backend,
        &["--pods", "dir", "--pod-dir", dir.0.to_str().expect("utf-8")],
        &[("MESHCAP_VERIFY_INTERVAL_SECONDS", "0")],
    )
    .expect("agent");
    let wired = Wired::new(&agent);
    let _servers = wired.servers();
    let sandbox = Sandbox::new("shop", "web", &wired.pod);
    let conf = config("1.0.0", &agent.socket, "10.0.0.2");
    let add = cni("ADD", &sandbox, &conf).expect("ADD");
    assert!(add.success, "ADD: {add:?}");
    let (what, _, tamper) = sidecar_tampers(backend)[0];
    tamper(&agent, &wired);
    // Three times the interval the other tests verify at.
    thread::sleep(Duration::from_secs(3));
    let check = cni("CHECK", &sandbox, &conf).expect("CHECK");
    assert_eq!(
        check.stdout["code"], 106,
        "{what}: still not in place: {check:?}"
    );
    assert_eq!(metric(&agent, "meshcap_verify_passes_total"), 0);
    // The plugin's requests, by verb and the CNI code the plugin returned (Istio 1.31's
    // istio_cni_plugin_requests_total).
    for series in [
        r#"meshcap_cni_plugin_requests_total{verb="add",code="0"}"#,
        r#"meshcap_cni_plugin_requests_total{verb="check",code="106"}"#,
    ] {
        assert_eq!(metric(&agent, series), 1, "{series}");
    }
    let (_, metrics) = agent.http_get("/metrics").expect("metrics");
    assert!(
        !metrics.contains("meshcap_capture_drift_total{"),
        "{metrics}"
    );
    let explained = agent.explain("shop/web");
    assert!(
        explained.contains("verification: off"),
        "explain says so:\n{explained}"
    );
    let del = cni("DEL", &sandbox, &conf).expect("DEL");
    assert!(del.success, "DEL: {del:?}");
}

/// Ambient mode with Istio's in-pod rules (whichever backend serves sidecar pods, the in-pod
/// rules are the same machinery: the iptables one here).
#[test]
fn drift_of_an_ambient_capture_is_put_back() {
    ambient(Backend::Iptables, false);
}

/// Ambient mode with `global.nativeNftables`: Istio's in-pod nftables rules, and the node's
/// probe sets and rule in table `inet istio-ambient-nat`.
#[test]
fn drift_of_an_ambient_capture_with_native_nftables_is_put_back() {
    ambient(Backend::Nftables, false);
}

/// Ambient mode in the kernel (`ambient.inKernel`), where the eBPF backend runs.
#[test]
fn drift_of_an_ambient_capture_in_the_kernel_is_put_back() {
    if meshcap_tests::ebpf_runs_here() {
        ambient(Backend::Ebpf, true);
    }
}

/// A stand-in ztunnel that has been sent its snapshot (`more`: its extra arguments).
fn ztunnel(node: &Node, socket: &std::path::Path, more: &[&str]) -> Proc {
    let at = meshcap_tests::Placement {
        cgroup: Some(&node.cgroup),
        ..node.client()
    };
    let mut args = vec!["--socket", socket.to_str().expect("utf-8")];
    args.extend_from_slice(more);
    let mut zt = Proc::spawn(at, &bin::ztunnel(), &args).expect("meshcap-ztunnel");
    while zt.wait_line().expect("ztunnel") != "snapshot_sent" {}
    zt
}

/// Who answers the app's connection to its peer on the node: `ztunnel` when captured.
fn outbound(node: &Node, pod: &Pod) -> String {
    let app = pod.at(node, APP_UID, APP_UID);
    dial(app, &format!("tcp:{}:80", pod.peer_v4()), None)
        .expect("dial")
        .expect("an answer")
        .server
}

/// A kind of drift made to an ambient capture: what is done, the kind the agent counts it as,
/// and how.
type AmbientTamper<'a> = (&'static str, &'static str, Box<dyn Fn() + 'a>);

/// `nft ARGS` in the node's netns.
fn node_nft(node: &Node, args: &[&str]) -> anyhow::Result<String> {
    let mut all = vec!["netns", "exec", node.netns.name(), "nft"];
    all.extend_from_slice(args);
    run("ip", &all)
}

/// Takes the pod's addresses out of the node's probe set (the nft one on `backend`
/// nftables).
fn empty_probe_set(node: &Node, backend: Backend) {
    if backend == Backend::Nftables {
        node_nft(node, &["flush", "set", "inet", NODE_TABLE, PROBE_SET_V4])
            .expect("emptying the probe set");
        return;
    }
    node.netns
        .run_in(|| {
            let mut sets = IpSets::open()?;
            for entry in sets.list(PROBE_SET_V4)? {
                sets.delete(PROBE_SET_V4, entry.ip)?;
            }
            Ok(())
        })
        .expect("emptying the probe set");
}

/// The addresses in the node's IPv4 probe set (none when it is not there).
fn probe_addresses(node: &Node, backend: Backend) -> Vec<String> {
    if backend == Backend::Nftables {
        let Ok(out) = node_nft(
            node,
            &["-j", "list", "set", "inet", NODE_TABLE, PROBE_SET_V4],
        ) else {
            return Vec::new();
        };
        let json: serde_json::Value = serde_json::from_str(&out).expect("nft's JSON");
        return json["nftables"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|o| o["set"]["elem"].as_array())
            .flatten()
            .filter_map(|e| e["elem"]["val"].as_str().map(str::to_owned))
            .collect();
    }
    node.netns
        .run_in(|| {
            let Ok(entries) = IpSets::open()?.list(PROBE_SET_V4) else {
                return Ok(Vec::new());
            };
            Ok(entries.into_iter().map(|e| e.ip.to_string()).collect())
        })
        .expect("listing the probe set")
}

/// The node's probe rules: jumps to the probe rule's chain in the node's nat table, either
/// iptables; on `backend` nftables, the rules of table `inet istio-ambient-nat` SNAT-ing to
/// the IPv4 probe set.
fn probe_jumps(node: &Node, backend: Backend) -> usize {
    if backend == Backend::Nftables {
        let rule = format!("ip daddr @{PROBE_SET_V4} counter snat");
        return node_nft(node, &["-s", "list", "table", "inet", NODE_TABLE])
            .map_or(0, |out| out.lines().filter(|l| l.contains(&rule)).count());
    }
    ["iptables-legacy-save", "iptables-nft-save"]
        .iter()
        .filter_map(|save| {
            run(
                "ip",
                &["netns", "exec", node.netns.name(), save, "-t", "nat"],
            )
            .ok()
        })
        .map(|out| {
            out.lines()
                .filter(|l| *l == "-A POSTROUTING -j ISTIO_POSTRT")
                .count()
        })
        .sum()
}

fn ambient(backend: Backend, in_kernel: bool) {
    require_root();
    let mut node = Node::new().expect("node");
    let pod = node.add_pod(false).expect("pod");
    let sockets = ManifestDir::new();
    let socket = sockets.0.join("ztunnel.sock");
    let api = ApiServer::with_configuration("ambient");
    let mut manifest = ambient_pod("shop", "web");
    manifest["spec"]["nodeName"] = json!("node-1");
    api.apply_pod(manifest);
    api.namespaces.lock().expect("namespaces").push(json!({
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": "shop", "labels": {}},
    }));
    let kubeconfig = api.kubeconfig(&sockets.0);
    let agent = Agent::start_in(
        backend,
        &["--pods", "kube", "--node-name", "node-1"],
        &[
            ("KUBECONFIG", kubeconfig.to_str().expect("utf-8")),
            ("MESHCAP_AMBIENT_ENABLED", "true"),
            (
                "MESHCAP_AMBIENT_IN_KERNEL",
                if in_kernel { "true" } else { "false" },
            ),
            ("MESHCAP_ZTUNNEL_SOCKET", socket.to_str().expect("utf-8")),
            (
                "MESHCAP_NODE_NETNS",
                node.netns.path().to_str().expect("utf-8"),
            ),
            ("MESHCAP_STARTUP_TAINT", ""),
            EVERY,
        ],
        Some(node.cgroup.path()),
    )
    .expect("agent");
    let mut zt = ztunnel(&node, &socket, &[]);
    let sandbox = Sandbox::new("shop", "web", &pod.netns);
    let conf = config("1.0.0", &agent.socket, &pod.v4().to_string());
    let add = cni("ADD", &sandbox, &conf).expect("ADD");
    assert!(add.success, "ADD: {add:?}\n{}", agent.log());
    assert!(zt.wait_line().expect("ztunnel").starts_with("add uid-web "));
    assert_eq!(outbound(&node, &pod), "ztunnel", "captured for ztunnel");
    let target: SocketAddr = format!("{}:80", pod.peer_v4()).parse().expect("address");
    let mut held =
        Held::connect(pod.at(&node, APP_UID, APP_UID), target).expect("a held connection");
    assert_eq!(held.first().server, "ztunnel");

    let mut tampers: Vec<AmbientTamper<'_>> = Vec::new();
    if in_kernel {
        let netns = pod.netns.name().to_owned();
        tampers.push((
            "the TC filter on eth0 deleted",
            "tc_filter",
            Box::new(move || {
                in_netns(
                    &netns,
                    &[
                        "tc", "filter", "del", "dev", "eth0", "ingress", "pref", "49153",
                    ],
                );
            }),
        ));
    } else {
        let netns = pod.netns.name().to_owned();
        let flush: &'static [&'static str] = if backend == Backend::Nftables {
            &["nft", "flush", "table", "inet", NODE_TABLE]
        } else {
            &["iptables-nft", "-t", "nat", "-F"]
        };
        tampers.push((
            "the in-pod nat table flushed",
            "rules",
            Box::new(move || in_netns(&netns, flush)),
        ));
        // No table changes with it: the pass after the one that found the tables unchanged
        // must still look.
        let netns = pod.netns.name().to_owned();
        tampers.push((
            "the reply route's rule deleted, the tables untouched",
            "route",
            Box::new(move || {
                in_netns(
                    &netns,
                    &[
                        "ip",
                        "rule",
                        "del",
                        "fwmark",
                        "0x111/0xfff",
                        "lookup",
                        "100",
                    ],
                );
            }),
        ));
    }
    tampers.push((
        "the node's probe set emptied",
        "probe_set",
        Box::new(|| empty_probe_set(&node, backend)),
    ));
    for (what, kind, tamper) in &tampers {
        let before = drift(&agent, kind, "repaired");
        tamper();
        wait_for(&format!("{what}: put back"), &agent, || {
            drift(&agent, kind, "repaired") > before
        });
        assert_eq!(outbound(&node, &pod), "ztunnel", "{what}: captured again");
        let echoed = held
            .exchange(what)
            .expect("the held connection carries data");
        assert_eq!(
            echoed.server, "ztunnel",
            "{what}: the held connection survived"
        );
        wait_for(&format!("{what}: an Event on the pod"), &agent, || {
            event(&api, "web", "CaptureDriftRepaired", kind)
        });
    }
    // The node's probe rule removed, its sets left (a firewall reload, a flush of the nat
    // table): the sets no rule matches are found by their references, and the rule put back.
    // With nftables, Istio's own `DeleteHostRules`: the node table flushed, its sets kept.
    let before = drift(&agent, "probe_set", "repaired");
    if backend == Backend::Nftables {
        node_nft(&node, &["flush", "table", "inet", NODE_TABLE]).expect("flushing the table");
    } else {
        iptables::node::remove(
            Some(&node.netns.path()),
            FlavourChoice::Auto,
            &HostProbeSnat::default().render(true),
        )
        .expect("removing the probe rule");
    }
    wait_for("the probe rule put back", &agent, || {
        drift(&agent, "probe_set", "repaired") > before && probe_jumps(&node, backend) == 1
    });
    assert!(
        probe_addresses(&node, backend).contains(&pod.v4().to_string()),
        "the sets kept the pod's address"
    );

    // The node's probe sets and their rule removed (what an uninstall does, here behind the
    // agent's back; Istio's istio/istio#60471 is the entries lost after a kubelet restart):
    // the sets are created again with one rule, and the pod's address put back in.
    let before = drift(&agent, "probe_set", "repaired");
    remove_from_node(
        Some(&node.netns.path()),
        FlavourChoice::Auto,
        HostProbeSnat::default(),
    )
    .expect("removing the probe sets and their rule");
    wait_for("the probe sets and their rule put back", &agent, || {
        drift(&agent, "probe_set", "repaired") > before
            && probe_addresses(&node, backend).contains(&pod.v4().to_string())
    });
    assert_eq!(probe_jumps(&node, backend), 1, "one probe rule again");
    assert!(
        held.exchange("the probe sets removed").is_ok(),
        "the held connection survived"
    );

    let check = cni("CHECK", &sandbox, &conf).expect("CHECK");
    assert!(check.success, "CHECK after the repairs: {check:?}");
    let explained = agent.explain("shop/web");
    for needle in [
        "pod shop/web: enrolled in ambient mode",
        "pod label istio.io/dataplane-mode=ambient",
        "handed to ztunnel as uid uid-web, acked",
        "in the node's probe set",
        "put back",
    ] {
        assert!(explained.contains(needle), "{needle:?} in\n{explained}");
    }

    if !in_kernel {
        zt = refused_by_ztunnel(&agent, &api, &node, &socket, zt);
    }
    let del = cni("DEL", &sandbox, &conf).expect("DEL");
    assert!(del.success, "DEL: {del:?}");
    assert_eq!(zt.wait_line().expect("ztunnel"), "del uid-web");
}

/// A ztunnel that refuses the pod cannot be made to serve it: the agent is not ready, saying
/// why, until a ztunnel that takes it connects (`zt`, serving the pod, goes first); that one is
/// returned.
fn refused_by_ztunnel(
    agent: &Agent,
    api: &ApiServer,
    node: &Node,
    socket: &std::path::Path,
    zt: Proc,
) -> Proc {
    drop(zt);
    let refusing = ztunnel(node, socket, &["--refuse", "uid-web"]);
    wait_for("the agent is not ready, naming ztunnel", agent, || {
        agent.http_get("/readyz").is_ok_and(|(code, body)| {
            code == 503 && body.contains("ztunnel has not acked uid uid-web")
        })
    });
    assert!(drift(agent, "ztunnel", "failed") > 0);
    wait_for("an Event saying it could not be put back", agent, || {
        event(api, "web", "CaptureDriftNotRepaired", "ztunnel")
    });
    drop(refusing);
    let serving = ztunnel(node, socket, &[]);
    wait_for("ready again once ztunnel serves the pod", agent, || {
        agent.http_get("/readyz").is_ok_and(|(code, _)| code == 200)
    });
    serving
}
