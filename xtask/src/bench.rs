//! `cargo xtask bench [--quick] [--only SECTION] [--short-only N] [--baseline REV|DIR]
//! [--ztunnel PATH]`: builds meshcap in release and runs the benchmark runner
//! (tests/src/bin/meshcap-bench), which prints the tables of BENCHMARKS.md and writes them to
//! `target/bench/results.md`. Needs root: it builds throwaway pods (netns, cgroups, BPF).
//!
//! With `--baseline`, a second build's agent and plugin run beside this build's in the same
//! rounds (A/B): a directory holding `meshcap-agent` and `meshcap-cni`, or a git revision,
//! which is exported (`git archive`, no worktree is registered) to
//! `target/bench/baseline/<commit>` and built in release there, into
//! `target/bench/baseline/target` (shared by every revision, so a second one builds
//! incrementally).
use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context as _, bail, ensure};

use crate::cmd::{self, root};

#[derive(clap::Args)]
pub struct Args {
    /// A smoke run: a few rounds of small loads, under 3 minutes.
    #[arg(long)]
    pub quick: bool,
    /// Only this section (repeatable): data-path, mesh-hop, ambient, inbound, policy-scale,
    /// footprint, pod-setup, repair, verify, churn, ztunnel (with `--ztunnel`).
    #[arg(long)]
    pub only: Vec<String>,
    /// The data path's short connections only, this many per round and mode (no ping-pong,
    /// no bulk): for profiling the per-connection cost.
    #[arg(long)]
    pub short_only: Option<usize>,
    /// A/B: also run this build of meshcap (a git revision, or a directory holding its
    /// `meshcap-agent` and `meshcap-cni`) in the same rounds, and report the ratios of its
    /// per-connection cost and rates to this build's.
    #[arg(long, value_name = "REV|DIR")]
    pub baseline: Option<String>,
    /// Ambient mode through this ztunnel binary (istio/ztunnel built with its `testing`
    /// feature, by you: the bench never fetches or builds it): HBONE with mTLS on one node and
    /// between two simulated nodes, the `ztunnel` section.
    #[arg(long, value_name = "PATH")]
    pub ztunnel: Option<PathBuf>,
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    let release = cmd::build_binaries(true)?;
    let root = root();
    let out_dir = root.join("target/bench");
    std::fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let baseline = args
        .baseline
        .as_deref()
        .map(|spec| baseline(&root, spec))
        .transpose()?;
    let mut bench = Command::new(release.join("meshcap-bench"));
    bench
        // The agent and plugin the bench drives: this release build.
        .env("MESHCAP_BIN_DIR", &release)
        .arg("run")
        .arg("--out")
        .arg(out_dir.join("results.md"));
    if args.quick {
        bench.arg("--quick");
    }
    for section in &args.only {
        bench.arg("--only").arg(section);
    }
    if let Some(short) = args.short_only {
        bench.arg("--short-only").arg(short.to_string());
    }
    if let Some(ztunnel) = &args.ztunnel {
        let ztunnel = ztunnel
            .canonicalize()
            .with_context(|| format!("--ztunnel {}", ztunnel.display()))?;
        bench.arg("--ztunnel").arg(ztunnel);
    }
    if let Some((dir, label)) = &baseline {
        bench
            .arg("--baseline-bin")
            .arg(dir)
            .arg("--baseline-label")
            .arg(label);
    }
    cmd::run(&mut bench)
}

/// The baseline's binaries directory and its label: `spec` itself when it is a directory
/// (labelled with its name), else the release build of git revision `spec` (labelled with its
/// short commit).
fn baseline(root: &Path, spec: &str) -> anyhow::Result<(PathBuf, String)> {
    let dir = Path::new(spec);
    if dir.is_dir() {
        for bin in ["meshcap-agent", "meshcap-cni"] {
            ensure!(
                dir.join(bin).is_file(),
                "--baseline {spec}: a binaries directory must hold {bin}"
            );
        }
        let dir = dir
            .canonicalize()
            .with_context(|| format!("resolving {spec}"))?;
        let label = dir
            .file_name()
            .map_or_else(|| spec.to_owned(), |n| n.to_string_lossy().into_owned());
        return Ok((dir, label));
    }
    let commit = git(
        root,
        &["rev-parse", "--verify", &format!("{spec}^{{commit}}")],
    )
    .with_context(|| format!("--baseline {spec}: neither a directory nor a git revision"))?;
    let short = git(root, &["rev-parse", "--short", &commit])?;
    let base = root.join("target/bench/baseline");
    let src = base.join(&commit);
    if !src.join("Cargo.toml").is_file() {
        std::fs::create_dir_all(&src).with_context(|| format!("creating {}", src.display()))?;
        let mut archive = Command::new("git")
            .current_dir(root)
            .args(["archive", "--format=tar", &commit])
            .stdout(Stdio::piped())
            .spawn()
            .context("git archive")?;
        let tar = Command::new("tar")
            .arg("-x")
            .arg("-C")
            .arg(&src)
            .stdin(archive.stdout.take().context("git archive's stdout")?)
            .status()
            .context("tar -x")?;
        ensure!(
            archive.wait()?.success() && tar.success(),
            "exporting {commit}"
        );
    }
    let target = base.join("target");
    eprintln!(
        "xtask bench: building the baseline {short} in {}",
        src.display()
    );
    cmd::run(
        Command::new("cargo")
            .current_dir(&src)
            .env("CARGO_TARGET_DIR", &target)
            .args([
                "build",
                "--quiet",
                "--release",
                "--package",
                "meshcap-agent",
                "--package",
                "meshcap-cni",
                "--bins",
            ]),
    )?;
    // Each revision's binaries apart: the shared target directory holds the last one built.
    let bins = base.join(format!("bin-{commit}"));
    std::fs::create_dir_all(&bins).with_context(|| format!("creating {}", bins.display()))?;
    for bin in ["meshcap-agent", "meshcap-cni"] {
        std::fs::copy(target.join("release").join(bin), bins.join(bin))
            .with_context(|| format!("copying the baseline's {bin}"))?;
    }
    Ok((bins, short))
}

fn git(root: &Path, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new("git")
        .current_dir(root)
        .args(args)
        .output()
        .context("running git")?;
    if !out.status.success() {
        bail!(
            "git {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}
