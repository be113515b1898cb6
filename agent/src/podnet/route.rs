//! Routing inside a pod's netns, over the visit's netlink socket: the policy routes a capture
//! needs ([`PolicyRoutes`]: a mark route — Istio's TPROXY rule and table, `ip rule add fwmark
//! 1337 lookup 133` and `ip route add local default dev lo table 133` per family, as
//! `tools/common/tproxy` installs them, or ambient mode's `fwmark 0x111/0xfff pref 32764 lookup
//! 100` — and addresses on `lo`), and the main table's routes (`excludeInterfaces` needs to
//! know which prefixes leave by which device).
use std::{
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use meshcap_policy::{Family, IpPrefix, MarkRoute, PolicyRoutes};
use netlink_packet_core::{NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL};
use netlink_packet_route::{
    AddressFamily, RouteNetlinkMessage,
    address::{AddressAttribute, AddressMessage},
    route::{
        RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteScope,
        RouteType,
    },
    rule::{RuleAction, RuleAttribute, RuleMessage},
};

use super::{Interface, Netlink, PodNetError, errno};

/// `lo` is always interface 1 in a network namespace.
const LOOPBACK_INDEX: u32 = 1;

/// A route of the pod's main table: destination prefix and output interface.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    /// Destination network.
    pub dst: IpAddr,
    /// Prefix length.
    pub len: u8,
    /// Output interface.
    pub dev: String,
}

fn failed(what: impl Into<String>) -> impl FnOnce(io::Error) -> PodNetError {
    let what = what.into();
    move |source| PodNetError::Netlink { what, source }
}

fn address_family(family: Family) -> AddressFamily {
    match family {
        Family::V4 => AddressFamily::Inet,
        Family::V6 => AddressFamily::Inet6,
    }
}

/// Moves the netns from the routes of `old` to those of `new`: adds what `new` has, removes
/// what only `old` had. Present and absent ones are fine.
///
/// # Errors
/// When the kernel refuses.
pub fn update(
    netlink: &mut Netlink,
    old: &PolicyRoutes,
    new: &PolicyRoutes,
) -> Result<(), PodNetError> {
    for (route, family) in &pairs(new) {
        ensure(netlink, route, *family)?;
    }
    for (route, family) in &dropped(old, new) {
        remove(netlink, route, *family)?;
    }
    for prefix in &new.loopback_addresses {
        add_loopback(netlink, prefix)?;
    }
    for prefix in old
        .loopback_addresses
        .iter()
        .filter(|p| !new.loopback_addresses.contains(p))
    {
        del_loopback(netlink, prefix)?;
    }
    Ok(())
}

/// What of `routes`' mark rule and route is missing, if anything.
///
/// # Errors
/// When the kernel cannot be asked.
pub fn missing(
    netlink: &mut Netlink,
    routes: &PolicyRoutes,
) -> Result<Option<String>, PodNetError> {
    for (route, family) in pairs(routes) {
        if our_rules(netlink, &route, family)?.is_empty() {
            return Ok(Some(format!(
                "ip rule {} ({family:?})",
                route.describe_rule()
            )));
        }
        if !has_local_route(netlink, &route, family)? {
            return Ok(Some(format!(
                "route local default dev lo table {} ({family:?})",
                route.table
            )));
        }
    }
    Ok(None)
}

/// The families in which `routes`' mark rule or its route is in the netns already: found
/// there before meshcap's capture (istio-cni's), so never meshcap's to remove.
///
/// # Errors
/// When the kernel cannot be asked.
pub fn found(netlink: &mut Netlink, routes: &PolicyRoutes) -> Result<Vec<Family>, PodNetError> {
    let mut found = Vec::new();
    for (route, family) in pairs(routes) {
        if !our_rules(netlink, &route, family)?.is_empty()
            || has_local_route(netlink, &route, family)?
        {
            found.push(family);
        }
    }
    Ok(found)
}

/// The routes of the main table, both families, with their output interface named by
/// `interfaces` (index, name); routes through other interfaces (`lo`) are left out.
///
/// # Errors
/// When the kernel cannot be asked.
pub fn main_table(
    netlink: &mut Netlink,
    interfaces: &[Interface],
) -> Result<Vec<Route>, PodNetError> {
    let mut out = Vec::new();
    for family in [Family::V4, Family::V6] {
        for route in routes(netlink, family)? {
            if table(&route) != u32::from(RouteHeader::RT_TABLE_MAIN) {
                continue;
            }
            let dst = route.attributes.iter().find_map(|a| match a {
                RouteAttribute::Destination(RouteAddress::Inet(v4)) => Some(IpAddr::V4(*v4)),
                RouteAttribute::Destination(RouteAddress::Inet6(v6)) => Some(IpAddr::V6(*v6)),
                _ => None,
            });
            let unspecified = match family {
                Family::V4 => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
                Family::V6 => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
            };
            let dev = route.attributes.iter().find_map(|a| match a {
                RouteAttribute::Oif(index) => interfaces
                    .iter()
                    .find(|(i, _)| i == index)
                    .map(|(_, name)| name.clone()),
                _ => None,
            });
            let Some(dev) = dev else {
                continue;
            };
            out.push(Route {
                dst: dst.unwrap_or(unspecified),
                len: route.header.destination_prefix_length,
                dev,
            });
        }
    }
    Ok(out)
}

