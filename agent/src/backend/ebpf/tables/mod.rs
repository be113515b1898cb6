//! The per-pod maps and the agent's index of them. The maps hold each pod's configuration
//! (`MESHCAP_PODS`, by netns cookie), its lists (`MESHCAP_PORTS`, `MESHCAP_CIDRS4/6`, keyed by
//! pod id) and its interfaces' flags (`MESHCAP_IFACES`). [`Tables`] is their only writer once
//! the backend is open, and keeps in memory what they hold per pod: the list keys written
//! under each pod id, the interface keys of each netns cookie, the pod ids in use and which
//! cookie each pinned pod is. A DEL or an update then removes exactly its own entries (one
//! syscall each) instead of walking whole maps, and a new pod id costs no map walk. The index
//! is rebuilt once from the pinned maps and pins when the backend opens.
use std::collections::{HashMap as StdHashMap, HashSet};

use aya::{
    Ebpf,
    maps::{HashMap, LpmTrie, MapData, lpm_trie::Key},
};
use meshcap_common::{
    Cidr4Data, Cidr6Data, CidrKind, IfaceKey, PodAddrs, PodConfig, PortKey, iface_flags, maps,
};

use super::{
    EbpfError, Entries,
    encode::{CidrKey, cidr_key},
    pins::Pins,
};
use crate::podnet::PodNet;

/// The per-pod maps, and what they hold per pod.
pub(super) struct Tables {
    pub(super) pods: HashMap<MapData, u64, PodConfig>,
    addrs: HashMap<MapData, u64, PodAddrs>,
    pub(super) cidrs4: LpmTrie<MapData, Cidr4Data, u32>,
    pub(super) cidrs6: LpmTrie<MapData, Cidr6Data, u32>,
    pub(super) ports: HashMap<MapData, PortKey, u8>,
    pub(super) ifaces: HashMap<MapData, IfaceKey, u32>,
    index: Index,
}

fn take<T: TryFrom<aya::maps::Map>>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, EbpfError>
where
    T::Error: std::error::Error + Send + Sync + 'static,
{
    let map = ebpf.take_map(name).ok_or(EbpfError::Missing(name))?;
    T::try_from(map).map_err(|e| EbpfError::map(&format!("map {name}"), e))
}

impl Tables {
    /// Takes the per-pod maps out of the loaded object and indexes what they and the pins
    /// hold (an agent's restart, or the first open): one walk of each map, once.
    pub(super) fn open(ebpf: &mut Ebpf, pins: &Pins) -> Result<Self, EbpfError> {
        let mut tables = Self {
            pods: take(ebpf, maps::PODS)?,
            addrs: take(ebpf, maps::POD_ADDRS)?,
            cidrs4: take(ebpf, maps::CIDRS4)?,
            cidrs6: take(ebpf, maps::CIDRS6)?,
            ports: take(ebpf, maps::PORTS)?,
            ifaces: take(ebpf, maps::IFACES)?,
            index: Index::default(),
        };
        for (cookie, config) in tables.pods.iter().flatten() {
            tables.index.use_id(config.pod_id);
            tables.index.pod_ids.insert(cookie, config.pod_id);
        }
        for key in tables.ports.keys().flatten() {
            tables.index.lists_mut(key.pod_id).ports.push(key);
        }
        for key in tables.cidrs4.keys().flatten() {
            let id = u32::from_be_bytes(key.data().pod);
            tables.index.lists_mut(id).cidrs4.push(key);
        }
        for key in tables.cidrs6.keys().flatten() {
            let id = u32::from_be_bytes(key.data().pod);
            tables.index.lists_mut(id).cidrs6.push(key);
        }
        for (key, flags) in tables.ifaces.iter().flatten() {
            tables.index.add_iface(key.netns, key, flags);
        }
        for pinned in pins.pinned_pods() {
            tables.index.set_cookie(
                super::pins::record_name(&pinned.pod_ref()),
                pinned.netns_cookie,
            );
        }
        Ok(tables)
    }

    /// The netns cookie of the pod whose record name is `record`, as pinned.
    pub(super) fn cookie(&self, record: &str) -> Option<u64> {
        self.index.cookie(record)
    }

    /// Records that the pod pinned as `record` is netns `cookie`.
    pub(super) fn set_cookie(&mut self, record: String, cookie: u64) {
        self.index.set_cookie(record, cookie);
    }

    /// Forgets every pod pinned under netns `cookie`.
    pub(super) fn forget_cookie(&mut self, cookie: u64) {
        self.index.forget_cookie(cookie);
    }

