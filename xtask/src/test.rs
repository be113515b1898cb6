//! `cargo xtask test`: the whole gate, as CI runs it. Each phase is timed.
use std::{process::Command, time::Instant};

use crate::cmd::{self, root};

pub fn run() -> anyhow::Result<()> {
    let root = root();
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| root.join("target"), std::path::PathBuf::from);
    let mut timings = Vec::new();
    let mut phase = |name: &'static str, cmd: &mut Command| -> anyhow::Result<()> {
        let start = Instant::now();
        if cmd.get_current_dir().is_none() {
            cmd.current_dir(&root);
        }
        cmd::run(cmd)?;
        timings.push((name, start.elapsed()));
        Ok(())
    };
    phase(
        "fmt",
        Command::new("cargo").args(["+nightly", "fmt", "--all", "--check"]),
    )?;
    phase(
        "clippy (host crates)",
        // The programs are linted on their own below: skip building them here.
        Command::new("cargo").env("AYA_BUILD_SKIP", "1").args([
            "clippy",
            "--workspace",
            "--exclude",
            "meshcap-ebpf",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ]),
    )?;
    phase(
        "clippy (eBPF crate)",
        // Its .cargo/config.toml selects bpfel and build-std; `cargo xtask` runs under the stable
        // toolchain's RUSTUP_TOOLCHAIN, which must not leak into this nightly build.
        Command::new("cargo")
            .current_dir(root.join("ebpf/meshcap-ebpf"))
            .env_remove("RUSTUP_TOOLCHAIN")
            .args(["+nightly", "clippy", "--release", "--", "-D", "warnings"]),
    )?;
    phase(
        "build meshcap-agent, meshcap-cni",
        Command::new("cargo").args(["build", "-p", "meshcap-agent", "-p", "meshcap-cni"]),
    )?;
    phase(
        "tests (host and real kernel)",
        // The end-to-end tests run these binaries; built once above instead of by each test
        // executable's own nested `cargo build`.
        Command::new("cargo")
            .env("MESHCAP_BIN_DIR", target.join("debug"))
            .args(["test", "--workspace", "--exclude", "meshcap-ebpf"]),
    )?;
    eprintln!("xtask test: all phases passed");
    for (name, took) in timings {
        eprintln!("  {name:<32} {:>7.1}s", took.as_secs_f64());
    }
    Ok(())
}
