//! The workload's sockets: Envoy-like listeners, the answers they give, and one exchange
//! with a target over TCP or UDP.
use std::{
    io::{BufRead as _, BufReader, Write as _},
    net::{SocketAddr, TcpStream, UdpSocket},
    os::fd::AsRawFd as _,
    time::Duration,
};

use super::{Answer, ProbeError};

/// `SO_ORIGINAL_DST` and `IP6T_SO_ORIGINAL_DST` share the number.
const SO_ORIGINAL_DST: libc::c_int = 80;

/// The sockets `bind` gives for `addrs`, those of a family the kernel lacks skipped.
pub(super) fn bound<T>(
    addrs: &[SocketAddr],
    bind: impl Fn(SocketAddr) -> std::io::Result<T>,
) -> Result<Vec<T>, ProbeError> {
    let mut sockets = Vec::new();
    for &addr in addrs {
        match bind(addr) {
            Ok(socket) => sockets.push(socket),
            // IPv6 (or IPv4) compiled out or disabled at boot: that family's pods do not exist;
            // or disabled in the pod (no `::1`).
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EAFNOSUPPORT | libc::EADDRNOTAVAIL)
                ) =>
            {
                eprintln!("not listening on {addr}: {e}");
            }
            Err(source) => return Err(ProbeError::Bind { addr, source }),
        }
    }
    Ok(sockets)
}

/// A socket's type.
#[derive(Clone, Copy)]
pub(super) enum Type {
    Stream,
    Datagram,
}

/// A listening TCP or a bound UDP socket with `SO_REUSEADDR` and `SO_REUSEPORT` (Envoy's
/// listeners have it, and the eBPF backend's socket assignment must cope with it); an IPv6 one
/// is v6-only.
pub(super) fn bind(addr: SocketAddr, kind: Type) -> std::io::Result<std::os::fd::OwnedFd> {
    use nix::sys::socket::{
        AddressFamily, Backlog, SockFlag, SockType, SockaddrStorage, bind, listen, setsockopt,
        socket, sockopt,
    };
    let family = if addr.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    let socket_type = match kind {
        Type::Stream => SockType::Stream,
        Type::Datagram => SockType::Datagram,
    };
    let fd = socket(family, socket_type, SockFlag::SOCK_CLOEXEC, None)?;
    setsockopt(&fd, sockopt::ReuseAddr, &true)?;
    setsockopt(&fd, sockopt::ReusePort, &true)?;
    if addr.is_ipv6() {
        setsockopt(&fd, sockopt::Ipv6V6Only, &true)?;
    }
    bind(fd.as_raw_fd(), &SockaddrStorage::from(addr))?;
    if let Type::Stream = kind {
        listen(&fd, Backlog::new(128).map_err(std::io::Error::from)?)?;
    }
    Ok(fd)
}

/// Answers each datagram on `socket` with an [`Answer`] of `role` (no original destination:
/// the kernel keeps none for UDP), until the socket fails.
pub(super) fn answer_datagrams(role: &str, socket: &UdpSocket) {
    let Ok(local) = socket.local_addr() else {
        return;
    };
    let mut buffer = [0; 512];
    while let Ok((_, peer)) = socket.recv_from(&mut buffer) {
        let answer = Answer {
            role: role.to_owned(),
            listener: local.port(),
            local,
            peer,
            original_dst: None,
        };
        if let Ok(line) = serde_json::to_string(&answer) {
            // A client gone before its answer is the client's business.
            let _ = socket.send_to(line.as_bytes(), peer);
        }
    }
}

pub(super) fn answer(role: &str, listener: u16, stream: &TcpStream) -> std::io::Result<()> {
    let local = stream.local_addr()?;
    let answer = Answer {
        role: role.to_owned(),
        listener,
        local,
        peer: stream.peer_addr()?,
        original_dst: original_dst(stream, local.is_ipv6()),
    };
    let mut writer = stream;
    writeln!(writer, "{}", serde_json::to_string(&answer)?)?;
    writer.flush()
}

/// `SO_ORIGINAL_DST` (`IP6T_SO_ORIGINAL_DST` on IPv6), when the kernel has one.
fn original_dst(stream: &TcpStream, v6: bool) -> Option<SocketAddr> {
    use nix::sys::socket::{SockaddrLike as _, SockaddrStorage};
    let mut storage = std::mem::MaybeUninit::<libc::sockaddr_storage>::zeroed();
    let mut len = libc::socklen_t::try_from(size_of::<libc::sockaddr_storage>()).ok()?;
    let level = if v6 { libc::SOL_IPV6 } else { libc::SOL_IP };
    // SAFETY: the kernel writes at most `len` bytes into `storage`, our own buffer.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            level,
            SO_ORIGINAL_DST,
            storage.as_mut_ptr().cast(),
            &raw mut len,
        )
    };
    if rc != 0 {
        return None;
    }
    // SAFETY: the kernel filled `len` bytes of a socket address.
    let addr = unsafe { SockaddrStorage::from_raw(storage.as_ptr().cast(), Some(len)) }?;
    if let Some(v4) = addr.as_sockaddr_in() {
        return Some(SocketAddr::V4((*v4).into()));
    }
    addr.as_sockaddr_in6()
        .map(|v6| SocketAddr::V6((*v6).into()))
}

/// One connection to `to` and the answer line read from it.
pub(super) fn exchange(to: SocketAddr) -> Result<Answer, String> {
    let stream = TcpStream::connect_timeout(&to, Duration::from_secs(3))
        .map_err(|e| format!("connecting to {to}: {e}"))?;
    stream
        .set_read_timeout(Some(Duration::from_secs(3)))
        .map_err(|e| e.to_string())?;
    let mut line = String::new();
    BufReader::new(&stream)
        .read_line(&mut line)
        .map_err(|e| format!("reading from {to}: {e}"))?;
    serde_json::from_str(line.trim()).map_err(|e| format!("{to} answered {line:?}: {e}"))
}

/// One datagram to `to`, and the answer taken only from `to`, as a resolver takes it (glibc's
/// checks the source of an answer): a captured datagram's answer shows the capture undone.
pub(super) fn exchange_datagram(to: SocketAddr) -> Result<Answer, String> {
    let local: SocketAddr = if to.is_ipv4() {
        (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let socket = UdpSocket::bind(local).map_err(|e| format!("binding {local}: {e}"))?;
    socket
        .set_read_timeout(Some(Duration::from_secs(3)))
        .map_err(|e| e.to_string())?;
    socket
        .send_to(b"meshcap connectivity test", to)
        .map_err(|e| format!("sending to {to}: {e}"))?;
    let mut buffer = [0; 1024];
    let (read, from) = socket
        .recv_from(&mut buffer)
        .map_err(|e| format!("no answer from {to}: {e}"))?;
    let text = String::from_utf8_lossy(&buffer[..read]);
    if from != to {
        return Err(format!("the answer to {to} came from {from}: {text}"));
    }
    serde_json::from_str(text.trim()).map_err(|e| format!("{to} answered {text:?}: {e}"))
}
