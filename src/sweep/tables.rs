//! Tables of a sweep directory: one tidy long table of every cell and metric, a wide summary
//! with one row per cell, and each paper table the sweep's cells can fill, all as CSV.
//!
//! | file | paper item | cells it reads |
//! |---|---|---|
//! | `tidy.csv` | - | every finished cell, one row per (cell, metric) |
//! | `summary.csv` | - | every finished cell, one row each |
//! | `aha_windows.csv` | AHA Tables 1/2 | AHA train cells: quality, retain %, mu_f by window |
//! | `aha_lambda.csv` | AHA Table 4 | AHA train cells, by lambda |
//! | `aha_static_heads.csv` | AHA Table 5 | static top-k heads beside AHA at its budget |
//! | `l2a_threshold.csv` | L2A Fig. 13 | L2A cells evaluated at other thresholds |
//! | `l2a_pruning.csv` | L2A Fig. 9 | prune cells |
//! | `swiattn_baselines.csv` | SwiAttn Tables 1-3 | Full, SWA-ZS, SWA-CPT, StaticHybrid, SwiAttn |
//! | `swiattn_ablations.csv` | SwiAttn Table 4 | SwiAttn cells by regulariser variant |
//! | `ppa.csv` | PPA Table 1 | PPA cells by p |
//! | `pareto.csv` | - | every method of one budget on every cost, with the fronts (`pareto`) |
//!
//! Quality is validation loss and perplexity; retain % is the full-attention model's
//! perplexity over the method's, times 100 (AHA's "method score / full score" for a metric
//! where lower is better).

use crate::config::{Method, Reduction, Router};
use crate::model::attention::{spec, top_k_name};
use crate::run::eval::{EvalReport, GateReport};
use crate::run::prune::PruneReport;
use crate::sweep::{read_status, Cell, StageKind, State};
use anyhow::{Context, Result};
use polars::prelude::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// What the tables know of one finished cell.
#[derive(Debug, Clone)]
pub struct Row {
    pub cell: String,
    pub stage: String,
    pub kind: StageKind,
    pub label: String,
    pub method: Method,
    /// The cell this one continued from or evaluates ("" when none), and its method.
    pub source: String,
    pub source_method: Option<Method>,
    pub window: f64,
    pub lambda: f64,
    pub tau: f64,
    pub ppa_power: f64,
    pub top_k: f64,
    pub router: Router,
    pub bernoulli_p: f64,
    pub variant: String,
    /// AHA Table 5's row name: "AHA", "top-k" static heads (at AHA's budget when top_k is 0),
    /// "all heads full", or "all heads window" (SWA trained as long).
    pub setting: String,
    /// The model's (layer, head) pairs.
    pub heads: usize,
    /// SwiAttn's disagreement weight and how the disagreement is reduced (the paper's MSE, or
    /// the squared norm, which alpha weighs hidden_size times more).
    pub swiattn_alpha: Option<f64>,
    pub swiattn_disagreement: Option<Reduction>,
    /// Training tokens behind the model (its own steps and those of every cell it continued
    /// from), and what identifies its model and data: the basis of retain %'s reference.
    pub budget_tokens: f64,
    /// Tokens behind the model before the cell's own training began, and per step of it.
    pub start_tokens: f64,
    pub tokens_per_step: f64,
    pub model_key: String,
    /// The cell's evaluation (`eval.json`), and its pruning (`prune.json`) for prune cells.
    pub report: EvalReport,
    pub prune: Option<PruneReport>,
    /// `<task>.<metric>` from the evaluation suite's results.json (probes, multiple choice).
    pub tasks: BTreeMap<String, f64>,
    /// Training throughput of a train cell: the median of its `train_log.csv` rates.
    pub tokens_per_s: Option<f64>,
    /// The throughput of the training that made the evaluated model: the cell's own, or for
    /// an eval or prune cell that of the train cell it derives from.
    pub train_tokens_per_s: Option<f64>,
    /// The attention the cell was evaluated with.
    pub attention: crate::config::AttentionConfig,
}

impl Row {
    pub fn loss(&self) -> f64 {
        self.report.loss
    }

    pub fn pairs_vs_full(&self) -> f64 {
        self.report.attention.pairs_vs_full
    }

    /// Full-attention usage of a routed model (pruned L2A layers counted as window).
    pub fn mu_f(&self) -> Option<f64> {
        self.report.gates.as_ref().map(|g| g.mu_f)
    }

    pub fn gates(&self) -> Option<&GateReport> {
        self.report.gates.as_ref()
    }

    /// Loss and exact-match accuracy of the predictions whose dependency lies at least the
    /// cell's window back (full attention's window setting, 64 by default, where it has
    /// none), pooled over those distance buckets: the long-range task of the synthetic
    /// corpus. None without buckets, or with none that far.
    pub fn far(&self) -> Option<(f64, Option<f64>)> {
        self.beyond(self.window)
    }

