//! Evaluation: validation loss, perplexity, bits per token, attention work against full
//! causal attention, key-value cache size, and, on the synthetic corpus, loss per
//! dependency-distance bucket. For routed methods also the gate statistics: full-attention
//! usage mu_f overall, per layer and per (layer, head), the mean gap between global calls of
//! each head, and on the synthetic corpus the precision and recall of gate = 1 against the
//! ground-truth need for global attention. What it writes (`eval.json` and the gate files) is
//! `report.rs`.

use super::report::{
    position_buckets, AttentionWork, Bucket, EvalReport, GapStats, GateReport, NeedReport,
    PositionLoss, PrecisionRecall, SourceLoss, Timing,
};
use crate::config::Config;
use crate::data::shards::Batch;
use crate::data::{synth, Split, DEP_NONE};
use crate::model;
use crate::model::attention::ForwardCtx;
use crate::model::nn::token_nll;
use crate::model::{ForwardOutput, Llama};
use crate::run::generate::greedy;
use crate::util::progress::Progress;
use crate::util::progress::DEFAULT_STATUS_EVERY;
use crate::util::rng::Rng;
use crate::util::stats::median;
use anyhow::Result;
use std::collections::BTreeMap;
use std::time::Duration;
use tch::{Device, Kind, Tensor};

/// Repetitions behind each figure of `Timing`.
const TIMING_REPS: usize = 3;

/// Times `x: [B, L]` (int64 ids) through `model`: see `Timing`.
pub(crate) fn time_inference(model: &Llama, x: &Tensor, seed: u64) -> Timing {
    let device = x.device();
    let (batch, len) = (x.size()[0], x.size()[1]);
    let steps = 64.min(len / 2);
    let mut ctx = ForwardCtx {
        gate_seed: seed,
        ..ForwardCtx::default()
    };
    // Each repetition: (forward, attention, prefill, decode) seconds and the cache bytes.
    let rep = |ctx: &mut ForwardCtx| {
        let clock = std::time::Instant::now;
        model::sync(device);
        let start = clock();
        let _ = model.forward(x, ctx);
        model::sync(device);
        let forward = start.elapsed().as_secs_f64();
        ctx.attention_seconds.set(Some(0.0));
        let _ = model.forward(x, ctx);
        let attention = ctx.attention_seconds.take().unwrap_or(0.0);
        // Prefill and decoding as the evaluations generate (`greedy`: weights cast once, one
        // step captured as a CUDA graph where the kernels run on a GPU): the decoding time is
        // the difference between runs of 3 + steps and 3 new tokens, so the prefill, the
        // first step (run as it is) and the capture (the second) cancel. The longer run ends
        // at the batch's length, so its cache holds what a sequence of that length needs.
        let prompt = x.narrow(1, 0, (len - steps - 3).max(1));
        let short = greedy(model, &prompt, 3, None, ctx, true);
        let long = greedy(model, &prompt, 3 + steps as usize, None, ctx, true);
        let prefill = short.prefill_seconds;
        // A difference at or below zero (steps too few against the clock's noise) measures
        // nothing: the longer run's own time for its steps stands in, the first step and the
        // capture in it, so the rate errs low, never toward infinity.
        let decode = match long.decode_seconds - short.decode_seconds {
            d if d > 0.0 => d,
            _ => (long.decode_seconds * steps as f64 / (steps + 2) as f64).max(f64::MIN_POSITIVE),
        };
        let cache = long.cache_bytes;
        (forward, attention, prefill, decode, cache)
    };
    tch::no_grad(|| {
        rep(&mut ctx);
        let reps: Vec<_> = (0..TIMING_REPS).map(|_| rep(&mut ctx)).collect();
        let of = |f: fn(&(f64, f64, f64, f64, f64)) -> f64| median(reps.iter().map(f).collect());
        let spread = |f: &dyn Fn(&(f64, f64, f64, f64, f64)) -> f64| {
            let v: Vec<f64> = reps.iter().map(f).collect();
            v.iter().copied().fold(f64::MIN, f64::max) - v.iter().copied().fold(f64::MAX, f64::min)
        };
        let rate = |r: &(f64, f64, f64, f64, f64)| (batch * steps) as f64 / r.3;
        Timing {
            device: format!("{device:?}"),
            batch: batch as usize,
            seq_len: len as usize,
            forward_ms: 1e3 * of(|r| r.0),
            attention_ms: 1e3 * of(|r| r.1),
            prefill_ms: 1e3 * of(|r| r.2),
            decode_steps: steps as usize,
            decode_tokens_per_s: (batch * steps) as f64 / of(|r| r.3),
            decode_cache_bytes: reps[0].4 / batch as f64,
            runs: reps.len(),
            forward_ms_spread: 1e3 * spread(&|r| r.0),
            prefill_ms_spread: 1e3 * spread(&|r| r.2),
            decode_tokens_per_s_spread: spread(&rate),
        }
    })
}

