//! The end-to-end test binaries, built static for the host's gnu target (no musl target can be
//! installed here): they run in a VM whose only userland is what the initramfs carries.
use std::{
    io::BufRead as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context as _, ensure};
use serde_json::Value;

/// The target the VM runs; set explicitly so the static flag reaches only its artifacts (build
/// scripts and proc macros stay dynamic, and aya-build's eBPF build is untouched).
pub const TARGET: &str = "x86_64-unknown-linux-gnu";

/// What the VM runs.
pub struct Binaries {
    /// Test executables of `tests/tests/*.rs`, by test name.
    pub tests: Vec<(String, PathBuf)>,
    /// The harness's helper binaries (stand-in Envoy, dial client), found beside the tests.
    pub helpers: Vec<PathBuf>,
    /// The VM's init.
    pub init: PathBuf,
}

/// `cargo build --tests --bins` of meshcap-tests and the VM init, static.
pub fn build(workspace: &Path, target_dir: &Path) -> anyhow::Result<Binaries> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut child = Command::new(cargo)
        .current_dir(workspace)
        .args([
            "build",
            "--package",
            "meshcap-tests",
            "--tests",
            "--bins",
            "--package",
            "xtask",
            "--bin",
            "meshcap-vm-init",
            "--message-format=json-render-diagnostics",
            "--target",
            TARGET,
        ])
        .arg("--target-dir")
        .arg(target_dir)
        .env(
            "CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUSTFLAGS",
            "-C target-feature=+crt-static",
        )
        .stdout(Stdio::piped())
        .spawn()
        .context("running cargo build")?;
    let stdout = child.stdout.take().context("cargo's stdout")?;
    let (mut tests, mut helpers, mut init) = (Vec::new(), Vec::new(), None);
    for line in std::io::BufReader::new(stdout).lines() {
        let message: Value = serde_json::from_str(&line?).unwrap_or_default();
        if message["reason"] != "compiler-artifact" {
            continue;
        }
        let Some(exe) = message["executable"].as_str().map(PathBuf::from) else {
            continue;
        };
        let package = message["package_id"].as_str().unwrap_or_default();
        let kind = &message["target"]["kind"];
        let name = message["target"]["name"].as_str().unwrap_or_default();
        let is_test_harness = message["profile"]["test"] == true;
        if name == "meshcap-vm-init" && !is_test_harness {
            init = Some(exe);
        } else if package.contains("#meshcap-tests@") {
            if kind == &serde_json::json!(["test"]) {
                tests.push((name.to_owned(), exe));
            } else if kind == &serde_json::json!(["bin"]) && !is_test_harness {
                helpers.push(exe);
            }
        }
    }
    ensure!(child.wait()?.success(), "building the test binaries failed");
    ensure!(
        !tests.is_empty(),
        "no test binaries were built (tests/tests/*.rs)"
    );
    tests.sort();
    Ok(Binaries {
        tests,
        helpers,
        init: init.context("meshcap-vm-init was not built")?,
    })
}
