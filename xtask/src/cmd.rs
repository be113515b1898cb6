//! Running commands from the workspace root, loudly.
use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, ensure};

/// The workspace root (xtask lives one level below it).
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

/// Cargo's target directory: `CARGO_TARGET_DIR`, or `target/` in the workspace.
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root().join("target"), PathBuf::from)
}

/// Runs `cmd`, echoing it first; fails when it exits non-zero.
pub fn run(cmd: &mut Command) -> anyhow::Result<()> {
    eprintln!("+ {}", describe(cmd));
    let status = cmd
        .status()
        .with_context(|| format!("starting {}", describe(cmd)))?;
    ensure!(status.success(), "{} failed ({status})", describe(cmd));
    Ok(())
}

/// Runs `cmd` quietly and returns its stdout, or `None` when it cannot run or fails.
pub fn output(cmd: &mut Command) -> Option<String> {
    let out = cmd.output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

fn describe(cmd: &Command) -> String {
    let mut text = cmd.get_program().to_string_lossy().into_owned();
    for arg in cmd.get_args() {
        text.push(' ');
        text.push_str(&arg.to_string_lossy());
    }
    text
}

/// Builds the binaries a run on this machine drives (the agent, the plugin, the tests' runners
/// and helpers), in release when `release`; returns the directory they are in.
pub fn build_binaries(release: bool) -> anyhow::Result<PathBuf> {
    let root = root();
    let mut cargo = Command::new("cargo");
    cargo.current_dir(&root).args(["build", "--quiet"]);
    if release {
        cargo.arg("--release");
    }
    run(cargo.args([
        "--package",
        "meshcap-tests",
        "--package",
        "meshcap-cni",
        "--package",
        "meshcap-agent",
        "--bins",
    ]))?;
    Ok(root
        .join("target")
        .join(if release { "release" } else { "debug" }))
}
