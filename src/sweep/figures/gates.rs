//! The gates' figures: usage against the window and lambda (AHA Tables 1/2 and 4), head usage
//! maps (AHA Figs. 3/4), the test-time threshold (L2A Fig. 13), sparsity per layer (L2A Fig. 3,
//! SwiAttn Fig. 5) and the routers' learning curves.

use super::series::{
    first_replicate, full_reference, grouped, reference_look, replicate_means, setting_legend,
    short_key, with_reference, UNIT,
};
use crate::config::{name_of, Router};
use crate::model::attention::{spec, Gates, PaperUsageAt};
use crate::sweep::figure::{series, sorted, Figure, Look, Panel, Series, XAxis};
use crate::sweep::grid::StageKind;
use crate::sweep::pareto;
use crate::sweep::rows::Row;
use crate::util::stats::summarize;
use std::collections::{BTreeMap, BTreeSet};

const WINDOW: &str = "attention.window";
const LAMBDA: &str = "attention.lambda";

/// Usage (mu_f) and validation loss against the same swept value, side by side.
pub(super) fn usage_and_loss(
    title: &str,
    x: &str,
    usage: Vec<Series>,
    loss: Vec<Series>,
) -> Figure {
    let x_axis = XAxis::LogSwept;
    Figure::Panels {
        title: title.into(),
        panels: vec![
            Panel {
                title: "full-attention usage".into(),
                x: format!("{x}, log scale"),
                y: "mu_f".into(),
                series: usage,
                x_axis,
            },
            Panel {
                title: "quality".into(),
                x: format!("{x}, log scale"),
                y: "validation loss".into(),
                series: loss,
                x_axis,
            },
        ],
    }
}

/// AHA Fig. 3: a layer x head map of full-attention usage.
pub(super) fn usage_map(title: String, values: Vec<Vec<f64>>) -> Figure {
    Figure::Heatmap {
        title,
        x: "head".into(),
        y: "layer".into(),
        values,
        range: (0.0, 1.0),
        x_ticks: vec![],
        y_ticks: vec![],
    }
}

/// AHA Tables 1/2: every learned router's usage and loss against the window, where windows vary.
pub(super) fn mu_f_vs_window(train: &[&Row], figs: &mut Vec<(String, Figure)>) {
    let routed_by_window: Vec<&Row> = train
        .iter()
        .copied()
        .filter(|r| r.mu_f().is_some() && r.router == Router::Learned)
        .collect();
    let windows: BTreeSet<i64> = routed_by_window.iter().map(|r| r.window as i64).collect();
    if windows.len() < 2 {
        return;
    }
    // Lambda names a series only for a method that reads it (AHA, L2A; not SwiAttn's regulariser).
    let key = |r: &Row| match r.grid_attention.reads().contains(&"lambda") {
        true => format!("{} lambda={}", name_of(r.method), r.grid_attention.lambda),
        false => name_of(r.method).to_string(),
    };
    figs.push((
        "mu_f_vs_window".into(),
        usage_and_loss(
            "Full-attention usage and quality against window",
            "window w (tokens)",
            grouped(
                &routed_by_window,
                WINDOW,
                key,
                |r| r.mu_f().map(|m| (r.window, m)),
                UNIT,
            ),
            with_reference(
                grouped(
                    &routed_by_window,
                    WINDOW,
                    key,
                    |r| Some((r.window, r.loss())),
                    None,
                ),
                full_reference(train.iter().copied(), &routed_by_window, |r| Some(r.loss())),
            ),
        ),
    ));
}

