//! Fuzzes the annotation parsers and the whole pod → policy → rules path: no input may panic,
//! and every rendered rule set must parse in the evaluator.
#![no_main]

use libfuzzer_sys::fuzz_target;
use meshcap_agent::policy::{self, RuleEvaluator, SelectConfig, Selection, annotations, keys};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = annotations::parse_go_bool(text);
    let _ = annotations::parse_port_list(text);
    let _ = annotations::parse_cidr_list(text);
    let _ = annotations::parse_interface_list(text);
    let _ = text.parse::<policy::IpPrefix>();

    // Lines become annotation values, key chosen by line number.
    let mut map = serde_json::Map::new();
    map.insert("sidecar.istio.io/status".into(), "{}".into());
    for (index, line) in text.lines().enumerate() {
        map.insert(
            keys::POLICY_ANNOTATIONS[index % keys::POLICY_ANNOTATIONS.len()].into(),
            line.into(),
        );
    }
    let manifest = serde_json::json!({
        "metadata": {"name": "fuzz", "namespace": "default", "annotations": map},
        "spec": {"containers": [{"name": "istio-proxy"}]},
    });
    let pod = policy::parse_pod_manifest(&manifest.to_string()).expect("a pod");
    let ips = ["10.0.0.2".parse().unwrap(), "fd00::2".parse().unwrap()];
    if let Ok(Selection::Capture { policy }) = policy::select(&pod, &ips, &SelectConfig::default())
    {
        let rules = policy.render();
        RuleEvaluator::new(&rules).expect("rendered rules parse");
    }
});
