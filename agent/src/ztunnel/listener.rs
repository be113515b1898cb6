//! The ZDS socket's path, listened on: a listening socket and which socket file the path names,
//! so that the acceptor ([`super::server`]) can tell when the path was unlinked or replaced
//! (istio-cni's agent unlinks it as it stops) and listen there again.

use std::{
    os::{
        fd::{AsRawFd, OwnedFd},
        unix::fs::MetadataExt as _,
    },
    path::Path,
};

use nix::sys::socket::{
    AddressFamily, Backlog, SockFlag, SockType, UnixAddr, bind, listen, socket,
};
use tracing::warn;

use super::ZdsError;

/// A socket file's device and inode: which socket a path names.
pub(super) type SocketId = (u64, u64);

/// A listening socket and the identity of its file.
pub(super) struct Listener {
    /// The listening socket.
    pub fd: OwnedFd,
    /// Its file's identity.
    pub id: SocketId,
    /// The socket's own inode (sockfs's, as `/proc/net/unix` lists it).
    pub inode: u64,
}

/// Listens at `path`, replacing whatever file is there.
pub(super) fn listen_at(path: &Path) -> Result<Listener, ZdsError> {
    match std::fs::remove_file(path) {
        Err(err) if err.kind() != std::io::ErrorKind::NotFound => {
            return Err(ZdsError::Io(err));
        }
        _ => {}
    }
    let fd = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )
    .map_err(ZdsError::io)?;
    bind(fd.as_raw_fd(), &UnixAddr::new(path).map_err(ZdsError::io)?).map_err(ZdsError::io)?;
    listen(&fd, Backlog::new(8).map_err(ZdsError::io)?).map_err(ZdsError::io)?;
    let id = socket_id(path).ok_or_else(|| {
        ZdsError::Io(std::io::Error::other(format!(
            "{} vanished as it was bound",
            path.display()
        )))
    })?;
    let inode = nix::sys::stat::fstat(&fd).map_err(ZdsError::io)?.st_ino;
    Ok(Listener { fd, id, inode })
}

/// The identity of the socket file at `path`, if there is one.
pub(super) fn socket_id(path: &Path) -> Option<SocketId> {
    use std::os::unix::fs::FileTypeExt as _;
    let meta = std::fs::symlink_metadata(path).ok()?;
    meta.file_type()
        .is_socket()
        .then(|| (meta.dev(), meta.ino()))
}

/// Listens at `path` again after it was unlinked or replaced; `None` (retried on the next
/// check) when it cannot.
pub(super) fn relisten(path: &Path) -> Option<Listener> {
    match listen_at(path) {
        Ok(listener) => {
            warn!(
                socket = %path.display(),
                "the ZDS socket's path was unlinked or replaced (istio-cni's agent unlinks it \
                 as it stops): listening there again"
            );
            Some(listener)
        }
        Err(err) => {
            warn!(socket = %path.display(), %err, "cannot listen for ztunnel; retrying");
            None
        }
    }
}

/// The sockets the tests open: ztunnel's, and another agent's at the path.
#[cfg(test)]
pub(super) mod testing {
    use std::{
        os::fd::{AsRawFd, OwnedFd},
        path::Path,
    };

    use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, bind, connect, socket};

    /// A `SOCK_SEQPACKET` Unix socket, as ztunnel and the agents open.
    pub fn seqpacket() -> OwnedFd {
        socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .expect("socket")
    }

    /// A socket bound at `path`.
    pub fn bound_at(path: &Path) -> OwnedFd {
        let fd = seqpacket();
        bind(fd.as_raw_fd(), &UnixAddr::new(path).expect("address")).expect("bind");
        fd
    }

    /// A socket connected to `path`, when something listens there.
    pub fn dialled(path: &Path) -> nix::Result<OwnedFd> {
        let fd = seqpacket();
        connect(fd.as_raw_fd(), &UnixAddr::new(path)?)?;
        Ok(fd)
    }
}
