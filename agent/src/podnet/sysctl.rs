//! The network sysctls meshcap writes in a pod's network namespace (`net.ipv4.tcp_fwmark_accept`
//! for TPROXY in the kernel, conntrack's loose pickup at a hand-back): `/proc/sys/net/...`
//! resolves for the opening thread's netns, so a thread visiting the pod's writes the pod's.
//!
//! A container runtime mounts `/proc/sys` read-only in every container that is not privileged,
//! meshcap's DaemonSet's included (Istio's node agent only ever reads sysctls). Where a write is
//! refused so (`EROFS`), the agent mounts a procfs of its own, once, in its own mount namespace
//! (the container's: the host never sees it), and writes through it: a new procfs instance is
//! read-write, and its `sys/net` resolves for the opening thread's netns as `/proc/sys/net`
//! does. The mount needs `CAP_SYS_ADMIN`, which the agent has; in the initial user namespace the
//! kernel lets a new procfs be mounted beside the runtime's masked one.
use std::{
    io,
    path::{Path, PathBuf},
    sync::Mutex,
};

use nix::mount::{MsFlags, mount};

/// The procfs the agent mounted for itself, once mounted.
static OWN_PROC: Mutex<Option<PathBuf>> = Mutex::new(None);

/// Reads sysctl `key` (`net/ipv4/tcp_fwmark_accept`) of the visited netns.
///
/// # Errors
/// When it does not exist (`NotFound`: its module is not loaded) or cannot be read.
pub fn read(key: &str) -> io::Result<String> {
    std::fs::read_to_string(Path::new("/proc/sys").join(key)).map(|v| v.trim().to_owned())
}

/// Writes `value` to sysctl `key` of the visited netns, through the agent's own procfs where
/// `/proc/sys` is mounted read-only.
///
/// # Errors
/// When it does not exist (`NotFound`), or cannot be written either way.
pub fn write(key: &str, value: &str) -> io::Result<()> {
    match std::fs::write(Path::new("/proc/sys").join(key), value) {
        Err(err) if err.raw_os_error() == Some(libc::EROFS) => {
            std::fs::write(own_proc()?.join("sys").join(key), value)
        }
        other => other,
    }
}

/// The agent's own procfs, mounted on first use at a directory of its own.
fn own_proc() -> io::Result<PathBuf> {
    let mut own = OWN_PROC
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(path) = own.as_ref() {
        return Ok(path.clone());
    }
    let path = std::env::temp_dir().join(format!("meshcap-proc-{}", std::process::id()));
    std::fs::create_dir_all(&path)?;
    mount(
        Some("proc"),
        &path,
        Some("proc"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        None::<&str>,
    )
    .map_err(|errno| {
        io::Error::new(
            io::Error::from(errno).kind(),
            format!(
                "/proc/sys is read-only here, and mounting a procfs at {} failed: {errno}",
                path.display()
            ),
        )
    })?;
    tracing::info!(
        path = %path.display(),
        "/proc/sys is read-only in this container: network sysctls of pods are written through \
         a procfs of the agent's own"
    );
    *own = Some(path.clone());
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// As in a container: a thread of its own mount and network namespaces (nothing it mounts
    /// reaches the host) with `/proc/sys` bound read-only. The write goes through the agent's
    /// own procfs to the thread's netns, and reads back through `/proc/sys`.
    #[test]
    fn a_read_only_proc_sys_is_written_through_a_procfs_of_its_own() {
        std::thread::spawn(|| {
            use nix::sched::{CloneFlags, unshare};
            unshare(CloneFlags::CLONE_NEWNS | CloneFlags::CLONE_FS | CloneFlags::CLONE_NEWNET)
                .expect("unshare (root)");
            mount(
                None::<&str>,
                "/",
                None::<&str>,
                MsFlags::MS_REC | MsFlags::MS_PRIVATE,
                None::<&str>,
            )
            .expect("private mounts");
            mount(
                Some("/proc/sys"),
                "/proc/sys",
                None::<&str>,
                MsFlags::MS_BIND,
                None::<&str>,
            )
            .expect("bind");
            mount(
                None::<&str>,
                "/proc/sys",
                None::<&str>,
                MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY,
                None::<&str>,
            )
            .expect("read-only");
            let key = "net/ipv4/tcp_fwmark_accept";
            let refused = std::fs::write(Path::new("/proc/sys").join(key), "1")
                .expect_err("a read-only /proc/sys");
            assert_eq!(refused.raw_os_error(), Some(libc::EROFS));
            assert_eq!(read(key).expect("read"), "0", "a new netns's default");
            write(key, "1").expect("written through the agent's procfs");
            assert_eq!(read(key).expect("read"), "1");
            let own = own_proc().expect("mounted");
            let _ = nix::mount::umount2(&own, nix::mount::MntFlags::MNT_DETACH);
            let _ = std::fs::remove_dir(&own);
            *OWN_PROC
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
        })
        .join()
        .expect("the thread");
    }
}
