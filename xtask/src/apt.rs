//! Debian packages fetched for another system than this one: the VMs' kernels and the
//! userland (`ip`, the iptables family, glibc) of the image and the VMs, for either
//! architecture. Each (Debian release, architecture) has a private apt state under
//! `target/debian/` (its own source list, package lists, cache and an empty dpkg status,
//! passed to apt with `-o`), so the machine's apt configuration and its own architecture are
//! never touched. Packages are fetched with `apt-get download`, checked against the SHA-256 of
//! apt's (signed) index, cached copies too, and unpacked with `dpkg-deb -x`: never installed,
//! nothing of theirs runs on this host.
use std::{
    cell::Cell,
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, SystemTime},
};

use anyhow::{Context as _, ensure};

use crate::{arch::Arch, cmd};

/// The release the userland comes from: the image's and the VMs' `ip` and iptables, and the
/// glibc the binaries are linked against (this machine's Debian 12, and its cross compiler's).
pub const USERLAND_RELEASE: &str = "bookworm";

/// Package lists older than this are fetched again before they are used: a superseded
/// security update leaves the mirror, and the old list would name what is gone.
const LISTS_FRESH_FOR: Duration = Duration::from_secs(24 * 3600);

/// Where everything fetched from Debian is kept between runs.
pub fn cache_dir() -> PathBuf {
    cmd::target_dir().join("debian")
}

/// apt for one Debian release and architecture, through its private state.
pub struct Apt {
    release: &'static str,
    arch: Arch,
    root: PathBuf,
    options: Vec<String>,
    /// Whether this run updated the lists already: once is enough.
    updated: Cell<bool>,
}

impl Apt {
    /// The private state of `release` for `arch`, made on first use.
    pub fn new(release: &'static str, arch: Arch) -> anyhow::Result<Self> {
        let root = cache_dir().join(format!("apt-{release}-{arch}"));
        for dir in ["lists/partial", "cache/archives/partial", "sources.list.d"] {
            fs::create_dir_all(root.join(dir))?;
        }
        let sources = root.join("sources.list");
        fs::write(
            &sources,
            format!(
                "deb http://deb.debian.org/debian {release} main\n\
                 deb http://deb.debian.org/debian {release}-updates main\n\
                 deb http://deb.debian.org/debian-security {release}-security main\n"
            ),
        )?;
        // No package is installed in this state: apt must not read this machine's.
        let status = root.join("status");
        if !status.exists() {
            fs::write(&status, "")?;
        }
        let path = |p: PathBuf| p.display().to_string();
        let options = [
            ("APT::Architecture", arch.name().to_owned()),
            ("APT::Architectures", arch.name().to_owned()),
            ("Dir::Etc::SourceList", path(sources)),
            ("Dir::Etc::SourceParts", path(root.join("sources.list.d"))),
            ("Dir::State::Lists", path(root.join("lists"))),
            ("Dir::State::status", path(status)),
            ("Dir::Cache", path(root.join("cache"))),
            // Downloads go into the target directory, which apt's own user may not reach.
            ("APT::Sandbox::User", "root".to_owned()),
        ]
        .into_iter()
        .flat_map(|(key, value)| ["-o".to_owned(), format!("{key}={value}")])
        .collect();
        Ok(Self {
            release,
            arch,
            root,
            options,
            updated: Cell::new(false),
        })
    }

    fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        cmd.args(&self.options);
        cmd
    }

    /// `apt-get update` of this state.
    fn update(&self) -> anyhow::Result<()> {
        self.updated.set(true);
        eprintln!(
            "debian: apt-get update ({} {})",
            self.release,
            self.arch.name()
        );
        let status = self
            .command("apt-get")
            .args(["update", "-qq"])
            .status()
            .context("running apt-get update")?;
        ensure!(
            status.success(),
            "apt-get update ({} {}) failed: this needs Debian's mirrors",
            self.release,
            self.arch.name()
        );
        Ok(())
    }

    /// Updates the package lists when they are missing or older than [`LISTS_FRESH_FOR`].
    fn fresh(&self) -> anyhow::Result<()> {
        let newest = fs::read_dir(self.root.join("lists"))?
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().contains("_Packages"))
            .filter_map(|e| e.metadata().ok()?.modified().ok())
            .max();
        let stale = newest.is_none_or(|at| {
            SystemTime::now()
                .duration_since(at)
                .is_ok_and(|age| age > LISTS_FRESH_FOR)
        });
        if stale { self.update() } else { Ok(()) }
    }

    /// The packages whose names match the regular expression `pattern`, by name.
    pub fn search(&self, pattern: &str) -> anyhow::Result<Vec<String>> {
        self.fresh()?;
        let out = self
            .command("apt-cache")
            .args(["search", "--names-only", pattern])
            .output()
            .context("running apt-cache (is this Debian?)")?;
        ensure!(out.status.success(), "apt-cache search {pattern} failed");
        Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .map(str::to_owned)
            .collect())
    }

    /// The SHA-256 apt's (signed) package index gives for the candidate of each of `packages`.
    fn expected_sha256(&self, packages: &[&str]) -> anyhow::Result<BTreeMap<String, String>> {
        let out = self
            .command("apt-cache")
            .args(["show", "--no-all-versions"])
            .args(packages)
            .output()
            .context("running apt-cache show")?;
        ensure!(
            out.status.success(),
            "apt-cache show {} ({} {}) failed",
            packages.join(" "),
            self.release,
            self.arch.name()
        );
        let text = String::from_utf8_lossy(&out.stdout);
        let mut sums = BTreeMap::new();
        for record in text.split("\n\n") {
            let field = |name: &str| {
                record
                    .lines()
                    .find_map(|l| l.strip_prefix(name))
                    .map(|v| v.trim().to_owned())
            };
            if let (Some(package), Some(sum)) = (field("Package:"), field("SHA256:")) {
                sums.insert(package, sum);
            }
        }
        for package in packages {
            ensure!(
                sums.contains_key(*package),
                "apt-cache show {package}: no SHA256"
            );
        }
        Ok(sums)
    }

    /// The verified `.deb` of `package` ([`Self::debs`]).
    pub fn deb(&self, package: &str) -> anyhow::Result<PathBuf> {
        Ok(self.debs(&[package])?.remove(0))
    }

    /// The verified `.deb`s of `packages`, in their order, downloaded unless a copy matching
    /// apt's SHA-256 is cached. A download the mirror refuses is tried once more after an
    /// `apt-get update` (the list named a version the mirror no longer holds), unless this run
    /// updated the lists already.
    pub fn debs(&self, packages: &[&str]) -> anyhow::Result<Vec<PathBuf>> {
        self.fresh()?;
        match self.download(packages) {
            Ok(debs) => Ok(debs),
            Err(err) if !self.updated.get() => {
                eprintln!("debian: {err:#}; updating the package lists and trying again");
                self.update()?;
                self.download(packages)
            }
            Err(err) => Err(err),
        }
    }

    fn download(&self, packages: &[&str]) -> anyhow::Result<Vec<PathBuf>> {
        let dir = cache_dir().join("debs");
        fs::create_dir_all(&dir)?;
        let want = self.expected_sha256(packages)?;
        let arch_suffix = [format!("_{}.deb", self.arch.name()), "_all.deb".to_owned()];
        // The cached copy of `package` that matches apt's SHA-256.
        let cached = |package: &str| -> anyhow::Result<Option<PathBuf>> {
            let prefix = format!("{package}_");
            for entry in fs::read_dir(&dir)? {
                let path = entry?.path();
                let name = path
                    .file_name()
                    .and_then(|n| n.to_str())
                    .unwrap_or_default();
                if name.starts_with(&prefix)
                    && arch_suffix.iter().any(|s| name.ends_with(s))
                    && sha256(&path)? == want[package]
                {
                    return Ok(Some(path));
                }
            }
            Ok(None)
        };
        let mut missing = Vec::new();
        for package in packages {
            if cached(package)?.is_none() {
                missing.push(*package);
            }
        }
        if !missing.is_empty() {
            eprintln!(
                "debian: apt-get download {} ({} {})",
                missing.join(" "),
                self.release,
                self.arch.name()
            );
            let status = self
                .command("apt-get")
                .args(["download", "-qq"])
                .args(&missing)
                .current_dir(&dir)
                .status()
                .context("running apt-get download")?;
            ensure!(
                status.success(),
                "apt-get download {} failed",
                missing.join(" ")
            );
        }
        packages
            .iter()
            .map(|package| {
                cached(package)?.with_context(|| {
                    format!(
                        "{package}: no downloaded .deb matches the SHA-256 of apt's index ({})",
                        want[*package]
                    )
                })
            })
            .collect()
    }
}

/// `debs` unpacked together (`dpkg-deb -x`, as one system's files) into `dir`, unless it is
/// there already; a partial unpacking is never taken for a whole one.
pub fn unpack(debs: &[PathBuf], dir: &Path) -> anyhow::Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    let partial = dir.with_extension("partial");
    let _ = fs::remove_dir_all(&partial);
    fs::create_dir_all(&partial)?;
    for deb in debs {
        let status = Command::new("dpkg-deb")
            .arg("-x")
            .arg(deb)
            .arg(&partial)
            .status()
            .context("running dpkg-deb")?;
        ensure!(status.success(), "dpkg-deb -x {} failed", deb.display());
    }
    fs::rename(&partial, dir).with_context(|| format!("renaming to {}", dir.display()))
}

fn sha256(path: &Path) -> anyhow::Result<String> {
    use sha2::{Digest as _, Sha256};
    let bytes = fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(format!("{:x}", Sha256::digest(bytes)))
}
