//! Booting a kernel with the initramfs and reading the outcome off its serial console.
use std::{
    fs::{self, File},
    io::{BufRead as _, BufReader, Write as _},
    path::Path,
    process::{Command, Stdio},
    sync::{
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::Context as _;

use super::stuck;
use crate::arch::Arch;

/// The line the VM's init prints last.
pub const RESULT_PREFIX: &str = "meshcap-vm: result:";

/// Whether KVM can be used: /dev/kvm opens read-write.
pub fn kvm_usable() -> bool {
    fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok()
}

/// How one boot went.
pub struct Outcome {
    /// The init's result line (`N passed, M failed`).
    pub result: String,
    /// Whether every test binary passed.
    pub passed: bool,
    /// Wall time from start to power-off.
    pub elapsed: Duration,
    /// Per test binary, what the console said.
    pub report: Report,
    /// The guest kernel reported a soft lockup, or its vCPUs were seen with interrupts off
    /// for [`stuck::STUCK_FOR`] ([`stuck`]); it was stopped.
    pub locked_up: bool,
    /// After a soft lockup: the BPF functions in the stacks the guest printed (every CPU's,
    /// `softlockup_all_cpu_backtrace`), JIT-ed programs included; empty when none ran there.
    pub bpf_frames: Vec<String>,
    /// The emulator's own fault, shown without meshcap (docs/development.md, "Emulator
    /// faults"): multi-threaded TCG runs an `int3` the kernel has already patched away (a
    /// static key's `text_poke_bp`), which a CPU cannot do. What the guest showed of it. An
    /// x86 guest's only: an arm64 kernel patches a static key's site with one instruction,
    /// which other CPUs may run old or new, and no breakpoint.
    pub emulator_fault: Option<&'static str>,
}

/// Whether the `Code:` line the kernel prints after `Oops: int3` shows the trap site holding
/// something other than `int3` (`cc`): the trap reports the address after the breakpoint, the
/// byte marked `<..>`, so the site is the byte before it. `None` when the line has no marked
/// byte or none before it.
fn breakpoint_gone(code_line: &str) -> Option<bool> {
    let (_, bytes) = code_line.split_once("Code: ")?;
    let bytes: Vec<&str> = bytes.split_whitespace().collect();
    let at = bytes.iter().position(|b| b.starts_with('<'))?;
    let site = bytes.get(at.checked_sub(1)?)?;
    Some(!site.eq_ignore_ascii_case("cc"))
}

/// The functions of a stack trace line that belong to BPF: JIT-ed programs (`bpf_prog_<tag>_
/// <name>`), the BPF core, helpers and maps (`bpf_lru_*`, `htab_*`), cgroup and TC hooks
/// (`__cgroup_bpf_run_*`, `cls_bpf_classify`, `tcx_*`).
fn bpf_frames(line: &str) -> impl Iterator<Item = &str> {
    line.split_whitespace()
        .filter_map(|token| token.split_once('+').map(|(name, _)| name))
        .filter(|name| {
            name.contains("bpf") || name.starts_with("htab_") || name.starts_with("tcx_")
        })
}

/// Whether a stack trace line is in the kernel's `int3` handling.
fn in_int3_handling(line: &str) -> bool {
    line.split_whitespace()
        .filter_map(|token| token.split_once('+').map(|(name, _)| name))
        // `RIP: 0010:asm_exc_int3+0x0/0x40`: the segment goes.
        .filter_map(|name| name.rsplit(':').next())
        .any(|name| matches!(name, "exc_int3" | "asm_exc_int3" | "poke_int3_handler"))
}

/// What one test binary did, read off the console (the init prefixes its lines `name| `).
#[derive(Default)]
pub struct Binary {
    /// The init's verdict (`ok in 6s`, `FAILED (exit code 101) in 30s`); `None` while running.
    pub verdict: Option<String>,
    /// Tests that passed.
    pub passed: usize,
    /// Names of the tests that failed.
    pub failed: Vec<String>,
    /// Seconds the binary ran, from the init's verdict.
    pub seconds: Option<u64>,
    /// Tests that found the eBPF backend unsupported on this kernel (as the runner expected)
    /// and so only checked that its programs are refused (`meshcap_tests::ebpf_runs_here`).
    pub ebpf_refused: usize,
}

/// What `meshcap_tests::ebpf_runs_here` prints where the eBPF backend cannot run.
const EBPF_REFUSED: &str = "meshcap-tests: eBPF backend unsupported here";

/// Every test binary of one boot, in start order.
#[derive(Default)]
pub struct Report {
    pub binaries: Vec<(String, Binary)>,
}

impl Report {
    fn binary(&mut self, name: &str) -> &mut Binary {
        let at = match self.binaries.iter().position(|(n, _)| n == name) {
            Some(at) => at,
            None => {
                self.binaries.push((name.to_owned(), Binary::default()));
                self.binaries.len() - 1
            }
        };
        &mut self.binaries[at].1
    }

    fn line(&mut self, line: &str) {
        if let Some(name) = line.strip_prefix("meshcap-vm: running ") {
            self.binary(name.trim());
        } else if let Some(rest) = line.strip_prefix("meshcap-vm: done ") {
            if let Some((name, verdict)) = rest.split_once(": ") {
                let binary = self.binary(name);
                binary.seconds = verdict
                    .rsplit_once(" in ")
                    .and_then(|(_, t)| t.strip_suffix('s')?.parse().ok());
                binary.verdict = Some(verdict.to_owned());
            }
        } else if let Some((name, out)) = line.split_once("| ") {
            if out.starts_with(EBPF_REFUSED) {
                self.binary(name).ebpf_refused += 1;
            }
            let Some(test) = out.strip_prefix("test ") else {
                return;
            };
            if test.ends_with(" ... ok") {
                self.binary(name).passed += 1;
            } else if let Some(test) = test.strip_suffix(" ... FAILED") {
                self.binary(name).failed.push(test.to_owned());
            }
        }
    }

    /// Binaries that started and never finished (the VM died or timed out under them).
    pub fn unfinished(&self) -> Vec<&str> {
        self.binaries
            .iter()
            .filter(|(_, b)| b.verdict.is_none())
            .map(|(n, _)| n.as_str())
            .collect()
    }

    /// One line per binary: verdict, test counts, failed tests by name.
    pub fn lines(&self) -> Vec<String> {
        self.binaries
            .iter()
            .map(|(name, b)| {
                let verdict = b.verdict.as_deref().unwrap_or("did not finish");
                let mut line = format!(
                    "{name}: {verdict}: {} passed, {} failed",
                    b.passed,
                    b.failed.len()
                );
                if !b.failed.is_empty() {
                    line.push_str(&format!(" ({})", b.failed.join(", ")));
                }
                if b.ebpf_refused > 0 {
                    line.push_str(&format!(
                        "; {} found the eBPF backend unsupported and checked it is refused",
                        b.ebpf_refused
                    ));
                }
                line
            })
            .collect()
    }
}

/// The init's first line: the VM is alive.
const ALIVE: &str = "meshcap-vm: init started";

/// Without a sign of life in this time, a KVM boot is taken as stuck (nested KVM on some hosts
/// accepts the VM and never runs it) and the VM is booted again under TCG.
const KVM_ALIVE_WITHIN: Duration = Duration::from_secs(30);

/// After the guest reports a soft lockup, how long its console is still read (its stack traces
/// and RCU stall reports) before the VM is stopped: it does not recover.
const LOCKUP_GRACE: Duration = Duration::from_secs(20);

/// Set once a KVM boot showed no sign of life: later kernels go straight to TCG.
static KVM_STUCK: AtomicBool = AtomicBool::new(false);

/// Boots `vmlinuz` (of `arch`) with `initrd`, mirrors the console to stdout (prefixed) and
/// `log`, and returns the init's verdict. Fails on a kernel panic, a missing verdict or
/// `timeout`.
pub fn boot(
    label: &str,
    arch: Arch,
    vmlinuz: &Path,
    initrd: &Path,
    log: &Path,
    timeout: Duration,
) -> anyhow::Result<Outcome> {
    let vm = Vm {
        label,
        arch,
        vmlinuz,
        initrd,
        log,
        timeout,
    };
    if Arch::host() == Some(arch) && kvm_usable() && !KVM_STUCK.load(Ordering::Relaxed) {
        match boot_once(&vm, true)? {
            Some(outcome) => return Ok(outcome),
            None => {
                KVM_STUCK.store(true, Ordering::Relaxed);
                eprintln!(
                    "integration: {label}: KVM failed or showed no sign of life within \
                     {KVM_ALIVE_WITHIN:?}; booting again under TCG, and the next kernels too"
                );
            }
        }
    }
    boot_once(&vm, false)?.with_context(|| format!("{label}: the VM never started its init"))
}

/// What one boot runs.
struct Vm<'a> {
    label: &'a str,
    arch: Arch,
    vmlinuz: &'a Path,
    initrd: &'a Path,
    log: &'a Path,
    timeout: Duration,
}

impl Vm<'_> {
    /// The QEMU command line, bar the monitor.
    ///
    /// Both: panic=-1 reboots at once on a panic, which -no-reboot turns into QEMU exiting.
    /// mitigations=off: under emulation, page-table isolation's address-space switch on every
    /// syscall flushes QEMU's software TLB; the tests make many syscalls and guard no secrets.
    /// softlockup_all_cpu_backtrace: a soft lockup prints every CPU's stack, not only the
    /// stuck one's, so whatever holds what the stuck CPU waits for is in the log too.
    fn command(&self, kvm: bool) -> Command {
        const APPEND: &str = "panic=-1 oops=panic rdinit=/init loglevel=5 mitigations=off \
                              softlockup_all_cpu_backtrace=1";
        let mut cmd;
        match self.arch {
            Arch::Amd64 => {
                cmd = Command::new("qemu-system-x86_64");
                if kvm {
                    cmd.args(["-accel", "kvm", "-cpu", "host"]);
                } else {
                    // One host thread per vCPU (MTTCG), so both vCPUs run at once.
                    cmd.args(["-accel", "tcg,thread=multi", "-cpu", "max"]);
                }
                cmd.arg("-append")
                    .arg(format!("console=ttyS0 noapic {APPEND}"));
            }
            Arch::Arm64 => {
                cmd = Command::new("qemu-system-aarch64");
                // QEMU's generic board; `max` with its own pointer-authentication algorithm,
                // which it emulates far faster than the architected one (the kernel uses
                // pointer authentication on every function return where the CPU has it).
                cmd.args(["-machine", "virt"]);
                if kvm {
                    cmd.args(["-accel", "kvm", "-cpu", "host"]);
                } else {
                    cmd.args(["-accel", "tcg,thread=multi", "-cpu", "max,pauth-impdef=on"]);
                }
                cmd.arg("-append").arg(format!("console=ttyAMA0 {APPEND}"));
            }
        }
        cmd.args([
            "-m",
            "2048",
            "-smp",
            "2",
            "-nographic",
            "-no-reboot",
            "-nodefaults",
        ])
        .args(["-serial", "stdio"])
        .arg("-kernel")
        .arg(self.vmlinuz)
        .arg("-initrd")
        .arg(self.initrd);
        cmd
    }
}

