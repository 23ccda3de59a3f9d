//! `attnsweep bench decode`: greedy generation of one model shape per method, context length
//! and batch, as the evaluations generate (`run/generate.rs`: the cache keeps what each method
//! reads, each step on the decode kernel, one step captured as a CUDA graph and replayed),
//! beside transformers' fastest path for the same shape in the same run (`kernels/
//! decode_peer.py`: static cache, compiled) and the memory-bandwidth floor of each step.
//!
//! Each case reports the time to the first token (the prefill, the cache allocated, the first
//! argmax read back), the latency of one decoding step (the difference between runs of `short +
//! new` and `short` new tokens over `new`: set-up, prefill and the capture cancel), tokens/s
//! (batch / step), the cache's bytes as allocated, peak memory, and the floor: the bytes a
//! step must read (bf16 weights once, and each key and value its queries attend, from the
//! step's own pair count) over the card's bandwidth. Rows go to `decode_bench.csv`, the step
//! latency against the context per method to `decode_bench.png/svg`.

use super::bench::{joined, run_peer};
use super::bench_methods::{calibrate_routers, method_config, TrainMethod};
use super::bench_train::{file_safe, profile_step};
use super::panics::caught;
use super::profile;
use crate::config::ModelConfig;
use crate::model::attention::{BenchKnobs, ForwardCtx};
use crate::model::kernels;
use crate::model::kernels::Kernels;
use crate::run::generate::greedy;
use crate::run::memory::GIB;
use crate::run::presets;
use crate::run::Built;
use crate::sweep::{Figure, Look, Panel, Series, XAxis};
use crate::util::atomic;
use crate::util::flags::{each_once, finite_flag};
use crate::util::stats::median;
use anyhow::{ensure, Context, Result};
use clap::Args;
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

#[derive(Args)]
pub(crate) struct BenchDecodeCmd {
    /// The model: a preset (smollm2-135m, qwen3-0.6b, qwen2.5-1.5b, olmo2-1b, llama3.2-1b)
    /// or a Hugging Face config.json (or its directory); random weights.
    #[arg(long, default_value = "smollm2-135m")]
    model: String,
    /// Attention methods [default: every one the bench times].
    #[arg(long, value_delimiter = ',', value_parser = TrainMethod::parse)]
    methods: Vec<TrainMethod>,
    /// Prompt lengths.
    #[arg(long, value_delimiter = ',', default_value = "1024,4096,8192,16384")]
    contexts: Vec<i64>,
    /// Prompts decoded together.
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    batches: Vec<i64>,
    /// Sliding window of every method that has one.
    #[arg(long, default_value_t = 1024)]
    window: usize,
    /// Fraction of the gates open (routers calibrated on random tokens).
    #[arg(long, value_parser = finite_flag, default_value_t = 0.1)]
    full_usage: f64,
    /// PPA's power p.
    #[arg(long, value_parser = finite_flag, default_value_t = 0.5)]
    ppa_power: f64,
    /// New tokens of the shorter timed run.
    #[arg(long, default_value_t = 16)]
    short: usize,
    /// How many more the longer run generates: a step is the difference over this many.
    #[arg(long, default_value_t = 128)]
    new: usize,
    /// Timed runs of each length (medians reported), after one to warm up.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Also time every step run as it is, without capturing it as a CUDA graph.
    #[arg(long)]
    eager: bool,
    /// The card's memory bandwidth in TB/s, the floor's denominator (an H200's 4.8; an H100
    /// SXM's 3.35).
    #[arg(long, value_parser = finite_flag, default_value_t = 4.8)]
    hbm_tbps: f64,
    /// Output directory.
    #[arg(long, default_value = "results/decode")]
    out: PathBuf,
    /// Python with torch and transformers for the peer.
    #[arg(long, default_value = "python3")]
    python: String,
    /// Skip the peer.
    #[arg(long)]
    no_peers: bool,
    /// One more run of each case under PyTorch's profiler: Chrome traces in --out/profiles,
    /// with kernel_time.csv and kernel_kinds.csv (GPU time by kernel and by kind).
    #[arg(long)]
    profile: bool,
    /// Runs nothing: draws the figure again from --out's decode_bench.csv (its rows of
    /// --model; the bandwidth floor's label from --hbm-tbps, which the CSV does not hold).
    #[arg(long, conflicts_with_all = [
        "methods", "contexts", "batches", "window", "full_usage", "ppa_power", "short", "new",
        "reps", "eager", "python", "no_peers", "profile",
    ])]
    redraw: bool,
}

