//! Medians, spreads and the Markdown tables the runner prints.
use std::fmt::Write as _;

/// Samples of one metric for one column (one value per round).
#[derive(Clone, Debug, Default)]
pub struct Samples(pub Vec<f64>);

impl Samples {
    /// The median (mean of the middle two for an even count); 0 when empty.
    pub fn median(&self) -> f64 {
        let mut v = self.0.clone();
        if v.is_empty() {
            return 0.0;
        }
        v.sort_by(f64::total_cmp);
        let mid = v.len() / 2;
        if v.len().is_multiple_of(2) {
            f64::midpoint(v[mid - 1], v[mid])
        } else {
            v[mid]
        }
    }

    /// Half the range, relative to the median, in percent: how far rounds strayed.
    pub fn spread_pct(&self) -> f64 {
        let median = self.median();
        let (min, max) = self
            .0
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &x| {
                (lo.min(x), hi.max(x))
            });
        if median == 0.0 || self.0.is_empty() {
            0.0
        } else {
            (max - min) / 2.0 / median * 100.0
        }
    }
}

/// A number as the tables show it: thousands separated, decimals by magnitude.
pub fn human(x: f64) -> String {
    if x == 0.0 {
        return "–".into();
    }
    if x >= 1000.0 {
        let whole = format!("{:.0}", x);
        let mut out = String::new();
        for (i, c) in whole.chars().enumerate() {
            if i > 0 && (whole.len() - i) % 3 == 0 {
                out.push(',');
            }
            out.push(c);
        }
        out
    } else if x >= 100.0 {
        format!("{x:.0}")
    } else if x >= 10.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.2}")
    }
}

/// A count, thousands separated.
pub fn count(n: usize) -> String {
    if n >= 1000 {
        human(n as f64)
    } else {
        n.to_string()
    }
}

/// A table: metric rows × column medians (with their spread), then ratio columns.
pub struct Table {
    /// Column names.
    pub columns: Vec<String>,
    /// Ratio columns: (numerator column, denominator column).
    pub ratios: Vec<(usize, usize)>,
    /// Rows: metric name and one sample set per column.
    pub rows: Vec<(String, Vec<Samples>)>,
}

impl Table {
    /// Markdown: medians with their round-to-round spread, then ratios of medians. A metric
    /// no column measured (a run without ping-pong or bulk) is left out.
    pub fn markdown(&self) -> String {
        let mut out = String::from("| metric |");
        for c in &self.columns {
            let _ = write!(out, " {c} |");
        }
        for (a, b) in &self.ratios {
            let _ = write!(out, " {}/{} |", self.columns[*a], self.columns[*b]);
        }
        out.push_str("\n|---|");
        for _ in 0..self.columns.len() + self.ratios.len() {
            out.push_str("---|");
        }
        out.push('\n');
        for (name, cols) in &self.rows {
            if cols.iter().all(|s| s.median() == 0.0) {
                continue;
            }
            let _ = write!(out, "| {name} |");
            for s in cols {
                if s.0.is_empty() {
                    out.push_str(" n/a |");
                } else {
                    let _ = write!(out, " {} ±{:.0}% |", human(s.median()), s.spread_pct());
                }
            }
            for (a, b) in &self.ratios {
                let (num, den) = (cols[*a].median(), cols[*b].median());
                if num == 0.0 || den == 0.0 {
                    out.push_str(" n/a |");
                } else {
                    let _ = write!(out, " {:.2} |", num / den);
                }
            }
            out.push('\n');
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_and_spreads() {
        assert_eq!(Samples(vec![3.0, 1.0, 2.0]).median(), 2.0);
        assert_eq!(Samples(vec![4.0, 1.0, 2.0, 3.0]).median(), 2.5);
        assert_eq!(Samples(Vec::new()).median(), 0.0);
        assert_eq!(Samples(vec![90.0, 100.0, 110.0]).spread_pct(), 10.0);
    }

    #[test]
    fn numbers_read_like_the_tables() {
        assert_eq!(human(24_502.4), "24,502");
        assert_eq!(human(1_234_567.0), "1,234,567");
        assert_eq!(human(174.2), "174");
        assert_eq!(human(31.54), "31.5");
        assert_eq!(human(5.071), "5.07");
        assert_eq!(count(1), "1");
        assert_eq!(count(10_000), "10,000");
    }

    #[test]
    fn ratios_are_ratios_of_medians() {
        let table = Table {
            columns: vec!["a".into(), "b".into()],
            ratios: vec![(1, 0)],
            rows: vec![(
                "m".into(),
                vec![
                    Samples(vec![10.0, 20.0, 30.0]),
                    Samples(vec![5.0, 10.0, 15.0]),
                ],
            )],
        };
        let text = table.markdown();
        assert!(
            text.contains("| m | 20.0 ±50% | 10.0 ±50% | 0.50 |"),
            "{text}"
        );
    }
}
