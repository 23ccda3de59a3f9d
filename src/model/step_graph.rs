//! A training step's forward and backward captured once as a CUDA graph and replayed.
//!
//! At SmolLM2-135M's shapes a step queues thousands of small kernels, and the host launching
//! them leaves the GPU idle for part of the step (the profiles of `results/paper_scale/`); a
//! replay launches them all at once. What a replay assumes, and how each holds:
//!
//! - **the same shapes and addresses**: the micro-batch is copied into inputs the graph owns;
//!   the sequence's masks, angles and PPA offsets are pinned on the model
//!   (`Llama::pin_sequence`) and built by an eager step before the capture, so the capture
//!   copies nothing from the host;
//! - **gradients in place**: the graph zeroes every trained parameter's gradient and the
//!   backward adds into it, so each gradient must exist before the capture (the eager step
//!   made them) and still be the same tensor after it (checked);
//! - **the forward's options as captured**: what a forward takes as constants (L2A's forced
//!   step, the penalty's share, the static heads' count, the gates' seed where the method
//!   draws) is the graph's `CtxKey`; a step under another runs eagerly;
//! - **nothing read back inside**: the loss, regulariser and usage stay on the device until
//!   after the replay (`StepStats`).
//!
//! The whole step's gradient comes from one pass (accumulation 1, as every best-against-best
//! search chose and `--join-micro-batches` makes of a rank's micro-batches); the optimizer
//! runs after the replay, as it does after an eager step.

use crate::model::attention::ForwardCtx;
use crate::model::kernels::{CudaGraph, Kernels};
use crate::model::llama::Llama;
use crate::model::step::{forward_backward, MicroStep, StepPlan, StepStats};
use anyhow::{bail, Result};
use tch::{Device, Tensor};

/// What a forward under a `ForwardCtx` takes as constants, which a captured step keeps.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct CtxKey {
    force_global: bool,
    penalty_scale: Option<u64>,
    static_heads: Option<usize>,
    gate_seed: Option<(u64, i64)>,
}

impl CtxKey {
    /// The key of `ctx`; `draws`: the method draws its gates from `ctx.gate_seed`
    /// (`AttentionConfig::draws_gates`). None where no capture can stand for the forward:
    /// gates overridden (by tensors a step may replace) or the attention timed (which
    /// synchronises).
    pub(crate) fn of(ctx: &ForwardCtx, draws: bool) -> Option<CtxKey> {
        if ctx.gate_override.is_some() || ctx.attention_seconds.get().is_some() {
            return None;
        }
        Some(CtxKey {
            force_global: ctx.force_global,
            penalty_scale: ctx.penalty_scale.map(f64::to_bits),
            static_heads: ctx.static_heads,
            gate_seed: draws.then_some((ctx.gate_seed, ctx.gate_row)),
        })
    }
}

/// One captured step: zero the gradients, forward and backward of a micro-batch.
pub(crate) struct StepGraph {
    graph: CudaGraph,
    x: Tensor,
    y: Tensor,
    stats: StepStats,
    key: CtxKey,
}

