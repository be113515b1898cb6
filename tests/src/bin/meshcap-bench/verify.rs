//! The verifier's cost (issues 34, 47): the CPU and wall time of one verification pass over a
//! node of pods, per backend, as the agent itself measures each pass
//! (`meshcap_verify_last_pass_seconds`, `meshcap_verify_last_pass_cpu_seconds`: the agent's own
//! CPU and that of the commands it ran, user and system). A running `meshcap-agent` per backend
//! captures every pod through the real plugin, verifying every [`EVERY`] seconds: the passes
//! after the last ADD are the steady state. Then the agent restarts twice: first with what the
//! verifier last found whole taken away from its state directory (`<backend>-baselines`), so
//! that its first pass meets every pod with nothing remembered of its tables (the iptables
//! backend asks CHECK's `-C` of every rule, the nftables backend lists every table, as every
//! first pass did before issue 47); then as an agent restarts, the baselines kept: a pod whose
//! tables did not change is not read again. Both restarts walk the node's namespaces for the
//! pods' netns (eBPF). Legacy iptables is measured too, and ambient mode both ways (Istio's
//! in-pod rules, and the kernel), its pods enrolled with a stand-in ztunnel that acks them and
//! reconnects to the restarted agent, as ztunnel does. Every backend runs at each node size
//! asked for (250 pods, a busy node, and 1,000).
use std::{
    fmt::Write as _,
    fs, thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail, ensure};
use meshcap_tests::{
    Netns, Placement, Proc, TestCgroup,
    agent::{Agent, Backend},
    bin,
    fixtures::{ManifestDir, ambient_pod, sidecar_pod},
    kubelet::{self, Sandbox, config},
};
use serde_json::Value;

use crate::{setup, stats::Samples};

/// Seconds between two passes.
const EVERY: u64 = 5;
/// Steady-state passes measured per backend.
const PASSES: usize = 5;
/// The node the 1 % budget is stated for: kubelet's default `maxPods`, at the default interval.
const NODE_PODS: f64 = 110.0;
const DEFAULT_INTERVAL: f64 = 30.0;

/// One pass as the agent reports it.
#[derive(Clone, Copy, Debug, Default)]
struct Pass {
    wall: f64,
    cpu: f64,
}

/// A restart with the baselines kept: from the restart until `/readyz` answers 200, the
/// agent's CPU until then, its peak resident memory (`VmHWM`) once its first pass ran, and an
/// ADD sent as soon as it is ready (while that pass may run).
#[derive(Clone, Copy, Debug, Default)]
struct Restart {
    ready: f64,
    ready_cpu: f64,
    peak_mib: f64,
    add: f64,
}

/// What one agent's run measured.
struct Measured {
    /// A restarted agent's first pass, and what its start cost.
    first: Pass,
    restart: Restart,
    /// The same with no baseline kept.
    cold: Pass,
    steady: Vec<Pass>,
}

/// An agent the section measures: its label, backend and flags, and in ambient mode whether
/// its pods are in the kernel (`ambient.inKernel`).
struct Run {
    label: &'static str,
    backend: Backend,
    args: &'static [&'static str],
    ambient: Option<bool>,
}

impl Run {
    const ALL: [Self; 6] = [
        Self::sidecar("eBPF", Backend::Ebpf, &[]),
        Self::sidecar(
            "iptables (nft)",
            Backend::Iptables,
            &["--iptables-flavour", "nft"],
        ),
        Self::sidecar(
            "iptables (legacy)",
            Backend::Iptables,
            &["--iptables-flavour", "legacy"],
        ),
        Self::sidecar("nftables (native)", Backend::Nftables, &[]),
        Self {
            label: "ambient, Istio's in-pod rules",
            backend: Backend::Iptables,
            args: &[],
            ambient: Some(false),
        },
        Self {
            label: "ambient, in the kernel",
            backend: Backend::Ebpf,
            args: &[],
            ambient: Some(true),
        },
    ];

