//! SwiAttn, Switch attention: per token, a full-attention branch or a window branch over one
//! set of queries, keys and values. A router reads the normalised hidden state,
//! `r_t = R(RMSNorm(h_t))`, `s_t = sigmoid(r_t)`, and the gate is `1(s_t > tau) + s_t -
//! sg(s_t)`; `O = o * O_full + (1 - o) * O_window`, each branch with its own output projection
//! unless `swiattn_shared_o_proj`. Its adaptive regulariser is
//! `gamma * softplus(r_t)` with `gamma = gamma_base / (eps + NLL_t + alpha * D_t)`, `D_t` the
//! branches' disagreement.

use super::aha::{full_rows, routed_attention, routed_pairs};
use super::cache::Keys;
use super::gates::GateSource;
use super::patterns::KeyPattern;
use super::{AttnOutput, Build, Chunk, Exec, ForwardCtx, Regulariser, Route, SelfAttention};
use crate::config::Reduction;
use crate::nn::Linear;
use tch::{Kind, Tensor};

/// SwiAttn's layer: a gate per token choosing the full or the window branch.
struct Switch {
    gates: GateSource,
    /// The window branch's own output projection (None: it shares `o_proj`).
    swa_o_proj: Option<Linear>,
    reg: SwiAttnReg,
}

/// The router reads the normalised hidden state and starts with every gate open
/// (`attention.router_init_bias`).
pub(super) fn build(b: &Build) -> Box<dyn Route> {
    let (m, a) = (b.m, b.a);
    Box::new(Switch {
        gates: b.gates(1, Some(a.router_init_bias), false, true),
        swa_o_proj: (!a.swiattn_shared_o_proj).then(|| {
            Linear::new(
                b.p / "swa_o_proj",
                (m.num_attention_heads * m.head_dim()) as i64,
                m.hidden_size as i64,
                false,
                m.initializer_range,
            )
        }),
        reg: SwiAttnReg {
            gamma_base: a.swiattn_gamma_base,
            eps: a.swiattn_eps,
            alpha: a.swiattn_alpha,
            adaptive: a.swiattn_adaptive,
            nll: a.swiattn_nll,
            disagreement: a.swiattn_disagreement,
        },
    })
}

impl Route for Switch {
    fn forward(&self, layer: &SelfAttention, c: &Chunk, ctx: &ForwardCtx) -> AttnOutput {
        layer.swiattn_forward(&self.gates, &self.swa_o_proj, &self.reg, c, ctx)
    }

    /// Both branches read the one shared cache; the full branch, all of it.
    fn kv_cache_bytes(&self, _: &SelfAttention, len: usize, per_position: f64, _: usize) -> f64 {
        len as f64 * per_position
    }

    /// The window branch's own output projection starts as a copy of the base one.
    fn derived_params(&self) -> Vec<(String, String)> {
        match self.swa_o_proj {
            Some(_) => vec![("swa_o_proj.weight".into(), "o_proj.weight".into())],
            None => Vec::new(),
        }
    }
}

/// SwiAttn's regulariser settings (`attention.swiattn_*`).
#[derive(Clone, Copy, Debug)]
pub struct SwiAttnReg {
    pub gamma_base: f64,
    pub eps: f64,
    pub alpha: f64,
    pub adaptive: bool,
    pub nll: bool,
    /// How `||O_full - O_swa||^2` is reduced over the hidden dimension.
    pub disagreement: Reduction,
}

impl SwiAttnReg {
    /// The branches' disagreement per token, `[B, T]` in fp32: the mean (the paper's MSE) or
    /// the sum (the squared norm) over the hidden dimension of `(full - local)^2`.
    pub(super) fn disagreement(&self, full: &Tensor, local: &Tensor) -> Tensor {
        let sq = (full - local).to_kind(Kind::Float).square();
        match self.disagreement {
            Reduction::Mean => sq.mean_dim(-1, false, Kind::Float),
            Reduction::Sum => sq.sum_dim_intlist(-1, false, Kind::Float),
        }
    }

