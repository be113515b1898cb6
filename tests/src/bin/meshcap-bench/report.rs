//! The report's sections: the data path, ambient mode, policy scale, footprint and pod set-up, each measured
//! in interleaved rounds over the node's pods and written as Markdown tables.
use std::{
    fmt::Write as _,
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    thread,
    time::Instant,
};

use anyhow::ensure;
use meshcap_tests::agent::Backend;

use crate::{
    cost::{self, Costs},
    pods::{Baseline, Mode, Node, Pod, exclude_ranges, istio_rules},
    run::Plan,
    setup::{self},
    stats::{Samples, Table, count, human},
    workload::{Load, Measured},
};

/// excludeOutboundIPRanges sizes of the policy-scale benchmark.
pub(crate) const SCALE_SIZES: [usize; 4] = [1, 100, 1_000, 10_000];

/// Runs `rounds` rounds over `pods`, each round in a rotated order, and returns every pod's
/// measurements. With `costs` (one per pod), each round ends with a pass of `cost` short
/// connections in every pod that has an eBPF agent on `node`, measuring its kernel time per
/// connection (statistics on only then).
pub(crate) fn interleave(
    pods: &[Pod],
    rounds: usize,
    exe: &Path,
    cpu: usize,
    load: Load,
    mut costs: Option<(&Node, Load, &mut [Costs])>,
) -> anyhow::Result<Vec<Vec<Measured>>> {
    let mut results = vec![Vec::new(); pods.len()];
    for round in 0..rounds {
        for k in 0..pods.len() {
            let i = (round + k) % pods.len();
            results[i].push(pods[i].measure(exe, cpu, load)?);
        }
        if let Some((node, cost, costs)) = &mut costs {
            for k in 0..pods.len() {
                let i = (round + k) % pods.len();
                if let Some(agent) = node.ebpf_agent(pods[i].mode) {
                    costs[i].pass(&[agent.pid()], *cost, || pods[i].measure(exe, cpu, *cost))?;
                }
            }
        }
        eprintln!("  round {}/{rounds} done", round + 1);
    }
    Ok(results)
}

/// The kernel-time table of the pods that have an eBPF agent on `node`.
fn cost_table(node: &Node, pods: &[Pod], costs: &[Costs]) -> String {
    let columns: Vec<(&str, &Costs)> = pods
        .iter()
        .zip(costs)
        .filter(|(pod, _)| node.ebpf_agent(pod.mode).is_some())
        .map(|(pod, c)| (pod.label.as_str(), c))
        .collect();
    cost::markdown(&columns)
}

pub(crate) fn column(runs: &[Measured], metric: impl Fn(&Measured) -> f64) -> Samples {
    Samples(runs.iter().map(metric).collect())
}

/// The data path's table over `modes` (short connections, round trips, bulk), with the ratios
/// of each capture to no capture and of the last to the one before.
fn data_table(modes: &[Mode], results: &[Vec<Measured>]) -> Table {
    let mut ratios: Vec<(usize, usize)> = (1..modes.len()).map(|i| (i, 0)).collect();
    if modes.len() > 2 {
        ratios.push((modes.len() - 1, modes.len() - 2));
    }
    let at = |mode| modes.iter().position(|m| *m == mode);
    if let (Some(nftables), Some(iptables)) = (at(Mode::Nftables), at(Mode::Iptables)) {
        ratios.push((nftables, iptables));
    }
    data_table_with(modes, results, ratios)
}

fn data_table_with(
    modes: &[Mode],
    results: &[Vec<Measured>],
    ratios: Vec<(usize, usize)>,
) -> Table {
    let columns = modes.iter().map(|m| m.label().to_owned()).collect();
    metrics_table(columns, results, ratios)
}

