//! Map keys and values. Addresses are kept as the kernel keeps them: 32-bit words in network
//! byte order (`user_ip4`, `user_ip6[i]`, `bpf_sock.src_ip6[i]`), so the programs copy words and
//! never swap bytes; ports are host order.

/// `AF_INET`.
pub const AF_INET: u16 = 2;
/// `AF_INET6`.
pub const AF_INET6: u16 = 10;

/// An IP address in the kernel's layout (words in network byte order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Addr {
    /// IPv4: `u32::from_ne_bytes(octets)`.
    V4(u32),
    /// IPv6: four words, each `u32::from_ne_bytes` of four octets.
    V6([u32; 4]),
}

impl Addr {
    /// From octets.
    #[inline(always)]
    #[must_use]
    pub const fn v4(octets: [u8; 4]) -> Self {
        Self::V4(u32::from_ne_bytes(octets))
    }

    /// From octets.
    #[inline(always)]
    #[must_use]
    pub const fn v6(o: [u8; 16]) -> Self {
        Self::V6([
            u32::from_ne_bytes([o[0], o[1], o[2], o[3]]),
            u32::from_ne_bytes([o[4], o[5], o[6], o[7]]),
            u32::from_ne_bytes([o[8], o[9], o[10], o[11]]),
            u32::from_ne_bytes([o[12], o[13], o[14], o[15]]),
        ])
    }

    /// `0.0.0.0` or `::`.
    #[inline(always)]
    #[must_use]
    pub const fn is_unspecified(&self) -> bool {
        match *self {
            Self::V4(a) => a == 0,
            Self::V6(w) => w[0] == 0 && w[1] == 0 && w[2] == 0 && w[3] == 0,
        }
    }

    /// The four words of a [`FlowKey`] / [`OrigDst`] (IPv4 in the first).
    #[inline(always)]
    #[must_use]
    pub const fn words(&self) -> [u32; 4] {
        match *self {
            Self::V4(a) => [a, 0, 0, 0],
            Self::V6(w) => w,
        }
    }

    /// The address family number.
    #[inline(always)]
    #[must_use]
    pub const fn family(&self) -> u16 {
        match self {
            Self::V4(_) => AF_INET,
            Self::V6(_) => AF_INET6,
        }
    }
}

/// Which port list of a pod a [`PortKey`] belongs to.
#[repr(u16)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PortKind {
    /// `excludeOutboundPorts` (TCP and UDP).
    ExcludeOutbound = 1,
    /// `includeOutboundPorts` (TCP).
    IncludeOutbound = 2,
    /// `includeInboundPorts` when it is a list.
    IncludeInbound = 3,
    /// `excludeInboundPorts` (with 15020, 15021, 15090), used when the include list is `*`.
    ExcludeInbound = 4,
}

/// Key of [`crate::maps::PORTS`]: presence means "in the list".
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PortKey {
    /// [`crate::PodConfig::pod_id`].
    pub pod_id: u32,
    /// [`PortKind`] as `u16`.
    pub kind: u16,
    /// The port, host order.
    pub port: u16,
}

impl PortKey {
    /// The key of `port` in `pod_id`'s `kind` list.
    #[inline(always)]
    #[must_use]
    pub const fn new(pod_id: u32, kind: PortKind, port: u16) -> Self {
        Self {
            pod_id,
            kind: kind as u16,
            port,
        }
    }
}

/// Which CIDR list of a pod an LPM entry belongs to.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CidrKind {
    /// `excludeOutboundIPRanges`.
    ExcludeOutbound = 1,
    /// `includeOutboundIPRanges` (`*` is a zero-length prefix).
    IncludeOutbound = 2,
    /// The pod's own addresses (and `::6`): traffic to them leaves by `lo`.
    Local = 3,
    /// A snapshot of the pod's routes, value 1 when the route's device is in
    /// `excludeInterfaces` (outbound traffic by that device is left alone), else 0.
    Route = 4,
    /// Ambient mode: the addresses the node SNATs kubelet's probes to (169.254.7.127 and
    /// its IPv6 twin), let through uncaptured both ways.
    ProbeSource = 5,
}

/// Bits of an LPM key before the address: pod id and list kind.
pub const CIDR_KEY_PREFIX_BITS: u32 = 64;

/// Data part of an IPv4 LPM key: `pod_id` (big-endian), kind (big-endian), address. The LPM
/// prefix length is [`CIDR_KEY_PREFIX_BITS`] plus the CIDR's length, so entries of other pods
/// and lists never match.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Cidr4Data {
    /// `pod_id.to_be_bytes()`.
    pub pod: [u8; 4],
    /// `(kind as u32).to_be_bytes()`.
    pub kind: [u8; 4],
    /// The address (network order word).
    pub addr: u32,
}

impl Cidr4Data {
    /// Data of `addr` in `pod_id`'s `kind` list.
    #[inline(always)]
    #[must_use]
    pub const fn new(pod_id: u32, kind: CidrKind, addr: u32) -> Self {
        Self {
            pod: pod_id.to_be_bytes(),
            kind: (kind as u32).to_be_bytes(),
            addr,
        }
    }
}

/// Data part of an IPv6 LPM key (as [`Cidr4Data`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Cidr6Data {
    /// `pod_id.to_be_bytes()`.
    pub pod: [u8; 4],
    /// `(kind as u32).to_be_bytes()`.
    pub kind: [u8; 4],
    /// The address (network order words).
    pub addr: [u32; 4],
}

