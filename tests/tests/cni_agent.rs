//! End to end, playing kubelet: a pod netns, the real `meshcap-cni` binary run with the CNI
//! environment and configuration, a running `meshcap-agent` (each test on both backends: eBPF
//! attached to a throwaway cgroup holding the pod's processes, and iptables) that learns the
//! pod from a manifest directory or from a Kubernetes API server (an in-test HTTP server
//! speaking the real paths with real Pod JSON; kube-rs is the client), and the stand-in Envoy
//! proving the capture. Then DEL, and nothing may be left.
use std::{
    io::Write as _,
    net::TcpListener,
    os::unix::{fs::PermissionsExt as _, net::UnixStream},
    path::Path,
    thread,
    time::Duration,
};

use meshcap_tests::{
    APP_UID, Held, Netns, PROXY_UID, Placement,
    agent::{Agent, Backend, tcx_env},
    apiserver::ApiServer,
    dial, dial_failure,
    fixtures::{ManifestDir, eventually, leftovers, sidecar_pod, write_manifest},
    kubelet::{Sandbox, cni, config, run_plugin_raw},
    require_root, unique_name,
    wired::Wired,
};
use serde_json::{Value, json};

meshcap_tests::test_on_both_backends!(
    kube_source_pod_is_captured_and_released,
    api_unreachable_fails_add_closed,
    bad_input_gets_clear_errors_and_the_agent_keeps_serving,
    a_capture_whose_netns_went_without_a_del_is_dropped,
);

meshcap_tests::test_on_every_backend!(
    dir_source_pod_is_captured_and_released,
    a_hundred_pods_in_parallel_leave_nothing_behind,
    a_pod_in_a_user_namespace_of_its_own_is_captured_as_istio_does,
);

fn dir_agent(backend: Backend, dir: &ManifestDir) -> Agent {
    dir_agent_with(backend, dir, &[])
}

fn dir_agent_with(backend: Backend, dir: &ManifestDir, env: &[(&str, &str)]) -> Agent {
    Agent::start(
        backend,
        &[
            "--pods",
            "dir",
            "--pod-dir",
            dir.0.to_str().expect("utf-8 path"),
        ],
        env,
    )
    .expect("agent")
}

/// ADD captures, CHECK passes, the app's connection reaches Envoy with its original
/// destination, DEL releases it and leaves nothing behind.
fn capture_cycle(agent: &Agent, wired: &Wired, sandbox: &Sandbox, version: &str) {
    let conf = config(version, &agent.socket, "10.0.0.2");
    let _servers = wired.servers();
    assert_eq!(
        wired.app_dial().0,
        "upstream",
        "before ADD nothing is captured"
    );

    let add = cni("ADD", sandbox, &conf).expect("ADD");
    assert!(add.success, "ADD failed: {add:?}");
    assert_eq!(add.stdout["cniVersion"], version);
    assert_eq!(
        add.stdout["ips"][0]["address"], "10.0.0.2/24",
        "prevResult passes through"
    );

    let (server, original) = wired.app_dial();
    assert_eq!(server, "envoy", "the app's connection is captured");
    assert_eq!(
        original.as_deref(),
        Some("10.0.0.1:80"),
        "Envoy learns the original destination"
    );
    let own = dial(wired.in_pod(PROXY_UID), "tcp:10.0.0.1:80", None)
        .expect("dial")
        .expect("answer");
    assert_eq!(
        own.server, "upstream",
        "the proxy's own connection is not captured"
    );

    let check = cni("CHECK", sandbox, &conf).expect("CHECK");
    assert!(check.success, "CHECK failed: {check:?}");
    let again = cni("ADD", sandbox, &conf).expect("second ADD");
    assert!(again.success, "a repeated ADD is idempotent: {again:?}");

    let del = cni("DEL", sandbox, &conf).expect("DEL");
    assert!(del.success, "DEL failed: {del:?}");
    assert_eq!(
        wired.app_dial().0,
        "upstream",
        "after DEL nothing is captured"
    );
    assert_eq!(
        leftovers(&wired.pod).expect("leftovers"),
        Vec::<String>::new()
    );
    assert_eq!(
        agent.ebpf_leftovers().expect("eBPF leftovers"),
        Vec::<String>::new()
    );
    let del_again = cni("DEL", sandbox, &conf).expect("second DEL");
    assert!(del_again.success, "DEL is idempotent: {del_again:?}");
}

/// The eBPF agent with pods' inbound stubs as TCX links (asked for; the default is netlink
/// TC), where the kernel has TCX: CHECK verifies them, DEL leaves no link behind.
#[test]
fn dir_source_pod_is_captured_and_released_ebpf_tcx() {
    require_root();
    if !meshcap_tests::ebpf_runs_here() {
        return;
    }
    let dir = ManifestDir::new();
    let agent = dir_agent_with(Backend::Ebpf, &dir, &[tcx_env()]);
    capture_cycles(&agent, &dir, Backend::Ebpf);
}

fn dir_source_pod_is_captured_and_released(backend: Backend) {
    require_root();
    let dir = ManifestDir::new();
    let agent = dir_agent(backend, &dir);
    capture_cycles(&agent, &dir, backend);
}

