//! The original destination, from the client socket to the proxy's accepted socket.
//!
//! connect (or the TC program, inbound) knows what was dialled; the proxy asks on another
//! socket. connect keeps it in the client socket's storage ([`DIALED`]); when the client end is
//! established, `sockops` puts it under the connection's netns-qualified 4-tuple in [`FLOWS`];
//! when the accepted end is established (right after, on loopback), `sockops` takes it from
//! there into the accepted socket's storage ([`ACCEPTED`]), where `cgroup/getsockopt` answers
//! `SO_ORIGINAL_DST` from. Socket storage goes with its socket, so nothing waits for a close:
//! sockops asks for no state callbacks, and runs only the kernel's default callbacks.
use core::ptr::read_volatile;

use aya_ebpf::{
    bindings::{
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB, BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB, bpf_sock_ops,
    },
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie},
    macros::{cgroup_sockopt, sock_ops},
    programs::{SockOpsContext, SockoptContext},
};
use meshcap_common::{
    AF_INET, AF_INET6, DNS_PROXY_PORT, FlowKey, PROXY_INBOUND_PORT, PROXY_OUTBOUND_PORT,
    SO_ORIGINAL_DST,
};

use crate::tables::{ACCEPTED, CONNECTING, FLOWS, sk_get, sk_put};

const SOL_IP: i32 = 0;
const SOL_IPV6: i32 = 41;
/// `sizeof(struct sockaddr_in)`.
const SOCKADDR_IN_LEN: usize = 16;
/// `sizeof(struct sockaddr_in6)`.
const SOCKADDR_IN6_LEN: usize = 28;

/// One end of a connection as sockops sees it: (address words, port).
type End = ([u32; 4], u16);

#[inline(always)]
fn ends(ops: *const bpf_sock_ops, family: u32) -> Option<(End, End)> {
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
    }
    1
}

/// The client end of a connection meshcap redirected: its original destination, from
/// [`CONNECTING`], under the 4-tuple. A redirected socket's peer is one of the proxy's ports:
/// other sockets stop there, before any map access.
#[inline(always)]
fn client_established(ctx: &SockOpsContext, ops: *mut bpf_sock_ops) {
    let family = ctx.family();
    let Some((local, remote)) = ends(ops, family) else {
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
    // SAFETY: a plain read.
    let Some(orig) = (unsafe { CONNECTING.get(cookie) }).copied() else {
        return;
    };
    let _ = CONNECTING.remove(cookie);
    // SAFETY: the helper takes the program's own context.
    let netns = unsafe { bpf_get_netns_cookie(ops.cast()) };
    if FLOWS
        .insert(flow(netns, family, local, remote), orig, 0)
        .is_err()
    {
        // Not expected (LRU): the proxy will not learn this connection's original destination.
        aya_log_ebpf::warn!(
            ctx,
            "captured connection not recorded (flow map): SO_ORIGINAL_DST will fail"
        );
    }
}

/// An accepted socket: when meshcap captured its connection, the original destination moves
/// from [`FLOWS`] into the socket's storage.
#[inline(always)]
fn accepted(ctx: &SockOpsContext, ops: *mut bpf_sock_ops) {
    // SAFETY: context read (as in `client_established`).
    let sk = unsafe { (*ops).__bindgen_anon_2.sk };
    if sk.is_null() {
        return;
    }
    let family = ctx.family();
    let Some((local, remote)) = ends(ops, family) else {
        return;
    };
    // SAFETY: the helper takes the program's own context.
    let netns = unsafe { bpf_get_netns_cookie(ops.cast()) };
    let key = flow(netns, family, remote, local);
    // SAFETY: a plain read.
    let Some(orig) = (unsafe { FLOWS.get(key) }).copied() else {
        return;
    };
    let _ = FLOWS.remove(key);
    // SAFETY: `sk` is the context's socket.
    unsafe { sk_put(&ACCEPTED, sk, orig) };
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
    // SAFETY: `sk` is the context's socket.
    let Some(orig) = (unsafe { sk_get(&ACCEPTED, sk) }) else {
        return 1;
    };
    // SAFETY: `optval..optval_end` is the kernel's copy of the caller's buffer; every write is
    // checked against `optval_end` first.
    unsafe {
        let optval = (*so).__bindgen_anon_2.optval.cast::<u8>();
        let end = (*so).__bindgen_anon_3.optval_end.cast::<u8>();
        let port = orig.port.to_be_bytes();
        if orig.family == AF_INET {
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
