//! iptables-restore payloads: the rendered rule text split into tables, the inverse of a
//! rule set (to remove or replace it atomically), and rules as `-C` argument lists.
//!
//! Rendered rules are Istio's: `* table`, `-N chain`, `-A chain spec…`, `-I chain n spec…`,
//! `COMMIT`. No rule contains quotes or comments, so whitespace splitting is exact.

/// Chains the kernel provides; every other chain in a rule set is created by it.
pub(super) const BUILTIN_CHAINS: &[&str] =
    &["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"];

/// One table of a rule set.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Table {
    /// `nat`, `mangle`, `raw`, …
    pub name: String,
    /// The command lines between the `*table` header and `COMMIT`.
    pub lines: Vec<String>,
}

/// Splits a rendered rule set into its tables. Tables named twice are merged in order.
#[must_use]
pub fn tables(text: &str) -> Vec<Table> {
    let mut out: Vec<Table> = Vec::new();
    let mut current: Option<usize> = None;
    for line in text.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix('*') {
            let name = name.trim().to_owned();
            let index = out.iter().position(|t| t.name == name).unwrap_or_else(|| {
                out.push(Table {
                    name,
                    lines: Vec::new(),
                });
                out.len() - 1
            });
            current = Some(index);
        } else if line == "COMMIT" {
            current = None;
        } else if !line.is_empty()
            && !line.starts_with('#')
            && let Some(i) = current
        {
            out[i].lines.push(line.to_owned());
        }
    }
    out
}

/// The chains a table's lines create (`-N`).
fn own_chains(table: &Table) -> Vec<&str> {
    table
        .lines
        .iter()
        .filter_map(|l| l.strip_prefix("-N "))
        .map(str::trim)
        .collect()
}

/// The lines that undo `table`: delete its rules in built-in chains, then flush and delete the
/// chains it created (their rules go with them).
#[must_use]
pub fn inverse(table: &Table) -> Vec<String> {
    let own = own_chains(table);
    let mut out = Vec::new();
    for line in &table.lines {
        let words: Vec<&str> = line.split_whitespace().collect();
        let spec = match words.as_slice() {
            ["-A", chain, spec @ ..] if BUILTIN_CHAINS.contains(chain) => Some((chain, spec)),
            ["-I", chain, index, spec @ ..]
                if BUILTIN_CHAINS.contains(chain) && index.parse::<u32>().is_ok() =>
            {
                Some((chain, spec))
            }
            ["-I", chain, spec @ ..] if BUILTIN_CHAINS.contains(chain) => Some((chain, spec)),
            _ => None,
        };
        if let Some((chain, spec)) = spec {
            out.push(format!("-D {chain} {}", spec.join(" ")));
        }
    }
    out.extend(own.iter().map(|c| format!("-F {c}")));
    out.extend(own.iter().map(|c| format!("-X {c}")));
    out
}

/// A restore payload: the given lines per table, each table committed on its own.
#[must_use]
pub fn payload(tables: &[(String, Vec<String>)]) -> String {
    let mut out = String::new();
    for (name, lines) in tables.iter().filter(|(_, l)| !l.is_empty()) {
        out.push('*');
        out.push_str(name);
        out.push('\n');
        for line in lines {
            out.push_str(line);
            out.push('\n');
        }
        out.push_str("COMMIT\n");
    }
    out
}

/// The payload that replaces `old` (what was applied before, if anything) by `new`, one
/// transaction per table, so no table is ever seen half-way.
#[must_use]
pub fn replace(old: Option<&str>, new: &str) -> String {
    let old = old.map(tables).unwrap_or_default();
    let new = tables(new);
    let mut names: Vec<String> = old.iter().map(|t| t.name.clone()).collect();
    for t in &new {
        if !names.contains(&t.name) {
            names.push(t.name.clone());
        }
    }
    let merged: Vec<(String, Vec<String>)> = names
        .into_iter()
        .map(|name| {
            let mut lines = old
                .iter()
                .find(|t| t.name == name)
                .map(inverse)
                .unwrap_or_default();
            if let Some(t) = new.iter().find(|t| t.name == name) {
                lines.extend(t.lines.iter().cloned());
            }
            (name, lines)
        })
        .collect();
    payload(&merged)
}

/// A rule line's chain and match-and-target words (`-A chain spec…`, `-I chain [n] spec…`).
fn rule(line: &str) -> Option<(&str, Vec<&str>)> {
    let words: Vec<&str> = line.split_whitespace().collect();
    match words.as_slice() {
        ["-A", chain, spec @ ..] => Some((chain, spec.to_vec())),
        ["-I", chain, index, spec @ ..] if index.parse::<u32>().is_ok() => {
            Some((chain, spec.to_vec()))
        }
        ["-I", chain, spec @ ..] => Some((chain, spec.to_vec())),
        _ => None,
    }
}

