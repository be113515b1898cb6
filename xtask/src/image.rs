//! `cargo xtask image`: the DaemonSet's container image as an OCI image archive
//! (`target/image/meshcap-<version>.oci.tar`: an OCI image layout in a tar, the `oci-archive`
//! of skopeo and podman, what containerd's `ctr images import` takes, and once unpacked a
//! layout `crane push` takes), written in Rust without a container engine.
//!
//! One image index for linux/amd64 and linux/arm64 (the layout's `index.json` names it, tagged
//! with the version; it lists one image manifest per platform), so a mixed cluster pulls one
//! name and each node its own architecture. Each platform's image has two gzip'd layers: the
//! userland the agent runs (`ip`, the iptables family, their libraries and extensions, data
//! files), from Debian 12's packages of that architecture ([`crate::userland`]), then the
//! release binaries built for it ([`crate::arch`]). The output depends only on the files that
//! go in: entries sorted, mtimes 0, owner root, no host uid/gid or xattrs, gzip headers
//! without a time, so the same inputs give the same digests.
use std::{
    collections::{BTreeMap, HashMap},
    fs,
    io::Write as _,
    path::{Path, PathBuf},
    time::Instant,
};

use anyhow::{Context as _, bail, ensure};
use serde_json::{Value, json};
use sha2::{Digest as _, Sha256};

use crate::{
    arch::{self, Arch},
    cmd, userland,
};

/// The image's name, as the chart's defaults refer to it (`global.hub: localhost`, `image:
/// meshcap`, the appVersion as tag): a name only a node that imported the archive has, which no
/// public registry can serve.
pub const NAME: &str = "localhost/meshcap";
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
    /// Architectures to build and ship (repeatable; amd64 and arm64 without).
    #[arg(long = "arch", value_enum, conflicts_with = "agents")]
    arches: Vec<Arch>,
    /// A prebuilt `meshcap-agent` instead of the release build (with --plugin); repeatable,
    /// one per architecture, which is read from the file. The image has the platforms given.
    #[arg(long = "agent", requires = "plugins")]
    agents: Vec<PathBuf>,
    /// A prebuilt `meshcap-cni` (with --agent); repeatable, one per architecture.
    #[arg(long = "plugin", requires = "agents")]
    plugins: Vec<PathBuf>,
}

/// One platform's binaries.
#[derive(Clone, Debug)]
pub struct Platform {
    pub arch: Arch,
    pub agent: PathBuf,
    pub plugin: PathBuf,
}

/// What [`build`] wrote.
#[derive(Debug)]
pub struct Built {
    /// `sha256:...` of the image index: the digest a registry reports after a push.
    pub index_digest: String,
    /// Each platform's image manifest digest, by architecture.
    pub manifests: Vec<(Arch, String)>,
    /// Bytes of the archive.
    pub size: u64,
}

/// Builds the release binaries (unless given) and writes the archive.
pub fn run(args: &Args) -> anyhow::Result<()> {
    let start = Instant::now();
    let platforms = if args.agents.is_empty() {
        let arches = if args.arches.is_empty() {
            Arch::ALL.to_vec()
        } else {
            args.arches.clone()
        };
        arches
            .into_iter()
            .map(|arch| {
                let dir = arch::release(arch)?;
                Ok(Platform {
                    arch,
                    agent: dir.join("meshcap-agent"),
                    plugin: dir.join("meshcap-cni"),
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?
    } else {
        prebuilt(&args.agents, &args.plugins)?
    };
    let out = args.out.clone().unwrap_or_else(|| {
        cmd::target_dir()
            .join("image")
            .join(format!("meshcap-{VERSION}.oci.tar"))
    });
    let built = build(&platforms, &out)?;
    eprintln!(
        "image: {NAME}:{VERSION} written to {} ({:.1} MB, index {}) in {:.1?}",
        out.display(),
        built.size as f64 / 1e6,
        built.index_digest,
        start.elapsed()
    );
    for (arch, manifest) in &built.manifests {
        eprintln!("image:   linux/{arch}: manifest {manifest}");
    }
    eprintln!(
        "image: push it with `skopeo copy --all oci-archive:{} docker://REGISTRY/meshcap:{VERSION}` \
         (docs/install.md)",
        out.display()
    );
    Ok(())
}

/// `--agent` and `--plugin` paired by the architecture each file is built for.
fn prebuilt(agents: &[PathBuf], plugins: &[PathBuf]) -> anyhow::Result<Vec<Platform>> {
    let arch_of = |path: &PathBuf| -> anyhow::Result<Arch> {
        let bytes = read(path)?;
        Arch::of_elf(&bytes)
            .with_context(|| format!("{}: not an amd64 or arm64 Linux executable", path.display()))
    };
    let mut by_arch: BTreeMap<Arch, (Option<PathBuf>, Option<PathBuf>)> = BTreeMap::new();
    for (paths, is_agent) in [(agents, true), (plugins, false)] {
        for path in paths {
            let arch = arch_of(path)?;
            let slot = by_arch.entry(arch).or_default();
            let slot = if is_agent { &mut slot.0 } else { &mut slot.1 };
            if let Some(first) = slot.replace(path.clone()) {
                bail!(
                    "two {arch} {}s: {} and {}",
                    if is_agent { "agent" } else { "plugin" },
                    first.display(),
                    path.display()
                );
            }
        }
    }
    by_arch
        .into_iter()
        .map(|(arch, pair)| match pair {
            (Some(agent), Some(plugin)) => Ok(Platform {
                arch,
                agent,
                plugin,
            }),
            (Some(_), None) => bail!("an {arch} --agent but no {arch} --plugin"),
            _ => bail!("an {arch} --plugin but no {arch} --agent"),
        })
        .collect()
}

/// Writes the OCI archive of an image index holding, for each platform, an image with its
/// binaries and its architecture's userland, to `out`.
pub fn build(platforms: &[Platform], out: &Path) -> anyhow::Result<Built> {
    ensure!(!platforms.is_empty(), "an image needs a platform");
    let mut platforms = platforms.to_vec();
    platforms.sort_by_key(|p| p.arch);
    let mut blobs = BTreeMap::new();
    let mut descriptors = Vec::new();
    let mut manifests = Vec::new();
    for (i, platform) in platforms.iter().enumerate() {
        ensure!(
            platforms[..i].iter().all(|p| p.arch != platform.arch),
            "two {} platforms",
            platform.arch
        );
        let manifest = platform_image(platform, &mut blobs)?;
        let mut descriptor = descriptor(MEDIA_MANIFEST, &manifest);
        descriptor["platform"] = json!({ "architecture": platform.arch.name(), "os": "linux" });
        let manifest_digest = digest(&manifest);
        manifests.push((platform.arch, manifest_digest.clone()));
        blobs.insert(manifest_digest, manifest);
        descriptors.push(descriptor);
    }
    let index = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": MEDIA_INDEX,
        "manifests": descriptors,
        "annotations": labels(),
    }))?;
    let mut index_descriptor = descriptor(MEDIA_INDEX, &index);
    index_descriptor["annotations"] = json!({
        // The tag in the archive (`skopeo copy oci-archive:FILE:0.1.0 ...`; podman load).
        "org.opencontainers.image.ref.name": VERSION,
        // The name `ctr images import` gives it.
        "io.containerd.image.name": format!("{NAME}:{VERSION}"),
    });
    let index_digest = digest(&index);
    blobs.insert(index_digest.clone(), index);
    let layout = json!({
        "schemaVersion": 2,
        "mediaType": MEDIA_INDEX,
        "manifests": [index_descriptor],
    });

    let mut archive = Tree::default();
    archive.file(
        "oci-layout",
        0o644,
        br#"{"imageLayoutVersion":"1.0.0"}"#.to_vec(),
    );
    archive.file("index.json", 0o644, serde_json::to_vec(&layout)?);
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
        index_digest,
        manifests,
        size: bytes.len() as u64,
    })
}

