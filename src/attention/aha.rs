//! AHA, All-or-Here attention: per token and per head, the whole prefix or the window over
//! one set of queries, keys and values. A learned router scores each (token, head),
//! `S = sigmoid(X W + b)`, the gate is `S > tau`, and each head's output is
//! `g * Attn_full + (1 - g) * Attn_window` with the straight-through `g`; the loss adds
//! `lambda * mean(S)`. Static top-k heads (`static_heads`) take the same path with a fixed
//! per-head gate. On the kernels each query runs only the path it picked (one routed launch);
//! the router's gradient reads the other path only where it needs it.

use super::cache::Keys;
use super::gates::{hash_uniform, router_input, GateSource};
use super::{
    AttnOutput, Build, Chunk, Exec, ForwardCtx, Regulariser, Route, SelfAttention, KERNEL_FAILED,
};
use crate::config::Method;
use crate::kernels::{Kernels, QueryPath};
use crate::nn::Linear;
use tch::{Kind, Tensor};

/// AHA's layer, or static top-k heads': a gate per (token, head) choosing the whole prefix or
/// the window over the shared q, k, v.
struct PerHead {
    gates: GateSource,
}

/// AHA's router scores each head (`W: d x H`) and starts with every gate open
/// (`attention.router_init_bias`); static heads take the layer's fixed assignment.
pub(super) fn build(b: &Build) -> Box<dyn Route> {
    let gates = match b.a.method {
        Method::StaticHeads => {
            let on: Vec<f32> = b
                .fixed_heads
                .expect("static_heads needs a head assignment")
                .iter()
                .map(|&h| h as u8 as f32)
                .collect();
            GateSource::Fixed(Tensor::from_slice(&on).to_device(b.p.device()))
        }
        _ => b.gates(
            b.m.num_attention_heads as i64,
            Some(b.a.router_init_bias),
            false,
            true,
        ),
    };
    Box::new(PerHead { gates })
}

impl Route for PerHead {
    fn forward(&self, layer: &SelfAttention, c: &Chunk, ctx: &ForwardCtx) -> AttnOutput {
        layer.aha_forward(&self.gates, c, ctx)
    }

    /// Any token may route to the full path, which reads the one shared cache.
    fn kv_cache_bytes(&self, _: &SelfAttention, len: usize, per_position: f64, _: usize) -> f64 {
        len as f64 * per_position
    }
}

/// The routed kernels' per-query paths `[B, H, L]` (uint8) from bool masks: the whole prefix
/// where `full`, else the window where `window`, else nothing.
fn query_paths(full: &Tensor, window: Option<&Tensor>) -> Tensor {
    let paths = full.to_kind(Kind::Uint8) * QueryPath::Full as i64;
    match window {
        Some(w) => paths.maximum(&(w.to_kind(Kind::Uint8) * QueryPath::Window as i64)),
        None => paths,
    }
}

/// Routed kernels' paths for a bool choice `on: [B, H, L]`: the whole prefix where on, the
/// window elsewhere.
pub fn routed_paths(on: &Tensor) -> Tensor {
    query_paths(on, Some(&on.logical_not()))
}

/// `[B, H, L, D]` attention of the queries marked in `full: [B, H, L]` (bool) over their whole
/// prefix, zeros for the others.
pub(super) fn full_rows(
    kern: &Kernels,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    full: &Tensor,
) -> Tensor {
    // No query is on the window: any valid window (1) will do.
    kern.routed_attention(q, k, v, &query_paths(full, None), 1)
        .expect(KERNEL_FAILED)
}

/// Routed attention `[B, H, L, D]`: each query marked in `on: [B, H, L]` (bool) attends its
/// whole prefix, every other query its window, and no query runs the path it did not pick
/// (one list per (b, h) holding both, in one launch). Differentiable in q, k, v.
pub(super) fn routed_attention(
    kern: &Kernels,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    on: &Tensor,
    window: i64,
) -> Tensor {
    kern.routed_attention(q, k, v, &routed_paths(on), window)
        .expect(KERNEL_FAILED)
}

