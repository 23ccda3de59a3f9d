//! Tables of a sweep directory: one tidy long table of every cell and metric, a wide summary
//! with one row per cell, and each paper table the sweep's cells can fill, all as CSV.
//!
//! | file | paper item | cells it reads |
//! |---|---|---|
//! | `tidy.csv` | - | every finished cell, one row per (cell, metric) |
//! | `summary.csv` | - | every finished cell, one row each; where some cell could not be read, a `note` column says what, and each cell without a row has one holding its note |
//! | `aha_windows.csv` | AHA Tables 1/2 | AHA train cells: quality, retain %, mu_f by window |
//! | `aha_lambda.csv` | AHA Table 4 | AHA train cells, by lambda |
//! | `aha_static_heads.csv` | AHA Table 5 | static top-k heads beside AHA at its budget |
//! | `l2a_threshold.csv` | L2A Fig. 13 | L2A cells evaluated at other thresholds |
//! | `l2a_pruning.csv` | L2A Fig. 9 | prune cells |
//! | `swiattn_baselines.csv` | SwiAttn Tables 1-3 | Full, SWA-ZS, SWA-CPT, StaticHybrid, SwiAttn |
//! | `swiattn_ablations.csv` | SwiAttn Table 4 | SwiAttn cells by regulariser variant |
//! | `ppa.csv` | PPA Table 1 | PPA cells by p |
//! | `timing.csv` | L2A Figs. 14-15; PPA's time against p | cells that had their device to themselves: prefill and decoding time by length (and p), medians of 3 runs with their spread, against full attention's |
//! | `layer_usage.csv` | L2A Fig. 3, SwiAttn Fig. 5 | gated train cells: usage per layer, layers from 1 |
//! | `pareto.csv` | - | every method of one budget on every cost, with the fronts (`pareto`) |
//! | `equal_work.csv` | - | every method of that budget less SWA's loss at its attended pairs, interpolated in log pairs between the two windows that bracket them, with 95 % intervals and Holm (`equal_work`) |
//! | `budget.csv` | - | a grid with budget ladders (stages with `ladder`): each line's loss, usage and probes by prompt length against its training tokens, replicates pooled with 95 % intervals (`budget`) |
//! | `replicates.csv` | - | a grid with `seeds`: each setting's mean, sd, n and 95 % interval per metric |
//! | `replicate_differences.csv` | - | every two settings of a stage: the difference, its 95 % Welch interval, "within noise" or "differs" |
//! | `stage_differences.csv` | - | every two settings of different train stages, on loss and attended pairs: the same comparison across methods |
//!
//! Quality is validation loss and perplexity; retain % is the full-attention model's
//! perplexity over the method's, times 100 (AHA's "method score / full score" for a metric
//! where lower is better).

use super::budget;
use super::equal_work;
use super::grid::StageKind;
use super::pareto;
use super::replicates;
use super::rows::{read_cells, rows, seed_of, setting_text_of, Row, SweepRows, Unread};
use crate::config::{name_of, AttentionConfig, Method, Router};
use crate::model::attention::{all_methods, Report, SettingColumn, Value, SHARED_COLUMNS};
use crate::run::prune::PruneReport;
use crate::run::report::{GateReport, Timing, HEAD_USAGE_COLUMNS};
use crate::util::atomic;
use anyhow::{bail, ensure, Context, Result};
use polars::prelude::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Every setting column, in the summary's order: the shared ones, then every method's own
/// written for every cell, then those written for their method's cells alone; each with the
/// method that declares it (None: shared).
fn all_setting_columns() -> Vec<(&'static SettingColumn, Option<Method>)> {
    let own = |every: bool| {
        all_methods().flat_map(move |s| {
            s.columns
                .iter()
                .filter(move |c| c.every_cell == every)
                .map(move |c| (c, Some(s.method)))
        })
    };
    SHARED_COLUMNS
        .iter()
        .map(|c| (c, None))
        .chain(own(true))
        .chain(own(false))
        .collect()
}

/// The setting columns a table of `rows` holds: those in every summary, and a method's others
/// where a row is of its method.
fn setting_columns(rows: &[&Row]) -> Vec<(&'static SettingColumn, Option<Method>)> {
    all_setting_columns()
        .into_iter()
        .filter(|(c, owner)| c.in_every_summary || rows.iter().any(|r| Some(r.method) == *owner))
        .collect()
}

/// One setting column over `rows`: a value for every row where the column is every cell's,
/// else for its method's rows (numbers empty elsewhere, text "").
fn setting_column(col: &SettingColumn, owner: Option<Method>, rows: &[&Row]) -> Column {
    let values: Vec<Option<Value>> = rows
        .iter()
        .map(|r| {
            (col.every_cell || Some(r.method) == owner).then(|| (col.value)(&r.grid_attention))
        })
        .collect();
    // Its type is its value's, whatever rows hold one.
    let text = matches!((col.value)(&AttentionConfig::default()), Value::Text(_));
    match text {
        true => Column::new(
            col.name.into(),
            values
                .into_iter()
                .map(|v| match v {
                    Some(Value::Text(t)) => t,
                    _ => String::new(),
                })
                .collect::<Vec<String>>(),
        ),
        false => Column::new(
            col.name.into(),
            values
                .into_iter()
                .map(|v| match v {
                    Some(Value::Number(x)) => Some(x),
                    _ => None,
                })
                .collect::<Vec<Option<f64>>>(),
        ),
    }
}

/// Retain % against full attention at the same total training budget: a full-attention
/// train cell of the same model and data whose tokens equal the row's (the one continued
/// from the same cell when there are several); none when the sweep has no such cell, rather
/// than a reference trained for longer or shorter.
fn retain_references(rows: &[Row]) -> Vec<Option<&Row>> {
    rows.iter()
        .map(|r| {
            let same = |x: &&Row| {
                x.is_reference()
                    && x.kind == StageKind::Train
                    && x.model_key == r.model_key
                    && x.budget_tokens == r.budget_tokens
                    && x.report.seq_len == r.report.seq_len
            };
            rows.iter()
                .filter(same)
                .find(|x| x.source == r.source)
                .or_else(|| rows.iter().find(same))
        })
        .collect()
}