impl StepGraph {
    /// Captures zeroing `params`' gradients, then the forward and backward of a micro-batch
    /// shaped as `x -> y` under `ctx` (of key `key`) and `plan`, the whole step's gradient in
    /// one pass. An eager step of the same shape must have run since `model.pin_sequence` of
    /// its length. The capture runs nothing: [`StepGraph::run`] then runs the step.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn capture(
        kern: &'static Kernels,
        model: &Llama,
        params: &[Tensor],
        x: &Tensor,
        y: &Tensor,
        ctx: &ForwardCtx,
        key: CtxKey,
        plan: &StepPlan,
    ) -> Result<StepGraph> {
        let Device::Cuda(index) = x.device() else {
            bail!("a training step is captured as a CUDA graph on a CUDA device only");
        };
        // The gradients the backward adds into: those of the parameters that have one (a
        // parameter the loss never reaches has none, and the optimizer skips it), each the same
        // tensor after the capture, none made during it.
        let grads = || -> Vec<(usize, i64)> {
            params
                .iter()
                .enumerate()
                .filter_map(|(i, p)| {
                    let g = p.grad();
                    g.defined().then(|| (i, g.data_ptr() as i64))
                })
                .collect()
        };
        let before = grads();
        if before.is_empty() {
            bail!(
                "no trained parameter has a gradient: a step runs eagerly before one is captured"
            );
        }
        let (xs, ys) = (x.copy(), y.copy());
        // The eager step's freed blocks go back to the driver, so the graph's own pool takes
        // them instead of as much memory again.
        kern.release_cache(index)?;
        let mut stats = None;
        let graph = kern.capture(|| {
            for &(i, _) in &before {
                let _ = params[i].grad().zero_();
            }
            stats = Some(forward_backward(model, &xs, &ys, ctx, plan, 1));
        })?;
        if grads() != before {
            bail!(
                "the captured backward made or replaced a gradient instead of adding into it, so \
                 a replay would not update that parameter"
            );
        }
        Ok(StepGraph {
            graph,
            x: xs,
            y: ys,
            stats: stats.expect("the capture ran the step's closure"),
            key,
        })
    }

    /// Whether this graph runs a micro-batch shaped as `x` under a forward of key `key`.
    pub(crate) fn fits(&self, x: &Tensor, key: &CtxKey) -> bool {
        self.x.size() == x.size() && self.key == *key
    }

    /// The step on `x -> y` under a forward of key `key`: copied into the graph's inputs,
    /// replayed, its measures read. An error where the graph does not fit them.
    pub(crate) fn run(&self, x: &Tensor, y: &Tensor, key: &CtxKey) -> Result<MicroStep> {
        if !self.fits(x, key) {
            bail!(
                "a captured step replayed on a micro-batch of {:?} under {key:?}; it was \
                 captured for {:?} under {:?}",
                x.size(),
                self.x.size(),
                self.key
            );
        }
        self.x.shallow_clone().copy_(x);
        self.y.shallow_clone().copy_(y);
        self.graph.replay()?;
        Ok(self.stats.read())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{AttnImpl, Config, Dtype, Method, ModelConfig};
    use crate::model::attention::all_methods;
    use crate::run::Built;
    use std::collections::BTreeMap;
    use tch::Kind;

    /// Every registered method's examples give, replayed as a captured step, the eager step's
    /// loss, usage and gradients on two micro-batches (the second one's inputs copied into
    /// the graph's): the same kernels on the same data, within what cuBLAS's choice of
    /// algorithm on another stream can change (the two batches' losses lie much further apart).
    #[test]
    #[ignore = "needs a CUDA GPU and the kernel library: run with --ignored on a GPU machine"]
    fn captured_steps_give_the_eager_steps() {
        crate::model::kernels::tests::on_cuda("captured_steps_give_the_eager_steps", |kern| {
            let dev = Device::Cuda(0);
            let (mut failed, mut captured) = (Vec::new(), 0);
            let examples = all_methods().flat_map(|s| s.examples.iter().map(|e| (e.name, e.set)));
            for (name, set) in examples {
                let mut c = Config::default();
                c.model = ModelConfig {
                    vocab_size: 1000,
                    hidden_size: 256,
                    intermediate_size: 512,
                    num_hidden_layers: 2,
                    num_attention_heads: 4,
                    num_key_value_heads: 2,
                    ..Default::default()
                };
                c.attention.method = Method::Full;
                c.attention.window = 64;
                set(&mut c.attention);
                c.attention.attn_impl = AttnImpl::Cuda;
                c.train.dtype = Dtype::Bf16;
                c.train.device = "cuda".into();
                let built = match Built::new(&c, dev) {
                    Ok(b) => b,
                    // Methods that read files (static heads' ranking) have no example here.
                    Err(_) => continue,
                };
                let params: Vec<Tensor> = built
                    .params()
                    .into_values()
                    .filter(|p| p.requires_grad())
                    .collect();
                let batch = |seed: i64| {
                    let ids = (Tensor::arange(2 * 513, (Kind::Int64, dev)) * (7919 + seed) + 3)
                        .remainder(1000)
                        .view([2, 513]);
                    (ids.narrow(1, 0, 512), ids.narrow(1, 1, 512))
                };
                let ctx = ForwardCtx {
                    compute_logits: true,
                    gate_seed: 11,
                    ..Default::default()
                };
                // The plain step, and blocks recomputed with the loss in chunks (the staged path's
                // many backwards and seeds inside one capture).
                let plans = [
                    StepPlan::new(crate::config::Checkpointing::None, 2, None),
                    StepPlan::new(crate::config::Checkpointing::Full, 2, Some(300)),
                ];
                let grads = || -> BTreeMap<String, Tensor> {
                    built
                        .params()
                        .into_iter()
                        .filter(|(_, p)| p.grad().defined())
                        .map(|(n, p)| (n, p.grad().copy()))
                        .collect()
                };
                let eager = |x: &Tensor, y: &Tensor, plan: &StepPlan| {
                    for p in &params {
                        let mut g = p.grad();
                        if g.defined() {
                            let _ = g.zero_();
                        }
                    }
                    let m = forward_backward(&built.model, x, y, &ctx, plan, 1).read();
                    (m, grads())
                };
                built.model.pin_sequence(512, dev);
                for plan in &plans {
                    let (x0, y0) = batch(0);
                    let (x1, y1) = batch(1);
                    let _ = eager(&x0, &y0, plan);
                    let key = CtxKey::of(&ctx, c.attention.draws_gates()).unwrap();
                    let graph = match StepGraph::capture(
                        kern,
                        &built.model,
                        &params,
                        &x0,
                        &y0,
                        &ctx,
                        key.clone(),
                        plan,
                    ) {
                        Ok(g) => g,
                        Err(e) => {
                            failed.push(format!("{name} {plan:?}: capture: {e:#}"));
                            continue;
                        }
                    };
                    captured += 1;
                    for (x, y) in [(&x0, &y0), (&x1, &y1)] {
                        let got = graph.run(x, y, &key).unwrap();
                        let got_grads = grads();
                        let (want, want_grads) = eager(x, y, plan);
                        let close = |a: f64, b: f64| (a - b).abs() <= 1e-3 * b.abs().max(1e-3);
                        let near = |g: &Tensor, w: &Tensor| {
                            let scale = w.abs().max().double_value(&[]).max(1e-6);
                            (g - w).abs().max().double_value(&[]) <= 2e-2 * scale
                        };
                        let same = close(got.loss, want.loss)
                            && got
                                .full_usage
                                .zip(want.full_usage)
                                .is_none_or(|(a, b)| close(a, b))
                            && got.reg.zip(want.reg).is_none_or(|(a, b)| close(a, b))
                            && want_grads.len() == got_grads.len()
                            && want_grads.iter().all(|(n, w)| near(&got_grads[n], w));
                        if !same {
                            failed.push(format!(
                                "{name} {plan:?}: replay loss {} usage {:?} against eager {} {:?}",
                                got.loss, got.full_usage, want.loss, want.full_usage
                            ));
                        }
                    }
                }
            }
            assert!(failed.is_empty(), "{}", failed.join("\n"));
            // Every example but those reading files (static heads), under both plans.
            assert!(captured >= 20, "{captured} captures");
        });
    }
}
