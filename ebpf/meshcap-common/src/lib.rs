//! What the kernel programs and the agent agree on: map names, map key and value layouts, and
//! the per-connection capture decision. `no_std`, no allocation, no panics, no loops: the same
//! code runs in the verifier's world and in host tests.
//!
//! The decision ([`decide_outbound`], [`decide_inbound`]) is Istio's `ISTIO_OUTPUT` /
//! `ISTIO_INBOUND` rule order written as straight-line code over a [`PodTables`] lookup: in the
//! kernel the lookups are BPF maps, on the host plain collections.
#![no_std]

#[cfg(test)]
extern crate std;

mod decision;
mod keys;

pub use decision::*;
pub use keys::*;

/// Map names, as the programs declare them and the agent opens them (and pins them under
/// these names).
pub mod maps {
    /// [`crate::PodConfig`] by network namespace cookie (`u64`).
    pub const PODS: &str = "MESHCAP_PODS";
    /// IPv4 CIDR lists (LPM trie, [`crate::Cidr4Key`] → `u32`).
    pub const CIDRS4: &str = "MESHCAP_CIDRS4";
    /// IPv6 CIDR lists (LPM trie, [`crate::Cidr6Key`] → `u32`).
    pub const CIDRS6: &str = "MESHCAP_CIDRS6";
    /// Port lists ([`crate::PortKey`] → `u8`).
    pub const PORTS: &str = "MESHCAP_PORTS";
    /// Interface flags in a pod ([`crate::IfaceKey`] → `u32`).
    pub const IFACES: &str = "MESHCAP_IFACES";
    /// Original destination of a redirected UDP socket, in the socket's own storage (socket
    /// storage, [`crate::OrigDst`]): from connect/sendmsg, for recvmsg.
    pub const DIALED: &str = "MESHCAP_DIALED";
    /// Original destination of a redirected TCP socket by socket cookie (LRU hash, `u64` →
    /// [`crate::OrigDst`]): written by connect before [`DIALING`] replaced it; sockops still
    /// reads it for a connection whose slot does not answer (one connected by an earlier
    /// build's program, during an upgrade).
    pub const CONNECTING: &str = "MESHCAP_CONNECTING";
    /// Original destination of a redirected TCP socket, in the slot of its socket cookie
    /// (array of [`crate::DIALING_SLOTS`] [`crate::Dialing`]): from connect, for sockops when
    /// the connection is established. No lock and no allocation on either side, where an LRU
    /// insert and delete were most of a captured connect's kernel time.
    pub const DIALING: &str = "MESHCAP_DIALING";
    /// Original destination by netns-qualified 4-tuple (LRU hash, [`crate::FlowKey`] →
    /// [`crate::OrigDst`]): from the client end (or TC, inbound), what
    /// `getsockopt(SO_ORIGINAL_DST)` on the accepted end answers.
    pub const FLOWS: &str = "MESHCAP_FLOWS";
    /// Program array, slot 0: the shared inbound TC program every pod's stub tail-calls.
    pub const TC_PROG: &str = "MESHCAP_TC_PROG";
    /// The pod's own addresses by network namespace cookie (`u64` → [`crate::PodAddrs`]): the
    /// local address a redirected connection gets, as Istio's NAT leaves it.
    pub const POD_ADDRS: &str = "MESHCAP_POD_ADDRS";
    /// The proxies' listeners (sockhash, [`crate::ListenerKey`] → socket): where the kernel's
    /// `bpf_sk_assign` refuses a `SO_REUSEPORT` listener, the TC classifier records the one it
    /// found here, for the socket lookup to hand the connection to.
    pub const LISTENERS: &str = "MESHCAP_LISTENERS";
    /// Inbound connections the TC classifier handed to the socket lookup (LRU hash,
    /// [`crate::FlowKey`] with `netns` 0 → [`crate::ListenerKey`]): written for a SYN the
    /// classifier could not assign itself, taken by the pod's socket lookup program.
    pub const HANDOFFS: &str = "MESHCAP_HANDOFFS";
}

