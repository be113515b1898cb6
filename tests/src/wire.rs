//! Frames as they cross a link: an `AF_PACKET` capture, TCP segments read from its frames with
//! their checksums checked, and a device's transmit checksum offload switched off, so that what
//! it sends carries complete checksums, as packets do on a physical network. Everything here
//! acts in the calling thread's network namespace (`crate::Netns::run_in`).
use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

const ETH_P_ALL: u16 = 0x0003;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86DD;
const SIOCETHTOOL: libc::c_ulong = 0x8946;
const ETHTOOL_STXCSUM: u32 = 0x17;
const IPPROTO_TCP: u8 = 6;

fn ifindex(name: &str) -> anyhow::Result<u32> {
    let c = std::ffi::CString::new(name)?;
    // SAFETY: a NUL-terminated name.
    match unsafe { libc::if_nametoindex(c.as_ptr()) } {
        0 => Err(std::io::Error::last_os_error()).with_context(|| format!("no device {name}")),
        i => Ok(i),
    }
}

/// `ethtool -K <name> tx on|off`.
///
/// # Errors
/// When the device is missing or refuses.
pub fn set_tx_checksum(name: &str, on: bool) -> anyhow::Result<()> {
    #[repr(C)]
    struct EthtoolValue {
        cmd: u32,
        data: u32,
    }
    #[repr(C)]
    struct Ifreq {
        name: [u8; libc::IFNAMSIZ],
        data: *mut EthtoolValue,
        pad: [u8; 16],
    }
    let mut value = EthtoolValue {
        cmd: ETHTOOL_STXCSUM,
        data: u32::from(on),
    };
    let mut req = Ifreq {
        name: [0; libc::IFNAMSIZ],
        data: &raw mut value,
        pad: [0; 16],
    };
    anyhow::ensure!(name.len() < libc::IFNAMSIZ, "device name {name} too long");
    req.name[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: plain socket call.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    anyhow::ensure!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` is a fresh socket we own from here on.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: `req` is a valid ifreq pointing at `value`, both alive for the call.
    if unsafe { libc::ioctl(fd.as_raw_fd(), SIOCETHTOOL, &raw mut req) } != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("ethtool -K {name} tx {}", if on { "on" } else { "off" }));
    }
    Ok(())
}

/// Every frame a device sends or receives, from when it was opened.
#[derive(Debug)]
pub struct Capture(OwnedFd);

impl Capture {
    /// Opens a capture on `name`.
    ///
    /// # Errors
    /// When the device is missing or the socket refused.
    pub fn open(name: &str) -> anyhow::Result<Self> {
        let protocol = ETH_P_ALL.to_be();
        // SAFETY: plain socket call.
        let fd = unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                i32::from(protocol),
            )
        };
        anyhow::ensure!(
            fd >= 0,
            "AF_PACKET socket: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: `fd` is a fresh socket we own from here on.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: all-zero is a valid sockaddr_ll.
        let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_protocol = protocol;
        addr.sll_ifindex = i32::try_from(ifindex(name)?)?;
        // SAFETY: `addr` is a sockaddr_ll of the size given.
        let bound = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&raw const addr).cast(),
                u32::try_from(size_of::<libc::sockaddr_ll>())?,
            )
        };
        anyhow::ensure!(
            bound == 0,
            "bind to {name}: {}",
            std::io::Error::last_os_error()
        );
        Ok(Self(fd))
    }

    /// The first TCP segment captured for which `wanted` is true, waiting at most `patience`.
    ///
    /// # Errors
    /// When none came.
    pub fn segment(
        &self,
        patience: Duration,
        wanted: impl Fn(&Segment) -> bool,
    ) -> anyhow::Result<Segment> {
        let deadline = Instant::now() + patience;
        let mut frame = [0u8; 2048];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                bail!("no such TCP segment in {patience:?}");
            }
            let mut poll = libc::pollfd {
                fd: self.0.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let ms = i32::try_from(left.as_millis()).unwrap_or(i32::MAX).max(1);
            // SAFETY: one valid pollfd.
            if unsafe { libc::poll(&raw mut poll, 1, ms) } <= 0 {
                continue;
            }
            // SAFETY: `frame` is writable for its length.
            let n = unsafe {
                libc::recv(
                    self.0.as_raw_fd(),
                    frame.as_mut_ptr().cast(),
                    frame.len(),
                    0,
                )
            };
            let n = usize::try_from(n).context("recv on the capture")?;
            if let Some(segment) = Segment::parse(&frame[..n])
                && wanted(&segment)
            {
                return Ok(segment);
            }
        }
    }
}

/// A TCP segment as a frame carried it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub sport: u16,
    pub dport: u16,
    pub seq: u32,
    pub ack: u32,
    /// The flags byte (FIN 0x01, SYN 0x02, RST 0x04, PSH 0x08, ACK 0x10).
    pub flags: u8,
    pub window: u16,
    /// The TCP header's length (20 without options).
    pub header_len: usize,
    /// Bytes after the TCP header.
    pub payload_len: usize,
    /// IPv4 header's TTL, or IPv6's hop limit.
    pub ttl: u8,
    /// The IPv4 header's checksum is right (always true for IPv6, which has none).
    pub ip_checksum_ok: bool,
    /// The TCP checksum, summed with the pseudo-header and the whole segment, is right.
    pub checksum_ok: bool,
    /// The TCP checksum field holds exactly the folded pseudo-header sum: what a sender that
    /// leaves the rest to the device (`CHECKSUM_PARTIAL`) puts there.
    pub checksum_partial: bool,
}

/// Adds 16-bit big-endian words of `bytes` (a last odd byte padded with zero) to `sum`.
fn add_words(mut sum: u64, bytes: &[u8]) -> u64 {
    for pair in bytes.chunks(2) {
        let hi = u64::from(pair[0]) << 8;
        sum += hi | pair.get(1).map_or(0, |b| u64::from(*b));
    }
    sum
}

fn fold(mut sum: u64) -> u16 {
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    u16::try_from(sum).unwrap_or(u16::MAX)
}

impl Segment {
    fn parse(frame: &[u8]) -> Option<Self> {
        let ethertype = u16::from_be_bytes([*frame.get(12)?, *frame.get(13)?]);
        let ip = frame.get(14..)?;
        let (src, dst, tcp, ttl, ip_checksum_ok, pseudo) = match ethertype {
            ETH_P_IP => {
                let ihl = usize::from(ip.first()? & 0x0f) * 4;
                let total = usize::from(u16::from_be_bytes([*ip.get(2)?, *ip.get(3)?]));
                if *ip.get(9)? != IPPROTO_TCP || ihl < 20 || total > ip.len() {
                    return None;
                }
                let src = Ipv4Addr::from(<[u8; 4]>::try_from(ip.get(12..16)?).ok()?);
                let dst = Ipv4Addr::from(<[u8; 4]>::try_from(ip.get(16..20)?).ok()?);
                let tcp = ip.get(ihl..total)?;
                let pseudo = add_words(
                    add_words(0, ip.get(12..20)?),
                    &[0, IPPROTO_TCP, (tcp.len() >> 8) as u8, tcp.len() as u8],
                );
                let ok = fold(add_words(0, ip.get(..ihl)?)) == 0xffff;
                (src.into(), dst.into(), tcp, ip[8], ok, pseudo)
            }
            ETH_P_IPV6 => {
                let payload = usize::from(u16::from_be_bytes([*ip.get(4)?, *ip.get(5)?]));
                if *ip.get(6)? != IPPROTO_TCP {
                    return None;
                }
                let src = Ipv6Addr::from(<[u8; 16]>::try_from(ip.get(8..24)?).ok()?);
                let dst = Ipv6Addr::from(<[u8; 16]>::try_from(ip.get(24..40)?).ok()?);
                let tcp = ip.get(40..40 + payload)?;
                let len = u32::try_from(tcp.len()).ok()?.to_be_bytes();
                let pseudo = add_words(
                    add_words(0, ip.get(8..40)?),
                    &[len[0], len[1], len[2], len[3], 0, 0, 0, IPPROTO_TCP],
                );
                (src.into(), dst.into(), tcp, ip[7], true, pseudo)
            }
            _ => return None,
        };
        let header_len = usize::from(tcp.get(12)? >> 4) * 4;
        let word = |at: usize| -> Option<u16> {
            Some(u16::from_be_bytes([*tcp.get(at)?, *tcp.get(at + 1)?]))
        };
        let long = |at: usize| -> Option<u32> {
            Some(u32::from_be_bytes(tcp.get(at..at + 4)?.try_into().ok()?))
        };
        Some(Self {
            src,
            dst,
            sport: word(0)?,
            dport: word(2)?,
            seq: long(4)?,
            ack: long(8)?,
            flags: *tcp.get(13)?,
            window: word(14)?,
            header_len,
            payload_len: tcp.len().checked_sub(header_len)?,
            ttl,
            ip_checksum_ok,
            checksum_ok: fold(add_words(pseudo, tcp)) == 0xffff,
            checksum_partial: word(16)? == fold(pseudo),
        })
    }
}
