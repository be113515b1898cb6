//! Both ends of one TCP stream, for its edge cases: what an app and its proxy see of a byte
//! stream must not depend on how the stream is captured (Istio's rules, meshcap's programs),
//! nor on how its bytes travel (BENCHMARKS.md: the socket shortcut that failed these cases).
//!
//! - `meshcap-stream serve ADDR:PORT CASE` (the proxy's end): listens, prints `ready`, accepts
//!   one connection, reads its original destination (`SO_ORIGINAL_DST`, as Envoy does), plays
//!   its half of `CASE`, prints one line (`ok …, to ORIGINAL` or `fail: …`), exits.
//! - `meshcap-stream dial ADDR:PORT CASE` (the app's end): connects, plays its half, prints
//!   one line, exits.
//!
//! Cases ([`Case`]): `echo` (messages of 1 B to 1 MiB echoed back, byte for byte), `large`
//! (one 16 MiB write, far beyond the socket buffers, read slowly), `half-close` (the app
//! shuts its sending side, then reads the proxy's answer to the end), `peek` (`MSG_PEEK` sees
//! what the next read takes), `sendfile` (the app sends a file with `sendfile`, the
//! proxy takes it with `splice` through a pipe), `reset` (the proxy closes with `SO_LINGER`
//! 0: the app's read fails with `ECONNRESET`), `close` (the proxy closes: the app reads the
//! end of the stream, then its write fails), `deferred` (the proxy's listener has
//! `TCP_DEFER_ACCEPT`, so its end of the connection only exists once the app's first bytes
//! arrive: what the app sends before and after must arrive in order), `many` (2,000
//! connections open at once, each answered as it opens and again when all are open).
use std::{
    io::{ErrorKind, Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    os::fd::AsRawFd as _,
    time::Duration,
};

use anyhow::{Context as _, bail, ensure};
use nix::{
    sys::socket::{MsgFlags, getsockopt, recv, setsockopt, sockopt},
    unistd::pipe,
};

/// Long enough for any case on a slow VM; a hung case fails instead of blocking the test.
const TIMEOUT: Duration = Duration::from_secs(20);

/// The `large` case's single write.
const LARGE: usize = 16 << 20;

/// The `deferred` case's stream, and the pieces the app sends it in.
const DEFERRED: usize = 64 << 10;
const DEFERRED_PIECE: usize = 1 << 10;

/// The `many` case's connections.
const MANY: usize = 2000;

/// The edge cases, by name.
#[derive(Clone, Copy)]
enum Case {
    Echo,
    Large,
    HalfClose,
    Peek,
    Sendfile,
    Reset,
    Close,
    Deferred,
    Many,
}

impl Case {
    fn parse(name: &str) -> anyhow::Result<Self> {
        Ok(match name {
            "echo" => Self::Echo,
            "large" => Self::Large,
            "half-close" => Self::HalfClose,
            "peek" => Self::Peek,
            "sendfile" => Self::Sendfile,
            "reset" => Self::Reset,
            "close" => Self::Close,
            "deferred" => Self::Deferred,
            "many" => Self::Many,
            other => bail!("unknown case {other}"),
        })
    }
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [role, addr, case] = args.as_slice() else {
        bail!("usage: meshcap-stream serve|dial ADDR:PORT CASE");
    };
    let addr: SocketAddr = addr.parse().context("ADDR:PORT")?;
    let case = Case::parse(case)?;
    let result = match role.as_str() {
        "serve" => serve(addr, case),
        "dial" => dial(addr, case),
        other => bail!("unknown role {other}"),
    };
    match result {
        Ok(line) => println!("ok {line}"),
        Err(err) => println!("fail: {err:#}"),
    }
    Ok(())
}

/// Byte `i` of every stream the cases send: a pattern that shows a lost, repeated or
/// reordered piece.
fn pattern(start: usize, len: usize) -> Vec<u8> {
    #[expect(clippy::cast_possible_truncation, reason = "a byte pattern")]
    (start..start + len).map(|i| (i % 251) as u8).collect()
}

fn check(what: &str, got: &[u8], start: usize) -> anyhow::Result<()> {
    let want = pattern(start, got.len());
    if let Some(at) = got.iter().zip(&want).position(|(g, w)| g != w) {
        bail!("{what}: byte {} differs", start + at);
    }
    Ok(())
}

fn serve(addr: SocketAddr, case: Case) -> anyhow::Result<String> {
    let listener = TcpListener::bind(addr).with_context(|| format!("listening on {addr}"))?;
    if matches!(case, Case::Deferred) {
        set_int(&listener, libc::IPPROTO_TCP, libc::TCP_DEFER_ACCEPT, 5)?;
    }
    if matches!(case, Case::Many) {
        return serve_many(&listener);
    }
    println!("ready");
    std::io::stdout().flush()?;
    let (conn, _) = listener.accept().context("accept")?;
    conn.set_read_timeout(Some(TIMEOUT))?;
    conn.set_write_timeout(Some(TIMEOUT))?;
    let to = original_dst(&conn)?;
    play(conn, case).map(|line| format!("{line}, to {to}"))
}

/// What `getsockopt(SOL_IP, SO_ORIGINAL_DST)` says of an accepted connection.
fn original_dst(conn: &TcpStream) -> anyhow::Result<std::net::SocketAddrV4> {
    let sin = getsockopt(conn, sockopt::OriginalDst).context("SO_ORIGINAL_DST")?;
    Ok(std::net::SocketAddrV4::new(
        u32::from_be(sin.sin_addr.s_addr).into(),
        u16::from_be(sin.sin_port),
    ))
}

/// The proxy's half of `case` on an accepted connection (closed when it returns).
fn play(mut conn: TcpStream, case: Case) -> anyhow::Result<String> {
    match case {
        Case::Echo => {
            let mut buf = vec![0; 1 << 20];
            let mut total = 0;
            loop {
                let n = conn.read(&mut buf)?;
                if n == 0 {
                    return Ok(format!("echoed {total}"));
                }
                conn.write_all(&buf[..n])?;
                total += n;
            }
        }
        Case::Large => {
            let mut buf = vec![0; 64 << 10];
            let mut total = 0;
            while total < LARGE {
                let n = conn.read(&mut buf)?;
                ensure!(n > 0, "end of stream after {total} bytes");
                check("large", &buf[..n], total)?;
                total += n;
                // A slow reader for the first quarter: the writer must wait, not lose bytes.
                if total < LARGE / 4 {
                    std::thread::sleep(Duration::from_micros(200));
                }
            }
            conn.write_all(format!("{total}\n").as_bytes())?;
            Ok(format!("read {total}"))
        }
        Case::HalfClose => {
            let mut got = Vec::new();
            conn.read_to_end(&mut got)?;
            check("half-close", &got, 0)?;
            conn.write_all(format!("got {}\n", got.len()).as_bytes())?;
            Ok(format!("read {} to the end", got.len()))
        }
        Case::Peek => {
            let mut peeked = [0; 5];
            let n = recv(conn.as_raw_fd(), &mut peeked, MsgFlags::MSG_PEEK)?;
            let mut all = [0; 11];
            conn.read_exact(&mut all)?;
            conn.write_all(b"done\n")?;
            Ok(format!(
                "peeked {:?} read {:?}",
                String::from_utf8_lossy(&peeked[..n]),
                String::from_utf8_lossy(&all)
            ))
        }
        Case::Sendfile => {
            let (out, into) = pipe()?;
            let mut out = std::fs::File::from(out);
            let mut total = 0;
            let mut got = Vec::new();
            loop {
                // SAFETY: two open descriptors, no offsets.
                let n = unsafe {
                    libc::splice(
                        conn.as_raw_fd(),
                        std::ptr::null_mut(),
                        into.as_raw_fd(),
                        std::ptr::null_mut(),
                        64 << 10,
                        0,
                    )
                };
                let n = usize::try_from(n).map_err(|_| std::io::Error::last_os_error())?;
                if n == 0 {
                    break;
                }
                let mut chunk = vec![0; n];
                out.read_exact(&mut chunk)?;
                got.extend_from_slice(&chunk);
                total += n;
            }
            check("sendfile", &got, 0)?;
            conn.write_all(format!("{total}\n").as_bytes())?;
            Ok(format!("spliced {total}"))
        }
        Case::Reset => {
            let mut line = [0; 6];
            conn.read_exact(&mut line)?;
            setsockopt(
                &conn,
                sockopt::Linger,
                &libc::linger {
                    l_onoff: 1,
                    l_linger: 0,
                },
            )?;
            drop(conn);
            Ok("reset".to_owned())
        }
        Case::Close => {
            let mut line = [0; 6];
            conn.read_exact(&mut line)?;
            drop(conn);
            Ok("closed".to_owned())
        }
        Case::Deferred => {
            // Everything the app sends is queued before the first read.
            std::thread::sleep(Duration::from_millis(200));
            let mut got = vec![0; DEFERRED];
            conn.read_exact(&mut got)?;
            check("deferred", &got, 0)?;
            conn.write_all(b"done\n")?;
            Ok(format!("read {DEFERRED} in order"))
        }
        Case::Many => unreachable!("served by serve_many"),
    }
}

fn serve_many(listener: &TcpListener) -> anyhow::Result<String> {
    raise_fd_limit()?;
    println!("ready");
    std::io::stdout().flush()?;
    let mut conns = Vec::with_capacity(MANY);
    let echo = |conn: &mut TcpStream| -> anyhow::Result<()> {
        let mut buf = [0; 8];
        conn.read_exact(&mut buf)?;
        conn.write_all(&buf)?;
        Ok(())
    };
    let mut to = std::collections::BTreeSet::new();
    for i in 0..MANY {
        let (mut conn, _) = listener.accept().with_context(|| format!("accept {i}"))?;
        conn.set_read_timeout(Some(TIMEOUT))?;
        echo(&mut conn).with_context(|| format!("connection {i}"))?;
        conns.push(conn);
    }
    for (i, conn) in conns.iter_mut().enumerate() {
        echo(conn).with_context(|| format!("connection {i}, again"))?;
        to.insert(original_dst(conn).with_context(|| format!("connection {i}"))?);
    }
    let to: Vec<_> = to.iter().map(ToString::to_string).collect();
    Ok(format!("echoed on {MANY}, to {}", to.join(" ")))
}

fn dial_many(addr: SocketAddr) -> anyhow::Result<String> {
    raise_fd_limit()?;
    let mut conns = Vec::with_capacity(MANY);
    let ask = |conn: &mut TcpStream, i: usize| -> anyhow::Result<()> {
        let msg = u64::try_from(i)?.to_le_bytes();
        conn.write_all(&msg)?;
        let mut back = [0; 8];
        conn.read_exact(&mut back)?;
        ensure!(back == msg, "connection {i} answered {back:?}");
        Ok(())
    };
    for i in 0..MANY {
        let mut conn = TcpStream::connect_timeout(&addr, TIMEOUT)
            .with_context(|| format!("connection {i}"))?;
        conn.set_read_timeout(Some(TIMEOUT))?;
        ask(&mut conn, i)?;
        conns.push(conn);
    }
    for (i, conn) in conns.iter_mut().enumerate() {
        ask(conn, i).with_context(|| format!("connection {i}, again"))?;
    }
    Ok(format!("{MANY} connections answered twice"))
}

/// Both ends of [`MANY`] connections need more descriptors than the usual soft limit.
fn raise_fd_limit() -> anyhow::Result<()> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is a valid `rlimit` for the kernel to fill, then to read.
    let rc = unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut limit) == 0 {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &raw const limit)
        } else {
            -1
        }
    };
    ensure!(
        rc == 0,
        "RLIMIT_NOFILE: {}",
        std::io::Error::last_os_error()
    );
    Ok(())
}