/// Program names in the object (and their pin names).
pub mod programs {
    /// `cgroup/connect4`.
    pub const CONNECT4: &str = "meshcap_connect4";
    /// `cgroup/connect6`.
    pub const CONNECT6: &str = "meshcap_connect6";
    /// `cgroup/sendmsg4`.
    pub const SENDMSG4: &str = "meshcap_sendmsg4";
    /// `cgroup/sendmsg6`.
    pub const SENDMSG6: &str = "meshcap_sendmsg6";
    /// `cgroup/recvmsg4`.
    pub const RECVMSG4: &str = "meshcap_recvmsg4";
    /// `cgroup/recvmsg6`.
    pub const RECVMSG6: &str = "meshcap_recvmsg6";
    /// `sockops`.
    pub const SOCKOPS: &str = "meshcap_sockops";
    /// `cgroup/getsockopt`.
    pub const GETSOCKOPT: &str = "meshcap_getsockopt";
    /// `cgroup/getpeername4`.
    pub const GETPEERNAME4: &str = "meshcap_getpeername4";
    /// `cgroup/getpeername6`.
    pub const GETPEERNAME6: &str = "meshcap_getpeername6";
    /// TC ingress classifier: loaded once, in [`crate::maps::TC_PROG`]; reads the pod's netns
    /// cookie from `skb->cb[0..2]`.
    pub const INGRESS: &str = "meshcap_ingress";
    /// `sk_lookup`, attached to a captured pod's netns where the kernel's `bpf_sk_assign`
    /// refuses `SO_REUSEPORT` listeners (before Linux 6.5): hands the connections in
    /// [`crate::maps::HANDOFFS`] to the proxy's listener.
    pub const HANDOFF: &str = "meshcap_handoff";
}

/// Envoy's outbound listener.
pub const PROXY_OUTBOUND_PORT: u16 = 15001;
/// Envoy's inbound listener.
pub const PROXY_INBOUND_PORT: u16 = 15006;
/// HBONE: never sent to the inbound listener by the proxy-loopback rule, never captured
/// inbound in REDIRECT mode.
pub const HBONE_PORT: u16 = 15008;
/// istio-agent's DNS proxy.
pub const DNS_PROXY_PORT: u16 = 15053;
/// DNS.
pub const DNS_PORT: u16 = 53;
/// The mark of TPROXY'd traffic (Envoy's `original_src` upstream sockets, and the policy
/// route's `fwmark`).
pub const TPROXY_MARK: u32 = 1337;
/// The policy route table of TPROXY mode.
pub const TPROXY_TABLE: u32 = 133;
/// Ambient mode: the mark ztunnel puts on its own sockets (under [`AMBIENT_MARK_MASK`]); they
/// are never captured.
pub const ZTUNNEL_MARK: u32 = 0x539;
/// Ambient mode: the mark of the app's replies to ztunnel's connections from a client's
/// address (Istio's connmark), which the pod's policy route delivers back to ztunnel.
pub const AMBIENT_REPLY_MARK: u32 = 0x111;
/// Ambient mode: the bits of a mark Istio's in-pod rules look at.
pub const AMBIENT_MARK_MASK: u32 = 0xfff;
/// `SO_ORIGINAL_DST` and `IP6T_SO_ORIGINAL_DST`.
pub const SO_ORIGINAL_DST: i32 = 80;

/// Capture configuration of one pod, the value of [`maps::PODS`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodConfig {
    /// The pod's id in [`PortKey`], [`Cidr4Key`] and [`Cidr6Key`] (netns cookies are 64-bit;
    /// a 32-bit id keeps the LPM keys short). Never 0.
    pub pod_id: u32,
    /// [`flags`].
    pub flags: u32,
    /// The proxy's uid.
    pub proxy_uid: u32,
    /// The proxy's gid.
    pub proxy_gid: u32,
}

impl PodConfig {
    /// Whether `flag` (from [`flags`]) is set.
    #[inline(always)]
    #[must_use]
    pub const fn has(&self, flag: u32) -> bool {
        self.flags & flag != 0
    }
}

