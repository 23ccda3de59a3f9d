//! Evaluation: validation loss, perplexity, bits per token, attention work against full
//! causal attention, key-value cache size, and, on the synthetic corpus, loss per
//! dependency-distance bucket. For routed methods also the gate statistics: full-attention
//! usage mu_f overall, per layer and per (layer, head), the mean gap between global calls of
//! each head, and on the synthetic corpus the precision and recall of gate = 1 against the
//! ground-truth need for global attention.

use crate::atomic;
use crate::attention::ForwardCtx;
use crate::config::Config;
use crate::data::{Split, DEP_NONE};
use crate::model::{token_nll, Llama};
use anyhow::{bail, ensure, Context, Result};
use serde::Serialize;
use std::path::Path;
use tch::{Device, Kind, Tensor};

#[derive(Serialize, Clone, Debug, PartialEq)]
pub struct AttentionWork {
    /// (query, key) pairs attended over all layers, heads and evaluated sequences.
    pub pairs: f64,
    pub full_causal_pairs: f64,
    /// pairs / full_causal_pairs.
    pub density: f64,
    /// 4 * pairs * head_dim: QK^T and PV, a multiply and an add each.
    pub flops: f64,
    pub full_causal_flops: f64,
}

#[derive(Serialize, Clone, Debug, PartialEq)]
pub struct Bucket {
    /// "unpredictable", "local", "d2-3", "d4-7", ..., or "out_of_context".
    pub bucket: String,
    /// Smallest dependency distance in the bucket (0 for unpredictable, u32::MAX for
    /// out_of_context), for sorting.
    pub min_distance: u32,
    pub tokens: u64,
    pub loss: f64,
}

#[derive(Serialize, Clone, Debug, PartialEq)]
pub struct EvalReport {
    pub split: String,
    pub tokens: u64,
    pub loss: f64,
    pub perplexity: f64,
    pub bits_per_token: f64,
    /// Entropy (nats) of the evaluated targets' unigram distribution: the loss of a model
    /// that knows token frequencies and nothing else.
    pub unigram_entropy: f64,
    pub attention: AttentionWork,
    /// Key-value cache bytes per layer for one sequence of seq_len tokens at decode time.
    pub kv_cache_bytes: Vec<f64>,
    pub kv_cache_bytes_total: f64,
    /// The same model with full attention in every layer.
    pub kv_cache_bytes_full: f64,
    /// Empty unless the data set records dependency distances.
    pub buckets: Vec<Bucket>,
    /// Routed methods only.
    pub gates: Option<GateReport>,
}

#[derive(Serialize, Clone, Debug, PartialEq)]
pub struct GateReport {
    /// Mean hard gate over layers, tokens and heads.
    pub mu_f: f64,
    pub per_layer: Vec<f64>,
    /// `[layer][head]`.
    pub per_head: Vec<Vec<f64>>,
    /// `[layer][head]`: mean number of tokens between consecutive gate = 1 events of a head
    /// within a sequence; None where no head fired twice in one sequence.
    pub mean_gap: Vec<Vec<Option<f64>>>,
    /// Synthetic corpus only.
    pub need: Option<NeedReport>,
}

/// Gate = 1 against need: a position needs global attention at window w when the token it
/// predicts depends on one at least w back. Positions with no dependency and those whose
/// dependency lies before the sequence start (no attention can reach it) are left out.
#[derive(Serialize, Clone, Debug, PartialEq)]
pub struct NeedReport {
    pub window: usize,
    pub positions: u64,
    pub needing: u64,
    /// Per layer, each (position, head) gate is one decision.
    pub per_layer: Vec<PrecisionRecall>,
    /// Every (layer, position, head) gate is one decision.
    pub all_gates: PrecisionRecall,
}

#[derive(Serialize, Clone, Debug, Default, PartialEq)]
pub struct PrecisionRecall {
    pub true_pos: u64,
    pub false_pos: u64,
    pub false_neg: u64,
    pub precision: Option<f64>,
    pub recall: Option<f64>,
}

impl PrecisionRecall {
    fn add(&mut self, routed: bool, need: bool) {
        match (routed, need) {
            (true, true) => self.true_pos += 1,
            (true, false) => self.false_pos += 1,
            (false, true) => self.false_neg += 1,
            (false, false) => {}
        }
    }

    fn finish(mut self) -> Self {
        let ratio = |a: u64, b: u64| (b > 0).then(|| a as f64 / b as f64);
        self.precision = ratio(self.true_pos, self.true_pos + self.false_pos);
        self.recall = ratio(self.true_pos, self.true_pos + self.false_neg);
        self
    }
}

