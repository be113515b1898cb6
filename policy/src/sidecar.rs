//! From a Kubernetes pod to a [`Selection`], the sidecar's half of the pod's decision
//! ([`super::decide`]): the checks of Istio's CNI plugin (`plugin.go`), in its order, then the
//! redirect inputs (`sidecar_redirect.go`).

use std::{
    collections::{BTreeMap, HashMap},
    net::IpAddr,
};

use k8s_openapi::api::core::v1::{Container, Pod};
use serde::{Deserialize, Serialize};

use super::{
    annotations::{
        BadEntry, parse_cidr_list, parse_go_bool, parse_interface_list, parse_port_list,
    },
    error::PolicyError,
    model::{
        ALWAYS_EXCLUDED_INBOUND_PORTS, CidrSet, DEFAULT_PROXY_ID, InterceptionMode, IpRanges,
        PodName, PortSelection, RedirectPolicy, STATUS_PORT, Selection, SkipReason, keys,
    },
};

/// The node-level settings of the selection (Istio's CNI config `exclude_namespaces`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SelectConfig {
    /// Pods in these namespaces are never captured.
    pub exclude_namespaces: Vec<String>,
}

impl Default for SelectConfig {
    /// Istio's chart default: `kube-system`.
    fn default() -> Self {
        Self {
            exclude_namespaces: vec!["kube-system".to_owned()],
        }
    }
}

/// Decides whether Istio's CNI plugin would capture `pod`, and if so with which policy.
/// `pod_ips` are the pod's addresses (they decide whether IPv6 rules are installed).
///
/// # Errors
/// A pod that should be captured but has an invalid annotation or proxy id.
pub fn select(
    pod: &Pod,
    pod_ips: &[IpAddr],
    config: &SelectConfig,
) -> Result<Selection, PolicyError> {
    let skip = |reason| Ok(Selection::Skip { reason });
    let pod_ref = PodName::of(pod);
    if config.exclude_namespaces.contains(&pod_ref.namespace) {
        return skip(SkipReason::ExcludedNamespace(pod_ref.namespace));
    }
    let spec = pod.spec.as_ref();
    if spec.and_then(|s| s.host_network) == Some(true) {
        return skip(SkipReason::HostNetwork);
    }
    let proxy = ProxyInfo::of(pod);
    if proxy
        .containers
        .iter()
        .any(|name| name == keys::INIT_CONTAINER)
    {
        return skip(SkipReason::IstioInit);
    }
    if proxy
        .env
        .get(keys::ENV_DISABLE_ENVOY)
        .and_then(|v| parse_go_bool(v))
        == Some(true)
    {
        return skip(SkipReason::EnvoyDisabled);
    }
    if !proxy
        .containers
        .iter()
        .any(|name| name == keys::PROXY_CONTAINER)
    {
        return skip(SkipReason::NoProxy);
    }
    if let Some(kind) = proxy
        .proxy_type
        .filter(|kind| !kind.is_empty() && kind != "sidecar")
    {
        return skip(SkipReason::NotSidecar(kind));
    }
    // The label is the newer API and wins when present, even when empty.
    let inject = pod
        .metadata
        .labels
        .as_ref()
        .and_then(|labels| labels.get(keys::INJECT))
        .or_else(|| annotations(pod).get(keys::INJECT));
    if let Some(value) = inject
        && parse_go_bool(value) == Some(false)
    {
        return skip(SkipReason::InjectDisabled(value.clone()));
    }
    if !annotations(pod).contains_key(keys::STATUS) {
        return skip(SkipReason::NoSidecarStatus);
    }
    let policy = RedirectPolicy::from_pod(pod, pod_ips)?;
    Ok(Selection::Capture {
        policy: Box::new(policy),
    })
}

fn annotations(pod: &Pod) -> &BTreeMap<String, String> {
    static EMPTY: BTreeMap<String, String> = BTreeMap::new();
    pod.metadata.annotations.as_ref().unwrap_or(&EMPTY)
}

/// What the plugin reads from the containers (Istio's `PodInfo`): init containers count, so
/// native sidecars (`restartPolicy: Always` init containers) do.
struct ProxyInfo {
    containers: Vec<String>,
    env: HashMap<String, String>,
    proxy_type: Option<String>,
    uid: Option<i64>,
    gid: Option<i64>,
}

impl ProxyInfo {
    fn of(pod: &Pod) -> Self {
        let mut info = Self {
            containers: Vec::new(),
            env: HashMap::new(),
            proxy_type: None,
            uid: None,
            gid: None,
        };
        let Some(spec) = pod.spec.as_ref() else {
            return info;
        };
        let all: Vec<&Container> = spec
            .init_containers
            .iter()
            .flatten()
            .chain(&spec.containers)
            .collect();
        for container in all {
            info.containers.push(container.name.clone());
            if container.name != keys::PROXY_CONTAINER {
                continue;
            }
            for var in container.env.iter().flatten() {
                info.env
                    .insert(var.name.clone(), var.value.clone().unwrap_or_default());
            }
            if let Some([first, kind, ..]) = container.args.as_deref()
                && first == "proxy"
            {
                info.proxy_type = Some(kind.clone());
            }
            if let Some(context) = &container.security_context {
                info.uid = context.run_as_user;
                info.gid = context.run_as_group;
            }
        }
        info
    }

