//! `cargo xtask integration`: the end-to-end tests (`tests/tests/*.rs`, whatever exists) inside
//! QEMU on Debian's cloud kernels, so older verifiers, netlink TC and TCX are all covered, and a
//! kernel below the eBPF floor (5.10) proves the iptables fallback; an arm64 guest runs the
//! arm64 build of the programs, the agent and the plugin on Debian's arm64 kernel.
//!
//! Per guest (a kernel series of one architecture): fetch its package (`apt-get download`,
//! cached), build an initramfs in Rust (newc cpio) holding a small init, the test binaries, the
//! modules they need and the tools the harness calls (`ip`, the iptables family, with their
//! shared libraries, from Debian's packages of the guest's architecture), boot it (KVM when
//! usable, else TCG) and read the init's single result line.
use std::{
    fmt, fs,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use crate::arch::Arch;

mod build;
mod chart;
mod cpio;
mod kernel;
mod qemu;
mod share;
mod stuck;

/// Guests `cargo xtask test` boots in QEMU after the host suite (`cargo xtask integration`'s
/// default), each running its share of the suite (`share.rs`): 5.10 proves the iptables
/// fallback below the eBPF floor, 6.1 the kernel paths of the oldest eBPF kernel (its verifier,
/// netlink TC, the socket hand-off before 6.5, cgroup programs without `BPF_F_BEFORE`), and
/// the arm64 guest the kernel programs through the arm64 JIT on 6.12 (TCX, a newer verifier).
pub const CI_GUESTS: &[&str] = &["5.10", "6.1", "6.12-arm64"];

/// Options of `cargo xtask integration`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Guests to boot: a Debian cloud kernel series, amd64 unless suffixed `-arm64`
    /// (`6.1`, `6.12-arm64`).
    #[arg(long = "kernel", default_values = CI_GUESTS)]
    kernels: Vec<Guest>,
    /// Where consoles, initramfs images and the last run's durations are kept between runs
    /// (the kernels themselves in target/debian/).
    #[arg(long, default_value = "target/integration")]
    cache_dir: PathBuf,
    /// Every guest runs every test the VMs can, not only its share of the suite
    /// (xtask/src/integration/share.rs); one of another architecture builds them all.
    #[arg(long)]
    whole_suite: bool,
    /// Test binaries run at once inside the VM (each with one test thread).
    #[arg(long, default_value_t = 2)]
    jobs: usize,
    /// Upper bound for one kernel's boot and test run, in seconds.
    #[arg(long, default_value_t = 1200)]
    timeout: u64,
    /// Boots of each kernel, each running the whole selection. With more than one, every boot
    /// counts (a fault is kept and reported, never booted again): the way to measure how
    /// often a guest locks up or the emulator faults, as docs/development.md describes.
    #[arg(long, default_value_t = 1)]
    boots: u32,
    /// Only the tests whose `binary::test` name contains one of these (all of them without);
    /// `*` stands for any characters (`ambient::*kernel`), and a leading `!` excludes what
    /// matches instead (`!ambient::`).
    #[arg(long = "test")]
    tests: Vec<String>,
    /// Runs no tests: checks the emulator against the kernel's patching of its own text, with
    /// no BPF loaded (docs/development.md, "Emulator faults"). `flip` flips a static key while
    /// the vCPUs run the code it patches; `still` is the control.
    #[arg(long, value_enum)]
    emulator_probe: Option<EmulatorProbe>,
    /// How long the emulator probe runs, in seconds.
    #[arg(long, default_value_t = 60)]
    probe_seconds: u64,
}

/// One guest: a kernel series of an architecture.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Guest {
    pub series: String,
    pub arch: Arch,
}

impl Guest {
    /// The name its files carry (`6.1`, `6.12-arm64`): amd64's as they were before arm64.
    fn name(&self) -> String {
        match self.arch {
            Arch::Amd64 => self.series.clone(),
            Arch::Arm64 => format!("{}-{}", self.series, self.arch),
        }
    }
}

impl std::str::FromStr for Guest {
    type Err = anyhow::Error;

    fn from_str(text: &str) -> anyhow::Result<Self> {
        let (series, arch) = match text.split_once('-') {
            None => (text, Arch::Amd64),
            Some((series, "amd64")) => (series, Arch::Amd64),
            Some((series, "arm64")) => (series, Arch::Arm64),
            Some((_, other)) => bail!("{text:?}: architecture {other:?}: expected amd64 or arm64"),
        };
        kernel::check_series(series)?;
        Ok(Self {
            series: series.to_owned(),
            arch,
        })
    }
}

impl fmt::Display for Guest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

/// What `--emulator-probe` does with the static key.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum EmulatorProbe {
    /// Flip it as fast as it goes.
    Flip,
    /// Leave it alone (the control).
    Still,
}