/// AHA Figs. 3/4: each learned cell's layer x head usage (of one method), and every head
/// sorted.
pub(super) fn head_usage(cells: &[&Row], figs: &mut Vec<(String, Figure)>) {
    // Per trained cell: its heads sorted by usage, named by its setting (stage and settings
    // but the seed), so a setting's curve is its replicates' mean at each rank.
    let mut sorted_curves: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for r in cells {
        let Some(g) = r.gates() else { continue };
        let m = g.per_head.clone();
        if m.is_empty() {
            continue;
        }
        if r.kind == StageKind::Train {
            let mut all_heads: Vec<f64> = m.iter().flatten().copied().collect();
            all_heads.sort_by(|a, b| b.total_cmp(a));
            let by_rank = all_heads
                .into_iter()
                .enumerate()
                .map(|(i, v)| (i as f64 + 1.0, v))
                .collect();
            sorted_curves.push((setting_legend(r), by_rank));
        }
        if first_replicate(r, cells.iter().copied()) {
            figs.push((
                format!("head_usage_{}", r.cell),
                usage_map(format!("Head usage mu_f: {}", r.label), m),
            ));
        }
    }
    let sorted_usage = replicate_means(sorted_curves);
    if !sorted_usage.is_empty() {
        figs.push((
            "head_usage_sorted".into(),
            Figure::Lines {
                title: "Heads sorted by full-attention usage (mean over seeds)".into(),
                x: "head rank".into(),
                y: "mu_f".into(),
                series: sorted_usage,
                x_axis: XAxis::Linear,
            },
        ));
    }
}

/// AHA Table 4: usage and loss against lambda, at the windows where lambdas vary (one
/// method's learned train cells), with the paper's usage at those windows as hollow dashed
/// references (`paper`, named by its source).
pub(super) fn lambda_ablation(
    cells: &[&Row],
    train: &[&Row],
    (paper, source): (&[PaperUsageAt], &str),
    figs: &mut Vec<(String, Figure)>,
) {
    let lambda = |r: &Row| r.grid_attention.lambda;
    let lambdas_at = |w: f64| -> BTreeSet<u64> {
        cells
            .iter()
            .filter(|r| r.window == w)
            .map(|r| lambda(r).to_bits())
            .collect()
    };
    let varied: Vec<&Row> = cells
        .iter()
        .copied()
        .filter(|r| lambdas_at(r.window).len() > 1)
        .collect();
    if varied.is_empty() {
        return;
    }
    let key = |r: &Row| format!("window={}", r.window);
    let mut usage = grouped(
        &varied,
        LAMBDA,
        key,
        |r| r.mu_f().map(|m| (lambda(r), m)),
        UNIT,
    );
    // The paper's usage at each swept window, inside the lambdas swept there: a point beyond
    // them would stretch this panel's axis away from the loss panel's beside it.
    let windows: BTreeSet<u64> = varied.iter().map(|r| r.window.to_bits()).collect();
    let mut drawn = 0;
    for w in windows.iter().map(|&w| f64::from_bits(w)) {
        let swept = lambdas_at(w).into_iter().map(f64::from_bits);
        let (lo, hi) = swept.fold((f64::INFINITY, 0.0f64), |(a, b), l| (a.min(l), b.max(l)));
        let points: Vec<(f64, f64)> = paper
            .iter()
            .filter(|p| p.window == w && (lo..=hi).contains(&p.lambda))
            .map(|p| (p.lambda, p.mu_f))
            .collect();
        // One value at a window (Table 2's at w 256) is the level the sweep is reaching for:
        // a line across the swept lambdas, through the paper's point at its own lambda.
        let s = match points[..] {
            [] => continue,
            [(at, mu)] => series(
                format!("{source}, w {w}: its usage at lambda {at}, as a level"),
                vec![(lo, mu), (hi, mu)],
                true,
            ),
            _ => series(format!("{source}, w {w}"), points, true),
        };
        usage.push(Series {
            look: reference_look([12, 9][drawn % 2]),
            ..s
        });
        drawn += 1;
    }
    // Full attention trained as long as the sweep's longest cells: the loss each lambda gives
    // up against.
    let budget = varied.iter().map(|r| r.budget_tokens).fold(0.0, f64::max);
    let longest: Vec<&Row> = varied
        .iter()
        .copied()
        .filter(|r| r.budget_tokens == budget)
        .collect();
    let full = full_reference(train.iter().copied(), &longest, |r| Some(r.loss()));
    figs.push((
        "lambda_ablation".into(),
        usage_and_loss(
            "Full-attention usage and quality against lambda",
            "lambda",
            usage,
            with_reference(
                grouped(&varied, LAMBDA, key, |r| Some((lambda(r), r.loss())), None),
                full,
            ),
        ),
    ));
}

