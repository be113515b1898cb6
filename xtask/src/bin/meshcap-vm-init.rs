//! PID 1 of `cargo xtask integration`'s VMs: mounts what the tests need (proc, sysfs, devtmpfs,
//! tmpfs, bpffs, cgroup2), loads the modules listed in `/modules.list`, runs each test binary
//! of `/tests.list`, prints one result line and powers the VM off. Built static.
use std::{
    ffi::CString,
    fs,
    os::fd::AsRawFd as _,
    process::{Command, ExitStatus},
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

fn run_tests() -> (u32, u32) {
    let (mut passed, mut failed) = (0, 0);
    let list = fs::read_to_string("/tests.list").unwrap_or_default();
    for name in list.lines().filter(|l| !l.is_empty()) {
        println!("meshcap-vm: running {name}");
        let status: Result<ExitStatus, _> = Command::new(format!("/tests/{name}"))
            .arg("--test-threads=1")
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .env("RUST_BACKTRACE", "1")
            .env("MESHCAP_BIN_DIR", "/tests")
            // Emulated CPUs: a smaller burst keeps the parallel-pods test within the plugin's
            // agent timeout (the host suite runs 100).
            .env("MESHCAP_PARALLEL_PODS", "20")
            .current_dir("/tmp")
            .status();
        match status {
            Ok(status) if status.success() => {
                println!("meshcap-vm: {name}: ok");
                passed += 1;
            }
            other => {
                println!("meshcap-vm: {name}: FAILED ({other:?})");
                failed += 1;
            }
        }
    }
    (passed, failed)
}
