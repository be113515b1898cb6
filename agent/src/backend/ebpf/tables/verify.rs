//! A pod's map entries compared with what [`Tables`] wrote (or adopted at start), and put back.
//!
//! Which keys each map holds is learnt from one walk of every per-pod map per verification pass
//! ([`Snapshot`]): the LPM tries answer a lookup with the longest matching prefix, so only a walk
//! says whether one exact key is there, and the same walk finds keys under a pod's id that
//! meshcap never wrote (an exclude range added behind its back is a bypass). Values are then
//! read one key at a time. What is put back is written over what is there (each update atomic),
//! lists first and the pod entry last, as an ADD commits; keys meshcap never wrote are deleted.
use std::collections::{HashMap as StdHashMap, HashSet};

use aya::maps::lpm_trie::Key;
use meshcap_common::{Cidr4Data, Cidr6Data, IfaceKey, PodConfig, PortKey};

use super::{EbpfError, Lists, Tables};

/// Which keys the per-pod maps held at one walk, by pod id (or netns cookie), with the pod
/// entries the index held then: a pod captured or updated since has another entry, and is
/// judged on the next walk.
#[derive(Default)]
pub(in crate::backend::ebpf) struct Snapshot {
    configs: StdHashMap<u64, PodConfig>,
    ports: StdHashMap<u32, HashSet<PortKey>>,
    cidrs4: StdHashMap<u32, HashSet<(u32, Cidr4Data)>>,
    cidrs6: StdHashMap<u32, HashSet<(u32, Cidr6Data)>>,
    ifaces: StdHashMap<u64, HashSet<IfaceKey>>,
}

/// What differs in one pod's entries.
#[derive(Debug, Default, PartialEq, Eq)]
pub(in crate::backend::ebpf) struct EntriesDrift {
    /// Each difference, in words.
    pub(in crate::backend::ebpf) what: Vec<String>,
}

impl Tables {
    /// Walks every per-pod map once: which keys each pod id (and netns cookie) holds.
    pub(in crate::backend::ebpf) fn snapshot(&self) -> Snapshot {
        let mut snapshot = Snapshot {
            configs: self.index.configs.clone(),
            ..Snapshot::default()
        };
        for key in self.ports.keys().flatten() {
            snapshot.ports.entry(key.pod_id).or_default().insert(key);
        }
        for key in self.cidrs4.keys().flatten() {
            let data = key.data();
            snapshot
                .cidrs4
                .entry(u32::from_be_bytes(data.pod))
                .or_default()
                .insert((key.prefix_len(), data));
        }
        for key in self.cidrs6.keys().flatten() {
            let data = key.data();
            snapshot
                .cidrs6
                .entry(u32::from_be_bytes(data.pod))
                .or_default()
                .insert((key.prefix_len(), data));
        }
        for key in self.ifaces.keys().flatten() {
            snapshot.ifaces.entry(key.netns).or_default().insert(key);
        }
        snapshot
    }

