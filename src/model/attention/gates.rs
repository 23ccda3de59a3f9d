//! Gates: a gate is 1 for the full (global) path and 0 for the window (local) path. Where a
//! layer's gates come from (a learned router and its threshold, context-free Bernoulli
//! draws, a fixed head assignment), the straight-through estimator that trains a router
//! through hard gates, and the hash behind per-token random draws.

use super::ctx::{ForwardCtx, GateOverride};
use crate::model::nn::{upcast, Linear, RmsNorm};
use tch::{Kind, Tensor};

/// Forward with the hard gate, backward as if it were the soft score (straight-through).
pub(crate) fn straight_through(hard: &Tensor, soft: &Tensor) -> Tensor {
    // `soft - sg(soft)` first: exactly 0, so the value is exactly `hard` in any dtype
    // (`(hard + soft) - soft` can round away from it).
    hard + (soft - soft.detach())
}

/// Hard gate from soft scores: `s > tau` (AHA, SwiAttn) or `s >= tau` (L2A).
pub(crate) fn threshold(scores: &Tensor, tau: f64, inclusive: bool) -> Tensor {
    let on = if inclusive {
        scores.ge(tau)
    } else {
        scores.gt(tau)
    };
    on.to_kind(scores.kind())
}

/// Where a layer's gates come from.
pub(super) enum GateSource {
    Learned {
        router: Linear,
        /// AHA's and SwiAttn's routers read the normalised hidden state. A post-norm model
        /// (OLMo-2) hands its attention the raw residual stream, so there the router has an
        /// RMSNorm of its own (`router_norm`, initialised to ones); None where the layer's
        /// input is already normalised, and for L2A, whose router reads its own norm of the stream
        /// after the window (`global_attn.norm`).
        norm: Option<RmsNorm>,
        tau: f64,
        inclusive: bool,
        lambda: f64,
    },
    /// Context-free gates at these probabilities (fp64, on the model's device): one a gate
    /// output (a head), or one for all.
    Bernoulli(Tensor),
    /// Static head assignment: `[H]` gates, the same for every token.
    Fixed(Tensor),
    /// Static heads ramped (`attention.top_k_ramp`): each head's place in the ranking (`[H]`,
    /// fp64; infinite for a head never full). A forward opens the places below
    /// `ForwardCtx::static_heads`, every full head's without it.
    Ranked(Tensor),
}

/// A layer's gates for one chunk.
pub(super) struct Gate {
    /// Hard gates, 0 or 1.
    pub(crate) hard: Tensor,
    /// The value the forward uses: equal to `hard`, with the straight-through gradient of a
    /// learned router.
    pub(crate) value: Tensor,
    /// A learned router's soft scores and logits.
    pub(crate) scores: Option<Tensor>,
    pub(crate) logits: Option<Tensor>,
}

impl GateSource {
    /// Hard gates and the gate value used in the forward pass, shaped like `like`
    /// (`[B, L, outputs]`), for learned routers with their soft scores: the gates of `layer`
    /// for the chunk of positions `start ..` whose input is `x`.
    pub(super) fn gates(
        &self,
        layer: usize,
        x: &Tensor,
        like: [i64; 3],
        positions: &Tensor,
        ctx: &ForwardCtx,
    ) -> Gate {
        // Routers run in fp32 so thresholding does not depend on the compute dtype.
        let logits = match self {
            GateSource::Learned { router, norm, .. } => {
                Some(router.forward(&upcast(&router_input(norm, x))))
            }
            _ => None,
        };
        let scores = logits.as_ref().map(|r| r.sigmoid());
        let ste = |hard: Tensor| match &scores {
            Some(s) => straight_through(&hard, s),
            None => hard,
        };
        let opts = (Kind::Float, x.device());
        let (hard, value) = match &ctx.gate_override {
            Some(GateOverride::Constant(c)) => {
                let hard = Tensor::full(like, *c, opts);
                (hard.shallow_clone(), ste(hard))
            }
            Some(GateOverride::Positions(open)) => {
                let width = open.size()[1];
                let inside = positions.lt(width).to_kind(Kind::Float);
                let marked = open
                    .to_kind(Kind::Float)
                    .index_select(1, &positions.clamp_max(width - 1));
                // Past the marks (generated tokens): open.
                let row: Tensor = &marked * &inside + inside.neg() + 1.0;
                let hard = row.unsqueeze(-1).expand(like, false).contiguous();
                (hard.shallow_clone(), ste(hard))
            }
            #[cfg(test)]
            Some(GateOverride::Relaxed(layers)) => {
                let (hard, anchor) = &layers[layer];
                let s = scores
                    .as_ref()
                    .expect("relaxed gates need a learned router");
                (hard.shallow_clone(), hard + s - anchor)
            }
            None => match self {
                GateSource::Learned { tau, inclusive, .. } => {
                    let hard = threshold(scores.as_ref().expect("scored"), *tau, *inclusive);
                    (hard.shallow_clone(), ste(hard))
                }
                GateSource::Bernoulli(rates) => {
                    // Drawn on the device from a hash of (seed, layer, row, position, head): the
                    // same gates whatever the chunking, at the cost of a few integer kernels
                    // (one keyed generator per gate on the host cost eight forwards).
                    let u = hash_uniform(layer_seed(ctx, layer), layer, like, positions);
                    let hard = u.lt_tensor(&rates.view([1, 1, -1])).to_kind(Kind::Float);
                    (hard.shallow_clone(), hard)
                }
                GateSource::Fixed(heads) => {
                    let hard = heads.view([1, 1, like[2]]).expand(like, false).contiguous();
                    (hard.shallow_clone(), hard)
                }
                GateSource::Ranked(places) => {
                    let open = match ctx.static_heads {
                        Some(k) => places.lt(k as f64),
                        None => places.isfinite(),
                    };
                    let hard = open
                        .to_kind(Kind::Float)
                        .view([1, 1, like[2]])
                        .expand(like, false)
                        .contiguous();
                    (hard.shallow_clone(), hard)
                }
            },
        };
        Gate {
            hard,
            value,
            scores,
            logits,
        }
    }

