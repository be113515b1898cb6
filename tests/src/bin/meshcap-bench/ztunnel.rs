//! Ambient mode through the real ztunnel (`--ztunnel PATH`): HBONE with mTLS from a pod to a
//! pod on its own node and to one on another node, for no mesh, Istio's in-pod rules and the
//! kernel capture, in alternated rounds.
//!
//! The network is one namespace that routes between the pods (`fabric`), each pod a namespace
//! with `eth0`, a veth to it, `10.98.<k>.2/24`. A simulated node is a namespace of its own
//! (its probe rule, ztunnel's admin ports), a `meshcap-agent` in ambient mode and a ztunnel
//! connected to that agent's ZDS socket; with the kernel capture the node has its own cgroup
//! root, which its agent's programs attach to and its pods and ztunnel live under, as on a
//! node. Every way has a client pod on node 1, a server pod on node 1 and one on node 2; the
//! nodes differ in nothing but their agent and their ztunnel, which is what HBONE between two
//! ztunnels needs.
//!
//! ztunnel runs without istiod, as its `testing` feature allows: `FAKE_CA=true` (its test
//! certificate authority, the same root in every ztunnel, so two nodes trust each other) and
//! `LOCAL_XDS_PATH`, a workload configuration written here naming each pod as its manifest
//! does. The binary is the operator's: nothing here fetches or builds it.
use std::{
    fmt::Write as _,
    fs,
    path::{Path, PathBuf},
    process::Command,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail, ensure};
use meshcap_tests::{
    Netns, Placement, Proc, TcpSocket, TestCgroup,
    agent::{self, Backend},
    fixtures::ManifestDir,
};

use crate::{
    cost::{self, Costs},
    pods::APP_UID,
    report::metrics_table,
    run::Plan,
    setup::Agent,
    stats::Samples,
    workload::{Load, MSG, Measured},
};

/// The server's port in its pod.
const SERVER_PORT: u16 = 8080;
/// The server's uid: neither the app's nor ztunnel's.
const SERVER_UID: u32 = 1001;
/// The client's identity as ztunnel's certificate for it names it (the pods' manifests have
/// namespace `bench` and service account `web`, `fixtures::ambient_pod`), whatever the trust
/// domain: `spiffe://<domain>/ns/bench/sa/web`.
fn is_client_identity(identity: &str) -> bool {
    identity
        .strip_prefix("spiffe://")
        .is_some_and(|rest| rest.ends_with("/ns/bench/sa/web"))
}

/// ztunnel's listeners in an enrolled pod: outbound, inbound plain text, HBONE.
const ZTUNNEL_PORTS: [u16; 3] = [15001, 15006, 15008];

/// How a pod's traffic reaches ztunnel.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Way {
    /// No mesh: the client dials the server.
    NoMesh,
    /// Istio's in-pod rules (`--backend iptables`).
    Rules,
    /// The kernel capture (`--backend ebpf`, `ambient.inKernel`).
    Kernel,
}

impl Way {
    const ALL: [Self; 3] = [Self::NoMesh, Self::Rules, Self::Kernel];

    fn label(self) -> &'static str {
        match self {
            Self::NoMesh => "no mesh",
            Self::Rules => "Istio's in-pod rules",
            Self::Kernel => "in the kernel",
        }
    }

    fn tag(self) -> &'static str {
        match self {
            Self::NoMesh => "none",
            Self::Rules => "rules",
            Self::Kernel => "kernel",
        }
    }
}

/// A pod: its namespace, address and cgroup, and the server it runs, if any.
struct Pod {
    name: String,
    ip: String,
    _server: Option<Proc>,
    cgroup: TestCgroup,
    netns: Netns,
}

/// A simulated node: its agent and the ztunnel connected to it. Fields drop in order:
/// ztunnel, the agent, then ztunnel's cgroup, the node's namespace and cgroup root.
struct Node {
    _ztunnel: Proc,
    agent: Agent,
    _ztunnel_cgroup: TestCgroup,
    _netns: Netns,
    _root: TestCgroup,
    /// ztunnel's log.
    log: PathBuf,
}

/// One way's three pods and its two nodes (none without a mesh). Pods drop before nodes.
struct Mesh {
    way: Way,
    client: Pod,
    /// The server on the client's node, and the one on the other node.
    servers: [Pod; 2],
    nodes: Vec<Node>,
}

/// Where the client's connections go: the server on its own node, or on the other.
#[derive(Clone, Copy)]
enum Layout {
    OneNode,
    TwoNodes,
}

