//! Rules collected in Istio's order (its `NftablesRuleBuilder`), written as one `nft -f`
//! transaction the way `knftables` prints it: per table, `add table`, `flush table`, its
//! chains, then its rules.
use std::fmt::Write as _;

/// A chain a table may declare, base chains with their hook.
pub(super) struct ChainSpec {
    pub(super) name: &'static str,
    /// `(type, hook, priority)` of a base chain.
    pub(super) hook: Option<(&'static str, &'static str, i32)>,
}

/// A table and every chain it may hold, in the order they are declared.
pub(super) struct TableSpec {
    pub(super) name: &'static str,
    pub(super) chains: &'static [ChainSpec],
}

/// A regular chain (no hook).
pub(super) const fn chain(name: &'static str) -> ChainSpec {
    ChainSpec { name, hook: None }
}

/// A base chain.
pub(super) const fn base(
    name: &'static str,
    kind: &'static str,
    hook: &'static str,
    priority: i32,
) -> ChainSpec {
    ChainSpec {
        name,
        hook: Some((kind, hook, priority)),
    }
}

struct Rule {
    table: &'static str,
    chain: &'static str,
    /// `Some(n)`: inserted at index `n` (Istio's `InsertRule`).
    index: Option<usize>,
    text: String,
}

/// Collects rules in Istio's order; IPv6 rules only when the pod has IPv6.
pub(super) struct Builder {
    ipv6: bool,
    rules: Vec<Rule>,
}

impl Builder {
    pub(super) const fn new(ipv6: bool) -> Self {
        Self {
            ipv6,
            rules: Vec::new(),
        }
    }

    pub(super) fn append(&mut self, table: &'static str, chain: &'static str, text: String) {
        self.rules.push(Rule {
            table,
            chain,
            index: None,
            text,
        });
    }

    /// [`Self::append`] when the pod has IPv6 (Istio's `AppendV6RuleIfSupported`).
    pub(super) fn append_v6(&mut self, table: &'static str, chain: &'static str, text: String) {
        if self.ipv6 {
            self.append(table, chain, text);
        }
    }

    pub(super) fn insert(
        &mut self,
        table: &'static str,
        chain: &'static str,
        index: usize,
        text: String,
    ) {
        self.rules.push(Rule {
            table,
            chain,
            index: Some(index),
            text,
        });
    }

    /// [`Self::insert`] when the pod has IPv6.
    pub(super) fn insert_v6(
        &mut self,
        table: &'static str,
        chain: &'static str,
        index: usize,
        text: String,
    ) {
        if self.ipv6 {
            self.insert(table, chain, index, text);
        }
    }

    /// The transaction writing `tables` (in this order): a table without rules is left out;
    /// a table's declared chains are those with rules or jumped to. An insert into a chain
    /// holding no more rules than its index becomes an append, as nftables cannot insert
    /// there (Istio's `addIstioTableRules`).
    pub(super) fn transaction(&self, tables: &[TableSpec]) -> String {
        let mut out = String::new();
        for table in tables {
            let rules: Vec<&Rule> = self
                .rules
                .iter()
                .filter(|rule| rule.table == table.name)
                .collect();
            if rules.is_empty() {
                continue;
            }
            let name = table.name;
            let _ = writeln!(out, "add table inet {name}");
            let _ = writeln!(out, "flush table inet {name}");
            let jumped = |chain: &str| {
                rules.iter().any(|rule| {
                    let mut words = rule.text.split_whitespace();
                    words.any(|word| word == "jump") && words.next() == Some(chain)
                })
            };
            for spec in table.chains {
                let used = rules.iter().any(|rule| rule.chain == spec.name);
                if !used && !jumped(spec.name) {
                    continue;
                }
                let _ = write!(out, "add chain inet {name} {}", spec.name);
                if let Some((kind, hook, priority)) = spec.hook {
                    let _ = write!(out, " {{ type {kind} hook {hook} priority {priority} ; }}");
                }
                out.push('\n');
            }
            let mut counts: Vec<(&str, usize)> = Vec::new();
            for rule in rules {
                let count = match counts.iter_mut().find(|(chain, _)| *chain == rule.chain) {
                    Some((_, count)) => count,
                    None => {
                        counts.push((rule.chain, 0));
                        &mut counts.last_mut().expect("just pushed").1
                    }
                };
                let (chain, text) = (rule.chain, &rule.text);
                match rule.index {
                    Some(index) if index < *count => {
                        let _ =
                            writeln!(out, "insert rule inet {name} {chain} index {index} {text}");
                    }
                    _ => {
                        let _ = writeln!(out, "add rule inet {name} {chain} {text}");
                    }
                }
                *count += 1;
            }
        }
        out
    }
}
