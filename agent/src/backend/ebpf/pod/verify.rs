//! A pod's capture compared with its record, for the verifier (and `explain`): its map entries
//! with what [`super::Tables`] wrote or adopted, and, in one visit to its netns, its policy
//! route, `tcp_fwmark_accept`, its stub on every interface that is not excluded (and `lo` for an
//! ambient pod) and its socket lookup program. What differs is put back in place: entries
//! written over, a stub attached again over its place ([`stub::reattach`]), the route and the
//! sysctl added; nothing is removed first.
use std::path::PathBuf;

use meshcap_common::{PodConfig, flags, iface_flags};
use meshcap_policy::PolicyRoutes;

use super::{Pods, attach::FWMARK_ACCEPT, check};
use crate::{
    backend::{
        DriftKind, PodCheck, Verify,
        ebpf::{EbpfError, encode, pins::record_name, stub, sys},
    },
    pod::PodRef,
    podnet::{self, PodNetError, Visit},
};

impl Pods {
    /// Remembers the path of netns `cookie` (the runtime's, from an ADD).
    pub(super) fn remember_netns(&self, cookie: u64, pod: &PodRef) {
        if !pod.netns.as_os_str().is_empty() {
            self.netns_paths().insert(cookie, Some(pod.netns.clone()));
        }
    }

    /// Forgets the path of netns `cookie` (released).
    pub(super) fn forget_netns(&self, cookie: u64) {
        self.netns_paths().remove(&cookie);
    }

    /// Walks the per-pod maps once for this pass's pods ([`super::Tables::snapshot`]).
    pub(in crate::backend::ebpf) fn begin_pass(&self) {
        // Namespaces a walk did not find are looked for again, once per pass at most.
        self.netns_paths().retain(|_, path| path.is_some());
        let snapshot = self.lock().snapshot();
        *self
            .snapshot
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = snapshot;
    }

    /// Compares `pod`'s capture with its record; with [`Verify::Repair`] puts back what
    /// differs. A pod this backend does not hold (released meanwhile) has nothing to compare.
    ///
    /// # Errors
    /// When the pod's netns cannot be found or entered.
    pub(in crate::backend::ebpf) fn verify(
        &self,
        pod: &PodRef,
        verify: Verify,
    ) -> Result<PodCheck, EbpfError> {
        let Some(cookie) = self.lock().cookie(&record_name(pod)) else {
            return Ok(PodCheck::default());
        };
        let mut check = self.verify_entries(cookie, verify);
        let Some(path) = self.netns_path(cookie, pod) else {
            check.installed.push(format!(
                "netns cookie {cookie}: its network namespace is not found on the node (gone: the capture is dropped within --gone-check-seconds)"
            ));
            return Ok(check);
        };
        let visited = podnet::run_in(&path, |visit| self.verify_netns(visit, cookie, verify))?;
        match visited {
            Ok(netns) => {
                check.extend(netns);
                Ok(check)
            }
            Err(VisitError::NotThisNetns) => {
                // The path now names another namespace: found afresh on the next pass.
                self.forget_netns(cookie);
                check.installed.push(format!(
                    "netns cookie {cookie}: looking for its namespace again"
                ));
                Ok(check)
            }
            Err(VisitError::PodNet(err)) => Err(err.into()),
        }
    }

    /// The pod's map entries against what was written.
    fn verify_entries(&self, cookie: u64, verify: Verify) -> PodCheck {
        let mut check = PodCheck::default();
        let mut tables = self.lock();
        let Some(config) = tables.recorded_config(cookie) else {
            check.installed.push(format!(
                "netns cookie {cookie}: pinned, but no pod entry was written or found at start (an ADD puts it back)"
            ));
            return check;
        };
        let (ports, v4, v6) = tables.recorded_lists(config.pod_id);
        check.installed.push(format!(
            "netns cookie {cookie}: MESHCAP_PODS entry pod id {}, flags {:#x}, proxy uid/gid {}/{}; {ports} port, {v4} IPv4 and {v6} IPv6 list entries",
            config.pod_id, config.flags, config.proxy_uid, config.proxy_gid
        ));
        let fresh;
        let held;
        let snapshot = match verify {
            // `explain` walks the maps itself: the pass's walk may be old, or not made yet.
            Verify::Look => {
                fresh = tables.snapshot();
                &fresh
            }
            Verify::Repair => {
                held = self
                    .snapshot
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                &*held
            }
        };
        if let Some(drift) = tables.entries_drift(cookie, snapshot)
            && !drift.what.is_empty()
        {
            check.drift.push(
                verify.handle(DriftKind::MapEntry, drift.what.join("; "), || {
                    tables.restore_entries(cookie, snapshot)
                }),
            );
        }
        check
    }

