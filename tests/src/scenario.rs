//! One table of capture scenarios, run against any backend: each row is a pod policy, a
//! connection, and what must answer it (the proxy on which port with which original
//! destination, or the real server).
use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
};

use anyhow::{Context as _, bail};
use meshcap_agent::{
    backend::{
        CaptureBackend as _,
        ebpf::{EbpfBackend, EbpfConfig, Handoff, TcAttach},
        iptables::{FlavourChoice, IptablesBackend, IptablesConfig},
        nftables::{NftablesBackend, NftablesConfig},
    },
    pod::PodRef,
};
use meshcap_policy::{
    CidrSet, InterceptionMode, IpPrefix, IpRanges, PodName, PortSelection, RedirectPolicy,
};

use crate::{
    Report, TestCgroup, dial, dial_failure, unique_name,
    world::{APP_UID, Node, PROXY, Pod},
};

/// TCX where the kernel has it (Linux 6.6+), else netlink TC: what the tests that keep the
/// non-default TCX path covered force (on 6.1, in the VM suite, they run the default path).
#[must_use]
pub fn tcx_where_supported() -> TcAttach {
    if aya::util::KernelVersion::current()
        .is_ok_and(|v| v >= aya::util::KernelVersion::new(6, 6, 0))
    {
        TcAttach::Tcx
    } else {
        TcAttach::Netlink
    }
}

/// A capture backend under test.
pub trait Backend {
    /// Captures the pod.
    ///
    /// # Errors
    /// The backend's.
    fn add(&self, pod: &PodRef, policy: &RedirectPolicy) -> anyhow::Result<()>;
    /// Releases the pod.
    ///
    /// # Errors
    /// The backend's.
    fn remove(&self, pod: &PodRef) -> anyhow::Result<()>;
}

/// The eBPF backend on a throwaway cgroup and bpffs directory, uninstalled on drop.
#[derive(Debug)]
pub struct EbpfUnderTest {
    backend: Option<EbpfBackend>,
}

impl EbpfUnderTest {
    /// Opens the backend attached to `cgroup`, pinned under a unique bpffs directory.
    ///
    /// # Errors
    /// When the kernel refuses.
    pub fn new(cgroup: &TestCgroup) -> anyhow::Result<Self> {
        Self::at(cgroup, &Self::unique_dir())
    }

    /// As [`Self::new`], with pods' inbound stubs attached as `tc_attach` says (TCX rather
    /// than the default netlink TC: [`tcx_where_supported`]).
    ///
    /// # Errors
    /// When the kernel refuses.
    pub fn with_tc_attach(cgroup: &TestCgroup, tc_attach: TcAttach) -> anyhow::Result<Self> {
        Self::at_with(cgroup, &Self::unique_dir(), tc_attach)
    }

    /// A fresh pin directory name for this process.
    #[must_use]
    pub fn unique_dir() -> PathBuf {
        PathBuf::from("/sys/fs/bpf")
            .join(unique_name("meshcap-test"))
            .join("v1")
    }

    /// Opens (or adopts) the backend pinned at `dir`.
    ///
    /// # Errors
    /// When the kernel refuses.
    pub fn at(cgroup: &TestCgroup, dir: &std::path::Path) -> anyhow::Result<Self> {
        Self::at_with(cgroup, dir, TcAttach::default())
    }

    /// As [`Self::at`], with pods' inbound stubs attached as `tc_attach` says.
    ///
    /// # Errors
    /// When the kernel refuses.
    pub fn at_with(
        cgroup: &TestCgroup,
        dir: &std::path::Path,
        tc_attach: TcAttach,
    ) -> anyhow::Result<Self> {
        let backend = EbpfBackend::open(EbpfConfig {
            cgroup_root: cgroup.path().to_owned(),
            bpffs_dir: dir.to_owned(),
            tc_attach,
            handoff: Handoff::default(),
        })?;
        Ok(Self {
            backend: Some(backend),
        })
    }

    /// The backend.
    ///
    /// # Panics
    /// Never: only [`Drop`] takes it.
    #[must_use]
    pub fn get(&self) -> &EbpfBackend {
        self.backend.as_ref().expect("backend present until drop")
    }

