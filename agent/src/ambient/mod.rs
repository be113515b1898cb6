//! Ambient mode on this node, as Istio's node agent runs it (`cni/pkg/nodeagent/`): an
//! enrolled pod gets Istio's in-pod rules in its network namespace, then is handed to ztunnel
//! over ZDS ([`crate::ztunnel`]), which opens its listeners inside it and acks.
//!
//! [`Ambient`] is the backend the router sends ambient pods to: it keeps what is ambient mode's
//! own — ztunnel, the node's probe sets, the pod's annotation and its workload record
//! (`records`: what ztunnel must be told about the pod, so that a ztunnel that connects
//! later, or to a restarted agent, is sent every enrolled pod in the snapshot) — around the
//! backend that applies the capture, given at start: the iptables machinery sidecar pods use
//! (records written ahead, rollback, crash consistency, CHECK against the kernel) with Istio's
//! in-pod rules, in a state directory of its own; or, with `ambient.inKernel` on a node the
//! eBPF backend serves, the kernel programs, with the same decisions (`meshcap-common`'s
//! ambient branch). What a starting agent makes of earlier enrollments is `start`'s.
//!
//! Then its addresses join the node's probe set, so kubelet's probes reach it uncaptured
//! ([`HostProbes`]). Last, the pod is annotated `ambient.istio.io/redirection: enabled`
//! (through `pods/status`, as Istio does): istiod reads it to send the pod HBONE.
//!
//! Pods already running join and leave as their labels and their namespace's change
//! ([`crate::enrollment`]), as Istio's node agent's informers make them.
//!
//! A pod is enrolled whole or not at all: when ztunnel is not connected, refuses the pod or
//! does not answer, or the annotation cannot be written, what was done is undone and the ADD
//! fails (kubelet retries it), so that no pod runs with its traffic sent to listeners nobody
//! opened. DEL tells every ztunnel and always completes.

mod adopt;
mod error;
mod handback;
mod kubelet;
mod probes;
mod records;
mod start;
mod verify;
mod yielding;

use std::{
    fs,
    net::IpAddr,
    path::{Path, PathBuf},
    sync::Arc,
};

pub use adopt::{Adopted, IstioEnrolled};
pub use error::AmbientError;
pub use handback::recorded_capture;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams};
pub use kubelet::KubeletNotFound;
use meshcap_policy::{
    DataplaneMode, PodName,
    ambient::{AmbientConfig, ambient_keys},
};
pub use probes::{HostProbes, ProbeWay, remove_from_node};
use records::{Records, Workload};
use tracing::{info, warn};

use crate::{
    backend::{
        AmbientCapture, BackendError, CaptureBackend, CapturedPod, PodCheck, PodPolicy, Verify,
        handover::Handover, iptables::FlavourChoice,
    },
    crashpoint,
    pod::PodRef,
    podnet,
    ztunnel::ZtunnelServer,
};

/// Ambient mode: the settings, ztunnel, the probe sets and the workload records, around the
/// backend that captures enrolled pods.
pub struct Ambient {
    config: AmbientConfig,
    backend: Arc<dyn CaptureBackend>,
    /// The rules backend in-pod rules are written with: the capture's, or with
    /// `ambient.inKernel` the one holding the pods adopted from istio-cni.
    rules: Arc<dyn CaptureBackend>,
    records: Records,
    ztunnel: ZtunnelServer,
    probes: HostProbes,
    /// The API server, where pods are annotated (none: standalone).
    api: Option<kube::Client>,
}

/// Where ambient mode keeps its state and meets ztunnel and the node.
pub struct AmbientPlaces<'a> {
    /// The agent's state directory (ambient mode's is `ambient/` in it).
    pub state_dir: &'a Path,
    /// Where ztunnel connects.
    pub socket: &'a Path,
    /// The node's network namespace, where kubelet's probes are SNAT-ed (`None`: the agent's
    /// own).
    pub node_netns: Option<PathBuf>,
    /// Which iptables the node's probe rule is written with (in the IP set form).
    pub flavour: FlavourChoice,
    /// The form of the node's probe sets and rule.
    pub probes: ProbeWay,
    /// The running pods istio-cni enrolled, adopted before ztunnel's socket is served.
    pub istio_enrolled: Vec<IstioEnrolled>,
}

