//! meshcap beside a primary CNI's socket load balancer (Cilium's, with kube-proxy
//! replacement): a `connect4` program assembled by the test (tests/src/socklb.rs) rewrites the
//! service 10.96.0.50:80 into the backend 10.0.0.1:80, on meshcap's cgroup root or on its
//! parent, attached before the agent, after it, or jumping ahead of it. Wherever the kernel can
//! order cgroup programs (the test finds out on a cgroup of its own), Envoy must see the
//! service as the original destination in every order; where it cannot, the agent must say so
//! (status, log) for the order that loses the service, and be right in the others.
use std::{net::SocketAddrV4, sync::Arc};

use meshcap_tests::{
    PROXY_UID, Placement, TestCgroup,
    agent::{Agent, Backend},
    dial,
    fixtures::{ManifestDir, eventually, sidecar_pod, write_manifest},
    kubelet::{Sandbox, cni, config},
    require_root,
    socklb::{self, Hook},
    start_server,
    wired::Wired,
};

const SERVICE: &str = "10.96.0.50:80";
const BACKEND: &str = "10.0.0.1:80";

fn load_lb() -> std::os::fd::OwnedFd {
    socklb::load(
        Hook::Connect4,
        SERVICE.parse::<SocketAddrV4>().expect("service"),
        BACKEND.parse::<SocketAddrV4>().expect("backend"),
    )
    .expect("loading the stand-in socket load balancer")
}

fn kernel_orders() -> bool {
    let scratch = TestCgroup::new("mc-order-probe").expect("scratch cgroup");
    socklb::kernel_orders_cgroup_links(scratch.path()).expect("probing BPF_F_BEFORE")
}

/// An eBPF agent on `root` (a manifest directory source) and a captured pod under it whose
/// Envoy stand-in runs; returns them with the original destination Envoy reads for the app's
/// connection to the service.
struct Captured {
    agent: Agent,
    wired: Wired,
    _servers: (meshcap_tests::Proc, meshcap_tests::Proc),
    _pods: ManifestDir,
}

impl Captured {
    fn start(root: &Arc<TestCgroup>) -> Self {
        Self::start_with(root, sidecar_pod("shop", "web", &[]), false)
    }

    /// [`Self::start`] with `manifest` for the pod, and Envoy's DNS listener (15053) and a
    /// DNS upstream (10.0.0.1:53) when `dns`.
    fn start_with(root: &Arc<TestCgroup>, manifest: serde_json::Value, dns: bool) -> Self {
        let pods = ManifestDir::new();
        let agent = Agent::start_in(
            Backend::Ebpf,
            &[
                "--pods",
                "dir",
                "--pod-dir",
                pods.0.to_str().expect("utf-8"),
            ],
            &[],
            Some(root.path()),
        )
        .expect("agent");
        let wired = Wired::in_cgroup(Some(root.clone()));
        write_manifest(&pods.0, &manifest);
        let add = cni(
            "ADD",
            &Sandbox::new("shop", "web", &wired.pod),
            &config("1.0.0", &agent.socket, "10.0.0.2"),
        )
        .expect("ADD");
        assert!(add.success, "{add:?}");
        let servers = if dns {
            (
                start_server(
                    wired.in_pod(PROXY_UID),
                    "envoy",
                    &[
                        "tcp:0.0.0.0:15001",
                        "tcp:0.0.0.0:15006",
                        // Envoy's DNS proxy listens on loopback, as istio-agent sets it up.
                        "udp:127.0.0.1:15053",
                    ],
                )
                .expect("stand-in envoy"),
                start_server(
                    Placement {
                        netns: &wired.upstream,
                        cgroup: None,
                        uid: 0,
                        gid: 0,
                    },
                    "upstream",
                    &["udp:10.0.0.1:53"],
                )
                .expect("DNS upstream"),
            )
        } else {
            wired.servers()
        };
        Self {
            agent,
            wired,
            _servers: servers,
            _pods: pods,
        }
    }

    /// Who answers the app's connection to the service, and the original destination it read.
    fn dial_service(&self) -> (String, Option<String>) {
        let report = dial(
            self.wired.in_pod(meshcap_tests::APP_UID),
            &format!("tcp:{SERVICE}"),
            None,
        )
        .expect("dial")
        .expect("an answer");
        (report.server, report.original_dst.map(|a| a.to_string()))
    }

