//! The connectivity test's workload (`meshcap-agent probe-pod`), the only program its pods
//! run, since meshcap's image ships nothing but the agent:
//! - `serve`: a server answering each TCP connection with one JSON [`Answer`] line (its role,
//!   the listener that took the connection, the local and peer addresses, and what
//!   `getsockopt(SO_ORIGINAL_DST)` says) then closing it. As the stand-in proxy it listens on
//!   Envoy's 15001 and 15006 with `SO_REUSEPORT`, as Envoy's listeners have it, and runs as
//!   Envoy's uid 1337 (the pod's manifest says so); as the upstream, on the test's port.
//!   With `--udp-listen` it also answers each UDP datagram with an [`Answer`] (Istio's DNS
//!   proxy listens on 15053 for both).
//! - `dial`: the app, connecting to each target once it can, printing one JSON [`Dialled`]
//!   line per target: the answer, or why none came. A `--udp` target gets one datagram, and
//!   its answer is taken only from the target's address, as a resolver takes it: the answer of
//!   a redirected datagram shows the redirect undone for the app, as a DNS client needs it.
//!
//! A connection refused or timed out is dialled again until the deadline (the proxy or the
//! server of another container or pod may not listen yet); an answer, whoever gave it, is
//! final: a connection that reached the wrong listener is never retried into a pass.
mod socket;

use std::{
    io::Write as _,
    net::{SocketAddr, TcpListener, UdpSocket},
    thread,
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};
use socket::{Type, answer, answer_datagrams, bind, bound, exchange, exchange_datagram};

/// Envoy's outbound listener, where a sidecar pod's outbound connections are redirected.
pub const OUTBOUND_PORT: u16 = 15001;
/// Envoy's inbound listener.
pub const INBOUND_PORT: u16 = 15006;
/// DNS's port, which Istio's DNS capture takes (TCP and UDP).
pub const DNS_PORT: u16 = 53;
/// Istio's DNS proxy (in the sidecar's `pilot-agent`), where captured port-53 traffic goes.
pub const DNS_CAPTURE_PORT: u16 = 15053;

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

/// Listens on every address of `listen` (TCP) and `udp` (those of a family the kernel lacks
/// skipped) and answers each connection and datagram with an [`Answer`] of `role`, until
/// killed. Prints `ready` once every listener is bound.
///
/// # Errors
/// When a listener cannot be bound, or none can.
pub fn serve(role: &str, listen: &[SocketAddr], udp: &[SocketAddr]) -> Result<(), ProbeError> {
    let tcp = bound(listen, |a| bind(a, Type::Stream).map(TcpListener::from))?;
    let udp = bound(udp, |a| bind(a, Type::Datagram).map(UdpSocket::from))?;
    if tcp.is_empty() && udp.is_empty() {
        return Err(ProbeError::NoListener);
    }
    let mut out = std::io::stdout();
    writeln!(out, "ready")?;
    out.flush()?;
    let udp = udp.into_iter().map(|socket| {
        let role = role.to_owned();
        thread::spawn(move || answer_datagrams(&role, &socket))
    });
    let handles: Vec<_> = udp
        .chain(tcp.into_iter().map(|listener| {
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
        }))
        .collect();
    for handle in handles {
        let _ = handle.join();
    }
    Ok(())
}

/// How a target is dialled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    Tcp,
    Udp,
}