/// The mark route of `routes` with each family it is installed in.
/// The rules and routes of `old` that `new` does not have.
fn dropped(old: &PolicyRoutes, new: &PolicyRoutes) -> Vec<(MarkRoute, Family)> {
    let wanted = pairs(new);
    pairs(old)
        .into_iter()
        .filter(|pair| !wanted.contains(pair))
        .collect()
}

/// The mark route of `routes` once per family, each naming its own family alone: what is in
/// the kernel is one rule and one route per family, so a route kept in IPv4 while its IPv6
/// goes (`ambient.ipv6` switched off) compares equal to the IPv4 one there and stays.
fn pairs(routes: &PolicyRoutes) -> Vec<(MarkRoute, Family)> {
    routes
        .mark_route
        .iter()
        .flat_map(|route| {
            route.families.iter().map(|&family| {
                let one = MarkRoute {
                    families: vec![family],
                    ..route.clone()
                };
                (one, family)
            })
        })
        .collect()
}

/// The table a route or rule is in: the attribute when the table number needs one, else the
/// header's byte.
fn table(route: &RouteMessage) -> u32 {
    route
        .attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Table(t) => Some(*t),
            _ => None,
        })
        .unwrap_or_else(|| u32::from(route.header.table))
}

/// `local default dev lo table TABLE` of one family.
fn local_route(mark_route: &MarkRoute, family: Family) -> RouteMessage {
    let mut route = RouteMessage::default();
    route.header.address_family = address_family(family);
    route.header.protocol = RouteProtocol::Static;
    route.header.scope = RouteScope::Host;
    route.header.kind = RouteType::Local;
    route.header.table = RouteHeader::RT_TABLE_UNSPEC;
    route.attributes = vec![
        RouteAttribute::Table(mark_route.table),
        RouteAttribute::Oif(LOOPBACK_INDEX),
    ];
    route
}

/// `fwmark MARK[/MASK] [pref PRIORITY] lookup TABLE` of one family.
fn mark_rule(route: &MarkRoute, family: Family) -> RuleMessage {
    let mut rule = RuleMessage::default();
    rule.header.family = address_family(family);
    rule.header.table = RouteHeader::RT_TABLE_UNSPEC;
    rule.header.action = RuleAction::ToTable;
    rule.attributes = vec![
        RuleAttribute::FwMark(route.mark),
        RuleAttribute::Table(route.table),
    ];
    if let Some(mask) = route.mask {
        rule.attributes.push(RuleAttribute::FwMask(mask));
    }
    if let Some(priority) = route.priority {
        rule.attributes.push(RuleAttribute::Priority(priority));
    }
    rule
}

/// Installs the rule and route of one family (present already is fine).
fn ensure(netlink: &mut Netlink, route: &MarkRoute, family: Family) -> Result<(), PodNetError> {
    match netlink.request(
        RouteNetlinkMessage::NewRule(mark_rule(route, family)),
        NLM_F_CREATE | NLM_F_EXCL,
    ) {
        Err(e) if errno(&e) != Some(libc::EEXIST) => {
            return Err(failed(format!(
                "ip rule add {} ({family:?})",
                route.describe_rule()
            ))(e));
        }
        _ => {}
    }
    match netlink.request(
        RouteNetlinkMessage::NewRoute(local_route(route, family)),
        NLM_F_CREATE | NLM_F_EXCL,
    ) {
        Err(e) if errno(&e) != Some(libc::EEXIST) => Err(failed(format!(
            "ip route add local default dev lo table {} ({family:?})",
            route.table
        ))(e)),
        _ => Ok(()),
    }
}

/// Removes the rule and route of one family (absent already is fine).
fn remove(netlink: &mut Netlink, route: &MarkRoute, family: Family) -> Result<(), PodNetError> {
    for rule in our_rules(netlink, route, family)? {
        match netlink.request(RouteNetlinkMessage::DelRule(rule), 0) {
            Err(e) if !matches!(errno(&e), Some(libc::ENOENT | libc::ESRCH)) => {
                return Err(failed("ip rule del")(e));
            }
            _ => {}
        }
    }
    match netlink.request(RouteNetlinkMessage::DelRoute(local_route(route, family)), 0) {
        Err(e) if !matches!(errno(&e), Some(libc::ENOENT | libc::ESRCH)) => Err(failed(format!(
            "ip route del local default table {}",
            route.table
        ))(e)),
        _ => Ok(()),
    }
}