    /// `far` for the predictions whose dependency lies at least `distance` back (a bucket
    /// counts when its shortest distance does).
    pub fn beyond(&self, distance: f64) -> Option<(f64, Option<f64>)> {
        let far: Vec<&crate::run::eval::Bucket> = self
            .report
            .buckets
            .iter()
            .filter(|b| b.min_distance as f64 >= distance && b.min_distance < u32::MAX)
            .collect();
        let n: u64 = far.iter().map(|b| b.tokens).sum();
        (n > 0).then(|| {
            let mean = |f: &dyn Fn(&crate::run::eval::Bucket) -> f64| {
                far.iter().map(|b| f(b) * b.tokens as f64).sum::<f64>() / n as f64
            };
            let acc = far
                .iter()
                .all(|b| b.accuracy.is_some())
                .then(|| mean(&|b| b.accuracy.unwrap_or(0.0)));
            (mean(&|b| b.loss), acc)
        })
    }
}

/// A name as the config writes it (`"aha"`, `"train"`, `"mean"`).
pub fn name_of<T: serde::Serialize>(v: T) -> String {
    toml::Value::try_from(v)
        .ok()
        .and_then(|v| v.as_str().map(String::from))
        .unwrap_or_default()
}

/// Tokens of one training step of a train cell (0 for the other kinds).
fn tokens_per_step(c: &Cell) -> f64 {
    let t = &c.config.train;
    match c.kind {
        StageKind::Train => (t.batch_size * t.grad_accum * c.config.data.seq_len) as f64,
        _ => 0.0,
    }
}

/// Training tokens behind each cell's model: its own (train cells) plus those of the cells
/// it continued from, evaluated or pruned.
fn budgets(cells: &[Cell]) -> BTreeMap<String, f64> {
    let mut out: BTreeMap<String, f64> = BTreeMap::new();
    // Cells come in stage order, so a dependency's budget is known before its dependents'.
    for c in cells {
        let own = c.config.train.steps as f64 * tokens_per_step(c);
        let before = c
            .depends_on
            .as_ref()
            .and_then(|d| out.get(d))
            .copied()
            .unwrap_or(0.0);
        out.entry(c.id.clone()).or_insert(own + before);
    }
    out
}

/// The finished cells of a sweep directory, each once (cells that several stages share
/// appear under the first).
pub fn rows(sweep: &Path) -> Result<Vec<Row>> {
    let cells_path = sweep.join("cells.json");
    let text = std::fs::read_to_string(&cells_path).with_context(|| {
        format!(
            "{} is not a sweep directory (no cells.json)",
            sweep.display()
        )
    })?;
    let cells: Vec<Cell> = serde_json::from_str(&text)
        .with_context(|| format!("{} is malformed", cells_path.display()))?;
    let budget = budgets(&cells);
    let mut out: Vec<Row> = Vec::new();
    for c in &cells {
        if out.iter().any(|r| r.cell == c.id) {
            continue;
        }
        let dir = sweep.join(&c.id);
        if read_status(&dir).is_none_or(|s| s.state != State::Done) {
            continue;
        }
        let Some(ev) = crate::run::eval::read_report(&dir.join("eval"))? else {
            continue;
        };
        let a = &c.config.attention;
        let heads = c.config.model.num_hidden_layers * c.config.model.num_attention_heads;
        let source = c
            .depends_on
            .as_ref()
            .and_then(|d| cells.iter().find(|x| &x.id == d));
        let prune_path = dir.join("prune.json");
        let prune = match prune_path.is_file() {
            true => Some(
                serde_json::from_str::<PruneReport>(&std::fs::read_to_string(&prune_path)?)
                    .with_context(|| format!("{} is malformed", prune_path.display()))?,
            ),
            false => None,
        };
        out.push(Row {
            cell: c.id.clone(),
            stage: c.stage.clone(),
            kind: c.kind,
            label: c.label.clone(),
            method: a.method,
            source: source.map(|s| s.id.clone()).unwrap_or_default(),
            source_method: source.map(|s| s.config.attention.method),
            window: a.window as f64,
            lambda: a.lambda,
            tau: a.tau,
            ppa_power: a.ppa_power,
            top_k: a.top_k as f64,
            router: a.router,
            // As trained: a grid may set it from another cell's usage (`match_usage`).
            bernoulli_p: ev.config.attention.bernoulli_p,
            variant: (spec(a.method).variant)(a),
            setting: match a.method {
                Method::Aha => "AHA".into(),
                Method::StaticHeads => top_k_name(a, heads, ev.report.gates.as_ref().map(|g| g.mu_f)),
                Method::Swa if c.kind == StageKind::Train => "all heads window".into(),
                _ => String::new(),
            },
            heads,
            swiattn_alpha: (a.method == Method::Swiattn).then_some(a.swiattn_alpha),
            swiattn_disagreement: (a.method == Method::Swiattn).then_some(a.swiattn_disagreement),
            budget_tokens: budget.get(&c.id).copied().unwrap_or(f64::NAN),
            start_tokens: budget.get(&c.id).copied().unwrap_or(f64::NAN)
                - c.config.train.steps as f64 * tokens_per_step(c),
            tokens_per_step: tokens_per_step(c),
            model_key: format!(
                "{}\n{}",
                toml::to_string(&c.config.model).unwrap_or_default(),
                c.config.data.dir.display()
            ),
            report: ev.report,
            prune,
            tasks: task_metrics(&dir.join("eval/results.json")),
            tokens_per_s: median_rate(&dir.join("train_log.csv")),
            train_tokens_per_s: None,
            attention: ev.config.attention.clone(),
        });
    }
    // Rows come in stage order, so the cell an eval or prune cell derives from is resolved
    // before it.
    for i in 0..out.len() {
        out[i].train_tokens_per_s = match out[i].kind {
            StageKind::Train => out[i].tokens_per_s,
            _ => {
                let source = &out[i].source;
                out[..i]
                    .iter()
                    .find(|r| &r.cell == source)
                    .and_then(|r| r.train_tokens_per_s)
            }
        };
    }
    Ok(out)
}

