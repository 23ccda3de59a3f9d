//! The evaluation suite beyond the loss: long-context probes scored by greedy generation over
//! the key-value cache, multiple-choice tasks scored by log-likelihood, and what inference
//! costs (keys attended per query and FLOPs per token in prefill, keys read per generated
//! token, cache bytes, time to first token, decoding speed). Results are written in the
//! lm-evaluation-harness shape (`results.json`) and as tidy CSV (`tasks.csv`, `niah.csv`,
//! `efficiency.csv`).

use crate::config::{Config, HaystackKind, ProbeGates};
use crate::data::probes::{self, Haystack, Probe, Task};
use crate::data::ruler;
use crate::data::{self, Split, TextTokenizer};
use crate::model::attention::{spec, Gates};
use crate::model::Llama;
use crate::run::choice::{read_mc, score_mc, write_mc_samples};
use crate::run::eval;
use crate::run::generate::HeadGates;
use crate::run::journal::Journal;
use crate::run::memory;
use crate::run::probe_batch::{run_batch, Batch, Cost};
use crate::util::atomic;
use crate::util::fault;
use crate::util::progress::{Progress, DEFAULT_STATUS_EVERY};
use crate::util::rng::Rng;
use crate::util::stats::{pooled_interval, wilson};
use anyhow::{bail, ensure, Context, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tch::Device;

/// Scores of one (task, length, depth) cell of the probe grid.
#[derive(Clone, Debug)]
pub(crate) struct ProbeCell {
    pub(crate) task: Task,
    pub(crate) length: usize,
    /// Requested depth; None for MQAR.
    pub(crate) depth: Option<f64>,
    pub(crate) exact_match: Vec<f64>,
    pub(crate) recall: Vec<f64>,
    /// Per probe, the mean gate over the queries that generated the answer's tokens.
    pub(crate) full_ratio: Option<Vec<f64>>,
    /// Per probe, the mean gate over the prompt's positions an answer rests on (its needles
    /// and question, `Probe::spans`): 1 for the oracle's gates, where a learned router falls
    /// below it.
    pub(crate) span_recall: Option<Vec<f64>>,
    /// Per probe, the mean gate over all of its prompt's positions: what `span_recall` is
    /// read against (gates blind to the evidence open it as often).
    pub(crate) prompt_gate: Option<Vec<f64>>,
    /// Per probe, the target and the generated text, for inspection.
    pub(crate) outputs: Vec<(String, String)>,
}

/// What the probes of `cfg.eval.tasks` measured: a cell per (task, length, depth), the
/// inference cost per (task, length), and each task's head usage over its prompts (routed
/// methods).
pub(crate) struct ProbeRun {
    pub(crate) cells: Vec<ProbeCell>,
    pub(crate) costs: BTreeMap<(Task, usize), Cost>,
    pub(crate) head_gates: BTreeMap<Task, HeadGates>,
}

/// The probes of `cfg.eval.tasks` over lengths and depths; the batches `journal` holds are
/// taken from it, the others run and appended to it.
pub(crate) fn run_probes(
    model: &Llama,
    cfg: &Config,
    tok: &TextTokenizer,
    haystack: &Haystack,
    device: Device,
    show: bool,
    journal: &mut Journal,
) -> Result<ProbeRun> {
    let e = &cfg.eval;
    let mut spec = e.probe_spec();
    // Each replicate draws its own prompts (the seed's), so intervals over seeds hold the
    // prompts' sampling; settings at one seed share theirs, and compare paired.
    spec.seed = Rng::derive(e.probe_seed, &[cfg.train.seed]);
    if e.chat {
        spec.chat = Some(tok.chat_wrap()?);
    }
    let lengths = if e.lengths.is_empty() {
        vec![cfg.data.seq_len]
    } else {
        e.lengths.clone()
    };
    // A batch of probes draws its own gates.
    let seed = eval::eval_gate_seed(cfg);
    let mut batch_index = 0u64;
    let (mut cells, mut costs) = (Vec::new(), BTreeMap::new());
    let mut head_gates: BTreeMap<Task, HeadGates> = BTreeMap::new();
    let total = e.tasks.len() * lengths.len() * e.samples;
    let every = Duration::from_secs(DEFAULT_STATUS_EVERY);
    let mut progress = Progress::new(total as u64, "probes", !show, every);
    let mut done = 0;
    for name in &e.tasks {
        let task = Task::parse(name)?;
        let depths = depths_of(task, e);
        for &length in &lengths {
            // A (task, length) holds `eval.samples` prompts, prompt s at depths[s mod n] (as
            // RULER spreads its needles over depths), generated in batches across the depths.
            let at: Vec<usize> = (0..e.samples).map(|s| s % depths.len()).collect();
            let probes: Vec<Probe> = (0..e.samples)
                .map(|s| {
                    let depth = depths[at[s]].unwrap_or(0.0);
                    probes::generate(task, &spec, haystack, tok, length, depth, s as u64)
                })
                .collect::<Result<_>>()?;
            let max_new = probes::max_new_tokens(task, &probes, tok)?;
            let mut by_depth: Vec<ProbeCell> = depths
                .iter()
                .map(|&depth| ProbeCell {
                    task,
                    length,
                    depth,
                    exact_match: vec![],
                    recall: vec![],
                    full_ratio: None,
                    span_recall: None,
                    prompt_gate: None,
                    outputs: vec![],
                })
                .collect();
            let cost: &mut Cost = costs.entry((task, length)).or_default();
            cost.length = length;
            for (c, chunk) in probes.chunks(e.batch_size).enumerate() {
                // Each batch draws its own gates, whether it runs or was run before.
                let (index, gate_seed) = (batch_index, Rng::derive(seed, &[batch_index]));
                batch_index += 1;
                let batch = match journal.take::<Batch>(name, length, index)? {
                    Some(b) => {
                        let ours = b.rows.len() == chunk.len()
                            && b.rows.iter().zip(chunk).all(|(r, p)| r.target == p.target);
                        ensure!(
                            ours,
                            "the probe journal's batch {index} ({name} at {length}) holds other \
                             prompts than this evaluation draws; remove {} to run the probes \
                             from their first batch",
                            journal.path().display()
                        );
                        b
                    }
                    None => {
                        let at = (length, max_new, gate_seed);
                        let b = run_batch(model, cfg, tok, chunk, at, device)?;
                        // A non-finite score would not read back as written: such a batch
                        // runs again on a resume.
                        if b.finite() {
                            journal.append(name, length, index, &b)?;
                        }
                        fault::point("probe_batch");
                        b
                    }
                };
                done += chunk.len();
                progress.update(done as u64, &format!("{name} at {length}"));
                if let Some(pg) = &batch.head_gates {
                    head_gates
                        .entry(task)
                        .and_modify(|h| h.add(pg))
                        .or_insert_with(|| pg.clone());
                }
                for (r, row) in batch.rows.into_iter().enumerate() {
                    let cell = &mut by_depth[at[c * e.batch_size + r]];
                    cell.outputs.push((row.target, row.text));
                    cell.exact_match.push(row.exact_match);
                    cell.recall.push(row.recall);
                    if let Some(hit) = row.span_recall {
                        cell.span_recall.get_or_insert_with(Vec::new).push(hit);
                    }
                    if let Some(g) = row.prompt_gate {
                        cell.prompt_gate.get_or_insert_with(Vec::new).push(g);
                    }
                    if let Some(ratio) = row.full_ratio {
                        cell.full_ratio.get_or_insert_with(Vec::new).push(ratio);
                    }
                }
                cost.add(&batch.cost);
            }
            // Fewer prompts than depths leave the last depths without any.
            cells.extend(by_depth.into_iter().filter(|c| !c.recall.is_empty()));
        }
    }
    progress.finish();
    // Batches resumed from an earlier binary's journal lack the prompts' gate: the whole
    // evaluation then reports none rather than a mean over some of its prompts.
    let partial = cells
        .iter()
        .any(|c| c.prompt_gate.as_ref().map(Vec::len) != c.span_recall.as_ref().map(Vec::len));
    if partial {
        cells.iter_mut().for_each(|c| c.prompt_gate = None);
    }
    Ok(ProbeRun {
        cells,
        costs,
        head_gates,
    })
}

/// The depths a task's needles are put at: `eval.depths`, or none for a task without one.
fn depths_of(task: Task, e: &crate::config::EvalConfig) -> Vec<Option<f64>> {
    match task.has_depth() {
        true => e.depths.iter().map(|&d| Some(d)).collect(),
        false => vec![None],
    }
}

/// The haystack of the probes: noise, or the val split of `eval.haystack_dir` (default the
/// run's data set), which must use the run's tokenizer.
pub(crate) fn haystack(cfg: &Config, run_meta: &data::Meta) -> Result<Haystack> {
    Ok(match haystack_source(cfg, run_meta)? {
        None => Haystack::Noise,
        Some((dir, meta)) => Haystack::Text(Split::open(&dir, &meta, "val")?.all_tokens()),
    })
}

/// The data set a text haystack is cut from, with its meta, checked to share the run's
/// tokenizer; None for noise.
fn haystack_source(cfg: &Config, run_meta: &data::Meta) -> Result<Option<(PathBuf, data::Meta)>> {
    if cfg.eval.haystack == HaystackKind::Noise {
        return Ok(None);
    }
    let dir = if cfg.eval.haystack_dir.as_os_str().is_empty() {
        cfg.data.dir.clone()
    } else {
        cfg.eval.haystack_dir.clone()
    };
    let meta = data::read_meta(&dir)?;
    let same_tokenizer = meta.tokenizer == run_meta.tokenizer
        && meta.vocab_size == run_meta.vocab_size
        && (meta.tokenizer != "tokenizer.json"
            || std::fs::read(dir.join("tokenizer.json")).ok()
                == std::fs::read(cfg.data.dir.join("tokenizer.json")).ok());
    ensure!(
        same_tokenizer,
        "haystack data set {} was tokenized differently from the model's data set {}",
        dir.display(),
        cfg.data.dir.display()
    );
    Ok(Some((dir, meta)))
}

// ---------------------------------------------------------------------------------------
// Running and writing.

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// Standard error of the mean with the sample standard deviation, as the harness reports.
fn stderr(v: &[f64]) -> f64 {
    if v.len() < 2 {
        return f64::NAN;
    }
    let m = mean(v);
    let var = v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (v.len() - 1) as f64;
    (var / v.len() as f64).sqrt()
}

/// One tidy row of `tasks.csv`: per (task, length, depth); per (task, length) with the depth
/// empty (a needle task's prompts over its depths); per task with both empty.
#[derive(serde::Serialize)]
struct TidyRow {
    task: String,
    length: Option<usize>,
    depth: Option<f64>,
    metric: String,
    value: f64,
    n: usize,
    /// The 95 % interval over the prompts: Wilson's for 0/1 scores, a bootstrap's for others
    /// (both inside [0, 1]).
    ci95_low: f64,
    ci95_high: f64,
}

/// How `run` reports.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RunOptions {
    /// Write every multiple-choice item's scoring (`samples_<task>.jsonl`).
    pub(crate) log_samples: bool,
    /// Show progress: a bar on a terminal, status lines with an ETA in a log.
    pub(crate) progress: bool,
}

