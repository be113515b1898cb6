//! The original destination, from the client socket to the proxy's accepted socket.
//!
//! connect (or the TC program, inbound) knows what was dialled; the proxy asks on another
//! socket. connect keeps it in the slot of the client socket's cookie in `MESHCAP_DIALING`
//! ([`crate::tables::dial`]); when the client end is established, `sockops` moves it under the
//! connection's netns-qualified 4-tuple in [`FLOWS`] ([`flow_state::CLIENT_HERE`]); when the
//! accepted end is established (right after, on loopback), `sockops` marks it
//! [`flow_state::ACCEPTED`]; `cgroup/getsockopt` on the accepted socket looks it up by that
//! socket's own netns and 4-tuple and answers `SO_ORIGINAL_DST` from an accepted entry, as
//! often as asked. The entry goes when the socket whose close ends its use closes (sockops
//! asks for state callbacks on that socket only): the app's, for a connection it dialled (its
//! `getpeername(2)` answers from the entry as long as it is open, also after the proxy closed
//! its end); the proxy's, for an inbound connection TC handed over. Nothing is allocated per
//! connection.
//! A stale entry (one the LRU kept after a close the program missed) never answers for another
//! connection: a new captured connection overwrites it; an accepted end established on an
//! already accepted entry removes it; an uncaptured connection to one of the proxy's ports
//! removes it when its client end is established.
use core::ptr::read_volatile;

use aya_ebpf::{
    bindings::{
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB, BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB,
        BPF_SOCK_OPS_STATE_CB, BPF_SOCK_OPS_STATE_CB_FLAG, BPF_TCP_CLOSE, bpf_sock, bpf_sock_ops,
    },
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie},
    macros::{cgroup_sockopt, sock_ops},
    programs::{SockOpsContext, SockoptContext},
};
use meshcap_common::{
    AF_INET, AF_INET6, DNS_PROXY_PORT, FlowKey, OrigDst, PROXY_INBOUND_PORT, PROXY_OUTBOUND_PORT,
    SO_ORIGINAL_DST, flow_state,
};

use crate::tables::{CONNECTING, FLOWS, dialled};

const SOL_IP: i32 = 0;
const SOL_IPV6: i32 = 41;
/// `sizeof(struct sockaddr_in)`.
const SOCKADDR_IN_LEN: usize = 16;
/// `sizeof(struct sockaddr_in6)`.
const SOCKADDR_IN6_LEN: usize = 28;

#[expect(clippy::cast_possible_wrap, reason = "a small flag")]
const STATE_CB_FLAG: i32 = BPF_SOCK_OPS_STATE_CB_FLAG as i32;

/// One end of a connection as sockops sees it: (address words, port).
pub type End = ([u32; 4], u16);

/// `::ffff:0:0/96`, the third word.
pub const V4_MAPPED: u32 = u32::from_be(0x0000_ffff);

/// The ends of a connection under the family its packets have: an IPv6 socket's connection
/// between IPv4-mapped addresses (a dual-stack listener's, such as ztunnel's `[::]:15001`, or
/// a dual-stack client's) is keyed as the IPv4 connection the other end, TC and the client's
/// connect see.
#[inline(always)]
fn canonical(family: u32, local: End, remote: End) -> (u32, End, End) {
    let mapped = |w: &[u32; 4]| w[0] == 0 && w[1] == 0 && w[2] == V4_MAPPED;
    if family == u32::from(AF_INET6) && mapped(&local.0) && mapped(&remote.0) {
        (
            u32::from(AF_INET),
            ([local.0[3], 0, 0, 0], local.1),
            ([remote.0[3], 0, 0, 0], remote.1),
        )
    } else {
        (family, local, remote)
    }
}

/// A sockops socket's family and ends, [`canonical`].
#[inline(always)]
fn ends(ops: *const bpf_sock_ops, family: u32) -> Option<(u32, End, End)> {
    let (local, remote) = raw_ends(ops, family)?;
    Some(canonical(family, local, remote))
}