/// The median of a training log's `tokens_per_s` column (robust to the first steps, which
/// include compilation and warm-up), None without a log.
fn median_rate(log: &Path) -> Option<f64> {
    let rates: Vec<f64> = log_columns(log, &["tokens_per_s"])?
        .into_iter()
        .map(|r| r[0])
        .collect();
    (!rates.is_empty()).then(|| crate::run::eval::median(rates))
}

/// The named columns of a training log (`train_log.csv`, `val_log.csv`), a row per logged
/// step, keeping the rows where each of them is a finite number; None when the file or a
/// column is missing.
pub fn log_columns(log: &Path, names: &[&str]) -> Option<Vec<Vec<f64>>> {
    let mut rdr = csv::Reader::from_path(log).ok()?;
    let header = rdr.headers().ok()?.clone();
    let cols: Vec<usize> = names
        .iter()
        .map(|n| header.iter().position(|h| h == *n))
        .collect::<Option<_>>()?;
    Some(
        rdr.records()
            .filter_map(|r| r.ok())
            .filter_map(|r| {
                cols.iter()
                    .map(|&i| r.get(i)?.parse::<f64>().ok().filter(|v| v.is_finite()))
                    .collect()
            })
            .collect(),
    )
}

fn read_json(p: &Path) -> Option<serde_json::Value> {
    serde_json::from_str(&std::fs::read_to_string(p).ok()?).ok()
}

/// `<task>.<metric>` of a harness-shaped results file (standard errors left out).
fn task_metrics(path: &Path) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    let Some(j) = read_json(path) else { return out };
    for (task, metrics) in j["results"].as_object().into_iter().flatten() {
        for (k, v) in metrics.as_object().into_iter().flatten() {
            let metric = k.split(',').next().unwrap_or(k);
            if let (Some(v), false) = (v.as_f64(), metric.ends_with("_stderr")) {
                out.insert(format!("{task}.{metric}"), v);
            }
        }
    }
    out
}

