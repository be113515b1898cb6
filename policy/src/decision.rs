//! What happens to a pod, decided in one place: left alone (and why), captured for its
//! sidecar with its [`RedirectPolicy`], or enrolled in ambient mode with its [`InpodPolicy`].
//! ADD, CHECK, the agent-down `decide`, live enrollment and the repair controller all ask
//! [`decide`]; nothing else in the agent evaluates Istio's selection ([`super::select`]) or
//! ambient mode's enrollment ([`super::ambient::enroll`]).
//!
//! Istio's order: on a node that runs ambient mode, ambient mode asks first (its plugin
//! `cni/pkg/plugin/plugin.go` checks the enablement selectors before the sidecar checks), then
//! the sidecar's checks and redirect inputs.
use std::{collections::BTreeMap, net::IpAddr};

use k8s_openapi::api::core::v1::Pod;
use serde::{Deserialize, Serialize};

use super::{
    PolicyError, RedirectPolicy, SelectConfig, Selection, SkipReason,
    ambient::{self, AmbientConfig, Enrollment, IgnoredAnnotation, InpodPolicy, NotEnrolledReason},
    select,
};

/// How a pod is in the mesh: Istio's data plane modes meshcap captures for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataplaneMode {
    /// Its own Envoy, injected beside the app.
    Sidecar,
    /// ztunnel, the node's proxy.
    Ambient,
}

impl std::fmt::Display for DataplaneMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Sidecar => "sidecar",
            Self::Ambient => "ambient",
        })
    }
}

/// The node's settings a pod's decision reads.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeSettings {
    /// Istio's node-level selection (excluded namespaces).
    pub select: SelectConfig,
    /// Ambient mode, when the node runs it.
    pub ambient: Option<AmbientConfig>,
}

/// What happens to a pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Left alone, as Istio's CNI plugin leaves it.
    Skip {
        /// Why the sidecar's capture does not apply.
        reason: SkipReason,
        /// On a node that runs ambient mode: why ambient mode does not enroll it.
        not_enrolled: Option<NotEnrolledReason>,
    },
    /// Its sidecar's capture.
    Sidecar {
        /// The capture.
        policy: Box<RedirectPolicy>,
        /// On a node that runs ambient mode: why ambient mode does not enroll it.
        not_enrolled: Option<NotEnrolledReason>,
    },
    /// Ambient mode's capture, served by ztunnel.
    Ambient {
        /// The in-pod capture.
        policy: InpodPolicy,
        /// Annotations Istio ignores as meshcap does (a boolean that is not one), to log.
        ignored: Vec<IgnoredAnnotation>,
    },
}

/// A pod whose annotations the mode that would capture it refuses: it must not start
/// uncaptured.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{error}")]
pub struct DecisionError {
    /// The mode whose inputs are wrong.
    pub dataplane: DataplaneMode,
    /// What is wrong, naming the pod, the annotation and the value.
    #[source]
    pub error: Box<PolicyError>,
}

/// Decides `pod`, whose addresses are `ips` (they decide whether a sidecar's IPv6 rules are
/// installed) and whose namespace carries `namespace_labels` (read only when
/// [`reads_namespace_labels`] says so), on a node with `node`'s settings.
///
/// # Errors
/// When the mode that would capture the pod refuses its annotations.
pub fn decide(
    pod: &Pod,
    ips: &[IpAddr],
    namespace_labels: &BTreeMap<String, String>,
    node: &NodeSettings,
) -> Result<Decision, DecisionError> {
    let exclude = &node.select.exclude_namespaces;
    let not_enrolled = match &node.ambient {
        None => None,
        Some(config) => {
            match ambient::enroll(pod, namespace_labels, exclude, config).map_err(|error| {
                DecisionError {
                    dataplane: DataplaneMode::Ambient,
                    error: Box::new(error),
                }
            })? {
                Enrollment::Enrolled { policy, ignored } => {
                    return Ok(Decision::Ambient { policy, ignored });
                }
                Enrollment::NotEnrolled { reason } => Some(reason),
            }
        }
    };
    let selection = select(pod, ips, &node.select).map_err(|error| DecisionError {
        dataplane: DataplaneMode::Sidecar,
        error: Box::new(error),
    })?;
    Ok(match selection {
        Selection::Skip { reason } => Decision::Skip {
            reason,
            not_enrolled,
        },
        Selection::Capture { policy } => Decision::Sidecar {
            policy,
            not_enrolled,
        },
    })
}