/// `attnsweep bench decode`.
pub(crate) fn run_cmd(c: BenchDecodeCmd) -> Result<()> {
    if c.redraw {
        println!("{}", redraw(&c.out, &c.model, c.hbm_tbps)?.display());
        return Ok(());
    }
    let b = DecodeBench {
        model: presets::model(&c.model)?,
        model_name: c.model,
        methods: match c.methods.is_empty() {
            true => TrainMethod::all().collect(),
            false => c.methods,
        },
        contexts: c.contexts,
        batches: c.batches,
        window: c.window,
        full_usage: c.full_usage,
        ppa_power: c.ppa_power,
        short: c.short,
        new: c.new,
        reps: c.reps,
        eager: c.eager,
        hbm_tbps: c.hbm_tbps,
        out: c.out,
        python: c.python,
        peers: !c.no_peers,
        profile: c.profile,
    };
    b.validate()?;
    let kern = kernels::cuda()
        .context("bench decode needs a GPU and a CUDA kernel library (attnsweep kernels build)")?;
    println!("{}", run(&b, kern)?.display());
    Ok(())
}

pub(crate) struct DecodeBench {
    pub(crate) model_name: String,
    pub(crate) model: ModelConfig,
    pub(crate) methods: Vec<TrainMethod>,
    pub(crate) contexts: Vec<i64>,
    pub(crate) batches: Vec<i64>,
    pub(crate) window: usize,
    pub(crate) full_usage: f64,
    pub(crate) ppa_power: f64,
    /// New tokens of the shorter run, and how many more the longer one generates.
    pub(crate) short: usize,
    pub(crate) new: usize,
    pub(crate) reps: usize,
    /// Also time each step run as it is, without the graph.
    pub(crate) eager: bool,
    /// The card's memory bandwidth, TB/s: the floor's denominator.
    pub(crate) hbm_tbps: f64,
    pub(crate) out: PathBuf,
    pub(crate) python: String,
    pub(crate) peers: bool,
    /// One more run of each case's longer generation (with graphs) under PyTorch's profiler:
    /// its trace in `out/profiles/`, summed by kernel and by kind (`profile::summarise`).
    pub(crate) profile: bool,
}

impl DecodeBench {
    pub(crate) fn validate(&self) -> Result<()> {
        ensure!(!self.contexts.is_empty(), "--contexts is empty");
        ensure!(!self.batches.is_empty(), "--batches is empty");
        ensure!(
            self.contexts.iter().all(|&c| c >= 1),
            "--contexts must be at least 1 token each"
        );
        ensure!(
            self.batches.iter().all(|&b| b >= 1),
            "--batches must be at least 1 each"
        );
        each_once("--contexts", &self.contexts)?;
        each_once("--batches", &self.batches)?;
        ensure!(self.short >= 2, "--short must be at least 2 new tokens");
        ensure!(self.new >= 1, "--new must be at least 1 token");
        ensure!(self.reps >= 1, "--reps must be at least 1");
        ensure!(
            self.hbm_tbps.is_finite() && self.hbm_tbps > 0.0,
            "--hbm-tbps must be a positive bandwidth"
        );
        ensure!(
            (0.0..=1.0).contains(&self.full_usage),
            "--full-usage must lie in [0, 1]"
        );
        ensure!(
            (0.0..=1.0).contains(&self.ppa_power),
            "--ppa-power must lie in [0, 1]"
        );
        ensure!(self.window >= 1, "--window must be at least 1");
        Ok(())
    }
}

const HEADER: [&str; 16] = [
    "model",
    "impl",
    "method",
    "window",
    "context",
    "batch",
    "ttft_ms",
    "step_ms",
    "step_ms_spread",
    "tokens_per_s",
    "floor_ms",
    "of_floor",
    "kv_gib",
    "peak_gib",
    "runs",
    "note",
];

const OURS: &str = "attnsweep";
const OURS_EAGER: &str = "attnsweep_eager";
const PEER: &str = "transformers_static";

/// One case measured: a row of `decode_bench.csv`.
struct DecodeRow {
    model: String,
    window: String,
    imp: String,
    method: String,
    context: i64,
    batch: i64,
    ttft_ms: f64,
    step_ms: f64,
    step_ms_spread: f64,
    floor_ms: Option<f64>,
    kv_gib: Option<f64>,
    peak_gib: f64,
    runs: usize,
    note: String,
}

