//! The request path with a recording backend and a manifest directory as the pod source: what
//! each request decides, which backend call it makes, and how it answers. The backends
//! themselves are tested against the real kernel (`tests/`).
use std::sync::Mutex;

use meshcap_policy::{DataplaneMode, SelectConfig};

use super::*;
use crate::{
    backend::{BackendError, CaptureBackend, CapturedPod},
    pods::dir::DirPods,
};

/// What the backend was asked, in order.
#[derive(Default)]
struct Recorder {
    calls: Mutex<Vec<String>>,
    captured: Mutex<Vec<PodRef>>,
}

impl CaptureBackend for Recorder {
    fn name(&self) -> &'static str {
        "recorder"
    }

    fn add(&self, pod: &PodRef, policy: &PodPolicy) -> Result<(), BackendError> {
        let PodPolicy::Sidecar(policy) = policy else {
            return Err(BackendError::NotServed(DataplaneMode::Ambient));
        };
        self.calls
            .lock()
            .unwrap()
            .push(format!("add {} {}", pod.container_id, policy.mode));
        self.captured.lock().unwrap().push(pod.clone());
        Ok(())
    }

    fn remove(&self, pod: &PodRef) -> Result<(), BackendError> {
        self.calls
            .lock()
            .unwrap()
            .push(format!("remove {}", pod.container_id));
        self.captured
            .lock()
            .unwrap()
            .retain(|c| c.container_id != pod.container_id);
        Ok(())
    }

    fn check(&self, pod: &PodRef, _: &PodPolicy) -> Result<(), BackendError> {
        let captured = self.captured.lock().unwrap();
        if captured.iter().any(|c| c.container_id == pod.container_id) {
            Ok(())
        } else {
            Err(BackendError::NotCaptured {
                pod: pod.to_string(),
                missing: "everything".to_owned(),
            })
        }
    }

    fn list(&self, mode: DataplaneMode) -> Result<Vec<CapturedPod>, BackendError> {
        if mode == DataplaneMode::Ambient {
            return Ok(Vec::new());
        }
        Ok(self
            .captured
            .lock()
            .unwrap()
            .iter()
            .map(|pod| CapturedPod {
                adopted: false,
                pod: pod.clone(),
                backend: "recorder".to_owned(),
                summary: String::new(),
            })
            .collect())
    }

    fn prune_gone(&self) -> Result<Vec<PodRef>, BackendError> {
        Ok(Vec::new())
    }

    fn gone(&self, _: DataplaneMode) -> Result<Vec<PodRef>, BackendError> {
        Ok(Vec::new())
    }

    fn drop_if_gone(&self, _: &PodRef) -> Result<bool, BackendError> {
        Ok(false)
    }
}

const MESH_POD: &str = "
kind: Pod
metadata: {name: web, namespace: shop, annotations: {sidecar.istio.io/status: '{}'}}
spec: {containers: [{name: app}, {name: istio-proxy, args: [proxy, sidecar]}]}
";

const PLAIN_POD: &str = "
kind: Pod
metadata: {name: plain, namespace: shop}
spec: {containers: [{name: app}]}
";

const BAD_POD: &str = "
kind: Pod
metadata: {name: bad, namespace: shop, annotations: {sidecar.istio.io/status: '{}',
  traffic.sidecar.istio.io/includeInboundPorts: 'eighty'}}
spec: {containers: [{name: app}, {name: istio-proxy, args: [proxy, sidecar]}]}
";

/// A serving hub over `backend`, its pods in a manifest directory.
fn hub(backend: Arc<Recorder>) -> (Hub, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    for (file, text) in [
        ("web.yaml", MESH_POD),
        ("plain.yaml", PLAIN_POD),
        ("bad.yaml", BAD_POD),
    ] {
        std::fs::write(dir.path().join(file), text).unwrap();
    }
    let hub = Hub::new(
        Parts {
            source: Arc::new(PodSource::Dir(DirPods::new(dir.path().to_owned()))),
            router: Router::new(backend, None),
            backend_reason: "a test's".to_owned(),
            probe: None,
            ambient: None,
            install: None,
            holds: Vec::new(),
            events: None,
        },
        Settings {
            retry: Retry {
                attempts: 1,
                interval: std::time::Duration::ZERO,
            },
            node: NodeSettings {
                select: SelectConfig::default(),
                ambient: None,
            },
            socket: PathBuf::from("/nonexistent/agent.sock"),
        },
    );
    hub.readiness().set_serving(true);
    (hub, dir)
}

fn sandbox(name: &str, container_id: &str) -> Sandbox {
    Sandbox {
        pod: PodRef {
            namespace: "shop".to_owned(),
            name: name.to_owned(),
            container_id: container_id.to_owned(),
            netns: PathBuf::from("/nonexistent/netns"),
        },
        uid: None,
        ips: vec!["10.0.0.2".parse().unwrap()],
    }
}

#[tokio::test]
async fn a_mesh_pod_is_captured_checked_and_released_through_its_backend() {
    let backend = Arc::new(Recorder::default());
    let (hub, _dir) = hub(backend.clone());
    let added = hub.add(sandbox("web", "c1")).await.expect("added");
    assert_eq!(added.label(), "captured");
    assert!(
        added
            .message()
            .starts_with("captured by the recorder backend: REDIRECT"),
        "{}",
        added.message()
    );
    let checked = hub.check(sandbox("web", "c1")).await.expect("checked");
    assert_eq!(checked.message(), "capture is in place");
    let removed = hub.del(sandbox("web", "c1").pod).await.expect("removed");
    assert_eq!(removed.message(), "capture removed");
    let missing = hub.check(sandbox("web", "c1")).await.expect_err("released");
    assert_eq!(missing.class(), ErrorClass::CheckFailed);
    assert_eq!(
        *backend.calls.lock().unwrap(),
        ["add c1 REDIRECT", "remove c1"]
    );
}