    /// A learned router's penalty weight (AHA's L1, L2A's squared penalty) in this forward.
    pub(super) fn lambda(&self, ctx: &ForwardCtx) -> Option<f64> {
        match self {
            GateSource::Learned { lambda, .. } => Some(*lambda * ctx.penalty_scale()),
            _ => None,
        }
    }
}

/// What a learned router reads: `x`, through the router's own norm where it has one.
pub(super) fn router_input(norm: &Option<RmsNorm>, x: &Tensor) -> Tensor {
    match norm {
        Some(n) => n.forward(x),
        None => x.shallow_clone(),
    }
}

/// The hash's salt of (seed, layer): what `hash_uniform` and the kernels' `walk.cuh` add to
/// a draw's mix of row, position and head.
fn salt(seed: u64, layer: usize) -> u64 {
    (seed ^ (seed >> 32) ^ (layer as u64).wrapping_mul(0x9E37_79B9)) & 0xFFFF_FFFF
}

/// Multiplier of the batch row in the hash's mix.
const ROW_MUL: u64 = 0x2545_F491;

/// The seed whose draws for rows `b` are `seed`'s for rows `row0 + b` at `layer`: the hash
/// adds the row times `ROW_MUL` to its salt (all modulo 2^32), so a row offset folds into the
/// salt, and a seed below 2^32 sets the salt it wants (`seed ^ layer's term`). Kernels that
/// hash rows of their own pass take the offset so, unchanged.
pub(crate) fn seed_at_row(seed: u64, layer: usize, row0: i64) -> u64 {
    let shifted = salt(seed, layer).wrapping_add((row0 as u64).wrapping_mul(ROW_MUL)) & 0xFFFF_FFFF;
    shifted ^ ((layer as u64).wrapping_mul(0x9E37_79B9) & 0xFFFF_FFFF)
}

/// The seed a layer's drawn gates hash in this forward: the context's, with its pass's first
/// row folded in (`seed_at_row`), so the pass's row r draws the step's row `gate_row + r`.
pub(crate) fn layer_seed(ctx: &ForwardCtx, layer: usize) -> u64 {
    seed_at_row(ctx.gate_seed, layer, ctx.gate_row)
}

/// A uniform draw in [0, 1) per (batch row, position, head) of a `[B, T, H]` chunk at
/// `positions: [T]` (int64, on the device): an integer hash of (seed, layer, row, position, head) computed on the
/// device, so it does not depend on the device, the chunking, or any generator's state.
pub(crate) fn hash_uniform(seed: u64, layer: usize, shape: [i64; 3], positions: &Tensor) -> Tensor {
    let [b, l, h] = shape;
    let device = positions.device();
    let ar = |n: i64, at: i64| Tensor::arange_start(at, at + n, (Kind::Int64, device));
    let mask = 0xFFFF_FFFFi64;
    let salt = salt(seed, layer) as i64;
    let mut x = ar(b, 0).view([b, 1, 1]) * ROW_MUL as i64
        + positions.view([1, l, 1]) * 0x1B87_3593i64
        + ar(h, 0).view([1, 1, h]) * 0x5BD1_E995i64
        + salt;
    // Products of values below 2^32 with multipliers below 2^31 stay inside int64.
    for mul in [0x7FEB_352Di64, 0x046B_2B8Bi64, 0x2C1B_3C6Di64] {
        x = x.bitwise_and(mask);
        x = x.bitwise_xor_tensor(&x.bitwise_right_shift_tensor_scalar(16)) * mul;
    }
    let x = x.bitwise_and(mask);
    x.bitwise_xor_tensor(&x.bitwise_right_shift_tensor_scalar(15))
        .to_kind(Kind::Double)
        / 4294967296.0
}
