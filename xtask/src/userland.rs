//! The host userland meshcap needs beside its own binaries: the tools the agent and the test
//! harness run (`ip`, the iptables family, legacy and nft), the files they read, the iptables
//! extensions they load and every shared library all of these (and any extra executables) link.
//! One list, used by the VM's initramfs (`integration`) and by the container image (`image`).
use std::{
    collections::BTreeSet,
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::Context as _;

/// Host tools the harness and the iptables backend run, copied with their libraries.
const HOST_TOOLS: &[&str] = &[
    "ip",
    // The tests inspect and set up netlink TC attachments with it (`ip netns exec NS tc`).
    "tc",
    "iptables",
    "iptables-save",
    "iptables-restore",
    "ip6tables",
    "ip6tables-save",
    "ip6tables-restore",
    "iptables-legacy",
    "iptables-legacy-save",
    "iptables-legacy-restore",
    "ip6tables-legacy",
    "ip6tables-legacy-save",
    "ip6tables-legacy-restore",
    "iptables-nft",
    "iptables-nft-save",
    "iptables-nft-restore",
    "ip6tables-nft",
    "ip6tables-nft-save",
    "ip6tables-nft-restore",
];

/// Plain data files those tools read; the CA bundle is what rustls (kube-rs) insists on
/// loading even for the tests' plain-HTTP API server.
const HOST_FILES: &[&str] = &[
    "/etc/protocols",
    "/etc/services",
    "/etc/ssl/certs/ca-certificates.crt",
];

/// The iptables extensions (`libxt_owner.so`, ...), loaded at run time.
const XTABLES_DIR: &str = "/usr/lib/x86_64-linux-gnu/xtables";

/// Where the tools go in the tree (on `PATH`).
pub const TOOLS_DIR: &str = "usr/sbin";

/// One file of the userland: where it goes (relative to the root of the tree), where it comes
/// from on this host, and its permission bits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub path: String,
    pub source: PathBuf,
    pub mode: u32,
}

/// The userland, in this order: data files, tools, iptables extensions, then the shared
/// libraries (ELF interpreter included) of the tools, the extensions and `also_link_for`.
/// Tools and files the host lacks are left out; a library `ldd` names must exist.
pub fn entries(also_link_for: &[PathBuf]) -> anyhow::Result<Vec<Entry>> {
    let mut entries = Vec::new();
    for file in HOST_FILES {
        if Path::new(file).is_file() {
            entries.push(entry(file, PathBuf::from(file), 0o644));
        }
    }
    let mut elfs = also_link_for.to_vec();
    for tool in HOST_TOOLS {
        if let Some(path) = which(tool) {
            entries.push(entry(&format!("{TOOLS_DIR}/{tool}"), path.clone(), 0o755));
            elfs.push(path);
        }
    }
    if let Ok(dir) = fs::read_dir(XTABLES_DIR) {
        let mut extensions: Vec<PathBuf> = dir.filter_map(Result::ok).map(|e| e.path()).collect();
        extensions.sort();
        for path in extensions {
            entries.push(entry(&path.to_string_lossy(), path.clone(), 0o644));
            elfs.push(path);
        }
    }
    let mut libraries = BTreeSet::new();
    for elf in &elfs {
        libraries.extend(shared_libraries(elf)?);
    }
    for library in libraries {
        entries.push(entry(&library, PathBuf::from(&library), 0o755));
    }
    Ok(entries)
}

fn entry(path: &str, source: PathBuf, mode: u32) -> Entry {
    Entry {
        path: path.trim_matches('/').to_owned(),
        source,
        mode,
    }
}

fn which(tool: &str) -> Option<PathBuf> {
    ["/usr/sbin", "/usr/bin", "/sbin", "/bin"]
        .iter()
        .map(|dir| Path::new(dir).join(tool))
        .find(|p| p.is_file())
}

/// The shared libraries (and the ELF interpreter) `elf` loads, as `ldd` resolves them.
fn shared_libraries(elf: &Path) -> anyhow::Result<Vec<String>> {
    let out = Command::new("ldd")
        .arg(elf)
        .output()
        .context("running ldd")?;
    // Static or not an ELF: nothing to add.
    if !out.status.success() {
        return Ok(Vec::new());
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| {
            let line = line.trim();
            let path = match line.split_once("=>") {
                Some((_, right)) => right.split_whitespace().next()?,
                None => line.split_whitespace().next()?,
            };
            path.starts_with('/').then(|| path.to_owned())
        })
        .collect())
}
