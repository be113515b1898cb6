//! The probe sets and the node rule as Istio writes them with `global.nativeNftables`: sets
//! `istio-inpod-probes-v4`/`-v6` (`ipv4_addr`/`ipv6_addr`, each element the pod's uid as its
//! comment) inside table `inet istio-ambient-nat` of the node's network namespace
//! (`cni/pkg/nftables/host_sets.go`, `HostNftSetManager`), and the table's `postrouting`
//! chain SNAT-ing TCP from kubelet's uid to an address in them
//! (`cni/pkg/nftables/nftables.go`, `CreateHostRulesForHealthChecks`; rendered by
//! [`HostProbeSnat::render_nftables`]). Every change is one `nft -f` transaction: the sets and
//! the rule are set up together (the table flushed, which keeps the sets' elements, as
//! Istio's rule transaction does), and a pod's elements are added or removed together.
//!
//! Unlike iptables' `-m owner --socket-exists` (any local socket), the rule matches kubelet's
//! uid only: a connection from another local process to an enrolled pod is not SNAT-ed.
use std::{collections::BTreeMap, fmt::Write as _, net::IpAddr, path::PathBuf};

use meshcap_policy::{
    ambient::HostProbeSnat,
    hostprobe::{PROBE_SET_V4, PROBE_SET_V6},
    nftables::hostprobe::NODE_TABLE,
};

use super::{ProbeSets, failed};
use crate::{
    ambient::AmbientError,
    backend::{BackendError, nftables::nft::Nft},
    ipset::{Entry, Family},
    podnet,
};

/// The sets' comment (Istio's).
const SET_COMMENT: &str = "UUID of the pods that are part of ambient mesh";

/// The node's probe sets and rule in nftables.
pub(super) struct NftProbes {
    pub(super) netns: Option<PathBuf>,
    pub(super) ipv6: bool,
    pub(super) snat: HostProbeSnat,
    /// The uid the rule matches (kubelet's, found at start).
    pub(super) kubelet_uid: u32,
}

impl NftProbes {
    fn families(&self) -> impl Iterator<Item = Family> {
        [Family::V4]
            .into_iter()
            .chain(self.ipv6.then_some(Family::V6))
    }

    /// The elements of `family`'s set, none when it is not there.
    fn elements(nft: &Nft, family: Family) -> Result<Vec<Entry>, BackendError> {
        let set = set_name(family);
        let Some(json) = nft.list_set_json(NODE_TABLE, set)? else {
            return Ok(Vec::new());
        };
        parse_elements(&json).map_err(|reason| BackendError::Command {
            pod: nft.who.clone(),
            command: format!("nft -j list set inet {NODE_TABLE} {set}"),
            stderr: reason.to_string(),
        })
    }

    /// Every element of the sets, by address.
    fn held(&self, nft: &Nft) -> Result<BTreeMap<IpAddr, String>, BackendError> {
        let mut held = BTreeMap::new();
        for family in self.families() {
            held.extend(
                Self::elements(nft, family)?
                    .into_iter()
                    .map(|e| (e.ip, e.comment)),
            );
        }
        Ok(held)
    }

    /// One transaction: `adds` (address, uid) put in the sets, an element of another uid for
    /// one of them replaced, and every other element `doomed` picks deleted.
    fn change(
        &self,
        adds: &[(IpAddr, &str)],
        doomed: &(dyn Fn(&Entry) -> bool + Sync),
    ) -> Result<(), AmbientError> {
        self.run(|nft| {
            let held = self.held(nft)?;
            let mut tx = String::new();
            for (ip, uid) in adds {
                match held.get(ip) {
                    Some(comment) if comment == uid => continue,
                    Some(_) => element(&mut tx, "delete", *ip, None),
                    None => {}
                }
                element(&mut tx, "add", *ip, Some(uid));
            }
            for (ip, comment) in &held {
                let entry = Entry {
                    ip: *ip,
                    comment: comment.clone(),
                };
                if !adds.iter().any(|(a, _)| a == ip) && doomed(&entry) {
                    element(&mut tx, "delete", *ip, None);
                }
            }
            nft.apply(&tx)
        })
    }

    /// Runs `f` with `nft` in the node's network namespace.
    fn run<T: Send>(
        &self,
        f: impl FnOnce(&Nft) -> Result<T, BackendError> + Send,
    ) -> Result<T, AmbientError> {
        in_node(self.netns.as_deref(), f)
    }
}

