//! Inbound capture: a TC classifier on the pod's interfaces, inside the pod netns. New TCP
//! connections to captured ports are handed to the proxy's listener with `bpf_sk_assign`
//! (TPROXY-like: no NAT, the accepted socket's local address is what the client dialled);
//! packets of existing connections keep reaching their own sockets. An ambient pod's `lo`
//! gets the stub too: there ztunnel's connections to the app are marked so that the app's
//! replies go back to ztunnel ([`ztunnel_connection_on_lo`]). Where the kernel's
//! `bpf_sk_assign` refuses the proxy's `SO_REUSEPORT` listener (before Linux 6.5), the SYN is
//! handed to the pod's socket lookup program instead ([`crate::handoff`]); so is a SYN whose
//! 4-tuple the pod's end of an earlier connection holds in `TIME_WAIT` (the client reusing its
//! port at once), which the kernel's `TIME_WAIT` handling must see first.
//!
//! The classifier is loaded and verified once, into [`TC_PROG`]. Each pod's interfaces get a
//! tiny stub the agent assembles itself (agent/src/backend/ebpf/stub.rs): it stores the pod's
//! netns cookie in `skb->cb[0..2]` and tail-calls the classifier. (`bpf_get_netns_cookie` is
//! not available to TC programs before Linux 6.15, and where it is, it answers for the skb's
//! socket, which an inbound packet does not have yet.)
use aya_ebpf::{
    bindings::{
        BPF_F_CURRENT_NETNS, TC_ACT_OK, TC_ACT_SHOT, bpf_sock, bpf_sock_tuple,
        bpf_sock_tuple__bindgen_ty_1__bindgen_ty_1, bpf_sock_tuple__bindgen_ty_1__bindgen_ty_2,
    },
    helpers::{bpf_sk_assign, bpf_sk_lookup_tcp, bpf_sk_release, bpf_skc_lookup_tcp},
    macros::{classifier, map},
    maps::ProgramArray,
    programs::TcContext,
};
use meshcap_common::{
    AMBIENT_MARK_MASK, AMBIENT_REPLY_MARK, Addr, Existing, FlowKey, IfaceKey, Inbound, OrigDst,
    TPROXY_MARK, Verdict, ZTUNNEL_MARK, decide_inbound, flags, iface_flags,
};

use crate::{
    handoff::{forget, hand_off},
    refuse::{Syn, refuses, reset},
    tables::{FLOWS, IFACES, Maps, pod},
};

/// Slot 0: the shared classifier, set by the agent when it opens the backend; the pods'
/// stubs tail-call it (they are not in this object, so the map is declared here, where the
/// agent pins it with the others).
#[map(name = "MESHCAP_TC_PROG")]
static TC_PROG: ProgramArray = ProgramArray::with_max_entries(1, 0);

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86DD;
const IPPROTO_TCP: u8 = 6;
const TCP_LISTEN: u32 = 10;
const TCP_TIME_WAIT: u32 = 6;
const TCP_SYN: u8 = 0x02;
const TCP_ACK: u8 = 0x10;
/// `lo`'s index in every network namespace (`LOOPBACK_IFINDEX`).
const LOOPBACK_IFINDEX: u32 = 1;

#[classifier]
pub fn meshcap_ingress(ctx: TcContext) -> i32 {
    match ingress(&ctx) {
        Some(action) => action,
        None => TC_ACT_OK,
    }
}

/// The fields the decision and the socket lookups need.
struct Packet {
    src: Addr,
    dst: Addr,
    sport: u16,
    dport: u16,
    flags: u8,
    /// Where the TCP header starts.
    l4: usize,
}

#[inline(always)]
fn parse(ctx: &TcContext) -> Option<Packet> {
    let proto = u16::from_be(ctx.load::<u16>(12).ok()?);
    let (src, dst, l4) = if proto == ETH_P_IP {
        let vihl = ctx.load::<u8>(ETH_HLEN).ok()?;
        let frag = u16::from_be(ctx.load::<u16>(ETH_HLEN + 6).ok()?);
        if ctx.load::<u8>(ETH_HLEN + 9).ok()? != IPPROTO_TCP || frag & 0x1fff != 0 {
            return None;
        }
        let src = Addr::V4(ctx.load::<u32>(ETH_HLEN + 12).ok()?);
        let dst = Addr::V4(ctx.load::<u32>(ETH_HLEN + 16).ok()?);
        (src, dst, ETH_HLEN + usize::from(vihl & 0x0f) * 4)
    } else if proto == ETH_P_IPV6 {
        // Extension headers before TCP are left alone (not captured).
        if ctx.load::<u8>(ETH_HLEN + 6).ok()? != IPPROTO_TCP {
            return None;
        }
        let src = Addr::V6(ctx.load::<[u32; 4]>(ETH_HLEN + 8).ok()?);
        let dst = Addr::V6(ctx.load::<[u32; 4]>(ETH_HLEN + 24).ok()?);
        (src, dst, ETH_HLEN + 40)
    } else {
        return None;
    };
    Some(Packet {
        src,
        dst,
        sport: u16::from_be(ctx.load::<u16>(l4).ok()?),
        dport: u16::from_be(ctx.load::<u16>(l4 + 2).ok()?),
        flags: ctx.load::<u8>(l4 + 13).ok()?,
        l4,
    })
}

