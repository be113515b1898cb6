//! `istio-nftables`' configuration for a sidecar pod: the pod's [`RedirectPolicy`] and what the
//! standalone tool can be told besides (`PROXY_UID`/`PROXY_GID` lists, DNS to listed resolvers,
//! owner groups, the host's loopback range), which the CNI plugin always leaves at its default.
use std::net::{IpAddr, Ipv4Addr};

use crate::model::{IpPrefix, RedirectPolicy};

/// Which DNS traffic goes to the agent's DNS proxy (`REDIRECT_DNS`, `CAPTURE_ALL_DNS` and the
/// resolvers of `istio-nftables`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DnsRedirect {
    /// None.
    Off,
    /// All port-53 traffic: what the CNI plugin asks for with `ISTIO_META_DNS_CAPTURE`.
    All,
    /// Port-53 traffic to these resolvers only (`istio-nftables` run in the pod, reading its
    /// `resolv.conf`, whose addresses it writes as they are spelt there); with none, DNS is
    /// not redirected at all.
    Servers {
        /// IPv4 resolvers.
        v4: Vec<String>,
        /// IPv6 resolvers (used when the pod has IPv6).
        v6: Vec<String>,
    },
}

/// Whose outbound traffic is captured by the socket's group (`OUTPUT_OWNER_GROUPS` and its
/// `_EXCLUDE`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OwnerGroups {
    /// Every group but these (`*`, the default, with the exclude list).
    AllExcept(Vec<String>),
    /// These groups only.
    Only(Vec<String>),
}

/// `istio-nftables`' configuration: the pod's [`RedirectPolicy`] plus what the standalone
/// tool can be told and the CNI plugin always leaves at its default. [`Self::from`] a policy
/// is the CNI plugin's configuration; Istio's own test cases set the rest.
#[derive(Clone, Debug)]
pub struct SidecarCapture<'a> {
    /// The pod's policy (its `proxy_uid`, `proxy_gid` and `dns_capture` are replaced by the
    /// fields below).
    pub policy: &'a RedirectPolicy,
    /// `PROXY_UID`: the uids whose traffic is the proxy's.
    pub proxy_uids: Vec<u32>,
    /// `PROXY_GID`.
    pub proxy_gids: Vec<u32>,
    /// DNS redirection.
    pub dns: DnsRedirect,
    /// Group-based outbound capture.
    pub owner_groups: OwnerGroups,
    /// `HOST_IPV4_LOOPBACK_CIDR` (default `127.0.0.1/32`).
    pub host_loopback_v4: IpPrefix,
}

impl<'a> From<&'a RedirectPolicy> for SidecarCapture<'a> {
    fn from(policy: &'a RedirectPolicy) -> Self {
        Self {
            policy,
            proxy_uids: vec![policy.proxy_uid],
            proxy_gids: vec![policy.proxy_gid],
            dns: if policy.dns_capture {
                DnsRedirect::All
            } else {
                DnsRedirect::Off
            },
            owner_groups: OwnerGroups::AllExcept(Vec::new()),
            host_loopback_v4: IpPrefix::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 32)
                .expect("/32 fits IPv4"),
        }
    }
}
