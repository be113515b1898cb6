//! The `bpf()` commands meshcap issues itself: `BPF_LINK_CREATE` (aya cannot turn a
//! `CgroupSockopt` link into a pinnable `FdLink`), `BPF_OBJ_PIN` / `BPF_OBJ_GET` on a raw fd,
//! and `BPF_PROG_LOAD` of the per-pod TC stub (a handful of instructions built by the agent,
//! see [`super::stub`]: loading it through aya would re-parse the whole object per pod). With
//! them every attachment is a bpf_link pinned in bpffs (or a netlink TC filter, which outlives
//! the agent by itself): it survives the agent (even SIGKILL), and is detached only by
//! unlinking its pin (or deleting the filter). What the kernel says about programs and links
//! is [`info`]'s.
use std::{
    ffi::{CStr, CString},
    io,
    os::{
        fd::{AsFd, AsRawFd as _, FromRawFd as _, OwnedFd},
        unix::ffi::OsStrExt as _,
    },
    path::Path,
};

pub use info::{
    effective_prog_ids, link_ids, prog_array_id, prog_by_id, prog_count, prog_id, prog_name,
    prog_tag, tcx_link_info,
};

mod info;

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_LINK_UPDATE: libc::c_long = 29;

/// `BPF_PROG_TYPE_SCHED_CLS`.
const PROG_TYPE_SCHED_CLS: u32 = 3;
/// `BPF_TCX_INGRESS`.
const TCX_INGRESS: u32 = 46;
/// `BPF_F_AFTER`: with no relative program, after every other one (aya's default order).
const F_AFTER: u32 = 1 << 4;

/// `enum bpf_attach_type` values meshcap attaches to a cgroup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum CgroupAttach {
    /// `BPF_CGROUP_SOCK_OPS`.
    SockOps = 3,
    /// `BPF_CGROUP_INET4_CONNECT`.
    Connect4 = 10,
    /// `BPF_CGROUP_INET6_CONNECT`.
    Connect6 = 11,
    /// `BPF_CGROUP_UDP4_SENDMSG`.
    SendMsg4 = 14,
    /// `BPF_CGROUP_UDP6_SENDMSG`.
    SendMsg6 = 15,
    /// `BPF_CGROUP_UDP4_RECVMSG`.
    RecvMsg4 = 19,
    /// `BPF_CGROUP_UDP6_RECVMSG`.
    RecvMsg6 = 20,
    /// `BPF_CGROUP_GETSOCKOPT`.
    GetSockopt = 21,
    /// `BPF_CGROUP_INET4_GETPEERNAME`.
    GetPeerName4 = 29,
    /// `BPF_CGROUP_INET6_GETPEERNAME`.
    GetPeerName6 = 30,
}

/// The `link_create` and `obj_pin` members of `union bpf_attr`, zero-padded to the size the
/// kernel accepts (it checks that bytes past what it knows are zero).
#[repr(C)]
#[derive(Default)]
struct Attr {
    words: [u64; 16],
}

fn bpf(cmd: libc::c_long, attr: &mut Attr) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a valid, fully initialised `union bpf_attr` prefix of the size passed;
    // the pointers it holds (paths, instructions, license, log and info buffers) are borrowed
    // by the caller for the whole call, with the lengths written beside them.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            std::ptr::from_mut(attr),
            size_of::<Attr>(),
        )
    };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

fn fd_from(rc: libc::c_long) -> io::Result<OwnedFd> {
    let raw = i32::try_from(rc).map_err(|_| io::Error::other("bpf() returned a bad fd"))?;
    // SAFETY: the kernel just returned this new fd to us; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| io::Error::other("NUL in path"))
}

/// `BPF_LINK_CREATE`: attaches `prog` to the cgroup `cgroup` as a bpf_link, after the
/// programs there.
///
/// # Errors
/// The kernel's refusal.
pub fn link_create(
    prog: impl AsFd,
    cgroup: impl AsFd,
    attach: CgroupAttach,
) -> io::Result<OwnedFd> {
    cgroup_link_create(prog.as_fd(), cgroup.as_fd(), attach, 0)
}

fn cgroup_link_create(
    prog: std::os::fd::BorrowedFd<'_>,
    cgroup: std::os::fd::BorrowedFd<'_>,
    attach: CgroupAttach,
    flags: u32,
) -> io::Result<OwnedFd> {
    let mut attr = Attr::default();
    // prog_fd, target_fd; attach_type, flags; cgroup.relative_fd (0: none), pad;
    // cgroup.expected_revision (0: any).
    attr.words[0] = u64::from(fd_u32(prog)?) | (u64::from(fd_u32(cgroup)?) << 32);
    attr.words[1] = u64::from(attach as u32) | (u64::from(flags) << 32);
    fd_from(bpf(BPF_LINK_CREATE, &mut attr)?)
}

