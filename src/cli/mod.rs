//! The command line: `attnsweep train | eval | prune | data | convert | export | sweep | plot |
//! bench | kernels`, each a thin call into the layers below.

pub(crate) mod bench;
pub(crate) mod bench_decode;
pub(crate) mod bench_methods;
pub(crate) mod bench_train;
mod grid;
mod panics;
mod profile;

use crate::cli::bench_methods::TrainMethod;
use crate::cli::bench_train::TrainBench;
use crate::cli::grid::{run_sweep, SweepCmd};
use crate::cli::panics::torch_cause;
use crate::config::{Checkpointing, Config, ModelConfig};
use crate::data::corpus;
use crate::data::corpus::PrepareSpec;
use crate::data::probes::ProbesArgs;
use crate::data::{self, SynthSpec};
use crate::model::kernels;
use crate::model::kernels::Variant;
use crate::run::convert;
use crate::run::convert::OutDtype;
use crate::run::eval;
use crate::run::memory;
use crate::run::presets;
use crate::run::prune;
use crate::run::ranks;
use crate::run::report;
use crate::run::tasks;
use crate::run::tasks::RunOptions;
use crate::run::train::{self, TrainArgs};
use crate::run::LoadedRun;
use crate::sweep;
use crate::util::flags::finite_flag;
use crate::util::progress::DEFAULT_STATUS_EVERY;
use anyhow::Result;
use clap::{Args, Parser, Subcommand};
use std::path::{Path, PathBuf};

#[derive(Parser)]
#[command(
    name = "attnsweep",
    version,
    about = "Train, evaluate and sweep transformers that mix full, sliding-window, PPA and routed attention"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model from an experiment file (or the built-in defaults).
    Train(TrainCmd),
    /// Evaluate a trained run: loss, perplexity, bits per token, attention work, and loss per
    /// dependency distance on the synthetic corpus.
    Eval(EvalCmd),
    /// Prepare token data sets.
    #[command(subcommand)]
    Data(DataCmd),
    /// Run a grid of experiments (see sweeps/): every cell trains or evaluates in its own
    /// directory; finished cells are skipped, interrupted ones resumed, failed ones recorded.
    Sweep(SweepCmd),
    /// Write the paper tables and figures of a sweep directory (CSV, PNG and SVG).
    Plot(PlotCmd),
    /// Build or locate the attention kernel library.
    #[command(subcommand)]
    Kernels(KernelsCmd),
    /// Benchmarks on the GPU, beside peers in the same run.
    #[command(subcommand)]
    Bench(BenchCmd),
    /// Convert a Hugging Face model directory (Llama, Mistral, Qwen2, Qwen3, OLMo-2; safetensors,
    /// sharded or not), a llama.cpp GGUF file (llama, qwen2, qwen3; F32, F16, BF16, Q4_0, Q4_1,
    /// Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; its tokenizer written as tokenizer.json) or a PyTorch
    /// state dict into an attnsweep checkpoint plus config.toml;
    /// `train --config <out>/config.toml --init-from <out>` then continues it with any method.
    Convert(ConvertCmd),
    /// Write a trained full-attention or sliding-window model in the Hugging Face layout.
    Export(ExportCmd),
    /// L2A post-training pruning: drop the global module of layers whose measured sparsity
    /// reaches a threshold; report the key-value cache before and after and the quality change.
    Prune(PruneCmd),
}

#[derive(Args)]
struct PlotCmd {
    /// Sweep directory (written by `attnsweep sweep`).
    #[arg(long)]
    sweep: PathBuf,
    /// Where tables and figures go [default: the sweep directory].
    #[arg(long)]
    out: Option<PathBuf>,
    /// Draw even where cells whose rows the tables hold have no folder here: their rows
    /// leave every table (without it such a plot is refused, naming the cells); where no
    /// cell's folder is here, rebuild the replicate tables from tidy.csv even if that drops
    /// their intervals over the probes' prompts.
    #[arg(long)]
    drop_absent: bool,
}

