//! What the kernel says about programs, links and cgroups: `BPF_OBJ_GET_INFO_BY_FD`,
//! `BPF_PROG_QUERY`, `BPF_PROG_GET_FD_BY_ID` and a program array's lookup. Only the status
//! report, CHECK, the ordering of programs and uninstall ask; a capture never does.
use std::{
    io,
    os::fd::{AsFd, OwnedFd},
};

use super::{Attr, CgroupAttach, bpf, fd_from, fd_u32};

const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_PROG_GET_FD_BY_ID: libc::c_long = 13;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;

/// `BPF_OBJ_GET_INFO_BY_FD` on a program: its id.
///
/// # Errors
/// The kernel's refusal (`EINVAL` for an fd that is not a program).
pub fn prog_id(prog: impl AsFd) -> io::Result<u32> {
    // struct bpf_prog_info: type (u32), id (u32), tag, ...; the kernel fills what fits.
    let mut info = [0u32; 2];
    get_info(prog.as_fd(), &mut info)?;
    Ok(info[1])
}

/// `BPF_OBJ_GET_INFO_BY_FD` on any link: its id and its program's.
///
/// # Errors
/// The kernel's refusal (`EINVAL` for an fd that is not a link).
pub fn link_ids(link: impl AsFd) -> io::Result<(u32, u32)> {
    // struct bpf_link_info: type, id, prog_id (u32 each), ...
    let mut info = [0u32; 3];
    get_info(link.as_fd(), &mut info)?;
    Ok((info[1], info[2]))
}

/// A program's tag (the kernel's hash of its instructions: the same code has the same tag),
/// as hex, by program id.
///
/// # Errors
/// When the program is gone or the kernel refuses.
pub fn prog_tag(id: u32) -> io::Result<String> {
    let prog = prog_by_id(id)?;
    // struct bpf_prog_info: type (u32), id (u32), tag (8 bytes), ...
    let mut info = [0u32; 4];
    get_info(prog.as_fd(), &mut info)?;
    Ok(info[2..4]
        .iter()
        .flat_map(|w| w.to_ne_bytes())
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// The id of the program in slot `slot` of the program array `map` (the kernel answers a
/// program array's lookup with the program's id).
///
/// # Errors
/// `ENOENT` for an empty slot, or the kernel's refusal.
pub fn prog_array_id(map: impl AsFd, slot: u32) -> io::Result<u32> {
    let mut attr = Attr::default();
    let mut id = 0u32;
    // map_fd (u32), pad, key (pointer), value (pointer), flags.
    attr.words[0] = u64::from(fd_u32(map.as_fd())?);
    attr.words[1] = std::ptr::from_ref(&slot) as u64;
    attr.words[2] = std::ptr::from_mut(&mut id) as u64;
    bpf(BPF_MAP_LOOKUP_ELEM, &mut attr).map(|_| id)
}

/// A TCX link as the kernel describes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcxLinkInfo {
    /// The attached program.
    pub prog_id: u32,
    /// The interface, 0 once it is gone (the link is then defunct).
    pub ifindex: u32,
}

/// `BPF_OBJ_GET_INFO_BY_FD` on a TCX link: its program and interface.
///
/// # Errors
/// The kernel's refusal (`EINVAL` for an fd that is not a link).
pub fn tcx_link_info(link: impl AsFd) -> io::Result<TcxLinkInfo> {
    // struct bpf_link_info: type, id, prog_id (u32 each), then the 8-aligned union, whose
    // `tcx` member is ifindex, attach_type.
    let mut info = [0u32; 6];
    get_info(link.as_fd(), &mut info)?;
    Ok(TcxLinkInfo {
        prog_id: info[2],
        ifindex: info[4],
    })
}

fn get_info(fd: std::os::fd::BorrowedFd<'_>, info: &mut [u32]) -> io::Result<()> {
    let mut attr = Attr::default();
    // bpf_fd, info_len; info (pointer).
    let len = u32::try_from(size_of_val(info)).map_err(|_| io::Error::other("info too large"))?;
    attr.words[0] = u64::from(fd_u32(fd)?) | (u64::from(len) << 32);
    attr.words[1] = info.as_mut_ptr() as u64;
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr).map(drop)
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

/// `BPF_F_QUERY_EFFECTIVE`: the programs that run for the cgroup, its ancestors' included.
const F_QUERY_EFFECTIVE: u32 = 1;

/// `BPF_PROG_QUERY` with `BPF_F_QUERY_EFFECTIVE`: the ids of the programs that run on `attach`
/// for processes in `cgroup`, in the order they run (its own, then its ancestors').
///
/// # Errors
/// The kernel's refusal.
pub fn effective_prog_ids(cgroup: impl AsFd, attach: CgroupAttach) -> io::Result<Vec<u32>> {
    // The array may grow between the count and the read: retry with the new count.
    loop {
        let mut attr = Attr::default();
        attr.words[0] = u64::from(fd_u32(cgroup.as_fd())?) | (u64::from(attach as u32) << 32);
        attr.words[1] = u64::from(F_QUERY_EFFECTIVE);
        bpf(BPF_PROG_QUERY, &mut attr)?;
        let count = (attr.words[3] & 0xffff_ffff) as usize;
        let mut ids = vec![0u32; count];
        let mut attr = Attr::default();
        attr.words[0] = u64::from(fd_u32(cgroup.as_fd())?) | (u64::from(attach as u32) << 32);
        attr.words[1] = u64::from(F_QUERY_EFFECTIVE);
        attr.words[2] = ids.as_mut_ptr() as u64;
        attr.words[3] = count as u64;
        match bpf(BPF_PROG_QUERY, &mut attr) {
            Ok(_) => {
                ids.truncate((attr.words[3] & 0xffff_ffff) as usize);
                return Ok(ids);
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => {}
            Err(e) => return Err(e),
        }
    }
}

/// A program's name (the first 15 bytes its loader gave it), by id.
///
/// # Errors
/// When the program is gone or the kernel refuses.
pub fn prog_name(id: u32) -> io::Result<String> {
    let prog = prog_by_id(id)?;
    // struct bpf_prog_info: type, id, tag[8], jited_prog_len, xlated_prog_len,
    // jited_prog_insns (u64), xlated_prog_insns (u64), load_time (u64), created_by_uid,
    // nr_map_ids, map_ids (u64), name[16]: the name is at byte 64.
    let mut info = [0u32; 20];
    get_info(prog.as_fd(), &mut info)?;
    let bytes: Vec<u8> = info[16..20].iter().flat_map(|w| w.to_ne_bytes()).collect();
    let end = bytes.iter().position(|b| *b == 0).unwrap_or(bytes.len());
    Ok(String::from_utf8_lossy(&bytes[..end]).into_owned())
}

/// `BPF_PROG_GET_FD_BY_ID`.
///
/// # Errors
/// When the program is gone or the kernel refuses.
pub fn prog_by_id(id: u32) -> io::Result<OwnedFd> {
    let mut attr = Attr::default();
    attr.words[0] = u64::from(id);
    fd_from(bpf(BPF_PROG_GET_FD_BY_ID, &mut attr)?)
}