/// Which window-picking queries also need the full path's output (see `per_head`).
enum Values<'a> {
    None,
    All,
    /// Those marked in a `[B, T, H]` mask.
    Some(&'a Tensor),
}

impl SelfAttention {
    /// AHA's layer (and static heads'): gates, the mixed paths, the regulariser and the pairs
    /// the executed paths attend, for the chunk `c`.
    pub(super) fn aha_forward(
        &self,
        gates: &GateSource,
        c: &Chunk,
        ctx: &ForwardCtx,
    ) -> AttnOutput {
        let Chunk {
            x, q, k, v, keys, ..
        } = *c;
        let (b, l, _) = x.size3().expect("attention input is [B, L, hidden]");
        let h = self.proj.n_heads;
        let start = keys.start();
        if let (
            Exec::Kernels(kern, _),
            GateSource::Learned {
                router,
                norm,
                tau,
                inclusive: false,
                lambda,
            },
            None,
        ) = (self.exec(keys), gates, &ctx.gate_override)
        {
            let input = router_input(norm, x);
            return self.per_head_fused(kern, &input, q, k, v, router, *tau, *lambda, start, ctx);
        }
        let g = gates.gates(self.layer, x, [b, l, h], start, ctx);
        let learned = matches!(gates, GateSource::Learned { .. });
        // Sampled straight-through gradient (attention.ste_sample): a random subset
        // of the window-picking pairs computes the full path, and their router
        // gradient is scaled up by 1 / ste_sample; the other window pairs send none.
        let probe = (learned && self.ste_sample < 1.0 && q.requires_grad()).then(|| {
            let u = hash_uniform(ctx.gate_seed, self.layer, [b, l, h], start, x.device());
            u.lt(self.ste_sample).logical_and(&g.hard.le(0.5))
        });
        let values = match (&probe, learned) {
            (Some(p), _) => Values::Some(p),
            (None, true) => Values::All,
            (None, false) => Values::None,
        };
        let value = match &probe {
            Some(p) => {
                let weight =
                    g.hard.gt(0.5).to_kind(Kind::Float) + p.to_kind(Kind::Float) / self.ste_sample;
                &g.hard + weight * (&g.value - &g.hard)
            }
            None => g.value.shallow_clone(),
        };
        let y = self.per_head(q, k, v, &g.hard, &value, keys, values);
        AttnOutput {
            y: self.proj.out(&y, self.kernels),
            pairs: routed_pairs(&g.hard, self.window, start),
            reg: gates.lambda().map(|lambda| {
                Regulariser::Term(g.scores.as_ref().expect("scored").mean(Kind::Float) * lambda)
            }),
            gates: Some(g.hard),
            scores: g.scores,
        }
    }

    /// AHA's per-(token, head) mix `g * full + (1 - g) * local`, `[B, H, T, D]`, for hard
    /// choices `on` and gate values `g` (`[B, T, H]`; `g` equals `on` in value and carries the
    /// straight-through gradient). `values` says which queries that picked the window also need
    /// the full path's output for the router's gradient `dy . (full - local)`.
    ///
    /// With kernels and the chunk's own keys it is computed as `chosen + (g - on) * sg(full -
    /// local)`: `chosen` is one routed launch (each query runs only the path it picked, with
    /// gradient; the path it did not pick reaches the loss multiplied by a hard 0, so its
    /// gradient is exactly zero), and `full - local` needs the other path only where the
    /// router's gradient reads it, from a second routed launch without gradient: the window
    /// for queries on the full path, the full prefix for the window queries `values` marks,
    /// nothing for the rest.
    /// Without gradient this is `chosen` alone, exact for gates that are 0 or 1
    /// (`GateOverride::Relaxed` gates are not, and are meant for gradients).
    #[allow(clippy::too_many_arguments)]
    fn per_head(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        on: &Tensor,
        g: &Tensor,
        keys: &Keys,
        values: Values,
    ) -> Tensor {
        let w = self.window as i64;
        let gv = |t: &Tensor| t.to_kind(q.kind()).transpose(1, 2).unsqueeze(-1);
        match self.exec(keys) {
            Exec::Kernels(kern, _) => {
                let full = on.transpose(1, 2).gt(0.5);
                let chosen = routed_attention(kern, q, k, v, &full, w);
                if !q.requires_grad() {
                    return chosen;
                }
                let flip = match values {
                    Values::None => return chosen,
                    Values::All => full.logical_not(),
                    Values::Some(rows) => rows
                        .transpose(1, 2)
                        .gt(0.5)
                        .logical_and(&full.logical_not()),
                };
                let paths = query_paths(&flip, Some(&full));
                let other = tch::no_grad(|| kern.routed_attention(q, k, v, &paths, w))
                    .expect(KERNEL_FAILED);
                // full - local is chosen minus the other path on the full path's rows and the
                // other way round on the window's: the sign goes on the per-row weight (rows
                // where neither is needed get a finite value that a zero gradient weight
                // multiplies). One fused kernel each way (`Kernels::st_mix`).
                let weight = ((g - on) * (on * 2.0 - 1.0)).transpose(1, 2);
                kern.st_mix(&chosen, &other, &weight).expect(KERNEL_FAILED)
            }
            _ => {
                let (full, local) = self.branches(q, k, v, on, keys, false);
                let g = gv(g);
                &g * full + (1.0 - &g) * local
            }
        }
    }

