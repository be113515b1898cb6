//! The kernel's IP sets (`ip_set`, `xt_set`), spoken to over nfnetlink as the `ipset` tool and
//! Istio's node agent (through `vishvananda/netlink`) do: `hash:ip` sets whose entries carry a
//! comment, created, filled, listed and emptied. Only what ambient mode's probe set needs.
//!
//! Messages are built by hand from the kernel's `uapi/linux/netfilter/ipset/ip_set.h`: an
//! nfnetlink header (`NFNL_SUBSYS_IPSET << 8 | command`, then `struct nfgenmsg`) and
//! attributes; the data of an entry nests under `IPSET_ATTR_DATA`, its address under
//! `IPSET_ATTR_IP`, in network byte order and flagged so. Without `NLM_F_EXCL` the kernel
//! treats every request as `-exist`: creating a set that is there, adding an entry that is
//! there (its comment replaced) and deleting one that is not all succeed.
//!
//! A socket belongs to the network namespace it was opened in: [`IpSets::open`] on the thread
//! that is in the wanted one.
use std::{
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};

const NFNL_SUBSYS_IPSET: u16 = 6;
const CMD_CREATE: u16 = 2;
const CMD_DESTROY: u16 = 3;
const CMD_LIST: u16 = 7;
const CMD_ADD: u16 = 9;
const CMD_DEL: u16 = 10;

/// The protocol version sent: the oldest the kernel takes (`IPSET_PROTOCOL_MIN`), which every
/// kernel meshcap runs on understands.
const PROTOCOL: u8 = 6;
/// `hash:ip` revision 2, the first with comments (Linux 3.14).
const HASH_IP_REVISION: u8 = 2;

const ATTR_PROTOCOL: u16 = 1;
const ATTR_SETNAME: u16 = 2;
const ATTR_TYPENAME: u16 = 3;
const ATTR_REVISION: u16 = 4;
const ATTR_FAMILY: u16 = 5;
const ATTR_DATA: u16 = 7;
const ATTR_ADT: u16 = 8;
const ATTR_IP: u16 = 1;
const ATTR_CADT_FLAGS: u16 = 8;
const ATTR_COMMENT: u16 = 26;
const ATTR_IPADDR_IPV4: u16 = 1;
const ATTR_IPADDR_IPV6: u16 = 2;
const FLAG_WITH_COMMENT: u32 = 1 << 4;

const NLA_F_NESTED: u16 = 1 << 15;
const NLA_F_NET_BYTEORDER: u16 = 1 << 14;
const NLA_TYPE_MASK: u16 = !(NLA_F_NESTED | NLA_F_NET_BYTEORDER);

const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLMSG_HEADER: usize = 16;
const NFGENMSG: usize = 4;

/// `NFPROTO_IPV4`, `NFPROTO_IPV6`.
const FAMILY_V4: u8 = 2;
const FAMILY_V6: u8 = 10;

/// `ENOENT`: no such set.
const ENOENT: i32 = 2;
/// `IPSET_ERR_BUSY`: the set is referenced.
const ERR_BUSY: i32 = 4100;

/// Bytes read per `recv` (a dump sends one datagram per batch, never above a page or two).
const RECV_BUFFER: usize = 64 * 1024;

/// The address family of a set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// IPv4 addresses.
    V4,
    /// IPv6 addresses.
    V6,
}

impl Family {
    /// The family of `ip`.
    #[must_use]
    pub const fn of(ip: &IpAddr) -> Self {
        match ip {
            IpAddr::V4(_) => Self::V4,
            IpAddr::V6(_) => Self::V6,
        }
    }

    const fn nfproto(self) -> u8 {
        match self {
            Self::V4 => FAMILY_V4,
            Self::V6 => FAMILY_V6,
        }
    }
}

/// One entry of a set: its address and its comment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The address.
    pub ip: IpAddr,
    /// The comment (Istio's: the pod's uid), empty when it has none.
    pub comment: String,
}

