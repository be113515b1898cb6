//! A stand-in for Envoy (or any upstream server) in end-to-end tests.
//!
//! `meshcap-standin --name NAME --listen tcp:ADDR:PORT --listen udp:ADDR:PORT ...`
//! binds every listener, prints `ready`, then answers each TCP connection and each UDP
//! datagram with one JSON [`Report`] line: who answered, on which listener, the local and
//! peer addresses, and what `getsockopt(SO_ORIGINAL_DST)` says — exactly what Envoy and
//! Istio's validation probe rely on. Runs until killed.
//!
//! `--mark N` sets `SO_MARK` on every socket (ztunnel marks its own with 0x539, which the
//! in-pod rules of ambient mode never capture); `--reuseport` sets `SO_REUSEPORT`, with which
//! an old and a new ztunnel both listen in a pod during ztunnel's rolling update.
//!
//! A TCP listener written `tcp:ADDR:PORT+hold` keeps each connection open (one thread per
//! connection) and answers every line the client sends with that line, a space and a fresh
//! report (its `original_dst` asked again), until the client closes: a long-lived connection
//! whose capture can be checked at any time. With `--hbone IP` (repeatable), a connection to
//! such a `+hold` listener whose original destination is at IP is carried over HBONE's port
//! instead, as ztunnel carries one to a workload of the mesh: to `IP:15008`, from this
//! namespace, with the listener's mark; the answer is the far app's report with both proxies'
//! reports in its `via`.
//!
//! A TCP listener written `tcp:ADDR:PORT+hbone` is ztunnel's HBONE listener, mTLS and HTTP/2
//! left out: it answers its report line; when the client then sends `CONNECT ADDR:PORT`, it
//! connects there from the client's own address (transparent, with the listener's mark, as
//! ztunnel's inbound does) and relays the app's answer line.
use std::{
    io::{BufRead as _, BufReader, Write as _},
    mem::MaybeUninit,
    net::{IpAddr, SocketAddr, SocketAddrV4, SocketAddrV6, TcpListener, TcpStream, UdpSocket},
    os::fd::{AsRawFd as _, RawFd},
    sync::Arc,
    thread,
};

use anyhow::{Context as _, bail};
use meshcap_tests::{Report, parse_mark};

/// `SO_ORIGINAL_DST` and `IP6T_SO_ORIGINAL_DST` share the number.
const SO_ORIGINAL_DST: libc::c_int = 80;

fn main() -> anyhow::Result<()> {
    let mut name = String::from("server");
    let mut listens = Vec::new();
    let mut mark = None;
    let mut reuse_port = false;
    let mut hbone = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--name" => name = args.next().context("--name needs a value")?,
            "--listen" => listens.push(args.next().context("--listen needs a value")?),
            "--hbone" => hbone.push(
                args.next()
                    .context("--hbone needs an address")?
                    .parse::<IpAddr>()
                    .context("--hbone needs an address")?,
            ),
            "--mark" => mark = Some(parse_mark(&args.next().context("--mark needs a value")?)?),
            "--reuseport" => reuse_port = true,
            other => bail!("unknown argument {other}"),
        }
    }
    let mut handles = Vec::new();
    for spec in &listens {
        let (proto, addr) = spec
            .split_once(':')
            .context("--listen is proto:addr:port")?;
        let (addr, dual_stack) = match addr.strip_suffix("+dualstack") {
            Some(addr) => (addr, true),
            None => (addr, false),
        };
        let (addr, mode) = if let Some(addr) = addr.strip_suffix("+transparent") {
            (addr, Mode::Transparent)
        } else if let Some(addr) = addr.strip_suffix("+hold") {
            (addr, Mode::Hold)
        } else if let Some(addr) = addr.strip_suffix("+hbone") {
            (addr, Mode::Hbone)
        } else {
            (addr, Mode::Answer)
        };
        let addr: SocketAddr = addr
            .parse()
            .with_context(|| format!("bad address in {spec}"))?;
        let name = name.clone();
        match proto {
            "tcp" => {
                let options = Options { mark, reuse_port };
                let listener = bind_tcp(addr, mode == Mode::Transparent, dual_stack, options)?;
                let serving = Serving {
                    name,
                    mode,
                    mark,
                    hbone: Arc::new(hbone.clone()),
                };
                handles.push(thread::spawn(move || serve_tcp(&serving, &listener)));
            }
            "udp" => {
                let socket = bind_udp(addr, Options { mark, reuse_port })?;
                handles.push(thread::spawn(move || serve_udp(&name, &socket)));
            }
            other => bail!("unknown protocol {other}"),
        }
    }
    println!("ready");
    std::io::stdout().flush()?;
    for handle in handles {
        let _ = handle.join();
    }
    Ok(())
}

