//! The calling process's mounts, as `/proc/self/mountinfo` lists them (proc(5)): where the
//! cgroup v2 hierarchy is, and where network namespaces are bind-mounted.
use std::{fs, io, path::PathBuf};

/// The mount points of every mount of filesystem type `fstype`, in mount order.
///
/// # Errors
/// When mountinfo cannot be read.
pub fn mount_points(fstype: &str) -> io::Result<Vec<PathBuf>> {
    Ok(mount_points_in(
        &fs::read_to_string("/proc/self/mountinfo")?,
        fstype,
    ))
}

/// [`mount_points`] of a mountinfo text.
#[must_use]
pub fn mount_points_in(mountinfo: &str, fstype: &str) -> Vec<PathBuf> {
    mountinfo
        .lines()
        .filter_map(|line| {
            // "<id> <parent> <maj:min> <root> <mount point> <options> [optional...] - <fstype> ..."
            let (left, right) = line.split_once(" - ")?;
            if right.split_whitespace().next()? != fstype {
                return None;
            }
            left.split_whitespace()
                .nth(4)
                .map(|p| PathBuf::from(unescape(p)))
        })
        .collect()
}

/// mountinfo escapes space, tab, newline and backslash as octal (`\040`).
fn unescape(field: &str) -> String {
    let mut out = String::with_capacity(field.len());
    let mut rest = field;
    while let Some(i) = rest.find('\\') {
        out.push_str(&rest[..i]);
        let code = rest
            .get(i + 1..i + 4)
            .and_then(|o| u8::from_str_radix(o, 8).ok());
        if let Some(byte) = code {
            out.push(char::from(byte));
            rest = &rest[i + 4..];
        } else {
            out.push('\\');
            rest = &rest[i + 1..];
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn optional_fields_and_escapes() {
        let info = "40 1 0:30 / /mnt/my\\040cg rw shared:5 master:1 - cgroup2 none rw";
        assert_eq!(
            mount_points_in(info, "cgroup2"),
            [PathBuf::from("/mnt/my cg")]
        );
    }

    #[test]
    fn every_mount_of_the_type_in_order() {
        let info = "\
611 28 0:4 net:[4026532845] /run/netns/cni-1 rw shared:300 - nsfs nsfs rw
700 28 0:4 net:[4026532999] /var/run/containerd/io.containerd.grpc.v1.cri/sandboxes/ab/netns rw - nsfs nsfs rw
1 0 0:1 / / rw - ext4 /dev/vda rw
702 28 0:4 mnt:[4026533000] /run/some-mnt-ns rw - nsfs nsfs rw";
        assert_eq!(
            mount_points_in(info, "nsfs"),
            [
                "/run/netns/cni-1",
                "/var/run/containerd/io.containerd.grpc.v1.cri/sandboxes/ab/netns",
                "/run/some-mnt-ns",
            ]
            .map(PathBuf::from)
        );
        assert_eq!(mount_points_in(info, "cgroup2"), Vec::<PathBuf>::new());
    }
}