fn summary_frame(rows: &[Row]) -> Result<DataFrame> {
    let s = |f: fn(&Row) -> String| rows.iter().map(f).collect::<Vec<String>>();
    let n = |f: fn(&Row) -> f64| rows.iter().map(f).collect::<Vec<f64>>();
    let o = |f: fn(&Row) -> Option<f64>| rows.iter().map(f).collect::<Vec<Option<f64>>>();
    let reference = retain_references(rows);
    let retain: Vec<Option<f64>> = rows
        .iter()
        .zip(&reference)
        .map(|(r, f)| f.map(|f| 100.0 * (f.report.perplexity / r.report.perplexity)))
        .collect();
    let retain_ref: Vec<String> = reference
        .iter()
        .map(|f| f.map_or(String::new(), |f| f.cell.clone()))
        .collect();
    let prune = |f: fn(&PruneReport) -> f64| {
        rows.iter()
            .map(|r| r.prune.as_ref().map(f))
            .collect::<Vec<Option<f64>>>()
    };
    let gates = |f: fn(&GateReport) -> Option<f64>| {
        rows.iter()
            .map(|r| r.gates().and_then(f))
            .collect::<Vec<Option<f64>>>()
    };
    let all: Vec<&Row> = rows.iter().collect();
    let settings: Vec<Column> = setting_columns(&all)
        .into_iter()
        .map(|(c, owner)| setting_column(c, owner, &all))
        .collect();
    Ok(df!(
        "cell" => s(|r| r.cell.clone()),
        "stage" => s(|r| r.stage.clone()),
        "kind" => s(|r| name_of(r.kind)),
        "label" => s(|r| r.label.clone()),
        "method" => s(|r| name_of(r.method)),
        "source_method" => s(|r| r.source_method.map(name_of).unwrap_or_default()),
        "router" => s(|r| match r.router {
            Router::Bernoulli => format!("bernoulli({})", r.bernoulli_p),
            Router::Learned => "learned".into(),
        }),
        "variant" => s(|r| r.variant.clone()),
        "setting" => s(|r| r.head_budget.clone()),
    )?
    .hstack(&settings)?
    .hstack(
        df!(
            "budget_tokens" => n(|r| r.budget_tokens),
            "tokens_per_s" => o(|r| r.tokens_per_s),
            "eval_seq_len" => n(|r| r.report.seq_len as f64),
            "loss" => n(|r| r.report.loss),
            "perplexity" => n(|r| r.report.perplexity),
            "retain_pct" => retain,
            "retain_ref" => retain_ref,
            "pairs_vs_full" => n(|r| r.report.attention.pairs_vs_full),
            "attention_flops" => n(|r| r.report.attention.flops),
            "kv_cache_bytes" => n(|r| r.report.kv_cache_bytes_total),
            "mu_f" => o(|r| r.mu_f()),
            "censored_heads" => gates(|g| Some(g.censored_heads as f64)),
            "gate_precision" => gates(|g| g.need.as_ref().and_then(|n| n.all_gates.precision)),
            "gate_recall" => gates(|g| g.need.as_ref().and_then(|n| n.all_gates.recall)),
            // The honest baselines of the two above: chance (gates opened at random) and the
            // rule "open at the key after ASK" (`NeedReport::ask_rule`).
            "chance_precision" => gates(|g| g.need.as_ref().map(|n| n.needing as f64 / n.positions.max(1) as f64)),
            "ask_rule_precision" => gates(|g| g.need.as_ref().and_then(|n| n.ask_rule.precision)),
            "ask_rule_recall" => gates(|g| g.need.as_ref().and_then(|n| n.ask_rule.recall)),
            "far_loss" => o(|r| r.far().map(|f| f.0)),
            "far_accuracy" => o(|r| r.far().and_then(|f| f.1)),
            "threshold" => prune(|p| p.threshold),
            "pruned_layers" => prune(|p| p.pruned_layers.len() as f64),
            "kv_cache_bytes_before" => prune(|p| p.kv_cache_bytes_before),
            "loss_before" => prune(|p| p.loss_before),
        )?
        .columns(),
    )?
    .hstack(&source_columns(rows))?
    .hstack(&position_columns(rows))?
    .hstack(&task_columns(rows))?)
}

/// One column per corpus source any row was evaluated on (`loss_<source>`: the validation
/// loss of a corpus held out per source).
fn source_columns(rows: &[Row]) -> Vec<Column> {
    keyed_columns(
        rows,
        |r| {
            r.report
                .by_source
                .iter()
                .map(|s| (s.source.clone(), s.loss))
                .collect()
        },
        |source| format!("loss_{source}"),
    )
}

/// One column per position bucket any row was evaluated with (`loss_pos_<from>_<to>`), in
/// the order of the positions.
fn position_columns(rows: &[Row]) -> Vec<Column> {
    keyed_columns(
        rows,
        |r| {
            r.report
                .by_position
                .iter()
                .map(|p| ((p.from, p.to), p.loss))
                .collect()
        },
        |&(from, to)| crate::run::report::position_column(from, to),
    )
}

/// One column per key that `values` gives any row, in the keys' order and named by `name`,
/// empty where a row has no such value.
fn keyed_columns<K: Ord + Clone>(
    rows: &[Row],
    values: impl Fn(&Row) -> BTreeMap<K, f64>,
    name: impl Fn(&K) -> String,
) -> Vec<Column> {
    let per_row: Vec<BTreeMap<K, f64>> = rows.iter().map(values).collect();
    let keys: std::collections::BTreeSet<&K> = per_row.iter().flat_map(|m| m.keys()).collect();
    keys.into_iter()
        .map(|k| {
            let v: Vec<Option<f64>> = per_row.iter().map(|m| m.get(k).copied()).collect();
            Column::new(name(k).into(), v)
        })
        .collect()
}

/// One column per task metric any row has.
fn task_columns(rows: &[Row]) -> Vec<Column> {
    keyed_columns(rows, |r| r.tasks.clone(), String::clone)
}

/// Every numeric metric of every cell as (cell, stage, method, label, metric, value): the
/// summary's numbers but its settings and the cells' budgets and lengths.
fn tidy_frame(summary: &DataFrame) -> Result<DataFrame> {
    let ids = ["cell", "stage", "kind", "method", "label"];
    let settings: Vec<&str> = all_setting_columns()
        .iter()
        .map(|(c, _)| c.name)
        .chain(["budget_tokens", "eval_seq_len"])
        .collect();
    let metrics: Vec<String> = summary
        .columns()
        .iter()
        .filter(|c| c.dtype() == &DataType::Float64 && !settings.contains(&c.name().as_str()))
        .map(|c| c.name().to_string())
        .collect();
    let mut cols: Vec<Vec<String>> = vec![Vec::new(); ids.len() + 1];
    let mut values: Vec<f64> = Vec::new();
    for i in 0..summary.height() {
        for m in &metrics {
            let v = summary.column(m)?.f64()?.get(i);
            let Some(v) = v else { continue };
            for (j, id) in ids.iter().enumerate() {
                cols[j].push(summary.column(id)?.str()?.get(i).unwrap_or("").to_string());
            }
            cols[ids.len()].push(m.clone());
            values.push(v);
        }
    }
    let mut columns: Vec<Column> = ids
        .iter()
        .zip(&cols)
        .map(|(n, c)| Column::new((*n).into(), c))
        .collect();
    columns.push(Column::new("metric".into(), &cols[ids.len()]));
    columns.push(Column::new("value".into(), values));
    Ok(DataFrame::new_infer_height(columns)?)
}

fn write_csv(df: &mut DataFrame, path: &Path) -> Result<()> {
    atomic::write_with(path, |tmp| {
        let mut f = std::fs::File::create(tmp)?;
        CsvWriter::new(&mut f).finish(df)?;
        Ok(())
    })
}

/// The rows of `summary` (one per row of `rows`) where `keep` holds.
fn filtered(summary: &DataFrame, rows: &[Row], keep: impl Fn(&Row) -> bool) -> Result<DataFrame> {
    let mask: BooleanChunked = rows.iter().map(|r| keep(r)).collect();
    Ok(summary.filter(&mask)?)
}

/// What a plot wrote, and what it could not read: the cells without a row, and the rows
/// that lack part of their files (cell, what).
pub(crate) struct Plotted {
    pub(crate) written: Vec<PathBuf>,
    pub(crate) unread: Vec<Unread>,
    pub(crate) noted: Vec<(String, String)>,
    /// No cell could be read, and the replicate tables were rebuilt from `tidy.csv`.
    pub(crate) from_tidy: bool,
    /// Figures of this sweep's cells that an earlier plot drew and this one did not.
    pub(crate) removed: Vec<PathBuf>,
}

/// `summary` with a `note` column saying what of each cell could not be read, and a row for
/// each cell without one (its identity and note alone): a table with a hole says so. A
/// sweep read whole keeps its summary as it was.
fn with_notes(summary: DataFrame, rows: &[Row], unread: &[Unread]) -> Result<DataFrame> {
    if unread.is_empty() && rows.iter().all(|r| r.note.is_empty()) {
        return Ok(summary);
    }
    let mut summary = summary;
    let notes: Vec<String> = rows.iter().map(|r| r.note.join("; ")).collect();
    summary.with_column(Column::new("note".into(), notes))?;
    let n = unread.len();
    let text = |f: fn(&Unread) -> String| unread.iter().map(f).collect::<Vec<String>>();
    let known: [(&str, Vec<String>); 5] = [
        ("cell", text(|u| u.cell.clone())),
        ("stage", text(|u| u.stage.clone())),
        ("kind", text(|u| name_of(u.kind))),
        ("label", text(|u| u.label.clone())),
        ("note", text(|u| format!("no row: {}", u.why))),
    ];
    let columns: Vec<Column> = summary
        .columns()
        .iter()
        .map(
            |c| match known.iter().find(|(k, _)| *k == c.name().as_str()) {
                Some((k, v)) => Column::new((*k).into(), v),
                None => Column::full_null(c.name().clone(), n, c.dtype()),
            },
        )
        .collect();
    Ok(summary.vstack(&DataFrame::new(n, columns)?)?)
}

