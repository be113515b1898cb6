//! Debian's cloud kernels, amd64 and arm64: found, fetched and checked through a private apt
//! state ([`crate::apt`]), unpacked with dpkg-deb. 5.10 is Debian 11's (bullseye), the others
//! Debian 12's. Debian builds veth, sch_ingress, cls_bpf and the netfilter matches as modules,
//! so the ones the tests need are resolved (with their dependencies, in load order) from the
//! package's own files.
use std::{
    collections::{BTreeMap, HashSet},
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, bail, ensure};

use crate::{
    apt::{self, Apt},
    arch::Arch,
};

/// Modules the end-to-end suites may need; those built into a kernel are simply absent.
const WANTED_MODULES: &[&str] = &[
    "veth",
    "sch_ingress",
    "cls_bpf",
    "ip_tables",
    "ip6_tables",
    "iptable_nat",
    "iptable_mangle",
    "iptable_raw",
    "ip6table_nat",
    "ip6table_mangle",
    "ip6table_raw",
    "nf_tables",
    "nft_compat",
    "nft_chain_nat",
    // iptables-nft's own expressions: modules on 5.10, folded into nf_tables later.
    "nft_counter",
    "nft_ct",
    "nft_nat",
    "nft_redir",
    "xt_REDIRECT",
    "xt_TPROXY",
    "xt_owner",
    "xt_mark",
    "xt_connmark",
    "xt_conntrack",
    "xt_multiport",
    "xt_CT",
    "xt_tcpudp",
    "nf_tproxy_ipv4",
    "nf_tproxy_ipv6",
    // Istio's native nftables rules (`tproxy ip to`): the rest are nf_tables' own or above.
    "nft_tproxy",
    // Ambient mode's probe SNAT on the node: the probe set and the rule matching it.
    "ip_set",
    "ip_set_hash_ip",
    "xt_set",
    "xt_nat",
];

/// An unpacked kernel package.
pub struct Kernel {
    /// The package's kernel release (`6.1.0-56-cloud-amd64`, `6.12.117+deb12-cloud-arm64`).
    pub release: String,
    /// The bootable image.
    pub vmlinuz: PathBuf,
    /// Module files to load, dependencies first.
    pub modules: Vec<PathBuf>,
}

/// Debian releases whose suites hold a kernel series the userland's release lacks.
const OTHER_RELEASES: &[(&str, &str)] = &[("5.10", "bullseye")];

/// The `linux-image-<series>…-cloud-<arch>-unsigned` packages apt knows, newest first.
fn packages_for(apt: &Apt, series: &str, arch: Arch) -> anyhow::Result<Vec<String>> {
    let pattern = format!("^linux-image-.*-cloud-{arch}-unsigned$");
    let mut matching: Vec<String> = apt
        .search(&pattern)?
        .into_iter()
        .filter(|name| {
            name.strip_prefix("linux-image-")
                .and_then(|rest| rest.strip_prefix(series))
                .is_some_and(|rest| rest.starts_with(['.', '-']))
        })
        .collect();
    ensure!(
        !matching.is_empty(),
        "apt knows no linux-image-{series}*-cloud-{arch}-unsigned"
    );
    matching.sort_by_key(|name| std::cmp::Reverse(version_key(name)));
    Ok(matching)
}

/// Orders `linux-image-6.1.0-9-…` before `linux-image-6.1.0-56-…` (numbers compared as numbers).
fn version_key(name: &str) -> Vec<u64> {
    name.split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap_or(0))
        .collect()
}

/// Fetches (unless cached) and unpacks the newest kernel of `series` for `arch` the mirror
/// serves. A package the index names but the mirror does not hold yet (a security update
/// still on its way to it) is passed over for the next older one, saying so.
pub fn fetch(series: &str, arch: Arch) -> anyhow::Result<Kernel> {
    let release = OTHER_RELEASES
        .iter()
        .find(|(s, _)| *s == series)
        .map_or(apt::USERLAND_RELEASE, |(_, release)| release);
    let apt = Apt::new(release, arch)?;
    let mut refused = Vec::new();
    let mut found = None;
    for package in packages_for(&apt, series, arch)? {
        match apt.deb(&package) {
            Ok(deb) => {
                found = Some((package, deb));
                break;
            }
            Err(err) => {
                eprintln!("integration: {err:#}; trying the next older {series} kernel");
                refused.push(package);
            }
        }
    }
    let (package, deb) = found.with_context(|| {
        format!(
            "no {series} {arch} cloud kernel could be fetched (tried {})",
            refused.join(", ")
        )
    })?;
    // Keyed by the .deb's name, which carries the Debian revision the package name lacks.
    let root = apt::cache_dir()
        .join("unpacked")
        .join(deb.file_stem().unwrap_or_default());
    apt::unpack(&[deb], &root)?;
    let vmlinuz = fs::read_dir(root.join("boot"))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("vmlinuz-"))
        })
        .with_context(|| format!("{package}: no boot/vmlinuz-*"))?;
    let release = vmlinuz
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("vmlinuz-"))
        .unwrap_or_default()
        .to_owned();
    let modules = resolve_modules(&root.join("lib/modules").join(&release))?;
    Ok(Kernel {
        release,
        vmlinuz,
        modules,
    })
}

