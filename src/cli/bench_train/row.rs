//! A row of `bench train`'s table (`train_bench.csv`): one case measured or refused, the
//! columns it writes and reads back, and the model FLOPs its utilisation counts.

use crate::cli::bench_methods::TrainMethod;
use crate::config::ModelConfig;
use crate::util::stats::mean_interval;
use anyhow::{ensure, Context, Result};
use std::collections::BTreeMap;

/// The dense bf16 peak the utilisation divides by: an H100 SXM's (and an H200's), 989.4
/// TFLOP/s without sparsity.
pub(super) const PEAK_FLOPS: f64 = 989.4e12;

/// The `impl` column of our rows.
pub(super) const OURS: &str = "attnsweep";

/// A method's place in the registry's order of bench variants (unknown names last).
pub(super) fn method_rank(name: &str) -> usize {
    TrainMethod::all()
        .position(|m| m.name() == name)
        .unwrap_or(usize::MAX)
}

/// Whether the variant named `method` reads PPA's power (`BenchVariant::reads_power`).
pub(super) fn reads_power(method: &str) -> bool {
    TrainMethod::parse(method).is_ok_and(|m| m.variant.reads_power)
}

/// One case measured (or refused): a row of `train_bench.csv`.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct TrainRow {
    pub(super) model: String,
    pub(super) imp: String,
    pub(super) method: String,
    pub(super) window: usize,
    /// The usage the gates were set to open at (`--full-usage`).
    pub(super) usage_set: f64,
    /// PPA's power (`--ppa-power`), for a method that reads it; None for the others, and for
    /// rows of a CSV written before the column was.
    pub(super) ppa_power: Option<f64>,
    pub(super) len: i64,
    pub(super) batch: i64,
    /// How the case keeps its activations and computes its loss.
    pub(super) setup: String,
    /// None where the case failed (`note` says why); over several runs of the bench
    /// (`--repeats`), the mean of the runs that measured it.
    pub(super) step_ms: Option<f64>,
    /// A slot per run of the bench that made the row, in the order the runs went: its step
    /// time, None where that run did not measure the case (empty for a row of a CSV written
    /// before the column was, and for a row made by hand).
    pub(super) runs_ms: Vec<Option<f64>>,
    /// When the bench that made the row started (seconds since 1970): rows of one bench are
    /// paired run by run, rows of two are not.
    pub(super) bench_run: Option<u64>,
    pub(super) peak_gib: Option<f64>,
    pub(super) planned_gib: Option<f64>,
    /// mu_f measured on the timed steps.
    pub(super) full_usage: Option<f64>,
    /// The utilisation as last written: kept for a model whose shape this run cannot resolve
    /// (`write_outputs`).
    pub(super) mfu: Option<f64>,
    pub(super) note: String,
}

/// The settings a row's method reads (`BenchVariant::reads_window`, `reads_usage`,
/// `reads_power`): its window, its gates' usage and PPA's power (as written in the CSV), None
/// for one it does not read.
pub(super) type Case = (Option<usize>, Option<String>, Option<String>);

pub(super) const HEADER: [&str; 22] = [
    "model",
    "impl",
    "method",
    "window",
    "usage_set",
    "ppa_power",
    "L",
    "batch",
    "setup",
    "step_ms",
    "tokens_per_s",
    "peak_gib",
    "planned_gib",
    "mfu",
    "full_usage",
    "vs_same_impl_full",
    "vs_compile_full",
    "note",
    "step_ms_runs",
    "vs_compile_full_ci95_low",
    "vs_compile_full_ci95_high",
    "bench_run",
];

/// The columns a CSV of an earlier version may lack (`ppa_power` and the repeats' four): such
/// a file reads as one whose rows hold no power and one run each, of no bench run named.
pub(super) const ADDED: [&str; 5] = [
    "ppa_power",
    "step_ms_runs",
    "vs_compile_full_ci95_low",
    "vs_compile_full_ci95_high",
    "bench_run",
];

