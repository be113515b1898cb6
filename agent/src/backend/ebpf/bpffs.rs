//! The BPF filesystem the pins live on. Hosts without one mounted at `/sys/fs/bpf` get one
//! (as kubelet hosts usually have; a DaemonSet mounts the host's with a hostPath).
use std::{fs, io, path::Path};

use nix::mount::{MsFlags, mount};

/// Where bpffs is mounted when there is none.
const BPFFS: &str = "/sys/fs/bpf";

/// Makes sure `dir` is on a bpffs: when the mount holding it is not one and `dir` is under
/// `/sys/fs/bpf`, mounts bpffs there.
///
/// # Errors
/// When `dir` is on another filesystem elsewhere, or the mount fails.
pub fn ensure(dir: &Path) -> io::Result<()> {
    let mountinfo = fs::read_to_string("/proc/self/mountinfo")?;
    if fstype_holding(&mountinfo, dir).as_deref() == Some("bpf") {
        return Ok(());
    }
    if !dir.starts_with(BPFFS) {
        return Err(io::Error::other(format!(
            "{} is not on a bpf filesystem; mount one (mount -t bpf bpf {BPFFS})",
            dir.display()
        )));
    }
    fs::create_dir_all(BPFFS)?;
    mount(
        Some("bpf"),
        BPFFS,
        Some("bpf"),
        MsFlags::empty(),
        None::<&str>,
    )
    .map_err(io::Error::from)
}

/// The filesystem type of the longest mount point that is a prefix of `dir`.
fn fstype_holding(mountinfo: &str, dir: &Path) -> Option<String> {
    mountinfo
        .lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let point = left.split_whitespace().nth(4)?;
            let fstype = right.split_whitespace().next()?;
            dir.starts_with(point)
                .then(|| (point.len(), fstype.to_owned()))
        })
        .max_by_key(|(len, _)| *len)
        .map(|(_, fstype)| fstype)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_innermost_mount() {
        let info = "1 0 0:1 / / rw - ext4 /dev/vda rw\n\
                    2 1 0:2 / /sys rw - sysfs sysfs rw\n\
                    3 2 0:3 / /sys/fs/bpf rw - bpf bpf rw";
        assert_eq!(
            fstype_holding(info, Path::new("/sys/fs/bpf/meshcap/v1")).as_deref(),
            Some("bpf")
        );
        assert_eq!(
            fstype_holding(info, Path::new("/sys/kernel")).as_deref(),
            Some("sysfs")
        );
    }
}
