//! Ambient mode's decisions, as Istio's CNI node agent makes them: whether a pod is enrolled
//! (`cni/pkg/util/enablement_selector.go`, `cni/pkg/plugin/plugin.go`, the informers'
//! ztunnel exclusion) and the pod's own overrides of its in-pod rules
//! (`cni/pkg/nodeagent/net.go`, `getPodLevelTrafficOverrides`), as one [`InpodPolicy`].

mod selector;

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, Ipv6Addr},
};

use k8s_openapi::api::core::v1::Pod;
use selector::Selector;
pub use selector::{EnablementSelector, SelectorError};
use serde::{Deserialize, Serialize};

use super::{
    annotations::{BadEntry, parse_ambient_interface_list, parse_go_bool},
    error::PolicyError,
    model::{PodName, keys},
};

/// Annotation and label names of ambient mode, exactly as Istio spells them.
pub mod ambient_keys {
    /// Label on a pod or namespace: `ambient` enrolls, `none` (on the pod) opts out.
    pub const DATAPLANE_MODE: &str = "istio.io/dataplane-mode";
    /// Written by the node agent: `enabled` once captured, `pending` while it is not yet;
    /// istiod reads it to send HBONE to the pod.
    pub const REDIRECTION: &str = "ambient.istio.io/redirection";
    /// A boolean: true leaves inbound traffic alone ("ingress mode").
    pub const BYPASS_INBOUND_CAPTURE: &str = "ambient.istio.io/bypass-inbound-capture";
    /// A boolean: overrides `ambient.dnsCapture` for the pod.
    pub const DNS_CAPTURE: &str = "ambient.istio.io/dns-capture";
}

/// The label ztunnel's own pods carry (`app=ztunnel`, in the system namespace).
const ZTUNNEL_APP: &str = "ztunnel";

/// Mark ztunnel sets on its own sockets (`SO_MARK`): never captured.
pub const ZTUNNEL_MARK: u32 = 0x539;
/// The mask Istio's rules match [`ZTUNNEL_MARK`] under.
pub const ZTUNNEL_MARK_MASK: u32 = 0xfff;
/// Connection mark of connections ztunnel's marked packets belong to, and the policy route's
/// `ip rule fwmark` that sends their replies back to ztunnel.
pub const CONNECTION_MARK: u32 = 0x111;
/// The mask of [`CONNECTION_MARK`].
pub const CONNECTION_MARK_MASK: u32 = 0xfff;
/// The routing table of ambient mode's mark route (`local default dev lo table 100`).
pub const AMBIENT_ROUTE_TABLE: u32 = 100;
/// The priority of ambient mode's `ip rule`.
pub const AMBIENT_RULE_PRIORITY: u32 = 32764;
/// ztunnel's outbound listener in the pod.
pub const ZTUNNEL_OUTBOUND_PORT: u16 = 15001;
/// ztunnel's plaintext inbound listener in the pod.
pub const ZTUNNEL_INBOUND_PLAINTEXT_PORT: u16 = 15006;
/// ztunnel's HBONE listener: reached at the pod's address, never redirected.
pub const ZTUNNEL_INBOUND_PORT: u16 = 15008;
/// ztunnel's DNS proxy in the pod.
pub const ZTUNNEL_DNS_PORT: u16 = 15053;

/// The source address kubelet's probes are SNAT-ed to on the node (Istio's
/// `HOST_PROBE_SNAT_ADDRESS` / `HOST_PROBE_V6_SNAT_ADDRESS`), so the pod's rules can let them
/// through uncaptured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostProbeSnat {
    /// IPv4 (169.254.7.127).
    pub v4: Ipv4Addr,
    /// IPv6 (fd16:9254:7127:1337:ffff:ffff:ffff:ffff).
    pub v6: Ipv6Addr,
}

impl Default for HostProbeSnat {
    fn default() -> Self {
        Self {
            v4: Ipv4Addr::new(169, 254, 7, 127),
            v6: Ipv6Addr::new(
                0xfd16, 0x9254, 0x7127, 0x1337, 0xffff, 0xffff, 0xffff, 0xffff,
            ),
        }
    }
}

