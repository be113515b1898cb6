//! istio-cni's sidecar captures made this agent's without a restart (issue 48, item 1). At
//! start, before the plugin's socket is served, each running pod of this node that Istio
//! injected (decided into sidecar mode now, as an ADD would decide it) whose netns holds
//! Istio's rules ([`found::istio_rules`]) and that no backend of this agent holds is offered
//! to the node's sidecar backend ([`CaptureBackend::adopt`]): exactly the rules Istio writes for
//! the pod now (iptables legacy or nft, or native nftables, as the rules backend in front
//! reads them) are recorded as its capture, under an id of meshcap's
//! ([`InPlace::Istio`]), so that CHECK, DEL (found by the pod's netns), the verifier, `status`
//! and `explain` cover it. Rules in another form (an earlier Istio's, other annotations or
//! node settings) are never rewritten under a running proxy, as Istio's own agent never
//! rewrites a sidecar pod's rules: they are left exactly as they are and reported ([`Taken`],
//! [`LeftAlone`]). On a node whose sidecar pods go to the kernel programs the rules backend
//! is put in front of them for the adopted pods (the binary's `choice.rs`), never both on one
//! pod.
//!
//! [`found_on_node`] reads this node's pods for both adoptions (ambient mode's adopts the pods
//! istio-cni enrolled) from the node's one pod watch, once its first list is complete: no
//! adoption lists the node's pods again.
use std::{
    collections::{BTreeMap, HashMap},
    path::Path,
    sync::Mutex,
    time::Duration,
};

use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::Api;
use meshcap_policy as policy;
use meshcap_policy::{Decision, NodeSettings, PodName, RedirectPolicy, keys};
use tracing::{info, warn};

use crate::{
    backend::{Adoption, BackendError, CaptureBackend, CapturedPod, PodPolicy, found},
    pod::{InPlace, PodRef},
    podnet,
    pods::feed::PodFeed,
};

/// How long the watch's first list may take at start before the agent goes on without it.
const LISTING: Duration = Duration::from_secs(10);

/// A namespace's labels.
pub type Labels = BTreeMap<String, String>;

/// The node's pods (its pod watch's, once listed) that `wanted` picks, each with its
/// namespace's labels where the decision under `settings` reads them
/// ([`policy::reads_namespace_labels`]: one read per namespace; a pod whose namespace cannot be
/// read is left out, logged), else none.
///
/// # Errors
/// Why the watch failed before its first list was complete.
async fn node_pods(
    client: &kube::Client,
    pods: &PodFeed,
    settings: &NodeSettings,
    wanted: impl Fn(&Pod) -> bool,
) -> Result<Vec<(Pod, Labels)>, String> {
    let pods = pods.listed().await?;
    let namespaces = Api::<Namespace>::all(client.clone());
    let mut labels: HashMap<String, Labels> = HashMap::new();
    let mut found = Vec::new();
    for pod in pods.into_iter().filter(|pod| wanted(pod)) {
        let Some(namespace) = pod.metadata.namespace.clone() else {
            continue;
        };
        if !policy::reads_namespace_labels(&pod, settings) {
            found.push((pod, Labels::new()));
            continue;
        }
        if !labels.contains_key(&namespace) {
            match namespaces.get(&namespace).await {
                Ok(ns) => {
                    labels.insert(namespace.clone(), ns.metadata.labels.unwrap_or_default());
                }
                Err(err) => {
                    warn!(namespace, error = %err, "reading a namespace's labels to adopt istio-cni's pods");
                    continue;
                }
            }
        }
        let labels = labels.get(&namespace).cloned().unwrap_or_default();
        found.push((pod, labels));
    }
    Ok(found)
}

/// What `of` finds among the node's pods that `wanted` picks (from its pod watch; their
/// namespaces' labels where the decision reads them), each looked at off the runtime (`of`
/// enters netns), with the node's `settings` and its `netns_dir`.
///
/// # Errors
/// Why the watch failed before its first list was complete.
pub async fn found_on_node<T: Send + 'static>(
    client: &kube::Client,
    pods: &PodFeed,
    settings: &NodeSettings,
    netns_dir: &Path,
    wanted: impl Fn(&Pod) -> bool,
    of: fn(&Pod, &Labels, &NodeSettings, &Path) -> Option<T>,
) -> Result<Vec<T>, String> {
    let pods = node_pods(client, pods, settings, wanted).await?;
    let (settings, dir) = (settings.clone(), netns_dir.to_owned());
    Ok(tokio::task::spawn_blocking(move || {
        pods.iter()
            .filter_map(|(pod, labels)| of(pod, labels, &settings, &dir))
            .collect()
    })
    .await
    .unwrap_or_default())
}

/// A running pod istio-cni captured for its sidecar: injected, decided into sidecar mode now,
/// Istio's rules in its netns.
#[derive(Clone, Debug)]
pub struct IstioCaptured {
    /// The pod, under the id of a capture adopted from istio-cni, in its netns.
    pub pod: PodRef,
    /// Its uid (its Events carry it).
    pub uid: String,
    /// Its capture, as an ADD now would make it.
    pub policy: Box<RedirectPolicy>,
    /// Istio's rules found in its netns, in words.
    pub found: Vec<String>,
}

