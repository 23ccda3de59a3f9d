//! Greedy decoding over the model's key-value cache, the evaluation suite's generator: what it
//! produced, what it cost (pairs attended in prefill and per decoded token, cache bytes,
//! times), and where a routed model's gates opened (per generated token, per prompt position,
//! per layer and head).

use crate::model::attention::ForwardCtx;
use crate::model::kernels::CudaGraph;
use crate::model::nn::with_cast_weights;
use crate::model::{ForwardOutput, Llama, ModelCache};
use std::time::Instant;
use tch::{Device, Kind, Tensor};

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

/// `[B]`: per row, the mean hard gate over layers and heads at position `pos` of the forward's
/// chunk, on the device; a static layer inside a routed model (a pruned L2A layer) counts as
/// window. None for static methods.
fn position_gates(out: &ForwardOutput, pos: i64) -> Option<Tensor> {
    let sum = out
        .layers
        .iter()
        .filter_map(|l| l.gates.as_ref())
        .map(|g| g.select(1, pos).mean_dim(-1, false, Kind::Float))
        .reduce(|a, b| a + b)?;
    Some(sum / out.layers.len() as f64)
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
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct HeadGates {
    pub(crate) sums: Vec<Vec<f64>>,
    pub(crate) positions: f64,
}

impl HeadGates {
    /// The gates of every layer of one forward, summed over its rows and positions.
    pub(crate) fn of(out: &ForwardOutput) -> Option<HeadGates> {
        let sizes = out.layers.iter().find_map(|l| l.gates.as_ref())?.size();
        let heads = sizes[2] as usize;
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

/// How many decoding steps run between the host's checks that every row has ended.
const STOP_CHECK: usize = 16;

/// Greedy decoding of up to `max_new` tokens (at least one) after `prompts: [B, L]` (int64) with the model's
/// key-value cache, until every row has produced `eot`. Everything a step records (its token,
/// pairs, gates, whether a row has ended) stays on the device, read once at the end; with
/// `graphs`, on the kernels on a GPU, one step is captured as a CUDA graph and replayed for
/// each later token.
pub(crate) fn greedy(
    model: &Llama,
    prompts: &Tensor,
    max_new: usize,
    eot: Option<u32>,
    ctx: &ForwardCtx,
    graphs: bool,
) -> Generation {
    tch::no_grad(|| {
        with_cast_weights(|| {
            let (rows, len) = (prompts.size()[0], prompts.size()[1]);
            // The prefill's token is always produced.
            let max_new = max_new.max(1);
            let device = prompts.device();
            let mut cache = model.new_cache(len + max_new as i64, device);
            let start = Instant::now();
            let out = model.prefill(prompts, &mut cache, ctx);
            let first = out.logits.select(1, -1).argmax(-1, false);
            // Reading the first tokens back waits for the device, so the clock measures the work.
            let _ = Vec::<i64>::try_from(&first).expect("ids");
            let prefill_seconds = start.elapsed().as_secs_f64();
            let prefill_pairs = out.attended_pairs();
            let prompt_gates = HeadGates::of(&out);
            let prompt_positions = position_means(&out);
            let mut ids = first.view([rows, 1]).copy();
            let mut rec = Records {
                tokens: Tensor::zeros([rows, max_new as i64], (Kind::Int64, device)),
                pairs: Tensor::zeros([max_new as i64], (Kind::Double, device)),
                gates: position_gates(&out, -1).map(|g| {
                    let all = Tensor::zeros([rows, max_new as i64], (Kind::Float, device));
                    let _ = all.narrow(1, 0, 1).copy_(&g.unsqueeze(1));
                    all
                }),
                ended: match eot {
                    Some(e) => first.eq(e as i64),
                    None => first.zeros_like().to_kind(Kind::Bool),
                },
            };
            let _ = rec.tokens.narrow(1, 0, 1).copy_(&ids);
            drop(out);
            let start = Instant::now();
            let mut steps = 1;
            // The same storage as the records' flags, which each step updates in place.
            let ended = rec.ended.shallow_clone();
            let mut step = |cache: &mut ModelCache| {
                let out = model.forward_cached(&ids, cache, ctx);
                let next = out.logits.select(1, -1).argmax(-1, false);
                rec.record(&out, &next, &cache.state.pos, len, eot);
                let _ = ids.copy_(&next.view([rows, 1]));
            };
            let kernels = model.kernels.filter(|_| graphs && device.is_cuda());
            let mut graph = None;
            while steps < max_new {
                // Without an end-of-text token no row ends: no check waits for the device.
                if eot.is_some() && steps % STOP_CHECK == 0 && ended.all().int64_value(&[]) != 0 {
                    break;
                }
                match (&graph, kernels) {
                    (Some(g), _) => {
                        CudaGraph::replay(g).expect("replaying a captured decoding step");
                        cache.state.replayed();
                    }
                    // The first step runs as it is, warming the libraries up; the second is
                    // captured, then replayed to run.
                    (None, Some(kern)) if steps >= 2 => {
                        let g = kern
                            .capture(|| step(&mut cache))
                            .expect("capturing a decoding step");
                        g.replay().expect("replaying a captured decoding step");
                        graph = Some(g);
                    }
                    _ => step(&mut cache),
                }
                steps += 1;
            }
            let tokens = Vec::<Vec<i64>>::try_from(
                rec.tokens.narrow(1, 0, steps as i64).to_device(Device::Cpu),
            )
            .expect("ids");
            let decode_seconds = start.elapsed().as_secs_f64();
            let decode_pairs = Vec::<f64>::try_from(
                rec.pairs
                    .narrow(0, 0, steps as i64 - 1)
                    .to_device(Device::Cpu),
            )
            .expect("pairs");
            let gates = rec.gates.map(|g| {
                Vec::<Vec<f64>>::try_from(
                    g.narrow(1, 0, steps as i64)
                        .to_kind(Kind::Double)
                        .to_device(Device::Cpu),
                )
                .expect("gates")
            });
            let tokens = tokens
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
    })
}

/// What each decoding step writes on the device: its token, the pairs it attended, its mean
/// gate per row, and which rows have produced the end token.
struct Records {
    /// `[B, max_new]`.
    tokens: Tensor,
    /// `[max_new]`: step s's pairs at s - 1.
    pairs: Tensor,
    /// `[B, max_new]`; None for static methods.
    gates: Option<Tensor>,
    /// `[B]` bool.
    ended: Tensor,
}

impl Records {
    /// Records the step whose output is `out` and token `next: [B]`, after which the cache
    /// holds `pos` tokens (prompts of `len`).
    fn record(
        &mut self,
        out: &ForwardOutput,
        next: &Tensor,
        pos: &Tensor,
        len: i64,
        eot: Option<u32>,
    ) {
        let at = pos - len;
        let _ = self.tokens.index_copy_(1, &at, &next.unsqueeze(1));
        let pairs = Tensor::stack(
            &out.layers
                .iter()
                .map(|l| l.pairs.to_kind(Kind::Double))
                .collect::<Vec<_>>(),
            0,
        )
        .sum(Kind::Double);
        let _ = self.pairs.index_copy_(0, &(&at - 1), &pairs.view([1]));
        if let (Some(all), Some(g)) = (&mut self.gates, position_gates(out, 0)) {
            let _ = all.index_copy_(1, &at, &g.unsqueeze(1));
        }
        if let Some(e) = eot {
            let _ = self.ended.logical_or_(&next.eq(e as i64));
        }
    }
}
