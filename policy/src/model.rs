//! The redirect policy: everything Istio's CNI plugin derives from a pod, as one value.
//!
//! Both backends translate this model; nothing else in meshcap reads the annotations. Field by
//! field it is the table in docs/development.md ("Redirect semantics"), already parsed,
//! validated, defaulted and split per address family.

use std::{fmt, net::IpAddr};

use serde::{Deserialize, Serialize};

pub use super::addr::{CidrSet, Family, IpPrefix, IpRanges, PrefixParseError};

/// Envoy's outbound listener (`ISTIO_REDIRECT`, `REDIRECT --to-ports 15001`). CNI cannot move it.
pub const OUTBOUND_CAPTURE_PORT: u16 = 15001;
/// Envoy's inbound listener (`ISTIO_IN_REDIRECT`, and the TPROXY `--on-port`).
pub const INBOUND_CAPTURE_PORT: u16 = 15006;
/// The HBONE tunnel port: inbound traffic to it is never captured (REDIRECT mode), and the
/// proxy's own loopback connections to it are never sent back to the inbound listener.
pub const INBOUND_TUNNEL_PORT: u16 = 15008;
/// The istio-agent DNS proxy that captured port-53 traffic goes to.
pub const DNS_CAPTURE_PORT: u16 = 15053;
/// The port DNS capture applies to.
pub const DNS_PORT: u16 = 53;
/// pilot-agent's status port: the default of `excludeInboundPorts` and `excludeOutboundPorts`.
pub const STATUS_PORT: u16 = 15020;
/// Envoy's health port, always excluded from inbound capture.
pub const HEALTH_PORT: u16 = 15021;
/// Envoy's Prometheus port, always excluded from inbound capture.
pub const PROMETHEUS_PORT: u16 = 15090;
/// Inbound ports never captured when `includeInboundPorts` is `*`, whatever the annotation says.
pub const ALWAYS_EXCLUDED_INBOUND_PORTS: [u16; 3] = [STATUS_PORT, HEALTH_PORT, PROMETHEUS_PORT];
/// The proxy's uid and gid when `istio-proxy` sets none (or sets 0).
pub const DEFAULT_PROXY_ID: u32 = 1337;
/// Packet mark of TPROXY'd inbound traffic (`--tproxy-mark`, `ISTIO_DIVERT`), and of the policy
/// route's `ip rule fwmark`.
pub const TPROXY_MARK: u32 = 1337;
/// Packet mark the proxy's own loopback traffic gets in TPROXY mode (app → VIP → Envoy
/// outbound → Envoy inbound → app).
pub const OUTBOUND_MARK: u32 = 1338;
/// The routing table of the TPROXY policy route (`local default dev lo table 133`).
pub const TPROXY_ROUTE_TABLE: u32 = 133;

/// Annotation and environment names, exactly as Istio spells them.
pub mod keys {
    /// `REDIRECT` (default) or `TPROXY`.
    pub const INTERCEPTION_MODE: &str = "sidecar.istio.io/interceptionMode";
    /// Label (preferred) and annotation: only a false value skips the pod.
    pub const INJECT: &str = "sidecar.istio.io/inject";
    /// Presence marks a pod the injector handled.
    pub const STATUS: &str = "sidecar.istio.io/status";
    /// Outbound CIDRs to capture; `*` all (default), empty none.
    pub const INCLUDE_OUTBOUND_IP_RANGES: &str = "traffic.sidecar.istio.io/includeOutboundIPRanges";
    /// Outbound CIDRs never captured; `*` is an error.
    pub const EXCLUDE_OUTBOUND_IP_RANGES: &str = "traffic.sidecar.istio.io/excludeOutboundIPRanges";
    /// Inbound ports to capture; `*` all (default), empty none.
    pub const INCLUDE_INBOUND_PORTS: &str = "traffic.sidecar.istio.io/includeInboundPorts";
    /// Inbound ports not captured when the include list is `*` (default 15020).
    pub const EXCLUDE_INBOUND_PORTS: &str = "traffic.sidecar.istio.io/excludeInboundPorts";
    /// TCP ports captured whatever the destination.
    pub const INCLUDE_OUTBOUND_PORTS: &str = "traffic.sidecar.istio.io/includeOutboundPorts";
    /// TCP and UDP ports never captured (15020 when absent).
    pub const EXCLUDE_OUTBOUND_PORTS: &str = "traffic.sidecar.istio.io/excludeOutboundPorts";
    /// Interfaces whose traffic is left alone.
    pub const EXCLUDE_INTERFACES: &str = "traffic.sidecar.istio.io/excludeInterfaces";
    /// Interfaces whose inbound traffic is treated as outbound.
    pub const REROUTE_VIRTUAL_INTERFACES: &str = "istio.io/reroute-virtual-interfaces";
    /// Deprecated name of [`REROUTE_VIRTUAL_INTERFACES`], read only when that one is absent.
    pub const KUBEVIRT_INTERFACES: &str = "traffic.sidecar.istio.io/kubevirtInterfaces";
    /// Every pod annotation that shapes the capture (beside [`STATUS`], which only marks the
    /// pod as injected): what generated and fuzzed inputs draw from.
    pub const POLICY_ANNOTATIONS: [&str; 11] = [
        INTERCEPTION_MODE,
        INCLUDE_OUTBOUND_IP_RANGES,
        EXCLUDE_OUTBOUND_IP_RANGES,
        INCLUDE_INBOUND_PORTS,
        EXCLUDE_INBOUND_PORTS,
        INCLUDE_OUTBOUND_PORTS,
        EXCLUDE_OUTBOUND_PORTS,
        EXCLUDE_INTERFACES,
        REROUTE_VIRTUAL_INTERFACES,
        KUBEVIRT_INTERFACES,
        INJECT,
    ];
    /// The sidecar container's name.
    pub const PROXY_CONTAINER: &str = "istio-proxy";
    /// The init container of the non-CNI install; its presence means CNI leaves the pod alone.
    pub const INIT_CONTAINER: &str = "istio-init";
    /// `istio-proxy` env: capture all port-53 traffic to the agent's DNS proxy.
    pub const ENV_DNS_CAPTURE: &str = "ISTIO_META_DNS_CAPTURE";
    /// `istio-proxy` env: drop packets conntrack considers invalid.
    pub const ENV_INVALID_DROP: &str = "INVALID_DROP";
    /// `istio-proxy` env: dual-stack pod.
    pub const ENV_DUAL_STACK: &str = "ISTIO_DUAL_STACK";
    /// `istio-proxy` env: the pod runs without Envoy, so nothing is captured.
    pub const ENV_DISABLE_ENVOY: &str = "DISABLE_ENVOY";
}

