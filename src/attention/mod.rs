//! Attention: the layer every method shares, and one file per method.
//!
//! | file | what |
//! |---|---|
//! | `patterns.rs` | which keys a query sees under full, window and PPA attention; pair counts; masks |
//! | `gates.rs` | routers, thresholds, context-free gates, the straight-through estimator |
//! | `cache.rs` | where a layer's keys come from: the chunk, or a decoding cache |
//! | `aha.rs` | AHA (and static top-k heads): full or window per token and head |
//! | `l2a.rs` | L2A: a window, and a global module for routed tokens |
//! | `swiattn.rs` | SwiAttn: a full or a window branch per token, its adaptive regulariser |
//!
//! This file holds the layer: its projections (Hugging Face names), the choice of method,
//! and the one place that decides how attention runs (`SelfAttention::exec`): on the kernel
//! library, on the dense reference path (correct everywhere, the definition the kernels are
//! tested against), or decoding over a cache. Every method computes the same function on
//! each; the kernels only skip work whose result is multiplied by a hard zero.

mod aha;
mod cache;
mod gates;
mod l2a;
mod patterns;
mod swiattn;
#[cfg(test)]
mod tests;

pub use aha::{routed_pairs, routed_paths};
pub use cache::{Keys, LayerCache};
#[cfg(test)]
pub(crate) use gates::hash_uniform;
pub use gates::{straight_through, threshold, GateOverride};
pub use patterns::{attend, is_power_offset, layer_pattern, KeyPattern, MaskCache};
pub use swiattn::SwiAttnReg;

use crate::config::{AttentionConfig, Method, ModelConfig, NormPlacement, QkNorm, Router};
use crate::kernels::{kernel_for, Kernels};
use crate::nn::{Linear, RmsNorm, Rope};
use gates::GateSource;
use tch::{nn, Tensor};

/// Per-forward options that are not part of the model.
#[derive(Default)]
pub struct ForwardCtx {
    /// L2A: run global attention for every token this step (p_force).
    pub force_global: bool,
    pub gate_override: Option<GateOverride>,
    /// Seed of Bernoulli gates: each gate is a hash of (seed, layer, batch row, position,
    /// head), so a token's gate does not depend on how the sequence is cut into chunks.
    pub gate_seed: u64,
    /// Leave the logits in the compute dtype (training's fused loss reads them so) instead
    /// of fp32.
    pub compute_logits: bool,
    /// When Some, each attention layer's forward is timed, the device synchronised before
    /// and after it, and its seconds added here: the attention layers' share of a forward.
    /// The synchronisation slows the forward, so a forward's own time is taken without it.
    pub attention_seconds: std::cell::Cell<Option<f64>>,
}

/// A layer's regulariser before it is averaged over layers.
pub enum Regulariser {
    /// Finished per-layer term (AHA: lambda * mean s; L2A: lambda * mean d_hat^2).
    Term(Tensor),
    /// SwiAttn: gamma * softplus(r) needs the per-token NLL, known only after the forward.
    Adaptive {
        logits: Tensor,
        disagreement: Tensor,
        params: SwiAttnReg,
    },
}

impl Regulariser {
    /// The per-layer term; `nll: [B, L]` is the per-token language-model loss.
    pub fn term(&self, nll: &Tensor) -> Tensor {
        match self {
            Regulariser::Term(t) => t.shallow_clone(),
            Regulariser::Adaptive {
                logits,
                disagreement,
                params,
            } => params.term(logits, disagreement, nll),
        }
    }
}

/// What one attention layer hands back to the model.
pub struct AttnOutput {
    /// `[B, L, hidden]`, ready for the residual add.
    pub y: Tensor,
    /// Hard gates `[B, L, H]` (1 = full path; per-token methods repeat theirs over heads);
    /// None for static methods.
    pub gates: Option<Tensor>,
    /// Soft router scores `[B, L, H]` or `[B, L, 1]` when the gates come from a learned router.
    pub scores: Option<Tensor>,
    pub reg: Option<Regulariser>,
    /// (query, key) pairs of the path actually executed, summed over batch and query heads
    /// (a scalar tensor, so counting never waits for the device).
    pub pairs: Tensor,
}

/// Query, key, value and output projections of one attention module (HF names).
pub struct Projections {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    qk_norm: QkNorm,
    pub(super) n_heads: i64,
    n_kv_heads: i64,
    head_dim: i64,
}

