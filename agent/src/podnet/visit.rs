//! One visit to a pod's network namespace: entering it (the calling thread visits, and
//! returns), what the visit sees there (the netns cookie, the key of every per-pod BPF map;
//! interfaces, addresses and, when asked, routes), and the visit's one synchronous rtnetlink
//! socket, on which every request of the visit is sent and answered on the calling thread. No
//! async runtime is built per request or per visit (a socket belongs to the netns it was opened
//! in, so it cannot be shared across pods).
use std::{
    collections::{HashMap, HashSet},
    fs::{self, File},
    io,
    net::IpAddr,
    os::{fd::AsRawFd as _, unix::fs::MetadataExt as _},
    panic::{self, AssertUnwindSafe},
    path::{Path, PathBuf},
};

use netlink_packet_core::{
    NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NetlinkBuffer, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_route::RouteNetlinkMessage;
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};
use nix::sched::{CloneFlags, setns};

use super::{
    PodNetError,
    route::{self, Route},
};
use crate::{mountinfo, privilege};

/// One visit to a pod's network namespace (see the module documentation).
#[derive(Default)]
pub struct Visit {
    netlink: Option<Netlink>,
}

impl Visit {
    /// The visit's netlink socket, opened on first use.
    ///
    /// # Errors
    /// When the kernel refuses the socket.
    pub fn netlink(&mut self) -> Result<&mut Netlink, PodNetError> {
        let socket = match self.netlink.take() {
            Some(socket) => socket,
            None => Netlink::open().map_err(|source| PodNetError::Netlink {
                what: "opening a netlink socket".into(),
                source,
            })?,
        };
        Ok(self.netlink.insert(socket))
    }
}

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
        why: privilege::explain(privilege::Operation::Namespace, &source)
            .map(|why| format!(" ({why})"))
            .unwrap_or_default(),
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

/// An interface: its index and name.
pub type Interface = (u32, String);

/// The pod's network as seen from inside its netns.
#[derive(Clone, Debug, Default)]
pub struct PodNet {
    /// The netns cookie.
    pub cookie: u64,
    /// Interfaces other than `lo`, sorted by index.
    pub interfaces: Vec<Interface>,
    /// Every address on every interface (`lo`'s too).
    pub addresses: Vec<IpAddr>,
    /// The main routing table (IPv4 and IPv6), when asked for.
    pub routes: Vec<Route>,
}

/// Reads the visited netns: its cookie, its interfaces and addresses (one `getifaddrs`: its
/// link entries carry the interface indexes), and, when `with_routes` (only
/// `excludeInterfaces` needs them), its main table's routes.
///
/// # Errors
/// When the kernel refuses the queries.
pub fn inspect(visit: &mut Visit, with_routes: bool) -> Result<PodNet, PodNetError> {
    let cookie = current_cookie()?;
    let (interfaces, addresses) = interfaces_and_addresses()?;
    let routes = if with_routes {
        route::main_table(visit.netlink()?, &interfaces)?
    } else {
        Vec::new()
    };
    Ok(PodNet {
        cookie,
        interfaces,
        addresses,
        routes,
    })
}

