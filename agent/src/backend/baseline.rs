//! What the verifier last found whole in a pod's tables ([`Baseline`]), for both rules
//! backends, kept in memory and in `<state dir>/<backend>-baselines/<record id>.json`, so that a
//! restarted agent's first pass costs what a steady one does: one netlink request per pod while
//! its nf_tables generation is unchanged (nft iptables, native nftables); with legacy iptables
//! its tables read from the kernel in process, per family — instead of CHECK's whole
//! comparison for every pod (a `-C` fork per iptables rule, an `nft list` per table).
//!
//! What a baseline proves: the tables held the rules recorded then (hashed with it), and they
//! are unchanged since: the namespace's nf_tables generation is the same (the kernel counts
//! every committed change), or the tables say what they said then (`iptables-save`, or the
//! legacy tables' entries). A baseline lost, unread or of another build (the hash is the
//! standard library's, not promised stable across Rust releases) only costs one full
//! comparison.
//!
//! Every baseline proves the same of any pod: tables that say exactly what one pod's said when
//! the same rules were found whole there hold those rules too ([`Baselines::whole_elsewhere`]).
//! Pods captured alike have alike tables, so a pod with no baseline of its own (a start with
//! none kept, an adoption) is compared in full only when no pod like it was: one full
//! comparison per kind of pod, not one per pod.
use std::{
    collections::HashMap,
    fs,
    hash::{DefaultHasher, Hash, Hasher},
    path::{Path, PathBuf},
    sync::{Mutex, PoisonError},
};

use serde::{Deserialize, Serialize};
use tracing::debug;

/// A pod's tables as they were when its rules were last found whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Baseline {
    /// The rules found whole (hashed).
    rules: u64,
    /// The namespace's nf_tables generation then (with nf_tables only).
    generation: Option<u32>,
    /// What the tables said then, counters left out (hashed).
    saved: u64,
}

impl Baseline {
    /// `rules` found whole, at `generation`, in tables `saved` lists.
    pub(super) fn new(rules: &impl Serialize, generation: Option<u32>, saved: &impl Hash) -> Self {
        Self {
            rules: hash(&serde_json::to_string(rules).unwrap_or_default()),
            generation,
            saved: hash(saved),
        }
    }

    /// Whether it is of `rules` and the generation is still `generation`.
    pub(super) fn same_generation(&self, rules: &impl Serialize, generation: Option<u32>) -> bool {
        generation.is_some()
            && self.generation == generation
            && self.rules == Self::new(rules, None, &()).rules
    }

    /// Whether it is of `rules` and the tables' listing still says `saved`.
    pub(super) fn same_tables(&self, rules: &impl Serialize, saved: &impl Hash) -> bool {
        *self == Self::new(rules, self.generation, saved)
    }
}

fn hash(value: &impl Hash) -> u64 {
    let mut hasher = DefaultHasher::new();
    value.hash(&mut hasher);
    hasher.finish()
}

/// Every pod's baseline, by container id.
#[derive(Debug)]
pub(super) struct Baselines {
    dir: PathBuf,
    known: Mutex<HashMap<String, Baseline>>,
}