/// Sends every line `from` yields, tagged `stderr`, until it ends.
fn forward(
    from: Box<dyn std::io::Read + Send>,
    stderr: bool,
    tx: mpsc::Sender<(bool, String)>,
) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        for line in BufReader::new(from).lines() {
            let Ok(line) = line else { break };
            if tx.send((stderr, line)).is_err() {
                break;
            }
        }
    })
}

/// One boot; `None` when a KVM boot failed or showed no sign of life.
fn boot_once(vm: &Vm<'_>, kvm: bool) -> anyhow::Result<Option<Outcome>> {
    let &Vm {
        label,
        arch,
        log,
        timeout,
        ..
    } = vm;
    // The emulator's known fault is an x86 guest's (see `Outcome::emulator_fault`).
    let x86 = arch == Arch::Amd64;
    let monitor_path = log.with_extension("monitor");
    let _ = fs::remove_file(&monitor_path);
    let monitor = stuck::Monitor::at(&monitor_path, arch);
    let mut cmd = vm.command(kvm);
    cmd.arg("-monitor")
        .arg(format!("unix:{},server,nowait", monitor_path.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    eprintln!(
        "integration: booting {label} ({})",
        if kvm { "KVM" } else { "TCG emulation" }
    );
    let started = Instant::now();
    let mut child = cmd.spawn().with_context(|| {
        format!(
            "starting {} (cargo xtask setup installs it)",
            cmd.get_program().to_string_lossy()
        )
    })?;
    let stdout = child.stdout.take().context("qemu's stdout")?;
    let stderr = child.stderr.take().context("qemu's stderr")?;
    // (from QEMU's stderr, line): the console is stdout.
    let (tx, rx) = mpsc::channel::<(bool, String)>();
    let readers = [
        forward(Box::new(stdout), false, tx.clone()),
        forward(Box::new(stderr), true, tx),
    ];
    let mut log_file = File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let (mut result, mut panicked, mut alive, mut kvm_failed) = (None, false, false, false);
    let mut locked_up_at = None;
    let (mut int3_oops, mut stale_breakpoint, mut int3_in_stacks) = (false, false, false);
    let (mut int3_path, mut stuck, mut hard_lockup) =
        (stuck::Int3Path::default(), stuck::Stuck::default(), None);
    let (mut last_line, mut next_sample) = (started, started);
    let mut frames = Vec::new();
    let mut report = Report::default();
    let deadline = started + timeout;
    let alive_deadline = started + if kvm { KVM_ALIVE_WITHIN } else { timeout };
    let timed_out = loop {
        let until = match (alive, locked_up_at) {
            (_, Some(at)) => deadline.min(at + LOCKUP_GRACE),
            (true, None) => deadline,
            (false, None) => alive_deadline.min(deadline),
        };
        // A quiet console is sampled through the monitor (see `stuck`).
        let wake = if alive && locked_up_at.is_none() {
            until.min((last_line + stuck::SAMPLE_EVERY).max(next_sample))
        } else {
            until
        };
        match rx.recv_timeout(wake.saturating_duration_since(Instant::now())) {
            Ok((true, line)) => {
                eprintln!("[{label} qemu] {line}");
                writeln!(log_file, "qemu: {line}")?;
                // Nested KVM on some hosts: QEMU stops the VM and waits; no use waiting too.
                if kvm && line.contains("KVM internal error") {
                    kvm_failed = true;
                    break true;
                }
            }
            Ok((false, line)) => {
                let line = line.trim_end_matches('\r').to_owned();
                println!("[{label}] {line}");
                writeln!(log_file, "{line}")?;
                (last_line, stuck) = (Instant::now(), stuck::Stuck::default());
                if let Some(path) = stuck::Int3Path::parse(&line) {
                    int3_path = path;
                }
                if line.contains("Kernel panic") {
                    panicked = true;
                }
                if line.contains("BUG: soft lockup") {
                    panicked = true;
                    locked_up_at.get_or_insert_with(Instant::now);
                }
                if x86 && line.contains("Oops: int3") {
                    int3_oops = true;
                } else if int3_oops && line.contains("Code: ") {
                    int3_oops = false;
                    stale_breakpoint |= breakpoint_gone(&line) == Some(true);
                }
                if locked_up_at.is_some() {
                    int3_in_stacks |= x86 && in_int3_handling(&line);
                    for frame in bpf_frames(&line) {
                        if !frames.iter().any(|f| f == frame) {
                            frames.push(frame.to_owned());
                        }
                    }
                }
                alive |= line.contains(ALIVE);
                report.line(&line);
                if let Some(rest) = line.strip_prefix(RESULT_PREFIX) {
                    result = Some(rest.trim().to_owned());
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break false,
            Err(mpsc::RecvTimeoutError::Timeout) if Instant::now() < until => {
                let now = Instant::now();
                next_sample = now + stuck::SAMPLE_EVERY;
                let cpus = monitor.sample().unwrap_or_default();
                if let Some(found) = stuck.observe(&cpus, &int3_path, now) {
                    let pcs: Vec<String> = cpus.iter().map(|c| format!("{:x}", c.pc)).collect();
                    writeln!(
                        log_file,
                        "runner: every vCPU has had interrupts off for {:?} (last PCs {}); \
                         in the kernel's int3 handling: {}",
                        stuck::STUCK_FOR,
                        pcs.join(" "),
                        found.in_int3
                    )?;
                    hard_lockup = Some(found);
                    break true;
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => break true,
        }
    };
    if timed_out {
        // Our own child, by its pid.
        let _ = child.kill();
    }
    let _ = child.wait();
    for reader in readers {
        let _ = reader.join();
    }
    let elapsed = started.elapsed();
    // A KVM guest that never came alive says nothing about the kernel under test: KVM itself
    // is unusable here, whether QEMU hung (nested KVM's internal error) or exited (an
    // assertion on a model-specific register, seen on some hosts).
    if kvm && (!alive || kvm_failed) {
        return Ok(None);
    }
    let running = report.unfinished().join(", ");
    let log = log.display();
    let emulator_fault = if stale_breakpoint {
        Some("an int3 trap at a site the kernel had already patched (Oops: int3)")
    } else if hard_lockup.is_some_and(|h| h.in_int3) {
        Some("every vCPU with interrupts off, trapping on int3 (a hard lockup)")
    } else if locked_up_at.is_some() && int3_in_stacks {
        Some("a soft lockup with CPUs in the kernel's int3 handling")
    } else {
        None
    };
    let result = if let Some(fault) = emulator_fault {
        format!(
            "the emulator ran a breakpoint the kernel had patched away: {fault} (while \
             running: {running}); console log in {log}"
        )
    } else if locked_up_at.is_some() {
        format!("soft lockup (while running: {running}); console log in {log}")
    } else if hard_lockup.is_some() {
        format!(
            "hard lockup: every vCPU had interrupts off for {:?} (while running: {running}); \
             console log in {log}",
            stuck::STUCK_FOR
        )
    } else if timed_out {
        format!("no power-off within {timeout:?} (still running: {running}); console log in {log}")
    } else if panicked {
        format!("kernel panic (while running: {running}); console log in {log}")
    } else {
        match result {
            Some(result) => result,
            None => format!("the VM stopped without a result line; console log in {log}"),
        }
    };
    let passed = !timed_out && !panicked && result.ends_with(" 0 failed") && running.is_empty();
    Ok(Some(Outcome {
        result,
        passed,
        elapsed,
        report,
        locked_up: locked_up_at.is_some() || hard_lockup.is_some(),
        bpf_frames: frames,
        emulator_fault,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bpf_frames_are_found_in_stack_lines() {
        let frames = |line| bpf_frames(line).collect::<Vec<_>>();
        assert_eq!(
            frames(" bpf_prog_6deef7357e7b4530_meshcap_connect4+0x5c/0x1000"),
            ["bpf_prog_6deef7357e7b4530_meshcap_connect4"]
        );
        assert_eq!(
            frames(" ? htab_lru_map_update_elem+0x1a/0x2c0"),
            ["htab_lru_map_update_elem"]
        );
        assert_eq!(
            frames(" __cgroup_bpf_run_filter_sock_addr+0x10e/0x2b0"),
            ["__cgroup_bpf_run_filter_sock_addr"]
        );
        assert!(frames(" __do_softirq+0xc5/0x2a3").is_empty());
        assert!(frames("RIP: 0010:native_safe_halt+0xb/0x10").is_empty());
    }

    #[test]
    fn int3_handling_is_found_in_stack_lines() {
        assert!(in_int3_handling(" ? exc_int3+0xe/0x80"));
        assert!(in_int3_handling(" asm_exc_int3+0x2a/0x40"));
        // 5.10, docs/development.md ("Emulator faults").
        assert!(in_int3_handling(
            "[   28.679188] RIP: 0010:asm_exc_int3+0x0/0x40"
        ));
        assert!(!in_int3_handling(" do_int3_user+0x1/0x2"));
    }

    #[test]
    fn a_breakpoint_patched_away_is_told_from_one_still_there() {
        // CI, 6.12: the site holds the patched `jmp` (e9) already.
        let patched = "[  150.440958] Code: 83 c0 04 41 89 45 00 eb a8 41 0f b6 46 12 3c 07 75 9f \
                       e9 <77> 02 00 00 e9 72 02 00 00 49 8b 46 28";
        assert_eq!(breakpoint_gone(patched), Some(true));
        let there = "Code: 48 89 e5 cc <0f> 1f 44 00 00";
        assert_eq!(breakpoint_gone(there), Some(false));
        assert_eq!(breakpoint_gone("Code: Unable to access opcode bytes"), None);
        assert_eq!(breakpoint_gone("Code: <cc> 90 90"), None);
    }

    #[test]
    fn report_reads_verdicts_and_failed_tests_off_the_console() {
        let mut report = Report::default();
        for line in [
            "meshcap-vm: running scenarios",
            "meshcap-vm: running probe",
            "probe| test auto_chooses_ebpf ... ok",
            "scenarios| test ebpf_rows ... FAILED",
            "scenarios| test iptables_rows ... ok",
            "scenarios| meshcap-tests: eBPF backend unsupported here (helper …); checked …",
            "meshcap-vm: done probe: ok in 1s",
            "meshcap-vm: done scenarios: FAILED (exit code 101) in 300s",
            "meshcap-vm: running cni_agent",
        ] {
            report.line(line);
        }
        assert_eq!(
            report.lines(),
            [
                "scenarios: FAILED (exit code 101) in 300s: 1 passed, 1 failed (ebpf_rows); 1 \
                 found the eBPF backend unsupported and checked it is refused",
                "probe: ok in 1s: 1 passed, 0 failed",
                "cni_agent: did not finish: 0 passed, 0 failed",
            ]
        );
        assert_eq!(report.unfinished(), ["cni_agent"]);
        assert_eq!(report.binaries[0].1.seconds, Some(300));
    }
}