/// Runs every task `cfg.eval` names (probes and multiple choice) and writes `results.json`,
/// `tasks.csv`, `niah.csv` (tasks with a needle depth) and `efficiency.csv` to `dir`.
/// Returns the overall metrics per task.
pub(crate) fn run(
    model: &Llama,
    cfg: &Config,
    meta: &data::Meta,
    device: Device,
    dir: &Path,
    model_path: &Path,
    opts: &RunOptions,
) -> Result<BTreeMap<String, BTreeMap<String, f64>>> {
    let e = &cfg.eval;
    if e.tasks.is_empty() && e.mc.is_empty() {
        bail!("no tasks: set eval.tasks (probes) or eval.mc (multiple-choice files)");
    }
    preflight(cfg, meta, Some(device))?;
    let tok = data::tokenizer_of(&cfg.data.dir, meta)?;
    atomic::ensure_writable_dir(dir)?;
    let mut scores = Scores::default();
    let mut journal = None;
    if !e.tasks.is_empty() {
        let j = journal.insert(Journal::of_evaluation(dir, cfg, model_path, opts.progress)?);
        scores.probes(model, cfg, meta, &tok, device, dir, opts, j)?;
    }
    for path in &e.mc {
        scores.multiple_choice(model, cfg, &tok, device, dir, path, opts)?;
    }
    scores.write(cfg, device, dir, model_path)?;
    if let Some(j) = journal {
        j.finish()?;
    }
    Ok(scores.results)
}

/// What the tasks `cfg.eval` names will read, checked before any model runs (by `run`, and by
/// a sweep's dry run for its eval cells): a text data set's tokenizer, each task's name, the
/// chat template where `eval.chat` asks for it, the haystack's data set, the multiple-choice
/// files, and on `device` (where known) the memory of the longest probes.
pub(crate) fn preflight(cfg: &Config, meta: &data::Meta, device: Option<Device>) -> Result<()> {
    let e = &cfg.eval;
    if e.tasks.is_empty() && e.mc.is_empty() {
        return Ok(());
    }
    let tok = data::tokenizer_of(&cfg.data.dir, meta)?;
    for name in &e.tasks {
        Task::parse(name)?;
    }
    ensure!(
        e.gates == ProbeGates::Learned || spec(cfg.attention.method).gates != Gates::None,
        "eval.gates = \"oracle\" replaces a router's gates, and attention.method = {} has none: \
         evaluate a routed model (aha, l2a, swiattn, ...) or leave eval.gates out",
        crate::config::name_of(cfg.attention.method)
    );
    if e.chat && !e.tasks.is_empty() {
        tok.chat_wrap()?;
    }
    if !e.tasks.is_empty() {
        haystack_source(cfg, meta)?;
    }
    for path in &e.mc {
        ensure!(
            path.is_file(),
            "eval.mc names {}, which is not a file",
            path.display()
        );
    }
    if let (Some(device), false) = (device, e.tasks.is_empty()) {
        let longest = e.lengths.iter().copied().max().unwrap_or(cfg.data.seq_len);
        memory::check_probes(cfg, device, longest)?;
    }
    Ok(())
}

