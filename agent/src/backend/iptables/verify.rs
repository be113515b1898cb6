//! A pod's rules compared with its record, for the verifier (and `explain`), in one visit to its
//! netns, and put back in place.
//!
//! The comparison is CHECK's: every recorded rule asked for with `-C`. That is a fork per rule,
//! so it runs only when the pod's tables changed since the rules were last found whole: with
//! nft iptables, while the namespace's nf_tables generation ([`crate::podnet::nftgen`]) is the
//! same, nothing is read at all; otherwise one `iptables-save` per family, compared with what it
//! said then (counters left out); with legacy iptables the kernel's tables, read in process
//! ([`super::legacy_tables`]), no fork. That view outlives the agent
//! ([`crate::backend::baseline`]): a restarted agent's first pass reads no more than a steady
//! one, and a pod without a baseline whose tables read as another pod's did when the same rules
//! were found whole there is whole too (`iptables-save` per family, no `-C`). Rules found
//! missing are put back in one `iptables-restore --noflush` transaction per table: the chains
//! the rules create are declared (which creates them, or empties them inside the transaction)
//! and filled again, and only the missing rules of the kernel's own chains are added, so that no
//! instant sees less of the capture than before the repair. A missing policy route is added.
use meshcap_policy::IptablesRules;

use super::{Flavour, IptablesBackend, inpod::Ctx, legacy_tables, records::Applied, restore};
use crate::{
    backend::{
        BackendError, Drift, DriftKind, PodCheck, Verify,
        baseline::{Baseline, Baselines},
        records::Record as _,
        rules_backend::route_drift,
    },
    pod::PodRef,
    podnet::{PodNetError, nftgen},
};

/// One recorded rule not in place: its family, its table and its line.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Missing {
    ipv6: bool,
    table: String,
    line: String,
}

impl IptablesBackend {
    /// Compares `pod`'s rules (and route) with its record; with [`Verify::Repair`] puts back
    /// what is missing.
    pub(super) fn verify_pod(
        &self,
        pod: &PodRef,
        verify: Verify,
    ) -> Result<PodCheck, BackendError> {
        let (mut check, id, record) = match self.records.to_verify(pod, describe) {
            Ok(found) => found,
            Err(check) => return Ok(check),
        };
        let baseline = self.baselines.get(&id);
        let (found, now) = self.in_netns(&record.pod, |ctx| {
            let then = Then {
                baseline: baseline.as_ref(),
                elsewhere: &self.baselines,
            };
            ctx.compare(record.flavour, &record.rules, then, verify)
        })?;
        check.extend(found);
        if let Some(now) = now {
            self.baselines.set(&id, now);
        }
        // Those of pods released since go (rarely more than a pass's DELs; after a start, those
        // of pods gone while no agent ran).
        if self.baselines.count() > self.records.count() {
            self.baselines.retain(|id| self.records.get(id).is_some());
        }
        Ok(check)
    }
}

/// The record in one line.
fn describe(record: &Applied) -> String {
    let count = |text: &str| {
        restore::tables(text)
            .iter()
            .map(|t| restore::checks(t).len())
            .sum::<usize>()
    };
    let v6 = record.rules.v6.as_deref().map(count);
    format!(
        "{} rules via {}: {} IPv4{}",
        record.whose(),
        record.flavour.binary(false, ""),
        count(&record.rules.v4),
        v6.map_or_else(String::new, |n| format!(", {n} IPv6"))
    )
}

/// The visited netns's nf_tables generation, with nft iptables (legacy tables have none).
fn generation_of(flavour: Flavour) -> Option<u32> {
    if flavour == Flavour::Nft {
        nftgen::generation().ok()
    } else {
        None
    }
}

/// Whether a pod's tables hold its rules ([`Ctx::whole`]).
pub(super) enum Whole {
    /// Found whole: the tables as they are now, to keep.
    Found(Baseline),
    /// This rule is not in place (in words).
    Missing(String),
}

