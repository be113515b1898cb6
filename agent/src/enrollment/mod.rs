//! Live enrollment: pods already running join ambient mode and leave it as their labels and
//! their namespace's labels change, as Istio's node agent's informers make them
//! (`cni/pkg/nodeagent/informers.go`, `reconcilePod` and the namespace handler that requeues
//! every pod of a namespace whose labels changed).
//!
//! It follows this node's pods (the node's one pod watch, shared with the pod source and the
//! repair controller as Istio's share its informer: [`crate::pods::feed`]), watches every
//! namespace (RBAC: `namespaces` `list` and `watch`), and decides each running pod with
//! [`policy::decide`], the same decision as a CNI ADD:
//!
//! - a pod that should be enrolled and is not is enrolled in place: its network namespace is
//!   found by its address ([`crate::podnet::find`]) and it is enrolled as an ADD enrolls
//!   (same rules, same ztunnel hand-over, same annotation), decided on the pod as this watch
//!   saw it, recorded under an id of its own ([`crate::pod::InPlace`]), once the hub has
//!   checked that the namespace still holds one of its IPs (Istio 1.31);
//! - an enrolled pod that should not be (its label set to `none` or removed, its namespace
//!   unlabelled or in `excludeNamespaces`, as Istio's agent since 1.30), or that has
//!   terminated, leaves: ztunnel is told, its in-pod rules go and its
//!   `ambient.istio.io/redirection` annotation is removed.
//!
//! Where Istio reads "enrolled" off the pod's annotation, meshcap reads it off its own
//! records, which say what the node holds; so pods whose labels changed while the agent was
//! down are reconciled when it starts (Istio's informer ignores the initial adds). No pod is
//! decided before the namespaces are known: an unknown namespace would un-enroll every pod it
//! enrolls. An enrollment that fails is tried again until it is done ([`crate::pending`]).
mod action;
mod retry;

use std::{
    collections::{BTreeMap, HashMap},
    path::PathBuf,
    sync::Arc,
};

use futures::{StreamExt as _, stream};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::{
    Api,
    runtime::{WatchStreamExt as _, watcher},
};
use meshcap_policy as policy;
use meshcap_policy::{NodeSettings, PodName};
use tracing::{info, warn};

use self::action::{Action, decide};
use crate::{
    ambient::{Ambient, AmbientError},
    hub::{CaptureError, Hub},
    pending,
    pod::{InPlace, PodRef, Sandbox},
    podnet::{self, find::FindError},
    pods::feed::PodEvents,
};

/// The controller.
pub struct LiveEnrollment {
    client: kube::Client,
    hub: Arc<Hub>,
    ambient: Arc<Ambient>,
    /// The node's settings, ambient mode's among them.
    settings: NodeSettings,
    netns_dir: PathBuf,
    /// This node's pods, by namespace and name, as last seen.
    pods: HashMap<PodName, Pod>,
    /// Every namespace's labels; `None` until the first list is in.
    namespaces: Option<HashMap<String, BTreeMap<String, String>>>,
}

