//! Memory a command will need, estimated from its config before anything is allocated, and
//! compared with what the machine has: a run that cannot fit is refused with both figures,
//! instead of dying half-way in an allocation failure or at the hands of the kernel's
//! out-of-memory killer.
//!
//! The estimates count only what is allocated at one time for certain (parameters, the
//! gradients and optimizer moments of those that train, the larger of training's and
//! evaluation's logits with their log-softmax, the dense masks of windowed and sparse layers,
//! the key-value cache of decoding), so they stay below the true need: a run they refuse
//! could not have fitted, and what they leave out (other activations, allocator slack) is
//! what the caught allocation errors are for.
//!
//! Training on a GPU is planned once the model is on the device (`plan_on_device`): each
//! block's forward and backward is measured at two lengths and fitted, the peak of a step
//! predicted for each checkpointing choice from those fits and the allocator's counts, and the
//! first choice that fits what the driver reports is taken; a run none fits is refused there.

use crate::config::{Checkpointing, Config, Dtype};
use crate::model::attention::{projection_params, spec};
use crate::model::attention::{ForwardCtx, Keys};
use crate::model::kernels::Kernels;
use crate::model::step::{seeded, StepPlan};
use crate::model::sync;
use crate::model::Llama;
use anyhow::{bail, Result};
use tch::Device;
use tch::{Kind, Tensor};

pub(crate) const GIB: f64 = (1u64 << 30) as f64;

/// Parameters of the model a config describes, a method's additions included (L2A's global
/// module, SwiAttn's second output projection; routers are negligible).
pub(crate) fn parameters(cfg: &Config) -> f64 {
    let m = &cfg.model;
    let (d, f, v) = (
        m.hidden_size as f64,
        m.intermediate_size as f64,
        m.vocab_size as f64,
    );
    let attention = projection_params(m);
    let extra = (spec(cfg.attention.method).extra_params)(m, &cfg.attention);
    let layer = attention + extra + 3.0 * d * f + 2.0 * d;
    let head = if m.tie_word_embeddings { 0.0 } else { v * d };
    v * d + head + d + m.num_hidden_layers as f64 * layer
}

/// Bytes of the dense `[len, len]` boolean mask a windowed or sparse layer builds on the
/// reference path (full attention needs none: `MethodSpec::dense_mask`).
fn mask_bytes(cfg: &Config, len: usize) -> f64 {
    match spec(cfg.attention.method).dense_mask {
        true => (len as f64).powi(2),
        false => 0.0,
    }
}

/// Logits of `rows` sequences of `len` tokens in fp32 and their log-softmax.
fn logits_bytes(cfg: &Config, rows: usize, len: usize) -> f64 {
    2.0 * 4.0 * (rows * len) as f64 * cfg.model.vocab_size as f64
}

/// Memory on the host now available to this process: the kernel's MemAvailable, lowered to
/// what a cgroup (a container's or a Slurm job's) still allows; None where neither is known.
pub(crate) fn available_host() -> Option<f64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let avail = meminfo.as_deref().and_then(|t| {
        t.lines()
            .find(|l| l.starts_with("MemAvailable:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<f64>().ok())
            .map(|kb| kb * 1024.0)
    });
    let read = |f: &str| {
        std::fs::read_to_string(format!("/sys/fs/cgroup/{f}"))
            .ok()
            .and_then(|t| t.trim().parse::<f64>().ok())
    };
    let cgroup = match (read("memory.max"), read("memory.current")) {
        (Some(max), Some(cur)) => Some((max - cur).max(0.0)),
        _ => None,
    };
    match (avail, cgroup) {
        (Some(a), Some(c)) => Some(a.min(c)),
        (a, c) => a.or(c),
    }
}

/// The most resident memory this process has held so far (Linux's `VmHWM`); None where
/// the kernel does not say.
pub(crate) fn host_peak() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))?
        .split_whitespace()
        .nth(1)?
        .parse::<f64>()
        .ok()?;
    Some(kb * 1024.0)
}

/// Refuses `parts` (what, bytes) when their sum exceeds what the device has: the host's
/// available memory, or a GPU's free memory and its allocator's cache as the CUDA kernel
/// library reads them (nothing is checked on a GPU where that library is not built).
/// `advice` says which settings lower the need.
fn check(what: &str, parts: &[(&str, f64)], device: Device, advice: &str) -> Result<()> {
    let have = match device {
        Device::Cpu => available_host(),
        Device::Cuda(i) => crate::model::kernels::cuda()
            .and_then(|k| k.cuda_memory(i, false).ok())
            .map(|m| m.free + m.reserved),
        _ => None,
    };
    check_against(what, parts, have, advice)
}

