//! Each pod's capture in the kernel, as one transaction: **observe** the pod's netns (its
//! cookie, interfaces, addresses and, for `excludeInterfaces`, routes), **plan** its map
//! entries from its policy and what was observed (one encoding, [`super::encode`]),
//! **attach** what the netns needs (the pod's pins first, then the policy route where TPROXY,
//! rerouted interfaces or ambient mode need it, `tcp_fwmark_accept`, the pod's stub on every
//! interface and, where `bpf_sk_assign` refuses `SO_REUSEPORT` listeners, the socket lookup
//! program on its netns) — observe, plan and attach in one visit to the netns — and
//! **commit**: the pod's lists and interface flags, then last its `MESHCAP_PODS` entry, which
//! is what makes the programs act. A pod is captured in full or not at all.
//!
//! Every pin of a pod is made, marked and removed through its [`PodPins`]; what a capture is
//! checked against is [`check`]'s, what takes it away [`remove`]'s.
mod attach;
mod check;
mod remove;
mod verify;

use std::{
    borrow::Cow,
    collections::{HashMap, HashSet},
    os::fd::OwnedFd,
    path::PathBuf,
    sync::Mutex,
};

use meshcap_common::{PodConfig, flags, maps};
use meshcap_policy::DataplaneMode;

use super::{
    EbpfBackend, EbpfError, Handoff,
    encode::{self, Plan},
    pins::{Pins, record_name},
    stub::TcAttach,
    tables::{Snapshot, Tables},
};
use crate::{
    backend::{
        AttachedProgram, BackendError, CaptureBackend, CapturedPod, OtherProgram, PodCheck,
        PodPolicy, Verify,
    },
    crashpoint,
    pod::PodRef,
    podnet,
};

/// `policy` with the proxy's uid and gid as the programs see them: the node's ids, which
/// `bpf_get_current_uid_gid` reports. For a pod in a user namespace of its own (`hostUsers:
/// false`), the ids its namespace maps the pod's to ([`podnet::userns`]); for every other pod,
/// the pod's own.
///
/// # Errors
/// When the pod's namespaces cannot be read, or its user namespace does not map the proxy's ids
/// (the proxy could not run as them).
pub(super) fn node_ids<'a>(
    pod: &PodRef,
    policy: &'a PodPolicy,
) -> Result<Cow<'a, PodPolicy>, EbpfError> {
    let PodPolicy::Sidecar(sidecar) = policy else {
        return Ok(Cow::Borrowed(policy));
    };
    let Some(userns) = podnet::userns::owner_of(&pod.netns)? else {
        return Ok(Cow::Borrowed(policy));
    };
    let maps = userns.id_maps()?;
    let unmapped = |what: &str, id: u32| {
        EbpfError::pod(
            pod,
            format!("its user namespace (hostUsers: false) does not map the proxy's {what} {id}"),
        )
    };
    let mut mapped = sidecar.clone();
    mapped.proxy_uid = maps
        .host_uid(sidecar.proxy_uid)
        .ok_or_else(|| unmapped("uid", sidecar.proxy_uid))?;
    mapped.proxy_gid = maps
        .host_gid(sidecar.proxy_gid)
        .ok_or_else(|| unmapped("gid", sidecar.proxy_gid))?;
    tracing::debug!(
        uid = mapped.proxy_uid,
        gid = mapped.proxy_gid,
        "the pod has a user namespace of its own: the proxy's ids as the node sees them"
    );
    Ok(Cow::Owned(PodPolicy::Sidecar(mapped)))
}

/// The capacity of `MESHCAP_PODS` (ebpf/meshcap-ebpf/src/tables.rs).
const MAX_PODS: usize = 1_024;