    /// How many pods are pinned.
    pub(super) fn pod_count(&self) -> usize {
        self.index.pods()
    }

    /// A pod id no pod entry or list uses, now in use.
    pub(super) fn allocate_id(&mut self) -> u32 {
        self.index.allocate()
    }

    /// The pod id of netns `cookie`'s lists: its pod entry's, or, when the entry was removed
    /// behind meshcap's back, the one this agent recorded.
    pub(super) fn current_id(&self, cookie: u64) -> Option<u32> {
        self.pods
            .get(&cookie, 0)
            .ok()
            .map(|c| c.pod_id)
            .or_else(|| self.index.pod_ids.get(&cookie).copied())
    }

    /// Writes the pod's own addresses (before its pod entry: a redirected socket is bound to
    /// them from its first connection on).
    pub(super) fn set_addrs(&mut self, cookie: u64, addrs: PodAddrs) -> Result<(), EbpfError> {
        self.addrs
            .insert(cookie, addrs, 0)
            .map_err(|e| EbpfError::map("writing the pod's addresses", e))
    }

    /// Writes the pod entry of netns `cookie`: what makes the programs act on it.
    pub(super) fn set_pod(&mut self, cookie: u64, config: PodConfig) -> Result<(), EbpfError> {
        self.pods
            .insert(cookie, config, 0)
            .map_err(|e| EbpfError::map("writing the pod entry", e))?;
        self.index.pod_ids.insert(cookie, config.pod_id);
        Ok(())
    }

    /// Whether the pod map has an entry for `cookie`.
    pub(super) fn has_pod(&self, cookie: u64) -> bool {
        self.pods.get(&cookie, 0).is_ok()
    }

    /// Removes the pod entry of netns `cookie` and the lists of its pod id; the entry, if
    /// there was one. The lists go also when the entry was removed behind meshcap's back (by
    /// the id this agent recorded for the cookie).
    pub(super) fn remove_pod(&mut self, cookie: u64) -> Result<Option<PodConfig>, EbpfError> {
        let config = self.pods.get(&cookie, 0).ok();
        if config.is_some() {
            self.pods
                .remove(&cookie)
                .map_err(|e| EbpfError::map("removing the pod entry", e))?;
        }
        let _ = self.addrs.remove(&cookie);
        let recorded = self.index.pod_ids.remove(&cookie);
        if let Some(id) = config.map(|c| c.pod_id).or(recorded) {
            self.remove_lists(id);
        }
        Ok(config)
    }

    /// Removes what an agent stopped part-way through an ADD, an update or a DEL can leave
    /// that nothing refers to: lists under pod ids no pod entry uses (written before the pod
    /// entry, or left by an update before it removed the old ones), and interface entries and
    /// addresses of netns cookies with neither a pod entry nor pins (`pinned`). Call only when no request
    /// is in flight (at start). Returns how many entries went.
    pub(super) fn sweep_orphans(&mut self, pinned: &HashSet<u64>) -> usize {
        let used: HashSet<u32> = self.index.pod_ids.values().copied().collect();
        let ids: Vec<u32> = self
            .index
            .lists
            .keys()
            .copied()
            .filter(|id| !used.contains(id))
            .collect();
        let mut removed = 0;
        for id in ids {
            let lists = self.index.lists.get(&id).map_or(0, Lists::len);
            self.remove_lists(id);
            removed += lists;
        }
        let cookies: Vec<u64> = self
            .index
            .ifaces
            .keys()
            .copied()
            .filter(|c| !self.index.pod_ids.contains_key(c) && !pinned.contains(c))
            .collect();
        for cookie in cookies {
            removed += self.index.ifaces.get(&cookie).map_or(0, Vec::len);
            self.remove_ifaces(cookie);
        }
        let addrs: Vec<u64> = self
            .addrs
            .keys()
            .flatten()
            .filter(|c| !self.index.pod_ids.contains_key(c) && !pinned.contains(c))
            .collect();
        for cookie in addrs {
            if self.addrs.remove(&cookie).is_ok() {
                removed += 1;
            }
        }
        removed
    }