/// What a plot could not read, for the user: the cells without a row grouped by why (at
/// most 8 named per reason), then the rows that lack part of their files; "" when it read
/// everything.
pub(crate) fn unread_report(p: &Plotted) -> String {
    let mut out = String::new();
    if p.from_tidy {
        out += "plot: no cell's folder is here; the replicate tables were rebuilt from tidy.csv \
                 (probe intervals over replicates alone, without their prompts) and the figures \
                 were left as they are: they need the cells, which `attnsweep sweep --grid \
                 <its grid> --out <this folder>` makes again (the folder's README names the grid)\n";
    }
    if !p.unread.is_empty() {
        out += &format!(
            "plot: {} cells of the sweep have no row{}:\n",
            p.unread.len(),
            match p.written.is_empty() || p.from_tidy {
                true => "",
                false => " (summary.csv lists each with its note)",
            }
        );
        let pairs = p.unread.iter().map(|u| (u.cell.as_str(), u.why.as_str()));
        for (why, cells) in super::by_reason(pairs, 8) {
            out += &format!("  {why}: {cells}\n");
        }
    }
    for f in &p.removed {
        out += &format!(
            "plot: removed {}: this plot draws it no longer\n",
            f.display()
        );
    }
    if !p.noted.is_empty() {
        out += &format!(
            "plot: {} rows lack part of their files (summary.csv's note column):\n",
            p.noted.len()
        );
        for (cell, note) in &p.noted {
            out += &format!("  {cell}: {note}\n");
        }
    }
    out
}

/// Writes `tidy.csv`, `summary.csv` and every paper table with at least one row into `out`
/// from the cells of `sweep` (`write_rows`).
pub(crate) fn write_all(sweep: &Path, out: &Path, drop_absent: bool) -> Result<Plotted> {
    write_rows(sweep, out, &rows(sweep)?, drop_absent)
}

/// Writes the tables of `read` (the rows of `sweep`'s cells) into `out`; returns the files
/// written and what could not be read. Refused, unless `drop_absent`, where cells that
/// `out`'s tables hold rows of have no folder in `sweep` (`absent_rows`).
pub(crate) fn write_rows(
    sweep: &Path,
    out: &Path,
    read: &SweepRows,
    drop_absent: bool,
) -> Result<Plotted> {
    atomic::ensure_writable_dir(out)?;
    let (rows, unread) = (&read.rows, read.unread.clone());
    if !rows.is_empty() && !drop_absent {
        absent_rows(sweep, out, rows)?;
    }
    let noted: Vec<(String, String)> = rows
        .iter()
        .filter(|r| !r.note.is_empty())
        .map(|r| (r.cell.clone(), r.note.join("; ")))
        .collect();
    let mut written = Vec::new();
    if rows.is_empty() {
        let from_tidy = sweep.join("tidy.csv").is_file();
        if from_tidy {
            // Intervals over the probes' prompts come from the cells' records: tables that
            // hold them are not replaced by ones without them unless asked.
            let kept = std::fs::read_to_string(out.join("replicates.csv")).unwrap_or_default();
            ensure!(
                drop_absent || !kept.contains(replicates::OVER_PROMPTS),
                "{}: no cell's folder is here, and its replicates.csv holds intervals over the \
                 probes' prompts, which tidy.csv cannot give again; nothing was written. Run the \
                 cells again (`attnsweep sweep --grid <its grid> --out <this folder>`), or pass \
                 --drop-absent to rebuild the replicate tables from tidy.csv without them",
                out.display()
            );
            written = replicates_from_tidy(sweep, out)?;
        }
        return Ok(Plotted {
            written,
            unread,
            noted,
            from_tidy,
            removed: vec![],
        });
    }
    let summary = summary_frame(rows)?;
    let mut tidy = tidy_frame(&summary)?;
    let mut marked = with_notes(summary.clone(), rows, &unread)?;
    for (df, name) in [(&mut marked, "summary.csv"), (&mut tidy, "tidy.csv")] {
        write_csv(df, &out.join(name))?;
        written.push(out.join(name));
    }
    written.extend(write_replicates(rows, &tidy, out)?);
    // The tables that set methods beside their baselines name each row so.
    let baselines: Vec<&str> = rows
        .iter()
        .map(|r| r.table_cell().baseline.unwrap_or_default())
        .collect();
    let mut with_baseline = summary.clone();
    with_baseline.with_column(Column::new("baseline".into(), baselines))?;
    for s in all_methods() {
        for report in s.reports {
            match report {
                Report::Table(t) => {
                    let holds = |r: &Row| (t.holds)(&r.table_cell());
                    // A table the sweep no longer fills must not linger from an earlier run.
                    let subject = rows
                        .iter()
                        .any(|r| holds(r) && (t.subject)(&r.table_cell()));
                    let df = match subject {
                        true => Some(
                            filtered(&with_baseline, rows, holds)?
                                .select(t.columns.iter().copied())?
                                .sort(t.sort.iter().copied(), SortMultipleOptions::default())?,
                        ),
                        false => None,
                    };
                    write_or_remove(&out.join(t.file), df, &mut written)?;
                }
                Report::HeadGaps { file } => {
                    let of: Vec<&Row> = rows
                        .iter()
                        .filter(|r| r.method == s.method && r.kind != StageKind::Prune)
                        .collect();
                    write_or_remove(&out.join(file), gap_table(&of)?, &mut written)?;
                }
                _ => {}
            }
        }
    }
    write_or_remove(&out.join("pareto.csv"), pareto::table(rows)?, &mut written)?;
    write_or_remove(
        &out.join("equal_work.csv"),
        equal_work::table(rows)?,
        &mut written,
    )?;
    write_or_remove(&out.join("budget.csv"), budget::table(rows)?, &mut written)?;
    write_or_remove(
        &out.join("budget_differences.csv"),
        budget::differences(rows)?,
        &mut written,
    )?;
    write_or_remove(&out.join("timing.csv"), timing_table(rows)?, &mut written)?;
    write_or_remove(
        &out.join("layer_usage.csv"),
        layer_table(rows)?,
        &mut written,
    )?;
    Ok(Plotted {
        written,
        unread,
        noted,
        from_tidy: false,
        removed: vec![],
    })
}

/// Refuses a plot that would drop rows: cells whose rows `out`'s `tidy.csv` holds (an earlier
/// plot read them) and whose folders are not in `sweep` now. A results folder's cells travel
/// without their weights, but a folder drawn before they did, or a clone that lacks some,
/// would otherwise lose those cells' results from every table in silence.
fn absent_rows(sweep: &Path, out: &Path, rows: &[Row]) -> Result<()> {
    let path = out.join("tidy.csv");
    if !path.is_file() {
        return Ok(());
    }
    let unreadable = || {
        format!(
            "{} cannot be read, so plot cannot tell which cells' rows it would drop; mend or \
             remove it, or plot with --drop-absent",
            path.display()
        )
    };
    let mut rdr = ::csv::Reader::from_path(&path).with_context(unreadable)?;
    let at = rdr
        .headers()
        .ok()
        .and_then(|h| h.iter().position(|c| c == "cell"))
        .with_context(unreadable)?;
    let mut held = std::collections::BTreeSet::new();
    for r in rdr.records() {
        held.extend(r.with_context(unreadable)?.get(at).map(String::from));
    }
    let gone: Vec<&String> = held
        .iter()
        .filter(|c| !rows.iter().any(|r| &&r.cell == c) && !sweep.join(c).exists())
        .collect();
    let Some(first) = gone.first() else {
        return Ok(());
    };
    let cells = read_cells(sweep)?;
    let indices: Vec<String> = gone
        .iter()
        .filter_map(|g| cells.iter().find(|c| &&c.id == g))
        .map(|c| c.index.to_string())
        .collect();
    let rerun = match indices.len() {
        0 => String::new(),
        _ => format!(
            ", or run them again (`attnsweep sweep --grid <the folder's grid> --out {} --cell \
             {}`)",
            sweep.display(),
            indices.join(",")
        ),
    };
    let outside = match gone.len() - indices.len() {
        0 => String::new(),
        n => format!(
            "; {n} of them are no longer in its cells.json (the grid changed since they ran)"
        ),
    };
    bail!(
        "{} holds rows of {} whose folders are not in {} ({}{}){outside}: drawing now would \
         drop them from every table. Bring their folders back{rerun}, or plot with \
         --drop-absent to draw without them",
        path.display(),
        match gone.len() {
            1 => "1 cell".to_string(),
            n => format!("{n} cells"),
        },
        sweep.display(),
        first,
        match gone.len() {
            1 => String::new(),
            n => format!(" and {} more", n - 1),
        },
    )
}