/// What the verifier found before: the pod's tables when they were last whole, and every
/// pod's ([`Baselines::whole_elsewhere`]).
#[derive(Clone, Copy)]
pub(super) struct Then<'a> {
    pub(super) baseline: Option<&'a Baseline>,
    pub(super) elsewhere: &'a Baselines,
}

/// What is known of a pod's tables without asking for its rules one by one ([`Ctx::known`]).
enum Known {
    /// They hold its rules: why, in words, and the tables as they are, to keep.
    Whole { why: &'static str, now: Baseline },
    /// Nothing: every rule is to be asked for. The nf_tables generation and the tables as read,
    /// the baseline to keep if they turn out whole.
    Unknown {
        generation: Option<u32>,
        saved: Vec<Vec<u8>>,
    },
}

impl Ctx<'_> {
    /// `rules` compared with the visited netns, `then` saying how tables holding them looked;
    /// the new baseline when there is one to keep.
    fn compare(
        &mut self,
        flavour: Flavour,
        rules: &IptablesRules,
        then: Then<'_>,
        verify: Verify,
    ) -> Result<(PodCheck, Option<Baseline>), BackendError> {
        let mut check = PodCheck::default();
        // The policy route is no table's: it is looked at on every pass (one netlink dump).
        let (generation, saved) = match self.known(flavour, rules, then)? {
            Known::Whole { why, now } => {
                check.installed.push(format!("every rule in place ({why})"));
                check.drift.extend(self.route_drift(rules, verify)?);
                return Ok((check, Some(now)));
            }
            Known::Unknown { generation, saved } => (generation, saved),
        };
        let missing = self.missing(flavour, rules)?;
        if missing.is_empty() {
            check
                .installed
                .push("every rule in place (as CHECK compares them)".to_owned());
        } else {
            let what = format!(
                "{} of its rules are not in place, first `{}` ({})",
                missing.len(),
                missing[0].line,
                missing[0].table
            );
            check.drift.push(verify.handle(DriftKind::Rules, what, || {
                self.put_back(flavour, rules, &missing)
            }));
        }
        check.drift.extend(self.route_drift(rules, verify)?);
        if check.drift.is_empty() {
            return Ok((check, Some(Baseline::new(rules, generation, &saved))));
        }
        if check
            .drift
            .iter()
            .any(|d| d.outcome != crate::backend::DriftOutcome::Repaired)
        {
            // Found only, or not put back: compared again from scratch next time.
            return Ok((check, None));
        }
        // Put back: the tables as the repair left them.
        let generation = generation_of(flavour);
        let saved = self.saved(flavour, rules)?;
        Ok((check, Some(Baseline::new(rules, generation, &saved))))
    }

    /// The policy route `rules` need, compared (and with [`Verify::Repair`] put back).
    fn route_drift(
        &mut self,
        rules: &IptablesRules,
        verify: Verify,
    ) -> Result<Option<Drift>, BackendError> {
        route_drift(self.visit, &self.xt.who, &rules.routes, verify)
    }

    /// What `then` tells of the visited netns's tables: they hold `rules` when its nf_tables
    /// generation is the same as when they were last found whole there, or its tables read the
    /// same as then or as another pod's with the same rules.
    fn known(
        &self,
        flavour: Flavour,
        rules: &IptablesRules,
        then: Then<'_>,
    ) -> Result<Known, BackendError> {
        // Read before the tables are: a change made while they are compared shows next time.
        let generation = generation_of(flavour);
        if let Some(now) = then
            .baseline
            .filter(|b| b.same_generation(rules, generation))
        {
            return Ok(Known::Whole {
                why: "nf_tables unchanged since last found whole",
                now: *now,
            });
        }
        let saved = self.saved(flavour, rules)?;
        let why = if then.baseline.is_some_and(|b| b.same_tables(rules, &saved)) {
            "tables unchanged since last found whole"
        } else if then.elsewhere.whole_elsewhere(rules, &saved) {
            "tables as another pod's were when the same rules were found whole there"
        } else {
            return Ok(Known::Unknown { generation, saved });
        };
        Ok(Known::Whole {
            why,
            now: Baseline::new(rules, generation, &saved),
        })
    }

