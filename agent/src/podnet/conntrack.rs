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
use std::io;

use super::PodNetError;

/// The sysctl in the calling thread's netns (`/proc/sys/net` is the opening thread's).
const TCP_LOOSE: &str = "/proc/sys/net/netfilter/nf_conntrack_tcp_loose";

/// Turns TCP loose pickup off in the visited netns. `false` when the netns has no conntrack
/// yet (the sysctl comes with the `nf_conntrack` module): the caller sets it again once the
/// rules have loaded conntrack.
///
/// # Errors
/// When the sysctl exists but cannot be written.
pub fn no_loose_pickup() -> Result<bool, PodNetError> {
    match std::fs::write(TCP_LOOSE, "0") {
        Ok(()) => Ok(true),
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(PodNetError::Io {
            what: "setting net.netfilter.nf_conntrack_tcp_loose to 0".to_owned(),
            source,
        }),
    }
}
