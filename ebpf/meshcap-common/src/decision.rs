//! The per-connection decision: Istio's rule order as straight-line code.

use crate::{
    AMBIENT_MARK_MASK, AMBIENT_REPLY_MARK, Addr, CidrKind, DNS_PORT, DNS_PROXY_PORT, HBONE_PORT,
    PROXY_INBOUND_PORT, PROXY_OUTBOUND_PORT, PodConfig, PortKind, TPROXY_MARK, ZTUNNEL_MARK, flags,
    iface_flags,
};

/// What happens to a connection (or datagram).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Verdict {
    /// Left alone.
    Pass,
    /// Sent to the proxy's listener on this port (on loopback for outbound; assigned to the
    /// listener for inbound).
    Redirect(u16),
    /// Dropped (`INVALID_DROP`).
    Drop,
}

/// The transport protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Proto {
    /// TCP.
    Tcp,
    /// UDP.
    Udp,
}

/// A pod's lists, as the decision reads them. In the kernel: BPF maps keyed with the pod's
/// id; on the host: plain collections.
pub trait PodTables {
    /// Whether `port` is in the pod's `kind` list.
    fn has_port(&self, kind: PortKind, port: u16) -> bool;
    /// The value of the longest prefix of the pod's `kind` list containing `addr`, if any.
    fn lookup(&self, kind: CidrKind, addr: &Addr) -> Option<u32>;
}

/// An outbound connection (TCP connect, UDP connect or datagram) from inside a pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Outbound {
    /// TCP or UDP.
    pub proto: Proto,
    /// Where the app sends it.
    pub dst: Addr,
    /// Destination port.
    pub dst_port: u16,
    /// The socket's bound source address (unspecified when unbound).
    pub src: Addr,
    /// The socket owner's uid.
    pub uid: u32,
    /// The socket owner's gid.
    pub gid: u32,
    /// The socket's mark (`SO_MARK`).
    pub mark: u32,
}

/// What already owns an inbound TCP packet's 4-tuple inside the pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Existing {
    /// Nothing: a new connection (or a SYN cookie's ACK).
    Nothing,
    /// Only a listener on the destination port.
    Listener,
    /// A connection (established or in handshake): it keeps its packets.
    Connection,
    /// A `TIME_WAIT` socket, the pod's end of a connection it closed first: it keeps the
    /// packets of that connection, but a SYN (the client reusing its port at once) opens a
    /// new connection, decided as one. Let through, the kernel's `TIME_WAIT` handling would
    /// take the SYN (`tcp_timewait_state_process`: `TCP_TW_SYN`) and look a listener up by
    /// the packet's own destination, the app's port: a bypass of the proxy. Istio's rules
    /// capture it: conntrack reopens a connection in `TIME_WAIT` on a SYN, and the NAT table
    /// redirects it again (`tests/tests/timewait.rs`).
    TimeWait,
}

impl Existing {
    /// Whether the socket keeps a packet (a SYN if `syn`): a connection's, or a `TIME_WAIT`
    /// socket's that is not a SYN.
    #[inline(always)]
    #[must_use]
    pub const fn keeps(self, syn: bool) -> bool {
        match self {
            Self::Connection => true,
            Self::TimeWait => !syn,
            Self::Nothing | Self::Listener => false,
        }
    }
}

/// An inbound TCP packet arriving on one of the pod's interfaces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Inbound {
    /// Source address.
    pub src: Addr,
    /// Destination port.
    pub dst_port: u16,
    /// The packet's mark (`skb->mark`).
    pub mark: u32,
    /// [`iface_flags`] of the interface it arrived on.
    pub iface: u32,
    /// SYN without ACK: opens a connection.
    pub syn: bool,
    /// ACK set (with SYN clear: a handshake's last packet, or data).
    pub ack: bool,
    /// What owns its 4-tuple.
    pub existing: Existing,
}

/// `127.0.0.1` / `::1`.
#[inline(always)]
const fn localhost(v6: bool) -> Addr {
    if v6 {
        Addr::V6([0, 0, 0, u32::from_ne_bytes([0, 0, 0, 1])])
    } else {
        Addr::V4(u32::from_ne_bytes([127, 0, 0, 1]))
    }
}

