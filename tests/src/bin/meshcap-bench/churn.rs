//! Kubelet's parallelism (issue 47, item 4): new pods ADDed and then DELeted while the node
//! already holds captured ones, [`PARALLEL`] at a time — kubelet's pod workers set sandboxes up
//! concurrently, and a rollout or a scale-up hands the runtime many at once — and one at a
//! time, alternated in the same run, per backend. Beside them, Istio's way, run by the
//! benchmark in each new pod's netns: the commands istio-cni's plugin runs at a sidecar pod's
//! ADD (its iptables flavour detection, then the rules' restore), and the restore alone. Both
//! leave out the plugin's own start and its API lookups, so they are lower bounds of its ADD;
//! its DEL does nothing for a sidecar pod (`cni/pkg/plugin/plugin.go`, `CmdDelete` returns
//! nil), so those rows have no DEL.
use std::{
    fmt::Write as _,
    io::Write as _,
    process::{Command, Stdio},
    sync::atomic::{AtomicUsize, Ordering},
    thread,
    time::Instant,
};

use anyhow::{Context as _, anyhow, ensure};
use meshcap_tests::{Netns, TestCgroup, agent::Backend};

use crate::{
    pods::istio_rules,
    setup::{self, Agent, SetupResult},
    stats::{Samples, human},
};

/// Pods sent at once, as a node's pod workers start them.
const PARALLEL: usize = 8;

/// One way of capturing at one concurrency, over every round: each operation's wall time
/// (spawn to exit), ms, and each round's rate, operations per second.
#[derive(Default)]
struct Ops {
    each_ms: Vec<f64>,
    per_second: Vec<f64>,
}

impl Ops {
    fn record(&mut self, batch: Batch) {
        self.per_second
            .push(batch.each_ms.len() as f64 / batch.total_s);
        self.each_ms.extend(batch.each_ms);
    }

    /// `p50 | p99 | rate` cells.
    fn cells(&self) -> String {
        let (p50, p99) = SetupResult::percentiles(&self.each_ms, self.each_ms.len());
        format!(
            "{} | {} | {}",
            human(p50),
            human(p99),
            human(Samples(self.per_second.clone()).median())
        )
    }
}

/// One batch: each operation's wall time, ms, and the batch's.
struct Batch {
    each_ms: Vec<f64>,
    total_s: f64,
}

