//! The image as a consumer sees it: the archive's index, the platforms' manifests, configs and
//! blobs checked as a registry client would, each platform's layers unpacked, and the
//! DaemonSet's command and the tools the agent runs started from the unpacked tree: amd64's
//! with `chroot` (in a throwaway network namespace for iptables), arm64's under `qemu-aarch64`
//! (Debian's qemu-user) with the tree as its root for the loader and libraries. Every executable
//! of a platform's tree is checked to be of that platform's architecture. Built from the debug
//! binaries (arm64's from the arm64 guest's build, `cargo xtask test`'s phase before this one),
//! stripped, so it takes seconds once they are built.
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

/// `path` (of `arch`) without debug info or symbols, in `dir` (the debug agent is ten times
/// larger with them, and every build of the image compresses it).
fn stripped(arch: Arch, path: &Path, dir: &Path) -> PathBuf {
    let out = dir.join(format!(
        "{}-{arch}",
        path.file_name().expect("a file name").to_string_lossy()
    ));
    let status = Command::new(arch.objcopy())
        .arg("--strip-all")
        .arg(path)
        .arg(&out)
        .status()
        .expect("running objcopy (binutils)");
    assert!(status.success(), "objcopy --strip-all {}", path.display());
    out
}

/// Every regular file of `rootfs` that is an ELF executable or library, with its machine.
fn elf_files(rootfs: &Path) -> Vec<(PathBuf, Option<Arch>)> {
    let mut found = Vec::new();
    let mut dirs = vec![rootfs.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in fs::read_dir(&dir).expect("listing the tree") {
            let path = entry.expect("an entry").path();
            let meta = fs::symlink_metadata(&path).expect("metadata");
            if meta.is_dir() {
                dirs.push(path);
            } else if meta.is_file() {
                let bytes = fs::read(&path).expect("reading a file");
                if bytes.starts_with(b"\x7fELF") {
                    found.push((path, Arch::of_elf(&bytes)));
                }
            }
        }
    }
    found
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
    cmd.arg(rootfs).args(args);
    output(cmd, env, args, stdin)
}

/// Runs `args` of an arm64 image under `qemu-aarch64`, its loader, libraries and extensions
/// found in `rootfs` (`-L`), the program by its path in the image; as [`in_image`] otherwise.
fn in_arm64_image(rootfs: &Path, env: &[(&str, &str)], args: &[&str], stdin: &str) -> String {
    let program = ["usr/local/bin", "usr/sbin"]
        .iter()
        .map(|dir| rootfs.join(dir).join(args[0].trim_start_matches('/')))
        .find(|p| p.is_file())
        .unwrap_or_else(|| rootfs.join(args[0].trim_start_matches('/')));
    let mut cmd = Command::new("qemu-aarch64");
    cmd.arg("-L").arg(rootfs).arg(program).args(&args[1..]);
    output(cmd, env, args, stdin)
}

