//! The maps, and the decision's view of them for one pod.
use core::{
    ffi::c_void,
    ptr::{read_volatile, write_volatile},
};

use aya_ebpf::{
    bindings::{BPF_SK_STORAGE_GET_F_CREATE, bpf_sock},
    btf_maps::SkStorage,
    helpers::generated::bpf_sk_storage_get,
    macros::{btf_map, map},
    maps::{Array, HashMap, LpmTrie, LruHashMap, SockHash, lpm_trie::Key},
};
use meshcap_common::{
    Addr, CIDR_KEY_PREFIX_BITS, Cidr4Data, Cidr6Data, CidrKind, DIALING_SLOTS, Dialing, FlowKey,
    IfaceKey, ListenerKey, OrigDst, PodAddrs, PodConfig, PodTables, PortKey, PortKind,
};

/// `BPF_F_NO_PREALLOC`: elements are allocated on insert (only the agent writes these).
const NO_PREALLOC: u32 = 1;

/// Pods of one node: kubelet's `maxPods` is 110 by default; 1,024 leaves room for nodes
/// configured far above it. The other per-pod maps are sized from it.
const MAX_PODS: u32 = 1_024;

/// Preallocated: small, and read on every connection.
#[map(name = "MESHCAP_PODS")]
pub static PODS: HashMap<u64, PodConfig> = HashMap::with_max_entries(MAX_PODS, 0);

/// CIDR lists: 64 entries per pod on average (LPM tries always allocate on insert).
#[map(name = "MESHCAP_CIDRS4")]
pub static CIDRS4: LpmTrie<Cidr4Data, u32> = LpmTrie::with_max_entries(MAX_PODS * 64, 0);

#[map(name = "MESHCAP_CIDRS6")]
pub static CIDRS6: LpmTrie<Cidr6Data, u32> = LpmTrie::with_max_entries(MAX_PODS * 64, 0);

/// Port lists: 64 entries per pod on average; sparse, so allocated on insert.
#[map(name = "MESHCAP_PORTS")]
pub static PORTS: HashMap<PortKey, u8> = HashMap::with_max_entries(MAX_PODS * 64, NO_PREALLOC);

/// Interface flags: 8 interfaces per pod on average.
#[map(name = "MESHCAP_IFACES")]
pub static IFACES: HashMap<IfaceKey, u32> = HashMap::with_max_entries(MAX_PODS * 8, NO_PREALLOC);

/// The pod's own addresses by netns cookie: what a redirected socket is bound to (see
/// [`crate::outbound`]). Read once per redirected connection, never for others.
#[map(name = "MESHCAP_POD_ADDRS")]
pub static POD_ADDRS: HashMap<u64, PodAddrs> = HashMap::with_max_entries(MAX_PODS, 0);

/// The original destination of a UDP socket meshcap redirected, on that socket: written at
/// connect or sendmsg, read by getpeername and recvmsg (DNS replies) for as long as the socket
/// lives. Socket storage: freed with the socket. (TCP sockets an earlier build redirected have
/// it too; this build keeps a TCP socket's in its connection's flow, at a fraction of the cost
/// of creating the storage on every connect.)
#[btf_map(name = "MESHCAP_DIALED")]
pub static DIALED: SkStorage<OrigDst> = SkStorage::new();

/// The original destination of a TCP socket meshcap redirected, by socket cookie, as
/// connect kept it before [`DIALING`]: sockops still takes an entry from here when the
/// socket's slot does not answer (a connect an earlier build's program rewrote, during an
/// upgrade). This build writes none.
#[map(name = "MESHCAP_CONNECTING")]
pub static CONNECTING: LruHashMap<u64, OrigDst> = LruHashMap::with_max_entries(16_384, 0);

