//! The node and its pods: a running `meshcap-agent` per backend driven through the real
//! plugin, and throwaway pods with their proxies, one per capture mode.
use std::{
    fmt::Write as _,
    fs,
    net::{Ipv4Addr, SocketAddrV4},
    os::fd::{AsFd as _, AsRawFd as _},
    path::{Path, PathBuf},
};

use anyhow::{Context as _, bail, ensure};
use aya::maps::MapData;
use meshcap_agent::backend::ebpf::Pins;
use meshcap_policy as policy;
use meshcap_policy::{RedirectPolicy, SelectConfig, Selection};
use meshcap_tests::{
    Netns, PROXY_UID, Placement, Proc, TestCgroup,
    agent::{self, Backend},
    bin,
    fixtures::ManifestDir,
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
    /// Istio's native nftables rules (`global.nativeNftables`), one `nft -f` transaction in
    /// the pod netns.
    Nftables,
    /// meshcap's programs, with an entry for the pod.
    Ebpf,
    /// Ambient mode, Istio's in-pod rules (the proxy stands in for ztunnel).
    AmbientIptables,
    /// Ambient mode in the kernel (`ambient.inKernel`).
    AmbientEbpf,
    /// [`Self::Ebpf`] with the A/B baseline's build.
    EbpfBaseline,
    /// [`Self::AmbientEbpf`] with the A/B baseline's build.
    AmbientEbpfBaseline,
    /// [`Self::Ebpf`] with every captured inbound connection handed to the proxy through the
    /// socket lookup (the agent's `--handoff always`), as on kernels before 6.5.
    EbpfHandoff,
}

impl Mode {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::NoProxy => "no proxy",
            Self::Direct => "no capture",
            Self::Iptables => "iptables",
            Self::Nftables => "nftables",
            Self::Ebpf => "eBPF",
            Self::AmbientIptables => "ambient iptables",
            Self::AmbientEbpf => "ambient eBPF",
            Self::EbpfBaseline => "eBPF baseline",
            Self::AmbientEbpfBaseline => "ambient eBPF baseline",
            Self::EbpfHandoff => "eBPF hand-off",
        }
    }
}

/// The A/B baseline: another build's `meshcap-agent` and `meshcap-cni`, and what it is.
#[derive(Clone, Debug)]
pub(crate) struct Baseline {
    /// The directory holding its binaries.
    pub(crate) bin: PathBuf,
    /// What the report calls it (a commit, a directory).
    pub(crate) label: String,
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
    /// `meshcap-agent run --backend nftables` (sidecar data path only).
    nftables: Option<Agent>,
    /// `meshcap-agent run --backend ebpf`, or why it could not run.
    pub(crate) ebpf: Result<Agent, String>,
    /// The A/B baseline's eBPF agent (attached to `base_root`), or why it could not run.
    pub(crate) baseline: Option<(Baseline, Result<Agent, String>)>,
    /// For inbound: an eBPF agent with `--handoff always` (attached to `handoff_root`).
    handoff: Option<Result<Agent, String>>,
    pub(crate) root: TestCgroup,
    base_root: TestCgroup,
    handoff_root: TestCgroup,
    pub(crate) plain: TestCgroup,
    /// With ambient mode: each agent's node netns (probe rules) and ztunnel's sockets.
    ambient: Option<(Vec<Netns>, ManifestDir)>,
}

impl Node {
    pub(crate) fn new(baseline: Option<&Baseline>) -> anyhow::Result<Self> {
        let root = TestCgroup::new("mcb-node")?;
        let base_root = TestCgroup::new("mcb-base")?;
        let plain = TestCgroup::new("mcb-plain")?;
        let iptables = Agent::start(Backend::Iptables, plain.path())
            .context("starting meshcap-agent --backend iptables")?;
        let ebpf = Agent::start(Backend::Ebpf, root.path()).map_err(|e| format!("{e:#}"));
        let nftables = if baseline.is_none() {
            Some(
                Agent::start(Backend::Nftables, plain.path())
                    .context("starting meshcap-agent --backend nftables")?,
            )
        } else {
            None
        };
        let baseline = baseline.map(|b| {
            let agent = Agent::start_from(&b.bin, Backend::Ebpf, base_root.path())
                .map_err(|e| format!("{e:#}"));
            (b.clone(), agent)
        });
        Ok(Self {
            _ztunnels: Vec::new(),
            iptables,
            nftables,
            ebpf,
            baseline,
            handoff: None,
            root,
            base_root,
            handoff_root: TestCgroup::new("mcb-handoff")?,
            plain,
            ambient: None,
        })
    }