impl Ambient {
    /// Opens the workload records under `state_dir/ambient`, makes what earlier agents left
    /// this one's (`start`: `earlier` is the backend that captured ambient pods the other
    /// way, when `ambient.inKernel` may have switched since), sets up the node's probe set and
    /// rule and serves ztunnel; enrolled pods are captured by `backend` and annotated through
    /// `api` when given.
    ///
    /// # Errors
    /// When the state directory, the probe set or rule, or the socket cannot be set up.
    pub fn open(
        config: AmbientConfig,
        backend: Arc<dyn CaptureBackend>,
        earlier: Option<Arc<dyn CaptureBackend>>,
        places: AmbientPlaces<'_>,
        api: Option<kube::Client>,
    ) -> Result<Self, AmbientError> {
        let records = Records::open(places.state_dir.join("ambient").join("workloads"))?;
        start::drop_left(backend.as_ref(), earlier.as_ref(), &records)?;
        if let Some(earlier) = &earlier {
            start::move_captures(earlier.as_ref(), backend.as_ref(), &records, &config);
        }
        // In-pod rules are the capture's, or with the kernel capturing, the earlier way's.
        let (backend, rules) = match earlier {
            Some(rules) if backend.name() == "ebpf" => {
                let both: Arc<dyn CaptureBackend> = Arc::new(Handover::new(backend, rules.clone()));
                (both, rules)
            }
            _ => (backend.clone(), backend),
        };
        if config.reconcile_on_startup {
            start::reconcile(backend.as_ref(), &records, &config);
        }
        for pod in &places.istio_enrolled {
            let reconcile = config.reconcile_on_startup;
            if let Err(err) = adopt::adopt(rules.as_ref(), &records, pod, reconcile) {
                warn!(pod = %pod.pod, error = %err, "adopting a pod istio-cni enrolled failed: live enrollment tries again");
            }
        }
        let probes = HostProbes::open(
            places.node_netns,
            places.probes,
            places.flavour,
            config.host_probe_snat,
            config.ipv6,
        )?;
        let enrolled: Vec<(String, Vec<IpAddr>)> = records
            .all()
            .map(|(_, w)| {
                let ips = if w.ips.is_empty() {
                    addresses(&w.netns).unwrap_or_default()
                } else {
                    w.ips
                };
                (w.uid, ips)
            })
            .collect();
        probes.sync(&enrolled)?;
        probes.retire_other()?;
        let socket = places.socket;
        if let Some(parent) = socket.parent() {
            fs::create_dir_all(parent).map_err(|e| records::state(parent, &e))?;
        }
        let snapshot = {
            let records = records.clone();
            move || records.snapshot()
        };
        let on_yield = {
            let records = records.clone();
            let in_kernel = backend.name() == "ebpf";
            move || yielding::before_istio_cni(&records, in_kernel)
        };
        let ztunnel =
            ZtunnelServer::start(socket, snapshot, on_yield).map_err(|e| AmbientError::State {
                path: socket.to_owned(),
                reason: e.to_string(),
            })?;
        Ok(Self {
            config,
            backend,
            rules,
            records,
            ztunnel,
            probes,
            api,
        })
    }

    /// The ambient settings.
    #[must_use]
    pub const fn config(&self) -> &AmbientConfig {
        &self.config
    }

    /// How many ztunnels were sent their snapshot so far (a pod whose enrollment found none
    /// is tried again when it grows).
    #[must_use]
    pub fn ztunnels_greeted(&self) -> u64 {
        self.ztunnel.greeted()
    }

    /// How many ztunnels are connected now (`ztunnel_connected`).
    #[must_use]
    pub fn ztunnels_connected(&self) -> usize {
        self.ztunnel.connected()
    }

