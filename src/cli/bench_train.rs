//! `attnsweep bench train`: whole training steps (forward, backward, clipping, AdamW) of one
//! model shape (a preset, a Hugging Face `config.json`, or a custom shape from the flags) per
//! method variant and length, beside the same model in plain PyTorch
//! (`kernels/train_peer.py`: eager, and compiled with FlexAttention block masks for the
//! sparse methods), timed in one run. Best against best: the tokens of an optimizer step are
//! fixed, and each side tries micro-batches of the step's sequences and of halves of them
//! (`--micro-batches`), the gradients accumulated over them, each with the checkpointing that
//! fits (ours: the memory plan training uses, `run/memory.rs`, with the loss's chunks; the
//! peer's: as written, else every block checkpointed and the loss in chunks); the fastest is
//! the row, its setup naming the choice and every try. Ours report their peak memory beside
//! the plan's prediction; every row gives its model-FLOPs utilisation.
//!
//! Rows accumulate in `train_bench.csv` across runs into one directory (a case measured again
//! replaces its row, the others stay; a case is the method with the settings it reads: window,
//! gates' usage, PPA's power), and `train_bench_<model>.png/svg` plots them all:
//! tokens/s and peak memory against the length, a line per (implementation, method).

use super::bench::{check_lengths, joined, run_peer};
use super::bench_methods::{calibrate_routers, method_config, TrainMethod};
use super::panics::{caught, last_panic};
use super::profile;
use crate::config::{Checkpointing, Config, ModelConfig};
use crate::model::attention::{BenchKnobs, ForwardCtx};
use crate::model::kernels;
use crate::model::step::forward_backward;
use crate::model::step_graph::{CtxKey, StepGraph};
use crate::run::memory::{self, GIB};
use crate::run::optim::AdamW;
use crate::run::Built;
use crate::util::atomic;
use crate::util::flags::each_once;
use crate::util::stats::median;
use anyhow::{bail, ensure, Context, Result};
use figure::figure;
use row::{combine_runs, known_header, optional_number, reads_power, TrainRow, HEADER, OURS};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;
use tch::{Device, Kind, Tensor};

mod figure;
mod row;

pub(crate) struct TrainBench {
    pub(crate) lengths: Vec<i64>,
    /// Tokens per step; the batch is `tokens / L` (at least 1).
    pub(crate) tokens: i64,
    pub(crate) methods: Vec<TrainMethod>,
    /// The model's name in the CSV (the preset, the config's path, or `custom-l..-d..` from
    /// the shape flags).
    pub(crate) model_name: String,
    pub(crate) model: ModelConfig,
    pub(crate) window: usize,
    /// Fraction of the gates open: AHA's (token, head), SwiAttn's and L2A's token gates.
    pub(crate) full_usage: f64,
    /// `attention.ste_sample` of the aha-sampled rows.
    pub(crate) ste_sample: f64,
    /// `attention.ppa_power` of the ppa rows.
    pub(crate) ppa_power: f64,
    /// `train.activation_checkpointing` of our cases.
    pub(crate) checkpointing: Checkpointing,
    /// `train.loss_chunk_tokens` of our cases.
    pub(crate) loss_chunk_tokens: usize,
    /// Micro-batches each side tries for a step's tokens: the step's sequences, then halves
    /// of them, this many at most; the fastest that fits is the row (1: the step at once).
    pub(crate) micro_batches: usize,
    pub(crate) steps: usize,
    pub(crate) warmup: usize,
    pub(crate) out: PathBuf,
    pub(crate) python: String,
    /// Plain-PyTorch peers run beside: "eager", "compile" (`torch.compile`), or none.
    pub(crate) peers: Vec<String>,
    /// torch.compile's modes the compiled peer tries (its search's third dimension).
    pub(crate) peer_modes: Vec<String>,
    /// One more step of each case (ours and the peers') under PyTorch's profiler: its trace in
    /// `out/profiles/`, summed by kernel and by kind (`profile::summarise`).
    pub(crate) profile: bool,
    /// Runs of the whole bench, ours and the peers' alternating which goes first: each case's
    /// row the mean of its runs, with every run's time and the paired ratio's interval.
    pub(crate) repeats: usize,
}

impl TrainBench {
    /// The flags, checked before anything runs or is written.
    pub(crate) fn validate(&self) -> Result<()> {
        check_lengths(&self.lengths)?;
        ensure!(
            !self.methods.is_empty(),
            "--methods needs at least one method"
        );
        ensure!(self.tokens >= 1, "--tokens must be at least 1");
        ensure!(self.window >= 1, "--window must be at least 1");
        ensure!(
            self.full_usage > 0.0 && self.full_usage < 1.0,
            "--full-usage must lie strictly between 0 and 1 (got {})",
            self.full_usage
        );
        ensure!(
            self.ste_sample > 0.0 && self.ste_sample <= 1.0,
            "--ste-sample must lie in (0, 1] (got {})",
            self.ste_sample
        );
        ensure!(self.steps >= 1, "--steps must be at least 1");
        ensure!(
            (1..=20).contains(&self.repeats),
            "--repeats must be 1 to 20 (got {})",
            self.repeats
        );
        ensure!(
            !(self.profile && self.repeats > 1),
            "--profile traces one run: give --repeats 1 with it"
        );
        let names: Vec<&str> = self.methods.iter().map(|m| m.name()).collect();
        each_once("--methods", &names)?;
        ensure!(
            self.micro_batches >= 1,
            "--micro-batches must be at least 1"
        );
        ensure!(
            (0.0..=1.0).contains(&self.ppa_power),
            "--ppa-power must lie in [0, 1] (got {})",
            self.ppa_power
        );
        for p in &self.peers {
            ensure!(
                p == "eager" || p == "compile",
                "--peers takes eager and compile (got {p:?})"
            );
        }
        const MODES: [&str; 3] = ["default", "max-autotune-no-cudagraphs", "reduce-overhead"];
        ensure!(!self.peer_modes.is_empty(), "--peer-modes is empty");
        if let Some(m) = self
            .peer_modes
            .iter()
            .find(|m| !MODES.contains(&m.as_str()))
        {
            bail!("--peer-modes takes {} (got {m:?})", MODES.join(", "));
        }
        each_once("--peer-modes", &self.peer_modes)?;
        self.model.validate()?;
        ensure!(
            self.model.vocab_size >= 2,
            "the model's vocabulary must hold at least 2 tokens"
        );
        Ok(())
    }
}

