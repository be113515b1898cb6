//! What the per-pod maps hold, per pod, kept in memory: the list keys written under each pod
//! id, the interface keys of each netns cookie, the pod ids in use and which cookie each pinned
//! pod is. A DEL or an update then removes exactly its own entries (one syscall each) instead
//! of walking whole maps, and a new pod id costs no map walk. Rebuilt once from the pinned
//! maps and pins when the backend opens; afterwards this process is their only writer.
use std::collections::{HashMap, HashSet};

use aya::maps::lpm_trie::Key;
use meshcap_common::{Cidr4Data, Cidr6Data, IfaceKey, PortKey};

/// The list entries written under one pod id.
#[derive(Default)]
pub struct Lists {
    /// `MESHCAP_PORTS` keys.
    pub ports: Vec<PortKey>,
    /// `MESHCAP_CIDRS4` keys.
    pub cidrs4: Vec<Key<Cidr4Data>>,
    /// `MESHCAP_CIDRS6` keys.
    pub cidrs6: Vec<Key<Cidr6Data>>,
}

/// The in-memory index of the per-pod maps (see the module documentation).
#[derive(Default)]
pub struct Index {
    /// By pod id.
    lists: HashMap<u32, Lists>,
    /// `MESHCAP_IFACES` keys and their flags, by netns cookie.
    ifaces: HashMap<u64, Vec<(IfaceKey, u32)>>,
    /// Pod ids a pod entry or a list uses.
    ids: HashSet<u32>,
    /// The last pod id handed out: ids go round rather than being reused at once, so a
    /// program that read a pod's old configuration never meets another pod's lists under it.
    cursor: u32,
    /// Netns cookie by pin name of the pod (`pod@<namespace>@<name>@<container>`).
    cookies: HashMap<String, u64>,
}

impl Index {
    /// Records that pod id `id` is in use (a pod entry references it).
    pub fn use_id(&mut self, id: u32) {
        self.ids.insert(id);
        self.cursor = self.cursor.max(id);
    }

    /// A pod id no pod entry or list uses, now in use.
    pub fn allocate(&mut self) -> u32 {
        loop {
            self.cursor = self.cursor.wrapping_add(1).max(1);
            if self.ids.insert(self.cursor) {
                return self.cursor;
            }
        }
    }

    /// The lists of pod id `id`, to record keys as they are written.
    pub fn lists_mut(&mut self, id: u32) -> &mut Lists {
        self.use_id(id);
        self.lists.entry(id).or_default()
    }

    /// Forgets pod id `id` (free again) and returns its list keys, to delete.
    pub fn release(&mut self, id: u32) -> Lists {
        self.ids.remove(&id);
        self.lists.remove(&id).unwrap_or_default()
    }

    /// Records an interface entry of the pod with netns `cookie`.
    pub fn add_iface(&mut self, cookie: u64, key: IfaceKey, flags: u32) {
        self.ifaces.entry(cookie).or_default().push((key, flags));
    }

    /// Forgets the interface entries of `cookie` and returns them, to delete.
    pub fn take_ifaces(&mut self, cookie: u64) -> Vec<(IfaceKey, u32)> {
        self.ifaces.remove(&cookie).unwrap_or_default()
    }

    /// The netns cookie of the pod pinned as `meta`.
    pub fn cookie(&self, meta: &str) -> Option<u64> {
        self.cookies.get(meta).copied()
    }

    /// Records that the pod pinned as `meta` is netns `cookie`.
    pub fn set_cookie(&mut self, meta: String, cookie: u64) {
        self.cookies.insert(meta, cookie);
    }

    /// Forgets every pod pinned under netns `cookie` (a DEL finds the pod by its netns when
    /// its pins name another container).
    pub fn forget_cookie(&mut self, cookie: u64) {
        self.cookies.retain(|_, c| *c != cookie);
    }

    /// How many pods are pinned.
    pub fn pods(&self) -> usize {
        self.cookies.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_go_round_and_skip_those_in_use() {
        let mut index = Index::default();
        index.use_id(2);
        assert_eq!(index.allocate(), 3);
        index.lists_mut(4).ports.push(PortKey::new(
            4,
            meshcap_common::PortKind::ExcludeOutbound,
            1,
        ));
        assert_eq!(index.allocate(), 5);
        assert_eq!(index.release(4).ports.len(), 1);
        assert!(index.release(4).ports.is_empty(), "released once");
        // 4 is free again, but ids go round first.
        assert_eq!(index.allocate(), 6);
        index.cursor = u32::MAX - 1;
        assert_eq!(index.allocate(), u32::MAX);
        assert_eq!(index.allocate(), 1, "0 is never an id");
        assert_eq!(index.allocate(), 4, "2, 3, 5 and 6 are in use");
    }

    #[test]
    fn ifaces_and_cookies_are_per_pod() {
        let mut index = Index::default();
        let key = |netns, ifindex| IfaceKey {
            netns,
            ifindex,
            pad: 0,
        };
        index.add_iface(7, key(7, 2), 1);
        index.add_iface(7, key(7, 3), 2);
        index.add_iface(8, key(8, 2), 1);
        assert_eq!(index.take_ifaces(7).len(), 2);
        assert!(index.take_ifaces(7).is_empty());
        assert_eq!(index.take_ifaces(8).len(), 1);
        index.set_cookie("pod@a@b@c".into(), 7);
        index.set_cookie("pod@a@b@d".into(), 9);
        assert_eq!(index.cookie("pod@a@b@c"), Some(7));
        assert_eq!(index.pods(), 2);
        index.forget_cookie(7);
        assert_eq!(index.cookie("pod@a@b@c"), None);
        assert_eq!(index.pods(), 1);
    }
}
