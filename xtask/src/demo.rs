//! `cargo xtask demo`: builds meshcap and runs the standalone demo (tests/src/bin/meshcap-demo.rs)
//! against a throwaway pod. Needs root: it loads BPF programs and creates a network namespace.
use std::process::Command;

use crate::cmd::{self, root};

pub fn run() -> anyhow::Result<()> {
    let root = root();
    cmd::run(Command::new("cargo").current_dir(&root).args([
        "build",
        "--quiet",
        "--package",
        "meshcap-tests",
        "--bins",
    ]))?;
    cmd::run(&mut Command::new(root.join("target/debug/meshcap-demo")))
}
