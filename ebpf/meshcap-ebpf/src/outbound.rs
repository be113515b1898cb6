//! Outbound capture at the socket layer: the destination is rewritten before any packet
//! exists (no NAT, no conntrack), and the original is remembered: a TCP socket's in the slot
//! of its cookie in `MESHCAP_DIALING` (sockops carries it on to the connection's flow, which
//! lives as long as the socket: [`crate::flows`]), a UDP socket's in its storage
//! (`MESHCAP_DIALED`, for as long as the socket lives).
//!
//! What the socket reports stays what Istio's NAT shows: a redirected socket that the app did
//! not bind is bound to the pod's own address (`MESHCAP_POD_ADDRS`; `bpf_bind` with port 0
//! allocates no port, connect does), so `getsockname(2)` is the pod's address and the proxy
//! sees the pod's address as its peer; `getpeername(2)` answers the dialled address
//! (`cgroup/getpeername4|6`, from the connection's `MESHCAP_FLOWS` entry or the socket's
//! storage); a DNS reply's source is the
//! server the app asked (`recvmsg`). Destinations on loopback keep the loopback source, as
//! routing gives it under NAT.
use core::ptr::{read_volatile, write_volatile};

use aya_ebpf::{
    bindings::{bpf_sock, bpf_sock_addr, sockaddr},
    helpers::{
        bpf_get_current_uid_gid, bpf_get_netns_cookie, bpf_get_socket_cookie, generated::bpf_bind,
    },
    macros::cgroup_sock_addr,
    programs::SockAddrContext,
};
use meshcap_common::{
    AF_INET, AF_INET6, Addr, DNS_PROXY_PORT, FlowKey, OrigDst, Outbound, PROXY_INBOUND_PORT,
    PROXY_OUTBOUND_PORT, PodAddrs, Proto, Verdict, decide_outbound, flags, is_loopback,
};

use crate::{
    flows::{V4_MAPPED, sock_ends},
    tables::{DIALED, FLOWS, Maps, dial, pod, pod_addrs, sk_get, sk_put},
};

/// Keep the call going (0 would fail it with EPERM).
const ALLOW: i32 = 1;
const IPPROTO_TCP: u32 = 6;
const IPPROTO_UDP: u32 = 17;

/// Which address family the hook is for.
#[derive(Clone, Copy)]
enum Family {
    V4,
    V6,
}

#[cgroup_sock_addr(connect4)]
pub fn meshcap_connect4(ctx: SockAddrContext) -> i32 {
    capture(&ctx, Family::V4, None);
    ALLOW
}

#[cgroup_sock_addr(connect6)]
pub fn meshcap_connect6(ctx: SockAddrContext) -> i32 {
    capture(&ctx, Family::V6, None);
    ALLOW
}

/// Unconnected UDP: only datagrams (DNS) can be captured.
#[cgroup_sock_addr(sendmsg4)]
pub fn meshcap_sendmsg4(ctx: SockAddrContext) -> i32 {
    capture(&ctx, Family::V4, Some(Proto::Udp));
    ALLOW
}

#[cgroup_sock_addr(sendmsg6)]
pub fn meshcap_sendmsg6(ctx: SockAddrContext) -> i32 {
    capture(&ctx, Family::V6, Some(Proto::Udp));
    ALLOW
}

/// A redirected socket's peer is what the app dialled.
#[cgroup_sock_addr(getpeername4)]
pub fn meshcap_getpeername4(ctx: SockAddrContext) -> i32 {
    show_dialled(&ctx, Family::V4);
    ALLOW
}

#[cgroup_sock_addr(getpeername6)]
pub fn meshcap_getpeername6(ctx: SockAddrContext) -> i32 {
    show_dialled(&ctx, Family::V6);
    ALLOW
}

/// The DNS proxy's reply must look as if the server the app asked had sent it.
#[cgroup_sock_addr(recvmsg4)]
pub fn meshcap_recvmsg4(ctx: SockAddrContext) -> i32 {
    restore_source(&ctx, Family::V4);
    ALLOW
}

#[cgroup_sock_addr(recvmsg6)]
pub fn meshcap_recvmsg6(ctx: SockAddrContext) -> i32 {
    restore_source(&ctx, Family::V6);
    ALLOW
}

