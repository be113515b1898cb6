//! Whether a live process listens on a socket file: the kernel's `sock_diag` dump of the network
//! namespace's listening Unix sockets (`NETLINK_SOCK_DIAG`, `UDIAG_SHOW_VFS`), each with the
//! device and inode of the file it was bound to.
//!
//! A socket file at the ZDS path that is not meshcap's is either another agent listening there
//! (istio-cni's agent starting on the node removes the path and binds its own) or a file left
//! by one that is gone. Only the first is to be left alone, and connecting to find out would
//! look like a ztunnel to that agent. The kernel's table says it without touching the socket.
//!
//! Where the kernel has no `sock_diag` for Unix sockets (`unix_diag`, a module Debian's kernels
//! do not always load), `/proc/net/unix` is read instead: it names each listening socket's path
//! as it was bound, not the file, so a socket listening on a file since replaced at the same
//! path counts too; the caller's own listener is left out by its socket's inode.
use std::{io, os::unix::ffi::OsStrExt as _, path::Path};

use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_SOCK_DIAG};

use super::listener::SocketId;

/// `SOCK_DIAG_BY_FAMILY`.
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLMSG_HEADER: usize = 16;
/// `struct unix_diag_msg`.
const UNIX_DIAG_MSG: usize = 16;
/// `UDIAG_SHOW_VFS`: the bound file's inode and device.
const UDIAG_SHOW_VFS: u32 = 0x2;
/// `UNIX_DIAG_VFS`.
const UNIX_DIAG_VFS: u16 = 1;
/// `TCP_LISTEN`, the state of a listening Unix socket.
const TCP_LISTEN: u32 = 10;
/// Bytes read per `recv`.
const RECV_BUFFER: usize = 64 * 1024;

/// Whether a socket of this network namespace listens on the file `id` names at `path`;
/// `own` is the inode of the caller's own listening socket, if it has one.
///
/// # Errors
/// When neither table can be read.
pub(super) fn listened_on(path: &Path, id: SocketId, own: Option<u64>) -> io::Result<bool> {
    match listening_files() {
        Ok(files) => Ok(files.contains(&kernel_file(id))),
        Err(err) if err.raw_os_error() == Some(libc::ENOENT) => {
            let table = std::fs::read("/proc/net/unix")?;
            Ok(listening_at(&table, path.as_os_str().as_bytes(), own))
        }
        Err(err) => Err(err),
    }
}

/// Whether `/proc/net/unix` (`table`) lists a listening socket bound at `path` other than
/// the one whose inode is `own`. Its columns: `Num RefCount Protocol Flags Type St Inode Path`;
/// `Flags` `00010000` is `__SO_ACCEPTCON`, a listening socket.
fn listening_at(table: &[u8], path: &[u8], own: Option<u64>) -> bool {
    table.split(|b| *b == b'\n').skip(1).any(|line| {
        let fields: Vec<&[u8]> = line
            .split(|b| *b == b' ')
            .filter(|f| !f.is_empty())
            .collect();
        let inode = fields
            .get(6)
            .and_then(|f| std::str::from_utf8(f).ok())
            .and_then(|f| f.parse::<u64>().ok());
        fields.get(3) == Some(&&b"00010000"[..])
            && fields.get(7) == Some(&path)
            && inode.is_some()
            && inode != own
    })
}

/// A file's identity as `unix_diag_vfs` gives it: the inode, and the device as the kernel
/// encodes it inside (`MKDEV`: the major number above 20 bits), not as `stat` reports it.
fn kernel_file((dev, ino): SocketId) -> (u32, u32) {
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    (ino as u32, (major << 20) | (minor & 0x000f_ffff))
}

