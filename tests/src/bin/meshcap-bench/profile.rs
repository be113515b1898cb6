//! `--profile`: the kernel's per-program statistics (`BPF_ENABLE_STATS`, run count and run
//! time) of the eBPF agent's programs, summed over the eBPF pod's data-path runs. Off by
//! default: while statistics are on, every BPF program on the machine pays two clock reads per
//! run, which the other modes do not.
use std::{
    collections::BTreeMap,
    fmt::Write as _,
    fs,
    os::fd::OwnedFd,
    sync::atomic::{AtomicBool, Ordering},
    thread,
    time::Duration,
};

use anyhow::Context as _;
use aya::{
    maps::{HashMap, Map, MapData, MapInfo},
    programs::loaded_programs,
    sys::{Stats, enable_stats},
};
use meshcap_common::{FlowKey, OrigDst, maps};

use crate::stats::human;

/// Run count and run time (ns) per program name.
type Counters = BTreeMap<String, (u64, u64)>;

/// Statistics switched on for as long as this lives, and what has been counted so far.
pub struct Profiler {
    _stats: OwnedFd,
    agent: u32,
    total: Counters,
    /// The most `MESHCAP_FLOWS` entries seen at once.
    flows_peak: usize,
}

impl Profiler {
    /// Switches statistics on; `agent` is the eBPF agent's pid, whose programs are counted.
    pub fn new(agent: u32) -> anyhow::Result<Self> {
        let stats = enable_stats(Stats::RunTime).context("BPF_ENABLE_STATS")?;
        Ok(Self {
            _stats: stats,
            agent,
            total: Counters::new(),
            flows_peak: 0,
        })
    }

    /// Runs `f` while a thread counts `MESHCAP_FLOWS` entries every millisecond, and keeps
    /// the peak.
    pub fn sampling_flows<T>(&mut self, f: impl FnOnce() -> T) -> T {
        let flows = self.flows_map();
        let done = AtomicBool::new(false);
        let (out, peak) = thread::scope(|scope| {
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
            let out = f();
            done.store(true, Ordering::Relaxed);
            (out, sampler.join().unwrap_or(0))
        });
        self.flows_peak = self.flows_peak.max(peak);
        out
    }

    /// The agent's `MESHCAP_FLOWS`, found through its programs.
    fn flows_map(&self) -> Option<HashMap<MapData, FlowKey, OrigDst>> {
        let id = self.programs().iter().find_map(|info| {
            info.map_ids().ok().flatten()?.into_iter().find(|id| {
                MapInfo::from_id(*id)
                    .ok()
                    .is_some_and(|m| m.name_as_str().is_some_and(|n| maps::FLOWS.starts_with(n)))
            })
        })?;
        let data = MapData::from_id(id).ok()?;
        HashMap::try_from(Map::LruHashMap(data)).ok()
    }

    /// The agent's programs: those using a map the agent holds, or a map of such a program
    /// (the agent does not keep every map open).
    fn programs(&self) -> Vec<aya::programs::ProgramInfo> {
        let mut maps = map_ids(self.agent);
        let programs: Vec<_> = loaded_programs().flatten().collect();
        let uses =
            |info: &aya::programs::ProgramInfo| info.map_ids().ok().flatten().unwrap_or_default();
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

    /// The counters now.
    pub fn snapshot(&self) -> Counters {
        let mut out = Counters::new();
        for info in self.programs() {
            let name = info.name_as_str().unwrap_or("?").to_owned();
            let entry = out.entry(name).or_default();
            entry.0 += info.run_count();
            entry.1 += u64::try_from(info.run_time().as_nanos()).unwrap_or(u64::MAX);
        }
        out
    }

    /// Adds what ran between `before` and now.
    pub fn add_since(&mut self, before: &Counters) {
        for (name, (runs, ns)) in self.snapshot() {
            let (runs0, ns0) = before.get(&name).copied().unwrap_or_default();
            let entry = self.total.entry(name).or_default();
            entry.0 += runs.saturating_sub(runs0);
            entry.1 += ns.saturating_sub(ns0);
        }
    }

    /// A Markdown table: per program, runs per short connection and ns per run.
    pub fn markdown(&self, connections: usize) -> String {
        let mut out = format!(
            "\nPer-program cost in the eBPF pod (`--profile`: `BPF_ENABLE_STATS` run count and \
             run time over its runs, ping-pong and bulk included; per connection: over {} \
             short connections, warm-ups included):\n\n| program | runs | runs per connection \
             | ns per run | ns per connection |\n|---|---|---|---|---|\n",
            crate::stats::count(connections)
        );
        let per = |x: u64| x as f64 / connections.max(1) as f64;
        let mut sum = 0.0;
        for (name, (runs, ns)) in &self.total {
            if *runs == 0 {
                continue;
            }
            sum += per(*ns);
            let _ = writeln!(
                out,
                "| {name} | {} | {:.2} | {} | {} |",
                crate::stats::count(usize::try_from(*runs).unwrap_or(usize::MAX)),
                per(*runs),
                human(*ns as f64 / *runs as f64),
                human(per(*ns))
            );
        }
        let _ = writeln!(out, "| all | | | | {} |", human(sum));
        let _ = writeln!(
            out,
            "\nMost `MESHCAP_FLOWS` entries seen at once (sampled every millisecond): {}.",
            self.flows_peak
        );
        out
    }
}

/// The ids of the maps `pid` holds file descriptors of (/proc/<pid>/fdinfo): a program using
/// one of them is the agent's (other agents on the machine load programs of the same names).
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
