//! The figures a sweep directory's cells can fill, each as PNG and SVG (`figure.rs` draws
//! them).
//!
//! | figure | paper item |
//! |---|---|
//! | `mu_f_vs_window` | AHA Table 1/2: full-attention usage and validation loss against the window |
//! | `head_usage_<cell>` | AHA Fig. 3: layer x head usage heatmap with a colour bar |
//! | `head_usage_<cell>_<task>` | AHA Fig. 3 per task, from a cell's `eval/probe_head_usage.csv` |
//! | `head_usage_sorted` | AHA Fig. 4: every head's usage, sorted |
//! | `lambda_ablation` | AHA Table 4: usage and validation loss against lambda |
//! | `threshold_sweep` | L2A Fig. 13: quality against attention work as tau varies |
//! | `layer_sparsity_<cell>` | L2A Fig. 3 / SwiAttn Fig. 5: sparsity per layer |
//! | `loss_curves` | validation loss during training, every train cell (PPA Fig. 2: curves by p) |
//! | `router_curves` | every learned router's gate usage and training loss over its steps (L2A router collapse) |
//! | `ppa_s_curve` | PPA Fig. 3 and Table 1: final loss against p, the probes' accuracy, on the synthetic corpus the accuracy on dependencies at least w back, and the attention and prefill time of the cells timed alone |
//! | `bucket_loss` | loss by dependency distance on the synthetic corpus, every evaluated cell |
//! | `niah_heatmap_<cell>`, `full_ratio_vs_depth` | SwiAttn Fig. 3 and 6, from a cell's `eval/niah.csv` |
//! | `pareto`, `pareto_time`, `pareto_memory`, `pareto_prefill` | every method of one budget: loss against attention work, measured training time, decode memory and prefill time timed alone, each with its Pareto front |
//! | `prefill_time` | L2A Figs. 14-15: forward, prefill and decoding time against length, cells timed alone |

use super::figure::{
    exact_step, min_gap, series, sorted, tick_format, Figure, Look, Panel, Series, XAxis,
};
use super::grid::StageKind;
use super::pareto::{self, accuracy, Cost};
use super::replicates;
use super::rows::{log_columns, name_of, rows, Row};
use super::tables;
use crate::config::{Method, Router};
use crate::model::attention::{spec, Gates};
use crate::run::report::Timing;
use crate::util::atomic;
use crate::util::stats::summarize;
use anyhow::{anyhow, Result};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Groups rows by a key into named series of (x, y). A cell's other varied settings (those of
/// its label but the x axis's setting `x_key`, its seed and what the key already names) are
/// added to its series' name, so a line joins only cells that differ in x (a control at one
/// window is its own point, not a jump in the line). Rows of one series at one x that are
/// replicates of one setting (they differ only in their seed) become one point, their mean,
/// with its 95 % interval as an error bar.
fn grouped(
    rows: &[&Row],
    x_key: &str,
    key: impl Fn(&Row) -> String,
    xy: impl Fn(&Row) -> Option<(f64, f64)>,
) -> Vec<Series> {
    let key = |r: &Row| {
        let mut name = key(r);
        for kv in replicates::setting(&r.label).split_whitespace() {
            let Some((k, v)) = kv.split_once('=') else {
                continue;
            };
            let short = k.rsplit('.').next().unwrap_or(k);
            if k != x_key && !name.contains(&format!("{short}=")) {
                name = format!("{name} {short}={v}").trim().to_string();
            }
        }
        name
    };
    // Per series, per x (by its bits), per setting: the ys.
    type AtX = BTreeMap<u64, BTreeMap<String, Vec<f64>>>;
    let mut groups: BTreeMap<String, AtX> = BTreeMap::new();
    for r in rows {
        if let Some((x, y)) = xy(r) {
            groups
                .entry(key(r))
                .or_default()
                .entry(x.to_bits())
                .or_default()
                .entry(replicates::setting(&r.label))
                .or_default()
                .push(y);
        }
    }
    let series_of = |name: String, at_x: AtX| {
        let mut points: Vec<(f64, f64, f64)> = Vec::new();
        for (x, settings) in at_x {
            for ys in settings.into_values() {
                let s = summarize(&ys);
                points.push((f64::from_bits(x), s.mean, s.half_width));
            }
        }
        // Sorted by x here, so `series`' own (stable) sort keeps the errors in step.
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut s = series(name, points.iter().map(|p| (p.0, p.1)).collect(), true);
        if points.iter().any(|p| p.2.is_finite()) {
            s.errors = points.iter().map(|p| p.2).collect();
        }
        s
    };
    sorted(groups.into_iter().map(|(k, v)| series_of(k, v)).collect())
}

/// A cell's name in a legend: its stage and the settings its stage sweeps, without the
/// sections' prefixes (`aha window=16`).
fn legend_name(r: &Row) -> String {
    legend_of(&r.stage, &r.label)
}

/// The legend name of a cell of `stage` labelled `label` (see `legend_name`).
fn legend_of(stage: &str, label: &str) -> String {
    let settings = label
        .split_whitespace()
        .map(|kv| match kv.split_once('=') {
            Some((key, v)) => format!("{}={v}", key.rsplit('.').next().unwrap_or(key)),
            None => kv.to_string(),
        })
        .collect::<Vec<_>>()
        .join(" ");
    format!("{stage} {settings}").trim().to_string()
}