/// The visited netns's addresses without loopback and link-local ones, each once: what Istio
/// reads inside a pod when the runtime gave none.
///
/// # Errors
/// When the interfaces cannot be listed.
pub fn global_addresses() -> Result<Vec<IpAddr>, PodNetError> {
    let (_, addresses) = interfaces_and_addresses()?;
    let mut out = Vec::new();
    for ip in addresses {
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

/// One `getifaddrs`: the interfaces other than `lo` (index, name; sorted) and every address.
fn interfaces_and_addresses() -> Result<(Vec<Interface>, Vec<IpAddr>), PodNetError> {
    let mut interfaces = Vec::new();
    let mut addresses = Vec::new();
    let entries = nix::ifaddrs::getifaddrs().map_err(|e| PodNetError::Io {
        what: "listing interfaces and addresses".into(),
        source: e.into(),
    })?;
    for entry in entries {
        let Some(address) = entry.address else {
            continue;
        };
        if let Some(link) = address.as_link_addr() {
            let index = u32::try_from(link.ifindex()).unwrap_or(0);
            if entry.interface_name != "lo" && index != 0 {
                interfaces.push((index, entry.interface_name));
            }
        } else if let Some(v4) = address.as_sockaddr_in() {
            addresses.push(IpAddr::V4(v4.ip()));
        } else if let Some(v6) = address.as_sockaddr_in6() {
            addresses.push(IpAddr::V6(v6.ip()));
        }
    }
    interfaces.sort_unstable();
    interfaces.dedup();
    Ok((interfaces, addresses))
}

/// Bytes read per `recv`: a netlink datagram never exceeds what the kernel fits in one
/// (`NLMSG_GOODSIZE`, a page or 8 KiB), and a dump sends one datagram per batch.
const RECV_BUFFER: usize = 64 * 1024;

/// The kernel's errno for a refused request, or `None` for any other failure.
#[must_use]
pub fn errno(err: &io::Error) -> Option<i32> {
    err.raw_os_error()
}

/// An open rtnetlink socket (see the module documentation).
pub struct Netlink {
    socket: Socket,
    sequence: u32,
    buffer: Vec<u8>,
}

impl Netlink {
    /// Opens a socket in the calling thread's network namespace.
    ///
    /// # Errors
    /// When the kernel refuses the socket.
    pub fn open() -> io::Result<Self> {
        let mut socket = Socket::new(NETLINK_ROUTE)?;
        socket.bind_auto()?;
        socket.connect(&SocketAddr::new(0, 0))?;
        Ok(Self {
            socket,
            sequence: 0,
            buffer: Vec::with_capacity(RECV_BUFFER),
        })
    }

    /// Sends `message` with `flags` (`NLM_F_CREATE`, `NLM_F_EXCL`, `NLM_F_DUMP`, ...) and
    /// collects the answers: for a dump every message until its end, for any other request
    /// the kernel's acknowledgement, which is always asked for so that no refusal is missed.
    ///
    /// # Errors
    /// The kernel's refusal as an [`io::Error`] carrying its errno ([`errno`]), or a socket
    /// failure.
    pub fn request(
        &mut self,
        message: RouteNetlinkMessage,
        flags: u16,
    ) -> io::Result<Vec<RouteNetlinkMessage>> {
        let dump = flags & NLM_F_DUMP == NLM_F_DUMP;
        self.sequence = self.sequence.wrapping_add(1);
        let mut request = NetlinkMessage::from(message);
        request.header.flags = NLM_F_REQUEST | flags | if dump { 0 } else { NLM_F_ACK };
        request.header.sequence_number = self.sequence;
        request.finalize();
        let mut bytes = vec![0; request.buffer_len()];
        request.serialize(&mut bytes);
        self.socket.send(&bytes, 0)?;
        let mut answers = Vec::new();
        loop {
            self.buffer.clear();
            let len = self.socket.recv(&mut self.buffer, 0)?;
            if len > self.buffer.len() {
                return Err(io::Error::other(format!(
                    "netlink answer of {len} bytes exceeds the {RECV_BUFFER}-byte buffer"
                )));
            }
            let mut offset = 0;
            while offset < self.buffer.len() {
                let datagram = &self.buffer[offset..];
                let length = NetlinkBuffer::new_checked(datagram)
                    .map_err(|e| io::Error::other(format!("malformed netlink answer: {e}")))?
                    .length() as usize;
                let answer =
                    NetlinkMessage::<RouteNetlinkMessage>::deserialize(&datagram[..length])
                        .map_err(|e| io::Error::other(format!("malformed netlink answer: {e}")))?;
                offset += length.max(1).next_multiple_of(4);
                if answer.header.sequence_number != self.sequence {
                    // A late answer to an earlier request of this session: not ours.
                    continue;
                }
                match answer.payload {
                    NetlinkPayload::Error(error) => {
                        return match error.code {
                            // The acknowledgement: an error message without an error.
                            None => Ok(answers),
                            Some(code) => Err(io::Error::from_raw_os_error(-code.get())),
                        };
                    }
                    NetlinkPayload::Done(_) => return Ok(answers),
                    NetlinkPayload::InnerMessage(inner) => answers.push(inner),
                    _ => {}
                }
            }
        }
    }
}