/// The per-pod half of the backend: the pins, the maps' only writer, and what every pod's
/// stub needs. Cheap to call concurrently: map updates are serialised, netns work runs on each
/// calling thread (which enters the pod's netns and returns).
pub(super) struct Pods {
    pins: Pins,
    tables: Mutex<Tables>,
    /// The pinned `MESHCAP_TC_PROG`, which every pod's stub tail-calls through.
    tc_prog: OwnedFd,
    /// The socket lookup program, which every captured pod's netns gets
    /// (ebpf/meshcap-ebpf/src/handoff.rs): inbound SYNs reach the proxy through it where
    /// `bpf_sk_assign` refuses `SO_REUSEPORT` listeners, or when a `TIME_WAIT` socket holds
    /// their 4-tuple.
    handoff: OwnedFd,
    /// The flags every pod's config gets for it ([`Handoff::pod_flags`]).
    handoff_flags: u32,
    /// How stubs attach.
    tc_attach: TcAttach,
    /// The netns cookies [`Self::gone`] last found dead. A netns never comes back and its
    /// cookie is never given to another, so dropping one of these needs no second walk of
    /// every namespace on the node.
    found_gone: Mutex<HashSet<u64>>,
    /// A path naming each captured pod's netns, by cookie: the runtime's from the ADD, or one
    /// a walk of the node's namespaces found (the pins record only the cookie), for the
    /// verifier's visits; `None`: this pass's walk found none.
    netns: Mutex<HashMap<u64, Option<PathBuf>>>,
    /// The verifier's walk of the per-pod maps, once per pass.
    snapshot: Mutex<Snapshot>,
}

impl Pods {
    pub(super) fn new(
        pins: Pins,
        tables: Tables,
        tc_prog: OwnedFd,
        handoff: OwnedFd,
        handoff_mode: Handoff,
        tc_attach: TcAttach,
    ) -> Self {
        Self {
            pins,
            tables: Mutex::new(tables),
            tc_prog,
            handoff_flags: handoff_mode.pod_flags(),
            handoff,
            tc_attach,
            found_gone: Mutex::default(),
            netns: Mutex::default(),
            snapshot: Mutex::default(),
        }
    }

    pub(super) const fn pins(&self) -> &Pins {
        &self.pins
    }

    pub(super) const fn tc_prog(&self) -> &OwnedFd {
        &self.tc_prog
    }

    /// Captures `pod` as `policy` says, or updates its capture to it. Idempotent: what was
    /// removed behind meshcap's back is attached afresh.
    ///
    /// # Errors
    /// When the pod's netns cannot be entered or the kernel refuses; a pod this agent did not
    /// capture yet then loses what this call attached (an update keeps its capture as it was).
    pub(super) fn capture(&self, pod: &PodRef, policy: &PodPolicy) -> Result<(), EbpfError> {
        self.capture_with(pod, policy, 0)
    }

    /// [`Self::capture`] with `extra` flags in the pod's entry ([`flags::HANDOFF_ALWAYS`] for a
    /// pod moving in from Istio's `nat` rules); an update keeps that flag once given.
    pub(super) fn capture_with(
        &self,
        pod: &PodRef,
        policy: &PodPolicy,
        extra: u32,
    ) -> Result<(), EbpfError> {
        let policy = &*node_ids(pod, policy)?;
        let known = self.lock().cookie(&record_name(pod)).is_some();
        let with_routes = !encode::interfaces(policy).0.is_empty();
        let visited = podnet::run_in(&pod.netns, |visit| -> Result<Plan, EbpfError> {
            let net = podnet::inspect(visit, with_routes)?;
            let plan = Plan::new(policy, net, self.handoff_flags | extra);
            self.attach(visit, pod, &plan)?;
            if extra & flags::HANDOFF_ALWAYS != 0 {
                let pins = self.pins.pod(plan.net.cookie);
                pins.mark_nat_hooks()
                    .map_err(|e| EbpfError::io(&format!("creating {}", pins.dir().display()), e))?;
            }
            Ok(plan)
        });
        let plan = match visited {
            Ok(Ok(plan)) => plan,
            Ok(Err(err)) => {
                if !known && let Err(undo) = self.release(pod) {
                    tracing::warn!(error = %undo, "undoing a failed ADD");
                }
                return Err(err);
            }
            Err(err) => return Err(err.into()),
        };
        self.commit(pod, &plan)?;
        self.remember_netns(plan.net.cookie, pod);
        Ok(())
    }

