//! The image as a consumer sees it: the archive's index, manifest, config and blobs checked as
//! a registry client would, the layers unpacked, and the DaemonSet's command and the tools the
//! agent runs started from the unpacked tree with `chroot` (in a throwaway network namespace
//! for iptables). Built from the debug binaries, stripped, so it takes seconds.
use std::{
    collections::BTreeSet,
    fs,
    io::{Read as _, Write as _},
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use serde_json::Value;

use super::*;

/// `path` without debug info, in `dir` (the debug agent is ten times larger with it).
fn stripped(path: &Path, dir: &Path) -> PathBuf {
    let out = dir.join(path.file_name().expect("a file name"));
    let status = Command::new("objcopy")
        .arg("--strip-debug")
        .arg(path)
        .arg(&out)
        .status()
        .expect("running objcopy (binutils)");
    assert!(status.success(), "objcopy --strip-debug {}", path.display());
    out
}

/// A blob of the unpacked layout, checked against its descriptor (digest and size).
fn blob(layout: &Path, descriptor: &Value, media_type: &str) -> Vec<u8> {
    assert_eq!(descriptor["mediaType"], media_type, "{descriptor}");
    let digest = descriptor["digest"].as_str().expect("a digest");
    let hex = digest.strip_prefix("sha256:").expect("a sha256 digest");
    let bytes = fs::read(layout.join("blobs/sha256").join(hex)).expect("the blob is in blobs/");
    assert_eq!(super::digest(&bytes), digest, "blob content");
    assert_eq!(
        descriptor["size"].as_u64(),
        Some(bytes.len() as u64),
        "blob size"
    );
    bytes
}

/// Runs `args` inside the image (chroot into `rootfs`) with only `env` (and `PATH`) set,
/// optionally inside network namespace `netns`, feeding `stdin`; returns stdout and stderr.
/// Panics when it fails.
fn in_image(
    rootfs: &Path,
    netns: Option<&str>,
    env: &[(&str, &str)],
    args: &[&str],
    stdin: &str,
) -> String {
    let mut cmd = match netns {
        Some(netns) => {
            let mut cmd = Command::new("ip");
            cmd.args(["netns", "exec", netns, "chroot"]);
            cmd
        }
        None => Command::new("chroot"),
    };
    cmd.arg(rootfs)
        .args(args)
        .env_clear()
        .env("PATH", PATH_ENV.trim_start_matches("PATH="))
        .envs(env.iter().copied());
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running chroot");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(stdin.as_bytes())
        .expect("writing stdin");
    let out = child.wait_with_output().expect("waiting for chroot");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "in the image: {args:?} failed: {text}"
    );
    text
}

/// A throwaway network namespace, deleted on drop (also when the test fails).
struct Netns(String);

