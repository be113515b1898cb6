//! The maps, and the decision's view of them for one pod.
use aya_ebpf::{
    macros::map,
    maps::{HashMap, LpmTrie, LruHashMap, lpm_trie::Key},
};
use meshcap_common::{
    Addr, CIDR_KEY_PREFIX_BITS, Cidr4Data, Cidr6Data, CidrKind, FlowKey, IfaceKey, OrigDst,
    PodConfig, PodTables, PortKey, PortKind,
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

/// Written at connect/sendmsg, read by sockops and recvmsg. LRU: sockets that never connect
/// age out.
#[map(name = "MESHCAP_BY_COOKIE")]
pub static BY_COOKIE: LruHashMap<u64, OrigDst> = LruHashMap::with_max_entries(262_144, 0);

/// Deleted when either end closes; LRU as a backstop.
#[map(name = "MESHCAP_FLOWS")]
pub static FLOWS: LruHashMap<FlowKey, OrigDst> = LruHashMap::with_max_entries(262_144, 0);

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
}

impl PodTables for Maps {
    #[inline(always)]
    fn has_port(&self, kind: PortKind, port: u16) -> bool {
        // SAFETY: presence only.
        unsafe { PORTS.get(PortKey::new(self.pod_id, kind, port)) }.is_some()
    }

    #[inline(always)]
    fn lookup(&self, kind: CidrKind, addr: &Addr) -> Option<u32> {
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
