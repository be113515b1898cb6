//! A running `meshcap-agent` with throwaway socket, state, cgroup and bpffs directories, and
//! the binaries the end-to-end tests run.
use std::{
    io::Write as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{Arc, OnceLock},
    thread,
    time::Duration,
};

use anyhow::{Context as _, bail};
use meshcap_agent::backend::ebpf::{EbpfBackend, EbpfConfig, Handoff, TcAttach, layout};

/// The agent's (hidden) setting forcing how pods' inbound stubs attach: `tcx` tests the TCX
/// path (the default is netlink TC on every kernel).
pub const TC_ATTACH_ENV: &str = "MESHCAP_TC_ATTACH";

/// The [`TC_ATTACH_ENV`] setting forcing TCX where the kernel has it
/// ([`crate::scenario::tcx_where_supported`]).
#[must_use]
pub fn tcx_env() -> (&'static str, &'static str) {
    match crate::scenario::tcx_where_supported() {
        TcAttach::Tcx => (TC_ATTACH_ENV, "tcx"),
        TcAttach::Netlink => (TC_ATTACH_ENV, "netlink"),
    }
}

use crate::{TestCgroup, kubelet::KubeletProcess, scenario::EbpfUnderTest, unique_name};

/// Builds `meshcap-agent` and `meshcap-cni` once per test process (cargo does not build
/// another package's binaries for this crate's tests) and returns the directory holding them.
///
/// # Panics
/// When cargo fails.
#[must_use]
pub fn binaries() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        // Prebuilt binaries (`cargo xtask integration` runs the tests in a VM without cargo).
        if let Some(dir) = std::env::var_os("MESHCAP_BIN_DIR") {
            return PathBuf::from(dir);
        }
        let exe = std::env::current_exe().expect("test executable path");
        // target/<profile>/deps/<test> (tests) or target/<profile>/<bin> (the demo)
        let mut dir = exe.parent().expect("target directory").to_owned();
        if dir.ends_with("deps") {
            dir.pop();
        }
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.args([
            "build",
            "--quiet",
            "-p",
            "meshcap-agent",
            "-p",
            "meshcap-cni",
        ]);
        if dir.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("running cargo build");
        assert!(
            status.success(),
            "cargo build -p meshcap-agent -p meshcap-cni failed"
        );
        dir
    })
}

/// How long an agent may take to come up: 20 s, or `MESHCAP_AGENT_READY_SECS` seconds.
/// `cargo xtask integration` gives 60: its guests' CPUs are emulated, and an arm64 guest's
/// run the debug agent's start (the programs parsed and through the verifier, then the node's
/// set-up) two to three times slower than an x86 guest's, which is itself many times slower
/// than this host (docs/development.md, "The arm64 guest").
pub fn ready_within() -> Duration {
    let seconds = std::env::var("MESHCAP_AGENT_READY_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    Duration::from_secs(seconds)
}

/// The capture backend an [`Agent`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// `--backend ebpf`, attached to a throwaway cgroup and pinned under a unique bpffs dir.
    Ebpf,
    /// `--backend iptables`.
    Iptables,
    /// `--backend nftables` with `global.nativeNftables` (Istio's native nftables rules, for
    /// ambient pods' in-pod rules too).
    Nftables,
}

impl Backend {
    /// The name the agent uses (`--backend`, metrics labels).
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Ebpf => "ebpf",
            Self::Iptables => "iptables",
            Self::Nftables => "nftables",
        }
    }
}

/// One test per backend for each scenario function `name(backend: Backend)`: a module `name`
/// holding the tests `ebpf` and `iptables` (`cargo test name::ebpf`).
#[macro_export]
macro_rules! test_on_both_backends {
    ($($name:ident),+ $(,)?) => {$(
        mod $name {
            #[test]
            fn ebpf() {
                if $crate::ebpf_runs_here() {
                    super::$name($crate::agent::Backend::Ebpf);
                }
            }

            #[test]
            fn iptables() {
                super::$name($crate::agent::Backend::Iptables);
            }
        }
    )+};
}

