//! One training micro-step, forward and backward, in the ways a model of any size needs:
//!
//! - **plain**: autograd over the whole model (`forward_loss`, then `backward`);
//! - **recomputed blocks** (activation checkpointing): the forward keeps only the input of each
//!   recomputed block, and the backward runs that block's forward again from it just before
//!   the block's own backward. tch has no `torch.utils.checkpoint`, so the backward goes block
//!   by block, each from a leaf input;
//! - **the loss in chunks of tokens**: the output projection and cross-entropy of one chunk at
//!   a time, forward and backward together, so the `[tokens, vocab]` logits never exist whole
//!   (what Liger's fused linear cross-entropy and Apple's Cut Cross-Entropy do in a kernel).
//!
//! Each piece's backward is seeded with the gradient of its output through a surrogate scalar
//! `y · g`, whose gradient in `y` is `g` bit for bit; the seeds of the loss's terms (the
//! per-token NLL and each layer's regulariser) come from the same autograd operations the plain
//! path runs, on stand-ins of their shapes, since a mean's gradient does not depend on values.
//! So recomputation gives the plain path's loss and gradients exactly where both run the same
//! operations (on the CPU, and on the GPU without a kernel library); the chunked loss differs
//! only by the order of the head's sums. With the kernels on the GPU, the plain path adds each
//! block's output into the next block's input norm in one kernel (`RmsNorm::add_forward`),
//! which rounds the stream's summed gradient once in bf16, where a recomputed block adds it
//! apart: the two agree to bf16 rounding, not bit for bit.

use crate::config::Checkpointing;
use crate::model::attention::{ForwardCtx, Keys, Regulariser};
use crate::model::llama::{mean_term, usage, Llama};
use crate::model::nn::token_nll;
use tch::{Kind, Tensor};

/// What one forward and backward over a micro-batch measured, read on the host.
pub(crate) struct MicroStep {
    /// Language-model loss (mean token NLL).
    pub(crate) loss: f64,
    /// The method's regulariser, if it has one.
    pub(crate) reg: Option<f64>,
    /// Full-attention usage mu_f, for routed methods.
    pub(crate) full_usage: Option<f64>,
}

/// What a micro-step measured, left on the device: read once its backward is queued (so the
/// host does not wait for the forward before queuing the backward), or after a captured
/// step's replay (`StepGraph`), whose capture may read nothing back.
pub(crate) struct StepStats {
    pub(crate) loss: Tensor,
    pub(crate) reg: Option<Tensor>,
    pub(crate) full_usage: Option<Tensor>,
}

impl StepStats {
    pub(crate) fn read(&self) -> MicroStep {
        MicroStep {
            loss: self.loss.double_value(&[]),
            reg: self.reg.as_ref().map(|r| r.double_value(&[])),
            full_usage: self.full_usage.as_ref().map(|mu| mu.double_value(&[])),
        }
    }
}

/// How a micro-step keeps what its backward needs.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct StepPlan {
    /// Per block: run its forward again in the backward (true), or keep its graph.
    pub(crate) recompute: Vec<bool>,
    /// Tokens a chunk of the loss; None computes the logits of the whole micro-batch at once.
    pub(crate) loss_chunk: Option<usize>,
}

impl StepPlan {
    /// `checkpointing` over `layers` blocks: none, all, or every other one from the first
    /// (torchtitan's selective checkpointing by layer), with the loss in chunks of
    /// `loss_chunk` tokens where given.
    pub(crate) fn new(
        checkpointing: Checkpointing,
        layers: usize,
        loss_chunk: Option<usize>,
    ) -> Self {
        let recompute = (0..layers)
            .map(|i| match checkpointing {
                Checkpointing::None => false,
                Checkpointing::Full => true,
                Checkpointing::Selective => i % 2 == 0,
                Checkpointing::Auto => unreachable!("the memory plan resolves auto first"),
            })
            .collect();
        StepPlan {
            recompute,
            loss_chunk,
        }
    }

    fn plain(&self) -> bool {
        self.loss_chunk.is_none() && !self.recompute.contains(&true)
    }
}

/// Per-token NLL `[B, L]` of `logits` at `targets`: the fused cross-entropy where the model
/// has a kernel library (it reads logits in the compute dtype), else the reference.
fn nll_of(model: &Llama, logits: &Tensor, targets: &Tensor) -> Tensor {
    match model.kernels {
        Some(k) => k
            .token_nll(logits, targets)
            .expect("cross-entropy kernel on the model's own logits"),
        None => token_nll(logits, targets),
    }
}

