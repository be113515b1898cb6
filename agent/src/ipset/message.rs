//! ip_set's nfnetlink messages, built and read by hand from the kernel's
//! `uapi/linux/netfilter/ipset/ip_set.h`: an nfnetlink header (`NFNL_SUBSYS_IPSET << 8 |
//! command`, then `struct nfgenmsg`) and attributes; the data of an entry nests under
//! `IPSET_ATTR_DATA`, its address under `IPSET_ATTR_IP`, in network byte order and flagged so.
use std::{
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use super::Entry;

pub(super) const NFNL_SUBSYS_IPSET: u16 = 6;
pub(super) const CMD_CREATE: u16 = 2;
pub(super) const CMD_DESTROY: u16 = 3;
pub(super) const CMD_LIST: u16 = 7;
pub(super) const CMD_ADD: u16 = 9;
pub(super) const CMD_DEL: u16 = 10;

/// The protocol version sent: the oldest the kernel takes (`IPSET_PROTOCOL_MIN`), which every
/// kernel meshcap runs on understands.
pub(super) const PROTOCOL: u8 = 6;
/// `hash:ip` revision 2, the first with comments (Linux 3.14).
pub(super) const HASH_IP_REVISION: u8 = 2;

pub(super) const ATTR_PROTOCOL: u16 = 1;
pub(super) const ATTR_SETNAME: u16 = 2;
pub(super) const ATTR_TYPENAME: u16 = 3;
pub(super) const ATTR_REVISION: u16 = 4;
pub(super) const ATTR_FAMILY: u16 = 5;
pub(super) const ATTR_DATA: u16 = 7;
pub(super) const ATTR_ADT: u16 = 8;
pub(super) const ATTR_IP: u16 = 1;
pub(super) const ATTR_CADT_FLAGS: u16 = 8;
pub(super) const ATTR_COMMENT: u16 = 26;
pub(super) const ATTR_IPADDR_IPV4: u16 = 1;
pub(super) const ATTR_IPADDR_IPV6: u16 = 2;
pub(super) const FLAG_WITH_COMMENT: u32 = 1 << 4;

pub(super) const NLA_F_NESTED: u16 = 1 << 15;
pub(super) const NLA_F_NET_BYTEORDER: u16 = 1 << 14;
pub(super) const NLA_TYPE_MASK: u16 = !(NLA_F_NESTED | NLA_F_NET_BYTEORDER);

pub(super) const NLM_F_REQUEST: u16 = 0x1;
pub(super) const NLM_F_ACK: u16 = 0x4;
pub(super) const NLM_F_DUMP: u16 = 0x300;
pub(super) const NLMSG_ERROR: u16 = 2;
pub(super) const NLMSG_DONE: u16 = 3;
pub(super) const NLMSG_HEADER: usize = 16;
pub(super) const NFGENMSG: usize = 4;

/// `NFPROTO_IPV4`, `NFPROTO_IPV6`.
pub(super) const FAMILY_V4: u8 = 2;
pub(super) const FAMILY_V6: u8 = 10;

/// `ENOENT`: no such set.
pub(super) const ENOENT: i32 = 2;

pub(super) const fn align(len: usize) -> usize {
    (len + 3) & !3
}

/// A request being built.
pub(super) struct Message {
    bytes: Vec<u8>,
}

impl Message {
    pub(super) fn new(command: u16, family: u8) -> Self {
        let mut bytes = vec![0; NLMSG_HEADER];
        bytes[4..6].copy_from_slice(&((NFNL_SUBSYS_IPSET << 8) | command).to_ne_bytes());
        // struct nfgenmsg: family, version (NFNETLINK_V0), resource id (big-endian 0).
        bytes.extend_from_slice(&[family, 0, 0, 0]);
        Self { bytes }
    }

    pub(super) fn attr(&mut self, kind: u16, value: &[u8]) {
        let len = u16::try_from(4 + value.len()).expect("attribute fits");
        self.bytes.extend_from_slice(&len.to_ne_bytes());
        self.bytes.extend_from_slice(&kind.to_ne_bytes());
        self.bytes.extend_from_slice(value);
        self.bytes.resize(align(self.bytes.len()), 0);
    }

    pub(super) fn u8(&mut self, kind: u16, value: u8) {
        self.attr(kind, &[value]);
    }

    pub(super) fn string(&mut self, kind: u16, value: &str) {
        let mut bytes = value.as_bytes().to_vec();
        bytes.push(0);
        self.attr(kind, &bytes);
    }

    pub(super) fn net_u32(&mut self, kind: u16, value: u32) {
        self.attr(kind | NLA_F_NET_BYTEORDER, &value.to_be_bytes());
    }

    pub(super) fn ip(&mut self, ip: IpAddr) {
        let nest = self.begin(ATTR_IP);
        match ip {
            IpAddr::V4(v4) => self.attr(ATTR_IPADDR_IPV4 | NLA_F_NET_BYTEORDER, &v4.octets()),
            IpAddr::V6(v6) => self.attr(ATTR_IPADDR_IPV6 | NLA_F_NET_BYTEORDER, &v6.octets()),
        }
        self.end(nest);
    }

    /// Opens a nested attribute; [`Self::end`] closes it.
    pub(super) fn begin(&mut self, kind: u16) -> usize {
        let at = self.bytes.len();
        self.attr(kind | NLA_F_NESTED, &[]);
        at
    }

    pub(super) fn end(&mut self, at: usize) {
        let len = u16::try_from(self.bytes.len() - at).expect("attribute fits");
        self.bytes[at..at + 2].copy_from_slice(&len.to_ne_bytes());
    }

    pub(super) fn finish(mut self, flags: u16, sequence: u32) -> Vec<u8> {
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
pub(super) fn entries_of(answer: &[u8]) -> io::Result<Vec<Entry>> {
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
