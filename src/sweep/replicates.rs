//! Replicates (a grid's `seeds`): the cells of one setting that differ only in `train.seed`,
//! summarised per metric (`replicates.csv`: n, mean, standard deviation, 95 % interval), and
//! every two settings of a stage compared per metric (`replicate_differences.csv`: the
//! difference of their means with its 95 % Welch interval, and whether that interval holds 0,
//! "within noise"), and every two settings of different train stages compared on loss and
//! attended pairs (`stage_differences.csv`: one method against another at its own budget,
//! the comparison a Pareto grid's verdicts rest on).

use crate::util::atomic;
use crate::util::stats::{summarize, welch_difference, Summary};
use anyhow::Result;
use std::collections::BTreeMap;
use std::path::Path;

/// One measured value of one cell: its stage, method, setting (its label without the seed,
/// which its replicates share: `Row::setting_text`), metric and value.
pub(crate) struct Measured<'a> {
    pub(crate) stage: &'a str,
    /// The stage's kind (`train`, `eval`, `prune`).
    pub(crate) kind: &'a str,
    pub(crate) method: &'a str,
    pub(crate) setting: &'a str,
    pub(crate) metric: &'a str,
    pub(crate) value: f64,
}

type Key = (String, String, String, String);

/// The metrics `stage_differences.csv` compares across train stages: quality, and the work
/// that bought it.
const ACROSS_STAGES: [&str; 2] = ["loss", "pairs_vs_full"];

/// The values of each (stage, metric, setting, method), in the order the cells came.
fn groups(values: &[Measured]) -> BTreeMap<Key, Vec<f64>> {
    let mut g: BTreeMap<Key, Vec<f64>> = BTreeMap::new();
    for m in values {
        g.entry((
            m.stage.into(),
            m.metric.into(),
            m.setting.into(),
            m.method.into(),
        ))
        .or_default()
        .push(m.value);
    }
    g
}

fn num(x: f64) -> String {
    if x.is_finite() {
        format!("{x}")
    } else {
        String::new()
    }
}

/// Writes both tables into `out` when some setting has more than one replicate, else removes
/// tables an earlier run left; returns the files written.
pub(crate) fn write(values: &[Measured], out: &Path) -> Result<Vec<std::path::PathBuf>> {
    let groups = groups(values);
    let (summary_path, diff_path, across_path) = (
        out.join("replicates.csv"),
        out.join("replicate_differences.csv"),
        out.join("stage_differences.csv"),
    );
    if groups.values().all(|v| v.len() < 2) {
        for p in [&summary_path, &diff_path, &across_path] {
            if p.exists() {
                std::fs::remove_file(p)?;
            }
        }
        return Ok(vec![]);
    }
    let summaries: BTreeMap<&Key, Summary> =
        groups.iter().map(|(k, v)| (k, summarize(v))).collect();
    let rows: Vec<Vec<String>> = summaries
        .iter()
        .map(|((stage, metric, setting, method), s)| {
            vec![
                stage.clone(),
                metric.clone(),
                setting.clone(),
                method.clone(),
                s.n.to_string(),
                num(s.mean),
                num(s.sd),
                num(s.mean - s.half_width),
                num(s.mean + s.half_width),
            ]
        })
        .collect();
    let header = [
        "stage",
        "metric",
        "setting",
        "method",
        "n",
        "mean",
        "sd",
        "ci95_low",
        "ci95_high",
    ];
    atomic::write_csv(&summary_path, &header, &rows)?;
    let all: Vec<(&&Key, &Summary)> = summaries.iter().collect();
    let mut diffs: Vec<Vec<String>> = Vec::new();
    for (i, (ka, a)) in all.iter().enumerate() {
        // Settings of one stage and metric only.
        for (kb, b) in all[i + 1..]
            .iter()
            .filter(|(kb, _)| (&ka.0, &ka.1) == (&kb.0, &kb.1))
        {
            let mut row = vec![ka.0.clone(), ka.1.clone(), named(ka), named(kb)];
            row.extend(compared(a, b));
            diffs.push(row);
        }
    }
    let header = [
        "stage",
        "metric",
        "setting_a",
        "setting_b",
        "difference",
        "ci95_low",
        "ci95_high",
        "verdict",
    ];
    atomic::write_csv(&diff_path, &header, &diffs)?;
    let mut written = vec![summary_path, diff_path];
    let kinds: BTreeMap<&str, &str> = values.iter().map(|m| (m.stage, m.kind)).collect();
    let trained = |k: &Key| kinds.get(k.0.as_str()) == Some(&"train");
    let mut across: Vec<Vec<String>> = Vec::new();
    for metric in ACROSS_STAGES {
        let of_metric: Vec<&(&&Key, &Summary)> = all
            .iter()
            .filter(|(k, _)| k.1 == metric && trained(k))
            .collect();
        for (i, (ka, a)) in of_metric.iter().enumerate() {
            for (kb, b) in of_metric[i + 1..].iter().filter(|(kb, _)| kb.0 != ka.0) {
                let mut row = vec![
                    metric.to_string(),
                    ka.0.clone(),
                    named(ka),
                    kb.0.clone(),
                    named(kb),
                ];
                row.extend(compared(a, b));
                across.push(row);
            }
        }
    }
    if across.is_empty() {
        if across_path.exists() {
            std::fs::remove_file(&across_path)?;
        }
    } else {
        let header = [
            "metric",
            "stage_a",
            "setting_a",
            "stage_b",
            "setting_b",
            "difference",
            "ci95_low",
            "ci95_high",
            "verdict",
        ];
        atomic::write_csv(&across_path, &header, &across)?;
        written.push(across_path);
    }
    Ok(written)
}