/// The loss of one micro-batch `x -> y` (language model plus the method's regulariser), with
/// what it measured, as one autograd graph. With a kernel library the cross-entropy is the
/// fused one, which reads logits left in the compute dtype (`ForwardCtx::compute_logits`).
pub(crate) fn forward_loss(
    model: &Llama,
    x: &Tensor,
    y: &Tensor,
    ctx: &ForwardCtx,
) -> (Tensor, StepStats) {
    let fwd = model.forward(x, ctx);
    let nll = nll_of(model, &fwd.logits, y);
    let lm = nll.mean(Kind::Float);
    let reg = fwd.regulariser(&nll);
    let stats = StepStats {
        loss: lm.detach(),
        reg: reg.as_ref().map(Tensor::detach),
        full_usage: fwd.full_usage().map(|mu| mu.detach()),
    };
    let total = match reg {
        Some(r) => lm + r,
        None => lm,
    };
    (total, stats)
}

/// Forward and backward of one micro-batch under `plan`, gradients scaled by `1 / accum` and
/// added to the parameters' gradients; its measures left on the device (`StepStats::read`).
pub(crate) fn forward_backward(
    model: &Llama,
    x: &Tensor,
    y: &Tensor,
    ctx: &ForwardCtx,
    plan: &StepPlan,
    accum: usize,
) -> StepStats {
    if plan.plain() {
        let (total, stats) = forward_loss(model, x, y, ctx);
        (total / accum as f64).backward();
        return stats;
    }
    staged(model, x, y, ctx, plan, accum)
}

/// What the forward keeps of a block for its backward.
struct Kept {
    /// The block's input: the leaf of its graph (kept blocks), or the tensor to run the block
    /// from again (recomputed ones).
    input: Tensor,
    /// The block's output with its graph, for kept blocks.
    output: Option<Tensor>,
    /// The attention's regulariser with its graph, for kept blocks.
    reg: Option<Regulariser>,
}

/// `y · g` over all elements: a scalar whose gradient in `y` is exactly `g`.
pub(crate) fn seeded(y: &Tensor, g: &Tensor) -> Tensor {
    y.flatten(0, -1).dot(&g.flatten(0, -1))
}

/// The gradients the plain path gives the per-token NLL (`[B, L]`) and each of `terms`
/// regulariser terms, from the same operations (`forward_loss`, then the division by
/// `accum`) on zeros of their shapes.
fn loss_seeds(
    shape: &[i64],
    terms: usize,
    accum: usize,
    kind: Kind,
    device: tch::Device,
) -> (Tensor, Vec<Tensor>) {
    let nll = Tensor::zeros(shape, (kind, device)).set_requires_grad(true);
    let t: Vec<Tensor> = (0..terms)
        .map(|_| Tensor::zeros([], (kind, device)).set_requires_grad(true))
        .collect();
    let lm = nll.mean(Kind::Float);
    let total = match mean_term(t.iter().map(|t| t.shallow_clone()).collect()) {
        Some(r) => lm + r,
        None => lm,
    };
    (total / accum as f64).backward();
    (nll.grad(), t.iter().map(|t| t.grad()).collect())
}

