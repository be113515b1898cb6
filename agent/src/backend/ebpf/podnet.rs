//! What happens inside a pod's network namespace, always on a dedicated thread
//! ([`crate::netns::run_in`]): learning its interfaces, addresses and routes, attaching and
//! detaching the TC program, and the TPROXY policy route.
use std::{
    fs,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    os::fd::BorrowedFd,
    path::Path,
};

use super::{EbpfError, stub, sys, tcnl};
use crate::{
    backend::iptables::route,
    policy::{
        Family, INBOUND_PASSTHROUGH_V6, IpPrefix, PolicyRoutes, TPROXY_MARK, TPROXY_ROUTE_TABLE,
        TproxyRoute,
    },
};

/// A route of the pod's main table: destination prefix and device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    /// Destination network.
    pub dst: IpAddr,
    /// Prefix length.
    pub len: u8,
    /// Output device.
    pub dev: String,
}

/// The pod's network as seen from inside its netns.
#[derive(Clone, Debug, Default)]
pub struct PodNet {
    /// The netns cookie.
    pub cookie: u64,
    /// Interfaces other than `lo`: (ifindex, name).
    pub interfaces: Vec<(u32, String)>,
    /// Every address on every interface.
    pub addresses: Vec<IpAddr>,
    /// The main routing table (IPv4 and IPv6), when asked for.
    pub routes: Vec<Route>,
}

/// Reads the calling thread's netns (call inside [`crate::netns::run_in`]): its cookie, its
/// interfaces and addresses (one `getifaddrs`: its link entries carry the interface indexes),
/// and, when `with_routes` (only `excludeInterfaces` needs them), its routes.
///
/// # Errors
/// When the kernel refuses the queries.
pub fn inspect(with_routes: bool) -> Result<PodNet, EbpfError> {
    let cookie = crate::netns::current_cookie().map_err(|e| EbpfError::io("netns cookie", e))?;
    let mut interfaces = Vec::new();
    let mut addresses = Vec::new();
    for entry in nix::ifaddrs::getifaddrs()
        .map_err(|e| EbpfError::io("listing interfaces and addresses", e.into()))?
    {
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
    let mut routes = Vec::new();
    if with_routes {
        // /proc/thread-self: /proc/self/net would show the thread group leader's netns.
        let v4 = fs::read_to_string("/proc/thread-self/net/route").unwrap_or_default();
        let v6 = fs::read_to_string("/proc/thread-self/net/ipv6_route").unwrap_or_default();
        routes = parse_route4(&v4);
        routes.extend(parse_route6(&v6));
    }
    Ok(PodNet {
        cookie,
        interfaces,
        addresses,
        routes,
    })
}

/// `/proc/net/route`: `Iface Destination Gateway Flags RefCnt Use Metric Mask ...`, addresses
/// as the hex of the raw (network order) word.
fn parse_route4(text: &str) -> Vec<Route> {
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let dst = u32::from_str_radix(f.get(1)?, 16).ok()?;
            let mask = u32::from_str_radix(f.get(7)?, 16).ok()?;
            Some(Route {
                dst: IpAddr::V4(Ipv4Addr::from(dst.to_le_bytes())),
                len: u8::try_from(mask.count_ones()).ok()?,
                dev: (*f.first()?).to_owned(),
            })
        })
        .collect()
}

/// `/proc/net/ipv6_route`: `dst dst_len src src_len gw metric refcnt use flags dev`.
fn parse_route6(text: &str) -> Vec<Route> {
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let dst = u128::from_str_radix(f.first()?, 16).ok()?;
            Some(Route {
                dst: IpAddr::V6(Ipv6Addr::from(dst)),
                len: u8::from_str_radix(f.get(1)?, 16).ok()?,
                dev: (*f.get(9)?).to_owned(),
            })
        })
        .collect()
}

/// How pods' inbound stubs are attached to their interfaces.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum TcAttach {
    /// A TCX bpf_link (Linux 6.6+), pinned at `pods/<cookie>/tc-<ifname>`. Creating and
    /// releasing one each wait for an RCU grace period in the kernel (6–12 ms apiece), so it
    /// is only used when asked for.
    Tcx,
    /// A `cls_bpf` direct-action filter on the `clsact` qdisc, over netlink (every kernel
    /// meshcap runs on), recorded in the directory `pods/<cookie>/tc-<ifname>/`: the default,
    /// on every kernel (docs/ebpf.md says why).
    #[default]
    Netlink,
}

