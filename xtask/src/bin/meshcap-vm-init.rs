//! PID 1 of `cargo xtask integration`'s VMs: mounts what the tests need (proc, sysfs, devtmpfs,
//! tmpfs, bpffs, cgroup2), loads the modules listed in `/modules.list`, runs every test of the
//! binaries in `/tests.list` that both `/tests.select` (this guest's share of the suite) and
//! `/tests.filter` (`--test`) keep ([`selected`]; one process per test, `/jobs` at a time,
//! every output line prefixed with the binary's name), prints one line per binary and one
//! result line, and powers the VM off. With `/emulator-probe` it runs no tests but
//! [`emulator_probe`].
use std::{
    collections::BTreeMap,
    ffi::CString,
    fs,
    io::{BufRead as _, BufReader, Read, Write as _},
    os::{fd::AsRawFd as _, unix::process::ExitStatusExt as _},
    process::{Command, ExitStatus, Stdio},
    sync::{Arc, Mutex},
    thread,
    time::{Duration, Instant},
};

use nix::mount::{MsFlags, mount};

const RESULT_PREFIX: &str = "meshcap-vm: result:";

/// The runner's `stuck::INT3_PATH`.
const INT3_PATH: &str = "meshcap-vm: int3 path:";

fn main() {
    let kernel = fs::read_to_string("/kernel.txt").unwrap_or_default();
    let kernel = kernel.trim();
    println!("meshcap-vm: init started on linux {kernel}");
    let (passed, failed) = match setup() {
        Ok(()) => {
            // The emulator's known fault is an x86 guest's (xtask/src/integration/stuck.rs).
            if cfg!(target_arch = "x86_64") {
                print_int3_path();
            }
            match fs::read_to_string("/emulator-probe") {
                Ok(spec) => emulator_probe(&spec),
                Err(_) => run_tests(),
            }
        }
        Err(err) => {
            println!("meshcap-vm: set-up failed: {err}");
            (0, 1)
        }
    };
    println!("{RESULT_PREFIX} linux {kernel}: {passed} passed, {failed} failed");
    // SAFETY: sync and reboot take no pointers; powering off is what PID 1 does last.
    unsafe {
        libc::sync();
        libc::reboot(libc::RB_POWER_OFF);
    }
}

fn setup() -> Result<(), String> {
    let mounts: [(&str, &str, &str, &str); 8] = [
        ("proc", "/proc", "proc", ""),
        ("sysfs", "/sys", "sysfs", ""),
        ("devtmpfs", "/dev", "devtmpfs", ""),
        ("tmpfs", "/tmp", "tmpfs", "mode=1777"),
        ("tmpfs", "/run", "tmpfs", "mode=755"),
        ("bpffs", "/sys/fs/bpf", "bpf", ""),
        ("cgroup2", "/sys/fs/cgroup", "cgroup2", ""),
        ("debugfs", "/sys/kernel/debug", "debugfs", ""),
    ];
    for (source, target, fstype, data) in mounts {
        let _ = fs::create_dir_all(target);
        let data = (!data.is_empty()).then_some(data);
        mount(Some(source), target, Some(fstype), MsFlags::empty(), data)
            .map_err(|e| format!("mounting {fstype} on {target}: {e}"))?;
    }
    let modules = fs::read_to_string("/modules.list").unwrap_or_default();
    for module in modules.lines().filter(|l| !l.is_empty()) {
        load_module(module)?;
    }
    // The tests' agents serve health and fake API servers on 127.0.0.1 of this namespace.
    let up = Command::new("/usr/sbin/ip")
        .args(["link", "set", "lo", "up"])
        .status()
        .map_err(|e| format!("running ip: {e}"))?;
    if !up.success() {
        return Err(format!("ip link set lo up: {up}"));
    }
    Ok(())
}

