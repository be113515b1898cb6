//! Pods with `hostUsers: false` (Kubernetes user namespaces): the runtime creates the pod's
//! network namespace inside a user namespace of its own, which maps the pod's uids and gids
//! (`0`..`65535`) to a range of the node's. Two things meshcap does to such a pod depend on it:
//!
//! - **Istio's rules** (the iptables backend): the kernel's owner match (`xt_owner`) accepts a
//!   `--uid-owner`/`--gid-owner` rule only from a writer in the user namespace that owns the
//!   network namespace, and reads its ids there (`owner_check`, net/netfilter/xt_owner.c). Istio
//!   runs `iptables-restore` through `nsenter --user --net` for such a pod (Istio 1.31,
//!   istio/istio#59448, `tools/istio-iptables/pkg/dependencies/implementation_linux.go`);
//!   meshcap's iptables commands enter the pod's user namespace ([`UserNs::enter_in_child`], in
//!   `backend::iptables`) before they run, with no `nsenter` binary.
//! - **The kernel programs** (the eBPF backend): they compare a socket owner's ids as the node
//!   sees them (`bpf_get_current_uid_gid` reads them in the initial user namespace), so the
//!   proxy's `1337` is the node's id it maps to ([`IdMaps`]). Istio has no such path.
//!
//! The user namespace is found from the network namespace itself (`NS_GET_USERNS`); one that is
//! the agent's own (every other pod) changes nothing.
use std::{
    ffi::CString,
    fs::File,
    io,
    os::{
        fd::{AsFd as _, AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
        unix::fs::MetadataExt as _,
    },
    path::Path,
};

use super::PodNetError;

/// `NS_GET_USERNS` (linux/nsfs.h): the user namespace owning a namespace, as a new fd.
const NS_GET_USERNS: libc::c_ulong = 0xb701;
/// `NS_GET_PARENT` (linux/nsfs.h): a user namespace's parent, as a new fd.
const NS_GET_PARENT: libc::c_ulong = 0xb702;

/// The agent's own user namespace.
const OWN_USERNS: &str = "/proc/self/ns/user";

/// The user namespace owning a pod's network namespace, when it is not the agent's own.
#[derive(Debug)]
pub struct UserNs {
    fd: OwnedFd,
    /// The network namespace, for errors.
    netns: std::path::PathBuf,
}

/// One line of a `uid_map` or `gid_map`: `len` ids from `inside` map to the node's from
/// `outside`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IdRange {
    /// The first id inside the user namespace.
    pub inside: u32,
    /// The id it is on the node (in the agent's user namespace).
    pub outside: u32,
    /// How many ids.
    pub len: u32,
}

/// A user namespace's uid and gid maps, as the node sees them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IdMaps {
    /// `uid_map`.
    pub uid: Vec<IdRange>,
    /// `gid_map`.
    pub gid: Vec<IdRange>,
}

/// A line of an id map that is not three ids.
#[derive(Debug, thiserror::Error)]
#[error("{0:?} is not three ids")]
pub struct BadMapLine(String);

impl IdMaps {
    /// Parses `uid_map` and `gid_map` as the kernel writes them (`inside outside length` per
    /// line).
    ///
    /// # Errors
    /// When a line is not three numbers.
    pub fn parse(uid_map: &str, gid_map: &str) -> Result<Self, BadMapLine> {
        fn ranges(text: &str) -> Result<Vec<IdRange>, BadMapLine> {
            text.lines()
                .filter(|l| !l.trim().is_empty())
                .map(|line| {
                    let bad = || BadMapLine(line.to_owned());
                    let n: Vec<u32> = line
                        .split_whitespace()
                        .map(str::parse)
                        .collect::<Result<_, _>>()
                        .map_err(|_| bad())?;
                    match n[..] {
                        [inside, outside, len] => Ok(IdRange {
                            inside,
                            outside,
                            len,
                        }),
                        _ => Err(bad()),
                    }
                })
                .collect()
        }
        Ok(Self {
            uid: ranges(uid_map)?,
            gid: ranges(gid_map)?,
        })
    }

    /// The node's uid for `id` inside the namespace; `None` when it is not mapped.
    #[must_use]
    pub fn host_uid(&self, id: u32) -> Option<u32> {
        map(&self.uid, id)
    }

    /// The node's gid for `id` inside the namespace; `None` when it is not mapped.
    #[must_use]
    pub fn host_gid(&self, id: u32) -> Option<u32> {
        map(&self.gid, id)
    }
}

