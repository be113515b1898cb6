//! The node and its pods: a running `meshcap-agent` per backend driven through the real
//! plugin, and throwaway pods with their proxies, one per capture mode.
use std::{
    fmt::Write as _,
    fs,
    net::{Ipv4Addr, SocketAddrV4},
    os::fd::{AsFd as _, AsRawFd as _},
    path::Path,
};

use anyhow::{Context as _, bail, ensure};
use aya::maps::MapData;
use meshcap_agent::{
    backend::ebpf::Pins,
    policy::{self, RedirectPolicy, SelectConfig, Selection},
};
use meshcap_tests::{
    Netns, PROXY_UID, Placement, Proc, TestCgroup, agent::Backend, bin, fixtures::ManifestDir,
};

use crate::{
    setup::Agent,
    workload::{Load, Measured},
};

/// The app's uid and gid.
pub(crate) const APP_UID: u32 = 1000;
/// The "service" the app dials when its traffic is captured.
pub(crate) const SERVICE: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 10), 80);
/// Where the app dials when nothing captures: the proxy itself.
pub(crate) const PROXY_DIRECT: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 15001);
/// The server a forwarding proxy sends every connection on to (the service's endpoint), in
/// the pod: loopback, which neither backend captures, so both hops are the proxy's.
pub(crate) const UPSTREAM: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 18080);
/// The server's uid and gid: neither the app's nor the proxy's.
const SERVER_UID: u32 = 1001;

/// How a pod's traffic reaches its proxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// No proxy at all: the app dials the server (the mesh hop's floor).
    NoProxy,
    /// Nothing captures: the app dials the proxy port.
    Direct,
    /// Istio's rule set, applied with iptables-restore in the pod netns.
    Iptables,
    /// meshcap's programs, with an entry for the pod.
    Ebpf,
    /// Ambient mode, Istio's in-pod rules (the proxy stands in for ztunnel).
    AmbientIptables,
    /// Ambient mode in the kernel (`ambient.inKernel`).
    AmbientEbpf,
}

impl Mode {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::NoProxy => "no proxy",
            Self::Direct => "no capture",
            Self::Iptables => "iptables",
            Self::Ebpf => "eBPF",
            Self::AmbientIptables => "ambient iptables",
            Self::AmbientEbpf => "ambient eBPF",
        }
    }

    /// Whether the pod's processes must sit under the cgroup the eBPF agent attaches to.
    const fn in_kernel(self) -> bool {
        matches!(self, Self::Ebpf | Self::AmbientEbpf)
    }
}

/// The node, once per run: a running `meshcap-agent` per backend, driven through the real
/// plugin. eBPF programs attach to a throwaway cgroup that every eBPF pod's cgroup is a child
/// of (as the cgroup v2 root is in production); pods of the other modes get their cgroups under
/// a sibling with nothing attached, so every pod's processes sit at the same depth.
/// Fields drop in order: the stand-in ztunnels, the agents (their bpffs pins go, which
/// detaches), then the cgroups and the rest.
pub(crate) struct Node {
    /// With ambient mode: a stand-in ztunnel per agent, acking every pod.
    _ztunnels: Vec<Proc>,
    pub(crate) iptables: Agent,
    /// `meshcap-agent run --backend ebpf`, or why it could not run.
    pub(crate) ebpf: Result<Agent, String>,
    pub(crate) root: TestCgroup,
    pub(crate) plain: TestCgroup,
    /// With ambient mode: each agent's node netns (probe rules) and ztunnel's sockets.
    ambient: Option<(Netns, Netns, ManifestDir)>,
}

impl Node {
    pub(crate) fn new() -> anyhow::Result<Self> {
        let root = TestCgroup::new("mcb-node")?;
        let plain = TestCgroup::new("mcb-plain")?;
        let iptables = Agent::start(Backend::Iptables, plain.path())
            .context("starting meshcap-agent --backend iptables")?;
        let ebpf = Agent::start(Backend::Ebpf, root.path()).map_err(|e| format!("{e:#}"));
        Ok(Self {
            _ztunnels: Vec::new(),
            iptables,
            ebpf,
            root,
            plain,
            ambient: None,
        })
    }

