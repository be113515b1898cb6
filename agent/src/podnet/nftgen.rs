//! The nf_tables generation of the visited network namespace (`NFT_MSG_GETGEN`): a number the
//! kernel bumps with every committed nf_tables transaction in that namespace, whatever wrote it
//! (`iptables-nft`, `nft`, a restore). While it stays the same, no nft rule of the namespace
//! changed: the verifier then need not read the rules back (a fork of `iptables-nft-save`).
use std::io;

use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};

use super::nfnl::{NFGENMSG, NLM_F_REQUEST, NLMSG_ERROR, NLMSG_HEADER};

/// `NFNL_SUBSYS_NFTABLES`, `NFT_MSG_GETGEN`, `NFT_MSG_NEWGEN`.
const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFT_MSG_GETGEN: u16 = 16;
const NFT_MSG_NEWGEN: u16 = 15;
/// `NFTA_GEN_ID`.
const NFTA_GEN_ID: u16 = 1;
const NLA_HEADER: usize = 4;

/// The visited namespace's nf_tables generation.
///
/// # Errors
/// When the kernel has no nf_tables or refuses.
pub fn generation() -> io::Result<u32> {
    let mut socket = Socket::new(NETLINK_NETFILTER)?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    socket.send(&request(), 0)?;
    let mut buffer = Vec::with_capacity(4096);
    socket.recv(&mut buffer, 0)?;
    parse(&buffer)
}

/// `NFT_MSG_GETGEN` for every family.
fn request() -> Vec<u8> {
    super::nfnl::request(NFNL_SUBSYS_NFTABLES, NFT_MSG_GETGEN, NLM_F_REQUEST)
}

/// The generation in the kernel's answer: a `NFT_MSG_NEWGEN` whose `NFTA_GEN_ID` attribute is
/// a big-endian u32.
fn parse(answer: &[u8]) -> io::Result<u32> {
    let malformed = || io::Error::other("malformed NFT_MSG_NEWGEN answer");
    let header = answer.get(..NLMSG_HEADER).ok_or_else(malformed)?;
    let len = u32::from_ne_bytes(header[0..4].try_into().map_err(|_| malformed())?) as usize;
    let kind = u16::from_ne_bytes([header[4], header[5]]);
    let body = answer.get(NLMSG_HEADER..len).ok_or_else(malformed)?;
    if kind == NLMSG_ERROR {
        let code = body
            .get(0..4)
            .map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
            .ok_or_else(malformed)?;
        return Err(io::Error::from_raw_os_error(-code));
    }
    if kind != (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWGEN {
        return Err(malformed());
    }
    let mut attributes = body.get(NFGENMSG..).ok_or_else(malformed)?;
    while attributes.len() >= NLA_HEADER {
        let len = usize::from(u16::from_ne_bytes([attributes[0], attributes[1]]));
        let kind = u16::from_ne_bytes([attributes[2], attributes[3]]) & 0x3fff;
        let value = attributes.get(NLA_HEADER..len).ok_or_else(malformed)?;
        if kind == NFTA_GEN_ID {
            let bytes: [u8; 4] = value
                .get(..4)
                .and_then(|v| v.try_into().ok())
                .ok_or_else(malformed)?;
            return Ok(u32::from_be_bytes(bytes));
        }
        attributes = attributes
            .get(len.next_multiple_of(4)..)
            .unwrap_or_default();
    }
    Err(malformed())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `NFT_MSG_NEWGEN` as the kernel sends it: the generation, then another attribute.
    fn answer(generation: u32) -> Vec<u8> {
        let mut attributes = Vec::new();
        attributes.extend_from_slice(&8u16.to_ne_bytes());
        attributes.extend_from_slice(&NFTA_GEN_ID.to_ne_bytes());
        attributes.extend_from_slice(&generation.to_be_bytes());
        attributes.extend_from_slice(&8u16.to_ne_bytes());
        attributes.extend_from_slice(&2u16.to_ne_bytes());
        attributes.extend_from_slice(&42u32.to_be_bytes());
        let len = NLMSG_HEADER + NFGENMSG + attributes.len();
        let mut out = Vec::new();
        out.extend_from_slice(&u32::try_from(len).unwrap_or_default().to_ne_bytes());
        out.extend_from_slice(&((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWGEN).to_ne_bytes());
        out.extend_from_slice(&[0; 10]);
        out.extend_from_slice(&[0; NFGENMSG]);
        out.extend_from_slice(&attributes);
        out
    }

    #[test]
    fn the_generation_is_read_off_the_answer() {
        assert_eq!(parse(&answer(7)).ok(), Some(7));
        assert!(parse(&answer(7)[..20]).is_err());
        assert_eq!(request().len(), NLMSG_HEADER + NFGENMSG);
    }

    /// The kernel answers (root: nfnetlink asks for `CAP_NET_ADMIN`). That a rule change bumps
    /// it is `tests/tests/verify.rs`'s (the rules flushed in a pod are found and put back).
    #[test]
    fn the_kernel_answers_a_generation() {
        generation().expect("NFT_MSG_GETGEN (run as root)");
    }
}