/// Our rules of one family, as the kernel lists them.
fn our_rules(
    netlink: &mut Netlink,
    route: &MarkRoute,
    family: Family,
) -> Result<Vec<RuleMessage>, PodNetError> {
    let mut query = RuleMessage::default();
    query.header.family = address_family(family);
    let answers = netlink
        .request(RouteNetlinkMessage::GetRule(query), NLM_F_DUMP)
        .map_err(failed("ip rule show"))?;
    Ok(answers
        .into_iter()
        .filter_map(|m| match m {
            RouteNetlinkMessage::NewRule(rule) => Some(rule),
            _ => None,
        })
        .filter(|r| {
            r.header.family == address_family(family)
                && r.attributes.contains(&RuleAttribute::FwMark(route.mark))
                && (r.attributes.contains(&RuleAttribute::Table(route.table))
                    || u32::from(r.header.table) == route.table)
        })
        .collect())
}

fn routes(netlink: &mut Netlink, family: Family) -> Result<Vec<RouteMessage>, PodNetError> {
    let mut query = RouteMessage::default();
    query.header.address_family = address_family(family);
    let answers = netlink
        .request(RouteNetlinkMessage::GetRoute(query), NLM_F_DUMP)
        .map_err(failed(format!("ip route show table all ({family:?})")))?;
    Ok(answers
        .into_iter()
        .filter_map(|m| match m {
            RouteNetlinkMessage::NewRoute(route)
                if route.header.address_family == address_family(family) =>
            {
                Some(route)
            }
            _ => None,
        })
        .collect())
}

/// Whether the route's table holds the local default route of one family.
fn has_local_route(
    netlink: &mut Netlink,
    route: &MarkRoute,
    family: Family,
) -> Result<bool, PodNetError> {
    Ok(routes(netlink, family)?.iter().any(|r| {
        r.header.kind == RouteType::Local
            && r.header.destination_prefix_length == 0
            && table(r) == route.table
    }))
}

fn loopback_address(prefix: &IpPrefix) -> AddressMessage {
    let mut message = AddressMessage::default();
    message.header.family = match prefix.addr() {
        IpAddr::V4(_) => AddressFamily::Inet,
        IpAddr::V6(_) => AddressFamily::Inet6,
    };
    message.header.prefix_len = prefix.len();
    message.header.index = LOOPBACK_INDEX;
    message.attributes = vec![
        AddressAttribute::Address(prefix.addr()),
        AddressAttribute::Local(prefix.addr()),
    ];
    message
}

fn add_loopback(netlink: &mut Netlink, prefix: &IpPrefix) -> Result<(), PodNetError> {
    match netlink.request(
        RouteNetlinkMessage::NewAddress(loopback_address(prefix)),
        NLM_F_CREATE | NLM_F_EXCL,
    ) {
        Err(e) if errno(&e) != Some(libc::EEXIST) => Err(failed(format!(
            "ip addr add {}/{} dev lo",
            prefix.addr(),
            prefix.len()
        ))(e)),
        _ => Ok(()),
    }
}

fn del_loopback(netlink: &mut Netlink, prefix: &IpPrefix) -> Result<(), PodNetError> {
    match netlink.request(RouteNetlinkMessage::DelAddress(loopback_address(prefix)), 0) {
        Err(e)
            if !matches!(
                errno(&e),
                Some(libc::ENOENT | libc::ESRCH | libc::EADDRNOTAVAIL)
            ) =>
        {
            Err(failed(format!(
                "ip addr del {}/{} dev lo",
                prefix.addr(),
                prefix.len()
            ))(e))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routes(route: MarkRoute) -> PolicyRoutes {
        PolicyRoutes {
            mark_route: Some(route),
            ..PolicyRoutes::default()
        }
    }

    fn families(pairs: &[(MarkRoute, Family)]) -> Vec<Family> {
        pairs.iter().map(|(_, family)| *family).collect()
    }

    #[test]
    fn a_family_switched_off_drops_its_own_rule_and_route_only() {
        let both = routes(MarkRoute::ambient(true));
        let v4 = routes(MarkRoute::ambient(false));
        assert_eq!(families(&dropped(&both, &v4)), [Family::V6]);
        assert_eq!(families(&dropped(&v4, &both)), []);
        assert_eq!(families(&dropped(&both, &both)), []);
        assert_eq!(
            families(&dropped(&both, &PolicyRoutes::default())),
            [Family::V4, Family::V6]
        );
        assert_eq!(
            families(&dropped(&routes(MarkRoute::tproxy(true)), &both)),
            [Family::V4, Family::V6],
            "another route altogether"
        );
    }
}
