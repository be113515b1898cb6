//! A pin layout as a whole, for a real uninstall: which layout directories a node holds, which
//! pods still depend on one, and removing one. Only pin names are read, never maps, so this
//! works for a layout of any version, also one this agent's object could not open.
use std::{
    io,
    path::{Path, PathBuf},
};

use super::{
    EbpfError, PinnedPod,
    pins::{Pins, list_dir, remove_tree},
};

/// The layout directories `configured` stands for: itself and, when it is a versioned
/// directory (`…/v<N>`, as the default `/sys/fs/bpf/meshcap/v3` is), every other version
/// beside it. An unversioned directory (tests use unique ones) stands only for itself.
#[must_use]
pub fn versions(configured: &Path) -> Vec<PathBuf> {
    let mut dirs = vec![configured.to_owned()];
    let (Some(name), Some(parent)) = (
        configured.file_name().and_then(|n| n.to_str()),
        versions_parent(configured),
    ) else {
        return dirs;
    };
    let mut siblings: Vec<String> = list_dir(parent)
        .into_iter()
        .filter(|n| n != name && versioned(n))
        .collect();
    siblings.sort();
    dirs.extend(siblings.into_iter().map(|n| parent.join(n)));
    dirs
}

/// Whether `name` is a layout version's (`v<N>`).
fn versioned(name: &str) -> bool {
    name.strip_prefix('v')
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// The directory holding the layout versions (`/sys/fs/bpf/meshcap` for the default
/// `…/meshcap/v3`); none for an unversioned directory.
fn versions_parent(configured: &Path) -> Option<&Path> {
    configured
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(versioned)
        .then(|| configured.parent())
        .flatten()
}

/// Removes the directory holding the layout versions once none is left in it, so that nothing
/// of meshcap stays on the node's bpffs after an uninstall. It stays while it holds anything
/// (a version kept for its live pods, another tool's pin).
pub fn remove_versions_parent(configured: &Path) {
    if let Some(parent) = versions_parent(configured) {
        let _ = std::fs::remove_dir(parent);
    }
}

/// Pods pinned under `dir` whose network namespace is still alive: the programs pinned there
/// still capture them, so removing the layout would let their traffic bypass the sidecar.
#[must_use]
pub fn live_pods(dir: &Path) -> Vec<PinnedPod> {
    let live = crate::podnet::live_cookies();
    Pins::new(dir)
        .pinned_pods()
        .into_iter()
        .filter(|pod| live.contains(&pod.netns_cookie))
        .collect()
}

/// Detaches everything pinned under `dir` (the node-wide links, pods' TC links and stubs) and
/// removes it, maps included.
///
/// # Errors
/// When something under `dir` cannot be removed.
pub fn remove(dir: &Path) -> Result<(), EbpfError> {
    remove_tree(dir);
    if dir.exists() {
        return Err(EbpfError::io(
            &format!("removing {}", dir.display()),
            io::Error::other("still present"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versioned_directories_bring_their_siblings() {
        let root = std::env::temp_dir().join(format!("meshcap-layout-{}", std::process::id()));
        for dir in ["v1", "v2", "v10", "other", "vx"] {
            std::fs::create_dir_all(root.join(dir)).unwrap();
        }
        let found = versions(&root.join("v2"));
        let alone = versions(&root.join("other"));
        std::fs::remove_dir_all(&root).unwrap();
        assert_eq!(
            found,
            vec![root.join("v2"), root.join("v1"), root.join("v10")]
        );
        assert_eq!(alone, vec![root.join("other")]);
    }

    #[test]
    fn the_versions_parent_goes_once_empty_and_only_it() {
        let root = std::env::temp_dir().join(format!("meshcap-parent-{}", std::process::id()));
        let parent = root.join("meshcap");
        std::fs::create_dir_all(parent.join("v3")).unwrap();
        remove_versions_parent(&parent.join("v3"));
        let kept = parent.exists();
        std::fs::remove_dir(parent.join("v3")).unwrap();
        remove_versions_parent(&parent.join("v3"));
        let gone = !parent.exists();
        std::fs::create_dir_all(root.join("plain")).unwrap();
        remove_versions_parent(&root.join("plain"));
        let root_kept = root.exists();
        std::fs::remove_dir_all(&root).unwrap();
        assert!(kept, "a parent holding a version stays");
        assert!(gone, "an empty parent goes");
        assert!(
            root_kept,
            "an unversioned directory's parent is not touched"
        );
    }
}