    /// AHA's layer with a learned router on the kernels, over the chunk's own keys: what the
    /// general branch of `aha_forward` and `per_head` compute, with the gates, probes, paths and
    /// pairs in one kernel (`Kernels::aha_gates`) and the router's scores in one
    /// (`Kernels::router`), where ATen took some fifty launches a layer,
    /// whose host cost bounded the training step's forward at L 8192 (PERFORMANCE.md).
    #[allow(clippy::too_many_arguments)]
    fn per_head_fused(
        &self,
        kern: &Kernels,
        x: &Tensor,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        router: &Linear,
        tau: f64,
        lambda: f64,
        start: i64,
        ctx: &ForwardCtx,
    ) -> AttnOutput {
        // In fp32, as `gates` computes them (`Kernels::router` reads x in its own dtype).
        let scores = kern
            .router(x, &router.weight, router.bias.as_ref())
            .expect(KERNEL_FAILED);
        let grad = q.requires_grad();
        // Without gradient no query is probed; with it, `ste_sample` 1 probes every window
        // query (the exact straight-through gradient).
        let sample = if grad { self.ste_sample } else { 1.0 };
        let w = self.window as i64;
        let g = kern
            .aha_gates(&scores, tau, sample, ctx.gate_seed, self.layer, start, w)
            .expect(KERNEL_FAILED);
        let chosen = kern
            .routed_attention(q, k, v, &g.chosen, w)
            .expect(KERNEL_FAILED);
        let y = if grad {
            let other =
                tch::no_grad(|| kern.routed_attention(q, k, v, &g.other, w)).expect(KERNEL_FAILED);
            kern.st_mix(&chosen, &other, &g.weight)
                .expect(KERNEL_FAILED)
        } else {
            chosen
        };
        AttnOutput {
            y: self.proj.out(&y, Some(kern)),
            pairs: g.pairs,
            reg: Some(Regulariser::Term(scores.mean(Kind::Float) * lambda)),
            gates: Some(g.hard),
            scores: Some(scores),
        }
    }
}

/// Pairs attended when gate `[B, L, H]` for the positions from `start` on picks, per (token,
/// head), the whole prefix (i + 1 keys) or the window (min(w, i + 1) keys).
pub fn routed_pairs(hard: &Tensor, window: usize, start: i64) -> Tensor {
    let l = hard.size()[1];
    let full = Tensor::arange_start(start + 1, start + l + 1, (Kind::Float, hard.device()));
    let win = full.clamp_max(window as f64);
    let n = (hard.size()[0] * hard.size()[2]) as f64;
    (hard.to_kind(Kind::Float) * (&full - &win).view([1, l, 1])).sum(Kind::Float)
        + win.sum(Kind::Float) * n
}