    /// A node for inbound capture: [`Self::new`]'s agents (the A/B baseline's among them) and
    /// one more eBPF agent whose pods get the socket lookup hand-off for every captured
    /// connection (`--handoff always`).
    pub(crate) fn inbound(baseline: Option<&Baseline>) -> anyhow::Result<Self> {
        let mut node = Self::new(baseline)?;
        node.handoff =
            Some(Agent::start_handoff(node.handoff_root.path()).map_err(|e| format!("{e:#}")));
        Ok(node)
    }

    /// The inbound modes: no capture (the client dials the proxy's port), Istio's rules, the
    /// kernel with `bpf_sk_assign` (and the A/B baseline's build of it) and with the hand-off.
    pub(crate) fn inbound_modes(&self) -> Vec<Mode> {
        let mut modes = vec![Mode::Direct, Mode::Iptables];
        if self.ebpf.is_ok() {
            modes.push(Mode::Ebpf);
        }
        if self
            .baseline
            .as_ref()
            .is_some_and(|(_, agent)| agent.is_ok())
        {
            modes.push(Mode::EbpfBaseline);
        }
        if self.handoff.as_ref().is_some_and(Result::is_ok) {
            modes.push(Mode::EbpfHandoff);
        }
        modes
    }

    /// A node in ambient mode: the iptables agent applies Istio's in-pod rules, the eBPF agent
    /// captures in the kernel (`ambient.inKernel`); each has a stand-in ztunnel that acks every
    /// pod and opens no listener (the pod's proxy stands in for ztunnel's).
    pub(crate) fn ambient(baseline: Option<&Baseline>) -> anyhow::Result<Self> {
        let root = TestCgroup::new("mcb-node")?;
        let base_root = TestCgroup::new("mcb-base")?;
        let plain = TestCgroup::new("mcb-plain")?;
        let nodes = [
            Netns::new("mcb-node")?,
            Netns::new("mcb-node")?,
            Netns::new("mcb-node")?,
        ];
        let sockets = ManifestDir::new();
        let socket = |name: &str| sockets.0.join(format!("{name}.sock"));
        let (socket_iptables, socket_ebpf, socket_base) =
            (socket("iptables"), socket("ebpf"), socket("baseline"));
        let iptables = Agent::start_ambient(
            agent::binaries(),
            Backend::Iptables,
            plain.path(),
            &socket_iptables,
            &nodes[0],
            false,
        )
        .context("starting meshcap-agent --backend iptables in ambient mode")?;
        let ebpf = Agent::start_ambient(
            agent::binaries(),
            Backend::Ebpf,
            root.path(),
            &socket_ebpf,
            &nodes[1],
            true,
        )
        .map_err(|e| format!("{e:#}"));
        let baseline = baseline.map(|b| {
            let agent = Agent::start_ambient(
                &b.bin,
                Backend::Ebpf,
                base_root.path(),
                &socket_base,
                &nodes[2],
                true,
            )
            .map_err(|e| format!("{e:#}"));
            (b.clone(), agent)
        });
        let mut sockets_in_use = vec![&socket_iptables];
        if ebpf.is_ok() {
            sockets_in_use.push(&socket_ebpf);
        }
        if baseline.as_ref().is_some_and(|(_, agent)| agent.is_ok()) {
            sockets_in_use.push(&socket_base);
        }
        let ztunnels = sockets_in_use
            .into_iter()
            .map(|socket| {
                let socket = socket.to_str().context("socket path")?;
                let mut ztunnel = Proc::spawn(
                    Placement {
                        netns: &nodes[0],
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
            nftables: None,
            ebpf,
            baseline,
            handoff: None,
            root,
            base_root,
            handoff_root: TestCgroup::new("mcb-handoff")?,
            plain,
            ambient: Some((nodes.into(), sockets)),
        })
    }

    /// The modes this node can measure: no capture, Istio's rules (sidecar pods: with nftables
    /// too) and the kernel; with an A/B baseline, no capture, the baseline's kernel capture and
    /// this build's.
    pub(crate) fn modes(&self) -> Vec<Mode> {
        let ambient = self.ambient.is_some();
        let (rules, kernel, base) = if ambient {
            (
                Mode::AmbientIptables,
                Mode::AmbientEbpf,
                Mode::AmbientEbpfBaseline,
            )
        } else {
            (Mode::Iptables, Mode::Ebpf, Mode::EbpfBaseline)
        };
        let mut modes = vec![Mode::Direct];
        if self.nftables.is_some() && !ambient {
            modes.push(Mode::Nftables);
        }
        match &self.baseline {
            None => modes.push(rules),
            Some((_, Ok(_))) => modes.push(base),
            Some((_, Err(_))) => {}
        }
        if self.ebpf.is_ok() {
            modes.push(kernel);
        }
        modes
    }

    /// The eBPF agent of `mode`, if it runs one.
    pub(crate) fn ebpf_agent(&self, mode: Mode) -> Option<&Agent> {
        match mode {
            Mode::Ebpf | Mode::AmbientEbpf => self.ebpf.as_ref().ok(),
            Mode::EbpfBaseline | Mode::AmbientEbpfBaseline => self
                .baseline
                .as_ref()
                .and_then(|(_, agent)| agent.as_ref().ok()),
            Mode::EbpfHandoff => self.handoff.as_ref().and_then(|agent| agent.as_ref().ok()),
            Mode::NoProxy
            | Mode::Direct
            | Mode::Iptables
            | Mode::Nftables
            | Mode::AmbientIptables => None,
        }
    }

    /// What the eBPF modes are, for the report.
    pub(crate) fn ebpf_description(&self) -> String {
        let mut out = match &self.ebpf {
            Ok(_) => {
                "eBPF: `meshcap-agent run --backend ebpf`, the pod ADDed through meshcap-cni, \
                      the programs attached to the pods' parent cgroup."
                    .to_owned()
            }
            Err(why) => format!("eBPF: n/a, the agent could not run its eBPF backend: {why}"),
        };
        match &self.baseline {
            None => {}
            Some((b, Ok(_))) => {
                let _ = write!(
                    out,
                    " *baseline*: the same with the build {} (its `meshcap-agent` and \
                     `meshcap-cni`, from `{}`), its programs attached to a cgroup of their own.",
                    b.label,
                    b.bin.display()
                );
            }
            Some((b, Err(why))) => {
                let _ = write!(
                    out,
                    " Baseline {}: n/a, its agent did not run: {why}",
                    b.label
                );
            }
        }
        out
    }

    /// Captures the pod in `netns` as `mode` does; returns the agent's ADD time, ms.
    pub(crate) fn add(
        &self,
        mode: Mode,
        netns: &Netns,
        excludes: &[String],
    ) -> anyhow::Result<f64> {
        let ebpf = || {
            self.ebpf_agent(mode)
                .with_context(|| format!("no eBPF agent for {}", mode.label()))
        };
        match mode {
            Mode::NoProxy | Mode::Direct => Ok(0.0),
            Mode::Iptables => self.iptables.add(netns, netns.name(), excludes),
            Mode::Nftables => self.nftables.as_ref().context("no nftables agent")?.add(
                netns,
                netns.name(),
                excludes,
            ),
            Mode::Ebpf | Mode::EbpfBaseline | Mode::EbpfHandoff => {
                ebpf()?.add(netns, netns.name(), excludes)
            }
            Mode::AmbientIptables => self.iptables.add_ambient(netns, netns.name()),
            Mode::AmbientEbpf | Mode::AmbientEbpfBaseline => {
                ebpf()?.add_ambient(netns, netns.name())
            }
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

/// What a pod's proxy does, and where its client is.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// The proxy answers every connection itself (the capture's cost alone); the app dials
    /// it from inside the pod.
    Answering,
    /// The proxy forwards every connection to a server in the pod ([`UPSTREAM`]).
    Forwarding,
    /// The proxy listens on the inbound port (15006, `SO_REUSEPORT` listeners as Envoy's
    /// workers have) and a client outside the pod dials the app's port ([`INBOUND`]).
    Inbound,
}

/// The app's port a client outside the pod dials (captured inbound).
pub(crate) const INBOUND: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 2), 8080);
/// Where that client dials when nothing captures: the proxy's inbound port.
const INBOUND_DIRECT: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 2), 15006);