    fn flag(&self, name: &str) -> bool {
        self.env
            .get(name)
            .and_then(|v| parse_go_bool(v))
            .unwrap_or(false)
    }
}

impl RedirectPolicy {
    /// The policy for `pod` with addresses `pod_ips`, whether or not the pod is selected
    /// (see [`select`]).
    ///
    /// # Errors
    /// The first invalid input, in the order Istio checks them.
    pub fn from_pod(pod: &Pod, pod_ips: &[IpAddr]) -> Result<Self, PolicyError> {
        let pod_ref = PodName::of(pod);
        let annotations = annotations(pod);
        let proxy = ProxyInfo::of(pod);
        let reader = Reader {
            pod: &pod_ref,
            annotations,
        };

        let mode = match annotations.get(keys::INTERCEPTION_MODE).map(String::as_str) {
            None | Some("REDIRECT") => InterceptionMode::Redirect,
            Some("TPROXY") => InterceptionMode::Tproxy,
            Some(other) => {
                return Err(PolicyError::InvalidInterceptionMode {
                    pod: pod_ref,
                    key: keys::INTERCEPTION_MODE,
                    value: other.to_owned(),
                });
            }
        };
        let proxy_uid = proxy_id(&pod_ref, "runAsUser", proxy.uid)?;
        let proxy_gid = proxy_id(&pod_ref, "runAsGroup", proxy.gid)?;
        let include_outbound_ip_ranges = match annotations.get(keys::INCLUDE_OUTBOUND_IP_RANGES) {
            None => IpRanges::All,
            Some(value) if value == "*" => IpRanges::All,
            Some(_) => IpRanges::Cidrs(reader.cidrs(keys::INCLUDE_OUTBOUND_IP_RANGES)?),
        };
        let exclude_outbound_ip_ranges = reader.cidrs(keys::EXCLUDE_OUTBOUND_IP_RANGES)?;
        let include_inbound_ports = match annotations.get(keys::INCLUDE_INBOUND_PORTS) {
            None => PortSelection::All,
            Some(value) if value == "*" => PortSelection::All,
            Some(_) => PortSelection::Ports(reader.ports(keys::INCLUDE_INBOUND_PORTS, &[])?),
        };
        // Istio validates `excludeInboundPorts` with `validatePortListWithWildcard`
        // (cni/pkg/plugin/sidecar_redirect.go): `*` is accepted, and unused when the include
        // list is a port list. With `includeInboundPorts: *` Istio would write `--dport *`, which
        // iptables refuses: meshcap refuses it up front.
        let exclude_wildcard = annotations
            .get(keys::EXCLUDE_INBOUND_PORTS)
            .is_some_and(|v| v == "*")
            && matches!(include_inbound_ports, PortSelection::Ports(_));
        let mut exclude_inbound_ports = if exclude_wildcard {
            vec![STATUS_PORT]
        } else {
            reader.ports(keys::EXCLUDE_INBOUND_PORTS, &[STATUS_PORT])?
        };
        for port in ALWAYS_EXCLUDED_INBOUND_PORTS {
            if !exclude_inbound_ports.contains(&port) {
                exclude_inbound_ports.push(port);
            }
        }
        let mut deduplicated = Vec::with_capacity(exclude_inbound_ports.len());
        for port in exclude_inbound_ports {
            if !deduplicated.contains(&port) {
                deduplicated.push(port);
            }
        }
        let exclude_outbound_ports = reader.ports(keys::EXCLUDE_OUTBOUND_PORTS, &[STATUS_PORT])?;
        let include_outbound_ports = reader.ports(keys::INCLUDE_OUTBOUND_PORTS, &[])?;
        let exclude_interfaces = reader.interfaces(keys::EXCLUDE_INTERFACES)?;
        let reroute_key = if annotations.contains_key(keys::REROUTE_VIRTUAL_INTERFACES) {
            keys::REROUTE_VIRTUAL_INTERFACES
        } else {
            keys::KUBEVIRT_INTERFACES
        };
        let reroute_virtual_interfaces = reader.interfaces(reroute_key)?;

        let dual_stack = proxy.flag(keys::ENV_DUAL_STACK);
        Ok(Self {
            ipv6: ipv6_enabled(pod_ips, dual_stack),
            pod_ips: pod_ips.to_vec(),
            dual_stack,
            mode,
            include_outbound_ip_ranges,
            exclude_outbound_ip_ranges,
            include_inbound_ports,
            exclude_inbound_ports: deduplicated,
            include_outbound_ports,
            exclude_outbound_ports,
            exclude_interfaces,
            reroute_virtual_interfaces,
            proxy_uid,
            proxy_gid,
            dns_capture: proxy.flag(keys::ENV_DNS_CAPTURE),
            invalid_drop: proxy.flag(keys::ENV_INVALID_DROP),
            pod: pod_ref,
        })
    }
}