/// Attaches the pod's `stub` on the ingress of interface `ifindex` (`ifname`) in the calling
/// thread's netns, and records it at `record`: the pinned TCX link, or, for netlink TC, a
/// directory holding the stub pinned under a name that says where its filter is
/// ([`tcnl::Filter::pin_name`]). Nothing is left attached without its record. `tc` is the
/// visit's netlink session.
///
/// # Errors
/// When the kernel refuses the attachment or the pin.
pub fn attach_tc(
    tc: &mut tcnl::Session,
    mode: TcAttach,
    stub: BorrowedFd<'_>,
    ifindex: u32,
    ifname: &str,
    record: &Path,
) -> Result<(), EbpfError> {
    match mode {
        TcAttach::Tcx => {
            let link = sys::tcx_ingress_link_create(stub, ifindex)
                .map_err(|e| EbpfError::io(&format!("attaching TCX ingress on {ifname}"), e))?;
            // Unpinned, the link goes with its fd: nothing stays attached.
            sys::obj_pin(&link, record).map_err(|e| {
                EbpfError::io(
                    &format!("pinning the TC link of {ifname} at {}", record.display()),
                    e,
                )
            })
        }
        TcAttach::Netlink => {
            let filter = tc.attach(ifindex, ifname, stub, stub::NAME)?;
            let pinned = fs::create_dir(record)
                .and_then(|()| sys::obj_pin(stub, &record.join(filter.pin_name())));
            if let Err(e) = pinned {
                let _ = fs::remove_dir(record);
                let _ = tc.detach(ifindex, ifname, sys::prog_id(stub).unwrap_or(0), filter);
                return Err(EbpfError::io(
                    &format!(
                        "recording the TC filter of {ifname} at {}",
                        record.display()
                    ),
                    e,
                ));
            }
            Ok(())
        }
    }
}

/// A netlink-TC record: the filter's place and its program's id.
fn read_netlink_record(record: &Path) -> Result<(tcnl::Filter, u32), String> {
    let entries = super::list_dir(record);
    let (name, filter) = entries
        .iter()
        .find_map(|n| Some((n, tcnl::Filter::parse(n)?)))
        .ok_or_else(|| format!("{} records no TC filter", record.display()))?;
    let prog = sys::obj_get(&record.join(name))
        .map_err(|e| format!("opening {}: {e}", record.join(name).display()))?;
    let id = sys::prog_id(&prog).map_err(|e| format!("{}: {e}", record.join(name).display()))?;
    Ok((filter, id))
}

/// Detaches what [`attach_tc`] attached on `ifname` (the calling thread's netns) and removes
/// its record. For netlink TC only meshcap's filter goes, and the clsact qdisc only when
/// meshcap added it and nothing else uses it.
pub fn detach_tc(tc: &mut tcnl::Session, ifname: &str, record: &Path) {
    if record.is_dir() {
        if let (Ok((filter, id)), Ok(ifindex)) = (
            read_netlink_record(record),
            nix::net::if_::if_nametoindex(ifname),
        ) && let Err(err) = tc.detach(ifindex, ifname, id, filter)
        {
            tracing::warn!(interface = ifname, error = %err, "detaching the TC filter");
        }
        super::remove_tree(record);
    } else {
        let _ = super::unpin_link(record);
    }
}

/// Whether what `record` says is attached on `ifname` (the calling thread's netns) really
/// is: the TCX link is alive on this interface, or meshcap's filter is there with the
/// recorded program.
///
/// # Errors
/// What is missing, in words.
pub fn verify_tc(tc: &mut tcnl::Session, ifname: &str, record: &Path) -> Result<(), String> {
    let ifindex =
        nix::net::if_::if_nametoindex(ifname).map_err(|e| format!("interface {ifname}: {e}"))?;
    if record.is_dir() {
        let (filter, id) = read_netlink_record(record)?;
        match tc
            .find(ifindex, ifname, filter)
            .map_err(|e| e.to_string())?
        {
            Some(found) if found == id => Ok(()),
            Some(found) => Err(format!(
                "the TC filter on {ifname} (pref {}) runs program {found}, not meshcap's {id}",
                filter.priority
            )),
            None => Err(format!(
                "no meshcap TC filter on {ifname} ingress (pref {}, handle {:#x})",
                filter.priority, filter.handle
            )),
        }
    } else {
        let link =
            sys::obj_get(record).map_err(|e| format!("opening {}: {e}", record.display()))?;
        let info = sys::tcx_link_info(&link).map_err(|e| format!("{}: {e}", record.display()))?;
        if info.ifindex == ifindex {
            Ok(())
        } else {
            Err(format!(
                "the TCX link of {ifname} is attached to interface {} (0: none), not {ifindex}",
                info.ifindex
            ))
        }
    }
}

