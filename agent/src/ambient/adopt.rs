//! Pods istio-cni enrolled, made this agent's without a restart (issue 48): a running pod
//! annotated `ambient.istio.io/redirection: enabled` whose netns holds Istio's in-pod rules
//! and of which meshcap has no record is recorded as enrolled, its rules as the capture of the
//! rules backend that holds them ([`crate::backend::CaptureBackend::adopt`]: exactly Istio's
//! rules for the pod now are kept as they are; in another form they are reconciled to them,
//! as Istio's own agent does at start with `reconcileIptablesOnStartup`, `ConstructInitialSnapshot`
//! in `cni/pkg/nodeagent/net_linux.go`, or left as they are with it off). At start this
//! happens before ztunnel's socket is served, so that ztunnel, reconnecting, is sent these
//! pods with their netns in its first snapshot and keeps serving them; while the agent runs,
//! live enrollment adopts a pod it first sees this way instead of enrolling it again.
use std::{net::IpAddr, path::Path};

use k8s_openapi::api::core::v1::Pod;
use meshcap_policy as policy;
use meshcap_policy::{Decision, NodeSettings, PodName, ambient::ambient_keys};
use tracing::{info, warn};

use super::{Ambient, AmbientError, records::Workload};
use crate::{
    backend::{Adoption, AmbientCapture, CaptureBackend, PodPolicy},
    pod::{InPlace, PodRef},
    podnet,
    pods::feed::PodFeed,
    takeover,
};

/// A running pod Istio's agent enrolled: annotated, and decided into ambient mode now.
#[derive(Clone, Debug)]
pub struct IstioEnrolled {
    /// The pod, under the id of a pod enrolled in place, in its netns.
    pub pod: PodRef,
    /// Its capture, as an enrollment now would make it.
    pub capture: AmbientCapture,
}

impl IstioEnrolled {
    /// `pod` when it is annotated as enrolled, running, with addresses, found in a netns under
    /// `netns_dir`, and decided into ambient mode with its namespace's `labels` under `node`.
    #[must_use]
    pub fn of(
        pod: &Pod,
        labels: &takeover::Labels,
        node: &NodeSettings,
        netns_dir: &Path,
    ) -> Option<Self> {
        let annotated = pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(ambient_keys::REDIRECTION))
            .is_some_and(|v| v == "enabled");
        let running = pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
        let uid = pod.metadata.uid.clone()?;
        let ips: Vec<IpAddr> = policy::status_pod_ips(pod);
        if !annotated || !running || pod.metadata.deletion_timestamp.is_some() || ips.is_empty() {
            return None;
        }
        let Ok(Decision::Ambient { policy, .. }) = policy::decide(pod, &ips, labels, node) else {
            return None;
        };
        let netns = podnet::find::find(netns_dir, &ips).ok()?;
        let name = PodName::of(pod);
        Some(Self {
            pod: PodRef {
                namespace: name.namespace,
                name: name.name,
                container_id: InPlace::Ambient.container_id(&uid),
                netns,
            },
            capture: AmbientCapture {
                policy,
                ips,
                uid,
                service_account: pod
                    .spec
                    .as_ref()
                    .and_then(|s| s.service_account_name.clone())
                    .unwrap_or_else(|| "default".to_owned()),
            },
        })
    }

    /// The running pods of the node Istio's agent enrolled and this agent (its state directory
    /// `state_dir`) has no record of, from its pod watch (`pods`, and the labels of their
    /// namespaces from the API server), within ten seconds; none when the watch cannot list
    /// them (logged: live enrollment adopts them as it sees them).
    pub async fn on_node(
        client: &kube::Client,
        pods: &PodFeed,
        settings: &NodeSettings,
        netns_dir: &Path,
        state_dir: &Path,
    ) -> Vec<Self> {
        let known: Vec<String> =
            match super::records::Records::open(state_dir.join("ambient").join("workloads")) {
                Ok(records) => records.all().map(|(_, w)| w.uid).collect(),
                Err(err) => {
                    warn!(error = %err, "reading ambient mode's records to adopt istio-cni's pods");
                    return Vec::new();
                }
            };
        let listed = Self::listed(client, pods, settings, netns_dir, &known);
        tokio::time::timeout(std::time::Duration::from_secs(10), listed)
            .await
            .unwrap_or_else(|_| {
                warn!("listing the pods istio-cni enrolled took more than 10 s: live enrollment adopts them as it sees them");
                Vec::new()
            })
    }

    async fn listed(
        client: &kube::Client,
        pods: &PodFeed,
        settings: &NodeSettings,
        netns_dir: &Path,
        known: &[String],
    ) -> Vec<Self> {
        let wanted = |pod: &Pod| {
            pod.metadata
                .annotations
                .as_ref()
                .is_some_and(|a| a.contains_key(ambient_keys::REDIRECTION))
                && !pod.metadata.uid.as_ref().is_some_and(|u| known.contains(u))
        };
        takeover::found_on_node(client, pods, settings, netns_dir, wanted, Self::of)
            .await
            .unwrap_or_else(|err| {
                warn!(error = %err, "listing this node's pods to adopt istio-cni's ambient pods");
                Vec::new()
            })
    }
}

