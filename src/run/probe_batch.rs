//! One batch of probes: its prompts decoded greedily over the cache, each answer scored,
//! what the batch cost; the record an evaluation's journal keeps (`run::journal`).

use crate::config::{Config, ProbeGates};
use crate::data::probes::Probe;
use crate::data::TextTokenizer;
use crate::model::attention::{ForwardCtx, GateOverride};
use crate::model::Llama;
use crate::run::generate::{greedy, HeadGates};
use anyhow::Result;
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

/// Inference cost of the probes of one (task, length).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub(crate) struct Cost {
    pub(crate) rows: usize,
    pub(crate) length: usize,
    pub(crate) prefill_pairs: f64,
    pub(crate) decode_pairs: f64,
    pub(crate) decode_tokens: usize,
    /// Keys full causal attention would read for the same decoded tokens (per layer and head).
    pub(crate) full_decode_keys: f64,
    pub(crate) cache_bytes: f64,
    /// Cache bytes full attention would hold for the same sequences.
    pub(crate) full_cache_bytes: f64,
    pub(crate) prefill_seconds: f64,
    pub(crate) batches: usize,
    pub(crate) decode_seconds: f64,
}

impl Cost {
    /// Adds a batch's cost (its length is the same).
    pub(crate) fn add(&mut self, b: &Cost) {
        self.rows += b.rows;
        self.batches += b.batches;
        self.prefill_pairs += b.prefill_pairs;
        self.decode_pairs += b.decode_pairs;
        self.decode_tokens += b.decode_tokens;
        self.full_decode_keys += b.full_decode_keys;
        self.cache_bytes += b.cache_bytes;
        self.full_cache_bytes += b.full_cache_bytes;
        self.prefill_seconds += b.prefill_seconds;
        self.decode_seconds += b.decode_seconds;
    }
}

/// One batch of probes as it was scored: each row's answer and scores, what the batch cost,
/// the gates over its prompts. The journal keeps it, so an evaluation cut off resumes after
/// its last finished batch.
#[derive(Serialize, Deserialize)]
pub(crate) struct Batch {
    pub(crate) rows: Vec<Row>,
    pub(crate) cost: Cost,
    pub(crate) head_gates: Option<HeadGates>,
}

impl Batch {
    /// Every number of it is finite (JSON has no other).
    pub(crate) fn finite(&self) -> bool {
        let c = &self.cost;
        let rows = self.rows.iter().all(|r| {
            [r.exact_match, r.recall]
                .into_iter()
                .chain(r.span_recall)
                .chain(r.prompt_gate)
                .chain(r.full_ratio)
                .all(f64::is_finite)
        });
        let costs = [
            c.prefill_pairs,
            c.decode_pairs,
            c.full_decode_keys,
            c.cache_bytes,
            c.full_cache_bytes,
            c.prefill_seconds,
            c.decode_seconds,
        ];
        let gates = self
            .head_gates
            .iter()
            .all(|g| g.positions.is_finite() && g.sums.iter().flatten().all(|x| x.is_finite()));
        rows && costs.iter().all(|x| x.is_finite()) && gates
    }
}

/// One prompt of a batch as scored: its target, the generated text and its scores.
#[derive(Serialize, Deserialize)]
pub(crate) struct Row {
    pub(crate) target: String,
    pub(crate) text: String,
    pub(crate) exact_match: f64,
    pub(crate) recall: f64,
    pub(crate) span_recall: Option<f64>,
    /// The mean gate over every position of the prompt: the rate `span_recall` is read
    /// against (gates blind to where the evidence is open it that often). Absent from the
    /// journals of earlier evaluations.
    #[serde(default)]
    pub(crate) prompt_gate: Option<f64>,
    pub(crate) full_ratio: Option<f64>,
}

/// Greedy decoding of one batch of `probes`, each `length` tokens, at most `max_new` new
/// tokens, its gates drawn from `gate_seed`, scored.
pub(crate) fn run_batch(
    model: &Llama,
    cfg: &Config,
    tok: &TextTokenizer,
    probes: &[Probe],
    (length, max_new, gate_seed): (usize, usize, u64),
    device: Device,
) -> Result<Batch> {
    let ids: Vec<i64> = probes
        .iter()
        .flat_map(|p| p.prompt.iter().map(|&t| t as i64))
        .collect();
    let prompts = Tensor::from_slice(&ids)
        .view([probes.len() as i64, length as i64])
        .to_device(device);
    let spans = span_mask(probes, length).to_device(device);
    let ctx = ForwardCtx {
        gate_seed,
        gate_override: (cfg.eval.gates == ProbeGates::Oracle)
            .then(|| GateOverride::Positions(spans.shallow_clone())),
        ..Default::default()
    };
    let g = greedy(model, &prompts, max_new, tok.eot(), &ctx, true);
    // Per row, the mean gate over the evidence's positions and over all of them.
    let span_hits: Option<(Vec<f64>, Vec<f64>)> = g.prompt_positions.as_ref().map(|at| {
        let hit = (at * &spans).sum_dim_intlist(1, false, Kind::Double)
            / spans.sum_dim_intlist(1, false, Kind::Double);
        let all = at.mean_dim(1, false, Kind::Double);
        (
            Vec::<f64>::try_from(hit).expect("span recall"),
            Vec::<f64>::try_from(all).expect("prompt gate"),
        )
    });
    let mut rows = Vec::with_capacity(probes.len());
    for (r, p) in probes.iter().enumerate() {
        let text = tok.decode(&g.tokens[r]);
        let (exact_match, recall) = p.score(&text);
        let full_ratio = match &g.gates {
            Some(gates) => {
                let n = tok.encode(&p.target)?.len().clamp(1, gates[r].len());
                Some(gates[r][..n].iter().sum::<f64>() / n as f64)
            }
            None => None,
        };
        rows.push(Row {
            target: p.target.clone(),
            text,
            exact_match,
            recall,
            span_recall: span_hits.as_ref().map(|h| h.0[r]),
            prompt_gate: span_hits.as_ref().map(|h| h.1[r]),
            full_ratio,
        });
    }
    let steps = g.decode_pairs.len();
    let n = probes.len();
    let cost = Cost {
        rows: n,
        length,
        prefill_pairs: g.prefill_pairs,
        decode_pairs: g.decode_pairs.iter().sum::<f64>(),
        decode_tokens: n * steps,
        // Decoding step s feeds position length + s - 1, which sees length + s keys.
        full_decode_keys: (n * (length * steps + steps * (steps + 1) / 2)) as f64,
        cache_bytes: g.cache_bytes,
        full_cache_bytes: n as f64 * model.full_kv_cache_bytes(length + steps),
        prefill_seconds: g.prefill_seconds,
        batches: 1,
        decode_seconds: g.decode_seconds,
    };
    Ok(Batch {
        rows,
        cost,
        head_gates: g.prompt_gates,
    })
}

/// `[B, L]` (fp32): 1 at the positions each probe's answer rests on (`Probe::spans`).
fn span_mask(probes: &[Probe], length: usize) -> Tensor {
    let mut mask = vec![0f32; probes.len() * length];
    for (r, p) in probes.iter().enumerate() {
        for &(a, b) in &p.spans {
            for m in &mut mask[r * length + a.min(length)..r * length + b.min(length)] {
                *m = 1.0;
            }
        }
    }
    Tensor::from_slice(&mask).view([probes.len() as i64, length as i64])
}
