//! The runner: throwaway pods, one per capture mode, interleaved rounds, Markdown tables.
//!
//! Every pod is a network namespace with `lo` and a veth `eth0` (10.0.0.2/24, default route),
//! `tcp_tw_reuse=1` and ports 16000–65000 (so back-to-back short connections never run out of
//! ports in any mode), a stand-in proxy on 0.0.0.0:15001 running as uid 1337, and the app
//! running as uid 1000. The app dials 10.96.0.10:80 (a "service"), except in the no-capture
//! mode, where it dials the proxy port directly: the floor.
use std::{
    fmt::Write as _,
    fs,
    net::{Ipv4Addr, SocketAddrV4},
    os::fd::{AsFd as _, AsRawFd as _},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::{Context as _, bail, ensure};
use aya::maps::MapData;
use meshcap_agent::{
    backend::ebpf::Pins,
    policy::{self, RedirectPolicy, SelectConfig, Selection},
};
use meshcap_tests::{Netns, PROXY_UID, Placement, Proc, TestCgroup, agent::Backend, require_root};

use crate::{
    profile::Profiler,
    setup::{self, Agent},
    stats::{Samples, Table, count, human},
    workload::{Load, Measured},
};

/// The app's uid and gid.
const APP_UID: u32 = 1000;
/// The "service" the app dials when its traffic is captured.
const SERVICE: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 10), 80);
/// Where the app dials when nothing captures: the proxy itself.
const PROXY_DIRECT: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 15001);
/// excludeOutboundIPRanges sizes of the policy-scale benchmark.
const SCALE_SIZES: [usize; 4] = [1, 100, 1_000, 10_000];

/// How much work a run does.
struct Plan {
    rounds: usize,
    load: Load,
    scale_rounds: usize,
    scale_load: Load,
    plugin_runs: usize,
    /// Pods ADDed (and DELeted) per backend; the agent's RSS is read at 100 and at this.
    setup_pods: usize,
}

impl Plan {
    fn new(quick: bool) -> Self {
        if quick {
            Self {
                rounds: 5,
                load: Load {
                    short: 5_000,
                    warmup: 200,
                    pingpong: 20_000,
                    bulk: 512 << 20,
                },
                scale_rounds: 5,
                scale_load: Load {
                    short: 3_000,
                    warmup: 100,
                    pingpong: 0,
                    bulk: 0,
                },
                plugin_runs: 20,
                setup_pods: 100,
            }
        } else {
            Self {
                rounds: 9,
                load: Load {
                    short: 20_000,
                    warmup: 1_000,
                    pingpong: 100_000,
                    bulk: 1 << 30,
                },
                scale_rounds: 7,
                scale_load: Load {
                    short: 10_000,
                    warmup: 500,
                    pingpong: 0,
                    bulk: 0,
                },
                plugin_runs: 200,
                setup_pods: 1_000,
            }
        }
    }
}

/// A section of the report (`--only`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Section {
    /// No capture vs iptables vs eBPF: short connections, ping-pong, bulk.
    DataPath,
    /// Short connections with growing exclude lists.
    PolicyScale,
    /// Map memory and the plugin's size and start time.
    Footprint,
    /// ADD/DEL of many pods, agent memory.
    PodSetup,
}

/// What `meshcap-bench run` was asked for.
pub struct Options {
    pub quick: bool,
    pub cpu: usize,
    /// Sections to run; empty: all.
    pub only: Vec<Section>,
    /// Per-program kernel statistics of the eBPF data path.
    pub profile: bool,
    /// The data path's short connections only, this many per round.
    pub short_only: Option<usize>,
}

impl Options {
    fn wants(&self, section: Section) -> bool {
        self.only.is_empty() || self.only.contains(&section)
    }
}