/// Socket options every listener gets.
#[derive(Clone, Copy)]
struct Options {
    mark: Option<u32>,
    reuse_port: bool,
}

impl Options {
    fn apply(self, fd: &std::os::fd::OwnedFd) -> anyhow::Result<()> {
        use nix::sys::socket::{setsockopt, sockopt};
        if let Some(mark) = self.mark {
            // Accepted connections inherit it.
            setsockopt(fd, sockopt::Mark, &mark)?;
        }
        if self.reuse_port {
            setsockopt(fd, sockopt::ReusePort, &true)?;
        }
        Ok(())
    }
}

/// IPv6 wildcard listeners are v6-only, as Envoy's are: a v4 connection must not land on
/// them by accident; unless `dual_stack` (`+dualstack`), as ztunnel's `[::]` listeners are,
/// which take IPv4 connections as IPv4-mapped ones.
fn bind_tcp(
    addr: SocketAddr,
    transparent: bool,
    dual_stack: bool,
    options: Options,
) -> anyhow::Result<TcpListener> {
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
    options.apply(&fd)?;
    if addr.is_ipv6() {
        setsockopt(&fd, sockopt::Ipv6V6Only, &!dual_stack)?;
    }
    if transparent {
        // Envoy's TPROXY-mode inbound listener is transparent: iptables' TPROXY target only
        // hands connections to such sockets (bpf_sk_assign does not care).
        set_transparent(&fd, addr.is_ipv6())?;
    }
    bind(fd.as_raw_fd(), &SockaddrStorage::from(addr))
        .with_context(|| format!("binding tcp {addr}"))?;
    listen(&fd, Backlog::new(128)?)?;
    Ok(TcpListener::from(fd))
}

/// As [`bind_tcp`]: IPv6 wildcards are v6-only.
fn bind_udp(addr: SocketAddr, options: Options) -> anyhow::Result<UdpSocket> {
    use nix::sys::socket::{
        AddressFamily, SockFlag, SockType, SockaddrStorage, bind, setsockopt, socket, sockopt,
    };
    let family = if addr.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    let fd = socket(family, SockType::Datagram, SockFlag::SOCK_CLOEXEC, None)?;
    if addr.is_ipv6() {
        setsockopt(&fd, sockopt::Ipv6V6Only, &true)?;
    }
    options.apply(&fd)?;
    bind(fd.as_raw_fd(), &SockaddrStorage::from(addr))
        .with_context(|| format!("binding udp {addr}"))?;
    Ok(UdpSocket::from(fd))
}

/// What a TCP listener does with a connection.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// One report line, then close.
    Answer,
    /// Relay to the original destination from the client's address (TPROXY inbound).
    Transparent,
    /// A report line, then an echo and a fresh report for every line, until the client closes;
    /// over HBONE for a destination of `--hbone`.
    Hold,
    /// A report line, then a `CONNECT` carried to the app: ztunnel's HBONE listener.
    Hbone,
}

/// What a TCP listener serves with.
struct Serving {
    name: String,
    mode: Mode,
    /// The listener's mark, given to its own connections too.
    mark: Option<u32>,
    /// The destinations reached over HBONE.
    hbone: Arc<Vec<IpAddr>>,
}

/// HBONE's port.
const HBONE_PORT: u16 = 15008;

fn serve_tcp(serving: &Serving, listener: &TcpListener) {
    let port = listener.local_addr().map(|a| a.port()).unwrap_or_default();
    for stream in listener.incoming().flatten() {
        let name = serving.name.clone();
        let (mark, hbone) = (serving.mark, serving.hbone.clone());
        let _ = match serving.mode {
            Mode::Transparent => relay_transparent(stream),
            Mode::Answer => answer_tcp(&name, port, stream),
            Mode::Hold => {
                thread::spawn(move || {
                    let to = report(&name, port, &stream)?
                        .original_dst
                        .filter(|dst| hbone.contains(&dst.ip().to_canonical()));
                    match to {
                        Some(dst) => hbone_out(&name, port, stream, dst, mark),
                        None => hold_tcp(&name, port, stream),
                    }
                });
                Ok(())
            }
            Mode::Hbone => {
                thread::spawn(move || hbone_in(&name, port, stream, mark));
                Ok(())
            }
        };
    }
}

