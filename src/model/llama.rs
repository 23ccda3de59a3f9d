//! The Llama-style decoder, top to bottom: token embedding, `num_hidden_layers` blocks of
//! (RMSNorm -> attention -> residual, RMSNorm -> SwiGLU MLP -> residual), final RMSNorm, LM
//! head. Parameter names are Hugging Face's (`model.layers.N.self_attn.q_proj.weight`, ...).
//!
//! Parameters are always fp32 (they are the optimizer's master copy); `compute` is the dtype
//! activations and matmuls run in. Weights are cast on use, so autograd delivers fp32
//! gradients to the parameters, which is what autocast does in PyTorch. The shared layers
//! (linear maps, RMSNorm, rotary embedding) are in `nn.rs`, the attention in `attention/`.

use crate::config::{AttentionConfig, ModelConfig, NormPlacement, QkNorm};
use crate::model::attention::{
    spec, AttnOutput, CacheState, ForwardCtx, KeyPattern, Keys, LayerCache, MaskCache,
    SelfAttention,
};
use crate::model::kernels;
use crate::model::kernels::Kernels;
use crate::model::nn::{cast, cast_copy, inv_freq, joined, upcast, Linear, RmsNorm, Rope};
use anyhow::Result;
use std::cell::RefCell;
use std::rc::Rc;
use tch::{nn, Device, Kind, Tensor};

pub(crate) struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
    /// The fused gate (`kernels/swiglu.cu`) where a library is loaded.
    kernels: Option<&'static Kernels>,
}

impl Mlp {
    fn new(p: nn::Path, m: &ModelConfig, kernels: Option<&'static Kernels>) -> Self {
        let (d, f, std) = (
            m.hidden_size as i64,
            m.intermediate_size as i64,
            m.initializer_range,
        );
        Mlp {
            gate_proj: Linear::new(&p / "gate_proj", d, f, false, std),
            up_proj: Linear::new(&p / "up_proj", d, f, false, std),
            down_proj: Linear::new(&p / "down_proj", f, d, false, std),
            kernels,
        }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        // Decoding: the gate and up projections as one product of their joined weights.
        let kernels = kernels::kernel_for(self.kernels, x);
        if let Some((k, (w, b))) = kernels.zip(joined(&[&self.gate_proj, &self.up_proj], x.kind()))
        {
            let h = k
                .swiglu_joined(&x.linear(&w, b.as_ref()))
                .expect("SwiGLU kernel on the MLP's own projection");
            return self.down_proj.forward(&h);
        }
        let (gate, up) = (self.gate_proj.forward(x), self.up_proj.forward(x));
        let h = match self.kernels {
            Some(k) => k
                .swiglu(&gate, &up)
                .expect("SwiGLU kernel on the MLP's own tensors"),
            None => gate.silu() * up,
        };
        self.down_proj.forward(&h)
    }
}

/// One block. Pre-norm (Llama): h = x + attn(norm(x)), out = h + mlp(norm(h)). Post-norm
/// (OLMo-2): h = x + norm(attn(x)), out = h + norm(mlp(h)); there `post_attention_layernorm`
/// normalises the attention output and `post_feedforward_layernorm` the MLP output.
pub(crate) struct DecoderLayer {
    input_layernorm: Option<RmsNorm>,
    pub(crate) self_attn: SelfAttention,
    post_attention_layernorm: RmsNorm,
    post_feedforward_layernorm: Option<RmsNorm>,
    mlp: Mlp,
}

/// Per-layer key-value caches of a batch being decoded, and what they share.
pub(crate) struct ModelCache {
    pub(crate) layers: Vec<RefCell<LayerCache>>,
    pub(crate) state: CacheState,
}

impl ModelCache {
    /// Bytes of keys and values allocated, over all layers.
    pub(crate) fn bytes(&self) -> f64 {
        self.layers.iter().map(|l| l.borrow().bytes()).sum()
    }
}

/// Everything a forward pass produces besides the logits.
pub struct ForwardOutput {
    /// `[B, L, vocab]` in fp32 (fp64 for an fp64 model), or in the compute dtype when the
    /// forward's context asks for it.
    pub logits: Tensor,
    /// One entry per layer.
    pub(crate) layers: Vec<AttnOutput>,
}

