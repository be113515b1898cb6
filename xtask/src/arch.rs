//! The node architectures meshcap ships for, and building for them.
//!
//! Both ship from one toolchain, the installed nightly (the one that already builds the kernel
//! programs): it builds the standard library from its `rust-src` for the target
//! (`-Z build-std=std,panic_abort`), since rustup cannot fetch another target's prebuilt one
//! on these machines, and Debian's `gcc-aarch64-linux-gnu` links for aarch64
//! (`.cargo/config.toml`). amd64 is built the same way, so the two differ in their target
//! alone. The host's own builds (`cargo build`, the tests) stay on the pinned stable.
use std::{fmt, path::PathBuf, process::Command};

use crate::cmd;

/// A node architecture, named as Debian and OCI name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, clap::ValueEnum)]
pub enum Arch {
    Amd64,
    Arm64,
}

impl Arch {
    pub const ALL: [Self; 2] = [Self::Amd64, Self::Arm64];

    /// Debian's and OCI's name (`dpkg --print-architecture`, a platform's `architecture`).
    pub const fn name(self) -> &'static str {
        match self {
            Self::Amd64 => "amd64",
            Self::Arm64 => "arm64",
        }
    }

    /// Rust's target.
    pub const fn triple(self) -> &'static str {
        match self {
            Self::Amd64 => "x86_64-unknown-linux-gnu",
            Self::Arm64 => "aarch64-unknown-linux-gnu",
        }
    }

    /// The multiarch directory Debian installs this architecture's libraries in
    /// (`/usr/lib/<dir>`, `/lib/<dir>`).
    pub const fn multiarch(self) -> &'static str {
        match self {
            Self::Amd64 => "x86_64-linux-gnu",
            Self::Arm64 => "aarch64-linux-gnu",
        }
    }

    /// The ELF machine its executables carry.
    pub const fn elf_machine(self) -> u16 {
        match self {
            Self::Amd64 => object::elf::EM_X86_64,
            Self::Arm64 => object::elf::EM_AARCH64,
        }
    }

    /// This machine's.
    pub fn host() -> Option<Self> {
        match std::env::consts::ARCH {
            "x86_64" => Some(Self::Amd64),
            "aarch64" => Some(Self::Arm64),
            _ => None,
        }
    }

    /// The architecture of the ELF executable `bytes`; `None` for anything else.
    pub fn of_elf(bytes: &[u8]) -> Option<Self> {
        let machine = crate::elf::machine(bytes)?;
        Self::ALL.into_iter().find(|a| a.elf_machine() == machine)
    }

    /// binutils' `objcopy` for this architecture's files: this machine's own, or Debian's
    /// cross one (`binutils-aarch64-linux-gnu`, which gcc-aarch64-linux-gnu brings).
    pub fn objcopy(self) -> String {
        if Self::host() == Some(self) {
            "objcopy".to_owned()
        } else {
            format!("{}-objcopy", self.multiarch())
        }
    }

    /// `cargo +nightly <subcommand> --target <triple> -Z build-std=std,panic_abort`, from the
    /// workspace root: a build for this architecture with the toolchain that ships it.
    pub fn cargo(self, subcommand: &str) -> Command {
        let mut cargo = Command::new("cargo");
        cargo
            .current_dir(cmd::root())
            // `cargo xtask` runs under the pinned stable's RUSTUP_TOOLCHAIN (and cargo's own
            // path in CARGO): neither may choose this build's toolchain.
            .env_remove("RUSTUP_TOOLCHAIN")
            .args(["+nightly", subcommand, "--target", self.triple()])
            .args(["-Z", "build-std=std,panic_abort"]);
        cargo
    }

    /// Where [`Self::cargo`] puts a `profile`'s output.
    pub fn target_dir(self, profile: &str) -> PathBuf {
        cmd::target_dir().join(self.triple()).join(profile)
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Options of `cargo xtask build`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Architectures to build for (repeatable; all of them without).
    #[arg(long = "arch", value_enum)]
    arches: Vec<Arch>,
}

/// `cargo xtask build`: the release agent and plugin for each architecture asked for.
pub fn run(args: &Args) -> anyhow::Result<()> {
    let arches = if args.arches.is_empty() {
        Arch::ALL.to_vec()
    } else {
        args.arches.clone()
    };
    for arch in arches {
        let dir = release(arch)?;
        eprintln!(
            "build: {arch}: {} and {}",
            dir.join("meshcap-agent").display(),
            dir.join("meshcap-cni").display()
        );
    }
    Ok(())
}

/// Builds the release `meshcap-agent` (its kernel programs embedded) and `meshcap-cni` for
/// `arch`; returns the directory holding them.
pub fn release(arch: Arch) -> anyhow::Result<PathBuf> {
    let started = std::time::Instant::now();
    cmd::run(arch.cargo("build").args([
        "--release",
        "--package",
        "meshcap-agent",
        "--package",
        "meshcap-cni",
        "--bin",
        "meshcap-agent",
        "--bin",
        "meshcap-cni",
    ]))?;
    eprintln!(
        "build: {arch} release binaries in {:.0?}",
        started.elapsed()
    );
    Ok(arch.target_dir("release"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_test_binary_is_the_hosts() {
        let exe = std::fs::read(std::env::current_exe().expect("the test binary"))
            .expect("reading the test binary");
        assert_eq!(
            Arch::of_elf(&exe),
            Arch::host(),
            "the test binary is this host's"
        );
    }
}
