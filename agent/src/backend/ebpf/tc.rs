//! A pod's inbound stub on its interfaces, each attachment recorded in the pod's pins
//! ([`TcRecord`]): a netlink `cls_bpf` filter ([`crate::podnet::clsact`], the default) recorded as
//! a directory holding the stub pinned under the filter's place, or a TCX `bpf_link` pinned as
//! the record itself. Attach, verify against the kernel, detach: all on the pod's netns thread.
use std::os::fd::{AsFd, BorrowedFd};

use super::{
    EbpfError,
    pins::{RecordError, TcRecord},
    stub, sys,
};
use crate::{
    crashpoint,
    podnet::{self, PodNetError, Visit, clsact},
};

/// `lo`'s index in every network namespace (`LOOPBACK_IFINDEX`): an ambient pod's stub sits
/// there too.
pub(super) const LOOPBACK_IFINDEX: u32 = 1;

/// How pods' inbound stubs are attached to their interfaces.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum TcAttach {
    /// A TCX bpf_link (Linux 6.6+), pinned at `pods/<cookie>/tc-<ifname>`. Creating and
    /// releasing one each wait for an RCU grace period in the kernel (6–12 ms apiece), so it
    /// is only used when asked for.
    Tcx,
    /// A `cls_bpf` direct-action filter on the `clsact` qdisc, over netlink (every kernel
    /// meshcap runs on), recorded in the directory `pods/<cookie>/tc-<ifname>/`: the default,
    /// on every kernel (docs/ebpf.md says why).
    #[default]
    Netlink,
}

/// Attaches the pod's `stub` on the ingress of interface `ifindex` (`record`'s) in the visited
/// netns, and records it. Nothing is left attached without its record, even when the agent is
/// killed half-way.
///
/// # Errors
/// When the kernel refuses the attachment or the pin.
pub fn attach(
    visit: &mut Visit,
    mode: TcAttach,
    stub: impl AsFd,
    ifindex: u32,
    record: &TcRecord,
) -> Result<(), EbpfError> {
    let ifname = record.ifname();
    match mode {
        TcAttach::Tcx => {
            let link = sys::tcx_ingress_link_create(stub, ifindex)
                .map_err(|e| EbpfError::io(&format!("attaching TCX ingress on {ifname}"), e))?;
            // Unpinned, the link goes with its fd: nothing stays attached.
            record.pin_link(&link).map_err(|e| {
                EbpfError::io(
                    &format!(
                        "pinning the TC link of {ifname} at {}",
                        record.path().display()
                    ),
                    e,
                )
            })
        }
        TcAttach::Netlink => attach_netlink(visit, stub.as_fd(), ifindex, record, false),
    }
}

/// Attaches the pod's `stub` on `ifindex` again where its record is gone or the kernel
/// contradicts it (the verifier's repair), in place: nothing of what is there is taken away
/// first. A netlink filter is replaced at meshcap's place (one atomic request) and recorded
/// anew, keeping what the old record said of the qdisc while the qdisc is there; a TCX link is
/// created and pinned over the old record, which goes only then. An interface without a
/// record gets what `mode` says.
///
/// # Errors
/// When the kernel refuses the attachment or the pin.
pub fn reattach(
    visit: &mut Visit,
    mode: TcAttach,
    stub: impl AsFd,
    ifindex: u32,
    record: &TcRecord,
) -> Result<(), EbpfError> {
    if !record.exists() {
        return attach(visit, mode, stub, ifindex, record);
    }
    if record.is_filter() {
        let owned = record
            .filter()
            .is_ok_and(|(filter, _)| filter.created_qdisc)
            || record.may_own_qdisc();
        // Only the pins go: the filter stays until the new one replaces it.
        super::pins::remove_tree(record.path());
        return attach_netlink(visit, stub.as_fd(), ifindex, record, owned);
    }
    let ifname = record.ifname();
    let link = sys::tcx_ingress_link_create(stub, ifindex)
        .map_err(|e| EbpfError::io(&format!("attaching TCX ingress on {ifname}"), e))?;
    // Beside the record, under a name no reader takes for a record (bpffs refuses dots).
    let staged = record.path().with_file_name(format!("new-tc-{ifname}"));
    let _ = std::fs::remove_file(&staged);
    sys::obj_pin(&link, &staged)
        .and_then(|()| std::fs::rename(&staged, record.path()))
        .map_err(|e| {
            let _ = std::fs::remove_file(&staged);
            EbpfError::io(
                &format!(
                    "pinning the TC link of {ifname} at {}",
                    record.path().display()
                ),
                e,
            )
        })
}