/// `check` against `have` bytes (nothing checked where it is unknown).
fn check_against(what: &str, parts: &[(&str, f64)], have: Option<f64>, advice: &str) -> Result<()> {
    let need: f64 = parts.iter().map(|p| p.1).sum();
    let Some(have) = have else {
        return Ok(());
    };
    if need > have {
        let shown: Vec<String> = parts
            .iter()
            .filter(|p| p.1 > 0.0)
            .map(|(n, b)| format!("{n} {:.2} GiB", b / GIB))
            .collect();
        bail!(
            "{what} needs at least {:.2} GiB of memory ({}), but this machine has {:.2} GiB \
             available; {advice}",
            need / GIB,
            shown.join(", "),
            have / GIB
        );
    }
    Ok(())
}

/// One allocation of `bytes` on the host for `what`, refused where the host lacks them.
pub(crate) fn check_host(what: &str, bytes: f64, advice: &str) -> Result<()> {
    check(what, &[("tensors", bytes)], Device::Cpu, advice)
}

/// A model loaded for evaluation, conversion or export: its parameters.
pub(crate) fn check_model(cfg: &Config, device: Device) -> Result<()> {
    check(
        "the model",
        &[("parameters", 4.0 * parameters(cfg))],
        device,
        "this model does not fit here",
    )
}

/// Parameters `train.freeze_mlp` keeps fixed (`train::frozen_by_freeze_mlp`): the MLPs, the
/// embedding and the head. They need no gradients or optimizer moments.
fn frozen_parameters(cfg: &Config) -> f64 {
    if !cfg.train.freeze_mlp {
        return 0.0;
    }
    let m = &cfg.model;
    let (d, v) = (m.hidden_size as f64, m.vocab_size as f64);
    let head = if m.tie_word_embeddings { 0.0 } else { v * d };
    v * d + head + m.num_hidden_layers as f64 * 3.0 * d * m.intermediate_size as f64
}

/// Bytes of one element in the compute dtype.
fn elt(cfg: &Config) -> f64 {
    match cfg.train.dtype {
        Dtype::Fp32 => 4.0,
        Dtype::Bf16 => 2.0,
    }
}

/// Activations one block keeps for its backward pass, per token, in the compute dtype, as
/// the reference path's autograd saves them: the block's input and the attention's
/// normalised input; the queries, keys and values, their rotated halves and rotated results
/// (RoPE), the attention's output and its reshaped copy; the residual sum and the MLP's
/// normalised input; the MLP's gate and up projections, the gate's SiLU and the product. That
/// is 4 d + 5 q + 4 kv + 4 f values. Measured on the CPU (fp32, full attention, the loss in
/// chunks; the growth of peak resident memory with the batch), a step keeps 1.03 to 1.16
/// times this with the whole model's (`activation_bytes`): the norms' statistics and the
/// backward's transient gradients are left out, so it stays below the true need.
fn block_bytes_per_token(cfg: &Config) -> f64 {
    let m = &cfg.model;
    let (d, f) = (m.hidden_size as f64, m.intermediate_size as f64);
    let q = (m.num_attention_heads * m.head_dim()) as f64;
    let kv = (m.num_key_value_heads * m.head_dim()) as f64;
    (4.0 * d + 5.0 * q + 4.0 * kv + 4.0 * f) * elt(cfg)
}

/// Activations a micro-batch keeps for its backward pass with `recomputed` of its blocks run
/// again in the backward: the kept blocks' (`block_bytes_per_token`), each recomputed block's
/// input, one recomputed block's activations while its backward runs, and the final norm's
/// input and output.
pub(crate) fn activation_bytes(cfg: &Config, recomputed: usize) -> f64 {
    let tokens = (cfg.train.forward_batch() * cfg.data.seq_len) as f64;
    let layers = cfg.model.num_hidden_layers;
    let final_norm = 2.0 * cfg.model.hidden_size as f64 * elt(cfg);
    let kept = (layers - recomputed) as f64 * block_bytes_per_token(cfg) + final_norm;
    let inputs = recomputed as f64 * cfg.model.hidden_size as f64 * elt(cfg);
    let one = match recomputed {
        0 => 0.0,
        _ => block_bytes_per_token(cfg),
    };
    tokens * (kept + inputs + one)
}

/// Logits a loss chunk holds at most where `train.loss_chunk_tokens = 0` chooses.
const LOSS_CHUNK_BYTES: f64 = GIB;