    /// Forgets the backend without uninstalling (an agent that exits), returning the pin
    /// directory.
    #[must_use]
    pub fn leave(mut self) -> PathBuf {
        let backend = self.backend.take().expect("backend present until drop");
        backend.config().bpffs_dir.clone()
    }
}

impl Drop for EbpfUnderTest {
    fn drop(&mut self) {
        if let Some(backend) = self.backend.take() {
            let parent = backend.config().bpffs_dir.parent().map(PathBuf::from);
            if let Err(err) = backend.uninstall() {
                eprintln!("cleanup: {err}");
            }
            if let Some(parent) = parent {
                let _ = std::fs::remove_dir(parent);
            }
        }
    }
}

impl Backend for EbpfUnderTest {
    fn add(&self, pod: &PodRef, policy: &RedirectPolicy) -> anyhow::Result<()> {
        Ok(self.get().add(pod, &policy.clone().into())?)
    }

    fn remove(&self, pod: &PodRef) -> anyhow::Result<()> {
        Ok(self.get().remove(pod)?)
    }
}

/// The iptables fallback with a throwaway state directory, removed on drop.
#[derive(Debug)]
pub struct IptablesUnderTest {
    backend: IptablesBackend,
    state_dir: PathBuf,
}

impl IptablesUnderTest {
    /// Opens the backend with a unique state directory under `/run`.
    ///
    /// # Errors
    /// When the directory cannot be made or no iptables works.
    pub fn new() -> anyhow::Result<Self> {
        let state_dir = PathBuf::from("/run").join(unique_name("meshcap-test-iptables"));
        let backend = IptablesBackend::new(&IptablesConfig {
            state_dir: state_dir.clone(),
            flavour: FlavourChoice::Auto,
        })?;
        Ok(Self { backend, state_dir })
    }
}

impl Drop for IptablesUnderTest {
    fn drop(&mut self) {
        if let Err(err) = std::fs::remove_dir_all(&self.state_dir) {
            eprintln!("cleanup: {}: {err}", self.state_dir.display());
        }
    }
}

impl Backend for IptablesUnderTest {
    fn add(&self, pod: &PodRef, policy: &RedirectPolicy) -> anyhow::Result<()> {
        Ok(self.backend.add(pod, &policy.clone().into())?)
    }

    fn remove(&self, pod: &PodRef) -> anyhow::Result<()> {
        Ok(self.backend.remove(pod)?)
    }
}

/// The native nftables backend ([`NftablesBackend`]) with a state directory of its own.
pub struct NftablesUnderTest {
    backend: NftablesBackend,
    state_dir: PathBuf,
}

impl NftablesUnderTest {
    /// Opens the backend with a unique state directory under `/run`.
    ///
    /// # Errors
    /// When the directory cannot be made or `nft` does not run.
    pub fn new() -> anyhow::Result<Self> {
        let state_dir = PathBuf::from("/run").join(unique_name("meshcap-test-nftables"));
        let backend = NftablesBackend::new(&NftablesConfig {
            state_dir: state_dir.clone(),
        })?;
        Ok(Self { backend, state_dir })
    }
}

impl Drop for NftablesUnderTest {
    fn drop(&mut self) {
        if let Err(err) = std::fs::remove_dir_all(&self.state_dir) {
            eprintln!("cleanup: {}: {err}", self.state_dir.display());
        }
    }
}

impl Backend for NftablesUnderTest {
    fn add(&self, pod: &PodRef, policy: &RedirectPolicy) -> anyhow::Result<()> {
        Ok(self.backend.add(pod, &policy.clone().into())?)
    }

    fn remove(&self, pod: &PodRef) -> anyhow::Result<()> {
        Ok(self.backend.remove(pod)?)
    }
}

/// Istio's defaults for a pod with these addresses (the basic golden's inputs).
#[must_use]
pub fn default_policy(name: &str, pod_ips: Vec<IpAddr>) -> RedirectPolicy {
    let ipv6 = pod_ips.iter().any(IpAddr::is_ipv6);
    RedirectPolicy {
        pod: PodName {
            namespace: "default".into(),
            name: name.into(),
        },
        pod_ips,
        ipv6,
        dual_stack: ipv6,
        mode: InterceptionMode::Redirect,
        include_outbound_ip_ranges: IpRanges::All,
        exclude_outbound_ip_ranges: CidrSet::default(),
        include_inbound_ports: PortSelection::All,
        exclude_inbound_ports: vec![15020, 15021, 15090],
        include_outbound_ports: Vec::new(),
        exclude_outbound_ports: vec![15020],
        exclude_interfaces: Vec::new(),
        reroute_virtual_interfaces: Vec::new(),
        proxy_uid: PROXY,
        proxy_gid: PROXY,
        dns_capture: false,
        invalid_drop: false,
    }
}