/// `replicates.csv`, `replicate_differences.csv` and `stage_differences.csv` from the tidy
/// table's values, each with its cell's setting (its label without the seed, from its row).
fn write_replicates(rows: &[Row], tidy: &DataFrame, out: &Path) -> Result<Vec<PathBuf>> {
    let text = |c: &str| -> Result<Vec<&str>> {
        Ok(tidy
            .column(c)?
            .str()?
            .into_iter()
            .map(|v| v.unwrap_or(""))
            .collect())
    };
    let settings: BTreeMap<&str, String> = rows
        .iter()
        .map(|r| (r.cell.as_str(), r.setting_text()))
        .collect();
    let by_cell: BTreeMap<&str, &Row> = rows.iter().map(|r| (r.cell.as_str(), r)).collect();
    let (cell, stage, kind, method, metric) = (
        text("cell")?,
        text("stage")?,
        text("kind")?,
        text("method")?,
        text("metric")?,
    );
    let value: Vec<f64> = tidy.column("value")?.f64()?.into_no_null_iter().collect();
    // A cell that several stages share is a replicate of each (`Row::also`).
    let also: BTreeMap<&str, Vec<(&str, String, &str)>> = rows
        .iter()
        .filter(|r| !r.also.is_empty())
        .map(|r| {
            let each = r.also.iter().map(|m| {
                let setting = setting_text_of(&m.varied);
                (m.stage.as_str(), setting, seed_of(&m.varied))
            });
            (r.cell.as_str(), each.collect())
        })
        .collect();
    let mut measured: Vec<replicates::Measured> = Vec::with_capacity(tidy.height());
    for i in 0..tidy.height() {
        let row = by_cell.get(cell[i]);
        let m = replicates::Measured {
            cell: cell[i],
            stage: stage[i],
            kind: kind[i],
            method: method[i],
            setting: settings.get(cell[i]).map_or("", String::as_str),
            seed: row.map_or("", |r| r.seed()),
            metric: metric[i],
            value: value[i],
            prompts: row
                .and_then(|r| r.prompt_scores.get(metric[i]))
                .map(Vec::as_slice),
        };
        for (stage, setting, seed) in also.get(cell[i]).into_iter().flatten() {
            measured.push(replicates::Measured {
                stage,
                setting,
                seed,
                ..m
            });
        }
        measured.push(m);
    }
    replicates::write(&measured, out)
}

/// The replicate tables of a sweep whose cells' folders are gone (a results folder keeps
/// its tables and `cells.json`, not its cells), rebuilt from its `tidy.csv`: each value with
/// its cell's setting and seed from `cells.json`. Probe scores have lost their prompts'
/// outcomes there, so their intervals are over the replicates alone.
fn replicates_from_tidy(sweep: &Path, out: &Path) -> Result<Vec<PathBuf>> {
    #[derive(serde::Deserialize)]
    struct Tidy {
        cell: String,
        kind: String,
        method: String,
        metric: String,
        value: f64,
    }
    let path = sweep.join("tidy.csv");
    let bad = || {
        format!(
            "{} is malformed (write it again with `plot` where the cells are)",
            path.display()
        )
    };
    let tidy: Vec<Tidy> = ::csv::Reader::from_path(&path)
        .with_context(bad)?
        .deserialize()
        .collect::<std::result::Result<_, _>>()
        .with_context(bad)?;
    // Each cell's varied settings in every stage that lists it: a cell several stages share
    // has its row under the first and is a replicate of each.
    let mut varied: BTreeMap<String, Vec<(String, Vec<(String, String)>)>> = BTreeMap::new();
    for c in read_cells(sweep)? {
        let memberships = varied.entry(c.id.clone()).or_default();
        // A cell listed twice in one stage (settings its method ignores) counts once there.
        if memberships.iter().all(|(stage, _)| *stage != c.stage) {
            memberships.push((c.stage.clone(), c.varied()));
        }
    }
    let mut settings = Vec::with_capacity(tidy.len());
    for (i, t) in tidy.iter().enumerate() {
        let Some(memberships) = varied.get(&t.cell) else {
            bail!(
                "{} row {}: cell {} is not in cells.json; give `plot` the sweep the table came from",
                path.display(),
                i + 2,
                t.cell
            );
        };
        ensure!(
            t.value.is_finite(),
            "{} row {}: {} of {} is {}; a table holds finite values only",
            path.display(),
            i + 2,
            t.metric,
            t.cell,
            t.value
        );
        // Its row's stage (the first that lists it) and every other that does.
        for (stage, v) in memberships {
            settings.push((t, stage, setting_text_of(v), seed_of(v)));
        }
    }
    let measured: Vec<replicates::Measured> = settings
        .iter()
        .map(|(t, stage, setting, seed)| replicates::Measured {
            cell: &t.cell,
            stage,
            kind: &t.kind,
            method: &t.method,
            setting,
            seed,
            metric: &t.metric,
            value: t.value,
            prompts: None,
        })
        .collect();
    replicates::write(&measured, out)
}

/// Writes `df` at `path`, or removes a `path` left by an earlier run when there is none.
fn write_or_remove(path: &Path, df: Option<DataFrame>, written: &mut Vec<PathBuf>) -> Result<()> {
    match df {
        Some(mut df) => {
            write_csv(&mut df, path)?;
            written.push(path.to_path_buf());
        }
        None if path.exists() => std::fs::remove_file(path)?,
        None => {}
    }
    Ok(())
}

/// The timed cells that ran alone on the GPU (`exclusive` stages), with their timings.
pub(crate) fn timed_alone(rows: &[Row]) -> Vec<(&Row, &Timing)> {
    rows.iter()
        .filter(|r| r.exclusive)
        .filter_map(|r| r.report.timing.as_ref().map(|t| (r, t)))
        .collect()
}