    /// What of netns `cookie`'s entries differs from what was written, as `snapshot` and the
    /// maps now say. `None` when the index holds no entry for the cookie, or another one than
    /// at the walk (captured or updated since: judged on the next walk).
    pub(in crate::backend::ebpf) fn entries_drift(
        &self,
        cookie: u64,
        snapshot: &Snapshot,
    ) -> Option<EntriesDrift> {
        let want = *self.index.configs.get(&cookie)?;
        if snapshot.configs.get(&cookie) != Some(&want) {
            return None;
        }
        let mut drift = EntriesDrift::default();
        let mut note = |what: String| drift.what.push(what);
        match self.pods.get(&cookie, 0) {
            Ok(have) if have == want => {}
            Ok(have) => note(format!("its MESHCAP_PODS entry is {have:?}, not {want:?}")),
            Err(_) => note("its MESHCAP_PODS entry is gone".to_owned()),
        }
        if let Some(want) = self.index.addrs.get(&cookie) {
            match self.addrs.get(&cookie, 0) {
                Ok(have) if have == *want => {}
                Ok(_) => note("its MESHCAP_POD_ADDRS entry changed".to_owned()),
                Err(_) => note("its MESHCAP_POD_ADDRS entry is gone".to_owned()),
            }
        }
        let empty = Lists::default();
        let lists = self.index.lists.get(&want.pod_id).unwrap_or(&empty);
        let (missing, changed, strays) = compare(
            lists.ports.iter().map(|key| (*key, 1u8)),
            snapshot.ports.get(&want.pod_id),
            |key| self.ports.get(key, 0).ok(),
        );
        describe(&mut note, "MESHCAP_PORTS", missing, changed, strays);
        let (missing, changed, strays) = compare(
            lists
                .cidrs4
                .iter()
                .map(|(key, value)| ((key.prefix_len(), key.data()), *value)),
            snapshot.cidrs4.get(&want.pod_id),
            |(len, data)| self.cidrs4.get(&Key::new(*len, *data), 0).ok(),
        );
        describe(&mut note, "MESHCAP_CIDRS4", missing, changed, strays);
        let (missing, changed, strays) = compare(
            lists
                .cidrs6
                .iter()
                .map(|(key, value)| ((key.prefix_len(), key.data()), *value)),
            snapshot.cidrs6.get(&want.pod_id),
            |(len, data)| self.cidrs6.get(&Key::new(*len, *data), 0).ok(),
        );
        describe(&mut note, "MESHCAP_CIDRS6", missing, changed, strays);
        let ifaces = self.index.ifaces.get(&cookie).cloned().unwrap_or_default();
        let (missing, changed, strays) =
            compare(ifaces.into_iter(), snapshot.ifaces.get(&cookie), |key| {
                self.ifaces.get(key, 0).ok()
            });
        describe(&mut note, "MESHCAP_IFACES", missing, changed, strays);
        Some(drift)
    }

    /// Puts netns `cookie`'s entries back as written: every list entry (over what is there),
    /// keys under its pod id it never wrote deleted, then its interface entries and addresses,
    /// and last its pod entry, which makes the programs act on the lists.
    ///
    /// # Errors
    /// When a map refuses a write (full).
    pub(in crate::backend::ebpf) fn restore_entries(
        &mut self,
        cookie: u64,
        snapshot: &Snapshot,
    ) -> Result<(), EbpfError> {
        let Some(config) = self.index.configs.get(&cookie).copied() else {
            return Ok(());
        };
        let empty = Lists::default();
        let lists = self.index.lists.get(&config.pod_id).unwrap_or(&empty);
        for key in &lists.ports {
            self.ports
                .insert(*key, 1, 0)
                .map_err(|e| EbpfError::map("putting back a port entry", e))?;
        }
        for (key, value) in &lists.cidrs4 {
            self.cidrs4
                .insert(key, *value, 0)
                .map_err(|e| EbpfError::map("putting back a CIDR entry", e))?;
        }
        for (key, value) in &lists.cidrs6 {
            self.cidrs6
                .insert(key, *value, 0)
                .map_err(|e| EbpfError::map("putting back a CIDR entry", e))?;
        }
        let own: HashSet<PortKey> = lists.ports.iter().copied().collect();
        for key in snapshot.ports.get(&config.pod_id).into_iter().flatten() {
            if !own.contains(key) {
                let _ = self.ports.remove(key);
            }
        }
        let own4: HashSet<(u32, Cidr4Data)> = lists
            .cidrs4
            .iter()
            .map(|(key, _)| (key.prefix_len(), key.data()))
            .collect();
        for (len, data) in snapshot.cidrs4.get(&config.pod_id).into_iter().flatten() {
            if !own4.contains(&(*len, *data)) {
                let _ = self.cidrs4.remove(&Key::new(*len, *data));
            }
        }
        let own6: HashSet<(u32, Cidr6Data)> = lists
            .cidrs6
            .iter()
            .map(|(key, _)| (key.prefix_len(), key.data()))
            .collect();
        for (len, data) in snapshot.cidrs6.get(&config.pod_id).into_iter().flatten() {
            if !own6.contains(&(*len, *data)) {
                let _ = self.cidrs6.remove(&Key::new(*len, *data));
            }
        }
        let ifaces = self.index.ifaces.get(&cookie).cloned().unwrap_or_default();
        for (key, flags) in &ifaces {
            self.ifaces
                .insert(*key, *flags, 0)
                .map_err(|e| EbpfError::map("putting back an interface entry", e))?;
        }
        for key in snapshot.ifaces.get(&cookie).into_iter().flatten() {
            if !ifaces.iter().any(|(own, _)| own == key) {
                let _ = self.ifaces.remove(key);
            }
        }
        if let Some(addrs) = self.index.addrs.get(&cookie).copied() {
            self.addrs
                .insert(cookie, addrs, 0)
                .map_err(|e| EbpfError::map("putting back the pod's addresses", e))?;
        }
        self.pods
            .insert(cookie, config, 0)
            .map_err(|e| EbpfError::map("putting back the pod entry", e))
    }

