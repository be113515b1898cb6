//! Inbound capture where `bpf_sk_assign` cannot reach the proxy: before Linux 6.5 (torvalds/linux
//! 9c02bec95954) TC's `bpf_sk_assign` refuses a listener with `SO_REUSEPORT`, and Envoy's
//! listeners have it (`enable_reuse_port`, its default on Linux), as ztunnel's do. The socket
//! lookup hook (`sk_lookup`, Linux 5.9) takes them: there the kernel assigns the connection to
//! the listener given and then picks among its reuseport group itself.
//!
//! On every kernel, a captured SYN whose 4-tuple the pod's end of an earlier connection holds
//! in `TIME_WAIT` (the client reusing its port at once after the proxy closed first) comes
//! here too: the kernel's `TIME_WAIT` handling frees the 4-tuple and then looks a listener up,
//! which runs this hook; `bpf_sk_assign` from TC would give the listener a request socket
//! under a 4-tuple still held, which Linux 6.10 and later refuse (the SYN is dropped).
//!
//! And on every kernel, a captured SYN that `bpf_sk_assign` gave the proxy's listener but whose
//! assignment netfilter's NAT hook took back (a nat rule in the pod's netns: docs/ebpf.md)
//! comes here to be given that listener again.
//!
//! Two parts:
//! - the TC classifier, for a SYN it decided to capture and whose listener `bpf_sk_assign`
//!   refused, or which finds a `TIME_WAIT` socket, or which it assigned ([`hand_off`]): the
//!   listener it found goes into [`LISTENERS`] under the pod's netns, port and family, and the
//!   connection's 4-tuple into [`HANDOFFS`] with that key; a SYN not assigned goes on to the
//!   socket lookup, an assigned one only where netfilter undid the assignment;
//! - [`meshcap_handoff`], attached to every captured pod's netns by the agent (and only then
//!   does the pod's config carry [`flags::HANDOFF`](meshcap_common::flags::HANDOFF)): a
//!   listener lookup whose 4-tuple is in [`HANDOFFS`] gets that listener, or the SYN is
//!   dropped (fail closed, as TC's own refusal).
//!
//! The decision and the choice of listener stay TC's (it sees the packet's mark and interface,
//! which the socket lookup does not, and its lookup finds the listener the kernel would);
//! nothing is rewritten, so the accepted socket's local address is what the client dialled, as
//! with `bpf_sk_assign`. Both maps are bounded: four listener keys per pod, and an LRU of
//! handshakes.
use core::{ffi::c_void, ptr::read_volatile};

use aya_ebpf::{
    bindings::{bpf_sock, sk_action},
    helpers::{bpf_map_lookup_elem, bpf_map_update_elem, bpf_sk_assign, bpf_sk_release},
    macros::sk_lookup,
    programs::SkLookupContext,
};
use meshcap_common::{AF_INET, AF_INET6, Addr, FlowKey, ListenerKey};

use crate::tables::{HANDOFFS, LISTENERS};

const IPPROTO_TCP: u32 = 6;

/// The classifier's part: hands a SYN it decided to capture (from `src`:`sport` to
/// `dst`:`dport` in the pod of `netns`) to the pod's socket lookup, for `listener`, the proxy's
/// listener on `port` that `bpf_sk_assign` refused. False when a map refuses (the SYN is then
/// dropped).
///
/// # Safety
/// `listener` must be a referenced full socket from a lookup of this program.
#[inline(always)]
pub unsafe fn hand_off(
    netns: u64,
    (src, dst): (Addr, Addr),
    (sport, dport): (u16, u16),
    port: u16,
    listener: *mut bpf_sock,
) -> bool {
    let family = src.family();
    let key = ListenerKey {
        netns,
        port,
        family,
        pad: 0,
    };
    let map = core::ptr::from_ref(&LISTENERS).cast_mut().cast::<c_void>();
    // A listener already recorded under the key stays: the socket lookup's assignment picks
    // among its reuseport group, and the kernel takes a closed listener out of the map itself.
    // An update costs several times a lookup (the socket's psock, the bucket's lock), and TC
    // records every inbound SYN it assigns.
    // SAFETY: a sockhash lookup returns a referenced socket or null; released once.
    let known = unsafe {
        let found = bpf_map_lookup_elem(map, core::ptr::from_ref(&key).cast()).cast::<bpf_sock>();
        if found.is_null() {
            false
        } else {
            bpf_sk_release(found.cast());
            true
        }
    };
    // SAFETY: a sockhash takes a socket as its value (the caller's referenced listener).
    let recorded = known
        || unsafe {
            bpf_map_update_elem(
                map,
                core::ptr::from_ref(&key).cast(),
                listener.cast::<c_void>(),
                0,
            )
        } == 0;
    recorded
        && HANDOFFS
            .insert(flow((src, dst), (sport, dport)), key, 0)
            .is_ok()
}