impl TrainBench {
    fn config(&self, method: TrainMethod, len: i64) -> Config {
        let knobs = BenchKnobs {
            full_usage: self.full_usage,
            ste_sample: self.ste_sample,
        };
        let mut c = method_config(&self.model, method, &knobs, self.window, self.ppa_power);
        c.data.seq_len = len as usize;
        c.train.batch_size = self.batch(len) as usize;
        c.train.activation_checkpointing = self.checkpointing;
        c.train.loss_chunk_tokens = self.loss_chunk_tokens;
        c
    }

    /// Our training step for one method and length at its best: for each micro-batch the
    /// search tries (`micro_batches`), the memory plan training would use (checkpointing and
    /// the loss's chunks that fit), timed; the fastest is the row, its setup naming the
    /// choice and every try.
    fn measure(
        &self,
        method: TrainMethod,
        len: i64,
        kern: &'static kernels::Kernels,
    ) -> Result<TrainRow> {
        let cfg = self.config(method, len);
        let built = Built::new(&cfg, Device::Cuda(0))?;
        if method.variant.calibrate_router {
            calibrate_routers(&built, self.full_usage, len);
        }
        let name = method.name();
        let mut best: Option<(f64, (i64, bool), TrainRow)> = None;
        let mut tried = Vec::new();
        // The whole step in one pass also runs as a captured CUDA graph (`StepGraph`), captured
        // in the second warm-up step.
        let graphs = self.warmup >= 2;
        let batch = self.batch(len);
        let tries = self.micro_batch_sizes(len).into_iter().flat_map(|m| {
            [(m, false)]
                .into_iter()
                .chain((graphs && m == batch).then_some((m, true)))
        });
        for (micro, graph) in tries {
            let label = format!("{micro}{}", if graph { " graphed" } else { "" });
            // A micro-batch that does not fit (refused by the plan, or out of memory) is
            // recorded and the search goes on.
            match caught(|| self.time_steps(&built, &cfg, name, micro, graph, kern, None)) {
                Ok(row) => {
                    let ms = row.step_ms.unwrap_or(f64::INFINITY);
                    tried.push(format!("{label}: {ms:.1} ms"));
                    if best.as_ref().is_none_or(|(b, ..)| ms < *b) {
                        best = Some((ms, (micro, graph), row));
                    }
                }
                Err(why) => tried.push(format!("{label}: {}", short(&why))),
            }
        }
        let tried = tried.join(" / ");
        let Some((_, (micro, graph), mut row)) = best else {
            bail!("no micro-batch ran: {tried}");
        };
        // After the timed steps, so the profiler's cost is in none of them.
        if self.profile {
            let trace = PathBuf::from(format!(
                "{}_{OURS}_{}_L{len}.json",
                self.trace_stem().display(),
                method.name()
            ));
            // One more run of the chosen micro-batch, the profiled step after it: a failure
            // leaves the measured row, with why in its note.
            row.note =
                caught(|| self.time_steps(&built, &cfg, name, micro, graph, kern, Some(&trace)))
                    .map_or_else(|why| format!("no profile: {why}"), |r| r.note);
        }
        row.setup = format!("{}; tried {tried}", row.setup);
        Ok(row)
    }