/// What the tasks scored, gathered for `tasks.csv` and the harness-shaped `results.json`.
#[derive(Default)]
struct Scores {
    tidy: Vec<TidyRow>,
    /// Per task: each metric's mean and standard error.
    results: BTreeMap<String, BTreeMap<String, f64>>,
    n_samples: BTreeMap<String, usize>,
    configs: serde_json::Map<String, serde_json::Value>,
}

/// A row of `tasks.csv`: the mean of `v`.
fn tidy_row(
    task: &str,
    length: Option<usize>,
    depth: Option<f64>,
    metric: &str,
    v: &[f64],
) -> TidyRow {
    let binary = v.iter().all(|&x| x == 0.0 || x == 1.0);
    let (ci95_low, ci95_high) = match binary {
        true => wilson(v.iter().sum(), v.len() as f64),
        false => pooled_interval(&[v.to_vec()]),
    };
    TidyRow {
        task: task.into(),
        length,
        depth,
        metric: metric.into(),
        value: mean(v),
        n: v.len(),
        ci95_low,
        ci95_high,
    }
}

impl Scores {
    /// The long-context probes: every (task, length, depth) cell, each task overall, and the
    /// files beside them (`niah.csv`, `SAMPLES`, `efficiency.csv`, and for routed
    /// models `probe_head_usage.csv`).
    fn probes(
        &mut self,
        model: &Llama,
        cfg: &Config,
        meta: &data::Meta,
        tok: &TextTokenizer,
        device: Device,
        dir: &Path,
        opts: &RunOptions,
        journal: &mut Journal,
    ) -> Result<()> {
        let e = &cfg.eval;
        let hay = haystack(cfg, meta)?;
        let ProbeRun {
            cells,
            costs,
            head_gates,
        } = run_probes(model, cfg, tok, &hay, device, opts.progress, journal)?;
        // Per task, and per (task, length) over a needle task's depths: exact match, recall,
        // full ratio, span recall and the prompts' mean gate over every prompt.
        type Metrics = [Vec<f64>; 5];
        const METRICS: [&str; 5] = [
            "exact_match",
            "recall",
            "full_ratio",
            "span_recall",
            "prompt_gate",
        ];
        let mut by_task: BTreeMap<&str, Metrics> = BTreeMap::new();
        let mut by_length: BTreeMap<(&str, usize), Metrics> = BTreeMap::new();
        for c in &cells {
            let name = c.task.name();
            let values = [
                Some(&c.exact_match),
                Some(&c.recall),
                c.full_ratio.as_ref(),
                c.span_recall.as_ref(),
                c.prompt_gate.as_ref(),
            ];
            for (i, v) in values.into_iter().enumerate() {
                let Some(v) = v else { continue };
                self.tidy
                    .push(tidy_row(name, Some(c.length), c.depth, METRICS[i], v));
                by_task.entry(name).or_default()[i].extend(v);
                if c.depth.is_some() {
                    by_length.entry((name, c.length)).or_default()[i].extend(v);
                }
            }
        }
        for ((name, length), metrics) in &by_length {
            for (metric, v) in METRICS.iter().zip(metrics) {
                if !v.is_empty() {
                    self.tidy
                        .push(tidy_row(name, Some(*length), None, metric, v));
                }
            }
        }
        for (name, metrics) in &by_task {
            let r = self.results.entry(name.to_string()).or_default();
            for (metric, v) in METRICS.iter().zip(metrics) {
                if v.is_empty() {
                    continue;
                }
                r.insert(metric.to_string(), mean(v));
                r.insert(format!("{metric}_stderr"), stderr(v));
                self.tidy.push(tidy_row(name, None, None, metric, v));
            }
            let em = &metrics[0];
            self.n_samples.insert(name.to_string(), em.len());
            self.configs.insert(
                name.to_string(),
                serde_json::json!({
                    "task": name,
                    "output_type": "generate_until",
                    "generation_kwargs": {"until": probes::STOP, "do_sample": false},
                    "lengths": if e.lengths.is_empty() { vec![cfg.data.seq_len] } else { e.lengths.clone() },
                    "depths": e.depths,
                    "samples": e.samples,
                    "haystack": e.haystack,
                    "probe_seed": e.probe_seed,
                    "gates": e.gates,
                    "digits": e.digits,
                    "needles": e.needles,
                    "queries": e.queries,
                }),
            );
        }
        let ruler_scores: Vec<(usize, f64)> = ruler_by_length(&cells);
        if !ruler_scores.is_empty() {
            let effective = ruler::effective_length(&ruler_scores, ruler::EFFECTIVE_THRESHOLD);
            let r = self.results.entry("ruler".into()).or_default();
            for (length, score) in &ruler_scores {
                r.insert(format!("score_{length}"), *score);
            }
            r.insert("effective_length".into(), effective.unwrap_or(0) as f64);
            r.insert("threshold".into(), ruler::EFFECTIVE_THRESHOLD);
            write_ruler(&dir.join("ruler.csv"), &ruler_scores, effective)?;
        }
        write_niah(&dir.join("niah.csv"), &cells)?;
        write_samples(&dir.join(SAMPLES), &cells)?;
        write_efficiency(&dir.join("efficiency.csv"), &costs, cfg, device)?;
        if !head_gates.is_empty() {
            write_probe_head_usage(&dir.join("probe_head_usage.csv"), &head_gates)?;
        }
        Ok(())
    }

