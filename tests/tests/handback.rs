//! Hand back (docs/install.md, "Rolling back → To istio-cni"): `meshcap-agent uninstall
//! --hand-back`, run once the agent is gone, gives every pod the kernel programs capture
//! Istio's own rules for it, rules first, then releases its kernel capture, and then removes
//! every program, link and pin of meshcap's. A dialer runs all along: every connection reaches
//! the pod's proxy with its original destination, before, during and after.
use std::{
    net::IpAddr,
    path::Path,
    process::{Command, Stdio},
    sync::atomic::{AtomicBool, AtomicU8, Ordering},
    thread,
    time::Duration,
};

use meshcap_agent::{
    backend::{
        CaptureBackend, PodPolicy,
        ebpf::{self, EbpfConfig},
        iptables::{FlavourChoice, IptablesBackend, IptablesConfig},
        nftables::{NftablesBackend, NftablesConfig},
    },
    crashpoint,
    pod::PodRef,
};
use meshcap_policy as policy;
use meshcap_policy::{DataplaneMode, Decision, NodeSettings};
use meshcap_tests::{
    APP_UID, Held, Netns, Placement, Proc, Report,
    agent::{Agent, Backend, binaries},
    bin,
    fixtures::{ManifestDir, attached_programs, leftovers, sidecar_pod, write_manifest},
    kubelet::{Sandbox, cni, config},
    require_root, unique_name,
    wired::Wired,
};
use serde_json::Value;

/// A running `meshcap-agent uninstall --hand-back`: killed if the test ends before
/// [`HandBack::finish`] (a failed step must not leave it paused forever).
struct HandBack(Option<std::process::Child>);

impl HandBack {
    /// Whether it has exited.
    fn exited(&mut self) -> bool {
        self.0
            .as_mut()
            .is_some_and(|child| child.try_wait().is_ok_and(|status| status.is_some()))
    }

    /// Waits for it: whether it succeeded, and what it said.
    fn finish(mut self) -> (bool, String) {
        let child = self.0.take().expect("running");
        let out = child.wait_with_output().expect("meshcap-agent uninstall");
        (
            out.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        )
    }
}

impl Drop for HandBack {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `meshcap-agent uninstall --pins-only --hand-back` for an agent's layout, pods and state,
/// with `env`, started.
/// How long the hand-back may take to reach its pause with both captures in place.
const PAUSE_WITHIN: Duration = Duration::from_secs(60);

fn hand_back(
    config: &EbpfConfig,
    pod_dir: &Path,
    state_dir: &Path,
    env: &[(&str, &str)],
) -> HandBack {
    let child = Command::new(binaries().join("meshcap-agent"))
        .args(["uninstall", "--pins-only", "--hand-back", "--pods", "dir"])
        .arg("--pod-dir")
        .arg(pod_dir)
        .arg("--bpffs-dir")
        .arg(&config.bpffs_dir)
        .arg("--cgroup-root")
        .arg(&config.cgroup_root)
        .arg("--state-dir")
        .arg(state_dir)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running meshcap-agent uninstall --hand-back");
    HandBack(Some(child))
}

/// The sidecar policy meshcap decides for `manifest` at address 10.0.0.2.
fn sidecar_policy(manifest: &Value) -> PodPolicy {
    let pod = policy::parse_pod_manifest(&manifest.to_string()).expect("manifest");
    let ip: IpAddr = "10.0.0.2".parse().expect("addr");
    match policy::decide(&pod, &[ip], &Default::default(), &NodeSettings::default()) {
        Ok(Decision::Sidecar { policy, .. }) => PodPolicy::Sidecar(policy),
        other => panic!("not a sidecar decision: {other:?}"),
    }
}

/// The rules backend keeping its records under `state_dir`: Istio's iptables rules, or with
/// `nftables` (`global.nativeNftables`) its native nftables ones.
fn rules_backend(state_dir: &Path, nftables: bool) -> Box<dyn CaptureBackend> {
    if nftables {
        Box::new(
            NftablesBackend::new(&NftablesConfig {
                state_dir: state_dir.to_owned(),
            })
            .expect("nftables backend"),
        )
    } else {
        Box::new(
            IptablesBackend::new(&IptablesConfig {
                state_dir: state_dir.to_owned(),
                flavour: FlavourChoice::Auto,
            })
            .expect("iptables backend"),
        )
    }
}

/// What the rules backend writes for `policy` in a fresh netns of its own: the rules Istio's
/// plugin writes (held to Istio's goldens), as `leftovers` lists them.
fn rendered(policy: &PodPolicy, nftables: bool) -> Vec<String> {
    let scratch = ManifestDir::new();
    let netns = Netns::new("mc-handback-ref").expect("reference netns");
    let backend = rules_backend(&scratch.0, nftables);
    let pod = PodRef {
        namespace: "ref".into(),
        name: "ref".into(),
        container_id: unique_name("ref"),
        netns: netns.path(),
    };
    backend.add(&pod, policy).expect("the reference rules");
    let rules = leftovers(&netns).expect("reference rules");
    backend.remove(&pod).expect("releasing the reference");
    rules
}

/// Stops a dial loop when dropped.
struct Stop<'a>(&'a AtomicBool);

