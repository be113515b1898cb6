//! What a pod's network looks like from inside its namespace: its cookie, interfaces,
//! addresses and, when asked, routes.
use std::net::IpAddr;

use super::{
    PodNetError, Visit, current_cookie,
    route::{self, Route},
};

/// An interface: its index and name.
pub type Interface = (u32, String);

/// The pod's network as seen from inside its netns.
#[derive(Clone, Debug, Default)]
pub struct PodNet {
    /// The netns cookie.
    pub cookie: u64,
    /// Interfaces other than `lo`, sorted by index.
    pub interfaces: Vec<Interface>,
    /// Every address on every interface (`lo`'s too).
    pub addresses: Vec<IpAddr>,
    /// The main routing table (IPv4 and IPv6), when asked for.
    pub routes: Vec<Route>,
}

/// Reads the visited netns: its cookie, its interfaces and addresses (one `getifaddrs`: its
/// link entries carry the interface indexes), and, when `with_routes` (only
/// `excludeInterfaces` needs them), its main table's routes.
///
/// # Errors
/// When the kernel refuses the queries.
pub fn inspect(visit: &mut Visit, with_routes: bool) -> Result<PodNet, PodNetError> {
    let cookie = current_cookie()?;
    let (interfaces, addresses) = interfaces_and_addresses()?;
    let routes = if with_routes {
        route::main_table(visit.netlink()?, &interfaces)?
    } else {
        Vec::new()
    };
    Ok(PodNet {
        cookie,
        interfaces,
        addresses,
        routes,
    })
}

/// The visited netns's addresses without loopback and link-local ones, each once: what Istio
/// reads inside a pod when the runtime gave none.
///
/// # Errors
/// When the interfaces cannot be listed.
pub fn global_addresses() -> Result<Vec<IpAddr>, PodNetError> {
    let (_, addresses) = interfaces_and_addresses()?;
    let mut out = Vec::new();
    for ip in addresses {
        let local = match ip {
            IpAddr::V4(v4) => v4.is_loopback() || v4.is_link_local(),
            IpAddr::V6(v6) => v6.is_loopback() || v6.is_unicast_link_local(),
        };
        if !local && !out.contains(&ip) {
            out.push(ip);
        }
    }
    Ok(out)
}

/// One `getifaddrs`: the interfaces other than `lo` (index, name; sorted) and every address.
fn interfaces_and_addresses() -> Result<(Vec<Interface>, Vec<IpAddr>), PodNetError> {
    let mut interfaces = Vec::new();
    let mut addresses = Vec::new();
    let entries = nix::ifaddrs::getifaddrs().map_err(|e| PodNetError::Io {
        what: "listing interfaces and addresses".into(),
        source: e.into(),
    })?;
    for entry in entries {
        let Some(address) = entry.address else {
            continue;
        };
        if let Some(link) = address.as_link_addr() {
            let index = u32::try_from(link.ifindex()).unwrap_or(0);
            if entry.interface_name != "lo" && index != 0 {
                interfaces.push((index, entry.interface_name));
            }
        } else if let Some(v4) = address.as_sockaddr_in() {
            addresses.push(IpAddr::V4(v4.ip()));
        } else if let Some(v6) = address.as_sockaddr_in6() {
            addresses.push(IpAddr::V6(v6.ip()));
        }
    }
    interfaces.sort_unstable();
    interfaces.dedup();
    Ok((interfaces, addresses))
}