/// One case's repeated runs (after one to warm up): each run's prefill and decode seconds, and
/// the last run's pairs per decoding step and cache bytes.
fn timed_runs(
    built: &Built,
    prompts: &Tensor,
    new: usize,
    reps: usize,
    graphs: bool,
) -> (Vec<f64>, Vec<f64>, f64, f64) {
    let ctx = ForwardCtx::default();
    let run = || greedy(&built.model, prompts, new, None, &ctx, graphs);
    let _ = run();
    let mut prefill = Vec::new();
    let mut decode = Vec::new();
    let mut pairs = 0.0;
    let mut bytes = 0.0;
    for _ in 0..reps {
        let g = run();
        prefill.push(g.prefill_seconds);
        decode.push(g.decode_seconds);
        pairs = g.decode_pairs.iter().sum::<f64>() / g.decode_pairs.len().max(1) as f64;
        bytes = g.cache_bytes;
    }
    (prefill, decode, pairs, bytes)
}

impl DecodeBench {
    /// Our rows of one method at one context and batch: graphs, and eager where asked.
    fn measure(
        &self,
        kern: &'static Kernels,
        method: TrainMethod,
        context: i64,
        batch: i64,
    ) -> Result<Vec<DecodeRow>> {
        let knobs = BenchKnobs {
            full_usage: self.full_usage,
            ste_sample: 1.0,
        };
        let cfg = method_config(&self.model, method, &knobs, self.window, self.ppa_power);
        let dev = Device::Cuda(0);
        // The same weights and prompts for a case whatever ran before it.
        tch::manual_seed(0);
        let built = Built::new(&cfg, dev)?;
        if method.variant.calibrate_router {
            calibrate_routers(&built, self.full_usage, context);
        }
        let prompts = Tensor::randint(
            self.model.vocab_size as i64,
            [batch, context],
            (Kind::Int64, dev),
        );
        // Every step reads the bf16 weights once and, per KV head, the keys and values its
        // queries attend (the query heads of a group share them).
        let params: f64 = built.params().values().map(|p| p.numel() as f64).sum();
        let m = &self.model;
        let group = (m.num_attention_heads / m.num_key_value_heads) as f64;
        let kv_per_pair = 2.0 * m.head_dim() as f64 * 2.0 / group;
        let mut rows = Vec::new();
        for graphs in [true, false] {
            if !graphs && !self.eager {
                continue;
            }
            kern.cuda_memory(0, true)?;
            let (_, long, pairs, bytes) =
                timed_runs(&built, &prompts, self.short + self.new, self.reps, graphs);
            let peak = kern.cuda_memory(0, false)?.peak;
            let (first, short, _, _) = timed_runs(&built, &prompts, self.short, self.reps, graphs);
            let steps: Vec<f64> = long
                .iter()
                .zip(&short)
                .map(|(l, s)| (l - s) / self.new as f64 * 1e3)
                .collect();
            let spread = steps.iter().copied().fold(f64::MIN, f64::max)
                - steps.iter().copied().fold(f64::MAX, f64::min);
            let floor_bytes = 2.0 * params + pairs * kv_per_pair;
            // After the timed runs, so the profiler's cost is in none of them.
            let note = match (self.profile, graphs) {
                (true, true) => {
                    let dir = self.out.join("profiles");
                    std::fs::create_dir_all(&dir)
                        .with_context(|| format!("cannot create {}", dir.display()))?;
                    let trace = dir.join(format!(
                        "{}_{}_c{context}_b{batch}.json",
                        file_safe(&self.model_name),
                        method.name()
                    ));
                    profile_step(kern, &trace, || {
                        let ctx = ForwardCtx::default();
                        let n = self.short + self.new;
                        let _ = greedy(&built.model, &prompts, n, None, &ctx, true);
                        tch::Cuda::synchronize(0);
                    })
                }
                _ => String::new(),
            };
            rows.push(DecodeRow {
                model: self.model_name.clone(),
                window: self.window_of(method.name()),
                imp: if graphs { OURS } else { OURS_EAGER }.into(),
                method: method.name().into(),
                context,
                batch,
                ttft_ms: median(first) * 1e3,
                step_ms: (median(long) - median(short)) / self.new as f64 * 1e3,
                step_ms_spread: spread,
                floor_ms: Some(floor_bytes / (self.hbm_tbps * 1e12) * 1e3),
                kv_gib: Some(bytes / GIB),
                peak_gib: peak / GIB,
                runs: self.reps,
                note,
            });
        }
        Ok(rows)
    }

