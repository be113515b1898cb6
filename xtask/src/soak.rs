//! `cargo xtask soak [--minutes N] [--pods N] [--kill-every S] [--backend B] [--one-build]`:
//! builds meshcap in release (and the agent in debug, the other build restarts alternate
//! with) and runs the chaos soak (tests/src/bin/meshcap-soak.rs), which prints its report
//! and writes it to `target/soak/results.md`. A measurement like the benchmark, not part of
//! `cargo xtask test`. Needs root: it builds throwaway pods (netns, cgroups, BPF).
use std::process::Command;

use anyhow::Context as _;

use crate::cmd::{self, root};

#[derive(clap::Args)]
pub struct Args {
    /// How long each backend is soaked.
    #[arg(long, default_value_t = 10.0)]
    pub minutes: f64,
    /// Pods alive at once, at most.
    #[arg(long, default_value_t = 40)]
    pub pods: usize,
    /// The agent is SIGKILLed every this many seconds on average; 0 never.
    #[arg(long, default_value_t = 6)]
    pub kill_every: u64,
    /// Only this backend (ebpf or iptables); both by default.
    #[arg(long)]
    pub backend: Option<String>,
    /// Restart the same build every time (by default restarts alternate between the release
    /// and the debug build of the agent: every other restart an upgrade, the next a rollback).
    #[arg(long)]
    pub one_build: bool,
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    let release = cmd::build_binaries(true)?;
    let other = if args.one_build {
        None
    } else {
        Some(cmd::build_binaries(false)?.join("meshcap-agent"))
    };
    let root = root();
    let out_dir = root.join("target/soak");
    std::fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let mut soak = Command::new(release.join("meshcap-soak"));
    soak
        // The agent, plugin and helpers the soak drives: this release build.
        .env("MESHCAP_BIN_DIR", &release)
        .arg("--minutes")
        .arg(args.minutes.to_string())
        .arg("--pods")
        .arg(args.pods.to_string())
        .arg("--kill-every")
        .arg(args.kill_every.to_string())
        .arg("--out")
        .arg(out_dir.join("results.md"));
    if let Some(backend) = &args.backend {
        soak.arg("--backend").arg(backend);
    }
    if let Some(other) = &other {
        soak.arg("--other-agent").arg(other);
    }
    cmd::run(&mut soak)
}