    /// A node in ambient mode: the iptables agent applies Istio's in-pod rules, the eBPF agent
    /// captures in the kernel (`ambient.inKernel`); each has a stand-in ztunnel that acks every
    /// pod and opens no listener (the pod's proxy stands in for ztunnel's).
    pub(crate) fn ambient() -> anyhow::Result<Self> {
        let root = TestCgroup::new("mcb-node")?;
        let plain = TestCgroup::new("mcb-plain")?;
        let (node_iptables, node_ebpf) = (Netns::new("mcb-node")?, Netns::new("mcb-node")?);
        let sockets = ManifestDir::new();
        let (socket_iptables, socket_ebpf) =
            (sockets.0.join("iptables.sock"), sockets.0.join("ebpf.sock"));
        let iptables = Agent::start_ambient(
            Backend::Iptables,
            plain.path(),
            &socket_iptables,
            &node_iptables,
            false,
        )
        .context("starting meshcap-agent --backend iptables in ambient mode")?;
        let ebpf = Agent::start_ambient(Backend::Ebpf, root.path(), &socket_ebpf, &node_ebpf, true)
            .map_err(|e| format!("{e:#}"));
        let mut sockets_in_use = vec![&socket_iptables];
        if ebpf.is_ok() {
            sockets_in_use.push(&socket_ebpf);
        }
        let ztunnels = sockets_in_use
            .into_iter()
            .map(|socket| {
                let socket = socket.to_str().context("socket path")?;
                let mut ztunnel = Proc::spawn(
                    Placement {
                        netns: &node_iptables,
                        cgroup: None,
                        uid: 0,
                        gid: 0,
                    },
                    &bin::ztunnel(),
                    &["--socket", socket, "--acks-only"],
                )?;
                let line = ztunnel.wait_line()?;
                ensure!(
                    line == "snapshot_sent",
                    "the stand-in ztunnel said {line:?}"
                );
                Ok(ztunnel)
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(Self {
            _ztunnels: ztunnels,
            iptables,
            ebpf,
            root,
            plain,
            ambient: Some((node_iptables, node_ebpf, sockets)),
        })
    }

    /// The modes this node can measure.
    pub(crate) fn modes(&self) -> Vec<Mode> {
        let (rules, kernel) = if self.ambient.is_some() {
            (Mode::AmbientIptables, Mode::AmbientEbpf)
        } else {
            (Mode::Iptables, Mode::Ebpf)
        };
        let mut modes = vec![Mode::Direct, rules];
        if self.ebpf.is_ok() {
            modes.push(kernel);
        }
        modes
    }

    /// What the eBPF mode is, for the report.
    pub(crate) fn ebpf_description(&self) -> String {
        match &self.ebpf {
            Ok(_) => {
                "eBPF: `meshcap-agent run --backend ebpf`, the pod ADDed through meshcap-cni, \
                      the programs attached to the pods' parent cgroup."
                    .to_owned()
            }
            Err(why) => format!("eBPF: n/a, the agent could not run its eBPF backend: {why}"),
        }
    }

    /// Captures the pod in `netns` as `mode` does; returns the agent's ADD time, ms.
    pub(crate) fn add(
        &self,
        mode: Mode,
        netns: &Netns,
        excludes: &[String],
    ) -> anyhow::Result<f64> {
        match (mode, &self.ebpf) {
            (Mode::NoProxy | Mode::Direct, _) => Ok(0.0),
            (Mode::Iptables, _) => self.iptables.add(netns, netns.name(), excludes),
            (Mode::Ebpf, Ok(agent)) => agent.add(netns, netns.name(), excludes),
            (Mode::AmbientIptables, _) => self.iptables.add_ambient(netns, netns.name()),
            (Mode::AmbientEbpf, Ok(agent)) => agent.add_ambient(netns, netns.name()),
            (Mode::Ebpf | Mode::AmbientEbpf, Err(why)) => bail!("no eBPF backend: {why}"),
        }
    }

    /// The kernel's memory accounting of every map the eBPF agent pins (opened from the pins,
    /// read from this process's fdinfo).
    pub(crate) fn map_memory(&self) -> Vec<(String, u64, u64)> {
        let Some(bpffs) = self.ebpf.as_ref().ok().and_then(Agent::bpffs) else {
            return Vec::new();
        };
        let dir = Pins::new(bpffs).maps();
        let mut names: Vec<String> = fs::read_dir(&dir)
            .map(|entries| {
                entries
                    .flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        names
            .into_iter()
            .filter_map(|name| {
                let map = MapData::from_pin(dir.join(&name)).ok()?;
                let fd = map.fd().as_fd().as_raw_fd();
                let text = fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).ok()?;
                let field = |key: &str| {
                    text.lines()
                        .find_map(|l| l.strip_prefix(key))
                        .and_then(|v| v.trim().parse::<u64>().ok())
                };
                Some((name, field("max_entries:")?, field("memlock:")?))
            })
            .collect()
    }
}

/// One throwaway pod. Fields drop in order: the proxy first, then the server, the cgroup, the
/// netns.
pub(crate) struct Pod {
    pub(crate) label: String,
    pub(crate) target: SocketAddrV4,
    pub(crate) _proxy: Proc,
    /// The proxy's upstream, when it forwards.
    pub(crate) _server: Option<Proc>,
    pub(crate) cgroup: TestCgroup,
    pub(crate) netns: Netns,
    /// The agent's ADD (plugin spawn to exit), ms; 0 without one.
    pub(crate) add_ms: f64,
}

impl Pod {
    /// A pod whose proxy answers every connection itself (the capture's cost alone).
    pub(crate) fn new(
        mode: Mode,
        excludes: &[String],
        exe: &Path,
        cpu: usize,
        node: &Node,
    ) -> anyhow::Result<Self> {
        Self::start(mode, excludes, exe, cpu, node, false)
    }

    /// A pod whose proxy forwards every connection to a server in the pod ([`UPSTREAM`]), as
    /// Envoy's outbound hop does.
    pub(crate) fn forwarding(
        mode: Mode,
        exe: &Path,
        cpu: usize,
        node: &Node,
    ) -> anyhow::Result<Self> {
        Self::start(mode, &[], exe, cpu, node, true)
    }

    fn start(
        mode: Mode,
        excludes: &[String],
        exe: &Path,
        cpu: usize,
        node: &Node,
        forward: bool,
    ) -> anyhow::Result<Self> {
        let netns = pod_netns()?;
        let add_ms = node.add(mode, &netns, excludes)?;
        let parent = if mode.in_kernel() {
            node.root.path()
        } else {
            node.plain.path()
        };
        let cgroup = TestCgroup::new_under(parent, "mcb-pod")?;
        let cpu = cpu.to_string();
        let spawn = |uid: u32, args: &[&str]| -> anyhow::Result<Proc> {
            let mut proc = Proc::spawn(
                Placement {
                    netns: &netns,
                    cgroup: Some(&cgroup),
                    uid,
                    gid: uid,
                },
                exe,
                args,
            )?;
            let line = proc.wait_line()?;
            ensure!(line == "ready", "{args:?} said {line:?}");
            Ok(proc)
        };
        let upstream = UPSTREAM.to_string();
        let server = if forward {
            Some(spawn(
                SERVER_UID,
                &["proxy", "--listen", &upstream, "--cpu", &cpu],
            )?)
        } else {
            None
        };
        let mut proxy_args = vec!["proxy", "--listen", "0.0.0.0:15001", "--cpu", &cpu];
        if forward {
            proxy_args.extend(["--upstream", &upstream]);
        }
        let proxy = spawn(PROXY_UID, &proxy_args)?;
        let target = match mode {
            Mode::NoProxy => UPSTREAM,
            Mode::Direct => PROXY_DIRECT,
            Mode::Iptables | Mode::Ebpf | Mode::AmbientIptables | Mode::AmbientEbpf => SERVICE,
        };
        Ok(Self {
            label: mode.label().to_owned(),
            target,
            _proxy: proxy,
            _server: server,
            cgroup,
            netns,
            add_ms,
        })
    }

    pub(crate) fn measure(&self, exe: &Path, cpu: usize, load: Load) -> anyhow::Result<Measured> {
        let args = [
            "client".to_owned(),
            "--target".to_owned(),
            self.target.to_string(),
            "--cpu".to_owned(),
            cpu.to_string(),
            "--short".to_owned(),
            load.short.to_string(),
            "--warmup".to_owned(),
            load.warmup.to_string(),
            "--pingpong".to_owned(),
            load.pingpong.to_string(),
            "--bulk".to_owned(),
            load.bulk.to_string(),
            "--size".to_owned(),
            load.size.to_string(),
        ];
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = Proc::spawn(
            Placement {
                netns: &self.netns,
                cgroup: Some(&self.cgroup),
                uid: APP_UID,
                gid: APP_UID,
            },
            exe,
            &args,
        )?
        .finish()
        .with_context(|| format!("client in the {} pod", self.label))?;
        serde_json::from_str(out.trim()).with_context(|| format!("client printed {out:?}"))
    }
}

/// A pod network namespace: `lo`, and `eth0` (a veth whose peer stays inside) with 10.0.0.2/24
/// and the default route, as a CNI plugin leaves it.
pub(crate) fn pod_netns() -> anyhow::Result<Netns> {
    let ns = Netns::new("mcb-pod")?;
    ns.ip(&[
        "link", "add", "eth0", "type", "veth", "peer", "name", "peer0",
    ])?;
    ns.ip(&["addr", "add", "10.0.0.2/24", "dev", "eth0"])?;
    ns.ip(&["link", "set", "eth0", "up"])?;
    ns.ip(&["link", "set", "peer0", "up"])?;
    ns.ip(&["route", "add", "default", "dev", "eth0"])?;
    ns.run_in(|| {
        fs::write("/proc/sys/net/ipv4/tcp_tw_reuse", "1")?;
        fs::write("/proc/sys/net/ipv4/ip_local_port_range", "16000 65000")?;
        Ok(())
    })?;
    Ok(ns)
}

/// `excludeOutboundIPRanges` of `n` /24s, none of which holds the service.
pub(crate) fn exclude_ranges(n: usize) -> Vec<String> {
    (0..n)
        .map(|i| format!("100.{}.{}.0/24", 64 + i / 256, i % 256))
        .collect()
}

/// The pod every benchmark pod is: Istio's injected default (as in Istio's `basic` golden
/// case), with `excludes` as `excludeOutboundIPRanges`.
pub(crate) fn pod_manifest(name: &str, excludes: &[String]) -> String {
    let mut annotations = String::from("    sidecar.istio.io/status: \"true\"\n");
    if !excludes.is_empty() {
        let _ = writeln!(
            annotations,
            "    traffic.sidecar.istio.io/excludeOutboundIPRanges: \"{}\"",
            excludes.join(",")
        );
    }
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: bench\n  \
         annotations:\n{annotations}spec:\n  containers:\n  - name: app\n    image: app\n  \
         - name: istio-proxy\n    image: proxyv2\n    args: [\"proxy\", \"sidecar\"]\n\
         status:\n  podIP: 10.0.0.2\n  podIPs:\n  - ip: 10.0.0.2\n"
    )
}

/// The policy meshcap's policy module derives from [`pod_manifest`].
pub(crate) fn redirect_policy(excludes: &[String]) -> anyhow::Result<RedirectPolicy> {
    let pod = policy::parse_pod_manifest(&pod_manifest("bench", excludes))?;
    let ips = policy::status_pod_ips(&pod);
    match policy::select(&pod, &ips, &SelectConfig::default())? {
        Selection::Capture { policy } => Ok(*policy),
        Selection::Skip { reason } => bail!("the benchmark pod is not captured: {reason}"),
    }
}

/// Istio's rules for the benchmark pod, as the policy module renders them.
pub(crate) fn istio_rules(excludes: &[String]) -> anyhow::Result<String> {
    Ok(redirect_policy(excludes)?.render().v4)
}
