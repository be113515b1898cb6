//! The kernel time a connection costs: per program of an eBPF agent, the kernel's own
//! statistics (`BPF_ENABLE_STATS`: run count and run time) over a pass of short connections
//! of their own, once per round and eBPF mode, after the round's rates. Statistics are on only
//! during these passes: while they are, every BPF program on the machine pays two clock reads
//! per run, which the rates must not.
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    fs,
    sync::atomic::{AtomicBool, Ordering},
    thread,
    time::Duration,
};

use anyhow::Context as _;
use aya::{
    maps::{HashMap, Map, MapData, MapInfo},
    programs::{ProgramInfo, loaded_programs},
    sys::{Stats, enable_stats},
};
use meshcap_common::{FlowKey, OrigDst, maps};

use crate::{
    stats::{Samples, human},
    workload::{Load, Measured},
};

/// Run count and run time (ns) per program name.
type Counters = BTreeMap<String, (u64, u64)>;

/// One mode's cost passes: per round, per program, runs and ns per connection.
#[derive(Default)]
pub struct Costs {
    rounds: Vec<BTreeMap<String, (f64, f64)>>,
    /// Connections per pass.
    pub connections: usize,
    /// The most `MESHCAP_FLOWS` entries seen at once during the passes.
    flows_peak: usize,
}

impl Costs {
    /// Runs `measure` (a pass of `load`) with statistics on and adds what the programs of the
    /// agents with pids `agents` ran, per connection (all of them together: with two nodes, a
    /// connection runs the client's node's programs and the server's).
    ///
    /// # Errors
    /// When statistics cannot be switched on or the client fails.
    pub fn pass(
        &mut self,
        agents: &[u32],
        load: Load,
        measure: impl FnOnce() -> anyhow::Result<Measured>,
    ) -> anyhow::Result<()> {
        let programs: Vec<ProgramInfo> = agents.iter().flat_map(|&a| agent_programs(a)).collect();
        let flows = flows_map(&programs);
        let stats = enable_stats(Stats::RunTime).context("BPF_ENABLE_STATS")?;
        let before = snapshot(&programs);
        let done = AtomicBool::new(false);
        let (measured, peak) = thread::scope(|scope| {
            let sampler = scope.spawn(|| {
                let mut peak = 0;
                while let Some(map) = &flows
                    && !done.load(Ordering::Relaxed)
                {
                    peak = peak.max(map.keys().flatten().count());
                    thread::sleep(Duration::from_millis(1));
                }
                peak
            });
            let measured = measure();
            done.store(true, Ordering::Relaxed);
            (measured, sampler.join().unwrap_or(0))
        });
        let after = snapshot(&programs);
        drop(stats);
        measured?;
        self.flows_peak = self.flows_peak.max(peak);
        let connections = load.short + load.warmup;
        self.connections = connections;
        let per = |x: u64| x as f64 / connections.max(1) as f64;
        let mut round = BTreeMap::new();
        for (name, (runs, ns)) in after {
            let (runs0, ns0) = before.get(&name).copied().unwrap_or_default();
            let (runs, ns) = (runs.saturating_sub(runs0), ns.saturating_sub(ns0));
            if runs > 0 {
                round.insert(name, (per(runs), per(ns)));
            }
        }
        self.rounds.push(round);
        Ok(())
    }

    /// Every program's ns per connection together, the median of the rounds.
    pub fn total_ns(&self) -> f64 {
        self.of(None).1.median()
    }

    /// Program names that ran in any pass.
    fn programs(&self) -> BTreeSet<String> {
        self.rounds.iter().flat_map(|r| r.keys().cloned()).collect()
    }

    /// `program`'s runs per connection (median over rounds) and ns per connection (one sample
    /// per round); `None` for every program together.
    fn of(&self, program: Option<&str>) -> (f64, Samples) {
        let pick = |r: &BTreeMap<String, (f64, f64)>| match program {
            Some(name) => r.get(name).copied().unwrap_or_default(),
            None => r
                .values()
                .fold((0.0, 0.0), |(a, b), (runs, ns)| (a + runs, b + ns)),
        };
        let runs = Samples(self.rounds.iter().map(|r| pick(r).0).collect()).median();
        (
            runs,
            Samples(self.rounds.iter().map(|r| pick(r).1).collect()),
        )
    }
}

