//! SwiAttn, Switch attention: per token, a full-attention branch or a window branch over one
//! set of queries, keys and values. A router reads the normalised hidden state,
//! `r_t = R(RMSNorm(h_t))`, `s_t = sigmoid(r_t)`, and the gate is `1(s_t > tau) + s_t -
//! sg(s_t)`; `O = o * O_full + (1 - o) * O_window`, each branch with its own output projection
//! unless `swiattn_shared_o_proj`. Its adaptive regulariser is
//! `gamma * softplus(r_t)` with `gamma = gamma_base / (eps + NLL_t + alpha * D_t)`, `D_t` the
//! branches' disagreement.

use crate::config::{AttentionConfig, Method, ModelConfig, Reduction};
use crate::model::attention::base::{AttnOutput, Base, Build, Chunk, Regulariser, Route};
use crate::model::attention::ctx::ForwardCtx;
use crate::model::attention::gates::GateSource;
use crate::model::attention::patterns::Keep;
use crate::model::attention::shared::{branches, routed_pairs};
use crate::model::attention::spec::{
    never_forced, no_fixed_heads, no_head_budget, BenchVariant, CellKind, Example, Gates,
    MethodSpec, PaperTable, Report, SettingColumn, SettingCurve, Value,
};
use crate::model::nn::Linear;
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
fn build(b: &Build) -> Box<dyn Route> {
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
    fn forward(&self, layer: &Base, c: &Chunk, ctx: &ForwardCtx) -> AttnOutput {
        self.forward_chunk(layer, c, ctx)
    }

    /// Both branches read the one shared cache; the full branch, all of it.
    fn keeps(&self, _: &Base) -> Vec<Keep> {
        vec![Keep::All]
    }

    /// The window branch's own output projection starts as a copy of the base one.
    fn derived_params(&self) -> Vec<(String, String)> {
        match self.swa_o_proj {
            Some(_) => vec![(
                "self_attn.swa_o_proj.weight".into(),
                "self_attn.o_proj.weight".into(),
            )],
            None => Vec::new(),
        }
    }
}

/// SwiAttn's regulariser settings (`attention.swiattn_*`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct SwiAttnReg {
    pub(crate) gamma_base: f64,
    pub(crate) eps: f64,
    pub(crate) alpha: f64,
    pub(crate) adaptive: bool,
    pub(crate) nll: bool,
    /// How `||O_full - O_swa||^2` is reduced over the hidden dimension.
    pub(crate) disagreement: Reduction,
}

impl SwiAttnReg {
    /// The branches' disagreement per token, `[B, T]` in fp32: the mean (the paper's MSE) or
    /// the sum (the squared norm) over the hidden dimension of `(full - local)^2`.
    fn disagreement(&self, full: &Tensor, local: &Tensor) -> Tensor {
        let sq = (full - local).to_kind(Kind::Float).square();
        match self.disagreement {
            Reduction::Mean => sq.mean_dim(-1, false, Kind::Float),
            Reduction::Sum => sq.sum_dim_intlist(-1, false, Kind::Float),
        }
    }

