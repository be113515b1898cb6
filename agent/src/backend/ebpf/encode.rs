//! A pod's capture configuration as map entries: the flags word, port lists and CIDR lists of
//! `meshcap-common`, plus what only the pod's netns knows (its addresses and routes); and the
//! [`Plan`] of a capture, made once the pod's netns has been observed: its entries and what
//! its netns needs (the policy route, `tcp_fwmark_accept`, which interfaces get a stub).
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use aya::maps::lpm_trie::Key;
use meshcap_common::{
    Addr, CIDR_KEY_PREFIX_BITS, Cidr4Data, Cidr6Data, CidrKind, PodAddrs, PodConfig, PortKind,
    flags, iface_flags,
};
use meshcap_policy::{
    CidrSet, InterceptionMode, IpRanges, MarkRoute, PolicyRoutes, PortSelection, RedirectPolicy,
    ambient::InpodPolicy,
};

use crate::{backend::PodPolicy, podnet::PodNet};

/// Everything the maps hold for one pod, before a pod id is assigned.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Entries {
    /// [`PodConfig`] without its `pod_id`.
    pub config: PodConfig,
    /// Port lists.
    pub ports: Vec<(PortKind, u16)>,
    /// CIDR lists: kind, network, prefix length, value.
    pub cidrs: Vec<(CidrKind, IpAddr, u8, u32)>,
    /// Interface flags by interface name.
    pub ifaces: Vec<(String, u32)>,
    /// The pod's own addresses, one per family: a redirected socket's local address.
    pub addrs: PodAddrs,
}

impl Entries {
    /// Adds what the pod's netns says: its own addresses (traffic to them leaves by `lo`) and,
    /// with `excludeInterfaces`, its routes marked by whether they leave by an excluded
    /// interface. Also the interface flags.
    pub fn add_pod_net(&mut self, net: &PodNet, exclude: &[String], reroute: &[String]) {
        for addr in &net.addresses {
            let len = if addr.is_ipv4() { 32 } else { 128 };
            self.cidrs.push((CidrKind::Local, *addr, len, 1));
        }
        // Envoy's IPv6 passthrough source; ambient mode has none.
        if self.config.has(flags::IPV6) && !self.config.has(flags::AMBIENT) {
            self.cidrs.push((
                CidrKind::Local,
                IpAddr::V6(std::net::Ipv6Addr::from(6u128)),
                128,
                1,
            ));
        }
        if !exclude.is_empty() {
            self.config.flags |= flags::EXCLUDED_ROUTES;
            for route in &net.routes {
                let excluded = u32::from(exclude.contains(&route.dev));
                self.cidrs
                    .push((CidrKind::Route, route.dst, route.len, excluded));
            }
        }
        // Connect compares an IPv4 destination with the pod's address instead of looking the
        // list up, when that is all the list holds.
        let only_pod_addr4 = self.addrs.v4 != 0
            && self.cidrs.iter().all(|(kind, addr, _, _)| match addr {
                IpAddr::V4(v4) if *kind == CidrKind::Local => {
                    u32::from_ne_bytes(v4.octets()) == self.addrs.v4
                }
                _ => true,
            });
        if only_pod_addr4 {
            self.config.flags |= flags::LOCAL4_IS_POD_ADDR;
        }
        for (_, name) in &net.interfaces {
            let mut f = 0;
            if exclude.contains(name) {
                f |= iface_flags::EXCLUDED;
            }
            if reroute.contains(name) {
                f |= iface_flags::REROUTE;
            }
            if f != 0 {
                self.ifaces.push((name.clone(), f));
            }
        }
    }
}

/// A pod's map entries, once its netns has been observed: its policy's, then what its netns
/// says ([`Entries::add_pod_net`]). The one encoding of a capture.
#[must_use]
pub fn entries(policy: &PodPolicy, net: &PodNet) -> Entries {
    let mut entries = policy_entries(policy);
    let (exclude, reroute) = interfaces(policy);
    entries.add_pod_net(net, exclude, reroute);
    entries
}

/// What a policy alone puts in the maps: what CHECK compares with what they hold.
#[must_use]
pub fn policy_entries(policy: &PodPolicy) -> Entries {
    match policy {
        PodPolicy::Sidecar(policy) => encode(policy),
        PodPolicy::Ambient(ambient) => encode_ambient(&ambient.policy, &ambient.ips),
    }
}

/// The interfaces a policy names: excluded ones (no stub, routes leaving by them not
/// captured) and rerouted ones (inbound treated as outbound).
#[must_use]
pub fn interfaces(policy: &PodPolicy) -> (&[String], &[String]) {
    match policy {
        PodPolicy::Sidecar(policy) => (
            &policy.exclude_interfaces,
            &policy.reroute_virtual_interfaces,
        ),
        PodPolicy::Ambient(ambient) => (&[], &ambient.policy.virtual_interfaces),
    }
}

