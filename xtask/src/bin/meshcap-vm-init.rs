//! PID 1 of `cargo xtask integration`'s VMs: mounts what the tests need (proc, sysfs, devtmpfs,
//! tmpfs, bpffs, cgroup2), loads the modules listed in `/modules.list`, runs every test of the
//! binaries in `/tests.list` that `/tests.filter` selects (one process per test, `/jobs` at a time, every output line
//! prefixed with the binary's name), prints one line per binary and one result line, and
//! powers the VM off.
use std::{
    collections::BTreeMap,
    ffi::CString,
    fs,
    io::{BufRead as _, BufReader, Read},
    os::{fd::AsRawFd as _, unix::process::ExitStatusExt as _},
    process::{Command, ExitStatus, Stdio},
    sync::{Arc, Mutex},
    thread,
    time::{Duration, Instant},
};

use nix::mount::{MsFlags, mount};

const RESULT_PREFIX: &str = "meshcap-vm: result:";

fn main() {
    let kernel = fs::read_to_string("/kernel.txt").unwrap_or_default();
    let kernel = kernel.trim();
    println!("meshcap-vm: init started on linux {kernel}");
    let (passed, failed) = match setup() {
        Ok(()) => run_tests(),
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
    // `cargo xtask integration --test F`: only tests whose `binary::test` contains an F.
    let filter = fs::read_to_string("/tests.filter").unwrap_or_default();
    let filter: Vec<&str> = filter.lines().filter(|l| !l.is_empty()).collect();
    let wanted = |binary: &str, test: &str| {
        let name = format!("{binary}::{test}");
        filter.is_empty() || filter.iter().any(|f| name.contains(f))
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
        // Emulated CPUs: a smaller burst keeps the parallel-pods test within the plugin's
        // agent timeout (the host suite runs 100).
        .env("MESHCAP_PARALLEL_PODS", "20")
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