impl Drop for Stop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Who answers a connection from upstream to the pod's 10.0.0.2:8080, and the original
/// destination the proxy saw.
fn inbound(wired: &Wired) -> (String, Option<String>) {
    answer(upstream(wired), "tcp:10.0.0.2:8080")
}

/// Where the upstream's processes run.
const fn upstream(wired: &Wired) -> Placement<'_> {
    Placement {
        netns: &wired.upstream,
        cgroup: None,
        uid: 0,
        gid: 0,
    }
}

/// Who answers the app's connection to 10.0.0.1:80, and the original destination the proxy
/// saw.
fn outbound(wired: &Wired) -> (String, Option<String>) {
    answer(wired.in_pod(APP_UID), "tcp:10.0.0.1:80")
}

fn answer(at: Placement<'_>, target: &str) -> (String, Option<String>) {
    let out = Proc::spawn(at, &bin::dial(), &[target])
        .and_then(Proc::finish)
        .expect("dial");
    let line = out.trim();
    match serde_json::from_str::<Report>(line) {
        Ok(report) => (report.server, report.original_dst.map(|a| a.to_string())),
        Err(_) => (line.to_owned(), None),
    }
}

/// `leftovers` without the kernel capture's clsact qdisc: Istio's rules and routes.
fn istio_only(lines: Vec<String>) -> Vec<String> {
    lines
        .into_iter()
        .filter(|l| !l.starts_with("qdisc clsact"))
        .collect()
}

#[test]
fn a_sidecar_pod_handed_back_to_istios_iptables_rules_stays_captured_and_nothing_of_meshcap_stays()
{
    require_root();
    if meshcap_tests::ebpf_runs_here() {
        handed_back(false);
    }
}

/// The same with `global.nativeNftables`: Istio's native nftables rules.
#[test]
fn a_sidecar_pod_handed_back_to_istios_nftables_rules_stays_captured_and_nothing_of_meshcap_stays()
{
    require_root();
    if meshcap_tests::ebpf_runs_here() {
        handed_back(true);
    }
}

/// A sidecar pod (its object in a manifest directory) captured in the kernel by an eBPF agent
/// reading that directory, with its proxy and app running.
struct Captured {
    pods: ManifestDir,
    agent: Agent,
    wired: Wired,
    _servers: (Proc, Proc),
    name: String,
    manifest: Value,
}

impl Captured {
    fn new() -> Self {
        let pods = ManifestDir::new();
        let agent = Agent::start(
            Backend::Ebpf,
            &[
                "--pods",
                "dir",
                "--pod-dir",
                pods.0.to_str().expect("utf-8"),
            ],
            &[],
        )
        .expect("agent");
        let wired = Wired::new(&agent);
        let servers = wired.servers();
        let name = unique_name("web");
        let manifest = sidecar_pod("shop", &name, &[]);
        write_manifest(&pods.0, &manifest);
        let sandbox = Sandbox::new("shop", &name, &wired.pod);
        let add = cni("ADD", &sandbox, &config("1.0.0", &agent.socket, "10.0.0.2")).expect("ADD");
        assert!(add.success, "ADD failed: {add:?}");
        Self {
            pods,
            agent,
            wired,
            _servers: servers,
            name,
            manifest,
        }
    }
}