/// An nfnetlink socket for IP sets (see the module documentation).
pub struct IpSets {
    socket: Socket,
    sequence: u32,
}

impl IpSets {
    /// Opens a socket in the calling thread's network namespace.
    ///
    /// # Errors
    /// When the kernel refuses the socket.
    pub fn open() -> io::Result<Self> {
        let mut socket = Socket::new(NETLINK_NETFILTER)?;
        socket.bind_auto()?;
        socket.connect(&SocketAddr::new(0, 0))?;
        Ok(Self {
            socket,
            sequence: 0,
        })
    }

    /// Creates the `hash:ip` set `name` of `family` with comments, unless it is there.
    ///
    /// # Errors
    /// The kernel's refusal (a set of that name and another kind, no `ip_set` support).
    pub fn create(&mut self, name: &str, family: Family) -> io::Result<()> {
        let mut m = Message::new(CMD_CREATE, family.nfproto());
        m.u8(ATTR_PROTOCOL, PROTOCOL);
        m.string(ATTR_SETNAME, name);
        m.string(ATTR_TYPENAME, "hash:ip");
        m.u8(ATTR_REVISION, HASH_IP_REVISION);
        m.u8(ATTR_FAMILY, family.nfproto());
        let data = m.begin(ATTR_DATA);
        m.net_u32(ATTR_CADT_FLAGS, FLAG_WITH_COMMENT);
        m.end(data);
        self.request(m, false).map(drop)
    }

    /// Destroys the set `name`, if it is there (kernels before 6.x answer `ENOENT` for a set
    /// that is not, whatever the flags: that is success too).
    ///
    /// # Errors
    /// The kernel's refusal: [`is_busy`] while a rule still holds the set.
    pub fn destroy(&mut self, name: &str) -> io::Result<()> {
        let mut m = Message::new(CMD_DESTROY, FAMILY_V4);
        m.u8(ATTR_PROTOCOL, PROTOCOL);
        m.string(ATTR_SETNAME, name);
        match self.request(m, false) {
            Err(err) if is_missing(&err) => Ok(()),
            other => other.map(drop),
        }
    }

    /// Adds `entry` to the set `name`; an entry for its address already there takes its
    /// comment.
    ///
    /// # Errors
    /// The kernel's refusal (no such set, the wrong family, the set full).
    pub fn add(&mut self, name: &str, entry: &Entry) -> io::Result<()> {
        let mut m = Message::new(CMD_ADD, Family::of(&entry.ip).nfproto());
        m.u8(ATTR_PROTOCOL, PROTOCOL);
        m.string(ATTR_SETNAME, name);
        let data = m.begin(ATTR_DATA);
        m.ip(entry.ip);
        m.string(ATTR_COMMENT, &entry.comment);
        m.end(data);
        self.request(m, false).map(drop)
    }

    /// Deletes `ip` from the set `name`, if it is there.
    ///
    /// # Errors
    /// The kernel's refusal (no such set, the wrong family).
    pub fn delete(&mut self, name: &str, ip: IpAddr) -> io::Result<()> {
        let mut m = Message::new(CMD_DEL, Family::of(&ip).nfproto());
        m.u8(ATTR_PROTOCOL, PROTOCOL);
        m.string(ATTR_SETNAME, name);
        let data = m.begin(ATTR_DATA);
        m.ip(ip);
        m.end(data);
        self.request(m, false).map(drop)
    }

    /// The entries of the set `name`.
    ///
    /// # Errors
    /// The kernel's refusal (`ENOENT`: no such set), or an answer that does not parse.
    pub fn list(&mut self, name: &str) -> io::Result<Vec<Entry>> {
        let mut m = Message::new(CMD_LIST, FAMILY_V4);
        m.u8(ATTR_PROTOCOL, PROTOCOL);
        m.string(ATTR_SETNAME, name);
        let mut entries = Vec::new();
        for answer in self.request(m, true)? {
            entries.extend(entries_of(&answer)?);
        }
        Ok(entries)
    }

