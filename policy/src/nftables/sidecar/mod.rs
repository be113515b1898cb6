//! Istio's nftables rules for a sidecar pod (`tools/istio-nftables/pkg/capture/run.go`,
//! `NftablesConfigurator.Run`): the same rules, in the same order, in the same three `inet`
//! tables, as `istio-nftables` writes for the CNI plugin (`cni/pkg/plugin/sidecar_nftables_linux.go`).

mod config;
mod unclaimed;

pub use config::{DnsRedirect, OwnerGroups, SidecarCapture};

use super::transaction::{Builder, TableSpec, base, chain};
use crate::model::{
    DNS_CAPTURE_PORT, DNS_PORT, INBOUND_CAPTURE_PORT, INBOUND_TUNNEL_PORT, InterceptionMode,
    IpRanges, OUTBOUND_CAPTURE_PORT, OUTBOUND_MARK, PortSelection, RedirectPolicy, TPROXY_MARK,
};

/// The sidecar's NAT table.
pub const NAT_TABLE: &str = "istio-proxy-nat";
/// The sidecar's mangle table (TPROXY, invalid drop).
pub const MANGLE_TABLE: &str = "istio-proxy-mangle";
/// The sidecar's raw table (DNS conntrack zones).
pub const RAW_TABLE: &str = "istio-proxy-raw";

const PREROUTING: &str = "prerouting";
const OUTPUT: &str = "output";
const INBOUND: &str = "istio-inbound";
const REDIRECT: &str = "istio-redirect";
const IN_REDIRECT: &str = "istio-in-redirect";
const ISTIO_OUTPUT: &str = "istio-output";
const OUTPUT_DNS: &str = "istio-output-dns";
const DIVERT: &str = "istio-divert";
const TPROXY: &str = "istio-tproxy";
const DROP: &str = "istio-drop";

/// The three tables and their chains, in Istio's declaration order.
pub(super) const TABLES: [TableSpec; 3] = [
    TableSpec {
        name: NAT_TABLE,
        chains: &[
            base(PREROUTING, "nat", "prerouting", -100),
            base(OUTPUT, "nat", "output", -100),
            chain(INBOUND),
            chain(REDIRECT),
            chain(IN_REDIRECT),
            chain(ISTIO_OUTPUT),
            chain(OUTPUT_DNS),
        ],
    },
    TableSpec {
        name: MANGLE_TABLE,
        chains: &[
            base(PREROUTING, "filter", "prerouting", -150),
            base(OUTPUT, "route", "output", -150),
            chain(DIVERT),
            chain(TPROXY),
            chain(INBOUND),
            chain(DROP),
        ],
    },
    TableSpec {
        name: RAW_TABLE,
        chains: &[
            base(PREROUTING, "filter", "prerouting", -300),
            base(OUTPUT, "filter", "output", -300),
            chain(INBOUND),
            chain(OUTPUT_DNS),
        ],
    },
];

impl RedirectPolicy {
    /// Istio's nftables rules for this policy, as `nft -f` input: exactly what Istio writes
    /// (the goldens); meshcap applies [`Self::render_nftables_applied`].
    #[must_use]
    pub fn render_nftables(&self) -> String {
        SidecarCapture::from(self).render()
    }
}

