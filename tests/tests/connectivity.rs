//! `meshcap-agent connectivity-test` (issue #45): its workload run for real, and its
//! orchestration against the test API server.
//!
//! The workload: `meshcap-agent probe-pod` processes (stand-in proxy as uid 1337, server, app)
//! in dual-stack pods that a real agent captured, on every backend that runs here, judged by
//! the same code that judges a cluster's pod logs: every check ok where the capture is in
//! place, and the sidecar checks FAIL, naming why, for a pod of Istio's shape that was never
//! captured.
//!
//! The orchestration: the test API server stores what the command creates and runs nothing,
//! so every pod stays unscheduled: the run must end at its deadline with each check FAILed as
//! not scheduled, after creating the namespace and the servers as `plan` says (manifests valid
//! for Kubernetes), removing a killed run's namespace by its label first, and deleting its own
//! namespace at the end unless `--keep`; all with only the permissions docs/install.md lists.
//! With the test playing kubelet (addresses, statuses and logs), the rounds carry each pod's
//! address to the next, and the logs are read and judged per node.
use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Command,
};

use meshcap_agent::connectivity::{
    plan::{self, MANAGED_BY, SERVER_PORT, SIDECAR_PORT},
    probe::Dialled,
    report::{self, Addresses, Check, NodeResults, Outcome, judge},
};
use meshcap_tests::{
    APP_UID, PROXY_UID, Placement, Proc,
    agent::{Agent, Backend, binaries},
    apiserver::{AGENT_POD, ApiServer, NODE},
    ebpf_runs_here,
    fixtures::{ManifestDir, plain_pod, sidecar_pod, write_manifest},
    kubelet::{Sandbox, cni, config_ips},
    require_root,
    wired::Wired,
};
use serde_json::{Value, json};

/// The server's address in every [`Wired`] pair (the upstream's side).
const SERVER: &str = "10.0.0.1";
/// The pod's address in every [`Wired`] pair.
const POD: &str = "10.0.0.2";
/// The server's address of the second family: the pairs are dual-stack.
const SERVER6: &str = "fd00::1";
/// The pod's address of the second family.
const POD6: &str = "fd00::2";
/// How long an app keeps dialling what does not answer (a bound, not an assertion).
const DIAL_SECONDS: &str = "3";

fn agent_binary() -> PathBuf {
    binaries().join("meshcap-agent")
}

fn server_addrs() -> Addresses {
    Addresses {
        first: format!("{SERVER}:{SERVER_PORT}").parse().expect("address"),
        second: Some(
            format!("[{SERVER6}]:{SERVER_PORT}")
                .parse()
                .expect("address"),
        ),
    }
}

fn sidecar_addrs() -> Addresses {
    Addresses {
        first: format!("{POD}:{SIDECAR_PORT}").parse().expect("address"),
        second: Some(format!("[{POD6}]:{SIDECAR_PORT}").parse().expect("address")),
    }
}

/// `probe-pod serve` at `at`, ready.
fn serve(at: Placement<'_>, role: &str, listen: &[String]) -> Proc {
    let mut args = vec!["probe-pod", "serve", "--role", role];
    for l in listen {
        args.extend(["--listen", l.as_str()]);
    }
    let mut proc = Proc::spawn(at, &agent_binary(), &args).expect("probe-pod serve");
    assert_eq!(proc.wait_line().expect("ready line"), "ready", "{role}");
    proc
}

/// `probe-pod dial` at `at`: what it printed.
fn dial(at: Placement<'_>, targets: &[(&str, SocketAddr)]) -> Vec<Dialled> {
    dial_both(at, targets, &[])
}

/// `probe-pod dial` at `at` with TCP `targets` and `--udp` ones: what it printed.
fn dial_both(
    at: Placement<'_>,
    targets: &[(&str, SocketAddr)],
    udp: &[(&str, SocketAddr)],
) -> Vec<Dialled> {
    let targets: Vec<String> = targets.iter().map(|(n, a)| format!("{n}={a}")).collect();
    let udp: Vec<String> = udp.iter().map(|(n, a)| format!("{n}={a}")).collect();
    let mut args = vec!["probe-pod", "dial", "--deadline-seconds", DIAL_SECONDS];
    args.extend(targets.iter().map(String::as_str));
    for target in &udp {
        args.extend(["--udp", target.as_str()]);
    }
    let out = Proc::spawn(at, &agent_binary(), &args)
        .expect("probe-pod dial")
        .finish()
        .expect("probe-pod dial exits 0");
    report::results(&out)
}

/// A pod of the agent's wired to its upstream, the server running there, captured by CNI ADD
/// when `captured`.
struct TestPod {
    /// Its sandbox and the plugin's configuration, when captured: DEL on drop.
    captured: Option<(Sandbox, Value)>,
    _server: Proc,
    wired: Wired,
}