    const fn sidecar(label: &'static str, backend: Backend, args: &'static [&'static str]) -> Self {
        Self {
            label,
            backend,
            args,
            ambient: None,
        }
    }

    /// The manifest of pod `name`.
    fn manifest(&self, name: &str) -> Value {
        if self.ambient.is_some() {
            ambient_pod("bench", name)
        } else {
            sidecar_pod("bench", name, &[])
        }
    }
}

/// Runs the section at each node size of `sizes` and returns its Markdown.
pub(crate) fn section(sizes: &[usize]) -> anyhow::Result<String> {
    let mut out = format!(
        "\n## Verification pass\n\nEvery capture compared with its record, once per \
         `meshcap.verifyIntervalSeconds` (30 s by default): the cost of one pass over a node's \
         captured pods (sidecar pods; in ambient mode enrolled pods, a stand-in ztunnel acking \
         them), as the agent measures it (wall time; CPU of the agent and of the commands it \
         runs, user and system). The steady state is the median of {PASSES} passes after the \
         pods' ADDs; the first pass is a restarted agent's, which keeps what the verifier last \
         found whole in its state directory but not the pods' netns paths (goal: at most 3 s \
         of CPU for 1,000 pods); \"nothing kept\" is the same with those baselines removed, as \
         every first pass was before. The share of one core is the steady pass scaled to a \
         {NODE_PODS:.0}-pod node at the default interval (goal: under 1 %).\n\n| backend | \
         pods | first pass after a restart: wall / CPU | first pass, nothing kept: wall / CPU \
         | steady pass: wall / CPU | per pod CPU | one core, {NODE_PODS:.0} pods every \
         {DEFAULT_INTERVAL:.0} s |\n|---|---|---|---|---|---|---|\n"
    );
    let mut restarts = String::from(
        "\nThe same restarts with the baselines kept: from the restart until `/readyz` answers \
         200, the agent's CPU until then (user and system), its peak resident memory (`VmHWM`) \
         once the first pass ran, and the plugin's wall time for a pod ADDed as soon as the \
         agent is ready (in ambient mode, and its ztunnel connected again), the first pass \
         running meanwhile.\n\n| backend | pods | to Ready | CPU to Ready | peak memory | ADD \
         after Ready | first pass: wall / CPU |\n|---|---|---|---|---|---|---|\n",
    );
    for &size in sizes {
        for run in &Run::ALL {
            eprintln!("  {}, {size} pods", run.label);
            let label = run.label;
            // Sandboxes of its own: whatever a failed row leaves in them goes with them.
            let mut sandboxes = setup::sandboxes(size + 1)?;
            let extra = sandboxes.pop().context("the pod ADDed at a restart")?;
            match measure(run, &sandboxes, &extra) {
                Ok(m) => {
                    let wall = Samples(m.steady.iter().map(|p| p.wall).collect()).median();
                    let cpu = Samples(m.steady.iter().map(|p| p.cpu).collect()).median();
                    let per_pod = cpu / size as f64;
                    let share = per_pod * NODE_PODS / DEFAULT_INTERVAL * 100.0;
                    let _ = writeln!(
                        out,
                        "| {label} | {size} | {} / {} | {} / {} | {} / {} | {:.0} µs | \
                         {share:.3} % |",
                        ms(m.first.wall),
                        ms(m.first.cpu),
                        ms(m.cold.wall),
                        ms(m.cold.cpu),
                        ms(wall),
                        ms(cpu),
                        per_pod * 1e6,
                    );
                    let r = m.restart;
                    let _ = writeln!(
                        restarts,
                        "| {label} | {size} | {} | {} | {:.0} MiB | {} | {} / {} |",
                        ms(r.ready),
                        ms(r.ready_cpu),
                        r.peak_mib,
                        ms(r.add),
                        ms(m.first.wall),
                        ms(m.first.cpu),
                    );
                }
                Err(err) => {
                    let _ = writeln!(out, "| {label} | {size} | n/a: {err:#} | | | | |");
                }
            }
        }
    }
    out.push_str(&restarts);
    Ok(out)
}

fn ms(seconds: f64) -> String {
    format!("{:.0} ms", seconds * 1e3)
}

/// The stand-in ztunnel of an ambient run, on the agent's ZDS socket, its lines in a log (a
/// pipe nobody reads would fill up and stop it).
struct Ztunnel {
    proc: Proc,
    log: std::path::PathBuf,
    _node: Netns,
}

impl Ztunnel {
    /// How many snapshots it has been sent: one per connection to an agent.
    fn snapshots(&self) -> usize {
        fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter(|l| *l == "snapshot_sent")
            .count()
    }

