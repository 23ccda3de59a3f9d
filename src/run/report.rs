//! What an evaluation writes and the sweep tables read: `eval.json` (`EvalReport` with the
//! resolved config), its tidy CSVs and, for routed methods, the gate files. One type per file
//! is written and read back, so a field renamed on one side cannot vanish on the other.

use crate::config::Config;
use crate::model::attention::HEAD_RANKING_COLUMNS;
use crate::util::atomic;
use crate::util::fault;
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub(crate) struct AttentionWork {
    /// (query, key) pairs attended over all layers, heads and evaluated sequences, by the
    /// paths actually executed: a routed token's full prefix or window, PPA's offsets, and
    /// for L2A both its local window and its global module.
    pub(crate) pairs: f64,
    pub(crate) full_causal_pairs: f64,
    /// pairs / full_causal_pairs: attention work relative to full causal attention in the
    /// same model. Not a density: above 1 when a method attends more pairs than full
    /// attention would (L2A at a low threshold adds its global module's pairs to its window's).
    pub(crate) pairs_vs_full: f64,
    /// 4 * pairs * head_dim: QK^T and PV, a multiply and an add each.
    pub(crate) flops: f64,
    pub(crate) full_causal_flops: f64,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub(crate) struct Bucket {
    /// "unpredictable", "local", "d2-3", "d4-7", ..., or "out_of_context".
    pub(crate) bucket: String,
    /// Smallest dependency distance in the bucket (0 for unpredictable, u32::MAX for
    /// out_of_context), for sorting.
    pub(crate) min_distance: u32,
    pub(crate) tokens: u64,
    pub(crate) loss: f64,
    /// Share of the bucket's tokens the model's argmax predicts exactly (a recall's answer is
    /// a copy of its definition's value, so this is the recall task's accuracy); None in
    /// reports written before it was measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) accuracy: Option<f64>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub(crate) struct EvalReport {
    pub(crate) split: String,
    /// Length of the evaluated sequences (`eval.seq_len`, or `data.seq_len`).
    pub(crate) seq_len: usize,
    /// Training step of the evaluated weights, None when they are a bare weight file.
    pub(crate) checkpoint_step: Option<usize>,
    /// The run's `train.steps`: a checkpoint step below it is a model evaluated before its
    /// training finished.
    pub(crate) train_steps: usize,
    pub(crate) tokens: u64,
    pub(crate) loss: f64,
    pub(crate) perplexity: f64,
    pub(crate) bits_per_token: f64,
    /// Entropy (nats) of the evaluated targets' unigram distribution: the loss of a model
    /// that knows token frequencies and nothing else.
    pub(crate) unigram_entropy: f64,
    pub(crate) attention: AttentionWork,
    /// Key-value cache bytes per layer for one sequence of seq_len tokens at decode time.
    pub(crate) kv_cache_bytes: Vec<f64>,
    pub(crate) kv_cache_bytes_total: f64,
    /// The same model with full attention in every layer.
    pub(crate) kv_cache_bytes_full: f64,
    /// Empty unless the data set records dependency distances.
    pub(crate) buckets: Vec<Bucket>,
    /// Routed methods only.
    pub(crate) gates: Option<GateReport>,
    /// Measured inference time (`eval.timing`); None when not asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) timing: Option<Timing>,
    /// The loss of each source of a corpus held out per source (`data prepare --sources`),
    /// over its share of the evaluated batches; empty for a split of one part.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) by_source: Vec<SourceLoss>,
    /// The loss by position in the sequence, in buckets that double in length after the
    /// first 1,024 positions (`position_buckets`); empty for sequences of 1,024 or fewer.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) by_position: Vec<PositionLoss>,
}

/// The validation loss of the predictions at positions `from..to` of each sequence.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub(crate) struct PositionLoss {
    pub(crate) from: usize,
    pub(crate) to: usize,
    pub(crate) tokens: u64,
    pub(crate) loss: f64,
}

/// The column of positions `from..to` in tables: `loss_pos_<from>_<to - 1>`.
pub(crate) fn position_column(from: usize, to: usize) -> String {
    format!("loss_pos_{from}_{}", to - 1)
}