    fn warnings(&self) -> Vec<String> {
        self.agent.status().expect("status").warnings
    }

    /// The other programs the agent reports on connect4: (name, before).
    fn others_on_connect4(&self) -> Vec<(String, bool)> {
        self.agent
            .status()
            .expect("status")
            .other_programs
            .into_iter()
            .filter(|o| o.hook == "meshcap_connect4")
            .map(|o| (o.name, o.before))
            .collect()
    }
}

/// The service is what Envoy reads, and the proxy's own connection goes through the balancer.
fn assert_service_kept(pod: &Captured, when: &str) {
    assert_eq!(
        pod.dial_service(),
        ("envoy".to_owned(), Some(SERVICE.to_owned())),
        "{when}: the app's connection reaches Envoy with the service as its original destination\n{}",
        pod.agent.log()
    );
    let own = dial(pod.wired.in_pod(PROXY_UID), &format!("tcp:{SERVICE}"), None)
        .expect("dial")
        .expect("answer");
    assert_eq!(
        own.server, "upstream",
        "{when}: Envoy's own connection is balanced to the backend"
    );
}

#[test]
fn a_balancer_attached_before_the_agent() {
    require_root();
    if !meshcap_tests::ebpf_runs_here() {
        return;
    }
    let root = Arc::new(TestCgroup::new("mc-coexist").expect("cgroup"));
    let lb = load_lb();
    let _link =
        socklb::attach(&lb, Hook::Connect4, root.path(), false).expect("attaching the balancer");
    let pod = Captured::start(&root);
    if kernel_orders() {
        // meshcap's links are created first on the hook.
        assert_service_kept(&pod, "balancer attached first");
        assert_eq!(
            pod.others_on_connect4(),
            [("test_socklb".to_owned(), false)]
        );
        assert_eq!(pod.warnings(), Vec::<String>::new());
    } else {
        // The kernel cannot put meshcap first: the backend is what Envoy reads, and the agent
        // says why, naming the program.
        assert_eq!(
            pod.dial_service(),
            ("envoy".to_owned(), Some(BACKEND.to_owned()))
        );
        assert_eq!(pod.others_on_connect4(), [("test_socklb".to_owned(), true)]);
        let warnings = pod.warnings();
        assert!(
            warnings.iter().any(|w| w.contains("test_socklb")
                && w.contains("runs before meshcap's meshcap_connect4")
                && w.contains("cannot order")),
            "{warnings:?}"
        );
        eventually("the warning is logged", || {
            pod.agent.log().contains("cannot order cgroup programs")
        })
        .expect("logged");
    }
}

#[test]
fn a_balancer_attached_after_the_agent() {
    require_root();
    if !meshcap_tests::ebpf_runs_here() {
        return;
    }
    let root = Arc::new(TestCgroup::new("mc-coexist").expect("cgroup"));
    let pod = Captured::start(&root);
    let lb = load_lb();
    let _link =
        socklb::attach(&lb, Hook::Connect4, root.path(), false).expect("attaching the balancer");
    assert_service_kept(&pod, "balancer attached after");
    assert_eq!(
        pod.others_on_connect4(),
        [("test_socklb".to_owned(), false)]
    );
    assert_eq!(pod.warnings(), Vec::<String>::new());
    let (_, metrics) = pod.agent.http_get("/metrics").expect("metrics");
    assert!(
        metrics.contains("meshcap_other_programs{hook=\"meshcap_connect4\",position=\"after\"} 1"),
        "{metrics}"
    );
}