/// Runs `op` on every pod, `parallel` at a time (each worker takes the next pod as it
/// finishes one, as kubelet's workers do).
fn batch(
    pods: &[Netns],
    parallel: usize,
    op: &(dyn Fn(usize, &Netns) -> anyhow::Result<f64> + Sync),
) -> anyhow::Result<Batch> {
    let next = AtomicUsize::new(0);
    let started = Instant::now();
    let each = thread::scope(|scope| {
        let workers: Vec<_> = (0..parallel)
            .map(|_| {
                scope.spawn(|| -> anyhow::Result<Vec<f64>> {
                    let mut took = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(netns) = pods.get(i) else {
                            return Ok(took);
                        };
                        took.push(op(i, netns)?);
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().map_err(|_| anyhow!("a worker panicked"))?)
            .collect::<anyhow::Result<Vec<_>>>()
    })?;
    Ok(Batch {
        each_ms: each.concat(),
        total_s: started.elapsed().as_secs_f64(),
    })
}

/// A way of capturing a new pod.
#[derive(Clone, Copy)]
enum Way {
    /// Istio's rules applied by the benchmark; with istio-cni's detection first when `full`.
    Istio { full: bool },
    /// meshcap's plugin and agent with a backend.
    Agent(Backend),
}

/// What one way measured at 1 and at [`PARALLEL`] at a time.
#[derive(Default)]
struct Measured {
    add: [Ops; 2],
    del: [Ops; 2],
}

/// Runs the section: `node_pods` pods captured first, then `churn_pods` new pods per batch,
/// `rounds` batches at each concurrency, alternated; returns its Markdown.
pub(crate) fn section(
    node_pods: usize,
    churn_pods: usize,
    rounds: usize,
) -> anyhow::Result<String> {
    let node = setup::sandboxes(node_pods)?;
    let churn = setup::sandboxes(churn_pods)?;
    let mut out = format!(
        "\n## Kubelet's parallelism\n\nThe node already holds {node_pods} captured sidecar \
         pods; then {churn_pods} new pods are ADDed through the real plugin and DELeted, \
         {PARALLEL} at a time (each of {PARALLEL} workers takes the next pod when its last one \
         is done, as kubelet's pod workers set sandboxes up concurrently) and one at a time, \
         {rounds} rounds of each, alternated. Times are the plugin's spawn to exit; the rate is \
         pods per second of a whole batch (median of the rounds). \"istio-cni's commands\" are \
         what istio-cni's plugin runs in a new sidecar pod's netns, run by the benchmark in a \
         shell there: its iptables flavour detection (for legacy, then nft: the `-save` dump, \
         its `--version`, a no-op `nat` rule added and deleted) and the rules' \
         `iptables-restore`; \"Istio's rules alone\" the restore only. Neither has the \
         plugin's own start or its API lookups (the pod and its namespace), so both are lower \
         bounds of istio-cni's ADD, each batch in fresh netns; its DEL does nothing for a \
         sidecar pod (`CmdDelete` returns nil).\n\n| way | at once | ADD \
         p50 ms | ADD p99 ms | ADDs/s | DEL p50 ms | DEL p99 ms | DELs/s |\n\
         |---|---|---|---|---|---|---|---|\n"
    );
    let ways: [(&str, Way); 5] = [
        ("istio-cni's commands", Way::Istio { full: true }),
        ("Istio's rules alone", Way::Istio { full: false }),
        ("iptables", Way::Agent(Backend::Iptables)),
        ("nftables", Way::Agent(Backend::Nftables)),
        ("eBPF", Way::Agent(Backend::Ebpf)),
    ];
    for (label, way) in ways {
        eprintln!("  {label}");
        let measured = match way {
            Way::Istio { full } => istio(&node, churn_pods, rounds, full),
            Way::Agent(backend) => agent(backend, &node, &churn, rounds),
        };
        match measured {
            Ok(m) => {
                for (i, at_once) in [1, PARALLEL].into_iter().enumerate() {
                    let del = if matches!(way, Way::Agent(_)) {
                        m.del[i].cells()
                    } else {
                        "– | – | –".to_owned()
                    };
                    let _ = writeln!(
                        out,
                        "| {label} | {at_once} | {} | {del} |",
                        m.add[i].cells()
                    );
                }
            }
            Err(err) => {
                let _ = writeln!(out, "| {label} | | n/a: {err:#} | | | | | |");
            }
        }
    }
    Ok(out)
}

/// A running agent of `backend`: the node's pods ADDed, then the rounds; every pod DELeted.
fn agent(
    backend: Backend,
    node: &[Netns],
    churn: &[Netns],
    rounds: usize,
) -> anyhow::Result<Measured> {
    let cgroup = TestCgroup::new("mcb-churn")?;
    let agent = Agent::start(backend, cgroup.path())?;
    for (i, netns) in node.iter().enumerate() {
        agent.add(netns, &format!("node-{i}"), &[])?;
    }
    let mut m = Measured::default();
    let add = |i: usize, netns: &Netns| agent.add(netns, &format!("churn-{i}"), &[]);
    let del = |i: usize, netns: &Netns| agent.del(netns, &format!("churn-{i}"));
    for _ in 0..rounds {
        for (slot, parallel) in [1, PARALLEL].into_iter().enumerate() {
            m.add[slot].record(batch(churn, parallel, &add)?);
            m.del[slot].record(batch(churn, parallel, &del)?);
        }
    }
    for (i, netns) in node.iter().enumerate() {
        agent.del(netns, &format!("node-{i}"))?;
    }
    Ok(m)
}

/// Istio's way: the node's pods given Istio's rules first, then the rounds, each batch in
/// fresh network namespaces (istio-cni's flavour detection leaves an empty legacy `nat` table
/// behind, which its next detection in the same netns would take for legacy rules); the node's
/// rules flushed at the end. `full`: the commands istio-cni's plugin runs
/// ([`ISTIO_DETECTION`] and the restore), else the restore alone.
fn istio(node: &[Netns], churn: usize, rounds: usize, full: bool) -> anyhow::Result<Measured> {
    let rules = istio_rules(&[])?;
    let apply = |_: usize, netns: &Netns| {
        let start = Instant::now();
        if full {
            in_netns(netns, ISTIO_DETECTION, "")?;
        }
        in_netns(netns, RESTORE, &rules)?;
        Ok(start.elapsed().as_secs_f64() * 1e3)
    };
    let result = (|| {
        for netns in node {
            in_netns(netns, RESTORE, &rules)?;
        }
        let mut m = Measured::default();
        for _ in 0..rounds {
            for (slot, parallel) in [1, PARALLEL].into_iter().enumerate() {
                let fresh = setup::sandboxes(churn)?;
                m.add[slot].record(batch(&fresh, parallel, &apply)?);
            }
        }
        Ok(m)
    })();
    for netns in node {
        in_netns(netns, "nft flush ruleset", "")?;
    }
    result
}

/// How istio-cni's plugin writes the rules (its detection chose nft in a new netns).
const RESTORE: &str = "iptables-nft-restore --noflush";

/// What istio-cni's plugin runs in a new pod's netns before its rules, for an IPv4 pod with
/// no rules yet (`tools/istio-iptables/pkg/dependencies/implementation.go`,
/// `DetectIptablesVersion`: legacy first, then nft, each through
/// `implementation_linux.go`'s `shouldUseBinaryForCurrentContext`: the `-save` dump, its
/// `--version`, and a no-op rule added to `nat` and deleted, with `--wait=30` for legacy).
const ISTIO_DETECTION: &str = "iptables-legacy-save >/dev/null && \
    iptables-legacy-save --version >/dev/null && \
    iptables-legacy -t nat -A INPUT -p 255 -j RETURN --wait=30 && \
    iptables-legacy -t nat -D INPUT -p 255 -j RETURN --wait=30 && \
    iptables-nft-save >/dev/null && \
    iptables-nft-save --version >/dev/null && \
    iptables-nft -t nat -A INPUT -p 255 -j RETURN && \
    iptables-nft -t nat -D INPUT -p 255 -j RETURN";

/// Runs the shell `script` in `netns` with `input` on its standard input (one `ip netns exec`
/// and one shell per call, whatever the script runs: as istio-cni's plugin, already in the
/// netns, forks each command itself).
fn in_netns(netns: &Netns, script: &str, input: &str) -> anyhow::Result<()> {
    let mut child = Command::new("ip")
        .args(["netns", "exec", netns.name(), "sh", "-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("{script} in {}", netns.name()))?;
    child
        .stdin
        .take()
        .context("stdin")?
        .write_all(input.as_bytes())?;
    let out = child.wait_with_output()?;
    ensure!(
        out.status.success(),
        "{script} in {}: {}",
        netns.name(),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}
