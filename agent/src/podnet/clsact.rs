//! A `cls_bpf` direct-action filter on the ingress of a `clsact` qdisc, over netlink: how a
//! pod's inbound stub is attached by default (every kernel; TCX is the backend's own, through
//! `bpf_link`). meshcap's filter sits at its own priority and handle ([`PRIORITY`],
//! [`HANDLE`]), so that meshcap finds, checks and deletes exactly its filter and never another
//! tool's. Such a filter outlives the agent by itself (it holds its program) and dies with the
//! interface.
//!
//! Spoken directly over rtnetlink rather than through `tc`: no fork per interface, the kernel's
//! own errors, and the program id read back from the filter dump instead of parsed from text.
use std::{
    io,
    os::fd::{AsFd, AsRawFd as _},
};

use netlink_packet_core::{NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL};
use netlink_packet_route::{
    RouteNetlinkMessage,
    tc::{TcAttribute, TcBpfFlags, TcFilterBpfOption, TcHandle, TcHeader, TcMessage, TcOption},
};

use super::{Netlink, PodNetError, errno};

/// meshcap's filter priority: just after the first one the kernel gives a filter added
/// without one (0xc000, and lower for later ones), so that, like a TCX link appended last,
/// meshcap's stub runs after what other tools attached before it.
pub const PRIORITY: u16 = 0xc001;
/// meshcap's filter handle at [`PRIORITY`].
pub const HANDLE: u32 = 1;

/// `ETH_P_ALL`: the filter sees every protocol.
const ETH_P_ALL: u16 = 0x0003;

/// `ffff:0`, the clsact qdisc's own handle.
const CLSACT_HANDLE: TcHandle = TcHandle {
    major: 0xffff,
    minor: 0,
};
/// `ffff:fff2`: clsact's ingress hook, the filters' parent.
const INGRESS: TcHandle = TcHandle {
    major: 0xffff,
    minor: TcHandle::MIN_INGRESS,
};
/// `ffff:fff3`: clsact's egress hook.
const EGRESS: TcHandle = TcHandle {
    major: 0xffff,
    minor: TcHandle::MIN_EGRESS,
};

/// Where [`add_filter`] put meshcap's filter: what the backend records, and hands back to
/// [`find`] and [`detach`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Filter {
    /// The filter's priority (`tc ... pref`).
    pub priority: u16,
    /// Its handle at that priority.
    pub handle: u32,
    /// Whether meshcap added the clsact qdisc (it was not there): only then may it remove it,
    /// and only when no filter is left on it.
    pub created_qdisc: bool,
}

impl Filter {
    fn info(&self) -> u32 {
        (u32::from(self.priority) << 16) | u32::from(ETH_P_ALL.to_be())
    }
}

fn failed(what: String) -> impl FnOnce(io::Error) -> PodNetError {
    move |source| PodNetError::Netlink { what, source }
}

/// Adds the `clsact` qdisc to interface `ifindex` when it has none: whether meshcap added it
/// (only then may it remove it, see [`release_qdisc`]).
///
/// # Errors
/// When the kernel refuses, e.g. because another qdisc than clsact holds the ingress handle.
pub fn add_qdisc(netlink: &mut Netlink, ifindex: u32, ifname: &str) -> Result<bool, PodNetError> {
    match netlink.request(
        RouteNetlinkMessage::NewQueueDiscipline(clsact(ifindex)),
        NLM_F_CREATE | NLM_F_EXCL,
    ) {
        Ok(_) => Ok(true),
        Err(e) if errno(&e) == Some(libc::EEXIST) => Ok(false),
        Err(e) => Err(failed(format!("tc qdisc add dev {ifname} clsact"))(e)),
    }
}