/// Which source a lookup tuple carries.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Source {
    /// The packet's: the lookup finds the connection that owns the 4-tuple, or else a listener.
    Packet,
    /// None (address and port zeroed): no connection can own it, so the lookup finds only a
    /// listener. A connection that Istio's `REDIRECT` gave the proxy before the kernel capture
    /// (a pod moving between the two) holds the packet's 4-tuple on the proxy's port; looked up
    /// with the packet's source, a new SYN from a reused client port would find that socket (or
    /// nothing, for its time-wait remnant) instead of the proxy's listener.
    Zeroed,
}

/// The lookup tuple of `p` with `dport` and `source`, and its length. Every byte is defined
/// (zeroed first): built as a union of two variants, the other variant's bytes were undefined,
/// and LLVM may then store any register there, which the verifier refuses to read ("R5
/// !read_ok").
#[inline(always)]
fn tuple(p: &Packet, dport: u16, source: Source) -> (bpf_sock_tuple, u32) {
    // SAFETY: all-zero bytes are a valid tuple (plain integers).
    let mut t: bpf_sock_tuple = unsafe { core::mem::zeroed() };
    let sport = if source == Source::Packet { p.sport } else { 0 };
    let len = match (p.src, p.dst) {
        (Addr::V4(s), Addr::V4(d)) => {
            t.__bindgen_anon_1.ipv4 = bpf_sock_tuple__bindgen_ty_1__bindgen_ty_1 {
                saddr: if source == Source::Packet { s } else { 0 },
                daddr: d,
                sport: sport.to_be(),
                dport: dport.to_be(),
            };
            12
        }
        _ => {
            t.__bindgen_anon_1.ipv6 = bpf_sock_tuple__bindgen_ty_1__bindgen_ty_2 {
                saddr: if source == Source::Packet {
                    p.src.words()
                } else {
                    [0; 4]
                },
                daddr: p.dst.words(),
                sport: sport.to_be(),
                dport: dport.to_be(),
            };
            36
        }
    };
    (t, len)
}

const CURRENT_NETNS: u64 = BPF_F_CURRENT_NETNS as u64;

/// What owns the packet's 4-tuple with `dport` as its destination port.
#[inline(always)]
fn existing(ctx: &TcContext, p: &Packet, dport: u16) -> Existing {
    let (mut t, len) = tuple(p, dport, Source::Packet);
    // SAFETY: `t` is a valid tuple of `len` bytes; a returned socket is released below.
    let sk: *mut bpf_sock =
        unsafe { bpf_skc_lookup_tcp(ctx.skb.skb.cast(), &raw mut t, len, CURRENT_NETNS, 0) };
    if sk.is_null() {
        return Existing::Nothing;
    }
    // SAFETY: `sk` is a referenced socket from the lookup; released once.
    unsafe {
        let state = core::ptr::read_volatile(&raw const (*sk).state);
        bpf_sk_release(sk.cast());
        match state {
            TCP_LISTEN => Existing::Listener,
            TCP_TIME_WAIT => Existing::TimeWait,
            _ => Existing::Connection,
        }
    }
}

/// `-ESOCKTNOSUPPORT`: what `bpf_sk_assign` answers for a `SO_REUSEPORT` listener before
/// Linux 6.5.
const ESOCKTNOSUPPORT: i64 = -94;

/// Why a packet was not handed to the proxy's listener.
enum Refused {
    /// No listener on the port.
    NoListener,
    /// The listener has `SO_REUSEPORT`, which this kernel's `bpf_sk_assign` refuses.
    Reuseport,
}

/// The pod's socket lookup ([`crate::handoff`]), when it has one.
#[derive(Clone, Copy)]
struct Handoff {
    /// The pod's netns.
    netns: u64,
    /// Without `bpf_sk_assign`: the socket lookup takes the SYN. Every captured SYN with
    /// [`flags::HANDOFF_ALWAYS`] (benchmarks only); a SYN on a 4-tuple in `TIME_WAIT`
    /// ([`Existing::TimeWait`]) always.
    always: bool,
}