impl IstioCaptured {
    /// `pod` when Istio injected it, it runs with addresses, it is decided into sidecar mode
    /// with its namespace's `labels` under `node`, its netns is found under `netns_dir` and
    /// holds Istio's rules. Blocking (enters netns).
    #[must_use]
    pub fn of(pod: &Pod, labels: &Labels, node: &NodeSettings, netns_dir: &Path) -> Option<Self> {
        let running = pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
        let uid = pod.metadata.uid.clone()?;
        let ips = policy::status_pod_ips(pod);
        if !injected(pod) || !running || pod.metadata.deletion_timestamp.is_some() || ips.is_empty()
        {
            return None;
        }
        let Ok(Decision::Sidecar { policy, .. }) = policy::decide(pod, &ips, labels, node) else {
            return None;
        };
        let netns = podnet::find::find(netns_dir, &ips).ok()?;
        let name = PodName::of(pod);
        let found = match found::istio_rules(&netns, &name.to_string()) {
            Ok(found) if !found.is_empty() => found,
            Ok(_) => return None,
            Err(err) => {
                warn!(pod = %name, error = %err, "looking for istio-cni's rules in a running pod");
                return None;
            }
        };
        Some(Self {
            pod: PodRef {
                namespace: name.namespace,
                name: name.name,
                container_id: InPlace::Istio.container_id(&uid),
                netns,
            },
            uid,
            policy,
            found,
        })
    }

    /// The running pods of the node istio-cni captured for their sidecars, from its pod watch
    /// (`pods`) within ten seconds; none when the watch cannot list them (logged: they keep
    /// Istio's rules, unlisted until they restart).
    pub async fn on_node(
        client: &kube::Client,
        pods: &PodFeed,
        settings: &NodeSettings,
        netns_dir: &Path,
    ) -> Vec<Self> {
        let listed = async {
            found_on_node(client, pods, settings, netns_dir, injected, Self::of)
                .await
                .unwrap_or_else(|err| {
                    warn!(error = %err, "listing this node's pods to adopt istio-cni's sidecar pods");
                    Vec::new()
                })
        };
        tokio::time::timeout(LISTING, listed)
            .await
            .unwrap_or_else(|_| {
                warn!("listing the sidecar pods istio-cni captured took more than 10 s: they keep Istio's rules, unlisted until they restart");
                Vec::new()
            })
    }
}

/// Whether Istio's injector handled `pod`.
fn injected(pod: &Pod) -> bool {
    pod.metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(keys::STATUS))
}

/// What became of one sidecar pod istio-cni captured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Taken {
    /// Recorded as the capture of the backend that reads its rules (how, in words).
    Adopted(String),
    /// Istio's rules left exactly as they are, not recorded (why, in words).
    Left(String),
    /// A backend of this agent holds the pod already.
    Known,
}

/// Adopts `pod` into `backend` (the node's sidecar backend), unless one of the captures it
/// `held` before the adoptions began is in the pod's netns.
///
/// # Errors
/// When the netns cannot be looked at, or a record cannot be written.
pub fn adopt(
    backend: &dyn CaptureBackend,
    pod: &IstioCaptured,
    held: &[CapturedPod],
) -> Result<Taken, BackendError> {
    if held
        .iter()
        .any(|captured| captured.pod.in_netns(&pod.pod.netns))
    {
        return Ok(Taken::Known);
    }
    let policy = PodPolicy::Sidecar(pod.policy.clone());
    let taken = match backend.adopt(&pod.pod, &policy, false)? {
        Adoption::Recognised(how) => {
            Taken::Adopted(format!("adopted istio-cni's rules as they are ({how})"))
        }
        Adoption::Reconciled(how) => Taken::Adopted(format!(
            "adopted istio-cni's capture, its rules rewritten ({how})"
        )),
        Adoption::NotRecognised(why) => Taken::Left(format!(
            "istio-cni's rules are not the ones Istio writes for it now ({why}): left exactly as they are, its capture is not meshcap's until it restarts"
        )),
        Adoption::Nothing => Taken::Left(format!(
            "its netns holds Istio's rules ({}) of a kind the {} backend does not read: left exactly as they are, its capture is not meshcap's until it restarts",
            pod.found.join("; "),
            backend.name()
        )),
    };
    match &taken {
        Taken::Adopted(how) => info!(pod = %pod.pod, "{how}"),
        Taken::Left(why) => warn!(pod = %pod.pod, "{why}"),
        Taken::Known => {}
    }
    Ok(taken)
}

/// The sidecar pods whose istio-cni capture was left as it is, each with why, until their DEL
/// (`explain` says it).
#[derive(Debug, Default)]
pub struct LeftAlone(Mutex<HashMap<PodName, String>>);

impl LeftAlone {
    /// `pod`'s capture was left as it is, for `why`.
    pub fn record(&self, pod: PodName, why: String) {
        self.lock().insert(pod, why);
    }

    /// Why `pod`'s capture was left as it is, when it was.
    #[must_use]
    pub fn of(&self, pod: &PodName) -> Option<String> {
        self.lock().get(pod).cloned()
    }

    /// `pod` went.
    pub fn forget(&self, pod: &PodName) {
        self.lock().remove(pod);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<PodName, String>> {
        // Single inserts and removes: consistent after a panic elsewhere.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}
