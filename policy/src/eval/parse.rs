//! Parsing one rule of `iptables-restore` input into its matches and target: exactly the
//! matches and targets Istio's rules use, anything else an error.
use std::net::IpAddr;

use super::super::{
    model::IpPrefix,
    packet::{CtState, Protocol},
};

/// What of a rule the evaluator does not read: only the matches and targets Istio's rules use
/// are.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub(super) enum Unsupported {
    /// A `!` with nothing after it.
    #[error("\"!\" at the end")]
    DanglingNot,
    /// An option without its value.
    #[error("{0} needs a value")]
    NoValue(String),
    /// A protocol other than TCP and UDP.
    #[error("protocol {0}")]
    Protocol(String),
    /// A match module Istio's rules do not use.
    #[error("match module {0}")]
    Module(String),
    /// An option Istio's rules do not use.
    #[error("option {0}")]
    Option(String),
    /// A rule without `-j`.
    #[error("no target")]
    NoTarget,
    /// A target Istio's rules do not use, with its arguments.
    #[error("target {0}")]
    Target(String),
    /// An address or prefix that does not parse.
    #[error("address {0}")]
    Address(String),
    /// A port that does not parse.
    #[error("port {0}")]
    Port(String),
    /// A number that does not parse.
    #[error("number {0}")]
    Number(String),
    /// A conntrack state Istio's rules do not use.
    #[error("conntrack state {0}")]
    CtState(String),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Rule {
    pub(super) text: String,
    pub(super) matches: Vec<(bool, Match)>,
    pub(super) target: Target,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Match {
    Protocol(Protocol),
    Source(IpPrefix),
    Destination(IpPrefix),
    InInterface(String),
    OutInterface(String),
    DestinationPort(u16),
    SourcePort(u16),
    DestinationPorts(Vec<u16>),
    UidOwner(u32),
    GidOwner(u32),
    CtState(Vec<CtState>),
    Mark(u32, u32),
    ConnMark(u32, u32),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Target {
    Return,
    Accept,
    Drop,
    Jump(String),
    Redirect(u16),
    Tproxy {
        port: u16,
        mark: u32,
        mask: u32,
    },
    SetMark(u32),
    /// `CONNMARK --set-xmark value/mask`: the connection mark's masked bits cleared, then
    /// `value` XORed in.
    SetConnMark {
        value: u32,
        mask: u32,
    },
    SaveMark,
    RestoreMark,
    ConntrackZone,
}

pub(super) fn parse_rule(text: &str, words: &[&str]) -> Result<Rule, Unsupported> {
    let mut matches = Vec::new();
    let mut target = None;
    let mut words = words.iter().copied().peekable();
    let mut module = "";
    while let Some(word) = words.next() {
        let negated = word == "!";
        let option = if negated {
            words.next().ok_or(Unsupported::DanglingNot)?
        } else {
            word
        };
        let mut value = || {
            words
                .next()
                .ok_or_else(|| Unsupported::NoValue(option.to_owned()))
        };
        let parsed = match option {
            "-p" => Match::Protocol(match value()? {
                "tcp" => Protocol::Tcp,
                "udp" => Protocol::Udp,
                other => return Err(Unsupported::Protocol(other.to_owned())),
            }),
            "-s" => Match::Source(prefix(value()?)?),
            "-d" => Match::Destination(prefix(value()?)?),
            "-i" => Match::InInterface(value()?.to_owned()),
            "-o" => Match::OutInterface(value()?.to_owned()),
            "--dport" => Match::DestinationPort(port(value()?)?),
            "--sport" => Match::SourcePort(port(value()?)?),
            "--dports" if module == "multiport" => {
                Match::DestinationPorts(value()?.split(',').map(port).collect::<Result<_, _>>()?)
            }
            "--uid-owner" if module == "owner" => Match::UidOwner(number(value()?)?),
            "--gid-owner" if module == "owner" => Match::GidOwner(number(value()?)?),
            "--ctstate" if module == "conntrack" => Match::CtState(
                value()?
                    .split(',')
                    .map(ct_state)
                    .collect::<Result<_, _>>()?,
            ),
            "--mark" if module == "mark" => {
                let (mark, mask) = mark(value()?)?;
                Match::Mark(mark, mask)
            }
            "--mark" if module == "connmark" => {
                let (mark, mask) = mark(value()?)?;
                Match::ConnMark(mark, mask)
            }
            "-m" if !negated => {
                module = value()?;
                if !matches!(
                    module,
                    "multiport" | "owner" | "conntrack" | "mark" | "connmark" | "tcp" | "udp"
                ) {
                    return Err(Unsupported::Module(module.to_owned()));
                }
                continue;
            }
            "-j" if !negated => {
                target = Some(parse_target(value()?, &mut words)?);
                continue;
            }
            other => return Err(Unsupported::Option(other.to_owned())),
        };
        matches.push((negated, parsed));
    }
    let target = target.ok_or(Unsupported::NoTarget)?;
    Ok(Rule {
        text: text.to_owned(),
        matches,
        target,
    })
}

fn parse_target<'a>(
    name: &str,
    words: &mut impl Iterator<Item = &'a str>,
) -> Result<Target, Unsupported> {
    let args: Vec<&str> = words.collect();
    Ok(match (name, args.as_slice()) {
        ("RETURN", []) => Target::Return,
        ("ACCEPT", []) => Target::Accept,
        ("DROP", []) => Target::Drop,
        ("REDIRECT", ["--to-ports" | "--to-port", to]) => Target::Redirect(port(to)?),
        ("TPROXY", ["--tproxy-mark", tproxy_mark, "--on-port", on]) => {
            let (mark, mask) = mark(tproxy_mark)?;
            Target::Tproxy {
                port: port(on)?,
                mark,
                mask,
            }
        }
        ("MARK", ["--set-mark", value]) => Target::SetMark(number(value)?),
        ("CONNMARK", ["--save-mark"]) => Target::SaveMark,
        ("CONNMARK", ["--restore-mark"]) => Target::RestoreMark,
        ("CONNMARK", ["--restore-mark", "--nfmask", nfmask, "--ctmask", ctmask])
            if number(nfmask)? == u32::MAX && number(ctmask)? == u32::MAX =>
        {
            Target::RestoreMark
        }
        ("CONNMARK", ["--set-xmark", value]) => {
            let (value, mask) = mark(value)?;
            Target::SetConnMark { value, mask }
        }
        ("CT", ["--zone", zone]) => {
            number(zone)?;
            Target::ConntrackZone
        }
        (chain, []) if chain.starts_with("ISTIO_") => Target::Jump(chain.to_owned()),
        (other, _) => {
            return Err(Unsupported::Target(format!("{other} {}", args.join(" "))));
        }
    })
}

fn prefix(text: &str) -> Result<IpPrefix, Unsupported> {
    if let Ok(prefix) = text.parse() {
        return Ok(prefix);
    }
    let bad = || Unsupported::Address(text.to_owned());
    let addr: IpAddr = text.parse().map_err(|_| bad())?;
    let len = if addr.is_ipv4() { 32 } else { 128 };
    IpPrefix::new(addr, len).ok_or_else(bad)
}

fn port(text: &str) -> Result<u16, Unsupported> {
    text.parse().map_err(|_| Unsupported::Port(text.to_owned()))
}

fn number(text: &str) -> Result<u32, Unsupported> {
    match text.strip_prefix("0x") {
        Some(hex) => u32::from_str_radix(hex, 16),
        None => text.parse(),
    }
    .map_err(|_| Unsupported::Number(text.to_owned()))
}

fn mark(text: &str) -> Result<(u32, u32), Unsupported> {
    match text.split_once('/') {
        Some((value, mask)) => Ok((number(value)?, number(mask)?)),
        None => Ok((number(text)?, u32::MAX)),
    }
}

fn ct_state(text: &str) -> Result<CtState, Unsupported> {
    match text {
        "NEW" => Ok(CtState::New),
        "ESTABLISHED" => Ok(CtState::Established),
        "RELATED" => Ok(CtState::Related),
        "INVALID" => Ok(CtState::Invalid),
        other => Err(Unsupported::CtState(other.to_owned())),
    }
}