/// The legend name of `r`'s setting: its stage and settings but the seed, which its
/// replicates share (their curves are averaged under it).
fn setting_legend(r: &Row) -> String {
    legend_of(&r.stage, &replicates::setting(&r.label))
}

/// Whether `r` is the first cell of its setting among `rows` (its stage and settings but the
/// seed): a figure of one cell is drawn for the first replicate only, the others being the same
/// setting again (the tables and the figures over settings have them all).
fn first_replicate<'a>(r: &Row, mut rows: impl Iterator<Item = &'a Row>) -> bool {
    let setting = replicates::setting(&r.label);
    rows.find(|o| o.stage == r.stage && replicates::setting(&o.label) == setting)
        .is_none_or(|o| o.cell == r.cell)
}

/// One line per name of `curves` (a setting's replicates share one): at each x, the mean of
/// the replicates' values there, so seeds read as one line, not a knot of them.
fn replicate_means(curves: Vec<(String, Vec<(f64, f64)>)>) -> Vec<Series> {
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

/// Usage (mu_f) and validation loss against the same swept value, side by side.
fn usage_and_loss(title: &str, x: &str, usage: Vec<Series>, loss: Vec<Series>) -> Figure {
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
fn usage_map(title: String, values: Vec<Vec<f64>>) -> Figure {
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

/// A usage map per probe task of one cell, from its `eval/probe_head_usage.csv` (columns
/// task, layer, head, mu_f), as (task, figure).
fn probe_usage_maps(path: &Path, label: &str) -> Result<Vec<(String, Figure)>> {
    let mut by_task: BTreeMap<String, Vec<Vec<f64>>> = BTreeMap::new();
    let mut rdr = csv::Reader::from_path(path)?;
    for (i, rec) in rdr.records().enumerate() {
        let rec = rec?;
        let bad = || {
            anyhow!(
                "{}: row {} needs task,layer,head,mu_f",
                path.display(),
                i + 2
            )
        };
        let index = |k: usize| {
            rec.get(k)
                .and_then(|v| v.parse::<usize>().ok())
                .ok_or_else(bad)
        };
        let (layer, head) = (index(1)?, index(2)?);
        let mu: f64 = rec.get(3).and_then(|v| v.parse().ok()).ok_or_else(bad)?;
        anyhow::ensure!(
            mu.is_finite(),
            "{}: row {} gives mu_f {mu}",
            path.display(),
            i + 2
        );
        let m = by_task
            .entry(rec.get(0).ok_or_else(bad)?.to_string())
            .or_default();
        if m.len() <= layer {
            m.resize(layer + 1, vec![]);
        }
        if m[layer].len() <= head {
            m[layer].resize(head + 1, f64::NAN);
        }
        m[layer][head] = mu;
    }
    Ok(by_task
        .into_iter()
        .map(|(task, m)| {
            let title = format!("Head usage mu_f on {task} prompts: {label}");
            (task, usage_map(title, m))
        })
        .collect())
}

/// NIAH figures of cell `cell` (described by `label`) from its `eval/niah.csv` (columns depth,
/// length, accuracy and optionally full_ratio), as the evaluation suite writes it; `window`,
/// where the method has one, is marked on the full-ratio figure.
fn niah_figures(
    path: &Path,
    cell: &str,
    label: &str,
    window: Option<f64>,
) -> Result<Vec<(String, Figure)>> {
    let mut rdr = csv::Reader::from_path(path)?;
    let headers = rdr.headers()?.clone();
    let idx = |n: &str| headers.iter().position(|h| h == n);
    let (Some(d), Some(l), Some(a)) = (idx("depth"), idx("length"), idx("accuracy")) else {
        anyhow::bail!("{} needs columns depth, length, accuracy", path.display());
    };
    let fr = idx("full_ratio");
    let mut cells: Vec<(f64, f64, f64, Option<f64>)> = Vec::new();
    for rec in rdr.records() {
        let rec = rec?;
        let num = |i: usize| {
            rec.get(i)
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(f64::NAN)
        };
        cells.push((num(d), num(l), num(a), fr.map(num)));
    }
    let mut depths: Vec<f64> = cells.iter().map(|c| c.0).collect();
    let mut lengths: Vec<f64> = cells.iter().map(|c| c.1).collect();
    for v in [&mut depths, &mut lengths] {
        v.sort_by(f64::total_cmp);
        v.dedup();
    }
    let mut grid = vec![vec![f64::NAN; lengths.len()]; depths.len()];
    for c in &cells {
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
    if fr.is_some() {
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
    Ok(out)
}

/// Every figure the sweep directory's cells can fill, as (file stem, figure).
pub(crate) fn figures(sweep: &Path) -> Result<Vec<(String, Figure)>> {
    let all = rows(sweep)?;
    let train: Vec<&Row> = all.iter().filter(|r| r.kind == StageKind::Train).collect();
    let aha: Vec<&Row> = train
        .iter()
        .copied()
        .filter(|r| r.method == Method::Aha && r.router == Router::Learned)
        .collect();
    let mut figs: Vec<(String, Figure)> = Vec::new();
    mu_f_vs_window(&train, &mut figs);
    head_usage(&aha, &mut figs);
    lambda_ablation(&aha, &mut figs);
    threshold_sweep(&all, &mut figs);
    layer_sparsity(&all, &mut figs);
    loss_curves(sweep, &train, &mut figs);
    router_curves(sweep, &train, &mut figs);
    bucket_loss(&all, &mut figs);
    ppa_s_curve(&all, &train, &mut figs);
    prefill_time(&all, &mut figs);
    cell_files(sweep, &all, &mut figs)?;
    figs.extend(pareto_figures(&all));
    Ok(figs)
}

const WINDOW: &str = "attention.window";
const LAMBDA: &str = "attention.lambda";

/// Full attention trained as long as `routed` (the same budget of tokens): the mean of
/// `metric` over its rows among `rows` (its replicates, and evaluations of them), the
/// reference of a quality panel; None when there is none.
fn full_reference<'a>(
    rows: impl IntoIterator<Item = &'a Row>,
    routed: &[&Row],
    metric: impl Fn(&Row) -> Option<f64>,
) -> Option<f64> {
    let budget = routed.first()?.budget_tokens;
    let values: Vec<f64> = rows
        .into_iter()
        .filter(|r| r.method == Method::Full && r.budget_tokens == budget)
        .filter_map(metric)
        .collect();
    (!values.is_empty()).then(|| summarize(&values).mean)
}

/// `series` with a dashed horizontal line at `reference` across their x range, named as
/// full attention trained as long.
fn with_reference(lines: Vec<Series>, reference: Option<f64>) -> Vec<Series> {
    with_line(lines, "full attention, trained as long", reference, 6)
}

/// `series` with a dashed horizontal line named `name` at `y` across their x range, in the
/// palette's colour `colour` (6 is black) with hollow markers: a reference, not a method.
fn with_line(mut lines: Vec<Series>, name: &str, y: Option<f64>, colour: usize) -> Vec<Series> {
    let xs = lines.iter().flat_map(|s| s.points.iter().map(|p| p.0));
    let (lo, hi) = xs.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| {
        (a.min(x), b.max(x))
    });
    if let (Some(y), true) = (y, lo < hi) {
        let mut line = series(name.into(), vec![(lo, y), (hi, y)], true);
        line.look = Look::Chosen {
            colour,
            shape: 0,
            hollow: true,
            dashed: true,
        };
        lines.push(line);
    }
    lines
}

/// AHA Tables 1/2: every learned router's usage and loss against the window, where windows vary.
fn mu_f_vs_window(train: &[&Row], figs: &mut Vec<(String, Figure)>) {
    let routed_by_window: Vec<&Row> = train
        .iter()
        .copied()
        .filter(|r| r.mu_f().is_some() && r.router == Router::Learned)
        .collect();
    if routed_by_window
        .iter()
        .map(|r| r.window as i64)
        .collect::<std::collections::BTreeSet<_>>()
        .len()
        > 1
    {
        let key = |r: &Row| format!("{} lambda={}", name_of(r.method), r.lambda);
        figs.push((
            "mu_f_vs_window".into(),
            usage_and_loss(
                "Full-attention usage and quality against window",
                "window w (tokens)",
                grouped(&routed_by_window, WINDOW, key, |r| {
                    r.mu_f().map(|m| (r.window, m))
                }),
                with_reference(
                    grouped(&routed_by_window, WINDOW, key, |r| {
                        Some((r.window, r.loss()))
                    }),
                    full_reference(train.iter().copied(), &routed_by_window, |r| Some(r.loss())),
                ),
            ),
        ));
    }
}

/// AHA Figs. 3/4: each learned AHA cell's layer x head usage, and every head sorted.
fn head_usage(aha: &[&Row], figs: &mut Vec<(String, Figure)>) {
    // Per trained cell: its heads sorted by usage, named by its setting (stage and settings
    // but the seed), so a setting's curve is its replicates' mean at each rank.
    let mut sorted_curves: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for r in aha {
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
        if first_replicate(r, aha.iter().copied()) {
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

/// AHA Table 4: usage and loss against lambda, at the windows where lambdas vary.
fn lambda_ablation(aha: &[&Row], figs: &mut Vec<(String, Figure)>) {
    let lambdas_at = |w: f64| -> std::collections::BTreeSet<u64> {
        aha.iter()
            .filter(|r| r.window == w)
            .map(|r| r.lambda.to_bits())
            .collect()
    };
    let aha: Vec<&Row> = aha
        .iter()
        .copied()
        .filter(|r| lambdas_at(r.window).len() > 1)
        .collect();
    if !aha.is_empty() {
        let key = |r: &Row| format!("window={}", r.window);
        figs.push((
            "lambda_ablation".into(),
            usage_and_loss(
                "Full-attention usage and quality against lambda",
                "lambda",
                grouped(&aha, LAMBDA, key, |r| r.mu_f().map(|m| (r.lambda, m))),
                grouped(&aha, LAMBDA, key, |r| Some((r.lambda, r.loss()))),
            ),
        ));
    }
}

/// L2A Fig. 13: each learned L2A setting's loss against attention work as the test-time
/// threshold moves, the trained cells' own evaluation (the trained tau) among the points; at
/// the length the cells trained at (their evaluations at other lengths are other work), each
/// point the mean over the setting's replicates.
fn threshold_sweep(all: &[Row], figs: &mut Vec<(String, Figure)>) {
    let learned = |r: &&Row| r.method == Method::L2a && r.router == Router::Learned;
    let trained: Vec<&Row> = all
        .iter()
        .filter(learned)
        .filter(|r| r.kind == StageKind::Train)
        .collect();
    let lengths: std::collections::BTreeSet<usize> =
        trained.iter().map(|r| r.report.seq_len).collect();
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
        .map(|r| (r.cell.as_str(), (r.report.seq_len, r.tau)))
        .collect();
    let tau: Vec<&Row> = all
        .iter()
        .filter(learned)
        .filter(|r| match r.kind {
            StageKind::Train => true,
            StageKind::Eval => trained_at
                .get(r.source.as_str())
                .is_some_and(|&(len, tau)| len == r.report.seq_len && tau != r.tau),
            StageKind::Prune => false,
        })
        .filter(|r| r.mu_f().is_some())
        .collect();
    if tau.iter().all(|r| r.kind == StageKind::Train) {
        return;
    }
    // A trained cell's setting: its window and settings but the seed; an evaluation belongs
    // to the setting of the cell it evaluates.
    let setting_of: BTreeMap<&str, String> = trained
        .iter()
        .map(|r| {
            let setting = replicates::setting(&r.label);
            let others = setting
                .split_whitespace()
                .filter(|kv| !kv.starts_with("attention.window="))
                .collect::<Vec<_>>()
                .join(" ");
            let name = format!("L2A w={} {}", r.window, legend_of("", &others));
            (r.cell.as_str(), name.trim().to_string())
        })
        .collect();
    // Per setting, per tau: the replicates' (pairs, loss).
    type Points = BTreeMap<u64, (Vec<f64>, Vec<f64>)>;
    let mut groups: BTreeMap<String, Points> = BTreeMap::new();
    for r in &tau {
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
            .entry(r.tau.to_bits())
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
                errors.push(loss.half_width);
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

/// L2A Fig. 3 / SwiAttn Fig. 5: sparsity per layer of each trained per-token router.
fn layer_sparsity(all: &[Row], figs: &mut Vec<(String, Figure)>) {
    for r in all
        .iter()
        .filter(|r| spec(r.method).gates == Gates::PerToken && r.kind == StageKind::Train)
        .filter(|r| first_replicate(r, all.iter()))
    {
        let Some(g) = r.gates() else { continue };
        let per_layer = &g.per_layer;
        figs.push((
            format!("layer_sparsity_{}", r.cell),
            Figure::Bars {
                title: format!("Sparsity per layer: {} {}", name_of(r.method), r.label),
                x: "layer".into(),
                y: "sparsity 1 - mu_f".into(),
                bars: per_layer
                    .iter()
                    .enumerate()
                    .map(|(l, m)| (l.to_string(), 1.0 - m))
                    .collect(),
            },
        ));
    }
}

/// Validation loss during training (PPA Fig. 2), continuations on their own axes too.
fn loss_curves(sweep: &Path, train: &[&Row], figs: &mut Vec<(String, Figure)>) {
    let curves: Vec<(bool, String, Vec<(f64, f64)>)> = train
        .iter()
        .filter_map(|r| {
            let log = log_columns(
                &sweep.join(&r.cell).join("val_log.csv"),
                &["step", "val_loss"],
            )?;
            // At the tokens behind the model, so a continuation starts where its source ended.
            let at = |step: f64| (r.start_tokens + step * r.tokens_per_step) / 1e6;
            let pts: Vec<(f64, f64)> = log.iter().map(|x| (at(x[0]), x[1])).collect();
            let name = setting_legend(r);
            (pts.len() > 1).then_some((r.start_tokens > 0.0, name, pts))
        })
        .collect();
    let continued_names: std::collections::BTreeSet<String> =
        curves.iter().filter(|c| c.0).map(|c| c.1.clone()).collect();
    let curves: Vec<(bool, Series)> =
        replicate_means(curves.into_iter().map(|c| (c.1, c.2)).collect())
            .into_iter()
            .map(|s| (continued_names.contains(&s.name), s))
            .collect();
    if !curves.is_empty() {
        let x = "training tokens (millions, with those of the cell continued from)";
        let title = "Validation loss during training";
        let continued: Vec<String> = curves
            .iter()
            .filter(|c| c.0)
            .map(|c| c.1.name.clone())
            .collect();
        let all = sorted(curves.into_iter().map(|c| c.1).collect());
        let fig = if continued.is_empty() || continued.len() == all.len() {
            Figure::Lines {
                title: title.into(),
                x: x.into(),
                y: "validation loss".into(),
                series: all,
                x_axis: XAxis::Linear,
            }
        } else {
            // The continuations on their own axes too (PPA Fig. 2: the curves ordered by p),
            // where beside the base's descent they would be a knot. The cells from scratch stay
            // in that panel without points, so each cell keeps its colour and marker.
            let zoomed = all
                .iter()
                .map(|s| {
                    let keep = continued.contains(&s.name);
                    series(
                        s.name.clone(),
                        if keep { s.points.clone() } else { vec![] },
                        true,
                    )
                })
                .collect();
            let panel = |title: &str, series| Panel {
                title: title.into(),
                x: x.into(),
                y: "validation loss".into(),
                series,
                x_axis: XAxis::Linear,
            };
            Figure::Panels {
                title: title.into(),
                panels: vec![panel("every cell", all), panel("continuations", zoomed)],
            }
        };
        figs.push(("loss_curves".into(), fig));
    }
}

/// The router's learning curve (L2A Sec. 3.3: collapse): every learned router's gate
/// usage and training loss over its own steps, from `train_log.csv`.
fn router_curves(sweep: &Path, train: &[&Row], figs: &mut Vec<(String, Figure)>) {
    let logs: Vec<(&Row, Vec<Vec<f64>>)> = train
        .iter()
        .filter(|r| r.router == Router::Learned && r.mu_f().is_some())
        .filter_map(|r| {
            let path = sweep.join(&r.cell).join("train_log.csv");
            let pts = log_columns(&path, &["step", "loss", "mu_f"])?;
            (pts.len() > 1).then_some((*r, pts))
        })
        .collect();
    if !logs.is_empty() {
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
}

/// Loss by dependency distance on the synthetic corpus, every evaluated cell.
fn bucket_loss(all: &[Row], figs: &mut Vec<(String, Figure)>) {
    let buckets: Vec<&Row> = all
        .iter()
        .filter(|r| r.kind != StageKind::Prune && r.report.buckets.len() > 1)
        .collect();
    if !buckets.is_empty() {
        // Recall buckets only: distances 1 (local), 2-3, 4-7, ... at their smallest distance.
        let recall = |r: &Row| -> Vec<(f64, f64)> {
            r.report
                .buckets
                .iter()
                .filter(|b| b.min_distance >= 1 && b.min_distance < u32::MAX && b.tokens > 0)
                .map(|b| (b.min_distance as f64, b.loss))
                .collect()
        };
        figs.push((
            "bucket_loss".into(),
            Figure::Lines {
                title: "Loss by dependency distance (synthetic corpus)".into(),
                x: "dependency distance (bucket's smallest: 1, 2-3, 4-7, ...)".into(),
                y: "validation loss on the bucket's tokens".into(),
                series: sorted(
                    buckets
                        .iter()
                        .map(|r| series(legend_name(r), recall(r), true))
                        .filter(|s| !s.points.is_empty())
                        .collect(),
                ),
                x_axis: XAxis::LogSwept,
            },
        ));
    }
}

/// L2A Figs. 14-15: forward and prefill time and decoding speed against length, one line per
/// setting, from the cells that ran alone on the GPU (`timing.csv`).
fn prefill_time(all: &[Row], figs: &mut Vec<(String, Figure)>) {
    let timed = tables::timed_alone(all);
    // Against length means at two lengths or more (one length is `pareto_prefill`'s axis).
    let lengths: BTreeSet<usize> = timed.iter().map(|(_, t)| t.seq_len).collect();
    if lengths.len() < 2 {
        return;
    }
    // One line per model: its setting without the length it was timed at.
    let name = |r: &Row| {
        let setting = replicates::setting(&r.label);
        let kept: Vec<&str> = setting
            .split(' ')
            .filter(|kv| !kv.starts_with("eval.seq_len=") && !kv.starts_with("eval.batch_size="))
            .collect();
        legend_of(&r.stage, &kept.join(" "))
    };
    // Seeds of one setting timed at one length are averaged into one point.
    let lines = |f: fn(&Timing) -> f64| -> Vec<Series> {
        replicate_means(
            timed
                .iter()
                .map(|(r, t)| (name(r), vec![(t.seq_len as f64, f(t))]))
                .collect(),
        )
    };
    let x_axis = XAxis::LogSwept;
    figs.push((
        "prefill_time".into(),
        Figure::Panels {
            title: "Inference time against length, each model alone on the GPU".into(),
            panels: vec![
                Panel {
                    title: "one forward, no cache (the fused kernels)".into(),
                    x: "context length (tokens), log scale".into(),
                    y: "forward time (ms)".into(),
                    series: lines(|t| t.forward_ms),
                    x_axis,
                },
                Panel {
                    title: "prefill into the key-value cache".into(),
                    x: "context length (tokens), log scale".into(),
                    y: "prefill time (ms)".into(),
                    series: lines(|t| t.prefill_ms),
                    x_axis,
                },
                Panel {
                    title: "greedy decoding over the cache".into(),
                    x: "context length (tokens), log scale".into(),
                    y: "decoded tokens/s".into(),
                    series: lines(|t| t.decode_tokens_per_s),
                    x_axis,
                },
            ],
        },
    ));
}

/// PPA Fig. 3 and Table 1: final loss against p, beside the probes' accuracy (with chance
/// and full attention as reference lines) and, on the synthetic corpus, the recall of
/// dependencies at least w back.
fn ppa_s_curve(all: &[Row], train: &[&Row], figs: &mut Vec<(String, Figure)>) {
    let ppa: Vec<&Row> = train
        .iter()
        .copied()
        .filter(|r| r.method == Method::Ppa)
        .collect();
    if ppa.is_empty() {
        return;
    }
    let by_window = |rows: &[&Row], f: &dyn Fn(&Row) -> Option<f64>| {
        grouped(
            rows,
            "attention.ppa_power",
            |r| format!("window={}", r.window),
            |r| Some((r.ppa_power, f(r)?)),
        )
    };
    let panel = |title: &str, y: &str, series| Panel {
        title: title.into(),
        x: "power p".into(),
        y: y.into(),
        series,
        x_axis: XAxis::LinearSwept,
    };
    let mut panels = vec![panel(
        "validation loss",
        "loss",
        with_reference(
            by_window(&ppa, &|r| Some(r.loss())),
            full_reference(train.iter().copied(), &ppa, |r| Some(r.loss())),
        ),
    )];
    let probed: Vec<&Row> = all
        .iter()
        .filter(|r| r.method == Method::Ppa && pareto::probe_exact_match(r).is_some())
        .collect();
    if !probed.is_empty() {
        // Full attention's probes: those of full attention trained as long where the sweep
        // has it (not the untrained base), else PPA's own p = 1 (the same pattern).
        let full = full_reference(all, &ppa, pareto::probe_exact_match).or_else(|| {
            let at_1: Vec<f64> = probed
                .iter()
                .filter(|r| r.ppa_power == 1.0)
                .filter_map(|r| pareto::probe_exact_match(r))
                .collect();
            (!at_1.is_empty()).then(|| summarize(&at_1).mean)
        });
        let lines = with_line(
            by_window(&probed, &pareto::probe_exact_match),
            "full attention, trained as long",
            full,
            6,
        );
        // A needle of digits is not guessed: chance is 0.
        let lines = with_line(lines, "chance", Some(0.0), 8);
        panels.push(panel("probes (RULER NIAH)", "exact-match accuracy", lines));
    }
    let far = by_window(&ppa, &|r| r.far()?.1);
    if far.iter().any(|s| !s.points.is_empty()) {
        // The synthetic corpus's long-range task (PPA Table 1's accuracy).
        panels.push(panel(
            "recall of dependencies >= w back",
            "exact-match accuracy",
            far,
        ));
    }
    // PPA's attention time against p: only cells timed alone on the GPU (`exclusive`), since
    // a timing beside other cells measures their load as much as p.
    let timed: Vec<&Row> = tables::timed_alone(all)
        .into_iter()
        .filter(|(r, _)| r.method == Method::Ppa)
        .map(|(r, _)| r)
        .collect();
    if !timed.is_empty() {
        let line = |what: &'static str, f: fn(&Timing) -> f64| {
            grouped(
                &timed,
                "attention.ppa_power",
                move |r| {
                    let len = r.report.timing.as_ref().map_or(0, |t| t.seq_len);
                    format!("{what}, L={len} window={}", r.window)
                },
                move |r| Some((r.ppa_power, f(r.report.timing.as_ref()?))),
            )
        };
        let mut series = line("attention layers", |t| t.attention_ms);
        series.extend(line("prefill", |t| t.prefill_ms));
        panels.push(panel("one sequence, alone on the GPU", "time (ms)", series));
    }
    let fig = match panels.len() {
        1 => {
            let p = panels.remove(0);
            Figure::Lines {
                title: "PPA: final validation loss against p".into(),
                x: p.x,
                y: "validation loss".into(),
                series: p.series,
                x_axis: p.x_axis,
            }
        }
        _ => Figure::Panels {
            title: "PPA against p".into(),
            panels,
        },
    };
    figs.push(("ppa_s_curve".into(), fig));
}

/// The figures of each cell's own evaluation files: probe usage maps (AHA Fig. 3 per task)
/// and NIAH by length and depth (SwiAttn Figs. 3 and 6).
fn cell_files(sweep: &Path, all: &[Row], figs: &mut Vec<(String, Figure)>) -> Result<()> {
    for r in all.iter().filter(|r| first_replicate(r, all.iter())) {
        let p = sweep.join(&r.cell).join("eval/probe_head_usage.csv");
        if p.is_file() {
            for (task, f) in probe_usage_maps(&p, &format!("{} {}", name_of(r.method), r.label))? {
                figs.push((format!("head_usage_{}_{task}", r.cell), f));
            }
        }
        let p = sweep.join(&r.cell).join("eval/niah.csv");
        if p.is_file() {
            // Full attention has no window to mark.
            let window = spec(r.method).windowed.then_some(r.window);
            let label = format!("{} {}", name_of(r.method), r.label);
            for (stem, f) in niah_figures(&p, &r.cell, &label, window)? {
                figs.push((format!("{stem}_{}", r.cell), f));
            }
        }
    }
    Ok(())
}

/// Per cost of `pareto::Cost`, over the comparable cells: validation loss against it, and
/// beside it long-context accuracy where the cells measured one (`pareto::accuracy`), each
/// panel with its Pareto front drawn first, so every method's markers sit over it, and the
/// front's points labelled with their settings.
fn pareto_figures(all: &[Row]) -> Vec<(String, Figure)> {
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
            let points: Vec<(&Row, (f64, f64))> = rows
                .iter()
                .filter_map(|r| Some((r, (cost.of(r)?, quality(r)?))))
                .collect();
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
            for ((r, p), on) in points.iter().zip(&on) {
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
                // Settings beside the front's points only: the cells off it crowd together,
                // and the legend names every method (pareto.csv has each cell's settings).
                s.labels.push(match (on, pareto::settings(r)) {
                    (false, _) => String::new(),
                    (true, settings) if settings.is_empty() => pareto::family(r),
                    (true, settings) => settings,
                });
            }
            let mut series = vec![self::series("Pareto front".into(), front, true)];
            series.extend(sorted(families.into_values().collect()));
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

/// Renders every figure of `sweep` into `out/figures/` and writes the tables into `out`.
pub(crate) fn write_all(sweep: &Path, out: &Path) -> Result<Vec<PathBuf>> {
    let mut written = tables::write_all(sweep, out)?;
    let dir = out.join("figures");
    atomic::ensure_writable_dir(&dir)?;
    for (stem, fig) in figures(sweep)? {
        written.extend(fig.save(&dir.join(stem))?);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sweep::figure::cell_label;
    use crate::sweep::figure::tests::render;
    use crate::sweep::fixture;

    /// Replicates of one setting at one x become their mean with Student's 95 % interval as
    /// an error bar; another setting at the same x stays its own point, without one; the
    /// chart with error bars renders.
    #[test]
    fn replicates_become_a_mean_with_an_error_bar() {
        let dir = fixture::sweep_dir("replicate-points");
        let all = rows(&dir).unwrap();
        let with = |label: &str, loss: f64| {
            let mut r = all[0].clone();
            r.label = label.into();
            r.report.loss = loss;
            r
        };
        let (a, b, c) = (
            with("attention.window=8 train.seed=1", 1.0),
            with("attention.window=8 train.seed=2", 1.2),
            with("attention.window=4", 3.0),
        );
        let s = grouped(
            &[&a, &b, &c],
            WINDOW,
            |_| "s".into(),
            |r| Some((8.0, r.loss())),
        );
        assert_eq!(s.len(), 1);
        let (points, errors) = (&s[0].points, &s[0].errors);
        assert_eq!(points.len(), 2);
        let mean = points
            .iter()
            .position(|p| (p.1 - 1.1).abs() < 1e-12)
            .unwrap();
        assert!(
            (errors[mean] - 12.706 * (0.02f64).sqrt() / 2f64.sqrt()).abs() < 1e-9,
            "{errors:?}"
        );
        assert!(errors[1 - mean].is_nan());
        let single = grouped(&[&c], WINDOW, |_| "s".into(), |r| Some((8.0, r.loss())));
        assert!(single[0].errors.is_empty());
        let again = grouped(
            &[&a, &b, &c],
            WINDOW,
            |_| "s".into(),
            |r| Some((8.0, r.loss())),
        );
        let fig = usage_and_loss("t", "x", s, again);
        assert!(render(&fig).0 > 0);
    }

    #[test]
    fn a_control_at_one_window_is_its_own_series_and_legends_keep_whole_names() {
        let dir = fixture::sweep_dir("control-series");
        let all = rows(&dir).unwrap();
        let with = |label: &str, window: f64, loss: f64| {
            let mut r = all[0].clone();
            r.label = label.into();
            r.window = window;
            r.report.loss = loss;
            r
        };
        let cells = [
            with("attention.window=8 train.seed=1", 8.0, 1.0),
            with("attention.window=16 train.seed=1", 16.0, 0.9),
            with("train.router_init_bias=1.0 train.seed=1", 8.0, 2.0),
        ];
        let refs: Vec<&Row> = cells.iter().collect();
        let s = grouped(
            &refs,
            WINDOW,
            |_| "aha".into(),
            |r| Some((r.window, r.loss())),
        );
        let names: Vec<&str> = s.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["aha", "aha router_init_bias=1.0"]);
        assert_eq!(s[0].points, [(8.0, 1.0), (16.0, 0.9)]);
        // A reference line spans the x range; the legend widens to the longest name.
        let lines = with_reference(s, Some(0.5));
        assert_eq!(lines[2].points, [(8.0, 0.5), (16.0, 0.5)]);
        let fig = usage_and_loss("t", "x", vec![], lines);
        let long = "full attention, trained as long".chars().count() as u32;
        assert!(fig.size().0 >= 560 * 2 + 8 * long);
    }

    #[test]
    fn every_figure_of_a_fixture_sweep_renders() {
        let dir = fixture::sweep_dir("plots");
        let figs = figures(&dir).unwrap();
        let stems: Vec<&str> = figs.iter().map(|(s, _)| s.as_str()).collect();
        for want in [
            "mu_f_vs_window",
            "head_usage_aha-4",
            "head_usage_sorted",
            "lambda_ablation",
            "threshold_sweep",
            "layer_sparsity_l2a-0",
            "layer_sparsity_swi-0",
            "loss_curves",
            "bucket_loss",
            "ppa_s_curve",
            "pareto",
            "pareto_time",
            "pareto_memory",
        ] {
            assert!(stems.contains(&want), "{want} missing from {stems:?}");
        }
        for (stem, f) in &figs {
            let (ink, svg) = render(f);
            assert!(ink > 5_000, "{stem}: only {ink} drawn pixels");
            assert!(svg.contains(f.title()), "{stem}: title missing");
        }
        let written = write_all(&dir, &dir).unwrap();
        assert!(written.iter().any(|p| p.ends_with("figures/pareto.png")));
        // L2A Fig. 13 has the trained threshold among the test-time ones, in order of tau.
        let Some((_, Figure::Lines { series, .. })) =
            figs.iter().find(|(s, _)| s == "threshold_sweep")
        else {
            panic!("threshold_sweep is one chart");
        };
        assert_eq!(series.len(), 1);
        assert_eq!(series[0].labels, ["tau=0.3", "tau=0.5", "tau=0.7"]);
    }

    /// PPA's attention time against p reads only the PPA cells timed alone on the GPU: one
    /// line for the attention layers and one for prefill, each at the powers timed.
    #[test]
    fn ppa_s_curve_plots_time_against_p_from_cells_timed_alone() {
        let dir = fixture::sweep_dir("ppa-time");
        let ppa_time = |dir: &Path| {
            let figs = figures(dir).unwrap();
            let Some((_, Figure::Panels { panels, .. })) =
                figs.into_iter().find(|(s, _)| s == "ppa_s_curve")
            else {
                panic!("ppa_s_curve has panels");
            };
            panels
                .into_iter()
                .find(|p| p.title == "one sequence, alone on the GPU")
        };
        assert!(ppa_time(&dir).is_none(), "no cell ran alone yet");
        tables::tests::time_alone(&dir, &["ppa-0", "ppa-5", "full-0"], ("ppa-5", 6.0));
        let panel = ppa_time(&dir).expect("a time panel once PPA cells ran alone");
        let names: Vec<&str> = panel.series.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names.len(), 2, "{names:?}");
        assert!(names.iter().all(|n| n.contains("window=")), "{names:?}");
        let prefill = panel
            .series
            .iter()
            .find(|s| s.name.starts_with("prefill"))
            .unwrap();
        // The fixture times 8 ms for every cell but the one set to 6 ms.
        assert_eq!(prefill.points, [(0.0, 8.0), (0.5, 6.0)]);
    }

    #[test]
    fn probe_head_usage_gives_a_map_per_task() {
        let dir = std::env::temp_dir().join(format!("attnsweep-probe-map-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("probe_head_usage.csv");
        std::fs::write(&p, "task,layer,head,mu_f\npasskey,0,0,0.5\npasskey,0,1,1.0\npasskey,1,0,0.0\npasskey,1,1,0.25\nniah_single,0,0,1.0\nniah_single,0,1,0.0\nniah_single,1,0,0.5\nniah_single,1,1,0.5\n").unwrap();
        let maps = probe_usage_maps(&p, "aha").unwrap();
        let names: Vec<&str> = maps.iter().map(|(t, _)| t.as_str()).collect();
        assert_eq!(names, ["niah_single", "passkey"]);
        match &maps[1].1 {
            Figure::Heatmap { values, range, .. } => {
                assert_eq!(values, &vec![vec![0.5, 1.0], vec![0.0, 0.25]]);
                assert_eq!(*range, (0.0, 1.0));
            }
            _ => panic!("heatmap expected"),
        }
        std::fs::write(&p, "task,layer,head,mu_f\npasskey,0,x,0.5\n").unwrap();
        let e = probe_usage_maps(&p, "aha").err().unwrap().to_string();
        assert!(e.contains("row 2 needs task,layer,head,mu_f"), "{e}");
    }

    #[test]
    fn niah_csv_gives_heatmap_and_depth_curve() {
        let dir = std::env::temp_dir().join(format!("attnsweep-niah-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("niah.csv");
        std::fs::write(&p, "depth,length,accuracy,full_ratio\n0.0,64,1.0,0.2\n0.5,64,0.5,0.4\n0.0,128,0.8,0.3\n0.5,128,0.2,0.5\n").unwrap();
        let figs = niah_figures(&p, "c", "m", Some(32.0)).unwrap();
        assert_eq!(figs.len(), 2);
        match &figs[0].1 {
            Figure::Heatmap {
                values,
                x_ticks,
                y_ticks,
                ..
            } => {
                assert_eq!(values, &vec![vec![1.0, 0.8], vec![0.5, 0.2]]);
                // The axes name the lengths and depths, not their indices.
                assert_eq!(
                    (x_ticks.as_slice(), y_ticks.as_slice()),
                    (
                        &["64".to_string(), "128".into()][..],
                        &["0".to_string(), "0.5".into()][..]
                    )
                );
                assert_eq!(cell_label(1.5, x_ticks), "128");
                assert_eq!(cell_label(1.0, x_ticks), "");
            }
            _ => panic!("heatmap expected"),
        }
        match &figs[1].1 {
            Figure::Lines { series, .. } => {
                assert_eq!(series[0].points, vec![(0.0, 0.2), (0.5, 0.4)]);
                assert_eq!(series[1].points, vec![(0.0, 0.3), (0.5, 0.5)]);
                // A 32-token window reaches a needle from depth 0.5 of 64 tokens, 0.75 of 128.
                assert_eq!(series[2].name, "window reach, L=64");
                assert_eq!(series[2].points, vec![(0.5, 0.0), (0.5, 1.0)]);
                assert_eq!(series[3].points, vec![(0.75, 0.0), (0.75, 1.0)]);
            }
            _ => panic!("lines expected"),
        }
        for (_, f) in &figs {
            assert!(render(f).0 > 5_000);
        }
    }
}