    /// The transformers peer's rows, for full attention.
    fn peer_rows(&self) -> Result<Vec<DecodeRow>> {
        let printed = run_peer(
            &self.out,
            &self.python,
            "decode_peer.py",
            include_str!("../../kernels/decode_peer.py"),
            &[
                ("--model", serde_json::to_string(&self.model)?),
                ("--contexts", joined(&self.contexts)),
                ("--batches", joined(&self.batches)),
                ("--short", self.short.to_string()),
                ("--new", self.new.to_string()),
                ("--reps", self.reps.to_string()),
            ],
        )?;
        let mut rows = Vec::new();
        for line in printed.lines() {
            if let Some(note) = line.strip_prefix("# ") {
                eprintln!("{note}");
                continue;
            }
            let f: Vec<&str> = line.split(',').collect();
            if f.len() != 8 || f[0] != PEER {
                continue;
            }
            let num = |s: &str| -> Result<f64> {
                let v: f64 = s
                    .parse()
                    .with_context(|| format!("the peer printed {line:?}"))?;
                ensure!(
                    v.is_finite(),
                    "the peer printed a non-finite value: {line:?}"
                );
                Ok(v)
            };
            rows.push(DecodeRow {
                model: self.model_name.clone(),
                window: String::new(),
                imp: PEER.into(),
                method: "full".into(),
                context: num(f[1])? as i64,
                batch: num(f[2])? as i64,
                ttft_ms: num(f[3])?,
                step_ms: num(f[4])?,
                step_ms_spread: num(f[5])?,
                floor_ms: None,
                kv_gib: None,
                peak_gib: num(f[6])?,
                runs: num(f[7])? as usize,
                note: String::new(),
            });
        }
        Ok(rows)
    }

    /// The window column of `method`'s rows: empty for full attention, which has none.
    fn window_of(&self, method: &str) -> String {
        match method {
            "full" => String::new(),
            _ => self.window.to_string(),
        }
    }
}

impl DecodeRow {
    fn record(&self) -> Vec<String> {
        let opt =
            |v: Option<f64>, digits: usize| v.map_or(String::new(), |v| format!("{v:.digits$}"));
        vec![
            self.model.clone(),
            self.imp.clone(),
            self.method.clone(),
            self.window.clone(),
            self.context.to_string(),
            self.batch.to_string(),
            format!("{:.3}", self.ttft_ms),
            format!("{:.4}", self.step_ms),
            format!("{:.4}", self.step_ms_spread),
            format!("{:.1}", self.batch as f64 / self.step_ms * 1e3),
            opt(self.floor_ms, 4),
            opt(self.floor_ms.map(|f| self.step_ms / f), 2),
            opt(self.kv_gib, 4),
            format!("{:.3}", self.peak_gib),
            self.runs.to_string(),
            self.note.clone(),
        ]
    }

    /// A row an earlier run wrote (`record`'s columns).
    fn parse(r: &csv::StringRecord) -> Result<DecodeRow> {
        ensure!(
            r.len() == HEADER.len(),
            "a row of {} fields, not {}",
            r.len(),
            HEADER.len()
        );
        let num = |i: usize| -> Result<f64> {
            match &r[i] {
                "" | "NaN" => Ok(f64::NAN),
                s => s
                    .parse()
                    .with_context(|| format!("{} is not a number: {s:?}", HEADER[i])),
            }
        };
        let opt = |i: usize| -> Result<Option<f64>> { Ok(Some(num(i)?).filter(|v| v.is_finite())) };
        Ok(DecodeRow {
            model: r[0].into(),
            imp: r[1].into(),
            method: r[2].into(),
            window: r[3].into(),
            context: num(4)? as i64,
            batch: num(5)? as i64,
            ttft_ms: num(6)?,
            step_ms: num(7)?,
            step_ms_spread: num(8)?,
            floor_ms: opt(10)?,
            kv_gib: opt(12)?,
            peak_gib: num(13)?,
            runs: num(14)? as usize,
            note: r[15].into(),
        })
    }

    /// Rows measuring the same case replace each other.
    fn key(&self) -> (&str, &str, &str, &str, i64, i64) {
        (
            &self.model,
            &self.imp,
            &self.method,
            &self.window,
            self.context,
            self.batch,
        )
    }
}

