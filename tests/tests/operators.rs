//! What an Istio operator's tools see of a real agent (issue 44): Istio's metrics under Istio's
//! names, types and labels on `/metrics`, driven by real events (an installation, a plugin
//! request, a broken pod labelled, ambient mode's watch events, a stand-in ztunnel connecting);
//! health and metrics on their own ports; a port taken on the node stopping the agent with an
//! error naming it; JSON log lines with Istio's keys.
use std::{
    collections::BTreeSet,
    net::{SocketAddr, TcpListener},
    path::PathBuf,
    process::{Command, Stdio},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use meshcap_tests::{
    Netns, Proc,
    agent::{Agent, Backend, binaries},
    apiserver::ApiServer,
    bin,
    cluster::ClusterNode,
    fixtures::{ManifestDir, broken_pod, eventually, plain_pod, sidecar_pod, unique_ip},
    kubelet::{Sandbox, cni, config},
    require_root, unique_name,
    world::Node,
};
use serde_json::{Value, json};

/// Istio's node agent's metrics (istio/istio 86c9f01): name as served (OpenMetrics: a
/// counter's family without `_total`), type, and the label names of its samples.
const ISTIO_METRICS: [(&str, &str, &[&str]); 6] = [
    // cni/pkg/install/monitoring.go
    ("istio_cni_install_ready", "gauge", &[]),
    ("istio_cni_installs", "counter", &["result"]),
    // cni/pkg/repair/monitoring.go
    (
        "istio_cni_repair_pods_repaired",
        "counter",
        &["result", "type"],
    ),
    // cni/pkg/nodeagent/cni-watcher.go
    ("istio_cni_plugin_requests", "counter", &["response_code"]),
    // cni/pkg/nodeagent/informers.go
    ("nodeagent_reconcile_events", "counter", &["type"]),
    // cni/pkg/nodeagent/ztunnelserver.go
    ("ztunnel_connected", "gauge", &[]),
];

/// One sample of the exposition: its metric name, label names and value.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: BTreeSet<String>,
    label_text: String,
    value: f64,
}

fn samples(text: &str) -> Vec<Sample> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (name, label_text) = match series.split_once('{') {
                Some((name, rest)) => (name, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            let labels = label_text
                .split(',')
                .filter_map(|pair| pair.split_once('=').map(|(k, _)| k.to_owned()))
                .collect();
            Some(Sample {
                name: name.to_owned(),
                labels,
                label_text: label_text.to_owned(),
                value: value.parse().ok()?,
            })
        })
        .collect()
}

/// The value of `name{labels}` (`labels` as written in the exposition).
fn value(text: &str, name: &str, labels: &str) -> Option<f64> {
    samples(text)
        .into_iter()
        .find(|s| s.name == name && s.label_text == labels)
        .map(|s| s.value)
}

fn metrics(agent: &Agent) -> String {
    let (code, text) = agent.http_get("/metrics").expect("metrics");
    assert_eq!(code, 200, "{text}");
    text
}