    /// Whether the visited netns's tables hold `rules`: as [`Self::known`] tells, else every
    /// rule asked for (`-C`, a fork each). Not its policy route ([`Ctx::missing_route`]).
    ///
    /// # Errors
    /// When the tables cannot be read.
    pub(super) fn whole(
        &self,
        flavour: Flavour,
        rules: &IptablesRules,
        then: Then<'_>,
    ) -> Result<Whole, BackendError> {
        Ok(match self.known(flavour, rules, then)? {
            Known::Whole { now, .. } => Whole::Found(now),
            Known::Unknown { generation, saved } => {
                match self.first_missing_rule(flavour, rules)? {
                    Some(missing) => Whole::Missing(missing),
                    None => Whole::Found(Baseline::new(rules, generation, &saved)),
                }
            }
        })
    }

    /// The tables `rules` use as they are, per family, without counters: with legacy iptables
    /// the kernel's entries read in process ([`legacy_tables`]), otherwise what `iptables-save`
    /// says.
    fn saved(&self, flavour: Flavour, rules: &IptablesRules) -> Result<Vec<Vec<u8>>, BackendError> {
        let mut out = Vec::new();
        for (ipv6, text) in families(rules) {
            let names: Vec<String> = restore::tables(text).into_iter().map(|t| t.name).collect();
            if flavour == Flavour::Legacy {
                let tables =
                    legacy_tables::read(ipv6, &names).map_err(|source| BackendError::PodNet {
                        pod: self.xt.who.clone(),
                        source: PodNetError::Io {
                            what: "reading the legacy iptables tables".to_owned(),
                            source,
                        },
                    })?;
                for (name, entries) in tables {
                    out.push(name.into_bytes());
                    out.push(entries.unwrap_or_default());
                }
                continue;
            }
            let save = self.xt.run(&flavour.binary(ipv6, "-save"), &[])?;
            out.push(relevant(&save, &names).into_bytes());
        }
        Ok(out)
    }

    /// Every recorded rule `-C` does not find, in order.
    fn missing(
        &self,
        flavour: Flavour,
        rules: &IptablesRules,
    ) -> Result<Vec<Missing>, BackendError> {
        let mut out = Vec::new();
        for (ipv6, text) in families(rules) {
            let program = flavour.binary(ipv6, "");
            for table in restore::tables(text) {
                for (line, mut args) in rule_lines(&table).zip(restore::checks(&table)) {
                    args.splice(0..0, ["-w".to_owned(), "10".to_owned()]);
                    if self.xt.run(&program, &args).is_err() {
                        out.push(Missing {
                            ipv6,
                            table: table.name.clone(),
                            line: line.to_owned(),
                        });
                    }
                }
            }
        }
        Ok(out)
    }

    /// Puts `missing` back: one transaction per table holding any of it.
    fn put_back(
        &self,
        flavour: Flavour,
        rules: &IptablesRules,
        missing: &[Missing],
    ) -> Result<(), BackendError> {
        for (ipv6, text) in families(rules) {
            for table in restore::tables(text) {
                let gone: Vec<&str> = missing
                    .iter()
                    .filter(|m| m.ipv6 == ipv6 && m.table == table.name)
                    .map(|m| m.line.as_str())
                    .collect();
                if gone.is_empty() {
                    continue;
                }
                let lines = repair_lines(&table, &gone);
                self.xt.restore(
                    flavour,
                    ipv6,
                    &restore::payload(&[(table.name.clone(), lines)]),
                )?;
            }
        }
        Ok(())
    }
}

/// The families `rules` has rules for, with their text.
fn families(rules: &IptablesRules) -> impl Iterator<Item = (bool, &str)> {
    std::iter::once((false, rules.v4.as_str())).chain(rules.v6.as_deref().map(|v6| (true, v6)))
}

