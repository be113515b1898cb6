//! Ambient enrollment: any pod and namespace labels, ambient annotations, host network, sidecar
//! status and enablement selectors give a decision, or an error naming the selector or the
//! pod's annotation, never a panic. A pod on the host network or with a sidecar is never
//! enrolled, nor one in an excluded namespace; an enrolled pod's in-pod rules render, the same
//! every time, with IPv6 exactly when `ambient.ipv6` is on, and name only valid interfaces.
#![no_main]

use std::collections::BTreeMap;

use k8s_openapi::{
    api::core::v1::{Pod, PodSpec},
    apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement},
};
use libfuzzer_sys::{
    arbitrary::{self, Arbitrary},
    fuzz_target,
};
use meshcap_policy::{
    PolicyError,
    ambient::{self, AmbientConfig, EnablementSelector, Enrollment, ambient_keys},
    keys,
};

const KEYS: [&str; 4] = [ambient_keys::DATAPLANE_MODE, "app", "tier", ""];
const VALUES: [&str; 6] = ["ambient", "none", "ztunnel", "web", "", "True"];
const OPERATORS: [&str; 5] = ["In", "NotIn", "Exists", "DoesNotExist", "in"];
const ANNOTATIONS: [&str; 4] = [
    ambient_keys::BYPASS_INBOUND_CAPTURE,
    ambient_keys::DNS_CAPTURE,
    keys::REROUTE_VIRTUAL_INTERFACES,
    keys::STATUS,
];
const NAMESPACES: [&str; 4] = ["default", "istio-system", "kube-system", "shop"];

/// A word from a small set (so that selectors and labels meet), or any text.
#[derive(Arbitrary, Debug)]
enum Word {
    Known(u8),
    Any(String),
}

impl Word {
    fn get(&self, known: &[&str]) -> String {
        match self {
            Self::Known(i) => known[usize::from(*i) % known.len()].to_owned(),
            Self::Any(text) => text.clone(),
        }
    }
}

#[derive(Arbitrary, Debug)]
struct Expression {
    key: Word,
    operator: Word,
    values: Vec<Word>,
}

#[derive(Arbitrary, Debug)]
struct Selector {
    labels: Vec<(Word, Word)>,
    expressions: Option<Vec<Expression>>,
}

impl Selector {
    fn get(&self) -> LabelSelector {
        let labels: BTreeMap<String, String> = self
            .labels
            .iter()
            .map(|(k, v)| (k.get(&KEYS), v.get(&VALUES)))
            .collect();
        LabelSelector {
            match_labels: (!labels.is_empty()).then_some(labels),
            match_expressions: self.expressions.as_ref().map(|expressions| {
                expressions
                    .iter()
                    .map(|e| LabelSelectorRequirement {
                        key: e.key.get(&KEYS),
                        operator: e.operator.get(&OPERATORS),
                        values: Some(e.values.iter().map(|v| v.get(&VALUES)).collect()),
                    })
                    .collect()
            }),
        }
    }
}

#[derive(Arbitrary, Debug)]
struct Input {
    /// `None`: Istio's defaults.
    selectors: Option<Vec<(Selector, Selector)>>,
    pod_labels: Vec<(Word, Word)>,
    namespace_labels: Vec<(Word, Word)>,
    annotations: Vec<(u8, Word)>,
    namespace: u8,
    host_network: Option<bool>,
    dns_capture: bool,
    ipv6: bool,
}

fn labels(pairs: &[(Word, Word)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.get(&KEYS), v.get(&VALUES)))
        .collect()
}

fuzz_target!(|input: Input| {
    let mut config = match &input.selectors {
        None => AmbientConfig::default(),
        Some(selectors) => {
            let selectors = selectors
                .iter()
                .map(|(pod, namespace)| EnablementSelector {
                    pod_selector: pod.get(),
                    namespace_selector: namespace.get(),
                })
                .collect();
            match AmbientConfig::new(selectors) {
                Ok(config) => config,
                Err(err) => {
                    assert!(err.to_string().starts_with("ambient.enablementSelectors["));
                    return;
                }
            }
        }
    };
    config.dns_capture = input.dns_capture;
    config.ipv6 = input.ipv6;
    let annotations: BTreeMap<String, String> = input
        .annotations
        .iter()
        .map(|(k, v)| {
            let key = ANNOTATIONS[usize::from(*k) % ANNOTATIONS.len()].to_owned();
            (
                key,
                v.get(&["true", "false", "eth1,net-2", " , ", "-j ACCEPT", "1"]),
            )
        })
        .collect();
    let sidecar = annotations.contains_key(keys::STATUS);
    let namespace = NAMESPACES[usize::from(input.namespace) % NAMESPACES.len()];
    let mut pod = Pod::default();
    pod.metadata.name = Some("app".to_owned());
    pod.metadata.namespace = Some(namespace.to_owned());
    pod.metadata.labels = Some(labels(&input.pod_labels));
    pod.metadata.annotations = Some(annotations);
    pod.spec = Some(PodSpec {
        host_network: input.host_network,
        ..PodSpec::default()
    });
    let excluded = ["kube-system".to_owned()];
    match ambient::enroll(&pod, &labels(&input.namespace_labels), &excluded, &config) {
        Err(err) => assert!(matches!(err, PolicyError::InvalidInterface { .. }), "{err}"),
        Ok(Enrollment::NotEnrolled { .. }) => {}
        Ok(Enrollment::Enrolled { policy, .. }) => {
            assert!(
                input.host_network != Some(true),
                "a host-network pod enrolled"
            );
            assert!(!sidecar, "a sidecar pod enrolled");
            assert_ne!(
                namespace, "kube-system",
                "an excluded namespace's pod enrolled"
            );
            let rules = policy.render();
            assert_eq!(rules, policy.render());
            assert_eq!(rules.v6.is_some(), config.ipv6);
            for name in &policy.virtual_interfaces {
                assert!(
                    !name.is_empty() && name.len() <= 15 && !name.contains(' '),
                    "{name:?}"
                );
            }
        }
    }
});
