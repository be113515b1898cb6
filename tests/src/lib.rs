//! Harness for meshcap's end-to-end tests against the real kernel.
//!
//! Everything a test creates (network namespaces, cgroups, bpffs pins, processes) is owned by a
//! guard whose `Drop` removes it, so a failing test cleans up too. Names carry the test
//! process's pid, so concurrent test runs on one machine never collide.
//!
//! The tests need root. [`require_root`] panics (never skips) when it is missing.

use std::{
    fs::{self, File},
    io::{BufReader, Read as _, Write as _},
    net::SocketAddr,
    os::{fd::AsRawFd as _, unix::process::CommandExt as _},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicU32, Ordering},
    thread,
    time::Duration,
};

use anyhow::{Context as _, bail, ensure};

pub mod rtnl;
pub mod scenario;
pub mod wire;
pub mod world;
use serde::{Deserialize, Serialize};

pub mod agent;
pub mod apiserver;
pub mod chart;
pub mod cluster;
pub mod containerd;
pub mod cri;
pub mod fixtures;
pub mod kubelet;
pub mod oci;
pub mod one_pod;
pub mod plugin;
pub mod rbac;
pub mod socklb;
pub mod wired;

/// The uid/gid Istio's proxy runs as.
pub const PROXY_UID: u32 = 1337;

/// The uid of the pods' application processes.
pub const APP_UID: u32 = 1000;

static NEXT: AtomicU32 = AtomicU32::new(0);

/// A name unique to this process and call: `<prefix>-<pid>-<n>`.
#[must_use]
pub fn unique_name(prefix: &str) -> String {
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// A socket mark as the test binaries take it (`--mark`): `1337` or `0x539`.
///
/// # Errors
/// When `text` is neither a decimal nor a `0x` hexadecimal `u32`.
pub fn parse_mark(text: &str) -> anyhow::Result<u32> {
    let parsed = match text.strip_prefix("0x") {
        Some(hex) => u32::from_str_radix(hex, 16),
        None => text.parse(),
    };
    parsed.with_context(|| format!("bad mark {text}"))
}

/// Panics unless running as root: these tests load BPF programs and create namespaces.
pub fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test needs root (it loads BPF programs into the kernel and creates network \
         namespaces and cgroups); run it as root, e.g. `sudo -E cargo xtask test`"
    );
}

/// Whether this kernel runs the eBPF backend, as the agent's probe answers, checked against what
/// the runner says of the kernel: `MESHCAP_EBPF=unsupported` (set by `cargo xtask integration`
/// on kernels below the eBPF path's floor) or, unset, that it must run it. A test that needs the
/// eBPF backend calls this first; where the backend cannot run, this checks instead that it
/// refuses to load and prints why, and the test goes on with nothing else: it never skips on
/// its own judgement, and a probe that disagrees with the runner fails it.
///
/// # Panics
/// When the probe and the runner disagree, or the programs load where the probe says no.
#[must_use]
pub fn ebpf_runs_here() -> bool {
    use meshcap_agent::{bpf, probe};
    static ANSWER: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    require_root();
    let answer = ANSWER.get_or_init(|| {
        // One boot of a kernel gives one answer. Where the runner names a file for it (the VMs,
        // which start a process per test, and whose emulated CPUs take seconds per probe), the
        // first test's answer is kept there for the others.
        let kept = std::env::var_os("MESHCAP_PROBE_ANSWER").map(PathBuf::from);
        if let Some(answer) = kept.as_deref().and_then(|p| fs::read_to_string(p).ok()) {
            return match answer.split_once('\n') {
                Some(("supported", "")) => Ok(()),
                Some(("unsupported", why)) => Err(why.to_owned()),
                _ => panic!("not a probe's answer: {answer:?}"),
            };
        }
        let report = probe::run();
        let answer = if report.ok() {
            Ok(())
        } else {
            Err(report.failures())
        };
        if let Some(path) = kept {
            let text = match &answer {
                Ok(()) => "supported\n".to_owned(),
                Err(why) => format!("unsupported\n{why}"),
            };
            // Written whole, then renamed: a test starting meanwhile probes for itself.
            let partial = path.with_extension("partial");
            if let Err(err) = fs::write(&partial, text).and_then(|()| fs::rename(&partial, &path)) {
                eprintln!("keeping the probe's answer in {}: {err}", path.display());
            }
        }
        answer
    });
    let expected = std::env::var("MESHCAP_EBPF").as_deref() != Ok("unsupported");
    match (answer, expected) {
        (Ok(()), true) => true,
        (Err(why), true) => panic!(
            "the probe says this kernel cannot run the eBPF backend ({why}); the runner expects \
             it to (set MESHCAP_EBPF=unsupported on a kernel below its floor, docs/ebpf.md)"
        ),
        (Ok(()), false) => panic!(
            "MESHCAP_EBPF=unsupported, but the probe finds every feature of the eBPF backend"
        ),
        (Err(why), false) => {
            let loaded = bpf::open()
                .map_err(|e| e.to_string())
                .and_then(|mut ebpf| bpf::load_all(&mut ebpf).map_err(|e| e.to_string()));
            assert!(
                loaded.is_err(),
                "the probe says no ({why}), yet every program loaded"
            );
            // Straight to the stderr fd, past the test harness's capture: the VM's report
            // counts these lines.
            let _ = writeln!(
                std::io::stderr().lock(),
                "meshcap-tests: eBPF backend unsupported here ({why}); checked that its \
                 programs are refused, and nothing else"
            );
            false
        }
    }
}