impl Layout {
    const ALL: [Self; 2] = [Self::OneNode, Self::TwoNodes];

    fn label(self) -> &'static str {
        match self {
            Self::OneNode => "pod to pod on one node",
            Self::TwoNodes => "pod to pod between two nodes",
        }
    }

    fn server(self) -> usize {
        match self {
            Self::OneNode => 0,
            Self::TwoNodes => 1,
        }
    }
}

/// Runs the section: sets every way up, measures `plan.ztunnel_rounds` alternated rounds and
/// returns the report.
pub(crate) fn section(plan: &Plan, exe: &Path, ztunnel: &Path) -> anyhow::Result<String> {
    let version = ztunnel_version(ztunnel)?;
    let fabric = Netns::new("mcb-zt-net")?;
    fabric.run_in(|| {
        fs::write("/proc/sys/net/ipv4/ip_forward", "1").context("ip_forward in the fabric")
    })?;
    let dir = ManifestDir::new();
    let plain = TestCgroup::new("mcb-zt-plain")?;
    let mut next = 0;
    let mut planned = Vec::new();
    for way in Way::ALL {
        // The kernel way's pods live under their node's cgroup root, which its agent attaches
        // to; the other ways' under one with nothing attached.
        let roots = [
            TestCgroup::new("mcb-zt-node")?,
            TestCgroup::new("mcb-zt-node")?,
        ];
        let parent = |node: usize| {
            if way == Way::Kernel {
                &roots[node]
            } else {
                &plain
            }
        };
        let mut pod = |role: &str, node: usize| {
            next += 1;
            make_pod(
                &fabric,
                next,
                &format!("zt-{}-{role}", way.tag()),
                parent(node),
            )
        };
        let pods = [pod("client", 0)?, pod("server-1", 0)?, pod("server-2", 1)?];
        planned.push((way, pods, roots));
    }
    let local_xds = dir.0.join("local.yaml");
    fs::write(&local_xds, workloads(&planned))?;
    let mut meshes = Vec::new();
    for (way, [client, server1, server2], roots) in planned {
        let nodes = match way {
            Way::NoMesh => Vec::new(),
            Way::Rules | Way::Kernel => roots
                .into_iter()
                .zip(1..)
                .map(|(root, n)| start_node(way, n, root, &dir, &local_xds, ztunnel))
                .collect::<anyhow::Result<_>>()?,
        };
        let mut mesh = Mesh {
            way,
            client,
            servers: [server1, server2],
            nodes,
        };
        mesh.enroll(exe)?;
        meshes.push(mesh);
    }
    let load = plan.ztunnel;
    let mut results = vec![vec![Vec::new(); Way::ALL.len()]; Layout::ALL.len()];
    let mut costs: Vec<Costs> = Layout::ALL.iter().map(|_| Costs::default()).collect();
    // Connections dialled per way and layout: each run's warm-up, short ones, and one each for
    // the round trips and the bulk.
    let per_run = |load: Load| {
        load.warmup + load.short + usize::from(load.pingpong > 0) + usize::from(load.bulk > 0)
    };
    let mut dialled = vec![vec![0; Way::ALL.len()]; Layout::ALL.len()];
    let started = Instant::now();
    for round in 0..plan.ztunnel_rounds {
        for (l, &layout) in Layout::ALL.iter().enumerate() {
            for k in 0..meshes.len() {
                let i = (round + l + k) % meshes.len();
                results[l][i].push(meshes[i].measure(exe, layout, load)?);
                dialled[l][i] += per_run(load);
            }
        }
        let kernel = meshes
            .iter()
            .find(|m| m.way == Way::Kernel)
            .context("no kernel way")?;
        for (l, &layout) in Layout::ALL.iter().enumerate() {
            let agents: Vec<u32> = kernel.nodes[..=layout.server()]
                .iter()
                .map(|n| n.agent.pid())
                .collect();
            costs[l].pass(&agents, plan.cost_ztunnel, || {
                kernel.measure(exe, layout, plan.cost_ztunnel)
            })?;
            let k = meshes
                .iter()
                .position(|m| m.way == Way::Kernel)
                .unwrap_or(0);
            dialled[l][k] += per_run(plan.cost_ztunnel);
        }
        eprintln!("  round {}/{} done", round + 1, plan.ztunnel_rounds);
    }
    let measured_s = started.elapsed().as_secs_f64();
    // ztunnel logs a connection once it is closed: give the last ones a moment.
    thread::sleep(Duration::from_secs(1));
    let through: Vec<String> = meshes
        .iter()
        .enumerate()
        .filter(|(_, m)| m.way != Way::NoMesh)
        .flat_map(|(i, m)| {
            let dialled = &dialled;
            Layout::ALL.iter().enumerate().map(move |(l, layout)| {
                format!(
                    "{}, {}: {} of {}",
                    m.way.label(),
                    layout.label(),
                    m.through_ztunnel(*layout),
                    dialled[l][i]
                )
            })
        })
        .collect();
    Ok(report(
        plan, &version, &meshes, &results, &costs, &through, measured_s,
    ))
}

