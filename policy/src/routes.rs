//! What a policy needs besides packet rules, set up over netlink in the pod's netns: a
//! policy route by packet mark (TPROXY's, or ambient mode's for replies to ztunnel) and
//! addresses on `lo`. Both of the agent's backends install it (its `podnet::route`); the iptables backend's rules rely on it exactly as Istio's do.
use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use super::{
    INBOUND_PASSTHROUGH_V6,
    ambient::{AMBIENT_ROUTE_TABLE, AMBIENT_RULE_PRIORITY, CONNECTION_MARK, CONNECTION_MARK_MASK},
    model::{Family, IpPrefix, TPROXY_MARK, TPROXY_ROUTE_TABLE},
};

/// Netlink state a policy relies on.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyRoutes {
    /// TPROXY mode with inbound capture: `ip rule add fwmark 1337 lookup 133` and
    /// `ip route add local default dev lo table 133`, per family; ambient mode: `ip rule add
    /// fwmark 0x111/0xfff pref 32764 lookup 100` and `local default dev lo table 100`.
    #[serde(alias = "tproxy")]
    pub mark_route: Option<MarkRoute>,
    /// Addresses to add to `lo`: `::6/128` (the IPv6 inbound passthrough source) when the pod
    /// has IPv6; IPv4 needs none (127.0.0.0/8 is all on `lo`).
    pub loopback_addresses: Vec<IpPrefix>,
}

/// A policy route by packet mark: packets with the mark are delivered locally (`ip rule
/// fwmark MARK[/MASK] [pref PRIORITY] lookup TABLE` and `ip route add local default dev lo
/// table TABLE`, per family).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MarkRoute {
    /// The `ip rule` fwmark.
    pub mark: u32,
    /// Its mask (none: the whole mark).
    #[serde(default)]
    pub mask: Option<u32>,
    /// The rule's priority (none: the kernel picks one).
    #[serde(default)]
    pub priority: Option<u32>,
    /// The routing table holding `local default dev lo`.
    pub table: u32,
    /// The families to install both in (IPv4, and IPv6 when the pod has it).
    pub families: Vec<Family>,
}

fn families(ipv6: bool) -> Vec<Family> {
    let mut families = vec![Family::V4];
    if ipv6 {
        families.push(Family::V6);
    }
    families
}

impl MarkRoute {
    /// Istio's TPROXY route (mark 1337, table 133) in IPv4, and IPv6 when `ipv6`.
    #[must_use]
    pub fn tproxy(ipv6: bool) -> Self {
        Self {
            mark: TPROXY_MARK,
            mask: None,
            priority: None,
            table: TPROXY_ROUTE_TABLE,
            families: families(ipv6),
        }
    }

    /// Istio's in-pod route of ambient mode (`fwmark 0x111/0xfff pref 32764 lookup 100`,
    /// `cni/pkg/iptables/iptables_linux.go`): replies to ztunnel's connections, which carry
    /// the connection mark, go back to ztunnel.
    #[must_use]
    pub fn ambient(ipv6: bool) -> Self {
        Self {
            mark: CONNECTION_MARK,
            mask: Some(CONNECTION_MARK_MASK),
            priority: Some(AMBIENT_RULE_PRIORITY),
            table: AMBIENT_ROUTE_TABLE,
            families: families(ipv6),
        }
    }

    /// `fwmark 1337 lookup 133`, as `ip rule` shows it.
    #[must_use]
    pub fn describe_rule(&self) -> String {
        let mask = self.mask.map(|m| format!("/{m:#x}")).unwrap_or_default();
        let priority = self
            .priority
            .map(|p| format!(" pref {p}"))
            .unwrap_or_default();
        format!(
            "fwmark {:#x}{mask}{priority} lookup {}",
            self.mark, self.table
        )
    }
}

impl PolicyRoutes {
    /// Only the TPROXY route, in IPv4 and, when `ipv6`, IPv6.
    #[must_use]
    pub fn tproxy(ipv6: bool) -> Self {
        Self {
            mark_route: Some(MarkRoute::tproxy(ipv6)),
            loopback_addresses: Vec::new(),
        }
    }

    /// Only `::6/128` on `lo`: Envoy's IPv6 inbound passthrough source, as Istio adds it.
    #[must_use]
    pub fn passthrough6() -> Self {
        Self {
            mark_route: None,
            loopback_addresses: IpPrefix::new(IpAddr::V6(INBOUND_PASSTHROUGH_V6), 128)
                .into_iter()
                .collect(),
        }
    }

    /// Whether there is nothing to install.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.mark_route.is_none() && self.loopback_addresses.is_empty()
    }

    /// These routes without the mark route's families in `found`: those the pod's netns held
    /// before meshcap's capture (Istio's), which are never meshcap's to remove.
    #[must_use]
    pub fn without_found(&self, found: &[Family]) -> Self {
        let mark_route = self.mark_route.clone().and_then(|mut route| {
            route.families.retain(|family| !found.contains(family));
            (!route.families.is_empty()).then_some(route)
        });
        Self {
            mark_route,
            loopback_addresses: self.loopback_addresses.clone(),
        }
    }
}
