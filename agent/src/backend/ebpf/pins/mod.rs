//! The pinned layout: every path under the backend's bpffs directory, named in one place
//! ([`Pins`]; a pod's own through [`PodPins`], the handle that creates, marks and removes
//! them). The pins are the backend's source of truth across agent restarts (a restarted agent
//! adopts what they say, and rebuilds its in-memory index from them); the tests read them
//! through these types too.
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
//! pods/<cookie>/ambient/                       the pod is captured for ztunnel (ambient
//!                                              mode), not for a sidecar
//! ```
use std::{
    fs, io,
    path::{Path, PathBuf},
};

mod pod;

use meshcap_policy::DataplaneMode;
pub use pod::{PodPins, RecordError, TcRecord, record_name};

use super::sys;
use crate::pod::PodRef;

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
    pub fn pod(&self, cookie: u64) -> PodPins {
        PodPins::new(self.pods().join(cookie.to_string()))
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
                names.iter().find_map(|n| pod::parse_record_name(n))
            else {
                continue;
            };
            out.push(PinnedPod {
                namespace,
                name,
                container_id,
                netns_cookie: cookie,
                interfaces: pod::tc_interfaces(&names).collect(),
                ambient: names.iter().any(|n| n == pod::AMBIENT_MARKER),
            });
        }
        out
    }
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

/// Detaches the link pinned at `path` and leaves the pin: what another tool's
/// `BPF_LINK_DETACH` (`bpftool link detach`) does behind meshcap's back.
///
/// # Errors
/// When the pin cannot be opened or is not a link.
pub fn detach_link(path: &Path) -> io::Result<()> {
    sys::link_detach(sys::obj_get(path)?)
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
