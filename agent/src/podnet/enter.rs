//! Entering a network namespace (the calling thread visits, and returns) and learning its
//! cookie, the key of every per-pod BPF map.
use std::{
    collections::{HashMap, HashSet},
    fs::{self, File},
    io,
    os::{fd::AsRawFd as _, unix::fs::MetadataExt as _},
    panic::{self, AssertUnwindSafe},
    path::{Path, PathBuf},
};

use nix::sched::{CloneFlags, setns};

use super::{PodNetError, Visit};
use crate::mountinfo;

/// `SO_NETNS_COOKIE` (Linux 5.14), not yet in every libc.
const SO_NETNS_COOKIE: libc::c_int = 71;

/// This thread's own network namespace, to return to after a visit (`/proc/self` would name the
/// main thread's).
const THREAD_NETNS: &str = "/proc/thread-self/ns/net";

/// Runs `f` with the calling thread inside the network namespace at `path`, and returns what it
/// returns, the thread back in the namespace it was in (visits nest).
///
/// The calling thread enters, rather than a thread spawned per visit: a visit is a few
/// netlink requests, and under load each thread handed over costs a wait for a CPU (BENCHMARKS.md,
/// ADD with the machine busy). `setns` moves only the calling thread, and `f` is synchronous,
/// so nothing else runs on the thread while it is inside. A thread that cannot return is never
/// left to do the agent's later work in a pod's namespace: the agent aborts instead (its
/// state survives a crash at any point; docs/reliability.md).
///
/// # Errors
/// When the namespace cannot be opened or entered, or `f` panics (the thread returns first).
pub fn run_in<T>(path: &Path, f: impl FnOnce(&mut Visit) -> T) -> Result<T, PodNetError> {
    let target = File::open(path).map_err(|source| PodNetError::Open {
        path: path.to_owned(),
        source,
    })?;
    let home = File::open(THREAD_NETNS).map_err(|source| PodNetError::Io {
        what: format!("opening {THREAD_NETNS}"),
        source,
    })?;
    setns(&target, CloneFlags::CLONE_NEWNET).map_err(|source| PodNetError::Enter {
        path: path.to_owned(),
        source,
    })?;
    let ran = panic::catch_unwind(AssertUnwindSafe(|| f(&mut Visit::default())));
    if let Err(err) = setns(&home, CloneFlags::CLONE_NEWNET) {
        tracing::error!(
            netns = %path.display(),
            "cannot leave the pod's network namespace ({err}): aborting rather than working \
             in it"
        );
        std::process::abort();
    }
    ran.map_err(|_| PodNetError::Panicked(path.to_owned()))
}

/// The cookie of the calling thread's network namespace.
///
/// # Errors
/// When the kernel does not support `SO_NETNS_COOKIE` (before Linux 5.14).
pub fn current_cookie() -> Result<u64, PodNetError> {
    let failed = |source| PodNetError::Io {
        what: "reading the netns cookie".into(),
        source,
    };
    // Any socket answers for the netns it was created in: no address, no bind.
    let socket = nix::sys::socket::socket(
        nix::sys::socket::AddressFamily::Unix,
        nix::sys::socket::SockType::Datagram,
        nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(|e| failed(e.into()))?;
    let mut cookie: u64 = 0;
    let mut len = libc::socklen_t::try_from(size_of::<u64>()).unwrap_or(8);
    // SAFETY: `cookie` and `len` are valid for writes and sized for the option.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_NETNS_COOKIE,
            (&raw mut cookie).cast(),
            &raw mut len,
        )
    };
    if rc != 0 {
        return Err(failed(io::Error::last_os_error()));
    }
    Ok(cookie)
}

/// The cookie of the network namespace at `path`.
///
/// # Errors
/// When the namespace cannot be entered or the kernel has no netns cookies.
pub fn cookie_of(path: &Path) -> Result<u64, PodNetError> {
    run_in(path, |_| current_cookie())?
}

/// The cookies of every network namespace alive on the host, as far as it can be seen
/// ([`live_netns`]).
#[must_use]
pub fn live_cookies() -> HashSet<u64> {
    live_netns().into_keys().collect()
}

/// Every network namespace alive on the host, as far as it can be seen, by cookie, each with a
/// path that names it: those bind-mounted where runtimes and `ip netns` keep them
/// (`/run/netns`, `/var/run/netns`), every other namespace bind mount the agent sees
/// (`/proc/self/mountinfo`: containerd with `netns_mounts_under_state_dir` keeps a sandbox's
/// under its state directory, the only trace of it between the CNI ADD and the start of its
/// pause container), and those of every process (`/proc/<pid>/ns/net`). A bind mount's path is
/// preferred: it names the namespace for as long as it lives. Each namespace is entered once
/// (deduplicated by inode).
#[must_use]
pub fn live_netns() -> HashMap<u64, PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    for dir in ["/run/netns", "/var/run/netns"] {
        candidates.extend(
            fs::read_dir(dir)
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path()),
        );
    }
    // Other kinds of namespace are bind-mounted too (nsfs): entering them as a network
    // namespace fails, and they are passed over.
    candidates.extend(mountinfo::mount_points("nsfs").unwrap_or_default());
    candidates.extend(
        fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| {
                e.file_name()
                    .to_string_lossy()
                    .bytes()
                    .all(|b| b.is_ascii_digit())
            })
            .map(|e| e.path().join("ns/net")),
    );
    let mut seen = HashSet::new();
    let mut found = HashMap::new();
    for path in candidates {
        let Ok(meta) = fs::metadata(&path) else {
            continue;
        };
        if !seen.insert((meta.dev(), meta.ino())) {
            continue;
        }
        if let Ok(cookie) = cookie_of(&path) {
            found.entry(cookie).or_insert(path);
        }
    }
    found
}
