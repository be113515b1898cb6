//! The connectivity test's workload (`meshcap-agent probe-pod`), the only program its pods
//! run, since meshcap's image ships nothing but the agent:
//! - `serve`: a server answering each TCP connection with one JSON [`Answer`] line (its role,
//!   the listener that took the connection, the local and peer addresses, and what
//!   `getsockopt(SO_ORIGINAL_DST)` says) then closing it. As the stand-in proxy it listens on
//!   Envoy's 15001 and 15006 with `SO_REUSEPORT`, as Envoy's listeners have it, and runs as
//!   Envoy's uid 1337 (the pod's manifest says so); as the upstream, on the test's port.
//! - `dial`: the app, connecting to each target once it can, printing one JSON [`Dialled`]
//!   line per target: the answer, or why none came.
//!
//! A connection refused or timed out is dialled again until the deadline (the proxy or the
//! server of another container or pod may not listen yet); an answer, whoever gave it, is
//! final: a connection that reached the wrong listener is never retried into a pass.
use std::{
    io::{BufRead as _, BufReader, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    os::fd::AsRawFd as _,
    thread,
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};

/// Envoy's outbound listener, where a sidecar pod's outbound connections are redirected.
pub const OUTBOUND_PORT: u16 = 15001;
/// Envoy's inbound listener.
pub const INBOUND_PORT: u16 = 15006;
/// `SO_ORIGINAL_DST` and `IP6T_SO_ORIGINAL_DST` share the number.
const SO_ORIGINAL_DST: libc::c_int = 80;

/// What a server says of one connection it accepted.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Answer {
    /// The server's role: `proxy` for the stand-in Envoy, `server` for the upstream.
    pub role: String,
    /// The port of the listener that took the connection.
    pub listener: u16,
    /// The accepted socket's local address.
    pub local: SocketAddr,
    /// The client's address as the server sees it.
    pub peer: SocketAddr,
    /// `getsockopt(SO_ORIGINAL_DST)` on the accepted socket, when it answered.
    pub original_dst: Option<SocketAddr>,
}

/// What the app printed for one target.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dialled {
    /// The target's name on the command line (`NAME=ADDR:PORT`).
    pub name: String,
    /// The address dialled.
    pub to: SocketAddr,
    /// What answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<Answer>,
    /// Why nothing did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Errors of the workload.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("binding {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("no address family of the listeners is supported here")]
    NoListener,
    #[error("the target {0:?} is not NAME=ADDR:PORT")]
    Target(String),
    #[error("writing the results: {0}")]
    Output(#[from] std::io::Error),
}

/// Parses a target `NAME=ADDR:PORT`.
///
/// # Errors
/// When it is not one.
pub fn target(text: &str) -> Result<(String, SocketAddr), ProbeError> {
    let (name, addr) = text
        .split_once('=')
        .ok_or_else(|| ProbeError::Target(text.to_owned()))?;
    let addr = addr
        .parse()
        .map_err(|_| ProbeError::Target(text.to_owned()))?;
    Ok((name.to_owned(), addr))
}

/// Listens on every address of `listen` (those of a family the kernel lacks skipped) and
/// answers each connection with an [`Answer`] of `role`, until killed. Prints `ready` once
/// every listener is bound.
///
/// # Errors
/// When a listener cannot be bound, or none can.
pub fn serve(role: &str, listen: &[SocketAddr]) -> Result<(), ProbeError> {
    let mut listeners = Vec::new();
    for &addr in listen {
        match bind(addr) {
            Ok(listener) => listeners.push(listener),
            // IPv6 (or IPv4) compiled out or disabled at boot: that family's pods do not exist.
            Err(e) if e.raw_os_error() == Some(libc::EAFNOSUPPORT) => {
                eprintln!("not listening on {addr}: {e}");
            }
            Err(source) => return Err(ProbeError::Bind { addr, source }),
        }
    }
    if listeners.is_empty() {
        return Err(ProbeError::NoListener);
    }
    let mut out = std::io::stdout();
    writeln!(out, "ready")?;
    out.flush()?;
    let handles: Vec<_> = listeners
        .into_iter()
        .map(|listener| {
            let role = role.to_owned();
            thread::spawn(move || {
                // The listener's own port: a connection the kernel assigned to it keeps the
                // address the client dialled as its local one.
                let port = listener.local_addr().map(|a| a.port()).unwrap_or_default();
                for stream in listener.incoming().flatten() {
                    // A client gone before its answer is the client's business.
                    let _ = answer(&role, port, &stream);
                }
            })
        })
        .collect();
    for handle in handles {
        let _ = handle.join();
    }
    Ok(())
}