/// A pod's namespace and name, shown as `namespace/name`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PodName {
    /// `metadata.namespace` (`default` when the manifest has none).
    pub namespace: String,
    /// `metadata.name`.
    pub name: String,
}

impl PodName {
    /// `pod`'s namespace and name.
    #[must_use]
    pub fn of(pod: &k8s_openapi::api::core::v1::Pod) -> Self {
        Self {
            namespace: pod
                .metadata
                .namespace
                .clone()
                .unwrap_or_else(|| "default".to_owned()),
            name: pod.metadata.name.clone().unwrap_or_default(),
        }
    }
}

impl fmt::Display for PodName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// How inbound traffic reaches Envoy. Outbound is always REDIRECT (NAT to 15001).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum InterceptionMode {
    /// NAT to 15006; Envoy recovers the destination with `SO_ORIGINAL_DST`.
    #[default]
    Redirect,
    /// Transparent proxying to 15006 (mangle table, marks 1337/1338 and a policy route): the
    /// accepted socket's local address is the original destination, the client's source address
    /// is preserved.
    Tproxy,
}

impl fmt::Display for InterceptionMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Redirect => "REDIRECT",
            Self::Tproxy => "TPROXY",
        })
    }
}

/// `includeInboundPorts`: `*`, or a list (an empty list captures no inbound traffic).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PortSelection {
    /// `*`: every port except [`RedirectPolicy::exclude_inbound_ports`] (default).
    All,
    /// These ports only, in annotation order.
    Ports(Vec<u16>),
}

impl PortSelection {
    /// Whether nothing is captured (`includeInboundPorts: ""`).
    #[must_use]
    pub fn is_none(&self) -> bool {
        matches!(self, Self::Ports(ports) if ports.is_empty())
    }
}

