//! Pod set-up and the agent's footprint: a running `meshcap-agent` per backend, and the real
//! `meshcap-cni` binary invoked as kubelet does (CNI environment, configuration on stdin) for
//! ADD and DEL of many pods, each with its own network namespace.
use std::{
    fs,
    io::Write as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail, ensure};
use meshcap_tests::{
    Netns, TestCgroup,
    agent::{config, sidecar_pod},
    unique_name,
};

use crate::stats::Samples;

/// What one backend's run measured.
pub struct SetupResult {
    /// `iptables` or `ebpf`.
    pub backend: &'static str,
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

/// A running agent and its throwaway directories, stopped (SIGTERM, by pid) on drop; the
/// bpffs directory goes with it, which detaches everything it attached.
pub struct Agent {
    child: Child,
    dir: PathBuf,
    bpffs: PathBuf,
    socket: PathBuf,
    log: PathBuf,
    plugin: PathBuf,
}

impl Agent {
    /// Starts `meshcap-agent run --pods dir --backend <backend>`, attaching (eBPF) to
    /// `cgroup_root`, and waits for its socket.
    ///
    /// # Errors
    /// When it exits first (e.g. the backend is not available), with its last log line.
    pub fn start(bin_dir: &Path, backend: &str, cgroup_root: &Path) -> anyhow::Result<Self> {
        let dir = std::env::temp_dir().join(unique_name("mcb-agent"));
        fs::create_dir_all(dir.join("pods"))?;
        let bpffs = Path::new("/sys/fs/bpf").join(unique_name("mcb"));
        let socket = dir.join("agent.sock");
        let log = dir.join("agent.log");
        let http = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
        let child = Command::new(bin_dir.join("meshcap-agent"))
            .arg("run")
            .args(["--pods", "dir", "--pod-dir"])
            .arg(dir.join("pods"))
            .args(["--backend", backend, "--socket"])
            .arg(&socket)
            .arg("--state-dir")
            .arg(dir.join("state"))
            .arg("--cgroup-root")
            .arg(cgroup_root)
            .arg("--bpffs-dir")
            .arg(&bpffs)
            .args(["--http-listen", &http.to_string()])
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(fs::File::create(&log)?)
            .stderr(fs::File::create(&log)?.try_clone()?)
            .spawn()
            .context("starting meshcap-agent")?;
        let mut agent = Self {
            child,
            dir,
            bpffs,
            socket,
            log,
            plugin: bin_dir.join("meshcap-cni"),
        };
        for _ in 0..400 {
            if let Some(status) = agent.child.try_wait()? {
                let log = fs::read_to_string(&agent.log).unwrap_or_default();
                let last = strip_ansi(log.lines().last().unwrap_or(""));
                // Drop the timestamp and level: keep the agent's message.
                let last = last
                    .split_once("meshcap_agent: ")
                    .map_or(last.trim(), |(_, msg)| msg.trim());
                bail!("the agent exited ({status}): {last}");
            }
            if agent.socket.exists() {
                return Ok(agent);
            }
            thread::sleep(Duration::from_millis(25));
        }
        bail!("the agent did not open its socket within 10 s")
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
        let manifest = self.dir.join("pods").join(format!("{name}.json"));
        fs::write(
            &manifest,
            sidecar_pod("bench", name, annotations).to_string(),
        )?;
        let took = cni(&self.plugin, "ADD", netns, name, self.conf().as_bytes());
        fs::remove_file(&manifest)?;
        took
    }

    /// DELs pod `name`; returns the wall time, ms.
    ///
    /// # Errors
    /// When the DEL fails.
    pub fn del(&self, netns: &Netns, name: &str) -> anyhow::Result<f64> {
        cni(&self.plugin, "DEL", netns, name, self.conf().as_bytes())
    }

    fn conf(&self) -> String {
        config("1.1.0", &self.socket, "10.0.0.2").to_string()
    }

    /// The agent's bpffs directory (maps pinned under `maps/`).
    pub fn bpffs(&self) -> &Path {
        &self.bpffs
    }

    /// The agent's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    fn rss_kib(&self) -> u64 {
        fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Ok(pid) = i32::try_from(self.child.id()) {
            // Our own child, by its pid.
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
        for _ in 0..100 {
            if !matches!(self.child.try_wait(), Ok(None)) {
                break;
            }
            thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = fs::remove_dir_all(&self.dir);
        let _ = fs::remove_dir_all(&self.bpffs);
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

/// Runs `meshcap-cni` as kubelet does and returns its wall time (spawn to exit), ms.
fn cni(
    plugin: &Path,
    command: &str,
    netns: &Netns,
    name: &str,
    conf: &[u8],
) -> anyhow::Result<f64> {
    let start = Instant::now();
    let mut child = Command::new(plugin)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", format!("sandbox-{name}"))
        .env("CNI_NETNS", netns.path())
        .env("CNI_IFNAME", "eth0")
        .env("CNI_PATH", "/opt/cni/bin")
        .env(
            "CNI_ARGS",
            format!(
                "IgnoreUnknown=1;K8S_POD_NAMESPACE=bench;K8S_POD_NAME={name};\
                 K8S_POD_INFRA_CONTAINER_ID=sandbox-{name}"
            ),
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context("starting meshcap-cni")?;
    child.stdin.take().context("stdin")?.write_all(conf)?;
    let out = child.wait_with_output()?;
    let took = start.elapsed().as_secs_f64() * 1e3;
    ensure!(
        out.status.success(),
        "meshcap-cni {command} of bench/{name}: {}",
        String::from_utf8_lossy(&out.stdout).trim()
    );
    Ok(took)
}

/// ADD every sandbox's pod, then DEL them all, through a running agent with `backend`; the
/// agent's RSS idle and after each count in `rss_at`.
pub fn run(bin_dir: &Path, backend: &'static str, pods: &[Netns], rss_at: &[usize]) -> SetupResult {
    let mut result = SetupResult {
        backend,
        unavailable: None,
        add_ms: Vec::new(),
        del_ms: Vec::new(),
        rss_kib: Vec::new(),
    };
    if let Err(err) = measure(bin_dir, pods, rss_at, &mut result) {
        result.unavailable = Some(format!("{err:#}"));
    }
    result
}

fn measure(
    bin_dir: &Path,
    pods: &[Netns],
    rss_at: &[usize],
    result: &mut SetupResult,
) -> anyhow::Result<()> {
    let cgroup = TestCgroup::new("mcb-agent")?;
    let agent = Agent::start(bin_dir, result.backend, cgroup.path())?;
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
