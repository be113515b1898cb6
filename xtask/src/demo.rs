//! `cargo xtask demo`: builds meshcap and runs the standalone demo (tests/src/bin/meshcap-demo.rs):
//! the real agent and plugin against a throwaway pod, on both backends. Needs root: it loads BPF
//! programs and creates network namespaces and cgroups.
use std::process::Command;

use crate::cmd::{self, root};

pub fn run() -> anyhow::Result<()> {
    // Only what the demo runs: the agent, the plugin, the demo and its stand-in Envoy and
    // client; the test harness's other tools are not needed.
    cmd::run(Command::new("cargo").current_dir(root()).args([
        "build",
        "--quiet",
        "--package",
        "meshcap-agent",
        "--package",
        "meshcap-cni",
        "--package",
        "meshcap-tests",
        "--bin",
        "meshcap-agent",
        "--bin",
        "meshcap-cni",
        "--bin",
        "meshcap-demo",
        "--bin",
        "meshcap-standin",
        "--bin",
        "meshcap-dial",
    ]))?;
    let debug = cmd::target_dir().join("debug");
    // The binaries this build made: without it the demo would ask cargo for them again, under
    // whatever toolchain its environment names.
    cmd::run(
        Command::new(debug.join("meshcap-demo"))
            .env("MESHCAP_BIN_DIR", &debug)
            .current_dir(root()),
    )
}
