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

/// `cargo build --tests --bins` of meshcap-tests, the agent and plugin binaries the tests
/// start, and the VM init, static.
pub fn build(workspace: &Path, target_dir: &Path) -> anyhow::Result<Binaries> {
    let (mut tests, mut helpers, mut init) = (Vec::new(), Vec::new(), None);
    let suites = [
        "--package",
        "meshcap-tests",
        "--tests",
        "--bins",
        "--package",
        "xtask",
        "--bin",
        "meshcap-vm-init",
    ];
    let daemons = [
        "--package",
        "meshcap-agent",
        "--package",
        "meshcap-cni",
        "--bins",
    ];
    for args in [&suites[..], &daemons[..]] {
        for artifact in cargo_build(workspace, target_dir, args)? {
            let Artifact {
                package,
                name,
                kind,
                test,
                exe,
            } = artifact;
            if name == "meshcap-vm-init" && !test {
                init = Some(exe);
            } else if kind == "test" && package.contains("#meshcap-tests@") {
                tests.push((name, exe));
            } else if kind == "bin" && !test && name != "xtask" {
                helpers.push(exe);
            }
        }
    }
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

/// One executable cargo produced.
struct Artifact {
    package: String,
    name: String,
    kind: String,
    test: bool,
    exe: PathBuf,
}

fn cargo_build(
    workspace: &Path,
    target_dir: &Path,
    args: &[&str],
) -> anyhow::Result<Vec<Artifact>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut child = Command::new(cargo)
        .current_dir(workspace)
        .arg("build")
        .args(args)
        .args([
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
    let mut artifacts = Vec::new();
    for line in std::io::BufReader::new(stdout).lines() {
        let message: Value = serde_json::from_str(&line?).unwrap_or_default();
        if message["reason"] != "compiler-artifact" {
            continue;
        }
        let Some(exe) = message["executable"].as_str().map(PathBuf::from) else {
            continue;
        };
        let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
        artifacts.push(Artifact {
            package: text(&message["package_id"]),
            name: text(&message["target"]["name"]),
            kind: text(&message["target"]["kind"][0]),
            test: message["profile"]["test"] == true,
            exe,
        });
    }
    ensure!(
        child.wait()?.success(),
        "cargo build {} failed",
        args.join(" ")
    );
    Ok(artifacts)
}