impl TestPod {
    fn new(agent: &Agent, name: &str, captured: bool) -> Self {
        let wired = Wired::new(agent);
        wired
            .pod
            .add_address("eth0", &format!("{POD6}/64"))
            .expect("the pod's IPv6 address");
        wired
            .upstream
            .add_address("eth0", &format!("{SERVER6}/64"))
            .expect("the upstream's IPv6 address");
        let captured = captured.then(|| {
            let sandbox = Sandbox::new("conn", name, &wired.pod);
            let ips = [POD, POD6].map(|ip| ip.parse().expect("address"));
            let conf = config_ips("1.0.0", &agent.socket, &ips);
            let add = cni("ADD", &sandbox, &conf).expect("ADD");
            assert!(add.success, "ADD {name}: {add:?}");
            (sandbox, conf)
        });
        let upstream = Placement {
            netns: &wired.upstream,
            cgroup: None,
            uid: 0,
            gid: 0,
        };
        let server = server_addrs();
        let listen = [server.first, server.second.expect("dual-stack")].map(|a| a.to_string());
        let server = serve(upstream, "server", &listen);
        Self {
            captured,
            _server: server,
            wired,
        }
    }

    fn upstream(&self) -> Placement<'_> {
        Placement {
            netns: &self.wired.upstream,
            cgroup: None,
            uid: 0,
            gid: 0,
        }
    }

    /// The stand-in proxy in the pod, as Envoy's uid, on 15001 and 15006.
    fn proxy(&self) -> Proc {
        let listen =
            ["0.0.0.0:15001", "[::]:15001", "0.0.0.0:15006", "[::]:15006"].map(str::to_owned);
        serve(self.wired.in_pod(PROXY_UID), "proxy", &listen)
    }

    /// The stand-in proxy with Istio's DNS proxy: also on TCP and UDP `localhost:15053`.
    fn dns_proxy(&self) -> Proc {
        let mut owned = Vec::new();
        for (flag, port) in [("--listen", 15001), ("--listen", 15006)] {
            for addr in ["0.0.0.0", "[::]"] {
                owned.extend([flag.to_owned(), format!("{addr}:{port}")]);
            }
        }
        for flag in ["--listen", "--udp-listen"] {
            for addr in ["127.0.0.1:15053", "[::1]:15053"] {
                owned.extend([flag.to_owned(), addr.to_owned()]);
            }
        }
        let mut args = vec!["probe-pod", "serve", "--role", "proxy"];
        args.extend(owned.iter().map(String::as_str));
        let mut proc =
            Proc::spawn(self.wired.in_pod(PROXY_UID), &agent_binary(), &args).expect("proxy");
        assert_eq!(proc.wait_line().expect("ready line"), "ready", "dns proxy");
        proc
    }
}

impl Drop for TestPod {
    fn drop(&mut self) {
        if let Some((sandbox, conf)) = &self.captured {
            let del = cni("DEL", sandbox, conf).expect("DEL");
            assert!(del.success || std::thread::panicking(), "DEL: {del:?}");
        }
    }
}

/// One node's results as the command gathers them, from pods of `agent`: `sidecar` (of
/// Istio's shape, captured when `captured`), `excluded` (its shape, the server's range
/// excluded), `outside` (no shape) and `dns` (its shape with Istio's DNS capture on when
/// `captured`; else `dns-off`, captured without it). The app of the pod outside the mesh dials the server
/// from its own pod and the sidecar pod from the sidecar's upstream (no pod here reaches
/// another's address; both are outside the mesh).
fn node_results(agent: &Agent, captured: bool) -> NodeResults {
    let (server, sidecar_addrs) = (server_addrs(), sidecar_addrs());
    let (server6, sidecar6) = (
        server.second.expect("dual-stack"),
        sidecar_addrs.second.expect("dual-stack"),
    );
    let sidecar = TestPod::new(agent, "sidecar", captured);
    let excluded = TestPod::new(agent, "excluded", true);
    let outside = TestPod::new(agent, "outside", true);
    let dns = TestPod::new(agent, if captured { "dns" } else { "dns-off" }, true);
    let _proxies = (sidecar.proxy(), excluded.proxy(), dns.dns_proxy());
    let mut outside_app = dial(outside.wired.in_pod(APP_UID), &[("server", server.first)]);
    outside_app.extend(dial(
        sidecar.upstream(),
        &[
            ("sidecar", sidecar_addrs.first),
            ("sidecar-family-2", sidecar6),
        ],
    ));
    let dns_to = SocketAddr::new(server.first.ip(), 53);
    NodeResults {
        server: Some(server),
        sidecar: Some(sidecar_addrs),
        sidecar_app: dial(
            sidecar.wired.in_pod(APP_UID),
            &[("server", server.first), ("server-family-2", server6)],
        ),
        excluded_app: dial(excluded.wired.in_pod(APP_UID), &[("server", server.first)]),
        outside_app,
        dns_app: dial_both(
            dns.wired.in_pod(APP_UID),
            &[("dns-tcp", dns_to)],
            &[("dns-udp", dns_to)],
        ),
    }
}

