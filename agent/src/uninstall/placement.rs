//! Whether the agent's DaemonSet still places a pod on this node: its pod template's
//! `nodeSelector` and required node affinity against the node, as the scheduler reads them
//! (Kubernetes' `component-helpers/scheduling/corev1/nodeaffinity`). A DaemonSet that is there but no longer
//! takes the node is not a restart: its pod never comes back, so a stopping agent uninstalls,
//! as Istio's node agent does (`cni/pkg/nodeagent/server.go`, `ShouldStopCleanup`, at
//! 86c9f01) — else the plugin's entry stays and the node's mesh pods wait for an agent that
//! will never run there.
use k8s_openapi::api::{
    apps::v1::DaemonSet,
    core::v1::{Node, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, PodSpec},
};

/// What the DaemonSet's placement says of this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Placement {
    /// It places a pod here (no required node affinity, or one the node meets).
    Takes,
    /// Its required node affinity no longer takes the node, in words.
    Excludes(String),
    /// Not known: the node could not be read, or the affinity cannot be evaluated (in words).
    Unknown(String),
}

/// Whether `daemon_set`'s pod template constrains its nodes (a `nodeSelector`, a required node
/// affinity): only then is the node worth reading.
#[must_use]
pub fn constrained(daemon_set: &DaemonSet) -> bool {
    required(daemon_set).is_some() || selector_of(daemon_set).is_some_and(|s| !s.is_empty())
}

/// What `daemon_set`'s placement says of `node`, named `name`.
#[must_use]
pub fn of(daemon_set: &DaemonSet, node: &Node, name: &str) -> Placement {
    let labels = node.metadata.labels.as_ref();
    for (key, wanted) in selector_of(daemon_set).into_iter().flatten() {
        let value = labels.and_then(|l| l.get(key));
        if value != Some(wanted) {
            return Placement::Excludes(format!(
                "node {name} lacks its nodeSelector's {key}={wanted} (it has {})",
                value.map_or_else(|| "none".to_owned(), |v| format!("{key}={v}"))
            ));
        }
    }
    let Some(selector) = required(daemon_set) else {
        return Placement::Takes;
    };
    match matches(selector, node) {
        Ok(true) => Placement::Takes,
        Ok(false) => Placement::Excludes(excluded(name, selector)),
        Err(why) => Placement::Unknown(format!("its node affinity: {why}")),
    }
}

/// The pod template's spec of `daemon_set`.
fn pod_spec(daemon_set: &DaemonSet) -> Option<&PodSpec> {
    daemon_set.spec.as_ref()?.template.spec.as_ref()
}

fn selector_of(daemon_set: &DaemonSet) -> Option<&std::collections::BTreeMap<String, String>> {
    pod_spec(daemon_set)?.node_selector.as_ref()
}

/// The required node affinity of `daemon_set`'s pod template, if it has one.
fn required(daemon_set: &DaemonSet) -> Option<&NodeSelector> {
    pod_spec(daemon_set)?
        .affinity
        .as_ref()?
        .node_affinity
        .as_ref()?
        .required_during_scheduling_ignored_during_execution
        .as_ref()
}

/// Whether `node` meets `selector`: any of its terms, each term every one of its requirements
/// (a term with none meets no node).
///
/// # Errors
/// A requirement the API server would not have admitted (an unknown operator, `Gt` without
/// exactly one integer, a field other than `metadata.name`), in words.
fn matches(selector: &NodeSelector, node: &Node) -> Result<bool, String> {
    let mut met = false;
    for term in &selector.node_selector_terms {
        met |= term_matches(term, node)?;
    }
    Ok(met)
}

fn term_matches(term: &NodeSelectorTerm, node: &Node) -> Result<bool, String> {
    let expressions = term.match_expressions.as_deref().unwrap_or_default();
    let fields = term.match_fields.as_deref().unwrap_or_default();
    if expressions.is_empty() && fields.is_empty() {
        return Ok(false);
    }
    let labels = node.metadata.labels.as_ref();
    let mut met = true;
    for requirement in expressions {
        let value = labels
            .and_then(|l| l.get(&requirement.key))
            .map(String::as_str);
        met &= requirement_matches(requirement, value)?;
    }
    for requirement in fields {
        if requirement.key != "metadata.name" {
            return Err(format!(
                "matchFields key {:?}: only metadata.name is supported",
                requirement.key
            ));
        }
        let values = requirement.values.as_deref().unwrap_or_default();
        if values.len() != 1 || !matches!(requirement.operator.as_str(), "In" | "NotIn") {
            return Err(format!(
                "matchFields on metadata.name: {} with {} values (In or NotIn with one)",
                requirement.operator,
                values.len()
            ));
        }
        let name = node.metadata.name.as_deref();
        met &= requirement_matches(requirement, name)?;
    }
    Ok(met)
}