fn staged(
    model: &Llama,
    x: &Tensor,
    y: &Tensor,
    ctx: &ForwardCtx,
    plan: &StepPlan,
    accum: usize,
) -> StepStats {
    let seq = model.sequence(x.size()[1], x.device());
    let (masks, rope) = (&seq.masks, &seq.rope);
    let keys = Keys::Chunk(masks);
    let layers = model.layers.len();
    assert_eq!(
        plan.recompute.len(),
        layers,
        "a plan for this model's blocks"
    );

    // Forward, block by block, each from a leaf input as the plain path computes it (so with
    // the same kernels): a kept block keeps its graph, a recomputed one only its input.
    let embedded = model.embed(x);
    let mut h = embedded.detach();
    let mut kept = Vec::with_capacity(layers);
    let mut means = Vec::new();
    let mut reg_layers = 0;
    for i in 0..layers {
        let input = h.set_requires_grad(true);
        let (out, attn) = model.block(i, &input, rope, &keys, ctx);
        reg_layers += usize::from(attn.reg.is_some());
        if let Some(g) = &attn.gates {
            means.push(tch::no_grad(|| g.mean(Kind::Float)));
        }
        h = out.detach();
        kept.push(match plan.recompute[i] {
            true => Kept {
                input: input.detach(),
                output: None,
                reg: None,
            },
            false => Kept {
                input,
                output: Some(out),
                reg: attn.reg,
            },
        });
    }

    // The loss, a chunk of tokens at a time: each chunk's logits, cross-entropy and their
    // backward (into the final norm's output and the head's weight) before the next.
    let last = h.set_requires_grad(true);
    let hn = model.final_norm(&last);
    let (b, l) = (x.size()[0], x.size()[1]);
    let d = *hn.size().last().expect("hidden states [B, L, d]");
    let rows = b * l;
    let nll_kind = match hn.kind() {
        Kind::Double => Kind::Double,
        _ => Kind::Float,
    };
    let (nll_seed, term_seeds) = loss_seeds(&[b, l], reg_layers, accum, nll_kind, x.device());
    let (hn_rows, y_rows, seed_rows) = (
        hn.detach().reshape([rows, d]),
        y.reshape([rows]),
        nll_seed.reshape([rows]),
    );
    let weight = model.head_weight();
    let trains_head = weight.requires_grad();
    let w_leaf = weight
        .detach()
        .to_kind(hn.kind())
        .set_requires_grad(trains_head);
    let g_hn = hn_rows.zeros_like();
    let chunk = plan.loss_chunk.unwrap_or(rows as usize).max(1) as i64;
    // The head's gradient, summed over the chunks in the parameter's dtype, reaches the
    // parameter in one backward at the end (with the embedding's, where the weight is both,
    // as the plain path adds them): each parameter's gradient accumulates once a micro-step,
    // which a data-parallel reducer's hooks count on.
    let mut head_grad: Option<Tensor> = None;
    let mut nll_parts = Vec::new();
    for start in (0..rows).step_by(chunk as usize) {
        let n = chunk.min(rows - start);
        let h_c = hn_rows.narrow(0, start, n).detach().set_requires_grad(true);
        let logits = h_c.linear(&w_leaf, None::<Tensor>);
        let nll_c = nll_of(model, &logits, &y_rows.narrow(0, start, n));
        let loss_c = seeded(&nll_c, &seed_rows.narrow(0, start, n));
        let inputs: Vec<&Tensor> = match trains_head {
            true => vec![&h_c, &w_leaf],
            false => vec![&h_c],
        };
        let grads = Tensor::run_backward(&[&loss_c], &inputs, false, false);
        g_hn.narrow(0, start, n).copy_(&grads[0]);
        if trains_head {
            let part = grads[1].to_kind(weight.kind());
            head_grad = Some(match head_grad {
                Some(mut sum) => {
                    let _ = sum.g_add_(&part);
                    sum
                }
                None => part,
            });
        }
        nll_parts.push(nll_c.detach());
    }
    let nll = Tensor::cat(&nll_parts, 0).view([b, l]);
    seeded(&hn, &g_hn.view([b, l, d])).backward();
    let mut g = last.grad();

    // Backward, block by block from the last: each block's output seeded with the gradient of
    // its input's successor, its regulariser term with the plain path's seed.
    let mut term_seeds = term_seeds.into_iter().rev();
    let mut terms = Vec::new();
    for i in (0..layers).rev() {
        let k = kept.pop().expect("one kept entry a block");
        let (output, reg, input) = match k.output {
            Some(out) => (out, k.reg, k.input),
            None => {
                let input = k.input.set_requires_grad(true);
                let (out, attn) = model.block(i, &input, rope, &keys, ctx);
                (out, attn.reg, input)
            }
        };
        let mut s = seeded(&output, &g);
        if let Some(r) = reg {
            let seed = term_seeds.next().expect("a seed a regulariser term");
            let term = r.term(&nll);
            terms.push(term.detach());
            s = s + term * seed;
        }
        s.backward();
        g = input.grad();
    }
    terms.reverse();
    embedding_backward(&embedded, &g, &weight, head_grad);
    StepStats {
        loss: nll.mean(Kind::Float),
        reg: mean_term(terms),
        full_usage: usage(means, layers),
    }
}