impl ProbeSets for NftProbes {
    fn set_up(&self) -> Result<(), AmbientError> {
        let mut tx = format!("add table inet {NODE_TABLE}\n");
        for family in self.families() {
            let (set, kind) = match family {
                Family::V4 => (PROBE_SET_V4, "ipv4_addr"),
                Family::V6 => (PROBE_SET_V6, "ipv6_addr"),
            };
            let _ = writeln!(
                tx,
                "add set inet {NODE_TABLE} {set} {{ type {kind}; comment \"{SET_COMMENT}\"; }}"
            );
        }
        tx.push_str(&self.snat.render_nftables(self.ipv6, self.kubelet_uid));
        self.run(|nft| nft.apply(&tx))
    }

    fn not_in_place(&self) -> Result<Vec<String>, AmbientError> {
        let listing = self.run(|nft| nft.list(NODE_TABLE))?;
        let Some(listing) = listing else {
            return Ok(vec![format!(
                "table inet {NODE_TABLE} is gone from the node, with the probe sets and rule"
            )]);
        };
        let mut out = Vec::new();
        for family in self.families() {
            let set = set_name(family);
            if !listing.contains(&format!("set {set} {{")) {
                out.push(format!("nft set {set} is gone from the node"));
            }
            let uid = format!("skuid {}", self.kubelet_uid);
            let matched = listing.lines().any(|line| {
                line.contains(&uid)
                    && line.contains(&format!("daddr @{set} "))
                    && line.contains("snat")
            });
            if !matched {
                out.push(format!(
                    "no rule of table inet {NODE_TABLE} SNATs kubelet's (uid {}) probes to addresses in {set}",
                    self.kubelet_uid
                ));
            }
        }
        Ok(out)
    }

    fn missing(&self, ips: &[IpAddr]) -> Result<Vec<IpAddr>, AmbientError> {
        let wanted: Vec<IpAddr> = ips
            .iter()
            .copied()
            .filter(|ip| ip.is_ipv4() || self.ipv6)
            .collect();
        if wanted.is_empty() {
            return Ok(Vec::new());
        }
        let held = self.run(|nft| self.held(nft))?;
        Ok(wanted
            .into_iter()
            .filter(|ip| !held.contains_key(ip))
            .collect())
    }

    fn add(&self, uid: &str, ips: &[IpAddr]) -> Result<(), AmbientError> {
        check_comment(uid)?;
        let adds: Vec<(IpAddr, &str)> = ips
            .iter()
            .filter(|ip| ip.is_ipv4() || self.ipv6)
            .map(|ip| (*ip, uid))
            .collect();
        self.change(&adds, &|_| false)
    }

    fn remove(&self, uid: &str) -> Result<(), AmbientError> {
        self.change(&[], &|e| e.comment == uid)
    }

    fn sync(&self, pods: &[(String, Vec<IpAddr>)]) -> Result<(), AmbientError> {
        let mut adds = Vec::new();
        for (uid, ips) in pods {
            check_comment(uid)?;
            adds.extend(
                ips.iter()
                    .filter(|ip| ip.is_ipv4() || self.ipv6)
                    .map(|ip| (*ip, uid.as_str())),
            );
        }
        self.change(&adds, &|e| {
            tracing::info!(ip = %e.ip, uid = e.comment, "dropping a probe address no enrolled pod holds");
            true
        })?;
        if !self.ipv6 {
            // An earlier agent's IPv6 set (the setting on then): its rule went with the flush.
            self.run(|nft| {
                let left = Self::elements(nft, Family::V6)?;
                let mut tx = String::new();
                for entry in left {
                    tracing::info!(ip = %entry.ip, uid = entry.comment, "ambient.ipv6 is off: dropping an IPv6 probe address an earlier agent left");
                    element(&mut tx, "delete", entry.ip, None);
                }
                nft.apply(&tx)
            })?;
        }
        Ok(())
    }
}

/// Whether the node holds the nftables form (its table), in `netns`. A node without `nft`
/// holds none.
pub(super) fn present(netns: Option<&std::path::Path>) -> Result<bool, AmbientError> {
    in_node(netns, |nft| match nft.list(NODE_TABLE) {
        Ok(listing) => Ok(listing.is_some()),
        Err(BackendError::Command { stderr, .. }) if is_not_installed(&stderr) => Ok(false),
        Err(err) => Err(err),
    })
}

/// Uninstall, or the node moving to the ipset form: deletes the table, its sets and rule with
/// it, from `netns`; nothing when it is not there.
pub(super) fn remove_from_node(netns: Option<&std::path::Path>) -> Result<(), AmbientError> {
    if !present(netns)? {
        return Ok(());
    }
    in_node(netns, |nft| {
        nft.apply(&format!("delete table inet {NODE_TABLE}\n"))
    })
}

/// Whether `nft` could not be run at all (not installed).
fn is_not_installed(stderr: &str) -> bool {
    stderr.contains("No such file or directory (os error 2)")
}