/// A throwaway directory, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(prefix: &str) -> Self {
        let dir = std::env::temp_dir().join(unique_name(prefix));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        Self(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A real agent as the DaemonSet runs it (the plugin installed, the API server's pods, ambient
/// mode on, pods labelled by the repair controller): each of Istio's six metrics is served
/// with Istio's type and label names, with a sample from the event Istio counts, and the
/// `process_*` metrics read the agent's own process.
#[test]
fn the_agent_serves_istios_metrics_with_istios_names_types_and_labels() {
    require_root();
    let started = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after the epoch")
        .as_secs_f64();
    let api = ApiServer::with_configuration("operators");
    api.apply_namespace(json!({
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": "shop", "labels": {}},
    }));
    api.apply_pod(plain_pod("shop", "plain"));
    let node = Node::new().expect("node");
    let cluster = ClusterNode::new(&api);
    let sockets = Scratch::new("meshcap-ztunnel");
    let ztunnel_socket = sockets.0.join("ztunnel.sock");
    let netns = node.netns.path();
    let agent = cluster.start_agent(
        Backend::Iptables,
        &[
            ("MESHCAP_AMBIENT_ENABLED", "true"),
            (
                "MESHCAP_ZTUNNEL_SOCKET",
                ztunnel_socket.to_str().expect("utf-8"),
            ),
            ("MESHCAP_NODE_NETNS", netns.to_str().expect("utf-8")),
            ("MESHCAP_REPAIR_REPAIR_PODS", "false"),
            ("MESHCAP_REPAIR_LABEL_PODS", "true"),
        ],
    );

    // The events Istio counts: a plugin request (a pod out of the mesh, passed through by
    // the agent), a broken pod labelled, a ztunnel connecting; the watches' own events.
    let (add, _) = cluster.add("shop", "plain");
    assert!(add.success, "ADD: {add:?}\n{}", agent.log());
    api.apply_pod(broken_pod(
        sidecar_pod("shop", "broken", &[]),
        &unique_ip(),
        3,
    ));
    let socket = ztunnel_socket.to_str().expect("utf-8");
    let mut zt = Proc::spawn(node.client(), &bin::ztunnel(), &["--socket", socket])
        .expect("meshcap-ztunnel");
    assert_eq!(zt.wait_line().expect("ztunnel"), "snapshot_sent");
    eventually("the pod labelled and ztunnel counted", || {
        let text = metrics(&agent);
        value(
            &text,
            "istio_cni_repair_pods_repaired_total",
            r#"type="label",result="success""#,
        ) == Some(1.0)
            && value(&text, "ztunnel_connected", "") == Some(1.0)
    })
    .unwrap_or_else(|e| panic!("{e}\n{}\n{}", metrics(&agent), agent.log()));

    let text = metrics(&agent);
    let all = samples(&text);
    for (family, kind, labels) in ISTIO_METRICS {
        assert!(
            text.lines().any(|l| l == format!("# TYPE {family} {kind}")),
            "# TYPE {family} {kind}:\n{text}"
        );
        let sample = if kind == "counter" {
            format!("{family}_total")
        } else {
            family.to_owned()
        };
        let series: Vec<_> = all.iter().filter(|s| s.name == sample).collect();
        assert!(!series.is_empty(), "no sample of {sample}:\n{text}");
        let wanted: BTreeSet<String> = labels.iter().map(|l| (*l).to_owned()).collect();
        for s in series {
            assert_eq!(s.labels, wanted, "{sample}'s labels: {s:?}");
        }
    }
    // Each from its event, with Istio's label values.
    assert_eq!(value(&text, "istio_cni_install_ready", ""), Some(1.0));
    assert_eq!(
        value(&text, "istio_cni_installs_total", r#"result="SUCCESS""#),
        Some(1.0),
        "one installation: {text}"
    );
    assert_eq!(
        value(
            &text,
            "istio_cni_plugin_requests_total",
            r#"response_code="200""#
        ),
        Some(1.0),
        "{text}"
    );
    // The namespaces listed and this node's pods: added, as Istio's informers count them.
    assert!(
        value(&text, "nodeagent_reconcile_events_total", r#"type="add""#).is_some_and(|n| n >= 3.0),
        "{text}"
    );
    drop(zt);
    eventually("ztunnel's departure counted", || {
        value(&metrics(&agent), "ztunnel_connected", "") == Some(0.0)
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", metrics(&agent)));

    // The process's own numbers, as the Prometheus Go client reads them for Istio's agent.
    for (family, kind) in [
        ("process_cpu_seconds", "counter"),
        ("process_resident_memory_bytes", "gauge"),
        ("process_virtual_memory_bytes", "gauge"),
        ("process_open_fds", "gauge"),
        ("process_max_fds", "gauge"),
        ("process_start_time_seconds", "gauge"),
    ] {
        assert!(
            text.lines().any(|l| l == format!("# TYPE {family} {kind}")),
            "# TYPE {family} {kind}:\n{text}"
        );
    }
    let start = value(&text, "process_start_time_seconds", "").expect("start time");
    assert!(
        start >= started - 1.0 && start <= started + 120.0,
        "the agent started at {start}, the test at {started}"
    );
    let pid = agent.pid();
    let rss_pages: f64 = std::fs::read_to_string(format!("/proc/{pid}/statm"))
        .expect("statm")
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .expect("resident pages");
    let rss = value(&text, "process_resident_memory_bytes", "").expect("rss");
    // The same process read two ways, moments apart.
    assert!(
        rss > 0.0 && (rss / (rss_pages * 4096.0) - 1.0).abs() < 0.5,
        "{rss} vs {rss_pages} pages"
    );
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("fds")
        .count() as f64;
    let open = value(&text, "process_open_fds", "").expect("open fds");
    assert!((open - fds).abs() <= 5.0, "{open} vs {fds}");
}

/// `meshcap-agent run` with a directory of pods and `args`, in `dir`; its stderr in
/// `dir/agent.log`.
fn spawn_agent(dir: &Scratch, args: &[String]) -> std::process::Child {
    let pods = dir.0.join("pods");
    std::fs::create_dir_all(&pods).expect("pods");
    let log = std::fs::File::create(dir.0.join("agent.log")).expect("log");
    Command::new(binaries().join("meshcap-agent"))
        .args(["run", "--pods", "dir", "--backend", "iptables", "--pod-dir"])
        .arg(&pods)
        .arg("--socket")
        .arg(dir.0.join("agent.sock"))
        .arg("--state-dir")
        .arg(dir.0.join("state"))
        .args(args)
        .env("RUST_LOG", "info")
        .env_remove("MESHCAP_HEALTH_LISTEN")
        .env_remove("MESHCAP_METRICS_LISTEN")
        .stdin(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("starting meshcap-agent")
}

/// The address the agent's log says the endpoint serving `serves` (`Health`, `Metrics`)
/// listens on: "health and metrics endpoint listening addr=… serves=…".
fn listening_on(log: &str, serves: &str) -> Option<SocketAddr> {
    log.lines()
        .filter(|line| line.contains("endpoint listening"))
        .find(|line| line.contains(&format!("serves={serves}")))?
        .split_whitespace()
        .find_map(|field| field.strip_prefix("addr=")?.parse().ok())
}

/// The agent process, stopped by its pid on drop.
struct Running(std::process::Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    use std::io::{Read as _, Write as _};
    let mut stream = std::net::TcpStream::connect(addr).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).ok()?;
    let code = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned())?;
    Some((code, body))
}

/// Health and readiness on one port, metrics on another, as Istio's node agent serves them
/// (8000 and 15014 by default: `agent/tests/deploy.rs` and the unit tests of `paths` and
/// `api::http` hold the defaults; here, port 0 for each, and the ports the agent's log names):
/// each path where it belongs and nowhere else.
#[test]
fn health_and_metrics_are_served_on_their_own_ports() {
    require_root();
    let dir = Scratch::new("meshcap-ports");
    let _agent = Running(spawn_agent(
        &dir,
        &[
            "--health-listen".to_owned(),
            "127.0.0.1:0".to_owned(),
            "--metrics-listen".to_owned(),
            "127.0.0.1:0".to_owned(),
        ],
    ));
    let log = || std::fs::read_to_string(dir.0.join("agent.log")).unwrap_or_default();
    let (mut health, mut metrics) = (None, None);
    eventually("the agent names both ports", || {
        health = listening_on(&log(), "Health");
        metrics = listening_on(&log(), "Metrics");
        health.is_some() && metrics.is_some()
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", log()));
    let (health, metrics) = (health.expect("health"), metrics.expect("metrics"));
    assert_ne!(health, metrics);
    eventually("the agent is ready", || {
        get(health, "/readyz").is_some_and(|(code, _)| code == 200)
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", log()));
    assert_eq!(get(health, "/healthz").map(|(c, _)| c), Some(200));
    assert_eq!(get(health, "/metrics").map(|(c, _)| c), Some(404));
    let (code, text) = get(metrics, "/metrics").expect("metrics");
    assert_eq!(code, 200);
    assert!(
        text.contains("# TYPE istio_cni_install_ready gauge"),
        "{text}"
    );
    assert_eq!(get(metrics, "/healthz").map(|(c, _)| c), Some(404));
    assert_eq!(get(metrics, "/readyz").map(|(c, _)| c), Some(404));
}

/// The agent shares the node's network: a port another process holds stops it at start, with
/// an error naming the port and what it is for, before anything is opened.
#[test]
fn a_taken_port_stops_the_agent_naming_the_port_and_its_use() {
    require_root();
    let taken = TcpListener::bind("127.0.0.1:0").expect("a port");
    let port = taken.local_addr().expect("addr").port();
    for (flag, purpose) in [
        (
            "--health-listen",
            "for health and readiness (/healthz, /readyz; chart value meshcap.healthPort",
        ),
        (
            "--metrics-listen",
            "for metrics (/metrics; chart value meshcap.metricsPort",
        ),
    ] {
        let dir = Scratch::new("meshcap-taken");
        let other = if flag == "--health-listen" {
            "--metrics-listen"
        } else {
            "--health-listen"
        };
        let mut child = spawn_agent(
            &dir,
            &[
                flag.to_owned(),
                format!("127.0.0.1:{port}"),
                other.to_owned(),
                "127.0.0.1:0".to_owned(),
            ],
        );
        let deadline = Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(status) = child.try_wait().expect("wait") {
                break status;
            }
            assert!(Instant::now() < deadline, "the agent did not stop");
            std::thread::sleep(Duration::from_millis(50));
        };
        let log = std::fs::read_to_string(dir.0.join("agent.log")).expect("log");
        assert!(!status.success(), "{log}");
        let wanted = format!("port {port} on 127.0.0.1 {purpose}");
        assert!(log.contains(&wanted), "{wanted:?} not in:\n{log}");
        assert!(log.contains("is already in use on this node"), "{log}");
        // Stopped before the plugin socket was served.
        assert!(!dir.0.join("agent.sock").exists());
    }
    drop(taken);
}

/// `--log_as_json`, Istio's flag: every line is a JSON object with Istio's keys (`level`,
/// `time`, `scope`, `msg`; `pkg/log/config.go`), the time as Istio's logger writes it (UTC,
/// microseconds: `2006-01-02T15:04:05.000000Z`), the agent's scope `cni-agent`; and
/// `--log_output_level`, Istio's name for the level, is taken.
#[test]
fn json_log_lines_have_istios_keys() {
    require_root();
    let pods = ManifestDir::new();
    let pod_dir = pods.0.to_str().expect("utf-8");
    let agent = Agent::start(
        Backend::Iptables,
        &[
            "--pods",
            "dir",
            "--pod-dir",
            pod_dir,
            "--log_as_json",
            "--log_output_level=default:info",
        ],
        &[],
    )
    .expect("agent");
    let log = agent.log();
    let lines: Vec<Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}\n{log}")))
        .collect();
    assert!(
        lines.iter().any(|l| l["msg"] == "plugin socket listening"),
        "{log}"
    );
    for line in &lines {
        let object = line.as_object().expect("an object");
        let keys: Vec<&str> = object.keys().map(String::as_str).collect();
        for key in ["level", "time", "scope", "msg"] {
            assert!(keys.contains(&key), "{key} missing: {line}");
        }
        assert!(
            ["debug", "info", "warn", "error"].contains(&line["level"].as_str().unwrap_or("")),
            "{line}"
        );
        assert_eq!(line["scope"], "cni-agent", "{line}");
        let time = line["time"].as_str().expect("a string");
        let shape: String = time
            .chars()
            .map(|c| if c.is_ascii_digit() { '0' } else { c })
            .collect();
        assert_eq!(shape, "0000-00-00T00:00:00.000000Z", "{line}");
    }
}

/// The plugin's messages reach the agent's log, as Istio's plugin sends its log to its agent
/// (`cni/pkg/plugin/plugin.go`, `cni/pkg/log/uds.go`): under scope `cni-plugin`, with the pod
/// the command concerned; with no agent to take them, on the plugin's stderr (the runtime's
/// log), as before.
#[test]
fn the_plugins_messages_are_in_the_agents_log_with_their_pod() {
    require_root();
    let pods = ManifestDir::new();
    let pod_dir = pods.0.to_str().expect("utf-8");
    let agent = Agent::start(
        Backend::Iptables,
        &["--pods", "dir", "--pod-dir", pod_dir, "--log_as_json"],
        &[],
    )
    .expect("agent");
    let netns = Netns::new("meshcap-plugin-log").expect("netns");
    // A pod the plugin passes through on its own (an excluded namespace): its message is the
    // plugin's alone.
    let sandbox = Sandbox::new("kube-system", "coredns-1", &netns);
    let mut conf = config("1.0.0", &agent.socket, "10.0.0.2");
    conf["exclude_namespaces"] = json!(["kube-system"]);
    let add = cni("ADD", &sandbox, &conf).expect("ADD");
    assert!(add.success, "{add:?}");
    assert_eq!(add.stderr, "", "the agent took the plugin's lines");
    let logged = || -> Option<Value> {
        agent.log().lines().find_map(|l| {
            let line: Value = serde_json::from_str(l).ok()?;
            (line["scope"] == "cni-plugin").then_some(line)
        })
    };
    eventually("the plugin's line in the agent's log", || {
        logged().is_some()
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", agent.log()));
    let line = logged().expect("a line");
    assert_eq!(line["pod"], "kube-system/coredns-1", "{line}");
    assert_eq!(line["level"], "info", "{line}");
    assert_eq!(
        line["msg"], "passing through: namespace kube-system is in exclude_namespaces",
        "{line}"
    );
    let time = line["time"].as_str().expect("a time");
    assert!(time.ends_with('Z') && time.len() == 27, "{line}");

    // No agent: the same line on the plugin's stderr.
    drop(agent);
    let add = cni("ADD", &sandbox, &conf).expect("ADD");
    assert!(add.success, "{add:?}");
    assert!(
        add.stderr
            .contains("meshcap-cni info pod=kube-system/coredns-1")
            && add
                .stderr
                .contains("passing through: namespace kube-system is in exclude_namespaces"),
        "{}",
        add.stderr
    );
}