/// Position buckets of a sequence of `seq_len` tokens: `0..1024`, then each twice as long as
/// the one before, the last cut at `seq_len`; none for 1,024 tokens or fewer. A context
/// extension is read off them: the buckets past the native length show whether the model
/// uses what it now sees.
pub(crate) fn position_buckets(seq_len: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    if seq_len <= 1024 {
        return out;
    }
    let (mut from, mut to) = (0, 1024);
    while from < seq_len {
        out.push((from, to.min(seq_len)));
        (from, to) = (to, to * 2);
    }
    out
}

/// The validation loss of one source of a corpus.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub(crate) struct SourceLoss {
    pub(crate) source: String,
    pub(crate) tokens: u64,
    pub(crate) loss: f64,
}

/// What one batch of the evaluated split costs in time on the evaluating device. Each figure
/// is the median of `TIMING_REPS` repetitions after one unmeasured warm-up, and includes the
/// host's work (kernel launches, a method's own synchronisations): the time a run pays.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub(crate) struct Timing {
    pub(crate) device: String,
    /// Sequences of the timed batch and their length.
    pub(crate) batch: usize,
    pub(crate) seq_len: usize,
    /// One forward of the batch without gradients, milliseconds.
    pub(crate) forward_ms: f64,
    /// The attention layers' part of it, each timed with the device synchronised around it.
    pub(crate) attention_ms: f64,
    /// Prefill of the batch's first `seq_len - decode_steps - 3` tokens into a key-value cache,
    /// to the first token read back (the time to first token).
    pub(crate) prefill_ms: f64,
    /// Tokens then decoded one at a time per sequence, greedily, over the cache, as the
    /// evaluations decode (`run/generate.rs`: on a GPU's kernels, one step captured as a CUDA
    /// graph and replayed).
    pub(crate) decode_steps: usize,
    /// Generated tokens per second over those steps alone (the capture excluded), all
    /// sequences of the batch together.
    pub(crate) decode_tokens_per_s: f64,
    /// Bytes of keys and values the cache holds per sequence after decoding (measured from
    /// the cache, beside the estimate `kv_cache_bytes_total`).
    pub(crate) decode_cache_bytes: f64,
    /// The repetitions behind the medians above, and their spread (largest less smallest)
    /// for the forward, the prefill and the decoding rate: a timing is read with its noise.
    #[serde(default)]
    pub(crate) runs: usize,
    #[serde(default)]
    pub(crate) forward_ms_spread: f64,
    #[serde(default)]
    pub(crate) prefill_ms_spread: f64,
    #[serde(default)]
    pub(crate) decode_tokens_per_s_spread: f64,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub(crate) struct GateReport {
    /// Mean hard gate over layers, tokens and heads (a static layer of a routed model, such
    /// as a pruned L2A layer, counts as all window).
    pub(crate) mu_f: f64,
    pub(crate) per_layer: Vec<f64>,
    /// `[layer][head]`.
    pub(crate) per_head: Vec<Vec<f64>>,
    /// `[layer][head]`: gaps between consecutive full-path calls of each head.
    pub(crate) gaps: Vec<Vec<GapStats>>,
    /// Heads without a measured median gap: their estimated survival never falls to one half
    /// within the evaluated sequences (or they never call twice in one).
    pub(crate) censored_heads: usize,
    /// Synthetic corpus only.
    pub(crate) need: Option<NeedReport>,
}

