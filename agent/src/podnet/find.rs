//! Finding a running pod's network namespace without kubelet or the runtime. Istio walks
//! `/host/proc` for the oldest process whose namespace holds the pod's IP
//! (`cni/pkg/repair/netns_linux.go`), which needs the host's PID namespace and ptrace access to
//! every process. meshcap looks where runtimes bind-mount pod namespaces (`/var/run/netns`,
//! already mounted into the agent for the CNI path) and enters each to find the one holding the
//! pod's addresses: no `/proc`, no `CAP_SYS_PTRACE`. Two namespaces holding the same address
//! (a leaked one beside the live pod's) are refused rather than guessed between.
use std::{
    net::IpAddr,
    path::{Path, PathBuf},
};

use super::{global_addresses, run_in};

/// Why no namespace was chosen.
#[derive(Debug, thiserror::Error)]
pub enum FindError {
    /// The pod has no address yet.
    #[error("the pod has no IP in its status yet")]
    NoAddress,
    /// The directory could not be read.
    #[error("reading {dir}: {source}")]
    Read {
        /// The directory.
        dir: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// No namespace holds the addresses.
    #[error("no network namespace in {dir} holds {ips:?}")]
    NotFound {
        /// The directory searched.
        dir: PathBuf,
        /// The pod's addresses.
        ips: Vec<IpAddr>,
    },
    /// More than one does.
    #[error("{ips:?} is held by more than one network namespace: {found:?}")]
    Ambiguous {
        /// The pod's addresses.
        ips: Vec<IpAddr>,
        /// The namespaces.
        found: Vec<PathBuf>,
    },
}

/// The namespace file in `dir` whose interfaces hold one of `ips`. Blocking (enters each
/// namespace on a thread of its own).
///
/// # Errors
/// See [`FindError`].
pub fn find(dir: &Path, ips: &[IpAddr]) -> Result<PathBuf, FindError> {
    if ips.is_empty() {
        return Err(FindError::NoAddress);
    }
    let entries = std::fs::read_dir(dir).map_err(|source| FindError::Read {
        dir: dir.to_owned(),
        source,
    })?;
    let mut found: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|path| {
            run_in(path, |_| global_addresses())
                .ok()
                .and_then(Result::ok)
                .is_some_and(|held| ips.iter().any(|ip| held.contains(ip)))
        })
        .collect();
    match found.len() {
        0 => Err(FindError::NotFound {
            dir: dir.to_owned(),
            ips: ips.to_vec(),
        }),
        1 => Ok(found.remove(0)),
        _ => Err(FindError::Ambiguous {
            ips: ips.to_vec(),
            found,
        }),
    }
}
