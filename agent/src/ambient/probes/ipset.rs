//! The probe sets and the node rule as Istio writes them with iptables
//! (`cni/pkg/iptables/iptables.go`, `CreateHostRulesForHealthChecks`; the sets of
//! `cni/pkg/ipset/`): IP sets `istio-inpod-probes-v4`/`-v6` of the node's network namespace,
//! each entry the pod's uid as its comment, written over nfnetlink ([`crate::ipset`]), and one
//! node rule ([`crate::backend::iptables::node`]) SNAT-ing TCP from a local socket (kubelet,
//! not traffic the node forwards: `-m owner --socket-exists`) to an address in them.
use std::{
    collections::BTreeSet,
    io,
    net::IpAddr,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use meshcap_policy::{
    ambient::HostProbeSnat,
    hostprobe::{PROBE_SET_V4, PROBE_SET_V6},
};
use tracing::info;

use super::{ProbeSets, failed};
use crate::{
    ambient::AmbientError,
    backend::iptables::{FlavourChoice, node},
    ipset::{self, Entry, Family, IpSets},
    podnet,
};

/// The node's probe sets and rule in IP sets and iptables.
pub(super) struct IpsetProbes {
    /// The node's network namespace (`None`: the agent's own).
    pub(super) netns: Option<PathBuf>,
    /// IPv6 beside IPv4 (`ambient.ipv6`).
    pub(super) ipv6: bool,
    /// Which iptables the node rule is written with, and where it SNATs to: to put the rule
    /// back with sets that were destroyed.
    pub(super) flavour: FlavourChoice,
    pub(super) snat: HostProbeSnat,
}

impl ProbeSets for IpsetProbes {
    /// Creates the sets (kept if there) and puts the node rule in front (one copy).
    ///
    /// # Errors
    /// When the sets or the rule cannot be set up.
    fn set_up(&self) -> Result<(), AmbientError> {
        self.sets(|sets| {
            for family in self.families() {
                let set = set_name(family);
                sets.create(set, family)
                    .map_err(|e| failed(format!("creating ip set {set}"), &e))?;
            }
            Ok(())
        })?;
        node::apply(
            self.netns.as_deref(),
            self.flavour,
            &self.snat.render(self.ipv6),
        )?;
        Ok(())
    }

    /// What of the sets and their rule is not in place, in words: a set that is gone
    /// (destroyed behind meshcap's back, with the rule that matched it), or one that no rule
    /// matches (the node rule deleted, its chain flushed). Whether a rule matches a set is the
    /// kernel's count of the set's references, read with its listing: no `iptables-save`.
    ///
    /// # Errors
    /// When the sets cannot be asked.
    fn not_in_place(&self) -> Result<Vec<String>, AmbientError> {
        self.sets(|sets| {
            let mut out = Vec::new();
            for family in self.families() {
                let set = set_name(family);
                match sets.references(set) {
                    Err(err) if ipset::is_missing(&err) => {
                        out.push(format!("ip set {set} is gone from the node"));
                    }
                    Err(err) => return Err(failed(format!("listing {set}"), &err)),
                    Ok(0) => out.push(format!(
                        "no rule of the node matches ip set {set} (the probe rule is gone)"
                    )),
                    Ok(_) => {}
                }
            }
            Ok(out)
        })
    }

    /// Which of `ips` the sets do not hold (the addresses the sets take: IPv6 only with
    /// `ambient.ipv6`).
    ///
    /// # Errors
    /// When the sets cannot be read.
    fn missing(&self, ips: &[IpAddr]) -> Result<Vec<IpAddr>, AmbientError> {
        let wanted: Vec<IpAddr> = self.kept(ips).collect();
        if wanted.is_empty() {
            return Ok(Vec::new());
        }
        self.sets(|sets| {
            let mut held = BTreeSet::new();
            for family in self.families() {
                let set = set_name(family);
                if wanted.iter().any(|ip| Family::of(ip) == family) {
                    let listed = sets
                        .list(set)
                        .map_err(|e| failed(format!("listing {set}"), &e))?;
                    held.extend(listed.into_iter().map(|e| e.ip));
                }
            }
            Ok(wanted.into_iter().filter(|ip| !held.contains(ip)).collect())
        })
    }

    /// Puts `ips` in the sets with `uid` as their comment (an entry already there for an
    /// address takes it).
    ///
    /// # Errors
    /// When the kernel refuses an entry.
    fn add(&self, uid: &str, ips: &[IpAddr]) -> Result<(), AmbientError> {
        self.sets(|sets| self.add_in(sets, uid, ips))
    }

    /// Removes every entry that carries `uid` (another pod's entry for one of its addresses
    /// stays): whatever addresses the pod had, also those of a record from before addresses
    /// were kept.
    ///
    /// # Errors
    /// When the sets cannot be read or the kernel refuses.
    fn remove(&self, uid: &str) -> Result<(), AmbientError> {
        self.delete_where(|e| e.comment == uid)
    }

    /// Makes the sets exactly `pods`' addresses, as (uid, addresses): each added, every other
    /// entry removed, in one visit to the node. With `ambient.ipv6` off, the IPv6 set an
    /// earlier agent filled (the setting on) is emptied: its rule, which only `uninstall`
    /// removes, then matches nothing, where its entries would go on SNAT-ing probes to
    /// addresses whose pods left while no agent kept the set.
    ///
    /// # Errors
    /// When the sets cannot be read or the kernel refuses.
    fn sync(&self, pods: &[(String, Vec<IpAddr>)]) -> Result<(), AmbientError> {
        let wanted: BTreeSet<IpAddr> = pods.iter().flat_map(|(_, ips)| ips.clone()).collect();
        self.sets(|sets| {
            for (uid, ips) in pods {
                self.add_in(sets, uid, ips)?;
            }
            self.delete_in(sets, &|e| {
                let stale = !wanted.contains(&e.ip);
                if stale {
                    info!(ip = %e.ip, uid = e.comment, "dropping a probe address no enrolled pod holds");
                }
                stale
            })?;
            if !self.ipv6 {
                empty_left_v6(sets)?;
            }
            Ok(())
        })
    }
}

impl IpsetProbes {
    fn add_in(&self, sets: &mut IpSets, uid: &str, ips: &[IpAddr]) -> Result<(), AmbientError> {
        for ip in self.kept(ips) {
            let entry = Entry {
                ip,
                comment: uid.to_owned(),
            };
            sets.add(set_of(ip), &entry)
                .map_err(|e| failed(format!("adding {ip} to {}", set_of(ip)), &e))?;
        }
        Ok(())
    }

    /// Deletes every entry of the sets `doomed` picks.
    fn delete_where(
        &self,
        doomed: impl Fn(&Entry) -> bool + Send + Sync,
    ) -> Result<(), AmbientError> {
        self.sets(|sets| self.delete_in(sets, &doomed))
    }

    fn delete_in(
        &self,
        sets: &mut IpSets,
        doomed: &dyn Fn(&Entry) -> bool,
    ) -> Result<(), AmbientError> {
        for family in self.families() {
            let set = set_name(family);
            let listed = sets
                .list(set)
                .map_err(|e| failed(format!("listing {set}"), &e))?;
            for entry in listed.iter().filter(|e| doomed(e)) {
                sets.delete(set, entry.ip)
                    .map_err(|e| failed(format!("deleting {} from {set}", entry.ip), &e))?;
            }
        }
        Ok(())
    }

    fn families(&self) -> impl Iterator<Item = Family> {
        [Family::V4]
            .into_iter()
            .chain(self.ipv6.then_some(Family::V6))
    }

    /// The addresses of `ips` the sets take (IPv6 only with `ambient.ipv6`).
    fn kept<'a>(&self, ips: &'a [IpAddr]) -> impl Iterator<Item = IpAddr> + 'a {
        let ipv6 = self.ipv6;
        ips.iter().copied().filter(move |ip| ip.is_ipv4() || ipv6)
    }

    /// Runs `f` on a socket in the node's network namespace.
    fn sets<T: Send>(
        &self,
        f: impl FnOnce(&mut IpSets) -> Result<T, AmbientError> + Send,
    ) -> Result<T, AmbientError> {
        in_node(self.netns.as_deref(), f)
    }
}