/// A sidecar pod captured in the kernel handed back, with a dialer running all along; Istio's
/// rules in their nftables form with `nftables`.
fn handed_back(nftables: bool) {
    let Captured {
        pods,
        mut agent,
        wired,
        _servers,
        name,
        manifest,
    } = Captured::new();
    let ebpf_config = agent.ebpf_config().expect("eBPF agent");
    let state_dir = agent.state_dir();
    let before = leftovers(&wired.pod).expect("netns state");
    assert!(
        !before
            .iter()
            .any(|l| l.contains("ISTIO") || l.contains("istio-")),
        "captured in the kernel, no rules: {before:?}"
    );
    // The DaemonSet is gone (the agent with it); the pod lives on, captured in the kernel.
    agent.kill().expect("kill the agent");
    // Connections the kernel capture carried, held open across the hand-back both ways: their
    // packets after it must still reach the ends they were opened with.
    let mut held = [
        Held::connect(wired.in_pod(APP_UID), "10.0.0.1:80".parse().expect("addr")),
        Held::connect(upstream(&wired), "10.0.0.2:8080".parse().expect("addr")),
    ]
    .map(|held| held.expect("a connection the kernel captured"));
    assert_eq!(
        held.each_ref().map(|h| (
            h.first().server.clone(),
            h.first().original_dst.map(|a| a.to_string())
        )),
        [
            ("envoy".to_owned(), Some("10.0.0.1:80".to_owned())),
            ("envoy".to_owned(), Some("10.0.0.2:8080".to_owned()))
        ],
        "the held connections are captured"
    );

    // Paused with both captures in place: Istio's rules written, the kernel capture not yet
    // released.
    let pause = pods.0.join("paused");
    let pause_at = format!("{}={}", crashpoint::HAND_BACK_BOTH, pause.display());
    let done = AtomicBool::new(false);
    // 0: before the hand-back, 1: while it runs, 2: after it.
    let phase = AtomicU8::new(0);
    let ((ok, out), both, (captured, bypassed)) = thread::scope(|scope| {
        // The dialer stops however this ends (a failed step panics before the end).
        let _stop = Stop(&done);
        let dials = scope.spawn(|| {
            let (mut captured, mut bypassed) = (0u32, Vec::new());
            while !done.load(Ordering::Relaxed) {
                for (seen, want) in [
                    (outbound(&wired), "10.0.0.1:80"),
                    (inbound(&wired), "10.0.0.2:8080"),
                ] {
                    match seen {
                        (server, Some(orig)) if server == "envoy" && orig == want => {
                            captured += 1;
                        }
                        other => bypassed.push((phase.load(Ordering::Relaxed), want, other)),
                    }
                }
            }
            (captured, bypassed)
        });
        thread::sleep(Duration::from_millis(300));
        phase.store(1, Ordering::Relaxed);
        let child = hand_back(
            &ebpf_config,
            &pods.0,
            &state_dir,
            &[
                (crashpoint::PAUSE_ENV, &pause_at),
                (
                    "MESHCAP_NATIVE_NFTABLES",
                    if nftables { "true" } else { "false" },
                ),
            ],
        );
        let mut child = child;
        // A liveness bound: under TCG (the 6.1 guest) the command takes several seconds to
        // start and open the layout and the rules backends before it reaches its first pod.
        let started = std::time::Instant::now();
        while !(pause.exists() || child.exited()) && started.elapsed() < PAUSE_WITHIN {
            thread::sleep(Duration::from_millis(50));
        }
        if !pause.exists() {
            let exited = child.exited();
            let (_, out) = child.finish();
            if exited {
                panic!(
                    "it exited without pausing (an agent binary built without the crash-points \
                     feature? `cargo build -p meshcap-agent -p meshcap-cni -p meshcap-tests \
                     --bins` builds it with): {out}"
                );
            }
            panic!("the hand-back did not pause with both captures within {PAUSE_WITHIN:?}: {out}");
        }
        let both = (
            istio_only(leftovers(&wired.pod).expect("netns state")),
            (outbound(&wired), inbound(&wired)),
            ebpf::Pins::new(&ebpf_config.bpffs_dir).pinned_pods().len(),
        );
        std::fs::remove_file(&pause).expect("resume the hand-back");
        let result = child.finish();
        phase.store(2, Ordering::Relaxed);
        thread::sleep(Duration::from_millis(300));
        done.store(true, Ordering::Relaxed);
        (result, both, dials.join().expect("the dial loop"))
    });
    let policy = sidecar_policy(&manifest);
    let istio = rendered(&policy, nftables);
    assert_eq!(
        both,
        (
            istio.clone(),
            (
                ("envoy".to_owned(), Some("10.0.0.1:80".to_owned())),
                ("envoy".to_owned(), Some("10.0.0.2:8080".to_owned()))
            ),
            1
        ),
        "with Istio's rules and the kernel capture both in place, a connection is redirected \
         once, with its original destination"
    );
    assert!(ok, "the hand-back failed: {out}");
    assert!(
        out.contains(&format!("handed back shop/{name}")),
        "names the pod: {out}"
    );
    assert!(
        bypassed.is_empty(),
        "{} of {} connections were not captured with their original destination across the \
         hand-back: {bypassed:?}\n{out}",
        bypassed.len(),
        captured as usize + bypassed.len()
    );
    assert!(captured > 5, "the loop ran: {captured} connections");
    for (held, way) in held.iter_mut().zip(["outbound", "inbound"]) {
        let after = held.exchange("after the hand-back");
        assert!(
            after.as_ref().is_ok_and(|r| r.server == "envoy"),
            "the {way} connection opened before the hand-back goes on with the proxy: {after:?}"
        );
    }
    assert_eq!(
        (outbound(&wired), inbound(&wired)),
        (
            ("envoy".to_owned(), Some("10.0.0.1:80".to_owned())),
            ("envoy".to_owned(), Some("10.0.0.2:8080".to_owned()))
        ),
        "captured by Istio's rules afterwards, both ways"
    );

    println!(
        "{captured} connections (outbound and inbound), all captured with their original \
         destination, across the hand-back"
    );
    assert_eq!(
        leftovers(&wired.pod).expect("netns state"),
        istio,
        "the netns holds exactly the rules Istio's plugin writes for the pod"
    );
    // Recorded as the rules backend records its own: a later agent's CHECK and DEL know them.
    let rules = rules_backend(&state_dir, nftables);
    let recorded = rules.list(DataplaneMode::Sidecar).expect("records");
    assert_eq!(
        recorded
            .iter()
            .map(|c| c.pod.name.as_str())
            .collect::<Vec<_>>(),
        [name.as_str()],
        "{recorded:?}"
    );
    let pod = PodRef {
        netns: wired.pod.path(),
        ..recorded[0].pod.clone()
    };
    rules
        .check(&pod, &policy)
        .expect("CHECK on the handed-back pod");

    assert!(
        !ebpf_config.bpffs_dir.exists(),
        "every pin removed: {:?}",
        std::fs::read_dir(&ebpf_config.bpffs_dir).map(|d| d.count())
    );
    assert_eq!(
        attached_programs(&ebpf_config.cgroup_root),
        Vec::new(),
        "every program detached"
    );
    let tc = meshcap_tests::run(
        "ip",
        &[
            "netns",
            "exec",
            wired.pod.name(),
            "tc",
            "filter",
            "show",
            "dev",
            "eth0",
            "ingress",
        ],
    );
    assert_eq!(
        tc.expect("tc filter show").trim(),
        "",
        "the pod's inbound stub is gone"
    );

    rules.remove(&pod).expect("DEL of the handed-back pod");
    assert_eq!(
        leftovers(&wired.pod).expect("netns state"),
        Vec::<String>::new(),
        "released by a DEL"
    );
}

