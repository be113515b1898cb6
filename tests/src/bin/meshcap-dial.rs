//! The application side of end-to-end tests: `meshcap-dial tcp|udp|udpc:ADDR:PORT [--bind ADDR]`
//! (`udpc`: connected UDP)
//! connects (or sends one datagram), prints the one-line answer of whoever took it, or
//! `no-answer: <kind>: <why>` when nothing did (`<kind>`: the failed call's
//! `std::io::ErrorKind`, e.g. `ConnectionRefused` or `TimedOut`). Exits 0 either way: what answered is the test's call.
//!
//! `--mark N` sets `SO_MARK` on the socket (as ztunnel marks its own, 0x539).
//! `--transparent` (IPv4) sets `IP_TRANSPARENT`, so that `--bind` may name an
//! address that is not the host's: ztunnel's inbound connections to the app come from the
//! client's own address.
//!
//! With `--hold` (TCP) it keeps the connection: every line read from stdin is sent, and the
//! answer line printed, until stdin closes (or `no-answer: <why>` and exit on a failure).
//!
//! With `--after-close` (TCP) it reads the answer and then until the server closes its end,
//! prints `closed`, waits for a line on stdin and only then asks its socket for its addresses
//! and prints the answer with them: what the app's socket reports after the proxy's end went.
use std::{
    io::{BufRead as _, BufReader, Write as _},
    net::{SocketAddr, TcpStream, UdpSocket},
    os::fd::AsRawFd as _,
    time::Duration,
};

use anyhow::{Context as _, bail};
use nix::sys::socket::{
    AddressFamily, SockFlag, SockType, SockaddrStorage, bind, connect, setsockopt, socket, sockopt,
};

const TIMEOUT: Duration = Duration::from_secs(3);

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let target = args
        .next()
        .context("usage: meshcap-dial tcp|udp:ADDR:PORT [--bind ADDR]")?;
    let mut bind_to = None;
    let mut hold = false;
    let mut after_close = false;
    let mut mark = None;
    let mut transparent = false;
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--bind" => bind_to = Some(args.next().context("--bind needs an address")?),
            "--hold" => hold = true,
            "--after-close" => after_close = true,
            "--transparent" => transparent = true,
            "--mark" => {
                mark = Some(meshcap_tests::parse_mark(
                    &args.next().context("--mark needs a value")?,
                )?);
            }
            other => bail!("unknown argument {other}"),
        }
    }
    let (proto, addr) = target
        .split_once(':')
        .context("target is proto:addr:port")?;
    let addr: SocketAddr = addr.parse()?;
    let bind_to = bind_to
        .map(|b| parse_bind(&b, addr.is_ipv6()))
        .transpose()?;
    if hold {
        anyhow::ensure!(proto == "tcp", "--hold is for tcp");
        return hold_tcp(addr, mark);
    }
    anyhow::ensure!(!after_close || proto == "tcp", "--after-close is for tcp");
    let answer = match proto {
        "tcp" => tcp(addr, bind_to, mark, transparent).and_then(|(line, mut reader)| {
            if after_close {
                wait_for_close(&mut reader)?;
            }
            let stream = reader.get_ref();
            Ok(with_own_view(
                &line,
                stream.local_addr()?,
                stream.peer_addr()?,
            ))
        }),
        "udp" => udp(addr, bind_to, false, mark),
        "udpc" => udp(addr, bind_to, true, mark),
        other => bail!("unknown protocol {other}"),
    };
    match answer {
        Ok(line) => println!("{}", line.trim()),
        Err(err) => println!("no-answer: {}: {err:#}", error_kind(&err)),
    }
    Ok(())
}

/// How the client failed, as `std::io::ErrorKind` names it (`ConnectionRefused`, `TimedOut`,
/// ...), or `Other` when no system call failed.
fn error_kind(err: &anyhow::Error) -> String {
    err.chain()
        .find_map(|e| {
            e.downcast_ref::<std::io::Error>()
                .map(std::io::Error::kind)
                .or_else(|| {
                    e.downcast_ref::<nix::errno::Errno>()
                        .map(|errno| std::io::Error::from(*errno).kind())
                })
        })
        .map_or_else(|| "Other".to_owned(), |kind| format!("{kind:?}"))
}

/// The server's answer with what the app's own socket reports added: `app_local`
/// (`getsockname`) and `app_peer` (`getpeername`, or where an unconnected socket's reply came
/// from). An answer that is not a JSON object is left as it is.
fn with_own_view(line: &str, local: SocketAddr, peer: SocketAddr) -> String {
    match serde_json::from_str::<serde_json::Value>(line.trim()) {
        Ok(serde_json::Value::Object(mut answer)) => {
            answer.insert("app_local".into(), local.to_string().into());
            answer.insert("app_peer".into(), peer.to_string().into());
            serde_json::Value::Object(answer).to_string()
        }
        _ => line.to_owned(),
    }
}

/// Reads until the server closes its end, says `closed` and waits for a line on stdin.
fn wait_for_close(reader: &mut BufReader<TcpStream>) -> anyhow::Result<()> {
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(reader, &mut rest)?;
    println!("closed");
    std::io::stdout().flush()?;
    let mut go = String::new();
    std::io::stdin().read_line(&mut go)?;
    Ok(())
}

