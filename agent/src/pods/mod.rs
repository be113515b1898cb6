//! Where the agent learns pods: the Kubernetes API ([`kube`]: a watch of this node's pods, and
//! a GET when the watch has not seen a pod yet; the same watch feeds the controllers, [`feed`])
//! or a directory of pod manifests ([`dir`], standalone). Either way a lookup retries a
//! bounded number of times: at CNI ADD the pod may be seconds old.
use std::{collections::BTreeMap, time::Duration};

use k8s_openapi::api::core::v1::Pod;
use meshcap_policy::{NodeSettings, PodName, reads_namespace_labels};
use tracing::debug;

pub mod dir;
pub mod feed;
pub mod kube;

/// Errors finding a pod.
#[derive(Debug, thiserror::Error)]
pub enum PodSourceError {
    /// The pod is not there after every retry.
    #[error("pod {namespace}/{name} not found in {source_name} after {attempts} attempts{hint}")]
    NotFound {
        /// The pod's namespace.
        namespace: String,
        /// The pod's name.
        name: String,
        /// The source, as the user configured it.
        source_name: String,
        /// How often it was looked up.
        attempts: u32,
        /// More context (e.g. manifests that failed to parse), possibly empty.
        hint: String,
    },
    /// The source could not be asked (API unreachable, directory unreadable).
    #[error(
        "pod {namespace}/{name}: {source_name} is unavailable after {attempts} attempts: {reason}"
    )]
    Unavailable {
        /// The pod's namespace.
        namespace: String,
        /// The pod's name.
        name: String,
        /// The source.
        source_name: String,
        /// How often it was tried.
        attempts: u32,
        /// The last error.
        reason: String,
    },
}

/// Errors reading a namespace's labels.
#[derive(Debug, thiserror::Error)]
pub enum NamespaceError {
    /// The API server has no such namespace.
    #[error("namespace {0} not found")]
    NotFound(String),
    /// The API server could not be asked.
    #[error("namespace {namespace}: {source}")]
    Api {
        /// The namespace.
        namespace: String,
        /// Why.
        #[source]
        source: ::kube::Error,
    },
    /// The manifest directory could not be read.
    #[error(transparent)]
    Manifests(#[from] dir::ManifestDirError),
}

/// How often and how far apart a missing pod is looked up again.
#[derive(Clone, Copy, Debug)]
pub struct Retry {
    /// Lookups in all (at least 1).
    pub attempts: u32,
    /// Pause between two.
    pub interval: Duration,
}

/// One lookup's answer.
enum Lookup {
    Found(Box<Pod>),
    Missing { hint: String },
    Failed(String),
}

/// A pod source.
pub enum PodSource {
    /// The Kubernetes API.
    Kube(kube::KubePods),
    /// A directory of manifests.
    Dir(dir::DirPods),
}

impl PodSource {
    /// What the source is, for logs and status.
    #[must_use]
    pub fn describe(&self) -> String {
        match self {
            Self::Kube(k) => k.describe(),
            Self::Dir(d) => d.describe(),
        }
    }

    /// The node's pod watch, for the controllers that follow its pods (the Kubernetes API
    /// only).
    #[must_use]
    pub fn feed(&self) -> Option<&feed::PodFeed> {
        match self {
            Self::Kube(k) => Some(k.feed()),
            Self::Dir(_) => None,
        }
    }

    /// Whether the source has synced (the watch listed once; a directory always is).
    #[must_use]
    pub fn is_ready(&self) -> bool {
        match self {
            Self::Kube(k) => k.is_ready(),
            Self::Dir(_) => true,
        }
    }

    /// The labels of `namespace` (ambient enrollment reads them).
    ///
    /// # Errors
    /// When the source cannot be asked, or (the API) has no such namespace.
    pub async fn namespace_labels(
        &self,
        namespace: &str,
    ) -> Result<BTreeMap<String, String>, NamespaceError> {
        match self {
            Self::Kube(k) => k.namespace_labels(namespace).await,
            Self::Dir(d) => Ok(d.namespace_labels(namespace).await?),
        }
    }

    /// The labels of `pod`'s namespace where its decision reads them
    /// ([`reads_namespace_labels`]: on a node that runs ambient mode), else none: one lookup,
    /// only when it counts.
    ///
    /// # Errors
    /// As [`Self::namespace_labels`].
    pub async fn labels_for_decision(
        &self,
        pod: &Pod,
        node: &NodeSettings,
    ) -> Result<BTreeMap<String, String>, NamespaceError> {
        if !reads_namespace_labels(pod, node) {
            return Ok(BTreeMap::new());
        }
        self.namespace_labels(&PodName::of(pod).namespace).await
    }

    /// The pod `namespace/name`, retried as `retry` says while it is missing or the source
    /// fails. With `uid`, a pod of that name but another UID (deleted and recreated) counts as
    /// missing.
    ///
    /// # Errors
    /// When it is still missing, or the source still fails, after the last attempt.
    pub async fn get(
        &self,
        namespace: &str,
        name: &str,
        uid: Option<&str>,
        retry: Retry,
    ) -> Result<Pod, PodSourceError> {
        let attempts = retry.attempts.max(1);
        let mut last = Lookup::Missing {
            hint: String::new(),
        };
        for attempt in 1..=attempts {
            last = match self {
                Self::Kube(k) => k.lookup(namespace, name).await,
                Self::Dir(d) => d.lookup(namespace, name).await,
            };
            match last {
                Lookup::Found(pod) => {
                    let found_uid = pod.metadata.uid.as_deref();
                    if uid.is_none() || found_uid == uid {
                        return Ok(*pod);
                    }
                    last = Lookup::Missing {
                        hint: format!(
                            " (a pod of that name exists with uid {}, not {})",
                            found_uid.unwrap_or("<none>"),
                            uid.unwrap_or_default()
                        ),
                    };
                }
                Lookup::Missing { .. } | Lookup::Failed(_) => {}
            }
            if attempt < attempts {
                debug!(namespace, name, attempt, "pod not found yet; retrying");
                tokio::time::sleep(retry.interval).await;
            }
        }
        let source_name = self.describe();
        Err(match last {
            Lookup::Failed(reason) => PodSourceError::Unavailable {
                namespace: namespace.to_owned(),
                name: name.to_owned(),
                source_name,
                attempts,
                reason,
            },
            Lookup::Missing { hint } => PodSourceError::NotFound {
                namespace: namespace.to_owned(),
                name: name.to_owned(),
                source_name,
                attempts,
                hint,
            },
            Lookup::Found(_) => unreachable!("a found pod returned above"),
        })
    }
}