fn map(ranges: &[IdRange], id: u32) -> Option<u32> {
    ranges.iter().find_map(|r| {
        let offset = id.checked_sub(r.inside)?;
        (offset < r.len).then(|| r.outside.checked_add(offset))?
    })
}

/// The user namespace that owns the network namespace at `netns`, when it is not the agent's
/// own; `None` for every pod that shares the node's user namespace.
///
/// # Errors
/// When the namespace cannot be opened or asked.
pub fn owner_of(netns: &Path) -> Result<Option<UserNs>, PodNetError> {
    let failed = |what: &str, source| PodNetError::Io {
        what: format!("{what} of network namespace {}", netns.display()),
        source,
    };
    let file = File::open(netns).map_err(|source| PodNetError::Open {
        path: netns.to_owned(),
        source,
    })?;
    let fd = ns_ioctl(file.as_fd(), NS_GET_USERNS)
        .map_err(|e| failed("finding the user namespace", e))?;
    let own = std::fs::metadata(OWN_USERNS).map_err(|e| failed("reading the agent's", e))?;
    if same_ns(&fd, &own).map_err(|e| failed("reading the user namespace", e))? {
        return Ok(None);
    }
    Ok(Some(UserNs {
        fd,
        netns: netns.to_owned(),
    }))
}

/// The capabilities a command run in a pod's user namespace keeps across its `execve`: its
/// network administration (iptables' socket options), raw sockets, and reading the netns's
/// `/proc/net` files (owned by the pod's root).
const CAPS_KEPT: [u32; 3] = [
    1,  // CAP_DAC_OVERRIDE
    12, // CAP_NET_ADMIN
    13, // CAP_NET_RAW
];

/// `_LINUX_CAPABILITY_VERSION_3`.
const CAPABILITY_VERSION_3: u32 = 0x2008_0522;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