/// `127.0.0.6` / `::6`: the source Envoy binds for inbound passthrough.
#[inline(always)]
const fn passthrough_source(v6: bool) -> Addr {
    if v6 {
        Addr::V6([0, 0, 0, u32::from_ne_bytes([0, 0, 0, 6])])
    } else {
        Addr::V4(u32::from_ne_bytes([127, 0, 0, 6]))
    }
}

/// `127.0.0.0/8` or `::1`.
#[inline(always)]
#[must_use]
pub fn is_loopback(addr: &Addr) -> bool {
    match *addr {
        Addr::V4(a) => a.to_ne_bytes()[0] == 127,
        Addr::V6(w) => w[0] == 0 && w[1] == 0 && w[2] == 0 && w[3] == localhost(true).words()[3],
    }
}

/// The decision for an outbound connection, rule by rule as Istio's `OUTPUT` / `ISTIO_OUTPUT`
/// (nat) chains order them. Lists the pod's flags say are empty (or, for the include list,
/// `*`) are not looked up: in the kernel every lookup is a map access on every connect. "`-o lo`" is "the destination is local": loopback, or one of the
/// pod's own addresses ([`CidrKind::Local`]).
#[inline(always)]
#[must_use]
pub fn decide_outbound<T: PodTables>(pod: &PodConfig, c: &Outbound, t: &T) -> Verdict {
    if pod.has(flags::AMBIENT) {
        return ambient_outbound(pod, c, t);
    }
    let v6 = matches!(c.dst, Addr::V6(_));
    // A pod without IPv6 gets no ip6tables rules.
    if v6 && !pod.has(flags::IPV6) {
        return Verdict::Pass;
    }
    let via_lo = is_loopback(&c.dst) || t.lookup(CidrKind::Local, &c.dst).is_some();
    // OUTPUT -o <excludeInterfaces> -j RETURN, by the pod's routes.
    if !via_lo && pod.has(flags::EXCLUDED_ROUTES) && t.lookup(CidrKind::Route, &c.dst) == Some(1) {
        return Verdict::Pass;
    }
    // -p tcp/udp --dport <excludeOutboundPorts> -j RETURN
    if !pod.has(flags::NO_EXCLUDE_PORTS) && t.has_port(PortKind::ExcludeOutbound, c.dst_port) {
        return Verdict::Pass;
    }
    // -o lo -s 127.0.0.6/32 -j RETURN
    if via_lo && c.src == passthrough_source(v6) {
        return Verdict::Pass;
    }
    // TPROXY mode: Envoy's original_src upstream sockets (mark 1337) deliver inbound traffic
    // to the app, as 127.0.0.6 does in REDIRECT mode.
    if pod.has(flags::TPROXY) && c.mark == TPROXY_MARK {
        return Verdict::Pass;
    }
    let tcp = matches!(c.proto, Proto::Tcp);
    let dns = pod.has(flags::DNS_CAPTURE);
    let to_localhost = c.dst == localhost(v6);
    let keep_app_loopback = !pod.has(flags::INCLUDE_LOOPBACK);
    let is_uid = c.uid == pod.proxy_uid;
    let is_gid = c.gid == pod.proxy_gid;

    // -o lo ! -d 127.0.0.1/32 -p tcp ! --dport 15008 (and 53 with DNS) --uid-owner -> 15006
    if via_lo
        && !to_localhost
        && tcp
        && c.dst_port != HBONE_PORT
        && !(dns && c.dst_port == DNS_PORT)
        && is_uid
    {
        return Verdict::Redirect(PROXY_INBOUND_PORT);
    }
    // -o lo [-p tcp ! --dport 53] ! --uid-owner -> RETURN (absent with a loopback include)
    if keep_app_loopback && via_lo && !is_uid && (!dns || (tcp && c.dst_port != DNS_PORT)) {
        return Verdict::Pass;
    }
    // --uid-owner -> RETURN
    if is_uid {
        return Verdict::Pass;
    }
    // The gid twins. Istio's gid redirect rule does not exempt port 53.
    if via_lo && !to_localhost && tcp && c.dst_port != HBONE_PORT && is_gid {
        return Verdict::Redirect(PROXY_INBOUND_PORT);
    }
    if keep_app_loopback && via_lo && !is_gid && (!dns || (tcp && c.dst_port != DNS_PORT)) {
        return Verdict::Pass;
    }
    if is_gid {
        return Verdict::Pass;
    }
    // ISTIO_OUTPUT_DNS: tcp and udp --dport 53 -> 15053
    if dns && c.dst_port == DNS_PORT {
        return Verdict::Redirect(DNS_PROXY_PORT);
    }
    // -d 127.0.0.1/32 -j RETURN
    if to_localhost {
        return Verdict::Pass;
    }
    // -d <excludeOutboundIPRanges> -j RETURN
    if !pod.has(flags::NO_EXCLUDE_CIDRS) && t.lookup(CidrKind::ExcludeOutbound, &c.dst).is_some() {
        return Verdict::Pass;
    }
    // ISTIO_REDIRECT is -p tcp: UDP falls through every jump to it.
    if !tcp {
        return Verdict::Pass;
    }
    // -p tcp --dport <includeOutboundPorts> -j ISTIO_REDIRECT
    if !pod.has(flags::NO_INCLUDE_PORTS) && t.has_port(PortKind::IncludeOutbound, c.dst_port) {
        return Verdict::Redirect(PROXY_OUTBOUND_PORT);
    }
    // -d <includeOutboundIPRanges> (or everything for `*`) -j ISTIO_REDIRECT
    if pod.has(flags::INCLUDE_ALL) || t.lookup(CidrKind::IncludeOutbound, &c.dst).is_some() {
        return Verdict::Redirect(PROXY_OUTBOUND_PORT);
    }
    Verdict::Pass
}