    /// The layer's term `mean(gamma * softplus(r))` for router logits `r` and the branches'
    /// disagreement, `[B, T]` both, and the per-token language-model loss `nll: [B, T]`;
    /// gamma is a weight, not a path for gradients.
    pub(super) fn term(&self, logits: &Tensor, disagreement: &Tensor, nll: &Tensor) -> Tensor {
        let gamma = if self.adaptive {
            let nll = if self.nll {
                nll.detach().to_kind(Kind::Float)
            } else {
                nll.zeros_like().to_kind(Kind::Float)
            };
            (nll + disagreement.detach() * self.alpha + self.eps).reciprocal() * self.gamma_base
        } else {
            disagreement.full_like(self.gamma_base)
        };
        (gamma * logits.softplus()).mean(Kind::Float)
    }
}

impl SelfAttention {
    /// SwiAttn's layer over the chunk `c`.
    pub(super) fn swiattn_forward(
        &self,
        gates: &GateSource,
        swa_o_proj: &Option<Linear>,
        reg: &SwiAttnReg,
        c: &Chunk,
        ctx: &ForwardCtx,
    ) -> AttnOutput {
        let Chunk {
            x, q, k, v, keys, ..
        } = *c;
        let (b, l, _) = x.size3().expect("attention input is [B, L, hidden]");
        let h = self.proj.n_heads;
        let start = keys.start();
        let g = gates.gates(self.layer, x, [b, l, 1], start, ctx);
        // The router's gradient and the regulariser's disagreement read both paths.
        let learned = matches!(gates, GateSource::Learned { .. });
        let (full, local) = self.branches(q, k, v, &g.hard.expand([b, l, h], false), keys, learned);
        let full = self.proj.out(&full, self.kernels);
        let local = match swa_o_proj {
            Some(o) => o.forward(&self.proj.merge(&local, self.kernels)),
            None => self.proj.out(&local, self.kernels),
        };
        let gv = g.value.to_kind(x.kind());
        let reg = match gates {
            GateSource::Learned { .. } => {
                let logits = g.logits.as_ref().expect("learned").squeeze_dim(-1);
                Some(Regulariser::Adaptive {
                    logits,
                    disagreement: reg.disagreement(&full, &local),
                    params: *reg,
                })
            }
            _ => None,
        };
        let hard = g.hard.expand([b, l, h], false);
        AttnOutput {
            y: &gv * full + (1.0 - &gv) * local,
            pairs: routed_pairs(&hard, self.window, start),
            reg,
            gates: Some(hard),
            scores: g.scores,
        }
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
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        on: &Tensor,
        keys: &Keys,
        all_values: bool,
    ) -> (Tensor, Tensor) {
        let window = KeyPattern::Window(self.window);
        match self.exec(keys) {
            Exec::Kernels(kern, _) => {
                let on = on.transpose(1, 2).gt(0.5);
                if !q.requires_grad() {
                    // Each query's row holds the output of the path it picked; the gates are
                    // hard here, so the caller's mix of the two returns it.
                    let y = routed_attention(kern, q, k, v, &on, self.window as i64);
                    return (y.shallow_clone(), y);
                }
                let full = full_rows(kern, q, k, v, &on);
                let full = if all_values {
                    let rest = tch::no_grad(|| keys.attend(0, q, k, v, KeyPattern::Full));
                    full + rest * on.logical_not().unsqueeze(-1).to_kind(q.kind())
                } else {
                    full
                };
                (full, self.attend_all(q, k, v, window, keys, 0))
            }
            // Decoding: a path that no query of the chunk picked is not run.
            Exec::Decode if !q.requires_grad() => {
                let picked = |t: Tensor| t.any().int64_value(&[]) != 0;
                let full = match picked(on.gt(0.5)) {
                    true => keys.attend(0, q, k, v, KeyPattern::Full),
                    false => q.zeros_like(),
                };
                let local = match picked(on.le(0.5)) {
                    true => self.attend_all(q, k, v, window, keys, 0),
                    false => q.zeros_like(),
                };
                (full, local)
            }
            _ => (
                keys.attend(0, q, k, v, KeyPattern::Full),
                self.attend_all(q, k, v, window, keys, 0),
            ),
        }
    }
}