impl UserNs {
    /// Makes `cmd` run inside this user namespace (and the network namespace the calling
    /// thread is in): its child enters the namespace before `execve`, keeping the node's
    /// identity (so it still owns meshcap's own files, such as its xtables lock) and, as
    /// ambient capabilities, [`CAPS_KEPT`] in the namespace. (`nsenter --user` becomes the
    /// namespace's root instead, which owns none of the node's files.) `cmd` must be run while
    /// `self` lives: the child uses its fd.
    pub fn enter_in_child(&self, cmd: &mut std::process::Command) {
        use std::os::unix::process::CommandExt as _;
        let fd = self.fd.as_raw_fd();
        // SAFETY: the closure runs in the forked child, single-threaded as entering a user
        // namespace requires; it makes only async-signal-safe system calls (setns, capget,
        // capset, prctl) on its own stack, allocates nothing, and `fd` is open in the parent
        // (and so in the child) while the command runs.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(fd, libc::CLONE_NEWUSER) != 0 {
                    return Err(io::Error::last_os_error());
                }
                // Entering gave every capability in the namespace; an `execve` by an id that is
                // not the namespace's root keeps only the ambient ones, which must be
                // inheritable first.
                let mut header = CapHeader {
                    version: CAPABILITY_VERSION_3,
                    pid: 0,
                };
                let mut data = [CapData {
                    effective: 0,
                    permitted: 0,
                    inheritable: 0,
                }; 2];
                if libc::syscall(libc::SYS_capget, &raw mut header, data.as_mut_ptr()) != 0 {
                    return Err(io::Error::last_os_error());
                }
                for cap in CAPS_KEPT {
                    data[0].inheritable |= 1 << cap;
                }
                if libc::syscall(libc::SYS_capset, &raw mut header, data.as_ptr()) != 0 {
                    return Err(io::Error::last_os_error());
                }
                for cap in CAPS_KEPT {
                    let raise = libc::prctl(
                        libc::PR_CAP_AMBIENT,
                        libc::PR_CAP_AMBIENT_RAISE,
                        libc::c_ulong::from(cap),
                        0,
                        0,
                    );
                    if raise != 0 {
                        return Err(io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
    }

    /// Its uid and gid maps, the node's ids being the agent's user namespace's: read by a
    /// child process that enters the namespace (a multi-threaded process cannot), as any
    /// process inside it reads its own.
    ///
    /// # Errors
    /// When the namespace is nested under another than the agent's (its outside ids would not
    /// be the node's), or the maps cannot be read.
    pub fn id_maps(&self) -> Result<IdMaps, PodNetError> {
        let failed = |what: String, source| PodNetError::Io {
            what: format!(
                "{what} of the user namespace of network namespace {}",
                self.netns.display()
            ),
            source,
        };
        let parent = ns_ioctl(self.fd.as_fd(), NS_GET_PARENT)
            .map_err(|e| failed("finding the parent".into(), e))?;
        let own =
            std::fs::metadata(OWN_USERNS).map_err(|e| failed("reading the agent's".into(), e))?;
        if !same_ns(&parent, &own).map_err(|e| failed("reading the parent".into(), e))? {
            return Err(failed(
                "mapping ids".into(),
                io::Error::other("it is nested under another user namespace than the agent's"),
            ));
        }
        let read = |file: &str| {
            read_inside(self.fd.as_fd(), file).map_err(|e| failed(format!("reading {file}"), e))
        };
        let (uid_map, gid_map) = (read("uid_map")?, read("gid_map")?);
        IdMaps::parse(&uid_map, &gid_map)
            .map_err(|bad| failed("reading the maps".into(), io::Error::other(bad)))
    }
}

fn ns_ioctl(fd: BorrowedFd<'_>, request: libc::c_ulong) -> io::Result<OwnedFd> {
    // SAFETY: the nsfs ioctls take no argument and return a new fd or -1; `fd` is open.
    let raw = unsafe { libc::ioctl(fd.as_raw_fd(), request) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel returned a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

fn same_ns(fd: &OwnedFd, other: &std::fs::Metadata) -> io::Result<bool> {
    let stat = nix::sys::stat::fstat(fd.as_fd()).map_err(io::Error::from)?;
    Ok(stat.st_ino == other.ino() && stat.st_dev == other.dev())
}

/// `/proc/self/<file>` as read by a child that entered `userns`: a process reads its own map
/// with the outside ids in the namespace's parent.
fn read_inside(userns: BorrowedFd<'_>, file: &str) -> io::Result<String> {
    let path = CString::new(format!("/proc/self/{file}")).map_err(io::Error::other)?;
    let (read_end, write_end) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(io::Error::from)?;
    let (ns, out) = (userns.as_raw_fd(), write_end.as_raw_fd());
    // SAFETY: the child makes only async-signal-safe system calls (setns, open, read, write,
    // _exit) on values prepared before the fork, on a buffer of its own stack; it allocates
    // nothing and never returns into Rust code.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    if pid == 0 {
        // SAFETY: as above; the child ends in `_exit`.
        unsafe {
            if libc::setns(ns, libc::CLONE_NEWUSER) != 0 {
                libc::_exit(2);
            }
            let src = libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
            if src < 0 {
                libc::_exit(3);
            }
            let mut buf = [0_u8; 512];
            loop {
                let n = libc::read(src, buf.as_mut_ptr().cast(), buf.len());
                if n == 0 {
                    libc::_exit(0);
                }
                if n < 0 || libc::write(out, buf.as_ptr().cast(), n.unsigned_abs()) != n {
                    libc::_exit(4);
                }
            }
        }
    }
    drop(write_end);
    let mut text = String::new();
    let read = io::Read::read_to_string(&mut File::from(read_end), &mut text);
    let status =
        nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid), None).map_err(io::Error::from)?;
    read?;
    match status {
        nix::sys::wait::WaitStatus::Exited(_, 0) => Ok(text),
        other => Err(io::Error::other(format!(
            "the child entering the user namespace ended with {other:?}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_map_through_every_range_and_nothing_outside_them() {
        let maps = IdMaps::parse(
            "0 100000 65536\n",
            "         0     200000       1000\n  1000 300000 10\n",
        )
        .expect("maps");
        assert_eq!(maps.host_uid(1337), Some(101_337));
        assert_eq!(maps.host_uid(0), Some(100_000));
        assert_eq!(maps.host_uid(65_536), None);
        assert_eq!(maps.host_gid(999), Some(200_999));
        assert_eq!(maps.host_gid(1005), Some(300_005));
        assert_eq!(maps.host_gid(1010), None);
        let top = IdMaps::parse("0 4294967000 1000", "").expect("maps");
        assert_eq!(top.host_uid(999), None, "no overflow past u32");
        assert!(IdMaps::parse("0 1", "").is_err());
        assert!(IdMaps::parse("a b c", "").is_err());
    }

    #[test]
    fn the_agents_own_network_namespace_is_in_its_own_user_namespace() {
        assert!(
            owner_of(Path::new("/proc/self/ns/net"))
                .expect("asked")
                .is_none()
        );
    }
}
