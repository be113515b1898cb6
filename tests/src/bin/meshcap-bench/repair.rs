//! Repair in place: how long a pod that started without its capture waits for it. A running
//! `meshcap-agent run --pods kube` per backend watches the in-test API server; one pod at a
//! time (a network namespace holding its own address) appears there as kubelet reports it
//! when `istio-validation` exits 126, and the time runs from that change until the agent's
//! `istio_cni_repair_pods_repaired_total{type="repair",result="success"}` counts it. That
//! includes the watch's delivery (the test API server streams changes every 5 ms) and the
//! poll of the agent's metrics (every 2 ms).
use std::{
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use meshcap_tests::{
    Netns, TestCgroup,
    agent::{self, Backend},
    apiserver::ApiServer,
    fixtures::{ManifestDir, broken_pod, sidecar_pod},
};

/// What one backend's run measured.
pub struct RepairResult {
    /// The backend measured.
    pub backend: Backend,
    /// Why the backend could not be measured.
    pub unavailable: Option<String>,
    /// Broken pod in the API → captured in place, ms, in pod order.
    pub ms: Vec<f64>,
}

/// The agent's count of pods repaired in place.
fn repaired(agent: &agent::Agent) -> anyhow::Result<u64> {
    let (_, metrics) = agent.http_get("/metrics")?;
    Ok(metrics
        .lines()
        .find_map(|l| {
            l.strip_prefix(
                "istio_cni_repair_pods_repaired_total{type=\"repair\",result=\"success\"} ",
            )
        })
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0))
}

/// Repairs `pods` pods, one after another, with `backend`.
pub fn run(backend: Backend, pods: usize) -> RepairResult {
    match measure(backend, pods) {
        Ok(ms) => RepairResult {
            backend,
            unavailable: None,
            ms,
        },
        Err(err) => RepairResult {
            backend,
            unavailable: Some(format!("{err:#}")),
            ms: Vec::new(),
        },
    }
}

fn measure(backend: Backend, pods: usize) -> anyhow::Result<Vec<f64>> {
    let api = ApiServer::start();
    let dir = ManifestDir::new();
    let kubeconfig = api.kubeconfig(&dir.0);
    let cgroup = TestCgroup::new("mcb-repair")?;
    let agent = agent::Agent::start_in(
        backend,
        &["--pods", "kube", "--node-name", "node-1"],
        &[
            ("KUBECONFIG", kubeconfig.to_str().context("utf-8")?),
            ("RUST_LOG", "warn"),
        ],
        Some(cgroup.path()),
    )?;
    let ready = Instant::now();
    while agent.http_get("/readyz")?.0 != 200 {
        if ready.elapsed() > Duration::from_secs(10) {
            bail!("the agent's pod watch did not sync");
        }
        thread::sleep(Duration::from_millis(10));
    }
    let mut namespaces = Vec::new();
    let mut ms = Vec::new();
    for i in 0..pods {
        let ns = Netns::new("mcb-rp")?;
        let ip = format!("100.127.{}.{}", i / 250, i % 250 + 1);
        ns.ip(&[
            "link", "add", "eth0", "type", "veth", "peer", "name", "peer0",
        ])?;
        ns.ip(&["addr", "add", &format!("{ip}/32"), "dev", "eth0"])?;
        ns.ip(&["link", "set", "eth0", "up"])?;
        namespaces.push(ns);
        let done = u64::try_from(i + 1)?;
        let started = Instant::now();
        api.apply_pod(broken_pod(
            sidecar_pod("bench", &format!("pod-{i}"), &[]),
            &ip,
            1,
        ));
        while repaired(&agent)? < done {
            if started.elapsed() > Duration::from_secs(30) {
                bail!("pod {i} was not repaired in 30 s\n{}", agent.log());
            }
            thread::sleep(Duration::from_millis(2));
        }
        ms.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    Ok(ms)
}