impl ForwardOutput {
    /// The method's regulariser: the mean over layers of each layer's term (every paper
    /// normalises by the number of layers), None for methods without one. `nll: [B, L]` is
    /// the per-token language-model loss, which SwiAttn's adaptive weight reads.
    pub(crate) fn regulariser(&self, nll: &Tensor) -> Option<Tensor> {
        mean_term(
            self.layers
                .iter()
                .filter_map(|l| l.reg.as_ref().map(|r| r.term(nll)))
                .collect(),
        )
    }

    /// (query, key) pairs attended over all layers and heads.
    pub(crate) fn attended_pairs(&self) -> f64 {
        self.layers.iter().map(|l| l.pairs.double_value(&[])).sum()
    }

    /// Mean of the hard gates over layers, tokens and heads (mu_f); None for static methods.
    /// A static layer of a routed model (a pruned L2A layer) is all window: it counts as 0, as
    /// evaluation counts it.
    pub(crate) fn full_usage(&self) -> Option<Tensor> {
        usage(
            self.layers
                .iter()
                .filter_map(|l| l.gates.as_ref().map(|g| g.mean(Kind::Float)))
                .collect(),
            self.layers.len(),
        )
    }
}

/// The regulariser from its per-layer terms: their mean (None without any).
pub(crate) fn mean_term(terms: Vec<Tensor>) -> Option<Tensor> {
    (!terms.is_empty()).then(|| Tensor::stack(&terms, 0).mean(Kind::Float))
}

/// mu_f from the mean gate of each gated layer, over all `layers` (None without any).
pub(crate) fn usage(means: Vec<Tensor>, layers: usize) -> Option<Tensor> {
    (!means.is_empty()).then(|| Tensor::stack(&means, 0).sum(Kind::Float) / layers as f64)
}

pub struct Llama {
    pub(crate) cfg: ModelConfig,
    embed_tokens: Tensor,
    pub(crate) layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Option<Linear>,
    /// The kind activations are computed in (bf16 or fp32).
    pub(crate) compute: Kind,
    /// The kernel library the attention layers use, None on the reference path.
    pub(crate) kernels: Option<&'static Kernels>,
    /// A sequence kept from one forward to the next (`pin_sequence`).
    pinned: RefCell<Option<Rc<Sequence>>>,
}

/// The masks and rotary angles of a whole sequence ([`Llama::sequence`]).
pub(crate) struct Sequence {
    pub(crate) masks: MaskCache,
    pub(crate) rope: Rope,
}