fn output(mut cmd: Command, env: &[(&str, &str)], args: &[&str], stdin: &str) -> String {
    cmd.env_clear()
        .env("PATH", PATH_ENV.trim_start_matches("PATH="))
        .envs(env.iter().copied());
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running the image's program");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(stdin.as_bytes())
        .expect("writing stdin");
    let out = child
        .wait_with_output()
        .expect("waiting for the image's program");
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

/// The debug binaries of both architectures, stripped, in `dir`.
fn platforms(dir: &Path) -> Vec<Platform> {
    let amd64 = meshcap_tests::agent::binaries().to_path_buf();
    let arm64 = crate::integration::build_binaries(Arch::Arm64).expect("the arm64 build");
    [(Arch::Amd64, amd64), (Arch::Arm64, arm64)]
        .into_iter()
        .map(|(arch, bin)| Platform {
            arch,
            agent: stripped(arch, &bin.join("meshcap-agent"), dir),
            plugin: stripped(arch, &bin.join("meshcap-cni"), dir),
        })
        .collect()
}

/// A platform's image as the archive holds it.
struct Unpacked {
    config: Value,
    rootfs: PathBuf,
}

/// Checks the manifest `descriptor` names, its config and layers (every blob it references
/// goes into `referenced`), and unpacks its layers into `rootfs`.
fn unpack_platform(
    layout: &Path,
    descriptor: &Value,
    rootfs: PathBuf,
    referenced: &mut BTreeSet<String>,
) -> Unpacked {
    referenced.insert(descriptor["digest"].as_str().expect("digest").to_owned());
    let manifest: Value =
        serde_json::from_slice(&blob(layout, descriptor, MEDIA_MANIFEST)).expect("manifest");
    assert_eq!(manifest["schemaVersion"], 2);
    referenced.insert(
        manifest["config"]["digest"]
            .as_str()
            .expect("digest")
            .to_owned(),
    );
    let config: Value =
        serde_json::from_slice(&blob(layout, &manifest["config"], MEDIA_CONFIG)).expect("config");
    assert_eq!(
        config["architecture"],
        descriptor["platform"]["architecture"]
    );
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
    // Each layer matches its diff_id.
    let layers = manifest["layers"].as_array().expect("layers");
    let diff_ids = config["rootfs"]["diff_ids"].as_array().expect("diff_ids");
    assert_eq!(config["rootfs"]["type"], "layers");
    assert_eq!(layers.len(), diff_ids.len());
    for (layer, diff_id) in layers.iter().zip(diff_ids) {
        referenced.insert(layer["digest"].as_str().expect("digest").to_owned());
        let gz = blob(layout, layer, MEDIA_LAYER);
        let mut tar = Vec::new();
        flate2::read::GzDecoder::new(&gz[..])
            .read_to_end(&mut tar)
            .expect("the layer is gzip");
        assert_eq!(super::digest(&tar), diff_id.as_str().expect("a diff_id"));
        let mut archive = tar::Archive::new(&tar[..]);
        archive.set_preserve_permissions(true);
        archive.unpack(&rootfs).expect("unpacking a layer");
    }
    Unpacked { config, rootfs }
}

#[test]
fn the_archive_is_a_multi_arch_oci_image_that_runs_the_daemonsets_command() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test unpacks the image and runs it with chroot and in a network namespace: run it as root"
    );
    let work = tempfile::tempdir().expect("a temporary directory");
    let platforms = platforms(work.path());

    // Deterministic: a second build of the same inputs is the same archive, byte for byte.
    let first = work.path().join("first.oci.tar");
    let second = work.path().join("second.oci.tar");
    let built = build(&platforms, &first).expect("building the image");
    let again = build(&platforms, &second).expect("building the image again");
    assert_eq!(built.index_digest, again.index_digest);
    let bytes = fs::read(&first).expect("reading the archive");
    assert_eq!(
        bytes,
        fs::read(&second).expect("reading the second archive")
    );
    assert_eq!(built.size, bytes.len() as u64);

    // The oci-archive as skopeo reads it: a tar of an OCI image layout, whose index.json names
    // one image index by the version's tag.
    let layout = work.path().join("layout");
    tar::Archive::new(&bytes[..])
        .unpack(&layout)
        .expect("unpacking the archive");
    let oci_layout: Value =
        serde_json::from_slice(&fs::read(layout.join("oci-layout")).expect("oci-layout"))
            .expect("oci-layout is JSON");
    assert_eq!(oci_layout["imageLayoutVersion"], "1.0.0");
    let top: Value =
        serde_json::from_slice(&fs::read(layout.join("index.json")).expect("index.json"))
            .expect("index.json is JSON");
    assert_eq!(top["schemaVersion"], 2);
    assert_eq!(top["mediaType"], MEDIA_INDEX);
    let tagged = top["manifests"].as_array().expect("manifests");
    assert_eq!(tagged.len(), 1, "{top}");
    assert_eq!(tagged[0]["digest"], built.index_digest.as_str());
    assert_eq!(
        tagged[0]["annotations"]["org.opencontainers.image.ref.name"],
        VERSION
    );
    assert_eq!(
        tagged[0]["annotations"]["io.containerd.image.name"],
        format!("{NAME}:{VERSION}").as_str()
    );
    let index: Value =
        serde_json::from_slice(&blob(&layout, &tagged[0], MEDIA_INDEX)).expect("the image index");
    assert_eq!(index["schemaVersion"], 2);
    let manifests = index["manifests"].as_array().expect("manifests");
    let platform_names: Vec<(&str, &str)> = manifests
        .iter()
        .map(|m| {
            (
                m["platform"]["os"].as_str().expect("os"),
                m["platform"]["architecture"]
                    .as_str()
                    .expect("architecture"),
            )
        })
        .collect();
    assert_eq!(platform_names, [("linux", "amd64"), ("linux", "arm64")]);
    let digests: Vec<(Arch, &str)> = built
        .manifests
        .iter()
        .map(|(arch, digest)| (*arch, digest.as_str()))
        .collect();
    assert_eq!(
        digests,
        [
            (
                Arch::Amd64,
                manifests[0]["digest"].as_str().expect("digest")
            ),
            (
                Arch::Arm64,
                manifests[1]["digest"].as_str().expect("digest")
            ),
        ]
    );

    // Every blob is referenced (no leftovers).
    let mut referenced = BTreeSet::from([built.index_digest.clone()]);
    let amd64 = unpack_platform(
        &layout,
        &manifests[0],
        work.path().join("rootfs-amd64"),
        &mut referenced,
    );
    let arm64 = unpack_platform(
        &layout,
        &manifests[1],
        work.path().join("rootfs-arm64"),
        &mut referenced,
    );
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

    // The DaemonSet's image, command and the plugin the agent installs from beside itself, on
    // both platforms; every executable and library of a platform is of its architecture.
    let container = daemonset_container();
    assert_eq!(container["image"], format!("{NAME}:{VERSION}").as_str());
    let command: Vec<&str> = container["command"]
        .as_array()
        .expect("the DaemonSet sets a command")
        .iter()
        .map(|c| c.as_str().expect("a string"))
        .collect();
    for (arch, image) in [(Arch::Amd64, &amd64), (Arch::Arm64, &arm64)] {
        let rootfs = &image.rootfs;
        assert_eq!(
            image.config["config"]["Entrypoint"],
            serde_json::json!([command[0]])
        );
        assert_eq!(
            image.config["config"]["Cmd"],
            serde_json::json!(command[1..])
        );
        let agent_in_image = rootfs.join(command[0].trim_start_matches('/'));
        assert!(
            executable(&agent_in_image),
            "{arch}: {command:?}: not executable in the image"
        );
        let plugin_in_image = agent_in_image.with_file_name("meshcap-cni");
        assert!(
            executable(&plugin_in_image),
            "{arch}: the plugin is not beside the agent in the image"
        );
        assert_eq!(plugin_in_image, rootfs.join(PLUGIN_PATH));
        for dir in [
            "tmp",
            "etc/ssl/certs/ca-certificates.crt",
            "etc/passwd",
            "etc/protocols",
            "etc/services",
        ] {
            assert!(rootfs.join(dir).exists(), "{arch}: /{dir} is missing");
        }
        assert_eq!(
            fs::metadata(rootfs.join("tmp"))
                .expect("/tmp")
                .permissions()
                .mode()
                & 0o7777,
            0o1777
        );
        let elfs = elf_files(rootfs);
        assert!(elfs.len() > 100, "{arch}: {} ELF files", elfs.len());
        let strangers: Vec<_> = elfs.iter().filter(|(_, a)| *a != Some(arch)).collect();
        assert!(strangers.is_empty(), "{arch}: {strangers:?}");
    }

    // amd64 runs: the agent and the tools find their libraries, loader and extensions.
    let rootfs = &amd64.rootfs;
    let version = in_image(rootfs, None, &[], &[command[0], "--version"], "");
    assert!(version.contains(VERSION), "{version}");
    let cni = in_image(
        rootfs,
        None,
        &[("CNI_COMMAND", "VERSION")],
        &["/usr/local/bin/meshcap-cni"],
        r#"{"cniVersion": "1.0.0"}"#,
    );
    assert!(cni.contains("supportedVersions"), "{cni}");
    assert!(in_image(rootfs, None, &[], &["ip", "-V"], "").contains("iproute2"));
    for restore in [
        "iptables-restore",
        "iptables-legacy-restore",
        "iptables-nft-restore",
    ] {
        assert!(in_image(rootfs, None, &[], &[restore, "--version"], "").contains("iptables"));
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
            in_image(rootfs, Some(&netns.0), &[], &[&restore, "--noflush"], rules);
            let saved = in_image(rootfs, Some(&netns.0), &[], &[&save, "-t", "nat"], "");
            assert!(
                saved.contains("--uid-owner 1337") && saved.contains("--to-ports 15001"),
                "{save} after {restore}: {saved}"
            );
        }
    }
    // The image's `nft` (the native nftables backend's) applies a transaction of Istio's
    // expressions, and the host's own `nft` reads it back (istio/istio#58492: a bundled `nft`
    // newer than the host's wrote what the host's could not read).
    let transaction = "add table inet meshcap-image\n\
                       add chain inet meshcap-image output { type nat hook output priority -100 ; }\n\
                       add rule inet meshcap-image output oifname lo meta l4proto tcp \
                       ip daddr != 127.0.0.1/32 tcp dport != { 53, 15008 } skuid 1337 counter \
                       redirect to :15006\n\
                       add rule inet meshcap-image output ct mark and 0xfff == 0x111 counter \
                       meta mark set ct mark\n";
    in_image(
        rootfs,
        Some(&netns.0),
        &[],
        &["nft", "-f", "-"],
        transaction,
    );
    let host = Command::new("ip")
        .args([
            "netns",
            "exec",
            &netns.0,
            "nft",
            "list",
            "table",
            "inet",
            "meshcap-image",
        ])
        .output()
        .expect("running the host's nft");
    let listed = String::from_utf8_lossy(&host.stdout);
    assert!(
        host.status.success()
            && listed.contains("meta skuid 1337")
            && listed.contains("redirect to :15006"),
        "the host's nft reads the image's table: {listed}{}",
        String::from_utf8_lossy(&host.stderr)
    );

    // arm64 runs, emulated: the same programs start from the arm64 tree with its own loader,
    // libraries and extensions. (qemu-user passes no netfilter socket options or netlink
    // families through, so the arm64 rules are applied in the arm64 guest of `cargo xtask
    // integration`, whose userland is this one, by the iptables backend's tests.)
    let rootfs = &arm64.rootfs;
    let version = in_arm64_image(rootfs, &[], &[command[0], "--version"], "");
    assert!(version.contains(VERSION), "{version}");
    let cni = in_arm64_image(
        rootfs,
        &[("CNI_COMMAND", "VERSION")],
        &["/usr/local/bin/meshcap-cni"],
        r#"{"cniVersion": "1.0.0"}"#,
    );
    assert!(cni.contains("supportedVersions"), "{cni}");
    assert!(in_arm64_image(rootfs, &[], &["ip", "-V"], "").contains("iproute2"));
    for restore in [
        "iptables-restore",
        "iptables-legacy-restore",
        "iptables-nft-restore",
    ] {
        assert!(in_arm64_image(rootfs, &[], &[restore, "--version"], "").contains("iptables"));
    }
    // (`nft` opens a netlink socket before anything else, even for `--version`: the arm64
    // one runs in the arm64 guest of `cargo xtask integration`, whose userland is this one,
    // through the nftables scenario table.)
    // The extensions the backend's rules name load (their options are in the help).
    let help = in_arm64_image(
        rootfs,
        &[],
        &[
            "iptables-legacy",
            "-m",
            "owner",
            "-m",
            "multiport",
            "-j",
            "REDIRECT",
            "-h",
        ],
        "",
    );
    for option in ["--uid-owner", "--dports", "--to-ports"] {
        assert!(help.contains(option), "{option} missing: {help}");
    }
}