/// Whether `header` is `HEADER` less some of the columns added since (`ADDED`), in order.
pub(super) fn known_header(header: &[String]) -> bool {
    let kept = HEADER
        .iter()
        .filter(|h| !ADDED.contains(h) || header.iter().any(|c| c == *h));
    header.iter().map(String::as_str).eq(kept.copied())
}

/// Model FLOPs a token of `m` takes in a training step at length `len`: 6 per parameter of
/// every matrix product (projections, MLP, head; the embedding lookup is none), and 12 per
/// query dimension and attended key for attention (QK and PV, forward and backward), with
/// full causal attention's (len + 1) / 2 keys a query: the dense model's count, the same for
/// every method, so a sparse method's utilisation reads as throughput in dense-model units.
pub(super) fn flops_per_token(m: &ModelConfig, len: i64) -> f64 {
    let (d, f, v) = (
        m.hidden_size as f64,
        m.intermediate_size as f64,
        m.vocab_size as f64,
    );
    let q = (m.num_attention_heads * m.head_dim()) as f64;
    let kv = (m.num_key_value_heads * m.head_dim()) as f64;
    let layer = d * q * 2.0 + d * kv * 2.0 + 3.0 * d * f;
    let matmul = m.num_hidden_layers as f64 * layer + v * d;
    6.0 * matmul + 12.0 * m.num_hidden_layers as f64 * q * (len as f64 + 1.0) / 2.0
}

impl TrainRow {
    /// The case a row measures: a setting its method does not read does not tell two rows
    /// apart (full attention at another `--window` is the same case).
    pub(super) fn key(&self) -> (String, String, String, Case, i64) {
        (
            self.model.clone(),
            self.imp.clone(),
            self.method.clone(),
            self.case(),
            self.len,
        )
    }

    pub(super) fn case(&self) -> Case {
        let (window, usage, power) =
            TrainMethod::parse(&self.method).map_or((true, true, true), |m| {
                (
                    m.variant.reads_window,
                    m.variant.reads_usage,
                    m.variant.reads_power,
                )
            });
        (
            window.then_some(self.window),
            usage.then(|| format!("{}", self.usage_set)),
            self.ppa_power.filter(|_| power).map(|p| format!("{p}")),
        )
    }

    pub(super) fn tokens_per_s(&self) -> Option<f64> {
        self.step_ms
            .map(|ms| (self.batch * self.len) as f64 / ms * 1e3)
    }

    /// The 95 % interval of the throughput over the runs (`--repeats`): the step time's
    /// interval (Student's t on the log scale, a time being positive) as tokens/s; NaN for one
    /// run.
    pub(super) fn tokens_per_s_interval(&self) -> (f64, f64) {
        let runs: Vec<f64> = self.runs_ms.iter().flatten().copied().collect();
        if runs.len() < 2 {
            return (f64::NAN, f64::NAN);
        }
        let (low_ms, high_ms) = mean_interval(&runs, Some((0.0, f64::INFINITY)));
        let tokens = (self.batch * self.len) as f64 * 1e3;
        (tokens / high_ms, tokens / low_ms)
    }