impl Baselines {
    /// The baselines an earlier agent's `backend` left under `state_dir` (none when
    /// unreadable: a full comparison each).
    pub(super) fn open(state_dir: &Path, backend: &str) -> Self {
        let dir = state_dir.join(format!("{backend}-baselines"));
        let mut known = HashMap::new();
        for entry in fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            let (Some(id), Ok(text)) = (path.file_stem().and_then(|s| s.to_str()), fs::read(&path))
            else {
                continue;
            };
            if let Ok(baseline) = serde_json::from_slice(&text) {
                known.insert(id.to_owned(), baseline);
            }
        }
        Self {
            dir,
            known: Mutex::new(known),
        }
    }

    /// The baseline of `id`.
    pub(super) fn get(&self, id: &str) -> Option<Baseline> {
        self.lock().get(id).copied()
    }

    /// Keeps `baseline` for `id`, and writes it when it changed (a failure only costs the next
    /// agent a full comparison).
    pub(super) fn set(&self, id: &str, baseline: Baseline) {
        if self.lock().insert(id.to_owned(), baseline) == Some(baseline) {
            return;
        }
        let path = self.path(id);
        let tmp = path.with_extension("json.tmp");
        let written = fs::create_dir_all(&self.dir)
            .and_then(|()| fs::write(&tmp, serde_json::to_vec(&baseline).unwrap_or_default()))
            .and_then(|()| fs::rename(&tmp, &path));
        if let Err(e) = written {
            debug!(path = %path.display(), error = %e, "writing the verifier's baseline");
        }
    }

    /// Forgets every baseline whose id `keep` refuses.
    pub(super) fn retain(&self, keep: impl Fn(&str) -> bool) {
        let gone: Vec<String> = {
            let mut known = self.lock();
            let gone = known.keys().filter(|id| !keep(id)).cloned().collect();
            known.retain(|id, _| keep(id));
            gone
        };
        for id in gone {
            let _ = fs::remove_file(self.path(&id));
        }
    }

    /// Whether the tables `saved` lists are what some pod's said when the same `rules` were
    /// found whole there, so that they hold those rules too.
    pub(super) fn whole_elsewhere(&self, rules: &impl Serialize, saved: &impl Hash) -> bool {
        let probe = Baseline::new(rules, None, saved);
        self.lock()
            .values()
            .any(|b| b.rules == probe.rules && b.saved == probe.saved)
    }

    /// How many it keeps.
    pub(super) fn count(&self) -> usize {
        self.lock().len()
    }

    fn path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.json"))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Baseline>> {
        self.known.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use meshcap_policy::{IptablesRules, PolicyRoutes};

    use super::*;

    fn rules(v4: &str) -> IptablesRules {
        IptablesRules {
            v4: v4.to_owned(),
            v6: None,
            routes: PolicyRoutes::default(),
        }
    }

    #[test]
    fn a_baseline_holds_only_for_its_rules_and_its_tables() {
        let (a, b) = (rules("*nat\n-A OUTPUT -j ISTIO_OUTPUT\n"), rules("*nat\n"));
        let saved = vec!["*nat\n:ISTIO_OUTPUT -\n".to_owned()];
        let baseline = Baseline::new(&a, Some(7), &saved);
        assert!(baseline.same_generation(&a, Some(7)));
        assert!(!baseline.same_generation(&a, Some(8)), "the tables changed");
        assert!(
            !baseline.same_generation(&a, None),
            "no generation to compare"
        );
        assert!(!baseline.same_generation(&b, Some(7)), "other rules");
        assert!(baseline.same_tables(&a, &saved));
        assert!(
            !baseline.same_tables(&a, &["*nat\n".to_owned()]),
            "other tables"
        );
        assert!(!baseline.same_tables(&b, &saved), "other rules");
    }

    #[test]
    fn tables_like_a_whole_pods_with_the_same_rules_are_whole() {
        let dir = std::env::temp_dir().join(format!("meshcap-elsewhere-{}", std::process::id()));
        let (a, b) = (rules("*nat\n-A OUTPUT -j ISTIO_OUTPUT\n"), rules("*nat\n"));
        let whole = vec!["*nat\n:ISTIO_OUTPUT -\n-A OUTPUT -j ISTIO_OUTPUT\n".to_owned()];
        let baselines = Baselines::open(&dir, "iptables");
        assert!(
            !baselines.whole_elsewhere(&a, &whole),
            "no pod found whole yet"
        );
        baselines.set("pod-1", Baseline::new(&a, Some(4), &whole));
        assert!(baselines.whole_elsewhere(&a, &whole));
        assert!(
            !baselines.whole_elsewhere(&a, &vec!["*nat\n:ISTIO_OUTPUT -\n".to_owned()]),
            "other tables"
        );
        assert!(!baselines.whole_elsewhere(&b, &whole), "other rules");
        baselines.retain(|_| false);
        assert!(!baselines.whole_elsewhere(&a, &whole), "that pod is gone");
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn baselines_outlive_the_agent_and_go_with_their_pods() {
        let dir = std::env::temp_dir().join(format!("meshcap-baselines-{}", std::process::id()));
        let baseline = Baseline::new(&rules("*nat\n"), Some(3), &());
        let first = Baselines::open(&dir, "iptables");
        first.set("kept", baseline);
        first.set("gone", baseline);
        first.retain(|id| id == "kept");
        let next = Baselines::open(&dir, "iptables");
        assert_eq!(next.get("kept"), Some(baseline));
        assert_eq!(next.get("gone"), None);
        assert_eq!(next.count(), 1);
        fs::remove_dir_all(&dir).expect("clean up");
    }
}
