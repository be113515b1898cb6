//! The `inet` tables a pod's transaction writes: their names, one transaction deleting them,
//! their listing as the kernel holds them, and how a listing differs from the one recorded
//! when they were applied.
use meshcap_policy::PolicyRoutes;
use serde::{Deserialize, Serialize};

use super::nft::Nft;
use crate::backend::BackendError;

/// A pod's capture as the nftables backend applies it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NftablesRules {
    /// Istio's `nft -f` transaction.
    pub transaction: String,
    /// What the rules need besides themselves, set up over netlink.
    pub routes: PolicyRoutes,
}

impl NftablesRules {
    /// The `inet` tables the transaction writes, in its order.
    pub(super) fn tables(&self) -> Vec<&str> {
        self.transaction
            .lines()
            .filter_map(|line| line.strip_prefix("add table inet "))
            .collect()
    }
}

/// One transaction deleting `tables`, whether or not each exists (`add` first makes it exist).
pub(super) fn deletion<'a>(tables: impl IntoIterator<Item = &'a str>) -> String {
    let mut seen: Vec<&str> = Vec::new();
    let mut out = String::new();
    for table in tables {
        if !seen.contains(&table) {
            seen.push(table);
            out.push_str(&format!(
                "add table inet {table}\ndelete table inet {table}\n"
            ));
        }
    }
    out
}

/// One transaction creating `tables`, failing whole when one exists already.
pub(super) fn creation(tables: &[&str]) -> String {
    tables
        .iter()
        .map(|table| format!("create table inet {table}\n"))
        .collect()
}

/// The listing of `rules`' tables now, a missing one named as such.
pub(super) fn listing(nft: &Nft, rules: &NftablesRules) -> Result<String, BackendError> {
    let mut out = String::new();
    for table in rules.tables() {
        match nft.list(table)? {
            Some(text) => out.push_str(&text),
            None => out.push_str(&format!("# table inet {table} is missing\n")),
        }
    }
    Ok(out)
}

/// How `now` differs from `recorded`, in words (`None`: it does not).
pub(super) fn difference(recorded: &str, now: &str) -> Option<String> {
    if recorded == now {
        return None;
    }
    let (mut was, mut is) = (recorded.lines(), now.lines());
    loop {
        match (was.next(), is.next()) {
            (Some(a), Some(b)) if a == b => {}
            (Some(a), Some(b)) => {
                return Some(format!("`{}` where `{}` was applied", b.trim(), a.trim()));
            }
            (Some(a), None) => return Some(format!("`{}` is missing", a.trim())),
            (None, Some(b)) => return Some(format!("`{}` was added", b.trim())),
            (None, None) => return Some("the tables differ".to_owned()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deletion_names_each_table_once_and_succeeds_whether_it_exists_or_not() {
        assert_eq!(
            deletion(["istio-proxy-nat", "istio-proxy-mangle", "istio-proxy-nat"]),
            "add table inet istio-proxy-nat\ndelete table inet istio-proxy-nat\n\
             add table inet istio-proxy-mangle\ndelete table inet istio-proxy-mangle\n"
        );
        assert_eq!(deletion([]), "");
    }

    #[test]
    fn the_tables_of_a_transaction_are_those_it_adds_in_order() {
        let rules = NftablesRules {
            transaction: "add table inet istio-proxy-nat\nflush table inet istio-proxy-nat\n\
                          add rule inet istio-proxy-nat output counter jump istio-output\n\
                          add table inet istio-proxy-raw\n"
                .to_owned(),
            routes: PolicyRoutes::default(),
        };
        assert_eq!(rules.tables(), ["istio-proxy-nat", "istio-proxy-raw"]);
    }

    #[test]
    fn a_difference_names_the_first_line_that_changed() {
        let applied = "table inet t {\n\tchain output {\n\t\tcounter jump istio-output\n\t}\n}\n";
        assert_eq!(difference(applied, applied), None);
        let flushed = "table inet t {\n\tchain output {\n\t}\n}\n";
        assert_eq!(
            difference(applied, flushed).as_deref(),
            Some("`}` where `counter jump istio-output` was applied")
        );
        let more = format!("{applied}table inet u {{\n}}\n");
        assert_eq!(
            difference(applied, &more).as_deref(),
            Some("`table inet u {` was added")
        );
        assert_eq!(
            difference(&more, applied).as_deref(),
            Some("`table inet u {` is missing")
        );
    }
}