impl Args {
    /// The defaults of `cargo xtask integration --kernel <each of kernels>`.
    pub fn for_guests(kernels: &[&str]) -> Self {
        #[derive(clap::Parser)]
        struct Standalone {
            #[command(flatten)]
            args: Args,
        }
        let mut argv = vec!["integration"];
        for kernel in kernels {
            argv.extend(["--kernel", kernel]);
        }
        <Standalone as clap::Parser>::parse_from(argv).args
    }
}

/// Builds what a guest of `arch` runs, as `cargo xtask integration` does (CI's subset for a
/// guest of another architecture than this machine's); returns the directory holding its
/// `meshcap-agent` and `meshcap-cni`.
pub fn build_binaries(arch: Arch) -> anyhow::Result<PathBuf> {
    let binaries = build::build(arch, false)?;
    binaries
        .helpers
        .iter()
        .find(|h| h.ends_with("meshcap-agent"))
        .and_then(|agent| agent.parent())
        .map(Path::to_path_buf)
        .context("meshcap-agent was not built")
}

/// Runs the suite on every guest asked for; fails when any guest fails.
pub fn run(args: &Args) -> anyhow::Result<()> {
    let cache = crate::cmd::root().join(&args.cache_dir);
    fs::create_dir_all(&cache)?;
    let mut binaries = Vec::new();
    for guest in &args.kernels {
        if binaries.iter().any(|(arch, _)| *arch == guest.arch) {
            continue;
        }
        let started = Instant::now();
        eprintln!(
            "integration: building the {} test binaries{}",
            guest.arch,
            if Arch::host() == Some(guest.arch) {
                " (as `cargo xtask test` does)"
            } else {
                ""
            }
        );
        let built = build::build(guest.arch, args.whole_suite)?;
        eprintln!(
            "integration: {} binaries ready in {:.0}s",
            guest.arch,
            started.elapsed().as_secs_f64()
        );
        binaries.push((guest.arch, built));
    }
    let charts = chart::render(&crate::cmd::root())?;
    for (test, why) in build::HOST_ONLY {
        eprintln!("integration: not in the VMs (host only, `cargo xtask test`): {test}: {why}");
    }
    if !args.whole_suite {
        for guest in &args.kernels {
            let tests: Vec<&str> = share::Share::of(&guest.series, guest.arch)
                .tests()
                .iter()
                .map(|(t, _)| *t)
                .collect();
            eprintln!(
                "integration: {guest} runs {} (--whole-suite: every test)",
                tests.join(", ")
            );
        }
    }

    let mut failures = Vec::new();
    let mut summary = Vec::new();
    for guest in &args.kernels {
        let Some((_, binaries)) = binaries.iter().find(|(arch, _)| *arch == guest.arch) else {
            continue;
        };
        match run_kernel(guest, &cache, (binaries, &charts), args) {
            Ok(boots) => summarise(guest, &cache, &boots, args, &mut summary, &mut failures),
            Err(err) => {
                summary.push(format!("{guest}: FAILED: {err:#}"));
                failures.push(guest.to_string());
            }
        }
    }
    eprintln!("integration: per kernel:");
    for line in &summary {
        eprintln!("  {line}");
    }
    if !failures.is_empty() {
        bail!("integration failed on guest(s) {}", failures.join(", "));
    }
    Ok(())
}

/// One kernel's boots: its release and each boot's outcome (a lock-up's log kept beside).
struct Boots {
    release: String,
    outcomes: Vec<qemu::Outcome>,
}

/// Adds one guest's lines to the summary (and its name to `failures` when it failed).
fn summarise(
    guest: &Guest,
    cache: &Path,
    boots: &Boots,
    args: &Args,
    summary: &mut Vec<String>,
    failures: &mut Vec<String>,
) {
    let release = &boots.release;
    let series = guest.to_string();
    for (i, outcome) in boots.outcomes.iter().enumerate() {
        let verdict = if outcome.passed { "ok" } else { "FAILED" };
        let boot = if boots.outcomes.len() > 1 {
            format!(" boot {}", i + 1)
        } else {
            String::new()
        };
        summary.push(format!(
            "{series} ({release}){boot}: {verdict} in {:.0}s: {}",
            outcome.elapsed.as_secs_f64(),
            outcome.result,
        ));
        summary.extend(outcome.report.lines().iter().map(|l| format!("    {l}")));
    }
    if args.tests.is_empty()
        && args.emulator_probe.is_none()
        && let Some(last) = boots.outcomes.last()
    {
        let durations: String = last
            .report
            .binaries
            .iter()
            .filter_map(|(name, b)| Some(format!("{name} {}\n", b.seconds?)))
            .collect();
        let _ = fs::write(
            cache.join(format!("durations-{}.txt", guest.name())),
            durations,
        );
    }
    let locked = boots
        .outcomes
        .iter()
        .filter(|o| o.locked_up && o.emulator_fault.is_none())
        .count();
    let stale = boots
        .outcomes
        .iter()
        .filter(|o| o.emulator_fault.is_some())
        .count();
    if args.boots > 1 {
        summary.push(format!(
            "{series}: {stale} of {} boots met the emulator's stale breakpoint, {locked} other \
             locked up, {} passed",
            boots.outcomes.len(),
            boots.outcomes.iter().filter(|o| o.passed).count()
        ));
    }
    // A single boot the emulator faulted was booted once more (see `run_kernel`): the last
    // one decides. With several boots asked for, every one must pass.
    let failed = if args.boots > 1 {
        boots.outcomes.iter().any(|o| !o.passed)
    } else {
        boots.outcomes.last().is_none_or(|o| !o.passed)
    };
    if failed {
        failures.push(series);
    }
}