/// Whether [`decide`] reads the labels of `pod`'s namespace: on a node that runs ambient mode,
/// unless the pod alone rules ambient mode out (an excluded namespace, host network, a sidecar,
/// ztunnel itself). Callers look the namespace up only then.
#[must_use]
pub fn reads_namespace_labels(pod: &Pod, node: &NodeSettings) -> bool {
    node.ambient.as_ref().is_some_and(|config| {
        ambient::never_enrolled(pod, &node.select.exclude_namespaces, config).is_none()
    })
}

impl Decision {
    /// The mode that captures the pod; `None` when it is left alone.
    #[must_use]
    pub const fn dataplane(&self) -> Option<DataplaneMode> {
        match self {
            Self::Skip { .. } => None,
            Self::Sidecar { .. } => Some(DataplaneMode::Sidecar),
            Self::Ambient { .. } => Some(DataplaneMode::Ambient),
        }
    }

    /// The sidecar's half, as Istio's CNI plugin alone decides it; `None` for a pod ambient
    /// mode enrolls.
    #[must_use]
    pub fn selection(&self) -> Option<Selection> {
        match self {
            Self::Skip { reason, .. } => Some(Selection::Skip {
                reason: reason.clone(),
            }),
            Self::Sidecar { policy, .. } => Some(Selection::Capture {
                policy: policy.clone(),
            }),
            Self::Ambient { .. } => None,
        }
    }