/// Istio's `ambient.*` values meshcap reads, with the chart's defaults.
#[derive(Clone, Debug, PartialEq)]
pub struct AmbientConfig {
    /// `ambient.enablementSelectors`, as given.
    pub enablement_selectors: Vec<EnablementSelector>,
    compiled: Vec<(Selector, Selector)>,
    /// `ambient.dnsCapture` (true): DNS to ztunnel's DNS proxy unless the pod says otherwise.
    pub dns_capture: bool,
    /// `ambient.ipv6` (true): IPv6 rules in every enrolled pod.
    pub ipv6: bool,
    /// The namespace ztunnel runs in (`istio-system`).
    pub system_namespace: String,
    /// Where kubelet's probes come from, as the pod sees them.
    pub host_probe_snat: HostProbeSnat,
    /// `ambient.reconcileIptablesOnStartup` (true): a starting agent rewrites the in-pod rules
    /// of pods already enrolled where they differ from its own.
    pub reconcile_on_startup: bool,
}

impl AmbientConfig {
    /// The chart's defaults with these selectors.
    ///
    /// # Errors
    /// A selector Kubernetes would refuse.
    pub fn new(enablement_selectors: Vec<EnablementSelector>) -> Result<Self, SelectorError> {
        let compiled = enablement_selectors
            .iter()
            .enumerate()
            .map(|(index, s)| {
                Ok((
                    Selector::compile(&s.pod_selector, index)?,
                    Selector::compile(&s.namespace_selector, index)?,
                ))
            })
            .collect::<Result<_, SelectorError>>()?;
        Ok(Self {
            enablement_selectors,
            compiled,
            dns_capture: true,
            ipv6: true,
            system_namespace: "istio-system".to_owned(),
            host_probe_snat: HostProbeSnat::default(),
            reconcile_on_startup: true,
        })
    }

    /// Whether any selector matches `pod_labels` and `namespace_labels` (Istio's `Matches`
    /// without its host-network and sidecar exclusions, which [`enroll`] makes).
    fn selects(
        &self,
        pod_labels: &BTreeMap<String, String>,
        namespace_labels: &BTreeMap<String, String>,
    ) -> bool {
        self.compiled
            .iter()
            .any(|(pod, namespace)| pod.matches(pod_labels) && namespace.matches(namespace_labels))
    }
}

impl Default for AmbientConfig {
    /// Istio's chart defaults.
    fn default() -> Self {
        Self::new(EnablementSelector::istio_defaults())
            .expect("Istio's default enablement selectors compile")
    }
}

/// What ambient mode does with a pod.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "decision")]
pub enum Enrollment {
    /// Left out of ambient mode (and why).
    NotEnrolled {
        /// Why not.
        reason: NotEnrolledReason,
    },
    /// Enrolled: its traffic goes to ztunnel under this policy.
    Enrolled {
        /// The in-pod policy.
        policy: InpodPolicy,
        /// Annotations Istio ignores as meshcap does (a boolean that is not one), to log.
        ignored: Vec<IgnoredAnnotation>,
    },
}

/// Why a pod is not enrolled.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(rename_all = "snake_case", tag = "reason", content = "value")]
pub enum NotEnrolledReason {
    /// The namespace is in the agent's excluded namespaces.
    #[error("namespace {0} is excluded")]
    ExcludedNamespace(String),
    /// `spec.hostNetwork: true`: there is no pod network namespace to capture in.
    #[error("the pod uses the host network")]
    HostNetwork,
    /// The pod has a sidecar (`sidecar.istio.io/status`): sidecar mode captures it.
    #[error("the pod has a sidecar")]
    Sidecar,
    /// The pod is ztunnel itself.
    #[error("the pod is ztunnel")]
    Ztunnel,
    /// No enablement selector matches the pod and its namespace.
    #[error("no ambient enablement selector matches the pod and its namespace")]
    NotSelected,
}

/// A pod annotation Istio ignores because its value is not a boolean.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IgnoredAnnotation {
    /// The annotation.
    pub key: String,
    /// Its value.
    pub value: String,
}

/// What an enrolled pod's in-pod capture does: Istio's `AmbientConfig` and the pod's
/// `PodLevelOverrides`, resolved.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InpodPolicy {
    /// Inbound TCP goes to ztunnel's 15006 (false: `bypass-inbound-capture`, ingress mode).
    pub inbound: bool,
    /// DNS (UDP and TCP port 53) goes to ztunnel's 15053.
    pub dns: bool,
    /// Interfaces whose inbound TCP is treated as outbound (`reroute-virtual-interfaces`).
    pub virtual_interfaces: Vec<String>,
    /// IPv6 rules beside IPv4 (`ambient.ipv6`, node-wide as in Istio).
    pub ipv6: bool,
    /// The probes' source addresses, let through uncaptured.
    pub host_probe_snat: HostProbeSnat,
}