/// As [`test_on_both_backends`], with a third test, `nftables`, on Istio's native nftables
/// rules: for the scenarios whose subject is how a rules backend applies, removes and
/// recovers a capture.
#[macro_export]
macro_rules! test_on_every_backend {
    ($($name:ident),+ $(,)?) => {$(
        mod $name {
            #[test]
            fn ebpf() {
                if $crate::ebpf_runs_here() {
                    super::$name($crate::agent::Backend::Ebpf);
                }
            }

            #[test]
            fn iptables() {
                super::$name($crate::agent::Backend::Iptables);
            }

            #[test]
            fn nftables() {
                super::$name($crate::agent::Backend::Nftables);
            }
        }
    )+};
}

/// A running agent with throwaway socket, state, cgroup and bpffs directories. On drop it is
/// stopped (SIGTERM, by pid) and everything it left is removed: the agent itself never
/// uninstalls (captured pods must outlive it), so the eBPF pins and links are removed here.
/// Its stderr goes to a file ([`Self::log`]), printed when the test panics.
pub struct Agent {
    child: Child,
    /// The `meshcap-agent` executable [`Self::restart`] starts.
    exe: PathBuf,
    dir: PathBuf,
    backend: Backend,
    args: Vec<String>,
    env: Vec<(String, String)>,
    cgroup: Option<Arc<TestCgroup>>,
    cgroup_root: Option<PathBuf>,
    bpffs_dir: Option<PathBuf>,
    /// The stand-in kubelet an ambient agent finds (its proc directory in the environment).
    kubelet: Option<Arc<KubeletProcess>>,
    /// The plugin socket.
    pub socket: PathBuf,
    /// The health/metrics endpoint: the agent binds port 0 and [`Self::wait_ready`] reads
    /// the port the kernel gave it off the process's listening socket. Empty until then.
    pub http: String,
}

impl Agent {
    /// Starts `meshcap-agent run --backend <backend>` with `source` (e.g. `--pods dir
    /// --pod-dir X`) and `env`, and waits until its socket exists and it answers /healthz.
    ///
    /// # Errors
    /// When it does not come up.
    pub fn start(backend: Backend, source: &[&str], env: &[(&str, &str)]) -> anyhow::Result<Self> {
        Self::start_in(backend, source, env, None)
    }

    /// As [`Self::start`], but an eBPF agent attaches to `cgroup_root` (a cgroup the caller
    /// owns, e.g. a scenario [`crate::world::Node`]'s) instead of a cgroup of its own;
    /// [`Self::cgroup`] is then `None`.
    ///
    /// # Errors
    /// When it does not come up.
    pub fn start_in(
        backend: Backend,
        source: &[&str],
        env: &[(&str, &str)],
        cgroup_root: Option<&Path>,
    ) -> anyhow::Result<Self> {
        Self::start_from(binaries(), backend, source, env, cgroup_root)
    }

    /// As [`Self::start_in`], with the `meshcap-agent` of `bin_dir` (another build's, say: the
    /// benchmark's baseline).
    ///
    /// # Errors
    /// When it does not come up.
    pub fn start_from(
        bin_dir: &Path,
        backend: Backend,
        source: &[&str],
        env: &[(&str, &str)],
        cgroup_root: Option<&Path>,
    ) -> anyhow::Result<Self> {
        let dir = std::env::temp_dir().join(unique_name("meshcap-agent"));
        std::fs::create_dir_all(&dir)?;
        let started = Self::start_in_dir(dir.clone(), bin_dir, backend, source, env, cgroup_root);
        // An agent that started owns the directory (its drop removes it); one that did not
        // leaves nothing behind.
        if started.is_err() {
            let _ = std::fs::remove_dir_all(&dir);
        }
        started
    }

