//! Pod set-up and the agent's footprint: a running `meshcap-agent` per backend, and the real
//! `meshcap-cni` binary invoked as kubelet does (CNI environment, configuration on stdin) for
//! ADD and DEL of many pods, each with its own network namespace.
use std::{
    fs,
    io::Write as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, ensure};
use meshcap_tests::{
    Netns, TestCgroup,
    agent::{self, Backend},
    fixtures::{ManifestDir, ambient_pod, sidecar_pod},
    kubelet::{self, Sandbox, config},
};

use crate::stats::Samples;

/// The address every benchmark pod has unless it says otherwise (`eth0`, as [`pod_netns`]
/// makes it).
///
/// [`pod_netns`]: crate::pods::pod_netns
const POD_IP: &str = "10.0.0.2";

/// What one backend's run measured.
pub struct SetupResult {
    /// The backend measured.
    pub backend: Backend,
    /// Why the backend could not be measured.
    pub unavailable: Option<String>,
    /// ADD start-to-exit, ms, in pod order.
    pub add_ms: Vec<f64>,
    /// DEL start-to-exit, ms.
    pub del_ms: Vec<f64>,
    /// Agent VmRSS (KiB): idle, then after each count of captured pods in `rss_at`.
    pub rss_kib: Vec<(usize, u64)>,
}

impl SetupResult {
    /// p50 and p99 of the first `n` samples, ms.
    pub fn percentiles(samples: &[f64], n: usize) -> (f64, f64) {
        let mut v: Vec<f64> = samples.iter().take(n).copied().collect();
        v.sort_by(f64::total_cmp);
        if v.is_empty() {
            return (0.0, 0.0);
        }
        let p99 = v[(v.len() * 99).div_ceil(100).max(1) - 1];
        (Samples(v).median(), p99)
    }
}

/// Pod network namespaces as a CNI plugin leaves them: `lo`, and `eth0` (veth) with
/// 10.0.0.2/24. Created once and shared by every backend (each DEL leaves them clean).
pub fn sandboxes(n: usize) -> anyhow::Result<Vec<Netns>> {
    (0..n)
        .map(|_| {
            let ns = Netns::new("mcb-sb")?;
            let mut ip = Command::new("ip")
                .args(["-n", ns.name(), "-batch", "-"])
                .stdin(Stdio::piped())
                .spawn()?;
            ip.stdin.take().context("stdin")?.write_all(
                b"link add eth0 type veth peer name peer0\naddr add 10.0.0.2/24 dev eth0\n\
                  link set eth0 up\nlink set peer0 up\n",
            )?;
            ensure!(ip.wait()?.success(), "ip -batch in {}", ns.name());
            Ok(ns)
        })
        .collect()
}

/// A running agent ([`meshcap_tests::agent::Agent`]: throwaway socket, state and bpffs
/// directories, all removed when it drops) learning pods from a manifest directory.
pub struct Agent {
    agent: agent::Agent,
    pods: ManifestDir,
    /// The `meshcap-cni` of the agent's build.
    plugin: PathBuf,
}

impl Agent {
    /// Starts `meshcap-agent run --pods dir --backend <backend>`, attaching (eBPF) to
    /// `cgroup_root`, and waits until it is ready. The binaries come from `MESHCAP_BIN_DIR`
    /// (`cargo xtask bench` sets it to the release build).
    ///
    /// # Errors
    /// When it exits first (e.g. the backend is not available), with its last log line.
    pub fn start(backend: Backend, cgroup_root: &Path) -> anyhow::Result<Self> {
        Self::start_with(agent::binaries(), backend, cgroup_root, &[])
    }

    /// [`Self::start`] with the `meshcap-agent` and `meshcap-cni` of `bin_dir` (the A/B
    /// baseline's build).
    ///
    /// # Errors
    /// As [`Self::start`].
    pub fn start_from(
        bin_dir: &Path,
        backend: Backend,
        cgroup_root: &Path,
    ) -> anyhow::Result<Self> {
        Self::start_with(bin_dir, backend, cgroup_root, &[])
    }

