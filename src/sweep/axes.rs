//! The axes of a chart: its value ranges, a coordinate that labels a sweep's own values
//! (`Swept`), and tick labels that print every value exactly and no more digits than its
//! neighbours need.

use crate::util::stats::below;
use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint, Ranged};

pub(super) fn bounds(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
            (a.min(v), b.max(v))
        });
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    // Values apart only by rounding are one value: an axis a few ulps tall has no ticks.
    if below(lo, hi) {
        let pad = (hi - lo) * 0.06;
        return (lo - pad, hi + pad);
    }
    let pad = lo.abs().max(1.0) * 0.1;
    (lo - pad, lo + pad)
}

/// The label of the unit cell whose centre a tick at `v` marks ("" for ticks on cell edges),
/// so categorical axes label cells, not their boundaries: `ticks[i]`, or the index `i` when
/// there are no ticks.
pub(super) fn cell_label(v: f64, ticks: &[String]) -> String {
    let i = v.floor();
    if (v - i - 0.5).abs() < 0.26 {
        ticks
            .get(i as usize)
            .cloned()
            .unwrap_or_else(|| format!("{}", i as i64))
    } else {
        String::new()
    }
}

/// Tick labels for values `step` apart: as many decimals as tell neighbours apart, so a
/// narrow range never repeats a label.
pub(super) fn tick_format(step: f64) -> impl Fn(&f64) -> String {
    let decimals = if step > 0.0 && step.is_finite() {
        (-step.log10()).ceil().clamp(0.0, 8.0) as usize
    } else {
        3
    };
    move |v: &f64| {
        if *v == 0.0 {
            "0".into()
        } else if v.abs() >= 1e5 || (v.abs() < 1e-3 && decimals > 4) {
            let s = format!("{v:.1e}");
            s.replace(".0e", "e")
        } else {
            let s = format!("{v:.decimals$}");
            if s.contains('.') {
                s.trim_end_matches('0').trim_end_matches('.').to_string()
            } else {
                s
            }
        }
    }
}

/// An axis labelled at given values (the swept ones) rather than at round numbers.
pub(super) struct Swept<R> {
    pub(super) axis: R,
    pub(super) at: Vec<f64>,
}

impl<R: Ranged<ValueType = f64>> Ranged for Swept<R> {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, v: &f64, limit: (i32, i32)) -> i32 {
        self.axis.map(v, limit)
    }

    fn key_points<Hint: KeyPointHint>(&self, _hint: Hint) -> Vec<f64> {
        self.at.clone()
    }

    fn range(&self) -> std::ops::Range<f64> {
        self.axis.range()
    }

    fn axis_pixel_range(&self, limit: (i32, i32)) -> std::ops::Range<i32> {
        self.axis.axis_pixel_range(limit)
    }
}

/// The largest power of ten, down to 1e-8, on whose decimal grid every value lies, so
/// labels with its decimals print each value exactly.
pub(super) fn exact_step(xs: &[f64]) -> f64 {
    (0..=8)
        .map(|d| (d, 10f64.powi(-d)))
        .find(|&(d, _)| {
            xs.iter().all(|x| {
                let shown: f64 = format!("{x:.*}", d as usize).parse().unwrap_or(f64::NAN);
                (shown - x).abs() <= 1e-9 * x.abs().max(1e-12)
            })
        })
        .map_or(1e-8, |(_, step)| step)
}

/// The smallest gap between neighbouring values.
pub(super) fn min_gap(xs: &[f64]) -> f64 {
    xs.windows(2)
        .map(|w| w[1] - w[0])
        .fold(f64::INFINITY, f64::min)
}