/// The user address of the call (destination for connect/sendmsg, source for recvmsg), with
/// IPv4-mapped IPv6 addresses read as IPv4.
#[inline(always)]
fn user_addr(sa: *const bpf_sock_addr, family: Family) -> Addr {
    // SAFETY: `sa` is the program's context; the words are read one by one (the verifier
    // refuses wider reads of `user_ip6`).
    unsafe {
        match family {
            Family::V4 => Addr::V4(read_volatile(&raw const (*sa).user_ip4)),
            Family::V6 => {
                let w = [
                    read_volatile(&raw const (*sa).user_ip6[0]),
                    read_volatile(&raw const (*sa).user_ip6[1]),
                    read_volatile(&raw const (*sa).user_ip6[2]),
                    read_volatile(&raw const (*sa).user_ip6[3]),
                ];
                if w[0] == 0 && w[1] == 0 && w[2] == V4_MAPPED {
                    Addr::V4(w[3])
                } else {
                    Addr::V6(w)
                }
            }
        }
    }
}

/// Writes the proxy's loopback address and `port` as the user address.
#[inline(always)]
fn set_user_addr(sa: *mut bpf_sock_addr, family: Family, v4: bool, port: u16) {
    let localhost4 = u32::from_ne_bytes([127, 0, 0, 1]);
    // SAFETY: `sa` is the program's context; these fields are writable in these hooks.
    unsafe {
        match (family, v4) {
            (Family::V4, _) => write_volatile(&raw mut (*sa).user_ip4, localhost4),
            (Family::V6, true) => {
                write_volatile(&raw mut (*sa).user_ip6[0], 0);
                write_volatile(&raw mut (*sa).user_ip6[1], 0);
                write_volatile(&raw mut (*sa).user_ip6[2], V4_MAPPED);
                write_volatile(&raw mut (*sa).user_ip6[3], localhost4);
            }
            (Family::V6, false) => {
                write_volatile(&raw mut (*sa).user_ip6[0], 0);
                write_volatile(&raw mut (*sa).user_ip6[1], 0);
                write_volatile(&raw mut (*sa).user_ip6[2], 0);
                (*sa).user_ip6[3] = u32::from_ne_bytes([0, 0, 0, 1]);
            }
        }
        write_volatile(&raw mut (*sa).user_port, u32::from(port.to_be()));
    }
}

#[inline(always)]
fn capture(ctx: &SockAddrContext, family: Family, only: Option<Proto>) {
    let sa = ctx.sock_addr;
    // SAFETY: the helper takes the program's own context.
    let netns = unsafe { bpf_get_netns_cookie(sa.cast()) };
    let Some(pod) = pod(netns) else {
        return;
    };
    // SAFETY: context reads; `sk` is always set in sock_addr hooks.
    let (protocol, dst_port, src, mark) = unsafe {
        let sk = (*sa).__bindgen_anon_1.sk;
        // One volatile load per field: the verifier refuses arithmetic on socket pointers.
        let src = match family {
            Family::V4 => Addr::V4(read_volatile(&raw const (*sk).src_ip4)),
            Family::V6 => {
                let w = [
                    read_volatile(&raw const (*sk).src_ip6[0]),
                    read_volatile(&raw const (*sk).src_ip6[1]),
                    read_volatile(&raw const (*sk).src_ip6[2]),
                    read_volatile(&raw const (*sk).src_ip6[3]),
                ];
                if w[0] == 0 && w[1] == 0 && w[2] == V4_MAPPED {
                    Addr::V4(w[3])
                } else {
                    Addr::V6(w)
                }
            }
        };
        #[expect(clippy::cast_possible_truncation, reason = "the port is the low half")]
        let port = u16::from_be(read_volatile(&raw const (*sa).user_port) as u16);
        (
            read_volatile(&raw const (*sa).protocol),
            port,
            src,
            read_volatile(&raw const (*sk).mark),
        )
    };
    let proto = match protocol {
        IPPROTO_TCP => Proto::Tcp,
        IPPROTO_UDP => Proto::Udp,
        _ => return,
    };
    if only.is_some_and(|p| p != proto) {
        return;
    }
    let dst = user_addr(sa, family);
    let ids = bpf_get_current_uid_gid();
    #[expect(clippy::cast_possible_truncation, reason = "uid is the low half")]
    let uid = ids as u32;
    let gid = (ids >> 32) as u32;
    let conn = Outbound {
        proto,
        dst,
        dst_port,
        src,
        uid,
        gid,
        mark,
    };
    // The pod's own addresses: for a pod whose only local IPv4 address is its own, what tells
    // a local IPv4 destination (compared, where the list would be looked up: the decision
    // needs it for every destination off loopback); then the source of a redirected socket
    // the app did not bind (read once).
    let off_loopback = !is_loopback(&dst);
    let compared = pod.has(flags::LOCAL4_IS_POD_ADDR) && off_loopback && matches!(dst, Addr::V4(_));
    let addrs = if compared { pod_addrs(netns) } else { None };
    let maps = Maps {
        local4: addrs.map(|a| a.v4),
        ..Maps::of(&pod)
    };
    let Verdict::Redirect(port) = decide_outbound(&pod, &conn, &maps) else {
        return;
    };
    let orig = OrigDst::new(dst, dst_port);
    if src.is_unspecified()
        && off_loopback
        && let Some(addrs) = if compared { addrs } else { pod_addrs(netns) }
    {
        source_from_pod(
            sa,
            &addrs,
            family,
            matches!(dst, Addr::V4(_)),
            only.is_some(),
        );
    }
    if proto == Proto::Tcp {
        // SAFETY: the helper takes the program's own context.
        dial(unsafe { bpf_get_socket_cookie(sa.cast()) }, orig);
    } else {
        // A UDP socket's own copy: what getpeername and recvmsg answer, for as long as it
        // lives (a TCP socket's connection keeps its flow that long: `crate::flows`).
        // SAFETY: context read, then the context's socket.
        unsafe { sk_put(&DIALED, (*sa).__bindgen_anon_1.sk, orig) };
    }
    set_user_addr(sa, family, matches!(dst, Addr::V4(_)), port);
}