/// Where the kernel handles `int3` (`asm_exc_int3`, `exc_int3`, `poke_int3_handler`, each up
/// to the next symbol), from `/proc/kallsyms`: the runner tells by it a guest stuck trapping on
/// `int3` from another (`xtask/src/integration/stuck.rs`).
fn print_int3_path() {
    let Ok(symbols) = fs::read_to_string("/proc/kallsyms") else {
        return;
    };
    let mut text: Vec<(u64, &str)> = symbols
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let address = u64::from_str_radix(fields.next()?, 16).ok()?;
            let kind = fields.next()?;
            let name = fields.next()?;
            kind.eq_ignore_ascii_case("t").then_some((address, name))
        })
        .collect();
    text.sort_unstable();
    let ranges: Vec<String> = text
        .windows(2)
        .filter(|pair| matches!(pair[0].1, "asm_exc_int3" | "exc_int3" | "poke_int3_handler"))
        .map(|pair| format!("{:x}-{:x}", pair[0].0, pair[1].0))
        .collect();
    println!("{INT3_PATH} {}", ranges.join(" "));
}

fn load_module(path: &str) -> Result<(), String> {
    let file = fs::File::open(path).map_err(|e| format!("opening {path}: {e}"))?;
    let params = CString::default();
    // SAFETY: finit_module reads the open module file and a NUL-terminated parameter string
    // that outlive the call.
    let rc = unsafe { libc::syscall(libc::SYS_finit_module, file.as_raw_fd(), params.as_ptr(), 0) };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EEXIST) {
            return Err(format!("loading module {path}: {err}"));
        }
    }
    Ok(())
}

/// One binary's progress: tests left, tests failed, seconds spent, first failure.
#[derive(Default)]
struct Progress {
    left: usize,
    failed: usize,
    seconds: u64,
    failure: Option<String>,
}

/// Runs every test of every listed binary, one process per test, `/jobs` processes at a time
/// (so the VM's CPUs stay busy until the end, whatever the binaries' sizes); prints
/// `meshcap-vm: done NAME: ...` when a binary's last test ends. Returns (passed, failed)
/// binaries.
fn run_tests() -> (u32, u32) {
    let list = fs::read_to_string("/tests.list").unwrap_or_default();
    let select = fs::read_to_string("/tests.select").unwrap_or_default();
    let filter = fs::read_to_string("/tests.filter").unwrap_or_default();
    let wanted = |binary: &str, test: &str| {
        let name = format!("{binary}::{test}");
        selected(&name, &select) && selected(&name, &filter)
    };
    let mut queue = Vec::new();
    let mut progress = BTreeMap::new();
    for binary in list.lines().filter(|l| !l.is_empty()) {
        println!("meshcap-vm: running {binary}");
        let entry: &mut Progress = progress.entry(binary.to_owned()).or_default();
        match list_tests(binary) {
            Ok(tests) => {
                let tests: Vec<String> = tests.into_iter().filter(|t| wanted(binary, t)).collect();
                entry.left = tests.len();
                if tests.is_empty() {
                    println!("meshcap-vm: done {binary}: ok in 0s");
                }
                queue.extend(tests.into_iter().map(|t| (binary.to_owned(), Some(t))));
            }
            Err(err) => {
                // Run it whole: its own output says what is wrong.
                println!("meshcap-vm: {binary}: cannot list its tests ({err})");
                entry.left = 1;
                queue.push((binary.to_owned(), None));
            }
        }
    }
    let jobs = fs::read_to_string("/jobs")
        .ok()
        .and_then(|j| j.trim().parse::<usize>().ok())
        .unwrap_or(1)
        .max(1);
    let queue = Arc::new(Mutex::new(queue.into_iter()));
    let progress = Arc::new(Mutex::new(progress));
    let workers: Vec<_> = (0..jobs)
        .map(|_| {
            let (queue, progress) = (Arc::clone(&queue), Arc::clone(&progress));
            thread::spawn(move || {
                loop {
                    let next = queue.lock().map(|mut q| q.next()).ok().flatten();
                    let Some((binary, test)) = next else { break };
                    let started = Instant::now();
                    let outcome = run_one(&binary, test.as_deref());
                    let Ok(mut all) = progress.lock() else { break };
                    let Some(p) = all.get_mut(&binary) else {
                        continue;
                    };
                    p.left -= 1;
                    p.seconds += started.elapsed().as_secs();
                    if let Err(how) = outcome {
                        p.failed += 1;
                        p.failure.get_or_insert(how);
                    }
                    if p.left == 0 {
                        let verdict = match &p.failure {
                            None => "ok".to_owned(),
                            Some(how) => format!("FAILED ({how}; {} test(s))", p.failed),
                        };
                        println!("meshcap-vm: done {binary}: {verdict} in {}s", p.seconds);
                    }
                }
            })
        })
        .collect();
    for worker in workers {
        let _ = worker.join();
    }
    progress.lock().map_or((0, 1), |all| {
        let failed = all.values().filter(|p| p.failed > 0 || p.left > 0).count();
        let passed = all.len() - failed;
        (
            u32::try_from(passed).unwrap_or(u32::MAX),
            u32::try_from(failed).unwrap_or(u32::MAX),
        )
    })
}