    /// What captures enrolled pods: `iptables` (Istio's in-pod rules) or `ebpf`.
    #[must_use]
    pub fn capture(&self) -> &'static str {
        self.backend.name()
    }

    /// Enrolls a pod: its record, its capture, then ztunnel, which must ack, then its
    /// addresses (the capture's, or when none are given those found in its netns) in the
    /// node's probe set.
    ///
    /// # Errors
    /// When the capture cannot be applied, ztunnel does not take the pod or the probe set
    /// refuses; nothing of the pod's enrollment is left then.
    fn enroll(&self, pod: &PodRef, capture: &AmbientCapture) -> Result<(), AmbientError> {
        let ips = if capture.ips.is_empty() {
            addresses(&pod.netns)?
        } else {
            capture.ips.clone()
        };
        let workload = Workload {
            container_id: pod.container_id.clone(),
            uid: capture.uid.clone(),
            name: pod.name.clone(),
            namespace: pod.namespace.clone(),
            service_account: capture.service_account.clone(),
            netns: pod.netns.clone(),
            policy: Some(capture.policy.clone()),
            ips,
        };
        let uid = &workload.uid;
        let path = self.records.write(&workload)?;
        crashpoint::here(crashpoint::AMBIENT_ADD_RECORDED);
        let captured = PodPolicy::Ambient(Box::new(AmbientCapture {
            ips: workload.ips.clone(),
            ..capture.clone()
        }));
        let mut acked = false;
        let handed = self
            .backend
            .add(pod, &captured)
            .map_err(AmbientError::from)
            .and_then(|()| {
                let netns =
                    fs::File::open(&pod.netns).map_err(|e| records::state(&pod.netns, &e))?;
                self.ztunnel
                    .add(uid, workload.info(), std::os::fd::AsFd::as_fd(&netns))
                    .map_err(|source| AmbientError::Ztunnel {
                        pod: pod.to_string(),
                        source,
                    })
            })
            .and_then(|()| {
                acked = true;
                crashpoint::here(crashpoint::AMBIENT_ADD_HANDED);
                self.probes.add(uid, &workload.ips)
            });
        if let Err(err) = handed {
            // No snapshot names the pod from here (its record goes last).
            let _leaving = self.records.leaving(uid);
            if acked && let Err(err) = self.ztunnel.delete(uid) {
                warn!(pod = %pod, error = %err, "telling ztunnel a pod whose enrollment failed is gone");
            }
            if let Err(undo) = self.probes.remove(uid) {
                warn!(pod = %pod, error = %undo, "removing the probe addresses of a pod whose enrollment failed");
            }
            if let Err(undo) = self.backend.remove(pod) {
                warn!(pod = %pod, error = %undo, "removing the rules of a pod ztunnel did not take");
            }
            records::remove(&path);
            return Err(err);
        }
        crashpoint::here(crashpoint::AMBIENT_ADD_PROBED);
        info!(pod = %pod, uid, ips = ?workload.ips, capture = self.backend.name(), "enrolled in ambient mode: captured in the pod, ztunnel serves it, kubelet's probes pass");
        Ok(())
    }

    /// Removes a pod from ambient mode, if it was enrolled: every ztunnel is told (a failure
    /// is logged: ztunnel drops a pod whose namespace is gone on its own), then its capture
    /// goes.
    ///
    /// # Errors
    /// When its capture cannot be removed from a netns that is still there.
    fn release(&self, pod: &PodRef) -> Result<(), AmbientError> {
        let Some((path, workload)) = self.records.of(pod) else {
            return Ok(self.backend.remove(pod)?);
        };
        let _leaving = self.records.leaving(&workload.uid);
        self.forget_probes(pod, &workload);
        crashpoint::here(crashpoint::AMBIENT_REMOVE_PROBES);
        if let Err(err) = self.ztunnel.delete(&workload.uid) {
            warn!(pod = %pod, uid = workload.uid, error = %err, "telling ztunnel the pod is gone");
        }
        crashpoint::here(crashpoint::AMBIENT_REMOVE_TOLD);
        self.backend.remove(pod)?;
        records::remove(&path);
        info!(pod = %pod, uid = workload.uid, "removed from ambient mode");
        Ok(())
    }

    /// Writes `ambient.istio.io/redirection: enabled` on an enrolled pod (Istio's
    /// `AnnotateEnrolledPod`, through `pods/status`); nothing without an API server.
    ///
    /// # Errors
    /// When the API server refuses or cannot be reached.
    pub async fn annotate_enrolled(&self, pod: &PodName) -> Result<(), AmbientError> {
        self.annotate(pod, serde_json::json!("enabled")).await
    }

    /// The enrolled pod whose uid is `uid`, if any, as its DEL names it.
    #[must_use]
    pub fn enrolled(&self, uid: &str) -> Option<PodRef> {
        self.records
            .all()
            .find(|(_, w)| w.uid == uid)
            .map(|(_, w)| w.pod())
    }

    /// Removes `ambient.istio.io/redirection` from a pod taken out of ambient mode while it
    /// runs, or never enrolled on this node (Istio's `AnnotateUnenrollPod`); nothing without
    /// an API server.
    ///
    /// # Errors
    /// When the API server refuses or cannot be reached.
    pub async fn annotate_unenrolled(&self, pod: &PodName) -> Result<(), AmbientError> {
        self.annotate(pod, serde_json::Value::Null).await
    }

    /// Sets `ambient.istio.io/redirection` to `value` (null removes it) with a merge patch of
    /// `pods/status`.
    async fn annotate(&self, pod: &PodName, value: serde_json::Value) -> Result<(), AmbientError> {
        let Some(client) = &self.api else {
            return Ok(());
        };
        let patch = serde_json::json!({
            "metadata": {"annotations": {ambient_keys::REDIRECTION: value}}
        });
        Api::<Pod>::namespaced(client.clone(), &pod.namespace)
            .patch_status(&pod.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map(drop)
            .map_err(|e| AmbientError::Annotation {
                pod: pod.to_string(),
                annotation: ambient_keys::REDIRECTION,
                reason: e.to_string(),
            })
    }

    /// Forgets a pod whose capture went with its netns: its addresses, ztunnel's workload and
    /// its record.
    fn forget(&self, pod: &PodRef) {
        let workload = self.records.get(&pod.container_id);
        let _leaving = workload.as_ref().map(|w| self.records.leaving(&w.uid));
        if let Some(workload) = &workload {
            self.forget_probes(pod, workload);
            if let Err(err) = self.ztunnel.delete(&workload.uid) {
                warn!(pod = %pod, error = %err, "telling ztunnel a gone pod is gone");
            }
        }
        records::remove(&self.records.path(&pod.container_id));
    }

    /// Takes a leaving pod's addresses out of the probe set. A failure is logged, not
    /// returned: a removal always completes, and an address left behind only SNATs the node's
    /// own connections to whichever pod holds it next (an enrolled one rewrites the entry; a
    /// starting agent drops every entry no enrolled pod holds).
    fn forget_probes(&self, pod: &PodRef, workload: &Workload) {
        if let Err(err) = self.probes.remove(&workload.uid) {
            warn!(pod = %pod, error = %err, "removing the pod's addresses from the probe set");
        }
    }
}

