//! The pinned layout: every path under the backend's bpffs directory, named in one place.
//! The pins are the backend's source of truth across agent restarts (a restarted agent adopts
//! what they say, and rebuilds its in-memory index from them); the tests read them through
//! this type too.
//!
//! ```text
//! maps/<MAP>                                   every map, adopted as is when present
//! links/<program>                              the node-wide cgroup links (bpf_link pins)
//! pods/<cookie>/pod@<namespace>@<name>@<id>/    which pod a netns cookie belongs to
//! pods/<cookie>/tc-<ifname>/filter@<pref>@<handle>@<own|shared>-qdisc
//!                                              its netlink TC filter (the default): the
//!                                              pinned stub
//! pods/<cookie>/tc-<ifname>/qdisc-intent/      while attaching, before the filter is
//!                                              recorded: meshcap may have added the
//!                                              clsact qdisc; or, with TCX (Linux 6.6+):
//! pods/<cookie>/tc-<ifname>                    the pod's TCX link
//! pods/<cookie>/handoff                        the socket lookup program's link on the
//!                                              pod's netns (before Linux 6.5)
//! pods/<cookie>/fwmark-accept@<value>/         the pod's tcp_fwmark_accept before meshcap
//!                                              set it
//! ```
use std::{
    fs, io,
    path::{Path, PathBuf},
};

use super::sys;
use crate::{pod::PodRef, podnet::tc::Filter, policy::DataplaneMode};

/// The directory in a netlink TC record that says, until the filter's own record is pinned,
/// that meshcap may have added the interface's clsact qdisc (written ahead of the netlink
/// request, so that an agent killed before the record exists leaves nothing unrecorded).
pub const QDISC_INTENT: &str = "qdisc-intent";

/// A pod the backend captures, as the pins record it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PinnedPod {
    /// `metadata.namespace`.
    pub namespace: String,
    /// `metadata.name`.
    pub name: String,
    /// The sandbox container id.
    pub container_id: String,
    /// The pod's netns cookie (the maps' key).
    pub netns_cookie: u64,
    /// Interfaces with the inbound TC program.
    pub interfaces: Vec<String>,
    /// Captured for ztunnel (ambient mode), not for a sidecar.
    pub ambient: bool,
}

impl PinnedPod {
    /// The mode it is captured for.
    #[must_use]
    pub const fn mode(&self) -> DataplaneMode {
        if self.ambient {
            DataplaneMode::Ambient
        } else {
            DataplaneMode::Sidecar
        }
    }

    /// The pod, as backends name it. The pins record the netns cookie, not the runtime's
    /// netns path, which stays empty.
    #[must_use]
    pub fn pod_ref(&self) -> PodRef {
        PodRef {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            container_id: self.container_id.clone(),
            netns: PathBuf::new(),
        }
    }
}

/// One layout directory (`/sys/fs/bpf/meshcap/v3`, or a test's own).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pins {
    root: PathBuf,
}

impl Pins {
    /// The layout under `root`.
    #[must_use]
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// The layout directory itself.
    #[must_use]
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `maps/`.
    #[must_use]
    pub fn maps(&self) -> PathBuf {
        self.root.join("maps")
    }

    /// `maps/<name>`.
    #[must_use]
    pub fn map(&self, name: &str) -> PathBuf {
        self.maps().join(name)
    }

    /// `links/`.
    #[must_use]
    pub fn links(&self) -> PathBuf {
        self.root.join("links")
    }

    /// `links/<program>`: a node-wide program's cgroup link.
    #[must_use]
    pub fn link(&self, program: &str) -> PathBuf {
        self.links().join(program)
    }

    /// `pods/`.
    #[must_use]
    pub fn pods(&self) -> PathBuf {
        self.root.join("pods")
    }

    /// `pods/<cookie>/`: everything of the pod with this netns cookie.
    #[must_use]
    pub fn pod(&self, cookie: u64) -> PathBuf {
        self.pods().join(cookie.to_string())
    }

    /// `pods/<cookie>/pod@<namespace>@<name>@<container>`: which pod the cookie is.
    #[must_use]
    pub fn pod_record(&self, cookie: u64, pod: &PodRef) -> PathBuf {
        self.pod(cookie).join(pod_record_name(pod))
    }

    /// `pods/<cookie>/ambient`: present when the pod is captured for ztunnel.
    #[must_use]
    pub fn ambient_marker(&self, cookie: u64) -> PathBuf {
        self.pod(cookie).join(AMBIENT_MARKER)
    }

    /// `pods/<cookie>/fwmark-accept@<value>`: the pod's `net.ipv4.tcp_fwmark_accept` before
    /// meshcap set it, put back when the pod is released with its netns alive.
    #[must_use]
    pub fn fwmark_accept_record(&self, cookie: u64, before: u8) -> PathBuf {
        self.pod(cookie)
            .join(format!("{FWMARK_ACCEPT_PREFIX}{before}"))
    }

    /// The pod's `net.ipv4.tcp_fwmark_accept` before meshcap set it, if recorded.
    #[must_use]
    pub fn fwmark_accept_before(&self, cookie: u64) -> Option<u8> {
        list_dir(&self.pod(cookie))
            .iter()
            .find_map(|name| name.strip_prefix(FWMARK_ACCEPT_PREFIX)?.parse().ok())
    }

