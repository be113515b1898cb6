//! meshcap's developer tasks. `cargo xtask <task>`; every task first runs `setup`, so a fresh
//! machine needs nothing done by hand.
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use setup::Need;

mod apt;
mod arch;
mod bench;
mod cmd;
mod demo;
mod elf;
mod fuzz;
mod image;
mod integration;
mod manifests;
mod setup;
mod soak;
mod test;
mod tools;
mod userland;

#[derive(Parser)]
#[command(name = "xtask", about = "meshcap developer tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install what a fresh machine lacks (Debian packages, nightly rust-src, bpf-linker,
    /// cargo-fuzz, the chart's tools).
    Setup {
        /// Only what building and running meshcap needs (what `demo` installs).
        #[arg(long)]
        demo: bool,
    },
    /// Setup, then the release `meshcap-agent` and `meshcap-cni` for each architecture
    /// (target/<triple>/release/), with the nightly and its rust-src.
    Build(arch::Args),
    /// Setup, then format check, clippy (host crates and the eBPF crate), every test including
    /// the real-kernel ones (root), every fuzz target for 20 s, then the end-to-end tests in QEMU
    /// on Debian's 5.10 and 6.1 x86 kernels and the kernel side on its 6.12 arm64 kernel. What
    /// CI runs.
    Test {
        /// Stop after the host suite (no QEMU phase).
        #[arg(long)]
        host_only: bool,
    },
    /// Setup, then run every fuzz target for a bounded time from the corpus in the tree.
    Fuzz(fuzz::Args),
    /// Set up only what running meshcap needs (the eBPF toolchain, iptables, nftables, iproute2),
    /// build, then show meshcap capturing a throwaway pod's traffic (root).
    Demo,
    /// Setup, then the end-to-end tests inside QEMU on Debian's cloud kernels, amd64 and arm64
    /// (CI's guests unless --kernel says which).
    Integration(integration::Args),
    /// Setup, build in release for amd64 and arm64, then write the DaemonSet's multi-arch
    /// container image as an OCI archive (target/image/meshcap-<version>.oci.tar) for skopeo,
    /// crane, podman or ctr to push.
    Image(image::Args),
    /// Setup, then write the plain manifests in deploy/ from the chart in deploy/chart (one
    /// source; a test fails when they are stale).
    Manifests,
    /// Setup, build in release, then the chaos soak: pods ADDed and DELeted in parallel with
    /// connections flowing while the agent is SIGKILLed every few seconds (root).
    Soak(soak::Args),
    /// Setup, build in release, then benchmark no capture vs Istio's iptables vs eBPF (root).
    Bench(bench::Args),
}

fn main() -> ExitCode {
    let result = match Cli::parse().task {
        Task::Setup { demo } => setup::run(if demo { Need::Run } else { Need::Everything }),
        Task::Build(args) => setup::run(Need::Everything).and_then(|()| arch::run(&args)),
        Task::Test { host_only } => {
            setup::run(Need::Everything).and_then(|()| test::run(host_only))
        }
        Task::Demo => setup::run(Need::Run).and_then(|()| demo::run()),
        Task::Fuzz(args) => setup::run(Need::Everything).and_then(|()| fuzz::run(&args)),
        Task::Soak(args) => setup::run(Need::Everything).and_then(|()| soak::run(&args)),
        Task::Integration(args) => {
            setup::run(Need::Everything).and_then(|()| integration::run(&args))
        }
        Task::Image(args) => setup::run(Need::Everything).and_then(|()| image::run(&args)),
        Task::Manifests => setup::run(Need::Everything).and_then(|()| manifests::run()),
        Task::Bench(args) => setup::run(Need::Everything).and_then(|()| bench::run(&args)),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("xtask: {err:#}");
            ExitCode::FAILURE
        }
    }
}