impl Netns {
    fn new() -> Self {
        let name = format!("meshcap-image-{}", std::process::id());
        let status = Command::new("ip")
            .args(["netns", "add", &name])
            .status()
            .expect("running ip netns add");
        assert!(status.success(), "ip netns add {name}");
        Self(name)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

fn executable(path: &Path) -> bool {
    fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The agent container of `deploy/05-daemonset.yaml`.
fn daemonset_container() -> Value {
    let text = fs::read_to_string(cmd::root().join("deploy/05-daemonset.yaml"))
        .expect("reading deploy/05-daemonset.yaml");
    let daemonset: Value = yaml_serde::from_str(&text).expect("parsing the DaemonSet");
    daemonset["spec"]["template"]["spec"]["containers"][0].clone()
}

#[test]
fn the_archive_is_an_oci_image_that_runs_the_daemonsets_command() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test unpacks the image and runs it with chroot and in a network namespace: run it as root"
    );
    let bin = meshcap_tests::agent::binaries();
    let work = tempfile::tempdir().expect("a temporary directory");
    let agent = stripped(&bin.join("meshcap-agent"), work.path());
    let plugin = stripped(&bin.join("meshcap-cni"), work.path());

    // Deterministic: a second build of the same inputs is the same archive, byte for byte.
    let first = work.path().join("first.oci.tar");
    let second = work.path().join("second.oci.tar");
    let built = build(&agent, &plugin, &first).expect("building the image");
    let again = build(&agent, &plugin, &second).expect("building the image again");
    assert_eq!(built.manifest_digest, again.manifest_digest);
    let bytes = fs::read(&first).expect("reading the archive");
    assert_eq!(
        bytes,
        fs::read(&second).expect("reading the second archive")
    );
    assert_eq!(built.size, bytes.len() as u64);

    // The oci-archive as skopeo reads it: a tar of an OCI image layout.
    let layout = work.path().join("layout");
    tar::Archive::new(&bytes[..])
        .unpack(&layout)
        .expect("unpacking the archive");
    let oci_layout: Value =
        serde_json::from_slice(&fs::read(layout.join("oci-layout")).expect("oci-layout"))
            .expect("oci-layout is JSON");
    assert_eq!(oci_layout["imageLayoutVersion"], "1.0.0");
    let index: Value =
        serde_json::from_slice(&fs::read(layout.join("index.json")).expect("index.json"))
            .expect("index.json is JSON");
    assert_eq!(index["schemaVersion"], 2);
    assert_eq!(index["mediaType"], MEDIA_INDEX);
    let manifests = index["manifests"].as_array().expect("manifests");
    assert_eq!(manifests.len(), 1, "{index}");
    assert_eq!(manifests[0]["digest"], built.manifest_digest.as_str());
    assert_eq!(
        manifests[0]["annotations"]["org.opencontainers.image.ref.name"],
        VERSION
    );
    let manifest: Value =
        serde_json::from_slice(&blob(&layout, &manifests[0], MEDIA_MANIFEST)).expect("manifest");
    assert_eq!(manifest["schemaVersion"], 2);
    let config: Value =
        serde_json::from_slice(&blob(&layout, &manifest["config"], MEDIA_CONFIG)).expect("config");
    assert_eq!(config["architecture"], "amd64");
    assert_eq!(config["os"], "linux");
    let labels = &config["config"]["Labels"];
    assert_eq!(labels["org.opencontainers.image.version"], VERSION);
    assert_eq!(
        labels["org.opencontainers.image.source"],
        env!("CARGO_PKG_REPOSITORY")
    );
    assert!(
        labels["org.opencontainers.image.source"]
            .as_str()
            .is_some_and(|s| s.starts_with("https://")),
        "{labels}"
    );

    // Every blob is referenced (no leftovers) and each layer matches its diff_id.
    let mut referenced = BTreeSet::from([
        manifests[0]["digest"].as_str().expect("digest").to_owned(),
        manifest["config"]["digest"]
            .as_str()
            .expect("digest")
            .to_owned(),
    ]);
    let layers = manifest["layers"].as_array().expect("layers");
    let diff_ids = config["rootfs"]["diff_ids"].as_array().expect("diff_ids");
    assert_eq!(config["rootfs"]["type"], "layers");
    assert_eq!(layers.len(), diff_ids.len());
    let rootfs = work.path().join("rootfs");
    for (layer, diff_id) in layers.iter().zip(diff_ids) {
        referenced.insert(layer["digest"].as_str().expect("digest").to_owned());
        let gz = blob(&layout, layer, MEDIA_LAYER);
        let mut tar = Vec::new();
        flate2::read::GzDecoder::new(&gz[..])
            .read_to_end(&mut tar)
            .expect("the layer is gzip");
        assert_eq!(super::digest(&tar), diff_id.as_str().expect("a diff_id"));
        let mut archive = tar::Archive::new(&tar[..]);
        archive.set_preserve_permissions(true);
        archive.unpack(&rootfs).expect("unpacking a layer");
    }
    let on_disk: BTreeSet<String> = fs::read_dir(layout.join("blobs/sha256"))
        .expect("blobs/sha256")
        .map(|e| {
            format!(
                "sha256:{}",
                e.expect("an entry").file_name().to_string_lossy()
            )
        })
        .collect();
    assert_eq!(on_disk, referenced);

    // The DaemonSet's image, command and the plugin the agent installs from beside itself.
    let container = daemonset_container();
    assert_eq!(container["image"], format!("{NAME}:{VERSION}").as_str());
    let command: Vec<&str> = container["command"]
        .as_array()
        .expect("the DaemonSet sets a command")
        .iter()
        .map(|c| c.as_str().expect("a string"))
        .collect();
    assert_eq!(
        config["config"]["Entrypoint"],
        serde_json::json!([command[0]])
    );
    assert_eq!(config["config"]["Cmd"], serde_json::json!(command[1..]));
    let agent_in_image = rootfs.join(command[0].trim_start_matches('/'));
    assert!(
        executable(&agent_in_image),
        "{command:?}: not executable in the image"
    );
    let plugin_in_image = agent_in_image.with_file_name("meshcap-cni");
    assert!(
        executable(&plugin_in_image),
        "the plugin is not beside the agent in the image"
    );
    assert_eq!(plugin_in_image, rootfs.join(PLUGIN_PATH));
    for dir in [
        "tmp",
        "etc/ssl/certs/ca-certificates.crt",
        "etc/passwd",
        "etc/protocols",
    ] {
        assert!(rootfs.join(dir).exists(), "/{dir} is missing");
    }
    assert_eq!(
        fs::metadata(rootfs.join("tmp"))
            .expect("/tmp")
            .permissions()
            .mode()
            & 0o7777,
        0o1777
    );

    // It runs: the agent and the tools find their libraries, loader and extensions.
    let version = in_image(&rootfs, None, &[], &[command[0], "--version"], "");
    assert!(version.contains(VERSION), "{version}");
    let cni = in_image(
        &rootfs,
        None,
        &[("CNI_COMMAND", "VERSION")],
        &["/usr/local/bin/meshcap-cni"],
        r#"{"cniVersion": "1.0.0"}"#,
    );
    assert!(cni.contains("supportedVersions"), "{cni}");
    assert!(in_image(&rootfs, None, &[], &["ip", "-V"], "").contains("iproute2"));
    for restore in [
        "iptables-restore",
        "iptables-legacy-restore",
        "iptables-nft-restore",
    ] {
        assert!(in_image(&rootfs, None, &[], &[restore, "--version"], "").contains("iptables"));
    }
    // Rules with the extensions the backend uses, applied and read back, legacy and nft, in a
    // throwaway network namespace.
    let netns = Netns::new();
    let rules = "*nat\n:MESHCAP_IMAGE - [0:0]\n\
                 -A OUTPUT -p tcp -m owner --uid-owner 1337 -j RETURN\n\
                 -A OUTPUT -p tcp -m multiport --dports 15020,15021 -j MESHCAP_IMAGE\n\
                 -A MESHCAP_IMAGE -p tcp -j REDIRECT --to-ports 15001\n\
                 COMMIT\n";
    for flavour in ["legacy", "nft"] {
        for family in ["iptables", "ip6tables"] {
            let restore = format!("{family}-{flavour}-restore");
            let save = format!("{family}-{flavour}-save");
            in_image(
                &rootfs,
                Some(&netns.0),
                &[],
                &[&restore, "--noflush"],
                rules,
            );
            let saved = in_image(&rootfs, Some(&netns.0), &[], &[&save, "-t", "nat"], "");
            assert!(
                saved.contains("--uid-owner 1337") && saved.contains("--to-ports 15001"),
                "{save} after {restore}: {saved}"
            );
        }
    }
}