    /// Median step time of `built` at micro-batches of `micro` sequences (the step's tokens
    /// accumulated over them) under the memory plan training would use, with its peak
    /// memory; `graph` (one micro-batch a step): after the first warm-up step, the forward
    /// and backward captured as a CUDA graph and replayed. With `profile`, one more step
    /// under the profiler, its trace there.
    #[allow(clippy::too_many_arguments)]
    fn time_steps(
        &self,
        built: &Built,
        cfg: &Config,
        method: &str,
        micro: i64,
        graph: bool,
        kern: &'static kernels::Kernels,
        profile: Option<&Path>,
    ) -> Result<TrainRow> {
        let (batch, len) = (cfg.train.batch_size as i64, cfg.data.seq_len as i64);
        let mut cfg = cfg.clone();
        cfg.train.batch_size = micro as usize;
        cfg.train.grad_accum = (batch / micro) as usize;
        let params = built.params();
        let trained: Vec<Tensor> = params.values().map(|p| p.shallow_clone()).collect();
        let plan = memory::plan_on_device(&cfg, &built.model, &trained, kern, 0)?;
        let mut opt = AdamW::new(&params, built.model.kernels);
        let ids = Tensor::randint(
            self.model.vocab_size as i64,
            [batch, len + 1],
            (Kind::Int64, Device::Cuda(0)),
        );
        let ctx = ForwardCtx {
            compute_logits: true,
            ..Default::default()
        };
        let accum = cfg.train.grad_accum;
        ensure!(
            !graph || accum == 1,
            "a captured step runs the whole step in one micro-batch"
        );
        ensure!(
            !graph || self.warmup >= 2,
            "a captured step needs an eager warm-up step and its capture before the timed \
             ones (--warmup 2 or more)"
        );
        let graphed: Vec<Tensor> = trained
            .iter()
            .filter(|p| p.requires_grad())
            .map(Tensor::shallow_clone)
            .collect();
        // Every try keeps the sequence's masks and angles, which a captured step needs: the
        // eager and captured steps differ in the capture alone.
        built.model.pin_sequence(len, Device::Cuda(0));
        let key = CtxKey::of(&ctx, cfg.attention.draws_gates())
            .context("the bench's forward options cannot be captured")?;
        let mut captured: Option<StepGraph> = None;
        let mut step = |warm: bool| -> Result<Vec<f64>> {
            let mut usage = Vec::new();
            let rows = |i: i64| {
                let rows = ids.narrow(0, i * micro, micro);
                (rows.narrow(1, 0, len), rows.narrow(1, 1, len))
            };
            match (&captured, graph && warm) {
                (Some(g), _) => {
                    let (x, y) = rows(0);
                    usage.extend(g.run(&x, &y, &key)?.full_usage);
                }
                (None, true) => {
                    let (x, y) = rows(0);
                    let g = StepGraph::capture(
                        kern,
                        &built.model,
                        &graphed,
                        &x,
                        &y,
                        &ctx,
                        key.clone(),
                        &plan.step,
                    )?;
                    usage.extend(g.run(&x, &y, &key)?.full_usage);
                    captured = Some(g);
                }
                (None, false) => {
                    opt.zero_grad();
                    for i in 0..accum as i64 {
                        let (x, y) = rows(i);
                        let stats =
                            forward_backward(&built.model, &x, &y, &ctx, &plan.step, accum).read();
                        usage.extend(stats.full_usage);
                    }
                }
            }
            opt.clip_grad_norm(cfg.train.grad_clip);
            // Learning rate 0: the same arithmetic, and the gate pattern stays as calibrated.
            opt.update(0.0, &cfg.train);
            tch::Cuda::synchronize(0);
            Ok(usage)
        };
        let (mut times, mut usage) = (Vec::new(), Vec::new());
        // The peak from the capture on, for a graph: its pool is allocated there, and the
        // replays allocate nothing.
        let peak_from = if graph { 1 } else { self.warmup };
        for i in 0..self.warmup + self.steps {
            if i == peak_from {
                kern.cuda_memory(0, true)?;
            }
            tch::Cuda::synchronize(0);
            let start = Instant::now();
            let used = step(i >= 1)?;
            if i >= self.warmup {
                times.push(start.elapsed().as_secs_f64() * 1e3);
                usage.extend(used);
            }
        }
        let peak = kern.cuda_memory(0, false)?.peak;
        let note = match profile {
            Some(trace) => {
                let mut failed = None;
                let note = profile_step(kern, trace, || {
                    failed = step(true).err();
                });
                match failed {
                    Some(e) => return Err(e),
                    None => note,
                }
            }
            None => String::new(),
        };
        Ok(TrainRow {
            imp: OURS.into(),
            step_ms: Some(median(times)),
            peak_gib: Some(peak / GIB),
            planned_gib: Some(plan.peak / GIB),
            full_usage: (!usage.is_empty()).then(|| median(usage)),
            setup: format!(
                "{}; micro-batch {micro} x {accum}{}",
                setup_of(&plan),
                if graph { "; CUDA graph" } else { "" }
            ),
            note,
            ..self.row(method, len)
        })
    }

    /// The micro-batches the search tries at `len`: the step's sequences, then its halves
    /// while they divide it, `micro_batches` at most.
    fn micro_batch_sizes(&self, len: i64) -> Vec<i64> {
        let mut sizes = vec![self.batch(len)];
        while let Some(&m) = sizes.last().filter(|&&m| m % 2 == 0) {
            if sizes.len() == self.micro_batches {
                break;
            }
            sizes.push(m / 2);
        }
        sizes
    }

    /// Sequences a step: `tokens / len`, at least one.
    fn batch(&self, len: i64) -> i64 {
        (self.tokens / len).max(1)
    }

    /// Where the profiled steps' traces go, less their `_<impl>_<method>_L<len>.json`.
    fn trace_stem(&self) -> PathBuf {
        self.out.join("profiles").join(file_safe(&self.model_name))
    }

    /// A row of this run's model and settings for `method` at `len`, nothing measured yet.
    fn row(&self, method: &str, len: i64) -> TrainRow {
        TrainRow {
            model: self.model_name.clone(),
            imp: String::new(),
            method: method.into(),
            window: self.window,
            usage_set: self.full_usage,
            ppa_power: reads_power(method).then_some(self.ppa_power),
            len,
            batch: self.batch(len),
            setup: String::new(),
            step_ms: None,
            peak_gib: None,
            planned_gib: None,
            runs_ms: Vec::new(),
            bench_run: None,
            full_usage: None,
            mfu: None,
            note: String::new(),
        }
    }
}

/// Runs `step` under the profiler, its trace written to `trace`: "" when it was, else why not
/// (the profiler stopped whatever the step did, so the next case can start it again).
pub(crate) fn profile_step(kern: &kernels::Kernels, trace: &Path, step: impl FnOnce()) -> String {
    if let Err(e) = kern.profile_start() {
        return format!("no profile: {e:#}");
    }
    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(step));
    let stopped = kern.profile_stop(trace);
    match (ran, stopped) {
        (Ok(()), Ok(())) => String::new(),
        (Err(_), _) => format!("no profile: its step failed: {}", last_panic()),
        (Ok(()), Err(e)) => format!("no profile: {e:#}"),
    }
}

/// The first line of a message, at most 80 characters: a try in a row's setup.
fn short(message: &str) -> String {
    let line = message.lines().next().unwrap_or_default();
    line.chars().take(80).collect()
}

/// The plan's checkpointing and loss chunks, as the CSV's `setup` says them.
fn setup_of(plan: &memory::MemoryPlan) -> String {
    let ckpt = format!("{:?}", plan.checkpointing).to_lowercase();
    match plan.step.loss_chunk {
        Some(n) => format!("checkpointing {ckpt}; loss in chunks of {n}"),
        None => format!("checkpointing {ckpt}"),
    }
}

/// The rows of `train_bench.csv` in `out` from earlier runs (none where there is no file).
fn earlier_rows(path: &Path) -> Result<Vec<TrainRow>> {
    if !path.exists() {
        return Ok(Vec::new());
    }
    let mut r =
        csv::Reader::from_path(path).with_context(|| format!("cannot read {}", path.display()))?;
    let header: Vec<String> = r.headers()?.iter().map(String::from).collect();
    // A file written before some columns were (`ADDED`) reads as one without them.
    if !known_header(&header) {
        bail!(
            "{} holds a bench of another format (columns {}); choose another --out or move it away",
            path.display(),
            header.join(",")
        );
    }
    r.records()
        .enumerate()
        .map(|(i, rec)| {
            TrainRow::parse(&rec?, &header)
                .with_context(|| format!("{} row {}", path.display(), i + 2))
        })
        .collect()
}

