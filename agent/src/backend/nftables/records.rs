//! The nftables backend's record of a pod ([`Applied`]), kept by the rules backends' record
//! store ([`crate::backend::records`]) in `<state dir>/nftables/<container id>.json`: the
//! transaction and routes, the rule sets whose tables an unfinished ADD or update may have left
//! besides them, and the tables' listing once applied (what CHECK and the verifier compare
//! with).
use meshcap_policy::{Family, InterceptionMode, PolicyRoutes};
use serde::{Deserialize, Serialize};

use super::NftablesRules;
use crate::{backend::records::Record, crashpoint, pod::PodRef};

/// What was applied to a pod: the record, written before the transaction runs.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct Applied {
    pub(super) pod: PodRef,
    /// The rules the pod's capture consists of.
    pub(super) rules: NftablesRules,
    /// Rule sets whose tables may still be in the netns besides `rules`' (an update or an ADD
    /// that has not finished; empty once it has).
    #[serde(default)]
    pub(super) replacing: Vec<NftablesRules>,
    /// The tables as the kernel listed them (`nft -s list table`) once the rules were in
    /// place: what CHECK and the verifier compare with. Empty until then.
    #[serde(default)]
    pub(super) listing: String,
    pub(super) mode: InterceptionMode,
    /// Ambient mode's in-pod rules (ztunnel's), not a sidecar's.
    pub(super) ambient: bool,
    /// The families whose policy route the netns held before this capture (istio-cni's):
    /// left in place whatever becomes of the capture.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(super) found_routes: Vec<Family>,
    /// Adopted: written by istio-cni, found in the pod's netns as they are.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(super) adopted: bool,
}

impl Applied {
    /// `routes` as this capture owns them: without those it found in place.
    pub(super) fn owned(&self, routes: &PolicyRoutes) -> PolicyRoutes {
        routes.without_found(&self.found_routes)
    }
}

impl Record for Applied {
    const BACKEND: &'static str = "nftables";
    const RECORD_WRITTEN: &'static str = crashpoint::NFTABLES_ADD_RECORD_WRITTEN;
    const REMOVED: &'static str = crashpoint::NFTABLES_REMOVE_REMOVED;
    type Rules = NftablesRules;

    fn pod(&self) -> &PodRef {
        &self.pod
    }

    fn rules(&self) -> &NftablesRules {
        &self.rules
    }

    fn replacing(&self) -> &[NftablesRules] {
        &self.replacing
    }

    fn mode(&self) -> InterceptionMode {
        self.mode
    }

    fn ambient(&self) -> bool {
        self.ambient
    }

    fn found_routes_mut(&mut self) -> &mut Vec<Family> {
        &mut self.found_routes
    }

    fn via(&self) -> String {
        let adopted = if self.adopted {
            ", adopted from istio-cni"
        } else {
            ""
        };
        format!("nft ({}){adopted}", self.rules.tables().join(", "))
    }

    fn adopted(&self) -> bool {
        self.adopted
    }
}

#[cfg(test)]
mod tests {
    use meshcap_policy::DataplaneMode;

    use super::*;
    use crate::backend::records::Records;

    /// A record as the agent has written it since the nftables backend recorded the tables'
    /// listing (main `cee8836`), byte for byte: an ambient pod's in-pod tables.
    const TODAY: &str = r#"{"pod":{"namespace":"default","name":"web","container_id":"c0ffee","netns":"/run/netns/web"},"rules":{"transaction":"add table inet istio-ambient-nat\nflush table inet istio-ambient-nat\n","routes":{"mark_route":{"mark":273,"mask":4095,"priority":32764,"table":100,"families":["v4","v6"]},"loopback_addresses":["::6/128"]}},"replacing":[],"listing":"table inet istio-ambient-nat {\n}\n","mode":"REDIRECT","ambient":true}"#;

    #[test]
    fn a_record_in_todays_format_is_adopted_and_written_the_same() {
        let dir = tempfile::tempdir().unwrap();
        let records = dir.path().join("nftables");
        std::fs::create_dir_all(&records).unwrap();
        // One complete, one interrupted between writing and renaming, one cut short.
        std::fs::write(records.join("c0ffee.json"), TODAY).unwrap();
        let tmp = TODAY.replace("c0ffee", "beef");
        std::fs::write(records.join("beef.json.tmp"), &tmp).unwrap();
        std::fs::write(records.join("cafe.json.tmp"), &TODAY[..40]).unwrap();

        let store = Records::<Applied>::open(dir.path()).unwrap();
        assert_eq!(store.count(), 2);
        let applied = store.get("c0ffee").unwrap();
        assert!(applied.ambient);
        assert_eq!(applied.rules.tables(), ["istio-ambient-nat"]);
        assert_eq!(applied.listing, "table inet istio-ambient-nat {\n}\n");
        assert_eq!(applied.via(), "nft (istio-ambient-nat)");
        assert_eq!(
            std::fs::read_to_string(records.join("beef.json")).unwrap(),
            tmp
        );
        assert!(!records.join("beef.json.tmp").exists());
        assert!(!records.join("cafe.json.tmp").exists());
        assert!(store.get("cafe").is_none());

        store.save(&applied).unwrap();
        assert_eq!(
            std::fs::read_to_string(records.join("c0ffee.json")).unwrap(),
            TODAY
        );
    }

    #[test]
    fn a_pod_is_found_by_its_netns_and_forgotten_on_disk() {
        let dir = tempfile::tempdir().unwrap();
        let records = dir.path().join("nftables");
        std::fs::create_dir_all(&records).unwrap();
        std::fs::write(records.join("c0ffee.json"), TODAY).unwrap();
        // Not a record: left alone, and not adopted.
        std::fs::write(records.join("junk.json"), "{").unwrap();

        let store = Records::<Applied>::open(dir.path()).unwrap();
        assert_eq!(store.count(), 1);
        assert_eq!(store.of_mode(DataplaneMode::Ambient).len(), 1);
        assert!(store.of_mode(DataplaneMode::Sidecar).is_empty());
        let in_place = PodRef {
            container_id: "meshcap-in-place".to_owned(),
            ..store.get("c0ffee").unwrap().pod
        };
        let (id, _) = store.recorded(&in_place).unwrap();
        assert_eq!(id, "c0ffee");

        // An update's temporary file goes with the record.
        std::fs::write(records.join("c0ffee.json.tmp"), TODAY).unwrap();
        store.forget(&id);
        assert_eq!(store.count(), 0);
        assert!(!records.join("c0ffee.json").exists());
        assert!(!records.join("c0ffee.json.tmp").exists());
        assert!(records.join("junk.json").exists());
    }
}