#[tokio::test]
async fn a_pod_outside_the_mesh_is_left_alone_and_a_bad_one_refused() {
    let backend = Arc::new(Recorder::default());
    let (hub, _dir) = hub(backend.clone());
    let skipped = hub.add(sandbox("plain", "c2")).await.expect("skipped");
    assert_eq!(
        skipped.message(),
        "not captured: the pod has no istio-proxy container"
    );
    let bad = hub.add(sandbox("bad", "c3")).await.expect_err("refused");
    assert_eq!(bad.class(), ErrorClass::InvalidPod);
    assert!(
        bad.to_string().starts_with("pod shop/bad: annotation"),
        "{bad}"
    );
    let unknown = hub.add(sandbox("ghost", "c4")).await.expect_err("unknown");
    assert_eq!(unknown.class(), ErrorClass::PodNotFound);
    assert!(backend.calls.lock().unwrap().is_empty());
    let metrics = hub.metrics().render();
    assert!(
        metrics.contains("reason=\"invalid_pod\"") && metrics.contains("reason=\"pod_not_found\""),
        "{metrics}"
    );
}

/// A pod captured in place in the test's own netns, with `ips`.
fn in_place_sandbox(container_id: &str, ips: Vec<std::net::IpAddr>) -> Sandbox {
    let mut sandbox = sandbox("web", container_id);
    sandbox.pod.netns = PathBuf::from("/proc/self/ns/net");
    sandbox.ips = ips;
    sandbox
}

/// The global addresses of the test's netns (the host's).
fn here() -> Vec<std::net::IpAddr> {
    let ips = crate::podnet::global_addresses().expect("addresses");
    assert!(!ips.is_empty(), "the host has a global address");
    ips
}

#[tokio::test]
async fn a_capture_in_place_needs_a_netns_holding_one_of_the_pods_ips() {
    let backend = Arc::new(Recorder::default());
    let (hub, _dir) = hub(backend.clone());
    let id = crate::pod::InPlace::Repair.container_id("u1");
    // 192.0.2.0/24 is documentation's (RFC 5737): no netns holds it.
    let elsewhere = in_place_sandbox(&id, vec!["192.0.2.77".parse().unwrap()]);
    let err = hub.add(elsewhere).await.expect_err("refused");
    assert_eq!(
        err.to_string(),
        "pod shop/web: network namespace /proc/self/ns/net holds none of its IPs [192.0.2.77] \
         (the pod is gone, or the namespace is another pod's): not captured in place"
    );
    assert!(
        backend.captured.lock().unwrap().is_empty(),
        "nothing captured"
    );
    hub.add(in_place_sandbox(&id, here()))
        .await
        .expect("captured where the netns holds its IP");
    // A runtime's ADD names the netns it made: not checked (this one does not even exist).
    hub.add(sandbox("web", "c1")).await.expect("added");
    assert_eq!(backend.captured.lock().unwrap().len(), 2);
}

#[tokio::test]
async fn gc_leaves_captures_made_in_place_and_those_the_runtime_has() {
    let backend = Arc::new(Recorder::default());
    let (hub, _dir) = hub(backend.clone());
    let in_place = crate::pod::InPlace::Repair.container_id("u1");
    for id in ["kept", "stale"] {
        hub.add(sandbox("web", id)).await.expect("added");
    }
    hub.add(in_place_sandbox(&in_place, here()))
        .await
        .expect("added");
    let collected = hub.gc(vec!["kept".to_owned()]).await.expect("collected");
    assert_eq!(collected.message(), "removed 1 stale captures");
    let left: Vec<String> = backend
        .captured
        .lock()
        .unwrap()
        .iter()
        .map(|pod| pod.container_id.clone())
        .collect();
    assert_eq!(left, ["kept", in_place.as_str()]);
}

#[tokio::test]
async fn nothing_is_served_but_the_status_while_not_serving() {
    let backend = Arc::new(Recorder::default());
    let (hub, _dir) = hub(backend.clone());
    assert_eq!(
        hub.ping().await.expect("ready").message(),
        "ready, backend recorder"
    );
    hub.readiness().set_serving(false);
    let refused = hub.add(sandbox("web", "c1")).await.expect_err("refused");
    assert_eq!(refused.class(), ErrorClass::NotReady);
    assert_eq!(refused.to_string(), "meshcap-agent is shutting down");
    let Done::Status(report) = hub.status().await.expect("a report") else {
        panic!("a status report");
    };
    assert!(!report.ready);
    assert_eq!(report.backend, "recorder");
    assert!(backend.calls.lock().unwrap().is_empty());
}

#[test]
fn a_hold_keeps_the_agent_unready_while_it_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let (hold, held) = watch::channel(Some("the agent may not watch pods".to_owned()));
    let readiness = Readiness::new(
        Arc::new(PodSource::Dir(DirPods::new(dir.path().to_owned()))),
        None,
        vec![held],
        Arc::default(),
    );
    readiness.set_serving(true);
    assert_eq!(
        readiness.not_ready_reason().as_deref(),
        Some("the agent may not watch pods")
    );
    hold.send_replace(None);
    assert_eq!(readiness.not_ready_reason(), None);
}