/// The distribution of one head's gaps: the number of tokens from one call of its full path to
/// the next (AHA Table 3 reports their mean). Within a finite sequence a gap is complete only
/// when both calls fall inside it; the spell after a head's last call ends at the sequence
/// end, so that gap is only known to be longer (right-censored). Dropping those, as a plain
/// mean over complete gaps does, biases gaps short; the Kaplan-Meier estimator below counts
/// them as what they are. Spells whose start lies before the sequence (before the first call,
/// or a whole sequence without a call) are left out of the estimate: only long gaps cover a
/// sequence start, so they would bias it long. `censored_share` reports how often a head
/// calls fewer than twice in a sequence.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub(crate) struct GapStats {
    /// Complete gaps observed.
    pub(crate) gaps: u64,
    /// Mean of the complete gaps: the paper's statistic, biased short.
    pub(crate) mean: Option<f64>,
    /// Kaplan-Meier median and 90th percentile of the gap; None when the estimated survival
    /// never falls that low (too many spells censored, or no complete gap at all).
    pub(crate) median: Option<u32>,
    pub(crate) p90: Option<u32>,
    /// Longest complete gap.
    pub(crate) max: Option<u32>,
    /// Longest censored spell: some gap is longer than this.
    pub(crate) max_censored: Option<u32>,
    /// Share of the evaluated sequences in which the head called full attention fewer than
    /// twice (no complete gap).
    pub(crate) censored_share: f64,
}

/// Gate = 1 against need: a position needs global attention at window w when the token it
/// predicts depends on one at least w back. Positions with no dependency and those whose
/// dependency lies before the sequence start (no attention can reach it) are left out.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub(crate) struct NeedReport {
    pub(crate) window: usize,
    pub(crate) positions: u64,
    pub(crate) needing: u64,
    /// Per layer, each (position, head) gate is one decision.
    pub(crate) per_layer: Vec<PrecisionRecall>,
    /// Every (layer, position, head) gate is one decision.
    pub(crate) all_gates: PrecisionRecall,
    /// The trivial rule a router could learn from one token back: open at the key that follows
    /// an ASK marker (the only token whose prediction reaches a distant definition), at every
    /// head; each position is one decision. The honest baseline of `all_gates`, beside chance
    /// (`needing / positions`, gates opened at random).
    #[serde(default)]
    pub(crate) ask_rule: PrecisionRecall,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub(crate) struct PrecisionRecall {
    pub(crate) true_pos: u64,
    pub(crate) false_pos: u64,
    pub(crate) false_neg: u64,
    pub(crate) precision: Option<f64>,
    pub(crate) recall: Option<f64>,
}

/// `eval.json`: a report and the resolved config it was computed with. `write_report` writes
/// it and `read_report` reads it (the sweep tables do), through this one type, so a field
/// renamed on one side cannot silently vanish on the other.
#[derive(Serialize, Deserialize, Clone, Debug)]
#[serde(deny_unknown_fields)]
pub(crate) struct EvalFile {
    pub(crate) report: EvalReport,
    pub(crate) config: Config,
}

/// The `eval.json` in `dir`; None when there is none, an error naming the file when it is not
/// one this version writes.
pub(crate) fn read_report(dir: &Path) -> Result<Option<EvalFile>> {
    let path = dir.join("eval.json");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    serde_json::from_str(&text).map(Some).with_context(|| {
        format!(
            "{} is not an evaluation report of this version of attnsweep; evaluate the run again",
            path.display()
        )
    })
}

