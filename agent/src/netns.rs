//! Network namespaces: entering one (on a dedicated thread, never a tokio worker: setns only
//! changes the calling thread) and learning its cookie, the key of every per-pod BPF map.
use std::{
    fs::File,
    io,
    net::IpAddr,
    os::fd::AsRawFd as _,
    path::{Path, PathBuf},
    thread,
};

use nix::sched::{CloneFlags, setns};

/// `SO_NETNS_COOKIE` (Linux 5.14), not yet in every libc.
const SO_NETNS_COOKIE: libc::c_int = 71;

/// Errors entering or inspecting a network namespace.
#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    /// The namespace file could not be opened (gone, or not a netns).
    #[error("opening network namespace {path}: {source}")]
    Open {
        /// The namespace file.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// setns refused.
    #[error("entering network namespace {path}: {source}")]
    Enter {
        /// The namespace file.
        path: PathBuf,
        /// Why.
        #[source]
        source: nix::Error,
    },
    /// The kernel does not report netns cookies (< 5.14) or the socket failed.
    #[error("reading the netns cookie of {path}: {source}")]
    Cookie {
        /// The namespace file.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The closure run inside panicked.
    #[error("the thread inside network namespace {0} panicked")]
    Panicked(PathBuf),
}

/// Runs `f` on a new thread that has entered the network namespace at `path`, and returns what
/// it returns. The caller's thread never changes namespace.
///
/// # Errors
/// When the namespace cannot be opened or entered, or `f` panics.
pub fn run_in<T: Send>(path: &Path, f: impl FnOnce() -> T + Send) -> Result<T, NetnsError> {
    let file = File::open(path).map_err(|source| NetnsError::Open {
        path: path.to_owned(),
        source,
    })?;
    thread::scope(|scope| {
        scope
            .spawn(move || {
                setns(&file, CloneFlags::CLONE_NEWNET).map_err(|source| NetnsError::Enter {
                    path: path.to_owned(),
                    source,
                })?;
                Ok(f())
            })
            .join()
            .map_err(|_| NetnsError::Panicked(path.to_owned()))?
    })
}

/// The cookie of the calling thread's network namespace.
///
/// # Errors
/// When the kernel does not support `SO_NETNS_COOKIE`.
pub fn current_cookie() -> io::Result<u64> {
    // Any socket answers for the netns it was created in: no address, no bind.
    let socket = nix::sys::socket::socket(
        nix::sys::socket::AddressFamily::Unix,
        nix::sys::socket::SockType::Datagram,
        nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(io::Error::from)?;
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
        return Err(io::Error::last_os_error());
    }
    Ok(cookie)
}

/// The cookie of the network namespace at `path`.
///
/// # Errors
/// When the namespace cannot be entered or the kernel has no netns cookies.
pub fn cookie_of(path: &Path) -> Result<u64, NetnsError> {
    run_in(path, current_cookie)?.map_err(|source| NetnsError::Cookie {
        path: path.to_owned(),
        source,
    })
}

/// The addresses of the calling thread's network namespace, loopback and link-local left out:
/// what Istio reads inside a pod to decide whether it has IPv6.
///
/// # Errors
/// When the interfaces cannot be listed.
pub fn pod_addresses() -> io::Result<Vec<IpAddr>> {
    let mut out = Vec::new();
    for ifaddr in nix::ifaddrs::getifaddrs().map_err(io::Error::from)? {
        let Some(address) = ifaddr.address else {
            continue;
        };
        let ip = if let Some(v4) = address.as_sockaddr_in() {
            IpAddr::V4(v4.ip())
        } else if let Some(v6) = address.as_sockaddr_in6() {
            IpAddr::V6(v6.ip())
        } else {
            continue;
        };
        let local = match ip {
            IpAddr::V4(v4) => v4.is_loopback() || v4.is_link_local(),
            IpAddr::V6(v6) => v6.is_loopback() || v6.is_unicast_link_local(),
        };
        if !local && !out.contains(&ip) {
            out.push(ip);
        }
    }
    Ok(out)
}

/// The cookies of every network namespace alive on the host, as far as it can be seen: those
/// of every process (`/proc/<pid>/ns/net`) and those bind-mounted where runtimes and `ip netns`
/// keep them (`/run/netns`, `/var/run/netns`). Each namespace is entered once (deduplicated by
/// inode).
#[must_use]
pub fn live_cookies() -> std::collections::HashSet<u64> {
    use std::os::unix::fs::MetadataExt as _;
    let mut candidates: Vec<PathBuf> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .bytes()
                .all(|b| b.is_ascii_digit())
        })
        .map(|e| e.path().join("ns/net"))
        .collect();
    for dir in ["/run/netns", "/var/run/netns"] {
        candidates.extend(
            std::fs::read_dir(dir)
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path()),
        );
    }
    let mut seen = std::collections::HashSet::new();
    let mut cookies = std::collections::HashSet::new();
    for path in candidates {
        let Ok(meta) = std::fs::metadata(&path) else {
            continue;
        };
        if !seen.insert((meta.dev(), meta.ino())) {
            continue;
        }
        if let Ok(cookie) = cookie_of(&path) {
            cookies.insert(cookie);
        }
    }
    cookies
}