/// `op` (`-C`, `-D`) argument lists for the table's rules, or only those in the kernel's own
/// chains: `-t table op chain spec…`.
fn rule_args(table: &Table, op: &str, builtin_only: bool) -> Vec<Vec<String>> {
    table
        .lines
        .iter()
        .filter_map(|line| rule(line))
        .filter(|(chain, _)| !builtin_only || BUILTIN_CHAINS.contains(chain))
        .map(|(chain, spec)| {
            let mut args = vec!["-t".to_owned(), table.name.clone(), op.to_owned()];
            args.push(chain.to_owned());
            args.extend(spec.iter().map(|s| (*s).to_owned()));
            args
        })
        .collect()
}

/// `-C` argument lists that verify every rule of a table (`-t table -C chain spec…`).
#[must_use]
pub fn checks(table: &Table) -> Vec<Vec<String>> {
    rule_args(table, "-C", false)
}

/// The table's rules in the kernel's own chains (the only ones that outlive flushing and
/// deleting the table's own chains), each as its `-D` and its `-C` argument list.
#[must_use]
pub fn builtin_rules(table: &Table) -> Vec<(Vec<String>, Vec<String>)> {
    rule_args(table, "-D", true)
        .into_iter()
        .zip(rule_args(table, "-C", true))
        .collect()
}

/// The chains a table creates, as `-F` lines then `-X` lines for those of them in `present`.
#[must_use]
pub fn drop_chains(table: &Table, present: &[String]) -> Vec<String> {
    let own: Vec<&str> = own_chains(table)
        .into_iter()
        .filter(|c| present.iter().any(|p| p == c))
        .collect();
    own.iter()
        .map(|c| format!("-F {c}"))
        .chain(own.iter().map(|c| format!("-X {c}")))
        .collect()
}

/// The chains an `iptables-save -t table` output declares (`:CHAIN policy [counters]`).
#[must_use]
pub fn saved_chains(save: &str) -> Vec<String> {
    save.lines()
        .filter_map(|l| l.strip_prefix(':'))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

/// Istio's rules an `iptables-save` (of every table) shows, as a rule set in the rendered
/// form: per table holding `ISTIO_*` chains, those chains (`-N`) with their rules, and the
/// rules of the kernel's chains that jump to one. What a pod's netns was found holding: its
/// inverse removes it in one transaction per table.
#[must_use]
pub fn istio_found(save: &str) -> String {
    let mut out = String::new();
    let mut table: Option<(String, Vec<String>)> = None;
    for line in save.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix('*') {
            table = Some((name.trim().to_owned(), Vec::new()));
        } else if line == "COMMIT" {
            if let Some((name, lines)) = table.take()
                && lines.iter().any(|l| l.starts_with("-N "))
            {
                out.push_str(&format!("* {name}\n{}\nCOMMIT\n", lines.join("\n")));
            }
        } else if let Some((_, lines)) = &mut table {
            if let Some(chain) = line
                .strip_prefix(':')
                .and_then(|l| l.split_whitespace().next())
                && chain.starts_with("ISTIO_")
            {
                lines.push(format!("-N {chain}"));
            } else if is_istios(line) {
                lines.push(line.to_owned());
            }
        }
    }
    out
}

/// Whether a rule line (`-A chain spec…`) is in one of Istio's chains or jumps to one.
fn is_istios(line: &str) -> bool {
    let Some((chain, spec)) = rule(line) else {
        return false;
    };
    chain.starts_with("ISTIO_")
        || spec
            .windows(2)
            .any(|w| matches!(w[0], "-j" | "-g") && w[1].starts_with("ISTIO_"))
}