/// [`capture_cycle`] in every CNI version, REDIRECT and TPROXY.
fn capture_cycles(agent: &Agent, dir: &ManifestDir, backend: Backend) {
    for (version, mode) in [
        ("1.0.0", "REDIRECT"),
        ("0.4.0", "TPROXY"),
        ("1.1.0", "REDIRECT"),
        ("0.3.1", "REDIRECT"),
    ] {
        let wired = Wired::new(agent);
        let name = unique_name("web");
        write_manifest(
            &dir.0,
            &sidecar_pod(
                "shop",
                &name,
                &[("sidecar.istio.io/interceptionMode", mode)],
            ),
        );
        let sandbox = Sandbox::new("shop", &name, &wired.pod);
        capture_cycle(agent, &wired, &sandbox, version);
    }
    let (code, metrics) = agent.http_get("/metrics").expect("metrics");
    assert_eq!(code, 200);
    assert!(
        metrics.contains(r#"meshcap_cni_requests_total{op="add",outcome="captured"} 8"#),
        "{metrics}"
    );
    assert!(
        metrics.contains(&format!(
            r#"meshcap_pods_captured{{backend="{}"}} 0"#,
            backend.name()
        )),
        "{metrics}"
    );
}

fn kube_source_pod_is_captured_and_released(backend: Backend) {
    require_root();
    let api = ApiServer::start();
    let listed = unique_name("listed");
    api.pods
        .lock()
        .expect("pods")
        .push(sidecar_pod("shop", &listed, &[]));
    let dir = ManifestDir::new();
    let kubeconfig = api.kubeconfig(&dir.0);
    let agent = Agent::start(
        backend,
        &["--pods", "kube", "--node-name", "node-1"],
        &[("KUBECONFIG", kubeconfig.to_str().expect("utf-8"))],
    )
    .expect("agent");
    let wired = Wired::new(&agent);
    eventually("the agent's pod watch syncs", || {
        agent.http_get("/readyz").is_ok_and(|(code, _)| code == 200)
    })
    .expect("readiness");
    // Known from the watch's list.
    capture_cycle(
        &agent,
        &wired,
        &Sandbox::new("shop", &listed, &wired.pod),
        "1.0.0",
    );
    // Created after the list: the watch is silent, the agent finds it with a GET.
    let late = unique_name("late");
    api.pods
        .lock()
        .expect("pods")
        .push(sidecar_pod("shop", &late, &[]));
    let wired = Wired::new(&agent);
    capture_cycle(
        &agent,
        &wired,
        &Sandbox::new("shop", &late, &wired.pod),
        "1.1.0",
    );

    // A pod whose capture fails gets a Warning Event naming the annotation and the value, as
    // `kubectl describe pod` shows it.
    let broken = unique_name("broken");
    api.pods.lock().expect("pods").push(sidecar_pod(
        "shop",
        &broken,
        &[("traffic.sidecar.istio.io/includeInboundPorts", "80,http")],
    ));
    let pod = Netns::new("mc-e2e-event").expect("netns");
    let add = cni(
        "ADD",
        &Sandbox::new("shop", &broken, &pod),
        &config("1.0.0", &agent.socket, "10.0.0.2"),
    )
    .expect("ADD");
    assert_eq!(add.stdout["code"], 104, "{add:?}");
    let mut event = Value::Null;
    eventually("the agent publishes an Event on the pod", || {
        let events = api.events.lock().expect("events");
        event = events
            .iter()
            .find(|e| e["regarding"]["name"] == broken.as_str())
            .cloned()
            .unwrap_or(Value::Null);
        !event.is_null()
    })
    .expect("event");
    assert_eq!(
        (
            &event["type"],
            &event["reason"],
            &event["regarding"]["kind"],
            &event["regarding"]["namespace"],
            &event["regarding"]["uid"],
            &event["reportingController"],
            &event["reportingInstance"],
        ),
        (
            &json!("Warning"),
            &json!("InvalidSidecarAnnotation"),
            &json!("Pod"),
            &json!("shop"),
            &json!(format!("uid-{broken}")),
            &json!("meshcap-agent"),
            &json!("node-1"),
        ),
        "{event}"
    );
    let note = event["note"].as_str().unwrap_or_default();
    assert!(
        note.contains("includeInboundPorts") && note.contains("80,http"),
        "{event}"
    );
}

fn api_unreachable_fails_add_closed(backend: Backend) {
    require_root();
    let dir = ManifestDir::new();
    let dead = TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr");
    let kubeconfig = dir.0.join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!("apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {{server: \"http://{dead}\"}}\nusers:\n- name: u\n  user: {{}}\ncontexts:\n- name: x\n  context: {{cluster: c, user: u}}\ncurrent-context: x\n"),
    )
    .expect("kubeconfig");
    let mut agent = Agent::start(
        backend,
        &["--pods", "kube", "--node-name", "node-1"],
        &[("KUBECONFIG", kubeconfig.to_str().expect("utf-8"))],
    )
    .expect("agent");
    let pod = Netns::new("mc-e2e-noapi").expect("netns");
    let add = cni(
        "ADD",
        &Sandbox::new("shop", "web", &pod),
        &config("1.0.0", &agent.socket, "10.0.0.2"),
    )
    .expect("ADD");
    assert!(!add.success, "ADD must fail closed: {add:?}");
    assert_eq!(add.stdout["code"], 11, "{add:?}");
    assert!(
        add.msg().contains("unavailable") && add.msg().contains("shop/web"),
        "{}",
        add.msg()
    );
    assert_eq!(leftovers(&pod).expect("leftovers"), Vec::<String>::new());
    assert_eq!(
        agent.ebpf_leftovers().expect("eBPF leftovers"),
        Vec::<String>::new()
    );
    assert!(agent.is_running());
}