/// Tokens a chunk of the loss under `train.loss_chunk_tokens`, None for the whole micro-batch
/// at once. 0 chooses: whole where the micro-batch's logits take at most `LOSS_CHUNK_BYTES`,
/// else chunks of about that much (a multiple of 256 tokens).
pub(crate) fn loss_chunk(cfg: &Config) -> Option<usize> {
    let rows = cfg.train.forward_batch() * cfg.data.seq_len;
    let row_bytes = cfg.model.vocab_size.max(1) as f64 * elt(cfg);
    match cfg.train.loss_chunk_tokens {
        0 if rows as f64 * row_bytes <= LOSS_CHUNK_BYTES => None,
        0 => Some(((LOSS_CHUNK_BYTES / row_bytes) as usize / 256 * 256).max(256)),
        n if n >= rows => None,
        n => Some(n),
    }
}

/// How a training run keeps what its backward needs, and the peak memory that predicts.
#[derive(Clone, Debug)]
pub(crate) struct MemoryPlan {
    /// The checkpointing chosen (never auto).
    pub(crate) checkpointing: Checkpointing,
    pub(crate) step: StepPlan,
    /// Predicted peak bytes: on a GPU, of tensors on the device (what its caching allocator
    /// counts as allocated); on the CPU, the lower bound the host was checked against.
    pub(crate) peak: f64,
}

impl MemoryPlan {
    fn new(cfg: &Config, checkpointing: Checkpointing, peak: f64) -> Self {
        MemoryPlan {
            checkpointing,
            step: StepPlan::new(checkpointing, cfg.model.num_hidden_layers, loss_chunk(cfg)),
            peak,
        }
    }

    /// One line for the run's output: the checkpointing (and what chose it), the loss's
    /// chunks, and the predicted peak where a GPU's was planned.
    pub(crate) fn describe(&self, cfg: &Config, planned: Option<f64>) -> String {
        let how = match cfg.train.activation_checkpointing {
            Checkpointing::Auto => " (auto)",
            _ => "",
        };
        let loss = match self.step.loss_chunk {
            Some(n) => format!("the loss in chunks of {n} tokens"),
            None => "the loss over the whole micro-batch".into(),
        };
        let peak = planned.map_or(String::new(), |p| {
            format!(", predicted peak {:.2} GiB on the GPU", p / GIB)
        });
        format!(
            "memory: activation checkpointing {}{how}, {loss}{peak}",
            format!("{:?}", self.checkpointing).to_lowercase()
        )
    }
}

/// The choices `train.activation_checkpointing` leaves, cheapest first.
fn candidates(cfg: &Config) -> Vec<Checkpointing> {
    match cfg.train.activation_checkpointing {
        Checkpointing::Auto => vec![
            Checkpointing::None,
            Checkpointing::Selective,
            Checkpointing::Full,
        ],
        c => vec![c],
    }
}

/// Copies of the gradients a rank's reducer keeps (its buckets, `kernels/dist.cpp`): one for
/// a rank of several, none for a process alone.
fn buckets(cfg: &Config) -> f64 {
    match cfg.train.ranks {
        1 => 0.0,
        _ => 1.0,
    }
}

/// What training needs on the CPU under `checkpointing`, as (what, bytes) parts: parameters,
/// the gradients and AdamW moments of those that train, the activations kept, the larger of a
/// loss chunk's logits (with their gradient) and an evaluation batch's, and the masks.
fn training_parts(cfg: &Config, checkpointing: Checkpointing) -> Vec<(&'static str, f64)> {
    let (t, e) = (&cfg.train, &cfg.eval);
    let len = cfg.data.seq_len;
    let trained = parameters(cfg) - frozen_parameters(cfg);
    let chunk_rows = loss_chunk(cfg).unwrap_or(t.forward_batch() * len);
    let recomputed = StepPlan::new(checkpointing, cfg.model.num_hidden_layers, None)
        .recompute
        .iter()
        .filter(|&&r| r)
        .count();
    vec![
        ("parameters", 4.0 * parameters(cfg)),
        (
            "gradients and optimizer state",
            (12.0 + 4.0 * buckets(cfg)) * trained,
        ),
        (
            "activations kept for the backward pass",
            activation_bytes(cfg, recomputed),
        ),
        (
            "logits of a batch",
            (1.5 * logits_bytes(cfg, 1, chunk_rows)).max(logits_bytes(
                cfg,
                e.batch_size,
                cfg.eval_seq_len(),
            )),
        ),
        ("attention masks", mask_bytes(cfg, len)),
    ]
}

const TRAINING_ADVICE: &str = "set train.activation_checkpointing = \"auto\" (it tries \"full\" \
     too) and a smaller train.loss_chunk_tokens, or lower train.micro_batch where it is set, or \
     train.batch_size (train.grad_accum keeps the tokens per step), data.seq_len, eval.batch_size or the model's size";

