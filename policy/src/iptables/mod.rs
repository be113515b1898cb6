//! Istio's iptables rules for a policy, as `iptables-restore` input: the same rules, in the
//! same order within each table, as `istio-iptables` (`tools/istio-iptables/pkg/capture`)
//! writes for the CNI plugin, plus the TPROXY policy route it installs over netlink.

use serde::{Deserialize, Serialize};

mod builder;
pub mod hostprobe;
mod inpod;

use builder::{BOTH, Builder, Families, IP, V4, V6, restore_text};

use super::{
    model::{
        DNS_CAPTURE_PORT, DNS_PORT, Family, INBOUND_CAPTURE_PORT, INBOUND_TUNNEL_PORT,
        InterceptionMode, IpRanges, OUTBOUND_CAPTURE_PORT, OUTBOUND_MARK, PortSelection,
        RedirectPolicy, TPROXY_MARK,
    },
    routes::{MarkRoute, PolicyRoutes},
};

/// A policy rendered for the iptables backend.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IptablesRules {
    /// `iptables-restore --noflush` input.
    pub v4: String,
    /// `ip6tables-restore --noflush` input, when the pod has IPv6.
    pub v6: Option<String>,
    /// What the rules need besides themselves, set up over netlink.
    pub routes: PolicyRoutes,
}

impl IptablesRules {
    /// The restore input of one family (`None` for IPv6 when the pod has no IPv6).
    #[must_use]
    pub fn family(&self, family: Family) -> Option<&str> {
        match family {
            Family::V4 => Some(&self.v4),
            Family::V6 => self.v6.as_deref(),
        }
    }
}

impl RedirectPolicy {
    /// Istio's rules for this policy.
    #[must_use]
    pub fn render(&self) -> IptablesRules {
        let mut builder = Builder::new(self.ipv6);
        self.build(&mut builder);
        IptablesRules {
            v4: restore_text(&builder.v4),
            v6: self.ipv6.then(|| restore_text(&builder.v6)),
            routes: self.routes(),
        }
    }

    /// What Istio's rules for this policy need besides themselves, whichever writes them
    /// (iptables or nftables).
    #[must_use]
    pub fn routes(&self) -> PolicyRoutes {
        let mut routes = if self.ipv6 {
            PolicyRoutes::passthrough6()
        } else {
            PolicyRoutes::default()
        };
        if self.mode == InterceptionMode::Tproxy && !self.include_inbound_ports.is_none() {
            routes.mark_route = Some(MarkRoute::tproxy(self.ipv6));
        }
        routes
    }

    fn build(&self, b: &mut Builder) {
        let tproxy = self.mode == InterceptionMode::Tproxy;
        let (uid, gid) = (self.proxy_uid, self.proxy_gid);

        for name in &self.exclude_interfaces {
            b.append(BOTH, NAT, PREROUTING, &format!("-i {name} -j RETURN"));
            b.append(BOTH, NAT, OUTPUT, &format!("-o {name} -j RETURN"));
        }
        if tproxy {
            for name in &self.exclude_interfaces {
                b.append(BOTH, MANGLE, PREROUTING, &format!("-i {name} -j RETURN"));
                b.append(BOTH, MANGLE, OUTPUT, &format!("-o {name} -j RETURN"));
            }
        }
        for name in &self.reroute_virtual_interfaces {
            b.insert(BOTH, NAT, PREROUTING, 1, &format!("-i {name} -j RETURN"));
        }
        if self.invalid_drop {
            let rule = format!("-m conntrack --ctstate INVALID -j {ISTIO_DROP}");
            b.append(BOTH, MANGLE, PREROUTING, &rule);
            b.append(BOTH, MANGLE, ISTIO_DROP, "-j DROP");
        }
        let tunnel = INBOUND_TUNNEL_PORT;
        b.append(
            BOTH,
            NAT,
            ISTIO_INBOUND,
            &format!("-p tcp --dport {tunnel} -j RETURN"),
        );
        let outbound = OUTBOUND_CAPTURE_PORT;
        let rule = format!("-p tcp -j REDIRECT --to-ports {outbound}");
        b.append(BOTH, NAT, ISTIO_REDIRECT, &rule);
        let inbound = INBOUND_CAPTURE_PORT;
        let rule = format!("-p tcp -j REDIRECT --to-ports {inbound}");
        b.append(BOTH, NAT, ISTIO_IN_REDIRECT, &rule);
        self.build_inbound(b);

        b.append(BOTH, NAT, OUTPUT, &format!("-j {ISTIO_OUTPUT}"));
        for port in &self.exclude_outbound_ports {
            b.append(
                BOTH,
                NAT,
                ISTIO_OUTPUT,
                &format!("-p tcp --dport {port} -j RETURN"),
            );
            b.append(
                BOTH,
                NAT,
                ISTIO_OUTPUT,
                &format!("-p udp --dport {port} -j RETURN"),
            );
        }
        b.versioned(
            NAT,
            ISTIO_OUTPUT,
            PASSTHROUGH,
            &format!("-o lo -s {IP} -j RETURN"),
        );
        let app_loopback_passes = !self.include_outbound_ip_ranges.has_loopback();
        for (owner, id) in [("--uid-owner", uid), ("--gid-owner", gid)] {
            let proxy_loopback = if self.dns_capture && owner == "--uid-owner" {
                format!("-o lo ! -d {IP} -p tcp -m multiport ! --dports {DNS_PORT},{tunnel}")
            } else {
                format!("-o lo ! -d {IP} -p tcp ! --dport {tunnel}")
            };
            b.versioned(
                NAT,
                ISTIO_OUTPUT,
                HOST_LOOPBACK,
                &format!("{proxy_loopback} -m owner {owner} {id} -j {ISTIO_IN_REDIRECT}"),
            );
            if app_loopback_passes {
                let rule = if self.dns_capture {
                    format!("-o lo -p tcp ! --dport {DNS_PORT} -m owner ! {owner} {id} -j RETURN")
                } else {
                    format!("-o lo -m owner ! {owner} {id} -j RETURN")
                };
                b.append(BOTH, NAT, ISTIO_OUTPUT, &rule);
            }
            let rule = format!("-m owner {owner} {id} -j RETURN");
            b.append(BOTH, NAT, ISTIO_OUTPUT, &rule);
        }
        if self.dns_capture {
            self.build_dns(b);
        }
        b.versioned(
            NAT,
            ISTIO_OUTPUT,
            HOST_LOOPBACK,
            &format!("-d {IP} -j RETURN"),
        );
        for (family, cidrs) in [
            (V4, &self.exclude_outbound_ip_ranges.v4),
            (V6, &self.exclude_outbound_ip_ranges.v6),
        ] {
            for cidr in cidrs {
                b.append(family, NAT, ISTIO_OUTPUT, &format!("-d {cidr} -j RETURN"));
            }
        }
        for port in &self.include_outbound_ports {
            let rule = format!("-p tcp --dport {port} -j {ISTIO_REDIRECT}");
            b.append(BOTH, NAT, ISTIO_OUTPUT, &rule);
        }
        for family in [V4, V6] {
            self.build_outbound_include(b, family);
        }
        if tproxy {
            self.build_tproxy_marks(b);
        }
    }