impl Cidr6Data {
    /// Data of `addr` in `pod_id`'s `kind` list.
    #[inline(always)]
    #[must_use]
    pub const fn new(pod_id: u32, kind: CidrKind, addr: [u32; 4]) -> Self {
        Self {
            pod: pod_id.to_be_bytes(),
            kind: (kind as u32).to_be_bytes(),
            addr,
        }
    }
}

/// Key of [`crate::maps::IFACES`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct IfaceKey {
    /// The pod's netns cookie.
    pub netns: u64,
    /// The interface's index inside the pod netns.
    pub ifindex: u32,
    /// Zero.
    pub pad: u32,
}

/// A pod's own addresses (value of [`crate::maps::POD_ADDRS`]): what a redirected connection's
/// socket is bound to, so that the app's local address and the peer the proxy sees are the
/// pod's, as under Istio's NAT. An all-zero address: the pod has none of that family.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PodAddrs {
    /// The IPv4 address, network order.
    pub v4: u32,
    /// The IPv6 address, network order words.
    pub v6: [u32; 4],
}

/// An original destination: what the app dialled (outbound) or the client dialled (inbound).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct OrigDst {
    /// Address words (IPv4 in the first), network order.
    pub addr: [u32; 4],
    /// Port, host order.
    pub port: u16,
    /// [`AF_INET`] or [`AF_INET6`] (both fit in a byte).
    pub family: u8,
    /// [`flow_state`]: how far the connection has got, in [`crate::maps::FLOWS`].
    pub state: u8,
}

impl OrigDst {
    /// `addr:port`.
    #[inline(always)]
    #[must_use]
    pub const fn new(addr: Addr, port: u16) -> Self {
        Self {
            addr: addr.words(),
            port,
            #[expect(clippy::cast_possible_truncation, reason = "AF_INET and AF_INET6 fit")]
            family: addr.family() as u8,
            state: flow_state::PENDING,
        }
    }
}

/// A slot of [`crate::maps::DIALING`]: the original destination of the redirected TCP socket
/// with cookie `cookie` (0: none), from connect until its connection is established.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Dialing {
    /// The socket's cookie; 0 while the slot is being written, or once it was taken.
    pub cookie: u64,
    /// What connect rewrote.
    pub orig: OrigDst,
    /// Zero.
    pub pad: u32,
}

/// Slots of [`crate::maps::DIALING`] (a power of two: a socket's slot is the low bits of its
/// cookie).
pub const DIALING_SLOTS: u32 = 1 << 16;

/// Bits of [`OrigDst::state`] in [`crate::maps::FLOWS`] (elsewhere always [`PENDING`]).
///
/// [`PENDING`]: flow_state::PENDING
pub mod flow_state {
    /// Written when the connecting end is established (or, inbound, when TC hands the SYN to
    /// the proxy): the accepting end is not yet.
    pub const PENDING: u8 = 0;
    /// The accepting end of this connection is established: `getsockopt(SO_ORIGINAL_DST)` on
    /// it answers from the entry. Another accepting end established under the same key means
    /// the entry is stale (its connection is gone), and it is removed.
    pub const ACCEPTED: u8 = 1;
    /// The connecting end is a socket in the pod (an app's redirected connection, not an
    /// inbound one TC handed over): the entry lives until that socket closes, and answers its
    /// `getpeername(2)` meanwhile, also after the proxy's end went.
    pub const CLIENT_HERE: u8 = 1 << 1;
}

/// Key of [`crate::maps::FLOWS`]: one TCP connection inside one network namespace, named by its
/// client and server ends (two pods can have identical loopback 4-tuples, hence the netns).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FlowKey {
    /// Network namespace cookie.
    pub netns: u64,
    /// The connecting end's address.
    pub client: [u32; 4],
    /// The accepting end's address (the proxy listener's, after a redirect).
    pub server: [u32; 4],
    /// The connecting end's port, host order.
    pub client_port: u16,
    /// The accepting end's port, host order.
    pub server_port: u16,
    /// [`AF_INET`] or [`AF_INET6`] (`u32` to keep the key free of padding).
    pub family: u32,
}

/// Key of [`crate::maps::LISTENERS`]: the proxy listener a pod's inbound connections on one
/// port and family were handed to. With `SO_REUSEPORT` the proxy has several listeners on one
/// port: the key holds one of them, and the kernel picks among the whole group when a
/// connection is handed to it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ListenerKey {
    /// Network namespace cookie.
    pub netns: u64,
    /// The listener's port, host order.
    pub port: u16,
    /// The connections' family, [`AF_INET`] or [`AF_INET6`] (an IPv4 connection's listener
    /// may be a dual-stack IPv6 socket).
    pub family: u16,
    /// Zero.
    pub pad: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_have_no_padding() {
        assert_eq!(size_of::<PortKey>(), 8);
        assert_eq!(size_of::<Cidr4Data>(), 12);
        assert_eq!(size_of::<Cidr6Data>(), 24);
        assert_eq!(size_of::<IfaceKey>(), 16);
        assert_eq!(size_of::<OrigDst>(), 20);
        assert_eq!(size_of::<FlowKey>(), 48);
        assert_eq!(size_of::<ListenerKey>(), 16);
        assert_eq!(size_of::<Dialing>(), 32);
        assert_eq!(size_of::<crate::PodConfig>(), 16);
    }
}