/// The embedding's backward from `g`, the gradient of the first block's input, and the head's
/// summed gradient (`head_grad`), in one backward: where the head's weight is the embedding,
/// its two gradients are added before the parameter's, as in the plain path.
fn embedding_backward(embedded: &Tensor, g: &Tensor, weight: &Tensor, head_grad: Option<Tensor>) {
    let embedding = embedded.requires_grad().then(|| seeded(embedded, g));
    let head = head_grad.map(|h| seeded(weight, &h));
    let total = match (embedding, head) {
        (Some(e), Some(h)) => Some(e + h),
        (e, h) => e.or(h),
    };
    if let Some(t) = total {
        t.backward();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{
        AttentionConfig, AttnImpl, Config, Method, ModelConfig, NormPlacement, QkNorm,
    };
    use crate::model::attention::all_methods;
    use crate::run::Built;
    use std::collections::BTreeMap;
    use tch::Device;

    /// What sets a case's method and its settings (`MethodSpec::examples`, or a test's own).
    type SetMethod = fn(&mut AttentionConfig);

    /// Every registered method's examples, by name.
    fn examples() -> Vec<(&'static str, SetMethod)> {
        all_methods()
            .flat_map(|s| s.examples.iter().map(|e| (e.name, e.set)))
            .collect()
    }

    /// A three-block model of the method `set` sets, with routers of random weights (so gates
    /// differ from token to token and head to head) and a regulariser where the method has one.
    fn model(set: SetMethod, norm: NormPlacement, tie: bool, imp: AttnImpl) -> Built {
        let mut c = Config::default();
        c.model = ModelConfig {
            vocab_size: 37,
            hidden_size: 32,
            intermediate_size: 48,
            num_hidden_layers: 3,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            attention_bias: true,
            tie_word_embeddings: tie,
            norm_placement: norm,
            qk_norm: match norm {
                NormPlacement::Post => QkNorm::Full,
                NormPlacement::Pre => QkNorm::PerHead,
            },
            ..Default::default()
        };
        c.attention.window = 5;
        c.attention.hybrid_every = 2;
        set(&mut c.attention);
        c.attention.attn_impl = imp;
        c.train.device = "cpu".into();
        let b = Built::new(&c, Device::Cpu).unwrap();
        // Values from a formula, not the global generator, which tests running beside this
        // one reseed.
        tch::no_grad(|| {
            for (name, p) in b.params() {
                if name.contains("router") {
                    let n = p.numel() as i64;
                    let w = (Tensor::arange(n, (Kind::Float, Device::Cpu)) * 1.7).sin() * 0.7;
                    p.shallow_clone().copy_(&w.view(p.size().as_slice()));
                }
            }
        });
        b
    }

    /// `accum` micro-steps' gradients, accumulated from zero, under `plan`, with the last
    /// one's measures.
    fn step(b: &Built, plan: &StepPlan, accum: usize) -> (MicroStep, BTreeMap<String, Tensor>) {
        for (_, p) in b.params() {
            let mut g = p.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
        let ctx = ForwardCtx {
            gate_seed: 77,
            compute_logits: b.model.kernels.is_some(),
            ..Default::default()
        };
        let mut m = None;
        for micro in 0..accum as i64 {
            let ids = (Tensor::arange(48, (Kind::Int64, Device::Cpu)) * (17 + 2 * micro) + 5)
                .remainder(37)
                .view([2, 24]);
            let (x, y) = (ids.narrow(1, 0, 23), ids.narrow(1, 1, 23));
            m = Some(forward_backward(&b.model, &x, &y, &ctx, plan, accum).read());
        }
        let m = m.expect("at least one micro-step");
        let grads = b
            .params()
            .into_iter()
            .filter(|(_, p)| p.grad().defined())
            .map(|(n, p)| (n, p.grad().copy()))
            .collect();
        (m, grads)
    }

    /// Recomputing every block, or every other one, gives the plain path's loss,
    /// regulariser, usage and every gradient bit for bit, for every method's examples,
    /// pre-norm and tied on the reference path, and for some post-norm, untied and on the
    /// kernel library's CPU build, over two accumulated micro-steps, and with the embedding,
    /// head and MLPs frozen (`train.freeze_mlp`).
    #[test]
    fn recomputed_blocks_give_the_plain_gradients_exactly() {
        let (aha, full, swiattn, l2a): (SetMethod, SetMethod, SetMethod, SetMethod) = (
            |a| a.method = Method::Aha,
            |a| a.method = Method::Full,
            |a| a.method = Method::Swiattn,
            |a| a.method = Method::L2a,
        );
        let (pre, post) = (NormPlacement::Pre, NormPlacement::Post);
        let (reference, kernels) = (AttnImpl::Reference, AttnImpl::Cuda);
        let cases = examples()
            .into_iter()
            .map(|(name, set)| (name, set, pre, true, reference, false))
            .chain([
                ("aha", aha, post, false, reference, false),
                ("full", full, post, false, kernels, false),
                ("swiattn", swiattn, pre, true, kernels, false),
                ("l2a", l2a, pre, false, kernels, false),
                // Frozen embedding, head and MLPs.
                ("swiattn", swiattn, pre, true, reference, true),
            ]);
        for (name, set, norm, tie, imp, frozen) in cases {
            let b = model(set, norm, tie, imp);
            if frozen {
                for (n, p) in b.params() {
                    if n.contains("embed") || n.contains("lm_head") || n.contains("mlp") {
                        let _ = p.set_requires_grad(false);
                    }
                }
            }
            let layers = b.model.layers.len();
            let (want, want_grads) = step(&b, &StepPlan::new(Checkpointing::None, layers, None), 2);
            for c in [Checkpointing::Full, Checkpointing::Selective] {
                let case = format!("{name} {norm:?} tie={tie} {imp:?} frozen={frozen} {c:?}");
                let (got, grads) = step(&b, &StepPlan::new(c, layers, None), 2);
                assert_eq!(got.loss, want.loss, "{case}: loss");
                assert_eq!(got.reg, want.reg, "{case}: regulariser");
                assert_eq!(got.full_usage, want.full_usage, "{case}: usage");
                assert_eq!(
                    grads.keys().collect::<Vec<_>>(),
                    want_grads.keys().collect::<Vec<_>>(),
                    "{case}: parameters with gradients"
                );
                for (n, g) in &grads {
                    assert!(g.equal(&want_grads[n]), "{case}: gradient of {n} differs");
                }
            }
        }
    }

    /// The loss in chunks (one not dividing the tokens, and one of a single token) gives the
    /// plain path's loss and gradients up to the order of the head's sums, alone and with
    /// recomputed blocks, for every method's examples; where the head's weight is also the
    /// embedding, its two gradients add (tied on the reference path, untied on the kernel
    /// library's CPU build).
    #[test]
    fn the_chunked_loss_gives_the_plain_loss_and_gradients() {
        let cases = examples().into_iter().flat_map(|(name, set)| {
            [
                (name, set, true, AttnImpl::Reference),
                (name, set, false, AttnImpl::Cuda),
            ]
        });
        for (name, set, tie, imp) in cases {
            let b = model(set, NormPlacement::Pre, tie, imp);
            let layers = b.model.layers.len();
            let (want, want_grads) = step(&b, &StepPlan::new(Checkpointing::None, layers, None), 1);
            for (c, chunk) in [
                (Checkpointing::None, 7),
                (Checkpointing::Full, 1),
                (Checkpointing::Selective, 20),
            ] {
                let case = format!("{name} tie={tie} {imp:?} {c:?} chunks of {chunk}");
                let (got, grads) = step(&b, &StepPlan::new(c, layers, Some(chunk)), 1);
                assert!(
                    (got.loss - want.loss).abs() < 1e-6,
                    "{case}: loss {} vs {}",
                    got.loss,
                    want.loss
                );
                let (r1, r2) = (got.reg.unwrap_or(0.0), want.reg.unwrap_or(0.0));
                assert!((r1 - r2).abs() < 1e-7, "{case}: regulariser {r1} vs {r2}");
                assert_eq!(got.full_usage, want.full_usage, "{case}: usage");
                for (n, g) in &grads {
                    let w = &want_grads[n];
                    let err = (g - w).abs().max().double_value(&[]);
                    let scale = w.abs().max().double_value(&[]).max(1e-6);
                    assert!(
                        err <= 1e-5 * scale,
                        "{case}: gradient of {n} differs by {err:e} (of {scale:e})"
                    );
                }
                assert_eq!(
                    grads.len(),
                    want_grads.len(),
                    "{case}: parameters with gradients"
                );
            }
        }
    }

    /// Relative L2 distance of `a` from `b`.
    fn rel(a: &Tensor, b: &Tensor) -> f64 {
        let b = b.to_kind(Kind::Double);
        (a.to_kind(Kind::Double) - &b).norm().double_value(&[])
            / b.norm().double_value(&[]).max(1e-12)
    }

    /// Models wider than 1024 on the kernels: OLMo-2's shape (d 2048, norms after attention
    /// and MLP and over all query heads, AHA's router of 16 heads x 2048) and Qwen2.5's (d
    /// 1536, 12 query heads over 2 key-value heads, q/k/v biases), two blocks each, give the
    /// reference path's loss and gradients within bf16's noise; recomputed blocks and the
    /// loss in chunks give the kernel path's own.
    #[test]
    #[ignore = "needs a CUDA GPU and the kernel library: run with --ignored on a GPU machine"]
    fn gpu_wide_models_train_on_the_kernels() {
        use crate::config::Dtype;
        crate::model::kernels::tests::on_cuda("gpu_wide_models_train_on_the_kernels", |_| {
            let dev = Device::Cuda(0);
            for (method, d, heads, kv, post) in [
                (Method::Aha, 2048usize, 16usize, 16usize, true),
                (Method::Full, 1536, 12, 2, false),
                (Method::L2a, 1536, 12, 2, false),
            ] {
                let mut c = Config::default();
                c.model = ModelConfig {
                    vocab_size: 1000,
                    hidden_size: d,
                    intermediate_size: 2 * d,
                    num_hidden_layers: 2,
                    num_attention_heads: heads,
                    num_key_value_heads: kv,
                    attention_bias: !post,
                    tie_word_embeddings: !post,
                    norm_placement: if post {
                        NormPlacement::Post
                    } else {
                        NormPlacement::Pre
                    },
                    qk_norm: if post { QkNorm::Full } else { QkNorm::None },
                    ..Default::default()
                };
                c.attention.method = method;
                c.attention.window = 64;
                c.attention.attn_impl = AttnImpl::Reference;
                c.train.dtype = Dtype::Bf16;
                c.train.device = "cuda".into();
                let reference = Built::new(&c, dev).unwrap();
                c.attention.attn_impl = AttnImpl::Cuda;
                let mut kernel = Built::new(&c, dev).unwrap();
                assert!(kernel.model.kernels.is_some());
                kernel.vs.copy(&reference.vs).unwrap();
                let ids = (Tensor::arange(2 * 513, (Kind::Int64, dev)) * 7919 + 3)
                    .remainder(1000)
                    .view([2, 513]);
                let (x, y) = (ids.narrow(1, 0, 512), ids.narrow(1, 1, 512));
                let run = |b: &Built, plan: &StepPlan| {
                    for (_, p) in b.params() {
                        let mut g = p.grad();
                        if g.defined() {
                            let _ = g.zero_();
                        }
                    }
                    let ctx = ForwardCtx {
                        compute_logits: b.model.kernels.is_some(),
                        ..Default::default()
                    };
                    let m = forward_backward(&b.model, &x, &y, &ctx, plan, 1).read();
                    let grads: BTreeMap<String, Tensor> = b
                        .params()
                        .into_iter()
                        .filter(|(_, p)| p.grad().defined())
                        .map(|(n, p)| (n, p.grad().copy()))
                        .collect();
                    (m.loss, grads)
                };
                let plain = StepPlan::new(Checkpointing::None, 2, None);
                let (want, want_grads) = run(&reference, &plain);
                let (got, grads) = run(&kernel, &plain);
                let (again, again_grads) =
                    run(&kernel, &StepPlan::new(Checkpointing::Full, 2, Some(300)));
                for (case, loss, g, base, w, tol) in [
                    (
                        "kernels against the reference",
                        got,
                        &grads,
                        want,
                        &want_grads,
                        5e-2,
                    ),
                    (
                        "recomputed and chunked against plain",
                        again,
                        &again_grads,
                        got,
                        &grads,
                        2e-2,
                    ),
                ] {
                    assert!(
                        (loss - base).abs() < 2e-2 * base.abs(),
                        "{method:?} d {d}: {case}: loss {loss} vs {base}"
                    );
                    assert_eq!(g.len(), w.len(), "{method:?} d {d}: {case}");
                    for (n, t) in g {
                        let e = rel(t, &w[n]);
                        assert!(
                            e < tol,
                            "{method:?} d {d}: {case}: gradient of {n} differs by {e:.2e}"
                        );
                    }
                }
            }
        });
    }

    /// Selective checkpointing recomputes every other block from the first; full, all.
    #[test]
    fn plans_name_the_blocks_they_recompute() {
        let p = StepPlan::new(Checkpointing::Selective, 5, Some(64));
        assert_eq!(p.recompute, vec![true, false, true, false, true]);
        assert_eq!(p.loss_chunk, Some(64));
        assert!(StepPlan::new(Checkpointing::Full, 3, None)
            .recompute
            .iter()
            .all(|&r| r));
        assert!(StepPlan::new(Checkpointing::None, 3, None).plain());
    }
}