fn run_kernel(
    guest: &Guest,
    cache: &Path,
    (binaries, charts): (&build::Binaries, &[(String, Vec<u8>)]),
    args: &Args,
) -> anyhow::Result<Boots> {
    let (series, name) = (guest.series.as_str(), guest.name());
    let kernel = kernel::fetch(series, guest.arch)?;
    let mut archive = cpio::Archive::default();
    add_userland(&mut archive, guest.arch, binaries)?;
    for (name, rendered) in charts {
        archive.file(&format!("chart/{name}.yaml"), 0o644, rendered);
    }
    archive.file(
        "tests.list",
        0o644,
        test_order(binaries, cache, &name).as_bytes(),
    );
    let mut list = String::new();
    for (i, module) in kernel.modules.iter().enumerate() {
        let name = module
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("module")
            .trim_end_matches(".xz");
        let path = format!("modules/{i:03}-{name}");
        archive.file(&path, 0o644, &kernel::module_bytes(module)?);
        list.push_str(&path);
        list.push('\n');
    }
    archive.file("modules.list", 0o644, list.as_bytes());
    archive.file("jobs", 0o644, format!("{}\n", args.jobs).as_bytes());
    // The tests' oracle, not the agent's (which probes): see `meshcap_tests::ebpf_runs_here`.
    if !share::runs_ebpf(series) {
        archive.file("ebpf.unsupported", 0o644, b"");
    }
    let mut filter: String = args.tests.iter().map(|t| format!("{t}\n")).collect();
    if !share::runs_native_nftables(series) {
        filter.push_str("!nftables\n");
    }
    archive.file("tests.filter", 0o644, filter.as_bytes());
    // The guest's share of the suite (`share.rs`), unless every test is asked for.
    let select: String = if args.whole_suite {
        String::new()
    } else {
        share::Share::of(&guest.series, guest.arch)
            .tests()
            .iter()
            .map(|(t, _)| format!("{t}\n"))
            .collect()
    };
    archive.file("tests.select", 0o644, select.as_bytes());
    if let Some(probe) = args.emulator_probe {
        let mode = match probe {
            EmulatorProbe::Flip => "flip",
            EmulatorProbe::Still => "still",
        };
        let spec = format!("{mode} {}\n", args.probe_seconds);
        archive.file("emulator-probe", 0o644, spec.as_bytes());
    }
    archive.file(
        "kernel.txt",
        0o644,
        format!("{series} {}\n", kernel.release).as_bytes(),
    );
    let initrd = cache.join(format!("initramfs-{name}.cpio"));
    fs::write(&initrd, archive.finish())?;
    let log = cache.join(format!("console-{name}.log"));
    let label = match guest.arch {
        Arch::Amd64 => format!("linux {series}"),
        Arch::Arm64 => format!("linux {series} {}", guest.arch),
    };
    let timeout = Duration::from_secs(args.timeout);
    let mut outcomes = Vec::new();
    let mut retried = false;
    let boots = usize::try_from(args.boots.max(1))?;
    while outcomes.len() < boots + usize::from(retried) {
        let boot = outcomes.len() + 1;
        let outcome = qemu::boot(&label, guest.arch, &kernel.vmlinuz, &initrd, &log, timeout)?;
        let (locked_up, fault) = (outcome.locked_up, outcome.emulator_fault);
        let frames = outcome.bpf_frames.join(", ");
        outcomes.push(outcome);
        if let Some(fault) = fault {
            let kept = keep(
                &log,
                &format!("boot{boot}.emulator-fault.log"),
                &mut outcomes,
            )?;
            eprintln!(
                "integration: {label}: THE EMULATOR RAN A BREAKPOINT THE KERNEL HAD PATCHED \
                 AWAY on boot {boot} ({fault}; console log kept in {}): multi-threaded TCG \
                 misses the kernel's cross-modifying-code protocol, reproduced without meshcap \
                 by flipping any static key (docs/development.md, \"Emulator faults\")",
                kept.display()
            );
            // The emulator's, shown: a single boot of the suite is booted once more, loudly;
            // a second such fault fails the run.
            if args.boots == 1 && !retried && args.emulator_probe.is_none() {
                retried = true;
                eprintln!("integration: {label}: booting it once more");
            }
        } else if locked_up {
            // Not the emulator's signature: it may be meshcap's (a BPF program, map or hook
            // on a stack says where to look). It fails the run, with the stacks kept.
            let kept = keep(&log, &format!("boot{boot}.locked-up.log"), &mut outcomes)?;
            eprintln!(
                "integration: {label}: THE GUEST KERNEL LOCKED UP on boot {boot}; console log \
                 with every CPU's stack kept in {}; BPF in the stacks: {}",
                kept.display(),
                if frames.is_empty() { "none" } else { &frames }
            );
        }
    }
    Ok(Boots {
        release: kernel.release,
        outcomes,
    })
}

