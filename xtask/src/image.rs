//! `cargo xtask image`: the DaemonSet's container image as an OCI image archive
//! (`target/image/meshcap-<version>.oci.tar`: an OCI image layout in a tar, the `oci-archive`
//! of skopeo and podman, what containerd's `ctr images import` takes, and once unpacked a
//! layout `crane push` takes), written in Rust without a container engine.
//!
//! Two gzip'd layers: the host userland the agent runs (`ip`, the iptables family, their
//! libraries and extensions, data files; [`crate::userland`]), then the release binaries. The
//! output depends only on the files that go in: entries sorted, mtimes 0, owner root, no host
//! uid/gid or xattrs, gzip headers without a time, so the same inputs give the same digest.
use std::{
    collections::{BTreeMap, HashMap},
    fs,
    io::Write as _,
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{Context as _, ensure};
use serde_json::{Value, json};
use sha2::{Digest as _, Sha256};

use crate::{cmd, userland};

/// The image's name and tag, as `deploy/05-daemonset.yaml` refers to it.
pub const NAME: &str = "meshcap/meshcap";
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// Where the agent is in the image: the DaemonSet's command.
pub const AGENT_PATH: &str = "usr/local/bin/meshcap-agent";
/// Where the plugin is: beside the agent, where `meshcap-agent run --install-cni` looks for the
/// binary it copies into the host's CNI bin dir when `--plugin-binary` is not given.
pub const PLUGIN_PATH: &str = "usr/local/bin/meshcap-cni";
/// The command the DaemonSet runs, split as Entrypoint and Cmd.
const ENTRYPOINT: &str = "/usr/local/bin/meshcap-agent";
const CMD: &str = "run";
const DESCRIPTION: &str =
    "meshcap node agent: Istio sidecar traffic capture with eBPF (or Istio's iptables rules)";
const PATH_ENV: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

pub const MEDIA_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const MEDIA_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const MEDIA_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
pub const MEDIA_LAYER: &str = "application/vnd.oci.image.layer.v1.tar+gzip";

/// Options of `cargo xtask image`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The archive to write (default: target/image/meshcap-<version>.oci.tar).
    #[arg(long)]
    out: Option<PathBuf>,
    /// A prebuilt `meshcap-agent` instead of `cargo build --release` (with --plugin).
    #[arg(long, requires = "plugin")]
    agent: Option<PathBuf>,
    /// A prebuilt `meshcap-cni` (with --agent).
    #[arg(long, requires = "agent")]
    plugin: Option<PathBuf>,
}

/// What [`build`] wrote.
#[derive(Debug)]
pub struct Built {
    /// `sha256:...` of the image manifest: the digest a registry reports after a push.
    pub manifest_digest: String,
    /// Bytes of the archive.
    pub size: u64,
}

/// Builds the release binaries (unless given) and writes the archive.
pub fn run(args: &Args) -> anyhow::Result<()> {
    let start = Instant::now();
    let root = cmd::root();
    let target =
        std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from);
    let (agent, plugin) = if let (Some(agent), Some(plugin)) = (&args.agent, &args.plugin) {
        (agent.clone(), plugin.clone())
    } else {
        cmd::run(Command::new("cargo").current_dir(&root).args([
            "build",
            "--release",
            "-p",
            "meshcap-agent",
            "-p",
            "meshcap-cni",
        ]))?;
        let release = target.join("release");
        (release.join("meshcap-agent"), release.join("meshcap-cni"))
    };
    let out = args.out.clone().unwrap_or_else(|| {
        target
            .join("image")
            .join(format!("meshcap-{VERSION}.oci.tar"))
    });
    let built = build(&agent, &plugin, &out)?;
    eprintln!(
        "image: {NAME}:{VERSION} written to {} ({:.1} MB, manifest {}) in {:.1?}",
        out.display(),
        built.size as f64 / 1e6,
        built.manifest_digest,
        start.elapsed()
    );
    eprintln!(
        "image: push it with `skopeo copy oci-archive:{} docker://REGISTRY/meshcap:{VERSION}` \
         (docs/install.md)",
        out.display()
    );
    Ok(())
}

