//! AHA, All-or-Here attention: per token and per head, the whole prefix or the window over
//! one set of queries, keys and values. A learned router scores each (token, head),
//! `S = sigmoid(X W + b)`, the gate is `S > tau`, and each head's output is
//! `g * Attn_full + (1 - g) * Attn_window` with the straight-through `g`; the loss adds
//! `lambda * mean(S)`. Static top-k heads (`static_heads`) take the same path with a fixed
//! per-head gate. On the kernels each query runs only the path it picked (one routed launch);
//! the router's gradient reads the other path only where it needs it.

use crate::config::{AttentionConfig, Method, ModelConfig, Router};
use crate::model::attention::base::{AttnOutput, Base, Build, Chunk, Exec, Regulariser, Route};
use crate::model::attention::cache::Keys;
use crate::model::attention::ctx::ForwardCtx;
use crate::model::attention::gates::{hash_uniform, layer_seed, router_input, GateSource};
use crate::model::attention::patterns::Keep;
use crate::model::attention::patterns::KERNEL_FAILED;
use crate::model::attention::shared::{branches, query_paths, routed_attention, routed_pairs};
use crate::model::attention::spec::{
    never_forced, no_extra_params, no_setup, no_variant, BenchKnobs, BenchVariant, CellKind,
    Example, Gates, HeadRanks, MethodSpec, PaperTable, PaperUsageAt, Report, SettingColumn,
    TableCell, Value,
};
use crate::model::kernels::Kernels;
use crate::model::nn::Linear;
use anyhow::{bail, ensure, Context, Result};
use std::path::Path;
use tch::{Kind, Tensor};

/// AHA's layer, or static top-k heads': a gate per (token, head) choosing the whole prefix or
/// the window over the shared q, k, v.
struct PerHead {
    gates: GateSource,
    /// `attention.ste_sample`: the share of window-picking pairs whose full path feeds the
    /// router's straight-through gradient.
    ste_sample: f64,
}

/// AHA's router scores each head (`W: d x H`) and starts with every gate open
/// (`attention.router_init_bias`), or, started at a static assignment
/// (`attention.router_init_heads`, `MethodSpec::fixed_heads`), with the assignment's heads open
/// and the others closed: the bias +|router_init_bias| or -|router_init_bias| a head, its
/// weight zero, so every token's gate is its head's.
fn build_aha(b: &Build) -> Box<dyn Route> {
    let gates = b.gates(
        b.m.num_attention_heads as i64,
        Some(b.a.router_init_bias),
        false,
        true,
    );
    if let (Some(heads), GateSource::Learned { router, .. }) = (b.fixed_heads, &gates) {
        let m = b.a.router_init_bias.abs();
        let start: Vec<f64> = heads
            .iter()
            .map(|h| if h.is_some() { m } else { -m })
            .collect();
        let mut bias = router
            .bias
            .as_ref()
            .expect("AHA's router has a bias")
            .shallow_clone();
        tch::no_grad(|| {
            let start = Tensor::from_slice(&start).to_kind(bias.kind());
            let _ = bias.copy_(&start.to_device(bias.device()));
        });
    }
    Box::new(PerHead {
        gates,
        ste_sample: b.a.ste_sample,
    })
}

/// Static heads take the layer's fixed assignment (`MethodSpec::fixed_heads`); ramped
/// (`attention.top_k_ramp`), each full head keeps its place in the ranking, and a training
/// step opens the first `ForwardCtx::static_heads` places.
fn build_static_heads(b: &Build) -> Box<dyn Route> {
    let heads = b
        .fixed_heads
        .expect("static_heads is built with its head assignment");
    let device = b.p.device();
    let gates = match b.a.top_k_ramp.as_os_str().is_empty() {
        true => {
            let on: Vec<f32> = heads.iter().map(|h| h.is_some() as u8 as f32).collect();
            GateSource::Fixed(Tensor::from_slice(&on).to_device(device))
        }
        // A head never full sits past every place a step can open.
        false => {
            let places: Vec<f64> = heads
                .iter()
                .map(|h| h.map_or(f64::INFINITY, |p| p as f64))
                .collect();
            GateSource::Ranked(Tensor::from_slice(&places).to_device(device))
        }
    };
    Box::new(PerHead {
        gates,
        ste_sample: b.a.ste_sample,
    })
}

impl Route for PerHead {
    fn forward(&self, layer: &Base, c: &Chunk, ctx: &ForwardCtx) -> AttnOutput {
        self.forward_chunk(layer, c, ctx)
    }

