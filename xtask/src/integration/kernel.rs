//! Debian's cloud kernels: found with apt-cache, fetched with `apt-get download` into the cache
//! dir, unpacked with dpkg-deb. A series this machine's release does not ship (5.10, Debian 11's)
//! comes from that release's suites through a private apt state under the cache dir: its own
//! sources, package lists and cache, so the machine's apt configuration is never touched. Debian builds veth, sch_ingress, cls_bpf and the netfilter
//! matches as modules, so the ones the tests need are resolved (with their dependencies, in
//! load order) from the package's own files.
use std::{
    collections::{BTreeMap, HashSet},
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail, ensure};

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
    // Ambient mode's probe SNAT on the node: the probe set and the rule matching it.
    "ip_set",
    "ip_set_hash_ip",
    "xt_set",
    "xt_nat",
];

/// An unpacked kernel package.
pub struct Kernel {
    /// The package's kernel release (`6.1.0-56-cloud-amd64`).
    pub release: String,
    /// The bootable image.
    pub vmlinuz: PathBuf,
    /// Module files to load, dependencies first.
    pub modules: Vec<PathBuf>,
}

/// Debian releases whose suites hold a kernel series this machine's own release lacks.
const OTHER_RELEASES: &[(&str, &str)] = &[("5.10", "bullseye")];

/// How apt is asked about one series: the machine's own configuration, or a private one for a
/// series of another Debian release.
struct Apt {
    /// `-o` options pointing apt at the private state, empty for the machine's own.
    options: Vec<String>,
}

impl Apt {
    fn for_series(series: &str, cache: &Path) -> anyhow::Result<Self> {
        let Some((_, release)) = OTHER_RELEASES.iter().find(|(s, _)| *s == series) else {
            return Ok(Self {
                options: Vec::new(),
            });
        };
        let root = cache.join(format!("apt-{release}"));
        for dir in ["lists/partial", "cache/archives/partial"] {
            fs::create_dir_all(root.join(dir))?;
        }
        let sources = root.join("sources.list");
        fs::write(
            &sources,
            format!(
                "deb http://deb.debian.org/debian {release} main\n\
                 deb http://deb.debian.org/debian-security {release}-security main\n"
            ),
        )?;
        let path = |p: PathBuf| p.display().to_string();
        let options = [
            ("Dir::Etc::SourceList", path(sources)),
            ("Dir::Etc::SourceParts", path(root.join("sources.list.d"))),
            ("Dir::State::Lists", path(root.join("lists"))),
            ("Dir::Cache", path(root.join("cache"))),
        ]
        .into_iter()
        .flat_map(|(key, value)| ["-o".to_owned(), format!("{key}={value}")])
        .collect();
        Ok(Self { options })
    }

    fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        cmd.args(&self.options);
        cmd
    }

    /// The `linux-image-<series>…-cloud-amd64-unsigned` packages apt knows, newest first;
    /// package lists that are missing or stale get one `apt-get update` first.
    fn packages_for(&self, series: &str) -> anyhow::Result<Vec<String>> {
        let packages = self.packages(series)?;
        if !packages.is_empty() {
            return Ok(packages);
        }
        eprintln!("integration: apt knows no {series} cloud kernel; apt-get update");
        let status = self
            .command("apt-get")
            .args(["update", "-qq"])
            .status()
            .context("running apt-get update")?;
        ensure!(status.success(), "apt-get update failed");
        let packages = self.packages(series)?;
        ensure!(
            !packages.is_empty(),
            "apt knows no linux-image-{series}*-cloud-amd64-unsigned, even after apt-get update"
        );
        Ok(packages)
    }

    fn packages(&self, series: &str) -> anyhow::Result<Vec<String>> {
        let out = self
            .command("apt-cache")
            .args([
                "search",
                "--names-only",
                "^linux-image-.*-cloud-amd64-unsigned$",
            ])
            .output()
            .context("running apt-cache (is this Debian?)")?;
        ensure!(out.status.success(), "apt-cache search failed");
        let text = String::from_utf8_lossy(&out.stdout);
        let mut matching: Vec<String> = text
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .filter(|name| {
                name.strip_prefix("linux-image-")
                    .and_then(|rest| rest.strip_prefix(series))
                    .is_some_and(|rest| rest.starts_with(['.', '-']))
            })
            .map(str::to_owned)
            .collect();
        matching.sort_by_key(|name| std::cmp::Reverse(version_key(name)));
        Ok(matching)
    }

    /// The SHA-256 apt's (signed) package index gives for `package`.
    fn expected_sha256(&self, package: &str) -> anyhow::Result<String> {
        let out = self
            .command("apt-cache")
            .args(["show", "--no-all-versions", package])
            .output()
            .context("running apt-cache show")?;
        ensure!(out.status.success(), "apt-cache show {package} failed");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .find_map(|l| l.strip_prefix("SHA256:"))
            .map(|h| h.trim().to_owned())
            .with_context(|| format!("apt-cache show {package}: no SHA256"))
    }
}

