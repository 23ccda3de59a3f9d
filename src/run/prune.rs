//! L2A's post-training pruning (L2A section 3.4): a layer whose measured sparsity reaches a
//! threshold loses its global module and keeps its window; the report gives the key-value
//! cache before and after and the change in loss.

use crate::data::Split;
use crate::io::checkpoint;
use crate::model::attention::spec;
use crate::run::eval;
use crate::run::eval::evaluate;
use crate::run::memory;
use crate::run::report::write_report;
use crate::run::Built;
use crate::run::LoadedRun;
use crate::util::atomic;
use anyhow::{ensure, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;
use tch::Tensor;

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub(crate) struct PruneReport {
    pub(crate) threshold: f64,
    /// 1 - mean gate per layer on the validation split, before pruning.
    pub(crate) sparsity: Vec<f64>,
    pub(crate) pruned_layers: Vec<usize>,
    pub(crate) kv_cache_bytes_before: f64,
    pub(crate) kv_cache_bytes_after: f64,
    pub(crate) kv_cache_bytes_full: f64,
    pub(crate) loss_before: f64,
    pub(crate) loss_after: f64,
}

/// L2A pruning (L2A section 3.4): layers whose measured sparsity is at least `threshold` lose
/// their global module and keep only the window. Writes the pruned model (config.toml,
/// model.safetensors), its evaluation and `prune.json` to `out`.
pub(crate) fn prune_l2a(
    run: &Path,
    ckpt: Option<&Path>,
    threshold: f64,
    out: &Path,
) -> Result<PruneReport> {
    ensure!(
        (0.0..=1.0).contains(&threshold),
        "--threshold {threshold} must be in 0 ..= 1"
    );
    ensure!(
        !out.join("config.toml").exists(),
        "{} already holds a model; choose another --out",
        out.display()
    );
    let loaded = LoadedRun::open(run, &[], ckpt, true)?;
    let cfg = &loaded.cfg;
    ensure!(
        spec(cfg.attention.method).prunable,
        "{} trains attention.method = {}; pruning removes L2A's global modules, so it applies \
         to runs of method \"l2a\" only",
        run.display(),
        toml::Value::try_from(cfg.attention.method).map_or_else(|_| "?".into(), |v| v.to_string())
    );
    let split = Split::open(&cfg.data.dir, loaded.meta()?, "val")?;
    memory::check_eval(cfg, loaded.device)?;
    let before = evaluate(&loaded.built.model, &split, cfg, "val", loaded.device, true)?;
    let sparsity: Vec<f64> = before
        .gates
        .as_ref()
        .expect("l2a reports gates")
        .per_layer
        .iter()
        .map(|m| 1.0 - m)
        .collect();
    let mut pruned_cfg = cfg.clone();
    pruned_cfg.attention.pruned_layers = (0..sparsity.len())
        .filter(|&l| sparsity[l] >= threshold || cfg.attention.pruned_layers.contains(&l))
        .collect();
    let pruned = Built::new(&pruned_cfg, loaded.device)?;
    let r = checkpoint::load_into(
        &pruned.params(),
        &loaded.weights,
        false,
        checkpoint::precision_of(&loaded.weights),
    )?;
    ensure!(
        r.initialised.is_empty(),
        "{} lacks {:?}",
        loaded.weights.display(),
        r.initialised
    );
    let mut after = evaluate(
        &pruned.model,
        &split,
        &pruned_cfg,
        "val",
        loaded.device,
        true,
    )?;
    after.checkpoint_step = loaded.step;
    after.timing = eval::timing_of(&pruned.model, &split, &pruned_cfg, loaded.device);
    atomic::ensure_writable_dir(out)?;
    let tensors: Vec<(String, Tensor)> = pruned.params().into_iter().collect();
    atomic::write_with(&out.join("model.safetensors"), |tmp| {
        Ok(Tensor::write_safetensors(&tensors, tmp)?)
    })?;
    write_report(&out.join("eval"), &after, &pruned_cfg)?;
    let report = PruneReport {
        threshold,
        sparsity,
        pruned_layers: pruned_cfg.attention.pruned_layers.clone(),
        kv_cache_bytes_before: before.kv_cache_bytes_total,
        kv_cache_bytes_after: after.kv_cache_bytes_total,
        kv_cache_bytes_full: before.kv_cache_bytes_full,
        loss_before: before.loss,
        loss_after: after.loss,
    };
    atomic::write_bytes(
        &out.join("prune.json"),
        serde_json::to_string_pretty(&report)?.as_bytes(),
    )?;
    // Last: with config.toml present the directory is a complete model `eval --run` accepts.
    atomic::write_bytes(&out.join("config.toml"), pruned_cfg.to_toml().as_bytes())?;
    Ok(report)
}
