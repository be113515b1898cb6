//! Parsing one rule of `iptables-restore` input into its matches and target: exactly the
//! matches and targets Istio's rules use, anything else an error.
use std::net::IpAddr;

use super::super::{
    model::IpPrefix,
    packet::{CtState, Protocol},
};

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

pub(super) fn parse_rule(text: &str, words: &[&str]) -> Result<Rule, String> {
    let mut matches = Vec::new();
    let mut target = None;
    let mut words = words.iter().copied().peekable();
    let mut module = "";
    while let Some(word) = words.next() {
        let negated = word == "!";
        let option = if negated {
            words.next().ok_or("\"!\" at the end")?
        } else {
            word
        };
        let mut value = || {
            words
                .next()
                .ok_or_else(|| format!("{option} needs a value"))
        };
        let parsed = match option {
            "-p" => Match::Protocol(match value()? {
                "tcp" => Protocol::Tcp,
                "udp" => Protocol::Udp,
                other => return Err(format!("protocol {other}")),
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
                    return Err(format!("match module {module}"));
                }
                continue;
            }
            "-j" if !negated => {
                target = Some(parse_target(value()?, &mut words)?);
                continue;
            }
            other => return Err(format!("option {other}")),
        };
        matches.push((negated, parsed));
    }
    let target = target.ok_or("no target")?;
    Ok(Rule {
        text: text.to_owned(),
        matches,
        target,
    })
}

fn parse_target<'a>(
    name: &str,
    words: &mut impl Iterator<Item = &'a str>,
) -> Result<Target, String> {
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
        (other, _) => return Err(format!("target {other} {}", args.join(" "))),
    })
}

fn prefix(text: &str) -> Result<IpPrefix, String> {
    if let Ok(prefix) = text.parse() {
        return Ok(prefix);
    }
    let addr: IpAddr = text.parse().map_err(|_| format!("address {text}"))?;
    let len = if addr.is_ipv4() { 32 } else { 128 };
    IpPrefix::new(addr, len).ok_or_else(|| format!("address {text}"))
}

fn port(text: &str) -> Result<u16, String> {
    text.parse().map_err(|_| format!("port {text}"))
}

fn number(text: &str) -> Result<u32, String> {
    match text.strip_prefix("0x") {
        Some(hex) => u32::from_str_radix(hex, 16),
        None => text.parse(),
    }
    .map_err(|_| format!("number {text}"))
}

fn mark(text: &str) -> Result<(u32, u32), String> {
    match text.split_once('/') {
        Some((value, mask)) => Ok((number(value)?, number(mask)?)),
        None => Ok((number(text)?, u32::MAX)),
    }
}

fn ct_state(text: &str) -> Result<CtState, String> {
    match text {
        "NEW" => Ok(CtState::New),
        "ESTABLISHED" => Ok(CtState::Established),
        "RELATED" => Ok(CtState::Related),
        "INVALID" => Ok(CtState::Invalid),
        other => Err(format!("conntrack state {other}")),
    }
}
