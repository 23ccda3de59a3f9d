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
//! what the caught allocation errors are for. The memory of a GPU is not read (nothing here
//! can ask its driver), so runs on a GPU are not checked at all.

use crate::config::{Config, Dtype};
use crate::model::attention::{projection_params, spec};
use anyhow::{bail, Result};
use tch::Device;

const GIB: f64 = (1u64 << 30) as f64;

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

/// Refuses `parts` (what, bytes) when their sum exceeds what the host has. `advice` says
/// which settings lower the need. On a GPU the tensors live in device memory, which is not
/// read here: nothing is checked.
fn check(what: &str, parts: &[(&str, f64)], device: Device, advice: &str) -> Result<()> {
    if device != Device::Cpu {
        return Ok(());
    }
    let need: f64 = parts.iter().map(|p| p.1).sum();
    let Some(have) = available_host() else {
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

/// Activations a micro-batch keeps for its backward pass, counting per layer and token only
/// what is certainly saved, in the compute dtype: the block's input and the attention's (its
/// normalised input), the queries, keys and values, the attention's output, and the MLP's gate
/// and up projections. Measured on the CPU, a step keeps about 1.6 times this (the norms'
/// statistics, the MLP's product, the residual sums), so it stays below the true need.
pub(crate) fn activation_bytes(cfg: &Config) -> f64 {
    let m = &cfg.model;
    let (d, f) = (m.hidden_size as f64, m.intermediate_size as f64);
    let q = (m.num_attention_heads * m.head_dim()) as f64;
    let kv = (m.num_key_value_heads * m.head_dim()) as f64;
    let tokens = (cfg.train.batch_size * cfg.data.seq_len) as f64;
    let elt = match cfg.train.dtype {
        Dtype::Fp32 => 4.0,
        Dtype::Bf16 => 2.0,
    };
    tokens * m.num_hidden_layers as f64 * (2.0 * d + 2.0 * q + 2.0 * kv + 2.0 * f) * elt
}

/// Training: parameters, the gradients and AdamW moments of those that train, a micro-batch's
/// activations, the larger of its logits (with their gradient) and an evaluation batch's, and
/// the masks.
pub(crate) fn check_training(cfg: &Config, device: Device) -> Result<()> {
    let (t, e) = (&cfg.train, &cfg.eval);
    let len = cfg.data.seq_len;
    let trained = parameters(cfg) - frozen_parameters(cfg);
    check(
        "training",
        &[
            ("parameters", 4.0 * parameters(cfg)),
            ("gradients and optimizer state", 12.0 * trained),
            (
                "activations kept for the backward pass",
                activation_bytes(cfg),
            ),
            (
                "logits of a batch",
                (1.5 * logits_bytes(cfg, t.batch_size, len)).max(logits_bytes(
                    cfg,
                    e.batch_size,
                    cfg.eval_seq_len(),
                )),
            ),
            ("attention masks", mask_bytes(cfg, len)),
        ],
        device,
        "lower train.batch_size (train.grad_accum keeps the tokens per step), data.seq_len, \
         eval.batch_size or the model's size",
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
    check(
        "the probes",
        &[
            ("parameters", 4.0 * parameters(cfg)),
            ("prefill logits", logits_bytes(cfg, rows, longest)),
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

    /// A run whose parameters, logits and masks fit in a few GiB but whose activations need
    /// about 240 GiB is refused for them, before anything is allocated (it was let through
    /// and killed by the operating system).
    #[test]
    fn activations_are_counted() {
        let mut c = Config::default();
        c.model.vocab_size = 257;
        c.model.hidden_size = 1024;
        c.model.intermediate_size = 4096;
        c.model.num_hidden_layers = 8;
        c.model.num_attention_heads = 8;
        c.model.num_key_value_heads = 8;
        c.data.seq_len = 1024;
        c.train.batch_size = 512;
        c.attention.method = crate::config::Method::Swa;
        let act = activation_bytes(&c);
        assert!((act / GIB - 224.0).abs() < 1.0, "{}", act / GIB);
        let e = format!("{:#}", check_training(&c, Device::Cpu).unwrap_err());
        assert!(e.contains("activations kept for the backward pass"), "{e}");
        c.train.dtype = Dtype::Bf16;
        assert_eq!(activation_bytes(&c), act / 2.0);
    }
}