    /// The layer's term `mean(gamma * softplus(r))` for router logits `r` and the branches'
    /// disagreement, `[B, T]` both, and the per-token language-model loss `nll: [B, T]`;
    /// gamma is a weight, not a path for gradients.
    pub(in crate::model::attention) fn term(
        &self,
        logits: &Tensor,
        disagreement: &Tensor,
        nll: &Tensor,
    ) -> Tensor {
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

impl Switch {
    /// SwiAttn's layer over the chunk `c`.
    fn forward_chunk(&self, layer: &Base, c: &Chunk, ctx: &ForwardCtx) -> AttnOutput {
        let (gates, swa_o_proj, reg) = (&self.gates, &self.swa_o_proj, &self.reg);
        let Chunk {
            x, q, k, v, keys, ..
        } = *c;
        let (b, l, _) = x.size3().expect("attention input is [B, L, hidden]");
        let h = layer.proj.n_heads;
        let positions = keys.positions(l, x.device());
        let g = gates.gates(layer.layer, x, [b, l, 1], &positions, ctx);
        // The router's gradient and the regulariser's disagreement read both paths.
        let learned = matches!(gates, GateSource::Learned { .. });
        let (full, local) = branches(
            layer,
            q,
            k,
            v,
            &g.hard.expand([b, l, h], false),
            keys,
            learned,
        );
        let full = layer.proj.out(&full, layer.kernels);
        let local = match swa_o_proj {
            Some(o) => o.forward(&layer.proj.merge(&local, layer.kernels)),
            None => layer.proj.out(&local, layer.kernels),
        };
        let gv = g.value.to_kind(x.kind());
        let reg = match gates {
            GateSource::Learned { .. } => {
                let logits = g.logits.as_ref().expect("learned").squeeze_dim(-1);
                let disagreement = reg.disagreement(&full, &local);
                let reg = *reg;
                Some(Regulariser::PerToken(Box::new(move |nll: &Tensor| {
                    reg.term(&logits, &disagreement, nll)
                })))
            }
            _ => None,
        };
        let hard = g.hard.expand([b, l, h], false);
        AttnOutput {
            y: &gv * full + (1.0 - &gv) * local,
            pairs: routed_pairs(&hard, layer.window, &positions),
            reg,
            gates: Some(hard),
            scores: g.scores,
        }
    }
}

/// SwiAttn's regulariser variant by its Table 4 name.
pub(crate) fn variant(a: &AttentionConfig) -> String {
    if !a.swiattn_adaptive {
        return "V1 (no adaptive weight)".into();
    }
    if !a.swiattn_nll {
        return "V2 (no NLL term)".into();
    }
    match (a.swiattn_alpha, a.swiattn_eps) {
        (x, e) if x == 100.0 && e == 0.1 => "SwiAttn".into(),
        (x, e) if e == 0.1 => format!(
            "alpha={x}{}",
            match x as i64 {
                10 => " (V3)",
                1 => " (V4)",
                0 => " (V5)",
                _ => "",
            }
        ),
        (x, e) if x == 100.0 => format!(
            "eps={e}{}",
            if e == 0.2 {
                " (V6)"
            } else if e == 0.01 {
                " (V7)"
            } else {
                ""
            }
        ),
        (x, e) => format!("alpha={x} eps={e}"),
    }
}

pub(super) const SWIATTN: MethodSpec = MethodSpec {
    method: Method::Swiattn,
    label: "SwiAttn",
    gates: Gates::PerToken,
    windowed: true,
    dense_mask: true,
    build,
    // The window branch's own output projection, unless it shares o_proj.
    extra_params: |m: &ModelConfig, a: &AttentionConfig| match a.swiattn_shared_o_proj {
        true => 0.0,
        false => (m.num_attention_heads * m.head_dim() * m.hidden_size) as f64,
    },
    fixed_heads: no_fixed_heads,
    force_global: never_forced,
    // Alpha, the regulariser's weight where it is not the paper's, and the other regulariser
    // variants by their Table 4 names.
    describe: |a, _, _| {
        let name = variant(a);
        let mut parts = vec![format!("α {}", a.swiattn_alpha)];
        if a.swiattn_gamma_base != AttentionConfig::default().swiattn_gamma_base {
            parts.push(format!("γ {}", a.swiattn_gamma_base));
        }
        if name != "SwiAttn" && !name.starts_with("alpha=") {
            parts.push(name);
        }
        parts
    },
    variant,
    reference: false,
    zero_shot: false,
    prunable: false,
    columns: &[
        // Alpha, and how the disagreement it weighs is reduced (the paper's MSE, or the
        // squared norm, which alpha weighs hidden_size times more), beside each other.
        SettingColumn {
            name: "swiattn_alpha",
            value: |a| Value::Number(a.swiattn_alpha),
            every_cell: false,
            in_every_summary: true,
            timed: false,
        },
        SettingColumn {
            name: "swiattn_disagreement",
            value: |a| Value::Text(crate::config::name_of(a.swiattn_disagreement)),
            every_cell: false,
            in_every_summary: true,
            timed: false,
        },
    ],
    baseline: Some(|_| "SwiAttn"),
    head_budget: no_head_budget,
    reports: &[
        // Fig. 5 / Sec. 4.4: "the averaged full attention ratio of all layers ... is around
        // 0.13".
        Report::PaperUsage {
            mu_f: 0.13,
            source: "SwiAttn paper, Fig. 5: full ratio ~0.13",
        },
        // The regulariser's weight that brings the full ratio to the paper's: quality and the
        // ratio against gamma_base.
        Report::Curve(SettingCurve {
            key: "attention.swiattn_gamma_base",
            stem: "swiattn_gamma",
            symbol: "gamma_base",
            axis: "regulariser weight gamma_base",
            value: |a| a.swiattn_gamma_base,
            full_at: None,
            log: true,
        }),
        // Tables 1-3: SwiAttn beside full attention, SWA-ZS, SWA-CPT and StaticHybrid (every
        // method with a name there: `MethodSpec::baseline`), written where it holds more than
        // full attention.
        Report::Table(PaperTable {
            file: "swiattn_baselines.csv",
            holds: |c| c.baseline.is_some(),
            subject: |c| !c.reference,
            columns: &[
                "baseline",
                "method",
                "source_method",
                "window",
                "swiattn_alpha",
                "swiattn_disagreement",
                "loss",
                "perplexity",
                "pairs_vs_full",
                "mu_f",
                "cell",
            ],
            sort: &["baseline"],
        }),
        // Table 4: the regulariser's variants.
        Report::Table(PaperTable {
            file: "swiattn_ablations.csv",
            holds: |c| c.method == Method::Swiattn && c.kind == CellKind::Trained,
            subject: |c| c.method == Method::Swiattn,
            columns: &[
                "variant",
                "swiattn_alpha",
                "swiattn_disagreement",
                "window",
                "loss",
                "perplexity",
                "mu_f",
                "pairs_vs_full",
                "cell",
            ],
            sort: &["variant"],
        }),
    ],
    hf: include_str!("swiattn.py"),
    examples: &[Example {
        name: "swiattn",
        set: |a| a.method = Method::Swiattn,
    }],
    // Its router calibrated like AHA's.
    bench: &[BenchVariant {
        name: "swiattn",
        setup: |_, _| {},
        calibrate_router: true,
        peer: Some("swiattn"),
        reads_window: true,
        reads_usage: true,
        reads_power: false,
    }],
};
