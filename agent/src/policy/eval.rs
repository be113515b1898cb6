//! An evaluator of rendered rules: it parses `iptables-restore` input and walks the chains the
//! way netfilter does, so it knows nothing of the policy that produced the rules. It is the
//! oracle the eBPF decision and [`super::RedirectPolicy::decide`] are checked against.
//!
//! It understands exactly the matches and targets Istio's rules use; anything else is a parse
//! error rather than a guess. Listeners are assumed present (TPROXY finds its socket).

use std::{collections::BTreeMap, net::IpAddr};

use super::{
    iptables::IptablesRules,
    model::{Family, IpPrefix},
    packet::{CtState, Direction, Outcome, Packet, Protocol, Verdict},
};

/// Rendered rules that do not parse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {text:?}: {reason}")]
pub struct RuleParseError {
    /// 1-based line number.
    pub line: usize,
    /// The line.
    pub text: String,
    /// What is wrong.
    pub reason: String,
}

/// The rules of both families, ready to evaluate packets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleEvaluator {
    v4: RuleSet,
    v6: Option<RuleSet>,
}

impl RuleEvaluator {
    /// Parses both families' restore input.
    ///
    /// # Errors
    /// A line the evaluator does not understand.
    pub fn new(rules: &IptablesRules) -> Result<Self, RuleParseError> {
        Ok(Self {
            v4: RuleSet::parse(&rules.v4)?,
            v6: rules.v6.as_deref().map(RuleSet::parse).transpose()?,
        })
    }

    /// What the rules do to `packet` (no rules for its family: it passes untouched).
    #[must_use]
    pub fn evaluate(&self, packet: &Packet) -> Outcome {
        self.trace(packet).outcome
    }

    /// [`Self::evaluate`], with the rules that matched on the way.
    #[must_use]
    pub fn trace(&self, packet: &Packet) -> Trace {
        match (packet.family(), &self.v6) {
            (Family::V4, _) => self.v4.trace(packet),
            (Family::V6, Some(v6)) => v6.trace(packet),
            (Family::V6, None) => Trace {
                outcome: Outcome {
                    verdict: Verdict::Pass,
                    mark: packet.mark,
                },
                matched: Vec::new(),
            },
        }
    }
}

/// An outcome and how the rules got there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Trace {
    /// The outcome.
    pub outcome: Outcome,
    /// `table: rule` for every rule that matched, in order.
    pub matched: Vec<String>,
}