fn in_node<T: Send>(
    netns: Option<&std::path::Path>,
    f: impl FnOnce(&Nft) -> Result<T, BackendError> + Send,
) -> Result<T, AmbientError> {
    let nft = Nft {
        who: "the node's network namespace".to_owned(),
    };
    let done = match netns {
        None => f(&nft),
        Some(netns) => podnet::run_in(netns, |_| f(&nft)).map_err(|e| {
            failed(
                format!("entering {}", netns.display()),
                &std::io::Error::other(e.to_string()),
            )
        })?,
    };
    done.map_err(|e| AmbientError::ProbeSet {
        what: format!("nft sets of table inet {NODE_TABLE}"),
        reason: e.to_string(),
    })
}

/// Writes one element statement of `ip`'s set to `tx`.
fn element(tx: &mut String, verb: &str, ip: IpAddr, comment: Option<&str>) {
    let set = set_name(Family::of(&ip));
    let comment = comment
        .map(|c| format!(" comment \"{c}\""))
        .unwrap_or_default();
    let _ = writeln!(
        tx,
        "{verb} element inet {NODE_TABLE} {set} {{ {ip}{comment} }}"
    );
}

/// A pod's uid goes into the transaction quoted: one that could end the quote is refused.
fn check_comment(uid: &str) -> Result<(), AmbientError> {
    if uid
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
    {
        Ok(())
    } else {
        Err(AmbientError::ProbeSet {
            what: format!("adding the addresses of the pod whose uid is {uid:?}"),
            reason:
                "a uid of other than letters, digits, '-', '_' and '.' cannot be an nft comment"
                    .into(),
        })
    }
}

const fn set_name(family: Family) -> &'static str {
    match family {
        Family::V4 => PROBE_SET_V4,
        Family::V6 => PROBE_SET_V6,
    }
}

/// Why `nft -j list set`'s output could not be read.
#[derive(Debug, thiserror::Error)]
enum ElementsError {
    /// It is not JSON.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    /// An element is not an address.
    #[error("an element that is not an address: {0}")]
    NotAnAddress(serde_json::Value),
}

/// The elements of the set in `nft -j list set`'s output: an address alone, or an object
/// with its comment.
fn parse_elements(json: &str) -> Result<Vec<Entry>, ElementsError> {
    let value: serde_json::Value = serde_json::from_str(json)?;
    let mut out = Vec::new();
    let sets = value["nftables"].as_array().into_iter().flatten();
    for elem in sets.filter_map(|o| o["set"]["elem"].as_array()).flatten() {
        let (ip, comment) = match elem {
            serde_json::Value::String(ip) => (ip.as_str(), ""),
            other => (
                other["elem"]["val"].as_str().unwrap_or_default(),
                other["elem"]["comment"].as_str().unwrap_or_default(),
            ),
        };
        let ip = ip
            .parse()
            .map_err(|_| ElementsError::NotAnAddress(elem.clone()))?;
        out.push(Entry {
            ip,
            comment: comment.to_owned(),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elements_are_read_with_their_comments() {
        let json = r#"{"nftables": [{"metainfo": {"version": "1.0.6"}}, {"set": {"family": "inet", "name": "istio-inpod-probes-v4", "table": "istio-ambient-nat", "type": "ipv4_addr", "handle": 1, "elem": [{"elem": {"val": "10.1.2.3", "comment": "uid-a"}}, "10.1.2.4"]}}]}"#;
        let entries = parse_elements(json).expect("parsed");
        assert_eq!(
            entries,
            [
                Entry {
                    ip: "10.1.2.3".parse().unwrap(),
                    comment: "uid-a".into()
                },
                Entry {
                    ip: "10.1.2.4".parse().unwrap(),
                    comment: String::new()
                },
            ]
        );
        let empty =
            r#"{"nftables": [{"set": {"name": "istio-inpod-probes-v6", "type": "ipv6_addr"}}]}"#;
        assert!(parse_elements(empty).expect("parsed").is_empty());
        let bad = r#"{"nftables": [{"set": {"elem": ["10.1.2"]}}]}"#;
        assert!(
            matches!(parse_elements(bad), Err(ElementsError::NotAnAddress(e)) if e == "10.1.2"),
            "an element that is not an address is named"
        );
        assert!(matches!(parse_elements("{"), Err(ElementsError::Json(_))));
    }

    #[test]
    fn a_uid_that_could_end_the_quote_is_refused() {
        assert!(check_comment("0b1c6f0e-6a2e-4b7c-9d3e-1f2a3b4c5d6e").is_ok());
        assert!(check_comment("a\" ; flush ruleset ; \"").is_err());
    }
}
