//! The two ends of the data path: a stand-in proxy that recovers the original destination as
//! Envoy does (and, given an upstream, forwards to it as Envoy does), and an app that measures
//! short connections, one persistent connection and bulk throughput against it.
//!
//! Wire format: every message is the connection's message size, at least [`MSG`] bytes. The
//! first message of a connection is a header: byte 0 says what the connection is, [`ECHO`]
//! (every message is answered with itself, the first answer carrying the original destination
//! the proxy recovered in bytes 1..7) or [`BULK`] (everything is discarded until EOF, then
//! answered with the byte count as 8 little-endian bytes); bytes 8..12 hold the message size
//! (u32, little-endian). A forwarding proxy passes every message to its upstream and every
//! answer back, writing the original destination into the first answer itself.
use std::{
    io::{Read as _, Write as _},
    mem::MaybeUninit,
    net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream},
    os::fd::{AsRawFd as _, RawFd},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, ensure};
use serde::{Deserialize, Serialize};

/// The smallest message (and the header's size): bytes per request and per response unless a
/// load says more.
pub const MSG: usize = 64;
const ECHO: u8 = b'E';
const BULK: u8 = b'B';
/// `SO_ORIGINAL_DST`, as Envoy asks for it at `SOL_IP`.
const SO_ORIGINAL_DST: libc::c_int = 80;
/// Bulk write size.
const CHUNK: usize = 128 * 1024;

/// Pins the calling process (all its threads to come) to one CPU.
pub fn pin_to(cpu: usize) -> anyhow::Result<()> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes within it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `cpu` is checked against the set's capacity by the macro's implementation.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: pid 0 is the calling thread; `set` is a valid cpu_set_t of the size given.
    let rc = unsafe { libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &raw const set) };
    ensure!(
        rc == 0,
        "pinning to CPU {cpu}: {}",
        std::io::Error::last_os_error()
    );
    Ok(())
}

/// The stand-in proxy: `threads` threads accepting on one listener, each serving a connection
/// to its end before accepting the next; with `reuseport`, as Envoy's workers do, each thread
/// on a listener of its own in one `SO_REUSEPORT` group (the kernel picks one per connection).
/// With an `upstream`, each connection is forwarded to it over a connection of its own
/// (Envoy's outbound hop). Prints `ready` once listening; runs until killed.
pub fn proxy(
    listen: SocketAddr,
    threads: usize,
    upstream: Option<SocketAddrV4>,
    reuseport: bool,
) -> anyhow::Result<()> {
    let listeners: Vec<TcpListener> = if reuseport {
        (0..threads)
            .map(|_| bind(listen, true))
            .collect::<anyhow::Result<_>>()?
    } else {
        let listener = bind(listen, false)?;
        (0..threads)
            .map(|_| Ok(listener.try_clone()?))
            .collect::<anyhow::Result<_>>()?
    };
    println!("ready");
    std::io::stdout().flush()?;
    let handles: Vec<_> = listeners
        .into_iter()
        .map(|listener| {
            Ok::<_, anyhow::Error>(thread::spawn(move || {
                for stream in listener.incoming().flatten() {
                    let _ = serve(stream, upstream);
                }
            }))
        })
        .collect::<anyhow::Result<_>>()?;
    for handle in handles {
        let _ = handle.join();
    }
    Ok(())
}