/// Running counts behind one head's `GapStats`.
#[derive(Clone, Debug, Default)]
struct GapCounts {
    /// Length -> (complete gaps of that length, spells known to exceed that length).
    at: BTreeMap<u32, (u64, u64)>,
    sum: f64,
    sequences: u64,
    fewer_than_two: u64,
}

impl GapCounts {
    /// One sequence of `len` positions in which the head called full attention at `calls`
    /// (ascending).
    fn add_sequence(&mut self, calls: &[usize], len: usize) {
        self.sequences += 1;
        self.fewer_than_two += (calls.len() < 2) as u64;
        for w in calls.windows(2) {
            let g = (w[1] - w[0]) as u32;
            self.at.entry(g).or_default().0 += 1;
            self.sum += g as f64;
        }
        // After the last call the next one lies at position len or later: the gap exceeds
        // the tokens left.
        if let Some(&p) = calls.last() {
            let censored = len - 1 - p;
            if censored > 0 {
                self.at.entry(censored as u32).or_default().1 += 1;
            }
        }
    }

    fn finish(&self) -> GapStats {
        let gaps: u64 = self.at.values().map(|v| v.0).sum();
        let observations: u64 = self.at.values().map(|v| v.0 + v.1).sum();
        // Kaplan-Meier: S(t) = prod over gap lengths g <= t of (1 - events(g) / at_risk(g)),
        // where a spell censored after c tokens is at risk at every g <= c.
        let mut quantiles = [(0.5, None), (0.9, None)];
        let (mut at_risk, mut survival) = (observations as f64, 1.0);
        for (&t, &(events, censored)) in &self.at {
            if events > 0 {
                survival *= 1.0 - events as f64 / at_risk;
                for (q, found) in quantiles.iter_mut() {
                    if found.is_none() && survival <= 1.0 - *q + 1e-12 {
                        *found = Some(t);
                    }
                }
            }
            at_risk -= (events + censored) as f64;
        }
        GapStats {
            gaps,
            mean: (gaps > 0).then(|| self.sum / gaps as f64),
            median: quantiles[0].1,
            p90: quantiles[1].1,
            max: self.at.iter().rev().find(|(_, v)| v.0 > 0).map(|(&t, _)| t),
            max_censored: self.at.iter().rev().find(|(_, v)| v.1 > 0).map(|(&t, _)| t),
            censored_share: self.fewer_than_two as f64 / self.sequences.max(1) as f64,
        }
    }
}

/// Precision and recall counted as gates are read.
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
    gaps: Vec<GapCounts>,
    /// Positions, those needing the full path, per layer and pooled gate counts, and the
    /// ASK rule's counts (`NeedReport`).
    need: Option<(
        u64,
        u64,
        Vec<PrecisionRecall>,
        PrecisionRecall,
        PrecisionRecall,
    )>,
}

impl GateAccum {
    fn new(layers: usize, heads: usize, window: usize, with_need: bool) -> Self {
        GateAccum {
            layers,
            heads,
            window,
            on: vec![0.0; layers * heads],
            tokens: 0,
            gaps: vec![GapCounts::default(); layers * heads],
            need: with_need.then(|| {
                (
                    0,
                    0,
                    vec![PrecisionRecall::default(); layers],
                    PrecisionRecall::default(),
                    PrecisionRecall::default(),
                )
            }),
        }
    }

