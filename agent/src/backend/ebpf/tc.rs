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
use crate::podnet::{
    self, Visit,
    tc::{self, Filter},
};

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
/// netns, and records it at `record`. Nothing is left attached without its record.
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
        TcAttach::Netlink => {
            let netlink = visit.netlink()?;
            let filter = tc::attach(netlink, ifindex, ifname, stub, stub::NAME)?;
            let pinned = fs::create_dir(record)
                .and_then(|()| sys::obj_pin(stub, &record.join(filter_record_name(&filter))));
            if let Err(e) = pinned {
                let _ = fs::remove_dir(record);
                let _ = tc::detach(
                    netlink,
                    ifindex,
                    ifname,
                    sys::prog_id(stub).unwrap_or(0),
                    filter,
                );
                return Err(EbpfError::io(
                    &format!(
                        "recording the TC filter of {ifname} at {}",
                        record.display()
                    ),
                    e,
                ));
            }
            Ok(())
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
        if let (Ok((filter, id)), Ok(ifindex)) = (
            read_netlink_record(record),
            nix::net::if_::if_nametoindex(ifname),
        ) {
            let detached = visit
                .netlink()
                .and_then(|netlink| tc::detach(netlink, ifindex, ifname, id, filter));
            if let Err(err) = detached {
                tracing::warn!(interface = ifname, error = %err, "detaching the TC filter");
            }
        }
        pins::remove_tree(record);
    } else {
        let _ = pins::unpin_link(record);
    }
}

/// Detaches meshcap's stub from every interface of the visited netns that has none of
/// `records` (interface, record) yet runs it: a filter whose record was removed behind
/// meshcap's back. Recognised by its place and its program's name; its qdisc stays (whether
/// meshcap added it went with the record).
pub fn detach_unrecorded(visit: &mut Visit, records: &[(String, PathBuf)]) {
    let interfaces = match podnet::inspect(visit, false) {
        Ok(net) => net.interfaces,
        Err(err) => {
            tracing::warn!(error = %err, "listing interfaces for unrecorded TC filters");
            return;
        }
    };
    for (ifindex, ifname) in interfaces {
        if records.iter().any(|(name, _)| *name == ifname) {
            continue;
        }
        let removed = visit.netlink().and_then(|netlink| {
            match tc::find_named(netlink, ifindex, &ifname, stub::NAME)? {
                Some((filter, id)) => {
                    tc::detach(netlink, ifindex, &ifname, id, filter).map(|()| true)
                }
                None => Ok(false),
            }
        });
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
