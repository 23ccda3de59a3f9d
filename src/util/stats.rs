//! Statistics of repeated measurements.

/// The middle value of `xs` (the upper one of an even count), for the repeated measurements
/// of timings and logged rates; `xs` must not be empty.
pub(crate) fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}