/// The data path's metrics (short connections, round trips, bulk) of `results`, a column each,
/// with the `ratios` (column, against column) of their medians.
pub(crate) fn metrics_table(
    columns: Vec<String>,
    results: &[Vec<Measured>],
    ratios: Vec<(usize, usize)>,
) -> Table {
    type Metric = fn(&Measured) -> f64;
    let metrics: [(&str, Metric); 6] = [
        ("short conn/s", |m| m.short_per_s),
        ("short p50 µs", |m| m.short_p50_us),
        ("short p99 µs", |m| m.short_p99_us),
        ("ping-pong p50 µs", |m| m.pingpong_p50_us),
        ("ping-pong p99 µs", |m| m.pingpong_p99_us),
        ("bulk Gbit/s", |m| m.bulk_gbit_s),
    ];
    Table {
        columns,
        ratios,
        rows: metrics
            .iter()
            .map(|(name, f)| {
                (
                    (*name).to_owned(),
                    results.iter().map(|r| column(r, f)).collect(),
                )
            })
            .collect(),
    }
}

/// ` <pod> <recovered> of <connections>;` per pod, the last `;` a full stop and a newline.
fn original_dsts(pods: &[Pod], results: &[Vec<Measured>]) -> String {
    let mut out = String::new();
    for (pod, runs) in pods.iter().zip(results) {
        let ok: usize = runs.iter().map(|m| m.original_dst_ok).sum();
        let all: usize = runs.iter().map(|m| m.short).sum();
        let _ = write!(out, " {} {ok} of {all};", pod.label);
    }
    out.pop();
    out.push_str(".\n");
    out
}

pub(crate) fn data_path(
    plan: &Plan,
    exe: &Path,
    cpu: usize,
    node: &Node,
) -> anyhow::Result<String> {
    let modes = node.modes();
    let pods: Vec<Pod> = modes
        .iter()
        .map(|&m| Pod::new(m, &[], exe, cpu, node))
        .collect::<anyhow::Result<_>>()?;
    let mut costs: Vec<Costs> = pods.iter().map(|_| Costs::default()).collect();
    let results = interleave(
        &pods,
        plan.rounds,
        exe,
        cpu,
        plan.load,
        Some((node, plan.cost, &mut costs)),
    )?;
    let table = data_table(&modes, &results);
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
    out.push_str(&cost_table(node, &pods, &costs));
    if node.baseline.is_none() {
        let rules = istio_rules(&[])?;
        let _ = write!(
            out,
            "\niptables: `meshcap-agent run --backend iptables`, the pod ADDed through \
             meshcap-cni: the {} rules (`-A` lines, nat table) of Istio's `basic` golden for a \
             default injected pod, applied with iptables-restore in the pod netns.\n",
            rules.lines().filter(|l| l.starts_with("-A")).count(),
        );
        out.push_str(
            "\nnftables: `meshcap-agent run --backend nftables`, the same pod: Istio's native \
             nftables rules for it (`global.nativeNftables`), one `nft -f` transaction in the \
             pod netns.\n",
        );
    }
    let _ = writeln!(out, "\n{}", node.ebpf_description());
    out.push_str("\nOriginal destination recovered by the proxy (`SO_ORIGINAL_DST`):");
    out.push_str(&original_dsts(&pods, &results));
    Ok(out)
}

/// Ambient mode: an enrolled pod captured by Istio's in-pod rules and by the kernel programs
/// (`ambient.inKernel`), beside no capture, with the data path's load; the pod's proxy answers
/// on ztunnel's outbound port (15001).
pub(crate) fn ambient(plan: &Plan, exe: &Path, cpu: usize, node: &Node) -> anyhow::Result<String> {
    let modes = node.modes();
    let pods: Vec<Pod> = modes
        .iter()
        .map(|&m| Pod::new(m, &[], exe, cpu, node))
        .collect::<anyhow::Result<_>>()?;
    let mut costs: Vec<Costs> = pods.iter().map(|_| Costs::default()).collect();
    let results = interleave(
        &pods,
        plan.rounds,
        exe,
        cpu,
        plan.load,
        Some((node, plan.cost, &mut costs)),
    )?;
    let table = data_table(&modes, &results);
    let mut out = format!(
        "\n## Ambient mode\n\nAn enrolled pod (`istio.io/dataplane-mode=ambient`, ADDed through \
         meshcap-cni to an agent with `ambient.enabled` and a stand-in ztunnel that acks it), its \
         outbound TCP captured to port 15001, where the pod's proxy stands in for ztunnel's; \
         {} interleaved rounds, the data path's load per round and mode. Cells: median \
         ±half the round-to-round range; ratios are ratios of medians.\n\n",
        plan.rounds
    );
    out.push_str(&table.markdown());
    out.push_str(&cost_table(node, &pods, &costs));
    out.push_str(
        "\nambient iptables: Istio's in-pod rules (`meshcap-agent run --backend iptables`); \
         ambient eBPF: `--backend ebpf` with `ambient.inKernel=true`.\n\n",
    );
    if node.baseline.is_some() {
        let _ = writeln!(out, "{}\n", node.ebpf_description());
    }
    out.push_str("ADD of the pod (one each, ztunnel's ack included):");
    for pod in pods.iter().filter(|p| p.add_ms > 0.0) {
        let _ = write!(out, " {} {:.1} ms;", pod.label, pod.add_ms);
    }
    out.push_str(" original destination recovered by the proxy:");
    out.push_str(&original_dsts(&pods, &results));
    Ok(out)
}

