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
mod check;
mod remove;

use std::{collections::HashSet, os::fd::OwnedFd, sync::Mutex};

use meshcap_common::{PodConfig, maps};

use super::{
    EbpfBackend, EbpfError,
    encode::{self, Plan},
    pins::{Pins, PodPins, record_name},
    stub::{self, TcAttach},
    sys,
    tables::Tables,
};
use crate::{
    backend::{
        AttachedProgram, BackendError, CaptureBackend, CapturedPod, OtherProgram, PodPolicy,
    },
    crashpoint,
    pod::PodRef,
    podnet::{self, Visit},
    policy::{DataplaneMode, PolicyRoutes},
};

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
    /// The socket lookup program, loaded where `bpf_sk_assign` refuses `SO_REUSEPORT`
    /// listeners: every captured pod's netns gets it (ebpf/meshcap-ebpf/src/handoff.rs).
    handoff: Option<OwnedFd>,
    /// How stubs attach.
    tc_attach: TcAttach,
    /// The netns cookies [`Self::gone`] last found dead. A netns never comes back and its
    /// cookie is never given to another, so dropping one of these needs no second walk of
    /// every namespace on the node.
    found_gone: Mutex<HashSet<u64>>,
}

impl Pods {
    pub(super) fn new(
        pins: Pins,
        tables: Tables,
        tc_prog: OwnedFd,
        handoff: Option<OwnedFd>,
        tc_attach: TcAttach,
    ) -> Self {
        Self {
            pins,
            tables: Mutex::new(tables),
            tc_prog,
            handoff,
            tc_attach,
            found_gone: Mutex::default(),
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
        let known = self.lock().cookie(&record_name(pod)).is_some();
        let with_routes = !encode::interfaces(policy).0.is_empty();
        let visited = podnet::run_in(&pod.netns, |visit| -> Result<Plan, EbpfError> {
            let net = podnet::inspect(visit, with_routes)?;
            let plan = Plan::new(policy, net, self.handoff.is_some());
            self.attach(visit, pod, &plan)?;
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
        self.commit(pod, &plan)
    }

    /// What the pod's netns needs, in the visit: its pins first (so that whoever comes next
    /// finds everything this attaches), then its route, `tcp_fwmark_accept`, its stubs and
    /// the socket lookup program.
    fn attach(&self, visit: &mut Visit, pod: &PodRef, plan: &Plan) -> Result<(), EbpfError> {
        let pins = self.pins.pod(plan.net.cookie);
        let pinning = |e| EbpfError::io(&format!("creating {}", pins.dir().display()), e);
        pins.create(pod).map_err(pinning)?;
        if plan.ambient() {
            pins.mark_ambient().map_err(pinning)?;
        }
        crashpoint::here(crashpoint::EBPF_ADD_PINNED);
        if let Some(routes) = plan.routes() {
            podnet::route::update(visit.netlink()?, &PolicyRoutes::default(), &routes)?;
        }
        set_fwmark_accept(&pins, plan.fwmark_accept())?;
        self.attach_stubs(visit, &pins, plan)?;
        self.attach_handoff(&pins)?;
        crashpoint::here(crashpoint::EBPF_ADD_ATTACHED);
        Ok(())
    }

    /// Attaches the pod's stub on every interface but the excluded ones (and on `lo` for an
    /// ambient pod, where ztunnel's connections to the app are told apart). An interface whose
    /// record the kernel confirms is attached already (by this agent or the one before it):
    /// never twice. A record the kernel contradicts (the filter deleted behind meshcap's back,
    /// the TCX link's interface replaced) is dropped and the stub attached afresh.
    fn attach_stubs(
        &self,
        visit: &mut Visit,
        pins: &PodPins,
        plan: &Plan,
    ) -> Result<(), EbpfError> {
        let lo = (stub::LOOPBACK_IFINDEX, "lo".to_owned());
        let mut todo = Vec::new();
        for (ifindex, name) in plan
            .net
            .interfaces
            .iter()
            .chain(plan.ambient().then_some(&lo))
        {
            if plan.exclude_interfaces.contains(name) {
                continue;
            }
            let record = pins.tc(name);
            if record.exists() {
                let Err(stale) = check::verify(visit, &record) else {
                    continue;
                };
                tracing::warn!(interface = %name, reason = %stale, "re-attaching the inbound TC stub");
                stub::detach(visit, &record);
            }
            todo.push((*ifindex, record));
        }
        if todo.is_empty() {
            return Ok(());
        }
        // One stub per pod, shared by its interfaces.
        let stub = stub::load(plan.net.cookie, &self.tc_prog)?;
        for (ifindex, record) in todo {
            stub::attach(visit, self.tc_attach, &stub, ifindex, &record)?;
        }
        Ok(())
    }

    /// Attaches the socket lookup program to the visited netns, where this kernel needs it
    /// (ebpf/meshcap-ebpf/src/handoff.rs), unless its pinned link is there already.
    fn attach_handoff(&self, pins: &PodPins) -> Result<(), EbpfError> {
        let Some(prog) = &self.handoff else {
            return Ok(());
        };
        let pin = pins.handoff_link();
        if sys::obj_get(&pin).is_ok() {
            return Ok(());
        }
        let netns = std::fs::File::open("/proc/thread-self/ns/net")
            .map_err(|e| EbpfError::io("opening the pod's netns", e))?;
        let link = sys::sk_lookup_link_create(prog, &netns)
            .map_err(|e| EbpfError::io("attaching the socket lookup program", e))?;
        sys::obj_pin(&link, &pin)
            .map_err(|e| EbpfError::io(&format!("pinning {}", pin.display()), e))
    }

    /// Writes the pod's lists under a fresh pod id, its interface flags and addresses, and last
    /// its entry; an update's old lists go once the new entry points past them.
    fn commit(&self, pod: &PodRef, plan: &Plan) -> Result<(), EbpfError> {
        let (cookie, entries) = (plan.net.cookie, &plan.entries);
        let mut tables = self.lock();
        tables.set_cookie(record_name(pod), cookie);
        let old = tables.current_id(cookie);
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

/// The sysctl `tcp_fwmark_accept` of the calling thread's netns.
const FWMARK_ACCEPT: &str = "/proc/sys/net/ipv4/tcp_fwmark_accept";

/// Sets the visited netns' `net.ipv4.tcp_fwmark_accept` to 1 when `on`, first recording the
/// pod's own value in its pins; otherwise puts a recorded value back (an update that needs it
/// no more). Released pods get theirs back when their capture is removed.
fn set_fwmark_accept(pins: &PodPins, on: bool) -> Result<(), EbpfError> {
    let before = pins.fwmark_accept_before();
    if !on {
        if let Some(value) = before {
            restore_fwmark_accept(value);
            pins.forget_fwmark_accept(value);
        }
        return Ok(());
    }
    if before.is_none() {
        let current = std::fs::read_to_string(FWMARK_ACCEPT)
            .map_err(|e| EbpfError::io("reading net.ipv4.tcp_fwmark_accept", e))?;
        let value = current.trim().parse().map_err(|_| {
            EbpfError::io(
                "reading net.ipv4.tcp_fwmark_accept",
                std::io::Error::other(format!("not a number: {current:?}")),
            )
        })?;
        pins.record_fwmark_accept(value)
            .map_err(|e| EbpfError::io(&format!("creating {}", pins.dir().display()), e))?;
    }
    std::fs::write(FWMARK_ACCEPT, "1").map_err(|e| EbpfError::io("net.ipv4.tcp_fwmark_accept", e))
}

/// Puts the pod's own `tcp_fwmark_accept` back (in the visited netns). A failure leaves 1,
/// which nothing in a released pod relies on: logged, never fatal.
fn restore_fwmark_accept(value: u8) {
    if let Err(err) = std::fs::write(FWMARK_ACCEPT, value.to_string()) {
        tracing::warn!(error = %err, value, "restoring net.ipv4.tcp_fwmark_accept");
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

    fn remove(&self, pod: &PodRef) -> Result<(), BackendError> {
        Ok(self.pods.release(pod)?)
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