/// Training, before the model is built: on the CPU, the first checkpointing
/// `train.activation_checkpointing` allows whose lower bound fits the host's memory, refused
/// with the estimate of the last one tried when none does. On a GPU, whose memory is planned
/// once the model is on it (`plan_on_device`), the cheapest choice, unchecked.
pub(crate) fn check_training(cfg: &Config, device: Device) -> Result<MemoryPlan> {
    plan_training(cfg, (device == Device::Cpu).then(available_host).flatten())
}

/// `check_training` with `have` bytes of memory (none checked where unknown).
fn plan_training(cfg: &Config, have: Option<f64>) -> Result<MemoryPlan> {
    let mut refused = None;
    for c in candidates(cfg) {
        let parts = training_parts(cfg, c);
        match check_against("training", &parts, have, TRAINING_ADVICE) {
            Ok(()) => return Ok(MemoryPlan::new(cfg, c, parts.iter().map(|p| p.1).sum())),
            Err(e) => refused = Some(e),
        }
    }
    Err(refused.expect("at least one choice"))
}

/// Memory a block takes on the device for a batch of `B` sequences of `L` tokens:
/// `k + B (a L + c L²)` bytes. `k` holds what does not grow with the tokens (the weights cast
/// to the compute dtype); `c` is zero on the kernels, whose needs are linear in `L`, and the
/// reference path's dense masks and score matrices give it.
#[derive(Clone, Copy, Debug, Default)]
struct Fit {
    k: f64,
    a: f64,
    c: f64,
}

impl Fit {
    /// The fit through `points` `(L, bytes)` of one sequence at distinct lengths: a line for
    /// two, a parabola for three (one: a line through the origin).
    fn through(points: &[(f64, f64)]) -> Fit {
        match *points {
            [(l1, y1), (l2, y2), (l3, y3)] => {
                let (s1, s2) = ((y2 - y1) / (l2 - l1), (y3 - y2) / (l3 - l2));
                let c = (s2 - s1) / (l3 - l1);
                let a = s1 - c * (l1 + l2);
                Fit {
                    k: y1 - a * l1 - c * l1 * l1,
                    a,
                    c,
                }
            }
            [(l1, y1), (l2, y2)] => {
                let a = (y2 - y1) / (l2 - l1);
                Fit {
                    k: y1 - a * l1,
                    a,
                    c: 0.0,
                }
            }
            [(l, y)] => Fit {
                k: 0.0,
                a: y / l,
                c: 0.0,
            },
            _ => Fit::default(),
        }
    }

    fn at(&self, batch: f64, l: f64) -> f64 {
        (self.k + batch * (self.a * l + self.c * l * l)).max(0.0)
    }
}

/// One block's memory on the device: what its forward keeps for the backward (its output
/// included), and the most its backward (the block's forward again first, where it is
/// recomputed) holds beyond that.
#[derive(Clone, Copy, Debug)]
struct BlockCost {
    kept: Fit,
    transient: Fit,
}

/// The longest sequence a block is probed at: long enough that allocation granularity is
/// noise, short enough to cost milliseconds.
const PROBE_LEN: usize = 2048;

/// Measures each block of `model` on `device`: its forward and backward on one random
/// sequence at two lengths up to `PROBE_LEN`, reading the caching allocator's counts
/// (`Kernels::cuda_memory`), fitted per block. Only the block's input gets a gradient, so no
/// parameter's gradient is made.
fn probe_blocks(
    model: &Llama,
    kern: &Kernels,
    index: usize,
    cfg: &Config,
) -> Result<Vec<BlockCost>> {
    let len = cfg.data.seq_len;
    let device = Device::Cuda(index);
    let long = len.min(PROBE_LEN);
    // A parabola on the reference path, a line on the kernels (`Fit`).
    let mut lengths: Vec<usize> = match model.kernels {
        Some(_) => vec![long / 2, long],
        None => vec![long / 4, long / 2, long],
    };
    lengths.retain(|&l| l >= 1);
    lengths.dedup();
    let d = model.cfg.hidden_size as i64;
    let ctx = ForwardCtx::default();
    let mut out = Vec::new();
    for i in 0..model.layers.len() {
        let mut kept = Vec::new();
        let mut transient = Vec::new();
        for &l in &lengths {
            let seq = model.sequence(l as i64, device);
            let (masks, rope) = (&seq.masks, &seq.rope);
            let x = Tensor::randn([1, l as i64, d], (Kind::Float, device))
                .to_kind(model.compute)
                .set_requires_grad(true);
            sync(device);
            let before = kern.cuda_memory(index, false)?.allocated;
            let (y, attn) = model.block(i, &x, rope, &Keys::Chunk(masks), &ctx);
            let g = y.ones_like();
            sync(device);
            let after = kern.cuda_memory(index, true)?.allocated;
            let g_bytes = (g.numel() * g.kind().elt_size_in_bytes()) as f64;
            let mut s = seeded(&y, &g);
            if let Some(r) = &attn.reg {
                s = s + r.term(&Tensor::zeros([1, l as i64], (Kind::Float, device)));
            }
            drop(attn);
            let _ = Tensor::run_backward(&[&s], &[&x], false, false);
            sync(device);
            let peak = kern.cuda_memory(index, false)?.peak;
            kept.push((l as f64, after - before - g_bytes));
            transient.push((l as f64, peak - after));
        }
        out.push(BlockCost {
            kept: Fit::through(&kept),
            transient: Fit::through(&transient),
        });
    }
    Ok(out)
}

