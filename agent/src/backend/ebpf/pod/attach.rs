//! A pod's capture attached in its netns, in the transaction's one visit: its pins, its
//! policy route, `tcp_fwmark_accept`, its stubs and the socket lookup program.
use meshcap_policy::PolicyRoutes;

use super::{Pods, check};
use crate::{
    backend::ebpf::{EbpfError, encode::Plan, pins::PodPins, stub, sys},
    crashpoint,
    pod::PodRef,
    podnet::{self, Visit, sysctl},
};

impl Pods {
    /// What the pod's netns needs, in the visit: its pins first (so that whoever comes next
    /// finds everything this attaches), then its route, `tcp_fwmark_accept`, its stubs and
    /// the socket lookup program.
    pub(super) fn attach(
        &self,
        visit: &mut Visit,
        pod: &PodRef,
        plan: &Plan,
    ) -> Result<(), EbpfError> {
        let pins = self.pins.pod(plan.net.cookie);
        let pinning = |e| EbpfError::io(&format!("creating {}", pins.dir().display()), e);
        let first = !pins.exists();
        pins.create(pod).map_err(pinning)?;
        if plan.ambient() {
            pins.mark_ambient().map_err(pinning)?;
        }
        crashpoint::here(crashpoint::EBPF_ADD_PINNED);
        if let Some(routes) = plan.routes() {
            if first {
                // A first capture: the policy routes already there are not meshcap's.
                let found = podnet::route::found(visit.netlink()?, &routes)?;
                pins.record_found_routes(&found).map_err(pinning)?;
            }
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
        // One stub per pod, shared by its interfaces; `lo` (ambient) gets a stub of its own,
        // which tail-calls only for ztunnel's packets.
        let (mut stub, mut lo_stub) = (None, None);
        for (ifindex, record) in todo {
            let lo = ifindex == stub::LOOPBACK_IFINDEX;
            let loaded = if lo { &mut lo_stub } else { &mut stub };
            let prog = match loaded.take() {
                Some(prog) => prog,
                None if lo => stub::load_lo(&self.tc_prog)?,
                None => stub::load(plan.net.cookie, &self.tc_prog)?,
            };
            stub::attach(visit, self.tc_attach, &prog, ifindex, &record)?;
            *loaded = Some(prog);
        }
        Ok(())
    }

    /// Attaches the socket lookup program to the visited netns
    /// (ebpf/meshcap-ebpf/src/handoff.rs), unless its pinned link is there already.
    pub(super) fn attach_handoff(&self, pins: &PodPins) -> Result<(), EbpfError> {
        let prog = &self.handoff;
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
}

/// The sysctl `tcp_fwmark_accept` of the calling thread's netns ([`crate::podnet::sysctl`]).
pub(super) const FWMARK_ACCEPT: &str = "net/ipv4/tcp_fwmark_accept";

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
        let current = sysctl::read(FWMARK_ACCEPT)
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
    sysctl::write(FWMARK_ACCEPT, "1").map_err(|e| EbpfError::io("net.ipv4.tcp_fwmark_accept", e))
}

/// Puts the pod's own `tcp_fwmark_accept` back (in the visited netns). A failure leaves 1,
/// which nothing in a released pod relies on: logged, never fatal.
pub(super) fn restore_fwmark_accept(value: u8) {
    if let Err(err) = sysctl::write(FWMARK_ACCEPT, &value.to_string()) {
        tracing::warn!(error = %err, value, "restoring net.ipv4.tcp_fwmark_accept");
    }
}
