//! The figures of each cell's own probe files, as its row holds them: usage maps per probe
//! task (AHA Fig. 3 per task) and NIAH by length and depth (SwiAttn Figs. 3 and 6).

use super::gates::usage_map;
use super::series::first_replicate;
use crate::config::name_of;
use crate::model::attention::spec;
use crate::sweep::axes::{exact_step, min_gap, tick_format};
use crate::sweep::cell_files::Niah;
use crate::sweep::figure::{series, Figure, Series, XAxis};
use crate::sweep::rows::Row;
use std::collections::BTreeMap;

/// Every first replicate's probe usage maps and NIAH figures.
pub(super) fn cell_files(all: &[Row], figs: &mut Vec<(String, Figure)>) {
    for r in all.iter().filter(|r| first_replicate(r, all.iter())) {
        let label = format!("{} {}", name_of(r.method), r.label);
        for (task, f) in probe_usage_maps(&r.probe_usage, &label) {
            figs.push((format!("head_usage_{}_{task}", r.cell), f));
        }
        if let Some(niah) = &r.niah {
            // Full attention has no window to mark.
            let window = spec(r.method).windowed.then_some(r.window);
            for (stem, f) in niah_figures(niah, &r.cell, &label, window) {
                figs.push((format!("{stem}_{}", r.cell), f));
            }
        }
    }
}

/// A usage map per probe task of one cell (described by `label`), as (task, figure).
pub(super) fn probe_usage_maps(
    by_task: &BTreeMap<String, Vec<Vec<f64>>>,
    label: &str,
) -> Vec<(String, Figure)> {
    by_task
        .iter()
        .map(|(task, m)| {
            let title = format!("Head usage mu_f on {task} prompts: {label}");
            (task.clone(), usage_map(title, m.clone()))
        })
        .collect()
}

/// NIAH figures of cell `cell` (described by `label`): accuracy by depth and length, and where
/// the grid has full ratios, the full ratio against depth per length, with the reach of
/// `window`, where the method has one.
pub(super) fn niah_figures(
    niah: &Niah,
    cell: &str,
    label: &str,
    window: Option<f64>,
) -> Vec<(String, Figure)> {
    let cells = &niah.cells;
    let mut depths: Vec<f64> = cells.iter().map(|c| c.0).collect();
    let mut lengths: Vec<f64> = cells.iter().map(|c| c.1).collect();
    for v in [&mut depths, &mut lengths] {
        v.sort_by(f64::total_cmp);
        v.dedup();
    }
    let mut grid = vec![vec![f64::NAN; lengths.len()]; depths.len()];
    for c in cells {
        let (i, j) = (
            depths.iter().position(|&x| x == c.0).unwrap(),
            lengths.iter().position(|&x| x == c.1).unwrap(),
        );
        grid[i][j] = c.2;
    }
    let mut out = vec![(
        "niah_heatmap".to_string(),
        Figure::Heatmap {
            title: format!("NIAH accuracy: {label}"),
            x: "context length (tokens)".into(),
            y: "needle depth (0: start of the prompt, 1: its end)".into(),
            x_ticks: lengths.iter().map(tick_format(1.0)).collect(),
            y_ticks: depths
                .iter()
                .map(tick_format(min_gap(&depths).min(exact_step(&depths))))
                .collect(),
            values: grid,
            range: (0.0, 1.0),
        },
    )];
    if niah.full_ratio {
        // One curve per length, and where a window reaches: a needle at depth d lies about
        // (1 - d) * length tokens before the answer, inside the window from d = 1 - w / length.
        let mut lines: Vec<Series> = lengths
            .iter()
            .map(|&len| {
                let pts = cells
                    .iter()
                    .filter(|c| c.1 == len)
                    .filter_map(|c| Some((c.0, c.3?)))
                    .filter(|p| p.1.is_finite())
                    .collect();
                series(format!("L={}", tick_format(1.0)(&len)), pts, true)
            })
            .collect();
        // A file with the column but no ratio in it (a method without routers, probed in a
        // grid that has some) draws no empty axes.
        if lines.iter().all(|s| s.points.is_empty()) {
            return out;
        }
        if let Some(w) = window {
            for &len in &lengths {
                let at = (1.0 - w / len).clamp(0.0, 1.0);
                lines.push(series(
                    format!("window reach, L={}", tick_format(1.0)(&len)),
                    vec![(at, 0.0), (at, 1.0)],
                    true,
                ));
            }
        }
        out.push((
            "full_ratio_vs_depth".to_string(),
            Figure::Lines {
                title: format!("Full ratio on answer tokens: {cell}"),
                x: "needle depth (0: start of the prompt, 1: its end)".into(),
                y: "full-attention ratio".into(),
                series: lines,
                x_axis: XAxis::LinearSwept,
            },
        ));
    }
    out
}