/// `ztunnel version`'s first lines: what the report says was measured.
fn ztunnel_version(ztunnel: &Path) -> anyhow::Result<String> {
    let out = Command::new(ztunnel)
        .arg("version")
        .output()
        .with_context(|| format!("running {} version", ztunnel.display()))?;
    ensure!(
        out.status.success(),
        "{} version: {}",
        ztunnel.display(),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text.split_whitespace().collect::<Vec<_>>().join(" "))
}

/// Pod `k`: `eth0` with `10.98.<k>.2/24`, its peer `p<k>` in `fabric` with `10.98.<k>.1/24`,
/// the default route through it, the data path's sysctls; its cgroup under `parent`.
fn make_pod(fabric: &Netns, k: usize, name: &str, parent: &TestCgroup) -> anyhow::Result<Pod> {
    let netns = Netns::new("mcb-zt-pod")?;
    let peer = format!("p{k}");
    netns.add_veth("eth0", fabric, &peer)?;
    let ip = format!("10.98.{k}.2");
    netns.add_address("eth0", &format!("{ip}/24"))?;
    netns.set_up("eth0")?;
    netns.add_default_route(&format!("10.98.{k}.1"))?;
    fabric.add_address(&peer, &format!("10.98.{k}.1/24"))?;
    fabric.set_up(&peer)?;
    netns.run_in(|| {
        fs::write("/proc/sys/net/ipv4/tcp_tw_reuse", "1")?;
        fs::write("/proc/sys/net/ipv4/ip_local_port_range", "16000 65000")?;
        Ok(())
    })?;
    Ok(Pod {
        name: name.to_owned(),
        ip,
        _server: None,
        cgroup: TestCgroup::new_under(parent.path(), "mcb-zt-pod")?,
        netns,
    })
}

/// ztunnel's local configuration: every meshed pod as a workload named as its manifest
/// (`fixtures::ambient_pod`: namespace `bench`, service account `web`), on its node, HBONE.
fn workloads(planned: &[(Way, [Pod; 3], [TestCgroup; 2])]) -> String {
    let mut out = String::from("workloads:\n");
    for (way, pods, _) in planned.iter().filter(|(way, ..)| *way != Way::NoMesh) {
        for (i, pod) in pods.iter().enumerate() {
            let node = if i == 2 { 2 } else { 1 };
            let _ = write!(
                out,
                "- uid: cluster1//v1/Pod/bench/{name}\n  name: {name}\n  namespace: bench\n  \
                 serviceAccount: web\n  workloadIps: [\"{ip}\"]\n  protocol: HBONE\n  \
                 node: {node}\n  network: \"\"\n  services: {{}}\n",
                name = pod.name,
                ip = pod.ip,
                node = node_name(*way, node),
            );
        }
    }
    out
}

fn node_name(way: Way, n: usize) -> String {
    format!("{}-{n}", way.tag())
}

/// Node `n` of `way` with its cgroup root: its namespace, agent (ambient mode; the kernel way
/// in the kernel) and its ztunnel, connected (its snapshot received).
fn start_node(
    way: Way,
    n: usize,
    root: TestCgroup,
    dir: &ManifestDir,
    local_xds: &Path,
    ztunnel: &Path,
) -> anyhow::Result<Node> {
    let netns = Netns::new("mcb-zt-node")?;
    let socket = dir.0.join(format!("{}.sock", node_name(way, n)));
    let (backend, in_kernel) = match way {
        Way::Kernel => (Backend::Ebpf, true),
        Way::NoMesh | Way::Rules => (Backend::Iptables, false),
    };
    let agent = Agent::start_ambient(
        agent::binaries(),
        backend,
        root.path(),
        &socket,
        &netns,
        in_kernel,
    )
    .with_context(|| format!("starting the agent of node {}", node_name(way, n)))?;
    let ztunnel_cgroup = TestCgroup::new_under(root.path(), "mcb-ztunnel")?;
    let log = dir.0.join(format!("ztunnel-{}.log", node_name(way, n)));
    let env = [
        "FAKE_CA=true".to_owned(),
        "XDS_ADDRESS=".to_owned(),
        "PROXY_MODE=shared".to_owned(),
        format!("NODE_NAME={}", node_name(way, n)),
        format!("INPOD_UDS={}", socket.display()),
        format!("LOCAL_XDS_PATH={}", local_xds.display()),
    ];
    let mut args: Vec<&str> = env.iter().map(String::as_str).collect();
    let program = ztunnel.to_str().context("ztunnel path")?;
    args.push(program);
    let mut proc = Proc::spawn_logged(
        Placement {
            netns: &netns,
            cgroup: Some(&ztunnel_cgroup),
            uid: 0,
            gid: 0,
        },
        Path::new("/usr/bin/env"),
        &args,
        &log,
    )?;
    wait_for(&mut proc, &log, "received snapshot sent")?;
    Ok(Node {
        _ztunnel: proc,
        agent,
        _ztunnel_cgroup: ztunnel_cgroup,
        _netns: netns,
        _root: root,
        log,
    })
}

