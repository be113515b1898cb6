//! meshcap's chaos soak, behind `cargo xtask soak`: for a set time, pods are ADDed and DELeted
//! in parallel through the real `meshcap-cni` (DEL once, or twice with an empty `CNI_NETNS` and
//! no `prevResult` as containerd sends it), the captured ones carry new and held connections,
//! and the agent is SIGKILLed and restarted every few seconds. It prints what happened, per
//! backend: connections captured, bypassed and unanswered; held connections broken; ADD and DEL
//! outcomes by code; what each DEL left in its pod's netns and what the agent holds once the
//! last pod is gone; the agent's RSS and open fds over time. A measurement, not a test: the
//! goals (0 bypassed, 0 broken, 0 left) are read from its report (docs/reliability.md).
use std::{
    collections::BTreeMap,
    fmt::Write as _,
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU32, Ordering},
    },
    thread,
    time::{Duration, Instant, SystemTime},
};

use anyhow::Context as _;
use clap::Parser;
use meshcap_tests::{
    APP_UID, Held,
    agent::{Agent, Backend},
    dial,
    fixtures::{ManifestDir, leftovers, sidecar_pod, write_manifest},
    kubelet::{Sandbox, cni, config},
    wired::Wired,
};
use serde_json::Value;

#[derive(Parser)]
#[command(name = "meshcap-soak", about = "meshcap's chaos soak (root)")]
struct Cli {
    /// How long each backend is soaked.
    #[arg(long, default_value_t = 5.0)]
    minutes: f64,
    /// Pods alive at once, at most.
    #[arg(long, default_value_t = 40)]
    pods: usize,
    /// Threads driving pods (each owns every `workers`-th pod slot).
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// The agent is killed every this many seconds on average (between half and one and a
    /// half times it); 0 never kills it (a run for the agent's footprint over time).
    #[arg(long, default_value_t = 6)]
    kill_every: u64,
    /// Another build of `meshcap-agent`: restarts alternate between it and the one in
    /// `MESHCAP_BIN_DIR`, so every other restart is an upgrade and the next a rollback.
    #[arg(long)]
    other_agent: Option<PathBuf>,
    /// Only this backend (`ebpf` or `iptables`); both by default.
    #[arg(long)]
    backend: Option<String>,
    /// Also write the report to this file.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// How often the soak's agent looks for captures whose netns went without a DEL it saw.
const GONE_CHECK: Duration = Duration::from_secs(10);

/// Where every pod's app connects: the upstream behind its `eth0`.
const SERVICE: &str = "10.0.0.1:80";

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let backends = match cli.backend.as_deref() {
        None => vec![Backend::Ebpf, Backend::Iptables],
        Some("ebpf") => vec![Backend::Ebpf],
        Some("iptables") => vec![Backend::Iptables],
        Some(other) => anyhow::bail!("--backend {other:?}: ebpf or iptables"),
    };
    let mut report = format!(
        "Soak: {:.1} min per backend, at most {} pods alive, {} workers, the agent SIGKILLed \
         every {}±{} s.\n",
        cli.minutes,
        cli.pods,
        cli.workers,
        cli.kill_every,
        cli.kill_every / 2
    );
    if let Some(other) = &cli.other_agent {
        let _ = writeln!(
            report,
            "Restarts alternate between this build of the agent and {} (upgrade, rollback).",
            other.display()
        );
    }
    for backend in backends {
        eprintln!(
            "meshcap-soak: {} for {:.1} min",
            backend.name(),
            cli.minutes
        );
        let soaked = soak(&cli, backend)?;
        report.push('\n');
        report.push_str(&soaked.render(backend));
    }
    print!("{report}");
    if let Some(out) = &cli.out {
        std::fs::write(out, &report).with_context(|| format!("writing {}", out.display()))?;
    }
    Ok(())
}

/// Counters by name, shared by every thread.
#[derive(Default)]
struct Counts(Mutex<BTreeMap<String, u64>>);

impl Counts {
    fn add(&self, key: impl Into<String>) {
        *self
            .0
            .lock()
            .expect("counts")
            .entry(key.into())
            .or_default() += 1;
    }

    fn get(&self, key: &str) -> u64 {
        self.0
            .lock()
            .expect("counts")
            .get(key)
            .copied()
            .unwrap_or(0)
    }
}

/// A small xorshift generator: the soak's choices need variety, not quality.
struct Rng(u64);