    pub(super) fn record(
        &self,
        rows: &[TrainRow],
        models: &BTreeMap<String, ModelConfig>,
    ) -> Vec<String> {
        let full_row = |imp: &str| {
            rows.iter().find(|r| {
                r.model == self.model && r.imp == imp && r.method == "full" && r.len == self.len
            })
        };
        let full_of = |imp: &str| full_row(imp).and_then(TrainRow::tokens_per_s);
        // Of throughputs, not step times: rows of runs with other --tokens hold other batches.
        let ratio = |base: Option<f64>| match (base, self.tokens_per_s()) {
            (Some(b), Some(t)) => format!("{:.3}", t / b),
            _ => String::new(),
        };
        let opt =
            |v: Option<f64>, digits: usize| v.map_or(String::new(), |v| format!("{v:.digits$}"));
        let mfu = match (self.tokens_per_s(), models.get(&self.model)) {
            (Some(t), Some(m)) => Some(t * flops_per_token(m, self.len) / PEAK_FLOPS),
            _ => self.mfu,
        };
        let mut record = vec![
            self.model.clone(),
            self.imp.clone(),
            self.method.clone(),
            self.window.to_string(),
            self.usage_set.to_string(),
            self.ppa_power.map_or(String::new(), |p| p.to_string()),
            self.len.to_string(),
            self.batch.to_string(),
            self.setup.clone(),
            opt(self.step_ms, 3),
            opt(self.tokens_per_s(), 0),
            opt(self.peak_gib, 2),
            opt(self.planned_gib, 2),
            opt(mfu, 3),
            opt(self.full_usage, 4),
            ratio(full_of(&self.imp)),
            ratio(full_of("torch_compile")),
            self.note.clone(),
            // A run that did not measure the case is "-" ("" is a row of no runs).
            self.runs_ms
                .iter()
                .map(|ms| ms.map_or("-".to_string(), |ms| format!("{ms:.3}")))
                .collect::<Vec<_>>()
                .join("/"),
        ];
        let (low, high) = full_row("torch_compile")
            .map_or((f64::NAN, f64::NAN), |f| self.paired_ratio_interval(f));
        record.push(opt(Some(low).filter(|v| v.is_finite()), 3));
        record.push(opt(Some(high).filter(|v| v.is_finite()), 3));
        record.push(self.bench_run.map_or(String::new(), |t| t.to_string()));
        record
    }

    /// The 95 % interval of this row's throughput over `base`'s, run by run: rows of one
    /// bench (`bench_run`) with a slot per run each, the runs both measured paired (the bench
    /// runs both sides once a run), each pair's ratio one replicate, Student's t on the log
    /// scale (a ratio is positive). Its centre is the pairs' geometric mean, not the ratio of
    /// the mean throughputs that `vs_compile_full` reports. NaN with fewer than two pairs.
    pub(super) fn paired_ratio_interval(&self, base: &TrainRow) -> (f64, f64) {
        let one_bench = self.bench_run.is_some()
            && self.bench_run == base.bench_run
            && self.runs_ms.len() == base.runs_ms.len();
        if !one_bench {
            return (f64::NAN, f64::NAN);
        }
        let rate = |r: &TrainRow, ms: f64| (r.batch * r.len) as f64 / ms;
        let ratios: Vec<f64> = self
            .runs_ms
            .iter()
            .zip(&base.runs_ms)
            .filter_map(|(a, b)| Some(rate(self, (*a)?) / rate(base, (*b)?)))
            .collect();
        match ratios.len() {
            0 | 1 => (f64::NAN, f64::NAN),
            _ => mean_interval(&ratios, Some((0.0, f64::INFINITY))),
        }
    }

    /// A row of an earlier run's CSV, its fields found by `columns` (the file's header).
    pub(super) fn parse(r: &csv::StringRecord, columns: &[String]) -> Result<TrainRow> {
        let get = |name: &str| {
            columns
                .iter()
                .position(|c| c == name)
                .and_then(|i| r.get(i))
                .unwrap_or_default()
                .to_string()
        };
        let num = |name: &str| optional_number(&get(name), name);
        Ok(TrainRow {
            model: get("model"),
            imp: get("impl"),
            method: get("method"),
            window: get("window").parse().context("window is not an integer")?,
            usage_set: num("usage_set")?.context("usage_set is empty")?,
            ppa_power: num("ppa_power")?,
            len: get("L").parse().context("L is not an integer")?,
            batch: get("batch").parse().context("batch is not an integer")?,
            setup: get("setup"),
            step_ms: num("step_ms")?,
            // A row of a CSV without the column: its step time is its one run.
            runs_ms: match get("step_ms_runs").as_str() {
                "" => num("step_ms")?.into_iter().map(Some).collect(),
                runs => runs
                    .split('/')
                    .map(|ms| match ms {
                        "-" => Ok(None),
                        ms => Ok(Some(
                            optional_number(ms, "a run of step_ms_runs")?
                                .context("step_ms_runs holds an empty run")?,
                        )),
                    })
                    .collect::<Result<_>>()?,
            },
            bench_run: match get("bench_run").as_str() {
                "" => None,
                t => Some(t.parse().context("bench_run is not a whole number")?),
            },
            peak_gib: num("peak_gib")?,
            planned_gib: num("planned_gib")?,
            full_usage: num("full_usage")?,
            mfu: num("mfu")?,
            note: get("note"),
        })
    }
}