impl Llama {
    /// Creates the parameters under `vs` (initialised from tch's current seed), reading first
    /// what the method reads from files (static heads' ranking: `MethodSpec::fixed_heads`).
    pub(crate) fn new(
        vs: &nn::Path,
        cfg: &ModelConfig,
        attn: &AttentionConfig,
        compute: Kind,
    ) -> Result<Self> {
        let fixed_heads = (spec(attn.method).fixed_heads)(cfg, attn)?;
        let kernels = kernels::for_model(attn.attn_impl, vs.device(), compute, cfg.head_dim())?;
        let d = cfg.hidden_size as i64;
        let eps = cfg.rms_norm_eps;
        let model = vs / "model";
        let embed_tokens = (&model / "embed_tokens").var(
            "weight",
            &[cfg.vocab_size as i64, d],
            nn::Init::Randn {
                mean: 0.0,
                stdev: cfg.initializer_range,
            },
        );
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let p = &model / "layers" / i;
                let post = cfg.norm_placement == NormPlacement::Post;
                DecoderLayer {
                    input_layernorm: (!post).then(|| {
                        RmsNorm::new(&p / "input_layernorm", d, eps).with_kernels(kernels)
                    }),
                    self_attn: SelfAttention::new(
                        &p / "self_attn",
                        i,
                        cfg,
                        attn,
                        fixed_heads.as_ref().map(|f| f[i].as_slice()),
                        kernels,
                    ),
                    post_attention_layernorm: RmsNorm::new(&p / "post_attention_layernorm", d, eps)
                        .with_kernels(kernels),
                    post_feedforward_layernorm: post.then(|| {
                        RmsNorm::new(&p / "post_feedforward_layernorm", d, eps)
                            .with_kernels(kernels)
                    }),
                    mlp: Mlp::new(&p / "mlp", cfg, kernels),
                }
            })
            .collect();
        let lm_head = (!cfg.tie_word_embeddings).then(|| {
            Linear::new(
                vs / "lm_head",
                d,
                cfg.vocab_size as i64,
                false,
                cfg.initializer_range,
            )
        });
        Ok(Llama {
            cfg: cfg.clone(),
            embed_tokens,
            layers,
            norm: RmsNorm::new(&model / "norm", d, eps).with_kernels(kernels),
            lm_head,
            compute,
            kernels,
            pinned: RefCell::new(None),
        })
    }

    /// `(new, base)` names of parameters a method adds that start as copies of base ones.
    pub(crate) fn derived_params(&self) -> Vec<(String, String)> {
        self.layers
            .iter()
            .flat_map(|l| l.self_attn.derived_params())
            .collect()
    }

    /// Key-value cache bytes per layer at decode time for a context of `len` tokens.
    pub(crate) fn kv_cache_bytes(&self, len: usize) -> Vec<f64> {
        let elt = self.compute.elt_size_in_bytes();
        self.layers
            .iter()
            .map(|l| l.self_attn.kv_cache_bytes(len, elt))
            .collect()
    }

    /// `ids: [B, L]` int64 token ids.
    pub fn forward(&self, ids: &Tensor, ctx: &ForwardCtx) -> ForwardOutput {
        let seq = self.sequence(ids.size()[1], ids.device());
        self.run(ids, &seq.rope, |_| Keys::Chunk(&seq.masks), ctx, false)
    }

    /// The masks and rotary angles of a whole sequence of `len` tokens: the pinned ones where
    /// they are of this length and device, else built afresh (and dropped after the forward).
    pub(crate) fn sequence(&self, len: i64, device: Device) -> Rc<Sequence> {
        if let Some(seq) = self.pinned.borrow().as_ref() {
            if seq.masks.fits(len as usize, device) {
                return Rc::clone(seq);
            }
        }
        Rc::new(self.new_sequence(len, device))
    }

    fn new_sequence(&self, len: i64, device: Device) -> Sequence {
        Sequence {
            masks: MaskCache::new(len as usize, device),
            rope: Rope::new(len, &inv_freq(&self.cfg), self.compute, device),
        }
    }

    /// Keeps the masks and angles of sequences of `len` tokens on `device` for every later
    /// forward of that length, as each builds them lazily the first time: a forward captured
    /// as a CUDA graph (`StepGraph`) after an eager one copies nothing from the host.
    pub(crate) fn pin_sequence(&self, len: i64, device: Device) {
        *self.pinned.borrow_mut() = Some(Rc::new(self.new_sequence(len, device)));
    }

    /// An empty decoding cache for `forward_cached` of sequences reaching `capacity` tokens
    /// (prompt and generated), on `device`.
    pub(crate) fn new_cache(&self, capacity: i64, device: Device) -> ModelCache {
        let rope = Rope::new(capacity, &inv_freq(&self.cfg), self.compute, device);
        ModelCache {
            layers: self
                .layers
                .iter()
                .map(|l| RefCell::new(LayerCache::new(l.self_attn.keeps())))
                .collect(),
            state: CacheState::new(capacity, rope, self.kernels, device),
        }
    }

    /// The next `ids: [B, T]` after the tokens `cache` already holds: same outputs as the
    /// whole-sequence forward gives at those positions, computing only the new queries. A
    /// single token's step reads every position from the device (`CacheState`), so it can be
    /// captured as a CUDA graph and replayed.
    pub(crate) fn forward_cached(
        &self,
        ids: &Tensor,
        cache: &mut ModelCache,
        ctx: &ForwardCtx,
    ) -> ForwardOutput {
        self.extend_cache(ids, cache, ctx, false)
    }

    /// `forward_cached` with the logits of the chunk's last position alone (`[B, 1, vocab]`):
    /// a prompt's prefill before generation, whose other logits (a 16K prompt's, batch 8:
    /// 26 GB in fp32) nothing reads.
    pub(crate) fn prefill(
        &self,
        ids: &Tensor,
        cache: &mut ModelCache,
        ctx: &ForwardCtx,
    ) -> ForwardOutput {
        self.extend_cache(ids, cache, ctx, true)
    }

    fn extend_cache(
        &self,
        ids: &Tensor,
        cache: &mut ModelCache,
        ctx: &ForwardCtx,
        last_only: bool,
    ) -> ForwardOutput {
        let n = ids.size()[1];
        let rope = cache.state.rope(n);
        let out = {
            let (layers, state) = (&cache.layers, &cache.state);
            self.run(
                ids,
                &rope,
                |l| Keys::Cache {
                    cache: &layers[l],
                    state,
                },
                ctx,
                last_only,
            )
        };
        cache.state.advance(n);
        out
    }

    fn run<'a>(
        &self,
        ids: &Tensor,
        rope: &Rope,
        keys: impl Fn(usize) -> Keys<'a>,
        ctx: &ForwardCtx,
        last_only: bool,
    ) -> ForwardOutput {
        // Each block hands back its stream and the MLP's output apart: the next block's input
        // norm (the final norm after the last) adds them, in one launch where it can.
        let (mut h, mut delta) = (self.embed(ids), None);
        let mut outs = Vec::with_capacity(self.layers.len());
        for i in 0..self.layers.len() {
            let (next, d, attn) = self.block_parts(i, &h, delta.as_ref(), rope, &keys(i), ctx);
            (h, delta) = (next, Some(d));
            outs.push(attn);
        }
        let last = |t: Tensor| match last_only {
            true => t.narrow(1, t.size()[1] - 1, 1),
            false => t,
        };
        let hn = match delta {
            Some(d) => self.norm.add_forward(&last(h), &last(d)).1,
            None => self.final_norm(&last(h)),
        };
        let logits = self.logits(&hn);
        ForwardOutput {
            logits: match ctx.compute_logits {
                true => logits,
                false => upcast(&logits),
            },
            layers: outs,
        }
    }

    /// Token embeddings in the compute dtype: the first block's input.
    pub(crate) fn embed(&self, ids: &Tensor) -> Tensor {
        match cast_copy(&self.embed_tokens, self.compute) {
            // Decoding: rows of the table cast once.
            Some(table) => Tensor::embedding(&table, ids, -1, false, false),
            // Training: the rows gathered, then cast, so the gradient reaches the fp32 table
            // as rows, not as a dense table in the compute dtype.
            None => {
                Tensor::embedding(&self.embed_tokens, ids, -1, false, false).to_kind(self.compute)
            }
        }
    }

    /// Block `i` over its input `h`: the block's output and what its attention handed back.
    pub(crate) fn block(
        &self,
        i: usize,
        h: &Tensor,
        rope: &Rope,
        keys: &Keys,
        ctx: &ForwardCtx,
    ) -> (Tensor, AttnOutput) {
        let (h, delta, attn) = self.block_parts(i, h, None, rope, keys, ctx);
        (h + delta, attn)
    }

    /// Block `i` over the stream `h + delta` (the last block's MLP output not yet added):
    /// the block's output as `(stream, MLP output)`, and what its attention handed back. A
    /// pre-norm block adds each residual in the norm that follows it (one launch each way,
    /// `RmsNorm::add_forward`).
    fn block_parts(
        &self,
        i: usize,
        h: &Tensor,
        delta: Option<&Tensor>,
        rope: &Rope,
        keys: &Keys,
        ctx: &ForwardCtx,
    ) -> (Tensor, Tensor, AttnOutput) {
        let layer = &self.layers[i];
        let device = h.device();
        // Pre-norm: the layer reads the normalised stream and is handed the stream itself.
        let attend = |x: &Tensor, residual: Option<&Tensor>| match ctx.attention_seconds.get() {
            None => layer.self_attn.forward(x, residual, rope, keys, ctx),
            Some(spent) => {
                sync(device);
                let start = std::time::Instant::now();
                let out = layer.self_attn.forward(x, residual, rope, keys, ctx);
                sync(device);
                ctx.attention_seconds
                    .set(Some(spent + start.elapsed().as_secs_f64()));
                out
            }
        };
        match &layer.input_layernorm {
            Some(norm) => {
                let (h, x) = match delta {
                    Some(d) => norm.add_forward(h, d),
                    None => (h.shallow_clone(), norm.forward(h)),
                };
                let attn = attend(&x, Some(&h));
                let (h, x) = layer.post_attention_layernorm.add_forward(&h, &attn.y);
                let mlp = layer.mlp.forward(&x);
                (h, mlp, attn)
            }
            None => {
                let h = match delta {
                    Some(d) => h + d,
                    None => h.shallow_clone(),
                };
                let attn = attend(&h, None);
                let h = &h + layer.post_attention_layernorm.forward(&attn.y);
                let ff = layer
                    .post_feedforward_layernorm
                    .as_ref()
                    .expect("post-norm layer");
                let mlp = ff.forward(&layer.mlp.forward(&h));
                (h, mlp, attn)
            }
        }
    }

    /// The final RMSNorm, the head's input.
    pub(crate) fn final_norm(&self, h: &Tensor) -> Tensor {
        self.norm.forward(h)
    }

    /// The output projection's weight: the head's own, or the embedding where they are tied.
    pub(crate) fn head_weight(&self) -> &Tensor {
        match &self.lm_head {
            Some(head) => &head.weight,
            None => &self.embed_tokens,
        }
    }

    /// Logits in `hn`'s dtype of final-normed hidden states `hn`.
    pub(crate) fn logits(&self, hn: &Tensor) -> Tensor {
        hn.linear(&cast(self.head_weight(), hn.kind()), None::<Tensor>)
    }

    /// Key-value cache bytes of the same model with full attention in every layer, for one
    /// sequence of `len` tokens: the denominator of every cache-size ratio.
    pub(crate) fn full_kv_cache_bytes(&self, len: usize) -> f64 {
        let m = &self.cfg;
        (m.num_hidden_layers * len * 2 * m.num_key_value_heads * m.head_dim()) as f64
            * self.compute.elt_size_in_bytes() as f64
    }

    /// Full-causal (query, key) pairs over all layers and heads for a `[B, L]` input: the
    /// denominator of every attention-work ratio.
    pub(crate) fn full_pairs(&self, batch: usize, len: usize) -> f64 {
        (batch * self.cfg.num_attention_heads * self.cfg.num_hidden_layers) as f64
            * KeyPattern::Full.attended_pairs(len) as f64
    }
}

