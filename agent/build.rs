//! Builds the kernel programs (ebpf/meshcap-ebpf) with the installed nightly and embeds them,
//! and generates the ZDS messages (ztunnel's protocol, `proto/zds/zds.proto`) with prost.
//!
//! `AYA_BUILD_SKIP=1` skips the kernel programs (lint-only runs); the agent then embeds an
//! empty object and fails at load time with a message saying so.
use std::{env, fs, path::PathBuf};

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