    /// `pods/<cookie>/handoff`: the link of the socket lookup program on the pod's netns.
    #[must_use]
    pub fn handoff_link(&self, cookie: u64) -> PathBuf {
        self.pod(cookie).join("handoff")
    }

    /// `pods/<cookie>/tc-<ifname>`: the record of the pod's stub on one interface (a
    /// directory holding the netlink filter's record, or the TCX link's pin).
    #[must_use]
    pub fn tc_record(&self, cookie: u64, ifname: &str) -> PathBuf {
        self.pod(cookie).join(format!("{TC_PREFIX}{ifname}"))
    }

    /// The pod's stub records: (interface, record).
    #[must_use]
    pub fn tc_records(&self, cookie: u64) -> Vec<(String, PathBuf)> {
        let dir = self.pod(cookie);
        list_dir(&dir)
            .into_iter()
            .filter_map(|name| Some((name.strip_prefix(TC_PREFIX)?.to_owned(), dir.join(&name))))
            .collect()
    }

    /// Creates `maps/`, `links/` and `pods/`.
    ///
    /// # Errors
    /// When a directory cannot be created.
    pub fn create_dirs(&self) -> io::Result<()> {
        for dir in [self.maps(), self.links(), self.pods()] {
            fs::create_dir_all(dir)?;
        }
        Ok(())
    }

    /// Every pod pinned here (only names are read, so this works for any layout version).
    #[must_use]
    pub fn pinned_pods(&self) -> Vec<PinnedPod> {
        let pods_dir = self.pods();
        let mut out = Vec::new();
        for cookie_name in list_dir(&pods_dir) {
            let Ok(cookie) = cookie_name.parse::<u64>() else {
                continue;
            };
            let names = list_dir(&pods_dir.join(&cookie_name));
            let Some((namespace, name, container_id)) =
                names.iter().find_map(|n| parse_pod_record_name(n))
            else {
                continue;
            };
            out.push(PinnedPod {
                namespace,
                name,
                container_id,
                netns_cookie: cookie,
                interfaces: names
                    .iter()
                    .filter_map(|n| n.strip_prefix(TC_PREFIX).map(str::to_owned))
                    .collect(),
                ambient: names.iter().any(|n| n == AMBIENT_MARKER),
            });
        }
        out
    }
}

const TC_PREFIX: &str = "tc-";
/// The directory marking a pod captured for ztunnel (bpffs holds no plain files).
const AMBIENT_MARKER: &str = "ambient";
const FWMARK_ACCEPT_PREFIX: &str = "fwmark-accept@";

/// The name recording which pod a cookie is (`@` is not in Kubernetes names): also the key
/// of the backend's index of pods.
#[must_use]
pub fn pod_record_name(pod: &PodRef) -> String {
    format!("pod@{}@{}@{}", pod.namespace, pod.name, pod.container_id)
}

fn parse_pod_record_name(name: &str) -> Option<(String, String, String)> {
    let mut parts = name.strip_prefix("pod@")?.splitn(3, '@');
    Some((
        parts.next()?.to_owned(),
        parts.next()?.to_owned(),
        parts.next()?.to_owned(),
    ))
}

/// The name the pod's stub is pinned under in a netlink filter's record, saying where the
/// filter is: `filter@<priority>@<handle>@<own-qdisc|shared-qdisc>`.
#[must_use]
pub fn filter_record_name(filter: &Filter) -> String {
    let qdisc = if filter.created_qdisc {
        "own-qdisc"
    } else {
        "shared-qdisc"
    };
    format!("filter@{}@{}@{qdisc}", filter.priority, filter.handle)
}

/// The inverse of [`filter_record_name`].
#[must_use]
pub fn parse_filter_record_name(name: &str) -> Option<Filter> {
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

/// The names in a directory (none when it cannot be read).
#[must_use]
pub fn list_dir(dir: &Path) -> Vec<String> {
    fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Removes a bpffs tree: pins are files (links are detached first), the rest directories.
pub fn remove_tree(dir: &Path) {
    for name in list_dir(dir) {
        let path = dir.join(name);
        if path.is_dir() {
            remove_tree(&path);
        } else {
            let _ = unpin_link(&path);
        }
    }
    let _ = fs::remove_dir(dir);
}

/// Detaches the link pinned at `path` now (when it is a link) and removes the pin. Only
/// unlinking the pin would detach it later, from a kernel workqueue.
///
/// # Errors
/// When the pin cannot be removed.
pub fn unpin_link(path: &Path) -> io::Result<()> {
    if let Ok(fd) = sys::obj_get(path) {
        // Maps and netlink-era leftovers are not links: EINVAL, and nothing to detach.
        let _ = sys::link_detach(&fd);
    }
    fs::remove_file(path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::podnet::tc::{HANDLE, PRIORITY};

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
        let pins = Pins::new("/sys/fs/bpf/meshcap/v3");
        let record = pins.pod_record(7, &pod);
        assert_eq!(
            record,
            Path::new("/sys/fs/bpf/meshcap/v3/pods/7/pod@shop@web-1@c0ffee")
        );
        let name = record.file_name().unwrap().to_str().unwrap();
        assert_eq!(
            parse_pod_record_name(name),
            Some(("shop".into(), "web-1".into(), "c0ffee".into()))
        );
        assert_eq!(
            pins.tc_record(7, "eth0"),
            Path::new("/sys/fs/bpf/meshcap/v3/pods/7/tc-eth0")
        );
    }
}