    /// [`Self::start`] (eBPF) with every captured inbound connection handed to the proxy
    /// through the socket lookup (`--handoff always`, benchmarks only).
    ///
    /// # Errors
    /// As [`Self::start`].
    pub fn start_handoff(cgroup_root: &Path) -> anyhow::Result<Self> {
        Self::start_with(
            agent::binaries(),
            Backend::Ebpf,
            cgroup_root,
            &[("MESHCAP_HANDOFF", "always")],
        )
    }

    /// [`Self::start`] with ambient mode on: ztunnel's socket at `ztunnel`, the node's probe
    /// rule in `node` (a throwaway netns), enrolled pods captured in the kernel when
    /// `in_kernel` (`ambient.inKernel`).
    ///
    /// # Errors
    /// As [`Self::start`].
    pub fn start_ambient(
        bin_dir: &Path,
        backend: Backend,
        cgroup_root: &Path,
        ztunnel: &Path,
        node: &Netns,
        in_kernel: bool,
    ) -> anyhow::Result<Self> {
        let socket = ztunnel.to_str().context("ztunnel socket path")?;
        let node = node.path();
        let node = node.to_str().context("node netns path")?;
        Self::start_with(
            bin_dir,
            backend,
            cgroup_root,
            &[
                ("MESHCAP_AMBIENT_ENABLED", "true"),
                (
                    "MESHCAP_AMBIENT_IN_KERNEL",
                    if in_kernel { "true" } else { "false" },
                ),
                ("MESHCAP_ZTUNNEL_SOCKET", socket),
                ("MESHCAP_NODE_NETNS", node),
            ],
        )
    }

    fn start_with(
        bin_dir: &Path,
        backend: Backend,
        cgroup_root: &Path,
        env: &[(&str, &str)],
    ) -> anyhow::Result<Self> {
        let pods = ManifestDir::new();
        let pod_dir = pods.0.to_str().context("pod directory path")?;
        // Warnings only: an info line per ADD is not what is being measured.
        let mut env = env.to_vec();
        env.push(("RUST_LOG", "warn"));
        let agent = agent::Agent::start_from(
            bin_dir,
            backend,
            &["--pods", "dir", "--pod-dir", pod_dir],
            &env,
            Some(cgroup_root),
        )
        .map_err(|err| {
            let err = format!("{err:#}");
            let last = err
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("");
            let last = strip_ansi(last);
            // Drop the timestamp and level: keep the agent's message.
            let last = last
                .split_once("meshcap_agent: ")
                .map_or(last.trim(), |(_, msg)| msg.trim())
                .to_owned();
            anyhow::anyhow!("the agent did not start: {last}")
        })?;
        Ok(Self {
            agent,
            pods,
            plugin: bin_dir.join("meshcap-cni"),
        })
    }

    /// Captures a default injected pod named `name` (with `excludes` as
    /// excludeOutboundIPRanges) in `netns` through the plugin; returns the ADD's wall time, ms.
    ///
    /// # Errors
    /// When the ADD fails.
    pub fn add(&self, netns: &Netns, name: &str, excludes: &[String]) -> anyhow::Result<f64> {
        let joined = excludes.join(",");
        let annotations: &[(&str, &str)] = if excludes.is_empty() {
            &[]
        } else {
            &[("traffic.sidecar.istio.io/excludeOutboundIPRanges", &joined)]
        };
        // The manifest is in the directory only while its ADD looks it up: the directory
        // source reads every file on a lookup, a cost the Kubernetes source (a watch cache)
        // does not have.
        let manifest = self.pods.0.join(format!("{name}.json"));
        fs::write(
            &manifest,
            sidecar_pod("bench", name, annotations).to_string(),
        )?;
        let took = self.cni("ADD", netns, name, POD_IP);
        fs::remove_file(&manifest)?;
        took
    }

