//! Kubelet's probes of enrolled pods, on the node's side, as Istio's node agent handles them
//! (`cni/pkg/nodeagent/meshdataplane_linux.go`, `CreateHostRulesForHealthChecks`): every
//! enrolled pod's addresses are in the `istio-inpod-probes-v4`/`-v6` sets of the node's
//! network namespace, each with the pod's uid as its comment, and a node rule SNATs kubelet's
//! TCP to an address in them to `169.254.7.127`, which the pod's in-pod rules let through to
//! the app uncaptured. Without it a probe would go through ztunnel like any inbound
//! connection, and fail once the mesh requires mTLS.
//!
//! Two forms, as in Istio, chosen by `global.nativeNftables` ([`ProbeWay`]): IP sets and an
//! iptables rule matching any local socket (`ipset`), or nftables sets in table
//! `inet istio-ambient-nat` and a rule matching kubelet's uid, found in the host's `/proc`
//! (`nft`, `super::kubelet`).
//!
//! A pod's entries are added once ztunnel serves it and before it is annotated, removed first
//! when it leaves; an entry is only removed by the pod whose uid it carries (two pods can hold
//! one address in turn). A starting agent creates the sets (kept when there), puts its node
//! rule in front (one copy), and makes the sets exactly its enrolled pods' addresses; only then
//! does it take the other form off the node, if an agent with the setting the other way left
//! it ([`HostProbes::retire_other`]), so that probes pass throughout. The sets and the rule stay
//! when the agent stops (probes keep working across restarts and upgrades) and go with an
//! uninstall ([`remove_from_node`]: both forms, whole).
mod ipset;
mod nft;