/// Uninstall, or the node moving to the nftables form: removes the node rule, then the sets,
/// from `netns` (`None`: the calling thread's); what is not there is fine.
///
/// # Errors
/// When the rule or a set is there and cannot be removed.
pub(super) fn remove_from_node(
    netns: Option<&Path>,
    flavour: FlavourChoice,
    snat: HostProbeSnat,
) -> Result<(), AmbientError> {
    node::remove(netns, flavour, &snat.render(true))?;
    in_node(netns, |sets| {
        for set in [PROBE_SET_V4, PROBE_SET_V6] {
            destroy(sets, set).map_err(|e| failed(format!("destroying ip set {set}"), &e))?;
        }
        Ok(())
    })
}

/// Whether the node holds the IP set form (a probe set: the rule matches them, so none is
/// there without them), in `netns`. A kernel without IP sets holds none.
pub(super) fn present(netns: Option<&Path>) -> Result<bool, AmbientError> {
    in_node(netns, |sets| {
        for set in [PROBE_SET_V4, PROBE_SET_V6] {
            match sets.list(set) {
                Ok(_) => return Ok(true),
                Err(err)
                    if ipset::is_missing(&err)
                        || matches!(
                            err.raw_os_error(),
                            Some(libc::EOPNOTSUPP | libc::EPROTONOSUPPORT)
                        ) => {}
                Err(err) => return Err(failed(format!("listing {set}"), &err)),
            }
        }
        Ok(false)
    })
}

