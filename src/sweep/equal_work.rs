//! Every method against a plain sliding window at equal work. The pareto grids sweep SWA's
//! window across the other methods' attended pairs rather than tune a window to each
//! (`sweeps/gpu/pareto_budget.toml`), so a method's equal-work baseline is read off the line,
//! in log pairs, between the two windows whose pairs bracket its own; nothing outside the
//! windows' span is extrapolated. A window's loss falls as a convex curve of its pairs, even
//! in log pairs, so the line lies on or above the curve: a method reads at most as far above
//! a window, and at least as far below, as it would against a window tuned to its pairs.
//! The difference gets a 95 % interval over both sides' replicates (a weighted sum of three
//! independent means, Welch-Satterthwaite degrees of freedom), conditional on the setting's
//! mean pairs, and Holm's adjustment over the table.

use super::grid::StageKind;
use super::pareto;
use super::rows::Row;
use crate::config::Method;
use crate::util::stats::{holm, summarize, t975, t_test_p, Summary};
use anyhow::Result;
use polars::prelude::*;

/// Pairs closer than this (relative) are the same pairs: a mean over replicates of one
/// window's pairs rounds in the last digits.
const SAME: f64 = 1e-9;

/// One setting's replicates: its attended pairs (the mean over them) and their losses.
#[derive(Clone, Debug)]
pub(crate) struct Setting {
    pub(crate) name: String,
    pub(crate) pairs: f64,
    pub(crate) losses: Vec<f64>,
}

/// A setting compared with the window line at its pairs.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Comparison {
    /// The windows with weight in the line at the setting's pairs (one where it sits on a
    /// window's pairs), and the second one's weight.
    pub(crate) between: Vec<String>,
    pub(crate) weight: f64,
    /// The fewest replicates of a window with weight.
    pub(crate) window_replicates: usize,
    pub(crate) reference: f64,
    /// The setting's mean loss less the reference, with its 95 % interval and Student's p;
    /// NaN where a side with weight has one replicate or none has spread.
    pub(crate) difference: f64,
    pub(crate) interval: (f64, f64),
    pub(crate) p: f64,
}

/// `s` against the window line through `windows` (any order, distinct pairs); None outside
/// their pairs.
pub(crate) fn compare(s: &Setting, windows: &[Setting]) -> Option<Comparison> {
    let mut w: Vec<&Setting> = windows.iter().filter(|w| w.pairs > 0.0).collect();
    w.sort_by(|a, b| a.pairs.total_cmp(&b.pairs));
    let inside = |lo: f64, hi: f64| lo * (1.0 - SAME) <= s.pairs && s.pairs <= hi * (1.0 + SAME);
    let k = w
        .windows(2)
        .position(|ab| inside(ab[0].pairs, ab[1].pairs))?;
    let (a, b) = (w[k], w[k + 1]);
    let t = ((s.pairs.ln() - a.pairs.ln()) / (b.pairs.ln() - a.pairs.ln())).clamp(0.0, 1.0);
    let t = match t {
        _ if t < SAME => 0.0,
        _ if t > 1.0 - SAME => 1.0,
        _ => t,
    };
    let sides: Vec<(f64, &Setting)> = [(1.0 - t, a), (t, b)]
        .into_iter()
        .filter(|(c, _)| *c != 0.0)
        .collect();
    // The difference is a weighted sum of three independent means: its variance is the sum
    // of each one's squared weight times its variance of the mean.
    let terms: Vec<(f64, Summary)> = std::iter::once((1.0, summarize(&s.losses)))
        .chain(sides.iter().map(|(c, w)| (-c, summarize(&w.losses))))
        .collect();
    let difference: f64 = terms.iter().map(|(c, m)| c * m.mean).sum();
    let var: Vec<f64> = terms
        .iter()
        .map(|(c, m)| c * c * m.sd.powi(2) / m.n as f64)
        .collect();
    let se = var.iter().sum::<f64>().sqrt();
    let (interval, p) = match se {
        // One replicate on a side with weight, or no spread anywhere (as `replicates.csv`
        // says "no spread measured" of a loss): no test.
        _ if se.is_nan() || se == 0.0 => ((f64::NAN, f64::NAN), f64::NAN),
        _ => {
            let df = se.powi(4)
                / terms
                    .iter()
                    .zip(&var)
                    .map(|((_, m), v)| v * v / (m.n as f64 - 1.0))
                    .sum::<f64>();
            let h = t975(df) * se;
            (
                (difference - h, difference + h),
                t_test_p(difference / se, df),
            )
        }
    };
    Some(Comparison {
        between: sides.iter().map(|(_, w)| w.name.clone()).collect(),
        weight: t,
        window_replicates: sides.iter().map(|(_, w)| w.losses.len()).min()?,
        // The window terms carry minus their weights.
        reference: terms[1..].iter().map(|(c, m)| -c * m.mean).sum(),
        difference,
        interval,
        p,
    })
}

