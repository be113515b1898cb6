//! Istio's node-side rules for ambient mode's kubelet probes (`cni/pkg/iptables/iptables.go`,
//! `AppendHostRules`): in the node's network namespace, TCP from a local socket (kubelet's
//! probes, not traffic the node forwards) to an address in the probe set is SNAT-ed to the
//! probe address, which the pod's in-pod rules let through to the app uncaptured.

use super::{
    IptablesRules, NAT,
    builder::{BOTH, Builder, V4, V6, restore_text},
};
use crate::{PolicyRoutes, ambient::HostProbeSnat};

/// The node's chain, jumped to first from `nat POSTROUTING`.
pub const ISTIO_POSTRT: &str = "ISTIO_POSTRT";
/// The set of enrolled pods' IPv4 addresses (Istio's `istio-inpod-probes` with its `-v4`).
pub const PROBE_SET_V4: &str = "istio-inpod-probes-v4";
/// The set of enrolled pods' IPv6 addresses.
pub const PROBE_SET_V6: &str = "istio-inpod-probes-v6";

const POSTROUTING: &str = "POSTROUTING";

impl HostProbeSnat {
    /// Istio's node rules SNAT-ing probes to these addresses, IPv6 beside IPv4 when `ipv6`.
    #[must_use]
    pub fn render(&self, ipv6: bool) -> IptablesRules {
        let mut b = Builder::new(ipv6);
        b.insert(BOTH, NAT, POSTROUTING, 1, &format!("-j {ISTIO_POSTRT}"));
        let rule = |set: &str, to: &str| {
            format!(
                "-m owner --socket-exists -p tcp -m set --match-set {set} dst -j SNAT --to-source {to}"
            )
        };
        b.append(
            V4,
            NAT,
            ISTIO_POSTRT,
            &rule(PROBE_SET_V4, &self.v4.to_string()),
        );
        b.append(
            V6,
            NAT,
            ISTIO_POSTRT,
            &rule(PROBE_SET_V6, &self.v6.to_string()),
        );
        IptablesRules {
            v4: restore_text(&b.v4),
            v6: ipv6.then(|| restore_text(&b.v6)),
            routes: PolicyRoutes::default(),
        }
    }
}