/// A pod's capture, planned from its policy and its observed netns.
pub(super) struct Plan {
    pub(super) net: PodNet,
    pub(super) entries: Entries,
    /// Interfaces that get no stub (`excludeInterfaces`).
    pub(super) exclude_interfaces: Vec<String>,
    /// Whether the policy reroutes interfaces (their traffic needs the policy route).
    reroute: bool,
}

impl Plan {
    /// `handoff`: the flags of the socket lookup hand-off ([`super::Handoff::pod_flags`]).
    pub(super) fn new(policy: &PodPolicy, net: PodNet, handoff: u32) -> Self {
        let mut entries = entries(policy, &net);
        entries.config.flags |= handoff;
        let (exclude, reroute) = interfaces(policy);
        Self {
            net,
            entries,
            exclude_interfaces: exclude.to_vec(),
            reroute: !reroute.is_empty(),
        }
    }

    pub(super) fn ambient(&self) -> bool {
        self.entries.config.has(flags::AMBIENT)
    }

    /// `::6` on lo (Envoy's IPv6 passthrough source) and, for TPROXY mode and rerouted
    /// interfaces, the policy route, as Istio installs them; in ambient mode, Istio's in-pod
    /// reply route, which rerouted interfaces share. `None` when the pod needs none.
    pub(super) fn routes(&self) -> Option<PolicyRoutes> {
        routes(&self.entries.config, self.reroute)
    }

    /// Accepted sockets inherit the SYN's mark, so that the app's replies to the original
    /// client source reach the proxy's transparent socket (in ambient mode, the mark the
    /// classifier on `lo` gives ztunnel's SYNs). Rerouted interfaces need only the route: their
    /// packets are marked by the TC program, and the proxy's sockets must not inherit that
    /// mark.
    pub(super) fn fwmark_accept(&self) -> bool {
        fwmark_accept(&self.entries.config)
    }
}

/// The policy routes of a pod whose entry is `config` (`reroute`: it reroutes interfaces): see
/// [`Plan::routes`]; the verifier asks it of a recorded entry.
pub(super) fn routes(config: &PodConfig, reroute: bool) -> Option<PolicyRoutes> {
    let ipv6 = config.has(flags::IPV6);
    let ambient = config.has(flags::AMBIENT);
    let mark_route = if ambient {
        Some(MarkRoute::ambient(ipv6))
    } else if config.has(flags::TPROXY) || reroute {
        Some(MarkRoute::tproxy(ipv6))
    } else {
        None
    };
    let passthrough6 = ipv6 && !ambient;
    if mark_route.is_none() && !passthrough6 {
        return None;
    }
    let mut routes = if passthrough6 {
        PolicyRoutes::passthrough6()
    } else {
        PolicyRoutes::default()
    };
    routes.mark_route = mark_route;
    Some(routes)
}

/// Whether a pod whose entry is `config` needs `tcp_fwmark_accept`: see [`Plan::fwmark_accept`].
pub(super) const fn fwmark_accept(config: &PodConfig) -> bool {
    config.has(flags::TPROXY) || config.has(flags::AMBIENT)
}

/// A policy's map entries (the pod's netns adds its own with [`Entries::add_pod_net`]).
#[must_use]
pub fn encode(policy: &RedirectPolicy) -> Entries {
    let mut f = 0;
    if policy.include_outbound_ip_ranges.has_loopback() {
        f |= flags::INCLUDE_LOOPBACK;
    }
    if policy.dns_capture {
        f |= flags::DNS_CAPTURE;
    }
    if policy.mode == InterceptionMode::Tproxy {
        f |= flags::TPROXY;
    }
    if policy.include_inbound_ports == PortSelection::All {
        f |= flags::INBOUND_ALL;
    }
    if policy.ipv6 {
        f |= flags::IPV6;
    }
    if policy.invalid_drop {
        f |= flags::INVALID_DROP;
    }
    let mut ports = Vec::new();
    ports.extend(
        policy
            .exclude_outbound_ports
            .iter()
            .map(|p| (PortKind::ExcludeOutbound, *p)),
    );
    ports.extend(
        policy
            .include_outbound_ports
            .iter()
            .map(|p| (PortKind::IncludeOutbound, *p)),
    );
    ports.extend(
        policy
            .exclude_inbound_ports
            .iter()
            .map(|p| (PortKind::ExcludeInbound, *p)),
    );
    if let PortSelection::Ports(list) = &policy.include_inbound_ports {
        ports.extend(list.iter().map(|p| (PortKind::IncludeInbound, *p)));
    }
    let mut cidrs = Vec::new();
    match &policy.include_outbound_ip_ranges {
        IpRanges::All => {
            cidrs.push((
                CidrKind::IncludeOutbound,
                IpAddr::V4(Ipv4Addr::UNSPECIFIED),
                0,
                1,
            ));
            cidrs.push((
                CidrKind::IncludeOutbound,
                IpAddr::V6(Ipv6Addr::UNSPECIFIED),
                0,
                1,
            ));
        }
        IpRanges::Cidrs(set) => cidrs.extend(prefixes(CidrKind::IncludeOutbound, set)),
    }
    cidrs.extend(prefixes(
        CidrKind::ExcludeOutbound,
        &policy.exclude_outbound_ip_ranges,
    ));
    for ip in &policy.pod_ips {
        let len = if ip.is_ipv4() { 32 } else { 128 };
        cidrs.push((CidrKind::Local, *ip, len, 1));
    }
    // What lets a connect skip lookups: lists known empty, and `*`.
    if policy.include_outbound_ip_ranges == IpRanges::All {
        f |= flags::INCLUDE_ALL;
    }
    if !cidrs.iter().any(|c| c.0 == CidrKind::ExcludeOutbound) {
        f |= flags::NO_EXCLUDE_CIDRS;
    }
    if !ports.iter().any(|p| p.0 == PortKind::ExcludeOutbound) {
        f |= flags::NO_EXCLUDE_PORTS;
    }
    if !ports.iter().any(|p| p.0 == PortKind::IncludeOutbound) {
        f |= flags::NO_INCLUDE_PORTS;
    }
    Entries {
        config: PodConfig {
            pod_id: 0,
            flags: f,
            proxy_uid: policy.proxy_uid,
            proxy_gid: policy.proxy_gid,
        },
        ports,
        cidrs,
        ifaces: Vec::new(),
        addrs: pod_addrs(&policy.pod_ips),
    }
}