/// The decision for an inbound TCP packet on one of the pod's interfaces, as Istio's
/// `PREROUTING` / `ISTIO_INBOUND` chains (nat in REDIRECT mode, mangle in TPROXY mode) order
/// them. Only new connections are captured; packets of existing connections keep reaching
/// their sockets. A packet with no socket that is not a SYN (a SYN cookie's ACK) is captured
/// like a SYN, so a flooded listener never hands a captured connection to the app; so is a
/// SYN whose 4-tuple a `TIME_WAIT` socket holds ([`Existing::TimeWait`]).
#[inline(always)]
#[must_use]
pub fn decide_inbound<T: PodTables>(pod: &PodConfig, c: &Inbound, t: &T) -> Verdict {
    if pod.has(flags::AMBIENT) {
        return ambient_inbound(pod, c, t);
    }
    if c.existing.keeps(c.syn) || c.iface & iface_flags::EXCLUDED != 0 {
        return Verdict::Pass;
    }
    // PREROUTING -i <reroute-virtual-interfaces> -j ISTIO_REDIRECT (inserted first).
    if c.iface & iface_flags::REROUTE != 0 {
        return Verdict::Redirect(PROXY_OUTBOUND_PORT);
    }
    // nat ISTIO_INBOUND -p tcp --dport 15008 -j RETURN (TPROXY's mangle chain has no such rule).
    if !pod.has(flags::TPROXY) && c.dst_port == HBONE_PORT {
        return Verdict::Pass;
    }
    let captured = if pod.has(flags::INBOUND_ALL) {
        !t.has_port(PortKind::ExcludeInbound, c.dst_port)
    } else {
        t.has_port(PortKind::IncludeInbound, c.dst_port)
    };
    if !captured {
        return Verdict::Pass;
    }
    // conntrack INVALID: neither opening nor continuing a connection.
    if pod.has(flags::INVALID_DROP) && !c.syn && !c.ack {
        return Verdict::Drop;
    }
    Verdict::Redirect(PROXY_INBOUND_PORT)
}