/// `name → file` for every module of the tree, names normalised (`-` → `_`).
fn index_modules(dir: &Path, index: &mut BTreeMap<String, PathBuf>) -> anyhow::Result<()> {
    for entry in fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            index_modules(&path, index)?;
        } else if let Some(name) = path.file_name().and_then(|n| n.to_str()) {
            let stem = name
                .strip_suffix(".ko.xz")
                .or_else(|| name.strip_suffix(".ko"));
            if let Some(stem) = stem {
                index.insert(stem.replace('-', "_"), path.clone());
            }
        }
    }
    Ok(())
}

/// The wanted modules present in `tree` and everything they depend on, dependencies first.
fn resolve_modules(tree: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut index = BTreeMap::new();
    index_modules(&tree.join("kernel"), &mut index)?;
    let mut order = Vec::new();
    let mut seen = HashSet::new();
    for name in WANTED_MODULES {
        visit(name, &index, &mut seen, &mut order)?;
    }
    Ok(order)
}

fn visit(
    name: &str,
    index: &BTreeMap<String, PathBuf>,
    seen: &mut HashSet<String>,
    order: &mut Vec<PathBuf>,
) -> anyhow::Result<()> {
    let name = name.replace('-', "_");
    if !seen.insert(name.clone()) {
        return Ok(());
    }
    // Not a module file: built into this kernel.
    let Some(path) = index.get(&name) else {
        return Ok(());
    };
    for dep in depends(&module_bytes(path)?) {
        visit(&dep, index, seen, order)?;
    }
    order.push(path.clone());
    Ok(())
}

/// A module's ELF bytes (decompressed when it is `.ko.xz`).
pub fn module_bytes(path: &Path) -> anyhow::Result<Vec<u8>> {
    let raw = fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    if path.extension().is_some_and(|e| e == "xz") {
        let mut out = Vec::new();
        lzma_rs::xz_decompress(&mut raw.as_slice(), &mut out)
            .map_err(|e| anyhow::anyhow!("decompressing {}: {e:?}", path.display()))?;
        Ok(out)
    } else {
        Ok(raw)
    }
}

/// The `depends=` entry of a module's `.modinfo` strings.
fn depends(elf: &[u8]) -> Vec<String> {
    let needle = b"\0depends=";
    let Some(at) = elf.windows(needle.len()).position(|w| w == needle) else {
        return Vec::new();
    };
    let rest = &elf[at + needle.len()..];
    let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
    String::from_utf8_lossy(&rest[..end])
        .split(',')
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Fails unless `series` looks like `5.10` or `6.12`.
pub fn check_series(series: &str) -> anyhow::Result<()> {
    let ok = series.split('.').count() == 2 && series.split('.').all(|p| p.parse::<u32>().is_ok());
    if !ok {
        bail!("kernel series {series:?}: expected MAJOR.MINOR, e.g. 6.1");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_sort_numerically() {
        let mut names = [
            "linux-image-6.1.0-56-cloud-amd64-unsigned",
            "linux-image-6.1.0-9-cloud-amd64-unsigned",
        ];
        names.sort_by_key(|n| version_key(n));
        assert_eq!(names[1], "linux-image-6.1.0-56-cloud-amd64-unsigned");
    }

    #[test]
    fn modinfo_depends() {
        let elf = b"junk\0license=GPL\0depends=nf_tables,x_tables\0name=nft_compat\0";
        assert_eq!(depends(elf), ["nf_tables", "x_tables"]);
        assert!(depends(b"\0depends=\0").is_empty());
    }
}