/// A Markdown table of the kernel time per connection of each column (label, costs), with the
/// ratio of the last column to the one before when there are two.
pub fn markdown(columns: &[(&str, &Costs)]) -> String {
    let Some((_, first)) = columns.first() else {
        return String::new();
    };
    let mut out = format!(
        "\nKernel time per connection: each eBPF agent's programs, by the kernel's statistics \
         (`BPF_ENABLE_STATS`: run count and run time, switched on only for this), over a pass \
         of {} short connections per round and mode after the round's rates. Cells: runs per \
         connection, and ns per connection as the median of the rounds ±half their range. \
         Program names are the kernel's (15 characters: `meshcap_connect` is connect4 and \
         connect6).\n\n| program |",
        crate::stats::count(first.connections)
    );
    for (label, _) in columns {
        let _ = write!(out, " {label} runs | {label} ns |");
    }
    let ratio = columns.len() == 2;
    if ratio {
        let _ = write!(out, " {}/{} |", columns[1].0, columns[0].0);
    }
    out.push_str("\n|---|");
    out.push_str(&"---|---|".repeat(columns.len()));
    if ratio {
        out.push_str("---|");
    }
    out.push('\n');
    let names: BTreeSet<String> = columns.iter().flat_map(|(_, c)| c.programs()).collect();
    let rows = names
        .iter()
        .map(|n| (n.as_str(), Some(n.as_str())))
        .chain([("all", None)]);
    for (label, program) in rows {
        let _ = write!(out, "| {label} |");
        let mut medians = Vec::new();
        for (_, costs) in columns {
            let (runs, ns) = costs.of(program);
            medians.push(ns.median());
            if ns.median() == 0.0 {
                out.push_str(" – | – |");
            } else {
                let _ = write!(
                    out,
                    " {:.2} | {} ±{:.0}% |",
                    runs,
                    human(ns.median()),
                    ns.spread_pct()
                );
            }
        }
        if ratio {
            if medians[0] > 0.0 && medians[1] > 0.0 {
                let _ = write!(out, " {:.2} |", medians[1] / medians[0]);
            } else {
                out.push_str(" n/a |");
            }
        }
        out.push('\n');
    }
    let peaks: Vec<String> = columns
        .iter()
        .map(|(label, c)| format!("{label} {}", c.flows_peak))
        .collect();
    let _ = writeln!(
        out,
        "\nMost `MESHCAP_FLOWS` entries seen at once during these passes (sampled every \
         millisecond): {}.",
        peaks.join(", ")
    );
    out
}

/// The counters of `programs` now (a `ProgramInfo` is a copy taken when it was listed).
fn snapshot(programs: &[ProgramInfo]) -> Counters {
    let ids: BTreeSet<u32> = programs.iter().map(ProgramInfo::id).collect();
    let mut out = Counters::new();
    for info in loaded_programs()
        .flatten()
        .filter(|p| ids.contains(&p.id()))
    {
        let name = info.name_as_str().unwrap_or("?").to_owned();
        let entry = out.entry(name).or_default();
        entry.0 += info.run_count();
        entry.1 += u64::try_from(info.run_time().as_nanos()).unwrap_or(u64::MAX);
    }
    out
}

/// The programs of the agent with pid `agent`: those using a map the agent holds, or a map of
/// such a program (the agent does not keep every map open). Other agents on the machine load
/// programs of the same names.
fn agent_programs(agent: u32) -> Vec<ProgramInfo> {
    let mut maps = map_ids(agent);
    let programs: Vec<_> = loaded_programs().flatten().collect();
    let uses = |info: &ProgramInfo| info.map_ids().ok().flatten().unwrap_or_default();
    for _ in 0..2 {
        for info in &programs {
            let ids = uses(info);
            if ids.iter().any(|id| maps.contains(id)) {
                maps.extend(ids);
            }
        }
    }
    programs
        .into_iter()
        .filter(|info| uses(info).iter().any(|id| maps.contains(id)))
        .collect()
}

/// The `MESHCAP_FLOWS` map of `programs`.
fn flows_map(programs: &[ProgramInfo]) -> Option<HashMap<MapData, FlowKey, OrigDst>> {
    let id = programs.iter().find_map(|info| {
        info.map_ids().ok().flatten()?.into_iter().find(|id| {
            MapInfo::from_id(*id)
                .ok()
                .is_some_and(|m| m.name_as_str().is_some_and(|n| maps::FLOWS.starts_with(n)))
        })
    })?;
    let data = MapData::from_id(id).ok()?;
    HashMap::try_from(Map::LruHashMap(data)).ok()
}

/// The ids of the maps `pid` holds file descriptors of (/proc/<pid>/fdinfo).
fn map_ids(pid: u32) -> Vec<u32> {
    let Ok(dir) = fs::read_dir(format!("/proc/{pid}/fdinfo")) else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|entry| {
            let text = fs::read_to_string(entry.path()).ok()?;
            text.lines()
                .find_map(|l| l.strip_prefix("map_id:"))
                .and_then(|v| v.trim().parse().ok())
        })
        .collect()
}
