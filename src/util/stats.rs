//! Statistics of repeated measurements.

/// The middle value of `xs` (the upper one of an even count), for the repeated measurements
/// of timings and logged rates; `xs` must not be empty.
pub(crate) fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Student's t 97.5 % quantile for `df` degrees of freedom (two-sided 95 %): the table's
/// value at the largest tabulated df not above `df` (conservative between rows), 1.960 for
/// large df.
pub(crate) fn t975(df: f64) -> f64 {
    const TABLE: [(f64, f64); 16] = [
        (1.0, 12.706),
        (2.0, 4.303),
        (3.0, 3.182),
        (4.0, 2.776),
        (5.0, 2.571),
        (6.0, 2.447),
        (7.0, 2.365),
        (8.0, 2.306),
        (9.0, 2.262),
        (10.0, 2.228),
        (15.0, 2.131),
        (20.0, 2.086),
        (30.0, 2.042),
        (60.0, 2.000),
        (120.0, 1.980),
        (f64::INFINITY, 1.960),
    ];
    if df.is_nan() || df < 1.0 {
        return f64::NAN;
    }
    TABLE
        .iter()
        .rev()
        .find(|(d, _)| *d <= df)
        .map_or(f64::NAN, |(_, t)| *t)
}

/// Mean, sample standard deviation, count and 95 % interval of the mean (Student's t) of
/// replicates.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Summary {
    pub(crate) n: usize,
    pub(crate) mean: f64,
    /// NaN for one value.
    pub(crate) sd: f64,
    /// Half the 95 % interval's width; NaN for one value.
    pub(crate) half_width: f64,
}

pub(crate) fn summarize(xs: &[f64]) -> Summary {
    let n = xs.len();
    let mean = xs.iter().sum::<f64>() / n as f64;
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n as f64 - 1.0);
    let sd = if n > 1 { var.sqrt() } else { f64::NAN };
    Summary {
        n,
        mean,
        sd,
        half_width: t975(n as f64 - 1.0) * sd / (n as f64).sqrt(),
    }
}

/// The difference of two replicated means, `a - b`, with its 95 % interval (Welch: unequal
/// variances, Welch-Satterthwaite degrees of freedom); NaN bounds when either has one value,
/// and none (0) when both are replicated without spread (a fixed cost such as a window's
/// pairs), where the degrees of freedom would be 0 / 0.
pub(crate) fn welch_difference(a: &Summary, b: &Summary) -> (f64, f64) {
    let (va, vb) = (a.sd.powi(2) / a.n as f64, b.sd.powi(2) / b.n as f64);
    let se = (va + vb).sqrt();
    if se == 0.0 {
        return (a.mean - b.mean, 0.0);
    }
    let df =
        (va + vb).powi(2) / (va.powi(2) / (a.n as f64 - 1.0) + vb.powi(2) / (b.n as f64 - 1.0));
    (a.mean - b.mean, t975(df) * se)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against values worked out by hand: [1, 2, 3, 4] has mean 2.5, sd sqrt(5/3), and a 95 %
    /// interval of 3.182 sd / 2; two such samples shifted by 10 differ by 10 +/- t(6) sqrt(2 *
    /// 5/3 / 4).
    #[test]
    fn replicates_summarize_as_student_and_welch_say() {
        let s = summarize(&[1.0, 2.0, 3.0, 4.0]);
        assert_eq!((s.n, s.mean), (4, 2.5));
        assert!((s.sd - (5.0f64 / 3.0).sqrt()).abs() < 1e-12);
        assert!((s.half_width - 3.182 * s.sd / 2.0).abs() < 1e-12);
        let t = summarize(&[11.0, 12.0, 13.0, 14.0]);
        let (d, h) = welch_difference(&t, &s);
        assert_eq!(d, 10.0);
        assert!(
            (h - 2.447 * (2.0 * 5.0 / 3.0 / 4.0f64).sqrt()).abs() < 1e-12,
            "{h}"
        );
        let one = summarize(&[3.0]);
        assert!(one.sd.is_nan() && one.half_width.is_nan());
        assert!(welch_difference(&one, &s).1.is_nan());
        // Replicates without spread on both sides (a fixed cost): the difference is exact.
        let (c, e) = (summarize(&[0.5; 3]), summarize(&[0.25; 3]));
        assert_eq!(welch_difference(&c, &e), (0.25, 0.0));
        assert_eq!(welch_difference(&c, &c), (0.0, 0.0));
        assert_eq!(t975(2.5), 4.303);
        assert_eq!(t975(1000.0), 1.980);
    }
}