/// The original destination of a TCP socket meshcap redirected, in the slot of its socket
/// cookie ([`dial`], [`dialled`]): written at connect, taken by sockops when the connection is
/// established (see [`crate::flows`]). An array: no lock, no allocation and no eviction on
/// either side (the LRU hash [`CONNECTING`] it replaces cost most of a captured connect's
/// kernel time). A slot is a handshake's: another socket whose cookie has the same low bits,
/// connecting before that handshake completes, takes it over and that one connection loses
/// its `SO_ORIGINAL_DST`, as an evicted LRU entry did; cookies are handed out in sequence
/// (per CPU, in batches of 4,096), so that takes 64 Ki sockets given cookies during one
/// handshake.
#[map(name = "MESHCAP_DIALING")]
pub static DIALING: Array<Dialing> = Array::with_max_entries(DIALING_SLOTS, 0);

/// Puts `orig` in the slot of socket `cookie`. The cookie is written last (and cleared
/// first), so a reader that finds it before and after copying the destination copied this
/// socket's.
#[inline(always)]
pub fn dial(cookie: u64, orig: OrigDst) {
    #[expect(
        clippy::cast_possible_truncation,
        reason = "the slot is the cookie's low bits"
    )]
    let Some(slot) = DIALING.get_ptr_mut(cookie as u32 & (DIALING_SLOTS - 1)) else {
        return;
    };
    // SAFETY: `slot` points into the array; each field is written whole.
    unsafe {
        write_volatile(&raw mut (*slot).cookie, 0);
        write_volatile(&raw mut (*slot).orig, orig);
        write_volatile(&raw mut (*slot).cookie, cookie);
    }
}

/// Takes the original destination of socket `cookie` out of its slot, if the slot holds it.
#[inline(always)]
pub fn dialled(cookie: u64) -> Option<OrigDst> {
    #[expect(
        clippy::cast_possible_truncation,
        reason = "the slot is the cookie's low bits"
    )]
    let slot = DIALING.get_ptr_mut(cookie as u32 & (DIALING_SLOTS - 1))?;
    // SAFETY: `slot` points into the array; each field is read whole.
    unsafe {
        if read_volatile(&raw const (*slot).cookie) != cookie {
            return None;
        }
        let orig = read_volatile(&raw const (*slot).orig);
        if read_volatile(&raw const (*slot).cookie) != cookie {
            return None;
        }
        write_volatile(&raw mut (*slot).cookie, 0);
        Some(orig)
    }
}

/// The original destination of a captured connection under its netns-qualified 4-tuple (see
/// [`crate::flows`]): written when the client end is established (or inbound, when TC assigns
/// the SYN), marked when the accepted end is, read by `getsockopt(SO_ORIGINAL_DST)` on the
/// accepted end for as long as the proxy asks, removed when the accepted end closes. So it
/// holds the node's open captured connections: sized for 64 Ki of them (a full LRU evicts on
/// every insert, which showed in the short-connection p99). Preallocated (no allocation per
/// connection).
#[map(name = "MESHCAP_FLOWS")]
pub static FLOWS: LruHashMap<FlowKey, OrigDst> = LruHashMap::with_max_entries(65_536, 0);

/// The proxies' listeners the classifier handed connections to (see [`crate::handoff`]), by
/// netns, port and family: at most four per pod. The kernel removes a socket when it closes.
#[map(name = "MESHCAP_LISTENERS")]
pub static LISTENERS: SockHash<ListenerKey> = SockHash::with_max_entries(MAX_PODS * 4, 0);

/// Inbound connections the classifier hands to the socket lookup, by 4-tuple (`netns` 0: the
/// socket lookup does not know its netns; the server end is the pod's own address) →
/// the listener. Entries are not taken when used: a retransmitted SYN, or the ACK of a SYN
/// cookie, is looked up again; the LRU retires them, and the classifier removes a new SYN's
/// entry before it decides (writing it again when it hands that SYN off too).
#[map(name = "MESHCAP_HANDOFFS")]
pub static HANDOFFS: LruHashMap<FlowKey, ListenerKey> = LruHashMap::with_max_entries(16_384, 0);