    /// TPROXY mode's marks: the inbound connections' mark kept in conntrack and restored on
    /// their replies, and the proxy's own loopback connections told apart.
    fn build_tproxy_marks(&self, b: &mut Builder) {
        let (mark, outbound_mark) = (TPROXY_MARK, OUTBOUND_MARK);
        let rule = format!("-p tcp -m mark --mark {mark} -j CONNMARK --save-mark");
        b.append(BOTH, MANGLE, PREROUTING, &rule);
        let rule = format!("-p tcp -o lo -m mark --mark {mark} -j RETURN");
        b.append(BOTH, MANGLE, OUTPUT, &rule);
        for (owner, id) in [
            ("--uid-owner", self.proxy_uid),
            ("--gid-owner", self.proxy_gid),
        ] {
            let rule = format!(
                "! -d {IP} -p tcp -o lo -m owner {owner} {id} -j MARK --set-mark {outbound_mark}"
            );
            b.versioned(MANGLE, OUTPUT, HOST_LOOPBACK, &rule);
        }
        let rule = format!("-p tcp -m connmark --mark {mark} -j CONNMARK --restore-mark");
        b.append(BOTH, MANGLE, OUTPUT, &rule);
        let rule = format!("-p tcp -m mark --mark {mark} -j RETURN");
        b.insert(BOTH, MANGLE, ISTIO_INBOUND, 1, &rule);
        for (family, source) in [(V4, PASSTHROUGH.0), (V6, PASSTHROUGH.1)] {
            let rule = format!("-p tcp -s {source} -i lo -j RETURN");
            b.insert(family, MANGLE, ISTIO_INBOUND, 2, &rule);
        }
        let rule = format!("-p tcp -i lo -m mark ! --mark {outbound_mark} -j RETURN");
        b.insert(BOTH, MANGLE, ISTIO_INBOUND, 3, &rule);
    }