    /// Waits until it has been sent `n` snapshots, a minute at most.
    fn wait_snapshots(&mut self, n: usize) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.snapshots() < n {
            ensure!(self.proc.exited()?.is_none(), "the stand-in ztunnel exited");
            ensure!(
                Instant::now() < deadline,
                "the stand-in ztunnel was sent no snapshot within a minute"
            );
            thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }
}

fn measure(run: &Run, sandboxes: &[Netns], extra: &Netns) -> anyhow::Result<Measured> {
    let label = run.label;
    let cgroup = TestCgroup::new("mcb-verify")?;
    let pods = ManifestDir::new();
    let mut args = vec![
        "--pods",
        "dir",
        "--pod-dir",
        pods.0.to_str().context("utf-8")?,
    ];
    args.extend_from_slice(run.args);
    let every = EVERY.to_string();
    let socket = pods.0.join("ztunnel.sock");
    let socket = socket.to_str().context("utf-8")?;
    let node = Netns::new("mcb-vnode")?;
    let node_path = node.path();
    let mut env = vec![
        ("RUST_LOG", "warn"),
        ("MESHCAP_VERIFY_INTERVAL_SECONDS", every.as_str()),
    ];
    if let Some(in_kernel) = run.ambient {
        env.extend([
            ("MESHCAP_AMBIENT_ENABLED", "true"),
            (
                "MESHCAP_AMBIENT_IN_KERNEL",
                if in_kernel { "true" } else { "false" },
            ),
            ("MESHCAP_ZTUNNEL_SOCKET", socket),
            ("MESHCAP_NODE_NETNS", node_path.to_str().context("utf-8")?),
        ]);
    }
    let mut agent = Agent::start_in(run.backend, &args, &env, Some(cgroup.path()))?;
    let mut ztunnel = match run.ambient {
        Some(_) => {
            let log = pods.0.join("ztunnel.log");
            let proc = Proc::spawn_logged(
                Placement {
                    netns: &node,
                    cgroup: None,
                    uid: 0,
                    gid: 0,
                },
                &bin::ztunnel(),
                &["--socket", socket, "--acks-only"],
                &log,
            )?;
            let mut ztunnel = Ztunnel {
                proc,
                log,
                _node: node,
            };
            ztunnel.wait_snapshots(1)?;
            Some(ztunnel)
        }
        None => None,
    };
    for (i, netns) in sandboxes.iter().enumerate() {
        let name = format!("pod-{i}");
        let manifest = pods.0.join(format!("{name}.json"));
        fs::write(&manifest, run.manifest(&name).to_string())?;
        let sandbox = Sandbox {
            container_id: format!("sandbox-{name}"),
            ..Sandbox::new("bench", &name, netns)
        };
        let conf = config("1.1.0", &agent.socket, "10.0.0.2");
        let add = kubelet::cni("ADD", &sandbox, &conf)?;
        fs::remove_file(&manifest)?;
        ensure!(add.success, "ADD of bench/{name}: {}", add.msg());
    }
    // The pass running while the last ADDs came may have missed some pods: the next one is
    // the first to meet them all.
    let after_adds = passes(&agent)?;
    wait_for_pass(&agent, after_adds + 1)?;
    let mut steady = Vec::new();
    for n in 0..PASSES {
        steady.push(wait_for_pass(&agent, after_adds + 2 + n as u64)?);
    }
    agent.kill()?;
    // The backend's baselines, and in ambient mode those of its in-pod rules, which that
    // backend keeps in a state directory of its own (`<state>/ambient`).
    let baselines = format!("{}-baselines", run.backend.name());
    let state = agent.state_dir();
    for dir in [
        state.join(&baselines),
        state.join("ambient").join(&baselines),
    ] {
        if dir.exists() {
            fs::remove_dir_all(&dir)?;
        }
    }
    let cold = first_pass(label, &mut agent)?;
    agent.kill()?;
    let snapshots = ztunnel.as_ref().map_or(0, Ztunnel::snapshots);
    let restart = Instant::now();
    agent.restart()?;
    while !agent.http_get("/readyz").is_ok_and(|(code, _)| code == 200) {
        ensure!(
            restart.elapsed() < FIRST_PASS_BOUND,
            "{label}: not ready after a restart"
        );
        thread::sleep(Duration::from_millis(10));
    }
    let ready = restart.elapsed().as_secs_f64();
    let ready_cpu = cpu_seconds(agent.pid())?;
    if let Some(ztunnel) = &mut ztunnel {
        ztunnel.wait_snapshots(snapshots + 1)?;
    }
    let extra_pod = Sandbox {
        container_id: "sandbox-extra".to_owned(),
        ..Sandbox::new("bench", "extra", extra)
    };
    let manifest = pods.0.join("extra.json");
    fs::write(&manifest, run.manifest("extra").to_string())?;
    let conf = config("1.1.0", &agent.socket, "10.0.0.2");
    let sent = Instant::now();
    let add = kubelet::cni("ADD", &extra_pod, &conf)?;
    let add_took = sent.elapsed().as_secs_f64();
    fs::remove_file(&manifest)?;
    ensure!(add.success, "{label}: ADD after a restart: {}", add.msg());
    let first = wait_for_pass_within(&agent, 1, FIRST_PASS_BOUND)?;
    untouched(label, &agent)?;
    let restart = Restart {
        ready,
        ready_cpu,
        peak_mib: peak_kib(agent.pid()) / 1024.0,
        add: add_took,
    };
    let del = kubelet::cni("DEL", &extra_pod, &conf)?;
    ensure!(del.success, "{label}: DEL of bench/extra: {}", del.msg());
    for (i, netns) in sandboxes.iter().enumerate() {
        let name = format!("pod-{i}");
        let sandbox = Sandbox {
            container_id: format!("sandbox-{name}"),
            ..Sandbox::new("bench", &name, netns)
        };
        let del = kubelet::cni("DEL", &sandbox, &config("1.1.0", &agent.socket, "10.0.0.2"))?;
        ensure!(del.success, "DEL of bench/{name}: {}", del.msg());
    }
    Ok(Measured {
        first,
        restart,
        cold,
        steady,
    })
}

/// The agent restarted, and its first pass, which must find no drift on the untouched node.
fn first_pass(label: &str, agent: &mut Agent) -> anyhow::Result<Pass> {
    agent.restart()?;
    let first = wait_for_pass_within(agent, 1, FIRST_PASS_BOUND)?;
    untouched(label, agent)?;
    Ok(first)
}

/// Whether the verifier found the untouched node so.
fn untouched(label: &str, agent: &Agent) -> anyhow::Result<()> {
    let (_, metrics) = agent.http_get("/metrics")?;
    ensure!(
        !metrics.contains("meshcap_capture_drift_total{"),
        "{label}: the verifier found drift on an untouched node"
    );
    Ok(())
}

/// The CPU `pid` has used, user and system, in seconds.
fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // After the command's `(name)`: state is field 3, utime 14 and stime 15.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .context("/proc/PID/stat")?
        .1
        .split_whitespace()
        .collect();
    let ticks: f64 = fields
        .get(11..13)
        .context("utime and stime")?
        .iter()
        .map(|f| f.parse::<f64>().unwrap_or_default())
        .sum();
    // SAFETY: sysconf reads a constant of the system.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Ok(ticks / per_second)
}

