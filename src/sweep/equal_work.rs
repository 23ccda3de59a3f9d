//! Every method against a plain sliding window at equal work. The pareto grids sweep SWA's
//! window across the other methods' attended pairs rather than tune a window to each
//! (`sweeps/gpu/pareto_budget.toml`), so a method's equal-work baseline is read off the line
//! between the two SWA settings whose pairs bracket its own: the loss a window would have
//! at the same work. The difference from it gets a 95 % interval over both sides'
//! replicates (Welch-Satterthwaite over the three means involved) and Holm's adjustment over
//! the table; nothing outside SWA's span of pairs is extrapolated.

use super::grid::StageKind;
use super::pareto;
use super::rows::Row;
use crate::config::Method;
use crate::util::stats::{holm, summarize, t975, t_test_p, Summary};
use anyhow::Result;
use polars::prelude::*;

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
    /// The two window settings bracketing the pairs, and the weight of the second.
    pub(crate) between: (String, String),
    pub(crate) weight: f64,
    pub(crate) reference: f64,
    /// The setting's mean loss less the reference, with its 95 % interval and Student's p
    /// (NaN where a side with weight has one replicate).
    pub(crate) difference: f64,
    pub(crate) interval: (f64, f64),
    pub(crate) p: f64,
}

/// `s` against the window line through `windows` (any order); None outside their pairs.
pub(crate) fn compare(s: &Setting, windows: &[Setting]) -> Option<Comparison> {
    let mut w: Vec<&Setting> = windows.iter().filter(|w| w.pairs.is_finite()).collect();
    w.sort_by(|a, b| a.pairs.total_cmp(&b.pairs));
    let k = w
        .windows(2)
        .position(|ab| ab[0].pairs <= s.pairs && s.pairs <= ab[1].pairs)?;
    let (a, b) = (w[k], w[k + 1]);
    let t = match b.pairs - a.pairs {
        0.0 => 0.0,
        span => (s.pairs - a.pairs) / span,
    };
    // The difference is a weighted sum of three independent means: its variance is the sum
    // of each one's squared weight times its variance of the mean.
    let terms: Vec<(f64, Summary)> = [(1.0, &s.losses), (-(1.0 - t), &a.losses), (-t, &b.losses)]
        .into_iter()
        .filter(|(c, _)| *c != 0.0)
        .map(|(c, l)| (c, summarize(l)))
        .collect();
    let difference: f64 = terms.iter().map(|(c, m)| c * m.mean).sum();
    let var: Vec<f64> = terms
        .iter()
        .map(|(c, m)| c * c * m.sd.powi(2) / m.n as f64)
        .collect();
    let se = var.iter().sum::<f64>().sqrt();
    let (interval, p) = match se {
        _ if se.is_nan() => ((f64::NAN, f64::NAN), f64::NAN),
        0.0 => ((difference, difference), f64::from(difference == 0.0)),
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
        between: (a.name.clone(), b.name.clone()),
        weight: t,
        reference: summarize(&s.losses).mean - difference,
        difference,
        interval,
        p,
    })
}

/// `equal_work.csv`: each comparable setting that is not SWA, against the SWA line at its
/// pairs; None without two SWA settings (trained, of the comparison's budget).
pub(crate) fn table(rows: &[Row]) -> Result<Option<DataFrame>> {
    let rows = pareto::comparable(rows);
    let settings: Vec<(bool, Setting)> = pareto::by_setting(&rows)
        .into_iter()
        .map(|(first, reps)| {
            let window = first.method == Method::Swa && first.kind == StageKind::Train;
            let name = format!("{} {}", pareto::family(first), pareto::settings(first));
            let pairs = reps.iter().map(|r| r.pairs_vs_full()).sum::<f64>() / reps.len() as f64;
            let losses = reps.iter().map(|r| r.loss()).collect();
            let name = name.trim().to_string();
            (
                window,
                Setting {
                    name,
                    pairs,
                    losses,
                },
            )
        })
        .collect();
    let windows: Vec<Setting> = settings
        .iter()
        .filter(|s| s.0)
        .map(|s| s.1.clone())
        .collect();
    if windows.len() < 2 {
        return Ok(None);
    }
    let mut out: Vec<(&Setting, Comparison)> = settings
        .iter()
        .filter(|s| !s.0)
        .filter_map(|(_, s)| Some((s, compare(s, &windows)?)))
        .collect();
    if out.is_empty() {
        return Ok(None);
    }
    out.sort_by(|a, b| a.0.pairs.total_cmp(&b.0.pairs));
    let p_holm = holm(&out.iter().map(|o| o.1.p).collect::<Vec<_>>());
    let verdict = |p: f64| match p {
        _ if p.is_nan() => "one replicate",
        _ if p < 0.05 => "differs",
        _ => "within noise",
    };
    let f = |g: &dyn Fn(&(&Setting, Comparison)) -> f64| out.iter().map(g).collect::<Vec<_>>();
    let s = |g: &dyn Fn(&(&Setting, Comparison)) -> String| out.iter().map(g).collect::<Vec<_>>();
    let df = df!(
        "name" => s(&|o| o.0.name.clone()),
        "replicates" => out.iter().map(|o| o.0.losses.len() as u32).collect::<Vec<_>>(),
        "pairs_vs_full" => f(&|o| o.0.pairs),
        "loss" => f(&|o| summarize(&o.0.losses).mean),
        "window_line" => s(&|o| format!("{} .. {}", o.1.between.0, o.1.between.1)),
        "window_line_loss" => f(&|o| o.1.reference),
        "difference" => f(&|o| o.1.difference),
        "ci95_low" => f(&|o| o.1.interval.0),
        "ci95_high" => f(&|o| o.1.interval.1),
        "p" => f(&|o| o.1.p),
        "verdict" => s(&|o| verdict(o.1.p).to_string()),
        "p_holm" => p_holm.clone(),
        "verdict_holm" => p_holm.iter().map(|&p| verdict(p).to_string()).collect::<Vec<_>>(),
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
        // At 0.5 of the pairs: a quarter of the way from w512 (mean 1.52) to w1024 (1.31).
        let s = setting("aha", 0.5, &[1.40, 1.41, 1.42]);
        let c = compare(&s, &windows).unwrap();
        assert_eq!(c.between, ("w512".to_string(), "w1024".to_string()));
        assert!((c.weight - 0.25).abs() < 1e-12);
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
        // Outside the windows' pairs nothing is extrapolated.
        assert!(compare(&setting("full", 1.0, &[1.2]), &windows).is_none());
        assert!(compare(&setting("ppa", 0.05, &[2.0]), &windows).is_none());
        // One replicate on a side with weight: a difference, no interval.
        let c = compare(&setting("one", 0.5, &[1.41]), &windows).unwrap();
        assert!((c.difference - (1.41 - line)).abs() < 1e-12);
        assert!(c.interval.0.is_nan() && c.p.is_nan());
        // On a window's own pairs the other window has no weight and does not count.
        let c = compare(&setting("at", 0.1, &[1.6, 1.62]), &windows).unwrap();
        assert_eq!(c.weight, 0.0);
        assert!((c.difference - (1.61 - 1.70)).abs() < 1e-12);
    }
}
