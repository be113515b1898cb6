//! Istio's in-pod nftables rules for an ambient pod (`cni/pkg/nftables/nftables.go`,
//! `AppendInpodRules`): the same rules, in the same order, in the same three `inet` tables.

use super::transaction::{Builder, TableSpec, base, chain};
use crate::ambient::{
    CONNECTION_MARK, CONNECTION_MARK_MASK, InpodPolicy, ZTUNNEL_DNS_PORT,
    ZTUNNEL_INBOUND_PLAINTEXT_PORT, ZTUNNEL_INBOUND_PORT, ZTUNNEL_MARK, ZTUNNEL_MARK_MASK,
    ZTUNNEL_OUTBOUND_PORT,
};

/// The in-pod NAT table.
pub const NAT_TABLE: &str = "istio-ambient-nat";
/// The in-pod mangle table.
pub const MANGLE_TABLE: &str = "istio-ambient-mangle";
/// The in-pod raw table (DNS conntrack zones).
pub const RAW_TABLE: &str = "istio-ambient-raw";

const PREROUTING: &str = "prerouting";
const OUTPUT: &str = "output";
const ISTIO_PREROUTING: &str = "istio-prerouting";
const ISTIO_OUTPUT: &str = "istio-output";

/// The three tables and their chains, in Istio's declaration order.
pub(super) const TABLES: [TableSpec; 3] = [
    TableSpec {
        name: NAT_TABLE,
        chains: &[
            base(PREROUTING, "nat", "prerouting", -100),
            base(OUTPUT, "nat", "output", -100),
            chain(ISTIO_PREROUTING),
            chain(ISTIO_OUTPUT),
        ],
    },
    TableSpec {
        name: MANGLE_TABLE,
        chains: &[
            base(PREROUTING, "filter", "prerouting", -150),
            base(OUTPUT, "route", "output", -150),
            chain(ISTIO_PREROUTING),
            chain(ISTIO_OUTPUT),
        ],
    },
    TableSpec {
        name: RAW_TABLE,
        chains: &[
            base(PREROUTING, "filter", "prerouting", -300),
            base(OUTPUT, "filter", "output", -300),
            chain(ISTIO_PREROUTING),
            chain(ISTIO_OUTPUT),
        ],
    },
];

impl InpodPolicy {
    /// Istio's in-pod nftables rules for this policy, as `nft -f` input.
    #[must_use]
    pub fn render_nftables(&self) -> String {
        let mut b = Builder::new(self.ipv6);
        self.build_nftables(&mut b);
        b.transaction(&TABLES)
    }