    fn start_in_dir(
        dir: PathBuf,
        bin_dir: &Path,
        backend: Backend,
        source: &[&str],
        env: &[(&str, &str)],
        cgroup_root: Option<&Path>,
    ) -> anyhow::Result<Self> {
        let socket = dir.join("agent.sock");
        let mut args: Vec<String> = source.iter().map(|s| (*s).to_owned()).collect();
        args.extend(["--backend".into(), backend.name().into()]);
        // Istio's nftables everywhere the rules path is used: ambient pods' in-pod rules too.
        let mut env = env.to_vec();
        if backend == Backend::Nftables {
            env.push(("MESHCAP_NATIVE_NFTABLES", "true"));
        }
        // An ambient agent finds kubelet among the host's processes (with
        // `global.nativeNftables`; any agent, so that a restart flipping it finds it too).
        let ambient = env
            .iter()
            .any(|(k, v)| *k == "MESHCAP_AMBIENT_ENABLED" && v.eq_ignore_ascii_case("true"));
        let kubelet = (ambient && !env.iter().any(|(k, _)| *k == "MESHCAP_HOST_PROC"))
            .then(KubeletProcess::start)
            .transpose()?
            .map(Arc::new);
        let host_proc = kubelet.as_ref().map(|k| k.proc().display().to_string());
        if let Some(host_proc) = &host_proc {
            env.push(("MESHCAP_HOST_PROC", host_proc));
        }
        let env = env.as_slice();
        let (cgroup, cgroup_root, bpffs_dir) = match backend {
            Backend::Ebpf => {
                let (cgroup, root) = match cgroup_root {
                    Some(root) => (None, root.to_owned()),
                    None => {
                        let cgroup = TestCgroup::new("meshcap-agent")?;
                        let root = cgroup.path().to_owned();
                        (Some(Arc::new(cgroup)), root)
                    }
                };
                let bpffs = EbpfUnderTest::unique_dir();
                args.push("--cgroup-root".into());
                args.push(root.display().to_string());
                args.push("--bpffs-dir".into());
                args.push(bpffs.display().to_string());
                (cgroup, Some(root), Some(bpffs))
            }
            Backend::Iptables | Backend::Nftables => (None, None, None),
        };
        let exe = bin_dir.join("meshcap-agent");
        let child = spawn(&exe, &dir, &args, &socket, env)?;
        let mut agent = Self {
            child,
            exe,
            dir,
            backend,
            args,
            env: env
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            cgroup,
            cgroup_root,
            bpffs_dir,
            kubelet,
            socket,
            http: String::new(),
        };
        agent.wait_ready()?;
        Ok(agent)
    }

    /// Starts another agent with this one's arguments and state directory (its own socket
    /// and health endpoint; the same log file), without waiting for it to serve: see
    /// [`Self::wait_ready`].
    ///
    /// # Errors
    /// When it cannot be spawned.
    pub fn spawn_beside(&self) -> anyhow::Result<Self> {
        let socket = self.dir.join("beside.sock");
        let env: Vec<(&str, &str)> = self
            .env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        Ok(Self {
            child: spawn(&self.exe, &self.dir, &self.args, &socket, &env)?,
            exe: self.exe.clone(),
            dir: self.dir.clone(),
            backend: self.backend,
            args: self.args.clone(),
            env: self.env.clone(),
            cgroup: self.cgroup.clone(),
            cgroup_root: self.cgroup_root.clone(),
            bpffs_dir: self.bpffs_dir.clone(),
            kubelet: self.kubelet.clone(),
            socket,
            http: String::new(),
        })
    }

