//! What every figure family shares: rows grouped into series (replicates as a mean with its
//! interval), legends named by a cell's settings, the first replicate of a setting, and the
//! reference lines (full attention trained as long, chance).

use crate::model::attention::spec;
use crate::sweep::figure::{series, sorted, Look, Series};
use crate::sweep::grid::StageKind;
use crate::sweep::pareto::by_setting;
use crate::sweep::rows::Row;
use crate::util::stats::{mean_interval, summarize};
use std::collections::{BTreeMap, BTreeSet};

/// Groups rows by a key into named series of (x, y). A cell's other varied settings (its
/// setting's but the x axis's setting `x_key` and what the key already names) are added to
/// its series' name, so a line joins only cells that differ in x (a control at one window is
/// its own point, not a jump in the line). Rows of one series at one x that are replicates of
/// one setting (they differ only in their seed) become one point, their mean, with its 95 %
/// interval as an error bar: inside `bounds` where the quantity is bounded (usage, accuracy).
/// A cell that several stages share counts in each of its settings, and a setting whose cells
/// all belong to a larger one is drawn once, as that one (`pareto::by_setting`): a regime's
/// three seeds are one point, not its first seed's cell of a sweep beside the mean of the
/// other two.
pub(super) fn grouped(
    rows: &[&Row],
    x_key: &str,
    key: impl Fn(&Row) -> String,
    xy: impl Fn(&Row) -> Option<(f64, f64)>,
    bounds: Option<(f64, f64)>,
) -> Vec<Series> {
    let key = |r: &Row| {
        let mut name = key(r);
        for (k, v) in r.setting() {
            let short = short_key(k);
            if k != x_key && !name.contains(&format!("{short}=")) {
                name = format!("{name} {short}={v}").trim().to_string();
            }
        }
        name
    };
    // Each setting's points: its series (named by the setting's own cell, so a cell shared
    // with a larger setting of another stage joins that one's series), its stage, x (by its
    // bits), its place among the settings, y.
    let mut points: Vec<(String, &str, u64, usize, f64)> = Vec::new();
    for (i, (named, cells)) in by_setting(rows.iter().copied()).into_iter().enumerate() {
        let name = key(named);
        for (x, y) in cells.into_iter().filter_map(&xy) {
            points.push((name.clone(), named.stage.as_str(), x.to_bits(), i, y));
        }
    }
    // Two stages at one x of one series are variants the settings do not name (AHA and AHA
    // with its sampled gradient at one window). Taken by most x values, then by first place,
    // a stage keeps the series' name where its x values meet none of those kept before it
    // (a continuation of the line to other windows stays on it); one that meets them becomes
    // a series of its own, named by its stage, so that no line joins the variants.
    let mut stages: BTreeMap<&str, Vec<(&str, BTreeSet<u64>, usize)>> = BTreeMap::new();
    for (name, stage, x, setting, _) in &points {
        let of = stages.entry(name.as_str()).or_default();
        match of.iter_mut().find(|(s, _, _)| s == stage) {
            Some((_, xs, first)) => {
                xs.insert(*x);
                *first = (*first).min(*setting);
            }
            None => of.push((*stage, BTreeSet::from([*x]), *setting)),
        }
    }
    let mut apart: BTreeSet<(&str, &str)> = BTreeSet::new();
    for (name, of) in &mut stages {
        of.sort_by(|a, b| b.1.len().cmp(&a.1.len()).then(a.2.cmp(&b.2)));
        let mut kept: BTreeSet<u64> = BTreeSet::new();
        for (stage, xs, _) in of.iter() {
            match kept.is_disjoint(xs) {
                true => kept.extend(xs),
                false => {
                    apart.insert((name, stage));
                }
            }
        }
    }
    // Per series, per x, per setting: the ys.
    type AtX = BTreeMap<u64, BTreeMap<usize, Vec<f64>>>;
    let mut groups: BTreeMap<String, AtX> = BTreeMap::new();
    for (name, stage, x, setting, y) in &points {
        let series = match apart.contains(&(name.as_str(), *stage)) {
            true => format!("{name} ({stage})"),
            false => name.clone(),
        };
        groups
            .entry(series)
            .or_default()
            .entry(*x)
            .or_default()
            .entry(*setting)
            .or_default()
            .push(*y);
    }
    let series_of = |name: String, at_x: AtX| {
        let mut points: Vec<(f64, f64, (f64, f64))> = Vec::new();
        for (x, settings) in at_x {
            for ys in settings.into_values() {
                let mean = summarize(&ys).mean;
                points.push((f64::from_bits(x), mean, mean_interval(&ys, bounds)));
            }
        }
        // Sorted by x here, so `series`' own (stable) sort keeps the errors in step.
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut s = series(name, points.iter().map(|p| (p.0, p.1)).collect(), true);
        if points.iter().any(|p| p.2 .0.is_finite()) {
            s.errors = points.iter().map(|p| p.2).collect();
        }
        s
    };
    sorted(groups.into_iter().map(|(k, v)| series_of(k, v)).collect())
}

/// The range of a rate, usage or accuracy: its intervals stay inside it.
pub(super) const UNIT: Option<(f64, f64)> = Some((0.0, 1.0));

