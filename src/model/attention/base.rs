//! What every method builds on: the base projections, one forward's chunk, how a call runs
//! (`Base::exec`: kernels, the reference path, or decoding over a cache), and the `Route` a
//! method implements for its part of the layer (its facts are its `MethodSpec`, `spec.rs`).

use super::cache::Keys;
use super::ctx::ForwardCtx;
use super::gates::GateSource;
use super::patterns::{Keep, KeyPattern, MaskCache};
use crate::config::{AttentionConfig, ModelConfig, NormPlacement, QkNorm, Router};
use crate::model::kernels::{kernel_for, Kernels};
use crate::model::nn::{joined, Linear, RmsNorm, Rope};
use tch::{nn, Tensor};

/// A layer's regulariser before it is averaged over layers.
pub(crate) enum Regulariser {
    /// Finished per-layer term (AHA: lambda * mean s; L2A: lambda * mean d_hat^2).
    Term(Tensor),
    /// A term that needs the per-token language-model loss `nll: [B, L]`, known only after
    /// the forward (SwiAttn's adaptive weight).
    PerToken(Box<dyn Fn(&Tensor) -> Tensor>),
}

impl Regulariser {
    /// The per-layer term; `nll: [B, L]` is the per-token language-model loss.
    pub(crate) fn term(&self, nll: &Tensor) -> Tensor {
        match self {
            Regulariser::Term(t) => t.shallow_clone(),
            Regulariser::PerToken(term) => term(nll),
        }
    }
}

/// What one attention layer hands back to the model.
pub(crate) struct AttnOutput {
    /// `[B, L, hidden]`, ready for the residual add.
    pub(crate) y: Tensor,
    /// Hard gates `[B, L, H]` (1 = full path; per-token methods repeat theirs over heads);
    /// None for static methods.
    pub(crate) gates: Option<Tensor>,
    /// Soft router scores `[B, L, H]` or `[B, L, 1]` when the gates come from a learned router.
    pub(crate) scores: Option<Tensor>,
    pub(crate) reg: Option<Regulariser>,
    /// (query, key) pairs of the path actually executed, summed over batch and query heads
    /// (a scalar tensor, so counting never waits for the device).
    pub(crate) pairs: Tensor,
}

/// Query, key, value and output projections of one attention module (HF names).
pub(crate) struct Projections {
    pub(super) q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    pub(super) q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    qk_norm: QkNorm,
    pub(super) n_heads: i64,
    n_kv_heads: i64,
    head_dim: i64,
}

impl Projections {
    /// `kernels`: the library the q/k norms run on (the fused RMSNorm), None on the reference
    /// path.
    pub(super) fn new(p: &nn::Path, m: &ModelConfig, kernels: Option<&'static Kernels>) -> Self {
        let (h, kv, hd) = (
            m.num_attention_heads as i64,
            m.num_key_value_heads as i64,
            m.head_dim() as i64,
        );
        let (d, std, bias) = (m.hidden_size as i64, m.initializer_range, m.attention_bias);
        // Qwen3 normalises each head (weights over head_dim), OLMo-2 the whole projection.
        let (qn, kn) = match m.qk_norm {
            QkNorm::None => (0, 0),
            QkNorm::PerHead => (hd, hd),
            QkNorm::Full => (h * hd, kv * hd),
        };
        let norm = |name: &str, dim: i64| {
            (dim > 0).then(|| RmsNorm::new(p / name, dim, m.rms_norm_eps).with_kernels(kernels))
        };
        Projections {
            q_proj: Linear::new(p / "q_proj", d, h * hd, bias, std),
            k_proj: Linear::new(p / "k_proj", d, kv * hd, bias, std),
            v_proj: Linear::new(p / "v_proj", d, kv * hd, bias, std),
            o_proj: Linear::new(p / "o_proj", h * hd, d, false, std),
            q_norm: norm("q_norm", qn),
            k_norm: norm("k_norm", kn),
            qk_norm: m.qk_norm,
            n_heads: h,
            n_kv_heads: kv,
            head_dim: hd,
        }
    }

    /// `x: [B, L, hidden]` to rotated `q: [B, H, L, D]` and `k, v: [B, Hkv, L, D]`.
    pub(super) fn qkv(
        &self,
        x: &Tensor,
        rope: &Rope,
        kernels: Option<&Kernels>,
    ) -> (Tensor, Tensor, Tensor) {
        let (b, l, _) = x.size3().expect("attention input is [B, L, hidden]");
        let split = |t: Tensor, n: i64| t.view([b, l, n, self.head_dim]);
        let normed = |t: Tensor, n: i64, norm: &Option<RmsNorm>| match (self.qk_norm, norm) {
            (QkNorm::Full, Some(nm)) => split(nm.forward(&t), n),
            (QkNorm::PerHead, Some(nm)) => nm.forward(&split(t, n)),
            _ => split(t, n),
        };
        let q = rope.apply_transposed(
            &normed(self.q_proj.forward(x), self.n_heads, &self.q_norm),
            kernels,
        );
        let k = rope.apply_transposed(
            &normed(self.k_proj.forward(x), self.n_kv_heads, &self.k_norm),
            kernels,
        );
        // The kernels read v contiguous: the move makes it so once here, not in each of a
        // layer's launches.
        let v = split(self.v_proj.forward(x), self.n_kv_heads);
        let v = match kernel_for(kernels, &v) {
            Some(k) => k.to_heads(&v).expect("head transpose kernel on v"),
            None => v.transpose(1, 2),
        };
        (q, k, v)
    }