/// Runs the benchmarks asked for and prints (and optionally writes) the tables.
pub fn run(opts: &Options, out: Option<&Path>) -> anyhow::Result<()> {
    require_root();
    let started = Instant::now();
    let mut plan = Plan::new(opts.quick);
    if let Some(short) = opts.short_only {
        plan.load = Load {
            short,
            warmup: plan.load.warmup,
            pingpong: 0,
            bulk: 0,
        };
    }
    let cpu = opts.cpu;
    let exe = std::env::current_exe().context("locating meshcap-bench")?;
    let mut report = machine(opts, cpu);
    let node = if [Section::DataPath, Section::PolicyScale, Section::Footprint]
        .into_iter()
        .any(|section| opts.wants(section))
    {
        Some(Node::new()?)
    } else {
        None
    };
    if let Some(node) = node.as_ref().filter(|_| opts.wants(Section::DataPath)) {
        eprintln!("meshcap-bench: data path, {} rounds", plan.rounds);
        report.push_str(&data_path(&plan, &exe, cpu, node, opts.profile)?);
    }
    if let Some(node) = node.as_ref().filter(|_| opts.wants(Section::PolicyScale)) {
        eprintln!("meshcap-bench: policy scale, {} rounds", plan.scale_rounds);
        report.push_str(&policy_scale(&plan, &exe, cpu, node)?);
    }
    if let Some(node) = node.as_ref().filter(|_| opts.wants(Section::Footprint)) {
        report.push_str(&footprint(&plan, &exe, node)?);
    }
    if opts.wants(Section::PodSetup) {
        eprintln!(
            "meshcap-bench: pod set-up, {} pods per backend",
            plan.setup_pods
        );
        report.push_str(&pod_setup(&plan)?);
    }
    let _ = writeln!(
        report,
        "\nThis run took {:.0} s.",
        started.elapsed().as_secs_f64()
    );
    print!("{report}");
    if let Some(out) = out {
        fs::write(out, &report).with_context(|| format!("writing {}", out.display()))?;
    }
    Ok(())
}

fn machine(opts: &Options, cpu: usize) -> String {
    let read = |path: &str| fs::read_to_string(path).unwrap_or_default();
    let cpuinfo = read("/proc/cpuinfo");
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|l| l.split_once(':'))
        .map_or("unknown", |(_, m)| m.trim());
    let cpus = cpuinfo
        .lines()
        .filter(|l| l.starts_with("processor"))
        .count();
    let mem_kib: u64 = read("/proc/meminfo")
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    let kernel = read("/proc/sys/kernel/osrelease");
    let iptables = Command::new("iptables")
        .arg("-V")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    let mut command = String::from("cargo xtask bench");
    if opts.quick {
        command.push_str(" --quick");
    }
    for section in &opts.only {
        if let Some(value) = clap::ValueEnum::to_possible_value(section) {
            let _ = write!(command, " --only {}", value.get_name());
        }
    }
    if opts.profile {
        command.push_str(" --profile");
    }
    if let Some(short) = opts.short_only {
        let _ = write!(command, " --short-only {short}");
    }
    format!(
        "## Machine\n\n- {cpus} × {model}, {:.1} GiB RAM, kernel {}, {iptables}\n- Command: \
         `{command}`\n- Client and proxy are both pinned to CPU {cpu} (sched_setaffinity), in \
         every mode: the numbers are CPU cost, not cross-CPU wake-up latency.\n",
        mem_kib as f64 / 1024.0 / 1024.0,
        kernel.trim()
    )
}

/// How a pod's traffic reaches its proxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Nothing captures: the app dials the proxy port.
    Direct,
    /// Istio's rule set, applied with iptables-restore in the pod netns.
    Iptables,
    /// meshcap's programs, with an entry for the pod.
    Ebpf,
}

impl Mode {
    fn label(self) -> &'static str {
        match self {
            Self::Direct => "no capture",
            Self::Iptables => "iptables",
            Self::Ebpf => "eBPF",
        }
    }
}

/// The node, once per run: a running `meshcap-agent` per backend, driven through the real
/// plugin. eBPF programs attach to a throwaway cgroup that every eBPF pod's cgroup is a child
/// of (as the cgroup v2 root is in production); pods of the other modes get their cgroups under
/// a sibling with nothing attached, so every pod's processes sit at the same depth.
/// Fields drop in order: the agents (their bpffs pins go, which detaches), then the cgroups.
struct Node {
    iptables: Agent,
    /// `meshcap-agent run --backend ebpf`, or why it could not run.
    ebpf: Result<Agent, String>,
    root: TestCgroup,
    plain: TestCgroup,
}