/// Sends raw bytes to the agent's socket and returns the decoded answer.
fn raw_request(socket: &Path, bytes: &[u8]) -> Value {
    let mut stream = UnixStream::connect(socket).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let _ = stream.write_all(bytes);
    let body =
        meshcap_cni::protocol::read_frame(&mut stream, meshcap_cni::protocol::MAX_RESPONSE_BYTES)
            .expect("an answer");
    serde_json::from_slice(&body).expect("JSON answer")
}

fn bad_input_gets_clear_errors_and_the_agent_keeps_serving(backend: Backend) {
    require_root();
    let dir = ManifestDir::new();
    let mut agent = dir_agent(backend, &dir);
    let pod = Netns::new("mc-e2e-bad").expect("netns");
    let sandbox = Sandbox::new("shop", "bad", &pod);
    let conf = config("1.0.0", &agent.socket, "10.0.0.2");
    let env = |cmd: &str| -> Vec<(&'static str, String)> {
        vec![
            ("CNI_COMMAND", cmd.to_owned()),
            ("CNI_CONTAINERID", sandbox.container_id.clone()),
            ("CNI_NETNS", sandbox.netns.display().to_string()),
            ("CNI_IFNAME", "eth0".into()),
            ("CNI_ARGS", "K8S_POD_NAMESPACE=shop;K8S_POD_NAME=bad".into()),
        ]
    };

    // Malformed stdin.
    let out = run_plugin_raw(&env("ADD"), b"{\"cniVersion\": \"1.0.0\", ", 0).expect("plugin");
    assert!(!out.success);
    assert_eq!(out.stdout["code"], 6);
    assert!(out.msg().contains("not valid JSON"), "{}", out.msg());
    // Missing CNI environment.
    let mut missing = env("ADD");
    missing.retain(|(k, _)| *k != "CNI_NETNS");
    let out = run_plugin_raw(&missing, conf.to_string().as_bytes(), 0).expect("plugin");
    assert_eq!((out.success, out.stdout["code"].clone()), (false, json!(4)));
    assert!(out.msg().contains("CNI_NETNS"), "{}", out.msg());
    let out = run_plugin_raw(&[], conf.to_string().as_bytes(), 0).expect("plugin");
    assert!(out.msg().contains("CNI_COMMAND"), "{}", out.msg());
    // Unsupported cniVersion.
    let out = cni("ADD", &sandbox, &config("0.2.0", &agent.socket, "10.0.0.2")).expect("plugin");
    assert_eq!((out.success, out.stdout["code"].clone()), (false, json!(1)));
    assert!(out.msg().contains("0.2.0"), "{}", out.msg());

    // Oversized, garbled, wrong-version and truncated socket requests.
    let answer = raw_request(&agent.socket, &(10u32 * 1024 * 1024).to_be_bytes());
    assert_eq!(answer["kind"], "bad_request");
    assert!(
        answer["msg"]
            .as_str()
            .unwrap_or("")
            .contains("larger than the limit"),
        "{answer}"
    );
    let mut garbled = 9u32.to_be_bytes().to_vec();
    garbled.extend_from_slice(b"\x00garbage!");
    assert_eq!(raw_request(&agent.socket, &garbled)["kind"], "bad_request");
    let body = br#"{"v":99,"op":"ping"}"#;
    let mut future = u32::try_from(body.len())
        .expect("len")
        .to_be_bytes()
        .to_vec();
    future.extend_from_slice(body);
    let answer = raw_request(&agent.socket, &future);
    assert_eq!(answer["kind"], "unsupported_version", "{answer}");
    {
        // A peer that announces a body and never sends it is cut off by the read timeout
        // without holding the agent up.
        let mut stream = UnixStream::connect(&agent.socket).expect("connect");
        stream.write_all(&100u32.to_be_bytes()).expect("prefix");
    }

    // A non-root peer: the socket is 0600, and even when opened up the agent refuses by
    // SO_PEERCRED.
    let mode = std::fs::metadata(&agent.socket)
        .expect("socket")
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600);
    let status_env = vec![("CNI_COMMAND", "STATUS".to_owned())];
    let out = run_plugin_raw(&status_env, conf.to_string().as_bytes(), APP_UID).expect("plugin");
    assert_eq!(out.stdout["code"], 50, "{out:?}");
    std::fs::set_permissions(&agent.socket, std::fs::Permissions::from_mode(0o666)).expect("chmod");
    let out = run_plugin_raw(&status_env, conf.to_string().as_bytes(), APP_UID).expect("plugin");
    assert_eq!(out.stdout["code"], 50, "{out:?}");
    assert!(
        out.msg().contains("uid 1000") && out.msg().contains("root only"),
        "{}",
        out.msg()
    );
    std::fs::set_permissions(&agent.socket, std::fs::Permissions::from_mode(0o600)).expect("chmod");

    // An invalid annotation: ADD fails naming the pod, annotation and value; nothing applied.
    write_manifest(
        &dir.0,
        &sidecar_pod(
            "shop",
            "bad",
            &[(
                "traffic.sidecar.istio.io/excludeOutboundIPRanges",
                "10.0.0.0/33",
            )],
        ),
    );
    let out = cni("ADD", &sandbox, &conf).expect("plugin");
    assert!(!out.success);
    assert_eq!(out.stdout["code"], 104);
    assert!(
        out.msg().contains("shop/bad")
            && out.msg().contains("excludeOutboundIPRanges")
            && out.msg().contains("10.0.0.0/33"),
        "{}",
        out.msg()
    );
    assert_eq!(leftovers(&pod).expect("leftovers"), Vec::<String>::new());
    assert_eq!(
        agent.ebpf_leftovers().expect("eBPF leftovers"),
        Vec::<String>::new()
    );
    // A pod the source does not have.
    let ghost = Sandbox::new("shop", "ghost", &pod);
    let out = cni("ADD", &ghost, &conf).expect("plugin");
    assert_eq!(out.stdout["code"], 103, "{out:?}");
    assert!(
        out.msg().contains("shop/ghost") && out.msg().contains("not found"),
        "{}",
        out.msg()
    );

    // Through all of it the agent kept serving.
    assert!(agent.is_running());
    let out = run_plugin_raw(
        &status_env,
        json!({"cniVersion": "1.1.0", "agent_socket": agent.socket})
            .to_string()
            .as_bytes(),
        0,
    )
    .expect("plugin");
    assert!(out.success, "STATUS after bad input: {out:?}");
    write_manifest(&dir.0, &sidecar_pod("shop", "bad", &[]));
    let out = cni("ADD", &sandbox, &conf).expect("plugin");
    assert!(out.success, "{out:?}");
    assert!(cni("DEL", &sandbox, &conf).expect("DEL").success);
    let (_, metrics) = agent.http_get("/metrics").expect("metrics");
    assert!(metrics.contains(r#"reason="invalid_pod""#), "{metrics}");
    assert!(metrics.contains(r#"reason="forbidden""#), "{metrics}");
}

/// Pods ADDed at once: 100, or `MESHCAP_PARALLEL_PODS`. `cargo xtask integration` runs
/// fewer: under QEMU's emulation a burst of 100 outlasts the plugin's 30 s agent timeout.
fn parallel_pods() -> usize {
    std::env::var("MESHCAP_PARALLEL_PODS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(100)
}

fn a_hundred_pods_in_parallel_leave_nothing_behind(backend: Backend) {
    require_root();
    let dir = ManifestDir::new();
    let agent = dir_agent(backend, &dir);
    let count = parallel_pods();
    let pods: Vec<(Netns, Sandbox)> = (0..count)
        .map(|i| {
            let netns = Netns::new("mc-e2e-many").expect("netns");
            netns
                .ip(&[
                    "link", "add", "eth0", "type", "veth", "peer", "name", "peer0",
                ])
                .expect("eth0");
            let name = format!("many-{i}");
            let mode = if i % 2 == 0 { "REDIRECT" } else { "TPROXY" };
            write_manifest(
                &dir.0,
                &sidecar_pod(
                    "shop",
                    &name,
                    &[("sidecar.istio.io/interceptionMode", mode)],
                ),
            );
            let sandbox = Sandbox::new("shop", &name, &netns);
            (netns, sandbox)
        })
        .collect();
    let conf = config("1.0.0", &agent.socket, "10.0.0.2");
    let run_all = |command: &'static str| {
        thread::scope(|scope| {
            let handles: Vec<_> = pods
                .iter()
                .map(|(_, sandbox)| scope.spawn(|| cni(command, sandbox, &conf).expect("plugin")))
                .collect();
            for handle in handles {
                let out = handle.join().expect("thread");
                assert!(out.success, "{command}: {out:?}");
            }
        });
    };
    run_all("ADD");
    match backend {
        Backend::Iptables => {
            for (netns, _) in &pods {
                let rules = leftovers(netns).expect("rules");
                assert!(
                    rules.iter().any(|l| l.contains("ISTIO_OUTPUT")),
                    "{}: {rules:?}",
                    netns.name()
                );
            }
        }
        Backend::Nftables => {
            for (netns, _) in &pods {
                let rules = leftovers(netns).expect("rules");
                assert!(
                    rules.contains(&"nft: table inet istio-proxy-nat".to_owned()),
                    "{}: {rules:?}",
                    netns.name()
                );
            }
        }
        Backend::Ebpf => {
            let held = agent.ebpf_leftovers().expect("eBPF state");
            let pinned = held.iter().filter(|l| l.starts_with("pinned pod")).count();
            assert_eq!(pinned, count, "{held:?}");
            let entries = format!("{count} entries in MESHCAP_PODS");
            assert!(held.contains(&entries), "{held:?}");
        }
    }
    let (_, metrics) = agent.http_get("/metrics").expect("metrics");
    assert!(
        metrics.contains(&format!(
            r#"meshcap_pods_captured{{backend="{}"}} {count}"#,
            backend.name()
        )),
        "{metrics}"
    );
    run_all("DEL");
    for (netns, _) in &pods {
        assert_eq!(
            leftovers(netns).expect("leftovers"),
            Vec::<String>::new(),
            "{}",
            netns.name()
        );
    }
    assert_eq!(
        agent.ebpf_leftovers().expect("eBPF leftovers"),
        Vec::<String>::new(),
        "no pins or map entries left"
    );
    let records = std::fs::read_dir(agent.state_dir().join("iptables"))
        .map(Iterator::count)
        .unwrap_or(0);
    assert_eq!(records, 0, "no iptables records left");
    let (_, metrics) = agent.http_get("/metrics").expect("metrics");
    assert!(
        metrics.contains(&format!(
            r#"meshcap_pods_captured{{backend="{}"}} 0"#,
            backend.name()
        )),
        "{metrics}"
    );
}

/// Restart safety through the real agent binary (eBPF): SIGKILL the agent while pods are
/// captured. During the gap every new connection still reaches the stand-in Envoy and a pod
/// ADDed fails closed; a pod whose netns goes away during the gap is dropped by the restarted
/// agent, which adopts the pins without attaching anything twice, keeps the live pod captured
/// and captures the pod that failed before. A captured connection opened before the kill
/// keeps exchanging lines across the kill and the restart, and its original destination
/// (Envoy's `SO_ORIGINAL_DST`, asked afresh at each exchange) stays what it was.
#[test]
fn sigkilled_agent_leaves_capture_in_place_and_restart_reconciles() {
    require_root();
    if !meshcap_tests::ebpf_runs_here() {
        return;
    }
    let dir = ManifestDir::new();
    let mut agent = dir_agent(Backend::Ebpf, &dir);
    let conf = config("1.0.0", &agent.socket, "10.0.0.2");
    let live = Wired::new(&agent);
    let _servers = live.servers();
    let doomed = Netns::new("mc-e2e-doomed").expect("netns");
    doomed
        .ip(&[
            "link", "add", "eth0", "type", "veth", "peer", "name", "peer0",
        ])
        .expect("eth0");
    let late = Netns::new("mc-e2e-late").expect("netns");
    for name in ["live", "doomed", "late"] {
        write_manifest(&dir.0, &sidecar_pod("shop", name, &[]));
    }
    let live_sandbox = Sandbox::new("shop", "live", &live.pod);
    let doomed_sandbox = Sandbox::new("shop", "doomed", &doomed);
    let late_sandbox = Sandbox::new("shop", "late", &late);
    for sandbox in [&live_sandbox, &doomed_sandbox] {
        let add = cni("ADD", sandbox, &conf).expect("ADD");
        assert!(add.success, "{add:?}");
    }
    assert_eq!(
        live.app_dial(),
        ("envoy".into(), Some("10.0.0.1:80".into()))
    );
    let mut held = Held::connect(live.in_pod(APP_UID), "10.0.0.1:80".parse().expect("addr"))
        .expect("a held connection");
    let first = held.first().clone();
    assert_eq!(
        (first.server.as_str(), first.original_dst),
        ("envoy", Some("10.0.0.1:80".parse().expect("addr"))),
        "the held connection is captured"
    );
    let mut exchanges = 0;
    let mut exchange = |held: &mut Held, when: &str| {
        exchanges += 1;
        let report = held
            .exchange(&format!("{when} #{exchanges}"))
            .unwrap_or_else(|e| panic!("exchange {exchanges} ({when}) failed: {e:#}"));
        assert_eq!(report, first, "exchange {exchanges} ({when})");
    };
    exchange(&mut held, "before the kill");
    let before = agent.ebpf_leftovers().expect("eBPF state");

    agent.kill().expect("SIGKILL the agent");
    // The gap: nothing serves the socket, yet capture holds for every new connection, and the
    // established one keeps working.
    for _ in 0..20 {
        exchange(&mut held, "agent down");
        assert_eq!(
            live.app_dial(),
            ("envoy".into(), Some("10.0.0.1:80".into())),
            "a connection bypassed capture while the agent was down"
        );
    }
    let add = cni("ADD", &late_sandbox, &conf).expect("ADD");
    assert!(
        !add.success,
        "ADD without an agent must fail closed: {add:?}"
    );
    assert!(add.msg().contains("agent"), "{}", add.msg());
    let doomed_cookie = doomed.cookie().expect("cookie");
    drop(doomed);
    assert_eq!(
        agent.ebpf_leftovers().expect("eBPF state"),
        before,
        "the agent's death changed nothing"
    );

    exchange(&mut held, "agent down, a pod gone");
    agent.restart().expect("restart on the same bpffs dir");
    exchange(&mut held, "after the restart");
    let config = agent.ebpf_config().expect("eBPF");
    let backend = meshcap_agent::backend::ebpf::EbpfBackend::open(config).expect("pins");
    for (program, count) in backend.attachments().expect("BPF_PROG_QUERY") {
        assert_eq!(count, 1, "{program} attached {count} times after a restart");
    }
    let pinned = backend.pinned_pods();
    assert_eq!(
        pinned.iter().map(|p| p.name.as_str()).collect::<Vec<_>>(),
        ["live"],
        "the pod whose netns went (cookie {doomed_cookie}) is dropped: {pinned:?}"
    );
    assert!(
        agent.log().contains("netns gone: entries and pins dropped"),
        "{}",
        agent.log()
    );
    assert_eq!(
        live.app_dial(),
        ("envoy".into(), Some("10.0.0.1:80".into()))
    );
    let check = cni("CHECK", &live_sandbox, &conf).expect("CHECK");
    assert!(check.success, "the live pod is still captured: {check:?}");
    let add = cni("ADD", &late_sandbox, &conf).expect("ADD");
    assert!(
        add.success,
        "kubelet's retry succeeds after the restart: {add:?}"
    );
    exchange(&mut held, "after the reconcile and a new ADD");
    drop(held);

    for sandbox in [&live_sandbox, &late_sandbox] {
        assert!(cni("DEL", sandbox, &conf).expect("DEL").success);
    }
    assert_eq!(
        agent.ebpf_leftovers().expect("eBPF leftovers"),
        Vec::<String>::new()
    );
}

/// A pod netns mounted only in a directory of its own, as containerd keeps it with
/// `netns_mounts_under_state_dir`, with no process in it: between a sandbox's CNI ADD and the
/// start of its pause container. Moved back on drop, for the handle to delete.
struct MountedElsewhere<'n> {
    netns: &'n Netns,
    dir: std::path::PathBuf,
}

impl<'n> MountedElsewhere<'n> {
    fn new(netns: &'n Netns) -> Self {
        let dir = std::env::temp_dir().join(unique_name("mc-state-dir"));
        std::fs::create_dir_all(&dir).expect("state dir");
        let moved = Self { netns, dir };
        move_mount(&netns.path(), &moved.path()).expect("moving the netns mount");
        moved
    }

    fn path(&self) -> std::path::PathBuf {
        self.dir.join("netns")
    }
}

impl Drop for MountedElsewhere<'_> {
    fn drop(&mut self) {
        if let Err(err) = move_mount(&self.path(), &self.netns.path()) {
            eprintln!("cleanup: {err:#}");
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Bind-mounts the namespace file `from` at `to` and takes it away from `from` (syscalls: the
/// VMs' initramfs has no `mount`).
fn move_mount(from: &Path, to: &Path) -> anyhow::Result<()> {
    use nix::mount::{MntFlags, MsFlags, mount, umount2};
    std::fs::File::create(to)?;
    mount(Some(from), to, None::<&str>, MsFlags::MS_BIND, None::<&str>)?;
    umount2(from, MntFlags::empty())?;
    std::fs::remove_file(from)?;
    Ok(())
}

/// A pod whose runtime DEL came while the agent was down (the plugin lets it succeed) and whose
/// netns went only after the agent was back: the running agent drops its capture within
/// `--gone-check-seconds`, not at its next start only. Found by the chaos soak (one pod's pins
/// and map entries left after 40 restarts, 1,000 pods). The live pod beside it stays captured,
/// and so does one whose netns is mounted outside `/run/netns` with no process in it yet
/// ([`MountedElsewhere`]): the check that drops the gone pod sees it alive.
fn a_capture_whose_netns_went_without_a_del_is_dropped(backend: Backend) {
    require_root();
    let dir = ManifestDir::new();
    let pod_dir = dir.0.to_str().expect("utf-8 path");
    let agent = Agent::start(
        backend,
        &[
            "--pods",
            "dir",
            "--pod-dir",
            pod_dir,
            "--gone-check-seconds",
            "1",
        ],
        &[],
    )
    .expect("agent");
    let conf = config("1.0.0", &agent.socket, "10.0.0.2");
    // Pods with an eth0 (the eBPF backend's CHECK looks for its TC program there).
    let live = Wired::new(&agent);
    let gone = Wired::new(&agent);
    let starting = Wired::new(&agent);
    let elsewhere = MountedElsewhere::new(&starting.pod);
    for name in ["live", "gone", "starting"] {
        write_manifest(&dir.0, &sidecar_pod("shop", name, &[]));
    }
    let live_sandbox = Sandbox::new("shop", "live", &live.pod);
    let starting_sandbox = Sandbox {
        netns: elsewhere.path(),
        ..Sandbox::new("shop", "starting", &starting.pod)
    };
    for sandbox in [
        &live_sandbox,
        &Sandbox::new("shop", "gone", &gone.pod),
        &starting_sandbox,
    ] {
        let add = cni("ADD", sandbox, &conf).expect("ADD");
        assert!(add.success, "{add:?}\n{}", agent.log());
    }
    let captured = || -> Vec<String> {
        let report = agent.status().expect("status");
        report
            .pods
            .iter()
            .map(|p| p.captured.pod.name.clone())
            .collect()
    };
    let sorted = || {
        let mut pods = captured();
        pods.sort();
        pods
    };
    assert_eq!(sorted(), ["gone", "live", "starting"]);
    drop(gone);
    eventually("the gone pod's capture is dropped", || {
        !captured().contains(&"gone".to_owned())
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", agent.log()));
    assert_eq!(
        sorted(),
        ["live", "starting"],
        "the pods alive stay captured\n{}",
        agent.log()
    );
    for sandbox in [&live_sandbox, &starting_sandbox] {
        let check = cni("CHECK", sandbox, &conf).expect("CHECK");
        assert!(check.success, "{check:?}");
    }
    for sandbox in [&live_sandbox, &starting_sandbox] {
        assert!(cni("DEL", sandbox, &conf).expect("DEL").success);
    }
    assert!(captured().is_empty());
    assert_eq!(agent.ebpf_leftovers().expect("pins"), Vec::<String>::new());
    let records = std::fs::read_dir(agent.state_dir().join("iptables")).map_or(0, Iterator::count);
    assert_eq!(records, 0, "iptables records left");
}

/// The iptables backend reconciles too: a record whose netns went while the agent was down is
/// dropped at start; the live pod's rules and record stay.
#[test]
fn restarted_iptables_agent_drops_records_of_gone_pods() {
    require_root();
    let dir = ManifestDir::new();
    let mut agent = dir_agent(Backend::Iptables, &dir);
    let conf = config("1.0.0", &agent.socket, "10.0.0.2");
    let live = Netns::new("mc-e2e-live").expect("netns");
    let doomed = Netns::new("mc-e2e-doomed").expect("netns");
    for name in ["live", "doomed"] {
        write_manifest(&dir.0, &sidecar_pod("shop", name, &[]));
    }
    let live_sandbox = Sandbox::new("shop", "live", &live);
    for sandbox in [&live_sandbox, &Sandbox::new("shop", "doomed", &doomed)] {
        assert!(cni("ADD", sandbox, &conf).expect("ADD").success);
    }
    let records = |agent: &Agent| {
        std::fs::read_dir(agent.state_dir().join("iptables"))
            .map(Iterator::count)
            .unwrap_or(0)
    };
    assert_eq!(records(&agent), 2);
    agent.kill().expect("SIGKILL the agent");
    drop(doomed);
    agent.restart().expect("restart");
    assert_eq!(records(&agent), 1, "the gone pod's record is dropped");
    assert!(
        cni("CHECK", &live_sandbox, &conf).expect("CHECK").success,
        "the live pod stays captured"
    );
    assert!(cni("DEL", &live_sandbox, &conf).expect("DEL").success);
    assert_eq!(records(&agent), 0);
}

/// A second agent on the same state directory (an operator's `run` beside the DaemonSet's)
/// waits for the first to exit before it opens anything: the backends' state has one writer
/// (the eBPF backend indexes its maps in memory). Once the first is gone (SIGKILL: the kernel
/// drops its lock), the second serves. One stopped while it waits (SIGTERM: a rollout moved
/// on) exits at once, cleanly, having started nothing.
#[test]
fn a_second_agent_waits_for_the_first_to_exit() {
    require_root();
    if !meshcap_tests::ebpf_runs_here() {
        return;
    }
    let dir = ManifestDir::new();
    let mut first = dir_agent(Backend::Ebpf, &dir);
    let mut second = first.spawn_beside().expect("second agent");
    let mut stopped = first.spawn_beside().expect("third agent");
    // One log for all three: both agents beside say that they wait.
    eventually("both agents beside report that they wait", || {
        first.log().matches("holds this state directory").count() == 2
    })
    .expect("waiting");
    let status = stopped.terminate().expect("SIGTERM the waiting agent");
    assert!(
        status.success(),
        "a waiting agent stops cleanly on SIGTERM: {status}\n{}",
        stopped.log()
    );
    assert!(
        stopped.log().contains("nothing was started"),
        "{}",
        stopped.log()
    );
    assert!(
        second.is_running(),
        "the second agent waits, it does not exit"
    );
    assert!(
        !second.socket.exists(),
        "the second agent must not serve while the first runs"
    );
    first.kill().expect("SIGKILL the first agent");
    second
        .wait_ready()
        .expect("the second agent serves once the first is gone");
    let conf = config("1.0.0", &second.socket, "10.0.0.2");
    let netns = Netns::new("mc-e2e-beside").expect("netns");
    write_manifest(&dir.0, &sidecar_pod("shop", "beside", &[]));
    let sandbox = Sandbox::new("shop", "beside", &netns);
    assert!(cni("ADD", &sandbox, &conf).expect("ADD").success);
    assert!(cni("DEL", &sandbox, &conf).expect("DEL").success);
}

/// aya-log: a record written by a kernel program reaches the agent's own log. The pod is
/// captured but its proxy is not listening, so TC refuses an inbound SYN (the reset Istio's
/// `REDIRECT` would give) and says so.
#[test]
fn kernel_log_records_reach_the_agents_log() {
    require_root();
    if !meshcap_tests::ebpf_runs_here() {
        return;
    }
    let dir = ManifestDir::new();
    let agent = dir_agent(Backend::Ebpf, &dir);
    let wired = Wired::new(&agent);
    let name = unique_name("quiet");
    write_manifest(&dir.0, &sidecar_pod("shop", &name, &[]));
    let sandbox = Sandbox::new("shop", &name, &wired.pod);
    let conf = config("1.0.0", &agent.socket, "10.0.0.2");
    let add = cni("ADD", &sandbox, &conf).expect("ADD");
    assert!(add.success, "{add:?}");
    let from_upstream = Placement {
        netns: &wired.upstream,
        cgroup: None,
        uid: 0,
        gid: 0,
    };
    let failed = dial_failure(from_upstream, "tcp:10.0.0.2:8080").expect("dial");
    assert_eq!(failed, "ConnectionRefused", "no proxy listens: refused");
    eventually("the kernel's record reaches the agent's log", || {
        agent
            .log()
            .contains("inbound TCP to port 8080 refused: no proxy listener on port 15006")
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", agent.log()));
    assert!(cni("DEL", &sandbox, &conf).expect("DEL").success);
}

/// Every thread of a running agent runs with a short scheduler slice where the kernel has
/// per-task slices (Linux 6.12+): on a busy node an ADD's wake-ups in the agent then preempt
/// the pods' work instead of waiting for its slices to end (BENCHMARKS.md, session 12). Where
/// the kernel has none, the agent runs as before.
#[test]
fn the_agents_threads_ask_for_a_short_slice() {
    require_root();
    let dir = ManifestDir::new();
    let agent = dir_agent(Backend::Iptables, &dir);
    let expected = thread::spawn(|| {
        meshcap_agent::sched::ask_for_short_slice().expect("sched_setattr");
        meshcap_agent::sched::slice_ns(0).expect("sched_getattr")
    })
    .join()
    .expect("thread");
    if expected.is_some() {
        assert_eq!(expected, Some(meshcap_agent::sched::SHORT_SLICE_NS));
    }
    let tasks: Vec<i32> = std::fs::read_dir(format!("/proc/{}/task", agent.pid()))
        .expect("the agent's threads")
        .map(|e| {
            e.expect("entry")
                .file_name()
                .to_string_lossy()
                .parse()
                .expect("tid")
        })
        .collect();
    assert!(
        tasks.len() > 1,
        "a running agent has its runtime's threads: {tasks:?}"
    );
    for tid in tasks {
        let slice = meshcap_agent::sched::slice_ns(tid).expect("sched_getattr");
        assert_eq!(slice, expected, "thread {tid} of the agent");
    }
}

/// Where the pod's user namespace maps its id 0 on the node.
const USERNS_BASE: u32 = 100_000;

/// Pods with `hostUsers: false` (Kubernetes user namespaces): the pod's network namespace is
/// owned by a user namespace of its own that maps the pod's ids to a range of the node's, here
/// `0`..`65535` to `100000`.. (the test makes it as containerd 2 with runc does: the user
/// namespace, then the network namespace inside it). The pod's processes run as the node's ids
/// of the pod's (`101337` for the proxy's `1337`), which is what the kernel compares.
///
/// Without meshcap's handling, each backend breaks such a pod differently: the kernel refuses
/// Istio's `--uid-owner` rules from outside the pod's user namespace (`iptables-restore` fails,
/// and the ADD with it), and the kernel programs, comparing the node's ids with the pod's
/// `1337`, would capture the proxy's own connections (a loop back into Envoy). Here the ADD
/// captures the app's traffic for Envoy, Envoy's own connection passes, CHECK passes, and the
/// DEL leaves nothing.
///
/// Not run here: a real user-namespaced pod (containerd 1.6 cannot create one; kubelet 1.30+
/// with containerd 2 and idmapped mounts would), and processes inside the user namespace (the
/// kernel sees the same node ids either way).
fn a_pod_in_a_user_namespace_of_its_own_is_captured_as_istio_does(backend: Backend) {
    require_root();
    let dir = ManifestDir::new();
    write_manifest(&dir.0, &sidecar_pod("shop", "web", &[]));
    let agent = Agent::start(
        backend,
        &["--pods", "dir", "--pod-dir", dir.0.to_str().expect("utf-8")],
        &[],
    )
    .expect("agent");
    let wired = Wired::in_user_namespace(agent.cgroup(), USERNS_BASE);
    let _servers = wired.servers();
    let sandbox = Sandbox::new("shop", "web", &wired.pod);
    let conf = config("1.0.0", &agent.socket, "10.0.0.2");

    let add = cni("ADD", &sandbox, &conf).expect("ADD");
    assert!(add.success, "ADD: {add:?}\n{}", agent.log());
    assert_eq!(
        wired.app_dial(),
        ("envoy".to_owned(), Some("10.0.0.1:80".to_owned())),
        "the app (uid {}) is captured\n{}",
        USERNS_BASE + APP_UID,
        agent.log()
    );
    let proxy = dial(wired.in_pod(PROXY_UID), "tcp:10.0.0.1:80", None)
        .expect("dial")
        .expect("something answers");
    assert_eq!(
        (proxy.server.as_str(), proxy.original_dst),
        ("upstream", None),
        "the proxy's own connection (uid {}) passes\n{}",
        USERNS_BASE + PROXY_UID,
        agent.log()
    );
    let check = cni("CHECK", &sandbox, &conf).expect("CHECK");
    assert!(check.success, "CHECK: {check:?}\n{}", agent.log());

    let del = cni("DEL", &sandbox, &conf).expect("DEL");
    assert!(del.success, "DEL: {del:?}");
    assert_eq!(wired.app_dial().0, "upstream", "released");
    assert_eq!(
        leftovers(&wired.pod).expect("netns state"),
        Vec::<String>::new()
    );
    assert_eq!(
        agent.ebpf_leftovers().expect("eBPF state"),
        Vec::<String>::new()
    );
}

/// A node moved between the rules backends (`global.nativeNftables` turned on, then off
/// again): the pod captured before keeps its rules as they are, CHECK passes on them and the
/// verifier leaves them alone, until its DEL releases them; the next pod gets the backend
/// chosen now. Istio 1.29's migration keeps a running pod's iptables rules the same way.
#[test]
fn a_node_moved_between_iptables_and_nftables_keeps_each_pod_as_it_was_until_it_goes() {
    require_root();
    for (before, after, table) in [
        (Backend::Iptables, Backend::Nftables, "ISTIO_OUTPUT"),
        (Backend::Nftables, Backend::Iptables, "istio-proxy-nat"),
    ] {
        let mut scene = meshcap_tests::one_pod::OnePod::new(before, None);
        let _servers = scene.wired.servers();
        let add = scene.cni("ADD");
        assert!(add.success, "ADD on {before:?}: {add:?}");
        let earlier = leftovers(&scene.wired.pod).expect("rules");
        assert!(
            earlier.iter().any(|l| l.contains(table)),
            "{before:?}: {earlier:?}"
        );
        scene.agent.set_backend(after);
        scene.agent.restart().expect("restart");
        scene.assert_captured(&format!("{before:?} pod after the move to {after:?}"));
        assert_eq!(
            leftovers(&scene.wired.pod).expect("rules"),
            earlier,
            "{before:?} → {after:?}: the pod's rules are kept as they were"
        );
        let status = scene.agent.status().expect("status");
        assert!(
            status
                .warnings
                .iter()
                .any(|w| w.contains("keep the") && w.contains(before.name())),
            "{:?}",
            status.warnings
        );
        let del = scene.cni("DEL");
        assert!(del.success, "DEL: {del:?}");
        scene.assert_released(&format!("{before:?} pod after its DEL"));
        let add = scene.cni("ADD");
        assert!(add.success, "ADD on {after:?}: {add:?}");
        scene.assert_captured(&format!("a new pod on {after:?}"));
        let now = leftovers(&scene.wired.pod).expect("rules");
        assert!(
            !now.iter().any(|l| l.contains(table)),
            "{after:?}: a new pod gets only the backend chosen now: {now:?}"
        );
        let del = scene.cni("DEL");
        assert!(del.success, "DEL: {del:?}");
        scene.assert_released(&format!("a new pod on {after:?} after its DEL"));
    }
}
