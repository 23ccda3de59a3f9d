//! `[data]` and `[train]`: what a run reads and how it trains.

use super::check::{check, check_open_f};
use anyhow::{bail, ensure, Result};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// A directory written by `attnsweep data prepare` or `attnsweep data synth`.
    pub dir: PathBuf,
    pub seq_len: usize,
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            dir: PathBuf::new(),
            seq_len: 256,
        }
    }
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Dtype {
    Fp32,
    Bf16,
}

/// Which blocks run their forward again in the backward instead of keeping their activations
/// (`model/step.rs`).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Checkpointing {
    None,
    /// Every block.
    Full,
    /// Every other block, from the first (torchtitan's selective checkpointing by layer):
    /// about half the activations for about half the recomputation.
    Selective,
    /// The first of none, selective and full whose planned peak fits the device's memory.
    Auto,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    pub steps: usize,
    pub batch_size: usize,
    pub grad_accum: usize,
    pub lr: f64,
    /// Cosine decay ends at lr * min_lr_ratio.
    pub min_lr_ratio: f64,
    pub warmup_steps: usize,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub adam_eps: f64,
    /// Global gradient-norm clip; 0 disables clipping.
    pub grad_clip: f64,
    pub seed: u64,
    /// Compute dtype; parameters and optimizer state stay fp32.
    pub dtype: Dtype,
    /// "auto" (CUDA when available), "cpu", "cuda" or "cuda:N".
    pub device: String,
    /// Processes that train the model together, data parallel: one per GPU (NCCL between
    /// them, each on the GPU of its local rank), or CPU processes (Gloo). The global batch
    /// stays `batch_size x grad_accum` sequences, each rank running `grad_accum / ranks` of
    /// the micro-batches, so `ranks` must divide `grad_accum`. `train --gpus N` sets it; a job
    /// a launcher started (torchrun, srun) takes its ranks from the environment instead.
    pub ranks: usize,
    /// Seconds a collective waits for the other ranks before the job stops with an error.
    pub dist_timeout_s: f64,
    pub log_every: usize,
    pub ckpt_every: usize,
    /// How many step checkpoints to keep on disk (the newest ones).
    pub keep_checkpoints: usize,
    /// Validation loss every N steps (0: only at the end).
    pub eval_every: usize,
    /// Keep the MLP weights fixed; train attention, routers and norms only (L2A E.1.3).
    pub freeze_mlp: bool,
    /// L2A with a learned router: for the first N steps of the run every gate is held open
    /// (every token runs global attention) and the router does not learn, so the global
    /// module trains on every token before the router judges it. Not in the paper (0, the
    /// default): a diagnostic of router collapse, which happens when the router closes
    /// before the global module, started as a copy of attention reading other inputs, has
    /// become useful.
    pub router_hold_steps: usize,
    /// The routers' penalty (`attention.lambda`) is off during warmup and then grows
    /// linearly to its full weight at the last step, as the L2A authors' code schedules it
    /// (the paper states no schedule). false (the default): the full weight from the start.
    pub lambda_ramp: bool,
    /// The routers' learning rate over `lr` (parameters named `*.router.*`, at every step of
    /// the schedule). 1 (the default) is the papers' single rate. Routers are new parameters
    /// that a continuation of a few hundred steps at a fine-tuning rate (AHA's 3e-5) barely
    /// moves: under Adam each step moves a weight by about the rate, so this many times more
    /// steps' worth of movement is what the multiplier buys.
    pub router_lr_mult: f64,
    /// Activation checkpointing by block: "none", "full", "selective" or "auto" (the memory
    /// plan, `run/memory.rs`, picks the first that fits the device).
    pub activation_checkpointing: Checkpointing,
    /// Tokens a chunk of the loss: the output projection and cross-entropy run one chunk at a
    /// time, forward and backward, so the logits never exist whole. 0 chooses: the whole
    /// micro-batch where its logits take at most 1 GiB, else chunks of about 1 GiB of logits.
    pub loss_chunk_tokens: usize,
    /// Sequences one forward and backward pass takes: a rank's consecutive micro-batches
    /// joined into passes of this many (a multiple of batch_size, whose count divides the
    /// rank's grad_accum / ranks micro-batches); 0 takes batch_size. The same sequences in the
    /// same order and, every micro-batch holding as many tokens, the same mean loss: fewer,
    /// larger kernels for more activation memory, the same computation up to rounding, so like
    /// ranks it changes where and how the work runs, not a run's identity (gates drawn at
    /// random hash the step's row of a sequence, so a join draws them alike).
    pub micro_batch: usize,
    /// Capture the step's forward and backward as a CUDA graph after its first eager run and
    /// replay it (`run/train_graph.rs`): the same kernels on the same data without the host
    /// launching each (PERFORMANCE.md, the CUDA-graph entry). Needs the
    /// kernel library on a GPU (dtype bf16, head_dim 64 or 128), one process, one pass a step
    /// (grad_accum / micro_batch's join of 1), gates that draw nothing at random and no ramp
    /// (lambda_ramp, attention.top_k_ramp); changes how the work runs, not what it computes.
    pub cuda_graph: bool,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            steps: 1000,
            batch_size: 16,
            grad_accum: 1,
            lr: 3e-3,
            min_lr_ratio: 0.1,
            warmup_steps: 100,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            adam_eps: 1e-8,
            grad_clip: 1.0,
            seed: 1337,
            dtype: Dtype::Fp32,
            device: "auto".into(),
            ranks: 1,
            dist_timeout_s: 300.0,
            log_every: 10,
            ckpt_every: 200,
            keep_checkpoints: 2,
            eval_every: 0,
            freeze_mlp: false,
            router_hold_steps: 0,
            lambda_ramp: false,
            router_lr_mult: 1.0,
            activation_checkpointing: Checkpointing::Auto,
            loss_chunk_tokens: 0,
            micro_batch: 0,
            cuda_graph: false,
        }
    }
}