#[derive(Subcommand)]
enum KernelsCmd {
    /// Compile the kernel library for the GPU found (nvcc against the active torch's headers;
    /// cached by a hash of the sources, the torch version and the GPU architecture) and print
    /// its path.
    Build {
        /// Build the CPU variant instead (g++; the autograd layer over an ATen reference).
        #[arg(long, conflicts_with = "arch")]
        cpu: bool,
        /// Build for this compute capability (e.g. 90 for Hopper) instead of the GPU found:
        /// a machine without a GPU checks that the CUDA sources compile and link (nvcc on PATH
        /// or in $NVCC).
        #[arg(long, value_name = "CC", value_parser = clap::value_parser!(u32).range(70..=121))]
        arch: Option<u32>,
    },
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Attention kernels (sliding window, sparse queries) beside SDPA (cuDNN, flash) and
    /// FlexAttention: CSV and the speed-up-against-sparsity figure.
    Attention(bench::BenchAttentionCmd),
    /// Whole training steps per method and length beside the same model in eager PyTorch:
    /// tokens/s and ratios in one CSV.
    Train(BenchTrainCmd),
    /// Greedy generation per method, context and batch (time to first token, step latency,
    /// tokens/s, memory) beside transformers' static-cache path and the bandwidth floor.
    Decode(bench_decode::BenchDecodeCmd),
}

#[derive(Args)]
struct BenchTrainCmd {
    /// Sequence lengths.
    #[arg(long, value_delimiter = ',', default_value = "8192,32768")]
    lengths: Vec<i64>,
    /// Tokens per step (batch = tokens / L, at least 1).
    #[arg(long, default_value_t = 32768)]
    tokens: i64,
    /// Attention methods [default: every one the bench times].
    #[arg(long, value_delimiter = ',', value_parser = TrainMethod::parse)]
    methods: Vec<TrainMethod>,
    /// The model: a preset (smollm2-135m, qwen3-0.6b, qwen2.5-1.5b, olmo2-1b, llama3.2-1b)
    /// or a Hugging Face config.json (or its directory). Without it, the shape of the flags
    /// below.
    #[arg(long)]
    model: Option<String>,
    /// Decoder layers (a custom shape, without --model).
    #[arg(long, default_value_t = 8, conflicts_with = "model")]
    layers: usize,
    /// Model width (d_model; a custom shape).
    #[arg(long, default_value_t = 512, conflicts_with = "model")]
    hidden: usize,
    /// Attention heads (as many key-value heads; head_dim = hidden / heads; a custom shape).
    #[arg(long, default_value_t = 8, conflicts_with = "model")]
    heads: usize,
    /// SwiGLU width (a custom shape).
    #[arg(long, default_value_t = 1536, conflicts_with = "model")]
    intermediate: usize,
    /// Vocabulary size (a custom shape; the tokens are random).
    #[arg(long, default_value_t = 32000, conflicts_with = "model")]
    vocab: usize,
    /// Sliding window of swa, of AHA's and SwiAttn's local paths and of L2A's window.
    #[arg(long, default_value_t = 256)]
    window: usize,
    /// Fraction of the gates open: AHA's (token, head) and SwiAttn's token gates (routers
    /// calibrated on random tokens), L2A's context-free token gates.
    #[arg(long, value_parser = finite_flag, default_value_t = 0.1)]
    full_usage: f64,
    /// PPA's power p.
    #[arg(long, value_parser = finite_flag, default_value_t = 0.5)]
    ppa_power: f64,
    /// attention.ste_sample of the aha-sampled method.
    #[arg(long, value_parser = finite_flag, default_value_t = 0.1)]
    ste_sample: f64,
    /// train.activation_checkpointing of our cases: none, full, selective, or auto (the
    /// memory plan's choice).
    #[arg(long, default_value = "auto", value_parser = parse_checkpointing)]
    checkpointing: Checkpointing,
    /// train.loss_chunk_tokens of our cases (0: the memory plan's choice).
    #[arg(long, default_value_t = 0)]
    loss_chunk_tokens: usize,
    /// Micro-batches each side tries, ours and the peers', for a step's tokens: the step's
    /// sequences, then halves of them, this many at most (each with the checkpointing that
    /// fits); the fastest is the row, best against best (1: the step in one micro-batch).
    #[arg(long, default_value_t = 3)]
    micro_batches: usize,
    /// Timed steps per case (median reported), after the warm-up steps.
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Untimed steps first.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Output directory; rows of earlier runs in it stay, a case measured again replaces its
    /// row.
    #[arg(long, default_value = "results/bench_train")]
    out: PathBuf,
    /// Python with torch for the peers.
    #[arg(long, default_value = "python3")]
    python: String,
    /// Plain-PyTorch peers run beside, the same model: eager, and under torch.compile.
    #[arg(long, value_delimiter = ',', default_value = "eager,compile")]
    peers: Vec<String>,
    /// Skip the peers.
    #[arg(long)]
    no_peers: bool,
    /// torch.compile modes the compiled peer tries at each micro-batch, its fastest the row:
    /// default, max-autotune-no-cudagraphs (inductor times its kernels' configurations),
    /// reduce-overhead (CUDA graphs).
    #[arg(long, value_delimiter = ',', default_value = "default")]
    peer_modes: Vec<String>,
    /// Run no case: rewrite train_bench.csv's derived columns and the figures in --out from
    /// the rows it holds (the other flags are not read).
    #[arg(long)]
    redraw: bool,
    /// One more step of each case, ours and the peers', under PyTorch's profiler: Chrome
    /// traces in --out/profiles, with kernel_time.csv and kernel_kinds.csv (GPU time by kernel
    /// and by kind).
    #[arg(long)]
    profile: bool,
    /// Runs of the whole bench, ours and the peers' alternating which goes first: each row the
    /// mean of its case's runs, with each run's step time (step_ms_runs) and the 95 % interval
    /// of the ratio to the compiled peer's full attention, run by run (3 or more: with 2 the
    /// interval's t is 12.7).
    #[arg(long, default_value_t = 1)]
    repeats: usize,
}

