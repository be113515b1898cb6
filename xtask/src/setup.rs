//! `cargo xtask setup`: installs, idempotently, what a fresh machine of our kind lacks. A second
//! run finds everything and only says so.
use std::process::Command;

use anyhow::{Context as _, bail};

use crate::cmd::{self, output};

/// Debian packages meshcap builds and runs with: all the demo needs.
const RUN_PACKAGES: &[&str] = &[
    // bpf-linker links against the system LLVM; it must be at least rustc's LLVM (22).
    "llvm-22-dev",
    // The iptables fallback and the tests' network plumbing.
    "iptables",
    "iproute2",
    // The native nftables backend (Istio's `global.nativeNftables`) runs `nft`; Debian 12's
    // 1.0.6, no newer than what a node's own tools read back (istio/istio#58492).
    "nftables",
];

/// Debian packages only the tests, the guests, the image and the chart's checks use.
const TEST_PACKAGES: &[&str] = &[
    // `cargo xtask integration` boots Debian's kernels in QEMU (x86_64 and aarch64 guests);
    // objcopy strips the test binaries for its initramfs.
    "qemu-system-x86",
    "qemu-system-arm",
    "binutils",
    // arm64 builds (`cargo xtask build --arch arm64`, the arm64 guest's test binaries): the
    // linker and the C compiler of ring's and other crates' C parts for aarch64, and glibc's
    // aarch64 headers and libraries. The nightly builds the standard library from its rust-src.
    "gcc-aarch64-linux-gnu",
    // Only recommended by the compiler, so named: without it no C file builds for aarch64.
    "libc6-dev-arm64-cross",
    // Runs aarch64 programs on this host: the image test starts the arm64 image's tools and
    // binaries from the unpacked layers.
    "qemu-user",
    // The containerd test (tests/tests/containerd.rs): a private containerd 1.6 with runc and
    // the CNI reference plugins, its pause and app image built from the static busybox. The
    // package starts no daemon here (no init system runs it); the test starts its own.
    "containerd",
    "runc",
    "containernetworking-plugins",
    "busybox-static",
    // The chart's tools (helm, kubernetes-validate) live in a venv of their own (crate::tools).
    "python3-venv",
];

/// The eBPF toolchain: the installed nightly builds the programs with `-Z build-std=core`.
const NIGHTLY: &str = "nightly";
const BPF_LINKER_VERSION: &str = "0.13.0";
const LLVM_PREFIX: &str = "/usr/lib/llvm-22";
/// `cargo xtask fuzz` builds the targets with it.
const CARGO_FUZZ_VERSION: &str = "0.13.2";

/// What a task needs set up: the demo only builds and runs meshcap; everything else also tests.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// The eBPF toolchain and the node's network tools (`cargo xtask demo`).
    Run,
    /// All of it: QEMU and the cross toolchain, containerd, cargo-fuzz, the chart's tools.
    Everything,
}

pub fn run(need: Need) -> anyhow::Result<()> {
    let mut packages = RUN_PACKAGES.to_vec();
    if need == Need::Everything {
        packages.extend_from_slice(TEST_PACKAGES);
    }
    debian_packages(&packages)?;
    nightly_rust_src()?;
    bpf_linker()?;
    if need == Need::Everything {
        cargo_fuzz()?;
        crate::tools::install()?;
    }
    Ok(())
}

fn is_root() -> bool {
    output(Command::new("id").arg("-u")).is_some_and(|uid| uid.trim() == "0")
}

fn debian_packages(packages: &[&str]) -> anyhow::Result<()> {
    let missing: Vec<&str> = packages
        .iter()
        .copied()
        .filter(|pkg| {
            output(Command::new("dpkg-query").args(["-W", "-f=${Status}", pkg]))
                .is_none_or(|status| !status.ends_with("install ok installed"))
        })
        .collect();
    if missing.is_empty() {
        eprintln!("setup: Debian packages present: {}", packages.join(", "));
        return Ok(());
    }
    if !is_root() {
        bail!(
            "missing Debian packages {}; run as root (or `sudo apt-get install {}`)",
            missing.join(" "),
            missing.join(" ")
        );
    }
    eprintln!("setup: installing Debian packages {}", missing.join(", "));
    cmd::run(Command::new("apt-get").args(["update", "-qq"]))
        .context("apt-get update failed: this machine needs access to Debian's package mirrors")?;
    cmd::run(
        Command::new("apt-get")
            .env("DEBIAN_FRONTEND", "noninteractive")
            .args(["install", "-y", "-qq", "--no-install-recommends"])
            .args(&missing),
    )
    .context("apt-get install failed")
}

fn nightly_rust_src() -> anyhow::Result<()> {
    let Some(installed) = output(Command::new("rustup").args([
        "component",
        "list",
        "--installed",
        "--toolchain",
        NIGHTLY,
    ])) else {
        bail!(
            "no `{NIGHTLY}` Rust toolchain: the eBPF programs need it (rustup toolchain install {NIGHTLY})"
        );
    };
    if installed.lines().any(|line| line.starts_with("rust-src")) {
        eprintln!("setup: {NIGHTLY} rust-src present");
        return Ok(());
    }
    eprintln!("setup: adding rust-src to the {NIGHTLY} toolchain");
    cmd::run(Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", NIGHTLY]))
        .context("rustup could not add rust-src (it needs the Rust distribution server)")
}

fn bpf_linker() -> anyhow::Result<()> {
    let version = output(Command::new("bpf-linker").arg("--version"));
    if let Some(version) = version.as_deref()
        && version
            .split_whitespace()
            .nth(1)
            .is_some_and(|v| v == BPF_LINKER_VERSION)
    {
        eprintln!("setup: {} present", version.trim());
        return Ok(());
    }
    eprintln!(
        "setup: building bpf-linker {BPF_LINKER_VERSION} against LLVM 22 (found: {})",
        version.as_deref().map_or("none", str::trim)
    );
    cmd::run(
        Command::new("cargo")
            .env("LLVM_PREFIX", LLVM_PREFIX)
            .args([
                "install",
                "--locked",
                "--force",
                "--no-default-features",
                "--features",
                "llvm-22",
            ])
            .args(["--version", BPF_LINKER_VERSION, "bpf-linker"]),
    )
    .context("installing bpf-linker failed (it needs crates.io and llvm-22-dev)")
}

fn cargo_fuzz() -> anyhow::Result<()> {
    let version = output(Command::new("cargo").args(["fuzz", "--version"]));
    if let Some(version) = version.as_deref()
        && version
            .split_whitespace()
            .nth(1)
            .is_some_and(|v| v == CARGO_FUZZ_VERSION)
    {
        eprintln!("setup: {} present", version.trim());
        return Ok(());
    }
    eprintln!("setup: installing cargo-fuzz {CARGO_FUZZ_VERSION}");
    cmd::run(Command::new("cargo").args([
        "install",
        "--locked",
        "--force",
        "--version",
        CARGO_FUZZ_VERSION,
        "cargo-fuzz",
    ]))
    .context("installing cargo-fuzz failed (it needs crates.io)")
}