#[inline(always)]
fn raw_ends(ops: *const bpf_sock_ops, family: u32) -> Option<(End, End)> {
    // SAFETY: context reads, word by word. `local_port` is host order; `remote_port` holds the
    // port in network order in its upper half on little-endian machines.
    unsafe {
        let local_port = read_volatile(&raw const (*ops).local_port);
        let remote_port = u32::from_be(read_volatile(&raw const (*ops).remote_port));
        #[expect(clippy::cast_possible_truncation, reason = "ports fit in 16 bits")]
        let (lp, rp) = (local_port as u16, remote_port as u16);
        match u16::try_from(family).ok()? {
            AF_INET => Some((
                ([read_volatile(&raw const (*ops).local_ip4), 0, 0, 0], lp),
                ([read_volatile(&raw const (*ops).remote_ip4), 0, 0, 0], rp),
            )),
            AF_INET6 => Some((
                (
                    [
                        read_volatile(&raw const (*ops).local_ip6[0]),
                        read_volatile(&raw const (*ops).local_ip6[1]),
                        read_volatile(&raw const (*ops).local_ip6[2]),
                        read_volatile(&raw const (*ops).local_ip6[3]),
                    ],
                    lp,
                ),
                (
                    [
                        read_volatile(&raw const (*ops).remote_ip6[0]),
                        read_volatile(&raw const (*ops).remote_ip6[1]),
                        read_volatile(&raw const (*ops).remote_ip6[2]),
                        read_volatile(&raw const (*ops).remote_ip6[3]),
                    ],
                    rp,
                ),
            )),
            _ => None,
        }
    }
}

/// The family and the local and remote ends of a full socket (`cgroup/getsockopt`'s), as
/// [`ends`] reads them in sockops ([`canonical`]).
#[inline(always)]
pub fn sock_ends(sk: *const bpf_sock) -> Option<(u32, End, End)> {
    let (family, local, remote) = raw_sock_ends(sk)?;
    Some(canonical(family, local, remote))
}

#[inline(always)]
fn raw_sock_ends(sk: *const bpf_sock) -> Option<(u32, End, End)> {
    // SAFETY: reads of a full socket the context handed out, word by word. `src_port` is host
    // order, `dst_port` network order (16 bits wide since Linux 5.18).
    unsafe {
        let family = read_volatile(&raw const (*sk).family);
        #[expect(clippy::cast_possible_truncation, reason = "ports fit in 16 bits")]
        let lp = read_volatile(&raw const (*sk).src_port) as u16;
        let rp = u16::from_be(read_volatile(&raw const (*sk).dst_port));
        match u16::try_from(family).ok()? {
            AF_INET => Some((
                family,
                ([read_volatile(&raw const (*sk).src_ip4), 0, 0, 0], lp),
                ([read_volatile(&raw const (*sk).dst_ip4), 0, 0, 0], rp),
            )),
            AF_INET6 => Some((
                family,
                (
                    [
                        read_volatile(&raw const (*sk).src_ip6[0]),
                        read_volatile(&raw const (*sk).src_ip6[1]),
                        read_volatile(&raw const (*sk).src_ip6[2]),
                        read_volatile(&raw const (*sk).src_ip6[3]),
                    ],
                    lp,
                ),
                (
                    [
                        read_volatile(&raw const (*sk).dst_ip6[0]),
                        read_volatile(&raw const (*sk).dst_ip6[1]),
                        read_volatile(&raw const (*sk).dst_ip6[2]),
                        read_volatile(&raw const (*sk).dst_ip6[3]),
                    ],
                    rp,
                ),
            )),
            _ => None,
        }
    }
}

#[inline(always)]
const fn flow(netns: u64, family: u32, client: End, server: End) -> FlowKey {
    FlowKey {
        netns,
        client: client.0,
        server: server.0,
        client_port: client.1,
        server_port: server.1,
        family,
    }
}

