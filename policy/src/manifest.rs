//! Pod manifests as `kubectl get pod -o yaml` or `-o json` prints them, for the pod directory
//! (standalone mode) and `meshcap-agent policy --pod`. JSON is read as JSON: it is also YAML,
//! but a YAML reader refuses control characters that JSON strings may carry raw (U+007F, as
//! serde_json and `kubectl -o json` write it) and folds others (U+0085 becomes a space), so one
//! such character in any annotation would fail or change every pod of the file.
use k8s_openapi::api::core::v1::Pod;
use serde::Deserialize as _;
use serde_json::Value;

use super::ManifestError;

/// Whether `text` is JSON rather than YAML: it opens with an object or an array (a YAML
/// document written by `kubectl` or by hand never does).
fn is_json(text: &str) -> bool {
    matches!(text.trim_start().as_bytes().first(), Some(b'{' | b'['))
}

/// Every document of a manifest: JSON values one after another, or YAML documents separated
/// by `---`.
///
/// # Errors
/// When the text does not parse.
pub fn documents(text: &str) -> Result<Vec<Value>, ManifestError> {
    if is_json(text) {
        Ok(serde_json::Deserializer::from_str(text)
            .into_iter::<Value>()
            .collect::<Result<_, _>>()?)
    } else {
        let mut out = Vec::new();
        for document in yaml_serde::Deserializer::from_str(text) {
            out.push(Value::deserialize(document)?);
        }
        Ok(out)
    }
}

/// Parses one pod manifest, YAML or JSON.
///
/// # Errors
/// The text is not a pod.
pub fn parse_pod_manifest(text: &str) -> Result<Pod, ManifestError> {
    if is_json(text) {
        Ok(serde_json::from_str(text)?)
    } else {
        Ok(yaml_serde::from_str(text)?)
    }
}

/// Every pod in one manifest file's text: its `Pod` documents and the pods of its `List`s
/// (`PodList`s).
///
/// # Errors
/// When the text is not YAML/JSON, or a `Pod` document does not parse as one.
pub fn pods(text: &str) -> Result<Vec<Pod>, ManifestError> {
    let mut pods = Vec::new();
    for document in documents(text)? {
        collect(document, &mut pods)?;
    }
    Ok(pods)
}

fn collect(value: Value, pods: &mut Vec<Pod>) -> Result<(), ManifestError> {
    match value.get("kind").and_then(Value::as_str) {
        Some("Pod") => {
            let name = value
                .pointer("/metadata/name")
                .and_then(Value::as_str)
                .unwrap_or("<unnamed>")
                .to_owned();
            pods.push(
                serde_json::from_value(value)
                    .map_err(|source| ManifestError::Pod { name, source })?,
            );
        }
        Some("List" | "PodList") => {
            if let Some(Value::Array(items)) = value.get("items").cloned() {
                for item in items {
                    collect(item, pods)?;
                }
            }
        }
        _ => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A manifest as serde_json (and `kubectl -o json`) writes it: U+007F raw, U+0085 raw.
    /// What the agent reads must be what the file says.
    #[test]
    fn json_is_read_as_json_with_every_character_kept() {
        let value = "a\u{7f}b\u{85}c";
        let manifest = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "web",
                "namespace": "shop",
                "annotations": {"traffic.sidecar.istio.io/excludeInboundPorts": value},
            },
        })
        .to_string();
        assert!(manifest.contains('\u{7f}'), "serde_json writes U+007F raw");
        let pod = parse_pod_manifest(&manifest).expect("a pod");
        let annotations = pod.metadata.annotations.expect("annotations");
        assert_eq!(
            annotations["traffic.sidecar.istio.io/excludeInboundPorts"],
            value
        );
        let docs = documents(&format!("{manifest}\n{manifest}")).expect("two documents");
        assert_eq!(docs.len(), 2);
        assert_eq!(
            docs[1]["metadata"]["annotations"]["traffic.sidecar.istio.io/excludeInboundPorts"],
            value
        );
    }

    #[test]
    fn yaml_documents_and_errors() {
        let docs = documents("kind: Pod\n---\nkind: List\nitems: []\n").expect("YAML");
        assert_eq!(docs.len(), 2);
        assert_eq!(docs[1]["kind"], "List");
        assert!(matches!(
            parse_pod_manifest("{\"kind\": "),
            Err(ManifestError::Json(_))
        ));
        assert!(matches!(
            parse_pod_manifest("kind: [unclosed"),
            Err(ManifestError::Yaml(_))
        ));
    }

    #[test]
    fn several_documents_and_lists() {
        let text = "
apiVersion: v1
kind: Pod
metadata: {name: a, namespace: x}
spec: {containers: [{name: app, image: busybox}]}
---
apiVersion: v1
kind: ConfigMap
metadata: {name: ignored}
---
apiVersion: v1
kind: List
items:
- {apiVersion: v1, kind: Pod, metadata: {name: b}, spec: {containers: []}}
";
        let pods = pods(text).unwrap();
        let names: Vec<_> = pods
            .iter()
            .map(|p| p.metadata.name.clone().unwrap())
            .collect();
        assert_eq!(names, ["a", "b"]);
    }

    #[test]
    fn a_broken_pod_is_named() {
        let err = pods("kind: Pod\nmetadata: {name: web}\nspec: {containers: 7}\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("pod web"), "{err}");
    }
}