/// The rows an earlier run left in `csv` (none where it does not exist).
fn earlier_rows(csv: &std::path::Path) -> Result<Vec<DecodeRow>> {
    if !csv.exists() {
        return Ok(Vec::new());
    }
    let mut reader =
        csv::Reader::from_path(csv).with_context(|| format!("cannot read {}", csv.display()))?;
    ensure!(
        reader.headers()?.iter().eq(HEADER.iter().copied()),
        "{} holds other columns than this bench writes; move it away or choose another --out",
        csv.display()
    );
    reader
        .records()
        .map(|r| DecodeRow::parse(&r?).with_context(|| format!("in {}", csv.display())))
        .collect()
}

/// Runs nothing: the figure of `out`'s decode_bench.csv drawn again for `model`'s rows (after
/// a change to how figures are drawn), its floor labelled at `hbm_tbps`; returns the PNG's path.
pub(crate) fn redraw(out: &Path, model: &str, hbm_tbps: f64) -> Result<PathBuf> {
    let csv = out.join("decode_bench.csv");
    ensure!(
        csv.exists(),
        "{} does not exist: --redraw draws the figure from the CSV a bench wrote there",
        csv.display()
    );
    let rows = earlier_rows(&csv)?;
    ensure!(
        rows.iter()
            .any(|r| r.model == model && r.step_ms.is_finite()),
        "{} holds no measured row of {model}: name the model it ran with --model",
        csv.display()
    );
    let stem = out.join("decode_bench");
    figure(model, hbm_tbps, &rows).save(&stem)?;
    Ok(stem.with_extension("png"))
}

/// Runs the bench; returns the CSV's path.
pub(crate) fn run(b: &DecodeBench, kern: &'static Kernels) -> Result<PathBuf> {
    std::fs::create_dir_all(&b.out)
        .with_context(|| format!("cannot create {}", b.out.display()))?;
    let csv = b.out.join("decode_bench.csv");
    // Refused before any case runs, not after.
    earlier_rows(&csv)?;
    let mut rows = Vec::new();
    for &method in &b.methods {
        for &context in &b.contexts {
            for &batch in &b.batches {
                eprintln!("{} at {context}, batch {batch}", method.name());
                // A case that fails (out of memory, a kernel's refusal, a panic) is kept as a
                // row saying why; the other cases go on.
                match caught(|| b.measure(kern, method, context, batch)) {
                    Ok(r) => rows.extend(r),
                    Err(why) => rows.push(DecodeRow {
                        model: b.model_name.clone(),
                        window: b.window_of(method.name()),
                        imp: OURS.into(),
                        method: method.name().into(),
                        context,
                        batch,
                        ttft_ms: f64::NAN,
                        step_ms: f64::NAN,
                        step_ms_spread: f64::NAN,
                        floor_ms: None,
                        kv_gib: None,
                        peak_gib: f64::NAN,
                        runs: 0,
                        note: format!("failed: {why}").replace(',', ";"),
                    }),
                }
                tch::Cuda::synchronize(0);
            }
        }
    }
    if b.peers && b.methods.iter().any(|m| m.name() == "full") {
        rows.extend(b.peer_rows()?);
    }
    // Rows of earlier runs stay, but for the cases measured again.
    let mut all: Vec<DecodeRow> = earlier_rows(&csv)?
        .into_iter()
        .filter(|e| !rows.iter().any(|r| r.key() == e.key()))
        .collect();
    all.extend(rows);
    let records: Vec<Vec<String>> = all.iter().map(DecodeRow::record).collect();
    atomic::write_csv(&csv, &HEADER, &records)?;
    figure(&b.model_name, b.hbm_tbps, &all).save(&b.out.join("decode_bench"))?;
    let profiles = b.out.join("profiles");
    if profiles.is_dir() {
        profile::summarise(&profiles)?;
    }
    Ok(csv)
}