/// ztunnel's outbound to a workload of the mesh: the app's connection (`app`, to `dst`) carried
/// to `dst`'s HBONE port, marked `mark`; the far app's answer, with this listener's report and
/// the HBONE listener's in its `via`, is the app's.
fn hbone_out(
    name: &str,
    listener: u16,
    mut app: TcpStream,
    dst: SocketAddr,
    mark: Option<u32>,
) -> anyhow::Result<()> {
    use nix::sys::socket::{SockFlag, SockType, SockaddrStorage, connect, setsockopt, socket};
    let own = report(name, listener, &app)?;
    let dst = SocketAddr::new(dst.ip().to_canonical(), dst.port());
    let fd = socket(family(dst), SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
    if let Some(mark) = mark {
        setsockopt(&fd, nix::sys::socket::sockopt::Mark, &mark)?;
    }
    let hbone = SocketAddr::new(dst.ip(), HBONE_PORT);
    connect(fd.as_raw_fd(), &SockaddrStorage::from(hbone))
        .with_context(|| format!("connecting to {hbone}"))?;
    let mut tunnel = BufReader::new(TcpStream::from(fd));
    let far: Report = serde_json::from_str(&read_line(&mut tunnel)?)?;
    writeln!(tunnel.get_mut(), "CONNECT {dst}")?;
    let mut answer: Report = serde_json::from_str(&read_line(&mut tunnel)?)?;
    answer.via = vec![own, far];
    writeln!(app, "{}", serde_json::to_string(&answer)?)?;
    Ok(())
}

/// ztunnel's HBONE listener: its report, then, on `CONNECT ADDR:PORT`, a connection to the app
/// at ADDR:PORT from the client's own address (transparent, marked `mark`), whose answer line
/// is relayed.
fn hbone_in(
    name: &str,
    listener: u16,
    mut client: TcpStream,
    mark: Option<u32>,
) -> anyhow::Result<()> {
    writeln!(
        client,
        "{}",
        serde_json::to_string(&report(name, listener, &client)?)?
    )?;
    let mut request = BufReader::new(client.try_clone()?);
    let line = read_line(&mut request)?;
    let target: SocketAddr = line
        .strip_prefix("CONNECT ")
        .with_context(|| format!("not a CONNECT: {line:?}"))?
        .parse()?;
    let from = client.peer_addr()?.ip().to_canonical();
    let mut app = BufReader::new(connect_transparent(from, target, mark.unwrap_or_default())?);
    let answer = read_line(&mut app)?;
    writeln!(client, "{answer}")?;
    Ok(())
}

/// One line, without its end; an error at the end of the stream.
fn read_line(reader: &mut impl std::io::BufRead) -> anyhow::Result<String> {
    let mut line = String::new();
    anyhow::ensure!(reader.read_line(&mut line)? > 0, "closed without a line");
    Ok(line.trim_end().to_owned())
}

fn family(addr: SocketAddr) -> nix::sys::socket::AddressFamily {
    if addr.is_ipv4() {
        nix::sys::socket::AddressFamily::Inet
    } else {
        nix::sys::socket::AddressFamily::Inet6
    }
}

fn hold_tcp(name: &str, listener: u16, stream: TcpStream) -> anyhow::Result<()> {
    let mut writer = stream.try_clone()?;
    writeln!(
        writer,
        "{}",
        serde_json::to_string(&report(name, listener, &stream)?)?
    )?;
    for line in BufReader::new(stream.try_clone()?).lines() {
        let line = line?;
        let report = serde_json::to_string(&report(name, listener, &stream)?)?;
        writeln!(writer, "{line} {report}")?;
    }
    Ok(())
}

fn report(name: &str, listener: u16, stream: &TcpStream) -> anyhow::Result<Report> {
    let local = stream.local_addr()?;
    Ok(Report {
        server: name.to_owned(),
        proto: "tcp".into(),
        listener,
        local,
        peer: stream.peer_addr()?,
        // An IPv4 connection on a dual-stack listener is asked as IPv4 (`SOL_IP`), as
        // ztunnel asks first.
        original_dst: original_dst(stream.as_raw_fd(), local.ip().to_canonical().is_ipv6()),
        app_local: None,
        app_peer: None,
        via: Vec::new(),
    })
}

/// Envoy's TPROXY-mode inbound path: connect to the original destination (the accepted
/// socket's local address) from the client's own address (`IP_TRANSPARENT`, mark 1337, as
/// Envoy's `original_src` filter does) and relay the upstream's answer line to the client.
fn relay_transparent(mut client: TcpStream) -> anyhow::Result<()> {
    let dst = client.local_addr()?;
    let upstream = connect_transparent(client.peer_addr()?.ip(), dst, 1337)?;
    let mut line = String::new();
    BufReader::new(upstream).read_line(&mut line)?;
    client.write_all(line.as_bytes())?;
    Ok(())
}

/// A connection to `dst` from `src` (any port), which need not be an address of this
/// namespace (`IP_TRANSPARENT`), marked `mark`.
fn connect_transparent(src: IpAddr, dst: SocketAddr, mark: u32) -> anyhow::Result<TcpStream> {
    use nix::sys::socket::{
        SockFlag, SockType, SockaddrStorage, bind, connect, setsockopt, socket, sockopt,
    };
    let fd = socket(family(dst), SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
    set_transparent(&fd, dst.is_ipv6())?;
    setsockopt(&fd, sockopt::Mark, &mark)?;
    bind(
        fd.as_raw_fd(),
        &SockaddrStorage::from(SocketAddr::new(src, 0)),
    )
    .context("transparent bind")?;
    connect(fd.as_raw_fd(), &SockaddrStorage::from(dst)).context("transparent connect")?;
    Ok(TcpStream::from(fd))
}

/// `IP_TRANSPARENT` / `IPV6_TRANSPARENT` (needs `CAP_NET_ADMIN`, which the harness keeps).
fn set_transparent(fd: &std::os::fd::OwnedFd, v6: bool) -> anyhow::Result<()> {
    use nix::sys::socket::{setsockopt, sockopt};
    if !v6 {
        setsockopt(fd, sockopt::IpTransparent, &true)?;
        return Ok(());
    }
    let on: libc::c_int = 1;
    // SAFETY: an int option on our own socket.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_IPV6,
            libc::IPV6_TRANSPARENT,
            (&raw const on).cast(),
            4,
        )
    };
    anyhow::ensure!(
        rc == 0,
        "IPV6_TRANSPARENT: {}",
        std::io::Error::last_os_error()
    );
    Ok(())
}

