//! Replicates (a grid's `seeds`): the cells of one setting that differ only in `train.seed`,
//! summarised per metric (`replicates.csv`: n, mean, standard deviation, 95 % interval), and
//! every two settings of a stage compared per metric (`replicate_differences.csv`), and every
//! two settings of different train stages compared on loss and attended pairs
//! (`stage_differences.csv`: one method against another at its own budget, the comparison a
//! Pareto grid's verdicts rest on).
//!
//! Intervals: Student's t over the replicates; for a quantity bounded to a range (usage,
//! accuracies, precision and recall, probe scores) the same on the logit scale, so they stay
//! inside it; for a probe score with its prompts' outcomes, a two-level bootstrap over the
//! replicates and their prompts (the prompts differ by seed). Differences: Welch's test; a
//! probe score of two settings on the same prompts (the same seeds) paired: one seed's 0/1
//! scores by exact McNemar's test, several seeds by the paired bootstrap's own p (each seed
//! a pair of separate models, whose spread the prompts alone do not hold). Each table carries the raw verdict and the one after Holm's
//! adjustment over all its rows; a side with one replicate is "one replicate", two sides
//! without spread on a metric the configuration does not fix are "no spread measured".

use crate::util::atomic;
use crate::util::stats::{
    holm, mean_interval, paired_bootstrap, paired_difference, pooled_interval, summarize,
    unpaired_difference, welch_test, Summary,
};
use anyhow::Result;
use std::collections::BTreeMap;
use std::path::Path;

/// One measured value of one cell: its stage, method, setting (its label without the seed,
/// which its replicates share: `Row::setting_text`), seed, metric and value, with the
/// per-prompt scores behind a probe metric.
pub(crate) struct Measured<'a> {
    /// The cell it was measured in ("" where unknown): a cell several stages share is a
    /// replicate of each, and two stages holding the same cell are not compared as apart.
    pub(crate) cell: &'a str,
    pub(crate) stage: &'a str,
    /// The stage's kind (`train`, `eval`, `prune`).
    pub(crate) kind: &'a str,
    pub(crate) method: &'a str,
    pub(crate) setting: &'a str,
    /// The replicate's `train.seed`: settings at one seed were probed with the same prompts.
    pub(crate) seed: &'a str,
    pub(crate) metric: &'a str,
    pub(crate) value: f64,
    /// A probe score's per-prompt values, in the prompts' order; None for other metrics.
    pub(crate) prompts: Option<&'a [f64]>,
}

type Key = (String, String, String, String);

/// One replicate of a setting: its cell, seed, value and probe prompts' scores.
struct Rep<'a> {
    cell: &'a str,
    seed: &'a str,
    value: f64,
    prompts: Option<&'a [f64]>,
}

/// The metrics `stage_differences.csv` compares across train stages: quality, and the work
/// that bought it.
const ACROSS_STAGES: [&str; 2] = ["loss", "pairs_vs_full"];

/// Metrics a cell's configuration and data fix (the pairs a window attends, its cache, the
/// baselines of chance and the ASK rule): replicates without spread on both sides differ
/// exactly, whatever their count.
const FIXED_COSTS: [&str; 8] = [
    "pairs_vs_full",
    "attention_flops",
    "kv_cache_bytes",
    "kv_cache_bytes_before",
    "pruned_layers",
    "chance_precision",
    "ask_rule_precision",
    "ask_rule_recall",
];

/// The range of a bounded metric: usage, attended pairs' share, accuracies, precision and
/// recall, probe, RULER and multiple-choice scores lie in [0, 1]; rates, counts, bytes,
/// perplexity and retain % above 0 (`(0, inf)`); None for the rest (losses and their
/// differences, which no interval brings near a bound).
pub(crate) fn bounds(metric: &str) -> Option<(f64, f64)> {
    const UNIT: [&str; 9] = [
        "mu_f",
        "pairs_vs_full",
        "gate_precision",
        "gate_recall",
        "chance_precision",
        "ask_rule_precision",
        "ask_rule_recall",
        "far_accuracy",
        "full_ratio",
    ];
    const POSITIVE: [&str; 7] = [
        "tokens_per_s",
        "perplexity",
        "retain_pct",
        "kv_cache_bytes",
        "kv_cache_bytes_before",
        "attention_flops",
        "censored_heads",
    ];
    let task_score = metric.contains('.')
        && ([
            "exact_match",
            "recall",
            "span_recall",
            "prompt_gate",
            "full_ratio",
            "acc",
            "acc_norm",
        ]
        .iter()
        .any(|m| metric.ends_with(&format!(".{m}")))
            || metric.starts_with("ruler.score_"));
    if UNIT.contains(&metric) || task_score {
        Some((0.0, 1.0))
    } else {
        POSITIVE.contains(&metric).then_some((0.0, f64::INFINITY))
    }
}