#[test]
fn a_binary_goes_only_into_its_own_architectures_image() {
    let work = tempfile::tempdir().expect("a temporary directory");
    let bin = meshcap_tests::agent::binaries();
    let (agent, plugin) = (bin.join("meshcap-agent"), bin.join("meshcap-cni"));
    let wrong = [Platform {
        arch: Arch::Arm64,
        agent: agent.clone(),
        plugin: plugin.clone(),
    }];
    let err = build(&wrong, &work.path().join("wrong.oci.tar"))
        .expect_err("an amd64 agent in the arm64 image")
        .to_string();
    assert!(
        err.contains("meshcap-agent is not an arm64 executable (it is amd64)"),
        "{err}"
    );
    // --agent and --plugin pair by the architecture read from the files.
    let paired = prebuilt(std::slice::from_ref(&agent), std::slice::from_ref(&plugin))
        .expect("an amd64 pair");
    assert_eq!(paired.len(), 1);
    assert_eq!(paired[0].arch, Arch::Amd64);
    assert_eq!((&paired[0].agent, &paired[0].plugin), (&agent, &plugin));
    let twice = prebuilt(
        &[agent.clone(), agent.clone()],
        std::slice::from_ref(&plugin),
    )
    .expect_err("two amd64 agents")
    .to_string();
    assert!(twice.contains("two amd64 agents"), "{twice}");
    let alone = prebuilt(std::slice::from_ref(&agent), &[])
        .expect_err("no plugin")
        .to_string();
    assert!(
        alone.contains("an amd64 --agent but no amd64 --plugin"),
        "{alone}"
    );
    let script = work.path().join("script");
    fs::write(&script, "#!/bin/sh\n").expect("writing a script");
    let not_elf = prebuilt(&[script], std::slice::from_ref(&plugin))
        .expect_err("not an executable")
        .to_string();
    assert!(
        not_elf.contains("not an amd64 or arm64 Linux executable"),
        "{not_elf}"
    );
}
