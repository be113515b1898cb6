//! The value parsers, with the exact rules of Istio's CNI plugin (Go's `strconv` and
//! `netip` included). Public so that the fuzz target can drive them.

use super::model::{CidrSet, IpPrefix, PrefixParseError};

/// The entry of a list that does not parse, as written.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a valid entry")]
pub struct BadEntry(pub String);

/// Go's `strconv.ParseBool`: `1 t T TRUE true True` and `0 f F FALSE false False`; anything
/// else is `None`.
#[must_use]
pub fn parse_go_bool(value: &str) -> Option<bool> {
    match value {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

/// A port list: the whole value and each entry trimmed, entries separated by `,`, each a
/// decimal number 0-65535 (leading zeros allowed, no sign). All-blank is the empty list; an
/// empty entry (`80,,443`, `80,`) is an error, as in Istio. Returns the offending entry.
pub fn parse_port_list(value: &str) -> Result<Vec<u16>, BadEntry> {
    let value = value.trim();
    if value.is_empty() {
        return Ok(Vec::new());
    }
    value
        .split(',')
        .map(|entry| parse_port(entry).ok_or_else(|| BadEntry(entry.to_owned())))
        .collect()
}

fn parse_port(entry: &str) -> Option<u16> {
    let digits = entry.trim();
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// A CIDR list: entries separated by `,`, each parsed as Go's `netip.ParsePrefix` does (no
/// surrounding spaces, no empty entries), split per family in order. The empty value is the
/// empty set. Returns the offending entry and why.
pub fn parse_cidr_list(value: &str) -> Result<CidrSet, (String, PrefixParseError)> {
    let mut set = CidrSet::default();
    if value.is_empty() {
        return Ok(set);
    }
    for entry in value.split(',') {
        let prefix: IpPrefix = entry.parse().map_err(|err| (entry.to_owned(), err))?;
        match prefix.family() {
            super::Family::V4 => set.v4.push(prefix),
            super::Family::V6 => set.v6.push(prefix),
        }
    }
    Ok(set)
}

/// An interface list (`excludeInterfaces`, `reroute-virtual-interfaces`,
/// `kubevirtInterfaces`): entries separated by `,` and trimmed; each must be a Linux interface
/// name (a letter, then letters, digits, `_`, `.`, `-`; at most 15 bytes), as Istio's
/// `ValidateInterfaceNames` (pkg/util/net/ip.go, Istio ≥ 1.30) requires of all three. The
/// empty value is the empty list; a blank entry is an error. Returns the offending entry.
pub fn parse_interface_list(value: &str) -> Result<Vec<String>, BadEntry> {
    if value.is_empty() {
        return Ok(Vec::new());
    }
    value
        .split(',')
        .map(|entry| {
            let name = entry.trim();
            is_interface_name(name)
                .then(|| name.to_owned())
                .ok_or_else(|| BadEntry(entry.to_owned()))
        })
        .collect()
}

/// Ambient's reading of `istio.io/reroute-virtual-interfaces` (Istio's node agent,
/// `getPodLevelTrafficOverrides`): entries separated by `,` and trimmed, blank entries
/// skipped. Each name must still be an interface name (meshcap's check: Istio writes any
/// string into `-i`, and `iptables-restore` then fails the pod). Returns the offending entry.
pub fn parse_ambient_interface_list(value: &str) -> Result<Vec<String>, BadEntry> {
    value
        .split(',')
        .map(str::trim)
        .filter(|name| !name.is_empty())
        .map(|name| {
            is_interface_name(name)
                .then(|| name.to_owned())
                .ok_or_else(|| BadEntry(name.to_owned()))
        })
        .collect()
}

fn is_interface_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    name.len() <= 15
        && bytes.next().is_some_and(|b| b.is_ascii_alphabetic())
        && bytes.all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_bool() {
        assert_eq!(parse_go_bool("True"), Some(true));
        assert_eq!(parse_go_bool("0"), Some(false));
        assert_eq!(parse_go_bool("yes"), None);
        assert_eq!(parse_go_bool(" true"), None);
    }

    #[test]
    fn ports() {
        assert_eq!(parse_port_list(" 80 , 0443 "), Ok(vec![80, 443]));
        assert_eq!(parse_port_list("   "), Ok(vec![]));
        assert_eq!(parse_port_list("80,"), Err(BadEntry(String::new())));
        assert_eq!(parse_port_list("65536"), Err(BadEntry("65536".to_owned())));
        assert_eq!(parse_port_list("+80"), Err(BadEntry("+80".to_owned())));
        assert_eq!(parse_port_list("0"), Ok(vec![0]));
    }

    #[test]
    fn cidrs() {
        let set = parse_cidr_list("10.0.0.1/8,fd00::/8,127.0.0.0/8").unwrap();
        assert_eq!(set.v4.len(), 2);
        assert_eq!(set.v6.len(), 1);
        assert_eq!(set.v4[0].to_string(), "10.0.0.1/8");
        assert!(set.has_loopback());
        assert!(parse_cidr_list(" 10.0.0.0/8").is_err());
        assert!(parse_cidr_list("10.0.0.0/8,").is_err());
        assert!(parse_cidr_list("10.0.0.0/08").is_err());
        assert!(parse_cidr_list("10.0.0.0/33").is_err());
        assert!(parse_cidr_list("010.0.0.0/8").is_err());
        assert!(parse_cidr_list("fe80::1%eth0/64").is_err());
        assert!(parse_cidr_list("10.0.0.0").is_err());
    }

    #[test]
    fn interfaces() {
        assert_eq!(
            parse_interface_list("eth1, net-2"),
            Ok(vec!["eth1".into(), "net-2".into()])
        );
        assert!(parse_interface_list("eth1,").is_err());
        assert!(parse_interface_list("1eth").is_err());
        assert!(parse_interface_list("abcdefghijklmnop").is_err());
        assert_eq!(
            parse_interface_list("eth1,,eth2"),
            Err(BadEntry(String::new()))
        );
        assert!(parse_interface_list("eth 1").is_err());
    }

    #[test]
    fn ambient_interfaces() {
        assert_eq!(
            parse_ambient_interface_list(" eth1,, net-2 ,"),
            Ok(vec!["eth1".into(), "net-2".into()])
        );
        assert_eq!(parse_ambient_interface_list(" "), Ok(vec![]));
        assert_eq!(
            parse_ambient_interface_list("eth1,1eth"),
            Err(BadEntry("1eth".into()))
        );
    }
}