/// Empties the IPv6 probe set, if an agent with `ambient.ipv6` left one.
fn empty_left_v6(sets: &mut IpSets) -> Result<(), AmbientError> {
    let listed = match sets.list(PROBE_SET_V6) {
        Err(err) if ipset::is_missing(&err) => return Ok(()),
        listed => listed.map_err(|e| failed(format!("listing {PROBE_SET_V6}"), &e))?,
    };
    for entry in listed {
        info!(ip = %entry.ip, uid = entry.comment, "ambient.ipv6 is off: dropping an IPv6 probe address an earlier agent left");
        sets.delete(PROBE_SET_V6, entry.ip)
            .map_err(|e| failed(format!("deleting {} from {PROBE_SET_V6}", entry.ip), &e))?;
    }
    Ok(())
}

/// How long a set may stay held after the rule matching it went (see [`destroy`]).
const RELEASE_WAIT: Duration = Duration::from_secs(5);

/// Destroys `set`. iptables-nft's rules hold a set through `nft_compat`, whose matches
/// nf_tables releases in deferred work after the transaction that deleted them has returned
/// (seen on 5.10: `EBUSY` right after the rule's removal): while the kernel still says the set
/// is in use, asked again every 20 ms, for at most [`RELEASE_WAIT`].
fn destroy(sets: &mut IpSets, set: &str) -> io::Result<()> {
    let deadline = Instant::now() + RELEASE_WAIT;
    loop {
        match sets.destroy(set) {
            Err(err) if ipset::is_busy(&err) && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            done => return done,
        }
    }
}

fn in_node<T: Send>(
    netns: Option<&Path>,
    f: impl FnOnce(&mut IpSets) -> Result<T, AmbientError> + Send,
) -> Result<T, AmbientError> {
    let run = || {
        let mut sets =
            IpSets::open().map_err(|e| failed("opening an nfnetlink socket".into(), &e))?;
        f(&mut sets)
    };
    match netns {
        None => run(),
        Some(netns) => podnet::run_in(netns, |_| run()).map_err(|e| AmbientError::ProbeSet {
            what: format!("entering {}", netns.display()),
            reason: e.to_string(),
        })?,
    }
}

const fn set_of(ip: IpAddr) -> &'static str {
    set_name(Family::of(&ip))
}

const fn set_name(family: Family) -> &'static str {
    match family {
        Family::V4 => PROBE_SET_V4,
        Family::V6 => PROBE_SET_V6,
    }
}
