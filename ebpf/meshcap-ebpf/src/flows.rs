//! The original destination, from the client socket to the proxy's accepted socket.
//!
//! connect (or the TC program, inbound) knows what was dialled; the proxy asks on another
//! socket. `sockops` moves the connect-time record (by socket cookie) to the connection's
//! 4-tuple qualified by its netns when the client end is established, and removes it when
//! either end closes; `cgroup/getsockopt` answers `SO_ORIGINAL_DST` on the accepting end from it.
use core::ptr::read_volatile;

use aya_ebpf::{
    bindings::{
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB, BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB,
        BPF_SOCK_OPS_STATE_CB, BPF_SOCK_OPS_STATE_CB_FLAG, bpf_sock_ops,
    },
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie},
    macros::{cgroup_sockopt, sock_ops},
    programs::{SockOpsContext, SockoptContext},
};
use meshcap_common::{AF_INET, AF_INET6, FlowKey, SO_ORIGINAL_DST};

use crate::tables::{BY_COOKIE, FLOWS};

const SOL_IP: i32 = 0;
const SOL_IPV6: i32 = 41;
const TCP_CLOSE: u32 = 7;
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
    if op != BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB
        && op != BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB
        && op != BPF_SOCK_OPS_STATE_CB
    {
        return 1;
    }
    let family = ctx.family();
    let Some((local, remote)) = ends(ops, family) else {
        return 1;
    };
    // SAFETY: the helper takes the program's own context.
    let netns = unsafe { bpf_get_netns_cookie(ops.cast()) };
    if op == BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB {
        // SAFETY: the helper takes the program's own context.
        let cookie = unsafe { bpf_get_socket_cookie(ops.cast()) };
        // SAFETY: a plain read.
        let Some(orig) = (unsafe { BY_COOKIE.get(cookie) }).copied() else {
            return 1;
        };
        let _ = BY_COOKIE.remove(cookie);
        if FLOWS
            .insert(flow(netns, family, local, remote), orig, 0)
            .is_ok()
        {
            let _ = ctx.set_cb_flags(BPF_SOCK_OPS_STATE_CB_FLAG as i32);
        } else {
            // The flow table is full: the proxy will not learn this connection's original
            // destination.
            aya_log_ebpf::warn!(
                &ctx,
                "captured connection not recorded (flow map full): SO_ORIGINAL_DST will fail"
            );
        }
    } else if op == BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB {
        // SAFETY: a plain read.
        if unsafe { FLOWS.get(flow(netns, family, remote, local)) }.is_some() {
            let _ = ctx.set_cb_flags(BPF_SOCK_OPS_STATE_CB_FLAG as i32);
        }
    } else if ctx.arg(1) == TCP_CLOSE {
        // Only sockets that asked for state callbacks get here: one of the two is ours.
        let _ = FLOWS.remove(flow(netns, family, local, remote));
        let _ = FLOWS.remove(flow(netns, family, remote, local));
    }
    1
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
    // SAFETY: reads of the socket's fields, one volatile load each: the verifier refuses
    // arithmetic on socket pointers, which LLVM would otherwise share between branches.
    let (family, local, remote) = unsafe {
        let family = read_volatile(&raw const (*sk).family);
        #[expect(clippy::cast_possible_truncation, reason = "ports fit in 16 bits")]
        let local_port = read_volatile(&raw const (*sk).src_port) as u16;
        let remote_port = u16::from_be(read_volatile(&raw const (*sk).dst_port));
        if family == u32::from(AF_INET) {
            (
                family,
                (
                    [read_volatile(&raw const (*sk).src_ip4), 0, 0, 0],
                    local_port,
                ),
                (
                    [read_volatile(&raw const (*sk).dst_ip4), 0, 0, 0],
                    remote_port,
                ),
            )
        } else {
            (
                family,
                (
                    [
                        read_volatile(&raw const (*sk).src_ip6[0]),
                        read_volatile(&raw const (*sk).src_ip6[1]),
                        read_volatile(&raw const (*sk).src_ip6[2]),
                        read_volatile(&raw const (*sk).src_ip6[3]),
                    ],
                    local_port,
                ),
                (
                    [
                        read_volatile(&raw const (*sk).dst_ip6[0]),
                        read_volatile(&raw const (*sk).dst_ip6[1]),
                        read_volatile(&raw const (*sk).dst_ip6[2]),
                        read_volatile(&raw const (*sk).dst_ip6[3]),
                    ],
                    remote_port,
                ),
            )
        }
    };
    // SAFETY: the helper takes the program's own context.
    let netns = unsafe { bpf_get_netns_cookie(so.cast()) };
    // SAFETY: a plain read.
    let Some(orig) = (unsafe { FLOWS.get(flow(netns, family, remote, local)) }).copied() else {
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