/// Peak bytes on the device of a training step of `cfg` under `step`, with `costs` per block
/// and `fixed` bytes of parameters, gradients and optimizer state.
fn predict(
    cfg: &Config,
    costs: &[BlockCost],
    step: &StepPlan,
    fixed: f64,
    fused_loss: bool,
) -> f64 {
    let m = &cfg.model;
    let (b, l) = (cfg.train.forward_batch() as f64, cfg.data.seq_len as f64);
    let e = elt(cfg);
    // One hidden state of the micro-batch: the embeddings, a recomputed block's input, a
    // gradient between blocks.
    let act = b * l * m.hidden_size as f64 * e;
    let kept: Vec<f64> = costs.iter().map(|c| c.kept.at(b, l)).collect();
    let state: Vec<f64> = kept
        .iter()
        .zip(&step.recompute)
        .map(|(&k, &r)| if r { act } else { k })
        .collect();
    // The loss: the final norm's output and its gradient, the head's weight in the compute
    // dtype, a chunk's logits and their gradient (fp32 copies and a log-softmax besides on the
    // reference path).
    let rows = step.loss_chunk.map_or(b * l, |c| c as f64);
    let head = if e < 4.0 {
        (m.vocab_size * m.hidden_size) as f64 * e
    } else {
        0.0
    };
    let per_logit = if fused_loss { 2.0 * e } else { 2.0 * e + 12.0 };
    let loss = 2.0 * act + head + rows * m.vocab_size as f64 * per_logit;
    let forward: f64 = act + state.iter().sum::<f64>();
    let mut peak = forward + loss;
    // The backward of block i: the blocks below it as the forward left them, the block's own
    // activations (run again where recomputed) and its backward's, the gradients in and out.
    for i in 0..costs.len() {
        let below: f64 = state[..i].iter().sum();
        let own = kept[i] + costs[i].transient.at(b, l);
        peak = peak.max(act + below + own + 2.0 * act);
    }
    fixed + peak
}

/// Training on a GPU, once the model is built there: each block measured
/// (`probe_blocks`), then the first checkpointing `train.activation_checkpointing` allows
/// whose predicted peak fits what the device has, or, where none does, a refusal with the
/// estimate and the device's memory.
pub(crate) fn plan_on_device(
    cfg: &Config,
    model: &Llama,
    trained: &[Tensor],
    kern: &Kernels,
    index: usize,
) -> Result<MemoryPlan> {
    let now = kern.cuda_memory(index, false)?;
    let trained_bytes: f64 = trained
        .iter()
        .map(|p| (p.numel() * p.kind().elt_size_in_bytes()) as f64)
        .sum();
    // The parameters on the device now, and the gradients and two AdamW moments of those
    // that train (fp32 like them), and a data-parallel rank's reducer buckets (a copy of the
    // gradients).
    let fixed = now.allocated + (3.0 + buckets(cfg)) * trained_bytes;
    // What the allocator may use: the driver's free memory and the allocator's own cache,
    // less a margin for the fragmentation of the allocator's blocks.
    let usable = 0.92 * (now.free + now.reserved);
    let costs = probe_blocks(model, kern, index, cfg)?;
    let fused_loss = model.kernels.is_some();
    let mut tried = Vec::new();
    for c in candidates(cfg) {
        let plan = MemoryPlan::new(cfg, c, 0.0);
        let peak = predict(cfg, &costs, &plan.step, fixed, fused_loss);
        if peak <= usable {
            return Ok(MemoryPlan { peak, ..plan });
        }
        tried.push(format!("{c:?}: {:.1} GiB", peak / GIB).to_lowercase());
    }
    bail!(
        "training needs more memory than the GPU has: predicted peaks {} (parameters, \
         gradients and optimizer state {:.1} GiB of them), the GPU can give {:.1} GiB of its \
         {:.1} GiB; {}",
        tried.join(", "),
        fixed / GIB,
        usable / GIB,
        now.total / GIB,
        TRAINING_ADVICE
    )
}

