//! The binaries the VM runs, built exactly as `cargo xtask test` builds them (same commands,
//! profile, features and target dir), so after `cargo xtask test` this costs seconds instead of
//! a second full build of the workspace. They are ordinary dynamically linked executables: the
//! initramfs carries their ELF interpreter and shared libraries (glibc, libgcc_s), as it does for
//! `ip` and iptables.
use std::{
    io::BufRead as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context as _, ensure};
use serde_json::Value;

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

/// Builds (or finds up to date) the test executables of meshcap-tests, the binaries they start
/// and the VM init.
pub fn build(workspace: &Path) -> anyhow::Result<Binaries> {
    let (mut tests, mut helpers, mut init) = (Vec::new(), Vec::new(), None);
    // `cargo xtask test`'s own test command (which also builds the agent's and the harness's
    // binaries for their packages' integration tests), then the two binaries it does not build.
    let commands: [&[&str]; 2] = [
        &[
            "test",
            "--workspace",
            "--exclude",
            "meshcap-ebpf",
            "--no-run",
        ],
        &[
            "build",
            "-p",
            "meshcap-cni",
            "-p",
            "xtask",
            "--bin",
            "meshcap-cni",
            "--bin",
            "meshcap-vm-init",
        ],
    ];
    for args in commands {
        for artifact in cargo(workspace, args)? {
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

/// One executable cargo produced.
struct Artifact {
    package: String,
    name: String,
    kind: String,
    test: bool,
    exe: PathBuf,
}

fn cargo(workspace: &Path, args: &[&str]) -> anyhow::Result<Vec<Artifact>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut child = Command::new(cargo)
        .current_dir(workspace)
        .args(args)
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
    ensure!(child.wait()?.success(), "cargo {} failed", args.join(" "));
    Ok(artifacts)
}