/// Why `pod` is left out of ambient mode whatever its namespace's labels say (an excluded
/// namespace, host network, a sidecar, ztunnel itself), or `None` when the selectors decide.
/// [`enroll`] asks this first, and [`super::reads_namespace_labels`] before the namespace is
/// looked up.
#[must_use]
pub(crate) fn never_enrolled(
    pod: &Pod,
    exclude_namespaces: &[String],
    config: &AmbientConfig,
) -> Option<NotEnrolledReason> {
    let namespace = PodName::of(pod).namespace;
    if exclude_namespaces.contains(&namespace) {
        return Some(NotEnrolledReason::ExcludedNamespace(namespace));
    }
    if pod.spec.as_ref().and_then(|s| s.host_network) == Some(true) {
        return Some(NotEnrolledReason::HostNetwork);
    }
    let annotations = pod.metadata.annotations.as_ref();
    if annotations.is_some_and(|a| a.contains_key(keys::STATUS)) {
        return Some(NotEnrolledReason::Sidecar);
    }
    let app = pod.metadata.labels.as_ref().and_then(|l| l.get("app"));
    if namespace == config.system_namespace && app.map(String::as_str) == Some(ZTUNNEL_APP) {
        return Some(NotEnrolledReason::Ztunnel);
    }
    None
}