    /// One multiple-choice file, scored as lm-evaluation-harness does (`acc`, `acc_norm`).
    #[allow(clippy::too_many_arguments)]
    fn multiple_choice(
        &mut self,
        model: &Llama,
        cfg: &Config,
        tok: &TextTokenizer,
        device: Device,
        dir: &Path,
        path: &Path,
        opts: &RunOptions,
    ) -> Result<()> {
        let max_len = match cfg.eval.max_length {
            0 => cfg.data.seq_len,
            n => n,
        };
        // The task's name is for display; the path itself is opened as given.
        let name = path
            .file_stem()
            .with_context(|| format!("multiple-choice file {} has no name", path.display()))?
            .to_string_lossy()
            .into_owned();
        ensure!(
            !self.results.contains_key(&name),
            "two tasks are named {name}; rename one multiple-choice file"
        );
        let items = read_mc(path)?;
        let scored = score_mc(
            model,
            tok,
            &items,
            max_len,
            device,
            eval::eval_gate_seed(cfg),
            opts.progress,
        )
        .with_context(|| format!("scoring {}", path.display()))?;
        if opts.log_samples {
            write_mc_samples(&dir.join(format!("samples_{name}.jsonl")), &items, &scored)?;
        }
        let acc: Vec<f64> = scored.iter().map(|r| r.acc).collect();
        let acc_norm: Vec<f64> = scored.iter().map(|r| r.acc_norm).collect();
        let r = self.results.entry(name.clone()).or_default();
        for (metric, v) in [("acc", &acc), ("acc_norm", &acc_norm)] {
            r.insert(metric.into(), mean(v));
            r.insert(format!("{metric}_stderr"), stderr(v));
            self.tidy.push(tidy_row(&name, None, None, metric, v));
        }
        self.n_samples.insert(name.clone(), items.len());
        self.configs.insert(
            name.clone(),
            serde_json::json!({
                "task": name,
                "output_type": "multiple_choice",
                "dataset_path": path.display().to_string(),
                "max_length": max_len,
                "metric_list": ["acc", "acc_norm"],
            }),
        );
        Ok(())
    }

    /// `tasks.csv` and `results.json` (lm-evaluation-harness's shape).
    fn write(&self, cfg: &Config, device: Device, dir: &Path, model_path: &Path) -> Result<()> {
        atomic::write_with(&dir.join("tasks.csv"), |tmp| {
            let mut w = csv::Writer::from_path(tmp)?;
            for r in &self.tidy {
                w.serialize(r)?;
            }
            w.flush()?;
            Ok(())
        })?;
        // The harness's keys carry a filter name after a comma; these tasks have none.
        let harness_results: serde_json::Map<String, serde_json::Value> = self
            .results
            .iter()
            .map(|(task, m)| {
                let mut o = serde_json::Map::new();
                o.insert("alias".into(), task.clone().into());
                for (k, v) in m {
                    o.insert(format!("{k},none"), serde_json::json!(v));
                }
                (task.clone(), o.into())
            })
            .collect();
        let json = serde_json::json!({
            "results": harness_results,
            "configs": self.configs,
            "versions": self.results.keys().map(|k| (k.clone(), serde_json::json!(1))).collect::<serde_json::Map<_, _>>(),
            "n-samples": self.n_samples.iter().map(|(k, n)| (k.clone(), serde_json::json!({"original": n, "effective": n}))).collect::<serde_json::Map<_, _>>(),
            "config": {
                "model": "attnsweep",
                "model_args": model_path.display().to_string(),
                "method": cfg.attention.method,
                "batch_size": cfg.eval.batch_size,
                "device": format!("{device:?}"),
            },
            "attnsweep_version": env!("CARGO_PKG_VERSION"),
            "date": std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        });
        atomic::write_bytes(
            &dir.join("results.json"),
            serde_json::to_string_pretty(&json)?.as_bytes(),
        )
    }
}

/// Per length, RULER's score: the mean over RULER's tasks of each task's mean
/// `string_match_all` (over its depths and samples), as RULER averages its 13 tasks.
fn ruler_by_length(cells: &[ProbeCell]) -> Vec<(usize, f64)> {
    let mut by: BTreeMap<usize, BTreeMap<Task, Vec<f64>>> = BTreeMap::new();
    for c in cells.iter().filter(|c| matches!(c.task, Task::Ruler(_))) {
        by.entry(c.length)
            .or_default()
            .entry(c.task)
            .or_default()
            .extend(&c.recall);
    }
    by.into_iter()
        .map(|(l, tasks)| {
            let means: Vec<f64> = tasks.values().map(|v| mean(v)).collect();
            (l, mean(&means))
        })
        .collect()
}

/// `ruler.csv`: RULER's score per length, whether it is above the effective-length
/// threshold, and (on every row) the effective length.
fn write_ruler(path: &Path, scores: &[(usize, f64)], effective: Option<usize>) -> Result<()> {
    let rows: Vec<Vec<String>> = scores
        .iter()
        .map(|(l, s)| {
            vec![
                l.to_string(),
                format!("{s:.4}"),
                ruler::EFFECTIVE_THRESHOLD.to_string(),
                (*s > ruler::EFFECTIVE_THRESHOLD).to_string(),
                effective.map_or("none".into(), |e| e.to_string()),
            ]
        })
        .collect();
    let header = ["length", "score", "threshold", "above", "effective_length"];
    atomic::write_csv(path, &header, &rows)
}

/// Every probe's target and generation (the harness's logged samples), one JSON object a
/// line, gzip-compressed (`zcat` reads it): the generations are most of a probe cell's record,
/// which a results folder keeps, and they compress about sevenfold.
pub(crate) const SAMPLES: &str = "probe_samples.jsonl.gz";

/// What an evaluation wrote before its samples were compressed, still read beside `SAMPLES`.
const PLAIN_SAMPLES: &str = "probe_samples.jsonl";

/// The probe samples in evaluation folder `dir` (`SAMPLES`, or the plain file of an earlier
/// evaluation), with the file read; None where there are none.
pub(crate) fn read_samples(dir: &Path) -> Result<Option<(PathBuf, String)>> {
    let gz = dir.join(SAMPLES);
    if gz.is_file() {
        let file =
            std::fs::File::open(&gz).with_context(|| format!("cannot open {}", gz.display()))?;
        let mut text = String::new();
        std::io::Read::read_to_string(&mut flate2::read::GzDecoder::new(file), &mut text)
            .with_context(|| {
                format!(
                    "{} is not gzip-compressed UTF-8 text (cut short?)",
                    gz.display()
                )
            })?;
        return Ok(Some((gz, text)));
    }
    let plain = dir.join(PLAIN_SAMPLES);
    match plain.is_file() {
        true => {
            let text = std::fs::read_to_string(&plain)
                .with_context(|| format!("cannot read {}", plain.display()))?;
            Ok(Some((plain, text)))
        }
        false => Ok(None),
    }
}

/// `SAMPLES`: a line per probe prompt.
fn write_samples(path: &Path, cells: &[ProbeCell]) -> Result<()> {
    let mut text = String::new();
    for c in cells {
        for (i, (target, generated)) in c.outputs.iter().enumerate() {
            let line = serde_json::json!({
                "task": c.task.name(), "length": c.length, "depth": c.depth, "sample": i,
                "target": target, "generated": generated, "exact_match": c.exact_match[i],
                "recall": c.recall[i],
            });
            text.push_str(&line.to_string());
            text.push('\n');
        }
    }
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    std::io::Write::write_all(&mut gz, text.as_bytes())?;
    atomic::write_bytes(path, &gz.finish()?)?;
    // An earlier evaluation's plain file would stay beside it and read as current.
    let stale = path.with_file_name(PLAIN_SAMPLES);
    match std::fs::remove_file(&stale) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("cannot remove {}", stale.display()))
        }
        _ => Ok(()),
    }
}