/// Bits of [`PodConfig::flags`].
pub mod flags {
    /// The include list names a loopback range (Istio's `HasLoopBackIP`, either family): the
    /// app's own loopback traffic is not waved through.
    pub const INCLUDE_LOOPBACK: u32 = 1;
    /// `ISTIO_META_DNS_CAPTURE`: port 53 to 15053.
    pub const DNS_CAPTURE: u32 = 1 << 1;
    /// `interceptionMode: TPROXY`.
    pub const TPROXY: u32 = 1 << 2;
    /// `includeInboundPorts: *` (otherwise the [`crate::PortKind::IncludeInbound`] list).
    pub const INBOUND_ALL: u32 = 1 << 3;
    /// IPv6 rules are installed (the pod has an IPv6 address); otherwise IPv6 passes.
    pub const IPV6: u32 = 1 << 4;
    /// The pod has `excludeInterfaces`: look up [`crate::CidrKind::Route`].
    pub const EXCLUDED_ROUTES: u32 = 1 << 5;
    /// `INVALID_DROP`.
    pub const INVALID_DROP: u32 = 1 << 6;
    /// `includeOutboundIPRanges: *`: every address is included, no lookup needed (the
    /// zero-length prefixes are in the list all the same).
    pub const INCLUDE_ALL: u32 = 1 << 7;
    /// The `excludeOutboundIPRanges` list is empty: no lookup needed.
    pub const NO_EXCLUDE_CIDRS: u32 = 1 << 8;
    /// The `excludeOutboundPorts` list is empty: no lookup needed.
    pub const NO_EXCLUDE_PORTS: u32 = 1 << 9;
    /// The `includeOutboundPorts` list is empty: no lookup needed.
    pub const NO_INCLUDE_PORTS: u32 = 1 << 10;
    /// Ambient mode: Istio's in-pod rules for ztunnel ([`crate::decide_outbound`] and
    /// [`crate::decide_inbound`] take their ambient branch); of the other flags only
    /// [`DNS_CAPTURE`] and [`IPV6`] apply.
    pub const AMBIENT: u32 = 1 << 11;
    /// Ambient mode's `ambient.istio.io/bypass-inbound-capture`: inbound is not captured
    /// (rerouted interfaces still are).
    pub const BYPASS_INBOUND: u32 = 1 << 12;
    /// The pod's netns has meshcap's socket lookup program ([`crate::programs::HANDOFF`]):
    /// an inbound connection whose proxy listener `bpf_sk_assign` refuses (`SO_REUSEPORT`,
    /// before Linux 6.5), or whose SYN finds the pod's end of an earlier connection in
    /// `TIME_WAIT` ([`crate::Existing::TimeWait`]), is handed to it instead of dropped. Every
    /// pod captured by an agent since the latter gets it.
    pub const HANDOFF: u32 = 1 << 13;
    /// The pod's only IPv4 address in its [`crate::CidrKind::Local`] list is the IPv4 address
    /// of its [`crate::maps::POD_ADDRS`] entry (nonzero): connect compares with that entry,
    /// which it reads anyway for a redirected socket's source, instead of looking the list up.
    /// Set by the agent from the pod's netns, like [`EXCLUDED_ROUTES`].
    pub const LOCAL4_IS_POD_ADDR: u32 = 1 << 14;
    /// With [`HANDOFF`]: every captured SYN goes through the socket lookup, also where
    /// `bpf_sk_assign` would take the listener. For a pod moved in place from Istio's `nat`
    /// rules, whose netns keeps netfilter's NAT hooks: with conntrack on, the NAT hook at
    /// `LOCAL_IN` drops a listener `bpf_sk_assign` chose (agent/src/backend/ebpf/pod, `add_moving`).
    /// Else for benchmarks only (the agent's hidden `--handoff always`), so that the
    /// hand-off's cost can be measured on a kernel that never needs it.
    pub const HANDOFF_ALWAYS: u32 = 1 << 15;
}

/// Bits of the [`maps::IFACES`] value.
pub mod iface_flags {
    /// `istio.io/reroute-virtual-interfaces`: inbound goes to the outbound listener.
    pub const REROUTE: u32 = 1;
    /// `excludeInterfaces`: left alone.
    pub const EXCLUDED: u32 = 1 << 1;
}

#[cfg(feature = "user")]
mod user {
    // SAFETY (all): `repr(C)`, `Copy`, no padding (checked by the size tests), every bit
    // pattern valid.
    unsafe impl aya::Pod for super::PodConfig {}
    unsafe impl aya::Pod for super::PortKey {}
    unsafe impl aya::Pod for super::IfaceKey {}
    unsafe impl aya::Pod for super::Cidr4Data {}
    unsafe impl aya::Pod for super::Cidr6Data {}
    unsafe impl aya::Pod for super::OrigDst {}
    unsafe impl aya::Pod for super::FlowKey {}
    unsafe impl aya::Pod for super::PodAddrs {}
    unsafe impl aya::Pod for super::Dialing {}
}