impl DataConfig {
    pub(crate) fn validate(&self) -> Result<()> {
        check("data.seq_len", self.seq_len, 2, 1 << 22)
    }
}

impl TrainConfig {
    /// Sequences a forward pass takes (`micro_batch`, or `batch_size` where it is 0).
    pub(crate) fn forward_batch(&self) -> usize {
        match self.micro_batch {
            0 => self.batch_size,
            m => m,
        }
    }

    /// Micro-batches a forward pass joins.
    pub(crate) fn joined(&self) -> usize {
        self.forward_batch() / self.batch_size
    }

    /// Sequences a rank trains a step on when the step is shared by `ranks`: its whole share
    /// as one pass is `train.micro_batch` at this value.
    pub(crate) fn share(&self, ranks: usize) -> usize {
        self.batch_size * self.grad_accum / ranks
    }

    pub(crate) fn validate(&self) -> Result<()> {
        let t = self;
        check("train.steps", t.steps, 1, 1 << 40)?;
        check("train.batch_size", t.batch_size, 1, 1 << 20)?;
        check("train.grad_accum", t.grad_accum, 1, 1 << 16)?;
        check("train.ranks", t.ranks, 1, 1 << 12)?;
        ensure!(
            t.grad_accum % t.ranks == 0,
            "train.grad_accum = {} is not a multiple of train.ranks = {}: the global batch of \
             batch_size x grad_accum sequences is shared out a whole number of micro-batches \
             a rank (set train.grad_accum to a multiple of {})",
            t.grad_accum,
            t.ranks,
            t.ranks
        );
        if t.micro_batch != 0 {
            let mine = t.grad_accum / t.ranks;
            let fits: Vec<String> = (1..=mine)
                .filter(|j| mine % j == 0)
                .map(|j| (j * t.batch_size).to_string())
                .collect();
            ensure!(
                t.micro_batch % t.batch_size == 0 && mine % (t.micro_batch / t.batch_size) == 0,
                "train.micro_batch = {} does not join a whole number of a rank's {mine} \
                 micro-batches of {} sequences (grad_accum {} over {} ranks): use one of {} \
                 (or 0, one micro-batch a pass)",
                t.micro_batch,
                t.batch_size,
                t.grad_accum,
                t.ranks,
                fits.join(", ")
            );
        }
        check_open_f("train.dist_timeout_s", t.dist_timeout_s, 0.0, 86_400.0)?;
        check_open_f("train.lr", t.lr, 0.0, 10.0)?;
        check("train.min_lr_ratio", t.min_lr_ratio, 0.0, 1.0)?;
        check("train.warmup_steps", t.warmup_steps, 0, t.steps)?;
        check("train.weight_decay", t.weight_decay, 0.0, 10.0)?;
        check("train.beta1", t.beta1, 0.0, 0.999_999)?;
        check("train.beta2", t.beta2, 0.0, 0.999_999_999)?;
        check_open_f("train.adam_eps", t.adam_eps, 0.0, 1.0)?;
        check("train.grad_clip", t.grad_clip, 0.0, 1e6)?;
        check_open_f("train.router_lr_mult", t.router_lr_mult, 0.0, 1e6)?;
        parse_device(&t.device).map(|_| ())?;
        check("train.log_every", t.log_every, 1, 1 << 40)?;
        check("train.ckpt_every", t.ckpt_every, 1, 1 << 40)?;
        check("train.keep_checkpoints", t.keep_checkpoints, 1, 1 << 20)?;
        Ok(())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceSpec {
    Auto,
    Cpu,
    Cuda(usize),
}

pub(crate) fn parse_device(s: &str) -> Result<DeviceSpec> {
    Ok(match s {
        "auto" => DeviceSpec::Auto,
        "cpu" => DeviceSpec::Cpu,
        "cuda" => DeviceSpec::Cuda(0),
        _ => match s.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
            Some(n) => DeviceSpec::Cuda(n),
            None => bail!("train.device = {s:?} is not one of auto, cpu, cuda, cuda:N"),
        },
    })
}