/// The replicates of each (stage, metric, setting, method), in the order the cells came.
fn groups<'a>(values: &'a [Measured<'a>]) -> BTreeMap<Key, Vec<Rep<'a>>> {
    let mut g: BTreeMap<Key, Vec<Rep>> = BTreeMap::new();
    for m in values {
        g.entry((
            m.stage.into(),
            m.metric.into(),
            m.setting.into(),
            m.method.into(),
        ))
        .or_default()
        .push(Rep {
            cell: m.cell,
            seed: m.seed,
            value: m.value,
            prompts: m.prompts,
        });
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

/// The per-prompt scores of every replicate, where each has them.
fn prompt_groups(reps: &[Rep]) -> Option<Vec<Vec<f64>>> {
    reps.iter()
        .map(|r| r.prompts.filter(|p| !p.is_empty()).map(<[f64]>::to_vec))
        .collect()
}

/// How `replicates.csv` names an interval drawn over the probes' prompts, which only the
/// cells' records (not `tidy.csv`) hold.
pub(crate) const OVER_PROMPTS: &str = "bootstrap over seeds and prompts";

/// A setting's row of `replicates.csv`: n, mean, sd, the 95 % interval and how it was drawn.
fn summary_row(metric: &str, reps: &[Rep]) -> [String; 6] {
    let values: Vec<f64> = reps.iter().map(|r| r.value).collect();
    let s = summarize(&values);
    let ((lo, hi), how) = match prompt_groups(reps) {
        Some(g) => (pooled_interval(&g), OVER_PROMPTS),
        None => (
            mean_interval(&values, bounds(metric)),
            match bounds(metric) {
                Some((_, hi)) if hi.is_finite() => "Student's t on the logit scale",
                Some(_) if values.iter().all(|&v| v > 0.0) => "Student's t on the log scale",
                Some(_) => "Student's t cut at 0",
                None => "Student's t",
            },
        ),
    };
    let how = if s.n == 1 && prompt_groups(reps).is_none() {
        "one replicate"
    } else {
        how
    };
    [
        s.n.to_string(),
        num(s.mean),
        num(s.sd),
        num(lo),
        num(hi),
        how.into(),
    ]
}

/// Writes the tables into `out` when some setting has more than one replicate, else removes
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
    let rows: Vec<Vec<String>> = groups
        .iter()
        .map(|((stage, metric, setting, method), reps)| {
            let mut row = vec![
                stage.clone(),
                metric.clone(),
                setting.clone(),
                method.clone(),
            ];
            row.extend(summary_row(metric, reps));
            row
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
        "interval",
    ];
    atomic::write_csv(&summary_path, &header, &rows)?;
    let all: Vec<(&Key, &Vec<Rep>)> = groups.iter().collect();
    let mut diffs: Vec<Vec<String>> = Vec::new();
    for (i, (ka, a)) in all.iter().enumerate() {
        // Settings of one stage and metric only.
        for (kb, b) in all[i + 1..]
            .iter()
            .filter(|(kb, _)| (&ka.0, &ka.1) == (&kb.0, &kb.1))
        {
            let mut row = vec![ka.0.clone(), ka.1.clone(), named(ka), named(kb)];
            row.extend(compared(&ka.1, a, b));
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
        "p",
        "verdict",
        "p_holm",
        "verdict_holm",
        "test",
    ];
    atomic::write_csv(&diff_path, &header, &with_holm(diffs))?;
    let mut written = vec![summary_path, diff_path];
    let kinds: BTreeMap<&str, &str> = values.iter().map(|m| (m.stage, m.kind)).collect();
    let trained = |k: &Key| kinds.get(k.0.as_str()) == Some(&"train");
    let mut across: Vec<Vec<String>> = Vec::new();
    for metric in ACROSS_STAGES {
        let of_metric: Vec<&(&Key, &Vec<Rep>)> = all
            .iter()
            .filter(|(k, _)| k.1 == metric && trained(k))
            .collect();
        for (i, (ka, a)) in of_metric.iter().enumerate() {
            // Two stages that share a cell (one computation listed in both) are not two
            // samples: their difference is not tested.
            let shares = |b: &[Rep]| {
                a.iter()
                    .any(|x| !x.cell.is_empty() && b.iter().any(|y| y.cell == x.cell))
            };
            for (kb, b) in of_metric[i + 1..]
                .iter()
                .filter(|(kb, b)| kb.0 != ka.0 && !shares(b))
            {
                let mut row = vec![
                    metric.to_string(),
                    ka.0.clone(),
                    named(ka),
                    kb.0.clone(),
                    named(kb),
                ];
                row.extend(compared(metric, a, b));
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
            "p",
            "verdict",
            "p_holm",
            "verdict_holm",
            "test",
        ];
        atomic::write_csv(&across_path, &header, &with_holm(across))?;
        written.push(across_path);
    }
    Ok(written)
}

/// A setting as the difference tables name it: its settings, then its method in brackets.
fn named(k: &Key) -> String {
    format!("{} ({})", k.2, k.3).trim_start().to_string()
}

/// The adjusted verdict of a test at 5 %: "differs" where the raw verdict did (its interval
/// leaves 0 out) and the adjusted p is below 0.05, else "within noise" (an interval widened
/// to hold the binomial one can keep 0 while the bootstrap's p is small); a verdict that is
/// not a test's ("one replicate", "no spread measured") stands as it is.
fn verdict_of(p: f64, raw: &str) -> String {
    match (raw, p.is_nan()) {
        ("differs", false) if p < 0.05 => "differs".into(),
        ("differs" | "within noise", false) => "within noise".into(),
        _ => raw.into(),
    }
}

/// `rows` (each ending p, verdict, test) with Holm's adjusted p and verdict inserted before
/// the test, over every row of the table.
fn with_holm(rows: Vec<Vec<String>>) -> Vec<Vec<String>> {
    let n = |r: &Vec<String>| r.len();
    let ps: Vec<f64> = rows
        .iter()
        .map(|r| r[n(r) - 3].parse().unwrap_or(f64::NAN))
        .collect();
    let adjusted = holm(&ps);
    rows.into_iter()
        .zip(adjusted)
        .map(|(mut r, p)| {
            let test = r.pop().expect("a test name");
            let raw = r.last().cloned().unwrap_or_default();
            r.push(num(p));
            r.push(verdict_of(p, &raw));
            r.push(test);
            r
        })
        .collect()
}

/// a less b on `metric`: the difference, its 95 % interval, the test's p, the verdict and
/// the test. A probe score with its prompts: paired over the prompts the two share (the
/// same seeds), else unpaired, both bootstrapped over seeds and prompts; other metrics by
/// Welch's test of the replicates' values.
fn compared(metric: &str, a: &[Rep], b: &[Rep]) -> [String; 6] {
    if let (Some(ga), Some(gb)) = (prompt_groups(a), prompt_groups(b)) {
        let pairs: Vec<Vec<(f64, f64)>> = a
            .iter()
            .zip(&ga)
            .filter_map(|(ra, pa)| {
                let pb = b.iter().zip(&gb).find(|(rb, _)| rb.seed == ra.seed)?.1;
                (pa.len() == pb.len()).then(|| pa.iter().copied().zip(pb.iter().copied()).collect())
            })
            .collect();
        let paired = pairs.len() == a.len() && pairs.len() == b.len();
        let ((d, lo, hi, p), test) = match (paired, pairs.len()) {
            (true, 1) => (
                paired_difference(&pairs),
                "paired over prompts (McNemar or bootstrap)",
            ),
            (true, _) => (
                paired_bootstrap(&pairs),
                "paired over seeds and prompts: bootstrap",
            ),
            (false, _) => (
                unpaired_difference(&ga, &gb),
                "unpaired bootstrap over seeds and prompts",
            ),
        };
        let raw = if lo <= 0.0 && hi >= 0.0 {
            "within noise"
        } else {
            "differs"
        };
        return [num(d), num(lo), num(hi), num(p), raw.into(), test.into()];
    }
    let va: Vec<f64> = a.iter().map(|r| r.value).collect();
    let vb: Vec<f64> = b.iter().map(|r| r.value).collect();
    let (sa, sb): (Summary, Summary) = (summarize(&va), summarize(&vb));
    let (d, h, p) = welch_test(&sa, &sb);
    let no_spread = h == 0.0 && !FIXED_COSTS.contains(&metric);
    let (verdict, p) = if h.is_nan() {
        ("one replicate", f64::NAN)
    } else if no_spread {
        ("no spread measured", f64::NAN)
    } else if d.abs() <= h {
        ("within noise", p)
    } else {
        ("differs", p)
    };
    [
        num(d),
        num(d - h),
        num(d + h),
        num(p),
        verdict.into(),
        "Welch".into(),
    ]
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
        let m = |setting: &'static str, seed, metric: &'static str, value| Measured {
            cell: "",
            stage: "aha",
            kind: "train",
            method: "aha",
            setting,
            seed,
            metric,
            value,
            prompts: None,
        };
        // Three seeds of each setting.
        let values = vec![
            m("attention.window=8", "1", "loss", 1.0),
            m("attention.window=8", "2", "loss", 1.1),
            m("attention.window=8", "3", "loss", 1.2),
            m("attention.window=16", "1", "loss", 1.05),
            m("attention.window=16", "2", "loss", 1.15),
            m("attention.window=16", "3", "loss", 1.25),
            m("attention.window=8", "1", "mu_f", 0.10),
            m("attention.window=8", "2", "mu_f", 0.11),
            m("attention.window=8", "3", "mu_f", 0.12),
            m("attention.window=16", "1", "mu_f", 0.50),
            m("attention.window=16", "2", "mu_f", 0.51),
            m("attention.window=16", "3", "mu_f", 0.52),
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
            let row: Vec<&str> = diffs
                .lines()
                .find(|l| l.starts_with(&format!("aha,{metric},")))
                .unwrap()
                .split(',')
                .collect();
            row[8].to_string()
        };
        assert_eq!(verdict("loss"), "within noise");
        assert_eq!(verdict("mu_f"), "differs");
        assert_eq!(diffs.lines().count(), 3, "one pair per metric");
        // One stage: nothing to compare across stages.
        assert!(!dir.join("stage_differences.csv").exists());
        // Another train stage and an eval stage: each aha setting against the swa one, on
        // loss; the eval stage and the metrics other than loss and pairs stay out.
        let other = |stage: &'static str, kind: &'static str, metric, value| Measured {
            cell: "",
            stage,
            kind,
            method: stage,
            setting: "",
            seed: "1",
            metric,
            value,
            prompts: None,
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
                pairs[0][9]
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
            assert_eq!(r[9], "differs");
        }
        // The first seed of each setting alone.
        let single: Vec<Measured> = values.into_iter().step_by(3).collect();
        assert!(write(&single, &dir).unwrap().is_empty());
        assert!(!dir.join("replicates.csv").exists());
        assert!(!dir.join("stage_differences.csv").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Holm's verdict differs only where the raw one did: an interval that holds 0 (widened to
    /// the binomial one) stays within noise whatever the bootstrap's p; a verdict that is no
    /// test's stands.
    #[test]
    fn adjusted_verdicts_follow_the_interval() {
        assert_eq!(verdict_of(0.01, "differs"), "differs");
        assert_eq!(verdict_of(0.2, "differs"), "within noise");
        assert_eq!(verdict_of(0.01, "within noise"), "within noise");
        assert_eq!(verdict_of(f64::NAN, "one replicate"), "one replicate");
    }

    /// A bounded rate keeps its interval inside [0, 1]; a probe score pools its replicates'
    /// prompts and compares two settings paired over the prompts their seeds share (exact
    /// McNemar for 0/1 scores); Holm's adjustment can turn a raw "differs" to "within noise";
    /// loss without spread on both sides is "no spread measured", not exact.
    #[test]
    fn bounded_probe_and_adjusted_verdicts() {
        let dir = crate::util::scratch_dir("repl-bounded");
        let prompts: Vec<Vec<f64>> = vec![
            vec![1.0; 10],
            vec![1.0; 10],
            vec![0.0; 10],
            vec![1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        ];
        let m = |setting: &'static str, seed, metric: &'static str, value, prompts| Measured {
            cell: "",
            stage: "probe",
            kind: "eval",
            method: "aha",
            setting,
            seed,
            metric,
            value,
            prompts,
        };
        let values = vec![
            // L2A-like usage, near 0: Student's t would go below it.
            m("w=8", "1", "mu_f", 0.001, None),
            m("w=8", "2", "mu_f", 0.002, None),
            m("w=8", "3", "mu_f", 0.019, None),
            m("w=16", "1", "mu_f", 0.001, None),
            m("w=16", "2", "mu_f", 0.001, None),
            m("w=16", "3", "mu_f", 0.001, None),
            // One setting finds every needle at both seeds, the other one in ten.
            m("w=8", "1", "niah.exact_match", 1.0, Some(&prompts[0][..])),
            m("w=8", "2", "niah.exact_match", 1.0, Some(&prompts[1][..])),
            m("w=16", "1", "niah.exact_match", 0.0, Some(&prompts[2][..])),
            m("w=16", "2", "niah.exact_match", 0.1, Some(&prompts[3][..])),
            // Losses that agree to the digit at every seed.
            m("w=8", "1", "loss", 2.0, None),
            m("w=8", "2", "loss", 2.0, None),
            m("w=16", "1", "loss", 2.5, None),
            m("w=16", "2", "loss", 2.5, None),
        ];
        write(&values, &dir).unwrap();
        let read = |f: &str| -> Vec<Vec<String>> {
            let mut r = csv::Reader::from_path(dir.join(f)).unwrap();
            r.records()
                .map(|x| x.unwrap().iter().map(String::from).collect())
                .collect()
        };
        let summary = read("replicates.csv");
        let row = |metric: &str, setting: &str| {
            summary
                .iter()
                .find(|r| r[1] == metric && r[2] == setting)
                .unwrap()
                .clone()
        };
        let usage = row("mu_f", "w=8");
        let low: f64 = usage[7].parse().unwrap();
        assert!(
            low > 0.0 && usage[9] == "Student's t on the logit scale",
            "{usage:?}"
        );
        assert_eq!(row("mu_f", "w=16")[7], "0.001");
        let niah = row("niah.exact_match", "w=16");
        let (lo, hi): (f64, f64) = (niah[7].parse().unwrap(), niah[8].parse().unwrap());
        assert!(lo >= 0.0 && hi > 0.05 && hi <= 1.0, "{niah:?}");
        assert_eq!(niah[9], "bootstrap over seeds and prompts");
        let diffs = read("replicate_differences.csv");
        let diff = |metric: &str| diffs.iter().find(|r| r[1] == metric).unwrap().clone();
        let probe = diff("niah.exact_match");
        // 19 prompts only a found, none only b, over two seeds: the bootstrap's own p (no
        // redrawn mean at or below 0), not McNemar's 2 / 2^19 over the pooled prompts.
        assert_eq!(probe[11], "paired over seeds and prompts: bootstrap");
        let p: f64 = probe[7].parse().unwrap();
        assert!(
            p < 0.001 && (p - 2.0 / 524_288.0).abs() > 1e-15,
            "{probe:?}"
        );
        assert_eq!(
            (probe[8].as_str(), probe[10].as_str()),
            ("differs", "differs")
        );
        assert_eq!(diff("loss")[8], "no spread measured");
        // Three tests, the usage's raw p near 0.3: Holm leaves it within noise, p at most 1.
        let usage = diff("mu_f");
        let (p, ph): (f64, f64) = (usage[7].parse().unwrap(), usage[9].parse().unwrap());
        assert!(ph >= p && ph <= 1.0, "{usage:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