/// The peer's rows: `impl,method,L,batch,step_ms,tokens_per_s,full_usage,peak_gib,setup,note`
/// (a case it could not run: no time, the reason in `note`), or `# note` lines, passed on.
fn peer_rows(b: &TrainBench, printed: &str) -> Result<Vec<TrainRow>> {
    let mut rows = Vec::new();
    for line in printed.lines() {
        if let Some(note) = line.strip_prefix("# ") {
            eprintln!("{note}");
            continue;
        }
        let f: Vec<&str> = line.splitn(10, ',').collect();
        if f.len() != 10 {
            if line.starts_with("torch_") {
                eprintln!(
                    "warning: the peer printed a row without its 10 fields, left out: {line:?}"
                );
            }
            continue;
        }
        let num = |s: &str| {
            optional_number(s, "a value").with_context(|| format!("peer printed {line:?}"))
        };
        rows.push(TrainRow {
            imp: f[0].into(),
            batch: f[3]
                .parse()
                .with_context(|| format!("peer printed {line:?}"))?,
            step_ms: num(f[4])?,
            full_usage: num(f[6])?,
            peak_gib: num(f[7])?,
            setup: f[8].into(),
            note: f[9].into(),
            ..b.row(
                f[1],
                f[2].parse()
                    .with_context(|| format!("peer printed {line:?}"))?,
            )
        });
    }
    Ok(rows)
}

/// Runs the training bench; returns the CSV's path.
pub(crate) fn run_train(b: &TrainBench) -> Result<PathBuf> {
    let kern = kernels::cuda()
        .context("bench train needs a GPU and a CUDA kernel library (attnsweep kernels build)")?;
    std::fs::create_dir_all(&b.out)?;
    if b.profile {
        std::fs::create_dir_all(b.out.join("profiles"))?;
    }
    let csv_path = b.out.join("train_bench.csv");
    let rows = earlier_rows(&csv_path)?;
    // This bench's name for its rows: they are paired run by run with each other only.
    let bench_run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut runs = Vec::new();
    for run in 0..b.repeats {
        // Which side goes first alternates, so a drift over the runs (the GPU's clocks, a
        // neighbour) falls on both alike.
        let peers_first = run % 2 == 0;
        if b.repeats > 1 {
            eprintln!("run {} of {}", run + 1, b.repeats);
        }
        let mut fresh = Vec::new();
        if peers_first {
            fresh.extend(peers_run(b)?);
        }
        fresh.extend(our_run(b, kern));
        if !peers_first {
            fresh.extend(peers_run(b)?);
        }
        runs.push(fresh);
        // Written after every run, so a run that stops the bench loses none before it (the
        // runs not yet made read as slots empty).
        let mut so_far = runs.clone();
        so_far.resize(b.repeats, Vec::new());
        write_outputs(
            &b.out,
            &merge(rows.clone(), combine_runs(so_far, bench_run)),
            Some((&b.model_name, &b.model)),
        )?;
    }
    Ok(csv_path)
}

/// The peers' rows of one run of the bench (none where none runs).
fn peers_run(b: &TrainBench) -> Result<Vec<TrainRow>> {
    let mut fresh = Vec::new();
    // The variants the peers implement (`BenchVariant::peer`).
    let peer_methods: Vec<&str> = b.methods.iter().filter_map(|m| m.variant.peer).collect();
    // A list of variants without a peer (aha-sampled) leaves the peers nothing to run.
    if !b.peers.is_empty() && !peer_methods.is_empty() {
        let model_json = b.out.join("peer_model.json");
        std::fs::write(&model_json, serde_json::to_string_pretty(&b.model)?)
            .with_context(|| format!("cannot write {}", model_json.display()))?;
        let flags = [
            ("--lengths", joined(&b.lengths)),
            ("--methods", joined(&peer_methods)),
            ("--tokens", b.tokens.to_string()),
            ("--model", model_json.display().to_string()),
            ("--window", b.window.to_string()),
            ("--full-usage", b.full_usage.to_string()),
            ("--ppa-power", b.ppa_power.to_string()),
            ("--impls", b.peers.join(",")),
            ("--compile-modes", b.peer_modes.join(",")),
            ("--micro-batches", b.micro_batches.to_string()),
            ("--steps", b.steps.to_string()),
            ("--warmup", b.warmup.to_string()),
            ("--lr", "0".to_string()),
            (
                "--profile",
                match b.profile {
                    true => b.trace_stem().display().to_string(),
                    false => String::new(),
                },
            ),
        ];
        let printed = run_peer(
            &b.out,
            &b.python,
            "train_peer.py",
            include_str!("../../kernels/train_peer.py"),
            &flags,
        )?;
        fresh.extend(peer_rows(b, &printed)?);
    }
    Ok(fresh)
}

/// Our rows of one run of the bench, a failed case recorded with its reason.
fn our_run(b: &TrainBench, kern: &'static kernels::Kernels) -> Vec<TrainRow> {
    let mut fresh = Vec::new();
    for &len in &b.lengths {
        for &m in &b.methods {
            // One failed case (out of memory at a long length) is recorded with its reason,
            // not fatal.
            fresh.push(caught(|| b.measure(m, len, kern)).unwrap_or_else(|why| {
                eprintln!("attnsweep {} L={len}: {why}", m.name());
                TrainRow {
                    imp: OURS.into(),
                    note: why,
                    ..b.row(m.name(), len)
                }
            }));
        }
    }
    fresh
}

/// `earlier` with the `fresh` rows in place of the rows of their cases.
fn merge(mut earlier: Vec<TrainRow>, fresh: Vec<TrainRow>) -> Vec<TrainRow> {
    for f in fresh {
        earlier.retain(|r| r.key() != f.key());
        earlier.push(f);
    }
    earlier
}