    /// `gates[l]`: `[B, T, H]` hard gates of layer l; `deps`: `[B * T]` dependency distances
    /// and `inputs` the `[B * T]` input tokens, where the data set records dependencies.
    fn add(
        &mut self,
        gates: &[Vec<f32>],
        batch: usize,
        len: usize,
        deps: Option<(&[u32], &[i64])>,
    ) {
        let h = self.heads;
        self.tokens += (batch * len) as u64;
        let at = |l: usize, b: usize, t: usize, hd: usize| gates[l][(b * len + t) * h + hd] > 0.5;
        let mut calls = Vec::with_capacity(len);
        for l in 0..self.layers {
            for hd in 0..h {
                let i = l * h + hd;
                for b in 0..batch {
                    calls.clear();
                    calls.extend((0..len).filter(|&t| at(l, b, t, hd)));
                    self.on[i] += calls.len() as f64;
                    self.gaps[i].add_sequence(&calls, len);
                }
            }
        }
        if let (Some((positions, needing, per_layer, all, rule)), Some((deps, inputs))) =
            (self.need.as_mut(), deps)
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
                    let after_ask = t > 0 && inputs[b * len + t - 1] == synth::ASK as i64;
                    rule.add(after_ask, need);
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
        let gaps: Vec<Vec<GapStats>> = (0..self.layers)
            .map(|l| (0..h).map(|hd| self.gaps[l * h + hd].finish()).collect())
            .collect();
        GateReport {
            mu_f: per_layer.iter().sum::<f64>() / self.layers as f64,
            censored_heads: gaps.iter().flatten().filter(|g| g.median.is_none()).count(),
            gaps,
            per_layer,
            per_head,
            need: self
                .need
                .map(|(positions, needing, per_layer, all, rule)| NeedReport {
                    window: self.window,
                    positions,
                    needing,
                    per_layer: per_layer.into_iter().map(PrecisionRecall::finish).collect(),
                    all_gates: all.finish(),
                    ask_rule: rule.finish(),
                }),
        }
    }
}

/// A batch's input tokens `[B * T]` where the data set records dependencies (the synthetic
/// corpus), which the ASK rule reads beside them.
fn inputs_with_deps(b: &Batch) -> Option<Vec<i64>> {
    b.deps.as_ref()?;
    Some(Vec::<i64>::try_from(b.x.flatten(0, 1)).expect("inputs to vec"))
}