#[inline(always)]
fn restore_source(ctx: &SockAddrContext, family: Family) {
    let sa = ctx.sock_addr;
    let src = user_addr(sa, family);
    // SAFETY: context read.
    #[expect(clippy::cast_possible_truncation, reason = "the port is the low half")]
    let port = u16::from_be(unsafe { read_volatile(&raw const (*sa).user_port) } as u16);
    let from_proxy = match src {
        Addr::V4(a) => a == u32::from_ne_bytes([127, 0, 0, 1]),
        Addr::V6(w) => {
            w[0] == 0 && w[1] == 0 && w[2] == 0 && w[3] == u32::from_ne_bytes([0, 0, 0, 1])
        }
    };
    if port != DNS_PROXY_PORT || !from_proxy {
        return;
    }
    // SAFETY: context read, then the context's socket.
    let Some(orig) = (unsafe { sk_get(&DIALED, (*sa).__bindgen_anon_1.sk) }) else {
        return;
    };
    write_user_addr(sa, family, &orig);
}

/// Writes `orig` as the user address (the peer getpeername reports, the source recvmsg does).
#[inline(always)]
fn write_user_addr(sa: *mut bpf_sock_addr, family: Family, orig: &OrigDst) {
    // SAFETY: context writes, word by word.
    unsafe {
        match family {
            Family::V4 => write_volatile(&raw mut (*sa).user_ip4, orig.addr[0]),
            Family::V6 if u16::from(orig.family) == AF_INET => {
                write_volatile(&raw mut (*sa).user_ip6[0], 0);
                write_volatile(&raw mut (*sa).user_ip6[1], 0);
                write_volatile(&raw mut (*sa).user_ip6[2], V4_MAPPED);
                write_volatile(&raw mut (*sa).user_ip6[3], orig.addr[0]);
            }
            Family::V6 => {
                write_volatile(&raw mut (*sa).user_ip6[0], orig.addr[0]);
                write_volatile(&raw mut (*sa).user_ip6[1], orig.addr[1]);
                write_volatile(&raw mut (*sa).user_ip6[2], orig.addr[2]);
                write_volatile(&raw mut (*sa).user_ip6[3], orig.addr[3]);
            }
        }
        write_volatile(&raw mut (*sa).user_port, u32::from(orig.port.to_be()));
    }
}

/// `struct sockaddr_in`.
#[repr(C)]
struct SockaddrIn {
    family: u16,
    port: u16,
    addr: u32,
    zero: [u8; 8],
}

/// `struct sockaddr_in6`.
#[repr(C)]
struct SockaddrIn6 {
    family: u16,
    port: u16,
    flowinfo: u32,
    addr: [u32; 4],
    scope_id: u32,
}

