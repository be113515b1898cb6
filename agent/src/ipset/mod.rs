//! The kernel's IP sets (`ip_set`, `xt_set`), spoken to over nfnetlink as the `ipset` tool and
//! Istio's node agent (through `vishvananda/netlink`) do: `hash:ip` sets whose entries carry a
//! comment, created, filled, listed and emptied. Only what ambient mode's probe set needs.
//!
//! Messages are built by hand (`message`). Without `NLM_F_EXCL` the kernel
//! treats every request as `-exist`: creating a set that is there, adding an entry that is
//! there (its comment replaced) and deleting one that is not all succeed.
//!
//! A socket belongs to the network namespace it was opened in: [`IpSets::open`] on the thread
//! that is in the wanted one.
mod message;

use std::{io, net::IpAddr};

use message::{
    ATTR_CADT_FLAGS, ATTR_COMMENT, ATTR_DATA, ATTR_FAMILY, ATTR_PROTOCOL, ATTR_REVISION,
    ATTR_SETNAME, ATTR_TYPENAME, CMD_ADD, CMD_CREATE, CMD_DEL, CMD_DESTROY, CMD_LIST, ENOENT,
    FAMILY_V4, FAMILY_V6, FLAG_WITH_COMMENT, HASH_IP_REVISION, Message, NFGENMSG, NLM_F_ACK,
    NLM_F_DUMP, NLM_F_REQUEST, NLMSG_DONE, NLMSG_ERROR, NLMSG_HEADER, PROTOCOL, align, entries_of,
};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};

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
