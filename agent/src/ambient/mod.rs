//! Ambient mode on this node, as Istio's node agent runs it (`cni/pkg/nodeagent/`): an
//! enrolled pod gets Istio's in-pod rules in its network namespace, then is handed to ztunnel
//! over ZDS ([`crate::ztunnel`]), which opens its listeners inside it and acks.
//!
//! The capture is applied ([`InpodCapture`]) by the iptables machinery sidecar pods use
//! (records written ahead, rollback, crash consistency, CHECK against the kernel), in a state
//! directory of its own and whichever backend serves the node's sidecar pods; or, with
//! `ambient.inKernel` on a node the eBPF backend serves, by the kernel programs, with the same
//! decisions (`meshcap-common`'s ambient branch). Beside each record, what ztunnel must be told
//! about the pod (its uid, name, namespace and service account) is kept, so that a ztunnel that
//! connects later, or to a restarted agent, is sent every enrolled pod in the snapshot.
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

mod inpod;
mod probes;

use std::{
    fs,
    net::IpAddr,
    path::{Path, PathBuf},
    sync::Arc,
};

pub use inpod::InpodCapture;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams};
pub use probes::{HostProbes, remove_from_node};
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::{
    backend::{
        BackendError, CapturedPod,
        ebpf::EbpfBackend,
        iptables::{FlavourChoice, IptablesBackend, IptablesConfig},
    },
    crashpoint,
    pod::{PodRef, record_file_name, same_netns},
    podnet,
    policy::ambient::{AmbientConfig, InpodPolicy, ambient_keys},
    ztunnel::{Enrolled, ZdsError, ZtunnelServer, proto::WorkloadInfo},
};

