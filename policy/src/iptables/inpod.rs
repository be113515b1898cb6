//! Istio's in-pod rules for an ambient pod (`cni/pkg/iptables/iptables.go`,
//! `AppendInpodRules`): the same rules, in the same order within each table, as
//! `iptables-restore` input, and the mark route they rely on (`iptables_linux.go`).

use super::{
    HOST_LOOPBACK, ISTIO_OUTPUT, IptablesRules, MANGLE, NAT, OUTPUT, PREROUTING, RAW,
    builder::{BOTH, Builder, IP, restore_text},
};
use crate::{
    MarkRoute, PolicyRoutes,
    ambient::{
        CONNECTION_MARK, CONNECTION_MARK_MASK, InpodPolicy, ZTUNNEL_DNS_PORT,
        ZTUNNEL_INBOUND_PLAINTEXT_PORT, ZTUNNEL_INBOUND_PORT, ZTUNNEL_MARK, ZTUNNEL_MARK_MASK,
        ZTUNNEL_OUTBOUND_PORT,
    },
};

/// The in-pod prerouting chain.
const ISTIO_PRERT: &str = "ISTIO_PRERT";

impl InpodPolicy {
    /// Istio's in-pod rules for this policy.
    #[must_use]
    pub fn render(&self) -> IptablesRules {
        let mut b = Builder::new(self.ipv6);
        self.build(&mut b);
        IptablesRules {
            v4: restore_text(&b.v4),
            v6: self.ipv6.then(|| restore_text(&b.v6)),
            routes: self.routes(),
        }
    }

    /// What Istio's in-pod rules need besides themselves, whichever writes them: the mark
    /// route.
    #[must_use]
    pub fn routes(&self) -> PolicyRoutes {
        PolicyRoutes {
            mark_route: Some(MarkRoute::ambient(self.ipv6)),
            loopback_addresses: Vec::new(),
        }
    }

    fn build(&self, b: &mut Builder) {
        let ztunnel = format!("{ZTUNNEL_MARK:#x}/{ZTUNNEL_MARK_MASK:#x}");
        let connection = format!("{CONNECTION_MARK:#x}/{CONNECTION_MARK_MASK:#x}");
        let probe = (
            self.host_probe_snat.v4.to_string(),
            self.host_probe_snat.v6.to_string(),
        );
        let probe = (probe.0.as_str(), probe.1.as_str());

        b.append(BOTH, MANGLE, PREROUTING, &format!("-j {ISTIO_PRERT}"));
        b.append(BOTH, MANGLE, OUTPUT, &format!("-j {ISTIO_OUTPUT}"));
        b.append(BOTH, NAT, OUTPUT, &format!("-j {ISTIO_OUTPUT}"));
        if self.dns {
            b.append(BOTH, RAW, PREROUTING, &format!("-j {ISTIO_PRERT}"));
            b.append(BOTH, RAW, OUTPUT, &format!("-j {ISTIO_OUTPUT}"));
        }
        b.append(BOTH, NAT, PREROUTING, &format!("-j {ISTIO_PRERT}"));

        let outbound = ZTUNNEL_OUTBOUND_PORT;
        for name in &self.virtual_interfaces {
            let rule = format!("-i {name} -p tcp -j REDIRECT --to-ports {outbound}");
            b.append(BOTH, NAT, ISTIO_PRERT, &rule);
            b.append(
                BOTH,
                NAT,
                ISTIO_PRERT,
                &format!("-i {name} -p tcp -j RETURN"),
            );
        }
        let rule = format!("-m mark --mark {ztunnel} -j CONNMARK --set-xmark {connection}");
        b.append(BOTH, MANGLE, ISTIO_PRERT, &rule);
        if self.inbound {
            let rule = format!("-s {IP} -p tcp -m tcp -j ACCEPT");
            b.versioned(NAT, ISTIO_PRERT, probe, &rule);
        }
        let rule = format!("-d {IP} -p tcp -m tcp -j ACCEPT");
        b.versioned(NAT, ISTIO_OUTPUT, probe, &rule);
        if self.inbound {
            let rule = format!(
                "! -d {IP} -p tcp ! --dport {ZTUNNEL_INBOUND_PORT} -m mark ! --mark {ztunnel} \
                 -j REDIRECT --to-ports {ZTUNNEL_INBOUND_PLAINTEXT_PORT}"
            );
            b.versioned(NAT, ISTIO_PRERT, HOST_LOOPBACK, &rule);
        }
        let rule = format!(
            "-m connmark --mark {connection} -j CONNMARK --restore-mark \
             --nfmask 0xffffffff --ctmask 0xffffffff"
        );
        b.append(BOTH, MANGLE, ISTIO_OUTPUT, &rule);
        if self.dns {
            let dns = ZTUNNEL_DNS_PORT;
            let rule = format!(
                "! -o lo -p udp -m mark ! --mark {ztunnel} -m udp --dport 53 \
                 -j REDIRECT --to-port {dns}"
            );
            b.append(BOTH, NAT, ISTIO_OUTPUT, &rule);
            let rule = format!(
                "! -d {IP} -p tcp --dport 53 -m mark ! --mark {ztunnel} \
                 -j REDIRECT --to-ports {dns}"
            );
            b.versioned(NAT, ISTIO_OUTPUT, HOST_LOOPBACK, &rule);
            let rule = format!("-p udp -m mark --mark {ztunnel} -m udp --dport 53 -j CT --zone 1");
            b.append(BOTH, RAW, ISTIO_OUTPUT, &rule);
            let rule =
                format!("-p udp -m mark ! --mark {ztunnel} -m udp --sport 53 -j CT --zone 1");
            b.append(BOTH, RAW, ISTIO_PRERT, &rule);
        }
        let rule = format!("-p tcp -m mark --mark {connection} -j ACCEPT");
        b.append(BOTH, NAT, ISTIO_OUTPUT, &rule);
        b.versioned(
            NAT,
            ISTIO_OUTPUT,
            HOST_LOOPBACK,
            &format!("! -d {IP} -o lo -j ACCEPT"),
        );
        let rule = format!(
            "! -d {IP} -p tcp -m mark ! --mark {ztunnel} -j REDIRECT --to-ports {outbound}"
        );
        b.versioned(NAT, ISTIO_OUTPUT, HOST_LOOPBACK, &rule);
    }
}
