//! A pod's inbound stub on its interfaces, and the record of each attachment in the pins: a
//! netlink `cls_bpf` filter ([`crate::podnet::tc`], the default) recorded as a directory
//! holding the stub pinned under the filter's place, or a TCX `bpf_link` pinned as the record
//! itself. Attach, verify against the kernel, detach: all on the pod's netns thread.
use std::{
    fs,
    os::fd::BorrowedFd,
    path::{Path, PathBuf},
};

use super::{
    EbpfError,
    pins::{self, filter_record_name, parse_filter_record_name},
    stub, sys,
};
use crate::{
    crashpoint,
    podnet::{
        self, Visit,
        tc::{self, Filter},
    },
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

/// Attaches the pod's `stub` on the ingress of interface `ifindex` (`ifname`) in the visited
/// netns, and records it at `record`. Nothing is left attached without its record, even when
/// the agent is killed half-way.
///
/// # Errors
/// When the kernel refuses the attachment or the pin.
pub fn attach(
    visit: &mut Visit,
    mode: TcAttach,
    stub: BorrowedFd<'_>,
    ifindex: u32,
    ifname: &str,
    record: &Path,
) -> Result<(), EbpfError> {
    match mode {
        TcAttach::Tcx => {
            let link = sys::tcx_ingress_link_create(stub, ifindex)
                .map_err(|e| EbpfError::io(&format!("attaching TCX ingress on {ifname}"), e))?;
            // Unpinned, the link goes with its fd: nothing stays attached.
            sys::obj_pin(&link, record).map_err(|e| {
                EbpfError::io(
                    &format!("pinning the TC link of {ifname} at {}", record.display()),
                    e,
                )
            })
        }
        TcAttach::Netlink => attach_netlink(visit, stub, ifindex, ifname, record),
    }
}

/// The netlink filter, written ahead: the record's directory and its qdisc intent are pinned
/// before the kernel is asked for anything, so that an agent killed at any instant leaves a
/// record for whatever it attached ([`detach`] finishes the job). The intent stays only while
/// meshcap may own the qdisc without a filter record saying so.
fn attach_netlink(
    visit: &mut Visit,
    stub: BorrowedFd<'_>,
    ifindex: u32,
    ifname: &str,
    record: &Path,
) -> Result<(), EbpfError> {
    let recording = |e| {
        EbpfError::io(
            &format!(
                "recording the TC filter of {ifname} at {}",
                record.display()
            ),
            e,
        )
    };
    let intent = record.join(pins::QDISC_INTENT);
    fs::create_dir(record).map_err(recording)?;
    if let Err(e) = fs::create_dir(&intent) {
        let _ = fs::remove_dir(record);
        return Err(recording(e));
    }
    let attached = visit.netlink().and_then(|netlink| {
        let created_qdisc = tc::add_qdisc(netlink, ifindex, ifname)?;
        if !created_qdisc {
            let _ = fs::remove_dir(&intent);
        }
        crashpoint::here(crashpoint::EBPF_ADD_QDISC);
        tc::add_filter(netlink, ifindex, ifname, created_qdisc, stub, stub::NAME)
    });
    let pinned = attached.map_err(EbpfError::from).and_then(|filter| {
        crashpoint::here(crashpoint::EBPF_ADD_FILTER);
        sys::obj_pin(stub, &record.join(filter_record_name(&filter))).map_err(recording)
    });
    match pinned {
        Ok(()) => {
            // The filter record says whose the qdisc is from now on.
            let _ = fs::remove_dir(&intent);
            Ok(())
        }
        Err(err) => {
            detach(visit, ifname, record);
            Err(err)
        }
    }
}

/// A netlink-TC record: the filter's place and its program's id.
fn read_netlink_record(record: &Path) -> Result<(Filter, u32), String> {
    let entries = pins::list_dir(record);
    let (name, filter) = entries
        .iter()
        .find_map(|n| Some((n, parse_filter_record_name(n)?)))
        .ok_or_else(|| format!("{} records no TC filter", record.display()))?;
    let prog = sys::obj_get(&record.join(name))
        .map_err(|e| format!("opening {}: {e}", record.join(name).display()))?;
    let id = sys::prog_id(&prog).map_err(|e| format!("{}: {e}", record.join(name).display()))?;
    Ok((filter, id))
}

/// Detaches what [`attach`] attached on `ifname` (the visited netns) and removes its record.
/// For netlink TC only meshcap's filter goes, and the clsact qdisc only when meshcap added it
/// and nothing else uses it.
pub fn detach(visit: &mut Visit, ifname: &str, record: &Path) {
    if record.is_dir() {
        if let Ok(ifindex) = nix::net::if_::if_nametoindex(ifname) {
            let detached = visit
                .netlink()
                .and_then(|netlink| match read_netlink_record(record) {
                    Ok((filter, id)) => tc::detach(netlink, ifindex, ifname, id, filter),
                    // An attach cut short before its filter was recorded: the filter by its place
                    // and name, and the qdisc if the intent says meshcap may have added it.
                    Err(_) => {
                        let own_qdisc = record.join(pins::QDISC_INTENT).is_dir();
                        tc::detach_named(netlink, ifindex, ifname, stub::NAME, own_qdisc).map(drop)
                    }
                });
            if let Err(err) = detached {
                tracing::warn!(interface = ifname, error = %err, "detaching the TC filter");
            }
        }
        pins::remove_tree(record);
    } else {
        let _ = pins::unpin_link(record);
    }
}

/// Detaches meshcap's stub from every interface of the visited netns (and `lo` with
/// `with_lo`: an ambient pod's, or one whose kind is not known) that has none of `records`
/// (interface, record) yet runs it: a filter whose record was removed behind meshcap's back, or
/// never written (an agent killed in between). Recognised by its place and its program's name;
/// its qdisc stays (whether meshcap added it went with the record).
pub fn detach_unrecorded(visit: &mut Visit, records: &[(String, PathBuf)], with_lo: bool) {
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
        if records.iter().any(|(name, _)| *name == ifname) {
            continue;
        }
        let removed = visit
            .netlink()
            .and_then(|netlink| tc::detach_named(netlink, ifindex, &ifname, stub::NAME, false));
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

/// Whether what `record` says is attached on `ifname` (the visited netns) really is: the TCX
/// link is alive on this interface, or meshcap's filter is there with the recorded program.
///
/// # Errors
/// What is missing, in words.
pub fn verify(visit: &mut Visit, ifname: &str, record: &Path) -> Result<(), String> {
    let ifindex =
        nix::net::if_::if_nametoindex(ifname).map_err(|e| format!("interface {ifname}: {e}"))?;
    if record.is_dir() {
        let (filter, id) = read_netlink_record(record)?;
        let netlink = visit.netlink().map_err(|e| e.to_string())?;
        match tc::find(netlink, ifindex, ifname, filter).map_err(|e| e.to_string())? {
            Some(found) if found == id => Ok(()),
            Some(found) => Err(format!(
                "the TC filter on {ifname} (pref {}) runs program {found}, not meshcap's {id}",
                filter.priority
            )),
            None => Err(format!(
                "no meshcap TC filter on {ifname} ingress (pref {}, handle {:#x})",
                filter.priority, filter.handle
            )),
        }
    } else {
        let link =
            sys::obj_get(record).map_err(|e| format!("opening {}: {e}", record.display()))?;
        let info = sys::tcx_link_info(&link).map_err(|e| format!("{}: {e}", record.display()))?;
        if info.ifindex == ifindex {
            Ok(())
        } else {
            Err(format!(
                "the TCX link of {ifname} is attached to interface {} (0: none), not {ifindex}",
                info.ifindex
            ))
        }
    }
}
