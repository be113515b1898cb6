//! The router: each mode's requests reach the backend serving it, and a DEL every backend, ambient mode's
//! first.
use std::sync::{Arc, Mutex};

use meshcap_policy::ambient::InpodPolicy;

use super::*;

/// A backend that notes, in the log both share, what it is asked.
struct Noting {
    name: &'static str,
    log: Arc<Mutex<Vec<String>>>,
}

impl Noting {
    fn note(&self, what: &str, pod: &PodRef) {
        self.log
            .lock()
            .unwrap()
            .push(format!("{} {what} {}", self.name, pod.container_id));
    }
}

impl CaptureBackend for Noting {
    fn name(&self) -> &'static str {
        self.name
    }

    fn add(&self, pod: &PodRef, policy: &PodPolicy) -> Result<(), BackendError> {
        self.note(&format!("add {}", policy.dataplane()), pod);
        Ok(())
    }

    fn check(&self, pod: &PodRef, policy: &PodPolicy) -> Result<(), BackendError> {
        self.note(&format!("check {}", policy.dataplane()), pod);
        Ok(())
    }

    fn remove(&self, pod: &PodRef) -> Result<(), BackendError> {
        self.note("remove", pod);
        Ok(())
    }

    fn list(&self, mode: DataplaneMode) -> Result<Vec<CapturedPod>, BackendError> {
        Ok(vec![CapturedPod {
            adopted: false,
            pod: pod(&format!("{}-{mode}", self.name)),
            backend: self.name.to_owned(),
            summary: String::new(),
        }])
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

fn pod(id: &str) -> PodRef {
    PodRef {
        namespace: "shop".to_owned(),
        name: "web".to_owned(),
        container_id: id.to_owned(),
        netns: "/nonexistent".into(),
    }
}

fn router(ambient: bool) -> (Router, Arc<Mutex<Vec<String>>>) {
    let log = Arc::new(Mutex::new(Vec::new()));
    let noting = |name| -> Arc<dyn CaptureBackend> {
        Arc::new(Noting {
            name,
            log: log.clone(),
        })
    };
    let router = Router::new(noting("node"), ambient.then(|| noting("inpod")));
    (router, log)
}

fn sidecar() -> PodPolicy {
    PodPolicy::from(RedirectPolicy {
        pod: meshcap_policy::PodName {
            namespace: "shop".to_owned(),
            name: "web".to_owned(),
        },
        pod_ips: Vec::new(),
        ipv6: false,
        dual_stack: false,
        mode: meshcap_policy::InterceptionMode::Redirect,
        include_outbound_ip_ranges: meshcap_policy::IpRanges::All,
        exclude_outbound_ip_ranges: meshcap_policy::CidrSet::default(),
        include_inbound_ports: meshcap_policy::PortSelection::All,
        exclude_inbound_ports: Vec::new(),
        include_outbound_ports: Vec::new(),
        exclude_outbound_ports: Vec::new(),
        exclude_interfaces: Vec::new(),
        reroute_virtual_interfaces: Vec::new(),
        proxy_uid: 1337,
        proxy_gid: 1337,
        dns_capture: false,
        invalid_drop: false,
    })
}

fn ambient() -> PodPolicy {
    PodPolicy::Ambient(Box::new(AmbientCapture {
        policy: InpodPolicy {
            inbound: true,
            dns: true,
            virtual_interfaces: Vec::new(),
            ipv6: false,
            host_probe_snat: meshcap_policy::ambient::HostProbeSnat::default(),
        },
        ips: Vec::new(),
        uid: "u1".to_owned(),
        service_account: "default".to_owned(),
    }))
}

#[test]
fn each_mode_goes_to_the_backend_serving_it_and_a_del_to_every_one() {
    let (router, log) = router(true);
    router.add(&pod("c1"), &sidecar()).expect("sidecar");
    router.add(&pod("c2"), &ambient()).expect("ambient");
    router.check(&pod("c2"), &ambient()).expect("checked");
    router.remove(&pod("c2")).expect("removed");
    assert_eq!(
        *log.lock().unwrap(),
        [
            "node add sidecar c1",
            "inpod add ambient c2",
            "inpod check ambient c2",
            "inpod remove c2",
            "node remove c2",
        ]
    );
    let listed: Vec<String> = router
        .list()
        .expect("listed")
        .into_iter()
        .map(|c| c.pod.container_id)
        .collect();
    assert_eq!(listed, ["node-sidecar", "inpod-ambient"]);
    assert_eq!(router.node_backend().name(), "node");
    let modes: Vec<DataplaneMode> = router.modes().map(|(mode, _)| mode).collect();
    assert_eq!(modes, [DataplaneMode::Ambient, DataplaneMode::Sidecar]);
}

#[test]
fn a_mode_nobody_serves_is_refused() {
    let (router, log) = router(false);
    let refused = router
        .add(&pod("c1"), &ambient())
        .expect_err("no ambient mode");
    assert!(matches!(
        refused,
        BackendError::NotServed(DataplaneMode::Ambient)
    ));
    assert_eq!(
        refused.to_string(),
        "no backend on this node captures ambient pods"
    );
    assert!(router.serving(DataplaneMode::Ambient).is_none());
    router.remove(&pod("c1")).expect("removed");
    assert_eq!(*log.lock().unwrap(), ["node remove c1"]);
    assert_eq!(router.list().expect("listed").len(), 1);
}