/// A pod's capture configuration with Istio's semantics: the one contract both backends
/// implement. Built by [`super::select`] (or [`RedirectPolicy::from_pod`]) from a pod and its
/// IPs; never from anything else.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RedirectPolicy {
    /// The pod this policy is for.
    pub pod: PodName,
    /// The pod's addresses (as given: from CNI's `prevResult` or the pod's status).
    pub pod_ips: Vec<IpAddr>,
    /// Whether IPv6 rules are installed (ip6tables, `::1`/`::6`, the v6 policy route): true when
    /// the pod has a global IPv6 address.
    pub ipv6: bool,
    /// `ISTIO_DUAL_STACK` on `istio-proxy` (informational: meshcap enables IPv6 whenever the pod
    /// has an IPv6 address, which is what Istio does with dual stack on).
    pub dual_stack: bool,
    /// `sidecar.istio.io/interceptionMode`.
    pub mode: InterceptionMode,
    /// `includeOutboundIPRanges` (default `*`).
    pub include_outbound_ip_ranges: IpRanges,
    /// `excludeOutboundIPRanges` (default none). Checked before the include list and the
    /// include ports.
    pub exclude_outbound_ip_ranges: CidrSet,
    /// `includeInboundPorts` (default `*`).
    pub include_inbound_ports: PortSelection,
    /// `excludeInboundPorts` (default 15020) plus 15020, 15021, 15090, deduplicated, in order.
    /// Only used when [`Self::include_inbound_ports`] is `*`.
    pub exclude_inbound_ports: Vec<u16>,
    /// `includeOutboundPorts` (default none): TCP ports captured whatever the destination
    /// (after the exclude ranges).
    pub include_outbound_ports: Vec<u16>,
    /// `excludeOutboundPorts`: TCP and UDP ports never captured. 15020 when the annotation is
    /// absent; an explicit value (even empty) replaces it.
    pub exclude_outbound_ports: Vec<u16>,
    /// `excludeInterfaces`: traffic in or out of these interfaces is left alone.
    pub exclude_interfaces: Vec<String>,
    /// `istio.io/reroute-virtual-interfaces` (else the deprecated `kubevirtInterfaces`):
    /// inbound traffic on these interfaces is treated as outbound.
    pub reroute_virtual_interfaces: Vec<String>,
    /// The proxy's uid: `istio-proxy`'s `runAsUser`, 1337 when unset or 0.
    pub proxy_uid: u32,
    /// The proxy's gid: `istio-proxy`'s `runAsGroup`, 1337 when unset or 0.
    pub proxy_gid: u32,
    /// `ISTIO_META_DNS_CAPTURE=true` on `istio-proxy`: TCP and UDP port 53 go to 15053, except
    /// the proxy's own.
    pub dns_capture: bool,
    /// `INVALID_DROP=true` on `istio-proxy`: packets in conntrack state INVALID are dropped.
    pub invalid_drop: bool,
}

/// What a pod gets: left alone (and why), or captured with a policy.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "decision")]
pub enum Selection {
    /// Not captured; the pod starts as it is.
    Skip {
        /// Why not.
        reason: SkipReason,
    },
    /// Captured with this policy.
    Capture {
        /// The policy to apply.
        policy: Box<RedirectPolicy>,
    },
}

/// Why Istio's CNI plugin would leave a pod alone.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(rename_all = "snake_case", tag = "reason", content = "value")]
pub enum SkipReason {
    /// The namespace is in the agent's excluded namespaces.
    #[error("namespace {0} is excluded")]
    ExcludedNamespace(String),
    /// `spec.hostNetwork: true`: the pod shares the node's network namespace.
    #[error("the pod uses the host network")]
    HostNetwork,
    /// An `istio-init` container programs the pod itself.
    #[error("the pod has an istio-init container")]
    IstioInit,
    /// `DISABLE_ENVOY` is true on `istio-proxy`.
    #[error("DISABLE_ENVOY is true on istio-proxy")]
    EnvoyDisabled,
    /// No container (or init container) is named `istio-proxy`.
    #[error("the pod has no istio-proxy container")]
    NoProxy,
    /// `istio-proxy` runs `proxy <type>` with a type other than `sidecar` (e.g. `router`).
    #[error("istio-proxy is a {0}, not a sidecar")]
    NotSidecar(String),
    /// `sidecar.istio.io/inject` (label, else annotation) is false.
    #[error("sidecar.istio.io/inject is {0:?}")]
    InjectDisabled(String),
    /// No `sidecar.istio.io/status` annotation: the injector did not handle the pod.
    #[error("the pod has no sidecar.istio.io/status annotation")]
    NoSidecarStatus,
}

impl RedirectPolicy {
    /// The policy in one line, for logs and status.
    #[must_use]
    pub fn summary(&self) -> String {
        let policy = self;
        let list = |items: Vec<String>| {
            if items.is_empty() {
                "none".to_owned()
            } else {
                items.join(",")
            }
        };
        let ports = |p: &[u16]| list(p.iter().map(u16::to_string).collect());
        let cidrs = |set: &CidrSet| {
            list(
                [Family::V4, Family::V6]
                    .into_iter()
                    .flat_map(|f| set.family(f).iter().map(ToString::to_string))
                    .collect(),
            )
        };
        let outbound = match &policy.include_outbound_ip_ranges {
            IpRanges::All => "*".to_owned(),
            IpRanges::Cidrs(set) => cidrs(set),
        };
        let inbound = match &policy.include_inbound_ports {
            PortSelection::All => format!("* except {}", ports(&policy.exclude_inbound_ports)),
            PortSelection::Ports(p) => ports(p),
        };
        format!(
            "{}; outbound {outbound} (not {}; ports not {}); inbound {inbound}; proxy uid/gid {}/{}{}{}",
            policy.mode,
            cidrs(&policy.exclude_outbound_ip_ranges),
            ports(&policy.exclude_outbound_ports),
            policy.proxy_uid,
            policy.proxy_gid,
            if policy.dns_capture {
                "; DNS captured"
            } else {
                ""
            },
            if policy.ipv6 { "; IPv6" } else { "" },
        )
    }
}