/// The netlink filter, written ahead: the record's directory and its qdisc intent are pinned
/// before the kernel is asked for anything, so that an agent killed at any instant leaves a
/// record for whatever it attached ([`detach`] finishes the job). The intent stays only while
/// meshcap may own the qdisc without a filter record saying so (`owned_qdisc`: an earlier
/// record said meshcap added it).
fn attach_netlink(
    visit: &mut Visit,
    stub: BorrowedFd<'_>,
    ifindex: u32,
    record: &TcRecord,
    owned_qdisc: bool,
) -> Result<(), EbpfError> {
    let ifname = record.ifname();
    let recording = |e| {
        EbpfError::io(
            &format!(
                "recording the TC filter of {ifname} at {}",
                record.path().display()
            ),
            e,
        )
    };
    record.begin_filter().map_err(recording)?;
    let attached = visit.netlink().and_then(|netlink| {
        let created_qdisc = clsact::add_qdisc(netlink, ifindex, ifname)? || owned_qdisc;
        if !created_qdisc {
            record.drop_intent();
        }
        crashpoint::here(crashpoint::EBPF_ADD_QDISC);
        clsact::add_filter(netlink, ifindex, ifname, created_qdisc, stub, stub::NAME)
    });
    let pinned = attached.map_err(EbpfError::from).and_then(|filter| {
        crashpoint::here(crashpoint::EBPF_ADD_FILTER);
        record.pin_filter(stub, &filter).map_err(recording)
    });
    if let Err(err) = pinned {
        detach(visit, record);
        return Err(err);
    }
    Ok(())
}

/// Detaches what [`attach`] attached (the visited netns) and removes its record. For netlink
/// TC only meshcap's filter goes, and the clsact qdisc only when meshcap added it and nothing
/// else uses it.
pub fn detach(visit: &mut Visit, record: &TcRecord) {
    let ifname = record.ifname();
    if record.is_filter()
        && let Ok(ifindex) = nix::net::if_::if_nametoindex(ifname)
    {
        let detached = visit.netlink().and_then(|netlink| match record.filter() {
            Ok((filter, id)) => clsact::detach(netlink, ifindex, ifname, id, filter),
            // An attach cut short before its filter was recorded: the filter by its place
            // and name, and the qdisc if the intent says meshcap may have added it.
            Err(_) => {
                clsact::detach_named(netlink, ifindex, ifname, stub::NAME, record.may_own_qdisc())
                    .map(drop)
            }
        });
        if let Err(err) = detached {
            tracing::warn!(interface = ifname, error = %err, "detaching the TC filter");
        }
    }
    record.remove();
}

/// Detaches meshcap's stub from every interface of the visited netns (and `lo` with
/// `with_lo`: an ambient pod's, or one whose kind is not known) that has none of `records`
/// yet runs it: a filter whose record was removed behind meshcap's back, or never written (an
/// agent killed in between). Recognised by its place and its program's name; its qdisc stays
/// (whether meshcap added it went with the record).
pub fn detach_unrecorded(visit: &mut Visit, records: &[TcRecord], with_lo: bool) {
    let mut interfaces = match podnet::inspect(visit, false) {
        Ok(net) => net.interfaces,
        Err(err) => {
            tracing::warn!(error = %err, "listing interfaces for unrecorded TC filters");
            return;
        }
    };
    if with_lo {
        interfaces.push((LOOPBACK_IFINDEX, "lo".to_owned()));
    }
    for (ifindex, ifname) in interfaces {
        if records.iter().any(|record| record.ifname() == ifname) {
            continue;
        }
        let removed = visit
            .netlink()
            .and_then(|netlink| clsact::detach_named(netlink, ifindex, &ifname, stub::NAME, false));
        match removed {
            Ok(true) => {
                tracing::warn!(interface = %ifname, "removed meshcap's TC filter, whose record was gone")
            }
            Ok(false) => {}
            Err(err) => {
                tracing::warn!(interface = %ifname, error = %err, "looking for an unrecorded TC filter")
            }
        }
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
pub fn verify(visit: &mut Visit, record: &TcRecord) -> Result<(), StubDrift> {
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
