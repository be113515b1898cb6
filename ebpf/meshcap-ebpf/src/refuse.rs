//! Refusing an inbound connection no proxy listener can take, as Istio's rules do.
//!
//! Under Istio's `REDIRECT` (sidecar inbound in its default mode, rerouted interfaces, ambient
//! mode's plaintext inbound to ztunnel's 15006) a SYN to a port nothing listens on is answered
//! by the kernel with a reset, which NAT hands back from the address and port the client
//! dialled: the client's `connect` fails at once with `ECONNREFUSED`, and load balancers and
//! health checks move on. The classifier cannot let such a SYN into the stack (the app may
//! listen on the port it was sent to), so it answers it itself: the SYN becomes the reset
//! `tcp_v4_send_reset`/`tcp_v6_send_reset` would send (RFC 9293 3.10.7.1: `<SEQ=0>
//! <ACK=SEG.SEQ+SEG.LEN><CTL=RST,ACK>`, from the dialled address and port, no options) and leaves
//! by the interface it came in on.
//!
//! The checksums are updated field by field rather than recomputed: a SYN sent by a socket on
//! this node crosses the veth with `CHECKSUM_PARTIAL`, where the TCP checksum field holds only
//! the pseudo-header's sum and the device (or the next stack) completes it over the header.
//! `bpf_l4_csum_replace` keeps both conventions right: header fields change the sum only where
//! it is complete, pseudo-header fields (`BPF_F_PSEUDO_HDR`, the TCP length) in both.
//!
//! Not answered (dropped, as before): a SYN carrying data (TCP Fast Open; its bytes would have
//! to leave the sum too) or IPv4 options. Istio's `TPROXY` target drops where no transparent
//! listener is found (`xt_TPROXY.c`, `tproxy_tg4`: `NF_DROP`), so sidecar pods in `TPROXY` mode
//! keep the drop on their captured ports ([`refuses`]).
use aya_ebpf::{
    bindings::{BPF_F_PSEUDO_HDR, TC_ACT_REDIRECT},
    helpers::{bpf_csum_diff, bpf_redirect, bpf_skb_change_tail},
    programs::TcContext,
};
use meshcap_common::{Addr, PodConfig, flags, iface_flags};

/// Ethernet header length, and where its source address starts.
const ETH_HLEN: usize = 14;
const ETH_ALEN: usize = 6;
/// A TCP header without options.
const TCP_HLEN: usize = 20;
/// TCP options: at most 40 bytes (data offset 15).
const MAX_OPTIONS: usize = 40;
/// Data offset 5, flags RST|ACK: the 16-bit word at byte 12 of the reset's TCP header.
const RST_ACK_WORD: u16 = (5 << 12) | 0x04 | 0x10;
/// The reset's TTL / hop limit (the kernel's default, `sysctl_ip_default_ttl`).
const TTL: u8 = 64;
/// IPv4 "don't fragment", as `ip_send_unicast_reply` sends resets.
const IP_DF: u16 = 0x4000;
const IPPROTO_TCP: u8 = 6;

/// Whether Istio's rules answer a SYN to this pod's captured port with a reset when nothing
/// listens (`REDIRECT`), rather than drop it (`TPROXY`: sidecar pods in `TPROXY` mode, on
/// interfaces that are not rerouted).
#[inline(always)]
pub(crate) const fn refuses(pod: &PodConfig, iface: u32) -> bool {
    pod.has(flags::AMBIENT) || !pod.has(flags::TPROXY) || iface & iface_flags::REROUTE != 0
}

/// The SYN this classifier received, where its TCP header starts (`l4`) and what it was sent
/// between.
pub(crate) struct Syn {
    pub(crate) src: Addr,
    pub(crate) dst: Addr,
    pub(crate) l4: usize,
}

