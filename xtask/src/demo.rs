//! `cargo xtask demo`: builds meshcap and runs the standalone demo (tests/src/bin/meshcap-demo.rs):
//! the real agent and plugin against a throwaway pod, on both backends. Needs root: it loads BPF
//! programs and creates network namespaces and cgroups.
use std::process::Command;

use crate::cmd::{self, root};

pub fn run() -> anyhow::Result<()> {
    let debug = cmd::build_binaries(false)?;
    cmd::run(Command::new(debug.join("meshcap-demo")).current_dir(root()))
}
