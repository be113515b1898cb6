//! The run's printout: what each node runs, a line per node and check, and the verdict.
use std::fmt;

use super::report::{Check, Outcome};

/// The whole run: what each node runs, and its outcomes.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// Each node and what it runs (its agent's pod, backend, kernel), in words.
    pub about: Vec<(String, String)>,
    pub nodes: Vec<(String, Vec<(Check, Outcome)>)>,
}

impl Report {
    /// Whether any check failed.
    #[must_use]
    pub fn failed(&self) -> bool {
        self.nodes
            .iter()
            .flat_map(|(_, outcomes)| outcomes)
            .any(|(_, o)| matches!(o, Outcome::Fail(_)))
    }
}

impl fmt::Display for Report {
    /// A line per node of what it runs, then one line per node and check (`NODE  CHECK
    /// OUTCOME`, aligned), then the verdict.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (node, about) in &self.about {
            writeln!(f, "{node}: {about}")?;
        }
        let node_width = self
            .nodes
            .iter()
            .map(|(n, _)| n.len())
            .chain(["NODE".len()])
            .max()
            .unwrap_or_default();
        let check_width = Check::ALL
            .iter()
            .map(|c| c.title().len())
            .max()
            .unwrap_or(0);
        writeln!(
            f,
            "{:node_width$}  {:check_width$}  RESULT",
            "NODE", "CHECK"
        )?;
        for (node, outcomes) in &self.nodes {
            for (check, outcome) in outcomes {
                writeln!(
                    f,
                    "{node:node_width$}  {:check_width$}  {outcome}",
                    check.title()
                )?;
            }
        }
        let count = |ok: fn(&Outcome) -> bool| {
            self.nodes
                .iter()
                .flat_map(|(_, o)| o)
                .filter(|(_, o)| ok(o))
                .count()
        };
        write!(
            f,
            "{}: {} ok, {} failed, {} not checked",
            if self.failed() { "FAILED" } else { "PASSED" },
            count(|o| *o == Outcome::Ok),
            count(|o| matches!(o, Outcome::Fail(_))),
            count(|o| matches!(o, Outcome::NotChecked(_))),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_has_a_line_per_check_and_the_verdict() {
        let mut report = Report {
            about: vec![("node-a".into(), "backend iptables".into())],
            nodes: vec![(
                "node-a".into(),
                Check::ALL.map(|c| (c, Outcome::Ok)).to_vec(),
            )],
        };
        let text = report.to_string();
        assert!(
            text.starts_with("node-a: backend iptables\nNODE "),
            "{text}"
        );
        assert!(text.contains("node-a  agent ready         ok"), "{text}");
        assert!(text.contains("node-a  sidecar outbound    ok"), "{text}");
        assert!(
            text.ends_with("PASSED: 11 ok, 0 failed, 0 not checked"),
            "{text}"
        );
        report.nodes[0].1[0].1 = Outcome::Fail("x".into());
        assert!(report.failed());
        let text = report.to_string();
        assert!(
            text.contains("node-a  agent ready         FAIL: x"),
            "{text}"
        );
        assert!(
            text.ends_with("FAILED: 10 ok, 1 failed, 0 not checked"),
            "{text}"
        );
    }
}
