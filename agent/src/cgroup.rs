//! The cgroup v2 hierarchy. On hybrid hosts it is not at /sys/fs/cgroup (here it is
//! /sys/fs/cgroup/unified), so it is found in /proc/self/mountinfo, never assumed.
use std::{io, path::PathBuf};

use crate::mountinfo;

/// Where the cgroup2 filesystem is mounted, from `/proc/self/mountinfo`.
///
/// # Errors
/// When mountinfo cannot be read or has no cgroup2 mount.
pub fn cgroup2_mount() -> io::Result<PathBuf> {
    mountinfo::mount_points("cgroup2")?
        .into_iter()
        .next()
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                "no cgroup2 filesystem in /proc/self/mountinfo; mount one (mount -t cgroup2 none /sys/fs/cgroup)",
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hybrid_host_has_cgroup2_under_unified() {
        let info = "\
25 30 0:22 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
26 25 0:23 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw,nsdelegate
27 25 0:24 / /sys/fs/cgroup/systemd rw - cgroup cgroup rw,name=systemd";
        assert_eq!(
            mountinfo::mount_points_in(info, "cgroup2"),
            [PathBuf::from("/sys/fs/cgroup/unified")]
        );
    }

    #[test]
    fn the_hosts_own_hierarchy_is_found() {
        let found = cgroup2_mount().expect("a cgroup2 mount on this host");
        assert!(found.join("cgroup.controllers").exists(), "{found:?}");
    }
}
