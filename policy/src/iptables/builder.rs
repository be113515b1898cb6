//! Rules collected per family in Istio's order (its `IptablesRuleBuilder`), written as
//! `iptables-restore` input.
use std::fmt::Write as _;

use super::super::model::Family;

/// Stands for the family's address in [`Builder::versioned`] rules.
pub(super) const IP: &str = "\0ip";
/// Chains and targets `-N` is never written for.
const BUILT_IN: [&str; 8] = [
    "INPUT",
    "OUTPUT",
    "FORWARD",
    "PREROUTING",
    "POSTROUTING",
    "ACCEPT",
    "RETURN",
    "DROP",
];

/// Which families a rule goes to.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) struct Families {
    v4: bool,
    v6: bool,
}
pub(super) const BOTH: Families = Families { v4: true, v6: true };
pub(super) const V4: Families = Families {
    v4: true,
    v6: false,
};
pub(super) const V6: Families = Families {
    v4: false,
    v6: true,
};

pub(super) struct Rule {
    table: &'static str,
    chain: &'static str,
    /// The rule as written after the table: `-A CHAIN …` or `-I CHAIN N …`.
    words: Vec<String>,
}

/// Collects rules per family in Istio's order (its `IptablesRuleBuilder`): IPv6 rules only
/// when the pod has IPv6.
pub(super) struct Builder {
    pub(super) v4: Vec<Rule>,
    pub(super) v6: Vec<Rule>,
    pub(super) ipv6: bool,
}

impl Builder {
    /// No rules yet; IPv6 ones kept only when `ipv6`.
    pub(super) const fn new(ipv6: bool) -> Self {
        Self {
            v4: Vec::new(),
            v6: Vec::new(),
            ipv6,
        }
    }

    /// Adds `rule` (arguments as `iptables` takes them, after `head`) to each family's rules,
    /// with [`IP`] replaced by `ip`'s address of that family.
    fn push(
        &mut self,
        families: Families,
        table: &'static str,
        chain: &'static str,
        head: &str,
        rule: &str,
        ip: Option<(&str, &str)>,
    ) {
        for (enabled, rules, family) in [
            (families.v4, &mut self.v4, Family::V4),
            (families.v6 && self.ipv6, &mut self.v6, Family::V6),
        ] {
            if !enabled {
                continue;
            }
            let words = head
                .split_whitespace()
                .chain(rule.split_whitespace())
                .map(|word| match (ip, word == IP, family) {
                    (Some((v4, _)), true, Family::V4) => v4.to_owned(),
                    (Some((_, v6)), true, Family::V6) => v6.to_owned(),
                    _ => word.to_owned(),
                })
                .collect();
            rules.push(Rule {
                table,
                chain,
                words,
            });
        }
    }

    pub(super) fn append(
        &mut self,
        families: Families,
        table: &'static str,
        chain: &'static str,
        rule: &str,
    ) {
        self.push(families, table, chain, &format!("-A {chain}"), rule, None);
    }

    pub(super) fn insert(
        &mut self,
        families: Families,
        table: &'static str,
        chain: &'static str,
        position: u32,
        rule: &str,
    ) {
        let head = format!("-I {chain} {position}");
        self.push(families, table, chain, &head, rule, None);
    }

    /// A rule for both families with [`IP`] standing for the first or second of `ip`.
    pub(super) fn versioned(
        &mut self,
        table: &'static str,
        chain: &'static str,
        ip: (&str, &str),
        rule: &str,
    ) {
        self.push(BOTH, table, chain, &format!("-A {chain}"), rule, Some(ip));
    }
}

/// `iptables-restore` input: tables in name order, each declaring its chains (those with
/// rules, in first-use order, then those only jumped to) before its rules.
pub(super) fn restore_text(rules: &[Rule]) -> String {
    let mut tables: Vec<&str> = rules.iter().map(|rule| rule.table).collect();
    tables.sort_unstable();
    tables.dedup();
    let mut out = String::new();
    for table in tables {
        let in_table: Vec<&Rule> = rules.iter().filter(|rule| rule.table == table).collect();
        let mut declared: Vec<&str> = Vec::new();
        let used = in_table.iter().map(|rule| rule.chain);
        let jumped = in_table
            .iter()
            .filter_map(|rule| match rule.words.as_slice() {
                [.., jump, target] if jump == "-j" => Some(target.as_str()),
                _ => None,
            });
        for chain in used.chain(jumped) {
            if !BUILT_IN.contains(&chain) && !declared.contains(&chain) {
                declared.push(chain);
            }
        }
        let _ = writeln!(out, "* {table}");
        for chain in declared {
            let _ = writeln!(out, "-N {chain}");
        }
        for rule in in_table {
            let _ = writeln!(out, "{}", rule.words.join(" "));
        }
        out.push_str("COMMIT\n");
    }
    out
}