    /// Writes `entries`' lists under `pod_id`, recording every key written (also when a
    /// later one fails, so that [`Self::remove_lists`] takes them all back).
    pub(super) fn write_lists(&mut self, pod_id: u32, entries: &Entries) -> Result<(), EbpfError> {
        for (kind, port) in &entries.ports {
            let key = PortKey::new(pod_id, *kind, *port);
            self.ports
                .insert(key, 1, 0)
                .map_err(|e| EbpfError::map("writing a port list", e))?;
            self.index.lists_mut(pod_id).ports.push(key);
        }
        for (kind, addr, len, value) in &entries.cidrs {
            match cidr_key(pod_id, *kind, *addr, *len) {
                CidrKey::V4(key) => {
                    self.cidrs4
                        .insert(&key, *value, 0)
                        .map_err(|e| EbpfError::map("writing a CIDR list", e))?;
                    self.index.lists_mut(pod_id).cidrs4.push(key);
                }
                CidrKey::V6(key) => {
                    self.cidrs6
                        .insert(&key, *value, 0)
                        .map_err(|e| EbpfError::map("writing a CIDR list", e))?;
                    self.index.lists_mut(pod_id).cidrs6.push(key);
                }
            }
        }
        Ok(())
    }

    /// What differs between the lists `pod_id` holds and those `entries` (encoded from a
    /// policy) say it should: the port lists and the include and exclude CIDR lists (the
    /// pod's own addresses and routes are the netns's, not the policy's), each entry looked up in
    /// its map, so that one deleted behind meshcap's back counts. `None` when they agree.
    pub(super) fn lists_differ(&self, pod_id: u32, entries: &Entries) -> Option<String> {
        let empty = Lists::default();
        let held = self.index.lists.get(&pod_id).unwrap_or(&empty);
        let want: HashSet<PortKey> = entries
            .ports
            .iter()
            .map(|(kind, port)| PortKey::new(pod_id, *kind, *port))
            .collect();
        let have: HashSet<PortKey> = held.ports.iter().copied().collect();
        if want != have || want.iter().any(|key| self.ports.get(key, 0).is_err()) {
            return Some(format!(
                "its port lists differ from the policy's ({} entries held, {} wanted)",
                have.len(),
                want.len()
            ));
        }
        let from_policy = |kind: [u8; 4]| {
            let kind = u32::from_be_bytes(kind);
            kind == CidrKind::ExcludeOutbound as u32
                || kind == CidrKind::IncludeOutbound as u32
                || kind == CidrKind::ProbeSource as u32
        };
        let (mut want4, mut want6) = (HashSet::new(), HashSet::new());
        for (kind, addr, len, _) in &entries.cidrs {
            if !from_policy((*kind as u32).to_be_bytes()) {
                continue;
            }
            match cidr_key(pod_id, *kind, *addr, *len) {
                CidrKey::V4(key) => want4.insert((key.prefix_len(), key.data())),
                CidrKey::V6(key) => want6.insert((key.prefix_len(), key.data())),
            };
        }
        let have4: HashSet<_> = held
            .cidrs4
            .iter()
            .map(|k| (k.prefix_len(), k.data()))
            .filter(|(_, d)| from_policy(d.kind))
            .collect();
        let have6: HashSet<_> = held
            .cidrs6
            .iter()
            .map(|k| (k.prefix_len(), k.data()))
            .filter(|(_, d)| from_policy(d.kind))
            .collect();
        let missing4 = want4
            .iter()
            .any(|(len, data)| self.cidrs4.get(&Key::new(*len, *data), 0).is_err());
        let missing6 = want6
            .iter()
            .any(|(len, data)| self.cidrs6.get(&Key::new(*len, *data), 0).is_err());
        (want4 != have4 || want6 != have6 || missing4 || missing6).then(|| {
            format!(
                "its CIDR lists differ from the policy's ({} entries held, {} wanted)",
                have4.len() + have6.len(),
                want4.len() + want6.len()
            )
        })
    }

    /// Removes the lists written under `pod_id` and frees the id.
    pub(super) fn remove_lists(&mut self, pod_id: u32) {
        let lists = self.index.release(pod_id);
        for key in &lists.ports {
            let _ = self.ports.remove(key);
        }
        for key in &lists.cidrs4 {
            let _ = self.cidrs4.remove(key);
        }
        for key in &lists.cidrs6 {
            let _ = self.cidrs6.remove(key);
        }
    }

