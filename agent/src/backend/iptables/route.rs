//! The TPROXY policy route, over netlink: `ip rule add fwmark 1337 lookup 133` and
//! `ip route add local default dev lo table 133` (and their IPv6 twins when the pod has IPv6),
//! as Istio's `tools/common/tproxy` installs them. Must run on a thread inside the pod netns:
//! the netlink socket belongs to the netns it is opened in.
use std::net::{Ipv4Addr, Ipv6Addr};

use futures::TryStreamExt as _;
use rtnetlink::{
    Handle, IpVersion, RouteMessageBuilder,
    packet_route::{
        route::{RouteAttribute, RouteScope, RouteType},
        rule::{RuleAction, RuleAttribute},
    },
};

use crate::policy::{Family, IpPrefix, PolicyRoutes, TPROXY_MARK, TPROXY_ROUTE_TABLE};

/// `lo` is always interface 1 in a network namespace.
const LOOPBACK_INDEX: u32 = 1;

const EEXIST: i32 = 17;
const ENOENT: i32 = 2;
const ESRCH: i32 = 3;
const EADDRNOTAVAIL: i32 = 99;

/// What went wrong, as text for the backend's error.
#[derive(Debug)]
pub struct RouteError {
    /// The request.
    pub what: String,
    /// The kernel's answer.
    pub reason: String,
}

fn errno(err: &rtnetlink::Error) -> Option<i32> {
    match err {
        rtnetlink::Error::NetlinkError(msg) => msg.code.map(|c| -c.get()),
        _ => None,
    }
}

fn fail(what: &str, err: impl std::fmt::Display) -> RouteError {
    RouteError {
        what: what.to_owned(),
        reason: err.to_string(),
    }
}

/// Runs `f` with a netlink handle on a private single-threaded runtime (this is a blocking
/// call on a netns thread, never on the agent's runtime).
fn with_handle<T>(f: impl AsyncFnOnce(Handle) -> Result<T, RouteError>) -> Result<T, RouteError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .map_err(|e| fail("starting a netlink runtime", e))?;
    runtime.block_on(async {
        let (connection, handle, _) =
            rtnetlink::new_connection().map_err(|e| fail("opening a netlink socket", e))?;
        let task = tokio::spawn(connection);
        let out = f(handle).await;
        task.abort();
        out
    })
}

fn route_v4() -> rtnetlink::packet_route::route::RouteMessage {
    RouteMessageBuilder::<Ipv4Addr>::new()
        .kind(RouteType::Local)
        .scope(RouteScope::Host)
        .table_id(TPROXY_ROUTE_TABLE)
        .output_interface(LOOPBACK_INDEX)
        .build()
}

fn route_v6() -> rtnetlink::packet_route::route::RouteMessage {
    RouteMessageBuilder::<Ipv6Addr>::new()
        .kind(RouteType::Local)
        .scope(RouteScope::Host)
        .table_id(TPROXY_ROUTE_TABLE)
        .output_interface(LOOPBACK_INDEX)
        .build()
}

fn families(routes: &PolicyRoutes) -> Vec<IpVersion> {
    routes.tproxy.as_ref().map_or_else(Vec::new, |t| {
        t.families
            .iter()
            .map(|f| match f {
                Family::V4 => IpVersion::V4,
                Family::V6 => IpVersion::V6,
            })
            .collect()
    })
}

/// Moves the netns from the routes of `old` to those of `new`: adds what `new` has, removes
/// what only `old` had.
///
/// # Errors
/// When the kernel refuses.
pub fn update(old: &PolicyRoutes, new: &PolicyRoutes) -> Result<(), RouteError> {
    if old == new && new.tproxy.is_none() && new.loopback_addresses.is_empty() {
        return Ok(());
    }
    with_handle(async |handle| {
        let (old_families, new_families) = (families(old), families(new));
        for family in &new_families {
            ensure(&handle, family).await?;
        }
        for family in old_families.iter().filter(|f| !new_families.contains(f)) {
            remove(&handle, family).await?;
        }
        for prefix in &new.loopback_addresses {
            add_loopback(&handle, prefix).await?;
        }
        for prefix in old
            .loopback_addresses
            .iter()
            .filter(|p| !new.loopback_addresses.contains(p))
        {
            del_loopback(&handle, prefix).await?;
        }
        Ok(())
    })
}

async fn add_loopback(handle: &Handle, prefix: &IpPrefix) -> Result<(), RouteError> {
    match handle
        .address()
        .add(LOOPBACK_INDEX, prefix.addr(), prefix.len())
        .execute()
        .await
    {
        Err(e) if errno(&e) != Some(EEXIST) => Err(fail(
            &format!("ip addr add {}/{} dev lo", prefix.addr(), prefix.len()),
            e,
        )),
        _ => Ok(()),
    }
}

