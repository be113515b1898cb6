//! Pod manifests and pod JSON: the pod directory's files (YAML or JSON, several documents,
//! `List`s), `policy --pod`, and a pod as the API server sends it to the agent's watch and the
//! plugin's fallback. Any text gives pods or an error, never a panic; JSON is read as JSON, so
//! what the agent reads is exactly what the file says; and a pod read from the API goes
//! through the capture decision (selection, policy, rules) without a panic.
#![no_main]

use k8s_openapi::api::core::v1::Pod;
use libfuzzer_sys::fuzz_target;
use meshcap_policy::{self as policy, RuleEvaluator, SelectConfig, Selection, manifest};
use serde_json::Value;

fuzz_target!(|data: &[u8]| {
    if let Ok(pod) = serde_json::from_slice::<Pod>(data) {
        let ips = ["10.0.0.2".parse().unwrap(), "fd00::2".parse().unwrap()];
        if let Ok(Selection::Capture { policy }) =
            policy::select(&pod, &ips, &SelectConfig::default())
        {
            RuleEvaluator::new(&policy.render()).expect("rendered rules parse");
        }
    }
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = manifest::parse_pod_manifest(text);
    let pods = manifest::pods(text);
    let Ok(value) = serde_json::from_str::<Value>(text) else {
        return;
    };
    if !(value.is_object() || value.is_array()) {
        return;
    }
    // JSON as JSON: the documents are the value itself, however serde_json writes it.
    for written in [
        text.to_owned(),
        value.to_string(),
        serde_json::to_string_pretty(&value).expect("a value writes"),
    ] {
        let documents = manifest::documents(&written).expect("JSON is a manifest");
        assert_eq!(
            documents,
            std::slice::from_ref(&value),
            "read back from {written:?}"
        );
    }
    if value.get("kind").and_then(Value::as_str) == Some("Pod")
        && let Ok(pod) = serde_json::from_value::<Pod>(value.clone())
    {
        assert_eq!(
            pods.expect("the pod parses"),
            [pod],
            "the pod the file holds"
        );
    }
});