/// "differs" where the test rejects at 5 % and the interval leaves out 0 (its quantile is
/// the table's at the degrees of freedom rounded down, the test's exact: both must agree),
/// "within noise" otherwise, "one replicate" without a test.
fn verdict(p: f64, c: &Comparison) -> &'static str {
    let (lo, hi) = c.interval;
    match p {
        _ if p.is_nan() => "one replicate",
        _ if p < 0.05 && (lo > 0.0 || hi < 0.0) => "differs",
        _ => "within noise",
    }
}

/// `equal_work.csv`: each trained or evaluated setting of the comparison
/// (`pareto::comparable`) that is not one of the windows, against the window line at its
/// pairs. The windows are the SWA stage with the most trained settings (the grid's window
/// axis; another SWA stage, such as a control with frozen weights, is compared like any
/// method). None without two windows or nothing inside their span.
pub(crate) fn table(rows: &[Row]) -> Result<Option<DataFrame>> {
    let rows = pareto::comparable(rows);
    let settings: Vec<(&Row, Setting)> = pareto::by_setting(&rows)
        .into_iter()
        .map(|(first, reps)| {
            let name = format!("{} {}", pareto::family(first), pareto::settings(first));
            let pairs = reps.iter().map(|r| r.pairs_vs_full()).sum::<f64>() / reps.len() as f64;
            let losses = reps.iter().map(|r| r.loss()).collect();
            let name = name.trim().to_string();
            (
                first,
                Setting {
                    name,
                    pairs,
                    losses,
                },
            )
        })
        .collect();
    let is_window = |r: &Row| r.method == Method::Swa && r.kind == StageKind::Train;
    let stage = settings
        .iter()
        .filter(|(r, _)| is_window(r))
        .map(|(r, _)| r.stage.as_str())
        .max_by_key(|st| settings.iter().filter(|(r, _)| r.stage == *st).count());
    let Some(stage) = stage else { return Ok(None) };
    let of_axis = |r: &Row| is_window(r) && r.stage == stage;
    let windows: Vec<Setting> = settings
        .iter()
        .filter(|(r, _)| of_axis(r))
        .map(|(_, s)| s.clone())
        .collect();
    if windows.len() < 2 {
        return Ok(None);
    }
    let mut out: Vec<(&Setting, Comparison)> = settings
        .iter()
        .filter(|(r, _)| !of_axis(r))
        .filter_map(|(_, s)| Some((s, compare(s, &windows)?)))
        .collect();
    if out.is_empty() {
        return Ok(None);
    }
    out.sort_by(|a, b| a.0.pairs.total_cmp(&b.0.pairs));
    let p_holm = holm(&out.iter().map(|o| o.1.p).collect::<Vec<_>>());
    let f = |g: &dyn Fn(&(&Setting, Comparison)) -> f64| out.iter().map(g).collect::<Vec<_>>();
    let s = |g: &dyn Fn(&(&Setting, Comparison)) -> String| out.iter().map(g).collect::<Vec<_>>();
    let n = |g: &dyn Fn(&(&Setting, Comparison)) -> usize| {
        out.iter().map(|o| g(o) as u32).collect::<Vec<_>>()
    };
    let df = df!(
        "name" => s(&|o| o.0.name.clone()),
        "replicates" => n(&|o| o.0.losses.len()),
        "pairs_vs_full" => f(&|o| o.0.pairs),
        "loss" => f(&|o| summarize(&o.0.losses).mean),
        "window_line" => s(&|o| o.1.between.join(" .. ")),
        "window_weight" => f(&|o| o.1.weight),
        "window_replicates" => n(&|o| o.1.window_replicates),
        "window_line_loss" => f(&|o| o.1.reference),
        "difference" => f(&|o| o.1.difference),
        "ci95_low" => f(&|o| o.1.interval.0),
        "ci95_high" => f(&|o| o.1.interval.1),
        "p" => f(&|o| o.1.p),
        "verdict" => s(&|o| verdict(o.1.p, &o.1).to_string()),
        "p_holm" => p_holm.clone(),
        "verdict_holm" => out.iter().zip(&p_holm).map(|(o, &p)| verdict(p, &o.1).to_string()).collect::<Vec<_>>(),
    )?;
    Ok(Some(df))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setting(name: &str, pairs: f64, losses: &[f64]) -> Setting {
        Setting {
            name: name.into(),
            pairs,
            losses: losses.to_vec(),
        }
    }

    #[test]
    fn a_setting_is_read_against_the_window_line_at_its_pairs() {
        let windows = [
            setting("w512", 0.4, &[1.50, 1.52, 1.54]),
            setting("w128", 0.1, &[1.70, 1.70, 1.70]),
            setting("w1024", 0.8, &[1.30, 1.31, 1.32]),
        ];
        // A quarter of the way in log pairs from w512 (mean 1.52) to w1024 (1.31).
        let s = setting("aha", 0.4 * 2f64.powf(0.25), &[1.40, 1.41, 1.42]);
        let c = compare(&s, &windows).unwrap();
        assert_eq!(c.between, ["w512", "w1024"]);
        assert!((c.weight - 0.25).abs() < 1e-12);
        assert_eq!(c.window_replicates, 3);
        let line = 0.75 * 1.52 + 0.25 * 1.31;
        assert!((c.reference - line).abs() < 1e-12, "{c:?}");
        assert!((c.difference - (1.41 - line)).abs() < 1e-12);
        // Each side's sd is 0.01 (w512's 0.02): se^2 = (1 + 0.75^2 * 4 + 0.25^2) * 1e-4 / 3,
        // and Welch-Satterthwaite's df from the three terms.
        let v = [1e-4 / 3.0, 0.5625 * 4e-4 / 3.0, 0.0625 * 1e-4 / 3.0];
        let se = v.iter().sum::<f64>().sqrt();
        let df = se.powi(4) / v.iter().map(|x| x * x / 2.0).sum::<f64>();
        let h = t975(df) * se;
        assert!((c.interval.0 - (c.difference - h)).abs() < 1e-12);
        assert!((c.interval.1 - (c.difference + h)).abs() < 1e-12);
        assert!(c.p < 0.05, "{c:?}");
        assert_eq!(verdict(c.p, &c), "differs");
        // A test the table's quantile does not back (p under 5 %, the interval holding 0)
        // is no verdict of a difference.
        let torn = Comparison {
            interval: (-0.01, 0.2),
            ..c.clone()
        };
        assert_eq!(verdict(0.04, &torn), "within noise");
        // Outside the windows' pairs nothing is extrapolated.
        assert!(compare(&setting("full", 1.0, &[1.2]), &windows).is_none());
        assert!(compare(&setting("ppa", 0.05, &[2.0]), &windows).is_none());
        // One replicate on a side with weight: a difference, no interval.
        let c = compare(&setting("one", s.pairs, &[1.41]), &windows).unwrap();
        assert!((c.difference - (1.41 - line)).abs() < 1e-12);
        assert!(c.interval.0.is_nan() && c.p.is_nan());
        assert_eq!(verdict(c.p, &c), "one replicate");
        // On a window's own pairs (as a mean over replicates rounds them) the other window has
        // no weight and does not count, whatever its replicates.
        let rounded = (0.1 + 0.1 + 0.1) / 3.0;
        let c = compare(&setting("at", rounded, &[1.6, 1.62]), &windows).unwrap();
        assert_eq!(
            (c.weight, c.between.as_slice()),
            (0.0, &["w128".to_string()][..])
        );
        assert!((c.difference - (1.61 - 1.70)).abs() < 1e-12);
        let top = compare(&setting("top", 0.8 * (1.0 + 1e-12), &[1.3, 1.31]), &windows).unwrap();
        assert_eq!(top.between, ["w1024"]);
        // No spread on any side with weight: nothing to test.
        let flat = compare(&setting("flat", rounded, &[1.6, 1.6]), &windows).unwrap();
        assert!(flat.p.is_nan());
    }
}