    /// Waits until the agent listens on its socket and answers /healthz.
    ///
    /// # Errors
    /// When it exits first, or does not come up in [`ready_within`].
    pub fn wait_ready(&mut self) -> anyhow::Result<()> {
        let deadline = std::time::Instant::now() + ready_within();
        while std::time::Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "meshcap-agent exited during start-up: {status}\n{}",
                    self.log()
                );
            }
            if self.http.is_empty()
                && let Some(port) = listening_port(self.child.id())
            {
                self.http = format!("127.0.0.1:{port}");
            }
            if listening(&self.socket)
                && !self.http.is_empty()
                && self.http_get("/healthz").is_ok_and(|(code, _)| code == 200)
            {
                return Ok(());
            }
            thread::sleep(Duration::from_millis(50));
        }
        bail!(
            "meshcap-agent did not become ready within {:?}\n{}",
            ready_within(),
            self.log()
        )
    }

    /// The backend it runs.
    #[must_use]
    pub const fn backend(&self) -> Backend {
        self.backend
    }

    /// The process id of the running agent.
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The throwaway cgroup the eBPF backend attaches to (`None` for iptables): the pods'
    /// processes must run in it to be captured. Shared: it is removed when the last holder
    /// lets go.
    #[must_use]
    pub fn cgroup(&self) -> Option<Arc<TestCgroup>> {
        self.cgroup.clone()
    }

    /// The eBPF backend's configuration (`None` for iptables).
    #[must_use]
    pub fn ebpf_config(&self) -> Option<EbpfConfig> {
        Some(EbpfConfig {
            cgroup_root: self.cgroup_root.clone()?,
            bpffs_dir: self.bpffs_dir.clone()?,
            tc_attach: if self
                .env
                .iter()
                .any(|(k, v)| k == TC_ATTACH_ENV && v == "tcx")
            {
                TcAttach::Tcx
            } else {
                TcAttach::default()
            },
            handoff: Handoff::default(),
        })
    }

    /// What the eBPF backend still holds, read from its pins: captured pods and entries of
    /// the per-pod maps. Empty when nothing is captured (and always for iptables).
    ///
    /// # Errors
    /// When the pins cannot be opened.
    pub fn ebpf_leftovers(&self) -> anyhow::Result<Vec<String>> {
        let Some(config) = self.ebpf_config() else {
            return Ok(Vec::new());
        };
        let backend = EbpfBackend::open(config)?;
        let mut out: Vec<String> = backend
            .pinned_pods()
            .into_iter()
            .map(|p| {
                format!(
                    "pinned pod {}/{} (netns cookie {})",
                    p.namespace, p.name, p.netns_cookie
                )
            })
            .collect();
        out.extend(
            backend
                .entry_counts()
                .into_iter()
                .filter(|(_, n)| *n > 0)
                .map(|(map, n)| format!("{n} entries in {map}")),
        );
        Ok(out)
    }

    /// The agent's stderr so far.
    #[must_use]
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("agent.log")).unwrap_or_default()
    }

    /// SIGKILL (by pid), as a crash or an OOM kill would: nothing runs on the way out.
    ///
    /// # Errors
    /// When the process cannot be signalled or reaped.
    pub fn kill(&mut self) -> anyhow::Result<()> {
        signal(&self.child, nix::sys::signal::Signal::SIGKILL)?;
        self.child.wait()?;
        Ok(())
    }

    /// SIGTERM (by pid), as kubelet stops a pod, and waits for the agent to exit.
    ///
    /// # Errors
    /// When the process cannot be signalled or reaped.
    pub fn terminate(&mut self) -> anyhow::Result<std::process::ExitStatus> {
        signal(&self.child, nix::sys::signal::Signal::SIGTERM)?;
        Ok(self.child.wait()?)
    }

    /// Starts the agent again with the same arguments (same socket, state and bpffs
    /// directories), after [`Self::kill`] (or, when it still runs, after SIGTERM), and waits
    /// until it serves.
    ///
    /// # Errors
    /// When it does not come up.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        if self.is_running() {
            self.terminate()?;
        }
        // A killed agent leaves its socket file behind: gone, it cannot pass for the new
        // agent's in `wait_ready` (a request sent to it would find nothing listening, and a
        // DEL would succeed without the agent ever seeing it).
        match std::fs::remove_file(&self.socket) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e.into()),
            _ => {}
        }
        self.spawn_again()?;
        self.wait_ready()
    }

    /// Starts the agent's process again with its executable, arguments, environment and
    /// socket (not waiting for it to serve; its health port is another).
    fn spawn_again(&mut self) -> anyhow::Result<()> {
        let env: Vec<(&str, &str)> = self
            .env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        self.child = spawn(&self.exe, &self.dir, &self.args, &self.socket, &env)?;
        self.http.clear();
        Ok(())
    }

    /// Makes the next [`Self::restart`] start `exe` instead (another build of the agent, as an
    /// upgrade or a rollback does).
    pub fn set_exe(&mut self, exe: &Path) {
        exe.clone_into(&mut self.exe);
    }

    /// Makes the next [`Self::restart`] run `backend` (an operator changing the node's backend
    /// or `global.nativeNftables`).
    pub fn set_backend(&mut self, backend: Backend) {
        if let Some(at) = self.args.iter().position(|a| a == "--backend") {
            self.args[at + 1] = backend.name().to_owned();
        }
        self.set_env(
            "MESHCAP_NATIVE_NFTABLES",
            (backend == Backend::Nftables).then_some("true"),
        );
        self.backend = backend;
    }

    /// Sets (`Some`) or removes (`None`) an environment variable for the next
    /// [`Self::restart`].
    pub fn set_env(&mut self, key: &str, value: Option<&str>) {
        self.env.retain(|(k, _)| k != key);
        if let Some(value) = value {
            self.env.push((key.to_owned(), value.to_owned()));
        }
    }

    /// Waits until the agent process has exited (after it killed itself), at most ~10 s.
    ///
    /// # Errors
    /// When it is still running.
    pub fn wait_exit(&mut self) -> anyhow::Result<std::process::ExitStatus> {
        for _ in 0..200 {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            thread::sleep(Duration::from_millis(50));
        }
        bail!("meshcap-agent still runs\n{}", self.log())
    }

    /// The agent's state directory.
    #[must_use]
    pub fn state_dir(&self) -> PathBuf {
        self.dir.join("state")
    }

    /// `meshcap-agent explain NAMESPACE/POD` against this agent, as text.
    ///
    /// # Panics
    /// When the command does not run or fails.
    #[must_use]
    pub fn explain(&self, pod: &str) -> String {
        let out = Command::new(binaries().join("meshcap-agent"))
            .args(["explain", pod, "--socket"])
            .arg(&self.socket)
            .output()
            .expect("meshcap-agent explain");
        assert!(out.status.success(), "explain: {out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `meshcap-agent status` over its socket, as the report.
    ///
    /// # Errors
    /// When the agent does not answer with a report.
    pub fn status(&self) -> anyhow::Result<meshcap_agent::status::StatusReport> {
        use meshcap_cni::protocol::{Op, Reply, Request};
        let response = meshcap_cni::protocol::call(
            &self.socket,
            &Request::new(Op::Status),
            Duration::from_secs(10),
        )?;
        match response.reply {
            Reply::Ok {
                report: Some(report),
                ..
            } => Ok(serde_json::from_value(report)?),
            other => bail!("status: {other:?}"),
        }
    }

    /// Whether the agent process still runs.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// `GET path` on the health/metrics endpoint: status code and body.
    ///
    /// # Errors
    /// When the endpoint does not answer.
    pub fn http_get(&self, path: &str) -> anyhow::Result<(u16, String)> {
        use std::io::Read as _;
        let mut stream = std::net::TcpStream::connect(&self.http)?;
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
            .context("no status line")?;
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        Ok((code, body))
    }
}

/// Whether a socket listens at `path`: the kernel's list of Unix sockets says so
/// (`/proc/net/unix`, `__SO_ACCEPTCON` in its flags), without connecting to it. The file alone
/// is not enough: it exists from `bind`, and a request sent before the `listen` right after is
/// refused (a test's first request failed so once in CI, on a busy machine).
fn listening(path: &Path) -> bool {
    const ACCEPTING: u32 = 0x0001_0000;
    let Some(path) = path.to_str() else {
        return false;
    };
    std::fs::read_to_string("/proc/net/unix").is_ok_and(|table| {
        table.lines().skip(1).any(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            fields.get(7) == Some(&path)
                && fields
                    .get(3)
                    .and_then(|flags| u32::from_str_radix(flags, 16).ok())
                    .is_some_and(|flags| flags & ACCEPTING != 0)
        })
    })
}

