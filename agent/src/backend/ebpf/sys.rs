//! The two `bpf()` commands aya 0.14 does not expose for every link type: `BPF_LINK_CREATE`
//! (aya cannot turn a `CgroupSockopt` link into a pinnable `FdLink`) and `BPF_OBJ_PIN` /
//! `BPF_OBJ_GET` on a raw fd. With them every node-wide cgroup attachment is a bpf_link pinned
//! in bpffs: it survives the agent (even SIGKILL), and is detached only by unlinking its pin.
use std::{
    ffi::CString,
    io,
    os::{
        fd::{AsFd, AsRawFd as _, FromRawFd as _, OwnedFd},
        unix::ffi::OsStrExt as _,
    },
    path::Path,
};

const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_LINK_CREATE: libc::c_long = 28;

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
}

/// The `link_create` and `obj_pin` members of `union bpf_attr`, zero-padded to the size the
/// kernel accepts (it checks that bytes past what it knows are zero).
#[repr(C)]
#[derive(Default)]
struct Attr {
    words: [u64; 16],
}

fn bpf(cmd: libc::c_long, attr: &mut Attr) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a valid, fully initialised `union bpf_attr` prefix of the size passed.
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

/// `BPF_LINK_CREATE`: attaches `prog` to the cgroup `cgroup` as a bpf_link.
///
/// # Errors
/// The kernel's refusal.
pub fn link_create(
    prog: impl AsFd,
    cgroup: impl AsFd,
    attach: CgroupAttach,
) -> io::Result<OwnedFd> {
    let mut attr = Attr::default();
    // prog_fd (u32), target_fd (u32), attach_type (u32), flags (u32).
    attr.words[0] = u64::from(fd_u32(prog.as_fd())?) | (u64::from(fd_u32(cgroup.as_fd())?) << 32);
    attr.words[1] = u64::from(attach as u32);
    fd_from(bpf(BPF_LINK_CREATE, &mut attr)?)
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

const BPF_PROG_QUERY: libc::c_long = 16;

/// `BPF_PROG_QUERY`: how many programs of `attach` type are attached to the cgroup itself
/// (not inherited).
///
/// # Errors
/// The kernel's refusal.
pub fn prog_count(cgroup: impl AsFd, attach: CgroupAttach) -> io::Result<u32> {
    let mut attr = Attr::default();
    // target_fd, attach_type; query_flags, attach_flags; prog_ids (none); prog_cnt (out).
    attr.words[0] = u64::from(fd_u32(cgroup.as_fd())?) | (u64::from(attach as u32) << 32);
    bpf(BPF_PROG_QUERY, &mut attr)?;
    Ok((attr.words[3] & 0xffff_ffff) as u32)
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