/// What became of one pod Istio enrolled.
#[derive(Debug, PartialEq, Eq)]
pub enum Adopted {
    /// Recorded as enrolled (its rules as found, or reconciled: how, in words).
    Enrolled(String),
    /// Its rules are not Istio's for it now, and `reconcileIptablesOnStartup` is off: left as
    /// they are, not recorded (why, in words).
    Left(String),
    /// Its netns holds none of Istio's in-pod rules: not Istio's to adopt.
    NotIstios,
    /// Already this agent's.
    Known,
}

impl Ambient {
    /// Adopts `pod` ([`adopt`]) while the agent runs, then hands it to ztunnel if one is
    /// connected (otherwise the next snapshot carries it).
    ///
    /// # Errors
    /// As [`adopt`].
    pub fn adopt_running(&self, pod: &IstioEnrolled) -> Result<Adopted, AmbientError> {
        let adopted = adopt(
            self.rules.as_ref(),
            &self.records,
            pod,
            self.config.reconcile_on_startup,
        )?;
        if matches!(adopted, Adopted::Enrolled(_)) {
            if let Err(err) = self.probes.add(&pod.capture.uid, &pod.capture.ips) {
                warn!(pod = %pod.pod, error = %err, "adding an adopted pod's addresses to the probe set");
            }
            if self.ztunnel.connected() > 0 {
                let handed = std::fs::File::open(&pod.pod.netns)
                    .map_err(|e| super::records::state(&pod.pod.netns, &e))
                    .and_then(|netns| {
                        let workload = workload(pod);
                        self.ztunnel
                            .add(
                                &pod.capture.uid,
                                workload.info(),
                                std::os::fd::AsFd::as_fd(&netns),
                            )
                            .map_err(|source| AmbientError::Ztunnel {
                                pod: pod.pod.to_string(),
                                source,
                            })
                    });
                if let Err(err) = handed {
                    warn!(pod = %pod.pod, error = %err, "handing an adopted pod to ztunnel: the verifier and the next snapshot try again");
                }
            }
        }
        Ok(adopted)
    }
}

/// Adopts one pod Istio's agent enrolled into `rules` (the rules backend in-pod rules are
/// written with) and the workload `records`; `reconcile`: rules in another form are replaced.
///
/// # Errors
/// When its netns cannot be looked at, or a record cannot be written.
pub(super) fn adopt(
    rules: &dyn CaptureBackend,
    records: &super::records::Records,
    pod: &IstioEnrolled,
    reconcile: bool,
) -> Result<Adopted, AmbientError> {
    if records.all().any(|(_, w)| w.uid == pod.capture.uid) {
        return Ok(Adopted::Known);
    }
    let policy = PodPolicy::Ambient(Box::new(pod.capture.clone()));
    let adopted = match rules.adopt(&pod.pod, &policy, reconcile)? {
        Adoption::Nothing => return Ok(Adopted::NotIstios),
        Adoption::NotRecognised(why) => {
            warn!(pod = %pod.pod, %why, "istio-cni's in-pod rules differ from Istio's for the pod now and ambient.reconcileIptablesOnStartup is off: left as they are, not adopted");
            return Ok(Adopted::Left(why));
        }
        Adoption::Recognised(how) => {
            format!("adopted istio-cni's in-pod rules as they are ({how})")
        }
        Adoption::Reconciled(how) => {
            format!("adopted istio-cni's enrollment, its in-pod rules reconciled ({how})")
        }
    };
    records.write(&workload(pod))?;
    info!(pod = %pod.pod, uid = pod.capture.uid, capture = rules.name(), "{adopted}");
    Ok(Adopted::Enrolled(adopted))
}

fn workload(pod: &IstioEnrolled) -> Workload {
    Workload {
        container_id: pod.pod.container_id.clone(),
        uid: pod.capture.uid.clone(),
        name: pod.pod.name.clone(),
        namespace: pod.pod.namespace.clone(),
        service_account: pod.capture.service_account.clone(),
        netns: pod.pod.netns.clone(),
        policy: Some(pod.capture.policy.clone()),
        ips: pod.capture.ips.clone(),
    }
}