    /// Sends `message` and collects the answers: every message of a dump, or the kernel's
    /// acknowledgement (always asked for, so that no refusal is missed).
    fn request(&mut self, message: Message, dump: bool) -> io::Result<Vec<Vec<u8>>> {
        self.sequence = self.sequence.wrapping_add(1);
        let flags = NLM_F_REQUEST | if dump { NLM_F_DUMP } else { NLM_F_ACK };
        let bytes = message.finish(flags, self.sequence);
        self.socket.send(&bytes, 0)?;
        let mut answers = Vec::new();
        let mut buffer = Vec::with_capacity(RECV_BUFFER);
        loop {
            buffer.clear();
            self.socket.recv(&mut buffer, 0)?;
            let mut rest = buffer.as_slice();
            while rest.len() >= NLMSG_HEADER {
                let len = u32::from_ne_bytes(rest[0..4].try_into().expect("4 bytes")) as usize;
                let kind = u16::from_ne_bytes([rest[4], rest[5]]);
                let sequence = u32::from_ne_bytes(rest[8..12].try_into().expect("4 bytes"));
                if len < NLMSG_HEADER || len > rest.len() {
                    return Err(io::Error::other("malformed nfnetlink answer"));
                }
                let body = &rest[NLMSG_HEADER..len];
                rest = &rest[align(len).min(rest.len())..];
                if sequence != self.sequence {
                    continue;
                }
                match kind {
                    NLMSG_ERROR => {
                        let code = body
                            .get(0..4)
                            .map(|b| i32::from_ne_bytes(b.try_into().expect("4 bytes")))
                            .ok_or_else(|| io::Error::other("short nfnetlink error"))?;
                        if code != 0 {
                            return Err(refusal(-code));
                        }
                        return Ok(answers);
                    }
                    NLMSG_DONE => return Ok(answers),
                    _ => answers.push(body.get(NFGENMSG..).unwrap_or_default().to_vec()),
                }
            }
        }
    }
}

/// Whether `err` is the kernel's answer for a set that is not there.
#[must_use]
pub fn is_missing(err: &io::Error) -> bool {
    err.raw_os_error() == Some(ENOENT)
}

/// Whether `err` is the kernel's refusal to destroy a set something still holds.
#[must_use]
pub fn is_busy(err: &io::Error) -> bool {
    err.get_ref()
        .and_then(|e| e.downcast_ref::<Refusal>())
        .is_some_and(|r| r.code == ERR_BUSY)
}

/// One of ip_set's own refusals (its codes start at 4096).
#[derive(Debug, thiserror::Error)]
#[error("{what} (ipset error {code})")]
struct Refusal {
    code: i32,
    what: &'static str,
}

/// The kernel's refusal as an error carrying its errno; ip_set's own codes (4096 and up) named.
fn refusal(code: i32) -> io::Error {
    let what = match code {
        4097 => "the kernel refused the request (an attribute the set does not take)",
        4098 => "the kernel has no such set type",
        4099 => "no more sets can be created",
        ERR_BUSY => "the set is in use",
        4102 => "a set of this name and another type exists",
        4103 => "the entry is already in the set",
        4106 => "the address family is not the set's",
        4108 => "the set is referenced by a rule",
        4112 => "the set does not take comments",
        4352 => "the set is full",
        _ => return io::Error::from_raw_os_error(code),
    };
    io::Error::other(Refusal { code, what })
}

const fn align(len: usize) -> usize {
    (len + 3) & !3
}

/// A request being built.
struct Message {
    bytes: Vec<u8>,
}