/// Message sizes of the mesh hop: a small RPC, a typical API response, a large one.
pub(crate) const HOP_SIZES: [usize; 3] = [64, 1024, 64 * 1024];

/// The mesh hop: app → proxy → server, the proxy forwarding every connection to its upstream
/// as Envoy does, beside the app dialling the server with no proxy at all. Per round, every
/// size runs over every mode in a rotated order.
pub(crate) fn mesh_hop(plan: &Plan, exe: &Path, cpu: usize, node: &Node) -> anyhow::Result<String> {
    let mut modes = vec![Mode::NoProxy];
    modes.extend(node.modes());
    let pods: Vec<Pod> = modes
        .iter()
        .map(|&m| Pod::forwarding(m, exe, cpu, node))
        .collect::<anyhow::Result<_>>()?;
    // results[size][pod]: one measurement per round.
    let mut results = vec![vec![Vec::new(); pods.len()]; HOP_SIZES.len()];
    for round in 0..plan.hop_rounds {
        for (s, &size) in HOP_SIZES.iter().enumerate() {
            let load = Load {
                size,
                bulk: if s == 0 { plan.hop_load.bulk } else { 0 },
                ..plan.hop_load
            };
            for k in 0..pods.len() {
                let i = (round + k) % pods.len();
                results[s][i].push(pods[i].measure(exe, cpu, load)?);
            }
        }
        eprintln!("  round {}/{} done", round + 1, plan.hop_rounds);
    }
    let mut out = format!(
        "\n## Mesh hop\n\nThe app's request through the proxy to a server, as a mesh hop is: \
         the stand-in proxy forwards every connection it accepts to the server (127.0.0.1:18080 \
         in the pod, uid 1001) over a connection of its own (uid 1337, which neither backend \
         captures), passes each request on and each answer back. *no proxy*: the app dials the \
         server. *no capture*: the app dials the proxy. {} interleaved rounds; per round, mode \
         and message size: {} short connections (after {} warm-up: connect, one request and \
         one response of that size, close), {} round trips on one connection, and with 64 B \
         messages {} MiB bulk through the proxy. Cells: median ±half the round-to-round \
         range; ratios are ratios of medians.\n",
        plan.hop_rounds,
        plan.hop_load.short,
        plan.hop_load.warmup,
        plan.hop_load.pingpong,
        plan.hop_load.bulk >> 20
    );
    let ratios = if modes.len() == 4 {
        vec![(1, 0), (2, 1), (3, 1), (3, 2)]
    } else {
        vec![(1, 0), (2, 1)]
    };
    type Metric = fn(&Measured) -> f64;
    for (s, &size) in HOP_SIZES.iter().enumerate() {
        let mut metrics: Vec<(&str, Metric)> = vec![
            ("short conn/s", |m| m.short_per_s),
            ("short p50 µs", |m| m.short_p50_us),
            ("short p99 µs", |m| m.short_p99_us),
            ("ping-pong p50 µs", |m| m.pingpong_p50_us),
            ("ping-pong p99 µs", |m| m.pingpong_p99_us),
        ];
        if s == 0 {
            metrics.push(("bulk Gbit/s", |m| m.bulk_gbit_s));
        }
        let table = Table {
            columns: modes.iter().map(|m| m.label().to_owned()).collect(),
            ratios: ratios.clone(),
            rows: metrics
                .iter()
                .map(|(name, f)| {
                    (
                        (*name).to_owned(),
                        results[s].iter().map(|r| column(r, f)).collect(),
                    )
                })
                .collect(),
        };
        let _ = write!(out, "\n{} messages:\n\n{}", bytes(size), table.markdown());
    }
    out.push_str("\nOriginal destination recovered by the proxy (`SO_ORIGINAL_DST`):");
    for (i, pod) in pods.iter().enumerate() {
        let runs = results.iter().flat_map(|by_pod| &by_pod[i]);
        let (ok, all) = runs.fold((0, 0), |(ok, all), m| {
            (ok + m.original_dst_ok, all + m.short)
        });
        let _ = write!(out, " {} {ok} of {all};", pod.label);
    }
    out.pop();
    out.push_str(".\n");
    Ok(out)
}

