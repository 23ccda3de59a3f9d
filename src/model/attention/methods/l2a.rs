//! L2A, Learning to Attend: every layer first attends its window, `s_t = LocalAttn(x_t)`,
//! which the block adds to its stream `h_t`. On that post-window stream, normalised by the
//! layer's own RMSNorm (`u_t = RMSNorm_g(h_t + s_t)`, its gain copied from the block's input
//! norm), a router `d_hat_t = sigmoid(W u_t)` (W zero at the start, so every token is global)
//! decides per token whether a second, global attention module (its own Q, K, V, O, starting
//! as copies of the base attention) attends the `u` of every earlier token: the layer adds
//! `s_t + d_t * a_t` to the stream, with the straight-through `d`. This is the authors' code
//! (`h + s` is the paper's `s_t`, the stream after the window): a pretrained layer's
//! projections read normalised hidden states, not a bare attention output. The loss adds
//! `lambda * mean(d_hat^2)`. With probability `p_force` a training step runs the global module
//! for every token, so the router gets a gradient on tokens it masked. Pruned layers keep only
//! the window (`attention.pruned_layers`, `attnsweep prune`).

use crate::config::{AttentionConfig, L2aStart, Method, NormPlacement, Router};
use crate::model::attention::base::{
    projection_params, AttnOutput, Base, Build, Chunk, Exec, Projections, Regulariser, Route,
};
use crate::model::attention::ctx::ForwardCtx;
use crate::model::attention::gates::GateSource;
use crate::model::attention::patterns::Keep;
use crate::model::attention::patterns::KeyPattern;
use crate::model::attention::shared::{full_rows, Static};
use crate::model::attention::spec::{
    no_fixed_heads, no_head_budget, no_variant, BenchKnobs, BenchVariant, CellKind, Example, Gates,
    MethodSpec, PaperTable, Report,
};
use crate::model::nn::RmsNorm;
use tch::Kind;

/// L2A's layer: the window, and the global module for routed tokens.
struct Global {
    gates: GateSource,
    /// `RMSNorm_g`: what the router and the global module read is the stream after the window.
    norm: RmsNorm,
    global: Projections,
    /// A pre-norm block's input norm exists to copy the gain from.
    pre_norm: bool,
    /// The global module's output projection starts at zero (`L2aStart::Inert`), not as a
    /// copy of the base's.
    inert: bool,
}

/// The router is `W u` with no bias, zero at the start (d_hat = 0.5: every token global); a
/// pruned layer keeps only its window.
fn build(b: &Build) -> Box<dyn Route> {
    if b.a.pruned_layers.contains(&b.layer) {
        return Box::new(Static(KeyPattern::Window(b.a.window)));
    }
    let p = b.p / "global_attn";
    let global = Projections::new(&p, b.m, b.kernels);
    let inert = b.a.l2a_start == L2aStart::Inert;
    if inert {
        global.zero_output();
    }
    Box::new(Global {
        gates: b.gates(1, None, true, false),
        norm: RmsNorm::new(&p / "norm", b.m.hidden_size as i64, b.m.rms_norm_eps)
            .with_kernels(b.kernels),
        global,
        pre_norm: b.m.norm_placement == NormPlacement::Pre,
        inert,
    })
}

impl Route for Global {
    fn forward(&self, layer: &Base, c: &Chunk, ctx: &ForwardCtx) -> AttnOutput {
        self.forward_chunk(layer, c, ctx)
    }

    /// The local module's window, and the global module's own keys (slot 1), all of them.
    fn keeps(&self, layer: &Base) -> Vec<Keep> {
        vec![KeyPattern::Window(layer.window).keeps(), Keep::All]
    }

    /// The global module starts as a copy of the base attention, its norm as a copy of the
    /// block's input norm (a post-norm block has none: the norm starts at gain 1).
    fn derived_params(&self) -> Vec<(String, String)> {
        let mut names: Vec<&str> = vec!["q_proj.weight", "k_proj.weight", "v_proj.weight"];
        if !self.inert {
            names.push("o_proj.weight");
        }
        if self.global.q_norm.is_some() {
            names.extend(["q_norm.weight", "k_norm.weight"]);
        }
        if self.global.q_proj.bias.is_some() {
            names.extend(["q_proj.bias", "k_proj.bias", "v_proj.bias"]);
        }
        let mut derived: Vec<(String, String)> = names
            .into_iter()
            .map(|n| {
                (
                    format!("self_attn.global_attn.{n}"),
                    format!("self_attn.{n}"),
                )
            })
            .collect();
        if self.pre_norm {
            derived.push((
                "self_attn.global_attn.norm.weight".into(),
                "input_layernorm.weight".into(),
            ));
        }
        derived
    }
}

