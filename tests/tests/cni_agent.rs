//! End to end, playing kubelet: a pod netns, the real `meshcap-cni` binary run with the CNI
//! environment and configuration, a running `meshcap-agent` (iptables backend) that learns the
//! pod from a manifest directory or from a Kubernetes API server (an in-test HTTP server
//! speaking the real paths with real Pod JSON; kube-rs is the client), and the stand-in Envoy
//! proving the capture. Then DEL, and nothing may be left.
use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{TcpListener, TcpStream},
    os::unix::{fs::PermissionsExt as _, net::UnixStream},
    path::Path,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::Duration,
};

use meshcap_tests::{
    Netns, PROXY_UID, Placement, Proc,
    agent::{Agent, Sandbox, cni, config, eventually, leftovers, run_plugin_raw, sidecar_pod},
    dial, require_root, start_server, unique_name,
};
use serde_json::{Value, json};

const APP_UID: u32 = 1000;

/// A pod netns wired to an "upstream" netns by a veth pair: pod 10.0.0.2/24 on eth0, upstream
/// 10.0.0.1/24, with a server on 10.0.0.1:80.
struct Wired {
    pod: Netns,
    upstream: Netns,
}

impl Wired {
    fn new() -> Self {
        let pod = Netns::new("mc-e2e-pod").expect("pod netns");
        let upstream = Netns::new("mc-e2e-up").expect("upstream netns");
        pod.ip(&[
            "link",
            "add",
            "eth0",
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            upstream.name(),
        ])
        .expect("veth pair");
        for (ns, addr) in [(&pod, "10.0.0.2/24"), (&upstream, "10.0.0.1/24")] {
            ns.ip(&["addr", "add", addr, "dev", "eth0"])
                .expect("address");
            ns.ip(&["link", "set", "eth0", "up"]).expect("link up");
        }
        Self { pod, upstream }
    }

    fn in_pod(&self, uid: u32) -> Placement<'_> {
        Placement {
            netns: &self.pod,
            cgroup: None,
            uid,
            gid: uid,
        }
    }

    /// Servers: the stand-in Envoy in the pod (uid 1337) and the upstream.
    fn servers(&self) -> (Proc, Proc) {
        let envoy = start_server(
            self.in_pod(PROXY_UID),
            "envoy",
            &["tcp:0.0.0.0:15001", "tcp:0.0.0.0:15006"],
        )
        .expect("stand-in envoy");
        let upstream = start_server(
            Placement {
                netns: &self.upstream,
                cgroup: None,
                uid: 0,
                gid: 0,
            },
            "upstream",
            &["tcp:10.0.0.1:80"],
        )
        .expect("upstream server");
        (envoy, upstream)
    }

    /// Who answers the app's connection to 10.0.0.1:80, and the original destination Envoy saw.
    fn app_dial(&self) -> (String, Option<String>) {
        let report = dial(self.in_pod(APP_UID), "tcp:10.0.0.1:80", None)
            .expect("dial")
            .expect("something answers 10.0.0.1:80");
        (report.server, report.original_dst.map(|a| a.to_string()))
    }
}

fn write_manifest(dir: &Path, pod: &Value) {
    let name = pod["metadata"]["name"].as_str().expect("name");
    std::fs::write(dir.join(format!("{name}.json")), pod.to_string()).expect("manifest");
}

/// A throwaway manifest directory, removed on drop.
struct ManifestDir(std::path::PathBuf);

impl ManifestDir {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(unique_name("meshcap-pods"));
        std::fs::create_dir_all(&dir).expect("manifest dir");
        Self(dir)
    }
}

impl Drop for ManifestDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn dir_agent(dir: &ManifestDir) -> Agent {
    Agent::start(
        &[
            "--pods",
            "dir",
            "--pod-dir",
            dir.0.to_str().expect("utf-8 path"),
        ],
        &[],
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
    let del_again = cni("DEL", sandbox, &conf).expect("second DEL");
    assert!(del_again.success, "DEL is idempotent: {del_again:?}");
}

#[test]
fn dir_source_pod_is_captured_and_released() {
    require_root();
    let dir = ManifestDir::new();
    let agent = dir_agent(&dir);
    for (version, mode) in [
        ("1.0.0", "REDIRECT"),
        ("0.4.0", "TPROXY"),
        ("1.1.0", "REDIRECT"),
        ("0.3.1", "REDIRECT"),
    ] {
        let wired = Wired::new();
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
        capture_cycle(&agent, &wired, &sandbox, version);
    }
    let (code, metrics) = agent.http_get("/metrics").expect("metrics");
    assert_eq!(code, 200);
    assert!(
        metrics.contains(r#"meshcap_cni_requests_total{op="add",outcome="captured"} 8"#),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"meshcap_pods_captured{backend="iptables"} 0"#),
        "{metrics}"
    );
}

/// A tiny Kubernetes API server: list and watch of pods (by field selector, as kube-rs's
/// watcher asks), and GET of one pod, with real Pod JSON.
struct FakeApiServer {
    addr: String,
    pods: Arc<Mutex<Vec<Value>>>,
    stop: Arc<AtomicBool>,
}

impl FakeApiServer {
    fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let pods = Arc::new(Mutex::new(Vec::<Value>::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (p, s) = (pods.clone(), stop.clone());
        thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                if s.load(Ordering::Relaxed) {
                    break;
                }
                let (p, s) = (p.clone(), s.clone());
                thread::spawn(move || serve_api(stream, &p, &s));
            }
        });
        Self { addr, pods, stop }
    }