use std::{
    io,
    net::IpAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use meshcap_policy::ambient::HostProbeSnat;
use tracing::{info, warn};

use super::{AmbientError, kubelet};
use crate::backend::iptables::FlavourChoice;

/// How many times kubelet is looked for before ambient mode fails to start, and how long
/// apart: as Istio's node agent retries its host rules (`cni/pkg/nodeagent/server_linux.go`,
/// a constant back-off of 2 s, 10 retries), then gives up starting.
const KUBELET_ATTEMPTS: u32 = 11;
const KUBELET_RETRY: Duration = Duration::from_secs(2);

/// Which form the node's probe sets and rule take.
#[derive(Clone, Debug)]
pub enum ProbeWay {
    /// IP sets and an iptables rule (Istio without `global.nativeNftables`).
    Ipset,
    /// nftables sets and rule (`global.nativeNftables`), matching the uid of the kubelet
    /// found among the processes of `host_proc` (the host's `/proc`).
    Nftables {
        /// The host's `/proc`.
        host_proc: PathBuf,
    },
}

/// One form of the probe sets and their rule, in the node's network namespace.
trait ProbeSets: Send + Sync {
    /// Creates the sets (kept if there, with their entries) and puts the node rule in front
    /// (one copy).
    fn set_up(&self) -> Result<(), AmbientError>;
    /// What of the sets and their rule is not in place, in words.
    fn not_in_place(&self) -> Result<Vec<String>, AmbientError>;
    /// Which of `ips` the sets do not hold (of the addresses they take).
    fn missing(&self, ips: &[IpAddr]) -> Result<Vec<IpAddr>, AmbientError>;
    /// Puts `ips` in the sets with `uid` as their comment (an entry already there for an
    /// address takes it).
    fn add(&self, uid: &str, ips: &[IpAddr]) -> Result<(), AmbientError>;
    /// Removes every entry that carries `uid`.
    fn remove(&self, uid: &str) -> Result<(), AmbientError>;
    /// Makes the sets exactly `pods`' addresses, as (uid, addresses).
    fn sync(&self, pods: &[(String, Vec<IpAddr>)]) -> Result<(), AmbientError>;
}

/// The node's probe sets and rule.
pub struct HostProbes {
    netns: Option<PathBuf>,
    /// Which iptables the ipset form's rule is written with, and where it SNATs to (also to
    /// take it off the node).
    flavour: FlavourChoice,
    snat: HostProbeSnat,
    nftables: bool,
    sets: Box<dyn ProbeSets>,
}

impl HostProbes {
    /// Creates the sets (kept if there) and puts the node rule SNAT-ing probes to `snat` in
    /// front, in `netns` (`None`: the agent's own), in the form `way` says; for nftables,
    /// kubelet's uid is found first.
    ///
    /// # Errors
    /// When kubelet cannot be found (after Istio's retries), or the sets or the rule cannot
    /// be set up.
    pub fn open(
        netns: Option<PathBuf>,
        way: ProbeWay,
        flavour: FlavourChoice,
        snat: HostProbeSnat,
        ipv6: bool,
    ) -> Result<Self, AmbientError> {
        let (sets, how): (Box<dyn ProbeSets>, String) = match &way {
            ProbeWay::Ipset => (
                Box::new(ipset::IpsetProbes {
                    netns: netns.clone(),
                    ipv6,
                    flavour,
                    snat,
                }),
                "IP sets and an iptables rule".into(),
            ),
            ProbeWay::Nftables { host_proc } => {
                let kubelet_uid = find_kubelet(host_proc)?;
                (
                    Box::new(nft::NftProbes {
                        netns: netns.clone(),
                        ipv6,
                        snat,
                        kubelet_uid,
                    }),
                    format!("nftables sets and a rule matching kubelet's uid {kubelet_uid}"),
                )
            }
        };
        let probes = Self {
            netns,
            flavour,
            snat,
            nftables: matches!(way, ProbeWay::Nftables { .. }),
            sets,
        };
        probes.set_up()?;
        info!(
            netns = %probes.netns.as_deref().map_or("the agent's".into(), |p| p.display().to_string()),
            "kubelet's probes of enrolled pods are SNAT-ed to {} on the node, with {how}", snat.v4
        );
        Ok(probes)
    }

    /// Creates the sets (kept if there) and puts the node rule in front (one copy).
    ///
    /// # Errors
    /// When the sets or the rule cannot be set up.
    pub fn set_up(&self) -> Result<(), AmbientError> {
        self.sets.set_up()
    }

    /// What of the sets and their rule is not in place, in words: a set that is gone, or one
    /// that no rule matches (the node rule deleted, its chain flushed).
    ///
    /// # Errors
    /// When the sets cannot be asked.
    pub fn not_in_place(&self) -> Result<Vec<String>, AmbientError> {
        self.sets.not_in_place()
    }

    /// Which of `ips` the sets do not hold (the addresses the sets take: IPv6 only with
    /// `ambient.ipv6`).
    ///
    /// # Errors
    /// When the sets cannot be read.
    pub fn missing(&self, ips: &[IpAddr]) -> Result<Vec<IpAddr>, AmbientError> {
        self.sets.missing(ips)
    }

    /// Puts `ips` in the sets with `uid` as their comment (an entry already there for an
    /// address takes it).
    ///
    /// # Errors
    /// When the kernel refuses an entry.
    pub fn add(&self, uid: &str, ips: &[IpAddr]) -> Result<(), AmbientError> {
        self.sets.add(uid, ips)
    }

    /// Removes every entry that carries `uid` (another pod's entry for one of its addresses
    /// stays): whatever addresses the pod had, also those of a record from before addresses
    /// were kept.
    ///
    /// # Errors
    /// When the sets cannot be read or the kernel refuses.
    pub fn remove(&self, uid: &str) -> Result<(), AmbientError> {
        self.sets.remove(uid)
    }

    /// Makes the sets exactly `pods`' addresses, as (uid, addresses): each added, every other
    /// entry removed. With `ambient.ipv6` off, the IPv6 set an earlier agent filled (the
    /// setting on) is emptied: its entries would go on SNAT-ing probes to addresses whose pods
    /// left while no agent kept the set.
    ///
    /// # Errors
    /// When the sets cannot be read or the kernel refuses.
    pub fn sync(&self, pods: &[(String, Vec<IpAddr>)]) -> Result<(), AmbientError> {
        self.sets.sync(pods)
    }

    /// Takes the other form off the node, when an earlier agent (`global.nativeNftables` the
    /// other way) left it: called once this form is set up and holds every enrolled pod, so
    /// that kubelet's probes are SNAT-ed throughout the switch.
    ///
    /// # Errors
    /// When the other form is there and cannot be removed.
    pub fn retire_other(&self) -> Result<(), AmbientError> {
        let netns = self.netns.as_deref();
        let (other, there) = if self.nftables {
            ("IP sets and iptables rule", ipset::present(netns)?)
        } else {
            ("nftables table", nft::present(netns)?)
        };
        if !there {
            return Ok(());
        }
        if self.nftables {
            ipset::remove_from_node(netns, self.flavour, self.snat)?;
        } else {
            nft::remove_from_node(netns)?;
        }
        info!(
            "global.nativeNftables changed: the probes' earlier {other} taken off the node, after this form was filled"
        );
        Ok(())
    }
}

/// Kubelet's uid from `host_proc`, looked for again while it is not found, as Istio does
/// (see [`KUBELET_ATTEMPTS`]).
fn find_kubelet(host_proc: &Path) -> Result<u32, AmbientError> {
    let mut attempt = 1;
    loop {
        match kubelet::kubelet_uid(host_proc) {
            Ok(uid) => return Ok(uid),
            Err(err) if attempt < KUBELET_ATTEMPTS => {
                warn!(error = %err, attempt, "kubelet not found yet: ambient mode waits for it");
                attempt += 1;
                std::thread::sleep(KUBELET_RETRY);
            }
            Err(err) => return Err(AmbientError::Kubelet(err)),
        }
    }
}

/// Uninstall: takes both forms off `netns` (`None`: the calling thread's), whole: the
/// nftables table with its sets and rule, the iptables rule and the IP sets; what is not there
/// is fine.
///
/// # Errors
/// When a form is there and cannot be removed.
pub fn remove_from_node(
    netns: Option<&Path>,
    flavour: FlavourChoice,
    snat: HostProbeSnat,
) -> Result<(), AmbientError> {
    nft::remove_from_node(netns)?;
    if ipset::present(netns)? {
        ipset::remove_from_node(netns, flavour, snat)?;
    }
    Ok(())
}

fn failed(what: String, err: &io::Error) -> AmbientError {
    AmbientError::ProbeSet {
        what,
        reason: err.to_string(),
    }
}