/// Whether the selection `lines` keeps the test `name` (`binary::test`): it matches one of
/// the lines that do not start with `!` (or there are none) and none of those that do. A line
/// matches a name the name contains, `*` in the line standing for any characters
/// (`ambient::*kernel`).
fn selected(name: &str, lines: &str) -> bool {
    let matches = |pattern: &str| {
        let mut rest = name;
        pattern.split('*').all(|part| match rest.find(part) {
            Some(at) => {
                rest = &rest[at + part.len()..];
                true
            }
            None => false,
        })
    };
    let lines: Vec<&str> = lines.lines().filter(|l| !l.is_empty()).collect();
    let (excluded, included): (Vec<&str>, Vec<&str>) =
        lines.iter().partition(|l| l.starts_with('!'));
    (included.is_empty() || included.iter().any(|p| matches(p)))
        && !excluded.iter().any(|p| matches(&p[1..]))
}

/// `cargo xtask integration --emulator-probe`: whether the emulator honours the kernel's
/// patching of its own text, with no BPF and no meshcap code. Two pairs of threads ping-pong
/// through pipes (the scheduler's hot paths run on every vCPU) while this thread flips the
/// scheduler's `sched_schedstats` static key (`flip`), or leaves it alone (`still`), for the
/// seconds given. Each flip patches the key's sites with `text_poke_bp` (an `int3` first, then
/// the new instruction), as attaching the first cgroup program of a kind does to
/// `cgroup_bpf_enabled_key`. A guest that dies of an `int3` here dies of the emulator.
fn emulator_probe(spec: &str) -> (u32, u32) {
    let mut words = spec.split_whitespace();
    let flip = words.next() == Some("flip");
    let seconds = words.next().and_then(|s| s.parse().ok()).unwrap_or(60);
    println!(
        "meshcap-vm: emulator probe: {} the sched_schedstats key for {seconds} s",
        if flip { "flipping" } else { "not flipping" }
    );
    for _ in 0..2 {
        if let Err(err) = ping_pong() {
            println!("meshcap-vm: emulator probe: {err}");
            return (0, 1);
        }
    }
    let started = Instant::now();
    let mut report = Duration::from_secs(10);
    let mut flips = 0_u64;
    while started.elapsed() < Duration::from_secs(seconds) {
        if flip {
            let value = if flips.is_multiple_of(2) { "1" } else { "0" };
            if let Err(err) = fs::write("/proc/sys/kernel/sched_schedstats", value) {
                println!("meshcap-vm: emulator probe: writing sched_schedstats: {err}");
                return (0, 1);
            }
            flips += 1;
        } else {
            thread::sleep(Duration::from_millis(1));
        }
        if started.elapsed() >= report {
            println!(
                "meshcap-vm: emulator probe: {flips} flips in {}s",
                report.as_secs()
            );
            report += Duration::from_secs(10);
        }
    }
    println!("meshcap-vm: emulator probe: {flips} flips in {seconds} s, no fault");
    (1, 0)
}

/// Two threads passing one byte back and forth through two pipes, for ever.
fn ping_pong() -> Result<(), String> {
    let pipe = || -> Result<(fs::File, fs::File), String> {
        let (read, write) = nix::unistd::pipe().map_err(|e| format!("pipe: {e}"))?;
        Ok((fs::File::from(read), fs::File::from(write)))
    };
    let ((mut ping_rx, mut ping_tx), (mut pong_rx, mut pong_tx)) = (pipe()?, pipe()?);
    let mut byte = [0_u8];
    thread::spawn(move || {
        while ping_rx.read_exact(&mut byte).is_ok() && pong_tx.write_all(&byte).is_ok() {}
    });
    thread::spawn(move || {
        let mut byte = [0_u8];
        while ping_tx.write_all(&byte).is_ok() && pong_rx.read_exact(&mut byte).is_ok() {}
    });
    Ok(())
}