fn summary_frame(rows: &[Row]) -> Result<DataFrame> {
    let s = |f: fn(&Row) -> String| rows.iter().map(f).collect::<Vec<String>>();
    let n = |f: fn(&Row) -> f64| rows.iter().map(f).collect::<Vec<f64>>();
    let o = |f: fn(&Row) -> Option<f64>| rows.iter().map(f).collect::<Vec<Option<f64>>>();
    // Retain % against full attention at the same total training budget: a full-attention
    // train cell of the same model and data whose tokens equal the row's (the one continued
    // from the same cell when there are several); none when the sweep has no such cell, rather
    // than a reference trained for longer or shorter.
    let reference: Vec<Option<&Row>> = rows
        .iter()
        .map(|r| {
            let same = |x: &&Row| {
                x.method == Method::Full
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
        .collect();
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
        "setting" => s(|r| r.setting.clone()),
        "window" => n(|r| r.window),
        "lambda" => n(|r| r.lambda),
        "tau" => n(|r| r.tau),
        "ppa_power" => n(|r| r.ppa_power),
        "top_k" => n(|r| r.top_k),
        "swiattn_alpha" => o(|r| r.swiattn_alpha),
        "swiattn_disagreement" => s(|r| r.swiattn_disagreement.map(name_of).unwrap_or_default()),
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
        "far_loss" => o(|r| r.far().map(|f| f.0)),
        "far_accuracy" => o(|r| r.far().and_then(|f| f.1)),
        "threshold" => prune(|p| p.threshold),
        "pruned_layers" => prune(|p| p.pruned_layers.len() as f64),
        "kv_cache_bytes_before" => prune(|p| p.kv_cache_bytes_before),
        "loss_before" => prune(|p| p.loss_before),
    )?
    .hstack(&task_columns(rows))?)
}

/// One column per task metric any row has.
fn task_columns(rows: &[Row]) -> Vec<Column> {
    let names: std::collections::BTreeSet<&String> =
        rows.iter().flat_map(|r| r.tasks.keys()).collect();
    names
        .into_iter()
        .map(|n| {
            let v: Vec<Option<f64>> = rows.iter().map(|r| r.tasks.get(n).copied()).collect();
            Column::new(n.as_str().into(), v)
        })
        .collect()
}

/// Every numeric metric of every cell as (cell, stage, method, label, metric, value).
fn tidy_frame(summary: &DataFrame) -> Result<DataFrame> {
    let ids = ["cell", "stage", "kind", "method", "label"];
    let metrics: Vec<String> = summary
        .columns()
        .iter()
        .filter(|c| {
            c.dtype() == &DataType::Float64
                && ![
                    "window",
                    "lambda",
                    "tau",
                    "ppa_power",
                    "top_k",
                    "swiattn_alpha",
                    "budget_tokens",
                    "eval_seq_len",
                ]
                .contains(&c.name().as_str())
        })
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
    crate::util::atomic::write_with(path, |tmp| {
        let mut f = std::fs::File::create(tmp)?;
        CsvWriter::new(&mut f).finish(df)?;
        Ok(())
    })
}

/// One paper table: the summary's rows that `filter` keeps, the `columns` named, sorted.
struct TableSpec {
    file: &'static str,
    filter: Expr,
    /// Written only when some kept row also matches this (the table's subject is present).
    require: Expr,
    columns: &'static [&'static str],
    sort: &'static [&'static str],
}

/// The summary's rows of method `m`.
fn method_is(m: Method) -> Expr {
    col("method").eq(lit(name_of(m)))
}

/// The summary's rows of cells of kind `k`.
fn kind_is(k: StageKind) -> Expr {
    col("kind").eq(lit(name_of(k)))
}

fn paper_tables() -> Vec<TableSpec> {
    let learned = col("router").eq(lit(name_of(Router::Learned)));
    let train = kind_is(StageKind::Train);
    vec![
        TableSpec {
            file: "aha_windows.csv",
            require: method_is(Method::Aha),
            filter: method_is(Method::Aha)
                .and(train.clone())
                .and(learned.clone()),
            columns: &[
                "window",
                "lambda",
                "loss",
                "perplexity",
                "retain_pct",
                "retain_ref",
                "mu_f",
                "pairs_vs_full",
                "gate_precision",
                "gate_recall",
                "cell",
            ],
            sort: &["lambda", "window"],
        },
        TableSpec {
            file: "aha_lambda.csv",
            require: method_is(Method::Aha),
            filter: method_is(Method::Aha)
                .and(train.clone())
                .and(learned.clone()),
            columns: &[
                "lambda",
                "window",
                "loss",
                "perplexity",
                "retain_pct",
                "retain_ref",
                "mu_f",
                "cell",
            ],
            sort: &["window", "lambda"],
        },
        TableSpec {
            file: "aha_static_heads.csv",
            require: method_is(Method::StaticHeads),
            filter: method_is(Method::StaticHeads)
                .or(method_is(Method::Aha))
                .or(method_is(Method::Swa))
                .and(train.clone()),
            columns: &[
                "setting",
                "method",
                "top_k",
                "window",
                "mu_f",
                "loss",
                "perplexity",
                "retain_pct",
                "retain_ref",
                "cell",
            ],
            sort: &["method", "mu_f"],
        },
        TableSpec {
            file: "l2a_threshold.csv",
            require: kind_is(StageKind::Eval),
            filter: method_is(Method::L2a).and(kind_is(StageKind::Prune).not()),
            columns: &[
                "tau",
                "window",
                "kind",
                "loss",
                "perplexity",
                "mu_f",
                "pairs_vs_full",
                "attention_flops",
                "cell",
            ],
            sort: &["window", "tau"],
        },
        TableSpec {
            file: "l2a_pruning.csv",
            require: kind_is(StageKind::Prune),
            filter: kind_is(StageKind::Prune),
            columns: &[
                "threshold",
                "pruned_layers",
                "kv_cache_bytes_before",
                "kv_cache_bytes",
                "loss_before",
                "loss",
                "label",
                "cell",
            ],
            sort: &["label", "threshold"],
        },
        TableSpec {
            file: "swiattn_baselines.csv",
            require: method_is(Method::Full).not(),
            filter: [Method::Swa, Method::StaticHybrid, Method::Swiattn]
                .into_iter()
                .fold(method_is(Method::Full), |e, m| e.or(method_is(m))),
            columns: &[
                "baseline",
                "method",
                "source_method",
                "window",
                "swiattn_alpha",
                "swiattn_disagreement",
                "loss",
                "perplexity",
                "pairs_vs_full",
                "mu_f",
                "cell",
            ],
            sort: &["baseline"],
        },
        TableSpec {
            file: "swiattn_ablations.csv",
            require: method_is(Method::Swiattn),
            filter: method_is(Method::Swiattn).and(train.clone()),
            columns: &[
                "variant",
                "swiattn_alpha",
                "swiattn_disagreement",
                "window",
                "loss",
                "perplexity",
                "mu_f",
                "pairs_vs_full",
                "cell",
            ],
            sort: &["variant"],
        },
        TableSpec {
            file: "ppa.csv",
            require: method_is(Method::Ppa),
            filter: method_is(Method::Ppa),
            columns: &[
                "ppa_power",
                "window",
                "loss",
                "perplexity",
                "far_loss",
                "far_accuracy",
                "pairs_vs_full",
                "tokens_per_s",
                "cell",
            ],
            sort: &["window", "ppa_power"],
        },
    ]
}

