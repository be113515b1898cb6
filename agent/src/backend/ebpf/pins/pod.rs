//! One pod's pins, `pods/<cookie>/`: the handle through which the backend creates, marks,
//! reads and removes every one of them ([`PodPins`]), and the record of its stub on one
//! interface ([`TcRecord`]).
use std::{
    fs, io,
    os::fd::{AsFd, OwnedFd},
    path::{Path, PathBuf},
};

use meshcap_policy::Family;

use super::{list_dir, remove_tree, sys, unpin_link};
use crate::{pod::PodRef, podnet::clsact::Filter};

/// The directory in a netlink TC record that says, until the filter's own record is pinned,
/// that meshcap may have added the interface's clsact qdisc (written ahead of the netlink
/// request, so that an agent killed before the record exists leaves nothing unrecorded).
const QDISC_INTENT: &str = "qdisc-intent";
const TC_PREFIX: &str = "tc-";
/// The directory marking a pod captured for ztunnel (bpffs holds no plain files).
pub(super) const AMBIENT_MARKER: &str = "ambient";
const FWMARK_ACCEPT_PREFIX: &str = "fwmark-accept@";
const ROUTE_FOUND_PREFIX: &str = "route-found@";
const HANDOFF: &str = "handoff";
/// The directory marking a pod whose netns keeps netfilter's NAT hooks (moved in from Istio's
/// rules, or being handed back to them): every captured SYN goes through the socket lookup.
const NAT_HOOKS: &str = "nat-hooks";

/// The pins of the pod with one netns cookie.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodPins {
    dir: PathBuf,
}

impl PodPins {
    pub(super) const fn new(dir: PathBuf) -> Self {
        Self { dir }
    }

    /// `pods/<cookie>/`.
    #[must_use]
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether anything is pinned for the pod.
    #[must_use]
    pub fn exists(&self) -> bool {
        self.dir.exists()
    }

    /// Records which pod the cookie is (`pod@<namespace>@<name>@<container>`): the first
    /// pin of a capture, before anything is attached.
    ///
    /// # Errors
    /// When bpffs refuses the directory.
    pub fn create(&self, pod: &PodRef) -> io::Result<()> {
        fs::create_dir_all(self.dir.join(record_name(pod)))
    }

    /// Marks the pod captured for ztunnel (ambient mode), not for a sidecar.
    ///
    /// # Errors
    /// When bpffs refuses the directory.
    pub fn mark_ambient(&self) -> io::Result<()> {
        fs::create_dir_all(self.dir.join(AMBIENT_MARKER))
    }

    /// Marks the pod's netns as keeping netfilter's NAT hooks: an entry written again later (an
    /// update, or a repair of an entry deleted behind meshcap's back) keeps the socket lookup
    /// for every captured SYN, which the map entry alone cannot tell once it is gone.
    ///
    /// # Errors
    /// When bpffs refuses the directory.
    pub fn mark_nat_hooks(&self) -> io::Result<()> {
        fs::create_dir_all(self.dir.join(NAT_HOOKS))
    }

    /// Whether [`Self::mark_nat_hooks`] marked the pod.
    #[must_use]
    pub fn keeps_nat_hooks(&self) -> bool {
        self.dir.join(NAT_HOOKS).exists()
    }

    /// The pod's `net.ipv4.tcp_fwmark_accept` before meshcap set it, if recorded.
    #[must_use]
    pub fn fwmark_accept_before(&self) -> Option<u8> {
        list_dir(&self.dir)
            .iter()
            .find_map(|name| name.strip_prefix(FWMARK_ACCEPT_PREFIX)?.parse().ok())
    }

    /// Records the pod's `net.ipv4.tcp_fwmark_accept` before meshcap sets it
    /// (`fwmark-accept@<value>`), put back when the pod is released with its netns alive.
    ///
    /// # Errors
    /// When bpffs refuses the directory.
    pub fn record_fwmark_accept(&self, before: u8) -> io::Result<()> {
        fs::create_dir_all(self.fwmark_accept(before))
    }

    /// Forgets the recorded `net.ipv4.tcp_fwmark_accept` (it was put back).
    pub fn forget_fwmark_accept(&self, before: u8) {
        remove_tree(&self.fwmark_accept(before));
    }

    fn fwmark_accept(&self, before: u8) -> PathBuf {
        self.dir.join(format!("{FWMARK_ACCEPT_PREFIX}{before}"))
    }

    /// The families whose policy route the pod's netns held before its capture
    /// (`route-found@v4`, `route-found@v6`): istio-cni's, never removed by meshcap.
    #[must_use]
    pub fn found_routes(&self) -> Vec<Family> {
        list_dir(&self.dir)
            .iter()
            .filter_map(|name| match name.strip_prefix(ROUTE_FOUND_PREFIX)? {
                "v4" => Some(Family::V4),
                "v6" => Some(Family::V6),
                _ => None,
            })
            .collect()
    }