    /// Ambient mode's half, on a node that runs it.
    #[must_use]
    pub fn enrollment(&self) -> Option<Enrollment> {
        match self {
            Self::Skip { not_enrolled, .. } | Self::Sidecar { not_enrolled, .. } => not_enrolled
                .clone()
                .map(|reason| Enrollment::NotEnrolled { reason }),
            Self::Ambient { policy, ignored } => Some(Enrollment::Enrolled {
                policy: policy.clone(),
                ignored: ignored.clone(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;
    use crate::ambient::ambient_keys;

    /// A pod of namespace `shop` named `web`, from `spec` and `metadata` (merged into Istio's
    /// injected shape when `injected`).
    fn pod(injected: bool, metadata: &Value, spec: &Value) -> Pod {
        let mut pod = json!({
            "metadata": {"name": "web", "namespace": "shop", "labels": {}, "annotations": {}},
            "spec": {"containers": [{"name": "app"}]},
        });
        if injected {
            pod["metadata"]["annotations"]["sidecar.istio.io/status"] = json!("{}");
            pod["spec"]["containers"] =
                json!([{"name": "app"}, {"name": "istio-proxy", "args": ["proxy", "sidecar"]}]);
        }
        merge(&mut pod["metadata"], metadata);
        merge(&mut pod["spec"], spec);
        serde_json::from_value(pod).expect("a pod")
    }

    fn merge(into: &mut Value, from: &Value) {
        match (into, from) {
            (Value::Object(into), Value::Object(from)) => {
                for (key, value) in from {
                    merge(into.entry(key.clone()).or_insert(Value::Null), value);
                }
            }
            (into, from) => *into = from.clone(),
        }
    }

    fn node(ambient: Option<AmbientConfig>) -> NodeSettings {
        NodeSettings {
            select: SelectConfig::default(),
            ambient,
        }
    }

    /// The decision in a few words: what the table compares.
    fn said(decision: &Result<Decision, DecisionError>) -> String {
        match decision {
            Ok(Decision::Skip {
                reason,
                not_enrolled,
            }) => match not_enrolled {
                None => format!("skip: {reason}"),
                Some(why) => format!("skip: {reason}; not ambient: {why}"),
            },
            Ok(Decision::Sidecar {
                policy,
                not_enrolled,
            }) => {
                let ipv6 = if policy.ipv6 { " ipv6" } else { "" };
                match not_enrolled {
                    None => format!("sidecar {}{ipv6}", policy.mode),
                    Some(why) => format!("sidecar {}{ipv6}; not ambient: {why}", policy.mode),
                }
            }
            Ok(Decision::Ambient { policy, ignored }) => format!(
                "ambient inbound={} dns={} virtual={:?} ignored={}",
                policy.inbound,
                policy.dns,
                policy.virtual_interfaces,
                ignored.len()
            ),
            Err(err) => format!("{:?} refuses: {err}", err.dataplane),
        }
    }

    const V4: &str = "10.0.0.2";

    /// A row: what it shows, the pod, its namespace's labels, the node, the pod's address,
    /// and the decision in words.
    type Row<'a> = (
        &'a str,
        Pod,
        &'a [(&'a str, &'a str)],
        &'a NodeSettings,
        &'a str,
        &'a str,
    );

    #[test]
    fn every_skip_reason_every_override_both_modes() {
        let off = node(None);
        let on = node(Some(AmbientConfig::default()));
        let mut quiet = AmbientConfig::default();
        quiet.dns_capture = false;
        let dns_off = node(Some(quiet));
        let ambient = json!({"labels": {ambient_keys::DATAPLANE_MODE: "ambient"}});
        let none = json!({"labels": {ambient_keys::DATAPLANE_MODE: "none"}});
        let labelled = [(ambient_keys::DATAPLANE_MODE, "ambient")];
        let no_labels: [(&str, &str); 0] = [];
        let proxy = |extra: Value| json!({"containers": [{"name": "app"}, extra]});
        #[rustfmt::skip]
        let rows: Vec<Row<'_>> = vec![
            // Sidecar mode: Istio's CNI plugin's checks, in its order.
            ("excluded namespace", pod(true, &json!({"namespace": "kube-system"}), &json!({})), &no_labels, &off, V4,
             "skip: namespace kube-system is excluded"),
            ("host network", pod(true, &json!({}), &json!({"hostNetwork": true})), &no_labels, &off, V4,
             "skip: the pod uses the host network"),
            ("istio-init", pod(true, &json!({}), &json!({"initContainers": [{"name": "istio-init"}]})), &no_labels, &off, V4,
             "skip: the pod has an istio-init container"),
            ("DISABLE_ENVOY", pod(true, &json!({}), &proxy(json!({"name": "istio-proxy", "env": [{"name": "DISABLE_ENVOY", "value": "true"}]}))), &no_labels, &off, V4,
             "skip: DISABLE_ENVOY is true on istio-proxy"),
            ("no proxy", pod(false, &json!({"annotations": {"sidecar.istio.io/status": "{}"}}), &json!({})), &no_labels, &off, V4,
             "skip: the pod has no istio-proxy container"),
            ("a gateway", pod(true, &json!({}), &proxy(json!({"name": "istio-proxy", "args": ["proxy", "router"]}))), &no_labels, &off, V4,
             "skip: istio-proxy is a router, not a sidecar"),
            ("inject label false", pod(true, &json!({"labels": {"sidecar.istio.io/inject": "false"}}), &json!({})), &no_labels, &off, V4,
             "skip: sidecar.istio.io/inject is \"false\""),
            ("inject annotation false", pod(true, &json!({"annotations": {"sidecar.istio.io/inject": "false"}}), &json!({})), &no_labels, &off, V4,
             "skip: sidecar.istio.io/inject is \"false\""),
            ("the inject label overrides the annotation", pod(true, &json!({"labels": {"sidecar.istio.io/inject": "true"}, "annotations": {"sidecar.istio.io/inject": "false"}}), &json!({})), &no_labels, &off, V4,
             "sidecar REDIRECT"),
            ("not injected", pod(false, &json!({}), &proxy(json!({"name": "istio-proxy"}))), &no_labels, &off, V4,
             "skip: the pod has no sidecar.istio.io/status annotation"),
            ("injected", pod(true, &json!({}), &json!({})), &no_labels, &off, V4,
             "sidecar REDIRECT"),
            ("interception mode overridden", pod(true, &json!({"annotations": {"sidecar.istio.io/interceptionMode": "TPROXY"}}), &json!({})), &no_labels, &off, V4,
             "sidecar TPROXY"),
            ("an IPv6 pod", pod(true, &json!({}), &json!({})), &no_labels, &off, "fd00::2",
             "sidecar REDIRECT ipv6"),
            ("a bad annotation", pod(true, &json!({"annotations": {"sidecar.istio.io/interceptionMode": "NAT"}}), &json!({})), &no_labels, &off, V4,
             "Sidecar refuses: pod shop/web: annotation sidecar.istio.io/interceptionMode: \"NAT\" is not an interception mode (REDIRECT or TPROXY)"),
            ("the ambient label where ambient mode is off", pod(false, &ambient, &json!({})), &no_labels, &off, V4,
             "skip: the pod has no istio-proxy container"),
            // Ambient mode asks first: its enablement selectors, then the sidecar's checks.
            ("the pod's label enrolls", pod(false, &ambient, &json!({})), &no_labels, &on, V4,
             "ambient inbound=true dns=true virtual=[] ignored=0"),
            ("its namespace's label enrolls", pod(false, &json!({}), &json!({})), &labelled, &on, V4,
             "ambient inbound=true dns=true virtual=[] ignored=0"),
            ("the pod's none overrides its namespace", pod(false, &none, &json!({})), &labelled, &on, V4,
             "skip: the pod has no istio-proxy container; not ambient: no ambient enablement selector matches the pod and its namespace"),
            ("neither is labelled", pod(false, &json!({}), &json!({})), &no_labels, &on, V4,
             "skip: the pod has no istio-proxy container; not ambient: no ambient enablement selector matches the pod and its namespace"),
            ("a sidecar pod is its sidecar's", pod(true, &ambient, &json!({})), &labelled, &on, V4,
             "sidecar REDIRECT; not ambient: the pod has a sidecar"),
            ("host network in ambient mode", pod(false, &ambient, &json!({"hostNetwork": true})), &no_labels, &on, V4,
             "skip: the pod uses the host network; not ambient: the pod uses the host network"),
            ("an excluded namespace in ambient mode", pod(false, &json!({"namespace": "kube-system", "labels": {ambient_keys::DATAPLANE_MODE: "ambient"}}), &json!({})), &labelled, &on, V4,
             "skip: namespace kube-system is excluded; not ambient: namespace kube-system is excluded"),
            ("ztunnel itself", pod(false, &json!({"namespace": "istio-system", "labels": {"app": "ztunnel"}}), &json!({})), &labelled, &on, V4,
             "skip: the pod has no istio-proxy container; not ambient: the pod is ztunnel"),
            ("bypass-inbound-capture overrides", pod(false, &json!({"labels": {ambient_keys::DATAPLANE_MODE: "ambient"}, "annotations": {ambient_keys::BYPASS_INBOUND_CAPTURE: "true"}}), &json!({})), &no_labels, &on, V4,
             "ambient inbound=false dns=true virtual=[] ignored=0"),
            ("dns-capture overrides the node's off", pod(false, &json!({"labels": {ambient_keys::DATAPLANE_MODE: "ambient"}, "annotations": {ambient_keys::DNS_CAPTURE: "true"}}), &json!({})), &no_labels, &dns_off, V4,
             "ambient inbound=true dns=true virtual=[] ignored=0"),
            ("dns-capture overrides the node's on", pod(false, &json!({"labels": {ambient_keys::DATAPLANE_MODE: "ambient"}, "annotations": {ambient_keys::DNS_CAPTURE: "false"}}), &json!({})), &no_labels, &on, V4,
             "ambient inbound=true dns=false virtual=[] ignored=0"),
            ("a dns-capture that is no boolean is ignored", pod(false, &json!({"labels": {ambient_keys::DATAPLANE_MODE: "ambient"}, "annotations": {ambient_keys::DNS_CAPTURE: "yes"}}), &json!({})), &no_labels, &dns_off, V4,
             "ambient inbound=true dns=false virtual=[] ignored=1"),
            ("rerouted interfaces", pod(false, &json!({"labels": {ambient_keys::DATAPLANE_MODE: "ambient"}, "annotations": {"istio.io/reroute-virtual-interfaces": "tap0"}}), &json!({})), &no_labels, &on, V4,
             "ambient inbound=true dns=true virtual=[\"tap0\"] ignored=0"),
            ("a bad interface in ambient mode", pod(false, &json!({"labels": {ambient_keys::DATAPLANE_MODE: "ambient"}, "annotations": {"istio.io/reroute-virtual-interfaces": "-j x"}}), &json!({})), &no_labels, &on, V4,
             "Ambient refuses: pod shop/web: annotation istio.io/reroute-virtual-interfaces: \"-j x\" is not an interface list: \"-j x\" is not an interface name"),
        ];
        for (what, pod, namespace, node, ip, want) in rows {
            let labels = namespace
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect();
            let ips = [ip.parse().expect("an address")];
            assert_eq!(said(&decide(&pod, &ips, &labels, node)), want, "{what}");
        }
    }

    #[test]
    fn the_namespace_is_read_only_where_ambient_mode_can_enroll_the_pod() {
        let on = node(Some(AmbientConfig::default()));
        let plain = pod(false, &json!({}), &json!({}));
        assert!(!reads_namespace_labels(&plain, &node(None)));
        assert!(reads_namespace_labels(&plain, &on));
        for alone in [
            pod(false, &json!({}), &json!({"hostNetwork": true})),
            pod(true, &json!({}), &json!({})),
            pod(false, &json!({"namespace": "kube-system"}), &json!({})),
        ] {
            assert!(!reads_namespace_labels(&alone, &on), "{alone:?}");
        }
    }

    #[test]
    fn each_half_reads_as_istio_decides_it() {
        let on = node(Some(AmbientConfig::default()));
        let sidecar = decide(
            &pod(true, &json!({}), &json!({})),
            &[],
            &BTreeMap::new(),
            &on,
        )
        .expect("decided");
        assert_eq!(sidecar.dataplane(), Some(DataplaneMode::Sidecar));
        assert!(matches!(
            sidecar.selection(),
            Some(Selection::Capture { .. })
        ));
        assert_eq!(
            sidecar.enrollment(),
            Some(Enrollment::NotEnrolled {
                reason: NotEnrolledReason::Sidecar
            })
        );
        let labelled = BTreeMap::from([(
            ambient_keys::DATAPLANE_MODE.to_owned(),
            "ambient".to_owned(),
        )]);
        let enrolled =
            decide(&pod(false, &json!({}), &json!({})), &[], &labelled, &on).expect("decided");
        assert_eq!(enrolled.dataplane(), Some(DataplaneMode::Ambient));
        assert_eq!(enrolled.selection(), None);
        assert!(matches!(
            enrolled.enrollment(),
            Some(Enrollment::Enrolled { .. })
        ));
        let skipped = decide(
            &pod(false, &json!({}), &json!({})),
            &[],
            &labelled,
            &node(None),
        )
        .expect("decided");
        assert_eq!(skipped.dataplane(), None);
        assert_eq!(skipped.enrollment(), None);
    }
}