/// `sk`'s value in the socket storage `map`, created when `create`.
///
/// # Safety
/// `sk` must be a socket pointer the program's context handed out (the verifier checks).
#[inline(always)]
unsafe fn storage(map: &SkStorage<OrigDst>, sk: *mut bpf_sock, create: bool) -> *mut OrigDst {
    let flags = if create {
        u64::from(BPF_SK_STORAGE_GET_F_CREATE)
    } else {
        0
    };
    let map = core::ptr::from_ref(map).cast_mut().cast::<c_void>();
    // SAFETY: `map` is a socket storage map; `sk` is the context's socket (caller).
    unsafe { bpf_sk_storage_get(map, sk.cast(), core::ptr::null_mut(), flags) }.cast()
}

/// `sk`'s value in the socket storage `map`, if it has one.
///
/// # Safety
/// As [`storage`].
#[inline(always)]
pub unsafe fn sk_get(map: &SkStorage<OrigDst>, sk: *mut bpf_sock) -> Option<OrigDst> {
    // SAFETY: caller; a non-null result points to this socket's value.
    unsafe { storage(map, sk, false).as_ref() }.copied()
}

/// Sets `sk`'s value in the socket storage `map`. Without memory for it, only this socket's
/// original destination is lost.
///
/// # Safety
/// As [`storage`].
#[inline(always)]
pub unsafe fn sk_put(map: &SkStorage<OrigDst>, sk: *mut bpf_sock, value: OrigDst) {
    // SAFETY: caller; a non-null result points to this socket's value.
    if let Some(slot) = unsafe { storage(map, sk, true).as_mut() } {
        *slot = value;
    }
}

/// The addresses of the pod of a netns, if the agent recorded them.
#[inline(always)]
pub fn pod_addrs(netns: u64) -> Option<PodAddrs> {
    // SAFETY: a plain read of a value the agent writes whole.
    unsafe { POD_ADDRS.get(netns) }.copied()
}

/// The pod config of a netns, if the agent captures it.
#[inline(always)]
pub fn pod(netns: u64) -> Option<PodConfig> {
    // SAFETY: a plain read of a value the agent writes whole.
    unsafe { PODS.get(netns) }.copied()
}

/// One pod's lists in the maps.
pub struct Maps {
    /// [`PodConfig::pod_id`].
    pub pod_id: u32,
    /// The pod's IPv4 address when it is all its [`CidrKind::Local`] list holds of IPv4
    /// ([`flags::LOCAL4_IS_POD_ADDR`](meshcap_common::flags::LOCAL4_IS_POD_ADDR)): compared
    /// instead of looked up.
    pub local4: Option<u32>,
}

impl Maps {
    /// The lists of `pod` (no local address known: every list is looked up).
    #[inline(always)]
    pub const fn of(pod: &PodConfig) -> Self {
        Self {
            pod_id: pod.pod_id,
            local4: None,
        }
    }
}

impl PodTables for Maps {
    #[inline(always)]
    fn has_port(&self, kind: PortKind, port: u16) -> bool {
        // SAFETY: presence only.
        unsafe { PORTS.get(PortKey::new(self.pod_id, kind, port)) }.is_some()
    }

    #[inline(always)]
    fn lookup(&self, kind: CidrKind, addr: &Addr) -> Option<u32> {
        if let (CidrKind::Local, Addr::V4(a), Some(own)) = (kind, *addr, self.local4) {
            return (a == own).then_some(1);
        }
        match *addr {
            Addr::V4(a) => CIDRS4
                .get(Key::new(
                    CIDR_KEY_PREFIX_BITS + 32,
                    Cidr4Data::new(self.pod_id, kind, a),
                ))
                .copied(),
            Addr::V6(w) => CIDRS6
                .get(Key::new(
                    CIDR_KEY_PREFIX_BITS + 128,
                    Cidr6Data::new(self.pod_id, kind, w),
                ))
                .copied(),
        }
    }
}
