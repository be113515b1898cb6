//! The binaries the VM runs. For this machine's architecture they are built exactly as `cargo
//! xtask test` builds them (same commands, profile, features and target dir), so after `cargo
//! xtask test` this costs seconds instead of a second full build of the workspace. For the
//! other (arm64 on these machines) they are cross-built with the toolchain that ships that
//! architecture ([`Arch::cargo`]), only the test binaries that guest runs (its share, `share::CROSS`).
//! They are ordinary dynamically linked executables: the initramfs carries their ELF
//! interpreter and shared libraries (glibc, libgcc_s) of their architecture, as it does for
//! `ip` and iptables.
use std::{
    io::BufRead as _,
    path::PathBuf,
    process::{Command, Stdio},
};

use anyhow::{Context as _, ensure};
use serde_json::Value;

use crate::arch::Arch;

/// Binaries the harness starts from `MESHCAP_BIN_DIR` or beside the test executables.
const HELPERS: &[&str] = &[
    "meshcap-agent",
    "meshcap-cni",
    "meshcap-standin",
    "meshcap-dial",
    "meshcap-ztunnel",
    "meshcap-stream",
];

/// Tests that run on the host only, with the reason printed by every `integration` run: what
/// they need is not in the guest's initramfs.
pub const HOST_ONLY: &[(&str, &str)] = &[
    (
        "containerd",
        "drives a real containerd 1.6 with runc, ctr and the CNI reference plugins, which the \
         guest's initramfs does not carry; the kernel paths it crosses are the other tests'",
    ),
    (
        "daemonset",
        "runs the chart's DaemonSet under that containerd, from the image archive and the \
         chart rendered by helm, none of which the guest carries",
    ),
    (
        "leaving",
        "the agent's uninstall decisions against the test API server: no pod is captured, and \
         the removal of the kernel programs is uninstall's, which runs in the guest",
    ),
    (
        "permissions",
        "the shipped RBAC against what the agent and the plugin ask the test API server: no \
         kernel path is crossed that the other tests do not cross",
    ),
];

/// What the VM runs.
pub struct Binaries {
    /// Test executables of `tests/tests/*.rs`, by test name.
    pub tests: Vec<(String, PathBuf)>,
    /// The agent, the plugin and the harness's helpers (stand-in Envoy, dial client, stand-in
    /// ztunnel, stream ends).
    pub helpers: Vec<PathBuf>,
    /// The VM's init.
    pub init: PathBuf,
}

/// Builds (or finds up to date) the test executables of meshcap-tests for `arch`, the binaries
/// they start and the VM init. Of another architecture than this machine's, only
/// its share (`share::CROSS`) unless `whole_suite`.
pub fn build(arch: Arch, whole_suite: bool) -> anyhow::Result<Binaries> {
    let workspace = crate::cmd::root();
    let (mut tests, mut helpers, mut init) = (Vec::new(), Vec::new(), None);
    let commands = if Arch::host() == Some(arch) {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
        let command = |args: &[&str]| {
            let mut cmd = Command::new(&cargo);
            cmd.current_dir(&workspace).args(args);
            cmd
        };
        // `cargo xtask test`'s own test command (which also builds the agent's and the
        // harness's binaries for their packages' integration tests), then the two binaries it
        // does not build.
        vec![
            command(&[
                "test",
                "--workspace",
                "--exclude",
                "meshcap-ebpf",
                "--no-run",
            ]),
            command(&[
                "build",
                "-p",
                "meshcap-cni",
                "-p",
                "xtask",
                "--bin",
                "meshcap-cni",
                "--bin",
                "meshcap-vm-init",
            ]),
        ]
    } else {
        // One command, so that one feature resolution serves all: the harness's test
        // binaries and helpers, the agent (with the test build's crash points, which
        // meshcap-tests, selected with it, asks for), the plugin and the init.
        let mut build = arch.cargo("build");
        build.args([
            "-p",
            "meshcap-tests",
            "-p",
            "meshcap-agent",
            "-p",
            "meshcap-cni",
            "-p",
            "xtask",
        ]);
        for name in cross_tests(whole_suite)? {
            build.args(["--test", &name]);
        }
        for bin in HELPERS.iter().chain(&["meshcap-vm-init"]) {
            build.args(["--bin", bin]);
        }
        vec![build]
    };
    for command in commands {
        for artifact in cargo(command)? {
            let Artifact {
                package,
                name,
                kind,
                test,
                exe,
            } = artifact;
            if test {
                if kind == "test"
                    && package.contains("#meshcap-tests@")
                    && !HOST_ONLY.iter().any(|(host_only, _)| *host_only == name)
                {
                    tests.push((name, exe));
                }
            } else if name == "meshcap-vm-init" {
                init = Some(exe);
            } else if HELPERS.contains(&name.as_str())
                && !helpers.iter().any(|h: &PathBuf| h.ends_with(&name))
            {
                helpers.push(exe);
            }
        }
    }
    ensure!(
        !tests.is_empty(),
        "no test binaries were built (tests/tests/*.rs)"
    );
    for helper in HELPERS {
        ensure!(
            helpers.iter().any(|h| h.ends_with(helper)),
            "{helper} was not built"
        );
    }
    tests.sort();
    Ok(Binaries {
        tests,
        helpers,
        init: init.context("meshcap-vm-init was not built")?,
    })
}

/// The test binaries a guest of another architecture runs: those of its share, or with
/// `whole_suite` every one of `tests/tests/` the VMs run.
fn cross_tests(whole_suite: bool) -> anyhow::Result<Vec<String>> {
    if !whole_suite {
        let mut names: Vec<String> = super::share::CROSS
            .iter()
            .filter_map(|(selection, _)| selection.split("::").next())
            .map(str::to_owned)
            .collect();
        names.sort();
        names.dedup();
        return Ok(names);
    }
    let dir = crate::cmd::root().join("tests/tests");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .with_context(|| format!("listing {}", dir.display()))?
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e
                .file_name()
                .to_string_lossy()
                .strip_suffix(".rs")?
                .to_owned();
            (!HOST_ONLY.iter().any(|(host_only, _)| *host_only == name)).then_some(name)
        })
        .collect();
    names.sort();
    Ok(names)
}

/// One executable cargo produced.
struct Artifact {
    package: String,
    name: String,
    kind: String,
    test: bool,
    exe: PathBuf,
}

fn cargo(mut command: Command) -> anyhow::Result<Vec<Artifact>> {
    let described = format!("{command:?}");
    let mut child = command
        .arg("--message-format=json-render-diagnostics")
        .stdout(Stdio::piped())
        .spawn()
        .context("running cargo")?;
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
    ensure!(child.wait()?.success(), "{described} failed");
    Ok(artifacts)
}