/// Runs nothing: rewrites `out`'s train_bench.csv (its derived columns) and figures from the
/// rows it holds; returns the CSV's path.
pub(crate) fn redraw(out: &Path) -> Result<PathBuf> {
    let csv_path = out.join("train_bench.csv");
    ensure!(
        csv_path.exists(),
        "{} does not exist: --redraw rewrites the CSV and figures a bench wrote there",
        csv_path.display()
    );
    write_outputs(out, &earlier_rows(&csv_path)?, None)
}

/// The CSV (ratios and utilisation derived from every row) and a figure per model, in `out`;
/// `model` the shape of the bench just run, other models' shapes from their presets.
fn write_outputs(
    out: &Path,
    rows: &[TrainRow],
    model: Option<(&String, &ModelConfig)>,
) -> Result<PathBuf> {
    let csv_path = out.join("train_bench.csv");
    // One row per case, the last measured (earlier runs may hold a case twice under settings
    // its method does not read).
    let kept: Vec<TrainRow> = rows
        .iter()
        .enumerate()
        .filter(|(i, r)| !rows[i + 1..].iter().any(|later| later.key() == r.key()))
        .map(|(_, r)| r.clone())
        .collect();
    let rows = &kept[..];
    let mut models = BTreeMap::new();
    if let Some((name, m)) = model {
        models.insert(name.clone(), m.clone());
    }
    // Rows of other models from earlier runs: their shapes from their presets, where they are
    // (elsewhere their utilisation stays as written).
    for r in rows {
        if !models.contains_key(&r.model) {
            if let Ok(m) = crate::run::presets::model(&r.model) {
                models.insert(r.model.clone(), m);
            }
        }
    }
    let records: Vec<Vec<String>> = rows.iter().map(|r| r.record(rows, &models)).collect();
    atomic::write_csv(&csv_path, &HEADER, &records)?;
    let mut names: Vec<&String> = rows.iter().map(|r| &r.model).collect();
    names.sort();
    names.dedup();
    for model in names {
        if let Some(f) = figure(rows, model) {
            f.save(&out.join(format!("train_bench_{}", file_safe(model))))?;
        }
    }
    let profiles = out.join("profiles");
    if profiles.is_dir() {
        profile::summarise(&profiles)?;
    }
    Ok(csv_path)
}