/// `BPF_F_BEFORE`: with no relative program, before every other one.
const F_BEFORE: u32 = 1 << 3;

/// [`link_create`] placing the program before every other one on the hook (`BPF_F_BEFORE`
/// with no relative program: multi-program ordering of cgroup links; 6.18 accepts it, 6.1
/// answers `EINVAL`). meshcap's programs then decide before another's rewrite (a socket load
/// balancer's) is applied.
///
/// # Errors
/// The kernel's refusal: `EINVAL` where cgroup links cannot be ordered.
pub fn link_create_first(
    prog: impl AsFd,
    cgroup: impl AsFd,
    attach: CgroupAttach,
) -> io::Result<OwnedFd> {
    cgroup_link_create(prog.as_fd(), cgroup.as_fd(), attach, F_BEFORE)
}

/// `BPF_LINK_CREATE` with `BPF_TCX_INGRESS` (Linux 6.6): attaches the classifier `prog` to
/// the ingress of interface `ifindex` in the calling thread's netns, after every program
/// already there.
///
/// # Errors
/// The kernel's refusal (`EINVAL` without TCX).
pub fn tcx_ingress_link_create(prog: impl AsFd, ifindex: u32) -> io::Result<OwnedFd> {
    let mut attr = Attr::default();
    // prog_fd, target_ifindex; attach_type, flags; tcx.relative_fd (0: none), pad;
    // tcx.expected_revision (0: any).
    attr.words[0] = u64::from(fd_u32(prog.as_fd())?) | (u64::from(ifindex) << 32);
    attr.words[1] = u64::from(TCX_INGRESS) | (u64::from(F_AFTER) << 32);
    fd_from(bpf(BPF_LINK_CREATE, &mut attr)?)
}

/// `BPF_SK_LOOKUP`.
const SK_LOOKUP: u32 = 36;

/// `BPF_LINK_CREATE` with `BPF_SK_LOOKUP` (Linux 5.9): attaches the socket lookup program
/// `prog` to the network namespace `netns`, beside any other there.
///
/// # Errors
/// The kernel's refusal.
pub fn sk_lookup_link_create(prog: impl AsFd, netns: impl AsFd) -> io::Result<OwnedFd> {
    let mut attr = Attr::default();
    // prog_fd, target_fd (the netns); attach_type, flags.
    attr.words[0] = u64::from(fd_u32(prog.as_fd())?) | (u64::from(fd_u32(netns.as_fd())?) << 32);
    attr.words[1] = u64::from(SK_LOOKUP);
    fd_from(bpf(BPF_LINK_CREATE, &mut attr)?)
}

/// The size of the verifier log asked for when a load fails (the stub's is a few lines).
const LOG_SIZE: usize = 64 * 1024;

/// A program the kernel refused.
#[derive(Debug, thiserror::Error)]
#[error("{source}; verifier log: {log}")]
pub struct Refused {
    /// The kernel's errno.
    #[source]
    pub source: io::Error,
    /// What the verifier said (empty when it said nothing).
    pub log: String,
}

/// `BPF_PROG_LOAD` of a `BPF_PROG_TYPE_SCHED_CLS` program from raw instructions (8 bytes
/// each, in the kernel's encoding). A refusal is retried once with the verifier log on, so
/// the error says why; the first attempt has none (logging slows the verifier).
///
/// # Errors
/// The kernel's refusal, with the verifier log.
pub fn prog_load_sched_cls(
    name: &str,
    insns: &[[u8; 8]],
    license: &CStr,
) -> Result<OwnedFd, Refused> {
    let load = |log: Option<&mut Vec<u8>>| -> io::Result<OwnedFd> {
        let insn_cnt =
            u32::try_from(insns.len()).map_err(|_| io::Error::other("too many instructions"))?;
        let mut attr = Attr::default();
        // prog_type, insn_cnt; insns; license; log_level, log_size; log_buf; kern_version,
        // prog_flags; prog_name[16].
        attr.words[0] = u64::from(PROG_TYPE_SCHED_CLS) | (u64::from(insn_cnt) << 32);
        attr.words[1] = insns.as_ptr() as u64;
        attr.words[2] = license.as_ptr() as u64;
        if let Some(log) = log {
            let size = u32::try_from(log.len()).unwrap_or(u32::MAX);
            attr.words[3] = 1 | (u64::from(size) << 32);
            attr.words[4] = log.as_mut_ptr() as u64;
        }
        let mut prog_name = [0u8; 16];
        for (dst, src) in prog_name.iter_mut().zip(name.bytes().take(15)) {
            *dst = src;
        }
        attr.words[6] = u64::from_ne_bytes(prog_name[..8].try_into().unwrap_or_default());
        attr.words[7] = u64::from_ne_bytes(prog_name[8..].try_into().unwrap_or_default());
        fd_from(bpf(BPF_PROG_LOAD, &mut attr)?)
    };
    load(None).or_else(|_| {
        let mut log = vec![0u8; LOG_SIZE];
        load(Some(&mut log)).map_err(|source| Refused {
            source,
            log: String::from_utf8_lossy(log.split(|b| *b == 0).next().unwrap_or_default())
                .trim()
                .to_owned(),
        })
    })
}

