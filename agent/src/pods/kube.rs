//! Pods from the Kubernetes API: a watch (kube-rs reflector) of the pods scheduled to this
//! node, and a GET when the store has not seen a pod yet (the watch can lag the CNI ADD). The
//! node's one pod watch: the controllers that follow the node's pods are fed from it
//! ([`PodFeed`]).
use std::{
    collections::BTreeMap,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::{
    Api, Client,
    runtime::{WatchStreamExt as _, reflector, reflector::ObjectRef, watcher},
};
use tokio::task::JoinHandle;
use tracing::{info, warn};

use super::{Lookup, NamespaceError, feed::PodFeed};
use crate::access::WatchHealth;

/// The Kubernetes source.
pub struct KubePods {
    client: Client,
    node: String,
    store: reflector::Store<Pod>,
    feed: PodFeed,
    ready: Arc<AtomicBool>,
    tasks: Vec<JoinHandle<()>>,
}

impl KubePods {
    /// Starts watching the pods of `node` (the watch reconnects with backoff on its own),
    /// reporting refusals to `health`.
    #[must_use]
    pub fn start(client: Client, node: String, health: WatchHealth) -> Self {
        let (store, writer) = reflector::store();
        let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
        let stream =
            reflector(writer, watcher(Api::<Pod>::all(client.clone()), config)).default_backoff();
        let feed = PodFeed::default();
        let fed = feed.clone();
        let watch = tokio::spawn(async move {
            futures::pin_mut!(stream);
            while let Some(event) = stream.next().await {
                health.observe("pod", &event);
                match event {
                    Ok(event) => fed.send(&event),
                    Err(err) => {
                        warn!(error = %err, "watching this node's pods; retrying");
                        fed.failed(&err.to_string());
                    }
                }
            }
        });
        let ready = Arc::new(AtomicBool::new(false));
        let synced = {
            let (store, ready, node) = (store.clone(), ready.clone(), node.clone());
            tokio::spawn(async move {
                if store.wait_until_ready().await.is_ok() {
                    ready.store(true, Ordering::Release);
                    info!(node, pods = store.state().len(), "pod watch synced");
                }
            })
        };
        Self {
            client,
            node,
            store,
            feed,
            ready,
            tasks: vec![watch, synced],
        }
    }

    /// The node's pod watch, for the controllers that follow its pods.
    #[must_use]
    pub fn feed(&self) -> &PodFeed {
        &self.feed
    }

    /// A source that only asks the API server (a GET per lookup) and watches nothing: for a
    /// one-off decision (`meshcap-agent decide`).
    #[must_use]
    pub fn get_only(client: Client, node: String) -> Self {
        let (store, _writer) = reflector::store();
        Self {
            client,
            node,
            store,
            feed: PodFeed::default(),
            ready: Arc::new(AtomicBool::new(true)),
            tasks: Vec::new(),
        }
    }

    pub(super) fn describe(&self) -> String {
        format!("the Kubernetes API (pods of node {})", self.node)
    }

    pub(super) fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    /// The labels of `namespace` (a GET: namespaces change rarely and ADDs of ambient pods
    /// are the only readers).
    pub(super) async fn namespace_labels(
        &self,
        namespace: &str,
    ) -> Result<BTreeMap<String, String>, NamespaceError> {
        let api: Api<Namespace> = Api::all(self.client.clone());
        match api.get_opt(namespace).await {
            Ok(Some(found)) => Ok(found.metadata.labels.unwrap_or_default()),
            Ok(None) => Err(NamespaceError::NotFound(namespace.to_owned())),
            Err(source) => Err(NamespaceError::Api {
                namespace: namespace.to_owned(),
                source,
            }),
        }
    }

    pub(super) async fn lookup(&self, namespace: &str, name: &str) -> Lookup {
        if let Some(pod) = self.store.get(&ObjectRef::new(name).within(namespace)) {
            return Lookup::Found(Box::new((*pod).clone()));
        }
        let api: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        match api.get_opt(name).await {
            Ok(Some(pod)) => Lookup::Found(Box::new(pod)),
            Ok(None) => Lookup::Missing {
                hint: String::new(),
            },
            Err(err) => Lookup::Failed(err.to_string()),
        }
    }
}

impl Drop for KubePods {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}