/// Why a pod's enrollment did not change as its labels say.
#[derive(Debug, thiserror::Error)]
enum LiveError {
    /// Looking for its netns did not finish.
    #[error("{0}")]
    Task(#[from] tokio::task::JoinError),
    /// Its netns was not found.
    #[error("to be enrolled in ambient mode, but its network namespace: {0}")]
    Netns(#[from] FindError),
    /// Enrolling it failed.
    #[error("{0}")]
    Enroll(#[source] CaptureError),
    /// Taking it out failed.
    #[error("taking it out of ambient mode failed: {0}")]
    Release(#[source] CaptureError),
    /// It is out, but its annotation stays.
    #[error("taken out of ambient mode, but: {0}")]
    Annotation(#[from] AmbientError),
    /// It was never enrolled here, and its stale annotation stays.
    #[error("not in ambient mode on this node, but: {0}")]
    Stale(#[source] AmbientError),
}

/// One change from either watch (boxed: a pod's is kilobytes).
enum Change {
    Pods(Box<watcher::Event<Pod>>),
    Namespaces(Box<Result<watcher::Event<Namespace>, watcher::Error>>),
    /// Time to look for pending enrollments that are due.
    Retry,
}

impl LiveEnrollment {
    /// A controller for the node's pods, deciding with the node's `settings`.
    #[must_use]
    pub fn new(
        client: kube::Client,
        hub: Arc<Hub>,
        ambient: Arc<Ambient>,
        settings: NodeSettings,
        netns_dir: PathBuf,
    ) -> Self {
        Self {
            client,
            hub,
            ambient,
            settings,
            netns_dir,
            pods: HashMap::new(),
            namespaces: None,
        }
    }

    /// Follows this node's pods (the node's one pod watch, [`PodEvents`]) and watches every
    /// namespace, until the watches end (never, in practice: they retry with backoff),
    /// reporting the namespace watch's refusals to `health`.
    pub async fn run(mut self, pods: PodEvents, health: crate::access::WatchHealth) {
        info!(
            "ambient mode: following this node's pods and watching every namespace for enrollment changes"
        );
        let pods = pods.map(|change| Change::Pods(Box::new(change)));
        let namespaces = watcher(
            Api::<Namespace>::all(self.client.clone()),
            watcher::Config::default(),
        )
        .default_backoff()
        .map(|change| Change::Namespaces(Box::new(change)));
        let retries = pending::ticks().map(|()| Change::Retry);
        let watches = stream::select(pods.boxed(), namespaces.boxed());
        let mut changes = stream::select(watches, retries.boxed());
        let mut listing = HashMap::new();
        while let Some(change) = changes.next().await {
            match change {
                Change::Pods(event) => self.on_pod(*event).await,
                Change::Namespaces(event) => {
                    health.observe("namespace", event.as_ref());
                    self.on_namespace(*event, &mut listing).await;
                }
                Change::Retry => self.retry_due().await,
            }
        }
    }

    async fn on_pod(&mut self, event: watcher::Event<Pod>) {
        match event {
            watcher::Event::Apply(pod) | watcher::Event::InitApply(pod) => {
                let known = self.pods.insert(PodName::of(&pod), pod.clone()).is_some();
                self.count(if known { "update" } else { "add" });
                self.reconcile(&pod).await;
            }
            // The runtime's DEL removes the pod's enrollment.
            watcher::Event::Delete(pod) => {
                self.count("delete");
                self.pods.remove(&PodName::of(&pod));
                if let Some(uid) = &pod.metadata.uid {
                    self.hub.pending().done(uid);
                }
            }
            watcher::Event::Init | watcher::Event::InitDone => {}
        }
    }

    /// `listing` collects a (re)list until it is done.
    async fn on_namespace(
        &mut self,
        event: Result<watcher::Event<Namespace>, watcher::Error>,
        listing: &mut HashMap<String, BTreeMap<String, String>>,
    ) {
        match event {
            Ok(watcher::Event::Init) => listing.clear(),
            Ok(watcher::Event::InitApply(namespace)) => {
                let name = name_of(&namespace);
                let known = self
                    .namespaces
                    .as_ref()
                    .is_some_and(|k| k.contains_key(&name));
                self.count(if known { "update" } else { "add" });
                listing.insert(name, labels_of(&namespace));
            }
            Ok(watcher::Event::InitDone) => {
                self.namespaces = Some(std::mem::take(listing));
                self.reconcile_where(|_| true).await;
            }
            Ok(watcher::Event::Apply(namespace)) => {
                let (name, labels) = (name_of(&namespace), labels_of(&namespace));
                let known = self.namespaces.get_or_insert_with(HashMap::new);
                self.hub
                    .metrics()
                    .reconcile_event(if known.contains_key(&name) {
                        "update"
                    } else {
                        "add"
                    });
                if known.get(&name) != Some(&labels) {
                    known.insert(name.clone(), labels);
                    // Istio requeues each of the namespace's pods as an update of its own.
                    for _ in 0..self.reconcile_where(|pod| pod.namespace == name).await {
                        self.count("update");
                    }
                }
            }
            Ok(watcher::Event::Delete(namespace)) => {
                self.count("delete");
                if let Some(known) = &mut self.namespaces {
                    known.remove(&name_of(&namespace));
                }
            }
            Err(err) => warn!(error = %err, "ambient mode's namespace watch"),
        }
    }

    /// Counts one event as Istio's informers count theirs (`nodeagent_reconcile_events_total`,
    /// `informers.go`): each pod or namespace event and each pod requeued, by type.
    fn count(&self, kind: &'static str) {
        self.hub.metrics().reconcile_event(kind);
    }

    /// Reconciles every known pod whose name `which` accepts; how many.
    async fn reconcile_where(&self, which: impl Fn(&PodName) -> bool) -> usize {
        let pods: Vec<Pod> = self
            .pods
            .iter()
            .filter(|(k, _)| which(k))
            .map(|(_, p)| p.clone())
            .collect();
        for pod in &pods {
            self.reconcile(pod).await;
        }
        pods.len()
    }

    async fn reconcile(&self, pod: &Pod) {
        let Some(namespaces) = &self.namespaces else {
            return;
        };
        let name = PodName::of(pod);
        let Some(labels) = namespaces.get(&name.namespace) else {
            return;
        };
        let Some(uid) = pod.metadata.uid.clone() else {
            return;
        };
        let enrolled = self.ambient.enrolled(&uid);
        let action = decide(pod, labels, &self.settings, enrolled);
        if action != Action::Enroll {
            self.hub.pending().done(&uid);
        }
        let done = match action {
            Action::Nothing => return,
            Action::Enroll => {
                let enrolled = self.enroll(pod, &uid).await;
                self.settle(&uid, &name, &enrolled);
                enrolled
            }
            Action::Unenroll(target) => self.unenroll(target).await,
            Action::Unannotate => self
                .ambient
                .annotate_unenrolled(&name)
                .await
                .map(|()| {
                    "annotated as in ambient mode, which it is not: annotation removed".to_owned()
                })
                .map_err(LiveError::Stale),
        };
        match done {
            Ok(note) => info!(pod = %name, "{note}"),
            Err(note) => warn!(pod = %name, "{note}"),
        }
    }

    /// Enrolls a running pod in place, as an ADD enrolls it.
    async fn enroll(&self, pod: &Pod, uid: &str) -> Result<String, LiveError> {
        let ips = policy::status_pod_ips(pod);
        let (dir, search) = (self.netns_dir.clone(), ips.clone());
        let netns =
            tokio::task::spawn_blocking(move || podnet::find::find(&dir, &search)).await??;
        let sandbox =
            Sandbox::in_place(PodName::of(pod), uid, InPlace::Ambient, netns.clone(), ips);
        let message = self
            .hub
            .enroll_in_place(sandbox, pod)
            .await
            .map_err(LiveError::Enroll)?;
        Ok(format!(
            "its labels now enroll it: {message} (in {})",
            netns.display()
        ))
    }

    /// Takes an enrolled pod out of ambient mode, as a DEL does, and removes its annotation.
    async fn unenroll(&self, target: PodRef) -> Result<String, LiveError> {
        self.hub
            .del(target.clone())
            .await
            .map_err(LiveError::Release)?;
        self.ambient.annotate_unenrolled(&target.pod_name()).await?;
        Ok("its labels no longer enroll it: out of ambient mode, ztunnel told".to_owned())
    }
}
fn name_of(namespace: &Namespace) -> String {
    namespace.metadata.name.clone().unwrap_or_default()
}

fn labels_of(namespace: &Namespace) -> BTreeMap<String, String> {
    namespace.metadata.labels.clone().unwrap_or_default()
}
