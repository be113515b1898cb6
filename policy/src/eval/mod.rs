//! An evaluator of rendered rules: it parses `iptables-restore` input and walks the chains the
//! way netfilter does, so it knows nothing of the policy that produced the rules. It is the
//! oracle the eBPF decision and [`super::RedirectPolicy::decide`] are checked against.
//!
//! It understands exactly the matches and targets Istio's rules use; anything else is a parse
//! error rather than a guess. Listeners are assumed present (TPROXY finds its socket).

use std::collections::BTreeMap;

mod parse;

use parse::{Match, Rule, Target, parse_rule};

use super::{
    iptables::IptablesRules,
    model::Family,
    packet::{CtState, Direction, Outcome, Packet, Verdict},
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
                            let rule = parse_rule(line, rest)
                                .map_err(|reason| fail(&reason.to_string()))?;
                            chains.entry((*chain).to_owned()).or_default().push(rule);
                        }
                        "-I" => {
                            let (position, rest) =
                                rest.split_first().ok_or_else(|| fail("no position"))?;
                            let position: usize =
                                position.parse().map_err(|_| fail("bad position"))?;
                            let rule = parse_rule(line, rest)
                                .map_err(|reason| fail(&reason.to_string()))?;
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
                Target::SetConnMark { value, mask } => {
                    walk.ct_mark = (walk.ct_mark & !mask) ^ value
                }
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
