//! nfnetlink requests as the kernel reads them: a netlink header, then `struct nfgenmsg`
//! (family `AF_UNSPEC`, version 0, resource id 0). Shared by the nf_tables generation
//! ([`super::nftgen`]) and the conntrack loader ([`super::conntrack`]).

/// `NLM_F_REQUEST`, `NLM_F_ACK`.
pub const NLM_F_REQUEST: u16 = 0x1;
pub const NLM_F_ACK: u16 = 0x4;
/// `NLMSG_ERROR`: the kernel's answer carries an errno (0 for an acknowledgement).
pub const NLMSG_ERROR: u16 = 2;
pub const NLMSG_HEADER: usize = 16;
pub const NFGENMSG: usize = 4;

/// The request for `message` of the nfnetlink subsystem `subsys`, with no attributes.
pub fn request(subsys: u16, message: u16, flags: u16) -> Vec<u8> {
    let len = u32::try_from(NLMSG_HEADER + NFGENMSG).unwrap_or(u32::MAX);
    let mut out = Vec::with_capacity(NLMSG_HEADER + NFGENMSG);
    out.extend_from_slice(&len.to_ne_bytes());
    out.extend_from_slice(&((subsys << 8) | message).to_ne_bytes());
    out.extend_from_slice(&flags.to_ne_bytes());
    out.extend_from_slice(&1u32.to_ne_bytes());
    out.extend_from_slice(&0u32.to_ne_bytes());
    out.extend_from_slice(&[0, 0, 0, 0]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_a_header_and_an_nfgenmsg() {
        let out = request(10, 16, NLM_F_REQUEST);
        assert_eq!(out.len(), NLMSG_HEADER + NFGENMSG);
        assert_eq!(u16::from_ne_bytes([out[4], out[5]]), (10 << 8) | 16);
        assert_eq!(u16::from_ne_bytes([out[6], out[7]]), NLM_F_REQUEST);
    }
}