/// A listener on `addr`, with `SO_REUSEPORT` when `reuseport`.
fn bind(addr: SocketAddr, reuseport: bool) -> anyhow::Result<TcpListener> {
    use nix::sys::socket::{
        AddressFamily, Backlog, SockFlag, SockType, SockaddrStorage, listen, setsockopt, socket,
        sockopt,
    };
    if !reuseport {
        return TcpListener::bind(addr).with_context(|| format!("binding {addr}"));
    }
    let family = if addr.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    let fd = socket(family, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
    setsockopt(&fd, sockopt::ReuseAddr, &true)?;
    setsockopt(&fd, sockopt::ReusePort, &true)?;
    nix::sys::socket::bind(fd.as_raw_fd(), &SockaddrStorage::from(addr))
        .with_context(|| format!("binding {addr}"))?;
    listen(&fd, Backlog::new(1024)?)?;
    Ok(TcpListener::from(fd))
}

/// A connection's header: its kind and message size.
fn read_header(stream: &mut TcpStream) -> anyhow::Result<(Vec<u8>, usize)> {
    let mut msg = vec![0u8; MSG];
    stream.read_exact(&mut msg)?;
    let size = u32::from_le_bytes([msg[8], msg[9], msg[10], msg[11]]) as usize;
    ensure!(size >= MSG, "message size {size} below {MSG}");
    msg.resize(size, 0);
    stream.read_exact(&mut msg[MSG..])?;
    Ok((msg, size))
}

fn serve(mut stream: TcpStream, upstream: Option<SocketAddrV4>) -> anyhow::Result<()> {
    stream.set_nodelay(true)?;
    // What Envoy does first on every accepted outbound connection.
    let original = original_dst(stream.as_raw_fd());
    let (mut msg, size) = read_header(&mut stream)?;
    let mut next = match upstream {
        Some(addr) => {
            let upstream = TcpStream::connect(addr).with_context(|| format!("upstream {addr}"))?;
            upstream.set_nodelay(true)?;
            Some(upstream)
        }
        None => None,
    };
    if msg[0] == BULK {
        let mut buf = vec![0u8; CHUNK];
        let mut total = size as u64;
        if let Some(upstream) = next.as_mut() {
            upstream.write_all(&msg)?;
        }
        loop {
            let n = stream.read(&mut buf)?;
            if n == 0 {
                break;
            }
            total += n as u64;
            if let Some(upstream) = next.as_mut() {
                upstream.write_all(&buf[..n])?;
            }
        }
        let mut ack = total.to_le_bytes();
        if let Some(upstream) = next.as_mut() {
            upstream.shutdown(std::net::Shutdown::Write)?;
            upstream.read_exact(&mut ack)?;
        }
        stream.write_all(&ack)?;
        return Ok(());
    }
    let mut exchange = |msg: &mut [u8]| -> std::io::Result<()> {
        if let Some(upstream) = next.as_mut() {
            upstream.write_all(msg)?;
            upstream.read_exact(msg)?;
        }
        Ok(())
    };
    exchange(&mut msg)?;
    // What this proxy recovered, not what an upstream wrote there: nothing is zeros.
    let (ip, port) = original.map_or(([0; 4], 0), |addr| (addr.ip().octets(), addr.port()));
    msg[1..5].copy_from_slice(&ip);
    msg[5..7].copy_from_slice(&port.to_be_bytes());
    stream.write_all(&msg)?;
    loop {
        match stream.read_exact(&mut msg) {
            Ok(()) => {
                exchange(&mut msg)?;
                stream.write_all(&msg)?;
            }
            Err(err) if err.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(err) => return Err(err.into()),
        }
    }
}

/// `getsockopt(SOL_IP, SO_ORIGINAL_DST)` on an accepted socket.
fn original_dst(fd: RawFd) -> Option<SocketAddrV4> {
    let mut sin = MaybeUninit::<libc::sockaddr_in>::zeroed();
    let mut len = libc::socklen_t::try_from(size_of::<libc::sockaddr_in>()).ok()?;
    // SAFETY: `sin` has room for a sockaddr_in and `len` says so.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_IP,
            SO_ORIGINAL_DST,
            sin.as_mut_ptr().cast(),
            &raw mut len,
        )
    };
    if rc != 0 {
        return None;
    }
    // SAFETY: the call succeeded, so the kernel wrote a sockaddr_in.
    let sin = unsafe { sin.assume_init() };
    Some(SocketAddrV4::new(
        Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)),
        u16::from_be(sin.sin_port),
    ))
}

/// How much work one client run does.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct Load {
    /// Short connections (after [`Load::warmup`] unmeasured ones).
    pub short: usize,
    /// Unmeasured short connections first.
    pub warmup: usize,
    /// Round trips on the persistent connection (0: skip).
    pub pingpong: usize,
    /// Bytes of bulk transfer (0: skip).
    pub bulk: u64,
    /// Bytes per request and per response, at least [`MSG`].
    pub size: usize,
}

impl Load {
    /// `meshcap-bench client`'s arguments for this load against `target`.
    pub fn client_args(self, target: &str) -> Vec<String> {
        let mut args = vec![
            "client".to_owned(),
            "--target".to_owned(),
            target.to_owned(),
        ];
        for (flag, value) in [
            ("--short", self.short as u64),
            ("--warmup", self.warmup as u64),
            ("--pingpong", self.pingpong as u64),
            ("--bulk", self.bulk),
            ("--size", self.size as u64),
        ] {
            args.extend([flag.to_owned(), value.to_string()]);
        }
        args
    }
}

/// What one client run measured.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Measured {
    /// Short connections per second (measured ones, back to back).
    pub short_per_s: f64,
    /// Short connection latency (connect, request, response, close), µs.
    pub short_p50_us: f64,
    /// 99th percentile of the above.
    pub short_p99_us: f64,
    /// Short connections whose proxy recovered exactly the destination the app dialed.
    pub original_dst_ok: usize,
    /// Short connections measured.
    pub short: usize,
    /// Persistent connection round trip, µs.
    pub pingpong_p50_us: f64,
    /// 99th percentile of the above.
    pub pingpong_p99_us: f64,
    /// Bulk throughput, Gbit/s.
    pub bulk_gbit_s: f64,
}

