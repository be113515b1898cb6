//! Pods from a directory of manifests (`*.yaml`, `*.yml`, `*.json`; several YAML documents per
//! file and `kind: List` are fine), for running without a cluster. Read on every lookup, so a
//! manifest written just before the CNI ADD is seen.
use std::{
    collections::BTreeMap,
    io,
    path::{Path, PathBuf},
};

use meshcap_policy::{ManifestError, manifest};
use serde_json::Value;
use tracing::warn;

use super::Lookup;

/// What went wrong reading the manifest directory.
#[derive(Debug, thiserror::Error)]
pub enum ManifestDirError {
    /// The directory cannot be listed.
    #[error("reading {path}: {source}")]
    List {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A manifest file cannot be read.
    #[error("{0}")]
    Read(#[from] io::Error),
    /// A manifest is not YAML or JSON, or a `Pod` document in it is not a pod.
    #[error("{0}")]
    Manifest(#[from] ManifestError),
    /// A `Namespace` document's labels do not parse.
    #[error("namespace {namespace} in {path}: labels: {source}")]
    Labels {
        /// The namespace.
        namespace: String,
        /// Its manifest.
        path: PathBuf,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// The reading task failed.
    #[error("reading manifests: {0}")]
    Task(#[from] tokio::task::JoinError),
}

/// The directory source.
#[derive(Debug)]
pub struct DirPods {
    dir: PathBuf,
}

impl DirPods {
    /// A source reading `dir`.
    #[must_use]
    pub fn new(dir: PathBuf) -> Self {
        Self { dir }
    }

    pub(super) fn describe(&self) -> String {
        format!("pod manifest directory {}", self.dir.display())
    }

    /// The labels of `namespace`, from a `kind: Namespace` manifest in the directory (none:
    /// no labels; standalone namespaces need not be declared).
    pub(super) async fn namespace_labels(
        &self,
        namespace: &str,
    ) -> Result<BTreeMap<String, String>, ManifestDirError> {
        let dir = self.dir.clone();
        let namespace = namespace.to_owned();
        tokio::task::spawn_blocking(move || namespace_labels(&dir, &namespace)).await?
    }

    pub(super) async fn lookup(&self, namespace: &str, name: &str) -> Lookup {
        let dir = self.dir.clone();
        let (namespace, name) = (namespace.to_owned(), name.to_owned());
        tokio::task::spawn_blocking(move || find(&dir, &namespace, &name))
            .await
            .unwrap_or_else(|e| Lookup::Failed(format!("reading manifests: {e}")))
    }
}

/// The manifest files of `dir`, in name order.
fn manifests(dir: &Path) -> Result<Vec<PathBuf>, ManifestDirError> {
    let entries = std::fs::read_dir(dir).map_err(|source| ManifestDirError::List {
        path: dir.to_owned(),
        source,
    })?;
    let mut paths: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|path| {
            path.extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| matches!(e, "yaml" | "yml" | "json"))
        })
        .collect();
    paths.sort();
    Ok(paths)
}

fn namespace_labels(
    dir: &Path,
    namespace: &str,
) -> Result<BTreeMap<String, String>, ManifestDirError> {
    for path in manifests(dir)? {
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        let Ok(documents) = manifest::documents(&text) else {
            continue;
        };
        for document in documents {
            if document.get("kind").and_then(Value::as_str) != Some("Namespace")
                || document.pointer("/metadata/name").and_then(Value::as_str) != Some(namespace)
            {
                continue;
            }
            let labels = document
                .pointer("/metadata/labels")
                .cloned()
                .unwrap_or(Value::Null);
            return serde_json::from_value::<Option<BTreeMap<String, String>>>(labels)
                .map(Option::unwrap_or_default)
                .map_err(|source| ManifestDirError::Labels {
                    namespace: namespace.to_owned(),
                    path: path.clone(),
                    source,
                });
        }
    }
    Ok(BTreeMap::new())
}

fn find(dir: &Path, namespace: &str, name: &str) -> Lookup {
    let paths = match manifests(dir) {
        Ok(paths) => paths,
        Err(err) => return Lookup::Failed(err.to_string()),
    };
    let mut broken = Vec::new();
    for path in paths {
        let parsed = std::fs::read_to_string(&path)
            .map_err(ManifestDirError::from)
            .and_then(|text| manifest::pods(&text).map_err(ManifestDirError::from));
        match parsed {
            Ok(pods) => {
                if let Some(pod) = pods.into_iter().find(|p| {
                    p.metadata.name.as_deref() == Some(name)
                        && p.metadata.namespace.as_deref().unwrap_or("default") == namespace
                }) {
                    return Lookup::Found(Box::new(pod));
                }
            }
            Err(reason) => {
                warn!(path = %path.display(), %reason, "skipping a manifest that does not parse");
                broken.push(format!("{}: {reason}", path.display()));
            }
        }
    }
    let hint = if broken.is_empty() {
        String::new()
    } else {
        format!(" (manifests that do not parse: {})", broken.join("; "))
    };
    Lookup::Missing { hint }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespace_labels_come_from_namespace_manifests() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("ns.yaml"),
            "kind: Namespace\nmetadata: {name: mesh, labels: {istio.io/dataplane-mode: ambient}}\n",
        )
        .unwrap();
        let labels = namespace_labels(dir.path(), "mesh").unwrap();
        assert_eq!(labels["istio.io/dataplane-mode"], "ambient");
        assert!(namespace_labels(dir.path(), "other").unwrap().is_empty());
    }

    #[test]
    fn lookup_defaults_the_namespace_and_reports_broken_files() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("web.yaml"),
            "kind: Pod\nmetadata: {name: web}\nspec: {containers: []}\n",
        )
        .unwrap();
        std::fs::write(dir.path().join("bad.json"), "{not json").unwrap();
        assert!(matches!(
            find(dir.path(), "default", "web"),
            Lookup::Found(_)
        ));
        match find(dir.path(), "default", "nope") {
            Lookup::Missing { hint } => assert!(hint.contains("bad.json"), "{hint}"),
            _ => panic!("expected a miss"),
        }
    }
}