impl Message {
    fn new(command: u16, family: u8) -> Self {
        let mut bytes = vec![0; NLMSG_HEADER];
        bytes[4..6].copy_from_slice(&((NFNL_SUBSYS_IPSET << 8) | command).to_ne_bytes());
        // struct nfgenmsg: family, version (NFNETLINK_V0), resource id (big-endian 0).
        bytes.extend_from_slice(&[family, 0, 0, 0]);
        Self { bytes }
    }

    fn attr(&mut self, kind: u16, value: &[u8]) {
        let len = u16::try_from(4 + value.len()).expect("attribute fits");
        self.bytes.extend_from_slice(&len.to_ne_bytes());
        self.bytes.extend_from_slice(&kind.to_ne_bytes());
        self.bytes.extend_from_slice(value);
        self.bytes.resize(align(self.bytes.len()), 0);
    }

    fn u8(&mut self, kind: u16, value: u8) {
        self.attr(kind, &[value]);
    }

    fn string(&mut self, kind: u16, value: &str) {
        let mut bytes = value.as_bytes().to_vec();
        bytes.push(0);
        self.attr(kind, &bytes);
    }

    fn net_u32(&mut self, kind: u16, value: u32) {
        self.attr(kind | NLA_F_NET_BYTEORDER, &value.to_be_bytes());
    }

    fn ip(&mut self, ip: IpAddr) {
        let nest = self.begin(ATTR_IP);
        match ip {
            IpAddr::V4(v4) => self.attr(ATTR_IPADDR_IPV4 | NLA_F_NET_BYTEORDER, &v4.octets()),
            IpAddr::V6(v6) => self.attr(ATTR_IPADDR_IPV6 | NLA_F_NET_BYTEORDER, &v6.octets()),
        }
        self.end(nest);
    }

    /// Opens a nested attribute; [`Self::end`] closes it.
    fn begin(&mut self, kind: u16) -> usize {
        let at = self.bytes.len();
        self.attr(kind | NLA_F_NESTED, &[]);
        at
    }

    fn end(&mut self, at: usize) {
        let len = u16::try_from(self.bytes.len() - at).expect("attribute fits");
        self.bytes[at..at + 2].copy_from_slice(&len.to_ne_bytes());
    }

    fn finish(mut self, flags: u16, sequence: u32) -> Vec<u8> {
        let len = u32::try_from(self.bytes.len()).expect("message fits");
        self.bytes[0..4].copy_from_slice(&len.to_ne_bytes());
        self.bytes[6..8].copy_from_slice(&flags.to_ne_bytes());
        self.bytes[8..12].copy_from_slice(&sequence.to_ne_bytes());
        self.bytes
    }
}