fn backends() -> Vec<Backend> {
    let mut backends = vec![Backend::Iptables, Backend::Nftables];
    if ebpf_runs_here() {
        backends.push(Backend::Ebpf);
    }
    backends
}

/// The agent's manifests: `sidecar` and `excluded` of Istio's injected shape, `outside` not.
fn manifests() -> ManifestDir {
    let dir = ManifestDir::new();
    let mut sidecar = sidecar_pod("conn", "sidecar", &[]);
    sidecar["spec"]["containers"][1]["env"] =
        json!([{"name": "ISTIO_DUAL_STACK", "value": "true"}]);
    write_manifest(&dir.0, &sidecar);
    let range = format!("{SERVER}/32");
    let excluded = [(
        "traffic.sidecar.istio.io/excludeOutboundIPRanges",
        range.as_str(),
    )];
    write_manifest(&dir.0, &sidecar_pod("conn", "excluded", &excluded));
    write_manifest(&dir.0, &plain_pod("conn", "outside"));
    let mut dns = sidecar_pod("conn", "dns", &[]);
    dns["spec"]["containers"][1]["env"] =
        json!([{"name": "ISTIO_META_DNS_CAPTURE", "value": "true"}]);
    write_manifest(&dir.0, &dns);
    write_manifest(&dir.0, &sidecar_pod("conn", "dns-off", &[]));
    dir
}

#[test]
fn the_workload_passes_where_meshcap_captures_and_fails_where_it_does_not() {
    require_root();
    for backend in backends() {
        let dir = manifests();
        let agent = Agent::start(
            backend,
            &["--pods", "dir", "--pod-dir", dir.0.to_str().expect("utf-8")],
            &[],
        )
        .expect("agent");

        let outcomes = judge(&node_results(&agent, true));
        assert!(
            outcomes.iter().all(|(_, o)| *o == Outcome::Ok),
            "{backend:?}, captured: {outcomes:#?}"
        );

        let outcomes = judge(&node_results(&agent, false));
        let outcome = |check| {
            outcomes
                .iter()
                .find(|(c, _)| *c == check)
                .map(|(_, o)| o.clone())
        };
        let fail = |check| match outcome(check) {
            Some(Outcome::Fail(why)) => why,
            other => panic!("{backend:?}, not captured, {check:?}: {other:?}"),
        };
        assert!(
            fail(Check::Outbound).starts_with("not captured: the server answered on port 8080"),
            "{backend:?}: {outcomes:#?}"
        );
        assert!(
            fail(Check::Inbound).starts_with("nothing answered 10.0.0.2:9080"),
            "{backend:?}: {outcomes:#?}"
        );
        assert!(
            fail(Check::OutboundSecond)
                .starts_with("not captured: the server answered on port 8080"),
            "{backend:?}: {outcomes:#?}"
        );
        assert!(
            fail(Check::InboundSecond).starts_with("nothing answered [fd00::2]:9080"),
            "{backend:?}: {outcomes:#?}"
        );
        assert_eq!(outcome(Check::Excluded), Some(Outcome::Ok), "{backend:?}");
        assert_eq!(outcome(Check::Untouched), Some(Outcome::Ok), "{backend:?}");
        // Captured without DNS capture: port 53 is outbound like any other port.
        assert!(
            fail(Check::Dns).starts_with(
                "TCP: captured to the wrong port: the proxy answered on port 15001 (original \
                 destination 10.0.0.1:53)"
            ),
            "{backend:?}: {outcomes:#?}"
        );
    }
}

/// An operator's identity in the test API server, with exactly the permissions
/// docs/install.md lists for the command: a kubeconfig for it.
fn operator(server: &ApiServer, dir: &Path) -> PathBuf {
    let ns = &server.namespace;
    server.create(json!({"apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": {"name": "operator", "namespace": ns, "uid": "sa-operator"}}));
    server.create(
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
        "metadata": {"name": "meshcap-connectivity-test"},
        "rules": [
            {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "create", "delete"]},
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "get", "list"]},
            {"apiGroups": [""], "resources": ["pods/log", "pods/proxy"], "verbs": ["get"]},
            {"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]},
            {"apiGroups": ["apps"], "resources": ["daemonsets"], "verbs": ["get"]},
        ]}),
    );
    server.create(json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": "meshcap-connectivity-test"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "meshcap-connectivity-test"},
        "subjects": [{"kind": "ServiceAccount", "name": "operator", "namespace": ns}]}));
    let token = server.issue(ns, "operator", None, None);
    server.kubeconfig_with(dir, "operator", &token)
}

/// `meshcap-agent connectivity-test ARGS` with `kubeconfig`: exit code and stdout.
fn connectivity_test(kubeconfig: &Path, args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(agent_binary())
        .arg("connectivity-test")
        .args(args)
        .env("KUBECONFIG", kubeconfig)
        .output()
        .expect("meshcap-agent connectivity-test");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    (out.status.code(), format!("{stdout}{stderr}"))
}

