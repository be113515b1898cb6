//! A capture compared with what it should be: the pod's entry and lists in the maps against
//! its policy's, the node-wide programs' links, and every stub (and the socket lookup
//! program) against the kernel ([`verify`]: how a stub differs from its record, a
//! [`StubDrift`]). What differs is named, for CHECK (and for whatever puts a capture back in
//! place: [`super::Pods::capture`] re-attaches what is gone).
use meshcap_common::flags;

use super::{Pods, encode};
use crate::{
    backend::{
        PodPolicy,
        ebpf::{
            EbpfError, node,
            pins::{RecordError, TcRecord},
            sys,
        },
    },
    pod::PodRef,
    podnet::{self, PodNetError, Visit, clsact},
};

impl Pods {
    /// Verifies `pod` is captured exactly as `policy` says and its stubs are attached.
    ///
    /// # Errors
    /// What is missing or different ([`EbpfError::Pod`]), or a failure to look.
    pub(in crate::backend::ebpf) fn check(
        &self,
        pod: &PodRef,
        policy: &PodPolicy,
    ) -> Result<(), EbpfError> {
        let entries = encode::policy_entries(&*super::node_ids(pod, policy)?);
        let cookie = podnet::cookie_of(&pod.netns)?;
        let config = self
            .lock()
            .pods
            .get(&cookie, 0)
            .map_err(|_| EbpfError::pod(pod, "not captured: no entry for its netns"))?;
        let handoff = self.handoff_flags;
        // What the pod's netns adds is not in `entries` (nor is the hand-off of every SYN a
        // pod moved from Istio's `nat` rules keeps).
        let from_netns = flags::EXCLUDED_ROUTES | flags::LOCAL4_IS_POD_ADDR | flags::HANDOFF_ALWAYS;
        let want = (entries.config.flags | handoff) & !from_netns;
        if config.flags & !from_netns != want
            || config.proxy_uid != entries.config.proxy_uid
            || config.proxy_gid != entries.config.proxy_gid
        {
            return Err(EbpfError::pod(
                pod,
                format!("captured with a different configuration: {config:?}"),
            ));
        }
        if let Some(differ) = self.lock().lists_differ(config.pod_id, &entries) {
            return Err(EbpfError::pod(pod, format!("captured, but {differ}")));
        }
        node::check_cgroup_links(&self.pins).map_err(|err| EbpfError::pod(pod, err.to_string()))?;
        let pins = self.pins.pod(cookie);
        let records = pins.tc_records();
        if records.is_empty() {
            return Err(EbpfError::pod(pod, "no inbound TC program attached"));
        }
        if sys::obj_get(&pins.handoff_link()).is_err() {
            return Err(EbpfError::pod(
                pod,
                "no socket lookup program on its netns (a SYN reusing a 4-tuple in TIME_WAIT, or before Linux 6.5 any SYN to a SO_REUSEPORT proxy listener, would be dropped)",
            ));
        }
        podnet::run_in(&pod.netns, |visit| {
            records.iter().try_for_each(|record| verify(visit, record))
        })?
        .map_err(|drift| EbpfError::pod(pod, drift.to_string()))
    }
}

/// How a stub differs from its record.
#[derive(Debug, thiserror::Error)]
pub enum StubDrift {
    /// The recorded interface is not there.
    #[error("interface {ifname}: {source}")]
    NoInterface {
        /// The interface.
        ifname: String,
        /// Why.
        #[source]
        source: nix::Error,
    },
    /// The record cannot be read.
    #[error(transparent)]
    Record(#[from] RecordError),
    /// The kernel cannot be asked.
    #[error(transparent)]
    Netlink(#[from] PodNetError),
    /// Another program sits at meshcap's filter's place.
    #[error("the TC filter on {ifname} (pref {priority}) runs program {found}, not meshcap's {id}")]
    OtherProgram {
        /// The interface.
        ifname: String,
        /// The filter's priority.
        priority: u16,
        /// The program there.
        found: u32,
        /// meshcap's.
        id: u32,
    },
    /// meshcap's filter is gone.
    #[error("no meshcap TC filter on {ifname} ingress (pref {priority}, handle {handle:#x})")]
    NoFilter {
        /// The interface.
        ifname: String,
        /// The filter's priority.
        priority: u16,
        /// Its handle.
        handle: u32,
    },
    /// The TCX link hangs on another interface (or none).
    #[error(
        "the TCX link of {ifname} is attached to interface {attached} (0: none), not {ifindex}"
    )]
    LinkMoved {
        /// The interface.
        ifname: String,
        /// Where the link is.
        attached: u32,
        /// Where it should be.
        ifindex: u32,
    },
    /// The TCX link cannot be asked where it is.
    #[error("{path}: {source}")]
    LinkInfo {
        /// The pin.
        path: std::path::PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Whether what `record` says is attached (the visited netns) really is: the TCX link is alive
/// on this interface, or meshcap's filter is there with the recorded program.
///
/// # Errors
/// What differs.
pub(super) fn verify(visit: &mut Visit, record: &TcRecord) -> Result<(), StubDrift> {
    let ifname = record.ifname().to_owned();
    let ifindex = nix::net::if_::if_nametoindex(ifname.as_str()).map_err(|source| {
        StubDrift::NoInterface {
            ifname: ifname.clone(),
            source,
        }
    })?;
    if record.is_filter() {
        let (filter, id) = record.filter()?;
        let netlink = visit.netlink()?;
        match clsact::find(netlink, ifindex, &ifname, filter)? {
            Some(found) if found == id => Ok(()),
            Some(found) => Err(StubDrift::OtherProgram {
                ifname,
                priority: filter.priority,
                found,
                id,
            }),
            None => Err(StubDrift::NoFilter {
                ifname,
                priority: filter.priority,
                handle: filter.handle,
            }),
        }
    } else {
        let link = record.link()?;
        let info = sys::tcx_link_info(&link).map_err(|source| StubDrift::LinkInfo {
            path: record.path().to_owned(),
            source,
        })?;
        if info.ifindex == ifindex {
            Ok(())
        } else {
            Err(StubDrift::LinkMoved {
                ifname,
                attached: info.ifindex,
                ifindex,
            })
        }
    }
}