/// `--bind 127.0.0.6` or `--bind 127.0.0.6:0`.
fn parse_bind(text: &str, v6: bool) -> anyhow::Result<SocketAddr> {
    if let Ok(addr) = text.parse() {
        return Ok(addr);
    }
    let ip: std::net::IpAddr = text.parse().with_context(|| format!("bad --bind {text}"))?;
    anyhow::ensure!(
        ip.is_ipv6() == v6,
        "--bind {text} is not of the target's family"
    );
    Ok(SocketAddr::new(ip, 0))
}

/// The `--hold` loop: the first answer, then one answer per stdin line.
fn hold_tcp(addr: SocketAddr, mark: Option<u32>) -> anyhow::Result<()> {
    let (first, mut reader) = match tcp(addr, None, mark, false) {
        Ok(answer) => answer,
        Err(err) => {
            println!("no-answer: {err:#}");
            return Ok(());
        }
    };
    println!("{}", first.trim());
    std::io::stdout().flush()?;
    let mut writer = reader.get_ref().try_clone()?;
    for line in std::io::stdin().lines() {
        let line = line?;
        let mut answer = String::new();
        let sent = writeln!(writer, "{line}").and_then(|()| reader.read_line(&mut answer));
        match sent {
            Ok(n) if n > 0 => println!("{}", answer.trim()),
            Ok(_) => {
                println!("no-answer: connection closed");
                return Ok(());
            }
            Err(err) => {
                println!("no-answer: {err}");
                return Ok(());
            }
        }
        std::io::stdout().flush()?;
    }
    Ok(())
}

fn tcp(
    addr: SocketAddr,
    bind_to: Option<SocketAddr>,
    mark: Option<u32>,
    transparent: bool,
) -> anyhow::Result<(String, BufReader<TcpStream>)> {
    let stream = if bind_to.is_none() && mark.is_none() && !transparent {
        TcpStream::connect_timeout(&addr, TIMEOUT)?
    } else {
        let fd = socket(family(addr), SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
        if let Some(mark) = mark {
            setsockopt(&fd, sockopt::Mark, &mark)?;
        }
        if transparent {
            anyhow::ensure!(addr.is_ipv4(), "--transparent is for IPv4 targets");
            setsockopt(&fd, sockopt::IpTransparent, &true)?;
        }
        if let Some(local) = bind_to {
            // A port named twice in a row: the first connection's TIME_WAIT must not refuse
            // the second (the kernel still checks the 4-tuple at connect).
            if local.port() != 0 {
                setsockopt(&fd, sockopt::ReuseAddr, &true)?;
            }
            bind(fd.as_raw_fd(), &SockaddrStorage::from(local))?;
        }
        connect(fd.as_raw_fd(), &SockaddrStorage::from(addr))?;
        TcpStream::from(fd)
    };
    stream.set_read_timeout(Some(TIMEOUT))?;
    let mut line = String::new();
    let mut reader = BufReader::new(stream);
    reader.read_line(&mut line)?;
    anyhow::ensure!(!line.is_empty(), "connection closed without an answer");
    Ok((line, reader))
}

/// One datagram; `connected`: `connect` (without a `bind` first, unless `--bind`) then
/// `send`/`recv_from`, as glibc's and Go's resolvers do; unconnected: `bind` to the wildcard
/// address then `sendto`, as musl's does.
fn udp(
    addr: SocketAddr,
    bind_to: Option<SocketAddr>,
    connected: bool,
    mark: Option<u32>,
) -> anyhow::Result<String> {
    let fd = socket(
        family(addr),
        SockType::Datagram,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    if let Some(mark) = mark {
        setsockopt(&fd, sockopt::Mark, &mark)?;
    }
    let wildcard = SocketAddr::new(
        if addr.is_ipv4() {
            std::net::Ipv4Addr::UNSPECIFIED.into()
        } else {
            std::net::Ipv6Addr::UNSPECIFIED.into()
        },
        0,
    );
    match (bind_to, connected) {
        (Some(local), _) => bind(fd.as_raw_fd(), &SockaddrStorage::from(local))?,
        (None, false) => bind(fd.as_raw_fd(), &SockaddrStorage::from(wildcard))?,
        (None, true) => {}
    }
    let socket = UdpSocket::from(fd);
    socket.set_read_timeout(Some(TIMEOUT))?;
    if connected {
        socket.connect(addr)?;
        socket.send(b"query")?;
    } else {
        socket.send_to(b"query", addr)?;
    }
    let mut buf = [0u8; 1500];
    let (n, from) = socket.recv_from(&mut buf)?;
    let line = String::from_utf8_lossy(&buf[..n]).into_owned();
    // The reply must look as if it came from where the query went (DNS resolvers check).
    if from != addr {
        return Ok(format!("no-answer: reply came from {from}, not {addr}"));
    }
    let peer = if connected { socket.peer_addr()? } else { from };
    Ok(with_own_view(&line, socket.local_addr()?, peer))
}

fn family(addr: SocketAddr) -> AddressFamily {
    if addr.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    }
}
