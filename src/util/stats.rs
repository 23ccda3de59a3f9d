//! Statistics of repeated measurements: means with their 95 % intervals (Student's t, on the
//! logit scale for quantities bounded to a range, Wilson's for proportions, a two-level
//! bootstrap for scores pooled over seeds and prompts), Welch's test, exact McNemar for paired
//! outcomes, and Holm's adjustment of many tests.

use super::rng::Rng;

/// The middle value of `xs` (the upper one of an even count), for the repeated measurements
/// of timings and logged rates; `xs` must not be empty.
pub(crate) fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Whether `a` lies below `b` by more than rounding: two means of the same values, summed in
/// another order, differ in their last bits and are one value.
pub(crate) fn below(a: f64, b: f64) -> bool {
    b - a > 1e-9 * a.abs().max(b.abs())
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

/// ln Γ(x) for x > 0 (Lanczos, g = 7, 9 terms: about 15 digits).
fn ln_gamma(x: f64) -> f64 {
    const C: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    if x < 0.5 {
        // Reflection: Γ(x) Γ(1 - x) = π / sin(π x).
        return (std::f64::consts::PI / (std::f64::consts::PI * x).sin()).ln() - ln_gamma(1.0 - x);
    }
    let x = x - 1.0;
    let t = x + 7.5;
    let sum = C[1..]
        .iter()
        .enumerate()
        .fold(C[0], |a, (i, c)| a + c / (x + i as f64 + 1.0));
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + sum.ln()
}

/// The regularised incomplete beta function I_x(a, b), by its continued fraction (Lentz).
fn incomplete_beta(x: f64, a: f64, b: f64) -> f64 {
    if x <= 0.0 {
        return 0.0;
    }
    if x >= 1.0 {
        return 1.0;
    }
    // The fraction converges fast for x < (a + 1) / (a + b + 2); the symmetry covers the rest.
    if x > (a + 1.0) / (a + b + 2.0) {
        return 1.0 - incomplete_beta(1.0 - x, b, a);
    }
    let front =
        (ln_gamma(a + b) - ln_gamma(a) - ln_gamma(b) + a * x.ln() + b * (1.0 - x).ln()).exp() / a;
    let tiny = 1e-300;
    let (mut c, mut d) = (1.0, 1.0 - (a + b) * x / (a + 1.0));
    d = 1.0 / if d.abs() < tiny { tiny } else { d };
    let mut f = d;
    for m in 1..300 {
        let m = m as f64;
        for (i, num) in [
            m * (b - m) * x / ((a + 2.0 * m - 1.0) * (a + 2.0 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2.0 * m) * (a + 2.0 * m + 1.0)),
        ]
        .into_iter()
        .enumerate()
        {
            d = 1.0 + num * d;
            d = 1.0 / if d.abs() < tiny { tiny } else { d };
            c = 1.0 + num / c;
            if c.abs() < tiny {
                c = tiny;
            }
            f *= c * d;
            if i == 1 && (c * d - 1.0).abs() < 1e-15 {
                return front * f;
            }
        }
    }
    front * f
}

/// The two-sided p-value of Student's t statistic `t` with `df` degrees of freedom.
pub(crate) fn t_test_p(t: f64, df: f64) -> f64 {
    if !t.is_finite() || df.is_nan() || df <= 0.0 {
        return f64::NAN;
    }
    incomplete_beta(df / (df + t * t), df / 2.0, 0.5)
}

/// Welch's test of two replicated means: `a - b`, half its 95 % interval (as
/// `welch_difference`), and the two-sided p-value; p is 0 or 1 where neither side has spread (a
/// fixed cost: the difference is exact) and NaN where a side has one value.
pub(crate) fn welch_test(a: &Summary, b: &Summary) -> (f64, f64, f64) {
    let (d, h) = welch_difference(a, b);
    let (va, vb) = (a.sd.powi(2) / a.n as f64, b.sd.powi(2) / b.n as f64);
    let se = (va + vb).sqrt();
    let p = match se {
        _ if h.is_nan() => f64::NAN,
        0.0 => f64::from(d == 0.0),
        _ => {
            let df = (va + vb).powi(2)
                / (va.powi(2) / (a.n as f64 - 1.0) + vb.powi(2) / (b.n as f64 - 1.0));
            t_test_p(d / se, df)
        }
    };
    (d, h, p)
}

/// The 95 % interval of the mean of `xs`: Student's t; for a quantity bounded to `bounds`, the
/// same on the logit scale of its place in the range (values within 1e-4 of a bound counted
/// there), mapped back, so it never leaves the range. A range open above (`(lo, inf)`: a rate,
/// a count, bytes) takes the log scale of the distance to `lo` when every value lies above it,
/// else Student's t cut at `lo`. NaN bounds for one value.
pub(crate) fn mean_interval(xs: &[f64], bounds: Option<(f64, f64)>) -> (f64, f64) {
    let Some((lo, hi)) = bounds else {
        let s = summarize(xs);
        return (s.mean - s.half_width, s.mean + s.half_width);
    };
    // Replicates that agree exactly (a rate at a bound, a fixed cost) have that value.
    if xs.len() > 1 && xs.iter().all(|&x| x == xs[0]) {
        return (xs[0], xs[0]);
    }
    if hi.is_infinite() {
        if xs.iter().all(|&x| x > lo) {
            let z: Vec<f64> = xs.iter().map(|&x| (x - lo).ln()).collect();
            let s = summarize(&z);
            return (
                lo + (s.mean - s.half_width).exp(),
                lo + (s.mean + s.half_width).exp(),
            );
        }
        let s = summarize(xs);
        return ((s.mean - s.half_width).max(lo), s.mean + s.half_width);
    }
    let eps = 1e-4;
    let logit = |x: f64| {
        let p = ((x - lo) / (hi - lo)).clamp(eps, 1.0 - eps);
        (p / (1.0 - p)).ln()
    };
    let back = |z: f64| lo + (hi - lo) / (1.0 + (-z).exp());
    let z: Vec<f64> = xs.iter().map(|&x| logit(x)).collect();
    let s = summarize(&z);
    (back(s.mean - s.half_width), back(s.mean + s.half_width))
}

/// Wilson's 95 % interval of a proportion, `k` successes of `n`: inside [0, 1] however few
/// trials or extreme the count. NaN for no trials.
pub(crate) fn wilson(k: f64, n: f64) -> (f64, f64) {
    if n <= 0.0 {
        return (f64::NAN, f64::NAN);
    }
    let z = 1.959_963_984_540_054;
    let p = k / n;
    let denom = 1.0 + z * z / n;
    let centre = (p + z * z / (2.0 * n)) / denom;
    let half = z * (p * (1.0 - p) / n + z * z / (4.0 * n * n)).sqrt() / denom;
    // At no success (every success) the bound is 0 (1) exactly, not a rounding away from it.
    let lo = if k <= 0.0 {
        0.0
    } else {
        (centre - half).max(0.0)
    };
    let hi = if k >= n {
        1.0
    } else {
        (centre + half).min(1.0)
    };
    (lo, hi)
}

/// Newcombe's interval (1998, method 10) for the difference of two paired proportions, from
/// the counts of pairs where both succeeded (`a`), only the first (`b`), only the second
/// (`c`) and neither (`d`): each proportion's Wilson interval, joined through the pairs'
/// correlation. It keeps inside [-1, 1] and, unlike a bootstrap of few discordant pairs,
/// does not leave 0 out where McNemar's test finds nothing.
pub(crate) fn newcombe_paired(a: u64, b: u64, c: u64, d: u64) -> (f64, f64) {
    let n = (a + b + c + d) as f64;
    if n == 0.0 {
        return (f64::NAN, f64::NAN);
    }
    let (a, b, c, d) = (a as f64, b as f64, c as f64, d as f64);
    let den = (a + b) * (c + d) * (a + c) * (b + d);
    let phi = if den > 0.0 {
        (a * d - b * c) / den.sqrt()
    } else {
        0.0
    };
    newcombe((a + b, n), (a + c, n), phi)
}

/// Newcombe's interval (1998, method 10) for the difference of two independent proportions,
/// `k1` of `n1` less `k2` of `n2`: the paired form with no correlation. NaN without trials.
pub(crate) fn newcombe_unpaired(k1: f64, n1: f64, k2: f64, n2: f64) -> (f64, f64) {
    if n1 <= 0.0 || n2 <= 0.0 {
        return (f64::NAN, f64::NAN);
    }
    newcombe((k1, n1), (k2, n2), 0.0)
}

/// Newcombe's method 10 from each proportion's (successes, trials) and their correlation
/// `phi`: the difference with its Wilson intervals' distances joined.
fn newcombe((k1, n1): (f64, f64), (k2, n2): (f64, f64), phi: f64) -> (f64, f64) {
    let (p1, p2) = (k1 / n1, k2 / n2);
    let ((l1, u1), (l2, u2)) = (wilson(k1, n1), wilson(k2, n2));
    let side = |x: f64, y: f64| (x * x - 2.0 * phi * x * y + y * y).max(0.0).sqrt();
    let theta = p1 - p2;
    (
        theta - side(p1 - l1, u2 - p2),
        theta + side(u1 - p1, p2 - l2),
    )
}

/// Exact McNemar's test of paired binary outcomes: `b` pairs where only the first succeeded,
/// `c` where only the second did; the two-sided p-value of the binomial (b + c, 1/2).
pub(crate) fn mcnemar_exact(b: u64, c: u64) -> f64 {
    let n = b + c;
    if n == 0 {
        return 1.0;
    }
    let k = b.min(c);
    let ln_choose = |n: u64, i: u64| {
        ln_gamma(n as f64 + 1.0) - ln_gamma(i as f64 + 1.0) - ln_gamma((n - i) as f64 + 1.0)
    };
    let tail: f64 = (0..=k)
        .map(|i| (ln_choose(n, i) - n as f64 * std::f64::consts::LN_2).exp())
        .sum();
    (2.0 * tail).min(1.0)
}

/// Holm's step-down adjustment of `p`: each p-value multiplied by the number of hypotheses
/// not yet rejected before it, in ascending order, kept monotone and at most 1; NaN stays NaN
/// and counts for nothing.
pub(crate) fn holm(p: &[f64]) -> Vec<f64> {
    let mut order: Vec<usize> = (0..p.len()).filter(|&i| !p[i].is_nan()).collect();
    order.sort_by(|&a, &b| p[a].total_cmp(&p[b]));
    let m = order.len();
    let mut out = vec![f64::NAN; p.len()];
    let mut running = 0.0f64;
    for (rank, &i) in order.iter().enumerate() {
        running = running.max(((m - rank) as f64 * p[i]).min(1.0));
        out[i] = running;
    }
    out
}

/// Draws for the bootstrap intervals: enough that their 2.5 % quantiles move by under a
/// percent of their width between seeds.
const DRAWS: usize = 4000;

/// The 2.5 % and 97.5 % quantiles of `draws`.
fn percentiles(mut draws: Vec<f64>) -> (f64, f64) {
    draws.sort_by(f64::total_cmp);
    let at = |q: f64| draws[((draws.len() - 1) as f64 * q).round() as usize];
    (at(0.025), at(0.975))
}

/// Means of `draws` two-level bootstrap samples of `groups` (each a replicate's per-prompt
/// values): replicates drawn with replacement, then prompts within each.
fn bootstrap_means(groups: &[Vec<f64>], draws: usize, seed: u64) -> Vec<f64> {
    let groups: Vec<&Vec<f64>> = groups.iter().filter(|g| !g.is_empty()).collect();
    let mut rng = Rng::new(seed);
    (0..draws)
        .map(|_| {
            let (mut sum, mut n) = (0.0, 0usize);
            for _ in 0..groups.len() {
                let g = groups[rng.below(groups.len() as u64) as usize];
                for _ in 0..g.len() {
                    sum += g[rng.below(g.len() as u64) as usize];
                }
                n += g.len();
            }
            sum / n as f64
        })
        .collect()
}

/// The 95 % interval of a score pooled over replicates: `groups` holds each replicate's
/// per-prompt values, and the bootstrap draws replicates, then prompts within each, so the
/// interval holds both the seeds' spread and the prompts' sampling; it stays inside the
/// values' range, and for 0/1 scores holds Wilson's interval of the pooled prompts (`hull`).
/// Deterministic (a fixed generator).
pub(crate) fn pooled_interval(groups: &[Vec<f64>]) -> (f64, f64) {
    let drawn = drawn_interval(groups);
    let all: Vec<f64> = groups.iter().flatten().copied().collect();
    if !binary(&all) {
        return drawn;
    }
    hull(drawn, wilson(all.iter().sum(), all.len() as f64))
}

/// The two-level bootstrap's 95 % interval of `groups`' pooled mean; NaN without values.
fn drawn_interval(groups: &[Vec<f64>]) -> (f64, f64) {
    if groups.iter().all(|g| g.is_empty()) {
        return (f64::NAN, f64::NAN);
    }
    percentiles(bootstrap_means(groups, DRAWS, 0x5EED_B007))
}

/// Whether every score is 0 or 1 (a proportion's trials).
pub(crate) fn binary(xs: &[f64]) -> bool {
    xs.iter().all(|&x| x == 0.0 || x == 1.0)
}

/// The bootstrap's interval widened to hold the binomial one of the pooled trials: a
/// bootstrap over few seeds whose prompts all scored alike draws one value ([1, 1] for 200
/// prompts of 200), while the prompts' sampling alone leaves at least the binomial interval.
fn hull(drawn: (f64, f64), binomial: (f64, f64)) -> (f64, f64) {
    (drawn.0.min(binomial.0), drawn.1.max(binomial.1))
}

/// Two settings' pooled scores compared on different prompts: the difference of their pooled
/// means, its 95 % interval from independent two-level bootstraps of each (widened to hold
/// Newcombe's unpaired interval of the pooled counts where every score is 0 or 1), and the
/// two-sided p-value of that bootstrap (`two_sided_share`).
pub(crate) fn unpaired_difference(a: &[Vec<f64>], b: &[Vec<f64>]) -> (f64, f64, f64, f64) {
    let pooled = |g: &[Vec<f64>]| {
        let all: Vec<f64> = g.iter().flatten().copied().collect();
        all.iter().sum::<f64>() / all.len() as f64
    };
    let diffs = |draws: usize, seed: u64| -> Vec<f64> {
        let (ma, mb) = (
            bootstrap_means(a, draws, seed ^ 0x0A0A),
            bootstrap_means(b, draws, seed ^ 0x0B0B),
        );
        ma.iter().zip(&mb).map(|(x, y)| x - y).collect()
    };
    let drawn = diffs(DRAWS, 0x5EED_0000);
    let p = bootstrap_p(&drawn, || diffs(MORE_DRAWS, 0x5EED_1000));
    let mut interval = percentiles(drawn);
    let (all_a, all_b): (Vec<f64>, Vec<f64>) = (
        a.iter().flatten().copied().collect(),
        b.iter().flatten().copied().collect(),
    );
    if binary(&all_a) && binary(&all_b) {
        let count = |xs: &[f64]| (xs.iter().sum::<f64>(), xs.len() as f64);
        let ((ka, na), (kb, nb)) = (count(&all_a), count(&all_b));
        interval = hull(interval, newcombe_unpaired(ka, na, kb, nb));
    }
    (pooled(a) - pooled(b), interval.0, interval.1, p)
}

/// Draws a bootstrap test takes afresh where fewer than `FEW_PAST` of its first `DRAWS` fall
/// on the far side of 0 (its p below about 0.005): 4,000 draws resolve p to 0.0005, which
/// Holm's adjustment over a table of a hundred rows multiplies past 0.05, so a difference
/// that every draw keeps could never be told apart there.
const MORE_DRAWS: usize = 50_000;

/// Draws past 0 below which a test's first `DRAWS` are too few to resolve its p.
const FEW_PAST: usize = 10;

/// The smallest p a bootstrap test gives (`two_sided_share` of `MORE_DRAWS` with no draw on
/// the far side of 0): the resolution of its p, never 0.
pub(crate) const BOOTSTRAP_MIN_P: f64 = 2.0 / (MORE_DRAWS as f64 + 1.0);

/// A bootstrap test's two-sided p from its `drawn` statistics, or, where fewer than
/// `FEW_PAST` of them fall past 0, from `MORE_DRAWS` drawn afresh (`more`).
fn bootstrap_p(drawn: &[f64], more: impl FnOnce() -> Vec<f64>) -> f64 {
    // A side without values draws NaN means: no test, not the smallest p.
    if drawn.iter().any(|m| m.is_nan()) {
        return f64::NAN;
    }
    let past = |draws: &[f64]| {
        let count = |keep: &dyn Fn(f64) -> bool| draws.iter().filter(|&&m| keep(m)).count();
        count(&|m| m <= 0.0).min(count(&|m| m >= 0.0))
    };
    if past(drawn) >= FEW_PAST {
        return two_sided_share(drawn);
    }
    two_sided_share(&more())
}

/// The bootstrap's two-sided p: twice the share of draws on the far side of 0 (a draw at 0
/// counts for both), each share counted as (k + 1) / (draws + 1), as a Monte Carlo p-value
/// is, so that a test of finitely many draws never claims p 0.
fn two_sided_share(draws: &[f64]) -> f64 {
    let share = |keep: &dyn Fn(f64) -> bool| {
        (draws.iter().filter(|&&m| keep(m)).count() as f64 + 1.0) / (draws.len() as f64 + 1.0)
    };
    (2.0 * share(&|m| m <= 0.0).min(share(&|m| m >= 0.0))).min(1.0)
}

/// A paired comparison of two settings scored on the same prompts: `pairs` holds, per
/// replicate, each prompt's (a, b). The mean of a - b, its 95 % two-level bootstrap interval
/// (replicates, then prompts), and the two-sided p-value: exact McNemar's where every score is
/// 0 or 1, else the bootstrap's (as `paired_bootstrap`).
pub(crate) fn paired_difference(pairs: &[Vec<(f64, f64)>]) -> (f64, f64, f64, f64) {
    if !binary_pairs(pairs) {
        return paired_bootstrap(pairs);
    }
    let Some((_, mean, lo, hi)) = paired_interval(pairs) else {
        return (f64::NAN, f64::NAN, f64::NAN, f64::NAN);
    };
    let [_, only_a, only_b, _] = concordance(pairs);
    (mean, lo, hi, mcnemar_exact(only_a, only_b))
}

/// `paired_difference` with the bootstrap's own two-sided p whatever the scores (twice the
/// share of redrawn means on the far side of 0): the test for pairs of replicates that are
/// separate models, whose spread the prompts alone do not hold.
pub(crate) fn paired_bootstrap(pairs: &[Vec<(f64, f64)>]) -> (f64, f64, f64, f64) {
    let Some((diffs, mean, lo, hi)) = paired_interval(pairs) else {
        return (f64::NAN, f64::NAN, f64::NAN, f64::NAN);
    };
    let p = bootstrap_p(&bootstrap_means(&diffs, DRAWS, 0x7E57_0001), || {
        bootstrap_means(&diffs, MORE_DRAWS, 0x7E57_0002)
    });
    (mean, lo, hi, p)
}

/// Each replicate's differences a - b, their mean and its 95 % two-level bootstrap interval
/// (widened to hold Newcombe's over the pooled pairs where every score is 0 or 1, as
/// `pooled_interval` holds Wilson's); None without a pair.
fn paired_interval(pairs: &[Vec<(f64, f64)>]) -> Option<(Vec<Vec<f64>>, f64, f64, f64)> {
    let diffs: Vec<Vec<f64>> = pairs
        .iter()
        .map(|g| g.iter().map(|(a, b)| a - b).collect())
        .collect();
    let all: Vec<f64> = diffs.iter().flatten().copied().collect();
    if all.is_empty() {
        return None;
    }
    let mean = all.iter().sum::<f64>() / all.len() as f64;
    let mut interval = drawn_interval(&diffs);
    if binary_pairs(pairs) {
        let [a, b, c, d] = concordance(pairs);
        interval = hull(interval, newcombe_paired(a, b, c, d));
    }
    Some((diffs, mean, interval.0, interval.1))
}

/// Pairs of 0/1 scores counted as McNemar's and Newcombe's tables take them: both succeeded,
/// only the first, only the second, neither.
pub(crate) fn concordance(pairs: &[Vec<(f64, f64)>]) -> [u64; 4] {
    let count = |x: f64, y: f64| {
        pairs
            .iter()
            .flatten()
            .filter(|&&(a, b)| a == x && b == y)
            .count() as u64
    };
    [
        count(1.0, 1.0),
        count(1.0, 0.0),
        count(0.0, 1.0),
        count(0.0, 0.0),
    ]
}

/// Whether both scores of every pair are 0 or 1.
fn binary_pairs(pairs: &[Vec<(f64, f64)>]) -> bool {
    pairs.iter().flatten().all(|&(a, b)| binary(&[a, b]))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against values worked out by hand: [1, 2, 3, 4] has mean 2.5, sd sqrt(5/3), and a 95 %
    /// interval of 3.182 sd / 2; two such samples shifted by 10 differ by 10 +/- t(6) sqrt(2 *
    /// 5/3 / 4).
    /// Newcombe's method 10 on his example (a) (36, 12, 2, 0): 0.0569 to 0.3404; no
    /// discordant pair gives an interval around 0; every interval holds its difference.
    #[test]
    fn newcombe_interval_matches_the_published_example() {
        let (lo, hi) = newcombe_paired(36, 12, 2, 0);
        assert!(
            (lo - 0.0569).abs() < 5e-5 && (hi - 0.3404).abs() < 5e-5,
            "{lo} {hi}"
        );
        let (lo, hi) = newcombe_paired(4, 0, 0, 96);
        assert!(lo < 0.0 && hi > 0.0 && (lo + hi).abs() < 1e-12);
        let (lo, hi) = newcombe_paired(90, 4, 0, 6);
        assert!(
            lo < 0.0 && 0.04 < hi && hi <= 1.0,
            "4 against 0 of 100: McNemar's p is 0.125"
        );
        assert!(newcombe_paired(0, 0, 0, 0).0.is_nan());
        // Method 10 for independent proportions on Newcombe's example (a), 56/70 - 48/80:
        // 0.0524 to 0.3339.
        let (lo, hi) = newcombe_unpaired(56.0, 70.0, 48.0, 80.0);
        assert!(
            (lo - 0.0524).abs() < 5e-5 && (hi - 0.3339).abs() < 5e-5,
            "{lo} {hi}"
        );
        assert!(newcombe_unpaired(1.0, 0.0, 1.0, 2.0).0.is_nan());
    }

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

    /// Against values worked out by hand or tabled: Student's 97.5 % points give p 0.05, Wilson
    /// for 0 of 10 reaches z^2 / (n + z^2), McNemar is twice a binomial tail, Holm steps down.
    #[test]
    fn tests_and_intervals_match_hand_values() {
        for (t, df) in [(12.706, 1.0), (2.571, 5.0), (2.228, 10.0), (1.96, 1e7)] {
            assert!(
                (t_test_p(t, df) - 0.05).abs() < 2e-4,
                "t {t} df {df}: {}",
                t_test_p(t, df)
            );
        }
        assert!((t_test_p(0.0, 4.0) - 1.0).abs() < 1e-12);
        let (lo, hi) = wilson(0.0, 10.0);
        assert_eq!(lo, 0.0);
        let z2 = 1.959_963_984_540_054f64.powi(2);
        assert!((hi - z2 / (10.0 + z2)).abs() < 1e-12, "{hi}");
        let (lo, hi) = wilson(5.0, 10.0);
        assert!(
            (lo - 0.2366).abs() < 1e-4 && (hi - 0.7634).abs() < 1e-4,
            "{lo} {hi}"
        );
        assert_eq!(wilson(10.0, 10.0).1, 1.0);
        assert_eq!(wilson(0.0, 3.0).0, 0.0);
        assert!((mcnemar_exact(0, 5) - 2.0 / 32.0).abs() < 1e-12);
        assert!((mcnemar_exact(1, 9) - 2.0 * 11.0 / 1024.0).abs() < 1e-12);
        assert_eq!(mcnemar_exact(3, 3), 1.0);
        assert_eq!(mcnemar_exact(0, 0), 1.0);
        let h = holm(&[0.01, 0.04, 0.03, f64::NAN]);
        assert!(
            (h[0] - 0.03).abs() < 1e-12
                && (h[1] - 0.06).abs() < 1e-12
                && (h[2] - 0.06).abs() < 1e-12
        );
        assert!(h[3].is_nan());
        // Welch's p agrees with its interval: 0 outside it where p < 0.05.
        let (a, b) = (summarize(&[1.0, 1.1, 1.2]), summarize(&[2.0, 2.1, 2.2]));
        let (d, h, p) = welch_test(&a, &b);
        assert!(d.abs() > h && p < 0.05, "{d} {h} {p}");
        let (c, e) = (summarize(&[0.5; 3]), summarize(&[0.25; 3]));
        assert_eq!(welch_test(&c, &e).2, 0.0);
        assert!(welch_test(&summarize(&[1.0]), &a).2.is_nan());
    }

    /// Bounded quantities keep their intervals inside the range; pooled and paired scores
    /// bootstrap over replicates and prompts.
    #[test]
    fn bounded_and_pooled_intervals_stay_in_range() {
        assert_eq!(mean_interval(&[0.5; 3], Some((0.0, 1.0))), (0.5, 0.5));
        assert_eq!(mean_interval(&[0.0; 3], Some((0.0, 1.0))), (0.0, 0.0));
        // L2A's usage, as the audit found it drawn below zero: 0.74 % [-1.7, 3.2].
        let usage = [0.001, 0.002, 0.019];
        let t = mean_interval(&usage, None);
        assert!(t.0 < 0.0, "Student's t leaves the range: {t:?}");
        let (lo, hi) = mean_interval(&usage, Some((0.0, 1.0)));
        assert!(
            lo > 0.0 && hi < 1.0 && lo < 0.0074 && hi > 0.0074,
            "{lo} {hi}"
        );
        // A rate (tokens/s) on the log scale: the geometric mean's interval, above zero where
        // Student's t is not; with a zero among the values, Student's t cut at zero.
        let rates = [100.0, 1000.0, 10000.0];
        assert!(mean_interval(&rates, None).0 < 0.0);
        let (lo, hi) = mean_interval(&rates, Some((0.0, f64::INFINITY)));
        let (g, h) = (1000f64.ln(), t975(2.0) * (1f64 / 3.0).sqrt() * 10f64.ln());
        let close = |a: f64, b: f64| ((a - b) / b).abs() < 1e-9;
        assert!(
            close(lo, (g - h).exp()) && close(hi, (g + h).exp()),
            "{lo} {hi}"
        );
        let counts = [0.0, 0.0, 3.0];
        let t = mean_interval(&counts, None);
        assert_eq!(
            mean_interval(&counts, Some((0.0, f64::INFINITY))),
            (0.0, t.1)
        );
        let (lo, hi) = pooled_interval(&[vec![1.0; 4], vec![0.0; 4]]);
        assert!(lo >= 0.0 && hi <= 1.0 && lo < 0.5 && hi > 0.5, "{lo} {hi}");
        // Every prompt of two seeds right: the bootstrap draws only 1, the interval is
        // Wilson's for 20 of 20 (z^2 / (n + z^2) below 1); scores not 0/1 keep the bootstrap.
        let z2 = 1.959_963_984_540_054f64.powi(2);
        assert_eq!(
            pooled_interval(&[vec![1.0; 10], vec![1.0; 10]]),
            (1.0 - z2 / (20.0 + z2), 1.0)
        );
        assert_eq!(pooled_interval(&[vec![0.5; 10]]), (0.5, 0.5));
        let (d, lo, hi, p) = paired_difference(&[vec![(1.0, 0.0); 10]]);
        assert_eq!((d, hi), (1.0, 1.0));
        assert_eq!(lo, newcombe_paired(0, 10, 0, 0).0);
        assert!(lo < 1.0);
        assert!((p - 2.0 / 1024.0).abs() < 1e-12);
        // On different prompts: independent bootstraps, the interval at least Newcombe's
        // unpaired one, the p at the bootstrap's resolution (no draw past 0 is not p 0).
        let (d, lo, hi, p) = unpaired_difference(&[vec![1.0; 20]], &[vec![0.0; 20]]);
        assert_eq!(
            (d, lo, hi),
            (1.0, newcombe_unpaired(20.0, 20.0, 0.0, 20.0).0, 1.0)
        );
        assert!(lo < 1.0);
        assert_eq!(p, BOOTSTRAP_MIN_P);
        assert!(BOOTSTRAP_MIN_P > 0.0 && BOOTSTRAP_MIN_P < 1e-4);
        // A difference a few of the first 4,000 draws cross is resolved by the 50,000 drawn
        // afresh: a p between their floors, not 4,000's 0.0005 for every such row; one that
        // many draws cross keeps its first p.
        let near = |hits: usize| {
            let one: Vec<f64> = (0..40).map(|i| f64::from(u8::from(i < hits))).collect();
            paired_bootstrap(&[one.iter().map(|&x| (x, 0.0)).collect::<Vec<_>>()]).3
        };
        let strong = near(8);
        assert!(
            BOOTSTRAP_MIN_P < strong && strong < 2.0 / 4001.0,
            "{strong}"
        );
        let weak = near(2);
        assert!(weak > 0.1, "{weak}");
        // Scores that are not 0 or 1 (recall) take the bootstrap's test.
        let (d, _, _, p) = paired_difference(&[vec![(0.5, 0.5); 20]]);
        assert_eq!(d, 0.0);
        assert!(p > 0.5, "{p}");
    }
}