/// Evaluation of the loss: the model and one batch's logits and masks.
pub(crate) fn check_eval(cfg: &Config, device: Device) -> Result<()> {
    let len = cfg.eval_seq_len();
    check(
        "evaluation",
        &[
            ("parameters", 4.0 * parameters(cfg)),
            ("logits", logits_bytes(cfg, cfg.eval.batch_size, len)),
            ("attention masks", mask_bytes(cfg, len)),
        ],
        device,
        "lower eval.batch_size or eval.seq_len",
    )
}

/// Probes: one batch of prompts of the longest length, its prefill's logits, the masks the
/// decoding cache builds ([queries, keys], full attention included), and the cache.
pub(crate) fn check_probes(cfg: &Config, device: Device, longest: usize) -> Result<()> {
    let m = &cfg.model;
    let rows = cfg.eval.batch_size.min(cfg.eval.samples);
    let cache = 2.0
        * 4.0
        * (rows * longest * m.num_hidden_layers * m.num_key_value_heads * m.head_dim()) as f64;
    // A prefill computes one layer at a time, nothing kept for a backward, and the logits of
    // the last position alone: per token, one layer's streams (the residual, its norm and the
    // attention's output and input), q, k and v, the MLP's three, in fp32's width and twice
    // over for blocks the allocator holds between layers (SmolLM2-135M at 16K, batch 8:
    // 7.7 GiB estimated; 7.4 GiB of the measured peak lies above the cache and both copies
    // of the weights, `results/decode`).
    let per_token = 8.0
        * (4 * m.hidden_size
            + (m.num_attention_heads + 2 * m.num_key_value_heads) * m.head_dim()
            + 3 * m.intermediate_size) as f64;
    check(
        "the probes",
        &[
            ("parameters", 4.0 * parameters(cfg)),
            ("prefill activations", per_token * (rows * longest) as f64),
            ("last logits", logits_bytes(cfg, rows, 1)),
            ("attention masks", (longest as f64).powi(2)),
            ("key-value cache", cache),
        ],
        device,
        "lower eval.lengths or eval.batch_size",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::EvalConfig;
    use crate::config::Method;
    use crate::run::Built;

    /// A default config with the model's vocabulary, widths, layers and heads set.
    fn shaped(
        vocab: usize,
        hidden: usize,
        inter: usize,
        layers: usize,
        heads: usize,
        kv: usize,
    ) -> Config {
        let mut c = Config::default();
        c.model.vocab_size = vocab;
        c.model.hidden_size = hidden;
        c.model.intermediate_size = inter;
        c.model.num_hidden_layers = layers;
        c.model.num_attention_heads = heads;
        c.model.num_key_value_heads = kv;
        c
    }

    /// The count from the config is the constructed model's, for every method that adds
    /// parameters, tied and untied.
    #[test]
    fn parameter_count_matches_the_built_model() {
        for (method, tie) in [
            (Method::Full, true),
            (Method::Full, false),
            (Method::L2a, true),
            (Method::Swiattn, true),
        ] {
            let mut c = Config::default();
            c.model.vocab_size = 101;
            c.model.hidden_size = 32;
            c.model.intermediate_size = 48;
            c.model.num_hidden_layers = 2;
            c.model.num_key_value_heads = 2;
            c.model.tie_word_embeddings = tie;
            c.attention.method = method;
            let b = Built::new(&c, Device::Cpu).unwrap();
            let built: i64 = b
                .params()
                .iter()
                .filter(|(n, _)| !n.contains("router"))
                .map(|(_, p)| p.numel() as i64)
                .sum();
            assert_eq!(parameters(&c) as i64, built, "{method:?} tie={tie}");
        }
    }

    /// A run that cannot fit is refused with both figures; a small one passes.
    #[test]
    fn too_large_runs_are_refused_with_the_estimate() {
        let mut c = Config::default();
        c.model.vocab_size = 257;
        check_training(&c, Device::Cpu).unwrap();
        c.train.batch_size = 1 << 20;
        let e = format!("{:#}", check_training(&c, Device::Cpu).unwrap_err());
        assert!(
            e.contains("GiB available") && e.contains("train.batch_size"),
            "{e}"
        );
        let c = Config {
            eval: EvalConfig {
                samples: 4,
                ..Default::default()
            },
            ..c
        };
        let e = format!(
            "{:#}",
            check_probes(&c, Device::Cpu, 1_000_000).unwrap_err()
        );
        assert!(e.contains("eval.lengths"), "{e}");
        // On a GPU nothing is read, so nothing is refused.
        check_probes(&c, Device::Cuda(0), 1_000_000).unwrap();
    }

    /// With activations that do not fit, auto recomputes every other block, then every
    /// block; a fixed choice is checked as it is; nothing fitting is refused with the advice.
    #[test]
    fn auto_checkpointing_takes_the_cheapest_choice_that_fits() {
        let mut c = shaped(257, 64, 16384, 64, 4, 4);
        c.data.seq_len = 4096;
        c.train.batch_size = 16;
        let need = |ckpt| training_parts(&c, ckpt).iter().map(|p| p.1).sum::<f64>();
        let (none, selective, full) = (
            need(Checkpointing::None),
            need(Checkpointing::Selective),
            need(Checkpointing::Full),
        );
        assert!(
            none > selective && selective > full,
            "{none} {selective} {full}"
        );
        let chosen = |have: f64| plan_training(&c, Some(have)).map(|p| p.checkpointing);
        assert_eq!(chosen(none).unwrap(), Checkpointing::None);
        assert_eq!(chosen(none - 1.0).unwrap(), Checkpointing::Selective);
        assert_eq!(chosen(selective - 1.0).unwrap(), Checkpointing::Full);
        let e = format!("{:#}", chosen(full - 1.0).unwrap_err());
        assert!(e.contains("activation_checkpointing"), "{e}");
        c.train.activation_checkpointing = Checkpointing::None;
        assert!(plan_training(&c, Some(none - 1.0)).is_err());
        let p = plan_training(&c, None).unwrap();
        assert_eq!(
            (p.checkpointing, p.step.recompute.len()),
            (Checkpointing::None, 64)
        );
    }

    /// The loss runs whole while a micro-batch's logits take at most 1 GiB, else in chunks of
    /// about that many (Qwen2.5's vocabulary in bf16: 3,328 tokens); a chunk size given is kept.
    #[test]
    fn the_loss_is_chunked_past_a_gib_of_logits() {
        let mut c = Config::default();
        c.model.vocab_size = 151_936;
        c.train.dtype = Dtype::Bf16;
        c.train.batch_size = 1;
        c.data.seq_len = 2048;
        assert_eq!(loss_chunk(&c), None);
        c.data.seq_len = 8192;
        assert_eq!(loss_chunk(&c), Some(3328));
        c.train.loss_chunk_tokens = 1000;
        assert_eq!(loss_chunk(&c), Some(1000));
        c.train.loss_chunk_tokens = 8192;
        assert_eq!(loss_chunk(&c), None);
    }

    /// A block's memory fitted through its probes is exact at them: a constant and a line
    /// through two, a parabola through three; the constant does not grow with the batch.
    #[test]
    fn block_fits_pass_through_their_probes() {
        let y = |l: f64| 5e7 + 3.0 * l + 2.0 * l * l;
        let f = Fit::through(&[(512.0, y(512.0)), (1024.0, y(1024.0)), (2048.0, y(2048.0))]);
        assert!(
            (f.k - 5e7).abs() < 1e-3 && (f.a - 3.0).abs() < 1e-9 && (f.c - 2.0).abs() < 1e-12,
            "{f:?}"
        );
        let line = Fit::through(&[(1024.0, 3e7 + 5120.0), (2048.0, 3e7 + 10240.0)]);
        assert!((line.at(1.0, 131072.0) - (3e7 + 5.0 * 131072.0)).abs() < 1e-3);
        assert!((line.at(4.0, 1024.0) - (3e7 + 4.0 * 5120.0)).abs() < 1e-3);
        assert_eq!(Fit::through(&[(7.0, 70.0)]).at(1.0, 14.0), 140.0);
    }

    /// The predicted peak falls as more blocks are recomputed and as the loss's chunks shrink,
    /// and holds the fixed part.
    #[test]
    fn predicted_peaks_follow_the_plan() {
        let mut c = Config::default();
        c.model.vocab_size = 32_000;
        c.model.num_hidden_layers = 8;
        c.data.seq_len = 8192;
        c.train.batch_size = 2;
        c.train.dtype = Dtype::Bf16;
        let cost = BlockCost {
            kept: Fit {
                k: 1e7,
                a: 40_000.0,
                c: 0.0,
            },
            transient: Fit {
                k: 0.0,
                a: 10_000.0,
                c: 0.0,
            },
        };
        let costs = vec![cost; 8];
        let peak = |ckpt, chunk| predict(&c, &costs, &StepPlan::new(ckpt, 8, chunk), 1e9, true);
        let none = peak(Checkpointing::None, None);
        assert!(none > peak(Checkpointing::Selective, None));
        assert!(peak(Checkpointing::Selective, None) > peak(Checkpointing::Full, None));
        assert!(peak(Checkpointing::Full, None) > peak(Checkpointing::Full, Some(1024)));
        // Eight kept blocks of 2 x 8192 tokens at 40 kB a token, beside the fixed GB.
        assert!(none > 1e9 + 8.0 * 2.0 * 8192.0 * 40_000.0);
    }

    /// On the GPU, the plan's predicted peak lies within 10 % of the peak a training step
    /// measures (AdamW's state made, after a first step), for each checkpointing, with the
    /// loss whole and in chunks, for full attention, a window and AHA's routing.
    #[test]
    #[ignore = "needs a CUDA GPU and the kernel library: run with --ignored on a GPU machine"]
    fn gpu_memory_plan_predicts_the_peak() {
        use crate::config::AttnImpl;
        use crate::model::step::forward_backward;
        use crate::run::optim::AdamW;
        crate::model::kernels::tests::on_cuda("gpu_memory_plan_predicts_the_peak", |kern| {
            let mut off = Vec::new();
            for (method, ckpt, chunk) in [
                (Method::Full, Checkpointing::None, 0),
                (Method::Full, Checkpointing::Full, 0),
                (Method::Full, Checkpointing::Selective, 2048),
                (Method::Swa, Checkpointing::None, 2048),
                (Method::Aha, Checkpointing::Full, 0),
            ] {
                let mut c = shaped(32_000, 1024, 4096, 8, 8, 4);
                c.attention.method = method;
                c.attention.window = 256;
                c.attention.attn_impl = AttnImpl::Cuda;
                c.data.seq_len = 4096;
                c.train.batch_size = 2;
                c.train.dtype = Dtype::Bf16;
                c.train.device = "cuda".into();
                c.train.activation_checkpointing = ckpt;
                c.train.loss_chunk_tokens = chunk;
                let built = Built::new(&c, Device::Cuda(0)).unwrap();
                let params = built.params();
                let trained: Vec<Tensor> = params.values().map(|p| p.shallow_clone()).collect();
                let plan = plan_on_device(&c, &built.model, &trained, kern, 0).unwrap();
                let mut opt = AdamW::new(&params, built.model.kernels);
                let ids = Tensor::randint(32_000, [2, 4097], (Kind::Int64, Device::Cuda(0)));
                let (x, y) = (ids.narrow(1, 0, 4096), ids.narrow(1, 1, 4096));
                let ctx = ForwardCtx {
                    compute_logits: true,
                    ..Default::default()
                };
                for step in 0..2 {
                    if step == 1 {
                        kern.cuda_memory(0, true).unwrap();
                    }
                    opt.zero_grad();
                    forward_backward(&built.model, &x, &y, &ctx, &plan.step, 1);
                    opt.clip_grad_norm(1.0);
                    opt.update(0.0, &c.train);
                    tch::Cuda::synchronize(0);
                }
                let peak = kern.cuda_memory(0, false).unwrap().peak;
                let e = (plan.peak - peak) / peak;
                eprintln!(
                    "{method:?} {ckpt:?} chunk {chunk}: predicted {:.3} GiB, measured {:.3} GiB ({:+.1} %)",
                    plan.peak / GIB,
                    peak / GIB,
                    100.0 * e
                );
                if e.abs() >= 0.10 {
                    off.push(format!(
                        "{method:?} {ckpt:?} chunk {chunk}: {:+.1} %",
                        100.0 * e
                    ));
                }
            }
            assert!(off.is_empty(), "predictions off by 10 % or more: {off:?}");
        });
    }

    /// A rank of a data-parallel job counts its reducer's buckets: one more copy of the
    /// gradients of what trains.
    #[test]
    fn a_rank_counts_its_gradient_buckets() {
        let mut c = shaped(257, 64, 128, 2, 2, 2);
        let alone = training_parts(&c, Checkpointing::None)[1].1;
        c.train.ranks = 2;
        let rank = training_parts(&c, Checkpointing::None)[1].1;
        assert_eq!(rank - alone, 4.0 * parameters(&c));
    }

    /// A run whose parameters, logits and masks fit in a few GiB but whose activations need
    /// about 470 GiB is refused for them, before anything is allocated (it was let through
    /// and killed by the operating system).
    #[test]
    fn activations_are_counted() {
        let mut c = shaped(257, 1024, 4096, 8, 8, 8);
        c.data.seq_len = 1024;
        c.train.batch_size = 512;
        c.attention.method = crate::config::Method::Swa;
        let act = activation_bytes(&c, 0);
        assert!((act / GIB - 468.0).abs() < 1.0, "{}", act / GIB);
        let e = format!("{:#}", check_training(&c, Device::Cpu).unwrap_err());
        assert!(e.contains("activations kept for the backward pass"), "{e}");
        c.train.dtype = Dtype::Bf16;
        assert_eq!(activation_bytes(&c, 0), act / 2.0);
    }
}