#[test]
fn a_balancer_jumping_ahead_is_overtaken() {
    require_root();
    if !meshcap_tests::ebpf_runs_here() {
        return;
    }
    let root = Arc::new(TestCgroup::new("mc-coexist").expect("cgroup"));
    let mut pod = Captured::start(&root);
    let lb = load_lb();
    let Ok(_link) = socklb::attach(&lb, Hook::Connect4, root.path(), true) else {
        // A kernel that cannot order cgroup links lets no program jump ahead either.
        assert!(
            !kernel_orders(),
            "BPF_F_BEFORE refused on a kernel that orders"
        );
        return;
    };
    assert_eq!(
        pod.dial_service(),
        ("envoy".to_owned(), Some(BACKEND.to_owned())),
        "the balancer now runs first"
    );
    // The agent's check (at start, and every minute) puts meshcap first again.
    pod.agent.restart().expect("restart");
    eventually("meshcap's connect4 runs first again", || {
        pod.others_on_connect4() == [("test_socklb".to_owned(), false)]
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", pod.agent.log()));
    assert_service_kept(&pod, "after the agent moved its program first");
    assert!(
        pod.agent
            .log()
            .contains("moved meshcap's program before the other one")
    );
    assert_eq!(pod.warnings(), Vec::<String>::new());
}

#[test]
fn a_balancer_on_a_parent_cgroup_runs_after() {
    require_root();
    if !meshcap_tests::ebpf_runs_here() {
        return;
    }
    let parent = TestCgroup::new("mc-coexist-parent").expect("cgroup");
    let root = Arc::new(TestCgroup::new_under(parent.path(), "mc-coexist").expect("child cgroup"));
    let lb = load_lb();
    let _link =
        socklb::attach(&lb, Hook::Connect4, parent.path(), false).expect("attaching the balancer");
    let pod = Captured::start(&root);
    assert_service_kept(&pod, "balancer on the parent cgroup");
    assert_eq!(
        pod.others_on_connect4(),
        [("test_socklb".to_owned(), false)]
    );
    assert_eq!(pod.warnings(), Vec::<String>::new());
}

#[test]
fn a_dns_balancer_attached_before_the_agent() {
    require_root();
    if !meshcap_tests::ebpf_runs_here() {
        return;
    }
    const DNS_SERVICE: &str = "10.96.0.10:53";
    const DNS_BACKEND: &str = "10.0.0.1:53";
    let root = Arc::new(TestCgroup::new("mc-coexist").expect("cgroup"));
    let lb = socklb::load(
        Hook::SendMsg4,
        DNS_SERVICE.parse().expect("service"),
        DNS_BACKEND.parse().expect("backend"),
    )
    .expect("loading the stand-in DNS balancer");
    let _link =
        socklb::attach(&lb, Hook::SendMsg4, root.path(), false).expect("attaching the balancer");
    let mut manifest = sidecar_pod("shop", "web", &[]);
    manifest["spec"]["containers"][1]["env"] =
        serde_json::json!([{"name": "ISTIO_META_DNS_CAPTURE", "value": "true"}]);
    let pod = Captured::start_with(&root, manifest, true);
    // A resolver's query: an unconnected datagram; it accepts only an answer from the address
    // it asked (meshcap-dial checks it, as glibc's resolver does).
    let said = meshcap_tests::Proc::spawn(
        pod.wired.in_pod(meshcap_tests::APP_UID),
        &meshcap_tests::bin::dial(),
        &[&format!("udp:{DNS_SERVICE}")],
    )
    .expect("dial")
    .finish()
    .expect("dial's answer");
    let others: Vec<(String, bool)> = pod
        .agent
        .status()
        .expect("status")
        .other_programs
        .into_iter()
        .filter(|o| o.hook == "meshcap_sendmsg4")
        .map(|o| (o.name, o.before))
        .collect();
    if kernel_orders() {
        let answer: meshcap_tests::Report = serde_json::from_str(said.trim())
            .unwrap_or_else(|e| panic!("dial said {said:?}: {e}\n{}", pod.agent.log()));
        assert_eq!((answer.server.as_str(), answer.listener), ("envoy", 15053));
        assert_eq!(
            answer.app_peer.map(|a| a.to_string()).as_deref(),
            Some(DNS_SERVICE),
            "{answer:?}"
        );
        assert_eq!(others, [("test_socklb".to_owned(), false)]);
        assert_eq!(pod.warnings(), Vec::<String>::new());
    } else {
        // meshcap saw the backend as the destination, so the answer comes back from the
        // backend's address, and the resolver drops it. The agent says why.
        assert_eq!(
            said.trim(),
            format!("no-answer: reply came from {DNS_BACKEND}, not {DNS_SERVICE}")
        );
        assert_eq!(others, [("test_socklb".to_owned(), true)]);
        let warnings = pod.warnings();
        assert!(
            warnings
                .iter()
                .any(|w| w.contains("runs before meshcap's meshcap_sendmsg4")),
            "{warnings:?}"
        );
    }
}