/// `--checkpointing`'s values: `train.activation_checkpointing`'s, read as the config reads
/// them.
fn parse_checkpointing(s: &str) -> std::result::Result<Checkpointing, String> {
    serde_json::from_value(serde_json::Value::String(s.into())).map_err(|e| e.to_string())
}

#[derive(Args)]
struct ConvertCmd {
    /// A Hugging Face model directory (config.json and weights), a GGUF file, or a weight file
    /// (with --config).
    #[arg(long)]
    from: PathBuf,
    /// config.json describing a bare weight file.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Output directory (must not already hold a model).
    #[arg(long, short)]
    out: PathBuf,
    /// Weight dtype written: keep, fp32, bf16 or fp16.
    #[arg(long, default_value = "keep")]
    dtype: String,
    /// Read pickled objects that are not tensors, containers or numbers (what the built-in
    /// reader of torch.save files refuses) by running Python's torch.load, which can run code:
    /// only for files you trust. The Python is $ATTNSWEEP_PYTHON, else python3, with torch and
    /// safetensors installed.
    #[arg(long)]
    allow_pickle: bool,
}

#[derive(Args)]
struct ExportCmd {
    /// The run directory to export.
    #[arg(long)]
    run: PathBuf,
    /// Weights to export instead of the run's latest checkpoint.
    #[arg(long, value_name = "PATH")]
    ckpt: Option<PathBuf>,
    /// Output directory for config.json and model.safetensors.
    #[arg(long, short)]
    out: PathBuf,
    /// Weight dtype written: fp32, bf16 or fp16.
    #[arg(long, default_value = "fp32")]
    dtype: String,
}