/// The port process `pid` listens on at 127.0.0.1 over TCP: its socket descriptors
/// (`/proc/<pid>/fd`) matched by inode against the kernel's TCP table of the host's network
/// (`/proc/net/tcp`, state `0A`: listening). The agent's one TCP listener is its endpoint.
fn listening_port(pid: u32) -> Option<u16> {
    let inodes: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .ok()?
        .filter_map(|fd| {
            let target = std::fs::read_link(fd.ok()?.path()).ok()?;
            let target = target.to_str()?;
            Some(
                target
                    .strip_prefix("socket:[")?
                    .strip_suffix(']')?
                    .to_owned(),
            )
        })
        .collect();
    let table = std::fs::read_to_string("/proc/net/tcp").ok()?;
    table.lines().skip(1).find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (local, state, inode) = (fields.get(1)?, fields.get(3)?, fields.get(9)?);
        let (address, port) = local.split_once(':')?;
        (*state == "0A" && address == "0100007F" && inodes.iter().any(|i| i == inode))
            .then(|| u16::from_str_radix(port, 16).ok())
            .flatten()
    })
}

fn signal(child: &Child, signal: nix::sys::signal::Signal) -> anyhow::Result<()> {
    let pid = i32::try_from(child.id())?;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), signal)?;
    Ok(())
}