#[sock_ops]
pub fn meshcap_sockops(ctx: SockOpsContext) -> u32 {
    let ops = ctx.ops;
    let op = ctx.op();
    if op == BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB {
        client_established(&ctx, ops);
    } else if op == BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB {
        accepted(&ctx, ops);
    } else if op == BPF_SOCK_OPS_STATE_CB && ctx.arg(1) == BPF_TCP_CLOSE {
        closed(&ctx, ops);
    }
    1
}

/// The client end of a connection meshcap redirected: its original destination, from
/// [`CONNECTING`], under the 4-tuple. A redirected socket's peer is one of the proxy's ports:
/// other sockets stop there, before any map access.
#[inline(always)]
fn client_established(ctx: &SockOpsContext, ops: *mut bpf_sock_ops) {
    let Some((family, local, remote)) = ends(ops, ctx.family()) else {
        return;
    };
    if !matches!(
        remote.1,
        PROXY_OUTBOUND_PORT | PROXY_INBOUND_PORT | DNS_PROXY_PORT
    ) {
        return;
    }
    // SAFETY: the helper takes the program's own context.
    let cookie = unsafe { bpf_get_socket_cookie(ops.cast()) };
    // SAFETY: the helper takes the program's own context.
    let netns = unsafe { bpf_get_netns_cookie(ops.cast()) };
    let key = flow(netns, family, local, remote);
    let Some(orig) = dialled(cookie).or_else(|| connecting(cookie)) else {
        // Not captured, to a proxy port: an entry left by an earlier connection with this
        // 4-tuple must not answer for this one.
        let _ = FLOWS.remove(key);
        return;
    };
    let entry = OrigDst {
        state: flow_state::CLIENT_HERE,
        ..orig
    };
    if FLOWS.insert(key, entry, 0).is_err() {
        // Not expected (LRU): the proxy will not learn this connection's original destination.
        aya_log_ebpf::warn!(
            ctx,
            "captured connection not recorded (flow map): SO_ORIGINAL_DST will fail"
        );
        return;
    }
    // The entry goes when this socket closes (`closed`).
    let _ = ctx.set_cb_flags(STATE_CB_FLAG);
}

/// The original destination an earlier build's connect kept under socket `cookie` (before
/// `MESHCAP_DIALING`), taken: only a connect rewritten before an upgrade has one.
#[inline(always)]
fn connecting(cookie: u64) -> Option<OrigDst> {
    // SAFETY: a plain read.
    let orig = unsafe { CONNECTING.get(cookie) }.copied()?;
    let _ = CONNECTING.remove(cookie);
    Some(orig)
}

/// An accepted socket: when meshcap captured its connection, the entry the other end left
/// (pending) is marked accepted; an entry already accepted is an earlier connection's, removed.
#[inline(always)]
fn accepted(ctx: &SockOpsContext, ops: *mut bpf_sock_ops) {
    let Some((family, local, remote)) = ends(ops, ctx.family()) else {
        return;
    };
    // SAFETY: the helper takes the program's own context.
    let netns = unsafe { bpf_get_netns_cookie(ops.cast()) };
    let key = flow(netns, family, remote, local);
    let Some(entry) = FLOWS.get_ptr_mut(key) else {
        return;
    };
    // SAFETY: `entry` points to the map's value; only this connection's handshake writes it.
    unsafe {
        let state = (*entry).state;
        if state & flow_state::ACCEPTED == 0 {
            (*entry).state = state | flow_state::ACCEPTED;
            if state & flow_state::CLIENT_HERE == 0 {
                // Inbound: the entry goes when this socket closes (`closed`). Without state
                // callbacks it stays until reused or evicted.
                let _ = ctx.set_cb_flags(STATE_CB_FLAG);
            }
            return;
        }
    }
    let _ = FLOWS.remove(key);
}