/// L2A Fig. 13: each learned setting's loss against attention work as the test-time threshold
/// moves (one method's learned cells), the trained cells' own evaluation (the trained tau)
/// among the points; at the length the cells trained at (their evaluations at other lengths
/// are other work), each point the mean over the setting's replicates.
pub(super) fn threshold_sweep(cells: &[&Row], figs: &mut Vec<(String, Figure)>) {
    let tau = |r: &Row| r.grid_attention.tau;
    let trained: Vec<&Row> = cells
        .iter()
        .copied()
        .filter(|r| r.kind == StageKind::Train)
        .collect();
    let lengths: BTreeSet<usize> = trained.iter().map(|r| r.report.seq_len).collect();
    let at = match (lengths.len(), lengths.first()) {
        (0, _) => return,
        (1, Some(len)) => format!("at {len} tokens"),
        _ => "at each cell's trained length".to_string(),
    };
    // The trained cells' own evaluations and those at another threshold (a probe stage at
    // the trained tau would count the trained point twice), at the length each trained cell
    // was evaluated at.
    let trained_at: BTreeMap<&str, (usize, f64)> = trained
        .iter()
        .map(|r| (r.cell.as_str(), (r.report.seq_len, tau(r))))
        .collect();
    let points: Vec<&Row> = cells
        .iter()
        .copied()
        .filter(|r| match r.kind {
            StageKind::Train => true,
            StageKind::Eval => trained_at
                .get(r.source.as_str())
                .is_some_and(|&(len, t)| len == r.report.seq_len && t != tau(r)),
            StageKind::Prune => false,
        })
        .filter(|r| r.mu_f().is_some())
        .collect();
    if points.iter().all(|r| r.kind == StageKind::Train) {
        return;
    }
    // A trained cell's setting: its window and settings but the seed; an evaluation belongs
    // to the setting of the cell it evaluates.
    let setting_of: BTreeMap<&str, String> = trained
        .iter()
        .map(|r| {
            let others = r
                .setting()
                .filter(|(k, _)| *k != WINDOW)
                .map(|(k, v)| format!("{}={v}", short_key(k)))
                .collect::<Vec<_>>()
                .join(" ");
            let name = format!("{} w={} {others}", spec(r.method).label, r.window);
            (r.cell.as_str(), name.trim().to_string())
        })
        .collect();
    // Per setting, per tau: the replicates' (pairs, loss).
    type Points = BTreeMap<u64, (Vec<f64>, Vec<f64>)>;
    let mut groups: BTreeMap<String, Points> = BTreeMap::new();
    for r in &points {
        let owner = match r.kind {
            StageKind::Train => &r.cell,
            _ => &r.source,
        };
        let Some(name) = setting_of.get(owner.as_str()) else {
            continue;
        };
        let e = groups
            .entry(name.clone())
            .or_default()
            .entry(tau(r).to_bits())
            .or_default();
        e.0.push(r.pairs_vs_full());
        e.1.push(r.loss());
    }
    let series: Vec<Series> = groups
        .into_iter()
        .map(|(name, at)| {
            let (mut points, mut labels, mut errors) = (vec![], vec![], vec![]);
            for (t, (pairs, losses)) in at {
                let loss = summarize(&losses);
                points.push((summarize(&pairs).mean, loss.mean));
                errors.push((loss.mean - loss.half_width, loss.mean + loss.half_width));
                labels.push(format!("tau={}", f64::from_bits(t)));
            }
            Series {
                name,
                points,
                line: true,
                labels,
                errors,
                look: Look::ByPlace,
            }
        })
        .collect();
    figs.push((
        "threshold_sweep".into(),
        Figure::Lines {
            title: format!("Test-time threshold {at}: quality against attention work"),
            x: "attended pairs / full causal".into(),
            y: "validation loss".into(),
            series: sorted(series),
            x_axis: XAxis::Linear,
        },
    ));
}