/// Which bucket the prediction at in-sequence position `t` with dependency `dep` falls in.
/// Recall dependencies are bucketed by powers of two; one whose source lies before the
/// start of the evaluated sequence cannot be resolved by any attention pattern.
pub(crate) fn bucket_of(dep: u32, t: usize) -> (String, u32) {
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

/// The seed context-free (Bernoulli) gates draw from when a model is evaluated: one per run, so
/// an evaluation repeats exactly, and apart from the training's draws. Evaluation batches, the
/// timed batch, probes and multiple-choice items each derive their own from it.
pub(crate) fn eval_gate_seed(cfg: &Config) -> u64 {
    cfg.train.seed ^ 0xE7A1
}

/// Loss, attention work, buckets and gate statistics of `model` on `split`, over sequences of
/// `cfg.eval_seq_len()` tokens. `show`: a progress bar (status lines off a terminal) over the
/// batches.
pub(crate) fn evaluate(
    model: &Llama,
    split: &Split,
    cfg: &Config,
    split_name: &str,
    device: Device,
    show: bool,
) -> Result<EvalReport> {
    let seq_len = cfg.eval_seq_len();
    let batches = split.sequential(cfg.eval.batch_size, seq_len, cfg.eval.max_batches, device);
    anyhow::ensure!(
        !batches.is_empty(),
        "the {split_name} split has no shard of more than {} = {seq_len} tokens (its largest \
         has {}), which one evaluated sequence needs",
        cfg.eval_seq_len_key(),
        split.largest_shard()
    );
    let (mut sum, mut count, mut pairs, mut full_pairs) = (0f64, 0u64, 0f64, 0f64);
    // Per part of the split: summed loss and tokens.
    let mut by_part = vec![(0f64, 0u64); split.part_names().len()];
    // Per position in the sequence: summed loss (every sequence has every position), kept on
    // the device and read once.
    let mut by_pos = Tensor::zeros([seq_len as i64], (Kind::Double, device));
    let mut sequences = 0u64;
    // Per bucket: summed loss, tokens, tokens predicted exactly.
    let mut buckets: BTreeMap<(u32, String), (f64, u64, u64)> = Default::default();
    let mut counts = Tensor::zeros([cfg.model.vocab_size as i64], (Kind::Int64, device));
    let (layers, heads) = (cfg.model.num_hidden_layers, cfg.model.num_attention_heads);
    let mut gates: Option<GateAccum> = None;
    let mut progress = Progress::new(
        batches.len() as u64,
        "batches",
        !show,
        Duration::from_secs(DEFAULT_STATUS_EVERY),
    );
    // Each batch has its own gate seed, so no two batches share a mask.
    let seed = eval_gate_seed(cfg);
    let mut ctx = ForwardCtx::default();
    tch::no_grad(|| {
        for (i, (part, b)) in batches.iter().enumerate() {
            ctx.gate_seed = Rng::derive(seed, &[i as u64]);
            let out = model.forward(&b.x, &ctx);
            let nll = token_nll(&out.logits, &b.y).to_kind(Kind::Double);
            let batch_sum = nll.sum(Kind::Double).double_value(&[]);
            sum += batch_sum;
            count += nll.numel() as u64;
            by_part[*part].0 += batch_sum;
            by_part[*part].1 += nll.numel() as u64;
            by_pos += nll.sum_dim_intlist(0, false, Kind::Double);
            sequences += nll.size()[0] as u64;
            counts +=
                b.y.flatten(0, 1)
                    .bincount(None::<Tensor>, cfg.model.vocab_size as i64);
            pairs += out.attended_pairs();
            let batch = b.x.size()[0] as usize;
            full_pairs += model.full_pairs(batch, seq_len);
            if let Some(per_layer) = layer_gates(&out, batch * seq_len * heads) {
                gates
                    .get_or_insert_with(|| {
                        GateAccum::new(layers, heads, cfg.attention.window, b.deps.is_some())
                    })
                    .add(
                        &per_layer,
                        batch,
                        seq_len,
                        b.deps.as_deref().zip(inputs_with_deps(b).as_deref()),
                    );
            }
            if let Some(deps) = &b.deps {
                let hit = out.logits.argmax(-1, false).eq_tensor(&b.y);
                add_to_buckets(&mut buckets, deps, &nll, &hit, seq_len);
            }
            progress.update(i as u64 + 1, "");
        }
    });
    progress.finish();
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
        seq_len,
        checkpoint_step: None,
        train_steps: cfg.train.steps,
        tokens: count,
        loss,
        perplexity: loss.exp(),
        bits_per_token: loss / std::f64::consts::LN_2,
        unigram_entropy,
        attention: AttentionWork {
            pairs,
            full_causal_pairs: full_pairs,
            pairs_vs_full: pairs / full_pairs,
            flops: 4.0 * pairs * head_dim,
            full_causal_flops: 4.0 * full_pairs * head_dim,
        },
        kv_cache_bytes_total: kv.iter().sum(),
        kv_cache_bytes: kv,
        kv_cache_bytes_full: kv_full,
        buckets: buckets
            .into_iter()
            .map(|((lo, name), (s, n, hits))| Bucket {
                bucket: name,
                min_distance: lo,
                tokens: n,
                loss: s / n as f64,
                accuracy: Some(hits as f64 / n as f64),
            })
            .collect(),
        gates: gates.map(GateAccum::finish),
        timing: None,
        by_source: match by_part.len() {
            1 => Vec::new(),
            _ => split
                .part_names()
                .into_iter()
                .zip(by_part)
                .filter(|(_, (_, n))| *n > 0)
                .map(|(name, (s, n))| SourceLoss {
                    source: name.to_string(),
                    tokens: n,
                    loss: s / n as f64,
                })
                .collect(),
        },
        by_position: position_losses(by_pos, sequences, seq_len),
    })
}

/// Each layer's hard gates of a forward, flattened (`tokens` of them a layer), where some
/// layer has gates: a static layer inside a routed model (a pruned L2A layer) is all window.
fn layer_gates(out: &ForwardOutput, tokens: usize) -> Option<Vec<Vec<f32>>> {
    out.layers.iter().any(|l| l.gates.is_some()).then(|| {
        out.layers
            .iter()
            .map(|l| match &l.gates {
                Some(g) => Vec::<f32>::try_from(g.to_kind(Kind::Float).contiguous().flatten(0, -1))
                    .expect("gates to vec"),
                None => vec![0.0; tokens],
            })
            .collect()
    })
}