/// A TCP listener with `SO_REUSEADDR` and `SO_REUSEPORT` (Envoy's listeners have it, and the
/// eBPF backend's socket assignment must cope with it); an IPv6 one is v6-only.
fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    use nix::sys::socket::{
        AddressFamily, Backlog, SockFlag, SockType, SockaddrStorage, bind, listen, setsockopt,
        socket, sockopt,
    };
    let family = if addr.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    let fd = socket(family, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
    setsockopt(&fd, sockopt::ReuseAddr, &true)?;
    setsockopt(&fd, sockopt::ReusePort, &true)?;
    if addr.is_ipv6() {
        setsockopt(&fd, sockopt::Ipv6V6Only, &true)?;
    }
    bind(fd.as_raw_fd(), &SockaddrStorage::from(addr))?;
    listen(&fd, Backlog::new(128).map_err(std::io::Error::from)?)?;
    Ok(TcpListener::from(fd))
}

fn answer(role: &str, listener: u16, stream: &TcpStream) -> std::io::Result<()> {
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

/// Dials each target in turn, again while it is refused or times out, until `deadline` from
/// now; prints one [`Dialled`] line for each.
///
/// # Errors
/// When the results cannot be written.
pub fn dial(targets: &[(String, SocketAddr)], deadline: Duration) -> Result<(), ProbeError> {
    let until = Instant::now() + deadline;
    let mut out = std::io::stdout();
    for (name, to) in targets {
        let dialled = dial_one(name, *to, until);
        writeln!(
            out,
            "{}",
            serde_json::to_string(&dialled).map_err(std::io::Error::from)?
        )?;
        out.flush()?;
    }
    Ok(())
}

/// One target's [`Dialled`], tried until `until`.
#[must_use]
pub fn dial_one(name: &str, to: SocketAddr, until: Instant) -> Dialled {
    loop {
        let error = match exchange(to) {
            Ok(answer) => {
                return Dialled {
                    name: name.to_owned(),
                    to,
                    answer: Some(answer),
                    error: None,
                };
            }
            Err(error) => error,
        };
        if Instant::now() >= until {
            return Dialled {
                name: name.to_owned(),
                to,
                answer: None,
                error: Some(error),
            };
        }
        thread::sleep(Duration::from_millis(500));
    }
}

/// One connection to `to` and the answer line read from it.
fn exchange(to: SocketAddr) -> Result<Answer, String> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_name_equals_address() {
        assert_eq!(
            target("server=10.1.2.3:8080").expect("target"),
            ("server".to_owned(), "10.1.2.3:8080".parse().expect("addr"))
        );
        assert!(matches!(
            target("10.1.2.3:8080"),
            Err(ProbeError::Target(_))
        ));
        assert!(matches!(target("s=10.1.2.3"), Err(ProbeError::Target(_))));
    }

    #[test]
    fn a_server_answers_with_what_it_saw() {
        let listener = bind("127.0.0.1:0".parse().expect("addr")).expect("bind");
        let addr = listener.local_addr().expect("addr");
        let server = thread::spawn(move || {
            let (stream, _) = listener.accept().expect("accept");
            answer("server", addr.port(), &stream).expect("answer");
        });
        let dialled = dial_one("s", addr, Instant::now());
        server.join().expect("server");
        let answer = dialled.answer.expect("an answer");
        assert_eq!(answer.role, "server");
        assert_eq!(answer.listener, addr.port());
        assert_eq!(answer.local, addr);
        assert_eq!(answer.original_dst, None, "nothing redirected it");
    }

    #[test]
    fn an_ipv6_server_answers_with_what_it_saw() {
        let listener = bind("[::1]:0".parse().expect("addr")).expect("bind");
        let addr = listener.local_addr().expect("addr");
        let server = thread::spawn(move || {
            let (stream, _) = listener.accept().expect("accept");
            answer("proxy", addr.port(), &stream).expect("answer");
        });
        let dialled = dial_one("s", addr, Instant::now());
        server.join().expect("server");
        let answer = dialled.answer.expect("an answer");
        assert_eq!((answer.role.as_str(), answer.local), ("proxy", addr));
        assert!(answer.peer.is_ipv6(), "{answer:?}");
    }

    #[test]
    fn nothing_listening_is_an_error_after_the_deadline() {
        let addr = {
            let listener = bind("127.0.0.1:0".parse().expect("addr")).expect("bind");
            listener.local_addr().expect("addr")
        };
        let dialled = dial_one("s", addr, Instant::now());
        assert_eq!(dialled.answer, None);
        assert!(
            dialled
                .error
                .as_deref()
                .is_some_and(|e| e.contains("connecting")),
            "{dialled:?}"
        );
    }
}