/// `pid`'s peak resident memory (`VmHWM`), KiB.
fn peak_kib(pid: u32) -> f64 {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0)
}

/// The agent's count of passes.
fn passes(agent: &Agent) -> anyhow::Result<u64> {
    Ok(metric(agent, "meshcap_verify_passes_total")?.map_or(0, |v| v as u64))
}

/// Waits until the agent has run `n` passes; the last one's wall and CPU time.
fn wait_for_pass(agent: &Agent, n: u64) -> anyhow::Result<Pass> {
    wait_for_pass_within(agent, n, Duration::from_secs(EVERY * 20))
}

/// How long a restarted agent's first pass may take: with nothing kept it asks `-C` of every
/// rule of every pod (a fork each, slower with nft iptables than with legacy), which on a busy
/// 2-core machine took over 100 s for 1,000 pods.
const FIRST_PASS_BOUND: Duration = Duration::from_secs(900);

/// [`wait_for_pass`], for at most `bound`.
fn wait_for_pass_within(agent: &Agent, n: u64, bound: Duration) -> anyhow::Result<Pass> {
    let deadline = Instant::now() + bound;
    loop {
        // One read for the count and the pass, often: a pass longer than the interval is
        // followed by the next at once (the ticks it missed), and the agent only tells of the
        // last one, so pass n is read before pass n + 1 ends or not at all.
        let (_, metrics) = agent.http_get("/metrics")?;
        let value = |series: &str| {
            metrics
                .lines()
                .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
                .and_then(|v| v.trim().parse::<f64>().ok())
        };
        let done = value("meshcap_verify_passes_total").map_or(0, |v| v as u64);
        if done == n {
            return Ok(Pass {
                wall: value("meshcap_verify_last_pass_seconds").unwrap_or_default(),
                cpu: value("meshcap_verify_last_pass_cpu_seconds").unwrap_or_default(),
            });
        }
        ensure!(
            done < n,
            "pass {n} was over before it could be read: pass {done} followed it at once"
        );
        if Instant::now() > deadline {
            bail!(
                "the agent ran no verification pass in {} s",
                bound.as_secs()
            );
        }
        // Often enough for the shortest pass measured (about 20 ms), seldom enough not to
        // cost the agent's CPU, which the pass's own figure counts.
        thread::sleep(Duration::from_millis(10));
    }
}

fn metric(agent: &Agent, series: &str) -> anyhow::Result<Option<f64>> {
    let (_, metrics) = agent.http_get("/metrics")?;
    Ok(metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok()))
}