/// L2A Fig. 3 / SwiAttn Fig. 5: sparsity per layer of each trained per-token router's
/// setting, the mean over its replicates (`layer_usage.csv` has each cell's), named by the
/// setting's cell (`pareto::by_setting`: a setting within a larger one is drawn as that one).
pub(super) fn layer_sparsity(all: &[Row], figs: &mut Vec<(String, Figure)>) {
    let routed = all
        .iter()
        .filter(|r| spec(r.method).gates == Gates::PerToken && r.kind == StageKind::Train);
    let mut stems: BTreeSet<String> = BTreeSet::new();
    for (named, cells) in pareto::by_setting(routed) {
        let layers: Vec<(&Row, &[f64])> = cells
            .iter()
            .filter_map(|r| Some((*r, r.gates()?.per_layer.as_slice())))
            .collect();
        let Some(depth) = layers.first().map(|(_, l)| l.len()) else {
            continue;
        };
        if layers.iter().any(|(_, l)| l.len() != depth) {
            continue;
        }
        let of = match layers.as_slice() {
            [(one, _)] => one.label.clone(),
            _ => format!("{}, mean of {} seeds", setting_legend(named), layers.len()),
        };
        // Two settings that share only some cells can be named by the same one: the second
        // figure is told apart, not written over the first.
        let mut stem = format!("layer_sparsity_{}", named.cell);
        if stems.contains(&stem) {
            let taken = |s: &String| stems.contains(s);
            stem = (2..)
                .map(|k| format!("{stem}-{k}"))
                .find(|s| !taken(s))
                .expect("some count is free");
        }
        stems.insert(stem.clone());
        figs.push((
            stem,
            Figure::Bars {
                title: format!("Sparsity per layer: {} {of}", name_of(named.method)),
                x: "layer (from 1, as the papers count)".into(),
                y: "sparsity 1 - mu_f".into(),
                bars: (0..depth)
                    .map(|l| {
                        let mean =
                            layers.iter().map(|(_, m)| m[l]).sum::<f64>() / layers.len() as f64;
                        ((l + 1).to_string(), 1.0 - mean)
                    })
                    .collect(),
            },
        ));
    }
}

/// The router's learning curve (L2A Sec. 3.3: collapse): every learned router's gate
/// usage and training loss over its own steps, from its training log.
pub(super) fn router_curves(train: &[&Row], figs: &mut Vec<(String, Figure)>) {
    let logs: Vec<(&Row, Vec<Vec<f64>>)> = train
        .iter()
        .filter(|r| r.router == Router::Learned && r.mu_f().is_some())
        .filter_map(|r| {
            let pts = r.train_log.as_ref()?.select(&["step", "loss", "mu_f"])?;
            (pts.len() > 1).then_some((*r, pts))
        })
        .collect();
    if logs.is_empty() {
        return;
    }
    let panel = |y: &str, col: usize| Panel {
        title: y.into(),
        x: "training step".into(),
        y: y.into(),
        series: replicate_means(
            logs.iter()
                .map(|(r, pts)| {
                    (
                        setting_legend(r),
                        pts.iter().map(|p| (p[0], p[col])).collect(),
                    )
                })
                .collect(),
        ),
        x_axis: XAxis::Linear,
    };
    figs.push((
        "router_curves".into(),
        Figure::Panels {
            title: "Routers while training".into(),
            panels: vec![panel("gates open (mu_f)", 2), panel("training loss", 1)],
        },
    ));
}