fn managed(object: &Value) -> bool {
    object["metadata"]["labels"][MANAGED_BY.0] == MANAGED_BY.1
}

/// Whether a run created a pod on `node`.
fn objects_on(server: &ApiServer, node: &str) -> bool {
    created(server)
        .iter()
        .any(|o| o["spec"]["nodeName"] == node)
}

/// The objects the runs created (POSTs), in order.
fn created(server: &ApiServer) -> Vec<Value> {
    let writes = server.writes.lock().expect("writes");
    writes
        .iter()
        .filter(|(method, _, _)| method == "POST")
        .map(|(_, _, body)| body.clone())
        .collect()
}

/// kubernetes-validate, strictly, on each object (as the chart's test does).
fn assert_valid(objects: &[Value]) {
    let tools = std::env::var_os("MESHCAP_TOOLS_DIR").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/tools"),
        PathBuf::from,
    );
    let validate = tools.join("venv/bin/kubernetes-validate");
    assert!(
        validate.exists(),
        "{}: run `cargo xtask setup`",
        validate.display()
    );
    let dir = ManifestDir::new();
    let mut files = Vec::new();
    for (i, object) in objects.iter().enumerate() {
        let mut object = object.clone();
        // What the server added.
        object["metadata"]
            .as_object_mut()
            .map(|m| ["uid", "resourceVersion"].map(|k| m.remove(k)));
        let file = dir.0.join(format!("{i}.yaml"));
        std::fs::write(&file, object.to_string()).expect("writing");
        files.push(file);
    }
    for version in ["1.29.0", "1.37.0"] {
        let out = Command::new(&validate)
            .args(["--strict", "--quiet", "-k", version])
            .args(&files)
            .output()
            .expect("kubernetes-validate");
        assert!(
            out.status.success(),
            "Kubernetes {version}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// The check's line for the test API server's agent pod on [`NODE`]: no status (no kubelet
/// runs it), no readiness probe.
fn not_ready_agent() -> String {
    format!(
        "{NODE}  agent ready         FAIL: agent pod {AGENT_POD} is not ready (not scheduled (no \
         status)); /readyz: the pod has no HTTP readiness probe to read"
    )
}

#[test]
fn a_run_where_no_pod_runs_fails_every_check_as_not_scheduled_and_cleans_up() {
    let server = ApiServer::start();
    let dir = ManifestDir::new();
    let kubeconfig = operator(&server, &dir.0);
    // What a killed run left, and a namespace of someone else's.
    for (name, labels) in [
        (
            "meshcap-connectivity-0badc0de",
            json!({MANAGED_BY.0: MANAGED_BY.1}),
        ),
        ("shop", json!({})),
    ] {
        server.apply_namespace(json!({"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": name, "labels": labels}}));
    }

    let (code, out) = connectivity_test(&kubeconfig, &["--timeout", "2", "--keep"]);
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains("removed namespace meshcap-connectivity-0badc0de"),
        "{out}"
    );
    for check in Check::PODS {
        let line = format!(
            "{NODE}  {:18}  FAIL: pod server-0 is not running: not scheduled (no status)",
            check.title()
        );
        assert!(out.contains(&line), "{line:?} in:\n{out}");
    }
    assert!(out.contains(&not_ready_agent()), "{out}");
    assert!(
        out.contains(&format!(
            "{NODE}: agent pod {AGENT_POD}, backend unknown (the pod declares no port named \
             metrics), kernel unknown"
        )),
        "{out}"
    );
    assert!(
        out.contains("FAILED: 0 ok, 8 failed, 3 not checked"),
        "{out}"
    );

    let objects = created(&server);
    let [namespace, pod] = objects.as_slice() else {
        panic!("a namespace and the server pod: {objects:#?}");
    };
    let name = namespace["metadata"]["name"].as_str().expect("name");
    assert!(
        name.starts_with(plan::NAMESPACE_PREFIX) && name.len() == plan::NAMESPACE_PREFIX.len() + 8
    );
    assert!(managed(namespace) && managed(pod), "{objects:#?}");
    assert_eq!(pod["metadata"]["namespace"], name);
    assert_eq!(pod["metadata"]["name"], "server-0");
    assert_eq!(pod["spec"]["nodeName"], NODE);
    // The image of meshcap's DaemonSet.
    let image = server.daemon_set()["spec"]["template"]["spec"]["containers"][0]["image"].clone();
    assert_eq!(pod["spec"]["containers"][0]["image"], image);
    assert_valid(&objects);
    let namespaces: Vec<String> = server
        .namespaces
        .lock()
        .expect("namespaces")
        .iter()
        .map(|n| {
            n["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
        .collect();
    assert!(
        namespaces.contains(&name.to_owned()),
        "--keep keeps it: {namespaces:?}"
    );
    assert!(namespaces.contains(&"shop".to_owned()), "{namespaces:?}");
    assert!(
        !namespaces
            .iter()
            .any(|n| n == "meshcap-connectivity-0badc0de")
    );

    // Without --keep: the kept namespace goes first (a leftover), the run's own at the end.
    let (code, out) = connectivity_test(&kubeconfig, &["--timeout", "1", "--node", NODE]);
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains(&format!("removed namespace {name}")), "{out}");
    let left: Vec<Value> = server.namespaces.lock().expect("namespaces").clone();
    assert!(!left.iter().any(managed), "{left:#?}");
    assert!(!server.pods.lock().expect("pods").iter().any(managed));
    let refused = server.refused();
    assert!(
        refused.is_empty(),
        "the documented permissions suffice: {refused:?}"
    );
}

#[test]
fn every_pod_of_a_node_is_valid_for_kubernetes() {
    let plan = plan::Plan::new(0x1234_abcd, "ghcr.io/example/meshcap:0.1.0", 60);
    let (server, sidecar) = (server_addrs(), sidecar_addrs());
    assert_valid(&[
        plan.namespace(),
        plan.server(0, NODE),
        plan.sidecar(0, NODE, server),
        plan.excluded(0, NODE, server.first),
        plan.outside(0, NODE, server, sidecar, None),
        plan.dns(0, NODE, server.first),
    ]);
}

/// Two runs beside the stand-in [`kubelet`], which answers as if `uncaptured`'s node did not
/// capture: one over every node, then one with `--node` [`NODE`].
fn every_node_then_one(
    server: &ApiServer,
    uncaptured: &str,
    kubeconfig: &Path,
) -> ((Option<i32>, String), (Option<i32>, String)) {
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| kubelet(server, uncaptured, &stop));
        let every = connectivity_test(kubeconfig, &["--timeout", "60"]);
        let one = connectivity_test(kubeconfig, &["--timeout", "60", "--node", NODE]);
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        (every, one)
    })
}

