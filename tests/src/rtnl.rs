//! The harness's network namespaces, links, addresses and routes, made in process over
//! rtnetlink and mount(2) instead of by `ip`. Wiring a pod took about fifteen `ip` processes:
//! on the host a third of the scenario table's CPU went to forking the test binary and to
//! `ip`'s dynamic loading, and under the guests' emulator a process start costs many times
//! more. The link, address and route calls act in the calling thread's network namespace
//! (`crate::Netns::run_in`).
use std::{
    fs::{self, File},
    net::IpAddr,
    os::{fd::AsRawFd as _, unix::fs::OpenOptionsExt as _},
    path::Path,
    sync::Mutex,
    thread,
};

use anyhow::{Context as _, bail};
use meshcap_agent::podnet::Netlink;
use netlink_packet_core::{NLM_F_CREATE, NLM_F_EXCL};
use netlink_packet_route::{
    AddressFamily, RouteNetlinkMessage,
    address::{AddressAttribute, AddressHeaderFlags, AddressMessage},
    link::{InfoData, InfoKind, InfoVeth, LinkAttribute, LinkFlags, LinkInfo, LinkMessage},
    route::{RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteType},
};
use nix::mount::{MntFlags, MsFlags, mount, umount2};

/// Where `ip netns` names namespaces.
pub const NETNS_RUN_DIR: &str = "/run/netns";

/// Whether this process made [`NETNS_RUN_DIR`] a shared mount yet.
static RUN_DIR_SHARED: Mutex<bool> = Mutex::new(false);

/// `ip netns add`: a new network namespace kept by a bind mount at `path` in
/// [`NETNS_RUN_DIR`], which is made a shared mount first as `ip` makes it (its namespaces then
/// reach other mount namespaces).
///
/// # Errors
/// When the file exists or the kernel refuses.
pub fn add_netns(path: &Path) -> anyhow::Result<()> {
    share_run_dir()?;
    File::options()
        .write(true)
        .create_new(true)
        .mode(0o000)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    // A thread of its own: unshare moves only the calling thread to the new namespace, and the
    // bind mount keeps the namespace after the thread is gone.
    let made = thread::scope(|scope| {
        scope
            .spawn(|| -> anyhow::Result<()> {
                nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
                    .context("unshare(CLONE_NEWNET)")?;
                mount(
                    Some("/proc/thread-self/ns/net"),
                    path,
                    None::<&str>,
                    MsFlags::MS_BIND,
                    None::<&str>,
                )
                .with_context(|| format!("bind-mounting the new netns on {}", path.display()))
            })
            .join()
            .unwrap_or_else(|_| bail!("the thread making {} panicked", path.display()))
    });
    if made.is_err() {
        let _ = fs::remove_file(path);
    }
    made
}

/// `ip netns del`: the bind mount at `path` detached and its file removed (the namespace goes
/// with its last process or socket).
///
/// # Errors
/// When the kernel refuses.
pub fn del_netns(path: &Path) -> anyhow::Result<()> {
    umount2(path, MntFlags::MNT_DETACH)
        .with_context(|| format!("unmounting {}", path.display()))?;
    fs::remove_file(path).with_context(|| format!("removing {}", path.display()))
}

fn share_run_dir() -> anyhow::Result<()> {
    let mut shared = RUN_DIR_SHARED.lock().unwrap_or_else(|e| e.into_inner());
    if *shared {
        return Ok(());
    }
    fs::create_dir_all(NETNS_RUN_DIR).with_context(|| format!("creating {NETNS_RUN_DIR}"))?;
    let make_shared = || {
        mount(
            None::<&str>,
            NETNS_RUN_DIR,
            None::<&str>,
            MsFlags::MS_SHARED | MsFlags::MS_REC,
            None::<&str>,
        )
    };
    if make_shared() == Err(nix::errno::Errno::EINVAL) {
        // Not a mount point yet: bind it onto itself, as `ip` does.
        mount(
            Some(NETNS_RUN_DIR),
            NETNS_RUN_DIR,
            None::<&str>,
            MsFlags::MS_BIND | MsFlags::MS_REC,
            None::<&str>,
        )
        .with_context(|| format!("bind-mounting {NETNS_RUN_DIR} onto itself"))?;
        make_shared().with_context(|| format!("making {NETNS_RUN_DIR} a shared mount"))?;
    }
    *shared = true;
    Ok(())
}

fn ifindex(dev: &str) -> anyhow::Result<u32> {
    nix::net::if_::if_nametoindex(dev).with_context(|| format!("no device {dev:?} in this netns"))
}

fn create(netlink: &mut Netlink, message: RouteNetlinkMessage, what: &str) -> anyhow::Result<()> {
    netlink
        .request(message, NLM_F_CREATE | NLM_F_EXCL)
        .with_context(|| what.to_owned())?;
    Ok(())
}

