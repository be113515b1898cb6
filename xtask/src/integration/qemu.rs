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

use anyhow::{Context as _, bail};

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
}

/// The init's first line: the VM is alive.
const ALIVE: &str = "meshcap-vm: init started";

/// Without a sign of life in this time, a KVM boot is taken as stuck (nested KVM on some hosts
/// accepts the VM and never runs it) and the VM is booted again under TCG.
const KVM_ALIVE_WITHIN: Duration = Duration::from_secs(60);

/// Set once a KVM boot showed no sign of life: later kernels go straight to TCG.
static KVM_STUCK: AtomicBool = AtomicBool::new(false);

/// Boots `vmlinuz` with `initrd`, mirrors the console to stdout (prefixed) and `log`, and
/// returns the init's verdict. Fails on a kernel panic, a missing verdict or `timeout`.
pub fn boot(
    label: &str,
    vmlinuz: &Path,
    initrd: &Path,
    log: &Path,
    timeout: Duration,
) -> anyhow::Result<Outcome> {
    if kvm_usable() && !KVM_STUCK.load(Ordering::Relaxed) {
        match boot_once(label, vmlinuz, initrd, log, timeout, true)? {
            Some(outcome) => return Ok(outcome),
            None => {
                KVM_STUCK.store(true, Ordering::Relaxed);
                eprintln!(
                    "integration: {label}: no sign of life under KVM within {KVM_ALIVE_WITHIN:?}; \
                 booting again under TCG, and the next kernels too"
                );
            }
        }
    }
    boot_once(label, vmlinuz, initrd, log, timeout, false)?
        .with_context(|| format!("{label}: the VM never started its init"))
}

/// One boot; `None` when a KVM boot showed no sign of life.
fn boot_once(
    label: &str,
    vmlinuz: &Path,
    initrd: &Path,
    log: &Path,
    timeout: Duration,
    kvm: bool,
) -> anyhow::Result<Option<Outcome>> {
    let mut cmd = Command::new("qemu-system-x86_64");
    if kvm {
        cmd.args(["-accel", "kvm", "-cpu", "host"]);
    } else {
        cmd.args(["-accel", "tcg", "-cpu", "max"]);
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
    .arg(vmlinuz)
    .arg("-initrd")
    .arg(initrd)
    // panic=-1: reboot at once on a panic, which -no-reboot turns into QEMU exiting.
    .args([
        "-append",
        "console=ttyS0 panic=-1 oops=panic rdinit=/init loglevel=4 noapic",
    ])
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit());
    eprintln!(
        "integration: booting {label} ({})",
        if kvm { "KVM" } else { "TCG emulation" }
    );
    let started = Instant::now();
    let mut child = cmd
        .spawn()
        .context("starting qemu-system-x86_64 (cargo xtask setup installs it)")?;
    let stdout = child.stdout.take().context("qemu's stdout")?;
    let (tx, rx) = mpsc::channel();
    let reader = thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut log_file = File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let (mut result, mut panicked, mut alive) = (None, false, false);
    let deadline = started + timeout;
    let alive_deadline = started + if kvm { KVM_ALIVE_WITHIN } else { timeout };
    let timed_out = loop {
        let until = if alive {
            deadline
        } else {
            alive_deadline.min(deadline)
        };
        let left = until.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                let line = line.trim_end_matches('\r').to_owned();
                println!("[{label}] {line}");
                writeln!(log_file, "{line}")?;
                if line.contains("Kernel panic") || line.contains("BUG: soft lockup") {
                    panicked = true;
                }
                alive |= line.contains(ALIVE);
                if let Some(rest) = line.strip_prefix(RESULT_PREFIX) {
                    result = Some(rest.trim().to_owned());
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break false,
            Err(mpsc::RecvTimeoutError::Timeout) => break true,
        }
    };
    if timed_out {
        // Our own child, by its pid.
        let _ = child.kill();
    }
    let _ = child.wait();
    let _ = reader.join();
    let elapsed = started.elapsed();
    if timed_out && kvm && !alive {
        return Ok(None);
    }
    if timed_out {
        bail!(
            "{label}: no power-off within {timeout:?}; console log in {}",
            log.display()
        );
    }
    if panicked {
        bail!("{label}: kernel panic; console log in {}", log.display());
    }
    let result = result.with_context(|| {
        format!(
            "{label}: the VM stopped without a result line; console log in {}",
            log.display()
        )
    })?;
    let passed = result.ends_with(" 0 failed");
    Ok(Some(Outcome {
        result,
        passed,
        elapsed,
    }))
}
