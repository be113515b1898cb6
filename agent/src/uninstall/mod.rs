//! A real uninstall: meshcap's plugin entry, binaries and kubeconfig removed from the node's CNI
//! set-up, and its eBPF programs detached with their pins once no pod they capture lives — the
//! pods still captured first handed back to Istio's own rules ([`handback`]) when the caller
//! can find their policies.
//! Never on a restart, an upgrade, a drain or a crash: pods created before the next agent runs
//! would start uncaptured. Run by `meshcap-agent uninstall`, and by the agent itself when it is
//! stopped because meshcap is being deleted ([`verdict`], from what [`witness`] observed).
use std::path::{Path, PathBuf};

use meshcap_policy::ambient::HostProbeSnat;

use crate::{
    ambient::{self, AmbientError},
    backend::{
        ebpf::{EbpfError, layout},
        iptables::FlavourChoice,
    },
    install::{self, InstallConfig, InstallError},
};

pub mod handback;
pub mod placement;
pub mod verdict;
pub mod witness;

/// What an uninstall removed, and what it had to keep.
#[derive(Debug, Default)]
pub struct Removed {
    /// The CNI configuration directory and bin directory cleaned, when they were.
    pub cni: Option<(PathBuf, PathBuf)>,
    /// Layout directories detached and removed.
    pub layouts: Vec<PathBuf>,
    /// Layout directories kept because pods they capture live: (directory, `ns/name` of each).
    pub kept: Vec<(PathBuf, Vec<String>)>,
}

/// Errors of an uninstall.
#[derive(Debug, thiserror::Error)]
pub enum UninstallError {
    /// The CNI set-up could not be cleaned.
    #[error(transparent)]
    Install(#[from] InstallError),
    /// A layout could not be removed.
    #[error(transparent)]
    Ebpf(#[from] EbpfError),
    /// Ambient mode's probe rule or sets could not be removed from the node.
    #[error(transparent)]
    Ambient(#[from] AmbientError),
}

/// Removes meshcap from this node: the CNI set-up (`config`, unless `None`: a private agent
/// installed none), then every eBPF layout version beside `bpffs_dir` none of whose pods lives,
/// and the directory that held them once empty. A layout with live pods stays, so those pods
/// keep their capture until they restart.
///
/// # Errors
/// When a file or pin cannot be removed.
pub fn node(config: Option<&InstallConfig>, bpffs_dir: &Path) -> Result<Removed, UninstallError> {
    let mut removed = Removed::default();
    if let Some(config) = config {
        install::uninstall(config)?;
        removed.cni = Some((config.cni_conf_dir.clone(), config.cni_bin_dir.clone()));
    }
    for dir in layout::versions(bpffs_dir) {
        if !dir.exists() {
            continue;
        }
        let live = layout::live_pods(&dir);
        if live.is_empty() {
            layout::remove(&dir)?;
            removed.layouts.push(dir);
        } else {
            let pods = live
                .iter()
                .map(|p| format!("{}/{}", p.namespace, p.name))
                .collect();
            removed.kept.push((dir, pods));
        }
    }
    if removed.kept.is_empty() {
        layout::remove_versions_parent(bpffs_dir);
    }
    Ok(removed)
}

/// Removes ambient mode's side of the node, from its network namespace `netns` (`None`: the
/// calling thread's): the rule SNAT-ing kubelet's probes, then the probe sets, as Istio's node
/// agent does when it stops for good. What is not there is fine. Pods enrolled keep their
/// in-pod rules, as under Istio: they are restarted off the mesh.
///
/// Not while istio-cni's entry is in the CNI configuration (`conf_dir`): the node is being
/// handed back to istio-cni, whose agent uses the same rule and sets under the same names for
/// the same pods (it creates them at its start and keeps no watch on them), so they are left to
/// it. Returns the file holding istio-cni's entry then.
///
/// # Errors
/// When the rule or a set is there and cannot be removed.
pub fn probes(
    netns: Option<&Path>,
    flavour: FlavourChoice,
    conf_dir: &Path,
) -> Result<Option<String>, UninstallError> {
    if let Some(file) = install::istio::entry_file(conf_dir)? {
        return Ok(Some(file));
    }
    ambient::remove_from_node(netns, flavour, HostProbeSnat::default())?;
    Ok(None)
}