/// Gives a redirected socket the pod's own address as its source, as routing would have for
/// the original destination under NAT: `bpf_bind` (port 0: connect picks the port) in the
/// connect hooks, the datagram's source (`msg_src_ip`) for sendmsg. `v4` says whether the
/// destination is IPv4 (on an IPv6 socket, IPv4-mapped). A pod without an address of that
/// family keeps the loopback source.
#[inline(always)]
fn source_from_pod(
    sa: *mut bpf_sock_addr,
    addrs: &PodAddrs,
    family: Family,
    v4: bool,
    datagram: bool,
) {
    let PodAddrs {
        v4: addr4,
        v6: addr6,
    } = *addrs;
    let addr = if v4 {
        if addr4 == 0 {
            return;
        }
        [0, 0, V4_MAPPED, addr4]
    } else {
        if addr6 == [0; 4] {
            return;
        }
        addr6
    };
    // SAFETY: context writes (msg_src_ip is writable in the sendmsg hooks), and `bpf_bind` on
    // the context with a socket address on the stack of the length it reads.
    unsafe {
        match (family, datagram) {
            (Family::V4, true) => write_volatile(&raw mut (*sa).msg_src_ip4, addr4),
            (Family::V6, true) => {
                for (i, word) in addr.iter().enumerate() {
                    write_volatile(&raw mut (*sa).msg_src_ip6[i], *word);
                }
            }
            (Family::V4, false) => {
                let mut sin = SockaddrIn {
                    family: AF_INET,
                    port: 0,
                    addr: addr4,
                    zero: [0; 8],
                };
                let _ = bpf_bind(
                    sa,
                    (&raw mut sin).cast::<sockaddr>(),
                    size_of::<SockaddrIn>() as i32,
                );
            }
            (Family::V6, false) => {
                let mut sin6 = SockaddrIn6 {
                    family: AF_INET6,
                    port: 0,
                    flowinfo: 0,
                    addr,
                    scope_id: 0,
                };
                let _ = bpf_bind(
                    sa,
                    (&raw mut sin6).cast::<sockaddr>(),
                    size_of::<SockaddrIn6>() as i32,
                );
            }
        }
    }
}

/// getpeername on a socket meshcap redirected to one of the proxy's loopback ports: the
/// address the app dialled, for a TCP socket from its connection's flow, which lives as long
/// as the socket (`crate::flows`), or from the socket's storage (a UDP socket's; a TCP
/// socket's that an earlier build redirected, during an upgrade). Only such a socket has
/// either (the flow is keyed by the netns), so no pod is looked up. The peer is looked at first: every `accept(2)` that asks for the peer's
/// address runs this program too (the proxy's, whose peer is the app), and only a socket
/// connected to the proxy's loopback ports goes on to a map.
#[inline(always)]
fn show_dialled(ctx: &SockAddrContext, family: Family) {
    let sa = ctx.sock_addr;
    let peer = user_addr(sa, family);
    // SAFETY: context read.
    #[expect(clippy::cast_possible_truncation, reason = "the port is the low half")]
    let port = u16::from_be(unsafe { read_volatile(&raw const (*sa).user_port) } as u16);
    let to_proxy = is_loopback(&peer)
        && matches!(
            port,
            PROXY_OUTBOUND_PORT | PROXY_INBOUND_PORT | DNS_PROXY_PORT
        );
    if !to_proxy {
        return;
    }
    // SAFETY: context reads, then the context's socket.
    let (protocol, sk) = unsafe {
        (
            read_volatile(&raw const (*sa).protocol),
            (*sa).__bindgen_anon_1.sk,
        )
    };
    let orig = match protocol {
        // SAFETY: the context's socket.
        IPPROTO_TCP => flow(sa, sk).or_else(|| unsafe { sk_get(&DIALED, sk) }),
        // SAFETY: the context's socket.
        IPPROTO_UDP => unsafe { sk_get(&DIALED, sk) },
        _ => None,
    };
    if let Some(orig) = orig {
        write_user_addr(sa, family, &orig);
    }
}

/// The original destination in the flow of the TCP connection of `sk`, the context's socket.
#[inline(always)]
fn flow(sa: *mut bpf_sock_addr, sk: *mut bpf_sock) -> Option<OrigDst> {
    let (family, local, remote) = sock_ends(sk)?;
    // SAFETY: the helper takes the program's own context.
    let netns = unsafe { bpf_get_netns_cookie(sa.cast()) };
    let key = FlowKey {
        netns,
        client: local.0,
        server: remote.0,
        client_port: local.1,
        server_port: remote.1,
        family,
    };
    // SAFETY: a plain read of a value written whole.
    unsafe { FLOWS.get(key) }.copied()
}
