//! Compiles the vendored CRI API (`proto/cri/api.proto`) into a tonic client for the containerd
//! tests, with protox (a protobuf compiler in Rust: Debian 12's protoc predates the field
//! options the current API uses).
fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/cri/api.proto");
    let descriptors = protox::compile(["api.proto"], ["proto/cri"])?;
    tonic_prost_build::configure()
        .build_server(false)
        .compile_fds(descriptors)?;
    Ok(())
}