/// A setting as the difference tables name it: its settings, then its method in brackets.
fn named(k: &Key) -> String {
    format!("{} ({})", k.2, k.3).trim_start().to_string()
}

/// a's mean less b's with its 95 % Welch interval, and the verdict: "differs" where the
/// interval excludes 0, "within noise" where it holds it, "one replicate" where a side has
/// no spread to measure.
fn compared(a: &Summary, b: &Summary) -> [String; 4] {
    let (d, h) = welch_difference(a, b);
    let verdict = if h.is_nan() {
        "one replicate"
    } else if d.abs() <= h {
        "within noise"
    } else {
        "differs"
    };
    [num(d), num(d - h), num(d + h), verdict.into()]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two settings of three seeds each: the summary has n 3 and Student's interval, the
    /// difference is within noise when the intervals of the difference holds 0 and differs
    /// when it does not; one seed writes nothing (and removes a stale table).
    #[test]
    fn replicates_are_summarised_and_compared() {
        let dir = std::env::temp_dir().join(format!("attnsweep-repl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let m = |setting: &'static str, metric: &'static str, value| Measured {
            stage: "aha",
            kind: "train",
            method: "aha",
            setting,
            metric,
            value,
        };
        // Three seeds of each setting.
        let values = vec![
            m("attention.window=8", "loss", 1.0),
            m("attention.window=8", "loss", 1.1),
            m("attention.window=8", "loss", 1.2),
            m("attention.window=16", "loss", 1.05),
            m("attention.window=16", "loss", 1.15),
            m("attention.window=16", "loss", 1.25),
            m("attention.window=8", "mu_f", 0.10),
            m("attention.window=8", "mu_f", 0.11),
            m("attention.window=8", "mu_f", 0.12),
            m("attention.window=16", "mu_f", 0.50),
            m("attention.window=16", "mu_f", 0.51),
            m("attention.window=16", "mu_f", 0.52),
        ];
        assert_eq!(write(&values, &dir).unwrap().len(), 2);
        let summary = std::fs::read_to_string(dir.join("replicates.csv")).unwrap();
        let row = summary
            .lines()
            .find(|l| l.starts_with("aha,loss,attention.window=8,"))
            .unwrap();
        let f: Vec<&str> = row.split(',').collect();
        assert_eq!(f[4], "3");
        let (mean, low): (f64, f64) = (f[5].parse().unwrap(), f[7].parse().unwrap());
        assert!(
            (mean - 1.1).abs() < 1e-12 && (mean - low - 4.303 * 0.1 / 3f64.sqrt()).abs() < 1e-9
        );
        let diffs = std::fs::read_to_string(dir.join("replicate_differences.csv")).unwrap();
        let verdict = |metric: &str| {
            diffs
                .lines()
                .find(|l| l.starts_with(&format!("aha,{metric},")))
                .unwrap()
                .rsplit(',')
                .next()
                .unwrap()
                .to_string()
        };
        assert_eq!(verdict("loss"), "within noise");
        assert_eq!(verdict("mu_f"), "differs");
        assert_eq!(diffs.lines().count(), 3, "one pair per metric");
        // One stage: nothing to compare across stages.
        assert!(!dir.join("stage_differences.csv").exists());
        // Another train stage and an eval stage: each aha setting against the swa one, on
        // loss; the eval stage and the metrics other than loss and pairs stay out.
        let other = |stage: &'static str, kind: &'static str, metric, value| Measured {
            stage,
            kind,
            method: stage,
            setting: "",
            metric,
            value,
        };
        let mut more: Vec<Measured> = values.iter().map(|v| Measured { ..*v }).collect();
        for loss in [2.0, 2.1, 2.2] {
            more.push(other("swa", "train", "loss", loss));
            more.push(other("swa", "train", "mu_f", 0.3));
            more.push(other("swa", "train", "pairs_vs_full", 0.5));
            more.push(other("full", "train", "pairs_vs_full", 1.0));
            more.push(other("probes", "eval", "loss", 0.5));
        }
        write(&more, &dir).unwrap();
        let across = std::fs::read_to_string(dir.join("stage_differences.csv")).unwrap();
        let rows: Vec<Vec<&str>> = across
            .lines()
            .skip(1)
            .map(|l| l.split(',').collect())
            .collect();
        // Pairs are fixed costs: replicated without spread, their difference is exact.
        let (pairs, rows): (Vec<_>, Vec<_>) =
            rows.into_iter().partition(|r| r[0] == "pairs_vs_full");
        assert_eq!(pairs.len(), 1, "{across}");
        assert_eq!(
            (
                pairs[0][1],
                pairs[0][3],
                pairs[0][5],
                pairs[0][6],
                pairs[0][8]
            ),
            ("full", "swa", "0.5", "0.5", "differs")
        );
        assert_eq!(rows.len(), 2, "{across}");
        for r in &rows {
            assert_eq!((r[0], r[1], r[3]), ("loss", "aha", "swa"));
            // aha's losses (1.0-1.25) against swa's (2.0-2.2).
            assert!(
                (-1.1..-0.7).contains(&r[5].parse::<f64>().unwrap()),
                "{r:?}"
            );
            assert_eq!(r[8], "differs");
        }
        // The first seed of each setting alone.
        let single: Vec<Measured> = values.into_iter().step_by(3).collect();
        assert!(write(&single, &dir).unwrap().is_empty());
        assert!(!dir.join("replicates.csv").exists());
        assert!(!dir.join("stage_differences.csv").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