/// The policy route TPROXY mode and rerouted interfaces need (as Istio installs it):
/// packets marked 1337 are delivered locally (`ip rule fwmark 1337 lookup 133`, `local default
/// dev lo table 133`), and accepted sockets inherit the SYN's mark (`tcp_fwmark_accept`), so
/// the app's replies to the original client source reach the proxy's transparent socket.
/// Rerouted interfaces need only the route (`fwmark_accept` false): their packets are marked
/// by the TC program, and the proxy's sockets must not inherit that mark or their replies
/// would be routed back to `lo`. Over rtnetlink, as the iptables backend installs it (no `ip`
/// fork per rule).
///
/// # Errors
/// When the kernel refuses.
pub fn install_tproxy_route(ipv6: bool, fwmark_accept: bool) -> Result<(), EbpfError> {
    route::update(&PolicyRoutes::default(), &tproxy_routes(ipv6)).map_err(route_error)?;
    if !fwmark_accept {
        return Ok(());
    }
    fs::write("/proc/sys/net/ipv4/tcp_fwmark_accept", "1")
        .map_err(|e| EbpfError::io("net.ipv4.tcp_fwmark_accept", e))
}

/// Removes what [`install_tproxy_route`] installed (the rule and table 133, both families);
/// absent ones are fine (the pod used neither TPROXY nor rerouted interfaces, or is gone).
pub fn remove_tproxy_route() {
    if let Err(err) = route::update(&tproxy_routes(true), &PolicyRoutes::default()) {
        tracing::warn!(error = %route_error(err), "removing the TPROXY policy route");
    }
}

/// Adds `::6` to `lo` (Envoy's IPv6 inbound passthrough source), as Istio does.
///
/// # Errors
/// When the kernel refuses.
pub fn add_passthrough6() -> Result<(), EbpfError> {
    let routes = PolicyRoutes {
        tproxy: None,
        loopback_addresses: IpPrefix::new(IpAddr::V6(INBOUND_PASSTHROUGH_V6), 128)
            .into_iter()
            .collect(),
    };
    route::update(&PolicyRoutes::default(), &routes).map_err(route_error)
}

fn tproxy_routes(ipv6: bool) -> PolicyRoutes {
    let mut families = vec![Family::V4];
    if ipv6 {
        families.push(Family::V6);
    }
    PolicyRoutes {
        tproxy: Some(TproxyRoute {
            mark: TPROXY_MARK,
            table: TPROXY_ROUTE_TABLE,
            families,
        }),
        loopback_addresses: Vec::new(),
    }
}

fn route_error(err: route::RouteError) -> EbpfError {
    EbpfError::Command(format!("{}: {}", err.what, err.reason))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_parse() {
        let v4 = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n\
                  eth0\t00000000\t0100000A\t0003\t0\t0\t0\t00000000\t0\t0\t0\n\
                  eth1\t0000A8C0\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0\n";
        let routes = parse_route4(v4);
        assert_eq!(
            routes[1],
            Route {
                dst: "192.168.0.0".parse().unwrap(),
                len: 16,
                dev: "eth1".into()
            }
        );
        assert_eq!(routes[0].len, 0);
        let v6 = "fd000000000000000000000000000000 40 00000000000000000000000000000000 00 00000000000000000000000000000000 00000100 00000001 00000000 00000001     eth1\n";
        assert_eq!(
            parse_route6(v6),
            vec![Route {
                dst: "fd00::".parse().unwrap(),
                len: 64,
                dev: "eth1".into()
            }]
        );
    }
}
