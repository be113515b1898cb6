//! Istio's `ambient.enablementSelectors`, read as Kubernetes reads label selectors
//! (`LabelSelectorAsSelector`): each compiled once, when the settings are read, into
//! requirements that must all hold.
use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};
use serde::{Deserialize, Serialize};

use super::ambient_keys;

/// One of Istio's `ambient.enablementSelectors`: a pod is enrolled when its labels match
/// `podSelector` and its namespace's labels match `namespaceSelector` (an empty selector
/// matches everything).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EnablementSelector {
    /// Against the pod's labels.
    #[serde(default)]
    pub pod_selector: LabelSelector,
    /// Against the pod's namespace's labels.
    #[serde(default)]
    pub namespace_selector: LabelSelector,
}

impl EnablementSelector {
    /// Istio's chart default: the pod labelled `istio.io/dataplane-mode=ambient`, or its
    /// namespace so labelled and the pod not labelled `none`.
    #[must_use]
    pub fn istio_defaults() -> Vec<Self> {
        let label = |value: &str| {
            Some(BTreeMap::from([(
                ambient_keys::DATAPLANE_MODE.to_owned(),
                value.to_owned(),
            )]))
        };
        vec![
            Self {
                pod_selector: LabelSelector {
                    match_labels: label("ambient"),
                    match_expressions: None,
                },
                namespace_selector: LabelSelector::default(),
            },
            Self {
                pod_selector: LabelSelector {
                    match_labels: None,
                    match_expressions: Some(vec![LabelSelectorRequirement {
                        key: ambient_keys::DATAPLANE_MODE.to_owned(),
                        operator: "NotIn".to_owned(),
                        values: Some(vec!["none".to_owned()]),
                    }]),
                },
                namespace_selector: LabelSelector {
                    match_labels: label("ambient"),
                    match_expressions: None,
                },
            },
        ]
    }
}

/// A selector that cannot be compiled, as Kubernetes' `LabelSelectorAsSelector` refuses it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("ambient.enablementSelectors[{index}]: {reason}")]
pub struct SelectorError {
    /// Which selector.
    pub index: usize,
    /// What is wrong with it.
    pub reason: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Operator {
    In,
    NotIn,
    Exists,
    DoesNotExist,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Requirement {
    key: String,
    operator: Operator,
    values: BTreeSet<String>,
}

/// A compiled label selector: every requirement must hold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Selector(Vec<Requirement>);

impl Selector {
    /// Compiles `selector`, the `index`th of `ambient.enablementSelectors`.
    pub(super) fn compile(selector: &LabelSelector, index: usize) -> Result<Self, SelectorError> {
        let refused = |reason: String| SelectorError { index, reason };
        let mut requirements = Vec::new();
        for (key, value) in selector.match_labels.iter().flatten() {
            requirements.push(Requirement {
                key: key.clone(),
                operator: Operator::In,
                values: BTreeSet::from([value.clone()]),
            });
        }
        for expression in selector.match_expressions.iter().flatten() {
            let values: BTreeSet<String> = expression.values.iter().flatten().cloned().collect();
            let operator = match expression.operator.as_str() {
                "In" => Operator::In,
                "NotIn" => Operator::NotIn,
                "Exists" => Operator::Exists,
                "DoesNotExist" => Operator::DoesNotExist,
                other => return Err(refused(format!("{other:?} is not a selector operator"))),
            };
            let wants_values = matches!(operator, Operator::In | Operator::NotIn);
            if wants_values == values.is_empty() {
                return Err(refused(format!(
                    "{} on key {:?} takes {} values",
                    expression.operator,
                    expression.key,
                    if wants_values { "one or more" } else { "no" }
                )));
            }
            requirements.push(Requirement {
                key: expression.key.clone(),
                operator,
                values,
            });
        }
        if let Some(empty) = requirements.iter().find(|r| r.key.is_empty()) {
            return Err(refused(format!("an empty key ({:?})", empty.operator)));
        }
        Ok(Self(requirements))
    }

    pub(super) fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.0.iter().all(|r| {
            let value = labels.get(&r.key);
            match r.operator {
                Operator::In => value.is_some_and(|v| r.values.contains(v)),
                Operator::NotIn => value.is_none_or(|v| !r.values.contains(v)),
                Operator::Exists => value.is_some(),
                Operator::DoesNotExist => value.is_none(),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ambient::AmbientConfig;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn expression(key: &str, operator: &str, values: &[&str]) -> LabelSelectorRequirement {
        LabelSelectorRequirement {
            key: key.to_owned(),
            operator: operator.to_owned(),
            values: Some(values.iter().map(|v| (*v).to_owned()).collect()),
        }
    }

    fn selecting(
        expressions: Vec<LabelSelectorRequirement>,
    ) -> Result<AmbientConfig, SelectorError> {
        AmbientConfig::new(vec![EnablementSelector {
            pod_selector: LabelSelector {
                match_labels: None,
                match_expressions: Some(expressions),
            },
            namespace_selector: LabelSelector::default(),
        }])
    }

    #[test]
    fn selector_operators_as_kubernetes_reads_them() {
        let config = selecting(vec![
            expression("mesh", "Exists", &[]),
            expression("legacy", "DoesNotExist", &[]),
            expression("tier", "In", &["web", "api"]),
            expression("stage", "NotIn", &["test"]),
        ])
        .unwrap();
        let selects = |pairs: &[(&str, &str)]| config.selects(&labels(pairs), &BTreeMap::new());
        assert!(selects(&[("mesh", ""), ("tier", "api")]));
        assert!(selects(&[
            ("mesh", "x"),
            ("tier", "web"),
            ("stage", "prod")
        ]));
        assert!(!selects(&[("tier", "web")]));
        assert!(!selects(&[("mesh", ""), ("tier", "db")]));
        assert!(!selects(&[("mesh", ""), ("tier", "web"), ("legacy", "1")]));
        assert!(!selects(&[
            ("mesh", ""),
            ("tier", "web"),
            ("stage", "test")
        ]));
    }

    #[test]
    fn a_selector_kubernetes_refuses_is_an_error_naming_it() {
        let err = |expressions| selecting(expressions).unwrap_err().to_string();
        assert_eq!(
            err(vec![expression("a", "In", &[])]),
            "ambient.enablementSelectors[0]: In on key \"a\" takes one or more values"
        );
        assert_eq!(
            err(vec![expression("a", "Exists", &["x"])]),
            "ambient.enablementSelectors[0]: Exists on key \"a\" takes no values"
        );
        assert_eq!(
            err(vec![expression("a", "Equals", &["x"])]),
            "ambient.enablementSelectors[0]: \"Equals\" is not a selector operator"
        );
    }

    #[test]
    fn the_selectors_read_as_istio_values_write_them() {
        let yaml = r#"[
            {"podSelector": {"matchLabels": {"istio.io/dataplane-mode": "ambient"}}},
            {"podSelector": {"matchExpressions": [
                {"key": "istio.io/dataplane-mode", "operator": "NotIn", "values": ["none"]}]},
             "namespaceSelector": {"matchLabels": {"istio.io/dataplane-mode": "ambient"}}}
        ]"#;
        let read: Vec<EnablementSelector> = serde_json::from_str(yaml).unwrap();
        assert_eq!(read, EnablementSelector::istio_defaults());
    }
}