impl SidecarCapture<'_> {
    /// The `nft -f` transaction `istio-nftables` runs for this configuration.
    #[must_use]
    pub fn render(&self) -> String {
        let mut b = Builder::new(self.policy.ipv6);
        self.build(&mut b);
        b.transaction(&TABLES)
    }

    /// Whether DNS is redirected at all: servers-only redirection with no servers is not.
    fn redirects_dns(&self) -> bool {
        match &self.dns {
            DnsRedirect::Off => false,
            DnsRedirect::All => true,
            DnsRedirect::Servers { v4, v6 } => !v4.is_empty() || !v6.is_empty(),
        }
    }

    fn build(&self, b: &mut Builder) {
        let p = self.policy;
        let tproxy = p.mode == InterceptionMode::Tproxy;
        let dns = self.redirects_dns();
        let loopback = &self.host_loopback_v4;
        let tunnel = INBOUND_TUNNEL_PORT;

        for name in &p.exclude_interfaces {
            b.append(
                NAT_TABLE,
                PREROUTING,
                format!("iifname {name} counter return"),
            );
            b.append(NAT_TABLE, OUTPUT, format!("oifname {name} counter return"));
        }
        if tproxy {
            for name in &p.exclude_interfaces {
                b.append(
                    MANGLE_TABLE,
                    PREROUTING,
                    format!("iifname {name} counter return"),
                );
                b.append(
                    MANGLE_TABLE,
                    OUTPUT,
                    format!("oifname {name} counter return"),
                );
            }
        }
        for name in &p.reroute_virtual_interfaces {
            b.insert(
                NAT_TABLE,
                PREROUTING,
                0,
                format!("iifname {name} counter return"),
            );
        }
        if p.invalid_drop {
            let rule = format!("meta l4proto tcp ct state invalid counter jump {DROP}");
            b.append(MANGLE_TABLE, PREROUTING, rule);
            b.append(MANGLE_TABLE, DROP, "counter drop".to_owned());
        }
        let rule = format!("meta l4proto tcp tcp dport {tunnel} counter return");
        b.append(NAT_TABLE, INBOUND, rule);
        let rule = format!("meta l4proto tcp counter redirect to :{OUTBOUND_CAPTURE_PORT}");
        b.append(NAT_TABLE, REDIRECT, rule);
        let rule = format!("meta l4proto tcp counter redirect to :{INBOUND_CAPTURE_PORT}");
        b.append(NAT_TABLE, IN_REDIRECT, rule);
        self.build_inbound(b);

        b.append(NAT_TABLE, OUTPUT, format!("counter jump {ISTIO_OUTPUT}"));
        for port in &p.exclude_outbound_ports {
            b.append(
                NAT_TABLE,
                ISTIO_OUTPUT,
                format!("tcp dport {port} counter return"),
            );
            b.append(
                NAT_TABLE,
                ISTIO_OUTPUT,
                format!("udp dport {port} counter return"),
            );
        }
        let rule = "oifname lo ip saddr 127.0.0.6/32 counter return".to_owned();
        b.append(NAT_TABLE, ISTIO_OUTPUT, rule);
        let rule = "oifname lo ip6 saddr ::6/128 counter return".to_owned();
        b.append_v6(NAT_TABLE, ISTIO_OUTPUT, rule);
        let app_loopback_passes = !p.include_outbound_ip_ranges.has_loopback();
        let owners = self.proxy_uids.iter().map(|id| ("skuid", id));
        for (owner, id) in owners.chain(self.proxy_gids.iter().map(|id| ("skgid", id))) {
            // Only the uid rule leaves the proxy's DNS over loopback alone.
            let ports = if dns && owner == "skuid" {
                format!("{{ {DNS_PORT}, {tunnel} }}")
            } else {
                tunnel.to_string()
            };
            let to_self = |daddr: &str| {
                format!(
                    "oifname lo meta l4proto tcp {daddr} tcp dport != {ports} {owner} {id} \
                     counter jump {IN_REDIRECT}"
                )
            };
            b.append(
                NAT_TABLE,
                ISTIO_OUTPUT,
                to_self(&format!("ip daddr != {loopback}")),
            );
            b.append_v6(NAT_TABLE, ISTIO_OUTPUT, to_self("ip6 daddr != ::1/128"));
            if app_loopback_passes {
                let rule = if dns {
                    format!(
                        "oifname lo meta l4proto tcp tcp dport != {DNS_PORT} {owner} != {id} \
                         counter return"
                    )
                } else {
                    format!("oifname lo {owner} != {id} counter return")
                };
                b.append(NAT_TABLE, ISTIO_OUTPUT, rule);
            }
            b.append(
                NAT_TABLE,
                ISTIO_OUTPUT,
                format!("{owner} {id} counter return"),
            );
        }
        match &self.owner_groups {
            OwnerGroups::AllExcept(groups) => {
                for group in groups {
                    let rule = format!("skgid {group} counter return");
                    b.append(NAT_TABLE, ISTIO_OUTPUT, rule);
                }
            }
            OwnerGroups::Only(groups) => {
                let none_of: Vec<String> = groups.iter().map(|g| format!("skgid != {g}")).collect();
                let rule = format!("{} counter return", none_of.join(" "));
                b.append(NAT_TABLE, ISTIO_OUTPUT, rule);
            }
        }
        if dns {
            self.build_dns(b);
        }
        let rule = format!("ip daddr {loopback} counter return");
        b.append(NAT_TABLE, ISTIO_OUTPUT, rule);
        let rule = "ip6 daddr ::1/128 counter return".to_owned();
        b.append_v6(NAT_TABLE, ISTIO_OUTPUT, rule);
        for cidr in &p.exclude_outbound_ip_ranges.v4 {
            b.append(
                NAT_TABLE,
                ISTIO_OUTPUT,
                format!("ip daddr {cidr} counter return"),
            );
        }
        for cidr in &p.exclude_outbound_ip_ranges.v6 {
            b.append_v6(
                NAT_TABLE,
                ISTIO_OUTPUT,
                format!("ip6 daddr {cidr} counter return"),
            );
        }
        for port in &p.include_outbound_ports {
            let rule = format!("tcp dport {port} counter jump {REDIRECT}");
            b.append(NAT_TABLE, ISTIO_OUTPUT, rule);
        }
        self.build_outbound_include(b);
        if tproxy {
            self.build_tproxy_marks(b);
        }
    }

    fn build_inbound(&self, b: &mut Builder) {
        let p = self.policy;
        if p.include_inbound_ports.is_none() {
            return;
        }
        let tproxy = p.mode == InterceptionMode::Tproxy;
        // Where a captured connection's packets go: its first packet, and (TPROXY) the rest.
        let (table, first, established) = if tproxy {
            let (mark, port, loopback) =
                (TPROXY_MARK, INBOUND_CAPTURE_PORT, &self.host_loopback_v4);
            b.append(
                MANGLE_TABLE,
                DIVERT,
                format!("counter meta mark set {mark}"),
            );
            b.append(MANGLE_TABLE, DIVERT, "counter accept".to_owned());
            let rule = format!(
                "meta l4proto tcp ip daddr != {loopback} tproxy ip to :{port} \
                 meta mark set {mark} counter accept"
            );
            b.append(MANGLE_TABLE, TPROXY, rule);
            let rule = format!(
                "meta l4proto tcp ip6 daddr != ::1/128 tproxy ip6 to :{port} \
                 meta mark set {mark} counter accept"
            );
            b.append_v6(MANGLE_TABLE, TPROXY, rule);
            (MANGLE_TABLE, TPROXY, Some(DIVERT))
        } else {
            (NAT_TABLE, IN_REDIRECT, None)
        };
        let rule = format!("meta l4proto tcp counter jump {INBOUND}");
        b.append(table, PREROUTING, rule);
        match &p.include_inbound_ports {
            PortSelection::All => {
                for port in &p.exclude_inbound_ports {
                    let rule = format!("meta l4proto tcp tcp dport {port} counter return");
                    b.append(table, INBOUND, rule);
                }
                if let Some(established) = established {
                    let rule = format!(
                        "meta l4proto tcp ct state related,established counter jump {established}"
                    );
                    b.append(table, INBOUND, rule);
                }
                let rule = format!("meta l4proto tcp counter jump {first}");
                b.append(table, INBOUND, rule);
            }
            PortSelection::Ports(ports) => {
                for port in ports {
                    if let Some(established) = established {
                        let rule = format!(
                            "meta l4proto tcp ct state related,established tcp dport {port} \
                             counter jump {established}"
                        );
                        b.append(table, INBOUND, rule);
                    }
                    let rule = format!("meta l4proto tcp tcp dport {port} counter jump {first}");
                    b.append(table, INBOUND, rule);
                }
            }
        }
    }

    fn build_dns(&self, b: &mut Builder) {
        let (dns, capture) = (DNS_PORT, DNS_CAPTURE_PORT);
        b.append(RAW_TABLE, OUTPUT, format!("counter jump {OUTPUT_DNS}"));
        b.append(
            NAT_TABLE,
            ISTIO_OUTPUT,
            format!("counter jump {OUTPUT_DNS}"),
        );
        let (v4, v6): (&[String], &[String]) = match &self.dns {
            DnsRedirect::Servers { v4, v6 } => (v4, v6),
            DnsRedirect::All | DnsRedirect::Off => (&[], &[]),
        };
        let all = self.dns == DnsRedirect::All;
        for proto in ["tcp", "udp"] {
            if all {
                let l4 = if proto == "tcp" {
                    "meta l4proto tcp "
                } else {
                    ""
                };
                let rule = format!("{l4}{proto} dport {dns} counter redirect to :{capture}");
                b.append(NAT_TABLE, OUTPUT_DNS, rule);
                continue;
            }
            for server in v4 {
                let rule = format!(
                    "ip daddr {server}/32 {proto} dport {dns} counter redirect to :{capture}"
                );
                b.append(NAT_TABLE, OUTPUT_DNS, rule);
            }
            for server in v6 {
                let rule = format!(
                    "ip6 daddr {server}/128 {proto} dport {dns} counter redirect to :{capture}"
                );
                b.append_v6(NAT_TABLE, OUTPUT_DNS, rule);
            }
        }
        // Separate conntrack zones for proxy ↔ upstream (1) and app ↔ proxy (2) DNS flows.
        let owners = self.proxy_uids.iter().map(|id| ("skuid", id));
        for (owner, id) in owners.chain(self.proxy_gids.iter().map(|id| ("skgid", id))) {
            let rule = format!("udp dport {dns} meta {owner} {id} counter ct zone set 1");
            b.append(RAW_TABLE, OUTPUT_DNS, rule);
            let rule = format!("udp sport {capture} meta {owner} {id} counter ct zone set 2");
            b.append(RAW_TABLE, OUTPUT_DNS, rule);
        }
        b.append(RAW_TABLE, PREROUTING, format!("counter jump {INBOUND}"));
        if all {
            let rule = format!("udp dport {dns} counter ct zone set 2");
            b.append(RAW_TABLE, OUTPUT_DNS, rule);
            let rule = format!("udp sport {dns} counter ct zone set 1");
            b.append(RAW_TABLE, INBOUND, rule);
            return;
        }
        for server in v4 {
            let rule = format!("udp dport {dns} ip daddr {server}/32 counter ct zone set 2");
            b.append(RAW_TABLE, OUTPUT_DNS, rule);
            let rule = format!("udp sport {dns} ip saddr {server}/32 counter ct zone set 1");
            b.append(RAW_TABLE, INBOUND, rule);
        }
        for server in v6 {
            let rule = format!("udp dport {dns} ip6 daddr {server}/128 counter ct zone set 2");
            b.append_v6(RAW_TABLE, OUTPUT_DNS, rule);
            let rule = format!("udp sport {dns} ip6 saddr {server}/128 counter ct zone set 1");
            b.append_v6(RAW_TABLE, INBOUND, rule);
        }
    }

    fn build_outbound_include(&self, b: &mut Builder) {
        let p = self.policy;
        let jump = format!("counter jump {REDIRECT}");
        match &p.include_outbound_ip_ranges {
            IpRanges::All => {
                b.append(NAT_TABLE, ISTIO_OUTPUT, jump.clone());
                for name in &p.reroute_virtual_interfaces {
                    b.insert(NAT_TABLE, PREROUTING, 0, format!("iifname {name} {jump}"));
                }
            }
            IpRanges::Cidrs(set) => {
                for cidr in &set.v4 {
                    for name in &p.reroute_virtual_interfaces {
                        let rule = format!("iifname {name} ip daddr {cidr} {jump}");
                        b.insert(NAT_TABLE, PREROUTING, 0, rule);
                    }
                    b.append(NAT_TABLE, ISTIO_OUTPUT, format!("ip daddr {cidr} {jump}"));
                }
                for cidr in &set.v6 {
                    for name in &p.reroute_virtual_interfaces {
                        let rule = format!("iifname {name} ip6 daddr {cidr} {jump}");
                        b.insert_v6(NAT_TABLE, PREROUTING, 0, rule);
                    }
                    b.append_v6(NAT_TABLE, ISTIO_OUTPUT, format!("ip6 daddr {cidr} {jump}"));
                }
            }
        }
    }

    /// TPROXY mode's marks: the inbound connections' mark kept in conntrack and restored on
    /// their replies, and the proxy's own loopback connections told apart.
    fn build_tproxy_marks(&self, b: &mut Builder) {
        let (mark, outbound, loopback) = (TPROXY_MARK, OUTBOUND_MARK, &self.host_loopback_v4);
        let rule = format!("meta l4proto tcp mark {mark} counter ct mark set mark");
        b.append(MANGLE_TABLE, PREROUTING, rule);
        let rule = format!("oifname lo meta l4proto tcp mark {mark} counter return");
        b.append(MANGLE_TABLE, OUTPUT, rule);
        let owners = self.proxy_uids.iter().map(|id| ("skuid", id));
        for (owner, id) in owners.chain(self.proxy_gids.iter().map(|id| ("skgid", id))) {
            let rule = |daddr: &str| {
                format!(
                    "oifname lo meta l4proto tcp {daddr} {owner} {id} counter meta mark set {outbound}"
                )
            };
            b.append(
                MANGLE_TABLE,
                OUTPUT,
                rule(&format!("ip daddr != {loopback}")),
            );
            b.append_v6(MANGLE_TABLE, OUTPUT, rule("ip6 daddr != ::1/128"));
        }
        let rule = format!("meta l4proto tcp ct mark {mark} counter meta mark set ct mark");
        b.append(MANGLE_TABLE, OUTPUT, rule);
        let rule = format!("meta l4proto tcp mark {mark} counter return");
        b.insert(MANGLE_TABLE, INBOUND, 0, rule);
        let rule = "iifname lo meta l4proto tcp ip saddr 127.0.0.6/32 counter return".to_owned();
        b.insert(MANGLE_TABLE, INBOUND, 1, rule);
        let rule = "iifname lo meta l4proto tcp ip6 saddr ::6/128 counter return".to_owned();
        b.insert_v6(MANGLE_TABLE, INBOUND, 1, rule);
        let rule = format!("iifname lo meta l4proto tcp mark != {outbound} counter return");
        b.insert(MANGLE_TABLE, INBOUND, 2, rule);
    }
}