    /// A decoding step's `(q, k, v)` (`qkv`'s shapes, the keys and values those of the cache
    /// slot) where the step runs on the kernels (`Keys::step_kernels`): the three projections
    /// as one product of their joined weights, then rotations and cache writes in one launch
    /// (`Keys::write_step`). None elsewhere, and for q/k norms, which come between.
    pub(super) fn step(
        &self,
        x: &Tensor,
        rope: &Rope,
        keys: &Keys,
        kernels: Option<&'static Kernels>,
    ) -> Option<(Tensor, Tensor, Tensor)> {
        if self.qk_norm != QkNorm::None {
            return None;
        }
        let kern = keys.step_kernels(x, kernels)?;
        let (w, b) = joined(&[&self.q_proj, &self.k_proj, &self.v_proj], x.kind())?;
        let qkv = x.linear(&w, b.as_ref());
        Some(keys.write_step(0, kern, &qkv, self.n_heads, rope))
    }

    /// `[B, H, L, D]` to `[B, L, H*D]`.
    pub(super) fn merge(&self, y: &Tensor, kernels: Option<&Kernels>) -> Tensor {
        let (b, _, l, _) = y.size4().expect("[B, H, L, D]");
        if l == 1 {
            // One position (a decoding step): the two layouts hold the same order.
            return y.reshape([b, 1, self.n_heads * self.head_dim]);
        }
        let y = match kernel_for(kernels, y) {
            Some(k) => k
                .from_heads(y)
                .expect("head transpose kernel on the output"),
            None => y.transpose(1, 2),
        };
        y.reshape([b, l, self.n_heads * self.head_dim])
    }

    pub(super) fn out(&self, y: &Tensor, kernels: Option<&Kernels>) -> Tensor {
        self.o_proj.forward(&self.merge(y, kernels))
    }

    /// The output projection at zero (under no gradient): a module that adds nothing until it
    /// has trained.
    pub(super) fn zero_output(&self) {
        tch::no_grad(|| {
            let _ = self.o_proj.weight.shallow_clone().zero_();
        });
    }

    /// Bytes of keys and values kept per cached position.
    pub(super) fn kv_bytes_per_position(&self, elt: usize) -> f64 {
        (2 * self.n_kv_heads * self.head_dim) as f64 * elt as f64
    }
}

/// Parameters of one set of projections (q, k, v, o with their biases and q/k norms where the
/// model has them): one layer's base attention, or a module that copies it.
pub(crate) fn projection_params(m: &ModelConfig) -> f64 {
    let (d, hd) = (m.hidden_size as f64, m.head_dim() as f64);
    let (q, kv) = (
        m.num_attention_heads as f64 * hd,
        m.num_key_value_heads as f64 * hd,
    );
    let bias = if m.attention_bias { q + 2.0 * kv } else { 0.0 };
    let qk_norm = match m.qk_norm {
        QkNorm::None => 0.0,
        QkNorm::PerHead => 2.0 * hd,
        QkNorm::Full => q + kv,
    };
    d * q + 2.0 * d * kv + q * d + bias + qk_norm
}

/// One forward's chunk: its input `x: [B, T, hidden]`, the projections `q, k, v` (the keys
/// already extended by a decoding cache), the rotary embedding of its positions and the keys'
/// bookkeeping.
#[derive(Clone, Copy)]
pub(super) struct Chunk<'a, 'k> {
    pub(crate) x: &'a Tensor,
    /// The residual stream the block adds this layer's output to: `x` before the block's
    /// input norm in a pre-norm model, `x` itself in a post-norm one.
    pub(crate) residual: &'a Tensor,
    pub(crate) q: &'a Tensor,
    pub(crate) k: &'a Tensor,
    pub(crate) v: &'a Tensor,
    pub(crate) rope: &'a Rope,
    pub(crate) keys: &'a Keys<'k>,
}

/// What a method adds to the layer every method shares (`Base`): each method's file implements
/// it and builds it from its `MethodSpec::build`.
pub(super) trait Route {
    /// The layer's output for the chunk `c`.
    fn forward(&self, layer: &Base, c: &Chunk, ctx: &ForwardCtx) -> AttnOutput;

    /// Which keys each slot of its decoding cache keeps for the queries still to come (slot
    /// 0 the base attention's keys; a module of its own, as L2A's global one, adds slot 1):
    /// what the cache holds and its reported bytes.
    fn keeps(&self, layer: &Base) -> Vec<Keep>;