    fn build_nftables(&self, b: &mut Builder) {
        // Istio writes the mark matches with its own spacing, double spaces included.
        let ztunnel = format!("{ZTUNNEL_MARK_MASK:#x} != {ZTUNNEL_MARK:#x}");
        let connection = format!("{CONNECTION_MARK_MASK:#x} == {CONNECTION_MARK:#x}");
        let (probe4, probe6) = (self.host_probe_snat.v4, self.host_probe_snat.v6);
        let (outbound, dns_port) = (ZTUNNEL_OUTBOUND_PORT, ZTUNNEL_DNS_PORT);

        b.append(MANGLE_TABLE, PREROUTING, format!("jump {ISTIO_PREROUTING}"));
        b.append(MANGLE_TABLE, OUTPUT, format!("jump {ISTIO_OUTPUT}"));
        b.append(NAT_TABLE, OUTPUT, format!("jump {ISTIO_OUTPUT}"));
        if self.dns {
            b.append(RAW_TABLE, PREROUTING, format!("jump {ISTIO_PREROUTING}"));
            b.append(RAW_TABLE, OUTPUT, format!("jump {ISTIO_OUTPUT}"));
        }
        b.append(NAT_TABLE, PREROUTING, format!("jump {ISTIO_PREROUTING}"));
        for name in &self.virtual_interfaces {
            let rule = format!("iifname {name} meta l4proto tcp counter redirect to :{outbound}");
            b.append(NAT_TABLE, ISTIO_PREROUTING, rule);
            let rule = format!("iifname {name} meta l4proto tcp counter return");
            b.append(NAT_TABLE, ISTIO_PREROUTING, rule);
        }
        let rule = format!(
            "meta mark & {ZTUNNEL_MARK_MASK:#x} == {ZTUNNEL_MARK:#x} counter \
             ct mark set ct mark & {:#x} |  {CONNECTION_MARK:#x}",
            !CONNECTION_MARK_MASK
        );
        b.append(MANGLE_TABLE, ISTIO_PREROUTING, rule);
        if self.inbound {
            let rule = format!("meta l4proto tcp ip saddr {probe4} counter accept");
            b.append(NAT_TABLE, ISTIO_PREROUTING, rule);
            let rule = format!("meta l4proto tcp ip6 saddr {probe6} counter accept");
            b.append_v6(NAT_TABLE, ISTIO_PREROUTING, rule);
        }
        let rule = format!("meta l4proto tcp ip daddr {probe4} counter accept");
        b.append(NAT_TABLE, ISTIO_OUTPUT, rule);
        let rule = format!("meta l4proto tcp ip6 daddr {probe6} counter accept");
        b.append_v6(NAT_TABLE, ISTIO_OUTPUT, rule);
        if self.inbound {
            let (hbone, plaintext) = (ZTUNNEL_INBOUND_PORT, ZTUNNEL_INBOUND_PLAINTEXT_PORT);
            let rule = format!(
                "ip daddr != 127.0.0.1/32 tcp dport != {hbone} mark and {ZTUNNEL_MARK_MASK:#x}  \
                 != {ZTUNNEL_MARK:#x} counter redirect to :{plaintext}"
            );
            b.append(NAT_TABLE, ISTIO_PREROUTING, rule);
            let rule = format!(
                "ip6 daddr != ::1/128 tcp dport != {hbone} mark and {ztunnel} counter \
                 redirect to :{plaintext}"
            );
            b.append_v6(NAT_TABLE, ISTIO_PREROUTING, rule);
        }
        let rule = format!("ct mark and {connection} counter meta mark set ct mark");
        b.append(MANGLE_TABLE, ISTIO_OUTPUT, rule);
        if self.dns {
            let rule = format!(
                "oifname != lo mark and {ztunnel} udp dport 53 counter redirect to :{dns_port}"
            );
            b.append(NAT_TABLE, ISTIO_OUTPUT, rule);
            let rule = format!(
                "ip daddr != 127.0.0.1/32 tcp dport 53 mark and {ztunnel} counter \
                 redirect to :{dns_port}"
            );
            b.append(NAT_TABLE, ISTIO_OUTPUT, rule);
            let rule = format!(
                "ip6 daddr != ::1/128 tcp dport 53 mark and {ztunnel} counter \
                 redirect to :{dns_port}"
            );
            b.append_v6(NAT_TABLE, ISTIO_OUTPUT, rule);
            let rule = format!(
                "udp dport 53 meta mark and {ZTUNNEL_MARK_MASK:#x} == {ZTUNNEL_MARK:#x} counter \
                 ct zone set 1"
            );
            b.append(RAW_TABLE, ISTIO_OUTPUT, rule);
            let rule = format!("udp sport 53 meta mark and {ztunnel} counter ct zone set 1");
            b.append(RAW_TABLE, ISTIO_PREROUTING, rule);
        }
        let rule = format!("meta l4proto tcp mark and {connection} counter accept");
        b.append(NAT_TABLE, ISTIO_OUTPUT, rule);
        let rule = "oifname lo ip daddr != 127.0.0.1/32 counter accept".to_owned();
        b.append(NAT_TABLE, ISTIO_OUTPUT, rule);
        let rule = "oifname lo ip6 daddr != ::1/128 counter accept".to_owned();
        b.append_v6(NAT_TABLE, ISTIO_OUTPUT, rule);
        let rule = format!(
            "meta l4proto tcp ip daddr != 127.0.0.1/32 mark and {ztunnel} counter \
             redirect to :{outbound}"
        );
        b.append(NAT_TABLE, ISTIO_OUTPUT, rule);
        let rule = format!(
            "meta l4proto tcp ip6 daddr != ::1/128 mark and {ztunnel} counter \
             redirect to :{outbound}"
        );
        b.append_v6(NAT_TABLE, ISTIO_OUTPUT, rule);
    }
}