/// L2A Figs. 14-15: prefill time and decoding speed by length, one row per timed cell that
/// ran alone, with the method's settings that change what its time measures (PPA's power);
/// `prefill_speedup` is full attention's prefill time at the same length and batch over the
/// row's (none without a full-attention row there).
fn timing_table(rows: &[Row]) -> Result<Option<DataFrame>> {
    let timed = timed_alone(rows);
    if timed.is_empty() {
        return Ok(None);
    }
    let full_prefill = |t: &Timing| {
        timed
            .iter()
            .find(|(r, f)| r.is_reference() && f.seq_len == t.seq_len && f.batch == t.batch)
            .map(|(_, f)| f.prefill_ms)
    };
    let n = |f: fn(&Timing) -> f64| timed.iter().map(|(_, t)| f(t)).collect::<Vec<f64>>();
    let timed_rows: Vec<&Row> = timed.iter().map(|(r, _)| *r).collect();
    let settings: Vec<(&SettingColumn, Option<Method>)> = setting_columns(&timed_rows)
        .into_iter()
        .filter(|(c, _)| c.timed)
        .collect();
    let own: Vec<Column> = settings
        .iter()
        .map(|&(c, owner)| {
            let mine = SettingColumn {
                every_cell: false,
                ..*c
            };
            setting_column(&mine, owner, &timed_rows)
        })
        .collect();
    let mut df = df!(
        "stage" => timed.iter().map(|(r, _)| r.stage.clone()).collect::<Vec<_>>(),
        "method" => timed.iter().map(|(r, _)| name_of(r.method)).collect::<Vec<_>>(),
        "window" => timed.iter().map(|(r, _)| r.window).collect::<Vec<_>>(),
    )?
    .hstack(&own)?
    .hstack(
        df!(
            "mu_f" => timed.iter().map(|(r, _)| r.mu_f()).collect::<Vec<_>>(),
            "seq_len" => n(|t| t.seq_len as f64),
            "batch" => n(|t| t.batch as f64),
            "prefill_ms" => n(|t| t.prefill_ms),
            "prefill_ms_spread" => n(|t| t.prefill_ms_spread),
            "prefill_speedup" => timed.iter().map(|(_, t)| full_prefill(t).map(|f| f / t.prefill_ms)).collect::<Vec<_>>(),
            "forward_ms" => n(|t| t.forward_ms),
            "forward_ms_spread" => n(|t| t.forward_ms_spread),
            "attention_ms" => n(|t| t.attention_ms),
            "decode_tokens_per_s" => n(|t| t.decode_tokens_per_s),
            "decode_tokens_per_s_spread" => n(|t| t.decode_tokens_per_s_spread),
            "timing_runs" => n(|t| t.runs as f64),
            "decode_cache_mb" => n(|t| t.decode_cache_bytes / 1e6),
            "device" => timed.iter().map(|(_, t)| t.device.clone()).collect::<Vec<_>>(),
            "label" => timed.iter().map(|(r, _)| r.label.clone()).collect::<Vec<_>>(),
            "cell" => timed.iter().map(|(r, _)| r.cell.clone()).collect::<Vec<_>>(),
        )?
        .columns(),
    )?;
    let sort: Vec<&str> = ["stage", "window"]
        .into_iter()
        .chain(settings.iter().map(|(c, _)| c.name))
        .chain(["seq_len"])
        .collect();
    df = df.sort(sort, SortMultipleOptions::default())?;
    Ok(Some(df))
}

/// AHA Table 3: every head of the cells of a method that reports it, trained or re-evaluated
/// (an eval stage at a longer `eval.seq_len` is how gaps longer than the training context are
/// measured), with its usage and the distribution of its gaps between full-path calls
/// (`report::GapStats`), heads by usage within a cell. None when there is no such cell.
fn gap_table(rows: &[&Row]) -> Result<Option<DataFrame>> {
    let mut cols: BTreeMap<&str, Vec<Option<f64>>> = BTreeMap::new();
    let mut cells: Vec<String> = Vec::new();
    let names: Vec<&str> = ["window", "lambda", "eval_seq_len"]
        .into_iter()
        .chain(HEAD_USAGE_COLUMNS)
        .collect();
    for r in rows {
        let Some(g) = r.gates() else { continue };
        let mut heads: Vec<(f64, usize, usize)> = g
            .per_head
            .iter()
            .enumerate()
            .flat_map(|(l, row)| row.iter().enumerate().map(move |(h, &mu)| (mu, l, h)))
            .collect();
        heads.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        for (_, l, h) in heads {
            cells.push(r.cell.clone());
            let settings = [
                Some(r.window),
                Some(r.grid_attention.lambda),
                Some(r.report.seq_len as f64),
            ];
            let values = settings.into_iter().chain(g.head_row(l, h));
            for (n, v) in names.iter().zip(values) {
                cols.entry(n).or_default().push(v);
            }
        }
    }
    if cells.is_empty() {
        return Ok(None);
    }
    let mut columns = vec![Column::new("cell".into(), cells)];
    columns.extend(names.iter().map(|n| Column::new((*n).into(), &cols[n])));
    Ok(Some(DataFrame::new_infer_height(columns)?))
}