/// The tests of a binary (`--list --format terse`: `name: test` lines).
fn list_tests(binary: &str) -> Result<Vec<String>, String> {
    let out = Command::new(format!("/tests/{binary}"))
        .args(["--list", "--format", "terse"])
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!("{}", out.status));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.strip_suffix(": test"))
        .map(str::to_owned)
        .collect())
}

/// Runs one test of `binary` (all of them when `test` is `None`), its output prefixed
/// `binary| `. `Err` says how it failed.
fn run_one(binary: &str, test: Option<&str>) -> Result<(), String> {
    let mut cmd = Command::new(format!("/tests/{binary}"));
    if let Some(test) = test {
        cmd.args(["--exact", test]);
    }
    // Below the eBPF backend's floor, the tests that need it check that it is refused.
    if fs::exists("/ebpf.unsupported").unwrap_or(false) {
        cmd.env("MESHCAP_EBPF", "unsupported");
    }
    let child = cmd
        .arg("--test-threads=1")
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("RUST_BACKTRACE", "1")
        .env("MESHCAP_BIN_DIR", "/tests")
        // The chart's configurations, rendered on the host (no helm here).
        .env("MESHCAP_CHART_RENDERED", "/chart")
        // Emulated CPUs: a smaller burst keeps the parallel-pods test within the plugin's
        // agent timeout (the host suite runs 100), and an agent's start gets three times the
        // host's 20 s (an arm64 guest's needs more than 20 s on a busy machine).
        .env("MESHCAP_PARALLEL_PODS", "20")
        // The kernel probe's answer, found by the boot's first test and read by the others
        // (`meshcap_tests::ebpf_runs_here`): seconds per test on emulated CPUs.
        .env("MESHCAP_PROBE_ANSWER", "/run/meshcap-probe-answer")
        .env("MESHCAP_AGENT_READY_SECS", "60")
        .current_dir("/tmp")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let status: Result<ExitStatus, String> = match child {
        Ok(mut child) => {
            let pipes: Vec<Box<dyn Read + Send>> = [
                child
                    .stdout
                    .take()
                    .map(|p| Box::new(p) as Box<dyn Read + Send>),
                child
                    .stderr
                    .take()
                    .map(|p| Box::new(p) as Box<dyn Read + Send>),
            ]
            .into_iter()
            .flatten()
            .collect();
            let copiers: Vec<_> = pipes
                .into_iter()
                .map(|pipe| {
                    let name = binary.to_owned();
                    thread::spawn(move || {
                        for line in BufReader::new(pipe).lines() {
                            let Ok(line) = line else { break };
                            println!("{name}| {line}");
                        }
                    })
                })
                .collect();
            let status = child.wait().map_err(|e| e.to_string());
            // A process the test leaked may hold the pipes open: wait a little, not forever.
            let until = Instant::now() + Duration::from_secs(5);
            while copiers.iter().any(|c| !c.is_finished()) && Instant::now() < until {
                thread::sleep(Duration::from_millis(50));
            }
            status
        }
        Err(err) => Err(format!("cannot start: {err}")),
    };
    match status {
        Ok(s) if s.success() => Ok(()),
        Ok(s) => Err(match (s.code(), s.signal()) {
            (Some(code), _) => format!("exit code {code}"),
            (None, Some(signal)) => format!("killed by signal {signal}"),
            _ => s.to_string(),
        }),
        Err(err) => Err(err),
    }
}

#[cfg(test)]
mod tests {
    use super::selected;

    #[test]
    fn a_selection_keeps_what_it_names_and_drops_what_it_excludes() {
        let name = "ambient::running_pods_join_and_leave_in_the_kernel";
        assert!(selected(name, ""));
        assert!(selected(name, "backend::\nambient::"));
        assert!(selected(name, "ambient::*kernel"));
        assert!(!selected("ambient::a_pod::iptables", "ambient::*kernel"));
        assert!(
            !selected("kernel::ambient::x", "ambient::*kernel"),
            "in order"
        );
        assert!(!selected(name, "!ambient::*kernel"));
        assert!(selected(
            "ambient::a_pod::ebpf",
            "!ambient::*kernel\n!scenarios::"
        ));
        assert!(!selected(
            "scenarios::rows",
            "!ambient::*kernel\n!scenarios::"
        ));
        assert!(!selected(name, "backend::"));
    }
}
