//! The containerd tests' one image, built without a registry as an OCI image archive (the
//! format `cargo xtask image` writes and `ctr images import` reads): Debian's static busybox,
//! whose `sleep` is the sandbox's pause process, and the links that let a container use the
//! host's `/usr` (mounted read-only) for the dynamically linked test binaries.
use std::path::Path;

use anyhow::Context as _;
use serde_json::{Value, json};
use sha2::{Digest as _, Sha256};

/// Where busybox-static (`cargo xtask setup`) puts its binary.
pub const BUSYBOX: &str = "/bin/busybox";

const MEDIA_LAYER: &str = "application/vnd.oci.image.layer.v1.tar";
const MEDIA_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
const MEDIA_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const MEDIA_INDEX: &str = "application/vnd.oci.image.index.v1+json";

fn digest(bytes: &[u8]) -> String {
    format!("sha256:{:x}", Sha256::digest(bytes))
}

fn descriptor(media_type: &str, bytes: &[u8]) -> Value {
    json!({ "mediaType": media_type, "digest": digest(bytes), "size": bytes.len() })
}

/// An uncompressed tar of `dirs`, then `files` (`(path, mode, bytes)`), then symlinks
/// (`(path, target)`): owner root, mtime 0.
fn tar(
    files: &[(&str, u32, &[u8])],
    dirs: &[&str],
    links: &[(&str, &str)],
) -> anyhow::Result<Vec<u8>> {
    let mut builder = tar::Builder::new(Vec::new());
    let header = |kind: tar::EntryType, mode: u32, size: u64| {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_size(size);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(0);
        h
    };
    for dir in dirs {
        let mut h = header(tar::EntryType::Directory, 0o755, 0);
        builder.append_data(&mut h, format!("{dir}/"), &[][..])?;
    }
    for (path, mode, data) in files {
        let mut h = header(tar::EntryType::Regular, *mode, data.len() as u64);
        builder.append_data(&mut h, path, *data)?;
    }
    for (path, target) in links {
        let mut h = header(tar::EntryType::Symlink, 0o777, 0);
        builder.append_link(&mut h, path, target)?;
    }
    Ok(builder.into_inner()?)
}

/// Writes the image archive to `out`, named `name` for `ctr images import`; its default
/// command sleeps for ever (the pause container).
///
/// # Errors
/// When busybox is missing or `out` cannot be written.
pub fn write_test_image(out: &Path, name: &str) -> anyhow::Result<()> {
    let busybox = std::fs::read(BUSYBOX)
        .with_context(|| format!("reading {BUSYBOX} (Debian's busybox-static)"))?;
    let layer = tar(
        &[("bin/busybox", 0o755, &busybox)],
        &["bin", "usr", "tmp", "proc", "sys", "dev", "etc"],
        &[("lib", "usr/lib"), ("lib64", "usr/lib64")],
    )?;
    let config = serde_json::to_vec(&json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Entrypoint": ["/bin/busybox", "sleep", "2147483647"],
            "Env": ["PATH=/bin"],
            "WorkingDir": "/",
        },
        "rootfs": { "type": "layers", "diff_ids": [digest(&layer)] },
    }))?;
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": MEDIA_MANIFEST,
        "config": descriptor(MEDIA_CONFIG, &config),
        "layers": [descriptor(MEDIA_LAYER, &layer)],
    }))?;
    let mut manifest_descriptor = descriptor(MEDIA_MANIFEST, &manifest);
    manifest_descriptor["platform"] = json!({ "architecture": "amd64", "os": "linux" });
    manifest_descriptor["annotations"] = json!({ "io.containerd.image.name": name });
    let index = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": MEDIA_INDEX,
        "manifests": [manifest_descriptor],
    }))?;
    let blobs: Vec<(String, &[u8])> = [&layer, &config, &manifest]
        .into_iter()
        .map(|b| {
            (
                format!("blobs/sha256/{}", &digest(b)["sha256:".len()..]),
                &b[..],
            )
        })
        .collect();
    let mut files: Vec<(&str, u32, &[u8])> = vec![
        ("oci-layout", 0o644, br#"{"imageLayoutVersion":"1.0.0"}"#),
        ("index.json", 0o644, &index),
    ];
    files.extend(
        blobs
            .iter()
            .map(|(path, bytes)| (path.as_str(), 0o644, *bytes)),
    );
    let archive = tar(&files, &["blobs", "blobs/sha256"], &[])?;
    std::fs::write(out, archive).with_context(|| format!("writing {}", out.display()))
}