/// Writes the OCI archive of an image holding `agent`, `plugin` and the host userland to `out`.
pub fn build(agent: &Path, plugin: &Path, out: &Path) -> anyhow::Result<Built> {
    ensure!(
        std::env::consts::ARCH == "x86_64",
        "the image is amd64 and takes its userland from this host, which is {}",
        std::env::consts::ARCH
    );
    let mut base = Tree::default();
    base.dir("tmp", 0o1777);
    base.dir("run", 0o755);
    base.symlink("var/run", "../run");
    base.file(
        "etc/passwd",
        0o644,
        b"root:x:0:0:root:/root:/usr/sbin/nologin\n".to_vec(),
    );
    base.file("etc/group", 0o644, b"root:x:0:\n".to_vec());
    let entries = userland::entries(
        crate::arch::Arch::Amd64,
        &[agent.to_path_buf(), plugin.to_path_buf()],
    )?;
    base.files(&entries)?;

    let mut meshcap = Tree::default();
    meshcap.file(AGENT_PATH, 0o755, read(agent)?);
    meshcap.file(PLUGIN_PATH, 0o755, read(plugin)?);

    let mut blobs = BTreeMap::new();
    let mut layers = Vec::new();
    let mut diff_ids = Vec::new();
    for tree in [&base, &meshcap] {
        let tar = tree.tar()?;
        diff_ids.push(digest(&tar));
        let mut gz = flate2::GzBuilder::new()
            .mtime(0)
            .write(Vec::new(), flate2::Compression::default());
        gz.write_all(&tar)?;
        let gz = gz.finish()?;
        layers.push(descriptor(MEDIA_LAYER, &gz));
        blobs.insert(digest(&gz), gz);
    }

    let labels = json!({
        "org.opencontainers.image.title": "meshcap",
        "org.opencontainers.image.description": DESCRIPTION,
        "org.opencontainers.image.version": VERSION,
        "org.opencontainers.image.source": env!("CARGO_PKG_REPOSITORY"),
        "org.opencontainers.image.licenses": env!("CARGO_PKG_LICENSE"),
    });
    let config = json!({
        "created": "1970-01-01T00:00:00Z",
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Entrypoint": [ENTRYPOINT],
            "Cmd": [CMD],
            "Env": [PATH_ENV],
            "WorkingDir": "/",
            "User": "0:0",
            "Labels": labels,
        },
        "rootfs": { "type": "layers", "diff_ids": diff_ids },
        "history": [
            { "created": "1970-01-01T00:00:00Z", "created_by": "cargo xtask image: ip, iptables (legacy and nft), their libraries and extensions, data files" },
            { "created": "1970-01-01T00:00:00Z", "created_by": "cargo xtask image: meshcap-agent, meshcap-cni" },
        ],
    });
    let config = serde_json::to_vec(&config)?;
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": MEDIA_MANIFEST,
        "config": descriptor(MEDIA_CONFIG, &config),
        "layers": layers,
        "annotations": labels,
    });
    blobs.insert(digest(&config), config);
    let manifest = serde_json::to_vec(&manifest)?;
    let mut manifest_descriptor = descriptor(MEDIA_MANIFEST, &manifest);
    manifest_descriptor["platform"] = json!({ "architecture": "amd64", "os": "linux" });
    manifest_descriptor["annotations"] = json!({
        // The tag in the archive (`skopeo copy oci-archive:FILE:0.1.0 ...`; podman load).
        "org.opencontainers.image.ref.name": VERSION,
        // The name `ctr images import` gives it.
        "io.containerd.image.name": format!("docker.io/{NAME}:{VERSION}"),
    });
    let manifest_digest = digest(&manifest);
    blobs.insert(manifest_digest.clone(), manifest);
    let index = json!({
        "schemaVersion": 2,
        "mediaType": MEDIA_INDEX,
        "manifests": [manifest_descriptor],
    });

    let mut archive = Tree::default();
    archive.file(
        "oci-layout",
        0o644,
        br#"{"imageLayoutVersion":"1.0.0"}"#.to_vec(),
    );
    archive.file("index.json", 0o644, serde_json::to_vec(&index)?);
    for (digest, bytes) in blobs {
        let hex = digest.trim_start_matches("sha256:");
        archive.file(&format!("blobs/sha256/{hex}"), 0o644, bytes);
    }
    let bytes = archive.tar()?;
    if let Some(dir) = out.parent() {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let partial = out.with_extension("tar.partial");
    fs::write(&partial, &bytes).with_context(|| format!("writing {}", partial.display()))?;
    fs::rename(&partial, out).with_context(|| format!("renaming to {}", out.display()))?;
    Ok(Built {
        manifest_digest,
        size: bytes.len() as u64,
    })
}