/// `BPF_LINK_UPDATE`: the link runs `prog` from now on, atomically (no call runs neither).
///
/// # Errors
/// The kernel's refusal: `ENOLINK` when the link is defunct (its cgroup is gone).
pub fn link_update(link: impl AsFd, prog: impl AsFd) -> io::Result<()> {
    let mut attr = Attr::default();
    // link_fd (u32), new_prog_fd (u32), flags (u32), old_prog_fd (u32).
    attr.words[0] = u64::from(fd_u32(link.as_fd())?) | (u64::from(fd_u32(prog.as_fd())?) << 32);
    bpf(BPF_LINK_UPDATE, &mut attr).map(drop)
}

fn fd_u32(fd: std::os::fd::BorrowedFd<'_>) -> io::Result<u32> {
    u32::try_from(fd.as_raw_fd()).map_err(|_| io::Error::other("negative fd"))
}

/// `BPF_OBJ_PIN`: pins a link, map or program fd at `path` (on bpffs).
///
/// # Errors
/// The kernel's refusal (e.g. `EEXIST`, or `EPERM` off bpffs).
pub fn obj_pin(fd: impl AsFd, path: &Path) -> io::Result<()> {
    let path = c_path(path)?;
    let mut attr = Attr::default();
    attr.words[0] = path.as_ptr() as u64;
    attr.words[1] = u64::from(fd_u32(fd.as_fd())?);
    bpf(BPF_OBJ_PIN, &mut attr).map(drop)
}

/// `BPF_OBJ_GET`: opens what is pinned at `path`.
///
/// # Errors
/// The kernel's refusal (`ENOENT` when nothing is pinned there).
pub fn obj_get(path: &Path) -> io::Result<OwnedFd> {
    let path = c_path(path)?;
    let mut attr = Attr::default();
    attr.words[0] = path.as_ptr() as u64;
    fd_from(bpf(BPF_OBJ_GET, &mut attr)?)
}

const BPF_LINK_DETACH: libc::c_long = 34;

/// `BPF_LINK_DETACH`: detaches a link now. Dropping a link's last reference (unlinking its
/// pin) detaches it too, but from a workqueue, after the call returns.
///
/// # Errors
/// The kernel's refusal (`EINVAL` for an fd that is not a link).
pub fn link_detach(link: impl AsFd) -> io::Result<()> {
    let mut attr = Attr::default();
    attr.words[0] = u64::from(fd_u32(link.as_fd())?);
    bpf(BPF_LINK_DETACH, &mut attr).map(drop)
}

/// What the stub's kernel test needs besides the above: a program array, an update of it,
/// and `BPF_PROG_TEST_RUN`.
#[cfg(test)]
pub mod testing {
    use std::{
        io,
        os::fd::{AsFd, OwnedFd},
    };

    use super::{Attr, bpf, fd_from, fd_u32};

    /// `BPF_MAP_CREATE` of a one-slot `BPF_MAP_TYPE_PROG_ARRAY`.
    pub fn prog_array() -> io::Result<OwnedFd> {
        let mut attr = Attr::default();
        // map_type (3), key_size (4); value_size (4), max_entries (1).
        attr.words[0] = 3 | (4 << 32);
        attr.words[1] = 4 | (1 << 32);
        fd_from(bpf(0, &mut attr)?)
    }

    /// `BPF_MAP_UPDATE_ELEM`: `map[slot] = prog`.
    pub fn set(map: impl AsFd, slot: u32, prog: impl AsFd) -> io::Result<()> {
        let value = fd_u32(prog.as_fd())?;
        let mut attr = Attr::default();
        // map_fd, pad; key (pointer); value (pointer); flags.
        attr.words[0] = u64::from(fd_u32(map.as_fd())?);
        attr.words[1] = std::ptr::from_ref(&slot) as u64;
        attr.words[2] = std::ptr::from_ref(&value) as u64;
        bpf(2, &mut attr).map(drop)
    }

    /// `BPF_PROG_TEST_RUN` of a classifier on one zeroed Ethernet frame: its return value.
    pub fn run(prog: impl AsFd) -> io::Result<u32> {
        let packet = [0u8; 64];
        let mut attr = Attr::default();
        // prog_fd, retval (out); data_size_in, data_size_out; data_in (pointer).
        attr.words[0] = u64::from(fd_u32(prog.as_fd())?);
        attr.words[1] = packet.len() as u64;
        attr.words[2] = packet.as_ptr() as u64;
        bpf(10, &mut attr)?;
        Ok((attr.words[0] >> 32) as u32)
    }
}