/// Waits for the work queued on `device` (nothing to wait for on the CPU).
pub(crate) fn sync(device: Device) {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

/// Names and shapes of a full-attention model's parameters, from its config alone (a
/// converter must check a multi-gigabyte checkpoint without building the model). The test
/// `manifest_matches_constructed_model` keeps this in step with the constructors above.
pub fn manifest(m: &ModelConfig) -> Vec<(String, Vec<i64>)> {
    let (d, f, v) = (
        m.hidden_size as i64,
        m.intermediate_size as i64,
        m.vocab_size as i64,
    );
    let (h, kv, hd) = (
        m.num_attention_heads as i64,
        m.num_key_value_heads as i64,
        m.head_dim() as i64,
    );
    let mut out: Vec<(String, Vec<i64>)> = vec![
        ("model.embed_tokens.weight".into(), vec![v, d]),
        ("model.norm.weight".into(), vec![d]),
    ];
    if !m.tie_word_embeddings {
        out.push(("lm_head.weight".into(), vec![v, d]));
    }
    for l in 0..m.num_hidden_layers {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        out.extend([
            (p("self_attn.q_proj.weight"), vec![h * hd, d]),
            (p("self_attn.k_proj.weight"), vec![kv * hd, d]),
            (p("self_attn.v_proj.weight"), vec![kv * hd, d]),
            (p("self_attn.o_proj.weight"), vec![d, h * hd]),
            (p("mlp.gate_proj.weight"), vec![f, d]),
            (p("mlp.up_proj.weight"), vec![f, d]),
            (p("mlp.down_proj.weight"), vec![d, f]),
            (p("post_attention_layernorm.weight"), vec![d]),
        ]);
        if m.attention_bias {
            out.extend([
                (p("self_attn.q_proj.bias"), vec![h * hd]),
                (p("self_attn.k_proj.bias"), vec![kv * hd]),
                (p("self_attn.v_proj.bias"), vec![kv * hd]),
            ]);
        }
        match m.qk_norm {
            QkNorm::None => {}
            QkNorm::PerHead => out.extend([
                (p("self_attn.q_norm.weight"), vec![hd]),
                (p("self_attn.k_norm.weight"), vec![hd]),
            ]),
            QkNorm::Full => out.extend([
                (p("self_attn.q_norm.weight"), vec![h * hd]),
                (p("self_attn.k_norm.weight"), vec![kv * hd]),
            ]),
        }
        match m.norm_placement {
            NormPlacement::Pre => out.push((p("input_layernorm.weight"), vec![d])),
            NormPlacement::Post => out.push((p("post_feedforward_layernorm.weight"), vec![d])),
        }
    }
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Method;
    use tch::Device;

    fn tiny(tie: bool, bias: bool) -> ModelConfig {
        ModelConfig {
            vocab_size: 11,
            hidden_size: 16,
            intermediate_size: 24,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            attention_bias: bias,
            tie_word_embeddings: tie,
            ..Default::default()
        }
    }

    #[test]
    fn parameter_names_follow_hugging_face() {
        let vs = nn::VarStore::new(Device::Cpu);
        let _m = Llama::new(
            &vs.root(),
            &tiny(false, true),
            &AttentionConfig::default(),
            Kind::Float,
        );
        let mut names: Vec<String> = vs.variables().into_keys().collect();
        names.sort();
        for want in [
            "model.embed_tokens.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.q_proj.bias",
            "model.layers.1.self_attn.k_proj.weight",
            "model.layers.1.self_attn.v_proj.bias",
            "model.layers.1.self_attn.o_proj.weight",
            "model.layers.0.mlp.gate_proj.weight",
            "model.layers.0.mlp.up_proj.weight",
            "model.layers.0.mlp.down_proj.weight",
            "model.layers.0.input_layernorm.weight",
            "model.layers.0.post_attention_layernorm.weight",
            "model.norm.weight",
            "lm_head.weight",
        ] {
            assert!(
                names.contains(&want.to_string()),
                "missing {want} in {names:?}"
            );
        }
        assert!(!names.iter().any(|n| n.contains("o_proj.bias")));
        assert_eq!(
            vs.variables()["model.layers.0.self_attn.k_proj.weight"].size(),
            vec![8, 16]
        );
        let vs = nn::VarStore::new(Device::Cpu);
        let _m = Llama::new(
            &vs.root(),
            &tiny(true, false),
            &AttentionConfig::default(),
            Kind::Float,
        );
        assert!(!vs.variables().contains_key("lm_head.weight"));
    }

    #[test]
    fn manifest_matches_constructed_model() {
        for (tie, bias, qk, post) in [
            (true, false, QkNorm::None, NormPlacement::Pre),
            (false, true, QkNorm::PerHead, NormPlacement::Pre),
            (false, false, QkNorm::Full, NormPlacement::Post),
        ] {
            let cfg = ModelConfig {
                qk_norm: qk,
                norm_placement: post,
                head_dim: 6,
                ..tiny(tie, bias)
            };
            let vs = nn::VarStore::new(Device::Cpu);
            let _m =
                Llama::new(&vs.root(), &cfg, &AttentionConfig::default(), Kind::Float).unwrap();
            let mut built: Vec<(String, Vec<i64>)> = vs
                .variables()
                .into_iter()
                .map(|(n, t)| (n, t.size()))
                .collect();
            built.sort();
            assert_eq!(
                built,
                manifest(&cfg),
                "tie={tie} bias={bias} {qk:?} {post:?}"
            );
        }
    }

    #[test]
    fn causal_and_window_respected_by_whole_model() {
        tch::manual_seed(1);
        let vs = nn::VarStore::new(Device::Cpu);
        let attn = AttentionConfig {
            method: Method::Swa,
            window: 3,
            ..Default::default()
        };
        let m = Llama::new(&vs.root(), &tiny(true, false), &attn, Kind::Float).unwrap();
        let a = Tensor::from_slice(&[1i64, 2, 3, 4, 5, 6, 7, 8]).view([1, 8]);
        let b = Tensor::from_slice(&[9i64, 2, 3, 4, 5, 6, 7, 10]).view([1, 8]);
        let (la, lb) = (
            m.forward(&a, &ForwardCtx::default()).logits,
            m.forward(&b, &ForwardCtx::default()).logits,
        );
        // Changing the first token cannot reach position 6 through two layers of window 3
        // (receptive field 1 + 2*2 = 5), and the last token changes nothing before it.
        let same = |i: i64| {
            la.get(0)
                .get(i)
                .allclose(&lb.get(0).get(i), 1e-6, 1e-6, false)
        };
        assert!(!same(0) && same(6) && same(5));
        assert!(!same(4));
        assert_eq!(
            m.forward(&a, &ForwardCtx::default()).attended_pairs(),
            (4 * 2) as f64 * KeyPattern::Window(3).attended_pairs(8) as f64
        );
    }

    /// The reference path on the GPU (fused causal kernel for full, masked SDPA otherwise)
    /// against the CPU, same weights, same input, for every method's examples (routers start
    /// at zero weight, so no gate sits near its threshold).
    #[test]
    #[ignore = "needs a CUDA GPU and the kernel library: run with --ignored on a GPU machine"]
    fn gpu_forward_matches_cpu() {
        assert!(
            tch::Cuda::is_available(),
            "gpu_forward_matches_cpu needs a CUDA device"
        );
        for e in crate::model::attention::all_methods().flat_map(|s| s.examples) {
            tch::manual_seed(3);
            let mut attn = AttentionConfig {
                window: 5,
                hybrid_every: 2,
                ..Default::default()
            };
            (e.set)(&mut attn);
            let cpu_vs = nn::VarStore::new(Device::Cpu);
            let cpu = Llama::new(&cpu_vs.root(), &tiny(false, true), &attn, Kind::Float).unwrap();
            let mut gpu_vs = nn::VarStore::new(Device::Cuda(0));
            let gpu = Llama::new(&gpu_vs.root(), &tiny(false, true), &attn, Kind::Float).unwrap();
            gpu_vs.copy(&cpu_vs).unwrap();
            let ids = Tensor::randint(11, [3, 37], (Kind::Int64, Device::Cpu));
            let want = cpu.forward(&ids, &ForwardCtx::default()).logits;
            let got = gpu
                .forward(&ids.to_device(Device::Cuda(0)), &ForwardCtx::default())
                .logits
                .to_device(Device::Cpu);
            let err = (&got - &want).abs().max().double_value(&[]);
            assert!(err < 1e-4, "{}: GPU differs from CPU by {err}", e.name);
        }
    }

    #[test]
    fn bf16_compute_tracks_fp32() {
        tch::manual_seed(2);
        let vs = nn::VarStore::new(Device::Cpu);
        let cfg = tiny(true, true);
        let m32 = Llama::new(&vs.root(), &cfg, &AttentionConfig::default(), Kind::Float).unwrap();
        let ids = Tensor::from_slice(&[1i64, 5, 3, 7, 2, 9]).view([1, 6]);
        let l32 = m32.forward(&ids, &ForwardCtx::default()).logits;
        let m16 = Llama {
            compute: Kind::BFloat16,
            ..m32
        };
        let l16 = m16.forward(&ids, &ForwardCtx::default()).logits;
        assert_eq!(l16.kind(), Kind::Float);
        let err = (l32 - l16).abs().max().double_value(&[]);
        assert!(err < 0.05, "bf16 drifted by {err}");
    }
}
