//! The figures a sweep directory's cells can fill, each as PNG and SVG (`figure.rs` draws
//! them), by family: the gates' (`gates.rs`), the curves over training, length and a method's
//! own setting (`curves.rs`), each cell's probe files (`cells.rs`), every method of one
//! budget (`pareto.rs` beside the table) and each set-up over its budgets (`budget.rs`), on
//! what they share (`series.rs`). Every family reads what it draws from the rows
//! (`rows.rs`); the families of one method's own are those its `MethodSpec::reports` names.
//!
//! | figure | paper item |
//! |---|---|
//! | `mu_f_vs_window` | AHA Table 1/2: full-attention usage and validation loss against the window |
//! | `head_usage_<cell>` | AHA Fig. 3: layer x head usage heatmap with a colour bar |
//! | `head_usage_<cell>_<task>` | AHA Fig. 3 per task, from a cell's `eval/probe_head_usage.csv` |
//! | `head_usage_sorted` | AHA Fig. 4: every head's usage, sorted |
//! | `lambda_ablation` | AHA Table 4: usage and validation loss against lambda, the paper's usage as references |
//! | `threshold_sweep` | L2A Fig. 13: quality against attention work as tau varies |
//! | `layer_sparsity_<cell>` | L2A Fig. 3 / SwiAttn Fig. 5: sparsity per layer |
//! | `loss_curves` | validation loss during training, every train cell (PPA Fig. 2: curves by p) |
//! | `router_curves` | every learned router's gate usage and training loss over its steps (L2A router collapse) |
//! | `ppa_s_curve` | PPA Fig. 3 and Table 1 (a method's `Report::Curve`): final loss against p, the probes' accuracy, on the synthetic corpus the accuracy on dependencies at least w back, and the attention and prefill time of the cells timed alone |
//! | `swiattn_gamma` | SwiAttn's regulariser weight (`Report::Curve`, a log axis): final loss, the full ratio beside the paper's ~0.13, and the probes against gamma_base, a line per budget |
//! | `bucket_loss` | loss by dependency distance on the synthetic corpus, every evaluated cell |
//! | `niah_heatmap_<cell>`, `full_ratio_vs_depth` | SwiAttn Fig. 3 and 6, from a cell's `eval/niah.csv` |
//! | `pareto`, `pareto_time`, `pareto_memory`, `pareto_prefill` | every method of one budget: loss against attention work, measured training time, decode memory and prefill time timed alone, each with its Pareto front |
//! | `prefill_time` | L2A Figs. 14-15: forward, prefill and decoding time against length, cells timed alone |
//! | `budget_ladder` | L2A Fig. 3's usage and each paper's key statistic against training tokens: loss, full-attention share (with the paper's value) and the probes at each length, a line per set-up over its budgets (`budget.rs`) |
//! | `budget_positions` | the loss by position in the sequence of every set-up of a budget ladder, a panel per budget, the pretrained model's beside them (`budget.rs`) |

mod budget;
mod cells;
mod curves;
mod gates;
mod pareto;
mod series;
#[cfg(test)]
mod tests;

use super::figure::Figure;
use super::grid::StageKind;
use super::rows::{rows, Row};
use super::tables::{self, Plotted};
use crate::config::Router;
use crate::model::attention::{all_methods, Report};
use crate::util::atomic;
use anyhow::Result;
use std::path::Path;

/// Every figure the sweep directory's cells can fill, as (file stem, figure).
#[cfg(test)]
pub(crate) fn figures(sweep: &Path) -> Result<Vec<(String, Figure)>> {
    Ok(figures_of(&rows(sweep)?.rows))
}

/// Every figure `all` (a sweep directory's rows) can fill.
fn figures_of(all: &[Row]) -> Vec<(String, Figure)> {
    let train: Vec<&Row> = all.iter().filter(|r| r.kind == StageKind::Train).collect();
    let mut figs: Vec<(String, Figure)> = Vec::new();
    gates::mu_f_vs_window(&train, &mut figs);
    // Each method's own families, over its learned routers' train cells where they read
    // routers (in the registry's order of the methods that report them).
    let learned = |r: &&Row| r.router == Router::Learned;
    let learned_train: Vec<&Row> = train.iter().copied().filter(learned).collect();
    let head_usage = |r: &Report| matches!(r, Report::HeadUsage).then_some(());
    for ((), rows) in reporting(&learned_train, head_usage) {
        gates::head_usage(&rows, &mut figs);
    }
    let lambda = |r: &'static Report| match r {
        Report::LambdaAblation { paper, source } => Some((*paper, *source)),
        _ => None,
    };
    for (paper, rows) in reporting(&learned_train, lambda) {
        gates::lambda_ablation(&rows, &train, paper, &mut figs);
    }
    let every: Vec<&Row> = all.iter().filter(learned).collect();
    let threshold = |r: &Report| matches!(r, Report::ThresholdSweep).then_some(());
    for ((), rows) in reporting(&every, threshold) {
        gates::threshold_sweep(&rows, &mut figs);
    }
    gates::layer_sparsity(all, &mut figs);
    curves::loss_curves(&train, &mut figs);
    gates::router_curves(&train, &mut figs);
    curves::bucket_loss(all, &mut figs);
    for s in all_methods() {
        for r in s.reports {
            if let Report::Curve(c) = r {
                curves::setting_curve(s, c, all, &train, &mut figs);
            }
        }
    }
    curves::prefill_time(all, &mut figs);
    cells::cell_files(all, &mut figs);
    figs.extend(pareto::pareto_figures(all));
    budget::budget_ladder(all, &mut figs);
    budget::budget_positions(all, &mut figs);
    figs
}

/// For each method whose `MethodSpec::reports` has a report that `pick` takes, what it took
/// and the method's rows, in the registry's order.
fn reporting<'a, T>(
    rows: &[&'a Row],
    pick: impl Fn(&'static Report) -> Option<T>,
) -> Vec<(T, Vec<&'a Row>)> {
    all_methods()
        .filter_map(|s| {
            let took = s.reports.iter().find_map(&pick)?;
            let mine = rows
                .iter()
                .copied()
                .filter(|r| r.method == s.method)
                .collect();
            Some((took, mine))
        })
        .collect()
}

/// Renders every figure of `sweep` into `out/figures/` and writes the tables into `out`
/// (`tables::write_rows`, which says what `drop_absent` allows).
pub(crate) fn write_all(sweep: &Path, out: &Path, drop_absent: bool) -> Result<Plotted> {
    // The cells are read once, for the tables and the figures alike.
    let read = rows(sweep)?;
    let mut plotted = tables::write_rows(sweep, out, &read, drop_absent)?;
    let dir = out.join("figures");
    atomic::ensure_writable_dir(&dir)?;
    let all = &read.rows;
    let mut drawn = Vec::new();
    for (stem, fig) in figures_of(all) {
        drawn.extend(fig.save(&dir.join(stem))?);
    }
    // A cell's own figure that this plot no longer draws (its data changed: an empty
    // full-ratio figure of a cell without routers) would otherwise stay beside the new ones
    // and be read as current. Only figures named after a cell read here are touched.
    for entry in std::fs::read_dir(&dir)? {
        let path = entry?.path();
        let ext = path.extension().and_then(|e| e.to_str());
        let stem = path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or_default();
        let of_cell = all.iter().any(|r| stem.ends_with(&format!("_{}", r.cell)));
        if matches!(ext, Some("png" | "svg")) && of_cell && !drawn.contains(&path) {
            std::fs::remove_file(&path)?;
            plotted.removed.push(path);
        }
    }
    plotted.written.extend(drawn);
    Ok(plotted)
}