fn sha256(path: &Path) -> anyhow::Result<String> {
    let out = Command::new("sha256sum")
        .arg(path)
        .output()
        .context("running sha256sum")?;
    ensure!(out.status.success(), "sha256sum {} failed", path.display());
    Ok(String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_owned())
}

/// Orders `linux-image-6.1.0-9-…` before `linux-image-6.1.0-56-…` (numbers compared as numbers).
fn version_key(name: &str) -> Vec<u64> {
    name.split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap_or(0))
        .collect()
}

/// The verified `.deb` of `package` in `debs`, downloaded unless a copy matching apt's
/// SHA-256 is there.
fn deb_of(apt: &Apt, package: &str, debs: &Path) -> anyhow::Result<PathBuf> {
    let prefix = format!("{package}_");
    let cached = |dir: &Path| -> anyhow::Result<Option<PathBuf>> {
        Ok(fs::read_dir(dir)?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .find(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".deb"))
            }))
    };
    let want = apt.expected_sha256(package)?;
    if let Some(deb) = cached(debs)? {
        if sha256(&deb)? == want {
            return Ok(deb);
        }
        eprintln!(
            "integration: {} does not match apt's SHA-256; fetching it again",
            deb.display()
        );
        fs::remove_file(&deb)?;
    }
    eprintln!("integration: apt-get download {package}");
    let status = apt
        .command("apt-get")
        .args(["download", package])
        .current_dir(debs)
        .status()
        .context("running apt-get download")?;
    ensure!(status.success(), "apt-get download {package} failed");
    let deb = cached(debs)?.with_context(|| format!("{package}: downloaded .deb not found"))?;
    ensure!(
        sha256(&deb)? == want,
        "{}: SHA-256 differs from apt's index ({want})",
        deb.display()
    );
    Ok(deb)
}

/// Fetches (unless cached) and unpacks the newest kernel of `series` the mirror serves. A
/// package the index names but the mirror does not hold yet (a security update still on its
/// way to it) is passed over for the next older one, saying so.
pub fn fetch(series: &str, cache: &Path) -> anyhow::Result<Kernel> {
    let debs = cache.join("debs");
    fs::create_dir_all(&debs)?;
    let apt = Apt::for_series(series, cache)?;
    let mut refused = Vec::new();
    let mut found = None;
    for package in apt.packages_for(series)? {
        match deb_of(&apt, &package, &debs) {
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
            "no {series} cloud kernel could be fetched (tried {})",
            refused.join(", ")
        )
    })?;
    // Keyed by the .deb's name, which carries the Debian revision the package name lacks.
    let stem = deb.file_stem().unwrap_or_default();
    let root = cache.join("unpacked").join(stem);
    if !root.join("boot").is_dir() {
        let tmp = root.with_extension("tmp");
        let _ = fs::remove_dir_all(&tmp);
        fs::create_dir_all(&tmp)?;
        let status = Command::new("dpkg-deb")
            .arg("-x")
            .arg(&deb)
            .arg(&tmp)
            .status()
            .context("running dpkg-deb")?;
        ensure!(status.success(), "dpkg-deb -x {} failed", deb.display());
        let _ = fs::remove_dir_all(&root);
        fs::rename(&tmp, &root)?;
    }
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
