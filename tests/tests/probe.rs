//! The kernel probe behind `--backend auto`: it knows every helper the embedded programs
//! call (an unknown one would silently send every node to the iptables fallback), and its
//! answer is the one the runner expects of this kernel (every feature on the host's and on
//! 6.1 and 6.12; on 5.10 the missing ones named, see `standalone::auto_runs_…`); and a
//! process without the capabilities it needs is told which one it lacks.
use std::{
    io::{Read as _, Write as _},
    os::unix::process::CommandExt as _,
    process::{Child, Command, Stdio},
    time::Duration,
};

use meshcap_agent::probe;
use meshcap_tests::{
    agent::binaries,
    fixtures::{ManifestDir, eventually},
    require_root, unique_name,
};

#[test]
fn the_probe_knows_every_helper_and_answers_as_the_kernel_does() {
    require_root();
    let report = probe::run();
    let unknown: Vec<_> = report
        .checks
        .iter()
        .filter(|check| check.detail.contains("unknown to this agent's probe"))
        .collect();
    assert!(unknown.is_empty(), "the probe does not know: {unknown:?}");
    // The findings, one line each, for the kernel table of docs/ebpf.md: straight to the
    // stderr fd, so that the VMs' consoles show them for a passing test too.
    let mut stderr = std::io::stderr().lock();
    for check in &report.checks {
        let answer = if check.ok { "yes" } else { "NO" };
        let why = check.detail.lines().next().unwrap_or_default();
        let _ = writeln!(stderr, "probe: {answer}: {} {why}", check.what);
    }
    drop(stderr);
    for must in ["BPF_FUNC_tail_call", "SO_NETNS_COOKIE"] {
        assert!(
            report.checks.iter().any(|check| check.what.contains(must)),
            "the probe must check {must}: {:?}",
            report.checks
        );
    }
    // TCX (6.6) is not required: pods' inbound stubs attach as netlink TC filters without it.
    // `ebpf_runs_here` fails the test when the probe's answer is not the runner's.
    assert_eq!(
        meshcap_tests::ebpf_runs_here(),
        report.ok(),
        "probe: {}",
        report.failures()
    );
}

/// `CAP_SYS_ADMIN` and `CAP_BPF` (`linux/capability.h`).
const SYS_ADMIN_AND_BPF: [libc::c_ulong; 2] = [21, 39];

/// `meshcap-agent` with `args`, in a process whose bounding set lacks `CAP_SYS_ADMIN` and
/// `CAP_BPF` (dropped before the exec, so root's process never has them), as a runtime or an
/// admission policy that removed what the DaemonSet adds leaves it.
fn without_sys_admin(args: &[&str]) -> Command {
    let mut command = Command::new(binaries().join("meshcap-agent"));
    command.args(args);
    // SAFETY: between fork and exec the child only calls prctl(2), which is
    // async-signal-safe, and allocates nothing.
    unsafe {
        command.pre_exec(|| {
            for cap in SYS_ADMIN_AND_BPF {
                if libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    command
}

/// The agent started by a test: stopped (SIGTERM, by pid) and reaped on drop.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        if let Ok(pid) = i32::try_from(self.0.id()) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
        for _ in 0..250 {
            if !matches!(self.0.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A pin directory on the host's bpffs, removed on drop.
struct Pins(std::path::PathBuf);

impl Drop for Pins {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `GET path` of the agent's endpoint at `addr`: the status code and the body.
fn get(addr: &str, path: &str) -> std::io::Result<(u16, String)> {
    let mut stream = std::net::TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )?;
    let mut text = String::new();
    stream.read_to_string(&mut text)?;
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_default();
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned());
    Ok((code, body.unwrap_or_default()))
}

#[test]
fn without_cap_sys_admin_the_probe_and_the_agent_name_it() {
    require_root();
    // The probe: the kernel refuses bpf() with EPERM, and the report says which capability.
    let out = without_sys_admin(&["probe"])
        .stdin(Stdio::null())
        .output()
        .expect("meshcap-agent probe");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "the probe must fail: {text}");
    assert!(
        text.contains("the agent lacks CAP_SYS_ADMIN, or CAP_BPF with CAP_NET_ADMIN"),
        "the probe names the capability: {text}"
    );
    // The agent forced onto the eBPF backend exits, naming it.
    let scratch = ManifestDir::new();
    let dir = |name: &str| {
        let path = scratch.0.join(name);
        std::fs::create_dir_all(&path).expect("dir");
        path.display().to_string()
    };
    let (pods, state, cgroup) = (dir("pods"), dir("state"), dir("cgroup"));
    let socket = scratch.0.join("agent.sock").display().to_string();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let http = format!("127.0.0.1:{port}");
    let run = |backend: &str| {
        let mut command = without_sys_admin(&[
            "run",
            "--pods",
            "dir",
            "--pod-dir",
            &pods,
            "--backend",
            backend,
            "--socket",
            &socket,
            "--state-dir",
            &state,
            "--http-listen",
            &http,
            "--cgroup-root",
            &cgroup,
        ]);
        command
            .env("RUST_LOG", "warn,meshcap_agent=info")
            .stdin(Stdio::null());
        command
    };
    let pins = Pins(std::path::PathBuf::from("/sys/fs/bpf").join(unique_name("meshcap-caps")));
    let out = run("ebpf")
        .env("MESHCAP_BPFFS_DIR", pins.0.join("v1"))
        .output()
        .expect("meshcap-agent run");
    drop(pins);
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "the eBPF backend cannot open: {text}"
    );
    assert!(
        text.contains(
            "opening the eBPF backend: operation not permitted: the agent lacks CAP_SYS_ADMIN"
        ),
        "the agent names the capability: {text}"
    );
    // On Istio's rules it runs, not ready, and /readyz says which capability it lacks.
    let log = scratch.0.join("agent.log");
    let agent = Running(
        run("iptables")
            .stderr(std::fs::File::create(&log).expect("log"))
            .spawn()
            .expect("meshcap-agent run"),
    );
    let readyz = || get(&http, "/readyz");
    eventually("/readyz names the capability lacking", || {
        readyz().is_ok_and(|(code, body)| {
            code == 503 && body.contains("the agent lacks CAP_SYS_ADMIN (")
        })
    })
    .unwrap_or_else(|e| {
        panic!(
            "{e}: {:?}\n{}",
            readyz(),
            std::fs::read_to_string(&log).unwrap_or_default()
        )
    });
    drop(agent);
    let logged = std::fs::read_to_string(&log).expect("log");
    assert!(
        logged.contains("the agent lacks CAP_SYS_ADMIN ("),
        "the log names it: {logged}"
    );
}