/// SwiAttn's baseline names: SWA-ZS is a full model evaluated with a window, SWA-CPT a
/// window model continued from a full one.
fn baseline_expr() -> Expr {
    when(
        method_is(Method::Swa)
            .and(kind_is(StageKind::Eval))
            .and(col("source_method").eq(lit(name_of(Method::Full)))),
    )
    .then(lit("SWA-ZS"))
    .when(method_is(Method::Swa).and(col("source_method").eq(lit(name_of(Method::Full)))))
    .then(lit("SWA-CPT"))
    .when(method_is(Method::Swa))
    .then(lit("SWA"))
    .when(method_is(Method::StaticHybrid))
    .then(lit("StaticHybrid"))
    .when(method_is(Method::Full))
    .then(lit("FullAttn"))
    .otherwise(lit("SwiAttn"))
    .alias("baseline")
}

/// Writes `tidy.csv`, `summary.csv` and every paper table with at least one row into `out`;
/// returns the files written.
pub fn write_all(sweep: &Path, out: &Path) -> Result<Vec<PathBuf>> {
    crate::util::atomic::ensure_writable_dir(out)?;
    let rows = rows(sweep)?;
    let mut written = Vec::new();
    if rows.is_empty() {
        return Ok(written);
    }
    let mut summary = summary_frame(&rows)?;
    let mut tidy = tidy_frame(&summary)?;
    for (df, name) in [(&mut summary, "summary.csv"), (&mut tidy, "tidy.csv")] {
        write_csv(df, &out.join(name))?;
        written.push(out.join(name));
    }
    let with_baseline = summary.clone().lazy().with_column(baseline_expr());
    for t in paper_tables() {
        let cols: Vec<Expr> = t.columns.iter().map(|c| col(*c)).collect();
        let kept = with_baseline.clone().filter(t.filter);
        // A table the sweep no longer fills must not linger from an earlier run.
        let stale = out.join(t.file);
        if kept.clone().filter(t.require).collect()?.height() == 0 {
            if stale.exists() {
                std::fs::remove_file(&stale)?;
            }
            continue;
        }
        let mut df = kept
            .select(cols)
            .sort(
                t.sort.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
                SortMultipleOptions::default(),
            )
            .collect()?;
        write_csv(&mut df, &out.join(t.file))?;
        written.push(out.join(t.file));
    }
    let pareto = out.join("pareto.csv");
    match crate::sweep::pareto::table(&rows)? {
        Some(mut df) => {
            write_csv(&mut df, &pareto)?;
            written.push(pareto);
        }
        None if pareto.exists() => std::fs::remove_file(&pareto)?,
        None => {}
    }
    let gaps = out.join("aha_gaps.csv");
    match gap_table(&rows)? {
        Some(mut df) => {
            write_csv(&mut df, &gaps)?;
            written.push(gaps);
        }
        None if gaps.exists() => std::fs::remove_file(&gaps)?,
        None => {}
    }
    Ok(written)
}