/// Hands the packet to the listener on `port`; a `SO_REUSEPORT` listener this kernel's
/// `bpf_sk_assign` refuses through the socket lookup instead when the pod has one (`handoff`;
/// with [`Handoff::always`] every listener).
///
/// A SYN `bpf_sk_assign` gave the listener is also recorded for the pod's socket lookup:
/// netfilter's NAT hook at `LOCAL_IN` (`nf_nat_ipv4_local_in`, `nf_nat_ipv6_local_in`) takes
/// the assignment back wherever the pod's netns has NAT hooks and conntrack (a NAT table an
/// app, a debug container or an operator made after the capture), since a listener's port is
/// never the connection's reply port; the kernel then looks a listener up for the SYN, which
/// runs the socket lookup, and the record gives it this listener instead of the app's port.
/// Where the assignment stands, the socket lookup does not run.
#[inline(always)]
fn assign(ctx: &TcContext, p: &Packet, port: u16, handoff: Option<Handoff>) -> Result<(), Refused> {
    let (mut t, len) = tuple(p, port, Source::Zeroed);
    // SAFETY: as in `existing`.
    let sk: *mut bpf_sock =
        unsafe { bpf_sk_lookup_tcp(ctx.skb.skb.cast(), &raw mut t, len, CURRENT_NETNS, 0) };
    if sk.is_null() {
        return Err(Refused::NoListener);
    }
    // SAFETY: `sk` is a referenced full socket; released once.
    unsafe {
        let result = if core::ptr::read_volatile(&raw const (*sk).state) == TCP_LISTEN {
            let assigned = match handoff {
                Some(Handoff { always: true, .. }) => ESOCKTNOSUPPORT,
                _ => bpf_sk_assign(ctx.skb.skb.cast(), sk.cast(), 0),
            };
            match assigned {
                0 => {
                    if let Some(h) = handoff
                        && p.flags & (TCP_SYN | TCP_ACK) == TCP_SYN
                    {
                        // SAFETY: `sk` is the referenced listener of this lookup. A map that
                        // refuses leaves the assignment as the only way, as before.
                        let _ = hand_off(h.netns, (p.src, p.dst), (p.sport, p.dport), port, sk);
                    }
                    Ok(())
                }
                ESOCKTNOSUPPORT => match handoff {
                    // SAFETY: `sk` is the referenced listener of this lookup.
                    Some(h) if hand_off(h.netns, (p.src, p.dst), (p.sport, p.dport), port, sk) => {
                        Ok(())
                    }
                    _ => Err(Refused::Reuseport),
                },
                _ => Err(Refused::NoListener),
            }
        } else {
            Err(Refused::NoListener)
        };
        bpf_sk_release(sk.cast());
        result
    }
}

/// An ambient pod's `lo` (its stub is only there): a SYN from one of ztunnel's own sockets
/// (mark 0x539/0xfff) is one of ztunnel's connections to the app, from the client's address.
/// Its mark becomes 0x111 under the same mask, and the pod's `tcp_fwmark_accept` gives that
/// mark to the app's accepted socket, so every reply, the SYN-ACK included, takes the pod's
/// reply route (`fwmark 0x111/0xfff lookup 100`: local) back to ztunnel's transparent socket
/// instead of leaving by the pod's interface. Istio's in-pod rules do the same with the
/// connection's mark (`CONNMARK --set-xmark 0x111/0xfff` in `mangle PREROUTING`, restored in
/// `mangle OUTPUT`). Only SYNs: the accepted socket carries the mark from then on.
/// Every packet between the app and ztunnel crosses `lo`: `lo`'s stub tail-calls only for
/// ztunnel's marks (agent/src/backend/ebpf/stub.rs; a stub attached by an earlier build does
/// for every packet), the mark is read first here too, and no pod is looked up (only ambient
/// pods have a stub there).
#[inline(always)]
fn ztunnel_connection_on_lo(ctx: &TcContext) -> i32 {
    // SAFETY: context read.
    let mark = unsafe { (*ctx.skb.skb).mark };
    if mark & AMBIENT_MARK_MASK == ZTUNNEL_MARK
        && parse(ctx).is_some_and(|p| p.flags & (TCP_SYN | TCP_ACK) == TCP_SYN)
    {
        ctx.set_mark((mark & !AMBIENT_MARK_MASK) | AMBIENT_REPLY_MARK);
    }
    TC_ACT_OK
}