/// Runs a command to completion and fails with its stderr when it does not succeed.
///
/// # Errors
/// When the command cannot start or exits non-zero.
pub fn run(program: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("running {program}"))?;
    ensure!(
        out.status.success(),
        "{program} {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A throwaway network namespace (`ip netns add`), deleted on drop.
#[derive(Debug)]
pub struct Netns {
    name: String,
    path: PathBuf,
    /// Made by this test (deleted on drop), or someone else's (a runtime's pod).
    owned: bool,
}

impl Netns {
    /// Creates the namespace with `lo` up and every port bindable without privilege (as in
    /// most pods, so the stand-ins can run as their real uids).
    ///
    /// # Errors
    /// When the kernel refuses.
    pub fn new(prefix: &str) -> anyhow::Result<Self> {
        let name = unique_name(prefix);
        let path = Path::new(rtnl::NETNS_RUN_DIR).join(&name);
        rtnl::add_netns(&path)?;
        let ns = Self {
            path,
            name,
            owned: true,
        };
        ns.set_up("lo")?;
        ns.run_in(|| {
            fs::write("/proc/sys/net/ipv4/ip_unprivileged_port_start", "0")
                .context("unprivileged ports sysctl")
        })?;
        Ok(ns)
    }

    /// A namespace owned by a user namespace of its own that maps ids `0`..`65535` to the
    /// node's `base`.. (a pod with `hostUsers: false`, as containerd 2 with runc makes it: the
    /// user namespace first, the network namespace inside it), set up as [`Self::new`] does.
    /// A child process creates both, the test writes its id maps and names its netns with `ip
    /// netns attach`; the child then exits, the name keeps the namespaces.
    ///
    /// # Errors
    /// When the kernel refuses, or `ip` fails.
    pub fn in_user_namespace(prefix: &str, base: u32) -> anyhow::Result<Self> {
        let name = unique_name(prefix);
        // Close-on-exec: no process another test starts meanwhile holds them. The child is
        // told to go by a byte, not by the pipe's end: a child another test forks meanwhile
        // holds a copy of the write end.
        let (ready_read, ready_write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
        let (go_read, go_write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
        let (ready, go) = (ready_write.as_raw_fd(), go_read.as_raw_fd());
        // SAFETY: the child makes only async-signal-safe system calls (unshare, write, read,
        // _exit) on its own stack and never returns into Rust code.
        let pid = unsafe { libc::fork() };
        ensure!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            // SAFETY: as above.
            unsafe {
                let made = libc::unshare(libc::CLONE_NEWUSER | libc::CLONE_NEWNET) == 0;
                let byte = [u8::from(made)];
                libc::write(ready, byte.as_ptr().cast(), 1);
                let mut wait = [0_u8; 1];
                libc::read(go, wait.as_mut_ptr().cast(), 1);
                libc::_exit(0);
            }
        }
        drop((ready_write, go_read));
        let child = nix::unistd::Pid::from_raw(pid);
        let made = (|| {
            let mut byte = [0_u8; 1];
            File::from(ready_read).read_exact(&mut byte)?;
            ensure!(byte[0] == 1, "unshare(CLONE_NEWUSER | CLONE_NEWNET) failed");
            for map in ["uid_map", "gid_map"] {
                fs::write(format!("/proc/{pid}/{map}"), format!("0 {base} 65536\n"))
                    .with_context(|| format!("writing {map}"))?;
            }
            run("ip", &["netns", "attach", &name, &pid.to_string()])?;
            Ok(())
        })();
        // The child reads its byte and exits; the name (if made) keeps the namespaces.
        let sent = File::from(go_write).write_all(&[1]);
        nix::sys::wait::waitpid(child, None)?;
        sent?;
        made?;
        let ns = Self {
            path: Path::new("/run/netns").join(&name),
            name,
            owned: true,
        };
        ns.set_up("lo")?;
        ns.run_in(|| {
            fs::write("/proc/sys/net/ipv4/ip_unprivileged_port_start", "0")
                .context("unprivileged ports sysctl")
        })?;
        Ok(ns)
    }

    /// A namespace someone else made (a container runtime's pod), at `path`: used as it is
    /// and never deleted by this handle. Its [`Self::name`] is the file's name, which `ip -n`
    /// knows only for a file in `/run/netns`.
    #[must_use]
    pub fn existing(path: &Path) -> Self {
        Self {
            name: path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            path: path.to_owned(),
            owned: false,
        }
    }

    /// The namespace's name for `ip netns`.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The namespace file (`/run/netns/<name>` for one of the test's own).
    #[must_use]
    pub fn path(&self) -> PathBuf {
        self.path.clone()
    }

    /// `ip -n <ns> <args>`.
    ///
    /// # Errors
    /// When `ip` fails.
    pub fn ip(&self, args: &[&str]) -> anyhow::Result<String> {
        let mut all = vec!["-n", self.name.as_str()];
        all.extend_from_slice(args);
        run("ip", &all)
    }

    /// `ip -n <ns> link add NAME type veth peer name PEER netns <peer_ns>`.
    ///
    /// # Errors
    /// When the kernel refuses.
    pub fn add_veth(&self, name: &str, peer_ns: &Self, peer: &str) -> anyhow::Result<()> {
        self.run_in(|| rtnl::add_veth(name, peer, &peer_ns.path))
    }

    /// `ip -n <ns> link set DEV up`.
    ///
    /// # Errors
    /// When there is no such device or the kernel refuses.
    pub fn set_up(&self, dev: &str) -> anyhow::Result<()> {
        self.run_in(|| rtnl::set_up(dev))
    }

    /// `ip -n <ns> addr add PREFIX dev DEV` (`10.0.0.2/24`; an IPv6 one `nodad`).
    ///
    /// # Errors
    /// When `prefix` is not one, or the kernel refuses.
    pub fn add_address(&self, dev: &str, prefix: &str) -> anyhow::Result<()> {
        let (addr, len) = rtnl::parse_prefix(prefix)?;
        self.run_in(|| rtnl::add_address(dev, addr, len))
    }

    /// `ip -n <ns> addr del PREFIX dev DEV`.
    ///
    /// # Errors
    /// When `prefix` is not one, or the device does not have it.
    pub fn del_address(&self, dev: &str, prefix: &str) -> anyhow::Result<()> {
        let (addr, len) = rtnl::parse_prefix(prefix)?;
        self.run_in(|| rtnl::del_address(dev, addr, len))
    }

    /// `ip -n <ns> route add default via GATEWAY` (either family).
    ///
    /// # Errors
    /// When `gateway` is not an address, or the kernel refuses.
    pub fn add_default_route(&self, gateway: &str) -> anyhow::Result<()> {
        let gateway = gateway
            .parse()
            .with_context(|| format!("gateway {gateway:?}"))?;
        self.run_in(|| rtnl::add_default_route(gateway))
    }

    /// Runs `f` with the calling thread inside this namespace, and brings it back (setns only
    /// affects the calling thread; the test's other threads stay where they are).
    ///
    /// # Errors
    /// When the namespace cannot be entered, or `f` fails.
    pub fn run_in<T>(&self, f: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
        meshcap_agent::podnet::run_in(&self.path(), |_| f())?
    }

    /// The namespace's TCP sockets, IPv4 and IPv6, as `/proc/net/tcp` and `tcp6` list them.
    ///
    /// # Errors
    /// When the namespace cannot be entered or the tables read.
    pub fn tcp_sockets(&self) -> anyhow::Result<Vec<TcpSocket>> {
        self.run_in(|| {
            let mut sockets = Vec::new();
            for file in ["tcp", "tcp6"] {
                let table = std::fs::read_to_string(format!("/proc/thread-self/net/{file}"))?;
                sockets.extend(table.lines().skip(1).filter_map(TcpSocket::parse));
            }
            Ok(sockets)
        })
    }

    /// The namespace's cookie, as `bpf_get_netns_cookie` reports it in programs.
    ///
    /// # Errors
    /// When the socket option is not supported (kernel < 5.14).
    pub fn cookie(&self) -> anyhow::Result<u64> {
        Ok(meshcap_agent::podnet::cookie_of(&self.path())?)
    }
}

/// One row of `/proc/net/tcp` or `tcp6` (`net/ipv4/tcp_ipv4.c`, `get_tcp4_sock`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcpSocket {
    /// The local port.
    pub local_port: u16,
    /// The remote port (0 for a listener).
    pub remote_port: u16,
    /// The TCP state (`0x0A`: `TCP_LISTEN`).
    pub state: u8,
    /// The active timer (`3`: the time-wait timer, which a time-wait socket runs).
    pub timer: u8,
}

impl TcpSocket {
    /// `TCP_LISTEN`.
    pub const LISTEN: u8 = 0x0A;
    /// `TCP_TIME_WAIT`.
    pub const TIME_WAIT: u8 = 0x06;
    /// The timer a time-wait socket runs (a full socket's close makes one, in `FIN_WAIT2` or
    /// `TIME_WAIT`).
    pub const TIME_WAIT_TIMER: u8 = 3;

    fn parse(line: &str) -> Option<Self> {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let port = |field: usize| {
            let hex = fields.get(field)?.rsplit(':').next()?;
            u16::from_str_radix(hex, 16).ok()
        };
        let timer = fields.get(5)?.split(':').next()?;
        Some(Self {
            local_port: port(1)?,
            remote_port: port(2)?,
            state: u8::from_str_radix(fields.get(3)?, 16).ok()?,
            timer: u8::from_str_radix(timer, 16).ok()?,
        })
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if self.owned
            && let Err(err) = rtnl::del_netns(&self.path)
        {
            eprintln!("cleanup: {err:#}");
        }
    }
}

/// A throwaway cgroup v2 directory under the cgroup2 mount, removed on drop.
#[derive(Debug)]
pub struct TestCgroup {
    path: PathBuf,
}

impl TestCgroup {
    /// Creates `<cgroup2 mount>/<unique name>`.
    ///
    /// # Errors
    /// When there is no cgroup2 mount or the directory cannot be made.
    pub fn new(prefix: &str) -> anyhow::Result<Self> {
        let root = meshcap_agent::cgroup::cgroup2_mount()?;
        Self::new_under(&root, prefix)
    }

    /// Creates a child of `parent`.
    ///
    /// # Errors
    /// When the directory cannot be made.
    pub fn new_under(parent: &Path, prefix: &str) -> anyhow::Result<Self> {
        let path = parent.join(unique_name(prefix));
        fs::create_dir(&path).with_context(|| format!("creating cgroup {}", path.display()))?;
        Ok(Self { path })
    }

    /// The cgroup's directory.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// An open directory handle, to attach programs to.
    ///
    /// # Errors
    /// When the directory cannot be opened.
    pub fn open(&self) -> anyhow::Result<File> {
        File::open(&self.path).with_context(|| format!("opening cgroup {}", self.path.display()))
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        // Children first (a test may nest cgroups), then this one. Processes started in it are
        // owned by their `Proc` guards, which kill them; a cgroup with a live member cannot be
        // removed, so retry briefly while they exit.
        for attempt in 0..50 {
            match fs::remove_dir(&self.path) {
                Ok(()) => return,
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => return,
                Err(err) if attempt == 49 => {
                    eprintln!("cleanup: removing cgroup {}: {err}", self.path.display());
                }
                Err(_) => thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}

/// Where and as whom a test process runs: the "pod" it belongs to.
#[derive(Clone, Copy, Debug)]
pub struct Placement<'a> {
    /// Network namespace to enter.
    pub netns: &'a Netns,
    /// cgroup to join (`None`: stay in the test's own).
    pub cgroup: Option<&'a TestCgroup>,
    /// uid to run as.
    pub uid: u32,
    /// gid to run as.
    pub gid: u32,
}

/// A child process, killed (by its pid) and reaped on drop.
#[derive(Debug)]
pub struct Proc {
    child: Child,
}

impl Proc {
    /// Starts `program` in `at`: joins the cgroup, enters the netns, drops to the uid/gid.
    ///
    /// # Errors
    /// When the process cannot be started.
    pub fn spawn(at: Placement<'_>, program: &Path, args: &[&str]) -> anyhow::Result<Self> {
        Self::spawn_with(at, program, args, false)
    }

    /// [`Self::spawn`], keeping `CAP_NET_ADMIN` across the uid change when `net_admin` (as
    /// Envoy has it in TPROXY mode: `IP_TRANSPARENT`, `SO_MARK`).
    ///
    /// # Errors
    /// When the process cannot be started.
    pub fn spawn_with(
        at: Placement<'_>,
        program: &Path,
        args: &[&str],
        net_admin: bool,
    ) -> anyhow::Result<Self> {
        Self::spawn_inner(at, program, args, net_admin, Stdio::null(), None)
    }

    /// [`Self::spawn`] with stdout and stderr appended to `log` (a daemon's log).
    ///
    /// # Errors
    /// When the log cannot be opened or the process cannot be started.
    pub fn spawn_logged(
        at: Placement<'_>,
        program: &Path,
        args: &[&str],
        log: &Path,
    ) -> anyhow::Result<Self> {
        let log = File::options()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("opening {}", log.display()))?;
        Self::spawn_inner(at, program, args, false, Stdio::null(), Some(log))
    }

    fn spawn_inner(
        at: Placement<'_>,
        program: &Path,
        args: &[&str],
        net_admin: bool,
        stdin: Stdio,
        log: Option<File>,
    ) -> anyhow::Result<Self> {
        let netns = File::open(at.netns.path())?;
        let procs = at
            .cgroup
            .map(|cg| {
                File::options()
                    .write(true)
                    .open(cg.path().join("cgroup.procs"))
            })
            .transpose()
            .context("opening cgroup.procs")?;
        let mut cmd = Command::new(program);
        cmd.args(args).stdin(stdin);
        match log {
            Some(log) => cmd.stdout(log.try_clone()?).stderr(log),
            None => cmd.stdout(Stdio::piped()).stderr(Stdio::inherit()),
        };
        let netns_fd = netns.as_raw_fd();
        let procs_fd = procs.as_ref().map(std::os::fd::AsRawFd::as_raw_fd);
        let (uid, gid) = (at.uid, at.gid);
        // std's `uid`/`gid` would drop privileges before `pre_exec` runs, and joining a cgroup
        // or a netns needs them: so all of it happens here, in that order.
        // SAFETY: the closure only makes async-signal-safe syscalls (write, setns, set*id) on
        // values prepared before the fork; it allocates nothing.
        unsafe {
            cmd.pre_exec(move || {
                if let Some(fd) = procs_fd {
                    // "0" moves the writing process itself.
                    if libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                if libc::setns(netns_fd, libc::CLONE_NEWNET) != 0
                    || (net_admin && libc::prctl(libc::PR_SET_KEEPCAPS, 1, 0, 0, 0) != 0)
                    || libc::setgroups(1, &raw const gid) != 0
                    || libc::setgid(gid) != 0
                    || libc::setuid(uid) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                if net_admin {
                    keep_net_admin()?;
                }
                Ok(())
            });
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {}", program.display()))?;
        drop((netns, procs));
        Ok(Self { child })
    }

    /// The process id.
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for the next stdout line (servers print `ready` once listening), a minute at
    /// most: a test waiting for something that never comes fails, naming what it waited for,
    /// rather than hanging.
    ///
    /// # Errors
    /// When the process exits first, or prints no line within a minute.
    pub fn wait_line(&mut self) -> anyhow::Result<String> {
        use std::os::fd::AsFd as _;
        let stdout = self.child.stdout.as_mut().context("stdout not piped")?;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let mut line = Vec::new();
        let mut byte = [0u8; 1];
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let left =
                nix::poll::PollTimeout::try_from(left).unwrap_or(nix::poll::PollTimeout::MAX);
            let mut fds = [nix::poll::PollFd::new(
                stdout.as_fd(),
                nix::poll::PollFlags::POLLIN,
            )];
            if nix::poll::poll(&mut fds, left)? == 0 {
                bail!(
                    "no line within a minute (so far: {:?})",
                    String::from_utf8_lossy(&line)
                );
            }
            let n = stdout.read(&mut byte)?;
            if n == 0 {
                bail!("process exited before printing a line");
            }
            if byte[0] == b'\n' {
                return Ok(String::from_utf8_lossy(&line).into_owned());
            }
            line.push(byte[0]);
        }
    }

    /// How the process exited, if it has.
    ///
    /// # Errors
    /// When its status cannot be read.
    pub fn exited(&mut self) -> std::io::Result<Option<std::process::ExitStatus>> {
        self.child.try_wait()
    }

    /// Waits for the process to exit and returns its whole stdout.
    ///
    /// # Errors
    /// When it exits non-zero.
    pub fn finish(mut self) -> anyhow::Result<String> {
        let mut out = String::new();
        if let Some(stdout) = self.child.stdout.as_mut() {
            BufReader::new(stdout).read_to_string(&mut out)?;
        }
        let status = self.child.wait()?;
        ensure!(status.success(), "process failed ({status}); stdout: {out}");
        Ok(out)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            // Our own child, by its pid.
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// `CAP_NET_ADMIN`.
const CAP_NET_ADMIN: u32 = 12;

/// Makes `CAP_NET_ADMIN` effective and ambient (it then survives `execve` as a non-root uid).
/// Async-signal-safe: raw syscalls on stack values only.
fn keep_net_admin() -> std::io::Result<()> {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let mut header = Header {
        version: 0x2008_0522,
        pid: 0,
    };
    let bit = 1 << CAP_NET_ADMIN;
    let data = [
        Data {
            effective: bit,
            permitted: bit,
            inheritable: bit,
        },
        Data {
            effective: 0,
            permitted: 0,
            inheritable: 0,
        },
    ];
    // SAFETY: capset with a v3 header and two data words, as the syscall expects; prctl with
    // integer arguments.
    let ok = unsafe {
        libc::syscall(libc::SYS_capset, &raw mut header, data.as_ptr()) == 0
            && libc::prctl(
                libc::PR_CAP_AMBIENT,
                libc::PR_CAP_AMBIENT_RAISE,
                libc::c_ulong::from(CAP_NET_ADMIN),
                0,
                0,
            ) == 0
    };
    if ok {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// What the stand-in Envoy (or a plain upstream server) reports for each connection it
/// accepts or datagram it receives.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report {
    /// The server's name (`--name`): `envoy` for the stand-in proxy, anything for upstreams.
    pub server: String,
    /// `tcp` or `udp`.
    pub proto: String,
    /// The port of the listening socket that took the connection.
    pub listener: u16,
    /// The accepted socket's local address.
    pub local: SocketAddr,
    /// The client's address as the server sees it.
    pub peer: SocketAddr,
    /// `getsockopt(SO_ORIGINAL_DST)` on the accepted socket, when it answered.
    pub original_dst: Option<SocketAddr>,
    /// The app's own socket's address (`getsockname`), as `meshcap-dial` adds it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub app_local: Option<SocketAddr>,
    /// The app's socket's peer (`getpeername`; for unconnected UDP, the reply's source), as
    /// `meshcap-dial` adds it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub app_peer: Option<SocketAddr>,
    /// The proxies' reports of the connections that carried this one to the server, the
    /// app's side first (the stand-in ztunnel's HBONE: the outbound listener's, then the
    /// far pod's 15008 listener's).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub via: Vec<Report>,
}

/// Paths of the harness's helper binaries, built with this crate into the same target
/// directory as the test executables (`target/<profile>/`, tests run from its `deps/`).
pub mod bin {
    use std::path::PathBuf;

    fn sibling(name: &str) -> PathBuf {
        let exe = std::env::current_exe().unwrap_or_default();
        let dir = exe.parent().unwrap_or(std::path::Path::new("."));
        let up = dir.parent().map(|p| p.join(name)).filter(|p| p.exists());
        up.unwrap_or_else(|| dir.join(name))
    }

    /// The stand-in Envoy / upstream server.
    #[must_use]
    pub fn standin() -> PathBuf {
        sibling("meshcap-standin")
    }

    /// The dialing client.
    #[must_use]
    pub fn dial() -> PathBuf {
        sibling("meshcap-dial")
    }

    /// The stand-in ztunnel.
    #[must_use]
    pub fn ztunnel() -> PathBuf {
        sibling("meshcap-ztunnel")
    }

    /// Both ends of one TCP stream, for the stream edge cases.
    #[must_use]
    pub fn stream() -> PathBuf {
        sibling("meshcap-stream")
    }
}

/// `meshcap-standin`'s options for a stand-in Envoy: its listeners have `SO_REUSEPORT`, as
/// Envoy's do (a listener's `enable_reuse_port`, true by default on Linux, and Istio leaves it
/// so): what `bpf_sk_assign` refused before Linux 6.5.
pub const ENVOY_OPTIONS: &[&str] = &["--reuseport"];

/// Starts a stand-in server in `at`, listening on every `(proto, address)` given (e.g.
/// `tcp:0.0.0.0:15001`), and waits until it is ready.
///
/// # Errors
/// When it cannot start or bind.
pub fn start_server(at: Placement<'_>, name: &str, listen: &[&str]) -> anyhow::Result<Proc> {
    start_server_with(at, name, listen, &[])
}

/// [`start_server`] with more of `meshcap-standin`'s options (`--reuseport`, `--mark N`).
///
/// # Errors
/// As [`start_server`].
pub fn start_server_with(
    at: Placement<'_>,
    name: &str,
    listen: &[&str],
    options: &[&str],
) -> anyhow::Result<Proc> {
    let mut args = vec!["--name", name];
    args.extend_from_slice(options);
    for l in listen {
        args.extend_from_slice(&["--listen", l]);
    }
    let net_admin = listen.iter().any(|l| l.ends_with("+transparent"));
    let mut proc = Proc::spawn_with(at, &bin::standin(), &args, net_admin)?;
    let line = proc.wait_line()?;
    ensure!(
        line == "ready",
        "stand-in server said {line:?} instead of ready"
    );
    Ok(proc)
}

/// Dials `target` (`tcp:ADDR:PORT` or `udp:ADDR:PORT`) from `at` and returns what answered,
/// or `None` when nothing did (refused, timed out).
///
/// # Errors
/// When the client cannot run or prints garbage.
pub fn dial(at: Placement<'_>, target: &str, bind: Option<&str>) -> anyhow::Result<Option<Report>> {
    match bind {
        Some(bind) => dial_with(at, target, &["--bind", bind]),
        None => dial_with(at, target, &[]),
    }
}

/// [`dial`] with more of `meshcap-dial`'s options (`--bind ADDR`, `--mark N`).
///
/// # Errors
/// When the client cannot run or prints garbage.
pub fn dial_with(
    at: Placement<'_>,
    target: &str,
    options: &[&str],
) -> anyhow::Result<Option<Report>> {
    let mut args = vec![target];
    args.extend_from_slice(options);
    let out = Proc::spawn(at, &bin::dial(), &args)?.finish()?;
    let line = out.trim();
    if line.starts_with("no-answer") {
        return Ok(None);
    }
    serde_json::from_str(line)
        .map(Some)
        .with_context(|| format!("dial printed {line:?}"))
}

/// Dials `target` from `at` expecting nothing to answer: how the client failed, as
/// `std::io::ErrorKind` names it (`ConnectionRefused`: a reset or an ICMP error; `TimedOut`:
/// the SYN went unanswered for `meshcap-dial`'s timeout).
///
/// # Errors
/// When the client cannot run, or something answered.
pub fn dial_failure(at: Placement<'_>, target: &str) -> anyhow::Result<String> {
    let out = Proc::spawn(at, &bin::dial(), &[target])?.finish()?;
    let line = out.trim();
    let why = line
        .strip_prefix("no-answer: ")
        .with_context(|| format!("{target} answered: {line}"))?;
    Ok(why.split(':').next().unwrap_or_default().to_owned())
}

/// Dials `target` (`tcp:ADDR:PORT`) from `at` with `meshcap-dial --after-close`: reads the
/// answer and until the server closes its end, runs `closed` (the test waits there for what
/// the close does), and only then asks the app's socket for its addresses.
///
/// # Errors
/// When the client cannot run, nothing answers or the server never closes.
pub fn dial_after_close(
    at: Placement<'_>,
    target: &str,
    closed: impl FnOnce(),
) -> anyhow::Result<Report> {
    dial_after_close_with(at, target, &[], closed)
}

/// [`dial_after_close`] with more of `meshcap-dial`'s options (`--bind ADDR:PORT`).
///
/// # Errors
/// As [`dial_after_close`].
pub fn dial_after_close_with(
    at: Placement<'_>,
    target: &str,
    options: &[&str],
    closed: impl FnOnce(),
) -> anyhow::Result<Report> {
    use std::io::Write as _;
    let mut args = vec![target, "--after-close"];
    args.extend_from_slice(options);
    let mut proc = Proc::spawn_inner(at, &bin::dial(), &args, false, Stdio::piped(), None)?;
    let line = proc.wait_line()?;
    ensure!(line == "closed", "dial said {line:?} instead of closed");
    closed();
    let stdin = proc.child.stdin.as_mut().context("stdin not piped")?;
    writeln!(stdin)?;
    stdin.flush()?;
    let line = proc.wait_line()?;
    serde_json::from_str(&line).with_context(|| format!("dial printed {line:?}"))
}

/// A long-lived TCP connection from a pod process (`meshcap-dial --hold`), to a stand-in
/// listener in hold mode (`tcp:ADDR:PORT+hold`). The client exits when this is dropped.
#[derive(Debug)]
pub struct Held {
    proc: Proc,
    first: Report,
}

impl Held {
    /// Connects from `at` to `target` and reads the first answer.
    ///
    /// # Errors
    /// When the client cannot run or nothing answers.
    pub fn connect(at: Placement<'_>, target: SocketAddr) -> anyhow::Result<Self> {
        let target = format!("tcp:{target}");
        let mut proc = Proc::spawn_inner(
            at,
            &bin::dial(),
            &[target.as_str(), "--hold"],
            false,
            Stdio::piped(),
            None,
        )?;
        let line = proc.wait_line()?;
        let first = serde_json::from_str(&line).with_context(|| format!("dial said {line:?}"))?;
        Ok(Self { proc, first })
    }

    /// The report of the connection's first answer.
    #[must_use]
    pub const fn first(&self) -> &Report {
        &self.first
    }

    /// Sends `line` on the connection and returns the server's fresh report, checking the
    /// line came back.
    ///
    /// # Errors
    /// When the exchange fails.
    pub fn exchange(&mut self, line: &str) -> anyhow::Result<Report> {
        use std::io::Write as _;
        let stdin = self.proc.child.stdin.as_mut().context("stdin not piped")?;
        writeln!(stdin, "{line}")?;
        stdin.flush()?;
        let answer = self.proc.wait_line()?;
        let report = answer
            .strip_prefix(line)
            .and_then(|rest| rest.strip_prefix(' '))
            .with_context(|| format!("sent {line:?}, the connection answered {answer:?}"))?;
        serde_json::from_str(report).with_context(|| format!("answer {answer:?}"))
    }
}