    /// Enrolls a pod named `name`, labelled `istio.io/dataplane-mode=ambient`, in `netns`
    /// through the plugin (the agent hands it to ztunnel); returns the ADD's wall time, ms.
    ///
    /// # Errors
    /// When the ADD fails.
    pub fn add_ambient(&self, netns: &Netns, name: &str) -> anyhow::Result<f64> {
        self.add_ambient_at(netns, name, POD_IP)
    }

    /// [`Self::add_ambient`] for a pod whose address (the primary plugin's result) is `ip`.
    ///
    /// # Errors
    /// When the ADD fails.
    pub fn add_ambient_at(&self, netns: &Netns, name: &str, ip: &str) -> anyhow::Result<f64> {
        let manifest = self.pods.0.join(format!("{name}.json"));
        fs::write(&manifest, ambient_pod("bench", name).to_string())?;
        let took = self.cni("ADD", netns, name, ip);
        fs::remove_file(&manifest)?;
        took
    }

    /// DELs pod `name`; returns the wall time, ms.
    ///
    /// # Errors
    /// When the DEL fails.
    pub fn del(&self, netns: &Netns, name: &str) -> anyhow::Result<f64> {
        self.cni("DEL", netns, name, POD_IP)
    }

    /// Runs `meshcap-cni` as kubelet does, the primary plugin having given the pod `ip`, and
    /// returns its wall time (spawn to exit), ms.
    fn cni(&self, command: &str, netns: &Netns, name: &str, ip: &str) -> anyhow::Result<f64> {
        let conf = config("1.1.0", &self.agent.socket, ip);
        // One container id per pod, as kubelet passes the same CNI_CONTAINERID to a
        // sandbox's ADD and DEL.
        let sandbox = Sandbox {
            container_id: format!("sandbox-{name}"),
            ..Sandbox::new("bench", name, netns)
        };
        let start = Instant::now();
        let out = kubelet::cni_with(&self.plugin, command, &sandbox, &conf)?;
        let took = start.elapsed().as_secs_f64() * 1e3;
        ensure!(
            out.success,
            "meshcap-cni {command} of bench/{name}: {}",
            out.msg()
        );
        Ok(took)
    }

    /// The eBPF agent's bpffs directory (maps pinned under `maps/`); `None` for iptables.
    pub fn bpffs(&self) -> Option<PathBuf> {
        self.agent.ebpf_config().map(|config| config.bpffs_dir)
    }

    /// The agent's pid.
    pub fn pid(&self) -> u32 {
        self.agent.pid()
    }

    fn rss_kib(&self) -> u64 {
        fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    }
}

/// The text of a coloured log line.
fn strip_ansi(line: &str) -> String {
    let mut out = String::new();
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// ADD every sandbox's pod, then DEL them all, through a running agent with `backend`; the
/// agent's RSS idle and after each count in `rss_at`.
pub fn run(backend: Backend, pods: &[Netns], rss_at: &[usize]) -> SetupResult {
    let mut result = SetupResult {
        backend,
        unavailable: None,
        add_ms: Vec::new(),
        del_ms: Vec::new(),
        rss_kib: Vec::new(),
    };
    if let Err(err) = measure(pods, rss_at, &mut result) {
        result.unavailable = Some(format!("{err:#}"));
    }
    result
}

/// Where the busy work runs, beside the runtime and the agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Busy {
    /// In a CPU cgroup of its own, as kubelet places every pod: the scheduler shares the CPUs
    /// between it and the rest fairly, as on a node.
    OwnCgroup,
    /// In the runtime's own scheduling group: every spinner competes with the plugin and the
    /// agent one for one (the worst case).
    SameGroup,
}