/// `name` as part of a file name: letters, digits and '-' kept, anything else (a path's
/// separators, a version's dots, which would read as an extension) as '_'.
pub(crate) fn file_safe(name: &str) -> String {
    name.chars()
        .map(|c| match c.is_ascii_alphanumeric() || c == '-' {
            true => c,
            false => '_',
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::row::{flops_per_token, ADDED, PEAK_FLOPS};
    use super::*;
    use crate::run::presets;
    use crate::sweep::{Figure, Look};

    /// The utilisation's FLOPs: 6 per matrix parameter and the causal attention term, for
    /// Qwen2.5-1.5B at 8192 tokens (about 9.3 GFLOP of matrices plus 2.1 of attention).
    #[test]
    fn model_flops_count_matrices_and_causal_attention() {
        let m = presets::model("qwen2.5-1.5b").unwrap();
        let f = flops_per_token(&m, 8192);
        let matmul = 28.0 * (1536.0 * 1536.0 * 2.0 + 1536.0 * 256.0 * 2.0 + 3.0 * 1536.0 * 8960.0)
            + 151936.0 * 1536.0;
        let attention = 12.0 * 28.0 * 1536.0 * 8193.0 / 2.0;
        assert!((f - 6.0 * matmul - attention).abs() < 1.0, "{f}");
        assert!((f / 1e9 - 11.38).abs() < 0.01, "{}", f / 1e9);
    }

    fn bench() -> TrainBench {
        TrainBench {
            lengths: vec![1024],
            tokens: 4096,
            methods: vec![TrainMethod::parse("full").unwrap()],
            model_name: "smollm2-135m".into(),
            model: presets::model("smollm2-135m").unwrap(),
            window: 256,
            full_usage: 0.1,
            ste_sample: 0.1,
            ppa_power: 0.5,
            checkpointing: Checkpointing::Auto,
            loss_chunk_tokens: 0,
            micro_batches: 3,
            steps: 1,
            warmup: 0,
            out: PathBuf::new(),
            python: "python3".into(),
            peers: vec![],
            peer_modes: vec!["default".into()],
            profile: false,
            repeats: 1,
        }
    }

    /// The compiled peer's modes are torch.compile's own, each named once.
    #[test]
    fn peer_modes_are_checked() {
        let mut b = bench();
        assert!(b.validate().is_ok());
        b.peer_modes = vec!["default".into(), "reduce-overhead".into()];
        assert!(b.validate().is_ok());
        b.peer_modes = vec!["fast".into()];
        assert!(format!("{:#}", b.validate().unwrap_err()).contains("--peer-modes takes default"));
        b.peer_modes = vec!["default".into(), "default".into()];
        assert!(format!("{:#}", b.validate().unwrap_err()).contains("twice"));
    }

    /// The search's micro-batches keep the step's tokens: the step's sequences, then halves
    /// while they divide it, as many as asked.
    #[test]
    fn micro_batches_halve_the_step_while_they_divide_it() {
        let mut b = bench();
        b.tokens = 32768;
        assert_eq!(b.micro_batch_sizes(2048), [16, 8, 4]);
        assert_eq!(b.micro_batch_sizes(16384), [2, 1]);
        assert_eq!(b.micro_batch_sizes(65536), [1]);
        b.tokens = 3 * 1024;
        assert_eq!(b.micro_batch_sizes(1024), [3]);
        b.tokens = 32768;
        b.micro_batches = 1;
        assert_eq!(b.micro_batch_sizes(2048), [16]);
    }

    /// The peer's rows read back, its failures kept with their reason, a non-finite value
    /// refused; the CSV's rows read back as written, and a row measured again replaces its
    /// earlier one only.
    #[test]
    fn rows_round_trip_and_replace_by_case() {
        let b = bench();
        let rows = peer_rows(
            &b,
            "# a note\ntorch_compile,full,1024,4,50.0,81920,,12.5,per-block checkpointing,\n\
             torch_eager,swa,1024,4,,,,,,out of memory, even so\n",
        )
        .unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].step_ms, Some(50.0));
        assert_eq!(rows[0].setup, "per-block checkpointing");
        assert_eq!(rows[1].step_ms, None);
        assert_eq!(rows[1].note, "out of memory, even so");
        assert!(peer_rows(&b, "torch_eager,full,1024,4,nan,1,,1,x,\n").is_err());
        // Beside them a row of ours that reads PPA's power; one run of the bench: each
        // measured row's run is its step time.
        let mut rows = rows;
        rows.push(TrainRow {
            imp: OURS.into(),
            step_ms: Some(40.0),
            ..b.row("ppa", 1024)
        });
        let rows = combine_runs(vec![rows], 7);
        assert_eq!(rows[0].runs_ms, vec![Some(50.0)]);
        assert_eq!(rows[1].runs_ms, vec![None]);
        assert_eq!(rows[1].note, "out of memory, even so");

        let dir = crate::util::scratch_dir("bench-train-csv");
        let path = dir.join("train_bench.csv");
        let mut models = BTreeMap::new();
        models.insert(b.model_name.clone(), b.model.clone());
        let records: Vec<Vec<String>> = rows.iter().map(|r| r.record(&rows, &models)).collect();
        atomic::write_csv(&path, &HEADER, &records).unwrap();
        // Read back as written, the utilisation the CSV adds among it.
        let back: Vec<TrainRow> = earlier_rows(&path)
            .unwrap()
            .into_iter()
            .map(|r| TrainRow { mfu: None, ..r })
            .collect();
        assert_eq!(back, rows);
        // Redrawn from its rows, the CSV is the same and the model's figure is drawn.
        let text = std::fs::read_to_string(&path).unwrap();
        redraw(&dir).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), text);
        assert!(dir.join("train_bench_smollm2-135m.png").exists());
        assert!(format!("{:#}", redraw(&dir.join("none")).unwrap_err()).contains("does not exist"));
        // MFU of the compiled full row: 81920 tokens/s times the model's FLOPs over the peak.
        let mfu = 81920.0 * flops_per_token(&b.model, 1024) / PEAK_FLOPS;
        assert!(text.contains(&format!("{mfu:.3}")), "{text}");
        // CSVs written before the repeats' columns, and before the ppa_power column too, read:
        // their rows without a power where it is missing, each step time its one run.
        for dropped in [&ADDED[1..], &ADDED[..]] {
            let kept: Vec<usize> = (0..HEADER.len())
                .filter(|&i| !dropped.contains(&HEADER[i]))
                .collect();
            let header: Vec<&str> = kept.iter().map(|&i| HEADER[i]).collect();
            let old_records: Vec<Vec<String>> = records
                .iter()
                .map(|r| kept.iter().map(|&i| r[i].clone()).collect())
                .collect();
            atomic::write_csv(&path, &header, &old_records).unwrap();
            let old = earlier_rows(&path).unwrap();
            assert_eq!(old.len(), rows.len());
            assert_eq!(old[0].step_ms, Some(50.0));
            assert_eq!(old[0].runs_ms, vec![Some(50.0)]);
            assert_eq!(old[0].bench_run, None);
            let power = (!dropped.contains(&"ppa_power")).then_some(0.5);
            assert_eq!(old[2].ppa_power, power);
        }
        // Columns out of order, or a required one missing, are another format.
        let mut swapped: Vec<&str> = HEADER.to_vec();
        swapped.swap(0, 1);
        atomic::write_csv(&path, &swapped, &[] as &[Vec<String>]).unwrap();
        assert!(earlier_rows(&path).is_err());
        std::fs::write(&path, "a,b\n1,2\n").unwrap();
        let e = format!("{:#}", earlier_rows(&path).unwrap_err());
        assert!(e.contains("another format"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Several runs of the bench make one row a case: the mean of the runs that measured it,
    /// each run kept, the first measuring run's setup, the largest peak; the ratio to the
    /// compiled peer's full attention gets the interval of its run-by-run pairs (Student's t on
    /// the log scale, computed here by hand); one run has no interval.
    #[test]
    fn repeated_runs_make_one_row_with_a_paired_interval() {
        let mut b = bench();
        b.repeats = 0;
        assert!(format!("{:#}", b.validate().unwrap_err()).contains("--repeats must be 1 to 20"));
        b.repeats = 2;
        assert!(b.validate().is_ok());
        b.profile = true;
        assert!(format!("{:#}", b.validate().unwrap_err()).contains("--profile traces one run"));
        b.profile = false;
        // A method named twice would be counted as two runs of one case.
        b.methods = vec![TrainMethod::parse("full").unwrap(); 2];
        assert!(format!("{:#}", b.validate().unwrap_err()).contains("--methods lists full twice"));
        let b = bench();
        let row = |imp: &str, method: &str, ms: Option<f64>, setup: &str, peak: f64| TrainRow {
            imp: imp.into(),
            step_ms: ms,
            setup: setup.into(),
            peak_gib: Some(peak),
            note: if ms.is_none() {
                "out of memory".into()
            } else {
                String::new()
            },
            ..b.row(method, 1024)
        };
        let runs = vec![
            vec![
                row("torch_compile", "full", Some(100.0), "peer; tried a", 9.0),
                row(OURS, "full", Some(90.0), "first; tried b", 5.0),
                row(OURS, "aha", None, "", 0.0),
            ],
            vec![
                row(OURS, "full", Some(88.0), "second; tried c", 6.0),
                row(OURS, "aha", Some(80.0), "fits", 4.0),
                row("torch_compile", "full", Some(110.0), "peer; tried d", 8.0),
            ],
        ];
        let rows = combine_runs(runs, 42);
        assert_eq!(rows.len(), 3);
        let ours = &rows[1];
        assert_eq!(ours.runs_ms, vec![Some(90.0), Some(88.0)]);
        assert_eq!(ours.step_ms, Some(89.0));
        assert_eq!(ours.setup, "first; tried b");
        assert_eq!(ours.note, "run 2 of 2 chose second");
        assert_eq!(ours.peak_gib, Some(6.0));
        assert_eq!(rows[0].runs_ms, vec![Some(100.0), Some(110.0)]);
        assert_eq!((rows[0].peak_gib, rows[0].note.as_str()), (Some(9.0), ""));
        // The case the first run could not measure takes the run that did, its failure named.
        assert_eq!(rows[2].runs_ms, vec![None, Some(80.0)]);
        assert_eq!(rows[2].step_ms, Some(80.0));
        assert_eq!(rows[2].setup, "fits");
        assert_eq!(rows[2].note, "run 1 of 2 failed: out of memory");
        // Pairs 100 / 90 and 110 / 88: the log ratios' mean +- t(1) 12.706 x their sd / sqrt 2.
        let logs = [(100.0f64 / 90.0).ln(), (110.0f64 / 88.0).ln()];
        let mean = (logs[0] + logs[1]) / 2.0;
        let half = 12.706 * (logs[0] - logs[1]).abs() / 2f64.sqrt() / 2f64.sqrt();
        let (low, high) = ours.paired_ratio_interval(&rows[0]);
        assert!(((mean - half).exp() - low).abs() < 1e-9, "{low}");
        assert!(((mean + half).exp() - high).abs() < 1e-9, "{high}");
        assert!(low < 1.0 && high > 1.1, "({low}, {high})");
        assert!(rows[2].paired_ratio_interval(&rows[0]).0.is_nan());
        // Rows of another bench are not paired with these.
        let other = TrainRow {
            bench_run: Some(43),
            ..rows[0].clone()
        };
        assert!(ours.paired_ratio_interval(&other).0.is_nan());
        // A run one side missed pairs nothing: ours failed in run 1 of 3, so runs 2 and 3 pair
        // (110 / 88 and 120 / 96, 1.25 both: no spread), not run 2 with the peer's run 1.
        let three = combine_runs(
            vec![
                vec![
                    row("torch_compile", "full", Some(100.0), "p", 9.0),
                    row(OURS, "full", None, "", 0.0),
                ],
                vec![
                    row(OURS, "full", Some(88.0), "o", 5.0),
                    row("torch_compile", "full", Some(110.0), "p", 9.0),
                ],
                vec![
                    row("torch_compile", "full", Some(120.0), "p", 9.0),
                    row(OURS, "full", Some(96.0), "o", 5.0),
                ],
            ],
            44,
        );
        assert_eq!(three[1].runs_ms, vec![None, Some(88.0), Some(96.0)]);
        assert_eq!(three[1].paired_ratio_interval(&three[0]), (1.25, 1.25));
        // The throughput's interval: the step times' on the log scale, as tokens/s.
        let logs = [90f64.ln(), 88f64.ln()];
        let (mean, half) = (
            (logs[0] + logs[1]) / 2.0,
            12.706 * (logs[0] - logs[1]).abs() / 2.0,
        );
        let tokens = 4.0 * 1024.0 * 1e3;
        let (slow, fast) = ours.tokens_per_s_interval();
        assert!((tokens / (mean + half).exp() - slow).abs() < 1e-6, "{slow}");
        assert!((tokens / (mean - half).exp() - fast).abs() < 1e-6, "{fast}");
        let rate = ours.tokens_per_s().unwrap();
        assert!(slow < rate && rate < fast);
        assert!(rows[2].tokens_per_s_interval().0.is_nan());
        let models = BTreeMap::new();
        let record = ours.record(&rows, &models);
        assert_eq!(record.len(), HEADER.len());
        assert_eq!(record[18], "90.000/88.000");
        assert_eq!(record[19], format!("{low:.3}"));
        assert_eq!(record[20], format!("{high:.3}"));
        assert_eq!(record[21], "42");
        assert_eq!(rows[2].record(&rows, &models)[18], "-/80.000");
        // The row's ratio is of the mean throughputs: 105 ms of the peer's on average over 89.
        assert_eq!(record[16], format!("{:.3}", 105.0 / 89.0));
        // Read back, the runs are the row's.
        let dir = crate::util::scratch_dir("bench-train-repeats");
        let records: Vec<Vec<String>> = rows.iter().map(|r| r.record(&rows, &models)).collect();
        atomic::write_csv(&dir.join("train_bench.csv"), &HEADER, &records).unwrap();
        let back = earlier_rows(&dir.join("train_bench.csv")).unwrap();
        assert_eq!(
            back,
            rows.iter()
                .map(|r| TrainRow {
                    mfu: None,
                    ..r.clone()
                })
                .collect::<Vec<_>>()
        );
        // The figure draws the rows with their intervals.
        write_outputs(&dir, &back, Some((&b.model_name, &b.model))).unwrap();
        assert!(dir.join("train_bench_smollm2-135m.png").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A case is what its method reads: full attention measured at another window or usage
    /// replaces its row, an AHA at another usage does not; ratios compare throughputs, so rows
    /// of another batch compare right; a model whose shape is unknown keeps its utilisation.
    #[test]
    fn cases_are_what_their_methods_read() {
        let b = bench();
        let ran = |method: &str, window: usize, usage: f64, step_ms: f64| TrainRow {
            imp: OURS.into(),
            window,
            usage_set: usage,
            step_ms: Some(step_ms),
            ..b.row(method, 1024)
        };
        let earlier = vec![ran("full", 256, 0.1, 10.0), ran("aha", 256, 0.1, 9.0)];
        let mut full = ran("full", 64, 0.2, 20.0);
        full.batch = 8;
        let merged = merge(earlier, vec![full.clone(), ran("aha", 256, 0.2, 8.0)]);
        assert_eq!(merged.len(), 3, "{merged:?}");
        assert_eq!(merged.iter().filter(|r| r.method == "full").count(), 1);
        assert_eq!(merged.iter().filter(|r| r.method == "aha").count(), 2);
        // PPA at another power is another case; at the same power it replaces its row.
        let ppa = |power: f64, step_ms: f64| TrainRow {
            ppa_power: Some(power),
            ..ran("ppa", 64, 0.1, step_ms)
        };
        assert_eq!(b.row("ppa", 1024).ppa_power, Some(0.5));
        assert_eq!(b.row("full", 1024).ppa_power, None);
        let powers = merge(vec![ppa(0.5, 9.0)], vec![ppa(0.75, 8.0), ppa(0.5, 7.0)]);
        assert_eq!(powers.len(), 2, "{powers:?}");
        assert!(powers
            .iter()
            .any(|r| r.ppa_power == Some(0.5) && r.step_ms == Some(7.0)));

        let dir = crate::util::scratch_dir("bench-train-cases");
        // Full attention twice under other windows in one file: the later row is kept.
        let mut custom = full.clone();
        custom.model = "custom-l2-d64-h2-f128-v300".into();
        custom.mfu = Some(0.25);
        let mut rows = merged.clone();
        rows.insert(0, ran("full", 512, 0.3, 99.0));
        rows.push(custom);
        write_outputs(&dir, &rows, Some((&b.model_name, &b.model))).unwrap();
        let back = earlier_rows(&dir.join("train_bench.csv")).unwrap();
        assert_eq!(back.len(), 4, "{back:?}");
        let aha = back
            .iter()
            .find(|r| r.method == "aha" && r.usage_set == 0.2)
            .unwrap();
        // 1024 x 4 tokens in 8 ms against full's 1024 x 8 in 20 ms.
        let text = std::fs::read_to_string(dir.join("train_bench.csv")).unwrap();
        let line = text
            .lines()
            .find(|l| l.contains(",aha,") && l.contains(",0.2,"))
            .unwrap();
        // vs_same_impl_full 1.250; no compiled peer here, no runs of the row (made by hand), no bench run.
        assert!(line.ends_with(",1.250,,,,,,"), "{line}");
        assert!(aha.mfu.is_some());
        let custom = back.iter().find(|r| r.model.starts_with("custom")).unwrap();
        assert_eq!(custom.mfu, Some(0.25));
        assert!(dir
            .join("train_bench_custom-l2-d64-h2-f128-v300.png")
            .exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A line per (implementation, method) in both panels, the failed cases left out; a
    /// method keeps its colour across implementations, ours solid and the peer's dashed.
    #[test]
    fn the_figure_draws_what_ran() {
        let b = bench();
        let mut ran = b.row("full", 1024);
        ran.imp = OURS.into();
        ran.step_ms = Some(10.0);
        ran.peak_gib = Some(3.0);
        let mut longer = ran.clone();
        // The same tokens a step at four times the length: one line.
        (longer.len, longer.batch) = (4096, ran.batch / 4);
        longer.step_ms = Some(40.0);
        let mut failed = b.row("swa", 1024);
        failed.imp = OURS.into();
        let mut swa = failed.clone();
        swa.step_ms = Some(5.0);
        swa.peak_gib = Some(2.0);
        let mut peer = ran.clone();
        peer.imp = "torch_compile".into();
        let rows = [peer, ran, longer, failed, swa];
        let Some(Figure::Panels { panels, title }) = figure(&rows, "smollm2-135m") else {
            panic!("a figure");
        };
        assert!(title.ends_with("ours beside plain PyTorch"), "{title}");
        // Without peers the title names no peer.
        let Some(Figure::Panels { title, .. }) = figure(&rows[1..], "smollm2-135m") else {
            panic!("a figure");
        };
        assert!(title.ends_with("our methods"), "{title}");
        for p in &panels {
            let names: Vec<&str> = p.series.iter().map(|s| s.name.as_str()).collect();
            assert_eq!(
                names,
                ["attnsweep full", "attnsweep swa", "torch_compile full"]
            );
            assert_eq!(p.series[0].points.len(), 2);
            let look = |i: usize| match p.series[i].look {
                Look::Chosen { colour, dashed, .. } => (colour, dashed),
                Look::ByPlace => panic!("a chosen look"),
            };
            assert_eq!(look(0), (0, false));
            assert_eq!(look(1), (1, false));
            assert_eq!(look(2), (0, true));
        }
        assert!(panels[0].series[0].line && panels[0].series[0].labels.is_empty());
        // Lengths run with other tokens a step or checkpointing are points named by their
        // set-up, not joined by a line.
        let mut other = rows[2].clone();
        other.setup = "checkpointing full; loss in chunks of 512".into();
        let mut rows = rows.clone();
        rows[2] = other;
        let Some(Figure::Panels { panels, .. }) = figure(&rows, "smollm2-135m") else {
            panic!("a figure");
        };
        let ours = &panels[0].series[0];
        assert!(!ours.line);
        assert_eq!(ours.labels.len(), 2);
        assert_ne!(ours.labels[0], ours.labels[1]);
        assert!(ours.labels[1].ends_with("ckpt full"), "{:?}", ours.labels);
        assert!(figure(&[], "smollm2-135m").is_none());
        // PPA at two powers, and a row of a file from before the power was written: three
        // lines, named apart.
        let ppa = |power: Option<f64>, step_ms: f64| {
            let mut r = b.row("ppa", 1024);
            r.imp = OURS.into();
            r.ppa_power = power;
            r.step_ms = Some(step_ms);
            r
        };
        let rows = [ppa(Some(0.5), 6.0), ppa(Some(0.75), 7.0), ppa(None, 8.0)];
        let Some(Figure::Panels { panels, .. }) = figure(&rows, "smollm2-135m") else {
            panic!("a figure");
        };
        let names: Vec<&str> = panels[0].series.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "attnsweep ppa p=?",
                "attnsweep ppa p=0.5",
                "attnsweep ppa p=0.75"
            ]
        );
    }
}
