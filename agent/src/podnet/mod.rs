//! Everything meshcap does inside a pod's network namespace, for both backends.
//!
//! [`run_in`] takes the calling thread into the namespace and back (`setns` moves only the
//! calling thread; callers run synchronous work, so nothing else runs on it meanwhile), so
//! every log line of the visit stays in the caller's span and names the pod. The closure gets
//! a [`Visit`], whose one netlink socket ([`Netlink`], synchronous, opened on first use)
//! serves every request of the visit: [`inspect`] (the netns cookie, interfaces,
//! addresses and routes), [`route`] (the policy routes), [`clsact`] (the inbound TC filter
//! on the clsact qdisc) and [`conntrack`] (loose pickup, off under handed-back rules). [`find`] finds a running pod's namespace by its address, for the
//! controllers that capture pods in place; [`userns`] the user namespace that owns a pod's
//! network namespace (`hostUsers: false`) and the ids it maps.
//!
//! Below the backends, above nothing of meshcap's but the policy model: it knows namespaces,
//! netlink and sockets, not BPF maps, pins or iptables.
pub mod clsact;
pub mod conntrack;
pub mod find;
mod nfnl;
pub mod nftgen;
pub mod route;
pub mod sysctl;
pub mod userns;
mod visit;

use std::{io, path::PathBuf};

pub use visit::{
    Interface, Netlink, PodNet, Visit, cookie_of, current_cookie, errno, global_addresses, inspect,
    live_cookies, live_netns, run_in,
};

/// Errors entering a pod's network namespace or working inside it.
#[derive(Debug, thiserror::Error)]
pub enum PodNetError {
    /// The namespace file could not be opened (gone, or not a netns).
    #[error("opening network namespace {path}: {source}")]
    Open {
        /// The namespace file.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// setns refused.
    #[error("entering network namespace {path}: {source}{why}")]
    Enter {
        /// The namespace file.
        path: PathBuf,
        /// Why.
        #[source]
        source: nix::Error,
        /// For an `EPERM`, the capability lacking or the likely cause, as ` (…)`
        /// ([`crate::privilege`]).
        why: String,
    },
    /// The closure run inside panicked.
    #[error("the work inside network namespace {0} panicked")]
    Panicked(PathBuf),
    /// A syscall inside the namespace failed (a socket, the cookie, the interface list, a
    /// sysctl).
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The kernel refused a netlink request (or the socket failed).
    #[error("netlink: {what}: {source}")]
    Netlink {
        /// The request, as `ip` or `tc` would spell it.
        what: String,
        /// The kernel's answer (its errno in [`io::Error::raw_os_error`]).
        #[source]
        source: io::Error,
    },
}

impl PodNetError {
    /// Whether the namespace itself is gone (or never was one): nothing inside it is left to
    /// undo.
    #[must_use]
    pub fn is_gone(&self) -> bool {
        matches!(self, Self::Open { .. })
    }
}