    fn build_inbound(&self, b: &mut Builder) {
        if self.include_inbound_ports.is_none() {
            return;
        }
        let tproxy = self.mode == InterceptionMode::Tproxy;
        // What a captured connection's packets jump to: its first packet, and the rest.
        let (table, first, established) = if tproxy {
            let mark = TPROXY_MARK;
            b.append(
                BOTH,
                MANGLE,
                ISTIO_DIVERT,
                &format!("-j MARK --set-mark {mark}"),
            );
            b.append(BOTH, MANGLE, ISTIO_DIVERT, "-j ACCEPT");
            let rule = format!(
                "! -d {IP} -p tcp -j TPROXY --tproxy-mark {mark}/0xffffffff --on-port {INBOUND_CAPTURE_PORT}"
            );
            b.versioned(MANGLE, ISTIO_TPROXY, HOST_LOOPBACK, &rule);
            (MANGLE, ISTIO_TPROXY, Some(ISTIO_DIVERT))
        } else {
            (NAT, ISTIO_IN_REDIRECT, None)
        };
        b.append(
            BOTH,
            table,
            PREROUTING,
            &format!("-p tcp -j {ISTIO_INBOUND}"),
        );
        let ports: Vec<Option<u16>> = match &self.include_inbound_ports {
            PortSelection::All => {
                for port in &self.exclude_inbound_ports {
                    let rule = format!("-p tcp --dport {port} -j RETURN");
                    b.append(BOTH, table, ISTIO_INBOUND, &rule);
                }
                vec![None]
            }
            PortSelection::Ports(ports) => ports.iter().copied().map(Some).collect(),
        };
        for port in ports {
            let dport = port.map_or_else(String::new, |port| format!(" --dport {port}"));
            if let Some(established) = established {
                let rule = format!(
                    "-p tcp{dport} -m conntrack --ctstate RELATED,ESTABLISHED -j {established}"
                );
                b.append(BOTH, table, ISTIO_INBOUND, &rule);
            }
            b.append(
                BOTH,
                table,
                ISTIO_INBOUND,
                &format!("-p tcp{dport} -j {first}"),
            );
        }
    }

    fn build_dns(&self, b: &mut Builder) {
        let (dns, capture) = (DNS_PORT, DNS_CAPTURE_PORT);
        b.append(BOTH, RAW, OUTPUT, &format!("-j {ISTIO_OUTPUT_DNS}"));
        b.append(BOTH, NAT, ISTIO_OUTPUT, &format!("-j {ISTIO_OUTPUT_DNS}"));
        let rule = format!("-p tcp --dport {dns} -j REDIRECT --to-ports {capture}");
        b.append(BOTH, NAT, ISTIO_OUTPUT_DNS, &rule);
        let rule = format!("-p udp --dport {dns} -j REDIRECT --to-port {capture}");
        b.append(BOTH, NAT, ISTIO_OUTPUT_DNS, &rule);
        // Separate conntrack zones for proxy ↔ upstream (1) and app ↔ proxy (2) DNS flows.
        for (owner, id) in [
            ("--uid-owner", self.proxy_uid),
            ("--gid-owner", self.proxy_gid),
        ] {
            let rule = format!("-p udp --dport {dns} -m owner {owner} {id} -j CT --zone 1");
            b.append(BOTH, RAW, ISTIO_OUTPUT_DNS, &rule);
            let rule = format!("-p udp --sport {capture} -m owner {owner} {id} -j CT --zone 2");
            b.append(BOTH, RAW, ISTIO_OUTPUT_DNS, &rule);
        }
        b.append(BOTH, RAW, PREROUTING, &format!("-j {ISTIO_INBOUND}"));
        let rule = format!("-p udp --dport {dns} -j CT --zone 2");
        b.append(BOTH, RAW, ISTIO_OUTPUT_DNS, &rule);
        let rule = format!("-p udp --sport {dns} -j CT --zone 1");
        b.append(BOTH, RAW, ISTIO_INBOUND, &rule);
    }

    fn build_outbound_include(&self, b: &mut Builder, family: Families) {
        let redirect = format!("-j {ISTIO_REDIRECT}");
        match &self.include_outbound_ip_ranges {
            IpRanges::All => {
                b.append(family, NAT, ISTIO_OUTPUT, &redirect);
                for name in &self.reroute_virtual_interfaces {
                    b.insert(family, NAT, PREROUTING, 1, &format!("-i {name} {redirect}"));
                }
            }
            IpRanges::Cidrs(set) => {
                for cidr in if family == V4 { &set.v4 } else { &set.v6 } {
                    for name in &self.reroute_virtual_interfaces {
                        let rule = format!("-i {name} -d {cidr} {redirect}");
                        b.insert(family, NAT, PREROUTING, 1, &rule);
                    }
                    b.append(family, NAT, ISTIO_OUTPUT, &format!("-d {cidr} {redirect}"));
                }
            }
        }
    }
}

const NAT: &str = "nat";
const MANGLE: &str = "mangle";
const RAW: &str = "raw";
const PREROUTING: &str = "PREROUTING";
const OUTPUT: &str = "OUTPUT";
const ISTIO_INBOUND: &str = "ISTIO_INBOUND";
const ISTIO_OUTPUT: &str = "ISTIO_OUTPUT";
const ISTIO_OUTPUT_DNS: &str = "ISTIO_OUTPUT_DNS";
const ISTIO_REDIRECT: &str = "ISTIO_REDIRECT";
const ISTIO_IN_REDIRECT: &str = "ISTIO_IN_REDIRECT";
const ISTIO_DIVERT: &str = "ISTIO_DIVERT";
const ISTIO_TPROXY: &str = "ISTIO_TPROXY";
const ISTIO_DROP: &str = "ISTIO_DROP";
/// The proxy's inbound passthrough source, IPv4 and IPv6.
const PASSTHROUGH: (&str, &str) = ("127.0.0.6/32", "::6/128");
/// The host's loopback address, IPv4 and IPv6.
const HOST_LOOPBACK: (&str, &str) = ("127.0.0.1/32", "::1/128");