/// Runs `load` against `target` and returns what it measured.
pub fn client(target: SocketAddrV4, load: Load) -> anyhow::Result<Measured> {
    ensure!(load.size >= MSG, "message size {} below {MSG}", load.size);
    for _ in 0..load.warmup {
        short_connection(target, load.size)?;
    }
    let mut latencies = Vec::with_capacity(load.short);
    let mut original_dst_ok = 0;
    let start = Instant::now();
    for _ in 0..load.short {
        let begin = Instant::now();
        let original = short_connection(target, load.size)?;
        latencies.push(begin.elapsed());
        if original == Some(target) {
            original_dst_ok += 1;
        }
    }
    let elapsed = start.elapsed();
    let mut measured = Measured {
        short_per_s: load.short as f64 / elapsed.as_secs_f64(),
        short_p50_us: percentile_us(&mut latencies, 50.0),
        short_p99_us: percentile_us(&mut latencies, 99.0),
        original_dst_ok,
        short: load.short,
        ..Measured::default()
    };
    if load.pingpong > 0 {
        let mut rtts = pingpong(target, load.pingpong, load.size)?;
        measured.pingpong_p50_us = percentile_us(&mut rtts, 50.0);
        measured.pingpong_p99_us = percentile_us(&mut rtts, 99.0);
    }
    if load.bulk > 0 {
        measured.bulk_gbit_s = bulk(target, load.bulk)?;
    }
    Ok(measured)
}

/// The first message of an echo connection: kind and size in its header.
fn echo_header(size: usize) -> anyhow::Result<Vec<u8>> {
    let mut msg = vec![0u8; size];
    msg[0] = ECHO;
    msg[8..12].copy_from_slice(&u32::try_from(size)?.to_le_bytes());
    Ok(msg)
}

/// Connect, one request/response of `size` bytes each, close. Returns the original
/// destination the proxy saw.
fn short_connection(target: SocketAddrV4, size: usize) -> anyhow::Result<Option<SocketAddrV4>> {
    let mut stream = TcpStream::connect(target).with_context(|| format!("connecting {target}"))?;
    stream.set_nodelay(true)?;
    let mut msg = echo_header(size)?;
    stream.write_all(&msg)?;
    stream.read_exact(&mut msg)?;
    let ip = Ipv4Addr::new(msg[1], msg[2], msg[3], msg[4]);
    let port = u16::from_be_bytes([msg[5], msg[6]]);
    Ok((port != 0).then(|| SocketAddrV4::new(ip, port)))
}

fn pingpong(target: SocketAddrV4, rounds: usize, size: usize) -> anyhow::Result<Vec<Duration>> {
    let mut stream = TcpStream::connect(target)?;
    stream.set_nodelay(true)?;
    let mut msg = echo_header(size)?;
    let mut rtts = Vec::with_capacity(rounds);
    // The first exchange carries the connection set-up: not a steady-state round trip.
    stream.write_all(&msg)?;
    stream.read_exact(&mut msg)?;
    for _ in 0..rounds {
        let begin = Instant::now();
        stream.write_all(&msg)?;
        stream.read_exact(&mut msg)?;
        rtts.push(begin.elapsed());
    }
    Ok(rtts)
}

fn bulk(target: SocketAddrV4, bytes: u64) -> anyhow::Result<f64> {
    let mut stream = TcpStream::connect(target)?;
    let mut header = [0u8; MSG];
    header[0] = BULK;
    header[8..12].copy_from_slice(&u32::try_from(MSG)?.to_le_bytes());
    let chunk = vec![0x5au8; CHUNK];
    let start = Instant::now();
    stream.write_all(&header)?;
    let mut sent = 0u64;
    while sent < bytes {
        let n = usize::try_from((bytes - sent).min(CHUNK as u64))?;
        stream.write_all(&chunk[..n])?;
        sent += n as u64;
    }
    stream.shutdown(std::net::Shutdown::Write)?;
    let mut ack = [0u8; 8];
    stream.read_exact(&mut ack)?;
    let elapsed = start.elapsed();
    ensure!(
        u64::from_le_bytes(ack) == bytes + MSG as u64,
        "the proxy received {} bytes of {}",
        u64::from_le_bytes(ack),
        bytes + MSG as u64
    );
    Ok(bytes as f64 * 8.0 / elapsed.as_secs_f64() / 1e9)
}

/// The `p`th percentile (nearest rank) in µs; sorts `samples`.
fn percentile_us(samples: &mut [Duration], p: f64) -> f64 {
    if samples.is_empty() {
        return 0.0;
    }
    samples.sort_unstable();
    let rank = ((p / 100.0) * samples.len() as f64).ceil() as usize;
    let index = rank.clamp(1, samples.len()) - 1;
    samples[index].as_secs_f64() * 1e6
}