/// [`run`] with the machine kept busy: a `meshcap-bench spin` process with `spinners` threads
/// burning CPU at normal priority for the whole run, placed as `busy` says (on 2 CPUs, 4
/// spinners hold the load average near 4).
pub fn run_busy(backend: Backend, pods: &[Netns], spinners: usize, busy: Busy) -> SetupResult {
    let spun = Spinners::start(spinners, busy);
    match spun {
        Ok(_spinners) => run(backend, pods, &[]),
        Err(err) => SetupResult {
            backend,
            unavailable: Some(format!("{err:#}")),
            add_ms: Vec::new(),
            del_ms: Vec::new(),
            rss_kib: Vec::new(),
        },
    }
}

/// The spinning process, and the CPU cgroup it was moved to; both go on drop.
struct Spinners {
    child: std::process::Child,
    cgroup: Option<PathBuf>,
}

impl Spinners {
    fn start(threads: usize, busy: Busy) -> anyhow::Result<Self> {
        let exe = std::env::current_exe().context("locating meshcap-bench")?;
        let child = Command::new(exe)
            .args(["spin", "--threads", &threads.to_string()])
            .stdin(Stdio::null())
            .spawn()
            .context("starting meshcap-bench spin")?;
        let mut spinners = Self {
            child,
            cgroup: None,
        };
        if busy == Busy::OwnCgroup {
            let root = cpu_cgroup_root()?;
            let dir = root.join(format!("mcb-busy-{}", spinners.child.id()));
            fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
            spinners.cgroup = Some(dir.clone());
            fs::write(dir.join("cgroup.procs"), spinners.child.id().to_string())
                .with_context(|| format!("moving the spinners into {}", dir.display()))?;
        }
        Ok(spinners)
    }
}

impl Drop for Spinners {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(dir) = &self.cgroup {
            let _ = fs::remove_dir(dir);
        }
    }
}

/// A hierarchy with the CPU controller: cgroup v1's `cpu`, or a v2 root that offers `cpu` to
/// its children.
fn cpu_cgroup_root() -> anyhow::Result<PathBuf> {
    let v1 = Path::new("/sys/fs/cgroup/cpu");
    if v1.join("cpu.shares").exists() {
        return Ok(v1.to_owned());
    }
    let v2 = Path::new("/sys/fs/cgroup");
    let offered = fs::read_to_string(v2.join("cgroup.subtree_control")).unwrap_or_default();
    ensure!(
        offered.split_whitespace().any(|c| c == "cpu"),
        "no cgroup hierarchy with the cpu controller (neither {} nor {} offering cpu)",
        v1.display(),
        v2.display()
    );
    Ok(v2.to_owned())
}

/// `meshcap-bench spin`: `threads` threads spinning until the process is killed, or its parent
/// dies (a benchmark killed part-way leaves nothing spinning).
pub fn spin(threads: usize) -> ! {
    // SAFETY: PR_SET_PDEATHSIG takes a signal number; no pointers are involved.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    for _ in 1..threads {
        thread::spawn(|| {
            loop {
                std::hint::spin_loop();
            }
        });
    }
    loop {
        std::hint::spin_loop();
    }
}

fn measure(pods: &[Netns], rss_at: &[usize], result: &mut SetupResult) -> anyhow::Result<()> {
    let cgroup = TestCgroup::new("mcb-agent")?;
    let agent = Agent::start(result.backend, cgroup.path())?;
    // Let start-up settle (program loads, first allocations) before calling it idle.
    thread::sleep(Duration::from_millis(500));
    result.rss_kib.push((0, agent.rss_kib()));
    for (i, netns) in pods.iter().enumerate() {
        result
            .add_ms
            .push(agent.add(netns, &format!("pod-{i}"), &[])?);
        if rss_at.contains(&(i + 1)) {
            result.rss_kib.push((i + 1, agent.rss_kib()));
        }
    }
    for (i, netns) in pods.iter().enumerate() {
        result.del_ms.push(agent.del(netns, &format!("pod-{i}"))?);
    }
    Ok(())
}
