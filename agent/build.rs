//! Builds the kernel programs (ebpf/meshcap-ebpf) with the installed nightly and embeds them,
//! and generates the ZDS messages (ztunnel's protocol, `proto/zds/zds.proto`) with prost.
//!
//! `AYA_BUILD_SKIP=1` skips the kernel programs (lint-only runs); the agent then embeds an
//! empty object and fails at load time with a message saying so.
use std::{
    env, fs,
    path::{Path, PathBuf},
};

use anyhow::Context as _;

fn main() -> anyhow::Result<()> {
    zds_messages()?;
    let out = PathBuf::from(env::var_os("OUT_DIR").context("OUT_DIR not set")?);
    let object = out.join("meshcap");
    println!("cargo:rerun-if-env-changed=AYA_BUILD_SKIP");
    if env::var_os("AYA_BUILD_SKIP").is_some_and(|v| v == "1") {
        if !object.exists() {
            fs::write(&object, []).context("writing the empty eBPF object stub")?;
        }
        return Ok(());
    }
    let ebpf = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").context("no manifest dir")?)
        .join("../ebpf");
    // aya-build watches the programs' crate; the decisions they share with the agent live in
    // meshcap-common, beside it, and must rebuild the object too.
    println!(
        "cargo:rerun-if-changed={}",
        ebpf.join("meshcap-common").display()
    );
    let root = ebpf.join("meshcap-ebpf");
    let root = root.to_str().context("non-UTF-8 path")?;
    share_programs_build(&out)?;
    aya_build::build_ebpf(
        [aya_build::Package {
            name: "meshcap-ebpf",
            root_dir: root,
            ..Default::default()
        }],
        aya_build::Toolchain::Custom("nightly"),
    )
    .context(
        "building the eBPF programs failed; run `cargo xtask setup` (nightly rust-src, bpf-linker)",
    )
}

/// Makes the cargo target directory aya-build gives the programs (under `OUT_DIR`, which
/// differs for every profile and feature set the agent is built with: the workspace build and
/// the test build each built the programs from nothing, a minute apiece) a link to one shared
/// directory per target directory and architecture (`<target dir>/ebpf/<arch>`; the programs'
/// `bpf_target_arch` is the agent's). Cargo's lock there serializes builds that run at once;
/// aya-build still copies the object into this `OUT_DIR`. Where no target directory is found
/// above `OUT_DIR` (it carries cargo's `CACHEDIR.TAG`), the build stays aya-build's own.
fn share_programs_build(out: &Path) -> anyhow::Result<()> {
    let link = out.join("aya-build").join("target").join("meshcap-ebpf");
    let Some(target_dir) = out
        .ancestors()
        .find(|dir| dir.join("CACHEDIR.TAG").is_file())
    else {
        // A link made in another target directory (this one copied from it) would build this
        // tree's programs there, where that tree's builds overwrite them.
        if link.is_symlink() {
            fs::remove_file(&link).with_context(|| format!("removing {}", link.display()))?;
        }
        return Ok(());
    };
    let arch = env::var("CARGO_CFG_TARGET_ARCH").context("CARGO_CFG_TARGET_ARCH not set")?;
    let shared = target_dir.join("ebpf").join(arch);
    if fs::read_link(&link).is_ok_and(|to| to == shared) {
        return Ok(());
    }
    fs::create_dir_all(&shared).with_context(|| format!("creating {}", shared.display()))?;
    if link.is_dir() && !link.is_symlink() {
        fs::remove_dir_all(&link).with_context(|| format!("removing {}", link.display()))?;
    } else if link.is_symlink() {
        fs::remove_file(&link).with_context(|| format!("removing {}", link.display()))?;
    }
    let parent = link
        .parent()
        .context("aya-build's target directory has a parent")?;
    fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    std::os::unix::fs::symlink(&shared, &link)
        .with_context(|| format!("linking {} to {}", link.display(), shared.display()))
}

/// `istio.workload.zds` as Rust types, compiled with protox (a protobuf compiler in Rust, so
/// no protoc is needed).
fn zds_messages() -> anyhow::Result<()> {
    println!("cargo:rerun-if-changed=proto/zds/zds.proto");
    let descriptors =
        protox::compile(["zds.proto"], ["proto/zds"]).context("compiling proto/zds/zds.proto")?;
    prost_build::Config::new()
        .compile_fds(descriptors)
        .context("generating the ZDS messages")
}