/// Plays kubelet for the test's pods until `stop`: each new one gets an address of each family
/// (a dual-stack cluster's) and a status (its `app` ended), and its app's log the answers a node gives: the capture in place, except
/// on `uncaptured`'s node, where the sidecar pod's outbound connection reaches the server
/// itself and a pod in ambient mode is not annotated as enrolled. Each answer echoes the target the run wrote into the pod's command, so an address
/// carried wrongly from one round of pods to the next fails a check.
fn kubelet(server: &ApiServer, uncaptured: &str, stop: &std::sync::atomic::AtomicBool) {
    use std::sync::atomic::Ordering;
    let mut next = 1;
    while !stop.load(Ordering::SeqCst) {
        let new: Vec<Value> = server
            .pods
            .lock()
            .expect("pods")
            .iter()
            .filter(|p| managed(p) && p["status"].is_null())
            .cloned()
            .collect();
        for mut pod in new {
            let ip = format!("10.9.0.{next}");
            // A dual-stack cluster's: the second family's address in `podIPs`.
            let ip6 = format!("fd09::{next}");
            next += 1;
            let name = pod["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            let node = pod["spec"]["nodeName"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            let statuses: Vec<Value> = pod["spec"]["containers"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|c| {
                    let state = if c["name"] == "app" {
                        json!({"terminated": {"exitCode": 0}})
                    } else {
                        json!({"running": {}})
                    };
                    json!({"name": c["name"], "image": c["image"], "imageID": "", "ready": true,
                           "restartCount": 0, "state": state})
                })
                .collect();
            let log = app_log(&pod, &ip, node == uncaptured);
            // What the agent does on enrolling a pod in ambient mode (tests/tests/ambient.rs
            // has a real one do it): not on `uncaptured`'s node.
            if pod["metadata"]["labels"]["istio.io/dataplane-mode"] == "ambient"
                && node != uncaptured
            {
                pod["metadata"]["annotations"]["ambient.istio.io/redirection"] = json!("enabled");
            }
            pod["status"] = json!({"phase": "Running", "podIP": ip,
                                   "podIPs": [{"ip": ip}, {"ip": ip6}],
                                   "containerStatuses": statuses});
            let namespace = pod["metadata"]["namespace"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            server
                .pod_logs
                .lock()
                .expect("logs")
                .push((namespace, name, log));
            server.apply_pod(pod);
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// What the `app` of `pod` (at `ip`) prints on a node that captures as Istio would (the
/// sidecar pod's outbound not captured when `uncaptured`).
fn app_log(pod: &Value, ip: &str, uncaptured: bool) -> String {
    let name = pod["metadata"]["name"].as_str().unwrap_or_default();
    let Some(app) = pod["spec"]["containers"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["name"] == "app"))
    else {
        return String::new();
    };
    let mut log = String::from("a line that is not a result\n");
    for arg in app["command"].as_array().into_iter().flatten() {
        let Some((target, to)) = arg.as_str().and_then(|a| a.split_once('=')) else {
            continue;
        };
        let to: SocketAddr = to.parse().expect("a target address");
        let (role, listener, original_dst) = match (name.split('-').next(), target) {
            (Some("sidecar"), _) if !uncaptured => ("proxy", 15001, Some(to)),
            // The kernel keeps no original destination of a datagram.
            (Some("dns"), target) => ("proxy", 15053, (target == "dns-tcp").then_some(to)),
            (Some("outside"), "sidecar" | "sidecar-family-2" | "sidecar-other-node") => {
                ("proxy", 15006, Some(to))
            }
            _ => ("server", to.port(), None),
        };
        let answer = json!({"role": role, "listener": listener, "local": to,
                            "peer": format!("{ip}:40000"), "original_dst": original_dst});
        log += &format!("{}\n", json!({"name": target, "to": to, "answer": answer}));
    }
    log
}

#[test]
fn a_run_where_pods_run_reads_their_logs_and_judges_each_node() {
    let server = ApiServer::start();
    let mut nodes = server.nodes.lock().expect("nodes");
    nodes.push(json!({
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-2", "uid": "node-uid-2"}, "spec": {},
    }));
    nodes.push(json!({
        "apiVersion": "v1", "kind": "Node", "spec": {},
        "metadata": {"name": "windows-1", "uid": "node-uid-3", "labels": {"kubernetes.io/os": "windows"}},
    }));
    drop(nodes);
    let dir = ManifestDir::new();
    let kubeconfig = operator(&server, &dir.0);
    let (every, one) = every_node_then_one(&server, "node-2", &kubeconfig);

    let (code, out) = every;
    assert_eq!(code, Some(1), "{out}");
    for check in Check::PODS {
        let line = format!("{NODE}  {:18}  ok", check.title());
        assert!(out.contains(&line), "{line:?} in:\n{out}");
    }
    assert!(
        out.contains("node-2  sidecar outbound    FAIL: not captured: the server answered on port 8080 (original destination none)"),
        "{out}"
    );
    assert!(
        out.contains("node-2  outbound, family 2  FAIL: not captured: the server answered on port 8080 (original destination none)"),
        "{out}"
    );
    assert!(out.contains(&not_ready_agent()), "{out}");
    assert!(
        out.contains(
            "node-2  agent ready         FAIL: no pod of DaemonSet meshcap-system/meshcap-agent on \
             this node (app.kubernetes.io/name=meshcap-agent)"
        ),
        "{out}"
    );
    assert!(
        out.contains("FAILED: 14 ok, 4 failed, 4 not checked"),
        "{out}"
    );
    // node-2's pod outside the mesh dials node-1's sidecar pod, and the reverse.
    for node in [NODE, "node-2"] {
        let line = format!("{node}  cross-node inbound  ok");
        assert!(out.contains(&line), "{line:?} in:\n{out}");
    }
    let (code, out) = one;
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains("FAILED: 7 ok, 1 failed, 3 not checked"),
        "{out}"
    );
    assert!(
        out.contains(&format!(
            "{NODE}  cross-node inbound  not checked: one node: no pod of another node to dial \
             from"
        )),
        "{out}"
    );
    assert!(!out.contains("node-2"), "{out}");
    assert!(
        !objects_on(&server, "windows-1"),
        "no pod on a node of another system"
    );

    // The second round's pods dial the first round's server, the third's the sidecar pod.
    let objects = created(&server);
    let pod = |name: &str| {
        objects
            .iter()
            .find(|o| o["metadata"]["name"] == name && o["kind"] == "Pod")
            .unwrap_or_else(|| panic!("{name} created"))
    };
    assert_eq!(pod("sidecar-1")["spec"]["nodeName"], "node-2");
    assert_eq!(
        pod("excluded-0")["metadata"]["annotations"]["traffic.sidecar.istio.io/excludeOutboundIPRanges"],
        "10.9.0.1/32",
        "the server of node-1 got the first address"
    );
    assert!(
        pod("outside-0")["spec"]["containers"][0]["command"]
            .to_string()
            .contains("\"server=10.9.0.1:8080\"")
    );
    assert!(
        server
            .namespaces
            .lock()
            .expect("namespaces")
            .iter()
            .all(|n| !managed(n))
    );
    assert_eq!(
        server.refused(),
        Vec::new(),
        "the documented permissions suffice"
    );
}

/// An agent pod of meshcap's DaemonSet on `node`, served by a real agent listening on `http`
/// (`127.0.0.1:PORT`, the pod's address and its readiness and metrics port), ready as kubelet
/// reports it when `ready`.
fn agent_pod(server: &ApiServer, name: &str, node: &str, http: &str, ready: bool) {
    let (ip, port) = http.split_once(':').expect("address:port");
    let port: u16 = port.parse().expect("port");
    let template = server.daemon_set()["spec"]["template"].clone();
    let mut container = template["spec"]["containers"][0].clone();
    container["readinessProbe"] = json!({"httpGet": {"path": "/readyz", "port": port}});
    container["ports"] = json!([{"name": "metrics", "containerPort": port}]);
    let ready = if ready { "True" } else { "False" };
    server.apply_pod(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": server.namespace, "uid": format!("uid-{name}"),
                     "labels": template["metadata"]["labels"]},
        "spec": {"nodeName": node, "hostNetwork": true, "containers": [container]},
        "status": {"phase": "Running", "podIP": ip,
                   "conditions": [{"type": "Ready", "status": ready}],
                   "containerStatuses": [{"name": container["name"], "ready": ready == "True",
                       "restartCount": 0, "image": container["image"], "imageID": "",
                       "state": {"running": {}}}]},
    }));
}