    /// The pod entry written (or adopted) for netns `cookie`.
    pub(in crate::backend::ebpf) fn recorded_config(&self, cookie: u64) -> Option<PodConfig> {
        self.index.configs.get(&cookie).copied()
    }

    /// The interface entries written (or adopted) for netns `cookie`: (ifindex, flags).
    pub(in crate::backend::ebpf) fn recorded_ifaces(&self, cookie: u64) -> Vec<(u32, u32)> {
        self.index
            .ifaces
            .get(&cookie)
            .into_iter()
            .flatten()
            .map(|(key, flags)| (key.ifindex, *flags))
            .collect()
    }

    /// How many list entries were written under `pod_id`: ports, IPv4 and IPv6 CIDRs.
    pub(in crate::backend::ebpf) fn recorded_lists(&self, pod_id: u32) -> (usize, usize, usize) {
        self.index.lists.get(&pod_id).map_or((0, 0, 0), |l| {
            (l.ports.len(), l.cidrs4.len(), l.cidrs6.len())
        })
    }
}

/// Keys `own` (with their values) has and `present` lacks, keys whose value `read` gives
/// otherwise, and keys `present` has that `own` lacks: (missing, changed, strays).
fn compare<K: Copy + Eq + std::hash::Hash, V: PartialEq>(
    own: impl Iterator<Item = (K, V)>,
    present: Option<&HashSet<K>>,
    read: impl Fn(&K) -> Option<V>,
) -> (usize, usize, usize) {
    let empty = HashSet::new();
    let present = present.unwrap_or(&empty);
    let (mut missing, mut changed) = (0, 0);
    let mut seen = HashSet::new();
    for (key, value) in own {
        seen.insert(key);
        if !present.contains(&key) {
            missing += 1;
        } else if read(&key).is_none_or(|have| have != value) {
            changed += 1;
        }
    }
    let strays = present.iter().filter(|key| !seen.contains(*key)).count();
    (missing, changed, strays)
}

fn describe(
    note: &mut impl FnMut(String),
    map: &str,
    missing: usize,
    changed: usize,
    strays: usize,
) {
    if missing > 0 {
        note(format!("{missing} of its {map} entries are gone"));
    }
    if changed > 0 {
        note(format!("{changed} of its {map} entries changed"));
    }
    if strays > 0 {
        note(format!(
            "{strays} {map} entries under its id were not written by meshcap"
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_changed_and_stray_keys_are_told_apart() {
        let present: HashSet<u32> = [1, 2, 4].into_iter().collect();
        let values = |key: &u32| Some(if *key == 2 { 9 } else { 1 });
        assert_eq!(
            compare([(1, 1), (2, 1), (3, 1)].into_iter(), Some(&present), values),
            (1, 1, 1)
        );
        assert_eq!(
            compare(std::iter::empty::<(u32, u8)>(), None, |_| None),
            (0, 0, 0)
        );
        let mut said = Vec::new();
        describe(&mut |w| said.push(w), "MESHCAP_PORTS", 1, 0, 2);
        assert_eq!(
            said,
            [
                "1 of its MESHCAP_PORTS entries are gone",
                "2 MESHCAP_PORTS entries under its id were not written by meshcap"
            ]
        );
    }
}
