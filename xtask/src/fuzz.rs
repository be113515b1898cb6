//! `cargo xtask fuzz`: builds every fuzz target of `fuzz/` (one workspace, one build) and runs
//! each for a bounded time from the corpus kept in the tree (`fuzz/corpus/<target>`, seeded
//! from the tests' inputs) with its dictionary (`fuzz/dict/<target>.dict`). What a run finds
//! goes to `fuzz/target/corpus/<target>` (kept between local runs, never in the tree); a crash
//! stops the run and is written to `fuzz/target/artifacts/<target>/` (replay it by passing the
//! file to the target's binary). Ends with each target's executions and coverage.
use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{Context as _, bail, ensure};

use crate::cmd::{self, root};

/// Every target, in the order they run.
pub const TARGETS: &[&str] = &[
    "cni_stdin",
    "cni_env",
    "protocol",
    "manifest",
    "policy",
    "conflist",
    "ambient",
];

/// How long CI runs each target (`cargo xtask test`).
pub const CI_SECONDS: u64 = 20;

#[derive(clap::Args)]
pub struct Args {
    /// How long each target runs.
    #[arg(long, default_value_t = 60)]
    pub seconds: u64,
    /// Instead of a time: this many executions of each target (a long run, for the record in
    /// docs/development.md).
    #[arg(long)]
    pub runs: Option<u64>,
    /// Only this target (repeatable); every target by default.
    #[arg(long)]
    pub target: Vec<String>,
}

/// One target's run, from libFuzzer's final statistics.
struct Stats {
    target: String,
    executions: u64,
    seconds: f64,
    coverage: u64,
    corpus: usize,
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    let targets: Vec<&str> = if args.target.is_empty() {
        TARGETS.to_vec()
    } else {
        for target in &args.target {
            ensure!(
                TARGETS.contains(&target.as_str()),
                "no fuzz target {target:?}; targets: {}",
                TARGETS.join(", ")
            );
        }
        args.target.iter().map(String::as_str).collect()
    };
    let fuzz = root().join("fuzz");
    build(&fuzz)?;
    let mut all = Vec::new();
    for target in targets {
        all.push(run_target(&fuzz, target, args)?);
    }
    eprintln!("xtask fuzz: no crash in {} target(s)", all.len());
    eprintln!(
        "  {:<10} {:>13} {:>9} {:>9} {:>8}",
        "target", "executions", "exec/s", "coverage", "corpus"
    );
    for s in all {
        eprintln!(
            "  {:<10} {:>13} {:>9.0} {:>9} {:>8}",
            s.target,
            s.executions,
            s.executions as f64 / s.seconds.max(f64::EPSILON),
            s.coverage,
            s.corpus
        );
    }
    Ok(())
}

/// The targets' binaries: release with debug assertions, coverage instrumentation, no
/// sanitizer (meshcap has no `unsafe` on these paths; the assertions and panics are what the
/// targets check). They depend on the pure crates only (`meshcap-policy`, `meshcap-cni`): no
/// kube client, tokio, aya or netlink to build with coverage instrumentation.
fn build(fuzz: &Path) -> anyhow::Result<()> {
    cmd::run(
        Command::new("cargo")
            .current_dir(fuzz)
            .env_remove("RUSTUP_TOOLCHAIN")
            .args([
                "+nightly",
                "fuzz",
                "build",
                "--release",
                "--debug-assertions",
                "--sanitizer",
                "none",
            ]),
    )
    .context("building the fuzz targets (cargo-fuzz comes with `cargo xtask setup`)")
}

fn binary(fuzz: &Path, target: &str) -> PathBuf {
    fuzz.join("target/x86_64-unknown-linux-gnu/release")
        .join(target)
}

fn run_target(fuzz: &Path, target: &str, args: &Args) -> anyhow::Result<Stats> {
    let seeds = fuzz.join("corpus").join(target);
    ensure!(
        seeds.is_dir(),
        "{} is missing: every target keeps its seeds in the tree",
        seeds.display()
    );
    let found = fuzz.join("target/corpus").join(target);
    let artifacts = fuzz.join("target/artifacts").join(target);
    fs::create_dir_all(&found)?;
    fs::create_dir_all(&artifacts)?;
    let mut command = Command::new(binary(fuzz, target));
    let bound = match args.runs {
        Some(runs) => {
            command.arg(format!("-runs={runs}"));
            format!("{runs} executions")
        }
        None => {
            command.arg(format!("-max_total_time={}", args.seconds));
            format!("{} s", args.seconds)
        }
    };
    command
        .arg(format!("-artifact_prefix={}/", artifacts.display()))
        .arg("-print_final_stats=1")
        // Never fork the CI machine's memory away: a leak or a blow-up is a crash.
        .arg("-rss_limit_mb=2048")
        .arg("-timeout=10");
    let dict = fuzz.join("dict").join(format!("{target}.dict"));
    if dict.exists() {
        command.arg(format!("-dict={}", dict.display()));
    }
    // New inputs go to the first directory; the seeds in the tree are only read.
    command.arg(&found).arg(&seeds);
    eprintln!("xtask fuzz: {target} for {bound}");
    let start = Instant::now();
    let out = command
        .output()
        .with_context(|| format!("running {}", binary(fuzz, target).display()))?;
    let took = start.elapsed().as_secs_f64();
    let log = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        eprintln!("{log}");
        bail!(
            "fuzz target {target} failed ({}); the input is in {}",
            out.status,
            artifacts.display()
        );
    }
    let stat = |name: &str| {
        log.lines()
            .find_map(|line| line.strip_prefix(&format!("stat::{name}:")))
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    let coverage = log
        .lines()
        .rev()
        .find_map(|line| line.split_once(" cov: "))
        .and_then(|(_, rest)| rest.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    Ok(Stats {
        target: target.to_owned(),
        executions: stat("number_of_executed_units").context("libFuzzer printed no statistics")?,
        seconds: took,
        coverage,
        corpus: fs::read_dir(&found)?.count(),
    })
}
