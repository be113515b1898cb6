//! `cargo xtask bench [--quick] [--only SECTION] [--profile] [--short-only N]`: builds meshcap in release and runs the benchmark runner
//! (tests/src/bin/meshcap-bench), which prints the tables of BENCHMARKS.md and writes them to
//! `target/bench/results.md`. Needs root: it builds throwaway pods (netns, cgroups, BPF).
use std::process::Command;

use anyhow::Context as _;

use crate::cmd::{self, root};

pub fn run(
    quick: bool,
    only: &[String],
    profile: bool,
    short_only: Option<usize>,
) -> anyhow::Result<()> {
    let release = cmd::build_binaries(true)?;
    let root = root();
    let out_dir = root.join("target/bench");
    std::fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let mut bench = Command::new(release.join("meshcap-bench"));
    bench
        // The agent and plugin the bench drives: this release build.
        .env("MESHCAP_BIN_DIR", &release)
        .arg("run")
        .arg("--out")
        .arg(out_dir.join("results.md"));
    if quick {
        bench.arg("--quick");
    }
    for section in only {
        bench.arg("--only").arg(section);
    }
    if profile {
        bench.arg("--profile");
    }
    if let Some(short) = short_only {
        bench.arg("--short-only").arg(short.to_string());
    }
    cmd::run(&mut bench)
}