/// Attaches `prog` (a direct-action classifier named `name`) at meshcap's place on the
/// ingress of interface `ifindex`, whose clsact qdisc [`add_qdisc`] made sure of
/// (`created_qdisc`: whether it added it), or replaces its program (atomically) when a
/// previous run left one without a record.
///
/// # Errors
/// When the kernel refuses.
pub fn add_filter(
    netlink: &mut Netlink,
    ifindex: u32,
    ifname: &str,
    created_qdisc: bool,
    prog: impl AsFd,
    name: &str,
) -> Result<Filter, PodNetError> {
    let filter = Filter {
        priority: PRIORITY,
        handle: HANDLE,
        created_qdisc,
    };
    let prog_fd = u32::try_from(prog.as_fd().as_raw_fd()).unwrap_or_default();
    let message = TcMessage::from_parts(
        header(ifindex, HANDLE.into(), INGRESS, filter.info()),
        vec![
            TcAttribute::Kind("bpf".into()),
            TcAttribute::Options(vec![
                TcOption::Bpf(TcFilterBpfOption::ProgFd(prog_fd)),
                TcOption::Bpf(TcFilterBpfOption::ProgName(name.to_owned())),
                TcOption::Bpf(TcFilterBpfOption::Flags(TcBpfFlags::DirectAction)),
            ]),
        ],
    );
    netlink
        .request(RouteNetlinkMessage::NewTrafficFilter(message), NLM_F_CREATE)
        .map_err(failed(format!(
            "tc filter replace dev {ifname} ingress pref {PRIORITY} handle {HANDLE:#x} bpf da"
        )))?;
    Ok(filter)
}

/// The program id of the `bpf` filter at `filter`'s place on the ingress of `ifindex`, if
/// there is one.
///
/// # Errors
/// When the filters cannot be listed.
pub fn find(
    netlink: &mut Netlink,
    ifindex: u32,
    ifname: &str,
    filter: Filter,
) -> Result<Option<u32>, PodNetError> {
    let filters = filters(netlink, ifindex, INGRESS)
        .map_err(failed(format!("tc filter show dev {ifname} ingress")))?;
    Ok(filters.iter().find_map(|found| {
        let ours = found.header.handle == TcHandle::from(filter.handle)
            && found.header.info >> 16 == u32::from(filter.priority)
            && found.attributes.contains(&TcAttribute::Kind("bpf".into()));
        if !ours {
            return None;
        }
        found
            .attributes
            .iter()
            .find_map(|attribute| match attribute {
                TcAttribute::Options(options) => options.iter().find_map(|o| match o {
                    TcOption::Bpf(TcFilterBpfOption::ProgId(id)) => Some(*id),
                    _ => None,
                }),
                _ => None,
            })
    }))
}

/// Whether a `bpf` filter at meshcap's place ([`PRIORITY`], [`HANDLE`]) on the ingress of
/// `ifindex` runs a program named `name`: meshcap's filter even when nothing records it (its
/// record was removed behind meshcap's back, or an attach was cut short before recording it).
/// The kernel reports a program's name beside its id, so a named filter is one with a program.
fn has_named(
    netlink: &mut Netlink,
    ifindex: u32,
    ifname: &str,
    name: &str,
) -> Result<bool, PodNetError> {
    let filters = filters(netlink, ifindex, INGRESS)
        .map_err(failed(format!("tc filter show dev {ifname} ingress")))?;
    Ok(filters.iter().any(|found| {
        let at_place = found.header.handle == TcHandle::from(HANDLE)
            && found.header.info >> 16 == u32::from(PRIORITY);
        let named = found.attributes.iter().any(|a| match a {
            TcAttribute::Options(options) => options
                .iter()
                .any(|o| matches!(o, TcOption::Bpf(TcFilterBpfOption::ProgName(n)) if n == name)),
            _ => false,
        });
        at_place && named
    }))
}

/// Deletes meshcap's filter from the ingress of `ifindex` when it runs `prog_id` (a filter at
/// that place with another program is not meshcap's record: left alone), then the clsact
/// qdisc when meshcap added it and no filter is left on it. Absent ones are fine.
///
/// # Errors
/// When the kernel refuses.
pub fn detach(
    netlink: &mut Netlink,
    ifindex: u32,
    ifname: &str,
    prog_id: u32,
    filter: Filter,
) -> Result<(), PodNetError> {
    if find(netlink, ifindex, ifname, filter)? == Some(prog_id) {
        delete_filter(netlink, ifindex, ifname, filter)?;
    }
    if filter.created_qdisc {
        release_qdisc(netlink, ifindex, ifname)?;
    }
    Ok(())
}

