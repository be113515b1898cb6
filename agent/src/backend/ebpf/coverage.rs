//! Whether the node-wide programs see a captured pod's processes at all: they run only for
//! processes in the cgroup they are attached to (or below it), so a pod whose processes live
//! elsewhere (an agent given a narrower `--cgroup-root`, or `--instance`, while the pod was
//! started outside that cgroup) is not captured, silently. This finds such processes, as far as
//! this agent can see processes (`/proc`: all of them on a host, its own in a container without
//! the host's pid namespace).
use std::{
    collections::{HashMap, HashSet},
    fs,
    os::unix::fs::MetadataExt as _,
    path::Path,
};

use super::pins::PinnedPod;
use crate::podnet;

/// A process in a captured pod's network namespace that the programs do not run for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Uncovered {
    /// `namespace/name` of the pod.
    pub pod: String,
    /// The process.
    pub pid: u32,
    /// Its command name.
    pub comm: String,
}

/// The processes of `pods` outside `cgroup_root`.
#[must_use]
pub fn uncovered(cgroup_root: &Path, pods: &[PinnedPod]) -> Vec<Uncovered> {
    let captured: HashMap<u64, &PinnedPod> = pods.iter().map(|p| (p.netns_cookie, p)).collect();
    if captured.is_empty() {
        return Vec::new();
    }
    let mut covered = HashSet::new();
    collect_procs(cgroup_root, &mut covered);
    let mut by_netns: HashMap<(u64, u64), Vec<u32>> = HashMap::new();
    for entry in fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if covered.contains(&pid) {
            continue;
        }
        if let Ok(meta) = fs::metadata(entry.path().join("ns/net")) {
            by_netns
                .entry((meta.dev(), meta.ino()))
                .or_default()
                .push(pid);
        }
    }
    let mut out = Vec::new();
    for pids in by_netns.into_values() {
        let netns = Path::new("/proc").join(pids[0].to_string()).join("ns/net");
        let Some(pod) = podnet::cookie_of(&netns)
            .ok()
            .and_then(|cookie| captured.get(&cookie))
        else {
            continue;
        };
        for pid in pids {
            let comm = fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            out.push(Uncovered {
                pod: format!("{}/{}", pod.namespace, pod.name),
                pid,
                comm: comm.trim().to_owned(),
            });
        }
    }
    out.sort_by_key(|u| u.pid);
    out
}

/// Every pid in `cgroup` and the cgroups below it.
fn collect_procs(cgroup: &Path, pids: &mut HashSet<u32>) {
    if let Ok(text) = fs::read_to_string(cgroup.join("cgroup.procs")) {
        pids.extend(text.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
    }
    for entry in fs::read_dir(cgroup).into_iter().flatten().flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            collect_procs(&entry.path(), pids);
        }
    }
}