    /// Writes the pod's lists under a fresh pod id, its interface flags and addresses, and last
    /// its entry; an update's old lists go once the new entry points past them.
    fn commit(&self, pod: &PodRef, plan: &Plan) -> Result<(), EbpfError> {
        let (cookie, entries) = (plan.net.cookie, &plan.entries);
        let mut tables = self.lock();
        tables.set_cookie(record_name(pod), cookie);
        let old = tables.current_id(cookie);
        // Its netns keeps the NAT hooks that made the SYNs go through the socket lookup: as its
        // pins say (also when its entry was deleted behind meshcap's back), or its entry (a
        // pod an earlier build moved, before the mark).
        let marked = if self.pins.pod(cookie).keeps_nat_hooks() {
            flags::HANDOFF_ALWAYS
        } else {
            0
        };
        let kept = marked
            | tables
                .pods
                .get(&cookie, 0)
                .map_or(0, |config| config.flags & flags::HANDOFF_ALWAYS);
        let pod_id = tables.allocate_id();
        let written = tables
            .write_lists(pod_id, entries)
            .and_then(|()| {
                crashpoint::here(crashpoint::EBPF_ADD_LISTS);
                tables.write_ifaces(cookie, &plan.net, entries)
            })
            .and_then(|()| tables.set_addrs(cookie, entries.addrs))
            .and_then(|()| {
                crashpoint::here(crashpoint::EBPF_ADD_IFACES);
                tables.set_pod(
                    cookie,
                    PodConfig {
                        pod_id,
                        flags: entries.config.flags | kept,
                        ..entries.config
                    },
                )
            });
        if let Err(err) = written {
            // A full map (E2BIG): nothing of this ADD stays; an update keeps its old entry.
            tables.remove_lists(pod_id);
            drop(tables);
            if old.is_none() {
                self.release(pod)?;
            }
            return Err(EbpfError::pod(
                pod,
                format!("capture not applied (a node holds at most {MAX_PODS} pods): {err}"),
            ));
        }
        if let Some(old) = old {
            tables.remove_lists(old);
        }
        tracing::info!(netns_cookie = cookie, pod_id, "captured");
        Ok(())
    }

    /// How many pods the maps hold, in either mode.
    pub(super) fn count(&self) -> usize {
        self.lock().pod_count()
    }

    /// How many entries each per-pod map holds (all zero when no pod is captured): the maps
    /// of pod configurations, CIDR lists, port lists and interfaces.
    pub(super) fn entry_counts(&self) -> Vec<(&'static str, usize)> {
        let tables = self.lock();
        vec![
            (maps::PODS, tables.pods.keys().count()),
            (maps::CIDRS4, tables.cidrs4.keys().count()),
            (maps::CIDRS6, tables.cidrs6.keys().count()),
            (maps::PORTS, tables.ports.keys().count()),
            (maps::IFACES, tables.ifaces.keys().count()),
        ]
    }