/// An ambient pod's map entries: Istio's in-pod rules for ztunnel as flags, and the probes'
/// source addresses (the pod's netns adds its own addresses and rerouted interfaces with
/// [`Entries::add_pod_net`]).
#[must_use]
pub fn encode_ambient(policy: &InpodPolicy, pod_ips: &[IpAddr]) -> Entries {
    let mut f = flags::AMBIENT;
    if policy.dns {
        f |= flags::DNS_CAPTURE;
    }
    if policy.ipv6 {
        f |= flags::IPV6;
    }
    if !policy.inbound {
        f |= flags::BYPASS_INBOUND;
    }
    let probe = &policy.host_probe_snat;
    let mut cidrs = vec![(CidrKind::ProbeSource, IpAddr::V4(probe.v4), 32, 1)];
    if policy.ipv6 {
        cidrs.push((CidrKind::ProbeSource, IpAddr::V6(probe.v6), 128, 1));
    }
    Entries {
        config: PodConfig {
            pod_id: 0,
            flags: f,
            proxy_uid: 0,
            proxy_gid: 0,
        },
        ports: Vec::new(),
        cidrs,
        ifaces: Vec::new(),
        addrs: pod_addrs(pod_ips),
    }
}

/// The pod's first address of each family that is neither loopback nor link-local (an
/// IPv4-mapped one counts as IPv4): the source routing gives its connections under Istio's NAT,
/// for the pod's primary interface.
fn pod_addrs(ips: &[IpAddr]) -> PodAddrs {
    let mut addrs = PodAddrs::default();
    for ip in ips.iter().map(IpAddr::to_canonical) {
        match ip {
            IpAddr::V4(v4) if addrs.v4 == 0 && !v4.is_loopback() && !v4.is_link_local() => {
                addrs.v4 = u32::from_ne_bytes(v4.octets());
            }
            IpAddr::V6(v6)
                if addrs.v6 == [0; 4] && !v6.is_loopback() && !v6.is_unicast_link_local() =>
            {
                addrs.v6 = Addr::v6(v6.octets()).words();
            }
            _ => {}
        }
    }
    addrs
}

/// A set's prefixes, masked (the policy keeps addresses as written, `10.0.0.1/8`).
fn prefixes(kind: CidrKind, set: &CidrSet) -> impl Iterator<Item = (CidrKind, IpAddr, u8, u32)> {
    set.v4.iter().chain(&set.v6).map(move |p| {
        let addr = match p.addr() {
            IpAddr::V4(a) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(p.len())).unwrap_or(0);
                IpAddr::V4(Ipv4Addr::from(u32::from(a) & mask))
            }
            IpAddr::V6(a) => {
                let mask = u128::MAX.checked_shl(128 - u32::from(p.len())).unwrap_or(0);
                IpAddr::V6(Ipv6Addr::from(u128::from(a) & mask))
            }
        };
        (kind, addr, p.len(), 1)
    })
}

/// A CIDR list entry's key, in the map of its family.
pub(super) enum CidrKey {
    V4(Key<Cidr4Data>),
    V6(Key<Cidr6Data>),
}

/// The key of `addr/len` in `pod_id`'s `kind` list.
pub(super) fn cidr_key(pod_id: u32, kind: CidrKind, addr: IpAddr, len: u8) -> CidrKey {
    let prefix = CIDR_KEY_PREFIX_BITS + u32::from(len);
    match addr {
        IpAddr::V4(a) => CidrKey::V4(Key::new(
            prefix,
            Cidr4Data::new(pod_id, kind, u32::from_ne_bytes(a.octets())),
        )),
        IpAddr::V6(a) => CidrKey::V6(Key::new(
            prefix,
            Cidr6Data::new(pod_id, kind, Addr::v6(a.octets()).words()),
        )),
    }
}