    fn kubeconfig(&self, dir: &Path) -> std::path::PathBuf {
        let path = dir.join("kubeconfig");
        std::fs::write(
            &path,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster: {{server: \"http://{}\"}}\n\
                 users:\n- name: test\n  user: {{}}\ncontexts:\n- name: test\n  context: {{cluster: test, user: test}}\n\
                 current-context: test\n",
                self.addr
            ),
        )
        .expect("kubeconfig");
        path
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = TcpStream::connect(&self.addr);
    }
}

fn serve_api(mut stream: TcpStream, pods: &Mutex<Vec<Value>>, stop: &AtomicBool) {
    let mut reader = BufReader::new(stream.try_clone().expect("clone"));
    let mut request_line = String::new();
    if reader.read_line(&mut request_line).is_err() {
        return;
    }
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header).is_err() || header.trim().is_empty() {
            break;
        }
    }
    let path = request_line
        .split_whitespace()
        .nth(1)
        .unwrap_or("/")
        .to_owned();
    let (route, query) = path.split_once('?').unwrap_or((&path, ""));
    let respond = |stream: &mut TcpStream, code: &str, body: &Value| {
        let body = body.to_string();
        let _ = write!(
            stream,
            "HTTP/1.1 {code}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
    };
    let parts: Vec<&str> = route.trim_matches('/').split('/').collect();
    match parts.as_slice() {
        ["api", "v1", "pods"] if query.contains("watch=true") || query.contains("watch=1") => {
            // A watch that stays open and quiet; new pods are found by the agent's GET.
            let _ = write!(
                stream,
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            );
            let _ = stream.flush();
            for _ in 0..600 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                thread::sleep(Duration::from_millis(100));
            }
        }
        ["api", "v1", "pods"] => {
            let items: Vec<Value> = pods.lock().expect("pods").clone();
            respond(
                &mut stream,
                "200 OK",
                &json!({
                    "apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "1"}, "items": items
                }),
            );
        }
        ["api", "v1", "namespaces", ns, "pods", name] => {
            let found = pods
                .lock()
                .expect("pods")
                .iter()
                .find(|p| p["metadata"]["namespace"] == *ns && p["metadata"]["name"] == *name)
                .cloned();
            match found {
                Some(pod) => respond(&mut stream, "200 OK", &pod),
                None => respond(
                    &mut stream,
                    "404 Not Found",
                    &json!({
                        "apiVersion": "v1", "kind": "Status", "status": "Failure",
                        "message": format!("pods \"{name}\" not found"), "reason": "NotFound", "code": 404
                    }),
                ),
            }
        }
        _ => respond(
            &mut stream,
            "404 Not Found",
            &json!({"kind": "Status", "code": 404}),
        ),
    }
    let mut rest = Vec::new();
    let _ = reader.read_to_end(&mut rest);
}

#[test]
fn kube_source_pod_is_captured_and_released() {
    require_root();
    let api = FakeApiServer::start();
    let wired = Wired::new();
    let listed = unique_name("listed");
    api.pods
        .lock()
        .expect("pods")
        .push(sidecar_pod("shop", &listed, &[]));
    let dir = ManifestDir::new();
    let kubeconfig = api.kubeconfig(&dir.0);
    let agent = Agent::start(
        &["--pods", "kube", "--node-name", "node-1"],
        &[("KUBECONFIG", kubeconfig.to_str().expect("utf-8"))],
    )
    .expect("agent");
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
    let wired = Wired::new();
    capture_cycle(
        &agent,
        &wired,
        &Sandbox::new("shop", &late, &wired.pod),
        "1.1.0",
    );
}

#[test]
fn api_unreachable_fails_add_closed() {
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

#[test]
fn bad_input_gets_clear_errors_and_the_agent_keeps_serving() {
    require_root();
    let dir = ManifestDir::new();
    let mut agent = dir_agent(&dir);
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

#[test]
fn a_hundred_pods_in_parallel_leave_nothing_behind() {
    require_root();
    let dir = ManifestDir::new();
    let agent = dir_agent(&dir);
    let pods: Vec<(Netns, Sandbox)> = (0..100)
        .map(|i| {
            let netns = Netns::new("mc-e2e-many").expect("netns");
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
    for (netns, _) in &pods {
        let rules = leftovers(netns).expect("rules");
        assert!(
            rules.iter().any(|l| l.contains("ISTIO_OUTPUT")),
            "{}: {rules:?}",
            netns.name()
        );
    }
    run_all("DEL");
    for (netns, _) in &pods {
        assert_eq!(
            leftovers(netns).expect("leftovers"),
            Vec::<String>::new(),
            "{}",
            netns.name()
        );
    }
    let records = std::fs::read_dir(agent.state_dir().join("iptables"))
        .expect("records")
        .count();
    assert_eq!(records, 0, "no iptables records left");
    let (_, metrics) = agent.http_get("/metrics").expect("metrics");
    assert!(
        metrics.contains(r#"meshcap_pods_captured{backend="iptables"} 0"#),
        "{metrics}"
    );
}