    /// Parameters the method adds that start as copies of base parameters, as `(new, base)`
    /// names below the layer's `model.layers.N.`.
    fn derived_params(&self) -> Vec<(String, String)> {
        Vec::new()
    }
}

/// What a method's `build` makes its part of a layer from.
pub(super) struct Build<'a> {
    /// `model.layers.N.self_attn`.
    pub(crate) p: &'a nn::Path<'a>,
    pub(crate) layer: usize,
    pub(crate) m: &'a ModelConfig,
    pub(crate) a: &'a AttentionConfig,
    /// This layer's heads, each always-full head's place in the ranking it was chosen by, for
    /// a method that reads a fixed per-head assignment (`MethodSpec::fixed_heads`).
    pub(crate) fixed_heads: Option<&'a [Option<usize>]>,
    pub(crate) kernels: Option<&'static Kernels>,
}

impl Build<'_> {
    /// The source of `outputs` gates a token: context-free draws under `attention.router =
    /// "bernoulli"`, else a learned router (`self_attn.router`) whose weight starts at zero,
    /// with a bias starting at `bias` if any, opening where `s > tau` (`s >= tau` when
    /// `inclusive`). `reads_hidden`: it reads the layer's hidden state (AHA, SwiAttn), and so gets
    /// an RMSNorm of its own in a post-norm model; L2A's reads what its own norm gives it.
    pub(super) fn gates(
        &self,
        outputs: i64,
        bias: Option<f64>,
        inclusive: bool,
        reads_hidden: bool,
    ) -> GateSource {
        let (p, m, a) = (self.p, self.m, self.a);
        if a.router == Router::Bernoulli {
            // This layer's rates, one a gate or one for all (the config refuses other
            // lengths), else the one rate everywhere.
            let rates = a
                .bernoulli_rates
                .get(self.layer)
                .cloned()
                .unwrap_or_else(|| vec![a.bernoulli_p]);
            // On the device once: a decoding step captured as a graph copies nothing from the
            // host.
            let rates = Tensor::from_slice(&rates).to_device(p.device());
            return GateSource::Bernoulli(rates);
        }
        let d = m.hidden_size as i64;
        let rp = p / "router";
        let weight = rp.var("weight", &[outputs, d], nn::Init::Const(0.0));
        let bias = bias.map(|b| rp.var("bias", &[outputs], nn::Init::Const(b)));
        let norm = (reads_hidden && m.norm_placement == NormPlacement::Post)
            .then(|| RmsNorm::new(p / "router_norm", d, m.rms_norm_eps).with_kernels(self.kernels));
        GateSource::Learned {
            router: Linear { weight, bias },
            norm,
            tau: a.tau,
            inclusive,
            lambda: a.lambda,
        }
    }
}

/// The layer every method shares: its base projections, window, position in the model and the
/// kernel library (None: the reference path).
pub(super) struct Base {
    pub(crate) proj: Projections,
    pub(crate) window: usize,
    pub(crate) layer: usize,
    pub(crate) kernels: Option<&'static Kernels>,
}

/// How a layer's attention runs for one call, decided in `Base::exec` and nowhere
/// else: on the kernel library over the chunk's own keys (with the forward's masks and
/// offset lists), on the dense reference path over them, or decoding over a cache (the
/// reference path, masked by the cached positions).
#[derive(Clone, Copy)]
pub(super) enum Exec<'a> {
    Kernels(&'static Kernels, &'a MaskCache),
    Reference,
    Decode,
}

impl Base {
    /// Where this call runs: see `Exec`.
    pub(crate) fn exec<'a>(&self, keys: &Keys<'a>) -> Exec<'a> {
        match (self.kernels, keys) {
            (Some(kern), Keys::Chunk(masks)) => Exec::Kernels(kern, masks),
            (None, Keys::Chunk(_)) => Exec::Reference,
            (_, Keys::Cache { .. }) => Exec::Decode,
        }
    }

    /// `pattern` for every query of the chunk: the patterns with kernels of their own
    /// (`KeyPattern::on_kernels`) go to them where they run (`exec`).
    pub(crate) fn attend_all(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        pattern: KeyPattern,
        keys: &Keys,
        slot: usize,
    ) -> Tensor {
        let on_kernels = match (self.exec(keys), self.kernels) {
            (Exec::Kernels(kern, masks), _) => pattern.on_kernels(kern, masks, q, k, v),
            // A prefill into an empty cache attends over the chunk alone, as a forward does:
            // the kernels take it (the cached path builds a window's mask; at 32K that was
            // 12-19x the forward's time).
            (Exec::Decode, Some(kern)) if keys.prefill_only() => {
                let masks = MaskCache::new(q.size()[2] as usize, q.device());
                pattern.on_kernels(kern, &masks, q, k, v)
            }
            _ => None,
        };
        on_kernels.unwrap_or_else(|| keys.attend(slot, q, k, v, pattern))
    }
}