/// One requirement against the node's `value` of its key (`None`: the node has no such label).
fn requirement_matches(
    requirement: &NodeSelectorRequirement,
    value: Option<&str>,
) -> Result<bool, String> {
    let values = requirement.values.as_deref().unwrap_or_default();
    let key = &requirement.key;
    let bound = || match values {
        [one] => one
            .parse::<i64>()
            .map_err(|_| format!("{key} {}: {one:?} is not an integer", requirement.operator)),
        _ => Err(format!(
            "{key} {}: {} values, one integer wanted",
            requirement.operator,
            values.len()
        )),
    };
    let number = || value.and_then(|v| v.parse::<i64>().ok());
    Ok(match requirement.operator.as_str() {
        "In" => value.is_some_and(|v| values.iter().any(|w| w == v)),
        "NotIn" => !value.is_some_and(|v| values.iter().any(|w| w == v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" => {
            let bound = bound()?;
            number().is_some_and(|n| n > bound)
        }
        "Lt" => {
            let bound = bound()?;
            number().is_some_and(|n| n < bound)
        }
        other => return Err(format!("{key}: unknown operator {other:?}")),
    })
}

/// In words, for the verdict: the node and the affinity that no longer takes it.
fn excluded(node: &str, selector: &NodeSelector) -> String {
    let terms: Vec<String> = selector
        .node_selector_terms
        .iter()
        .map(|term| {
            let mut parts: Vec<String> = Vec::new();
            for r in term.match_expressions.iter().flatten() {
                parts.push(words(r));
            }
            for r in term.match_fields.iter().flatten() {
                parts.push(words(r));
            }
            parts.join(" and ")
        })
        .collect();
    format!(
        "node {node} meets none of its required node affinity's terms ({})",
        terms.join("; or ")
    )
}

fn words(r: &NodeSelectorRequirement) -> String {
    match r.values.as_deref() {
        Some(values) if !values.is_empty() => {
            format!("{} {} [{}]", r.key, r.operator, values.join(", "))
        }
        _ => format!("{} {}", r.key, r.operator),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use serde_json::json;

    use super::*;

    fn node(labels: &[(&str, &str)]) -> Node {
        Node {
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                name: Some("node-1".into()),
                labels: Some(
                    labels
                        .iter()
                        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                        .collect::<BTreeMap<_, _>>(),
                ),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn selector(terms: serde_json::Value) -> NodeSelector {
        serde_json::from_value(json!({ "nodeSelectorTerms": terms })).expect("a NodeSelector")
    }

    /// The node-by-node switch of docs/install.md: meshcap's agents go where the label says.
    #[test]
    fn the_switchs_affinity_takes_and_excludes_nodes() {
        let meshcap = selector(json!([{"matchExpressions": [
            {"key": "meshcap.io/cni", "operator": "In", "values": ["both", "meshcap"]}]}]));
        assert_eq!(
            matches(&meshcap, &node(&[("meshcap.io/cni", "meshcap")])),
            Ok(true)
        );
        assert_eq!(
            matches(&meshcap, &node(&[("meshcap.io/cni", "istio")])),
            Ok(false)
        );
        assert_eq!(matches(&meshcap, &node(&[])), Ok(false));
        let istio = selector(json!([{"matchExpressions": [
            {"key": "meshcap.io/cni", "operator": "NotIn", "values": ["meshcap"]}]}]));
        assert_eq!(matches(&istio, &node(&[])), Ok(true));
        assert_eq!(
            matches(&istio, &node(&[("meshcap.io/cni", "meshcap")])),
            Ok(false)
        );
    }

    /// Terms are ORed, requirements within a term ANDed; an empty term meets nothing.
    #[test]
    fn terms_and_requirements_combine_as_the_schedulers() {
        let arch_and_zone = selector(json!([
            {"matchExpressions": [
                {"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64", "arm64"]},
                {"key": "zone", "operator": "Exists"}]},
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-1"]}]}
        ]));
        assert_eq!(matches(&arch_and_zone, &node(&[])), Ok(true), "by name");
        let without_name = selector(json!([
            {"matchExpressions": [
                {"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]},
                {"key": "zone", "operator": "Exists"}]}]));
        assert_eq!(
            matches(&without_name, &node(&[("kubernetes.io/arch", "amd64")])),
            Ok(false)
        );
        assert_eq!(
            matches(
                &without_name,
                &node(&[("kubernetes.io/arch", "amd64"), ("zone", "a")])
            ),
            Ok(true)
        );
        assert_eq!(matches(&selector(json!([{}])), &node(&[])), Ok(false));
        let gone = selector(json!([{"matchExpressions": [
            {"key": "drain", "operator": "DoesNotExist"}]}]));
        assert_eq!(matches(&gone, &node(&[("drain", "")])), Ok(false));
    }

    #[test]
    fn gt_and_lt_compare_integers() {
        let gt = selector(json!([{"matchExpressions": [
            {"key": "gen", "operator": "Gt", "values": ["3"]}]}]));
        assert_eq!(matches(&gt, &node(&[("gen", "4")])), Ok(true));
        assert_eq!(matches(&gt, &node(&[("gen", "3")])), Ok(false));
        assert_eq!(matches(&gt, &node(&[("gen", "x")])), Ok(false));
        let lt = selector(json!([{"matchExpressions": [
            {"key": "gen", "operator": "Lt", "values": ["3"]}]}]));
        assert_eq!(matches(&lt, &node(&[("gen", "2")])), Ok(true));
        let bad = selector(json!([{"matchExpressions": [
            {"key": "gen", "operator": "Gt", "values": ["three"]}]}]));
        assert!(matches(&bad, &node(&[])).is_err());
    }

    #[test]
    fn what_the_api_server_would_refuse_is_an_error() {
        for terms in [
            json!([{"matchExpressions": [{"key": "k", "operator": "Near"}]}]),
            json!([{"matchFields": [{"key": "metadata.uid", "operator": "In", "values": ["u"]}]}]),
            json!([{"matchFields": [{"key": "metadata.name", "operator": "Exists"}]}]),
        ] {
            assert!(
                matches(&selector(terms.clone()), &node(&[])).is_err(),
                "{terms}"
            );
        }
    }

    /// The chart's DaemonSet: Linux nodes by `nodeSelector`, the image's architectures by
    /// affinity.
    #[test]
    fn the_charts_placement_takes_linux_nodes_of_its_architectures() {
        let ds: DaemonSet = serde_json::from_value(json!({"spec": {
            "selector": {}, "template": {"spec": {
                "containers": [],
                "nodeSelector": {"kubernetes.io/os": "linux"},
                "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution":
                    {"nodeSelectorTerms": [{"matchExpressions": [{"key": "kubernetes.io/arch",
                        "operator": "In", "values": ["amd64", "arm64"]}]}]}}}}}}}))
        .expect("a DaemonSet");
        assert!(constrained(&ds));
        let linux = node(&[
            ("kubernetes.io/os", "linux"),
            ("kubernetes.io/arch", "arm64"),
        ]);
        assert_eq!(of(&ds, &linux, "node-1"), Placement::Takes);
        let windows = node(&[
            ("kubernetes.io/os", "windows"),
            ("kubernetes.io/arch", "amd64"),
        ]);
        assert_eq!(
            of(&ds, &windows, "node-1"),
            Placement::Excludes(
                "node node-1 lacks its nodeSelector's kubernetes.io/os=linux (it has \
                 kubernetes.io/os=windows)"
                    .into()
            )
        );
        let s390 = node(&[
            ("kubernetes.io/os", "linux"),
            ("kubernetes.io/arch", "s390x"),
        ]);
        assert!(matches!(of(&ds, &s390, "node-1"), Placement::Excludes(_)));
        assert!(!constrained(&DaemonSet::default()));
    }

    #[test]
    fn the_exclusion_names_the_node_and_the_terms() {
        let s = selector(json!([{"matchExpressions": [
            {"key": "meshcap.io/cni", "operator": "In", "values": ["both", "meshcap"]}]}]));
        assert_eq!(
            excluded("node-1", &s),
            "node node-1 meets none of its required node affinity's terms \
             (meshcap.io/cni In [both, meshcap])"
        );
    }
}