    /// Records `found` ([`Self::found_routes`]).
    ///
    /// # Errors
    /// When bpffs refuses the directory.
    pub fn record_found_routes(&self, found: &[Family]) -> io::Result<()> {
        for family in found {
            let name = match family {
                Family::V4 => "v4",
                Family::V6 => "v6",
            };
            fs::create_dir_all(self.dir.join(format!("{ROUTE_FOUND_PREFIX}{name}")))?;
        }
        Ok(())
    }

    /// Forgets [`Self::found_routes`]: the routes are the capture's own from now on.
    pub fn forget_found_routes(&self) {
        for name in list_dir(&self.dir) {
            if name.starts_with(ROUTE_FOUND_PREFIX) {
                remove_tree(&self.dir.join(name));
            }
        }
    }

    /// `handoff`: the link of the socket lookup program on the pod's netns.
    #[must_use]
    pub fn handoff_link(&self) -> PathBuf {
        self.dir.join(HANDOFF)
    }

    /// The record of the pod's stub on `ifname` (`tc-<ifname>`).
    #[must_use]
    pub fn tc(&self, ifname: &str) -> TcRecord {
        TcRecord {
            ifname: ifname.to_owned(),
            path: self.dir.join(format!("{TC_PREFIX}{ifname}")),
        }
    }

    /// The records of the pod's stubs, one per interface.
    #[must_use]
    pub fn tc_records(&self) -> Vec<TcRecord> {
        tc_interfaces(&list_dir(&self.dir))
            .map(|ifname| self.tc(&ifname))
            .collect()
    }

    /// Removes every pin of the pod (links are detached first).
    pub fn remove(&self) {
        remove_tree(&self.dir);
    }
}

/// The interfaces that names in a pod's directory record stubs on.
pub(super) fn tc_interfaces(names: &[String]) -> impl Iterator<Item = String> + '_ {
    names
        .iter()
        .filter_map(|n| n.strip_prefix(TC_PREFIX).map(str::to_owned))
}

/// The record of the pod's stub on one interface: a directory holding the netlink filter's
/// record (the stub pinned under the filter's place), or the TCX link's pin itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TcRecord {
    ifname: String,
    path: PathBuf,
}