/// Running sums behind `GateReport`.
struct GateAccum {
    layers: usize,
    heads: usize,
    window: usize,
    on: Vec<f64>,
    tokens: u64,
    gap_sum: Vec<f64>,
    gap_n: Vec<u64>,
    need: Option<(u64, u64, Vec<PrecisionRecall>, PrecisionRecall)>,
}

impl GateAccum {
    fn new(layers: usize, heads: usize, window: usize, with_need: bool) -> Self {
        GateAccum {
            layers,
            heads,
            window,
            on: vec![0.0; layers * heads],
            tokens: 0,
            gap_sum: vec![0.0; layers * heads],
            gap_n: vec![0; layers * heads],
            need: with_need.then(|| {
                (
                    0,
                    0,
                    vec![PrecisionRecall::default(); layers],
                    PrecisionRecall::default(),
                )
            }),
        }
    }

    /// `gates[l]`: `[B, T, H]` hard gates of layer l; `deps`: `[B * T]` dependency distances.
    fn add(&mut self, gates: &[Vec<f32>], batch: usize, len: usize, deps: Option<&[u32]>) {
        let h = self.heads;
        self.tokens += (batch * len) as u64;
        let at = |l: usize, b: usize, t: usize, hd: usize| gates[l][(b * len + t) * h + hd] > 0.5;
        for l in 0..self.layers {
            for hd in 0..h {
                let i = l * h + hd;
                for b in 0..batch {
                    let mut last: Option<usize> = None;
                    for t in 0..len {
                        if at(l, b, t, hd) {
                            self.on[i] += 1.0;
                            if let Some(p) = last {
                                self.gap_sum[i] += (t - p) as f64;
                                self.gap_n[i] += 1;
                            }
                            last = Some(t);
                        }
                    }
                }
            }
        }
        if let (Some((positions, needing, per_layer, all)), Some(deps)) = (self.need.as_mut(), deps)
        {
            for b in 0..batch {
                for t in 0..len {
                    let d = deps[b * len + t] as usize;
                    if d == DEP_NONE as usize || d > t {
                        continue;
                    }
                    let need = d >= self.window;
                    *positions += 1;
                    *needing += need as u64;
                    for (l, pr) in per_layer.iter_mut().enumerate() {
                        for hd in 0..h {
                            pr.add(at(l, b, t, hd), need);
                            all.add(at(l, b, t, hd), need);
                        }
                    }
                }
            }
        }
    }

    fn finish(self) -> GateReport {
        let h = self.heads;
        let n = self.tokens as f64;
        let per_head: Vec<Vec<f64>> = (0..self.layers)
            .map(|l| (0..h).map(|hd| self.on[l * h + hd] / n).collect())
            .collect();
        let per_layer: Vec<f64> = per_head
            .iter()
            .map(|r| r.iter().sum::<f64>() / h as f64)
            .collect();
        GateReport {
            mu_f: per_layer.iter().sum::<f64>() / self.layers as f64,
            mean_gap: (0..self.layers)
                .map(|l| {
                    (0..h)
                        .map(|hd| {
                            (self.gap_n[l * h + hd] > 0)
                                .then(|| self.gap_sum[l * h + hd] / self.gap_n[l * h + hd] as f64)
                        })
                        .collect()
                })
                .collect(),
            per_layer,
            per_head,
            need: self
                .need
                .map(|(positions, needing, per_layer, all)| NeedReport {
                    window: self.window,
                    positions,
                    needing,
                    per_layer: per_layer.into_iter().map(PrecisionRecall::finish).collect(),
                    all_gates: all.finish(),
                }),
        }
    }
}

/// Which bucket the prediction at in-sequence position `t` with dependency `dep` falls in.
/// Recall dependencies are bucketed by powers of two; one whose source lies before the
/// start of the evaluated sequence cannot be resolved by any attention pattern.
pub fn bucket_of(dep: u32, t: usize) -> (String, u32) {
    match dep {
        DEP_NONE => ("unpredictable".into(), 0),
        1 => ("local".into(), 1),
        d if d as usize > t => ("out_of_context".into(), u32::MAX),
        d => {
            let lo = 1u32 << (31 - d.leading_zeros());
            (format!("d{lo}-{}", 2 * lo - 1), lo)
        }
    }
}