fn spawn(
    exe: &Path,
    dir: &Path,
    args: &[String],
    socket: &Path,
    env: &[(&str, &str)],
) -> anyhow::Result<Child> {
    let set = |key: &str| {
        env.iter()
            .any(|(k, v)| *k == key && !v.is_empty() && !v.eq_ignore_ascii_case("false"))
    };
    if set("MESHCAP_AMBIENT_ENABLED") && !set("MESHCAP_NODE_NETNS") {
        bail!(
            "an ambient agent in a test needs MESHCAP_NODE_NETNS (a throwaway node netns): it \
             writes its probe rule and sets in the node's namespace, which would be the host's"
        );
    }
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("agent.log"))?;
    Command::new(exe)
        .arg("run")
        .args(args)
        .args([
            "--pod-lookup-attempts",
            "3",
            "--pod-lookup-interval-ms",
            "100",
        ])
        .arg("--socket")
        .arg(socket)
        .arg("--state-dir")
        .arg(dir.join("state"))
        // Port 0: the kernel picks a port nothing holds, at the bind itself (a port chosen
        // beforehand can be taken by any process of the host before the agent binds it).
        .args(["--http-listen", "127.0.0.1:0"])
        .env("RUST_LOG", "warn,meshcap_agent=info,meshcap_cni=info")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stderr(log)
        .spawn()
        .context("starting meshcap-agent")
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = signal(&self.child, nix::sys::signal::Signal::SIGTERM);
        for _ in 0..100 {
            if !matches!(self.child.try_wait(), Ok(None)) {
                break;
            }
            thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        if thread::panicking() {
            eprintln!("meshcap-agent's log:\n{}", self.log());
        }
        if let Some(config) = self.ebpf_config() {
            let parent = config.bpffs_dir.parent().map(PathBuf::from);
            // By its pins alone (as `EbpfBackend::uninstall` does once open): the layout may
            // be another build's (an upgrade test's old agent, the benchmark's baseline),
            // whose maps this build's object would not open.
            if config.bpffs_dir.exists()
                && let Err(err) = layout::remove(&config.bpffs_dir)
            {
                eprintln!("cleanup: {err}");
            }
            // The unique parent goes too, also when the test removed the layout itself.
            if let Some(parent) = parent {
                let _ = std::fs::remove_dir(parent);
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