/// Writes `eval.json` (report plus the resolved config), `eval.csv` (one metric per row, a
/// corpus's sources' losses as `loss_<source>`) and, when there are buckets,
/// `eval_buckets.csv`; also the resolved `config.toml`.
pub(crate) fn write_report(dir: &Path, report: &EvalReport, cfg: &Config) -> Result<()> {
    atomic::ensure_writable_dir(dir)?;
    let file = EvalFile {
        report: report.clone(),
        config: cfg.recordable(),
    };
    atomic::write_bytes(
        &dir.join("eval.json"),
        serde_json::to_string_pretty(&file)?.as_bytes(),
    )?;
    fault::point("eval_report");
    let a = &report.attention;
    let mut rows: Vec<(String, f64)> = [
        ("tokens", report.tokens as f64),
        ("loss", report.loss),
        ("perplexity", report.perplexity),
        ("bits_per_token", report.bits_per_token),
        ("unigram_entropy", report.unigram_entropy),
        ("attended_pairs", a.pairs),
        ("full_causal_pairs", a.full_causal_pairs),
        ("pairs_vs_full", a.pairs_vs_full),
        ("attention_flops", a.flops),
        ("full_causal_flops", a.full_causal_flops),
        ("seq_len", report.seq_len as f64),
        ("kv_cache_bytes", report.kv_cache_bytes_total),
        ("kv_cache_bytes_full", report.kv_cache_bytes_full),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    if let Some(step) = report.checkpoint_step {
        rows.push(("checkpoint_step".into(), step as f64));
    }
    for src in &report.by_source {
        rows.push((format!("loss_{}", src.source), src.loss));
    }
    for p in &report.by_position {
        rows.push((position_column(p.from, p.to), p.loss));
    }
    if let Some(t) = &report.timing {
        rows.extend(
            [
                ("forward_ms", t.forward_ms),
                ("attention_ms", t.attention_ms),
                ("prefill_ms", t.prefill_ms),
                ("decode_tokens_per_s", t.decode_tokens_per_s),
                ("decode_cache_bytes", t.decode_cache_bytes),
            ]
            .map(|(k, v)| (k.to_string(), v)),
        );
    }
    if let Some(g) = &report.gates {
        rows.push(("mu_f".into(), g.mu_f));
        rows.push(("censored_heads".into(), g.censored_heads as f64));
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
                ("ask_rule_precision", n.ask_rule.precision),
                ("ask_rule_recall", n.ask_rule.recall),
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

/// The columns of a head's row in `head_usage.csv` (and in AHA Table 3, after its cell's
/// settings): its place, its usage and the distribution of its gaps (`GapStats`).
pub(crate) const HEAD_USAGE_COLUMNS: [&str; 10] = [
    "layer",
    "head",
    "mu_f",
    "gaps",
    "mean_gap",
    "gap_median",
    "gap_p90",
    "gap_max",
    "gap_max_censored",
    "censored_share",
];

impl GateReport {
    /// Head `h` of layer `l` as a row of `HEAD_USAGE_COLUMNS` (None: a statistic a head
    /// without enough gaps does not have).
    pub(crate) fn head_row(&self, l: usize, h: usize) -> [Option<f64>; 10] {
        let gap = &self.gaps[l][h];
        [
            Some(l as f64),
            Some(h as f64),
            Some(self.per_head[l][h]),
            Some(gap.gaps as f64),
            gap.mean,
            gap.median.map(f64::from),
            gap.p90.map(f64::from),
            gap.max.map(f64::from),
            gap.max_censored.map(f64::from),
            Some(gap.censored_share),
        ]
    }
}

/// `layer_head_usage.csv` (the layer x head matrix of mu_f), `head_usage.csv` (one row per
/// head with its gap distribution) and `head_ranking.csv` (heads by mu_f, highest first: the
/// input of the static_heads method).
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
    atomic::write_csv(&dir.join("layer_head_usage.csv"), &header, &matrix)?;
    let mut rows: Vec<Vec<String>> = Vec::new();
    for (l, r) in g.per_head.iter().enumerate() {
        for h in 0..r.len() {
            let row = g.head_row(l, h);
            rows.push(
                row.iter()
                    .map(|v| v.map_or(String::new(), |v| v.to_string()))
                    .collect(),
            );
        }
    }
    let strs = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    atomic::write_csv(
        &dir.join("head_usage.csv"),
        &strs(&HEAD_USAGE_COLUMNS),
        &rows,
    )?;
    let mut ranked: Vec<(usize, usize, f64)> = g
        .per_head
        .iter()
        .enumerate()
        .flat_map(|(l, r)| r.iter().enumerate().map(move |(h, &mu)| (l, h, mu)))
        .collect();
    ranked.sort_by(|a, b| b.2.total_cmp(&a.2).then(a.0.cmp(&b.0)).then(a.1.cmp(&b.1)));
    let rows: Vec<Vec<String>> = ranked
        .iter()
        .enumerate()
        .map(|(rank, (l, h, mu))| {
            vec![
                (rank + 1).to_string(),
                l.to_string(),
                h.to_string(),
                mu.to_string(),
            ]
        })
        .collect();
    atomic::write_csv(
        &dir.join("head_ranking.csv"),
        &strs(&HEAD_RANKING_COLUMNS),
        &rows,
    )
}
