//! meshcap's benchmark: the workloads and the runner behind `cargo xtask bench`.
//!
//! - `meshcap-bench run [--quick] [--out FILE] [--ztunnel PATH]`: builds throwaway pods, one
//!   per capture mode, runs interleaved rounds in them and prints Markdown tables (medians,
//!   ratios of medians);
//! - `meshcap-bench proxy --listen ADDR [--cpu N] [--upstream ADDR]`: the stand-in proxy,
//!   forwarding to an upstream when given one (see [`workload`]);
//! - `meshcap-bench client --target ADDR [--cpu N] ...`: the app; prints one JSON line;
//! - `meshcap-bench spin --threads N`: busy work for pod set-up under load.
//!
//! A benchmark, not a test: it asserts nothing about speed.
use std::{net::SocketAddr, path::PathBuf};

use anyhow::Context as _;
use clap::{Parser, Subcommand};

mod churn;
mod cost;
mod pods;
mod repair;
mod report;
mod run;
mod setup;
mod stats;
mod verify;
mod workload;
mod ztunnel;

#[derive(Parser)]
#[command(name = "meshcap-bench", about = "meshcap's benchmark (root)")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Every benchmark, in throwaway pods; prints the tables of BENCHMARKS.md.
    Run {
        /// A smoke run (fewer rounds, smaller loads): minutes, not tens of minutes.
        #[arg(long)]
        quick: bool,
        /// Also write the tables to this file.
        #[arg(long)]
        out: Option<PathBuf>,
        /// The CPU client and proxy are both pinned to, in every mode.
        #[arg(long, default_value_t = 1)]
        cpu: usize,
        /// Only these sections (repeatable); all of them by default.
        #[arg(long, value_enum)]
        only: Vec<run::Section>,
        /// The data path's short connections only, this many per round and mode (no
        /// ping-pong, no bulk): for profiling the per-connection cost (e.g. under `perf`).
        #[arg(long)]
        short_only: Option<usize>,
        /// A/B: the directory of another build's `meshcap-agent` and `meshcap-cni`, run in the
        /// same rounds as this build (in place of Istio's rules).
        #[arg(long)]
        baseline_bin: Option<PathBuf>,
        /// What the report calls the baseline.
        #[arg(long, requires = "baseline_bin")]
        baseline_label: Option<String>,
        /// A ztunnel binary (istio/ztunnel built with its `testing` feature): ambient mode
        /// through it, HBONE on one node and between two (the `ztunnel` section).
        #[arg(long)]
        ztunnel: Option<PathBuf>,
    },
    /// The stand-in proxy: accepts, recovers the original destination, echoes.
    Proxy {
        #[arg(long)]
        listen: SocketAddr,
        #[arg(long)]
        cpu: Option<usize>,
        #[arg(long, default_value_t = 4)]
        threads: usize,
        /// Forward every connection to this upstream, as Envoy's outbound hop does.
        #[arg(long)]
        upstream: Option<std::net::SocketAddrV4>,
        /// A listener per thread in one `SO_REUSEPORT` group, as Envoy's workers have.
        #[arg(long)]
        reuseport: bool,
    },
    /// Busy work: threads spinning until killed (pod set-up with the machine busy).
    Spin {
        #[arg(long)]
        threads: usize,
    },
    /// The app: short connections, one persistent connection, bulk.
    Client {
        #[arg(long)]
        target: std::net::SocketAddrV4,
        #[arg(long)]
        cpu: Option<usize>,
        #[arg(long)]
        short: usize,
        #[arg(long, default_value_t = 0)]
        warmup: usize,
        #[arg(long, default_value_t = 0)]
        pingpong: usize,
        #[arg(long, default_value_t = 0)]
        bulk: u64,
        /// Bytes per request and per response.
        #[arg(long, default_value_t = workload::MSG)]
        size: usize,
    },
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Run {
            quick,
            out,
            cpu,
            only,
            short_only,
            baseline_bin,
            baseline_label,
            ztunnel,
        } => run::run(
            &run::Options {
                quick,
                cpu,
                only,
                short_only,
                baseline: baseline_bin.map(|bin| pods::Baseline {
                    label: baseline_label.unwrap_or_else(|| bin.display().to_string()),
                    bin,
                }),
                ztunnel,
            },
            out.as_deref(),
        ),
        Command::Proxy {
            listen,
            cpu,
            threads,
            upstream,
            reuseport,
        } => {
            if let Some(cpu) = cpu {
                workload::pin_to(cpu)?;
            }
            workload::proxy(listen, threads, upstream, reuseport)
        }
        Command::Spin { threads } => setup::spin(threads),
        Command::Client {
            target,
            cpu,
            short,
            warmup,
            pingpong,
            bulk,
            size,
        } => {
            if let Some(cpu) = cpu {
                workload::pin_to(cpu)?;
            }
            let load = workload::Load {
                short,
                warmup,
                pingpong,
                bulk,
                size,
            };
            let measured = workload::client(target, load).context("client")?;
            println!("{}", serde_json::to_string(&measured)?);
            Ok(())
        }
    }
}