/// A grid key without its section (`attention.window` -> `window`).
pub(super) fn short_key(key: &str) -> &str {
    key.rsplit('.').next().unwrap_or(key)
}

/// A legend's name for a cell of `stage` with these settings, without the sections' prefixes
/// (`aha window=16`).
pub(super) fn legend<'a>(
    stage: &str,
    settings: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> String {
    let settings = settings
        .into_iter()
        .map(|(k, v)| format!("{}={v}", short_key(k)))
        .collect::<Vec<_>>()
        .join(" ");
    format!("{stage} {settings}").trim().to_string()
}

/// A cell's name in a legend: its stage and the settings its stage varies, its seed among them.
pub(super) fn legend_name(r: &Row) -> String {
    legend(
        &r.stage,
        r.varied.iter().map(|(k, v)| (k.as_str(), v.as_str())),
    )
}

/// The legend name of `r`'s setting: its stage and settings but the seed, which its
/// replicates share (their curves are averaged under it).
pub(super) fn setting_legend(r: &Row) -> String {
    legend(&r.stage, r.setting())
}

/// Whether `r` is the first cell of its setting among `rows` (its stage and settings but the
/// seed): a figure of one cell is drawn for the first replicate only, the others being the same
/// setting again (the tables and the figures over settings have them all).
pub(super) fn first_replicate<'a>(r: &Row, mut rows: impl Iterator<Item = &'a Row>) -> bool {
    let setting = r.setting_text();
    rows.find(|o| o.stage == r.stage && o.setting_text() == setting)
        .is_none_or(|o| o.cell == r.cell)
}

/// One line per name of `curves` (a setting's replicates share one): at each x, the mean of
/// the replicates' values there, so seeds read as one line, not a knot of them.
pub(super) fn replicate_means(curves: Vec<(String, Vec<(f64, f64)>)>) -> Vec<Series> {
    let mut by_name: BTreeMap<String, BTreeMap<u64, Vec<f64>>> = BTreeMap::new();
    for (name, points) in curves {
        let at = by_name.entry(name).or_default();
        for (x, y) in points {
            at.entry(x.to_bits()).or_default().push(y);
        }
    }
    sorted(
        by_name
            .into_iter()
            .map(|(name, at)| {
                let points = at
                    .into_iter()
                    .map(|(x, ys)| (f64::from_bits(x), ys.iter().sum::<f64>() / ys.len() as f64))
                    .collect();
                series(name, points, true)
            })
            .collect(),
    )
}

/// Full attention trained as long as `routed` (the same budget of tokens): the mean of
/// `metric` over its rows among `rows` (its replicates, and evaluations of them), the
/// reference of a quality panel; None when there is none. Of several such set-ups (a control
/// with frozen parameters beside the plain one) only the first train stage's: a reference
/// line is one model's, never an average of different trainings.
pub(super) fn full_reference<'a>(
    rows: impl IntoIterator<Item = &'a Row>,
    routed: &[&Row],
    metric: impl Fn(&Row) -> Option<f64>,
) -> Option<f64> {
    let budget = routed.first()?.budget_tokens;
    let candidates: Vec<&Row> = rows
        .into_iter()
        .filter(|r| spec(r.method).reference && r.budget_tokens == budget)
        .collect();
    // Without a trained reference here (only evaluations of one), those evaluations are it.
    let stage = candidates
        .iter()
        .find(|r| r.kind == StageKind::Train)
        .map(|r| r.stage.as_str());
    let trained: Vec<&str> = candidates
        .iter()
        .filter(|r| r.kind == StageKind::Train && Some(r.stage.as_str()) == stage)
        .map(|r| r.cell.as_str())
        .collect();
    let values: Vec<f64> = candidates
        .into_iter()
        .filter(|r| {
            stage.is_none()
                || trained.contains(&r.cell.as_str())
                || trained.contains(&r.source.as_str())
        })
        .filter_map(metric)
        .collect();
    (!values.is_empty()).then(|| summarize(&values).mean)
}

/// `series` with a dashed horizontal line at `reference` across their x range, named as
/// full attention trained as long.
pub(super) fn with_reference(lines: Vec<Series>, reference: Option<f64>) -> Vec<Series> {
    with_line(lines, "full attention, trained as long", reference, 6)
}

/// `series` with a dashed horizontal line named `name` at `y` across their x range, in the
/// palette's colour `colour` (6 is black) with hollow markers: a reference, not a method.
pub(super) fn with_line(
    mut lines: Vec<Series>,
    name: &str,
    y: Option<f64>,
    colour: usize,
) -> Vec<Series> {
    let xs = lines.iter().flat_map(|s| s.points.iter().map(|p| p.0));
    let (lo, hi) = xs.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| {
        (a.min(x), b.max(x))
    });
    if let (Some(y), true) = (y, lo < hi) {
        let mut line = series(name.into(), vec![(lo, y), (hi, y)], true);
        line.look = reference_look(colour);
        lines.push(line);
    }
    lines
}

/// How a reference (a paper's value, the model before training) is drawn: dashed, hollow,
/// in palette colour `colour`.
pub(super) fn reference_look(colour: usize) -> Look {
    Look::Chosen {
        colour,
        shape: 0,
        hollow: true,
        dashed: true,
    }
}