/// Ambient pods' backend, as the router sees it: the capture is `backend`'s, the rest ambient
/// mode's own.
impl CaptureBackend for Ambient {
    fn name(&self) -> &'static str {
        self.backend.name()
    }

    fn add(&self, pod: &PodRef, policy: &PodPolicy) -> Result<(), BackendError> {
        match policy {
            PodPolicy::Ambient(capture) => Ok(self.enroll(pod, capture)?),
            PodPolicy::Sidecar(_) => Err(BackendError::NotServed(DataplaneMode::Sidecar)),
        }
    }

    fn check(&self, pod: &PodRef, policy: &PodPolicy) -> Result<(), BackendError> {
        self.backend.check(pod, policy)
    }

    fn remove(&self, pod: &PodRef) -> Result<(), BackendError> {
        Ok(self.release(pod)?)
    }

    fn list(&self, mode: DataplaneMode) -> Result<Vec<CapturedPod>, BackendError> {
        match mode {
            DataplaneMode::Ambient => self.backend.list(mode),
            DataplaneMode::Sidecar => Ok(Vec::new()),
        }
    }

    fn prune_gone(&self) -> Result<Vec<PodRef>, BackendError> {
        let gone = start::drop_gone(self.backend.as_ref())?;
        for pod in &gone {
            self.forget(pod);
        }
        Ok(gone)
    }

    fn gone(&self, mode: DataplaneMode) -> Result<Vec<PodRef>, BackendError> {
        match mode {
            DataplaneMode::Ambient => self.backend.gone(mode),
            DataplaneMode::Sidecar => Ok(Vec::new()),
        }
    }

    fn drop_if_gone(&self, pod: &PodRef) -> Result<bool, BackendError> {
        let dropped = self.backend.drop_if_gone(pod)?;
        if dropped {
            self.forget(pod);
        }
        Ok(dropped)
    }

    fn verify(&self, pod: &PodRef, verify: Verify) -> Result<PodCheck, BackendError> {
        self.verify_enrolled(pod, verify)
    }

    /// Ambient mode's own node-wide part only: the backend capturing enrolled pods is the
    /// node's (the kernel programs) or keeps nothing node-wide (Istio's in-pod rules).
    fn verify_node(&self, verify: Verify) -> PodCheck {
        self.verify_sets(verify)
    }
}

/// The global addresses in the netns at `netns`.
fn addresses(netns: &Path) -> Result<Vec<IpAddr>, AmbientError> {
    let failed = |reason: String| AmbientError::State {
        path: netns.to_owned(),
        reason,
    };
    podnet::run_in(netns, |_| podnet::global_addresses())
        .map_err(|e| failed(e.to_string()))?
        .map_err(|e| failed(format!("listing its addresses: {e}")))
}
