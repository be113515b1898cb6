//! A pod's capture configuration as map entries: the flags word, port lists and CIDR lists of
//! `meshcap-common`, plus what only the pod's netns knows (its addresses and routes).
use std::net::IpAddr;

use meshcap_common::{CidrKind, PodConfig, PortKind, flags, iface_flags};

use super::podnet::PodNet;

/// Everything the maps hold for one pod, before a pod id is assigned.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Entries {
    /// [`PodConfig`] without its `pod_id`.
    pub config: PodConfig,
    /// Port lists.
    pub ports: Vec<(PortKind, u16)>,
    /// CIDR lists: kind, network, prefix length, value.
    pub cidrs: Vec<(CidrKind, IpAddr, u8, u32)>,
    /// Interface flags by interface name.
    pub ifaces: Vec<(String, u32)>,
}

impl Entries {
    /// Adds what the pod's netns says: its own addresses (traffic to them leaves by `lo`) and,
    /// with `excludeInterfaces`, its routes marked by whether they leave by an excluded
    /// interface. Also the interface flags.
    pub fn add_pod_net(&mut self, net: &PodNet, exclude: &[String], reroute: &[String]) {
        for addr in &net.addresses {
            let len = if addr.is_ipv4() { 32 } else { 128 };
            self.cidrs.push((CidrKind::Local, *addr, len, 1));
        }
        if self.config.has(flags::IPV6) {
            self.cidrs.push((
                CidrKind::Local,
                IpAddr::V6(std::net::Ipv6Addr::from(6u128)),
                128,
                1,
            ));
        }
        if !exclude.is_empty() {
            self.config.flags |= flags::EXCLUDED_ROUTES;
            for route in &net.routes {
                let excluded = u32::from(exclude.contains(&route.dev));
                self.cidrs
                    .push((CidrKind::Route, route.dst, route.len, excluded));
            }
        }
        for (_, name) in &net.interfaces {
            let mut f = 0;
            if exclude.contains(name) {
                f |= iface_flags::EXCLUDED;
            }
            if reroute.contains(name) {
                f |= iface_flags::REROUTE;
            }
            if f != 0 {
                self.ifaces.push((name.clone(), f));
            }
        }
    }
}
