//! The cgroup v2 hierarchy. On hybrid hosts it is not at /sys/fs/cgroup (here it is
//! /sys/fs/cgroup/unified), so it is found in /proc/self/mountinfo, never assumed.
use std::{fs, io, path::PathBuf};

/// Where the cgroup2 filesystem is mounted, from `/proc/self/mountinfo`.
///
/// # Errors
/// When mountinfo cannot be read or has no cgroup2 mount.
pub fn cgroup2_mount() -> io::Result<PathBuf> {
    let mountinfo = fs::read_to_string("/proc/self/mountinfo")?;
    cgroup2_mount_in(&mountinfo).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            "no cgroup2 filesystem in /proc/self/mountinfo; mount one (mount -t cgroup2 none /sys/fs/cgroup)",
        )
    })
}

/// The first cgroup2 mount point in a mountinfo text.
fn cgroup2_mount_in(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        // "<id> <parent> <maj:min> <root> <mount point> <options> [optional...] - <fstype> ..."
        let (left, right) = line.split_once(" - ")?;
        let fstype = right.split_whitespace().next()?;
        if fstype != "cgroup2" {
            return None;
        }
        left.split_whitespace()
            .nth(4)
            .map(|p| PathBuf::from(unescape(p)))
    })
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
    fn hybrid_host_has_cgroup2_under_unified() {
        let info = "\
25 30 0:22 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
26 25 0:23 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw,nsdelegate
27 25 0:24 / /sys/fs/cgroup/systemd rw - cgroup cgroup rw,name=systemd";
        assert_eq!(
            cgroup2_mount_in(info),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
    }

    #[test]
    fn optional_fields_and_escapes() {
        let info = "40 1 0:30 / /mnt/my\\040cg rw shared:5 master:1 - cgroup2 none rw";
        assert_eq!(cgroup2_mount_in(info), Some(PathBuf::from("/mnt/my cg")));
    }

    #[test]
    fn no_cgroup2() {
        assert_eq!(cgroup2_mount_in("1 0 0:1 / / rw - ext4 /dev/vda rw"), None);
    }
}
