//! The userland meshcap needs beside its own binaries, for one architecture: the tools the
//! agent and the test harness run (`ip`, `tc`, the iptables family, legacy and nft, and `nft`), the files
//! they read, the iptables extensions they load and every shared library all of these (and any
//! extra executables) link, with the loader. Taken from Debian 12's packages of that
//! architecture ([`crate::apt`]: downloaded, checked, unpacked, never run here), so an arm64
//! image or VM gets arm64 tools whatever this machine is, and the same inputs give the same
//! files on any machine. One list, used by the VMs' initramfs (`integration`) and by the
//! container image (`image`).
use std::{
    collections::{BTreeMap, BTreeSet, VecDeque},
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, bail, ensure};
use sha2::{Digest as _, Sha256};

use crate::{
    apt::{self, Apt},
    arch::Arch,
    elf,
};

/// Debian packages the userland comes from: the tools' own and every library they (and
/// meshcap's binaries: glibc, libgcc) link. A library none of them holds fails the build,
/// naming it and what needs it.
const PACKAGES: &[&str] = &[
    "libc6",
    "libgcc-s1",
    "iproute2",
    "libbpf1",
    "libelf1",
    "zlib1g",
    "libmnl0",
    "libbsd0",
    "libmd0",
    "libcap2",
    "iptables",
    "libxtables12",
    "libip4tc2",
    "libip6tc2",
    "libnftnl11",
    "libnetfilter-conntrack3",
    "libnfnetlink0",
    // `nft`, for the native nftables backend (`global.nativeNftables`), and its libraries.
    "nftables",
    "libnftables1",
    "libedit2",
    "libtinfo6",
    "libgmp10",
    "libjansson4",
    // /etc/protocols and /etc/services.
    "netbase",
    // The CA bundle rustls (kube-rs) insists on loading, even for the tests' plain-HTTP API
    // server; made from the package's certificates as its installation would.
    "ca-certificates",
];

/// Tools the harness and the iptables backend run, by the name they are run by and the
/// package's file. `iptables`, `ip6tables` and their `-save` and `-restore` are Debian's
/// alternatives, which the packages' installation points at the nft flavour by default (the
/// higher priority): so here.
const TOOLS: &[(&str, &str)] = &[
    ("ip", "ip"),
    // The tests inspect and set up netlink TC attachments with it (`ip netns exec NS tc`).
    ("tc", "tc"),
    ("iptables", "iptables-nft"),
    ("iptables-save", "iptables-nft-save"),
    ("iptables-restore", "iptables-nft-restore"),
    ("ip6tables", "ip6tables-nft"),
    ("ip6tables-save", "ip6tables-nft-save"),
    ("ip6tables-restore", "ip6tables-nft-restore"),
    ("iptables-legacy", "iptables-legacy"),
    ("iptables-legacy-save", "iptables-legacy-save"),
    ("iptables-legacy-restore", "iptables-legacy-restore"),
    ("ip6tables-legacy", "ip6tables-legacy"),
    ("ip6tables-legacy-save", "ip6tables-legacy-save"),
    ("ip6tables-legacy-restore", "ip6tables-legacy-restore"),
    ("iptables-nft", "iptables-nft"),
    ("iptables-nft-save", "iptables-nft-save"),
    ("iptables-nft-restore", "iptables-nft-restore"),
    ("ip6tables-nft", "ip6tables-nft"),
    ("ip6tables-nft-save", "ip6tables-nft-save"),
    ("ip6tables-nft-restore", "ip6tables-nft-restore"),
    ("nft", "nft"),
];

/// Where the packages keep their programs.
const TOOL_DIRS: &[&str] = &["usr/sbin", "usr/bin", "sbin", "bin"];

/// Plain data files those tools read.
const DATA_FILES: &[&str] = &["etc/protocols", "etc/services", CA_BUNDLE];

/// The bundle `update-ca-certificates` writes when ca-certificates is installed.
const CA_BUNDLE: &str = "etc/ssl/certs/ca-certificates.crt";

/// Where the tools go in the tree (on `PATH`).
pub const TOOLS_DIR: &str = "usr/sbin";

/// One file of the userland: where it goes (relative to the root of the tree), the file it is
/// (in the unpacked packages, symbolic links followed), and its permission bits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub path: String,
    pub source: PathBuf,
    pub mode: u32,
}