/// The rule lines of `table` (`-A`, `-I`), in order: the lines [`restore::checks`] checks.
fn rule_lines(table: &restore::Table) -> impl Iterator<Item = &str> {
    table
        .lines
        .iter()
        .map(String::as_str)
        .filter(|line| line.starts_with("-A ") || line.starts_with("-I "))
}

/// Whether `line` adds to one of the kernel's own chains.
fn in_builtin_chain(line: &str) -> bool {
    line.split_whitespace()
        .nth(1)
        .is_some_and(|chain| restore::BUILTIN_CHAINS.contains(&chain))
}

/// One table's repair: its own chains declared (created, or emptied within the transaction)
/// and filled again in order, and of the rules in the kernel's chains only the `missing` ones.
fn repair_lines(table: &restore::Table, missing: &[&str]) -> Vec<String> {
    let mut lines: Vec<String> = table
        .lines
        .iter()
        .filter_map(|line| line.strip_prefix("-N "))
        .map(|chain| format!(":{} - [0:0]", chain.trim()))
        .collect();
    lines.extend(
        rule_lines(table)
            .filter(|line| !in_builtin_chain(line) || missing.contains(line))
            .map(str::to_owned),
    );
    lines
}

/// The lines of `save` (an `iptables-save` output) in the tables `names`, without comments and
/// counters.
fn relevant(save: &str, names: &[String]) -> String {
    let mut out = String::new();
    let mut keep = false;
    for line in save.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix('*') {
            keep = names.iter().any(|n| n == name.trim());
        }
        if !keep || line.starts_with('#') {
            continue;
        }
        // `:CHAIN POLICY [packets:bytes]`: the counters change with every packet.
        let line = match line.rsplit_once(" [") {
            Some((head, _)) if line.starts_with(':') => head,
            _ => line,
        };
        out.push_str(line);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const NAT: &str = "* nat
-N ISTIO_INBOUND
-N ISTIO_REDIRECT
-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001
-A PREROUTING -p tcp -j ISTIO_INBOUND
-I OUTPUT 1 -p tcp -j ISTIO_REDIRECT
-A ISTIO_INBOUND -p tcp --dport 15008 -j RETURN
COMMIT
";

    #[test]
    fn a_repair_refills_own_chains_and_adds_only_missing_kernel_chain_rules() {
        let table = &restore::tables(NAT)[0];
        assert_eq!(
            repair_lines(table, &["-A PREROUTING -p tcp -j ISTIO_INBOUND"]),
            [
                ":ISTIO_INBOUND - [0:0]",
                ":ISTIO_REDIRECT - [0:0]",
                "-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001",
                "-A PREROUTING -p tcp -j ISTIO_INBOUND",
                "-A ISTIO_INBOUND -p tcp --dport 15008 -j RETURN",
            ]
        );
        assert_eq!(rule_lines(table).count(), restore::checks(table).len());
    }

    #[test]
    fn counters_and_other_tables_are_left_out_of_the_comparison() {
        let save = "# Generated by iptables-save v1.8.9\n*mangle\n:PREROUTING ACCEPT [9:99]\nCOMMIT\n\
                    *nat\n:PREROUTING ACCEPT [3:180]\n:ISTIO_INBOUND - [0:0]\n\
                    -A PREROUTING -p tcp -j ISTIO_INBOUND\nCOMMIT\n# Completed\n";
        let later = save
            .replace("[3:180]", "[70:4200]")
            .replace("[9:99]", "[1:1]");
        let names = ["nat".to_owned()];
        assert_eq!(relevant(save, &names), relevant(&later, &names));
        assert_eq!(
            relevant(save, &names),
            "*nat\n:PREROUTING ACCEPT\n:ISTIO_INBOUND -\n-A PREROUTING -p tcp -j ISTIO_INBOUND\nCOMMIT\n"
        );
    }
}