async fn del_loopback(handle: &Handle, prefix: &IpPrefix) -> Result<(), RouteError> {
    let addresses: Vec<_> = handle
        .address()
        .get()
        .set_link_index_filter(LOOPBACK_INDEX)
        .execute()
        .try_collect()
        .await
        .map_err(|e| fail("listing lo addresses", e))?;
    for message in addresses {
        let ours = message.header.prefix_len == prefix.len()
            && message.attributes.iter().any(|a| {
                matches!(a, rtnetlink::packet_route::address::AddressAttribute::Address(ip) if *ip == prefix.addr())
            });
        if ours
            && let Err(e) = handle.address().del(message).execute().await
            && !matches!(errno(&e), Some(ENOENT | ESRCH | EADDRNOTAVAIL))
        {
            return Err(fail(
                &format!("ip addr del {}/{} dev lo", prefix.addr(), prefix.len()),
                e,
            ));
        }
    }
    Ok(())
}

/// Installs the rule and route of one family (present already is fine).
async fn ensure(handle: &Handle, family: &IpVersion) -> Result<(), RouteError> {
    let rule = handle
        .rule()
        .add()
        .fw_mark(TPROXY_MARK)
        .table_id(TPROXY_ROUTE_TABLE)
        .action(RuleAction::ToTable);
    let added = match family {
        IpVersion::V4 => rule.v4().execute().await,
        IpVersion::V6 => rule.v6().execute().await,
    };
    if let Err(e) = added
        && errno(&e) != Some(EEXIST)
    {
        return Err(fail(
            &format!("ip rule add fwmark {TPROXY_MARK} lookup {TPROXY_ROUTE_TABLE} ({family:?})"),
            e,
        ));
    }
    let route = match family {
        IpVersion::V4 => route_v4(),
        IpVersion::V6 => route_v6(),
    };
    if let Err(e) = handle.route().add(route).execute().await
        && errno(&e) != Some(EEXIST)
    {
        return Err(fail(
            &format!("ip route add local default dev lo table {TPROXY_ROUTE_TABLE} ({family:?})"),
            e,
        ));
    }
    Ok(())
}

/// Our rules of one family, as the kernel lists them.
async fn our_rules(
    handle: &Handle,
    family: IpVersion,
) -> Result<Vec<rtnetlink::packet_route::rule::RuleMessage>, RouteError> {
    let rules: Vec<_> = handle
        .rule()
        .get(family.clone())
        .execute()
        .try_collect()
        .await
        .map_err(|e| fail("listing ip rules", e))?;
    Ok(rules
        .into_iter()
        .filter(|r| {
            r.attributes.contains(&RuleAttribute::FwMark(TPROXY_MARK))
                && (r
                    .attributes
                    .contains(&RuleAttribute::Table(TPROXY_ROUTE_TABLE))
                    || u32::from(r.header.table) == TPROXY_ROUTE_TABLE)
        })
        .collect())
}

/// Whether table 133 holds the local default route of one family.
async fn has_route(handle: &Handle, family: &IpVersion) -> Result<bool, RouteError> {
    let query = match family {
        IpVersion::V4 => RouteMessageBuilder::<Ipv4Addr>::new()
            .table_id(TPROXY_ROUTE_TABLE)
            .build(),
        IpVersion::V6 => RouteMessageBuilder::<Ipv6Addr>::new()
            .table_id(TPROXY_ROUTE_TABLE)
            .build(),
    };
    let routes: Vec<_> = handle
        .route()
        .get(query)
        .execute()
        .try_collect()
        .await
        .map_err(|e| fail("listing routes", e))?;
    Ok(routes.iter().any(|r| {
        r.header.kind == RouteType::Local
            && r.header.destination_prefix_length == 0
            && (r
                .attributes
                .contains(&RouteAttribute::Table(TPROXY_ROUTE_TABLE))
                || u32::from(r.header.table) == TPROXY_ROUTE_TABLE)
    }))
}

/// Removes the rule and route of one family (absent already is fine).
async fn remove(handle: &Handle, family: &IpVersion) -> Result<(), RouteError> {
    for rule in our_rules(handle, family.clone()).await? {
        if let Err(e) = handle.rule().del(rule).execute().await
            && !matches!(errno(&e), Some(ENOENT | ESRCH))
        {
            return Err(fail("ip rule del", e));
        }
    }
    let route = match family {
        IpVersion::V4 => route_v4(),
        IpVersion::V6 => route_v6(),
    };
    if let Err(e) = handle.route().del(route).execute().await
        && !matches!(errno(&e), Some(ENOENT | ESRCH))
    {
        return Err(fail("ip route del local default table 133", e));
    }
    Ok(())
}

/// What of the rule and route is missing, if anything.
///
/// # Errors
/// When the kernel cannot be asked.
pub fn missing(routes: &PolicyRoutes) -> Result<Option<String>, RouteError> {
    if routes.tproxy.is_none() {
        return Ok(None);
    }
    with_handle(async |handle| {
        for family in &families(routes) {
            if our_rules(&handle, family.clone()).await?.is_empty() {
                return Ok(Some(format!(
                    "ip rule fwmark {TPROXY_MARK} lookup {TPROXY_ROUTE_TABLE} ({family:?})"
                )));
            }
            if !has_route(&handle, family).await? {
                return Ok(Some(format!(
                    "route local default dev lo table {TPROXY_ROUTE_TABLE} ({family:?})"
                )));
            }
        }
        Ok(None)
    })
}