/// The (inode, device) of every file a listening Unix socket of this namespace is bound to.
fn listening_files() -> io::Result<Vec<(u32, u32)>> {
    let mut socket = Socket::new(NETLINK_SOCK_DIAG)?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    socket.send(&request(), 0)?;
    let mut files = Vec::new();
    let mut buffer = Vec::with_capacity(RECV_BUFFER);
    loop {
        buffer.clear();
        socket.recv(&mut buffer, 0)?;
        let mut rest = buffer.as_slice();
        while rest.len() >= NLMSG_HEADER {
            let len = u32::from_ne_bytes(rest[0..4].try_into().expect("4 bytes")) as usize;
            let kind = u16::from_ne_bytes([rest[4], rest[5]]);
            if len < NLMSG_HEADER || len > rest.len() {
                return Err(io::Error::other("malformed sock_diag answer"));
            }
            let body = &rest[NLMSG_HEADER..len];
            rest = &rest[align(len).min(rest.len())..];
            match kind {
                NLMSG_DONE => return Ok(files),
                NLMSG_ERROR => {
                    let code = body
                        .get(0..4)
                        .map(|b| i32::from_ne_bytes(b.try_into().expect("4 bytes")))
                        .ok_or_else(|| io::Error::other("short sock_diag error"))?;
                    return Err(io::Error::from_raw_os_error(-code));
                }
                SOCK_DIAG_BY_FAMILY => files.extend(bound_file(body)),
                _ => {}
            }
        }
    }
}

/// The dump request: every listening Unix socket, with its bound file.
fn request() -> Vec<u8> {
    let mut bytes = Vec::with_capacity(NLMSG_HEADER + 24);
    bytes.extend_from_slice(&((NLMSG_HEADER + 24) as u32).to_ne_bytes());
    bytes.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    bytes.extend_from_slice(&(NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
    bytes.extend_from_slice(&1u32.to_ne_bytes());
    bytes.extend_from_slice(&0u32.to_ne_bytes());
    // struct unix_diag_req: family, protocol, pad, states, ino, show, cookie.
    bytes.push(libc::AF_UNIX as u8);
    bytes.extend_from_slice(&[0, 0, 0]);
    bytes.extend_from_slice(&(1u32 << TCP_LISTEN).to_ne_bytes());
    bytes.extend_from_slice(&0u32.to_ne_bytes());
    bytes.extend_from_slice(&UDIAG_SHOW_VFS.to_ne_bytes());
    bytes.extend_from_slice(&[0xff; 8]);
    bytes
}

/// The `UNIX_DIAG_VFS` attribute of one `unix_diag_msg`, if the socket has a file.
fn bound_file(body: &[u8]) -> Option<(u32, u32)> {
    let mut attrs = body.get(UNIX_DIAG_MSG..)?;
    while attrs.len() >= 4 {
        let len = usize::from(u16::from_ne_bytes([attrs[0], attrs[1]]));
        let kind = u16::from_ne_bytes([attrs[2], attrs[3]]);
        if len < 4 || len > attrs.len() {
            return None;
        }
        if kind == UNIX_DIAG_VFS && len >= 12 {
            let ino = u32::from_ne_bytes(attrs[4..8].try_into().ok()?);
            let dev = u32::from_ne_bytes(attrs[8..12].try_into().ok()?);
            return Some((ino, dev));
        }
        attrs = &attrs[align(len).min(attrs.len())..];
    }
    None
}

const fn align(len: usize) -> usize {
    (len + 3) & !3
}

#[cfg(test)]
mod tests {
    use nix::sys::socket::{Backlog, listen};

    use super::*;
    use crate::ztunnel::listener::{socket_id, testing::bound_at};

    #[test]
    fn proc_net_unix_names_the_other_listeners_at_a_path() {
        let table = b"Num       RefCount Protocol Flags    Type St Inode Path\n\
ffff0001: 00000002 00000000 00010000 0005 01 100 /var/run/ztunnel/ztunnel.sock\n\
ffff0002: 00000003 00000000 00000000 0005 03 101 /var/run/ztunnel/ztunnel.sock\n\
ffff0003: 00000002 00000000 00010000 0001 01 102 /run/other.sock\n";
        let path = b"/var/run/ztunnel/ztunnel.sock";
        assert!(listening_at(table, path, None));
        assert!(listening_at(table, path, Some(7)));
        assert!(!listening_at(table, path, Some(100)), "the caller's own");
        assert!(!listening_at(table, b"/var/run/none.sock", None));
    }

    #[test]
    fn a_listening_socket_is_told_from_a_bound_one_and_a_closed_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("zds.sock");
        let fd = bound_at(&path);
        let id = socket_id(&path).expect("a socket file");
        let listened = || listened_on(&path, id, None).expect("a table");
        assert!(!listened(), "bound, not listening");
        listen(&fd, Backlog::new(1).expect("backlog")).expect("listen");
        assert!(listened(), "listening");
        drop(fd);
        assert!(path.exists(), "closing leaves the file");
        assert!(!listened(), "closed: nobody listens");
    }
}