/// `sha256:<hex>` of `bytes`.
pub fn digest(bytes: &[u8]) -> String {
    format!("sha256:{:x}", Sha256::digest(bytes))
}

fn descriptor(media_type: &str, bytes: &[u8]) -> Value {
    json!({ "mediaType": media_type, "digest": digest(bytes), "size": bytes.len() })
}

fn read(path: &Path) -> anyhow::Result<Vec<u8>> {
    fs::read(path).with_context(|| format!("reading {}", path.display()))
}

/// One entry of a layer.
enum Node {
    Dir(u32),
    File(u32, Vec<u8>),
    Symlink(String),
    /// Another path of the same layer with the same content (the iptables tools are a few
    /// multi-call binaries under many names).
    Hardlink(String),
}

/// A file tree, written as a tar in path order with parents first.
#[derive(Default)]
struct Tree {
    nodes: BTreeMap<String, Node>,
}

impl Tree {
    fn dir(&mut self, path: &str, mode: u32) {
        self.parents(path);
        self.nodes.insert(path.to_owned(), Node::Dir(mode));
    }

    fn file(&mut self, path: &str, mode: u32, data: Vec<u8>) {
        self.parents(path);
        self.nodes.insert(path.to_owned(), Node::File(mode, data));
    }

    fn symlink(&mut self, path: &str, target: &str) {
        self.parents(path);
        self.nodes
            .insert(path.to_owned(), Node::Symlink(target.to_owned()));
    }

    /// Host files, each copied once: a later path of the same file becomes a hard link to the
    /// first (in path order, so the link follows its target in the tar).
    fn files(&mut self, entries: &[userland::Entry]) -> anyhow::Result<()> {
        let mut sorted: Vec<&userland::Entry> = entries.iter().collect();
        sorted.sort_by(|a, b| a.path.cmp(&b.path));
        let mut seen: HashMap<PathBuf, &str> = HashMap::new();
        for entry in sorted {
            let real = fs::canonicalize(&entry.source)
                .with_context(|| format!("resolving {}", entry.source.display()))?;
            if let Some(first) = seen.get(&real) {
                self.parents(&entry.path);
                self.nodes
                    .insert(entry.path.clone(), Node::Hardlink((*first).to_owned()));
            } else {
                self.file(&entry.path, entry.mode, read(&entry.source)?);
                seen.insert(real, &entry.path);
            }
        }
        Ok(())
    }

    fn parents(&mut self, path: &str) {
        let mut parent = Path::new(path).parent();
        while let Some(dir) = parent.and_then(Path::to_str).filter(|d| !d.is_empty()) {
            self.nodes.entry(dir.to_owned()).or_insert(Node::Dir(0o755));
            parent = Path::new(dir).parent();
        }
    }

    /// The tree as an uncompressed tar: owner root, mtime 0, sorted by path (a parent sorts
    /// before its children).
    fn tar(&self) -> anyhow::Result<Vec<u8>> {
        let mut builder = tar::Builder::new(Vec::new());
        for (path, node) in &self.nodes {
            let mut header = tar::Header::new_gnu();
            header.set_uid(0);
            header.set_gid(0);
            header.set_mtime(0);
            header.set_size(0);
            match node {
                Node::Dir(mode) => {
                    header.set_entry_type(tar::EntryType::Directory);
                    header.set_mode(*mode);
                    builder.append_data(&mut header, format!("{path}/"), &[][..])?;
                }
                Node::File(mode, data) => {
                    header.set_entry_type(tar::EntryType::Regular);
                    header.set_mode(*mode);
                    header.set_size(data.len() as u64);
                    builder.append_data(&mut header, path, &data[..])?;
                }
                Node::Symlink(target) => {
                    header.set_entry_type(tar::EntryType::Symlink);
                    header.set_mode(0o777);
                    builder.append_link(&mut header, path, target)?;
                }
                Node::Hardlink(target) => {
                    header.set_entry_type(tar::EntryType::Link);
                    header.set_mode(0o644);
                    builder.append_link(&mut header, path, target)?;
                }
            }
        }
        Ok(builder.into_inner()?)
    }
}

#[cfg(test)]
mod tests;