/// A number of a CSV field named `what`: None where empty, else a finite number.
pub(super) fn optional_number(s: &str, what: &str) -> Result<Option<f64>> {
    if s.is_empty() {
        return Ok(None);
    }
    let v: f64 = s
        .parse()
        .with_context(|| format!("{what} = {s:?} is not a number"))?;
    ensure!(v.is_finite(), "{what} = {s} is not finite");
    Ok(Some(v))
}

/// One row per case from the runs of one bench (`--repeats`; `bench_run` its start), each
/// run's rows in the order they were measured: a case's row is the first run's that measured
/// it (its setup, usage and notes), its peak the largest of the runs', `runs_ms` a slot per run
/// and `step_ms` the mean of the runs that measured it. A run that could not measure the case,
/// or chose another set-up for it, is named in the row's note. A case no run measured keeps
/// the first run's refusal, the others' named beside it.
pub(super) fn combine_runs(runs: Vec<Vec<TrainRow>>, bench_run: u64) -> Vec<TrainRow> {
    let n = runs.len();
    let mut out: Vec<TrainRow> = Vec::new();
    // The choice a setup names, less the times of the tries behind it.
    let chosen = |setup: &str| {
        setup
            .split("; tried ")
            .next()
            .unwrap_or_default()
            .to_string()
    };
    for (k, run) in runs.into_iter().enumerate() {
        for r in run {
            let run_note = |what: &str| format!("run {} of {n} {what}", k + 1);
            let Some(i) = out.iter().position(|o| o.key() == r.key()) else {
                let mut row = TrainRow {
                    runs_ms: vec![None; n],
                    bench_run: Some(bench_run),
                    ..r.clone()
                };
                if let Some(ms) = r.step_ms {
                    row.runs_ms[k] = Some(ms);
                } else if n > 1 {
                    row.note = run_note(&format!("failed: {}", r.note));
                }
                out.push(row);
                continue;
            };
            let o = &mut out[i];
            match (o.step_ms, r.step_ms) {
                (_, None) => {
                    o.note = join_notes(&o.note, &run_note(&format!("failed: {}", r.note)));
                }
                // The runs before failed: this run's row stands, their notes kept.
                (None, Some(ms)) => {
                    let before = std::mem::take(&mut o.note);
                    let mut slots = std::mem::take(&mut o.runs_ms);
                    slots[k] = Some(ms);
                    *o = TrainRow {
                        runs_ms: slots,
                        bench_run: Some(bench_run),
                        note: join_notes(&before, &r.note),
                        ..r.clone()
                    };
                }
                (Some(_), Some(ms)) => {
                    o.runs_ms[k] = Some(ms);
                    if chosen(&r.setup) != chosen(&o.setup) {
                        let other = run_note(&format!("chose {}", chosen(&r.setup)));
                        o.note = join_notes(&o.note, &other);
                    }
                    o.peak_gib = match (o.peak_gib, r.peak_gib) {
                        (Some(a), Some(b)) => Some(a.max(b)),
                        (a, b) => a.or(b),
                    };
                    let measured: Vec<f64> = o.runs_ms.iter().flatten().copied().collect();
                    o.step_ms = Some(measured.iter().sum::<f64>() / measured.len() as f64);
                }
            }
        }
    }
    out
}

/// Two notes as one ("; " between), either of them possibly empty.
fn join_notes(a: &str, b: &str) -> String {
    match (a.is_empty(), b.is_empty()) {
        (true, _) => b.to_string(),
        (_, true) => a.to_string(),
        _ => format!("{a}; {b}"),
    }
}
