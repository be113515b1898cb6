//! The iptables backend's record of a pod ([`Applied`]), kept by the rules backends' record
//! store ([`crate::backend::records`]) in `<state dir>/iptables/<container id>.json`: the rules,
//! the rule sets an unfinished ADD or update may have left besides them, and the iptables they
//! were written with.
use meshcap_policy::{Family, InterceptionMode, IptablesRules};
use serde::{Deserialize, Serialize};

use super::Flavour;
use crate::{backend::records::Record, crashpoint, pod::PodRef};

/// What was applied to a pod: the record, written before the rules are applied.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct Applied {
    pub(super) pod: PodRef,
    pub(super) flavour: Flavour,
    /// The rules the pod's capture consists of.
    pub(super) rules: IptablesRules,
    /// Rule sets that may still be in the netns besides `rules`: those of an update or an ADD
    /// that has not finished (empty once it has).
    #[serde(default)]
    pub(super) replacing: Vec<IptablesRules>,
    pub(super) mode: InterceptionMode,
    /// Ambient mode's in-pod rules (ztunnel's), not a sidecar's.
    #[serde(default)]
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
    /// `rules` as this capture owns them: without the routes it found in place.
    pub(super) fn owned(&self, rules: &IptablesRules) -> IptablesRules {
        IptablesRules {
            routes: rules.routes.without_found(&self.found_routes),
            ..rules.clone()
        }
    }
}

impl Record for Applied {
    const BACKEND: &'static str = "iptables";
    const RECORD_WRITTEN: &'static str = crashpoint::IPTABLES_ADD_RECORD_WRITTEN;
    const REMOVED: &'static str = crashpoint::IPTABLES_REMOVE_REMOVED;
    type Rules = IptablesRules;

    fn pod(&self) -> &PodRef {
        &self.pod
    }

    fn rules(&self) -> &IptablesRules {
        &self.rules
    }

    fn replacing(&self) -> &[IptablesRules] {
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
        format!(
            "{}{}{}",
            self.flavour.binary(false, ""),
            if self.rules.family(Family::V6).is_some() {
                ", IPv4+IPv6"
            } else {
                ""
            },
            if self.adopted {
                ", adopted from istio-cni"
            } else {
                ""
            }
        )
    }

    fn adopted(&self) -> bool {
        self.adopted
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::records::Records;

    /// A record as the agent has written it since ambient mode's in-pod rules were recorded
    /// (main `cee8836`), byte for byte: a TPROXY pod in the middle of an update.
    const TODAY: &str = r#"{"pod":{"namespace":"default","name":"web","container_id":"c0ffee","netns":"/run/netns/web"},"flavour":"nft","rules":{"v4":"* nat\n-N ISTIO_INBOUND\nCOMMIT\n","v6":null,"routes":{"mark_route":{"mark":1337,"mask":null,"priority":null,"table":133,"families":["v4"]},"loopback_addresses":[]}},"replacing":[{"v4":"* nat\nCOMMIT\n","v6":"* nat\nCOMMIT\n","routes":{"mark_route":null,"loopback_addresses":["::6/128"]}}],"mode":"TPROXY","ambient":false}"#;

    #[test]
    fn a_record_in_todays_format_is_adopted_and_written_the_same() {
        let dir = tempfile::tempdir().unwrap();
        let records = dir.path().join("iptables");
        std::fs::create_dir_all(&records).unwrap();
        // One complete, one interrupted between writing and renaming.
        std::fs::write(records.join("c0ffee.json"), TODAY).unwrap();
        let tmp = TODAY.replace("c0ffee", "beef");
        std::fs::write(records.join("beef.json.tmp"), &tmp).unwrap();

        let store = Records::<Applied>::open(dir.path()).unwrap();
        assert_eq!(store.count(), 2);
        let applied = store.get("c0ffee").unwrap();
        assert_eq!(applied.pod.name, "web");
        assert_eq!(applied.flavour, Flavour::Nft);
        assert_eq!(applied.mode, InterceptionMode::Tproxy);
        assert_eq!(applied.rule_sets().count(), 2);
        assert_eq!(
            std::fs::read_to_string(records.join("beef.json")).unwrap(),
            tmp
        );
        assert!(!records.join("beef.json.tmp").exists());

        store.save(&applied).unwrap();
        assert_eq!(
            std::fs::read_to_string(records.join("c0ffee.json")).unwrap(),
            TODAY
        );
    }

    #[test]
    fn a_record_from_before_ambient_mode_reads_as_a_sidecars() {
        let old = TODAY.replace(r#","ambient":false"#, "");
        let applied: Applied = serde_json::from_str(&old).unwrap();
        assert!(!applied.ambient);
    }
}