/// What went wrong enrolling or removing an ambient pod.
#[derive(Debug, thiserror::Error)]
pub enum AmbientError {
    /// The in-pod rules could not be applied, checked or removed.
    #[error(transparent)]
    Rules(#[from] BackendError),
    /// ztunnel did not take the pod (its rules were removed again).
    #[error("pod {pod}: ztunnel did not take the pod: {source}")]
    Ztunnel {
        /// The pod.
        pod: String,
        /// What ztunnel (or its socket) said.
        source: ZdsError,
    },
    /// The pod's `ambient.istio.io/redirection` annotation could not be written (its
    /// enrollment was undone).
    #[error("pod {pod}: annotating it {annotation}=enabled: {reason}")]
    Annotation {
        /// The pod.
        pod: String,
        /// The annotation.
        annotation: &'static str,
        /// Why.
        reason: String,
    },
    /// The node's probe set could not be read or written.
    #[error("kubelet's probe set on the node: {what}: {reason}")]
    ProbeSet {
        /// What was being done.
        what: String,
        /// Why.
        reason: String,
    },
    /// The agent's own state could not be written.
    #[error("{path}: {reason}")]
    State {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
}

/// What ztunnel is told about an enrolled pod, kept per container.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Workload {
    /// The id the pod is enrolled under: the runtime's sandbox, or one of
    /// [`crate::pod::InPlace`]'s for a pod enrolled while it runs.
    #[serde(default)]
    container_id: String,
    uid: String,
    name: String,
    namespace: String,
    service_account: String,
    netns: PathBuf,
    /// The policy the pod was enrolled with (none in records of builds before it was kept).
    #[serde(default)]
    policy: Option<InpodPolicy>,
    /// The pod's addresses, in the node's probe set (none in records of builds before it).
    #[serde(default)]
    ips: Vec<IpAddr>,
}

impl Workload {
    fn info(&self) -> WorkloadInfo {
        WorkloadInfo {
            name: self.name.clone(),
            namespace: self.namespace.clone(),
            service_account: self.service_account.clone(),
        }
    }
}

/// Ambient mode: the settings, the in-pod rules and ztunnel.
pub struct Ambient {
    config: AmbientConfig,
    rules: InpodCapture,
    workloads: PathBuf,
    ztunnel: ZtunnelServer,
    probes: HostProbes,
    /// The API server, where pods are annotated (none: standalone).
    api: Option<kube::Client>,
}

impl Ambient {
    /// Opens the in-pod rules' records under `state_dir/ambient`, sets up the node's probe
    /// set and rule in `node_netns` (`None`: the agent's own) and serves ztunnel at `socket`;
    /// enrolled pods are annotated through `api` when given. `kernel` is the eBPF backend when
    /// it serves the node; with `in_kernel` too, enrolled pods are captured by its programs
    /// instead of Istio's in-pod rules. A pod an earlier agent captured the other way
    /// (`ambient.inKernel` switched since) is moved to this one's ([`move_captures`]).
    ///
    /// # Errors
    /// When the state directory, the probe set or rule, or the socket cannot be set up.
    #[expect(
        clippy::too_many_arguments,
        reason = "the agent's settings, each its own"
    )]
    pub fn open(
        config: AmbientConfig,
        state_dir: &Path,
        flavour: FlavourChoice,
        socket: &Path,
        api: Option<kube::Client>,
        node_netns: Option<PathBuf>,
        kernel: Option<Arc<EbpfBackend>>,
        in_kernel: bool,
    ) -> Result<Self, AmbientError> {
        let state_dir = state_dir.join("ambient");
        let in_pod_rules = || {
            IptablesBackend::new(&IptablesConfig {
                state_dir: state_dir.clone(),
                flavour,
            })
        };
        let (rules, earlier) = match kernel {
            Some(ebpf) if in_kernel => (
                InpodCapture::Ebpf(ebpf),
                Some(InpodCapture::Iptables(in_pod_rules()?)),
            ),
            Some(ebpf) => (
                InpodCapture::Iptables(in_pod_rules()?),
                Some(InpodCapture::Ebpf(ebpf)),
            ),
            None => (InpodCapture::Iptables(in_pod_rules()?), None),
        };
        let workloads = state_dir.join("workloads");
        fs::create_dir_all(&workloads).map_err(|e| state(&workloads, &e))?;
        // Pods whose netns went while no agent ran: their rules went with it, and no ztunnel
        // is to be told about them. (A record of what ztunnel is told is written before the
        // rules' own, so that of a pod whose ADD was cut off may stand alone: it goes too.)
        rules.prune_gone()?;
        if let Some(earlier) = &earlier {
            earlier.prune_gone()?;
        }
        for (path, workload) in records(&workloads) {
            if !workload.netns.exists() {
                remove_file(&path);
            }
        }
        if let Some(earlier) = &earlier {
            move_captures(earlier, &rules, &workloads, &config);
        }
        if config.reconcile_on_startup {
            reconcile(&rules, &workloads, &config);
        }
        let probes = HostProbes::open(node_netns, flavour, config.host_probe_snat, config.ipv6)?;
        let enrolled: Vec<(String, Vec<IpAddr>)> = records(&workloads)
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
        if let Some(parent) = socket.parent() {
            fs::create_dir_all(parent).map_err(|e| state(parent, &e))?;
        }
        let snapshot = {
            let workloads = workloads.clone();
            move || snapshot(&workloads)
        };
        let ztunnel = ZtunnelServer::start(socket, snapshot).map_err(|e| AmbientError::State {
            path: socket.to_owned(),
            reason: e.to_string(),
        })?;
        Ok(Self {
            config,
            rules,
            workloads,
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

    /// What captures enrolled pods: `iptables` (Istio's in-pod rules) or `ebpf`.
    #[must_use]
    pub const fn capture(&self) -> &'static str {
        self.rules.name()
    }

    /// Enrolls a pod: its in-pod rules, then ztunnel, which must ack, then its addresses
    /// (`ips`, or when none are given those found in its netns) in the node's probe set.
    ///
    /// # Errors
    /// When the rules cannot be applied, ztunnel does not take the pod or the probe set
    /// refuses; nothing of the pod's enrollment is left then.
    pub fn add(
        &self,
        pod: &PodRef,
        uid: &str,
        service_account: &str,
        policy: &InpodPolicy,
        ips: &[IpAddr],
    ) -> Result<(), AmbientError> {
        let ips = if ips.is_empty() {
            addresses(&pod.netns).map_err(|reason| AmbientError::State {
                path: pod.netns.clone(),
                reason,
            })?
        } else {
            ips.to_vec()
        };
        let workload = Workload {
            container_id: pod.container_id.clone(),
            uid: uid.to_owned(),
            name: pod.name.clone(),
            namespace: pod.namespace.clone(),
            service_account: service_account.to_owned(),
            netns: pod.netns.clone(),
            policy: Some(policy.clone()),
            ips,
        };
        let path = self.workload_path(&pod.container_id);
        let bytes = serde_json::to_vec(&workload).map_err(|e| state(&path, &e))?;
        fs::write(&path, bytes).map_err(|e| state(&path, &e))?;
        crashpoint::here(crashpoint::AMBIENT_ADD_RECORDED);
        let handed = self
            .rules
            .add(pod, policy, &workload.ips)
            .map_err(AmbientError::from)
            .and_then(|()| {
                let netns = fs::File::open(&pod.netns).map_err(|e| state(&pod.netns, &e))?;
                self.ztunnel
                    .add(uid, workload.info(), std::os::fd::AsFd::as_fd(&netns))
                    .map_err(|source| AmbientError::Ztunnel {
                        pod: pod.to_string(),
                        source,
                    })
            })
            .and_then(|()| {
                crashpoint::here(crashpoint::AMBIENT_ADD_HANDED);
                self.probes.add(uid, &workload.ips).inspect_err(|_| {
                    if let Err(err) = self.ztunnel.delete(uid) {
                        warn!(pod = %pod, error = %err, "telling ztunnel a pod whose enrollment failed is gone");
                    }
                })
            });
        if let Err(err) = handed {
            if let Err(undo) = self.probes.remove(uid) {
                warn!(pod = %pod, error = %undo, "removing the probe addresses of a pod whose enrollment failed");
            }
            if let Err(undo) = self.rules.remove(pod) {
                warn!(pod = %pod, error = %undo, "removing the rules of a pod ztunnel did not take");
            }
            remove_file(&path);
            return Err(err);
        }
        crashpoint::here(crashpoint::AMBIENT_ADD_PROBED);
        info!(pod = %pod, uid, ips = ?workload.ips, capture = self.rules.name(), "enrolled in ambient mode: captured in the pod, ztunnel serves it, kubelet's probes pass");
        Ok(())
    }

    /// Writes `ambient.istio.io/redirection: enabled` on an enrolled pod (Istio's
    /// `AnnotateEnrolledPod`, through `pods/status`); nothing without an API server.
    ///
    /// # Errors
    /// When the API server refuses or cannot be reached.
    pub async fn annotate_enrolled(&self, pod: &PodRef) -> Result<(), AmbientError> {
        self.annotate(pod, serde_json::json!("enabled")).await
    }

    /// Whether `pod`'s in-pod rules are in place.
    ///
    /// # Errors
    /// When they are not, or cannot be checked.
    pub fn check(&self, pod: &PodRef, policy: &InpodPolicy) -> Result<(), AmbientError> {
        Ok(self.rules.check(pod, policy)?)
    }

    /// Removes a pod from ambient mode, if it was enrolled: every ztunnel is told (a failure
    /// is logged: ztunnel drops a pod whose namespace is gone on its own), then its rules go.
    ///
    /// # Errors
    /// When its rules cannot be removed from a netns that is still there.
    pub fn remove(&self, pod: &PodRef) -> Result<(), AmbientError> {
        let Some((path, workload)) = self.workload_of(pod) else {
            return Ok(self.rules.remove(pod)?);
        };
        self.forget_probes(pod, &workload);
        crashpoint::here(crashpoint::AMBIENT_REMOVE_PROBES);
        if let Err(err) = self.ztunnel.delete(&workload.uid) {
            warn!(pod = %pod, uid = workload.uid, error = %err, "telling ztunnel the pod is gone");
        }
        crashpoint::here(crashpoint::AMBIENT_REMOVE_TOLD);
        self.rules.remove(pod)?;
        remove_file(&path);
        info!(pod = %pod, uid = workload.uid, "removed from ambient mode");
        Ok(())
    }

    /// The enrolled pod whose uid is `uid`, if any, as its DEL names it.
    #[must_use]
    pub fn enrolled(&self, uid: &str) -> Option<PodRef> {
        records(&self.workloads)
            .find(|(_, w)| w.uid == uid)
            .map(|(_, w)| PodRef {
                namespace: w.namespace,
                name: w.name,
                container_id: w.container_id,
                netns: w.netns,
            })
    }

    /// Removes `ambient.istio.io/redirection` from a pod taken out of ambient mode while it
    /// runs (Istio's `AnnotateUnenrollPod`); nothing without an API server.
    ///
    /// # Errors
    /// When the API server refuses or cannot be reached.
    pub async fn annotate_unenrolled(&self, pod: &PodRef) -> Result<(), AmbientError> {
        self.annotate(pod, serde_json::Value::Null).await
    }

    /// Sets `ambient.istio.io/redirection` to `value` (null removes it) with a merge patch of
    /// `pods/status`.
    async fn annotate(&self, pod: &PodRef, value: serde_json::Value) -> Result<(), AmbientError> {
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

    /// The record of `pod`: by its container, else by its netns (a pod enrolled while it ran
    /// is recorded under an id of meshcap's, which the runtime's DEL does not name).
    fn workload_of(&self, pod: &PodRef) -> Option<(PathBuf, Workload)> {
        let path = self.workload_path(&pod.container_id);
        if let Some(workload) = read_workload(&path) {
            return Some((path, workload));
        }
        records(&self.workloads).find(|(_, w)| same_netns(&w.netns, &pod.netns))
    }

    /// The enrolled pods.
    ///
    /// # Errors
    /// As the backends' `list`.
    pub fn list(&self) -> Result<Vec<CapturedPod>, AmbientError> {
        Ok(self.rules.list()?)
    }

    /// Drops the enrollments of pods whose netns is gone without a DEL this agent saw.
    ///
    /// # Errors
    /// When the records cannot be read.
    pub fn prune_gone(&self) -> Result<Vec<PodRef>, AmbientError> {
        let gone = self.rules.prune_gone()?;
        for pod in &gone {
            let path = self.workload_path(&pod.container_id);
            if let Some(workload) = read_workload(&path) {
                self.forget_probes(pod, &workload);
                if let Err(err) = self.ztunnel.delete(&workload.uid) {
                    warn!(pod = %pod, error = %err, "telling ztunnel a gone pod is gone");
                }
            }
            remove_file(&path);
        }
        Ok(gone)
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

    fn workload_path(&self, container_id: &str) -> PathBuf {
        workload_path(&self.workloads, container_id)
    }
}

/// The global addresses in the netns at `netns`.
fn addresses(netns: &Path) -> Result<Vec<IpAddr>, String> {
    podnet::run_in(netns, |_| podnet::global_addresses())
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("listing its addresses: {e}"))
}

/// The record of what ztunnel is told about one container's pod.
fn workload_path(workloads: &Path, container_id: &str) -> PathBuf {
    workloads.join(record_file_name(container_id))
}

/// `ambient.reconcileIptablesOnStartup`, as Istio's node agent's `reconcileExistingPod`: the
/// in-pod rules of every pod already enrolled are made this build's, rendered from the policy
/// the pod was enrolled with and the node's settings now. Nothing happens to a pod whose rules
/// are already those; a failure is logged and leaves the pod as it was, as in Istio.
fn reconcile(rules: &InpodCapture, workloads: &Path, config: &AmbientConfig) {
    for held in held_by(rules, workloads, config, "reconciling in-pod rules") {
        let Some(policy) = held.policy else {
            continue;
        };
        if let Err(err) = rules.add(&held.pod, &policy, &held.ips) {
            warn!(pod = %held.pod, error = %err, "reconciling in-pod rules failed: the pod keeps the rules it had; restart it, or take it out of ambient mode and back");
        }
    }
}

/// Moves every enrolled pod `earlier` captures (an agent before this one, with
/// `ambient.inKernel` the other way) to `now`: captured by `now`, then released by `earlier`,
/// then captured by `now` once more, as both keep the same reply route (the release took it):
/// the pod is captured throughout. A pod that cannot be moved keeps the capture it has, with a
/// warning naming it; the next start tries again.
fn move_captures(
    earlier: &InpodCapture,
    now: &InpodCapture,
    workloads: &Path,
    config: &AmbientConfig,
) {
    let (from, to) = (earlier.name(), now.name());
    for Held { pod, policy, ips } in held_by(earlier, workloads, config, "moving captures") {
        let Some(policy) = policy else {
            warn!(pod = %pod, from, "an enrolled pod's record has no policy (an older build's): it keeps the capture it has");
            continue;
        };
        let moved = now
            .add(&pod, &policy, &ips)
            .and_then(|()| earlier.remove(&pod))
            .and_then(|()| now.add(&pod, &policy, &ips));
        match moved {
            Ok(()) => {
                info!(pod = %pod, from, to, "ambient.inKernel changed: the enrolled pod's capture moved");
            }
            Err(err) => {
                warn!(pod = %pod, from, to, error = %err, "moving an enrolled pod's capture failed: it stays captured as it was, and only this agent's next start can release it; restart the pod, or the agent to try again");
            }
        }
    }
}

/// An enrolled pod a capture holds.
struct Held {
    pod: PodRef,
    /// The policy it was enrolled with, under the node's settings now (none in records of
    /// builds before it was kept).
    policy: Option<InpodPolicy>,
    ips: Vec<IpAddr>,
}

/// The enrolled pods `capture` holds; none when its records cannot be read (logged, as
/// `doing`).
fn held_by(
    capture: &InpodCapture,
    workloads: &Path,
    config: &AmbientConfig,
    doing: &str,
) -> Vec<Held> {
    let captured: Vec<String> = match capture.list() {
        Ok(captured) => captured.into_iter().map(|c| c.pod.container_id).collect(),
        Err(err) => {
            warn!(error = %err, capture = capture.name(), "{doing}: the captures cannot be listed");
            return Vec::new();
        }
    };
    records(workloads)
        .filter(|(_, w)| captured.contains(&w.container_id))
        .map(|(_, w)| Held {
            policy: w.policy.map(|mut policy| {
                policy.ipv6 = config.ipv6;
                policy.host_probe_snat = config.host_probe_snat;
                policy
            }),
            ips: w.ips,
            pod: PodRef {
                namespace: w.namespace,
                name: w.name,
                container_id: w.container_id,
                netns: w.netns,
            },
        })
        .collect()
}

/// Every record in `workloads`, with its path.
fn records(workloads: &Path) -> impl Iterator<Item = (PathBuf, Workload)> {
    fs::read_dir(workloads)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let path = entry.path();
            read_workload(&path).map(|workload| (path, workload))
        })
}

/// Every enrolled pod, for a connecting ztunnel: with its netns when it is still there.
fn snapshot(workloads: &Path) -> Vec<Enrolled> {
    records(workloads)
        .map(|(_, workload)| Enrolled {
            uid: workload.uid.clone(),
            workload: workload.info(),
            netns: fs::File::open(&workload.netns).ok().map(Into::into),
        })
        .collect()
}

fn read_workload(path: &Path) -> Option<Workload> {
    let bytes = fs::read(path).ok()?;
    match serde_json::from_slice(&bytes) {
        Ok(workload) => Some(workload),
        Err(err) => {
            warn!(path = %path.display(), error = %err, "ignoring an unreadable ambient record");
            None
        }
    }
}

fn remove_file(path: &Path) {
    if let Err(err) = fs::remove_file(path)
        && err.kind() != std::io::ErrorKind::NotFound
    {
        warn!(path = %path.display(), error = %err, "removing an ambient record");
    }
}

fn state(path: &Path, err: &impl std::fmt::Display) -> AmbientError {
    AmbientError::State {
        path: path.to_owned(),
        reason: err.to_string(),
    }
}