/// Waits until ztunnel's log holds `line`, 30 s at most.
fn wait_for(ztunnel: &mut Proc, log: &Path, line: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let text = fs::read_to_string(log).unwrap_or_default();
        if text.contains(line) {
            return Ok(());
        }
        if let Some(status) = ztunnel.exited()? {
            bail!("ztunnel exited ({status}) before {line:?}: {}", tail(&text));
        }
        if Instant::now() > deadline {
            bail!("ztunnel logged no {line:?} within 30 s: {}", tail(&text));
        }
        thread::sleep(Duration::from_millis(50));
    }
}

fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(10)..].join("\n")
}

impl Mesh {
    /// Starts the servers and, with a mesh, ADDs the three pods through the plugin to their
    /// nodes' agents, waiting until ztunnel listens in each.
    fn enroll(&mut self, exe: &Path) -> anyhow::Result<()> {
        if !self.nodes.is_empty() {
            let pods = [
                (&self.client, 0),
                (&self.servers[0], 0),
                (&self.servers[1], 1),
            ];
            for (pod, node) in pods {
                self.nodes[node]
                    .agent
                    .add_ambient_at(&pod.netns, &pod.name, &pod.ip)
                    .with_context(|| format!("enrolling {}", pod.name))?;
                wait_listening(pod, &self.nodes[node])?;
            }
        }
        let port = SERVER_PORT.to_string();
        let listen = format!("0.0.0.0:{port}");
        for server in &mut self.servers {
            let mut proc = Proc::spawn(
                Placement {
                    netns: &server.netns,
                    cgroup: Some(&server.cgroup),
                    uid: SERVER_UID,
                    gid: SERVER_UID,
                },
                exe,
                &["proxy", "--listen", &listen, "--threads", "4"],
            )?;
            let line = proc.wait_line()?;
            ensure!(
                line == "ready",
                "the server in {} said {line:?}",
                server.name
            );
            server._server = Some(proc);
        }
        Ok(())
    }

    /// The client's run against the server of `layout`.
    fn measure(&self, exe: &Path, layout: Layout, load: Load) -> anyhow::Result<Measured> {
        let server = &self.servers[layout.server()];
        let args = load.client_args(&format!("{}:{SERVER_PORT}", server.ip));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = Proc::spawn(
            Placement {
                netns: &self.client.netns,
                cgroup: Some(&self.client.cgroup),
                uid: APP_UID,
                gid: APP_UID,
            },
            exe,
            &args,
        )?
        .finish()
        .with_context(|| {
            format!(
                "the client, {}, {}{}",
                self.way.label(),
                layout.label(),
                self.ztunnel_logs()
            )
        })?;
        serde_json::from_str(out.trim()).with_context(|| format!("client printed {out:?}"))
    }

    /// The connections the server of `layout` was reached by through its ztunnel, as that
    /// ztunnel's access log says: inbound, to that pod, from the client's SPIFFE identity (the
    /// peer's certificate of the mTLS).
    fn through_ztunnel(&self, layout: Layout) -> usize {
        let server = &self.servers[layout.server()];
        let Some(node) = self.nodes.get(layout.server()) else {
            return 0;
        };
        let to = format!("dst.workload=\"{}\"", server.name);
        fs::read_to_string(&node.log)
            .unwrap_or_default()
            .lines()
            .filter(|l| {
                l.contains("connection complete")
                    && l.contains("direction=\"inbound\"")
                    && l.contains(&to)
                    && field(l, "src.identity").is_some_and(is_client_identity)
            })
            .count()
    }

