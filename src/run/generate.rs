//! Greedy decoding over the model's key-value cache, the evaluation suite's generator: what it
//! produced, what it cost (pairs attended in prefill and per decoded token, cache bytes,
//! times), and where a routed model's gates opened (per generated token, per prompt position,
//! per layer and head).

use crate::model::attention::ForwardCtx;
use crate::model::{ForwardOutput, Llama};
use std::time::Instant;
use tch::{Kind, Tensor};

/// What greedy decoding of a batch produced and cost.
pub(crate) struct Generation {
    /// Generated ids per row, ending before the first end-of-document token.
    pub(crate) tokens: Vec<Vec<u32>>,
    /// (query, key) pairs of the prefill over layers, heads and rows.
    pub(crate) prefill_pairs: f64,
    /// Pairs of each decoding step after the prefill, over layers, heads and rows.
    pub(crate) decode_pairs: Vec<f64>,
    /// `[row][i]`: mean hard gate over layers and heads of the query that produced generated
    /// token i (the last prompt position for i = 0); None for static methods.
    pub(crate) gates: Option<Vec<Vec<f64>>>,
    /// The prompts' head usage: hard gates summed over rows and prompt positions per layer
    /// and head; None for static methods.
    pub(crate) prompt_gates: Option<HeadGates>,
    /// `[B, L]`: each prompt position's hard gate, meaned over layers and heads (a layer
    /// without gates as window); None for static methods.
    pub(crate) prompt_positions: Option<Tensor>,
    /// Cache bytes after the last step, all rows.
    pub(crate) cache_bytes: f64,
    pub(crate) prefill_seconds: f64,
    pub(crate) decode_seconds: f64,
}

/// Per row, the mean gate over layers and heads at position `pos` of the forward's chunk; a
/// static layer inside a routed model (a pruned L2A layer) counts as window.
fn position_gates(out: &ForwardOutput, pos: i64) -> Option<Vec<f64>> {
    if out.layers.iter().all(|l| l.gates.is_none()) {
        return None;
    }
    let rows = out.logits.size()[0];
    let mut sum = vec![0.0; rows as usize];
    for l in &out.layers {
        if let Some(g) = &l.gates {
            let m = g
                .select(1, pos)
                .to_kind(Kind::Double)
                .mean_dim(-1, false, Kind::Double);
            for (s, v) in sum
                .iter_mut()
                .zip(Vec::<f64>::try_from(m).expect("gates to vec"))
            {
                *s += v;
            }
        }
    }
    Some(
        sum.into_iter()
            .map(|s| s / out.layers.len() as f64)
            .collect(),
    )
}

/// `[B, L]`: the forward's hard gates at each position, meaned over layers and heads; a static
/// layer inside a routed model counts as window. None without gates.
fn position_means(out: &ForwardOutput) -> Option<Tensor> {
    let sum = out
        .layers
        .iter()
        .filter_map(|l| l.gates.as_ref())
        .map(|g| g.to_kind(Kind::Float).mean_dim(-1, false, Kind::Float))
        .reduce(|a, b| a + b)?;
    Some(sum / out.layers.len() as f64)
}

/// Hard gates summed per layer and head over `positions` (row, position) pairs: AHA Fig. 3's
/// usage map of the text they were summed over. A layer without gates (a pruned L2A layer)
/// counts as window.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct HeadGates {
    pub(crate) sums: Vec<Vec<f64>>,
    pub(crate) positions: f64,
}

impl HeadGates {
    /// The gates of every layer of one forward, summed over its rows and positions.
    pub(crate) fn of(out: &ForwardOutput) -> Option<HeadGates> {
        let heads = out.layers.iter().find_map(|l| l.gates.as_ref())?.size()[2] as usize;
        let sizes = out.logits.size();
        let sums = out
            .layers
            .iter()
            .map(|l| match &l.gates {
                Some(g) => Vec::<f64>::try_from(g.to_kind(Kind::Double).sum_dim_intlist(
                    [0i64, 1].as_slice(),
                    false,
                    Kind::Double,
                ))
                .expect("gates to vec"),
                None => vec![0.0; heads],
            })
            .collect();
        Some(HeadGates {
            sums,
            positions: (sizes[0] * sizes[1]) as f64,
        })
    }

    pub(crate) fn add(&mut self, other: &HeadGates) {
        for (a, b) in self.sums.iter_mut().zip(&other.sums) {
            for (x, y) in a.iter_mut().zip(b) {
                *x += y;
            }
        }
        self.positions += other.positions;
    }

    /// Usage per layer and head: the share of positions whose gate chose the full path.
    pub(crate) fn usage(&self) -> Vec<Vec<f64>> {
        self.sums
            .iter()
            .map(|r| r.iter().map(|s| s / self.positions).collect())
            .collect()
    }
}

/// Greedy decoding of `max_new` tokens after `prompts: [B, L]` (int64) with the model's
/// key-value cache.
pub(crate) fn greedy(
    model: &Llama,
    prompts: &Tensor,
    max_new: usize,
    eot: Option<u32>,
    ctx: &ForwardCtx,
) -> Generation {
    tch::no_grad(|| {
        let rows = prompts.size()[0] as usize;
        let mut cache = model.new_cache();
        let start = Instant::now();
        let out = model.forward_cached(prompts, &mut cache, ctx);
        let mut next = out.logits.select(1, -1).argmax(-1, false);
        // Reading the tokens back waits for the device, so the clock measures the work.
        let mut generated: Vec<Vec<i64>> = Vec::<i64>::try_from(&next)
            .expect("ids")
            .into_iter()
            .map(|t| vec![t])
            .collect();
        let prefill_seconds = start.elapsed().as_secs_f64();
        let prefill_pairs = out.attended_pairs();
        let prompt_gates = HeadGates::of(&out);
        let prompt_positions = position_means(&out);
        let mut gates =
            position_gates(&out, -1).map(|g| g.into_iter().map(|v| vec![v]).collect::<Vec<_>>());
        let mut decode_pairs = Vec::with_capacity(max_new);
        let start = Instant::now();
        for _ in 1..max_new {
            let out = model.forward_cached(&next.view([rows as i64, 1]), &mut cache, ctx);
            next = out.logits.select(1, -1).argmax(-1, false);
            for (g, t) in generated
                .iter_mut()
                .zip(Vec::<i64>::try_from(&next).expect("ids"))
            {
                g.push(t);
            }
            decode_pairs.push(out.attended_pairs());
            if let (Some(all), Some(step)) = (gates.as_mut(), position_gates(&out, 0)) {
                for (row, v) in all.iter_mut().zip(step) {
                    row.push(v);
                }
            }
        }
        let decode_seconds = start.elapsed().as_secs_f64();
        let tokens = generated
            .into_iter()
            .map(|g| {
                g.into_iter()
                    .map(|t| t as u32)
                    .take_while(|t| Some(*t) != eot)
                    .collect()
            })
            .collect();
        Generation {
            tokens,
            prefill_pairs,
            decode_pairs,
            gates,
            prompt_gates,
            prompt_positions,
            cache_bytes: cache.bytes(),
            prefill_seconds,
            decode_seconds,
        }
    })
}