/// How many of a rule set's rules are Istio's by [`is_istios`]: what [`istio_found`] keeps of
/// them, for comparing a rendered set with one found.
#[must_use]
pub fn istio_rule_count(text: &str) -> usize {
    tables(text)
        .iter()
        .flat_map(|t| t.lines.iter())
        .filter(|line| is_istios(line))
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn istios_rules_are_found_in_a_save_and_counted_as_rendered() {
        let save = "# Generated by iptables-nft-save v1.8.9\n*mangle\n:PREROUTING ACCEPT [0:0]\n\
                    :OUTPUT ACCEPT [0:0]\n:ISTIO_PRERT - [0:0]\n-A PREROUTING -j ISTIO_PRERT\n\
                    -A OUTPUT -m mark --mark 0x7 -j ACCEPT\n\
                    -A ISTIO_PRERT -m mark --mark 0x539/0xfff -j CONNMARK --set-xmark 0x111/0xfff\n\
                    COMMIT\n*filter\n:INPUT ACCEPT [0:0]\n-A INPUT -j ACCEPT\nCOMMIT\n";
        let found = istio_found(save);
        assert_eq!(
            found,
            "* mangle\n-N ISTIO_PRERT\n-A PREROUTING -j ISTIO_PRERT\n\
             -A ISTIO_PRERT -m mark --mark 0x539/0xfff -j CONNMARK --set-xmark 0x111/0xfff\nCOMMIT\n"
        );
        assert_eq!(istio_rule_count(&found), 2);
        assert_eq!(
            istio_rule_count(TPROXY),
            4,
            "the RETURN in OUTPUT is not counted"
        );
        assert_eq!(istio_found("*nat\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n"), "");
        let undo = replace(Some(&found), "");
        assert_eq!(
            undo,
            "*mangle\n-D PREROUTING -j ISTIO_PRERT\n-F ISTIO_PRERT\n-X ISTIO_PRERT\nCOMMIT\n"
        );
    }

    #[test]
    fn what_is_left_is_removed_by_parts() {
        let t = tables(TPROXY);
        assert_eq!(
            builtin_rules(&t[0])
                .iter()
                .map(|(delete, _)| delete.join(" "))
                .collect::<Vec<_>>(),
            [
                "-t mangle -D PREROUTING -p tcp -j ISTIO_INBOUND",
                "-t mangle -D OUTPUT -p tcp -o lo -m mark --mark 1337 -j RETURN",
            ]
        );
        let present = saved_chains(
            "# Generated by iptables-save\n*mangle\n:PREROUTING ACCEPT [0:0]\n\
             :ISTIO_INBOUND - [0:0]\n-A PREROUTING -p tcp -j ISTIO_INBOUND\nCOMMIT\n",
        );
        assert_eq!(present, ["PREROUTING", "ISTIO_INBOUND"]);
        assert_eq!(
            drop_chains(&t[0], &present),
            ["-F ISTIO_INBOUND", "-X ISTIO_INBOUND"]
        );
    }

    const TPROXY: &str = "* mangle
-N ISTIO_DIVERT
-N ISTIO_INBOUND
-A ISTIO_DIVERT -j MARK --set-mark 1337
-A PREROUTING -p tcp -j ISTIO_INBOUND
-A OUTPUT -p tcp -o lo -m mark --mark 1337 -j RETURN
-I ISTIO_INBOUND 1 -p tcp -m mark --mark 1337 -j RETURN
COMMIT
* nat
-N ISTIO_OUTPUT
-A OUTPUT -j ISTIO_OUTPUT
COMMIT
";

    #[test]
    fn tables_are_split_and_trimmed() {
        let t = tables(TPROXY);
        assert_eq!(t.len(), 2);
        assert_eq!(t[0].name, "mangle");
        assert_eq!(t[0].lines.len(), 6);
        assert_eq!(t[1].lines, ["-N ISTIO_OUTPUT", "-A OUTPUT -j ISTIO_OUTPUT"]);
    }

    #[test]
    fn inverse_deletes_builtin_rules_then_own_chains() {
        let t = tables(TPROXY);
        assert_eq!(
            inverse(&t[0]),
            [
                "-D PREROUTING -p tcp -j ISTIO_INBOUND",
                "-D OUTPUT -p tcp -o lo -m mark --mark 1337 -j RETURN",
                "-F ISTIO_DIVERT",
                "-F ISTIO_INBOUND",
                "-X ISTIO_DIVERT",
                "-X ISTIO_INBOUND",
            ]
        );
    }

    #[test]
    fn replace_is_one_transaction_per_table() {
        let text = replace(
            Some(TPROXY),
            "* nat\n-N ISTIO_OUTPUT\n-A OUTPUT -j ISTIO_OUTPUT\nCOMMIT\n",
        );
        assert_eq!(
            text,
            "*mangle\n-D PREROUTING -p tcp -j ISTIO_INBOUND\n\
             -D OUTPUT -p tcp -o lo -m mark --mark 1337 -j RETURN\n-F ISTIO_DIVERT\n\
             -F ISTIO_INBOUND\n-X ISTIO_DIVERT\n-X ISTIO_INBOUND\nCOMMIT\n\
             *nat\n-D OUTPUT -j ISTIO_OUTPUT\n-F ISTIO_OUTPUT\n-X ISTIO_OUTPUT\n\
             -N ISTIO_OUTPUT\n-A OUTPUT -j ISTIO_OUTPUT\nCOMMIT\n"
        );
        assert_eq!(replace(None, ""), "");
    }

    #[test]
    fn checks_drop_insert_positions() {
        let t = tables(TPROXY);
        let checks = checks(&t[0]);
        assert_eq!(checks.len(), 4);
        assert_eq!(
            checks[3].join(" "),
            "-t mangle -C ISTIO_INBOUND -p tcp -m mark --mark 1337 -j RETURN"
        );
    }
}