/// One family's tables, parsed from `iptables-restore` input.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RuleSet {
    /// table → chain → rules in order (after every `-A`/`-I` was applied).
    tables: BTreeMap<String, BTreeMap<String, Vec<Rule>>>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Rule {
    text: String,
    matches: Vec<(bool, Match)>,
    target: Target,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Match {
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
enum Target {
    Return,
    Accept,
    Drop,
    Jump(String),
    Redirect(u16),
    Tproxy { port: u16, mark: u32, mask: u32 },
    SetMark(u32),
    SaveMark,
    RestoreMark,
    ConntrackZone,
}

/// What a chain walk ended with.
enum Flow {
    /// Fell off the end or hit RETURN.
    Continue,
    /// A terminating target.
    Stop(Verdict),
}

impl RuleSet {
    /// Parses `iptables-restore` input (`*table`, `:CHAIN`, `-N`, `-A`, `-I`, `COMMIT`).
    ///
    /// # Errors
    /// A line (or a match or target in it) the evaluator does not understand.
    pub fn parse(text: &str) -> Result<Self, RuleParseError> {
        let mut set = Self::default();
        let mut table: Option<String> = None;
        for (index, line) in text.lines().enumerate() {
            let fail = |reason: &str| RuleParseError {
                line: index + 1,
                text: line.to_owned(),
                reason: reason.to_owned(),
            };
            let words: Vec<&str> = line.split_whitespace().collect();
            match words.as_slice() {
                [] => {}
                [comment, ..] if comment.starts_with('#') => {}
                ["*", name] => table = Some((*name).to_owned()),
                [name] if name.starts_with('*') => table = Some(name[1..].to_owned()),
                ["COMMIT"] => table = None,
                [command, chain, rest @ ..] => {
                    let table = table.as_ref().ok_or_else(|| fail("outside a table"))?;
                    let chains = set.tables.entry(table.clone()).or_default();
                    match *command {
                        "-N" if rest.is_empty() => {
                            chains.entry((*chain).to_owned()).or_default();
                        }
                        "-A" => {
                            let rule = parse_rule(line, rest).map_err(|reason| fail(&reason))?;
                            chains.entry((*chain).to_owned()).or_default().push(rule);
                        }
                        "-I" => {
                            let (position, rest) =
                                rest.split_first().ok_or_else(|| fail("no position"))?;
                            let position: usize =
                                position.parse().map_err(|_| fail("bad position"))?;
                            let rule = parse_rule(line, rest).map_err(|reason| fail(&reason))?;
                            let rules = chains.entry((*chain).to_owned()).or_default();
                            if position == 0 || position > rules.len() + 1 {
                                return Err(fail("position out of range"));
                            }
                            rules.insert(position - 1, rule);
                        }
                        _ => return Err(fail("unknown command")),
                    }
                }
                [declaration] if declaration.starts_with(':') => {}
                _ => return Err(fail("unknown line")),
            }
        }
        Ok(set)
    }

    /// What these rules do to `packet` (which must be of this rule set's family).
    #[must_use]
    pub fn evaluate(&self, packet: &Packet) -> Outcome {
        self.trace(packet).outcome
    }

    /// [`Self::evaluate`], with the rules that matched.
    #[must_use]
    pub fn trace(&self, packet: &Packet) -> Trace {
        let mut walk = Walk {
            packet,
            mark: packet.mark,
            ct_mark: packet.ct_mark,
            matched: Vec::new(),
        };
        let hook = match packet.direction {
            Direction::Outbound => "OUTPUT",
            Direction::Inbound => "PREROUTING",
        };
        // NAT rules are consulted for a connection's first packet only, and not again when a
        // locally sent packet loops back in over lo.
        let nat = packet.ct_state == CtState::New
            && !(packet.direction == Direction::Inbound && packet.interface == "lo");
        let mut verdict = Verdict::Pass;
        for table in ["raw", "mangle", "nat", "filter"] {
            if table == "nat" && !nat {
                continue;
            }
            match self.walk(table, hook, &mut walk, 0) {
                Flow::Stop(Verdict::Drop) => {
                    verdict = Verdict::Drop;
                    break;
                }
                Flow::Stop(found @ (Verdict::Redirect(_) | Verdict::Tproxy(_)))
                    if verdict == Verdict::Pass =>
                {
                    verdict = found
                }
                Flow::Stop(_) | Flow::Continue => {}
            }
        }
        Trace {
            outcome: Outcome {
                verdict,
                mark: walk.mark,
            },
            matched: walk.matched,
        }
    }

    fn walk(&self, table: &str, chain: &str, walk: &mut Walk<'_>, depth: usize) -> Flow {
        let Some(rules) = self.tables.get(table).and_then(|chains| chains.get(chain)) else {
            return Flow::Continue;
        };
        if depth > 32 {
            return Flow::Continue;
        }
        for rule in rules {
            if !rule
                .matches
                .iter()
                .all(|(negated, m)| walk.matches(m) != *negated)
            {
                continue;
            }
            walk.matched.push(format!("{table}: {}", rule.text));
            match &rule.target {
                Target::Return => return Flow::Continue,
                Target::Accept => return Flow::Stop(Verdict::Pass),
                Target::Drop => return Flow::Stop(Verdict::Drop),
                Target::Redirect(port) => return Flow::Stop(Verdict::Redirect(*port)),
                Target::Tproxy { port, mark, mask } => {
                    walk.mark = (walk.mark & !mask) ^ mark;
                    return Flow::Stop(Verdict::Tproxy(*port));
                }
                Target::SetMark(mark) => walk.mark = *mark,
                Target::SaveMark => walk.ct_mark = walk.mark,
                Target::RestoreMark => walk.mark = walk.ct_mark,
                Target::ConntrackZone => {}
                Target::Jump(target) => {
                    if let Flow::Stop(verdict) = self.walk(table, target, walk, depth + 1) {
                        return Flow::Stop(verdict);
                    }
                }
            }
        }
        // Falling off a built-in chain applies its policy (ACCEPT in a pod netns): the next
        // table runs, as after a RETURN.
        Flow::Continue
    }
}

struct Walk<'a> {
    packet: &'a Packet,
    mark: u32,
    ct_mark: u32,
    matched: Vec<String>,
}

impl Walk<'_> {
    fn matches(&self, m: &Match) -> bool {
        let p = self.packet;
        let outbound = p.direction == Direction::Outbound;
        match m {
            Match::Protocol(protocol) => p.protocol == *protocol,
            Match::Source(prefix) => prefix.contains(p.src),
            Match::Destination(prefix) => prefix.contains(p.dst),
            Match::InInterface(name) => !outbound && interface_matches(name, &p.interface),
            Match::OutInterface(name) => outbound && interface_matches(name, &p.interface),
            Match::DestinationPort(port) => p.dst_port == *port,
            // Istio's rules only match source ports on the proxy's DNS replies; packets here
            // are requests, so none has a source port of interest.
            Match::SourcePort(_) => false,
            Match::DestinationPorts(ports) => ports.contains(&p.dst_port),
            Match::UidOwner(uid) => outbound && p.uid == *uid,
            Match::GidOwner(gid) => outbound && p.gid == *gid,
            Match::CtState(states) => states.contains(&p.ct_state),
            Match::Mark(value, mask) => self.mark & mask == *value,
            Match::ConnMark(value, mask) => self.ct_mark & mask == *value,
        }
    }
}

/// iptables interface names: exact, or a prefix when ending in `+`.
fn interface_matches(pattern: &str, name: &str) -> bool {
    match pattern.strip_suffix('+') {
        Some(prefix) => name.starts_with(prefix),
        None => pattern == name,
    }
}

fn parse_rule(text: &str, words: &[&str]) -> Result<Rule, String> {
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
                    "multiport" | "owner" | "conntrack" | "mark" | "connmark"
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