/// `probe_head_usage.csv`: per task, layer and head, the share of prompt positions whose gate
/// chose the full path (AHA Fig. 3 per task).
fn write_probe_head_usage(path: &Path, by_task: &BTreeMap<Task, HeadGates>) -> Result<()> {
    let mut rows = Vec::new();
    for (task, g) in by_task {
        for (l, heads) in g.usage().iter().enumerate() {
            for (h, mu) in heads.iter().enumerate() {
                rows.push(vec![
                    task.name().to_string(),
                    l.to_string(),
                    h.to_string(),
                    mu.to_string(),
                ]);
            }
        }
    }
    atomic::write_csv(path, &["task", "layer", "head", "mu_f"], &rows)
}

/// `niah.csv`: per (depth, length), RULER's accuracy (recall of the answers) and the mean
/// gate on the answer's queries, averaged over the tasks with a needle depth.
fn write_niah(path: &Path, cells: &[ProbeCell]) -> Result<()> {
    let mut acc: BTreeMap<(usize, u64), (Vec<f64>, Vec<f64>)> = BTreeMap::new();
    for c in cells {
        let Some(d) = c.depth else { continue };
        let e = acc.entry((c.length, d.to_bits())).or_default();
        e.0.extend(&c.recall);
        e.1.extend(c.full_ratio.iter().flatten());
    }
    if acc.is_empty() {
        return Ok(());
    }
    let mut rows: Vec<(f64, usize, f64, Option<f64>)> = acc
        .into_iter()
        .map(|((l, d), (a, f))| {
            (
                f64::from_bits(d),
                l,
                mean(&a),
                (!f.is_empty()).then(|| mean(&f)),
            )
        })
        .collect();
    rows.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    atomic::write_with(path, |tmp| {
        let mut w = csv::Writer::from_path(tmp)?;
        w.write_record(["depth", "length", "accuracy", "full_ratio"])?;
        for (d, l, a, f) in rows {
            w.write_record([
                d.to_string(),
                l.to_string(),
                a.to_string(),
                f.map(|f| f.to_string()).unwrap_or_default(),
            ])?;
        }
        w.flush()?;
        Ok(())
    })
}

