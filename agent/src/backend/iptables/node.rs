//! Rules in the node's own network namespace (ambient mode's probe SNAT): applied, re-applied
//! by a restarted or upgraded agent and removed, each in one `iptables-restore` transaction
//! per table, under the system's xtables lock (the node's other writers, kube-proxy first, take
//! it too), with the iptables Istio would choose there.
//!
//! Unlike a pod's, the node's rules have no record: whatever an earlier agent left is read
//! from `iptables-save`. Applying declares the rule set's own chains (flushing them if there),
//! drops every copy of its jumps from the kernel's chains and inserts them again, so a restart
//! leaves exactly one set, in front.
use std::path::Path;

use meshcap_policy::IptablesRules;

use super::{Flavour, FlavourChoice, restore, xtables::Xtables};
use crate::{backend::BackendError, podnet};

/// How the node is named in errors.
const NODE: &str = "the node's network namespace";

/// Applies `rules` in the node's network namespace `netns` (see the module documentation).
///
/// # Errors
/// When the namespace cannot be entered or iptables refuses.
pub fn apply(
    netns: Option<&Path>,
    choice: FlavourChoice,
    rules: &IptablesRules,
) -> Result<(), BackendError> {
    transact(netns, choice, rules, |table, _, lines| {
        for line in &table.lines {
            match line.strip_prefix("-N ") {
                Some(chain) => lines.insert(0, format!(":{} - [0:0]", chain.trim())),
                None => lines.push(line.clone()),
            }
        }
    })
}

/// Removes whatever of `rules` is in the network namespace `netns`.
///
/// # Errors
/// When the namespace cannot be entered or iptables refuses.
pub fn remove(
    netns: Option<&Path>,
    choice: FlavourChoice,
    rules: &IptablesRules,
) -> Result<(), BackendError> {
    transact(netns, choice, rules, |table, save, lines| {
        lines.extend(restore::drop_chains(table, &restore::saved_chains(save)));
    })
}

/// One `iptables-restore` per family in `netns`: per table of `rules`, a `-D` for every copy
/// of its jumps already in the kernel's chains, then what `more` adds (given the table and
/// its `iptables-save`).
fn transact(
    netns: Option<&Path>,
    choice: FlavourChoice,
    rules: &IptablesRules,
    more: impl Fn(&restore::Table, &str, &mut Vec<String>) + Send + Sync,
) -> Result<(), BackendError> {
    in_node(netns, |xt| {
        let flavour = xt.detect(choice);
        for (ipv6, text) in families(rules) {
            let mut tables = Vec::new();
            for table in restore::tables(text) {
                let save = saved(xt, flavour, ipv6, &table.name)?;
                let mut lines = jumps_present(&table, &save);
                more(&table, &save, &mut lines);
                tables.push((table.name, lines));
            }
            xt.restore(flavour, ipv6, &restore::payload(&tables))?;
        }
        Ok(())
    })
}

fn families(rules: &IptablesRules) -> impl Iterator<Item = (bool, &str)> {
    [
        (false, Some(rules.v4.as_str())),
        (true, rules.v6.as_deref()),
    ]
    .into_iter()
    .filter_map(|(ipv6, text)| text.map(|t| (ipv6, t)))
}

fn saved(xt: &Xtables, flavour: Flavour, ipv6: bool, table: &str) -> Result<String, BackendError> {
    xt.run(
        &flavour.binary(ipv6, "-save"),
        &["-t".to_owned(), table.to_owned()],
    )
}

/// A `-D` for every copy in `save` of the table's rules in the kernel's chains.
fn jumps_present(table: &restore::Table, save: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (delete, _) in restore::builtin_rules(table) {
        // ["-t", table, "-D", chain, spec…]
        let spec = delete[3..].join(" ");
        let copies = save
            .lines()
            .filter(|l| l.strip_prefix("-A ") == Some(spec.as_str()))
            .count();
        out.extend(std::iter::repeat_n(format!("-D {spec}"), copies));
    }
    out
}

/// Runs `f` in `netns` (`None`: the agent's own, which a host-network DaemonSet's is the
/// node's).
fn in_node<T: Send>(
    netns: Option<&Path>,
    f: impl FnOnce(&Xtables) -> Result<T, BackendError> + Send,
) -> Result<T, BackendError> {
    let xt = Xtables {
        who: NODE.to_owned(),
        lock: None,
        userns: None,
    };
    let Some(netns) = netns else {
        return f(&xt);
    };
    podnet::run_in(netns, |_| f(&xt)).map_err(|source| BackendError::PodNet {
        pod: NODE.to_owned(),
        source,
    })?
}