/// A pod that cannot be handed back (its object is gone from the pod source, so its policy
/// cannot be found) keeps its kernel capture whole and gets none of Istio's rules; the command
/// fails naming it and why, and the programs stay for it.
#[test]
fn a_pod_that_cannot_be_handed_back_keeps_its_kernel_capture_and_is_named() {
    require_root();
    if !meshcap_tests::ebpf_runs_here() {
        return;
    }
    let Captured {
        pods,
        mut agent,
        wired,
        _servers,
        name,
        ..
    } = Captured::new();
    let ebpf_config = agent.ebpf_config().expect("eBPF agent");
    agent.kill().expect("kill the agent");
    std::fs::remove_file(pods.0.join(format!("{name}.json"))).expect("the pod's object gone");

    let (ok, out) = hand_back(&ebpf_config, &pods.0, &agent.state_dir(), &[]).finish();
    assert!(!ok, "a pod not handed back fails the command: {out}");
    assert!(
        out.contains(&format!("shop/{name}: its policy cannot be found")),
        "names the pod and why: {out}"
    );
    assert_eq!(
        istio_only(leftovers(&wired.pod).expect("netns state")),
        Vec::<String>::new(),
        "none of Istio's rules written"
    );
    assert_eq!(
        ebpf::Pins::new(&ebpf_config.bpffs_dir).pinned_pods().len(),
        1,
        "its kernel capture kept"
    );
    assert_eq!(
        (outbound(&wired), inbound(&wired)),
        (
            ("envoy".to_owned(), Some("10.0.0.1:80".to_owned())),
            ("envoy".to_owned(), Some("10.0.0.2:8080".to_owned()))
        ),
        "still captured in the kernel, both ways"
    );
}