/// Dials each target in turn, again while it is refused or times out, until `deadline` from
/// now; prints one [`Dialled`] line for each.
///
/// # Errors
/// When the results cannot be written.
pub fn dial(
    targets: &[(String, SocketAddr, Protocol)],
    deadline: Duration,
) -> Result<(), ProbeError> {
    let until = Instant::now() + deadline;
    let mut out = std::io::stdout();
    for (name, to, protocol) in targets {
        let dialled = dial_one(name, *to, *protocol, until);
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
pub fn dial_one(name: &str, to: SocketAddr, protocol: Protocol, until: Instant) -> Dialled {
    loop {
        let exchanged = match protocol {
            Protocol::Tcp => exchange(to),
            Protocol::Udp => exchange_datagram(to),
        };
        let error = match exchanged {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn tcp(addr: &str) -> TcpListener {
        TcpListener::from(bind(addr.parse().expect("addr"), Type::Stream).expect("bind"))
    }

    /// A server of `role` on `listen` answers one dialled connection: its address, and what it
    /// saw.
    fn answered_once(listen: &str, role: &'static str) -> (SocketAddr, Answer) {
        let listener = tcp(listen);
        let addr = listener.local_addr().expect("addr");
        let server = thread::spawn(move || {
            let (stream, _) = listener.accept().expect("accept");
            answer(role, addr.port(), &stream).expect("answer");
        });
        let dialled = dial_one("s", addr, Protocol::Tcp, Instant::now());
        server.join().expect("server");
        (addr, dialled.answer.expect("an answer"))
    }

    #[test]
    fn a_datagram_is_answered_from_the_address_it_was_sent_to() {
        let socket = UdpSocket::from(
            bind("127.0.0.1:0".parse().expect("addr"), Type::Datagram).expect("bind"),
        );
        let addr = socket.local_addr().expect("addr");
        thread::spawn(move || answer_datagrams("proxy", &socket));
        let dialled = dial_one("dns", addr, Protocol::Udp, Instant::now());
        let answer = dialled.answer.expect("an answer");
        assert_eq!(
            (answer.role.as_str(), answer.listener),
            ("proxy", addr.port())
        );
        assert!(answer.peer.ip().is_loopback(), "{answer:?}");
    }

    #[test]
    fn an_answer_from_another_address_is_not_taken() {
        // Bound to every address: it answers 127.0.0.2's datagram from 127.0.0.1, the source
        // the kernel picks, as an answer whose redirect was not undone comes.
        let socket = UdpSocket::from(
            bind("0.0.0.0:0".parse().expect("addr"), Type::Datagram).expect("bind"),
        );
        let port = socket.local_addr().expect("addr").port();
        thread::spawn(move || answer_datagrams("proxy", &socket));
        let to = SocketAddr::from(([127, 0, 0, 2], port));
        let dialled = dial_one("dns", to, Protocol::Udp, Instant::now());
        assert_eq!(dialled.answer, None);
        let error = dialled.error.unwrap_or_default();
        assert!(
            error.starts_with(&format!("the answer to {to} came from 127.0.0.1:{port}")),
            "{error}"
        );
    }

    #[test]
    fn a_datagram_nothing_answers_is_an_error_after_the_deadline() {
        let addr = {
            let socket = UdpSocket::bind("127.0.0.1:0").expect("bind");
            socket.local_addr().expect("addr")
        };
        let dialled = dial_one("dns", addr, Protocol::Udp, Instant::now());
        assert_eq!(dialled.answer, None);
        assert!(
            dialled
                .error
                .as_deref()
                .is_some_and(|e| e.contains("no answer from 127.0.0.1")),
            "{dialled:?}"
        );
    }

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

    /// In a throwaway netns of a thread's own: conntrack answers `SO_ORIGINAL_DST` for any
    /// connection it tracks, and the host's netns may track them all (a `ct` rule of kubelet's
    /// does), which is no part of what this test checks.
    #[test]
    fn a_server_answers_with_what_it_saw() {
        thread::spawn(|| {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare (root)");
            let up = std::process::Command::new("ip")
                .args(["link", "set", "lo", "up"])
                .status();
            assert!(up.expect("ip").success());
            let (addr, answer) = answered_once("127.0.0.1:0", "server");
            assert_eq!(answer.role, "server");
            assert_eq!(answer.listener, addr.port());
            assert_eq!(answer.local, addr);
            assert_eq!(answer.original_dst, None, "nothing redirected it");
        })
        .join()
        .expect("the thread");
    }

    #[test]
    fn an_ipv6_server_answers_with_what_it_saw() {
        let (addr, answer) = answered_once("[::1]:0", "proxy");
        assert_eq!((answer.role.as_str(), answer.local), ("proxy", addr));
        assert!(answer.peer.is_ipv6(), "{answer:?}");
    }

    #[test]
    fn nothing_listening_is_an_error_after_the_deadline() {
        let addr = tcp("127.0.0.1:0").local_addr().expect("addr");
        let dialled = dial_one("s", addr, Protocol::Tcp, Instant::now());
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