    /// Any token may route to the full path, which reads the one shared cache.
    fn keeps(&self, _: &Base) -> Vec<Keep> {
        vec![Keep::All]
    }
}

/// Which window-picking queries also need the full path's output (see `per_head`).
enum Values<'a> {
    None,
    All,
    /// Those marked in a `[B, T, H]` mask.
    Some(&'a Tensor),
}

impl PerHead {
    /// AHA's layer (and static heads'): gates, the mixed paths, the regulariser and the pairs
    /// the executed paths attend, for the chunk `c`.
    fn forward_chunk(&self, layer: &Base, c: &Chunk, ctx: &ForwardCtx) -> AttnOutput {
        let gates = &self.gates;
        let Chunk {
            x, q, k, v, keys, ..
        } = *c;
        let (b, l, _) = x.size3().expect("attention input is [B, L, hidden]");
        let h = layer.proj.n_heads;
        let start = keys.start();
        if let (
            Exec::Kernels(kern, _),
            GateSource::Learned {
                router,
                norm,
                tau,
                inclusive: false,
                ..
            },
            None,
        ) = (layer.exec(keys), gates, &ctx.gate_override)
        {
            let input = router_input(norm, x);
            return self.per_head_fused(
                layer,
                kern,
                &input,
                q,
                k,
                v,
                router,
                *tau,
                gates.lambda(ctx).expect("a learned router has a penalty"),
                start,
                ctx,
            );
        }
        let positions = keys.positions(l, x.device());
        let g = gates.gates(layer.layer, x, [b, l, h], &positions, ctx);
        let learned = matches!(gates, GateSource::Learned { .. });
        // Sampled straight-through gradient (attention.ste_sample): a random subset
        // of the window-picking pairs computes the full path, and their router
        // gradient is scaled up by 1 / ste_sample; the other window pairs send none.
        let probe = (learned && self.ste_sample < 1.0 && q.requires_grad()).then(|| {
            let seed = layer_seed(ctx, layer.layer);
            let u = hash_uniform(seed, layer.layer, [b, l, h], &positions);
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
        let y = self.per_head(layer, q, k, v, &g.hard, &value, keys, values);
        AttnOutput {
            y: layer.proj.out(&y, layer.kernels),
            pairs: routed_pairs(&g.hard, layer.window, &positions),
            reg: gates.lambda(ctx).map(|lambda| {
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
        layer: &Base,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        on: &Tensor,
        g: &Tensor,
        keys: &Keys,
        values: Values,
    ) -> Tensor {
        let w = layer.window as i64;
        let gv = |t: &Tensor| t.to_kind(q.kind()).transpose(1, 2).unsqueeze(-1);
        match layer.exec(keys) {
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
                let (full, local) = branches(layer, q, k, v, on, keys, false);
                let g = gv(g);
                &g * full + (1.0 - &g) * local
            }
        }
    }

    /// AHA's layer with a learned router on the kernels, over the chunk's own keys: what the
    /// general branch of `forward_chunk` and `per_head` compute, with the gates, probes, paths and
    /// pairs in one kernel (`Kernels::aha_gates`) and the router's scores in one
    /// (`Kernels::router`), where ATen took some fifty launches a layer,
    /// whose host cost bounded the training step's forward at L 8192 (PERFORMANCE.md).
    #[allow(clippy::too_many_arguments)]
    fn per_head_fused(
        &self,
        layer: &Base,
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
        let w = layer.window as i64;
        let g = kern
            .aha_gates(
                &scores,
                tau,
                sample,
                layer_seed(ctx, layer.layer),
                layer.layer,
                start,
                w,
            )
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
            y: layer.proj.out(&y, Some(kern)),
            pairs: g.pairs,
            reg: Some(Regulariser::Term(scores.mean(Kind::Float) * lambda)),
            gates: Some(g.hard),
            scores: Some(scores),
        }
    }
}

/// The columns of `head_ranking.csv`, which evaluation writes of a routed model and static
/// heads read: heads by descending usage.
pub(crate) const HEAD_RANKING_COLUMNS: [&str; 4] = ["rank", "layer", "head", "mu_f"];

/// Reads a `head_ranking.csv` and marks its first `top_k` (layer, head) pairs as full, each
/// with its place in the ranking: `[layer][head]`. `top_k` 0 takes the ranked model's own
/// budget: as many heads as its per-head usage adds up to (rounded), so the static model calls
/// the full path for the same share of (token, head) pairs (AHA Table 5 at equal budget).
pub(crate) fn read_head_assignment(
    path: &Path,
    top_k: usize,
    layers: usize,
    heads: usize,
) -> Result<HeadRanks> {
    let mut rdr = csv::Reader::from_path(path)
        .with_context(|| format!("cannot read head ranking {}", path.display()))?;
    let mut ranked: Vec<(usize, usize)> = Vec::new();
    let mut usage = 0.0;
    for (i, row) in rdr.records().enumerate() {
        let row = row.with_context(|| format!("{}: malformed row {}", path.display(), i + 2))?;
        let bad = || {
            format!(
                "{}: row {} needs {}",
                path.display(),
                i + 2,
                HEAD_RANKING_COLUMNS.join(",")
            )
        };
        let field = |k: usize| -> Result<usize> {
            row.get(k).and_then(|v| v.parse().ok()).with_context(bad)
        };
        let (layer, head) = (field(1)?, field(2)?);
        let mu: f64 = row.get(3).and_then(|v| v.parse().ok()).with_context(bad)?;
        ensure!(
            mu.is_finite() && (0.0..=1.0).contains(&mu),
            "{}: row {} gives head usage {mu}; it must be a share between 0 and 1",
            path.display(),
            i + 2
        );
        ensure!(
            layer < layers && head < heads,
            "{}: row {} names layer {layer} head {head}, but the model has {layers} layers of {heads} heads",
            path.display(),
            i + 2
        );
        ensure!(
            !ranked.contains(&(layer, head)),
            "{}: row {} ranks layer {layer} head {head} a second time; each head has one place",
            path.display(),
            i + 2
        );
        ranked.push((layer, head));
        usage += mu;
    }
    let k = match top_k {
        0 => usage.round() as usize,
        k => k,
    };
    if ranked.len() < k {
        bail!(
            "{} ranks {} heads, fewer than attention.top_k = {k}",
            path.display(),
            ranked.len()
        );
    }
    let mut on = vec![vec![None; heads]; layers];
    for (place, &(layer, head)) in ranked[..k].iter().enumerate() {
        on[layer][head] = Some(place);
    }
    Ok(on)
}

/// Static heads ramped along another run's usage (`attention.top_k_ramp`): that run's
/// usage at each fraction of its training, as a share of its last (AHA Table 5's control for
/// AHA's own ramp: static heads that open as AHA's gates did, not all from the first step).
#[derive(Debug)]
pub(crate) struct UsageRamp {
    /// (fraction of training, usage over the last usage), by fraction.
    points: Vec<(f64, f64)>,
}

impl UsageRamp {
    /// Reads a run's `train_log.csv`: its `step` and `mu_f` columns, rows without a usage
    /// left out. Refused without usage, with a usage that is not a share, or when the last
    /// is 0 (nothing to ramp toward).
    pub(crate) fn read(path: &Path) -> Result<Self> {
        let shown = path.display();
        let mut rdr = csv::Reader::from_path(path).with_context(|| {
            format!("cannot read attention.top_k_ramp {shown} (a train_log.csv of a routed run)")
        })?;
        let header = rdr.headers()?.clone();
        let col = |name: &str| {
            header.iter().position(|h| h == name).with_context(|| {
                format!("attention.top_k_ramp {shown} has no {name} column: give a routed run's train_log.csv")
            })
        };
        let (step, mu) = (col("step")?, col("mu_f")?);
        let mut raw: Vec<(f64, f64)> = Vec::new();
        for (i, row) in rdr.records().enumerate() {
            let row = row.with_context(|| format!("{shown}: malformed row {}", i + 2))?;
            let Some(u) = row.get(mu).filter(|v| !v.is_empty()) else {
                continue;
            };
            let (s, u): (f64, f64) = match (row[step].parse(), u.parse()) {
                (Ok(s), Ok(u)) => (s, u),
                _ => bail!("{shown}: row {} has no number in step or mu_f", i + 2),
            };
            ensure!(
                s.is_finite() && u.is_finite() && (0.0..=1.0).contains(&u),
                "{shown}: row {} gives usage {u} at step {s}; usage is a share between 0 and 1",
                i + 2
            );
            raw.push((s, u));
        }
        let (last_step, last) = *raw
            .last()
            .with_context(|| format!("{shown} logs no usage (mu_f): nothing to ramp along"))?;
        ensure!(
            last > 0.0 && last_step > 0.0,
            "{shown} ends at usage {last} (step {last_step}): static heads ramped toward it would \
             end with none full"
        );
        Ok(UsageRamp {
            points: raw
                .into_iter()
                .map(|(s, u)| (s / last_step, u / last))
                .collect(),
        })
    }

    /// How many of `total` ranked heads run full at `step` of `steps`: `total` times the
    /// ramp's share at that fraction (linear between its points, its first before them),
    /// rounded, at most `total`.
    pub(crate) fn heads(&self, step: usize, steps: usize, total: usize) -> usize {
        let x = (step as f64 + 1.0) / steps.max(1) as f64;
        let p = &self.points;
        let share = match p.iter().position(|&(f, _)| f >= x) {
            Some(0) => p[0].1,
            Some(i) => {
                let ((x0, y0), (x1, y1)) = (p[i - 1], p[i]);
                y0 + (y1 - y0) * (x - x0) / (x1 - x0)
            }
            None => p[p.len() - 1].1,
        };
        ((share * total as f64).round() as usize).min(total)
    }
}

/// Static heads' name of a top-k setting: all heads, the ranked model's budget (top_k 0, its
/// heads counted from the usage measured), or k.
fn top_k_name(a: &AttentionConfig, heads: usize, mu_f: Option<f64>) -> String {
    let name = match a.top_k {
        k if k == heads => "all heads full".into(),
        0 => format!(
            "top-{} (AHA's budget)",
            (mu_f.unwrap_or(0.0) * heads as f64).round()
        ),
        k => format!("top-{k}"),
    };
    match a.top_k_ramp.as_os_str().is_empty() {
        true => name,
        false => format!("{name}, ramped along a run's usage"),
    }
}

/// The paper's Table 2, "Avg %" at w 256 (lambda 3e-4): its headline usage.
const TABLE2_W256: f64 = 0.067;

pub(super) const AHA: MethodSpec = MethodSpec {
    method: Method::Aha,
    label: "AHA",
    gates: Gates::PerHead,
    windowed: true,
    dense_mask: true,
    build: build_aha,
    extra_params: no_extra_params,
    // Started at a static assignment: the heads whose routers start open.
    fixed_heads: |m: &ModelConfig, a: &AttentionConfig| match a.router_init_heads.as_os_str() {
        p if p.is_empty() => Ok(None),
        _ => read_head_assignment(
            &a.router_init_heads,
            a.top_k,
            m.num_hidden_layers,
            m.num_attention_heads,
        )
        .map(Some),
    },
    force_global: never_forced,
    // The penalty, and the sampled straight-through gradient where it stands for the exact one.
    describe: |a, _, _| {
        let mut parts = vec![format!("λ {}", a.lambda)];
        if a.ste_sample < 1.0 {
            parts.push(format!("STE sampled {}", a.ste_sample));
        }
        parts
    },
    variant: no_variant,
    reference: false,
    zero_shot: false,
    prunable: false,
    columns: &[],
    baseline: None,
    // Random gates at AHA's usage are Table 5's other control, not AHA: named apart.
    head_budget: |a, _, _, _| match (a.router, a.bernoulli_rates.is_empty()) {
        (Router::Learned, _) => "AHA".into(),
        (Router::Bernoulli, false) => "random gates (AHA's usage per head)".into(),
        (Router::Bernoulli, true) => format!("random gates (p {} for every head)", a.bernoulli_p),
    },
    reports: &[
        Report::PaperUsage {
            mu_f: TABLE2_W256,
            source: "AHA paper, Table 2 at w 256: 6.7 %",
        },
        // Tables 1/2: quality, retain % and usage by window; Table 4: by lambda.
        Report::Table(PaperTable {
            file: "aha_windows.csv",
            holds: learned_and_trained,
            subject: |c| c.method == Method::Aha,
            columns: &[
                "window",
                "lambda",
                "loss",
                "perplexity",
                "retain_pct",
                "retain_ref",
                "mu_f",
                "pairs_vs_full",
                "gate_precision",
                "gate_recall",
                "chance_precision",
                "ask_rule_precision",
                "ask_rule_recall",
                "cell",
            ],
            sort: &["lambda", "window"],
        }),
        Report::Table(PaperTable {
            file: "aha_lambda.csv",
            holds: learned_and_trained,
            subject: |c| c.method == Method::Aha,
            columns: &[
                "lambda",
                "window",
                "loss",
                "perplexity",
                "retain_pct",
                "retain_ref",
                "mu_f",
                "cell",
            ],
            sort: &["window", "lambda"],
        }),
        // Table 3: every head's gaps between full-path calls.
        Report::HeadGaps {
            file: "aha_gaps.csv",
        },
        // Figs. 3/4 and Table 4's curves.
        Report::HeadUsage,
        Report::LambdaAblation {
            // Table 4 ("Avg Full %", w 128) and Table 2's w 256 at the default lambda.
            paper: &[
                PaperUsageAt {
                    window: 128.0,
                    lambda: 1e-4,
                    mu_f: 0.535,
                },
                PaperUsageAt {
                    window: 128.0,
                    lambda: 3e-4,
                    mu_f: 0.116,
                },
                PaperUsageAt {
                    window: 128.0,
                    lambda: 1e-3,
                    mu_f: 0.045,
                },
                PaperUsageAt {
                    window: 256.0,
                    lambda: 3e-4,
                    mu_f: TABLE2_W256,
                },
            ],
            source: "AHA paper, Tables 4 and 2",
        },
    ],
    hf: include_str!("aha.py"),
    examples: &[
        Example {
            name: "aha",
            set: |a| a.method = Method::Aha,
        },
        // Context-free gates: no router gradient, the full path for the picked queries only.
        Example {
            name: "aha_bernoulli",
            set: |a| {
                a.method = Method::Aha;
                a.router = Router::Bernoulli;
                a.bernoulli_p = 0.4;
            },
        },
        // Sampled straight-through gradient: the full path for the picked and probed queries.
        Example {
            name: "aha_sampled",
            set: |a| {
                a.method = Method::Aha;
                a.ste_sample = 0.5;
            },
        },
    ],
    bench: &[
        // The paper's: the exact straight-through router gradient.
        BenchVariant {
            name: "aha",
            setup: no_setup,
            calibrate_router: true,
            peer: Some("aha"),
            reads_window: true,
            reads_usage: true,
            reads_power: false,
        },
        // The sampled straight-through gradient (`--ste-sample`); the peers have the paper's only.
        BenchVariant {
            name: "aha-sampled",
            setup: |a: &mut AttentionConfig, k: &BenchKnobs| a.ste_sample = k.ste_sample,
            calibrate_router: true,
            peer: None,
            reads_window: true,
            reads_usage: true,
            reads_power: false,
        },
    ],
};

pub(super) const STATIC_HEADS: MethodSpec = MethodSpec {
    method: Method::StaticHeads,
    label: "static heads",
    gates: Gates::PerHead,
    windowed: true,
    dense_mask: true,
    build: build_static_heads,
    extra_params: no_extra_params,
    fixed_heads: |m: &ModelConfig, a: &AttentionConfig| {
        read_head_assignment(
            &a.head_ranking,
            a.top_k,
            m.num_hidden_layers,
            m.num_attention_heads,
        )
        .map(Some)
    },
    force_global: never_forced,
    describe: |a, heads, mu_f| vec![top_k_name(a, heads, mu_f)],
    variant: no_variant,
    bench: &[],
    reference: false,
    zero_shot: false,
    prunable: false,
    columns: &[TOP_K],
    baseline: None,
    head_budget: |a, _, heads, mu_f| top_k_name(a, heads, mu_f),
    reports: &[
        // AHA Table 5: static top-k heads beside AHA at its budget, all heads full and all on
        // the window (SWA trained as long): every trained cell with a row there.
        Report::Table(PaperTable {
            file: "aha_static_heads.csv",
            holds: |c| c.kind == CellKind::Trained && !c.head_budget.is_empty(),
            subject: |c| c.method == Method::StaticHeads,
            columns: &[
                "setting",
                "method",
                "top_k",
                "window",
                "mu_f",
                "loss",
                "perplexity",
                "retain_pct",
                "retain_ref",
                "cell",
            ],
            sort: &["method", "mu_f"],
        }),
    ],
    hf: include_str!("aha.py"),
    examples: &[Example {
        name: "static_heads",
        set: |a| {
            a.method = Method::StaticHeads;
            a.head_ranking = example_ranking();
            a.top_k = 1;
        },
    }],
};

/// How many top-ranked heads are full: a column of every cell (Table 5's axis).
const TOP_K: SettingColumn = SettingColumn {
    name: "top_k",
    value: |a| Value::Number(a.top_k as f64),
    every_cell: true,
    in_every_summary: true,
    timed: false,
};

/// A trained cell of a learned AHA router (Tables 1/2 and 4).
fn learned_and_trained(c: &TableCell) -> bool {
    c.method == Method::Aha && c.kind == CellKind::Trained && c.router == Router::Learned
}

/// A head ranking of layer 0's first two heads, which every example's model has, written once
/// per process for the examples: (0, 0), then (0, 1).
fn example_ranking() -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!(
        "attnsweep-example-head-ranking-{}.csv",
        std::process::id()
    ));
    if !path.is_file() {
        let tmp = path.with_extension(format!("{:?}.tmp", std::thread::current().id()));
        std::fs::write(
            &tmp,
            format!("{}\n1,0,0,0.9\n2,0,1,0.1\n", HEAD_RANKING_COLUMNS.join(",")),
        )
        .expect("the example head ranking is written to the temporary directory");
        std::fs::rename(&tmp, &path).expect("the example head ranking is renamed into place");
    }
    path
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::attention::spec::Provenance;

    /// A ramp reads a run's usage as shares of its last, by fraction of training; a step opens
    /// that share of the ranked heads (linear between the logged points, rounded, at most
    /// all); logs it cannot ramp along are refused by what they lack.
    #[test]
    fn a_usage_ramp_opens_its_share_of_the_heads() {
        let dir = std::env::temp_dir().join(format!("attnsweep-ramp-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("train_log.csv");
        std::fs::write(&log, "step,loss,mu_f\n1,3,0.1\n2,3,\n3,3,0.3\n4,3,0.4\n").unwrap();
        let ramp = UsageRamp::read(&log).unwrap();
        // Points at fractions 0.25, 0.75 and 1, shares 0.25, 0.75 and 1.
        let heads: Vec<usize> = (0..4).map(|s| ramp.heads(s, 4, 8)).collect();
        assert_eq!(heads, [2, 4, 6, 8]);
        // Half as many steps: the same fractions of training.
        assert_eq!(ramp.heads(0, 2, 8), 4);
        std::fs::write(&log, "step,mu_f\n1,0.8\n2,0.4\n").unwrap();
        assert_eq!(UsageRamp::read(&log).unwrap().heads(0, 2, 8), 8);
        for (text, needle) in [
            ("step,loss\n1,3\n", "no mu_f column"),
            ("step,mu_f\n1,0.2\n2,0\n", "ends at usage 0"),
            ("step,mu_f\n1,1.5\n", "share between 0 and 1"),
            ("step,mu_f\n1,\n", "logs no usage"),
        ] {
            std::fs::write(&log, text).unwrap();
            let e = format!("{:#}", UsageRamp::read(&log).unwrap_err());
            assert!(e.contains(needle), "{text:?}: {e}");
        }
        // A ranking that places a head twice is refused: its places would not be 0..k.
        let ranking = dir.join("head_ranking.csv");
        std::fs::write(&ranking, "rank,layer,head,mu_f\n0,0,1,0.9\n1,0,1,0.8\n").unwrap();
        let e = format!("{:#}", read_head_assignment(&ranking, 2, 1, 2).unwrap_err());
        assert!(e.contains("a second time"), "{e}");
        std::fs::write(&ranking, "rank,layer,head,mu_f\n0,0,1,0.9\n1,0,0,0.8\n").unwrap();
        let places = read_head_assignment(&ranking, 1, 1, 2).unwrap();
        assert_eq!(places, vec![vec![None, Some(0)]]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Table 5 holds AHA's learned gates and its random-gate control as two rows, not two
    /// "AHA" rows a reader cannot tell apart.
    #[test]
    fn random_gates_have_their_own_table_5_row() {
        let p = Provenance {
            kind: CellKind::Trained,
            from_reference: true,
        };
        let mut a = AttentionConfig::default();
        a.method = Method::Aha;
        assert_eq!((AHA.head_budget)(&a, &p, 270, Some(0.06)), "AHA");
        a.router = Router::Bernoulli;
        a.bernoulli_p = 0.06;
        let name = (AHA.head_budget)(&a, &p, 270, Some(0.06));
        assert_eq!(name, "random gates (p 0.06 for every head)");
        a.bernoulli_rates = vec![vec![0.1, 0.02]];
        let name = (AHA.head_budget)(&a, &p, 270, Some(0.06));
        assert_eq!(name, "random gates (AHA's usage per head)");
    }
}