impl Projections {
    fn new(p: &nn::Path, m: &ModelConfig) -> Self {
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
        let norm =
            |name: &str, dim: i64| (dim > 0).then(|| RmsNorm::new(p / name, dim, m.rms_norm_eps));
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

    /// `[B, H, L, D]` to `[B, L, H*D]`.
    pub(super) fn merge(&self, y: &Tensor, kernels: Option<&Kernels>) -> Tensor {
        let (b, _, l, _) = y.size4().expect("[B, H, L, D]");
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

    /// Bytes of keys and values kept per cached position.
    fn kv_bytes_per_position(&self, elt: usize) -> f64 {
        (2 * self.n_kv_heads * self.head_dim) as f64 * elt as f64
    }
}

/// What a method adds to the layer every method shares. Each method's file implements it
/// (`patterns.rs` for the static patterns) with a `build` function, and
/// `SelfAttention::new` picks the file by `attention.method`: a new method is a new file and
/// its arm there.
/// One forward's chunk: its input `x: [B, T, hidden]`, the projections `q, k, v` (the keys
/// already extended by a decoding cache), the rotary embedding of its positions and the keys'
/// bookkeeping.
#[derive(Clone, Copy)]
struct Chunk<'a, 'k> {
    x: &'a Tensor,
    q: &'a Tensor,
    k: &'a Tensor,
    v: &'a Tensor,
    rope: &'a Rope,
    keys: &'a Keys<'k>,
}

trait Route {
    /// The layer's output for the chunk `c`.
    fn forward(&self, layer: &SelfAttention, c: &Chunk, ctx: &ForwardCtx) -> AttnOutput;

    /// Bytes of the key-value cache decoding keeps for `len` tokens, where one position of
    /// the base attention takes `per_position` bytes and a value `elt`.
    fn kv_cache_bytes(
        &self,
        layer: &SelfAttention,
        len: usize,
        per_position: f64,
        elt: usize,
    ) -> f64;

    /// Parameters the method adds that start as copies of the base attention's, as `(new,
    /// base)` names below the layer's `self_attn.`.
    fn derived_params(&self) -> Vec<(String, String)> {
        Vec::new()
    }

    /// How far back the base attention's queries ever look, when that is a window (a decoding
    /// cache keeps only it); None when a query may read the whole prefix.
    fn window_only(&self, _layer: &SelfAttention) -> Option<usize> {
        None
    }

    /// The pattern of a static layer, None for routed ones.
    fn static_pattern(&self) -> Option<KeyPattern> {
        None
    }
}

/// What a method's `build` makes its part of a layer from.
struct Build<'a> {
    /// `model.layers.N.self_attn`.
    p: &'a nn::Path<'a>,
    layer: usize,
    m: &'a ModelConfig,
    a: &'a AttentionConfig,
    /// static_heads: this layer's heads, true where always full.
    fixed_heads: Option<&'a [bool]>,
    kernels: Option<&'static Kernels>,
}

impl Build<'_> {
    /// The source of `outputs` gates a token: context-free draws under `attention.router =
    /// "bernoulli"`, else a learned router (`self_attn.router`) whose weight starts at zero,
    /// with a bias starting at `bias` if any, opening where `s > tau` (`s >= tau` when
    /// `inclusive`). `reads_hidden`: it reads the layer's hidden state (AHA, SwiAttn), not a
    /// module's output (L2A), and so gets an RMSNorm of its own in a post-norm model.
    fn gates(
        &self,
        outputs: i64,
        bias: Option<f64>,
        inclusive: bool,
        reads_hidden: bool,
    ) -> GateSource {
        let (p, m, a) = (self.p, self.m, self.a);
        if a.router == Router::Bernoulli {
            return GateSource::Bernoulli(a.bernoulli_p);
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

/// One attention layer of any method, with Hugging Face parameter names for the base
/// module; parameters a method adds sit beside them (`router`, `global_attn.*`, `swa_o_proj`).
pub struct SelfAttention {
    proj: Projections,
    route: Box<dyn Route>,
    window: usize,
    /// AHA: `attention.ste_sample`.
    ste_sample: f64,
    layer: usize,
    prefix: String,
    /// The kernel library computing window and sparse-query attention; None: reference path.
    kernels: Option<&'static Kernels>,
}

/// How a layer's attention runs for one call, decided in `SelfAttention::exec` and nowhere
/// else: on the kernel library over the chunk's own keys (with the forward's masks and
/// offset lists), on the dense reference path over them, or decoding over a cache (the
/// reference path, masked by the cached positions).
#[derive(Clone, Copy)]
enum Exec<'a> {
    Kernels(&'static Kernels, &'a MaskCache),
    Reference,
    Decode,
}

const KERNEL_FAILED: &str = "attention kernel failed on inputs the model validated";

impl SelfAttention {
    /// `p` is `model.layers.N.self_attn`; `fixed_heads` the static_heads assignment of this
    /// layer.
    pub fn new(
        p: nn::Path,
        layer: usize,
        m: &ModelConfig,
        a: &AttentionConfig,
        fixed_heads: Option<&[bool]>,
        kernels: Option<&'static Kernels>,
    ) -> Self {
        // The base projections first: parameters draw their initial values from tch's
        // generator in the order they are created.
        let proj = Projections::new(&p, m);
        let build = Build {
            p: &p,
            layer,
            m,
            a,
            fixed_heads,
            kernels,
        };
        let route = match a.method {
            Method::Full | Method::Swa | Method::Ppa | Method::StaticHybrid => {
                patterns::build(&build)
            }
            Method::Aha | Method::StaticHeads => aha::build(&build),
            Method::L2a => l2a::build(&build),
            Method::Swiattn => swiattn::build(&build),
        };
        SelfAttention {
            proj,
            route,
            window: a.window,
            ste_sample: a.ste_sample,
            layer,
            prefix: format!("model.layers.{layer}.self_attn"),
            kernels,
        }
    }

    /// `pattern` for every query of the chunk: windows and PPA go to the kernels where they
    /// run (`exec`).
    fn attend_all(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        pattern: KeyPattern,
        keys: &Keys,
        slot: usize,
    ) -> Tensor {
        match (self.exec(keys), pattern) {
            (Exec::Kernels(kern, _), KeyPattern::Window(w)) => kern
                .list_attention(q, k, v, None, w as i64)
                .expect(KERNEL_FAILED),
            (Exec::Kernels(kern, masks), KeyPattern::Ppa { window, .. }) => {
                match masks.ppa_offsets(pattern) {
                    None => kern.list_attention(q, k, v, None, window as i64),
                    Some(offsets) => kern.ppa_attention(q, k, v, window as i64, &offsets),
                }
                .expect(KERNEL_FAILED)
            }
            _ => keys.attend(slot, q, k, v, pattern),
        }
    }

    /// Parameters a method adds that start as copies of base parameters, `(new, base)`:
    /// L2A's global module and SwiAttn's window-branch output projection.
    pub fn derived_params(&self) -> Vec<(String, String)> {
        let p = &self.prefix;
        self.route
            .derived_params()
            .into_iter()
            .map(|(new, base)| (format!("{p}.{new}"), format!("{p}.{base}")))
            .collect()
    }

    /// Bytes of the key-value cache this layer needs for a context of `len` tokens at
    /// decode time (`elt` bytes per value).
    pub fn kv_cache_bytes(&self, len: usize, elt: usize) -> f64 {
        let per = self.proj.kv_bytes_per_position(elt);
        self.route.kv_cache_bytes(self, len, per, elt)
    }

    /// Where this call runs: see `Exec`.
    fn exec<'a>(&self, keys: &Keys<'a>) -> Exec<'a> {
        match (self.kernels, keys) {
            (Some(kern), Keys::Chunk(masks)) => Exec::Kernels(kern, masks),
            (None, Keys::Chunk(_)) => Exec::Reference,
            (_, Keys::Cache { .. }) => Exec::Decode,
        }
    }

    /// `x: [B, T, hidden]` (already normalised in a pre-norm model), the chunk of positions
    /// `keys.start() ..`; `rope` covers those positions. The method's file computes the rest.
    pub fn forward(&self, x: &Tensor, rope: &Rope, keys: &Keys, ctx: &ForwardCtx) -> AttnOutput {
        let l = x.size()[1];
        let start = keys.start();
        let (q, k, v) = self.proj.qkv(x, rope, self.kernels);
        let (k, v) = keys.extend(0, k, v);
        let chunk = Chunk {
            x,
            q: &q,
            k: &k,
            v: &v,
            rope,
            keys,
        };
        let out = self.route.forward(self, &chunk, ctx);
        // Keys that no later query can reach through this layer's window are dropped.
        if let Some(w) = self.route.window_only(self) {
            keys.trim(0, w, start + l);
        }
        out
    }

    /// The pattern of a static layer, None for routed ones.
    pub fn static_pattern(&self) -> Option<KeyPattern> {
        self.route.static_pattern()
    }
}