    /// The pod's cookie: as the pins record it (indexed), else from its netns while it
    /// exists.
    fn find_cookie(&self, pod: &PodRef) -> Option<u64> {
        self.lock()
            .cookie(&record_name(pod))
            .or_else(|| podnet::cookie_of(&pod.netns).ok())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Tables> {
        self.tables
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The kernel's answer to the backend interface: each pod's capture is a transaction of
/// `Pods`; the node-wide questions are [`EbpfBackend`]'s.
impl CaptureBackend for EbpfBackend {
    fn name(&self) -> &'static str {
        "ebpf"
    }

    fn add(&self, pod: &PodRef, policy: &PodPolicy) -> Result<(), BackendError> {
        Ok(self.pods.capture(pod, policy)?)
    }

    /// With the socket lookup for every captured SYN ([`flags::HANDOFF_ALWAYS`]): while
    /// conntrack tracks the pod's connections and the netns has an `ip nat` base chain (the
    /// empty ones iptables-nft leaves, or Istio's rules still there), the kernel's NAT hook at
    /// `LOCAL_IN` (`nf_nat_ipv4_local_in`) orphans a SYN that `bpf_sk_assign` gave the proxy's
    /// listener (its `sk_dport` is not the conntrack entry's), and the SYN goes to the port
    /// it was sent to: the app. The socket lookup chooses the listener at lookup time instead,
    /// where netfilter has no say. Kept for the pod's life (its NAT hooks stay too).
    fn add_moving(&self, pod: &PodRef, policy: &PodPolicy) -> Result<(), BackendError> {
        Ok(self.pods.capture_with(pod, policy, flags::HANDOFF_ALWAYS)?)
    }

    fn remove(&self, pod: &PodRef) -> Result<(), BackendError> {
        Ok(self.pods.release(pod)?)
    }

    fn forget_found_routes(&self, pod: &PodRef) -> Result<(), BackendError> {
        if let Some(cookie) = self.pods.find_cookie(pod) {
            self.pods.pins.pod(cookie).forget_found_routes();
        }
        Ok(())
    }

    fn check(&self, pod: &PodRef, policy: &PodPolicy) -> Result<(), BackendError> {
        self.pods.check(pod, policy).map_err(EbpfError::into_check)
    }

    fn prune_gone(&self) -> Result<Vec<PodRef>, BackendError> {
        Ok(self.pods.prune_gone()?)
    }

    fn gone(&self, mode: DataplaneMode) -> Result<Vec<PodRef>, BackendError> {
        Ok(self.pods.gone(mode))
    }

    fn drop_if_gone(&self, pod: &PodRef) -> Result<bool, BackendError> {
        Ok(self.pods.drop_if_gone(pod)?)
    }

    fn verify(&self, pod: &PodRef, verify: Verify) -> Result<PodCheck, BackendError> {
        Ok(self.pods.verify(pod, verify)?)
    }

    fn verify_node(&self, verify: Verify) -> PodCheck {
        if verify == Verify::Repair {
            self.pods.begin_pass();
        }
        self.own.verify(
            self.pods.pins(),
            &self.config.cgroup_root,
            self.pods.tc_prog(),
            verify,
        )
    }

    fn programs(&self) -> Vec<AttachedProgram> {
        self.attached()
    }

    fn other_programs(&self) -> Vec<OtherProgram> {
        self.neighbours()
    }

    fn warnings(&self) -> Vec<String> {
        self.node_warnings()
    }

    fn captured_count(&self) -> Result<usize, BackendError> {
        Ok(self.pods.count())
    }

    fn list(&self, mode: DataplaneMode) -> Result<Vec<CapturedPod>, BackendError> {
        Ok(self
            .pinned_pods()
            .into_iter()
            .filter(|pinned| pinned.mode() == mode)
            .map(|pinned| CapturedPod {
                adopted: false,
                summary: match mode {
                    DataplaneMode::Sidecar => format!(
                        "netns cookie {}, inbound TC on {}",
                        pinned.netns_cookie,
                        if pinned.interfaces.is_empty() {
                            "no interface".to_owned()
                        } else {
                            pinned.interfaces.join(",")
                        }
                    ),
                    DataplaneMode::Ambient => format!(
                        "ambient (ztunnel) in the kernel: netns cookie {}, TC on {}",
                        pinned.netns_cookie,
                        pinned.interfaces.join(",")
                    ),
                },
                pod: pinned.pod_ref(),
                backend: "ebpf".to_owned(),
            })
            .collect())
    }
}