/// Keeps the console `log` of the last boot under the extension `kept` (the next boot writes
/// `log` again), and points that boot's result at it.
fn keep(log: &Path, kept: &str, outcomes: &mut [qemu::Outcome]) -> anyhow::Result<PathBuf> {
    let kept = log.with_extension(kept);
    fs::rename(log, &kept).with_context(|| format!("keeping {}", log.display()))?;
    if let Some(last) = outcomes.last_mut() {
        last.result = last
            .result
            .replace(&log.display().to_string(), &kept.display().to_string());
    }
    Ok(kept)
}

/// The test binaries, longest first by this guest's last run (new ones first of all), so the
/// VM's parallel jobs finish close together.
fn test_order(binaries: &build::Binaries, cache: &Path, guest: &str) -> String {
    let last = fs::read_to_string(cache.join(format!("durations-{guest}.txt"))).unwrap_or_default();
    let seconds = |name: &str| {
        last.lines()
            .filter_map(|l| l.split_once(' '))
            .find(|(n, _)| *n == name)
            .and_then(|(_, s)| s.parse::<u64>().ok())
            .unwrap_or(u64::MAX)
    };
    let mut names: Vec<&str> = binaries.tests.iter().map(|(n, _)| n.as_str()).collect();
    names.sort_by_key(|n| std::cmp::Reverse(seconds(n)));
    names.iter().map(|n| format!("{n}\n")).collect()
}

/// Everything but the kernel's modules: init, tests, helpers, the tools and their libraries.
fn add_userland(
    archive: &mut cpio::Archive,
    arch: Arch,
    binaries: &build::Binaries,
) -> anyhow::Result<()> {
    archive.char_device("dev/console", 5, 1);
    archive.file("init", 0o755, &stripped(arch, &binaries.init)?);
    for (name, exe) in &binaries.tests {
        archive.file(&format!("tests/{name}"), 0o755, &stripped(arch, exe)?);
    }
    for helper in &binaries.helpers {
        let name = helper
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        archive.file(&format!("tests/{name}"), 0o755, &stripped(arch, helper)?);
    }
    for dir in ["proc", "sys", "dev", "tmp", "run", "usr/bin", "bin", "sbin"] {
        archive.dir(dir);
    }
    archive.symlink("var/run", "../run");
    archive.file("etc/passwd", 0o644, b"root:x:0:0:root:/:/bin/sh\n");
    archive.file("etc/group", 0o644, b"root:x:0:\n");
    let mut elfs: Vec<PathBuf> = binaries.tests.iter().map(|(_, exe)| exe.clone()).collect();
    elfs.extend(binaries.helpers.iter().cloned());
    elfs.push(binaries.init.clone());
    for entry in crate::userland::entries(arch, &elfs)? {
        archive.file(&entry.path, entry.mode, &read(&entry.source)?);
    }
    Ok(())
}

fn read(path: &Path) -> anyhow::Result<Vec<u8>> {
    fs::read(path).with_context(|| format!("reading {}", path.display()))
}

/// The binary (of `arch`) without its debug info (ten times smaller: the whole initramfs sits
/// in the VM's memory). Symbols stay, so backtraces still name functions.
fn stripped(arch: Arch, path: &Path) -> anyhow::Result<Vec<u8>> {
    let out = path.with_extension("stripped");
    let status = Command::new(arch.objcopy())
        .arg("--strip-debug")
        .arg(path)
        .arg(&out)
        .status()
        .with_context(|| format!("running {} (binutils)", arch.objcopy()))?;
    anyhow::ensure!(
        status.success(),
        "objcopy --strip-debug {} failed",
        path.display()
    );
    let bytes = read(&out)?;
    let _ = fs::remove_file(&out);
    Ok(bytes)
}