/// Whether `mark` is ztunnel's own (`-m mark --mark 0x539/0xfff`).
#[inline(always)]
const fn is_ztunnel(mark: u32) -> bool {
    mark & AMBIENT_MARK_MASK == ZTUNNEL_MARK
}

/// Ambient mode's outbound decision, rule by rule as Istio's in-pod `nat ISTIO_OUTPUT`
/// (`cni/pkg/iptables/iptables.go`, `AppendInpodRules`) orders them. "`-o lo`" is "the
/// destination is local", as in sidecar mode.
#[inline(always)]
fn ambient_outbound<T: PodTables>(pod: &PodConfig, c: &Outbound, t: &T) -> Verdict {
    let v6 = matches!(c.dst, Addr::V6(_));
    if v6 && !pod.has(flags::IPV6) {
        return Verdict::Pass;
    }
    let tcp = matches!(c.proto, Proto::Tcp);
    let ztunnel = is_ztunnel(c.mark);
    let to_localhost = c.dst == localhost(v6);
    // -d <probe SNAT address> -p tcp -j ACCEPT
    if tcp && t.lookup(CidrKind::ProbeSource, &c.dst).is_some() {
        return Verdict::Pass;
    }
    let via_lo = is_loopback(&c.dst) || t.lookup(CidrKind::Local, &c.dst).is_some();
    if pod.has(flags::DNS_CAPTURE) && c.dst_port == DNS_PORT && !ztunnel {
        // ! -o lo -p udp ! --mark 0x539/0xfff --dport 53 -j REDIRECT --to-port 15053
        // ! -d 127.0.0.1 -p tcp --dport 53 ! --mark 0x539/0xfff -j REDIRECT --to-ports 15053
        if (!tcp && !via_lo) || (tcp && !to_localhost) {
            return Verdict::Redirect(DNS_PROXY_PORT);
        }
    }
    // -p tcp -m mark --mark 0x111/0xfff -j ACCEPT
    if tcp && c.mark & AMBIENT_MARK_MASK == AMBIENT_REPLY_MARK {
        return Verdict::Pass;
    }
    // ! -d 127.0.0.1 -o lo -j ACCEPT
    if via_lo && !to_localhost {
        return Verdict::Pass;
    }
    // ! -d 127.0.0.1 -p tcp ! --mark 0x539/0xfff -j REDIRECT --to-ports 15001
    if tcp && !to_localhost && !ztunnel {
        return Verdict::Redirect(PROXY_OUTBOUND_PORT);
    }
    Verdict::Pass
}

/// Ambient mode's inbound decision, as Istio's in-pod `nat ISTIO_PRERT` orders it: new
/// connections only (NAT sees a connection's first packet), rerouted interfaces to 15001,
/// kubelet's probes (from the node's SNAT address) and HBONE (15008) left to the pod's
/// address, ztunnel's own marked packets left alone, the rest to 15006 (a SYN on a 4-tuple in
/// `TIME_WAIT` too: conntrack reopens it, [`Existing::TimeWait`]). (`! -d 127.0.0.1` is
/// moot: the kernel drops a loopback destination arriving on any other interface.)
#[inline(always)]
fn ambient_inbound<T: PodTables>(pod: &PodConfig, c: &Inbound, t: &T) -> Verdict {
    if c.existing.keeps(c.syn) {
        return Verdict::Pass;
    }
    if matches!(c.src, Addr::V6(_)) && !pod.has(flags::IPV6) {
        return Verdict::Pass;
    }
    // -i <reroute-virtual-interfaces> -p tcp -j REDIRECT --to-ports 15001
    if c.iface & iface_flags::REROUTE != 0 {
        return Verdict::Redirect(PROXY_OUTBOUND_PORT);
    }
    if pod.has(flags::BYPASS_INBOUND)
        || t.lookup(CidrKind::ProbeSource, &c.src).is_some()
        || c.dst_port == HBONE_PORT
        || is_ztunnel(c.mark)
    {
        return Verdict::Pass;
    }
    Verdict::Redirect(PROXY_INBOUND_PORT)
}

#[cfg(test)]
mod tests;