/// An agent pod of the DaemonSet on `node` whose container the runtime refused to create, with
/// the status kubelet gives it: the container waits in `CreateContainerError` with `message`.
fn refused_agent_pod(server: &ApiServer, name: &str, node: &str, message: &str) {
    let template = server.daemon_set()["spec"]["template"].clone();
    let container = &template["spec"]["containers"][0];
    server.apply_pod(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": server.namespace, "uid": format!("uid-{name}"),
                     "labels": template["metadata"]["labels"]},
        "spec": {"nodeName": node, "hostNetwork": true, "containers": [container]},
        "status": {"phase": "Pending", "conditions": [{"type": "Ready", "status": "False"}],
                   "containerStatuses": [{"name": container["name"], "ready": false,
                       "restartCount": 0, "image": container["image"], "imageID": "",
                       "state": {"waiting": {"reason": "CreateContainerError",
                                             "message": message}}}]},
    }));
}

#[test]
fn the_agent_check_reads_each_nodes_agent_through_the_api_server() {
    require_root();
    let server = ApiServer::start();
    {
        let mut nodes = server.nodes.lock().expect("nodes");
        nodes[0]["status"] = json!({"nodeInfo": {"kernelVersion": "6.1.0-test"}});
        for name in ["node-2", "node-3", "node-4"] {
            nodes.push(json!({"apiVersion": "v1", "kind": "Node", "spec": {},
                              "metadata": {"name": name, "uid": format!("uid-{name}")}}));
        }
    }
    let manifests = ManifestDir::new();
    let pod_dir = manifests.0.to_str().expect("utf-8");
    // node-1: an agent that captures; node-2: one whose plugin is not chained yet (no primary
    // CNI configuration), which kubelet's probe reports not ready; node-3: none; node-4: one
    // whose container the runtime refuses, its bpffs not a shared mount (containerd's words).
    let ready = Agent::start(
        Backend::Iptables,
        &["--pods", "dir", "--pod-dir", pod_dir],
        &[],
    )
    .expect("agent");
    let (conf, bin) = (ManifestDir::new(), ManifestDir::new());
    let unready = Agent::start(
        Backend::Nftables,
        &["--pods", "dir", "--pod-dir", pod_dir],
        &[
            ("MESHCAP_INSTALL_CNI", "true"),
            ("MESHCAP_CNI_CONF_DIR", conf.0.to_str().expect("utf-8")),
            ("MESHCAP_CNI_BIN_DIR", bin.0.to_str().expect("utf-8")),
        ],
    )
    .expect("agent");
    agent_pod(&server, AGENT_POD, NODE, &ready.http, true);
    agent_pod(&server, "meshcap-agent-n2", "node-2", &unready.http, false);
    let refusal = "failed to generate container spec: path \"/sys/fs/bpf\" is mounted on \
                   \"/sys/fs/bpf\" but it is not a shared or slave mount";
    refused_agent_pod(&server, "meshcap-agent-n4", "node-4", refusal);

    let dir = ManifestDir::new();
    let kubeconfig = operator(&server, &dir.0);
    let (every, one) = every_node_then_one(&server, "none", &kubeconfig);

    let (code, out) = every;
    assert_eq!(code, Some(1), "{out}");
    let lines = [
        format!("{NODE}: agent pod {AGENT_POD}, backend iptables, kernel 6.1.0-test"),
        "node-2: agent pod meshcap-agent-n2, backend nftables, kernel unknown".to_owned(),
        format!("{NODE}  agent ready         ok"),
        "node-2  agent ready         FAIL: agent pod meshcap-agent-n2 is not ready (Running); \
         /readyz: answered 503: not ready: "
            .to_owned(),
        "node-3  agent ready         FAIL: no pod of DaemonSet meshcap-system/meshcap-agent on \
         this node (app.kubernetes.io/name=meshcap-agent)"
            .to_owned(),
        format!("{NODE}  host prerequisites  ok"),
        "node-2  host prerequisites  ok".to_owned(),
        "node-3  host prerequisites  not checked: no agent pod on the node".to_owned(),
        "node-4  agent ready         FAIL: agent pod meshcap-agent-n4 is not ready (Pending, \
         agent CreateContainerError)"
            .to_owned(),
        format!(
            "node-4  host prerequisites  FAIL: a host path the DaemonSet mounts with \
             HostToContainer propagation is not on a shared or slave mount (`mount \
             --make-rshared /` at boot, before the runtime): CreateContainerError: {refusal} \
             (docs/install.md, Host prerequisites)"
        ),
        "FAILED: 35 ok, 4 failed, 5 not checked".to_owned(),
        format!("{NODE}  ambient enrolled    not checked: ambient mode is off on this node"),
    ];
    for line in lines {
        assert!(out.contains(&line), "{line:?} in:\n{out}");
    }
    assert!(out.contains("meshcap-cni is not in place"), "{out}");
    let (code, out) = one;
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("PASSED: 9 ok, 0 failed, 2 not checked"),
        "{out}"
    );
    assert_eq!(
        server.refused(),
        Vec::new(),
        "the documented permissions suffice"
    );
}