/// The classifier's part for a SYN it lets through: an earlier connection's entry under the
/// same 4-tuple (the LRU keeps entries; a pod with this address before, or before a change of
/// its ports) must not send this one to a proxy.
#[inline(always)]
pub fn forget((src, dst): (Addr, Addr), (sport, dport): (u16, u16)) {
    let _ = HANDOFFS.remove(flow((src, dst), (sport, dport)));
}

/// [`HANDOFFS`]' key: the 4-tuple, without the netns (which the socket lookup cannot read; the
/// server end is an address of the pod, unique on the node).
#[inline(always)]
fn flow((src, dst): (Addr, Addr), (sport, dport): (u16, u16)) -> FlowKey {
    FlowKey {
        netns: 0,
        client: src.words(),
        server: dst.words(),
        client_port: sport,
        server_port: dport,
        family: u32::from(src.family()),
    }
}

#[sk_lookup]
pub fn meshcap_handoff(ctx: SkLookupContext) -> u32 {
    lookup(&ctx).unwrap_or(sk_action::SK_PASS)
}

#[inline(always)]
fn lookup(ctx: &SkLookupContext) -> Option<u32> {
    let l = ctx.lookup;
    // SAFETY: context reads. `remote_port` is network order, `local_port` host order.
    let flow = unsafe {
        if read_volatile(&raw const (*l).protocol) != IPPROTO_TCP {
            return None;
        }
        let family = read_volatile(&raw const (*l).family);
        let (client, server) = if family == u32::from(AF_INET) {
            (
                [read_volatile(&raw const (*l).remote_ip4), 0, 0, 0],
                [read_volatile(&raw const (*l).local_ip4), 0, 0, 0],
            )
        } else if family == u32::from(AF_INET6) {
            (
                [
                    read_volatile(&raw const (*l).remote_ip6[0]),
                    read_volatile(&raw const (*l).remote_ip6[1]),
                    read_volatile(&raw const (*l).remote_ip6[2]),
                    read_volatile(&raw const (*l).remote_ip6[3]),
                ],
                [
                    read_volatile(&raw const (*l).local_ip6[0]),
                    read_volatile(&raw const (*l).local_ip6[1]),
                    read_volatile(&raw const (*l).local_ip6[2]),
                    read_volatile(&raw const (*l).local_ip6[3]),
                ],
            )
        } else {
            return None;
        };
        #[expect(clippy::cast_possible_truncation, reason = "ports fit in 16 bits")]
        FlowKey {
            netns: 0,
            client,
            server,
            client_port: u16::from_be(read_volatile(&raw const (*l).remote_port)),
            server_port: read_volatile(&raw const (*l).local_port) as u16,
            family,
        }
    };
    // SAFETY: a plain read.
    let listener = unsafe { HANDOFFS.get(flow) }.copied()?;
    if assign(ctx, &listener) {
        return Some(sk_action::SK_PASS);
    }
    aya_log_ebpf::warn!(
        ctx,
        "inbound TCP to port {} dropped: the proxy's listener on port {} is gone",
        flow.server_port,
        listener.port
    );
    Some(sk_action::SK_DROP)
}

/// Assigns the lookup to the listener under `key`, if there is one and the kernel takes it.
#[inline(always)]
fn assign(ctx: &SkLookupContext, key: &ListenerKey) -> bool {
    let map = core::ptr::from_ref(&LISTENERS).cast_mut().cast::<c_void>();
    // SAFETY: a sockhash lookup from this program type returns a referenced socket or null.
    let sk =
        unsafe { bpf_map_lookup_elem(map, core::ptr::from_ref(key).cast()) }.cast::<bpf_sock>();
    if sk.is_null() {
        return false;
    }
    // SAFETY: `sk` is referenced; released once.
    unsafe {
        let assigned = bpf_sk_assign(ctx.lookup.cast(), sk.cast(), 0) == 0;
        bpf_sk_release(sk.cast());
        assigned
    }
}