/// Step latency against the context for the bench's model, a panel per batch: a line per
/// (implementation, method, window), full attention's bandwidth floor dashed beside them.
fn figure(model: &str, hbm_tbps: f64, rows: &[DecodeRow]) -> Figure {
    let rows: Vec<&DecodeRow> = rows
        .iter()
        .filter(|r| r.model == model && r.step_ms.is_finite())
        .collect();
    let methods: Vec<&str> = TrainMethod::all().map(|m| m.name()).collect();
    let rank = |method: &str| {
        methods
            .iter()
            .position(|m| *m == method)
            .unwrap_or(methods.len())
    };
    let imp_rank = |imp: &str| [OURS, OURS_EAGER, PEER].iter().position(|i| *i == imp);
    let mut lines: Vec<(String, String, String)> = rows
        .iter()
        .map(|r| (r.imp.clone(), r.method.clone(), r.window.clone()))
        .collect();
    lines.sort_by_key(|l| (imp_rank(&l.0), rank(&l.1), l.2.clone()));
    lines.dedup();
    let mut batches: Vec<i64> = rows.iter().map(|r| r.batch).collect();
    batches.sort();
    batches.dedup();
    let windows = {
        let mut w: Vec<&str> = lines
            .iter()
            .map(|l| l.2.as_str())
            .filter(|w| !w.is_empty())
            .collect();
        w.sort();
        w.dedup();
        w.len() > 1
    };
    let colour = |method: &str| rank(method);
    let panels = batches
        .iter()
        .map(|&batch| {
            let points = |keep: &dyn Fn(&DecodeRow) -> bool,
                          value: fn(&DecodeRow) -> Option<f64>| {
                let mut p: Vec<(f64, f64)> = rows
                    .iter()
                    .filter(|r| r.batch == batch && keep(r))
                    .filter_map(|r| {
                        value(r)
                            .filter(|v| v.is_finite())
                            .map(|v| (r.context as f64, v))
                    })
                    .collect();
                p.sort_by(|a, b| a.0.total_cmp(&b.0));
                p
            };
            let mut series: Vec<Series> = lines
                .iter()
                .map(|(imp, method, window)| Series {
                    name: match (windows, window.is_empty()) {
                        (true, false) => format!("{imp} {method} w={window}"),
                        _ => format!("{imp} {method}"),
                    },
                    points: points(
                        &|r| &r.imp == imp && &r.method == method && &r.window == window,
                        |r| Some(r.step_ms),
                    ),
                    line: true,
                    labels: vec![],
                    errors: vec![],
                    look: Look::Chosen {
                        colour: colour(method),
                        shape: match imp.as_str() {
                            OURS => 0,
                            OURS_EAGER => 1,
                            _ => 2,
                        },
                        hollow: imp != OURS,
                        dashed: imp == PEER,
                    },
                })
                .filter(|s| !s.points.is_empty())
                .collect();
            let floor = points(&|r| r.imp == OURS && r.method == "full", |r| r.floor_ms);
            if !floor.is_empty() {
                series.push(Series {
                    name: format!("bandwidth floor, full ({hbm_tbps} TB/s)"),
                    points: floor,
                    line: true,
                    labels: vec![],
                    errors: vec![],
                    look: Look::Chosen {
                        colour: methods.len(),
                        shape: 3,
                        hollow: true,
                        dashed: true,
                    },
                });
            }
            Panel {
                title: format!("batch {batch}"),
                x: "context (tokens)".into(),
                y: "decoding step (ms)".into(),
                series,
                x_axis: XAxis::LogSwept,
            }
        })
        .collect();
    Figure::Panels {
        title: format!("Greedy decoding of {model}: a step against the context"),
        panels,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_figure_is_redrawn_from_the_csv() {
        let out = crate::util::scratch_dir("decode-redraw");
        let redrawn = |model: &str| redraw(&out, model, 4.8);
        assert!(format!("{:#}", redrawn("smollm2-135m").unwrap_err()).contains("does not exist"));
        let row = |method: &str, context: i64, step_ms: f64| DecodeRow {
            model: "smollm2-135m".into(),
            window: String::new(),
            imp: OURS.into(),
            method: method.into(),
            context,
            batch: 8,
            ttft_ms: 10.0,
            step_ms,
            step_ms_spread: 0.1,
            floor_ms: Some(0.3),
            kv_gib: Some(1.0),
            peak_gib: 2.0,
            runs: 3,
            note: String::new(),
        };
        let rows = [
            row("full", 8192, 1.5),
            row("full", 16384, 2.1),
            row("l2a", 8192, 4.6),
        ];
        let records: Vec<Vec<String>> = rows.iter().map(DecodeRow::record).collect();
        atomic::write_csv(&out.join("decode_bench.csv"), &HEADER, &records).unwrap();
        let png = redrawn("smollm2-135m").unwrap();
        assert!(png.is_file() && out.join("decode_bench.svg").is_file());
        assert!(format!("{:#}", redrawn("olmo2-1b").unwrap_err()).contains("no measured row"));
    }
}