#[test]
fn without_meshcaps_daemon_set_the_agent_check_fails_and_no_image_is_guessed() {
    let server = ApiServer::start();
    let dir = ManifestDir::new();
    let kubeconfig = operator(&server, &dir.0);

    let (code, out) = connectivity_test(&kubeconfig, &["--daemon-set", "nope"]);
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains(
            "DaemonSet meshcap-system/nope is not in the cluster: give --agent-namespace and \
             --daemon-set, or --image"
        ),
        "{out}"
    );
    assert!(created(&server).is_empty(), "nothing created: {out}");

    let args = [
        "--daemon-set",
        "nope",
        "--image",
        "ghcr.io/example/meshcap:0.1.0",
        "--timeout",
        "1",
    ];
    let (code, out) = connectivity_test(&kubeconfig, &args);
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains(&format!(
            "{NODE}  agent ready         FAIL: meshcap's DaemonSet meshcap-system/nope is not in \
             the cluster"
        )),
        "{out}"
    );
    assert_eq!(server.refused(), Vec::new());
}

#[test]
fn on_a_node_in_ambient_mode_a_pod_labelled_for_it_must_be_enrolled() {
    require_root();
    let server = ApiServer::start();
    server
        .nodes
        .lock()
        .expect("nodes")
        .push(json!({"apiVersion": "v1", "kind": "Node",
        "spec": {}, "metadata": {"name": "node-2", "uid": "uid-node-2"}}));
    // A real agent with ambient mode on, behind the agent pods of both nodes.
    let node = meshcap_tests::world::Node::new().expect("node");
    let (sockets, manifests) = (ManifestDir::new(), ManifestDir::new());
    let socket = sockets.0.join("ztunnel.sock");
    let netns = node.netns.path();
    let env = [
        ("MESHCAP_AMBIENT_ENABLED", "true"),
        ("MESHCAP_AMBIENT_IN_KERNEL", "false"),
        ("MESHCAP_ZTUNNEL_SOCKET", socket.to_str().expect("utf-8")),
        ("MESHCAP_NODE_NETNS", netns.to_str().expect("utf-8")),
    ];
    let args = [
        "--pods",
        "dir",
        "--pod-dir",
        manifests.0.to_str().expect("utf-8"),
    ];
    let agent = Agent::start_in(Backend::Iptables, &args, &env, Some(node.cgroup.path()))
        .expect("ambient agent");
    agent_pod(&server, AGENT_POD, NODE, &agent.http, true);
    agent_pod(&server, "meshcap-agent-n2", "node-2", &agent.http, true);

    let dir = ManifestDir::new();
    let kubeconfig = operator(&server, &dir.0);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (code, out) = std::thread::scope(|s| {
        s.spawn(|| kubelet(&server, "node-2", &stop));
        let run = connectivity_test(&kubeconfig, &["--timeout", "15"]);
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        run
    });
    assert_eq!(code, Some(1), "{out}");
    for line in [
        format!("{NODE}  ambient enrolled    ok"),
        // The agent serves no ztunnel here: its metric says so, and the failure names it.
        "node-2  ambient enrolled    FAIL: pod ambient-1 is not enrolled: it has no \
         ambient.istio.io/redirection annotation; no ztunnel is connected to the node's agent \
         (its ztunnel_connected is 0): is ztunnel running on the node?"
            .to_owned(),
    ] {
        assert!(out.contains(&line), "{line:?} in:\n{out}");
    }
    let ambient: Vec<Value> = created(&server)
        .into_iter()
        .filter(|o| o["metadata"]["labels"]["istio.io/dataplane-mode"] == "ambient")
        .collect();
    assert_eq!(
        ambient.len(),
        2,
        "one pod in ambient mode per node: {ambient:#?}"
    );
    assert_valid(&ambient);
    assert_eq!(server.refused(), Vec::new());
}