fn set_int(
    fd: &impl std::os::fd::AsRawFd,
    level: libc::c_int,
    name: libc::c_int,
    value: libc::c_int,
) -> anyhow::Result<()> {
    // SAFETY: an open socket and an int of the size passed.
    let rc = unsafe { libc::setsockopt(fd.as_raw_fd(), level, name, (&raw const value).cast(), 4) };
    ensure!(
        rc == 0,
        "setsockopt {level}/{name}: {}",
        std::io::Error::last_os_error()
    );
    Ok(())
}

fn dial(addr: SocketAddr, case: Case) -> anyhow::Result<String> {
    if matches!(case, Case::Many) {
        return dial_many(addr);
    }
    let mut conn =
        TcpStream::connect_timeout(&addr, TIMEOUT).with_context(|| format!("connecting {addr}"))?;
    conn.set_read_timeout(Some(TIMEOUT))?;
    conn.set_write_timeout(Some(TIMEOUT))?;
    let line = |conn: &mut TcpStream| -> anyhow::Result<String> {
        let mut out = Vec::new();
        let mut byte = [0];
        while conn.read(&mut byte)? == 1 && byte[0] != b'\n' {
            out.push(byte[0]);
        }
        Ok(String::from_utf8_lossy(&out).into_owned())
    };
    match case {
        Case::Echo => {
            let mut sent = 0;
            for size in [1, 64, 1 << 10, 64 << 10, 1 << 20] {
                let msg = pattern(sent, size);
                conn.write_all(&msg)?;
                let mut back = vec![0; size];
                conn.read_exact(&mut back)?;
                check(&format!("echo of {size} B"), &back, sent)?;
                sent += size;
            }
            conn.shutdown(std::net::Shutdown::Write)?;
            let mut rest = Vec::new();
            conn.read_to_end(&mut rest)?;
            ensure!(rest.is_empty(), "{} bytes after the echoes", rest.len());
            Ok(format!("echoed {sent}"))
        }
        Case::Large => {
            conn.write_all(&pattern(0, LARGE))?;
            Ok(format!("wrote {LARGE}, proxy read {}", line(&mut conn)?))
        }
        Case::HalfClose => {
            let size = 100 << 10;
            conn.write_all(&pattern(0, size))?;
            conn.shutdown(std::net::Shutdown::Write)?;
            let mut answer = String::new();
            conn.read_to_string(&mut answer)?;
            Ok(format!("wrote {size}, answer {:?}", answer.trim_end()))
        }
        Case::Peek => {
            conn.write_all(b"hello world")?;
            Ok(line(&mut conn)?)
        }
        Case::Sendfile => {
            let size = 1 << 20;
            let mut file = memfd()?;
            file.write_all(&pattern(0, size))?;
            let mut offset: libc::off_t = 0;
            while usize::try_from(offset)? < size {
                // SAFETY: two open descriptors; `offset` outlives the call.
                let n = unsafe {
                    libc::sendfile(conn.as_raw_fd(), file.as_raw_fd(), &raw mut offset, size)
                };
                ensure!(
                    n > 0,
                    "sendfile at {offset}: {}",
                    std::io::Error::last_os_error()
                );
            }
            conn.shutdown(std::net::Shutdown::Write)?;
            Ok(format!("sent {size}, proxy spliced {}", line(&mut conn)?))
        }
        Case::Reset => {
            conn.write_all(b"reset\n")?;
            let mut buf = [0; 16];
            match conn.read(&mut buf) {
                Err(e) if e.kind() == ErrorKind::ConnectionReset => Ok("reset".to_owned()),
                other => bail!("expected a reset, read {other:?}"),
            }
        }
        Case::Close => {
            conn.write_all(b"close\n")?;
            let mut buf = [0; 16];
            let n = conn.read(&mut buf)?;
            ensure!(n == 0, "read {n} bytes where the stream ends");
            // The proxy's socket is gone: the first write is answered with a reset, a later
            // one fails.
            let mut failed = None;
            for _ in 0..50 {
                if let Err(e) = conn.write_all(b"more\n") {
                    failed = Some(e.kind());
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Ok(format!("end of stream, then write {failed:?}"))
        }
        Case::Deferred => {
            for at in (0..DEFERRED).step_by(DEFERRED_PIECE) {
                conn.write_all(&pattern(at, DEFERRED_PIECE))?;
            }
            ensure!(line(&mut conn)? == "done", "no answer from the proxy");
            Ok(format!("sent {DEFERRED}"))
        }
        Case::Many => unreachable!("dialled by dial_many"),
    }
}

/// An anonymous file to `sendfile` from (no file system needed: the VMs' is an initramfs).
fn memfd() -> anyhow::Result<std::fs::File> {
    // SAFETY: a NUL-terminated name; the new descriptor is owned by the `File`.
    let fd = unsafe { libc::memfd_create(c"meshcap-stream".as_ptr(), 0) };
    ensure!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: a descriptor this process just opened and nothing else owns.
    Ok(unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) })
}