/// One throwaway pod. Fields drop in order: the proxy first, then the server, the client's
/// place, the cgroup, the netns.
pub(crate) struct Pod {
    pub(crate) mode: Mode,
    pub(crate) label: String,
    pub(crate) target: SocketAddrV4,
    pub(crate) _proxy: Proc,
    /// The proxy's upstream, when it forwards.
    pub(crate) _server: Option<Proc>,
    /// Inbound: the client's cgroup (with nothing attached) and its netns, which holds the
    /// peer of the pod's `eth0`.
    client: Option<(TestCgroup, Netns)>,
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
        Self::start(mode, excludes, exe, cpu, node, Kind::Answering)
    }

    /// A pod whose proxy answers on the inbound port, dialled from a client outside the pod.
    pub(crate) fn inbound(mode: Mode, exe: &Path, cpu: usize, node: &Node) -> anyhow::Result<Self> {
        Self::start(mode, &[], exe, cpu, node, Kind::Inbound)
    }

    /// A pod whose proxy forwards every connection to a server in the pod ([`UPSTREAM`]), as
    /// Envoy's outbound hop does.
    pub(crate) fn forwarding(
        mode: Mode,
        exe: &Path,
        cpu: usize,
        node: &Node,
    ) -> anyhow::Result<Self> {
        Self::start(mode, &[], exe, cpu, node, Kind::Forwarding)
    }

    fn start(
        mode: Mode,
        excludes: &[String],
        exe: &Path,
        cpu: usize,
        node: &Node,
        kind: Kind,
    ) -> anyhow::Result<Self> {
        let (netns, client_netns) = if kind == Kind::Inbound {
            let (pod, client) = inbound_netns()?;
            (pod, Some(client))
        } else {
            (pod_netns()?, None)
        };
        let add_ms = node.add(mode, &netns, excludes)?;
        let parent = match mode {
            Mode::Ebpf | Mode::AmbientEbpf => node.root.path(),
            Mode::EbpfBaseline | Mode::AmbientEbpfBaseline => node.base_root.path(),
            Mode::EbpfHandoff => node.handoff_root.path(),
            Mode::NoProxy
            | Mode::Direct
            | Mode::Iptables
            | Mode::Nftables
            | Mode::AmbientIptables => node.plain.path(),
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
        let forward = kind == Kind::Forwarding;
        let server = if forward {
            Some(spawn(
                SERVER_UID,
                &["proxy", "--listen", &upstream, "--cpu", &cpu],
            )?)
        } else {
            None
        };
        let listen = if kind == Kind::Inbound {
            "0.0.0.0:15006"
        } else {
            "0.0.0.0:15001"
        };
        let mut proxy_args = vec!["proxy", "--listen", listen, "--cpu", &cpu];
        if forward {
            proxy_args.extend(["--upstream", &upstream]);
        }
        if kind == Kind::Inbound {
            proxy_args.push("--reuseport");
        }
        let proxy = spawn(PROXY_UID, &proxy_args)?;
        let client = match client_netns {
            Some(netns) => Some((
                TestCgroup::new_under(node.plain.path(), "mcb-client")?,
                netns,
            )),
            None => None,
        };
        let target = match mode {
            Mode::Direct if kind == Kind::Inbound => INBOUND_DIRECT,
            _ if kind == Kind::Inbound => INBOUND,
            Mode::NoProxy => UPSTREAM,
            Mode::Direct => PROXY_DIRECT,
            Mode::Iptables
            | Mode::Nftables
            | Mode::Ebpf
            | Mode::AmbientIptables
            | Mode::AmbientEbpf
            | Mode::EbpfBaseline
            | Mode::AmbientEbpfBaseline
            | Mode::EbpfHandoff => SERVICE,
        };
        Ok(Self {
            mode,
            label: mode.label().to_owned(),
            target,
            _proxy: proxy,
            _server: server,
            client,
            cgroup,
            netns,
            add_ms,
        })
    }

    pub(crate) fn measure(&self, exe: &Path, cpu: usize, load: Load) -> anyhow::Result<Measured> {
        let mut args = load.client_args(&self.target.to_string());
        args.extend(["--cpu".to_owned(), cpu.to_string()]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (cgroup, netns) = self
            .client
            .as_ref()
            .map_or((&self.cgroup, &self.netns), |(c, n)| (c, n));
        let out = Proc::spawn(
            Placement {
                netns,
                cgroup: Some(cgroup),
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

/// A pod network namespace for inbound: `lo`, and `eth0` with 10.0.0.2/24 and the default
/// route, whose veth peer (10.0.0.1/24) is in a client namespace of its own, so that the
/// client's packets arrive on the pod's `eth0` as a peer's do. Both with the sysctls of
/// [`pod_netns`].
pub(crate) fn inbound_netns() -> anyhow::Result<(Netns, Netns)> {
    let pod = Netns::new("mcb-pod")?;
    let client = Netns::new("mcb-cli")?;
    pod.ip(&[
        "link",
        "add",
        "eth0",
        "type",
        "veth",
        "peer",
        "name",
        "peer0",
        "netns",
        client.name(),
    ])?;
    pod.ip(&["addr", "add", "10.0.0.2/24", "dev", "eth0"])?;
    pod.ip(&["link", "set", "eth0", "up"])?;
    pod.ip(&["route", "add", "default", "dev", "eth0"])?;
    client.ip(&["addr", "add", "10.0.0.1/24", "dev", "peer0"])?;
    client.ip(&["link", "set", "peer0", "up"])?;
    for ns in [&pod, &client] {
        ns.run_in(|| {
            fs::write("/proc/sys/net/ipv4/tcp_tw_reuse", "1")?;
            fs::write("/proc/sys/net/ipv4/ip_local_port_range", "16000 65000")?;
            Ok(())
        })?;
    }
    Ok((pod, client))
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
