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
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{Context as _, ensure};
use meshcap_tests::require_root;

use crate::{
    pods::{Baseline, Node},
    report::{
        ambient, data_path, footprint, inbound, mesh_hop, pod_setup, policy_scale, repair_in_place,
    },
    workload::{Load, MSG},
};

/// How much work a run does.
pub(crate) struct Plan {
    pub(crate) rounds: usize,
    pub(crate) load: Load,
    /// The per-round pass of short connections that measures each eBPF mode's kernel time
    /// per connection (statistics on), after the round's rates.
    pub(crate) cost: Load,
    /// Rounds of the mesh hop (each runs every message size).
    pub(crate) hop_rounds: usize,
    /// The mesh hop's load per message size (bulk with the smallest only).
    pub(crate) hop_load: Load,
    pub(crate) scale_rounds: usize,
    pub(crate) scale_load: Load,
    pub(crate) plugin_runs: usize,
    /// Pods ADDed (and DELeted) per backend; the agent's RSS is read at 100 and at this.
    pub(crate) setup_pods: usize,
    /// Broken pods repaired in place per backend.
    pub(crate) repair_pods: usize,
    /// The node sizes (captured pods) a verification pass goes over, per backend.
    pub(crate) verify_pods: &'static [usize],
    /// Kubelet's parallelism: pods on the node, new pods per batch, rounds per concurrency.
    pub(crate) churn: (usize, usize, usize),
    /// Through the real ztunnel: alternated rounds, the load per round, way and layout, and
    /// the kernel-time pass after each round.
    pub(crate) ztunnel_rounds: usize,
    pub(crate) ztunnel: Load,
    pub(crate) cost_ztunnel: Load,
}

impl Plan {
    pub(crate) fn new(quick: bool) -> Self {
        if quick {
            Self {
                rounds: 5,
                load: Load {
                    short: 5_000,
                    warmup: 200,
                    pingpong: 20_000,
                    bulk: 512 << 20,
                    size: MSG,
                },
                cost: Load {
                    short: 5_000,
                    warmup: 0,
                    pingpong: 0,
                    bulk: 0,
                    size: MSG,
                },
                hop_rounds: 3,
                hop_load: Load {
                    short: 1_500,
                    warmup: 100,
                    pingpong: 3_000,
                    bulk: 256 << 20,
                    size: MSG,
                },
                scale_rounds: 5,
                scale_load: Load {
                    short: 3_000,
                    warmup: 100,
                    pingpong: 0,
                    bulk: 0,
                    size: MSG,
                },
                plugin_runs: 20,
                setup_pods: 100,
                repair_pods: 20,
                verify_pods: &[100],
                churn: (20, 16, 1),
                ztunnel_rounds: 2,
                ztunnel: Load {
                    short: 300,
                    warmup: 30,
                    pingpong: 1_000,
                    bulk: 64 << 20,
                    size: MSG,
                },
                cost_ztunnel: Load {
                    short: 300,
                    warmup: 0,
                    pingpong: 0,
                    bulk: 0,
                    size: MSG,
                },
            }
        } else {
            Self {
                rounds: 9,
                load: Load {
                    short: 20_000,
                    warmup: 1_000,
                    pingpong: 100_000,
                    bulk: 1 << 30,
                    size: MSG,
                },
                cost: Load {
                    short: 10_000,
                    warmup: 0,
                    pingpong: 0,
                    bulk: 0,
                    size: MSG,
                },
                hop_rounds: 7,
                hop_load: Load {
                    short: 5_000,
                    warmup: 300,
                    pingpong: 10_000,
                    bulk: 512 << 20,
                    size: MSG,
                },
                scale_rounds: 7,
                scale_load: Load {
                    short: 10_000,
                    warmup: 500,
                    pingpong: 0,
                    bulk: 0,
                    size: MSG,
                },
                plugin_runs: 200,
                setup_pods: 1_000,
                repair_pods: 100,
                verify_pods: &[250, 1_000],
                churn: (250, 64, 2),
                ztunnel_rounds: 5,
                ztunnel: Load {
                    short: 3_000,
                    warmup: 200,
                    pingpong: 10_000,
                    bulk: 512 << 20,
                    size: MSG,
                },
                cost_ztunnel: Load {
                    short: 2_000,
                    warmup: 0,
                    pingpong: 0,
                    bulk: 0,
                    size: MSG,
                },
            }
        }
    }
}

/// A section of the report (`--only`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Section {
    /// No capture vs iptables vs eBPF: short connections, ping-pong, bulk.
    DataPath,
    /// App → forwarding proxy → server, with 64 B, 1 KiB and 64 KiB messages.
    MeshHop,
    /// Ambient mode: no capture vs Istio's in-pod rules vs in the kernel.
    Ambient,
    /// Inbound: a client outside the pod to the app's port, captured to the proxy's 15006;
    /// the kernel's `bpf_sk_assign` and the socket-lookup hand-off (forced).
    Inbound,
    /// Short connections with growing exclude lists.
    PolicyScale,
    /// Map memory and the plugin's size and start time.
    Footprint,
    /// ADD/DEL of many pods, agent memory.
    PodSetup,
    /// A broken pod in the API to its capture in place.
    Repair,
    /// One verification pass over every capture of a node.
    Verify,
    /// New pods ADDed and DELeted 8 at a time and one at a time beside a node's pods.
    Churn,
    /// Ambient mode through the real ztunnel (`--ztunnel`): HBONE on one node and between two.
    Ztunnel,
}

