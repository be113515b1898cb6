//! Addresses as Istio's CNI plugin reads them: families, prefixes (Go's `netip.ParsePrefix`,
//! the address kept as written), sets of them per family, and `includeOutboundIPRanges`.
use std::{fmt, net::IpAddr, str::FromStr};

use serde::{Deserialize, Serialize};

/// IPv4 or IPv6: Istio writes one rule set per family (iptables / ip6tables).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// IPv4.
    V4,
    /// IPv6.
    V6,
}

impl Family {
    /// The family of an address.
    #[must_use]
    pub fn of(addr: IpAddr) -> Self {
        match addr {
            IpAddr::V4(_) => Self::V4,
            IpAddr::V6(_) => Self::V6,
        }
    }
}

/// An address prefix as Istio parses it (Go's `netip.ParsePrefix`): the address is kept as
/// written (`10.0.0.1/8` stays `10.0.0.1/8` in the rules), matching uses the masked bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct IpPrefix {
    addr: IpAddr,
    len: u8,
}

impl IpPrefix {
    /// A prefix, or `None` when `len` is longer than the address.
    #[must_use]
    pub fn new(addr: IpAddr, len: u8) -> Option<Self> {
        let max = match addr {
            IpAddr::V4(_) => 32,
            IpAddr::V6(_) => 128,
        };
        (len <= max).then_some(Self { addr, len })
    }

    /// The address as written.
    #[must_use]
    pub fn addr(&self) -> IpAddr {
        self.addr
    }

    /// The prefix length in bits.
    #[must_use]
    pub fn len(&self) -> u8 {
        self.len
    }

    /// Whether this is a zero-length prefix (matches every address of its family).
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address family.
    #[must_use]
    pub fn family(&self) -> Family {
        Family::of(self.addr)
    }

    /// Whether Istio counts this range as loopback: its address (not the whole range) is a
    /// loopback address (`127.0.0.0/8` yes, `0.0.0.0/0` no).
    #[must_use]
    pub fn is_loopback(&self) -> bool {
        // As Go's `netip.Addr.IsLoopback`, which Istio calls: an IPv4-mapped IPv6 address is
        // loopback when its IPv4 address is.
        self.addr.to_canonical().is_loopback()
    }

    /// Whether `ip` is in the range. Addresses of the other family never are.
    #[must_use]
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(self.len)).unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.len))
                    .unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

impl fmt::Display for IpPrefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

/// Why a string is not a prefix.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PrefixParseError {
    /// No `/bits`.
    #[error("no \"/\" with a prefix length")]
    NoSlash,
    /// The address part does not parse (zones such as `%eth0` are refused, as Go does).
    #[error("bad address")]
    BadAddress,
    /// The length is not plain decimal (no sign, no leading zero) or too long for the family.
    #[error("bad prefix length")]
    BadLength,
}

impl FromStr for IpPrefix {
    type Err = PrefixParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (addr, bits) = s.rsplit_once('/').ok_or(PrefixParseError::NoSlash)?;
        let addr: IpAddr = addr.parse().map_err(|_| PrefixParseError::BadAddress)?;
        let plain_decimal = !bits.is_empty()
            && bits.len() <= 3
            && bits.bytes().all(|b| b.is_ascii_digit())
            && !(bits.len() > 1 && bits.starts_with('0'));
        if !plain_decimal {
            return Err(PrefixParseError::BadLength);
        }
        let len: u8 = bits.parse().map_err(|_| PrefixParseError::BadLength)?;
        Self::new(addr, len).ok_or(PrefixParseError::BadLength)
    }
}

impl Serialize for IpPrefix {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for IpPrefix {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// CIDRs split per family, each in annotation order (Istio's `SeparateV4V6`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CidrSet {
    /// The IPv4 prefixes (rendered into iptables).
    pub v4: Vec<IpPrefix>,
    /// The IPv6 prefixes (rendered into ip6tables).
    pub v6: Vec<IpPrefix>,
}

impl CidrSet {
    /// The prefixes of one family.
    #[must_use]
    pub fn family(&self, family: Family) -> &[IpPrefix] {
        match family {
            Family::V4 => &self.v4,
            Family::V6 => &self.v6,
        }
    }

    /// Whether any prefix of `ip`'s family contains it.
    #[must_use]
    pub fn contains(&self, ip: IpAddr) -> bool {
        self.family(Family::of(ip)).iter().any(|p| p.contains(ip))
    }

    /// Whether the set has no prefix at all.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.v4.is_empty() && self.v6.is_empty()
    }

    /// Whether any prefix (of either family) is a loopback range.
    #[must_use]
    pub fn has_loopback(&self) -> bool {
        self.v4.iter().chain(&self.v6).any(IpPrefix::is_loopback)
    }
}

/// `includeOutboundIPRanges`: `*`, or a list (an empty list captures nothing). A list of one
/// family only installs no outbound capture at all for the other family.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IpRanges {
    /// `*`: every destination (default).
    All,
    /// These ranges only.
    Cidrs(CidrSet),
}

impl IpRanges {
    /// Whether `ip` is captured by the include list.
    #[must_use]
    pub fn contains(&self, ip: IpAddr) -> bool {
        match self {
            Self::All => true,
            Self::Cidrs(set) => set.contains(ip),
        }
    }

    /// Whether the list names a loopback range, which keeps the app's own loopback traffic in
    /// the capture path (Istio then drops its `-o lo ! --uid-owner … RETURN` rules).
    #[must_use]
    pub fn has_loopback(&self) -> bool {
        matches!(self, Self::Cidrs(set) if set.has_loopback())
    }
}
