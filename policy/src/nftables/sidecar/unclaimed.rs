//! meshcap's one addition to Istio's sidecar nftables rules: in `TPROXY` mode, a new inbound
//! connection no proxy socket claims is dropped, as Istio's iptables rules drop it.
//!
//! Istio's `istio-tproxy` chain holds one rule per family, `... tproxy ip to :15006 meta mark
//! set 1337 counter accept`. iptables' `TPROXY` target drops a packet for which it finds no
//! transparent socket (`net/netfilter/xt_TPROXY.c`, `tproxy_tg4`/`tproxy_tg6_v1`: `NF_DROP`);
//! nft's `tproxy` statement only ends its rule (`net/netfilter/nft_tproxy.c`,
//! `nft_tproxy_eval_v4`: `NFT_BREAK`), so with Istio's nft rules alone the SYN falls through
//! the chain and reaches the app on the port dialled, past its sidecar, for as long as the
//! proxy is not listening (starting, or crashed). One rule per family after Istio's, matching
//! exactly what its `tproxy` rule matched, drops what the `tproxy` did not take: the pod
//! answers as under iptables (the client times out), and nothing reaches the app uncaptured.
//! [`RedirectPolicy::render_nftables`] stays Istio's transaction, golden for golden; the
//! backend applies [`RedirectPolicy::render_nftables_applied`].
use std::fmt::Write as _;

use super::{MANGLE_TABLE, SidecarCapture, TPROXY};
use crate::model::{InterceptionMode, RedirectPolicy};

impl RedirectPolicy {
    /// What meshcap's nftables backend applies to the pod: Istio's transaction
    /// ([`Self::render_nftables`]) and, in `TPROXY` mode with inbound capture, the rules
    /// dropping the connections its `tproxy` rules leave unclaimed.
    #[must_use]
    pub fn render_nftables_applied(&self) -> String {
        let mut transaction = self.render_nftables();
        if self.mode != InterceptionMode::Tproxy || self.include_inbound_ports.is_none() {
            return transaction;
        }
        let loopback = SidecarCapture::from(self).host_loopback_v4;
        let mut rules = vec![format!(
            "meta l4proto tcp ip daddr != {loopback} counter drop"
        )];
        if self.ipv6 {
            rules.push("meta l4proto tcp ip6 daddr != ::1/128 counter drop".to_owned());
        }
        for rule in rules {
            let _ = writeln!(transaction, "add rule inet {MANGLE_TABLE} {TPROXY} {rule}");
        }
        transaction
    }
}