#[derive(Args)]
struct PruneCmd {
    /// The L2A run directory.
    #[arg(long)]
    run: PathBuf,
    /// Weights to prune instead of the run's latest checkpoint.
    #[arg(long, value_name = "PATH")]
    ckpt: Option<PathBuf>,
    /// Prune layers whose sparsity (1 - mean gate) on the validation split is at least this.
    #[arg(long, value_parser = finite_flag, default_value_t = 0.95)]
    threshold: f64,
    /// Directory for the pruned model (config.toml, model.safetensors, eval/, prune.json)
    /// [default: <run>/pruned-<threshold>]; it must not already hold a model.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Args)]
struct ConfigArgs {
    /// Experiment file (TOML with [model], [attention], [data], [train], [eval]); built-in
    /// defaults when omitted.
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// Override one config value, e.g. --set attention.window=64 (repeatable; applied in
    /// order after the file).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    sets: Vec<String>,
}

#[derive(Args)]
struct TrainCmd {
    #[command(flatten)]
    config: ConfigArgs,
    /// Run directory: resolved config, logs, checkpoints and the final evaluation go here.
    #[arg(long, short)]
    out: PathBuf,
    /// Continue the run in --out from its latest checkpoint (its saved config is used; --set
    /// may change only how it logs, checkpoints, evaluates, where it runs and the attention
    /// implementation: other changes are refused, naming each setting).
    #[arg(long)]
    resume: bool,
    /// Start from another run's weights (continued pretraining): a run directory, a
    /// checkpoint directory or a .safetensors file. Parameters with matching names are loaded;
    /// parameters the source lacks keep their initialisation.
    #[arg(long, value_name = "PATH", conflicts_with = "resume")]
    init_from: Option<PathBuf>,
    /// Stop after this many steps (writing a checkpoint) without shortening the schedule;
    /// continue later with --resume. For jobs cut into time slots.
    #[arg(long, value_name = "STEP")]
    stop_at_step: Option<usize>,
    /// No progress bar or status lines.
    #[arg(long, short)]
    quiet: bool,
    /// Where stderr is not a terminal (a Slurm log, nohup): seconds between status lines
    /// (step, loss, tokens/s, ETA).
    #[arg(long, value_name = "SECONDS", default_value_t = DEFAULT_STATUS_EVERY)]
    status_every: u64,
    /// Train data parallel over this many GPUs of this machine (train.ranks): one process
    /// each, started here; with train.device = "cpu", as many CPU processes.
    #[arg(long, value_name = "N")]
    gpus: Option<usize>,
}

#[derive(Args)]
struct EvalCmd {
    /// The run directory to evaluate (its config.toml describes the model).
    #[arg(long)]
    run: PathBuf,
    /// Weights to evaluate instead of the run's latest checkpoint (checkpoint directory or
    /// .safetensors file).
    #[arg(long, value_name = "PATH")]
    ckpt: Option<PathBuf>,
    /// Override a config value for this evaluation only, e.g. --set attention.method=swa
    /// --set attention.window=32 evaluates a full-attention model with a window (SWA-ZS).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    sets: Vec<String>,
    /// Output directory [default: <run>/eval, <run>/eval-<overrides> when --set is given; with
    /// probes or multiple choice, <run>/eval-tasks or <run>/eval-<overrides>-tasks, so the
    /// training's own report in <run>/eval is never overwritten].
    #[arg(long)]
    out: Option<PathBuf>,
    /// Split to evaluate.
    #[arg(long, default_value = "val", value_parser = ["val", "train"])]
    split: String,
    /// Long-context probes to run after the loss (sets eval.tasks): RULER's niah_single_1,
    /// niah_single_2, niah_single_3, niah_multikey_1, niah_multikey_2, niah_multikey_3,
    /// niah_multivalue, niah_multiquery, vt, cwe, fwe (the essay tasks need eval.haystack =
    /// "text"; eval.chat = true wraps them in the model's chat template), and the short probes
    /// niah_single, niah_multikey, niah_multivalue_short, passkey, mqar, variable_tracking.
    /// Lengths, depths, samples and haystack come from eval.lengths, eval.depths, eval.samples,
    /// eval.haystack.
    #[arg(long, value_delimiter = ',')]
    tasks: Vec<String>,
    /// Multiple-choice JSONL files (lines {"context", "choices", "gold"}), scored by
    /// log-likelihood (sets eval.mc).
    #[arg(long, num_args = 1..)]
    mc: Vec<PathBuf>,
    /// Write every multiple-choice item's scoring to samples_<task>.jsonl (each choice's
    /// log-likelihood and whether it is the greedy continuation, the prediction, the gold),
    /// as lm-evaluation-harness's --log_samples does, to compare item by item.
    #[arg(long)]
    log_samples: bool,
    /// Print nothing but errors.
    #[arg(long, short)]
    quiet: bool,
}

#[derive(Subcommand)]
enum DataCmd {
    /// Tokenise a corpus (files and directories of text, JSON Lines or Parquet, optionally
    /// gzip/zstd/xz-compressed; byte-level, or with a tokenizer.json) into train/val token
    /// shards plus meta.json, in parallel. Each file, line or row is one document. E.g. the
    /// Python sources of the installed torch:
    /// `data prepare --python-package torch --glob '*.py' --out data/torch-py`.
    Prepare(PrepareCmd),
    /// Generate the synthetic long-tail dependency corpus (tokens plus each position's
    /// dependency distance).
    Synth(SynthCmd),
    /// Write probe documents (prompt, answer, end of document), alone or mixed into a prepared
    /// corpus, so small models learn the probe format.
    Probes(ProbesCmd),
}

#[derive(Args)]
struct ProbesCmd {
    /// Output data set directory.
    #[arg(long, short)]
    out: PathBuf,
    #[command(flatten)]
    args: ProbesArgs,
}

#[derive(Args)]
struct PrepareCmd {
    /// Output directory (must not already hold a data set).
    #[arg(long, short)]
    out: PathBuf,
    #[command(flatten)]
    spec: PrepareSpec,
}

#[derive(Args)]
struct SynthCmd {
    /// Output directory (must not already hold a data set).
    #[arg(long, short)]
    out: PathBuf,
    #[command(flatten)]
    spec: SynthSpec,
}

/// Runs the command line. A panic (a bug, or an allocation that failed inside libtorch)
/// comes back as an error naming where it happened, never as a Rust panic.
pub fn main() -> Result<()> {
    panics::keep_first();
    match std::panic::catch_unwind(run) {
        Ok(result) => result,
        Err(_) => {
            let (msg, at) = panics::take();
            // libtorch's failed allocations, on the host and on a GPU.
            if msg.contains("can't allocate memory") || msg.contains("out of memory") {
                anyhow::bail!(
                    "out of memory: {}; lower train.batch_size (train.grad_accum keeps the \
                     tokens per step), data.seq_len, eval.batch_size, eval.lengths or the \
                     model's size",
                    torch_cause(&msg)
                );
            }
            anyhow::bail!(
                "internal error{at}: {} (please report it)",
                torch_cause(&msg)
            )
        }
    }
    .map_err(|e| {
        // An error of libtorch's carries its C++ backtrace: its first line is the cause.
        let text = format!("{e:#}");
        match text.contains("frame #0") {
            true => anyhow::anyhow!("{}", torch_cause(&text)),
            false => e,
        }
    })
}

fn run() -> Result<()> {
    match Cli::parse().command {
        Command::Train(c) => run_train(c),
        Command::Eval(c) => run_eval(c),
        Command::Convert(c) => run_convert(c),
        Command::Export(c) => {
            let dtype = OutDtype::parse(&c.dtype)?;
            println!(
                "{}",
                convert::export(&c.run, c.ckpt.as_deref(), &c.out, dtype)?.display()
            );
            Ok(())
        }
        Command::Bench(BenchCmd::Attention(c)) => bench::run_cmd(c),
        Command::Bench(BenchCmd::Decode(c)) => bench_decode::run_cmd(c),
        Command::Bench(BenchCmd::Train(c)) => run_bench_train(c),
        Command::Kernels(KernelsCmd::Build { cpu, arch }) => {
            let variant = match (cpu, arch) {
                (true, _) => Some(Variant::Cpu),
                (false, Some(cc)) => Some(Variant::Cuda(cc)),
                (false, None) => None,
            };
            println!("{}", kernels::build(variant, false)?.display());
            Ok(())
        }
        Command::Sweep(c) => run_sweep(c),
        Command::Plot(c) => {
            let out = c.out.unwrap_or_else(|| c.sweep.clone());
            let plotted = sweep::write_all(&c.sweep, &out, c.drop_absent)?;
            for w in &plotted.written {
                println!("{}", w.display());
            }
            eprint!("{}", sweep::unread_report(&plotted));
            Ok(())
        }
        Command::Prune(c) => run_prune(c),
        Command::Data(DataCmd::Prepare(c)) => {
            let summary = corpus::prepare(&c.spec, &c.out, false)?;
            eprintln!("{}", summary.report(&c.out));
            Ok(())
        }
        Command::Data(DataCmd::Probes(c)) => {
            let meta = c.args.write(&c.out)?;
            report_dataset(&meta, &c.out);
            Ok(())
        }
        Command::Data(DataCmd::Synth(c)) => {
            let meta = data::synth(&c.spec, &c.out)?;
            report_dataset(&meta, &c.out);
            Ok(())
        }
    }
}

fn run_train(c: TrainCmd) -> Result<()> {
    let mut sets = c.config.sets.clone();
    if let Some(n) = c.gpus {
        sets.push(format!("train.ranks={n}"));
    }
    let mut cfg = if c.resume {
        anyhow::ensure!(
            c.config.config.is_none(),
            "--resume uses the run's saved config.toml; drop --config"
        );
        Config::load(Some(&c.out.join("config.toml")), &sets)?
    } else {
        // Without --config a continued run takes the config of the run it starts from (its
        // model's shape, tokenizer and data), as `--config <source>/config.toml` would.
        let inherited = match (&c.config.config, &c.init_from) {
            (None, Some(src)) => source_config(src),
            _ => None,
        };
        if let Some(p) = &inherited {
            eprintln!(
                "note: no --config: starting from {} (the config of the run --init-from names); \
                 --set changes it",
                p.display()
            );
        }
        Config::load(c.config.config.as_deref().or(inherited.as_deref()), &sets)?
    };
    // A rank of a job (started below, by torchrun or by srun) trains; a process asked for
    // several ranks and in no job starts them.
    let place = ranks::place()?;
    match &place {
        Some(p) => {
            cfg.train.ranks = p.rendezvous.world;
            cfg.validate()?;
        }
        None if cfg.train.ranks > 1 => return ranks::launch(cfg.train.ranks),
        None => {}
    }
    let quiet = c.quiet || place.as_ref().is_some_and(|p| !p.leads());
    train::train(
        cfg,
        &TrainArgs {
            out: c.out,
            resume: c.resume,
            init_from: c.init_from,
            stop_at: c.stop_at_step,
            quiet,
            status_every: c.status_every,
            place,
        },
    )
}

/// The experiment file of the run `src` (`--init-from`) names: the `config.toml` of its
/// directory, or of the run holding the checkpoint directory or weights file it names.
fn source_config(src: &Path) -> Option<PathBuf> {
    let dir = if src.is_dir() { src } else { src.parent()? };
    std::iter::successors(Some(dir), |d| d.parent())
        .take(2)
        .map(|d| d.join("config.toml"))
        .find(|p| p.is_file())
}

fn run_convert(c: ConvertCmd) -> Result<()> {
    let dtype = OutDtype::parse(&c.dtype)?;
    let r = convert::convert(&c.from, c.config.as_deref(), &c.out, dtype, c.allow_pickle)?;
    println!(
        "{:?}: {} tensors, {} parameters -> {} (config {})",
        r.family,
        r.tensors,
        r.parameters,
        c.out.display(),
        r.config.display()
    );
    Ok(())
}

fn run_bench_train(c: BenchTrainCmd) -> Result<()> {
    if c.redraw {
        println!("{}", bench_train::redraw(&c.out)?.display());
        return Ok(());
    }
    let (model_name, model) = match &c.model {
        Some(spec) => (spec.clone(), presets::model(spec)?),
        None => {
            // The custom shape's flags, named as such.
            anyhow::ensure!(c.layers >= 1, "--layers must be at least 1");
            anyhow::ensure!(c.heads >= 1, "--heads must be at least 1");
            anyhow::ensure!(
                c.hidden % c.heads == 0,
                "--hidden {} is not a multiple of --heads {}",
                c.hidden,
                c.heads
            );
            anyhow::ensure!(
                (c.hidden / c.heads) % 2 == 0,
                "--hidden {} / --heads {} gives heads of {} values; rotary embedding needs an \
                 even head size",
                c.hidden,
                c.heads,
                c.hidden / c.heads
            );
            anyhow::ensure!(c.intermediate >= 1, "--intermediate must be at least 1");
            anyhow::ensure!(c.vocab >= 2, "--vocab must be at least 2");
            let m = ModelConfig {
                vocab_size: c.vocab,
                hidden_size: c.hidden,
                intermediate_size: c.intermediate,
                num_hidden_layers: c.layers,
                num_attention_heads: c.heads,
                num_key_value_heads: c.heads,
                ..Default::default()
            };
            // Named by its shape, so benches of two shapes in one --out keep their rows apart.
            let name = format!(
                "custom-l{}-d{}-h{}-f{}-v{}",
                c.layers, c.hidden, c.heads, c.intermediate, c.vocab
            );
            (name, m)
        }
    };
    let b = TrainBench {
        lengths: c.lengths,
        tokens: c.tokens,
        methods: match c.methods.is_empty() {
            true => TrainMethod::all().collect(),
            false => c.methods,
        },
        model_name,
        model,
        window: c.window,
        full_usage: c.full_usage,
        ste_sample: c.ste_sample,
        ppa_power: c.ppa_power,
        checkpointing: c.checkpointing,
        loss_chunk_tokens: c.loss_chunk_tokens,
        micro_batches: c.micro_batches,
        steps: c.steps,
        warmup: c.warmup,
        out: c.out,
        python: c.python,
        peers: if c.no_peers { Vec::new() } else { c.peers },
        peer_modes: c.peer_modes,
        profile: c.profile,
        repeats: c.repeats,
    };
    b.validate()?;
    println!("{}", bench_train::run_train(&b)?.display());
    Ok(())
}

fn run_prune(c: PruneCmd) -> Result<()> {
    let out = c
        .out
        .unwrap_or_else(|| c.run.join(format!("pruned-{}", c.threshold)));
    let r = prune::prune_l2a(&c.run, c.ckpt.as_deref(), c.threshold, &out)?;
    println!(
        "pruned layers {:?} of {}: KV cache {:.0} -> {:.0} bytes ({:.1}% of full attention's {:.0}); val loss {:.4} -> {:.4} ({:+.4}) -> {}",
        r.pruned_layers,
        r.sparsity.len(),
        r.kv_cache_bytes_before,
        r.kv_cache_bytes_after,
        100.0 * r.kv_cache_bytes_after / r.kv_cache_bytes_full,
        r.kv_cache_bytes_full,
        r.loss_before,
        r.loss_after,
        r.loss_after - r.loss_before,
        out.display()
    );
    Ok(())
}

fn report_dataset(meta: &data::Meta, out: &std::path::Path) {
    eprintln!(
        "wrote {} train and {} val tokens to {}",
        meta.train_tokens,
        meta.val_tokens,
        out.display()
    );
}

/// `<run>/eval`, `<run>/eval-<overrides>` when `--set` is given, and `-tasks` after either
/// when probes or multiple choice run: the training's final report in `<run>/eval` holds the
/// loss of the trained model and is never replaced by a task evaluation.
fn default_eval_dir(run: &std::path::Path, sets: &[String], tasks: bool) -> PathBuf {
    let mut name = String::from("eval");
    if !sets.is_empty() {
        let tag: String = sets
            .join("_")
            .chars()
            .map(
                |ch| match ch.is_ascii_alphanumeric() || ch == '.' || ch == '-' {
                    true => ch,
                    false => '_',
                },
            )
            .collect();
        // A long list of overrides is named by its first characters and a hash of the whole,
        // so the folder's name stays short and distinct.
        let tag = match tag.len() > 48 {
            true => format!(
                "{}-{:08x}",
                &tag[..40],
                crate::util::fnv1a(tag.as_bytes()) >> 32
            ),
            false => tag,
        };
        name = format!("{name}-{tag}");
    }
    if tasks {
        name.push_str("-tasks");
    }
    run.join(name)
}

fn run_eval(c: EvalCmd) -> Result<()> {
    let quote = |v: &[String]| {
        let items: Vec<String> = v.iter().map(|x| format!("{x:?}")).collect();
        format!("[{}]", items.join(", "))
    };
    let mut sets = c.sets.clone();
    if !c.tasks.is_empty() {
        sets.push(format!("eval.tasks={}", quote(&c.tasks)));
    }
    // Multiple choice alone reads no data set and computes no loss: its tokenizer is the
    // run's own (a converted model keeps it beside its weights), else its data set's.
    if c.tasks.is_empty() && !c.mc.is_empty() {
        sets.push("eval.tasks=[]".into());
        let mut run = LoadedRun::open(&c.run, &sets, c.ckpt.as_deref(), false)?;
        run.cfg.eval.mc = c.mc.clone();
        if !c.quiet {
            run.report_load();
        }
        return run_multiple_choice(&c, &run);
    }
    let mut run = LoadedRun::open(&c.run, &sets, c.ckpt.as_deref(), true)?;
    if !c.mc.is_empty() {
        // The paths as given: a path that is not UTF-8 survives, which text would not.
        run.cfg.eval.mc = c.mc.clone();
    }
    if !c.quiet {
        run.report_load();
    }
    let (cfg, built) = (&run.cfg, &run.built);
    let meta = run.meta()?;
    let with_tasks = !cfg.eval.tasks.is_empty() || !cfg.eval.mc.is_empty();
    let out = c
        .out
        .clone()
        .unwrap_or_else(|| default_eval_dir(&c.run, &c.sets, with_tasks));
    let split = data::Split::open(&cfg.data.dir, meta, &c.split)?;
    memory::check_eval(cfg, run.device)?;
    let mut report = eval::evaluate(&built.model, &split, cfg, &c.split, run.device, !c.quiet)?;
    report.checkpoint_step = run.step;
    report.timing = eval::timing_of(&built.model, &split, cfg, run.device);
    report::write_report(&out, &report, cfg)?;
    if !c.quiet {
        println!(
            "{} loss {:.4}  ppl {:.3}  bits/token {:.4}  (unigram entropy {:.4})  attended pairs / full causal {:.4}  ({} tokens of {}-token sequences) -> {}",
            c.split,
            report.loss,
            report.perplexity,
            report.bits_per_token,
            report.unigram_entropy,
            report.attention.pairs_vs_full,
            report.tokens,
            report.seq_len,
            out.display()
        );
        for b in &report.buckets {
            println!(
                "  {:>16}  {:>8} tokens  loss {:.4}",
                b.bucket, b.tokens, b.loss
            );
        }
        for src in &report.by_source {
            println!(
                "  {:>16}  {:>8} tokens  loss {:.4}",
                src.source, src.tokens, src.loss
            );
        }
        for p in &report.by_position {
            println!(
                "  {:>16}  {:>8} tokens  loss {:.4}",
                format!("positions {}-{}", p.from, p.to - 1),
                p.tokens,
                p.loss
            );
        }
    }
    if with_tasks {
        run_tasks(&c, &run, cfg, meta, &out)?;
    }
    Ok(())
}

/// The tasks of `cfg.eval` (probes, multiple choice) on the run, written to `out`, their
/// overall metrics printed.
fn run_tasks(
    c: &EvalCmd,
    run: &LoadedRun,
    cfg: &Config,
    meta: &data::Meta,
    out: &Path,
) -> Result<()> {
    let opts = RunOptions {
        log_samples: c.log_samples,
        progress: !c.quiet,
    };
    let results = tasks::run(
        &run.built.model,
        cfg,
        meta,
        run.device,
        out,
        &run.weights,
        &opts,
    )?;
    if !c.quiet {
        for (task, metrics) in &results {
            let shown: Vec<String> = metrics
                .iter()
                .filter(|(k, _)| !k.ends_with("_stderr"))
                .map(|(k, v)| format!("{k} {v:.4}"))
                .collect();
            println!("  {task:>18}  {}", shown.join("  "));
        }
        println!("-> {}", out.display());
    }
    Ok(())
}

/// `eval --mc` without probes: the run's own tokenizer where its folder holds one (read as
/// a data set of that tokenizer would be), else its data set's.
fn run_multiple_choice(c: &EvalCmd, run: &LoadedRun) -> Result<()> {
    let mut cfg = run.cfg.clone();
    let meta = match c.run.join("tokenizer.json").is_file() {
        true => {
            cfg.data.dir = c.run.clone();
            data::Meta::of_tokenizer(cfg.model.vocab_size)
        }
        false => {
            let dir = &cfg.data.dir;
            anyhow::ensure!(
                !dir.as_os_str().is_empty(),
                "multiple choice needs a tokenizer: {} holds no tokenizer.json and its config \
                 names no data set (set data.dir to one prepared with its tokenizer)",
                c.run.display()
            );
            data::read_meta(dir)?
        }
    };
    let out = c
        .out
        .clone()
        .unwrap_or_else(|| default_eval_dir(&c.run, &c.sets, true));
    run_tasks(c, run, &cfg, &meta, &out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An evaluation's default folder sits in the run it evaluates, named by its overrides;
    /// a long list of them is cut and told apart by a hash, so names stay short.
    #[test]
    fn evaluation_folders_have_short_distinct_names() {
        let run = Path::new("runs/x");
        assert_eq!(default_eval_dir(run, &[], false), run.join("eval"));
        let set = |s: &str| vec![s.to_string()];
        assert_eq!(
            default_eval_dir(run, &set("attention.window=32"), true),
            run.join("eval-attention.window_32-tasks")
        );
        let long = |w: u32| {
            vec![
                format!("attention.method=swa"),
                format!("eval.tasks=[\"niah_single_1\",\"niah_single_2\"]"),
                format!("attention.window={w}"),
            ]
        };
        let (a, b) = (
            default_eval_dir(run, &long(8), false),
            default_eval_dir(run, &long(9), false),
        );
        let name = |p: &Path| p.file_name().unwrap().to_string_lossy().into_owned();
        assert_ne!(a, b);
        assert!(
            name(&a).len() <= 5 + 40 + 9 && a.parent() == Some(run),
            "{a:?}"
        );
    }

    /// libtorch's refusal of an allocation, as tch panics with it and as an error carries it:
    /// its cause on one line, without the C++ backtrace.
    #[test]
    fn a_libtorch_error_shows_its_cause_alone() {
        let e = tch::Tensor::f_empty([1i64 << 45], (tch::Kind::Float, tch::Device::Cpu))
            .err()
            .unwrap();
        let panicked = format!("called `Result::unwrap()` on an `Err` value: {e:?}");
        for text in [panicked, format!("{e}")] {
            assert!(text.contains("frame #0"), "{text}");
            let cause = torch_cause(&text);
            assert!(
                cause.starts_with("DefaultCPUAllocator: can't allocate memory")
                    && !cause.contains("frame")
                    && !cause.contains('\n')
                    && cause.len() < 200,
                "{cause}"
            );
        }
        assert_eq!(torch_cause("plain message"), "plain message");
    }
    use clap::CommandFactory;

    fn check(cmd: &clap::Command, path: &str) {
        for arg in cmd.get_arguments() {
            let id = arg.get_id().as_str();
            if id == "help" || id == "version" {
                continue;
            }
            assert!(
                arg.get_help().is_some_and(|h| h.to_string().len() > 10),
                "{path} --{id} has no help text"
            );
        }
        for sub in cmd.get_subcommands() {
            assert!(
                sub.get_about().is_some(),
                "{path} {} has no description",
                sub.get_name()
            );
            check(sub, &format!("{path} {}", sub.get_name()));
        }
    }

    #[test]
    fn help_explains_every_flag() {
        Cli::command().debug_assert();
        check(&Cli::command(), "attnsweep");
    }
}