/// The attributes of `bytes`, as (type without flags, value).
fn attrs(mut bytes: &[u8]) -> io::Result<Vec<(u16, &[u8])>> {
    let mut out = Vec::new();
    while bytes.len() >= 4 {
        let len = usize::from(u16::from_ne_bytes([bytes[0], bytes[1]]));
        let kind = u16::from_ne_bytes([bytes[2], bytes[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > bytes.len() {
            return Err(io::Error::other("malformed ipset attribute"));
        }
        out.push((kind, &bytes[4..len]));
        bytes = &bytes[align(len).min(bytes.len())..];
    }
    Ok(out)
}

/// The entries of one answer to a list request (`IPSET_ATTR_ADT`, one `IPSET_ATTR_DATA` each).
fn entries_of(answer: &[u8]) -> io::Result<Vec<Entry>> {
    let mut entries = Vec::new();
    for (_, adt) in attrs(answer)?.into_iter().filter(|(k, _)| *k == ATTR_ADT) {
        for (_, data) in attrs(adt)?.into_iter().filter(|(k, _)| *k == ATTR_DATA) {
            let mut ip = None;
            let mut comment = String::new();
            for (kind, value) in attrs(data)? {
                match kind {
                    ATTR_IP => ip = address(value)?,
                    ATTR_COMMENT => {
                        comment = String::from_utf8_lossy(value)
                            .trim_end_matches('\0')
                            .to_owned();
                    }
                    _ => {}
                }
            }
            if let Some(ip) = ip {
                entries.push(Entry { ip, comment });
            }
        }
    }
    Ok(entries)
}

fn address(nested: &[u8]) -> io::Result<Option<IpAddr>> {
    for (kind, value) in attrs(nested)? {
        match (kind, value.len()) {
            (ATTR_IPADDR_IPV4, 4) => {
                let octets: [u8; 4] = value.try_into().expect("4 bytes");
                return Ok(Some(Ipv4Addr::from(octets).into()));
            }
            (ATTR_IPADDR_IPV6, 16) => {
                let octets: [u8; 16] = value.try_into().expect("16 bytes");
                return Ok(Some(Ipv6Addr::from(octets).into()));
            }
            _ => {}
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An add of 10.1.2.3 with comment "u" to set "s", byte for byte as `ip_set.h` lays it out.
    #[test]
    fn an_add_is_laid_out_as_the_kernel_reads_it() {
        let mut m = Message::new(CMD_ADD, FAMILY_V4);
        m.u8(ATTR_PROTOCOL, PROTOCOL);
        m.string(ATTR_SETNAME, "s");
        let data = m.begin(ATTR_DATA);
        m.ip("10.1.2.3".parse().unwrap());
        m.string(ATTR_COMMENT, "u");
        m.end(data);
        let bytes = m.finish(NLM_F_REQUEST | NLM_F_ACK, 7);
        let mut want = Vec::new();
        want.extend_from_slice(&60u32.to_ne_bytes());
        want.extend_from_slice(&0x0609u16.to_ne_bytes());
        want.extend_from_slice(&5u16.to_ne_bytes());
        want.extend_from_slice(&7u32.to_ne_bytes());
        want.extend_from_slice(&0u32.to_ne_bytes());
        want.extend_from_slice(&[2, 0, 0, 0]);
        // protocol 6, padded
        want.extend_from_slice(&5u16.to_ne_bytes());
        want.extend_from_slice(&1u16.to_ne_bytes());
        want.extend_from_slice(&[6, 0, 0, 0]);
        // set name "s\0", padded
        want.extend_from_slice(&6u16.to_ne_bytes());
        want.extend_from_slice(&2u16.to_ne_bytes());
        want.extend_from_slice(&[b's', 0, 0, 0]);
        // data (nested): ip (nested): ipv4 (network order), comment "u\0"
        want.extend_from_slice(&24u16.to_ne_bytes());
        want.extend_from_slice(&(7u16 | NLA_F_NESTED).to_ne_bytes());
        want.extend_from_slice(&12u16.to_ne_bytes());
        want.extend_from_slice(&(1u16 | NLA_F_NESTED).to_ne_bytes());
        want.extend_from_slice(&8u16.to_ne_bytes());
        want.extend_from_slice(&(1u16 | NLA_F_NET_BYTEORDER).to_ne_bytes());
        want.extend_from_slice(&[10, 1, 2, 3]);
        want.extend_from_slice(&6u16.to_ne_bytes());
        want.extend_from_slice(&26u16.to_ne_bytes());
        want.extend_from_slice(&[b'u', 0, 0, 0]);
        assert_eq!(bytes, want);
    }

    #[test]
    fn a_listed_entry_is_read_back() {
        let mut m = Message::new(CMD_LIST, FAMILY_V6);
        let adt = m.begin(ATTR_ADT);
        let data = m.begin(ATTR_DATA);
        m.ip("fd00::7".parse().unwrap());
        m.string(ATTR_COMMENT, "uid-1");
        m.end(data);
        m.end(adt);
        let bytes = m.finish(0, 1);
        let entries = entries_of(&bytes[NLMSG_HEADER + NFGENMSG..]).unwrap();
        assert_eq!(
            entries,
            [Entry {
                ip: "fd00::7".parse().unwrap(),
                comment: "uid-1".into()
            }]
        );
    }
}