/// `ip link add NAME type veth peer name PEER netns NETNS`.
///
/// # Errors
/// When the namespace cannot be opened or the kernel refuses.
pub fn add_veth(name: &str, peer: &str, peer_netns: &Path) -> anyhow::Result<()> {
    let netns = File::open(peer_netns).with_context(|| format!("{}", peer_netns.display()))?;
    let mut peer_link = LinkMessage::default();
    peer_link.attributes = vec![
        LinkAttribute::IfName(peer.to_owned()),
        LinkAttribute::NetNsFd(netns.as_raw_fd()),
    ];
    let mut link = LinkMessage::default();
    link.attributes = vec![
        LinkAttribute::IfName(name.to_owned()),
        LinkAttribute::LinkInfo(vec![
            LinkInfo::Kind(InfoKind::Veth),
            LinkInfo::Data(InfoData::Veth(InfoVeth::Peer(peer_link))),
        ]),
    ];
    create(
        &mut Netlink::open()?,
        RouteNetlinkMessage::NewLink(link),
        &format!("ip link add {name} type veth peer name {peer}"),
    )
}

/// `ip link set DEV up`.
///
/// # Errors
/// When there is no such device or the kernel refuses.
pub fn set_up(dev: &str) -> anyhow::Result<()> {
    let mut link = LinkMessage::default();
    link.header.index = ifindex(dev)?;
    link.header.flags = LinkFlags::Up;
    link.header.change_mask = LinkFlags::Up;
    Netlink::open()?
        .request(RouteNetlinkMessage::SetLink(link), 0)
        .with_context(|| format!("ip link set {dev} up"))?;
    Ok(())
}

/// `ip addr add ADDR/LEN dev DEV`, an IPv6 one with `nodad` (usable at once, as every test
/// wants it).
///
/// # Errors
/// When there is no such device or the kernel refuses (the address is there already too).
pub fn add_address(dev: &str, addr: IpAddr, len: u8) -> anyhow::Result<()> {
    let mut message = AddressMessage::default();
    message.header.family = family(addr);
    message.header.prefix_len = len;
    message.header.index = ifindex(dev)?;
    if addr.is_ipv6() {
        message.header.flags = AddressHeaderFlags::Nodad;
    }
    message.attributes = vec![
        AddressAttribute::Local(addr),
        AddressAttribute::Address(addr),
    ];
    create(
        &mut Netlink::open()?,
        RouteNetlinkMessage::NewAddress(message),
        &format!("ip addr add {addr}/{len} dev {dev}"),
    )
}

/// `ip addr del ADDR/LEN dev DEV`.
///
/// # Errors
/// When there is no such device or address.
pub fn del_address(dev: &str, addr: IpAddr, len: u8) -> anyhow::Result<()> {
    let mut message = AddressMessage::default();
    message.header.family = family(addr);
    message.header.prefix_len = len;
    message.header.index = ifindex(dev)?;
    message.attributes = vec![AddressAttribute::Local(addr)];
    Netlink::open()?
        .request(RouteNetlinkMessage::DelAddress(message), 0)
        .with_context(|| format!("ip addr del {addr}/{len} dev {dev}"))?;
    Ok(())
}

/// `ip route add default via GATEWAY` in the main table.
///
/// # Errors
/// When the gateway is unreachable or a default route exists.
pub fn add_default_route(gateway: IpAddr) -> anyhow::Result<()> {
    let mut route = RouteMessage::default();
    route.header.address_family = family(gateway);
    route.header.table = RouteHeader::RT_TABLE_MAIN;
    route.header.protocol = RouteProtocol::Boot;
    route.header.kind = RouteType::Unicast;
    route.attributes = vec![RouteAttribute::Gateway(match gateway {
        IpAddr::V4(v4) => RouteAddress::Inet(v4),
        IpAddr::V6(v6) => RouteAddress::Inet6(v6),
    })];
    create(
        &mut Netlink::open()?,
        RouteNetlinkMessage::NewRoute(route),
        &format!("ip route add default via {gateway}"),
    )
}

/// `ADDR/LEN` as `ip` takes it.
///
/// # Errors
/// When it is not an address and a prefix length of its family.
pub fn parse_prefix(text: &str) -> anyhow::Result<(IpAddr, u8)> {
    let (addr, len) = text
        .split_once('/')
        .with_context(|| format!("{text:?}: no prefix length"))?;
    let addr: IpAddr = addr.parse().with_context(|| format!("{text:?}"))?;
    let len: u8 = len.parse().with_context(|| format!("{text:?}"))?;
    let max = if addr.is_ipv4() { 32 } else { 128 };
    if len > max {
        bail!("{text:?}: prefix length over {max}");
    }
    Ok((addr, len))
}

fn family(addr: IpAddr) -> AddressFamily {
    if addr.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    }
}