/// The socket whose close ends a captured connection's entry is closed: the app's connecting
/// end, or the proxy's accepted end of an inbound connection (and, during an upgrade, the
/// proxy's end of any connection an earlier build saw accepted). The entry goes, so that the
/// table holds only open connections and the LRU never has to evict (eviction frees in
/// batches, a latency spike for the connect that triggers it). Which end this is is not
/// known here (an accepted inbound socket's local port is the one dialled, its peer's any),
/// so both keys go; the one that is not this connection's names none.
#[inline(always)]
fn closed(ctx: &SockOpsContext, ops: *mut bpf_sock_ops) {
    let Some((family, local, remote)) = ends(ops, ctx.family()) else {
        return;
    };
    // SAFETY: the helper takes the program's own context.
    let netns = unsafe { bpf_get_netns_cookie(ops.cast()) };
    let _ = FLOWS.remove(flow(netns, family, local, remote));
    let _ = FLOWS.remove(flow(netns, family, remote, local));
}

/// Answers `getsockopt(SOL_IP, SO_ORIGINAL_DST)` and `getsockopt(SOL_IPV6,
/// IP6T_SO_ORIGINAL_DST)` for sockets meshcap redirected; every other call passes untouched
/// (neither `optlen` nor `retval` changes).
#[cgroup_sockopt(getsockopt)]
pub fn meshcap_getsockopt(ctx: SockoptContext) -> i32 {
    let so = ctx.sockopt;
    // SAFETY: context reads.
    let (level, optname) = unsafe { ((*so).level, (*so).optname) };
    if optname != SO_ORIGINAL_DST || (level != SOL_IP && level != SOL_IPV6) {
        return 1;
    }
    // SAFETY: context read; `sk` is a full socket in this hook.
    let sk = unsafe { (*so).__bindgen_anon_1.sk };
    if sk.is_null() {
        return 1;
    }
    let Some((family, local, remote)) = sock_ends(sk) else {
        return 1;
    };
    // SAFETY: the helper takes the program's own context.
    let netns = unsafe { bpf_get_netns_cookie(so.cast()) };
    // SAFETY: a plain read.
    let Some(entry) = (unsafe { FLOWS.get(flow(netns, family, remote, local)) }) else {
        return 1;
    };
    if entry.state & flow_state::ACCEPTED == 0 {
        return 1;
    }
    let orig = *entry;
    // SAFETY: `optval..optval_end` is the kernel's copy of the caller's buffer; every write is
    // checked against `optval_end` first.
    unsafe {
        let optval = (*so).__bindgen_anon_2.optval.cast::<u8>();
        let end = (*so).__bindgen_anon_3.optval_end.cast::<u8>();
        let port = orig.port.to_be_bytes();
        if u16::from(orig.family) == AF_INET {
            if optval.wrapping_add(SOCKADDR_IN_LEN) > end {
                return 1;
            }
            let out = optval.cast::<[u32; 4]>();
            (*out)[0] = u32::from_ne_bytes([2, 0, port[0], port[1]]);
            (*out)[1] = orig.addr[0];
            (*out)[2] = 0;
            (*out)[3] = 0;
            (*so).optlen = SOCKADDR_IN_LEN as i32;
        } else {
            if optval.wrapping_add(SOCKADDR_IN6_LEN) > end {
                return 1;
            }
            let out = optval.cast::<[u32; 7]>();
            (*out)[0] = u32::from_ne_bytes([10, 0, port[0], port[1]]);
            (*out)[1] = 0;
            (*out)[2] = orig.addr[0];
            (*out)[3] = orig.addr[1];
            (*out)[4] = orig.addr[2];
            (*out)[5] = orig.addr[3];
            (*out)[6] = 0;
            (*so).optlen = SOCKADDR_IN6_LEN as i32;
        }
        (*so).retval = 0;
    }
    1
}