/// `64 B`, `1 KiB`, `64 KiB`.
fn bytes(n: usize) -> String {
    if n >= 1024 && n.is_multiple_of(1024) {
        format!("{} KiB", n / 1024)
    } else {
        format!("{n} B")
    }
}

pub(crate) fn policy_scale(
    plan: &Plan,
    exe: &Path,
    cpu: usize,
    node: &Node,
) -> anyhow::Result<String> {
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

pub(crate) fn footprint(plan: &Plan, exe: &Path, node: &Node) -> anyhow::Result<String> {
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
pub(crate) const SETUP_LATENCY_PODS: usize = 200;

pub(crate) fn pod_setup(plan: &Plan) -> anyhow::Result<String> {
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
    let first = SETUP_LATENCY_PODS.min(plan.setup_pods);
    let cpus = thread::available_parallelism().map_or(1, usize::from);
    let spinners = 2 * cpus;
    let busy: Vec<_> = [setup::Busy::OwnCgroup, setup::Busy::SameGroup]
        .into_iter()
        .flat_map(|busy| [Backend::Iptables, Backend::Ebpf].map(|backend| (busy, backend)))
        .map(|(busy, backend)| {
            eprintln!("  {}, busy ({busy:?})", backend.name());
            (
                busy,
                setup::run_busy(backend, &pods[..first], spinners, busy),
            )
        })
        .collect();
    drop(pods);
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
        let (_, add99_all) = setup::SetupResult::percentiles(&r.add_ms, r.add_ms.len());
        let _ = writeln!(
            out,
            "| {} | {} | {} |",
            r.backend.name(),
            latency_cells(r, first),
            human(add99_all)
        );
    }
    let _ = write!(
        out,
        "\nThe same, {first} pods, with the machine busy: {spinners} threads spinning at normal \
         priority on {cpus} CPUs for the whole run (a load average of about {spinners}), in a \
         CPU cgroup of their own as kubelet places every pod (*busy pods*), or in the \
         scheduling group of the plugin's parent and the agent (*busy, same group*: each \
         spinner competes with them one for one):\n\n| load | backend | ADD p50 ms | ADD p99 \
         ms | DEL p50 ms | DEL p99 ms |\n|---|---|---|---|---|---|\n"
    );
    for (busy, r) in &busy {
        let load = match busy {
            setup::Busy::OwnCgroup => "busy pods",
            setup::Busy::SameGroup => "busy, same group",
        };
        if let Some(why) = &r.unavailable {
            let _ = writeln!(out, "| {load} | {} | n/a: {why} | | | |", r.backend.name());
            continue;
        }
        let _ = writeln!(
            out,
            "| {load} | {} | {} |",
            r.backend.name(),
            latency_cells(r, first)
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

/// ADD p50, ADD p99, DEL p50 and DEL p99 over the first `first` pods, as table cells.
fn latency_cells(r: &setup::SetupResult, first: usize) -> String {
    let (add50, add99) = setup::SetupResult::percentiles(&r.add_ms, first);
    let (del50, del99) = setup::SetupResult::percentiles(&r.del_ms, first);
    format!(
        "{} | {} | {} | {}",
        human(add50),
        human(add99),
        human(del50),
        human(del99)
    )
}

pub(crate) fn sibling(exe: &Path, name: &str) -> PathBuf {
    exe.parent().unwrap_or(Path::new(".")).join(name)
}

pub(crate) fn repair_in_place(plan: &Plan) -> String {
    let mut out = format!(
        "\n## Repair in place\n\nA pod that started without its capture (its \
         `istio-validation` last exited 126) appears in the API server the agent watches; the \
         time runs until the agent's repair controller has captured it in place \
         (`istio_cni_repair_pods_repaired_total` counts it). {n} pods, one at a time, per \
         backend; includes the watch's delivery (the test API server streams changes every \
         5 ms) and the metric poll (2 ms). Goal: at most 2 s.\n\n| backend | p50 ms | p99 ms \
         | max ms |\n|---|---|---|---|\n",
        n = plan.repair_pods
    );
    for backend in [Backend::Iptables, Backend::Ebpf] {
        eprintln!("  {}", backend.name());
        let r = crate::repair::run(backend, plan.repair_pods);
        if let Some(why) = &r.unavailable {
            let _ = writeln!(out, "| {} | n/a: {why} | | |", r.backend.name());
            continue;
        }
        let (p50, p99) = setup::SetupResult::percentiles(&r.ms, r.ms.len());
        let max = r.ms.iter().copied().fold(0.0, f64::max);
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} |",
            r.backend.name(),
            human(p50),
            human(p99),
            human(max)
        );
    }
    out
}

/// Inbound: a client outside the pod (its own netns, across the pod's veth) dials the app's
/// port, captured to the proxy's inbound listener; with the kernel's `bpf_sk_assign`, and with
/// every captured connection handed off through the socket lookup as on kernels before 6.5
/// (forced: this kernel never needs it). Short connections only: round trips and bulk of an
/// established connection do not go near either.
pub(crate) fn inbound(
    plan: &Plan,
    exe: &Path,
    cpu: usize,
    baseline: Option<&Baseline>,
) -> anyhow::Result<String> {
    let node = Node::inbound(baseline)?;
    let modes = node.inbound_modes();
    let pods: Vec<Pod> = modes
        .iter()
        .map(|&m| Pod::inbound(m, exe, cpu, &node))
        .collect::<anyhow::Result<_>>()?;
    let load = Load {
        pingpong: 0,
        bulk: 0,
        ..plan.load
    };
    let mut costs: Vec<Costs> = pods.iter().map(|_| Costs::default()).collect();
    let results = interleave(
        &pods,
        plan.rounds,
        exe,
        cpu,
        load,
        Some((&node, plan.cost, &mut costs)),
    )?;
    let mut ratios: Vec<(usize, usize)> = (1..modes.len()).map(|i| (i, 0)).collect();
    let at = |mode| modes.iter().position(|&m| m == mode);
    if let (Some(kernel), Some(handoff)) = (at(Mode::Ebpf), at(Mode::EbpfHandoff)) {
        ratios.push((handoff, kernel));
    }
    if let (Some(kernel), Some(baseline)) = (at(Mode::Ebpf), at(Mode::EbpfBaseline)) {
        ratios.push((kernel, baseline));
    }
    let table = data_table_with(&modes, &results, ratios);
    let mut out = format!(
        "\n## Inbound\n\nA client in a network namespace of its own, on the other end of the \
         pod's veth, dials the app's port ({}); the pod's proxy listens on 15006 (four \
         `SO_REUSEPORT` listeners, as Envoy's workers have) and recovers the original \
         destination. *no capture*: the client dials 15006 itself. *eBPF*: TC hands each new \
         connection to the listener with `bpf_sk_assign`. *eBPF hand-off*: an agent with the \
         hidden `--handoff always` (`MESHCAP_HANDOFF=always`, benchmarks only), whose \
         classifier hands every captured SYN to the pod's socket lookup program as it does on \
         Linux 5.15–6.4, where `bpf_sk_assign` refuses `SO_REUSEPORT` listeners (this kernel \
         never needs it). {} interleaved rounds of {} short connections (after {} warm-up) \
         per mode. Cells: median ±half the round-to-round range; ratios are ratios of \
         medians.\n\n",
        crate::pods::INBOUND,
        plan.rounds,
        load.short,
        load.warmup
    );
    out.push_str(&table.markdown());
    out.push_str(&cost_table(&node, &pods, &costs));
    out.push_str("\nOriginal destination recovered by the proxy (`SO_ORIGINAL_DST`):");
    out.push_str(&original_dsts(&pods, &results));
    Ok(out)
}