/// `efficiency.csv`: per prompt length (over the probe tasks), keys attended per query and
/// head and layer in prefill, FLOPs per prompt token, keys read per generated token, cache
/// bytes per sequence, each beside full causal attention's, and measured times.
fn write_efficiency(
    path: &Path,
    costs: &BTreeMap<(Task, usize), Cost>,
    cfg: &Config,
    device: Device,
) -> Result<()> {
    let mut by_len: BTreeMap<usize, Cost> = BTreeMap::new();
    for c in costs.values() {
        let t = by_len.entry(c.length).or_default();
        t.length = c.length;
        t.add(c);
    }
    let m = &cfg.model;
    let (layers, heads, hd) = (
        m.num_hidden_layers as f64,
        m.num_attention_heads as f64,
        m.head_dim() as f64,
    );
    let header = [
        "length",
        "probes",
        "prefill_keys_per_query",
        "full_causal_keys_per_query",
        "prefill_flops_per_token",
        "full_causal_flops_per_token",
        "decode_keys_per_token",
        "full_causal_decode_keys_per_token",
        "kv_cache_bytes",
        "kv_cache_bytes_full",
        "ttft_ms",
        "decode_tokens_per_s",
        "device",
    ];
    atomic::write_with(path, |tmp| {
        let mut w = csv::Writer::from_path(tmp)?;
        w.write_record(header)?;
        for c in by_len.values() {
            let l = c.length as f64;
            let queries = c.rows as f64 * l * layers * heads;
            let decoded = c.decode_tokens.max(1) as f64;
            w.write_record([
                c.length.to_string(),
                c.rows.to_string(),
                (c.prefill_pairs / queries).to_string(),
                ((l + 1.0) / 2.0).to_string(),
                (4.0 * hd * c.prefill_pairs / (c.rows as f64 * l)).to_string(),
                (4.0 * hd * layers * heads * (l + 1.0) / 2.0).to_string(),
                (c.decode_pairs / (decoded * layers * heads)).to_string(),
                (c.full_decode_keys / decoded).to_string(),
                (c.cache_bytes / c.rows as f64).to_string(),
                (c.full_cache_bytes / c.rows as f64).to_string(),
                (1000.0 * c.prefill_seconds / c.batches as f64).to_string(),
                (c.decode_tokens as f64 / c.decode_seconds).to_string(),
                format!("{device:?}"),
            ])?;
        }
        w.flush()?;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::attention::ForwardCtx;
    use crate::run::generate::greedy;
    use tch::{Kind, Tensor};

    /// A journal of its own for a test that probes without an evaluation's folder.
    fn scratch_journal() -> Journal {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let d = std::env::temp_dir().join(format!("attnsweep-probes-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let p = d.join(format!("journal-{n}.jsonl"));
        let _ = std::fs::remove_file(&p);
        Journal::open(&p, "test").unwrap()
    }
    use crate::config::Method;
    use crate::config::ModelConfig;
    use crate::data::BYTE_EOT;
    use crate::run::choice::{choice_logliks, encode_pair, rstripped_len, McItem};
    use crate::run::Built;
    use crate::util;

    fn tiny() -> Built {
        Built::new(&tiny_config(), Device::Cpu).unwrap()
    }

    fn tiny_config() -> Config {
        let mut c = Config::default();
        c.model = ModelConfig {
            vocab_size: 257,
            hidden_size: 16,
            intermediate_size: 32,
            num_hidden_layers: 2,
            num_attention_heads: 2,
            num_key_value_heads: 1,
            ..Default::default()
        };
        c.train.device = "cpu".into();
        c
    }

    /// Sum of log p(ids[t + 1] | ids[..=t]) over the last `n` targets, from one unpadded
    /// forward pass and an explicit log-softmax.
    fn by_hand(b: &Built, ids: &[u8], n: usize) -> f64 {
        let x: Vec<i64> = ids.iter().map(|&t| t as i64).collect();
        let logits = tch::no_grad(|| {
            b.model
                .forward(
                    &Tensor::from_slice(&x).view([1, -1]),
                    &ForwardCtx::default(),
                )
                .logits
                .to_kind(Kind::Double)
        });
        let mut total = 0.0;
        for t in ids.len() - 1 - n..ids.len() - 1 {
            let row: Vec<f64> = Vec::try_from(logits.get(0).get(t as i64)).unwrap();
            let max = row.iter().cloned().fold(f64::MIN, f64::max);
            let lse = max + row.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
            total += row[x[t + 1] as usize] - lse;
        }
        total
    }

    #[test]
    fn multiple_choice_matches_hand_computation() {
        let b = tiny();
        let tok = TextTokenizer::Bytes;
        let item = McItem {
            context: "the cat ".into(),
            choices: vec!["sat".into(), "jumped high".into(), "x".into()],
            gold: 1,
            target_delimiter: " ".into(),
        };
        // The context's trailing space moves to the continuation: "the cat" + "  sat".
        let hand: Vec<f64> = item
            .choices
            .iter()
            .map(|c| {
                let cont = format!("  {c}");
                by_hand(&b, format!("the cat{cont}").as_bytes(), cont.len())
            })
            .collect();
        let got = choice_logliks(&b.model, &tok, &item, 64, Device::Cpu, 0).unwrap();
        for (g, h) in got.iter().zip(&hand) {
            assert!((g.loglik - h).abs() < 1e-5, "{g:?} vs {h}");
        }
        let argmax = |v: &[f64]| (0..v.len()).max_by(|&a, &c| v[a].total_cmp(&v[c])).unwrap();
        let norm: Vec<f64> = hand
            .iter()
            .zip(&item.choices)
            .map(|(l, c)| l / c.len() as f64)
            .collect();
        let r = score_mc(
            &b.model,
            &tok,
            std::slice::from_ref(&item),
            64,
            Device::Cpu,
            0,
            false,
        )
        .unwrap();
        assert_eq!(r[0].acc, (argmax(&hand) == 1) as u8 as f64);
        assert_eq!(r[0].acc_norm, (argmax(&norm) == 1) as u8 as f64);
        assert_eq!(
            (r[0].prediction, r[0].prediction_norm),
            (argmax(&hand), argmax(&norm))
        );

        // A window of 6 tokens keeps the end of the context: 5 inputs and the last target.
        let long = McItem {
            context: "the cat sat on the mat".into(),
            choices: vec!["a".into(), "bc".into()],
            gold: 0,
            target_delimiter: " ".into(),
        };
        let got = choice_logliks(&b.model, &tok, &long, 6, Device::Cpu, 0).unwrap();
        let ids = b"the cat sat on the mat bc";
        assert!((got[1].loglik - by_hand(&b, &ids[ids.len() - 7..], 3)).abs() < 1e-5);
        assert!(
            choice_logliks(&b.model, &tok, &long, 3, Device::Cpu, 0).is_err(),
            "continuation longer than the window"
        );
    }

    /// A static-heads model fixes which heads are full, so the prompts' head usage must be
    /// that assignment exactly, over every row and prompt position.
    #[test]
    fn prompt_head_usage_is_the_fixed_assignment_of_static_heads() {
        let dir =
            std::env::temp_dir().join(format!("attnsweep-probe-heads-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ranking = dir.join("head_ranking.csv");
        std::fs::write(
            &ranking,
            "rank,layer,head,mu_f\n1,1,0,0.9\n2,0,1,0.5\n3,0,0,0.1\n4,1,1,0.0\n",
        )
        .unwrap();
        let mut c = tiny_config();
        c.attention.method = Method::StaticHeads;
        c.attention.window = 2;
        c.attention.head_ranking = ranking;
        c.attention.top_k = 2;
        let b = Built::new(&c, Device::Cpu).unwrap();
        let prompts = Tensor::from_slice(&[5i64, 9, 2, 7, 1, 3, 8, 4, 6, 2, 5, 1]).view([2, 6]);
        let g = greedy(&b.model, &prompts, 3, None, &ForwardCtx::default(), false);
        let hg = g.prompt_gates.expect("a routed model reports its gates");
        assert_eq!(hg.positions, 12.0);
        assert_eq!(hg.usage(), vec![vec![0.0, 1.0], vec![1.0, 0.0]]);
        assert!(greedy(
            &tiny().model,
            &prompts,
            1,
            None,
            &ForwardCtx::default(),
            false
        )
        .prompt_gates
        .is_none());
    }

    /// The tiny model of `method` probed with three passkeys at depth 0.5 of 512 tokens.
    fn passkey_config(method: Method) -> Config {
        let mut c = tiny_config();
        c.attention.method = method;
        c.data.seq_len = 512;
        c.eval.tasks = vec!["passkey".into()];
        c.eval.lengths = vec![512];
        c.eval.depths = vec![0.5];
        c.eval.samples = 3;
        c
    }

    /// `eval.samples` prompts per (task, length) spread over the depths in turn, and fewer
    /// prompts than depths leave the last without a cell.
    #[test]
    fn a_cells_prompts_are_spread_over_the_depths() {
        let mut c = passkey_config(Method::Full);
        c.eval.depths = vec![0.25, 0.75, 1.0];
        c.eval.samples = 5;
        let b = Built::new(&c, Device::Cpu).unwrap();
        let run = |c: &Config| {
            run_probes(
                &b.model,
                c,
                &TextTokenizer::Bytes,
                &Haystack::Noise,
                Device::Cpu,
                false,
                &mut scratch_journal(),
            )
            .unwrap()
        };
        let cells = run(&c).cells;
        let shape: Vec<(Option<f64>, usize)> =
            cells.iter().map(|c| (c.depth, c.recall.len())).collect();
        assert_eq!(shape, [(Some(0.25), 2), (Some(0.75), 2), (Some(1.0), 1)]);
        c.eval.samples = 2;
        let depths: Vec<Option<f64>> = run(&c).cells.iter().map(|c| c.depth).collect();
        assert_eq!(depths, [Some(0.25), Some(0.75)]);
    }

    /// A journal written before the prompts' gate was measured resumes without it: one such
    /// batch drops the metric from the whole evaluation, not from that batch's prompts alone,
    /// and leaves every other score as the journal holds it.
    #[test]
    fn a_journal_without_the_prompts_gate_drops_it_everywhere() {
        let mut c = passkey_config(Method::Aha);
        c.attention.window = 4;
        c.eval.samples = 4;
        c.eval.batch_size = 2;
        let b = Built::new(&c, Device::Cpu).unwrap();
        let mut journal = scratch_journal();
        let path = journal.path().to_path_buf();
        let run = |journal: &mut Journal| {
            let tok = TextTokenizer::Bytes;
            run_probes(
                &b.model,
                &c,
                &tok,
                &Haystack::Noise,
                Device::Cpu,
                false,
                journal,
            )
            .unwrap()
        };
        let first = run(&mut journal);
        assert!(first.cells.iter().all(|c| c.prompt_gate.is_some()));
        // The first batch as an earlier binary wrote it: its rows without the field.
        let text = std::fs::read_to_string(&path).unwrap();
        let mut lines: Vec<String> = text.lines().map(String::from).collect();
        let mut line: serde_json::Value = serde_json::from_str(&lines[1]).unwrap();
        for row in line["record"]["rows"].as_array_mut().unwrap() {
            assert!(row.as_object_mut().unwrap().remove("prompt_gate").is_some());
        }
        lines[1] = line.to_string();
        std::fs::write(&path, lines.join("\n") + "\n").unwrap();
        let again = run(&mut Journal::open(&path, "test").unwrap());
        assert!(again.cells.iter().all(|c| c.prompt_gate.is_none()));
        let recall = |r: &ProbeRun| -> Vec<Vec<f64>> {
            r.cells
                .iter()
                .map(|c| c.span_recall.clone().unwrap())
                .collect()
        };
        assert_eq!(recall(&again), recall(&first));
    }

    /// The oracle's gates open exactly a probe's needles and question in every layer and head
    /// (span recall 1), whatever the router learned; a model's own gates report where they
    /// fall on the same spans; probes differ with the replicate's seed; and a model without
    /// gates is refused the oracle.
    #[test]
    fn the_oracle_opens_the_needles_and_the_question() {
        let mut c = passkey_config(Method::Aha);
        c.attention.window = 4;
        let b = Built::new(&c, Device::Cpu).unwrap();
        let tok = TextTokenizer::Bytes;
        let run = |c: &Config| {
            run_probes(
                &b.model,
                c,
                &tok,
                &Haystack::Noise,
                Device::Cpu,
                false,
                &mut scratch_journal(),
            )
            .unwrap()
        };
        // The router starts open everywhere (sigmoid(1) > tau): its own span recall is 1 too.
        let learned = run(&c);
        let own = learned.cells[0]
            .span_recall
            .clone()
            .expect("a routed model");
        assert!(own.iter().all(|&r| (0.0..=1.0).contains(&r)), "{own:?}");
        let mut oracle_cfg = c.clone();
        oracle_cfg.eval.gates = ProbeGates::Oracle;
        let oracle = run(&oracle_cfg);
        assert_eq!(oracle.cells[0].span_recall.clone().unwrap(), vec![1.0; 3]);
        // Read against the gates' rate over each whole prompt: every gate open for the
        // untrained router; for the oracle the spans' share, a fraction whose mean over the
        // three prompts (all of one length) is each head's usage over them.
        assert_eq!(learned.cells[0].prompt_gate.clone().unwrap(), vec![1.0; 3]);
        let gate = oracle.cells[0].prompt_gate.clone().unwrap();
        let heads = oracle.head_gates[&Task::parse("passkey").unwrap()].usage();
        let mean = gate.iter().sum::<f64>() / 3.0;
        assert!(gate.iter().all(|&g| g > 0.0 && g < 0.5), "{gate:?}");
        assert!(
            heads.iter().flatten().all(|&u| (u - mean).abs() < 1e-6),
            "{mean} {heads:?}"
        );
        // The oracle's usage over the prompts: the spans' share, well under every gate.
        let usage = &oracle.head_gates[&Task::parse("passkey").unwrap()].usage();
        assert!(
            usage.iter().flatten().all(|&u| u > 0.0 && u < 0.5),
            "{usage:?}"
        );
        // Another replicate draws other prompts.
        let mut other = c.clone();
        other.train.seed += 1;
        let targets = |r: &ProbeRun| -> Vec<String> {
            r.cells[0].outputs.iter().map(|o| o.0.clone()).collect()
        };
        assert_ne!(targets(&run(&other)), targets(&learned));
        let mut plain = tiny_config();
        plain.eval = oracle_cfg.eval.clone();
        let meta = crate::data::Meta {
            tokenizer: "byte".into(),
            eot_token: Some(256),
            ..crate::data::Meta::of_tokenizer(257)
        };
        let e = preflight(&plain, &meta, None).unwrap_err();
        assert!(
            format!("{e:#}").contains("eval.gates = \"oracle\""),
            "{e:#}"
        );
    }

    /// On the GPU, through the kernels, the oracle's gates open exactly the probes' spans for
    /// every routed method (span recall 1), and the usage they give over the prompts is the CPU
    /// reference path's to the last digit: what a kernel reads is the mask the spans make.
    #[test]
    #[ignore = "needs a CUDA GPU and the kernel library: run with --ignored on a GPU machine"]
    fn the_oracle_opens_on_the_gpu_what_it_opens_on_the_cpu() {
        use crate::config::{AttnImpl, Dtype};
        let name = "the_oracle_opens_on_the_gpu_what_it_opens_on_the_cpu";
        crate::model::kernels::tests::on_cuda(name, |_| {
            for method in [Method::Aha, Method::L2a, Method::Swiattn] {
                let mut c = passkey_config(method);
                c.model.hidden_size = 128;
                c.model.num_key_value_heads = 2;
                c.attention.window = 16;
                c.eval.gates = ProbeGates::Oracle;
                let usage = |c: &Config, dev: Device| {
                    let b = Built::new(c, dev).unwrap();
                    let tok = TextTokenizer::Bytes;
                    let r = run_probes(
                        &b.model,
                        c,
                        &tok,
                        &Haystack::Noise,
                        dev,
                        false,
                        &mut scratch_journal(),
                    )
                    .unwrap();
                    let recall = r.cells[0].span_recall.clone().expect("a routed model");
                    assert_eq!(recall, vec![1.0; 3], "{method:?} on {dev:?}");
                    r.head_gates[&Task::parse("passkey").unwrap()].usage()
                };
                let cpu = usage(&c, Device::Cpu);
                let mut gpu = c.clone();
                gpu.train.device = "cuda".into();
                gpu.train.dtype = Dtype::Bf16;
                gpu.attention.attn_impl = AttnImpl::Cuda;
                assert_eq!(usage(&gpu, Device::Cuda(0)), cpu, "{method:?}");
            }
        });
    }

    /// is_greedy: true exactly when every continuation token is the model's argmax.
    #[test]
    fn greedy_flag_follows_the_argmax() {
        let b = tiny();
        let tok = TextTokenizer::Bytes;
        let x = Tensor::from_slice(&[b'a' as i64]).view([1, 1]);
        let next = tch::no_grad(|| b.model.forward(&x, &ForwardCtx::default()).logits)
            .argmax(-1, false)
            .int64_value(&[0, 0]) as u8;
        let other = if next == b'z' { b'y' } else { b'z' };
        let item = McItem {
            context: "a".into(),
            choices: vec![(next as char).to_string(), (other as char).to_string()],
            gold: 0,
            target_delimiter: String::new(),
        };
        let s = choice_logliks(&b.model, &tok, &item, 16, Device::Cpu, 0).unwrap();
        assert!(s[0].greedy && !s[1].greedy, "{s:?}");
    }

    /// An empty context's prefix is the BOS the tokenizer's config declares, as the harness's
    /// `bos_token_id`, even where the tokenizer adds none before a text (SmolLM2); without a
    /// declaration, its end of text.
    #[test]
    fn an_empty_context_follows_the_declared_bos() {
        let dir = util::scratch_dir("mc-declared-bos");
        let bos = std::fs::read_to_string(bos_tokenizer_path()).unwrap();
        let start = bos.find(r#""post_processor""#).unwrap();
        let end = bos.find(r#""decoder""#).unwrap();
        let path = dir.join("tokenizer.json");
        std::fs::write(&path, format!("{}{}", &bos[..start], &bos[end..])).unwrap();
        let tok = TextTokenizer::hf(&path).unwrap();
        assert_eq!((tok.bos(), tok.declared("bos_token")), (None, None));
        assert_eq!(encode_pair(&tok, "", "the").unwrap(), (vec![1], vec![2]));
        let config = dir.join("tokenizer_config.json");
        std::fs::write(&config, r#"{"bos_token": {"content": "<s>"}}"#).unwrap();
        let tok = TextTokenizer::hf(&path).unwrap();
        assert_eq!(tok.declared("bos_token"), Some(0));
        assert_eq!(encode_pair(&tok, "", "the").unwrap(), (vec![0], vec![2]));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A tokenizer.json of whole words whose post-processor puts `<s>` before a text, as
    /// Llama's does.
    fn bos_tokenizer() -> TextTokenizer {
        TextTokenizer::hf(&bos_tokenizer_path()).unwrap()
    }

    fn bos_tokenizer_path() -> std::path::PathBuf {
        let dir = util::scratch_dir("mc-bos");
        let path = dir.join("tokenizer.json");
        let vocab: Vec<String> = ["<s>", "</s>", "the", "cat", "sat", "on", "mat"]
            .iter()
            .enumerate()
            .map(|(i, w)| format!("\"{w}\": {i}"))
            .collect();
        let json = format!(
            r#"{{"version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [
              {{"id": 0, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}},
              {{"id": 1, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}}],
            "normalizer": null, "pre_tokenizer": {{"type": "WhitespaceSplit"}},
            "post_processor": {{"type": "TemplateProcessing",
              "single": [{{"SpecialToken": {{"id": "<s>", "type_id": 0}}}}, {{"Sequence": {{"id": "A", "type_id": 0}}}}],
              "pair": [{{"SpecialToken": {{"id": "<s>", "type_id": 0}}}}, {{"Sequence": {{"id": "A", "type_id": 0}}}}, {{"Sequence": {{"id": "B", "type_id": 1}}}}],
              "special_tokens": {{"<s>": {{"id": "<s>", "ids": [0], "tokens": ["<s>"]}}}}}},
            "decoder": null,
            "model": {{"type": "WordLevel", "vocab": {{{}}}, "unk_token": "</s>"}}}}"#,
            vocab.join(", ")
        );
        std::fs::write(&path, json).unwrap();
        path
    }

    /// The harness's encodings (lm-evaluation-harness 0.4.9.2 and later, by default): special
    /// tokens on both the pair and the context, none when a text already starts with the BOS;
    /// BOS as the prefix of an empty context, before the continuation without special tokens
    /// (never two BOS); trailing whitespace as Python's rstrip sees it.
    #[test]
    fn pairs_are_encoded_as_the_harness_encodes_them() {
        let tok = bos_tokenizer();
        assert_eq!(tok.bos(), Some(0));
        assert_eq!(
            encode_pair(&tok, "the cat ", "sat").unwrap(),
            (vec![0, 2, 3], vec![4])
        );
        assert_eq!(
            encode_pair(&tok, "<s> the cat", " sat").unwrap(),
            (vec![0, 2, 3], vec![4])
        );
        assert_eq!(
            encode_pair(&tok, "", "the cat").unwrap(),
            (vec![0], vec![2, 3])
        );
        assert_eq!(
            encode_pair(&tok, "", "<s> the").unwrap(),
            (vec![0], vec![2])
        );
        // Byte-level: no BOS; an empty context is the end-of-text token.
        let bytes = TextTokenizer::Bytes;
        assert_eq!(bytes.bos(), None);
        assert_eq!(
            encode_pair(&bytes, "", "ab").unwrap(),
            (vec![BYTE_EOT], vec![97, 98])
        );
        // Python's str.rstrip also strips the separators U+001C..U+001F.
        assert_eq!(
            encode_pair(&bytes, "a\u{1c}\u{1f} ", "b").unwrap(),
            (vec![97], vec![0x1c, 0x1f, 32, 98])
        );
        for (s, n) in [
            ("x\u{85}\u{a0}\u{3000}\t", 1),
            ("x\u{200b}", 4),
            ("\u{1d}", 0),
        ] {
            assert_eq!(rstripped_len(s), n, "{s:?}");
        }
    }

    /// Items the harness could not score are refused, each with its own reason.
    #[test]
    fn unscorable_items_are_refused() {
        let dir = util::scratch_dir("mc-bad");
        let p = dir.join("t.jsonl");
        for (line, says) in [
            (
                r#"{"context": "a", "choices": [], "gold": 0}"#,
                "no choices",
            ),
            (
                r#"{"context": "a", "choices": ["b", ""], "gold": 0}"#,
                "choice 1 is empty",
            ),
            (
                r#"{"context": "a", "choices": ["b", "c"], "gold": 2}"#,
                "gold = 2",
            ),
        ] {
            std::fs::write(&p, line).unwrap();
            let e = format!("{:#}", read_mc(&p).unwrap_err());
            assert!(e.contains(says) && e.contains("line 1"), "{e}");
        }
    }

    #[test]
    fn malformed_multiple_choice_lines_are_named() {
        let dir = std::env::temp_dir().join(format!("attnsweep-mc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("t.jsonl");
        std::fs::write(&p, "{\"context\": \"a\", \"choices\": [\"b\", \"c\"], \"gold\": 0}\n\n{\"context\": \"a\", \"choices\": [\"b\"], \"gold\": 0}\n").unwrap();
        let e = format!("{:#}", read_mc(&p).unwrap_err());
        assert!(
            e.contains("line 3") && e.contains("at least 2 choices"),
            "{e}"
        );
        std::fs::write(&p, "{\"context\": \"a\", \"answers\": []}\n").unwrap();
        assert!(format!("{:#}", read_mc(&p).unwrap_err()).contains("line 1"));
        std::fs::write(
            &p,
            "{\"context\": \"a\", \"choices\": [\"b\", \"c\"], \"gold\": 1}\n",
        )
        .unwrap();
        assert_eq!(read_mc(&p).unwrap()[0].target_delimiter, " ");
    }

    #[test]
    fn harness_stderr_uses_the_sample_deviation() {
        let v = [1.0, 0.0, 1.0, 1.0];
        let m: f64 = 0.75;
        let sd = ((3.0 * (1.0 - m).powi(2) + m.powi(2)) / 3.0).sqrt();
        assert!((stderr(&v) - sd / 2.0).abs() < 1e-12);
        assert!(stderr(&[1.0]).is_nan());
    }
}