/// A CIDR list as the policy holds it.
///
/// # Panics
/// On a bad CIDR in a test table.
#[must_use]
pub fn cidrs(list: &[&str]) -> CidrSet {
    let mut set = CidrSet::default();
    for text in list {
        let p: IpPrefix = text.parse().expect("CIDR in a test table");
        if p.addr().is_ipv4() {
            set.v4.push(p);
        } else {
            set.v6.push(p);
        }
    }
    set
}

/// Who opens the connection.
#[derive(Clone, Copy, Debug)]
pub enum Who {
    /// The app: uid/gid 1000, in the pod's cgroup.
    App,
    /// Some uid/gid in the pod's cgroup.
    Ids(u32, u32),
    /// The proxy: uid/gid 1337.
    Proxy,
    /// A process in the pod's netns but outside every captured cgroup.
    Outside,
    /// A client on the node, dialling into the pod.
    Node,
}

/// Where it goes (addresses from [`crate::world`]).
#[derive(Clone, Copy, Debug)]
pub enum To {
    /// The node end of `eth0`.
    Peer(u16),
    /// Same, IPv6.
    PeerV6(u16),
    /// The service address on the node.
    Service(u16),
    /// The pod's own `eth0` address.
    Own(u16),
    /// Same, IPv6.
    OwnV6(u16),
    /// The node end of `eth1`.
    Side(u16),
    /// The pod's `eth1` address.
    OwnSide(u16),
    /// A literal address.
    Addr(&'static str, u16),
}

/// What must answer.
#[derive(Clone, Copy, Debug)]
pub enum Expect {
    /// The stand-in proxy on this port; for TCP its `SO_ORIGINAL_DST` is the dialled address,
    /// and the app's socket reports the dialled address as its peer (`getpeername`; for
    /// unconnected UDP, the reply's source), as under Istio's NAT.
    Captured(u16),
    /// [`Self::Captured`], and the addresses are the pod's as under Istio's NAT: the proxy sees
    /// the pod's own address as its peer, and (connected sockets) the app's `getsockname` is
    /// that same address and port.
    CapturedFromPod(u16),
    /// This server, uncaptured.
    Server(&'static str),
    /// The app, which sees the dialling client's own address as peer (TPROXY).
    AppSeesClient,
    /// Nothing: the client's `connect` is refused at once (a reset), as when `REDIRECT` finds
    /// no listener on the proxy's port.
    Refused,
    /// Nothing: the SYN goes unanswered and the client times out, as when Istio's `TPROXY`
    /// target finds no listener (it drops).
    Unanswered,
}

/// One row of the table.
#[derive(Clone, Copy, Debug)]
pub struct Case {
    /// What it checks.
    pub name: &'static str,
    /// Changes to the default policy.
    pub policy: fn(&mut RedirectPolicy),
    /// The pod is dual-stack.
    pub ipv6: bool,
    /// Who dials.
    pub from: Who,
    /// `tcp`, `udp` (unconnected) or `udpc` (connected).
    pub proto: &'static str,
    /// Where.
    pub to: To,
    /// `--bind` for the client.
    pub bind: Option<&'static str>,
    /// What must answer.
    pub expect: Expect,
    /// The stand-in proxy listens (otherwise only the app runs in the pod).
    pub proxy: bool,
}

/// A row with defaults: REDIRECT, IPv4 only, TCP, no bind, the proxy listening.
#[must_use]
pub const fn case(name: &'static str, from: Who, to: To, expect: Expect) -> Case {
    Case {
        name,
        policy: |_| {},
        ipv6: false,
        from,
        proto: "tcp",
        to,
        bind: None,
        expect,
        proxy: true,
    }
}

fn target(pod: &Pod, to: To) -> anyhow::Result<SocketAddr> {
    Ok(match to {
        To::Peer(p) => SocketAddr::new(pod.peer_v4().into(), p),
        To::PeerV6(p) => SocketAddr::new(pod.peer_v6().into(), p),
        To::Service(p) => SocketAddr::new([10, 96, 0, 10].into(), p),
        To::Own(p) => SocketAddr::new(pod.v4().into(), p),
        To::OwnV6(p) => SocketAddr::new(pod.v6().into(), p),
        To::Side(p) => SocketAddr::new(pod.side_peer_v4().into(), p),
        To::OwnSide(p) => SocketAddr::new(pod.side_v4().into(), p),
        To::Addr(a, p) => SocketAddr::new(a.parse().context("address in a test table")?, p),
    })
}

/// Runs one row in a fresh pod of `node`, with `backend`.
///
/// # Errors
/// What went wrong, or what answered instead of what was expected.
pub fn run_case(node: &mut Node, backend: &dyn Backend, c: &Case) -> anyhow::Result<()> {
    let mut pod = node.add_pod(c.ipv6)?;
    let mut policy = default_policy(c.name, pod.ips(c.ipv6));
    (c.policy)(&mut policy);
    let transparent = policy.mode == InterceptionMode::Tproxy;
    if c.proxy {
        pod.start_servers(node, policy.proxy_uid, transparent)?;
    } else {
        pod.start_app(node)?;
    }
    let pod_ref = PodRef {
        namespace: "default".into(),
        name: format!("case-{}", pod.index),
        container_id: format!("c{}", pod.index),
        netns: pod.netns.path(),
    };
    backend.add(&pod_ref, &policy)?;
    let result = check(node, &pod, c);
    backend.remove(&pod_ref)?;
    result
}

fn check(node: &Node, pod: &Pod, c: &Case) -> anyhow::Result<()> {
    let to = target(pod, c.to)?;
    let at = match c.from {
        Who::App => pod.at(node, APP_UID, APP_UID),
        Who::Ids(uid, gid) => pod.at(node, uid, gid),
        Who::Proxy => pod.at(node, PROXY, PROXY),
        Who::Outside => crate::Placement {
            cgroup: None,
            ..pod.at(node, APP_UID, APP_UID)
        },
        Who::Node => node.client(),
    };
    let target = format!("{}:{to}", c.proto);
    let failure = match c.expect {
        Expect::Refused => Some("ConnectionRefused"),
        Expect::Unanswered => Some("TimedOut"),
        _ => None,
    };
    if let Some(expected) = failure {
        let failed = dial_failure(at, &target)?;
        if failed != expected {
            bail!("{:?} expected, the client failed with {failed}", c.expect);
        }
        return Ok(());
    }
    let answer = dial(at, &target, c.bind)?;
    let Some(report) = answer else {
        bail!("nothing answered {} {to}", c.proto);
    };
    expect(c, to, &report, pod)
}

fn expect(c: &Case, to: SocketAddr, r: &Report, pod: &Pod) -> anyhow::Result<()> {
    let captured = |port| {
        r.server == "envoy"
            && r.listener == port
            && (c.proto != "tcp" || r.original_dst == Some(to))
            && r.app_peer == Some(to)
    };
    let ok = match c.expect {
        Expect::Captured(port) => captured(port),
        Expect::CapturedFromPod(port) => {
            let own: IpAddr = if to.is_ipv4() {
                pod.v4().into()
            } else {
                pod.v6().into()
            };
            captured(port)
                && r.peer.ip().to_canonical() == own
                && (c.proto == "udp" || r.app_local.map(|a| a.ip().to_canonical()) == Some(own))
                && (c.proto == "udp" || r.app_local.map(|a| a.port()) == Some(r.peer.port()))
        }
        Expect::Server(name) => r.server == name,
        Expect::AppSeesClient => {
            r.server == "app" && r.peer.ip() == IpAddr::from(pod.peer_v4()) && r.local == to
        }
        Expect::Refused | Expect::Unanswered => false,
    };
    if !ok {
        bail!("{:?} expected, got {r:?}", c.expect);
    }
    Ok(())
}

/// Runs every row (each in its own pod) and fails listing every row that failed.
///
/// # Panics
/// When a row fails.
pub fn run_table(backend: &dyn Backend, node: &mut Node, cases: &[Case]) {
    let mut failures = Vec::new();
    for c in cases {
        if let Err(err) = run_case(node, backend, c) {
            failures.push(format!("{}: {err:#}", c.name));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} scenarios failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}