    /// The pod's netns against its record, in the visit.
    fn verify_netns(
        &self,
        visit: &mut Visit,
        cookie: u64,
        verify: Verify,
    ) -> Result<PodCheck, VisitError> {
        if podnet::current_cookie()? != cookie {
            return Err(VisitError::NotThisNetns);
        }
        let mut check = PodCheck::default();
        let (config, ifaces) = {
            let tables = self.lock();
            (
                tables.recorded_config(cookie),
                tables.recorded_ifaces(cookie),
            )
        };
        let Some(config) = config else {
            return Ok(check);
        };
        let reroute = ifaces.iter().any(|(_, f)| f & iface_flags::REROUTE != 0);
        if let Some(routes) = encode::routes(&config, reroute).filter(|r| r.mark_route.is_some()) {
            match podnet::route::missing(visit.netlink()?, &routes)? {
                None => check.installed.push(format!(
                    "policy route: {}",
                    routes
                        .mark_route
                        .as_ref()
                        .map(|r| r.describe_rule())
                        .unwrap_or_default()
                )),
                Some(missing) => check.drift.push(verify.handle(
                    DriftKind::Route,
                    format!("{missing} is missing"),
                    || {
                        visit.netlink().and_then(|n| {
                            podnet::route::update(n, &PolicyRoutes::default(), &routes)
                        })
                    },
                )),
            }
        }
        if encode::fwmark_accept(&config) {
            let value = crate::podnet::sysctl::read(FWMARK_ACCEPT).unwrap_or_default();
            if value.trim() == "1" {
                check
                    .installed
                    .push("net.ipv4.tcp_fwmark_accept = 1".to_owned());
            } else {
                check.drift.push(verify.handle(
                    DriftKind::Sysctl,
                    format!("net.ipv4.tcp_fwmark_accept is {:?}, not 1", value.trim()),
                    || crate::podnet::sysctl::write(FWMARK_ACCEPT, "1"),
                ));
            }
        }
        self.verify_stubs(visit, cookie, &config, &ifaces, verify, &mut check)?;
        let pins = self.pins.pod(cookie);
        let handoff = self.handoff_flags;
        if sys::obj_get(&pins.handoff_link()).is_err() {
            check.drift.push(verify.handle(
                DriftKind::Handoff,
                "no socket lookup program on its netns",
                || self.attach_handoff(&pins),
            ));
        } else if config.flags & handoff != handoff {
            // Captured by an agent that gave the program only to pods whose kernel needed it
            // for every SYN (before Linux 6.5): TC hands a SYN on a 4-tuple in TIME_WAIT over
            // only where the flag says the program is there, and drops it elsewhere.
            check.drift.push(verify.handle(
                DriftKind::Handoff,
                format!("its pod entry lacks the socket lookup's flags {handoff:#x}"),
                || {
                    let config = PodConfig {
                        flags: config.flags | handoff,
                        ..config
                    };
                    self.lock().set_pod(cookie, config)
                },
            ));
        } else {
            check
                .installed
                .push("socket lookup program on its netns".to_owned());
        }
        Ok(check)
    }

    /// Every interface that is not excluded (and `lo` for an ambient pod) has the pod's stub,
    /// as its record says and the kernel confirms. An interface that came after the capture gets
    /// one too, as Istio's rules hold for every interface, unless the pod excludes interfaces:
    /// then only those recorded are (whether a newer one is excluded was never written down).
    fn verify_stubs(
        &self,
        visit: &mut Visit,
        cookie: u64,
        config: &meshcap_common::PodConfig,
        ifaces: &[(u32, u32)],
        verify: Verify,
        check: &mut PodCheck,
    ) -> Result<(), VisitError> {
        let pins = self.pins.pod(cookie);
        let mut interfaces = podnet::inspect(visit, false)?.interfaces;
        if config.has(flags::AMBIENT) {
            interfaces.push((stub::LOOPBACK_IFINDEX, "lo".to_owned()));
        }
        let mut stub = None;
        let excludes = config.has(flags::EXCLUDED_ROUTES);
        for (ifindex, name) in interfaces {
            let excluded = ifaces
                .iter()
                .any(|(index, f)| *index == ifindex && f & iface_flags::EXCLUDED != 0);
            let record = pins.tc(&name);
            if excluded || (excludes && !record.exists()) {
                continue;
            }
            let drift = if record.exists() {
                match check::verify(visit, &record) {
                    Ok(()) => {
                        check.installed.push(format!("inbound TC stub on {name}"));
                        continue;
                    }
                    Err(drift) => drift.to_string(),
                }
            } else {
                format!("no inbound TC stub recorded on {name}")
            };
            check
                .drift
                .push(verify.handle(DriftKind::TcFilter, drift, || {
                    let stub = match &mut stub {
                        Some(stub) => stub,
                        None => stub.insert(stub::load(cookie, &self.tc_prog)?),
                    };
                    stub::reattach(visit, self.tc_attach, &*stub, ifindex, &record)
                }));
        }
        Ok(())
    }

    /// A path naming netns `cookie`: remembered from its ADD or an earlier walk, else found by
    /// a walk of the node's namespaces (which remembers every captured pod's it finds, and
    /// which it does not, until the next pass).
    fn netns_path(&self, cookie: u64, pod: &PodRef) -> Option<PathBuf> {
        if !pod.netns.as_os_str().is_empty() {
            return Some(pod.netns.clone());
        }
        if let Some(path) = self.netns_paths().get(&cookie) {
            return path.clone();
        }
        let pinned: Vec<u64> = self
            .pins
            .pinned_pods()
            .iter()
            .map(|p| p.netns_cookie)
            .collect();
        let live = podnet::live_netns();
        let mut paths = self.netns_paths();
        for cookie in pinned {
            let found = live.get(&cookie).cloned();
            paths.entry(cookie).or_insert(found);
        }
        paths.get(&cookie).cloned().flatten()
    }

    fn netns_paths(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<u64, Option<PathBuf>>> {
        self.netns
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Why a visit could not compare.
enum VisitError {
    /// The path names another namespace than the pod's.
    NotThisNetns,
    /// The kernel could not be asked.
    PodNet(PodNetError),
}

impl From<PodNetError> for VisitError {
    fn from(err: PodNetError) -> Self {
        Self::PodNet(err)
    }
}