/// Whether Istio installs IPv6 rules: `tools/common/config/config.go` `getLocalIP` walks the
/// pod's addresses in the kernel's order (IPv4 before IPv6), skipping loopback and link-local
/// ones (an IPv4-mapped address counts as IPv4), and takes the first one's family; with
/// `ISTIO_DUAL_STACK` it goes on to the first IPv6 address. So: IPv6 when the pod has a global
/// IPv6 address and, unless dual stack is on, no global IPv4 one.
fn ipv6_enabled(pod_ips: &[IpAddr], dual_stack: bool) -> bool {
    let global: Vec<IpAddr> = pod_ips
        .iter()
        .map(|ip| ip.to_canonical())
        .filter(|ip| match ip {
            IpAddr::V4(v4) => !v4.is_loopback() && !v4.is_link_local(),
            IpAddr::V6(v6) => {
                let first = v6.segments()[0];
                !v6.is_loopback() && first & 0xffc0 != 0xfe80 && first != 0xff02
            }
        })
        .collect();
    let has_v6 = global.iter().any(IpAddr::is_ipv6);
    has_v6 && (dual_stack || !global.iter().any(IpAddr::is_ipv4))
}

/// A set `runAsUser`/`runAsGroup` of 0 means the default, as unset does.
fn proxy_id(pod: &PodName, field: &'static str, value: Option<i64>) -> Result<u32, PolicyError> {
    match value {
        None | Some(0) => Ok(DEFAULT_PROXY_ID),
        Some(id) => u32::try_from(id).map_err(|_| PolicyError::InvalidProxyId {
            pod: pod.clone(),
            field,
            value: id,
        }),
    }
}

struct Reader<'a> {
    pod: &'a PodName,
    annotations: &'a BTreeMap<String, String>,
}

impl Reader<'_> {
    fn value(&self, key: &str) -> Option<&str> {
        self.annotations.get(key).map(String::as_str)
    }

    fn cidrs(&self, key: &'static str) -> Result<CidrSet, PolicyError> {
        let value = self.value(key).unwrap_or_default();
        if value.split(',').any(|entry| entry == "*") && key == keys::EXCLUDE_OUTBOUND_IP_RANGES {
            return Err(self.wildcard(key, value));
        }
        parse_cidr_list(value).map_err(|(entry, reason)| PolicyError::InvalidCidr {
            pod: self.pod.clone(),
            key,
            value: value.to_owned(),
            entry,
            reason,
        })
    }

    fn ports(&self, key: &'static str, default: &[u16]) -> Result<Vec<u16>, PolicyError> {
        let Some(value) = self.value(key) else {
            return Ok(default.to_vec());
        };
        if value == "*" {
            return Err(self.wildcard(key, value));
        }
        parse_port_list(value).map_err(|BadEntry(entry)| PolicyError::InvalidPort {
            pod: self.pod.clone(),
            key,
            value: value.to_owned(),
            entry,
        })
    }

    fn interfaces(&self, key: &'static str) -> Result<Vec<String>, PolicyError> {
        let value = self.value(key).unwrap_or_default();
        parse_interface_list(value).map_err(|BadEntry(entry)| self.bad_interface(key, value, entry))
    }

    fn bad_interface(&self, key: &'static str, value: &str, entry: String) -> PolicyError {
        PolicyError::InvalidInterface {
            pod: self.pod.clone(),
            key,
            value: value.to_owned(),
            entry,
        }
    }

    fn wildcard(&self, key: &'static str, value: &str) -> PolicyError {
        PolicyError::WildcardNotAllowed {
            pod: self.pod.clone(),
            key,
            value: value.to_owned(),
        }
    }
}

/// The pod's addresses from its status (`status.podIPs`, else `status.podIP`); unparseable
/// entries are left out.
#[must_use]
pub fn status_pod_ips(pod: &Pod) -> Vec<IpAddr> {
    let Some(status) = &pod.status else {
        return Vec::new();
    };
    let listed: Vec<IpAddr> = status
        .pod_ips
        .iter()
        .flatten()
        .filter_map(|ip| ip.ip.parse().ok())
        .collect();
    if listed.is_empty() {
        status
            .pod_ip
            .iter()
            .filter_map(|ip| ip.parse().ok())
            .collect()
    } else {
        listed
    }
}