/// Deletes the `bpf` filter at `filter`'s place on the ingress of `ifindex`, whatever it runs
/// (the caller has checked); an absent one is fine.
fn delete_filter(
    netlink: &mut Netlink,
    ifindex: u32,
    ifname: &str,
    filter: Filter,
) -> Result<(), PodNetError> {
    let message = TcMessage::from_parts(
        header(ifindex, filter.handle.into(), INGRESS, filter.info()),
        vec![TcAttribute::Kind("bpf".into())],
    );
    match netlink.request(RouteNetlinkMessage::DelTrafficFilter(message), 0) {
        Err(e) if errno(&e) != Some(libc::ENOENT) => Err(failed(format!(
            "tc filter del dev {ifname} ingress pref {} handle {:#x} bpf",
            filter.priority, filter.handle
        ))(e)),
        _ => Ok(()),
    }
}

/// Deletes a filter at meshcap's place that was attached under the name `name` (its record
/// was removed behind meshcap's back, or an attach was cut short before recording it), then
/// the clsact qdisc when `created_qdisc` says meshcap may have added it and no filter is left
/// on it. Whether anything was there to delete.
///
/// # Errors
/// When the kernel refuses.
pub fn detach_named(
    netlink: &mut Netlink,
    ifindex: u32,
    ifname: &str,
    name: &str,
    created_qdisc: bool,
) -> Result<bool, PodNetError> {
    let found = has_named(netlink, ifindex, ifname, name)?;
    if found {
        let place = Filter {
            priority: PRIORITY,
            handle: HANDLE,
            created_qdisc,
        };
        delete_filter(netlink, ifindex, ifname, place)?;
    }
    if created_qdisc {
        release_qdisc(netlink, ifindex, ifname)?;
    }
    Ok(found)
}

/// Deletes the clsact qdisc of `ifindex` when no filter (either direction) is left on it:
/// another tool's filters mean it is shared by now. An absent one is fine.
///
/// # Errors
/// When the kernel refuses.
pub fn release_qdisc(netlink: &mut Netlink, ifindex: u32, ifname: &str) -> Result<(), PodNetError> {
    for parent in [INGRESS, EGRESS] {
        let left = filters(netlink, ifindex, parent)
            .map_err(failed(format!("tc filter show dev {ifname}")))?;
        if !left.is_empty() {
            return Ok(());
        }
    }
    match netlink.request(RouteNetlinkMessage::DelQueueDiscipline(clsact(ifindex)), 0) {
        Err(e) if !matches!(errno(&e), Some(libc::ENOENT | libc::EINVAL)) => {
            Err(failed(format!("tc qdisc del dev {ifname} clsact"))(e))
        }
        _ => Ok(()),
    }
}

fn clsact(ifindex: u32) -> TcMessage {
    TcMessage::from_parts(
        header(ifindex, CLSACT_HANDLE, TcHandle::CLSACT, 0),
        vec![TcAttribute::Kind("clsact".into())],
    )
}

fn header(ifindex: u32, handle: TcHandle, parent: TcHandle, info: u32) -> TcHeader {
    TcHeader {
        index: i32::try_from(ifindex).unwrap_or_default(),
        handle,
        parent,
        info,
        ..TcHeader::default()
    }
}

/// Every filter on `parent` of `ifindex` (none when there is no clsact qdisc). The kernel
/// also lists each priority's classifier itself (handle 0), which never matches a filter.
fn filters(netlink: &mut Netlink, ifindex: u32, parent: TcHandle) -> io::Result<Vec<TcMessage>> {
    let query = TcMessage::from_parts(header(ifindex, TcHandle::UNSPEC, parent, 0), vec![]);
    match netlink.request(RouteNetlinkMessage::GetTrafficFilter(query), NLM_F_DUMP) {
        Ok(messages) => Ok(messages
            .into_iter()
            .filter_map(|m| match m {
                RouteNetlinkMessage::NewTrafficFilter(f) if f.header.handle != TcHandle::UNSPEC => {
                    Some(f)
                }
                _ => None,
            })
            .collect()),
        Err(e) if errno(&e) == Some(libc::EINVAL) => Ok(Vec::new()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Priority in the upper half, `ETH_P_ALL` in network order in the lower half, as `tc`
    /// sends `protocol all pref N`.
    #[test]
    fn info_is_priority_and_protocol() {
        let filter = Filter {
            priority: 0xc001,
            handle: 1,
            created_qdisc: false,
        };
        assert_eq!(filter.info() >> 16, 0xc001);
        assert_eq!(u16::from_be((filter.info() & 0xffff) as u16), 0x0003);
    }
}