    /// Replaces the interface entries of the pod with netns `cookie` by those `entries` has
    /// for `net`'s interfaces.
    pub(super) fn write_ifaces(
        &mut self,
        cookie: u64,
        net: &PodNet,
        entries: &Entries,
    ) -> Result<(), EbpfError> {
        self.remove_ifaces(cookie);
        for (ifindex, name) in &net.interfaces {
            if let Some((_, flags)) = entries.ifaces.iter().find(|(n, _)| n == name) {
                let key = IfaceKey {
                    netns: cookie,
                    ifindex: *ifindex,
                    pad: 0,
                };
                self.ifaces
                    .insert(key, *flags, 0)
                    .map_err(|e| EbpfError::map("writing interface flags", e))?;
                self.index.add_iface(cookie, key, *flags);
            }
        }
        Ok(())
    }

    /// Removes the interface entries of the pod with netns `cookie`; whether one of them
    /// was rerouted.
    pub(super) fn remove_ifaces(&mut self, cookie: u64) -> bool {
        let mut rerouted = false;
        for (key, flags) in self.index.take_ifaces(cookie) {
            rerouted |= flags & iface_flags::REROUTE != 0;
            let _ = self.ifaces.remove(&key);
        }
        rerouted
    }
}

/// The list entries written under one pod id.
#[derive(Default)]
struct Lists {
    /// `MESHCAP_PORTS` keys.
    ports: Vec<PortKey>,
    /// `MESHCAP_CIDRS4` keys.
    cidrs4: Vec<Key<Cidr4Data>>,
    /// `MESHCAP_CIDRS6` keys.
    cidrs6: Vec<Key<Cidr6Data>>,
}

/// The in-memory index of the per-pod maps (see the module documentation).
#[derive(Default)]
struct Index {
    /// By pod id.
    lists: StdHashMap<u32, Lists>,
    /// `MESHCAP_IFACES` keys and their flags, by netns cookie.
    ifaces: StdHashMap<u64, Vec<(IfaceKey, u32)>>,
    /// Pod ids a pod entry or a list uses.
    ids: HashSet<u32>,
    /// The last pod id handed out: ids go round rather than being reused at once, so a
    /// program that read a pod's old configuration never meets another pod's lists under it.
    cursor: u32,
    /// Netns cookie by pin name of the pod (`pod@<namespace>@<name>@<container>`).
    cookies: StdHashMap<String, u64>,
    /// The pod id of each netns cookie's pod entry.
    pod_ids: StdHashMap<u64, u32>,
}

impl Lists {
    fn len(&self) -> usize {
        self.ports.len() + self.cidrs4.len() + self.cidrs6.len()
    }
}

impl Index {
    /// Records that pod id `id` is in use (a pod entry references it).
    fn use_id(&mut self, id: u32) {
        self.ids.insert(id);
        self.cursor = self.cursor.max(id);
    }

    /// A pod id no pod entry or list uses, now in use.
    fn allocate(&mut self) -> u32 {
        loop {
            self.cursor = self.cursor.wrapping_add(1).max(1);
            if self.ids.insert(self.cursor) {
                return self.cursor;
            }
        }
    }

    /// The lists of pod id `id`, to record keys as they are written.
    fn lists_mut(&mut self, id: u32) -> &mut Lists {
        self.use_id(id);
        self.lists.entry(id).or_default()
    }

    /// Forgets pod id `id` (free again) and returns its list keys, to delete.
    fn release(&mut self, id: u32) -> Lists {
        self.ids.remove(&id);
        self.lists.remove(&id).unwrap_or_default()
    }

    /// Records an interface entry of the pod with netns `cookie`.
    fn add_iface(&mut self, cookie: u64, key: IfaceKey, flags: u32) {
        self.ifaces.entry(cookie).or_default().push((key, flags));
    }

    /// Forgets the interface entries of `cookie` and returns them, to delete.
    fn take_ifaces(&mut self, cookie: u64) -> Vec<(IfaceKey, u32)> {
        self.ifaces.remove(&cookie).unwrap_or_default()
    }

    /// The netns cookie of the pod pinned as `meta`.
    fn cookie(&self, meta: &str) -> Option<u64> {
        self.cookies.get(meta).copied()
    }

    /// Records that the pod pinned as `meta` is netns `cookie`.
    fn set_cookie(&mut self, meta: String, cookie: u64) {
        self.cookies.insert(meta, cookie);
    }

    /// Forgets every pod pinned under netns `cookie` (a DEL finds the pod by its netns when
    /// its pins name another container).
    fn forget_cookie(&mut self, cookie: u64) {
        self.cookies.retain(|_, c| *c != cookie);
    }

    /// How many pods are pinned.
    fn pods(&self) -> usize {
        self.cookies.len()
    }
}

#[cfg(test)]
mod tests;