/// Adds a batch's tokens to the dependency-distance buckets (summed loss, tokens, tokens
/// predicted exactly): each target's dependency `deps`, its loss `nll` and whether the argmax
/// hit it, `[B, L]` each.
fn add_to_buckets(
    buckets: &mut BTreeMap<(u32, String), (f64, u64, u64)>,
    deps: &[u32],
    nll: &Tensor,
    hit: &Tensor,
    seq_len: usize,
) {
    let v = Vec::<f64>::try_from(nll.flatten(0, 1)).expect("nll to vec");
    let hit = Vec::<bool>::try_from(hit.flatten(0, 1)).expect("hits to vec");
    for (i, ((&d, &l), &h)) in deps.iter().zip(&v).zip(&hit).enumerate() {
        let (name, lo) = bucket_of(d, i % seq_len);
        let e = buckets.entry((lo, name)).or_default();
        e.0 += l;
        e.1 += 1;
        e.2 += h as u64;
    }
}

/// The loss by position bucket from the summed loss at each position `by_pos` over
/// `sequences` sequences of `seq_len`.
fn position_losses(by_pos: Tensor, sequences: u64, seq_len: usize) -> Vec<PositionLoss> {
    let by_pos = Vec::<f64>::try_from(by_pos).expect("loss by position to vec");
    position_buckets(seq_len)
        .into_iter()
        .map(|(from, to)| PositionLoss {
            from,
            to,
            tokens: sequences * (to - from) as u64,
            loss: by_pos[from..to].iter().sum::<f64>() / (sequences * (to - from) as u64) as f64,
        })
        .collect()
}