/// A netlink TC record that cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// The record names no filter.
    #[error("{0} records no TC filter")]
    NoFilter(PathBuf),
    /// A pin cannot be opened.
    #[error("opening {path}: {source}")]
    Open {
        /// The pin.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The pinned program cannot be asked its id.
    #[error("{path}: {source}")]
    Program {
        /// The pin.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
}

impl TcRecord {
    /// The interface.
    #[must_use]
    pub fn ifname(&self) -> &str {
        &self.ifname
    }

    /// Where it is pinned.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether a stub is recorded on the interface.
    #[must_use]
    pub fn exists(&self) -> bool {
        self.path.exists()
    }

    /// Whether it records a netlink filter (rather than a TCX link).
    #[must_use]
    pub fn is_filter(&self) -> bool {
        self.path.is_dir()
    }

    /// Pins a TCX link as the record.
    ///
    /// # Errors
    /// When bpffs refuses the pin.
    pub fn pin_link(&self, link: impl AsFd) -> io::Result<()> {
        sys::obj_pin(link, &self.path)
    }

    /// The pinned TCX link.
    ///
    /// # Errors
    /// When it is not there.
    pub fn link(&self) -> Result<OwnedFd, RecordError> {
        sys::obj_get(&self.path).map_err(|source| RecordError::Open {
            path: self.path.clone(),
            source,
        })
    }

    /// Written ahead of a netlink filter: the record's directory and its qdisc intent, before
    /// the kernel is asked for anything.
    ///
    /// # Errors
    /// When bpffs refuses either directory (then neither is left).
    pub fn begin_filter(&self) -> io::Result<()> {
        fs::create_dir(&self.path)?;
        if let Err(e) = fs::create_dir(self.path.join(QDISC_INTENT)) {
            let _ = fs::remove_dir(&self.path);
            return Err(e);
        }
        Ok(())
    }

    /// meshcap did not add the interface's qdisc: the intent goes.
    pub fn drop_intent(&self) {
        let _ = fs::remove_dir(self.path.join(QDISC_INTENT));
    }

    /// Whether meshcap may have added the interface's qdisc with no filter record saying so
    /// (an attach cut short).
    #[must_use]
    pub fn may_own_qdisc(&self) -> bool {
        self.path.join(QDISC_INTENT).is_dir()
    }

    /// Pins `stub` under `filter`'s place: from now on the filter's record says whose the
    /// qdisc is, and the intent goes.
    ///
    /// # Errors
    /// When bpffs refuses the pin.
    pub fn pin_filter(&self, stub: impl AsFd, filter: &Filter) -> io::Result<()> {
        sys::obj_pin(stub, &self.path.join(filter_record_name(filter)))?;
        self.drop_intent();
        Ok(())
    }

    /// The recorded filter's place and its program's id.
    ///
    /// # Errors
    /// When the record names no filter or its pin cannot be read.
    pub fn filter(&self) -> Result<(Filter, u32), RecordError> {
        let entries = list_dir(&self.path);
        let (name, filter) = entries
            .iter()
            .find_map(|n| Some((n, parse_filter_record_name(n)?)))
            .ok_or_else(|| RecordError::NoFilter(self.path.clone()))?;
        let path = self.path.join(name);
        let prog = sys::obj_get(&path).map_err(|source| RecordError::Open {
            path: path.clone(),
            source,
        })?;
        let id = sys::prog_id(&prog).map_err(|source| RecordError::Program { path, source })?;
        Ok((filter, id))
    }

    /// Removes the record (a TCX link is detached first).
    pub fn remove(&self) {
        if self.is_filter() {
            remove_tree(&self.path);
        } else {
            let _ = unpin_link(&self.path);
        }
    }
}

/// The name recording which pod a cookie is (`@` is not in Kubernetes names): also the key
/// of the backend's index of pods.
#[must_use]
pub fn record_name(pod: &PodRef) -> String {
    format!("pod@{}@{}@{}", pod.namespace, pod.name, pod.container_id)
}

/// The inverse of [`record_name`]: namespace, name and container.
pub(super) fn parse_record_name(name: &str) -> Option<(String, String, String)> {
    let mut parts = name.strip_prefix("pod@")?.splitn(3, '@');
    Some((
        parts.next()?.to_owned(),
        parts.next()?.to_owned(),
        parts.next()?.to_owned(),
    ))
}

/// The name the pod's stub is pinned under in a netlink filter's record, saying where the
/// filter is: `filter@<priority>@<handle>@<own-qdisc|shared-qdisc>`.
fn filter_record_name(filter: &Filter) -> String {
    let qdisc = if filter.created_qdisc {
        "own-qdisc"
    } else {
        "shared-qdisc"
    };
    format!("filter@{}@{}@{qdisc}", filter.priority, filter.handle)
}

/// The inverse of [`filter_record_name`].
fn parse_filter_record_name(name: &str) -> Option<Filter> {
    let mut parts = name.strip_prefix("filter@")?.split('@');
    let filter = Filter {
        priority: parts.next()?.parse().ok()?,
        handle: parts.next()?.parse().ok()?,
        created_qdisc: match parts.next()? {
            "own-qdisc" => true,
            "shared-qdisc" => false,
            _ => return None,
        },
    };
    parts.next().is_none().then_some(filter)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        backend::ebpf::Pins,
        podnet::clsact::{HANDLE, PRIORITY},
    };

    #[test]
    fn filter_records_round_trip() {
        for created_qdisc in [true, false] {
            let filter = Filter {
                priority: PRIORITY,
                handle: HANDLE,
                created_qdisc,
            };
            assert_eq!(
                parse_filter_record_name(&filter_record_name(&filter)),
                Some(filter)
            );
        }
        assert_eq!(
            parse_filter_record_name("filter@49153@1@own-qdisc"),
            Some(Filter {
                priority: 0xc001,
                handle: 1,
                created_qdisc: true
            })
        );
        for bad in [
            "filter@49153@1",
            "filter@49153@1@mine",
            "filter@x@1@own-qdisc",
            "filter@49153@1@own-qdisc@more",
            "pod@default@web@c1",
        ] {
            assert_eq!(parse_filter_record_name(bad), None, "{bad}");
        }
    }

    #[test]
    fn pod_records_round_trip() {
        let pod = PodRef {
            namespace: "shop".into(),
            name: "web-1".into(),
            container_id: "c0ffee".into(),
            netns: PathBuf::new(),
        };
        let pins = Pins::new("/sys/fs/bpf/meshcap/v3").pod(7);
        let name = record_name(&pod);
        assert_eq!(
            pins.dir().join(&name),
            Path::new("/sys/fs/bpf/meshcap/v3/pods/7/pod@shop@web-1@c0ffee")
        );
        assert_eq!(
            parse_record_name(&name),
            Some(("shop".into(), "web-1".into(), "c0ffee".into()))
        );
        assert_eq!(
            pins.tc("eth0").path(),
            Path::new("/sys/fs/bpf/meshcap/v3/pods/7/tc-eth0")
        );
    }
}
