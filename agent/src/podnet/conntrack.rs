//! The one conntrack setting meshcap changes in a pod's network namespace: TCP loose pickup,
//! turned off when Istio's rules take over connections the kernel programs carried.
//!
//! The kernel programs capture without conntrack, so a pod captured in the kernel has none of
//! its connections tracked. Once Istio's `nat` rules are written, conntrack runs in the netns,
//! and with loose pickup (`net.netfilter.nf_conntrack_tcp_loose`, 1 by default) the next
//! packet of such a connection is taken as a new connection and put through those rules: a
//! peer's packet to the proxy's inbound connection is redirected to 15006, where no socket
//! owns it (reset); the proxy's first bytes back to the app are redirected to 15006 too
//! (`ISTIO_OUTPUT`: the proxy's uid, `-o lo`, to the pod's address), and the app waits. With
//! loose pickup off, conntrack tracks only connections whose SYN it saw: the earlier ones pass
//! untouched to the sockets that own them, and every new one is tracked and redirected as
//! under Istio.
//!
//! The sysctl exists once the kernel has conntrack, in every netns at once. Where
//! `nf_conntrack` is a module no rule has loaded yet (a node without kube-proxy's iptables or
//! IPVS modes), the first Istio rule would load it with loose pickup on. So a missing sysctl is
//! first answered by asking conntrack's netlink subsystem for its statistics: nfnetlink has the
//! kernel load `nf_conntrack_netlink`, and `nf_conntrack` with it, before it answers
//! (`request_module("nfnetlink-subsys-1")`, run by the host's modprobe). Loading conntrack
//! tracks nothing: a netns starts tracking only when a rule asks for it.
use std::io;

use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};

use super::{
    PodNetError,
    nfnl::{NLM_F_ACK, NLM_F_REQUEST, NLMSG_ERROR, NLMSG_HEADER},
};

/// The sysctl, of the calling thread's netns ([`super::sysctl`]).
const TCP_LOOSE: &str = "net/netfilter/nf_conntrack_tcp_loose";

/// `NFNL_SUBSYS_CTNETLINK`, `IPCTNL_MSG_CT_GET_STATS`.
const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPCTNL_MSG_CT_GET_STATS: u16 = 5;

/// Turns TCP loose pickup off in the visited netns, loading conntrack first where the kernel
/// has it as a module not yet loaded. `false` when the kernel still has no conntrack (built
/// without it, or without its netlink subsystem to load it by): the caller sets it again once
/// the rules have loaded conntrack.
///
/// # Errors
/// When the sysctl exists but cannot be written.
pub fn no_loose_pickup() -> Result<bool, PodNetError> {
    if write_off()? {
        return Ok(true);
    }
    if let Err(err) = load() {
        tracing::debug!(error = %err, "conntrack's netlink subsystem did not answer");
    }
    write_off()
}

fn write_off() -> Result<bool, PodNetError> {
    match super::sysctl::write(TCP_LOOSE, "0") {
        Ok(()) => Ok(true),
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(PodNetError::Io {
            what: "setting net.netfilter.nf_conntrack_tcp_loose to 0".to_owned(),
            source,
        }),
    }
}

/// Asks ctnetlink for conntrack's statistics in the visited netns and waits for the kernel's
/// acknowledgement: by then nfnetlink has had the subsystem's module loaded, when there is one.
fn load() -> io::Result<()> {
    let mut socket = Socket::new(NETLINK_NETFILTER)?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    let request = super::nfnl::request(
        NFNL_SUBSYS_CTNETLINK,
        IPCTNL_MSG_CT_GET_STATS,
        NLM_F_REQUEST | NLM_F_ACK,
    );
    socket.send(&request, 0)?;
    loop {
        let mut buffer = Vec::with_capacity(4096);
        socket.recv(&mut buffer, 0)?;
        if let Some(code) = acknowledgement(&buffer) {
            return if code == 0 {
                Ok(())
            } else {
                Err(io::Error::from_raw_os_error(-code))
            };
        }
    }
}

/// The errno of the `NLMSG_ERROR` message among `answer`'s, if one is there (0: acknowledged).
fn acknowledgement(mut answer: &[u8]) -> Option<i32> {
    while answer.len() >= NLMSG_HEADER {
        let len = u32::from_ne_bytes(answer[0..4].try_into().ok()?) as usize;
        let kind = u16::from_ne_bytes([answer[4], answer[5]]);
        if len < NLMSG_HEADER {
            return None;
        }
        if kind == NLMSG_ERROR {
            let code = answer.get(NLMSG_HEADER..NLMSG_HEADER + 4)?;
            return Some(i32::from_ne_bytes(code.try_into().ok()?));
        }
        answer = answer.get(len.next_multiple_of(4)..)?;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(kind: u16, payload: &[u8]) -> Vec<u8> {
        let len = u32::try_from(NLMSG_HEADER + payload.len()).unwrap_or_default();
        let mut out = len.to_ne_bytes().to_vec();
        out.extend_from_slice(&kind.to_ne_bytes());
        out.extend_from_slice(&[0; 10]);
        out.extend_from_slice(payload);
        out
    }

    #[test]
    fn the_acknowledgement_is_found_after_the_answer() {
        let mut answer = message((NFNL_SUBSYS_CTNETLINK << 8) | 4, &[0; 8]);
        answer.extend(message(NLMSG_ERROR, &0i32.to_ne_bytes()));
        assert_eq!(acknowledgement(&answer), Some(0));
        let refused = message(NLMSG_ERROR, &(-95i32).to_ne_bytes());
        assert_eq!(acknowledgement(&refused), Some(-95));
        assert_eq!(acknowledgement(&answer[..12]), None);
    }

    /// The kernel takes the request (root: nfnetlink asks for `CAP_NET_ADMIN`). That it loads
    /// `nf_conntrack` on a kernel where it is a module not yet loaded is nfnetlink's
    /// (`nfnetlink_rcv_msg`); no kernel the suite boots has conntrack unloaded.
    #[test]
    fn the_kernel_acknowledges_the_statistics_request() {
        load().expect("IPCTNL_MSG_CT_GET_STATS (run as root)");
    }
}