/// The userland for `arch`, in this order: data files, tools, iptables extensions, then the
/// loader and shared libraries of the tools, the extensions and `also_link_for` (executables
/// of `arch`, which must be; each library where Debian installs it, the loader at the path
/// the executables name).
pub fn entries(arch: Arch, also_link_for: &[PathBuf]) -> anyhow::Result<Vec<Entry>> {
    let root = unpacked(arch)?;
    let mut entries = Vec::new();
    for file in DATA_FILES {
        let source = resolve(&root, file).with_context(|| format!("/{file} is in no package"))?;
        entries.push(entry(file, source, 0o644));
    }
    let mut elfs: Vec<(String, PathBuf)> = also_link_for
        .iter()
        .map(|p| (p.display().to_string(), p.clone()))
        .collect();
    for (name, file) in TOOLS {
        let source = TOOL_DIRS
            .iter()
            .find_map(|dir| resolve(&root, &format!("{dir}/{file}")))
            .with_context(|| format!("{file} is in none of {}", PACKAGES.join(", ")))?;
        entries.push(entry(&format!("{TOOLS_DIR}/{name}"), source.clone(), 0o755));
        elfs.push((name.to_string(), source));
    }
    let xtables = format!("usr/lib/{}/xtables", arch.multiarch());
    let mut extensions: Vec<PathBuf> = fs::read_dir(root.join(&xtables))
        .with_context(|| format!("no /{xtables} in the iptables package"))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .collect();
    extensions.sort();
    for path in extensions {
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        let path = format!("{xtables}/{name}");
        let source = resolve(&root, &path).with_context(|| format!("/{path}: a broken link"))?;
        entries.push(entry(&path, source.clone(), 0o644));
        elfs.push((path, source));
    }
    entries.extend(libraries(&root, arch, elfs)?);
    Ok(entries)
}

fn entry(path: &str, source: PathBuf, mode: u32) -> Entry {
    Entry {
        path: path.trim_matches('/').to_owned(),
        source,
        mode,
    }
}

/// The packages of `arch`, unpacked together as one system's files, with the CA bundle their
/// installation would write; cached under the versions' digest (a newer package makes a new
/// tree, the old one is removed).
fn unpacked(arch: Arch) -> anyhow::Result<PathBuf> {
    let apt = Apt::new(apt::USERLAND_RELEASE, arch)?;
    let debs = apt.debs(PACKAGES)?;
    let mut names: Vec<String> = debs
        .iter()
        .map(|d| {
            d.file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    names.sort();
    let key = format!("{:x}", Sha256::digest(names.join("\n")));
    let prefix = format!("userland-{}-{arch}-", apt::USERLAND_RELEASE);
    let dir = apt::cache_dir().join(format!("{prefix}{}", &key[..16]));
    if !dir.is_dir() {
        for old in fs::read_dir(apt::cache_dir())?.filter_map(Result::ok) {
            if old.file_name().to_string_lossy().starts_with(&prefix) {
                let _ = fs::remove_dir_all(old.path());
            }
        }
        let partial = dir.with_extension("bundle");
        let _ = fs::remove_dir_all(&partial);
        apt::unpack(&debs, &partial)?;
        ca_bundle(&partial)?;
        fs::rename(&partial, &dir)?;
    }
    Ok(dir)
}

/// `update-ca-certificates`' bundle: every certificate of the package, in name order.
fn ca_bundle(root: &Path) -> anyhow::Result<()> {
    let dir = root.join("usr/share/ca-certificates/mozilla");
    let mut certificates: Vec<PathBuf> = fs::read_dir(&dir)
        .with_context(|| format!("listing {}", dir.display()))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "crt"))
        .collect();
    ensure!(
        !certificates.is_empty(),
        "no certificates in {}",
        dir.display()
    );
    certificates.sort();
    let mut bundle = Vec::new();
    for certificate in certificates {
        let pem = fs::read(&certificate)?;
        bundle.extend_from_slice(&pem);
        if !pem.ends_with(b"\n") {
            bundle.push(b'\n');
        }
    }
    let out = root.join(CA_BUNDLE);
    fs::create_dir_all(out.parent().context("the bundle's directory")?)?;
    fs::write(out, bundle)?;
    Ok(())
}