/// The image annotations and config labels.
fn labels() -> Value {
    json!({
        "org.opencontainers.image.title": "meshcap",
        "org.opencontainers.image.description": DESCRIPTION,
        "org.opencontainers.image.version": VERSION,
        "org.opencontainers.image.source": env!("CARGO_PKG_REPOSITORY"),
        "org.opencontainers.image.licenses": env!("CARGO_PKG_LICENSE"),
    })
}

/// One platform's layers and config into `blobs`; returns its image manifest.
fn platform_image(
    platform: &Platform,
    blobs: &mut BTreeMap<String, Vec<u8>>,
) -> anyhow::Result<Vec<u8>> {
    let arch = platform.arch;
    let agent = read(&platform.agent)?;
    let plugin = read(&platform.plugin)?;
    for (path, bytes) in [(&platform.agent, &agent), (&platform.plugin, &plugin)] {
        let found = Arch::of_elf(bytes);
        ensure!(
            found == Some(arch),
            "{} is not an {arch} executable (it is {}): it cannot go in the linux/{arch} image",
            path.display(),
            found.map_or("something else", Arch::name)
        );
    }
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
    let entries = userland::entries(arch, &[platform.agent.clone(), platform.plugin.clone()])?;
    base.files(&entries)?;

    let mut meshcap = Tree::default();
    meshcap.file(AGENT_PATH, 0o755, agent);
    meshcap.file(PLUGIN_PATH, 0o755, plugin);

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
    let userland = format!(
        "cargo xtask image: ip, iptables (legacy and nft), their libraries and extensions, data \
         files, from Debian 12's {arch} packages"
    );
    let config = json!({
        "created": "1970-01-01T00:00:00Z",
        "architecture": arch.name(),
        "os": "linux",
        "config": {
            "Entrypoint": [ENTRYPOINT],
            "Cmd": [CMD],
            "Env": [PATH_ENV],
            "WorkingDir": "/",
            "User": "0:0",
            "Labels": labels(),
        },
        "rootfs": { "type": "layers", "diff_ids": diff_ids },
        "history": [
            { "created": "1970-01-01T00:00:00Z", "created_by": userland },
            { "created": "1970-01-01T00:00:00Z", "created_by": format!("cargo xtask image: meshcap-agent, meshcap-cni for {arch}") },
        ],
    });
    let config = serde_json::to_vec(&config)?;
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": MEDIA_MANIFEST,
        "config": descriptor(MEDIA_CONFIG, &config),
        "layers": layers,
        "annotations": labels(),
    });
    blobs.insert(digest(&config), config);
    Ok(serde_json::to_vec(&manifest)?)
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

    /// Userland files, each copied once: a later path of the same file becomes a hard link to
    /// the first (in path order, so the link follows its target in the tar).
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
                    // The target's mode: containerd's applier chmods the shared inode to a
                    // link's header mode, so 0644 here left the image's loader unexecutable.
                    let mode = match self.nodes.get(target) {
                        Some(Node::File(mode, _)) => *mode,
                        _ => bail!("{path}: a hard link to {target}, which is no file"),
                    };
                    header.set_entry_type(tar::EntryType::Link);
                    header.set_mode(mode);
                    builder.append_link(&mut header, path, target)?;
                }
            }
        }
        Ok(builder.into_inner()?)
    }
}

#[cfg(test)]
mod tests;