fn answer_tcp(name: &str, listener: u16, mut stream: TcpStream) -> anyhow::Result<()> {
    let report = report(name, listener, &stream)?;
    writeln!(stream, "{}", serde_json::to_string(&report)?)?;
    Ok(())
}

fn serve_udp(name: &str, socket: &UdpSocket) {
    let Ok(local) = socket.local_addr() else {
        return;
    };
    let mut buf = [0u8; 1500];
    while let Ok((_, peer)) = socket.recv_from(&mut buf) {
        let report = Report {
            server: name.to_owned(),
            proto: "udp".into(),
            listener: local.port(),
            local,
            peer,
            original_dst: None,
            app_local: None,
            app_peer: None,
            via: Vec::new(),
        };
        if let Ok(line) = serde_json::to_string(&report) {
            let _ = socket.send_to(line.as_bytes(), peer);
        }
    }
}

/// `getsockopt(SOL_IP|SOL_IPV6, SO_ORIGINAL_DST)`, as Envoy calls it.
fn original_dst(fd: RawFd, v6: bool) -> Option<SocketAddr> {
    let mut storage = MaybeUninit::<libc::sockaddr_in6>::zeroed();
    let (level, mut len) = if v6 {
        (libc::SOL_IPV6, size_of::<libc::sockaddr_in6>())
    } else {
        (libc::SOL_IP, size_of::<libc::sockaddr_in>())
    };
    let mut socklen = libc::socklen_t::try_from(len).ok()?;
    // SAFETY: `storage` is large enough for either address family and `socklen` says so.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            level,
            SO_ORIGINAL_DST,
            storage.as_mut_ptr().cast(),
            &raw mut socklen,
        )
    };
    if rc != 0 {
        return None;
    }
    len = usize::try_from(socklen).ok()?;
    // SAFETY: the kernel (or meshcap's getsockopt program) filled `len` bytes of a sockaddr.
    let storage = unsafe { storage.assume_init() };
    if !v6 && len >= size_of::<libc::sockaddr_in>() {
        // SAFETY: sockaddr_in fits in sockaddr_in6 and was written as one.
        let sin: libc::sockaddr_in = unsafe { std::ptr::read((&raw const storage).cast()) };
        return Some(SocketAddr::V4(SocketAddrV4::new(
            u32::from_be(sin.sin_addr.s_addr).into(),
            u16::from_be(sin.sin_port),
        )));
    }
    (v6 && len >= size_of::<libc::sockaddr_in6>()).then(|| {
        SocketAddr::V6(SocketAddrV6::new(
            storage.sin6_addr.s6_addr.into(),
            u16::from_be(storage.sin6_port),
            0,
            0,
        ))
    })
}