impl Rng {
    fn seeded(salt: u64) -> Self {
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Self((now ^ salt.wrapping_mul(0x9e37_79b9_7f4a_7c15)) | 1)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

/// One pod slot's pod: its netns pair, servers, sandbox, and a held connection once captured.
struct Live {
    wired: Wired,
    _servers: (meshcap_tests::Proc, meshcap_tests::Proc),
    sandbox: Sandbox,
    manifest: PathBuf,
    captured: bool,
    held: Option<Held>,
}

/// What the soak of one backend saw.
struct Soaked {
    counts: Arc<Counts>,
    samples: Vec<(f64, u64, usize)>,
    kills: u64,
    left: Vec<String>,
    minutes: f64,
}

fn soak(cli: &Cli, backend: Backend) -> anyhow::Result<Soaked> {
    let dir = ManifestDir::new();
    let agent = Agent::start(
        backend,
        &[
            "--pods",
            "dir",
            "--pod-dir",
            dir.0.to_str().context("a UTF-8 manifest directory")?,
            "--gone-check-seconds",
            &GONE_CHECK.as_secs().to_string(),
        ],
        &[],
    )?;
    let socket = agent.socket.clone();
    let cgroup = agent.cgroup();
    let pid = Arc::new(AtomicU32::new(agent.pid()));
    let agent = Arc::new(Mutex::new(agent));
    let counts = Arc::new(Counts::default());
    let done = Arc::new(AtomicBool::new(false));
    let deadline = Instant::now() + Duration::from_secs_f64(cli.minutes * 60.0);
    let start = Instant::now();

    let killer = {
        let (agent, pid, done) = (agent.clone(), pid.clone(), done.clone());
        let every = cli.kill_every * 1000;
        let builds = [
            Some(meshcap_tests::agent::binaries().join("meshcap-agent")),
            cli.other_agent.clone(),
        ];
        thread::spawn(move || -> anyhow::Result<u64> {
            let mut rng = Rng::seeded(1);
            let mut kills = 0;
            while every > 0 && !done.load(Ordering::Relaxed) {
                thread::sleep(Duration::from_millis(every / 2 + rng.below(every)));
                if done.load(Ordering::Relaxed) {
                    break;
                }
                let mut agent = agent.lock().expect("agent");
                agent.kill()?;
                kills += 1;
                thread::sleep(Duration::from_millis(rng.below(500)));
                if let Some(exe) = &builds[usize::from(kills % 2 == 1)] {
                    agent.set_exe(exe);
                }
                agent.restart()?;
                pid.store(agent.pid(), Ordering::Relaxed);
            }
            Ok(kills)
        })
    };
    let sampler = {
        let (pid, done) = (pid.clone(), done.clone());
        thread::spawn(move || {
            let mut samples = Vec::new();
            while !done.load(Ordering::Relaxed) {
                let pid = pid.load(Ordering::Relaxed);
                if let Some((rss, fds)) = footprint(pid) {
                    samples.push((start.elapsed().as_secs_f64(), rss, fds));
                }
                thread::sleep(Duration::from_secs(1));
            }
            samples
        })
    };

    let workers: Vec<_> = (0..cli.workers.max(1))
        .map(|w| {
            let slots = (w..cli.pods).step_by(cli.workers.max(1)).count();
            let (counts, socket, cgroup) = (counts.clone(), socket.clone(), cgroup.clone());
            let dir = dir.0.clone();
            thread::spawn(move || {
                let mut rng = Rng::seeded(w as u64 + 2);
                let mut pods: Vec<Option<Live>> = (0..slots).map(|_| None).collect();
                let conf = config("1.0.0", &socket, "10.0.0.2");
                let mut serial = 0;
                while Instant::now() < deadline {
                    for slot in &mut pods {
                        step(
                            slot,
                            &mut rng,
                            &counts,
                            &conf,
                            &dir,
                            &cgroup,
                            w,
                            &mut serial,
                        );
                    }
                }
                pods
            })
        })
        .collect();
    let mut remaining = Vec::new();
    for worker in workers {
        remaining.extend(
            worker
                .join()
                .map_err(|_| anyhow::anyhow!("a worker panicked"))?,
        );
    }
    done.store(true, Ordering::Relaxed);
    let kills = killer
        .join()
        .map_err(|_| anyhow::anyhow!("the killer panicked"))??;
    let samples = sampler
        .join()
        .map_err(|_| anyhow::anyhow!("the sampler panicked"))?;

    // The end: the agent up, every pod still alive DELeted (until the DEL succeeds, as the
    // runtime retries), then what is left anywhere.
    let conf = config("1.0.0", &socket, "10.0.0.2");
    for live in remaining.into_iter().flatten() {
        release(live, &counts, &conf, false);
    }
    let agent = Arc::try_unwrap(agent)
        .map_err(|_| anyhow::anyhow!("the agent is still shared"))?
        .into_inner()
        .map_err(|_| anyhow::anyhow!("the agent's lock is poisoned"))?;
    // A pod whose DEL got no answer and whose netns went after the agent's last start is
    // dropped by the agent's next look for gone netns (`--gone-check-seconds`): wait for it.
    let leftovers = || -> anyhow::Result<Vec<String>> {
        let mut left = agent.ebpf_leftovers()?;
        let records = std::fs::read_dir(agent.state_dir().join("iptables"))
            .map(|entries| entries.count())
            .unwrap_or(0);
        if records > 0 {
            left.push(format!("{records} iptables records"));
        }
        Ok(left)
    };
    let until = Instant::now() + 2 * GONE_CHECK + Duration::from_secs(5);
    let mut left = leftovers()?;
    while !left.is_empty() && Instant::now() < until {
        thread::sleep(Duration::from_millis(500));
        left = leftovers()?;
    }
    Ok(Soaked {
        counts,
        samples,
        kills,
        left,
        minutes: start.elapsed().as_secs_f64() / 60.0,
    })
}

/// One turn of one pod slot: a new pod is created and ADDed; a pod whose ADD failed is ADDed
/// again (kubelet retries); a captured pod makes connections and, one turn in four, is
/// DELeted and its netns removed.
#[expect(clippy::too_many_arguments, reason = "the worker's state, passed down")]
fn step(
    slot: &mut Option<Live>,
    rng: &mut Rng,
    counts: &Counts,
    conf: &Value,
    dir: &Path,
    cgroup: &Option<Arc<meshcap_tests::TestCgroup>>,
    worker: usize,
    serial: &mut u64,
) {
    let Some(live) = slot else {
        *serial += 1;
        let name = format!("soak-{worker}-{serial}");
        write_manifest(dir, &sidecar_pod("soak", &name, &[]));
        let wired = Wired::in_cgroup(cgroup.clone());
        let servers = wired.servers();
        let sandbox = Sandbox::new("soak", &name, &wired.pod);
        let mut live = Live {
            wired,
            _servers: servers,
            sandbox,
            manifest: dir.join(format!("{name}.json")),
            captured: false,
            held: None,
        };
        add(&mut live, counts, conf);
        *slot = Some(live);
        return;
    };
    if !live.captured {
        add(live, counts, conf);
        return;
    }
    for _ in 0..3 {
        match dial(live.wired.in_pod(APP_UID), &format!("tcp:{SERVICE}"), None) {
            Ok(Some(report)) if report.server == "envoy" => {
                if report.original_dst.map(|a| a.to_string()).as_deref() == Some(SERVICE) {
                    counts.add("connections: captured");
                } else {
                    counts.add("connections: captured, wrong original destination");
                }
            }
            Ok(Some(_)) => counts.add("connections: bypassed"),
            Ok(None) => counts.add("connections: not answered"),
            Err(err) => {
                counts.add("connections: client error");
                eprintln!("meshcap-soak: dial: {err:#}");
            }
        }
    }
    if let Some(held) = &mut live.held {
        exchange(held, counts);
    }
    if rng.below(4) == 0
        && let Some(live) = slot.take()
    {
        release(live, counts, conf, rng.below(2) == 0);
    }
}

fn add(live: &mut Live, counts: &Counts, conf: &Value) {
    match cni("ADD", &live.sandbox, conf) {
        Ok(out) if out.success => {
            counts.add("ADD: ok");
            live.captured = true;
            let target: SocketAddr = SERVICE.parse().expect("an address");
            match Held::connect(live.wired.in_pod(APP_UID), target) {
                Ok(held) if held.first().server == "envoy" => live.held = Some(held),
                Ok(_) => counts.add("connections: bypassed"),
                Err(_) => counts.add("held connections: not established"),
            }
        }
        Ok(out) => counts.add(format!("ADD: code {}", out.stdout["code"])),
        Err(err) => {
            counts.add("ADD: plugin did not run");
            eprintln!("meshcap-soak: ADD: {err:#}");
        }
    }
}

fn exchange(held: &mut Held, counts: &Counts) {
    match held.exchange("ping") {
        Ok(report) if report.server == "envoy" => counts.add("held connections: exchanges"),
        Ok(_) => counts.add("held connections: answered by another server"),
        Err(_) => counts.add("held connections: broken"),
    }
}

/// DELs the pod until a DEL succeeds (and once more as containerd does, when `twice`), checks
/// what its netns still holds when the agent answered the DEL, then removes the pod (its
/// manifest, then its netns).
fn release(mut live: Live, counts: &Counts, conf: &Value, twice: bool) {
    if let Some(held) = &mut live.held {
        exchange(held, counts);
    }
    drop(live.held.take());
    let mut tries = 0;
    let mut by_agent = false;
    loop {
        match cni("DEL", &live.sandbox, conf) {
            // The agent could not answer: the plugin lets the pod go, its capture goes with
            // the netns, and the agent's next start drops its record (checked at the end).
            Ok(out) if out.success && out.stderr.contains("DEL succeeds regardless") => {
                counts.add("DEL: ok without the agent (no answer)");
                break;
            }
            Ok(out) if out.success => {
                counts.add("DEL: ok");
                by_agent = true;
                break;
            }
            Ok(out) => counts.add(format!("DEL: code {}", out.stdout["code"])),
            Err(_) => counts.add("DEL: plugin did not run"),
        }
        tries += 1;
        if tries == 20 {
            counts.add("DEL: still failing after 20 tries");
            break;
        }
        thread::sleep(Duration::from_millis(250));
    }
    if twice {
        let mut second = live.sandbox.clone();
        second.netns = PathBuf::new();
        let mut bare = conf.clone();
        if let Some(conf) = bare.as_object_mut() {
            conf.remove("prevResult");
        }
        match cni("DEL", &second, &bare) {
            Ok(out) if out.success => counts.add("second DEL (no netns): ok"),
            Ok(out) => counts.add(format!(
                "second DEL (no netns): code {}",
                out.stdout["code"]
            )),
            Err(_) => counts.add("second DEL (no netns): plugin did not run"),
        }
    }
    if !by_agent {
        let _ = std::fs::remove_file(&live.manifest);
        return;
    }
    match leftovers(&live.wired.pod) {
        Ok(left) if left.is_empty() => counts.add("pods the agent released whole"),
        Ok(left) => {
            counts.add("pods the agent released with something left");
            for what in left {
                counts.add(format!("left in a released pod's netns: {what}"));
            }
        }
        Err(err) => eprintln!("meshcap-soak: reading a pod's leftovers: {err:#}"),
    }
    let _ = std::fs::remove_file(&live.manifest);
}

/// The agent's resident memory (bytes) and open file descriptors.
fn footprint(pid: u32) -> Option<(u64, usize)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib: u64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count();
    Some((kib * 1024, fds))
}

impl Soaked {
    fn render(&self, backend: Backend) -> String {
        let c = &self.counts;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "### {} ({:.1} min, {} agent kills)\n",
            backend.name(),
            self.minutes,
            self.kills
        );
        let _ = writeln!(out, "| what | count |\n|---|---|");
        for (key, value) in c.0.lock().expect("counts").iter() {
            let _ = writeln!(out, "| {key} | {value} |");
        }
        let total = c.get("connections: captured")
            + c.get("connections: bypassed")
            + c.get("connections: not answered");
        let _ = writeln!(
            out,
            "\nConnections: {total} attempted, {} bypassed, {} held connections broken; pods the \
             agent released with something left in their netns: {}; left with the agent once \
             every pod was gone: {}.",
            c.get("connections: bypassed"),
            c.get("held connections: broken"),
            c.get("pods the agent released with something left"),
            if self.left.is_empty() {
                "nothing".to_owned()
            } else {
                self.left.join(", ")
            }
        );
        if let (Some(first), Some(last)) = (self.samples.first(), self.samples.last()) {
            let max_rss = self.samples.iter().map(|s| s.1).max().unwrap_or(0);
            let max_fds = self.samples.iter().map(|s| s.2).max().unwrap_or(0);
            let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
            let _ = writeln!(
                out,
                "Agent (the running one, sampled every second): RSS {:.1} MiB at {:.0} s, \
                 {:.1} MiB at {:.0} s, at most {:.1} MiB; open fds {} then {}, at most {}.",
                mib(first.1),
                first.0,
                mib(last.1),
                last.0,
                mib(max_rss),
                first.2,
                last.2,
                max_fds
            );
        }
        out
    }
}
