//! What several methods share, so that no method file reads another: a layer of one fixed
//! pattern (the fixed methods, a pruned L2A layer), the routed kernels' per-query paths (each
//! query runs the whole prefix or its window, in one launch), the pairs such a choice attends,
//! and the full and window outputs of a per-token choice on every execution path.

use super::base::{AttnOutput, Base, Chunk, Exec, Route};
use super::cache::Keys;
use super::ctx::ForwardCtx;
use super::patterns::Keep;
use super::patterns::{KeyPattern, KERNEL_FAILED};
use crate::model::kernels::{Kernels, QueryPath};
use tch::{Kind, Tensor};

/// A layer of one fixed pattern for every token and head: full, window, PPA, or the layer's
/// pattern under static_hybrid.
pub(super) struct Static(pub(super) KeyPattern);

impl Route for Static {
    fn forward(&self, layer: &Base, c: &Chunk, _ctx: &ForwardCtx) -> AttnOutput {
        let Chunk {
            x, q, k, v, keys, ..
        } = *c;
        let (b, l, _) = x.size3().expect("attention input is [B, L, hidden]");
        let pairs = keys.pattern_pairs(self.0, l, b * layer.proj.n_heads);
        AttnOutput {
            y: layer
                .proj
                .out(&layer.attend_all(q, k, v, self.0, keys, 0), layer.kernels),
            gates: None,
            scores: None,
            reg: None,
            pairs,
        }
    }

    fn keeps(&self, _: &Base) -> Vec<Keep> {
        vec![self.0.keeps()]
    }
}

/// The routed kernels' per-query paths `[B, H, L]` (uint8) from bool masks: the whole prefix
/// where `full`, else the window where `window`, else nothing.
pub(super) fn query_paths(full: &Tensor, window: Option<&Tensor>) -> Tensor {
    let paths = full.to_kind(Kind::Uint8) * QueryPath::Full as i64;
    match window {
        Some(w) => paths.maximum(&(w.to_kind(Kind::Uint8) * QueryPath::Window as i64)),
        None => paths,
    }
}

/// Routed kernels' paths for a bool choice `on: [B, H, L]`: the whole prefix where on, the
/// window elsewhere.
pub(crate) fn routed_paths(on: &Tensor) -> Tensor {
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

/// Full-prefix and window outputs `[B, H, T, D]` for a per-token choice `on: [B, T, H]`,
/// combined by the caller as `g * full + (1 - g) * local` with `g` numerically equal to
/// `on`. `all_values`: the queries that picked the window also need the full path's output
/// (for a router's gradient).
///
/// SwiAttn's branches, and AHA's without kernels (`per_head` handles AHA's kernel path).
/// With kernels and the chunk's own keys, the full path runs with gradient only for the
/// queries that picked it (one routed list): the other rows of `full` reach the loss
/// multiplied by a hard 0, so their gradient is exactly zero and skipping it changes
/// nothing; `all_values` fills them by a dense forward without gradient.
/// Without gradient, each query runs only its own path, and both outputs are that one
/// routed output: the caller's mix then returns it for gates that are exactly 0 or 1.
pub(super) fn branches(
    layer: &Base,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    on: &Tensor,
    keys: &Keys,
    all_values: bool,
) -> (Tensor, Tensor) {
    let window = KeyPattern::Window(layer.window);
    match layer.exec(keys) {
        Exec::Kernels(kern, _) => {
            let on = on.transpose(1, 2).gt(0.5);
            if !q.requires_grad() {
                // Each query's row holds the output of the path it picked; the gates are
                // hard here, so the caller's mix of the two returns it.
                let y = routed_attention(kern, q, k, v, &on, layer.window as i64);
                return (y.shallow_clone(), y);
            }
            let full = full_rows(kern, q, k, v, &on);
            let full = if all_values {
                let rest = tch::no_grad(|| keys.attend(0, q, k, v, KeyPattern::Full));
                full + rest * on.logical_not().unsqueeze(-1).to_kind(q.kind())
            } else {
                full
            };
            (full, layer.attend_all(q, k, v, window, keys, 0))
        }
        // Decoding runs both paths: skipping the one no query picked would read the gates
        // back on the host, a wait at every step that a captured step cannot make.
        _ => (
            keys.attend(0, q, k, v, KeyPattern::Full),
            layer.attend_all(q, k, v, window, keys, 0),
        ),
    }
}

/// Pairs attended when gate `[B, L, H]` for the positions `positions: [L]` (int64) picks, per
/// (token, head), the whole prefix (i + 1 keys) or the window (min(w, i + 1) keys).
pub(crate) fn routed_pairs(hard: &Tensor, window: usize, positions: &Tensor) -> Tensor {
    let l = hard.size()[1];
    let full = positions.to_kind(Kind::Float) + 1.0;
    let win = full.clamp_max(window as f64);
    let n = (hard.size()[0] * hard.size()[2]) as f64;
    (hard.to_kind(Kind::Float) * (&full - &win).view([1, l, 1])).sum(Kind::Float)
        + win.sum(Kind::Float) * n
}