#[inline(always)]
fn ingress(ctx: &TcContext) -> Option<i32> {
    // SAFETY: context read.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    if ifindex == LOOPBACK_IFINDEX {
        return Some(ztunnel_connection_on_lo(ctx));
    }
    // SAFETY: context reads of what the stub wrote.
    let netns =
        unsafe { u64::from((*ctx.skb.skb).cb[0]) | (u64::from((*ctx.skb.skb).cb[1]) << 32) };
    let pod = pod(netns)?;
    let p = parse(ctx)?;
    if pod.has(flags::HANDOFF) && p.flags & (TCP_SYN | TCP_ACK) == TCP_SYN {
        // An earlier connection's hand-off under this 4-tuple must not decide for this one
        // (written again below when this one is handed off too).
        forget((p.src, p.dst), (p.sport, p.dport));
    }
    let key = IfaceKey {
        netns,
        ifindex,
        pad: 0,
    };
    // SAFETY: a plain read.
    let iface = unsafe { IFACES.get(key) }.copied().unwrap_or(0);
    let ambient = pod.has(flags::AMBIENT);
    if iface & iface_flags::REROUTE != 0 {
        // Not addressed to the pod: the policy route (fwmark 1337 -> local; in ambient mode
        // the reply route, 0x111/0xfff -> local) delivers it to the proxy's socket instead of
        // forwarding it.
        ctx.set_mark(if ambient {
            AMBIENT_REPLY_MARK
        } else {
            TPROXY_MARK
        });
    }
    let c = Inbound {
        src: p.src,
        dst_port: p.dport,
        // SAFETY: context read.
        mark: unsafe { (*ctx.skb.skb).mark },
        iface,
        syn: p.flags & TCP_SYN != 0 && p.flags & TCP_ACK == 0,
        ack: p.flags & TCP_ACK != 0,
        existing: existing(ctx, &p, p.dport),
    };
    match decide_inbound(&pod, &c, &Maps::of(&pod)) {
        Verdict::Pass => Some(TC_ACT_OK),
        Verdict::Drop => Some(TC_ACT_SHOT),
        Verdict::Redirect(port) => {
            // A packet of a connection Istio's `REDIRECT` gave the proxy before this capture (a
            // pod moving from Istio's rules to the kernel, or back): its socket holds the
            // 4-tuple on the proxy's port, and conntrack's NAT entry, which outlives the rules,
            // takes the packet there. Only a SYN opens a connection, so nothing new gets by.
            if !c.syn
                && matches!(
                    existing(ctx, &p, port),
                    Existing::Connection | Existing::TimeWait
                )
            {
                return Some(TC_ACT_OK);
            }
            // A SYN on a 4-tuple in TIME_WAIT: only the kernel's TIME_WAIT handling may give it
            // to a listener (it frees the 4-tuple first; a request socket under a 4-tuple in
            // TIME_WAIT is refused since Linux 6.10, and the SYN dropped until the TIME_WAIT
            // ends), and the listener it looks up is the pod's socket lookup's to choose.
            let reused = matches!(c.existing, Existing::TimeWait);
            if reused && !pod.has(flags::HANDOFF) {
                aya_log_ebpf::warn!(
                    ctx,
                    "inbound TCP to port {} dropped: a TIME_WAIT socket holds its 4-tuple and the pod has no socket lookup program",
                    p.dport
                );
                return Some(TC_ACT_SHOT);
            }
            let handoff = pod.has(flags::HANDOFF).then_some(Handoff {
                netns,
                always: reused || pod.has(flags::HANDOFF_ALWAYS),
            });
            match assign(ctx, &p, port, handoff) {
                Ok(()) => {}
                // Nothing listens on the proxy's port (a proxy down or not started): the SYN
                // is refused where Istio's rules refuse it and dropped where they drop it
                // (`crate::refuse`), never let through. Rare and worth knowing: one record per
                // SYN.
                Err(Refused::NoListener) => {
                    let syn = Syn {
                        src: p.src,
                        dst: p.dst,
                        l4: p.l4,
                    };
                    if p.flags & (TCP_SYN | TCP_ACK) == TCP_SYN
                        && refuses(&pod, iface)
                        && let Some(action) = reset(ctx, &syn, ifindex)
                    {
                        aya_log_ebpf::warn!(
                            ctx,
                            "inbound TCP to port {} refused: no proxy listener on port {}",
                            p.dport,
                            port
                        );
                        return Some(action);
                    }
                    aya_log_ebpf::warn!(
                        ctx,
                        "inbound TCP to port {} dropped: no proxy listener on port {}",
                        p.dport,
                        port
                    );
                    return Some(TC_ACT_SHOT);
                }
                Err(Refused::Reuseport) => {
                    aya_log_ebpf::warn!(
                        ctx,
                        "inbound TCP to port {} dropped: the proxy's listener on port {} has SO_REUSEPORT, which this kernel's bpf_sk_assign refuses (Linux 6.5 takes it), and the pod has no socket lookup program or its maps are full",
                        p.dport,
                        port
                    );
                    return Some(TC_ACT_SHOT);
                }
            }
            let flow = FlowKey {
                netns,
                client: p.src.words(),
                server: p.dst.words(),
                client_port: p.sport,
                server_port: p.dport,
                family: u32::from(p.src.family()),
            };
            let _ = FLOWS.insert(flow, OrigDst::new(p.dst, p.dport), 0);
            Some(TC_ACT_OK)
        }
    }
}