impl Global {
    /// L2A's layer over the chunk `c`.
    fn forward_chunk(&self, layer: &Base, c: &Chunk, ctx: &ForwardCtx) -> AttnOutput {
        let (gates, global) = (&self.gates, &self.global);
        let Chunk {
            x,
            residual,
            q,
            k,
            v,
            rope,
            keys,
        } = *c;
        let (b, l, _) = x.size3().expect("attention input is [B, L, hidden]");
        let h = layer.proj.n_heads;
        let positions = keys.positions(l, x.device());
        let window = KeyPattern::Window(layer.window);
        let s = layer
            .proj
            .out(&layer.attend_all(q, k, v, window, keys, 0), layer.kernels);
        let u = self.norm.forward(&(residual + &s));
        let g = gates.gates(layer.layer, &u, [b, l, 1], &positions, ctx);
        let (qg, kg, vg) = global.qkv(&u, rope, layer.kernels);
        // Every token's u is a key of the global module, routed or not.
        let (kg, vg) = keys.extend(1, kg, vg);
        // Global attention runs only for routed tokens (all of them when forced), so an
        // unrouted token's a_t is zero and sends the router no language-model gradient.
        let executed = if ctx.force_global {
            g.hard.ones_like()
        } else {
            g.hard.shallow_clone()
        };
        // The routed rows alone, on the kernels.
        let routed_rows = |kern| {
            let active = executed.transpose(1, 2).gt(0.5).expand([b, h, l], false);
            global.out(&full_rows(kern, &qg, &kg, &vg, &active), layer.kernels)
        };
        let a = match (layer.exec(keys), layer.kernels) {
            (Exec::Kernels(kern, _), _) => routed_rows(kern),
            // A prefill into an empty cache: its keys are the chunk's own, as in a forward, so
            // only the routed queries attend (the cached path had attended every query).
            (Exec::Decode, Some(kern)) if keys.prefill_only() => routed_rows(kern),
            // Decoding attends for every token and keeps the routed ones' (skipping a step
            // without a routed token would read the gates back on the host).
            _ => {
                global.out(
                    &keys.attend(1, &qg, &kg, &vg, KeyPattern::Full),
                    layer.kernels,
                ) * executed.to_kind(x.kind())
            }
        };
        let y = &s + g.value.to_kind(x.kind()) * a;
        let local_pairs = keys.pattern_pairs(window, l, b * h);
        let keys_seen = positions.to_kind(Kind::Float) + 1.0;
        let global_pairs = (executed.squeeze_dim(-1) * keys_seen).sum(Kind::Float) * h as f64;
        AttnOutput {
            y,
            pairs: global_pairs + local_pairs,
            reg: gates.lambda(ctx).map(|lambda| {
                Regulariser::Term(
                    g.scores
                        .as_ref()
                        .expect("scored")
                        .square()
                        .mean(Kind::Float)
                        * lambda,
                )
            }),
            gates: Some(g.hard.expand([b, l, h], false)),
            scores: g.scores,
        }
    }
}

pub(super) const L2A: MethodSpec = MethodSpec {
    method: Method::L2a,
    label: "L2A",
    gates: Gates::PerToken,
    windowed: true,
    dense_mask: true,
    build,
    // The global module: a second set of the base projections, and its input norm.
    extra_params: |m, _| projection_params(m) + m.hidden_size as f64,
    fixed_heads: no_fixed_heads,
    // The anti-collapse draw: a learned router's training step runs the global module for
    // every token with probability p_force.
    force_global: |a| match a.router {
        Router::Learned => a.p_force,
        Router::Bernoulli => 0.0,
    },
    describe: |a, _, _| vec![format!("τ {}", a.tau)],
    variant: no_variant,
    reference: false,
    zero_shot: false,
    // A layer whose measured sparsity reaches a threshold drops its global module (Sec. 3.4).
    prunable: true,
    columns: &[],
    baseline: None,
    head_budget: no_head_budget,
    reports: &[
        // Sec. 4: the routers keep about 20 % of the tokens global (~80 % local).
        Report::PaperUsage {
            mu_f: 0.20,
            source: "L2A paper: ~20 % of tokens global",
        },
        // Fig. 13: the cells evaluated again at other thresholds.
        Report::Table(PaperTable {
            file: "l2a_threshold.csv",
            holds: |c| c.method == Method::L2a && c.kind != CellKind::Pruned,
            subject: |c| c.kind == CellKind::Evaluated,
            columns: &[
                "tau",
                "window",
                "kind",
                "loss",
                "perplexity",
                "mu_f",
                "pairs_vs_full",
                "attention_flops",
                "cell",
            ],
            sort: &["window", "tau"],
        }),
        // Fig. 9: the pruned cells.
        Report::Table(PaperTable {
            file: "l2a_pruning.csv",
            holds: |c| c.method == Method::L2a && c.kind == CellKind::Pruned,
            subject: |c| c.kind == CellKind::Pruned,
            columns: &[
                "threshold",
                "pruned_layers",
                "kv_cache_bytes_before",
                "kv_cache_bytes",
                "loss_before",
                "loss",
                "label",
                "cell",
            ],
            sort: &["label", "threshold"],
        }),
        Report::ThresholdSweep,
    ],
    hf: include_str!("l2a.py"),
    examples: &[
        Example {
            name: "l2a",
            set: |a| {
                a.method = Method::L2a;
                a.tau = 0.5;
            },
        },
        Example {
            name: "l2a_pruned",
            set: |a| {
                a.method = Method::L2a;
                a.pruned_layers = vec![1];
            },
        },
    ],
    // What costs is how many tokens take the global module, not how the router picks them:
    // context-free gates open for `--full-usage` of the tokens.
    bench: &[BenchVariant {
        name: "l2a",
        setup: |a: &mut AttentionConfig, k: &BenchKnobs| {
            a.router = Router::Bernoulli;
            a.bernoulli_p = k.full_usage;
        },
        calibrate_router: false,
        peer: Some("l2a"),
        reads_window: true,
        reads_usage: true,
        reads_power: false,
    }],
};