/// What `meshcap-bench run` was asked for.
pub struct Options {
    pub quick: bool,
    pub cpu: usize,
    /// Sections to run; empty: all.
    pub only: Vec<Section>,
    /// The data path's short connections only, this many per round.
    pub short_only: Option<usize>,
    /// A/B: another build run beside this one.
    pub baseline: Option<Baseline>,
    /// A ztunnel binary, for [`Section::Ztunnel`].
    pub ztunnel: Option<PathBuf>,
}

impl Options {
    pub(crate) fn wants(&self, section: Section) -> bool {
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
            size: MSG,
        };
    }
    ensure!(
        opts.ztunnel.is_some() || !opts.only.contains(&Section::Ztunnel),
        "--only ztunnel needs --ztunnel PATH: a ztunnel binary, which the bench never fetches \
         or builds"
    );
    let cpu = opts.cpu;
    let exe = std::env::current_exe().context("locating meshcap-bench")?;
    let mut report = machine(opts, cpu);
    let node = if [
        Section::DataPath,
        Section::MeshHop,
        Section::PolicyScale,
        Section::Footprint,
    ]
    .into_iter()
    .any(|section| opts.wants(section))
    {
        Some(Node::new(opts.baseline.as_ref())?)
    } else {
        None
    };
    if let Some(node) = node.as_ref().filter(|_| opts.wants(Section::DataPath)) {
        eprintln!("meshcap-bench: data path, {} rounds", plan.rounds);
        report.push_str(&data_path(&plan, &exe, cpu, node)?);
    }
    if let Some(node) = node.as_ref().filter(|_| opts.wants(Section::MeshHop)) {
        eprintln!("meshcap-bench: mesh hop, {} rounds", plan.hop_rounds);
        report.push_str(&mesh_hop(&plan, &exe, cpu, node)?);
    }
    if opts.wants(Section::Ambient) {
        eprintln!("meshcap-bench: ambient mode, {} rounds", plan.rounds);
        report.push_str(&ambient(
            &plan,
            &exe,
            cpu,
            &Node::ambient(opts.baseline.as_ref())?,
        )?);
    }
    if opts.wants(Section::Inbound) {
        eprintln!("meshcap-bench: inbound, {} rounds", plan.rounds);
        report.push_str(&inbound(&plan, &exe, cpu, opts.baseline.as_ref())?);
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
    if opts.wants(Section::Repair) {
        eprintln!(
            "meshcap-bench: repair in place, {} pods per backend",
            plan.repair_pods
        );
        report.push_str(&repair_in_place(&plan));
    }
    if opts.wants(Section::Verify) {
        eprintln!(
            "meshcap-bench: verification pass, {:?} pods per backend",
            plan.verify_pods
        );
        report.push_str(&crate::verify::section(plan.verify_pods)?);
    }
    if opts.wants(Section::Churn) {
        let (node, churn, rounds) = plan.churn;
        eprintln!("meshcap-bench: kubelet's parallelism, {node} pods on the node, {churn} new");
        report.push_str(&crate::churn::section(node, churn, rounds)?);
    }
    if let Some(ztunnel) = opts
        .ztunnel
        .as_deref()
        .filter(|_| opts.wants(Section::Ztunnel))
    {
        eprintln!(
            "meshcap-bench: through the real ztunnel, {} rounds",
            plan.ztunnel_rounds
        );
        report.push_str(&crate::ztunnel::section(&plan, &exe, ztunnel)?);
    } else if opts.only.is_empty() {
        report.push_str(
            "\n## Ambient through the real ztunnel\n\nNot run: no `--ztunnel PATH` (a ztunnel \
             binary, which the bench never fetches or builds).\n",
        );
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

pub(crate) fn machine(opts: &Options, cpu: usize) -> String {
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
    if let Some(short) = opts.short_only {
        let _ = write!(command, " --short-only {short}");
    }
    if let Some(baseline) = &opts.baseline {
        let _ = write!(command, " --baseline {}", baseline.label);
    }
    if let Some(ztunnel) = &opts.ztunnel {
        let _ = write!(command, " --ztunnel {}", ztunnel.display());
    }
    format!(
        "## Machine\n\n- {cpus} × {model}, {:.1} GiB RAM, kernel {}, {iptables}\n- Command: \
         `{command}`\n- Client and proxy are both pinned to CPU {cpu} (sched_setaffinity), in \
         every mode: the numbers are CPU cost, not cross-CPU wake-up latency.\n",
        mem_kib as f64 / 1024.0 / 1024.0,
        kernel.trim()
    )
}