pub fn evaluate(
    model: &Llama,
    split: &Split,
    cfg: &Config,
    split_name: &str,
    device: Device,
) -> Result<EvalReport> {
    let seq_len = cfg.data.seq_len;
    let batches = split.sequential(cfg.eval.batch_size, seq_len, cfg.eval.max_batches, device);
    anyhow::ensure!(
        !batches.is_empty(),
        "the {split_name} split holds fewer than seq_len + 1 = {} tokens",
        seq_len + 1
    );
    let (mut sum, mut count, mut pairs, mut full_pairs) = (0f64, 0u64, 0f64, 0f64);
    let mut buckets: std::collections::BTreeMap<(u32, String), (f64, u64)> = Default::default();
    let mut counts = Tensor::zeros([cfg.model.vocab_size as i64], (Kind::Int64, device));
    let (layers, heads) = (cfg.model.num_hidden_layers, cfg.model.num_attention_heads);
    let mut gates: Option<GateAccum> = None;
    // Bernoulli routers draw from a generator seeded by the run, so evaluation repeats.
    let ctx = ForwardCtx {
        gate_seed: cfg.train.seed ^ 0xE7A1,
        ..Default::default()
    };
    tch::no_grad(|| {
        for b in &batches {
            let out = model.forward(&b.x, &ctx);
            let nll = token_nll(&out.logits, &b.y).to_kind(Kind::Double);
            sum += nll.sum(Kind::Double).double_value(&[]);
            count += nll.numel() as u64;
            counts +=
                b.y.flatten(0, 1)
                    .bincount(None::<Tensor>, cfg.model.vocab_size as i64);
            pairs += out.attended_pairs();
            let batch = b.x.size()[0] as usize;
            full_pairs += model.full_pairs(batch, seq_len);
            if out.layers.iter().any(|l| l.gates.is_some()) {
                let per_layer: Vec<Vec<f32>> = out
                    .layers
                    .iter()
                    .map(|l| match &l.gates {
                        Some(g) => {
                            Vec::<f32>::try_from(g.to_kind(Kind::Float).contiguous().flatten(0, -1))
                                .expect("gates to vec")
                        }
                        // A static layer inside a routed model (a pruned L2A layer) is all window.
                        None => vec![0.0; batch * seq_len * heads],
                    })
                    .collect();
                gates
                    .get_or_insert_with(|| {
                        GateAccum::new(layers, heads, cfg.attention.window, b.deps.is_some())
                    })
                    .add(&per_layer, batch, seq_len, b.deps.as_deref());
            }
            if let Some(deps) = &b.deps {
                let v = Vec::<f64>::try_from(nll.flatten(0, 1)).expect("nll to vec");
                for (i, (&d, &l)) in deps.iter().zip(&v).enumerate() {
                    let (name, lo) = bucket_of(d, i % seq_len);
                    let e = buckets.entry((lo, name)).or_default();
                    e.0 += l;
                    e.1 += 1;
                }
            }
        }
    });
    let loss = sum / count as f64;
    let freq = counts.to_kind(Kind::Double) / count as f64;
    let unigram_entropy = -(&freq * freq.clamp_min(1e-300).log())
        .sum(Kind::Double)
        .double_value(&[]);
    let head_dim = cfg.model.head_dim() as f64;
    let kv = model.kv_cache_bytes(seq_len);
    let kv_full = model.full_kv_cache_bytes(seq_len);
    Ok(EvalReport {
        split: split_name.into(),
        tokens: count,
        loss,
        perplexity: loss.exp(),
        bits_per_token: loss / std::f64::consts::LN_2,
        unigram_entropy,
        attention: AttentionWork {
            pairs,
            full_causal_pairs: full_pairs,
            density: pairs / full_pairs,
            flops: 4.0 * pairs * head_dim,
            full_causal_flops: 4.0 * full_pairs * head_dim,
        },
        kv_cache_bytes_total: kv.iter().sum(),
        kv_cache_bytes: kv,
        kv_cache_bytes_full: kv_full,
        buckets: buckets
            .into_iter()
            .map(|((lo, name), (s, n))| Bucket {
                bucket: name,
                min_distance: lo,
                tokens: n,
                loss: s / n as f64,
            })
            .collect(),
        gates: gates.map(GateAccum::finish),
    })
}

