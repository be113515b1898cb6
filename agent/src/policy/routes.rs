//! What a policy needs besides packet rules, set up over netlink in the pod's netns: the
//! TPROXY policy route and addresses on `lo`. Both backends install it (through
//! `crate::podnet::route`); the iptables backend's rules rely on it exactly as Istio's do.
use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use super::{
    INBOUND_PASSTHROUGH_V6,
    model::{Family, IpPrefix, TPROXY_MARK, TPROXY_ROUTE_TABLE},
};

/// Netlink state a policy relies on.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyRoutes {
    /// TPROXY mode with inbound capture: `ip rule add fwmark 1337 lookup 133` and
    /// `ip route add local default dev lo table 133`, per family.
    pub tproxy: Option<TproxyRoute>,
    /// Addresses to add to `lo`: `::6/128` (the IPv6 inbound passthrough source) when the pod
    /// has IPv6; IPv4 needs none (127.0.0.0/8 is all on `lo`).
    pub loopback_addresses: Vec<IpPrefix>,
}

/// The TPROXY policy route.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TproxyRoute {
    /// The `ip rule` fwmark (1337).
    pub mark: u32,
    /// The routing table holding `local default dev lo` (133).
    pub table: u32,
    /// The families to install both in (IPv4, and IPv6 when the pod has it).
    pub families: Vec<Family>,
}

impl TproxyRoute {
    /// Istio's route (mark 1337, table 133) in IPv4, and IPv6 when `ipv6`.
    #[must_use]
    pub fn new(ipv6: bool) -> Self {
        let mut families = vec![Family::V4];
        if ipv6 {
            families.push(Family::V6);
        }
        Self {
            mark: TPROXY_MARK,
            table: TPROXY_ROUTE_TABLE,
            families,
        }
    }
}

impl PolicyRoutes {
    /// Only the TPROXY route, in IPv4 and, when `ipv6`, IPv6.
    #[must_use]
    pub fn tproxy(ipv6: bool) -> Self {
        Self {
            tproxy: Some(TproxyRoute::new(ipv6)),
            loopback_addresses: Vec::new(),
        }
    }

    /// Only `::6/128` on `lo`: Envoy's IPv6 inbound passthrough source, as Istio adds it.
    #[must_use]
    pub fn passthrough6() -> Self {
        Self {
            tproxy: None,
            loopback_addresses: IpPrefix::new(IpAddr::V6(INBOUND_PASSTHROUGH_V6), 128)
                .into_iter()
                .collect(),
        }
    }

    /// Whether there is nothing to install.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.tproxy.is_none() && self.loopback_addresses.is_empty()
    }
}
