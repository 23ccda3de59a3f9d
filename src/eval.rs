//! Evaluation: validation loss, perplexity, bits per token, attention work against full
//! causal attention, and, on the synthetic corpus, loss per dependency-distance bucket.

use crate::atomic;
use crate::config::Config;
use crate::data::{Split, DEP_NONE};
use crate::model::{token_nll, Llama};
use anyhow::Result;
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
    /// Empty unless the data set records dependency distances.
    pub buckets: Vec<Bucket>,
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
    tch::no_grad(|| {
        for b in &batches {
            let out = model.forward(&b.x);
            let nll = token_nll(&out.logits, &b.y).to_kind(Kind::Double);
            sum += nll.sum(Kind::Double).double_value(&[]);
            count += nll.numel() as u64;
            counts +=
                b.y.flatten(0, 1)
                    .bincount(None::<Tensor>, cfg.model.vocab_size as i64);
            pairs += out.attended_pairs();
            full_pairs += model.full_pairs(b.x.size()[0] as usize, seq_len);
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
        buckets: buckets
            .into_iter()
            .map(|((lo, name), (s, n))| Bucket {
                bucket: name,
                min_distance: lo,
                tokens: n,
                loss: s / n as f64,
            })
            .collect(),
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
    let a = &report.attention;
    let rows: [(&str, f64); 11] = [
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
    ];
    atomic::write_with(&dir.join("eval.csv"), |tmp| {
        let mut w = csv::Writer::from_path(tmp)?;
        w.write_record(["split", "metric", "value"])?;
        for (k, v) in rows {
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
    atomic::write_bytes(&dir.join("config.toml"), cfg.to_toml().as_bytes())
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
