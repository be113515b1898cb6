//! The agent's in-memory index of the per-pod maps ([`super::Tables`] keeps it with every
//! write): the list keys (and values) written under each pod id, the interface keys of each
//! netns cookie, the pod entries and addresses written, the pod ids in use and which cookie
//! each pinned pod is.
use std::collections::{HashMap as StdHashMap, HashSet};

use aya::maps::lpm_trie::Key;
use meshcap_common::{Cidr4Data, Cidr6Data, IfaceKey, PodAddrs, PodConfig, PortKey};

/// The list entries written under one pod id.
#[derive(Default)]
pub(super) struct Lists {
    /// `MESHCAP_PORTS` keys.
    pub(super) ports: Vec<PortKey>,
    /// `MESHCAP_CIDRS4` keys, with their values.
    pub(super) cidrs4: Vec<(Key<Cidr4Data>, u32)>,
    /// `MESHCAP_CIDRS6` keys, with their values.
    pub(super) cidrs6: Vec<(Key<Cidr6Data>, u32)>,
}

/// The in-memory index of the per-pod maps (see the module documentation).
#[derive(Default)]
pub(super) struct Index {
    /// By pod id.
    pub(super) lists: StdHashMap<u32, Lists>,
    /// `MESHCAP_IFACES` keys and their flags, by netns cookie.
    pub(super) ifaces: StdHashMap<u64, Vec<(IfaceKey, u32)>>,
    /// Pod ids a pod entry or a list uses.
    pub(super) ids: HashSet<u32>,
    /// The last pod id handed out: ids go round rather than being reused at once, so a
    /// program that read a pod's old configuration never meets another pod's lists under it.
    pub(super) cursor: u32,
    /// Netns cookie by pin name of the pod (`pod@<namespace>@<name>@<container>`).
    pub(super) cookies: StdHashMap<String, u64>,
    /// Each netns cookie's pod entry, as written (or adopted).
    pub(super) configs: StdHashMap<u64, PodConfig>,
    /// Each netns cookie's own addresses, as written (or adopted).
    pub(super) addrs: StdHashMap<u64, PodAddrs>,
}

impl Lists {
    pub(super) fn len(&self) -> usize {
        self.ports.len() + self.cidrs4.len() + self.cidrs6.len()
    }
}

impl Index {
    /// Records that pod id `id` is in use (a pod entry references it).
    pub(super) fn use_id(&mut self, id: u32) {
        self.ids.insert(id);
        self.cursor = self.cursor.max(id);
    }

    /// A pod id no pod entry or list uses, now in use.
    pub(super) fn allocate(&mut self) -> u32 {
        loop {
            self.cursor = self.cursor.wrapping_add(1).max(1);
            if self.ids.insert(self.cursor) {
                return self.cursor;
            }
        }
    }

    /// The lists of pod id `id`, to record keys as they are written.
    pub(super) fn lists_mut(&mut self, id: u32) -> &mut Lists {
        self.use_id(id);
        self.lists.entry(id).or_default()
    }

    /// Forgets pod id `id` (free again) and returns its list keys, to delete.
    pub(super) fn release(&mut self, id: u32) -> Lists {
        self.ids.remove(&id);
        self.lists.remove(&id).unwrap_or_default()
    }

    /// Records an interface entry of the pod with netns `cookie`.
    pub(super) fn add_iface(&mut self, cookie: u64, key: IfaceKey, flags: u32) {
        self.ifaces.entry(cookie).or_default().push((key, flags));
    }

    /// Forgets the interface entries of `cookie` and returns them, to delete.
    pub(super) fn take_ifaces(&mut self, cookie: u64) -> Vec<(IfaceKey, u32)> {
        self.ifaces.remove(&cookie).unwrap_or_default()
    }

    /// The netns cookie of the pod pinned as `meta`.
    pub(super) fn cookie(&self, meta: &str) -> Option<u64> {
        self.cookies.get(meta).copied()
    }

    /// Records that the pod pinned as `meta` is netns `cookie`.
    pub(super) fn set_cookie(&mut self, meta: String, cookie: u64) {
        self.cookies.insert(meta, cookie);
    }

    /// Forgets every pod pinned under netns `cookie` (a DEL finds the pod by its netns when
    /// its pins name another container).
    pub(super) fn forget_cookie(&mut self, cookie: u64) {
        self.cookies.retain(|_, c| *c != cookie);
    }

    /// How many pods are pinned.
    pub(super) fn pods(&self) -> usize {
        self.cookies.len()
    }
}