/// AHA Table 3: every head of every AHA cell, trained or re-evaluated (an eval stage at a
/// longer `eval.seq_len` is how gaps longer than the training context are measured), with its
/// usage and the distribution of its gaps between full-path calls (`eval::GapStats`), heads by
/// usage within a cell. None when the sweep has no AHA cell.
fn gap_table(rows: &[Row]) -> Result<Option<DataFrame>> {
    let mut cols: BTreeMap<&str, Vec<Option<f64>>> = BTreeMap::new();
    let mut cells: Vec<String> = Vec::new();
    let names = [
        "window",
        "lambda",
        "eval_seq_len",
        "layer",
        "head",
        "mu_f",
        "gaps",
        "mean_gap",
        "gap_median",
        "gap_p90",
        "gap_max",
        "gap_max_censored",
        "censored_share",
    ];
    for r in rows
        .iter()
        .filter(|r| r.method == Method::Aha && r.kind != StageKind::Prune)
    {
        let Some(g) = r.gates() else { continue };
        let mut heads: Vec<(f64, usize, usize)> = g
            .per_head
            .iter()
            .enumerate()
            .flat_map(|(l, row)| row.iter().enumerate().map(move |(h, &mu)| (mu, l, h)))
            .collect();
        heads.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        for (mu, l, h) in heads {
            let gap = &g.gaps[l][h];
            cells.push(r.cell.clone());
            let values = [
                Some(r.window),
                Some(r.lambda),
                Some(r.report.seq_len as f64),
                Some(l as f64),
                Some(h as f64),
                Some(mu),
                Some(gap.gaps as f64),
                gap.mean,
                gap.median.map(f64::from),
                gap.p90.map(f64::from),
                gap.max.map(f64::from),
                gap.max_censored.map(f64::from),
                Some(gap.censored_share),
            ];
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

/// A sweep directory made by hand: one cell per kind of row the tables and figures read.
#[cfg(test)]
pub mod fixture {
    use crate::config::{Config, Method};
    use crate::run::eval::{
        AttentionWork, Bucket, EvalFile, EvalReport, GapStats, GateReport, NeedReport,
        PrecisionRecall,
    };
    use crate::run::prune::PruneReport;
    use crate::sweep::{Cell, StageKind};
    use std::path::{Path, PathBuf};

    struct Spec {
        id: &'static str,
        kind: StageKind,
        dep: Option<&'static str>,
        loss: f64,
        density: f64,
        gates: bool,
        threshold: Option<f64>,
        edit: fn(&mut Config),
    }

    pub fn sweep_dir(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("attnsweep-fixture-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        // AHA at w 16 with a strong penalty, trained and evaluated again with the same attention.
        fn aha_16b(c: &mut Config) {
            c.attention.method = Method::Aha;
            c.attention.window = 16;
            c.attention.lambda = 0.1;
        }
        let specs = [
            Spec {
                id: "base-0",
                kind: StageKind::Train,
                dep: None,
                loss: 2.0,
                density: 1.0,
                gates: false,
                threshold: None,
                edit: |_| {},
            },
            Spec {
                id: "full-0",
                kind: StageKind::Train,
                dep: Some("base-0"),
                loss: 1.8,
                density: 1.0,
                gates: false,
                threshold: None,
                edit: |_| {},
            },
            Spec {
                id: "zs-0",
                kind: StageKind::Eval,
                dep: Some("base-0"),
                loss: 2.5,
                density: 0.2,
                gates: false,
                threshold: None,
                edit: |c| c.attention.method = Method::Swa,
            },
            Spec {
                id: "swa-0",
                kind: StageKind::Train,
                dep: Some("base-0"),
                loss: 2.1,
                density: 0.2,
                gates: false,
                threshold: None,
                edit: |c| c.attention.method = Method::Swa,
            },
            Spec {
                id: "hyb-0",
                kind: StageKind::Train,
                dep: Some("base-0"),
                loss: 1.9,
                density: 0.4,
                gates: false,
                threshold: None,
                edit: |c| c.attention.method = Method::StaticHybrid,
            },
            Spec {
                id: "aha-4",
                kind: StageKind::Train,
                dep: Some("base-0"),
                loss: 1.85,
                density: 0.9,
                gates: true,
                threshold: None,
                edit: |c| {
                    c.attention.method = Method::Aha;
                    c.attention.window = 4
                },
            },
            // aha-4 evaluated again on sequences four times longer, for its gaps alone.
            Spec {
                id: "gaps-4",
                kind: StageKind::Eval,
                dep: Some("aha-4"),
                loss: 1.95,
                density: 0.8,
                gates: true,
                threshold: None,
                edit: |c| {
                    c.attention.method = Method::Aha;
                    c.attention.window = 4;
                    c.eval.seq_len = 4 * c.data.seq_len
                },
            },
            Spec {
                id: "aha-16",
                kind: StageKind::Train,
                dep: Some("base-0"),
                loss: 1.82,
                density: 0.6,
                gates: true,
                threshold: None,
                edit: |c| {
                    c.attention.method = Method::Aha;
                    c.attention.window = 16
                },
            },
            Spec {
                id: "aha-16b",
                kind: StageKind::Train,
                dep: Some("base-0"),
                loss: 1.9,
                density: 0.5,
                gates: true,
                threshold: None,
                edit: aha_16b,
            },
            // aha-16b evaluated again with the same attention (as a probe stage does).
            Spec {
                id: "probe-16b",
                kind: StageKind::Eval,
                dep: Some("aha-16b"),
                loss: 1.9,
                density: 0.5,
                gates: true,
                threshold: None,
                edit: aha_16b,
            },
            Spec {
                id: "heads-2",
                kind: StageKind::Train,
                dep: Some("aha-16"),
                loss: 1.95,
                density: 0.5,
                gates: true,
                threshold: None,
                edit: |c| {
                    c.attention.method = Method::StaticHeads;
                    c.attention.top_k = 2
                },
            },
            Spec {
                id: "heads-budget",
                kind: StageKind::Train,
                dep: Some("aha-16"),
                loss: 1.84,
                density: 0.5,
                gates: true,
                threshold: None,
                edit: |c| {
                    c.attention.method = Method::StaticHeads;
                    c.attention.top_k = 0
                },
            },
            Spec {
                id: "heads-16",
                kind: StageKind::Train,
                dep: Some("aha-16"),
                loss: 1.83,
                density: 1.0,
                gates: true,
                threshold: None,
                edit: |c| {
                    c.attention.method = Method::StaticHeads;
                    c.attention.top_k = 16
                },
            },
            Spec {
                id: "l2a-0",
                kind: StageKind::Train,
                dep: Some("base-0"),
                loss: 1.83,
                density: 0.5,
                gates: true,
                threshold: None,
                edit: |c| c.attention.method = Method::L2a,
            },
            Spec {
                id: "tau-3",
                kind: StageKind::Eval,
                dep: Some("l2a-0"),
                loss: 1.81,
                density: 0.7,
                gates: true,
                threshold: None,
                edit: |c| {
                    c.attention.method = Method::L2a;
                    c.attention.tau = 0.3
                },
            },
            Spec {
                id: "tau-7",
                kind: StageKind::Eval,
                dep: Some("l2a-0"),
                loss: 1.9,
                density: 0.3,
                gates: true,
                threshold: None,
                edit: |c| {
                    c.attention.method = Method::L2a;
                    c.attention.tau = 0.7
                },
            },
            Spec {
                id: "prune-9",
                kind: StageKind::Prune,
                dep: Some("l2a-0"),
                loss: 1.86,
                density: 0.4,
                gates: true,
                threshold: Some(0.9),
                edit: |c| c.attention.method = Method::L2a,
            },
            Spec {
                id: "swi-0",
                kind: StageKind::Train,
                dep: Some("base-0"),
                loss: 1.84,
                density: 0.6,
                gates: true,
                threshold: None,
                edit: |c| c.attention.method = Method::Swiattn,
            },
            Spec {
                id: "swi-v1",
                kind: StageKind::Train,
                dep: Some("base-0"),
                loss: 1.88,
                density: 0.5,
                gates: true,
                threshold: None,
                edit: |c| {
                    c.attention.method = Method::Swiattn;
                    c.attention.swiattn_adaptive = false
                },
            },
            Spec {
                id: "ppa-0",
                kind: StageKind::Train,
                dep: Some("base-0"),
                loss: 2.0,
                density: 0.15,
                gates: false,
                threshold: None,
                edit: |c| {
                    c.attention.method = Method::Ppa;
                    c.attention.ppa_power = 0.0
                },
            },
            Spec {
                id: "ppa-5",
                kind: StageKind::Train,
                dep: Some("base-0"),
                loss: 1.9,
                density: 0.3,
                gates: false,
                threshold: None,
                edit: |c| {
                    c.attention.method = Method::Ppa;
                    c.attention.ppa_power = 0.5
                },
            },
        ];
        let mut cells = Vec::new();
        for (i, s) in specs.iter().enumerate() {
            let mut config = Config::default();
            (s.edit)(&mut config);
            let cell_dir = dir.join(s.id);
            std::fs::create_dir_all(cell_dir.join("eval")).unwrap();
            std::fs::write(
                cell_dir.join("status.json"),
                r#"{"state":"done","attempts":1,"error":null}"#,
            )
            .unwrap();
            let gap = |gaps: u64, median: Option<u32>, share: f64| GapStats {
                gaps,
                mean: median.map(f64::from),
                median,
                p90: median.map(|m| m + 1),
                max: median.map(|m| m + 2),
                max_censored: Some(64),
                censored_share: share,
            };
            let gates = s.gates.then(|| GateReport {
                mu_f: s.density,
                per_layer: vec![s.density, s.density * 0.5],
                per_head: vec![vec![0.9, 0.1], vec![0.4, 0.6]],
                gaps: vec![
                    vec![gap(9, Some(1), 0.0), gap(0, None, 1.0)],
                    vec![gap(4, Some(2), 0.5), gap(5, Some(3), 0.25)],
                ],
                censored_heads: 1,
                need: Some(NeedReport {
                    window: 64,
                    positions: 10,
                    needing: 4,
                    per_layer: vec![],
                    all_gates: PrecisionRecall {
                        precision: Some(0.3),
                        recall: Some(0.8),
                        ..Default::default()
                    },
                }),
            });
            let pairs = s.density * 1e6;
            let report = EvalReport {
                split: "val".into(),
                seq_len: config.eval_seq_len(),
                checkpoint_step: Some(config.train.steps),
                train_steps: config.train.steps,
                tokens: 1000,
                loss: s.loss,
                perplexity: s.loss.exp(),
                bits_per_token: s.loss / std::f64::consts::LN_2,
                unigram_entropy: 3.0,
                attention: AttentionWork {
                    pairs,
                    full_causal_pairs: 1e6,
                    pairs_vs_full: s.density,
                    flops: 4.0 * pairs,
                    full_causal_flops: 4e6,
                },
                kv_cache_bytes: vec![500.0, 500.0],
                kv_cache_bytes_total: 1000.0,
                kv_cache_bytes_full: 1000.0,
                buckets: [
                    ("unpredictable", 0),
                    ("local", 1),
                    ("d2-3", 2),
                    ("d4-7", 4),
                    ("d64-127", 64),
                    ("d128-255", 128),
                ]
                .iter()
                .map(|&(name, lo)| Bucket {
                    bucket: name.into(),
                    min_distance: lo,
                    tokens: 100 + lo as u64,
                    loss: s.loss + 0.1 * lo as f64,
                    accuracy: Some(1.0 / (1.0 + lo as f64)),
                })
                .collect(),
                gates,
                timing: Some(crate::run::eval::Timing {
                    device: "Cpu".into(),
                    batch: 2,
                    seq_len: 8,
                    forward_ms: 10.0,
                    attention_ms: 4.0 * s.density,
                    prefill_ms: 8.0,
                    decode_steps: 4,
                    decode_tokens_per_s: 100.0 / s.density,
                    decode_cache_bytes: 1000.0,
                }),
            };
            let file = EvalFile {
                report,
                config: config.clone(),
            };
            std::fs::write(
                cell_dir.join("eval/eval.json"),
                serde_json::to_string(&file).unwrap(),
            )
            .unwrap();
            let suite = serde_json::json!({ "results": { "niah_single": {
                "alias": "niah_single", "exact_match,none": s.loss, "exact_match_stderr,none": 0.1 } } });
            std::fs::write(cell_dir.join("eval/results.json"), suite.to_string()).unwrap();
            if s.kind == StageKind::Train {
                std::fs::write(
                    cell_dir.join("val_log.csv"),
                    format!("step,val_loss\n100,{}\n200,{}\n", s.loss + 0.1, s.loss),
                )
                .unwrap();
                // Rates 1000, 3000, 2000: the median is 2000.
                std::fs::write(
                    cell_dir.join("train_log.csv"),
                    "step,loss,lr,grad_norm,tokens_per_s,tokens_seen,reg,mu_f\n\
                     10,3,0.001,1,1000.0,100,,\n20,3,0.001,1,3000.0,200,,\n30,3,0.001,1,2000.0,300,,\n",
                )
                .unwrap();
            }
            if let Some(threshold) = s.threshold {
                let p = PruneReport {
                    threshold,
                    sparsity: vec![0.5, 0.95],
                    pruned_layers: vec![1],
                    kv_cache_bytes_before: 2000.0,
                    kv_cache_bytes_after: 1000.0,
                    kv_cache_bytes_full: 2000.0,
                    loss_before: 1.83,
                    loss_after: s.loss,
                };
                std::fs::write(
                    cell_dir.join("prune.json"),
                    serde_json::to_string(&p).unwrap(),
                )
                .unwrap();
            }
            cells.push(Cell {
                index: i,
                id: s.id.into(),
                stage: s.id.split('-').next().unwrap().into(),
                kind: s.kind,
                label: s.id.into(),
                assignment: Default::default(),
                settings: Default::default(),
                depends_on: s.dep.map(String::from),
                reads: None,
                match_usage: false,
                threshold: s.threshold,
                config,
            });
        }
        std::fs::write(
            dir.join("cells.json"),
            serde_json::to_string(&cells).unwrap(),
        )
        .unwrap();
        // A cell that did not finish is left out of every table.
        std::fs::create_dir_all(dir.join("broken")).unwrap();
        dir
    }

    pub fn csv(path: &Path) -> Vec<Vec<String>> {
        std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .map(|l| l.split(',').map(String::from).collect())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::fixture::{csv, sweep_dir};
    use super::*;

    #[test]
    fn pareto_table_compares_one_budget_on_every_cost() {
        let dir = sweep_dir("pareto");
        write_all(&dir, &dir).unwrap();
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
        // Every cell trained at one rate and holds one cache size: full attention, the best
        // loss, is the only point of those fronts.
        for c in ["front_time", "front_memory"] {
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
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn every_paper_table_from_a_fixture_sweep() {
        let dir = sweep_dir("tables");
        let written = write_all(&dir, &dir).unwrap();
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