/// Writes `eval.json` (report plus the resolved config), `eval.csv` (one metric per row) and,
/// when there are buckets, `eval_buckets.csv`; also the resolved `config.toml`.
pub fn write_report(dir: &Path, report: &EvalReport, cfg: &Config) -> Result<()> {
    atomic::ensure_writable_dir(dir)?;
    let json = serde_json::json!({ "report": report, "config": cfg });
    atomic::write_bytes(
        &dir.join("eval.json"),
        serde_json::to_string_pretty(&json)?.as_bytes(),
    )?;
    crate::fault::point("eval_report");
    let a = &report.attention;
    let mut rows: Vec<(String, f64)> = [
        ("tokens", report.tokens as f64),
        ("loss", report.loss),
        ("perplexity", report.perplexity),
        ("bits_per_token", report.bits_per_token),
        ("unigram_entropy", report.unigram_entropy),
        ("attended_pairs", a.pairs),
        ("full_causal_pairs", a.full_causal_pairs),
        ("attention_density", a.density),
        ("attention_flops", a.flops),
        ("full_causal_flops", a.full_causal_flops),
        ("seq_len", cfg.data.seq_len as f64),
        ("kv_cache_bytes", report.kv_cache_bytes_total),
        ("kv_cache_bytes_full", report.kv_cache_bytes_full),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    if let Some(g) = &report.gates {
        rows.push(("mu_f".into(), g.mu_f));
        rows.extend(
            g.per_layer
                .iter()
                .enumerate()
                .map(|(l, v)| (format!("mu_f_layer_{l}"), *v)),
        );
        if let Some(n) = &g.need {
            rows.push((
                "need_fraction".into(),
                n.needing as f64 / n.positions.max(1) as f64,
            ));
            for (name, v) in [
                ("gate_precision", n.all_gates.precision),
                ("gate_recall", n.all_gates.recall),
            ] {
                if let Some(v) = v {
                    rows.push((name.into(), v));
                }
            }
        }
    }
    atomic::write_with(&dir.join("eval.csv"), |tmp| {
        let mut w = csv::Writer::from_path(tmp)?;
        w.write_record(["split", "metric", "value"])?;
        for (k, v) in &rows {
            w.write_record([report.split.as_str(), k, &v.to_string()])?;
        }
        w.flush()?;
        Ok(())
    })?;
    if !report.buckets.is_empty() {
        atomic::write_with(&dir.join("eval_buckets.csv"), |tmp| {
            let mut w = csv::Writer::from_path(tmp)?;
            for b in &report.buckets {
                w.serialize(b)?;
            }
            w.flush()?;
            Ok(())
        })?;
    }
    if let Some(g) = &report.gates {
        write_gate_files(dir, g)?;
    }
    atomic::write_bytes(&dir.join("config.toml"), cfg.to_toml().as_bytes())
}

fn write_csv(path: &Path, header: &[String], rows: &[Vec<String>]) -> Result<()> {
    atomic::write_with(path, |tmp| {
        let mut w = csv::Writer::from_path(tmp)?;
        w.write_record(header)?;
        for r in rows {
            w.write_record(r)?;
        }
        w.flush()?;
        Ok(())
    })
}

/// `layer_head_usage.csv` (the layer x head matrix of mu_f), `head_usage.csv` (one row per
/// head with its mean gap) and `head_ranking.csv` (heads by mu_f, highest first: the input of
/// the static_heads method).
fn write_gate_files(dir: &Path, g: &GateReport) -> Result<()> {
    let heads = g.per_head.first().map_or(0, |r| r.len());
    let mut header = vec!["layer".to_string()];
    header.extend((0..heads).map(|h| format!("head_{h}")));
    let matrix: Vec<Vec<String>> = g
        .per_head
        .iter()
        .enumerate()
        .map(|(l, r)| {
            std::iter::once(l.to_string())
                .chain(r.iter().map(|v| v.to_string()))
                .collect()
        })
        .collect();
    write_csv(&dir.join("layer_head_usage.csv"), &header, &matrix)?;
    let mut heads_long: Vec<(usize, usize, f64, Option<f64>)> = Vec::new();
    for (l, r) in g.per_head.iter().enumerate() {
        for (h, &mu) in r.iter().enumerate() {
            heads_long.push((l, h, mu, g.mean_gap[l][h]));
        }
    }
    let strs = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let rows: Vec<Vec<String>> = heads_long
        .iter()
        .map(|(l, h, mu, gap)| {
            vec![
                l.to_string(),
                h.to_string(),
                mu.to_string(),
                gap.map(|g| g.to_string()).unwrap_or_default(),
            ]
        })
        .collect();
    write_csv(
        &dir.join("head_usage.csv"),
        &strs(&["layer", "head", "mu_f", "mean_gap"]),
        &rows,
    )?;
    heads_long.sort_by(|a, b| b.2.total_cmp(&a.2).then(a.0.cmp(&b.0)).then(a.1.cmp(&b.1)));
    let rows: Vec<Vec<String>> = heads_long
        .iter()
        .enumerate()
        .map(|(rank, (l, h, mu, _))| {
            vec![
                (rank + 1).to_string(),
                l.to_string(),
                h.to_string(),
                mu.to_string(),
            ]
        })
        .collect();
    write_csv(
        &dir.join("head_ranking.csv"),
        &strs(&["rank", "layer", "head", "mu_f"]),
        &rows,
    )
}

/// Reads a `head_ranking.csv` and marks its first `top_k` (layer, head) pairs as full:
/// `[layer][head]`.
pub fn read_head_assignment(
    path: &Path,
    top_k: usize,
    layers: usize,
    heads: usize,
) -> Result<Vec<Vec<bool>>> {
    let mut rdr = csv::Reader::from_path(path)
        .with_context(|| format!("cannot read head ranking {}", path.display()))?;
    let mut on = vec![vec![false; heads]; layers];
    let mut seen = 0usize;
    for (i, row) in rdr.records().enumerate() {
        let row = row.with_context(|| format!("{}: malformed row {}", path.display(), i + 2))?;
        let field = |k: usize| -> Result<usize> {
            row.get(k).and_then(|v| v.parse().ok()).with_context(|| {
                format!(
                    "{}: row {} needs rank,layer,head,mu_f",
                    path.display(),
                    i + 2
                )
            })
        };
        let (layer, head) = (field(1)?, field(2)?);
        ensure!(
            layer < layers && head < heads,
            "{}: row {} names layer {layer} head {head}, but the model has {layers} layers of {heads} heads",
            path.display(),
            i + 2
        );
        if seen < top_k {
            on[layer][head] = true;
        }
        seen += 1;
    }
    if seen < top_k {
        bail!(
            "{} ranks {seen} heads, fewer than attention.top_k = {top_k}",
            path.display()
        );
    }
    Ok(on)
}

#[derive(Serialize, Clone, Debug, PartialEq)]
pub struct PruneReport {
    pub threshold: f64,
    /// 1 - mean gate per layer on the validation split, before pruning.
    pub sparsity: Vec<f64>,
    pub pruned_layers: Vec<usize>,
    pub kv_cache_bytes_before: f64,
    pub kv_cache_bytes_after: f64,
    pub kv_cache_bytes_full: f64,
    pub loss_before: f64,
    pub loss_after: f64,
}

/// L2A pruning (L2A section 3.4): layers whose measured sparsity is at least `threshold` lose
/// their global module and keep only the window. Writes the pruned model (config.toml,
/// model.safetensors), its evaluation and `prune.json` to `out`.
pub fn prune_l2a(
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
    let loaded = crate::train::LoadedRun::open(run, &[], ckpt)?;
    let cfg = &loaded.cfg;
    ensure!(
        cfg.attention.method == crate::config::Method::L2a,
        "{} is a {:?} run; pruning applies to l2a",
        run.display(),
        cfg.attention.method
    );
    let split = Split::open(&cfg.data.dir, &loaded.meta, "val")?;
    let before = evaluate(&loaded.built.model, &split, cfg, "val", loaded.device)?;
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
    let pruned = crate::train::Built::new(&pruned_cfg, loaded.device)?;
    let r = crate::checkpoint::load_into(&pruned.params(), &loaded.weights, false)?;
    ensure!(
        r.initialised.is_empty(),
        "{} lacks {:?}",
        loaded.weights.display(),
        r.initialised
    );
    let after = evaluate(&pruned.model, &split, &pruned_cfg, "val", loaded.device)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_by_power_of_two_and_context() {
        assert_eq!(bucket_of(0, 10).0, "unpredictable");
        assert_eq!(bucket_of(1, 0).0, "local");
        assert_eq!(bucket_of(2, 10), ("d2-3".to_string(), 2));
        assert_eq!(bucket_of(3, 10), ("d2-3".to_string(), 2));
        assert_eq!(bucket_of(4, 10), ("d4-7".to_string(), 4));
        assert_eq!(bucket_of(100, 200), ("d64-127".to_string(), 64));
        assert_eq!(bucket_of(100, 100).0, "d64-127");
        assert_eq!(bucket_of(100, 99).0, "out_of_context");
    }
}