/// `Timing` of the first batch `evaluate` reads when `eval.timing` asks for it: the final
/// evaluation of a training run and `attnsweep eval` measure it, the periodic ones do not.
pub(crate) fn timing_of(
    model: &Llama,
    split: &Split,
    cfg: &Config,
    device: Device,
) -> Option<Timing> {
    if !cfg.eval.timing {
        return None;
    }
    let batch = split
        .sequential(cfg.eval.batch_size, cfg.eval_seq_len(), 1, device)
        .into_iter()
        .next()?
        .1;
    let seed = Rng::derive(eval_gate_seed(cfg), &[u64::MAX]);
    Some(time_inference(model, &batch.x, seed))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::EvalConfig;
    use crate::config::Method;
    use crate::config::Router;
    use crate::model::step;
    use crate::run::Built;
    use crate::util;

    /// The ASK rule by hand: inputs 5 ASK 7 9 ASK 8 3 4 with dependencies none, 1, 2, 1, none,
    /// 1, 3, 1 at window 2. The rule opens after each ASK (positions 2 and 5); position 2 needs
    /// the full path (2 >= 2), 5 does not (1), and 6 needs it but follows no ASK: precision
    /// and recall 1/2. Chance is 2 needing of 6 counted positions.
    #[test]
    fn the_ask_rule_is_scored_against_need() {
        let mut acc = GateAccum::new(1, 1, 2, true);
        let n = DEP_NONE;
        let deps = [n, 1, 2, 1, n, 1, 3, 1];
        let ask = synth::ASK as i64;
        let inputs = [5, ask, 7, 9, ask, 8, 3, 4];
        acc.add(&[vec![0.0; 8]], 1, 8, Some((&deps, &inputs)));
        let need = acc.finish().need.unwrap();
        assert_eq!((need.positions, need.needing), (6, 2));
        let r = need.ask_rule;
        assert_eq!((r.true_pos, r.false_pos, r.false_neg), (1, 1, 1));
        assert_eq!((r.precision, r.recall), (Some(0.5), Some(0.5)));
        // Gates never open: no precision, recall 0.
        assert_eq!(need.all_gates.precision, None);
        assert_eq!(need.all_gates.recall, Some(0.0));
    }

    /// Kaplan-Meier by hand. Four sequences of 10 positions: calls at 0, 2, 4 (gaps 2, 2; the
    /// spell after 4 censored at 5), none (no spell observed from its start: left out), 1, 8
    /// (gap 7; censored at 1), and 3 (censored at 6). At 2, 5 observations are at risk (the
    /// spell censored at 1 has left) and 2 end: S = 0.6; at 7, 1 is at risk and it ends: S = 0.
    /// So the median and p90 are 7, while the mean of the complete gaps is 11/3.
    #[test]
    fn gap_quantiles_count_censored_spells() {
        let mut g = GapCounts::default();
        g.add_sequence(&[0, 2, 4], 10);
        g.add_sequence(&[], 10);
        g.add_sequence(&[1, 8], 10);
        g.add_sequence(&[3], 10);
        let s = g.finish();
        assert_eq!(s.gaps, 3);
        assert!((s.mean.unwrap() - 11.0 / 3.0).abs() < 1e-12);
        assert_eq!((s.median, s.p90), (Some(7), Some(7)));
        assert_eq!((s.max, s.max_censored), (Some(7), Some(6)));
        assert!((s.censored_share - 0.5).abs() < 1e-12);
        // Without the long complete gap, the censored spells keep the estimate above one
        // half: the median is not measured, though the plain mean says 2.
        let mut g = GapCounts::default();
        g.add_sequence(&[0, 2, 4], 10);
        g.add_sequence(&[3], 10);
        g.add_sequence(&[5], 10);
        let s = g.finish();
        assert_eq!((s.mean, s.median), (Some(2.0), None));
        // A head that calls every token: gaps of 1, nothing censored but the last call
        // (which ends at the sequence end: no spell).
        let mut g = GapCounts::default();
        g.add_sequence(&[0, 1, 2, 3], 4);
        let s = g.finish();
        assert_eq!((s.median, s.p90, s.max_censored), (Some(1), Some(1), None));
        // A head that never calls: every quantile censored.
        let mut g = GapCounts::default();
        g.add_sequence(&[], 4);
        assert_eq!(g.finish().median, None);
    }

    /// A data set whose val split is `rows` copies of one sequence of `len` tokens (a period
    /// of `len`, so every sequential window is the same), and a routed config over it.
    fn repeated_rows(tag: &str, len: usize, rows: usize, method: Method) -> (Config, Split) {
        use crate::data::{write_shard, Meta, Width, TOKENS_MAGIC};
        let dir = util::scratch_dir(tag);
        let tokens: Vec<u32> = (0..len * rows + 1).map(|k| (k % len % 13) as u32).collect();
        for split in ["train", "val"] {
            write_shard(
                &dir.join(format!("{split}_000.bin")),
                TOKENS_MAGIC,
                Width::U16,
                &tokens,
            )
            .unwrap();
        }
        let meta = Meta {
            format: 1,
            tokenizer: "synth".into(),
            vocab_size: 13,
            eot_token: None,
            train: vec!["train_000.bin".into()],
            val: vec!["val_000.bin".into()],
            train_tokens: tokens.len() as u64,
            val_tokens: tokens.len() as u64,
            synth: None,
            probes: None,
            corpus: None,
            shards_sha256: None,
        };
        std::fs::write(dir.join("meta.json"), serde_json::to_string(&meta).unwrap()).unwrap();
        let mut c = Config::default();
        c.model.vocab_size = 13;
        c.model.hidden_size = 16;
        c.model.intermediate_size = 24;
        c.model.num_hidden_layers = 2;
        c.attention.method = method;
        c.attention.window = 2;
        c.data.dir = dir.clone();
        c.data.seq_len = len;
        c.train.device = "cpu".into();
        c.eval.batch_size = 1;
        let split = Split::open(&dir, &meta, "val").unwrap();
        (c, split)
    }

    /// Context-free gates are drawn afresh for every evaluated batch: two batches holding the
    /// same sequence get different masks, so their mean loss is not that of one of them (it
    /// was, when every batch reused one mask).
    #[test]
    fn context_free_gates_differ_between_batches() {
        let (mut c, split) = repeated_rows("eval-bernoulli", 16, 2, Method::L2a);
        c.attention.router = Router::Bernoulli;
        c.attention.bernoulli_p = 0.5;
        let b = Built::new(&c, Device::Cpu).unwrap();
        let loss = |batches: usize| {
            let c = Config {
                eval: EvalConfig {
                    max_batches: batches,
                    ..c.eval.clone()
                },
                ..c.clone()
            };
            evaluate(&b.model, &split, &c, "val", Device::Cpu, false)
                .unwrap()
                .loss
        };
        assert!((loss(1) - loss(2)).abs() > 1e-7);
        assert_eq!(loss(2), loss(2), "evaluation repeats");
    }

    /// The loss by position is the mean, over the evaluated sequences, of the per-token loss
    /// computed by hand at each position, bucketed 0..1024, 1024..2048, 2048..2500; its
    /// token-weighted mean is the overall loss.
    #[test]
    fn loss_by_position_buckets_the_per_token_loss() {
        assert_eq!(position_buckets(1024), vec![]);
        assert_eq!(
            position_buckets(5000),
            vec![(0, 1024), (1024, 2048), (2048, 4096), (4096, 5000)]
        );
        let (mut c, split) = repeated_rows("eval-by-position", 2500, 2, Method::Full);
        c.eval.max_batches = 2;
        let b = Built::new(&c, Device::Cpu).unwrap();
        let report = evaluate(&b.model, &split, &c, "val", Device::Cpu, false).unwrap();
        let mut by_hand = vec![0f64; 2500];
        for (_, batch) in split.sequential(1, 2500, 2, Device::Cpu) {
            let logits = b.model.forward(&batch.x, &ForwardCtx::default()).logits;
            let lp = logits.to_kind(Kind::Double).log_softmax(-1, Kind::Double);
            let nll = -lp.gather(-1, &batch.y.unsqueeze(-1), false).squeeze_dim(-1);
            for (t, v) in Vec::<f64>::try_from(nll.flatten(0, 1))
                .unwrap()
                .iter()
                .enumerate()
            {
                by_hand[t] += v / 2.0;
            }
        }
        let spans: Vec<_> = report
            .by_position
            .iter()
            .map(|p| (p.from, p.to, p.tokens))
            .collect();
        assert_eq!(
            spans,
            vec![(0, 1024, 2048), (1024, 2048, 2048), (2048, 2500, 904)]
        );
        for p in &report.by_position {
            let want = by_hand[p.from..p.to].iter().sum::<f64>() / (p.to - p.from) as f64;
            assert!(
                (p.loss - want).abs() < 1e-4,
                "{}..{}: {} vs {want}",
                p.from,
                p.to,
                p.loss
            );
        }
        let mean = report
            .by_position
            .iter()
            .map(|p| p.loss * p.tokens as f64)
            .sum::<f64>()
            / report.tokens as f64;
        assert!((mean - report.loss).abs() < 1e-9);
    }

    /// mu_f counts a pruned L2A layer as all window in training's log and in evaluation
    /// alike (training's average used to skip it).
    #[test]
    fn mu_f_is_the_same_in_training_and_evaluation() {
        let (mut c, split) = repeated_rows("eval-mu-f", 16, 1, Method::L2a);
        c.attention.pruned_layers = vec![0];
        let b = Built::new(&c, Device::Cpu).unwrap();
        let report = evaluate(&b.model, &split, &c, "val", Device::Cpu, false).unwrap();
        let batch = &split.sequential(1, 16, 1, Device::Cpu)[0].1;
        let (_, step) = step::forward_loss(&b.model, &batch.x, &batch.y, &ForwardCtx::default());
        let mu = report.gates.unwrap().mu_f;
        // The zero-initialised router opens every gate of layer 1; layer 0 has none.
        assert!((mu - 0.5).abs() < 1e-12, "{mu}");
        assert!((step.read().full_usage.unwrap() - mu).abs() < 1e-12);
    }

    /// When timing is asked for, every figure is a positive time or rate, the attention layers are
    /// part of the forward, and the cache decoding filled is the size the estimate gives
    /// for the same length: the whole context for full attention, the window for SWA.
    #[test]
    fn timing_measures_the_cache_it_estimates() {
        for method in [Method::Full, Method::Swa] {
            let (mut c, split) = repeated_rows("eval-timing", 16, 2, method);
            c.eval.batch_size = 2;
            c.eval.timing = true;
            let b = Built::new(&c, Device::Cpu).unwrap();
            let report = evaluate(&b.model, &split, &c, "val", Device::Cpu, false).unwrap();
            assert!(report.timing.is_none(), "evaluation alone does not time");
            let t = timing_of(&b.model, &split, &c, Device::Cpu).expect("timing asked for");
            assert_eq!((t.batch, t.seq_len, t.decode_steps), (2, 16, 8));
            for v in [
                t.forward_ms,
                t.attention_ms,
                t.prefill_ms,
                t.decode_tokens_per_s,
            ] {
                assert!(v.is_finite() && v > 0.0, "{t:?}");
            }
            assert_eq!(
                t.decode_cache_bytes, report.kv_cache_bytes_total,
                "{method:?}"
            );
            c.eval.timing = false;
            assert!(timing_of(&b.model, &split, &c, Device::Cpu).is_none());
        }
    }

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
