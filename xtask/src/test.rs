//! `cargo xtask test`: the whole gate, as CI runs it. Each phase is timed, and the disk space
//! left after it is reported: twice a CI machine ran out of disk (stops 28 and 29), and the
//! first thing to know then is how much there was.
use std::{path::Path, process::Command, time::Instant};

use anyhow::Context as _;

use crate::{
    arch::Arch,
    cmd::{self, root},
    fuzz, image, integration, tools,
};

/// What a clean clone's run writes to its disk, measured (docs/development.md "Disk"): build,
/// clippy and fuzz target directories, the arm64 guest's cross build (2.8 GB) and the VMs'
/// kernels and Debian packages (their initramfs is built in memory).
const CLEAN_RUN_WRITES: u64 = 15_000_000_000;

pub fn run(host_only: bool) -> anyhow::Result<()> {
    let root = root();
    let target = cmd::target_dir();
    let free_at_start = free_bytes(&root);
    eprintln!(
        "xtask test: {} free on {}",
        gb(free_at_start),
        root.display()
    );
    if free_at_start.is_some_and(|free| free < CLEAN_RUN_WRITES) {
        eprintln!(
            "xtask test: WARNING: a clean clone's run writes about {}; this disk may run out",
            gb(Some(CLEAN_RUN_WRITES))
        );
    }
    let mut timings = Vec::new();
    let mut phase = |name: String, run: &mut dyn FnMut() -> anyhow::Result<()>| {
        let start = Instant::now();
        run()
            .with_context(|| format!("{} free on {} now", gb(free_bytes(&root)), root.display()))?;
        timings.push((name, start.elapsed(), free_bytes(&root)));
        anyhow::Ok(())
    };
    let command = |cmd: &mut Command| {
        if cmd.get_current_dir().is_none() {
            cmd.current_dir(&root);
        }
        cmd::run(cmd)
    };
    phase("fmt".into(), &mut || {
        command(Command::new("cargo").args(["+nightly", "fmt", "--all", "--check"]))?;
        // The fuzz targets are a workspace of their own.
        command(
            Command::new("cargo")
                .current_dir(root.join("fuzz"))
                .env_remove("RUSTUP_TOOLCHAIN")
                .args(["+nightly", "fmt", "--all", "--check"]),
        )
    })?;
    phase("clippy (host crates)".into(), &mut || {
        // The programs are linted on their own below: skip building them here.
        command(Command::new("cargo").env("AYA_BUILD_SKIP", "1").args([
            "clippy",
            "--workspace",
            "--exclude",
            "meshcap-ebpf",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ]))
    })?;
    phase("clippy (eBPF crate)".into(), &mut || {
        // Its .cargo/config.toml selects bpfel and build-std; `cargo xtask` runs under the stable
        // toolchain's RUSTUP_TOOLCHAIN, which must not leak into this nightly build.
        command(
            Command::new("cargo")
                .current_dir(root.join("ebpf/meshcap-ebpf"))
                .env_remove("RUSTUP_TOOLCHAIN")
                .args(["+nightly", "clippy", "--release", "--", "-D", "warnings"]),
        )
    })?;
    phase("clippy (fuzz targets)".into(), &mut || {
        // Nightly, as cargo-fuzz builds them.
        command(
            Command::new("cargo")
                .current_dir(root.join("fuzz"))
                .env_remove("RUSTUP_TOOLCHAIN")
                .args([
                    "+nightly",
                    "clippy",
                    "--all-targets",
                    "--target-dir",
                    "target/clippy",
                    "--",
                    "-D",
                    "warnings",
                ]),
        )
    })?;
    phase("build (workspace)".into(), &mut || {
        // The whole workspace, as the test phase resolves it: built for two packages alone,
        // their dependencies' features unify differently and the test phase built them again.
        command(Command::new("cargo").args(["build", "--workspace", "--exclude", "meshcap-ebpf"]))
    })?;
    let mut arm64 = std::path::PathBuf::new();
    phase("build (arm64 guest's binaries)".into(), &mut || {
        // Cross-built and timed on its own: the arm64 guest's cost is this and its boot. Its
        // agent and plugin are also the test image's arm64 platform.
        arm64 = integration::build_binaries(Arch::Arm64)?;
        Ok(())
    })?;
    // The DaemonSet's image from the binaries just built (no release build), both platforms:
    // what tests/tests/daemonset.rs runs under containerd (its amd64 one) and checks the
    // chart's architectures against.
    let archive = target.join("image/meshcap-test.oci.tar");
    phase("image (debug binaries)".into(), &mut || {
        let platform = |arch, dir: &Path| image::Platform {
            arch,
            agent: dir.join("meshcap-agent"),
            plugin: dir.join("meshcap-cni"),
        };
        let platforms = [
            platform(Arch::Amd64, &target.join("debug")),
            platform(Arch::Arm64, &arm64),
        ];
        image::build(&platforms, &archive).map(drop)
    })?;
    phase("tests (host and real kernel)".into(), &mut || {
        // The end-to-end tests run these binaries; built once above instead of by each test
        // executable's own nested `cargo build`.
        command(
            Command::new("cargo")
                .env("MESHCAP_BIN_DIR", target.join("debug"))
                .env("MESHCAP_IMAGE_ARCHIVE", &archive)
                .env("MESHCAP_TOOLS_DIR", tools::dir())
                .args(["test", "--workspace", "--exclude", "meshcap-ebpf"]),
        )
    })?;
    phase(
        format!(
            "fuzz ({} targets, {} s each)",
            fuzz::TARGETS.len(),
            fuzz::CI_SECONDS
        ),
        &mut || {
            fuzz::run(&fuzz::Args {
                seconds: fuzz::CI_SECONDS,
                runs: None,
                target: Vec::new(),
            })
        },
    )?;
    if !host_only {
        // The same test binaries, already built above, in QEMU on Debian's kernels.
        phase(
            format!("integration (QEMU: {})", integration::CI_GUESTS.join(", ")),
            &mut || integration::run(&integration::Args::for_guests(integration::CI_GUESTS)),
        )?;
    }
    eprintln!(
        "xtask test: all phases passed ({} free at the start)",
        gb(free_at_start)
    );
    for (name, took, free) in timings {
        eprintln!(
            "  {name:<36} {:>7.1}s   {} free after",
            took.as_secs_f64(),
            gb(free)
        );
    }
    Ok(())
}

/// Bytes an unprivileged writer may still use on the filesystem holding `path`.
fn free_bytes(path: &Path) -> Option<u64> {
    let stat = nix::sys::statvfs::statvfs(path).ok()?;
    Some(stat.blocks_available() * stat.fragment_size())
}

fn gb(bytes: Option<u64>) -> String {
    bytes.map_or_else(
        || "unknown space".to_owned(),
        #[expect(clippy::cast_precision_loss, reason = "a figure for people")]
        |bytes| format!("{:.1} GB", bytes as f64 / 1e9),
    )
}
