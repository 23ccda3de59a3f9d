//! Every method of one budget against each cost (`pareto::Cost`), with the Pareto fronts the
//! table `pareto.csv` marks.

use crate::sweep::figure::{series, sorted, Figure, Look, Panel, Series, XAxis};
use crate::sweep::pareto::{self, accuracy, Cost};
use crate::sweep::rows::Row;
use crate::util::stats::mean_interval;
use std::collections::BTreeMap;

/// Per cost of `pareto::Cost`, over the comparable cells: validation loss against it, and
/// beside it long-context accuracy where the cells measured one (`pareto::accuracy`), each
/// panel with its Pareto front drawn first, so every method's markers sit over it, and the
/// front's points labelled with their settings.
pub(super) fn pareto_figures(all: &[Row]) -> Vec<(String, Figure)> {
    let rows = pareto::comparable(all);
    let reach = pareto::reach(&rows);
    let accuracy_name = rows.iter().find_map(|r| accuracy(r, reach).map(|a| a.1));
    // Each method family keeps one look in every panel and figure, whichever families a
    // panel lacks (not every cell was probed); the front's line takes the first.
    let families: std::collections::BTreeSet<String> = rows.iter().map(pareto::family).collect();
    // The palette but the front's colour (0) and the references' black (6): eleven families
    // of methods each with a colour of its own.
    const FAMILY_COLOURS: [usize; 11] = [1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12];
    let look_of = |name: &str| {
        let i = families.iter().position(|f| f == name).unwrap_or(0);
        Look::Chosen {
            colour: FAMILY_COLOURS[i % FAMILY_COLOURS.len()],
            shape: (i + 1) % 5,
            hollow: i % 2 == 0,
            dashed: false,
        }
    };
    let mut figs = Vec::new();
    for cost in Cost::ALL {
        let mut panels = Vec::new();
        let loss = |r: &Row| Some(r.loss());
        let acc = |r: &Row| accuracy(r, reach).map(|a| a.0);
        let qualities: Vec<(&str, &dyn Fn(&Row) -> Option<f64>, bool)> = match &accuracy_name {
            Some(name) => vec![
                ("validation loss", &loss, false),
                (name.as_str(), &acc, true),
            ],
            None => vec![("validation loss", &loss, false)],
        };
        for (y, quality, higher_better) in qualities {
            let bounds = higher_better.then_some((0.0, 1.0));
            let (points, errors) =
                replicate_points(&rows, |r| Some((cost.of(r)?, quality(r)?)), bounds);
            if points.len() < 2 {
                continue;
            }
            let sign = if higher_better { -1.0 } else { 1.0 };
            let on = pareto::on_front(
                &points
                    .iter()
                    .map(|(_, (x, y))| Some((*x, sign * y)))
                    .collect::<Vec<_>>(),
            );
            let front: Vec<(f64, f64)> = points
                .iter()
                .zip(&on)
                .filter(|(_, on)| **on)
                .map(|(p, _)| p.1)
                .collect();
            let mut families: BTreeMap<String, Series> = BTreeMap::new();
            for (((r, p), on), err) in points.iter().zip(&on).zip(&errors) {
                let s = families
                    .entry(pareto::family(r))
                    .or_insert_with_key(|name| Series {
                        name: name.clone(),
                        points: vec![],
                        line: false,
                        labels: vec![],
                        errors: vec![],
                        look: look_of(name),
                    });
                s.points.push(*p);
                s.errors.push(*err);
                // Settings beside the front's points only: the cells off it crowd together,
                // and the legend names every method (pareto.csv has each cell's settings).
                s.labels.push(match (on, pareto::settings(r)) {
                    (false, _) => String::new(),
                    (true, settings) if settings.is_empty() => pareto::family(r),
                    (true, settings) => settings,
                });
            }
            let mut series = vec![self::series("Pareto front".into(), front, true)];
            // Error bars only where some setting has replicates.
            let families = families.into_values().map(|mut s| {
                if s.errors.iter().all(|e| !e.0.is_finite()) {
                    s.errors.clear();
                }
                s
            });
            series.extend(sorted(families.collect()));
            panels.push(Panel {
                title: format!(
                    "{y} (front: {})",
                    if higher_better { "higher" } else { "lower" }
                ),
                x: cost.axis().into(),
                y: y.into(),
                series,
                x_axis: XAxis::Linear,
            });
        }
        if panels.is_empty() {
            continue;
        }
        let stem = match cost {
            Cost::Work => "pareto".to_string(),
            c => format!("pareto_{}", c.name()),
        };
        let title = format!("Every method against {}", cost.axis());
        let fig = match panels.len() {
            1 => {
                let p = panels.remove(0);
                Figure::Lines {
                    title,
                    x: p.x,
                    y: p.y,
                    series: p.series,
                    x_axis: p.x_axis,
                }
            }
            _ => Figure::Panels { title, panels },
        };
        figs.push((stem, fig));
    }
    figs
}

/// One point per setting (a stage's cells that differ only in their seed): the mean of its
/// replicates' `(cost, quality)`, with the quality's 95 % interval over them (inside `bounds`
/// for a bounded quality; NaN for one replicate), and the setting's first cell, which names
/// it. Seeds drawn one by one would cluster and hide each other.
fn replicate_points<'a>(
    rows: &'a [Row],
    xy: impl Fn(&Row) -> Option<(f64, f64)>,
    bounds: Option<(f64, f64)>,
) -> (Vec<(&'a Row, (f64, f64))>, Vec<(f64, f64)>) {
    // Each setting named by its first cell with a point.
    let groups = pareto::by_setting(rows)
        .into_iter()
        .filter_map(|(_, reps)| {
            let first = *reps.iter().find(|r| xy(r).is_some())?;
            Some((first, reps.into_iter().filter_map(&xy).collect::<Vec<_>>()))
        });
    groups
        .map(|(r, ps)| {
            let (xs, ys): (Vec<f64>, Vec<f64>) = ps.into_iter().unzip();
            let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
            ((r, (mean(&xs), mean(&ys))), mean_interval(&ys, bounds))
        })
        .unzip()
}