/// Decides, as Istio's plugin and node agent do, whether `pod` (whose namespace carries
/// `namespace_labels`) is enrolled in ambient mode, and if so with which policy.
///
/// # Errors
/// An enrolled pod whose `istio.io/reroute-virtual-interfaces` names something that is not an
/// interface.
pub fn enroll(
    pod: &Pod,
    namespace_labels: &BTreeMap<String, String>,
    exclude_namespaces: &[String],
    config: &AmbientConfig,
) -> Result<Enrollment, PolicyError> {
    let not = |reason| Ok(Enrollment::NotEnrolled { reason });
    if let Some(reason) = never_enrolled(pod, exclude_namespaces, config) {
        return not(reason);
    }
    let pod_ref = PodName::of(pod);
    let labels = pod.metadata.labels.clone().unwrap_or_default();
    if !config.selects(&labels, namespace_labels) {
        return not(NotEnrolledReason::NotSelected);
    }

    let annotations = pod.metadata.annotations.clone().unwrap_or_default();
    let mut ignored = Vec::new();
    let mut boolean = |key: &str| {
        let value = annotations.get(key)?;
        let parsed = parse_go_bool(value);
        if parsed.is_none() {
            ignored.push(IgnoredAnnotation {
                key: key.to_owned(),
                value: value.clone(),
            });
        }
        parsed
    };
    let inbound = !boolean(ambient_keys::BYPASS_INBOUND_CAPTURE).unwrap_or(false);
    let dns = boolean(ambient_keys::DNS_CAPTURE).unwrap_or(config.dns_capture);
    let virtual_interfaces = match annotations.get(keys::REROUTE_VIRTUAL_INTERFACES) {
        None => Vec::new(),
        Some(value) => parse_ambient_interface_list(value).map_err(|BadEntry(entry)| {
            PolicyError::InvalidInterface {
                pod: pod_ref.clone(),
                key: keys::REROUTE_VIRTUAL_INTERFACES,
                value: value.clone(),
                entry,
            }
        })?,
    };
    Ok(Enrollment::Enrolled {
        policy: InpodPolicy {
            inbound,
            dns,
            virtual_interfaces,
            ipv6: config.ipv6,
            host_probe_snat: config.host_probe_snat,
        },
        ignored,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(namespace: &str, labels: &[(&str, &str)], annotations: &[(&str, &str)]) -> Pod {
        let map = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect::<BTreeMap<_, _>>()
        };
        let mut pod = Pod::default();
        pod.metadata.name = Some("app".to_owned());
        pod.metadata.namespace = Some(namespace.to_owned());
        pod.metadata.labels = Some(map(labels));
        pod.metadata.annotations = Some(map(annotations));
        pod
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn decide(pod: &Pod, namespace: &[(&str, &str)]) -> Enrollment {
        enroll(
            pod,
            &labels(namespace),
            &["kube-system".to_owned()],
            &AmbientConfig::default(),
        )
        .unwrap()
    }

    fn reason(enrollment: Enrollment) -> Option<NotEnrolledReason> {
        match enrollment {
            Enrollment::NotEnrolled { reason } => Some(reason),
            Enrollment::Enrolled { .. } => None,
        }
    }

    const AMBIENT: (&str, &str) = (ambient_keys::DATAPLANE_MODE, "ambient");
    const NONE: (&str, &str) = (ambient_keys::DATAPLANE_MODE, "none");

    #[test]
    fn the_pod_label_or_the_namespace_label_enrolls_and_the_pods_none_wins() {
        assert_eq!(reason(decide(&pod("a", &[AMBIENT], &[]), &[])), None);
        assert_eq!(reason(decide(&pod("a", &[], &[]), &[AMBIENT])), None);
        assert_eq!(reason(decide(&pod("a", &[AMBIENT], &[]), &[NONE])), None);
        assert_eq!(
            reason(decide(&pod("a", &[NONE], &[]), &[AMBIENT])),
            Some(NotEnrolledReason::NotSelected)
        );
        assert_eq!(
            reason(decide(&pod("a", &[], &[]), &[])),
            Some(NotEnrolledReason::NotSelected)
        );
        let other = (ambient_keys::DATAPLANE_MODE, "sidecar");
        assert_eq!(
            reason(decide(&pod("a", &[other], &[]), &[])),
            Some(NotEnrolledReason::NotSelected)
        );
    }

    #[test]
    fn host_network_sidecar_ztunnel_and_excluded_namespaces_are_never_enrolled() {
        let mut host = pod("a", &[AMBIENT], &[]);
        host.spec = Some(k8s_openapi::api::core::v1::PodSpec {
            host_network: Some(true),
            ..Default::default()
        });
        assert_eq!(
            reason(decide(&host, &[])),
            Some(NotEnrolledReason::HostNetwork)
        );
        let sidecar = pod("a", &[AMBIENT], &[(keys::STATUS, "{}")]);
        assert_eq!(
            reason(decide(&sidecar, &[])),
            Some(NotEnrolledReason::Sidecar)
        );
        let ztunnel = pod("istio-system", &[("app", "ztunnel")], &[]);
        assert_eq!(
            reason(decide(&ztunnel, &[AMBIENT])),
            Some(NotEnrolledReason::Ztunnel)
        );
        let namesake = pod("apps", &[("app", "ztunnel")], &[]);
        assert_eq!(reason(decide(&namesake, &[AMBIENT])), None);
        assert_eq!(
            reason(decide(&pod("kube-system", &[AMBIENT], &[]), &[])),
            Some(NotEnrolledReason::ExcludedNamespace("kube-system".into()))
        );
    }

    #[test]
    fn pod_overrides_resolve_against_the_node_settings() {
        let policy =
            |annotations: &[(&str, &str)]| match decide(&pod("a", &[AMBIENT], annotations), &[]) {
                Enrollment::Enrolled { policy, ignored } => (policy, ignored),
                other => panic!("{other:?}"),
            };
        let (default, ignored) = policy(&[]);
        assert!(default.inbound && default.dns && default.ipv6 && ignored.is_empty());
        assert!(
            !policy(&[(ambient_keys::BYPASS_INBOUND_CAPTURE, "True")])
                .0
                .inbound
        );
        assert!(!policy(&[(ambient_keys::DNS_CAPTURE, "0")]).0.dns);
        let (dns, ignored) = policy(&[(ambient_keys::DNS_CAPTURE, "yes")]);
        assert!(dns.dns, "a value that is not a boolean is ignored");
        assert_eq!(
            ignored,
            [IgnoredAnnotation {
                key: ambient_keys::DNS_CAPTURE.into(),
                value: "yes".into()
            }]
        );
        let virt = policy(&[(keys::REROUTE_VIRTUAL_INTERFACES, "eth1,, eth2 ")]).0;
        assert_eq!(virt.virtual_interfaces, ["eth1", "eth2"]);
    }

    #[test]
    fn a_bad_interface_name_fails_naming_the_pod_the_annotation_and_the_value() {
        let pod = pod(
            "a",
            &[AMBIENT],
            &[(keys::REROUTE_VIRTUAL_INTERFACES, "eth1,-j ACCEPT")],
        );
        let err = enroll(&pod, &BTreeMap::new(), &[], &AmbientConfig::default()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "pod a/app: annotation istio.io/reroute-virtual-interfaces: \"eth1,-j ACCEPT\" is \
             not an interface list: \"-j ACCEPT\" is not an interface name"
        );
    }
}