impl Node {
    fn new() -> anyhow::Result<Self> {
        let root = TestCgroup::new("mcb-node")?;
        let plain = TestCgroup::new("mcb-plain")?;
        let iptables = Agent::start(Backend::Iptables, plain.path())
            .context("starting meshcap-agent --backend iptables")?;
        let ebpf = Agent::start(Backend::Ebpf, root.path()).map_err(|e| format!("{e:#}"));
        Ok(Self {
            iptables,
            ebpf,
            root,
            plain,
        })
    }

    /// The modes this node can measure.
    fn modes(&self) -> Vec<Mode> {
        let mut modes = vec![Mode::Direct, Mode::Iptables];
        if self.ebpf.is_ok() {
            modes.push(Mode::Ebpf);
        }
        modes
    }

    /// What the eBPF mode is, for the report.
    fn ebpf_description(&self) -> String {
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
    fn add(&self, mode: Mode, netns: &Netns, excludes: &[String]) -> anyhow::Result<f64> {
        match (mode, &self.ebpf) {
            (Mode::Direct, _) => Ok(0.0),
            (Mode::Iptables, _) => self.iptables.add(netns, netns.name(), excludes),
            (Mode::Ebpf, Ok(agent)) => agent.add(netns, netns.name(), excludes),
            (Mode::Ebpf, Err(why)) => bail!("no eBPF backend: {why}"),
        }
    }

    /// The kernel's memory accounting of every map the eBPF agent pins (opened from the pins,
    /// read from this process's fdinfo).
    fn map_memory(&self) -> Vec<(String, u64, u64)> {
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

/// One throwaway pod. Fields drop in order: the proxy first, then the cgroup, then the netns.
struct Pod {
    label: String,
    target: SocketAddrV4,
    _proxy: Proc,
    cgroup: TestCgroup,
    netns: Netns,
    /// The agent's ADD (plugin spawn to exit), ms; 0 without one.
    add_ms: f64,
}

impl Pod {
    fn new(
        mode: Mode,
        excludes: &[String],
        exe: &Path,
        cpu: usize,
        node: &Node,
    ) -> anyhow::Result<Self> {
        let netns = pod_netns()?;
        let add_ms = node.add(mode, &netns, excludes)?;
        let parent = if mode == Mode::Ebpf {
            node.root.path()
        } else {
            node.plain.path()
        };
        let cgroup = TestCgroup::new_under(parent, "mcb-pod")?;
        let cpu = cpu.to_string();
        let mut proxy = Proc::spawn(
            Placement {
                netns: &netns,
                cgroup: Some(&cgroup),
                uid: PROXY_UID,
                gid: PROXY_UID,
            },
            exe,
            &["proxy", "--listen", "0.0.0.0:15001", "--cpu", &cpu],
        )?;
        let line = proxy.wait_line()?;
        ensure!(line == "ready", "the proxy said {line:?}");
        let target = if mode == Mode::Direct {
            PROXY_DIRECT
        } else {
            SERVICE
        };
        Ok(Self {
            label: mode.label().to_owned(),
            target,
            _proxy: proxy,
            cgroup,
            netns,
            add_ms,
        })
    }

    fn measure(&self, exe: &Path, cpu: usize, load: Load) -> anyhow::Result<Measured> {
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
fn pod_netns() -> anyhow::Result<Netns> {
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
fn exclude_ranges(n: usize) -> Vec<String> {
    (0..n)
        .map(|i| format!("100.{}.{}.0/24", 64 + i / 256, i % 256))
        .collect()
}

/// The pod every benchmark pod is: Istio's injected default (as in Istio's `basic` golden
/// case), with `excludes` as `excludeOutboundIPRanges`.
fn pod_manifest(name: &str, excludes: &[String]) -> String {
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
fn redirect_policy(excludes: &[String]) -> anyhow::Result<RedirectPolicy> {
    let pod = policy::parse_pod_manifest(&pod_manifest("bench", excludes))?;
    let ips = policy::status_pod_ips(&pod);
    match policy::select(&pod, &ips, &SelectConfig::default())? {
        Selection::Capture { policy } => Ok(*policy),
        Selection::Skip { reason } => bail!("the benchmark pod is not captured: {reason}"),
    }
}

/// Istio's rules for the benchmark pod, as the policy module renders them.
fn istio_rules(excludes: &[String]) -> anyhow::Result<String> {
    Ok(redirect_policy(excludes)?.render().v4)
}

/// Runs `rounds` rounds over `pods`, each round in a rotated order, and returns every pod's
/// measurements.
fn interleave(
    pods: &[Pod],
    rounds: usize,
    exe: &Path,
    cpu: usize,
    load: Load,
    mut profile: Option<(usize, &mut Profiler)>,
) -> anyhow::Result<Vec<Vec<Measured>>> {
    let mut results = vec![Vec::new(); pods.len()];
    for round in 0..rounds {
        for k in 0..pods.len() {
            let i = (round + k) % pods.len();
            match &mut profile {
                Some((profiled, profiler)) if *profiled == i => {
                    let before = profiler.snapshot();
                    let measured = profiler.sampling_flows(|| pods[i].measure(exe, cpu, load))?;
                    results[i].push(measured);
                    profiler.add_since(&before);
                }
                _ => results[i].push(pods[i].measure(exe, cpu, load)?),
            }
        }
        eprintln!("  round {}/{rounds} done", round + 1);
    }
    Ok(results)
}

fn column(runs: &[Measured], metric: impl Fn(&Measured) -> f64) -> Samples {
    Samples(runs.iter().map(metric).collect())
}

fn data_path(
    plan: &Plan,
    exe: &Path,
    cpu: usize,
    node: &Node,
    profile: bool,
) -> anyhow::Result<String> {
    let modes = node.modes();
    let pods: Vec<Pod> = modes
        .iter()
        .map(|&m| Pod::new(m, &[], exe, cpu, node))
        .collect::<anyhow::Result<_>>()?;
    let mut profiler = match (&node.ebpf, profile) {
        (Ok(agent), true) => Some(Profiler::new(agent.pid())?),
        _ => None,
    };
    let profiled = modes.iter().position(|&m| m == Mode::Ebpf);
    let results = interleave(
        &pods,
        plan.rounds,
        exe,
        cpu,
        plan.load,
        profiled.zip(profiler.as_mut()),
    )?;
    type Metric = fn(&Measured) -> f64;
    let metrics: [(&str, Metric); 6] = [
        ("short conn/s", |m| m.short_per_s),
        ("short p50 µs", |m| m.short_p50_us),
        ("short p99 µs", |m| m.short_p99_us),
        ("ping-pong p50 µs", |m| m.pingpong_p50_us),
        ("ping-pong p99 µs", |m| m.pingpong_p99_us),
        ("bulk Gbit/s", |m| m.bulk_gbit_s),
    ];
    let table = Table {
        columns: modes.iter().map(|m| m.label().to_owned()).collect(),
        ratios: if modes.len() == 3 {
            vec![(1, 0), (2, 0), (2, 1)]
        } else {
            vec![(1, 0)]
        },
        rows: metrics
            .iter()
            .map(|(name, f)| {
                (
                    (*name).to_owned(),
                    results.iter().map(|r| column(r, f)).collect(),
                )
            })
            .collect(),
    };
    let mut out = format!(
        "\n## Data path\n\n{} interleaved rounds; per round and mode: {} short connections \
         (after {} warm-up), {} round trips on one connection, {} MiB bulk. Cells: median \
         ±half the round-to-round range; ratios are ratios of medians.\n\n",
        plan.rounds,
        plan.load.short,
        plan.load.warmup,
        plan.load.pingpong,
        plan.load.bulk >> 20
    );
    out.push_str(&table.markdown());
    let rules = istio_rules(&[])?;
    let _ = write!(
        out,
        "\niptables: `meshcap-agent run --backend iptables`, the pod ADDed through meshcap-cni: \
         the {} rules (`-A` lines, nat table) of Istio's `basic` golden for a default injected \
         pod, applied with iptables-restore in the pod netns.\n\n{}\n",
        rules.lines().filter(|l| l.starts_with("-A")).count(),
        node.ebpf_description()
    );
    out.push_str("\nOriginal destination recovered by the proxy (`SO_ORIGINAL_DST`):");
    for (pod, runs) in pods.iter().zip(&results) {
        let ok: usize = runs.iter().map(|m| m.original_dst_ok).sum();
        let all: usize = runs.iter().map(|m| m.short).sum();
        let _ = write!(out, " {} {ok} of {all};", pod.label);
    }
    out.pop();
    out.push_str(".\n");
    if let Some(profiler) = &profiler {
        out.push_str(&profiler.markdown(plan.rounds * (plan.load.short + plan.load.warmup)));
    }
    Ok(out)
}

fn policy_scale(plan: &Plan, exe: &Path, cpu: usize, node: &Node) -> anyhow::Result<String> {
    let ebpf = node.ebpf.is_ok();
    let mut modes = vec![Mode::Iptables];
    if ebpf {
        modes.push(Mode::Ebpf);
    }
    // pods[0] is the floor; then, per size, one pod per mode.
    let mut pods = vec![Pod::new(Mode::Direct, &[], exe, cpu, node)?];
    for n in SCALE_SIZES {
        for &mode in &modes {
            let mut pod = Pod::new(mode, &exclude_ranges(n), exe, cpu, node)?;
            pod.label = format!("{} {n}", mode.label());
            pods.push(pod);
        }
    }
    let results = interleave(&pods, plan.scale_rounds, exe, cpu, plan.scale_load, None)?;
    let floor = column(&results[0], |m| m.short_per_s);
    let mut out = format!(
        "\n## Policy scale\n\nShort connections with `excludeOutboundIPRanges` of N /24s (none \
         matches the service, so every connection passes the whole list). {} interleaved \
         rounds of {} connections (after {} warm-up); the no-capture floor ran in the same \
         rounds: {} conn/s ±{:.0}%. ADD: the plugin's wall time capturing that pod.\n\n| \
         CIDRs | iptables ADD ms | iptables conn/s | iptables p99 µs | iptables vs 1 CIDR | eBPF \
         ADD ms | eBPF conn/s | eBPF p99 µs | eBPF vs 1 CIDR |\n|---|---|---|---|---|---|---|---|---|\n",
        plan.scale_rounds,
        plan.scale_load.short,
        plan.scale_load.warmup,
        human(floor.median()),
        floor.spread_pct()
    );
    let base: Vec<f64> = (0..modes.len())
        .map(|m| column(&results[1 + m], |r| r.short_per_s).median())
        .collect();
    for (k, n) in SCALE_SIZES.iter().enumerate() {
        let _ = write!(out, "| {} |", count(*n));
        for (m, base) in base.iter().enumerate() {
            let i = 1 + k * modes.len() + m;
            let rate = column(&results[i], |r| r.short_per_s);
            let p99 = column(&results[i], |r| r.short_p99_us);
            let _ = write!(
                out,
                " {} | {} ±{:.0}% | {} ±{:.0}% | {:.2} |",
                human(pods[i].add_ms),
                human(rate.median()),
                rate.spread_pct(),
                human(p99.median()),
                p99.spread_pct(),
                rate.median() / base
            );
        }
        if modes.len() == 1 {
            out.push_str(" n/a | n/a | n/a | n/a |");
        }
        out.push('\n');
    }
    if !ebpf {
        out.push_str(
            "\neBPF: n/a until `meshcap-agent run --backend ebpf` runs (see the data path).\n",
        );
    }
    Ok(out)
}

fn footprint(plan: &Plan, exe: &Path, node: &Node) -> anyhow::Result<String> {
    let mut out = String::from("\n## Footprint\n\n");
    let maps = node.map_memory();
    let total: u64 = maps.iter().map(|m| m.2).sum();
    let _ = writeln!(
        out,
        "BPF maps the eBPF agent pins (kernel memlock accounting, from fdinfo): {} KiB in total.\n\n| map | \
         max entries | memlock KiB |\n|---|---|---|",
        total / 1024
    );
    for (name, max, memlock) in &maps {
        let _ = writeln!(
            out,
            "| {name} | {} | {} |",
            human(*max as f64),
            memlock / 1024
        );
    }
    let plugin = sibling(exe, "meshcap-cni");
    if let Ok(meta) = fs::metadata(&plugin) {
        let mut times = Vec::with_capacity(plan.plugin_runs);
        for _ in 0..plan.plugin_runs {
            let start = Instant::now();
            let status = Command::new(&plugin)
                .env("CNI_COMMAND", "VERSION")
                .stdout(Stdio::null())
                .status()?;
            times.push(start.elapsed().as_secs_f64() * 1e6);
            ensure!(status.success(), "meshcap-cni VERSION failed");
        }
        let mut samples = Samples(times);
        let p50 = samples.median();
        samples.0.sort_by(f64::total_cmp);
        let p99 = samples.0[(samples.0.len() * 99).div_ceil(100).max(1) - 1];
        let _ = writeln!(
            out,
            "\nPlugin `meshcap-cni` (release): {:.0} KiB; start to exit (`CNI_COMMAND=VERSION`, \
             {} runs): p50 {} µs, p99 {} µs.",
            meta.len() as f64 / 1024.0,
            plan.plugin_runs,
            human(p50),
            human(p99)
        );
    } else {
        let _ = writeln!(
            out,
            "\nPlugin binary not found beside meshcap-bench ({}): build it with `cargo build \
             --release -p meshcap-cni`.",
            plugin.display()
        );
    }
    Ok(out)
}

/// Latency of ADD and DEL is reported over this many pods (and over all of them).
const SETUP_LATENCY_PODS: usize = 200;

fn pod_setup(plan: &Plan) -> anyhow::Result<String> {
    let pods = setup::sandboxes(plan.setup_pods)?;
    let mut rss_at = vec![100, plan.setup_pods];
    rss_at.dedup();
    let results: Vec<_> = [Backend::Iptables, Backend::Ebpf]
        .into_iter()
        .map(|backend| {
            eprintln!("  {}", backend.name());
            setup::run(backend, &pods, &rss_at)
        })
        .collect();
    drop(pods);
    let first = SETUP_LATENCY_PODS.min(plan.setup_pods);
    let mut out = format!(
        "\n## Pod set-up and agent memory\n\nThe real `meshcap-cni` binary run as kubelet runs it (CNI \
         environment, configuration with `prevResult` on stdin) against a running \
         `meshcap-agent run --pods dir --backend B`, one pod netns (lo, veth eth0) per pod, \
         {n} pods ADDed one after another, then DELeted. Times are the plugin's spawn to exit. \
         The pod's manifest sits in the agent's manifest directory only during its ADD (that \
         source reads every file per lookup; the Kubernetes source looks up a watch \
         cache). Percentiles over the first {first} pods, and ADD p99 over all.\n\n| backend | \
         ADD p50 ms | ADD p99 ms | DEL p50 ms | DEL p99 ms | ADD p99 ms, all {n} \
         |\n|---|---|---|---|---|---|\n",
        n = plan.setup_pods
    );
    for r in &results {
        if let Some(why) = &r.unavailable {
            let _ = writeln!(out, "| {} | n/a: {why} | | | | |", r.backend.name());
            continue;
        }
        let (add50, add99) = setup::SetupResult::percentiles(&r.add_ms, first);
        let (del50, del99) = setup::SetupResult::percentiles(&r.del_ms, first);
        let (_, add99_all) = setup::SetupResult::percentiles(&r.add_ms, r.add_ms.len());
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} |",
            r.backend.name(),
            human(add50),
            human(add99),
            human(del50),
            human(del99),
            human(add99_all)
        );
    }
    let _ = write!(
        out,
        "\nAgent resident memory (VmRSS), idle and with pods captured:\n\n| backend | idle |"
    );
    for n in &rss_at {
        let _ = write!(out, " {} pods |", count(*n));
    }
    out.push_str("\n|---|---|");
    out.push_str(&"---|".repeat(rss_at.len()));
    out.push('\n');
    for r in &results {
        let _ = write!(out, "| {} |", r.backend.name());
        for (_, kib) in &r.rss_kib {
            let _ = write!(out, " {:.1} MiB |", *kib as f64 / 1024.0);
        }
        for _ in r.rss_kib.len()..=rss_at.len() {
            out.push_str(" n/a |");
        }
        out.push('\n');
    }
    Ok(out)
}

fn sibling(exe: &Path, name: &str) -> PathBuf {
    exe.parent().unwrap_or(Path::new(".")).join(name)
}
