//! Istio's node-side nftables rule for ambient mode's kubelet probes
//! (`cni/pkg/nftables/nftables.go`, `CreateHostRulesForHealthChecks`): in the node's network
//! namespace, TCP from kubelet's uid to an address in the probe set is SNAT-ed to the probe
//! address, which the pod's in-pod rules let through to the app uncaptured.

use super::transaction::{Builder, TableSpec, base};
use crate::{
    ambient::HostProbeSnat,
    hostprobe::{PROBE_SET_V4, PROBE_SET_V6},
};

/// The node's table (the in-pod NAT table's name, in the node's namespace).
pub const NODE_TABLE: &str = "istio-ambient-nat";

const POSTROUTING: &str = "postrouting";

const TABLES: [TableSpec; 1] = [TableSpec {
    name: NODE_TABLE,
    chains: &[base(POSTROUTING, "nat", "postrouting", 100)],
}];

impl HostProbeSnat {
    /// Istio's node rules SNAT-ing probes made by `kubelet_uid` to these addresses, IPv6
    /// beside IPv4 when `ipv6`, as `nft -f` input. The probe sets themselves are Istio's
    /// (`host_sets.go`), made apart from this transaction.
    #[must_use]
    pub fn render_nftables(&self, ipv6: bool, kubelet_uid: u32) -> String {
        let mut b = Builder::new(ipv6);
        let rule = |family: &str, set: &str, to: &dyn std::fmt::Display| {
            format!(
                "meta l4proto tcp skuid {kubelet_uid} {family} daddr @{set} counter snat to {to}"
            )
        };
        b.append(NODE_TABLE, POSTROUTING, rule("ip", PROBE_SET_V4, &self.v4));
        b.append_v6(NODE_TABLE, POSTROUTING, rule("ip6", PROBE_SET_V6, &self.v6));
        b.transaction(&TABLES)
    }
}