/// `path` (relative to `root`) with every symbolic link on the way followed inside `root`, as
/// the system the packages are unpacked for would follow it; `None` unless it ends at a file.
fn resolve(root: &Path, path: &str) -> Option<PathBuf> {
    let mut pending: VecDeque<String> = path.split('/').map(str::to_owned).collect();
    let mut at = PathBuf::new();
    let mut links = 0;
    while let Some(part) = pending.pop_front() {
        match part.as_str() {
            "" | "." => continue,
            ".." => {
                at.pop();
                continue;
            }
            _ => {}
        }
        let next = at.join(&part);
        if fs::symlink_metadata(root.join(&next))
            .ok()?
            .file_type()
            .is_symlink()
        {
            links += 1;
            if links > 40 {
                return None;
            }
            let target = fs::read_link(root.join(&next)).ok()?;
            let target = target.to_str()?;
            if target.starts_with('/') {
                at = PathBuf::new();
            }
            for part in target.split('/').rev() {
                pending.push_front(part.to_owned());
            }
        } else {
            at = next;
        }
    }
    let file = root.join(at);
    file.is_file().then_some(file)
}

/// The loader and every shared library `elfs` (named, file) need, transitively: each where
/// the loader finds it (Debian's multiarch directories, then `/lib` and `/usr/lib`).
fn libraries(root: &Path, arch: Arch, elfs: Vec<(String, PathBuf)>) -> anyhow::Result<Vec<Entry>> {
    let dirs = [
        format!("lib/{}", arch.multiarch()),
        format!("usr/lib/{}", arch.multiarch()),
        "lib".to_owned(),
        "usr/lib".to_owned(),
    ];
    let mut found: BTreeMap<String, PathBuf> = BTreeMap::new();
    let mut queue: VecDeque<(String, PathBuf)> = elfs.into();
    let mut scanned = BTreeSet::new();
    while let Some((name, file)) = queue.pop_front() {
        if !scanned.insert(file.clone()) {
            continue;
        }
        let bytes = fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
        let machine = Arch::of_elf(&bytes);
        if machine != Some(arch) {
            bail!(
                "{name} ({}) is not an {arch} executable (it is {})",
                file.display(),
                machine.map_or("something else", Arch::name)
            );
        }
        let needs = elf::needs(&bytes).with_context(|| format!("reading {name}"))?;
        if let Some(loader) = needs.interpreter {
            let path = loader.trim_start_matches('/').to_owned();
            let source = resolve(root, &path)
                .with_context(|| format!("{name} needs the loader {loader}, which libc6 lacks"))?;
            queue.push_back((loader, source.clone()));
            found.insert(path, source);
        }
        for library in needs.libraries {
            let Some((path, source)) = dirs.iter().find_map(|dir| {
                let path = format!("{dir}/{library}");
                resolve(root, &path).map(|source| (path, source))
            }) else {
                bail!(
                    "{name} needs {library}, which none of the {arch} packages {} holds: add \
                     its Debian package to userland::PACKAGES",
                    PACKAGES.join(", ")
                );
            };
            queue.push_back((library, source.clone()));
            found.insert(path, source);
        }
    }
    Ok(found
        .into_iter()
        .map(|(path, source)| entry(&path, source, 0o755))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_are_followed_inside_the_root() {
        let root = tempfile::tempdir().expect("a temporary directory");
        let root = root.path();
        fs::create_dir_all(root.join("lib/x86_64-linux-gnu")).expect("mkdir");
        fs::create_dir_all(root.join("lib64")).expect("mkdir");
        fs::create_dir_all(root.join("sbin")).expect("mkdir");
        fs::write(root.join("lib/x86_64-linux-gnu/ld.so.2"), "loader").expect("write");
        // Absolute: the root's /lib, never this machine's.
        std::os::unix::fs::symlink("/lib/x86_64-linux-gnu/ld.so.2", root.join("lib64/ld.so.2"))
            .expect("symlink");
        std::os::unix::fs::symlink("../lib64/./ld.so.2", root.join("sbin/relative"))
            .expect("symlink");
        std::os::unix::fs::symlink("/etc/passwd", root.join("sbin/outside")).expect("symlink");
        std::os::unix::fs::symlink("loop", root.join("sbin/loop")).expect("symlink");
        let loader = root.join("lib/x86_64-linux-gnu/ld.so.2");
        assert_eq!(resolve(root, "lib64/ld.so.2"), Some(loader.clone()));
        assert_eq!(resolve(root, "/sbin/relative"), Some(loader));
        assert_eq!(
            resolve(root, "sbin/outside"),
            None,
            "/etc/passwd is the host's"
        );
        assert_eq!(resolve(root, "sbin/loop"), None);
        assert_eq!(resolve(root, "lib"), None, "a directory");
    }
}
