//! Which iptables a pod's rules are written with, chosen as Istio chooses
//! (`tools/istio-iptables/pkg/dependencies`): legacy when `iptables-legacy-save` already shows
//! rules in the pod's netns, else nft when `iptables-nft-save` works, else plain `iptables`.
use serde::{Deserialize, Serialize};

/// Which iptables to use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum FlavourChoice {
    /// Istio's detection, per pod netns.
    #[default]
    Auto,
    /// `iptables-legacy`.
    Legacy,
    /// `iptables-nft`.
    Nft,
}

/// The iptables implementation used for a pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Flavour {
    /// x_tables (`iptables-legacy*`).
    Legacy,
    /// nf_tables (`iptables-nft*`).
    Nft,
    /// Whatever `iptables*` is on this host.
    Plain,
}

impl Flavour {
    fn suffix(self) -> &'static str {
        match self {
            Self::Legacy => "-legacy",
            Self::Nft => "-nft",
            Self::Plain => "",
        }
    }

    /// `iptables…`/`ip6tables…` followed by `tail` (`-restore`, `-save` or nothing).
    pub(in crate::backend) fn binary(self, ipv6: bool, tail: &str) -> String {
        let base = if ipv6 { "ip6tables" } else { "iptables" };
        format!("{base}{}{tail}", self.suffix())
    }
}
