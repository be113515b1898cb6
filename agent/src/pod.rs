//! Which pod a capture is: [`PodRef`], a pod's name with the sandbox the runtime made for it
//! (the capture's key and its network namespace; the name alone, as errors, logs and events
//! show it, is the policy model's [`PodName`]). [`Sandbox`] is what a capture is asked for: a
//! [`PodRef`] with what the runtime (or the API, for a pod captured in place) says of the pod
//! besides. The plugin's wire form of it is `api`'s alone.
use std::{
    fmt,
    net::IpAddr,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
};

use meshcap_policy::PodName;
use serde::{Deserialize, Serialize};

/// A captured pod: its name and its sandbox.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PodRef {
    /// `metadata.namespace`.
    pub namespace: String,
    /// `metadata.name`.
    pub name: String,
    /// The sandbox (pause) container's ID, as CNI names it: the key of a capture.
    pub container_id: String,
    /// The sandbox's network namespace file (may be empty on DEL: the runtime may have
    /// removed it already).
    pub netns: PathBuf,
}

impl PodRef {
    /// The pod's namespace and name.
    #[must_use]
    pub fn pod_name(&self) -> PodName {
        PodName {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
        }
    }

    /// Whether this pod's netns file names the same namespace as `netns` ([`same_netns`]).
    #[must_use]
    pub fn in_netns(&self, netns: &Path) -> bool {
        same_netns(&self.netns, netns)
    }
}

impl fmt::Display for PodRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pod {}/{}", self.namespace, self.name)
    }
}

/// What a capture is asked for: the pod and its sandbox, with what is known of it besides.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sandbox {
    /// The pod and its sandbox.
    pub pod: PodRef,
    /// `metadata.uid`, when the runtime passed it (`K8S_POD_UID`) or the API said it.
    pub uid: Option<String>,
    /// The pod's addresses (the runtime's `prevResult`, or the pod's status); empty: they
    /// are read in its netns.
    pub ips: Vec<IpAddr>,
}

impl Sandbox {
    /// A running pod captured in place by `by`, found in `netns` by its `ips`: recorded under
    /// an id of meshcap's ([`InPlace::container_id`]), as no runtime named its sandbox.
    #[must_use]
    pub fn in_place(
        pod: PodName,
        uid: &str,
        by: InPlace,
        netns: PathBuf,
        ips: Vec<IpAddr>,
    ) -> Self {
        Self {
            pod: PodRef {
                namespace: pod.namespace,
                name: pod.name,
                container_id: by.container_id(uid),
                netns,
            },
            uid: Some(uid.to_owned()),
            ips,
        }
    }
}

/// What the ids of captures made in place begin with: meshcap records a running pod it
/// captures (the repair controller), enrolls (ambient mode's live enrollment) or adopts from
/// istio-cni (its sidecar rules, at start) under an id of its own, as no runtime told it the pod's sandbox id. The runtime's DEL finds such a capture
/// by the pod's netns; its GC, which lists only sandbox ids, leaves it alone: it goes with a
/// DEL, or with its netns.
const IN_PLACE: &str = "in-place:";

/// Who captures a running pod in place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InPlace {
    /// The repair controller.
    Repair,
    /// Ambient mode's live enrollment.
    Ambient,
    /// The adoption of istio-cni's sidecar capture at start (the `takeover` module).
    Istio,
}

impl InPlace {
    /// The id a pod with `uid` captured in place this way is recorded under.
    #[must_use]
    pub fn container_id(self, uid: &str) -> String {
        let by = match self {
            Self::Repair => "repair",
            Self::Ambient => "ambient",
            Self::Istio => "istio-cni",
        };
        format!("{IN_PLACE}{by}:{uid}")
    }
}

/// Whether a capture recorded under `container_id` was made in place ([`InPlace`]).
#[must_use]
pub fn made_in_place(container_id: &str) -> bool {
    container_id.starts_with(IN_PLACE)
}

/// A file name for what is recorded about one container: its id as the runtime gave it (hex,
/// in practice), anything else in it replaced, so that no id names a path elsewhere.
#[must_use]
pub fn record_file_name(container_id: &str) -> String {
    let safe: String = container_id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("{safe}.json")
}

/// Whether two netns paths name the same namespace file (`/run/netns/x` and
/// `/var/run/netns/x` are one); an empty path names none.
#[must_use]
pub fn same_netns(a: &Path, b: &Path) -> bool {
    if a.as_os_str().is_empty() || b.as_os_str().is_empty() {
        return false;
    }
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
        _ => a == b,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_made_in_place_are_told_apart() {
        let id = InPlace::Repair.container_id("u-1");
        assert_eq!(id, "in-place:repair:u-1");
        assert_eq!(InPlace::Ambient.container_id("u-1"), "in-place:ambient:u-1");
        assert_eq!(InPlace::Istio.container_id("u-1"), "in-place:istio-cni:u-1");
        assert!(made_in_place(&id));
        assert!(!made_in_place("c0ffee"));
        assert_eq!(record_file_name(&id), "in-place_repair_u-1.json");
    }
}