/// Turns the SYN in `ctx` into the reset that refuses it and sends it back out of `ifindex`
/// (`TC_ACT_REDIRECT`); `None` when it cannot be answered (see the module's docs) and must be
/// dropped.
#[inline(always)]
pub(crate) fn reset(ctx: &TcContext, syn: &Syn, ifindex: u32) -> Option<i32> {
    let l4 = syn.l4;
    let word12 = ctx.load::<u16>(l4 + 12).ok()?;
    let header = usize::from(u16::from_be(word12) >> 12) * 4;
    if !(TCP_HLEN..=TCP_HLEN + MAX_OPTIONS).contains(&header) {
        return None;
    }
    let v4 = matches!(syn.src, Addr::V4(_));
    let segment = if v4 {
        if l4 != ETH_HLEN + 20 {
            return None;
        }
        usize::from(u16::from_be(ctx.load::<u16>(ETH_HLEN + 2).ok()?)).checked_sub(20)?
    } else {
        usize::from(u16::from_be(ctx.load::<u16>(ETH_HLEN + 4).ok()?))
    };
    if segment != header {
        return None;
    }
    let seq = ctx.load::<u32>(l4 + 4).ok()?;
    let ack = ctx.load::<u32>(l4 + 8).ok()?;
    let window = ctx.load::<u16>(l4 + 14).ok()?;
    let urgent = ctx.load::<u16>(l4 + 18).ok()?;
    let options = options_sum(ctx, l4, header - TCP_HLEN)?;
    let reply_ack = u32::from_be(seq).wrapping_add(1).to_be();
    let rst_ack = RST_ACK_WORD.to_be();

    // The TCP checksum: every changed header field, the options leaving, the pseudo-header's
    // length. The ports and the addresses only swap places, which leaves the sum as it is.
    let check = l4 + 16;
    let field = |from: u64, to: u64, size: u64| ctx.l4_csum_replace(check, from, to, size).ok();
    field(u64::from(seq), 0, 4)?;
    field(u64::from(ack), u64::from(reply_ack), 4)?;
    field(u64::from(word12), u64::from(rst_ack), 2)?;
    field(u64::from(window), 0, 2)?;
    field(u64::from(urgent), 0, 2)?;
    field(0, u64::from(options), 0)?;
    let pseudo = u64::from(BPF_F_PSEUDO_HDR);
    if v4 {
        let (from, to) = (header as u16, TCP_HLEN as u16);
        field(u64::from(from.to_be()), u64::from(to.to_be()), pseudo | 2)?;
    } else {
        let (from, to) = (header as u32, TCP_HLEN as u32);
        field(u64::from(from.to_be()), u64::from(to.to_be()), pseudo | 4)?;
    }

    let ports = ctx.load::<u32>(l4).ok()?;
    ctx.store(l4, &ports.rotate_left(16), 0).ok()?;
    ctx.store(l4 + 4, &0u32, 0).ok()?;
    ctx.store(l4 + 8, &reply_ack, 0).ok()?;
    ctx.store(l4 + 12, &rst_ack, 0).ok()?;
    ctx.store(l4 + 14, &0u16, 0).ok()?;
    ctx.store(l4 + 18, &0u16, 0).ok()?;

    if v4 {
        ipv4(ctx, syn)?;
    } else {
        ipv6(ctx, syn)?;
    }
    let src_mac = ctx.load::<[u8; ETH_ALEN]>(ETH_ALEN).ok()?;
    let dst_mac = ctx.load::<[u8; ETH_ALEN]>(0).ok()?;
    ctx.store(0, &src_mac, 0).ok()?;
    ctx.store(ETH_ALEN, &dst_mac, 0).ok()?;

    let len = u32::try_from(l4 + TCP_HLEN).ok()?;
    // SAFETY: the context's own skb; shortening it drops the options.
    if unsafe { bpf_skb_change_tail(ctx.skb.skb, len, 0) } != 0 {
        return None;
    }
    // SAFETY: a plain helper call; it answers TC_ACT_REDIRECT (or TC_ACT_SHOT when the flags are
    // wrong, which these are not).
    let action = unsafe { bpf_redirect(ifindex, 0) };
    (action == i64::from(TC_ACT_REDIRECT)).then_some(TC_ACT_REDIRECT)
}

/// The sum to add to a checksum for the `len` bytes of options after the TCP header to leave it.
#[inline(always)]
fn options_sum(ctx: &TcContext, l4: usize, len: usize) -> Option<u32> {
    // Word by word, at a constant size: a load of a variable length must be proven non-zero,
    // and older verifiers (Linux 6.1's) learn no lower bound from the test LLVM emits for it.
    let mut words = [0u32; MAX_OPTIONS / 4];
    for (i, word) in words.iter_mut().enumerate() {
        if i * 4 < len {
            *word = ctx.load::<u32>(l4 + TCP_HLEN + i * 4).ok()?;
        }
    }
    // SAFETY: `words` is MAX_OPTIONS readable bytes (the unused ones zero, which add nothing);
    // no "to" buffer. The result is the negated sum of `words`, to add.
    let sum = unsafe {
        bpf_csum_diff(
            words.as_mut_ptr(),
            MAX_OPTIONS as u32,
            core::ptr::null_mut(),
            0,
            0,
        )
    };
    u32::try_from(sum).ok()
}

/// The IPv4 header of the reset: addresses swapped, no TOS, 40 bytes, id 0, DF, TTL 64.
#[inline(always)]
fn ipv4(ctx: &TcContext, syn: &Syn) -> Option<()> {
    let ip = ETH_HLEN;
    let check = ip + 10;
    let (Addr::V4(src), Addr::V4(dst)) = (syn.src, syn.dst) else {
        return None;
    };
    let fields: [(usize, u16); 5] = [
        (0, u16::from_be_bytes([0x45, 0])),
        (2, (20 + TCP_HLEN) as u16),
        (4, 0),
        (6, IP_DF),
        (8, u16::from_be_bytes([TTL, IPPROTO_TCP])),
    ];
    for (offset, value) in fields {
        let old = ctx.load::<u16>(ip + offset).ok()?;
        let new = value.to_be();
        ctx.l3_csum_replace(check, u64::from(old), u64::from(new), 2)
            .ok()?;
        ctx.store(ip + offset, &new, 0).ok()?;
    }
    ctx.store(ip + 12, &dst, 0).ok()?;
    ctx.store(ip + 16, &src, 0).ok()
}

/// The IPv6 header of the reset: addresses swapped, no traffic class or flow label, a 20-byte
/// payload, hop limit 64.
#[inline(always)]
fn ipv6(ctx: &TcContext, syn: &Syn) -> Option<()> {
    let ip = ETH_HLEN;
    ctx.store(ip, &0x6000_0000u32.to_be(), 0).ok()?;
    ctx.store(ip + 4, &(TCP_HLEN as u16).to_be(), 0).ok()?;
    ctx.store(ip + 7, &TTL, 0).ok()?;
    ctx.store(ip + 8, &syn.dst.words(), 0).ok()?;
    ctx.store(ip + 24, &syn.src.words(), 0).ok()
}