    /// The end of each ztunnel's log, for an error.
    fn ztunnel_logs(&self) -> String {
        self.nodes
            .iter()
            .map(|n| {
                let text = fs::read_to_string(&n.log).unwrap_or_default();
                format!("\nztunnel {}:\n{}", n.log.display(), tail(&text))
            })
            .collect()
    }
}

/// The quoted value of `key` in an access log line (`key="value"`).
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let (_, rest) = line.split_once(&format!(" {key}=\""))?;
    rest.split_once('"').map(|(value, _)| value)
}

/// Waits until ztunnel listens on its three ports in `pod`, 30 s at most.
fn wait_listening(pod: &Pod, node: &Node) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let sockets = pod.netns.tcp_sockets()?;
        let listening = |port| {
            sockets
                .iter()
                .any(|s| s.state == TcpSocket::LISTEN && s.local_port == port)
        };
        if ZTUNNEL_PORTS.into_iter().all(listening) {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "ztunnel opened no listeners in {} within 30 s: {}",
            pod.name,
            tail(&fs::read_to_string(&node.log).unwrap_or_default())
        );
        thread::sleep(Duration::from_millis(50));
    }
}

fn report(
    plan: &Plan,
    version: &str,
    meshes: &[Mesh],
    results: &[Vec<Vec<Measured>>],
    costs: &[Costs],
    through: &[String],
    measured_s: f64,
) -> String {
    let load = plan.ztunnel;
    let mut out = format!(
        "\n## Ambient through the real ztunnel\n\nztunnel: `{version}` (`ztunnel version`), \
         run with `FAKE_CA=true`, `LOCAL_XDS_PATH` and `PROXY_MODE=shared`, one per simulated \
         node, each connected to its node's agent. The client pod's app (uid {APP_UID}) dials \
         a server pod's `:{SERVER_PORT}` (an echo server, uid {SERVER_UID}): with a mesh, \
         through its ztunnel's outbound listener in the pod, HBONE with mTLS to the server's \
         ztunnel (15008), which connects to the server as the client. *Istio's in-pod rules*: \
         `meshcap-agent run --backend iptables` in ambient mode; *in the kernel*: `--backend \
         ebpf` with `ambient.inKernel=true`. {} alternated rounds; per round, way and layout: \
         {} short connections (after {} warm-up: connect, a {MSG} B request and its answer, \
         close), {} round trips on one connection, {} MiB bulk. Nothing pinned: the 2 cores \
         are shared by the client, the server and the ztunnels. Cells: median ±half the \
         round-to-round range; ratios are ratios of medians. The measured rounds took {:.0} \
         s.\n",
        plan.ztunnel_rounds,
        load.short,
        load.warmup,
        load.pingpong,
        load.bulk >> 20,
        measured_s,
    );
    let columns: Vec<String> = meshes.iter().map(|m| m.way.label().to_owned()).collect();
    let kernel = meshes.iter().position(|m| m.way == Way::Kernel);
    let rules = meshes.iter().position(|m| m.way == Way::Rules);
    for (l, layout) in Layout::ALL.iter().enumerate() {
        let mut ratios: Vec<(usize, usize)> = (1..meshes.len()).map(|i| (i, 0)).collect();
        if let (Some(kernel), Some(rules)) = (kernel, rules) {
            ratios.push((kernel, rules));
        }
        let _ = write!(out, "\n### {}\n\n", layout.label());
        out.push_str(&metrics_table(columns.clone(), &results[l], ratios).markdown());
        if let Some(kernel) = kernel {
            let p50 = Samples(results[l][kernel].iter().map(|m| m.short_p50_us).collect());
            let bpf = costs[l].total_ns();
            let _ = writeln!(
                out,
                "\nThe kernel capture's share: its programs ran {:.2} µs per connection \
                 (both nodes' agents when there are two; `BPF_ENABLE_STATS` over a pass of {} \
                 connections per round), {:.2} % of the median connection ({:.0} µs).",
                bpf / 1e3,
                plan.cost_ztunnel.short,
                bpf / 1e3 / p50.median() * 100.0,
                p50.median(),
            );
        }
    }
    let _ = writeln!(
        out,
        "\nConnections carried by ztunnel, as the server's ztunnel logged them (`connection \
         complete`, inbound, to that pod, the peer's certificate naming the client's SPIFFE \
         identity), of those the client dialled (the kernel-time passes included): {}.",
        through.join("; ")
    );
    let columns: Vec<(&str, &Costs)> = Layout::ALL.iter().map(|l| l.label()).zip(costs).collect();
    out.push_str(&cost::markdown(&columns));
    out
}