/// `layer_usage.csv` (L2A Fig. 3, SwiAttn Fig. 5): every gated train cell's usage per layer on
/// the validation text, layers counted from 1 as the papers count them, each row with its
/// setting and seed so replicates can be read together; None without such cells.
fn layer_table(rows: &[Row]) -> Result<Option<DataFrame>> {
    let (mut cell, mut stage, mut setting, mut seed) = (vec![], vec![], vec![], vec![]);
    let (mut layer, mut mu_f): (Vec<u32>, Vec<f64>) = (vec![], vec![]);
    for r in rows.iter().filter(|r| r.kind == StageKind::Train) {
        let Some(g) = r.gates() else { continue };
        for (l, m) in g.per_layer.iter().enumerate() {
            cell.push(r.cell.clone());
            stage.push(r.stage.clone());
            setting.push(r.setting_text());
            seed.push(r.seed().to_string());
            layer.push(l as u32 + 1);
            mu_f.push(*m);
        }
    }
    if cell.is_empty() {
        return Ok(None);
    }
    Ok(Some(DataFrame::new_infer_height(vec![
        Column::new("cell".into(), cell),
        Column::new("stage".into(), stage),
        Column::new("setting".into(), setting),
        Column::new("seed".into(), seed),
        Column::new("layer".into(), layer),
        Column::new("mu_f".into(), mu_f),
    ])?))
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::sweep::fixture::{csv, sweep_dir};

    /// Cells a plot cannot read are named and marked, never dropped in silence: a cut-short
    /// status.json, a deleted cell folder and a deleted eval/ each get a row holding their
    /// note; a cut-short train_log.csv keeps its row, its note saying what is missing. A
    /// sweep read whole keeps its summary without the column.
    #[test]
    fn cells_that_cannot_be_read_are_named_and_their_rows_marked() {
        let dir = sweep_dir("unread");
        write_all(&dir, &dir, false).unwrap();
        let whole = csv(&dir.join("summary.csv"));
        assert!(!whole[0].contains(&"note".to_string()));
        let status = std::fs::read_to_string(dir.join("aha-4/status.json")).unwrap();
        std::fs::write(dir.join("aha-4/status.json"), &status[..status.len() / 2]).unwrap();
        std::fs::remove_dir_all(dir.join("ppa-5")).unwrap();
        std::fs::remove_dir_all(dir.join("swa-0/eval")).unwrap();
        let log = std::fs::read_to_string(dir.join("aha-16/train_log.csv")).unwrap();
        std::fs::write(dir.join("aha-16/train_log.csv"), format!("{log}40,3,0.0")).unwrap();
        let plotted = write_all(&dir, &dir, true).unwrap();
        // Read as CSV proper: the notes hold commas and quotes.
        let mut rdr = ::csv::Reader::from_path(dir.join("summary.csv")).unwrap();
        let t: Vec<Vec<String>> = std::iter::once(rdr.headers().unwrap().clone())
            .chain(rdr.records().map(|r| r.unwrap()))
            .map(|r| r.iter().map(String::from).collect())
            .collect();
        let col = |n: &str| t[0].iter().position(|c| c == n).unwrap();
        let note = |cell: &str| {
            t.iter()
                .find(|r| r[col("cell")] == cell)
                .map(|r| r[col("note")].clone())
                .unwrap_or_else(|| panic!("{cell} has no row"))
        };
        assert!(
            note("aha-4").starts_with("no row: status.json is unreadable"),
            "{}",
            note("aha-4")
        );
        assert_eq!(note("ppa-5"), "no row: not run (no folder)");
        assert_eq!(
            note("swa-0"),
            "no row: finished but its eval/eval.json is missing"
        );
        assert!(note("aha-16").starts_with("train_log.csv is unreadable from its row 5 on"));
        assert_eq!(note("full-0"), "");
        // The marked row keeps what could be read: the median rate of its three whole rows.
        let rate =
            t.iter().find(|r| r[col("cell")] == "aha-16").unwrap()[col("tokens_per_s")].clone();
        assert_eq!(rate, "2000.0");
        assert_eq!(t.len(), whole.len());
        let said = unread_report(&plotted);
        for cell in ["aha-4", "ppa-5", "swa-0", "aha-16"] {
            assert!(said.contains(cell), "{said}");
        }
    }

    /// A plot that would drop the rows of cells whose folders are gone is refused, naming
    /// them and the cells to run, and leaves every table as it was; `--drop-absent` draws
    /// without them. A cell whose folder is here but unfinished is not refused.
    #[test]
    fn a_plot_that_would_drop_rows_of_absent_cells_is_refused() {
        let dir = sweep_dir("absent");
        write_all(&dir, &dir, false).unwrap();
        let before = std::fs::read(dir.join("tidy.csv")).unwrap();
        let index = read_cells(&dir)
            .unwrap()
            .into_iter()
            .find(|c| c.id == "ppa-5")
            .unwrap()
            .index;
        std::fs::remove_dir_all(dir.join("ppa-5")).unwrap();
        let e = format!("{:#}", write_all(&dir, &dir, false).err().expect("refused"));
        assert!(
            e.contains("rows of 1 cell whose") && e.contains("(ppa-5)"),
            "{e}"
        );
        assert!(
            e.contains(&format!("--cell {index}")) && e.contains("--drop-absent"),
            "{e}"
        );
        assert_eq!(std::fs::read(dir.join("tidy.csv")).unwrap(), before);
        // Unfinished, not absent: its folder says why it has no row.
        std::fs::remove_file(dir.join("aha-4/status.json")).unwrap();
        let e = format!("{:#}", write_all(&dir, &dir, false).err().expect("refused"));
        assert!(!e.contains("aha-4"), "{e}");
        // A cell the grid no longer lists (its id changed with its settings) is refused too.
        let path = dir.join("cells.json");
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::write(&path, text.replace("\"swa-0\"", "\"swa-9\"")).unwrap();
        std::fs::rename(dir.join("swa-0"), dir.join("swa-9")).unwrap();
        std::fs::remove_dir_all(dir.join("swa-9")).unwrap();
        let e = format!("{:#}", write_all(&dir, &dir, false).err().expect("refused"));
        assert!(
            e.contains("2 cells") && e.contains("1 of them are no longer"),
            "{e}"
        );
        write_all(&dir, &dir, true).unwrap();
        let tidy = std::fs::read_to_string(dir.join("tidy.csv")).unwrap();
        assert!(!tidy.contains("ppa-5") && !tidy.contains("aha-4,"));
        // The next plot holds only what the tables hold now.
        write_all(&dir, &dir, false).unwrap();
    }

    /// A folder without its cells' folders rebuilds its replicate tables from tidy.csv, but
    /// not over tables that hold intervals over the probes' prompts (which tidy.csv cannot
    /// give again) unless asked: refused, nothing written.
    #[test]
    fn a_plot_without_cells_keeps_intervals_over_prompts() {
        let dir = sweep_dir("tidy-prompts");
        write_all(&dir, &dir, false).unwrap();
        let kept = dir.join("kept");
        std::fs::create_dir_all(&kept).unwrap();
        for f in ["cells.json", "tidy.csv"] {
            std::fs::copy(dir.join(f), kept.join(f)).unwrap();
        }
        let table = kept.join("replicates.csv");
        let held = format!(
            "stage,metric,setting,method,n,mean,sd,ci95_low,ci95_high,interval\n\
             probes,niah.exact_match,,full,1,0.5,,0.4,0.6,{}\n",
            replicates::OVER_PROMPTS
        );
        std::fs::write(&table, &held).unwrap();
        let e = format!(
            "{:#}",
            write_all(&kept, &kept, false).err().expect("refused")
        );
        assert!(
            e.contains("intervals over the") && e.contains("--drop-absent"),
            "{e}"
        );
        assert_eq!(std::fs::read_to_string(&table).unwrap(), held);
        // Asked: rebuilt from tidy.csv (here without replicates, so no table is left).
        write_all(&kept, &kept, true).unwrap();
        assert_ne!(std::fs::read_to_string(&table).ok(), Some(held));
    }

    /// `layer_usage.csv` holds each gated train cell's usage per layer, layers from 1, and no
    /// row of a cell without gates.
    #[test]
    fn layer_usage_lists_each_gated_cells_layers_from_one() {
        let dir = sweep_dir("layer-usage");
        write_all(&dir, &dir, false).unwrap();
        let t = csv(&dir.join("layer_usage.csv"));
        assert_eq!(t[0], ["cell", "stage", "setting", "seed", "layer", "mu_f"]);
        let gated = rows(&dir)
            .unwrap()
            .rows
            .into_iter()
            .filter(|r| r.kind == StageKind::Train && r.gates().is_some())
            .collect::<Vec<_>>();
        assert!(!gated.is_empty());
        assert_eq!(t.len() - 1, 2 * gated.len());
        for r in &gated {
            let mine: Vec<&Vec<String>> = t.iter().filter(|row| row[0] == r.cell).collect();
            let mu = r.gates().unwrap().mu_f;
            assert_eq!(mine[0][4], "1");
            assert_eq!(mine[1][4], "2");
            assert_eq!(mine[0][5].parse::<f64>().unwrap(), mu);
            assert_eq!(mine[1][5].parse::<f64>().unwrap(), mu * 0.5);
        }
        assert!(!t.iter().any(|row| row[0] == "full-0"));
    }

    #[test]
    fn equal_work_reads_each_method_against_the_window_line() {
        // One window alone draws no line: no table.
        let dir = sweep_dir("equal-work-one");
        write_all(&dir, &dir, false).unwrap();
        assert!(!dir.join("equal_work.csv").exists());
        let dir = crate::sweep::fixture::sweep_dir_with_windows("equal-work");
        write_all(&dir, &dir, false).unwrap();
        let t = csv(&dir.join("equal_work.csv"));
        let col = |name: &str| t[0].iter().position(|c| c == name).unwrap();
        // StaticHybrid at 0.4 of the pairs lies ln 2 / ln 3 of the way in log pairs along
        // SWA's line from (0.2, 2.1) to (0.6, 1.9).
        let hyb = t
            .iter()
            .find(|r| r[col("name")].starts_with("StaticHybrid"))
            .unwrap();
        let num = |r: &Vec<String>, c: &str| r[col(c)].parse::<f64>().unwrap();
        let w = 2f64.ln() / 3f64.ln();
        let line = (1.0 - w) * 2.1 + w * 1.9;
        assert!(
            (num(hyb, "window_line_loss") - line).abs() < 1e-9,
            "{hyb:?}"
        );
        assert!(
            (num(hyb, "difference") - (1.9 - line)).abs() < 1e-9,
            "{hyb:?}"
        );
        assert_eq!(hyb[col("verdict")], "one replicate");
        // Nothing is extrapolated (full attention at 1.0, PPA at 0.15) and no window is
        // compared with its own line.
        assert!(t[1..].iter().all(|r| {
            let p = num(r, "pairs_vs_full");
            (0.2..=0.6).contains(&p) && !r[col("name")].starts_with("SWA")
        }));
        assert!(t[1..].iter().any(|r| r[col("name")].starts_with("AHA")));
    }

    #[test]
    fn pareto_table_compares_one_budget_on_every_cost() {
        let dir = sweep_dir("pareto");
        write_all(&dir, &dir, false).unwrap();
        let t = csv(&dir.join("pareto.csv"));
        let col = |name: &str| t[0].iter().position(|c| c == name).unwrap();
        let of = |cell: &str| t.iter().find(|r| r[col("cell")] == cell).unwrap();
        // One budget at one length: the base (shorter), SWA zero-shot (the base's), the longer
        // evaluation gaps-4 and the static heads (continued from AHA, longer) stay out, and
        // probe-16b, aha-16b measured again, is part of aha-16b's row.
        let mut cells: Vec<&str> = t[1..].iter().map(|r| r[col("cell")].as_str()).collect();
        cells.sort();
        assert_eq!(
            cells,
            [
                "aha-16", "aha-16b", "aha-4", "full-0", "hyb-0", "l2a-0", "ppa-0", "ppa-5",
                "prune-9", "swa-0", "swi-0", "swi-v1", "tau-3", "tau-7"
            ]
        );
        // The work front by hand over (pairs, loss): ties on both stay, anything beaten goes.
        let front: Vec<&str> = t[1..]
            .iter()
            .filter(|r| r[col("front_work")] == "true")
            .map(|r| r[col("cell")].as_str())
            .collect();
        assert_eq!(
            front,
            ["ppa-0", "tau-7", "ppa-5", "prune-9", "l2a-0", "aha-16", "tau-3", "full-0"]
        );
        // Rates measured while cells shared the device make no front.
        assert!(t[1..].iter().all(|r| r[col("front_time")] == "false"));
        // Every cell holds one cache size: full attention, the best loss, is the only point of
        // that front (and of the time front, once the rates are each cell's own: below).
        for c in ["front_memory"] {
            let on: Vec<&str> = t[1..]
                .iter()
                .filter(|r| r[col(c)] == "true")
                .map(|r| r[col("cell")].as_str())
                .collect();
            assert_eq!(on, ["full-0"], "{c}");
        }
        // Accuracy's fronts keep the highest (the fixture's probe score is its loss, highest
        // for swa-0) where every cell costs the same.
        let best: Vec<&str> = t[1..]
            .iter()
            .filter(|r| r[col("accuracy_front_memory")] == "true")
            .map(|r| r[col("cell")].as_str())
            .collect();
        assert_eq!(best, ["swa-0"]);
        // An evaluation or pruning of a trained cell took that cell's training.
        assert_eq!(of("tau-3")[col("train_tokens_per_s")], "2000.0");
        assert_eq!(of("prune-9")[col("name")], "L2A w64 τ 0.5 pruned at 0.9");
        assert_eq!(
            of("swi-v1")[col("name")],
            "SwiAttn w64 α 100 V1 (no adaptive weight)"
        );
        assert_eq!(of("full-0")[col("retain_pct")], "100.0");
        assert_eq!(of("l2a-0")[col("attention_ms")], "2.0");
        // No cell ran alone: no prefill front, every timing marked as shared.
        assert!(t[1..]
            .iter()
            .all(|r| r[col("front_prefill")] == "false" && r[col("timed_alone")] == "false"));
        // Timed alone, probe-16b's timing becomes aha-16b's, and the prefill front holds the
        // cells timed alone only: one, so it is on it.
        time_alone(&dir, &["probe-16b", "full-0"], ("probe-16b", 3.0));
        write_all(&dir, &dir, false).unwrap();
        let t = csv(&dir.join("pareto.csv"));
        let of = |cell: &str| t.iter().find(|r| r[col("cell")] == cell).unwrap();
        assert_eq!(of("aha-16b")[col("prefill_ms")], "3.0");
        assert_eq!(of("aha-16b")[col("timed_alone")], "true");
        assert_eq!(of("aha-16")[col("timed_alone")], "false");
        let on: Vec<&str> = t[1..]
            .iter()
            .filter(|r| r[col("front_prefill")] == "true")
            .map(|r| r[col("cell")].as_str())
            .collect();
        assert_eq!(on, ["aha-16b", "full-0"]);
        // Trained each alone on its device, every cell at one rate: full attention alone is on
        // the time front.
        crate::sweep::fixture::trained_alone(&dir);
        write_all(&dir, &dir, false).unwrap();
        let t = csv(&dir.join("pareto.csv"));
        let on: Vec<&str> = t[1..]
            .iter()
            .filter(|r| r[col("front_time")] == "true")
            .map(|r| r[col("cell")].as_str())
            .collect();
        assert_eq!(on, ["full-0"]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Marks `ids` of a fixture sweep as cells that ran in an `exclusive` stage (the
    /// `cell.json` their run writes into their folders) timing one sequence, and sets `id`'s
    /// measured prefill time.
    pub(crate) fn time_alone(dir: &Path, ids: &[&str], prefill: (&str, f64)) {
        let cells: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("cells.json")).unwrap())
                .unwrap();
        for c in cells.as_array().unwrap() {
            let id = c["id"].as_str().unwrap();
            if ids.contains(&id) {
                let mut ran = c.clone();
                ran["exclusive"] = true.into();
                std::fs::write(dir.join(id).join("cell.json"), ran.to_string()).unwrap();
                edit_timing(dir, id, "batch", 1.into());
            }
        }
        edit_timing(dir, prefill.0, "prefill_ms", prefill.1.into());
    }

    /// Sets one figure of a fixture cell's timing.
    fn edit_timing(dir: &Path, id: &str, key: &str, value: serde_json::Value) {
        let path = dir.join(id).join("eval/eval.json");
        let mut eval: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        eval["report"]["timing"][key] = value;
        std::fs::write(&path, eval.to_string()).unwrap();
    }

    /// `timing.csv` holds the cells that ran alone, with full attention's prefill time over
    /// theirs at the same length; a sweep with none has no such table.
    #[test]
    fn timing_lists_the_cells_timed_alone_against_full_attention() {
        let dir = sweep_dir("timing");
        write_all(&dir, &dir, false).unwrap();
        assert!(!dir.join("timing.csv").exists());
        time_alone(&dir, &["full-0", "zs-0", "ppa-5"], ("zs-0", 4.0));
        write_all(&dir, &dir, false).unwrap();
        let t = csv(&dir.join("timing.csv"));
        let at = |name: &str| t[0].iter().position(|c| c == name).unwrap();
        let row = |cell: &str| t.iter().find(|r| r[at("cell")] == cell).unwrap().clone();
        assert_eq!(t.len(), 4, "a header and the three cells: {t:?}");
        // The fixture times 8 ms for every cell but zs-0.
        assert_eq!(row("full-0")[at("prefill_speedup")], "1.0");
        assert_eq!(row("zs-0")[at("prefill_speedup")], "2.0");
        assert_eq!(row("zs-0")[at("prefill_ms")], "4.0");
        // PPA's rows carry their power; the others have none.
        assert_eq!(row("ppa-5")[at("ppa_power")], "0.5");
        assert_eq!(row("full-0")[at("ppa_power")], "");
        // A stage made exclusive after its cells ran: they ran beside others, and their
        // own cell.json, written when they ran, says so.
        let path = dir.join("cells.json");
        let mut cells: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        for c in cells.as_array_mut().unwrap() {
            c["exclusive"] = true.into();
        }
        std::fs::write(&path, cells.to_string()).unwrap();
        write_all(&dir, &dir, false).unwrap();
        assert_eq!(csv(&dir.join("timing.csv")).len(), 4);
    }

    /// Attention sinks, a method beyond the papers, reach the tables through their spec alone:
    /// their setting's column in the summary (only in a sweep that ran them), their rows
    /// beside SWA's in the baseline table (zero-shot and continued), their family in the
    /// Pareto table.
    #[test]
    fn sinks_join_the_summary_the_baselines_and_the_pareto_table() {
        let plain = sweep_dir("no-sinks");
        write_all(&plain, &plain, false).unwrap();
        assert!(!csv(&plain.join("summary.csv"))[0].contains(&"sink_tokens".to_string()));
        let dir = crate::sweep::fixture::sweep_dir_with_sinks("sinks");
        write_all(&dir, &dir, false).unwrap();
        let summary = csv(&dir.join("summary.csv"));
        let col = |t: &[Vec<String>], name: &str| t[0].iter().position(|c| c == name).unwrap();
        let row = |t: &[Vec<String>], cell: &str| {
            t.iter()
                .find(|r| r[col(t, "cell")] == cell)
                .unwrap()
                .clone()
        };
        let sinks = col(&summary, "sink_tokens");
        assert_eq!(row(&summary, "sinks-0")[sinks], "4.0");
        assert_eq!(row(&summary, "swa-0")[sinks], "");
        // The columns of the papers' methods stand where they stood, the new one after them.
        assert_eq!(sinks, col(&summary, "swiattn_disagreement") + 1);
        let b = csv(&dir.join("swiattn_baselines.csv"));
        let named = |cell: &str| row(&b, cell)[col(&b, "baseline")].clone();
        assert_eq!(
            [
                named("sinks-0"),
                named("sinkzs-0"),
                named("swa-0"),
                named("zs-0")
            ],
            ["Sinks-CPT", "Sinks-ZS", "SWA-CPT", "SWA-ZS"]
        );
        let p = csv(&dir.join("pareto.csv"));
        let sinks_row = row(&p, "sinks-0");
        assert_eq!(sinks_row[col(&p, "family")], "Sinks");
        assert_eq!(sinks_row[col(&p, "name")], "Sinks w64 sinks 4");
        let _ = std::fs::remove_dir_all(&plain);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn every_paper_table_from_a_fixture_sweep() {
        let dir = sweep_dir("tables");
        let written = write_all(&dir, &dir, false).unwrap().written;
        let names: Vec<String> = written
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        for f in [
            "summary.csv",
            "tidy.csv",
            "aha_windows.csv",
            "aha_lambda.csv",
            "aha_static_heads.csv",
            "l2a_threshold.csv",
            "l2a_pruning.csv",
            "swiattn_baselines.csv",
            "swiattn_ablations.csv",
            "ppa.csv",
        ] {
            assert!(names.contains(&f.to_string()), "{f} not written: {names:?}");
        }
        // Throughput: the median of a train cell's logged rates; none for an eval cell.
        let summary = csv(&dir.join("summary.csv"));
        let rate = summary[0].iter().position(|c| c == "tokens_per_s").unwrap();
        let of = |id: &str| summary.iter().find(|r| r[0] == id).unwrap()[rate].clone();
        assert_eq!((of("base-0").as_str(), of("zs-0").as_str()), ("2000.0", ""));
        let t = csv(&dir.join("aha_windows.csv"));
        assert_eq!(
            t[0][..5],
            ["window", "lambda", "loss", "perplexity", "retain_pct"]
        );
        assert_eq!(t.len(), 4);
        // Retain % against the equal-budget full model (full-0, continued from the same base).
        let retain: f64 = t[1][4].parse().unwrap();
        assert!(
            (retain - 100.0 * (1.8f64).exp() / (1.85f64).exp()).abs() < 1e-9,
            "{retain}"
        );
        let b = csv(&dir.join("swiattn_baselines.csv"));
        let baselines: Vec<&str> = b[1..].iter().map(|r| r[0].as_str()).collect();
        assert_eq!(
            baselines,
            [
                "FullAttn",
                "FullAttn",
                "SWA-CPT",
                "SWA-ZS",
                "StaticHybrid",
                "SwiAttn",
                "SwiAttn"
            ]
        );
        // Far dependencies: the buckets at least the window (64) back, pooled by tokens.
        let p = csv(&dir.join("ppa.csv"));
        let at = |name: &str| p[0].iter().position(|c| c == name).unwrap();
        let (n64, n128) = (164.0, 228.0);
        let want = (n64 / 65.0 + n128 / 129.0) / (n64 + n128);
        let got: f64 = p[1][at("far_accuracy")].parse().unwrap();
        assert!((got - want).abs() < 1e-12, "{got} {want}");
        let loss: f64 = p[1][at("loss")].parse().unwrap();
        let far: f64 = p[1][at("far_loss")].parse().unwrap();
        let want = loss + (n64 * 6.4 + n128 * 12.8) / (n64 + n128);
        assert!((far - want).abs() < 1e-9, "{far} {want}");
        let a = csv(&dir.join("swiattn_ablations.csv"));
        assert_eq!(
            a[1..].iter().map(|r| r[0].as_str()).collect::<Vec<_>>(),
            ["SwiAttn", "V1 (no adaptive weight)"]
        );
        let tau = csv(&dir.join("l2a_threshold.csv"));
        assert_eq!(
            tau[1..].iter().map(|r| r[0].as_str()).collect::<Vec<_>>(),
            ["0.3", "0.5", "0.7"]
        );
        let p = csv(&dir.join("l2a_pruning.csv"));
        assert_eq!(p[1][..3], ["0.9", "1.0", "2000.0"]);
        assert_eq!(csv(&dir.join("ppa.csv")).len(), 3);
        let heads = csv(&dir.join("aha_static_heads.csv"));
        assert_eq!(heads.len(), 8);
        // Retain % needs a full-attention model of the same budget: the static heads
        // continued from an AHA cell have trained longer than any, so they get none.
        let col = |t: &[Vec<String>], name: &str| t[0].iter().position(|c| c == name).unwrap();
        let (setting, retain, reference) = (
            col(&heads, "setting"),
            col(&heads, "retain_pct"),
            col(&heads, "retain_ref"),
        );
        let static_row = heads.iter().find(|r| r[setting] == "top-2").unwrap();
        // (CSV writes an empty string as "".)
        let empty = |v: &str| v.trim_matches('"').is_empty();
        assert!(
            empty(&static_row[retain]) && empty(&static_row[reference]),
            "{static_row:?}"
        );
        // Top-k at AHA's budget names the heads it resolved to (half of 16); SWA trained as
        // long is the all-window row.
        for row in ["all heads full", "top-8 (AHA's budget)", "all heads window"] {
            assert!(heads.iter().any(|r| r[setting] == row), "{row}: {heads:?}");
        }
        let aha_row = heads.iter().find(|r| r[setting] == "AHA").unwrap();
        assert_eq!(aha_row[reference], "full-0");
        let summary = csv(&dir.join("summary.csv"));
        let (cell, reference) = (col(&summary, "cell"), col(&summary, "retain_ref"));
        for (c, want) in [
            ("base-0", "base-0"),
            ("zs-0", "base-0"),
            ("aha-4", "full-0"),
        ] {
            let row = summary.iter().find(|r| r[cell] == c).unwrap();
            assert_eq!(row[reference], want, "{c}");
        }
        // AHA Table 3: every head of every AHA cell, trained or evaluated at a longer context,
        // with its gap distribution; the long evaluation stays out of the quality tables.
        let gaps = csv(&dir.join("aha_gaps.csv"));
        assert_eq!(gaps.len(), 1 + 5 * 4);
        let long = gaps.iter().filter(|r| r[0] == "gaps-4").collect::<Vec<_>>();
        assert_eq!(long.len(), 4);
        let seq = col(&gaps, "eval_seq_len");
        assert!(long
            .iter()
            .all(|r| r[seq] != gaps[1..].iter().find(|r| r[0] == "aha-4").unwrap()[seq]));
        let (median, share) = (col(&gaps, "gap_median"), col(&gaps, "censored_share"));
        assert!(gaps[1..]
            .iter()
            .any(|r| r[median].is_empty() && r[share] == "1.0"));
        let swi = csv(&dir.join("swiattn_ablations.csv"));
        assert_eq!(
            swi[1][col(&swi, "swiattn_disagreement")],
            "mean",
            "the reduction stands beside alpha"
        );
        let tidy = csv(&dir.join("tidy.csv"));
        assert_eq!(
            tidy[0],
            ["cell", "stage", "kind", "method", "label", "metric", "value"]
        );
        assert!(tidy
            .iter()
            .any(|r| r[0] == "aha-4" && r[5] == "mu_f" && r[6] == "0.9"));
        assert!(!tidy.iter().any(|r| r[0] == "broken"));
        // The evaluation suite's task metrics join the tidy table; standard errors do not.
        assert!(tidy
            .iter()
            .any(|r| r[0] == "aha-4" && r[5] == "niah_single.exact_match"));
        assert!(!tidy.iter().any(|r| r[5].contains("stderr")));
    }
}
