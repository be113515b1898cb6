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
}
